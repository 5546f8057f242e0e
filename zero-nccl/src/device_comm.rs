//! [`DeviceComm`]: what the CUDA engine needs of a communicator over device
//! buffers. [`NcclComm`](crate::NcclComm) (one process per GPU, NCCL) and
//! [`CudaThreadComm`](crate::CudaThreadComm) (ranks as threads of one
//! process, one GPU shared or several) implement it, so `CudaMemory` and
//! zero-candle's optimizer run on either unchanged.

use crate::stream::is_per_thread_stream;
use crate::Error;
use cudarc::driver::sys::{CUevent, CUresult};
use cudarc::driver::{
    CudaContext, CudaEvent, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, DeviceRepr,
    DriverError, ValidAsZeroBits,
};
use std::sync::Arc;
use std::thread::ThreadId;
use std::time::{Duration, Instant};
use zero_core::comm::MemoryKind;
use zero_core::engine::UnitBucket;
use zero_core::{Communicator, Element, ReduceOp, Result, Work};

/// Device memory: buffers are `cudarc` [`CudaSlice`]s.
#[derive(Clone, Copy, Debug, Default)]
pub struct Cuda;

impl MemoryKind for Cuda {
    type Buffer<T: Element> = CudaSlice<T>;
}

/// A [`Communicator`] over CUDA buffers whose collectives are ordered with a
/// compute stream by events, never by host waits.
///
/// The `_event` collectives queue the collective after everything queued on
/// the compute stream so far and return the event recorded when it is
/// complete; the `_view` ones make the compute stream wait on that event.
/// Views may be ranges of larger buffers (one bucket of the engine's flat
/// gradients).
pub trait DeviceComm: Communicator<Memory = Cuda> + Sized {
    /// The CUDA context of this rank's GPU.
    fn context(&self) -> &Arc<CudaContext>;

    /// The stream collectives are ordered with.
    fn compute_stream(&self) -> &Arc<CudaStream>;

    /// The deadline of host waits (see [`DeviceComm::wait_compute`]).
    fn timeout(&self) -> Duration;

    /// Orders collectives after, and makes waits apply to, `stream` (for
    /// example Candle's device stream). It must belong to this
    /// communicator's context.
    fn with_compute_stream(self, stream: Arc<CudaStream>) -> Result<Self>;

    /// All-reduces `buf` in place; see the trait's documentation.
    fn all_reduce_event<T: Element>(
        &self,
        buf: &mut (impl DevicePtrMut<T> + ?Sized),
        op: ReduceOp,
    ) -> Result<CudaEvent>;

    /// Reduce-scatters `send` (`world_size * recv.len()` elements) into `recv`.
    fn reduce_scatter_event<T: Element>(
        &self,
        send: &(impl DevicePtr<T> + ?Sized),
        recv: &mut (impl DevicePtrMut<T> + ?Sized),
        op: ReduceOp,
    ) -> Result<CudaEvent>;

    /// All-gathers `send` into `recv` (`world_size * send.len()` elements).
    fn all_gather_event<T: Element>(
        &self,
        send: &(impl DevicePtr<T> + ?Sized),
        recv: &mut (impl DevicePtrMut<T> + ?Sized),
    ) -> Result<CudaEvent>;

    /// All-gathers in place: `buf` is `world_size` equal slots, and this
    /// rank sends its own, slot `rank` (NCCL's in-place all-gather,
    /// `sendbuff == recvbuff + rank * sendcount`). For values written into
    /// that slot first, with no staging buffer to send them from.
    fn all_gather_in_place_event<T: Element>(
        &self,
        buf: &mut (impl DevicePtrMut<T> + ?Sized),
    ) -> Result<CudaEvent>;

    /// Several all-gathers as one collective (a stage-3 layer's buckets):
    /// for each bucket, every rank's `shard[bucket.shard]` into
    /// `buffer[bucket.at]`, in rank order. One NCCL group; on
    /// `cuda-threads` one pass of the protocol (two host rendezvous for the
    /// whole batch, not two per bucket). No buckets, nothing queued: the
    /// event marks the compute stream's point.
    fn all_gather_buckets_event<T: Element>(
        &self,
        shard: &CudaSlice<T>,
        buffer: &mut CudaSlice<T>,
        buckets: &[UnitBucket],
    ) -> Result<CudaEvent>;

    /// [`DeviceComm::all_gather_buckets_event`] in place: this rank's slot
    /// of each bucket's place in `buffer` holds its chunk already
    /// ([`DeviceComm::all_gather_in_place_event`]); `bucket.shard` gives
    /// the chunk's length.
    fn all_gather_buckets_in_place_event<T: Element>(
        &self,
        buffer: &mut CudaSlice<T>,
        buckets: &[UnitBucket],
    ) -> Result<CudaEvent>;

    /// Blocks the host until everything queued on the compute stream so far
    /// has run, within the communicator's deadline: a collective stuck on a
    /// dead or frozen peer becomes an error instead of a hang. Call it
    /// before any host read of device memory that the compute stream writes.
    fn wait_compute(&self, op: &'static str) -> Result<()>;

    /// All-reduces a few host values (a mask, a norm) within the deadline.
    fn all_reduce_host(&self, values: &mut [f64], op: ReduceOp) -> Result<()>;

    /// [`Communicator::gather_varlen`] of host values, within the deadline.
    fn gather_varlen_host<T: Element + DeviceRepr + ValidAsZeroBits>(
        &self,
        send: &[T],
        counts: &[usize],
        recv: Option<&mut [T]>,
        root: usize,
    ) -> Result<()>;

    /// [`DeviceComm::all_reduce_event`], complete in compute-stream order
    /// when it returns; the host does not wait.
    fn all_reduce_view<T: Element>(
        &self,
        buf: &mut (impl DevicePtrMut<T> + ?Sized),
        op: ReduceOp,
    ) -> Result<()> {
        let done = self.all_reduce_event(buf, op)?;
        Ok(self.compute_stream().wait(&done).map_err(Error::from)?)
    }

    /// [`DeviceComm::reduce_scatter_event`], complete in compute-stream
    /// order when it returns.
    fn reduce_scatter_view<T: Element>(
        &self,
        send: &(impl DevicePtr<T> + ?Sized),
        recv: &mut (impl DevicePtrMut<T> + ?Sized),
        op: ReduceOp,
    ) -> Result<()> {
        let done = self.reduce_scatter_event(send, recv, op)?;
        Ok(self.compute_stream().wait(&done).map_err(Error::from)?)
    }

    /// [`DeviceComm::all_gather_event`], complete in compute-stream order
    /// when it returns.
    fn all_gather_view<T: Element>(
        &self,
        send: &(impl DevicePtr<T> + ?Sized),
        recv: &mut (impl DevicePtrMut<T> + ?Sized),
    ) -> Result<()> {
        let done = self.all_gather_event(send, recv)?;
        Ok(self.compute_stream().wait(&done).map_err(Error::from)?)
    }
}

/// The length of each of `world_size` slots of an in-place all-gather's
/// buffer of `len` elements (see [`DeviceComm::all_gather_in_place_event`]).
pub(crate) fn in_place_slot(len: usize, world_size: usize) -> zero_core::Result<usize> {
    if world_size == 0 || len % world_size != 0 {
        return Err(zero_core::Error::BufferSize {
            op: "all_gather (in place)",
            what: "the buffer (one equal slot per rank)",
            got: len,
            expected: len.next_multiple_of(world_size.max(1)),
        });
    }
    Ok(len / world_size)
}

/// One all-gather of a batch ([`bucket_gathers`]): device addresses of this
/// rank's chunk and of the gathered place, and the chunk's length.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct BucketGather {
    pub send: u64,
    pub recv: u64,
    pub count: usize,
}

/// The all-gathers of `buckets` of `T`, from a shard at `shard` (address,
/// length; `None`: in place, each chunk in this rank's slot of its place)
/// into a buffer at `buffer`, each checked in bounds and `world_size`
/// chunks long; with the bytes they send.
pub(crate) fn bucket_gathers<T>(
    shard: Option<(u64, usize)>,
    (buffer, buffer_len): (u64, usize),
    buckets: &[UnitBucket],
    (rank, world_size): (usize, usize),
) -> zero_core::Result<(Vec<BucketGather>, u64)> {
    let elem = std::mem::size_of::<T>();
    let address = |base: u64, at: usize| base + (at * elem) as u64;
    let mut bytes = 0;
    let gathers = buckets
        .iter()
        .map(|bucket| {
            let (chunk, at) = (&bucket.shard, &bucket.at);
            let count = chunk.len();
            let in_shard = shard.is_none_or(|(_, len)| chunk.end <= len);
            if !in_shard || at.end > buffer_len || at.len() != world_size * count {
                return Err(zero_core::Error::State(format!(
                    "internal: an all-gather of shard {chunk:?} into {at:?} of a {buffer_len}-element \
                     buffer ({world_size} ranks; shard of {:?} elements) is out of bounds or not \
                     {world_size} chunks",
                    shard.map(|(_, len)| len)
                )));
            }
            bytes += ring_bytes(at.len() * elem, world_size);
            let send = match shard {
                Some((base, _)) => address(base, chunk.start),
                None => address(buffer, at.start + rank * count),
            };
            Ok(BucketGather {
                send,
                recv: address(buffer, at.start),
                count,
            })
        })
        .collect::<zero_core::Result<_>>()?;
    Ok((gathers, bytes))
}

/// Bytes a rank sends in a ring collective over a buffer of `bytes`: `(N-1)/N`
/// of it (what `bytes_sent` counts, whatever moves the bytes).
pub(crate) fn ring_bytes(bytes: usize, world_size: usize) -> u64 {
    (bytes as u64 * (world_size as u64 - 1)) / world_size as u64
}

/// The [`Work`] of a collective that completes at `done`: waiting makes
/// `compute` wait on it (a device-side wait; the host does not block),
/// from `owner`'s thread only where `compute` is a per-thread stream.
pub(crate) fn event_work<'a>(
    compute: Arc<CudaStream>,
    owner: StreamOwner,
    done: CudaEvent,
) -> Work<'a> {
    Work::new(move |block| {
        owner.check("a collective's Work")?;
        if block {
            compute.wait(&done).map_err(Error::from)?;
            return Ok(true);
        }
        let complete = done.try_is_complete().map_err(Error::from)?;
        if complete {
            compute.wait(&done).map_err(Error::from)?;
        }
        Ok(complete)
    })
}

/// The thread a compute stream belongs to, where it is CUDA's per-thread
/// default stream (Candle's `Device::new_cuda`): that handle names another
/// stream on every thread, so work queued, recorded or waited on from
/// another thread is not ordered with the owner's (the backward pass, the
/// layers reading a gathered buffer).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct StreamOwner(Option<ThreadId>);

impl StreamOwner {
    /// `stream`'s owner: the calling thread for the per-thread default
    /// stream; none for a stream of its own, which any thread may use.
    pub fn of(stream: &CudaStream) -> Self {
        Self(is_per_thread_stream(stream).then(|| std::thread::current().id()))
    }

    /// Fails unless this is the owner's thread (or there is no owner),
    /// saying what to do; `what` names the object used.
    pub fn check(self, what: &str) -> zero_core::Result<()> {
        let Some(owner) = self.0 else {
            return Ok(());
        };
        let here = std::thread::current().id();
        if here == owner {
            return Ok(());
        }
        Err(zero_core::Error::State(format!(
            "{what} was set up on thread {owner:?} and is used from {here:?}; its stream is \
             CUDA's per-thread default stream (Candle's `Device::new_cuda`), which is another \
             stream on each thread, so work queued or waited on here would not be ordered \
             with that thread's (its backward pass, the layers reading its buffers). Run \
             forward, backward, the step and the optimizer's drop on the thread that built \
             the optimizer, or build the model on `Device::new_cuda_with_stream` (a stream of \
             its own, usable from any thread)"
        )))
    }
}

/// How long [`host_wait`] sleeps between polls at most.
const HOST_WAIT_POLL: Duration = Duration::from_millis(10);

/// Blocks the host until `done` has completed or `timeout` passes
/// ([`Error::Timeout`] naming `op` and the collective count `seq`),
/// sleeping between polls up to 10 ms.
pub(crate) fn host_wait(
    op: &'static str,
    seq: u64,
    done: &CudaEvent,
    timeout: Duration,
) -> crate::Result<()> {
    host_wait_polling(op, seq, done, timeout, HOST_WAIT_POLL)
}

/// [`host_wait`] sleeping at most `max_pause` between polls: for a wait
/// that is short as a rule and whose lateness shows (offload's copies).
pub(crate) fn host_wait_polling(
    op: &'static str,
    seq: u64,
    done: &CudaEvent,
    timeout: Duration,
    max_pause: Duration,
) -> crate::Result<()> {
    poll_until(op, seq, timeout, max_pause, || done.try_is_complete())
}

/// [`host_wait`] on an event known by its handle only: a peer's, in a
/// group of ranks sharing the process.
///
/// # Safety
///
/// `event` is a live event.
pub(crate) unsafe fn host_wait_handle(
    op: &'static str,
    seq: u64,
    event: CUevent,
    timeout: Duration,
) -> crate::Result<()> {
    poll_until(op, seq, timeout, HOST_WAIT_POLL, || {
        // SAFETY: `event` is live (the caller's contract).
        match unsafe { cudarc::driver::result::event::query(event) } {
            Ok(()) => Ok(true),
            Err(DriverError(CUresult::CUDA_ERROR_NOT_READY)) => Ok(false),
            Err(error) => Err(error),
        }
    })
}

/// Polls `complete` until it holds or `timeout` passes, sleeping between
/// polls from 50 µs, doubling up to `max_pause`.
fn poll_until(
    op: &'static str,
    seq: u64,
    timeout: Duration,
    max_pause: Duration,
    mut complete: impl FnMut() -> std::result::Result<bool, DriverError>,
) -> crate::Result<()> {
    let start = Instant::now();
    let mut pause = Duration::from_micros(50).min(max_pause);
    loop {
        if complete()? {
            return Ok(());
        }
        let waited = start.elapsed();
        if waited >= timeout {
            return Err(Error::Timeout {
                op,
                seq,
                waited_s: waited.as_secs_f64(),
            });
        }
        std::thread::sleep(pause);
        pause = (pause * 2).min(max_pause);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bucket_gathers_address_each_chunk_and_its_place() {
        let bucket =
            |shard: std::ops::Range<usize>, at: std::ops::Range<usize>| UnitBucket { shard, at };
        let buckets = [bucket(0..3, 0..6), bucket(3..5, 10..14)];
        // From a shard of f32 at 1000 into a buffer at 5000, rank 1 of 2.
        let (gathers, bytes) =
            bucket_gathers::<f32>(Some((1000, 5)), (5000, 14), &buckets, (1, 2)).unwrap();
        let gather = |send, recv, count| BucketGather { send, recv, count };
        assert_eq!(gathers, [gather(1000, 5000, 3), gather(1012, 5040, 2)]);
        assert_eq!(bytes, ring_bytes(24, 2) + ring_bytes(16, 2));
        // In place: each chunk is this rank's slot of its place.
        let (gathers, _) = bucket_gathers::<f32>(None, (5000, 14), &buckets, (1, 2)).unwrap();
        assert_eq!(gathers, [gather(5012, 5000, 3), gather(5048, 5040, 2)]);
        // Out of the shard, out of the buffer, not world_size chunks.
        for (shard_len, buffer_len, buckets) in [
            (4, 14, vec![bucket(3..5, 10..14)]),
            (5, 13, vec![bucket(3..5, 10..14)]),
            (5, 14, vec![bucket(3..5, 10..13)]),
        ] {
            let err =
                bucket_gathers::<f32>(Some((0, shard_len)), (0, buffer_len), &buckets, (1, 2))
                    .unwrap_err()
                    .to_string();
            assert!(err.contains("out of bounds or not 2 chunks"), "{err}");
        }
    }

    #[test]
    fn another_thread_than_the_owner_is_refused_with_what_to_do() {
        let here = StreamOwner(Some(std::thread::current().id()));
        assert!(StreamOwner(None).check("NcclComm").is_ok());
        assert!(here.check("NcclComm").is_ok());
        let err = std::thread::spawn(move || here.check("NcclComm"))
            .join()
            .expect("the check does not panic")
            .expect_err("another thread is refused");
        let msg = err.to_string();
        assert!(msg.starts_with("NcclComm was set up on thread"), "{msg}");
        assert!(msg.contains("per-thread default stream"), "{msg}");
        assert!(msg.contains("new_cuda_with_stream"), "{msg}");
        // No owner: any thread.
        let none = StreamOwner(None);
        assert!(std::thread::spawn(move || none.check("NcclComm"))
            .join()
            .expect("the check does not panic")
            .is_ok());
    }
}
