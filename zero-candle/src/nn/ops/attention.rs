//! Causal self-attention over a packed `qkv` tensor, as one op.

use super::super::cpu;
use super::super::cuda;
use super::super::elem::{dispatch_float, Accum, Elem};
use super::super::storage::{tensor_from, with_cuda, Saved, SavedSlot};
use super::attention_dims::AttentionDims;
use candle_core::backend::BackendStorage;
use candle_core::{
    CpuStorage, CudaStorage, CustomOp1, Layout, Result, Shape, Storage, Tensor, WithDType,
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
/// inputs compute in f32. On CUDA one kernel does the forward and one the
/// backward, over every batch and head.
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
    qkv.contiguous()?.apply_op1(CausalAttention {
        dims,
        lse: SavedSlot::default(),
    })
}

struct CausalAttention {
    dims: AttentionDims,
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
            let (y, lse) = forward::<T>(qkv, &dims);
            (
                T::to_cpu_storage_owned(y),
                <T as Elem>::Acc::to_cpu_storage_owned(lse),
            )
        });
        self.lse.put(Saved::Cpu(lse));
        Ok((y, Shape::from((dims.batch, dims.time, dims.d_model()))))
    }

    fn cuda_fwd(&self, storage: &CudaStorage, layout: &Layout) -> Result<(CudaStorage, Shape)> {
        let dims = self.dims;
        let (y, lse) = cuda::attention_forward((storage, layout), &dims)?;
        self.lse.put(Saved::Cuda(lse));
        Ok((y, Shape::from((dims.batch, dims.time, dims.d_model()))))
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
                                T::to_cpu_storage_owned(backward::<T>(
                                    cpu::slice::<T>(q_storage, q_layout, "the qkv input")?,
                                    cpu::slice::<T>(o_storage, o_layout, "the attention output")?,
                                    cpu::slice::<T>(g_storage, g_layout, "the output gradient")?,
                                    <T as Elem>::Acc::cpu_storage_as_slice(lse)?,
                                    &dims,
                                ))
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

/// One sequence's `qkv` `[time, 3d]` in the accumulation type.
fn widen<T: Elem>(values: &[T]) -> Vec<T::Acc> {
    values.iter().map(|v| v.acc()).collect()
}

/// The forward over every sequence (in parallel): the output `[batch,
/// time, d]` and the log-sum-exp `[batch, heads, time]`.
///
/// Row `i` of head `h`: scores `s_j = scale · q_i·k_j` for `j <= i`,
/// `m = max s`, `l = Σ exp(s_j - m)`, `y_i = Σ exp(s_j - m) v_j / l`,
/// `lse_i = m + ln l`.
fn forward<T: Elem>(qkv: &[T], dims: &AttentionDims) -> (Vec<T>, Vec<T::Acc>) {
    let AttentionDims {
        batch,
        time,
        heads,
        head_dim: hd,
        ..
    } = *dims;
    let d = dims.d_model();
    let scale = dims.scale_in::<T::Acc>();
    let mut y = vec![T::from_acc(T::Acc::ZERO); batch * time * d];
    let mut lse = vec![T::Acc::ZERO; batch * heads * time];
    if y.is_empty() {
        return (y, lse);
    }
    y.par_chunks_mut(time * d)
        .zip(lse.par_chunks_mut(heads * time))
        .zip(qkv.par_chunks(time * 3 * d))
        .for_each(|((y, lse), qkv)| {
            let x = widen(qkv);
            let mut scores = vec![T::Acc::ZERO; time];
            let mut acc = vec![T::Acc::ZERO; hd];
            for h in 0..heads {
                let (q_at, k_at, v_at) = (h * hd, d + h * hd, 2 * d + h * hd);
                for i in 0..time {
                    let q = &x[i * 3 * d + q_at..][..hd];
                    let scores = &mut scores[..=i];
                    for (j, s) in scores.iter_mut().enumerate() {
                        *s = scale * dot(q, &x[j * 3 * d + k_at..][..hd]);
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
                    for (j, &p) in scores.iter().enumerate() {
                        axpy(&mut acc, p, &x[j * 3 * d + v_at..][..hd]);
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

/// The gradient of `qkv` given the forward's output `out`, its gradient
/// `grad` and the log-sum-exp `lse`, every sequence in parallel.
///
/// Per head, with `p_ij = exp(scale · q_i·k_j - lse_i)` recomputed and
/// `D_i = Σ grad_i · out_i`: `dv_j += p_ij grad_i`,
/// `ds_ij = p_ij (grad_i·v_j - D_i)`, `dq_i += scale · ds_ij k_j`,
/// `dk_j += scale · ds_ij q_i`.
fn backward<T: Elem>(
    qkv: &[T],
    out: &[T],
    grad: &[T],
    lse: &[T::Acc],
    dims: &AttentionDims,
) -> Vec<T> {
    let AttentionDims {
        batch,
        time,
        heads,
        head_dim: hd,
        ..
    } = *dims;
    let d = dims.d_model();
    let scale = dims.scale_in::<T::Acc>();
    let mut dqkv = vec![T::from_acc(T::Acc::ZERO); batch * time * 3 * d];
    if dqkv.is_empty() {
        return dqkv;
    }
    dqkv.par_chunks_mut(time * 3 * d)
        .zip(qkv.par_chunks(time * 3 * d))
        .zip(out.par_chunks(time * d))
        .zip(grad.par_chunks(time * d))
        .zip(lse.par_chunks(heads * time))
        .for_each(|((((dqkv, qkv), out), grad), lse)| {
            let x = widen(qkv);
            let o = widen(out);
            let g = widen(grad);
            let mut dx = vec![T::Acc::ZERO; time * 3 * d];
            let mut delta = vec![T::Acc::ZERO; time];
            let (mut p, mut ds) = (vec![T::Acc::ZERO; time], vec![T::Acc::ZERO; time]);
            let mut dq = vec![T::Acc::ZERO; hd];
            for h in 0..heads {
                let (q_at, k_at, v_at) = (h * hd, d + h * hd, 2 * d + h * hd);
                for (i, delta) in delta.iter_mut().enumerate() {
                    let at = i * d + h * hd;
                    *delta = dot(&g[at..][..hd], &o[at..][..hd]);
                }
                for i in 0..time {
                    let q = &x[i * 3 * d + q_at..][..hd];
                    let g_i = &g[i * d + h * hd..][..hd];
                    let lse_i = lse[h * time + i];
                    let (p, ds) = (&mut p[..=i], &mut ds[..=i]);
                    // Each quantity in a pass of its own over the row's
                    // keys, so that the exponentials and products vectorize.
                    for (j, p) in p.iter_mut().enumerate() {
                        *p = scale * dot(q, &x[j * 3 * d + k_at..][..hd]);
                    }
                    for p in p.iter_mut() {
                        *p = (*p - lse_i).exp();
                    }
                    for (j, ds) in ds.iter_mut().enumerate() {
                        *ds = dot(g_i, &x[j * 3 * d + v_at..][..hd]);
                    }
                    for (ds, &p) in ds.iter_mut().zip(p.iter()) {
                        *ds = scale * p * (*ds - delta[i]);
                    }
                    for j in 0..=i {
                        axpy(&mut dx[j * 3 * d + v_at..][..hd], p[j], g_i);
                        axpy(&mut dx[j * 3 * d + k_at..][..hd], ds[j], q);
                    }
                    let dq = &mut dq[..hd];
                    dq.fill(T::Acc::ZERO);
                    for (j, &ds) in ds.iter().enumerate() {
                        axpy(dq, ds, &x[j * 3 * d + k_at..][..hd]);
                    }
                    for (out, &v) in dx[i * 3 * d + q_at..][..hd].iter_mut().zip(dq.iter()) {
                        *out += v;
                    }
                }
            }
            for (out, &v) in dqkv.iter_mut().zip(&dx) {
                *out = T::from_acc(v);
            }
        });
    dqkv
}
