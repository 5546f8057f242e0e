//! Stochastic gradient descent with momentum, dampening, Nesterov momentum,
//! weight decay and maximize, as `torch.optim.SGD`.

use super::core::{
    check_non_negative, for_each_chunk, forward_to_core, get_bool, get_f64, num, reject_leftovers,
    take_tensor, with_flags, Core, GroupConfig, PieceState,
};
use super::{Float, FunctionalOptimizer, Hyperparams, ParamMut, ParamState};
use crate::{Error, Result};

/// Hyperparameters of an [`Sgd`] parameter group; `Default` is PyTorch's.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SgdConfig {
    /// Learning rate (`lr`, default 1e-3).
    pub lr: f64,
    /// Momentum factor (`momentum`, default 0).
    pub momentum: f64,
    /// Dampening for momentum (`dampening`, default 0).
    pub dampening: f64,
    /// Nesterov momentum (`nesterov`, default false); needs momentum > 0 and
    /// zero dampening.
    pub nesterov: bool,
    /// L2 penalty added to the gradient (`weight_decay`, default 0).
    pub weight_decay: f64,
    /// Maximize the objective instead of minimizing (`maximize`, default false).
    pub maximize: bool,
}

impl Default for SgdConfig {
    fn default() -> Self {
        Self {
            lr: 1e-3,
            momentum: 0.0,
            dampening: 0.0,
            nesterov: false,
            weight_decay: 0.0,
            maximize: false,
        }
    }
}

impl SgdConfig {
    /// Sets the learning rate.
    pub fn with_lr(mut self, lr: f64) -> Self {
        self.lr = lr;
        self
    }
    /// Sets the momentum factor.
    pub fn with_momentum(mut self, momentum: f64) -> Self {
        self.momentum = momentum;
        self
    }
    /// Sets the dampening.
    pub fn with_dampening(mut self, dampening: f64) -> Self {
        self.dampening = dampening;
        self
    }
    /// Turns Nesterov momentum on or off.
    pub fn with_nesterov(mut self, nesterov: bool) -> Self {
        self.nesterov = nesterov;
        self
    }
    /// Sets the weight decay.
    pub fn with_weight_decay(mut self, weight_decay: f64) -> Self {
        self.weight_decay = weight_decay;
        self
    }
    /// Maximizes instead of minimizing.
    pub fn with_maximize(mut self, maximize: bool) -> Self {
        self.maximize = maximize;
        self
    }
}

impl GroupConfig for SgdConfig {
    const KEYS: &'static [&'static str] = &[
        "lr",
        "momentum",
        "dampening",
        "nesterov",
        "weight_decay",
        "maximize",
    ];
    const KIND: &'static str = "sgd";

    fn lr(&self) -> f64 {
        self.lr
    }
    fn set_lr(&mut self, lr: f64) {
        self.lr = lr;
    }
    fn to_hyperparams(&self) -> Hyperparams {
        let mut h = Hyperparams::new();
        h.insert("lr".into(), num(self.lr));
        h.insert("momentum".into(), num(self.momentum));
        h.insert("dampening".into(), num(self.dampening));
        h.insert("nesterov".into(), self.nesterov.into());
        h.insert("weight_decay".into(), num(self.weight_decay));
        h.insert("maximize".into(), self.maximize.into());
        h
    }
    fn apply(&mut self, h: &Hyperparams) -> Result<()> {
        let k = Self::KIND;
        self.lr = get_f64(k, h, "lr")?.unwrap_or(self.lr);
        self.momentum = get_f64(k, h, "momentum")?.unwrap_or(self.momentum);
        self.dampening = get_f64(k, h, "dampening")?.unwrap_or(self.dampening);
        self.nesterov = get_bool(k, h, "nesterov")?.unwrap_or(self.nesterov);
        self.weight_decay = get_f64(k, h, "weight_decay")?.unwrap_or(self.weight_decay);
        self.maximize = get_bool(k, h, "maximize")?.unwrap_or(self.maximize);
        Ok(())
    }
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

/// `torch.optim.SGD`: stochastic gradient descent with optional momentum
/// (the buffer starts as the first gradient), dampening, Nesterov momentum,
/// L2 weight decay and maximize.
///
/// State per piece: `momentum_buffer` (only when momentum is non-zero).
pub struct Sgd<T = f32> {
    core: Core<SgdConfig, SgdPiece<T>>,
}

impl<T: Float> Sgd<T> {
    /// An optimizer whose group 0 has `config`.
    pub fn new(config: SgdConfig) -> Result<Self> {
        Ok(Self {
            core: Core::new(config)?,
        })
    }

    /// Adds a parameter group with `config`; returns its index.
    pub fn add_param_group(&mut self, config: SgdConfig) -> Result<usize> {
        self.core.push_group(config)
    }

    /// The configuration of `group`, if it exists.
    pub fn config(&self, group: usize) -> Option<&SgdConfig> {
        self.core.groups.get(group)
    }
}

impl<T: Float> FunctionalOptimizer<T> for Sgd<T> {
    fn kind(&self) -> &str {
        SgdConfig::KIND
    }

    fn step(&mut self, params: &mut [ParamMut<'_, T>], grads: &[Option<&[T]>]) -> Result<()> {
        self.core.step(
            params,
            grads,
            |_, _| SgdPiece {
                momentum_buffer: None,
            },
            |config, state, param, grad| {
                let c = SgdCoefficients {
                    sign: T::from_f64(if config.maximize { -1.0 } else { 1.0 }),
                    weight_decay: T::from_f64(config.weight_decay),
                    momentum: T::from_f64(config.momentum),
                    one_minus_dampening: T::from_f64(1.0 - config.dampening),
                    neg_lr: T::from_f64(-config.lr),
                };
                let weight_decay = config.weight_decay != 0.0;
                if config.momentum == 0.0 {
                    for_each_chunk(grad, [param], |g, [p]| {
                        with_flags!(sgd_kernel [] (&c, p, g, &mut []) weight_decay, false, false, false)
                    });
                    return;
                }
                let first = state.momentum_buffer.is_none();
                let buffer = state
                    .momentum_buffer
                    .get_or_insert_with(|| vec![T::ZERO; grad.len()]);
                let nesterov = config.nesterov;
                for_each_chunk(grad, [param, buffer], |g, [p, b]| {
                    with_flags!(sgd_kernel [] (&c, p, g, b) weight_decay, true, first, nesterov)
                });
            },
        )
    }

    forward_to_core!();
}
