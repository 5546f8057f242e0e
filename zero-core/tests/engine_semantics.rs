//! Engine semantics that match `torch.optim`: `None` gradients leave a
//! parameter untouched in every mode, added groups take the constructor's
//! hyperparameters, and a non-finite norm under clipping refuses the step
//! on every rank.

mod common;

use common::{assert_close, engine, make_opt, mean, run, Model, Opt, Reference, Synthetic};
use zero_core::engine::HostGrad;
use zero_core::engine::{EngineConfig, NormType, PartitionerKind, Stage};
use zero_core::optim::Hyperparams;
use zero_core::{Communicator, Error};

const STAGES: [Stage; 3] = [Stage::Ddp, Stage::OptimizerState, Stage::Gradients];

/// Parameter 1 has a gradient on no rank from step 2 on.
fn has_grad(param: usize, step: usize) -> bool {
    param != 1 || step < 2
}

#[test]
fn none_leaves_a_parameter_untouched_with_the_trainability_check_off() {
    let model = Synthetic::medium();
    let steps = 5;
    for stage in STAGES {
        for world in [1, 3] {
            let config = EngineConfig::default()
                .with_stage(stage)
                .with_partitioner(PartitionerKind::Flat)
                .with_bucket_bytes(64)
                .with_trainability_check(false);
            // SGD with momentum and weight decay: a zero gradient would
            // still move the parameter.
            let decay: Hyperparams = common::weight_decay(0.1);
            let params_of_rank = run(world, |comm| {
                let rank = comm.rank();
                let mut opt = make_opt(Opt::Sgd, false);
                opt.set_hyperparams(0, &decay)?;
                let mut e = engine(comm, &model, opt, config.clone())?;
                let mut params = model.init();
                let mut frozen_at = None;
                for s in 0..steps {
                    let g = model.grads(&params, rank, s);
                    let slots: Vec<Option<HostGrad<'_, f64>>> = g
                        .iter()
                        .enumerate()
                        .map(|(i, g)| has_grad(i, s).then_some(g.into()))
                        .collect();
                    e.step(&slots, &mut params)?;
                    if s == 1 {
                        frozen_at = Some(params[1].clone());
                    }
                }
                assert_eq!(
                    Some(&params[1]),
                    frozen_at.as_ref(),
                    "stage {stage:?} world {world}: a parameter without gradients moved"
                );
                Ok(params)
            });
            let mut opt = make_opt(Opt::Sgd, false);
            opt.set_hyperparams(0, &decay).unwrap();
            let mut reference = Reference::new(&model, opt);
            for s in 0..steps {
                let g: Vec<Option<Vec<f64>>> = mean(&reference.rank_grads(&model, world, s))
                    .into_iter()
                    .enumerate()
                    .map(|(i, g)| has_grad(i, s).then_some(g))
                    .collect();
                reference.step(&g);
            }
            for params in &params_of_rank {
                assert_close(
                    params,
                    &reference.params,
                    1e-12,
                    &format!("stage {stage:?} world {world}"),
                );
            }
        }
    }
}

#[test]
fn an_added_group_takes_the_constructor_values_not_the_scheduled_ones() {
    let model = Synthetic::medium();
    let lrs = run(2, |comm| {
        // make_opt's SGD is built with lr 0.05.
        let mut e = engine(
            comm,
            &model,
            make_opt(Opt::Sgd, false),
            EngineConfig::default(),
        )?;
        e.set_learning_rate(0.01);
        let group = e.add_param_group(&["a.bias"], &Hyperparams::new())?;
        Ok((
            e.optimizer().unwrap().learning_rate(0),
            e.optimizer().unwrap().learning_rate(group),
        ))
    });
    for (lr0, lr1) in lrs {
        assert_eq!(lr0, 0.01);
        assert_eq!(
            lr1, 0.05,
            "torch.optim's add_param_group takes the defaults"
        );
    }
}

#[test]
fn a_non_finite_norm_under_clipping_refuses_the_step_on_every_rank() {
    let model = Synthetic::medium();
    for stage in STAGES {
        for norm_type in [NormType::L2, NormType::Inf, NormType::L1] {
            for bad in [f64::NAN, f64::INFINITY] {
                let config = EngineConfig::default()
                    .with_stage(stage)
                    .with_bucket_bytes(64)
                    .with_clip(1.0, norm_type);
                let outcomes = run(3, |comm| {
                    let rank = comm.rank();
                    let mut e = engine(comm, &model, make_opt(Opt::Adam, false), config.clone())?;
                    let mut params = model.init();
                    let mut outcome = Vec::new();
                    for s in 0..3 {
                        let before = params.clone();
                        let mut g = model.grads(&params, rank, s);
                        // One element on one rank at step 1.
                        if s == 1 && rank == 1 {
                            g[2][3] = bad;
                        }
                        let slots = common::slots(&g);
                        match e.step(&slots, &mut params) {
                            Ok(_) => outcome.push(None),
                            Err(Error::NonFiniteGradNorm { step, .. }) => {
                                assert_eq!(params, before, "a refused step changed parameters");
                                outcome.push(Some(step));
                            }
                            Err(other) => return Err(other),
                        }
                        assert_eq!(e.counters().micro_steps, 0);
                    }
                    assert!(params.iter().flatten().all(|x| x.is_finite()));
                    Ok((outcome, params, e.steps()))
                });
                let what = format!("stage {stage:?} {norm_type:?} {bad}");
                for (outcome, params, steps) in &outcomes {
                    assert_eq!(outcome, &[None, Some(2), None], "{what}");
                    assert_eq!(*steps, 2, "{what}: refused steps are not counted");
                    assert_eq!(params, &outcomes[0].1, "{what}: replicas differ");
                }
            }
        }
    }
}

#[test]
fn a_gradient_on_some_ranks_only_is_stepped_with_the_check_on() {
    let model = Synthetic::medium();
    let steps = 3;
    // Parameter 1 has a gradient on rank 0 only; the others on every rank.
    let present = |param: usize, rank: usize| param != 1 || rank == 0;
    for stage in STAGES {
        let world = 3;
        let config = EngineConfig::default()
            .with_stage(stage)
            .with_bucket_bytes(64);
        let params_of_rank = run(world, |comm| {
            let rank = comm.rank();
            let mut e = engine(comm, &model, make_opt(Opt::Adam, false), config.clone())?;
            let mut params = model.init();
            for s in 0..steps {
                let g = model.grads(&params, rank, s);
                let slots: Vec<Option<HostGrad<'_, f64>>> = g
                    .iter()
                    .enumerate()
                    .map(|(i, g)| present(i, rank).then_some(g.into()))
                    .collect();
                e.step(&slots, &mut params)?;
            }
            Ok(params)
        });
        // DDP-ref: the absent ranks contribute zeros to the mean.
        let mut reference = Reference::new(&model, make_opt(Opt::Adam, false));
        for s in 0..steps {
            let mut per_rank = reference.rank_grads(&model, world, s);
            for (rank, grads) in per_rank.iter_mut().enumerate() {
                if !present(1, rank) {
                    grads[1].iter_mut().for_each(|x| *x = 0.0);
                }
            }
            let g: Vec<Option<Vec<f64>>> = mean(&per_rank).into_iter().map(Some).collect();
            reference.step(&g);
        }
        for params in &params_of_rank {
            assert_close(
                params,
                &reference.params,
                1e-12,
                &format!("stage {stage:?}"),
            );
        }
    }
}

#[test]
fn gradients_handed_over_one_by_one_equal_passing_them_to_step() {
    let model = Synthetic::medium();
    for stage in STAGES {
        for accum in [1, 2] {
            let config = EngineConfig::default()
                .with_stage(stage)
                .with_bucket_bytes(64)
                .with_grad_accum_steps(accum)
                .with_clip(5.0, NormType::L2);
            let outcomes = run(3, |comm| {
                let rank = comm.rank();
                let split = comm.split(&[0, 1, 2])?.expect("every rank is a member");
                let mut whole = engine(comm, &model, make_opt(Opt::Adam, false), config.clone())?;
                let mut handed = engine(split, &model, make_opt(Opt::Adam, false), config.clone())?;
                let (mut a, mut b) = (model.init(), model.init());
                for s in 0..3 * accum {
                    let g = model.grads(&a, rank, s);
                    whole.step(&common::slots(&g), &mut a)?;
                    // In reverse order, as backward produces them; parameter
                    // 2 in two halves (a weight used twice); parameter 1
                    // through `step` as usual.
                    let mut slots: Vec<Option<HostGrad<'_, f64>>> = vec![None; g.len()];
                    let halves: Vec<f64> = g[2].iter().map(|x| x / 2.0).collect();
                    for i in (0..g.len()).rev() {
                        match i {
                            1 => slots[1] = Some((&g[1]).into()),
                            2 => {
                                handed.accumulate_param(2, .., (&halves).into())?;
                                handed.accumulate_param(2, .., (&halves).into())?;
                            }
                            _ => handed.accumulate_param(i, .., (&g[i]).into())?,
                        }
                    }
                    handed.step(&slots, &mut b)?;
                }
                assert_eq!(handed.counters().micro_steps, 0);
                Ok((a, b))
            });
            for (a, b) in outcomes {
                assert_eq!(
                    a, b,
                    "stage {stage:?}, {accum} micro-step(s): not bitwise equal"
                );
            }
        }
    }
}

#[test]
fn a_checkpoint_with_gradients_handed_over_but_not_stepped_is_refused() {
    let model = Synthetic::medium();
    let dir = tempfile::tempdir().unwrap();
    run(2, |comm| {
        let mut e = engine(
            comm,
            &model,
            make_opt(Opt::Sgd, false),
            EngineConfig::default(),
        )?;
        let mut params = model.init();
        let g = model.grads(&params, 0, 0);
        e.accumulate_param(0, .., (&g[0]).into())?;
        let err = e
            .save_checkpoint(dir.path(), &mut params, &zero_core::SaveOptions::default())
            .expect_err("pending gradients are not part of a checkpoint");
        assert!(
            err.to_string().contains("finish the optimizer step"),
            "{err}"
        );
        e.discard_window();
        e.save_checkpoint(dir.path(), &mut params, &zero_core::SaveOptions::default())?;
        Ok(())
    });
}

#[test]
fn a_bucket_holds_bucket_bytes_whatever_the_world_size() {
    // 128 f64 elements per bucket, all ranks together: a rank's bucket
    // buffers (what one collective moves) must not grow with the world.
    // (128 / 4 is still a whole number of the flat partitioner's 32-element
    // alignment, below which a segment does not go.)
    let model = Synthetic::medium();
    let numel: usize = model.infos().iter().map(|p| p.numel()).sum();
    for world in [1, 2, 4] {
        for stage in [Stage::Ddp, Stage::OptimizerState, Stage::Gradients] {
            let config = EngineConfig::default()
                .with_stage(stage)
                .with_bucket_bytes(128 * 8);
            let lengths = run(world, |comm| {
                let e = engine(comm, &model, make_opt(Opt::Adam, false), config.clone())?;
                let layout = e.sharding().layout();
                Ok((0..layout.buckets.len())
                    .map(|k| layout.bucket_range(k).len())
                    .collect::<Vec<_>>())
            });
            let lengths = &lengths[0];
            let longest = lengths.iter().copied().max().unwrap_or(0);
            assert!(
                longest <= 128,
                "world {world}, {stage:?}: a bucket of {longest}"
            );
            // Not cut finer than needed either: the model fills its buckets.
            assert!(
                lengths.len() <= numel.div_ceil(128) + 1,
                "world {world}, {stage:?}: {} buckets for {numel} elements",
                lengths.len()
            );
        }
    }
}
