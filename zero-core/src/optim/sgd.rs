//! Stochastic gradient descent with momentum, dampening, Nesterov momentum,
//! weight decay and maximize, as `torch.optim.SGD`.

use super::core::{
    check_non_negative, for_each_chunk, group_config, optimizer, reject_leftovers, take_tensor,
    with_flags, GroupConfig, GroupFields, PieceState,
};
use super::{Float, ParamState};
use crate::{Error, Result};

group_config! {
    /// Hyperparameters of an [`Sgd`] parameter group; `Default` is PyTorch's.
    pub struct SgdConfig("sgd") {
        /// Learning rate (`lr`, default 1e-3).
        pub lr: f64 = 1e-3,
            /// Sets the learning rate.
            fn with_lr;
        /// Momentum factor (`momentum`, default 0).
        pub momentum: f64 = 0.0,
            /// Sets the momentum factor.
            fn with_momentum;
        /// Dampening for momentum (`dampening`, default 0).
        pub dampening: f64 = 0.0,
            /// Sets the dampening.
            fn with_dampening;
        /// Nesterov momentum (`nesterov`, default false); needs momentum > 0 and
        /// zero dampening.
        pub nesterov: bool = false,
            /// Turns Nesterov momentum on or off.
            fn with_nesterov;
        /// L2 penalty added to the gradient (`weight_decay`, default 0).
        pub weight_decay: f64 = 0.0,
            /// Sets the weight decay.
            fn with_weight_decay;
        /// Maximize the objective instead of minimizing (`maximize`, default false).
        pub maximize: bool = false,
            /// Maximizes instead of minimizing.
            fn with_maximize;
    }
}

impl GroupConfig for SgdConfig {
    fn validate(&self) -> Result<()> {
        let k = Self::KIND;
        check_non_negative(k, "learning rate", self.lr)?;
        check_non_negative(k, "momentum", self.momentum)?;
        check_non_negative(k, "weight_decay", self.weight_decay)?;
        if !self.dampening.is_finite() {
            return Err(Error::Optimizer(format!(
                "{k}: invalid dampening value: {}",
                self.dampening
            )));
        }
        if self.nesterov && (self.momentum <= 0.0 || self.dampening != 0.0) {
            return Err(Error::Optimizer(format!(
                "{k}: Nesterov momentum requires a momentum and zero dampening \
                 (momentum {}, dampening {})",
                self.momentum, self.dampening
            )));
        }
        Ok(())
    }
}

/// SGD state of one piece: the momentum buffer, once momentum was used.
pub(crate) struct SgdPiece<T> {
    momentum_buffer: Option<Vec<T>>,
}

impl<T: Float> PieceState<T> for SgdPiece<T> {
    fn bytes(&self) -> usize {
        self.momentum_buffer.as_ref().map_or(0, Vec::len) * std::mem::size_of::<T>()
    }
    fn len(&self) -> Option<usize> {
        self.momentum_buffer.as_ref().map(Vec::len)
    }
    fn export(&self) -> ParamState<T> {
        let mut state = ParamState::default();
        if let Some(buffer) = &self.momentum_buffer {
            state
                .tensors
                .insert("momentum_buffer".into(), buffer.clone());
        }
        state
    }
    fn import(kind: &str, name: &str, mut state: ParamState<T>) -> Result<Self> {
        let mut len = None;
        let momentum_buffer = take_tensor(kind, name, &mut state, "momentum_buffer", &mut len)?;
        reject_leftovers(kind, name, &state)?;
        Ok(Self { momentum_buffer })
    }
}

/// Scalars of one SGD step, converted to the element type once.
struct SgdCoefficients<T> {
    sign: T,
    weight_decay: T,
    momentum: T,
    one_minus_dampening: T,
    neg_lr: T,
}

/// One fused pass of `torch.optim.SGD`'s single-tensor update. `FIRST`: the
/// momentum buffer is initialised to the (decayed) gradient, as torch does.
#[inline(always)]
fn sgd_kernel<
    T: Float,
    const WEIGHT_DECAY: bool,
    const MOMENTUM: bool,
    const FIRST: bool,
    const NESTEROV: bool,
>(
    c: &SgdCoefficients<T>,
    param: &mut [T],
    grad: &[T],
    buffer: &mut [T],
) {
    let direction = |p: T, g: T| {
        let d = g * c.sign;
        if WEIGHT_DECAY {
            d + c.weight_decay * p
        } else {
            d
        }
    };
    if MOMENTUM {
        for ((p, &g), b) in param.iter_mut().zip(grad).zip(buffer.iter_mut()) {
            let d = direction(*p, g);
            let buf = if FIRST {
                d
            } else {
                *b * c.momentum + c.one_minus_dampening * d
            };
            *b = buf;
            let d = if NESTEROV { d + c.momentum * buf } else { buf };
            *p = *p + c.neg_lr * d;
        }
    } else {
        for (p, &g) in param.iter_mut().zip(grad) {
            let d = direction(*p, g);
            *p = *p + c.neg_lr * d;
        }
    }
}

/// Steps one piece.
fn sgd_update<T: Float>(config: &SgdConfig, state: &mut SgdPiece<T>, param: &mut [T], grad: &[T]) {
    let c = SgdCoefficients {
        sign: T::from_f64(if config.maximize { -1.0 } else { 1.0 }),
        weight_decay: T::from_f64(config.weight_decay),
        momentum: T::from_f64(config.momentum),
        one_minus_dampening: T::from_f64(1.0 - config.dampening),
        neg_lr: T::from_f64(-config.lr),
    };
    let weight_decay = config.weight_decay != 0.0;
    if config.momentum == 0.0 {
        for_each_chunk(
            grad,
            [param],
            |g, [p]| with_flags!(sgd_kernel [] (&c, p, g, &mut []) weight_decay, false, false, false),
        );
        return;
    }
    let first = state.momentum_buffer.is_none();
    let buffer = state
        .momentum_buffer
        .get_or_insert_with(|| vec![T::ZERO; grad.len()]);
    let nesterov = config.nesterov;
    for_each_chunk(
        grad,
        [param, buffer],
        |g, [p, b]| with_flags!(sgd_kernel [] (&c, p, g, b) weight_decay, true, first, nesterov),
    );
}

optimizer! {
    /// `torch.optim.SGD`: stochastic gradient descent with optional momentum
    /// (the buffer starts as the first gradient), dampening, Nesterov momentum,
    /// L2 weight decay and maximize.
    ///
    /// State per piece: `momentum_buffer` (only when momentum is non-zero).
    pub struct Sgd<T>(SgdConfig, SgdPiece);
    init: |_, _| SgdPiece { momentum_buffer: None },
    update: sgd_update,
}
