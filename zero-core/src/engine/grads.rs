//! The reduced gradients of the pieces that step, made ready for the
//! optimizer: averaged over the micro-steps, unscaled (loss scaling) and
//! clipped, with the collectives each needs.

use super::scaler::LossScaler;
use super::{ClipConfig, NormType, ShardMemory};
use crate::comm::{Communicator, ReduceOp};
use crate::{Element, Error, Result};
use std::ops::Range;

/// The reduced gradients of the stepping pieces: the gradient shard (in
/// stage 0 the full buffer, whose plan has one rank) at `ranges`.
pub(super) struct SteppingGrads<'a, T: Element, C: Communicator, M: ShardMemory<T, C>> {
    pub comm: &'a C,
    pub memory: &'a mut M,
    pub grads: &'a mut M::Buffer,
    pub ranges: &'a [Range<usize>],
    /// Stage 0: every rank holds the whole reduced gradient, so the local
    /// norm is the global one.
    pub replicated: bool,
}

impl<T: Element, C: Communicator, M: ShardMemory<T, C>> SteppingGrads<'_, T, C, M> {
    /// Multiplies them by `factor`.
    pub fn scale(&mut self, factor: f64) -> Result<()> {
        self.memory.scale(self.grads, self.ranges, factor)
    }

    /// With loss scaling: looks for an inf or NaN on every rank (one
    /// all-reduce of one flag), divides by the scale when there is none,
    /// and updates the scale. Returns whether the step must be skipped
    /// (the same answer on every rank). Without loss scaling: `false`, and
    /// nothing happens.
    pub fn unscale_or_skip(&mut self, scaler: Option<&mut LossScaler>) -> Result<bool> {
        let Some(scaler) = scaler else {
            return Ok(false);
        };
        let scale = scaler.scale();
        // The inf-norm partial is non-finite exactly when an inf or NaN is
        // there (the memory counts a NaN as infinite).
        let largest =
            self.memory
                .norm_partial(self.comm, self.grads, self.ranges, NormType::Inf)?;
        let mut flag = [if largest.is_finite() { 0.0f32 } else { 1.0 }];
        self.memory
            .all_reduce_host(self.comm, &mut flag[..], ReduceOp::Max)?;
        let found_inf = flag[0] > 0.5;
        if !found_inf {
            // torch: `inv_scale = scale.double().reciprocal().float()`.
            self.scale(f64::from((1.0 / scale) as f32))?;
        }
        scaler.stepped(found_inf, scale);
        if found_inf {
            tracing::debug!(scale, "inf or NaN gradient; optimizer step skipped");
        }
        Ok(found_inf)
    }

    /// Computes the global gradient norm if `clip` or `compute_norm` asks,
    /// and clips.
    ///
    /// With clipping on, a non-finite norm (an inf or NaN gradient on any
    /// rank) refuses step `step` on every rank alike (`torch`'s
    /// `clip_grad_norm_(error_if_nonfinite=True)`): the parameters and the
    /// optimizer state are left as they were, and the error says so.
    pub fn clip(
        &mut self,
        clip: Option<ClipConfig>,
        compute_norm: bool,
        step: u64,
    ) -> Result<Option<f64>> {
        let norm_type = match (&clip, compute_norm) {
            (Some(clip), _) => clip.norm_type,
            (None, true) => NormType::L2,
            (None, false) => return Ok(None),
        };
        let local = self
            .memory
            .norm_partial(self.comm, self.grads, self.ranges, norm_type)?;
        let total = if self.replicated {
            local
        } else {
            let op = match norm_type {
                NormType::Inf => ReduceOp::Max,
                _ => ReduceOp::Sum,
            };
            let mut total = [local];
            self.memory.all_reduce_host(self.comm, &mut total[..], op)?;
            total[0]
        };
        let norm = match norm_type {
            NormType::L2 => total.sqrt(),
            _ => total,
        };
        if let Some(clip) = clip {
            if !norm.is_finite() {
                return Err(Error::NonFiniteGradNorm { norm, step });
            }
            // torch.nn.utils.clip_grad_norm_: coefficient clamped to 1.
            let coef = clip.max_norm / (norm + 1e-6);
            if coef < 1.0 {
                self.scale(coef)?;
            }
        }
        Ok(Some(norm))
    }
}
