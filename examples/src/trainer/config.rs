//! What the flags mean beyond each one's own value: the checks across
//! them, the engine configuration, the model's shape and where its
//! variables come from.

use super::{
    Args, Backend, Dataset, GptConfig, LrDecayArg, ModelKind, OffloadArg, OverlapArg,
    PartitionerArg, Precision, ReplicaDtype, TrainError, TrainingData,
};
use clap::ValueEnum;
use zero_candle::models::MAX_SIZE;
use zero_candle::ShardedVarMap;
use zero_core::engine::{
    EngineConfig, LossScale, NormType, Offload, Overlap, PartitionerKind, Stage,
};
use zero_core::optim::{LrDecay, LrSchedule};
use zero_core::Preemption;

pub(super) fn validate(args: &Args) -> Result<(), TrainError> {
    if args.hf.is_some() && args.init.is_some() {
        return Err(TrainError::Usage(
            "--hf reads the model's weights from its directory; drop --init".into(),
        ));
    }
    if args.save_hf.is_some() && args.hf.is_none() {
        return Err(TrainError::Usage(
            "--save-hf writes the model back in the layout --hf read it in; give --hf DIR (or \
             use --save FILE for the trainer's own models)"
                .into(),
        ));
    }
    let language_model = args.model == ModelKind::Gpt || args.hf.is_some();
    if args.checkpoint_activations && !language_model {
        return Err(TrainError::Usage(
            "--checkpoint-activations recomputes the GPT's blocks; use it with --model gpt or \
             --hf"
                .into(),
        ));
    }
    if args.betas.len() != 2 {
        return Err(TrainError::Usage(format!(
            "--betas takes two values, as beta1,beta2; got {:?}",
            args.betas
        )));
    }
    if args.hidden.iter().any(|&w| w == 0 || w > MAX_SIZE) {
        return Err(TrainError::Usage(format!(
            "--hidden widths must be positive and at most {MAX_SIZE}; got {:?}",
            args.hidden
        )));
    }
    for (flag, mb) in [
        ("--prefetch-mb", args.prefetch_mb),
        ("--gather-mb", args.gather_mb),
        ("--max-live-mb", args.max_live_mb),
    ] {
        if let Some(mb) = mb.filter(|mb| mb.is_nan() || *mb < 0.0) {
            return Err(TrainError::Usage(format!(
                "{flag} {mb} must be a number of MB, at least 0"
            )));
        }
    }
    if !(args.lr.is_finite() && args.lr >= 0.0) {
        return Err(TrainError::Usage(format!("--lr {} must be >= 0", args.lr)));
    }
    lr_schedule(args)?;
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
    shard_group(args, |name| std::env::var(name).ok())?;
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
    // With --hf, the shape comes from the directory's config.json.
    if args.hf.is_none() && args.model == ModelKind::Gpt {
        gpt_config(args).validate()?;
    } else if !language_model && args.sample > 0 {
        return Err(TrainError::Usage(
            "--sample generates text and needs --model gpt or --hf".into(),
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
    preempt_signals(args)?;
    if args.checkpoint_async && args.checkpoint_dir.is_none() {
        return Err(TrainError::Usage(
            "--checkpoint-async needs --checkpoint-dir".into(),
        ));
    }
    if args.keep_checkpoints.is_some() && args.checkpoint_dir.is_none() {
        return Err(TrainError::Usage(
            "--keep-checkpoints needs --checkpoint-dir".into(),
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

/// The learning-rate schedule of `--lr`, `--warmup-steps`, `--lr-decay`,
/// `--min-lr` and `--lr-decay-steps`; `None` for a constant `--lr` without
/// warmup, where the loop leaves the optimizer's rate (or a resumed
/// checkpoint's) as it is.
pub(super) fn lr_schedule(args: &Args) -> Result<Option<LrSchedule>, TrainError> {
    let total_steps = args.lr_decay_steps.unwrap_or(args.steps);
    let min_lr = args.min_lr.unwrap_or(0.0);
    let decay = match args.lr_decay {
        LrDecayArg::Constant if args.min_lr.is_some() || args.lr_decay_steps.is_some() => {
            return Err(TrainError::Usage(
                "--min-lr and --lr-decay-steps shape a decay, and --lr-decay constant has none; \
                 add --lr-decay linear or cosine, or drop them"
                    .into(),
            ))
        }
        LrDecayArg::Constant if args.warmup_steps == 0 => return Ok(None),
        LrDecayArg::Constant => LrDecay::Constant,
        LrDecayArg::Linear => LrDecay::Linear {
            total_steps,
            min_lr,
        },
        LrDecayArg::Cosine => LrDecay::Cosine {
            total_steps,
            min_lr,
        },
    };
    LrSchedule::new(args.lr, args.warmup_steps, decay)
        .map(Some)
        .map_err(|e| {
            TrainError::Usage(format!(
                "--lr {} --warmup-steps {} --lr-decay {} --min-lr {min_lr} --lr-decay-steps \
                 {total_steps}: {e}",
                args.lr,
                args.warmup_steps,
                lr_decay_name(args.lr_decay)
            ))
        })
}

/// How the command line spells `decay`.
fn lr_decay_name(decay: LrDecayArg) -> String {
    decay
        .to_possible_value()
        .map_or_else(String::new, |v| v.get_name().to_string())
}

/// The schedule: `--overlap`, or where it is not given, interleaved for
/// an offloaded stage 1 or 2 without clipping or loss scaling (the host
/// steps each bucket as it lands, beside backward, instead of all of them
/// after it), after-backward otherwise.
pub fn overlap(args: &Args) -> OverlapArg {
    args.overlap.unwrap_or_else(|| {
        // Offload's host steps each bucket before the groups' average: in
        // groups, after backward.
        let steps_early = args.offload == OffloadArg::Optimizer
            && matches!(args.stage, 1 | 2)
            && args.shard_group.is_none()
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
    // Validated by `validate` before any rank starts.
    config.shard_group = shard_group(args, |name| std::env::var(name).ok())
        .ok()
        .flatten();
    config.replica_reduce_dtype = args.replica_reduce_dtype.map(|dtype| match dtype {
        ReplicaDtype::Bf16 => zero_core::DType::BF16,
        ReplicaDtype::F16 => zero_core::DType::F16,
    });
    if let Some(max_norm) = args.clip_norm {
        config = config.with_clip(max_norm, NormType::L2);
    }
    // Unset, stage 3's budgets are the memory's (a GPU's are larger).
    let bytes = |mb: f64| (mb * (1 << 20) as f64) as usize;
    config.prefetch_bytes = args.prefetch_mb.map(bytes);
    config.gather_bytes = args.gather_mb.map(bytes);
    config.max_live_bytes = args.max_live_mb.map(|mb| bytes(mb).max(1));
    config
}

/// The model's layer widths: data width, `--hidden`, classes.
pub(super) fn widths(args: &Args, data: &Dataset) -> Vec<usize> {
    let mut widths = vec![data.width];
    widths.extend(&args.hidden);
    widths.push(data.classes);
    widths
}

/// The GPT shape the flags describe.
pub(super) fn gpt_config(args: &Args) -> GptConfig {
    GptConfig {
        layers: args.layers as usize,
        heads: args.heads as usize,
        d_model: args.d_model as usize,
        context: args.context as usize,
    }
}

/// Where the model's variables come from: `--hf`'s weights, `--init`'s
/// file (both memory-mapped) or the seed; created without values, for the optimizer to fill (at
/// stage 3 each rank only its shard of the large ones).
pub(super) fn model_vars(args: &Args, data: &TrainingData) -> Result<ShardedVarMap, TrainError> {
    if let TrainingData::Hub(hub) = data {
        return Ok(hub.vars());
    }
    Ok(match &args.init {
        Some(path) => ShardedVarMap::from_safetensors(path).map_err(|e| TrainError::Data {
            path: path.clone(),
            detail: format!("cannot initialize from it: {e}"),
        })?,
        None => ShardedVarMap::seeded(args.seed),
    })
}

/// The signals `--preempt-signals` names (none for `none`).
pub(super) fn preempt_signals(args: &Args) -> Result<Vec<i32>, TrainError> {
    if let [only] = &args.preempt_signals[..] {
        if only.eq_ignore_ascii_case("none") {
            return Ok(Vec::new());
        }
    }
    args.preempt_signals
        .iter()
        .map(|name| zero_core::preempt::signal_from_name(name))
        .collect::<Result<_, _>>()
        .map_err(|e| TrainError::Usage(format!("--preempt-signals: {e}")))
}

/// The preemption handle the flags ask for: handlers of
/// `--preempt-signals`, or a handle no signal sets.
pub(super) fn preemption(args: &Args) -> Result<Preemption, TrainError> {
    let signals = preempt_signals(args)?;
    if signals.is_empty() {
        return Ok(Preemption::manual());
    }
    Preemption::on_signals(&signals, args.preempt_exit_code)
        .map_err(|e| TrainError::Usage(format!("--preempt-signals: {e}")))
}

/// `--shard-group`: a number of ranks, or `node` for the ranks of one
/// machine as the launcher's variables (read through `var`) say.
pub fn shard_group(
    args: &Args,
    var: impl Fn(&str) -> Option<String>,
) -> Result<Option<usize>, TrainError> {
    let Some(given) = args.shard_group.as_deref() else {
        return Ok(None);
    };
    if given != "node" {
        return match given.parse::<usize>() {
            Ok(ranks) if ranks > 0 => Ok(Some(ranks)),
            _ => Err(TrainError::Usage(format!(
                "--shard-group {given:?}: give a number of ranks (a divisor of the world size) \
                 or `node`"
            ))),
        };
    }
    const LOCAL: [&str; 3] = [
        "OMPI_COMM_WORLD_LOCAL_SIZE",
        "LOCAL_WORLD_SIZE",
        "SLURM_NTASKS_PER_NODE",
    ];
    let local = LOCAL
        .iter()
        .find_map(|name| var(name).and_then(|v| v.trim().parse::<usize>().ok()));
    match local {
        Some(ranks) if ranks > 0 => Ok(Some(ranks)),
        // Ranks as threads of this process: one machine, one group.
        _ if matches!(args.backend, Backend::Threads | Backend::CudaThreads) => Ok(None),
        _ => Err(TrainError::Usage(format!(
            "--shard-group node: the launcher did not say how many ranks run on each machine \
             (none of {}); give the number instead",
            LOCAL.join(", ")
        ))),
    }
}
