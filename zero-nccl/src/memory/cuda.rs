//! The CUDA implementation of the engine's memory seam.

mod capabilities;

use super::gathers::DeviceGathers;
use super::optimizer::DeviceOptimizer;
use super::segments::{plan_segments, PieceSlot};
use super::view::{DeviceView, DeviceViewMut, ViewElement};
use crate::device_comm::StreamOwner;
use crate::kernels::Half;
use crate::kernels::{FusedKernels, NormAccumulator, NormKind, PIECES_PER_LAUNCH};
use crate::{DeviceComm, NcclComm};
use cudarc::driver::{
    CudaEvent, CudaSlice, CudaStream, CudaView, DevicePtr, DevicePtrMut, DriverError,
};
use half::{bf16, f16};
use std::collections::BTreeMap;
use std::ops::Range;
use std::sync::Arc;
use std::time::Duration;
use zero_core::engine::{
    Deferral, EngineConfig, GradPiece, NormType, PackedGathers, ParamCopy, ShardMemory, ShardStep,
    StepPiece,
};
use zero_core::optim::{FunctionalOptimizer, OptimizerState};
use zero_core::partition::ParamInfo;
use zero_core::{Engine, Error, ReduceOp, Result};

/// The engine on one GPU (f32 arithmetic; the parameters are f32, or
/// bf16/f16 with f32 master weights), over NCCL unless `C` says otherwise.
pub type CudaEngine<C = NcclComm> = Engine<f32, C, CudaMemory>;

/// Builds the engine with its buffers on `comm`'s GPU; see
/// [`Engine::with_memory`]. A collective. `optimizer` must be a built-in of
/// `zero-core` (SGD, Adam, AdamW, Adagrad or RMSprop): its hyperparameters
/// drive the fused kernels.
pub fn cuda_engine<C: DeviceComm>(
    comm: C,
    params: Vec<ParamInfo>,
    optimizer: Box<dyn FunctionalOptimizer<f32>>,
    config: EngineConfig,
) -> Result<CudaEngine<C>> {
    let memory = CudaMemory::new(&comm)?;
    Engine::with_memory(comm, memory, params, optimizer, config)
}

/// Device memory of the parameters a framework holds (contiguous, one
/// buffer per parameter, in the engine's parameter order): f32, or bf16/f16
/// for a 16-bit model (the engine then keeps f32 master weights).
///
/// The engine reads one parameter at a time, writes a bucket's at once
/// where the source lends them so ([`DeviceParams::with_params_mut`]),
/// and only queues work on the compute stream while it holds them.
pub trait DeviceParams {
    /// Calls `f` with parameter `param`'s device memory.
    fn with_param(
        &mut self,
        param: usize,
        f: &mut dyn FnMut(DeviceView<'_>) -> Result<()>,
    ) -> Result<()>;

    /// Calls `f` with device memory holding the elements `range` of
    /// parameter `param`, from the offset `f` is given: for a source that
    /// computes its values (a model built sharded), only what is read. By
    /// default the whole parameter, from `range.start`.
    fn with_param_range(
        &mut self,
        param: usize,
        range: Range<usize>,
        f: &mut dyn FnMut(DeviceView<'_>, usize) -> Result<()>,
    ) -> Result<()> {
        self.with_param(param, &mut |view| f(view, range.start))
    }

    /// Calls `f` with parameter `param`'s device memory, writable.
    fn with_param_mut(
        &mut self,
        param: usize,
        f: &mut dyn FnMut(DeviceViewMut<'_>) -> Result<()>,
    ) -> Result<()>;

    /// Calls `f` with the writable device memory of the distinct
    /// parameters `params`, in that order: all in one call where the source
    /// can hold them at once (the engine then writes a bucket's parameters
    /// in one launch instead of one each), else in consecutive runs, each
    /// call given the next ones. By default one parameter a call, through
    /// [`with_param_mut`](Self::with_param_mut).
    fn with_params_mut(
        &mut self,
        params: &[usize],
        f: &mut dyn FnMut(&mut [DeviceViewMut<'_>]) -> Result<()>,
    ) -> Result<()> {
        for &param in params {
            self.with_param_mut(param, &mut |view| f(&mut [view]))?;
        }
        Ok(())
    }
}

impl<E: ViewElement> DeviceParams for Vec<CudaSlice<E>> {
    fn with_param(
        &mut self,
        param: usize,
        f: &mut dyn FnMut(DeviceView<'_>) -> Result<()>,
    ) -> Result<()> {
        f(E::view(&self[param]))
    }

    fn with_param_mut(
        &mut self,
        param: usize,
        f: &mut dyn FnMut(DeviceViewMut<'_>) -> Result<()>,
    ) -> Result<()> {
        f(E::view_mut(&mut self[param]))
    }

    fn with_params_mut(
        &mut self,
        params: &[usize],
        f: &mut dyn FnMut(&mut [DeviceViewMut<'_>]) -> Result<()>,
    ) -> Result<()> {
        let count = self.len();
        let mut slots: Vec<Option<&mut CudaSlice<E>>> = self.iter_mut().map(Some).collect();
        let mut views = Vec::with_capacity(params.len());
        for &param in params {
            let slot = slots.get_mut(param).and_then(Option::take).ok_or_else(|| {
                Error::State(format!(
                    "internal: parameter {param} asked for twice at once, or not among the \
                     {count} there are"
                ))
            })?;
            views.push(E::view_mut(slot));
        }
        f(&mut views)
    }
}

fn cuda(e: DriverError) -> Error {
    Error::from(crate::Error::from(e))
}

fn nccl(e: crate::Error) -> Error {
    Error::from(e)
}

/// Copies `len` elements from `src[src_at..]` to `dst[dst_at..]` on `stream`
/// (asynchronously, device to device).
fn copy_range(
    stream: &Arc<CudaStream>,
    src: &dyn DevicePtr<f32>,
    src_at: usize,
    dst: &mut dyn DevicePtrMut<f32>,
    dst_at: usize,
    len: usize,
) -> Result<()> {
    if len == 0 {
        return Ok(());
    }
    for (what, at, have) in [
        ("source", src_at, src.len()),
        ("destination", dst_at, dst.len()),
    ] {
        if at + len > have {
            return Err(Error::BufferSize {
                op: "device copy",
                what,
                got: have,
                expected: at + len,
            });
        }
    }
    let size = std::mem::size_of::<f32>();
    let (s, _gs) = src.device_ptr(stream);
    let (d, _gd) = dst.device_ptr_mut(stream);
    // SAFETY: both ranges lie inside live device buffers of f32 (checked
    // above) whose guards are held until the copy is queued; they belong to
    // different buffers (a parameter and an engine buffer).
    unsafe {
        cudarc::driver::result::memcpy_dtod_async(
            d + (dst_at * size) as u64,
            s + (src_at * size) as u64,
            len * size,
            stream.cu_stream(),
        )
    }
    .map_err(cuda)
}

/// Copies `len` elements of parameter view `src` from `src_at` into the f32
/// buffer `dst` at `dst_at`, widening 16-bit values.
fn read_view(
    kernels: &FusedKernels,
    stream: &Arc<CudaStream>,
    src: DeviceView<'_>,
    src_at: usize,
    dst: &mut CudaSlice<f32>,
    dst_at: usize,
    len: usize,
) -> Result<()> {
    let range = src_at..src_at + len;
    match src {
        DeviceView::F32(src) => return copy_range(stream, src, src_at, dst, dst_at, len),
        DeviceView::Bf16(src) => kernels.widen_ranges(stream, &[(dst_at, src, range)], dst, false),
        DeviceView::F16(src) => kernels.widen_ranges(stream, &[(dst_at, src, range)], dst, false),
    }
    .map_err(nccl)
}

/// Writes `buffer[c.at..]` into each parameter view of `views`, the
/// destinations of `copies` in order: one launch per dtype present.
fn write_views(
    kernels: &FusedKernels,
    stream: &Arc<CudaStream>,
    buffer: &CudaSlice<f32>,
    copies: &[ParamCopy],
    views: &mut [DeviceViewMut<'_>],
) -> Result<()> {
    let mut f32s: Vec<(usize, &mut dyn DevicePtrMut<f32>, Range<usize>)> = Vec::new();
    let mut bf16s: Vec<(usize, &mut dyn DevicePtrMut<bf16>, Range<usize>)> = Vec::new();
    let mut f16s: Vec<(usize, &mut dyn DevicePtrMut<f16>, Range<usize>)> = Vec::new();
    for (c, view) in copies.iter().zip(views.iter_mut()) {
        let range = c.param_range.clone();
        match view {
            DeviceViewMut::F32(dst) => f32s.push((c.at, &mut **dst, range)),
            DeviceViewMut::Bf16(dst) => bf16s.push((c.at, &mut **dst, range)),
            DeviceViewMut::F16(dst) => f16s.push((c.at, &mut **dst, range)),
        }
    }
    if !f32s.is_empty() {
        kernels
            .scatter_ranges(stream, buffer, &mut f32s)
            .map_err(nccl)?;
    }
    if !bf16s.is_empty() {
        kernels
            .narrow_ranges(stream, buffer, &mut bf16s)
            .map_err(nccl)?;
    }
    if !f16s.is_empty() {
        kernels
            .narrow_ranges(stream, buffer, &mut f16s)
            .map_err(nccl)?;
    }
    Ok(())
}

/// `copies` cut into consecutive runs of distinct parameters (a source
/// holds a parameter once at a time), each at most a launch's table.
fn distinct_runs(copies: &[ParamCopy]) -> Vec<&[ParamCopy]> {
    let mut runs = Vec::new();
    let mut start = 0;
    for (i, c) in copies.iter().enumerate() {
        let run = &copies[start..i];
        if run.len() == PIECES_PER_LAUNCH || run.iter().any(|r| r.param == c.param) {
            runs.push(run);
            start = i;
        }
    }
    if start < copies.len() {
        runs.push(&copies[start..]);
    }
    runs
}

fn check_range(op: &'static str, range: &Range<usize>, len: usize) -> Result<()> {
    if range.end > len || range.start > range.end {
        return Err(Error::BufferSize {
            op,
            what: "range",
            got: len,
            expected: range.end,
        });
    }
    Ok(())
}

/// The 16-bit staging of gathers in `slot` (a chunk to send, a gathered
/// bucket), grown to hold at least `n` and `all` values.
fn wire16<'a>(
    slot: &'a mut Option<(CudaSlice<u16>, CudaSlice<u16>)>,
    stream: &Arc<CudaStream>,
    n: usize,
    all: usize,
) -> Result<(&'a mut CudaSlice<u16>, &'a mut CudaSlice<u16>)> {
    let short = |b: &CudaSlice<u16>, len: usize| b.len() < len.max(1);
    if slot
        .as_ref()
        .is_none_or(|(s, r)| short(s, n) || short(r, all))
    {
        let (old_send, old_recv) = slot.take().map_or((0, 0), |(s, r)| (s.len(), r.len()));
        // SAFETY: every element read is written first (the narrowing writes
        // the chunk, the gather the bucket).
        let alloc = |len: usize| unsafe { stream.alloc::<u16>(len.max(1)) };
        *slot = Some((
            alloc(n.max(old_send)).map_err(cuda)?,
            alloc(all.max(old_recv)).map_err(cuda)?,
        ));
    }
    let (send16, recv16) = slot.as_mut().ok_or_else(short_wire)?;
    Ok((send16, recv16))
}

fn short_wire() -> Error {
    Error::State("internal: 16-bit gather staging too short".into())
}

/// All-gathers this rank's 16-bit chunk `send` into the staging `recv16`
/// and widens the gathered bucket into `recv[recv_range]`.
fn gather_widen<H: Half + zero_core::Element>(
    kernels: &FusedKernels,
    stream: &Arc<CudaStream>,
    comm: &impl DeviceComm,
    send: &CudaView<'_, H>,
    recv16: &mut CudaSlice<u16>,
    (recv, recv_range): (&mut CudaSlice<f32>, Range<usize>),
) -> Result<()> {
    let all = recv_range.len();
    // SAFETY: bf16 and f16 are 16-bit plain data, as u16 is.
    let mut narrow_recv = unsafe { recv16.transmute_mut::<H>(all) }.ok_or_else(short_wire)?;
    comm.all_gather_view(send, &mut narrow_recv)?;
    let narrow_recv = unsafe { recv16.transmute::<H>(all) }.ok_or_else(short_wire)?;
    kernels
        .widen_ranges(
            stream,
            &[(recv_range.start, &narrow_recv as &dyn DevicePtr<H>, 0..all)],
            recv,
            false,
        )
        .map_err(nccl)
}

/// The engine's buffers on one GPU: fused kernels, the norm accumulator,
/// and the optimizer's device state.
pub struct CudaMemory {
    /// Shared with stage 3's gathers, which round chunks to 16 bits.
    kernels: Arc<FusedKernels>,
    stream: Arc<CudaStream>,
    norm: NormAccumulator,
    /// Created at the first step or state import, when the pieces are known.
    optimizer: Option<DeviceOptimizer>,
    /// Steps taken by each owned piece, by `(name, offset)` (bias
    /// corrections and Adagrad's decay are per piece).
    piece_steps: BTreeMap<(String, usize), u64>,
    /// The thread that built it, when the stream is the per-thread default
    /// stream (work queued from another thread would not be ordered).
    owner: StreamOwner,
    /// While the engine defers completion (a backward pass whose buckets
    /// are reduced as they fill): the reductions' completion events, which
    /// the compute stream waits on only when the engine settles, so that
    /// the rest of backward runs beside them.
    deferred: Option<Vec<CudaEvent>>,
    /// How many of `deferred` the compute stream already waits on.
    fenced: usize,
    /// The 16-bit staging of gathers in the model's dtype (the rounded
    /// chunk, the gathered bucket), kept between buckets and steps: a
    /// device allocation per bucket would cost more than the bytes saved.
    wire16: Option<(CudaSlice<u16>, CudaSlice<u16>)>,
    /// The communicator's deadline, for the host's waits in transfers
    /// (the stream may wait on a collective that a dead peer never joins).
    timeout: Duration,
    /// Offload's transfers queued to and from page-locked host memory.
    transfers: super::pinned::Transfers,
    /// The stream they are queued on, where not the compute stream
    /// (`EngineConfig::offload_copy_stream`). (An earlier copy stream,
    /// with each upload's staging allocated on it and the host waiting
    /// for each bucket's copy during backward, measured slower on an H200:
    /// `bench gpu-zero`'s offloaded step 2.66x the plain one's against
    /// 2.29x on the compute stream.)
    copy: Option<Arc<CudaStream>>,
}

impl std::fmt::Debug for CudaMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaMemory")
            .field("arch", &self.kernels.arch())
            .field(
                "state_bytes",
                &self.optimizer.as_ref().map(DeviceOptimizer::state_bytes),
            )
            .finish()
    }
}

impl CudaMemory {
    /// Compiles the fused kernels for `comm`'s GPU (a few hundred
    /// milliseconds), and makes the device's memory pool keep what is freed
    /// ([`DevicePool::retain_freed`](crate::DevicePool::retain_freed)). The
    /// engine checks that its optimizer has a device kernel unless it is
    /// offloaded ([`ShardMemory::check_optimizer`]).
    pub fn new(comm: &impl DeviceComm) -> Result<Self> {
        let kernels = Arc::new(FusedKernels::new(comm.context()).map_err(nccl)?);
        // Training allocates its activations again every step: keep what
        // is freed in the device's pool instead of mapping it again after
        // each synchronization. (Without pools, Candle allocates with
        // cuMemAlloc and there is nothing to keep.)
        if comm.context().has_async_alloc() {
            if let Err(e) = crate::DevicePool::of(comm.context()).and_then(|p| p.retain_freed()) {
                tracing::warn!("the device's memory pool keeps CUDA's release threshold: {e}");
            }
        }
        let stream = comm.compute_stream().clone();
        let owner = StreamOwner::of(&stream);
        Ok(Self {
            norm: NormAccumulator::new(&stream).map_err(nccl)?,
            kernels,
            stream,
            optimizer: None,
            piece_steps: BTreeMap::new(),
            owner,
            deferred: None,
            fenced: 0,
            wire16: None,
            timeout: comm.timeout(),
            transfers: Default::default(),
            copy: None,
        })
    }

    /// The compiled kernels.
    pub fn kernels(&self) -> &FusedKernels {
        &self.kernels
    }

    /// Blocks the host until the stream has run everything queued so far,
    /// within the communicator's deadline: before a copy between host and
    /// device memory, which would otherwise wait in the driver, without a
    /// deadline, for a collective a dead peer never joins.
    fn drain_within(&self, op: &'static str) -> Result<()> {
        let stream = self.stream()?;
        let done = stream.record_event(None).map_err(cuda)?;
        crate::device_comm::host_wait(op, 0, &done, self.timeout).map_err(nccl)
    }

    /// [`ShardMemory::all_gather`] with the values on the wire in `H`: the
    /// chunk is rounded into a 16-bit staging buffer, gathered, and widened
    /// into `recv` (the write-back rounds the same values again, a no-op).
    /// Half the bytes of an f32 gather, for two small launches per bucket;
    /// the 16-bit staging stays allocated.
    fn all_gather_narrow<H: Half + zero_core::Element>(
        &mut self,
        comm: &impl DeviceComm,
        send: &CudaSlice<f32>,
        send_range: Range<usize>,
        recv: &mut CudaSlice<f32>,
        recv_range: Range<usize>,
    ) -> Result<()> {
        check_range("all_gather", &send_range, send.len())?;
        check_range("all_gather", &recv_range, recv.len())?;
        let stream = self.stream()?;
        let n = send_range.len();
        let (send16, recv16) = wire16(&mut self.wire16, &stream, n, recv_range.len())?;
        // SAFETY: bf16 and f16 are 16-bit plain data, as u16 is.
        let mut narrow_send = unsafe { send16.transmute_mut::<H>(n) }.ok_or_else(short_wire)?;
        self.kernels
            .narrow_ranges(
                &stream,
                send,
                &mut [(
                    send_range.start,
                    &mut narrow_send as &mut dyn DevicePtrMut<H>,
                    0..n,
                )],
            )
            .map_err(nccl)?;
        let narrow_send = unsafe { send16.transmute::<H>(n) }.ok_or_else(short_wire)?;
        gather_widen(
            &self.kernels,
            &stream,
            comm,
            &narrow_send,
            recv16,
            (recv, recv_range),
        )
    }

    /// The stream to queue work on, after checking that this thread may.
    fn stream(&self) -> Result<Arc<CudaStream>> {
        self.owner.check("the CUDA engine (CudaMemory)")?;
        Ok(self.stream.clone())
    }

    /// The device optimizer, created on first use with a state of
    /// `state_len` elements (the whole shard: the first step may pass only
    /// some of its pieces).
    fn device_optimizer(
        &mut self,
        optimizer: &dyn FunctionalOptimizer<f32>,
        state_len: usize,
    ) -> Result<&mut DeviceOptimizer> {
        if self.optimizer.is_none() {
            let stream = self.stream()?;
            self.optimizer = Some(DeviceOptimizer::new(optimizer, &stream, state_len)?);
        }
        match self.optimizer.as_mut() {
            Some(o) => Ok(o),
            None => unreachable!("created above"),
        }
    }
}

impl<C: DeviceComm> ShardMemory<f32, C> for CudaMemory {
    type Buffer = CudaSlice<f32>;
    type Gathers = DeviceGathers<C>;
    type Grad<'g> = DeviceView<'g>;
    type Params<'p> = dyn DeviceParams + 'p;

    fn grad_len(grad: &DeviceView<'_>) -> usize {
        grad.len()
    }

    fn check_optimizer(&self, optimizer: &dyn FunctionalOptimizer<f32>) -> Result<()> {
        DeviceOptimizer::check_kind(optimizer)
    }

    fn alloc_zeroed(&mut self, numel: usize) -> Result<CudaSlice<f32>> {
        // cudarc cannot allocate zero bytes; an empty buffer gets one spare
        // element that no range ever reaches.
        self.stream()?.alloc_zeros(numel.max(1)).map_err(cuda)
    }

    fn buffer_len(buffer: &CudaSlice<f32>) -> usize {
        buffer.len()
    }

    fn gathers(&self, comm: C) -> Result<DeviceGathers<C>> {
        if !Arc::ptr_eq(comm.compute_stream(), &self.stream) {
            return Err(Error::State(
                "internal: stage 3's gather communicator orders with another compute stream than \
                 the engine's memory"
                    .into(),
            ));
        }
        Ok(DeviceGathers::new(comm)
            .with_kernels(Arc::clone(&self.kernels))
            .tracking(self.transfers.pending())
            .owned_by(self.owner))
    }

    fn deferral(&mut self) -> Option<&mut dyn Deferral<C>> {
        Some(self)
    }

    fn packed_gathers(&mut self) -> Option<&mut dyn PackedGathers<C, CudaSlice<f32>>> {
        Some(self)
    }

    /// The 16-bit gather staging, kept between steps.
    fn staging_bytes(&self) -> usize {
        self.wire16
            .as_ref()
            .map_or(0, |(send, recv)| (send.len() + recv.len()) * 2)
    }

    fn zero(&mut self, buffer: &mut CudaSlice<f32>, range: Range<usize>) -> Result<()> {
        check_range("zero", &range, buffer.len())?;
        if range.is_empty() {
            return Ok(());
        }
        self.stream()?
            .memset_zeros(&mut buffer.slice_mut(range))
            .map_err(cuda)
    }

    fn flatten(
        &mut self,
        buffer: &mut CudaSlice<f32>,
        pieces: &[GradPiece<DeviceView<'_>>],
        add: bool,
    ) -> Result<()> {
        if pieces.is_empty() {
            return Ok(());
        }
        let stream = self.stream()?;
        // One launch per dtype present (a model has one, as a rule).
        let mut f32s = Vec::new();
        let mut bf16s = Vec::new();
        let mut f16s = Vec::new();
        for p in pieces {
            let range = p.range.clone();
            match p.grad {
                DeviceView::F32(g) => f32s.push((p.at, g, range)),
                DeviceView::Bf16(g) => bf16s.push((p.at, g, range)),
                DeviceView::F16(g) => f16s.push((p.at, g, range)),
            }
        }
        let k = &self.kernels;
        if !f32s.is_empty() {
            k.flatten_ranges(&stream, &f32s, buffer, add)
                .map_err(nccl)?;
        }
        if !bf16s.is_empty() {
            k.widen_ranges(&stream, &bf16s, buffer, add).map_err(nccl)?;
        }
        if !f16s.is_empty() {
            k.widen_ranges(&stream, &f16s, buffer, add).map_err(nccl)?;
        }
        Ok(())
    }

    fn copy_range(
        &mut self,
        dst: &mut CudaSlice<f32>,
        dst_at: usize,
        src: &CudaSlice<f32>,
        src_range: Range<usize>,
        add: bool,
    ) -> Result<()> {
        check_range("copy_range", &src_range, src.len())?;
        check_range("copy_range", &(dst_at..dst_at + src_range.len()), dst.len())?;
        if src_range.is_empty() {
            return Ok(());
        }
        let stream = self.stream()?;
        let entries: [(usize, &dyn DevicePtr<f32>, Range<usize>); 1] = [(dst_at, src, src_range)];
        self.kernels
            .flatten_ranges(&stream, &entries, dst, add)
            .map_err(nccl)
    }

    fn read_params(
        &mut self,
        params: &mut (dyn DeviceParams + '_),
        copies: &[ParamCopy],
        buffer: &mut CudaSlice<f32>,
    ) -> Result<()> {
        let stream = self.stream()?;
        for c in copies {
            params.with_param_range(c.param, c.param_range.clone(), &mut |src, start| {
                read_view(
                    &self.kernels,
                    &stream,
                    src,
                    start,
                    buffer,
                    c.at,
                    c.param_range.len(),
                )
            })?;
        }
        Ok(())
    }

    fn write_params(
        &mut self,
        params: &mut (dyn DeviceParams + '_),
        copies: &[ParamCopy],
        buffer: &CudaSlice<f32>,
    ) -> Result<()> {
        let stream = self.stream()?;
        for run in distinct_runs(copies) {
            let ids: Vec<usize> = run.iter().map(|c| c.param).collect();
            let mut done = 0;
            params.with_params_mut(&ids, &mut |views| {
                let part = run.get(done..done + views.len()).ok_or_else(|| {
                    Error::State("internal: the parameters' source handed more than asked".into())
                })?;
                done += views.len();
                write_views(&self.kernels, &stream, buffer, part, views)
            })?;
            if done != run.len() {
                return Err(Error::State(format!(
                    "internal: the parameters' source handed {done} of the {} parameters asked",
                    run.len()
                )));
            }
        }
        Ok(())
    }

    fn scale(
        &mut self,
        buffer: &mut CudaSlice<f32>,
        ranges: &[Range<usize>],
        factor: f64,
    ) -> Result<()> {
        let stream = self.stream()?;
        for range in ranges {
            check_range("scale", range, buffer.len())?;
            self.kernels
                .scale(&stream, &mut buffer.slice_mut(range.clone()), factor as f32)
                .map_err(nccl)?;
        }
        Ok(())
    }

    fn norm_partial(
        &mut self,
        comm: &C,
        buffer: &CudaSlice<f32>,
        ranges: &[Range<usize>],
        norm: NormType,
    ) -> Result<f64> {
        let kind = match norm {
            NormType::L1 => NormKind::L1,
            NormType::L2 => NormKind::L2,
            NormType::Inf => NormKind::Inf,
        };
        let stream = self.stream()?;
        self.norm.reset(&stream).map_err(nccl)?;
        for range in ranges {
            check_range("norm", range, buffer.len())?;
            self.kernels
                .norm_partial(&stream, &buffer.slice(range.clone()), kind, &mut self.norm)
                .map_err(nccl)?;
        }
        // The norm is needed on the host (the clipping coefficient, the
        // report): one synchronization, as with any clipping. The kernels
        // may sit behind a reduction stuck on a dead peer: wait within the
        // deadline before the copy blocks.
        comm.wait_compute("gradient norm")?;
        self.norm.read(&stream, kind).map_err(nccl)
    }

    fn all_reduce(
        &mut self,
        comm: &C,
        buffer: &mut CudaSlice<f32>,
        range: Range<usize>,
        op: ReduceOp,
    ) -> Result<()> {
        check_range("all_reduce", &range, buffer.len())?;
        self.stream()?;
        let mut view = buffer.slice_mut(range);
        match self.deferred.as_mut() {
            Some(events) => {
                events.push(comm.all_reduce_event(&mut view, op)?);
                Ok(())
            }
            None => comm.all_reduce_view(&mut view, op),
        }
    }

    fn reduce_scatter(
        &mut self,
        comm: &C,
        send: &CudaSlice<f32>,
        send_range: Range<usize>,
        recv: &mut CudaSlice<f32>,
        recv_range: Range<usize>,
        op: ReduceOp,
    ) -> Result<()> {
        check_range("reduce_scatter", &send_range, send.len())?;
        check_range("reduce_scatter", &recv_range, recv.len())?;
        self.stream()?;
        let (send, mut recv) = (send.slice(send_range), recv.slice_mut(recv_range));
        match self.deferred.as_mut() {
            Some(events) => {
                events.push(comm.reduce_scatter_event(&send, &mut recv, op)?);
                Ok(())
            }
            None => comm.reduce_scatter_view(&send, &mut recv, op),
        }
    }

    fn all_gather(
        &mut self,
        comm: &C,
        send: &CudaSlice<f32>,
        send_range: Range<usize>,
        recv: &mut CudaSlice<f32>,
        recv_range: Range<usize>,
    ) -> Result<()> {
        check_range("all_gather", &send_range, send.len())?;
        check_range("all_gather", &recv_range, recv.len())?;
        self.stream()?;
        comm.all_gather_view(&send.slice(send_range), &mut recv.slice_mut(recv_range))
    }

    fn all_gather_as(
        &mut self,
        comm: &C,
        send: &CudaSlice<f32>,
        send_range: Range<usize>,
        recv: &mut CudaSlice<f32>,
        recv_range: Range<usize>,
        wire: zero_core::DType,
    ) -> Result<()> {
        use zero_core::DType;
        match wire {
            DType::BF16 => self.all_gather_narrow::<bf16>(comm, send, send_range, recv, recv_range),
            DType::F16 => self.all_gather_narrow::<f16>(comm, send, send_range, recv, recv_range),
            DType::F32 | DType::F64 => self.all_gather(comm, send, send_range, recv, recv_range),
        }
    }

    fn all_reduce_host<V: zero_core::Element>(
        &mut self,
        comm: &C,
        values: &mut [V],
        op: ReduceOp,
    ) -> Result<()> {
        self.stream()?;
        // Through f64, exact for the f32 masks and f64 norms the engine sends.
        let mut wide: Vec<f64> = values.iter().map(|v| v.to_f64()).collect();
        comm.all_reduce_host(&mut wide, op)?;
        for (v, w) in values.iter_mut().zip(&wide) {
            *v = V::from_f64(*w);
        }
        Ok(())
    }

    fn gather_varlen_host(
        &mut self,
        comm: &C,
        send: &[f32],
        counts: &[usize],
        recv: Option<&mut [f32]>,
        root: usize,
    ) -> Result<()> {
        self.stream()?;
        comm.gather_varlen_host(send, counts, recv, root)
    }

    fn step(
        &mut self,
        optimizer: &mut dyn FunctionalOptimizer<f32>,
        params: &mut CudaSlice<f32>,
        grads: &CudaSlice<f32>,
        plan: ShardStep<'_>,
    ) -> Result<()> {
        let stream = self.stream()?;
        let slots: Vec<PieceSlot> = plan
            .pieces
            .iter()
            .map(|p| PieceSlot {
                range: p.range.clone(),
                group: p.key.group,
                step: self
                    .piece_steps
                    .get(&(p.key.name.clone(), p.key.offset))
                    .copied()
                    .unwrap_or(0)
                    + 1,
                active: p.active,
            })
            .collect();
        let segments = plan_segments(plan.buckets, plan.bucket_active, &slots);
        // Positions in the state are shard positions.
        let at_shard = |r: &Range<usize>| plan.origin + r.start..plan.origin + r.end;
        let state_len = plan
            .pieces
            .iter()
            .map(|p| at_shard(&p.range).end)
            .fold(plan.shard_len, usize::max);
        self.device_optimizer(optimizer, state_len)?;
        let Some(device) = self.optimizer.as_mut() else {
            unreachable!("created above");
        };
        // Hyperparameters may have changed since the last step (a schedule,
        // a new group): a few numbers per group.
        device.refresh(optimizer)?;
        let starting: Vec<(Range<usize>, usize)> = plan
            .pieces
            .iter()
            .zip(&slots)
            .filter(|(_, slot)| slot.active && slot.step == 1)
            .map(|(p, _)| (at_shard(&p.range), p.key.group))
            .collect();
        device.start_pieces(&stream, &starting)?;
        device.step(
            &self.kernels,
            &stream,
            params,
            grads,
            &segments,
            plan.origin,
            state_len,
        )?;
        for p in plan.pieces.iter().filter(|p| p.active) {
            *self
                .piece_steps
                .entry((p.key.name.clone(), p.key.offset))
                .or_default() += 1;
        }
        Ok(())
    }

    fn export_state(
        &mut self,
        comm: &C,
        _optimizer: &dyn FunctionalOptimizer<f32>,
        pieces: &[StepPiece<'_>],
    ) -> Result<OptimizerState<f32>> {
        let stream = self.stream()?;
        let Some(device) = self.optimizer.as_ref() else {
            return Ok(OptimizerState::default());
        };
        comm.wait_compute("exporting the optimizer state")?;
        device.export(&stream, pieces, &self.piece_steps)
    }

    fn import_state(
        &mut self,
        optimizer: &mut dyn FunctionalOptimizer<f32>,
        pieces: &[StepPiece<'_>],
        state: OptimizerState<f32>,
    ) -> Result<()> {
        let stream = self.stream()?;
        let steps = {
            let len = pieces.iter().map(|p| p.range.end).max().unwrap_or(0);
            let device = self.device_optimizer(optimizer, len)?;
            device.refresh(optimizer)?;
            device.import(&stream, pieces, state)?
        };
        for (key, step) in steps {
            self.piece_steps.insert(key, step);
        }
        Ok(())
    }

    fn state_bytes(&self, _optimizer: &dyn FunctionalOptimizer<f32>) -> usize {
        self.optimizer
            .as_ref()
            .map_or(0, DeviceOptimizer::state_bytes)
    }

    fn buffer_to_host(
        &mut self,
        comm: &C,
        buffer: &CudaSlice<f32>,
        range: Range<usize>,
        out: &mut [f32],
    ) -> Result<()> {
        check_range("buffer_to_host", &range, buffer.len())?;
        let stream = self.stream()?;
        comm.wait_compute("reading master weights")?;
        stream.memcpy_dtoh(&buffer.slice(range), out).map_err(cuda)
    }

    fn buffer_from_host(
        &mut self,
        buffer: &mut CudaSlice<f32>,
        at: usize,
        values: &[f32],
    ) -> Result<()> {
        let range = at..at + values.len();
        check_range("buffer_from_host", &range, buffer.len())?;
        if values.is_empty() {
            return Ok(());
        }
        // A copy from pageable memory synchronizes the stream first.
        self.drain_within("copying from host memory")?;
        self.stream()?
            .memcpy_htod(values, &mut buffer.slice_mut(range))
            .map_err(cuda)
    }

    fn read_param_host(
        &mut self,
        comm: &C,
        params: &mut (dyn DeviceParams + '_),
        param: usize,
        out: &mut [f32],
    ) -> Result<()> {
        let stream = self.stream()?;
        check_param_len(params, param, out.len(), "reading a parameter")?;
        // Staged in f32 on the device (16-bit parameters widen there).
        let mut staged = ShardMemory::<f32, C>::alloc_zeroed(self, out.len())?;
        let whole = ParamCopy {
            param,
            param_range: 0..out.len(),
            at: 0,
        };
        ShardMemory::<f32, C>::read_params(self, params, &[whole], &mut staged)?;
        comm.wait_compute("reading a parameter")?;
        stream
            .memcpy_dtoh(&staged.slice(0..out.len()), out)
            .map_err(cuda)
    }

    fn write_param_host(
        &mut self,
        params: &mut (dyn DeviceParams + '_),
        param: usize,
        values: &[f32],
    ) -> Result<()> {
        let stream = self.stream()?;
        check_param_len(params, param, values.len(), "writing a parameter")?;
        let mut staged = ShardMemory::<f32, C>::alloc_zeroed(self, values.len())?;
        if !values.is_empty() {
            self.drain_within("writing a parameter")?;
            stream
                .memcpy_htod(values, &mut staged.slice_mut(0..values.len()))
                .map_err(cuda)?;
        }
        let whole = ParamCopy {
            param,
            param_range: 0..values.len(),
            at: 0,
        };
        ShardMemory::<f32, C>::write_params(self, params, &[whole], &staged)
    }
}

/// Fails unless parameter `param` holds `len` elements.
fn check_param_len(
    params: &mut (dyn DeviceParams + '_),
    param: usize,
    len: usize,
    op: &'static str,
) -> Result<()> {
    params.with_param(param, &mut |view| {
        if view.len() == len {
            return Ok(());
        }
        Err(Error::BufferSize {
            op,
            what: "parameter",
            got: view.len(),
            expected: len,
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn copies(params: &[usize]) -> Vec<ParamCopy> {
        params
            .iter()
            .enumerate()
            .map(|(i, &param)| ParamCopy {
                param,
                param_range: 0..3,
                at: 3 * i,
            })
            .collect()
    }

    fn run_params(runs: &[&[ParamCopy]]) -> Vec<Vec<usize>> {
        runs.iter()
            .map(|run| run.iter().map(|c| c.param).collect())
            .collect()
    }

    #[test]
    fn write_back_runs_hold_each_parameter_once_in_order() {
        // A parameter written twice in one call (two runs of it in the
        // bucket) starts a new run: a source lends it once at a time.
        let all = copies(&[0, 1, 2, 1, 3, 3, 4]);
        let runs = distinct_runs(&all);
        assert_eq!(run_params(&runs), [vec![0, 1, 2], vec![1, 3], vec![3, 4]]);
        assert_eq!(runs.concat(), all);
        assert!(distinct_runs(&[]).is_empty());
    }

    #[test]
    fn write_back_runs_fit_a_launch_table() {
        let all = copies(&(0..150).collect::<Vec<_>>());
        let runs = distinct_runs(&all);
        let lens: Vec<usize> = runs.iter().map(|r| r.len()).collect();
        assert_eq!(
            lens,
            [
                PIECES_PER_LAUNCH,
                PIECES_PER_LAUNCH,
                150 - 2 * PIECES_PER_LAUNCH
            ]
        );
        assert_eq!(runs.concat(), all);
    }
}
