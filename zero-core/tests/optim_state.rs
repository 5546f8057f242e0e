//! Sharded equivalence, exact state round trips and error reporting of the
//! built-in optimizers.

use zero_core::optim::{
    Adagrad, AdagradConfig, Adam, AdamConfig, AdamW, AdamWConfig, Float, FunctionalOptimizer,
    Hyperparams, ParamKey, ParamMut, ParamState, RmsProp, RmsPropConfig, Sgd, SgdConfig,
};
use zero_core::Error;

type Factory<T> = Box<dyn Fn() -> Box<dyn FunctionalOptimizer<T>>>;

/// Every built-in, with options that use every state tensor.
fn factories<T: Float>() -> Vec<(&'static str, Factory<T>)> {
    vec![
        (
            "sgd",
            Box::new(|| Box::new(Sgd::<T>::new(SgdConfig::default().with_lr(0.1)).unwrap())),
        ),
        (
            "sgd_nesterov",
            Box::new(|| {
                let config = SgdConfig::default()
                    .with_lr(0.1)
                    .with_momentum(0.9)
                    .with_nesterov(true)
                    .with_weight_decay(0.01);
                Box::new(Sgd::<T>::new(config).unwrap())
            }),
        ),
        (
            "adam_amsgrad",
            Box::new(|| {
                let config = AdamConfig::default()
                    .with_amsgrad(true)
                    .with_weight_decay(0.1);
                Box::new(Adam::<T>::new(config).unwrap())
            }),
        ),
        (
            "adamw",
            Box::new(|| {
                Box::new(AdamW::<T>::new(AdamWConfig::default().with_maximize(true)).unwrap())
            }),
        ),
        (
            "adagrad",
            Box::new(|| {
                let config = AdagradConfig::default()
                    .with_lr_decay(0.1)
                    .with_initial_accumulator_value(0.1);
                Box::new(Adagrad::<T>::new(config).unwrap())
            }),
        ),
        (
            "rmsprop_centered_momentum",
            Box::new(|| {
                let config = RmsPropConfig::default()
                    .with_centered(true)
                    .with_momentum(0.9);
                Box::new(RmsProp::<T>::new(config).unwrap())
            }),
        ),
    ]
}

/// Deterministic values in [-1, 1).
fn values<T: Float>(seed: u64, n: usize) -> Vec<T> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            T::from_f64((x >> 11) as f64 / (1u64 << 52) as f64 - 1.0)
        })
        .collect()
}

/// Steps `param` as the pieces cut at `cuts` (offsets), `steps` times;
/// the gradient is `None` on step 2.
fn run_pieces<T: Float>(
    opt: &mut dyn FunctionalOptimizer<T>,
    param: &mut [T],
    cuts: &[usize],
    steps: std::ops::Range<u64>,
) {
    let n = param.len();
    let bounds: Vec<(usize, usize)> = cuts
        .iter()
        .zip(cuts.iter().skip(1).chain([&n]))
        .map(|(&a, &b)| (a, b))
        .collect();
    let keys: Vec<ParamKey> = cuts.iter().map(|&c| ParamKey::new("w", c, 0)).collect();
    for step in steps {
        let grad = values::<T>(step + 1, n);
        let mut rest = &mut *param;
        let mut pieces = Vec::new();
        for ((a, b), key) in bounds.iter().zip(&keys) {
            let (head, tail) = rest.split_at_mut(b - a);
            pieces.push(ParamMut { key, data: head });
            rest = tail;
        }
        let grads: Vec<Option<&[T]>> = bounds
            .iter()
            .map(|&(a, b)| (step != 2).then(|| &grad[a..b]))
            .collect();
        opt.step(&mut pieces, &grads).unwrap();
    }
}

fn bits<T: Float>(v: &[T]) -> Vec<u64> {
    v.iter().map(|x| x.to_f64().to_bits()).collect()
}

fn sharded_equals_whole<T: Float>() {
    // One length below and one above the threads' chunking threshold.
    for n in [37usize, 700_001] {
        for (name, make) in factories::<T>() {
            let init = values::<T>(99, n);
            let mut whole = init.clone();
            run_pieces(&mut *make(), &mut whole, &[0], 0..5);
            let mut split = init.clone();
            let k = n / 3 + 1;
            run_pieces(&mut *make(), &mut split, &[0, k], 0..5);
            assert!(
                bits(&whole) == bits(&split),
                "{name}, n = {n}: split differs from whole"
            );
            assert!(bits(&whole) != bits(&init), "{name}: nothing happened");
        }
    }
}

#[test]
fn sharded_pieces_step_like_the_whole_f32() {
    sharded_equals_whole::<f32>();
}

#[test]
fn sharded_pieces_step_like_the_whole_f64() {
    sharded_equals_whole::<f64>();
}

#[test]
fn state_round_trip_is_exact() {
    for (name, make) in factories::<f64>() {
        let init = values::<f64>(7, 101);
        let mut straight = init.clone();
        run_pieces(&mut *make(), &mut straight, &[0, 40], 0..6);

        let mut resumed = init.clone();
        let mut first = make();
        run_pieces(&mut *first, &mut resumed, &[0, 40], 0..3);
        let state = first.export_state();
        assert_eq!(state.params.len(), 2, "{name}");
        let mut second = make();
        second.import_state(state.clone()).unwrap();
        assert_eq!(second.export_state(), state, "{name}: export after import");
        run_pieces(&mut *second, &mut resumed, &[0, 40], 3..6);
        assert!(
            bits(&straight) == bits(&resumed),
            "{name}: resumed run differs"
        );
        assert_eq!(first.kind(), second.kind());
    }
}

/// `export_state_into` over the buffers of an earlier export of other
/// pieces and another optimizer's tensors gives what `export_state` gives.
#[test]
fn export_into_reused_buffers_equals_a_fresh_export() {
    for (name, make) in factories::<f64>() {
        let mut params = values::<f64>(7, 101);
        let mut opt = make();
        run_pieces(&mut *opt, &mut params, &[0, 40], 0..2);
        // Stale buffers: other pieces, and tensors of every other built-in.
        let mut reused = opt.export_state();
        for (_, other) in factories::<f64>() {
            let mut other = other();
            let mut p = values::<f64>(9, 101);
            run_pieces(&mut *other, &mut p, &[0, 70], 0..1);
            for ((key, offset), state) in other.export_state().params {
                let piece = reused.params.entry((key, offset)).or_default();
                piece.tensors.extend(state.tensors);
                piece.scalars.extend(state.scalars);
            }
        }
        run_pieces(&mut *opt, &mut params, &[0, 40], 2..4);
        opt.export_state_into(&mut reused);
        assert_eq!(reused, opt.export_state(), "{name}");
    }
}

#[test]
fn step_counts_are_per_piece_and_skip_none() {
    let mut opt = Adam::<f32>::new(AdamConfig::default()).unwrap();
    let (ka, kb) = (ParamKey::new("a", 0, 0), ParamKey::new("b", 0, 0));
    let (mut a, mut b) = (vec![1.0f32; 4], vec![1.0f32; 4]);
    let g = [0.5f32; 4];
    for step in 0..5 {
        let grads = [Some(&g[..]), (step % 2 == 0).then_some(&g[..])];
        let mut pieces = [
            ParamMut {
                key: &ka,
                data: &mut a,
            },
            ParamMut {
                key: &kb,
                data: &mut b,
            },
        ];
        opt.step(&mut pieces, &grads).unwrap();
    }
    let state = opt.export_state();
    assert_eq!(state.params[&("a".to_string(), 0)].scalars["step"], 5.0);
    assert_eq!(state.params[&("b".to_string(), 0)].scalars["step"], 3.0);
}

fn message(err: Error) -> String {
    match err {
        Error::Optimizer(m) => m,
        other => panic!("expected Error::Optimizer, got {other:?}"),
    }
}

#[test]
fn imported_state_of_the_wrong_length_fails_at_the_next_step() {
    let mut opt = Adam::<f32>::new(AdamConfig::default()).unwrap();
    let mut state = ParamState::default();
    state.scalars.insert("step".into(), 3.0);
    state.tensors.insert("exp_avg".into(), vec![0.0; 5]);
    state.tensors.insert("exp_avg_sq".into(), vec![0.0; 5]);
    let mut all = zero_core::optim::OptimizerState::default();
    all.params.insert(("layer.weight".into(), 8), state);
    opt.import_state(all).unwrap();
    let key = ParamKey::new("layer.weight", 8, 0);
    let mut data = vec![0.0f32; 6];
    let grad = vec![1.0f32; 6];
    let err = opt
        .step(
            &mut [ParamMut {
                key: &key,
                data: &mut data,
            }],
            &[Some(&grad)],
        )
        .unwrap_err();
    let m = message(err);
    assert!(
        m.contains("layer.weight") && m.contains('5') && m.contains('6'),
        "{m}"
    );
    assert_eq!(data, vec![0.0; 6], "nothing may change on error");
}

#[test]
fn inconsistent_or_foreign_state_is_rejected_on_import() {
    let mut state = ParamState::<f32>::default();
    state.scalars.insert("step".into(), 1.0);
    state.tensors.insert("exp_avg".into(), vec![0.0; 5]);
    state.tensors.insert("exp_avg_sq".into(), vec![0.0; 4]);
    let mut all = zero_core::optim::OptimizerState::default();
    all.params.insert(("w".into(), 0), state.clone());
    let mut adam = Adam::<f32>::new(AdamConfig::default()).unwrap();
    assert!(message(adam.import_state(all.clone()).unwrap_err()).contains("exp_avg_sq"));
    let mut sgd = Sgd::<f32>::new(SgdConfig::default()).unwrap();
    assert!(message(sgd.import_state(all).unwrap_err()).contains("exp_avg"));
}

#[test]
fn hyperparameters_are_validated_like_torch() {
    let bad = [
        message(
            Sgd::<f32>::new(SgdConfig::default().with_lr(-1.0))
                .err()
                .unwrap(),
        ),
        message(
            Sgd::<f32>::new(SgdConfig::default().with_nesterov(true))
                .err()
                .unwrap(),
        ),
        message(
            Sgd::<f32>::new(
                SgdConfig::default()
                    .with_momentum(0.9)
                    .with_dampening(0.1)
                    .with_nesterov(true),
            )
            .err()
            .unwrap(),
        ),
        message(
            Adam::<f32>::new(AdamConfig::default().with_betas(1.0, 0.9))
                .err()
                .unwrap(),
        ),
        message(
            AdamW::<f32>::new(AdamWConfig::default().with_betas(0.9, -0.1))
                .err()
                .unwrap(),
        ),
        message(
            Adagrad::<f32>::new(AdagradConfig::default().with_lr_decay(-1.0))
                .err()
                .unwrap(),
        ),
        message(
            RmsProp::<f32>::new(RmsPropConfig::default().with_alpha(-0.5))
                .err()
                .unwrap(),
        ),
    ];
    for m in &bad {
        assert!(m.contains("invalid") || m.contains("Nesterov"), "{m}");
    }

    let mut opt = Adam::<f32>::new(AdamConfig::default()).unwrap();
    let hyper = |json: serde_json::Value| -> Hyperparams { json.as_object().unwrap().clone() };
    assert!(message(
        opt.set_hyperparams(0, &hyper(serde_json::json!({"lr": -0.1})))
            .unwrap_err()
    )
    .contains("learning rate"));
    assert!(message(
        opt.add_group(&hyper(serde_json::json!({"betas": [0.9]})))
            .unwrap_err()
    )
    .contains("betas"));
    assert!(message(
        opt.add_group(&hyper(serde_json::json!({"momentum": 0.9})))
            .unwrap_err()
    )
    .contains("momentum"));
    assert_eq!(
        opt.learning_rate(0),
        1e-3,
        "a failed update keeps the old values"
    );
    // PyTorch's bookkeeping keys load unchanged.
    let g = opt
        .add_group(&hyper(
            serde_json::json!({"lr": 0.5, "foreach": null, "initial_lr": 0.5}),
        ))
        .unwrap();
    assert_eq!(opt.learning_rate(g), 0.5);
    assert_eq!(opt.hyperparams(g)["betas"], serde_json::json!([0.9, 0.999]));
    opt.set_learning_rate(g, 0.25);
    assert_eq!(opt.config(g).unwrap().lr, 0.25);
}

#[test]
fn malformed_step_calls_are_errors() {
    let mut opt = Sgd::<f64>::new(SgdConfig::default()).unwrap();
    let key = ParamKey::new("w", 0, 0);
    let other_group = ParamKey::new("w", 0, 3);
    let mut data = vec![1.0f64; 3];
    let short = vec![1.0f64; 2];
    let m = message(
        opt.step(
            &mut [ParamMut {
                key: &key,
                data: &mut data,
            }],
            &[Some(&short)],
        )
        .unwrap_err(),
    );
    assert!(
        m.contains("\"w\"") && m.contains('2') && m.contains('3'),
        "{m}"
    );
    let m = message(
        opt.step(
            &mut [ParamMut {
                key: &key,
                data: &mut data,
            }],
            &[],
        )
        .unwrap_err(),
    );
    assert!(m.contains("gradient slots"), "{m}");
    let grad = vec![1.0f64; 3];
    let m = message(
        opt.step(
            &mut [ParamMut {
                key: &other_group,
                data: &mut data,
            }],
            &[Some(&grad)],
        )
        .unwrap_err(),
    );
    assert!(m.contains("group 3"), "{m}");
    assert_eq!(data, vec![1.0; 3]);
}
