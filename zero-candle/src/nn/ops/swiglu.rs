//! SwiGLU's gate, `silu(gate) * up`, as one op whose backward gives both
//! gradients in one pass.

use super::super::cpu;
use super::super::elem::{dispatch_float, Accum, Elem};
use super::super::storage::{tensor_from, with_cuda};
use super::activation::silu_at;
use super::cuda;
use candle_core::backend::BackendStorage;
use candle_core::{
    bail, CpuStorage, CudaStorage, CustomOp2, Layout, Result, Shape, Storage, Tensor, WithDType,
};
use rayon::prelude::*;

const OP: &str = "swiglu";

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
    if gate.dims() != up.dims() {
        bail!(
            "zero-candle {OP}: gate has shape {:?} but up has {:?}; pass the two projections \
             of the same input",
            gate.dims(),
            up.dims()
        )
    }
    if gate.dtype() != up.dtype() {
        bail!(
            "zero-candle {OP}: gate is {:?} but up is {:?}; convert one with .to_dtype()",
            gate.dtype(),
            up.dtype()
        )
    }
    gate.contiguous()?.apply_op2(&up.contiguous()?, SwiGlu)
}

struct SwiGlu;

/// `silu(gate) * up`, in parallel chunks.
fn forward<T: Elem>(gate: &[T], up: &[T]) -> Vec<T> {
    let mut out = vec![T::from_acc(T::Acc::ZERO); gate.len()];
    out.par_chunks_mut(CHUNK)
        .zip(gate.par_chunks(CHUNK).zip(up.par_chunks(CHUNK)))
        .for_each(|(out, (gate, up))| {
            for ((o, &g), &u) in out.iter_mut().zip(gate).zip(up) {
                *o = T::from_acc(silu_at(g.acc()).0 * u.acc());
            }
        });
    out
}

/// `(dgate, dup)` for the output gradient `grad`, in parallel chunks.
fn backward<T: Elem>(gate: &[T], up: &[T], grad: &[T]) -> (Vec<T>, Vec<T>) {
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
                let (silu, slope) = silu_at(g.acc());
                let dy = dy.acc();
                *dg = T::from_acc(dy * u.acc() * slope);
                *du = T::from_acc(dy * silu);
            }
        });
    (dgate, dup)
}

impl CustomOp2 for SwiGlu {
    fn name(&self) -> &'static str {
        "zero-swiglu"
    }

    fn cpu_fwd(
        &self,
        gate: &CpuStorage,
        gate_layout: &Layout,
        up: &CpuStorage,
        up_layout: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let y = dispatch_float!(gate.dtype(), OP, |T| {
            let gate = cpu::slice::<T>(gate, gate_layout, "the gate")?;
            let up = cpu::slice::<T>(up, up_layout, "up")?;
            T::to_cpu_storage_owned(forward(gate, up))
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
        let y = cuda::swiglu_forward((gate, gate_layout), (up, up_layout))?;
        Ok((y, gate_layout.shape().clone()))
    }

    fn bwd(
        &self,
        gate: &Tensor,
        up: &Tensor,
        _y: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let grad = grad.contiguous()?;
        let shape = gate.shape().clone();
        let (dgate, dup) = if gate.device().is_cuda() {
            let (dgate, dup) = with_cuda(gate, "the gate", |gs, gl| {
                with_cuda(up, "up", |us, ul| {
                    with_cuda(&grad, "the output gradient", |ds, dl| {
                        cuda::swiglu_backward((gs, gl), (us, ul), (ds, dl))
                    })
                })
            })?;
            (Storage::Cuda(dgate), Storage::Cuda(dup))
        } else {
            let (dgate, dup) = cpu::with_cpu(gate, "the gate", |gs, gl| {
                cpu::with_cpu(up, "up", |us, ul| {
                    cpu::with_cpu(&grad, "the output gradient", |ds, dl| {
                        Ok(dispatch_float!(gs.dtype(), OP, |T| {
                            let (dgate, dup) = backward::<T>(
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
        Ok((
            Some(tensor_from(dgate, shape.clone())),
            Some(tensor_from(dup, shape)),
        ))
    }
}
