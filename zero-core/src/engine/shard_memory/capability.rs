//! What only some memories can do, a trait each: collectives that complete
//! after they return, packed 16-bit gathers, transfers to and from host
//! memory, and ZeRO-Offload.

use super::ShardMemory;
use super::{host_step, ShardStep};
use crate::comm::Communicator;
use crate::engine::host_buffer::{HostPin, Landing};
use crate::optim::FunctionalOptimizer;
use crate::{DType, Element, Error, Result};
use std::ops::Range;
use std::sync::Arc;

/// Collectives that may complete after they return (a device stream), for
/// a memory that launches a backward pass's reductions on the calling
/// thread ([`ShardMemory::deferral`]).
pub trait Deferral<C> {
    /// From now until [`Deferral::settle`], reductions may complete after
    /// they return: the engine neither reads their results nor reuses
    /// their buffers before settling.
    fn defer_completion(&mut self);

    /// While deferring: how many reductions have been issued since
    /// [`Deferral::defer_completion`].
    fn deferred_count(&self) -> usize;

    /// While deferring: orders everything queued on the calling thread from
    /// now on after the first `count` reductions deferred (a device stream
    /// waits on their events; the host does not wait), so that the buffers
    /// they read may be written again; the deferral goes on.
    fn fence_deferred(&mut self, count: usize) -> Result<()>;

    /// Orders everything after the reductions deferred since
    /// [`Deferral::defer_completion`] (a device stream waits on their
    /// events; the host does not wait) and ends the deferral.
    fn settle(&mut self, comm: &C) -> Result<()>;
}

/// Gathers of chunks already rounded to a 16-bit dtype and packed
/// ([`pack_narrow`](super::pack_narrow)), over buffers `B`
/// ([`ShardMemory::packed_gathers`]).
pub trait PackedGathers<C, B> {
    /// [`ShardMemory::all_gather_as`] of a packed chunk: this rank's `n`
    /// values are the first `n` 16-bit values of `send`'s memory. They are
    /// gathered in `wire` and widened into `recv[recv_range]`.
    fn all_gather_packed(
        &mut self,
        comm: &C,
        send: &B,
        n: usize,
        recv: &mut B,
        recv_range: Range<usize>,
        wire: DType,
    ) -> Result<()>;
}

/// Transfers between a memory's buffers and host memory: what
/// [`OffloadMemory`](crate::engine::OffloadMemory) asks of the memory it
/// wraps. Only [`HostTransfers::download`] is required; the rest defaults
/// to copies done at once, in order.
pub trait HostTransfers<T: Element, C: Communicator>: ShardMemory<T, C> {
    /// Copies `buffer[range]` into host memory once everything queued
    /// before it has written it (reductions still deferred included). It
    /// takes no communicator: a device memory bounds its wait with the
    /// deadline of the communicator it was built for.
    fn download(&mut self, buffer: &Self::Buffer, range: Range<usize>, out: &mut [T])
        -> Result<()>;

    /// [`HostTransfers::download`] that may only queue the copy, behind
    /// the work queued so far, and return before it lands, so that a
    /// device's queue is not drained once per bucket; `buffer` (the source)
    /// stays with the memory until then. [`HostTransfers::land`] waits for
    /// every queued copy. Default: `download`, landed at once.
    ///
    /// # Safety
    /// `out` must be page-locked by this memory's
    /// [`HostTransfers::pin_host`] and stay allocated and in place, neither
    /// read nor written, until `land` or a [`HostTransfers::landing`] taken
    /// after this call has returned, or that lock is unlocked (a memory
    /// that queues makes the unlock wait for its copies first).
    unsafe fn download_queued(
        &mut self,
        buffer: Self::Buffer,
        range: Range<usize>,
        out: &mut [T],
    ) -> Result<()> {
        self.download(&buffer, range, out)
    }

    /// A new buffer holding `values` (an upload into a fresh staging
    /// buffer, as [`ShardMemory::alloc_zeroed`] and
    /// [`ShardMemory::buffer_from_host`] make it) whose copy may only be
    /// queued, so that the call returns before it has read `values`; work
    /// queued on the buffer afterwards runs after the copy, and
    /// [`HostTransfers::land`] waits for it too. Default: those two calls,
    /// done at once.
    ///
    /// # Safety
    /// `values` must be page-locked by this memory's
    /// [`HostTransfers::pin_host`] and stay allocated, in place and
    /// unwritten until `land` or a [`HostTransfers::landing`] taken after
    /// this call has returned, or that lock is unlocked.
    unsafe fn upload_queued(&mut self, values: &[T]) -> Result<Self::Buffer> {
        let mut staged = self.alloc_zeroed(values.len())?;
        self.buffer_from_host(&mut staged, 0, values)?;
        Ok(staged)
    }

    /// What waits for the copies queued so far, and for none queued after:
    /// once it has returned, the host may touch what those copies wrote or
    /// read, while later ones are still in flight. `None` when nothing is
    /// in flight. Default `None`: nothing is ever queued.
    fn landing(&mut self) -> Result<Option<Landing>> {
        Ok(None)
    }

    /// Waits until every queued copy has landed (a device: within its
    /// communicator's deadline). Default: nothing is ever queued.
    fn land(&mut self) -> Result<()> {
        Ok(())
    }

    /// Page-locks `values`, host memory this memory copies to and from (an
    /// offloaded shard), until the returned guard is unlocked
    /// ([`HostLock`](crate::engine::HostLock)): a device's transfers then
    /// run at the link's speed, without staging through a pageable copy.
    /// `values` must neither move nor be freed while locked, nor freed at
    /// all if unlocking fails. Default: nothing to lock (`None`).
    fn pin_host(&mut self, values: &mut [T]) -> Result<Option<HostPin>> {
        let _ = values;
        Ok(None)
    }

    /// Queues the transfers on a stream of their own, beside the compute
    /// stream, each ordered after the work queued before it and the work
    /// queued after an upload ordered after it (see
    /// [`EngineConfig::offload_copy_stream`](crate::engine::EngineConfig::offload_copy_stream)).
    /// Default: nothing to do (a memory without streams copies in order).
    fn copy_stream(&mut self) -> Result<()> {
        Ok(())
    }
}

/// ZeRO-Offload: the optimizer's side (the shards the optimizer steps,
/// master weights, optimizer state) kept in host memory and stepped there,
/// over buffers `B`, by a memory for communicator `C`
/// ([`ShardMemory::host_offload`]).
pub trait HostOffload<C, B> {
    /// From now on, keep the optimizer's side in host memory and step
    /// there, on `threads` threads (`0`: rayon's global pool), the shards
    /// page-locked with `pin_memory` (see [`HostTransfers::pin_host`]).
    /// Called by the engine before it allocates, when
    /// `EngineConfig::offload` asks.
    fn offload_optimizer(&mut self, threads: usize, pin_memory: bool) -> Result<()>;

    /// The transfers on a copy stream of their own
    /// ([`HostTransfers::copy_stream`]).
    fn copy_stream(&mut self) -> Result<()>;

    /// A zeroed buffer for a stretch of the shard the optimizer steps (the
    /// parameter and gradient shards): in host memory once offloading.
    fn alloc_shard(&mut self, numel: usize) -> Result<B>;

    /// The host step to run on another thread while backward goes on,
    /// where the shard is in host memory and no communication thread runs
    /// (offload over a GPU): the interleaved schedule steps each bucket
    /// there as its reduced gradients land. `None` otherwise.
    fn host_stepper(&self) -> Option<HostStepper>;

    /// [`HostTransfers::landing`] of the memory offloaded from.
    fn landing(&mut self) -> Result<Option<Landing>>;
}

/// The host step of an offloading memory, usable from any thread: the
/// engine's [`FunctionalOptimizer`] over host slices, on the offload's
/// threads (rayon's global pool without).
#[derive(Clone, Debug, Default)]
pub struct HostStepper {
    pool: Option<Arc<rayon::ThreadPool>>,
}

impl HostStepper {
    /// The host step on `threads` threads of its own (`0`: rayon's global
    /// pool).
    pub(crate) fn new(threads: usize) -> Result<Self> {
        if threads == 0 {
            return Ok(Self::default());
        }
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(|i| format!("zero-offload-{i}"))
            .build()
            .map_err(|e| {
                Error::Config(format!(
                    "could not start {threads} offload threads ({e}); ask for fewer \
                     (offload_threads, 0 for rayon's global pool)"
                ))
            })?;
        Ok(Self {
            pool: Some(Arc::new(pool)),
        })
    }

    /// Steps the active pieces of `plan` (ranges of `params` and `grads`).
    pub(crate) fn step<T: Element>(
        &self,
        optimizer: &mut dyn FunctionalOptimizer<T>,
        params: &mut [T],
        grads: &[T],
        plan: ShardStep<'_>,
    ) -> Result<()> {
        self.run(|| host_step(optimizer, params, grads, plan))
    }

    /// Runs `work` with the offload's threads as rayon's pool.
    pub(crate) fn run<R: Send>(&self, work: impl FnOnce() -> R + Send) -> R {
        match &self.pool {
            Some(pool) => pool.install(work),
            None => work(),
        }
    }
}

/// What the engine's memory can do that decides a step's path, asked once
/// at construction (after offload started): a memory's capabilities do not
/// change.
#[derive(Clone, Debug, Default)]
pub(crate) struct Abilities {
    /// Collectives may complete after they return ([`Deferral`]).
    pub launches_async: bool,
    /// Offload's host stepper ([`HostOffload::host_stepper`]).
    pub host_stepper: Option<HostStepper>,
}

impl Abilities {
    /// What `memory` can do.
    pub fn of<T: Element, C: Communicator, M: ShardMemory<T, C>>(memory: &mut M) -> Self {
        Self {
            launches_async: memory.deferral().is_some(),
            host_stepper: memory.host_offload().and_then(|o| o.host_stepper()),
        }
    }
}

/// `memory`'s deferral, which the inline reductions were chosen for.
pub(crate) fn deferral<T: Element, C: Communicator, M: ShardMemory<T, C>>(
    memory: &mut M,
) -> Result<&mut dyn Deferral<C>> {
    memory.deferral().ok_or_else(|| {
        Error::State("internal: reductions launched inline on a memory that defers none".into())
    })
}

/// A zeroed buffer for a stretch of the shard the optimizer steps: where
/// an offloading memory keeps it, or any buffer of `memory`'s.
pub(crate) fn alloc_shard<T: Element, C: Communicator, M: ShardMemory<T, C>>(
    memory: &mut M,
    numel: usize,
) -> Result<M::Buffer> {
    match memory.host_offload() {
        Some(offload) => offload.alloc_shard(numel),
        None => memory.alloc_zeroed(numel),
    }
}

/// Starts ZeRO-Offload on `memory`, or says why it cannot.
pub(crate) fn start_offload<T: Element, C: Communicator, M: ShardMemory<T, C>>(
    memory: &mut M,
    threads: usize,
    pin_memory: bool,
    copy_stream: bool,
) -> Result<()> {
    let offload = memory.host_offload().ok_or_else(|| {
        Error::Config(
            "offload moves the optimizer's side of a GPU model to host memory; this engine's \
             memory is not a device's (the thread and MPI backends keep everything in host \
             memory already): leave offload off, or train on the NCCL backend"
                .into(),
        )
    })?;
    offload.offload_optimizer(threads, pin_memory)?;
    if copy_stream {
        offload.copy_stream()?;
    }
    Ok(())
}
