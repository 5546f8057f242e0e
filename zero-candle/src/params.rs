//! Moving values between Candle variables and the engine's host buffers.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, InplaceOp1, Layout, Storage, Tensor, Var, WithDType};
use half::{bf16, f16};
use std::ops::Range;
use zero_core::engine::convert_slice;
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
        if var.device().is_cpu() && var.is_contiguous() {
            // Straight into the variable's storage, rounded to its dtype
            // where the engine keeps wider master weights: no copy of the
            // range in either type.
            return var
                .as_tensor()
                .inplace_op1(&WriteRange { range, values })
                .map_err(|e| var_error("write", param, var, e));
        }
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

/// Overwrites elements `range` of a contiguous CPU tensor with `values`,
/// converted to its dtype (to nearest, ties to even, when narrower).
struct WriteRange<'a, T> {
    range: Range<usize>,
    values: &'a [T],
}

impl<T: Element + WithDType> InplaceOp1 for WriteRange<'_, T> {
    fn name(&self) -> &'static str {
        "zero-write-range"
    }

    fn cpu_fwd(&self, storage: &mut CpuStorage, layout: &Layout) -> candle_core::Result<()> {
        let Some((start, end)) = layout.contiguous_offsets() else {
            candle_core::bail!("zero-write-range: the variable is not contiguous")
        };
        let (lo, hi) = (start + self.range.start, start + self.range.end);
        if hi > end || self.values.len() != self.range.len() {
            candle_core::bail!(
                "zero-write-range: {} values for elements {:?} of a variable of {} elements",
                self.values.len(),
                self.range,
                end - start
            )
        }
        let values = self.values;
        match storage {
            CpuStorage::F32(v) => store::<T, f32>(values, &mut v[lo..hi]),
            CpuStorage::F64(v) => store::<T, f64>(values, &mut v[lo..hi]),
            CpuStorage::BF16(v) => store::<T, bf16>(values, &mut v[lo..hi]),
            CpuStorage::F16(v) => store::<T, f16>(values, &mut v[lo..hi]),
            other => candle_core::bail!(
                "zero-write-range: a {:?} variable cannot receive float values",
                other.dtype()
            ),
        }
        Ok(())
    }
}

/// `values` into `dst`: copied when of one type, else converted.
fn store<T: Element, S: Element>(values: &[T], dst: &mut [S]) {
    if T::DTYPE == S::DTYPE {
        dst.copy_from_slice(bytemuck::cast_slice(values));
    } else {
        convert_slice(values, dst);
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
