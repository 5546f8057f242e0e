//! What both partitioners share: input validation, cutting a flat layout into
//! per-rank pieces, and buckets.

use super::plan::{ParamInfo, PartitionKind, PartitionPlan, ShardPiece};
use crate::{bail_config, DType, Result};
use std::collections::{BTreeMap, BTreeSet};
use std::ops::Range;

/// At most this many parameter names are listed per dtype in an error.
const NAMES_IN_ERROR: usize = 5;

/// Checks the arguments common to every partitioner and returns each
/// parameter's element count and the element size of the trainable
/// parameters (`None` when nothing is trainable).
pub(super) fn validate(
    partitioner: &str,
    params: &[ParamInfo],
    world_size: usize,
    bucket_bytes: usize,
    alignment: usize,
) -> Result<(Vec<usize>, Option<DType>)> {
    if world_size == 0 {
        bail_config!("{partitioner}: world_size is 0; a group needs at least one rank");
    }
    if bucket_bytes == 0 {
        bail_config!(
            "{partitioner}: bucket_bytes is 0; use a positive size (usize::MAX for one bucket)"
        );
    }
    if alignment == 0 {
        bail_config!("{partitioner}: alignment is 0; use at least 1 element");
    }

    let mut seen = BTreeSet::new();
    let mut numels = Vec::with_capacity(params.len());
    for p in params {
        if !seen.insert(p.name.as_str()) {
            bail_config!(
                "{partitioner}: parameter name {:?} appears twice; names must be unique",
                p.name
            );
        }
        let numel = p
            .shape
            .iter()
            .try_fold(1usize, |acc, &d| acc.checked_mul(d))
            .ok_or_else(|| {
                crate::Error::Config(format!(
                    "{partitioner}: parameter {:?} of shape {:?} has more elements than fit in usize",
                    p.name, p.shape
                ))
            })?;
        numels.push(numel);
    }

    // The flat layout counts elements, so every trainable parameter must have
    // the same element size for a byte offset to mean the same thing
    // everywhere. Engines with mixed dtypes partition each dtype separately.
    let mut by_dtype: BTreeMap<DType, Vec<&str>> = BTreeMap::new();
    for p in params.iter().filter(|p| p.trainable) {
        by_dtype.entry(p.dtype).or_default().push(&p.name);
    }
    if by_dtype.len() > 1 {
        let groups: Vec<String> = by_dtype
            .iter()
            .map(|(dtype, names)| {
                let shown: Vec<&str> = names.iter().take(NAMES_IN_ERROR).copied().collect();
                let more = names.len().saturating_sub(NAMES_IN_ERROR);
                if more > 0 {
                    format!("{dtype}: {} and {more} more", shown.join(", "))
                } else {
                    format!("{dtype}: {}", shown.join(", "))
                }
            })
            .collect();
        bail_config!(
            "{partitioner}: trainable parameters have different dtypes ({}); one flat layout \
             holds one dtype, so partition each dtype's parameters separately",
            groups.join("; ")
        );
    }
    let dtype = by_dtype.keys().next().copied();
    Ok((numels, dtype))
}

/// Rounds `n` up to a multiple of `alignment`.
pub(super) fn round_up(partitioner: &str, n: usize, alignment: usize) -> Result<usize> {
    n.div_ceil(alignment).checked_mul(alignment).ok_or_else(|| {
        crate::Error::Config(format!(
            "{partitioner}: {n} elements rounded up to a multiple of {alignment} overflow usize"
        ))
    })
}

/// Builds the plan from a finished flat layout: cuts every placed parameter
/// at rank boundaries into pieces, and lays out the buckets.
#[allow(clippy::too_many_arguments)]
pub(super) fn finish(
    kind: PartitionKind,
    params: &[ParamInfo],
    numels: &[usize],
    world_size: usize,
    shard_numel: usize,
    flat_offsets: Vec<Option<usize>>,
    dtype: Option<DType>,
    bucket_bytes: usize,
    alignment: usize,
) -> PartitionPlan {
    let mut shards: Vec<Vec<ShardPiece>> = vec![Vec::new(); world_size];
    for (param, (offset, &numel)) in flat_offsets.iter().zip(numels).enumerate() {
        let Some(offset) = *offset else { continue };
        let mut start = offset;
        let end = offset + numel;
        while start < end {
            let rank = start / shard_numel;
            let piece_end = end.min((rank + 1) * shard_numel);
            shards[rank].push(ShardPiece {
                param,
                param_range: start - offset..piece_end - offset,
                flat_range: start..piece_end,
            });
            start = piece_end;
        }
    }
    for shard in &mut shards {
        shard.sort_by_key(|p| p.flat_range.start);
    }

    let elem_bytes = dtype.map_or(1, DType::size_in_bytes);
    PartitionPlan {
        kind,
        world_size,
        params: params.to_vec(),
        shard_numel,
        shards,
        flat_offsets,
        buckets: buckets(shard_numel, elem_bytes, bucket_bytes, alignment),
    }
}

/// Cuts `0..shard_numel` into buckets of about `bucket_bytes` each.
///
/// A bucket holds `bucket_bytes / elem_bytes` elements rounded down to a
/// multiple of `alignment`, but at least `alignment` elements, so every
/// bucket but the last starts and ends on an aligned offset. An empty shard
/// has no buckets.
pub(super) fn buckets(
    shard_numel: usize,
    elem_bytes: usize,
    bucket_bytes: usize,
    alignment: usize,
) -> Vec<Range<usize>> {
    let elems = (bucket_bytes / elem_bytes.max(1)).max(1);
    let elems = (elems / alignment * alignment).max(alignment);
    let mut buckets = Vec::with_capacity(shard_numel.div_ceil(elems));
    let mut start = 0;
    while start < shard_numel {
        let end = shard_numel.min(start.saturating_add(elems));
        buckets.push(start..end);
        start = end;
    }
    buckets
}
