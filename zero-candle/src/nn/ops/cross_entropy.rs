//! Cross-entropy from logits (log-softmax and the negative log-likelihood)
//! as one op.

use super::super::cpu;
use super::super::elem::{dispatch_float, Accum, Elem};
use super::super::storage::{tensor_from, with_cuda, Saved, SavedSlot};
use super::cuda;
use candle_core::backend::BackendStorage;
use candle_core::{
    bail, CpuStorage, CudaStorage, CustomOp2, DType, Layout, Result, Shape, Storage, Tensor,
    WithDType,
};
use rayon::prelude::*;

/// The mean cross-entropy of `logits` `[rows, classes]` against the class
/// indices `targets` `[rows]` (u32 or i64), as
/// `candle_nn::loss::cross_entropy`, in one op.
///
/// The forward keeps one statistic per row (its log-sum-exp) instead of the
/// log-softmax; the backward writes `(softmax - one_hot) / rows · grad` in
/// one pass. The loss is f32 for f32, bf16 and f16 logits (16-bit logits
/// are read in f32, as autocast does), f64 for f64. A target outside
/// `0..classes` (and not ignored) is an error naming the row on the CPU; on
/// CUDA, which could only check it by waiting for the GPU, it makes the
/// loss and that row's gradient NaN (never a read out of bounds).
///
/// ```
/// use candle_core::{Device, Tensor};
/// # fn main() -> candle_core::Result<()> {
/// let logits = Tensor::new(&[[2f32, 0.0, 0.0], [0.0, 0.0, 0.0]], &Device::Cpu)?;
/// let targets = Tensor::new(&[0u32, 2], &Device::Cpu)?;
/// let loss = zero_candle::nn::ops::cross_entropy(&logits, &targets)?;
/// let want = candle_nn::loss::cross_entropy(&logits, &targets)?;
/// assert!((loss.to_scalar::<f32>()? - want.to_scalar::<f32>()?).abs() < 1e-6);
/// # Ok(()) }
/// ```
pub fn cross_entropy(logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
    apply(logits, targets, None)
}

/// [`cross_entropy`] over the rows whose target is not `ignore_index`
/// (PyTorch's `ignore_index`, often -100 or a padding id): they add
/// nothing to the loss, count nothing in the mean and get a zero gradient.
/// With every row ignored the loss is NaN (0/0), as in PyTorch.
pub fn cross_entropy_with_ignore(
    logits: &Tensor,
    targets: &Tensor,
    ignore_index: i64,
) -> Result<Tensor> {
    apply(logits, targets, Some(ignore_index))
}

fn apply(logits: &Tensor, targets: &Tensor, ignore_index: Option<i64>) -> Result<Tensor> {
    let (rows, classes) = match logits.dims() {
        &[r, c] => (r, c),
        dims => bail!(
            "zero-candle cross_entropy: logits must be [rows, classes], got {dims:?}; flatten \
             the leading dims first (logits.flatten_to(D::Minus2))"
        ),
    };
    if targets.dims() != [rows] {
        bail!(
            "zero-candle cross_entropy: {rows} rows of logits but targets {:?}; pass one class \
             index per row",
            targets.dims()
        );
    }
    if !matches!(targets.dtype(), DType::U32 | DType::I64) {
        bail!(
            "zero-candle cross_entropy: targets must be u32 or i64 class indices, got {:?}",
            targets.dtype()
        );
    }
    if classes == 0 {
        bail!(
            "zero-candle cross_entropy: logits have no classes ({:?})",
            logits.dims()
        );
    }
    logits.contiguous()?.apply_op2(
        &targets.contiguous()?,
        CrossEntropy {
            ignore_index,
            saved: SavedSlot::default(),
        },
    )
}

struct CrossEntropy {
    ignore_index: Option<i64>,
    /// On the CPU: each row's log-sum-exp, then the number of rows counted
    /// (one more element), in the accumulation type. On CUDA: whatever the
    /// kernels keep.
    saved: SavedSlot,
}

const OP: &str = "cross_entropy";

/// The class of each row, or `None` for an ignored row; an error for a
/// class out of range.
fn classes_of(
    targets: &CpuStorage,
    layout: &Layout,
    classes: usize,
    ignore_index: Option<i64>,
) -> Result<Vec<Option<usize>>> {
    let raw: Vec<i64> = match targets {
        CpuStorage::U32(_) => cpu::slice::<u32>(targets, layout, "the targets")?
            .iter()
            .map(|&t| t as i64)
            .collect(),
        _ => cpu::slice::<i64>(targets, layout, "the targets")?.to_vec(),
    };
    raw.into_iter()
        .enumerate()
        .map(|(row, t)| {
            if Some(t) == ignore_index {
                Ok(None)
            } else if (0..classes as i64).contains(&t) {
                Ok(Some(t as usize))
            } else {
                bail!(
                    "zero-candle cross_entropy: row {row} has target {t}, outside 0..{classes}{}",
                    match ignore_index {
                        Some(i) => format!(" and not the ignore index {i}"),
                        None => String::new(),
                    }
                )
            }
        })
        .collect()
}

/// Per row: log-sum-exp, and the loss `lse - logit[target]` (zero when
/// ignored).
fn forward<T: Elem>(
    logits: &[T],
    targets: &[Option<usize>],
    classes: usize,
) -> (Vec<T::Acc>, T::Acc) {
    let per_row: Vec<(T::Acc, T::Acc)> = logits
        .par_chunks(classes)
        .zip(targets.par_iter())
        .map(|(row, target)| {
            let mut max = T::Acc::NEG_INFINITY;
            for &v in row {
                if v.acc() > max {
                    max = v.acc();
                }
            }
            let mut sum = T::Acc::ZERO;
            for &v in row {
                sum += (v.acc() - max).exp();
            }
            let lse = max + sum.ln();
            let loss = match target {
                Some(t) => lse - row[*t].acc(),
                None => T::Acc::ZERO,
            };
            (lse, loss)
        })
        .collect();
    // Summed in row order: the same bits on every thread count.
    let mut total = T::Acc::ZERO;
    let mut saved = Vec::with_capacity(per_row.len() + 1);
    for (lse, loss) in per_row {
        saved.push(lse);
        total += loss;
    }
    let count = targets.iter().filter(|t| t.is_some()).count();
    saved.push(T::Acc::cast(count as f64));
    (saved, total / T::Acc::cast(count as f64))
}

fn backward<T: Elem>(
    logits: &[T],
    targets: &[Option<usize>],
    saved: &[T::Acc],
    grad: T::Acc,
    classes: usize,
) -> Vec<T> {
    let (lse, count) = saved.split_at(targets.len());
    let factor = grad / count[0];
    let mut dlogits = vec![T::from_acc(T::Acc::ZERO); logits.len()];
    dlogits
        .par_chunks_mut(classes)
        .zip(logits.par_chunks(classes))
        .zip(targets.par_iter().zip(lse.par_iter()))
        .for_each(|((d, row), (target, &lse))| {
            let Some(target) = *target else { return };
            for (d, &v) in d.iter_mut().zip(row) {
                *d = T::from_acc(factor * (v.acc() - lse).exp());
            }
            let p = (row[target].acc() - lse).exp();
            d[target] = T::from_acc(factor * (p - T::Acc::ONE));
        });
    dlogits
}

impl CustomOp2 for CrossEntropy {
    fn name(&self) -> &'static str {
        "zero-cross-entropy"
    }

    fn cpu_fwd(
        &self,
        logits: &CpuStorage,
        logits_layout: &Layout,
        targets: &CpuStorage,
        targets_layout: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (_, classes) = logits_layout.shape().dims2()?;
        let targets = classes_of(targets, targets_layout, classes, self.ignore_index)?;
        let (saved, loss) = dispatch_float!(logits.dtype(), OP, |T| {
            let values = cpu::slice::<T>(logits, logits_layout, "the logits")?;
            let (saved, loss) = forward::<T>(values, &targets, classes);
            (
                <T as Elem>::Acc::to_cpu_storage_owned(saved),
                <T as Elem>::Acc::to_cpu_storage_owned(vec![loss]),
            )
        });
        self.saved.put(Saved::Cpu(saved));
        Ok((loss, Shape::from(())))
    }

    fn cuda_fwd(
        &self,
        logits: &CudaStorage,
        logits_layout: &Layout,
        targets: &CudaStorage,
        targets_layout: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        let (loss, saved) = cuda::cross_entropy_forward(
            (logits, logits_layout),
            (targets, targets_layout),
            self.ignore_index,
        )?;
        self.saved.put(Saved::Cuda(saved));
        Ok((loss, Shape::from(())))
    }

    fn bwd(
        &self,
        logits: &Tensor,
        targets: &Tensor,
        _loss: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let shape = logits.shape().clone();
        let (_, classes) = shape.dims2()?;
        let grad = grad.contiguous()?;
        let ignore_index = self.ignore_index;
        let dlogits = self.saved.read(OP, |saved| match saved {
            Saved::Cpu(saved) => {
                let grad = grad.to_dtype(DType::F64)?.to_scalar::<f64>()?;
                let dlogits = cpu::with_cpu(logits, "the logits", |l_storage, l_layout| {
                    cpu::with_cpu(targets, "the targets", |t_storage, t_layout| {
                        let targets = classes_of(t_storage, t_layout, classes, ignore_index)?;
                        Ok(dispatch_float!(l_storage.dtype(), OP, |T| {
                            T::to_cpu_storage_owned(backward::<T>(
                                cpu::slice::<T>(l_storage, l_layout, "the logits")?,
                                &targets,
                                <T as Elem>::Acc::cpu_storage_as_slice(saved)?,
                                <T as Elem>::Acc::cast(grad),
                                classes,
                            ))
                        }))
                    })
                })?;
                Ok(Storage::Cpu(dlogits))
            }
            Saved::Cuda(saved) => {
                let dlogits = with_cuda(logits, "the logits", |l_storage, l_layout| {
                    with_cuda(targets, "the targets", |t_storage, t_layout| {
                        with_cuda(&grad, "the loss gradient", |g_storage, g_layout| {
                            cuda::cross_entropy_backward(
                                (l_storage, l_layout),
                                (t_storage, t_layout),
                                saved,
                                (g_storage, g_layout),
                                ignore_index,
                            )
                        })
                    })
                })?;
                Ok(Storage::Cuda(dlogits))
            }
        })?;
        Ok((Some(tensor_from(dlogits, shape)), None))
    }
}
