//! The device side of a built-in optimizer: hyperparameters read from the
//! host optimizer the user configured, state as flat buffers over the whole
//! shard, steps as fused kernel launches over [`Segment`]s.

use super::pieces::{merge_state, split_state, StateFormat};
use super::segments::Segment;
use crate::kernels::{
    AdagradHyper, AdagradState, AdamHyper, AdamState, DeviceState, FusedKernels, RmspropHyper,
    RmspropState, SgdHyper, SgdState,
};
use cudarc::driver::{CudaSlice, CudaStream};
use std::collections::BTreeMap;
use std::ops::Range;
use std::sync::Arc;
use zero_core::engine::StepPiece;
use zero_core::optim::{FunctionalOptimizer, Hyperparams, OptimizerState, ParamState};
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
            "{kind} hyperparameters lack a numeric {key:?}; the CUDA engine reads the \
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
    /// optimizer `host` describes, zeroed ([`DeviceOptimizer::start_pieces`]
    /// sets what starts elsewhere).
    pub fn new(
        host: &dyn FunctionalOptimizer<f32>,
        stream: &Arc<CudaStream>,
        shard_numel: usize,
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
            "adagrad" => Self::Adagrad(
                Vec::new(),
                AdagradState {
                    sum: zeros(shard_numel)?,
                    step: 0,
                },
            ),
            "rmsprop" => Self::Rmsprop(
                Vec::new(),
                RmspropState {
                    square_avg: zeros(shard_numel)?,
                    grad_avg: None,
                    momentum_buffer: None,
                    step: 0,
                },
            ),
            _ => return Err(Self::unsupported(host.kind())),
        })
    }

    fn unsupported(kind: &str) -> Error {
        Error::Config(format!(
            "optimizer {kind:?} has no fused CUDA kernel; the CUDA engine runs {}. Use one of \
             them, or offload the optimizer (`EngineConfig::with_offload(Offload::Optimizer, \
             threads)` through zero-candle's optimizer), whose step on the host runs any \
             FunctionalOptimizer, or train through host memory (threads or MPI backend)",
            DEVICE_KINDS.join(", ")
        ))
    }

    /// Fails unless `host` is of a kind the fused kernels implement.
    pub fn check_kind(host: &dyn FunctionalOptimizer<f32>) -> Result<()> {
        if DEVICE_KINDS.contains(&host.kind()) {
            Ok(())
        } else {
            Err(Self::unsupported(host.kind()))
        }
    }

    /// This kind's state format (torch's names).
    fn format(&self) -> StateFormat {
        match self {
            Self::Sgd(..) => StateFormat {
                kind: "sgd",
                has_step: false,
                tensors: &["momentum_buffer"],
            },
            Self::Adam(..) => StateFormat {
                kind: "adam",
                has_step: true,
                tensors: &["exp_avg", "exp_avg_sq", "max_exp_avg_sq"],
            },
            Self::Adagrad(..) => StateFormat {
                kind: "adagrad",
                has_step: true,
                tensors: &["sum"],
            },
            Self::Rmsprop(..) => StateFormat {
                kind: "rmsprop",
                has_step: true,
                tensors: &["square_avg", "momentum_buffer", "grad_avg"],
            },
        }
    }

    /// The whole flat state on the host (blocks: wait for the stream
    /// within the deadline first).
    fn export_whole(&self, stream: &Arc<CudaStream>) -> Result<ParamState<f32>> {
        let whole = match self {
            Self::Sgd(_, s) => s.export(stream),
            Self::Adam(_, s) => s.export(stream),
            Self::Adagrad(_, s) => s.export(stream),
            Self::Rmsprop(_, s) => s.export(stream),
        };
        whole.map_err(Error::from)
    }

    /// The state of every stepped piece in the host optimizers' format
    /// (see [`split_state`]).
    pub fn export(
        &self,
        stream: &Arc<CudaStream>,
        pieces: &[StepPiece<'_>],
        piece_steps: &BTreeMap<(String, usize), u64>,
    ) -> Result<OptimizerState<f32>> {
        let whole = self.export_whole(stream)?;
        let unstarted: &[Range<usize>] = match self {
            Self::Sgd(_, s) => s.momentum_unstarted(),
            _ => &[],
        };
        Ok(split_state(
            self.format(),
            &whole,
            pieces,
            piece_steps,
            unstarted,
        ))
    }

    /// Replaces the state of the pieces in `state` (the others keep theirs;
    /// see [`merge_state`]) and returns their step counts.
    pub fn import(
        &mut self,
        stream: &Arc<CudaStream>,
        pieces: &[StepPiece<'_>],
        state: OptimizerState<f32>,
    ) -> Result<Vec<((String, usize), u64)>> {
        let len = pieces.iter().map(|p| p.range.end).max().unwrap_or(0);
        let mut whole = self.export_whole(stream)?;
        // SGD: the ranges no step with momentum has written yet.
        let old_unstarted: Vec<Range<usize>> = match self {
            Self::Sgd(_, s) if s.momentum_buffer.is_some() => s.momentum_unstarted().to_vec(),
            Self::Sgd(..) => std::iter::once(0..len).collect(),
            _ => Vec::new(),
        };
        let merged = merge_state(
            self.format(),
            &mut whole,
            len,
            pieces,
            state,
            &old_unstarted,
        )?;
        match self {
            Self::Sgd(_, s) => {
                *s = SgdState::import(stream, &whole, len)?;
                if s.momentum_buffer.is_some() {
                    for range in merged.momentum_unstarted {
                        s.mark_momentum_unstarted(range);
                    }
                }
            }
            Self::Adam(_, s) => *s = AdamState::import(stream, &whole, len)?,
            Self::Adagrad(_, s) => *s = AdagradState::import(stream, &whole, len)?,
            Self::Rmsprop(_, s) => *s = RmspropState::import(stream, &whole, len)?,
        }
        Ok(merged.steps)
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

    /// Sets the state of pieces about to take their first step, given as
    /// (state range, group): Adagrad starts its sums at the group's
    /// `initial_accumulator_value`; the other kinds start from zeros.
    pub fn start_pieces(
        &mut self,
        stream: &Arc<CudaStream>,
        pieces: &[(Range<usize>, usize)],
    ) -> Result<()> {
        let Self::Adagrad(hyper, state) = self else {
            return Ok(());
        };
        for (range, group) in pieces {
            let value = hyper[*group].initial_accumulator_value as f32;
            let init = vec![value; range.len()];
            stream
                .memcpy_htod(&init, &mut state.sum.slice_mut(range.clone()))
                .map_err(|e| Error::from(crate::Error::from(e)))?;
        }
        Ok(())
    }

    /// Steps every segment: one fused launch each. Segments are ranges of
    /// `params` and `grads`, whose element 0 is the state's element
    /// `origin`. `state_len`: the elements the state covers (lazily
    /// allocated buffers get as many, as at creation).
    #[allow(clippy::too_many_arguments)]
    pub fn step(
        &mut self,
        kernels: &FusedKernels,
        stream: &Arc<CudaStream>,
        params: &mut CudaSlice<f32>,
        grads: &CudaSlice<f32>,
        segments: &[Segment],
        origin: usize,
        state_len: usize,
    ) -> Result<()> {
        let shard_numel = state_len;
        for s in segments {
            let mut p = params.slice_mut(s.range.clone());
            let g = grads.slice(s.range.clone());
            let at = origin + s.range.start;
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
