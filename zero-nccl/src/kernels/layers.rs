//! The fused transformer layers' CUDA kernels ([`LAYER_SOURCE`]): causal
//! self-attention (FlashAttention-2 forward and backward), LayerNorm and
//! RMSNorm (forward, alone or with the residual add before it, and
//! backward; the weight optionally offset, as Gemma's `1 + w`), GELU/SiLU,
//! the gated MLP's `act(gate) * up` (SwiGLU, GeGLU), rotary embeddings
//! (forward and backward),
//! cross-entropy, column sums (a Linear's bias gradient) and an embedding
//! lookup and its table's gradient, for f32, bf16 and f16 storage, computing in f32.
//! zero-candle's custom ops launch them through [`LayerKernels`]; each
//! kernel has a CPU reference there.
//!
//! Attention has two kernel families with the same arguments: on sm_80 and
//! newer, bf16 and f16 run on tensor cores (`attention_tc.cu`: products in
//! `mma.sync` with f32 accumulation, `P` and `dS` rounded to the storage
//! type in between, as FlashAttention-2 does); f32, and every type on older
//! GPUs, run in f32 arithmetic on CUDA cores (`layers.cu`). Both take a
//! packed `qkv` or separate `q`, `k`, `v` with fewer K/V heads than query
//! heads ([`AttentionShape::kv_heads`]).
//!
//! Attention's backward is three launches, all deterministic:
//! `D = rowsum(dO * O)` per query row, then dK/dV per key tile and dQ per
//! query tile, each recomputing `P` from the forward's log-sum-exp (so no
//! float atomics and no `[T, T]` buffer; the price is computing `Q K^T` and
//! `dO V^T` twice). A K/V head's dK/dV block sums over its group of query
//! heads in order. Norm backward is a row pass (dx, and the row
//! statistics) and a column pass over fixed chunks of rows (dw, db) summed
//! in a fixed order; the column sums are that column pass alone. The
//! embedding lookup reads the table a stretch at a time (a table gathered
//! in pieces, with the ids on the device); its gradient sorts the lookup's rows by id, then sums each id's
//! rows in their order.
//!
//! ```no_run
//! # fn main() -> zero_nccl::Result<()> {
//! use zero_nccl::cudarc::driver::CudaContext;
//! use zero_nccl::kernels::layers::{ActivationKind, LayerKernels};
//! let ctx = CudaContext::new(0)?;
//! let kernels = LayerKernels::new(&ctx)?; // compile + load: once per process and device
//! let stream = ctx.default_stream();
//! let x = stream.clone_htod(&[0.5f32, -1.0, 2.0])?;
//! let mut y = stream.alloc_zeros::<f32>(3)?;
//! kernels.activation_forward(&stream, ActivationKind::Gelu, &x, &mut y)?;
//! # Ok(()) }
//! ```

mod attention;
mod elementwise;
mod embedding;
mod reduce;
mod rotary;

pub use attention::{AttentionShape, MAX_HEAD_DIM};
pub use rotary::{RotaryShape, RotaryTurn};

use super::{compile_and_load, compile_source, max_blocks};
use crate::probe::guarded;
use crate::{Error, Result};
use attention::{AttentionKernels, ATTENTION_THREADS};
use cudarc::driver::{
    CudaContext, CudaFunction, CudaModule, CudaStream, DevicePtr, DevicePtrMut, DeviceRepr,
    LaunchConfig, PushKernelArg, ValidAsZeroBits,
};
use std::sync::Arc;

/// The CUDA C source of the layer kernels: `layers.cu`, then the
/// tensor-core attention of `attention_tc.cu` and the embedding gradient of
/// `embedding.cu`, which use its definitions.
pub const LAYER_SOURCE: &str = concat!(
    include_str!("layers.cu"),
    include_str!("attention_tc.cu"),
    include_str!("embedding.cu")
);

/// Every kernel [`LayerKernels::new`] loads from [`LAYER_SOURCE`].
pub const LAYER_KERNEL_NAMES: [&str; 104] = [
    "attention_forward_d64_f32",
    "attention_backward_dq_d64_f32",
    "attention_backward_dkdv_d64_f32",
    "attention_forward_d128_f32",
    "attention_backward_dq_d128_f32",
    "attention_backward_dkdv_d128_f32",
    "attention_backward_delta_f32",
    "attention_forward_d64_bf16",
    "attention_backward_dq_d64_bf16",
    "attention_backward_dkdv_d64_bf16",
    "attention_forward_d128_bf16",
    "attention_backward_dq_d128_bf16",
    "attention_backward_dkdv_d128_bf16",
    "attention_backward_delta_bf16",
    "attention_forward_d64_f16",
    "attention_backward_dq_d64_f16",
    "attention_backward_dkdv_d64_f16",
    "attention_forward_d128_f16",
    "attention_backward_dq_d128_f16",
    "attention_backward_dkdv_d128_f16",
    "attention_backward_delta_f16",
    "attention_tc_forward_d64_bf16",
    "attention_tc_backward_dq_d64_bf16",
    "attention_tc_backward_dkdv_d64_bf16",
    "attention_tc_forward_d128_bf16",
    "attention_tc_backward_dq_d128_bf16",
    "attention_tc_backward_dkdv_d128_bf16",
    "attention_tc_forward_d64_f16",
    "attention_tc_backward_dq_d64_f16",
    "attention_tc_backward_dkdv_d64_f16",
    "attention_tc_forward_d128_f16",
    "attention_tc_backward_dq_d128_f16",
    "attention_tc_backward_dkdv_d128_f16",
    "norm_forward_f32",
    "residual_norm_forward_f32",
    "norm_backward_rows_f32",
    "norm_backward_columns_f32",
    "norm_backward_finish_f32",
    "norm_forward_bf16",
    "residual_norm_forward_bf16",
    "norm_backward_rows_bf16",
    "norm_backward_columns_bf16",
    "norm_backward_finish_bf16",
    "norm_forward_f16",
    "residual_norm_forward_f16",
    "norm_backward_rows_f16",
    "norm_backward_columns_f16",
    "norm_backward_finish_f16",
    "column_sums_partial_f32",
    "column_sums_finish_f32",
    "column_sums_partial_bf16",
    "column_sums_finish_bf16",
    "column_sums_partial_f16",
    "column_sums_finish_f16",
    "activation_forward_f32",
    "activation_backward_f32",
    "activation_recompute_backward_f32",
    "bias_activation_forward_f32",
    "activation_forward_bf16",
    "activation_backward_bf16",
    "activation_recompute_backward_bf16",
    "bias_activation_forward_bf16",
    "activation_forward_f16",
    "activation_backward_f16",
    "activation_recompute_backward_f16",
    "bias_activation_forward_f16",
    "gated_forward_f32",
    "gated_backward_f32",
    "gated_forward_bf16",
    "gated_backward_bf16",
    "gated_forward_f16",
    "gated_backward_f16",
    "rotary_f32",
    "rotary_bf16",
    "rotary_f16",
    "cross_entropy_lse_f32",
    "cross_entropy_loss_f32_u32",
    "cross_entropy_backward_f32_u32",
    "cross_entropy_loss_f32_i64",
    "cross_entropy_backward_f32_i64",
    "cross_entropy_lse_bf16",
    "cross_entropy_loss_bf16_u32",
    "cross_entropy_backward_bf16_u32",
    "cross_entropy_loss_bf16_i64",
    "cross_entropy_backward_bf16_i64",
    "cross_entropy_lse_f16",
    "cross_entropy_loss_f16_u32",
    "cross_entropy_backward_f16_u32",
    "cross_entropy_loss_f16_i64",
    "cross_entropy_backward_f16_i64",
    "embedding_order_u32",
    "embedding_order_i64",
    "embedding_lookup_f32_u32",
    "embedding_lookup_f32_i64",
    "embedding_lookup_bf16_u32",
    "embedding_lookup_bf16_i64",
    "embedding_lookup_f16_u32",
    "embedding_lookup_f16_i64",
    "embedding_backward_f32_u32",
    "embedding_backward_f32_i64",
    "embedding_backward_bf16_u32",
    "embedding_backward_bf16_i64",
    "embedding_backward_f16_u32",
    "embedding_backward_f16_i64",
];

/// Compiles [`LAYER_SOURCE`] to PTX for `arch` with
/// [`compile_options`](super::compile_options), as [`LayerKernels::new`]
/// does (which picks `arch` with [`nvrtc_arch`](super::nvrtc_arch)). Needs
/// libnvrtc, not a GPU.
pub fn compile_layer_ptx_for(arch: &str) -> Result<cudarc::nvrtc::Ptx> {
    compile_source(LAYER_SOURCE, arch)
}

/// Names of the storage types, in [`LayerElement::INDEX`] order.
const ELEMENT_NAMES: [&str; 3] = ["f32", "bf16", "f16"];

/// Names of the target types, in [`TargetIndex::INDEX`] order.
const TARGET_NAMES: [&str; 2] = ["u32", "i64"];

/// A storage type of the layer kernels: `f32`, `bf16` or `f16` (16-bit
/// values compute in f32 and round to nearest even when stored).
pub trait LayerElement: DeviceRepr + ValidAsZeroBits + Copy + 'static {
    /// Its kernels' index in the per-type tables.
    const INDEX: usize;
    /// Its index among the tensor-core attention kernels' types (bf16, f16),
    /// if it has them.
    const TENSOR_CORE_INDEX: Option<usize>;
}

impl LayerElement for f32 {
    const INDEX: usize = 0;
    const TENSOR_CORE_INDEX: Option<usize> = None;
}

impl LayerElement for half::bf16 {
    const INDEX: usize = 1;
    const TENSOR_CORE_INDEX: Option<usize> = Some(0);
}

impl LayerElement for half::f16 {
    const INDEX: usize = 2;
    const TENSOR_CORE_INDEX: Option<usize> = Some(1);
}

/// A class-index type of cross-entropy targets and embedding ids: `u32` or
/// `i64`.
pub trait TargetIndex: DeviceRepr + Copy + 'static {
    /// Its kernels' index in the per-type tables.
    const INDEX: usize;
}

impl TargetIndex for u32 {
    const INDEX: usize = 0;
}

impl TargetIndex for i64 {
    const INDEX: usize = 1;
}

/// Which element-wise activation [`LayerKernels::activation_forward`] (and
/// [`LayerKernels::gated_forward`]'s gate) computes (the kernels' `kind`
/// argument).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ActivationKind {
    /// `0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))`.
    Gelu = 0,
    /// `0.5 x (1 + erf(x / sqrt(2)))`.
    GeluErf = 1,
    /// `x / (1 + exp(-x))`.
    Silu = 2,
    /// `max(x, 0)^2`.
    Relu2 = 3,
}

/// Which normalization the norm kernels compute over the last dimension.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Normalization {
    /// LayerNorm: `(x - mean) / sqrt(var + eps) * w (+ b)`.
    Layer,
    /// RMSNorm: `x / sqrt(mean(x^2) + eps) * w (+ b)`.
    Rms,
}

/// Threads of a block in the 1-D launches (8 warps).
const BLOCK: u32 = 256;
/// Rows per chunk the column passes (the norm backward's, the column sums)
/// aim at, and the most chunks they make (bounding their f32 partials to
/// 512 rows of `n` per sum).
const ROWS_PER_CHUNK: usize = 128;
const MAX_CHUNKS: usize = 512;

/// `(chunks, rows_per_chunk)` of a column pass over `rows` rows: every
/// chunk but the last holds `rows_per_chunk` rows and none is empty, so
/// each chunk's partial is written. One chunk for no rows.
fn row_chunks(rows: usize) -> (usize, usize) {
    let chunks = rows.div_ceil(ROWS_PER_CHUNK).clamp(1, MAX_CHUNKS);
    let rows_per_chunk = rows.div_ceil(chunks).max(1);
    (rows.div_ceil(rows_per_chunk).max(1), rows_per_chunk)
}

/// How a kernel's threads map onto its data; [`LayerKernels::config`] turns
/// it into a grid, in one place.
#[derive(Clone, Copy, Debug)]
enum Launch {
    /// One thread per element, grid-stride.
    Elements(usize),
    /// One warp per row, 8 rows per block, grid-stride.
    WarpPerRow(usize),
    /// One block of 256 threads per row, grid-stride.
    BlockPerRow(usize),
    /// A single block of 256 threads.
    OneBlock,
    /// One block of 128 threads per tile of `rows` query or key rows, per
    /// head and sequence.
    Attention {
        time: usize,
        rows: usize,
        heads: usize,
        batch: usize,
    },
    /// Blocks of 32 x 8 threads: 32 columns by `chunks` chunks of rows.
    Columns { n: usize, chunks: usize },
    /// Blocks of 256 threads: one per row (grid-stride) and per 256
    /// columns.
    Segments { rows: usize, columns: usize },
}

/// A grid dimension past CUDA's limit: `(what, value, limit)`.
type PastLimit = (&'static str, usize, usize);

/// The grid of an attention launch, `(heads, batch, tiles)` for tiles of
/// `rows` of `time` positions, or `None` when there is nothing to do; else
/// the dimension past CUDA's limit. CUDA starts a grid's blocks about in
/// linear order, z last: with the tiles in z the kernels rank the blocks
/// by work (`attn_query_tile`, `attn_key_tile` in layers.cu), the heaviest
/// first across the whole grid.
fn attention_grid(
    time: usize,
    rows: usize,
    heads: usize,
    batch: usize,
) -> std::result::Result<Option<(u32, u32, u32)>, PastLimit> {
    let tiles = time.div_ceil(rows);
    if tiles == 0 || heads == 0 || batch == 0 {
        return Ok(None);
    }
    for (what, value, limit) in [
        ("heads", heads, i32::MAX as usize),
        ("batch", batch, 65535),
        ("time tiles", tiles, 65535),
    ] {
        if value > limit {
            return Err((what, value, limit));
        }
    }
    Ok(Some((heads as u32, batch as u32, tiles as u32)))
}

/// The layer kernels, compiled once and loaded into one device's context.
/// Every method queues its launches on the given stream and returns without
/// waiting; buffers are checked against each other first.
#[derive(Debug)]
pub struct LayerKernels {
    ctx: Arc<CudaContext>,
    /// The `compute_XY` NVRTC compiled for.
    arch: String,
    /// Both attention families, and which one this device runs.
    attention: AttentionKernels,
    norm_forward: [CudaFunction; 3],
    residual_norm_forward: [CudaFunction; 3],
    norm_backward_rows: [CudaFunction; 3],
    norm_backward_columns: [CudaFunction; 3],
    norm_backward_finish: [CudaFunction; 3],
    column_sums_partial: [CudaFunction; 3],
    column_sums_finish: [CudaFunction; 3],
    activation_forward: [CudaFunction; 3],
    activation_backward: [CudaFunction; 3],
    activation_recompute_backward: [CudaFunction; 3],
    bias_activation_forward: [CudaFunction; 3],
    gated_forward: [CudaFunction; 3],
    gated_backward: [CudaFunction; 3],
    rotary: [CudaFunction; 3],
    cross_entropy_lse: [CudaFunction; 3],
    /// Per [`LayerElement::INDEX`], then per [`TargetIndex::INDEX`].
    cross_entropy_loss: [[CudaFunction; 2]; 3],
    cross_entropy_backward: [[CudaFunction; 2]; 3],
    /// Per [`TargetIndex::INDEX`] (the ids' type).
    embedding_order: [CudaFunction; 2],
    /// Per [`LayerElement::INDEX`], then per [`TargetIndex::INDEX`].
    embedding_lookup: [[CudaFunction; 2]; 3],
    embedding_backward: [[CudaFunction; 2]; 3],
    /// The cap of grid-stride launches.
    max_blocks: u32,
}

/// Loads `<family>_<type>` for each storage type.
fn per_element(module: &Arc<CudaModule>, family: &str) -> Result<[CudaFunction; 3]> {
    let [a, b, c] = ELEMENT_NAMES.map(|ty| module.load_function(&format!("{family}_{ty}")));
    Ok([a?, b?, c?])
}

/// Loads `<family>_<target>` for each target type.
fn per_target(module: &Arc<CudaModule>, family: &str) -> Result<[CudaFunction; 2]> {
    let [u, i] = TARGET_NAMES.map(|t| module.load_function(&format!("{family}_{t}")));
    Ok([u?, i?])
}

/// Loads `<family>_<type>_<target>` for each storage and target type.
fn per_element_and_target(
    module: &Arc<CudaModule>,
    family: &str,
) -> Result<[[CudaFunction; 2]; 3]> {
    let [a, b, c] = ELEMENT_NAMES.map(|ty| {
        let [u, i] = TARGET_NAMES.map(|t| module.load_function(&format!("{family}_{ty}_{t}")));
        Ok::<_, Error>([u?, i?])
    });
    Ok([a?, b?, c?])
}

/// `value` as a kernel's `int` argument.
fn int_arg(op: &'static str, what: &str, value: usize) -> Result<i32> {
    i32::try_from(value).map_err(|_| {
        Error::from(zero_core::Error::Unsupported {
            op,
            detail: format!(
            "{what} = {value} does not fit the kernels' 32-bit int; split the call into smaller \
             pieces"
        ),
        })
    })
}

/// Fails unless `got == expected` elements.
fn check_len(op: &'static str, what: &'static str, got: usize, expected: usize) -> Result<()> {
    if got == expected {
        Ok(())
    } else {
        Err(Error::from(zero_core::Error::BufferSize {
            op,
            what,
            got,
            expected,
        }))
    }
}

/// The scalar arguments of the cross-entropy kernels with targets, as their
/// C types take them.
#[derive(Clone, Copy, Debug)]
struct CrossEntropyScalars {
    rows: i64,
    vocab: i64,
    has_ignore: i32,
    ignore: i64,
}

impl CrossEntropyScalars {
    fn new(rows: usize, vocab: usize, ignore_index: Option<i64>) -> Self {
        Self {
            rows: rows as i64,
            vocab: vocab as i64,
            has_ignore: i32::from(ignore_index.is_some()),
            ignore: ignore_index.unwrap_or(0),
        }
    }

    /// Queues `kernel`, `cross_entropy_loss_*_*` or
    /// `cross_entropy_backward_*_*`: both take their device pointers
    /// (`pointers`) first and then these four.
    ///
    /// # Safety
    /// `pointers` are the ones `kernel` takes, in its order, and hold what it
    /// indexes for `rows` and `vocab`; `cfg` is the kernel's grid and block.
    unsafe fn launch(
        &self,
        stream: &Arc<CudaStream>,
        kernel: &CudaFunction,
        cfg: LaunchConfig,
        pointers: &[u64],
    ) -> Result<()> {
        let mut launch = stream.launch_builder(kernel);
        for pointer in pointers {
            launch.arg(pointer);
        }
        launch
            .arg(&self.rows)
            .arg(&self.vocab)
            .arg(&self.has_ignore)
            .arg(&self.ignore);
        // SAFETY: the arguments are the kernel's and the buffers fit them, as
        // the caller promises.
        unsafe { launch.launch(cfg) }?;
        Ok(())
    }
}

impl LayerKernels {
    /// Compiles [`LAYER_SOURCE`] with NVRTC for `ctx`'s device and loads it
    /// into `ctx`. Do it once per process and device and share the result:
    /// compilation takes seconds.
    pub fn new(ctx: &Arc<CudaContext>) -> Result<Self> {
        const WHAT: &str = "loading the fused layer kernels";
        let (module, arch) = compile_and_load(ctx, LAYER_SOURCE, WHAT)?;
        guarded(WHAT, || {
            Ok(Self {
                ctx: ctx.clone(),
                attention: AttentionKernels::load(&module, &arch)?,
                arch,
                norm_forward: per_element(&module, "norm_forward")?,
                residual_norm_forward: per_element(&module, "residual_norm_forward")?,
                norm_backward_rows: per_element(&module, "norm_backward_rows")?,
                norm_backward_columns: per_element(&module, "norm_backward_columns")?,
                norm_backward_finish: per_element(&module, "norm_backward_finish")?,
                column_sums_partial: per_element(&module, "column_sums_partial")?,
                column_sums_finish: per_element(&module, "column_sums_finish")?,
                activation_forward: per_element(&module, "activation_forward")?,
                activation_backward: per_element(&module, "activation_backward")?,
                activation_recompute_backward: per_element(
                    &module,
                    "activation_recompute_backward",
                )?,
                bias_activation_forward: per_element(&module, "bias_activation_forward")?,
                gated_forward: per_element(&module, "gated_forward")?,
                gated_backward: per_element(&module, "gated_backward")?,
                rotary: per_element(&module, "rotary")?,
                cross_entropy_lse: per_element(&module, "cross_entropy_lse")?,
                cross_entropy_loss: per_element_and_target(&module, "cross_entropy_loss")?,
                cross_entropy_backward: per_element_and_target(&module, "cross_entropy_backward")?,
                embedding_order: per_target(&module, "embedding_order")?,
                embedding_lookup: per_element_and_target(&module, "embedding_lookup")?,
                embedding_backward: per_element_and_target(&module, "embedding_backward")?,
                max_blocks: max_blocks(ctx)?,
            })
        })
    }

    /// The virtual architecture the kernels were compiled for (`compute_90`, ...).
    pub fn arch(&self) -> &str {
        &self.arch
    }

    /// The context the kernels are loaded in.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// The grid of `launch`, or `None` when there is nothing to do.
    fn config(&self, op: &'static str, launch: Launch) -> Result<Option<LaunchConfig>> {
        let cap = self.max_blocks as usize;
        let one_d = |blocks: usize, threads: u32| {
            (blocks > 0).then(|| LaunchConfig {
                grid_dim: (blocks.min(cap) as u32, 1, 1),
                block_dim: (threads, 1, 1),
                shared_mem_bytes: 0,
            })
        };
        let too_large = |what: &str, value: usize, limit: usize| {
            Error::from(zero_core::Error::Unsupported {
                op,
                detail: format!(
                    "{what} = {value} exceeds CUDA's grid limit of {limit}; split the call into \
                 smaller pieces"
                ),
            })
        };
        Ok(match launch {
            Launch::Elements(n) => one_d(n.div_ceil(BLOCK as usize), BLOCK),
            Launch::WarpPerRow(rows) => one_d(rows.div_ceil(BLOCK as usize / 32), BLOCK),
            Launch::BlockPerRow(rows) => one_d(rows, BLOCK),
            Launch::OneBlock => one_d(1, BLOCK),
            Launch::Attention {
                time,
                rows,
                heads,
                batch,
            } => attention_grid(time, rows, heads, batch)
                .map_err(|(what, value, limit)| too_large(what, value, limit))?
                .map(|grid_dim| LaunchConfig {
                    grid_dim,
                    block_dim: (ATTENTION_THREADS, 1, 1),
                    shared_mem_bytes: 0,
                }),
            Launch::Columns { n, chunks } => {
                if n == 0 || chunks == 0 {
                    return Ok(None);
                }
                if chunks > 65535 {
                    return Err(too_large("row chunks", chunks, 65535));
                }
                Some(LaunchConfig {
                    grid_dim: (n.div_ceil(32) as u32, chunks as u32, 1),
                    block_dim: (32, 8, 1),
                    shared_mem_bytes: 0,
                })
            }
            Launch::Segments { rows, columns } => {
                let column_blocks = columns.div_ceil(BLOCK as usize);
                if rows == 0 || column_blocks == 0 {
                    return Ok(None);
                }
                if column_blocks > 65535 {
                    return Err(too_large("column blocks", column_blocks, 65535));
                }
                Some(LaunchConfig {
                    grid_dim: (rows.min(cap) as u32, column_blocks as u32, 1),
                    block_dim: (BLOCK, 1, 1),
                    shared_mem_bytes: 0,
                })
            }
        })
    }

    /// LayerNorm or RMSNorm over the last dimension: `x` is `[rows, n]` with
    /// `n = weight.len()`; `y = (x - mean) * rstd * (weight_offset + weight)
    /// (+ bias)`, the statistics and the sum `weight_offset + weight` in
    /// f32, the variance around the mean (two passes). Gemma's RMSNorm
    /// scales by `1 + weight` (`weight_offset = 1.0`); `-0.0` adds nothing
    /// to any weight.
    #[allow(clippy::too_many_arguments)]
    pub fn norm_forward<E: LayerElement>(
        &self,
        stream: &Arc<CudaStream>,
        norm: Normalization,
        eps: f32,
        weight_offset: f32,
        x: &impl DevicePtr<E>,
        weight: &impl DevicePtr<E>,
        bias: Option<&dyn DevicePtr<E>>,
        y: &mut impl DevicePtrMut<E>,
    ) -> Result<()> {
        let lens = (x.len(), weight.len(), bias.map(|b| b.len()));
        let outputs = [("y", y.len())];
        let Some((cfg, rows, n, remove_mean)) =
            self.norm_forward_launch("norm_forward", norm, lens, &outputs)?
        else {
            return Ok(());
        };
        let (x, _g0) = x.device_ptr(stream);
        let (w, _g1) = weight.device_ptr(stream);
        // Without a bias the kernel never reads its pointer: pass the weight's.
        let (b, _g2) = match bias {
            Some(bias) => bias.device_ptr(stream),
            None => weight.device_ptr(stream),
        };
        let has_bias = i32::from(bias.is_some());
        let (y, _g3) = y.device_ptr_mut(stream);
        let mut launch = stream.launch_builder(&self.norm_forward[E::INDEX]);
        launch
            .arg(&x)
            .arg(&w)
            .arg(&weight_offset)
            .arg(&b)
            .arg(&has_bias)
            .arg(&y)
            .arg(&rows)
            .arg(&n)
            .arg(&eps)
            .arg(&remove_mean);
        // SAFETY: x and y hold rows * n `E`, weight (and bias when read) n;
        // the arguments match `norm_forward_*`.
        unsafe { launch.launch(cfg) }?;
        Ok(())
    }

    /// The residual add and the norm after it in one pass over the rows:
    /// `h = x + residual` (rounded to `E`, as a separate add rounds it) and
    /// `y` the [`LayerKernels::norm_forward`] of that `h`. Its backward is
    /// [`LayerKernels::norm_backward`] over `h`, whose `dx` is the gradient
    /// of both `x` and `residual` (with `h`'s other uses added).
    #[allow(clippy::too_many_arguments)]
    pub fn residual_norm_forward<E: LayerElement>(
        &self,
        stream: &Arc<CudaStream>,
        norm: Normalization,
        eps: f32,
        weight_offset: f32,
        x: &impl DevicePtr<E>,
        residual: &impl DevicePtr<E>,
        weight: &impl DevicePtr<E>,
        bias: Option<&dyn DevicePtr<E>>,
        h: &mut impl DevicePtrMut<E>,
        y: &mut impl DevicePtrMut<E>,
    ) -> Result<()> {
        let lens = (x.len(), weight.len(), bias.map(|b| b.len()));
        let outputs = [("residual", residual.len()), ("h", h.len()), ("y", y.len())];
        let Some((cfg, rows, n, remove_mean)) =
            self.norm_forward_launch("residual_norm_forward", norm, lens, &outputs)?
        else {
            return Ok(());
        };
        let (x, _g0) = x.device_ptr(stream);
        let (r, _g1) = residual.device_ptr(stream);
        let (w, _g2) = weight.device_ptr(stream);
        // Without a bias the kernel never reads its pointer: pass the weight's.
        let (b, _g3) = match bias {
            Some(bias) => bias.device_ptr(stream),
            None => weight.device_ptr(stream),
        };
        let has_bias = i32::from(bias.is_some());
        let (h, _g4) = h.device_ptr_mut(stream);
        let (y, _g5) = y.device_ptr_mut(stream);
        let mut launch = stream.launch_builder(&self.residual_norm_forward[E::INDEX]);
        launch
            .arg(&x)
            .arg(&r)
            .arg(&w)
            .arg(&weight_offset)
            .arg(&b)
            .arg(&has_bias)
            .arg(&h)
            .arg(&y)
            .arg(&rows)
            .arg(&n)
            .arg(&eps)
            .arg(&remove_mean);
        // SAFETY: x, residual, h and y hold rows * n `E`, weight (and bias
        // when read) n; the arguments match `residual_norm_forward_*`.
        unsafe { launch.launch(cfg) }?;
        Ok(())
    }

    /// The backward of [`LayerKernels::norm_forward`] for upstream gradient
    /// `grad` (`[rows, n]`): `dx` (when given) and the weight's and bias's
    /// gradients `dw`, `db` (`[n]`, summed over rows in a fixed order). The
    /// row statistics are recomputed from `x`. `dx` scales the gradient by
    /// `weight_offset + weight`, as the forward scaled `y`; `dw` is
    /// `Σ_rows grad * x̂` whatever the offset. Three launches, with f32
    /// scratch allocated on `stream`.
    #[allow(clippy::too_many_arguments)]
    pub fn norm_backward<E: LayerElement>(
        &self,
        stream: &Arc<CudaStream>,
        norm: Normalization,
        eps: f32,
        weight_offset: f32,
        x: &impl DevicePtr<E>,
        weight: &impl DevicePtr<E>,
        grad: &impl DevicePtr<E>,
        dx: Option<&mut dyn DevicePtrMut<E>>,
        dw: &mut impl DevicePtrMut<E>,
        db: &mut impl DevicePtrMut<E>,
    ) -> Result<()> {
        const OP: &str = "norm_backward";
        let (rows, n) = Self::norm_rows(OP, x.len(), weight.len())?;
        check_len(OP, "grad", grad.len(), x.len())?;
        if let Some(dx) = &dx {
            check_len(OP, "dx", dx.len(), x.len())?;
        }
        check_len(OP, "dw", dw.len(), n)?;
        check_len(OP, "db", db.len(), n)?;
        let Some(rows_cfg) = self.config(OP, Launch::WarpPerRow(rows))? else {
            // No rows: the sums over rows are zero.
            stream.memset_zeros(dw)?;
            stream.memset_zeros(db)?;
            return Ok(());
        };
        let (chunks, rows_per_chunk) = row_chunks(rows);
        let Some(columns_cfg) = self.config(OP, Launch::Columns { n, chunks })? else {
            return Ok(());
        };
        let Some(finish_cfg) = self.config(OP, Launch::Elements(n))? else {
            return Ok(());
        };
        let n_arg = int_arg(OP, "the normalized width", n)?;
        let chunks_arg = int_arg(OP, "row chunks", chunks)?;
        let rows_arg = rows as i64;
        let rows_per_chunk = rows_per_chunk as i64;
        let remove_mean = i32::from(norm == Normalization::Layer);
        let want_dx = i32::from(dx.is_some());
        // SAFETY: the row pass writes every row's mean and rstd before the
        // column pass reads them, and the column pass writes every partial
        // (2 * chunks * n) before the finish reads them, in stream order.
        let mut stats = unsafe { stream.alloc::<f32>(2 * rows) }?;
        let mut partial = unsafe { stream.alloc::<f32>(2 * chunks * n) }?;
        let (x_ptr, _g0) = x.device_ptr(stream);
        let (w, _g1) = weight.device_ptr(stream);
        let (g, _g2) = grad.device_ptr(stream);
        {
            // Without dx the kernel never writes through its pointer: pass x's.
            let (dx, _g3) = match dx {
                Some(dx) => dx.device_ptr_mut(stream),
                None => x.device_ptr(stream),
            };
            let x = x_ptr;
            let (stats, _g4) = stats.device_ptr_mut(stream);
            let mut launch = stream.launch_builder(&self.norm_backward_rows[E::INDEX]);
            launch
                .arg(&x)
                .arg(&w)
                .arg(&weight_offset)
                .arg(&g)
                .arg(&dx)
                .arg(&stats)
                .arg(&rows_arg)
                .arg(&n_arg)
                .arg(&eps)
                .arg(&remove_mean)
                .arg(&want_dx);
            // SAFETY: x, grad (and dx when written) hold rows * n `E`, weight
            // n, stats 2 * rows f32; the arguments match
            // `norm_backward_rows_*`.
            unsafe { launch.launch(rows_cfg) }?;
        }
        {
            let (stats, _g4) = stats.device_ptr(stream);
            let (partial, _g5) = partial.device_ptr_mut(stream);
            let mut launch = stream.launch_builder(&self.norm_backward_columns[E::INDEX]);
            launch
                .arg(&x_ptr)
                .arg(&g)
                .arg(&stats)
                .arg(&partial)
                .arg(&rows_arg)
                .arg(&n_arg)
                .arg(&rows_per_chunk);
            // SAFETY: the grid's `chunks` row chunks of rows_per_chunk rows
            // cover rows (the last one clipped) and its columns n; partial
            // holds 2 * chunks * n f32; the block is the 32 x 8 the kernel's
            // shared arrays assume; the arguments match
            // `norm_backward_columns_*`.
            unsafe { launch.launch(columns_cfg) }?;
        }
        let (partial, _g5) = partial.device_ptr(stream);
        let (dw, _g6) = dw.device_ptr_mut(stream);
        let (db, _g7) = db.device_ptr_mut(stream);
        let mut launch = stream.launch_builder(&self.norm_backward_finish[E::INDEX]);
        launch
            .arg(&partial)
            .arg(&dw)
            .arg(&db)
            .arg(&n_arg)
            .arg(&chunks_arg);
        // SAFETY: partial holds 2 * chunks * n f32, dw and db n `E`; the
        // arguments match `norm_backward_finish_*`.
        unsafe { launch.launch(finish_cfg) }?;
        Ok(())
    }

    /// `(rows, n)` of a norm over `x_len` elements with a weight of `n`.
    /// The forward norms' checks (`x` whole rows of the weight's width, the
    /// bias that wide, each of `same_as_x` as long as `x`) and launch:
    /// `None` for no rows, else the configuration and the kernels' `rows`,
    /// `n` and `remove_mean` arguments.
    fn norm_forward_launch(
        &self,
        op: &'static str,
        norm: Normalization,
        (x_len, weight_len, bias_len): (usize, usize, Option<usize>),
        same_as_x: &[(&'static str, usize)],
    ) -> Result<Option<(LaunchConfig, i64, i32, i32)>> {
        let (rows, n) = Self::norm_rows(op, x_len, weight_len)?;
        if let Some(len) = bias_len {
            check_len(op, "bias", len, n)?;
        }
        for &(name, len) in same_as_x {
            check_len(op, name, len, x_len)?;
        }
        let Some(cfg) = self.config(op, Launch::WarpPerRow(rows))? else {
            return Ok(None);
        };
        let n = int_arg(op, "the normalized width", n)?;
        let remove_mean = i32::from(norm == Normalization::Layer);
        Ok(Some((cfg, rows as i64, n, remove_mean)))
    }

    fn norm_rows(op: &'static str, x_len: usize, n: usize) -> Result<(usize, usize)> {
        if n == 0 || x_len % n != 0 {
            return Err(Error::from(zero_core::Error::Unsupported {
                op,
                detail: format!(
                    "x has {x_len} elements, not a whole number of rows of the weight's {n}; \
                     the weight must have the size of x's last dimension"
                ),
            }));
        }
        Ok((x_len / n, n))
    }

    /// Cross-entropy of `logits` (`[rows, vocab]`, `rows = targets.len()`)
    /// against class indices `targets`: `loss[0]` is the mean over the rows
    /// whose target is not `ignore_index` of `logsumexp(row) - row[target]`.
    /// `saved` (`rows + 1` f32) receives each row's log-sum-exp and then the
    /// number of counted rows, for [`LayerKernels::cross_entropy_backward`].
    ///
    /// With every row ignored the loss is NaN (as PyTorch's). A target
    /// outside `[0, vocab)` that is not the ignore index is never read
    /// through: it makes the loss NaN (and its row's gradient NaN).
    #[allow(clippy::too_many_arguments)]
    pub fn cross_entropy_forward<E: LayerElement, I: TargetIndex>(
        &self,
        stream: &Arc<CudaStream>,
        ignore_index: Option<i64>,
        logits: &impl DevicePtr<E>,
        targets: &impl DevicePtr<I>,
        loss: &mut impl DevicePtrMut<f32>,
        saved: &mut impl DevicePtrMut<f32>,
    ) -> Result<()> {
        const OP: &str = "cross_entropy_forward";
        let (rows, vocab) = Self::cross_entropy_rows(OP, logits.len(), targets.len())?;
        check_len(OP, "loss", loss.len(), 1)?;
        check_len(OP, "saved", saved.len(), rows + 1)?;
        let scalars = CrossEntropyScalars::new(rows, vocab, ignore_index);
        let (logits, _g0) = logits.device_ptr(stream);
        let (targets, _g1) = targets.device_ptr(stream);
        let (saved, _g2) = saved.device_ptr_mut(stream);
        let (loss, _g3) = loss.device_ptr_mut(stream);
        if let Some(cfg) = self.config(OP, Launch::BlockPerRow(rows))? {
            let mut launch = stream.launch_builder(&self.cross_entropy_lse[E::INDEX]);
            launch
                .arg(&logits)
                .arg(&saved)
                .arg(&scalars.rows)
                .arg(&scalars.vocab);
            // SAFETY: logits hold rows * vocab `E`, saved rows + 1 f32; the
            // block is the 256 threads the kernel's shared arrays assume;
            // the arguments match `cross_entropy_lse_*`.
            unsafe { launch.launch(cfg) }?;
        }
        if let Some(cfg) = self.config(OP, Launch::OneBlock)? {
            let kernel = &self.cross_entropy_loss[E::INDEX][I::INDEX];
            // SAFETY: as above, targets hold rows `I` and loss one f32; the
            // kernel reads a logit only for a target in [0, vocab); one block
            // of 256 threads, as its shared arrays assume; the pointers are
            // those of `cross_entropy_loss_*_*`.
            unsafe { scalars.launch(stream, kernel, cfg, &[logits, targets, saved, loss]) }?;
        }
        Ok(())
    }

    /// The gradient of [`LayerKernels::cross_entropy_forward`]'s loss with
    /// respect to `logits`, for the loss's gradient `grad_loss` (one f32,
    /// read on the device): `grad / count * (softmax(row) - onehot(target))`,
    /// zero rows for ignored targets. `saved` is the forward's.
    #[allow(clippy::too_many_arguments)]
    pub fn cross_entropy_backward<E: LayerElement, I: TargetIndex>(
        &self,
        stream: &Arc<CudaStream>,
        ignore_index: Option<i64>,
        logits: &impl DevicePtr<E>,
        targets: &impl DevicePtr<I>,
        saved: &impl DevicePtr<f32>,
        grad_loss: &impl DevicePtr<f32>,
        dlogits: &mut impl DevicePtrMut<E>,
    ) -> Result<()> {
        const OP: &str = "cross_entropy_backward";
        let (rows, vocab) = Self::cross_entropy_rows(OP, logits.len(), targets.len())?;
        check_len(OP, "saved", saved.len(), rows + 1)?;
        check_len(OP, "grad_loss", grad_loss.len(), 1)?;
        check_len(OP, "dlogits", dlogits.len(), logits.len())?;
        let Some(cfg) = self.config(OP, Launch::BlockPerRow(rows))? else {
            return Ok(());
        };
        let scalars = CrossEntropyScalars::new(rows, vocab, ignore_index);
        let (logits, _g0) = logits.device_ptr(stream);
        let (targets, _g1) = targets.device_ptr(stream);
        let (saved, _g2) = saved.device_ptr(stream);
        let (grad, _g3) = grad_loss.device_ptr(stream);
        let (dlogits, _g4) = dlogits.device_ptr_mut(stream);
        let kernel = &self.cross_entropy_backward[E::INDEX][I::INDEX];
        let pointers = [logits, targets, saved, grad, dlogits];
        // SAFETY: logits and dlogits hold rows * vocab `E`, targets rows `I`,
        // saved rows + 1 f32 and grad_loss one; the kernel reads no logit
        // through a target; the pointers are those of
        // `cross_entropy_backward_*_*`.
        unsafe { scalars.launch(stream, kernel, cfg, &pointers) }
    }

    /// `(rows, vocab)` of logits of `logits_len` elements with `rows` targets.
    fn cross_entropy_rows(
        op: &'static str,
        logits_len: usize,
        rows: usize,
    ) -> Result<(usize, usize)> {
        if rows == 0 {
            check_len(op, "logits (no targets)", logits_len, 0)?;
            return Ok((0, 0));
        }
        if logits_len % rows != 0 {
            return Err(Error::from(zero_core::Error::Unsupported {
                op,
                detail: format!(
                    "logits have {logits_len} elements, not a whole number of rows for {rows} \
                     targets; pass logits [rows, vocab] and one target per row"
                ),
            }));
        }
        Ok((rows, logits_len / rows))
    }
}

#[cfg(test)]
mod tests {
    use super::attention::{HEAD_DIM_VARIANTS, TENSOR_CORE_NAMES};
    use super::*;

    #[test]
    fn attention_grids_put_the_tiles_last_for_the_kernels_to_rank_by_work() {
        assert_eq!(attention_grid(2048, 64, 32, 4), Ok(Some((32, 4, 32))));
        assert_eq!(attention_grid(65, 64, 3, 2), Ok(Some((3, 2, 2))));
        for empty in [(0, 64, 1, 1), (1, 64, 0, 1), (1, 64, 1, 0)] {
            assert_eq!(attention_grid(empty.0, empty.1, empty.2, empty.3), Ok(None));
        }
        assert_eq!(
            attention_grid(16 * 65536, 16, 1, 1),
            Err(("time tiles", 65536, 65535))
        );
        assert_eq!(
            attention_grid(16, 16, 1, 65536),
            Err(("batch", 65536, 65535))
        );
        // Both families read the grid so: the last query tile first, the
        // first key tile first (the CPU harnesses run them on such grids).
        assert!(LAYER_SOURCE.contains("return (gridDim.z - 1 - blockIdx.z) * rows;"));
        assert!(LAYER_SOURCE.contains("return blockIdx.z * rows;"));
    }

    /// The names `LayerKernels::new` builds, in its order.
    fn loaded_names() -> Vec<String> {
        let mut names = Vec::new();
        for ty in ELEMENT_NAMES {
            for dmax in HEAD_DIM_VARIANTS {
                for family in ["forward", "backward_dq", "backward_dkdv"] {
                    names.push(format!("attention_{family}_d{dmax}_{ty}"));
                    if TENSOR_CORE_NAMES.contains(&ty) {
                        names.push(format!("attention_tc_{family}_d{dmax}_{ty}"));
                    }
                }
            }
            for family in [
                "attention_backward_delta",
                "norm_forward",
                "residual_norm_forward",
                "norm_backward_rows",
                "norm_backward_columns",
                "norm_backward_finish",
                "column_sums_partial",
                "column_sums_finish",
                "activation_forward",
                "activation_backward",
                "activation_recompute_backward",
                "bias_activation_forward",
                "gated_forward",
                "gated_backward",
                "rotary",
                "cross_entropy_lse",
            ] {
                names.push(format!("{family}_{ty}"));
            }
            for family in [
                "cross_entropy_loss",
                "cross_entropy_backward",
                "embedding_lookup",
                "embedding_backward",
            ] {
                for t in TARGET_NAMES {
                    names.push(format!("{family}_{ty}_{t}"));
                }
            }
        }
        for t in TARGET_NAMES {
            names.push(format!("embedding_order_{t}"));
        }
        names
    }

    #[test]
    fn the_name_list_is_what_new_loads() {
        let mut loaded = loaded_names();
        let mut listed: Vec<String> = LAYER_KERNEL_NAMES.iter().map(|s| s.to_string()).collect();
        loaded.sort();
        listed.sort();
        assert_eq!(loaded, listed);
    }

    #[test]
    fn every_listed_kernel_is_defined_in_the_source() {
        // The source defines kernels through macros: each family's macro
        // stem must be there, and each kernel's suffix type.
        for name in LAYER_KERNEL_NAMES {
            let family = name
                .trim_end_matches("_u32")
                .trim_end_matches("_i64")
                .trim_end_matches("_f32")
                .trim_end_matches("_bf16")
                .trim_end_matches("_f16")
                .trim_end_matches("_d64")
                .trim_end_matches("_d128");
            assert!(LAYER_SOURCE.contains(family), "{family} ({name})");
        }
    }

    #[test]
    fn block_shapes_match_the_source() {
        // The 256-thread blocks of cross-entropy and of the embedding
        // gradient (launched as `Launch::Elements` and `Launch::Segments`),
        // and the 32 x 8 of the column passes, the norm backward's and the
        // column sums' (attention's: attention.rs).
        assert!(LAYER_SOURCE.contains("#define CE_THREADS 256"));
        assert!(LAYER_SOURCE.contains("#define EMB_THREADS 256"));
        assert_eq!(BLOCK, 256);
        assert!(LAYER_SOURCE.contains("#define NORM_COL_ROWS 8"));
    }

    #[test]
    fn row_chunks_cover_the_rows_without_an_empty_chunk() {
        assert_eq!(row_chunks(0), (1, 1));
        assert_eq!(row_chunks(1), (1, 1));
        assert_eq!(row_chunks(129), (2, 65));
        assert_eq!(row_chunks(1001), (8, 126));
        // The cap: 547 chunks of 128 would be wanted; 511 of 137 are made.
        assert_eq!(row_chunks(70_001), (511, 137));
        for rows in (1..5000).chain([65_535, 65_536, 65_537, 1 << 20, 10_000_019]) {
            let (chunks, per_chunk) = row_chunks(rows);
            assert!((1..=MAX_CHUNKS).contains(&chunks), "{rows}: {chunks}");
            assert!(chunks * per_chunk >= rows, "{rows}: rows left over");
            assert!(
                (chunks - 1) * per_chunk < rows,
                "{rows}: an empty last chunk"
            );
        }
    }

    #[test]
    fn row_counts_are_derived_and_checked() {
        assert_eq!(LayerKernels::norm_rows("t", 12, 4).unwrap(), (3, 4));
        assert!(LayerKernels::norm_rows("t", 12, 5).is_err());
        assert!(LayerKernels::norm_rows("t", 0, 0).is_err());
        assert_eq!(LayerKernels::norm_rows("t", 0, 4).unwrap(), (0, 4));
        assert_eq!(
            LayerKernels::cross_entropy_rows("t", 12, 3).unwrap(),
            (3, 4)
        );
        assert!(LayerKernels::cross_entropy_rows("t", 12, 5).is_err());
        assert_eq!(LayerKernels::cross_entropy_rows("t", 0, 0).unwrap(), (0, 0));
        assert!(LayerKernels::cross_entropy_rows("t", 3, 0).is_err());
    }

    #[test]
    fn int_arguments_refuse_overflow_by_name() {
        assert_eq!(int_arg("t", "time", 7).unwrap(), 7);
        let err = int_arg("t", "time", 1 << 31).unwrap_err().to_string();
        assert!(err.contains("time = 2147483648"), "{err}");
    }
}
