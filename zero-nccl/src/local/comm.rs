//! [`CudaThreadComm`]: ranks as threads of one process, over device memory.
//!
//! Each rank has its own compute and communication streams; the ranks share
//! one GPU, or several GPUs of the process (with peer access between them).
//! A collective, or a batch of them (a stage-3 layer's all-gathers), is
//! [`protocol::collective`] over the rank's streams: two host rendezvous
//! of the ranks' [`ThreadComm`] (so the deadline, mismatch
//! and dead-peer semantics are the thread backend's) around device copies
//! and the `reduce_ranks` kernel over the peers' buffers, ordered by events;
//! the host waits on them only on the way out of a failed collective.

use super::collective::{Call, Kind};
use super::protocol::{self, Lane};
use crate::device_comm::Cuda;
use crate::device_comm::{
    bucket_gathers, event_work, host_wait, host_wait_handle, ring_bytes, DeviceComm, StreamOwner,
};
use crate::kernels::{FusedKernels, MAX_LOCAL_RANKS};
use crate::Error;
use cudarc::driver::sys::{CUevent, CUevent_wait_flags};
use cudarc::driver::{
    CudaContext, CudaEvent, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, DeviceRepr,
    ValidAsZeroBits,
};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;
use zero_core::comm::{check_len, Buf};
use zero_core::engine::UnitBucket;
use zero_core::{Communicator, DType, Element, ReduceOp, Result, ThreadComm, ThreadGroup, Work};

/// One GPU of a group: its context and the kernels loaded in it.
#[derive(Clone)]
struct Gpu {
    ctx: Arc<CudaContext>,
    kernels: Arc<FusedKernels>,
}

/// Several ranks in one process, over device memory: the CUDA counterpart
/// of [`ThreadGroup`]. Every rank is a thread with its own streams; the
/// ranks share one GPU ([`CudaThreadGroup::new`]) or are spread over
/// several ([`CudaThreadGroup::on_devices`]).
///
/// It runs every multi-rank path of the engine on a machine with a single
/// GPU (NCCL refuses two ranks on one device), and drives several GPUs from
/// one process without NCCL. At most [`MAX_LOCAL_RANKS`] ranks.
///
/// ```no_run
/// use zero_nccl::{CudaThreadGroup, DeviceComm};
/// use zero_core::Communicator;
/// # fn main() -> zero_core::Result<()> {
/// let results = CudaThreadGroup::new(4).run(|comm| {
///     let stream = comm.compute_stream().clone();
///     let mut buf = stream.clone_htod(&[comm.rank() as f32; 8]).map_err(zero_nccl::Error::from)?;
///     comm.all_reduce(&mut buf, zero_core::ReduceOp::Sum)?;
///     Ok(stream.clone_dtoh(&buf).map_err(zero_nccl::Error::from)?)
/// })?;
/// # Ok(()) }
/// ```
#[derive(Clone, Debug)]
pub struct CudaThreadGroup {
    world_size: usize,
    devices: Vec<usize>,
    timeout: Duration,
}

impl CudaThreadGroup {
    /// `world_size` ranks sharing GPU 0.
    pub fn new(world_size: usize) -> Self {
        Self::on_devices(world_size, &[0])
    }

    /// `world_size` ranks, rank `r` on GPU `devices[r % devices.len()]`.
    /// Distinct GPUs must be able to access each other's memory (peer
    /// access); [`CudaThreadGroup::communicators`] says so when they cannot.
    pub fn on_devices(world_size: usize, devices: &[usize]) -> Self {
        Self {
            world_size,
            devices: if devices.is_empty() {
                vec![0]
            } else {
                devices.to_vec()
            },
            timeout: zero_core::comm::DEFAULT_TIMEOUT,
        }
    }

    /// Sets the deadline of every rendezvous (as [`ThreadGroup::with_timeout`]).
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// The number of ranks.
    pub fn world_size(&self) -> usize {
        self.world_size
    }

    /// The GPU of rank `rank`.
    pub fn device_of(&self, rank: usize) -> usize {
        self.devices[rank % self.devices.len()]
    }

    /// Opens each GPU once: its context, the kernels compiled for it, and
    /// peer access between distinct GPUs.
    fn open(&self) -> Result<BTreeMap<usize, Gpu>> {
        if self.world_size == 0 || self.world_size > MAX_LOCAL_RANKS {
            return Err(zero_core::Error::Config(format!(
                "CudaThreadGroup: {} ranks; a group has 1 to {MAX_LOCAL_RANKS} (for more, \
                 launch one process per GPU with NcclComm)",
                self.world_size
            )));
        }
        // A missing driver or device is an error, never cudarc's panic.
        let devices = crate::probe::cuda_device_count()?;
        let mut gpus = BTreeMap::new();
        for rank in 0..self.world_size {
            let ordinal = self.device_of(rank);
            if gpus.contains_key(&ordinal) {
                continue;
            }
            if ordinal >= devices {
                return Err(zero_core::Error::Config(format!(
                    "CudaThreadGroup: rank {rank} is to run on GPU {ordinal}, but the CUDA \
                     driver reports {devices} GPU(s)"
                )));
            }
            let ctx =
                crate::probe::guarded("CudaThreadGroup setup", || Ok(CudaContext::new(ordinal)?))?;
            let kernels = Arc::new(FusedKernels::new(&ctx)?);
            gpus.insert(ordinal, Gpu { ctx, kernels });
        }
        let ordinals: Vec<usize> = gpus.keys().copied().collect();
        for (a, b) in peer_pairs(&ordinals) {
            enable_peer_access(a, &gpus[&a].ctx, b, &gpus[&b].ctx)?;
        }
        Ok(gpus)
    }

    /// The ranks' communicators, in rank order, for threads the caller
    /// runs (each must be moved to its own thread). Compiles the kernels
    /// once per GPU.
    pub fn communicators(&self) -> Result<Vec<CudaThreadComm>> {
        let gpus = self.open()?;
        let retired = Arc::new(Mutex::new(Vec::new()));
        ThreadGroup::new(self.world_size)
            .with_timeout(self.timeout)
            .communicators()
            .into_iter()
            .map(|host| {
                let gpu = &gpus[&self.device_of(host.rank())];
                CudaThreadComm::new(host, gpu, retired.clone(), self.timeout)
            })
            .collect()
    }

    /// Runs `f` on every rank, each in its own scoped thread, and returns
    /// the ranks' results in rank order, as [`ThreadGroup::run`] does: a rank
    /// that panics yields `RankPanicked`, and its peers' collectives fail
    /// instead of waiting for it. Fails as a whole only when the GPUs cannot
    /// be opened.
    #[must_use = "a rank that failed or panicked says so only in its result; check every rank's"]
    pub fn run<R, F>(&self, f: F) -> Result<Vec<Result<R>>>
    where
        F: Fn(CudaThreadComm) -> Result<R> + Sync,
        R: Send,
    {
        let gpus = self.open()?;
        let retired = Arc::new(Mutex::new(Vec::new()));
        let results = ThreadGroup::new(self.world_size)
            .with_timeout(self.timeout)
            .run(|host| {
                let gpu = &gpus[&self.device_of(host.rank())];
                f(CudaThreadComm::new(
                    host,
                    gpu,
                    retired.clone(),
                    self.timeout,
                )?)
            });
        Ok(results.into_iter().map(|r| r.and_then(|r| r)).collect())
    }
}

/// Every `(a, b)` of distinct GPUs of a group, in order: GPU `a`'s
/// kernels read and write GPU `b`'s memory (the copies and reductions of a
/// collective run on each rank's own stream over every peer's buffers), so
/// each pair is opened both ways.
fn peer_pairs(ordinals: &[usize]) -> Vec<(usize, usize)> {
    let mut pairs = Vec::new();
    for &a in ordinals {
        for &b in ordinals.iter().filter(|&&b| b != a) {
            pairs.push((a, b));
        }
    }
    pairs
}

/// Lets `a_ctx`'s kernels read and write `b_ctx`'s memory: both what
/// `cuMemAlloc` gives (the context's peer access) and what `cuMemAllocAsync`
/// gives from GPU `b`'s memory pools, which Candle and cudarc allocate
/// from, and which peer access between contexts does not open.
fn enable_peer_access(
    a: usize,
    a_ctx: &Arc<CudaContext>,
    b: usize,
    b_ctx: &Arc<CudaContext>,
) -> Result<()> {
    use cudarc::driver::sys::{cuCtxEnablePeerAccess, cuDeviceCanAccessPeer, CUresult};
    let mut can = 0;
    // SAFETY: a valid out-pointer and two device handles of live contexts.
    unsafe { cuDeviceCanAccessPeer(&mut can, a_ctx.cu_device(), b_ctx.cu_device()) }
        .result()
        .map_err(Error::from)?;
    if can == 0 {
        return Err(zero_core::Error::Unsupported {
            op: "CudaThreadGroup::on_devices",
            detail: format!(
                "GPU {a} cannot access GPU {b}'s memory (no peer access between them); \
                 launch one process per GPU with NcclComm instead"
            ),
        });
    }
    a_ctx.bind_to_thread().map_err(Error::from)?;
    // SAFETY: `a_ctx` is current and `b_ctx` is a live context.
    match unsafe { cuCtxEnablePeerAccess(b_ctx.cu_ctx(), 0) } {
        CUresult::CUDA_SUCCESS | CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED => {}
        other => return Err(Error::from(cudarc::driver::DriverError(other)).into()),
    }
    open_pools(a, a_ctx, b, b_ctx).map_err(|e| zero_core::Error::Unsupported {
        op: "CudaThreadGroup::on_devices",
        detail: format!(
            "GPU {a} could not be given access to GPU {b}'s memory pool ({e}), so a \
             collective reading GPU {b}'s buffers from GPU {a} would fault; check that the \
             driver supports memory pools (CUDA 11.2 or later) and peer access between \
             them (`nvidia-smi topo -m`), or launch one process per GPU with NcclComm instead"
        ),
    })
}

/// Opens GPU `b`'s memory pools (its current one, which `cuMemAllocAsync`
/// allocates from, and its default one, where they differ) to GPU `a`,
/// for reads and writes. The grant covers the pools' present and future
/// allocations.
fn open_pools(
    a: usize,
    a_ctx: &Arc<CudaContext>,
    b: usize,
    b_ctx: &Arc<CudaContext>,
) -> std::result::Result<(), cudarc::driver::DriverError> {
    use cudarc::driver::result::device;
    use cudarc::driver::sys::{cuMemPoolSetAccess, CUmemAccessDesc, CUmemAccess_flags};
    if !b_ctx.has_async_alloc() {
        // cudarc then allocates with `cuMemAlloc`, which peer access opens.
        return Ok(());
    }
    b_ctx.bind_to_thread()?;
    // SAFETY: the device handle of a live context.
    let current = unsafe { device::get_mem_pool(b_ctx.cu_device()) }?;
    // SAFETY: as above.
    let default = unsafe { device::get_default_mem_pool(b_ctx.cu_device()) }?;
    let access = CUmemAccessDesc {
        location: device_location(a_ctx.cu_device()),
        flags: CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
    };
    let pools = if current == default {
        vec![current]
    } else {
        vec![current, default]
    };
    for pool in pools {
        // SAFETY: `pool` is a live pool of GPU `b`, whose context is
        // current; one descriptor, naming GPU `a`, a device other than `b`.
        unsafe { cuMemPoolSetAccess(pool, &access, 1) }.result()?;
    }
    tracing::debug!("CudaThreadGroup: GPU {a} reads and writes GPU {b}'s memory pools");
    Ok(())
}

// The location of a device: its type, then its ordinal as a C int. cudarc
// names the ordinal `id` up to CUDA 13.1 and puts it in a union from 13.2
// on, which code built against either cannot name, so it is written at its
// offset; the size check keeps that honest for any bindings.
const _: () = assert!(
    std::mem::size_of::<cudarc::driver::sys::CUmemLocation>()
        == 2 * std::mem::size_of::<std::ffi::c_int>()
);

/// The `CUmemLocation` of device `device`.
fn device_location(device: cudarc::driver::sys::CUdevice) -> cudarc::driver::sys::CUmemLocation {
    use cudarc::driver::sys::{CUmemLocation, CUmemLocationType};
    // SAFETY: plain C data, of which all zeros is a valid value (an invalid
    // location, ordinal 0).
    let mut location: CUmemLocation = unsafe { std::mem::zeroed() };
    location.type_ = CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
    let at = std::mem::size_of::<CUmemLocationType>();
    // SAFETY: the ordinal is the C int right after the 4-byte type, inside
    // the 8-byte value (checked above), and 4-aligned as the value is.
    unsafe {
        std::ptr::addr_of_mut!(location)
            .cast::<u8>()
            .add(at)
            .cast::<std::ffi::c_int>()
            .write(device);
    }
    location
}

/// One rank of a [`CudaThreadGroup`]: a [`Communicator`] over device
/// buffers and a [`DeviceComm`], so the engine, `CudaMemory` and
/// zero-candle's optimizer run on it as on [`NcclComm`](crate::NcclComm).
/// Reductions combine the ranks in rank order, in f32 for 16-bit types:
/// the thread backend's results, bit for bit.
pub struct CudaThreadComm {
    host: ThreadComm,
    gpu: Gpu,
    compute: Arc<CudaStream>,
    /// The thread `compute` belongs to, where it is the per-thread default
    /// stream (set with `with_compute_stream`): collectives are ordered
    /// with it from that thread only.
    owner: StreamOwner,
    comm_stream: Arc<CudaStream>,
    bytes_sent: AtomicU64,
    seq: AtomicU64,
    timeout: Duration,
    /// Held while a collective is issued (one at a time, as on NCCL), with
    /// the previous collective's events: a peer may wait on them until it
    /// posts the next collective.
    issuing: Mutex<Vec<CudaEvent>>,
    /// Where a dropped communicator leaves its last events, which its peers
    /// may still be about to wait on; freed with the group's last communicator.
    retired: Arc<Mutex<Vec<CudaEvent>>>,
}

impl std::fmt::Debug for CudaThreadComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaThreadComm")
            .field("rank", &self.host.rank())
            .field("world_size", &self.host.world_size())
            .field("device", &self.gpu.ctx.ordinal())
            .field("bytes_sent", &self.bytes_sent.load(Ordering::Relaxed))
            .finish()
    }
}

impl Drop for CudaThreadComm {
    fn drop(&mut self) {
        let events = std::mem::take(
            self.issuing
                .get_mut()
                .unwrap_or_else(PoisonError::into_inner),
        );
        self.retired
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .extend(events);
    }
}

impl CudaThreadComm {
    fn new(
        host: ThreadComm,
        gpu: &Gpu,
        retired: Arc<Mutex<Vec<CudaEvent>>>,
        timeout: Duration,
    ) -> Result<Self> {
        let compute = gpu.ctx.new_stream().map_err(Error::from)?;
        let comm_stream = gpu.ctx.new_stream().map_err(Error::from)?;
        Ok(Self {
            host,
            gpu: gpu.clone(),
            owner: StreamOwner::of(&compute),
            compute,
            comm_stream,
            bytes_sent: AtomicU64::new(0),
            seq: AtomicU64::new(0),
            timeout,
            issuing: Mutex::new(Vec::new()),
            retired,
        })
    }

    /// The stream collectives run on.
    pub fn comm_stream(&self) -> &Arc<CudaStream> {
        &self.comm_stream
    }

    /// The handle of a collective that completes at `done`.
    fn work<'a>(&self, done: CudaEvent) -> Work<'a> {
        event_work(self.compute.clone(), self.owner, done)
    }

    /// Runs one collective ([`protocol::collective`]) on this rank's
    /// streams, counting `bytes` as sent; returns the completion event.
    fn collective(
        &self,
        op: &'static str,
        call: Call,
        addrs: (u64, u64),
        check: Result<()>,
        bytes: u64,
    ) -> Result<CudaEvent> {
        self.batch(op, &[(call, addrs)], check, bytes)
    }

    /// Runs a batch of collectives in one pass of the protocol.
    fn batch(
        &self,
        op: &'static str,
        calls: &[(Call, (u64, u64))],
        check: Result<()>,
        bytes: u64,
    ) -> Result<CudaEvent> {
        self.owner.check("CudaThreadComm")?;
        let mut previous = self.issuing.lock().unwrap_or_else(PoisonError::into_inner);
        self.gpu.ctx.bind_to_thread().map_err(Error::from)?;
        let seq = self.seq.fetch_add(1, Ordering::Relaxed);
        let lane = CudaLane {
            compute: &self.compute,
            comm: &self.comm_stream,
            kernels: &self.gpu.kernels,
            timeout: self.timeout,
        };
        let done = protocol::collective(&self.host, &lane, &mut previous, (op, seq), calls, check)?;
        self.bytes_sent.fetch_add(bytes, Ordering::Relaxed);
        Ok(done)
    }

    /// The all-gathers of `buckets` as one batch, from the shard at `shard`
    /// (`None`: in place) into `buffer`. A refused bucket is posted as a
    /// failure, so that the peers fail at once instead of waiting.
    fn all_gather_buckets<T: Element>(
        &self,
        shard: Option<(u64, usize)>,
        buffer: (u64, usize),
        buckets: &[UnitBucket],
    ) -> Result<CudaEvent> {
        if buckets.is_empty() {
            self.owner.check("CudaThreadComm")?;
            self.gpu.ctx.bind_to_thread().map_err(Error::from)?;
            return Ok(self.compute.record_event(None).map_err(Error::from)?);
        }
        let world = (self.host.rank(), self.host.world_size());
        let planned = bucket_gathers::<T>(shard, buffer, buckets, world);
        // Refused, the calls are posted with no addresses.
        let calls: Vec<(Call, (u64, u64))> = buckets
            .iter()
            .enumerate()
            .map(|(i, bucket)| {
                let addrs = planned
                    .as_ref()
                    .map_or((0, 0), |(g, _)| (g[i].send, g[i].recv));
                (Self::call::<T>(Kind::AllGather, bucket.shard.len()), addrs)
            })
            .collect();
        let bytes = planned.as_ref().map_or(0, |(_, bytes)| *bytes);
        self.batch("all_gather", &calls, planned.map(drop), bytes)
    }

    fn call<T: Element>(kind: Kind, len: usize) -> Call {
        Call {
            kind,
            dtype: T::DTYPE,
            len,
        }
    }

    fn check_root(&self, op: &'static str, root: usize) -> Result<()> {
        zero_core::comm::check_root(op, root, self.host.world_size())
    }

    fn in_place<T: Element>(
        &self,
        op: &'static str,
        kind: Kind,
        buf: &mut (impl DevicePtrMut<T> + ?Sized),
        check: Result<()>,
        bytes: u64,
    ) -> Result<CudaEvent> {
        let len = buf.len();
        let (ptr, _record) = buf.device_ptr_mut(&self.comm_stream);
        self.collective(op, Self::call::<T>(kind, len), (ptr, ptr), check, bytes)
    }

    fn varlen<T: Element>(
        &self,
        op: &'static str,
        send: &CudaSlice<T>,
        counts: &[usize],
        recv: Option<&mut CudaSlice<T>>,
        root: Option<usize>,
    ) -> Result<CudaEvent> {
        let n = self.host.world_size();
        let rank = self.host.rank();
        let total: usize = counts.iter().sum();
        let receives = root.is_none_or(|r| r == rank);
        let check = root
            .map_or(Ok(()), |r| self.check_root(op, r))
            .and_then(|()| check_len(op, "counts", counts.len(), n))
            .and_then(|()| check_len(op, "send", send.len(), counts[rank]))
            .and_then(|()| match (&recv, receives) {
                (Some(r), true) => check_len(op, "recv", r.len(), total),
                (None, true) => Err(zero_core::Error::Unsupported {
                    op,
                    detail: "a receiving rank must pass a receive buffer".into(),
                }),
                (_, false) => Ok(()),
            });
        // A refused call posts what it can; `counts` may be short.
        let counts = if check.is_ok() {
            counts.to_vec()
        } else {
            Vec::new()
        };
        let bytes = (send.num_bytes() * if root.is_none() { n - 1 } else { 1 }) as u64;
        let (src, _record_src) = send.device_ptr(&self.comm_stream);
        let mut dst_guard = recv.map(|r| r.device_ptr_mut(&self.comm_stream));
        let dst = dst_guard.as_mut().map_or(0, |(ptr, _)| *ptr);
        let call = Call::gather(T::DTYPE, counts, root);
        self.collective(op, call, (src, dst), check, bytes)
    }
}

/// A rank's compute and comm streams as the protocol's [`Lane`].
struct CudaLane<'a> {
    compute: &'a Arc<CudaStream>,
    comm: &'a Arc<CudaStream>,
    kernels: &'a FusedKernels,
    /// The deadline of a host wait.
    timeout: Duration,
}

impl Lane for CudaLane<'_> {
    type Event = CudaEvent;

    fn record_compute(&self) -> Result<CudaEvent> {
        Ok(self.compute.record_event(None).map_err(Error::from)?)
    }

    fn record_comm(&self) -> Result<CudaEvent> {
        Ok(self.comm.record_event(None).map_err(Error::from)?)
    }

    fn handle(event: &CudaEvent) -> u64 {
        event.cu_event() as u64
    }

    unsafe fn wait(&self, handle: u64) -> Result<()> {
        // SAFETY: `handle` is a live event of the group (the trait's contract).
        unsafe {
            cudarc::driver::result::stream::wait_event(
                self.comm.cu_stream(),
                handle as CUevent,
                CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
            )
        }
        .map_err(|e| Error::from(e).into())
    }

    unsafe fn wait_on_host(&self, handle: u64, (op, seq): (&'static str, u64)) -> Result<()> {
        // SAFETY: `handle` is a live event of the group (the trait's contract).
        Ok(unsafe { host_wait_handle(op, seq, handle as CUevent, self.timeout) }?)
    }

    fn sync_comm(&self) -> Result<()> {
        Ok(self.comm.synchronize().map_err(Error::from)?)
    }

    unsafe fn copy(&self, dst: u64, src: u64, bytes: usize) -> Result<()> {
        // SAFETY: both ranges are live device memory (the trait's
        // contract), reachable from this device (peer access).
        unsafe { cudarc::driver::result::memcpy_dtod_async(dst, src, bytes, self.comm.cu_stream()) }
            .map_err(|e| Error::from(e).into())
    }

    unsafe fn reduce(
        &self,
        dtype: DType,
        srcs: &[u64],
        dsts: &[u64],
        len: usize,
        op: ReduceOp,
    ) -> Result<()> {
        // SAFETY: forwarded from the trait's contract.
        Ok(unsafe {
            self.kernels
                .reduce_ranks(self.comm, dtype, srcs, dsts, len, op)
        }?)
    }
}

impl DeviceComm for CudaThreadComm {
    fn context(&self) -> &Arc<CudaContext> {
        &self.gpu.ctx
    }

    fn compute_stream(&self) -> &Arc<CudaStream> {
        &self.compute
    }

    fn timeout(&self) -> Duration {
        self.timeout
    }

    fn with_compute_stream(mut self, stream: Arc<CudaStream>) -> Result<Self> {
        if stream.context() != &self.gpu.ctx {
            return Err(zero_core::Error::Unsupported {
                op: "CudaThreadComm::with_compute_stream",
                detail: format!(
                    "the stream belongs to device {}, the communicator to device {}",
                    stream.context().ordinal(),
                    self.gpu.ctx.ordinal()
                ),
            });
        }
        self.owner = StreamOwner::of(&stream);
        self.compute = stream;
        Ok(self)
    }

    fn all_reduce_event<T: Element>(
        &self,
        buf: &mut (impl DevicePtrMut<T> + ?Sized),
        op: ReduceOp,
    ) -> Result<CudaEvent> {
        let bytes = 2 * ring_bytes(buf.num_bytes(), self.host.world_size());
        self.in_place("all_reduce", Kind::AllReduce(op), buf, Ok(()), bytes)
    }

    fn reduce_scatter_event<T: Element>(
        &self,
        send: &(impl DevicePtr<T> + ?Sized),
        recv: &mut (impl DevicePtrMut<T> + ?Sized),
        op: ReduceOp,
    ) -> Result<CudaEvent> {
        const OP: &str = "reduce_scatter";
        let n = self.host.world_size();
        let check = check_len(OP, "send", send.len(), n * recv.len());
        let bytes = ring_bytes(send.num_bytes(), n);
        let len = recv.len();
        let (src, _record_src) = send.device_ptr(&self.comm_stream);
        let (dst, _record_dst) = recv.device_ptr_mut(&self.comm_stream);
        let call = Self::call::<T>(Kind::ReduceScatter(op), len);
        self.collective(OP, call, (src, dst), check, bytes)
    }

    fn all_gather_event<T: Element>(
        &self,
        send: &(impl DevicePtr<T> + ?Sized),
        recv: &mut (impl DevicePtrMut<T> + ?Sized),
    ) -> Result<CudaEvent> {
        const OP: &str = "all_gather";
        let n = self.host.world_size();
        let check = check_len(OP, "recv", recv.len(), n * send.len());
        let bytes = ring_bytes(recv.num_bytes(), n);
        let len = send.len();
        let (src, _record_src) = send.device_ptr(&self.comm_stream);
        let (dst, _record_dst) = recv.device_ptr_mut(&self.comm_stream);
        self.collective(
            OP,
            Self::call::<T>(Kind::AllGather, len),
            (src, dst),
            check,
            bytes,
        )
    }

    /// Each rank copies its peers' slots into its own buffer and leaves
    /// its own slot where it is ([`protocol::collective`] skips a copy
    /// onto itself).
    fn all_gather_in_place_event<T: Element>(
        &self,
        buf: &mut (impl DevicePtrMut<T> + ?Sized),
    ) -> Result<CudaEvent> {
        let n = self.host.world_size();
        // A refused length is posted as a failure, as other refusals are,
        // so that the peers fail at once instead of waiting.
        let (len, check) = match crate::device_comm::in_place_slot(buf.len(), n) {
            Ok(len) => (len, Ok(())),
            Err(e) => (buf.len() / n, Err(e)),
        };
        let bytes = ring_bytes(buf.num_bytes(), n);
        let (dst, _record) = buf.device_ptr_mut(&self.comm_stream);
        let src = dst + (self.host.rank() * len * std::mem::size_of::<T>()) as u64;
        self.collective(
            "all_gather",
            Self::call::<T>(Kind::AllGather, len),
            (src, dst),
            check,
            bytes,
        )
    }

    fn all_gather_buckets_event<T: Element>(
        &self,
        shard: &CudaSlice<T>,
        buffer: &mut CudaSlice<T>,
        buckets: &[UnitBucket],
    ) -> Result<CudaEvent> {
        let len = buffer.len();
        let (src, _record_src) = shard.device_ptr(&self.comm_stream);
        let (dst, _record_dst) = buffer.device_ptr_mut(&self.comm_stream);
        self.all_gather_buckets::<T>(Some((src, shard.len())), (dst, len), buckets)
    }

    fn all_gather_buckets_in_place_event<T: Element>(
        &self,
        buffer: &mut CudaSlice<T>,
        buckets: &[UnitBucket],
    ) -> Result<CudaEvent> {
        let len = buffer.len();
        let (dst, _record) = buffer.device_ptr_mut(&self.comm_stream);
        self.all_gather_buckets::<T>(None, (dst, len), buckets)
    }

    fn wait_compute(&self, op: &'static str) -> Result<()> {
        self.owner.check("CudaThreadComm")?;
        self.gpu.ctx.bind_to_thread().map_err(Error::from)?;
        let done = self.compute.record_event(None).map_err(Error::from)?;
        Ok(host_wait(
            op,
            self.seq.load(Ordering::Relaxed),
            &done,
            self.timeout,
        )?)
    }

    /// On the host, through the ranks' [`ThreadComm`]: the values never
    /// need the device.
    fn all_reduce_host(&self, values: &mut [f64], op: ReduceOp) -> Result<()> {
        self.host.all_reduce(values, op)
    }

    fn gather_varlen_host<T: Element + DeviceRepr + ValidAsZeroBits>(
        &self,
        send: &[T],
        counts: &[usize],
        recv: Option<&mut [T]>,
        root: usize,
    ) -> Result<()> {
        self.host.gather_varlen(send, counts, recv, root)
    }
}

impl Communicator for CudaThreadComm {
    type Memory = Cuda;

    fn rank(&self) -> usize {
        self.host.rank()
    }

    fn world_size(&self) -> usize {
        self.host.world_size()
    }

    fn bytes_sent(&self) -> u64 {
        self.bytes_sent.load(Ordering::Relaxed)
    }

    fn barrier(&self) -> Result<()> {
        self.host.barrier()
    }

    fn all_reduce<T: Element>(&self, buf: &mut Buf<Self, T>, op: ReduceOp) -> Result<()> {
        self.all_reduce_async(buf, op)?.wait()
    }

    fn reduce_scatter<T: Element>(
        &self,
        send: &Buf<Self, T>,
        recv: &mut Buf<Self, T>,
        op: ReduceOp,
    ) -> Result<()> {
        self.reduce_scatter_async(send, recv, op)?.wait()
    }

    fn all_gather<T: Element>(&self, send: &Buf<Self, T>, recv: &mut Buf<Self, T>) -> Result<()> {
        self.all_gather_async(send, recv)?.wait()
    }

    fn broadcast<T: Element>(&self, buf: &mut Buf<Self, T>, root: usize) -> Result<()> {
        self.broadcast_async(buf, root)?.wait()
    }

    fn reduce<T: Element>(&self, buf: &mut Buf<Self, T>, op: ReduceOp, root: usize) -> Result<()> {
        let check = self.check_root("reduce", root);
        let bytes = ring_bytes(buf.num_bytes(), self.host.world_size());
        let done = self.in_place("reduce", Kind::Reduce { op, root }, buf, check, bytes)?;
        self.work(done).wait()
    }

    fn gather_varlen<T: Element>(
        &self,
        send: &Buf<Self, T>,
        counts: &[usize],
        recv: Option<&mut Buf<Self, T>>,
        root: usize,
    ) -> Result<()> {
        let done = self.varlen("gather_varlen", send, counts, recv, Some(root))?;
        self.work(done).wait()
    }

    fn all_gather_varlen<T: Element>(
        &self,
        send: &Buf<Self, T>,
        counts: &[usize],
        recv: &mut Buf<Self, T>,
    ) -> Result<()> {
        let done = self.varlen("all_gather_varlen", send, counts, Some(recv), None)?;
        self.work(done).wait()
    }

    fn all_gather_bytes(&self, send: &[u8]) -> Result<Vec<Vec<u8>>> {
        self.host.all_gather_bytes(send)
    }

    fn all_reduce_async<'a, T: Element>(
        &'a self,
        buf: &'a mut Buf<Self, T>,
        op: ReduceOp,
    ) -> Result<Work<'a>> {
        let done = self.all_reduce_event(buf, op)?;
        Ok(self.work(done))
    }

    fn reduce_scatter_async<'a, T: Element>(
        &'a self,
        send: &'a Buf<Self, T>,
        recv: &'a mut Buf<Self, T>,
        op: ReduceOp,
    ) -> Result<Work<'a>> {
        let done = self.reduce_scatter_event(send, recv, op)?;
        Ok(self.work(done))
    }

    fn all_gather_async<'a, T: Element>(
        &'a self,
        send: &'a Buf<Self, T>,
        recv: &'a mut Buf<Self, T>,
    ) -> Result<Work<'a>> {
        let done = self.all_gather_event(send, recv)?;
        Ok(self.work(done))
    }

    fn broadcast_async<'a, T: Element>(
        &'a self,
        buf: &'a mut Buf<Self, T>,
        root: usize,
    ) -> Result<Work<'a>> {
        let check = self.check_root("broadcast", root);
        let bytes = ring_bytes(buf.num_bytes(), self.host.world_size());
        let done = self.in_place("broadcast", Kind::Broadcast { root }, buf, check, bytes)?;
        Ok(self.work(done))
    }

    fn split(&self, ranks: &[usize]) -> Result<Option<Self>> {
        let Some(host) = self.host.split(ranks)? else {
            return Ok(None);
        };
        let mut sub = Self::new(host, &self.gpu, self.retired.clone(), self.timeout)?;
        sub.compute = self.compute.clone();
        sub.owner = self.owner;
        Ok(Some(sub))
    }
}

#[cfg(test)]
mod tests {
    use super::{device_location, peer_pairs};
    use cudarc::driver::sys::CUmemLocationType;

    #[test]
    fn every_gpu_is_opened_to_every_other_both_ways_and_never_to_itself() {
        assert!(peer_pairs(&[0]).is_empty());
        assert_eq!(peer_pairs(&[0, 1]), vec![(0, 1), (1, 0)]);
        let pairs = peer_pairs(&[0, 2, 3]);
        assert_eq!(
            pairs,
            vec![(0, 2), (0, 3), (2, 0), (2, 3), (3, 0), (3, 2)],
            "each ordered pair of distinct GPUs once, in order"
        );
    }

    #[test]
    fn a_device_location_holds_the_type_then_the_ordinal() {
        let location = device_location(3);
        // SAFETY: two C ints (the size is checked at compile time).
        let words: [std::ffi::c_int; 2] = unsafe { std::mem::transmute(location) };
        assert_eq!(
            words,
            [
                CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE as std::ffi::c_int,
                3
            ]
        );
    }
}
