//! What a load writes of the engine, borrowed for one load ([`Load`]):
//! the optimizer's state and hyperparameters, the weights, the step counter
//! and the loss scaler, from a sharded checkpoint or a [`StateDict`].

use crate::checkpoint::MANIFEST_FILE;
use crate::checkpoint::{checkpoint_error, CheckpointInfo, GroupState, Manifest, StateDict};
use crate::comm::Communicator;
use crate::engine::params::ParamTable;
use crate::engine::precision::{engine_steps, Masters, Truth};
use crate::engine::scaler::LossScaler;
use crate::engine::sharding::Sharding;
use crate::engine::state::{check_groups, checked_info, group_states, read_owned_state};
use crate::engine::{Engine, ShardMemory, Stage};
use crate::optim::{FunctionalOptimizer, OptimizerState, ParamState};
use crate::{Element, Error, Result};
use std::ops::Range;
use std::path::Path;

/// The engine's parts a load reads and writes, borrowed for one load: the
/// optimizer (its state through the memory, its hyperparameters), the
/// weights (the replica through the memory, the master weights in the
/// parameter shard), the step counter and the loss scaler; the parameters
/// and the partition say what this rank takes.
pub(super) struct Load<'e, T: Element, C: Communicator, M: ShardMemory<T, C>> {
    comm: &'e C,
    memory: &'e mut M,
    optimizer: &'e mut dyn FunctionalOptimizer<T>,
    params: &'e ParamTable,
    sharding: &'e Sharding,
    /// The parameter shard: the master weights where it holds the truth.
    param_shard: &'e mut M::Buffer,
    stage: Stage,
    /// Stage 3: per parameter, whether it lives only as shards (empty at
    /// other stages).
    sharded: &'e [bool],
    /// Whether the shard, not the replica, holds the truth of the trained
    /// weights (`Truth::in_shard`).
    truth: bool,
    /// Set fresh once the shard holds what was loaded.
    fresh: &'e mut Truth,
    steps: &'e mut u64,
    scaler: Option<&'e mut LossScaler>,
}

impl<'e, T: Element, C: Communicator, M: ShardMemory<T, C>> Load<'e, T, C, M> {
    /// The parts of `engine` a load reads and writes.
    pub fn of(engine: &'e mut Engine<T, C, M>) -> Result<Self> {
        let truth = engine.truth.in_shard();
        let sharded = engine.stage.sharded_mask();
        Ok(Self {
            comm: &engine.comm,
            memory: &mut engine.memory,
            optimizer: engine.optimizer.home_mut()?,
            params: &engine.params,
            sharding: &engine.sharding,
            param_shard: engine.buffers.param_shard.here_mut()?,
            stage: engine.config.stage,
            sharded,
            truth,
            fresh: &mut engine.truth,
            steps: &mut engine.steps,
            scaler: engine.scaler.as_mut(),
        })
    }

    /// Loads the sharded checkpoint in `dir` ([`Engine::load_checkpoint`])
    /// and returns its manifest; the parameter shard is at home. Not a
    /// collective: the caller agrees with the other ranks on the outcome.
    pub fn checkpoint(mut self, dir: &Path, weights: &mut M::Params<'_>) -> Result<Manifest> {
        let manifest = Manifest::load(dir)?;
        let groups = group_states(&*self.optimizer, self.params);
        let info = checked_info(dir, &manifest, self.params, self.optimizer.kind(), &groups)?;
        let owned = self
            .sharding
            .owned
            .iter()
            .map(|p| (self.params[p.param].name.clone(), p.param_range.clone()));
        let imported = read_owned_state(dir, &manifest, info, owned)?;
        self.read_weights(dir, &manifest, info, weights)?;
        self.install(&info.param_groups, imported, info.steps)?;
        Ok(manifest)
    }

    /// Loads an unsharded optimizer state ([`Engine::load_state_dict`]):
    /// this rank's pieces sliced out of the full tensors, once the dict is
    /// checked against the optimizer and the model.
    pub fn state_dict(mut self, dict: &StateDict<T>) -> Result<()> {
        if dict.optimizer != self.optimizer.kind() {
            return Err(Error::Optimizer(format!(
                "load_state_dict: the state dict is of a {:?} optimizer, this engine's is {:?}",
                dict.optimizer,
                self.optimizer.kind()
            )));
        }
        check_groups(
            &group_states(&*self.optimizer, self.params),
            &dict.param_groups,
        )
        .map_err(|detail| Error::Optimizer(format!("load_state_dict: {detail}")))?;
        for (name, piece) in &dict.state {
            let Some(i) = self.params.index(name) else {
                return Err(Error::Optimizer(format!(
                    "load_state_dict: the state dict holds state for {name:?}, which is not a \
                     parameter of the model; is it the state of another model?"
                )));
            };
            let numel = self.params[i].numel();
            for (tensor, values) in &piece.tensors {
                if values.len() != numel {
                    return Err(Error::Optimizer(format!(
                        "load_state_dict: state {tensor:?} of {name:?} has {} elements, the \
                         parameter has {numel}",
                        values.len()
                    )));
                }
            }
        }
        let mut imported = OptimizerState::default();
        for (piece, key) in self.sharding.owned.iter().zip(&self.sharding.keys) {
            if let Some(full) = dict.state.get(&key.name) {
                imported.params.insert(
                    (key.name.clone(), key.offset),
                    ParamState {
                        scalars: full.scalars.clone(),
                        tensors: full
                            .tensors
                            .iter()
                            .map(|(n, v)| (n.clone(), v[piece.param_range.clone()].to_vec()))
                            .collect(),
                    },
                );
            }
        }
        self.install(&dict.param_groups, imported, dict.steps)
    }

    /// Takes every group's saved hyperparameters (`groups`), this rank's
    /// optimizer state (`imported`) and the step counter.
    fn install(
        &mut self,
        groups: &[GroupState],
        imported: OptimizerState<T>,
        steps: u64,
    ) -> Result<()> {
        for (g, group) in groups.iter().enumerate() {
            self.optimizer.set_hyperparams(g, &group.hyperparams)?;
        }
        let pieces = self.sharding.step_pieces(|_| true);
        self.memory
            .import_state(&mut *self.optimizer, &pieces, imported)?;
        *self.steps = steps;
        Ok(())
    }

    /// The weights from the model file: into the replica (and the masters),
    /// or, for a sharded parameter, only the owned pieces into the masters;
    /// and the loss scaler's state.
    fn read_weights(
        &mut self,
        dir: &Path,
        manifest: &Manifest,
        info: &CheckpointInfo,
        weights: &mut M::Params<'_>,
    ) -> Result<()> {
        let manifest_path = dir.join(MANIFEST_FILE);
        let model_file = info
            .model_file
            .as_deref()
            .ok_or_else(|| checkpoint_error(&manifest_path, "names no model file"))?;
        let model = manifest.map_file(dir, model_file)?;
        let model_path = model.path();
        // Any float dtype loads into any precision: a bf16 run's f32
        // masters into an f32 run, an f32 run's weights into the masters of
        // a bf16 run (the replica gets them rounded).
        let masters = self.truth;
        for i in 0..self.params.len() {
            let p = &self.params[i];
            if !engine_steps::<T>(p.dtype) {
                continue;
            }
            let t = model.get(&p.name).ok_or_else(|| {
                checkpoint_error(model_path, format!("has no tensor {:?}", p.name))
            })?;
            if t.shape != p.shape {
                return Err(checkpoint_error(
                    model_path,
                    format!(
                        "tensor {:?} is {} {:?}, the model's parameter is {} {:?}",
                        p.name, t.dtype, t.shape, p.dtype, p.shape
                    ),
                ));
            }
            let name = p.name.clone();
            let read_error = |e: Error| checkpoint_error(model_path, format!("{name:?}: {e}"));
            if self.sharded.get(i) == Some(&true) {
                // Stage 3: no replica to write, and no rank reads more of
                // the parameter than the pieces it owns (`masters` holds).
                let ranges: Vec<Range<usize>> = self
                    .sharding
                    .owned_copies
                    .iter()
                    .filter(|c| c.param == i)
                    .map(|c| c.param_range.clone())
                    .collect();
                for range in ranges {
                    let mut values = vec![T::default(); range.len()];
                    t.read_range_as(range.clone(), &mut values)
                        .map_err(read_error)?;
                    self.masters().set_range(i, range, &values)?;
                }
                continue;
            }
            // One whole tensor at a time, dropped before the next.
            let values = t.to_vec_as::<T>().map_err(read_error)?;
            self.memory.write_param_host(weights, i, &values)?;
            if masters {
                self.masters().set(i, &values)?;
            }
        }
        self.fresh.set_fresh(masters);
        if let (Some(state), Some(scaler)) = (info.loss_scaler, self.scaler.as_mut()) {
            scaler.restore(state);
        }
        Ok(())
    }

    /// The master weights, to set piece by piece.
    fn masters(&mut self) -> Masters<'_, T, C, M> {
        let memory = &mut *self.memory;
        Masters::new(
            (self.comm, memory),
            self.param_shard,
            self.sharding,
            self.stage,
        )
    }
}
