//! The [`Communicator`] trait, the memory its buffers live in, and the
//! reduction operations.

use super::work::Work;
use crate::{Element, Result};
use std::time::Duration;

/// The default deadline of a collective.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);

/// Where a backend's buffers live.
pub trait MemoryKind: Send + Sync + 'static {
    /// The buffer of `T` elements a collective takes.
    type Buffer<T: Element>: ?Sized;
}

/// Host memory: buffers are slices.
#[derive(Clone, Copy, Debug, Default)]
pub struct Host;

impl MemoryKind for Host {
    type Buffer<T: Element> = [T];
}

/// The buffer type of communicator `C` for elements `T`.
pub type Buf<C, T> = <<C as Communicator>::Memory as MemoryKind>::Buffer<T>;

/// How a reduction combines the ranks' values.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    /// Sum over ranks.
    Sum,
    /// Sum over ranks divided by the world size.
    Avg,
    /// Element-wise maximum.
    Max,
    /// Element-wise minimum.
    Min,
    /// Product over ranks.
    Product,
}

impl ReduceOp {
    /// The lowercase name of the operation.
    pub fn as_str(self) -> &'static str {
        match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Avg => "avg",
            ReduceOp::Max => "max",
            ReduceOp::Min => "min",
            ReduceOp::Product => "product",
        }
    }
}

/// A group of ranks that run collectives together.
///
/// Sizes are derived from the buffers: `reduce_scatter` takes a send buffer
/// of `world_size * n` elements and a receive buffer of `n`; `all_gather`
/// takes `n` and `world_size * n`. Rank `r`'s part is always the `r`-th
/// contiguous chunk. 16-bit reductions accumulate in f32.
///
/// The `*_async` forms start the collective and return a [`Work`] that keeps
/// the buffers borrowed until it completes; `wait` it before touching them.
///
/// A communicator owns what it uses (`'static`): the engine hands it to its
/// communication thread.
pub trait Communicator: Send + Sync + 'static {
    /// Where this backend's buffers live.
    type Memory: MemoryKind;

    /// This rank's index in the group, `0..world_size`.
    fn rank(&self) -> usize;

    /// The number of ranks in the group.
    fn world_size(&self) -> usize;

    /// Bytes this rank has sent so far, counted as the ring algorithms send
    /// them (reduce-scatter and all-gather: `(N-1)/N` of the full buffer).
    fn bytes_sent(&self) -> u64;

    /// Blocks until every rank has called `barrier`.
    fn barrier(&self) -> Result<()>;

    /// Reduces `buf` across ranks in place; every rank gets the result.
    fn all_reduce<T: Element>(&self, buf: &mut Buf<Self, T>, op: ReduceOp) -> Result<()>;

    /// Reduces `send` (`world_size * n` elements) across ranks; rank `r`
    /// receives chunk `r` of the result in `recv` (`n` elements).
    fn reduce_scatter<T: Element>(
        &self,
        send: &Buf<Self, T>,
        recv: &mut Buf<Self, T>,
        op: ReduceOp,
    ) -> Result<()>;

    /// Concatenates every rank's `send` (`n` elements) into `recv`
    /// (`world_size * n`), in rank order.
    fn all_gather<T: Element>(&self, send: &Buf<Self, T>, recv: &mut Buf<Self, T>) -> Result<()>;

    /// Copies `root`'s `buf` into every other rank's `buf`.
    fn broadcast<T: Element>(&self, buf: &mut Buf<Self, T>, root: usize) -> Result<()>;

    /// Reduces `buf` across ranks; the result lands in `root`'s `buf`, the
    /// other ranks' buffers are left unchanged.
    fn reduce<T: Element>(&self, buf: &mut Buf<Self, T>, op: ReduceOp, root: usize) -> Result<()>;

    /// Gathers variable-size contributions to `root`: rank `r` sends
    /// `counts[r]` elements; on `root`, `recv` (length `sum(counts)`) receives
    /// them in rank order. Other ranks pass `None`. Ranks with a count of 0
    /// send nothing, so one rank's shard at a time can be streamed to `root`.
    fn gather_varlen<T: Element>(
        &self,
        send: &Buf<Self, T>,
        counts: &[usize],
        recv: Option<&mut Buf<Self, T>>,
        root: usize,
    ) -> Result<()>;

    /// Like [`Communicator::gather_varlen`], with every rank receiving.
    fn all_gather_varlen<T: Element>(
        &self,
        send: &Buf<Self, T>,
        counts: &[usize],
        recv: &mut Buf<Self, T>,
    ) -> Result<()>;

    /// Gathers a small host byte string from every rank to every rank (for
    /// fingerprints and metadata, never on the step path).
    fn all_gather_bytes(&self, send: &[u8]) -> Result<Vec<Vec<u8>>>;

    /// Starts an all-reduce; see [`Communicator::all_reduce`].
    fn all_reduce_async<'a, T: Element>(
        &'a self,
        buf: &'a mut Buf<Self, T>,
        op: ReduceOp,
    ) -> Result<Work<'a>>;

    /// Starts a reduce-scatter; see [`Communicator::reduce_scatter`].
    fn reduce_scatter_async<'a, T: Element>(
        &'a self,
        send: &'a Buf<Self, T>,
        recv: &'a mut Buf<Self, T>,
        op: ReduceOp,
    ) -> Result<Work<'a>>;

    /// Starts an all-gather; see [`Communicator::all_gather`].
    fn all_gather_async<'a, T: Element>(
        &'a self,
        send: &'a Buf<Self, T>,
        recv: &'a mut Buf<Self, T>,
    ) -> Result<Work<'a>>;

    /// Starts a broadcast; see [`Communicator::broadcast`].
    fn broadcast_async<'a, T: Element>(
        &'a self,
        buf: &'a mut Buf<Self, T>,
        root: usize,
    ) -> Result<Work<'a>>;

    /// Whether this communicator and another of the same process (one made
    /// by [`Communicator::split`]) may each run a collective at the same
    /// time, from two threads. Stage 3 then gathers parameters on a thread
    /// of its own while gradients are reduced on another. MPI says so only
    /// under `MPI_THREAD_MULTIPLE`: below it every call of a process is
    /// serialized, so two collectives waiting on each other's peers could
    /// deadlock.
    fn concurrent_groups(&self) -> bool {
        true
    }

    /// Creates a communicator over a subset of this group's ranks.
    ///
    /// A collective: every rank of this group calls it with the same sorted
    /// `ranks`. Members get `Some` (their rank in the subgroup is their
    /// position in `ranks`); the others get `None`.
    fn split(&self, ranks: &[usize]) -> Result<Option<Self>>
    where
        Self: Sized;
}
