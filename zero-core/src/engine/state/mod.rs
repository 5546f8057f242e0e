//! What the engine's checkpoints (`ops/checkpoint/`) are made of: the
//! optimizer state's pieces in transit, the files of one rank's state, the
//! checks of a saved checkpoint against the engine, the agreement of every
//! rank on the outcome (`agree`) and a sharded save's commit
//! (`Pending::commit`: the manifest, written once every rank's files are),
//! the only collectives here; background saves' snapshots and writer
//! (`background.rs`).

mod background;
mod pieces;

use crate::checkpoint::{
    checkpoint_error, piece_name, write_atomic, write_tensors, CheckpointInfo, CheckpointKind,
    FailAfter, FileRecord, GroupState, Manifest, TensorBytes, MANIFEST_FILE,
};
use crate::comm::Communicator;
use crate::engine::params::ParamTable;
use crate::optim::{FunctionalOptimizer, OptimizerState};
use crate::partition::ParamInfo;
use crate::{DType, Element, Error, Result};
pub use background::SavedCheckpoint;
pub(super) use background::{BackgroundSave, ModelSnapshot, Snapshot, StateSnapshot};
pub(super) use pieces::{
    check_coverage, pack_pieces, piece_metas, sink_pieces, Assembly, FileSink, MemorySink,
    ModelFile, ModelSink, PieceMeta, PieceSink, RankStatus,
};
use std::collections::BTreeMap;
use std::ops::Range;
use std::path::{Path, PathBuf};

/// The files a rank wrote: name and record.
pub(super) type Files = Vec<(String, FileRecord)>;

/// Options of [`Engine::save_checkpoint`](crate::Engine::save_checkpoint).
#[derive(Clone, Debug, Default)]
pub struct SaveOptions {
    /// Stored in the manifest ([`CheckpointInfo::user`]) and given back by
    /// [`Engine::load_checkpoint`](crate::Engine::load_checkpoint): data
    /// position, learning rate, ...
    pub user: serde_json::Value,
    /// Fault injection for tests: `(rank, bytes)` makes that rank's
    /// optimizer file write fail after `bytes` bytes.
    #[doc(hidden)]
    pub fail_after: Option<(usize, usize)>,
}

impl SaveOptions {
    /// The bytes after which `rank`'s optimizer file write is to fail
    /// (tests' fault injection), if it is that rank.
    pub(in crate::engine) fn fails_after(&self, rank: usize) -> Option<usize> {
        self.fail_after
            .and_then(|(r, bytes)| (r == rank).then_some(bytes))
    }
}

/// Shares every rank's outcome; returns the files all ranks wrote, or
/// this rank's error, or an error naming the first rank that failed.
pub(super) fn agree<C: Communicator>(
    comm: &C,
    local: Result<Files>,
    dir: &Path,
    what: &str,
) -> Result<Files> {
    let status = match &local {
        Ok(files) => RankStatus {
            error: None,
            files: files.clone(),
        },
        Err(e) => RankStatus {
            error: Some(e.to_string()),
            files: Vec::new(),
        },
    };
    let all = comm.all_gather_bytes(&serde_json::to_vec(&status)?)?;
    let mut files = Vec::new();
    let mut failed = None;
    for (r, bytes) in all.iter().enumerate() {
        let status: RankStatus = serde_json::from_slice(bytes)?;
        if let (Some(msg), None) = (status.error, &failed) {
            failed = Some((r, msg));
        }
        files.extend(status.files);
    }
    match (local, failed) {
        (Err(e), _) => Err(e),
        (Ok(_), Some((r, msg))) => Err(Error::Checkpoint {
            path: dir.to_path_buf(),
            detail: format!("{what} failed on rank {r}: {msg}"),
        }),
        (Ok(_), None) => Ok(files),
    }
}

/// A sharded save waiting for every rank's files, to commit it: the
/// manifest is written last, on rank 0, once every rank reports success.
pub(super) struct Pending {
    pub dir: PathBuf,
    /// The manifest's checkpoint section, fixed when the save starts.
    pub info: CheckpointInfo,
    /// Rank 0: the directory's checkpoint before this save, whose files go
    /// once this one is complete.
    pub old: Option<Manifest>,
}

impl Pending {
    /// Agrees on every rank's outcome (`written`: this rank's files, or its
    /// error; `what` names the step that wrote them), writes the manifest
    /// on rank 0, agrees on that, and removes the files of older
    /// checkpoints. Collectives: every rank calls it.
    pub fn commit<C: Communicator>(
        self,
        comm: &C,
        written: Result<Files>,
        what: &str,
    ) -> Result<Manifest> {
        let dir = &self.dir;
        let files = agree(comm, written, dir, what)?;
        let mut manifest = Manifest::new();
        for (name, record) in files {
            manifest.record(name, record);
        }
        manifest.checkpoint = Some(self.info);
        let rank = comm.rank();
        let written = if rank == 0 {
            manifest.save(dir).map(|_| Vec::new())
        } else {
            Ok(Vec::new())
        };
        agree(comm, written, dir, "writing the manifest")?;
        if rank == 0 {
            remove_stale_files(dir, &manifest, self.old.as_ref());
        }
        Ok(manifest)
    }
}

/// The first difference between the `saved` parameters and the model's
/// (`params`).
pub(super) fn check_same_model(
    params: &ParamTable,
    saved: &[ParamInfo],
) -> std::result::Result<(), String> {
    let by_name: BTreeMap<&str, &ParamInfo> = saved.iter().map(|p| (p.name.as_str(), p)).collect();
    for p in params.iter() {
        let Some(s) = by_name.get(p.name.as_str()) else {
            return Err(format!(
                "has no parameter {:?}; is it a checkpoint of another model?",
                p.name
            ));
        };
        // Another dtype is another precision of the same model: allowed.
        if s.shape != p.shape {
            return Err(format!(
                "parameter {:?} is {} {:?} in the checkpoint but {} {:?} in the model; \
                 is it a checkpoint of another model?",
                p.name, s.dtype, s.shape, p.dtype, p.shape
            ));
        }
    }
    if let Some(extra) = saved.iter().find(|s| params.index(&s.name).is_none()) {
        return Err(format!(
            "parameter {:?} of the checkpoint is not in the model; \
             is it a checkpoint of another model?",
            extra.name
        ));
    }
    Ok(())
}

/// The first difference between `saved` groups and the optimizer's
/// (`ours`).
pub(super) fn check_groups(
    ours: &[GroupState],
    saved: &[GroupState],
) -> std::result::Result<(), String> {
    if saved.len() != ours.len() {
        return Err(format!(
            "it has {} parameter group(s), the optimizer {}; build the optimizer with the \
             same parameter groups",
            saved.len(),
            ours.len()
        ));
    }
    for (g, (s, o)) in saved.iter().zip(ours).enumerate() {
        let mut names = s.params.clone();
        names.sort();
        if names != o.params {
            let differ = names
                .iter()
                .find(|n| !o.params.contains(n))
                .or_else(|| o.params.iter().find(|n| !names.contains(n)))
                .cloned()
                .unwrap_or_default();
            return Err(format!(
                "parameter group {g} differs from the optimizer's (first difference: {differ:?}); \
                 build the optimizer with the same parameter groups"
            ));
        }
    }
    Ok(())
}

/// Each parameter's number of elements, by name.
pub(super) fn numel_by_name(params: &[ParamInfo]) -> BTreeMap<String, usize> {
    params.iter().map(|p| (p.name.clone(), p.numel())).collect()
}

/// Rank 0's fresh tag for a save at `steps` (one the directory's current
/// checkpoint `old` does not use), on every rank.
pub(super) fn agreed_tag<C: Communicator>(
    comm: &C,
    old: Option<&Manifest>,
    steps: u64,
) -> Result<String> {
    let tag = fresh_tag(old, steps);
    let tags = comm.all_gather_bytes(tag.as_bytes())?;
    Ok(tags
        .first()
        .map(|t| String::from_utf8_lossy(t).into_owned())
        .unwrap_or(tag))
}

/// `step<steps>`, suffixed (`.1`, `.2`, ...) while the directory's current
/// checkpoint `old` uses it: a new save never writes a file the current
/// manifest points to.
pub(super) fn fresh_tag(old: Option<&Manifest>, steps: u64) -> String {
    let old_tag = old
        .and_then(|m| m.checkpoint.as_ref())
        .map(|c| c.tag.as_str());
    let mut tag = format!("step{steps}");
    let mut k = 0;
    while old_tag == Some(tag.as_str()) {
        k += 1;
        tag = format!("step{steps}.{k}");
    }
    tag
}

/// Removes the data files of older checkpoints (those of `old` and any
/// `model.step*` / `optim.step*` / `optimizer.step*` left by failed saves)
/// that `current` does not use. Best effort: a file left behind wastes space, nothing more.
pub(super) fn remove_stale_files(dir: &Path, current: &Manifest, old: Option<&Manifest>) {
    let keep = |name: &str| current.files.contains_key(name) || name == MANIFEST_FILE;
    if let Some(old) = old {
        for name in old.files.keys().filter(|n| !keep(n)) {
            if !name.contains('/') && !name.contains('\\') && !name.starts_with('.') {
                let _ = std::fs::remove_file(dir.join(name));
            }
        }
    }
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let ours = (name.starts_with("model.step")
            || name.starts_with("optim.step")
            || name.starts_with("optimizer.step"))
            && name.ends_with(".safetensors");
        if ours && !keep(&name) {
            let _ = std::fs::remove_file(entry.path());
        }
    }
}

/// The manifest's checkpoint section, if it was saved from this model
/// (`params`, by name in `index`), this `optimizer` kind and its `groups`.
pub(super) fn checked_info<'m>(
    dir: &Path,
    manifest: &'m Manifest,
    params: &ParamTable,
    optimizer: &str,
    groups: &[GroupState],
) -> Result<&'m CheckpointInfo> {
    let manifest_path = dir.join(MANIFEST_FILE);
    let info = manifest.checkpoint.as_ref().ok_or_else(|| {
        checkpoint_error(
            &manifest_path,
            "describes no engine checkpoint (no \"checkpoint\" section)",
        )
    })?;
    if info.kind != CheckpointKind::Sharded {
        return Err(checkpoint_error(
            &manifest_path,
            "holds a consolidated optimizer state without weights; \
             load it with StateDict::load and Engine::load_state_dict",
        ));
    }
    check_same_model(params, &info.params)
        .map_err(|detail| checkpoint_error(&manifest_path, detail))?;
    if info.optimizer != optimizer {
        return Err(checkpoint_error(
            &manifest_path,
            format!(
                "was saved with a {:?} optimizer, this engine uses {:?}",
                info.optimizer, optimizer
            ),
        ));
    }
    check_groups(groups, &info.param_groups)
        .map_err(|detail| checkpoint_error(&manifest_path, detail))?;
    Ok(info)
}

/// This rank's optimizer state (its `owned` pieces: parameter name and
/// range), assembled from whichever rank files hold them (saved at any
/// world size), read range by range.
pub(super) fn read_owned_state<T: Element>(
    dir: &Path,
    manifest: &Manifest,
    info: &CheckpointInfo,
    owned: impl Iterator<Item = (String, Range<usize>)>,
) -> Result<OptimizerState<T>> {
    let manifest_path = dir.join(MANIFEST_FILE);
    // This rank's pieces, and the state assembled for each.
    let mut mine: Vec<Assembly<T>> = owned
        .map(|(name, range)| Assembly::new(name, range))
        .collect();
    for shard in &info.shards {
        let needed = shard
            .pieces
            .iter()
            .any(|s| mine.iter().any(|a| a.overlap(s).is_some()));
        if !needed {
            continue;
        }
        let tensors = manifest.map_file(dir, &shard.file)?;
        for saved in &shard.pieces {
            let prefix = format!("state.{}.{}.", saved.name, saved.offset);
            for piece in mine.iter_mut().filter(|a| a.overlap(saved).is_some()) {
                for (tensor_name, t) in tensors.with_prefix(&prefix) {
                    let Some(state) = tensor_name.strip_prefix(&prefix) else {
                        break;
                    };
                    if !state.contains('.') {
                        piece.take(tensors.path(), saved, (tensor_name, state), &t)?;
                    }
                }
            }
        }
    }
    let mut imported = OptimizerState::default();
    for piece in mine {
        if let Some((key, state)) = piece.finish(&manifest_path)? {
            imported.params.insert(key, state);
        }
    }
    Ok(imported)
}

/// Writes a rank's `exported` optimizer state (tensors
/// `state.<param>.<offset>.<state>`, scalars as f64 tensors of shape `[]`)
/// to `path`, atomically; `fail_after` injects a failure after that many
/// bytes (tests).
pub(super) fn write_state_file<T: Element>(
    path: &Path,
    exported: &OptimizerState<T>,
    fail_after: Option<usize>,
) -> Result<FileRecord> {
    let mut scalars: Vec<(String, f64)> = Vec::new();
    let mut tensors: Vec<(String, TensorBytes<'_>)> = Vec::new();
    for ((name, offset), state) in &exported.params {
        for (s, v) in &state.scalars {
            scalars.push((piece_name(name, *offset, s), *v));
        }
        for (t, values) in &state.tensors {
            tensors.push((
                piece_name(name, *offset, t),
                TensorBytes {
                    dtype: T::DTYPE,
                    shape: vec![values.len()],
                    data: bytemuck::cast_slice(values),
                },
            ));
        }
    }
    for (name, value) in &scalars {
        tensors.push((
            name.clone(),
            TensorBytes {
                dtype: DType::F64,
                shape: Vec::new(),
                data: bytemuck::bytes_of(value),
            },
        ));
    }
    write_atomic(path, |w| {
        let result = match fail_after {
            Some(bytes) => write_tensors(path, &mut FailAfter::new(w, bytes), &tensors),
            None => write_tensors(path, w, &tensors),
        };
        result.map_err(std::io::Error::other)
    })
}

/// The optimizer's groups as a checkpoint records them: each group's
/// hyperparameters and its parameters' names.
pub(super) fn group_states<T: Element>(
    optimizer: &dyn FunctionalOptimizer<T>,
    params: &ParamTable,
) -> Vec<GroupState> {
    (0..optimizer.num_groups())
        .map(|g| {
            let mut params: Vec<String> = params
                .iter()
                .zip(params.groups())
                .filter(|(_, &group)| group == g)
                .map(|(p, _)| p.name.clone())
                .collect();
            params.sort();
            GroupState {
                hyperparams: optimizer.hyperparams(g),
                params,
            }
        })
        .collect()
}
