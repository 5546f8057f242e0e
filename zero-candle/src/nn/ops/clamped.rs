//! gpt-oss's clamped SwiGLU as one op, and [`Gating`], the gated unit a
//! mixture's experts apply (an activation's, or the clamped one).

use super::super::cpu;
use super::super::elem::{dispatch_float, Accum, Elem};
use super::super::storage::tensor_from;
use super::activation_kind::Activation;
use super::swiglu::{gated, gated_cpu, gated_grads, gated_grads_cpu};
use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, CustomOp2, Layout, Result, Shape, Storage, Tensor, WithDType};
use rayon::prelude::*;

/// Elements per parallel chunk: large enough that splitting pays.
const CHUNK: usize = 1 << 14;

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
    let op = Clamped { alpha, limit };
    if gate.dims() != up.dims() || gate.dtype() != up.dtype() {
        bail!(
            "zero-candle clamped swiglu: gate is {:?} {:?} but up is {:?} {:?}; pass the two \
             projections of the same input",
            gate.dtype(),
            gate.dims(),
            up.dtype(),
            up.dims()
        )
    }
    match gate.device().is_cpu() {
        true => gate.contiguous()?.apply_op2(&up.contiguous()?, op),
        false => op.composed(gate, up),
    }
}

/// The clamped unit's constants.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Clamped {
    alpha: f64,
    limit: f64,
}

impl Clamped {
    /// The unit of Candle's ops.
    fn composed(&self, gate: &Tensor, up: &Tensor) -> Result<Tensor> {
        let gate = gate.minimum(self.limit)?;
        let up = up.clamp(-self.limit, self.limit)?;
        let opened = candle_nn::ops::sigmoid(&gate.affine(self.alpha, 0.0)?)?;
        (up + 1.0)? * (gate * opened)?
    }

    /// `(dgate, dup)` for the output gradient `grad`, of Candle's ops in
    /// the inputs' dtype; a bound passes the whole gradient.
    fn composed_grads(
        &self,
        gate: &Tensor,
        up: &Tensor,
        grad: &Tensor,
    ) -> Result<(Tensor, Tensor)> {
        let g = gate.minimum(self.limit)?;
        let s = candle_nn::ops::sigmoid(&g.affine(self.alpha, 0.0)?)?;
        let unit = (&g * &s)?;
        let shifted = (up.clamp(-self.limit, self.limit)? + 1.0)?;
        // σ(αg) + αg·σ(αg)·(1 - σ(αg)): the slope of g·σ(αg).
        let slope = (&s * ((&g * s.affine(-1.0, 1.0)?)?.affine(self.alpha, 1.0))?)?;
        let zeros = grad.zeros_like()?;
        let dgate = gate
            .le(self.limit)?
            .where_cond(&((grad * shifted)? * slope)?, &zeros)?;
        let dup = up
            .abs()?
            .le(self.limit)?
            .where_cond(&(grad * unit)?, &zeros)?;
        Ok((dgate, dup))
    }

    /// The unit and its slopes at one element: `(value, ∂gate, ∂up)`.
    #[inline(always)]
    fn at<A: Accum>(&self, gate: A, up: A) -> (A, A, A) {
        let (one, limit, alpha) = (A::ONE, A::cast(self.limit), A::cast(self.alpha));
        let g = if gate > limit { limit } else { gate };
        let u = if up > limit {
            limit
        } else if up < -limit {
            -limit
        } else {
            up
        };
        let s = one / (one + (-(alpha * g)).exp());
        let unit = g * s;
        let slope = s * (one + alpha * g * (one - s));
        let dgate = if gate > limit {
            A::ZERO
        } else {
            (u + one) * slope
        };
        let dup = if up > limit || up < -limit {
            A::ZERO
        } else {
            unit
        };
        ((u + one) * unit, dgate, dup)
    }

    fn forward<T: Elem>(&self, gate: &[T], up: &[T]) -> Vec<T> {
        let mut out = vec![T::from_acc(T::Acc::ZERO); gate.len()];
        out.par_chunks_mut(CHUNK)
            .zip(gate.par_chunks(CHUNK).zip(up.par_chunks(CHUNK)))
            .for_each(|(out, (gate, up))| {
                for ((o, &g), &u) in out.iter_mut().zip(gate).zip(up) {
                    *o = T::from_acc(self.at(g.acc(), u.acc()).0);
                }
            });
        out
    }

    fn backward<T: Elem>(&self, gate: &[T], up: &[T], grad: &[T]) -> (Vec<T>, Vec<T>) {
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
                    let (_, slope_gate, slope_up) = self.at(g.acc(), u.acc());
                    let dy = dy.acc();
                    *dg = T::from_acc(dy * slope_gate);
                    *du = T::from_acc(dy * slope_up);
                }
            });
        (dgate, dup)
    }

    /// `(dgate, dup)` on the CPU.
    fn grads_cpu(&self, gate: &Tensor, up: &Tensor, grad: &Tensor) -> Result<(Tensor, Tensor)> {
        let grad = grad.contiguous()?;
        let shape = gate.shape().clone();
        let (dgate, dup) = cpu::with_cpu(gate, "the gate", |gs, gl| {
            cpu::with_cpu(up, "up", |us, ul| {
                cpu::with_cpu(&grad, "the output gradient", |ds, dl| {
                    Ok(dispatch_float!(gs.dtype(), "clamped swiglu", |T| {
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
        Ok((
            tensor_from(Storage::Cpu(dgate), shape.clone()),
            tensor_from(Storage::Cpu(dup), shape),
        ))
    }
}

impl CustomOp2 for Clamped {
    fn name(&self) -> &'static str {
        "zero-clamped-swiglu"
    }

    fn cpu_fwd(
        &self,
        gate: &CpuStorage,
        gate_layout: &Layout,
        up: &CpuStorage,
        up_layout: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let y = dispatch_float!(gate.dtype(), "clamped swiglu", |T| {
            let gate = cpu::slice::<T>(gate, gate_layout, "the gate")?;
            let up = cpu::slice::<T>(up, up_layout, "up")?;
            T::to_cpu_storage_owned(self.forward(gate, up))
        });
        Ok((y, gate_layout.shape().clone()))
    }

    fn bwd(
        &self,
        gate: &Tensor,
        up: &Tensor,
        _y: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let (dgate, dup) = self.grads_cpu(gate, up, grad)?;
        Ok((Some(dgate), Some(dup)))
    }
}

/// The gated unit of an MLP: `act(gate) · up`, or gpt-oss's clamped one.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum Gating {
    Act(Activation),
    Clamped { alpha: f64, limit: f64 },
}

impl Gating {
    /// The unit over CPU slices.
    pub(crate) fn cpu<T: Elem>(self, gate: &[T], up: &[T]) -> Vec<T> {
        match self {
            Self::Act(kind) => gated_cpu(kind, gate, up),
            Self::Clamped { alpha, limit } => Clamped { alpha, limit }.forward(gate, up),
        }
    }

    /// `(dgate, dup)` over CPU slices for the output gradient `grad`.
    pub(crate) fn grads_cpu<T: Elem>(self, gate: &[T], up: &[T], grad: &[T]) -> (Vec<T>, Vec<T>) {
        match self {
            Self::Act(kind) => gated_grads_cpu(kind, gate, up, grad),
            Self::Clamped { alpha, limit } => Clamped { alpha, limit }.backward(gate, up, grad),
        }
    }

    /// The unit of `gate` and `up` tensors (their values only: no graph
    /// for the clamped unit off the CPU).
    pub(crate) fn forward(self, gate: &Tensor, up: &Tensor) -> Result<Tensor> {
        match self {
            Self::Act(kind) => gated(kind, gate, up),
            Self::Clamped { alpha, limit } => clamped_swiglu(gate, up, alpha, limit),
        }
    }

    /// `(dgate, dup)` for the output gradient `grad`; `gate` and `up`
    /// contiguous.
    pub(crate) fn grads(
        self,
        gate: &Tensor,
        up: &Tensor,
        grad: &Tensor,
    ) -> Result<(Tensor, Tensor)> {
        match self {
            Self::Act(kind) => gated_grads(kind, gate, up, grad),
            Self::Clamped { alpha, limit } => {
                let op = Clamped { alpha, limit };
                match gate.device().is_cpu() {
                    true => op.grads_cpu(gate, up, grad),
                    false => op.composed_grads(gate, up, grad),
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device, Var};

    /// Values in about ±`scale`, different for each `seed`.
    fn values(n: usize, seed: usize, scale: f64) -> Tensor {
        let v: Vec<f64> = (0..n)
            .map(|i| scale * ((i * 7 + seed * 131) as f64 * 0.61).sin())
            .collect();
        Tensor::from_vec(v, n, &Device::Cpu).unwrap()
    }

    fn max_diff(a: &Tensor, b: &Tensor) -> f64 {
        (a.to_dtype(DType::F64).unwrap() - b.to_dtype(DType::F64).unwrap())
            .unwrap()
            .abs()
            .unwrap()
            .max(0)
            .unwrap()
            .to_scalar()
            .unwrap()
    }

    /// The op's value and gradients equal the composition's in f64 (f32's
    /// and bf16's against the composition over their values), with values
    /// on both sides of the bounds.
    #[test]
    fn the_op_is_the_composition_of_candles_ops() {
        let (alpha, limit) = (1.702, 1.5);
        let op = Clamped { alpha, limit };
        for (dtype, tolerance) in [(DType::F64, 1e-12), (DType::F32, 1e-5), (DType::BF16, 4e-2)] {
            let of = |t: Tensor| Var::from_tensor(&t.to_dtype(dtype).unwrap()).unwrap();
            let (g, u) = (of(values(400, 1, 3.0)), of(values(400, 2, 3.0)));
            let probe = values(400, 3, 1.0).to_dtype(dtype).unwrap();
            let wide = |v: &Var| Var::from_tensor(&v.to_dtype(DType::F64).unwrap()).unwrap();
            let (gate, up) = (wide(&g), wide(&u));
            let theirs = op.composed(&gate, &up).unwrap();
            let their_grads = (&theirs * probe.to_dtype(DType::F64).unwrap())
                .unwrap()
                .sum_all()
                .unwrap()
                .backward()
                .unwrap();
            let ours = clamped_swiglu(&g, &u, alpha, limit).unwrap();
            assert_eq!(ours.dtype(), dtype);
            let diff = max_diff(&ours, &theirs);
            assert!(diff < tolerance, "{dtype:?}: values differ by {diff:e}");
            let grads = (&ours * &probe)
                .unwrap()
                .sum_all()
                .unwrap()
                .backward()
                .unwrap();
            for (ours, theirs, what) in [(&g, &gate, "gate"), (&u, &up, "up")] {
                let diff = max_diff(grads.get(ours).unwrap(), their_grads.get(theirs).unwrap());
                assert!(diff < tolerance, "{dtype:?}: ∂{what} differs by {diff:e}");
            }
            // Gating's tensor gradients are the op's.
            let (dgate, dup) = Gating::Clamped { alpha, limit }
                .grads(g.as_tensor(), u.as_tensor(), &probe)
                .unwrap();
            assert_eq!(max_diff(&dgate, grads.get(&g).unwrap()), 0.0);
            assert_eq!(max_diff(&dup, grads.get(&u).unwrap()), 0.0);
            // So are those of Candle's ops that other devices take (in the
            // inputs' dtype: bf16's rounded more often).
            let (dgate, dup) = op.composed_grads(&g, &u, &probe).unwrap();
            let diff = max_diff(&dgate, grads.get(&g).unwrap());
            assert!(
                diff < 2.0 * tolerance,
                "{dtype:?}: composed ∂gate differs by {diff:e}"
            );
            let diff = max_diff(&dup, grads.get(&u).unwrap());
            assert!(
                diff < 2.0 * tolerance,
                "{dtype:?}: composed ∂up differs by {diff:e}"
            );
        }
    }

    /// At a bound the whole gradient passes, as torch's clamp passes it
    /// (Candle's `minimum` and `clamp` pass half); past it none.
    #[test]
    fn a_bound_passes_the_whole_gradient() {
        let (alpha, limit) = (1.702, 7.0);
        let gate = Var::new(&[7f64, 7.5, 7.0], &Device::Cpu).unwrap();
        let up = Var::new(&[7f64, 0.0, -7.0], &Device::Cpu).unwrap();
        let op = Clamped { alpha, limit };
        let ours = clamped_swiglu(&gate, &up, alpha, limit).unwrap();
        let grads = ours.sum_all().unwrap().backward().unwrap();
        let dgate = grads.get(&gate).unwrap().to_vec1::<f64>().unwrap();
        let dup = grads.get(&up).unwrap().to_vec1::<f64>().unwrap();
        let s = 1.0 / (1.0 + (-alpha * limit).exp());
        let slope = s * (1.0 + alpha * limit * (1.0 - s));
        assert!((dgate[0] - 8.0 * slope).abs() < 1e-12, "{dgate:?}");
        assert_eq!(dgate[1], 0.0, "past the bound");
        assert!((dgate[2] + 6.0 * slope).abs() < 1e-12, "{dgate:?}");
        assert!((dup[0] - limit * s).abs() < 1e-12, "{dup:?}");
        assert!((dup[2] - limit * s).abs() < 1e-12, "{dup:?}");
        let (composed_dgate, composed_dup) = op
            .composed_grads(gate.as_tensor(), up.as_tensor(), &ours.ones_like().unwrap())
            .unwrap();
        assert_eq!(composed_dgate.to_vec1::<f64>().unwrap(), dgate);
        assert_eq!(composed_dup.to_vec1::<f64>().unwrap(), dup);
    }
}
