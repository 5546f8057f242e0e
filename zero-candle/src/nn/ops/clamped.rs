//! gpt-oss's clamped SwiGLU: the unit, its slopes and its composition of
//! Candle's ops; the op is `swiglu.rs`'s ([`super::clamped_swiglu`]).

use super::super::elem::Accum;
use candle_core::{Result, Tensor};

/// The clamped unit's constants.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) struct Clamped {
    pub(super) alpha: f64,
    pub(super) limit: f64,
}

impl Clamped {
    /// The unit of Candle's ops.
    pub(super) fn composed(&self, gate: &Tensor, up: &Tensor) -> Result<Tensor> {
        let gate = gate.minimum(self.limit)?;
        let up = up.clamp(-self.limit, self.limit)?;
        let opened = candle_nn::ops::sigmoid(&gate.affine(self.alpha, 0.0)?)?;
        (up + 1.0)? * (gate * opened)?
    }

    /// `(dgate, dup)` for the output gradient `grad`, of Candle's ops in
    /// the inputs' dtype; a bound passes the whole gradient.
    pub(super) fn composed_grads(
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
    pub(super) fn at<A: Accum>(&self, gate: A, up: A) -> (A, A, A) {
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
}

#[cfg(test)]
mod tests {
    use super::super::swiglu::{clamped_swiglu, Gating};
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
