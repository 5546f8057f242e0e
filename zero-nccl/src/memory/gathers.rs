//! Stage 3's parameter gathers in device memory: [`DeviceGathers`].
//!
//! The fetcher's logic (plan, prefetch, budgets, pool) is `zero-core`'s,
//! the same as on the host; this supplies the buffers and the collective.
//! A gather is *queued*: each bucket's all-gather goes on the gather
//! communicator's own stream, after what the compute stream has queued so
//! far (so a pooled buffer is never refilled while a layer still reads it,
//! and the shard is never read while a step writes it), and returns at
//! once. When a layer takes the buffer, the compute stream waits on the
//! gather's completion event: no host wait per layer, and the gathers of
//! the next layers run beside the current one's compute.
//!
//! Under a 16-bit model ([`GatherMemory::gather_in`]) each rank's chunk of
//! f32 masters is rounded on the compute stream into its slot of a 16-bit
//! buffer and gathered there in place: half the bytes on the wire and in
//! the buffer, and layers compute with the buffer as it is (the values the
//! write-back gives a replicated weight) instead of rounding at each use.

use super::pinned::{track, Pending};
use crate::device_comm::{host_wait, StreamOwner};
use crate::kernels::{FusedKernels, Half};
use crate::DeviceComm;
use cudarc::driver::{CudaEvent, CudaSlice, CudaStream, DeviceRepr, DriverError};
use half::{bf16, f16};
use std::ops::Range;
use std::sync::Arc;
use zero_core::engine::{GatherBudgets, GatherMemory, UnitBucket};
use zero_core::{DType, Element, Error, Result};

fn cuda(e: DriverError) -> Error {
    Error::from(crate::Error::from(e))
}

/// Stage 3's gathers on the GPU over communicator `C` (split from the
/// engine's for them: its own stream, the engine's compute stream).
pub struct DeviceGathers<C> {
    comm: C,
    /// Where the copies out of an offloaded (page-locked) shard are
    /// tracked, so that unlocking its pages waits for them.
    host_reads: Option<Pending>,
    /// The thread the compute stream belongs to, where it is the
    /// per-thread default stream.
    owner: StreamOwner,
    /// The kernels that round chunks into 16-bit buffers; without them
    /// the gathers stay in f32.
    kernels: Option<Arc<FusedKernels>>,
    /// The 16-bit dtype gathers are in (`gather_in`), or `None`: f32.
    narrow: Option<DType>,
}

impl<C: DeviceComm> DeviceGathers<C> {
    /// Gathers over `comm`, ordered with its compute stream.
    pub fn new(comm: C) -> Self {
        let owner = StreamOwner::of(comm.compute_stream());
        Self {
            comm,
            host_reads: None,
            owner,
            kernels: None,
            narrow: None,
        }
    }

    /// These gathers, able to gather in a 16-bit dtype with `kernels`.
    pub(super) fn with_kernels(mut self, kernels: Arc<FusedKernels>) -> Self {
        self.kernels = Some(kernels);
        self
    }

    /// These gathers, used from `owner`'s thread only (the engine's, when
    /// its stream is the per-thread default stream).
    pub(super) fn owned_by(mut self, owner: StreamOwner) -> Self {
        self.owner = owner;
        self
    }

    /// The compute stream, after checking that this thread may use it.
    fn stream(&self) -> Result<&Arc<CudaStream>> {
        self.owner.check("stage 3's gathers (DeviceGathers)")?;
        Ok(self.comm.compute_stream())
    }

    /// These gathers, tracking their copies out of a host shard in
    /// `pending` (the page-locks' transfers).
    pub(super) fn tracking(mut self, pending: Pending) -> Self {
        self.host_reads = Some(pending);
        self
    }
}

/// A buffer of [`DeviceGather`]: device memory, and the event its last
/// gather completes at until the compute stream waits on it.
pub struct DeviceGather {
    /// First, so that it is dropped (waited on) before the memory below
    /// is freed.
    done: GatherDone,
    values: GatherValues,
}

/// What a [`DeviceGather`] holds: f32 masters, or masters rounded to a
/// 16-bit model's dtype.
#[derive(Debug)]
pub enum GatherValues {
    /// Masters as they are.
    F32(CudaSlice<f32>),
    /// Rounded to a bf16 model's dtype.
    BF16(CudaSlice<bf16>),
    /// Rounded to an f16 model's dtype.
    F16(CudaSlice<f16>),
}

impl GatherValues {
    /// Elements held.
    pub fn len(&self) -> usize {
        match self {
            Self::F32(v) => v.len(),
            Self::BF16(v) => v.len(),
            Self::F16(v) => v.len(),
        }
    }

    /// Whether it holds no element.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        match self {
            Self::F32(_) => DType::F32,
            Self::BF16(_) => DType::BF16,
            Self::F16(_) => DType::F16,
        }
    }

    /// `len` uninitialized elements of `dtype` (f32 unless 16-bit) on
    /// `stream`.
    ///
    /// # Safety
    /// Nothing may read an element before something writes it.
    unsafe fn alloc(stream: &Arc<CudaStream>, dtype: DType, len: usize) -> Result<Self> {
        Ok(match dtype {
            DType::BF16 => Self::BF16(stream.alloc::<bf16>(len).map_err(cuda)?),
            DType::F16 => Self::F16(stream.alloc::<f16>(len).map_err(cuda)?),
            DType::F32 | DType::F64 => Self::F32(stream.alloc::<f32>(len).map_err(cuda)?),
        })
    }
}

impl From<CudaSlice<f32>> for GatherValues {
    fn from(values: CudaSlice<f32>) -> Self {
        Self::F32(values)
    }
}

impl From<CudaSlice<bf16>> for GatherValues {
    fn from(values: CudaSlice<bf16>) -> Self {
        Self::BF16(values)
    }
}

impl From<CudaSlice<f16>> for GatherValues {
    fn from(values: CudaSlice<f16>) -> Self {
        Self::F16(values)
    }
}

/// A queued gather's completion event, and the compute stream, which
/// frees the buffer's memory: dropped with the gather still queued (the
/// fetcher dropped with a prefetch in flight), the stream waits for it
/// first.
struct GatherDone {
    event: Option<CudaEvent>,
    stream: Arc<CudaStream>,
    /// The thread `stream` belongs to, where it is the per-thread default
    /// stream.
    owner: StreamOwner,
}

impl Drop for GatherDone {
    fn drop(&mut self) {
        let Some(done) = self.event.take() else {
            return;
        };
        if let Err(e) = self.owner.check("a stage-3 gather buffer (DeviceGather)") {
            // Here the stream's handle names this thread's stream, and a
            // wait on it would order nothing: the host waits instead, so
            // that the gather has run before the memory can be freed.
            tracing::warn!("dropping a queued gather: {e}");
            let waited = host_wait(
                "stage 3: a gather buffer dropped on another thread",
                0,
                &done,
                zero_core::comm::DEFAULT_TIMEOUT,
            );
            if let Err(e) = waited {
                tracing::warn!("a dropped gather buffer's gather did not finish: {e}");
            }
            return;
        }
        if let Err(e) = self.stream.wait(&done) {
            tracing::warn!("dropping a queued gather: the compute stream cannot wait on it: {e}");
        }
    }
}

impl DeviceGather {
    /// A buffer over `values`, with nothing queued into it, whose memory
    /// `stream` (the compute stream) frees: a buffer lent on as a tensor
    /// storage, given back.
    /// Use it from the calling thread only where `stream` is the
    /// per-thread default stream.
    pub fn new(values: impl Into<GatherValues>, stream: Arc<CudaStream>) -> Self {
        let owner = StreamOwner::of(&stream);
        Self::owned_by(values.into(), stream, owner)
    }

    fn owned_by(values: GatherValues, stream: Arc<CudaStream>, owner: StreamOwner) -> Self {
        Self {
            done: GatherDone {
                event: None,
                stream,
                owner,
            },
            values,
        }
    }

    /// The gathered values (the whole buffer; a unit's lie at the start).
    /// Read them on the compute stream only once the fetcher handed the
    /// buffer out (it made the stream wait for the gather).
    pub fn values(&self) -> &GatherValues {
        &self.values
    }

    /// The device memory itself (no copy), to lend on as a tensor storage
    /// for the length of one computation ([`DeviceGather::new`] takes it
    /// back). The fetcher hands out buffers whose gather the compute
    /// stream already waits on.
    pub fn into_values(self) -> GatherValues {
        let Self { done, values } = self;
        // Makes the compute stream wait for a gather still queued.
        drop(done);
        values
    }
}

/// For each bucket, its chunk of a shard of `shard_len` elements and this
/// rank's slot of its place in a buffer of `buffer_len` elements (where
/// the chunk goes before an in-place gather), both checked in bounds.
fn slots(
    buckets: &[UnitBucket],
    (rank, world_size): (usize, usize),
    shard_len: usize,
    buffer_len: usize,
) -> Result<Vec<(Range<usize>, Range<usize>)>> {
    buckets
        .iter()
        .map(|bucket| {
            let (send, at) = (&bucket.shard, &bucket.at);
            if send.end > shard_len || at.end > buffer_len {
                return Err(Error::State(format!(
                    "internal: a stage-3 gather of shard {send:?} into {at:?} is out of bounds \
                     ({shard_len} and {buffer_len} elements)"
                )));
            }
            if at.len() != world_size * send.len() {
                return Err(Error::State(format!(
                    "internal: a stage-3 gather of {} elements per rank into {at:?} is not \
                     {world_size} ranks' worth",
                    send.len()
                )));
            }
            let slot = at.start + rank * send.len();
            Ok((send.clone(), slot..slot + send.len()))
        })
        .collect()
}

/// The error of a buffer whose dtype is not the gathers'.
fn mismatched(buffer: &GatherValues, narrow: Option<DType>) -> Error {
    Error::State(format!(
        "internal: a stage-3 gather into a {:?} buffer where the gathers are in {:?}",
        buffer.dtype(),
        narrow.unwrap_or(DType::F32)
    ))
}

impl<C: DeviceComm> DeviceGathers<C> {
    /// This rank's slots of `buckets` (see [`slots`]).
    fn slots(
        &self,
        buckets: &[UnitBucket],
        shard_len: usize,
        buffer: &DeviceGather,
    ) -> Result<Vec<(Range<usize>, Range<usize>)>> {
        let ranks = (self.comm.rank(), self.comm.world_size());
        slots(buckets, ranks, shard_len, buffer.values.len())
    }

    /// `from` (f32: the shard, or chunks staged from the host), each
    /// `(offset, slot)` rounded into its slot of `values` on the compute
    /// stream, then the buckets gathered in place: the completion event.
    fn narrow_and_gather<H: Half + Element>(
        &self,
        from: &CudaSlice<f32>,
        pieces: &[(usize, Range<usize>)],
        values: &mut CudaSlice<H>,
        buckets: &[UnitBucket],
    ) -> Result<CudaEvent> {
        let stream = self.stream()?;
        let kernels = self.kernels.as_ref().ok_or_else(|| {
            Error::State("internal: 16-bit stage-3 gathers without their kernels".into())
        })?;
        kernels
            .narrow_into(stream, from, values, pieces)
            .map_err(Error::from)?;
        self.comm.all_gather_buckets_in_place_event(values, buckets)
    }

    /// [`DeviceGathers::narrow_and_gather`] into whichever 16-bit buffer
    /// `buffer` holds.
    fn narrowed(
        &self,
        from: &CudaSlice<f32>,
        pieces: &[(usize, Range<usize>)],
        buffer: &mut DeviceGather,
        buckets: &[UnitBucket],
    ) -> Result<CudaEvent> {
        match &mut buffer.values {
            GatherValues::BF16(values) => self.narrow_and_gather(from, pieces, values, buckets),
            GatherValues::F16(values) => self.narrow_and_gather(from, pieces, values, buckets),
            other => Err(mismatched(other, self.narrow)),
        }
    }
}

/// `values[range]` copied to the host and widened into `out`.
fn read_widened<H: Element + DeviceRepr>(
    stream: &Arc<CudaStream>,
    values: &CudaSlice<H>,
    range: Range<usize>,
    out: &mut [f32],
) -> Result<()> {
    let mut narrow = vec![H::default(); range.len()];
    stream
        .memcpy_dtoh(&values.slice(range), &mut narrow)
        .map_err(cuda)?;
    zero_core::engine::convert_slice(&narrow, out);
    Ok(())
}

impl<C: DeviceComm> GatherMemory<f32> for DeviceGathers<C> {
    type Shard = CudaSlice<f32>;
    type Buffer = DeviceGather;

    /// A device's: a layer in one GEMM, DeepSpeed's prefetch and live
    /// limits.
    fn default_budgets(&self) -> GatherBudgets {
        GatherBudgets::DEVICE
    }

    fn queues(&self) -> bool {
        true
    }

    /// Only with the kernels to round with, and only to bf16 or f16.
    fn gather_in(&mut self, dtype: DType) {
        if self.kernels.is_some() && matches!(dtype, DType::BF16 | DType::F16) {
            self.narrow = Some(dtype);
        }
    }

    fn element_bytes(&self) -> usize {
        self.narrow.map_or(4, DType::size_in_bytes)
    }

    fn shard_len(shard: &CudaSlice<f32>) -> usize {
        shard.len()
    }

    fn capacity(buffer: &DeviceGather) -> usize {
        buffer.values.len()
    }

    fn buffer(&self, reuse: Option<DeviceGather>, len: usize) -> Result<DeviceGather> {
        let dtype = self.narrow.unwrap_or(DType::F32);
        match reuse {
            Some(buffer) if buffer.values.len() >= len && buffer.values.dtype() == dtype => {
                Ok(buffer)
            }
            reuse => {
                // Freed (in compute-stream order, after the layers that
                // read it) before the larger one is made.
                drop(reuse);
                let stream = self.stream()?.clone();
                // SAFETY: uninitialized device memory (no zero-filling
                // pass): every gather writes the unit's elements before
                // anything reads them, and nothing reads past a unit.
                let values = unsafe { GatherValues::alloc(&stream, dtype, len.max(1)) }?;
                Ok(DeviceGather::owned_by(values, stream, self.owner))
            }
        }
    }

    fn gather(
        &self,
        shard: &CudaSlice<f32>,
        buckets: &[UnitBucket],
        buffer: &mut DeviceGather,
    ) -> Result<()> {
        self.stream()?;
        if buckets.is_empty() {
            return Ok(());
        }
        let done = match (&mut buffer.values, self.narrow) {
            // The unit's buckets in one collective (one NCCL group, one
            // pass of cuda-threads' protocol), bounds checked there.
            (GatherValues::F32(values), None) => {
                self.comm.all_gather_buckets_event(shard, values, buckets)?
            }
            (_, Some(_)) => {
                let slots = self.slots(buckets, shard.len(), buffer)?;
                let pieces: Vec<(usize, Range<usize>)> = slots
                    .into_iter()
                    .map(|(send, slot)| (send.start, slot))
                    .collect();
                self.narrowed(shard, &pieces, buffer, buckets)?
            }
            (other, None) => return Err(mismatched(other, None)),
        };
        buffer.done.event = Some(done);
        Ok(())
    }

    /// Each chunk is copied on the compute stream (after the host step
    /// that wrote it, and after the layers that last read the buffer)
    /// straight into this rank's slot of its place in the buffer, and
    /// gathered there in place: no device memory beyond the buffer. In a
    /// 16-bit buffer the chunks are staged in f32 on the device first and
    /// rounded into their slots.
    fn gather_from_host(
        &self,
        shard: &[f32],
        buckets: &[UnitBucket],
        buffer: &mut DeviceGather,
    ) -> Result<()> {
        let stream = self.stream()?;
        let slots = self.slots(buckets, shard.len(), buffer)?;
        let done = match (&mut buffer.values, self.narrow) {
            (GatherValues::F32(values), None) => {
                for (send, slot) in slots.iter().filter(|(send, _)| !send.is_empty()) {
                    let mut mine = values.slice_mut(slot.clone());
                    stream
                        .memcpy_htod(&shard[send.clone()], &mut mine)
                        .map_err(cuda)?;
                }
                // Every chunk is in its slot: the buckets gathered in
                // place, in one collective.
                (!buckets.is_empty())
                    .then(|| self.comm.all_gather_buckets_in_place_event(values, buckets))
                    .transpose()?
            }
            (_, Some(_)) => {
                let staged_len = slots.iter().map(|(send, _)| send.len()).sum::<usize>();
                // SAFETY: every element is copied into below before the
                // rounding reads it.
                let mut staged = unsafe { stream.alloc::<f32>(staged_len.max(1)) }.map_err(cuda)?;
                let mut pieces = Vec::with_capacity(slots.len());
                let mut at = 0;
                for (send, slot) in slots {
                    if !send.is_empty() {
                        let mut into = staged.slice_mut(at..at + send.len());
                        stream
                            .memcpy_htod(&shard[send.clone()], &mut into)
                            .map_err(cuda)?;
                    }
                    pieces.push((at, slot));
                    at += send.len();
                }
                // `staged` is freed in stream order, after the rounding.
                (!buckets.is_empty())
                    .then(|| self.narrowed(&staged, &pieces, buffer, buckets))
                    .transpose()?
            }
            (other, None) => return Err(mismatched(other, None)),
        };
        if done.is_some() {
            buffer.done.event = done;
        }
        // From page-locked memory the copies are asynchronous: its pages
        // stay locked (and the shard allocated) until they are done.
        if let Some(pending) = &self.host_reads {
            let copied = stream.record_event(None).map_err(cuda)?;
            track(pending, Arc::new(copied));
        }
        Ok(())
    }

    fn ready(&self, buffer: &mut DeviceGather) -> Result<()> {
        let stream = self.stream()?;
        match buffer.done.event.take() {
            Some(done) => stream.wait(&done).map_err(cuda),
            None => Ok(()),
        }
    }

    fn read(&self, buffer: &DeviceGather, range: Range<usize>, out: &mut [f32]) -> Result<()> {
        if range.end > buffer.values.len() || range.len() != out.len() {
            return Err(Error::State(format!(
                "internal: reading {range:?} of a {}-element gather into {} elements",
                buffer.values.len(),
                out.len()
            )));
        }
        if range.is_empty() {
            return Ok(());
        }
        let stream = self.stream()?;
        self.comm
            .wait_compute("stage 3: reading gathered parameters")?;
        match &buffer.values {
            GatherValues::F32(values) => {
                stream.memcpy_dtoh(&values.slice(range), out).map_err(cuda)
            }
            GatherValues::BF16(values) => read_widened(stream, values, range, out),
            GatherValues::F16(values) => read_widened(stream, values, range, out),
        }
    }

    fn bytes_sent(&self) -> u64 {
        self.comm.bytes_sent()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bucket(shard: Range<usize>, at: Range<usize>) -> UnitBucket {
        UnitBucket { shard, at }
    }

    #[test]
    fn each_chunk_goes_to_this_rank_s_slot_of_its_bucket() {
        // Two buckets of a unit on two ranks: 3 and 2 elements a rank.
        let buckets = [bucket(4..7, 0..6), bucket(7..9, 6..10)];
        let at_rank = |rank| slots(&buckets, (rank, 2), 9, 10).unwrap();
        assert_eq!(at_rank(0), vec![(4..7, 0..3), (7..9, 6..8)]);
        assert_eq!(at_rank(1), vec![(4..7, 3..6), (7..9, 8..10)]);
        // One rank: the chunk is the whole place.
        let one = [bucket(2..5, 10..13)];
        assert_eq!(slots(&one, (0, 1), 5, 13).unwrap(), vec![(2..5, 10..13)]);
    }

    #[test]
    fn a_place_that_is_not_every_rank_s_chunk_or_out_of_bounds_is_refused() {
        let uneven = [bucket(0..3, 0..7)];
        assert!(slots(&uneven, (0, 2), 3, 7).is_err(), "7 is not 2 x 3");
        let past_shard = [bucket(2..5, 0..6)];
        assert!(slots(&past_shard, (0, 2), 4, 6).is_err(), "shard of 4");
        let past_buffer = [bucket(0..3, 2..8)];
        assert!(slots(&past_buffer, (1, 2), 3, 7).is_err(), "buffer of 7");
    }
}
