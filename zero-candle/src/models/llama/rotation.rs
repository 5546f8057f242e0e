//! The rotary embeddings' tables: cosines and sines by position, cached
//! per dtype and device, grown as longer sequences come.

use crate::models::rope::Rope;
use crate::nn::ops;
use candle_core::{DType, Device, Tensor};
use std::sync::{Mutex, PoisonError};

/// The cosines and sines of positions `0..len`, `[len, head_dim / 2]`
/// each, times the rotation's attention factor (YaRN's), in the model's
/// dtype (rounded from f32, as `transformers` rounds its tables to the
/// activations' dtype).
#[derive(Clone)]
pub(super) struct Rotation {
    cos: Tensor,
    sin: Tensor,
}

impl Rotation {
    fn new(
        (inv_freq, factor): (&[f64], f64),
        len: usize,
        dtype: DType,
        device: &Device,
    ) -> candle_core::Result<Self> {
        // f32 as transformers computes them.
        let angles: Vec<f32> = (0..len)
            .flat_map(|t| inv_freq.iter().map(move |&f| t as f32 * f as f32))
            .collect();
        let angles = Tensor::from_vec(angles, (len, inv_freq.len()), device)?;
        let scaled = |table: Tensor| {
            if factor == 1.0 {
                Ok(table)
            } else {
                table * factor
            }
        };
        Ok(Self {
            cos: scaled(angles.cos()?)?.to_dtype(dtype)?,
            sin: scaled(angles.sin()?)?.to_dtype(dtype)?,
        })
    }

    fn len(&self) -> usize {
        self.cos.dims()[0]
    }

    /// The first `time` positions (a view: a position's row does not
    /// depend on the table's length).
    fn narrow(&self, time: usize) -> candle_core::Result<Self> {
        Ok(Self {
            cos: self.cos.narrow(0, 0, time)?,
            sin: self.sin.narrow(0, 0, time)?,
        })
    }

    /// `x * cos + rotate_half(x) * sin` for `x` `[batch, time, heads,
    /// head_dim]`, in one op; where the tables rotate fewer values than a
    /// head holds (Phi-3's `partial_rotary_factor`), the first ones, the
    /// rest passed through.
    pub(super) fn apply(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let (rotated, width) = (2 * self.cos.dim(1)?, x.dim(3)?);
        if rotated == width {
            return ops::rotary_embedding(x, &self.cos, &self.sin);
        }
        let turned = ops::rotary_embedding(&x.narrow(3, 0, rotated)?, &self.cos, &self.sin)?;
        Tensor::cat(&[&turned, &x.narrow(3, rotated, width - rotated)?], 3)
    }
}

/// The rotation tables a model has built, one per dtype and device, each
/// as long as the longest sequence asked for so far: a forward narrows one
/// instead of computing and uploading its table again.
struct RotationCache {
    /// The rotary frequencies.
    inv_freq: Vec<f64>,
    /// The factor on the cosines and sines.
    factor: f64,
    tables: Mutex<Vec<(DType, Device, Rotation)>>,
}

impl RotationCache {
    /// No tables yet, of the frequencies `inv_freq` and the factor on the
    /// cosines and sines.
    fn new(inv_freq: Vec<f64>, factor: f64) -> Self {
        Self {
            inv_freq,
            factor,
            tables: Mutex::default(),
        }
    }

    /// The tables of positions `0..time` in `dtype` on `device`.
    fn get(&self, time: usize, dtype: DType, device: &Device) -> candle_core::Result<Rotation> {
        let mut tables = self.tables.lock().unwrap_or_else(PoisonError::into_inner);
        let slot = tables
            .iter()
            .position(|(d, dev, _)| *d == dtype && dev.same_device(device));
        if let Some(i) = slot {
            if tables[i].2.len() >= time {
                return tables[i].2.narrow(time);
            }
        }
        // Growing by at least twice the length keeps rebuilds rare when
        // sequences lengthen one token at a time.
        let len = slot.map_or(time, |i| time.max(2 * tables[i].2.len()));
        let built = Rotation::new((&self.inv_freq, self.factor), len, dtype, device)?;
        let rotation = built.narrow(time)?;
        match slot {
            Some(i) => tables[i].2 = built,
            None => tables.push((dtype, device.clone(), built)),
        }
        Ok(rotation)
    }
}

/// A rotation's tables: one cache, or longrope's two, its short factors'
/// up to its original context and its long factors' past it.
pub(super) struct RopeTables {
    short: RotationCache,
    /// The length past which the long tables rotate, and their cache.
    long: Option<(usize, RotationCache)>,
}

impl RopeTables {
    /// No tables yet, of the rotation `rope` gives the first `rotary_dim`
    /// values of each head; by the negative angles where `negated`
    /// (NanoChat's: its sines negated).
    pub(super) fn new(rope: &Rope, rotary_dim: usize, negated: bool) -> Self {
        let frequencies = |time| {
            let inv_freq = rope.inv_freq_at(rotary_dim, time);
            match negated {
                true => inv_freq.into_iter().map(|f| -f).collect(),
                false => inv_freq,
            }
        };
        let cache = |time| RotationCache::new(frequencies(time), rope.attention_factor());
        Self {
            short: cache(0),
            long: rope
                .switches_after()
                .map(|after| (after, cache(after.saturating_add(1)))),
        }
    }

    /// The tables of sequences of `time` positions in `dtype` on `device`.
    pub(super) fn get(
        &self,
        time: usize,
        dtype: DType,
        device: &Device,
    ) -> candle_core::Result<Rotation> {
        match &self.long {
            Some((after, long)) if time > *after => long.get(time, dtype, device),
            _ => self.short.get(time, dtype, device),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::models::rope::RopeScaling;

    fn values(t: &Tensor) -> Vec<f32> {
        t.flatten_all().unwrap().to_vec1::<f32>().unwrap()
    }

    #[test]
    fn the_rotation_cache_narrows_its_table_and_grows_it_when_asked_for_more() {
        let rope = Rope {
            theta: 100.0,
            scaling: RopeScaling::None,
        };
        let cache = RotationCache::new(rope.inv_freq(6), rope.attention_factor());
        let plain: Vec<f64> = (0..3).map(|i| 1.0 / 100f64.powf(i as f64 / 3.0)).collect();
        assert_eq!(cache.inv_freq, plain);
        let device = Device::Cpu;
        let long = cache.get(5, DType::F32, &device).unwrap();
        let short = cache.get(3, DType::F32, &device).unwrap();
        let fresh = Rotation::new((&cache.inv_freq, 1.0), 3, DType::F32, &device).unwrap();
        assert_eq!((long.len(), short.len()), (5, 3));
        assert_eq!(values(&short.cos), values(&fresh.cos));
        assert_eq!(values(&short.sin), values(&fresh.sin));
        // A narrowed view of the one table, not a table of its own.
        assert_eq!(cache.tables.lock().unwrap().len(), 1);
        let longer = cache.get(7, DType::F32, &device).unwrap();
        assert_eq!(longer.len(), 7);
        assert_eq!(
            cache.tables.lock().unwrap()[0].2.len(),
            10,
            "grown to twice the old length"
        );
        cache.get(3, DType::BF16, &device).unwrap();
        assert_eq!(cache.tables.lock().unwrap().len(), 2, "one table per dtype");
    }

    /// YaRN's attention factor multiplies the cosines and sines.
    #[test]
    fn an_attention_factor_scales_the_tables() {
        let inv_freq = [1.0, 0.1];
        let plain = Rotation::new((&inv_freq, 1.0), 4, DType::F32, &Device::Cpu).unwrap();
        let scaled = Rotation::new((&inv_freq, 1.5), 4, DType::F32, &Device::Cpu).unwrap();
        for (a, b) in [(&plain.cos, &scaled.cos), (&plain.sin, &scaled.sin)] {
            let want: Vec<f32> = values(a).iter().map(|v| v * 1.5).collect();
            assert_eq!(values(b), want);
        }
    }
}
