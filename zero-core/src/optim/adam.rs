//! Adam and AdamW (`torch.optim.Adam`, `torch.optim.AdamW`), which share one
//! fused kernel: AdamW only moves the weight decay from the gradient (L2) to
//! the parameter (decoupled).

use super::core::{
    check_non_negative, check_unit_interval, for_each_chunk, group_config, missing, optimizer,
    reject_leftovers, take_step, take_tensor, with_flags, GroupConfig, GroupFields, Lerp,
    PieceState,
};
use super::{Float, ParamState};
use crate::Result;

macro_rules! adam_config {
    ($(#[$doc:meta])* $name:ident, $kind:literal, $weight_decay:literal, $decoupled:literal) => {
        group_config! {
            $(#[$doc])*
            pub struct $name($kind) {
                /// Learning rate (`lr`, default 1e-3).
                pub lr: f64 = 1e-3,
                    /// Sets the learning rate.
                    fn with_lr;
                /// Decay rates of the first and second moment averages (`betas`,
                /// default (0.9, 0.999)), each in [0, 1).
                pub betas: (f64, f64) = (0.9, 0.999);
                /// Added to the denominator for stability (`eps`, default 1e-8).
                pub eps: f64 = 1e-8,
                    /// Sets epsilon.
                    fn with_eps;
                #[doc = concat!("Weight decay (`weight_decay`, default ", stringify!($weight_decay), ").")]
                pub weight_decay: f64 = $weight_decay,
                    /// Sets the weight decay.
                    fn with_weight_decay;
                /// Use the AMSGrad variant (`amsgrad`, default false).
                pub amsgrad: bool = false,
                    /// Turns AMSGrad on or off.
                    fn with_amsgrad;
                /// Maximize the objective instead of minimizing (`maximize`, default false).
                pub maximize: bool = false,
                    /// Maximizes instead of minimizing.
                    fn with_maximize;
            }
        }

        impl $name {
            /// Sets the moment decay rates.
            pub fn with_betas(mut self, beta1: f64, beta2: f64) -> Self {
                self.betas = (beta1, beta2);
                self
            }
        }

        impl GroupConfig for $name {
            fn validate(&self) -> Result<()> {
                let k = Self::KIND;
                check_non_negative(k, "learning rate", self.lr)?;
                check_non_negative(k, "epsilon", self.eps)?;
                check_unit_interval(k, "beta parameter at index 0", self.betas.0)?;
                check_unit_interval(k, "beta parameter at index 1", self.betas.1)?;
                check_non_negative(k, "weight_decay", self.weight_decay)
            }
        }

        impl AdamHyper for $name {
            const DECOUPLED: bool = $decoupled;
            fn adam(&self) -> AdamConfig {
                AdamConfig {
                    lr: self.lr,
                    betas: self.betas,
                    eps: self.eps,
                    weight_decay: self.weight_decay,
                    amsgrad: self.amsgrad,
                    maximize: self.maximize,
                }
            }
        }
    };
}

adam_config!(
    /// Hyperparameters of an [`Adam`] parameter group; `Default` is PyTorch's.
    AdamConfig, "adam", 0.0, false
);
adam_config!(
    /// Hyperparameters of an [`AdamW`] parameter group; `Default` is
    /// PyTorch's (weight decay 1e-2).
    AdamWConfig, "adamw", 1e-2, true
);

/// What the shared kernel needs from either config.
trait AdamHyper: GroupConfig {
    /// AdamW: decay the parameter, not the gradient.
    const DECOUPLED: bool;
    /// The fields, as an [`AdamConfig`].
    fn adam(&self) -> AdamConfig;
}

/// Adam state of one piece.
pub(crate) struct AdamPiece<T> {
    step: f64,
    exp_avg: Vec<T>,
    exp_avg_sq: Vec<T>,
    max_exp_avg_sq: Option<Vec<T>>,
}

impl<T: Float> AdamPiece<T> {
    fn new(len: usize, amsgrad: bool) -> Self {
        Self {
            step: 0.0,
            exp_avg: vec![T::ZERO; len],
            exp_avg_sq: vec![T::ZERO; len],
            max_exp_avg_sq: amsgrad.then(|| vec![T::ZERO; len]),
        }
    }
}

impl<T: Float> PieceState<T> for AdamPiece<T> {
    fn bytes(&self) -> usize {
        (self.exp_avg.len()
            + self.exp_avg_sq.len()
            + self.max_exp_avg_sq.as_ref().map_or(0, Vec::len))
            * std::mem::size_of::<T>()
            + std::mem::size_of::<f64>()
    }
    fn len(&self) -> Option<usize> {
        Some(self.exp_avg.len())
    }
    fn export(&self) -> ParamState<T> {
        let mut state = ParamState::default();
        state.scalars.insert("step".into(), self.step);
        state.tensors.insert("exp_avg".into(), self.exp_avg.clone());
        state
            .tensors
            .insert("exp_avg_sq".into(), self.exp_avg_sq.clone());
        if let Some(max) = &self.max_exp_avg_sq {
            state.tensors.insert("max_exp_avg_sq".into(), max.clone());
        }
        state
    }
    fn export_into(&self, out: &mut ParamState<T>) {
        out.scalars.clear();
        out.scalars.insert("step".into(), self.step);
        let mut copy = |name: &str, from: Option<&Vec<T>>| match from {
            Some(from) => {
                let to = out.tensors.entry(name.into()).or_default();
                to.clear();
                to.extend_from_slice(from);
            }
            None => {
                out.tensors.remove(name);
            }
        };
        copy("exp_avg", Some(&self.exp_avg));
        copy("exp_avg_sq", Some(&self.exp_avg_sq));
        copy("max_exp_avg_sq", self.max_exp_avg_sq.as_ref());
        out.tensors
            .retain(|name, _| matches!(name.as_str(), "exp_avg" | "exp_avg_sq" | "max_exp_avg_sq"));
    }
    fn import(kind: &str, name: &str, mut state: ParamState<T>) -> Result<Self> {
        let mut len = None;
        let step = take_step(kind, name, &mut state)?;
        let exp_avg = take_tensor(kind, name, &mut state, "exp_avg", &mut len)?
            .ok_or_else(|| missing(kind, name, "exp_avg"))?;
        let exp_avg_sq = take_tensor(kind, name, &mut state, "exp_avg_sq", &mut len)?
            .ok_or_else(|| missing(kind, name, "exp_avg_sq"))?;
        let max_exp_avg_sq = take_tensor(kind, name, &mut state, "max_exp_avg_sq", &mut len)?;
        reject_leftovers(kind, name, &state)?;
        Ok(Self {
            step,
            exp_avg,
            exp_avg_sq,
            max_exp_avg_sq,
        })
    }
}

/// Scalars of one Adam step of one piece, converted to `T` once, in the
/// order `torch.optim.Adam` (single-tensor) derives them.
struct AdamCoefficients<T> {
    sign: T,
    weight_decay: T,
    /// `1 - lr * weight_decay` for AdamW, exactly 1 otherwise.
    param_decay: T,
    lerp: Lerp<T>,
    beta2: T,
    one_minus_beta2: T,
    bias_correction2_sqrt: T,
    eps: T,
    neg_step_size: T,
}

impl<T: Float> AdamCoefficients<T> {
    fn new(c: &AdamConfig, decoupled: bool, step: f64) -> Self {
        let (beta1, beta2) = c.betas;
        let bias_correction1 = 1.0 - beta1.powf(step);
        let bias_correction2 = 1.0 - beta2.powf(step);
        let step_size = c.lr / bias_correction1;
        Self {
            sign: T::from_f64(if c.maximize { -1.0 } else { 1.0 }),
            weight_decay: T::from_f64(c.weight_decay),
            param_decay: T::from_f64(if decoupled && c.weight_decay != 0.0 {
                1.0 - c.lr * c.weight_decay
            } else {
                1.0
            }),
            lerp: Lerp::new(1.0 - beta1),
            beta2: T::from_f64(beta2),
            one_minus_beta2: T::from_f64(1.0 - beta2),
            bias_correction2_sqrt: T::from_f64(bias_correction2.sqrt()),
            eps: T::from_f64(c.eps),
            neg_step_size: T::from_f64(-step_size),
        }
    }
}

/// The element update shared by the AMSGrad and plain loops.
#[inline(always)]
fn adam_element<T: Float, const L2: bool, const LERP_SMALL: bool>(
    c: &AdamCoefficients<T>,
    p: &mut T,
    g: T,
    m: &mut T,
    v: &mut T,
    v_max: Option<&mut T>,
) {
    let mut g = g * c.sign;
    if L2 {
        g = g + c.weight_decay * *p;
    }
    // Exactly 1 unless AdamW, and multiplying by 1 is exact.
    let decayed = *p * c.param_decay;
    *m = c.lerp.apply::<LERP_SMALL>(*m, g);
    *v = *v * c.beta2 + c.one_minus_beta2 * g * g;
    let second = match v_max {
        Some(v_max) => {
            *v_max = v_max.maximum(*v);
            *v_max
        }
        None => *v,
    };
    let denom = second.sqrt() / c.bias_correction2_sqrt + c.eps;
    *p = decayed + c.neg_step_size * *m / denom;
}

/// One fused pass of the single-tensor Adam/AdamW update over a chunk.
/// `v_max` is only read when `AMSGRAD`.
#[inline(always)]
fn adam_kernel<T: Float, const L2: bool, const LERP_SMALL: bool, const AMSGRAD: bool>(
    c: &AdamCoefficients<T>,
    param: &mut [T],
    grad: &[T],
    exp_avg: &mut [T],
    exp_avg_sq: &mut [T],
    v_max: &mut [T],
) {
    let common = param
        .iter_mut()
        .zip(grad)
        .zip(exp_avg.iter_mut())
        .zip(exp_avg_sq.iter_mut());
    if AMSGRAD {
        for ((((p, &g), m), v), x) in common.zip(v_max.iter_mut()) {
            adam_element::<T, L2, LERP_SMALL>(c, p, g, m, v, Some(x));
        }
    } else {
        for (((p, &g), m), v) in common {
            adam_element::<T, L2, LERP_SMALL>(c, p, g, m, v, None);
        }
    }
}

/// Steps one piece; shared by [`Adam`] and [`AdamW`].
fn adam_update<T: Float, C: AdamHyper>(
    config: &C,
    state: &mut AdamPiece<T>,
    param: &mut [T],
    grad: &[T],
) {
    let config_adam = config.adam();
    state.step += 1.0;
    let c = AdamCoefficients::<T>::new(&config_adam, C::DECOUPLED, state.step);
    let l2 = !C::DECOUPLED && config_adam.weight_decay != 0.0;
    let small = c.lerp.small;
    let AdamPiece {
        exp_avg,
        exp_avg_sq,
        max_exp_avg_sq,
        ..
    } = state;
    if config_adam.amsgrad {
        // Created here too when AMSGrad is switched on mid-training.
        let v_max = max_exp_avg_sq.get_or_insert_with(|| vec![T::ZERO; grad.len()]);
        for_each_chunk(
            grad,
            [param, exp_avg, exp_avg_sq, v_max],
            |g, [p, m, v, x]| with_flags!(adam_kernel [] (&c, p, g, m, v, x) l2, small, true),
        );
    } else {
        for_each_chunk(
            grad,
            [param, exp_avg, exp_avg_sq],
            |g, [p, m, v]| with_flags!(adam_kernel [] (&c, p, g, m, v, &mut []) l2, small, false),
        );
    }
}

optimizer! {
    /// `torch.optim.Adam`: adaptive moments with bias correction; weight
    /// decay is an L2 term added to the gradient.
    ///
    /// State per piece: `step` (scalar), `exp_avg`, `exp_avg_sq`, and
    /// `max_exp_avg_sq` with AMSGrad.
    pub struct Adam<T>(AdamConfig, AdamPiece);
    init: |config, len| AdamPiece::new(len, config.amsgrad),
    update: adam_update,
}

optimizer! {
    /// `torch.optim.AdamW`: Adam with decoupled weight decay (the parameter
    /// is multiplied by `1 - lr * weight_decay` before the update).
    ///
    /// State per piece: `step` (scalar), `exp_avg`, `exp_avg_sq`, and
    /// `max_exp_avg_sq` with AMSGrad.
    pub struct AdamW<T>(AdamWConfig, AdamPiece);
    init: |config, len| AdamPiece::new(len, config.amsgrad),
    update: adam_update,
}
