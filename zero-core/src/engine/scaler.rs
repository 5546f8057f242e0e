//! Loss scaling: the loss is multiplied by a scale before backward so that
//! small 16-bit gradients do not flush to zero; the engine divides the
//! reduced gradients by it again before clipping and the optimizer step.
//!
//! The dynamic scale follows PyTorch's `torch.amp.GradScaler`: it starts at
//! 2^16, is multiplied by the backoff factor (0.5) and the step skipped
//! when a gradient is inf or NaN on any rank, and grows by the growth
//! factor (2.0) after every `growth_interval` (2000) steps in a row without
//! one. Whether a step is skipped is decided by one all-reduce of one flag
//! (the largest absolute value of each rank's reduced gradient shard is
//! non-finite exactly when an inf or NaN reached it, and a sum with an inf
//! or NaN in it is never finite), so every rank skips alike and the scale
//! stays the same everywhere.

use crate::checkpoint::LossScalerState;
use crate::{Error, Result};
use serde::{Deserialize, Serialize};

/// How the loss is scaled before backward.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub enum LossScale {
    /// No scaling (f32 and bf16 models need none).
    #[default]
    None,
    /// A fixed scale. A step whose gradients hold an inf or NaN is still
    /// skipped on every rank; the scale does not change.
    Fixed(f64),
    /// PyTorch `GradScaler` semantics (see [`DynamicLossScale`]).
    Dynamic(DynamicLossScale),
}

/// The parameters of a dynamic loss scale, with `torch.amp.GradScaler`'s
/// names and defaults.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct DynamicLossScale {
    /// The first scale (2^16).
    pub init_scale: f64,
    /// What the scale is multiplied by after `growth_interval` clean steps
    /// (2.0).
    pub growth_factor: f64,
    /// What the scale is multiplied by after a step with an inf or NaN
    /// gradient (0.5).
    pub backoff_factor: f64,
    /// Clean steps in a row before the scale grows (2000).
    pub growth_interval: u64,
}

impl Default for DynamicLossScale {
    fn default() -> Self {
        Self {
            init_scale: 65536.0,
            growth_factor: 2.0,
            backoff_factor: 0.5,
            growth_interval: 2000,
        }
    }
}

impl LossScale {
    /// The default dynamic scale (`GradScaler()`).
    pub fn dynamic() -> Self {
        LossScale::Dynamic(DynamicLossScale::default())
    }

    pub(crate) fn validate(&self) -> Result<()> {
        let positive = |what: &str, v: f64| {
            if v.is_finite() && v > 0.0 {
                Ok(())
            } else {
                Err(Error::Config(format!(
                    "loss scale: {what} is {v}; use a positive finite number"
                )))
            }
        };
        match *self {
            LossScale::None => Ok(()),
            LossScale::Fixed(scale) => positive("the fixed scale", scale),
            LossScale::Dynamic(d) => {
                positive("init_scale", d.init_scale)?;
                if !(d.growth_factor > 1.0 && d.growth_factor.is_finite()) {
                    return Err(Error::Config(format!(
                        "loss scale: growth_factor is {}; it must be above 1 (GradScaler's \
                         default is 2.0)",
                        d.growth_factor
                    )));
                }
                if !(d.backoff_factor > 0.0 && d.backoff_factor < 1.0) {
                    return Err(Error::Config(format!(
                        "loss scale: backoff_factor is {}; it must be between 0 and 1 \
                         (GradScaler's default is 0.5)",
                        d.backoff_factor
                    )));
                }
                if d.growth_interval == 0 {
                    return Err(Error::Config(
                        "loss scale: growth_interval is 0; use a positive number of steps \
                         (GradScaler's default is 2000)"
                            .into(),
                    ));
                }
                Ok(())
            }
        }
    }
}

/// A loss scaler: the configuration and its state.
#[derive(Clone, Debug)]
pub(crate) struct LossScaler {
    config: LossScale,
    state: LossScalerState,
    /// Whether the last completed step was skipped, and the scale its
    /// gradients were divided by.
    last: Option<(bool, f64)>,
}

impl LossScaler {
    /// The scaler `config` asks for (`None` without scaling).
    pub(crate) fn new(config: LossScale) -> Option<Self> {
        let scale = match config {
            LossScale::None => return None,
            LossScale::Fixed(scale) => scale,
            LossScale::Dynamic(d) => d.init_scale,
        };
        Some(Self {
            config,
            state: LossScalerState {
                scale,
                growth_tracker: 0,
            },
            last: None,
        })
    }

    /// The scale gradients are divided by now.
    pub(crate) fn scale(&self) -> f64 {
        self.state.scale
    }

    /// The state a checkpoint keeps.
    pub(crate) fn state(&self) -> LossScalerState {
        self.state
    }

    /// Restores a checkpoint's state; a fixed scale, which never changes,
    /// keeps its own.
    pub(crate) fn restore(&mut self, state: LossScalerState) {
        if matches!(self.config, LossScale::Dynamic(_)) {
            self.state = state;
        }
    }

    /// Whether the last completed step was skipped for an inf or NaN
    /// gradient, and the scale its gradients were divided by.
    pub(crate) fn outcome(&self) -> (bool, Option<f64>) {
        match self.last {
            Some((skipped, scale)) => (skipped, Some(scale)),
            None => (false, None),
        }
    }

    /// After a step whose gradients were divided by `scale`: records it,
    /// and updates the scale.
    pub(crate) fn stepped(&mut self, found_inf: bool, scale: f64) {
        self.last = Some((found_inf, scale));
        self.update(found_inf);
    }

    /// After a step: `GradScaler.update` (torch's `_amp_update_scale_`,
    /// which keeps the scale as an f32 and only grows it while the grown
    /// value is finite).
    fn update(&mut self, found_inf: bool) {
        let LossScale::Dynamic(d) = self.config else {
            return;
        };
        let state = &mut self.state;
        if found_inf {
            state.scale = f64::from((state.scale * d.backoff_factor) as f32);
            state.growth_tracker = 0;
        } else {
            state.growth_tracker += 1;
            if state.growth_tracker == d.growth_interval {
                let grown = (state.scale * d.growth_factor) as f32;
                if grown.is_finite() {
                    state.scale = f64::from(grown);
                }
                state.growth_tracker = 0;
            }
        }
    }
}
