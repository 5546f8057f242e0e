//! The norms' CPU kernels: a row at a time, statistics in `T::Acc` (f32
//! for 16-bit inputs).

use super::super::elem::{Accum, Elem};
use super::NormScalars;
use candle_core::CpuStorage;

/// A row's mean (zero without `remove_mean`) and `1/√(var + eps)`, the
/// variance taken around the mean in a second pass (no `E[x²] - mean²`
/// cancellation).
fn row_stats<T: Elem>(row: &[T], eps: T::Acc, remove_mean: bool) -> (T::Acc, T::Acc) {
    let n = T::Acc::cast(row.len() as f64);
    let mean = if remove_mean {
        let mut sum = T::Acc::ZERO;
        for &v in row {
            sum += v.acc();
        }
        sum / n
    } else {
        T::Acc::ZERO
    };
    let mut sum_sq = T::Acc::ZERO;
    for &v in row {
        let centered = v.acc() - mean;
        sum_sq += centered * centered;
    }
    (mean, T::Acc::ONE / (sum_sq / n + eps).sqrt())
}

/// The per-column scale of the output, `weight_offset + w`, in `T::Acc`:
/// computed once per call, read by every row.
fn scales<T: Elem>(weight: &[T], weight_offset: f64) -> Vec<T::Acc> {
    let offset = T::Acc::cast(weight_offset);
    weight.iter().map(|&w| w.acc() + offset).collect()
}

/// `y = (x - mean)·rstd·(offset + w) + b` per row of `weight.len()`
/// elements.
pub(super) fn norm_forward<T: Elem>(
    x: &[T],
    weight: &[T],
    bias: Option<&[T]>,
    scalars: NormScalars,
) -> Vec<T> {
    let eps = T::Acc::cast(scalars.eps);
    let scale = scales(weight, scalars.weight_offset);
    let mut y = Vec::with_capacity(x.len());
    for row in x.chunks_exact(weight.len()) {
        normalize_row(row, &scale, bias, eps, scalars.remove_mean, &mut y);
    }
    y
}

/// `h = x + residual` (rounded to `T`, as Candle's add rounds it) and
/// `y` its [`norm_forward`], as storages, a row at a time: each row of `h`
/// is normalized while it is in cache.
pub(super) fn residual_norm_forward<T: Elem>(
    x: &[T],
    residual: &[T],
    weight: &[T],
    bias: Option<&[T]>,
    scalars: NormScalars,
) -> (CpuStorage, CpuStorage) {
    let eps = T::Acc::cast(scalars.eps);
    let scale = scales(weight, scalars.weight_offset);
    let size = weight.len();
    let mut h = Vec::with_capacity(x.len());
    let mut y = Vec::with_capacity(x.len());
    for (x_row, residual_row) in x.chunks_exact(size).zip(residual.chunks_exact(size)) {
        let start = h.len();
        h.extend(
            x_row
                .iter()
                .zip(residual_row)
                .map(|(&a, &b)| T::from_acc(a.acc() + b.acc())),
        );
        normalize_row(&h[start..], &scale, bias, eps, scalars.remove_mean, &mut y);
    }
    (T::to_cpu_storage_owned(h), T::to_cpu_storage_owned(y))
}

/// One row of [`norm_forward`], appended to `y`, with `scale` the
/// [`scales`] of the weight.
fn normalize_row<T: Elem>(
    row: &[T],
    scale: &[T::Acc],
    bias: Option<&[T]>,
    eps: T::Acc,
    remove_mean: bool,
    y: &mut Vec<T>,
) {
    let (mean, rstd) = row_stats(row, eps, remove_mean);
    match bias {
        Some(bias) => y.extend(
            row.iter()
                .zip(scale)
                .zip(bias)
                .map(|((&v, &s), &b)| T::from_acc((v.acc() - mean) * rstd * s + b.acc())),
        ),
        None => y.extend(
            row.iter()
                .zip(scale)
                .map(|(&v, &s)| T::from_acc((v.acc() - mean) * rstd * s)),
        ),
    }
}

/// The gradients of [`norm_forward`] given the output gradient `grad`:
/// `∂x` (when `want_x`), and `∂w`, `∂b` accumulated over rows in `T::Acc`.
///
/// With `x̂ = (x - mean)·rstd` and `ĝ = g·(offset + w)` per row of `n`:
/// `∂x = rstd·(ĝ - mean(ĝ) - x̂·mean(ĝ·x̂))` (no `mean(ĝ)` term for RMS),
/// `∂w = Σ_rows g·x̂` (the offset is a constant), `∂b = Σ_rows g`.
#[allow(clippy::type_complexity)]
pub(super) fn norm_backward<T: Elem>(
    x: &[T],
    weight: &[T],
    grad: &[T],
    scalars: NormScalars,
    want_x: bool,
) -> (Option<Vec<T>>, Vec<T::Acc>, Vec<T::Acc>) {
    let size = weight.len();
    let n = T::Acc::cast(size as f64);
    let eps = T::Acc::cast(scalars.eps);
    let remove_mean = scalars.remove_mean;
    let scale = scales(weight, scalars.weight_offset);
    let mut grad_x = want_x.then(|| Vec::with_capacity(x.len()));
    let mut grad_weight = vec![T::Acc::ZERO; size];
    let mut grad_bias = vec![T::Acc::ZERO; size];
    for (row, grad_row) in x.chunks_exact(size).zip(grad.chunks_exact(size)) {
        let (mean, rstd) = row_stats(row, eps, remove_mean);
        let mut sum_g_hat = T::Acc::ZERO;
        let mut sum_g_hat_x_hat = T::Acc::ZERO;
        for j in 0..size {
            let x_hat = (row[j].acc() - mean) * rstd;
            let g = grad_row[j].acc();
            let g_hat = g * scale[j];
            sum_g_hat += g_hat;
            sum_g_hat_x_hat += g_hat * x_hat;
            grad_weight[j] += g * x_hat;
            grad_bias[j] += g;
        }
        if let Some(grad_x) = grad_x.as_mut() {
            let mean_g_hat = if remove_mean {
                sum_g_hat / n
            } else {
                T::Acc::ZERO
            };
            let mean_g_hat_x_hat = sum_g_hat_x_hat / n;
            grad_x.extend((0..size).map(|j| {
                let x_hat = (row[j].acc() - mean) * rstd;
                let g_hat = grad_row[j].acc() * scale[j];
                T::from_acc(rstd * (g_hat - mean_g_hat - x_hat * mean_g_hat_x_hat))
            }));
        }
    }
    (grad_x, grad_weight, grad_bias)
}
