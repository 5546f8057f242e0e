//! # zero-nccl
//!
//! The CUDA fast path of zero-rs (feature `nccl`): an NCCL communicator over
//! device buffers, and fused CUDA kernels for the engine. Being written.
#![warn(missing_docs)]
