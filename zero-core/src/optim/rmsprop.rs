//! RMSprop (`torch.optim.RMSprop`), plain or centered, with optional
//! momentum.

use super::core::{
    check_non_negative, for_each_chunk, forward_to_core, get_bool, get_f64, missing, num,
    reject_leftovers, take_step, take_tensor, with_flags, Core, GroupConfig, Lerp, PieceState,
};
use super::{Float, FunctionalOptimizer, Hyperparams, ParamMut, ParamState};
use crate::Result;

/// Hyperparameters of an [`RmsProp`] parameter group; `Default` is PyTorch's.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RmsPropConfig {
    /// Learning rate (`lr`, default 1e-2).
    pub lr: f64,
    /// Smoothing constant of the square average (`alpha`, default 0.99).
    pub alpha: f64,
    /// Added to the denominator for stability (`eps`, default 1e-8).
    pub eps: f64,
    /// L2 penalty added to the gradient (`weight_decay`, default 0).
    pub weight_decay: f64,
    /// Momentum factor (`momentum`, default 0).
    pub momentum: f64,
    /// Normalize by the estimated variance instead of the second moment
    /// (`centered`, default false).
    pub centered: bool,
    /// Maximize the objective instead of minimizing (`maximize`, default false).
    pub maximize: bool,
}

impl Default for RmsPropConfig {
    fn default() -> Self {
        Self {
            lr: 1e-2,
            alpha: 0.99,
            eps: 1e-8,
            weight_decay: 0.0,
            momentum: 0.0,
            centered: false,
            maximize: false,
        }
    }
}

impl RmsPropConfig {
    /// Sets the learning rate.
    pub fn with_lr(mut self, lr: f64) -> Self {
        self.lr = lr;
        self
    }
    /// Sets the smoothing constant.
    pub fn with_alpha(mut self, alpha: f64) -> Self {
        self.alpha = alpha;
        self
    }
    /// Sets epsilon.
    pub fn with_eps(mut self, eps: f64) -> Self {
        self.eps = eps;
        self
    }
    /// Sets the weight decay.
    pub fn with_weight_decay(mut self, weight_decay: f64) -> Self {
        self.weight_decay = weight_decay;
        self
    }
    /// Sets the momentum factor.
    pub fn with_momentum(mut self, momentum: f64) -> Self {
        self.momentum = momentum;
        self
    }
    /// Turns the centered variant on or off.
    pub fn with_centered(mut self, centered: bool) -> Self {
        self.centered = centered;
        self
    }
    /// Maximizes instead of minimizing.
    pub fn with_maximize(mut self, maximize: bool) -> Self {
        self.maximize = maximize;
        self
    }
}

impl GroupConfig for RmsPropConfig {
    const KEYS: &'static [&'static str] = &[
        "lr",
        "alpha",
        "eps",
        "weight_decay",
        "momentum",
        "centered",
        "maximize",
    ];
    const KIND: &'static str = "rmsprop";

    fn lr(&self) -> f64 {
        self.lr
    }
    fn set_lr(&mut self, lr: f64) {
        self.lr = lr;
    }
    fn to_hyperparams(&self) -> Hyperparams {
        let mut h = Hyperparams::new();
        h.insert("lr".into(), num(self.lr));
        h.insert("alpha".into(), num(self.alpha));
        h.insert("eps".into(), num(self.eps));
        h.insert("weight_decay".into(), num(self.weight_decay));
        h.insert("momentum".into(), num(self.momentum));
        h.insert("centered".into(), self.centered.into());
        h.insert("maximize".into(), self.maximize.into());
        h
    }
    fn apply(&mut self, h: &Hyperparams) -> Result<()> {
        let k = Self::KIND;
        self.lr = get_f64(k, h, "lr")?.unwrap_or(self.lr);
        self.alpha = get_f64(k, h, "alpha")?.unwrap_or(self.alpha);
        self.eps = get_f64(k, h, "eps")?.unwrap_or(self.eps);
        self.weight_decay = get_f64(k, h, "weight_decay")?.unwrap_or(self.weight_decay);
        self.momentum = get_f64(k, h, "momentum")?.unwrap_or(self.momentum);
        self.centered = get_bool(k, h, "centered")?.unwrap_or(self.centered);
        self.maximize = get_bool(k, h, "maximize")?.unwrap_or(self.maximize);
        Ok(())
    }
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

/// `torch.optim.RMSprop`: divides the gradient by a running root mean
/// square (minus the squared running mean when centered), with optional
/// momentum and L2 weight decay.
///
/// State per piece: `step` (scalar), `square_avg`, `momentum_buffer` with
/// momentum, `grad_avg` when centered.
pub struct RmsProp<T = f32> {
    core: Core<RmsPropConfig, RmsPropPiece<T>>,
}

impl<T: Float> RmsProp<T> {
    /// An optimizer whose group 0 has `config`.
    pub fn new(config: RmsPropConfig) -> Result<Self> {
        Ok(Self {
            core: Core::new(config)?,
        })
    }

    /// Adds a parameter group with `config`; returns its index.
    pub fn add_param_group(&mut self, config: RmsPropConfig) -> Result<usize> {
        self.core.push_group(config)
    }

    /// The configuration of `group`, if it exists.
    pub fn config(&self, group: usize) -> Option<&RmsPropConfig> {
        self.core.groups.get(group)
    }
}

impl<T: Float> FunctionalOptimizer<T> for RmsProp<T> {
    fn kind(&self) -> &str {
        RmsPropConfig::KIND
    }

    fn step(&mut self, params: &mut [ParamMut<'_, T>], grads: &[Option<&[T]>]) -> Result<()> {
        self.core.step(
            params,
            grads,
            |_, len| RmsPropPiece {
                step: 0.0,
                square_avg: vec![T::ZERO; len],
                momentum_buffer: None,
                grad_avg: None,
            },
            |config, state, param, grad| {
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
                    (true, true) => for_each_chunk(grad, [param, square_avg, grad_avg, buf], |g, [p, s, a, b]| {
                        with_flags!(rmsprop_kernel [] (&c, p, g, s, a, b) weight_decay, true, small, true)
                    }),
                    (true, false) => for_each_chunk(grad, [param, square_avg, grad_avg], |g, [p, s, a]| {
                        with_flags!(rmsprop_kernel [] (&c, p, g, s, a, &mut []) weight_decay, true, small, false)
                    }),
                    (false, true) => for_each_chunk(grad, [param, square_avg, buf], |g, [p, s, b]| {
                        with_flags!(rmsprop_kernel [] (&c, p, g, s, &mut [], b) weight_decay, false, false, true)
                    }),
                    (false, false) => for_each_chunk(grad, [param, square_avg], |g, [p, s]| {
                        with_flags!(rmsprop_kernel [] (&c, p, g, s, &mut [], &mut []) weight_decay, false, false, false)
                    }),
                }
            },
        )
    }

    forward_to_core!();
}
