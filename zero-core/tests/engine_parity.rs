//! Parity of the engine (stages 0-2, both partitioners, several bucket
//! sizes and world sizes) with DDP-ref: the mean of the ranks' full
//! gradients stepped by an unsharded optimizer with whole-parameter keys.

mod common;

use common::{assert_close, engine, make_opt, mean, run, slots, Mlp, Model, Opt, Reference};
use zero_core::engine::{EngineConfig, PartitionerKind, Stage};

const STAGES: [Stage; 3] = [Stage::Ddp, Stage::OptimizerState, Stage::Gradients];
const PARTITIONERS: [PartitionerKind; 2] = [PartitionerKind::Flat, PartitionerKind::Greedy];
/// 8 bytes rounds up to one aligned bucket of 32 elements: parameters
/// straddle buckets and ranks.
const BUCKETS: [usize; 3] = [8, 512, 25 << 20];

/// From step 10 the first parameter is frozen on even steps.
fn first_trainable(step: usize) -> bool {
    step < 10 || (step - 10) % 2 == 1
}

struct Case {
    opt: Opt,
    maximize: bool,
    stage: Stage,
    partitioner: PartitionerKind,
    bucket_bytes: usize,
    world: usize,
}

/// Runs `case` for `steps` steps and checks every rank's parameters against
/// DDP-ref after every step. Returns the largest difference seen.
fn check_parity(model: &dyn Model, case: &Case, steps: usize) -> f64 {
    let first = model.infos()[0].name.clone();
    let config = EngineConfig::default()
        .with_stage(case.stage)
        .with_partitioner(case.partitioner)
        .with_bucket_bytes(case.bucket_bytes);
    let trajectories = run(case.world, |comm| {
        let rank = zero_core::Communicator::rank(&comm);
        let mut e = engine(
            comm,
            model,
            make_opt(case.opt, case.maximize),
            config.clone(),
        )?;
        let mut params = model.init();
        let mut out = Vec::new();
        for s in 0..steps {
            e.set_trainable(&first, first_trainable(s))?;
            let g = model.grads(&params, rank, s);
            let report = e.step(&slots(&g), &mut params)?;
            assert_eq!(report.map(|r| r.micro_steps), Some(1));
            out.push(params.clone());
        }
        assert_eq!(e.steps(), steps as u64);
        Ok(out)
    });
    let mut reference = Reference::new(model, make_opt(case.opt, case.maximize));
    let mut worst = 0.0f64;
    for s in 0..steps {
        let g = mean(&reference.rank_grads(model, case.world, s));
        let g: Vec<Option<Vec<f64>>> = g
            .into_iter()
            .enumerate()
            .map(|(i, g)| (i != 0 || first_trainable(s)).then_some(g))
            .collect();
        reference.step(&g);
        for (rank, t) in trajectories.iter().enumerate() {
            assert_eq!(t[s], trajectories[0][s], "rank {rank} differs from rank 0");
            let what = format!(
                "{:?} maximize={} {:?} {:?} bucket={} world={} step {s} rank {rank}",
                case.opt,
                case.maximize,
                case.stage,
                case.partitioner,
                case.bucket_bytes,
                case.world
            );
            assert_close(&t[s], &reference.params, 1e-9, &what);
            for (x, y) in t[s].iter().flatten().zip(reference.params.iter().flatten()) {
                worst = worst.max((x - y).abs());
            }
        }
    }
    worst
}

fn cases() -> Vec<Case> {
    let mut out = Vec::new();
    for opt in [Opt::Sgd, Opt::Adam, Opt::AdamW] {
        for maximize in [false, true] {
            for stage in STAGES {
                for partitioner in PARTITIONERS {
                    let i = out.len();
                    out.push(Case {
                        opt,
                        maximize,
                        stage,
                        partitioner,
                        bucket_bytes: BUCKETS[i % BUCKETS.len()],
                        world: 1 + i % 5,
                    });
                }
            }
        }
    }
    out
}

#[test]
fn mlp_matches_ddp_reference() {
    // 2 -> 16 -> 16 -> 3: 371 elements, several 32-element buckets per rank.
    let model = Mlp::new(&[2, 16, 16, 3]);
    let mut worst = 0.0f64;
    for case in cases() {
        worst = worst.max(check_parity(&model, &case, 20));
    }
    // The reduction order matches the reference's (rank order, then divide),
    // and the optimizers are element-wise, so the results are bitwise equal.
    assert_eq!(worst, 0.0, "expected bitwise parity with DDP-ref");
}

#[test]
fn synthetic_matches_ddp_reference_all_world_sizes() {
    // Every world size with every stage and partitioner, tiny buckets.
    let model = common::Synthetic::medium();
    for world in 1..=5 {
        for stage in STAGES {
            for partitioner in PARTITIONERS {
                let case = Case {
                    opt: Opt::Adam,
                    maximize: world % 2 == 0,
                    stage,
                    partitioner,
                    bucket_bytes: 8,
                    world,
                };
                check_parity(&model, &case, 12);
            }
        }
    }
}

#[test]
fn stages_agree_with_one_process_on_the_global_batch() {
    let world = 3;
    let steps = 6;
    let model = Mlp::new(&[2, 16, 16, 3]);
    // One process on the global batch: the concatenation of the ranks'
    // batches (the loss is a batch mean, so its gradient is the mean).
    let global = Mlp {
        batch: model.batch * world,
        ..Mlp::new(&model.dims)
    };
    let single = run(1, |comm| {
        let mut e = engine(
            comm,
            &model,
            make_opt(Opt::Adam, false),
            EngineConfig::default().with_stage(Stage::Ddp),
        )?;
        let mut params = model.init();
        let mut out = Vec::new();
        for s in 0..steps {
            let x: Vec<f64> = (0..world).flat_map(|r| model.data(r, s)).collect();
            let g = global.loss_and_grads(&params, &x).1;
            e.step(&slots(&g), &mut params)?;
            out.push(params.clone());
        }
        Ok(out)
    })
    .remove(0);
    let mut per_stage = Vec::new();
    for stage in STAGES {
        let t = run(world, |comm| {
            let rank = zero_core::Communicator::rank(&comm);
            let mut e = engine(
                comm,
                &model,
                make_opt(Opt::Adam, false),
                EngineConfig::default()
                    .with_stage(stage)
                    .with_bucket_bytes(8),
            )?;
            let mut params = model.init();
            let mut out = Vec::new();
            for s in 0..steps {
                let g = model.grads(&params, rank, s);
                e.step(&slots(&g), &mut params)?;
                out.push(params.clone());
            }
            Ok(out)
        })
        .remove(0);
        for s in 0..steps {
            assert_close(
                &t[s],
                &single[s],
                1e-9,
                &format!("{stage:?} vs one process, step {s}"),
            );
        }
        per_stage.push(t);
    }
    // The stages reduce in the same order: identical results.
    assert_eq!(per_stage[0], per_stage[1]);
    assert_eq!(per_stage[1], per_stage[2]);
}
