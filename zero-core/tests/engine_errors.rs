//! Rank consistency, bad input, and the trainability opt-out.

mod common;

use common::{assert_close, engine, make_opt, mean, run, slots, Model, Opt, Reference, Synthetic};
use zero_core::engine::{EngineConfig, Stage};
use zero_core::optim::{Adam, AdamConfig};
use zero_core::{Communicator, DType, Engine, Error, ParamInfo, ThreadGroup};

/// Builds an engine on every rank of 3, rank 1 with `change` applied to its
/// parameters and config, and expects `RankMismatch` naming `needle` on
/// every rank.
fn expect_mismatch(
    change: impl Fn(&mut Vec<ParamInfo>, &mut EngineConfig, &mut f64) + Sync,
    needle: &str,
) {
    let model = Synthetic::medium();
    let results = ThreadGroup::new(3)
        .with_timeout(std::time::Duration::from_secs(30))
        .run(|comm| {
            let mut infos = model.infos();
            let mut config = EngineConfig::default().with_stage(Stage::Gradients);
            let mut lr = 0.01;
            if comm.rank() == 1 {
                change(&mut infos, &mut config, &mut lr);
            }
            let opt = Box::new(Adam::<f64>::new(AdamConfig::default().with_lr(lr)).unwrap());
            Engine::<f64, _>::new(comm, infos, opt, config).map(|_| ())
        });
    for (rank, r) in results.into_iter().enumerate() {
        match r.expect("no panic") {
            Err(e @ Error::RankMismatch { .. }) => {
                let msg = e.to_string();
                assert!(
                    msg.contains(needle),
                    "rank {rank}: {msg:?} does not name {needle:?}"
                );
            }
            other => panic!("rank {rank}: expected RankMismatch, got {other:?}"),
        }
    }
}

#[test]
fn rank_with_a_different_shape_name_or_config_is_named() {
    expect_mismatch(|p, _, _| p[1].shape = vec![40, 4], "[40, 4]");
    expect_mismatch(|p, _, _| p[1].shape = vec![60, 2], "[60, 2]");
    expect_mismatch(|p, _, _| p[0].name = "a.bias2".into(), "a.bias2");
    expect_mismatch(|p, _, _| p[3].trainable = false, "frozen");
    expect_mismatch(|p, _, _| p.pop().map(|_| ()).unwrap(), "parameter count");
    expect_mismatch(|_, _, lr| *lr = 0.02, "0.02");
    expect_mismatch(|_, c, _| c.stage = Stage::OptimizerState, "stage");
    expect_mismatch(|_, c, _| c.bucket_bytes = 1024, "bucket_bytes");
    expect_mismatch(|_, c, _| c.grad_accum_steps = 2, "grad_accum_steps");
    expect_mismatch(|_, c, _| c.check_trainability = false, "check_trainability");
    // Fields the check once listed by hand and missed: a rank deferring its
    // gathers trained wrong weights without a word.
    expect_mismatch(|_, c, _| c.defer_gathers = true, "defer_gathers");
    expect_mismatch(|_, c, _| c.persist_numel = 7, "persist_numel");
    expect_mismatch(|_, c, _| c.prefetch_bytes = Some(7), "prefetch_bytes");
    expect_mismatch(|_, c, _| c.gather_bytes = Some(7), "gather_bytes");
    expect_mismatch(|_, c, _| c.max_live_bytes = Some(7), "max_live_bytes");
    expect_mismatch(
        |_, c, _| {
            *c = c
                .clone()
                .with_param_group(vec!["a.bias".into()], common::weight_decay(0.1))
        },
        "parameter group 1",
    );
}

#[test]
fn rank_with_an_invalid_config_gets_rank_mismatch_everywhere() {
    // Invalid only on rank 1: every rank learns of the difference instead of
    // rank 1 failing alone and its peers waiting in the first collective.
    expect_mismatch(|_, c, _| c.bucket_bytes = 0, "bucket_bytes");
    expect_mismatch(|_, c, _| c.grad_accum_steps = 0, "grad_accum_steps");
    expect_mismatch(|p, _, _| p[2].dtype = DType::F32, "f32");
    expect_mismatch(|p, _, _| p[2].name = p[1].name.clone(), "parameter #2");
    expect_mismatch(
        |_, c, _| {
            *c = c
                .clone()
                .with_param_group(vec!["missing".into()], common::weight_decay(0.1))
        },
        "missing",
    );
}

#[test]
fn wrong_gradients_are_config_errors_naming_the_parameter() {
    let model = Synthetic::medium();
    let infos = model.infos();
    let out = run(2, |comm| {
        let rank = comm.rank();
        let config = EngineConfig::default().with_stage(Stage::Gradients);
        let mut e = engine(comm, &model, make_opt(Opt::Adam, false), config)?;
        let mut params = model.init();
        let g = model.grads(&params, rank, 0);

        let mut few = slots(&g);
        few.pop();
        let err = e.step(&few, &mut params).unwrap_err();
        assert!(matches!(err, Error::Config(_)), "{err}");
        assert!(err.to_string().contains("gradient slots"), "{err}");
        assert!(matches!(e.accumulate(&few), Err(Error::Config(_))));

        let short = g[3][1..].to_vec();
        let mut bad = slots(&g);
        bad[3] = Some((&short).into());
        for err in [
            e.step(&bad, &mut params).unwrap_err(),
            e.accumulate(&bad).unwrap_err(),
        ] {
            assert!(matches!(err, Error::Config(_)), "{err}");
            assert!(err.to_string().contains(&infos[3].name), "{err}");
        }
        assert_eq!(e.counters().micro_steps, 0);
        assert_eq!(params, model.init(), "a rejected step changed parameters");

        // Unknown names.
        assert!(matches!(
            e.set_trainable("nope", false),
            Err(Error::Config(_))
        ));
        assert!(matches!(
            e.add_param_group(&["nope"], &common::weight_decay(0.1)),
            Err(Error::Config(_))
        ));

        // The engine is still usable and in step with its peers.
        e.step(&slots(&g), &mut params)?;
        Ok(params)
    });
    let mut reference = Reference::new(&model, make_opt(Opt::Adam, false));
    let g = mean(&reference.rank_grads(&model, 2, 0));
    reference.step(&g.into_iter().map(Some).collect::<Vec<_>>());
    for p in &out {
        assert_eq!(p, &reference.params);
    }
}

#[test]
fn parameter_frozen_at_build_cannot_be_unfrozen() {
    let model = Synthetic::medium();
    run(2, |comm| {
        let mut infos = model.infos();
        infos[1].trainable = false;
        let opt = make_opt(Opt::Sgd, false);
        let mut e = Engine::<f64, _>::new(comm, infos.clone(), opt, EngineConfig::default())?;
        assert!(matches!(
            e.set_trainable(&infos[1].name, true),
            Err(Error::Config(_))
        ));
        e.set_trainable(&infos[1].name, false)?;
        Ok(())
    });
}

#[test]
fn wrong_engine_dtype_is_an_error_naming_both_dtypes() {
    let out = ThreadGroup::new(1).run(|comm| {
        let infos = vec![ParamInfo::new("w", [4], DType::F32)];
        Engine::<f64, _>::new(
            comm,
            infos,
            make_opt(Opt::Sgd, false),
            EngineConfig::default(),
        )
        .map(|_| ())
    });
    assert!(matches!(
        out[0],
        Ok(Err(Error::ParamDType {
            param: DType::F32,
            engine: DType::F64,
            ..
        }))
    ));
}

#[test]
fn trainability_opt_out_applies_at_refresh_only() {
    let model = Synthetic::medium();
    let first = model.infos()[0].name.clone();
    let world = 3;
    let steps = 8;
    // Step 2: set_trainable(false) without refresh: still trains. Step 3
    // (accumulated) trains too; the refresh after it freezes steps 4 and 5;
    // a refresh before step 6 unfreezes.
    let frozen_at = |s: usize| (4..6).contains(&s);
    for stage in [Stage::Ddp, Stage::OptimizerState, Stage::Gradients] {
        let config = EngineConfig::default()
            .with_stage(stage)
            .with_bucket_bytes(8)
            .with_trainability_check(false);
        let first_state = |opt: &dyn zero_core::FunctionalOptimizer<f64>| {
            let state = opt.export_state();
            state
                .params
                .into_iter()
                .filter(|((name, _), _)| *name == first)
                .collect::<Vec<_>>()
        };
        let out = run(world, |comm| {
            let rank = comm.rank();
            let mut e = engine(comm, &model, make_opt(Opt::Adam, false), config.clone())?;
            let mut params = model.init();
            let mut traj = Vec::new();
            let mut frozen_state = None;
            for s in 0..steps {
                if s == 2 {
                    e.set_trainable(&first, false)?;
                }
                if s == 3 {
                    // Inside accumulation: refused, nothing lost.
                    let g = model.grads(&params, rank, 100);
                    e.accumulate(&slots(&g))?;
                    let err = e.refresh_trainability().unwrap_err();
                    assert!(matches!(err, Error::State(_)), "{err}");
                    e.step_accumulated(&mut params)?;
                    traj.push(params.clone());
                    e.refresh_trainability()?;
                    assert!(!e.active_mask()[0]);
                    frozen_state = Some(first_state(e.optimizer().unwrap()));
                    continue;
                }
                if s == 6 {
                    e.set_trainable(&first, true)?;
                    e.refresh_trainability()?;
                    assert!(e.active_mask()[0]);
                    // The state was kept while frozen.
                    assert_eq!(Some(first_state(e.optimizer().unwrap())), frozen_state);
                }
                let g = model.grads(&params, rank, s);
                e.step(&slots(&g), &mut params)?;
                traj.push(params.clone());
            }
            Ok(traj)
        });
        let mut reference = Reference::new(&model, make_opt(Opt::Adam, false));
        for s in 0..steps {
            // Step 3 is the accumulated one (data index 100); it runs with
            // the first parameter still trainable.
            let g = mean(&reference.rank_grads(&model, world, if s == 3 { 100 } else { s }));
            let g: Vec<Option<Vec<f64>>> = g
                .into_iter()
                .enumerate()
                .map(|(i, g)| (i != 0 || !frozen_at(s)).then_some(g))
                .collect();
            reference.step(&g);
            for (rank, t) in out.iter().enumerate() {
                assert_close(
                    &t[s],
                    &reference.params,
                    0.0,
                    &format!("{stage:?} step {s} rank {rank}"),
                );
            }
        }
    }
}
