//! # zero-nccl
//!
//! The CUDA fast path of zero-rs: `NcclComm`, a
//! [`Communicator`](zero_core::Communicator) over device buffers with NCCL
//! (feature `nccl`), and fused CUDA kernels compiled at run time with NVRTC
//! for the engine's flatten/unflatten and the built-in optimizers (feature
//! `cuda`; see `kernels`).
//!
//! The crate builds without CUDA installed: the libraries are loaded at run
//! time, and a missing `libcuda.so`, `libnvrtc.so` or `libnccl.so` is an
//! [`Error::LibraryNotFound`], never a panic. Without features it holds the
//! launcher plumbing only ([`LaunchEnv`], [`Rendezvous`]), which is pure Rust.
//!
//! ```no_run
//! # #[cfg(feature = "nccl")]
//! # fn main() -> zero_nccl::Result<()> {
//! use zero_nccl::NcclComm;
//! // Launched by `torchrun`-style variables or `mpirun`:
//! let comm = NcclComm::from_env()?;
//! # Ok(()) }
//! # #[cfg(not(feature = "nccl"))] fn main() {}
//! ```
#![warn(missing_docs)]

mod error;
pub mod launch;
mod local;
pub mod memory;
pub mod ptx_cache;
pub mod rendezvous;

#[cfg(feature = "cuda")]
pub mod kernels;
#[cfg(feature = "cuda")]
mod pool;
#[cfg(feature = "cuda")]
pub mod probe;
#[cfg(feature = "cuda")]
mod stream;

#[cfg(feature = "nccl")]
mod comm;
#[cfg(feature = "nccl")]
mod device_comm;

pub use error::{Error, Result};
pub use launch::{LaunchEnv, Launcher};
pub use rendezvous::Rendezvous;

#[cfg(feature = "nccl")]
pub use comm::{NcclComm, UNIQUE_ID_BYTES};
#[cfg(feature = "nccl")]
pub use device_comm::{Cuda, DeviceComm};
#[cfg(feature = "nccl")]
pub use kernels::MAX_LOCAL_RANKS;
#[cfg(feature = "nccl")]
pub use local::{CudaThreadComm, CudaThreadGroup};
#[cfg(feature = "nccl")]
pub use memory::{
    cuda_engine, CudaEngine, CudaMemory, DeviceGather, DeviceGathers, DeviceParams, GatherValues,
};
#[cfg(feature = "cuda")]
pub use memory::{DeviceView, DeviceViewMut, ViewElement};
#[cfg(feature = "cuda")]
pub use pool::DevicePool;
#[cfg(feature = "cuda")]
pub use probe::cuda_device_count;
#[cfg(feature = "cuda")]
pub use stream::is_per_thread_stream;

/// Re-export of the `cudarc` this crate is built against, so that users
/// name the same `CudaSlice`/`CudaStream` types.
#[cfg(feature = "cuda")]
pub use cudarc;
