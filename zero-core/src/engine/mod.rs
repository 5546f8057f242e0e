//! The ZeRO engine, stages 0-2, independent of any framework.
//!
//! The engine owns flat buffers, issues collectives in a fixed order, runs
//! the optimizer on the rank's shard and reports its memory. A framework
//! adapter hands it gradients as slices (one slot per parameter, `None` when
//! a parameter has none) and gives it access to the parameter replica through
//! [`ParamStore`].
//!
//! Per optimizer step:
//! - stage 0 all-reduces (mean) gradient buckets and steps every parameter;
//! - stage 1 reduce-scatters (mean) gradient buckets into the rank's gradient
//!   shard, steps the shard, and all-gathers the updated parameters;
//! - stage 2 does the same without a persistent full gradient buffer: each
//!   bucket is flattened into a bucket-sized buffer and reduce-scattered.
//!
//! Stages 1 and 2 move `2(N-1)/N` times the (padded) parameter bytes per
//! rank and step, plus one all-reduce of the trainable mask (one `f32` per
//! parameter) when the per-step trainability check is on, and one of a
//! single `f64` when a gradient norm is asked for.

mod config;
mod layout;
mod memory;
mod setup;
mod state;

pub use config::{ClipConfig, EngineConfig, NormType, ParamGroupSpec, PartitionerKind, Stage};
pub use layout::{Layout, Run};
pub use memory::MemoryReport;
pub use setup::ShardSetup;
pub use state::SaveOptions;

use crate::comm::{Communicator, Host, ReduceOp};
use crate::optim::{FunctionalOptimizer, Hyperparams, ParamKey, ParamMut};
use crate::partition::{ParamInfo, PartitionPlan, ShardPiece};
use crate::{Element, Error, Result};
use std::collections::BTreeMap;
use std::ops::Range;

/// Access to the full parameter replica a framework holds.
///
/// Ranges are element ranges of the flattened (row-major) parameter.
pub trait ParamStore<T> {
    /// Copies `range` of parameter `param` into `out`.
    fn read(&mut self, param: usize, range: Range<usize>, out: &mut [T]) -> Result<()>;
    /// Overwrites `range` of parameter `param` with `values`.
    fn write(&mut self, param: usize, range: Range<usize>, values: &[T]) -> Result<()>;
}

impl<T: Copy> ParamStore<T> for Vec<Vec<T>> {
    fn read(&mut self, param: usize, range: Range<usize>, out: &mut [T]) -> Result<()> {
        out.copy_from_slice(&self[param][range]);
        Ok(())
    }

    fn write(&mut self, param: usize, range: Range<usize>, values: &[T]) -> Result<()> {
        self[param][range].copy_from_slice(values);
        Ok(())
    }
}

/// What one optimizer step did.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct StepReport {
    /// The global gradient norm before clipping, when clipping or
    /// `compute_grad_norm` is on.
    pub grad_norm: Option<f64>,
    /// How many micro-steps were averaged into this step.
    pub micro_steps: usize,
}

/// The ZeRO engine for one rank.
pub struct Engine<T: Element, C: Communicator<Memory = Host>> {
    comm: C,
    config: EngineConfig,
    params: Vec<ParamInfo>,
    index: BTreeMap<String, usize>,
    plan: PartitionPlan,
    layout: Layout,
    /// This rank's index in the plan (0 in stage 0, whose plan has one rank).
    plan_rank: usize,
    owned: Vec<ShardPiece>,
    keys: Vec<ParamKey>,
    group_of: Vec<usize>,
    optimizer: Box<dyn FunctionalOptimizer<T>>,
    /// Working copy of the owned parameter pieces, at their shard offsets.
    param_shard: Vec<T>,
    /// The reduced gradient shard (stages 1 and 2).
    grad_shard: Vec<T>,
    /// Full gradients in bucket-major order (stages 0 and 1 always; stage 2
    /// only inside an accumulation window).
    full_grads: Option<Vec<T>>,
    /// Reused buffer for one bucket (stage-2 reduce-scatter, all-gathers).
    bucket_buf: Vec<T>,
    micro_steps: usize,
    present: Vec<bool>,
    trainable: Vec<bool>,
    active: Vec<bool>,
    bucket_active: Vec<bool>,
    steps: u64,
    /// The state gathered by the last `consolidate_state_dict` (receiver only).
    consolidated: Option<crate::checkpoint::StateDict<T>>,
}

impl<T: Element, C: Communicator<Memory = Host>> Engine<T, C> {
    /// Builds the engine: partitions `params`, assigns parameter groups,
    /// and checks that every rank has the same parameters and configuration
    /// (a collective: every rank must call it).
    ///
    /// `params` must have unique names; their order is the order of every
    /// collective, so give it sorted by name (adapters do). Only parameters
    /// with `trainable` set are ever updated.
    pub fn new(
        comm: C,
        params: Vec<ParamInfo>,
        mut optimizer: Box<dyn FunctionalOptimizer<T>>,
        config: EngineConfig,
    ) -> Result<Self> {
        check_rank_consistency(&comm, &params, &config, optimizer.as_ref())?;
        let ShardSetup {
            index,
            group_of,
            plan,
            layout,
            plan_rank,
            owned,
        } = ShardSetup::new(
            &params,
            &config,
            optimizer.as_mut(),
            comm.world_size(),
            comm.rank(),
        )?;
        let keys = owned
            .iter()
            .map(|p| {
                ParamKey::new(
                    params[p.param].name.clone(),
                    p.param_range.start,
                    group_of[p.param],
                )
            })
            .collect();

        let trainable: Vec<bool> = params.iter().map(|p| p.trainable).collect();
        let mut engine = Self {
            param_shard: vec![T::default(); plan.shard_numel],
            grad_shard: match config.stage {
                Stage::Ddp => Vec::new(),
                _ => vec![T::default(); plan.shard_numel],
            },
            full_grads: None,
            bucket_buf: Vec::new(),
            micro_steps: 0,
            present: vec![false; params.len()],
            active: trainable.clone(),
            bucket_active: Vec::new(),
            trainable,
            steps: 0,
            consolidated: None,
            comm,
            config,
            index,
            layout,
            plan_rank,
            owned,
            keys,
            group_of,
            optimizer,
            plan,
            params,
        };
        engine.rebuild_buckets();
        if engine.config.stage != Stage::Gradients {
            engine.full_grads = Some(vec![T::default(); engine.plan.flat_numel()]);
        }
        Ok(engine)
    }

    /// The communicator.
    pub fn comm(&self) -> &C {
        &self.comm
    }

    /// The configuration.
    pub fn config(&self) -> &EngineConfig {
        &self.config
    }

    /// The parameters, in collective order.
    pub fn params(&self) -> &[ParamInfo] {
        &self.params
    }

    /// The partition plan (in stage 0 a plan over one rank: every rank
    /// steps everything).
    pub fn plan(&self) -> &PartitionPlan {
        &self.plan
    }

    /// The pieces this rank steps, with their optimizer keys.
    pub fn owned_pieces(&self) -> impl Iterator<Item = (&ShardPiece, &ParamKey)> {
        self.owned.iter().zip(&self.keys)
    }

    /// The functional optimizer.
    pub fn optimizer(&self) -> &dyn FunctionalOptimizer<T> {
        self.optimizer.as_ref()
    }

    /// The functional optimizer, mutably (hyperparameters, state import).
    pub fn optimizer_mut(&mut self) -> &mut dyn FunctionalOptimizer<T> {
        self.optimizer.as_mut()
    }

    /// Optimizer steps taken so far.
    pub fn steps(&self) -> u64 {
        self.steps
    }

    /// Sets the step counter (when resuming from a checkpoint).
    pub fn set_steps(&mut self, steps: u64) {
        self.steps = steps;
    }

    /// Micro-steps accumulated since the last optimizer step.
    pub fn pending_micro_steps(&self) -> usize {
        self.micro_steps
    }

    /// The index of the parameter named `name`.
    pub fn param_index(&self, name: &str) -> Option<usize> {
        self.index.get(name).copied()
    }

    /// The group of each parameter.
    pub fn param_groups(&self) -> &[usize] {
        &self.group_of
    }

    /// The learning rate of group 0.
    pub fn learning_rate(&self) -> f64 {
        self.optimizer.learning_rate(0)
    }

    /// Sets the learning rate of every group.
    pub fn set_learning_rate(&mut self, lr: f64) {
        for group in 0..self.optimizer.num_groups() {
            self.optimizer.set_learning_rate(group, lr);
        }
    }

    /// Adds a parameter group for the named parameters, which leave their
    /// current group (their optimizer state is kept). Every rank must call it
    /// alike. Returns the group's index.
    pub fn add_param_group(&mut self, names: &[&str], hyperparams: &Hyperparams) -> Result<usize> {
        let mut members = Vec::with_capacity(names.len());
        for name in names {
            let Some(&i) = self.index.get(*name) else {
                return Err(Error::Config(format!(
                    "add_param_group: {name:?} is not a parameter of the model"
                )));
            };
            members.push(i);
        }
        let group = self.optimizer.add_group(hyperparams)?;
        for i in members {
            self.group_of[i] = group;
        }
        for (piece, key) in self.owned.iter().zip(self.keys.iter_mut()) {
            key.group = self.group_of[piece.param];
        }
        Ok(group)
    }

    /// Freezes (`false`) or unfreezes a parameter. Takes effect at the next
    /// step (checked) or at [`Engine::refresh_trainability`] (unchecked).
    pub fn set_trainable(&mut self, name: &str, trainable: bool) -> Result<()> {
        let Some(&i) = self.index.get(name) else {
            return Err(Error::Config(format!(
                "set_trainable: {name:?} is not a parameter of the model"
            )));
        };
        if trainable && !self.params[i].trainable {
            return Err(Error::Config(format!(
                "parameter {name:?} was frozen when the optimizer was built and owns no shard; \
                 rebuild the optimizer with it trainable"
            )));
        }
        self.trainable[i] = trainable;
        Ok(())
    }

    /// The trainable mask in effect (global across ranks).
    pub fn active_mask(&self) -> &[bool] {
        &self.active
    }

    /// Applies the trainable flags now, when the per-step check is off.
    /// A collective. Refusing inside gradient accumulation: the pending
    /// gradients were bucketed for the old mask.
    pub fn refresh_trainability(&mut self) -> Result<()> {
        if self.micro_steps > 0 {
            return Err(Error::State(format!(
                "refresh_trainability called with {} micro-step(s) accumulated; \
                 finish the optimizer step first, or their gradients would be lost",
                self.micro_steps
            )));
        }
        let local: Vec<bool> = self.trainable.clone();
        let active = self.global_mask(&local)?;
        if active != self.active {
            self.active = active;
            self.rebuild_buckets();
        }
        Ok(())
    }

    /// Bytes this rank holds, per category.
    pub fn memory_report(&self) -> MemoryReport {
        let size = std::mem::size_of::<T>();
        let replica: usize = self
            .params
            .iter()
            .map(|p| p.numel() * p.dtype.size_in_bytes())
            .sum();
        MemoryReport {
            params: replica + self.param_shard.len() * size,
            grads: self.full_grads.as_ref().map_or(0, Vec::len) * size,
            grad_shard: self.grad_shard.len() * size,
            optimizer_state: self.optimizer.state_bytes(),
            comm_buffers: self.bucket_buf.capacity() * size,
        }
    }

    /// Adds one micro-step's gradients without communicating. `grads` has
    /// one slot per parameter, each as long as the parameter.
    pub fn accumulate(&mut self, grads: &[Option<&[T]>]) -> Result<()> {
        self.check_grads(grads)?;
        let numel = self.plan.flat_numel();
        let full = self
            .full_grads
            .get_or_insert_with(|| vec![T::default(); numel]);
        if self.micro_steps == 0 {
            full.fill(T::default());
        }
        for run in &self.layout.runs {
            if let Some(g) = grads[run.param] {
                let dst = &mut full[run.pos..run.pos + run.param_range.len()];
                add_assign(dst, &g[run.param_range.clone()]);
            }
        }
        for (present, g) in self.present.iter_mut().zip(grads) {
            *present |= g.is_some();
        }
        self.micro_steps += 1;
        Ok(())
    }

    /// One micro-step: on the last of `grad_accum_steps` it reduces the
    /// accumulated gradients, steps the optimizer and updates `params`
    /// (returning `Some`); before that it only accumulates.
    pub fn step(
        &mut self,
        grads: &[Option<&[T]>],
        params: &mut dyn ParamStore<T>,
    ) -> Result<Option<StepReport>> {
        if self.micro_steps + 1 < self.config.grad_accum_steps {
            self.accumulate(grads)?;
            return Ok(None);
        }
        self.check_grads(grads)?;
        self.reduce_and_update(Some(grads), params).map(Some)
    }

    /// Finishes an optimizer step from the micro-steps accumulated so far
    /// (manual accumulation).
    pub fn step_accumulated(&mut self, params: &mut dyn ParamStore<T>) -> Result<StepReport> {
        if self.micro_steps == 0 {
            return Err(Error::State(
                "step_accumulated called without accumulated gradients; call accumulate first"
                    .into(),
            ));
        }
        self.reduce_and_update(None, params)
    }

    fn check_grads(&self, grads: &[Option<&[T]>]) -> Result<()> {
        if grads.len() != self.params.len() {
            return Err(Error::Config(format!(
                "got {} gradient slots for {} parameters; pass one slot per parameter (None to skip)",
                grads.len(),
                self.params.len()
            )));
        }
        for (p, g) in self.params.iter().zip(grads) {
            if let Some(g) = g {
                if g.len() != p.numel() {
                    return Err(Error::Config(format!(
                        "gradient of {:?} has {} elements, the parameter has {} ({:?})",
                        p.name,
                        g.len(),
                        p.numel(),
                        p.shape
                    )));
                }
            }
        }
        Ok(())
    }

    fn reduce_and_update(
        &mut self,
        last: Option<&[Option<&[T]>]>,
        params: &mut dyn ParamStore<T>,
    ) -> Result<StepReport> {
        let micro_steps = self.micro_steps + usize::from(last.is_some());
        if let Some(grads) = last {
            for (present, g) in self.present.iter_mut().zip(grads) {
                *present |= g.is_some();
            }
        }

        // Which parameters train this step: the same answer on every rank.
        if self.config.check_trainability {
            let local: Vec<bool> = self
                .trainable
                .iter()
                .zip(&self.present)
                .map(|(&t, &p)| t && p)
                .collect();
            let active = self.global_mask(&local)?;
            if active != self.active {
                tracing::debug!("trainable mask changed; rebuilding buckets");
                self.active = active;
                self.rebuild_buckets();
            }
        }

        // The owned pieces' current values (the replica may have been changed
        // by the user since the last step).
        let base = self.plan_rank * self.plan.shard_numel;
        for piece in &self.owned {
            let off = piece.flat_range.start - base;
            params.read(
                piece.param,
                piece.param_range.clone(),
                &mut self.param_shard[off..off + piece.len()],
            )?;
        }

        self.reduce_gradients(last, micro_steps)?;
        let grad_norm = self.clip_gradients()?;
        self.run_optimizer()?;
        self.write_back(params)?;

        self.micro_steps = 0;
        self.present.fill(false);
        // Stages 0 and 1 keep the buffer; it is zeroed where the next window
        // starts (`accumulate`, or per bucket in `reduce_gradients`).
        if self.config.stage == Stage::Gradients {
            self.full_grads = None;
        }
        self.steps += 1;
        Ok(StepReport {
            grad_norm,
            micro_steps,
        })
    }

    /// Reduces every active bucket: all-reduce in stage 0, reduce-scatter
    /// into the gradient shard otherwise; then averages over micro-steps.
    fn reduce_gradients(
        &mut self,
        last: Option<&[Option<&[T]>]>,
        micro_steps: usize,
    ) -> Result<()> {
        for k in 0..self.layout.buckets.len() {
            if !self.bucket_active[k] {
                continue;
            }
            let range = self.layout.bucket_range(k);
            let shard_range = self.layout.buckets[k].clone();
            if let Some(full) = self.full_grads.as_mut() {
                let bucket = &mut full[range.clone()];
                if self.micro_steps == 0 {
                    bucket.fill(T::default());
                }
                if let Some(grads) = last {
                    for run in self.layout.runs_of(k) {
                        if let Some(g) = grads[run.param] {
                            let at = run.pos - range.start;
                            add_assign(
                                &mut bucket[at..at + run.param_range.len()],
                                &g[run.param_range.clone()],
                            );
                        }
                    }
                }
                match self.config.stage {
                    Stage::Ddp => self.comm.all_reduce(bucket, ReduceOp::Avg)?,
                    _ => self.comm.reduce_scatter(
                        bucket,
                        &mut self.grad_shard[shard_range],
                        ReduceOp::Avg,
                    )?,
                }
            } else {
                // Stage 2 without accumulation: flatten straight from the
                // caller's gradients into one bucket-sized buffer.
                let len = range.len();
                if self.bucket_buf.len() < len {
                    self.bucket_buf.resize(len, T::default());
                }
                let bucket = &mut self.bucket_buf[..len];
                bucket.fill(T::default());
                if let Some(grads) = last {
                    for run in self.layout.runs_of(k) {
                        if let Some(g) = grads[run.param] {
                            let at = run.pos - range.start;
                            bucket[at..at + run.param_range.len()]
                                .copy_from_slice(&g[run.param_range.clone()]);
                        }
                    }
                }
                self.comm.reduce_scatter(
                    bucket,
                    &mut self.grad_shard[shard_range],
                    ReduceOp::Avg,
                )?;
            }
        }
        if micro_steps > 1 {
            self.scale_grads(1.0 / micro_steps as f64);
        }
        Ok(())
    }

    /// Computes the global gradient norm if asked for, and clips.
    fn clip_gradients(&mut self) -> Result<Option<f64>> {
        let norm_type = match (&self.config.clip, self.config.compute_grad_norm) {
            (Some(clip), _) => clip.norm_type,
            (None, true) => NormType::L2,
            (None, false) => return Ok(None),
        };
        let stage = self.config.stage;
        let base = self.plan_rank * self.plan.shard_numel;
        let source = grad_source(stage, &mut self.full_grads, &mut self.grad_shard);
        let mut local = 0.0f64;
        for piece in self.owned.iter().filter(|p| self.active[p.param]) {
            let off = piece.flat_range.start - base;
            let g = &source[off..off + piece.len()];
            match norm_type {
                NormType::L1 => local += g.iter().map(|x| x.to_f64().abs()).sum::<f64>(),
                NormType::L2 => local += g.iter().map(|x| x.to_f64().powi(2)).sum::<f64>(),
                NormType::Inf => {
                    local = g.iter().fold(local, |m, x| m.max(x.to_f64().abs()));
                }
            }
        }
        let mut total = [local];
        // Stage 0 ranks hold the whole reduced gradient: the local norm is
        // the global one.
        if stage != Stage::Ddp {
            let op = match norm_type {
                NormType::Inf => ReduceOp::Max,
                _ => ReduceOp::Sum,
            };
            self.comm.all_reduce(&mut total[..], op)?;
        }
        let norm = match norm_type {
            NormType::L2 => total[0].sqrt(),
            _ => total[0],
        };
        if let Some(clip) = self.config.clip {
            // torch.nn.utils.clip_grad_norm_: coefficient clamped to 1.
            let coef = clip.max_norm / (norm + 1e-6);
            if coef < 1.0 {
                self.scale_grads(coef);
            }
        }
        Ok(Some(norm))
    }

    /// Multiplies the reduced gradients of the owned pieces by `factor`.
    fn scale_grads(&mut self, factor: f64) {
        let base = self.plan_rank * self.plan.shard_numel;
        let source = grad_source(
            self.config.stage,
            &mut self.full_grads,
            &mut self.grad_shard,
        );
        for piece in &self.owned {
            let off = piece.flat_range.start - base;
            for g in &mut source[off..off + piece.len()] {
                *g = T::from_f64(g.to_f64() * factor);
            }
        }
    }

    fn run_optimizer(&mut self) -> Result<()> {
        let base = self.plan_rank * self.plan.shard_numel;
        let grad_source: &[T] = match self.config.stage {
            Stage::Ddp => self.full_grads.as_deref().unwrap_or_default(),
            _ => &self.grad_shard,
        };
        let mut pieces = Vec::with_capacity(self.owned.len());
        let mut grads = Vec::with_capacity(self.owned.len());
        let mut rest: &mut [T] = &mut self.param_shard;
        let mut consumed = 0;
        for (piece, key) in self.owned.iter().zip(&self.keys) {
            let off = piece.flat_range.start - base;
            let (_, tail) = std::mem::take(&mut rest).split_at_mut(off - consumed);
            let (data, tail) = tail.split_at_mut(piece.len());
            rest = tail;
            consumed = off + piece.len();
            pieces.push(ParamMut { key, data });
            grads.push(self.active[piece.param].then(|| &grad_source[off..off + piece.len()]));
        }
        self.optimizer.step(&mut pieces, &grads)
    }

    /// Puts the updated values into the replica: stage 0 writes its own
    /// (whole) parameters; stages 1 and 2 all-gather each active bucket.
    fn write_back(&mut self, params: &mut dyn ParamStore<T>) -> Result<()> {
        let base = self.plan_rank * self.plan.shard_numel;
        if self.config.stage == Stage::Ddp {
            for piece in self.owned.iter().filter(|p| self.active[p.param]) {
                let off = piece.flat_range.start - base;
                params.write(
                    piece.param,
                    piece.param_range.clone(),
                    &self.param_shard[off..off + piece.len()],
                )?;
            }
            return Ok(());
        }
        for k in 0..self.layout.buckets.len() {
            if !self.bucket_active[k] {
                continue;
            }
            let range = self.layout.bucket_range(k);
            let shard_range = self.layout.buckets[k].clone();
            // The gradients are consumed by now: gather into the full
            // gradient buffer where one exists (stage 1), so the gather
            // needs no buffer of its own.
            let gathered = match self.full_grads.as_mut() {
                Some(full) => &mut full[range.clone()],
                None => {
                    let len = range.len();
                    if self.bucket_buf.len() < len {
                        self.bucket_buf.resize(len, T::default());
                    }
                    &mut self.bucket_buf[..len]
                }
            };
            self.comm
                .all_gather(&self.param_shard[shard_range], gathered)?;
            for run in self.layout.runs_of(k) {
                if self.active[run.param] {
                    let at = run.pos - range.start;
                    params.write(
                        run.param,
                        run.param_range.clone(),
                        &gathered[at..at + run.param_range.len()],
                    )?;
                }
            }
        }
        Ok(())
    }

    /// Marks the buckets that hold at least one active parameter; the others
    /// are neither reduced nor gathered.
    fn rebuild_buckets(&mut self) {
        self.bucket_active = (0..self.layout.buckets.len())
            .map(|k| {
                self.layout
                    .runs_of(k)
                    .iter()
                    .any(|run| self.active[run.param])
            })
            .collect();
    }

    /// ORs a per-parameter mask across ranks.
    fn global_mask(&self, local: &[bool]) -> Result<Vec<bool>> {
        let mut mask: Vec<f32> = local.iter().map(|&b| f32::from(u8::from(b))).collect();
        self.comm.all_reduce(&mut mask[..], ReduceOp::Max)?;
        Ok(mask
            .iter()
            .zip(&self.params)
            .map(|(&m, p)| m > 0.5 && p.trainable)
            .collect())
    }
}

/// All-gathers a description of every rank's parameters, configuration and
/// optimizer and names the first difference with another rank. A
/// collective; engines run it first thing in their constructor.
///
/// `Engine::new` runs it before validating anything locally: every check
/// after it depends only on these inputs, so ranks either all fail alike or
/// all pass. A rank that failed alone would skip this collective and leave
/// its peers waiting until their timeout.
pub fn check_rank_consistency<T: Element, C: Communicator>(
    comm: &C,
    params: &[ParamInfo],
    config: &EngineConfig,
    optimizer: &dyn FunctionalOptimizer<T>,
) -> Result<()> {
    let mine = fingerprint(params, config, optimizer);
    let bytes = serde_json::to_vec(&mine)?;
    let all = comm.all_gather_bytes(&bytes)?;
    for (other_rank, other) in all.iter().enumerate() {
        let other: Vec<(String, String)> = serde_json::from_slice(other)?;
        if other == mine {
            continue;
        }
        let at = mine
            .iter()
            .zip(&other)
            .position(|(a, b)| a != b)
            .unwrap_or(mine.len().min(other.len()));
        let describe = |list: &[(String, String)]| match list.get(at) {
            Some((field, value)) => format!("{field} = {value}"),
            None => format!("no entry #{at} (only {} entries)", list.len()),
        };
        return Err(Error::RankMismatch {
            rank: comm.rank(),
            this: describe(&mine),
            other_rank,
            other: describe(&other),
        });
    }
    Ok(())
}

fn fingerprint<T: Element>(
    params: &[ParamInfo],
    config: &EngineConfig,
    optimizer: &dyn FunctionalOptimizer<T>,
) -> Vec<(String, String)> {
    let mut out = vec![
        ("element type".to_string(), T::DTYPE.to_string()),
        ("parameter count".to_string(), params.len().to_string()),
    ];
    for (i, p) in params.iter().enumerate() {
        out.push((
            format!("parameter #{i}"),
            format!(
                "{} {:?} {}{}",
                p.name,
                p.shape,
                p.dtype,
                if p.trainable { "" } else { " frozen" }
            ),
        ));
    }
    let c = config;
    out.push(("stage".into(), c.stage.number().to_string()));
    out.push(("partitioner".into(), format!("{:?}", c.partitioner)));
    out.push(("bucket_bytes".into(), c.bucket_bytes.to_string()));
    out.push(("grad_accum_steps".into(), c.grad_accum_steps.to_string()));
    out.push(("clip".into(), format!("{:?}", c.clip)));
    out.push(("compute_grad_norm".into(), c.compute_grad_norm.to_string()));
    out.push((
        "check_trainability".into(),
        c.check_trainability.to_string(),
    ));
    out.push(("optimizer".into(), optimizer.kind().to_string()));
    for g in 0..optimizer.num_groups() {
        out.push((
            format!("optimizer group {g}"),
            serde_json::Value::Object(optimizer.hyperparams(g)).to_string(),
        ));
    }
    for (k, spec) in c.param_groups.iter().enumerate() {
        out.push((
            format!("parameter group {}", k + 1),
            format!(
                "{:?} {}",
                spec.params,
                serde_json::Value::Object(spec.hyperparams.clone())
            ),
        ));
    }
    out
}

/// The reduced gradients of the owned pieces: the full buffer in stage 0
/// (whose plan has one rank, so positions are flat offsets), the gradient
/// shard otherwise.
fn grad_source<'a, T>(
    stage: Stage,
    full_grads: &'a mut Option<Vec<T>>,
    grad_shard: &'a mut [T],
) -> &'a mut [T] {
    match stage {
        Stage::Ddp => full_grads.as_deref_mut().unwrap_or_default(),
        _ => grad_shard,
    }
}

/// `dst += src`, element-wise, in the accumulator type.
fn add_assign<T: Element>(dst: &mut [T], src: &[T]) {
    for (d, s) in dst.iter_mut().zip(src) {
        *d = T::from_acc(d.to_acc() + s.to_acc());
    }
}
