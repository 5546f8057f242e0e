//! Element types the library moves and reduces: f32, f64, bf16 and f16.

use half::{bf16, f16};
use serde::{Deserialize, Serialize};
use std::any::TypeId;

/// The element type of a buffer, as a value.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DType {
    /// 32-bit IEEE float.
    F32,
    /// 64-bit IEEE float.
    F64,
    /// bfloat16.
    BF16,
    /// IEEE half precision.
    F16,
}

impl DType {
    /// Bytes per element.
    pub fn size_in_bytes(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F64 => 8,
            DType::BF16 | DType::F16 => 2,
        }
    }

    /// The lowercase name (`"f32"`, `"bf16"`, ...).
    pub fn as_str(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F64 => "f64",
            DType::BF16 => "bf16",
            DType::F16 => "f16",
        }
    }
}

impl std::fmt::Display for DType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A type a communicator can move and reduce.
///
/// 16-bit types accumulate in f32: [`Element::Acc`] is the type sums are
/// carried in, so reductions of many bf16 values lose no more than one
/// rounding at the end.
pub trait Element:
    Copy + Default + Send + Sync + PartialOrd + bytemuck::Pod + std::fmt::Debug + 'static
{
    /// The type as a value.
    const DTYPE: DType;
    /// The accumulator type used by reductions.
    type Acc: Copy + Send + Sync + std::ops::Add<Output = Self::Acc>;
    /// Widens to the accumulator.
    fn to_acc(self) -> Self::Acc;
    /// Rounds the accumulator back.
    fn from_acc(acc: Self::Acc) -> Self;
    /// Widens to f64 (for norms and tests).
    fn to_f64(self) -> f64;
    /// Rounds from f64.
    fn from_f64(v: f64) -> Self;
}

impl Element for f32 {
    const DTYPE: DType = DType::F32;
    type Acc = f32;
    fn to_acc(self) -> f32 {
        self
    }
    fn from_acc(acc: f32) -> Self {
        acc
    }
    fn to_f64(self) -> f64 {
        self as f64
    }
    fn from_f64(v: f64) -> Self {
        v as f32
    }
}

impl Element for f64 {
    const DTYPE: DType = DType::F64;
    type Acc = f64;
    fn to_acc(self) -> f64 {
        self
    }
    fn from_acc(acc: f64) -> Self {
        acc
    }
    fn to_f64(self) -> f64 {
        self
    }
    fn from_f64(v: f64) -> Self {
        v
    }
}

impl Element for bf16 {
    const DTYPE: DType = DType::BF16;
    type Acc = f32;
    fn to_acc(self) -> f32 {
        self.to_f32()
    }
    fn from_acc(acc: f32) -> Self {
        bf16::from_f32(acc)
    }
    fn to_f64(self) -> f64 {
        self.to_f64()
    }
    fn from_f64(v: f64) -> Self {
        // An f32 value (what the engine narrows) rounds from f32: `half`'s
        // f64 route truncates some values in bf16's subnormal range.
        let narrow = v as f32;
        if narrow as f64 == v {
            bf16::from_f32(narrow)
        } else {
            bf16::from_f64(v)
        }
    }
}

impl Element for f16 {
    const DTYPE: DType = DType::F16;
    type Acc = f32;
    fn to_acc(self) -> f32 {
        self.to_f32()
    }
    fn from_acc(acc: f32) -> Self {
        f16::from_f32(acc)
    }
    fn to_f64(self) -> f64 {
        self.to_f64()
    }
    fn from_f64(v: f64) -> Self {
        f16::from_f64(v)
    }
}

/// Elements one task converts when [`convert_slice`] splits a long slice
/// across rayon's threads.
const CONVERT_CHUNK: usize = 64 << 10;

/// Converts between element types, `min(src.len(), dst.len())` elements:
/// exact when widening, one rounding to nearest (ties to even) when
/// narrowing, as through f64. Between f32 and bf16 or f16 it converts
/// directly (the same values, several times faster than through f64), and
/// a long slice is split across rayon's threads.
pub fn convert_slice<S: Element, D: Element>(src: &[S], dst: &mut [D]) {
    let n = src.len().min(dst.len());
    let (src, dst) = (&src[..n], &mut dst[..n]);
    if n > CONVERT_CHUNK {
        use rayon::prelude::*;
        src.par_chunks(CONVERT_CHUNK)
            .zip(dst.par_chunks_mut(CONVERT_CHUNK))
            .for_each(|(s, d)| convert_run(s, d));
    } else {
        convert_run(src, dst);
    }
}

/// `values` as a slice of `E` when `V` is `E`.
fn typed<V: Element, E: Element>(values: &[V]) -> Option<&[E]> {
    (TypeId::of::<V>() == TypeId::of::<E>()).then(|| bytemuck::cast_slice(values))
}

/// [`typed`], writable.
fn typed_mut<V: Element, E: Element>(values: &mut [V]) -> Option<&mut [E]> {
    (TypeId::of::<V>() == TypeId::of::<E>()).then(|| bytemuck::cast_slice_mut(values))
}

/// `x` rounded to bf16, to nearest with ties to even (a NaN stays a NaN,
/// made quiet): `half`'s `bf16::from_f32` without its branches, so that a
/// loop of it vectorizes.
#[inline]
fn bf16_of(x: f32) -> bf16 {
    let bits = x.to_bits();
    let rounded = (bits.wrapping_add(0x7FFF + ((bits >> 16) & 1)) >> 16) as u16;
    let quiet_nan = ((bits >> 16) | 0x0040) as u16;
    let is_nan = bits & 0x7FFF_FFFF > 0x7F80_0000;
    bf16::from_bits(if is_nan { quiet_nan } else { rounded })
}

/// [`convert_slice`] on this thread, of slices of one length.
fn convert_run<S: Element, D: Element>(src: &[S], dst: &mut [D]) {
    use half::slice::HalfFloatSliceExt;
    if let Some(dst) = typed_mut::<D, S>(dst) {
        dst.copy_from_slice(src);
        return;
    }
    if let Some(src) = typed::<S, f32>(src) {
        if let Some(dst) = typed_mut::<D, bf16>(dst) {
            for (d, &s) in dst.iter_mut().zip(src) {
                *d = bf16_of(s);
            }
            return;
        }
        if let Some(dst) = typed_mut::<D, f16>(dst) {
            return dst.convert_from_f32_slice(src);
        }
    }
    if let Some(dst) = typed_mut::<D, f32>(dst) {
        if let Some(src) = typed::<S, bf16>(src) {
            return src.convert_to_f32_slice(dst);
        }
        if let Some(src) = typed::<S, f16>(src) {
            return src.convert_to_f32_slice(dst);
        }
    }
    for (d, s) in dst.iter_mut().zip(src) {
        *d = D::from_f64(s.to_f64());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every f32 whose top 16 bits are any pattern and whose low 16 bits
    /// sit at or beside a rounding boundary (ties, just below and above,
    /// the extremes): infinities, NaNs, subnormals and both signs among
    /// them; and past [`CONVERT_CHUNK`], so the split path runs too.
    fn boundary_floats() -> Vec<f32> {
        let lows = [
            0u32, 1, 0x3FFF, 0x7FFF, 0x8000, 0x8001, 0xBFFF, 0xC000, 0xFFFF,
        ];
        (0..=0xFFFFu32)
            .flat_map(|high| lows.iter().map(move |low| f32::from_bits(high << 16 | low)))
            .collect()
    }

    /// `convert_slice` through f64, as it was before its fast paths.
    fn through_f64<S: Element, D: Element>(src: &[S]) -> Vec<D> {
        src.iter().map(|s| D::from_f64(s.to_f64())).collect()
    }

    /// `convert_slice(src)` and the f64 path agree bit for bit (NaNs as
    /// NaNs: their payloads are not specified); the converted values.
    fn agrees<S: Element, D: Element, B: PartialEq + std::fmt::Debug>(
        src: &[S],
        bits: impl Fn(&D) -> B,
    ) -> Vec<D> {
        let mut got = vec![D::default(); src.len()];
        convert_slice(src, &mut got);
        let bits_or_nan = |values: &[D]| -> Vec<Option<B>> {
            values
                .iter()
                .map(|v| (!v.to_f64().is_nan()).then(|| bits(v)))
                .collect()
        };
        assert_eq!(
            bits_or_nan(&got),
            bits_or_nan(&through_f64(src)),
            "{:?} to {:?}",
            S::DTYPE,
            D::DTYPE
        );
        got
    }

    #[test]
    fn the_fast_conversions_round_as_the_f64_path_does() {
        let floats = boundary_floats();
        assert!(floats.len() > CONVERT_CHUNK);
        let narrow = agrees(&floats, |v: &bf16| v.to_bits());
        // A NaN stays a NaN, of the same sign.
        for (g, f) in narrow.iter().zip(&floats).filter(|(_, f)| f.is_nan()) {
            assert!(g.is_nan() && g.is_sign_negative() == f.is_sign_negative());
        }
        let half = agrees(&floats, |v: &f16| v.to_bits());
        // Widening is exact: back to f32, and f32 to f64.
        agrees(&narrow, |v: &f32| v.to_bits());
        agrees(&half, |v: &f32| v.to_bits());
        agrees(&floats, |v: &f64| v.to_bits());
    }

    #[test]
    fn a_conversion_covers_the_shorter_of_its_slices_and_copies_its_own_type() {
        let src = [1.5f32, -2.25, 3.0];
        let mut short = [0f32; 2];
        convert_slice(&src, &mut short);
        assert_eq!(short, [1.5, -2.25]);
        let mut long = [bf16::from_f32(9.0); 5];
        convert_slice(&src, &mut long);
        assert_eq!(
            long.map(f32::from),
            [1.5, -2.25, 3.0, 9.0, 9.0],
            "past the source untouched"
        );
    }

    #[test]
    fn f32_values_narrow_to_bf16_to_nearest_even_in_the_subnormal_range_too() {
        // Just above the midpoint between two bf16 subnormals: rounds up.
        let x = f32::from_bits(0x0020_8001);
        assert_eq!(<bf16 as Element>::from_f64(x as f64).to_bits(), 0x0021);
        assert_eq!(bf16::from_f32(x).to_bits(), 0x0021);
        // An exact tie rounds to even, an f64 value between f32s still rounds.
        let tie = f32::from_bits(0x3F80_8000);
        assert_eq!(<bf16 as Element>::from_f64(tie as f64).to_bits(), 0x3F80);
        let between = 1.0 + 3.0 * 2f64.powi(-9) + 2f64.powi(-40);
        assert_eq!(
            <bf16 as Element>::from_f64(between),
            bf16::from_f64(between)
        );
    }
}
