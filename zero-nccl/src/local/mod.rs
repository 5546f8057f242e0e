//! Several ranks in one process over device memory: [`CudaThreadGroup`]
//! and its [`CudaThreadComm`]s (feature `nccl`). The collectives' logic
//! (what each rank posts, checks and issues: `collective`; the rendezvous and
//! events around it: `protocol`) is tested on the host.

#[cfg_attr(not(feature = "nccl"), allow(dead_code))]
mod collective;
#[cfg_attr(not(feature = "nccl"), allow(dead_code))]
mod protocol;

#[cfg(feature = "nccl")]
mod comm;

#[cfg(feature = "nccl")]
pub use comm::{CudaThreadComm, CudaThreadGroup};
