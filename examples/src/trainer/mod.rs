//! The `train` binary's logic: flags, data, models (an MLP on rows, a GPT
//! on text) and the per-rank loop, kept in the library so tests can run it
//! in-process.

mod args;
mod data;
mod gpt;
mod model;
mod plot;
mod text;

pub use args::{
    Args, Backend, ModelKind, OffloadArg, OptimizerKind, OverlapArg, PartitionerArg, Precision,
};
pub use data::Dataset;
pub use gpt::{Gpt, GptConfig, GptOps, VOCAB};
pub use model::{copy_vars, read_weights, Mlp};
pub use plot::LossHistory;
pub use text::{TextData, DEFAULT_CORPUS_DIR};

use candle_core::{DType, Device, Tensor, WithDType};
use indicatif::{ProgressBar, ProgressStyle};
use serde::Serialize;
use std::io::{IsTerminal, Write};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};
use zero_candle::nn::GradHook;
use zero_candle::{CandleMemory, ShardedVarMap, ZeroHook, ZeroOptimizer};
use zero_core::checkpoint::Manifest;
use zero_core::comm::Host;
use zero_core::engine::{
    EngineConfig, LossScale, MemoryReport, NormType, Offload, Overlap, PartitionerKind,
    SaveOptions, Stage, StepReport,
};
use zero_core::optim::Float;
use zero_core::{Communicator, Element, ReduceOp, ThreadGroup};

/// Why training stopped.
#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    /// Bad flags.
    #[error("{0}")]
    Usage(String),
    /// A data, weights or metrics file is unusable.
    #[error("{path}: {detail}")]
    Data {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        detail: String,
    },
    /// The engine, a communicator or a checkpoint failed.
    #[error(transparent)]
    Zero(#[from] zero_core::Error),
    /// The Candle adapter failed.
    #[error(transparent)]
    Adapter(#[from] zero_candle::Error),
    /// Candle failed.
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
    /// A rank failed; the message says which and why.
    #[error("rank {rank}: {source}")]
    Rank {
        /// The rank.
        rank: usize,
        /// What happened.
        source: Box<TrainError>,
    },
    /// A broken internal invariant.
    #[error("internal error: {0}")]
    Internal(String),
}

/// One line of `--metrics`.
#[derive(Debug, Serialize)]
pub struct StepMetrics {
    /// Optimizer step, from 1.
    pub step: u64,
    /// Mean loss over the global batch of the step.
    pub loss: f64,
    /// Mean loss over the validation windows (GPT, at `--eval-every`
    /// steps).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub val_loss: Option<f64>,
    /// Learning rate used.
    pub lr: f64,
    /// Global gradient norm (L2) before clipping.
    pub grad_norm: Option<f64>,
    /// Wall time of the step in seconds.
    pub step_time_s: f64,
    /// Tokens (bytes) of the global batch per second of step time (GPT).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tokens_per_s: Option<f64>,
    /// Bytes rank 0 sent during the step.
    pub bytes_sent: u64,
    /// Rank 0's engine buffers, per category (the engine's own count).
    pub memory: MemoryReport,
    /// The loss scale the step's gradients were divided by (with loss
    /// scaling).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub loss_scale: Option<f64>,
    /// Whether the step was skipped for an inf/NaN gradient (loss scaling).
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub skipped: bool,
    /// The process's peak heap bytes so far (all ranks of a threads run),
    /// as counted by the binary's allocator; absent when not counted.
    pub peak_heap_bytes: Option<usize>,
    /// GPU backends: rank 0's device peak so far (the high-water mark of
    /// the device's stream-ordered memory pool: model, activations,
    /// gradients and the engine's buffers), when the device can tell.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub device_peak_bytes: Option<u64>,
    /// Stage 3, once sharded: rank 0's parameter gathers so far.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gathers: Option<GatherMetrics>,
    /// `--offload optimizer` on a GPU: where rank 0's host time went so far.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub offload: Option<OffloadMetrics>,
}

/// Rank 0's offloaded steps so far (`--metrics`; see
/// [`zero_core::engine::OffloadTimes`]), in milliseconds summed over
/// `steps`.
#[derive(Debug, Serialize)]
pub struct OffloadMetrics {
    /// Steps whose host stepped each bucket as it landed.
    pub steps: u64,
    /// The step thread, waiting for buckets' copies into host memory.
    pub landing_ms: f64,
    /// The step thread, stepping buckets.
    pub stepping_ms: f64,
    /// The step thread, rounding a 16-bit model's stepped weights for the
    /// write-back.
    pub packing_ms: f64,
    /// Waiting after backward for the step thread's last buckets.
    pub join_ms: f64,
    /// Writing the stepped weights back into the model.
    pub write_back_ms: f64,
}

/// Rank 0's stage 3 parameter gathers so far (`--metrics`).
#[derive(Debug, Serialize)]
pub struct GatherMetrics {
    /// Requests whose gather had been issued ahead (prefetched).
    pub prefetch_hits: u64,
    /// Requests that issued their own gather.
    pub prefetch_misses: u64,
    /// Whether gathers run on a thread of their own (only then can one be
    /// issued ahead: not under MPI without `MPI_THREAD_MULTIPLE`).
    pub on_thread: bool,
}

/// What a finished run reports.
#[derive(Debug, Clone)]
pub struct Summary {
    /// Loss of the last step.
    pub final_loss: f64,
    /// Steps run (including those before a resume).
    pub steps: u64,
    /// The last validation loss measured (GPT with `--eval-every`).
    pub val_loss: Option<f64>,
    /// The bytes `--sample` generated (GPT, rank 0).
    pub sample: Option<Vec<u8>>,
    /// Steps whose all-gathers ran into the next forward (rank 0;
    /// `--defer-gathers`).
    pub deferred_steps: u64,
}

/// What a run trains on: rows for the MLP, text for the GPT.
#[derive(Clone, Debug)]
pub enum TrainingData {
    /// Rows of inputs and class targets.
    Rows(Dataset),
    /// Bytes of text.
    Text(TextData),
}

impl TrainingData {
    /// The data `--model` and `--data` name.
    pub fn from_args(args: &Args) -> Result<Self, TrainError> {
        Ok(match args.model {
            ModelKind::Mlp => Self::Rows(match &args.data {
                Some(path) => Dataset::load(path)?,
                None => Dataset::synthetic(args.seed),
            }),
            ModelKind::Gpt => {
                let context = args.context as usize;
                Self::Text(match &args.data {
                    Some(path) => TextData::load(path, context)?,
                    None => TextData::default_corpus(context)?,
                })
            }
        })
    }
}

/// `--timeout-s` as a duration (every backend's collective deadline).
fn timeout(args: &Args) -> Result<Duration, TrainError> {
    Duration::try_from_secs_f64(args.timeout_s).map_err(|e| {
        TrainError::Usage(format!(
            "--timeout-s {} is not a usable duration ({e}); give seconds, e.g. 300",
            args.timeout_s
        ))
    })
}

/// Runs training as the flags say; the backend decides how ranks start.
pub fn run(args: &Args) -> Result<Summary, TrainError> {
    validate(args)?;
    let data = Arc::new(TrainingData::from_args(args)?);
    match args.backend {
        Backend::Threads => {
            let world_size = args.world_size as usize;
            let group = ThreadGroup::new(world_size).with_timeout(timeout(args)?);
            let results = group.run(|comm| train_rank(args, comm, &data));
            collect(results)
        }
        Backend::Mpi => run_mpi(args, &data),
        Backend::Nccl => run_nccl(args, &data),
        Backend::CudaThreads => run_cuda_threads(args, &data),
    }
}

#[cfg(feature = "nccl")]
fn run_nccl(args: &Args, data: &Arc<TrainingData>) -> Result<Summary, TrainError> {
    use zero_nccl::NcclComm;
    let comm = NcclComm::from_env()
        .map_err(zero_core::Error::from)?
        .with_timeout(timeout(args)?);
    let device = Device::new_cuda(comm.context().ordinal())?;
    train_gpu_rank(args, comm, device, data)
}

/// `--backend cuda-threads`: the ranks as threads sharing GPU 0, each with
/// its own Candle stream.
#[cfg(feature = "nccl")]
fn run_cuda_threads(args: &Args, data: &Arc<TrainingData>) -> Result<Summary, TrainError> {
    use zero_nccl::{CudaThreadGroup, DeviceComm};
    let group = CudaThreadGroup::new(args.world_size as usize).with_timeout(timeout(args)?);
    let results = group.run(|comm| {
        let device = Device::new_cuda_with_stream(comm.context().ordinal());
        Ok(device
            .map_err(TrainError::from)
            .and_then(|device| train_gpu_rank(args, comm, device, data)))
    })?;
    collect(results)
}

/// One rank's training on a GPU backend, the model on `device`.
#[cfg(feature = "nccl")]
fn train_gpu_rank<C>(
    args: &Args,
    comm: C,
    device: Device,
    data: &TrainingData,
) -> Result<Summary, TrainError>
where
    C: zero_nccl::DeviceComm,
{
    let (rank, world_size) = (comm.rank(), comm.world_size());
    let map = model_vars(args)?;
    let hook = zero_candle::ZeroHook::<C, f32>::new();
    let model = Model::new(args, data, &map, &device, hook.clone())?;
    let mut opt = ZeroOptimizer::<C, f32>::new_sharded(
        &map,
        comm,
        engine_config(args),
        crate::optimizers::build(args)?,
        &hook,
    )?;
    let ctx = LoopContext {
        args,
        rank,
        world_size,
        device: &device,
        model: &model,
    };
    train_loop(&ctx, &mut opt)
}

#[cfg(not(feature = "nccl"))]
fn run_nccl(_: &Args, _: &Arc<TrainingData>) -> Result<Summary, TrainError> {
    Err(TrainError::Usage(
        "--backend nccl trains on GPUs and needs a build with `--features nccl` on a machine \
         with CUDA; launch one process per GPU with `torchrun`-style variables or `mpirun`"
            .into(),
    ))
}

#[cfg(not(feature = "nccl"))]
fn run_cuda_threads(_: &Args, _: &Arc<TrainingData>) -> Result<Summary, TrainError> {
    Err(TrainError::Usage(
        "--backend cuda-threads trains on a GPU and needs a build with `--features nccl` on a \
         machine with CUDA"
            .into(),
    ))
}

#[cfg(feature = "mpi")]
fn run_mpi(args: &Args, data: &Arc<TrainingData>) -> Result<Summary, TrainError> {
    use zero_mpi_gloo::MpiComm;
    let timeout = timeout(args)?;
    let comm = MpiComm::init()
        .map_err(zero_core::Error::from)?
        .with_timeout(Some(timeout));
    comm.abort_on_panic();
    // A second handle on the same ranks outlives the optimizer, so a rank
    // that fails can end the whole job (naming itself) instead of leaving
    // its peers waiting in a collective. Split after the deadline is set:
    // the split inherits it.
    let everyone: Vec<usize> = (0..comm.world_size()).collect();
    let keeper = comm
        .split(&everyone)?
        .ok_or_else(|| TrainError::Internal("this rank is missing from its own world".into()))?;
    match train_rank(args, comm, data) {
        Ok(summary) => Ok(summary),
        Err(e) => keeper.abort(&e.to_string()),
    }
}

#[cfg(not(feature = "mpi"))]
fn run_mpi(_: &Args, _: &Arc<TrainingData>) -> Result<Summary, TrainError> {
    Err(TrainError::Usage(
        "--backend mpi needs a build with `--features mpi` (and Open MPI installed); \
         launch with `mpirun -n N target/release/train --backend mpi ...`"
            .into(),
    ))
}

/// Turns per-rank results into one: rank 0's summary, or the failure that
/// caused the others (a rank's own error beats its peers' reports of it).
fn collect(
    results: Vec<zero_core::Result<Result<Summary, TrainError>>>,
) -> Result<Summary, TrainError> {
    let mut failures = Vec::new();
    let mut summary = None;
    for (rank, result) in results.into_iter().enumerate() {
        match result {
            Ok(Ok(s)) if rank == 0 => summary = Some(s),
            Ok(Ok(_)) => {}
            Ok(Err(e)) => failures.push(TrainError::Rank {
                rank,
                source: Box::new(e),
            }),
            Err(e) => failures.push(TrainError::Rank {
                rank,
                source: Box::new(TrainError::Zero(e)),
            }),
        }
    }
    // Peers of a failed rank report it as a failed peer or a timeout.
    let is_echo = |e: &TrainError| {
        let TrainError::Rank { source, .. } = e else {
            return false;
        };
        let zero = match source.as_ref() {
            TrainError::Zero(z) | TrainError::Adapter(zero_candle::Error::Zero(z)) => z,
            _ => return false,
        };
        matches!(
            zero,
            zero_core::Error::PeerFailed { .. } | zero_core::Error::CollectiveTimeout { .. }
        )
    };
    if let Some(i) = failures.iter().position(|e| !is_echo(e)) {
        return Err(failures.swap_remove(i));
    }
    match (failures.into_iter().next(), summary) {
        (Some(e), _) => Err(e),
        (None, Some(s)) => Ok(s),
        (None, None) => Err(TrainError::Internal("no rank returned".into())),
    }
}

fn validate(args: &Args) -> Result<(), TrainError> {
    if args.checkpoint_activations && args.model != ModelKind::Gpt {
        return Err(TrainError::Usage(
            "--checkpoint-activations recomputes the GPT's blocks; use it with --model gpt".into(),
        ));
    }
    if args.hidden.contains(&0) {
        return Err(TrainError::Usage("--hidden widths must be positive".into()));
    }
    if !(args.lr.is_finite() && args.lr >= 0.0) {
        return Err(TrainError::Usage(format!("--lr {} must be >= 0", args.lr)));
    }
    if !(args.bucket_mb.is_finite() && args.bucket_mb > 0.0) {
        return Err(TrainError::Usage(format!(
            "--bucket-mb {} must be positive",
            args.bucket_mb
        )));
    }
    if args.overlap == Some(OverlapArg::Interleaved) && args.clip_norm.is_some() {
        return Err(TrainError::Usage(
            "--overlap interleaved steps each bucket before the other gradients exist, so it \
             cannot clip by the global norm; drop --clip-norm or use --overlap after-backward"
                .into(),
        ));
    }
    if args.defer_gathers && (args.stage == 0 || overlap(args) == OverlapArg::None) {
        return Err(TrainError::Usage(
            "--defer-gathers defers the all-gathers of stages 1 and 2 after an overlapped step; \
             use it with --stage 1 or 2 and --overlap after-backward or interleaved"
                .into(),
        ));
    }
    if let Some(c) = args.clip_norm {
        if !(c.is_finite() && c > 0.0) {
            return Err(TrainError::Usage(format!(
                "--clip-norm {c} must be positive"
            )));
        }
    }
    if !(args.timeout_s.is_finite() && args.timeout_s > 0.0) {
        return Err(TrainError::Usage("--timeout-s must be positive".into()));
    }
    if args.model == ModelKind::Gpt {
        gpt_config(args).validate()?;
    } else if args.sample > 0 {
        return Err(TrainError::Usage(
            "--sample generates text and needs --model gpt".into(),
        ));
    }
    if !(args.temperature.is_finite() && args.temperature >= 0.0) {
        return Err(TrainError::Usage(format!(
            "--temperature {} must be >= 0 (0 picks the most likely byte)",
            args.temperature
        )));
    }
    if loss_scale(args)? != LossScale::None && args.overlap == Some(OverlapArg::Interleaved) {
        return Err(TrainError::Usage(
            "loss scaling (--loss-scale, on by default for --precision f16) decides after \
             backward whether to step; --overlap interleaved steps during backward: use \
             --overlap after-backward"
                .into(),
        ));
    }
    if args.offload == OffloadArg::Optimizer && !args.backend.on_gpu() {
        return Err(TrainError::Usage(
            "--offload optimizer moves a GPU model's optimizer side to host memory; with \
             --backend threads or mpi everything is in host memory already: drop --offload, or \
             train on --backend nccl or cuda-threads"
                .into(),
        ));
    }
    if args.offload_copy_stream && args.offload != OffloadArg::Optimizer {
        return Err(TrainError::Usage(
            "--offload-copy-stream puts offload's transfers on a stream of their own: use it \
             with --offload optimizer"
                .into(),
        ));
    }
    if args.offload == OffloadArg::Optimizer && args.stage == 0 {
        return Err(TrainError::Usage(
            "--offload optimizer moves the optimizer's shard to host memory: use it with \
             --stage 1, 2 or 3 (stage 0 has no shard)"
                .into(),
        ));
    }
    if args.backend.on_gpu() && (args.no_master_weights || args.reduce_in_param_dtype) {
        return Err(TrainError::Usage(
            "the GPU backends train 16-bit models with f32 master weights and reduce their \
             gradients in f32; drop --no-master-weights and --reduce-in-param-dtype"
                .into(),
        ));
    }
    if args.reduce_in_param_dtype && (args.precision == Precision::F32 || args.no_master_weights) {
        return Err(TrainError::Usage(
            "--reduce-in-param-dtype applies to --precision bf16 or f16 with master weights".into(),
        ));
    }
    if args.no_master_weights && args.precision == Precision::F32 {
        return Err(TrainError::Usage(
            "--no-master-weights applies to --precision bf16 or f16".into(),
        ));
    }
    if args.checkpoint_every > 0 && args.checkpoint_dir.is_none() {
        return Err(TrainError::Usage(
            "--checkpoint-every needs --checkpoint-dir".into(),
        ));
    }
    Ok(())
}

/// The loss scaling `--loss-scale` asks for (by default dynamic for f16,
/// none otherwise).
fn loss_scale(args: &Args) -> Result<LossScale, TrainError> {
    let scale = match args.loss_scale.as_deref() {
        None if args.precision == Precision::F16 => LossScale::dynamic(),
        None | Some("none") => LossScale::None,
        Some("dynamic") => LossScale::dynamic(),
        Some(fixed) => match fixed.parse::<f64>() {
            Ok(v) if v.is_finite() && v > 0.0 => LossScale::Fixed(v),
            _ => {
                return Err(TrainError::Usage(format!(
                    "--loss-scale {fixed:?}: use dynamic, none, or a positive number"
                )))
            }
        },
    };
    Ok(scale)
}

/// The schedule: `--overlap`, or where it is not given, interleaved for
/// an offloaded stage 1 or 2 without clipping or loss scaling (the host
/// steps each bucket as it lands, beside backward, instead of all of them
/// after it), after-backward otherwise.
pub fn overlap(args: &Args) -> OverlapArg {
    args.overlap.unwrap_or_else(|| {
        let steps_early = args.offload == OffloadArg::Optimizer
            && matches!(args.stage, 1 | 2)
            && args.clip_norm.is_none()
            && loss_scale(args).unwrap_or_default() == LossScale::None;
        if steps_early {
            OverlapArg::Interleaved
        } else {
            OverlapArg::AfterBackward
        }
    })
}

/// The engine configuration the flags describe.
pub fn engine_config(args: &Args) -> EngineConfig {
    let mut config = EngineConfig::default()
        .with_stage(match args.stage {
            0 => Stage::Ddp,
            1 => Stage::OptimizerState,
            2 => Stage::Gradients,
            _ => Stage::Parameters,
        })
        .with_persist_numel(args.persist_numel)
        .with_prefetch_bytes((args.prefetch_mb * (1 << 20) as f64) as usize)
        .with_gather_bytes((args.gather_mb * (1 << 20) as f64) as usize)
        .with_max_live_bytes(((args.max_live_mb * (1 << 20) as f64) as usize).max(1))
        .with_partitioner(match args.partitioner {
            PartitionerArg::Flat => PartitionerKind::Flat,
            PartitionerArg::Greedy => PartitionerKind::Greedy,
        })
        .with_bucket_bytes(((args.bucket_mb * (1 << 20) as f64) as usize).max(1))
        .with_grad_accum_steps(args.grad_accum as usize)
        .with_overlap(match overlap(args) {
            OverlapArg::None => Overlap::None,
            OverlapArg::AfterBackward => Overlap::AfterBackward,
            OverlapArg::Interleaved => Overlap::Interleaved,
        })
        // The norm needs every gradient: the interleaved schedule has none.
        .with_grad_norm(overlap(args) != OverlapArg::Interleaved)
        // Validated by `run` before any rank starts.
        .with_loss_scale(loss_scale(args).unwrap_or_default())
        .with_reduce_in_param_dtype(args.reduce_in_param_dtype)
        .with_defer_gathers(args.defer_gathers)
        .with_offload(
            match args.offload {
                OffloadArg::None => Offload::None,
                OffloadArg::Optimizer => Offload::Optimizer,
            },
            args.offload_threads,
        )
        .with_offload_pin_memory(args.offload_pinned)
        .with_offload_copy_stream(args.offload_copy_stream);
    if let Some(max_norm) = args.clip_norm {
        config = config.with_clip(max_norm, NormType::L2);
    }
    config
}

/// The model's layer widths: data width, `--hidden`, classes.
fn widths(args: &Args, data: &Dataset) -> Vec<usize> {
    let mut widths = vec![data.width];
    widths.extend(&args.hidden);
    widths.push(data.classes);
    widths
}

/// The GPT shape the flags describe.
fn gpt_config(args: &Args) -> GptConfig {
    GptConfig {
        layers: args.layers as usize,
        heads: args.heads as usize,
        d_model: args.d_model as usize,
        context: args.context as usize,
    }
}

/// Where the model's variables come from: `--init`'s file (memory-mapped)
/// or the seed; created without values, for the optimizer to fill (at
/// stage 3 each rank only its shard of the large ones).
fn model_vars(args: &Args) -> Result<ShardedVarMap, TrainError> {
    Ok(match &args.init {
        Some(path) => ShardedVarMap::from_safetensors(path).map_err(|e| TrainError::Data {
            path: path.clone(),
            detail: format!("cannot initialize from it: {e}"),
        })?,
        None => ShardedVarMap::seeded(args.seed),
    })
}

/// The model a rank trains, with the data it reads.
enum Model<'a> {
    Mlp(Mlp, &'a Dataset),
    Gpt(Gpt, &'a TextData),
}

impl<'a> Model<'a> {
    /// Creates the variables through `map`, the same on every rank. The
    /// layers hand their gradients to `hook` during backward.
    fn new(
        args: &Args,
        data: &'a TrainingData,
        map: &ShardedVarMap,
        device: &Device,
        hook: Arc<dyn GradHook>,
    ) -> Result<Self, TrainError> {
        let hook = Some(hook);
        let dtype = args.precision.dtype();
        Ok(match data {
            TrainingData::Rows(rows) => Self::Mlp(
                Mlp::build(map, &widths(args, rows), device, hook, dtype)?,
                rows,
            ),
            TrainingData::Text(text) => Self::Gpt(
                Gpt::build(map, gpt_config(args), device, hook, dtype)?
                    .with_checkpointing(args.checkpoint_activations),
                text,
            ),
        })
    }

    /// The mean loss over this rank's part of the global micro-batch that
    /// starts at row (MLP) or sequence (GPT) `first_row`.
    fn batch_loss(
        &self,
        args: &Args,
        first_row: u64,
        world_size: usize,
        rank: usize,
        device: &Device,
    ) -> Result<Tensor, TrainError> {
        let batch = args.batch_size as usize;
        Ok(match self {
            Self::Mlp(model, data) => {
                let (x, y) = data.batch_at(first_row, world_size, rank, batch);
                let x = Tensor::from_vec(x, (batch, data.width), device)?
                    .to_dtype(args.precision.dtype())?;
                let y = Tensor::from_vec(y, batch, device)?;
                // The loss in f32 whatever the model's dtype (as autocast).
                let logits = model.forward(&x)?.to_dtype(DType::F32)?;
                candle_nn::loss::cross_entropy(&logits, &y)?
            }
            Self::Gpt(model, text) => {
                let context = args.context as usize;
                let ids = text.windows_at(first_row, rank, batch, context, args.seed);
                model.loss(&Tensor::from_vec(ids, (batch, context + 1), device)?)?
            }
        })
    }

    /// The mean loss over `--eval-sequences` validation windows (GPT; None
    /// for the MLP, which has no validation split). Rank `r` evaluates
    /// windows `r, r + W, ...`; one collective mean makes every rank's
    /// answer the same.
    fn validation_loss(
        &self,
        args: &Args,
        opt: &mut dyn RankOptimizer,
        world_size: usize,
        rank: usize,
        device: &Device,
    ) -> Result<Option<f64>, TrainError> {
        let Self::Gpt(model, text) = self else {
            return Ok(None);
        };
        let (count, context) = (args.eval_sequences as usize, args.context as usize);
        let mine: Vec<usize> = (rank..count).step_by(world_size).collect();
        let mut sum = 0.0;
        for chunk in mine.chunks(args.batch_size as usize) {
            let ids: Vec<u32> = chunk
                .iter()
                .flat_map(|&i| text.validation_window(i, count, context))
                .collect();
            let ids = Tensor::from_vec(ids, (chunk.len(), context + 1), device)?;
            let loss = model.loss(&ids)?.to_scalar::<f32>()? as f64;
            sum += loss * chunk.len() as f64;
        }
        // Avg over ranks of (sum * W / count) is the mean over all windows.
        let mean = opt.mean_over_ranks(sum * world_size as f64 / count as f64)?;
        Ok(Some(mean))
    }

    /// Tokens each sequence of a batch trains on (1 per row for the MLP).
    fn tokens_per_row(&self, args: &Args) -> Option<usize> {
        match self {
            Self::Mlp(..) => None,
            Self::Gpt(..) => Some(args.context as usize),
        }
    }
}

/// What the training loop needs of a rank's optimizer ([`ZeroOptimizer`]
/// on any backend), so the loop is compiled once.
trait RankOptimizer {
    /// `loss.backward()` and one micro-step.
    fn backward_step(&mut self, loss: &Tensor) -> Result<Option<StepReport>, TrainError>;
    fn learning_rate(&self) -> f64;
    fn set_learning_rate(&mut self, lr: f64);
    fn bytes_sent(&self) -> u64;
    fn memory_report(&self) -> MemoryReport;
    /// The device's peak memory so far (GPU backends).
    fn device_peak_bytes(&self) -> Option<u64>;
    /// The mean of `value` over ranks (a collective).
    fn mean_over_ranks(&mut self, value: f64) -> Result<f64, TrainError>;
    fn save_checkpoint(
        &mut self,
        dir: &std::path::Path,
        options: &SaveOptions,
    ) -> Result<(), TrainError>;
    fn load_checkpoint(&mut self, dir: &std::path::Path) -> Result<Manifest, TrainError>;
    /// Writes every trained variable to a safetensors file, one tensor at
    /// a time (a collective).
    fn save_weights(&mut self, path: &std::path::Path) -> Result<(), TrainError>;
    /// Steps that deferred their all-gathers.
    fn deferred_steps(&self) -> u64;
    /// Stage 3, once sharded: the parameter gathers so far.
    fn gather_metrics(&self) -> Option<GatherMetrics>;
    /// Offload with a step thread: its times so far.
    fn offload_metrics(&self) -> Option<OffloadMetrics>;
}

impl<C, T> RankOptimizer for ZeroOptimizer<C, T>
where
    C: Communicator + 'static,
    T: Element + WithDType,
    C::Memory: CandleMemory<T, C>,
{
    fn backward_step(&mut self, loss: &Tensor) -> Result<Option<StepReport>, TrainError> {
        Ok(ZeroOptimizer::backward_step(self, loss)?)
    }
    fn learning_rate(&self) -> f64 {
        self.engine().learning_rate()
    }
    fn set_learning_rate(&mut self, lr: f64) {
        self.engine_mut().set_learning_rate(lr)
    }
    fn bytes_sent(&self) -> u64 {
        ZeroOptimizer::bytes_sent(self)
    }
    fn memory_report(&self) -> MemoryReport {
        ZeroOptimizer::memory_report(self)
    }
    fn device_peak_bytes(&self) -> Option<u64> {
        ZeroOptimizer::device_peak_bytes(self)
    }
    fn mean_over_ranks(&mut self, value: f64) -> Result<f64, TrainError> {
        let mut v = [value];
        self.engine_mut()
            .all_reduce_host(&mut v[..], ReduceOp::Avg)?;
        Ok(v[0])
    }
    fn save_checkpoint(
        &mut self,
        dir: &std::path::Path,
        options: &SaveOptions,
    ) -> Result<(), TrainError> {
        self.save_checkpoint_with(dir, options)?;
        Ok(())
    }
    fn load_checkpoint(&mut self, dir: &std::path::Path) -> Result<Manifest, TrainError> {
        Ok(ZeroOptimizer::load_checkpoint(self, dir)?)
    }
    fn save_weights(&mut self, path: &std::path::Path) -> Result<(), TrainError> {
        Ok(ZeroOptimizer::save_weights(self, path)?)
    }
    fn deferred_steps(&self) -> u64 {
        self.engine().deferred_steps()
    }
    fn gather_metrics(&self) -> Option<GatherMetrics> {
        let fetcher = self.engine().fetcher()?;
        let stats = fetcher.stats();
        Some(GatherMetrics {
            prefetch_hits: stats.hits,
            prefetch_misses: stats.misses,
            on_thread: fetcher.threaded(),
        })
    }
    fn offload_metrics(&self) -> Option<OffloadMetrics> {
        let times = self.engine().offload_times();
        let ms = |d: std::time::Duration| d.as_secs_f64() * 1e3;
        (times.steps > 0).then(|| OffloadMetrics {
            steps: times.steps,
            landing_ms: ms(times.landing),
            stepping_ms: ms(times.stepping),
            packing_ms: ms(times.packing),
            join_ms: ms(times.join),
            write_back_ms: ms(times.write_back),
        })
    }
}

/// One rank's training loop on a host backend (threads or MPI).
pub fn train_rank<C: Communicator<Memory = Host> + 'static>(
    args: &Args,
    comm: C,
    data: &TrainingData,
) -> Result<Summary, TrainError> {
    // The engine's element type: f32 (the master weights of a 16-bit
    // model), or the model's own without master weights.
    match (args.precision, args.no_master_weights) {
        (Precision::Bf16, true) => train_rank_as::<C, half::bf16>(args, comm, data),
        (Precision::F16, true) => train_rank_as::<C, half::f16>(args, comm, data),
        _ => train_rank_as::<C, f32>(args, comm, data),
    }
}

/// [`train_rank`] with an engine of element type `T`.
fn train_rank_as<C, T>(args: &Args, comm: C, data: &TrainingData) -> Result<Summary, TrainError>
where
    C: Communicator<Memory = Host> + 'static,
    T: Float + WithDType,
{
    let (rank, world_size) = (comm.rank(), comm.world_size());
    let map = model_vars(args)?;
    let hook = ZeroHook::<C, T>::new();
    let model = Model::new(args, data, &map, &Device::Cpu, hook.clone())?;
    // At stage 3 each rank builds and initializes (or reads) only its
    // shard of the large parameters.
    let mut opt = ZeroOptimizer::<C, T>::new_sharded(
        &map,
        comm,
        engine_config(args),
        crate::optimizers::build(args)?,
        &hook,
    )?;
    let ctx = LoopContext {
        args,
        rank,
        world_size,
        device: &Device::Cpu,
        model: &model,
    };
    train_loop(&ctx, &mut opt)
}

/// What the loop runs on besides the optimizer.
struct LoopContext<'a> {
    args: &'a Args,
    rank: usize,
    world_size: usize,
    device: &'a Device,
    model: &'a Model<'a>,
}

fn train_loop(ctx: &LoopContext<'_>, opt: &mut dyn RankOptimizer) -> Result<Summary, TrainError> {
    let LoopContext {
        args,
        rank,
        world_size,
        device,
        model,
    } = *ctx;
    // Resuming: weights, optimizer state, step counter, data position and
    // learning rate come from the checkpoint (any world size and stage).
    let mut first_step = 0;
    // Rows of the dataset (MLP) or sequences (GPT) consumed before this run
    // (counted in rows, so a resume with another world size or batch size
    // continues at the same row; a GPT sequence's text is a function of the
    // seed and its index, so the count is its whole data position).
    let mut rows_consumed = 0;
    if let Some(dir) = &args.resume {
        let manifest = opt.load_checkpoint(dir)?;
        let user = manifest.checkpoint.map(|c| c.user).unwrap_or_default();
        first_step = user["step"].as_u64().ok_or_else(|| TrainError::Data {
            path: dir.clone(),
            detail: "the checkpoint records no trainer step; was it saved by `train`?".into(),
        })?;
        rows_consumed = user["rows_consumed"]
            .as_u64()
            .ok_or_else(|| TrainError::Data {
                path: dir.clone(),
                detail: "the checkpoint records no data position (`rows_consumed`)".into(),
            })?;
        if let Some(lr) = user["lr"].as_f64() {
            opt.set_learning_rate(lr);
        }
    }
    let mut metrics = match (&args.metrics, rank) {
        (Some(path), 0) => Some(std::io::BufWriter::new(
            std::fs::File::create(path).map_err(|e| TrainError::Data {
                path: path.clone(),
                detail: format!("cannot create metrics file: {e}"),
            })?,
        )),
        _ => None,
    };
    let tokens_per_row = model.tokens_per_row(args);
    let progress = Progress::new(
        rank == 0 && !args.quiet,
        args.steps,
        if tokens_per_row.is_some() {
            "tokens/s"
        } else {
            "samples/s"
        },
    );
    let mut history = LossHistory::default();
    let mut val_loss = None;

    let batch = args.batch_size as usize;
    let accum = args.grad_accum;
    let mut final_loss = f64::NAN;
    for step in first_step..args.steps {
        let started = Instant::now();
        let bytes_before = opt.bytes_sent();
        let lr = opt.learning_rate();
        let mut loss_sum = 0.0;
        let mut report = None;
        for micro in 0..accum {
            let micro_steps_done = (step - first_step) * accum + micro;
            let first_row = rows_consumed + micro_steps_done * (world_size * batch) as u64;
            let loss = model.batch_loss(args, first_row, world_size, rank, device)?;
            loss_sum += loss.to_scalar::<f32>()? as f64;
            // The layers hand their gradients to the engine during
            // backward (none stays in Candle's GradStore).
            report = opt.backward_step(&loss)?;
        }
        let report = report.ok_or_else(|| {
            TrainError::Internal("the last micro-step did not complete a step".into())
        })?;
        final_loss = opt.mean_over_ranks(loss_sum / accum as f64)?;
        let step_time_s = started.elapsed().as_secs_f64();
        let samples_per_s = (world_size * batch) as f64 * accum as f64 / step_time_s;
        let tokens_per_s = tokens_per_row.map(|t| samples_per_s * t as f64);
        // Validation is timed apart from the step (it is not training).
        let eval_now =
            args.eval_every > 0 && ((step + 1) % args.eval_every == 0 || step + 1 == args.steps);
        let step_val_loss = if eval_now {
            model.validation_loss(args, opt, world_size, rank, device)?
        } else {
            None
        };
        if step_val_loss.is_some() {
            val_loss = step_val_loss;
        }
        if rank == 0 {
            history.train.push((step + 1, final_loss));
            if let Some(v) = step_val_loss {
                history.validation.push((step + 1, v));
            }
        }
        if let Some(out) = metrics.as_mut() {
            let line = StepMetrics {
                step: step + 1,
                loss: final_loss,
                val_loss: step_val_loss,
                lr,
                grad_norm: report.grad_norm,
                step_time_s,
                tokens_per_s,
                bytes_sent: opt.bytes_sent() - bytes_before,
                memory: opt.memory_report(),
                loss_scale: report.loss_scale,
                skipped: report.skipped,
                peak_heap_bytes: crate::heap::peak_bytes(),
                device_peak_bytes: opt.device_peak_bytes(),
                gathers: opt.gather_metrics(),
                offload: opt.offload_metrics(),
            };
            let path = args.metrics.clone().unwrap_or_default();
            serde_json::to_writer(&mut *out, &line)
                .map_err(std::io::Error::from)
                .and_then(|_| out.write_all(b"\n"))
                .map_err(|e| TrainError::Data {
                    path,
                    detail: format!("cannot write metrics: {e}"),
                })?;
        }
        progress.step(
            step + 1,
            final_loss,
            tokens_per_s.unwrap_or(samples_per_s),
            step_val_loss,
        );
        if let Some(dir) = &args.checkpoint_dir {
            if args.checkpoint_every > 0 && (step + 1) % args.checkpoint_every == 0 {
                let options = SaveOptions {
                    user: serde_json::json!({
                        "step": step + 1,
                        "rows_consumed": rows_consumed
                            + (step + 1 - first_step) * accum * (world_size * batch) as u64,
                        "lr": opt.learning_rate(),
                    }),
                    ..SaveOptions::default()
                };
                opt.save_checkpoint(dir, &options)?;
            }
        }
    }
    progress.finish(final_loss);
    if let Some(out) = metrics.as_mut() {
        out.flush().map_err(|e| TrainError::Data {
            path: args.metrics.clone().unwrap_or_default(),
            detail: format!("cannot write metrics: {e}"),
        })?;
    }

    // Every rank: saving is a collective (at stage 3 each sharded weight is
    // gathered, written and dropped in turn), and at stage 3 so is every
    // forward (the sample).
    if let Some(path) = &args.save {
        opt.save_weights(path)?;
    }
    let mut sample = None;
    let sharded = args.stage == 3;
    if rank == 0 || sharded {
        if let (Model::Gpt(gpt, text), true) = (model, args.sample > 0) {
            let bytes = gpt.generate(
                args.prompt.as_bytes(),
                args.sample as usize,
                args.temperature,
                args.seed,
                device,
            )?;
            if !args.quiet && rank == 0 {
                println!(
                    "--- sample ({} bytes after {:?}, trained on {}) ---\n{}{}\n---",
                    bytes.len(),
                    args.prompt,
                    text.source,
                    args.prompt,
                    String::from_utf8_lossy(&bytes)
                );
            }
            sample = (rank == 0).then_some(bytes);
        }
    }
    if rank == 0 {
        if let Some(path) = &args.plot {
            let title = match model {
                Model::Gpt(gpt, _) => {
                    let c = gpt.config();
                    format!(
                        "GPT (layers {}, d_model {}, context {}), world size {world_size}, stage {}",
                        c.layers, c.d_model, c.context, args.stage
                    )
                }
                Model::Mlp(..) => format!("MLP, world size {world_size}, stage {}", args.stage),
            };
            history.plot(path, &title)?;
            if !args.quiet {
                eprintln!("loss plot written to {}", path.display());
            }
        }
    }
    Ok(Summary {
        final_loss,
        steps: args.steps,
        val_loss,
        sample,
        deferred_steps: opt.deferred_steps(),
    })
}

/// A progress bar on a terminal, plain log lines otherwise.
struct Progress {
    bar: Option<ProgressBar>,
    enabled: bool,
    every: u64,
    /// What the rate counts: samples/s (MLP) or tokens/s (GPT).
    rate_unit: &'static str,
    /// The last validation loss, shown until the next.
    val_loss: std::cell::Cell<Option<f64>>,
}

impl Progress {
    fn new(enabled: bool, steps: u64, rate_unit: &'static str) -> Self {
        let bar = (enabled && std::io::stderr().is_terminal()).then(|| {
            let bar = ProgressBar::new(steps);
            if let Ok(style) = ProgressStyle::with_template(
                "{bar:40} {pos}/{len} steps  {msg}  [{elapsed_precise} < {eta_precise}]",
            ) {
                bar.set_style(style);
            }
            bar
        });
        Self {
            bar,
            enabled,
            every: (steps / 10).max(1),
            rate_unit,
            val_loss: std::cell::Cell::new(None),
        }
    }

    fn step(&self, step: u64, loss: f64, rate: f64, val_loss: Option<f64>) {
        if val_loss.is_some() {
            self.val_loss.set(val_loss);
        }
        let unit = self.rate_unit;
        let val = match self.val_loss.get() {
            Some(v) => format!("  val {v:.4}"),
            None => String::new(),
        };
        if let Some(bar) = &self.bar {
            bar.set_position(step);
            bar.set_message(format!("loss {loss:.4}{val}  {rate:.0} {unit}"));
        } else if self.enabled && (step % self.every == 0 || step == 1 || val_loss.is_some()) {
            eprintln!("step {step}: loss {loss:.4}{val}, {rate:.0} {unit}");
        }
    }

    fn finish(&self, loss: f64) {
        if let Some(bar) = &self.bar {
            bar.finish_with_message(format!("final loss {loss:.4}"));
        } else if self.enabled {
            eprintln!("done: final loss {loss:.4}");
        }
    }
}
