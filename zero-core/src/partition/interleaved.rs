//! The interleaved partitioner: buckets contiguous in the parameter order,
//! each split evenly over the ranks (for overlapping reductions with backward).

use super::layout::{self, round_up};
use super::plan::{
    ParamInfo, PartitionKind, PartitionPlan, Partitioner, ShardPiece, DEFAULT_ALIGNMENT,
};
use crate::{Error, Result};

/// Concatenates the trainable parameters in the order given, cuts that
/// sequence into buckets of `world_size x` about `bucket_bytes`, and splits
/// every bucket into `world_size` equal chunks: rank `r` owns chunk `r` of
/// each bucket.
///
/// With [`Flat`](super::Flat), bucket `k` holds the `k`-th chunk of every
/// rank's contiguous range, so it spans the whole model and is complete only
/// when nearly every gradient is. Here bucket `k` is one contiguous stretch
/// of the order: give the parameters in the order their gradients become
/// ready, and each bucket can be reduced as soon as backward has passed it,
/// while backward goes on. The bucket-major position of an element (see
/// [`Layout`](crate::engine::Layout)) is its position in the sequence.
///
/// Every chunk is a multiple of [`alignment`](Interleaved::alignment)
/// elements. The elements of each stretch between breaks (the whole
/// sequence without breaks) are spread evenly over as few buckets as hold
/// them, so a bucket may be a little smaller than `bucket_bytes` and the
/// padding is under one aligned chunk per rank and bucket. [`PartitionPlan::flat_offsets`]
/// holds each parameter's sequence position (it is contiguous there, not in
/// the rank-major buffer).
///
/// ```
/// use zero_core::{DType, Interleaved, ParamInfo, Partitioner};
/// let params = vec![
///     ParamInfo::new("late", [64], DType::F32),
///     ParamInfo::new("early", [64], DType::F32),
/// ];
/// // Buckets of 16 elements per rank: bucket 0 is `late`, bucket 1 `early`.
/// let plan = Interleaved::new(8).partition(&params, 4, 16 * 4)?;
/// assert_eq!(plan.buckets, vec![0..16, 16..32]);
/// assert!(plan.bucket_pieces(3, 0).iter().all(|p| p.param == 0));
/// # Ok::<(), zero_core::Error>(())
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Interleaved {
    /// Alignment of each rank's chunk of a bucket, in elements (at least 1).
    pub alignment: usize,
}

impl Default for Interleaved {
    fn default() -> Self {
        Self {
            alignment: DEFAULT_ALIGNMENT,
        }
    }
}

impl Interleaved {
    /// An interleaved partitioner with `alignment` elements.
    pub fn new(alignment: usize) -> Self {
        Self { alignment }
    }
}

impl Partitioner for Interleaved {
    fn partition(
        &self,
        params: &[ParamInfo],
        world_size: usize,
        bucket_bytes: usize,
    ) -> Result<PartitionPlan> {
        self.partition_with_breaks(params, world_size, bucket_bytes, &[])
    }
}

impl Interleaved {
    /// As [`Interleaved::partition_with_breaks`] over the parameters taken
    /// in `order` (a permutation of their indices; `breaks` are positions
    /// in `order`); the plan names the parameters by their own indices.
    pub fn partition_in_order(
        &self,
        params: &[ParamInfo],
        order: &[usize],
        world_size: usize,
        bucket_bytes: usize,
        breaks: &[usize],
    ) -> Result<PartitionPlan> {
        let permuted: Vec<ParamInfo> = order.iter().map(|&p| params[p].clone()).collect();
        let mut plan = self.partition_with_breaks(&permuted, world_size, bucket_bytes, breaks)?;
        for shard in &mut plan.shards {
            for piece in shard.iter_mut() {
                piece.param = order[piece.param];
            }
        }
        let mut offsets = vec![None; params.len()];
        for (j, offset) in plan.flat_offsets.iter().enumerate() {
            offsets[order[j]] = *offset;
        }
        plan.flat_offsets = offsets;
        plan.params = params.to_vec();
        Ok(plan)
    }

    /// As [`Partitioner::partition`], and every parameter index in `breaks`
    /// starts a new bucket (the previous one is padded), so that the
    /// parameters before and after it never share one.
    pub fn partition_with_breaks(
        &self,
        params: &[ParamInfo],
        world_size: usize,
        bucket_bytes: usize,
        breaks: &[usize],
    ) -> Result<PartitionPlan> {
        let (numels, dtype) = layout::validate(
            "Interleaved",
            params,
            world_size,
            bucket_bytes,
            self.alignment,
        )?;
        // Elements per rank of a full bucket, as the other partitioners count
        // bucket sizes (per rank segment).
        let elem_bytes = dtype.map_or(1, |d| d.size_in_bytes());
        let chunk = (bucket_bytes / elem_bytes).max(1);
        let chunk = (chunk / self.alignment * self.alignment).max(self.alignment);
        let span = chunk.checked_mul(world_size).ok_or_else(|| {
            Error::Config(format!(
                "Interleaved: buckets of {world_size} x {chunk} elements overflow usize"
            ))
        })?;

        // Each stretch between breaks is cut into as few buckets as hold it,
        // and its elements spread evenly over them: padding stays below one
        // aligned chunk per rank and bucket, not a whole bucket per break.
        let overflow = || {
            Error::Config(
                "Interleaved: the trainable parameters hold more elements than fit in usize".into(),
            )
        };
        let mut in_segment = Vec::with_capacity(params.len());
        let mut segments = vec![0usize];
        for (i, (p, &numel)) in params.iter().zip(&numels).enumerate() {
            if breaks.contains(&i) && segments.last() != Some(&0) {
                segments.push(0);
            }
            let segment = segments.len() - 1;
            if p.trainable {
                in_segment.push(Some((segment, segments[segment])));
                segments[segment] = segments[segment].checked_add(numel).ok_or_else(overflow)?;
            } else {
                in_segment.push(None);
            }
        }
        // Per bucket: where it starts in the sequence, and its chunk.
        let mut bucket_starts = Vec::new();
        let mut chunks = Vec::new();
        let mut segment_starts = Vec::with_capacity(segments.len());
        let mut total = 0usize;
        for &length in &segments {
            segment_starts.push(total);
            if length == 0 {
                continue;
            }
            let count = length.div_ceil(span);
            let even = round_up(
                "Interleaved",
                length.div_ceil(count * world_size),
                self.alignment,
            )?;
            for _ in 0..count {
                bucket_starts.push(total);
                chunks.push(even);
                total = total.checked_add(even * world_size).ok_or_else(overflow)?;
            }
        }
        let sequence: Vec<Option<usize>> = in_segment
            .iter()
            .map(|at| at.map(|(segment, offset)| segment_starts[segment] + offset))
            .collect();
        let mut chunk_starts = Vec::with_capacity(chunks.len());
        let mut shard_numel = 0usize;
        for &c in &chunks {
            chunk_starts.push(shard_numel);
            shard_numel += c;
        }
        let buckets = chunk_starts
            .iter()
            .zip(&chunks)
            .map(|(&at, &c)| at..at + c)
            .collect();

        let mut shards: Vec<Vec<ShardPiece>> = vec![Vec::new(); world_size];
        for (param, (start, &numel)) in sequence.iter().zip(&numels).enumerate() {
            let Some(start) = *start else { continue };
            let end = start + numel;
            let mut at = start;
            while at < end {
                let k = bucket_starts.partition_point(|&b| b <= at) - 1;
                let c = chunks[k];
                let offset = at - bucket_starts[k];
                let rank = offset / c;
                let piece_end = end.min(bucket_starts[k] + (rank + 1) * c);
                let flat = rank * shard_numel + chunk_starts[k] + offset % c;
                shards[rank].push(ShardPiece {
                    param,
                    param_range: at - start..piece_end - start,
                    flat_range: flat..flat + (piece_end - at),
                });
                at = piece_end;
            }
        }
        for shard in &mut shards {
            shard.sort_by_key(|p| p.flat_range.start);
        }
        Ok(PartitionPlan {
            kind: PartitionKind::Interleaved,
            world_size,
            params: params.to_vec(),
            shard_numel,
            shards,
            flat_offsets: sequence,
            buckets,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::Layout;
    use crate::DType;

    fn params(numels: &[usize]) -> Vec<ParamInfo> {
        numels
            .iter()
            .enumerate()
            .map(|(i, &n)| ParamInfo::new(format!("p{i}"), [n], DType::F32))
            .collect()
    }

    /// Every element lands exactly once, and its bucket-major position is
    /// its position in the sequence: what lets a bucket be reduced as soon
    /// as backward has passed it.
    #[test]
    fn bucket_major_order_is_the_given_order() {
        for world_size in 1..=5 {
            for bucket in [4usize, 12, 40, 1 << 20] {
                let ps = params(&[7, 1, 33, 16, 5, 64]);
                let plan = Interleaved::new(4)
                    .partition(&ps, world_size, bucket * 4)
                    .unwrap();
                let layout = Layout::new(&plan);
                let mut expected = 0;
                let mut seen = 0;
                for run in &layout.runs {
                    let start = plan.flat_offsets[run.param].unwrap();
                    assert_eq!(run.pos, start + run.param_range.start);
                    seen += run.param_range.len();
                    expected = expected.max(run.pos + run.param_range.len());
                }
                let total: usize = ps.iter().map(ParamInfo::numel).sum();
                assert_eq!(seen, total);
                assert_eq!(expected, total);
                assert!(plan.flat_numel() >= total);
                for k in 0..plan.buckets.len() {
                    assert_eq!(plan.buckets[k].len() % 4, 0);
                }
            }
        }
    }

    #[test]
    fn a_break_starts_a_new_bucket() {
        let ps = params(&[6, 6, 6]);
        let plan = Interleaved::new(2)
            .partition_with_breaks(&ps, 2, 4 * 4, &[2])
            .unwrap();
        // Buckets of 8 elements: p0 and p1 share buckets 0-1, p2 starts
        // bucket 2 after padding.
        assert_eq!(plan.flat_offsets, vec![Some(0), Some(6), Some(16)]);
        let layout = Layout::new(&plan);
        for k in 0..plan.buckets.len() {
            let has = |p| layout.runs_of(k).iter().any(|r| r.param == p);
            assert!(!(has(2) && (has(0) || has(1))), "bucket {k}");
        }
    }

    #[test]
    fn each_stretch_is_spread_evenly_over_as_few_buckets_as_hold_it() {
        // Buckets of at most 2 x 32 elements. 100 elements need two: 2 x 25
        // each, no padding (a fixed chunk would pad 28 in the second). The
        // 10 after the break take one bucket of 2 x 5.
        let ps = params(&[60, 40, 10]);
        let plan = Interleaved::new(1)
            .partition_with_breaks(&ps, 2, 32 * 4, &[2])
            .unwrap();
        assert_eq!(plan.buckets, vec![0..25, 25..50, 50..55]);
        assert_eq!(plan.shard_numel, 55);
        assert_eq!(plan.flat_offsets, vec![Some(0), Some(60), Some(100)]);
        let layout = Layout::new(&plan);
        assert_eq!(layout.bucket_range(2), 100..110);
        // Alignment pads each chunk, never more.
        let plan = Interleaved::new(8)
            .partition_with_breaks(&ps, 2, 32 * 4, &[2])
            .unwrap();
        assert_eq!(plan.buckets, vec![0..32, 32..64, 64..72]);
    }

    #[test]
    fn frozen_parameters_own_nothing() {
        let mut ps = params(&[8, 8, 8]);
        ps[1].trainable = false;
        let plan = Interleaved::new(1).partition(&ps, 2, 4 * 4).unwrap();
        assert!(plan.shards.iter().flatten().all(|p| p.param != 1));
        assert_eq!(plan.flat_offsets[1], None);
        assert_eq!(plan.flat_offsets[2], Some(8));
    }

    #[test]
    fn nothing_trainable_gives_no_buckets() {
        let mut ps = params(&[8]);
        ps[0].trainable = false;
        let plan = Interleaved::default().partition(&ps, 3, 1024).unwrap();
        assert_eq!(plan.shard_numel, 0);
        assert!(plan.buckets.is_empty());
    }
}
