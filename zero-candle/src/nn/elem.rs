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

macro_rules! accum {
    ($t:ty, $erf:path) => {
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
            fn exp(self) -> Self {
                <$t>::exp(self)
            }
            fn ln(self) -> Self {
                <$t>::ln(self)
            }
            fn tanh(self) -> Self {
                <$t>::tanh(self)
            }
            fn erf(self) -> Self {
                $erf(self)
            }
        }
    };
}

accum!(f32, candle_core::cpu::erf::erf_f32);
accum!(f64, candle_core::cpu::erf::erf_f64);

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
