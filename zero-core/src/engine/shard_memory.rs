//! [`ShardMemory`]: the seam between the engine and the memory its buffers
//! live in.
//!
//! The engine's stage logic (plan, buckets, trainability, accumulation,
//! clipping, gradient checks, checkpoints) is shared by every memory. What
//! depends on where the flat buffers live is this trait: allocate and zero
//! a buffer, flatten gradients into a bucket, move parameter pieces between
//! the framework and a flat buffer, scale, partial norms, the collectives
//! over ranges of a buffer, and the optimizer step on the shard. [`HostMemory`]
//! implements it over `Vec<T>` (the optimizer steps through
//! [`FunctionalOptimizer`], so custom optimizers work); `zero-nccl`'s
//! `CudaMemory` over device buffers with fused kernels.
//!
//! Every method is local except the collectives, which every rank calls in
//! the same order (the engine guarantees it), and which must honour the
//! communicator's deadline: a dead peer is an error, never a hang.

use super::fetch::{GatherMemory, HostGathers};
use super::precision::convert_slice;
use super::NormType;
use crate::comm::{Communicator, Host, ReduceOp};
use crate::optim::{FunctionalOptimizer, OptimizerState, ParamKey, ParamMut};
use crate::{DType, Element, Error, Result};
use half::{bf16, f16};
use std::ops::Range;
use std::sync::Arc;

/// One gradient piece to flatten: `grad[range]` goes to
/// `buffer[at..at + range.len()]`.
#[derive(Clone, Debug)]
pub struct GradPiece<G> {
    /// Position in the destination buffer.
    pub at: usize,
    /// The parameter's whole gradient.
    pub grad: G,
    /// Element range of the gradient.
    pub range: Range<usize>,
}

/// One copy between a framework parameter and a flat buffer:
/// `param[param_range]` and `buffer[at..at + param_range.len()]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParamCopy {
    /// Index of the parameter.
    pub param: usize,
    /// Element range within the parameter.
    pub param_range: Range<usize>,
    /// Position in the flat buffer.
    pub at: usize,
}

/// An owned piece as the optimizer step sees it.
#[derive(Clone, Debug)]
pub struct StepPiece<'a> {
    /// The piece's optimizer key (name, offset, group).
    pub key: &'a ParamKey,
    /// Its range in the shard buffers.
    pub range: Range<usize>,
    /// Whether it steps now (`false`: untouched, its state does not advance).
    pub active: bool,
}

/// What one optimizer step covers: some of the owned pieces (all of them,
/// one bucket's, or a window of them), in buffers that hold a stretch of
/// the shard.
#[derive(Clone, Copy, Debug)]
pub struct ShardStep<'a> {
    /// The pieces to step, in shard order, at their ranges in the buffers.
    pub pieces: &'a [StepPiece<'a>],
    /// The buckets, as ranges of the buffers (a device implementation
    /// launches per bucket).
    pub buckets: &'a [Range<usize>],
    /// Which buckets hold an active piece.
    pub bucket_active: &'a [bool],
    /// Where the buffers' first element lies in the shard: the shard
    /// position of `buffer[i]` is `origin + i`. A memory that keeps the
    /// optimizer state as one flat buffer (CUDA) finds a piece's state there.
    pub origin: usize,
    /// Elements in the whole shard, what such a flat state must cover
    /// however few pieces the first step passes.
    pub shard_len: usize,
}

/// What the engine needs from the memory its buffers live in, for
/// communicator `C` and element type `T`: allocate and zero buffers,
/// flatten gradients, move parameter pieces, scale, partial norms,
/// collectives over ranges, and the optimizer step on the shard.
///
/// Ranges are element ranges of a buffer. The engine only passes ranges
/// inside the buffers it allocated through [`ShardMemory::alloc_zeroed`]
/// (and gradients it checked against the parameters' sizes); a range out of
/// bounds is a broken internal invariant. Device implementations still check
/// before handing a pointer to a kernel.
///
/// A memory owns what it uses (`'static`): the engine's communication
/// thread keeps a fork of it.
pub trait ShardMemory<T: Element, C: Communicator>: Send + 'static {
    /// An owned flat buffer of `T`.
    type Buffer: Send + Sync + 'static;
    /// Stage 3's parameter gathers in this memory.
    type Gathers: GatherMemory<T, Shard = Self::Buffer>;
    /// One parameter's whole gradient as the framework hands it over.
    type Grad<'g>: Copy
    where
        Self: 'g;
    /// The framework's parameters (the replica the engine reads owned
    /// pieces from and writes updated values into).
    type Params<'p>: ?Sized
    where
        Self: 'p;

    /// The number of elements of a gradient.
    fn grad_len(grad: &Self::Grad<'_>) -> usize;

    /// A buffer of `numel` zeros.
    fn alloc_zeroed(&mut self, numel: usize) -> Result<Self::Buffer>;

    /// The number of elements of `buffer`.
    fn buffer_len(buffer: &Self::Buffer) -> usize;

    /// Stage 3's gathers over `comm` (a communicator of their own, split
    /// from the engine's), reading the parameter shard (one of this
    /// memory's buffers, lent to them between steps) into buffers of the
    /// same memory.
    fn gathers(&self, comm: C) -> Result<Self::Gathers>;

    /// Sets `buffer[range]` to zero.
    fn zero(&mut self, buffer: &mut Self::Buffer, range: Range<usize>) -> Result<()>;

    /// Copies every piece's gradient range into `buffer` (`add`: adds it to
    /// what is there). Pieces never overlap.
    fn flatten(
        &mut self,
        buffer: &mut Self::Buffer,
        pieces: &[GradPiece<Self::Grad<'_>>],
        add: bool,
    ) -> Result<()>;

    /// Adds `src[src_range]` into `dst[dst_at..]` (`add`), or copies it
    /// there. The overlapped reductions use it to fold a bucket into the
    /// gradients already accumulated.
    fn copy_range(
        &mut self,
        dst: &mut Self::Buffer,
        dst_at: usize,
        src: &Self::Buffer,
        src_range: Range<usize>,
        add: bool,
    ) -> Result<()>;

    /// A handle on this memory for the engine's communication thread, which
    /// reduces gradient buckets while backward goes on; `None` when this
    /// memory cannot run collectives off the thread that built it (then
    /// gradients handed over during backward are reduced in the step,
    /// unless [`ShardMemory::launches_async`]).
    fn fork(&self) -> Option<Self>
    where
        Self: Sized,
    {
        None
    }

    /// Whether collectives queued on the calling thread can complete after
    /// they return (a device stream), once
    /// [`ShardMemory::defer_completion`] asked for it. A memory without
    /// [`ShardMemory::fork`] that says so gets a backward pass's reductions
    /// launched on the calling thread as their buckets fill, overlapping
    /// the rest of backward. Default `false`.
    fn launches_async(&self) -> bool {
        false
    }

    /// From now until [`ShardMemory::settle`], reductions may complete
    /// after they return: the engine neither reads their results nor
    /// reuses their buffers before settling. Default: nothing (collectives
    /// complete before they return).
    fn defer_completion(&mut self) {}

    /// While deferring: how many reductions have been issued since
    /// [`ShardMemory::defer_completion`]. Default `0`.
    fn deferred_count(&self) -> usize {
        0
    }

    /// While deferring: orders everything queued on the calling thread from
    /// now on after the first `count` reductions deferred (a device stream
    /// waits on their events; the host does not wait), so that the buffers
    /// they read may be written again; the deferral goes on. Default:
    /// nothing (collectives complete before they return).
    fn fence_deferred(&mut self, count: usize) -> Result<()> {
        let _ = count;
        Ok(())
    }

    /// Orders everything after the reductions deferred since
    /// [`ShardMemory::defer_completion`] (a device stream waits on their
    /// events; the host does not wait) and ends the deferral.
    fn settle(&mut self, comm: &C) -> Result<()> {
        let _ = comm;
        Ok(())
    }

    /// Copies parameter pieces from the framework into `buffer`.
    fn read_params(
        &mut self,
        params: &mut Self::Params<'_>,
        copies: &[ParamCopy],
        buffer: &mut Self::Buffer,
    ) -> Result<()>;

    /// Copies pieces of `buffer` into the framework's parameters.
    fn write_params(
        &mut self,
        params: &mut Self::Params<'_>,
        copies: &[ParamCopy],
        buffer: &Self::Buffer,
    ) -> Result<()>;

    /// Multiplies `buffer[range]` by `factor` for every range.
    fn scale(
        &mut self,
        buffer: &mut Self::Buffer,
        ranges: &[Range<usize>],
        factor: f64,
    ) -> Result<()>;

    /// This rank's part of a norm over `buffer[range]` for every range: the
    /// sum of `|x|` (L1), of `x²` (L2) or the largest `|x|` (inf). A NaN
    /// anywhere makes the result NaN (L1, L2) or infinite (inf), never a
    /// finite number. Waits for the value within `comm`'s deadline.
    fn norm_partial(
        &mut self,
        comm: &C,
        buffer: &Self::Buffer,
        ranges: &[Range<usize>],
        norm: NormType,
    ) -> Result<f64>;

    /// All-reduces `buffer[range]` in place.
    fn all_reduce(
        &mut self,
        comm: &C,
        buffer: &mut Self::Buffer,
        range: Range<usize>,
        op: ReduceOp,
    ) -> Result<()>;

    /// Reduce-scatters `send[send_range]` into `recv[recv_range]`.
    fn reduce_scatter(
        &mut self,
        comm: &C,
        send: &Self::Buffer,
        send_range: Range<usize>,
        recv: &mut Self::Buffer,
        recv_range: Range<usize>,
        op: ReduceOp,
    ) -> Result<()>;

    /// All-gathers `send[send_range]` into `recv[recv_range]`.
    fn all_gather(
        &mut self,
        comm: &C,
        send: &Self::Buffer,
        send_range: Range<usize>,
        recv: &mut Self::Buffer,
        recv_range: Range<usize>,
    ) -> Result<()>;

    /// [`ShardMemory::all_reduce`] with the values on the wire rounded to
    /// `wire` (the parameters' dtype when the engine keeps master weights
    /// and is asked to reduce in it); the result is widened back into `T`.
    /// The default reduces in `T`.
    fn all_reduce_as(
        &mut self,
        comm: &C,
        buffer: &mut Self::Buffer,
        range: Range<usize>,
        op: ReduceOp,
        wire: DType,
    ) -> Result<()> {
        let _ = wire;
        self.all_reduce(comm, buffer, range, op)
    }

    /// [`ShardMemory::reduce_scatter`] with the values on the wire rounded
    /// to `wire`, as [`ShardMemory::all_reduce_as`].
    #[allow(clippy::too_many_arguments)]
    fn reduce_scatter_as(
        &mut self,
        comm: &C,
        send: &Self::Buffer,
        send_range: Range<usize>,
        recv: &mut Self::Buffer,
        recv_range: Range<usize>,
        op: ReduceOp,
        wire: DType,
    ) -> Result<()> {
        let _ = wire;
        self.reduce_scatter(comm, send, send_range, recv, recv_range, op)
    }

    /// [`ShardMemory::all_gather`] with the values on the wire rounded to
    /// `wire` (the parameters' dtype, narrower than `T`, when the engine
    /// keeps master weights); `recv` receives them widened back into `T`.
    /// The default sends `T` (the same values after the write-back rounds
    /// them, twice the bytes).
    fn all_gather_as(
        &mut self,
        comm: &C,
        send: &Self::Buffer,
        send_range: Range<usize>,
        recv: &mut Self::Buffer,
        recv_range: Range<usize>,
        wire: DType,
    ) -> Result<()> {
        let _ = wire;
        self.all_gather(comm, send, send_range, recv, recv_range)
    }

    /// Whether [`ShardMemory::all_gather_packed`] works here (offload's
    /// write-back then sends a 16-bit model's weights up in 16 bits).
    /// Default `false`.
    fn gathers_packed(&self) -> bool {
        false
    }

    /// [`ShardMemory::all_gather_as`] of a chunk already rounded to the
    /// 16-bit `wire` dtype and packed ([`pack_narrow`]): this rank's `n`
    /// values are the first `n` 16-bit values of `send`'s memory. They are
    /// gathered in `wire` and widened into `recv[recv_range]`. Memories
    /// that cannot keep the default, an error
    /// ([`ShardMemory::gathers_packed`] is `false`).
    fn all_gather_packed(
        &mut self,
        comm: &C,
        send: &Self::Buffer,
        n: usize,
        recv: &mut Self::Buffer,
        recv_range: Range<usize>,
        wire: DType,
    ) -> Result<()> {
        let _ = (comm, send, n, recv, recv_range, wire);
        Err(Error::State(
            "internal: this memory gathers no packed 16-bit chunks".into(),
        ))
    }

    /// Copies `buffer[range]` into host memory (master weights for a
    /// checkpoint). Memories that cannot keep master weights keep the
    /// default, an error.
    fn buffer_to_host(
        &mut self,
        comm: &C,
        buffer: &Self::Buffer,
        range: Range<usize>,
        out: &mut [T],
    ) -> Result<()> {
        let _ = (comm, buffer, range, out);
        Err(no_master_weights("buffer_to_host"))
    }

    /// Overwrites `buffer[at..at + values.len()]` from host memory (master
    /// weights from a checkpoint). Memories that cannot keep master
    /// weights keep the default, an error.
    fn buffer_from_host(
        &mut self,
        buffer: &mut Self::Buffer,
        at: usize,
        values: &[T],
    ) -> Result<()> {
        let _ = (buffer, at, values);
        Err(no_master_weights("buffer_from_host"))
    }

    /// Copies `buffer[range]` into host memory once everything queued
    /// before it has written it (reductions still deferred included):
    /// the device-to-host transfer of an offloading memory
    /// ([`OffloadMemory`](super::OffloadMemory)), which pairs it with
    /// [`ShardMemory::buffer_from_host`]. It takes no communicator: a
    /// device memory bounds its wait with the deadline of the communicator
    /// it was built for. Memories that cannot offload keep the default, an
    /// error.
    fn download(
        &mut self,
        buffer: &Self::Buffer,
        range: Range<usize>,
        out: &mut [T],
    ) -> Result<()> {
        let _ = (buffer, range, out);
        Err(Error::Unsupported {
            op: "download",
            detail: "this engine memory has no device-to-host transfer, so it cannot offload"
                .into(),
        })
    }

    /// Offload: [`ShardMemory::download`] that may only queue the copy,
    /// behind the work queued so far, and return before it lands, so that
    /// a device's queue is not drained once per bucket; `buffer` (the
    /// source) stays with the memory until then. [`ShardMemory::land`]
    /// waits for every queued copy. Default: `download`, landed at once.
    ///
    /// # Safety
    /// `out` must be page-locked by this memory's [`ShardMemory::pin_host`]
    /// and stay allocated and in place, neither read nor written, until
    /// `land` or a [`ShardMemory::landing`] taken after this call has
    /// returned, or that lock is unlocked (a memory that queues makes the
    /// unlock wait for its copies first).
    unsafe fn download_queued(
        &mut self,
        buffer: Self::Buffer,
        range: Range<usize>,
        out: &mut [T],
    ) -> Result<()> {
        self.download(&buffer, range, out)
    }

    /// Offload: a new buffer holding `values` (an upload into a fresh
    /// staging buffer, as [`ShardMemory::alloc_zeroed`] and
    /// [`ShardMemory::buffer_from_host`] make it) whose copy may only be
    /// queued, so that the call returns before it has read `values`; work
    /// queued on the buffer afterwards runs after the copy, and
    /// [`ShardMemory::land`] waits for it too. Default: those two calls,
    /// done at once.
    ///
    /// # Safety
    /// `values` must be page-locked by this memory's
    /// [`ShardMemory::pin_host`] and stay allocated, in place and unwritten
    /// until `land` or a [`ShardMemory::landing`] taken after this call has
    /// returned, or that lock is unlocked.
    unsafe fn upload_queued(&mut self, values: &[T]) -> Result<Self::Buffer> {
        let mut staged = self.alloc_zeroed(values.len())?;
        self.buffer_from_host(&mut staged, 0, values)?;
        Ok(staged)
    }

    /// What waits for the copies [`ShardMemory::download_queued`] and
    /// [`ShardMemory::upload_queued`] queued so far, and for none queued
    /// after: once it has returned, the host may touch what those copies
    /// wrote or read, while later ones are still in flight. `None` when
    /// nothing is in flight. Default `None`: nothing is ever queued.
    fn landing(&mut self) -> Result<Option<super::Landing>> {
        Ok(None)
    }

    /// Waits until every copy [`ShardMemory::download_queued`] and
    /// [`ShardMemory::upload_queued`] queued has landed (a device: within
    /// its communicator's deadline). Default: nothing is ever queued.
    fn land(&mut self) -> Result<()> {
        Ok(())
    }

    /// A zeroed buffer for a stretch of the shard the optimizer steps (the
    /// parameter and gradient shards): where an offloading memory keeps
    /// them in host memory. Default: [`ShardMemory::alloc_zeroed`].
    fn alloc_shard(&mut self, numel: usize) -> Result<Self::Buffer> {
        self.alloc_zeroed(numel)
    }

    /// From now on, keep the optimizer's side (the shards of
    /// [`ShardMemory::alloc_shard`], master weights, optimizer state) in
    /// host memory and step there, on `threads` threads (`0`: rayon's
    /// global pool), the shards page-locked with `pin_memory` (see
    /// [`ShardMemory::pin_host`]): ZeRO-Offload. Called by the engine before it
    /// allocates, when `EngineConfig::offload` asks. The default refuses:
    /// this memory's buffers are in host memory already, or it cannot
    /// transfer.
    fn offload_optimizer(&mut self, threads: usize, pin_memory: bool) -> Result<()> {
        let _ = (threads, pin_memory);
        Err(Error::Config(
            "offload moves the optimizer's side of a GPU model to host memory; this engine's \
             memory is not a device's (the thread and MPI backends keep everything in host \
             memory already): leave offload off, or train on the NCCL backend"
                .into(),
        ))
    }

    /// Offload: queue the transfers to and from page-locked host memory
    /// ([`ShardMemory::download_queued`], [`ShardMemory::upload_queued`]) on
    /// a stream of their own, beside the compute stream, each ordered after
    /// the work queued before it and the work queued after an upload
    /// ordered after it (see [`EngineConfig::offload_copy_stream`]).
    /// Default: nothing to do (a memory without streams copies in order).
    ///
    /// [`EngineConfig::offload_copy_stream`]: super::EngineConfig::offload_copy_stream
    fn copy_stream(&mut self) -> Result<()> {
        Ok(())
    }

    /// Page-locks `values`, host memory this memory copies to and from
    /// (an offloaded shard), until the returned guard is unlocked
    /// ([`super::HostLock`]): a device's transfers then run at the link's
    /// speed, without staging through a pageable copy. `values` must
    /// neither move nor be freed while locked, nor freed at all if
    /// unlocking fails. Default: nothing to lock (`None`).
    fn pin_host(&mut self, values: &mut [T]) -> Result<Option<super::HostPin>> {
        let _ = values;
        Ok(None)
    }

    /// The host step to run on another thread while backward goes on,
    /// where this memory keeps the shard in host memory and runs no
    /// communication thread ([`OffloadMemory`](super::OffloadMemory) over a
    /// GPU): the interleaved schedule steps each bucket there as its
    /// reduced gradients land. Default `None`.
    fn host_stepper(&self) -> Option<super::HostStepper> {
        None
    }

    /// `buffer` in host memory, lent as a region to the
    /// [`ShardMemory::host_stepper`]'s thread, which reads each bucket's
    /// gradients there once landed and steps its parameters there. Default
    /// `None`.
    fn host_region(buffer: &mut Self::Buffer) -> Option<super::HostRegion<T>> {
        let _ = buffer;
        None
    }

    /// Whether `buffer` is offloaded to host memory (see
    /// [`ShardMemory::offload_optimizer`]); the memory report counts such
    /// bytes apart. Default `false`.
    fn offloaded(buffer: &Self::Buffer) -> bool {
        let _ = buffer;
        false
    }

    /// Bytes this memory holds itself for collectives, beyond the engine's
    /// buffers (a device's staging of 16-bit gathers); the memory report
    /// counts them with the communication buffers. Default `0`.
    fn staging_bytes(&self) -> usize {
        0
    }

    /// Whether the optimizer state is offloaded to host memory. Default
    /// `false`.
    fn state_offloaded(&self) -> bool {
        false
    }

    /// All-reduces a few host values (the trainable mask, a norm) and waits
    /// for the result, within the communicator's deadline.
    fn all_reduce_host<V: Element>(
        &mut self,
        comm: &C,
        values: &mut [V],
        op: ReduceOp,
    ) -> Result<()>;

    /// [`Communicator::gather_varlen`] of host values (checkpoints).
    fn gather_varlen_host(
        &mut self,
        comm: &C,
        send: &[T],
        counts: &[usize],
        recv: Option<&mut [T]>,
        root: usize,
    ) -> Result<()>;

    /// Steps the active pieces of `plan`: `params[piece.range]` from
    /// `grads[piece.range]`. `optimizer` holds the hyperparameters (and, on
    /// the host, the state).
    fn step(
        &mut self,
        optimizer: &mut dyn FunctionalOptimizer<T>,
        params: &mut Self::Buffer,
        grads: &Self::Buffer,
        plan: ShardStep<'_>,
    ) -> Result<()>;

    /// The optimizer state of the owned pieces, in host memory under
    /// `torch.optim`'s names (checkpoints). Waits within `comm`'s deadline.
    fn export_state(
        &mut self,
        comm: &C,
        optimizer: &dyn FunctionalOptimizer<T>,
        pieces: &[StepPiece<'_>],
    ) -> Result<OptimizerState<T>>;

    /// Replaces the state of the pieces in `state` (checkpoints).
    fn import_state(
        &mut self,
        optimizer: &mut dyn FunctionalOptimizer<T>,
        pieces: &[StepPiece<'_>],
        state: OptimizerState<T>,
    ) -> Result<()>;

    /// Bytes of optimizer state held.
    fn state_bytes(&self, optimizer: &dyn FunctionalOptimizer<T>) -> usize;

    /// Copies parameter `param` (whole) into host memory (checkpoints).
    /// Waits within `comm`'s deadline.
    fn read_param_host(
        &mut self,
        comm: &C,
        params: &mut Self::Params<'_>,
        param: usize,
        out: &mut [T],
    ) -> Result<()>;

    /// Overwrites parameter `param` (whole) from host memory (checkpoints).
    fn write_param_host(
        &mut self,
        params: &mut Self::Params<'_>,
        param: usize,
        values: &[T],
    ) -> Result<()>;
}

/// The error of a memory without master weights asked for them.
fn no_master_weights(op: &'static str) -> Error {
    Error::Unsupported {
        op,
        detail: "this engine memory does not keep master weights; train the model in the \
                 engine's element type (e.g. f32), or use host memory (threads, MPI) for \
                 16-bit models with f32 master weights"
            .into(),
    }
}

/// Access to the full parameter replica a framework holds in host memory.
///
/// Ranges are element ranges of the flattened (row-major) parameter.
pub trait ParamStore<T> {
    /// Copies `range` of parameter `param` into `out`.
    fn read(&mut self, param: usize, range: Range<usize>, out: &mut [T]) -> Result<()>;
    /// Overwrites `range` of parameter `param` with `values`.
    fn write(&mut self, param: usize, range: Range<usize>, values: &[T]) -> Result<()>;
}

impl<T: Copy> ParamStore<T> for Vec<Vec<T>> {
    fn read(&mut self, param: usize, range: Range<usize>, out: &mut [T]) -> Result<()> {
        out.copy_from_slice(&self[param][range]);
        Ok(())
    }

    fn write(&mut self, param: usize, range: Range<usize>, values: &[T]) -> Result<()> {
        self[param][range].copy_from_slice(values);
        Ok(())
    }
}

/// One gradient in host memory: in the engine's element type, or 16-bit
/// under wider master weights. A 16-bit gradient is widened element by
/// element as it is flattened into the buckets, so no widened copy of a
/// whole gradient exists. `&[T]` and `&Vec<T>` convert with `into()`.
#[derive(Clone, Copy, Debug)]
pub enum HostGrad<'g, T> {
    /// In the engine's element type.
    Same(&'g [T]),
    /// A bf16 model's gradient.
    Bf16(&'g [bf16]),
    /// An f16 model's gradient.
    F16(&'g [f16]),
}

impl<T> HostGrad<'_, T> {
    /// The number of elements.
    pub fn len(&self) -> usize {
        match self {
            Self::Same(g) => g.len(),
            Self::Bf16(g) => g.len(),
            Self::F16(g) => g.len(),
        }
    }

    /// Whether it has no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl<'g, T> From<&'g [T]> for HostGrad<'g, T> {
    fn from(grad: &'g [T]) -> Self {
        Self::Same(grad)
    }
}

impl<'g, T> From<&'g Vec<T>> for HostGrad<'g, T> {
    fn from(grad: &'g Vec<T>) -> Self {
        Self::Same(grad)
    }
}

/// Adds (or copies) `src`, converted to `T`, into `dst`: for a 16-bit
/// `src`, the values a widened copy of it would give, bit for bit.
fn flatten_into<T: Element, S: Element>(dst: &mut [T], src: &[S], add: bool) {
    if !add {
        return convert_slice(src, dst);
    }
    // Widened a stretch at a time (the fast conversions), then added.
    let mut wide = [T::default(); 1024];
    for (d, s) in dst.chunks_mut(wide.len()).zip(src.chunks(wide.len())) {
        let wide = &mut wide[..s.len().min(d.len())];
        convert_slice(s, wide);
        for (d, w) in d.iter_mut().zip(wide.iter()) {
            *d = T::from_acc(d.to_acc() + w.to_acc());
        }
    }
}

/// Host memory: buffers are `Vec<T>`, gradients [`HostGrad`]s, parameters
/// a [`ParamStore`], and the optimizer a [`FunctionalOptimizer`] that
/// keeps its own state.
#[derive(Clone, Copy, Debug, Default)]
pub struct HostMemory;

impl<T: Element, C: Communicator<Memory = Host>> ShardMemory<T, C> for HostMemory {
    type Buffer = Vec<T>;
    type Gathers = HostGathers<T>;
    type Grad<'g> = HostGrad<'g, T>;
    type Params<'p> = dyn ParamStore<T> + 'p;

    fn grad_len(grad: &HostGrad<'_, T>) -> usize {
        grad.len()
    }

    fn alloc_zeroed(&mut self, numel: usize) -> Result<Vec<T>> {
        Ok(vec![T::default(); numel])
    }

    fn buffer_len(buffer: &Vec<T>) -> usize {
        buffer.len()
    }

    fn gathers(&self, comm: C) -> Result<HostGathers<T>> {
        Ok(host_gathers(comm))
    }

    fn zero(&mut self, buffer: &mut Vec<T>, range: Range<usize>) -> Result<()> {
        buffer[range].fill(T::default());
        Ok(())
    }

    fn flatten(
        &mut self,
        buffer: &mut Vec<T>,
        pieces: &[GradPiece<HostGrad<'_, T>>],
        add: bool,
    ) -> Result<()> {
        for piece in pieces {
            let dst = &mut buffer[piece.at..piece.at + piece.range.len()];
            let range = piece.range.clone();
            match piece.grad {
                HostGrad::Same(g) if !add => dst.copy_from_slice(&g[range]),
                HostGrad::Same(g) => flatten_into(dst, &g[range], true),
                HostGrad::Bf16(g) => flatten_into(dst, &g[range], add),
                HostGrad::F16(g) => flatten_into(dst, &g[range], add),
            }
        }
        Ok(())
    }

    fn copy_range(
        &mut self,
        dst: &mut Vec<T>,
        dst_at: usize,
        src: &Vec<T>,
        src_range: Range<usize>,
        add: bool,
    ) -> Result<()> {
        host_copy(
            &mut dst[dst_at..dst_at + src_range.len()],
            &src[src_range],
            add,
        );
        Ok(())
    }

    fn fork(&self) -> Option<Self> {
        Some(HostMemory)
    }

    fn read_params(
        &mut self,
        params: &mut (dyn ParamStore<T> + '_),
        copies: &[ParamCopy],
        buffer: &mut Vec<T>,
    ) -> Result<()> {
        for c in copies {
            params.read(
                c.param,
                c.param_range.clone(),
                &mut buffer[c.at..c.at + c.param_range.len()],
            )?;
        }
        Ok(())
    }

    fn write_params(
        &mut self,
        params: &mut (dyn ParamStore<T> + '_),
        copies: &[ParamCopy],
        buffer: &Vec<T>,
    ) -> Result<()> {
        for c in copies {
            params.write(
                c.param,
                c.param_range.clone(),
                &buffer[c.at..c.at + c.param_range.len()],
            )?;
        }
        Ok(())
    }

    fn scale(&mut self, buffer: &mut Vec<T>, ranges: &[Range<usize>], factor: f64) -> Result<()> {
        host_scale(buffer, ranges, factor);
        Ok(())
    }

    fn norm_partial(
        &mut self,
        _comm: &C,
        buffer: &Vec<T>,
        ranges: &[Range<usize>],
        norm: NormType,
    ) -> Result<f64> {
        Ok(host_norm(buffer, ranges, norm))
    }

    fn all_reduce(
        &mut self,
        comm: &C,
        buffer: &mut Vec<T>,
        range: Range<usize>,
        op: ReduceOp,
    ) -> Result<()> {
        comm.all_reduce(&mut buffer[range], op)
    }

    fn reduce_scatter(
        &mut self,
        comm: &C,
        send: &Vec<T>,
        send_range: Range<usize>,
        recv: &mut Vec<T>,
        recv_range: Range<usize>,
        op: ReduceOp,
    ) -> Result<()> {
        comm.reduce_scatter(&send[send_range], &mut recv[recv_range], op)
    }

    fn all_gather(
        &mut self,
        comm: &C,
        send: &Vec<T>,
        send_range: Range<usize>,
        recv: &mut Vec<T>,
        recv_range: Range<usize>,
    ) -> Result<()> {
        comm.all_gather(&send[send_range], &mut recv[recv_range])
    }

    fn all_reduce_as(
        &mut self,
        comm: &C,
        buffer: &mut Vec<T>,
        range: Range<usize>,
        op: ReduceOp,
        wire: DType,
    ) -> Result<()> {
        let buffer = &mut buffer[range];
        match wire {
            _ if wire == T::DTYPE => comm.all_reduce(buffer, op),
            DType::BF16 => all_reduce_narrow::<T, bf16, C>(comm, buffer, op),
            DType::F16 => all_reduce_narrow::<T, f16, C>(comm, buffer, op),
            _ => comm.all_reduce(buffer, op),
        }
    }

    fn reduce_scatter_as(
        &mut self,
        comm: &C,
        send: &Vec<T>,
        send_range: Range<usize>,
        recv: &mut Vec<T>,
        recv_range: Range<usize>,
        op: ReduceOp,
        wire: DType,
    ) -> Result<()> {
        let (send, recv) = (&send[send_range], &mut recv[recv_range]);
        match wire {
            _ if wire == T::DTYPE => comm.reduce_scatter(send, recv, op),
            DType::BF16 => reduce_scatter_narrow::<T, bf16, C>(comm, send, recv, op),
            DType::F16 => reduce_scatter_narrow::<T, f16, C>(comm, send, recv, op),
            _ => comm.reduce_scatter(send, recv, op),
        }
    }

    fn all_gather_as(
        &mut self,
        comm: &C,
        send: &Vec<T>,
        send_range: Range<usize>,
        recv: &mut Vec<T>,
        recv_range: Range<usize>,
        wire: DType,
    ) -> Result<()> {
        let (send, recv) = (&send[send_range], &mut recv[recv_range]);
        match wire {
            _ if wire == T::DTYPE => comm.all_gather(send, recv),
            DType::BF16 => gather_narrow::<T, bf16, C>(comm, send, recv),
            DType::F16 => gather_narrow::<T, f16, C>(comm, send, recv),
            // Never narrower than `T`: nothing to gain.
            DType::F32 | DType::F64 => comm.all_gather(send, recv),
        }
    }

    fn gathers_packed(&self) -> bool {
        true
    }

    fn all_gather_packed(
        &mut self,
        comm: &C,
        send: &Vec<T>,
        n: usize,
        recv: &mut Vec<T>,
        recv_range: Range<usize>,
        wire: DType,
    ) -> Result<()> {
        if packed_len::<T>(n) > send.len() {
            return Err(Error::BufferSize {
                op: "all_gather_packed",
                what: "packed chunk",
                got: send.len(),
                expected: packed_len::<T>(n),
            });
        }
        let recv = &mut recv[recv_range];
        match wire {
            DType::BF16 => gather_packed::<T, bf16, C>(comm, send, n, recv),
            DType::F16 => gather_packed::<T, f16, C>(comm, send, n, recv),
            other => Err(Error::State(format!(
                "internal: a packed gather in {other:?}, not a 16-bit dtype"
            ))),
        }
    }

    fn buffer_to_host(
        &mut self,
        _comm: &C,
        buffer: &Vec<T>,
        range: Range<usize>,
        out: &mut [T],
    ) -> Result<()> {
        out.copy_from_slice(&buffer[range]);
        Ok(())
    }

    fn buffer_from_host(&mut self, buffer: &mut Vec<T>, at: usize, values: &[T]) -> Result<()> {
        buffer[at..at + values.len()].copy_from_slice(values);
        Ok(())
    }

    fn download(&mut self, buffer: &Vec<T>, range: Range<usize>, out: &mut [T]) -> Result<()> {
        out.copy_from_slice(&buffer[range]);
        Ok(())
    }

    fn all_reduce_host<V: Element>(
        &mut self,
        comm: &C,
        values: &mut [V],
        op: ReduceOp,
    ) -> Result<()> {
        comm.all_reduce(values, op)
    }

    fn gather_varlen_host(
        &mut self,
        comm: &C,
        send: &[T],
        counts: &[usize],
        recv: Option<&mut [T]>,
        root: usize,
    ) -> Result<()> {
        comm.gather_varlen(send, counts, recv, root)
    }

    fn step(
        &mut self,
        optimizer: &mut dyn FunctionalOptimizer<T>,
        params: &mut Vec<T>,
        grads: &Vec<T>,
        plan: ShardStep<'_>,
    ) -> Result<()> {
        host_step(optimizer, params, grads, plan)
    }

    fn export_state(
        &mut self,
        _comm: &C,
        optimizer: &dyn FunctionalOptimizer<T>,
        _pieces: &[StepPiece<'_>],
    ) -> Result<OptimizerState<T>> {
        Ok(optimizer.export_state())
    }

    fn import_state(
        &mut self,
        optimizer: &mut dyn FunctionalOptimizer<T>,
        _pieces: &[StepPiece<'_>],
        state: OptimizerState<T>,
    ) -> Result<()> {
        optimizer.import_state(state)
    }

    fn state_bytes(&self, optimizer: &dyn FunctionalOptimizer<T>) -> usize {
        optimizer.state_bytes()
    }

    fn read_param_host(
        &mut self,
        _comm: &C,
        params: &mut (dyn ParamStore<T> + '_),
        param: usize,
        out: &mut [T],
    ) -> Result<()> {
        let len = out.len();
        params.read(param, 0..len, out)
    }

    fn write_param_host(
        &mut self,
        params: &mut (dyn ParamStore<T> + '_),
        param: usize,
        values: &[T],
    ) -> Result<()> {
        params.write(param, 0..values.len(), values)
    }
}

/// Stage 3's gathers on host memory over `comm`.
pub fn host_gathers<T: Element, C: Communicator<Memory = Host>>(comm: C) -> HostGathers<T> {
    HostGathers::new(Arc::new(move |send: &[T], recv: &mut [T]| {
        comm.all_gather(send, recv)
    }))
}

/// Adds (`add`) or copies `src` into `dst`, in host memory.
pub(super) fn host_copy<T: Element>(dst: &mut [T], src: &[T], add: bool) {
    if add {
        let n = dst.len().min(src.len());
        elementwise(&mut dst[..n], |d, at| {
            for (d, s) in d.iter_mut().zip(&src[at..]) {
                *d = T::from_acc(d.to_acc() + s.to_acc());
            }
        });
    } else {
        dst.copy_from_slice(src);
    }
}

/// Multiplies `buffer[range]` by `factor` for every range, in host memory.
pub(super) fn host_scale<T: Element>(buffer: &mut [T], ranges: &[Range<usize>], factor: f64) {
    for range in ranges {
        elementwise(&mut buffer[range.clone()], |g, _| {
            for g in g {
                *g = T::from_f64(g.to_f64() * factor);
            }
        });
    }
}

/// Elements one task of [`elementwise`] takes.
const ELEMENTWISE_CHUNK: usize = 64 << 10;

/// Runs `work(chunk, offset)` over `values` in chunks, split across
/// rayon's threads when there is more than one chunk: for operations whose
/// elements are independent (the result is the same however it is split).
fn elementwise<T: Send>(values: &mut [T], work: impl Fn(&mut [T], usize) + Sync) {
    use rayon::prelude::*;
    if values.len() <= ELEMENTWISE_CHUNK {
        return work(values, 0);
    }
    values
        .par_chunks_mut(ELEMENTWISE_CHUNK)
        .enumerate()
        .for_each(|(i, chunk)| work(chunk, i * ELEMENTWISE_CHUNK));
}

/// This rank's part of a norm over `buffer[range]` for every range (see
/// [`ShardMemory::norm_partial`]), in host memory. A long range is taken
/// in chunks of [`ELEMENTWISE_CHUNK`] across rayon's threads, their parts
/// combined in order: the same value however many threads there are.
pub(super) fn host_norm<T: Element>(buffer: &[T], ranges: &[Range<usize>], norm: NormType) -> f64 {
    use rayon::prelude::*;
    let part = |g: &[T]| -> f64 {
        match norm {
            NormType::L1 => g.iter().map(|x| x.to_f64().abs()).sum::<f64>(),
            NormType::L2 => g.iter().map(|x| x.to_f64().powi(2)).sum::<f64>(),
            // `f64::max` would drop a NaN: count it as infinite instead.
            NormType::Inf => g.iter().fold(0.0, |m: f64, x| {
                let a = x.to_f64().abs();
                if a.is_nan() {
                    f64::INFINITY
                } else {
                    m.max(a)
                }
            }),
        }
    };
    let mut local = 0.0f64;
    for range in ranges {
        let g = &buffer[range.clone()];
        let parts: Vec<f64> = if g.len() > ELEMENTWISE_CHUNK {
            g.par_chunks(ELEMENTWISE_CHUNK).map(part).collect()
        } else {
            vec![part(g)]
        };
        for p in parts {
            local = match norm {
                NormType::Inf => local.max(p),
                NormType::L1 | NormType::L2 => local + p,
            };
        }
    }
    local
}

/// Steps the active pieces of `plan` in host memory through `optimizer`,
/// which keeps its own state.
pub(super) fn host_step<T: Element>(
    optimizer: &mut dyn FunctionalOptimizer<T>,
    params: &mut [T],
    grads: &[T],
    plan: ShardStep<'_>,
) -> Result<()> {
    // Split the shard into disjoint mutable pieces (in shard order).
    let mut pieces = Vec::with_capacity(plan.pieces.len());
    let mut slots = Vec::with_capacity(plan.pieces.len());
    let mut rest: &mut [T] = params;
    let mut consumed = 0;
    for piece in plan.pieces {
        let (_, tail) = std::mem::take(&mut rest).split_at_mut(piece.range.start - consumed);
        let (data, tail) = tail.split_at_mut(piece.range.len());
        rest = tail;
        consumed = piece.range.end;
        pieces.push(ParamMut {
            key: piece.key,
            data,
        });
        slots.push(piece.active.then(|| &grads[piece.range.clone()]));
    }
    optimizer.step(&mut pieces, &slots)
}

/// `values` rounded to `L` (to nearest).
fn narrowed<T: Element, L: Element>(values: &[T]) -> Vec<L> {
    let mut narrow = vec![L::default(); values.len()];
    super::precision::convert_slice(values, &mut narrow);
    narrow
}

/// Elements of `T` that `n` packed 16-bit values take ([`pack_narrow`]).
pub fn packed_len<T>(n: usize) -> usize {
    (2 * n).div_ceil(std::mem::size_of::<T>())
}

/// Rounds `values` to the 16-bit dtype `wire` and packs them into the
/// first [`packed_len`] elements of `out` (their memory holds the 16-bit
/// values in order): what offload's write-back sends up for a 16-bit
/// model, half the bytes of f32 masters.
///
/// # Panics
/// If `wire` is not 16-bit, or `out` is shorter than `values`.
pub fn pack_narrow<T: Element>(values: &[T], wire: DType, out: &mut [T]) {
    match wire {
        DType::BF16 => convert_slice(values, as_narrow_mut::<T, bf16>(out, values.len())),
        DType::F16 => convert_slice(values, as_narrow_mut::<T, f16>(out, values.len())),
        other => panic!("pack_narrow to {other:?}: not a 16-bit dtype"),
    }
}

/// The first `n` 16-bit values in `packed`'s memory, as `L`.
fn as_narrow<T, L: Element>(packed: &[T], n: usize) -> &[L] {
    assert!(std::mem::size_of::<L>() == 2 && packed_len::<T>(n) <= packed.len());
    // SAFETY: within `packed`'s memory (checked above); `L` is a 16-bit
    // plain-data type, aligned to 2, and `T` (an element) to at least 2.
    unsafe { std::slice::from_raw_parts(packed.as_ptr().cast::<L>(), n) }
}

/// [`as_narrow`], writable.
fn as_narrow_mut<T, L: Element>(packed: &mut [T], n: usize) -> &mut [L] {
    assert!(std::mem::size_of::<L>() == 2 && packed_len::<T>(n) <= packed.len());
    // SAFETY: as in `as_narrow`, and `packed` is borrowed mutably.
    unsafe { std::slice::from_raw_parts_mut(packed.as_mut_ptr().cast::<L>(), n) }
}

/// All-gathers the `n` values packed in `send` as `L` into `recv`, widened.
fn gather_packed<T: Element, L: Element, C: Communicator<Memory = Host>>(
    comm: &C,
    send: &[T],
    n: usize,
    recv: &mut [T],
) -> Result<()> {
    let mut narrow = vec![L::default(); recv.len()];
    comm.all_gather(as_narrow::<T, L>(send, n), &mut narrow)?;
    convert_slice(&narrow, recv);
    Ok(())
}

/// All-reduces `buffer` rounded to `L`, and widens the result back.
fn all_reduce_narrow<T: Element, L: Element, C: Communicator<Memory = Host>>(
    comm: &C,
    buffer: &mut [T],
    op: ReduceOp,
) -> Result<()> {
    let mut narrow: Vec<L> = narrowed(buffer);
    comm.all_reduce(&mut narrow, op)?;
    super::precision::convert_slice(&narrow, buffer);
    Ok(())
}

/// Reduce-scatters `send` rounded to `L` into `recv`, widened back.
fn reduce_scatter_narrow<T: Element, L: Element, C: Communicator<Memory = Host>>(
    comm: &C,
    send: &[T],
    recv: &mut [T],
    op: ReduceOp,
) -> Result<()> {
    let narrow: Vec<L> = narrowed(send);
    let mut narrow_recv = vec![L::default(); recv.len()];
    comm.reduce_scatter(&narrow, &mut narrow_recv, op)?;
    super::precision::convert_slice(&narrow_recv, recv);
    Ok(())
}

/// All-gathers `send` as `L` (rounded to nearest) and widens what arrives
/// back into `recv`. The narrow values are received into the tail of
/// `recv`'s own bytes and widened front to back in place (element `i` is
/// read before anything is written over it, since `T` is at least as wide
/// as `L`), so the gather needs no bucket-sized buffer of its own.
fn gather_narrow<T: Element, L: Element, C: Communicator<Memory = Host>>(
    comm: &C,
    send: &[T],
    recv: &mut [T],
) -> Result<()> {
    let narrow_send: Vec<L> = narrowed(send);
    let (wide, narrow) = (std::mem::size_of::<T>(), std::mem::size_of::<L>());
    let len = recv.len();
    let bytes: &mut [u8] = bytemuck::cast_slice_mut(recv);
    let tail = len * (wide - narrow);
    match bytemuck::try_cast_slice_mut::<u8, L>(&mut bytes[tail..]) {
        Ok(narrow_recv) => comm.all_gather(&narrow_send, narrow_recv)?,
        // Not aligned for `L` (never for the f32/bf16 pairs used): a buffer.
        Err(_) => {
            let mut narrow_recv = vec![L::default(); len];
            comm.all_gather(&narrow_send, &mut narrow_recv)?;
            let recv: &mut [T] = bytemuck::cast_slice_mut(bytes);
            super::precision::convert_slice(&narrow_recv, recv);
            return Ok(());
        }
    }
    for i in 0..len {
        let at = tail + i * narrow;
        let value: L = bytemuck::pod_read_unaligned(&bytes[at..at + narrow]);
        let value = T::from_f64(value.to_f64());
        bytes[i * wide..(i + 1) * wide].copy_from_slice(bytemuck::bytes_of(&value));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_long_norm_is_the_same_on_any_number_of_threads() {
        let n = 5 * ELEMENTWISE_CHUNK + 3;
        let mut values: Vec<f32> = (0..n)
            .map(|i| ((i * 37) % 1009) as f32 * 1e-3 - 0.4)
            .collect();
        let within = 1..n - 1;
        let ranges = std::slice::from_ref(&within);
        let on = |threads: usize, values: &[f32], norm: NormType| {
            rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap()
                .install(|| host_norm(values, ranges, norm))
        };
        for norm in [NormType::L1, NormType::L2, NormType::Inf] {
            let one = on(1, &values, norm);
            assert_eq!(one.to_bits(), on(3, &values, norm).to_bits(), "{norm:?}");
            let g = &values[within.clone()];
            let sequential = match norm {
                NormType::L1 => g.iter().map(|x| (*x as f64).abs()).sum::<f64>(),
                NormType::L2 => g.iter().map(|x| (*x as f64).powi(2)).sum::<f64>(),
                NormType::Inf => g.iter().map(|x| (*x as f64).abs()).fold(0.0, f64::max),
            };
            assert!((one - sequential).abs() <= 1e-12 * sequential, "{norm:?}");
        }
        // A NaN in a later chunk makes the infinity norm infinite.
        values[4 * ELEMENTWISE_CHUNK + 9] = f32::NAN;
        assert_eq!(on(2, &values, NormType::Inf), f64::INFINITY);
    }

    #[test]
    fn a_long_scale_or_sum_split_across_threads_is_the_element_by_element_one() {
        let n = 3 * ELEMENTWISE_CHUNK + 17;
        let values: Vec<f32> = (0..n).map(|i| (i % 1013) as f32 * 0.37 - 91.0).collect();
        let other: Vec<f32> = (0..n).map(|i| (i % 641) as f32 * -1.3 + 7.0).collect();

        let mut scaled = values.clone();
        // Two ranges, one of them short, and the elements between untouched.
        let ranges = [5..n - 3, 0..2];
        host_scale(&mut scaled, &ranges, 0.1);
        for (i, (got, v)) in scaled.iter().zip(&values).enumerate() {
            let want = if ranges.iter().any(|r| r.contains(&i)) {
                (*v as f64 * 0.1) as f32
            } else {
                *v
            };
            assert_eq!(got.to_bits(), want.to_bits(), "element {i}");
        }

        let mut summed = values.clone();
        host_copy(&mut summed, &other, true);
        for (i, ((got, v), o)) in summed.iter().zip(&values).zip(&other).enumerate() {
            assert_eq!(got.to_bits(), (v + o).to_bits(), "element {i}");
        }
        // A shorter source adds into the first elements only.
        let mut partly = values.clone();
        host_copy(&mut partly, &other[..n - 5], true);
        assert_eq!(partly[n - 5..], values[n - 5..]);
        assert_eq!(partly[n - 6], values[n - 6] + other[n - 6]);
    }

    /// Packed values are the rounded ones, in order, from the start of the
    /// buffer's memory, for any wider element; the rest is left alone.
    #[test]
    fn packing_rounds_each_value_into_the_buffers_first_bytes() {
        let values: Vec<f64> = vec![0.5, 1.0 + 1.0 / 512.0, -2.71, 1e-3, 65504.0];
        let mut out = vec![7.0f64; 4];
        pack_narrow(&values, DType::BF16, &mut out);
        assert_eq!(packed_len::<f64>(values.len()), 2);
        let packed = as_narrow::<f64, bf16>(&out, values.len());
        for (got, v) in packed.iter().zip(&values) {
            assert_eq!(*got, bf16::from_f64(*v));
        }
        assert_eq!(out[2..], [7.0, 7.0], "past the packed values");
        let values: Vec<f32> = vec![0.1, -2.5, 1e-5];
        let mut out = vec![0f32; 3];
        pack_narrow(&values, DType::F16, &mut out);
        assert_eq!(packed_len::<f32>(values.len()), 2);
        let packed = as_narrow::<f32, f16>(&out, values.len());
        for (got, v) in packed.iter().zip(&values) {
            assert_eq!(*got, f16::from_f32(*v));
        }
    }

    /// A chunk too short for the values it is said to hold is an error,
    /// not a read past it.
    #[test]
    fn a_packed_gather_from_too_short_a_chunk_is_an_error() {
        let errors = crate::ThreadGroup::new(1).run(|comm| {
            let (send, mut recv) = (vec![0f32; 2], vec![0f32; 5]);
            <HostMemory as ShardMemory<f32, _>>::all_gather_packed(
                &mut HostMemory,
                &comm,
                &send,
                5,
                &mut recv,
                0..5,
                DType::BF16,
            )
            .expect_err("5 values in 2 elements")
            .to_string()
        });
        let error = errors[0].as_ref().expect("the rank ran");
        assert!(error.contains("all_gather_packed"), "{error}");
    }
}
