//! RMSprop (`torch.optim.RMSprop`), plain or centered, with optional
//! momentum.

use super::core::{
    check_non_negative, for_each_chunk, group_config, missing, optimizer, reject_leftovers,
    take_step, take_tensor, with_flags, GroupConfig, GroupFields, Lerp, PieceState,
};
use super::{Float, ParamState};
use crate::Result;

group_config! {
    /// Hyperparameters of an [`RmsProp`] parameter group; `Default` is PyTorch's.
    pub struct RmsPropConfig("rmsprop") {
        /// Learning rate (`lr`, default 1e-2).
        pub lr: f64 = 1e-2,
            /// Sets the learning rate.
            fn with_lr;
        /// Smoothing constant of the square average (`alpha`, default 0.99).
        pub alpha: f64 = 0.99,
            /// Sets the smoothing constant.
            fn with_alpha;
        /// Added to the denominator for stability (`eps`, default 1e-8).
        pub eps: f64 = 1e-8,
            /// Sets epsilon.
            fn with_eps;
        /// L2 penalty added to the gradient (`weight_decay`, default 0).
        pub weight_decay: f64 = 0.0,
            /// Sets the weight decay.
            fn with_weight_decay;
        /// Momentum factor (`momentum`, default 0).
        pub momentum: f64 = 0.0,
            /// Sets the momentum factor.
            fn with_momentum;
        /// Normalize by the estimated variance instead of the second moment
        /// (`centered`, default false).
        pub centered: bool = false,
            /// Turns the centered variant on or off.
            fn with_centered;
        /// Maximize the objective instead of minimizing (`maximize`, default false).
        pub maximize: bool = false,
            /// Maximizes instead of minimizing.
            fn with_maximize;
    }
}

impl GroupConfig for RmsPropConfig {
    fn validate(&self) -> Result<()> {
        let k = Self::KIND;
        check_non_negative(k, "learning rate", self.lr)?;
        check_non_negative(k, "epsilon", self.eps)?;
        check_non_negative(k, "momentum", self.momentum)?;
        check_non_negative(k, "weight_decay", self.weight_decay)?;
        check_non_negative(k, "alpha", self.alpha)
    }
}

/// RMSprop state of one piece.
pub(crate) struct RmsPropPiece<T> {
    step: f64,
    square_avg: Vec<T>,
    momentum_buffer: Option<Vec<T>>,
    grad_avg: Option<Vec<T>>,
}

impl<T: Float> PieceState<T> for RmsPropPiece<T> {
    fn bytes(&self) -> usize {
        (self.square_avg.len()
            + self.momentum_buffer.as_ref().map_or(0, Vec::len)
            + self.grad_avg.as_ref().map_or(0, Vec::len))
            * std::mem::size_of::<T>()
            + std::mem::size_of::<f64>()
    }
    fn len(&self) -> Option<usize> {
        Some(self.square_avg.len())
    }
    fn export(&self) -> ParamState<T> {
        let mut state = ParamState::default();
        state.scalars.insert("step".into(), self.step);
        state
            .tensors
            .insert("square_avg".into(), self.square_avg.clone());
        if let Some(buffer) = &self.momentum_buffer {
            state
                .tensors
                .insert("momentum_buffer".into(), buffer.clone());
        }
        if let Some(grad_avg) = &self.grad_avg {
            state.tensors.insert("grad_avg".into(), grad_avg.clone());
        }
        state
    }
    fn import(kind: &str, name: &str, mut state: ParamState<T>) -> Result<Self> {
        let mut len = None;
        let step = take_step(kind, name, &mut state)?;
        let square_avg = take_tensor(kind, name, &mut state, "square_avg", &mut len)?
            .ok_or_else(|| missing(kind, name, "square_avg"))?;
        let momentum_buffer = take_tensor(kind, name, &mut state, "momentum_buffer", &mut len)?;
        let grad_avg = take_tensor(kind, name, &mut state, "grad_avg", &mut len)?;
        reject_leftovers(kind, name, &state)?;
        Ok(Self {
            step,
            square_avg,
            momentum_buffer,
            grad_avg,
        })
    }
}

/// Scalars of one RMSprop step of one piece.
struct RmsPropCoefficients<T> {
    sign: T,
    weight_decay: T,
    alpha: T,
    one_minus_alpha: T,
    grad_avg_lerp: Lerp<T>,
    eps: T,
    momentum: T,
    neg_lr: T,
}

/// The element update; `grad_avg` is `Some` exactly when `CENTERED`, `buf`
/// exactly when `MOMENTUM`.
#[inline(always)]
fn rmsprop_element<
    T: Float,
    const WEIGHT_DECAY: bool,
    const CENTERED: bool,
    const LERP_SMALL: bool,
    const MOMENTUM: bool,
>(
    c: &RmsPropCoefficients<T>,
    p: &mut T,
    g: T,
    square_avg: &mut T,
    grad_avg: Option<&mut T>,
    buf: Option<&mut T>,
) {
    let mut g = g * c.sign;
    if WEIGHT_DECAY {
        g = g + c.weight_decay * *p;
    }
    *square_avg = *square_avg * c.alpha + c.one_minus_alpha * g * g;
    let avg = match grad_avg {
        Some(ga) if CENTERED => {
            *ga = c.grad_avg_lerp.apply::<LERP_SMALL>(*ga, g);
            // addcmul(grad_avg, grad_avg, value=-1): -1 * ga is exact.
            (*square_avg + -*ga * *ga).sqrt()
        }
        _ => square_avg.sqrt(),
    } + c.eps;
    match buf {
        Some(b) if MOMENTUM => {
            *b = *b * c.momentum + g / avg;
            *p = *p + c.neg_lr * *b;
        }
        _ => *p = *p + c.neg_lr * g / avg,
    }
}

/// One fused pass of the single-tensor RMSprop update over a chunk. Slices
/// not used by the variant are empty.
#[inline(always)]
fn rmsprop_kernel<
    T: Float,
    const WEIGHT_DECAY: bool,
    const CENTERED: bool,
    const LERP_SMALL: bool,
    const MOMENTUM: bool,
>(
    c: &RmsPropCoefficients<T>,
    param: &mut [T],
    grad: &[T],
    square_avg: &mut [T],
    grad_avg: &mut [T],
    buf: &mut [T],
) {
    let common = param.iter_mut().zip(grad).zip(square_avg.iter_mut());
    let element = rmsprop_element::<T, WEIGHT_DECAY, CENTERED, LERP_SMALL, MOMENTUM>;
    match (CENTERED, MOMENTUM) {
        (true, true) => {
            for ((((p, &g), s), a), b) in common.zip(grad_avg.iter_mut()).zip(buf.iter_mut()) {
                element(c, p, g, s, Some(a), Some(b));
            }
        }
        (true, false) => {
            for (((p, &g), s), a) in common.zip(grad_avg.iter_mut()) {
                element(c, p, g, s, Some(a), None);
            }
        }
        (false, true) => {
            for (((p, &g), s), b) in common.zip(buf.iter_mut()) {
                element(c, p, g, s, None, Some(b));
            }
        }
        (false, false) => {
            for ((p, &g), s) in common {
                element(c, p, g, s, None, None);
            }
        }
    }
}

/// Steps one piece.
fn rmsprop_update<T: Float>(
    config: &RmsPropConfig,
    state: &mut RmsPropPiece<T>,
    param: &mut [T],
    grad: &[T],
) {
    state.step += 1.0;
    let c = RmsPropCoefficients {
        sign: T::from_f64(if config.maximize { -1.0 } else { 1.0 }),
        weight_decay: T::from_f64(config.weight_decay),
        alpha: T::from_f64(config.alpha),
        one_minus_alpha: T::from_f64(1.0 - config.alpha),
        grad_avg_lerp: Lerp::new(1.0 - config.alpha),
        eps: T::from_f64(config.eps),
        momentum: T::from_f64(config.momentum),
        neg_lr: T::from_f64(-config.lr),
    };
    let weight_decay = config.weight_decay != 0.0;
    let centered = config.centered;
    let small = c.grad_avg_lerp.small;
    let momentum = config.momentum > 0.0;
    let len = grad.len();
    // Buffers are created zeroed on first use, also when an
    // option is switched on mid-training.
    let grad_avg: &mut [T] = if centered {
        state.grad_avg.get_or_insert_with(|| vec![T::ZERO; len])
    } else {
        &mut []
    };
    let buf: &mut [T] = if momentum {
        state
            .momentum_buffer
            .get_or_insert_with(|| vec![T::ZERO; len])
    } else {
        &mut []
    };
    let square_avg = &mut state.square_avg;
    match (centered, momentum) {
        (true, true) => for_each_chunk(
            grad,
            [param, square_avg, grad_avg, buf],
            |g, [p, s, a, b]| with_flags!(rmsprop_kernel [] (&c, p, g, s, a, b) weight_decay, true, small, true),
        ),
        (true, false) => for_each_chunk(
            grad,
            [param, square_avg, grad_avg],
            |g, [p, s, a]| with_flags!(rmsprop_kernel [] (&c, p, g, s, a, &mut []) weight_decay, true, small, false),
        ),
        (false, true) => for_each_chunk(
            grad,
            [param, square_avg, buf],
            |g, [p, s, b]| with_flags!(rmsprop_kernel [] (&c, p, g, s, &mut [], b) weight_decay, false, false, true),
        ),
        (false, false) => for_each_chunk(
            grad,
            [param, square_avg],
            |g, [p, s]| with_flags!(rmsprop_kernel [] (&c, p, g, s, &mut [], &mut []) weight_decay, false, false, false),
        ),
    }
}

optimizer! {
    /// `torch.optim.RMSprop`: divides the gradient by a running root mean
    /// square (minus the squared running mean when centered), with optional
    /// momentum and L2 weight decay.
    ///
    /// State per piece: `step` (scalar), `square_avg`, `momentum_buffer` with
    /// momentum, `grad_avg` when centered.
    pub struct RmsProp<T>(RmsPropConfig, RmsPropPiece);
    init: |_, len| RmsPropPiece {
        step: 0.0,
        square_avg: vec![T::ZERO; len],
        momentum_buffer: None,
        grad_avg: None,
    },
    update: rmsprop_update,
}
