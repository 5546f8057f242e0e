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

use super::pinned::{track, Pending};
use crate::device_comm::{host_wait, StreamOwner};
use crate::DeviceComm;
use cudarc::driver::{CudaEvent, CudaSlice, CudaStream, DriverError};
use std::ops::Range;
use std::sync::Arc;
use zero_core::engine::{GatherBudgets, GatherMemory, UnitBucket};
use zero_core::{Error, Result};

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
}

impl<C: DeviceComm> DeviceGathers<C> {
    /// Gathers over `comm`, ordered with its compute stream.
    pub fn new(comm: C) -> Self {
        let owner = StreamOwner::of(comm.compute_stream());
        Self {
            comm,
            host_reads: None,
            owner,
        }
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

/// A buffer of [`DeviceGathers`]: device memory, and the event its last
/// gather completes at until the compute stream waits on it.
pub struct DeviceGather {
    /// First, so that it is dropped (waited on) before the memory below
    /// is freed.
    done: GatherDone,
    values: CudaSlice<f32>,
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
    pub fn new(values: CudaSlice<f32>, stream: Arc<CudaStream>) -> Self {
        let owner = StreamOwner::of(&stream);
        Self::owned_by(values, stream, owner)
    }

    fn owned_by(values: CudaSlice<f32>, stream: Arc<CudaStream>, owner: StreamOwner) -> Self {
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
    pub fn values(&self) -> &CudaSlice<f32> {
        &self.values
    }

    /// The device memory itself (no copy), to lend on as a tensor storage
    /// for the length of one computation ([`DeviceGather::new`] takes it
    /// back). The fetcher hands out buffers whose gather the compute
    /// stream already waits on.
    pub fn into_values(self) -> CudaSlice<f32> {
        let Self { done, values } = self;
        // Makes the compute stream wait for a gather still queued.
        drop(done);
        values
    }
}

/// `bucket`'s chunk of a shard of `shard_len` elements and its place in
/// `buffer`, both checked in bounds.
fn in_bounds<'b>(
    bucket: &'b UnitBucket,
    shard_len: usize,
    buffer: &DeviceGather,
) -> Result<(&'b Range<usize>, &'b Range<usize>)> {
    let (send, at) = (&bucket.shard, &bucket.at);
    if send.end > shard_len || at.end > buffer.values.len() {
        return Err(Error::State(format!(
            "internal: a stage-3 gather of shard {send:?} into {at:?} is out of bounds ({} and \
             {} elements)",
            shard_len,
            buffer.values.len()
        )));
    }
    Ok((send, at))
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

    fn shard_len(shard: &CudaSlice<f32>) -> usize {
        shard.len()
    }

    fn capacity(buffer: &DeviceGather) -> usize {
        buffer.values.len()
    }

    fn buffer(&self, reuse: Option<DeviceGather>, len: usize) -> Result<DeviceGather> {
        match reuse {
            Some(buffer) if buffer.values.len() >= len => Ok(buffer),
            reuse => {
                // Freed (in compute-stream order, after the layers that
                // read it) before the larger one is made.
                drop(reuse);
                let stream = self.stream()?.clone();
                // SAFETY: uninitialized device memory (no zero-filling
                // pass): every gather writes the unit's elements before
                // anything reads them, and nothing reads past a unit.
                let values = unsafe { stream.alloc::<f32>(len.max(1)) }.map_err(cuda)?;
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
        if !buckets.is_empty() {
            // The unit's buckets in one collective (one NCCL group, one pass
            // of cuda-threads' protocol), bounds checked there.
            let done = self
                .comm
                .all_gather_buckets_event(shard, &mut buffer.values, buckets)?;
            buffer.done.event = Some(done);
        }
        Ok(())
    }

    /// Each chunk is copied on the compute stream (after the host step
    /// that wrote it, and after the layers that last read the buffer)
    /// straight into this rank's slot of its place in the buffer, and
    /// gathered there in place: no device memory beyond the buffer.
    fn gather_from_host(
        &self,
        shard: &[f32],
        buckets: &[UnitBucket],
        buffer: &mut DeviceGather,
    ) -> Result<()> {
        let stream = self.stream()?;
        let (rank, world_size) = (self.comm.rank(), self.comm.world_size());
        for bucket in buckets {
            let (send, at) = in_bounds(bucket, shard.len(), buffer)?;
            if at.len() != world_size * send.len() {
                return Err(Error::State(format!(
                    "internal: a stage-3 gather of {} elements per rank into {at:?} is not \
                     {world_size} ranks' worth",
                    send.len()
                )));
            }
            if !send.is_empty() {
                let slot = at.start + rank * send.len();
                let mut mine = buffer.values.slice_mut(slot..slot + send.len());
                stream
                    .memcpy_htod(&shard[send.clone()], &mut mine)
                    .map_err(cuda)?;
            }
        }
        if !buckets.is_empty() {
            // Every chunk is in its slot: the buckets gathered in place, in
            // one collective.
            let done = self
                .comm
                .all_gather_buckets_in_place_event(&mut buffer.values, buckets)?;
            buffer.done.event = Some(done);
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
        stream
            .memcpy_dtoh(&buffer.values.slice(range), out)
            .map_err(cuda)
    }

    fn bytes_sent(&self) -> u64 {
        self.comm.bytes_sent()
    }
}
