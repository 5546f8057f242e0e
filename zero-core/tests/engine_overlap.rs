//! Gradients handed over during backward (`begin_backward` +
//! `accumulate_param`) give what slots given to `step` give, however the
//! micro-steps of a window are mixed, at every stage and schedule.

mod common;

use common::{
    assert_trajectories, engine, hooked_micro_step, make_opt, reference_trajectory, run, slots,
    Model, Opt, Synthetic,
};
use zero_core::engine::HostGrad;
use zero_core::engine::{EngineConfig, Overlap, Stage};
use zero_core::{Communicator, Engine, ThreadComm};

#[test]
fn handed_over_micro_steps_mix_with_slot_micro_steps() {
    let model = Synthetic::medium();
    let (world, micro, steps) = (2, 3, 3);
    let expected = reference_trajectory(&model, Opt::Adam, world, micro, steps);
    // Which micro-steps are handed over during "backward".
    let patterns: [[bool; 3]; 3] = [[false, true, true], [true, false, true], [true, true, true]];
    for stage in [Stage::Ddp, Stage::OptimizerState, Stage::Gradients] {
        for overlap in [Overlap::None, Overlap::AfterBackward, Overlap::Interleaved] {
            for pattern in patterns {
                let config = EngineConfig::default()
                    .with_stage(stage)
                    .with_bucket_bytes(8)
                    .with_grad_accum_steps(micro)
                    .with_overlap(overlap);
                let trajectories = run(world, |comm| {
                    let rank = comm.rank();
                    let mut e = engine(comm, &model, make_opt(Opt::Adam, false), config.clone())?;
                    let mut params = model.init();
                    let mut out = Vec::new();
                    for s in 0..steps {
                        for (m, &handed) in pattern.iter().enumerate() {
                            let g = model.grads(&params, rank, s * micro + m);
                            if !handed {
                                e.step(&slots(&g), &mut params)?;
                                continue;
                            }
                            hooked_micro_step(&mut e, &g, &mut params)?;
                        }
                        out.push(params.clone());
                    }
                    assert_eq!(e.steps(), steps as u64);
                    Ok(out)
                });
                assert_trajectories(
                    &trajectories,
                    &expected[..steps],
                    1e-9,
                    &format!("{stage:?} {overlap:?} {pattern:?}"),
                );
            }
        }
    }
}

/// `0..n` in three ranges of uneven lengths (fewer when `n < 3`).
fn ranges(n: usize) -> Vec<std::ops::Range<usize>> {
    let (a, b) = (n / 5, n / 2);
    [0..a, a..b, b..n]
        .into_iter()
        .filter(|r| !r.is_empty())
        .collect()
}

#[test]
fn gradients_handed_over_in_ranges_count_as_whole_ones() {
    let model = Synthetic::medium();
    let (world, steps) = (2, 3);
    let expected = reference_trajectory(&model, Opt::Adam, world, 1, steps);
    for stage in [Stage::Ddp, Stage::OptimizerState, Stage::Gradients] {
        for overlap in [Overlap::None, Overlap::AfterBackward, Overlap::Interleaved] {
            // Without `begin_backward` too: the ranges then go to the full
            // gradient buffer.
            for open_pass in [true, false] {
                let config = EngineConfig::default()
                    .with_stage(stage)
                    .with_bucket_bytes(8)
                    .with_overlap(overlap);
                let trajectories = run(world, |comm| {
                    let rank = comm.rank();
                    let mut e = engine(comm, &model, make_opt(Opt::Adam, false), config.clone())?;
                    let n = e.params().len();
                    let mut params = model.init();
                    let mut out = Vec::new();
                    for s in 0..steps {
                        let g = model.grads(&params, rank, s);
                        if open_pass {
                            let order: Vec<(usize, usize)> = (0..n).rev().map(|p| (p, 1)).collect();
                            e.begin_backward(&order, &mut params)?;
                        }
                        for p in (0..n).rev() {
                            for range in ranges(g[p].len()) {
                                e.accumulate_param(p, range.clone(), g[p][range].into())?;
                            }
                        }
                        let none: Vec<Option<HostGrad<'_, f64>>> = vec![None; n];
                        e.step(&none, &mut params)?;
                        out.push(params.clone());
                    }
                    // A range past the parameter's end is refused.
                    let len = e.params()[0].numel();
                    let err = e
                        .accumulate_param(0, len..len + 1, [0.0][..].into())
                        .expect_err("past the end");
                    assert!(err.to_string().contains("range"), "{err}");
                    Ok(out)
                });
                assert_trajectories(
                    &trajectories,
                    &expected[..steps],
                    1e-9,
                    &format!("{stage:?} {overlap:?} open pass {open_pass}"),
                );
            }
        }
    }
}

#[test]
fn after_backward_stages_1_and_2_keep_no_copy_of_the_parameter_shard() {
    let model = Synthetic::medium();
    let replica: usize = model.infos().iter().map(|p| p.numel() * 8).sum();
    for stage in [Stage::OptimizerState, Stage::Gradients] {
        for overlap in [Overlap::None, Overlap::AfterBackward, Overlap::Interleaved] {
            let config = EngineConfig::default()
                .with_stage(stage)
                .with_bucket_bytes(64)
                .with_overlap(overlap);
            let reports = run(2, |comm| {
                let mut e = engine(comm, &model, make_opt(Opt::Adam, false), config.clone())?;
                hand_over_steps(&mut e, &model, 2)?;
                Ok((
                    e.memory_report().params,
                    e.sharding().plan().shard_numel * 8,
                ))
            });
            let (params, shard) = reports[0];
            // The replica is the framework's; only the schedule that steps
            // bucket by bucket from it after backward can do without a shard.
            let want = match overlap {
                Overlap::AfterBackward => replica,
                _ => replica + shard,
            };
            assert_eq!(params, want, "{stage:?} {overlap:?}");
        }
    }
}

#[test]
fn a_backward_pass_holds_a_few_bucket_buffers_not_one_per_bucket() {
    // Buckets of 4 MiB (512Ki f64): the gradients of 8 MiB span two or
    // three, and the model has more buckets than the engine may hold
    // buffers for (two, or as many as hold 8 MiB).
    let model = Synthetic::new(&[
        ("a.weight", &[1024, 1024]),
        ("b.weight", &[1024, 1024]),
        ("c.weight", &[1024, 1024]),
        ("d.weight", &[1024, 512]),
    ]);
    let config = EngineConfig::default()
        .with_stage(Stage::Gradients)
        .with_bucket_bytes(4 << 20)
        .with_overlap(Overlap::AfterBackward);
    let reports = run(2, |comm| {
        let mut e = engine(comm, &model, make_opt(Opt::Adam, false), config.clone())?;
        hand_over_steps(&mut e, &model, 2)?;
        let layout = e.sharding().layout();
        let longest = (0..layout.buckets.len())
            .map(|k| layout.bucket_range(k).len())
            .max()
            .unwrap_or(1);
        Ok((
            e.memory_report().comm_buffers,
            longest * 8,
            layout.buckets.len(),
        ))
    });
    for (rank, &(bytes, bucket, buckets)) in reports.iter().enumerate() {
        assert!(buckets >= 6, "the test needs many buckets, got {buckets}");
        // Two for the reductions (one filling, one reducing), one more
        // while a gradient spans a bucket boundary with none queued; the
        // gathers after the step reuse them.
        assert!(
            bytes <= 3 * bucket,
            "rank {rank}: {bytes} bytes of bucket buffers for {buckets} buckets of {bucket}"
        );
    }
}

/// `steps` steps of `model` whose gradients are all handed over during
/// "backward", in reverse order, as a hook hands them.
fn hand_over_steps(
    e: &mut Engine<f64, ThreadComm>,
    model: &Synthetic,
    steps: usize,
) -> zero_core::Result<()> {
    let rank = e.comm().rank();
    let n = e.params().len();
    let mut params = model.init();
    for s in 0..steps {
        let g = model.grads(&params, rank, s);
        hand_over_backward(e, &g, &mut params)?;
        e.step(&vec![None; n], &mut params)?;
    }
    Ok(())
}

/// One "backward" handing every gradient of `g` over in reverse order, as
/// a hook hands them; the step is the caller's.
fn hand_over_backward(
    e: &mut Engine<f64, ThreadComm>,
    g: &[Vec<f64>],
    params: &mut Vec<Vec<f64>>,
) -> zero_core::Result<()> {
    let n = e.params().len();
    let order: Vec<(usize, usize)> = (0..n).rev().map(|p| (p, 1)).collect();
    e.begin_backward(&order, params)?;
    for p in (0..n).rev() {
        e.accumulate_param(p, .., (&g[p]).into())?;
    }
    Ok(())
}

/// Stage 0 steps each bucket as soon as it is reduced (after backward)
/// unless the trainable mask changed: the same weights as the serial
/// schedule, bitwise, through steps where a parameter is frozen, where no
/// rank hands one over, and where only one rank does.
#[test]
fn stage_0_stepping_as_reduced_follows_mask_changes_bitwise() {
    let model = Synthetic::medium();
    let (world, steps) = (2, 5);
    let trajectories = |overlap: Overlap| {
        let config = EngineConfig::default()
            .with_stage(Stage::Ddp)
            .with_bucket_bytes(64)
            .with_overlap(overlap);
        run(world, |comm| {
            let rank = comm.rank();
            let mut e = engine(comm, &model, make_opt(Opt::Adam, false), config.clone())?;
            let n = e.params().len();
            let frozen = e.params()[0].name.clone();
            let mut params = model.init();
            let mut out = Vec::new();
            for s in 0..steps {
                // Step 1 freezes parameter 0; step 2 thaws it and no rank
                // hands parameter 1 over; step 3 only rank 0 does.
                e.set_trainable(&frozen, s != 1)?;
                let skips = |p: usize| p == 1 && (s == 2 || (s == 3 && rank == 1));
                let g = model.grads(&params, rank, s);
                let order: Vec<(usize, usize)> = (0..n).rev().map(|p| (p, 1)).collect();
                e.begin_backward(&order, &mut params)?;
                for p in (0..n).rev().filter(|&p| !skips(p)) {
                    e.accumulate_param(p, .., (&g[p]).into())?;
                }
                e.step(&vec![None; n], &mut params)?;
                out.push(params.clone());
            }
            Ok(out)
        })
    };
    let serial = trajectories(Overlap::None);
    let overlapped = trajectories(Overlap::AfterBackward);
    assert_eq!(serial, overlapped);
    // The steps did what they say: parameter 0 held still while frozen,
    // parameter 1 while no rank had a gradient for it.
    for rank in &serial {
        assert_eq!(rank[0][0], rank[1][0], "frozen parameter 0 moved");
        assert_ne!(rank[1][0], rank[2][0], "thawed parameter 0 did not move");
        assert_eq!(
            rank[1][1], rank[2][1],
            "parameter 1 moved without gradients"
        );
        assert_ne!(
            rank[2][1], rank[3][1],
            "one rank's gradient did not move it"
        );
    }
}

/// A peer that leaves in the middle of a stage 0 pass (after its first
/// buckets went out) makes the step fail on the rank that stays, at once,
/// naming it (in the mask's all-reduce or a bucket's reduction),
/// rather than wait for its deadline.
#[test]
fn stage_0_a_peer_leaving_mid_pass_is_an_error_not_a_hang() {
    let model = Synthetic::medium();
    let config = EngineConfig::default()
        .with_stage(Stage::Ddp)
        .with_bucket_bytes(64)
        .with_overlap(Overlap::AfterBackward);
    let started = std::time::Instant::now();
    let results = zero_core::ThreadGroup::new(2)
        .with_timeout(std::time::Duration::from_secs(30))
        .run(|comm| -> zero_core::Result<()> {
            let rank = comm.rank();
            let mut e = engine(comm, &model, make_opt(Opt::Adam, false), config.clone())?;
            let n = e.params().len();
            let mut params = model.init();
            let g = model.grads(&params, rank, 0);
            let order: Vec<(usize, usize)> = (0..n).rev().map(|p| (p, 1)).collect();
            e.begin_backward(&order, &mut params)?;
            for p in (0..n).rev() {
                if rank == 1 && p < n / 2 {
                    // Leaves with its engine, communicators and all.
                    return Ok(());
                }
                e.accumulate_param(p, .., (&g[p]).into())?;
            }
            e.step(&vec![None; n], &mut params).map(drop)
        });
    let mut results = results.into_iter();
    let stayed = results.next().expect("rank 0").expect("no panic");
    let err = stayed.expect_err("the step cannot succeed without its peer");
    assert!(
        err.to_string().contains("rank 1"),
        "the error should name the rank that left: {err}"
    );
    assert!(results.next().expect("rank 1").expect("no panic").is_ok());
    assert!(
        started.elapsed() < std::time::Duration::from_secs(20),
        "took {:?}: waited for the deadline instead of failing at once",
        started.elapsed()
    );
}

/// With the interleaved schedule the optimizer steps beside backward: a
/// learning rate set between `begin_backward` and the step applies from the
/// next step (this one's buckets may have stepped), exactly as one set right
/// after the step; meanwhile the engine reports the rate set and refuses to
/// lend the optimizer out again.
#[test]
fn a_learning_rate_set_during_an_interleaved_backward_applies_from_the_next_step() {
    let model = Synthetic::medium();
    let (world, steps, changed_at) = (2, 4, 1);
    let config = EngineConfig::default()
        .with_stage(Stage::Gradients)
        .with_bucket_bytes(96)
        .with_overlap(Overlap::Interleaved);
    let train = |during_backward: bool| {
        run(world, |comm| {
            let rank = comm.rank();
            let mut e = engine(comm, &model, make_opt(Opt::Sgd, false), config.clone())?;
            let n = e.params().len();
            let mut params = model.init();
            let mut state_bytes = 0;
            for s in 0..steps {
                let g = model.grads(&params, rank, s);
                hand_over_backward(&mut e, &g, &mut params)?;
                if during_backward && s == changed_at {
                    assert!(
                        e.optimizer().is_err(),
                        "the optimizer is stepping beside backward"
                    );
                    assert!(state_bytes > 0, "momentum is state");
                    assert_eq!(
                        e.memory_report().optimizer_state,
                        state_bytes,
                        "a lent optimizer's state counts as when it left"
                    );
                    e.set_learning_rate(0.5);
                    assert_eq!(e.learning_rate(), 0.5);
                }
                e.step(&vec![None; n], &mut params)?;
                if !during_backward && s == changed_at {
                    e.set_learning_rate(0.5);
                }
                assert_eq!(e.optimizer()?.learning_rate(0), e.learning_rate());
                state_bytes = e.memory_report().optimizer_state;
            }
            assert_eq!(e.learning_rate(), 0.5);
            Ok(params)
        })
    };
    let (during, after) = (train(true), train(false));
    assert_eq!(during, after, "bitwise: the same steps at the same rates");
}
