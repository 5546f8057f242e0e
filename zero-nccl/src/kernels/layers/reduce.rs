//! Reductions over rows for [`LayerKernels`] (`column_sums_*` in
//! layers.cu): a Linear's bias gradient, summed in f32 over fixed chunks of
//! rows and then over the chunks in order, so the result is deterministic.

use super::{check_len, int_arg, row_chunks, Launch, LayerElement, LayerKernels};
use crate::{Error, Result};
use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut, PushKernelArg};
use std::sync::Arc;

impl LayerKernels {
    /// `sums[c] = Σ_r grad[r, c]` over a row-major `[rows, n]` `grad`,
    /// `n = sums.len()`: a Linear's bias gradient. Two launches, as the
    /// norm backward's column pass: blocks of 32 columns sum fixed chunks
    /// of rows (coalesced) into f32 partials allocated on `stream`, then
    /// each column's partials are added in chunk order and rounded once to
    /// `E`. No rows give zeros.
    pub fn column_sums<E: LayerElement>(
        &self,
        stream: &Arc<CudaStream>,
        rows: usize,
        grad: &impl DevicePtr<E>,
        sums: &mut impl DevicePtrMut<E>,
    ) -> Result<()> {
        const OP: &str = "column_sums";
        let n = sums.len();
        let elements = rows.checked_mul(n).ok_or_else(|| {
            Error::from(zero_core::Error::Unsupported {
                op: OP,
                detail: format!(
                    "{rows} rows of {n} columns are more elements than memory holds; pass the \
                     gradient's own row count"
                ),
            })
        })?;
        check_len(OP, "grad", grad.len(), elements)?;
        if rows == 0 {
            stream.memset_zeros(sums)?;
            return Ok(());
        }
        let (chunks, rows_per_chunk) = row_chunks(rows);
        let Some(partial_cfg) = self.config(OP, Launch::Columns { n, chunks })? else {
            // No columns: nothing to sum.
            return Ok(());
        };
        let Some(finish_cfg) = self.config(OP, Launch::Elements(n))? else {
            return Ok(());
        };
        let n_arg = int_arg(OP, "the number of columns", n)?;
        let chunks_arg = int_arg(OP, "row chunks", chunks)?;
        let rows_arg = rows as i64;
        let rows_per_chunk = rows_per_chunk as i64;
        // SAFETY: the partial pass writes every one of the chunks * n
        // partials (each chunk holds at least one row, and a block writes
        // its columns below n) before the finish reads them, in stream order.
        let mut partial = unsafe { stream.alloc::<f32>(chunks * n) }?;
        let (g, _g0) = grad.device_ptr(stream);
        {
            let (partial, _g1) = partial.device_ptr_mut(stream);
            let mut launch = stream.launch_builder(&self.column_sums_partial[E::INDEX]);
            launch
                .arg(&g)
                .arg(&partial)
                .arg(&rows_arg)
                .arg(&n_arg)
                .arg(&rows_per_chunk);
            // SAFETY: grad holds rows * n `E`; the grid's `chunks` row
            // chunks of rows_per_chunk rows cover rows (the last one
            // clipped) and its columns n; partial holds chunks * n f32; the
            // block is the 32 x 8 the kernel's shared array assumes; the
            // arguments match `column_sums_partial_*`.
            unsafe { launch.launch(partial_cfg) }?;
        }
        let (partial, _g1) = partial.device_ptr(stream);
        let (sums, _g2) = sums.device_ptr_mut(stream);
        let mut launch = stream.launch_builder(&self.column_sums_finish[E::INDEX]);
        launch.arg(&partial).arg(&sums).arg(&n_arg).arg(&chunks_arg);
        // SAFETY: partial holds chunks * n f32, sums n `E`; the arguments
        // match `column_sums_finish_*`.
        unsafe { launch.launch(finish_cfg) }?;
        Ok(())
    }
}
