//! # zero-core
//!
//! ZeRO (Zero Redundancy Optimizer) sharded data parallelism without a
//! framework: the [`Communicator`], [`Partitioner`] and
//! [`FunctionalOptimizer`] traits, the engine for stages 0-3, built-in
//! optimizers that match `torch.optim`, checkpoints, [`Preemption`] (stop
//! every rank at the same step on a signal), and [`ThreadGroup`], an
//! in-process backend that needs nothing installed.
//!
//! Candle users want `zero_candle::ZeroOptimizer`, built on this crate. The
//! engine alone, over parameters held in plain vectors: two ranks (threads)
//! each compute a gradient of their half of the batch, and the step applies
//! their mean to every rank's copy, each rank keeping half of the optimizer
//! state (stage 2).
//!
//! ```
//! use zero_core::engine::HostGrad;
//! use zero_core::{DType, Engine, EngineConfig, ParamInfo, Sgd, SgdConfig, ThreadGroup};
//!
//! let results = ThreadGroup::new(2).run(|comm| -> zero_core::Result<Vec<Vec<f32>>> {
//!     let rank = zero_core::Communicator::rank(&comm);
//!     let params = vec![ParamInfo::new("w", vec![3], DType::F32)];
//!     let sgd = Box::new(Sgd::<f32>::new(SgdConfig::default().with_lr(0.5))?);
//!     let mut engine = Engine::new(comm, params, sgd, EngineConfig::default())?;
//!     let mut weights = vec![vec![1.0f32, 2.0, 3.0]];
//!     // This rank's gradient; the engine averages them over the ranks.
//!     let grad = vec![rank as f32; 3];
//!     let slots = [Some(HostGrad::from(&grad))];
//!     engine.step(&slots, &mut weights)?;
//!     Ok(weights)
//! });
//! for result in results {
//!     // The mean gradient is 0.5: w - 0.5 * 0.5 on every rank.
//!     assert_eq!(result??, vec![vec![0.75, 1.75, 2.75]]);
//! }
//! # Ok::<(), zero_core::Error>(())
//! ```
#![warn(missing_docs)]

pub mod checkpoint;
pub mod comm;
mod dtype;
pub mod engine;
mod error;
pub mod optim;
pub mod partition;
pub mod preempt;

pub use comm::{Communicator, Host, MemoryKind, ReduceOp, ThreadComm, ThreadGroup, Work};
pub use dtype::{DType, Element};
pub use engine::{Engine, EngineConfig, MemoryReport, ParamStore, SaveOptions, Stage, StepReport};
pub use error::{Error, Result};
pub use optim::{
    Adagrad, AdagradConfig, Adam, AdamConfig, AdamW, AdamWConfig, FunctionalOptimizer, RmsProp,
    RmsPropConfig, Sgd, SgdConfig,
};
pub use partition::{Flat, Greedy, Interleaved, ParamInfo, PartitionPlan, Partitioner};
pub use preempt::Preemption;
/// The serde this crate uses, for a custom optimizer's configuration
/// (`#[serde(crate = "zero_core::serde")]`).
pub use serde;
/// The JSON map [`optim::Hyperparams`] is made of.
pub use serde_json;

/// The most used items, for `use zero_core::prelude::*`.
pub mod prelude {
    pub use crate::comm::{Communicator, ReduceOp, ThreadGroup};
    pub use crate::optim::{
        Adagrad, AdagradConfig, Adam, AdamConfig, AdamW, AdamWConfig, FunctionalOptimizer, LrDecay,
        LrSchedule, ParamKey, ParamMut, RmsProp, RmsPropConfig, Sgd, SgdConfig,
    };
    pub use crate::partition::{Flat, Greedy, Interleaved, ParamInfo, Partitioner};
    pub use crate::preempt::Preemption;
    pub use crate::{DType, Element, Error, Result};
}
