//! Shared code of the zero-rs trainers and benchmarks.

pub mod bench;
pub mod optimizers;
pub mod trainer;
