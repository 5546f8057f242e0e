//! Command-line flags of the `train` binary.

use clap::{Parser, ValueEnum};
use std::path::PathBuf;

/// Which communicator runs the ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Backend {
    /// N threads of this process (no installation needed).
    Threads,
    /// One MPI process per rank (`mpirun -n N train --backend mpi`); needs
    /// the `mpi` feature.
    Mpi,
    /// One process per GPU over NCCL; needs the `nccl` feature.
    Nccl,
    /// `--world-size` ranks as threads of this process sharing GPU 0
    /// (`CudaThreadGroup`: no NCCL, every multi-rank path on one GPU);
    /// needs the `nccl` feature.
    CudaThreads,
}

impl Backend {
    /// Whether the model and the engine's buffers live on a GPU.
    pub fn on_gpu(self) -> bool {
        matches!(self, Self::Nccl | Self::CudaThreads)
    }
}

/// Which built-in optimizer steps the shard.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum OptimizerKind {
    /// SGD with optional momentum, nesterov and weight decay.
    Sgd,
    /// Adam (weight decay as L2).
    Adam,
    /// AdamW (decoupled weight decay).
    Adamw,
    /// Adagrad.
    Adagrad,
    /// RMSprop.
    Rmsprop,
}

/// When gradient reductions run (`zero_core::engine::Overlap`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum OverlapArg {
    /// After backward, in the step (the serial baseline).
    None,
    /// During backward, each bucket as soon as it is complete; the
    /// optimizer steps after the last.
    AfterBackward,
    /// During backward, and each bucket's shard is stepped as soon as it is
    /// reduced (no clipping, no gradient norm).
    Interleaved,
}

/// What `--offload` moves to host memory (`zero_core::engine::Offload`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum OffloadArg {
    /// Nothing: everything on the GPU.
    None,
    /// The optimizer's side: f32 master weights, the gradient shard, the
    /// optimizer state and the step (ZeRO-Offload).
    Optimizer,
}

/// Which partitioner assigns elements to ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum PartitionerArg {
    /// Equal contiguous ranges of the concatenated parameters.
    Flat,
    /// Whole parameters, greedily balanced.
    Greedy,
}

/// The dtype of the model's weights, activations and gradients.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Precision {
    /// 32-bit floats everywhere.
    F32,
    /// bfloat16 model; f32 master weights and optimizer state in the engine
    /// (unless `--no-master-weights`).
    Bf16,
    /// IEEE half-precision model; f32 master weights, and a dynamic loss
    /// scale unless `--loss-scale` says otherwise.
    F16,
}

impl Precision {
    /// The model's Candle dtype.
    pub fn dtype(self) -> candle_core::DType {
        match self {
            Precision::F32 => candle_core::DType::F32,
            Precision::Bf16 => candle_core::DType::BF16,
            Precision::F16 => candle_core::DType::F16,
        }
    }
}

/// A 16-bit dtype for `--replica-reduce-dtype`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum ReplicaDtype {
    Bf16,
    F16,
}

/// What the learning rate does after the warmup
/// (`zero_core::optim::LrDecay`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum LrDecayArg {
    /// Stays at `--lr`.
    Constant,
    /// Falls linearly to `--min-lr`.
    Linear,
    /// Falls along a half cosine to `--min-lr`.
    Cosine,
}

/// The model to train.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum ModelKind {
    /// A multi-layer perceptron (`--hidden`) on rows of numbers.
    Mlp,
    /// A byte-level decoder-only transformer (`--layers`, `--heads`,
    /// `--d-model`, `--context`) on text.
    Gpt,
}

/// Train a GPT on text, or an MLP classifier, with ZeRO sharded data
/// parallelism.
#[derive(Clone, Debug, Parser)]
#[command(name = "train", version, about)]
pub struct Args {
    /// Communication backend.
    #[arg(long, value_enum, default_value_t = Backend::Threads)]
    pub backend: Backend,
    /// Number of ranks (threads and cuda-threads; MPI and NCCL take it from
    /// the launcher).
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u64).range(1..=1024))]
    pub world_size: u64,
    /// ZeRO stage: 0 (DDP), 1 (optimizer state), 2 (+ gradients), 3 (+
    /// parameters: sharded from construction, gathered layer by layer on
    /// use; every backend).
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u8).range(0..=3))]
    pub stage: u8,
    /// Stage 3: parameters with at most this many elements stay replicated
    /// (0: shard every layer weight).
    #[arg(long, default_value_t = 100_000)]
    pub persist_numel: usize,
    /// Stage 3: MiB of parameter gathers issued ahead of use (0: none;
    /// unset: the memory's default, 4 on the host, 200 on a GPU).
    #[arg(long)]
    pub prefetch_mb: Option<f64>,
    /// Stage 3: layers above this many MiB are gathered and computed in
    /// pieces of about this size (0: whole layers; unset: the memory's
    /// default, 1 on the host, 256 on a GPU).
    #[arg(long)]
    pub gather_mb: Option<f64>,
    /// Stage 3: the most MiB of gathered parameters alive at once (unset:
    /// the memory's default, 1024 on the host, about 3815 on a GPU).
    #[arg(long)]
    pub max_live_mb: Option<f64>,
    /// Partitioner.
    #[arg(long, value_enum, default_value_t = PartitionerArg::Flat)]
    pub partitioner: PartitionerArg,
    /// Optimizer.
    #[arg(long, value_enum, default_value_t = OptimizerKind::Adamw)]
    pub optimizer: OptimizerKind,
    /// Learning rate (the peak, with `--warmup-steps` or `--lr-decay`).
    #[arg(long, default_value_t = 1e-2)]
    pub lr: f64,
    /// Steps over which the learning rate rises linearly from 0 to `--lr`:
    /// step s (from 0) of N has `--lr * s / N`, as in `transformers`'
    /// schedules.
    #[arg(long, default_value_t = 0)]
    pub warmup_steps: u64,
    /// What the learning rate does after the warmup: stays at `--lr`, or
    /// falls linearly or along a half cosine to `--min-lr` at
    /// `--lr-decay-steps`. The schedule counts the trainer's steps (those
    /// loss scaling skips too), so a resumed run continues it.
    #[arg(long, value_enum, default_value_t = LrDecayArg::Constant)]
    pub lr_decay: LrDecayArg,
    /// The floor of `--lr-decay linear` or `cosine` [default: 0, as
    /// `transformers`' schedules].
    #[arg(long)]
    pub min_lr: Option<f64>,
    /// The step at which `--lr-decay linear` or `cosine` reaches `--min-lr`
    /// (warmup included), which then holds [default: `--steps`; give it to
    /// stop a run early and resume it later on the same schedule].
    #[arg(long)]
    pub lr_decay_steps: Option<u64>,
    /// Momentum (SGD, RMSprop).
    #[arg(long, default_value_t = 0.0)]
    pub momentum: f64,
    /// Nesterov momentum (SGD).
    #[arg(long)]
    pub nesterov: bool,
    /// Weight decay (default: 0.01 for AdamW, 0 otherwise).
    #[arg(long)]
    pub weight_decay: Option<f64>,
    /// Adam betas, as `beta1,beta2`.
    // One value split at the comma, or two values; `optimizers::build`
    // checks that there are two in all.
    #[arg(long, value_delimiter = ',', num_args = 1..=2, default_values_t = [0.9, 0.999])]
    pub betas: Vec<f64>,
    /// Epsilon (Adam, AdamW, Adagrad, RMSprop; default: the optimizer's own).
    #[arg(long)]
    pub eps: Option<f64>,
    /// Optimizer steps to run.
    #[arg(long, default_value_t = 100)]
    pub steps: u64,
    /// Rows (MLP) or sequences of `--context` bytes (GPT) per rank per
    /// micro-step.
    #[arg(long, default_value_t = 32, value_parser = clap::value_parser!(u64).range(1..))]
    pub batch_size: u64,
    /// Seed of the synthetic data and the initial weights.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Micro-steps per optimizer step.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..))]
    pub grad_accum: u64,
    /// Clip gradients to this global L2 norm.
    #[arg(long)]
    pub clip_norm: Option<f64>,
    /// The model's dtype: f32, or bf16/f16 with f32 master weights and
    /// optimizer state (16-bit layers; norms and losses in f32).
    #[arg(long, value_enum, default_value_t = Precision::F32)]
    pub precision: Precision,
    /// Loss scaling: `dynamic` (torch's GradScaler: 2^16, x2 every 2000
    /// clean steps, x0.5 and a skipped step on an inf/NaN gradient), a fixed
    /// factor, or `none`. Default: dynamic for f16, none otherwise.
    #[arg(long)]
    pub loss_scale: Option<String>,
    /// With a 16-bit `--precision`: step the model's own dtype, without f32
    /// master weights (updates smaller than the weights' precision are
    /// lost; for comparison).
    #[arg(long)]
    pub no_master_weights: bool,
    /// With a 16-bit `--precision` and master weights: reduce gradients in
    /// the model's dtype on the wire (half the bytes; rounds each rank's
    /// gradient). Default: reduce in f32.
    #[arg(long)]
    pub reduce_in_param_dtype: bool,
    /// Bucket size in MiB: what one collective moves and one bucket
    /// buffer holds, all ranks' chunks together.
    #[arg(long, default_value_t = 4.0)]
    pub bucket_mb: f64,
    /// When gradient reductions run: overlapped with backward or after it
    /// [default: interleaved with `--offload optimizer` at stage 1 or 2
    /// without clipping, loss scaling or `--shard-group` (the host steps each bucket as it
    /// lands, beside backward), after-backward otherwise].
    #[arg(long, value_enum)]
    pub overlap: Option<OverlapArg>,
    /// Stages 1 and 2: leave a step's all-gathers running after it returns;
    /// each layer of the next forward waits for its own parameters, so the
    /// gathers hide behind that forward.
    #[arg(long)]
    pub defer_gathers: bool,
    /// Hybrid sharding, stages 1 to 3: shard the state over groups of this
    /// many consecutive ranks and replicate it across the groups; `node`:
    /// the ranks of one machine, as the launcher says
    /// (`OMPI_COMM_WORLD_LOCAL_SIZE`, `LOCAL_WORLD_SIZE` or
    /// `SLURM_NTASKS_PER_NODE`) [default: one group of every rank].
    #[arg(long)]
    pub shard_group: Option<String>,
    /// With `--shard-group`: average the gradient shards across the
    /// groups (the traffic between machines) in this 16-bit dtype: half the
    /// bytes, the averaged gradients rounded to it [default: the gradients'
    /// own dtype].
    #[arg(long, value_enum)]
    pub replica_reduce_dtype: Option<ReplicaDtype>,
    /// `--backend nccl`, stages 1 to 3: `optimizer` keeps the optimizer's
    /// side (f32 master weights, gradient shard, optimizer state) in host
    /// memory and steps it there; the GPU keeps the model, its gradients
    /// and the bucket buffers (ZeRO-Offload).
    #[arg(long, value_enum, default_value_t = OffloadArg::None)]
    pub offload: OffloadArg,
    /// With `--offload optimizer`: threads that step the host shard (0: one
    /// per core).
    #[arg(long, default_value_t = 0)]
    pub offload_threads: usize,
    /// With `--offload optimizer`: page-lock the host shards so that the
    /// GPU's transfers run at the link's speed; `false` where the host
    /// cannot lock that much memory (`ulimit -l`).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    pub offload_pinned: bool,
    /// With `--offload optimizer`: queue the transfers on a CUDA stream of
    /// their own, so that a bucket's copy down runs while backward
    /// computes (default: on the compute stream).
    #[arg(long)]
    pub offload_copy_stream: bool,
    /// GPT: keep only each block's input for backward and run the block
    /// again there (activation checkpointing): the same gradients, a
    /// fraction of the activation memory, one more forward per step.
    #[arg(long)]
    pub checkpoint_activations: bool,
    /// Model.
    #[arg(long, value_enum, default_value_t = ModelKind::Mlp)]
    pub model: ModelKind,
    /// Hidden layer widths, comma-separated.
    #[arg(long, value_delimiter = ',', default_values_t = [64, 64])]
    pub hidden: Vec<usize>,
    /// Training data. MLP: a safetensors file with `inputs` (f32, n x d)
    /// and `targets` (i64, n); without it, a synthetic task from `--seed`.
    /// GPT: a plain text file (bytes; the last 10% validate); without it,
    /// the license texts in /usr/share/common-licenses that every Debian
    /// and Ubuntu system has. `--hf`: a text file or a directory of them
    /// (one document each, joined by the end-of-text token), or a `.bin`
    /// of u16 token ids (nanoGPT's); without it, those license texts.
    #[arg(long)]
    pub data: Option<PathBuf>,
    /// GPT: transformer blocks.
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u64).range(1..=1024))]
    pub layers: u64,
    /// GPT: attention heads per block (must divide `--d-model`).
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u64).range(1..=1024))]
    pub heads: u64,
    /// GPT: width of the residual stream.
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u64).range(1..=65536))]
    pub d_model: u64,
    /// GPT: sequence length in bytes (positions the model sees).
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u64).range(1..=65536))]
    pub context: u64,
    /// GPT: measure the validation loss every this many steps (and after
    /// the last); 0 for never.
    #[arg(long, default_value_t = 50)]
    pub eval_every: u64,
    /// GPT: validation windows of `--context` bytes per measurement, split
    /// among the ranks.
    #[arg(long, default_value_t = 32, value_parser = clap::value_parser!(u64).range(1..))]
    pub eval_sequences: u64,
    /// GPT: at the end, print this many bytes the model writes after
    /// `--prompt` (rank 0).
    #[arg(long, default_value_t = 0)]
    pub sample: u64,
    /// GPT: the text `--sample` continues.
    #[arg(long, default_value = "The ")]
    pub prompt: String,
    /// GPT: sampling temperature of `--sample` (0: always the most likely
    /// byte); the draws are seeded by `--seed`.
    #[arg(long, default_value_t = 0.8)]
    pub temperature: f64,
    /// At the end, draw the training (and validation) loss against the step
    /// into this PNG file (rank 0; `plot` draws one from a metrics file).
    #[arg(long)]
    pub plot: Option<PathBuf>,
    /// Initial weights by name (safetensors).
    #[arg(long)]
    pub init: Option<PathBuf>,
    /// Write the final weights here (safetensors).
    #[arg(long)]
    pub save: Option<PathBuf>,
    /// Fine-tune this Hugging Face GPT-2 or Llama-family (Mistral, Qwen,
    /// Gemma, Phi, DeepSeek and the others docs/hub.md lists) directory
    /// (`config.json`, `model.safetensors` or an index with its shards,
    /// `tokenizer.json`) instead of `--model`: the shape comes from
    /// its config (`--layers`, `--heads`, `--d-model` are not used), `--data`
    /// is tokenized with its tokenizer (documents joined by its end-of-text
    /// token), and at stage 3 each rank reads only its shard of the weights.
    #[arg(long)]
    pub hf: Option<PathBuf>,
    /// With `--hf`: at the end, write the model here in the layout it was
    /// read in (the same files, names, dtypes and orientation, with its
    /// config and tokenizer files), which `transformers` loads as it is.
    #[arg(long)]
    pub save_hf: Option<PathBuf>,
    /// Write one JSON object per step here.
    #[arg(long)]
    pub metrics: Option<PathBuf>,
    /// Write a sharded checkpoint every `--checkpoint-every` steps into
    /// `DIR/step-000123/`, and name the newest complete one in `DIR/latest`.
    #[arg(long)]
    pub checkpoint_dir: Option<PathBuf>,
    /// Steps between checkpoints (with `--checkpoint-dir`).
    #[arg(long, default_value_t = 0)]
    pub checkpoint_every: u64,
    /// With `--checkpoint-dir`: save in the background: the step boundary
    /// takes a snapshot into host memory and training goes on while a
    /// thread per rank writes it (the same files; `latest` moves once every
    /// rank's are written). At most one save in flight; a failed write is
    /// an error at the next step boundary, save or the end.
    #[arg(long)]
    pub checkpoint_async: bool,
    /// Resume from a checkpoint (any world size and stage): the latest
    /// complete one of a `--checkpoint-dir`, a step directory of one
    /// (`DIR/step-000123`), or a directory holding a manifest.
    #[arg(long)]
    pub resume: Option<PathBuf>,
    /// With `--checkpoint-dir`: keep the newest K step checkpoints, removing
    /// older ones once a newer one is complete [default: keep all].
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    pub keep_checkpoints: Option<u64>,
    /// Signals that stop the run at the next step boundary (every rank at
    /// the same step) with a checkpoint into `--checkpoint-dir` and the
    /// exit status `--preempt-exit-code`: comma-separated names (TERM, INT,
    /// USR1, USR2, HUP, QUIT, XCPU, ALRM) or numbers, or `none`. A second
    /// signal exits at once, leaving the previous checkpoint loadable.
    #[arg(long, value_delimiter = ',', default_values = ["TERM", "INT", "USR1"])]
    pub preempt_signals: Vec<String>,
    /// The exit status of a run stopped by `--preempt-signals` (default:
    /// that of a process SIGTERM ended), so that a restart loop or a
    /// Kubernetes Job sees an unfinished run.
    #[arg(long, default_value_t = 143, value_parser = clap::value_parser!(i32).range(1..=255))]
    pub preempt_exit_code: i32,
    /// How long, in seconds, a rank waits for its peers in any collective
    /// before the job fails (every backend). A rank that crashed, hangs or
    /// was stopped is detected after this long; raise it if a rank can
    /// legitimately keep the others waiting longer (e.g. a slow checkpoint
    /// write, or a long first step).
    #[arg(long, default_value_t = 300.0)]
    pub timeout_s: f64,
    /// No progress bar or log lines, only errors.
    #[arg(long)]
    pub quiet: bool,
    /// Read flags from this TOML file, one `long-flag-name = value` per
    /// line (`world-size = 2`, `lr-decay = "cosine"`); flags given on the
    /// command line win. Read by `Args::parse_with_config`, which the
    /// `train` binary uses (`Args::parse` alone leaves it unread).
    #[arg(long)]
    pub config: Option<PathBuf>,
}

impl Args {
    /// How many ranks run as threads of this process: the world size with
    /// the thread backend, one otherwise (a process per rank).
    pub fn ranks_in_process(&self) -> usize {
        match self.backend {
            Backend::Threads | Backend::CudaThreads => {
                usize::try_from(self.world_size).unwrap_or(usize::MAX)
            }
            Backend::Mpi | Backend::Nccl => 1,
        }
    }
}
