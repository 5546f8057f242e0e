//! A user-written optimizer (Lion, Chen et al. 2023) built on the public
//! `zero_core::optim` API alone (`SimpleOptimizer`), checked against a
//! hand-computed update; its groups, hyperparameters and state behave as
//! the built-ins' do.

mod common;

use common::lion::{lion, LionConfig};
use serde::{Deserialize, Serialize};
use zero_core::optim::{
    FunctionalOptimizer, Hyperparams, ParamKey, ParamMut, Simple, SimpleOptimizer,
};

fn hyper(json: serde_json::Value) -> Hyperparams {
    json.as_object().expect("an object").clone()
}

fn step(opt: &mut dyn FunctionalOptimizer<f64>, p: &mut [f64], g: Option<&[f64]>) {
    let key = ParamKey::new("w", 0, 0);
    opt.step(&mut [ParamMut { key: &key, data: p }], &[g])
        .expect("step");
}

#[test]
fn lion_matches_a_hand_computation_and_leaves_zero_and_absent_gradients_alone() {
    let mut opt = lion(0.1, (0.9, 0.99), 0.5);
    let mut p = vec![1.0, -2.0, 0.5];
    // Step 1: m = 0, so the update is -lr sign(g) after decay 1 - 0.05; a
    // zero gradient has sign 0 (torch's), so only the decay moves it.
    step(&mut opt, &mut p, Some(&[0.2, 0.3, 0.0]));
    assert_eq!(p, vec![0.95 - 0.1, -1.9 - 0.1, 0.475]);
    // m = 0.01 g = [0.002, 0.003, 0]; step 2 with g = [-0.01, -0.1, 1]:
    // c = 0.9 m + 0.1 g = [0.0008, -0.0073, 0.1] -> signs [+, -, +].
    step(&mut opt, &mut p, Some(&[-0.01, -0.1, 1.0]));
    let want = [0.85 * 0.95 - 0.1, -2.0 * 0.95 + 0.1, 0.475 * 0.95 - 0.1];
    for (got, want) in p.iter().zip(want) {
        assert!((got - want).abs() < 1e-15, "{got} vs {want}");
    }
    let before = p.clone();
    step(&mut opt, &mut p, None);
    assert_eq!(p, before, "no gradient: nothing moves");
    let state = opt.export_state();
    let piece = &state.params[&("w".to_string(), 0)];
    assert!((piece.tensors["exp_avg"][2] - 0.01).abs() < 1e-15);
    assert_eq!(piece.scalars["step"], 2.0, "None did not count as a step");
}

#[test]
fn groups_added_by_name_take_the_constructors_values_not_group_zeros() {
    let mut opt = lion(0.1, (0.9, 0.99), 0.5);
    // A scheduler moves group 0 away from the constructor's values.
    opt.set_hyperparams(0, &hyper(serde_json::json!({ "betas": [0.5, 0.5] })))
        .expect("set");
    opt.set_learning_rate(0, 0.3);
    assert_eq!(opt.learning_rate(0), 0.3);
    assert_eq!(opt.hyperparams(0)["betas"], serde_json::json!([0.5, 0.5]));
    let g = opt
        .add_group(&hyper(serde_json::json!({ "weight_decay": 0.0 })))
        .expect("added");
    assert_eq!(g, 1);
    assert_eq!(
        opt.hyperparams(1),
        hyper(serde_json::json!({ "lr": 0.1, "betas": [0.9, 0.99], "weight_decay": 0.0 }))
    );
    // PyTorch's extra keys are accepted; unknown and malformed ones are not.
    opt.add_group(&hyper(serde_json::json!({ "params": [], "foreach": null })))
        .expect("torch's bookkeeping keys");
    let err = opt
        .add_group(&hyper(serde_json::json!({ "momentum": 0.9 })))
        .expect_err("unknown")
        .to_string();
    assert!(err.contains("lion") && err.contains("momentum"), "{err}");
    let err = opt
        .set_hyperparams(0, &hyper(serde_json::json!({ "betas": 0.9 })))
        .expect_err("malformed")
        .to_string();
    assert!(err.contains("betas"), "{err}");
    let err = opt
        .add_group(&hyper(serde_json::json!({ "lr": -1.0 })))
        .expect_err("negative")
        .to_string();
    assert!(err.contains("learning rate"), "{err}");
    // Weight decay set by name takes effect: group 1 has none.
    let key = ParamKey::new("v", 0, 1);
    let mut p = vec![2.0];
    opt.step(
        &mut [ParamMut {
            key: &key,
            data: &mut p,
        }],
        &[Some(&[1.0][..])],
    )
    .expect("step");
    assert_eq!(p, vec![2.0 - 0.1]);
}

#[test]
fn state_round_trips_and_foreign_state_is_refused_naming_the_entry() {
    let mut opt = lion(0.1, (0.9, 0.99), 0.0);
    let mut p = vec![1.0, 2.0];
    step(&mut opt, &mut p, Some(&[0.5, -0.5]));
    let state = opt.export_state();
    let mut fresh = lion(0.1, (0.9, 0.99), 0.0);
    fresh.import_state(state.clone()).expect("import");
    assert_eq!(fresh.export_state(), state);
    assert_eq!(
        fresh.state_bytes(),
        2 * std::mem::size_of::<f64>() + std::mem::size_of::<f64>()
    );
    // The same next step from the imported state.
    let (mut a, mut b) = (p.clone(), p.clone());
    step(&mut opt, &mut a, Some(&[0.1, 0.1]));
    step(&mut fresh, &mut b, Some(&[0.1, 0.1]));
    assert_eq!(a, b);

    let mut missing = state.clone();
    let piece = missing.params.values_mut().next().expect("a piece");
    piece.tensors.clear();
    let err = lion(0.1, (0.9, 0.99), 0.0)
        .import_state(missing)
        .expect_err("no exp_avg")
        .to_string();
    assert!(err.contains("exp_avg"), "{err}");
    let mut extra = state;
    let piece = extra.params.values_mut().next().expect("a piece");
    piece.tensors.insert("momentum_buffer".into(), vec![0.0; 2]);
    let err = lion(0.1, (0.9, 0.99), 0.0)
        .import_state(extra)
        .expect_err("foreign")
        .to_string();
    assert!(err.contains("momentum_buffer"), "{err}");
}

#[test]
fn a_config_without_a_learning_rate_is_refused_at_construction() {
    #[derive(Clone, Serialize, Deserialize)]
    struct NoLr {
        step_size: f64,
    }
    struct Plain;
    impl SimpleOptimizer<f32> for Plain {
        type Config = NoLr;
        const KIND: &'static str = "plain";
        const STATE: &'static [&'static str] = &[];
        fn update(c: &NoLr, _: u64, p: &mut [f32], g: &[f32], _: &mut [Vec<f32>]) {
            for (p, g) in p.iter_mut().zip(g) {
                *p -= c.step_size as f32 * g;
            }
        }
    }
    let err = Simple::<Plain, f32>::new(NoLr { step_size: 0.1 })
        .err()
        .expect("refused")
        .to_string();
    assert!(err.contains("plain") && err.contains("`lr`"), "{err}");
}

#[test]
fn a_custom_optimizer_may_not_take_a_built_ins_name() {
    struct NotAdam;
    impl SimpleOptimizer<f64> for NotAdam {
        type Config = LionConfig;
        const KIND: &'static str = "adam";
        const STATE: &'static [&'static str] = &[];
        fn update(_: &LionConfig, _: u64, _: &mut [f64], _: &[f64], _: &mut [Vec<f64>]) {}
    }
    let config = LionConfig {
        lr: 0.1,
        betas: (0.9, 0.99),
        weight_decay: 0.0,
    };
    let err = Simple::<NotAdam, f64>::new(config)
        .err()
        .expect("refused")
        .to_string();
    assert!(
        err.contains("\"adam\"") && err.contains("built-in"),
        "{err}"
    );
}
