//! Mixed precision at the Candle seam: 16-bit variables and gradients meet
//! an engine of a wider element type (f32 master weights), and the loss is
//! scaled before backward when the engine asks for it.
//!
//! The engine's buffers, optimizer state and reductions are in its element
//! type `T`; a bf16/f16 model's values are widened to `T` on the way in
//! (gradients, the replica's first read) and rounded to the model's dtype
//! on the way out (the write-back).

use crate::Result;
use candle_core::backend::BackendStorage;
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

/// Storages for gathered master weights rounded to a 16-bit model's dtype
/// (stage 3): a layer gives each back when done with it, and the next piece
/// is rounded into it, so that lending a piece allocates nothing once the
/// pool holds the pieces in use.
#[derive(Default)]
pub struct RoundedPool(std::sync::Mutex<Vec<CpuStorage>>);

/// Storages a [`RoundedPool`] keeps: the pieces a layer computes with at
/// once (Linear in pieces holds one; a tied weight's two uses, two).
const ROUNDED_KEPT: usize = 4;

impl RoundedPool {
    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<CpuStorage>> {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// `stretches` of `values` (master weights), rounded to the 16-bit
    /// `dtype` (the rounding the engine's write-back applies) into a
    /// storage from the pool, at `into`'s places (which follow one another
    /// from 0).
    pub(crate) fn round<T: Element>(
        &self,
        values: &[T],
        stretches: &[crate::nn::Stretch],
        into: &[crate::nn::Stretch],
        dtype: DType,
    ) -> Result<CpuStorage> {
        let len = into.last().map_or(0, |s| s.at.end);
        let kept = {
            let mut pool = self.lock();
            let found = pool.iter().position(|s| s.dtype() == dtype);
            found.map(|k| pool.swap_remove(k))
        };
        /// `stretches` of `values`, stretch by stretch into `out` (reused
        /// when the pool had one) at `into`'s places.
        fn fill<T: Element, H: Element>(
            mut out: Vec<H>,
            len: usize,
            values: &[T],
            (stretches, into): (&[crate::nn::Stretch], &[crate::nn::Stretch]),
        ) -> Vec<H> {
            out.resize(len, H::default());
            for (from, to) in stretches.iter().zip(into) {
                convert_slice(&values[from.at.clone()], &mut out[to.at.clone()]);
            }
            out
        }
        let places = (stretches, into);
        Ok(match (dtype, kept) {
            (DType::BF16, kept) => {
                let out = match kept {
                    Some(CpuStorage::BF16(v)) => v,
                    _ => Vec::new(),
                };
                CpuStorage::BF16(fill(out, len, values, places))
            }
            (DType::F16, kept) => {
                let out = match kept {
                    Some(CpuStorage::F16(v)) => v,
                    _ => Vec::new(),
                };
                CpuStorage::F16(fill(out, len, values, places))
            }
            (other, _) => {
                return Err(crate::Error::Variable {
                    name: "<gathered>".into(),
                    detail: format!("cannot round master weights to {other:?}; use bf16 or f16"),
                })
            }
        })
    }
}

impl crate::nn::GiveBack for RoundedPool {
    fn give_back(&self, _tag: usize, storage: candle_core::Storage) {
        let mut pool = self.lock();
        if let (candle_core::Storage::Cpu(storage), true) = (storage, pool.len() < ROUNDED_KEPT) {
            pool.push(storage);
        }
    }
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nn::{GiveBack, Stretch};

    fn stretch(at: std::ops::Range<usize>, values: std::ops::Range<usize>) -> Stretch {
        Stretch { at, values }
    }

    /// A piece is rounded stretch by stretch into a storage from the pool,
    /// and the storage given back serves the next piece of its dtype.
    #[test]
    fn rounded_pieces_reuse_the_storages_given_back() {
        let pool = RoundedPool::default();
        let values: Vec<f32> = (0..10).map(|i| i as f32 * 0.1 + 1.0 / 3.0).collect();
        let from = [stretch(6..10, 0..4), stretch(0..2, 4..6)];
        let into = [stretch(0..4, 0..4), stretch(4..6, 4..6)];
        let expected: Vec<bf16> = values[6..10]
            .iter()
            .chain(&values[0..2])
            .map(|&x| bf16::from_f32(x))
            .collect();
        let first = pool.round(&values, &from, &into, DType::BF16).unwrap();
        let CpuStorage::BF16(v) = &first else {
            panic!("a bf16 storage")
        };
        assert_eq!(v, &expected);
        let place = v.as_ptr();
        pool.give_back(0, candle_core::Storage::Cpu(first));
        // An f16 piece does not take the bf16 storage.
        let f16_piece = pool.round(&values, &from, &into, DType::F16).unwrap();
        assert!(matches!(f16_piece, CpuStorage::F16(_)));
        let again = pool.round(&values, &from, &into, DType::BF16).unwrap();
        let CpuStorage::BF16(w) = &again else {
            panic!("a bf16 storage")
        };
        assert_eq!(w.as_ptr(), place, "the storage given back is reused");
        assert_eq!(w, &expected);
        assert!(pool.round(&values, &from, &into, DType::F32).is_err());
    }
}
