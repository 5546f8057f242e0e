//! The engine's flat buffers, in its memory, and the pieces gradients are
//! flattened into them by.

use super::layout::Run;
use super::shard_memory::{GradPiece, ShardMemory};
use crate::comm::Communicator;
use crate::{Element, Result};
use std::ops::Range;

/// The engine's flat buffers, in its memory.
pub(super) struct Buffers<B> {
    /// The owned parameter pieces at their shard offsets: master weights,
    /// stage 3's only copy, or a working copy (empty with a lean shard).
    pub param_shard: ParamShard<B>,
    /// The reduced gradient shard (stages 1-3).
    pub grad_shard: Option<B>,
    /// Full gradients in bucket-major order: stage 0's reduced gradients;
    /// stages 1-3's micro-steps given outside a backward pass.
    pub full_grads: Option<B>,
    /// Bucket buffers, recycled: filled by gradients during an overlapped
    /// backward, and the reduce-scatter source and all-gather destination
    /// when there is no full buffer.
    pub pool: Vec<B>,
    /// A shard-bucket-sized buffer to reduce-scatter into when adding to
    /// the gradient shard (and to stage from when gathering).
    pub scratch: Option<B>,
}

impl<B> Buffers<B> {
    /// A buffer of at least `len` elements, from the pool or new.
    pub fn take_pooled<T: Element, C: Communicator, M: ShardMemory<T, C, Buffer = B>>(
        &mut self,
        memory: &mut M,
        len: usize,
    ) -> Result<B> {
        match self.pool.iter().position(|b| M::buffer_len(b) >= len) {
            Some(i) => Ok(self.pool.swap_remove(i)),
            None => memory.alloc_zeroed(len),
        }
    }
}

/// The parameter shard, here or lent: to stage 3's fetcher between steps
/// (its only copy), or to a step running beside backward (the interleaved
/// schedule, offload's step thread) until the step takes it back.
pub(super) enum ParamShard<B> {
    Here(B),
    Lent { to: Borrower, len: usize },
}

/// Who has the parameter shard.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) enum Borrower {
    Fetcher,
    Step,
}

impl<B> ParamShard<B> {
    /// The shard, unless it is lent.
    pub fn here(&self) -> Result<&B> {
        match self {
            Self::Here(shard) => Ok(shard),
            Self::Lent { to, .. } => Err(lent(*to)),
        }
    }

    /// The shard to write, unless it is lent.
    pub fn here_mut(&mut self) -> Result<&mut B> {
        match self {
            Self::Here(shard) => Ok(shard),
            Self::Lent { to, .. } => Err(lent(*to)),
        }
    }

    /// Whether `borrower` has the shard.
    pub fn lent_to(&self, borrower: Borrower) -> bool {
        matches!(self, Self::Lent { to, .. } if *to == borrower)
    }

    /// Elements of the shard, here or lent.
    pub fn len<T: Element, C: Communicator, M: ShardMemory<T, C, Buffer = B>>(&self) -> usize {
        match self {
            Self::Here(shard) => M::buffer_len(shard),
            Self::Lent { len, .. } => *len,
        }
    }

    /// Lends the shard to `to`.
    pub fn lend<T: Element, C: Communicator, M: ShardMemory<T, C, Buffer = B>>(
        &mut self,
        to: Borrower,
    ) -> Result<B> {
        let len = match self {
            Self::Here(shard) => M::buffer_len(shard),
            Self::Lent { to: holder, .. } => return Err(lent(*holder)),
        };
        match std::mem::replace(self, Self::Lent { to, len }) {
            Self::Here(shard) => Ok(shard),
            Self::Lent { to: holder, .. } => Err(lent(holder)),
        }
    }

    /// Takes the shard back (or puts a new one here).
    pub fn put(&mut self, shard: B) {
        *self = Self::Here(shard);
    }
}

fn lent(to: Borrower) -> crate::Error {
    crate::Error::State(format!(
        "internal: the parameter shard is lent to {}",
        match to {
            Borrower::Fetcher => "stage 3's fetcher",
            Borrower::Step => "the step running beside backward",
        }
    ))
}

/// The full gradient buffer of the current accumulation window: allocated
/// (zeroed) on first use, or zeroed when it still holds an earlier window's
/// gradients (`in_window` false).
pub(super) fn window_buffer<'a, T: Element, C: Communicator, M: ShardMemory<T, C>>(
    memory: &mut M,
    slot: &'a mut Option<M::Buffer>,
    numel: usize,
    in_window: bool,
) -> Result<&'a mut M::Buffer> {
    if slot.is_none() {
        return Ok(slot.insert(memory.alloc_zeroed(numel)?));
    }
    let full = slot.as_mut().expect("checked above");
    if !in_window {
        let numel = M::buffer_len(full);
        memory.zero(full, 0..numel)?;
    }
    Ok(full)
}

/// The piece of run `run` that a gradient of the parameter's elements
/// `range` covers, placed at the run's position less `base` (a bucket's
/// start, for a bucket buffer); `None` if they do not overlap.
pub(super) fn piece_of<G: Copy>(
    run: &Run,
    range: &Range<usize>,
    grad: G,
    base: usize,
) -> Option<GradPiece<G>> {
    let start = run.param_range.start.max(range.start);
    let end = run.param_range.end.min(range.end);
    (start < end).then(|| GradPiece {
        at: run.pos - base + (start - run.param_range.start),
        grad,
        range: start - range.start..end - range.start,
    })
}
