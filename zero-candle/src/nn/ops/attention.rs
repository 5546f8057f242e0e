//! Causal attention as one op: over a packed `qkv` tensor, or over separate
//! `q`, `k`, `v` with grouped K/V heads.

use super::super::cpu;
use super::super::elem::{dispatch_float, Accum, Elem};
use super::super::grad_hook::{before_read, check_holds_values, GradHook};
use super::super::storage::{on_device, owned_storage, tensor_from, with_cuda, Saved, SavedSlot};
use super::super::tap;
use super::attention_dims::AttentionDims;
use super::cuda;
use super::sinks::Sinks;
use candle_core::backend::BackendStorage;
use candle_core::{
    CpuStorage, CudaStorage, CustomOp1, CustomOp3, DType, Layout, Result, Shape, Storage, Tensor,
    WithDType, D,
};
use rayon::prelude::*;
use std::sync::Arc;

/// Causal self-attention `softmax(q kᵀ / √head_dim + mask) v` per head,
/// over the packed `qkv` `[batch, time, 3 * d]` a GPT's `qkv` Linear
/// writes (see [`AttentionDims`] for the layout), returning `[batch, time,
/// d]` with the heads side by side, ready for the output projection.
///
/// One op: no mask tensor, no `[batch, heads, time, time]` tensor kept for
/// backward (only the output and one f32 statistic per row: the
/// log-sum-exp of the row's scores, FlashAttention-2's scheme); the
/// backward recomputes the attention weights from it in one pass. 16-bit
/// inputs compute in f32. On CUDA one kernel does the forward and two the
/// backward, over every batch and head; bf16 and f16 on sm_80 and newer run
/// on tensor cores (their products take `P` and `dS` rounded to the input
/// type, as FlashAttention-2 does). The CPU takes heads of any width, the
/// CUDA kernels heads up to 128 wide (a wider head is an error here; the
/// split form, [`causal_attention`], runs it composed).
///
/// ```
/// use candle_core::{Device, Tensor};
/// # fn main() -> candle_core::Result<()> {
/// let qkv = Tensor::randn(0f32, 1.0, (2, 5, 3 * 8), &Device::Cpu)?; // 2 heads of 4
/// let y = zero_candle::nn::ops::causal_self_attention(&qkv, 2)?;
/// assert_eq!(y.dims(), &[2, 5, 8]);
/// # Ok(()) }
/// ```
pub fn causal_self_attention(qkv: &Tensor, heads: usize) -> Result<Tensor> {
    let dims = AttentionDims::of(qkv, heads)?;
    let out = Shape::from((dims.batch, dims.time, dims.d_model()));
    causal_packed(qkv, dims, out)
}

/// [`causal_self_attention`] over rows: `qkv` `[batch * time, 3 * d]`,
/// sequences of `time` rows one after the other, returning `[batch *
/// time, d]`. A model that keeps its activations as rows between its
/// Linear layers takes no reshape before or after the attention; with
/// Candle as published each reshape's backward costs a zeroed tensor and a
/// pass over its gradient (`vendor/README.md`).
///
/// ```
/// use candle_core::{Device, Tensor};
/// # fn main() -> candle_core::Result<()> {
/// let qkv = Tensor::randn(0f32, 1.0, (2 * 5, 3 * 8), &Device::Cpu)?; // 2 sequences of 5
/// let y = zero_candle::nn::ops::causal_self_attention_rows(&qkv, 5, 2)?;
/// assert_eq!(y.dims(), &[10, 8]);
/// # Ok(()) }
/// ```
pub fn causal_self_attention_rows(qkv: &Tensor, time: usize, heads: usize) -> Result<Tensor> {
    let dims = AttentionDims::of_rows(qkv, time, heads)?;
    let out = Shape::from((dims.batch * dims.time, dims.d_model()));
    causal_packed(qkv, dims, out)
}

fn causal_packed(qkv: &Tensor, dims: AttentionDims, out: Shape) -> Result<Tensor> {
    qkv.contiguous()?.apply_op1(CausalAttention {
        dims,
        out,
        lse: SavedSlot::default(),
    })
}

struct CausalAttention {
    dims: AttentionDims,
    /// The output's shape: `[batch, time, d]` or rows `[batch * time, d]`.
    out: Shape,
    /// The forward's log-sum-exp per `(batch, head, row)`.
    lse: SavedSlot,
}

const OP: &str = "causal_self_attention";

impl CustomOp1 for CausalAttention {
    fn name(&self) -> &'static str {
        "zero-causal-self-attention"
    }

    fn cpu_fwd(&self, storage: &CpuStorage, layout: &Layout) -> Result<(CpuStorage, Shape)> {
        let dims = self.dims;
        let (y, lse) = dispatch_float!(storage.dtype(), OP, |T| {
            let qkv = cpu::slice::<T>(storage, layout, "the qkv input")?;
            let (y, lse) = forward::<T>(&Operands::packed(qkv, &dims), &dims);
            (
                T::to_cpu_storage_owned(y),
                <T as Elem>::Acc::to_cpu_storage_owned(lse),
            )
        });
        self.lse.put(Saved::Cpu(lse));
        Ok((y, self.out.clone()))
    }

    fn cuda_fwd(&self, storage: &CudaStorage, layout: &Layout) -> Result<(CudaStorage, Shape)> {
        let dims = self.dims;
        let (y, lse) = cuda::attention_forward((storage, layout), &dims)?;
        self.lse.put(Saved::Cuda(lse));
        Ok((y, self.out.clone()))
    }

    fn bwd(&self, qkv: &Tensor, out: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        let dims = self.dims;
        let grad = grad.contiguous()?;
        let shape = qkv.shape().clone();
        self.lse.read(OP, |saved| match saved {
            Saved::Cpu(lse) => {
                let dqkv = cpu::with_cpu(qkv, "the qkv input", |q_storage, q_layout| {
                    cpu::with_cpu(out, "the attention output", |o_storage, o_layout| {
                        cpu::with_cpu(&grad, "the output gradient", |g_storage, g_layout| {
                            Ok(dispatch_float!(q_storage.dtype(), OP, |T| {
                                let qkv = cpu::slice::<T>(q_storage, q_layout, "the qkv input")?;
                                let grads = backward::<T>(
                                    &Operands::packed(qkv, &dims),
                                    cpu::slice::<T>(o_storage, o_layout, "the attention output")?,
                                    cpu::slice::<T>(g_storage, g_layout, "the output gradient")?,
                                    <T as Elem>::Acc::cpu_storage_as_slice(lse)?,
                                    &dims,
                                );
                                T::to_cpu_storage_owned(grads.packed(&dims))
                            }))
                        })
                    })
                })?;
                Ok(Some(tensor_from(Storage::Cpu(dqkv), shape)))
            }
            Saved::Cuda(lse) => {
                let dqkv = with_cuda(qkv, "the qkv input", |q_storage, q_layout| {
                    with_cuda(out, "the attention output", |o_storage, o_layout| {
                        with_cuda(&grad, "the output gradient", |g_storage, g_layout| {
                            cuda::attention_backward(
                                (q_storage, q_layout),
                                (o_storage, o_layout),
                                lse,
                                (g_storage, g_layout),
                                &dims,
                            )
                        })
                    })
                })?;
                Ok(Some(tensor_from(Storage::Cuda(dqkv), shape)))
            }
        })
    }
}

/// Causal attention `softmax(q kᵀ / √head_dim + mask) v` over separate
/// `q` `[batch, time, heads, head_dim]`, `k` and `v` `[batch, time,
/// kv_heads, head_dim]`, where `kv_heads` divides `heads`: query head `h`
/// attends with K/V head `h / (heads / kv_heads)` (grouped-query
/// attention; `kv_heads == heads` is plain multi-head attention). Returns
/// `[batch, time, heads, head_dim]`; the gradients of `k` and `v` sum over
/// each K/V head's group of query heads, in order.
///
/// The same op as [`causal_self_attention`] otherwise: only the output and
/// the rows' log-sum-exp are kept for backward, on the CPU and on CUDA.
/// On CUDA that holds for heads up to 128 wide; a wider head (Gemma's are
/// 256) runs composed of Candle's ops instead, as `transformers`' eager
/// attention does: correct, but it keeps the `[batch, heads, time, time]`
/// scores and weights for backward, so its memory grows with `time²`. The
/// CPU runs the fused op at any width.
///
/// ```
/// use candle_core::{Device, Tensor};
/// # fn main() -> candle_core::Result<()> {
/// let q = Tensor::randn(0f32, 1.0, (2, 5, 4, 8), &Device::Cpu)?; // 4 query heads of 8
/// let k = Tensor::randn(0f32, 1.0, (2, 5, 2, 8), &Device::Cpu)?; // 2 K/V heads
/// let v = Tensor::randn(0f32, 1.0, (2, 5, 2, 8), &Device::Cpu)?;
/// let y = zero_candle::nn::ops::causal_attention(&q, &k, &v)?;
/// assert_eq!(y.dims(), &[2, 5, 4, 8]);
/// # Ok(()) }
/// ```
pub fn causal_attention(q: &Tensor, k: &Tensor, v: &Tensor) -> Result<Tensor> {
    split_attention(q, k, v, AttentionDims::of_split(q, k, v)?)
}

/// [`causal_attention`] within a sliding window: query `t` attends to keys
/// `t - window < j <= t` only, `window` positions with its own (Mistral's
/// and Qwen's `sliding_window`, as `transformers` masks it). A window of at
/// least the sequence's length is [`causal_attention`]. The kernels
/// compute and stream only the key tiles inside the window. On CUDA a head
/// wider than 128 runs composed, as [`causal_attention`] says: every
/// query's scores over the whole sequence, the window as a banded mask.
///
/// ```
/// use candle_core::{Device, Tensor};
/// # fn main() -> candle_core::Result<()> {
/// let q = Tensor::randn(0f32, 1.0, (1, 6, 2, 4), &Device::Cpu)?;
/// let k = Tensor::randn(0f32, 1.0, (1, 6, 1, 4), &Device::Cpu)?;
/// let v = Tensor::randn(0f32, 1.0, (1, 6, 1, 4), &Device::Cpu)?;
/// // Each position sees itself and the two before it.
/// let y = zero_candle::nn::ops::sliding_window_attention(&q, &k, &v, 3)?;
/// assert_eq!(y.dims(), &[1, 6, 2, 4]);
/// # Ok(()) }
/// ```
pub fn sliding_window_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    window: usize,
) -> Result<Tensor> {
    let dims = AttentionDims::of_split(q, k, v)?.with_window(window)?;
    split_attention(q, k, v, dims)
}

/// [`causal_attention`] (within `window` positions when given, as
/// [`sliding_window_attention`]) with every score capped as `cap ·
/// tanh(score / cap)` before the mask: Gemma 2's
/// `attn_logit_softcapping`. No fused kernel caps scores, so this runs
/// composed of Candle's ops on every device, as `transformers`' eager
/// attention does: it keeps the `[batch, heads, time, time]` scores and
/// weights for backward.
///
/// ```
/// use candle_core::{Device, Tensor};
/// # fn main() -> candle_core::Result<()> {
/// let q = Tensor::randn(0f32, 1.0, (1, 6, 2, 4), &Device::Cpu)?;
/// let k = Tensor::randn(0f32, 1.0, (1, 6, 1, 4), &Device::Cpu)?;
/// let v = Tensor::randn(0f32, 1.0, (1, 6, 1, 4), &Device::Cpu)?;
/// let y = zero_candle::nn::ops::softcapped_attention(&q, &k, &v, Some(3), 50.0)?;
/// assert_eq!(y.dims(), &[1, 6, 2, 4]);
/// # Ok(()) }
/// ```
pub fn softcapped_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    window: Option<usize>,
    cap: f64,
) -> Result<Tensor> {
    if !(cap > 0.0 && cap.is_finite()) {
        candle_core::bail!(
            "zero-candle softcapped_attention: the cap is {cap}; pass a positive number (or use \
             causal_attention for no cap)"
        )
    }
    let dims = AttentionDims::of_split(q, k, v)?;
    let dims = match window {
        Some(window) => dims.with_window(window)?,
        None => dims,
    };
    composed_attention(q, k, v, dims, Some(cap), None)
}

/// [`causal_attention`] (within `window` positions when given, as
/// [`sliding_window_attention`]) with an attention sink per query head:
/// `sinks` `[heads]` are logits that join each row's softmax beside its
/// scores and take their share of the weight to nowhere (a value of zero),
/// gpt-oss's `sinks`, as `transformers` computes them. The scores are
/// scaled by `head_dim^-1/2`.
///
/// With a `hook` and `sinks` a variable, this is the fused op: its forward
/// rescales each row's output by the weight the keys kept and adds the sink
/// to the row's log-sum-exp, which the backward then reads as it is; the
/// sinks' gradient, `−Σ exp(sink − lse)·rowsum(dO∘O)` over the batch and
/// the rows, goes to the hook. Otherwise (or on CUDA with heads wider than
/// 128) it runs composed of Candle's ops, as [`softcapped_attention`] does,
/// the sinks' gradient wherever their tensor's goes.
///
/// ```
/// use candle_core::{Device, Tensor};
/// # fn main() -> candle_core::Result<()> {
/// let q = Tensor::randn(0f32, 1.0, (1, 6, 2, 4), &Device::Cpu)?;
/// let k = Tensor::randn(0f32, 1.0, (1, 6, 1, 4), &Device::Cpu)?;
/// let v = Tensor::randn(0f32, 1.0, (1, 6, 1, 4), &Device::Cpu)?;
/// let sinks = Tensor::new(&[0.5f32, -1.0], &Device::Cpu)?;
/// let y = zero_candle::nn::ops::sink_attention(&q, &k, &v, &sinks, Some(3), None)?;
/// assert_eq!(y.dims(), &[1, 6, 2, 4]);
/// # Ok(()) }
/// ```
pub fn sink_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    sinks: &Tensor,
    window: Option<usize>,
    hook: Option<Arc<dyn GradHook>>,
) -> Result<Tensor> {
    let dims = AttentionDims::of_split(q, k, v)?;
    let dims = match window {
        Some(window) => dims.with_window(window)?,
        None => dims,
    };
    if sinks.dims() != [dims.heads] {
        candle_core::bail!(
            "zero-candle sink_attention: the sinks are {:?}, the queries have {} heads; give one \
             sink per query head",
            sinks.dims(),
            dims.heads
        )
    }
    let fused = SplitPath::of(q.device().is_cuda(), &dims) == SplitPath::Fused;
    match hook {
        Some(hook) if fused && sinks.is_variable() => {
            before_read(Some(&hook), &[Some(sinks)])?;
            check_holds_values(&[Some(sinks)])?;
            q.contiguous()?.apply_op3(
                &k.contiguous()?,
                &v.contiguous()?,
                SplitAttention {
                    dims,
                    lse: SavedSlot::default(),
                    sinks: Some(Sinks::new(sinks, hook)?),
                },
            )
        }
        hook => {
            let sinks = match (hook, sinks.is_variable()) {
                (Some(hook), true) => tap(&candle_core::Var::from_tensor(sinks)?, Some(hook))?,
                _ => sinks.clone(),
            };
            composed_attention(q, k, v, dims, None, Some(&sinks))
        }
    }
}

/// The widest head the fused CUDA attention kernels take: zero-nccl's
/// `kernels::layers::MAX_HEAD_DIM`, which zero-candle can name only with
/// its `cuda` feature, so it is repeated here (a unit test keeps the two
/// equal). A wider head on CUDA runs [`composed_attention`].
const FUSED_CUDA_HEAD_DIM: usize = 128;

/// How one split attention call runs.
#[derive(Clone, Copy, Debug, PartialEq)]
enum SplitPath {
    /// [`SplitAttention`], one custom op.
    Fused,
    /// [`composed_attention`]: CUDA, where the head is wider than the
    /// kernels take.
    Composed,
}

impl SplitPath {
    fn of(on_cuda: bool, dims: &AttentionDims) -> Self {
        if on_cuda && dims.head_dim > FUSED_CUDA_HEAD_DIM {
            Self::Composed
        } else {
            Self::Fused
        }
    }
}

fn split_attention(q: &Tensor, k: &Tensor, v: &Tensor, dims: AttentionDims) -> Result<Tensor> {
    match SplitPath::of(q.device().is_cuda(), &dims) {
        SplitPath::Fused => q.contiguous()?.apply_op3(
            &k.contiguous()?,
            &v.contiguous()?,
            SplitAttention {
                dims,
                lse: SavedSlot::default(),
                sinks: None,
            },
        ),
        SplitPath::Composed => composed_attention(q, k, v, dims, None, None),
    }
}

/// [`causal_attention`] (within `dims`' window, if any) composed of
/// Candle's tensor ops, each with its own backward: `transformers`' eager
/// attention. `q` goes to `[batch, heads, time, head_dim]`; `k` and `v`
/// to `[batch, kv_heads, time, head_dim]`, each K/V head repeated for its
/// group of query heads (`repeat_kv`: head `h` gets K/V head `h / group`);
/// the scores `q kᵀ / √head_dim` are computed in the input type (and
/// capped as `cap · tanh(s / cap)` there, with a `cap`), the causal (and
/// banded) mask of 0 and -inf is added and the softmax taken
/// in f32 (f64 for f64 input), with `sinks` `[heads]` as one more column
/// of each row that is dropped after it (gpt-oss's), the weights rounded
/// back to the input type and multiplied with `v`.
///
/// The fallback where the fused kernels cannot run (CUDA heads wider than
/// [`FUSED_CUDA_HEAD_DIM`]), not a fast path: the `[batch, heads, time,
/// time]` scores, in the input type and in f32, and the weights are kept
/// until backward.
pub(crate) fn composed_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    dims: AttentionDims,
    cap: Option<f64>,
    sinks: Option<&Tensor>,
) -> Result<Tensor> {
    let AttentionDims {
        batch,
        time,
        heads,
        kv_heads,
        head_dim,
        ..
    } = dims;
    let group = heads / kv_heads;
    let dtype = q.dtype();
    let softmax_dtype = if dtype == DType::F64 {
        DType::F64
    } else {
        DType::F32
    };
    let q = q.transpose(1, 2)?.contiguous()?;
    let repeat_kv = |x: &Tensor| {
        let x = x.transpose(1, 2)?;
        if group == 1 {
            return x.contiguous();
        }
        x.unsqueeze(2)?
            .expand((batch, kv_heads, group, time, head_dim))?
            .reshape((batch, heads, time, head_dim))
    };
    let (k, v) = (repeat_kv(k)?, repeat_kv(v)?);
    let scores = q.matmul(&k.t()?)?.affine(dims.scale_in::<f64>(), 0.0)?;
    let scores = match cap {
        Some(cap) => ((scores / cap)?.tanh()? * cap)?,
        None => scores,
    };
    // Query i sees key j where 0 <= i - j < window (the fused op's
    // `first_key`), built on the device: no [time, time] table uploaded per
    // call.
    let device = q.device();
    let window = dims.window.unwrap_or(time).max(1) as f64;
    let positions = Tensor::arange(0f32, time as f32, device)?;
    let behind = positions
        .unsqueeze(1)?
        .broadcast_sub(&positions.unsqueeze(0)?)?;
    let visible = (behind.ge(0f64)? * behind.lt(window)?)?;
    let (seen, hidden) = (
        Tensor::zeros((time, time), softmax_dtype, device)?,
        Tensor::full(f32::NEG_INFINITY, (time, time), device)?.to_dtype(softmax_dtype)?,
    );
    let mask = visible.where_cond(&seen, &hidden)?;
    let scores = scores.to_dtype(softmax_dtype)?.broadcast_add(&mask)?;
    let scores = match sinks {
        Some(sinks) => {
            let column = sinks
                .to_dtype(softmax_dtype)?
                .reshape((1, heads, 1, 1))?
                .broadcast_as((batch, heads, time, 1))?;
            Tensor::cat(&[&scores, &column], 3)?
        }
        None => scores,
    };
    // Candle's reductions refuse empty tensors; no positions have no
    // weights to normalize.
    let weights = if scores.elem_count() == 0 {
        scores
    } else {
        candle_nn::ops::softmax(&scores, D::Minus1)?
    };
    let weights = match sinks {
        Some(_) => weights.narrow(3, 0, time)?,
        None => weights,
    };
    let weights = weights.to_dtype(dtype)?;
    weights.matmul(&v)?.transpose(1, 2)?.contiguous()
}

struct SplitAttention {
    dims: AttentionDims,
    /// The forward's log-sum-exp per `(batch, head, row)`.
    lse: SavedSlot,
    sinks: Option<Sinks>,
}

const SPLIT_OP: &str = "causal_attention";

impl CustomOp3 for SplitAttention {
    fn name(&self) -> &'static str {
        "zero-causal-attention"
    }

    fn cpu_fwd(
        &self,
        q: &CpuStorage,
        q_layout: &Layout,
        k: &CpuStorage,
        k_layout: &Layout,
        v: &CpuStorage,
        v_layout: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let dims = self.dims;
        let (y, lse) = dispatch_float!(q.dtype(), SPLIT_OP, |T| {
            let operands = Operands::split(
                cpu::slice::<T>(q, q_layout, "q")?,
                cpu::slice::<T>(k, k_layout, "k")?,
                cpu::slice::<T>(v, v_layout, "v")?,
                &dims,
            );
            let (y, lse) = forward::<T>(&operands, &dims);
            (
                T::to_cpu_storage_owned(y),
                <T as Elem>::Acc::to_cpu_storage_owned(lse),
            )
        });
        let y = self.finish(Storage::Cpu(y), Storage::Cpu(lse))?;
        Ok((on_device(y, SPLIT_OP)?, split_shape(&dims)))
    }

    fn cuda_fwd(
        &self,
        q: &CudaStorage,
        q_layout: &Layout,
        k: &CudaStorage,
        k_layout: &Layout,
        v: &CudaStorage,
        v_layout: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        let dims = self.dims;
        let (y, lse) =
            cuda::attention_forward_split([(q, q_layout), (k, k_layout), (v, v_layout)], &dims)?;
        let y = self.finish(Storage::Cuda(y), Storage::Cuda(lse))?;
        Ok((on_device(y, SPLIT_OP)?, split_shape(&dims)))
    }

    fn bwd(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        out: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let dims = self.dims;
        let grad = grad.contiguous()?;
        let (q_shape, kv_shape) = (q.shape().clone(), k.shape().clone());
        let [dq, dk, dv] = self.lse.read(SPLIT_OP, |saved| match saved {
            Saved::Cpu(lse) => {
                let grads = cpu::with_cpu(q, "q", |qs, ql| {
                    cpu::with_cpu(k, "k", |ks, kl| {
                        cpu::with_cpu(v, "v", |vs, vl| {
                            cpu::with_cpu(out, "the attention output", |os, ol| {
                                cpu::with_cpu(&grad, "the output gradient", |gs, gl| {
                                    Ok(dispatch_float!(qs.dtype(), SPLIT_OP, |T| {
                                        let operands = Operands::split(
                                            cpu::slice::<T>(qs, ql, "q")?,
                                            cpu::slice::<T>(ks, kl, "k")?,
                                            cpu::slice::<T>(vs, vl, "v")?,
                                            &dims,
                                        );
                                        let grads = backward::<T>(
                                            &operands,
                                            cpu::slice::<T>(os, ol, "the attention output")?,
                                            cpu::slice::<T>(gs, gl, "the output gradient")?,
                                            <T as Elem>::Acc::cpu_storage_as_slice(lse)?,
                                            &dims,
                                        );
                                        [grads.q, grads.k, grads.v].map(T::to_cpu_storage_owned)
                                    }))
                                })
                            })
                        })
                    })
                })?;
                Ok(grads.map(Storage::Cpu))
            }
            Saved::Cuda(lse) => {
                let grads = with_cuda(q, "q", |qs, ql| {
                    with_cuda(k, "k", |ks, kl| {
                        with_cuda(v, "v", |vs, vl| {
                            with_cuda(out, "the attention output", |os, ol| {
                                with_cuda(&grad, "the output gradient", |gs, gl| {
                                    cuda::attention_backward_split(
                                        [(qs, ql), (ks, kl), (vs, vl)],
                                        (os, ol),
                                        lse,
                                        (gs, gl),
                                        &dims,
                                    )
                                })
                            })
                        })
                    })
                })?;
                Ok(grads.map(Storage::Cuda))
            }
        })?;
        if let Some(sinks) = &self.sinks {
            sinks.backward(out, &grad)?;
        }
        Ok((
            Some(tensor_from(dq, q_shape)),
            Some(tensor_from(dk, kv_shape.clone())),
            Some(tensor_from(dv, kv_shape)),
        ))
    }
}

impl SplitAttention {
    /// The forward's output `y`, with the sinks joined where there are
    /// any; its rows' log-sum-exp `lse` (joined likewise) saved for the
    /// backward.
    fn finish(&self, y: Storage, lse: Storage) -> Result<Storage> {
        let (y, lse) = match &self.sinks {
            None => (y, lse),
            Some(sinks) => {
                let d = self.dims;
                let (y, lse) = sinks.join(
                    tensor_from(y, split_shape(&d)),
                    tensor_from(lse, (d.batch, d.heads, d.time)),
                )?;
                (
                    owned_storage(&y, "the attention output")?,
                    owned_storage(&lse, "the attention's row statistics")?,
                )
            }
        };
        self.lse.put(match lse {
            Storage::Cpu(lse) => Saved::Cpu(lse),
            Storage::Cuda(lse) => Saved::Cuda(lse),
            _ => candle_core::bail!("zero-candle {SPLIT_OP}: runs on the CPU and on CUDA only"),
        });
        Ok(y)
    }
}

/// The split form's output shape, `[batch, time, heads, head_dim]`.
fn split_shape(dims: &AttentionDims) -> Shape {
    Shape::from((dims.batch, dims.time, dims.heads, dims.head_dim))
}

/// `Σ a·b` in `A`, in eight lanes so that it vectorizes.
fn dot<A: Accum>(a: &[A], b: &[A]) -> A {
    let mut lanes = [A::ZERO; 8];
    let (a8, b8) = (a.chunks_exact(8), b.chunks_exact(8));
    let (a_rest, b_rest) = (a8.remainder(), b8.remainder());
    for (x, y) in a8.zip(b8) {
        for l in 0..8 {
            lanes[l] += x[l] * y[l];
        }
    }
    let mut sum = A::ZERO;
    for (&x, &y) in a_rest.iter().zip(b_rest) {
        sum += x * y;
    }
    for lane in lanes {
        sum += lane;
    }
    sum
}

/// `acc += p · x`.
fn axpy<A: Accum>(acc: &mut [A], p: A, x: &[A]) {
    for (a, &v) in acc.iter_mut().zip(x) {
        *a += p * v;
    }
}

/// One sequence's rows in the accumulation type.
fn widen<T: Elem>(values: &[T]) -> Vec<T::Acc> {
    values.iter().map(|v| v.acc()).collect()
}

/// One of q, k, v: rows of `stride` elements in `data`, the operand's
/// head 0 at column `at` of each row, head `h` `h * head_dim` further.
#[derive(Clone, Copy)]
struct Operand<'a, T> {
    data: &'a [T],
    at: usize,
    stride: usize,
}

impl<'a, T> Operand<'a, T> {
    /// Sequence `b`'s rows.
    fn sequence(&self, b: usize, time: usize) -> &'a [T] {
        &self.data[b * time * self.stride..][..time * self.stride]
    }
}

/// The inputs of one attention call: a packed `qkv` (three column ranges
/// of one buffer) or three tensors.
struct Operands<'a, T> {
    q: Operand<'a, T>,
    k: Operand<'a, T>,
    v: Operand<'a, T>,
}

impl<'a, T> Operands<'a, T> {
    fn packed(qkv: &'a [T], dims: &AttentionDims) -> Self {
        let (d, stride) = (dims.d_model(), dims.d_model() + 2 * dims.kv_width());
        let at = |at| Operand {
            data: qkv,
            at,
            stride,
        };
        Self {
            q: at(0),
            k: at(d),
            v: at(d + dims.kv_width()),
        }
    }

    fn split(q: &'a [T], k: &'a [T], v: &'a [T], dims: &AttentionDims) -> Self {
        let (d, kv) = (dims.d_model(), dims.kv_width());
        Self {
            q: Operand {
                data: q,
                at: 0,
                stride: d,
            },
            k: Operand {
                data: k,
                at: 0,
                stride: kv,
            },
            v: Operand {
                data: v,
                at: 0,
                stride: kv,
            },
        }
    }
}

/// One sequence's operand widened to the accumulation type, rows readable
/// per head.
struct Widened<A> {
    x: Vec<A>,
    at: usize,
    stride: usize,
    head_dim: usize,
}

impl<A: Accum> Widened<A> {
    fn of<T: Elem<Acc = A>>(operand: &Operand<T>, b: usize, dims: &AttentionDims) -> Self {
        Self {
            x: widen(operand.sequence(b, dims.time)),
            at: operand.at,
            stride: operand.stride,
            head_dim: dims.head_dim,
        }
    }

    /// Row `t` of head `h`.
    fn row(&self, t: usize, h: usize) -> &[A] {
        &self.x[t * self.stride + self.at + h * self.head_dim..][..self.head_dim]
    }
}

/// The forward over every sequence (in parallel): the output `[batch,
/// time, heads * head_dim]` and the log-sum-exp `[batch, heads, time]`.
///
/// Row `i` of head `h` (K/V head `g = h / (heads / kv_heads)`): scores
/// `s_j = scale · q_i·k_j` for the keys it sees (`j <= i`, within the
/// window), `m = max s`, `l = Σ exp(s_j - m)`,
/// `y_i = Σ exp(s_j - m) v_j / l`, `lse_i = m + ln l`.
fn forward<T: Elem>(operands: &Operands<T>, dims: &AttentionDims) -> (Vec<T>, Vec<T::Acc>) {
    let AttentionDims {
        batch,
        time,
        heads,
        head_dim: hd,
        ..
    } = *dims;
    let d = dims.d_model();
    let group = heads / dims.kv_heads;
    let scale = dims.scale_in::<T::Acc>();
    let mut y = vec![T::from_acc(T::Acc::ZERO); batch * time * d];
    let mut lse = vec![T::Acc::ZERO; batch * heads * time];
    if y.is_empty() {
        return (y, lse);
    }
    y.par_chunks_mut(time * d)
        .zip(lse.par_chunks_mut(heads * time))
        .enumerate()
        .for_each(|(b, (y, lse))| {
            let q = Widened::of(&operands.q, b, dims);
            let k = Widened::of(&operands.k, b, dims);
            let v = Widened::of(&operands.v, b, dims);
            let mut scores = vec![T::Acc::ZERO; time];
            let mut acc = vec![T::Acc::ZERO; hd];
            for h in 0..heads {
                let g = h / group;
                for i in 0..time {
                    let q_i = q.row(i, h);
                    // Keys j0..=i, scores[j - j0].
                    let j0 = dims.first_key(i);
                    let scores = &mut scores[j0..=i];
                    for (j, s) in (j0..).zip(scores.iter_mut()) {
                        *s = scale * dot(q_i, k.row(j, g));
                    }
                    let max = scores
                        .iter()
                        .fold(T::Acc::NEG_INFINITY, |m, &s| if s > m { s } else { m });
                    // A pass of its own, so that the exponentials vectorize.
                    for s in scores.iter_mut() {
                        *s = (*s - max).exp();
                    }
                    let sum = scores.iter().fold(T::Acc::ZERO, |a, &p| a + p);
                    acc.fill(T::Acc::ZERO);
                    for (j, &p) in (j0..).zip(scores.iter()) {
                        axpy(&mut acc, p, v.row(j, g));
                    }
                    let inv = T::Acc::ONE / sum;
                    for (o, &a) in y[i * d + h * hd..][..hd].iter_mut().zip(&acc) {
                        *o = T::from_acc(a * inv);
                    }
                    lse[h * time + i] = max + sum.ln();
                }
            }
        });
    (y, lse)
}

/// The gradients of q `[batch, time, heads * head_dim]`, k and v `[batch,
/// time, kv_heads * head_dim]`, each rounded once.
struct Gradients<T> {
    q: Vec<T>,
    k: Vec<T>,
    v: Vec<T>,
}

impl<T: Copy> Gradients<T> {
    /// As one packed `dqkv` `[batch, time, (heads + 2 kv_heads) head_dim]`.
    fn packed(&self, dims: &AttentionDims) -> Vec<T> {
        let (d, kv) = (dims.d_model(), dims.kv_width());
        let mut dqkv = Vec::with_capacity(self.q.len() + 2 * self.k.len());
        for ((q, k), v) in self
            .q
            .chunks_exact(d)
            .zip(self.k.chunks_exact(kv))
            .zip(self.v.chunks_exact(kv))
        {
            dqkv.extend_from_slice(q);
            dqkv.extend_from_slice(k);
            dqkv.extend_from_slice(v);
        }
        dqkv
    }
}

/// The gradients of q, k and v given the forward's output `out`, its
/// gradient `grad` and the log-sum-exp `lse`, every sequence in parallel.
///
/// Per head, with `p_ij = exp(scale · q_i·k_j - lse_i)` recomputed and
/// `D_i = Σ grad_i · out_i`: `dv_j += p_ij grad_i`,
/// `ds_ij = p_ij (grad_i·v_j - D_i)`, `dq_i += scale · ds_ij k_j`,
/// `dk_j += scale · ds_ij q_i`; a K/V head's `dk`, `dv` sum over its group
/// of query heads in head order.
fn backward<T: Elem>(
    operands: &Operands<T>,
    out: &[T],
    grad: &[T],
    lse: &[T::Acc],
    dims: &AttentionDims,
) -> Gradients<T> {
    let AttentionDims {
        batch,
        time,
        heads,
        head_dim: hd,
        ..
    } = *dims;
    let (d, kv) = (dims.d_model(), dims.kv_width());
    let group = heads / dims.kv_heads;
    let scale = dims.scale_in::<T::Acc>();
    let zero = T::from_acc(T::Acc::ZERO);
    let mut grads = Gradients {
        q: vec![zero; batch * time * d],
        k: vec![zero; batch * time * kv],
        v: vec![zero; batch * time * kv],
    };
    if grads.q.is_empty() {
        return grads;
    }
    grads
        .q
        .par_chunks_mut(time * d)
        .zip(grads.k.par_chunks_mut(time * kv))
        .zip(grads.v.par_chunks_mut(time * kv))
        .zip(out.par_chunks(time * d))
        .zip(grad.par_chunks(time * d))
        .zip(lse.par_chunks(heads * time))
        .enumerate()
        .for_each(|(b, (((((dq_out, dk_out), dv_out), out), grad), lse))| {
            let q = Widened::of(&operands.q, b, dims);
            let k = Widened::of(&operands.k, b, dims);
            let v = Widened::of(&operands.v, b, dims);
            let o = widen(out);
            let g = widen(grad);
            let mut dq = vec![T::Acc::ZERO; time * d];
            let mut dk = vec![T::Acc::ZERO; time * kv];
            let mut dv = vec![T::Acc::ZERO; time * kv];
            let mut delta = vec![T::Acc::ZERO; time];
            let (mut p, mut ds) = (vec![T::Acc::ZERO; time], vec![T::Acc::ZERO; time]);
            for h in 0..heads {
                let kv_at = (h / group) * hd;
                for (i, delta) in delta.iter_mut().enumerate() {
                    let at = i * d + h * hd;
                    *delta = dot(&g[at..][..hd], &o[at..][..hd]);
                }
                for i in 0..time {
                    let q_i = q.row(i, h);
                    let g_i = &g[i * d + h * hd..][..hd];
                    let lse_i = lse[h * time + i];
                    // Keys j0..=i, p[j - j0] and ds[j - j0].
                    let j0 = dims.first_key(i);
                    let (p, ds) = (&mut p[j0..=i], &mut ds[j0..=i]);
                    // Each quantity in a pass of its own over the row's
                    // keys, so that the exponentials and products vectorize.
                    for (j, p) in (j0..).zip(p.iter_mut()) {
                        *p = scale * dot(q_i, k.row(j, h / group));
                    }
                    for p in p.iter_mut() {
                        *p = (*p - lse_i).exp();
                    }
                    for (j, ds) in (j0..).zip(ds.iter_mut()) {
                        *ds = dot(g_i, v.row(j, h / group));
                    }
                    for (ds, &p) in ds.iter_mut().zip(p.iter()) {
                        *ds = scale * p * (*ds - delta[i]);
                    }
                    for (j, (&p, &ds)) in (j0..).zip(p.iter().zip(ds.iter())) {
                        axpy(&mut dv[j * kv + kv_at..][..hd], p, g_i);
                        axpy(&mut dk[j * kv + kv_at..][..hd], ds, q_i);
                    }
                    let dq_i = &mut dq[i * d + h * hd..][..hd];
                    for (j, &ds) in (j0..).zip(ds.iter()) {
                        axpy(dq_i, ds, k.row(j, h / group));
                    }
                }
            }
            for (out, acc) in [(dq_out, &dq), (dk_out, &dk), (dv_out, &dv)] {
                for (out, &v) in out.iter_mut().zip(acc.iter()) {
                    *out = T::from_acc(v);
                }
            }
        });
    grads
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    /// Seeded values in `[-scale, scale)` as a variable of `dtype`.
    fn var(seed: u64, shape: &[usize], scale: f32, dtype: DType) -> Result<Var> {
        let mut rng = StdRng::seed_from_u64(seed);
        let n: usize = shape.iter().product();
        let values: Vec<f32> = (0..n).map(|_| rng.gen_range(-scale..scale)).collect();
        Var::from_tensor(&Tensor::from_vec(values, shape, &Device::Cpu)?.to_dtype(dtype)?)
    }

    /// The output of `attention` on `q`, `k`, `v` and their gradients
    /// under `Σ y·upstream` (an upstream that is not uniform, so that a
    /// misplaced gradient shows).
    fn value_and_grads(
        [q, k, v]: [&Var; 3],
        upstream: &Tensor,
        attention: impl Fn(&Tensor, &Tensor, &Tensor) -> Result<Tensor>,
    ) -> Result<Vec<Tensor>> {
        let y = attention(q.as_tensor(), k.as_tensor(), v.as_tensor())?;
        let grads = (&y * upstream)?
            .to_dtype(DType::F32)?
            .sum_all()?
            .backward()?;
        let mut out = vec![y];
        for x in [q, k, v] {
            let grad = grads.get(x.as_tensor()).cloned();
            out.push(grad.ok_or_else(|| candle_core::Error::Msg("no gradient".into()))?);
        }
        Ok(out)
    }

    /// `|got - want| <= tol · max |want|` element for element.
    fn assert_close(what: &str, got: &Tensor, want: &Tensor, tol: f32) -> Result<()> {
        assert_eq!(got.dims(), want.dims(), "{what}: shapes");
        assert_eq!(got.dtype(), want.dtype(), "{what}: dtypes");
        let [got, want] = [got, want].map(|t| t.to_dtype(DType::F32)?.flatten_all()?.to_vec1());
        let (got, want): (Vec<f32>, Vec<f32>) = (got?, want?);
        let scale = want.iter().fold(f32::MIN_POSITIVE, |m, w| m.max(w.abs()));
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert!(
                (g - w).abs() <= tol * scale,
                "{what}: element {i} is {g:e}, want {w:e} (tolerance {tol:e} x {scale:e})"
            );
        }
        Ok(())
    }

    /// Compares [`composed_attention`] with the fused CPU op, output and
    /// the gradients of q, k and v, at each `(batch, time, heads,
    /// kv_heads, head_dim)` and window.
    fn composed_matches_fused(
        dtype: DType,
        shapes: &[(usize, usize, usize, usize, usize)],
        windows: &[Option<usize>],
        tol: f32,
    ) -> Result<()> {
        for (seed, &(b, t, h, kvh, d)) in shapes.iter().enumerate() {
            for &window in windows {
                let seed = 10 * seed as u64;
                let q = var(seed, &[b, t, h, d], 2.0, dtype)?;
                let k = var(seed + 1, &[b, t, kvh, d], 2.0, dtype)?;
                let v = var(seed + 2, &[b, t, kvh, d], 2.0, dtype)?;
                let upstream = var(seed + 3, &[b, t, h, d], 1.0, dtype)?;
                let dims = AttentionDims::of_split(&q, &k, &v)?;
                let dims = match window {
                    Some(w) => dims.with_window(w)?,
                    None => dims,
                };
                let inputs = [&q, &k, &v];
                let fused = value_and_grads(inputs, &upstream, |q, k, v| match window {
                    Some(w) => sliding_window_attention(q, k, v, w),
                    None => causal_attention(q, k, v),
                })?;
                let composed = value_and_grads(inputs, &upstream, |q, k, v| {
                    composed_attention(q, k, v, dims, None, None)
                })?;
                for (name, (got, want)) in ["output", "dq", "dk", "dv"]
                    .iter()
                    .zip(composed.iter().zip(&fused))
                {
                    let what = format!("{dtype:?} b{b} t{t} h{h} kv{kvh} d{d} window {window:?}");
                    assert_close(&format!("{what} {name}"), got, want, tol)?;
                }
            }
        }
        Ok(())
    }

    /// Capped scores: a cap far above every score is the plain attention
    /// (output and gradients); a cap that bites gives, per query, the
    /// softmax of `cap · tanh(s / cap)` over its window, computed here in
    /// f64 from the inputs; a cap that is not positive is an error.
    #[test]
    fn softcapped_attention_caps_the_scores_before_the_mask() -> Result<()> {
        let (b, t, h, kvh, d) = (2, 7, 4, 2, 8);
        let q = var(1, &[b, t, h, d], 2.0, DType::F32)?;
        let k = var(2, &[b, t, kvh, d], 2.0, DType::F32)?;
        let v = var(3, &[b, t, kvh, d], 2.0, DType::F32)?;
        let upstream = var(4, &[b, t, h, d], 1.0, DType::F32)?;
        for window in [None, Some(3)] {
            let plain = value_and_grads([&q, &k, &v], &upstream, |q, k, v| match window {
                Some(w) => sliding_window_attention(q, k, v, w),
                None => causal_attention(q, k, v),
            })?;
            let loose = value_and_grads([&q, &k, &v], &upstream, |q, k, v| {
                softcapped_attention(q, k, v, window, 1e9)
            })?;
            for (name, (got, want)) in ["output", "dq", "dk", "dv"]
                .iter()
                .zip(loose.iter().zip(&plain))
            {
                assert_close(&format!("cap 1e9 {window:?} {name}"), got, want, 1e-5)?;
            }
            let cap = 0.5;
            let capped = softcapped_attention(&q, &k, &v, window, cap)?;
            let [qv, kv, vv] = [&q, &k, &v].map(|x| x.flatten_all()?.to_vec1::<f32>());
            let (qv, kv, vv) = (qv?, kv?, vv?);
            let mut want = vec![0f32; b * t * h * d];
            for (bi, ti, hi) in
                (0..b).flat_map(|bi| (0..t).flat_map(move |ti| (0..h).map(move |hi| (bi, ti, hi))))
            {
                let kh = hi / (h / kvh);
                let row = |x: &[f32], at: usize, heads: usize, head: usize| -> Vec<f64> {
                    let start = ((bi * t + at) * heads + head) * d;
                    x[start..start + d].iter().map(|&v| v as f64).collect()
                };
                let first = window.map_or(0, |w| (ti + 1).saturating_sub(w));
                let qi = row(&qv, ti, h, hi);
                let scores: Vec<f64> = (first..=ti)
                    .map(|j| {
                        let s: f64 = qi
                            .iter()
                            .zip(row(&kv, j, kvh, kh))
                            .map(|(a, b)| a * b)
                            .sum();
                        cap * (s / (d as f64).sqrt() / cap).tanh()
                    })
                    .collect();
                let top = scores.iter().cloned().fold(f64::MIN, f64::max);
                let weights: Vec<f64> = scores.iter().map(|s| (s - top).exp()).collect();
                let total: f64 = weights.iter().sum();
                let out = &mut want[((bi * t + ti) * h + hi) * d..][..d];
                for (j, w) in (first..=ti).zip(&weights) {
                    for (o, x) in out.iter_mut().zip(row(&vv, j, kvh, kh)) {
                        *o += (w / total * x) as f32;
                    }
                }
            }
            let want = Tensor::from_vec(want, (b, t, h, d), &Device::Cpu)?;
            assert_close(&format!("cap {cap} {window:?}"), &capped, &want, 1e-5)?;
            let uncapped = &plain[0];
            let apart = (&capped - uncapped)?.abs()?.max_all()?.to_scalar::<f32>()?;
            assert!(apart > 1e-2, "a cap of {cap} changes the output ({apart})");
        }
        for cap in [0.0, -1.0, f64::NAN] {
            assert!(
                softcapped_attention(&q, &k, &v, None, cap).is_err(),
                "cap {cap}"
            );
        }
        Ok(())
    }

    /// Groups of 2 and 4 query heads per K/V head and plain multi-head
    /// attention, Gemma's width and a narrow one, one position and
    /// several; no window, windows shorter than the sequence and of one
    /// position. A wrong mask or a wrong head grouping is off by the
    /// values' own size, far beyond the tolerance.
    const SHAPES: [(usize, usize, usize, usize, usize); 6] = [
        (2, 9, 4, 2, 256),
        (1, 1, 4, 2, 256),
        (1, 13, 4, 1, 256),
        (2, 11, 4, 2, 8),
        (1, 1, 2, 1, 8),
        (1, 6, 3, 3, 16),
    ];
    const WINDOWS: [Option<usize>; 4] = [None, Some(1), Some(3), Some(7)];

    #[test]
    fn composed_attention_matches_the_fused_op_in_f32() -> Result<()> {
        composed_matches_fused(DType::F32, &SHAPES, &WINDOWS, 1e-5)
    }

    /// 16-bit: the composed attention rounds the scores and the weights to
    /// the input type (as `transformers` does), the fused op rounds once,
    /// so they agree to a few units in the last place of the type, the
    /// tolerance `tests/gpu_layers.rs` gives CUDA against the CPU.
    #[test]
    fn composed_attention_matches_the_fused_op_in_16_bits() -> Result<()> {
        composed_matches_fused(DType::BF16, &SHAPES, &WINDOWS, 4.0 / 256.0)?;
        composed_matches_fused(DType::F16, &SHAPES, &WINDOWS, 4.0 / 2048.0)
    }

    /// No sequences or no positions: empty outputs and gradients, as the
    /// fused op gives.
    #[test]
    fn composed_attention_of_no_positions_is_empty() -> Result<()> {
        for (b, t) in [(0, 5), (2, 0)] {
            let q = var(1, &[b, t, 4, 256], 1.0, DType::F32)?;
            let k = var(2, &[b, t, 2, 256], 1.0, DType::F32)?;
            let v = var(3, &[b, t, 2, 256], 1.0, DType::F32)?;
            let dims = AttentionDims::of_split(&q, &k, &v)?;
            let upstream = q.ones_like()?;
            let got = value_and_grads([&q, &k, &v], &upstream, |q, k, v| {
                composed_attention(q, k, v, dims, None, None)
            })?;
            let shapes: Vec<&[usize]> = got.iter().map(|t| t.dims()).collect();
            assert_eq!(shapes, [q.dims(), q.dims(), k.dims(), v.dims()]);
        }
        Ok(())
    }

    /// The fused sinks (gradient to a hook) against the composed ones
    /// (gradient in the `GradStore`): output and the gradients of q, k, v
    /// and the sinks, with and without a window, grouped and not.
    fn sinks_fused_match_composed(dtype: DType, tol: f32) -> Result<()> {
        use crate::nn::GradCollector;
        for (seed, &(b, t, h, kvh, d)) in SHAPES[3..].iter().enumerate() {
            for window in [None, Some(3)] {
                let seed = 100 + 10 * seed as u64;
                let q = var(seed, &[b, t, h, d], 2.0, dtype)?;
                let k = var(seed + 1, &[b, t, kvh, d], 2.0, dtype)?;
                let v = var(seed + 2, &[b, t, kvh, d], 2.0, dtype)?;
                let sinks = var(seed + 3, &[h], 3.0, dtype)?;
                let upstream = var(seed + 4, &[b, t, h, d], 1.0, dtype)?;
                let collector = Arc::new(GradCollector::new());
                let hook: Arc<dyn GradHook> = collector.clone();
                let fused = value_and_grads([&q, &k, &v], &upstream, |q, k, v| {
                    sink_attention(q, k, v, &sinks, window, Some(hook.clone()))
                })?;
                let fused_sinks = collector.get(&sinks).expect("the sinks' gradient");
                let y = sink_attention(&q, &k, &v, &sinks, window, None)?;
                let grads = (&y * upstream.as_tensor())?
                    .to_dtype(DType::F32)?
                    .sum_all()?
                    .backward()?;
                let composed_sinks = grads.get(&sinks).expect("the sinks' gradient");
                let what = format!("{dtype:?} b{b} t{t} h{h} kv{kvh} d{d} window {window:?}");
                assert_close(&format!("{what} output"), &y, &fused[0], tol)?;
                for (name, (x, got)) in ["dq", "dk", "dv"]
                    .iter()
                    .zip([&q, &k, &v].iter().zip(&fused[1..]))
                {
                    let want = grads.get(x.as_tensor()).expect("a gradient");
                    assert_close(&format!("{what} {name}"), got, want, tol)?;
                }
                assert_close(&format!("{what} dsinks"), &fused_sinks, composed_sinks, tol)?;
                // The sinks take weight: the output is not the plain one.
                let plain = match window {
                    Some(w) => sliding_window_attention(&q, &k, &v, w)?,
                    None => causal_attention(&q, &k, &v)?,
                };
                let apart = (plain - &y)?.abs()?.to_dtype(DType::F32)?.max_all()?;
                assert!(
                    apart.to_scalar::<f32>()? > 1e-2,
                    "{what}: the sinks change nothing"
                );
            }
        }
        Ok(())
    }

    #[test]
    fn sink_attention_fused_equals_composed() -> Result<()> {
        sinks_fused_match_composed(DType::F32, 1e-5)?;
        sinks_fused_match_composed(DType::BF16, 4.0 / 256.0)
    }

    /// A sink far below every score takes no weight: the plain attention;
    /// one sink per query head or an error.
    #[test]
    fn a_sink_far_below_the_scores_is_the_plain_attention() -> Result<()> {
        let q = var(1, &[2, 7, 4, 8], 1.0, DType::F32)?;
        let k = var(2, &[2, 7, 2, 8], 1.0, DType::F32)?;
        let v = var(3, &[2, 7, 2, 8], 1.0, DType::F32)?;
        let sinks = Var::from_tensor(&Tensor::full(-1e4f32, 4, &Device::Cpu)?)?;
        let hook: Arc<dyn GradHook> = Arc::new(crate::nn::GradCollector::new());
        let plain = causal_attention(&q, &k, &v)?;
        for hook in [None, Some(hook)] {
            let y = sink_attention(&q, &k, &v, &sinks, None, hook)?;
            assert_close("far sinks", &y, &plain, 1e-6)?;
        }
        let three = Tensor::zeros(3, DType::F32, &Device::Cpu)?;
        let err = sink_attention(&q, &k, &v, &three, None, None).unwrap_err();
        assert!(err.to_string().contains("one sink per query head"), "{err}");
        Ok(())
    }

    #[test]
    fn only_wide_heads_on_cuda_run_composed() -> Result<()> {
        let dims = |d: usize| {
            let q = Tensor::zeros((1, 2, 4, d), DType::F32, &Device::Cpu)?;
            let kv = Tensor::zeros((1, 2, 2, d), DType::F32, &Device::Cpu)?;
            AttentionDims::of_split(&q, &kv, &kv)
        };
        let wide = FUSED_CUDA_HEAD_DIM + 1;
        assert_eq!(SplitPath::of(true, &dims(wide)?), SplitPath::Composed);
        assert_eq!(SplitPath::of(true, &dims(256)?), SplitPath::Composed);
        assert_eq!(
            SplitPath::of(true, &dims(FUSED_CUDA_HEAD_DIM)?),
            SplitPath::Fused
        );
        assert_eq!(SplitPath::of(false, &dims(256)?), SplitPath::Fused);
        Ok(())
    }

    #[cfg(feature = "cuda")]
    #[test]
    fn the_fused_cuda_width_is_zero_nccls() {
        assert_eq!(
            FUSED_CUDA_HEAD_DIM,
            zero_nccl::kernels::layers::MAX_HEAD_DIM
        );
    }
}
