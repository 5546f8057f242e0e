//! The engine's step plans keep the contract a memory with a flat
//! optimizer state relies on (the CUDA memory keeps its state in one buffer
//! over the shard): whatever stretch of the shard a plan's buffers hold
//! (`ShardStep::origin`) and however few pieces it steps, a piece is always
//! at the same shard position, inside `ShardStep::shard_len`, and no two
//! pieces overlap. Checked here on host memory, at every stage, schedule,
//! world size and accumulation, so CI guards what only a GPU could run.

mod common;

use common::{
    assert_trajectories, hooked_micro_step, make_opt, reference_trajectory, run, Model, Opt,
    PlanCheck, Seen, Synthetic,
};
use std::sync::{Arc, Mutex};
use zero_core::engine::{EngineConfig, HostGrad, Overlap, Stage};
use zero_core::{Communicator, Engine};

#[test]
fn step_plans_keep_each_piece_at_its_shard_position() {
    let model = Synthetic::medium();
    let (micro, steps) = (2, 3);
    for world in [1, 2, 3] {
        let expected = reference_trajectory(&model, Opt::Adam, world, micro, steps);
        for stage in [Stage::Ddp, Stage::OptimizerState, Stage::Gradients] {
            for overlap in [Overlap::None, Overlap::AfterBackward, Overlap::Interleaved] {
                let what = format!("N={world} {stage:?} {overlap:?}");
                // Small buckets: stage 0 steps in many windows, the
                // schedules bucket by bucket.
                let config = EngineConfig::default()
                    .with_stage(stage)
                    .with_bucket_bytes(96)
                    .with_grad_accum_steps(micro)
                    .with_overlap(overlap);
                let seen: Vec<Arc<Mutex<Seen>>> = (0..world).map(|_| Arc::default()).collect();
                let trajectories = run(world, |comm| {
                    let rank = comm.rank();
                    let memory = PlanCheck::new(seen[rank].clone(), false);
                    let optimizer = make_opt(Opt::Adam, false);
                    let mut e = Engine::with_memory(
                        comm,
                        memory,
                        model.infos(),
                        optimizer,
                        config.clone(),
                    )?;
                    let mut params = model.init();
                    let mut out = Vec::new();
                    for s in 0..steps {
                        for m in 0..micro {
                            let g = model.grads(&params, rank, s * micro + m);
                            hooked_micro_step(&mut e, &g, &mut params)?;
                        }
                        out.push(params.clone());
                    }
                    Ok(out)
                });
                assert_trajectories(&trajectories, &expected[..steps], 1e-9, &what);
                for (rank, seen) in seen.iter().enumerate() {
                    let seen = seen.lock().expect("no test thread panicked");
                    seen.assert_kept(&format!("{what} rank {rank}"));
                    assert!(seen.plans > 0, "{what} rank {rank}: no step plan");
                }
                // Stage 0 steps in windows; the schedules step a bucket at a
                // time at stages 1 and 2 (after-backward with the shard
                // read from the replica, interleaved during backward).
                let partial: usize = seen
                    .iter()
                    .map(|s| s.lock().expect("no panic").partial)
                    .sum();
                if stage == Stage::Ddp || overlap != Overlap::None {
                    assert!(
                        partial > 0,
                        "{what}: no plan stepped only part of the shard"
                    );
                }
            }
        }
    }
}

/// A memory with asynchronous collectives and no communication thread
/// (the CUDA memory) gets its reductions launched on the calling thread as
/// buckets fill, and trains what the reference trains, at every stage, with
/// accumulation: the inline reducer settles before it uses a result
/// (stage 0 writes its buckets into the full buffer after settling). At
/// stages 1 and 2 it steps and gathers bucket by bucket on the calling
/// thread too, with no copy of the parameter shard.
#[test]
fn a_memory_with_asynchronous_collectives_reduces_during_backward_on_the_calling_thread() {
    let model = Synthetic::medium();
    let (micro, steps) = (2, 3);
    let n = model.infos().len();
    for world in [1, 2, 3] {
        let expected = reference_trajectory(&model, Opt::Adam, world, micro, steps);
        for stage in [Stage::Ddp, Stage::OptimizerState, Stage::Gradients] {
            let what = format!("N={world} {stage:?}");
            let config = EngineConfig::default()
                .with_stage(stage)
                .with_bucket_bytes(96)
                .with_grad_accum_steps(micro);
            let seen: Vec<Arc<Mutex<Seen>>> = (0..world).map(|_| Arc::default()).collect();
            let trajectories = run(world, |comm| {
                let rank = comm.rank();
                let memory = PlanCheck::new(seen[rank].clone(), true);
                let optimizer = make_opt(Opt::Adam, false);
                let mut e =
                    Engine::with_memory(comm, memory, model.infos(), optimizer, config.clone())?;
                let progress = e.reduction_progress();
                let mut params = model.init();
                let mut out = Vec::new();
                for s in 0..steps {
                    for m in 0..micro {
                        let g = model.grads(&params, rank, s * micro + m);
                        let order: Vec<(usize, usize)> = (0..n).rev().map(|p| (p, 1)).collect();
                        e.begin_backward(&order, &mut params)?;
                        let before = progress.completed();
                        for p in (0..n).rev() {
                            e.accumulate_param(p, .., (&g[p]).into())?;
                        }
                        // Stage 2 reduces every micro-step, the others on
                        // the last: every bucket is launched once its last
                        // gradient is in, before the step closes the pass.
                        if stage == Stage::Gradients || m + 1 == micro {
                            assert!(
                                progress.completed() > before,
                                "{stage:?}: nothing reduced during backward"
                            );
                        }
                        let none: Vec<Option<HostGrad<'_, f64>>> = vec![None; n];
                        e.step(&none, &mut params)?;
                    }
                    out.push(params.clone());
                }
                // No copy of the parameter shard beside the replica: each
                // bucket's owned pieces were read from the replica, stepped
                // and gathered (stages 1 and 2, as stage 0 steps the replica).
                let replica: usize = model
                    .infos()
                    .iter()
                    .map(|p| p.numel() * p.dtype.size_in_bytes())
                    .sum();
                assert_eq!(
                    e.memory_report().params,
                    replica,
                    "{stage:?}: the engine holds parameters beside the replica"
                );
                Ok((out, e.memory_report().comm_buffers))
            });
            let (trajectories, comm_buffers): (Vec<_>, Vec<_>) = trajectories.into_iter().unzip();
            assert_trajectories(&trajectories, &expected[..steps], 1e-9, &what);
            for (seen, comm_buffers) in seen.iter().zip(comm_buffers) {
                let seen = seen.lock().expect("no test thread panicked");
                // Includes: no bucket buffer written while a reduction
                // that read it was neither settled nor fenced.
                seen.assert_kept(&what);
                assert!(seen.deferred > 0, "{what}: no reduction was deferred");
                // Bucket buffers are reused behind fences (stage 0's
                // written into the full buffer first): at N = 1 (each
                // bucket one stretch of backward) a few, not one per bucket
                // (24 of 96 bytes here; held to the end, 2,048-2,304
                // bytes).
                assert!(seen.fences > 0, "{what}: no buffer reused before settling");
                if world == 1 {
                    assert!(comm_buffers <= 12 * 96, "{what}: {comm_buffers} bytes");
                }
            }
        }
    }
}

/// A gradient handed over whole lands on the zeros of a fresh bucket
/// buffer: it is copied there, not added (one read of the buffer less); a
/// second gradient of the same weight (a weight used twice) is added.
#[test]
fn a_whole_first_gradient_is_copied_into_its_bucket_and_a_second_added() {
    let model = Synthetic::medium();
    let n = model.infos().len();
    for world in [1, 2] {
        for twice in [false, true] {
            let what = format!("N={world}, last weight twice: {twice}");
            let config = EngineConfig::default()
                .with_stage(Stage::Gradients)
                .with_bucket_bytes(96);
            let expected = reference_trajectory(&model, Opt::Adam, world, 1, 2);
            let seen: Vec<Arc<Mutex<Seen>>> = (0..world).map(|_| Arc::default()).collect();
            let trajectories = run(world, |comm| {
                let rank = comm.rank();
                let memory = PlanCheck::new(seen[rank].clone(), false);
                let mut e = Engine::with_memory(
                    comm,
                    memory,
                    model.infos(),
                    make_opt(Opt::Adam, false),
                    config.clone(),
                )?;
                let mut params = model.init();
                let mut out = Vec::new();
                for s in 0..2 {
                    let g = model.grads(&params, rank, s);
                    let calls = |p: usize| if twice && p == 0 { 2 } else { 1 };
                    let order: Vec<(usize, usize)> = (0..n).rev().map(|p| (p, calls(p))).collect();
                    e.begin_backward(&order, &mut params)?;
                    for p in (0..n).rev() {
                        if calls(p) == 2 {
                            let half: Vec<f64> = g[p].iter().map(|x| x / 2.0).collect();
                            e.accumulate_param(p, .., (&half).into())?;
                            e.accumulate_param(p, .., (&half).into())?;
                        } else {
                            e.accumulate_param(p, .., (&g[p]).into())?;
                        }
                    }
                    let none: Vec<Option<HostGrad<'_, f64>>> = vec![None; n];
                    e.step(&none, &mut params)?;
                    out.push(params.clone());
                }
                Ok(out)
            });
            assert_trajectories(&trajectories, &expected[..2], 1e-9, &what);
            for seen in &seen {
                let (copied, added) = seen.lock().expect("no panic").flattened;
                assert!(copied > 0, "{what}: nothing copied");
                if twice {
                    assert!(added > 0, "{what}: the second gradient was not added");
                } else {
                    assert_eq!(added, 0, "{what}: a first gradient was added");
                }
            }
        }
    }
}
