//! The bucket-major layout of gradients and gathered parameters.
//!
//! A plan's flat buffer is rank-major (rank `r` owns `r*S .. (r+1)*S`), but a
//! collective needs each bucket contiguous: bucket `k` as `[rank 0's chunk |
//! rank 1's chunk | ...]`. The engine's full gradient buffer and its gather
//! buffers use this bucket-major order, so every reduce-scatter, all-reduce
//! and all-gather works on one contiguous slice with no staging copy. A
//! [`Run`] is a contiguous piece of one parameter at one position of that
//! order.

use crate::partition::PartitionPlan;
use std::ops::Range;

/// A contiguous piece of a parameter at a position of the bucket-major order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Run {
    /// Index of the parameter.
    pub param: usize,
    /// Element range within the parameter.
    pub param_range: Range<usize>,
    /// Start in the bucket-major buffer.
    pub pos: usize,
}

/// Bucket-major positions of every parameter piece of a plan.
#[derive(Clone, Debug)]
pub struct Layout {
    /// Ranks of the plan.
    pub world_size: usize,
    /// Buckets in shard space.
    pub buckets: Vec<Range<usize>>,
    /// All runs, sorted by `pos`.
    pub runs: Vec<Run>,
    /// Per bucket, its range of `runs`.
    pub bucket_runs: Vec<Range<usize>>,
}

impl Layout {
    /// The bucket-major layout of `plan`.
    pub fn new(plan: &PartitionPlan) -> Self {
        let world_size = plan.world_size;
        let mut runs = Vec::new();
        let mut bucket_runs = Vec::with_capacity(plan.buckets.len());
        for (k, bucket) in plan.buckets.iter().enumerate() {
            let first = runs.len();
            for rank in 0..world_size {
                let segment_start = rank * plan.shard_numel + bucket.start;
                for piece in plan.bucket_pieces(rank, k) {
                    runs.push(Run {
                        param: piece.param,
                        param_range: piece.param_range.clone(),
                        pos: world_size * bucket.start
                            + rank * bucket.len()
                            + (piece.flat_range.start - segment_start),
                    });
                }
            }
            bucket_runs.push(first..runs.len());
        }
        Self {
            world_size,
            buckets: plan.buckets.clone(),
            runs,
            bucket_runs,
        }
    }

    /// Bucket `k`'s range in the bucket-major buffer.
    pub fn bucket_range(&self, k: usize) -> Range<usize> {
        let b = &self.buckets[k];
        self.world_size * b.start..self.world_size * b.end
    }

    /// The runs of bucket `k`.
    pub fn runs_of(&self, k: usize) -> &[Run] {
        &self.runs[self.bucket_runs[k].clone()]
    }
}
