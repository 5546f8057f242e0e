//! Adagrad (`torch.optim.Adagrad`): per-element learning rates from the sum
//! of squared gradients.

use super::core::{
    check_non_negative, for_each_chunk, forward_to_core, get_bool, get_f64, missing, num,
    reject_leftovers, take_step, take_tensor, with_flags, Core, GroupConfig, PieceState,
};
use super::{Float, FunctionalOptimizer, Hyperparams, ParamMut, ParamState};
use crate::Result;

/// Hyperparameters of an [`Adagrad`] parameter group; `Default` is PyTorch's.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdagradConfig {
    /// Learning rate (`lr`, default 1e-2).
    pub lr: f64,
    /// Learning rate decay per step (`lr_decay`, default 0).
    pub lr_decay: f64,
    /// L2 penalty added to the gradient (`weight_decay`, default 0).
    pub weight_decay: f64,
    /// Starting value of the sum of squares (`initial_accumulator_value`,
    /// default 0).
    pub initial_accumulator_value: f64,
    /// Added to the denominator for stability (`eps`, default 1e-10).
    pub eps: f64,
    /// Maximize the objective instead of minimizing (`maximize`, default false).
    pub maximize: bool,
}

impl Default for AdagradConfig {
    fn default() -> Self {
        Self {
            lr: 1e-2,
            lr_decay: 0.0,
            weight_decay: 0.0,
            initial_accumulator_value: 0.0,
            eps: 1e-10,
            maximize: false,
        }
    }
}

impl AdagradConfig {
    /// Sets the learning rate.
    pub fn with_lr(mut self, lr: f64) -> Self {
        self.lr = lr;
        self
    }
    /// Sets the learning rate decay.
    pub fn with_lr_decay(mut self, lr_decay: f64) -> Self {
        self.lr_decay = lr_decay;
        self
    }
    /// Sets the weight decay.
    pub fn with_weight_decay(mut self, weight_decay: f64) -> Self {
        self.weight_decay = weight_decay;
        self
    }
    /// Sets the starting value of the sum of squares.
    pub fn with_initial_accumulator_value(mut self, value: f64) -> Self {
        self.initial_accumulator_value = value;
        self
    }
    /// Sets epsilon.
    pub fn with_eps(mut self, eps: f64) -> Self {
        self.eps = eps;
        self
    }
    /// Maximizes instead of minimizing.
    pub fn with_maximize(mut self, maximize: bool) -> Self {
        self.maximize = maximize;
        self
    }
}

impl GroupConfig for AdagradConfig {
    const KEYS: &'static [&'static str] = &[
        "lr",
        "lr_decay",
        "weight_decay",
        "initial_accumulator_value",
        "eps",
        "maximize",
    ];
    const KIND: &'static str = "adagrad";

    fn lr(&self) -> f64 {
        self.lr
    }
    fn set_lr(&mut self, lr: f64) {
        self.lr = lr;
    }
    fn to_hyperparams(&self) -> Hyperparams {
        let mut h = Hyperparams::new();
        h.insert("lr".into(), num(self.lr));
        h.insert("lr_decay".into(), num(self.lr_decay));
        h.insert("weight_decay".into(), num(self.weight_decay));
        h.insert(
            "initial_accumulator_value".into(),
            num(self.initial_accumulator_value),
        );
        h.insert("eps".into(), num(self.eps));
        h.insert("maximize".into(), self.maximize.into());
        h
    }
    fn apply(&mut self, h: &Hyperparams) -> Result<()> {
        let k = Self::KIND;
        self.lr = get_f64(k, h, "lr")?.unwrap_or(self.lr);
        self.lr_decay = get_f64(k, h, "lr_decay")?.unwrap_or(self.lr_decay);
        self.weight_decay = get_f64(k, h, "weight_decay")?.unwrap_or(self.weight_decay);
        self.initial_accumulator_value =
            get_f64(k, h, "initial_accumulator_value")?.unwrap_or(self.initial_accumulator_value);
        self.eps = get_f64(k, h, "eps")?.unwrap_or(self.eps);
        self.maximize = get_bool(k, h, "maximize")?.unwrap_or(self.maximize);
        Ok(())
    }
    fn validate(&self) -> Result<()> {
        let k = Self::KIND;
        check_non_negative(k, "learning rate", self.lr)?;
        check_non_negative(k, "lr_decay", self.lr_decay)?;
        check_non_negative(k, "weight_decay", self.weight_decay)?;
        check_non_negative(
            k,
            "initial_accumulator_value",
            self.initial_accumulator_value,
        )?;
        check_non_negative(k, "epsilon", self.eps)
    }
}

/// Adagrad state of one piece.
pub(crate) struct AdagradPiece<T> {
    step: f64,
    sum: Vec<T>,
}

impl<T: Float> PieceState<T> for AdagradPiece<T> {
    fn len(&self) -> Option<usize> {
        Some(self.sum.len())
    }
    fn export(&self) -> ParamState<T> {
        let mut state = ParamState::default();
        state.scalars.insert("step".into(), self.step);
        state.tensors.insert("sum".into(), self.sum.clone());
        state
    }
    fn import(kind: &str, name: &str, mut state: ParamState<T>) -> Result<Self> {
        let step = take_step(kind, name, &mut state)?;
        let sum = take_tensor(kind, name, &mut state, "sum", &mut None)?
            .ok_or_else(|| missing(kind, name, "sum"))?;
        reject_leftovers(kind, name, &state)?;
        Ok(Self { step, sum })
    }
}

/// Scalars of one Adagrad step of one piece.
struct AdagradCoefficients<T> {
    sign: T,
    weight_decay: T,
    eps: T,
    neg_clr: T,
}

/// One fused pass of the single-tensor Adagrad update over a chunk.
#[inline(always)]
fn adagrad_kernel<T: Float, const WEIGHT_DECAY: bool>(
    c: &AdagradCoefficients<T>,
    param: &mut [T],
    grad: &[T],
    sum: &mut [T],
) {
    for ((p, &g), s) in param.iter_mut().zip(grad).zip(sum.iter_mut()) {
        let mut g = g * c.sign;
        if WEIGHT_DECAY {
            g = g + c.weight_decay * *p;
        }
        *s = *s + g * g;
        let std = s.sqrt() + c.eps;
        *p = *p + c.neg_clr * g / std;
    }
}

/// `torch.optim.Adagrad`: the step size of each element shrinks with the
/// sum of its squared gradients; `lr_decay` shrinks the learning rate with
/// the step count.
///
/// State per piece: `step` (scalar) and `sum`.
pub struct Adagrad<T = f32> {
    core: Core<AdagradConfig, AdagradPiece<T>>,
}

impl<T: Float> Adagrad<T> {
    /// An optimizer whose group 0 has `config`.
    pub fn new(config: AdagradConfig) -> Result<Self> {
        Ok(Self {
            core: Core::new(config)?,
        })
    }

    /// Adds a parameter group with `config`; returns its index.
    pub fn add_param_group(&mut self, config: AdagradConfig) -> Result<usize> {
        self.core.push_group(config)
    }

    /// The configuration of `group`, if it exists.
    pub fn config(&self, group: usize) -> Option<&AdagradConfig> {
        self.core.groups.get(group)
    }
}

impl<T: Float> FunctionalOptimizer<T> for Adagrad<T> {
    fn kind(&self) -> &str {
        AdagradConfig::KIND
    }

    fn step(&mut self, params: &mut [ParamMut<'_, T>], grads: &[Option<&[T]>]) -> Result<()> {
        self.core.step(
            params,
            grads,
            |config, len| AdagradPiece {
                step: 0.0,
                sum: vec![T::from_f64(config.initial_accumulator_value); len],
            },
            |config, state, param, grad| {
                state.step += 1.0;
                let clr = config.lr / (1.0 + (state.step - 1.0) * config.lr_decay);
                let c = AdagradCoefficients {
                    sign: T::from_f64(if config.maximize { -1.0 } else { 1.0 }),
                    weight_decay: T::from_f64(config.weight_decay),
                    eps: T::from_f64(config.eps),
                    neg_clr: T::from_f64(-clr),
                };
                let weight_decay = config.weight_decay != 0.0;
                for_each_chunk(
                    grad,
                    [param, &mut state.sum],
                    |g, [p, s]| with_flags!(adagrad_kernel [] (&c, p, g, s) weight_decay),
                );
            },
        )
    }

    forward_to_core!();
}
