//! [`ShardMemory`]: the seam between the engine and the memory its buffers
//! live in.
//!
//! The engine's stage logic (plan, buckets, trainability, accumulation,
//! clipping, gradient checks, checkpoints) is shared by every memory. What
//! depends on where the flat buffers live is this trait: allocate and zero
//! a buffer, flatten gradients into a bucket, move parameter pieces between
//! the framework and a flat buffer, scale, partial norms, the collectives
//! over ranges of a buffer, and the optimizer step on the shard. What only
//! some memories can do is a capability trait of its own, which the memory
//! hands out when it has it ([`ShardMemory::deferral`],
//! [`ShardMemory::packed_gathers`], [`ShardMemory::host_offload`]), or
//! which a wrapper asks of what it wraps ([`HostTransfers`]).
//! [`HostMemory`] implements the core over `Vec<T>` (the optimizer steps
//! through [`FunctionalOptimizer`], so custom optimizers work); `zero-nccl`'s
//! `CudaMemory` over device buffers with fused kernels.
//!
//! Every method is local except the collectives, which every rank calls in
//! the same order (the engine guarantees it), and which must honour the
//! communicator's deadline: a dead peer is an error, never a hang.

mod capability;
mod host;
mod narrow;

pub(crate) use capability::{alloc_shard, deferral, start_offload, Abilities};
pub use capability::{Deferral, HostOffload, HostStepper, HostTransfers, PackedGathers};
pub(crate) use host::{host_copy, host_norm, host_scale};
pub use host::{host_gathers, HostMemory};
pub use narrow::{pack_narrow, packed_len};

use super::fetch::GatherMemory;
use super::NormType;
use crate::comm::{Communicator, ReduceOp};
use crate::optim::{FunctionalOptimizer, OptimizerState, ParamKey, ParamMut};
use crate::{DType, Element, Result};
use half::{bf16, f16};
use std::ops::Range;

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
    /// unless it has a [`ShardMemory::deferral`]).
    fn fork(&self) -> Option<Self>
    where
        Self: Sized,
    {
        None
    }

    /// This memory's [`Deferral`], where its collectives can complete after
    /// they return (a device stream): a memory without
    /// [`ShardMemory::fork`] that has one gets a backward pass's reductions
    /// launched on the calling thread as their buckets fill, overlapping
    /// the rest of backward. Default `None`: collectives complete before
    /// they return.
    fn deferral(&mut self) -> Option<&mut dyn Deferral<C>> {
        None
    }

    /// Whether [`ShardMemory::all_reduce_as`] and
    /// [`ShardMemory::reduce_scatter_as`] round to a 16-bit `wire` (the
    /// defaults reduce in `T`). Default `false`: the engine refuses
    /// [`EngineConfig::replica_reduce_dtype`](crate::engine::EngineConfig::replica_reduce_dtype).
    fn narrows_wire(&self) -> bool {
        false
    }

    /// This memory's [`PackedGathers`], where it has them (offload's
    /// write-back then sends a 16-bit model's weights up in 16 bits).
    /// Default `None`.
    fn packed_gathers(&mut self) -> Option<&mut dyn PackedGathers<C, Self::Buffer>> {
        None
    }

    /// This memory's [`HostOffload`] (ZeRO-Offload), where it can keep the
    /// optimizer's side in host memory. Default `None`: the engine refuses
    /// `EngineConfig::offload`.
    fn host_offload(&mut self) -> Option<&mut dyn HostOffload<C, Self::Buffer>> {
        None
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

    /// Copies `buffer[range]` into host memory (master weights for a
    /// checkpoint), once everything queued before it has written it.
    /// Waits within `comm`'s deadline.
    fn buffer_to_host(
        &mut self,
        comm: &C,
        buffer: &Self::Buffer,
        range: Range<usize>,
        out: &mut [T],
    ) -> Result<()>;

    /// Overwrites `buffer[at..at + values.len()]` from host memory (master
    /// weights from a checkpoint, a staged upload).
    fn buffer_from_host(
        &mut self,
        buffer: &mut Self::Buffer,
        at: usize,
        values: &[T],
    ) -> Result<()>;

    /// `buffer` in host memory, lent as a region to the
    /// [`HostOffload::host_stepper`]'s thread, which reads each bucket's
    /// gradients there once landed and steps its parameters there. Default
    /// `None`.
    fn host_region(buffer: &mut Self::Buffer) -> Option<super::host_buffer::HostRegion<T>> {
        let _ = buffer;
        None
    }

    /// Whether `buffer` is offloaded to host memory (see
    /// [`HostOffload`]); the memory report counts such
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

    /// Fails unless this memory can step `optimizer` itself: a device
    /// memory whose step runs kernels for some kinds only refuses the rest
    /// with an error naming the ones it runs. The engine asks at
    /// construction, and not when the optimizer is offloaded (the host
    /// steps any optimizer). The default steps any.
    fn check_optimizer(&self, optimizer: &dyn FunctionalOptimizer<T>) -> Result<()> {
        let _ = optimizer;
        Ok(())
    }

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

    /// [`export_state`](ShardMemory::export_state) into `out`, reusing its
    /// buffers where the memory can (background checkpoints, at every
    /// save). The default exports afresh.
    fn export_state_into(
        &mut self,
        comm: &C,
        optimizer: &dyn FunctionalOptimizer<T>,
        pieces: &[StepPiece<'_>],
        out: &mut OptimizerState<T>,
    ) -> Result<()> {
        *out = self.export_state(comm, optimizer, pieces)?;
        Ok(())
    }

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

/// Steps the active pieces of `plan` in host memory through `optimizer`,
/// which keeps its own state.
pub(crate) fn host_step<T: Element>(
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
