//! The gate of a gated MLP, `act(gate) * up`, as one op whose backward
//! gives both gradients in one pass: SwiGLU (`silu`, Llama's), GeGLU
//! (tanh-form `gelu`, Gemma's) and gpt-oss's clamped SwiGLU
//! ([`super::clamped_swiglu`]); [`Gating`] names the unit.

use super::super::cpu;
use super::super::elem::{dispatch_float, Accum, Elem};
use super::super::storage::{tensor_from, with_cuda};
use super::activation::{gelu_erf_at, gelu_tanh, relu2_at, silu_at};
use super::activation_kind::Activation;
use super::clamped::Clamped;
use super::cuda;
use candle_core::backend::BackendStorage;
use candle_core::{
    bail, CpuStorage, CudaStorage, CustomOp2, Layout, Result, Shape, Storage, Tensor, WithDType,
};
use rayon::prelude::*;

/// Elements per parallel chunk: large enough that splitting pays.
const CHUNK: usize = 1 << 14;

/// `silu(gate) * up`, element-wise, the gated unit of a SwiGLU MLP
/// (Llama's `act_fn(gate_proj(x)) * up_proj(x)`), as one op: the forward
/// keeps only its two inputs (the composition also keeps `silu(gate)`),
/// and the backward computes both gradients, `grad * up * silu'(gate)` and
/// `grad * silu(gate)`, in one pass. `gate` and `up` have the same shape
/// and dtype; 16-bit inputs compute in f32 and round once.
///
/// ```
/// use candle_core::{Device, Tensor};
/// # fn main() -> candle_core::Result<()> {
/// let gate = Tensor::new(&[-1f32, 0.0, 2.0], &Device::Cpu)?;
/// let up = Tensor::new(&[3f32, 5.0, 0.5], &Device::Cpu)?;
/// let y = zero_candle::nn::ops::swiglu(&gate, &up)?.to_vec1::<f32>()?;
/// assert!((y[2] - 0.5 * 2.0 / (1.0 + (-2f32).exp())).abs() < 1e-6);
/// # Ok(()) }
/// ```
pub fn swiglu(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    Gating::Act(Activation::Silu).forward(gate, up)
}

/// `gelu(gate) * up` with GELU's tanh form (`Tensor::gelu`), element-wise,
/// the gated unit of a GeGLU MLP: Gemma's `act_fn(gate_proj(x)) *
/// up_proj(x)` with transformers' `gelu_pytorch_tanh`. One op, as
/// [`swiglu`]: the backward computes `grad * up * gelu'(gate)` and
/// `grad * gelu(gate)` in one pass. `gate` and `up` have the same shape and
/// dtype; 16-bit inputs compute in f32 and round once.
///
/// ```
/// use candle_core::{Device, Tensor};
/// # fn main() -> candle_core::Result<()> {
/// let gate = Tensor::new(&[-1f32, 0.0, 2.0], &Device::Cpu)?;
/// let up = Tensor::new(&[3f32, 5.0, 0.5], &Device::Cpu)?;
/// let y = zero_candle::nn::ops::geglu(&gate, &up)?.to_vec1::<f32>()?;
/// assert!((y[2] - 0.5 * 1.9546).abs() < 1e-4);
/// # Ok(()) }
/// ```
pub fn geglu(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    Gating::Act(Activation::Gelu).forward(gate, up)
}

/// gpt-oss's gated unit, `(clamp(up, -limit, limit) + 1) · g · σ(alpha ·
/// g)` with `g = min(gate, limit)`, element-wise (`transformers`'
/// `GptOssExperts._apply_gate`). On the CPU one op that keeps only its
/// inputs and whose backward is one pass; 16-bit inputs compute in f32 and
/// round once. A value at a bound passes its whole gradient, as torch's
/// `clamp` does. Elsewhere Candle's ops compose it in the inputs' dtype
/// (their `minimum` and `clamp` pass half the gradient at a bound).
///
/// ```
/// use candle_core::{Device, Tensor};
/// # fn main() -> candle_core::Result<()> {
/// let gate = Tensor::new(&[-1f32, 9.0], &Device::Cpu)?;
/// let up = Tensor::new(&[0.5f32, -8.0], &Device::Cpu)?;
/// let y = zero_candle::nn::ops::clamped_swiglu(&gate, &up, 1.702, 7.0)?.to_vec1::<f32>()?;
/// let unit = |g: f32| g / (1.0 + (-1.702 * g).exp());
/// assert!((y[0] - 1.5 * unit(-1.0)).abs() < 1e-6);
/// assert!((y[1] - -6.0 * unit(7.0)).abs() < 1e-5);
/// # Ok(()) }
/// ```
pub fn clamped_swiglu(gate: &Tensor, up: &Tensor, alpha: f64, limit: f64) -> Result<Tensor> {
    Gating::Clamped { alpha, limit }.forward(gate, up)
}

/// The gated unit of an MLP: `act(gate) · up`, or gpt-oss's clamped one.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum Gating {
    Act(Activation),
    Clamped { alpha: f64, limit: f64 },
}

impl Gating {
    /// The unit of `gate` and `up` (of one shape and dtype), one op with its
    /// backward (the clamped unit off the CPU: Candle's ops).
    pub(crate) fn forward(self, gate: &Tensor, up: &Tensor) -> Result<Tensor> {
        Gated(self).apply(gate, up)
    }

    /// `(dgate, dup)` for the output gradient `grad`; `gate` and `up`
    /// contiguous.
    pub(crate) fn grads(
        self,
        gate: &Tensor,
        up: &Tensor,
        grad: &Tensor,
    ) -> Result<(Tensor, Tensor)> {
        Gated(self).grads(gate, up, grad)
    }

    /// The unit over CPU slices.
    pub(crate) fn cpu<T: Elem>(self, gate: &[T], up: &[T]) -> Vec<T> {
        Gated(self).forward(gate, up)
    }

    /// `(dgate, dup)` over CPU slices for the output gradient `grad`.
    pub(crate) fn grads_cpu<T: Elem>(self, gate: &[T], up: &[T], grad: &[T]) -> (Vec<T>, Vec<T>) {
        Gated(self).backward(gate, up, grad)
    }
}

/// The op `(gate, up) -> unit(gate, up)`.
struct Gated(Gating);

/// An activation's gradients of `act(g) · u`: `act` its `(value, slope)`
/// at `g`.
#[inline(always)]
fn act_grads<A: Accum>((value, slope): (A, A), u: A, dy: A) -> (A, A) {
    (dy * u * slope, dy * value)
}

impl Gated {
    /// The op's name in errors.
    fn what(&self) -> &'static str {
        match self.0 {
            Gating::Act(Activation::Silu) => "swiglu",
            Gating::Act(Activation::Gelu) => "geglu",
            Gating::Act(Activation::GeluErf) => "geglu (erf)",
            Gating::Act(Activation::Relu2) => "relu2-gated",
            Gating::Clamped { .. } => "clamped swiglu",
        }
    }

    fn apply(self, gate: &Tensor, up: &Tensor) -> Result<Tensor> {
        let what = self.what();
        if gate.dims() != up.dims() {
            bail!(
                "zero-candle {what}: gate has shape {:?} but up has {:?}; pass the two \
                 projections of the same input",
                gate.dims(),
                up.dims()
            )
        }
        if gate.dtype() != up.dtype() {
            bail!(
                "zero-candle {what}: gate is {:?} but up is {:?}; convert one with .to_dtype()",
                gate.dtype(),
                up.dtype()
            )
        }
        match self.0 {
            // No kernel of its own off the CPU.
            Gating::Clamped { alpha, limit } if !gate.device().is_cpu() => {
                Clamped { alpha, limit }.composed(gate, up)
            }
            _ => gate.contiguous()?.apply_op2(&up.contiguous()?, self),
        }
    }

    /// The unit on the CPU, each its own loop.
    fn forward<T: Elem>(&self, gate: &[T], up: &[T]) -> Vec<T> {
        match self.0 {
            Gating::Act(Activation::Gelu) => forward(gate, up, |g, u| gelu_tanh(g).0 * u),
            Gating::Act(Activation::GeluErf) => forward(gate, up, |g, u| gelu_erf_at(g).0 * u),
            Gating::Act(Activation::Silu) => forward(gate, up, |g, u| silu_at(g).0 * u),
            Gating::Act(Activation::Relu2) => forward(gate, up, |g, u| relu2_at(g).0 * u),
            Gating::Clamped { alpha, limit } => {
                let unit = Clamped { alpha, limit };
                forward(gate, up, |g, u| unit.at(g, u).0)
            }
        }
    }

    /// `(dgate, dup)` on the CPU, each unit its own loop.
    fn backward<T: Elem>(&self, gate: &[T], up: &[T], grad: &[T]) -> (Vec<T>, Vec<T>) {
        match self.0 {
            Gating::Act(Activation::Gelu) => {
                backward(gate, up, grad, |g, u, dy| act_grads(gelu_tanh(g), u, dy))
            }
            Gating::Act(Activation::GeluErf) => {
                backward(gate, up, grad, |g, u, dy| act_grads(gelu_erf_at(g), u, dy))
            }
            Gating::Act(Activation::Silu) => {
                backward(gate, up, grad, |g, u, dy| act_grads(silu_at(g), u, dy))
            }
            Gating::Act(Activation::Relu2) => {
                backward(gate, up, grad, |g, u, dy| act_grads(relu2_at(g), u, dy))
            }
            Gating::Clamped { alpha, limit } => {
                let unit = Clamped { alpha, limit };
                backward(gate, up, grad, |g, u, dy| {
                    let (_, slope_gate, slope_up) = unit.at(g, u);
                    (dy * slope_gate, dy * slope_up)
                })
            }
        }
    }
}

/// `unit(gate, up)`, in parallel chunks. Generic over `unit` so that each
/// gets its own loop, inlined.
#[inline(always)]
fn forward<T: Elem>(
    gate: &[T],
    up: &[T],
    unit: impl Fn(T::Acc, T::Acc) -> T::Acc + Sync,
) -> Vec<T> {
    let mut out = vec![T::from_acc(T::Acc::ZERO); gate.len()];
    out.par_chunks_mut(CHUNK)
        .zip(gate.par_chunks(CHUNK).zip(up.par_chunks(CHUNK)))
        .for_each(|(out, (gate, up))| {
            for ((o, &g), &u) in out.iter_mut().zip(gate).zip(up) {
                *o = T::from_acc(unit(g.acc(), u.acc()));
            }
        });
    out
}

/// `(dgate, dup)` for the output gradient `grad`, in parallel chunks,
/// `grads(gate, up, dy)` giving both at one element.
#[inline(always)]
fn backward<T: Elem>(
    gate: &[T],
    up: &[T],
    grad: &[T],
    grads: impl Fn(T::Acc, T::Acc, T::Acc) -> (T::Acc, T::Acc) + Sync,
) -> (Vec<T>, Vec<T>) {
    let zero = T::from_acc(T::Acc::ZERO);
    let (mut dgate, mut dup) = (vec![zero; gate.len()], vec![zero; gate.len()]);
    dgate
        .par_chunks_mut(CHUNK)
        .zip(dup.par_chunks_mut(CHUNK))
        .zip(gate.par_chunks(CHUNK))
        .zip(up.par_chunks(CHUNK).zip(grad.par_chunks(CHUNK)))
        .for_each(|(((dgate, dup), gate), (up, grad))| {
            let outs = dgate.iter_mut().zip(dup.iter_mut());
            let ins = gate.iter().zip(up).zip(grad);
            for ((dg, du), ((&g, &u), &dy)) in outs.zip(ins) {
                let (d_gate, d_up) = grads(g.acc(), u.acc(), dy.acc());
                *dg = T::from_acc(d_gate);
                *du = T::from_acc(d_up);
            }
        });
    (dgate, dup)
}

impl CustomOp2 for Gated {
    fn name(&self) -> &'static str {
        match self.0 {
            Gating::Act(Activation::Silu) => "zero-swiglu",
            Gating::Act(Activation::Gelu) => "zero-geglu",
            Gating::Act(Activation::GeluErf) => "zero-geglu-erf",
            Gating::Act(Activation::Relu2) => "zero-relu2-gated",
            Gating::Clamped { .. } => "zero-clamped-swiglu",
        }
    }

    fn cpu_fwd(
        &self,
        gate: &CpuStorage,
        gate_layout: &Layout,
        up: &CpuStorage,
        up_layout: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let y = dispatch_float!(gate.dtype(), self.what(), |T| {
            let gate = cpu::slice::<T>(gate, gate_layout, "the gate")?;
            let up = cpu::slice::<T>(up, up_layout, "up")?;
            T::to_cpu_storage_owned(self.forward(gate, up))
        });
        Ok((y, gate_layout.shape().clone()))
    }

    fn cuda_fwd(
        &self,
        gate: &CudaStorage,
        gate_layout: &Layout,
        up: &CudaStorage,
        up_layout: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        let Gating::Act(kind) = self.0 else {
            bail!(
                "zero-candle {}: internal: no CUDA kernel (Candle's ops compose it)",
                self.what()
            )
        };
        let y = cuda::gated_forward(kind, (gate, gate_layout), (up, up_layout))?;
        Ok((y, gate_layout.shape().clone()))
    }

    fn bwd(
        &self,
        gate: &Tensor,
        up: &Tensor,
        _y: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let (dgate, dup) = self.grads(gate, up, grad)?;
        Ok((Some(dgate), Some(dup)))
    }
}

impl Gated {
    /// `(dgate, dup)` for the output gradient `grad`.
    fn grads(&self, gate: &Tensor, up: &Tensor, grad: &Tensor) -> Result<(Tensor, Tensor)> {
        let grad = grad.contiguous()?;
        let shape = gate.shape().clone();
        let (dgate, dup) = match self.0 {
            Gating::Clamped { alpha, limit } if !gate.device().is_cpu() => {
                return Clamped { alpha, limit }.composed_grads(gate, up, &grad);
            }
            Gating::Act(kind) if gate.device().is_cuda() => {
                let (dgate, dup) = with_cuda(gate, "the gate", |gs, gl| {
                    with_cuda(up, "up", |us, ul| {
                        with_cuda(&grad, "the output gradient", |ds, dl| {
                            cuda::gated_backward(kind, (gs, gl), (us, ul), (ds, dl))
                        })
                    })
                })?;
                (Storage::Cuda(dgate), Storage::Cuda(dup))
            }
            _ => {
                let (dgate, dup) = cpu::with_cpu(gate, "the gate", |gs, gl| {
                    cpu::with_cpu(up, "up", |us, ul| {
                        cpu::with_cpu(&grad, "the output gradient", |ds, dl| {
                            Ok(dispatch_float!(gs.dtype(), self.what(), |T| {
                                let (dgate, dup) = self.backward::<T>(
                                    cpu::slice::<T>(gs, gl, "the gate")?,
                                    cpu::slice::<T>(us, ul, "up")?,
                                    cpu::slice::<T>(ds, dl, "the output gradient")?,
                                );
                                (T::to_cpu_storage_owned(dgate), T::to_cpu_storage_owned(dup))
                            }))
                        })
                    })
                })?;
                (Storage::Cpu(dgate), Storage::Cpu(dup))
            }
        };
        Ok((tensor_from(dgate, shape.clone()), tensor_from(dup, shape)))
    }
}
