//! What every engine derives from its parameters and configuration before
//! the first step: the parameters by name and their groups, the partition plan, the bucket-major
//! layout and the pieces this rank steps, whatever memory the [`Engine`]'s
//! buffers live in.
//!
//! [`Engine`]: super::Engine

use super::{EngineConfig, Layout, ParamTable, Stage};
use crate::optim::FunctionalOptimizer;
use crate::partition::{Interleaved, ParamInfo, PartitionPlan, ShardPiece};
use crate::{Element, Result};

/// Parameters, plan, layout and owned pieces of one rank.
#[derive(Clone, Debug)]
pub struct ShardSetup {
    /// The parameters by name, and their groups.
    pub params: ParamTable,
    /// The partition plan: over one rank in stage 0 (every rank steps
    /// everything), over the world otherwise.
    pub plan: PartitionPlan,
    /// The bucket-major layout of `plan`.
    pub layout: Layout,
    /// This rank's index in the plan (0 in stage 0).
    pub plan_rank: usize,
    /// The pieces this rank steps, in shard order.
    pub owned: Vec<ShardPiece>,
}

impl ShardSetup {
    /// Validates `config` and the parameters, adds `config.param_groups` to
    /// `optimizer` and partitions. Local: run the rank-consistency check
    /// before it, so that every rank fails alike or passes alike.
    pub fn new<T: Element>(
        params: Vec<ParamInfo>,
        config: &EngineConfig,
        optimizer: &mut dyn FunctionalOptimizer<T>,
        world_size: usize,
        rank: usize,
    ) -> Result<Self> {
        config.validate()?;
        let params = ParamTable::new(params, config, optimizer)?;
        let (plan_world, plan_rank) = match config.stage {
            Stage::Ddp => (1, 0),
            Stage::OptimizerState | Stage::Gradients | Stage::Parameters => (world_size, rank),
        };
        let plan = partition::<T>(&params, config, plan_world)?;
        let layout = Layout::new(&plan);
        let owned = plan.shards[plan_rank].clone();
        Ok(Self {
            params,
            plan,
            layout,
            plan_rank,
            owned,
        })
    }

    /// Where piece `piece` of `owned` starts in this rank's shard.
    pub fn shard_offset(&self, piece: &ShardPiece) -> usize {
        piece.flat_range.start - self.plan_rank * self.plan.shard_numel
    }
}

/// The first partition over `plan_world` ranks.
fn partition<T: Element>(
    params: &[ParamInfo],
    config: &EngineConfig,
    plan_world: usize,
) -> Result<PartitionPlan> {
    let bucket_bytes = partition_bucket_bytes::<T>(params, config.bucket_bytes, plan_world);
    if config.stage != Stage::Parameters {
        return config
            .partitioner
            .partitioner()
            .partition(params, plan_world, bucket_bytes);
    }
    // Stage 3 gathers a parameter as one stretch of buckets: split every
    // bucket evenly (by name until the first hooked backward orders them by
    // gradient), the parameters that may be sharded first and the
    // persistent ones after a break, so that no bucket mixes the two.
    let small = |p: &ParamInfo| p.numel() <= config.persist_numel;
    let order: Vec<usize> = (0..params.len())
        .filter(|&p| !small(&params[p]))
        .chain((0..params.len()).filter(|&p| small(&params[p])))
        .collect();
    let large = params.iter().filter(|p| !small(p)).count();
    let mut breaks = stage3_breaks::<T>(params, &order[..large], config);
    breaks.push(large);
    Interleaved::default().partition_in_order(params, &order, plan_world, bucket_bytes, &breaks)
}

/// The `bucket_bytes` to give the partitioners so that a bucket of
/// `world` rank segments holds `bucket_bytes` of `T`.
///
/// - The partitioners count a bucket per rank segment; the configured size
///   is the whole bucket (what one collective moves and one bucket buffer
///   holds), so a rank's bucket buffers do not grow with the world size
///   (at least one element per segment).
/// - They count in the parameters' dtype, but the engine's bucket buffers
///   hold `T`: f32 master weights over a bf16 model would otherwise get
///   buckets of twice the configured bytes.
///
/// The bucket buffers are most of what stage 2 holds besides the shard.
/// Exact: the partitioners take `bytes / param_bytes` elements, the
/// segment's count of `T` again, and it cannot overflow, as `T` is never
/// narrower than a trainable parameter.
pub(super) fn partition_bucket_bytes<T: Element>(
    params: &[ParamInfo],
    bucket_bytes: usize,
    world: usize,
) -> usize {
    let engine_bytes = std::mem::size_of::<T>();
    let param_bytes = params
        .iter()
        .find(|p| p.trainable)
        .map_or(engine_bytes, |p| p.dtype.size_in_bytes());
    (bucket_bytes / engine_bytes / world.max(1))
        .max(1)
        .saturating_mul(param_bytes)
}

/// Stage 3: the positions in `order` (the parameters that may be sharded)
/// of those at least a bucket large (counted in `T`, as the bucket
/// buffers; see [`partition_bucket_bytes`]). Each starts a bucket of its
/// own, so that a gather of one layer never spans its neighbours (buckets
/// shared at the boundaries would chain every layer into one gather);
/// smaller ones pack into the buckets before them and travel with them.
pub(super) fn stage3_breaks<T: Element>(
    params: &[ParamInfo],
    order: &[usize],
    config: &EngineConfig,
) -> Vec<usize> {
    order
        .iter()
        .enumerate()
        .filter(|&(_, &p)| {
            let bytes = params[p].numel().saturating_mul(std::mem::size_of::<T>());
            bytes >= config.bucket_bytes
        })
        .map(|(j, _)| j)
        .collect()
}
