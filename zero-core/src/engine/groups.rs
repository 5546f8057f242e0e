//! Hybrid sharding ([`EngineConfig::shard_group`]): the world split into
//! groups of consecutive ranks, each holding the whole state sharded over
//! its ranks, and the replicas of each shard across the groups.
//!
//! The engine's communicator is then the group's: the partition, the
//! reductions and gathers of every stage and the step's agreements (the
//! gradient norm, loss scaling's inf check) run within the group unchanged.
//! What differs is here: once a step's gradients are reduced into the
//! shard, each shard is averaged across its replicas (so every group steps
//! alike); what every rank must agree on (the starting model, the trainable
//! mask, a metric, a checkpoint's outcome) runs over the world.
//!
//! [`EngineConfig::shard_group`]: crate::engine::EngineConfig::shard_group

use crate::comm::{Communicator, ReduceOp};
use crate::engine::{EngineConfig, ShardMemory};
use crate::{DType, Element, Error, Result};
use serde::de::DeserializeOwned;
use serde::Serialize;
use std::ops::Range;
use std::path::Path;
use std::sync::Arc;

/// The world and this rank's replicas, beside the group's communicator.
pub(super) struct ShardGroups<C> {
    /// Every rank.
    pub world: Arc<C>,
    /// The ranks holding this rank's shard, one per group (this rank's
    /// position in its group, in every group); shared with the
    /// communication thread, which averages each bucket across them before
    /// stepping it during backward (the interleaved schedule).
    pub replicas: Arc<C>,
}

/// Splits `world` into groups of `config.shard_group` consecutive ranks:
/// the group's communicator, and the groups (`None` for one group of every
/// rank). A collective: every rank passes the same configuration (the rank
/// check made sure of it), validated first, so that a bad one starts no
/// collective; `narrows_wire`: whether the memory can average across the
/// replicas in `config.replica_reduce_dtype`.
pub(super) fn split<C: Communicator>(
    world: C,
    config: &EngineConfig,
    narrows_wire: bool,
) -> Result<(C, Option<ShardGroups<C>>)> {
    config.validate()?;
    if config.replica_reduce_dtype.is_some() && !narrows_wire {
        return Err(Error::Config(
            "replica_reduce_dtype: this memory reduces in the engine's own dtype only (the \
             host's narrow the wire, the GPU's not yet); leave it unset"
                .into(),
        ));
    }
    let n = world.world_size();
    let size = match config.shard_group {
        Some(size) if size < n => size,
        _ => return Ok((world, None)),
    };
    if n % size != 0 {
        return Err(Error::Config(format!(
            "shard_group {size} does not divide the world of {n} ranks; use a divisor of {n} \
             (the ranks of one machine, say)"
        )));
    }
    let groups = n / size;
    let mut group = None;
    for k in 0..groups {
        let ranks: Vec<usize> = (k * size..(k + 1) * size).collect();
        group = group.or(world.split(&ranks)?);
    }
    let mut replicas = None;
    for j in 0..size {
        let ranks: Vec<usize> = (0..groups).map(|k| k * size + j).collect();
        replicas = replicas.or(world.split(&ranks)?);
    }
    let (Some(group), Some(replicas)) = (group, replicas) else {
        return Err(Error::State(
            "internal: splitting into shard groups left this rank out".into(),
        ));
    };
    let (world, replicas) = (Arc::new(world), Arc::new(replicas));
    Ok((group, Some(ShardGroups { world, replicas })))
}

/// The communicator of every rank: `comm` itself without groups.
pub(super) fn world<'a, C>(comm: &'a Arc<C>, groups: &'a Option<ShardGroups<C>>) -> &'a C {
    groups.as_ref().map_or(comm, |g| &g.world)
}

/// World rank `rank`'s rank in `group` (the engine's communicator), or
/// `None` when it is in another group; an error naming `op` when the world
/// has no such rank.
pub(super) fn in_group<C: Communicator>(
    group: &Arc<C>,
    groups: &Option<ShardGroups<C>>,
    rank: usize,
    op: &'static str,
) -> Result<Option<usize>> {
    let world_size = world(group, groups).world_size();
    if rank >= world_size {
        return Err(Error::InvalidRank {
            op,
            rank,
            world_size,
        });
    }
    let size = group.world_size();
    Ok(match groups {
        Some(groups) => (groups.replicas.rank() == rank / size).then_some(rank % size),
        None => Some(rank),
    })
}

impl<C: Communicator> ShardGroups<C> {
    /// Averages the gradient shard `grads` across the replicas, in `wire`,
    /// so that every group steps the same gradients: the whole shard, or,
    /// when the interleaved schedule stepped some buckets during backward
    /// (`buckets`: their shard ranges, and which stepped), the others (the
    /// stepped ones were averaged before they stepped).
    pub fn average<T: Element, M: ShardMemory<T, C>>(
        &self,
        memory: &mut M,
        grads: &mut M::Buffer,
        (buckets, stepped): (&[Range<usize>], &[bool]),
        wire: DType,
    ) -> Result<()> {
        if !stepped.contains(&true) {
            let len = M::buffer_len(grads);
            return memory.all_reduce_as(&self.replicas, grads, 0..len, ReduceOp::Avg, wire);
        }
        for (range, _) in buckets.iter().zip(stepped).filter(|(_, &s)| !s) {
            memory.all_reduce_as(&self.replicas, grads, range.clone(), ReduceOp::Avg, wire)?;
        }
        Ok(())
    }

    /// Whether this rank's group is the first: the one that writes what
    /// every group holds alike (a checkpoint).
    pub fn first(&self) -> bool {
        self.replicas.rank() == 0
    }
}

/// The outcome of `what` (on `dir`) on every rank of `world`: the first
/// failure on any rank is returned on every rank; otherwise the value of
/// the first rank that has one (`local` is `None` on ranks that had nothing
/// to do).
pub(super) fn agree<C: Communicator, R: Serialize + DeserializeOwned>(
    world: &C,
    local: Result<Option<R>>,
    dir: &Path,
    what: &str,
) -> Result<R> {
    let shared: std::result::Result<&Option<R>, String> =
        local.as_ref().map_err(ToString::to_string);
    let all = world.all_gather_bytes(&serde_json::to_vec(&shared)?)?;
    let mut value = None;
    for (rank, bytes) in all.iter().enumerate() {
        let outcome: std::result::Result<Option<R>, String> = serde_json::from_slice(bytes)?;
        match outcome {
            Err(detail) => {
                return Err(match local {
                    Err(e) => e,
                    Ok(_) => Error::Checkpoint {
                        path: dir.to_path_buf(),
                        detail: format!("{what} failed on rank {rank}: {detail}"),
                    },
                })
            }
            Ok(some) => value = value.or(some),
        }
    }
    value.ok_or_else(|| Error::State(format!("internal: {what}: no rank had a result")))
}
