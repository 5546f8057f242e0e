//! Checkpoints from the engine's side: consolidating the sharded optimizer
//! state into a [`StateDict`], loading one, and sharded save and load at any
//! world size, stage and partitioner.
//!
//! Every function here is a collective unless it says otherwise. Failures
//! on one rank are shared with the others through one small
//! `all_gather_bytes` of a status, so a rank that fails to write a file
//! makes every rank return an error naming it instead of leaving them
//! waiting.

mod pieces;

use crate::checkpoint::{FileRecord, GroupState, Manifest, MANIFEST_FILE};
use crate::comm::Communicator;
use crate::partition::ParamInfo;
use crate::{Error, Result};
pub(super) use pieces::{
    check_coverage, pack_pieces, piece_metas, sink_pieces, Assembly, FileSink, MemorySink,
    ModelFile, PieceMeta, PieceSink, RankStatus,
};
use std::collections::BTreeMap;
use std::path::Path;

/// Options of [`Engine::save_checkpoint_with`].
#[derive(Clone, Debug, Default)]
pub struct SaveOptions {
    /// Stored in the manifest ([`CheckpointInfo::user`]) and given back by
    /// [`Engine::load_checkpoint`]: data position, learning rate, ...
    pub user: serde_json::Value,
    /// Fault injection for tests: `(rank, bytes)` makes that rank's
    /// optimizer file write fail after `bytes` bytes.
    #[doc(hidden)]
    pub fail_after: Option<(usize, usize)>,
}

/// Shares every rank's outcome; returns the files all ranks wrote, or
/// this rank's error, or an error naming the first rank that failed.
pub(super) fn agree<C: Communicator>(
    comm: &C,
    local: Result<Vec<(String, FileRecord)>>,
    dir: &Path,
    what: &str,
) -> Result<Vec<(String, FileRecord)>> {
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

/// The first difference between the `saved` parameters and the model's
/// (`params`, found by name in `index`).
pub(super) fn check_same_model(
    params: &[ParamInfo],
    index: &BTreeMap<String, usize>,
    saved: &[ParamInfo],
) -> std::result::Result<(), String> {
    let by_name: BTreeMap<&str, &ParamInfo> = saved.iter().map(|p| (p.name.as_str(), p)).collect();
    for p in params {
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
    if let Some(extra) = saved.iter().find(|s| !index.contains_key(&s.name)) {
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
