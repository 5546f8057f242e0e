//! The built-in optimizers against `torch.optim` (single-tensor
//! implementations), in f64 and f32.
//!
//! The golden values come from `golden/gen_optim_golden.py` (torch version
//! recorded in the JSON); see that script for the scenario: three
//! parameters, some steps with `None` gradients so step counts differ, a
//! learning-rate change half way, several parameter groups.

use serde_json::Value;
use zero_core::optim::{
    Adagrad, AdagradConfig, Adam, AdamConfig, AdamW, AdamWConfig, Float, FunctionalOptimizer,
    Hyperparams, ParamKey, ParamMut, RmsProp, RmsPropConfig, Sgd, SgdConfig,
};

const GOLDEN: &str = include_str!("golden/optim_golden.json");

/// The generator's 32-bit LCG: `n` values in [-2, 2].
fn lcg_values(seed: u64, n: usize) -> Vec<f64> {
    let mut x = seed & 0xFFFF_FFFF;
    (0..n)
        .map(|_| {
            x = (1_664_525 * x + 1_013_904_223) & 0xFFFF_FFFF;
            (((x >> 8) % 20001) as f64 - 10000.0) / 5000.0
        })
        .collect()
}

fn make<T: Float>(kind: &str) -> Box<dyn FunctionalOptimizer<T>> {
    match kind {
        "sgd" => Box::new(Sgd::<T>::new(SgdConfig::default()).unwrap()),
        "adam" => Box::new(Adam::<T>::new(AdamConfig::default()).unwrap()),
        "adamw" => Box::new(AdamW::<T>::new(AdamWConfig::default()).unwrap()),
        "adagrad" => Box::new(Adagrad::<T>::new(AdagradConfig::default()).unwrap()),
        "rmsprop" => Box::new(RmsProp::<T>::new(RmsPropConfig::default()).unwrap()),
        other => panic!("unknown optimizer {other}"),
    }
}

fn as_vec(v: &Value) -> Vec<f64> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap())
        .collect()
}

/// Runs one case in `T`; returns the final parameters and the optimizer.
fn run_case<T: Float>(
    golden: &Value,
    case: &Value,
) -> (Vec<Vec<T>>, Box<dyn FunctionalOptimizer<T>>) {
    let steps = golden["steps"].as_u64().unwrap() as usize;
    let lr_change_step = golden["lr_change_step"].as_u64().unwrap() as usize;
    let lr_factor = golden["lr_factor"].as_f64().unwrap();
    let none: Vec<(usize, usize)> = golden["none"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| {
            (
                p[0].as_u64().unwrap() as usize,
                p[1].as_u64().unwrap() as usize,
            )
        })
        .collect();
    let specs: Vec<(String, usize)> = golden["params"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| {
            (
                p["name"].as_str().unwrap().to_string(),
                p["len"].as_u64().unwrap() as usize,
            )
        })
        .collect();
    let assignment: Vec<usize> = case["assignment"]
        .as_array()
        .unwrap()
        .iter()
        .map(|g| g.as_u64().unwrap() as usize)
        .collect();

    let mut opt = make::<T>(case["optimizer"].as_str().unwrap());
    let groups = case["groups"].as_array().unwrap();
    let hyper = |i: usize| -> Hyperparams { groups[i].as_object().unwrap().clone() };
    opt.set_hyperparams(0, &hyper(0)).unwrap();
    for i in 1..groups.len() {
        // The script gives torch's constructor group 0's values, and an
        // added group takes the constructor's values for the keys it does
        // not give; this optimizer was constructed with the defaults.
        let mut added = hyper(0);
        added.extend(hyper(i));
        assert_eq!(opt.add_group(&added).unwrap(), i);
    }
    assert_eq!(opt.num_groups(), groups.len());

    let keys: Vec<ParamKey> = specs
        .iter()
        .zip(&assignment)
        .map(|((name, _), &group)| ParamKey::new(name.clone(), 0, group))
        .collect();
    let mut params: Vec<Vec<T>> = specs
        .iter()
        .enumerate()
        .map(|(i, (_, n))| {
            lcg_values(1000 + i as u64, *n)
                .into_iter()
                .map(T::from_f64)
                .collect()
        })
        .collect();
    for step in 0..steps {
        if step == lr_change_step {
            for g in 0..opt.num_groups() {
                let lr = opt.learning_rate(g);
                opt.set_learning_rate(g, lr * lr_factor);
            }
        }
        let grads: Vec<Option<Vec<T>>> = specs
            .iter()
            .enumerate()
            .map(|(i, (_, n))| {
                (!none.contains(&(step, i))).then(|| {
                    lcg_values(7919 * step as u64 + 31 * i as u64 + 1, *n)
                        .into_iter()
                        .map(T::from_f64)
                        .collect()
                })
            })
            .collect();
        let grad_refs: Vec<Option<&[T]>> = grads.iter().map(|g| g.as_deref()).collect();
        let mut pieces: Vec<ParamMut<'_, T>> = params
            .iter_mut()
            .zip(&keys)
            .map(|(data, key)| ParamMut { key, data })
            .collect();
        opt.step(&mut pieces, &grad_refs).unwrap();
    }
    (params, opt)
}

fn assert_close(case: &str, what: &str, got: &[f64], want: &[f64], rtol: f64) {
    assert_eq!(got.len(), want.len(), "{case}: {what}: length");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let tol = rtol * w.abs().max(1.0);
        assert!(
            (g - w).abs() <= tol,
            "{case}: {what}[{i}]: got {g:e}, torch {w:e} (diff {:e} > {tol:e})",
            (g - w).abs()
        );
    }
}

fn check<T: Float>(dtype: &str, rtol: f64) {
    let golden: Value = serde_json::from_str(GOLDEN).unwrap();
    let names: Vec<String> = golden["params"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["name"].as_str().unwrap().to_string())
        .collect();
    let mut checked = 0;
    for case in golden["cases"].as_array().unwrap() {
        let name = case["name"].as_str().unwrap();
        let expected = &case[dtype];
        let (params, opt) = run_case::<T>(&golden, case);
        let state = opt.export_state();
        for (i, param) in params.iter().enumerate() {
            let got: Vec<f64> = param.iter().map(|x| x.to_f64()).collect();
            let param_name = &names[i];
            assert_close(
                name,
                &format!("{dtype} param {param_name}"),
                &got,
                &as_vec(&expected["params"][i]),
                rtol,
            );
            let want_state = &expected["state"][i];
            let got_state = state.params.get(&(param_name.clone(), 0));
            let want_tensors = want_state["tensors"].as_object().unwrap();
            let got_tensor_names: Vec<&String> = got_state
                .map(|s| s.tensors.keys().collect())
                .unwrap_or_default();
            let want_tensor_names: Vec<&String> = want_tensors.keys().collect();
            assert_eq!(
                got_tensor_names, want_tensor_names,
                "{name}: {param_name}: state names"
            );
            for (key, want) in want_tensors {
                let got: Vec<f64> = got_state.unwrap().tensors[key]
                    .iter()
                    .map(|x| x.to_f64())
                    .collect();
                assert_close(
                    name,
                    &format!("{dtype} {param_name}.{key}"),
                    &got,
                    &as_vec(want),
                    rtol,
                );
            }
            let want_step = want_state["scalars"].get("step").and_then(Value::as_f64);
            let got_step = got_state.and_then(|s| s.scalars.get("step").copied());
            assert_eq!(got_step, want_step, "{name}: {param_name}: step");
        }
        checked += 1;
    }
    assert!(checked >= 30, "only {checked} cases");
}

#[test]
fn f64_matches_torch_float64() {
    check::<f64>("f64", 1e-12);
}

#[test]
fn f32_matches_torch_float32() {
    check::<f32>("f32", 1e-6);
}

#[test]
fn hyperparams_use_torch_names() {
    let opt = Adam::<f32>::new(AdamConfig::default().with_amsgrad(true)).unwrap();
    let h = opt.hyperparams(0);
    assert_eq!(h["betas"], serde_json::json!([0.9, 0.999]));
    assert_eq!(h["amsgrad"], Value::Bool(true));
    assert_eq!(h["lr"].as_f64(), Some(1e-3));
    let opt = AdamW::<f32>::new(AdamWConfig::default()).unwrap();
    assert_eq!(opt.hyperparams(0)["weight_decay"].as_f64(), Some(1e-2));
    let opt = RmsProp::<f64>::new(RmsPropConfig::default()).unwrap();
    let h = opt.hyperparams(0);
    let keys: Vec<&str> = h.keys().map(String::as_str).collect();
    assert_eq!(
        keys,
        [
            "alpha",
            "centered",
            "eps",
            "lr",
            "maximize",
            "momentum",
            "weight_decay"
        ]
    );
}
