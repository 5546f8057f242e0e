//! The ZeRO engine, stages 0-3, independent of any framework.
//!
//! The engine owns flat buffers, issues collectives in a fixed order, runs
//! the optimizer on the rank's shard and reports its memory. A framework
//! adapter hands it gradients (one slot per parameter, `None` when a
//! parameter has none, or one by one during backward) and gives it access
//! to the parameter replica. Where the buffers live is the memory `M`
//! ([`ShardMemory`]): host memory ([`HostMemory`]: slices, a
//! [`ParamStore`], any [`FunctionalOptimizer`]) or GPU memory
//! (`zero_nccl::CudaMemory`, stages 0-3). The stage logic above that seam is
//! shared by both.
//!
//! Per optimizer step:
//! - stage 0 all-reduces (mean) gradient buckets into its full gradient
//!   buffer and steps every parameter of the replica, a few at a time;
//! - stage 1 reduce-scatters (mean) gradient buckets into the rank's gradient
//!   shard, steps the shard, and all-gathers the updated parameters; across
//!   an accumulation window it sums micro-steps in a full gradient buffer
//!   and reduces once;
//! - stage 2 does the same, and when gradients are handed over during
//!   backward it reduce-scatters every micro-step, so no full gradient
//!   buffer lives across the window;
//! - stage 3 is stage 2 whose large parameters, once sharded
//!   ([`Engine::shard_parameters`], [`Engine::shard_from_start`]), live only
//!   in the shard and are gathered on use by the [`Fetcher`].
//!
//! Gradients handed over during backward ([`Engine::begin_backward`],
//! [`Engine::accumulate_param`]) are reduced bucket by bucket as backward
//! produces them, on the engine's communication thread ([`Overlap`]; the
//! `pass` and `reduce` modules). With [`EngineConfig::defer_gathers`],
//! stages 1 and 2 leave the all-gathers running into the next forward,
//! whose layers wait for their own parameters (the `deferred` module). The
//! step, and the order of its collectives, is in the `step` module.
//!
//! Stages 1 and 2 move `2(N-1)/N` times the (padded) parameter bytes per
//! rank and step, plus one all-reduce of the trainable mask (one `f32` per
//! parameter) when the per-step trainability check is on, and one of a
//! single `f64` when a gradient norm is asked for.

mod buffers;
mod config;
mod consistency;
mod deferred;
mod fetch;
mod grads;
mod groups;
mod host_buffer;
mod layout;
mod lent;
mod mask;
mod memory;
mod offload;
mod ops;
mod params;
mod pass;
mod precision;
mod reduce;
mod scaler;
mod setup;
mod shard_memory;
mod sharding;
mod stage3;
mod state;
mod window;
mod worker;

pub use crate::dtype::convert_slice;
pub use config::{
    ClipConfig, EngineConfig, GatherBudgets, NormType, Offload, Overlap, ParamGroupSpec,
    PartitionerKind, Stage, StartingModel,
};
pub use consistency::check_rank_consistency;
pub use deferred::{ParamAccess, Refresh};
pub use fetch::{
    FetchStats, Fetcher, GatherFn, GatherMemory, Gathered, HostGather, HostGathers, UnitBucket,
};
pub use host_buffer::{HostBuffer, HostLock, HostPin, HostRegion, Landing};
pub use layout::{Layout, Run};
pub use memory::MemoryReport;
pub use offload::{host_available_bytes, OffloadGathers, OffloadMemory, OffloadTimes, Placed};
pub use params::ParamTable;
pub use precision::CastParams;
pub use reduce::ReductionProgress;
pub use scaler::{DynamicLossScale, LossScale};
pub use setup::ShardSetup;
pub use shard_memory::{
    host_gathers, pack_narrow, packed_len, Deferral, GradPiece, HostGrad, HostMemory, HostOffload,
    HostStepper, HostTransfers, PackedGathers, ParamCopy, ParamStore, ShardMemory, ShardStep,
    StepPiece,
};
pub use sharding::Sharding;
pub use stage3::{FetcherOf, ParamPieceSink};
pub use state::{SaveOptions, SavedCheckpoint};

use crate::comm::{Communicator, Host, ReduceOp};
use crate::optim::{FunctionalOptimizer, Hyperparams};
use crate::partition::{ParamInfo, PartitionPlan};
use crate::{Element, Error, Result};
use buffers::{piece_of, window_buffer, Buffers, ParamShard};
use mask::{mask_over, Trainability};
use std::ops::{Bound, RangeBounds};
use std::sync::Arc;
use window::AccumulationWindow;

/// What one optimizer step did.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct StepReport {
    /// The global gradient norm before clipping, when clipping or
    /// `compute_grad_norm` is on.
    pub grad_norm: Option<f64>,
    /// How many micro-steps were averaged into this step.
    pub micro_steps: usize,
    /// With loss scaling: the step was skipped on every rank because a
    /// gradient was inf or NaN on some rank (weights and optimizer state
    /// unchanged; the scale backed off).
    pub skipped: bool,
    /// With loss scaling: the scale this step's gradients were divided by.
    pub loss_scale: Option<f64>,
}

/// What the engine has counted so far ([`Engine::counters`]; the optimizer
/// steps are [`Engine::steps`]): what to log beside the loss.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Counters {
    /// Micro-steps accumulated since the last optimizer step.
    pub micro_steps: usize,
    /// Steps that left their all-gathers running after they returned (see
    /// [`EngineConfig::defer_gathers`]: a step with a gradient given in a
    /// slot gathers before it returns).
    pub deferred_steps: u64,
    /// Where the host's time went in the offloaded steps that stepped each
    /// bucket as it landed (zero without offload, or where the schedule
    /// steps after backward).
    pub offload: OffloadTimes,
    /// Bytes this rank has sent
    /// ([`Communicator::bytes_sent`](crate::Communicator::bytes_sent)) over
    /// every communicator of the engine: its group's, with shard groups the
    /// replicas' and the world's, stage 3's gathers' and stage 0's side
    /// communicator's.
    pub bytes_sent: u64,
}

/// The ZeRO engine for one rank, over communicator `C`, with its buffers in
/// memory `M` ([`HostMemory`] by default; `zero-nccl` has `CudaMemory`).
pub struct Engine<T: Element, C: Communicator, M: ShardMemory<T, C> = HostMemory> {
    /// The ranks the state is sharded over: the world, or with
    /// [`EngineConfig::shard_group`] this rank's group. Shared with the
    /// communication thread during an overlapped backward.
    comm: Arc<C>,
    /// With [`EngineConfig::shard_group`]: the world and this rank's
    /// replicas (see `groups.rs`).
    groups: Option<groups::ShardGroups<C>>,
    memory: M,
    config: EngineConfig,
    params: ParamTable,
    optimizer: lent::HeldOptimizer<T>,
    /// The partition and what derives from it.
    sharding: Sharding,
    buffers: Buffers<M::Buffer>,
    /// Which parameters train, and the buckets that hold them.
    mask: Trainability,
    /// The micro-steps since the last optimizer step.
    window: AccumulationWindow,
    /// The backward pass whose gradients are being handed over.
    pass: Option<pass::BackwardPass<T, M::Buffer>>,
    /// Offload's step thread, still stepping its last buckets after
    /// backward, with the optimizer and both shards, until the write-back
    /// has taken them (`Engine::finish_pass_stepping`).
    host_steps: Option<Box<reduce::HostSteps<T, M::Buffer>>>,
    progress: ReductionProgress,
    /// Offload's host times (see [`OffloadTimes`]).
    offload_times: OffloadTimes,
    steps: u64,
    /// The background save in flight and its reused buffers.
    background: state::BackgroundSave<T>,
    /// Whether master weights are kept, and the dtypes on the wire.
    wire: precision::Wire,
    /// What the memory can do that decides a step's path.
    abilities: shard_memory::Abilities,
    /// Whether the shard or the replica holds the truth of the trained
    /// parameters, and whether the shard is current (see `precision.rs`).
    truth: precision::Truth,
    /// The loss scaler, when the configuration asks for loss scaling.
    scaler: Option<scaler::LossScaler>,
    /// When the replica is current (shared with the framework's layers;
    /// always, but after a step that deferred its all-gathers).
    refresh: Arc<deferred::Refresh>,
    /// What only some stages have.
    stage: StageState<T, C, M>,
    /// The communication thread, once started (host memory; see
    /// `worker.rs`).
    worker: Option<worker::CommWorker<M>>,
}

/// The state only some stages have.
enum StageState<T: Element, C: Communicator, M: ShardMemory<T, C>> {
    /// Stage 0 stepping each bucket as it is reduced: a communicator of its
    /// own (split from the engine's) for the trainable mask's all-reduce,
    /// which then runs beside the reductions still on the wire.
    Replicated { side: Option<C> },
    /// Stages 1 and 2 (and 3 until its parameters are sharded): the
    /// all-gathers a step may leave running into the next forward.
    Sharded(deferred::DeferredGathers<T, C, M>),
    /// Stage 3 once sharded: the parameters that live only as shards.
    Parameters(stage3::ShardedParams<T, C, M>),
}

impl<T: Element, C: Communicator, M: ShardMemory<T, C>> StageState<T, C, M> {
    /// Stage 3 once sharded.
    fn sharded_params(&self) -> Option<&stage3::ShardedParams<T, C, M>> {
        match self {
            Self::Parameters(sharded) => Some(sharded),
            _ => None,
        }
    }

    /// Per parameter, whether it lives only as shards (empty until stage 3
    /// shards).
    fn sharded_mask(&self) -> &[bool] {
        self.sharded_params().map_or(&[], |s| &s.sharded[..])
    }

    /// Whether parameter `param` lives only as shards (stage 3; the
    /// public answer is the fetcher's, [`Fetcher::is_sharded`]).
    fn is_sharded(&self, param: usize) -> bool {
        self.sharded_mask().get(param) == Some(&true)
    }

    /// Stages 1 and 2's deferred all-gathers (`None` at other stages).
    fn deferred_gathers(&mut self) -> Option<&mut deferred::DeferredGathers<T, C, M>> {
        match self {
            Self::Sharded(gathers) => Some(gathers),
            _ => None,
        }
    }

    /// Gives stage 0 its side communicator (split from `comm`) when
    /// `wanted` and it has none yet.
    fn split_side(&mut self, comm: &C, wanted: bool) -> Result<()> {
        if let Self::Replicated { side: side @ None } = self {
            if wanted {
                let world: Vec<usize> = (0..comm.world_size()).collect();
                *side = comm.split(&world)?;
            }
        }
        Ok(())
    }

    /// Stage 3, at the end of a micro-step's backward: waits for the
    /// gathers in flight (the step is about to change the shard).
    fn end_fetch_pass(&self) -> Result<()> {
        match self.sharded_params() {
            Some(sharded) => sharded.fetcher.end_pass(),
            None => Ok(()),
        }
    }
}

impl<T: Element, C: Communicator, M: ShardMemory<T, C>> Drop for Engine<T, C, M> {
    fn drop(&mut self) {
        // Deferred all-gathers still running write into the framework's
        // parameters: let them finish (their collectives end by their
        // deadline if a peer is gone).
        if let Some(pending) = self.stage.deferred_gathers().and_then(|g| g.pending.take()) {
            let _ = pending.wait();
        }
    }
}

impl<T: Element, C: Communicator<Memory = Host>> Engine<T, C, HostMemory> {
    /// Builds the engine on host memory; see [`Engine::with_memory`]. A
    /// collective: every rank must call it.
    pub fn new(
        comm: C,
        params: Vec<ParamInfo>,
        optimizer: Box<dyn FunctionalOptimizer<T>>,
        config: EngineConfig,
    ) -> Result<Self> {
        Self::with_memory(comm, HostMemory, params, optimizer, config)
    }
}

impl<T: Element, C: Communicator, M: ShardMemory<T, C>> Engine<T, C, M> {
    /// Builds the engine with its buffers in `memory`: partitions `params`,
    /// assigns parameter groups, and checks that every rank has the same
    /// parameters and configuration (a collective: every rank must call it).
    ///
    /// `params` must have unique names; their order is the order of every
    /// collective, so give it sorted by name (adapters do). Only parameters
    /// with `trainable` set are ever updated.
    pub fn with_memory(
        comm: C,
        mut memory: M,
        params: Vec<ParamInfo>,
        mut optimizer: Box<dyn FunctionalOptimizer<T>>,
        config: EngineConfig,
    ) -> Result<Self> {
        check_rank_consistency(&comm, &params, &config, optimizer.as_ref())?;
        // The same on every rank (the check above): each refuses alike.
        if config.offload != Offload::Optimizer {
            memory.check_optimizer(optimizer.as_ref())?;
        }
        let (comm, groups) = groups::split(comm, &config, memory.narrows_wire())?;
        let ShardSetup { params, plan, .. } = ShardSetup::new(
            params,
            &config,
            optimizer.as_mut(),
            comm.world_size(),
            comm.rank(),
        )?;
        if config.offload == Offload::Optimizer {
            shard_memory::start_offload(
                &mut memory,
                config.offload_threads,
                config.offload_pin_memory,
                config.offload_copy_stream,
            )?;
            // The shard, its gradients and (Adam's) two moments.
            let needed = (plan.shard_numel * std::mem::size_of::<T>() * 4) as u64;
            offload::check_host_room(needed, offload::host_available_bytes())?;
        }
        let trainable: Vec<bool> = params.iter().map(|p| p.trainable).collect();
        let packed = memory.packed_gathers().is_some();
        let wire = precision::Wire::new::<T>(&params, &config, comm.world_size(), packed);
        let abilities = shard_memory::Abilities::of(&mut memory);
        let stage = match config.stage {
            Stage::Ddp => StageState::Replicated { side: None },
            _ => StageState::Sharded(deferred::DeferredGathers::default()),
        };
        // The plan-derived parts are filled by `install_plan` below.
        let mut engine = Self {
            sharding: Sharding::new(plan.clone(), 0, &params, None),
            buffers: Buffers {
                param_shard: ParamShard::Here(memory.alloc_zeroed(0)?),
                grad_shard: None,
                full_grads: None,
                pool: Vec::new(),
                scratch: None,
            },
            mask: Trainability::new(trainable),
            window: AccumulationWindow {
                present: vec![false; params.len()],
                ..AccumulationWindow::default()
            },
            pass: None,
            host_steps: None,
            progress: ReductionProgress::default(),
            offload_times: OffloadTimes::default(),
            steps: 0,
            background: state::BackgroundSave::default(),
            wire,
            abilities,
            truth: match wire.masters {
                true => precision::Truth::Shard { fresh: false },
                false => precision::Truth::Replica,
            },
            scaler: scaler::LossScaler::new(config.loss_scale),
            refresh: Arc::default(),
            stage,
            worker: None,
            comm: Arc::new(comm),
            groups,
            memory,
            config,
            optimizer: lent::HeldOptimizer::Home(optimizer),
            params,
        };
        engine.install_plan(plan, None)?;
        Ok(engine)
    }

    /// Derives everything that depends on the partition plan (layout, owned
    /// pieces, keys, buffers) and allocates the buffers afresh.
    fn install_plan(&mut self, plan: PartitionPlan, order: Option<Vec<usize>>) -> Result<()> {
        let stage = self.config.stage;
        let plan_rank = match stage {
            Stage::Ddp => 0,
            _ => self.comm.rank(),
        };
        let shard_numel = plan.shard_numel;
        let flat_numel = plan.flat_numel();
        self.sharding = Sharding::new(plan, plan_rank, &self.params, order);
        // Stage 0 steps the replica itself (`Replica`), unless it
        // keeps master weights (all of them: its plan has one rank); a lean
        // shard is read from the replica as it is stepped.
        let param_shard = match stage {
            Stage::Ddp if !self.wire.masters => self.memory.alloc_zeroed(0)?,
            _ if self.lean_shard() => self.memory.alloc_zeroed(0)?,
            _ => shard_memory::alloc_shard(&mut self.memory, shard_numel)?,
        };
        self.buffers.param_shard.put(param_shard);
        self.truth.set_fresh(false);
        self.buffers.grad_shard = match stage {
            Stage::Ddp => None,
            _ => Some(shard_memory::alloc_shard(&mut self.memory, shard_numel)?),
        };
        // Stage 0 reduces into its full gradient buffer; stage 1 makes one
        // when it accumulates micro-steps (and keeps it); stage 2 only for
        // the micro-steps of one window given after backward.
        self.buffers.full_grads = match stage {
            Stage::Ddp => Some(self.memory.alloc_zeroed(flat_numel)?),
            _ => None,
        };
        self.buffers.pool.clear();
        self.buffers.scratch = None;
        self.mask.rebuild_buckets(&self.sharding.layout);
        Ok(())
    }

    /// The communicator of every rank (the one the engine was built
    /// with).
    pub fn comm(&self) -> &C {
        groups::world(&self.comm, &self.groups)
    }

    /// The configuration.
    pub fn config(&self) -> &EngineConfig {
        &self.config
    }

    /// The parameters, in collective order (a slice of [`ParamInfo`]),
    /// by name, and their optimizer groups.
    pub fn params(&self) -> &ParamTable {
        &self.params
    }

    /// The partition: plan, layout and the pieces this rank steps.
    pub fn sharding(&self) -> &Sharding {
        &self.sharding
    }

    /// The functional optimizer (hyperparameters; on the host, the state).
    /// Errors between [`Engine::begin_backward`] and the step when the
    /// step runs beside backward ([`Overlap::Interleaved`]): the optimizer
    /// is stepping then.
    pub fn optimizer(&self) -> Result<&dyn FunctionalOptimizer<T>> {
        self.optimizer.home()
    }

    /// Optimizer steps taken so far.
    pub fn steps(&self) -> u64 {
        self.steps
    }

    /// The engine's counters as of now: micro-steps pending, deferred
    /// steps, offload's host times, bytes sent.
    pub fn counters(&self) -> Counters {
        Counters {
            micro_steps: self.window.micro_steps,
            deferred_steps: match &self.stage {
                StageState::Sharded(gathers) => gathers.steps,
                _ => 0,
            },
            offload: self.offload_times,
            bytes_sent: self.comm.bytes_sent()
                + (self.groups.as_ref())
                    .map_or(0, |g| g.world.bytes_sent() + g.replicas.bytes_sent())
                + self.fetcher().map_or(0, |f| f.bytes_sent())
                + match &self.stage {
                    StageState::Replicated { side: Some(side) } => side.bytes_sent(),
                    _ => 0,
                },
        }
    }

    /// What the loss must be multiplied by before backward (`None` without
    /// loss scaling). Adapters do it for you (`zero_candle`'s
    /// `backward_step`); with gradients computed elsewhere, multiply the
    /// loss by it yourself.
    pub fn loss_scale(&self) -> Option<f64> {
        self.scaler.as_ref().map(scaler::LossScaler::scale)
    }

    /// The learning rate of group 0.
    pub fn learning_rate(&self) -> f64 {
        self.optimizer.learning_rate(0)
    }

    /// Sets the learning rate of every group. Set between
    /// [`Engine::begin_backward`] and the step when the step runs beside
    /// backward ([`Overlap::Interleaved`]), it applies from the next step:
    /// this one's buckets may have stepped already.
    pub fn set_learning_rate(&mut self, lr: f64) {
        self.optimizer.set_learning_rate(lr);
    }

    /// Adds a parameter group for the named parameters, which leave their
    /// current group (their optimizer state is kept). Hyperparameters not
    /// in `hyperparams` take the optimizer's constructor values (as
    /// `torch.optim`'s `add_param_group`), not group 0's current ones. Every
    /// rank must call it alike. Returns the group's index.
    pub fn add_param_group(&mut self, names: &[&str], hyperparams: &Hyperparams) -> Result<usize> {
        self.finish_gathers()?;
        let members = (names.iter())
            .map(|name| self.params.find(name, "add_param_group"))
            .collect::<Result<Vec<usize>>>()?;
        let group = self.optimizer.home_mut()?.add_group(hyperparams)?;
        self.params.move_to_group(&members, group);
        for (piece, key) in self
            .sharding
            .owned
            .iter()
            .zip(self.sharding.keys.iter_mut())
        {
            key.group = self.params.groups()[piece.param];
        }
        Ok(group)
    }

    /// Freezes (`false`) or unfreezes a parameter. Takes effect at the next
    /// step (checked) or at [`Engine::refresh_trainability`] (unchecked).
    pub fn set_trainable(&mut self, name: &str, trainable: bool) -> Result<()> {
        let i = self.params.find(name, "set_trainable")?;
        if trainable && !self.params[i].trainable {
            return Err(Error::Config(format!(
                "parameter {name:?} was frozen when the optimizer was built and owns no shard; \
                 rebuild the optimizer with it trainable"
            )));
        }
        self.mask.trainable[i] = trainable;
        Ok(())
    }

    /// The trainable mask in effect (global across ranks).
    pub fn active_mask(&self) -> &[bool] {
        &self.mask.active
    }

    /// Applies the trainable flags now, when the per-step check is off.
    /// A collective. Refusing inside gradient accumulation: the pending
    /// gradients were bucketed for the old mask.
    pub fn refresh_trainability(&mut self) -> Result<()> {
        self.finish_gathers()?;
        if self.window.micro_steps > 0 || self.window.in_full_buffer {
            return Err(Error::State(format!(
                "refresh_trainability called with {} micro-step(s) accumulated; \
                 finish the optimizer step first, or their gradients would be lost",
                self.window.micro_steps
            )));
        }
        let local = self.mask.trainable.clone();
        let model = (&self.params[..], &self.sharding.layout);
        let world = groups::world(&self.comm, &self.groups);
        self.mask.agree(&mut self.memory, world, model, &local)
    }

    /// All-reduces a few host values with the engine's communicator and
    /// memory (metrics such as a loss; a collective, within the
    /// communicator's deadline).
    pub fn all_reduce_host<V: Element>(&mut self, values: &mut [V], op: ReduceOp) -> Result<()> {
        self.finish_gathers()?;
        let world = groups::world(&self.comm, &self.groups);
        self.memory.all_reduce_host(world, values, op)
    }

    /// Bytes this rank holds, per category (in the engine's memory; while
    /// the optimizer steps beside backward, see [`Engine::optimizer`], its
    /// state as when it left).
    pub fn memory_report(&self) -> MemoryReport {
        let size = std::mem::size_of::<T>();
        let len = |b: &Option<M::Buffer>| b.as_ref().map_or(0, M::buffer_len);
        // Stage 3: a sharded parameter has no replica; its gathers are
        // communication buffers.
        let replica: usize = self
            .params
            .iter()
            .enumerate()
            .filter(|&(i, _)| !self.stage.is_sharded(i))
            .map(|(_, p)| p.numel() * p.dtype.size_in_bytes())
            .sum();
        let gathers = self.fetcher().map_or(0, |f| f.buffer_bytes());
        let offloaded = |b: &M::Buffer| if M::offloaded(b) { M::buffer_len(b) } else { 0 };
        let state = (self.optimizer).state_bytes(|optimizer| self.memory.state_bytes(optimizer));
        MemoryReport {
            offloaded: (self.buffers.param_shard.here().map_or(0, offloaded)
                + self.buffers.grad_shard.as_ref().map_or(0, offloaded))
                * size
                + if self.config.offload == Offload::Optimizer {
                    state
                } else {
                    0
                },
            params: replica + self.buffers.param_shard.len::<T, C, M>() * size,
            grads: len(&self.buffers.full_grads) * size,
            grad_shard: len(&self.buffers.grad_shard) * size,
            optimizer_state: state,
            comm_buffers: (self.buffers.pool.iter().map(M::buffer_len).sum::<usize>()
                + len(&self.buffers.scratch))
                * size
                + gathers
                + self.memory.staging_bytes(),
        }
    }

    /// Adds one micro-step's gradients without communicating. `grads` has
    /// one slot per parameter, each as long as the parameter.
    pub fn accumulate(&mut self, grads: &[Option<M::Grad<'_>>]) -> Result<()> {
        self.params.check_grads(grads, M::grad_len)?;
        self.finish_gathers()?;
        self.stage.end_fetch_pass()?;
        self.window.plain_grads |= grads.iter().any(Option::is_some);
        if self.pass.is_some() {
            if !self.config.stage.shards_gradients() {
                return Err(Error::State(
                    "begin_backward opened the last micro-step of this window (its reductions \
                     have started); finish it with step, not accumulate"
                        .into(),
                ));
            }
            // Stage 2 reduce-scatters every micro-step into the shard.
            let result = self.finish_pass(Some(grads));
            if result.is_err() {
                self.discard_window();
            }
            result?;
            self.window.in_shard = true;
        } else {
            let add = self.window.in_full_buffer;
            let full = window_buffer(
                &mut self.memory,
                &mut self.buffers.full_grads,
                self.sharding.partition.flat_numel(),
                add,
            )?;
            let pieces: Vec<GradPiece<M::Grad<'_>>> = (self.sharding.layout.runs.iter())
                .filter_map(|run| {
                    grads[run.param].map(|grad| GradPiece {
                        at: run.pos,
                        grad,
                        range: run.param_range.clone(),
                    })
                })
                .collect();
            self.memory.flatten(full, &pieces, add)?;
            self.window.in_full_buffer = true;
        }
        self.window.mark_present(grads);
        self.window.micro_steps += 1;
        if let Some(fetcher) = self.fetcher() {
            fetcher.resume();
        }
        Ok(())
    }

    /// Adds the gradient of one parameter's elements `range` (in its
    /// row-major order; `..` for the whole parameter) to the current
    /// micro-step, before its [`Engine::step`] (or [`Engine::accumulate`])
    /// call completes it: how a framework hands gradients over during
    /// backward, the moment each is final, instead of keeping them all
    /// until the end. `grad` holds just those elements. A parameter handed
    /// over twice (a tied weight) gets the sum, as does one also passed to
    /// `step`; one handed over in consecutive ranges that cover it once
    /// counts as one handover, and never exists whole.
    ///
    /// After [`Engine::begin_backward`] each range goes into its buckets'
    /// buffers and a bucket's reduction can start as soon as its last range
    /// is in (see [`Overlap`]); without it, it goes into the full flat
    /// gradient buffer (which in stage 2 then lives until the step, as
    /// during accumulation) and nothing is communicated.
    pub fn accumulate_param(
        &mut self,
        param: usize,
        range: impl RangeBounds<usize>,
        grad: M::Grad<'_>,
    ) -> Result<()> {
        let Some(info) = self.params.get(param) else {
            return Err(Error::Config(format!(
                "accumulate_param: parameter #{param} does not exist (there are {})",
                self.params.len()
            )));
        };
        let start = match range.start_bound() {
            Bound::Included(&s) => s,
            Bound::Excluded(&s) => s + 1,
            Bound::Unbounded => 0,
        };
        let end = match range.end_bound() {
            Bound::Included(&e) => e.saturating_add(1),
            Bound::Excluded(&e) => e,
            Bound::Unbounded => info.numel(),
        };
        let range = start..end;
        let len = M::grad_len(&grad);
        if len != range.len() || range.start > range.end || range.end > info.numel() {
            return Err(Error::Config(format!(
                "gradient of {:?}: {len} elements given for the range {range:?} of a parameter \
                 of {} ({:?}); pass the gradient's elements of that range, contiguous",
                info.name,
                info.numel(),
                info.shape
            )));
        }
        if let (mut parts, Some(pass)) = self.pass_parts() {
            return parts.hand_over(pass, param, range, grad, true);
        }
        let full = window_buffer(
            &mut self.memory,
            &mut self.buffers.full_grads,
            self.sharding.partition.flat_numel(),
            self.window.in_full_buffer,
        )?;
        self.window.in_full_buffer = true;
        let pieces: Vec<GradPiece<M::Grad<'_>>> = self.sharding.runs_of_param[param]
            .iter()
            .filter_map(|&r| piece_of(&self.sharding.layout.runs[r], &range, grad, 0))
            .collect();
        self.memory.flatten(full, &pieces, true)?;
        self.window.present[param] = true;
        Ok(())
    }

    /// One micro-step: on the last of `grad_accum_steps` it reduces the
    /// accumulated gradients, steps the optimizer and updates `params`
    /// (returning `Some`); before that it only accumulates.
    pub fn step(
        &mut self,
        grads: &[Option<M::Grad<'_>>],
        params: &mut M::Params<'_>,
    ) -> Result<Option<StepReport>> {
        if self.window.micro_steps + 1 < self.config.grad_accum_steps {
            self.accumulate(grads)?;
            return Ok(None);
        }
        self.params.check_grads(grads, M::grad_len)?;
        self.reduce_and_update(Some(grads), params).map(Some)
    }

    /// Finishes an optimizer step from the micro-steps accumulated so far
    /// (manual accumulation).
    pub fn step_accumulated(&mut self, params: &mut M::Params<'_>) -> Result<StepReport> {
        if self.window.micro_steps == 0 {
            return Err(Error::State(
                "step_accumulated called without accumulated gradients; call accumulate first"
                    .into(),
            ));
        }
        self.reduce_and_update(None, params)
    }

    /// Drops whatever the current window holds (micro-steps accumulated,
    /// gradients handed over during a backward pass that then failed), so
    /// the next micro-step starts a fresh window.
    pub fn discard_window(&mut self) {
        // Waits for reductions already launched (a failed peer makes them
        // fail within the deadline) to get the buffers back.
        if let Err(e) = self.finish_pass(None) {
            tracing::debug!("discarding a backward pass whose reductions failed: {e}");
        }
        self.window.in_shard = false;
        self.window.plain_grads = false;
        self.window.params_read = false;
        self.window.early_stepped.clear();
        self.window.micro_steps = 0;
        self.window.in_full_buffer = false;
        self.window.present.fill(false);
        // Stages 0 and 1 keep the buffer; it is zeroed where the next window
        // starts (`accumulate`, `accumulate_param`, or per bucket in
        // `reduce_buckets`).
        if self.config.stage.shards_gradients() {
            self.buffers.full_grads = None;
        }
    }
}
