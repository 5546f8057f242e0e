//! What the bucket-by-bucket updates share: the owned pieces grouped by
//! bucket, one bucket's step, and its all-gather into the replica.

use crate::comm::Communicator;
use crate::engine::sharding::Sharding;
use crate::engine::{Engine, Layout, ParamCopy, ShardMemory, ShardStep, StepPiece};
use crate::optim::FunctionalOptimizer;
use crate::{DType, Element, Error, Result};
use std::ops::Range;

/// A bucket-by-bucket update's view of the shard: per bucket, its range
/// of the owned pieces, and, without a shard copy (a lean shard), the
/// buffer each bucket's gradients are copied into beside its values.
pub(super) struct Buckets<'s, B> {
    pub groups: Vec<Range<usize>>,
    pub grad_chunk: Option<B>,
    /// Which parameters step.
    pub stepping: &'s [bool],
}

impl<'s, B> Buckets<'s, B> {
    /// The buckets of `engine`'s plan (every owned piece within one, as
    /// the step's path was decided on); a lean shard's copy dropped.
    pub fn new<T: Element, C: Communicator, M: ShardMemory<T, C, Buffer = B>>(
        engine: &mut Engine<T, C, M>,
        stepping: &'s [bool],
    ) -> Result<Self> {
        let groups = engine
            .sharding
            .pieces_by_bucket()
            .ok_or_else(|| {
                Error::State("internal: a piece straddles buckets on a bucketed update".into())
            })?
            .to_vec();
        if engine.buffers.grad_shard.is_none() {
            return Err(no_grad_shard());
        }
        // Without a shard copy (`lean_shard`), each bucket's owned pieces
        // are read from the replica into a staging buffer and stepped
        // there, with their gradients copied beside them.
        let mut grad_chunk = None;
        if engine.lean_shard() {
            let empty = engine.memory.alloc_zeroed(0)?;
            engine.buffers.param_shard.put(empty);
            grad_chunk = Some(
                engine
                    .memory
                    .alloc_zeroed(longest_chunk(&engine.sharding))?,
            );
        }
        Ok(Self {
            groups,
            grad_chunk,
            stepping,
        })
    }
}

pub(super) fn no_grad_shard() -> Error {
    Error::State("internal: no gradient shard in stage 1 or 2".into())
}

/// Elements of the longest bucket's chunk (one rank's part of it).
pub(super) fn longest_chunk(sharding: &Sharding) -> usize {
    sharding
        .layout
        .buckets
        .iter()
        .map(Range::len)
        .max()
        .unwrap_or(0)
}

/// A buffer for one bucket's chunk (to send) and a pooled one for the
/// whole gathered bucket (to receive; the caller gives it back): what a
/// bucket-by-bucket write-back goes through, which the stream's order lets
/// each bucket reuse at once.
pub(super) fn gather_buffers<T: Element, C: Communicator, M: ShardMemory<T, C>>(
    engine: &mut Engine<T, C, M>,
) -> Result<(M::Buffer, M::Buffer)> {
    let send = engine
        .memory
        .alloc_zeroed(longest_chunk(&engine.sharding))?;
    // Overwritten whole by each gather: no need to zero.
    let (recv, _) = crate::engine::reduce::take_shortest(
        &mut engine.memory,
        &mut engine.buffers.pool,
        engine.sharding.longest_bucket,
    )?;
    Ok((send, recv))
}

/// What stepping one bucket of the shard reads (see [`step_bucket`]).
pub(super) struct BucketStep<'a, B> {
    sharding: &'a Sharding,
    /// The owned pieces to step, at shard offsets.
    pieces: Vec<StepPiece<'a>>,
    pub bucket_active: &'a [bool],
    /// Per bucket, whether the interleaved schedule stepped it already.
    early_stepped: &'a [bool],
    /// The reduced gradient shard.
    grads: &'a B,
}

impl<'a, B> BucketStep<'a, B> {
    /// What stepping reads: the sharding and its pieces (those of `stepping`
    /// parameters active), the active buckets, those the interleaved
    /// schedule stepped, the reduced gradient shard (an error if none).
    pub fn new(
        sharding: &'a Sharding,
        stepping: &[bool],
        bucket_active: &'a [bool],
        early_stepped: &'a [bool],
        grads: Option<&'a B>,
    ) -> Result<Self> {
        Ok(Self {
            sharding,
            pieces: sharding.step_pieces(|p| stepping[p]),
            bucket_active,
            early_stepped,
            grads: grads.ok_or_else(no_grad_shard)?,
        })
    }
}

/// Steps bucket `k` (owned pieces `group`) and leaves its updated chunk in
/// `send`: from the parameter shard, or, without one (`grad_chunk` given,
/// a lean shard), from the replica through `send` itself.
pub(super) fn step_bucket<T, C, M>(
    memory: &mut M,
    optimizer: &mut dyn FunctionalOptimizer<T>,
    params: &mut M::Params<'_>,
    (param_shard, grad_chunk): (&mut M::Buffer, Option<&mut M::Buffer>),
    at: &BucketStep<'_, M::Buffer>,
    (k, group): (usize, Range<usize>),
    send: &mut M::Buffer,
) -> Result<()>
where
    T: Element,
    C: Communicator,
    M: ShardMemory<T, C>,
{
    let shard_range = at.sharding.layout.buckets[k].clone();
    let shard_len = at.sharding.partition.shard_numel;
    if let Some(grad_chunk) = grad_chunk {
        return step_from_replica(
            memory,
            optimizer,
            params,
            (&at.sharding.owned_copies[group.clone()], &at.pieces[group]),
            (shard_range, shard_len),
            (send, grad_chunk, at.grads),
        );
    }
    if at.early_stepped.get(k) != Some(&true) {
        let plan = ShardStep {
            pieces: &at.pieces[group],
            buckets: &at.sharding.layout.buckets,
            bucket_active: at.bucket_active,
            origin: 0,
            shard_len,
        };
        memory.step(optimizer, param_shard, at.grads, plan)?;
    }
    memory.copy_range(send, 0, param_shard, shard_range, false)
}

/// `copies` (at shard offsets) at their places in a buffer that holds the
/// shard from `start` on (one bucket's chunk).
pub(super) fn copies_from(copies: &[ParamCopy], start: usize) -> Vec<ParamCopy> {
    copies
        .iter()
        .map(|c| ParamCopy {
            at: c.at - start,
            ..c.clone()
        })
        .collect()
}

/// What a stepped chunk holds and the dtype it is gathered in.
#[derive(Clone, Copy)]
pub(super) enum Wire {
    /// The chunk's values, gathered rounded to the dtype
    /// ([`ShardMemory::all_gather_as`]).
    As(DType),
    /// The chunk's values already rounded to the 16-bit dtype, packed
    /// (`PackedGathers::all_gather_packed`).
    Packed(DType),
}

/// All-gathers bucket `k` (`active` parameters of `layout`) from this
/// rank's stepped chunk in `send` into `recv`, as `wire` says, and writes
/// it into the replica.
pub(super) fn gather_into_replica<T, C, M>(
    memory: &mut M,
    comm: &C,
    params: &mut M::Params<'_>,
    (send, recv, wire): (&M::Buffer, &mut M::Buffer, Wire),
    (layout, active, k): (&Layout, &[bool], usize),
) -> Result<()>
where
    T: Element,
    C: Communicator,
    M: ShardMemory<T, C>,
{
    let (n, all) = (layout.buckets[k].len(), layout.bucket_range(k).len());
    match wire {
        Wire::As(dtype) => memory.all_gather_as(comm, send, 0..n, recv, 0..all, dtype)?,
        Wire::Packed(dtype) => memory
            .packed_gathers()
            .ok_or_else(|| Error::State("internal: a packed gather on a memory without".into()))?
            .all_gather_packed(comm, send, n, recv, 0..all, dtype)?,
    }
    memory.write_params(params, &bucket_copies(layout, active, k), recv)
}

/// Where bucket `k`'s active parameters lie in the gathered bucket.
pub(super) fn bucket_copies(layout: &Layout, active: &[bool], k: usize) -> Vec<ParamCopy> {
    let start = layout.bucket_range(k).start;
    layout
        .runs_of(k)
        .iter()
        .filter(|run| active[run.param])
        .map(|run| ParamCopy {
            param: run.param,
            param_range: run.param_range.clone(),
            at: run.pos - start,
        })
        .collect()
}

/// Steps the owned pieces of one bucket without a shard copy: reads their
/// values from the replica into `values` and their gradients (shard range
/// `shard_range` of `grads`) into `grad_chunk`, and steps them there.
/// `copies` and `pieces` are the bucket's owned pieces, at shard offsets;
/// `shard_len` is the whole shard's length.
fn step_from_replica<T, C, M>(
    memory: &mut M,
    optimizer: &mut dyn FunctionalOptimizer<T>,
    params: &mut M::Params<'_>,
    (copies, pieces): (&[ParamCopy], &[StepPiece<'_>]),
    (shard_range, shard_len): (Range<usize>, usize),
    (values, grad_chunk, grads): (&mut M::Buffer, &mut M::Buffer, &M::Buffer),
) -> Result<()>
where
    T: Element,
    C: Communicator,
    M: ShardMemory<T, C>,
{
    let start = shard_range.start;
    let copies = copies_from(copies, start);
    memory.read_params(params, &copies, values)?;
    memory.copy_range(grad_chunk, 0, grads, shard_range.clone(), false)?;
    let pieces: Vec<StepPiece<'_>> = pieces
        .iter()
        .map(|p| StepPiece {
            range: p.range.start - start..p.range.end - start,
            ..*p
        })
        .collect();
    let whole = [Range {
        start: 0,
        end: shard_range.len(),
    }];
    let plan = ShardStep {
        pieces: &pieces,
        buckets: &whole,
        bucket_active: &[true],
        origin: start,
        shard_len,
    };
    memory.step(optimizer, values, grad_chunk, plan)
}
