//! `Embedding`: a row lookup as one custom op that reads the table in place
//! and hands the table's gradient to the hook.

use super::cpu;
use super::grad_hook::{
    announce, announce_gather, before_read, for_each_stretch, gather, route, GatheredParam,
    GradHook, StretchView,
};
use super::ops::cuda;
use super::storage::{on_device, tensor_from, with_cuda, OnDevice};
use candle_core::backend::{BackendDevice, BackendStorage};
use candle_core::cpu_backend::CpuDevice;
use candle_core::{
    bail, CpuStorage, CudaStorage, CustomOp2, DType, Device, Layout, Module, Result, Shape,
    Storage, Tensor, WithDType,
};
use candle_nn::VarBuilder;
use std::ops::Range;
use std::sync::{Arc, Mutex, PoisonError};

/// An embedding table `[vocab, hidden_size]` looked up by integer ids, as
/// `candle_nn::Embedding`.
///
/// The forward is one custom op over `(table, ids)` that gathers rows from
/// the table's storage. An id outside the vocabulary is an error on the
/// CPU; on CUDA (u32 or i64 ids) its row is NaN, as the cross-entropy's
/// loss of such a target, since refusing it would wait for the GPU. A
/// stage-3 table gathered in pieces is looked up a piece at a time, with
/// the ids left on the device. Its backward builds the `[vocab, hidden_size]`
/// gradient (rows of the output gradient added at their ids: one pass on the
/// CPU; on CUDA the rows sorted by id, then each id's summed in f32) and
/// hands it to the hook. The ids get no gradient.
#[derive(Clone)]
pub struct Embedding {
    embeddings: Tensor,
    hidden_size: usize,
    hook: Option<Arc<dyn GradHook>>,
}

impl Embedding {
    /// A layer over an existing `[vocab, hidden_size]` table, as
    /// `candle_nn::Embedding::new`, plus the hook (`None`: the gradient goes
    /// to the `GradStore`).
    pub fn new(embeddings: Tensor, hidden_size: usize, hook: Option<Arc<dyn GradHook>>) -> Self {
        announce(hook.as_ref(), &[Some(&embeddings)]);
        announce_gather(hook.as_ref(), &[Some(&embeddings)]);
        Self {
            embeddings,
            hidden_size,
            hook,
        }
    }

    /// The `[vocab, hidden_size]` table.
    pub fn embeddings(&self) -> &Tensor {
        &self.embeddings
    }

    /// The width of a row.
    pub fn hidden_size(&self) -> usize {
        self.hidden_size
    }

    /// The hook the table's gradient goes to.
    pub fn hook(&self) -> Option<&Arc<dyn GradHook>> {
        self.hook.as_ref()
    }
}

impl std::fmt::Debug for Embedding {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Embedding")
            .field("embeddings", &self.embeddings.shape())
            .field("hooked", &self.hook.is_some())
            .finish()
    }
}

impl Module for Embedding {
    /// `ids` of any shape `[..]` give `[.., hidden_size]`.
    fn forward(&self, ids: &Tensor) -> Result<Tensor> {
        let mut out_dims = ids.dims().to_vec();
        out_dims.push(self.hidden_size);
        let ids = ids.flatten_all()?;
        // Stage 3: the table the hook keeps sharded, gathered for this
        // forward only (the backward does not need it). A table gathered
        // in pieces is looked up here, a piece at a time, and the op hands
        // out the rows.
        let hook = self.hook.as_ref();
        before_read(hook, &[Some(&self.embeddings)])?;
        let lent = match gather(hook, Some(&self.embeddings), 0)? {
            Some(first) if first.whole().is_none() => Some(Lent::Output(lookup_in_pieces(
                hook,
                &self.embeddings,
                first,
                &ids,
            )?)),
            table => table.map(Lent::Table),
        };
        let rows = self.embeddings.apply_op2(
            &ids,
            FusedEmbedding {
                hook: self.hook.clone(),
                lent: Mutex::new(lent),
            },
        )?;
        rows.reshape(out_dims)
    }
}

/// An embedding layer created as `candle_nn::embedding` creates it: `weight`
/// `[in_size, out_size]`, standard normal.
pub fn embedding(
    in_size: usize,
    out_size: usize,
    vb: VarBuilder,
    hook: Option<Arc<dyn GradHook>>,
) -> Result<Embedding> {
    let layer = candle_nn::embedding(in_size, out_size, vb)?;
    Ok(Embedding::new(layer.embeddings().clone(), out_size, hook))
}

/// The op `(table [vocab, dim], ids [n]) -> table[ids] [n, dim]`.
struct FusedEmbedding {
    hook: Option<Arc<dyn GradHook>>,
    /// The gathered table (stage 3), or the rows looked up in its pieces,
    /// taken and dropped by the forward.
    lent: Mutex<Option<Lent>>,
}

enum Lent {
    Table(GatheredParam),
    Output(Storage),
}

const ROWS: &str = "the embedding rows";

impl FusedEmbedding {
    /// The rows, from the table the forward lent (stage 3) or `table`,
    /// looked up by `lookup`.
    fn rows<S: OnDevice>(
        &self,
        (table, table_layout): (&S, &Layout),
        (ids, ids_layout): (&S, &Layout),
        lookup: impl FnOnce(&S, &Layout, &S, &Layout) -> Result<(S, Shape)>,
    ) -> Result<(S, Shape)> {
        let lent = self
            .lent
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        if let Some(Lent::Output(rows)) = lent {
            let (_, dim) = table_layout.shape().dims2()?;
            let count = ids_layout.shape().dims1()?;
            return Ok((on_device(rows, ROWS)?, Shape::from((count, dim))));
        }
        let (table, table_layout) = match &lent {
            Some(Lent::Table(gathered)) => gathered.whole_on::<S>().ok_or_else(|| {
                candle_core::Error::Msg(
                    "zero-candle Embedding: internal: a table gathered in pieces, or on another \
                     device, reached the whole-table op"
                        .into(),
                )
            })?,
            _ => (table, table_layout),
        };
        lookup(table, table_layout, ids, ids_layout)
    }
}

/// `table[ids]` with the table gathered in pieces: each stretch of each
/// piece writes the elements of the rows that come from it (rows split over
/// stretches get their columns from each), on the CPU from the ids checked
/// there, on CUDA by a kernel per stretch with the ids left on the device.
/// The stretches must cover the table.
fn lookup_in_pieces(
    hook: Option<&Arc<dyn GradHook>>,
    table: &Tensor,
    first: GatheredParam,
    ids: &Tensor,
) -> Result<Storage> {
    let (vocab, dim) = table.dims2()?;
    let shape = Shape::from((ids.dim(0)?, dim));
    let (mut out, ids) = match table.device() {
        Device::Cpu => (
            Storage::Cpu(CpuDevice.zeros_impl(&shape, table.dtype())?),
            PieceIds::Rows(row_ids(ids, vocab)?),
        ),
        Device::Cuda(device) => {
            let ids = match ids.dtype() {
                DType::U8 => ids.to_dtype(DType::U32)?,
                _ => ids.contiguous()?,
            };
            // At least one element, as every buffer of our CUDA ops.
            let len = Shape::from(shape.elem_count().max(1));
            (
                Storage::Cuda(device.zeros_impl(&len, table.dtype())?),
                PieceIds::Device(ids),
            )
        }
        other => bail!("zero-candle Embedding: stage 3 gathers on the CPU or CUDA, not {other:?}"),
    };
    let mut covered = Vec::new();
    for_each_stretch(hook, table, Some(first), |values, stretch| {
        let StretchView::Piece { piece, at } = stretch else {
            bail!("zero-candle Embedding: internal: a table in pieces lent its own values")
        };
        if shape.elem_count() > 0 {
            copy_rows(
                &ids,
                (piece.storage(), at.clone()),
                values.clone(),
                (vocab, dim),
                &mut out,
            )?;
        }
        covered.push(values);
        Ok(())
    })?;
    check_cover(covered, vocab * dim)?;
    Ok(out)
}

/// The ids of a lookup in pieces: on the CPU checked row numbers, on CUDA
/// contiguous u32 or i64 ids on the device.
enum PieceIds {
    Rows(Vec<usize>),
    Device(Tensor),
}

/// The rows of the lookup that the stretch at `at` of `part` (elements
/// `values` of the `[vocab, dim]` table) holds, into `out`.
fn copy_rows(
    ids: &PieceIds,
    (part, at): (&Storage, Range<usize>),
    values: Range<usize>,
    (vocab, dim): (usize, usize),
    out: &mut Storage,
) -> Result<()> {
    match (ids, part, out) {
        (PieceIds::Rows(rows), Storage::Cpu(part), Storage::Cpu(out)) => {
            fn copy<T: Copy>(out: &mut [T], part: &[T], values: Range<usize>, rows: &[usize]) {
                let Some(dim) = out.len().checked_div(rows.len()).filter(|&dim| dim > 0) else {
                    return;
                };
                for (out, &row) in out.chunks_exact_mut(dim).zip(rows) {
                    let (start, end) = (row * dim, (row + 1) * dim);
                    let (lo, hi) = (start.max(values.start), end.min(values.end));
                    if lo < hi {
                        out[lo - start..hi - start]
                            .copy_from_slice(&part[lo - values.start..hi - values.start]);
                    }
                }
            }
            if at.end > cpu::storage_len(part) {
                bail!("zero-candle Embedding: internal: a gathered piece has no elements {at:?}")
            }
            match (part, out) {
                (CpuStorage::F32(p), CpuStorage::F32(o)) => copy(o, &p[at], values, rows),
                (CpuStorage::F64(p), CpuStorage::F64(o)) => copy(o, &p[at], values, rows),
                (CpuStorage::BF16(p), CpuStorage::BF16(o)) => copy(o, &p[at], values, rows),
                (CpuStorage::F16(p), CpuStorage::F16(o)) => copy(o, &p[at], values, rows),
                (p, _) => bail!(
                    "zero-candle Embedding: a table of {:?} in pieces; stage 3 gathers f32, f64, \
                     bf16 or f16",
                    p.dtype()
                ),
            }
            Ok(())
        }
        (PieceIds::Device(ids), Storage::Cuda(part), Storage::Cuda(out)) => {
            with_cuda(ids, "the embedding ids", |ids, layout| {
                cuda::embedding_lookup((ids, layout), (part, at), values, (vocab, dim), out)
            })
        }
        _ => bail!(
            "zero-candle Embedding: a gathered piece of the table on another device than the \
             table; keep the model on one device"
        ),
    }
}

/// Fails unless the element ranges `covered` are `0..len`, each once.
fn check_cover(mut covered: Vec<Range<usize>>, len: usize) -> Result<()> {
    covered.sort_by_key(|values| values.start);
    let mut next = 0;
    let ends = covered.iter().map(|values| (values.start, values.end));
    for (start, end) in ends.chain([(len, len)]) {
        if start > next {
            bail!("zero-candle Embedding: internal: the gathered pieces of the table miss its elements {next}..{start}")
        }
        if start < next {
            bail!("zero-candle Embedding: internal: the gathered pieces of the table hold its elements {start}..{next} twice")
        }
        next = end;
    }
    Ok(())
}

fn gather_rows<S: BackendStorage>(
    table: &S,
    table_layout: &Layout,
    ids: &S,
    ids_layout: &Layout,
) -> Result<(S, Shape)> {
    let (_vocab, dim) = table_layout.shape().dims2()?;
    let count = ids_layout.shape().dims1()?;
    // Checks every id against the vocabulary (but its type's largest).
    let rows = table.index_select(ids, table_layout, ids_layout, 0)?;
    Ok((rows, Shape::from((count, dim))))
}

/// The lookup on the CPU: every id checked against the vocabulary first
/// (Candle's `index_select` reads an id of its type's largest value as a
/// row of zeros), then Candle's `index_select`.
fn lookup_cpu(
    table: &CpuStorage,
    table_layout: &Layout,
    ids: &CpuStorage,
    ids_layout: &Layout,
) -> Result<(CpuStorage, Shape)> {
    let (vocab, _) = table_layout.shape().dims2()?;
    rows_of_storage(ids, ids_layout, vocab)?;
    gather_rows(table, table_layout, ids, ids_layout)
}

/// The lookup on CUDA: zero-nccl's kernel where it takes the types (the
/// rows of ids outside the vocabulary NaN), else Candle's `index_select`
/// (which traps on such an id).
fn lookup_cuda(
    table: &CudaStorage,
    table_layout: &Layout,
    ids: &CudaStorage,
    ids_layout: &Layout,
) -> Result<(CudaStorage, Shape)> {
    let (vocab, dim) = table_layout.shape().dims2()?;
    let shape = Shape::from((ids_layout.shape().dims1()?, dim));
    match table_layout.contiguous_offsets() {
        Some((start, end)) if has_cuda_kernel(ids.dtype(), table.dtype()) => {
            // SAFETY: the kernel writes every element of the rows: the
            // table's values, or NaN for an id outside it. At least one,
            // as every buffer of our CUDA ops; no rows, no launch (a
            // launch of an empty grid is an error).
            let len = Shape::from(shape.elem_count().max(1));
            let mut rows = unsafe { table.device().alloc_uninit(&len, table.dtype()) }?;
            if shape.elem_count() > 0 {
                let whole = (table, start..end);
                let (values, table) = (0..vocab * dim, (vocab, dim));
                cuda::embedding_lookup((ids, ids_layout), whole, values, table, &mut rows)?;
            }
            Ok((rows, shape))
        }
        _ => gather_rows(table, table_layout, ids, ids_layout),
    }
}

impl CustomOp2 for FusedEmbedding {
    fn name(&self) -> &'static str {
        "zero-embedding"
    }

    fn cpu_fwd(
        &self,
        table: &CpuStorage,
        table_layout: &Layout,
        ids: &CpuStorage,
        ids_layout: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        self.rows((table, table_layout), (ids, ids_layout), lookup_cpu)
    }

    fn cuda_fwd(
        &self,
        table: &CudaStorage,
        table_layout: &Layout,
        ids: &CudaStorage,
        ids_layout: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        self.rows((table, table_layout), (ids, ids_layout), lookup_cuda)
    }

    fn bwd(
        &self,
        table: &Tensor,
        ids: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        if !table.track_op() {
            return Ok((None, None));
        }
        let (vocab, dim) = table.dims2()?;
        let grad_table = if table.device().is_cpu() {
            scatter_rows_cpu(vocab, dim, ids, grad)?
        } else if table.device().is_cuda() && has_cuda_kernel(ids.dtype(), grad.dtype()) {
            scatter_rows_cuda(vocab, dim, ids, grad)?
        } else {
            // Other devices and types: Candle's own index_add, as candle-nn's
            // backward.
            Tensor::zeros((vocab, dim), grad.dtype(), grad.device())?.index_add(ids, grad, 0)?
        };
        Ok((route(self.hook.as_ref(), table, grad_table)?, None))
    }
}

/// Whether zero-nccl's embedding kernels take these ids and values: u32 or
/// i64 ids, f32, bf16 or f16 values.
fn has_cuda_kernel(ids: DType, values: DType) -> bool {
    matches!(ids, DType::U32 | DType::I64)
        && matches!(values, DType::F32 | DType::BF16 | DType::F16)
}

/// The table's gradient on CUDA: the lookup's rows sorted by id, then each
/// id's rows added in f32 in their order and rounded once (candle's
/// `index_add` adds them one after another in the element type, on a thread
/// per column). In f32 the sums are bitwise the CPU's.
fn scatter_rows_cuda(vocab: usize, dim: usize, ids: &Tensor, grad: &Tensor) -> Result<Tensor> {
    let ids = ids.flatten_all()?.contiguous()?;
    let grad = grad.contiguous()?;
    let table = with_cuda(&ids, "the embedding ids", |ids_storage, ids_layout| {
        with_cuda(&grad, "the embedding gradient", |g_storage, g_layout| {
            cuda::embedding_backward(
                (ids_storage, ids_layout),
                (g_storage, g_layout),
                (vocab, dim),
            )
        })
    })?;
    Ok(tensor_from(Storage::Cuda(table), (vocab, dim)))
}

/// `out[ids[i]] += grad[i]` into a fresh zeroed `[vocab, dim]` table, in
/// the order of `ids` (the order of Candle's `index_add`, so the sums are
/// bitwise those of candle-nn).
fn scatter_rows<T: WithDType>(grad: &[T], ids: &[usize], vocab: usize, dim: usize) -> Vec<T> {
    let mut out = vec![T::from_f64(0.0); vocab * dim];
    for (row, &id) in grad.chunks_exact(dim).zip(ids) {
        for (o, g) in out[id * dim..(id + 1) * dim].iter_mut().zip(row) {
            *o += *g;
        }
    }
    out
}

/// The ids as row numbers, each checked against the vocabulary.
fn row_numbers<I>(ids: &CpuStorage, layout: &Layout, vocab: usize) -> Result<Vec<usize>>
where
    I: WithDType + TryInto<usize> + std::fmt::Display,
{
    cpu::slice::<I>(ids, layout, "the embedding ids")?
        .iter()
        .map(|&id| match id.try_into() {
            Ok(row) if row < vocab => Ok(row),
            _ => bail!("zero-candle Embedding: id {id} is outside the vocabulary 0..{vocab}"),
        })
        .collect()
}

fn scatter_typed<T: WithDType>(
    grad: &CpuStorage,
    layout: &Layout,
    rows: &[usize],
    vocab: usize,
    dim: usize,
) -> Result<Tensor> {
    let grad = cpu::slice::<T>(grad, layout, "the embedding gradient")?;
    Tensor::from_vec(
        scatter_rows(grad, rows, vocab, dim),
        (vocab, dim),
        &Device::Cpu,
    )
}

/// The ids (on the CPU) as row numbers, each checked against the
/// vocabulary.
fn row_ids(ids: &Tensor, vocab: usize) -> Result<Vec<usize>> {
    let ids = &ids.to_device(&Device::Cpu)?;
    cpu::with_cpu(ids, "the embedding ids", |storage, layout| {
        rows_of_storage(storage, layout, vocab)
    })
}

/// [`row_numbers`] of ids of any supported type.
fn rows_of_storage(ids: &CpuStorage, layout: &Layout, vocab: usize) -> Result<Vec<usize>> {
    match ids.dtype() {
        DType::U8 => row_numbers::<u8>(ids, layout, vocab),
        DType::U32 => row_numbers::<u32>(ids, layout, vocab),
        DType::I64 => row_numbers::<i64>(ids, layout, vocab),
        other => bail!(
            "zero-candle Embedding: ids of dtype {other:?} are not supported; use u8, u32 or i64"
        ),
    }
}

fn scatter_rows_cpu(vocab: usize, dim: usize, ids: &Tensor, grad: &Tensor) -> Result<Tensor> {
    if dim == 0 {
        return Tensor::zeros((vocab, dim), grad.dtype(), &Device::Cpu);
    }
    let grad = grad.contiguous()?;
    let rows = row_ids(ids, vocab)?;
    cpu::with_cpu(
        &grad,
        "the embedding gradient",
        |storage, layout| match storage.dtype() {
            DType::F32 => scatter_typed::<f32>(storage, layout, &rows, vocab, dim),
            DType::F64 => scatter_typed::<f64>(storage, layout, &rows, vocab, dim),
            DType::BF16 => scatter_typed::<half::bf16>(storage, layout, &rows, vocab, dim),
            DType::F16 => scatter_typed::<half::f16>(storage, layout, &rows, vocab, dim),
            other => bail!(
                "zero-candle Embedding: dtype {other:?} is not supported; use f32, f64, bf16 or f16"
            ),
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    #[allow(clippy::single_range_in_vec_init)] // one piece, one stretch
    fn the_pieces_must_cover_the_table_once() {
        assert!(check_cover(vec![5..9, 0..5, 9..12], 12).is_ok());
        assert!(check_cover(vec![0..0, 0..12], 12).is_ok());
        let err = check_cover(vec![0..4, 6..12], 12).unwrap_err().to_string();
        assert!(err.contains("miss its elements 4..6"), "{err}");
        let err = check_cover(vec![0..6, 4..12], 12).unwrap_err().to_string();
        assert!(err.contains("hold its elements 4..6 twice"), "{err}");
        let err = check_cover(vec![0..10], 12).unwrap_err().to_string();
        assert!(err.contains("miss its elements 10..12"), "{err}");
        let err = check_cover(vec![0..14], 12).unwrap_err().to_string();
        assert!(err.contains("hold its elements 12..14 twice"), "{err}");
    }
}
