//! Shared code of the zero-rs trainers and benchmarks.

pub mod bench;
