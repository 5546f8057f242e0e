//! Gradient accumulation (configured and manual) and optimizer step counts.

mod common;

use common::{
    assert_close, assert_trajectories, engine, make_opt, reference_trajectory, run, slots, Model,
    Opt, Synthetic,
};
use zero_core::engine::{EngineConfig, PartitionerKind, Stage};
use zero_core::Communicator;

const STAGES: [Stage; 3] = [Stage::Ddp, Stage::OptimizerState, Stage::Gradients];

#[test]
fn three_micro_batches_equal_one_large_batch() {
    let model = Synthetic::medium();
    let (world, micro, steps) = (3, 3, 4);
    for opt in [Opt::Sgd, Opt::Adam] {
        let expected = reference_trajectory(&model, opt, world, micro, steps);
        for stage in STAGES {
            for partitioner in [PartitionerKind::Flat, PartitionerKind::Greedy] {
                let config = EngineConfig::default()
                    .with_stage(stage)
                    .with_partitioner(partitioner)
                    .with_bucket_bytes(8)
                    .with_grad_accum_steps(micro);
                let trajectories = run(world, |comm| {
                    let rank = comm.rank();
                    let mut e = engine(comm, &model, make_opt(opt, false), config.clone())?;
                    let mut params = model.init();
                    let mut out = Vec::new();
                    for s in 0..steps {
                        for m in 0..micro {
                            let g = model.grads(&params, rank, s * micro + m);
                            let report = e.step(&slots(&g), &mut params)?;
                            if m + 1 < micro {
                                assert!(report.is_none(), "stepped early at micro-step {m}");
                                assert_eq!(e.counters().micro_steps, m + 1);
                                // Stage 2 holds a full gradient buffer only
                                // inside the accumulation window.
                                assert!(e.memory_report().grads > 0);
                            } else {
                                assert_eq!(report.map(|r| r.micro_steps), Some(micro));
                                assert_eq!(e.counters().micro_steps, 0);
                                let grads = e.memory_report().grads;
                                if stage == Stage::Gradients {
                                    assert_eq!(grads, 0, "stage 2 kept its gradient buffer");
                                } else {
                                    assert!(grads > 0);
                                }
                            }
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
                    &format!("{opt:?} {stage:?} {partitioner:?}"),
                );
            }
        }
    }
}

#[test]
fn manual_accumulation_matches() {
    let model = Synthetic::medium();
    let (world, steps) = (2, 3);
    for stage in STAGES {
        // accumulate x2 + step_accumulated: two micro-batches per step.
        let two = run(world, |comm| {
            let rank = comm.rank();
            let config = EngineConfig::default()
                .with_stage(stage)
                .with_bucket_bytes(8);
            let mut e = engine(comm, &model, make_opt(Opt::Adam, false), config)?;
            let mut params = model.init();
            let mut out = Vec::new();
            for s in 0..steps {
                for m in 0..2 {
                    let g = model.grads(&params, rank, s * 2 + m);
                    e.accumulate(&slots(&g))?;
                    assert!(e.memory_report().grads > 0);
                }
                let report = e.step_accumulated(&mut params)?;
                assert_eq!(report.micro_steps, 2);
                if stage == Stage::Gradients {
                    assert_eq!(e.memory_report().grads, 0);
                }
                out.push(params.clone());
            }
            // Nothing accumulated: an error, not a silent no-op step.
            assert!(matches!(
                e.step_accumulated(&mut params),
                Err(zero_core::Error::State(_))
            ));
            Ok(out)
        });
        let expected = reference_trajectory(&model, Opt::Adam, world, 2, steps);
        for t in &two {
            for s in 0..steps {
                assert_close(&t[s], &expected[s], 1e-9, &format!("{stage:?} x2 step {s}"));
            }
        }

        // accumulate x2 + step (grad_accum_steps = 1): three micro-batches.
        let three = run(world, |comm| {
            let rank = comm.rank();
            let config = EngineConfig::default()
                .with_stage(stage)
                .with_bucket_bytes(8);
            let mut e = engine(comm, &model, make_opt(Opt::Adam, false), config)?;
            let mut params = model.init();
            let mut out = Vec::new();
            for s in 0..steps {
                for m in 0..2 {
                    let g = model.grads(&params, rank, s * 3 + m);
                    e.accumulate(&slots(&g))?;
                }
                let g = model.grads(&params, rank, s * 3 + 2);
                let report = e.step(&slots(&g), &mut params)?;
                assert_eq!(report.map(|r| r.micro_steps), Some(3));
                out.push(params.clone());
            }
            Ok(out)
        });
        let expected = reference_trajectory(&model, Opt::Adam, world, 3, steps);
        for t in &three {
            for s in 0..steps {
                assert_close(&t[s], &expected[s], 1e-9, &format!("{stage:?} x3 step {s}"));
            }
        }
    }
}

#[test]
fn adam_step_count_equals_applied_steps() {
    let model = Synthetic::medium();
    let infos = model.infos();
    let frozen = infos[0].name.clone();
    // Skipped by every rank (no gradient anywhere) at step 3.
    let absent = infos[2].name.clone();
    let (world, micro, steps) = (3, 2, 6);
    for stage in STAGES {
        let config = EngineConfig::default()
            .with_stage(stage)
            .with_bucket_bytes(8)
            .with_grad_accum_steps(micro);
        let counts = run(world, |comm| {
            let rank = comm.rank();
            let mut e = engine(comm, &model, make_opt(Opt::Adam, false), config.clone())?;
            let mut params = model.init();
            for s in 0..steps {
                // Frozen for optimizer steps 1 and 2, changed mid-window.
                for m in 0..micro {
                    if m == 1 {
                        e.set_trainable(&frozen, !(1..=2).contains(&s))?;
                    }
                    let g = model.grads(&params, rank, s * micro + m);
                    let mut slots = slots(&g);
                    if s == 3 {
                        slots[2] = None;
                    }
                    e.step(&slots, &mut params)?;
                }
            }
            assert_eq!(e.steps(), steps as u64);
            let state = e.optimizer().unwrap().export_state();
            Ok(state
                .params
                .iter()
                .map(|((name, offset), st)| (name.clone(), *offset, st.scalars["step"]))
                .collect::<Vec<_>>())
        });
        let mut seen = std::collections::BTreeSet::new();
        for (rank, pieces) in counts.iter().enumerate() {
            for (name, offset, step) in pieces {
                let expected = if *name == frozen {
                    steps - 2
                } else if *name == absent {
                    steps - 1
                } else {
                    steps
                };
                assert_eq!(
                    *step, expected as f64,
                    "{stage:?} rank {rank} {name}@{offset}"
                );
                seen.insert(name.clone());
            }
        }
        assert_eq!(
            seen.len(),
            infos.len(),
            "{stage:?}: some parameter has no state"
        );
    }
}
