//! Global gradient norms over shards and torch-style clipping.

mod common;

use common::{assert_close, engine, make_opt, mean, run, slots, Model, Opt, Reference, Synthetic};
use zero_core::engine::{EngineConfig, NormType, PartitionerKind, Stage};
use zero_core::Communicator;

fn norm(grads: &[Option<Vec<f64>>], norm_type: NormType) -> f64 {
    let values = grads.iter().flatten().flatten();
    match norm_type {
        NormType::L1 => values.map(|x| x.abs()).sum(),
        NormType::L2 => values.map(|x| x * x).sum::<f64>().sqrt(),
        NormType::Inf => values.fold(0.0, |m, x| m.max(x.abs())),
    }
}

/// From step 2 the first parameter is frozen: it leaves the norm.
fn first_trainable(step: usize) -> bool {
    step < 2
}

/// Runs with clipping at `max_norm` and checks the reported norm and the
/// parameters against DDP-ref with `torch.nn.utils.clip_grad_norm_`.
fn check_clip(
    stage: Stage,
    partitioner: PartitionerKind,
    world: usize,
    norm_type: NormType,
    max_norm: f64,
) {
    let model = Synthetic::medium();
    let first = model.infos()[0].name.clone();
    let steps = 4;
    let config = EngineConfig::default()
        .with_stage(stage)
        .with_partitioner(partitioner)
        .with_bucket_bytes(8)
        .with_clip(max_norm, norm_type);
    let trajectories = run(world, |comm| {
        let rank = comm.rank();
        let mut e = engine(comm, &model, make_opt(Opt::Sgd, false), config.clone())?;
        let mut params = model.init();
        let mut out = Vec::new();
        for s in 0..steps {
            e.set_trainable(&first, first_trainable(s))?;
            let g = model.grads(&params, rank, s);
            let report = e.step(&slots(&g), &mut params)?.expect("a step");
            out.push((report.grad_norm.expect("a norm"), params.clone()));
        }
        Ok(out)
    });
    let mut reference = Reference::new(&model, make_opt(Opt::Sgd, false));
    let mut clipped_some = false;
    for s in 0..steps {
        let g: Vec<Option<Vec<f64>>> = mean(&reference.rank_grads(&model, world, s))
            .into_iter()
            .enumerate()
            .map(|(i, g)| (i != 0 || first_trainable(s)).then_some(g))
            .collect();
        let total = norm(&g, norm_type);
        let coef = (max_norm / (total + 1e-6)).min(1.0);
        clipped_some |= coef < 1.0;
        let g: Vec<Option<Vec<f64>>> = g
            .into_iter()
            .map(|g| g.map(|g| g.into_iter().map(|x| x * coef).collect()))
            .collect();
        reference.step(&g);
        let what = format!(
            "{stage:?} {partitioner:?} world {world} {norm_type:?} max {max_norm} step {s}"
        );
        for (rank, t) in trajectories.iter().enumerate() {
            let (reported, params) = &t[s];
            assert!(
                (reported - total).abs() <= 1e-9 * total.max(1.0),
                "{what} rank {rank}: norm {reported} vs {total}"
            );
            assert_close(
                params,
                &reference.params,
                1e-9,
                &format!("{what} rank {rank}"),
            );
        }
    }
    if max_norm < 1.0 {
        assert!(clipped_some, "the test never clipped");
    }
}

#[test]
fn norm_and_clipping_match_reference_for_every_norm() {
    let mut i = 0;
    for stage in [Stage::Ddp, Stage::OptimizerState, Stage::Gradients] {
        for partitioner in [PartitionerKind::Flat, PartitionerKind::Greedy] {
            for norm_type in [NormType::L1, NormType::L2, NormType::Inf] {
                let world = 1 + i % 4;
                i += 1;
                // Clipping active, and a bound never reached (norm only).
                check_clip(stage, partitioner, world, norm_type, 0.1);
                check_clip(stage, partitioner, world, norm_type, 1e9);
            }
        }
    }
}

#[test]
fn grad_norm_without_clipping_is_l2_and_leaves_the_step_alone() {
    let model = Synthetic::medium();
    let world = 3;
    for stage in [Stage::OptimizerState, Stage::Gradients] {
        let config = EngineConfig::default()
            .with_stage(stage)
            .with_grad_norm(true);
        let out = run(world, |comm| {
            let rank = comm.rank();
            let mut e = engine(comm, &model, make_opt(Opt::Adam, false), config.clone())?;
            let mut params = model.init();
            let g = model.grads(&params, rank, 0);
            let report = e.step(&slots(&g), &mut params)?.expect("a step");
            Ok((report.grad_norm.expect("a norm"), params))
        });
        let mut reference = Reference::new(&model, make_opt(Opt::Adam, false));
        let g: Vec<Option<Vec<f64>>> = mean(&reference.rank_grads(&model, world, 0))
            .into_iter()
            .map(Some)
            .collect();
        let total = norm(&g, NormType::L2);
        reference.step(&g);
        for (n, params) in &out {
            assert!((n - total).abs() <= 1e-9 * total, "{n} vs {total}");
            assert_eq!(params, &reference.params);
        }
    }
}
