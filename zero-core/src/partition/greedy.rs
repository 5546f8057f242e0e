//! The greedy partitioner: PyTorch `ZeroRedundancyOptimizer` semantics.

use super::layout::{self, round_up};
use super::plan::{ParamInfo, PartitionKind, PartitionPlan, Partitioner, DEFAULT_ALIGNMENT};
use crate::{Error, Result};

/// Assigns whole parameters to ranks: sorted by size, largest first, each to
/// the rank with the smallest running total.
///
/// This is PyTorch `ZeroRedundancyOptimizer`'s rule, exactly: the sort is
/// stable (equal sizes keep their input order), ties between ranks go to the
/// lowest rank, and frozen parameters are placed and counted in the totals
/// like any other, although they own no elements and get no flat offset.
///
/// The flat layout gives rank `r` the segment `r * shard_numel ..
/// (r + 1) * shard_numel`, holding its trainable parameters contiguously in
/// input order; `shard_numel` is the largest segment rounded up to
/// [`alignment`](Greedy::alignment), so reduce-scatter and all-gather stay
/// exact at the cost of padding the smaller segments.
///
/// All trainable parameters must share one dtype (the layout counts
/// elements); an engine with mixed dtypes partitions each dtype separately.
///
/// ```
/// use zero_core::{DType, Greedy, ParamInfo, Partitioner};
/// // Shapes (n, 1) for n in [9, 7, 5, 3], four times: 24 elements per rank.
/// let params: Vec<_> = (0..16)
///     .map(|i| ParamInfo::new(format!("p{i}"), [[9, 7, 5, 3][i % 4], 1], DType::F32))
///     .collect();
/// let plan = Greedy::new(1).partition(&params, 4, usize::MAX)?;
/// assert!((0..4).all(|rank| plan.owned_numel(rank) == 24));
/// # Ok::<(), zero_core::Error>(())
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Greedy {
    /// Alignment of `shard_numel`, in elements (at least 1). The default,
    /// [`DEFAULT_ALIGNMENT`], is 128 bytes of f32.
    pub alignment: usize,
}

impl Default for Greedy {
    fn default() -> Self {
        Self {
            alignment: DEFAULT_ALIGNMENT,
        }
    }
}

impl Greedy {
    /// A greedy partitioner with `alignment` elements (at least 1; 0 is
    /// rejected by [`partition`](Partitioner::partition)).
    pub fn new(alignment: usize) -> Self {
        Self { alignment }
    }

    /// Sets the alignment, in elements.
    pub fn with_alignment(mut self, alignment: usize) -> Self {
        self.alignment = alignment;
        self
    }

    /// The rank each parameter is placed on, frozen ones included, without
    /// building a plan. Fails only if `world_size` is 0.
    pub fn assign(params: &[ParamInfo], world_size: usize) -> Result<Vec<usize>> {
        if world_size == 0 {
            return Err(Error::Config(
                "Greedy: world_size is 0; a group needs at least one rank".into(),
            ));
        }
        let numels: Vec<usize> = params
            .iter()
            .map(|p| p.shape.iter().fold(1usize, |a, &d| a.saturating_mul(d)))
            .collect();
        Ok(assign_ranks(&numels, world_size))
    }
}

/// The greedy rule on element counts.
fn assign_ranks(numels: &[usize], world_size: usize) -> Vec<usize> {
    let mut order: Vec<usize> = (0..numels.len()).collect();
    // `sort_by` is stable: equal sizes keep their input order, as Python's
    // `sorted(..., reverse=True)` does.
    order.sort_by(|&a, &b| numels[b].cmp(&numels[a]));
    let mut totals = vec![0usize; world_size];
    let mut ranks = vec![0usize; numels.len()];
    for i in order {
        // `min_by_key` returns the first minimum: ties go to the lowest rank.
        let rank = (0..world_size).min_by_key(|&r| totals[r]).unwrap_or(0);
        totals[rank] = totals[rank].saturating_add(numels[i]);
        ranks[i] = rank;
    }
    ranks
}

impl Partitioner for Greedy {
    fn partition(
        &self,
        params: &[ParamInfo],
        world_size: usize,
        bucket_bytes: usize,
    ) -> Result<PartitionPlan> {
        let (numels, dtype) =
            layout::validate("Greedy", params, world_size, bucket_bytes, self.alignment)?;
        let ranks = assign_ranks(&numels, world_size);

        // Segment sizes first, then offsets: rank r's parameters sit in input
        // order from r * shard_numel.
        let mut segment = vec![0usize; world_size];
        for ((p, &numel), &rank) in params.iter().zip(&numels).zip(&ranks) {
            if p.trainable {
                segment[rank] = segment[rank].checked_add(numel).ok_or_else(|| {
                    Error::Config(format!(
                        "Greedy: rank {rank}'s parameters hold more elements than fit in usize"
                    ))
                })?;
            }
        }
        let largest = segment.iter().copied().max().unwrap_or(0);
        let shard_numel = round_up("Greedy", largest, self.alignment)?;
        if shard_numel.checked_mul(world_size).is_none() {
            return Err(Error::Config(format!(
                "Greedy: a flat buffer of {world_size} x {shard_numel} elements overflows usize"
            )));
        }

        let mut next: Vec<usize> = (0..world_size).map(|r| r * shard_numel).collect();
        let flat_offsets = params
            .iter()
            .zip(&numels)
            .zip(&ranks)
            .map(|((p, &numel), &rank)| {
                p.trainable.then(|| {
                    let offset = next[rank];
                    next[rank] += numel;
                    offset
                })
            })
            .collect();

        Ok(layout::finish(
            PartitionKind::Greedy,
            params,
            &numels,
            world_size,
            shard_numel,
            flat_offsets,
            dtype,
            bucket_bytes,
            self.alignment,
        ))
    }
}
