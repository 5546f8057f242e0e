//! Element types of the fused layers' CPU kernels, and the arithmetic they
//! accumulate in: f32 for the 16-bit types (as autocast does), the type
//! itself for f32 and f64.

use candle_core::WithDType;
use std::ops::{Add, AddAssign, Div, Mul, Neg, Sub};

/// The arithmetic a kernel accumulates in (f32 or f64).
pub(crate) trait Accum:
    WithDType
    + Copy
    + PartialOrd
    + Add<Output = Self>
    + Sub<Output = Self>
    + Mul<Output = Self>
    + Div<Output = Self>
    + Neg<Output = Self>
    + AddAssign
    + Send
    + Sync
    + 'static
{
    const ZERO: Self;
    const ONE: Self;
    const NEG_INFINITY: Self;
    /// `v` rounded to this type.
    fn cast(v: f64) -> Self;
    fn sqrt(self) -> Self;
    fn exp(self) -> Self;
    fn ln(self) -> Self;
    fn tanh(self) -> Self;
    fn erf(self) -> Self;
}

/// `e^x` in f32 to about two ulps, branch-free so that loops over slices
/// vectorize (libm's `expf` is a call per element): `e^x = 2^n · e^r` with
/// `n = round(x / ln 2)`, `|r| <= ln 2 / 2`, and Cephes' polynomial for
/// `e^r`. Below `ln` of the smallest normal it returns 0, above `ln(f32::MAX)`
/// +inf; NaN stays NaN.
#[inline(always)]
pub(crate) fn exp_f32(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    // ln 2 split so that n · LN2_HI is exact.
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    const LOW: f32 = -87.336_55;
    const HIGH: f32 = 88.376_26;
    // Adding and subtracting 1.5 · 2^23 rounds to the nearest integer.
    const ROUND: f32 = 12_582_912.0;
    let clamped = x.clamp(LOW, HIGH);
    let n = (clamped * LOG2E + ROUND) - ROUND;
    let r = clamped - n * LN2_HI - n * LN2_LO;
    let mut p = 1.987_569_1e-4f32;
    p = p * r + 1.398_199_9e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 1.666_666_5e-1;
    p = p * r + 0.5;
    let e_r = p * r * r + r + 1.0;
    let two_n = f32::from_bits(((n as i32 + 127) << 23) as u32);
    let y = e_r * two_n;
    if x < LOW {
        0.0
    } else if x > HIGH {
        f32::INFINITY
    } else {
        y
    }
}

/// `tanh(x) = 1 - 2 / (1 + e^{2x})` over [`exp_f32`] (vectorizes; libm's
/// `tanhf` does not): absolute error below 3e-7 (a few ulps of 1).
#[inline(always)]
pub(crate) fn tanh_f32(x: f32) -> f32 {
    1.0 - 2.0 / (1.0 + exp_f32(2.0 * x))
}

macro_rules! accum {
    ($t:ty, $erf:path, $exp:path, $tanh:path) => {
        impl Accum for $t {
            const ZERO: Self = 0.0;
            const ONE: Self = 1.0;
            const NEG_INFINITY: Self = <$t>::NEG_INFINITY;
            fn cast(v: f64) -> Self {
                v as $t
            }
            fn sqrt(self) -> Self {
                <$t>::sqrt(self)
            }
            #[inline(always)]
            fn exp(self) -> Self {
                $exp(self)
            }
            fn ln(self) -> Self {
                <$t>::ln(self)
            }
            #[inline(always)]
            fn tanh(self) -> Self {
                $tanh(self)
            }
            fn erf(self) -> Self {
                $erf(self)
            }
        }
    };
}

accum!(f32, candle_core::cpu::erf::erf_f32, exp_f32, tanh_f32);
accum!(f64, candle_core::cpu::erf::erf_f64, f64::exp, f64::tanh);

/// A float element type with the type it accumulates in.
pub(crate) trait Elem: WithDType {
    type Acc: Accum;
    fn acc(self) -> Self::Acc;
    fn from_acc(v: Self::Acc) -> Self;
}

impl Elem for f32 {
    type Acc = f32;
    fn acc(self) -> f32 {
        self
    }
    fn from_acc(v: f32) -> Self {
        v
    }
}

impl Elem for f64 {
    type Acc = f64;
    fn acc(self) -> f64 {
        self
    }
    fn from_acc(v: f64) -> Self {
        v
    }
}

impl Elem for half::bf16 {
    type Acc = f32;
    fn acc(self) -> f32 {
        self.to_f32()
    }
    fn from_acc(v: f32) -> Self {
        half::bf16::from_f32(v)
    }
}

impl Elem for half::f16 {
    type Acc = f32;
    fn acc(self) -> f32 {
        self.to_f32()
    }
    fn from_acc(v: f32) -> Self {
        half::f16::from_f32(v)
    }
}

/// Calls `$body` with `$T` bound to the element type of `$dtype` (f32, f64,
/// bf16, f16), or fails naming `$what` for any other dtype.
macro_rules! dispatch_float {
    ($dtype:expr, $what:expr, |$T:ident| $body:expr) => {
        match $dtype {
            candle_core::DType::F32 => {
                type $T = f32;
                $body
            }
            candle_core::DType::F64 => {
                type $T = f64;
                $body
            }
            candle_core::DType::BF16 => {
                type $T = half::bf16;
                $body
            }
            candle_core::DType::F16 => {
                type $T = half::f16;
                $body
            }
            other => candle_core::bail!(
                "zero-candle {}: dtype {other:?} is not supported; use f32, f64, bf16 or f16",
                $what
            ),
        }
    };
}
pub(crate) use dispatch_float;

#[cfg(test)]
mod tests {
    use super::*;

    /// Distance in units in the last place between two finite f32.
    fn ulps(a: f32, b: f32) -> u32 {
        let key = |v: f32| {
            let bits = v.to_bits() as i32;
            if bits < 0 {
                i32::MIN - bits
            } else {
                bits
            }
        };
        key(a).abs_diff(key(b))
    }

    #[test]
    fn exp_f32_is_within_two_ulps_of_the_exact_value() {
        let mut worst = 0;
        let mut x = -87.0f32;
        while x < 88.0 {
            let exact = (x as f64).exp() as f32;
            worst = worst.max(ulps(exp_f32(x), exact));
            x += 0.001_37;
        }
        assert!(worst <= 2, "{worst} ulps");
        assert_eq!(exp_f32(0.0), 1.0);
        assert_eq!(exp_f32(-100.0), 0.0);
        assert_eq!(exp_f32(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp_f32(100.0), f32::INFINITY);
        assert!(exp_f32(f32::NAN).is_nan());
    }

    #[test]
    fn tanh_f32_is_within_3e7_of_the_exact_value() {
        let mut x = -20.0f32;
        while x < 20.0 {
            let exact = (x as f64).tanh();
            let err = (tanh_f32(x) as f64 - exact).abs();
            assert!(err < 3e-7, "tanh({x}): {} vs {exact}", tanh_f32(x));
            x += 0.000_73;
        }
        assert_eq!(tanh_f32(50.0), 1.0);
        assert_eq!(tanh_f32(-50.0), -1.0);
        assert!(tanh_f32(f32::NAN).is_nan());
    }
}
