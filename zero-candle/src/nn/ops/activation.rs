//! GELU and SiLU as single ops whose backward is one pass.

use super::super::cpu;
use super::super::elem::{dispatch_float, Accum, Elem};
use super::super::storage::{tensor_from, with_cuda};
use super::activation_kind::Activation;
use super::cuda;
use candle_core::backend::BackendStorage;
use candle_core::{
    bail, CpuStorage, CudaStorage, CustomOp1, InplaceOp2, Layout, Result, Shape, Storage, Tensor,
    WithDType,
};
use rayon::prelude::*;
use std::sync::{Mutex, PoisonError};

/// √(2/π), GELU's tanh constant.
const SQRT_2_OVER_PI: f64 = 0.797_884_560_802_865_4;
/// 1/√(2π), the normal density's constant.
const INV_SQRT_2PI: f64 = 0.398_942_280_401_432_7;

/// GELU (tanh form) at `x` and its slope there.
#[inline(always)]
pub(super) fn gelu_tanh<A: Accum>(x: A) -> (A, A) {
    let (half, one) = (A::cast(0.5), A::ONE);
    let c = A::cast(SQRT_2_OVER_PI);
    let k = A::cast(0.044715);
    let t = (c * x * (one + k * x * x)).tanh();
    let slope = half * (one + t) + half * x * (one - t * t) * c * (one + A::cast(3.0) * k * x * x);
    (half * x * (one + t), slope)
}

/// GELU (erf form) at `x` and its slope there.
#[inline(always)]
pub(super) fn gelu_erf_at<A: Accum>(x: A) -> (A, A) {
    let half = A::cast(0.5);
    let cdf = half * (A::ONE + (x * A::cast(std::f64::consts::FRAC_1_SQRT_2)).erf());
    let pdf = A::cast(INV_SQRT_2PI) * (-half * x * x).exp();
    (x * cdf, cdf + x * pdf)
}

/// SiLU at `x` and its slope there.
#[inline(always)]
pub(super) fn silu_at<A: Accum>(x: A) -> (A, A) {
    let one = A::ONE;
    let s = one / (one + (-x).exp());
    (x * s, s * (one + x * (one - s)))
}

/// Squared ReLU at `x` and its slope there.
#[inline(always)]
pub(super) fn relu2_at<A: Accum>(x: A) -> (A, A) {
    let r = if x > A::ZERO { x } else { A::ZERO };
    (r * r, A::cast(2.0) * r)
}

/// `out[i] = f(x[i])` (with `grad`: `out[i] = grad[i] · slope`), in
/// parallel chunks. Generic over `f` so that each activation gets its own
/// loop, inlined and (for f32) vectorized.
#[inline(always)]
fn map_elements<T: Elem>(
    x: &[T],
    grad: Option<&[T]>,
    f: impl Fn(T::Acc) -> (T::Acc, T::Acc) + Sync,
) -> Vec<T> {
    let mut out = vec![T::from_acc(T::Acc::ZERO); x.len()];
    match grad {
        None => out
            .par_chunks_mut(CHUNK)
            .zip(x.par_chunks(CHUNK))
            .for_each(|(out, x)| {
                for (o, &x) in out.iter_mut().zip(x) {
                    *o = T::from_acc(f(x.acc()).0);
                }
            }),
        Some(grad) => out
            .par_chunks_mut(CHUNK)
            .zip(x.par_chunks(CHUNK).zip(grad.par_chunks(CHUNK)))
            .for_each(|(out, (x, g))| {
                for ((o, &x), &g) in out.iter_mut().zip(x).zip(g) {
                    *o = T::from_acc(g.acc() * f(x.acc()).1);
                }
            }),
    }
    out
}

/// `y[i] = f(x[i])` and `grad[i] *= slope` in one pass (the values of
/// [`map_elements`] without and with the gradient, bit for bit), in
/// parallel chunks.
#[inline(always)]
fn map_with_grad<T: Elem>(
    x: &[T],
    grad: &mut [T],
    f: impl Fn(T::Acc) -> (T::Acc, T::Acc) + Sync,
) -> Vec<T> {
    let mut y = vec![T::from_acc(T::Acc::ZERO); x.len()];
    y.par_chunks_mut(CHUNK)
        .zip(x.par_chunks(CHUNK).zip(grad.par_chunks_mut(CHUNK)))
        .for_each(|(y, (x, grad))| {
            for ((y, &x), g) in y.iter_mut().zip(x).zip(grad) {
                let (value, slope) = f(x.acc());
                *y = T::from_acc(value);
                *g = T::from_acc(g.acc() * slope);
            }
        });
    y
}

/// `pre[i] += bias[i % width]` and `y[i] = f(pre[i])` in one pass over
/// `[rows, width]` rows, in parallel chunks of whole rows. The sum is
/// rounded to `T` before the activation reads it, as a bias add followed by
/// the activation would round it.
#[inline(always)]
fn add_bias_and_map<T: Elem>(
    pre: &mut [T],
    bias: &[T],
    f: impl Fn(T::Acc) -> (T::Acc, T::Acc) + Sync,
) -> Vec<T> {
    let width = bias.len().max(1);
    let chunk = (CHUNK / width).max(1) * width;
    let mut y = vec![T::from_acc(T::Acc::ZERO); pre.len()];
    y.par_chunks_mut(chunk)
        .zip(pre.par_chunks_mut(chunk))
        .for_each(|(y, pre)| {
            for (y, pre) in y.chunks_exact_mut(width).zip(pre.chunks_exact_mut(width)) {
                for ((y, p), &b) in y.iter_mut().zip(pre.iter_mut()).zip(bias) {
                    let sum = T::from_acc(p.acc() + b.acc());
                    *p = sum;
                    *y = T::from_acc(f(sum.acc()).0);
                }
            }
        });
    y
}

impl Activation {
    /// The activation of `x` (or, with `grad`, its input gradient).
    fn map<T: Elem>(self, x: &[T], grad: Option<&[T]>) -> Vec<T> {
        match self {
            Activation::Gelu => map_elements(x, grad, gelu_tanh),
            Activation::GeluErf => map_elements(x, grad, gelu_erf_at),
            Activation::Silu => map_elements(x, grad, silu_at),
            Activation::Relu2 => map_elements(x, grad, relu2_at),
        }
    }

    /// The activation of `x`, and `grad` multiplied by its slope in place.
    fn map_with_grad<T: Elem>(self, x: &[T], grad: &mut [T]) -> Vec<T> {
        match self {
            Activation::Gelu => map_with_grad(x, grad, gelu_tanh),
            Activation::GeluErf => map_with_grad(x, grad, gelu_erf_at),
            Activation::Silu => map_with_grad(x, grad, silu_at),
            Activation::Relu2 => map_with_grad(x, grad, relu2_at),
        }
    }

    /// A Linear layer's epilogue on the CPU: `pre`, the `[rows, out]`
    /// product, gets `bias` added in place (it becomes the pre-activation
    /// the backward reads) and the activation of it is returned, in one
    /// pass over the rows.
    pub(crate) fn add_bias_and_apply<T: Elem>(self, pre: &mut [T], bias: Option<&[T]>) -> Vec<T> {
        let Some(bias) = bias else {
            return self.map(pre, None);
        };
        match self {
            Activation::Gelu => add_bias_and_map(pre, bias, gelu_tanh),
            Activation::GeluErf => add_bias_and_map(pre, bias, gelu_erf_at),
            Activation::Silu => add_bias_and_map(pre, bias, silu_at),
            Activation::Relu2 => add_bias_and_map(pre, bias, relu2_at),
        }
    }

    fn op_name(self) -> &'static str {
        match self {
            Activation::Gelu => "zero-gelu",
            Activation::GeluErf => "zero-gelu-erf",
            Activation::Silu => "zero-silu",
            Activation::Relu2 => "zero-relu2",
        }
    }

    pub(crate) fn apply(self, x: &Tensor) -> Result<Tensor> {
        x.contiguous()?.apply_op1(ActivationOp(self))
    }
}

/// GELU, tanh approximation, as `Tensor::gelu`, in one op: the forward
/// keeps only its input and the backward is one pass over it (Candle's
/// composed derivative keeps and computes a handful of full-size tensors).
/// 16-bit inputs compute in f32.
///
/// ```
/// # fn main() -> candle_core::Result<()> {
/// let x = candle_core::Tensor::new(&[-1f32, 0.0, 2.0], &candle_core::Device::Cpu)?;
/// let y = zero_candle::nn::ops::gelu(&x)?;
/// assert!((y.to_vec1::<f32>()?[2] - 1.9546).abs() < 1e-4);
/// # Ok(()) }
/// ```
pub fn gelu(x: &Tensor) -> Result<Tensor> {
    Activation::Gelu.apply(x)
}

/// GELU, exact (erf) form, as `Tensor::gelu_erf`, in one op (see [`gelu`]).
pub fn gelu_erf(x: &Tensor) -> Result<Tensor> {
    Activation::GeluErf.apply(x)
}

/// SiLU (swish), as `Tensor::silu`, in one op (see [`gelu`]).
pub fn silu(x: &Tensor) -> Result<Tensor> {
    Activation::Silu.apply(x)
}

/// Squared ReLU, `max(x, 0)²` (`transformers`' `relu2`), in one op (see
/// [`gelu`]).
///
/// ```
/// # fn main() -> candle_core::Result<()> {
/// let x = candle_core::Tensor::new(&[-1f32, 0.5, 3.0], &candle_core::Device::Cpu)?;
/// let y = zero_candle::nn::ops::relu2(&x)?;
/// assert_eq!(y.to_vec1::<f32>()?, [0.0, 0.25, 9.0]);
/// # Ok(()) }
/// ```
pub fn relu2(x: &Tensor) -> Result<Tensor> {
    Activation::Relu2.apply(x)
}

struct ActivationOp(Activation);

/// Elements per parallel chunk: large enough that splitting pays.
const CHUNK: usize = 1 << 14;

impl CustomOp1 for ActivationOp {
    fn name(&self) -> &'static str {
        self.0.op_name()
    }

    fn cpu_fwd(&self, storage: &CpuStorage, layout: &Layout) -> Result<(CpuStorage, Shape)> {
        let kind = self.0;
        let y = dispatch_float!(storage.dtype(), kind.op_name(), |T| {
            let x = cpu::slice::<T>(storage, layout, "the activation's input")?;
            T::to_cpu_storage_owned(kind.map(x, None))
        });
        Ok((y, layout.shape().clone()))
    }

    fn cuda_fwd(&self, storage: &CudaStorage, layout: &Layout) -> Result<(CudaStorage, Shape)> {
        let y = cuda::activation_forward(self.0, (storage, layout))?;
        Ok((y, layout.shape().clone()))
    }

    fn bwd(&self, x: &Tensor, _y: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        Ok(Some(input_grad(self.0, x, grad)?))
    }
}

/// `grad ⊙ act'(x)`, the gradient of the activation's input `x` (any
/// contiguous tensor) given its output's: one pass, on the CPU or CUDA.
pub(crate) fn input_grad(kind: Activation, x: &Tensor, grad: &Tensor) -> Result<Tensor> {
    let grad = grad.contiguous()?;
    let shape = x.shape().clone();
    if x.device().is_cuda() {
        let dx = with_cuda(x, "the activation's input", |x_storage, x_layout| {
            with_cuda(
                &grad,
                "the activation's output gradient",
                |g_storage, g_layout| {
                    cuda::activation_backward(kind, (x_storage, x_layout), (g_storage, g_layout))
                },
            )
        })?;
        return Ok(tensor_from(Storage::Cuda(dx), shape));
    }
    let dx = cpu::with_cpu(x, "the activation's input", |x_storage, x_layout| {
        cpu::with_cpu(
            &grad,
            "the activation's output gradient",
            |g_storage, g_layout| {
                Ok(dispatch_float!(x_storage.dtype(), kind.op_name(), |T| {
                    let x = cpu::slice::<T>(x_storage, x_layout, "the activation's input")?;
                    let g = cpu::slice::<T>(g_storage, g_layout, "the output gradient")?;
                    T::to_cpu_storage_owned(kind.map(x, Some(g)))
                }))
            },
        )
    })?;
    Ok(tensor_from(Storage::Cpu(dx), shape))
}

/// `act(x)` and the gradient of `x` given that of `act(x)`, `grad`, in one
/// pass over `x` (one evaluation of the activation's transcendental per
/// element): the backward of a layer that applies `kind` to its input and
/// kept `x` alone, which needs `act(x)` again for its weight's gradient.
/// The values are those of `kind`'s forward and [`input_grad`], bit for
/// bit. `grad` becomes `x`'s gradient in place: its storage must be the
/// caller's alone (a product just computed).
pub(crate) fn recompute_with_input_grad(
    kind: Activation,
    x: &Tensor,
    grad: Tensor,
) -> Result<(Tensor, Tensor)> {
    let x = x.contiguous()?;
    if grad.shape() != x.shape() || grad.dtype() != x.dtype() {
        bail!(
            "zero-candle {}: the gradient is {:?} {:?}, the input {:?} {:?}",
            kind.op_name(),
            grad.dtype(),
            grad.shape(),
            x.dtype(),
            x.shape()
        )
    }
    let grad = grad.contiguous()?;
    let op = RecomputeWithGrad {
        kind,
        activated: Mutex::new(None),
    };
    grad.inplace_op2(&x, &op)?;
    let activated = op
        .activated
        .into_inner()
        .unwrap_or_else(PoisonError::into_inner);
    match activated {
        Some(values) => Ok((tensor_from(values, x.shape().clone()), grad)),
        None => bail!(
            "zero-candle {}: the recompute produced no values",
            kind.op_name()
        ),
    }
}

/// [`recompute_with_input_grad`]'s op, in place on the gradient; the
/// activation's values come out through `activated`.
struct RecomputeWithGrad {
    kind: Activation,
    activated: Mutex<Option<Storage>>,
}

impl RecomputeWithGrad {
    fn keep(&self, values: Storage) {
        *self
            .activated
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = Some(values);
    }
}

/// `grad`'s elements of a contiguous `layout` and the same number of `x`'s,
/// as `T`.
fn grad_and_input<'a, T: Elem>(
    grad: &'a mut [T],
    grad_layout: &Layout,
    x: &'a CpuStorage,
    x_layout: &Layout,
) -> Result<(&'a mut [T], &'a [T])> {
    let x = cpu::slice::<T>(x, x_layout, "the activation's input")?;
    let Some((start, end)) = grad_layout.contiguous_offsets() else {
        bail!("zero-candle: the activation's gradient must be contiguous here")
    };
    if end - start != x.len() {
        bail!(
            "zero-candle: the activation's gradient has {} elements, its input {}",
            end - start,
            x.len()
        )
    }
    Ok((&mut grad[start..end], x))
}

impl InplaceOp2 for RecomputeWithGrad {
    fn name(&self) -> &'static str {
        "zero-activation-recompute-backward"
    }

    fn cpu_fwd(
        &self,
        grad: &mut CpuStorage,
        grad_layout: &Layout,
        x: &CpuStorage,
        x_layout: &Layout,
    ) -> Result<()> {
        let kind = self.kind;
        let values = match grad {
            CpuStorage::F32(g) => {
                let (g, x) = grad_and_input::<f32>(g, grad_layout, x, x_layout)?;
                CpuStorage::F32(kind.map_with_grad(x, g))
            }
            CpuStorage::F64(g) => {
                let (g, x) = grad_and_input::<f64>(g, grad_layout, x, x_layout)?;
                CpuStorage::F64(kind.map_with_grad(x, g))
            }
            CpuStorage::BF16(g) => {
                let (g, x) = grad_and_input::<half::bf16>(g, grad_layout, x, x_layout)?;
                CpuStorage::BF16(kind.map_with_grad(x, g))
            }
            CpuStorage::F16(g) => {
                let (g, x) = grad_and_input::<half::f16>(g, grad_layout, x, x_layout)?;
                CpuStorage::F16(kind.map_with_grad(x, g))
            }
            other => bail!(
                "zero-candle {}: {:?} is not a float dtype",
                kind.op_name(),
                other.dtype()
            ),
        };
        self.keep(Storage::Cpu(values));
        Ok(())
    }

    fn cuda_fwd(
        &self,
        grad: &mut CudaStorage,
        grad_layout: &Layout,
        x: &CudaStorage,
        x_layout: &Layout,
    ) -> Result<()> {
        let values =
            cuda::activation_recompute_backward(self.kind, (x, x_layout), (grad, grad_layout))?;
        self.keep(Storage::Cuda(values));
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device};

    #[test]
    fn the_recompute_gives_the_forward_and_input_gradient_writing_the_gradient_in_place() {
        for kind in [
            Activation::Gelu,
            Activation::GeluErf,
            Activation::Silu,
            Activation::Relu2,
        ] {
            for dtype in [DType::F32, DType::F64, DType::BF16, DType::F16] {
                let x = Tensor::randn(0f32, 3.0, (5, 37), &Device::Cpu).unwrap();
                let x = x.to_dtype(dtype).unwrap();
                let grad = Tensor::randn(0f32, 1.0, (5, 37), &Device::Cpu).unwrap();
                let grad = grad.to_dtype(dtype).unwrap();
                let want_y = kind.apply(&x).unwrap();
                let want_dx = input_grad(kind, &x, &grad).unwrap();
                // A second handle on the gradient's storage sees ∂x: in place.
                let same_storage = grad.clone();
                let (y, dx) = recompute_with_input_grad(kind, &x, grad).unwrap();
                let bits = |t: &Tensor| {
                    let t = t.to_dtype(DType::F64).unwrap().flatten_all().unwrap();
                    let values = t.to_vec1::<f64>().unwrap();
                    values.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
                };
                assert_eq!(bits(&y), bits(&want_y), "{kind:?} {dtype:?}: act(x)");
                assert_eq!(bits(&dx), bits(&want_dx), "{kind:?} {dtype:?}: ∂x");
                assert_eq!(
                    bits(&same_storage),
                    bits(&want_dx),
                    "{kind:?} {dtype:?}: in place"
                );
            }
        }
    }

    #[test]
    fn a_gradient_of_another_shape_is_refused() {
        let x = Tensor::zeros((4, 3), DType::F32, &Device::Cpu).unwrap();
        let grad = Tensor::zeros((3, 4), DType::F32, &Device::Cpu).unwrap();
        let err = recompute_with_input_grad(Activation::Gelu, &x, grad).unwrap_err();
        assert!(err.to_string().contains("the gradient is"), "{err}");
    }
}
