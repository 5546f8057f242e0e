//! A user-written optimizer (Lion, Chen et al. 2023) built on the public
//! `zero_core::optim` API alone, checked against a hand-computed update.

use std::collections::BTreeMap;
use zero_core::optim::{
    Float, FunctionalOptimizer, Hyperparams, OptimizerState, ParamMut, ParamState,
};
use zero_core::{Error, Result};

/// Lion: `p -= lr * (sign(b1 m + (1 - b1) g) + wd p)`, `m = b2 m + (1 - b2) g`.
struct Lion<T> {
    groups: Vec<(f64, f64, f64, f64)>, // lr, beta1, beta2, weight_decay
    exp_avg: BTreeMap<(String, usize), Vec<T>>,
}

impl<T: Float> Lion<T> {
    fn new(lr: f64, beta1: f64, beta2: f64, weight_decay: f64) -> Self {
        Self {
            groups: vec![(lr, beta1, beta2, weight_decay)],
            exp_avg: BTreeMap::new(),
        }
    }
}

impl<T: Float> FunctionalOptimizer<T> for Lion<T> {
    fn kind(&self) -> &str {
        "lion"
    }

    fn step(&mut self, params: &mut [ParamMut<'_, T>], grads: &[Option<&[T]>]) -> Result<()> {
        for (param, grad) in params.iter_mut().zip(grads) {
            let Some(grad) = grad else { continue };
            let &(lr, beta1, beta2, wd) = self
                .groups
                .get(param.key.group)
                .ok_or_else(|| Error::Optimizer(format!("lion: no group {}", param.key.group)))?;
            let m = self
                .exp_avg
                .entry((param.key.name.clone(), param.key.offset))
                .or_insert_with(|| vec![T::ZERO; grad.len()]);
            let (b1, b2) = (T::from_f64(beta1), T::from_f64(beta2));
            let (one_b1, one_b2) = (T::from_f64(1.0 - beta1), T::from_f64(1.0 - beta2));
            let decay = T::from_f64(1.0 - lr * wd);
            let lr = T::from_f64(lr);
            for ((p, &g), m) in param.data.iter_mut().zip(*grad).zip(m.iter_mut()) {
                let c = b1 * *m + one_b1 * g;
                let sign = if c > T::ZERO {
                    T::ONE
                } else if c < T::ZERO {
                    -T::ONE
                } else {
                    T::ZERO
                };
                *p = *p * decay - lr * sign;
                *m = b2 * *m + one_b2 * g;
            }
        }
        Ok(())
    }

    fn num_groups(&self) -> usize {
        self.groups.len()
    }

    fn add_group(&mut self, hyper: &Hyperparams) -> Result<usize> {
        let mut group = self.groups[0];
        if let Some(lr) = hyper.get("lr").and_then(|v| v.as_f64()) {
            group.0 = lr;
        }
        self.groups.push(group);
        Ok(self.groups.len() - 1)
    }

    fn hyperparams(&self, group: usize) -> Hyperparams {
        let mut h = Hyperparams::new();
        if let Some(&(lr, b1, b2, wd)) = self.groups.get(group) {
            h.insert("lr".into(), lr.into());
            h.insert("betas".into(), serde_json::json!([b1, b2]));
            h.insert("weight_decay".into(), wd.into());
        }
        h
    }

    fn set_hyperparams(&mut self, group: usize, hyper: &Hyperparams) -> Result<()> {
        if let Some(lr) = hyper.get("lr").and_then(|v| v.as_f64()) {
            self.set_learning_rate(group, lr);
        }
        Ok(())
    }

    fn learning_rate(&self, group: usize) -> f64 {
        self.groups.get(group).map_or(f64::NAN, |g| g.0)
    }

    fn set_learning_rate(&mut self, group: usize, lr: f64) {
        if let Some(g) = self.groups.get_mut(group) {
            g.0 = lr;
        }
    }

    fn export_state(&self) -> OptimizerState<T> {
        OptimizerState {
            params: self
                .exp_avg
                .iter()
                .map(|(key, m)| {
                    let mut state = ParamState::default();
                    state.tensors.insert("exp_avg".into(), m.clone());
                    (key.clone(), state)
                })
                .collect(),
        }
    }

    fn import_state(&mut self, state: OptimizerState<T>) -> Result<()> {
        for (key, mut piece) in state.params {
            let m = piece
                .tensors
                .remove("exp_avg")
                .ok_or_else(|| Error::Optimizer(format!("lion: {key:?} has no exp_avg")))?;
            self.exp_avg.insert(key, m);
        }
        Ok(())
    }
}

#[test]
fn lion_written_against_the_public_trait_matches_a_hand_computation() {
    use zero_core::optim::ParamKey;
    let mut opt: Box<dyn FunctionalOptimizer<f64>> = Box::new(Lion::new(0.1, 0.9, 0.99, 0.5));
    let key = ParamKey::new("w", 0, 0);
    let mut p = vec![1.0, -2.0, 0.5];
    // Step 1: m = 0, c = 0.1 g, so the update is -lr * sign(g), after decay 1 - 0.05.
    opt.step(
        &mut [ParamMut {
            key: &key,
            data: &mut p,
        }],
        &[Some(&[0.2, 0.3, 0.0])],
    )
    .unwrap();
    assert_eq!(p, vec![0.95 - 0.1, -1.9 - 0.1, 0.475]);
    // m = 0.01 g = [0.002, 0.003, 0]; step 2 with g = [-0.01, -0.1, 1]:
    // c = 0.9 m + 0.1 g = [0.0008, -0.0073, 0.1] -> signs [+, -, +].
    opt.step(
        &mut [ParamMut {
            key: &key,
            data: &mut p,
        }],
        &[Some(&[-0.01, -0.1, 1.0])],
    )
    .unwrap();
    let want = [0.85 * 0.95 - 0.1, -2.0 * 0.95 + 0.1, 0.475 * 0.95 - 0.1];
    for (got, want) in p.iter().zip(want) {
        assert!((got - want).abs() < 1e-15, "{got} vs {want}");
    }
    // None: nothing moves.
    let before = p.clone();
    opt.step(
        &mut [ParamMut {
            key: &key,
            data: &mut p,
        }],
        &[None],
    )
    .unwrap();
    assert_eq!(p, before);
    let state = opt.export_state();
    let m = &state.params[&("w".to_string(), 0)].tensors["exp_avg"];
    assert!((m[2] - 0.01).abs() < 1e-15);
}
