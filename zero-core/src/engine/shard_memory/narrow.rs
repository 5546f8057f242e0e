//! 16-bit values on the wire: the host's narrowed collectives and the
//! packing of 16-bit values into a wider buffer.

use crate::comm::{Communicator, Host, ReduceOp};
use crate::dtype::convert_slice;
use crate::{DType, Element, Result};
use half::{bf16, f16};

/// `values` rounded to `L` (to nearest).
fn narrowed<T: Element, L: Element>(values: &[T]) -> Vec<L> {
    let mut narrow = vec![L::default(); values.len()];
    convert_slice(values, &mut narrow);
    narrow
}

/// Elements of `T` that `n` packed 16-bit values take ([`pack_narrow`]).
pub fn packed_len<T>(n: usize) -> usize {
    (2 * n).div_ceil(std::mem::size_of::<T>())
}

/// Rounds `values` to the 16-bit dtype `wire` and packs them into the
/// first [`packed_len`] elements of `out` (their memory holds the 16-bit
/// values in order): what offload's write-back sends up for a 16-bit
/// model, half the bytes of f32 masters.
///
/// # Panics
/// If `wire` is not 16-bit, or `out` is shorter than `values`.
pub fn pack_narrow<T: Element>(values: &[T], wire: DType, out: &mut [T]) {
    match wire {
        DType::BF16 => convert_slice(values, as_narrow_mut::<T, bf16>(out, values.len())),
        DType::F16 => convert_slice(values, as_narrow_mut::<T, f16>(out, values.len())),
        other => panic!("pack_narrow to {other:?}: not a 16-bit dtype"),
    }
}

/// The first `n` 16-bit values in `packed`'s memory, as `L`.
fn as_narrow<T, L: Element>(packed: &[T], n: usize) -> &[L] {
    assert!(std::mem::size_of::<L>() == 2 && packed_len::<T>(n) <= packed.len());
    // SAFETY: within `packed`'s memory (checked above); `L` is a 16-bit
    // plain-data type, aligned to 2, and `T` (an element) to at least 2.
    unsafe { std::slice::from_raw_parts(packed.as_ptr().cast::<L>(), n) }
}

/// [`as_narrow`], writable.
fn as_narrow_mut<T, L: Element>(packed: &mut [T], n: usize) -> &mut [L] {
    assert!(std::mem::size_of::<L>() == 2 && packed_len::<T>(n) <= packed.len());
    // SAFETY: as in `as_narrow`, and `packed` is borrowed mutably.
    unsafe { std::slice::from_raw_parts_mut(packed.as_mut_ptr().cast::<L>(), n) }
}

/// All-gathers the `n` values packed in `send` as `L` into `recv`, widened.
pub(super) fn gather_packed<T: Element, L: Element, C: Communicator<Memory = Host>>(
    comm: &C,
    send: &[T],
    n: usize,
    recv: &mut [T],
) -> Result<()> {
    let mut narrow = vec![L::default(); recv.len()];
    comm.all_gather(as_narrow::<T, L>(send, n), &mut narrow)?;
    convert_slice(&narrow, recv);
    Ok(())
}

/// All-reduces `buffer` rounded to `L`, and widens the result back.
pub(super) fn all_reduce_narrow<T: Element, L: Element, C: Communicator<Memory = Host>>(
    comm: &C,
    buffer: &mut [T],
    op: ReduceOp,
) -> Result<()> {
    let mut narrow: Vec<L> = narrowed(buffer);
    comm.all_reduce(&mut narrow, op)?;
    convert_slice(&narrow, buffer);
    Ok(())
}

/// Reduce-scatters `send` rounded to `L` into `recv`, widened back.
pub(super) fn reduce_scatter_narrow<T: Element, L: Element, C: Communicator<Memory = Host>>(
    comm: &C,
    send: &[T],
    recv: &mut [T],
    op: ReduceOp,
) -> Result<()> {
    let narrow: Vec<L> = narrowed(send);
    let mut narrow_recv = vec![L::default(); recv.len()];
    comm.reduce_scatter(&narrow, &mut narrow_recv, op)?;
    convert_slice(&narrow_recv, recv);
    Ok(())
}

/// All-gathers `send` as `L` (rounded to nearest) and widens what arrives
/// back into `recv`. The narrow values are received into the tail of
/// `recv`'s own bytes and widened front to back in place (element `i` is
/// read before anything is written over it, since `T` is at least as wide
/// as `L`), so the gather needs no bucket-sized buffer of its own.
pub(super) fn gather_narrow<T: Element, L: Element, C: Communicator<Memory = Host>>(
    comm: &C,
    send: &[T],
    recv: &mut [T],
) -> Result<()> {
    let narrow_send: Vec<L> = narrowed(send);
    let (wide, narrow) = (std::mem::size_of::<T>(), std::mem::size_of::<L>());
    let len = recv.len();
    let bytes: &mut [u8] = bytemuck::cast_slice_mut(recv);
    let tail = len * (wide - narrow);
    match bytemuck::try_cast_slice_mut::<u8, L>(&mut bytes[tail..]) {
        Ok(narrow_recv) => comm.all_gather(&narrow_send, narrow_recv)?,
        // Not aligned for `L` (never for the f32/bf16 pairs used): a buffer.
        Err(_) => {
            let mut narrow_recv = vec![L::default(); len];
            comm.all_gather(&narrow_send, &mut narrow_recv)?;
            let recv: &mut [T] = bytemuck::cast_slice_mut(bytes);
            convert_slice(&narrow_recv, recv);
            return Ok(());
        }
    }
    for i in 0..len {
        let at = tail + i * narrow;
        let value: L = bytemuck::pod_read_unaligned(&bytes[at..at + narrow]);
        let value = T::from_f64(value.to_f64());
        bytes[i * wide..(i + 1) * wide].copy_from_slice(bytemuck::bytes_of(&value));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Packed values are the rounded ones, in order, from the start of the
    /// buffer's memory, for any wider element; the rest is left alone.
    #[test]
    fn packing_rounds_each_value_into_the_buffers_first_bytes() {
        let values: Vec<f64> = vec![0.5, 1.0 + 1.0 / 512.0, -2.71, 1e-3, 65504.0];
        let mut out = vec![7.0f64; 4];
        pack_narrow(&values, DType::BF16, &mut out);
        assert_eq!(packed_len::<f64>(values.len()), 2);
        let packed = as_narrow::<f64, bf16>(&out, values.len());
        for (got, v) in packed.iter().zip(&values) {
            assert_eq!(*got, bf16::from_f64(*v));
        }
        assert_eq!(out[2..], [7.0, 7.0], "past the packed values");
        let values: Vec<f32> = vec![0.1, -2.5, 1e-5];
        let mut out = vec![0f32; 3];
        pack_narrow(&values, DType::F16, &mut out);
        assert_eq!(packed_len::<f32>(values.len()), 2);
        let packed = as_narrow::<f32, f16>(&out, values.len());
        for (got, v) in packed.iter().zip(&values) {
            assert_eq!(*got, f16::from_f32(*v));
        }
    }

    /// A chunk too short for the values it is said to hold is an error,
    /// not a read past it.
    #[test]
    fn a_packed_gather_from_too_short_a_chunk_is_an_error() {
        let errors = crate::ThreadGroup::new(1).run(|comm| {
            let (send, mut recv) = (vec![0f32; 2], vec![0f32; 5]);
            crate::engine::PackedGathers::<_, Vec<f32>>::all_gather_packed(
                &mut crate::engine::HostMemory,
                &comm,
                &send,
                5,
                &mut recv,
                0..5,
                DType::BF16,
            )
            .expect_err("5 values in 2 elements")
            .to_string()
        });
        let error = errors[0].as_ref().expect("the rank ran");
        assert!(error.contains("all_gather_packed"), "{error}");
    }
}
