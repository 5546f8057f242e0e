//! [`NcclComm`]: the [`Communicator`](zero_core::Communicator) over device
//! buffers, with NCCL.
//!
//! Collectives run on a communication stream of their own, ordered with the
//! compute stream by events: the comm stream waits for an event recorded on
//! the compute stream, runs the collective and records a second event, which
//! [`Work::wait`](zero_core::Work::wait) makes the compute stream wait on.
//! Nothing on the step path blocks the host; "blocking" collectives are
//! complete in stream order when they return (work queued later on the
//! compute stream sees their result). Only `barrier`, `all_gather_bytes` and
//! `split` wait on the host, each with the communicator's deadline.
//!
//! This file builds the communicator; `handle` owns the NCCL handle,
//! `abort` locks it for each call and aborts it past the deadline,
//! `collectives` issues the collectives, `host` runs the ones that wait on
//! the host, and `traits` implements `Communicator` and `DeviceComm` over
//! them.

mod abort;
mod collectives;
mod handle;
mod host;
mod traits;

use crate::device_comm::StreamOwner;
use crate::launch::LaunchEnv;
use crate::probe::{cuda_device_count, ensure_library, guarded, Library};
use crate::rendezvous::Rendezvous;
use crate::{Error, Result};
use cudarc::driver::{CudaContext, CudaStream};
use cudarc::nccl::{result as nccl, sys};
use handle::RawComm;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Length of an `ncclUniqueId`.
pub const UNIQUE_ID_BYTES: usize = 128;

/// A group of GPUs, one per rank, running collectives with NCCL.
///
/// Create it with [`NcclComm::from_env`] in a job launched by mpirun or a
/// torchrun-style launcher, or [`NcclComm::single`] for one GPU.
pub struct NcclComm {
    comm: Mutex<RawComm>,
    ctx: Arc<CudaContext>,
    compute: Arc<CudaStream>,
    /// The thread `compute` belongs to, where it is the per-thread default
    /// stream: collectives are ordered with it from that thread only.
    owner: StreamOwner,
    comm_stream: Arc<CudaStream>,
    rank: usize,
    world_size: usize,
    bytes_sent: AtomicU64,
    seq: AtomicU64,
    timeout: Duration,
}

impl std::fmt::Debug for NcclComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclComm")
            .field("rank", &self.rank)
            .field("world_size", &self.world_size)
            .field("device", &self.ctx.ordinal())
            .field("bytes_sent", &self.bytes_sent.load(Ordering::Relaxed))
            .finish()
    }
}

impl NcclComm {
    /// Creates a fresh NCCL unique id (rank 0 does this and hands it to the others).
    pub fn unique_id() -> Result<[u8; UNIQUE_ID_BYTES]> {
        ensure_library(Library::Cuda)?;
        ensure_library(Library::Nccl)?;
        let id = guarded("ncclGetUniqueId", || {
            nccl::get_uniqueid().map_err(|e| Error::nccl("ncclGetUniqueId", e))
        })?;
        Ok(id.internal.map(|c| c as u8))
    }

    /// A communicator of one rank on GPU `device_ordinal`.
    pub fn single(device_ordinal: usize) -> Result<Self> {
        let id = Self::unique_id()?;
        Self::from_unique_id(device_ordinal, 0, 1, &id)
    }

    /// Joins the job described by the launcher's environment; see
    /// [`LaunchEnv::from_env`] for the variables read. `LOCAL_RANK` (or its
    /// MPI equivalent) picks the GPU; rank 0 creates the unique id and
    /// serves it over TCP at `MASTER_ADDR:MASTER_PORT`.
    pub fn from_env() -> Result<Self> {
        Self::from_launch(&LaunchEnv::from_env()?)
    }

    /// Joins the job described by `env`; see [`NcclComm::from_env`].
    pub fn from_launch(env: &LaunchEnv) -> Result<Self> {
        let devices = cuda_device_count()?;
        ensure_library(Library::Nccl)?;
        if devices == 0 {
            return Err(Error::from(zero_core::Error::Unsupported {
                op: "NcclComm::from_env",
                detail: "the CUDA driver reports no device; run on a GPU machine".into(),
            }));
        }
        let ordinal = env.local_rank.unwrap_or(env.rank % devices);
        if ordinal >= devices {
            return Err(Error::Env {
                var: "LOCAL_RANK",
                value: ordinal.to_string(),
                detail: format!("this node has {devices} GPU(s); launch at most one rank per GPU"),
            });
        }
        let rendezvous = Rendezvous::from_launch(env);
        let id = if env.rank == 0 {
            let id = Self::unique_id()?;
            rendezvous.exchange(Some(&id))?
        } else {
            rendezvous.exchange(None)?
        };
        let id: [u8; UNIQUE_ID_BYTES] =
            id.as_slice().try_into().map_err(|_| Error::Rendezvous {
                addr: rendezvous.address(),
                rank: env.rank,
                detail: format!(
                    "received {} bytes, expected a {UNIQUE_ID_BYTES}-byte NCCL id",
                    id.len()
                ),
            })?;
        Self::from_unique_id(ordinal, env.rank, env.world_size, &id)
    }

    /// Joins the communicator named by `id` as `rank` of `world_size`, on GPU
    /// `device_ordinal`. Every rank must call this with the same id; it
    /// returns once all have joined.
    pub fn from_unique_id(
        device_ordinal: usize,
        rank: usize,
        world_size: usize,
        id: &[u8; UNIQUE_ID_BYTES],
    ) -> Result<Self> {
        if rank >= world_size {
            return Err(Error::from(zero_core::Error::InvalidRank {
                op: "NcclComm::from_unique_id",
                rank,
                world_size,
            }));
        }
        let (ranks, rank_i32) = match (i32::try_from(world_size), i32::try_from(rank)) {
            (Ok(n), Ok(r)) => (n, r),
            _ => {
                return Err(Error::from(zero_core::Error::Unsupported {
                    op: "NcclComm::from_unique_id",
                    detail: format!("a world of {world_size} ranks exceeds NCCL's i32 range"),
                }))
            }
        };
        ensure_library(Library::Cuda)?;
        ensure_library(Library::Nccl)?;
        guarded("NCCL communicator setup", || {
            let ctx = CudaContext::new(device_ordinal)?;
            let comm_stream = ctx.new_stream()?;
            let compute = ctx.default_stream();
            let unique = sys::ncclUniqueId {
                internal: id.map(|b| b as std::ffi::c_char),
            };
            ctx.bind_to_thread()?;
            let mut comm: sys::ncclComm_t = std::ptr::null_mut();
            // SAFETY: `comm` is a valid out-pointer; the context of the chosen
            // device is current on this thread, as ncclCommInitRank requires.
            unsafe { nccl::comm_init_rank(&mut comm, ranks, unique, rank_i32) }
                .map_err(|e| Error::nccl("ncclCommInitRank", e))?;
            Ok(Self::wrap(
                comm,
                ctx,
                compute,
                comm_stream,
                rank,
                world_size,
            ))
        })
    }

    fn wrap(
        comm: sys::ncclComm_t,
        ctx: Arc<CudaContext>,
        compute: Arc<CudaStream>,
        comm_stream: Arc<CudaStream>,
        rank: usize,
        world_size: usize,
    ) -> Self {
        Self {
            comm: Mutex::new(RawComm(comm)),
            ctx,
            owner: StreamOwner::of(&compute),
            compute,
            comm_stream,
            rank,
            world_size,
            bytes_sent: AtomicU64::new(0),
            seq: AtomicU64::new(0),
            timeout: zero_core::comm::DEFAULT_TIMEOUT,
        }
    }

    /// Orders collectives after, and makes waits apply to, `stream` (for
    /// example Candle's device stream) instead of the context's default
    /// stream. It must belong to this communicator's context.
    pub fn with_compute_stream(mut self, stream: Arc<CudaStream>) -> Result<Self> {
        if stream.context() != &self.ctx {
            return Err(Error::from(zero_core::Error::Unsupported {
                op: "NcclComm::with_compute_stream",
                detail: format!(
                    "the stream belongs to device {}, the communicator to device {}",
                    stream.context().ordinal(),
                    self.ctx.ordinal()
                ),
            }));
        }
        self.owner = StreamOwner::of(&stream);
        self.compute = stream;
        Ok(self)
    }

    /// Sets the deadline of host-side waits (barrier, byte gathers, split).
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// The CUDA context of this rank's GPU.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// The stream collectives are ordered with.
    pub fn compute_stream(&self) -> &Arc<CudaStream> {
        &self.compute
    }

    /// The stream collectives run on.
    pub fn comm_stream(&self) -> &Arc<CudaStream> {
        &self.comm_stream
    }
}

impl Drop for NcclComm {
    fn drop(&mut self) {
        // ncclCommDestroy (in RawComm's drop) needs this device current.
        if let Err(e) = self.ctx.bind_to_thread() {
            tracing::warn!("NcclComm drop: cannot bind the CUDA context: {e}");
        }
    }
}
