//! A user-written optimizer (Lion, Chen et al. 2023) built on the public
//! `zero_core::optim` API alone (`SimpleOptimizer`).

use serde::{Deserialize, Serialize};
use zero_core::optim::{Float, Simple, SimpleOptimizer};

#[derive(Clone, Serialize, Deserialize)]
pub struct LionConfig {
    pub lr: f64,
    pub betas: (f64, f64),
    pub weight_decay: f64,
}

/// `p = p (1 - lr wd) - lr sign(b1 m + (1 - b1) g)`, `m = b2 m + (1 - b2) g`.
pub struct Lion;

impl<T: Float> SimpleOptimizer<T> for Lion {
    type Config = LionConfig;
    const KIND: &'static str = "lion";
    const STATE: &'static [&'static str] = &["exp_avg"];

    fn update(c: &LionConfig, _step: u64, param: &mut [T], grad: &[T], state: &mut [Vec<T>]) {
        let f = T::from_f64;
        let (lr, wd, b1, b2) = (f(c.lr), f(c.weight_decay), f(c.betas.0), f(c.betas.1));
        for ((p, &g), m) in param.iter_mut().zip(grad).zip(&mut state[0]) {
            let update = b1 * *m + (T::ONE - b1) * g;
            let sign = match update.to_f64() {
                u if u > 0.0 => T::ONE,
                u if u < 0.0 => -T::ONE,
                _ => update * T::ZERO, // 0 at 0, NaN at NaN
            };
            *p = *p * (T::ONE - lr * wd) - lr * sign;
            *m = b2 * *m + (T::ONE - b2) * g;
        }
    }
}

pub fn lion(lr: f64, betas: (f64, f64), weight_decay: f64) -> Simple<Lion, f64> {
    let config = LionConfig {
        lr,
        betas,
        weight_decay,
    };
    Simple::new(config).expect("a valid Lion")
}
