//! [`NcclComm`]: the [`Communicator`] over device buffers, with NCCL.
//!
//! Collectives run on a communication stream of their own, ordered with the
//! compute stream by events: the comm stream waits for an event recorded on
//! the compute stream, runs the collective and records a second event, which
//! [`Work::wait`] makes the compute stream wait on. Nothing on the step path
//! blocks the host; "blocking" collectives are complete in stream order when
//! they return (work queued later on the compute stream sees their result).
//! Only `barrier`, `all_gather_bytes` and `split` wait on the host, each
//! with the communicator's deadline.

use crate::device_comm::{event_work, host_wait, ring_bytes, Cuda, DeviceComm};
use crate::launch::LaunchEnv;
use crate::probe::{cuda_device_count, ensure_library, guarded, Library};
use crate::rendezvous::Rendezvous;
use crate::{Error, Result};
use cudarc::driver::{
    CudaContext, CudaEvent, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, DeviceRepr,
    ValidAsZeroBits,
};
use cudarc::nccl::{result as nccl, sys};
use std::ffi::c_void;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;
use zero_core::comm::{check_counts, check_len, check_root, Buf};
use zero_core::{Communicator, DType, Element, ReduceOp, Work};

/// `NCCL_SPLIT_NOCOLOR` from `nccl.h`: the rank takes no part in the new communicator.
const NCCL_SPLIT_NOCOLOR: i32 = -1;
/// Length of an `ncclUniqueId`.
pub const UNIQUE_ID_BYTES: usize = 128;

/// The NCCL type of an element type.
fn nccl_dtype(dtype: DType) -> sys::ncclDataType_t {
    match dtype {
        DType::F32 => sys::ncclDataType_t::ncclFloat32,
        DType::F64 => sys::ncclDataType_t::ncclFloat64,
        DType::BF16 => sys::ncclDataType_t::ncclBfloat16,
        DType::F16 => sys::ncclDataType_t::ncclFloat16,
    }
}

fn nccl_op(op: ReduceOp) -> sys::ncclRedOp_t {
    match op {
        ReduceOp::Sum => sys::ncclRedOp_t::ncclSum,
        ReduceOp::Avg => sys::ncclRedOp_t::ncclAvg,
        ReduceOp::Max => sys::ncclRedOp_t::ncclMax,
        ReduceOp::Min => sys::ncclRedOp_t::ncclMin,
        ReduceOp::Product => sys::ncclRedOp_t::ncclProd,
    }
}

/// A ring collective that [`NcclComm::collective_event`] issues.
#[derive(Clone, Copy, Debug)]
enum Collective {
    AllReduce(ReduceOp),
    ReduceScatter(ReduceOp),
    AllGather,
    /// From the rank `root` (checked against the world size).
    Broadcast {
        root: i32,
    },
}

impl Collective {
    /// The NCCL function's name, for errors and the deadline's messages.
    fn call(self) -> &'static str {
        match self {
            Self::AllReduce(_) => "ncclAllReduce",
            Self::ReduceScatter(_) => "ncclReduceScatter",
            Self::AllGather => "ncclAllGather",
            Self::Broadcast { .. } => "ncclBroadcast",
        }
    }
}

/// Address of element `offset` of a buffer of `T` at `ptr`.
fn offset_ptr<T>(ptr: u64, offset: usize) -> u64 {
    ptr + (offset * std::mem::size_of::<T>()) as u64
}

/// An owned `ncclComm_t`; null once aborted.
struct RawComm(sys::ncclComm_t);

// SAFETY: an NCCL communicator is not tied to the thread that created it; NCCL
// only requires that calls on one communicator are not concurrent, which the
// `Mutex` around `RawComm` in `NcclComm` guarantees (group calls included: the
// lock is held from ncclGroupStart to ncclGroupEnd).
unsafe impl Send for RawComm {}

impl Drop for RawComm {
    fn drop(&mut self) {
        if self.0.is_null() {
            return;
        }
        // SAFETY: `self.0` came from ncclCommInitRank/ncclCommSplit, has not
        // been destroyed or aborted (it would be null), and is not used after.
        // ncclCommDestroy finalizes (flushes queued work) before freeing.
        if let Err(e) = unsafe { nccl::comm_destroy(self.0) } {
            tracing::warn!(
                "ncclCommDestroy failed: {}",
                Error::nccl("ncclCommDestroy", e)
            );
        }
        self.0 = std::ptr::null_mut();
    }
}

/// A group of GPUs, one per rank, running collectives with NCCL.
///
/// Create it with [`NcclComm::from_env`] in a job launched by mpirun or a
/// torchrun-style launcher, or [`NcclComm::single`] for one GPU.
pub struct NcclComm {
    comm: Mutex<RawComm>,
    ctx: Arc<CudaContext>,
    compute: Arc<CudaStream>,
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

    fn lock(&self, op: &'static str) -> Result<MutexGuard<'_, RawComm>> {
        // A poisoned lock only means another thread panicked while holding
        // it; the raw handle itself is still consistent.
        let guard = self.comm.lock().unwrap_or_else(|p| p.into_inner());
        if guard.0.is_null() {
            return Err(Error::Aborted { op });
        }
        Ok(guard)
    }

    fn cu_stream(&self) -> sys::cudaStream_t {
        self.comm_stream.cu_stream() as sys::cudaStream_t
    }

    /// Orders the comm stream after the compute stream, runs `call` under the
    /// communicator lock and returns the event recorded after it.
    fn issue(
        &self,
        op: &'static str,
        bytes: u64,
        call: impl FnOnce(sys::ncclComm_t, sys::cudaStream_t) -> Result<()>,
    ) -> Result<CudaEvent> {
        self.ctx.bind_to_thread()?;
        let ready = self.compute.record_event(None)?;
        self.comm_stream.wait(&ready)?;
        {
            let comm = self.lock(op)?;
            call(comm.0, self.cu_stream())?;
        }
        self.seq.fetch_add(1, Ordering::Relaxed);
        self.bytes_sent.fetch_add(bytes, Ordering::Relaxed);
        Ok(self.comm_stream.record_event(None)?)
    }

    /// The handle of a collective that completes at `done`.
    fn work<'a>(&self, done: CudaEvent) -> Work<'a> {
        event_work(self.compute.clone(), done)
    }

    /// Blocks the host until `done` has completed or the deadline passes; on
    /// timeout the communicator is aborted so that no rank hangs on it.
    fn host_wait(&self, op: &'static str, done: &CudaEvent) -> Result<()> {
        let waited = host_wait(op, self.seq.load(Ordering::Relaxed), done, self.timeout);
        if waited.is_err() {
            self.abort();
        }
        waited
    }

    /// Aborts the communicator: queued and future collectives fail instead of hanging.
    pub fn abort(&self) {
        let mut comm = self.comm.lock().unwrap_or_else(|p| p.into_inner());
        if comm.0.is_null() {
            return;
        }
        // SAFETY: the handle is live (not null) and is nulled right after, so
        // it is neither used nor destroyed again.
        if let Err(e) = unsafe { nccl::comm_abort(comm.0) } {
            tracing::warn!("ncclCommAbort failed: {}", Error::nccl("ncclCommAbort", e));
        }
        comm.0 = std::ptr::null_mut();
    }

    fn check_root(&self, op: &'static str, root: usize) -> Result<i32> {
        check_root(op, root, self.world_size)?;
        Ok(root as i32)
    }

    fn check_counts(&self, op: &'static str, counts: &[usize], send_len: usize) -> Result<()> {
        check_counts(op, counts, send_len, (self.rank, self.world_size))?;
        Ok(())
    }

    /// Issues `collective` from the device address `src` into `dst` (the
    /// same address when in place) with `count` elements of `T` per rank
    /// (NCCL's `count`, `recvcount` or `sendcount`), counting `bytes` as
    /// sent. The one place the four ring collectives call NCCL.
    ///
    /// # Safety
    ///
    /// `src` and `dst` address live device buffers of `T` holding what
    /// `collective` reads and writes for `count`: `count` elements each in
    /// place, `world_size * count` in reduce-scatter's source and
    /// all-gather's destination, and `count` in the other side of those two.
    unsafe fn collective_event<T: Element>(
        &self,
        collective: Collective,
        src: u64,
        dst: u64,
        count: usize,
        bytes: u64,
    ) -> Result<CudaEvent> {
        let call = collective.call();
        let dtype = nccl_dtype(T::DTYPE);
        self.issue(call, bytes, |comm, stream| {
            let (src, dst) = (src as *const c_void, dst as *mut c_void);
            // SAFETY: the buffers are as this function's contract requires.
            unsafe {
                match collective {
                    Collective::AllReduce(op) => {
                        nccl::all_reduce(src, dst, count, dtype, nccl_op(op), comm, stream)
                    }
                    Collective::ReduceScatter(op) => {
                        nccl::reduce_scatter(src, dst, count, dtype, nccl_op(op), comm, stream)
                    }
                    Collective::AllGather => nccl::all_gather(src, dst, count, dtype, comm, stream),
                    Collective::Broadcast { root } => {
                        nccl::broadcast(src, dst, count, dtype, root, comm, stream)
                    }
                }
            }
            .map(drop)
            .map_err(|e| Error::nccl(call, e))
        })
    }

    /// Fails unless the gathered side of a reduce-scatter or all-gather
    /// (`what`, of `got` elements) holds `world_size * count`.
    fn check_gathered(
        &self,
        op: &'static str,
        what: &'static str,
        got: usize,
        count: usize,
    ) -> Result<()> {
        Ok(check_len(op, what, got, count * self.world_size)?)
    }

    fn all_reduce_event_raw<T: Element>(
        &self,
        buf: &mut (impl DevicePtrMut<T> + ?Sized),
        op: ReduceOp,
    ) -> Result<CudaEvent> {
        let count = buf.len();
        let bytes = 2 * ring_bytes(buf.num_bytes(), self.world_size);
        let (ptr, _record) = buf.device_ptr_mut(&self.comm_stream);
        // SAFETY: in place over `count` elements of a live device buffer of
        // `T`; the buffer stays borrowed until the returned event's Work is
        // waited.
        unsafe { self.collective_event::<T>(Collective::AllReduce(op), ptr, ptr, count, bytes) }
    }

    fn reduce_scatter_event_raw<T: Element>(
        &self,
        send: &(impl DevicePtr<T> + ?Sized),
        recv: &mut (impl DevicePtrMut<T> + ?Sized),
        op: ReduceOp,
    ) -> Result<CudaEvent> {
        let count = recv.len();
        self.check_gathered("reduce_scatter", "send", send.len(), count)?;
        let bytes = ring_bytes(send.num_bytes(), self.world_size);
        let (src, _record_src) = send.device_ptr(&self.comm_stream);
        let (dst, _record_dst) = recv.device_ptr_mut(&self.comm_stream);
        // SAFETY: `send` holds world_size * count and `recv` count elements
        // of `T` (checked above); both are live device buffers.
        unsafe { self.collective_event::<T>(Collective::ReduceScatter(op), src, dst, count, bytes) }
    }

    fn all_gather_event_raw<T: Element>(
        &self,
        send: &(impl DevicePtr<T> + ?Sized),
        recv: &mut (impl DevicePtrMut<T> + ?Sized),
    ) -> Result<CudaEvent> {
        let count = send.len();
        self.check_gathered("all_gather", "recv", recv.len(), count)?;
        let bytes = ring_bytes(recv.num_bytes(), self.world_size);
        let (src, _record_src) = send.device_ptr(&self.comm_stream);
        let (dst, _record_dst) = recv.device_ptr_mut(&self.comm_stream);
        // SAFETY: `send` holds count and `recv` world_size * count elements
        // of `T` (checked above); both are live device buffers.
        unsafe { self.collective_event::<T>(Collective::AllGather, src, dst, count, bytes) }
    }

    fn broadcast_event<T: Element>(
        &self,
        buf: &mut CudaSlice<T>,
        root: usize,
    ) -> Result<CudaEvent> {
        let root = self.check_root("broadcast", root)?;
        let count = buf.len();
        let bytes = ring_bytes(buf.num_bytes(), self.world_size);
        let (ptr, _record) = buf.device_ptr_mut(&self.comm_stream);
        // SAFETY: in place over `count` elements of a live device buffer.
        unsafe {
            self.collective_event::<T>(Collective::Broadcast { root }, ptr, ptr, count, bytes)
        }
    }

    /// Gathers the ranks' contributions with grouped point-to-point calls:
    /// rank `r`'s `counts[r]` elements land at offset `sum(counts[..r])` of
    /// `recv` on every rank in `receivers`.
    fn varlen_event<T: Element, R: DevicePtrMut<T> + ?Sized>(
        &self,
        op: &'static str,
        send: &(impl DevicePtr<T> + ?Sized),
        counts: &[usize],
        recv: Option<&mut R>,
        receivers: Receivers,
    ) -> Result<CudaEvent> {
        self.check_counts(op, counts, send.len())?;
        let total: usize = counts.iter().sum();
        let offsets: Vec<usize> = counts
            .iter()
            .scan(0, |acc, &c| {
                let o = *acc;
                *acc += c;
                Some(o)
            })
            .collect();
        let receives = match receivers {
            Receivers::All => true,
            Receivers::Root(root) => root == self.rank,
        };
        let targets: Vec<usize> = match receivers {
            Receivers::All => (0..self.world_size).filter(|&p| p != self.rank).collect(),
            Receivers::Root(root) if root != self.rank => vec![root],
            Receivers::Root(_) => Vec::new(),
        };
        let recv = match (receives, recv) {
            (true, Some(recv)) if recv.len() == total => Some(recv),
            (true, Some(recv)) => {
                return Err(Error::from(zero_core::Error::BufferSize {
                    op,
                    what: "recv",
                    got: recv.len(),
                    expected: total,
                }))
            }
            (true, None) => {
                return Err(Error::from(zero_core::Error::Unsupported {
                    op,
                    detail: "the root must pass a receive buffer".into(),
                }))
            }
            (false, _) => None,
        };
        let dtype = nccl_dtype(T::DTYPE);
        let elem = std::mem::size_of::<T>();
        let bytes = (counts[self.rank] * elem * targets.len()) as u64;
        let (src, _record_src) = send.device_ptr(&self.comm_stream);
        let mut dst_guard = recv.map(|r| r.device_ptr_mut(&self.comm_stream));
        let dst = dst_guard.as_mut().map(|(ptr, _)| *ptr);
        let (rank, world_size) = (self.rank, self.world_size);
        let cu_stream = self.comm_stream.cu_stream();
        self.issue(op, bytes, |comm, stream| {
            if let Some(dst) = dst {
                if counts[rank] > 0 {
                    // SAFETY: both ranges lie inside live device buffers of
                    // `T` (lengths checked above); the copy is stream-ordered.
                    unsafe {
                        cudarc::driver::result::memcpy_dtod_async(
                            offset_ptr::<T>(dst, offsets[rank]),
                            src,
                            counts[rank] * elem,
                            cu_stream,
                        )
                    }?;
                }
            }
            let nccl_err = |call| move |e| Error::nccl(call, e);
            nccl::group_start().map_err(nccl_err("ncclGroupStart"))?;
            // Queue every send and receive before checking errors, so that a
            // failure never leaves the group open.
            let mut queued = Ok(());
            for peer in (0..world_size).filter(|&p| p != rank) {
                if counts[rank] > 0 && targets.contains(&peer) && queued.is_ok() {
                    // SAFETY: `send` holds counts[rank] elements of `T`.
                    queued = unsafe {
                        nccl::send(
                            src as *const _,
                            counts[rank],
                            dtype,
                            peer as i32,
                            comm,
                            stream,
                        )
                    }
                    .map(drop)
                    .map_err(nccl_err("ncclSend"));
                }
                if let Some(dst) = dst {
                    if counts[peer] > 0 && queued.is_ok() {
                        // SAFETY: offsets[peer] + counts[peer] <= total = recv.len().
                        queued = unsafe {
                            nccl::recv(
                                offset_ptr::<T>(dst, offsets[peer]) as *mut _,
                                counts[peer],
                                dtype,
                                peer as i32,
                                comm,
                                stream,
                            )
                        }
                        .map(drop)
                        .map_err(nccl_err("ncclRecv"));
                    }
                }
            }
            let ended = nccl::group_end()
                .map(drop)
                .map_err(nccl_err("ncclGroupEnd"));
            queued.and(ended)
        })
    }

    fn host_bytes_all_gather(&self, send: &[u8]) -> Result<Vec<Vec<u8>>> {
        const OP: &str = "all_gather_bytes";
        let n = self.world_size;
        if n == 1 {
            return Ok(vec![send.to_vec()]);
        }
        let stream = &self.comm_stream;
        let len_send = stream.clone_htod(&[send.len() as u64])?;
        let mut len_recv = stream.alloc_zeros::<u64>(n)?;
        let done = self.raw_all_gather(
            OP,
            &len_send,
            &mut len_recv,
            sys::ncclDataType_t::ncclUint64,
        )?;
        self.host_wait(OP, &done)?;
        let lens: Vec<usize> = stream
            .clone_dtoh(&len_recv)?
            .into_iter()
            .map(|l| l as usize)
            .collect();
        let max = lens.iter().copied().max().unwrap_or(0);
        if max == 0 {
            return Ok(vec![Vec::new(); n]);
        }
        let mut padded = send.to_vec();
        padded.resize(max, 0);
        let data_send = stream.clone_htod(&padded)?;
        let mut data_recv = stream.alloc_zeros::<u8>(max * n)?;
        let done = self.raw_all_gather(
            OP,
            &data_send,
            &mut data_recv,
            sys::ncclDataType_t::ncclUint8,
        )?;
        self.host_wait(OP, &done)?;
        let all = stream.clone_dtoh(&data_recv)?;
        Ok(lens
            .iter()
            .enumerate()
            .map(|(r, &len)| all[r * max..r * max + len].to_vec())
            .collect())
    }

    fn raw_all_gather<U>(
        &self,
        op: &'static str,
        send: &CudaSlice<U>,
        recv: &mut CudaSlice<U>,
        dtype: sys::ncclDataType_t,
    ) -> Result<CudaEvent> {
        let count = send.len();
        let bytes = ring_bytes(recv.num_bytes(), self.world_size);
        let (src, _record_src) = send.device_ptr(&self.comm_stream);
        let (dst, _record_dst) = recv.device_ptr_mut(&self.comm_stream);
        self.issue(op, bytes, |comm, stream| {
            // SAFETY: callers allocate `recv` with world_size * count elements.
            unsafe { nccl::all_gather(src as *const _, dst as *mut _, count, dtype, comm, stream) }
                .map(drop)
                .map_err(|e| Error::nccl("ncclAllGather", e))
        })
    }
}

/// The host-facing collectives of [`DeviceComm`], in this crate's errors.
impl NcclComm {
    /// [`DeviceComm::wait_compute`].
    fn wait_compute_raw(&self, op: &'static str) -> Result<()> {
        self.ctx.bind_to_thread()?;
        let done = self.compute.record_event(None)?;
        self.host_wait(op, &done)
    }

    /// [`DeviceComm::all_reduce_host`], through device memory.
    fn all_reduce_host_raw(&self, values: &mut [f64], op: ReduceOp) -> Result<()> {
        if values.is_empty() {
            return Ok(());
        }
        self.ctx.bind_to_thread()?;
        let mut buf = self.compute.clone_htod(values)?;
        let done = self.all_reduce_event_raw(&mut buf, op)?;
        self.host_wait("all_reduce (host values)", &done)?;
        self.compute.wait(&done)?;
        self.compute.memcpy_dtoh(&buf, values)?;
        Ok(())
    }

    /// [`DeviceComm::gather_varlen_host`], staged through device memory.
    fn gather_varlen_host_raw<T: Element + DeviceRepr + ValidAsZeroBits>(
        &self,
        send: &[T],
        counts: &[usize],
        recv: Option<&mut [T]>,
        root: usize,
    ) -> Result<()> {
        self.ctx.bind_to_thread()?;
        self.check_root("gather_varlen", root)?;
        // cudarc cannot allocate zero bytes: stage through one spare element.
        let mut send_dev = self.compute.alloc_zeros::<T>(send.len().max(1))?;
        let mut recv_dev = self
            .compute
            .alloc_zeros::<T>(recv.as_ref().map_or(1, |r| r.len().max(1)))?;
        if !send.is_empty() {
            self.compute
                .memcpy_htod(send, &mut send_dev.slice_mut(0..send.len()))?;
        }
        let recv_len = recv.as_ref().map(|r| r.len());
        let done = {
            let mut recv_view = recv_len.map(|len| recv_dev.slice_mut(0..len));
            self.varlen_event(
                "gather_varlen",
                &send_dev.slice(0..send.len()),
                counts,
                recv_view.as_mut(),
                Receivers::Root(root),
            )?
        };
        self.host_wait("gather_varlen", &done)?;
        self.compute.wait(&done)?;
        if let Some(out) = recv {
            let len = out.len();
            self.compute.memcpy_dtoh(&recv_dev.slice(0..len), out)?;
        }
        Ok(())
    }
}

#[derive(Clone, Copy)]
enum Receivers {
    All,
    Root(usize),
}

impl Drop for NcclComm {
    fn drop(&mut self) {
        // ncclCommDestroy (in RawComm's drop) needs this device current.
        if let Err(e) = self.ctx.bind_to_thread() {
            tracing::warn!("NcclComm drop: cannot bind the CUDA context: {e}");
        }
    }
}

impl Communicator for NcclComm {
    type Memory = Cuda;

    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world_size
    }

    fn bytes_sent(&self) -> u64 {
        self.bytes_sent.load(Ordering::Relaxed)
    }

    fn barrier(&self) -> zero_core::Result<()> {
        let mut token = self
            .comm_stream
            .alloc_zeros::<f32>(1)
            .map_err(Error::from)?;
        let done = self.all_reduce_event_raw(&mut token, ReduceOp::Sum)?;
        self.host_wait("barrier", &done)?;
        Ok(())
    }

    fn all_reduce<T: Element>(
        &self,
        buf: &mut Buf<Self, T>,
        op: ReduceOp,
    ) -> zero_core::Result<()> {
        self.all_reduce_async(buf, op)?.wait()
    }

    fn reduce_scatter<T: Element>(
        &self,
        send: &Buf<Self, T>,
        recv: &mut Buf<Self, T>,
        op: ReduceOp,
    ) -> zero_core::Result<()> {
        self.reduce_scatter_async(send, recv, op)?.wait()
    }

    fn all_gather<T: Element>(
        &self,
        send: &Buf<Self, T>,
        recv: &mut Buf<Self, T>,
    ) -> zero_core::Result<()> {
        self.all_gather_async(send, recv)?.wait()
    }

    fn broadcast<T: Element>(&self, buf: &mut Buf<Self, T>, root: usize) -> zero_core::Result<()> {
        self.broadcast_async(buf, root)?.wait()
    }

    fn reduce<T: Element>(
        &self,
        buf: &mut Buf<Self, T>,
        op: ReduceOp,
        root: usize,
    ) -> zero_core::Result<()> {
        let root = self.check_root("reduce", root)?;
        let count = buf.len();
        let bytes = ring_bytes(buf.num_bytes(), self.world_size);
        let (ptr, record) = buf.device_ptr_mut(&self.comm_stream);
        let done = self.issue("ncclReduce", bytes, |comm, stream| {
            // SAFETY: in place over `count` elements of a live device buffer;
            // NCCL writes the result only on `root`.
            unsafe {
                nccl::reduce(
                    ptr as *const _,
                    ptr as *mut _,
                    count,
                    nccl_dtype(T::DTYPE),
                    nccl_op(op),
                    root,
                    comm,
                    stream,
                )
            }
            .map(drop)
            .map_err(|e| Error::nccl("ncclReduce", e))
        })?;
        drop(record);
        self.work(done).wait()
    }

    fn gather_varlen<T: Element>(
        &self,
        send: &Buf<Self, T>,
        counts: &[usize],
        recv: Option<&mut Buf<Self, T>>,
        root: usize,
    ) -> zero_core::Result<()> {
        self.check_root("gather_varlen", root)?;
        let done = self.varlen_event("gather_varlen", send, counts, recv, Receivers::Root(root))?;
        self.work(done).wait()
    }

    fn all_gather_varlen<T: Element>(
        &self,
        send: &Buf<Self, T>,
        counts: &[usize],
        recv: &mut Buf<Self, T>,
    ) -> zero_core::Result<()> {
        let done = self.varlen_event(
            "all_gather_varlen",
            send,
            counts,
            Some(recv),
            Receivers::All,
        )?;
        self.work(done).wait()
    }

    fn all_gather_bytes(&self, send: &[u8]) -> zero_core::Result<Vec<Vec<u8>>> {
        Ok(self.host_bytes_all_gather(send)?)
    }

    fn all_reduce_async<'a, T: Element>(
        &'a self,
        buf: &'a mut Buf<Self, T>,
        op: ReduceOp,
    ) -> zero_core::Result<Work<'a>> {
        let done = self.all_reduce_event_raw(buf, op)?;
        Ok(self.work(done))
    }

    fn reduce_scatter_async<'a, T: Element>(
        &'a self,
        send: &'a Buf<Self, T>,
        recv: &'a mut Buf<Self, T>,
        op: ReduceOp,
    ) -> zero_core::Result<Work<'a>> {
        let done = self.reduce_scatter_event_raw(send, recv, op)?;
        Ok(self.work(done))
    }

    fn all_gather_async<'a, T: Element>(
        &'a self,
        send: &'a Buf<Self, T>,
        recv: &'a mut Buf<Self, T>,
    ) -> zero_core::Result<Work<'a>> {
        let done = self.all_gather_event_raw(send, recv)?;
        Ok(self.work(done))
    }

    fn broadcast_async<'a, T: Element>(
        &'a self,
        buf: &'a mut Buf<Self, T>,
        root: usize,
    ) -> zero_core::Result<Work<'a>> {
        let done = self.broadcast_event(buf, root)?;
        Ok(self.work(done))
    }

    fn split(&self, ranks: &[usize]) -> zero_core::Result<Option<Self>> {
        const OP: &str = "split";
        if ranks.windows(2).any(|w| w[0] >= w[1]) {
            return Err(zero_core::Error::Config(format!(
                "split: ranks {ranks:?} must be sorted and distinct"
            )));
        }
        if let Some(&bad) = ranks.iter().find(|&&r| r >= self.world_size) {
            return Err(Error::from(zero_core::Error::InvalidRank {
                op: OP,
                rank: bad,
                world_size: self.world_size,
            })
            .into());
        }
        let position = ranks.iter().position(|&r| r == self.rank);
        let (color, key) = match position {
            Some(p) => (0, p as i32),
            None => (NCCL_SPLIT_NOCOLOR, 0),
        };
        let new_comm = guarded("ncclCommSplit", || {
            self.ctx.bind_to_thread()?;
            // Pending work on the old communicator must be queued before the
            // split, which is itself blocking and collective.
            let comm = self.lock(OP)?;
            let mut new_comm: sys::ncclComm_t = std::ptr::null_mut();
            // SAFETY: `comm.0` is live (checked by lock); `new_comm` is a valid
            // out-pointer; a null config inherits the parent's.
            unsafe { sys::ncclCommSplit(comm.0, color, key, &mut new_comm, std::ptr::null_mut()) }
                .result()
                .map_err(|e| Error::nccl("ncclCommSplit", e))?;
            Ok(new_comm)
        })?;
        let Some(position) = position else {
            if !new_comm.is_null() {
                drop(RawComm(new_comm));
            }
            return Ok(None);
        };
        let comm_stream = self.ctx.new_stream().map_err(Error::from)?;
        let sub = Self::wrap(
            new_comm,
            self.ctx.clone(),
            self.compute.clone(),
            comm_stream,
            position,
            ranks.len(),
        )
        .with_timeout(self.timeout);
        Ok(Some(sub))
    }
}

impl DeviceComm for NcclComm {
    fn context(&self) -> &Arc<CudaContext> {
        NcclComm::context(self)
    }

    fn compute_stream(&self) -> &Arc<CudaStream> {
        NcclComm::compute_stream(self)
    }

    fn timeout(&self) -> Duration {
        self.timeout
    }

    fn with_compute_stream(self, stream: Arc<CudaStream>) -> zero_core::Result<Self> {
        Ok(NcclComm::with_compute_stream(self, stream)?)
    }

    fn all_reduce_event<T: Element>(
        &self,
        buf: &mut (impl DevicePtrMut<T> + ?Sized),
        op: ReduceOp,
    ) -> zero_core::Result<CudaEvent> {
        Ok(self.all_reduce_event_raw(buf, op)?)
    }

    fn reduce_scatter_event<T: Element>(
        &self,
        send: &(impl DevicePtr<T> + ?Sized),
        recv: &mut (impl DevicePtrMut<T> + ?Sized),
        op: ReduceOp,
    ) -> zero_core::Result<CudaEvent> {
        Ok(self.reduce_scatter_event_raw(send, recv, op)?)
    }

    fn all_gather_event<T: Element>(
        &self,
        send: &(impl DevicePtr<T> + ?Sized),
        recv: &mut (impl DevicePtrMut<T> + ?Sized),
    ) -> zero_core::Result<CudaEvent> {
        Ok(self.all_gather_event_raw(send, recv)?)
    }

    fn wait_compute(&self, op: &'static str) -> zero_core::Result<()> {
        Ok(self.wait_compute_raw(op)?)
    }

    fn all_reduce_host(&self, values: &mut [f64], op: ReduceOp) -> zero_core::Result<()> {
        Ok(self.all_reduce_host_raw(values, op)?)
    }

    fn gather_varlen_host<T: Element + DeviceRepr + ValidAsZeroBits>(
        &self,
        send: &[T],
        counts: &[usize],
        recv: Option<&mut [T]>,
        root: usize,
    ) -> zero_core::Result<()> {
        Ok(self.gather_varlen_host_raw(send, counts, recv, root)?)
    }
}
