//! Moving values between Candle variables and the engine's host buffers.

use candle_core::{Storage, Tensor, Var, WithDType};
use std::ops::Range;
use zero_core::{Element, ParamStore};

/// Candle variables as the engine's [`ParamStore`] (parameter `i` is
/// `vars[i]`, in the engine's parameter order), for calling the engine's
/// checkpoint functions directly.
pub struct VarStore<'a> {
    /// The variables, in the engine's parameter order.
    pub vars: &'a [Var],
}

/// A Candle failure on variable `param`, with what the engine needs of it.
fn var_error(action: &str, param: usize, var: &Var, e: candle_core::Error) -> zero_core::Error {
    zero_core::Error::State(format!(
        "cannot {action} parameter #{param} ({:?} {:?}) through Candle: {e}; \
         the optimizer's variables must keep the dtype and shape they had when it was built",
        var.dtype(),
        var.dims()
    ))
}

impl<T: Element + WithDType> ParamStore<T> for VarStore<'_> {
    fn read(&mut self, param: usize, range: Range<usize>, out: &mut [T]) -> zero_core::Result<()> {
        let var = &self.vars[param];
        {
            let (storage, layout) = var.storage_and_layout();
            if let (Storage::Cpu(cpu), Some((start, _))) = (&*storage, layout.contiguous_offsets())
            {
                let values = start + range.start..start + range.end;
                if var.dtype() == <T as WithDType>::DTYPE {
                    let data = T::cpu_storage_as_slice(cpu)
                        .map_err(|e| var_error("read", param, var, e))?;
                    out.copy_from_slice(&data[values]);
                    return Ok(());
                }
                // A 16-bit variable under f32 master weights: widened.
                if crate::precision::convert_cpu(cpu, values, out) {
                    return Ok(());
                }
            }
        }
        // Other devices (and non-contiguous variables): through a host copy.
        let values = var
            .as_tensor()
            .flatten_all()
            .and_then(|t| t.narrow(0, range.start, range.len()))
            .and_then(|t| t.to_dtype(<T as WithDType>::DTYPE))
            .and_then(|t| t.to_vec1::<T>())
            .map_err(|e| var_error("read", param, var, e))?;
        out.copy_from_slice(&values);
        Ok(())
    }

    fn write(&mut self, param: usize, range: Range<usize>, values: &[T]) -> zero_core::Result<()> {
        let var = &self.vars[param];
        // Rounded to the variable's dtype (to nearest, ties to even) where
        // the engine keeps wider master weights, straight into a buffer of
        // that dtype (no copy in `T` first).
        let src = match var.dtype() {
            dtype if dtype == <T as WithDType>::DTYPE => {
                Tensor::from_slice(values, values.len(), var.device())
            }
            candle_core::DType::BF16 => narrowed::<T, half::bf16>(values, var),
            candle_core::DType::F16 => narrowed::<T, half::f16>(values, var),
            _ => Tensor::from_slice(values, values.len(), var.device())
                .and_then(|t| t.to_dtype(var.dtype())),
        }
        .map_err(|e| var_error("write", param, var, e))?;
        // A contiguous variable's flattened view shares its storage, so
        // `slice_set` writes the range in place.
        var.as_tensor()
            .flatten_all()
            .and_then(|flat| flat.slice_set(&src, 0, range.start))
            .map_err(|e| var_error("write", param, var, e))
    }
}

/// `values` rounded to `L`, as a tensor on `var`'s device.
fn narrowed<T: Element, L: Element + WithDType>(
    values: &[T],
    var: &Var,
) -> candle_core::Result<Tensor> {
    let mut narrow = vec![L::default(); values.len()];
    zero_core::engine::convert_slice(values, &mut narrow);
    Tensor::from_vec(narrow, values.len(), var.device())
}
