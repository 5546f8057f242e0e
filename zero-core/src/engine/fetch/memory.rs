//! Where stage 3's gathers run: the [`GatherMemory`] seam and its host
//! implementation, [`HostGathers`].

use super::units::UnitBucket;
use crate::engine::GatherBudgets;
use crate::{DType, Error, Result};
use std::ops::Range;
use std::sync::Arc;

/// All-gathers `send` (this rank's chunk of one bucket) into `recv` (the
/// whole bucket, every rank's chunk in rank order).
pub type GatherFn<T> = dyn Fn(&[T], &mut [T]) -> Result<()> + Send + Sync;

/// Where stage 3's gathers run: the parameter shard they read, the buffers
/// they fill, and the collective. The [`Fetcher`](super::Fetcher)'s
/// decisions (upcoming units, prefetch, budgets, pool) are the same over
/// every memory; this is what differs.
///
/// Host memory ([`HostGathers`]) gathers into vectors and returns when the
/// values are there (on the fetcher's thread, or the caller's). A device
/// memory *queues* each gather on a stream of its own and returns at once;
/// [`GatherMemory::ready`] then orders the caller's work (its compute
/// stream) after the gather, with no host wait, so the caller's thread
/// issues ahead without a thread of its own.
pub trait GatherMemory<T>: Send + Sync + 'static {
    /// This rank's parameter shard (the engine's buffer, lent to the
    /// fetcher between steps).
    type Shard: Send + Sync + 'static;
    /// The buffer one gather fills.
    type Buffer: Send + 'static;

    /// Whether [`GatherMemory::gather`] only queues the gather (see the
    /// trait's documentation).
    fn queues(&self) -> bool {
        false
    }

    /// The budgets stage 3 gathers with where the configuration leaves
    /// them unset: host memory's ([`GatherBudgets::HOST`]) unless the
    /// memory says otherwise (a device: [`GatherBudgets::DEVICE`]).
    fn default_budgets(&self) -> GatherBudgets {
        GatherBudgets::HOST
    }

    /// Stage 3 under master weights, asked once before the first gather:
    /// gather in the model's 16-bit `dtype` where this memory can (each
    /// rank's chunk rounded before it is sent: half the bytes, and layers
    /// compute with the buffer as it is instead of rounding it at every
    /// use). Default: the gathers stay in `T`.
    fn gather_in(&mut self, dtype: DType) {
        let _ = dtype;
    }

    /// Bytes one gathered element takes in a buffer (`T`'s unless
    /// [`GatherMemory::gather_in`] narrowed the gathers): what the
    /// budgets count.
    fn element_bytes(&self) -> usize {
        std::mem::size_of::<T>()
    }

    /// Elements of `shard`.
    fn shard_len(shard: &Self::Shard) -> usize;

    /// Elements `buffer` holds.
    fn capacity(buffer: &Self::Buffer) -> usize;

    /// A buffer of at least `len` elements: `reuse` (a pooled one) when it
    /// is large enough, else a new one (`reuse` is freed first).
    fn buffer(&self, reuse: Option<Self::Buffer>, len: usize) -> Result<Self::Buffer>;

    /// All-gathers each bucket: `shard[bucket.shard]` of every rank, in
    /// rank order, into `buffer[bucket.at]`. A collective on the fetcher's
    /// own communicator.
    fn gather(
        &self,
        shard: &Self::Shard,
        buckets: &[UnitBucket],
        buffer: &mut Self::Buffer,
    ) -> Result<()>;

    /// [`GatherMemory::gather`] from a parameter shard in host memory (an
    /// offloaded one): each bucket's chunk is brought to this memory first.
    fn gather_from_host(
        &self,
        shard: &[T],
        buckets: &[UnitBucket],
        buffer: &mut Self::Buffer,
    ) -> Result<()> {
        let _ = (shard, buckets, buffer);
        Err(Error::Config(
            "stage 3 cannot gather from a parameter shard in host memory on this memory".into(),
        ))
    }

    /// Orders what the caller does next after `buffer`'s gather: its reads
    /// of the buffer, and its writes of the shard (a step). Called whenever
    /// a gathered buffer leaves the fetcher's hands or is let go.
    fn ready(&self, _buffer: &mut Self::Buffer) -> Result<()> {
        Ok(())
    }

    /// Copies `buffer[range]` into `out` (on the host), after its gather
    /// (values gathered in a narrower dtype, widened).
    fn read(&self, buffer: &Self::Buffer, range: Range<usize>, out: &mut [T]) -> Result<()>;

    /// Bytes the gathers' communicator has sent
    /// ([`Communicator::bytes_sent`](crate::Communicator::bytes_sent)).
    /// Default 0: a memory that does not count them.
    fn bytes_sent(&self) -> u64 {
        0
    }
}

/// Stage 3's gathers in host memory: vectors, gathered by `all_gather`
/// (a collective on the fetcher's own communicator).
pub struct HostGathers<T> {
    all_gather: Arc<GatherFn<T>>,
    /// What the communicator behind `all_gather` has sent, where known.
    sent: Option<Arc<dyn Fn() -> u64 + Send + Sync>>,
}

impl<T> HostGathers<T> {
    /// Gathers with `all_gather`, one call per bucket.
    pub fn new(all_gather: Arc<GatherFn<T>>) -> Self {
        Self {
            all_gather,
            sent: None,
        }
    }

    /// These gathers, reporting as [`GatherMemory::bytes_sent`] what
    /// `sent` says their communicator has sent.
    pub fn counting(self, sent: Arc<dyn Fn() -> u64 + Send + Sync>) -> Self {
        Self {
            sent: Some(sent),
            ..self
        }
    }
}

impl<T: crate::Element> GatherMemory<T> for HostGathers<T> {
    type Shard = Vec<T>;
    type Buffer = Vec<T>;

    fn shard_len(shard: &Vec<T>) -> usize {
        shard.len()
    }

    fn capacity(buffer: &Vec<T>) -> usize {
        buffer.capacity()
    }

    fn buffer(&self, reuse: Option<Vec<T>>, len: usize) -> Result<Vec<T>> {
        let mut buffer = reuse.unwrap_or_default();
        if buffer.capacity() < len {
            // Freed before the larger one is made.
            drop(std::mem::take(&mut buffer));
            buffer = Vec::with_capacity(len);
        }
        buffer.resize(len, T::default());
        Ok(buffer)
    }

    fn gather(&self, shard: &Vec<T>, buckets: &[UnitBucket], buffer: &mut Vec<T>) -> Result<()> {
        self.gather_from_host(shard, buckets, buffer)
    }

    fn gather_from_host(
        &self,
        shard: &[T],
        buckets: &[UnitBucket],
        buffer: &mut Vec<T>,
    ) -> Result<()> {
        for bucket in buckets {
            (self.all_gather)(&shard[bucket.shard.clone()], &mut buffer[bucket.at.clone()])?;
        }
        Ok(())
    }

    fn read(&self, buffer: &Vec<T>, range: Range<usize>, out: &mut [T]) -> Result<()> {
        out.copy_from_slice(&buffer[range]);
        Ok(())
    }

    fn bytes_sent(&self) -> u64 {
        self.sent.as_ref().map_or(0, |sent| sent())
    }
}
