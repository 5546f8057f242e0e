//! `Embedding`: a row lookup as one custom op that reads the table in place
//! and hands the table's gradient to the hook.

use super::cpu;
use super::grad_hook::{
    announce, announce_gather, before_read, for_each_stretch, gather, route, row_parts,
    GatheredParam, GradHook, RowPart,
};
use super::ops::cuda;
use super::storage::{on_device, owned_storage, tensor_from, with_cuda, OnDevice};
use candle_core::backend::BackendStorage;
use candle_core::{
    bail, CpuStorage, CudaStorage, CustomOp2, DType, Device, Layout, Module, Result, Shape,
    Storage, Tensor, WithDType,
};
use candle_nn::VarBuilder;
use std::sync::{Arc, Mutex, PoisonError};

/// An embedding table `[vocab, hidden_size]` looked up by integer ids, as
/// `candle_nn::Embedding`.
///
/// The forward is one custom op over `(table, ids)` that gathers rows from
/// the table's storage. Its backward builds the `[vocab, hidden_size]`
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
            Some(first) if first.whole().is_none() => {
                let rows = lookup_in_pieces(hook, &self.embeddings, first, &ids)?;
                Some(Lent::Output(owned_storage(&rows, ROWS)?))
            }
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
    /// The rows, from the table the forward lent (stage 3) or `table`.
    fn rows<S: OnDevice>(
        &self,
        (table, table_layout): (&S, &Layout),
        (ids, ids_layout): (&S, &Layout),
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
        gather_rows(table, table_layout, ids, ids_layout)
    }
}

/// `table[ids]` with the table gathered in pieces: the rows wanted are
/// taken out of each stretch in one selection (a row split over stretches
/// put together from its columns), in id order, and the lookup is one more
/// selection from those: a few launches per stretch, not a few per id.
fn lookup_in_pieces(
    hook: Option<&Arc<dyn GradHook>>,
    table: &Tensor,
    first: GatheredParam,
    ids: &Tensor,
) -> Result<Tensor> {
    let (vocab, dim) = table.dims2()?;
    let device = table.device();
    let ids = row_ids(ids, vocab)?;
    let wanted: std::collections::BTreeSet<usize> = ids.iter().copied().collect();
    // The wanted rows by their first id, in blocks of consecutive wanted
    // ids (copied out of the piece, so that the piece can go), and the
    // parts of split rows: (first column, values).
    let mut blocks: std::collections::BTreeMap<usize, Tensor> = Default::default();
    let mut split: std::collections::BTreeMap<usize, Vec<(usize, Tensor)>> = Default::default();
    for_each_stretch(hook, table, Some(first), |values, stretch| {
        for part in row_parts(values, dim) {
            match part {
                RowPart::Rows { rows, at } => {
                    let local: Vec<u32> = wanted
                        .range(rows.clone())
                        .map(|&id| (id - rows.start) as u32)
                        .collect();
                    let Some(&first_local) = local.first() else {
                        continue;
                    };
                    let run = stretch
                        .tensor(at..at + rows.len() * dim, device)?
                        .reshape((rows.len(), dim))?;
                    let local = Tensor::new(local.as_slice(), device)?;
                    blocks.insert(
                        rows.start + first_local as usize,
                        run.index_select(&local, 0)?,
                    );
                }
                RowPart::Partial { row, cols, at } if wanted.contains(&row) => {
                    let values = stretch.tensor(at..at + cols.len(), device)?;
                    split.entry(row).or_default().push((cols.start, values));
                }
                RowPart::Partial { .. } => {}
            }
        }
        Ok(())
    })?;
    for (id, mut row) in split {
        row.sort_by_key(|(col, _)| *col);
        let row: Vec<Tensor> = row.into_iter().map(|(_, v)| v).collect();
        let row = Tensor::cat(&row, 0)?;
        if row.dim(0)? != dim {
            bail!("zero-candle Embedding: the gathered pieces of the table miss part of row {id}")
        }
        blocks.insert(id, row.reshape((1, dim))?);
    }
    if ids.is_empty() {
        return Tensor::zeros((0, dim), table.dtype(), device);
    }
    let blocks: Vec<Tensor> = blocks.into_values().collect();
    let found = Tensor::cat(&blocks, 0)?;
    if found.dim(0)? != wanted.len() {
        bail!(
            "zero-candle Embedding: the gathered pieces of the table hold {} of the {} rows looked up",
            found.dim(0)?,
            wanted.len()
        )
    }
    // Each id's place among the wanted rows, in id order.
    let order: Vec<usize> = wanted.into_iter().collect();
    let places: Vec<u32> = ids
        .iter()
        .map(|id| order.partition_point(|&w| w < *id) as u32)
        .collect();
    found.index_select(&Tensor::new(places.as_slice(), device)?, 0)
}

fn gather_rows<S: BackendStorage>(
    table: &S,
    table_layout: &Layout,
    ids: &S,
    ids_layout: &Layout,
) -> Result<(S, Shape)> {
    let (_vocab, dim) = table_layout.shape().dims2()?;
    let count = ids_layout.shape().dims1()?;
    // Checks every id against the vocabulary.
    let rows = table.index_select(ids, table_layout, ids_layout, 0)?;
    Ok((rows, Shape::from((count, dim))))
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
        self.rows((table, table_layout), (ids, ids_layout))
    }

    fn cuda_fwd(
        &self,
        table: &CudaStorage,
        table_layout: &Layout,
        ids: &CudaStorage,
        ids_layout: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        self.rows((table, table_layout), (ids, ids_layout))
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
        } else if table.device().is_cuda() && has_cuda_kernel(ids, grad) {
            scatter_rows_cuda(vocab, dim, ids, grad)?
        } else {
            // Other devices and types: Candle's own index_add, as candle-nn's
            // backward.
            Tensor::zeros((vocab, dim), grad.dtype(), grad.device())?.index_add(ids, grad, 0)?
        };
        Ok((route(self.hook.as_ref(), table, grad_table)?, None))
    }
}

/// Whether zero-nccl's embedding gradient takes these ids and this
/// gradient: u32 or i64 ids, f32, bf16 or f16 values.
fn has_cuda_kernel(ids: &Tensor, grad: &Tensor) -> bool {
    matches!(ids.dtype(), DType::U32 | DType::I64)
        && matches!(grad.dtype(), DType::F32 | DType::BF16 | DType::F16)
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
    // Ids on a GPU (a table gathered in pieces there) are read on the host.
    let ids = &ids.to_device(&Device::Cpu)?;
    cpu::with_cpu(ids, "the embedding ids", |storage, layout| {
        match storage.dtype() {
            DType::U8 => row_numbers::<u8>(storage, layout, vocab),
            DType::U32 => row_numbers::<u32>(storage, layout, vocab),
            DType::I64 => row_numbers::<i64>(storage, layout, vocab),
            other => bail!(
                "zero-candle Embedding: ids of dtype {other:?} are not supported; use u8, u32 or i64"
            ),
        }
    })
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
