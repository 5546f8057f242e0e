//! What a save reads of the engine, borrowed for one save ([`Save`]), and
//! the writing that every save shares: the tag, this rank's optimizer
//! state, the model file (streamed to a file, or into a background save's
//! snapshot), the manifest's record, and the consolidated state streamed
//! to one rank.

use crate::checkpoint::{
    checkpoint_error, consolidated_file_name, file_order, CheckpointInfo, CheckpointKind,
    FileRecord, LossScalerState, Manifest, StateDict, TensorWriter,
};
use crate::comm::Communicator;
use crate::engine::params::ParamTable;
use crate::engine::precision::{engine_steps, Masters};
use crate::engine::scaler::LossScaler;
use crate::engine::sharding::Sharding;
use crate::engine::state::{
    agree, agreed_tag, check_coverage, fresh_tag, group_states, numel_by_name, pack_pieces,
    piece_metas, remove_stale_files, sink_pieces, write_state_file, BackgroundSave, FileSink,
    Files, MemorySink, ModelFile, ModelSink, ModelSnapshot, Pending, PieceMeta, PieceSink,
    SaveOptions, Snapshot, StateSnapshot,
};
use crate::engine::{Engine, ShardMemory, Stage};
use crate::optim::FunctionalOptimizer;
use crate::{DType, Element, Error, Result};
use std::collections::BTreeMap;
use std::path::Path;

/// The engine's parts a save reads, borrowed for one save: the optimizer
/// and its state's pieces (the partition, the memory), the weights (the
/// replica through the memory, the master weights in the parameter shard),
/// and what the manifest records. The memory and the shard are borrowed
/// mutably only to run collectives and reads through them: a save changes
/// nothing the training depends on.
pub(super) struct Save<'e, T: Element, C: Communicator, M: ShardMemory<T, C>> {
    comm: &'e C,
    memory: &'e mut M,
    optimizer: &'e dyn FunctionalOptimizer<T>,
    params: &'e ParamTable,
    sharding: &'e Sharding,
    /// The parameter shard: the master weights where it holds the truth.
    param_shard: &'e mut M::Buffer,
    stage: Stage,
    steps: u64,
    loss_scaler: Option<LossScalerState>,
    /// Stage 3: per parameter, whether it lives only as shards (empty at
    /// other stages).
    sharded: &'e [bool],
    /// Whether the shard, not the replica, holds the truth of the trained
    /// weights (`Truth::in_shard`).
    truth: bool,
}

/// A sharded save's tag, the same on every rank, and the directory's
/// checkpoint before it (rank 0), whose files go once the save commits.
struct Tag {
    tag: String,
    old: Option<Manifest>,
}

impl Tag {
    /// Rank `rank`'s optimizer file.
    fn shard_file(&self, rank: usize) -> String {
        format!("optim.{}.rank{rank}.safetensors", self.tag)
    }

    /// Rank 0's model file.
    fn model_file(&self) -> String {
        format!("model.{}.safetensors", self.tag)
    }
}

/// Where rank 0's model file goes ([`Save::write_model`]).
enum ModelOut<'a, T> {
    /// Nowhere: this rank only takes part in the gathers.
    Nowhere,
    /// Straight into the file at this path (a blocking save).
    File(&'a Path),
    /// Into host memory as long as the file's data (a background save's
    /// snapshot).
    Memory(&'a mut [T]),
}

impl<'e, T: Element, C: Communicator, M: ShardMemory<T, C>> Save<'e, T, C, M> {
    /// The parts of `engine` a save reads.
    pub fn of(engine: &'e mut Engine<T, C, M>) -> Result<Self> {
        Ok(Self::with_background(engine)?.0)
    }

    /// [`Save::of`], and beside it the engine's background save, whose
    /// buffers take the snapshot and whose writer writes it.
    pub fn with_background(
        engine: &'e mut Engine<T, C, M>,
    ) -> Result<(Self, &'e mut BackgroundSave<T>)> {
        let truth = engine.truth.in_shard();
        let loss_scaler = engine.scaler.as_ref().map(LossScaler::state);
        let sharded = engine.stage.sharded_mask();
        let save = Self {
            comm: &engine.comm,
            memory: &mut engine.memory,
            optimizer: engine.optimizer.home()?,
            params: &engine.params,
            sharding: &engine.sharding,
            param_shard: engine.buffers.param_shard.here_mut()?,
            stage: engine.config.stage,
            steps: engine.steps,
            loss_scaler,
            sharded,
            truth,
        };
        Ok((save, &mut engine.background))
    }

    /// Writes a sharded checkpoint into `dir` and commits it
    /// ([`Engine::save_checkpoint`]); the parameter shard is at home.
    pub fn write_sharded(
        mut self,
        dir: &Path,
        weights: &mut M::Params<'_>,
        options: &SaveOptions,
    ) -> Result<Manifest> {
        let rank = self.comm.rank();
        let tag = self.agree_tag(dir)?;
        let local = (|| -> Result<Files> {
            std::fs::create_dir_all(dir).map_err(|e| Error::Io {
                path: dir.to_path_buf(),
                source: e,
            })?;
            let mut files = Vec::new();
            if self.writes_shard() {
                let name = tag.shard_file(self.sharding.rank);
                let pieces = self.sharding.step_pieces(|_| true);
                let exported = self
                    .memory
                    .export_state(self.comm, self.optimizer, &pieces)?;
                let fail = options.fails_after(rank);
                let record = write_state_file(&dir.join(&name), &exported, fail)?;
                files.push((name, record));
            }
            Ok(files)
        })();
        // Every rank takes part in the model file, whatever happened above
        // (the master weights come to rank 0 piece by piece); rank 0 writes
        // it unless its own part failed already.
        let model_file = tag.model_file();
        let model_path = dir.join(&model_file);
        let out = if rank == 0 && local.is_ok() {
            ModelOut::File(&model_path)
        } else {
            ModelOut::Nowhere
        };
        let model = self.write_model(out, weights)?;
        let local = local.and_then(|mut files| {
            if let Some(record) = model? {
                files.push((model_file, record));
            }
            Ok(files)
        });
        let pending = self.pending(dir, tag, options);
        pending.commit(self.comm, local, "save_checkpoint")
    }

    /// Takes a background save's snapshot into host memory and hands it to
    /// `background`'s writer ([`Engine::save_checkpoint_async`]); the
    /// parameter shard is at home. The tag is picked as a blocking save
    /// picks it. A failure to take the snapshot on one rank is that rank's
    /// outcome of the save, shared when it completes, so that the ranks'
    /// collectives stay in step.
    pub fn start_snapshot(
        mut self,
        dir: &Path,
        weights: &mut M::Params<'_>,
        options: &SaveOptions,
        background: &mut BackgroundSave<T>,
    ) -> Result<()> {
        let tag = self.agree_tag(dir)?;
        let state = self.snapshot_state(&tag, options, background);
        let writes = self.comm.rank() == 0 && state.is_ok();
        let specs = self.model_tensors().1;
        let mut values = if writes {
            let numel = specs
                .iter()
                .map(|(_, _, shape)| shape.iter().product::<usize>());
            background.take_model_values(numel.sum())
        } else {
            Vec::new()
        };
        let out = if writes {
            ModelOut::Memory(&mut values)
        } else {
            ModelOut::Nowhere
        };
        let model = self.write_model(out, weights)?;
        let model_file = tag.model_file();
        let snapshot = state.and_then(|state| {
            model?;
            Ok(Snapshot {
                dir: dir.to_path_buf(),
                state,
                model: writes.then_some(ModelSnapshot {
                    file: model_file,
                    specs,
                    values,
                }),
            })
        });
        background.start(self.pending(dir, tag, options), snapshot);
        Ok(())
    }

    /// Gathers the full optimizer state on rank `to`
    /// ([`Engine::consolidate_state_dict`]): `Some` there, `None` on the
    /// other ranks.
    pub fn consolidate(mut self, to: usize) -> Result<Option<StateDict<T>>> {
        let numel = numel_by_name(self.params);
        let mut sink = MemorySink {
            numel: &numel,
            state: BTreeMap::new(),
            covered: BTreeMap::new(),
        };
        self.stream_pieces(to, "consolidate_state_dict", &mut sink)?;
        if self.comm.rank() != to {
            return Ok(None);
        }
        check_coverage(&numel, &sink.covered)?;
        Ok(Some(StateDict {
            optimizer: self.optimizer.kind().to_string(),
            state: sink.state,
            param_groups: group_states(self.optimizer, self.params),
            steps: self.steps,
        }))
    }

    /// Writes the full optimizer state into `dir` on rank `to`, streamed
    /// shard by shard, and its manifest ([`Engine::save_consolidated`]).
    pub fn write_consolidated(mut self, dir: &Path, to: usize) -> Result<()> {
        // Only `to` writes, so only `to` needs the name.
        let old = if self.comm.rank() == to {
            Manifest::load(dir).ok()
        } else {
            None
        };
        let tag = fresh_tag(old.as_ref(), self.steps);
        let file_name = consolidated_file_name(&tag);
        let path = dir.join(&file_name);
        let numel = numel_by_name(self.params);
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
            manifest.checkpoint = Some(self.info(
                CheckpointKind::Consolidated,
                tag.clone(),
                serde_json::Value::Null,
            ));
            manifest.save(dir)?;
            remove_stale_files(dir, &manifest, old.as_ref());
            Ok(Vec::new())
        });
        agree(self.comm, local, dir, "save_consolidated").map(|_| ())
    }

    /// Rank 0 picks a tag unused by the directory's current checkpoint;
    /// every rank gets it (a collective).
    fn agree_tag(&self, dir: &Path) -> Result<Tag> {
        let old = if self.comm.rank() == 0 {
            Manifest::load(dir).ok()
        } else {
            None
        };
        let tag = agreed_tag(self.comm, old.as_ref(), self.steps)?;
        Ok(Tag { tag, old })
    }

    /// Whether this rank writes an optimizer file: in stage 0 every rank
    /// holds everything, and rank 0 alone writes it.
    fn writes_shard(&self) -> bool {
        self.stage != Stage::Ddp || self.comm.rank() == 0
    }

    /// This rank's optimizer state, exported into `background`'s buffers
    /// (`None` where the rank writes no optimizer file).
    fn snapshot_state(
        &mut self,
        tag: &Tag,
        options: &SaveOptions,
        background: &mut BackgroundSave<T>,
    ) -> Result<Option<StateSnapshot<T>>> {
        if !self.writes_shard() {
            return Ok(None);
        }
        let pieces = self.sharding.step_pieces(|_| true);
        let mut state = background.take_state();
        self.memory
            .export_state_into(self.comm, self.optimizer, &pieces, &mut state)?;
        Ok(Some(StateSnapshot {
            file: tag.shard_file(self.sharding.rank),
            state,
            fail_after: options.fails_after(self.comm.rank()),
        }))
    }

    /// The sharded save under `tag`, waiting for every rank's files to
    /// commit: its manifest section names the model file and every rank's
    /// optimizer file.
    fn pending(&self, dir: &Path, tag: Tag, options: &SaveOptions) -> Pending {
        let mut info = self.info(
            CheckpointKind::Sharded,
            tag.tag.clone(),
            options.user.clone(),
        );
        info.model_file = Some(tag.model_file());
        info.shards = self
            .sharding
            .shard_records(self.params, |p| tag.shard_file(p));
        Pending {
            dir: dir.to_path_buf(),
            info,
            old: tag.old,
        }
    }

    /// The manifest's checkpoint section, without files.
    fn info(&self, kind: CheckpointKind, tag: String, user: serde_json::Value) -> CheckpointInfo {
        CheckpointInfo {
            kind,
            tag,
            world_size: self.comm.world_size(),
            stage: self.stage.number(),
            partition: self.sharding.partition.kind,
            params: self.params.to_vec(),
            optimizer: self.optimizer.kind().to_string(),
            param_groups: group_states(self.optimizer, self.params),
            steps: self.steps,
            loss_scaler: self.loss_scaler,
            model_file: None,
            shards: Vec::new(),
            user,
        }
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
        let contributes = self.stage != Stage::Ddp || rank == to;
        let mut exported = if contributes {
            let pieces = self.sharding.step_pieces(|_| true);
            self.memory
                .export_state(self.comm, self.optimizer, &pieces)?
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
                .gather_varlen_host(self.comm, &send[..], &counts, recv_buf, to)?;
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
    /// to rank 0 one piece at a time (`Masters::stream`), and a replica
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
            let masters =
                self.truth && (self.params[i].trainable || self.sharded.get(i) == Some(&true));
            if masters {
                if let Some(into) = file.next_in_memory(numel) {
                    // A snapshot: gathered straight into place.
                    self.masters().gather(i, 0, into)?;
                    continue;
                }
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
                let read = self.memory.read_param_host(self.comm, weights, i, into);
                if let Err(e) = read {
                    file.fail(e);
                }
            } else if file.sink.is_some() {
                values.clear();
                values.resize(numel, T::default());
                match self
                    .memory
                    .read_param_host(self.comm, weights, i, &mut values)
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
        let params = self.params;
        let mut order: Vec<usize> = (0..params.len())
            .filter(|&i| engine_steps::<T>(params[i].dtype))
            .collect();
        order.sort_by(|&l, &r| {
            file_order(
                (params[l].name.as_str(), T::DTYPE),
                (params[r].name.as_str(), T::DTYPE),
            )
        });
        let specs = order
            .iter()
            .map(|&i| (params[i].name.clone(), T::DTYPE, params[i].shape.clone()))
            .collect();
        (order, specs)
    }

    /// The master weights, to stream to rank 0.
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
