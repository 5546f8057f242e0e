//! `tap`: a parameter that is not in a fused layer, with its gradient sent to the hook.

use super::grad_hook::{assemble, gather, route, GradHook};
use candle_core::backend::BackendStorage;
use candle_core::{
    CpuStorage, CudaStorage, CustomOp1, CustomOp2, Layout, Result, Shape, Tensor, Var,
};
use std::sync::Arc;

/// The variable `var` as a tensor to compute with, whose gradient goes to
/// `hook` when backward reaches it.
///
/// With a hook this is a copy of `var` (Candle's custom ops cannot return
/// their input without copying it), recorded as an identity op whose
/// backward hands the gradient to the hook and gives Candle none, so `var`
/// gets no `GradStore` entry from this use. Tap small parameters (biases,
/// scales, positional tables); large weights belong in the fused
/// [`Linear`](super::Linear) and [`Embedding`](super::Embedding), which read
/// them in place. Tap inside every forward: the copy is a snapshot of `var`
/// at the time of the call. A variable the hook keeps sharded (stage 3,
/// when a fused layer also reads it) is gathered whole for the copy.
///
/// With `None` it returns `var`'s own tensor (no copy) and the gradient goes
/// to the `GradStore` as usual.
///
/// ```
/// use std::sync::Arc;
/// use candle_core::{DType, Device, Var};
/// use zero_candle::nn::{tap, GradCollector, GradHook};
///
/// # fn main() -> candle_core::Result<()> {
/// let scale = Var::ones(3, DType::F32, &Device::Cpu)?;
/// let collector = Arc::new(GradCollector::new());
/// let hook: Arc<dyn GradHook> = collector.clone();
/// let loss = (tap(&scale, Some(hook))? * 2.0)?.sum_all()?;
/// let grads = loss.backward()?;
/// assert!(grads.get(&scale).is_none());
/// assert_eq!(collector.get(&scale).unwrap().to_vec1::<f32>()?, [2.0; 3]);
/// # Ok(())
/// # }
/// ```
pub fn tap(var: &Var, hook: Option<Arc<dyn GradHook>>) -> Result<Tensor> {
    match hook {
        Some(hook) => {
            hook.before_read(var)?;
            let param = var.as_tensor();
            match gather(Some(&hook), Some(param), 0)? {
                Some(first) => {
                    let values =
                        assemble(Some(&hook), param, Some(first))?.to_dtype(param.dtype())?;
                    param.apply_op2(&values, Tap { hook })
                }
                None => param.apply_op1(Tap { hook }),
            }
        }
        None => Ok(var.as_tensor().clone()),
    }
}

/// The identity op behind [`tap`]; as a binary op, the variable (sharded,
/// its storage empty) and its gathered values.
struct Tap {
    hook: Arc<dyn GradHook>,
}

/// A contiguous copy of the elements `layout` selects; a same-dtype
/// conversion is an exact copy on every backend.
fn copy<S: BackendStorage>(storage: &S, layout: &Layout) -> Result<(S, Shape)> {
    Ok((
        storage.to_dtype(layout, storage.dtype())?,
        layout.shape().clone(),
    ))
}

impl CustomOp1 for Tap {
    fn name(&self) -> &'static str {
        "zero-tap"
    }

    fn cpu_fwd(&self, storage: &CpuStorage, layout: &Layout) -> Result<(CpuStorage, Shape)> {
        copy(storage, layout)
    }

    fn cuda_fwd(&self, storage: &CudaStorage, layout: &Layout) -> Result<(CudaStorage, Shape)> {
        copy(storage, layout)
    }

    fn bwd(&self, arg: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        route(Some(&self.hook), arg, grad.clone())
    }
}

impl CustomOp2 for Tap {
    fn name(&self) -> &'static str {
        "zero-tap-gathered"
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        values: &CpuStorage,
        layout: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        copy(values, layout)
    }

    fn cuda_fwd(
        &self,
        _: &CudaStorage,
        _: &Layout,
        values: &CudaStorage,
        layout: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        copy(values, layout)
    }

    fn bwd(
        &self,
        arg: &Tensor,
        _values: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        Ok((route(Some(&self.hook), arg, grad.clone())?, None))
    }
}
