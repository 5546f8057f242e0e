//! [`AttentionDims`], the shape of one causal self-attention call: the CPU
//! op and the CUDA entry points both take it.

use super::super::elem::Accum;
use candle_core::{bail, Result, Tensor};

/// The shape of one causal attention call.
///
/// Packed ([`causal_self_attention`](super::causal_self_attention)): `qkv` is `[batch, time, 3 * heads * head_dim]`, as a GPT's `qkv` Linear
/// writes it: the query of head `h` at columns `h * head_dim..`, its key at
/// `d + h * head_dim..` and its value at `2 * d + h * head_dim..`, with
/// `d = heads * head_dim`. The output is `[batch, time, d]`, head `h` at
/// columns `h * head_dim..` (what the output projection reads). The
/// forward also keeps, per `(batch, head, row)`, the log-sum-exp of the
/// row's scaled scores (f32, `[batch, heads, time]`, natural log), which
/// is all the backward needs besides `qkv` and the output.
///
/// Split ([`causal_attention`](super::causal_attention)): `q` is `[batch,
/// time, heads, head_dim]`, `k` and `v` are `[batch, time, kv_heads,
/// head_dim]` with `kv_heads` dividing `heads`: query head `h` attends with
/// K/V head `h / (heads / kv_heads)` (grouped-query attention); the output
/// is `[batch, time, heads, head_dim]`.
///
/// With a [`window`](AttentionDims::window), query `t` attends to keys
/// `t - window < j <= t` only (sliding-window attention).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AttentionDims {
    /// Sequences.
    pub batch: usize,
    /// Positions per sequence.
    pub time: usize,
    /// Query heads.
    pub heads: usize,
    /// Key/value heads (`heads` in the packed form).
    pub kv_heads: usize,
    /// Width of one head.
    pub head_dim: usize,
    /// The factor on `q · k` (`1 / sqrt(head_dim)`), in f32 as the CUDA
    /// kernels take it.
    pub scale: f32,
    /// Each query attends to at most this many positions, its own
    /// included; `None`: every position up to its own.
    pub window: Option<usize>,
}

impl AttentionDims {
    /// The dims of `qkv` `[batch, time, 3 * d]` split into `heads`, with
    /// the usual scale `1 / sqrt(head_dim)`.
    pub fn of(qkv: &Tensor, heads: usize) -> Result<Self> {
        match qkv.dims() {
            &[batch, time, width] => Self::packed(qkv, batch, time, width, heads),
            dims => bail!(
                "zero-candle causal_self_attention: qkv must be [batch, time, 3 * d] (the qkv \
                 Linear's output), got {dims:?}"
            ),
        }
    }

    /// The dims of `qkv` `[batch * time, 3 * d]` (sequences of `time`
    /// rows, one after the other) split into `heads`.
    pub fn of_rows(qkv: &Tensor, time: usize, heads: usize) -> Result<Self> {
        match qkv.dims() {
            &[rows, width] if time > 0 && rows % time == 0 => {
                Self::packed(qkv, rows / time, time, width, heads)
            }
            // No positions: no sequences.
            &[0, width] => Self::packed(qkv, 0, time, width, heads),
            dims => bail!(
                "zero-candle causal_self_attention_rows: qkv must be [batch * time, 3 * d] \
                 (the qkv Linear's output over whole sequences) with time {time}, got {dims:?}"
            ),
        }
    }

    fn packed(qkv: &Tensor, batch: usize, time: usize, width: usize, heads: usize) -> Result<Self> {
        if heads == 0 || width == 0 || width % (3 * heads) != 0 {
            bail!(
                "zero-candle causal_self_attention: the last dim of qkv {:?} must be 3 * heads * \
                 head_dim with {heads} heads; check the qkv Linear's width and the head count",
                qkv.dims()
            );
        }
        let head_dim = width / (3 * heads);
        Ok(Self {
            batch,
            time,
            heads,
            kv_heads: heads,
            head_dim,
            scale: 1.0 / (head_dim as f32).sqrt(),
            window: None,
        })
    }

    /// The dims of separate `q` `[batch, time, heads, head_dim]`, `k` and
    /// `v` `[batch, time, kv_heads, head_dim]`, with the usual scale.
    pub fn of_split(q: &Tensor, k: &Tensor, v: &Tensor) -> Result<Self> {
        let four = |t: &Tensor, name: &str, heads: &str| match t.dims() {
            &[b, t, h, d] => Ok((b, t, h, d)),
            dims => bail!(
                "zero-candle causal_attention: {name} must be [batch, time, {heads}, head_dim], \
                 got {dims:?}"
            ),
        };
        let (batch, time, heads, head_dim) = four(q, "q", "heads")?;
        let (kb, kt, kv_heads, kd) = four(k, "k", "kv_heads")?;
        if v.dims() != k.dims() || (kb, kt, kd) != (batch, time, head_dim) {
            bail!(
                "zero-candle causal_attention: k {:?} and v {:?} must both be [batch, time, \
                 kv_heads, head_dim] with q's batch, time and head_dim (q is {:?})",
                k.dims(),
                v.dims(),
                q.dims()
            );
        }
        if heads == 0 || head_dim == 0 || kv_heads == 0 || heads % kv_heads != 0 {
            bail!(
                "zero-candle causal_attention: {heads} query heads of {head_dim} cannot share \
                 {kv_heads} K/V heads; kv_heads must divide heads and both be at least 1"
            );
        }
        if q.dtype() != k.dtype() || q.dtype() != v.dtype() {
            bail!(
                "zero-candle causal_attention: q, k, v are {:?}, {:?}, {:?}; convert them to \
                 one dtype",
                q.dtype(),
                k.dtype(),
                v.dtype()
            );
        }
        Ok(Self {
            batch,
            time,
            heads,
            kv_heads,
            head_dim,
            scale: 1.0 / (head_dim as f32).sqrt(),
            window: None,
        })
    }

    /// These dims with each query attending to at most `window` positions,
    /// its own included: an error for a window of 0.
    pub fn with_window(self, window: usize) -> Result<Self> {
        if window == 0 {
            bail!(
                "zero-candle attention: a sliding window of 0 positions; a query sees at least \
                 itself, so use a window of at least 1"
            );
        }
        Ok(Self {
            window: Some(window),
            ..self
        })
    }

    /// The first key query `t` sees.
    pub(super) fn first_key(&self, t: usize) -> usize {
        self.window.map_or(0, |w| (t + 1).saturating_sub(w))
    }

    /// `1 / sqrt(head_dim)` computed in `A` (the CPU kernels': f64 ones
    /// need more than [`AttentionDims::scale`]'s f32).
    pub(super) fn scale_in<A: Accum>(&self) -> A {
        A::ONE / A::cast(self.head_dim as f64).sqrt()
    }

    /// `heads * head_dim`.
    pub fn d_model(&self) -> usize {
        self.heads * self.head_dim
    }

    /// `kv_heads * head_dim`: the width of a K or V row.
    pub fn kv_width(&self) -> usize {
        self.kv_heads * self.head_dim
    }
}
