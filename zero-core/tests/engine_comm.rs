//! Communication: bytes per step, subgroups, and ranks that own nothing.

mod common;

use common::{assert_close, engine, make_opt, mean, run, slots, Model, Opt, Reference, Synthetic};
use zero_core::engine::{EngineConfig, PartitionerKind, Stage};
use zero_core::Communicator;

/// What the thread backend counts for an all-reduce of `bytes` on `n` ranks.
fn all_reduce_bytes(bytes: u64, n: u64) -> u64 {
    2 * (bytes * (n - 1) / n)
}

#[test]
fn stages_1_and_2_send_exactly_reduce_scatter_plus_all_gather() {
    let model = Synthetic::medium();
    let n_params = model.infos().len() as u64;
    for world in 2..=5usize {
        for stage in [Stage::OptimizerState, Stage::Gradients] {
            for partitioner in [PartitionerKind::Flat, PartitionerKind::Greedy] {
                for check in [true, false] {
                    for bucket_bytes in [8, 25 << 20] {
                        let config = EngineConfig::default()
                            .with_stage(stage)
                            .with_partitioner(partitioner)
                            .with_bucket_bytes(bucket_bytes)
                            .with_trainability_check(check);
                        let out = run(world, |comm| {
                            let rank = comm.rank();
                            let mut e =
                                engine(comm, &model, make_opt(Opt::Adam, false), config.clone())?;
                            let mut params = model.init();
                            let mut deltas = Vec::new();
                            for s in 0..3 {
                                let g = model.grads(&params, rank, s);
                                let before = e.comm().bytes_sent();
                                e.step(&slots(&g), &mut params)?;
                                deltas.push(e.comm().bytes_sent() - before);
                            }
                            Ok((deltas, e.sharding().plan().flat_numel()))
                        });
                        let n = world as u64;
                        for (rank, (deltas, flat_numel)) in out.iter().enumerate() {
                            let flat_bytes = *flat_numel as u64 * 8;
                            assert_eq!(flat_bytes % n, 0);
                            let mut expected = 2 * (n - 1) * flat_bytes / n;
                            if check {
                                expected += all_reduce_bytes(4 * n_params, n);
                            }
                            for d in deltas {
                                assert_eq!(
                                    *d, expected,
                                    "world {world} {stage:?} {partitioner:?} check {check} \
                                     bucket {bucket_bytes} rank {rank}"
                                );
                            }
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn stage_0_all_reduces_every_bucket_and_nothing_else() {
    let model = Synthetic::medium();
    let world = 3usize;
    let config = EngineConfig::default()
        .with_stage(Stage::Ddp)
        .with_bucket_bytes(8)
        .with_trainability_check(false)
        .with_grad_norm(true);
    let out = run(world, |comm| {
        let rank = comm.rank();
        let mut e = engine(comm, &model, make_opt(Opt::Sgd, false), config.clone())?;
        let mut params = model.init();
        let g = model.grads(&params, rank, 0);
        let before = e.comm().bytes_sent();
        e.step(&slots(&g), &mut params)?;
        let expected: u64 = e
            .sharding()
            .plan()
            .buckets
            .iter()
            .map(|b| all_reduce_bytes(b.len() as u64 * 8, world as u64))
            .sum();
        Ok((e.comm().bytes_sent() - before, expected))
    });
    for (sent, expected) in out {
        // Stage 0 needs no all-reduce for the norm: every rank has it all.
        assert_eq!(sent, expected);
    }
}

#[test]
fn grad_norm_costs_one_f64_all_reduce() {
    let model = Synthetic::medium();
    let world = 4usize;
    let sent = |norm: bool| {
        let config = EngineConfig::default()
            .with_stage(Stage::Gradients)
            .with_trainability_check(false)
            .with_grad_norm(norm);
        run(world, |comm| {
            let rank = comm.rank();
            let mut e = engine(comm, &model, make_opt(Opt::Sgd, false), config.clone())?;
            let mut params = model.init();
            let g = model.grads(&params, rank, 0);
            let before = e.comm().bytes_sent();
            e.step(&slots(&g), &mut params)?;
            Ok(e.comm().bytes_sent() - before)
        })
    };
    let (with, without) = (sent(true), sent(false));
    for (a, b) in with.iter().zip(&without) {
        assert_eq!(a - b, all_reduce_bytes(8, world as u64));
    }
}

#[test]
fn subgroup_trains_while_the_others_idle() {
    let model = Synthetic::medium();
    let steps = 5;
    for stage in [Stage::Ddp, Stage::OptimizerState, Stage::Gradients] {
        let config = EngineConfig::default()
            .with_stage(stage)
            .with_bucket_bytes(8);
        let out = run(4, |comm| {
            let Some(sub) = comm.split(&[0, 2])? else {
                return Ok(None);
            };
            assert_eq!(sub.world_size(), 2);
            let rank = sub.rank();
            let mut e = engine(sub, &model, make_opt(Opt::AdamW, false), config.clone())?;
            let mut params = model.init();
            let mut traj = Vec::new();
            for s in 0..steps {
                let g = model.grads(&params, rank, s);
                e.step(&slots(&g), &mut params)?;
                traj.push(params.clone());
            }
            Ok(Some(traj))
        });
        assert!(out[1].is_none() && out[3].is_none());
        let (a, b) = (out[0].as_ref().unwrap(), out[2].as_ref().unwrap());
        assert_eq!(a, b, "{stage:?}: subgroup ranks differ");
        let mut reference = Reference::new(&model, make_opt(Opt::AdamW, false));
        for (s, params) in a.iter().enumerate() {
            let g = mean(&reference.rank_grads(&model, 2, s));
            reference.step(&g.into_iter().map(Some).collect::<Vec<_>>());
            assert_eq!(*params, reference.params, "{stage:?} step {s}");
        }
    }
}

#[test]
fn ranks_that_own_nothing_do_not_hang() {
    let model = Synthetic::new(&[("bias", &[3]), ("weight", &[2, 2])]);
    let world = 4;
    let steps = 4;
    for stage in [Stage::OptimizerState, Stage::Gradients] {
        for partitioner in [PartitionerKind::Flat, PartitionerKind::Greedy] {
            for clip in [false, true] {
                let mut config = EngineConfig::default()
                    .with_stage(stage)
                    .with_partitioner(partitioner)
                    .with_grad_accum_steps(2);
                if clip {
                    config = config.with_clip(0.5, zero_core::engine::NormType::L2);
                }
                let out = run(world, |comm| {
                    let rank = comm.rank();
                    let mut e = engine(comm, &model, make_opt(Opt::Adam, false), config.clone())?;
                    let owned = e.sharding().owned_pieces().count();
                    let mut params = model.init();
                    let mut traj = Vec::new();
                    for s in 0..steps {
                        for m in 0..2 {
                            let g = model.grads(&params, rank, 2 * s + m);
                            e.step(&slots(&g), &mut params)?;
                        }
                        traj.push(params.clone());
                    }
                    Ok((owned, traj))
                });
                let empty = out.iter().filter(|(owned, _)| *owned == 0).count();
                assert!(
                    empty >= 2,
                    "{stage:?} {partitioner:?}: only {empty} empty ranks"
                );

                let mut reference = Reference::new(&model, make_opt(Opt::Adam, false));
                for s in 0..steps {
                    let per_rank: Vec<Vec<Vec<f64>>> = (0..world)
                        .map(|r| {
                            mean(&[
                                model.grads(&reference.params, r, 2 * s),
                                model.grads(&reference.params, r, 2 * s + 1),
                            ])
                        })
                        .collect();
                    let g: Vec<Option<Vec<f64>>> = mean(&per_rank).into_iter().map(Some).collect();
                    let g = if clip {
                        let total = g
                            .iter()
                            .flatten()
                            .flatten()
                            .map(|x| x * x)
                            .sum::<f64>()
                            .sqrt();
                        let coef = (0.5 / (total + 1e-6)).min(1.0);
                        g.into_iter()
                            .map(|g| g.map(|g| g.into_iter().map(|x| x * coef).collect()))
                            .collect()
                    } else {
                        g
                    };
                    reference.step(&g);
                    for (rank, (_, t)) in out.iter().enumerate() {
                        assert_close(
                            &t[s],
                            &reference.params,
                            1e-9,
                            &format!("{stage:?} {partitioner:?} clip {clip} step {s} rank {rank}"),
                        );
                    }
                }
            }
        }
    }
}
