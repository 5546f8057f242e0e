//! What each stage holds per rank.

mod common;

use common::{engine, make_opt, run, slots, Model, Opt, Synthetic};
use zero_core::engine::{EngineConfig, MemoryReport, PartitionerKind, Stage};
use zero_core::partition::DEFAULT_ALIGNMENT;
use zero_core::Communicator;

fn model() -> Synthetic {
    Synthetic::new(&[
        ("a", &[64, 32]),
        ("b", &[64]),
        ("c", &[32, 48]),
        ("d", &[17]),
    ])
}

/// Per rank: the memory report after one step, the optimizer's tensor-state
/// bytes, and the number of pieces it steps.
fn after_one_step(
    world: usize,
    stage: Stage,
    partitioner: PartitionerKind,
    opt: Opt,
) -> Vec<(MemoryReport, usize, usize)> {
    let model = model();
    let config = EngineConfig::default()
        .with_stage(stage)
        .with_partitioner(partitioner)
        .with_bucket_bytes(1024);
    run(world, |comm| {
        let rank = comm.rank();
        let mut e = engine(comm, &model, make_opt(opt, false), config.clone())?;
        let mut params = model.init();
        let g = model.grads(&params, rank, 0);
        e.step(&slots(&g), &mut params)?;
        let tensors: usize = e
            .optimizer()?
            .export_state()
            .params
            .values()
            .map(|p| p.tensors.values().map(Vec::len).sum::<usize>() * 8)
            .sum();
        Ok((
            e.memory_report(),
            tensors,
            e.sharding().owned_pieces().count(),
        ))
    })
}

#[test]
fn optimizer_state_is_split_across_ranks() {
    let total_numel: usize = model().infos().iter().map(|p| p.numel()).sum();
    let n_params = model().infos().len();
    for opt in [Opt::Sgd, Opt::Adam] {
        let full = after_one_step(3, Stage::Ddp, PartitionerKind::Flat, opt);
        let (stage0, stage0_tensors, _) = full[0];
        // Every stage-0 rank holds everything.
        assert!(full.iter().all(|(m, _, _)| *m == stage0));
        let per_element = stage0_tensors / total_numel;
        for world in 2..=5 {
            for stage in [Stage::OptimizerState, Stage::Gradients] {
                for partitioner in [PartitionerKind::Flat, PartitionerKind::Greedy] {
                    let ranks = after_one_step(world, stage, partitioner, opt);
                    let what = format!("{opt:?} world {world} {stage:?} {partitioner:?}");
                    let tensors: usize = ranks.iter().map(|r| r.1).sum();
                    assert_eq!(tensors, stage0_tensors, "{what}: tensor state");
                    // Scalars (Adam's `step`) are per piece: a parameter cut
                    // between ranks has one per piece.
                    let pieces: usize = ranks.iter().map(|r| r.2).sum();
                    let scalar_bytes = (stage0.optimizer_state - stage0_tensors) / n_params;
                    let total: usize = ranks.iter().map(|r| r.0.optimizer_state).sum();
                    assert_eq!(
                        total,
                        stage0.optimizer_state + (pieces - n_params) * scalar_bytes,
                        "{what}: optimizer state"
                    );
                    if partitioner == PartitionerKind::Flat {
                        // No rank holds more than its 1/N share plus the
                        // alignment padding.
                        let share = total_numel.div_ceil(world) + DEFAULT_ALIGNMENT;
                        for (rank, r) in ranks.iter().enumerate() {
                            assert!(
                                r.1 <= share * per_element,
                                "{what} rank {rank}: {} bytes of state > {}",
                                r.1,
                                share * per_element
                            );
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn stage_2_holds_a_1_over_n_gradient() {
    let total_numel: usize = model().infos().iter().map(|p| p.numel()).sum();
    let (stage0, _, _) = after_one_step(1, Stage::Ddp, PartitionerKind::Flat, Opt::Sgd)[0];
    assert!(stage0.grads >= total_numel * 8);
    assert_eq!(stage0.grad_shard, 0);
    for world in 2..=5 {
        for partitioner in [PartitionerKind::Flat, PartitionerKind::Greedy] {
            let s1 = after_one_step(world, Stage::OptimizerState, partitioner, Opt::Sgd);
            let s2 = after_one_step(world, Stage::Gradients, partitioner, Opt::Sgd);
            for (rank, ((m1, _, _), (m2, _, _))) in s1.iter().zip(&s2).enumerate() {
                let what = format!("world {world} {partitioner:?} rank {rank}");
                // Neither keeps a full gradient after a step without
                // accumulation (stage 1 holds one only across an
                // accumulation window).
                assert_eq!(m1.grads, 0, "{what}");
                assert_eq!(m2.grads, 0, "{what}");
                assert_eq!(m1.grad_shard, m2.grad_shard, "{what}");
                let g2 = m2.grads + m2.grad_shard;
                assert!(g2 * world >= total_numel * 8, "{what}: {g2} bytes too few");
                if partitioner == PartitionerKind::Flat {
                    let bound = (total_numel.div_ceil(world) + DEFAULT_ALIGNMENT) * 8;
                    assert!(g2 <= bound, "{what}: {g2} > {bound}");
                }
                assert_eq!(m2.total(), m1.total(), "{what}");
            }
        }
    }
}
