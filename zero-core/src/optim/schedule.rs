//! Learning-rate schedules: linear warmup, then a constant, linear or cosine
//! rate down to a floor, as a function of the optimizer step.

use crate::{bail_config, Result};

/// What the learning rate does after the warmup.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum LrDecay {
    /// Stays at the peak learning rate.
    Constant,
    /// Falls linearly from the peak at the end of the warmup to `min_lr` at
    /// `total_steps`, and stays there.
    Linear {
        /// The step at which the rate reaches `min_lr` (counting the
        /// warmup).
        total_steps: u64,
        /// The floor, at most the peak learning rate.
        min_lr: f64,
    },
    /// Falls along a half cosine from the peak at the end of the warmup to
    /// `min_lr` at `total_steps`, and stays there.
    Cosine {
        /// The step at which the rate reaches `min_lr` (counting the
        /// warmup).
        total_steps: u64,
        /// The floor, at most the peak learning rate.
        min_lr: f64,
    },
}

/// A learning rate per optimizer step: linear warmup from 0 to `lr`, then
/// an [`LrDecay`].
///
/// [`LrSchedule::lr_at`] gives the learning rate of optimizer step `step`
/// (counted from 0: the step about to be taken). The values are those of
/// `transformers`' schedules, which wrap `torch.optim.lr_scheduler.LambdaLR`
/// and are stepped once after each optimizer step:
/// - warmup: `lr * step / warmup_steps` for `step < warmup_steps`, so the
///   first step has learning rate 0 and step `warmup_steps` the peak `lr`
///   (`get_*_schedule_with_warmup`);
/// - [`LrDecay::Cosine`]: `min_lr + (lr - min_lr) * (1 + cos(pi * p)) / 2`,
///   with `p = (step - warmup_steps) / (total_steps - warmup_steps)`
///   (`get_cosine_with_min_lr_schedule_with_warmup`, which is
///   `get_cosine_schedule_with_warmup` when `min_lr` is 0);
/// - [`LrDecay::Linear`]: `min_lr + (lr - min_lr) * (1 - p)`
///   (`get_linear_schedule_with_warmup` when `min_lr` is 0; the floor is
///   applied as the cosine one is, the way nanoGPT's `train.py` does);
/// - [`LrDecay::Constant`]: `lr` (`get_constant_schedule_with_warmup`);
/// - from `total_steps` on, the decays hold `min_lr` (nanoGPT's rule;
///   `transformers`' cosine would climb back up there).
///
/// The schedule only computes rates; the loop hands each to the optimizer
/// before the step. With `zero_candle::ZeroOptimizer`, that is
/// `opt.set_learning_rate(schedule.lr_at(opt.engine().steps()))` before
/// each `backward_step` (`candle_nn::Optimizer::set_learning_rate`, which
/// sets every parameter group): the engine's step counter counts completed
/// optimizer steps, so the rate is right with gradient accumulation too, and
/// a loaded checkpoint restores the counter, so a resumed run continues the
/// schedule where it stopped. Steps skipped by loss scaling do not advance
/// the counter. [`Engine::set_learning_rate`](crate::Engine::set_learning_rate)
/// and [`FunctionalOptimizer::set_learning_rate`](super::FunctionalOptimizer::set_learning_rate)
/// take the rate the same way.
///
/// ```
/// use zero_core::optim::{FunctionalOptimizer, LrDecay, LrSchedule, Sgd, SgdConfig};
///
/// // 100 steps: 10 of warmup to 0.1, then a cosine down to 0.01.
/// let decay = LrDecay::Cosine { total_steps: 100, min_lr: 0.01 };
/// let schedule = LrSchedule::new(0.1, 10, decay)?;
/// let mut sgd = Sgd::<f32>::new(SgdConfig::default().with_lr(0.1))?;
/// for step in 0..100 {
///     sgd.set_learning_rate(0, schedule.lr_at(step));
///     // ... gradients, then sgd.step(...)
/// }
/// assert_eq!(schedule.lr_at(0), 0.0);
/// assert_eq!(schedule.lr_at(5), 0.05);
/// assert_eq!(schedule.lr_at(10), 0.1);
/// assert!((schedule.lr_at(55) - 0.055).abs() < 1e-12); // half way down
/// assert_eq!(schedule.lr_at(100), 0.01);
/// assert_eq!(schedule.lr_at(1_000), 0.01);
/// # Ok::<(), zero_core::Error>(())
/// ```
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LrSchedule {
    lr: f64,
    warmup_steps: u64,
    decay: LrDecay,
}

impl LrSchedule {
    /// A schedule that warms up from 0 to `lr` over `warmup_steps` steps
    /// (0 for none), then follows `decay`. Fails on a learning rate that is
    /// negative or not finite, a floor above `lr`, a decay that ends before
    /// the warmup does, or a decay over no steps.
    pub fn new(lr: f64, warmup_steps: u64, decay: LrDecay) -> Result<Self> {
        check_rate("lr", lr)?;
        if let LrDecay::Linear {
            total_steps,
            min_lr,
        }
        | LrDecay::Cosine {
            total_steps,
            min_lr,
        } = decay
        {
            check_rate("min_lr", min_lr)?;
            if min_lr > lr {
                bail_config!(
                    "learning-rate schedule: min_lr {min_lr} is above the peak lr {lr}; the \
                     decay falls from lr to min_lr, so give a min_lr of at most lr"
                );
            }
            if total_steps == 0 {
                bail_config!(
                    "learning-rate schedule: total_steps is 0; give the number of optimizer \
                     steps the decay ends at (warmup included), or use LrDecay::Constant"
                );
            }
            if warmup_steps > total_steps {
                bail_config!(
                    "learning-rate schedule: warmup_steps {warmup_steps} is more than \
                     total_steps {total_steps}; the warmup must end before the decay does: use \
                     fewer warmup steps or more total steps"
                );
            }
        }
        Ok(Self {
            lr,
            warmup_steps,
            decay,
        })
    }

    /// A constant learning rate `lr` (no warmup).
    pub fn constant(lr: f64) -> Result<Self> {
        Self::new(lr, 0, LrDecay::Constant)
    }

    /// The peak learning rate.
    pub fn peak_lr(&self) -> f64 {
        self.lr
    }

    /// Steps of linear warmup.
    pub fn warmup_steps(&self) -> u64 {
        self.warmup_steps
    }

    /// What follows the warmup.
    pub fn decay(&self) -> LrDecay {
        self.decay
    }

    /// The learning rate of optimizer step `step` (from 0: the step about
    /// to be taken).
    pub fn lr_at(&self, step: u64) -> f64 {
        let (lr, warmup) = (self.lr, self.warmup_steps);
        if step < warmup {
            // As `transformers` computes it: the ratio first, then times lr.
            return lr * (step as f64 / warmup as f64);
        }
        let (total, min_lr, cosine) = match self.decay {
            LrDecay::Constant => return lr,
            LrDecay::Linear {
                total_steps,
                min_lr,
            } => (total_steps, min_lr, false),
            LrDecay::Cosine {
                total_steps,
                min_lr,
            } => (total_steps, min_lr, true),
        };
        if step >= total {
            return min_lr;
        }
        // `total > step >= warmup`, so the span is at least 1.
        let progress = (step - warmup) as f64 / (total - warmup) as f64;
        let remaining = if cosine {
            0.5 * (1.0 + (std::f64::consts::PI * progress).cos())
        } else {
            (total - step) as f64 / (total - warmup) as f64
        };
        min_lr + (lr - min_lr) * remaining
    }
}

/// Fails unless `value` is a finite rate, at least 0.
fn check_rate(name: &str, value: f64) -> Result<()> {
    if !(value.is_finite() && value >= 0.0) {
        bail_config!(
            "learning-rate schedule: {name} is {value}; give a finite learning rate of at \
             least 0"
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config_message(result: Result<LrSchedule>) -> String {
        match result {
            Err(crate::Error::Config(message)) => message,
            other => panic!("expected a configuration error, got {other:?}"),
        }
    }

    #[test]
    fn bad_inputs_are_configuration_errors_that_say_what_to_do() {
        let cosine = |total_steps, min_lr| LrDecay::Cosine {
            total_steps,
            min_lr,
        };
        let cases = [
            (LrSchedule::new(-1e-3, 0, LrDecay::Constant), "lr is -0.001"),
            (LrSchedule::constant(f64::NAN), "lr is NaN"),
            (LrSchedule::constant(f64::INFINITY), "lr is inf"),
            (LrSchedule::new(1e-3, 0, cosine(10, -1.0)), "min_lr is -1"),
            (
                LrSchedule::new(1e-3, 0, cosine(10, f64::NAN)),
                "min_lr is NaN",
            ),
            (
                LrSchedule::new(1e-3, 0, cosine(10, 1e-2)),
                "min_lr 0.01 is above the peak lr 0.001",
            ),
            (LrSchedule::new(1e-3, 0, cosine(0, 0.0)), "total_steps is 0"),
            (
                LrSchedule::new(
                    1e-3,
                    11,
                    LrDecay::Linear {
                        total_steps: 10,
                        min_lr: 0.0,
                    },
                ),
                "warmup_steps 11 is more than total_steps 10",
            ),
        ];
        for (result, needle) in cases {
            let message = config_message(result);
            assert!(message.contains(needle), "{message:?} lacks {needle:?}");
        }
    }

    #[test]
    fn a_constant_schedule_is_its_rate_at_every_step() {
        let schedule = LrSchedule::constant(3e-4).unwrap();
        for step in [0, 1, 7, u64::MAX] {
            assert_eq!(schedule.lr_at(step), 3e-4);
        }
    }

    #[test]
    fn a_warmup_as_long_as_the_decay_drops_to_the_floor_at_its_end() {
        let decay = LrDecay::Linear {
            total_steps: 4,
            min_lr: 0.1,
        };
        let schedule = LrSchedule::new(1.0, 4, decay).unwrap();
        let rates: Vec<f64> = (0..6).map(|s| schedule.lr_at(s)).collect();
        assert_eq!(rates, [0.0, 0.25, 0.5, 0.75, 0.1, 0.1]);
    }

    #[test]
    fn the_decays_are_monotone_and_end_at_the_floor() {
        for decay in [
            LrDecay::Linear {
                total_steps: 50,
                min_lr: 1e-4,
            },
            LrDecay::Cosine {
                total_steps: 50,
                min_lr: 1e-4,
            },
        ] {
            let schedule = LrSchedule::new(1e-3, 5, decay).unwrap();
            let rates: Vec<f64> = (5..=50).map(|s| schedule.lr_at(s)).collect();
            assert_eq!(rates[0], 1e-3, "{decay:?}");
            assert!(rates.windows(2).all(|w| w[1] < w[0]), "{decay:?}");
            assert_eq!(*rates.last().unwrap(), 1e-4, "{decay:?}");
        }
    }
}
