//! An embedding lookup and its table's gradient for [`LayerKernels`]
//! (`embedding_*` in embedding.cu). The lookup reads the table a stretch at
//! a time; the gradient puts the lookup's rows in order of their ids, then
//! sums each id's rows in f32, in their order, into its row of the table.
//! Deterministic, no atomics.

use super::{check_len, int_arg, Launch, LayerElement, LayerKernels, TargetIndex};
use crate::{Error, Result};
use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut, PushKernelArg};
use std::ops::Range;
use std::sync::Arc;

impl LayerKernels {
    /// The part of the lookup `out[i] = table[ids[i]]` (`out` `[ids.len(),
    /// dim]`) that `part` holds: `part` is elements `values` of the
    /// row-major `[vocab, dim]` table (the whole table: `0..vocab * dim`),
    /// and every element of `out` taken from those is written. Launched once
    /// per stretch of a table gathered in pieces, `out` is whole once the
    /// stretches cover the table. The rows of ids outside `[0, vocab)` are
    /// NaN, written by every launch.
    #[allow(clippy::too_many_arguments)]
    pub fn embedding_lookup<E: LayerElement, I: TargetIndex>(
        &self,
        stream: &Arc<CudaStream>,
        (vocab, dim): (usize, usize),
        ids: &impl DevicePtr<I>,
        part: &impl DevicePtr<E>,
        values: Range<usize>,
        out: &mut impl DevicePtrMut<E>,
    ) -> Result<()> {
        const OP: &str = "embedding_lookup";
        let n = ids.len();
        lookup_part(OP, (vocab, dim), &values, part.len())?;
        check_len(OP, "out", out.len(), n * dim)?;
        let vocab_arg = vocab_arg(OP, vocab)?;
        let n_arg = i64::from(int_arg(OP, "ids", n)?);
        let dim_arg = int_arg(OP, "the embedding width", dim)?;
        // Within the table's vocab * dim elements, which the 32-bit vocab
        // and int width keep within i64.
        let (first, len) = (values.start as i64, values.len() as i64);
        let Some(cfg) = self.config(
            OP,
            Launch::Segments {
                rows: n,
                columns: dim,
            },
        )?
        else {
            return Ok(());
        };
        let (ids, _g0) = ids.device_ptr(stream);
        let (part, _g1) = part.device_ptr(stream);
        let (out, _g2) = out.device_ptr_mut(stream);
        let mut launch = stream.launch_builder(&self.embedding_lookup[E::INDEX][I::INDEX]);
        launch
            .arg(&ids)
            .arg(&part)
            .arg(&out)
            .arg(&n_arg)
            .arg(&dim_arg)
            .arg(&first)
            .arg(&len)
            .arg(&vocab_arg);
        // SAFETY: ids holds n `I`, out n * dim `E`, part the `len` elements
        // read (at `id * dim + c - first` within `0..len` only); the
        // arguments match `embedding_lookup_*_*`.
        unsafe { launch.launch(cfg) }?;
        Ok(())
    }

    /// The gradient of an embedding lookup's `[vocab, dim]` table, written
    /// whole into `table`: row `r` is the sum of the rows `i` of `grad`
    /// (`[ids.len(), dim]`) with `ids[i] == r`, added in f32 in the order of
    /// `i` and rounded once (in f32, bitwise a sequential sum), zero where
    /// `r` does not occur. An id outside `[0, vocab)` adds nowhere (the
    /// lookup refuses it). Costs `ids.len()²` comparisons on the device to
    /// order the rows (17 million for 4,096 ids).
    pub fn embedding_backward<E: LayerElement, I: TargetIndex>(
        &self,
        stream: &Arc<CudaStream>,
        vocab: usize,
        ids: &impl DevicePtr<I>,
        grad: &impl DevicePtr<E>,
        table: &mut impl DevicePtrMut<E>,
    ) -> Result<()> {
        const OP: &str = "embedding_backward";
        let n = ids.len();
        let dim = embedding_width(OP, vocab, table.len(), n, grad.len())?;
        let vocab_arg = vocab_arg(OP, vocab)?;
        let n_arg = i64::from(int_arg(OP, "ids", n)?);
        let dim_arg = int_arg(OP, "the embedding width", dim)?;
        stream.memset_zeros(table)?;
        let Some(order_cfg) = self.config(OP, Launch::Elements(n))? else {
            return Ok(());
        };
        let Some(sum_cfg) = self.config(
            OP,
            Launch::Segments {
                rows: n,
                columns: dim,
            },
        )?
        else {
            return Ok(());
        };
        // SAFETY: embedding_order writes every one of the n elements (a
        // permutation of 0..n) before embedding_backward reads them.
        let mut order_buf = unsafe { stream.alloc::<u32>(n) }?;
        let (ids, _g0) = ids.device_ptr(stream);
        let (grad, _g1) = grad.device_ptr(stream);
        let (table, _g2) = table.device_ptr_mut(stream);
        let (order, _g3) = order_buf.device_ptr_mut(stream);
        let mut launch = stream.launch_builder(&self.embedding_order[I::INDEX]);
        launch.arg(&ids).arg(&order).arg(&n_arg).arg(&vocab_arg);
        // SAFETY: ids holds n `I` and order n u32; the arguments match
        // `embedding_order_*`.
        unsafe { launch.launch(order_cfg) }?;
        let mut launch = stream.launch_builder(&self.embedding_backward[E::INDEX][I::INDEX]);
        launch
            .arg(&ids)
            .arg(&order)
            .arg(&grad)
            .arg(&table)
            .arg(&n_arg)
            .arg(&dim_arg)
            .arg(&vocab_arg);
        // SAFETY: ids and order hold n elements, grad n * dim `E`, table
        // vocab * dim `E`; the kernel writes table rows below vocab only; the
        // arguments match `embedding_backward_*_*`.
        unsafe { launch.launch(sum_cfg) }?;
        Ok(())
    }
}

/// `vocab` as the kernels' 32-bit argument.
fn vocab_arg(op: &'static str, vocab: usize) -> Result<u32> {
    u32::try_from(vocab).map_err(|_| {
        Error::from(zero_core::Error::Unsupported {
            op,
            detail: format!("a vocabulary of {vocab} rows exceeds the kernels' 32-bit ids"),
        })
    })
}

/// Fails unless `values` lies in a `[vocab, dim]` table and `part_len`
/// elements hold it.
fn lookup_part(
    op: &'static str,
    (vocab, dim): (usize, usize),
    values: &Range<usize>,
    part_len: usize,
) -> Result<()> {
    let table = vocab.checked_mul(dim);
    if values.start > values.end || table.is_none_or(|table| values.end > table) {
        return Err(Error::from(zero_core::Error::Unsupported {
            op,
            detail: format!(
                "elements {values:?} are not a stretch of a [{vocab}, {dim}] table; pass the \
                 table elements the part holds"
            ),
        }));
    }
    check_len(op, "part", part_len, values.len())
}

/// The table's width: `table_len` is `vocab` rows of it, `grad_len` `ids`.
fn embedding_width(
    op: &'static str,
    vocab: usize,
    table_len: usize,
    ids: usize,
    grad_len: usize,
) -> Result<usize> {
    let dim = match table_len.checked_div(vocab) {
        Some(dim) if dim * vocab == table_len => dim,
        None if table_len == 0 => 0,
        _ => {
            return Err(Error::from(zero_core::Error::Unsupported {
                op,
                detail: format!(
                    "a table of {table_len} elements is not {vocab} rows of one width; pass the \
                     [vocab, dim] gradient buffer"
                ),
            }))
        }
    };
    check_len(op, "grad", grad_len, ids * dim)?;
    Ok(dim)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lookup_part_must_be_a_stretch_of_the_table_and_hold_it() {
        assert!(lookup_part("t", (10, 3), &(0..30), 30).is_ok());
        assert!(lookup_part("t", (10, 3), &(7..12), 5).is_ok());
        assert!(lookup_part("t", (10, 3), &(30..30), 0).is_ok());
        let err = lookup_part("t", (10, 3), &(25..31), 6)
            .unwrap_err()
            .to_string();
        assert!(err.contains("25..31") && err.contains("[10, 3]"), "{err}");
        let err = lookup_part("t", (10, 3), &(7..12), 6)
            .unwrap_err()
            .to_string();
        assert!(err.contains("part"), "{err}");
        assert!(lookup_part("t", (usize::MAX, 3), &(0..1), 1).is_err());
    }

    #[test]
    fn the_width_follows_the_table_and_the_gradient_must_match_it() {
        assert_eq!(embedding_width("t", 10, 30, 4, 12).unwrap(), 3);
        assert_eq!(embedding_width("t", 0, 0, 4, 0).unwrap(), 0);
        assert_eq!(embedding_width("t", 10, 30, 0, 0).unwrap(), 3);
        let err = embedding_width("t", 10, 31, 4, 12).unwrap_err().to_string();
        assert!(err.contains("31 elements is not 10 rows"), "{err}");
        assert!(embedding_width("t", 0, 5, 4, 0).is_err());
        let err = embedding_width("t", 10, 30, 4, 13).unwrap_err().to_string();
        assert!(err.contains("grad"), "{err}");
    }
}
