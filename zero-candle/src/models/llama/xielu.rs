//! xIELU (Apertus's activation, arXiv 2411.13010): a piecewise activation
//! with two trained parameters and two constants of its own.

use crate::nn::{tap, GradHook};
use crate::Result;
use candle_core::{DType, Tensor, Var};
use candle_nn::{Init, VarBuilder};
use std::sync::Arc;

/// `x > 0`: `αp x² + β x`; else `(expm1(min(x, ε)) − x) αn + β x`, with
/// `αp = softplus(alpha_p)` and `αn = β + softplus(alpha_n)`, as
/// `transformers`' `XIELUActivation` computes it; composed of Candle's ops
/// (`expm1` as `2 tanh(x/2) / (1 − tanh(x/2))`, exact near 0 where
/// `exp(x) − 1` cancels).
#[derive(Clone)]
pub(super) struct Xielu {
    /// `alpha_p` and `alpha_n`, one value each (trained).
    alpha_p: Tensor,
    alpha_n: Tensor,
    /// The checkpoint's buffers `beta` and `eps` (not trained; saved back as
    /// they are).
    beta: f64,
    eps: f64,
    hook: Option<Arc<dyn GradHook>>,
}

/// `log(exp(x) − 1)`, softplus's inverse: `transformers`' initial values.
fn softplus_inverse(x: f64) -> f64 {
    x.exp_m1().ln()
}

impl Xielu {
    /// The activation under `vb` (`mlp.act_fn`): its parameters, initialized
    /// as `transformers` does (αp 0.8, αn 0.8, β 0.5, ε −1e-6) where the
    /// checkpoint has none.
    pub(super) fn new(vb: VarBuilder, hook: Option<Arc<dyn GradHook>>) -> Result<Self> {
        let constant = |name: &str, missing: f64| -> Result<f64> {
            match vb.contains_tensor(name) {
                true => Ok(vb
                    .get_unchecked_dtype(name, DType::F64)?
                    .flatten_all()?
                    .get(0)?
                    .to_scalar::<f64>()?),
                false => Ok(missing),
            }
        };
        let beta = constant("beta", 0.5)?;
        Ok(Self {
            alpha_p: vb.get_with_hints(1, "alpha_p", Init::Const(softplus_inverse(0.8)))?,
            alpha_n: vb.get_with_hints(1, "alpha_n", Init::Const(softplus_inverse(0.8 - beta)))?,
            beta,
            eps: constant("eps", -1e-6)?,
            hook,
        })
    }

    /// The activation of `x`, in `x`'s dtype.
    pub(super) fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        // softplus of a parameter whose gradient goes to the hook.
        let scale = |param: &Tensor| -> candle_core::Result<Tensor> {
            let p = match &self.hook {
                Some(hook) => tap(&Var::from_tensor(param)?, Some(hook.clone()))?,
                None => param.clone(),
            };
            (p.to_dtype(x.dtype())?.exp()? + 1.0)?.log()
        };
        let alpha_p = scale(&self.alpha_p)?;
        let alpha_n = (scale(&self.alpha_n)? + self.beta)?;
        let linear = (x * self.beta)?;
        let positive = x.sqr()?.broadcast_mul(&alpha_p)?.add(&linear)?;
        let half = (x.minimum(self.eps)? * 0.5)?.tanh()?;
        let expm1 = ((&half * 2.0)? / half.affine(-1.0, 1.0)?)?;
        let negative = (expm1 - x)?.broadcast_mul(&alpha_n)?.add(&linear)?;
        x.gt(0.0)?.where_cond(&positive, &negative)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// The composition against the formula in f64, on both sides of 0 and
    /// of ε, and its gradients against finite differences.
    #[test]
    fn xielu_is_transformers_formula() {
        let (ap, an, beta, eps) = (0.3f64, -0.2f64, 0.5f64, -1e-6f64);
        let softplus = |v: f64| v.exp().ln_1p();
        let reference = |x: f64| match x > 0.0 {
            true => softplus(ap) * x * x + beta * x,
            false => (x.min(eps).exp_m1() - x) * (beta + softplus(an)) + beta * x,
        };
        let xs = [-3.0, -0.5, -1e-3, -2e-6, -5e-7, 0.0, 1e-4, 0.7, 2.5];
        let act = Xielu {
            alpha_p: Var::new(&[ap], &Device::Cpu).unwrap().as_tensor().clone(),
            alpha_n: Var::new(&[an], &Device::Cpu).unwrap().as_tensor().clone(),
            beta,
            eps,
            hook: None,
        };
        let x = Var::new(&xs, &Device::Cpu).unwrap();
        let y = act.forward(x.as_tensor()).unwrap();
        for (got, x) in y.to_vec1::<f64>().unwrap().iter().zip(xs) {
            let want = reference(x);
            assert!(
                (got - want).abs() <= 1e-15 * (1.0 + want.abs()),
                "xielu({x}) = {got}, want {want}"
            );
        }
        let grads = y.sum_all().unwrap().backward().unwrap();
        let dx = grads.get(x.as_tensor()).unwrap().to_vec1::<f64>().unwrap();
        let h = 1e-7;
        for (got, &x) in dx.iter().zip(&xs) {
            // One-sided away from the kinks at 0 and ε.
            let want = match x {
                x if x > 0.0 => (reference(x + h) - reference(x)) / h,
                _ => (reference(x) - reference(x - h)) / h,
            };
            assert!(
                (got - want).abs() < 1e-5,
                "d xielu({x}) = {got}, want {want}"
            );
        }
        let d_ap = grads.get(&act.alpha_p).unwrap().to_vec1::<f64>().unwrap()[0];
        let sigmoid = |v: f64| 1.0 / (1.0 + (-v).exp());
        let want: f64 = xs.iter().filter(|&&x| x > 0.0).map(|x| x * x).sum::<f64>() * sigmoid(ap);
        assert!((d_ap - want).abs() < 1e-12, "d alpha_p {d_ap}, want {want}");
    }
}
