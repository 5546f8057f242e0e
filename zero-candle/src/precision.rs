//! Mixed precision at the Candle seam: 16-bit variables and gradients meet
//! an engine of a wider element type (f32 master weights), and the loss is
//! scaled before backward when the engine asks for it.
//!
//! The engine's buffers, optimizer state and reductions are in its element
//! type `T`; a bf16/f16 model's values are widened to `T` on the way in
//! (gradients, the replica's first read) and rounded to the model's dtype
//! on the way out (the write-back).

use crate::Result;
use candle_core::{CpuStorage, DType, Storage, Tensor, WithDType};
use half::{bf16, f16};
use zero_core::engine::convert_slice;
use zero_core::Element;

/// The elements of `values` (contiguous CPU storage of any float dtype)
/// converted into `out`; `false` if the storage is of another kind.
pub(crate) fn convert_cpu<T: Element>(
    storage: &CpuStorage,
    values: std::ops::Range<usize>,
    out: &mut [T],
) -> bool {
    match storage {
        CpuStorage::BF16(v) => convert_slice::<bf16, T>(&v[values], out),
        CpuStorage::F16(v) => convert_slice::<f16, T>(&v[values], out),
        CpuStorage::F32(v) => convert_slice::<f32, T>(&v[values], out),
        CpuStorage::F64(v) => convert_slice::<f64, T>(&v[values], out),
        _ => return false,
    }
    true
}

/// All elements of `t` (any float dtype, any device) as `T`, widened (or
/// rounded) in one pass over CPU storage.
pub(crate) fn values_as<T: Element + WithDType>(t: &Tensor) -> Result<Vec<T>> {
    {
        let (storage, layout) = t.storage_and_layout();
        if let (Storage::Cpu(cpu), Some((start, end))) = (&*storage, layout.contiguous_offsets()) {
            let mut out = vec![T::default(); end - start];
            if convert_cpu(cpu, start..end, &mut out) {
                return Ok(out);
            }
        }
    }
    Ok(t.flatten_all()?
        .to_dtype(<T as WithDType>::DTYPE)?
        .to_vec1::<T>()?)
}

/// `values` rounded to the 16-bit `dtype`, as a CPU storage (the rounding
/// the engine's write-back applies).
pub(crate) fn rounded<T: Element>(values: &[T], dtype: DType) -> Result<CpuStorage> {
    Ok(match dtype {
        DType::BF16 => {
            let mut out = vec![bf16::ZERO; values.len()];
            convert_slice::<T, bf16>(values, &mut out);
            CpuStorage::BF16(out)
        }
        DType::F16 => {
            let mut out = vec![f16::ZERO; values.len()];
            convert_slice::<T, f16>(values, &mut out);
            CpuStorage::F16(out)
        }
        other => {
            return Err(crate::Error::Variable {
                name: "<gathered>".into(),
                detail: format!("cannot round master weights to {other:?}; use bf16 or f16"),
            })
        }
    })
}

/// `loss` multiplied by the engine's loss scale (`loss` itself without
/// one). Compute the loss of an f16 model in f32 (as `autocast` does):
/// the scaled loss of an f16 loss overflows f16 at the default scale.
pub(crate) fn scale_loss(loss: &Tensor, scale: Option<f64>) -> Result<Tensor> {
    Ok(match scale {
        Some(scale) => loss.affine(scale, 0.0)?,
        None => loss.clone(),
    })
}

/// Whether `dtype` is a 16-bit float (a model that wants f32 masters).
pub fn is_half(dtype: DType) -> bool {
    matches!(dtype, DType::BF16 | DType::F16)
}
