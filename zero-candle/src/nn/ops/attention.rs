//! Causal attention as one op: over a packed `qkv` tensor, or over separate
//! `q`, `k`, `v` with grouped K/V heads.

use super::super::cpu;
use super::super::elem::{dispatch_float, Accum, Elem};
use super::super::storage::{tensor_from, with_cuda, Saved, SavedSlot};
use super::attention_dims::AttentionDims;
use super::cuda;
use candle_core::backend::BackendStorage;
use candle_core::{
    CpuStorage, CudaStorage, CustomOp1, CustomOp3, Layout, Result, Shape, Storage, Tensor,
    WithDType,
};
use rayon::prelude::*;

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
/// type, as FlashAttention-2 does). Heads up to 128 wide.
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
/// compute and stream only the key tiles inside the window.
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

fn split_attention(q: &Tensor, k: &Tensor, v: &Tensor, dims: AttentionDims) -> Result<Tensor> {
    q.contiguous()?.apply_op3(
        &k.contiguous()?,
        &v.contiguous()?,
        SplitAttention {
            dims,
            lse: SavedSlot::default(),
        },
    )
}

struct SplitAttention {
    dims: AttentionDims,
    /// The forward's log-sum-exp per `(batch, head, row)`.
    lse: SavedSlot,
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
        self.lse.put(Saved::Cpu(lse));
        Ok((y, split_shape(&dims)))
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
        self.lse.put(Saved::Cuda(lse));
        Ok((y, split_shape(&dims)))
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
        Ok((
            Some(tensor_from(dq, q_shape)),
            Some(tensor_from(dk, kv_shape.clone())),
            Some(tensor_from(dv, kv_shape)),
        ))
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
