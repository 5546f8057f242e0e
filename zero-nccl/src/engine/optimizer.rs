//! The device side of a built-in optimizer: hyperparameters read from the
//! host optimizer the user configured, state as flat buffers over the whole
//! shard, steps as fused kernel launches over [`Segment`]s.

use super::segments::Segment;
use crate::kernels::{
    AdagradHyper, AdagradState, AdamHyper, AdamState, FusedKernels, RmspropHyper, RmspropState,
    SgdHyper, SgdState,
};
use cudarc::driver::{CudaSlice, CudaStream};
use std::sync::Arc;
use zero_core::optim::{FunctionalOptimizer, Hyperparams};
use zero_core::{Error, Result};

/// Kernels, hyperparameters per group and the flat state of one optimizer.
#[derive(Debug)]
pub(crate) enum DeviceOptimizer {
    Sgd(Vec<SgdHyper>, SgdState),
    Adam(Vec<AdamHyper>, AdamState),
    Adagrad(Vec<AdagradHyper>, AdagradState),
    Rmsprop(Vec<RmspropHyper>, RmspropState),
}

fn number(kind: &str, h: &Hyperparams, key: &str) -> Result<f64> {
    h.get(key).and_then(|v| v.as_f64()).ok_or_else(|| {
        Error::Config(format!(
            "{kind} hyperparameters lack a numeric {key:?}; the device engine reads the \
             built-in optimizers' hyperparameters"
        ))
    })
}

fn flag(kind: &str, h: &Hyperparams, key: &str) -> Result<bool> {
    h.get(key)
        .and_then(|v| v.as_bool())
        .ok_or_else(|| Error::Config(format!("{kind} hyperparameters lack a boolean {key:?}")))
}

fn pair(kind: &str, h: &Hyperparams, key: &str) -> Result<(f64, f64)> {
    let values = h.get(key).and_then(|v| v.as_array());
    match values.map(|a| a.iter().map(|x| x.as_f64()).collect::<Vec<_>>()) {
        Some(v) if v.len() == 2 && v.iter().all(Option::is_some) => {
            Ok((v[0].unwrap_or_default(), v[1].unwrap_or_default()))
        }
        _ => Err(Error::Config(format!(
            "{kind} hyperparameters lack a pair {key:?}"
        ))),
    }
}

/// The kinds the fused kernels implement.
pub const DEVICE_KINDS: [&str; 5] = ["sgd", "adam", "adamw", "adagrad", "rmsprop"];

impl DeviceOptimizer {
    /// Allocates the state for a shard of `shard_numel` elements for the
    /// optimizer `host` describes. `groups_of_range` gives each owned piece's
    /// shard range and group (Adagrad starts its sums at the group's value).
    pub fn new(
        host: &dyn FunctionalOptimizer<f32>,
        stream: &Arc<CudaStream>,
        shard_numel: usize,
        groups_of_range: &[(std::ops::Range<usize>, usize)],
    ) -> Result<Self> {
        let cuda = |e: cudarc::driver::DriverError| Error::from(crate::Error::from(e));
        let zeros = |n: usize| -> Result<CudaSlice<f32>> { stream.alloc_zeros(n).map_err(cuda) };
        Ok(match host.kind() {
            "sgd" => Self::Sgd(Vec::new(), SgdState::new()),
            "adam" | "adamw" => Self::Adam(
                Vec::new(),
                AdamState {
                    exp_avg: zeros(shard_numel)?,
                    exp_avg_sq: zeros(shard_numel)?,
                    max_exp_avg_sq: None,
                    step: 0,
                },
            ),
            "adagrad" => {
                let mut init = vec![0f32; shard_numel];
                for (range, group) in groups_of_range {
                    let h = host.hyperparams(*group);
                    let value = number("adagrad", &h, "initial_accumulator_value")? as f32;
                    init[range.clone()].fill(value);
                }
                Self::Adagrad(
                    Vec::new(),
                    AdagradState {
                        sum: stream.clone_htod(&init).map_err(cuda)?,
                        step: 0,
                    },
                )
            }
            "rmsprop" => Self::Rmsprop(
                Vec::new(),
                RmspropState {
                    square_avg: zeros(shard_numel)?,
                    grad_avg: None,
                    momentum_buffer: None,
                    step: 0,
                },
            ),
            other => {
                return Err(Error::Config(format!(
                    "optimizer {other:?} has no fused CUDA kernel; the device engine runs {}. \
                     Use one of them, or train through the host engine (threads or MPI backend)",
                    DEVICE_KINDS.join(", ")
                )))
            }
        })
    }

    /// Reads every group's hyperparameters from the host optimizer (after
    /// construction, and whenever they may have changed).
    pub fn refresh(&mut self, host: &dyn FunctionalOptimizer<f32>) -> Result<()> {
        let kind = host.kind().to_string();
        let k = kind.as_str();
        let groups = (0..host.num_groups()).map(|g| host.hyperparams(g));
        match self {
            Self::Sgd(hyper, _) => {
                *hyper = groups
                    .map(|h| {
                        Ok(SgdHyper {
                            lr: number(k, &h, "lr")?,
                            momentum: number(k, &h, "momentum")?,
                            dampening: number(k, &h, "dampening")?,
                            weight_decay: number(k, &h, "weight_decay")?,
                            nesterov: flag(k, &h, "nesterov")?,
                            maximize: flag(k, &h, "maximize")?,
                        })
                    })
                    .collect::<Result<_>>()?
            }
            Self::Adam(hyper, _) => {
                *hyper = groups
                    .map(|h| {
                        Ok(AdamHyper {
                            lr: number(k, &h, "lr")?,
                            betas: pair(k, &h, "betas")?,
                            eps: number(k, &h, "eps")?,
                            weight_decay: number(k, &h, "weight_decay")?,
                            amsgrad: flag(k, &h, "amsgrad")?,
                            maximize: flag(k, &h, "maximize")?,
                            decoupled_weight_decay: k == "adamw",
                        })
                    })
                    .collect::<Result<_>>()?
            }
            Self::Adagrad(hyper, _) => {
                *hyper = groups
                    .map(|h| {
                        Ok(AdagradHyper {
                            lr: number(k, &h, "lr")?,
                            lr_decay: number(k, &h, "lr_decay")?,
                            weight_decay: number(k, &h, "weight_decay")?,
                            initial_accumulator_value: number(k, &h, "initial_accumulator_value")?,
                            eps: number(k, &h, "eps")?,
                            maximize: flag(k, &h, "maximize")?,
                        })
                    })
                    .collect::<Result<_>>()?
            }
            Self::Rmsprop(hyper, _) => {
                *hyper = groups
                    .map(|h| {
                        Ok(RmspropHyper {
                            lr: number(k, &h, "lr")?,
                            alpha: number(k, &h, "alpha")?,
                            eps: number(k, &h, "eps")?,
                            weight_decay: number(k, &h, "weight_decay")?,
                            momentum: number(k, &h, "momentum")?,
                            centered: flag(k, &h, "centered")?,
                            maximize: flag(k, &h, "maximize")?,
                        })
                    })
                    .collect::<Result<_>>()?
            }
        }
        Ok(())
    }

    /// Steps every segment: one fused launch each.
    pub fn step(
        &mut self,
        kernels: &FusedKernels,
        stream: &Arc<CudaStream>,
        params: &mut CudaSlice<f32>,
        grads: &CudaSlice<f32>,
        segments: &[Segment],
    ) -> Result<()> {
        let shard_numel = params.len();
        for s in segments {
            let mut p = params.slice_mut(s.range.clone());
            let g = grads.slice(s.range.clone());
            let at = s.range.start;
            let result = match self {
                Self::Sgd(hyper, state) => kernels.sgd_step_at(
                    stream,
                    &mut p,
                    &g,
                    state,
                    at,
                    shard_numel,
                    s.step,
                    &hyper[s.group],
                ),
                Self::Adam(hyper, state) => {
                    kernels.adam_step_at(stream, &mut p, &g, state, at, s.step, &hyper[s.group])
                }
                Self::Adagrad(hyper, state) => {
                    kernels.adagrad_step_at(stream, &mut p, &g, state, at, s.step, &hyper[s.group])
                }
                Self::Rmsprop(hyper, state) => {
                    kernels.rmsprop_step_at(stream, &mut p, &g, state, at, &hyper[s.group])
                }
            };
            result?;
        }
        Ok(())
    }

    /// Device bytes of the state.
    pub fn state_bytes(&self) -> usize {
        let len = |b: &Option<CudaSlice<f32>>| b.as_ref().map_or(0, CudaSlice::len);
        let elements = match self {
            Self::Sgd(_, s) => len(&s.momentum_buffer),
            Self::Adam(_, s) => s.exp_avg.len() + s.exp_avg_sq.len() + len(&s.max_exp_avg_sq),
            Self::Adagrad(_, s) => s.sum.len(),
            Self::Rmsprop(_, s) => s.square_avg.len() + len(&s.grad_avg) + len(&s.momentum_buffer),
        };
        elements * std::mem::size_of::<f32>()
    }
}
