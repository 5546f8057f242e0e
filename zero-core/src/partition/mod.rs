//! Partitioners: which rank owns which elements of which parameter.
//!
//! Both partitioners produce a [`PartitionPlan`] over one *flat layout*: every
//! owned parameter has an offset in a flat buffer of `world_size *
//! shard_numel` elements, and rank `r` owns the contiguous range
//! `r * shard_numel .. (r + 1) * shard_numel`. That makes reduce-scatter and
//! all-gather exact for both: [`Flat`] concatenates the trainable parameters
//! in order and cuts the buffer into equal ranges (a parameter may straddle
//! ranks); [`Greedy`] assigns whole parameters and lays each rank's
//! parameters out in its own segment, padded to the largest segment.
//!
//! Buckets are ranges in *shard space* (offsets within every rank's segment):
//! bucket `k` covers `buckets[k]` on every rank, so one reduce-scatter or
//! all-gather of `world_size * buckets[k].len()` elements moves it.

mod flat;
mod greedy;
mod interleaved;
mod layout;
mod plan;

pub use flat::Flat;
pub use greedy::Greedy;
pub use interleaved::Interleaved;
pub use plan::{
    ParamInfo, PartitionKind, PartitionPlan, Partitioner, ShardPiece, DEFAULT_ALIGNMENT,
};
