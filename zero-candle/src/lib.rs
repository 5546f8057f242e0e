//! # zero-candle
//!
//! The Candle adapter of zero-rs: [`ZeroOptimizer`] implements
//! [`candle_nn::Optimizer`], so a ZeRO sharded optimizer drops into any
//! Candle training loop. Backends come with features: the in-process
//! thread backend always, `mpi` for processes across machines, `nccl` for
//! GPUs.
#![warn(missing_docs)]

mod error;
mod optimizer;
mod params;

pub use error::{Error, Result};
pub use optimizer::{ZeroConfig, ZeroOptimizer};
pub use params::VarStore;
