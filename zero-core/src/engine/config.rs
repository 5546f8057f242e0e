//! Engine configuration.

use super::scaler::LossScale;
use crate::optim::Hyperparams;
use crate::partition::{Flat, Greedy, Partitioner};
use crate::{Error, Result};
use serde::{Deserialize, Serialize};

/// What ZeRO partitions.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Stage {
    /// Stage 0, the DDP baseline: gradients all-reduced, every rank steps
    /// the whole model.
    Ddp,
    /// Stage 1: optimizer state partitioned.
    OptimizerState,
    /// Stage 2: optimizer state and gradients partitioned.
    Gradients,
    /// Stage 3: optimizer state, gradients and parameters partitioned. The
    /// gradient path is stage 2's; parameters above
    /// [`EngineConfig::persist_numel`] that the framework gathers on use
    /// (see [`Engine::shard_parameters`](super::Engine::shard_parameters))
    /// then live only as this rank's shard.
    Parameters,
}

impl Stage {
    /// The stage from its number, 0 to 3.
    pub fn from_number(stage: u8) -> Result<Self> {
        match stage {
            0 => Ok(Stage::Ddp),
            1 => Ok(Stage::OptimizerState),
            2 => Ok(Stage::Gradients),
            3 => Ok(Stage::Parameters),
            other => Err(Error::Config(format!(
                "stage {other} is not supported; use 0 (DDP), 1 (optimizer state), 2 (+ gradients) \
                 or 3 (+ parameters)"
            ))),
        }
    }

    /// Whether gradients are partitioned: reduce-scattered into the shard
    /// and their full buffers freed bucket by bucket (stages 2 and 3).
    pub fn shards_gradients(self) -> bool {
        matches!(self, Stage::Gradients | Stage::Parameters)
    }

    /// The stage's number.
    pub fn number(self) -> u8 {
        match self {
            Stage::Ddp => 0,
            Stage::OptimizerState => 1,
            Stage::Gradients => 2,
            Stage::Parameters => 3,
        }
    }
}

/// Which partitioner assigns elements to ranks.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PartitionerKind {
    /// [`Flat`]: equal contiguous ranges of the concatenated parameters.
    #[default]
    Flat,
    /// [`Greedy`]: whole parameters, PyTorch ZeroRedundancyOptimizer style.
    Greedy,
}

impl PartitionerKind {
    /// The partitioner.
    pub fn partitioner(self) -> Box<dyn Partitioner> {
        match self {
            PartitionerKind::Flat => Box::new(Flat::default()),
            PartitionerKind::Greedy => Box::new(Greedy::default()),
        }
    }
}

/// The norm used for gradient clipping.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub enum NormType {
    /// Sum of absolute values.
    L1,
    /// Euclidean norm.
    L2,
    /// Largest absolute value.
    Inf,
}

impl NormType {
    /// Parses `1`, `2` or `inf`.
    pub fn parse(s: &str) -> Result<Self> {
        match s {
            "1" => Ok(NormType::L1),
            "2" => Ok(NormType::L2),
            "inf" | "Inf" | "INF" => Ok(NormType::Inf),
            other => Err(Error::Config(format!(
                "norm type {other:?} is not supported; use 1, 2 or inf"
            ))),
        }
    }
}

/// When gradient reductions run, for gradients handed to the engine during
/// backward ([`Engine::begin_backward`](super::Engine::begin_backward), then
/// [`Engine::accumulate_param`](super::Engine::accumulate_param): what
/// `zero_candle`'s `backward_step` does). The overlapped schedules are those
/// of PyTorch's `ddp_zero_hook`; all three give the same weights, bitwise.
/// Gradients given as slots to [`Engine::step`](super::Engine::step) after
/// a plain backward are reduced in the step.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Overlap {
    /// Every reduction runs after backward, in the step (the serial
    /// baseline).
    None,
    /// Bucket `k`'s reduction starts on a communication thread as soon as
    /// its last gradient arrives and every lower bucket has started; after
    /// backward the optimizer steps as PyTorch's `hook_with_zero_step` does.
    /// At stage 0 each bucket's parameters step as soon as its own
    /// all-reduce is back, while later buckets are still on the wire (but
    /// after every reduction with clipping, a gradient norm, loss scaling
    /// or master weights, which need every gradient first, or on a backend
    /// that cannot run two groups at once). At stages 1 and 2 the shard
    /// steps once every reduce-scatter is done, each bucket all-gathered as
    /// soon as it is stepped.
    #[default]
    AfterBackward,
    /// As `AfterBackward`, but each bucket's shard is stepped as soon as its
    /// reduction completes, during backward
    /// (`hook_with_zero_step_interleaved`). Global-norm clipping needs every
    /// gradient first, so it cannot be combined with this schedule.
    Interleaved,
}

impl Overlap {
    /// Parses `none`, `after-backward` or `interleaved`.
    pub fn parse(s: &str) -> Result<Self> {
        match s {
            "none" => Ok(Overlap::None),
            "after-backward" => Ok(Overlap::AfterBackward),
            "interleaved" => Ok(Overlap::Interleaved),
            other => Err(Error::Config(format!(
                "overlap schedule {other:?} is not known; use none, after-backward or interleaved"
            ))),
        }
    }
}

/// Gradient clipping by the global norm across shards.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct ClipConfig {
    /// The largest allowed total norm.
    pub max_norm: f64,
    /// Which norm.
    pub norm_type: NormType,
}

/// A parameter group given up front: the parameters (by name) and the
/// hyperparameters that differ from the optimizer's group 0.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ParamGroupSpec {
    /// Names of the parameters in the group.
    pub params: Vec<String>,
    /// Hyperparameters (PyTorch names); missing ones take the optimizer's
    /// constructor values.
    pub hyperparams: Hyperparams,
}

/// How the engine shards, buckets, accumulates and clips: the defaults and
/// a `with_*` builder per field. Every rank must use the same one
/// (construction checks it).
///
/// ```
/// use zero_core::engine::{EngineConfig, NormType, Overlap, Stage};
///
/// // Stage 2, gradients accumulated over 4 micro-steps and clipped to a
/// // global L2 norm of 1, buckets of 8 MiB reduced during backward.
/// let config = EngineConfig::default()
///     .with_stage(Stage::Gradients)
///     .with_grad_accum_steps(4)
///     .with_clip(1.0, NormType::L2)
///     .with_bucket_bytes(8 << 20)
///     .with_overlap(Overlap::AfterBackward);
/// assert_eq!(config.stage.number(), 2);
/// // Stage 3 shards the parameters above `persist_numel` elements (and
/// // keeps the smaller ones whole on every rank): the one place to set it.
/// let stage3 = EngineConfig::default()
///     .with_stage(Stage::Parameters)
///     .with_persist_numel(10_000);
/// assert_eq!(stage3.persist_numel, 10_000);
/// ```
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct EngineConfig {
    /// What to partition.
    pub stage: Stage,
    /// Which partitioner.
    pub partitioner: PartitionerKind,
    /// Bytes of one bucket, all ranks' segments together: what one
    /// collective moves and one bucket buffer holds (in the engine's
    /// element type), whatever the world size.
    pub bucket_bytes: usize,
    /// Micro-steps per optimizer step; communication happens on the last.
    pub grad_accum_steps: usize,
    /// Clip gradients by their global norm.
    pub clip: Option<ClipConfig>,
    /// Compute the global gradient norm every step even without clipping.
    pub compute_grad_norm: bool,
    /// Compare the trainable mask every step (one small all-reduce) and
    /// rebuild communication when it changes. When off, call
    /// `refresh_trainability` after changing it.
    pub check_trainability: bool,
    /// Parameter groups beyond group 0.
    pub param_groups: Vec<ParamGroupSpec>,
    /// Loss scaling for 16-bit models (f16 needs it; see [`LossScale`]).
    /// Off by default.
    #[serde(default)]
    pub loss_scale: LossScale,
    /// With master weights (the engine's element type wider than the
    /// parameters', e.g. an `Engine<f32>` over a bf16 model), all-gather
    /// the updated shard in the parameters' dtype: half the bytes, and
    /// exact, since the replica holds that dtype anyway. Off: gather the
    /// master dtype and round on write-back (the same values, twice the
    /// bytes). No effect without master weights.
    #[serde(default = "default_true")]
    pub gather_in_param_dtype: bool,
    /// With master weights, reduce gradients in the parameters' dtype on
    /// the wire (half the bytes; each rank's gradient is rounded to it
    /// before the reduction and the result after, though the backends
    /// still add in f32). Off by default: the reductions carry the master
    /// dtype, the accurate choice. No effect without master weights.
    #[serde(default)]
    pub reduce_in_param_dtype: bool,
    /// When reductions of gradients handed over during backward run.
    #[serde(default)]
    pub overlap: Overlap,
    /// Stage 3: parameters with at most this many elements stay replicated
    /// on every rank and take the stage-2 path (biases, norms; DeepSpeed's
    /// `stage3_param_persistence_threshold`). `0` shards every parameter
    /// the framework can gather.
    #[serde(default = "default_persist_numel")]
    pub persist_numel: usize,
    /// Stage 3: how many gathered bytes may be issued ahead of the piece
    /// being computed (the prefetch; `0` gathers each piece when it is
    /// used). `None`: the memory's default ([`GatherBudgets`]); more holds
    /// memory longer.
    #[serde(default)]
    pub prefetch_bytes: Option<usize>,
    /// Stage 3: a layer whose sharded parameters take more than this many
    /// bytes is gathered and computed in pieces of about this size (each
    /// piece a slice of every rank's chunk of one bucket), so that its
    /// whole weight never exists on a rank. `0` gathers whole layers;
    /// `None`: the memory's default ([`GatherBudgets`]).
    #[serde(default)]
    pub gather_bytes: Option<usize>,
    /// Stage 3: the most gathered parameter bytes alive at once (in use
    /// plus prefetched). A layer larger than this on its own is an error.
    /// `None`: the memory's default ([`GatherBudgets`]).
    #[serde(default)]
    pub max_live_bytes: Option<usize>,
    /// Stages 1 and 2 with an overlapped schedule: the all-gathers of a
    /// step's updated parameters run on a thread after the step returns,
    /// in forward order, and each `zero_candle::nn` layer waits in its
    /// next forward until its own parameters are current (FSDP's lazy
    /// gathers): the all-gathers hide behind the next forward instead of
    /// ending the step. Only steps whose every gradient came through hooked
    /// layers defer (a parameter read by a plain op would be read stale).
    /// Between such a step and the next forward the replica is being
    /// written: read it only after `engine.refresh().wait_all()` (the engine's
    /// own checkpoints, consolidation and collectives wait themselves), and
    /// issue collectives of your own through the engine, not the
    /// communicator. Off by default.
    #[serde(default)]
    pub defer_gathers: bool,
    /// Stages 1 and 2 on a device memory: keep the optimizer's side (the
    /// parameter shard with the master weights, the gradient shard, the
    /// optimizer state) in host memory and step there, while the model,
    /// its gradients and the collectives stay on the device (ZeRO-Offload;
    /// see `OffloadMemory`). Off by default.
    #[serde(default)]
    pub offload: Offload,
    /// With offload: the threads that step the host shard (`0`: rayon's
    /// global pool, one per core).
    #[serde(default)]
    pub offload_threads: usize,
    /// With offload: page-lock the host shards, so that the device's
    /// transfers run at the link's speed (on by default; off where the
    /// host cannot lock that much memory, at the cost of slower copies).
    #[serde(default = "default_offload_pin_memory")]
    pub offload_pin_memory: bool,
    /// With offload on a device with streams: queue the transfers to and
    /// from the page-locked shards on a stream of their own, beside the
    /// compute stream, so that a bucket's copy down runs while backward
    /// computes (off by default: on the compute stream, in order with the
    /// kernels).
    #[serde(default)]
    pub offload_copy_stream: bool,
    /// How construction makes every rank start from the same model (see
    /// [`StartingModel`]; an adapter runs it through
    /// [`Engine::sync_starting_model`](super::Engine::sync_starting_model)).
    #[serde(default)]
    pub starting_model: StartingModel,
    /// Hybrid sharding (FSDP's HSDP): the stage's state is sharded over
    /// groups of this many consecutive ranks and replicated across the
    /// `world / shard_group` groups (usually: a group per machine). Each
    /// step reduce-scatters the gradients within the group and averages
    /// each shard across its replicas; stage 3 gathers within the group.
    /// `None` (or the world size): one group, every rank a shard.
    #[serde(default)]
    pub shard_group: Option<usize>,
    /// With [`EngineConfig::shard_group`]: a 16-bit dtype (bf16 or f16)
    /// for each gradient shard's average across its replicas, the one
    /// collective that crosses between groups (usually between machines):
    /// half its bytes, for gradients rounded to that dtype in the average
    /// (ZeRO++ quantizes the same traffic). `None`: the gradients' own
    /// dtype on the wire.
    #[serde(default)]
    pub replica_reduce_dtype: Option<crate::DType>,
}

/// How every rank comes to start from the same model. Each rank builds its
/// own copy of the model, and a random initializer (Candle's) draws other
/// values on each: trained from there, stage 0 would train a different
/// model on every rank and a sharded stage a patchwork of them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum StartingModel {
    /// Every rank's parameters are overwritten with rank 0's at
    /// construction, as PyTorch's DDP does (FSDP's `sync_module_states`):
    /// one pass over the model, `bucket_bytes` at a time.
    #[default]
    Broadcast,
    /// Nothing is copied; each rank hashes its values and construction
    /// fails, naming the first parameter that differs from rank 0's, unless
    /// all agree. For models built identically on every rank (a seed, a
    /// file) that should stay so.
    Verify,
}

/// What lives in host memory instead of the device (ZeRO-Offload).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum Offload {
    /// Everything on the device.
    #[default]
    None,
    /// The optimizer's side: the parameter and gradient shards, master
    /// weights, optimizer state and the step.
    Optimizer,
}

fn default_offload_pin_memory() -> bool {
    true
}

/// Stage 3's gather budgets in bytes (see [`EngineConfig::gather_bytes`],
/// [`EngineConfig::prefetch_bytes`] and [`EngineConfig::max_live_bytes`]).
/// A memory's defaults ([`GatherMemory::default_budgets`]) stand for what
/// the configuration leaves `None`.
///
/// [`GatherMemory::default_budgets`]: crate::engine::GatherMemory::default_budgets
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GatherBudgets {
    /// Gathered bytes issued ahead of the piece being computed.
    pub prefetch_bytes: usize,
    /// Layers above this are gathered in pieces of about this size.
    pub gather_bytes: usize,
    /// The most gathered bytes alive at once.
    pub max_live_bytes: usize,
}

impl GatherBudgets {
    /// Host memory's: layers in pieces of 1 MiB and four pieces ahead,
    /// which on two shared cores kept stage 3 within 10% of stage 2's step
    /// where two ahead did not (`bench stage3`); at most 1 GiB alive.
    pub const HOST: Self = Self {
        prefetch_bytes: 4 << 20,
        gather_bytes: 1 << 20,
        max_live_bytes: 1 << 30,
    };

    /// A device's: a GEMM per layer, not per piece (pieces only above
    /// 256 MiB); 32 MiB ahead, about a layer of the 12 x 768 GPT in f32,
    /// and always the next layer (FSDP's one module ahead; DeepSpeed's
    /// 200 MB `stage3_prefetch_bucket_size` keeps seven such layers
    /// gathered); DeepSpeed's 1e9 parameters alive
    /// (`stage3_max_live_parameters`).
    pub const DEVICE: Self = Self {
        prefetch_bytes: 32 << 20,
        gather_bytes: 256 << 20,
        max_live_bytes: 4_000_000_000,
    };
}

fn default_persist_numel() -> usize {
    100_000
}

fn default_true() -> bool {
    true
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            stage: Stage::Gradients,
            partitioner: PartitionerKind::Flat,
            bucket_bytes: 4 << 20,
            grad_accum_steps: 1,
            clip: None,
            compute_grad_norm: false,
            check_trainability: true,
            param_groups: Vec::new(),
            loss_scale: LossScale::None,
            gather_in_param_dtype: true,
            reduce_in_param_dtype: false,
            overlap: Overlap::default(),
            persist_numel: default_persist_numel(),
            prefetch_bytes: None,
            gather_bytes: None,
            max_live_bytes: None,
            defer_gathers: false,
            offload: Offload::None,
            offload_threads: 0,
            offload_pin_memory: default_offload_pin_memory(),
            offload_copy_stream: false,
            starting_model: StartingModel::Broadcast,
            shard_group: None,
            replica_reduce_dtype: None,
        }
    }
}

impl EngineConfig {
    /// Sets the stage.
    pub fn with_stage(mut self, stage: Stage) -> Self {
        self.stage = stage;
        self
    }

    /// Sets the partitioner.
    pub fn with_partitioner(mut self, partitioner: PartitionerKind) -> Self {
        self.partitioner = partitioner;
        self
    }

    /// Sets the bucket size in bytes.
    pub fn with_bucket_bytes(mut self, bucket_bytes: usize) -> Self {
        self.bucket_bytes = bucket_bytes;
        self
    }

    /// Sets the number of micro-steps per optimizer step.
    pub fn with_grad_accum_steps(mut self, steps: usize) -> Self {
        self.grad_accum_steps = steps;
        self
    }

    /// Clips gradients to `max_norm` in the given norm.
    pub fn with_clip(mut self, max_norm: f64, norm_type: NormType) -> Self {
        self.clip = Some(ClipConfig {
            max_norm,
            norm_type,
        });
        self
    }

    /// Computes the global gradient norm every step.
    pub fn with_grad_norm(mut self, on: bool) -> Self {
        self.compute_grad_norm = on;
        self
    }

    /// Turns the per-step trainability check on or off.
    pub fn with_trainability_check(mut self, on: bool) -> Self {
        self.check_trainability = on;
        self
    }

    /// Sets the overlap schedule.
    pub fn with_overlap(mut self, overlap: Overlap) -> Self {
        self.overlap = overlap;
        self
    }

    /// Adds a parameter group.
    pub fn with_param_group(mut self, params: Vec<String>, hyperparams: Hyperparams) -> Self {
        self.param_groups.push(ParamGroupSpec {
            params,
            hyperparams,
        });
        self
    }

    /// Sets the loss scaling.
    pub fn with_loss_scale(mut self, loss_scale: LossScale) -> Self {
        self.loss_scale = loss_scale;
        self
    }

    /// Gathers updated master shards in the parameters' dtype (`true`, the
    /// default) or in the master dtype.
    pub fn with_gather_in_param_dtype(mut self, on: bool) -> Self {
        self.gather_in_param_dtype = on;
        self
    }

    /// Reduces gradients in the parameters' dtype (`true`) or in the
    /// master dtype (`false`, the default, accurate).
    pub fn with_reduce_in_param_dtype(mut self, on: bool) -> Self {
        self.reduce_in_param_dtype = on;
        self
    }

    /// Stage 3: parameters of at most `numel` elements stay replicated.
    pub fn with_persist_numel(mut self, numel: usize) -> Self {
        self.persist_numel = numel;
        self
    }

    /// Stage 3: bytes of gathers issued ahead of use (`0`: no prefetch).
    pub fn with_prefetch_bytes(mut self, bytes: usize) -> Self {
        self.prefetch_bytes = Some(bytes);
        self
    }

    /// Stage 3: gather layers above `bytes` in pieces of about `bytes`
    /// (`0`: whole layers).
    pub fn with_gather_bytes(mut self, bytes: usize) -> Self {
        self.gather_bytes = Some(bytes);
        self
    }

    /// Stage 3: the most gathered bytes alive at once.
    pub fn with_max_live_bytes(mut self, bytes: usize) -> Self {
        self.max_live_bytes = Some(bytes);
        self
    }

    /// The gather budgets in effect over a memory whose defaults are
    /// `defaults`: the configured ones, and the defaults for the rest.
    pub fn gather_budgets(&self, defaults: GatherBudgets) -> GatherBudgets {
        GatherBudgets {
            prefetch_bytes: self.prefetch_bytes.unwrap_or(defaults.prefetch_bytes),
            gather_bytes: self.gather_bytes.unwrap_or(defaults.gather_bytes),
            max_live_bytes: self.max_live_bytes.unwrap_or(defaults.max_live_bytes),
        }
    }

    /// Stages 1 and 2: defer a step's all-gathers into the next forward
    /// (see [`EngineConfig::defer_gathers`]).
    pub fn with_defer_gathers(mut self, on: bool) -> Self {
        self.defer_gathers = on;
        self
    }

    /// Stages 1 and 2 on a device memory: the optimizer's side in host
    /// memory (see [`EngineConfig::offload`]), stepped on `threads` threads
    /// (`0`: rayon's global pool). With [`Overlap::Interleaved`] (no
    /// clipping, no loss scaling) the host steps each bucket as it lands,
    /// beside backward; otherwise all of them after it.
    pub fn with_offload(mut self, offload: Offload, threads: usize) -> Self {
        self.offload = offload;
        self.offload_threads = threads;
        self
    }

    /// With offload: whether to page-lock the host shards (see
    /// [`EngineConfig::offload_pin_memory`]).
    pub fn with_offload_pin_memory(mut self, on: bool) -> Self {
        self.offload_pin_memory = on;
        self
    }

    /// With offload: whether the transfers get a stream of their own (see
    /// [`EngineConfig::offload_copy_stream`]).
    pub fn with_offload_copy_stream(mut self, on: bool) -> Self {
        self.offload_copy_stream = on;
        self
    }

    /// How every rank comes to start from the same model (see
    /// [`StartingModel`]).
    pub fn with_starting_model(mut self, starting_model: StartingModel) -> Self {
        self.starting_model = starting_model;
        self
    }

    /// Shards over groups of `ranks` consecutive ranks, replicated across
    /// the groups (see [`EngineConfig::shard_group`]).
    pub fn with_shard_group(mut self, ranks: usize) -> Self {
        self.shard_group = Some(ranks);
        self
    }

    /// Averages the gradient shards across the groups' replicas in
    /// `dtype`, bf16 or f16 (see [`EngineConfig::replica_reduce_dtype`]).
    pub fn with_replica_reduce_dtype(mut self, dtype: crate::DType) -> Self {
        self.replica_reduce_dtype = Some(dtype);
        self
    }

    /// Whether a step of `micro_steps` micro-steps reads every reduced
    /// gradient before it updates anything: to average the micro-steps, to
    /// clip by or report the global norm, or to look for an inf or NaN.
    pub(crate) fn reads_every_gradient(&self, micro_steps: usize) -> bool {
        micro_steps > 1
            || self.clip.is_some()
            || self.compute_grad_norm
            || self.loss_scale != LossScale::None
    }

    /// Whether stage 0 may step each bucket as soon as it is reduced:
    /// nothing needs every gradient first (no clipping, no gradient norm,
    /// no loss scaling) and the replica is what steps (no master weights,
    /// `masters`).
    pub(crate) fn steps_ddp_as_reduced(&self, masters: bool) -> bool {
        self.stage == Stage::Ddp
            && self.overlap != Overlap::None
            && self.clip.is_none()
            && !self.compute_grad_norm
            && self.loss_scale == LossScale::None
            && !masters
    }

    pub(crate) fn validate(&self) -> Result<()> {
        self.loss_scale.validate()?;
        let interleaved = self.overlap == Overlap::Interleaved;
        let stage3 = self.stage == Stage::Parameters;
        // Each combination refused, with what to do instead.
        let refused: [(bool, &str); 10] = [
            (
                self.bucket_bytes == 0,
                "bucket_bytes is 0; use a positive size such as 4 MiB",
            ),
            (
                self.grad_accum_steps == 0,
                "grad_accum_steps is 0; use 1 for no accumulation",
            ),
            (
                interleaved && self.loss_scale != LossScale::None,
                "loss scaling decides after backward whether a step runs (an inf or NaN on any \
                 rank skips it), but the interleaved overlap steps buckets during backward; use \
                 the after-backward overlap with loss scaling",
            ),
            (
                interleaved && (self.clip.is_some() || self.compute_grad_norm),
                "the interleaved overlap schedule steps each bucket before the other gradients \
                 exist, so it cannot clip by (or compute) the global gradient norm; use overlap \
                 after-backward (the default) with clipping",
            ),
            (
                stage3 && interleaved,
                "stage 3 gathers each layer's weights again during backward, from the shard the \
                 interleaved schedule would be stepping at the same time; use overlap \
                 after-backward (the default) at stage 3",
            ),
            (
                stage3 && self.partitioner == PartitionerKind::Greedy,
                "stage 3 splits every parameter evenly over the ranks (so one layer is gathered \
                 by one collective per bucket); the greedy partitioner keeps parameters whole; \
                 use the flat partitioner (the default) at stage 3",
            ),
            (
                stage3 && self.max_live_bytes == Some(0),
                "max_live_bytes is 0: stage 3 must hold at least one gathered layer; use a size \
                 above the largest layer, such as 1 GiB",
            ),
            (
                self.defer_gathers && (self.stage == Stage::Ddp || self.overlap == Overlap::None),
                "defer_gathers defers the all-gathers that stages 1 and 2 run after an overlapped \
                 step; stage 0 all-reduces gradients and gathers nothing, and overlap none runs \
                 every collective in the step; use stage 1 or 2 with overlap after-backward, or \
                 leave defer_gathers off",
            ),
            (
                self.offload_copy_stream && self.offload == Offload::None,
                "offload_copy_stream puts offload's transfers on a stream of their own, and \
                 offload is off: turn offload on (Offload::Optimizer) or leave the copy stream \
                 off",
            ),
            (
                self.offload == Offload::Optimizer && self.stage == Stage::Ddp,
                "offload moves the optimizer's shard to host memory, and stage 0 has no shard \
                 (every rank steps the whole model); use stage 1, 2 or 3 with offload",
            ),
        ];
        let with_groups = self.refused_with_groups();
        if let Some((_, why)) = refused
            .iter()
            .chain(&with_groups)
            .find(|(refuse, _)| *refuse)
        {
            return Err(Error::Config((*why).into()));
        }
        if let Some(clip) = &self.clip {
            if !(clip.max_norm.is_finite() && clip.max_norm > 0.0) {
                return Err(Error::Config(format!(
                    "clip max_norm {} must be a positive finite number",
                    clip.max_norm
                )));
            }
        }
        Ok(())
    }

    /// What [`EngineConfig::shard_group`] refuses, with what to do instead.
    fn refused_with_groups(&self) -> [(bool, &'static str); 5] {
        let hybrid = self.shard_group.is_some();
        [
            (
                self.shard_group == Some(0),
                "shard_group is 0; give the ranks of one group (such as the GPUs of one machine), \
                 or leave it unset to shard over every rank",
            ),
            (
                hybrid && self.stage == Stage::Ddp,
                "shard_group shards the state within groups of ranks, and stage 0 shards nothing; \
                 use stage 1, 2 or 3 with shard_group",
            ),
            (
                hybrid
                    && self.overlap == Overlap::Interleaved
                    && self.offload == Offload::Optimizer,
                "the interleaved overlap with offload steps each bucket on the host as it lands, \
                 before it is averaged across the groups; use overlap after-backward (the \
                 default) with shard_group and offload",
            ),
            (
                self.replica_reduce_dtype.is_some() && !hybrid,
                "replica_reduce_dtype is the dtype of the gradients' average across the replicas \
                 of shard groups; set shard_group too, or leave it unset",
            ),
            (
                matches!(
                    self.replica_reduce_dtype,
                    Some(crate::DType::F32 | crate::DType::F64)
                ),
                "replica_reduce_dtype narrows the replicas' average to a 16-bit dtype (bf16 or \
                 f16); leave it unset to average in the gradients' own dtype",
            ),
        ]
    }
}
