//! # zero-candle
//!
//! The Candle adapter of zero-rs: [`ZeroOptimizer`] implements
//! [`candle_nn::Optimizer`], so a ZeRO sharded optimizer drops into any
//! Candle training loop. Backends come with features: the in-process
//! thread backend always, `mpi` for processes across machines, `nccl` for
//! GPUs: `ZeroOptimizer<NcclComm>` (`NcclZeroOptimizer`, feature `nccl`; or
//! `ZeroOptimizer<CudaThreadComm>`, ranks as threads sharing a GPU) trains a Candle model on
//! CUDA with the engine's buffers in GPU memory, gradients and parameters
//! staying on the GPU. [`nn`] has candle-nn's layers rebuilt so that their
//! parameter gradients leave `backward()` through a hook as they are computed.
//!
//! A first program (`zero-candle/examples/quickstart.rs`; run it with
//! `cargo run --release -p zero-candle --example quickstart`):
//!
//! ```
#![doc = include_str!("../examples/quickstart.rs")]
//! ```
#![warn(missing_docs)]

mod error;
mod hook;
pub mod hub;
pub mod init;
pub mod memory;
pub mod models;
#[cfg(feature = "nccl")]
mod nccl;
pub mod nn;
mod optimizer;
mod params;
mod precision;
pub mod recompute;
mod stage3;

pub use error::{Error, Result};
pub use hook::ZeroHook;
pub use init::{ParamSource, SafetensorsInit, SeededInit, ShardedVarMap};
pub use memory::CandleMemory;
pub use optimizer::{ZeroConfig, ZeroOptimizer};
pub use params::VarStore;
pub use precision::is_half;
pub use recompute::checkpoint;
pub use stage3::holds_values;

#[cfg(feature = "nccl")]
pub use nccl::{NcclZeroConfig, NcclZeroOptimizer};
