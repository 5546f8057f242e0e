//! The micro-steps of one optimizer step: what an accumulation window holds.

use crate::{Error, Result};

/// The micro-steps of one optimizer step (an accumulation window); reset
/// by [`Engine::discard_window`].
#[derive(Default)]
pub(super) struct AccumulationWindow {
    pub micro_steps: usize,
    /// Per parameter, whether a gradient came in this window.
    pub present: Vec<bool>,
    /// The full gradient buffer holds contributions of this window
    /// (micro-steps accumulated, or gradients handed over one by one
    /// without a backward pass).
    pub in_full_buffer: bool,
    /// The gradient shard holds reduced micro-steps of this window (stage
    /// 2, overlapped).
    pub in_shard: bool,
    /// A gradient came through a slot of `accumulate` or `step` (a
    /// parameter a plain op reads, which a deferred gather would leave
    /// stale in the next forward).
    pub plain_grads: bool,
    /// `begin_backward` read the owned pieces for this step.
    pub params_read: bool,
    /// Per bucket, whether the interleaved schedule stepped it during
    /// backward.
    pub early_stepped: Vec<bool>,
}

impl AccumulationWindow {
    /// Refuses `op` while micro-steps are accumulated: their gradients
    /// are not part of a checkpoint, nor of a re-partition.
    pub fn refuse_mid(&self, op: &str) -> Result<()> {
        if self.micro_steps > 0 || self.in_full_buffer {
            return Err(Error::State(format!(
                "{op} called with {} micro-step(s) accumulated; their gradients are not part of \
                 a checkpoint: finish the optimizer step first",
                self.micro_steps
            )));
        }
        Ok(())
    }

    /// `flags` of the parameters with a gradient here this window: of
    /// `trainable`, the local mask to all-reduce; of `active`, what steps
    /// without the trainability check.
    pub fn with_gradient(&self, flags: &[bool]) -> Vec<bool> {
        flags
            .iter()
            .zip(&self.present)
            .map(|(&f, &p)| f && p)
            .collect()
    }

    /// Marks the parameters with a gradient in `grads` (one slot each).
    pub fn mark_present<G>(&mut self, grads: &[Option<G>]) {
        for (present, g) in self.present.iter_mut().zip(grads) {
            *present |= g.is_some();
        }
    }
}
