//! `CudaMemory`: the engine's buffers in GPU memory, over NCCL.
//!
//! `zero-core`'s one [`Engine`](zero_core::Engine) runs the stage logic
//! (plan, buckets, trainability, accumulation, clipping, checkpoints); this
//! module implements its memory seam,
//! [`ShardMemory`](zero_core::engine::ShardMemory), with every buffer in
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
//! Everything is queued on the communicator's compute stream (collectives
//! on its own stream, ordered by events), so a step does not block the
//! host, except where a value is needed on the host: the per-step
//! trainability check (one small all-reduce, skipped with
//! `check_trainability = false`) and gradient clipping or norms. Those
//! waits, and the copies of checkpoints, are bounded by the communicator's
//! deadline: a dead or frozen peer is an error, never a hang.
//!
//! The optimizer is described by a built-in optimizer of `zero-core` (its
//! kind and hyperparameters, so groups, learning-rate schedules and
//! validation behave as on the host); its state lives on the device as flat
//! buffers over the shard, and crosses to the host only for checkpoints, in
//! the host optimizers' format.

pub mod pieces;
pub mod segments;

#[cfg(feature = "nccl")]
mod cuda;
#[cfg(feature = "nccl")]
mod gathers;
#[cfg(feature = "nccl")]
mod pinned;
// Its device optimizer serves `CudaMemory` (feature `nccl`); `cuda` alone
// uses only `DEVICE_KINDS`.
#[cfg(feature = "cuda")]
#[cfg_attr(not(feature = "nccl"), allow(dead_code))]
mod optimizer;
#[cfg(feature = "cuda")]
mod view;

#[cfg(feature = "nccl")]
pub use cuda::{cuda_engine, CudaEngine, CudaMemory, DeviceParams};
#[cfg(feature = "nccl")]
pub use gathers::{DeviceGather, DeviceGathers, GatherValues};
#[cfg(feature = "cuda")]
pub use optimizer::DEVICE_KINDS;
#[cfg(feature = "cuda")]
pub use view::{DeviceView, DeviceViewMut, ViewElement};
