//! The gate of a gated MLP, `act(gate) * up`, as one op whose backward
//! gives both gradients in one pass: SwiGLU (`silu`, Llama's) and GeGLU
//! (tanh-form `gelu`, Gemma's).

use super::super::cpu;
use super::super::elem::{dispatch_float, Accum, Elem};
use super::super::storage::{tensor_from, with_cuda};
use super::activation::{gelu_erf_at, gelu_tanh, relu2_at, silu_at};
use super::activation_kind::Activation;
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
    Gated(Activation::Silu).apply(gate, up)
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
    Gated(Activation::Gelu).apply(gate, up)
}

/// The op `(gate, up) -> act(gate) * up` for its activation.
struct Gated(Activation);

impl Gated {
    /// The op's name in errors.
    fn what(&self) -> &'static str {
        match self.0 {
            Activation::Silu => "swiglu",
            Activation::Gelu => "geglu",
            Activation::GeluErf => "geglu (erf)",
            Activation::Relu2 => "relu2-gated",
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
        gate.contiguous()?.apply_op2(&up.contiguous()?, self)
    }

    /// `act(gate) * up` on the CPU, each activation its own loop.
    fn forward<T: Elem>(&self, gate: &[T], up: &[T]) -> Vec<T> {
        match self.0 {
            Activation::Gelu => forward(gate, up, gelu_tanh),
            Activation::GeluErf => forward(gate, up, gelu_erf_at),
            Activation::Silu => forward(gate, up, silu_at),
            Activation::Relu2 => forward(gate, up, relu2_at),
        }
    }

    /// `(dgate, dup)` on the CPU, each activation its own loop.
    fn backward<T: Elem>(&self, gate: &[T], up: &[T], grad: &[T]) -> (Vec<T>, Vec<T>) {
        match self.0 {
            Activation::Gelu => backward(gate, up, grad, gelu_tanh),
            Activation::GeluErf => backward(gate, up, grad, gelu_erf_at),
            Activation::Silu => backward(gate, up, grad, silu_at),
            Activation::Relu2 => backward(gate, up, grad, relu2_at),
        }
    }
}

/// `act(gate) * up`, in parallel chunks, `act` giving `(value, slope)`.
/// Generic over `act` so that each activation gets its own loop, inlined.
#[inline(always)]
fn forward<T: Elem>(
    gate: &[T],
    up: &[T],
    act: impl Fn(T::Acc) -> (T::Acc, T::Acc) + Sync,
) -> Vec<T> {
    let mut out = vec![T::from_acc(T::Acc::ZERO); gate.len()];
    out.par_chunks_mut(CHUNK)
        .zip(gate.par_chunks(CHUNK).zip(up.par_chunks(CHUNK)))
        .for_each(|(out, (gate, up))| {
            for ((o, &g), &u) in out.iter_mut().zip(gate).zip(up) {
                *o = T::from_acc(act(g.acc()).0 * u.acc());
            }
        });
    out
}

/// `(dgate, dup)` for the output gradient `grad`, in parallel chunks.
#[inline(always)]
fn backward<T: Elem>(
    gate: &[T],
    up: &[T],
    grad: &[T],
    act: impl Fn(T::Acc) -> (T::Acc, T::Acc) + Sync,
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
                let (value, slope) = act(g.acc());
                let dy = dy.acc();
                *dg = T::from_acc(dy * u.acc() * slope);
                *du = T::from_acc(dy * value);
            }
        });
    (dgate, dup)
}

impl CustomOp2 for Gated {
    fn name(&self) -> &'static str {
        match self.0 {
            Activation::Silu => "zero-swiglu",
            Activation::Gelu => "zero-geglu",
            Activation::GeluErf => "zero-geglu-erf",
            Activation::Relu2 => "zero-relu2-gated",
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
        let y = cuda::gated_forward(self.0, (gate, gate_layout), (up, up_layout))?;
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
        let (dgate, dup) = if gate.device().is_cuda() {
            let (dgate, dup) = with_cuda(gate, "the gate", |gs, gl| {
                with_cuda(up, "up", |us, ul| {
                    with_cuda(&grad, "the output gradient", |ds, dl| {
                        cuda::gated_backward(self.0, (gs, gl), (us, ul), (ds, dl))
                    })
                })
            })?;
            (Storage::Cuda(dgate), Storage::Cuda(dup))
        } else {
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
        };
        Ok((tensor_from(dgate, shape.clone()), tensor_from(dup, shape)))
    }
}

/// `act(gate) * up` (`kind`: SwiGLU's SiLU, GeGLU's GELUs), as [`swiglu`].
pub(crate) fn gated(kind: Activation, gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    Gated(kind).apply(gate, up)
}

/// [`gated`]'s gradients `(dgate, dup)` for its output's `grad`; `gate`
/// and `up` contiguous.
pub(crate) fn gated_grads(
    kind: Activation,
    gate: &Tensor,
    up: &Tensor,
    grad: &Tensor,
) -> Result<(Tensor, Tensor)> {
    Gated(kind).grads(gate, up, grad)
}

/// [`gated`] over CPU slices.
pub(crate) fn gated_cpu<T: Elem>(kind: Activation, gate: &[T], up: &[T]) -> Vec<T> {
    Gated(kind).forward(gate, up)
}

/// [`gated_grads`] over CPU slices.
pub(crate) fn gated_grads_cpu<T: Elem>(
    kind: Activation,
    gate: &[T],
    up: &[T],
    grad: &[T],
) -> (Vec<T>, Vec<T>) {
    Gated(kind).backward(gate, up, grad)
}
