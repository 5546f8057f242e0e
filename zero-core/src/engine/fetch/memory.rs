//! Where stage 3's gathers run: the [`GatherMemory`] seam and its host
//! implementation, [`HostGathers`].

use super::units::UnitBucket;
use crate::engine::GatherBudgets;
use crate::{DType, Error, Result};
use half::{bf16, f16};
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
/// (a collective on the fetcher's own communicator), or, asked to gather
/// in a 16-bit dtype ([`GatherMemory::gather_in`]) and given the 16-bit
/// collectives ([`HostGathers::narrowing`]), each rank's chunk rounded to
/// it and gathered as such: half the bytes on the wire and in the buffer.
pub struct HostGathers<T> {
    all_gather: Arc<GatherFn<T>>,
    /// What the communicator behind `all_gather` has sent, where known.
    sent: Option<Arc<dyn Fn() -> u64 + Send + Sync>>,
    /// The all-gathers of 16-bit values, where given.
    narrowing: Option<Narrowing>,
    /// The 16-bit dtype the gathers are in, once asked.
    narrow: Option<DType>,
}

/// [`HostGathers`]' all-gathers of bf16 and of f16 values.
struct Narrowing {
    bf16: Arc<GatherFn<bf16>>,
    f16: Arc<GatherFn<f16>>,
}

/// A buffer of [`HostGathers`]: the gathered values in `T`, or rounded to
/// a 16-bit model's dtype.
#[derive(Debug)]
pub enum HostGather<T> {
    /// In the engine's element type.
    Wide(Vec<T>),
    /// Rounded to bf16.
    BF16(Vec<bf16>),
    /// Rounded to f16.
    F16(Vec<f16>),
}

impl<T: crate::Element> HostGather<T> {
    /// The element type held.
    pub fn dtype(&self) -> DType {
        match self {
            Self::Wide(_) => T::DTYPE,
            Self::BF16(_) => DType::BF16,
            Self::F16(_) => DType::F16,
        }
    }

    /// The values, where they are in `T`.
    pub fn as_wide(&self) -> Option<&[T]> {
        match self {
            Self::Wide(values) => Some(values),
            _ => None,
        }
    }
}

impl<T> HostGathers<T> {
    /// Gathers with `all_gather`, one call per bucket.
    pub fn new(all_gather: Arc<GatherFn<T>>) -> Self {
        Self {
            all_gather,
            sent: None,
            narrowing: None,
            narrow: None,
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

    /// These gathers, able to gather in bf16 and f16 with `bf16` and
    /// `f16` (all-gathers on the same communicator).
    pub fn narrowing(self, bf16: Arc<GatherFn<bf16>>, f16: Arc<GatherFn<f16>>) -> Self {
        Self {
            narrowing: Some(Narrowing { bf16, f16 }),
            ..self
        }
    }
}

/// `len` elements of `buffer`'s kind (`reuse`'d when it is one with room;
/// else freed before the new one is made).
fn host_buffer<V: Copy + Default>(reuse: Option<Vec<V>>, len: usize) -> Vec<V> {
    let mut buffer = reuse.unwrap_or_default();
    if buffer.capacity() < len {
        drop(std::mem::take(&mut buffer));
        buffer = Vec::with_capacity(len);
    }
    buffer.resize(len, V::default());
    buffer
}

/// Each bucket's chunk of `shard`, rounded to `H`, all-gathered into its
/// place in `buffer` by `all_gather`.
fn gather_narrowed<T: crate::Element, H: crate::Element>(
    all_gather: &GatherFn<H>,
    shard: &[T],
    buckets: &[UnitBucket],
    buffer: &mut [H],
) -> Result<()> {
    let mut chunk = Vec::new();
    for bucket in buckets {
        let send = &shard[bucket.shard.clone()];
        chunk.clear();
        chunk.resize(send.len(), H::default());
        crate::dtype::convert_slice(send, &mut chunk);
        all_gather(&chunk, &mut buffer[bucket.at.clone()])?;
    }
    Ok(())
}

impl<T: crate::Element> GatherMemory<T> for HostGathers<T> {
    type Shard = Vec<T>;
    type Buffer = HostGather<T>;

    /// Only with the 16-bit collectives, to bf16 or f16, from a wider `T`.
    fn gather_in(&mut self, dtype: DType) {
        let narrower = dtype.size_in_bytes() < T::DTYPE.size_in_bytes();
        if self.narrowing.is_some() && matches!(dtype, DType::BF16 | DType::F16) && narrower {
            self.narrow = Some(dtype);
        }
    }

    fn element_bytes(&self) -> usize {
        self.narrow
            .map_or(std::mem::size_of::<T>(), DType::size_in_bytes)
    }

    fn shard_len(shard: &Vec<T>) -> usize {
        shard.len()
    }

    fn capacity(buffer: &HostGather<T>) -> usize {
        match buffer {
            HostGather::Wide(values) => values.capacity(),
            HostGather::BF16(values) => values.capacity(),
            HostGather::F16(values) => values.capacity(),
        }
    }

    fn buffer(&self, reuse: Option<HostGather<T>>, len: usize) -> Result<HostGather<T>> {
        Ok(match (self.narrow, reuse) {
            (Some(DType::BF16), Some(HostGather::BF16(v))) => {
                HostGather::BF16(host_buffer(Some(v), len))
            }
            (Some(DType::BF16), _) => HostGather::BF16(host_buffer(None, len)),
            (Some(DType::F16), Some(HostGather::F16(v))) => {
                HostGather::F16(host_buffer(Some(v), len))
            }
            (Some(DType::F16), _) => HostGather::F16(host_buffer(None, len)),
            (_, Some(HostGather::Wide(v))) => HostGather::Wide(host_buffer(Some(v), len)),
            (_, _) => HostGather::Wide(host_buffer(None, len)),
        })
    }

    fn gather(
        &self,
        shard: &Vec<T>,
        buckets: &[UnitBucket],
        buffer: &mut HostGather<T>,
    ) -> Result<()> {
        self.gather_from_host(shard, buckets, buffer)
    }

    fn gather_from_host(
        &self,
        shard: &[T],
        buckets: &[UnitBucket],
        buffer: &mut HostGather<T>,
    ) -> Result<()> {
        match (buffer, &self.narrowing) {
            (HostGather::Wide(buffer), _) => {
                for bucket in buckets {
                    (self.all_gather)(
                        &shard[bucket.shard.clone()],
                        &mut buffer[bucket.at.clone()],
                    )?;
                }
                Ok(())
            }
            (HostGather::BF16(buffer), Some(n)) => {
                gather_narrowed(&*n.bf16, shard, buckets, buffer)
            }
            (HostGather::F16(buffer), Some(n)) => gather_narrowed(&*n.f16, shard, buckets, buffer),
            (buffer, None) => Err(Error::State(format!(
                "internal: a {:?} stage-3 buffer for gathers without 16-bit collectives",
                buffer.dtype()
            ))),
        }
    }

    fn read(&self, buffer: &HostGather<T>, range: Range<usize>, out: &mut [T]) -> Result<()> {
        match buffer {
            HostGather::Wide(values) => out.copy_from_slice(&values[range]),
            HostGather::BF16(values) => crate::dtype::convert_slice(&values[range], out),
            HostGather::F16(values) => crate::dtype::convert_slice(&values[range], out),
        }
        Ok(())
    }

    fn bytes_sent(&self) -> u64 {
        self.sent.as_ref().map_or(0, |sent| sent())
    }
}
