//! [`Float`]: the element types the built-in host kernels compute in.

use crate::Element;
use std::ops::{Add, Div, Mul, Neg, Sub};

/// A floating-point element the built-in optimizers compute in directly
/// (f32 and f64; bf16 and f16 op by op through f32).
///
/// Hyperparameters are `f64`; a kernel converts each derived scalar once per
/// step with [`Element::from_f64`] and then computes in `Self`, as
/// `torch.optim` does for a tensor of that dtype. 16-bit parameters are meant
/// to be stepped through f32 master copies rather than in 16 bits (an
/// `Engine<f32>` over a bf16 model).
pub trait Float:
    Element
    + Add<Output = Self>
    + Sub<Output = Self>
    + Mul<Output = Self>
    + Div<Output = Self>
    + Neg<Output = Self>
{
    /// Zero.
    const ZERO: Self;
    /// One.
    const ONE: Self;
    /// The square root.
    fn sqrt(self) -> Self;
    /// The larger of `self` and `other`, NaN if either is NaN (like
    /// `torch.maximum`).
    fn maximum(self, other: Self) -> Self;
}

macro_rules! impl_float {
    ($t:ty) => {
        impl Float for $t {
            const ZERO: Self = 0.0;
            const ONE: Self = 1.0;
            #[inline(always)]
            fn sqrt(self) -> Self {
                <$t>::sqrt(self)
            }
            #[inline(always)]
            fn maximum(self, other: Self) -> Self {
                // A select rather than `f32::max`, which would drop the NaN.
                if self > other || self.is_nan() {
                    self
                } else {
                    other
                }
            }
        }
    };
}

impl_float!(f32);
impl_float!(f64);

/// 16-bit types, for an engine without master weights (the engine's
/// element type is the model's): every operation is computed in f32 and
/// rounded back, as a `torch.optim` step on a bf16/f16 tensor does op by
/// op. Updates smaller than half a unit in the last place are lost: train
/// 16-bit models with f32 master weights instead (`Engine<f32>`).
macro_rules! impl_half_float {
    ($t:ty) => {
        impl Float for $t {
            const ZERO: Self = <$t>::ZERO;
            const ONE: Self = <$t>::ONE;
            #[inline(always)]
            fn sqrt(self) -> Self {
                <$t>::from_f32(self.to_f32().sqrt())
            }
            #[inline(always)]
            fn maximum(self, other: Self) -> Self {
                if self > other || self.is_nan() {
                    self
                } else {
                    other
                }
            }
        }
    };
}

impl_half_float!(half::bf16);
impl_half_float!(half::f16);
