//! Checkpoints from the engine's side: consolidating the sharded optimizer
//! state into a [`StateDict`], loading one, and sharded save and load at any
//! world size, stage and partitioner (the files' pieces and checks are the
//! `state` module's).
//!
//! Every function here is a collective unless it says otherwise. Failures on
//! one rank are shared with the others through one small `all_gather_bytes` of
//! a status, so a rank that fails to write a file makes every rank return an
//! error naming it instead of leaving them waiting.

use crate::checkpoint::{
    checkpoint_error, file_order, CheckpointInfo, CheckpointKind, FileRecord, Manifest, StateDict,
    TensorWriter, MANIFEST_FILE,
};
use crate::comm::{Communicator, ReduceOp};
use crate::engine::state::{
    agree, agreed_tag, check_groups, checked_info, fresh_tag, group_states, numel_by_name,
    read_owned_state, remove_stale_files, write_state_file, SaveOptions,
};
use crate::engine::state::{
    check_coverage, pack_pieces, piece_metas, sink_pieces, FileSink, MemorySink, ModelFile,
    ModelSink, PieceMeta, PieceSink,
};
use crate::engine::state::{ModelSnapshot, Pending, SavedCheckpoint, Snapshot, StateSnapshot};
use crate::engine::{Engine, ShardMemory, Stage};
use crate::optim::{OptimizerState, ParamState};
use crate::{DType, Element, Error, Result};
use std::collections::BTreeMap;
use std::ops::Range;
use std::path::Path;

impl<T: Element, C: Communicator, M: ShardMemory<T, C>> Engine<T, C, M> {
    /// Gathers the full (unsharded) optimizer state on rank `to`; read it
    /// there with [`Engine::state_dict`]. A collective: every rank calls it.
    ///
    /// It streams shard by shard: for each rank in order, that rank's
    /// pieces go to `to` alone (a `gather_varlen` where only the source
    /// sends), so `to` holds at most one other rank's shard besides the
    /// result. Ranks that own nothing send nothing. The result is a
    /// snapshot: later steps do not update it.
    pub fn consolidate_state_dict(&mut self, to: usize) -> Result<()> {
        self.finish_gathers()?;
        self.consolidated = None;
        let numel = numel_by_name(&self.params);
        let mut sink = MemorySink {
            numel: &numel,
            state: BTreeMap::new(),
            covered: BTreeMap::new(),
        };
        self.stream_pieces(to, "consolidate_state_dict", &mut sink)?;
        if self.comm.rank() == to {
            check_coverage(&numel, &sink.covered)?;
            self.consolidated = Some(StateDict {
                optimizer: self.optimizer.kind().to_string(),
                state: sink.state,
                param_groups: group_states(self.optimizer.as_ref(), &self.params, &self.group_of),
                steps: self.steps,
            });
        }
        Ok(())
    }

    /// The state gathered by the last [`Engine::consolidate_state_dict`]
    /// on this rank (only its `to` rank has one). Not a collective.
    pub fn state_dict(&self) -> Result<&StateDict<T>> {
        self.consolidated.as_ref().ok_or_else(|| {
            Error::State(format!(
                "rank {} holds no consolidated optimizer state; \
                 call consolidate_state_dict(to) on every rank first, then state_dict() on rank `to`",
                self.comm.rank()
            ))
        })
    }

    /// Writes the full optimizer state into `dir` as one
    /// `optimizer.<tag>.safetensors` (tensors `state.<param>.<state>`, scalars as
    /// f64 tensors of shape `[]`) plus the manifest, streaming shard by
    /// shard to rank `to`, which writes each piece as it arrives (it never
    /// holds more than one shard). Read it back with [`StateDict::load`].
    /// A collective; an error on `to` is returned on every rank.
    pub fn save_consolidated(&mut self, dir: impl AsRef<Path>, to: usize) -> Result<()> {
        self.finish_gathers()?;
        let dir = dir.as_ref();
        // Only `to` writes, so only `to` needs the name.
        let old = if self.comm.rank() == to {
            Manifest::load(dir).ok()
        } else {
            None
        };
        let tag = fresh_tag(old.as_ref(), self.steps);
        let file_name = crate::checkpoint::consolidated_file_name(&tag);
        let path = dir.join(&file_name);
        let numel = numel_by_name(&self.params);
        let mut sink = FileSink {
            numel: &numel,
            path: &path,
            dtype: T::DTYPE,
            file: None,
            covered: BTreeMap::new(),
        };
        let streamed = self.stream_pieces(to, "save_consolidated", &mut sink);
        let local = streamed.and_then(|()| {
            if self.comm.rank() != to {
                return Ok(Vec::new());
            }
            check_coverage(&numel, &sink.covered)?;
            let record = match sink.file.take() {
                Some(file) => file.finish()?,
                None => return Err(checkpoint_error(&path, "internal: file not created")),
            };
            let mut manifest = Manifest::new();
            manifest.record(file_name.clone(), record);
            manifest.checkpoint = Some(self.checkpoint_info(
                CheckpointKind::Consolidated,
                tag.clone(),
                serde_json::Value::Null,
            ));
            manifest.save(dir)?;
            remove_stale_files(dir, &manifest, old.as_ref());
            Ok(Vec::new())
        });
        agree(&*self.comm, local, dir, "save_consolidated").map(|_| ())
    }

    /// Loads an unsharded optimizer state: each rank slices its pieces out
    /// of the full tensors, and every group takes the dict's
    /// hyperparameters (an optimizer built with another learning rate takes
    /// the saved one). Works at any world size, stage and partitioner. Not
    /// a collective; call it on every rank with the same dict.
    ///
    /// Errors: another optimizer kind, other parameter groups, state for a
    /// name that is not a parameter, or a tensor whose length is not the
    /// parameter's. Parameters without state in the dict keep theirs (a
    /// fresh engine has none). Sets the step counter to the dict's.
    pub fn load_state_dict(&mut self, dict: &StateDict<T>) -> Result<()> {
        self.finish_gathers()?;
        self.window.refuse_mid("load_state_dict")?;
        if dict.optimizer != self.optimizer.kind() {
            return Err(Error::Optimizer(format!(
                "load_state_dict: the state dict is of a {:?} optimizer, this engine's is {:?}",
                dict.optimizer,
                self.optimizer.kind()
            )));
        }
        check_groups(
            &group_states(self.optimizer.as_ref(), &self.params, &self.group_of),
            &dict.param_groups,
        )
        .map_err(|detail| Error::Optimizer(format!("load_state_dict: {detail}")))?;
        for (name, piece) in &dict.state {
            let Some(&i) = self.index.get(name) else {
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
        for (g, group) in dict.param_groups.iter().enumerate() {
            self.optimizer.set_hyperparams(g, &group.hyperparams)?;
        }
        let pieces = self.sharding.step_pieces(|_| true);
        self.memory
            .import_state(self.optimizer.as_mut(), &pieces, imported)?;
        self.steps = dict.steps;
        Ok(())
    }

    /// Saves a sharded checkpoint into `dir`; see
    /// [`Engine::save_checkpoint_with`].
    pub fn save_checkpoint(
        &mut self,
        dir: impl AsRef<Path>,
        weights: &mut M::Params<'_>,
    ) -> Result<Manifest> {
        self.save_checkpoint_with(dir, weights, &SaveOptions::default())
    }

    /// Saves a sharded checkpoint into `dir` (created if needed). A
    /// collective.
    ///
    /// Each rank that owns a shard writes `optim.<tag>.rank<r>.safetensors`
    /// (its pieces' state, tensors `state.<param>.<offset>.<state>`; in
    /// stage 0 only rank 0, as every rank holds everything); rank 0 writes
    /// `model.<tag>.safetensors` (the weights of the parameters of the
    /// engine's dtype, read from `weights`, under their names: Candle's
    /// `safetensors::load` and Python's `safetensors` read it) and, once
    /// every rank reports success, `manifest.json`, the commit point. The
    /// tag is `step<N>` (with a suffix if the directory's current checkpoint
    /// already uses it), so a save that fails part-way leaves the previous
    /// checkpoint of the directory loadable; files of older checkpoints are
    /// removed once the new manifest is in place.
    ///
    /// Refused inside a gradient-accumulation window (the accumulated
    /// gradients are not part of a checkpoint): finish the step first. A
    /// background save in flight ([`Engine::save_checkpoint_async`]) is
    /// completed first, and its failure returned.
    pub fn save_checkpoint_with(
        &mut self,
        dir: impl AsRef<Path>,
        weights: &mut M::Params<'_>,
        options: &SaveOptions,
    ) -> Result<Manifest> {
        self.finish_gathers()?;
        self.window.refuse_mid("save_checkpoint")?;
        // One save at a time: a background one in flight completes first.
        self.wait_checkpoint()?;
        let dir = dir.as_ref();
        self.with_shard_home(|engine| engine.save_checkpoint_home(dir, weights, options))
    }

    /// [`Engine::save_checkpoint_with`] with the parameter shard at home.
    fn save_checkpoint_home(
        &mut self,
        dir: &Path,
        weights: &mut M::Params<'_>,
        options: &SaveOptions,
    ) -> Result<Manifest> {
        let rank = self.comm.rank();

        // Rank 0 picks a tag unused by the directory's current checkpoint.
        let old = if rank == 0 {
            Manifest::load(dir).ok()
        } else {
            None
        };
        let tag = agreed_tag(&*self.comm, old.as_ref(), self.steps)?;

        let shard_file = |p: usize| format!("optim.{tag}.rank{p}.safetensors");
        let model_file = format!("model.{tag}.safetensors");
        let local = (|| -> Result<Vec<(String, FileRecord)>> {
            std::fs::create_dir_all(dir).map_err(|e| Error::Io {
                path: dir.to_path_buf(),
                source: e,
            })?;
            let mut files = Vec::new();
            let writes_shard = self.config.stage != Stage::Ddp || rank == 0;
            if writes_shard {
                let name = shard_file(self.sharding.rank);
                let fail = options
                    .fail_after
                    .and_then(|(r, bytes)| (r == rank).then_some(bytes));
                let pieces = self.sharding.step_pieces(|_| true);
                let exported =
                    self.memory
                        .export_state(&self.comm, self.optimizer.as_ref(), &pieces)?;
                let record = write_state_file(&dir.join(&name), &exported, fail)?;
                files.push((name, record));
            }
            Ok(files)
        })();
        // Every rank takes part in the model file, whatever happened above
        // (the master weights come to rank 0 piece by piece); rank 0 writes
        // it unless its own part failed already.
        let model_path = dir.join(&model_file);
        let out = if rank == 0 && local.is_ok() {
            ModelOut::File(&model_path)
        } else {
            ModelOut::Nowhere
        };
        let model = self.write_model(out, weights)?;
        let local = local.and_then(|mut files| {
            if let Some(record) = model? {
                files.push((model_file.clone(), record));
            }
            Ok(files)
        });
        let files = agree(&*self.comm, local, dir, "save_checkpoint")?;

        let mut manifest = Manifest::new();
        for (name, record) in files {
            manifest.record(name, record);
        }
        let mut info =
            self.checkpoint_info(CheckpointKind::Sharded, tag.clone(), options.user.clone());
        info.model_file = Some(model_file);
        info.shards = self.sharding.shard_records(&self.params, shard_file);
        manifest.checkpoint = Some(info);
        let written = if rank == 0 {
            manifest.save(dir).map(|_| Vec::new())
        } else {
            Ok(Vec::new())
        };
        agree(&*self.comm, written, dir, "writing the manifest")?;

        if rank == 0 {
            remove_stale_files(dir, &manifest, old.as_ref());
        }
        Ok(manifest)
    }

    /// Saves a sharded checkpoint into `dir` in the background: the files
    /// of [`Engine::save_checkpoint_with`], bitwise, but this call only
    /// takes a snapshot of what they hold into host memory and returns; a
    /// thread of this rank writes it while training goes on. A collective.
    ///
    /// The snapshot is this rank's optimizer state and, on rank 0, the
    /// model file's data (at stage 3 and with master weights the pieces are
    /// gathered to rank 0 here, as a blocking save gathers them: this call
    /// blocks for the gathers, not for the writes). Rank 0 thus holds the
    /// whole model in host memory until its write is done; a model larger
    /// than rank 0's host memory saves with [`Engine::save_checkpoint`].
    ///
    /// At most one save is in flight: this call first completes the
    /// previous one, as [`Engine::wait_checkpoint`] does, and returns it.
    /// A save completes on the main thread, never on the writer (no
    /// collective runs there): once every rank's writer is done, the ranks
    /// agree and rank 0 writes the manifest, the commit point. Complete a
    /// save sooner with [`Engine::poll_checkpoint`] at step boundaries, and
    /// the last one with [`Engine::wait_checkpoint`] before the engine is
    /// dropped (a drop lets the files finish but writes no manifest: the
    /// save is then incomplete, and loads as nothing).
    ///
    /// Errors: a failure of the previous save's writes on any rank (that
    /// save is then abandoned without a manifest, and this one is not
    /// started: call again to start it); refused inside an accumulation
    /// window. A failure of this save's writes comes back from the call
    /// that completes it.
    pub fn save_checkpoint_async(
        &mut self,
        dir: impl AsRef<Path>,
        weights: &mut M::Params<'_>,
        options: &SaveOptions,
    ) -> Result<Option<SavedCheckpoint>> {
        self.finish_gathers()?;
        self.window.refuse_mid("save_checkpoint_async")?;
        let previous = self.wait_checkpoint()?;
        let dir = dir.as_ref();
        self.with_shard_home(|engine| engine.snapshot_checkpoint(dir, weights, options))?;
        Ok(previous)
    }

    /// Completes the background save in flight if every rank's writer is
    /// done, and returns it; `None` if a writer is still busy or no save is
    /// in flight. A collective while a save is in flight (an all-reduce of
    /// one value; nothing otherwise): call it on every rank at the same
    /// point, e.g. once per step. Errors as [`Engine::wait_checkpoint`].
    pub fn poll_checkpoint(&mut self) -> Result<Option<SavedCheckpoint>> {
        if !self.background.in_flight() {
            return Ok(None);
        }
        // 1 where this rank's writer is still busy; the max over ranks.
        let mut busy = [f32::from(u8::from(!self.background.written()))];
        self.all_reduce_host(&mut busy[..], ReduceOp::Max)?;
        if busy[0] > 0.0 {
            return Ok(None);
        }
        self.complete_checkpoint()
    }

    /// Waits for the background save in flight on every rank and completes
    /// it (the manifest written, on rank 0); returns it, or `None` if none
    /// was in flight. A collective while a save is in flight.
    ///
    /// Errors, on every rank: a rank's writes failed (the error names the
    /// rank and what failed) or the manifest could not be written. The save
    /// is then abandoned: its directory has no manifest, so it is never
    /// loaded, and the directory's previous checkpoint (or a
    /// [`StepCheckpoints`](crate::checkpoint::StepCheckpoints)' `latest`)
    /// is untouched.
    pub fn wait_checkpoint(&mut self) -> Result<Option<SavedCheckpoint>> {
        if !self.background.in_flight() {
            return Ok(None);
        }
        self.complete_checkpoint()
    }

    /// Joins this rank's writer, agrees with the other ranks on the
    /// outcome, and writes the manifest on rank 0 (collectives).
    fn complete_checkpoint(&mut self) -> Result<Option<SavedCheckpoint>> {
        let Some((pending, written)) = self.background.join() else {
            return Ok(None);
        };
        let dir = pending.dir;
        let files = agree(&*self.comm, written, &dir, "the background save")?;
        let mut manifest = Manifest::new();
        for (name, record) in files {
            manifest.record(name, record);
        }
        manifest.checkpoint = Some(pending.info);
        let rank = self.comm.rank();
        let written = if rank == 0 {
            manifest.save(&dir).map(|_| Vec::new())
        } else {
            Ok(Vec::new())
        };
        agree(&*self.comm, written, &dir, "writing the manifest")?;
        if rank == 0 {
            remove_stale_files(&dir, &manifest, pending.old.as_ref());
        }
        Ok(Some(SavedCheckpoint { dir, manifest }))
    }

    /// [`Engine::save_checkpoint_async`] with the parameter shard at home:
    /// the tag, as a blocking save picks it, and the snapshot, handed to
    /// the writer. A failure to take the snapshot on one rank is that
    /// rank's outcome of the save, shared when it completes, so that the
    /// ranks' collectives stay in step.
    fn snapshot_checkpoint(
        &mut self,
        dir: &Path,
        weights: &mut M::Params<'_>,
        options: &SaveOptions,
    ) -> Result<()> {
        let rank = self.comm.rank();
        let old = if rank == 0 {
            Manifest::load(dir).ok()
        } else {
            None
        };
        let tag = agreed_tag(&*self.comm, old.as_ref(), self.steps)?;
        let shard_file = |p: usize| format!("optim.{tag}.rank{p}.safetensors");
        let model_file = format!("model.{tag}.safetensors");

        let state = (|| -> Result<Option<StateSnapshot<T>>> {
            if self.config.stage == Stage::Ddp && rank != 0 {
                return Ok(None);
            }
            let pieces = self.sharding.step_pieces(|_| true);
            let mut state = self.background.take_state();
            self.memory.export_state_into(
                &self.comm,
                self.optimizer.as_ref(),
                &pieces,
                &mut state,
            )?;
            Ok(Some(StateSnapshot {
                file: shard_file(self.sharding.rank),
                state,
                fail_after: options
                    .fail_after
                    .and_then(|(r, bytes)| (r == rank).then_some(bytes)),
            }))
        })();
        let writes = rank == 0 && state.is_ok();
        let specs = self.model_tensors().1;
        let mut values = if writes {
            let numel = specs
                .iter()
                .map(|(_, _, shape)| shape.iter().product::<usize>());
            self.background.take_model_values(numel.sum())
        } else {
            Vec::new()
        };
        let out = if writes {
            ModelOut::Memory(&mut values)
        } else {
            ModelOut::Nowhere
        };
        let model = self.write_model(out, weights)?;
        let snapshot = state.and_then(|state| {
            model?;
            Ok(Snapshot {
                dir: dir.to_path_buf(),
                state,
                model: writes.then(|| ModelSnapshot {
                    file: model_file.clone(),
                    specs,
                    values,
                }),
            })
        });

        let mut info =
            self.checkpoint_info(CheckpointKind::Sharded, tag.clone(), options.user.clone());
        info.model_file = Some(model_file);
        info.shards = self.sharding.shard_records(&self.params, shard_file);
        let pending = Pending {
            dir: dir.to_path_buf(),
            info,
            old,
        };
        self.background.start(pending, snapshot);
        Ok(())
    }

    /// Loads a sharded checkpoint saved at any world size, stage and
    /// partitioner: weights from the model file into `weights`, and this
    /// rank's optimizer state, read from just the rank files whose pieces
    /// overlap its own (each verified against its checksum). Also restores
    /// the hyperparameters of every group and the step counter. Returns the
    /// manifest ([`CheckpointInfo::user`] holds what the save stored). A
    /// collective: a failure on any rank is returned on every rank (the
    /// engine's state is then unspecified; load again).
    ///
    /// Errors ([`Error::Checkpoint`] naming the file): missing, truncated or
    /// corrupted files, an unknown format version, a checkpoint of another
    /// model (parameter names, shapes, dtypes) or optimizer.
    pub fn load_checkpoint(
        &mut self,
        dir: impl AsRef<Path>,
        weights: &mut M::Params<'_>,
    ) -> Result<Manifest> {
        self.window.refuse_mid("load_checkpoint")?;
        self.finish_gathers()?;
        self.wait_checkpoint()?;
        let dir = dir.as_ref();
        let local = self.with_shard_home(|engine| {
            let manifest = Manifest::load(dir)?;
            let groups = group_states(engine.optimizer.as_ref(), &engine.params, &engine.group_of);
            let info = checked_info(
                dir,
                &manifest,
                (&engine.params, &engine.index),
                engine.optimizer.kind(),
                &groups,
            )?;
            let owned = engine
                .sharding
                .owned
                .iter()
                .map(|p| (engine.params[p.param].name.clone(), p.param_range.clone()));
            let imported = read_owned_state(dir, &manifest, info, owned)?;
            engine.read_weights(dir, &manifest, info, weights)?;
            for (g, group) in info.param_groups.iter().enumerate() {
                engine.optimizer.set_hyperparams(g, &group.hyperparams)?;
            }
            let pieces = engine.sharding.step_pieces(|_| true);
            engine
                .memory
                .import_state(engine.optimizer.as_mut(), &pieces, imported)?;
            engine.steps = info.steps;
            Ok(manifest)
        });
        let (status, manifest) = match local {
            Ok(m) => (Ok(Vec::new()), Some(m)),
            Err(e) => (Err(e), None),
        };
        agree(&*self.comm, status, dir, "load_checkpoint")?;
        manifest.ok_or_else(|| Error::State("load_checkpoint: internal: no manifest".into()))
    }

    /// The weights from the model file: into the replica (and the masters),
    /// or, for a sharded parameter, only the owned pieces into the masters.
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
        let masters = self.shard_is_truth();
        for i in 0..self.params.len() {
            let p = &self.params[i];
            if !crate::engine::precision::engine_steps::<T>(p.dtype) {
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
            if self.is_sharded(i) {
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
        self.masters_fresh = masters;
        if let Some(state) = info.loss_scaler {
            self.set_loss_scaler_state(state);
        }
        Ok(())
    }

    /// Sends every rank's pieces to `to`, one source rank at a time, into
    /// `sink`. A sink error on `to` does not stop the collectives (the other
    /// ranks would hang); it is returned at the end.
    fn stream_pieces(
        &mut self,
        to: usize,
        op: &'static str,
        sink: &mut dyn PieceSink<T>,
    ) -> Result<()> {
        let rank = self.comm.rank();
        let world = self.comm.world_size();
        if to >= world {
            return Err(Error::InvalidRank {
                op,
                rank: to,
                world_size: world,
            });
        }
        // In stage 0 every rank holds everything: only `to` contributes.
        let contributes = self.config.stage != Stage::Ddp || rank == to;
        let mut exported = if contributes {
            let pieces = self.sharding.step_pieces(|_| true);
            self.memory
                .export_state(&self.comm, self.optimizer.as_ref(), &pieces)?
                .params
        } else {
            BTreeMap::new()
        };
        let lengths: BTreeMap<(&str, usize), usize> = self
            .sharding
            .keys
            .iter()
            .zip(&self.sharding.owned)
            .map(|(k, p)| ((k.name.as_str(), k.offset), p.len()))
            .collect();
        let metas = piece_metas(&exported, &lengths);
        let all = self.comm.all_gather_bytes(&serde_json::to_vec(&metas)?)?;
        let all: Vec<Vec<PieceMeta>> = all
            .iter()
            .map(|b| serde_json::from_slice(b))
            .collect::<std::result::Result<_, _>>()?;

        let mut failure = None;
        if rank == to {
            failure = sink.begin(&all).err();
        }
        let mut recv: Vec<T> = Vec::new();
        for (src, metas) in all.iter().enumerate() {
            let count: usize = metas.iter().map(|m| m.len * m.tensors.len()).sum();
            if count == 0 {
                continue;
            }
            let mut counts = vec![0; world];
            counts[src] = count;
            let send = if rank == src {
                pack_pieces(&mut exported, metas, count)
            } else {
                Vec::new()
            };
            if rank == to {
                recv.clear();
                recv.resize(count, T::default());
            }
            let recv_buf = if rank == to {
                Some(&mut recv[..])
            } else {
                None
            };
            self.memory
                .gather_varlen_host(&self.comm, &send[..], &counts, recv_buf, to)?;
            drop(send);
            if rank == to && failure.is_none() {
                failure = sink_pieces(sink, metas, &recv).err();
            }
        }
        failure.map_or(Ok(()), Err)
    }

    /// Writes the model file to `out` (rank 0): every parameter in the
    /// engine's element type, a trainable or sharded one from the master
    /// weights where the shard holds the truth, anything else from the
    /// replica (widened where it is narrower). It is the file
    /// `write_tensors` writes for these tensors, streamed: the masters come
    /// to rank 0 one piece at a time (`stream_masters`), and a replica
    /// tensor is read whole but one at a time, so that no rank ever holds
    /// the whole model (but for a background save's snapshot, whose point
    /// is to hold it, in host memory).
    ///
    /// A collective where the shard holds the truth (every rank calls it;
    /// the others with [`ModelOut::Nowhere`]). The outer error is a failed
    /// collective, on every rank; the inner one is the writer's failure to
    /// write the file, which the other ranks learn through `agree`. A
    /// failed write does not stop the writer from taking part in the
    /// gathers that follow, so that no rank waits forever.
    fn write_model(
        &mut self,
        out: ModelOut<'_, T>,
        weights: &mut M::Params<'_>,
    ) -> Result<Result<Option<FileRecord>>> {
        let masters = self.shard_is_truth();
        let (order, specs) = self.model_tensors();
        let mut file = ModelFile::default();
        match out {
            ModelOut::Nowhere => {}
            ModelOut::File(path) => match TensorWriter::create(path, &specs) {
                Ok(writer) => file.sink = Some(ModelSink::File(Box::new(writer))),
                Err(e) => file.failure = Some(e),
            },
            ModelOut::Memory(values) => {
                file.sink = Some(ModelSink::Memory { values, at: 0 });
            }
        }
        let mut values = Vec::new();
        for i in order {
            let numel = self.params[i].numel();
            if masters && (self.params[i].trainable || self.is_sharded(i)) {
                let mut next = 0;
                self.masters().stream(i, 0, &mut |range, values| {
                    // The plan's pieces are in order and disjoint; what it
                    // leaves out of the parameter is saved as zeros.
                    file.zeros(range.start.saturating_sub(next));
                    file.write(values);
                    next = range.end;
                })?;
                file.zeros(numel.saturating_sub(next));
            } else if let Some(into) = file.next_in_memory(numel) {
                // A snapshot: read straight into place.
                let read = self.memory.read_param_host(&self.comm, weights, i, into);
                if let Err(e) = read {
                    file.fail(e);
                }
            } else if file.sink.is_some() {
                values.clear();
                values.resize(numel, T::default());
                match self
                    .memory
                    .read_param_host(&self.comm, weights, i, &mut values)
                {
                    Ok(()) => file.write(&values),
                    Err(e) => file.fail(e),
                }
            }
        }
        Ok(file.finish())
    }

    /// The model file's parameters and their tensors (name, dtype, shape),
    /// in the file's order, the same on every rank. A frozen parameter of
    /// a dtype the engine does not step is not the engine's to save (nor
    /// to load).
    #[allow(clippy::type_complexity)]
    fn model_tensors(&self) -> (Vec<usize>, Vec<(String, DType, Vec<usize>)>) {
        let mut order: Vec<usize> = (0..self.params.len())
            .filter(|&i| crate::engine::precision::engine_steps::<T>(self.params[i].dtype))
            .collect();
        order.sort_by(|&l, &r| {
            file_order(
                (self.params[l].name.as_str(), T::DTYPE),
                (self.params[r].name.as_str(), T::DTYPE),
            )
        });
        let specs = order
            .iter()
            .map(|&i| {
                (
                    self.params[i].name.clone(),
                    T::DTYPE,
                    self.params[i].shape.clone(),
                )
            })
            .collect();
        (order, specs)
    }

    fn checkpoint_info(
        &self,
        kind: CheckpointKind,
        tag: String,
        user: serde_json::Value,
    ) -> CheckpointInfo {
        CheckpointInfo {
            kind,
            tag,
            world_size: self.comm.world_size(),
            stage: self.config.stage.number(),
            partition: self.sharding.partition.kind,
            params: self.params.clone(),
            optimizer: self.optimizer.kind().to_string(),
            param_groups: group_states(self.optimizer.as_ref(), &self.params, &self.group_of),
            steps: self.steps,
            loss_scaler: self.loss_scaler_state(),
            model_file: None,
            shards: Vec::new(),
            user,
        }
    }
}

/// Where rank 0's model file goes (`Engine::write_model`).
enum ModelOut<'a, T> {
    /// Nowhere: this rank only takes part in the gathers.
    Nowhere,
    /// Straight into the file at this path (a blocking save).
    File(&'a Path),
    /// Into host memory as long as the file's data (a background save's
    /// snapshot).
    Memory(&'a mut [T]),
}
