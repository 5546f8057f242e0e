//! Rotary position embeddings in `transformers`' rotate_half convention as one op,
//! whose backward is the same rotation by the opposite angle.

use super::super::cpu;
use super::super::elem::{dispatch_float, Accum, Elem};
use super::super::storage::{tensor_from, with_cuda};
use super::cuda;
use super::rotary_dims::{RotaryDims, Turn};
use candle_core::backend::BackendStorage;
use candle_core::{
    CpuStorage, CudaStorage, CustomOp3, Layout, Result, Shape, Storage, Tensor, WithDType,
};
use rayon::prelude::*;

const OP: &str = "rotary_embedding";

/// `x * cos + rotate_half(x) * sin`, as Llama's `apply_rotary_pos_emb`, for
/// `x` `[batch, time, heads, head_dim]` and tables `cos`, `sin` `[time,
/// head_dim / 2]` of `x`'s dtype: with `x1`, `x2` the halves of each head
/// and `(c, s)` the table's row of the position,
/// `[x1 c - x2 s, x2 c + x1 s]`. (Llama's full-width tables repeat each
/// half; this op reads one.)
///
/// One op instead of two narrows, a negation, a concatenation, two
/// broadcast products and a sum (and their backward); it keeps nothing for
/// backward but the tables, and its backward is the rotation by the
/// opposite angles. 16-bit inputs compute in f32 and round once. The
/// tables get no gradient.
///
/// ```
/// use candle_core::{Device, Tensor};
/// # fn main() -> candle_core::Result<()> {
/// let x = Tensor::new(&[[[[1f32, 0.0]]]], &Device::Cpu)?; // one head of 2
/// let angle = std::f32::consts::FRAC_PI_2; // one position, one pair
/// let cos = Tensor::new(&[[angle.cos()]], &Device::Cpu)?;
/// let sin = Tensor::new(&[[angle.sin()]], &Device::Cpu)?;
/// let y = zero_candle::nn::ops::rotary_embedding(&x, &cos, &sin)?;
/// let y = y.flatten_all()?.to_vec1::<f32>()?;
/// assert!(y[0].abs() < 1e-6 && (y[1] - 1.0).abs() < 1e-6);
/// # Ok(()) }
/// ```
pub fn rotary_embedding(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let dims = RotaryDims::of(x, cos, sin)?;
    x.contiguous()?
        .apply_op3(&cos.contiguous()?, &sin.contiguous()?, Rotary { dims })
}

struct Rotary {
    dims: RotaryDims,
}

/// Positions (`heads * head_dim` elements each) per parallel chunk: about
/// 16k elements, so that splitting pays.
fn positions_per_chunk(dims: &RotaryDims) -> usize {
    ((1 << 14) / (dims.heads * dims.head_dim).max(1)).max(1)
}

/// `x` rotated by the angles of `cos`, `sin` (or, `Backward`, by their
/// opposites), in parallel chunks of whole positions.
fn rotate<T: Elem>(x: &[T], cos: &[T], sin: &[T], dims: &RotaryDims, turn: Turn) -> Vec<T> {
    let half = dims.head_dim / 2;
    let position = dims.heads * dims.head_dim;
    let mut out = vec![T::from_acc(T::Acc::ZERO); x.len()];
    if position == 0 || dims.time == 0 {
        return out;
    }
    let per_chunk = positions_per_chunk(dims);
    let sign = match turn {
        Turn::Forward => T::Acc::ONE,
        Turn::Backward => -T::Acc::ONE,
    };
    out.par_chunks_mut(per_chunk * position)
        .zip(x.par_chunks(per_chunk * position))
        .enumerate()
        .for_each(|(chunk, (out, x))| {
            let positions = out.chunks_exact_mut(position).zip(x.chunks_exact(position));
            for (p, (out, x)) in positions.enumerate() {
                let t = (chunk * per_chunk + p) % dims.time;
                let (cos, sin) = (&cos[t * half..][..half], &sin[t * half..][..half]);
                let heads = out
                    .chunks_exact_mut(dims.head_dim)
                    .zip(x.chunks_exact(dims.head_dim));
                for (out, x) in heads {
                    let (x1, x2) = x.split_at(half);
                    let (o1, o2) = out.split_at_mut(half);
                    let pairs = o1.iter_mut().zip(o2).zip(x1.iter().zip(x2));
                    for (((o1, o2), (&a, &b)), (&c, &s)) in pairs.zip(cos.iter().zip(sin)) {
                        let (a, b, c, s) = (a.acc(), b.acc(), c.acc(), sign * s.acc());
                        *o1 = T::from_acc(a * c - b * s);
                        *o2 = T::from_acc(b * c + a * s);
                    }
                }
            }
        });
    out
}

/// [`rotate`] over CPU storages.
fn rotate_cpu(
    x: (&CpuStorage, &Layout),
    cos: (&CpuStorage, &Layout),
    sin: (&CpuStorage, &Layout),
    dims: &RotaryDims,
    turn: Turn,
) -> Result<CpuStorage> {
    Ok(dispatch_float!(x.0.dtype(), OP, |T| {
        let x = cpu::slice::<T>(x.0, x.1, "x")?;
        let cos = cpu::slice::<T>(cos.0, cos.1, "cos")?;
        let sin = cpu::slice::<T>(sin.0, sin.1, "sin")?;
        T::to_cpu_storage_owned(rotate(x, cos, sin, dims, turn))
    }))
}

impl CustomOp3 for Rotary {
    fn name(&self) -> &'static str {
        "zero-rotary-embedding"
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        x_layout: &Layout,
        cos: &CpuStorage,
        cos_layout: &Layout,
        sin: &CpuStorage,
        sin_layout: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let y = rotate_cpu(
            (x, x_layout),
            (cos, cos_layout),
            (sin, sin_layout),
            &self.dims,
            Turn::Forward,
        )?;
        Ok((y, self.dims.shape()))
    }

    fn cuda_fwd(
        &self,
        x: &CudaStorage,
        x_layout: &Layout,
        cos: &CudaStorage,
        cos_layout: &Layout,
        sin: &CudaStorage,
        sin_layout: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        let y = cuda::rotary_embedding(
            (x, x_layout),
            (cos, cos_layout),
            (sin, sin_layout),
            &self.dims,
            Turn::Forward,
        )?;
        Ok((y, self.dims.shape()))
    }

    fn bwd(
        &self,
        _x: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        _y: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let dims = self.dims;
        let grad = grad.contiguous()?;
        let dx = if grad.device().is_cuda() {
            Storage::Cuda(with_cuda(&grad, "the output gradient", |gs, gl| {
                with_cuda(cos, "cos", |cs, cl| {
                    with_cuda(sin, "sin", |ss, sl| {
                        cuda::rotary_embedding((gs, gl), (cs, cl), (ss, sl), &dims, Turn::Backward)
                    })
                })
            })?)
        } else {
            Storage::Cpu(cpu::with_cpu(&grad, "the output gradient", |gs, gl| {
                cpu::with_cpu(cos, "cos", |cs, cl| {
                    cpu::with_cpu(sin, "sin", |ss, sl| {
                        rotate_cpu((gs, gl), (cs, cl), (ss, sl), &dims, Turn::Backward)
                    })
                })
            })?)
        };
        Ok((Some(tensor_from(dx, dims.shape())), None, None))
    }
}
