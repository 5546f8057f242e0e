//! Parameter groups and learning-rate schedules against DDP-ref.

mod common;

use common::{engine, mean, run, slots, weight_decay, Mlp, Model, Reference};
use zero_core::engine::{EngineConfig, PartitionerKind, Stage};
use zero_core::optim::{AdamW, AdamWConfig};
use zero_core::{Communicator, FunctionalOptimizer};

fn adamw_no_decay() -> Box<dyn FunctionalOptimizer<f64>> {
    Box::new(
        AdamW::<f64>::new(AdamWConfig::default().with_lr(0.01).with_weight_decay(0.0)).unwrap(),
    )
}

fn bias_names(model: &dyn Model) -> Vec<String> {
    model
        .infos()
        .into_iter()
        .map(|p| p.name)
        .filter(|n| n.ends_with(".bias"))
        .collect()
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum When {
    UpFront,
    AfterConstruction,
    /// Before step `n`: the biases switch group with their state kept.
    BeforeStep(usize),
}

/// MLP 5 -> 10 -> 10 -> 5 with AdamW: weight decay 0 on weights and 0.01 on
/// biases, the bias group given at `when`, compared with plain AdamW.
fn check_groups(when: When, stage: Stage, partitioner: PartitionerKind, world: usize) {
    let model = Mlp::new(&[5, 10, 10, 5]);
    let biases = bias_names(&model);
    let steps = 8;
    let mut config = EngineConfig::default()
        .with_stage(stage)
        .with_partitioner(partitioner)
        .with_bucket_bytes(8);
    if when == When::UpFront {
        config = config.with_param_group(biases.clone(), weight_decay(0.01));
    }
    let trajectories = run(world, |comm| {
        let rank = comm.rank();
        let mut e = engine(comm, &model, adamw_no_decay(), config.clone())?;
        let names: Vec<&str> = biases.iter().map(String::as_str).collect();
        if when == When::AfterConstruction {
            assert_eq!(e.add_param_group(&names, &weight_decay(0.01))?, 1);
        }
        let mut params = model.init();
        let mut out = Vec::new();
        for s in 0..steps {
            if when == When::BeforeStep(s) {
                e.add_param_group(&names, &weight_decay(0.01))?;
            }
            let g = model.grads(&params, rank, s);
            e.step(&slots(&g), &mut params)?;
            out.push(params.clone());
        }
        let bias = e.params().index(&biases[0]).unwrap();
        assert_eq!(e.params().groups()[bias], 1);
        assert_eq!(e.optimizer().unwrap().num_groups(), 2);
        Ok(out)
    });

    let mut reference = Reference::new(&model, adamw_no_decay());
    let add_group = |reference: &mut Reference| {
        let group = reference.opt.add_group(&weight_decay(0.01)).unwrap();
        for (p, g) in reference.infos.iter().zip(reference.groups.iter_mut()) {
            if p.name.ends_with(".bias") {
                *g = group;
            }
        }
    };
    if matches!(when, When::UpFront | When::AfterConstruction) {
        add_group(&mut reference);
    }
    for s in 0..steps {
        if when == When::BeforeStep(s) {
            add_group(&mut reference);
        }
        let g = mean(&reference.rank_grads(&model, world, s));
        reference.step(&g.into_iter().map(Some).collect::<Vec<_>>());
        for (rank, t) in trajectories.iter().enumerate() {
            assert_eq!(
                t[s], reference.params,
                "{when:?} {stage:?} {partitioner:?} world {world} step {s} rank {rank}"
            );
        }
    }
}

#[test]
fn groups_up_front_match_plain_adamw() {
    check_groups(
        When::UpFront,
        Stage::OptimizerState,
        PartitionerKind::Flat,
        3,
    );
    check_groups(When::UpFront, Stage::Gradients, PartitionerKind::Greedy, 4);
    check_groups(When::UpFront, Stage::Ddp, PartitionerKind::Flat, 2);
}

#[test]
fn groups_added_later_match_plain_adamw() {
    check_groups(
        When::AfterConstruction,
        Stage::Gradients,
        PartitionerKind::Flat,
        3,
    );
    check_groups(
        When::AfterConstruction,
        Stage::OptimizerState,
        PartitionerKind::Greedy,
        2,
    );
    check_groups(
        When::BeforeStep(3),
        Stage::Gradients,
        PartitionerKind::Flat,
        4,
    );
    check_groups(When::BeforeStep(3), Stage::Ddp, PartitionerKind::Greedy, 3);
}

#[test]
fn groups_differ_from_a_single_group() {
    // Guard against a vacuous comparison: the bias decay must matter.
    let model = Mlp::new(&[5, 10, 10, 5]);
    let run_with = |groups: bool| {
        let mut config = EngineConfig::default().with_stage(Stage::Gradients);
        if groups {
            config = config.with_param_group(bias_names(&model), weight_decay(0.5));
        }
        run(2, |comm| {
            let rank = comm.rank();
            let mut e = engine(comm, &model, adamw_no_decay(), config.clone())?;
            let mut params = model.init();
            for s in 0..3 {
                let g = model.grads(&params, rank, s);
                e.step(&slots(&g), &mut params)?;
            }
            Ok(params)
        })
        .remove(0)
    };
    assert_ne!(run_with(true), run_with(false));
}

#[test]
fn step_decay_schedule_matches_reference_exactly() {
    let model = Mlp::new(&[5, 10, 10, 5]);
    let biases = bias_names(&model);
    let lr_at = |s: usize| 0.01 * 0.5f64.powi((s / 2) as i32);
    let world = 3;
    for stage in [Stage::Ddp, Stage::OptimizerState, Stage::Gradients] {
        let config = EngineConfig::default()
            .with_stage(stage)
            .with_bucket_bytes(8)
            .with_param_group(biases.clone(), weight_decay(0.01));
        let trajectories = run(world, |comm| {
            let rank = comm.rank();
            let mut e = engine(comm, &model, adamw_no_decay(), config.clone())?;
            let mut params = model.init();
            let mut out = Vec::new();
            for s in 0..5 {
                e.set_learning_rate(lr_at(s));
                assert_eq!(e.learning_rate(), lr_at(s));
                assert_eq!(e.optimizer().unwrap().learning_rate(1), lr_at(s));
                let g = model.grads(&params, rank, s);
                e.step(&slots(&g), &mut params)?;
                out.push(params.clone());
            }
            Ok(out)
        });
        let mut reference = Reference::new(&model, adamw_no_decay());
        let group = reference.opt.add_group(&weight_decay(0.01)).unwrap();
        for (p, g) in reference.infos.iter().zip(reference.groups.iter_mut()) {
            if p.name.ends_with(".bias") {
                *g = group;
            }
        }
        for s in 0..5 {
            for g in 0..reference.opt.num_groups() {
                reference.opt.set_learning_rate(g, lr_at(s));
            }
            let g = mean(&reference.rank_grads(&model, world, s));
            reference.step(&g.into_iter().map(Some).collect::<Vec<_>>());
            for t in &trajectories {
                assert_eq!(t[s], reference.params, "{stage:?} step {s}");
            }
        }
    }
}
