//! The partition plan and the types around it: parameters as a partitioner
//! sees them, the pieces each rank owns, and the [`Partitioner`] trait.

use crate::{DType, Result};
use serde::{Deserialize, Serialize};
use std::ops::Range;

/// The default alignment of [`Flat`](super::Flat) and
/// [`Greedy`](super::Greedy), in elements: 32 elements are 128 bytes of f32
/// (64 of bf16/f16), enough for any SIMD width and for NCCL's preferred
/// buffer alignment at f32.
pub const DEFAULT_ALIGNMENT: usize = 32;

/// A parameter as the partitioner sees it.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ParamInfo {
    /// Unique name; the order of a parameter list is the order of names.
    pub name: String,
    /// Shape; the parameter has `shape.iter().product()` elements.
    pub shape: Vec<usize>,
    /// Element type.
    pub dtype: DType,
    /// Whether the optimizer may ever update it. Frozen parameters own no
    /// elements (greedy placement still counts them, as PyTorch does).
    pub trainable: bool,
}

impl ParamInfo {
    /// Creates a trainable parameter.
    pub fn new(name: impl Into<String>, shape: impl Into<Vec<usize>>, dtype: DType) -> Self {
        Self {
            name: name.into(),
            shape: shape.into(),
            dtype,
            trainable: true,
        }
    }

    /// Sets trainability.
    pub fn with_trainable(mut self, trainable: bool) -> Self {
        self.trainable = trainable;
        self
    }

    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

/// A contiguous piece of one parameter owned by one rank.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShardPiece {
    /// Index of the parameter in [`PartitionPlan::params`].
    pub param: usize,
    /// Element range within the parameter (flattened, row-major).
    pub param_range: Range<usize>,
    /// Element range within the global flat buffer.
    pub flat_range: Range<usize>,
}

impl ShardPiece {
    /// Number of elements.
    pub fn len(&self) -> usize {
        self.param_range.len()
    }

    /// Whether the piece is empty (never produced by the partitioners).
    pub fn is_empty(&self) -> bool {
        self.param_range.is_empty()
    }
}

/// Which partitioner made a plan.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PartitionKind {
    /// [`Flat`](super::Flat).
    Flat,
    /// [`Greedy`](super::Greedy).
    Greedy,
    /// [`Interleaved`](super::Interleaved).
    Interleaved,
}

/// The result of partitioning: ownership, flat layout and buckets.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PartitionPlan {
    /// The partitioner that made the plan.
    pub kind: PartitionKind,
    /// Number of ranks.
    pub world_size: usize,
    /// The parameters, in the order given.
    pub params: Vec<ParamInfo>,
    /// Elements per rank segment (including padding); the flat buffer has
    /// `world_size * shard_numel` elements.
    pub shard_numel: usize,
    /// Per rank, its pieces sorted by flat offset.
    pub shards: Vec<Vec<ShardPiece>>,
    /// Per parameter, its offset in the flat buffer (`None` if frozen). A
    /// parameter occupies `offset .. offset + numel` contiguously. For
    /// [`Interleaved`](super::Interleaved) plans, the offset is in
    /// bucket-major order instead (see [`Interleaved`](super::Interleaved)).
    pub flat_offsets: Vec<Option<usize>>,
    /// Buckets as ranges of shard offsets, covering `0..shard_numel` in order.
    pub buckets: Vec<Range<usize>>,
}

impl PartitionPlan {
    /// Total elements of the flat buffer, padding included.
    pub fn flat_numel(&self) -> usize {
        self.world_size * self.shard_numel
    }

    /// Rank `rank`'s range in the flat buffer.
    pub fn shard_range(&self, rank: usize) -> Range<usize> {
        rank * self.shard_numel..(rank + 1) * self.shard_numel
    }

    /// Elements of trainable parameters rank `rank` owns (no padding).
    pub fn owned_numel(&self, rank: usize) -> usize {
        self.shards[rank].iter().map(ShardPiece::len).sum()
    }

    /// The pieces of `rank` that intersect bucket `bucket`, clipped to it.
    pub fn bucket_pieces(&self, rank: usize, bucket: usize) -> Vec<ShardPiece> {
        let shard = self.shard_range(rank);
        let b = &self.buckets[bucket];
        let lo = shard.start + b.start;
        let hi = shard.start + b.end;
        self.shards[rank]
            .iter()
            .filter_map(|p| {
                let start = p.flat_range.start.max(lo);
                let end = p.flat_range.end.min(hi);
                (start < end).then(|| {
                    let skip = start - p.flat_range.start;
                    ShardPiece {
                        param: p.param,
                        param_range: p.param_range.start + skip
                            ..p.param_range.start + skip + (end - start),
                        flat_range: start..end,
                    }
                })
            })
            .collect()
    }
}

/// Decides which rank owns which parameter elements.
pub trait Partitioner: Send + Sync {
    /// Partitions `params` over `world_size` ranks, with buckets of about
    /// `bucket_bytes` (counted per rank segment, in each parameter's dtype).
    fn partition(
        &self,
        params: &[ParamInfo],
        world_size: usize,
        bucket_bytes: usize,
    ) -> Result<PartitionPlan>;
}
