//! Host reduction kernels: combine N ranks' chunks in rank order, in blocks
//! that the compiler vectorizes, accumulating 16-bit types in f32.

use crate::comm::ReduceOp;
use crate::{DType, Element, Error, Result};
use half::{bf16, f16};

/// Elements per block: the accumulator block stays in L1.
const BLOCK: usize = 1024;

/// Arithmetic of one concrete element type in its accumulator.
trait Arith: bytemuck::Pod {
    type A: Copy + Default;
    fn up(self) -> Self::A;
    fn down(a: Self::A) -> Self;
    fn add(a: Self::A, b: Self::A) -> Self::A;
    fn mul(a: Self::A, b: Self::A) -> Self::A;
    /// Maximum that propagates NaN.
    fn max(a: Self::A, b: Self::A) -> Self::A;
    /// Minimum that propagates NaN.
    fn min(a: Self::A, b: Self::A) -> Self::A;
    fn div_n(a: Self::A, n: usize) -> Self::A;
}

macro_rules! arith {
    ($t:ty, $a:ty, $up:expr, $down:expr) => {
        impl Arith for $t {
            type A = $a;
            #[inline(always)]
            fn up(self) -> $a {
                $up(self)
            }
            #[inline(always)]
            fn down(a: $a) -> Self {
                $down(a)
            }
            #[inline(always)]
            fn add(a: $a, b: $a) -> $a {
                a + b
            }
            #[inline(always)]
            fn mul(a: $a, b: $a) -> $a {
                a * b
            }
            #[inline(always)]
            fn max(a: $a, b: $a) -> $a {
                if a >= b || a.is_nan() {
                    a
                } else {
                    b
                }
            }
            #[inline(always)]
            fn min(a: $a, b: $a) -> $a {
                if a <= b || a.is_nan() {
                    a
                } else {
                    b
                }
            }
            #[inline(always)]
            fn div_n(a: $a, n: usize) -> $a {
                a / (n as $a)
            }
        }
    };
}

arith!(f32, f32, |x| x, |a| a);
arith!(f64, f64, |x| x, |a| a);
arith!(bf16, f32, bf16::to_f32, bf16::from_f32);
arith!(f16, f32, f16::to_f32, f16::from_f32);

/// Checks that `T`'s layout is that of the concrete type its `DTYPE` names,
/// so the kernels may reinterpret its buffers. Fails only for a foreign
/// `Element` implementation that lies about its `DTYPE`.
pub(super) fn check_layout<T: Element>(op: &'static str) -> Result<()> {
    let (size, align) = match T::DTYPE {
        DType::F32 => (4, std::mem::align_of::<f32>()),
        DType::F64 => (8, std::mem::align_of::<f64>()),
        DType::BF16 | DType::F16 => (2, 2),
    };
    if std::mem::size_of::<T>() == size && std::mem::align_of::<T>() >= align {
        Ok(())
    } else {
        Err(Error::Unsupported {
            op,
            detail: format!(
                "element type {} claims dtype {} but has a different layout",
                std::any::type_name::<T>(),
                T::DTYPE
            ),
        })
    }
}

/// Reduces elements `[src_off, src_off + len)` of every `srcs[k]`, in rank
/// order, and writes the result to `[dst_off, dst_off + len)` of every
/// `dsts[k]`. `Avg` divides the sum by `world_size` in the accumulator.
///
/// # Safety
/// `check_layout::<T>()` succeeded; every pointer is aligned for `T`; every
/// source is valid for reads and every destination for writes of the given
/// range; no other thread accesses those ranges during the call. A source
/// range may be the same memory as a destination range (in-place
/// all-reduce), but ranges must not otherwise overlap.
pub(super) unsafe fn reduce<T: Element>(
    srcs: &[*const u8],
    src_off: usize,
    dsts: &[*mut u8],
    dst_off: usize,
    len: usize,
    op: ReduceOp,
    world_size: usize,
) {
    // SAFETY: forwarded; the layout check makes T and the concrete type
    // interchangeable (both are Pod of the same size, T at least as aligned).
    unsafe {
        match T::DTYPE {
            DType::F32 => reduce_typed::<f32>(srcs, src_off, dsts, dst_off, len, op, world_size),
            DType::F64 => reduce_typed::<f64>(srcs, src_off, dsts, dst_off, len, op, world_size),
            DType::BF16 => reduce_typed::<bf16>(srcs, src_off, dsts, dst_off, len, op, world_size),
            DType::F16 => reduce_typed::<f16>(srcs, src_off, dsts, dst_off, len, op, world_size),
        }
    }
}

/// # Safety
/// As [`reduce`], with `E` the concrete type.
unsafe fn reduce_typed<E: Arith>(
    srcs: &[*const u8],
    src_off: usize,
    dsts: &[*mut u8],
    dst_off: usize,
    len: usize,
    op: ReduceOp,
    world_size: usize,
) {
    // SAFETY: forwarded.
    unsafe {
        match op {
            ReduceOp::Sum => combine::<E, _>(srcs, src_off, dsts, dst_off, len, E::add, None),
            ReduceOp::Avg => {
                combine::<E, _>(srcs, src_off, dsts, dst_off, len, E::add, Some(world_size))
            }
            ReduceOp::Max => combine::<E, _>(srcs, src_off, dsts, dst_off, len, E::max, None),
            ReduceOp::Min => combine::<E, _>(srcs, src_off, dsts, dst_off, len, E::min, None),
            ReduceOp::Product => combine::<E, _>(srcs, src_off, dsts, dst_off, len, E::mul, None),
        }
    }
}

/// # Safety
/// As [`reduce`].
#[inline(always)]
unsafe fn combine<E: Arith, F: Fn(E::A, E::A) -> E::A>(
    srcs: &[*const u8],
    src_off: usize,
    dsts: &[*mut u8],
    dst_off: usize,
    len: usize,
    f: F,
    divide_by: Option<usize>,
) {
    let Some((&first, rest)) = srcs.split_first() else {
        return;
    };
    let mut acc_block = [E::A::default(); BLOCK];
    let mut start = 0;
    while start < len {
        let m = BLOCK.min(len - start);
        let acc = &mut acc_block[..m];
        // Each slice below lives only inside its statement block, so a
        // source and a destination that share memory are never borrowed at
        // the same time.
        {
            // SAFETY: in bounds and readable per the contract; E is aligned.
            let s =
                unsafe { std::slice::from_raw_parts((first as *const E).add(src_off + start), m) };
            for (a, &x) in acc.iter_mut().zip(s) {
                *a = x.up();
            }
        }
        for &src in rest {
            // SAFETY: as above.
            let s =
                unsafe { std::slice::from_raw_parts((src as *const E).add(src_off + start), m) };
            for (a, &x) in acc.iter_mut().zip(s) {
                *a = f(*a, x.up());
            }
        }
        if let Some(n) = divide_by {
            for a in acc.iter_mut() {
                *a = E::div_n(*a, n);
            }
        }
        for &dst in dsts {
            // SAFETY: in bounds and writable per the contract; no source
            // slice is alive.
            let d =
                unsafe { std::slice::from_raw_parts_mut((dst as *mut E).add(dst_off + start), m) };
            for (y, &a) in d.iter_mut().zip(acc.iter()) {
                *y = E::down(a);
            }
        }
        start += m;
    }
}
