//! Adagrad (`torch.optim.Adagrad`): per-element learning rates from the sum
//! of squared gradients.

use super::core::{
    check_non_negative, for_each_chunk, group_config, missing, optimizer, reject_leftovers,
    take_step, take_tensor, with_flags, GroupConfig, GroupFields, PieceState,
};
use super::{Float, ParamState};
use crate::Result;

group_config! {
    /// Hyperparameters of an [`Adagrad`] parameter group; `Default` is PyTorch's.
    pub struct AdagradConfig("adagrad") {
        /// Learning rate (`lr`, default 1e-2).
        pub lr: f64 = 1e-2,
            /// Sets the learning rate.
            fn with_lr;
        /// Learning rate decay per step (`lr_decay`, default 0).
        pub lr_decay: f64 = 0.0,
            /// Sets the learning rate decay.
            fn with_lr_decay;
        /// L2 penalty added to the gradient (`weight_decay`, default 0).
        pub weight_decay: f64 = 0.0,
            /// Sets the weight decay.
            fn with_weight_decay;
        /// Starting value of the sum of squares (`initial_accumulator_value`,
        /// default 0). Each group's own value applies (`torch.optim.Adagrad`
        /// uses its constructor's value for every group).
        pub initial_accumulator_value: f64 = 0.0,
            /// Sets the starting value of the sum of squares.
            fn with_initial_accumulator_value;
        /// Added to the denominator for stability (`eps`, default 1e-10).
        pub eps: f64 = 1e-10,
            /// Sets epsilon.
            fn with_eps;
        /// Maximize the objective instead of minimizing (`maximize`, default false).
        pub maximize: bool = false,
            /// Maximizes instead of minimizing.
            fn with_maximize;
    }
}

impl GroupConfig for AdagradConfig {
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
    fn bytes(&self) -> usize {
        self.sum.len() * std::mem::size_of::<T>() + std::mem::size_of::<f64>()
    }
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

/// Steps one piece.
fn adagrad_update<T: Float>(
    config: &AdagradConfig,
    state: &mut AdagradPiece<T>,
    param: &mut [T],
    grad: &[T],
) {
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
}

optimizer! {
    /// `torch.optim.Adagrad`: the step size of each element shrinks with the
    /// sum of its squared gradients; `lr_decay` shrinks the learning rate with
    /// the step count.
    ///
    /// State per piece: `step` (scalar) and `sum`.
    pub struct Adagrad<T>(AdagradConfig, AdagradPiece);
    init: |config, len| AdagradPiece {
        step: 0.0,
        sum: vec![T::from_f64(config.initial_accumulator_value); len],
    },
    update: adagrad_update,
}
