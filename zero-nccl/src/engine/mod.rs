//! [`DeviceEngine`]: ZeRO stages 0-2 on GPU buffers over NCCL.
//!
//! The same plan, bucket-major layout and collective order as the host
//! engine of `zero-core` (both build them with
//! [`ShardSetup`](zero_core::engine::ShardSetup)), with every buffer in
//! device memory and every element-wise pass a fused kernel:
//!
//! - flatten: one launch per bucket copies (or, accumulating, adds) the
//!   gradients' pieces into the bucket;
//! - reduce: `ncclAllReduce` (stage 0) or `ncclReduceScatter` per bucket;
//! - step: one optimizer launch per bucket (more only where pieces differ in
//!   parameter group or step count, see [`segments`]);
//! - gather: `ncclAllGather` per bucket, then one device copy per parameter
//!   run into the framework's parameters.
//!
//! Everything is queued on the compute stream (collectives on the
//! communicator's stream, ordered by events), so a step does not block the
//! host, except where a value is needed on the host: the per-step
//! trainability check (one small all-reduce, skipped with
//! `check_trainability = false`) and gradient clipping or norms.
//!
//! The optimizer is described by a host optimizer of `zero-core` (its kind
//! and hyperparameters, so groups, learning-rate schedules and validation
//! behave as on the host); its state lives on the device.

pub mod segments;

#[cfg(feature = "nccl")]
mod device;
#[cfg(feature = "cuda")]
mod optimizer;

#[cfg(feature = "nccl")]
pub use device::{DeviceEngine, DeviceParams};
#[cfg(feature = "cuda")]
pub use optimizer::DEVICE_KINDS;
