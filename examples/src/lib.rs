//! Shared code of the zero-rs trainers and benchmarks.

pub mod bench;
pub mod heap;
pub mod optimizers;
pub mod trainer;
