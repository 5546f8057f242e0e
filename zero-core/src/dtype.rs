//! Element types the library moves and reduces: f32, f64, bf16 and f16.

use half::{bf16, f16};
use serde::{Deserialize, Serialize};

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

#[cfg(test)]
mod tests {
    use super::Element;
    use half::bf16;

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
