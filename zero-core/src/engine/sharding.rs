//! The partition as the engine uses it: the plan, its bucket-major layout,
//! this rank's owned pieces and their optimizer keys, and the indices the
//! hand-over of gradients looks up.

use super::{Layout, ParamCopy, ParamTable, StepPiece};
use crate::checkpoint::{PieceRecord, ShardRecord};
use crate::optim::ParamKey;
use crate::partition::{ParamInfo, PartitionPlan, ShardPiece};
use std::ops::Range;

/// The partition as this rank's engine uses it: the plan, its bucket-major
/// layout, the pieces this rank steps and their optimizer keys. Derived
/// from one plan, and rebuilt whole when the engine re-partitions (in the
/// order of the first backward's gradients).
pub struct Sharding {
    pub(crate) partition: PartitionPlan,
    pub(crate) layout: Layout,
    /// This rank's index in the plan (0 in stage 0, whose plan has one rank).
    pub(crate) rank: usize,
    pub(crate) owned: Vec<ShardPiece>,
    /// The owned pieces as copies between the replica and the shard.
    pub(crate) owned_copies: Vec<ParamCopy>,
    pub(crate) keys: Vec<ParamKey>,
    /// For each parameter, the indices of its runs in the layout.
    pub(crate) runs_of_param: Vec<Vec<usize>>,
    /// For each run, its bucket.
    pub(crate) bucket_of_run: Vec<usize>,
    /// Elements of the longest bucket (bucket-major).
    pub(crate) longest_bucket: usize,
    /// The parameter order the plan was built for (`None`: names).
    pub(crate) order: Option<Vec<usize>>,
    /// Per bucket, its range of the owned pieces (`pieces_by_bucket`).
    by_bucket: Option<Vec<Range<usize>>>,
}

impl Sharding {
    /// The partition plan (in stage 0 a plan over one rank: every rank
    /// steps everything).
    pub fn plan(&self) -> &PartitionPlan {
        &self.partition
    }

    /// The bucket-major layout of the plan.
    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    /// The pieces this rank steps, with their optimizer keys.
    pub fn owned_pieces(&self) -> impl Iterator<Item = (&ShardPiece, &ParamKey)> {
        self.owned.iter().zip(&self.keys)
    }

    /// The owned pieces that step now, as shard ranges; neighbours that
    /// both step are merged across the alignment padding between them
    /// (zero in every reduced gradient), so a device takes few launches.
    pub(super) fn stepping_ranges(&self, stepping: &[bool]) -> Vec<Range<usize>> {
        let mut ranges: Vec<Range<usize>> = Vec::new();
        let mut previous = false;
        for piece in &self.owned {
            let steps = stepping[piece.param];
            if steps {
                let at = self.shard_offset(piece);
                match ranges.last_mut() {
                    Some(last) if previous => last.end = at + piece.len(),
                    _ => ranges.push(at..at + piece.len()),
                }
            }
            previous = steps;
        }
        ranges
    }

    /// Derives the layout, owned pieces and keys of `partition` for plan
    /// rank `rank`.
    pub fn new(
        partition: PartitionPlan,
        rank: usize,
        params: &ParamTable,
        order: Option<Vec<usize>>,
    ) -> Self {
        let layout = Layout::new(&partition);
        let owned = partition.shards[rank].clone();
        let base = rank * partition.shard_numel;
        let keys = owned
            .iter()
            .map(|p| {
                ParamKey::new(
                    params[p.param].name.clone(),
                    p.param_range.start,
                    params.groups()[p.param],
                )
            })
            .collect();
        let owned_copies = owned
            .iter()
            .map(|piece| ParamCopy {
                param: piece.param,
                param_range: piece.param_range.clone(),
                at: piece.flat_range.start - base,
            })
            .collect();
        let mut runs_of_param = vec![Vec::new(); params.len()];
        for (i, run) in layout.runs.iter().enumerate() {
            runs_of_param[run.param].push(i);
        }
        let mut bucket_of_run = vec![0; layout.runs.len()];
        for (k, runs) in layout.bucket_runs.iter().enumerate() {
            bucket_of_run[runs.clone()].fill(k);
        }
        let longest_bucket = (0..layout.buckets.len())
            .map(|k| layout.bucket_range(k).len())
            .max()
            .unwrap_or(0);
        let by_bucket = group_by_bucket(&layout, &owned, base);
        Self {
            partition,
            layout,
            rank,
            owned,
            owned_copies,
            keys,
            runs_of_param,
            bucket_of_run,
            longest_bucket,
            order,
            by_bucket,
        }
    }

    /// Where this rank's shard starts in the flat plan.
    pub fn base(&self) -> usize {
        self.rank * self.partition.shard_numel
    }

    /// Where an owned piece starts in this rank's shard.
    pub fn shard_offset(&self, piece: &ShardPiece) -> usize {
        piece.flat_range.start - self.base()
    }

    /// The owned pieces with their keys and shard ranges, active where
    /// `active` says (by parameter).
    pub fn step_pieces(&self, active: impl Fn(usize) -> bool) -> Vec<StepPiece<'_>> {
        let base = self.base();
        self.owned
            .iter()
            .zip(&self.keys)
            .map(|(piece, key)| {
                let at = piece.flat_range.start - base;
                StepPiece {
                    key,
                    range: at..at + piece.len(),
                    active: active(piece.param),
                }
            })
            .collect()
    }

    /// Every rank's shard file (named by `shard_file`) and the pieces it
    /// holds, as a checkpoint's manifest records them.
    pub fn shard_records(
        &self,
        params: &[ParamInfo],
        shard_file: impl Fn(usize) -> String,
    ) -> Vec<ShardRecord> {
        self.partition
            .shards
            .iter()
            .enumerate()
            .map(|(p, pieces)| ShardRecord {
                rank: p,
                file: shard_file(p),
                pieces: pieces
                    .iter()
                    .map(|piece| PieceRecord {
                        name: params[piece.param].name.clone(),
                        offset: piece.param_range.start,
                        len: piece.len(),
                    })
                    .collect(),
            })
            .collect()
    }

    /// Per bucket, the gradient pieces a backward pass will hand over
    /// into it, given each parameter's expected hand-overs.
    pub fn arrivals_per_bucket(&self, expected_calls: &[usize]) -> Vec<usize> {
        let mut remaining = vec![0usize; self.layout.buckets.len()];
        for (param, &calls) in expected_calls.iter().enumerate() {
            for &run in &self.runs_of_param[param] {
                remaining[self.bucket_of_run[run]] += calls;
            }
        }
        remaining
    }

    /// Per bucket, its range of the owned pieces; `None` when a piece
    /// straddles buckets (a partition not made in gradient order), which
    /// then cannot be stepped bucket by bucket.
    pub fn pieces_by_bucket(&self) -> Option<&[Range<usize>]> {
        self.by_bucket.as_deref()
    }
}

/// Per bucket of `layout`, its range of the `owned` pieces (this rank's
/// shard starting at `base` of the flat plan); `None` when a piece
/// straddles buckets.
fn group_by_bucket(
    layout: &Layout,
    owned: &[ShardPiece],
    base: usize,
) -> Option<Vec<Range<usize>>> {
    let mut groups = Vec::with_capacity(layout.buckets.len());
    let mut next = 0;
    for bucket in &layout.buckets {
        let first = next;
        while let Some(piece) = owned.get(next) {
            let at = piece.flat_range.start - base;
            if at >= bucket.end {
                break;
            }
            if at + piece.len() > bucket.end {
                return None;
            }
            next += 1;
        }
        groups.push(first..next);
    }
    Some(groups)
}
