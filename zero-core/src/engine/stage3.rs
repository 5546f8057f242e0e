//! Stage 3: parameters that live only as this rank's shard.
//!
//! Until [`Engine::shard_parameters`] is called, a stage-3 engine is a
//! stage-2 engine (the replica is whole and updated every step). The call
//! marks the parameters the framework can gather on use (its ZeRO-aware
//! layers) and that exceed [`EngineConfig::persist_numel`] as *sharded*:
//! from then on the engine never reads or writes their replica (the
//! framework may free it), its shard is their only copy, and the returned
//! [`Fetcher`] all-gathers them for each use. The gradient path stays
//! stage 2's: a sharded parameter's gradient is handed over during
//! backward and reduce-scattered into the gradient shard. After the step,
//! only the buckets of replicated parameters are all-gathered.
//!
//! Before `shard_parameters`, the first `begin_backward` partitions in
//! gradient order as at stage 2, with one difference: parameters above the
//! persistence threshold come first and the small ones after a break, so
//! that buckets hold either kind and the post-step all-gather skips the
//! sharded ones entirely.
//!
//! [`Engine::shard_from_start`] shards before the first step instead: the
//! parameters are laid out in an order the framework gives (its layers'
//! construction order, reversed: about the order backward makes their
//! gradients), and the owned pieces are read from a source that computes
//! them (a seeded initializer, a memory-mapped file), so that no rank ever
//! holds a whole sharded parameter.
//!
//! [`EngineConfig::persist_numel`]: super::EngineConfig::persist_numel

use super::fetch::{Fetcher, Span, Unit, UnitBucket};
use super::sharding::Sharding;
use super::ShardMemory;
use crate::comm::Communicator;
use crate::partition::ParamInfo;
use crate::{Element, Error, Result};
use std::ops::Range;
use std::sync::Arc;

/// Where [`Engine::stream_params`](crate::Engine::stream_params) puts each
/// piece: (parameter, its range of the parameter's elements, the values).
pub type ParamPieceSink<'a, T> = dyn FnMut(usize, Range<usize>, &[T]) -> Result<()> + 'a;

/// The fetcher of an engine over memory `M`.
pub type FetcherOf<T, C, M> = Fetcher<T, <M as ShardMemory<T, C>>::Gathers>;

/// Stage 3 once sharded: which parameters live only as shards, and their
/// gathers.
pub(super) struct ShardedParams<T, C: Communicator, M: ShardMemory<T, C>>
where
    T: Element,
{
    /// Per parameter, whether it lives only as shards.
    pub sharded: Vec<bool>,
    pub fetcher: Arc<FetcherOf<T, C, M>>,
}

/// A run of buckets (first, last) and the sharded parameters in it (index,
/// sequence position of the first element).
type BucketRun = (usize, usize, Vec<(usize, usize)>);

/// The gather units of the sharded parameters (`mask`) of `sharding`:
/// runs of buckets, one per group of sharded parameters that share
/// buckets, or pieces of those buckets when a group is above `piece_len`
/// elements; and where each parameter lies in the units' buffers.
pub(super) fn gather_units(
    sharding: &Sharding,
    params: &[ParamInfo],
    mask: &[bool],
    piece_len: usize,
    world: usize,
) -> Result<(Vec<Unit>, Vec<Vec<Span>>)> {
    let groups = sharding.sharded_groups(params, mask)?;
    let layout = &sharding.layout;
    let mut units = Vec::with_capacity(groups.len());
    let mut place = vec![Vec::new(); params.len()];
    for (lo, hi, members) in groups {
        let base = layout.bucket_range(lo).start;
        let len = layout.bucket_range(hi).end - base;
        if piece_len == 0 || len <= piece_len {
            let buckets: Vec<UnitBucket> = (lo..=hi)
                .map(|k| {
                    let at = layout.bucket_range(k);
                    UnitBucket {
                        shard: layout.buckets[k].clone(),
                        at: at.start - base..at.end - base,
                    }
                })
                .collect();
            for (p, start) in members {
                let numel = params[p].numel();
                place[p].push(Span {
                    unit: units.len(),
                    at: start - base..start - base + numel,
                    values: 0..numel,
                });
            }
            units.push(Unit { buckets, len });
        } else {
            for k in lo..=hi {
                let members = (params, &members[..]);
                sharding.piece_units((k, world), piece_len, members, &mut units, &mut place)?;
            }
        }
    }
    Ok((units, place))
}

impl Sharding {
    /// The sharded parameters (`mask`) grouped by the buckets they share,
    /// in bucket order: (first bucket, last bucket, [(parameter, sequence
    /// position of its first element)]).
    fn sharded_groups(&self, params: &[ParamInfo], mask: &[bool]) -> Result<Vec<BucketRun>> {
        // Each sharded parameter's bucket span and sequence position.
        let mut spans = Vec::new();
        for (p, &sharded) in mask.iter().enumerate() {
            if !sharded {
                continue;
            }
            let runs = &self.runs_of_param[p];
            let Some(&first) = runs.first() else {
                continue;
            };
            let run = &self.layout.runs[first];
            let start = run.pos - run.param_range.start;
            let contiguous = runs.iter().all(|&r| {
                let run = &self.layout.runs[r];
                run.pos - run.param_range.start == start
            });
            if !contiguous {
                return Err(Error::State(format!(
                    "stage 3 cannot shard {:?}: the partition does not lay it out in one stretch. Shard after a step whose gradients were handed over during backward (begin_backward lays the parameters out in gradient order), as zero_candle's backward_step does",
                    params[p].name
                )));
            }
            let buckets = runs.iter().map(|&r| self.bucket_of_run[r]);
            let lo = buckets.clone().min().unwrap_or(0);
            let hi = buckets.max().unwrap_or(0);
            spans.push((lo, hi, p, start));
        }
        spans.sort_unstable();
        let mut groups: Vec<BucketRun> = Vec::new();
        for (lo, hi, p, start) in spans {
            match groups.last_mut() {
                Some(group) if lo <= group.1 => {
                    group.1 = group.1.max(hi);
                    group.2.push((p, start));
                }
                _ => groups.push((lo, hi, vec![(p, start)])),
            }
        }
        Ok(groups)
    }

    /// Gathers bucket `k` in pieces of about `piece_len` elements: piece
    /// `j` all-gathers slice `j` of every rank's chunk, so its buffer holds
    /// one stretch of the sequence per rank. `members` are the sharded
    /// parameters around (index, sequence position of their first element).
    fn piece_units(
        &self,
        (k, world): (usize, usize),
        piece_len: usize,
        (params, members): (&[ParamInfo], &[(usize, usize)]),
        units: &mut Vec<Unit>,
        place: &mut [Vec<Span>],
    ) -> Result<()> {
        let sequence = self.layout.bucket_range(k);
        let chunk = self.layout.buckets[k].clone();
        if sequence.len() != world * chunk.len() {
            return Err(Error::State(format!(
                "internal: bucket {k} spans {} elements but this rank's chunk is {} of {world}",
                sequence.len(),
                chunk.len()
            )));
        }
        let slice_len = (piece_len / world).max(1);
        let mut offset = 0;
        while offset < chunk.len() {
            let slice = slice_len.min(chunk.len() - offset);
            let unit = units.len();
            for rank in 0..world {
                let from = sequence.start + rank * chunk.len() + offset;
                for &(p, start) in members {
                    let lo = from.max(start);
                    let hi = (from + slice).min(start + params[p].numel());
                    if lo < hi {
                        let at = rank * slice + lo - from;
                        place[p].push(Span {
                            unit,
                            at: at..at + hi - lo,
                            values: lo - start..hi - start,
                        });
                    }
                }
            }
            units.push(Unit {
                buckets: vec![UnitBucket {
                    shard: chunk.start + offset..chunk.start + offset + slice,
                    at: 0..world * slice,
                }],
                len: world * slice,
            });
            offset += slice;
        }
        Ok(())
    }
}
