//! Builds the built-in optimizer the trainer's flags name.

use crate::trainer::{Args, OptimizerKind, TrainError};
use zero_core::optim::FunctionalOptimizer;

/// The optimizer `args` describes.
pub fn build(args: &Args) -> Result<Box<dyn FunctionalOptimizer<f32>>, TrainError> {
    let _ = (args, OptimizerKind::Sgd);
    Err(TrainError::Usage("optimizers are being written".into()))
}
