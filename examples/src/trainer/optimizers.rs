//! Builds the built-in optimizer the trainer's flags name.

use super::{Args, OptimizerKind, TrainError};
use zero_core::optim::{
    Adagrad, AdagradConfig, Adam, AdamConfig, AdamW, AdamWConfig, Float, FunctionalOptimizer,
    RmsProp, RmsPropConfig, Sgd, SgdConfig,
};

/// The optimizer `args` describes, stepping elements `T` (f32, or a
/// 16-bit type without master weights); invalid hyperparameters are an
/// error naming the flag's value.
pub fn build<T: Float>(args: &Args) -> Result<Box<dyn FunctionalOptimizer<T>>, TrainError> {
    let (beta1, beta2) = match args.betas.as_slice() {
        [b1, b2] => (*b1, *b2),
        other => {
            return Err(TrainError::Usage(format!(
                "--betas takes two values, got {other:?}"
            )))
        }
    };
    let built: zero_core::Result<Box<dyn FunctionalOptimizer<T>>> = match args.optimizer {
        OptimizerKind::Sgd => Sgd::new(
            SgdConfig::default()
                .with_lr(args.lr)
                .with_momentum(args.momentum)
                .with_nesterov(args.nesterov)
                .with_weight_decay(args.weight_decay.unwrap_or(0.0)),
        )
        .map(|o| Box::new(o) as _),
        OptimizerKind::Adam => {
            let mut c = AdamConfig::default()
                .with_lr(args.lr)
                .with_betas(beta1, beta2)
                .with_weight_decay(args.weight_decay.unwrap_or(0.0));
            if let Some(eps) = args.eps {
                c = c.with_eps(eps);
            }
            Adam::new(c).map(|o| Box::new(o) as _)
        }
        OptimizerKind::Adamw => {
            let mut c = AdamWConfig::default()
                .with_lr(args.lr)
                .with_betas(beta1, beta2);
            if let Some(wd) = args.weight_decay {
                c = c.with_weight_decay(wd);
            }
            if let Some(eps) = args.eps {
                c = c.with_eps(eps);
            }
            AdamW::new(c).map(|o| Box::new(o) as _)
        }
        OptimizerKind::Adagrad => {
            let mut c = AdagradConfig::default()
                .with_lr(args.lr)
                .with_weight_decay(args.weight_decay.unwrap_or(0.0));
            if let Some(eps) = args.eps {
                c = c.with_eps(eps);
            }
            Adagrad::new(c).map(|o| Box::new(o) as _)
        }
        OptimizerKind::Rmsprop => {
            let mut c = RmsPropConfig::default()
                .with_lr(args.lr)
                .with_momentum(args.momentum)
                .with_weight_decay(args.weight_decay.unwrap_or(0.0));
            if let Some(eps) = args.eps {
                c = c.with_eps(eps);
            }
            RmsProp::new(c).map(|o| Box::new(o) as _)
        }
    };
    built.map_err(|e| TrainError::Usage(format!("invalid optimizer flags: {e}")))
}
