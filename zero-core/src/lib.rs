//! # zero-core
//!
//! ZeRO (Zero Redundancy Optimizer) sharded data parallelism without a
//! framework: the [`Communicator`], [`Partitioner`] and
//! [`FunctionalOptimizer`] traits, the engine for stages 0-3, built-in
//! optimizers that match `torch.optim`, checkpoints, and [`ThreadGroup`], an
//! in-process backend that needs nothing installed.
#![warn(missing_docs)]

pub mod checkpoint;
pub mod comm;
mod dtype;
pub mod engine;
mod error;
pub mod optim;
pub mod partition;

pub use comm::{Communicator, Host, MemoryKind, ReduceOp, ThreadComm, ThreadGroup, Work};
pub use dtype::{DType, Element};
pub use engine::{Engine, EngineConfig, MemoryReport, ParamStore, SaveOptions, Stage, StepReport};
pub use error::{Error, Result};
pub use optim::{
    Adagrad, AdagradConfig, Adam, AdamConfig, AdamW, AdamWConfig, FunctionalOptimizer, RmsProp,
    RmsPropConfig, Sgd, SgdConfig,
};
pub use partition::{Flat, Greedy, Interleaved, ParamInfo, PartitionPlan, Partitioner};

/// The most used items, for `use zero_core::prelude::*`.
pub mod prelude {
    pub use crate::comm::{Communicator, ReduceOp, ThreadGroup};
    pub use crate::optim::{
        Adagrad, AdagradConfig, Adam, AdamConfig, AdamW, AdamWConfig, FunctionalOptimizer,
        ParamKey, ParamMut, RmsProp, RmsPropConfig, Sgd, SgdConfig,
    };
    pub use crate::partition::{Flat, Greedy, Interleaved, ParamInfo, Partitioner};
    pub use crate::{DType, Element, Error, Result};
}
