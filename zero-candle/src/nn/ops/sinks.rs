//! Attention sinks: a logit per query head in each row's softmax, joined
//! to the fused attention's output and row statistics.

use super::super::grad_hook::{route, GradHook};
use candle_core::{Result, Tensor};
use std::sync::{Arc, Mutex, PoisonError};

/// The sinks of a fused [`sink_attention`](super::sink_attention).
pub(super) struct Sinks {
    /// Their values when the forward ran, f32 `[heads]`.
    values: Tensor,
    /// The variable, and the hook its gradient goes to.
    param: Tensor,
    hook: Arc<dyn GradHook>,
    /// `exp(sink − lse)` per `(batch, head, row)` (the sink's weight in the
    /// row's softmax), from the forward for the backward.
    weights: Mutex<Option<Tensor>>,
}

impl Sinks {
    /// The sinks `param` (a variable `[heads]`, read by the hook before),
    /// whose gradient goes to `hook`.
    pub(super) fn new(param: &Tensor, hook: Arc<dyn GradHook>) -> Result<Self> {
        Ok(Self {
            values: param.detach().to_dtype(candle_core::DType::F32)?.copy()?,
            param: param.clone(),
            hook,
            weights: Mutex::default(),
        })
    }

    /// The attention's output `y` `[batch, time, heads, head_dim]` and its
    /// rows' log-sum-exp `lse` `[batch, heads, time]` with the sinks in
    /// each row's softmax: `lse' = log(exp(lse) + exp(sink))`, `y' = y ·
    /// exp(lse − lse')`.
    pub(super) fn join(&self, y: Tensor, lse: Tensor) -> Result<(Tensor, Tensor)> {
        if lse.elem_count() == 0 {
            return Ok((y, lse));
        }
        let sinks = self.values.to_dtype(lse.dtype())?.reshape((1, (), 1))?;
        let top = lse.broadcast_maximum(&sinks)?;
        let total = (lse.broadcast_sub(&top)?.exp()? + sinks.broadcast_sub(&top)?.exp()?)?;
        let joined = (top + total.log()?)?;
        let kept = (&lse - &joined)?.exp()?.transpose(1, 2)?.unsqueeze(3)?;
        let y = y
            .to_dtype(kept.dtype())?
            .broadcast_mul(&kept)?
            .to_dtype(y.dtype())?;
        *self.weights.lock().unwrap_or_else(PoisonError::into_inner) =
            Some(sinks.broadcast_sub(&joined)?.exp()?);
        Ok((y, joined))
    }

    /// Hands the sinks' gradient for the output `out` and its gradient
    /// `grad` to the hook.
    pub(super) fn backward(&self, out: &Tensor, grad: &Tensor) -> Result<()> {
        let weights = self.weights.lock().unwrap_or_else(PoisonError::into_inner);
        let Some(weights) = weights.as_ref() else {
            candle_core::bail!("zero-candle sink_attention: backward ran without its forward")
        };
        // rowsum(dO∘O) per (batch, row, head), as (batch, head, row).
        let dots = (grad.to_dtype(weights.dtype())? * out.to_dtype(weights.dtype())?)?
            .sum(3)?
            .transpose(1, 2)?;
        let grad = (weights * dots)?.sum((0, 2))?.neg()?;
        let grad = grad.to_dtype(self.param.dtype())?;
        if route(Some(&self.hook), &self.param, grad)?.is_some() {
            candle_core::bail!(
                "zero-candle sink_attention: the sinks are not a variable, so their gradient has \
                 no place; build them as one"
            )
        }
        Ok(())
    }
}
