//! The Linear layer's three bf16 products on the CPU, a slice of the
//! weight at a time, so that no f32 copy of a whole weight exists.
//!
//! candle-core 0.11 has no bf16 matmul kernel on the CPU: it widens both
//! operands' whole storages to f32, multiplies in f32 and rounds the
//! product back. For a layer that is an f32 copy of the weight in the
//! forward and in the input gradient, and an f32 weight gradient before its
//! bf16 one, each twice the bf16 weight: under f32 master weights those
//! copies set the process's peak. Here the same f32 multiplications (the
//! same CPU matmul of Candle, on f32 storages) run over slices of the
//! weight's rows or columns, and each slice's product is rounded into the
//! bf16 result as it comes.
//!
//! The results are bitwise Candle's. gemm computes each output element as
//! one dot product over `k` in blocks whose length depends on `k` only;
//! splitting `m` or `n` changes which tiles an element falls in, not its
//! arithmetic, as long as the pieces take gemm's general path when the
//! whole product does: gemm treats products of at most 64 x 64, of at most
//! 256 elements, or with one row or column, with other kernels. So slices
//! are at least [`MIN_SLICE`] wide, the last one takes the remainder, and a
//! product with one row (or column) is not sliced. The tests below check
//! the bits against Candle's own bf16 matmul.

use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, Device, Layout, Result, Shape, Storage, Tensor};
use half::bf16;
use half::slice::HalfFloatSliceExt;
use std::ops::Range;

/// About this many bytes of f32 per widened slice.
const SLICE_BYTES: usize = 1 << 20;
/// The fewest rows or columns in a slice (see the module doc: with at least
/// two rows, a slice this wide is past gemm's small-product kernels).
const MIN_SLICE: usize = 192;

/// How many rows (or columns) of length `len` make one slice.
fn slice_len(len: usize) -> usize {
    (SLICE_BYTES / 4 / len.max(1)).max(MIN_SLICE) / 64 * 64
}

/// `0..n` in slices of `len`, the last one taking the remainder (so none
/// is shorter than `len`); one slice when `n < 2 * len`.
fn slices(n: usize, len: usize) -> impl Iterator<Item = Range<usize>> {
    let count = (n / len.max(1)).max(1);
    (0..count).map(move |i| {
        let start = i * len;
        let end = if i + 1 == count { n } else { start + len };
        start..end
    })
}

/// Candle's CPU matmul of two f32 storages, as a vector.
fn matmul_f32(
    lhs: &CpuStorage,
    lhs_layout: &Layout,
    rhs: &CpuStorage,
    rhs_layout: &Layout,
    bmnk: (usize, usize, usize, usize),
) -> Result<Vec<f32>> {
    match lhs.matmul(rhs, bmnk, lhs_layout, rhs_layout)? {
        CpuStorage::F32(v) => Ok(v),
        other => bail!(
            "zero-candle bf16 matmul: an f32 product came out as {:?}",
            other.dtype()
        ),
    }
}

/// The bf16 elements of a contiguous 2-d CPU tensor with its dims.
fn bf16_matrix<R>(
    t: &Tensor,
    f: impl FnOnce(&[bf16], (usize, usize)) -> Result<R>,
) -> Result<Option<R>> {
    let (storage, layout) = t.storage_and_layout();
    let (Storage::Cpu(CpuStorage::BF16(data)), Some((start, end)), [a, b]) = (
        &*storage,
        layout.contiguous_offsets(),
        layout.shape().dims(),
    ) else {
        return Ok(None);
    };
    f(&data[start..end], (*a, *b)).map(Some)
}

/// Two 2-d CPU storages as their contiguous bf16 elements with their
/// dims; `None` when either is not that.
#[allow(clippy::type_complexity)]
fn bf16_matrices<'a>(
    storages: [(&'a CpuStorage, &Layout); 2],
) -> Result<Option<[(&'a [bf16], (usize, usize)); 2]>> {
    let [(a, a_layout), (b, b_layout)] = storages;
    let (CpuStorage::BF16(a), CpuStorage::BF16(b)) = (a, b) else {
        return Ok(None);
    };
    let (Some((a_start, a_end)), Some((b_start, b_end))) =
        (a_layout.contiguous_offsets(), b_layout.contiguous_offsets())
    else {
        return Ok(None);
    };
    Ok(Some([
        (&a[a_start..a_end], a_layout.shape().dims2()?),
        (&b[b_start..b_end], b_layout.shape().dims2()?),
    ]))
}

/// `x·Wᵀ` for `x` `[rows, in]` and `W` `[out, in]`, both bf16 and
/// contiguous: `[rows, out]`, a slice of `W`'s rows at a time. `None`
/// when the storages are not that (the caller takes Candle's matmul).
pub(super) fn xwt(
    x: &CpuStorage,
    x_layout: &Layout,
    w: &CpuStorage,
    w_layout: &Layout,
) -> Result<Option<(CpuStorage, usize, usize)>> {
    let Some([(x, (rows, in_dim)), (w, (out_dim, w_in))]) =
        bf16_matrices([(x, x_layout), (w, w_layout)])?
    else {
        return Ok(None);
    };
    if in_dim != w_in {
        return Ok(None);
    }
    let x32 = CpuStorage::F32(x.to_f32_vec());
    let x32_layout = Layout::contiguous((rows, in_dim));
    let len = if rows > 1 { slice_len(in_dim) } else { out_dim };
    let mut out = vec![bf16::ZERO; rows * out_dim];
    for cols in slices(out_dim, len) {
        let w32 = CpuStorage::F32(w[cols.start * in_dim..cols.end * in_dim].to_f32_vec());
        let w32_layout = Layout::contiguous((cols.len(), in_dim)).transpose(0, 1)?;
        let bmnk = (1, rows, cols.len(), in_dim);
        let y = matmul_f32(&x32, &x32_layout, &w32, &w32_layout, bmnk)?;
        for (row, y) in out
            .chunks_exact_mut(out_dim)
            .zip(y.chunks_exact(cols.len()))
        {
            row[cols.clone()].convert_from_f32_slice(y);
        }
    }
    Ok(Some((CpuStorage::BF16(out), rows, out_dim)))
}

/// Rows `outs` of `∂W = gᵀ·x` for `g` `[rows, out]` and `x` `[rows, in]`,
/// both bf16, contiguous, on the CPU: `[outs.len(), in]`, a slice of its
/// rows at a time (no f32 copy of the whole gradient). `None` when the
/// tensors are not that.
pub(super) fn grad_weight(g: &Tensor, x: &Tensor, outs: Range<usize>) -> Result<Option<Tensor>> {
    let out = bf16_matrix(g, |g, (rows, out_dim)| {
        bf16_matrix(x, |x, (x_rows, in_dim)| {
            if x_rows != rows {
                bail!("zero-candle Linear: {x_rows} input rows for {rows} gradient rows")
            }
            if outs.end > out_dim {
                bail!("zero-candle Linear: rows {outs:?} of a gradient of {out_dim}")
            }
            let g32 = CpuStorage::F32(g.to_f32_vec());
            let x32 = CpuStorage::F32(x.to_f32_vec());
            let gt_layout = Layout::contiguous((rows, out_dim)).transpose(0, 1)?;
            let x32_layout = Layout::contiguous((rows, in_dim));
            let len = if in_dim > 1 {
                slice_len(in_dim)
            } else {
                outs.len()
            };
            let mut grad = vec![bf16::ZERO; outs.len() * in_dim];
            for part in slices(outs.len(), len) {
                let lhs_layout = gt_layout.narrow(0, outs.start + part.start, part.len())?;
                let bmnk = (1, part.len(), in_dim, rows);
                let y = matmul_f32(&g32, &lhs_layout, &x32, &x32_layout, bmnk)?;
                grad[part.start * in_dim..part.end * in_dim].convert_from_f32_slice(&y);
            }
            Tensor::from_vec(grad, (outs.len(), in_dim), &Device::Cpu)
        })
    })?;
    Ok(out.flatten())
}

/// Blocks of the `out` rows of a weight gradient with rows of `in_dim`
/// elements of `size` bytes, each of about `bytes` (never fewer than
/// [`MIN_SLICE`] rows, so each block's product is bitwise that block of
/// the whole product; see the module doc): the gradient a block at a time.
pub(super) fn row_blocks(
    out: usize,
    in_dim: usize,
    size: usize,
    bytes: usize,
) -> Vec<Range<usize>> {
    if in_dim <= 1 {
        return vec![Range { start: 0, end: out }];
    }
    let len = (bytes / size.max(1) / in_dim).max(MIN_SLICE) / 64 * 64;
    slices(out, len).collect()
}

/// `∂x = g·W` for `g` `[rows, out]` and `W` `[out, in]`, both bf16,
/// contiguous, on the CPU: `[rows, in]`, a slice of `W`'s columns at a
/// time (no f32 copy of the whole weight). `None` when the tensors are not
/// that.
pub(super) fn grad_input(g: &Tensor, w: &Tensor) -> Result<Option<Tensor>> {
    let out = bf16_matrix(g, |g, (rows, out_dim)| {
        bf16_matrix(w, |w, (w_out, in_dim)| {
            if w_out != out_dim {
                bail!("zero-candle Linear: a gradient of {out_dim} outputs for a weight of {w_out}")
            }
            let grad = grad_input_slices(g, rows, w, (out_dim, in_dim))?;
            Tensor::from_vec(grad, (rows, in_dim), &Device::Cpu)
        })
    })?;
    Ok(out.flatten())
}

/// [`grad_input`] on storages (stage 3's gathered weight): `g`
/// `[rows, out]` and `W` `[out, in]`, both bf16 and contiguous; `None`
/// when they are not that.
pub(super) fn grad_input_storage(
    g: &CpuStorage,
    g_layout: &Layout,
    w: &CpuStorage,
    w_layout: &Layout,
) -> Result<Option<(CpuStorage, Shape)>> {
    let Some([(g, (rows, out_dim)), (w, (w_out, in_dim))]) =
        bf16_matrices([(g, g_layout), (w, w_layout)])?
    else {
        return Ok(None);
    };
    if w_out != out_dim {
        bail!("zero-candle Linear: a gradient of {out_dim} outputs for a weight of {w_out}")
    }
    let grad = grad_input_slices(g, rows, w, (out_dim, in_dim))?;
    Ok(Some((CpuStorage::BF16(grad), Shape::from((rows, in_dim)))))
}

/// `g·W` for `g` `[rows, out]` and `W` `[out, in]` (bf16 slices), a slice
/// of `W`'s columns at a time, as `[rows, in]`.
fn grad_input_slices(
    g: &[bf16],
    rows: usize,
    w: &[bf16],
    (out_dim, in_dim): (usize, usize),
) -> Result<Vec<bf16>> {
    let g32 = CpuStorage::F32(g.to_f32_vec());
    let g32_layout = Layout::contiguous((rows, out_dim));
    let len = if rows > 1 { slice_len(out_dim) } else { in_dim };
    let mut grad = vec![bf16::ZERO; rows * in_dim];
    let mut w32 = Vec::new();
    for cols in slices(in_dim, len) {
        w32.clear();
        for row in w.chunks_exact(in_dim) {
            w32.extend(row[cols.clone()].iter().map(|v| v.to_f32()));
        }
        let w32_storage = CpuStorage::F32(std::mem::take(&mut w32));
        let w32_layout = Layout::contiguous((out_dim, cols.len()));
        let bmnk = (1, rows, cols.len(), out_dim);
        let y = matmul_f32(&g32, &g32_layout, &w32_storage, &w32_layout, bmnk)?;
        if let CpuStorage::F32(v) = w32_storage {
            w32 = v;
        }
        for (row, y) in grad
            .chunks_exact_mut(in_dim)
            .zip(y.chunks_exact(cols.len()))
        {
            row[cols.clone()].convert_from_f32_slice(y);
        }
    }
    Ok(grad)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::DType;

    fn bf16_tensor(seed: u64, dims: (usize, usize)) -> Tensor {
        // A small LCG: values in ±2 with every mantissa bit in use.
        let mut state = seed.wrapping_mul(6364136223846793005).wrapping_add(1);
        let values: Vec<f32> = (0..dims.0 * dims.1)
            .map(|_| {
                state = state
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((state >> 33) as f32 / (1u64 << 31) as f32) * 4.0 - 2.0
            })
            .collect();
        Tensor::from_vec(values, dims, &Device::Cpu)
            .and_then(|t| t.to_dtype(DType::BF16))
            .expect("a CPU tensor")
    }

    fn bits(t: &Tensor) -> Vec<u16> {
        t.flatten_all()
            .and_then(|t| t.to_vec1::<bf16>())
            .expect("bf16 values")
            .iter()
            .map(|v| v.to_bits())
            .collect()
    }

    /// Shapes around every threshold: one row, the small-product kernels,
    /// a slice count of one and two, a remainder.
    const SHAPES: [(usize, usize, usize); 11] = [
        (1, 7, 5),
        (2, 64, 65),
        (3, 300, 100),
        (8, 384, 2),
        (8, 2, 500),
        (5, 1000, 450),
        (17, 700, 1300),
        (1, 900, 800),
        (8, 2048, 520),
        (2, 600, 1500),
        (4, 1000, 2048),
    ];

    #[test]
    fn products_are_candles_bit_for_bit() {
        for (i, &(rows, out_dim, in_dim)) in SHAPES.iter().enumerate() {
            let seed = 3 * i as u64;
            let x = bf16_tensor(seed, (rows, in_dim));
            let w = bf16_tensor(seed + 1, (out_dim, in_dim));
            let g = bf16_tensor(seed + 2, (rows, out_dim));
            let shape = format!("rows {rows}, out {out_dim}, in {in_dim}");

            let (xs, xl) = x.storage_and_layout();
            let (ws, wl) = w.storage_and_layout();
            let (Storage::Cpu(xs), Storage::Cpu(ws)) = (&*xs, &*ws) else {
                unreachable!("CPU tensors")
            };
            let Some((CpuStorage::BF16(y), _, _)) = xwt(xs, xl, ws, wl).unwrap() else {
                panic!("bf16 operands give a bf16 product")
            };
            let y = Tensor::from_vec(y, (rows, out_dim), &Device::Cpu).unwrap();
            let reference = x.matmul(&w.t().unwrap()).unwrap();
            assert_eq!(bits(&y), bits(&reference), "x·Wᵀ, {shape}");

            let dw = grad_weight(&g, &x, 0..out_dim)
                .unwrap()
                .expect("bf16 operands");
            let reference = g.t().unwrap().matmul(&x).unwrap();
            assert_eq!(bits(&dw), bits(&reference), "gᵀ·x, {shape}");
            for rows in row_blocks(out_dim, in_dim, 2, 64 << 10) {
                let block = grad_weight(&g, &x, rows.clone()).unwrap().expect("bf16");
                let reference = reference.narrow(0, rows.start, rows.len()).unwrap();
                assert_eq!(
                    bits(&block),
                    bits(&reference),
                    "gᵀ·x rows {rows:?}, {shape}"
                );
            }

            let dx = grad_input(&g, &w).unwrap().expect("bf16 operands");
            let reference = g.matmul(&w).unwrap();
            assert_eq!(bits(&dx), bits(&reference), "g·W, {shape}");
        }
    }

    #[test]
    fn slices_cover_the_range_and_none_is_short() {
        for n in [0, 1, 191, 192, 383, 384, 1000] {
            let all: Vec<Range<usize>> = slices(n, 192).collect();
            assert_eq!(all.first().map(|r| r.start), Some(0));
            assert_eq!(all.last().map(|r| r.end), Some(n));
            assert!(all.windows(2).all(|p| p[0].end == p[1].start));
            assert!(all.len() == 1 || all.iter().all(|r| r.len() >= 192), "{n}");
        }
    }

    #[test]
    fn other_dtypes_are_left_to_candle() {
        let x = Tensor::zeros((2, 3), DType::F32, &Device::Cpu).unwrap();
        assert!(grad_weight(&x, &x, 0..3).unwrap().is_none());
    }
}
