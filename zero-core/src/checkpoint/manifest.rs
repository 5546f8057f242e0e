//! The manifest that indexes a checkpoint directory: its files with their
//! checksums, what the checkpoint holds, and how it was saved.

use super::files::*;
use super::tensors::MappedTensors;
use crate::optim::Hyperparams;
use crate::partition::{ParamInfo, PartitionKind};
use crate::Result;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::fs;
use std::io;
use std::path::{Component, Path, PathBuf};

/// The checkpoint format this build writes and the newest it reads.
pub const FORMAT_VERSION: u32 = 1;

/// The manifest's file name inside a checkpoint directory.
pub const MANIFEST_FILE: &str = "manifest.json";

/// The index of a checkpoint directory, stored as [`MANIFEST_FILE`].
///
/// The manifest is the commit point of a save: write every data file first
/// (recording each [`FileRecord`] in [`files`](Manifest::files)), then the
/// manifest, atomically. A directory whose manifest loads is complete.
///
/// To extend it, add public fields with `#[serde(default)]` so older
/// manifests still load, and raise [`FORMAT_VERSION`] only for changes an
/// older build must refuse. Fields this build does not know are kept in
/// [`extra`](Manifest::extra) and written back unchanged.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    /// The format version; [`Manifest::load`] refuses versions newer than
    /// [`FORMAT_VERSION`].
    pub format_version: u32,
    /// Every data file of the checkpoint, by path relative to the
    /// directory, with its checksum and length.
    #[serde(default)]
    pub files: BTreeMap<String, FileRecord>,
    /// What the checkpoint holds and how it was saved (written by the
    /// engine's saves; `None` for a bare manifest).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub checkpoint: Option<CheckpointInfo>,
    /// Fields this build does not know, kept as they were.
    #[serde(flatten)]
    pub extra: BTreeMap<String, serde_json::Value>,
}

impl Default for Manifest {
    fn default() -> Self {
        Self::new()
    }
}

/// Just the version, read before the rest so that a newer format fails on
/// its version rather than on a field this build does not understand.
#[derive(Deserialize)]
struct VersionOnly {
    format_version: u32,
}

impl Manifest {
    /// An empty manifest at [`FORMAT_VERSION`].
    pub fn new() -> Self {
        Self {
            format_version: FORMAT_VERSION,
            files: BTreeMap::new(),
            checkpoint: None,
            extra: BTreeMap::new(),
        }
    }

    /// Loads `dir/manifest.json`, refusing unknown format versions.
    pub fn load(dir: impl AsRef<Path>) -> Result<Self> {
        let path = dir.as_ref().join(MANIFEST_FILE);
        let bytes =
            match fs::read(&path) {
                Ok(b) => b,
                Err(e) if e.kind() == io::ErrorKind::NotFound => return Err(checkpoint_error(
                    &path,
                    "no manifest; is this a zero-rs checkpoint directory, and did the save finish?",
                )),
                Err(e) => return Err(io_error(&path, e)),
            };
        let version: VersionOnly = serde_json::from_slice(&bytes).map_err(|e| {
            checkpoint_error(
                &path,
                format!("not a valid manifest (no format_version?): {e}"),
            )
        })?;
        match version.format_version {
            0 => {
                return Err(checkpoint_error(
                    &path,
                    "format version 0 is not a valid version; the manifest is corrupted",
                ))
            }
            v if v > FORMAT_VERSION => {
                return Err(checkpoint_error(
                    &path,
                    format!(
                        "format version {v} is newer than this build supports ({FORMAT_VERSION}); upgrade zero-rs"
                    ),
                ))
            }
            _ => {}
        }
        serde_json::from_slice(&bytes)
            .map_err(|e| checkpoint_error(&path, format!("not a valid manifest: {e}")))
    }

    /// Writes `dir/manifest.json` atomically. Call it last in a save, once
    /// every data file is in place and nothing else writes into `dir`.
    ///
    /// It first removes the temporary files (`.<name>.tmp.<pid>.<n>`) that
    /// processes killed in the middle of an earlier save left in `dir`.
    pub fn save(&self, dir: impl AsRef<Path>) -> Result<FileRecord> {
        let dir = dir.as_ref();
        // Every writer of this save has finished (the engine's ranks wait
        // for the commit), so any temporary file here belongs to a write
        // that will never finish. Removing them before the commit rather
        // than after means a process killed just after the commit has none
        // left to leak; one killed during the removal has not committed, and
        // the save that redoes its step removes the rest.
        remove_interrupted_writes(dir);
        let path = dir.join(MANIFEST_FILE);
        write_atomic(&path, |w| {
            serde_json::to_writer_pretty(&mut *w, self)?;
            w.write_all(b"\n")
        })
    }

    /// Records a data file written into the checkpoint.
    pub fn record(&mut self, name: impl Into<String>, record: FileRecord) {
        self.files.insert(name.into(), record);
    }

    /// Reads the data file `name` of the checkpoint in `dir`, verified
    /// against its record. For files too large to hold, use
    /// [`map_file`](Manifest::map_file).
    ///
    /// Fails if the manifest does not list `name`, if `name` is not a plain
    /// relative path inside the directory, or as [`read_verified`] does.
    pub fn read_file(&self, dir: impl AsRef<Path>, name: &str) -> Result<Vec<u8>> {
        let (path, record) = self.file_path(dir.as_ref(), name)?;
        read_verified(path, &record.sha256, record.len)
    }

    /// Maps the safetensors data file `name` of the checkpoint in `dir`
    /// (see [`MappedTensors`]) once its length and SHA-256 match its record,
    /// checked by streaming through the mapping: the file is never copied
    /// into memory.
    ///
    /// Fails as [`read_file`](Manifest::read_file) does, or if the file is
    /// not a safetensors file of supported dtypes.
    pub fn map_file(&self, dir: impl AsRef<Path>, name: &str) -> Result<MappedTensors> {
        let (path, record) = self.file_path(dir.as_ref(), name)?;
        MappedTensors::map(&path, Some(record))
    }

    /// Where the listed data file `name` is, and its record.
    fn file_path(&self, dir: &Path, name: &str) -> Result<(PathBuf, &FileRecord)> {
        let record = self.files.get(name).ok_or_else(|| {
            checkpoint_error(
                &dir.join(MANIFEST_FILE),
                format!("lists no file {name:?}; the checkpoint is incomplete or of another kind"),
            )
        })?;
        let relative = Path::new(name);
        if name.is_empty()
            || !relative
                .components()
                .all(|c| matches!(c, Component::Normal(_)))
        {
            return Err(checkpoint_error(
                &dir.join(MANIFEST_FILE),
                format!("file name {name:?} is not a plain relative path inside the checkpoint"),
            ));
        }
        Ok((dir.join(relative), record))
    }
}

/// Whether a checkpoint holds per-rank optimizer shards or one consolidated
/// optimizer state.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum CheckpointKind {
    /// One optimizer file per saving rank, plus the model weights
    /// (`Engine::save_checkpoint`).
    Sharded,
    /// One unsharded optimizer file (`Engine::save_consolidated`).
    Consolidated,
}

/// A piece of a parameter whose optimizer state a per-rank file holds.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct PieceRecord {
    /// The parameter's name.
    pub name: String,
    /// Offset of the piece within the flattened parameter.
    pub offset: usize,
    /// Number of elements.
    pub len: usize,
}

/// One rank's optimizer file in a sharded checkpoint.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ShardRecord {
    /// The rank (of the partition plan) that wrote it.
    pub rank: usize,
    /// The file, relative to the checkpoint directory.
    pub file: String,
    /// The pieces whose state it holds, as tensors named
    /// `state.<name>.<offset>.<state name>` (scalars such as `step` as f64
    /// tensors of shape `[]`). Pieces never stepped have no tensors.
    pub pieces: Vec<PieceRecord>,
}

/// The typed description of a checkpoint in its [`Manifest`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CheckpointInfo {
    /// Sharded or consolidated.
    pub kind: CheckpointKind,
    /// Distinguishes the files of this save from those of earlier saves
    /// into the same directory (e.g. `step12`).
    #[serde(default)]
    pub tag: String,
    /// The communicator's world size at save.
    pub world_size: usize,
    /// The ZeRO stage at save (0, 1 or 2).
    pub stage: u8,
    /// The partitioner at save.
    pub partition: PartitionKind,
    /// The model's parameters: names, shapes, dtypes, trainability.
    pub params: Vec<ParamInfo>,
    /// The optimizer's kind, e.g. `"adam"`.
    pub optimizer: String,
    /// Hyperparameters and members of each parameter group.
    pub param_groups: Vec<GroupState>,
    /// Optimizer steps taken at save.
    pub steps: u64,
    /// The loss scaler's state at save (runs with loss scaling).
    #[serde(default)]
    pub loss_scaler: Option<LossScalerState>,
    /// The model weights under parameter names (sharded checkpoints).
    #[serde(default)]
    pub model_file: Option<String>,
    /// Per saving rank, its optimizer file and pieces (sharded
    /// checkpoints).
    #[serde(default)]
    pub shards: Vec<ShardRecord>,
    /// What the user stored with the checkpoint (e.g. data position and
    /// learning rate); `null` when nothing.
    #[serde(default)]
    pub user: serde_json::Value,
}

/// One parameter group: its hyperparameters (PyTorch's names) and the names
/// of its parameters.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct GroupState {
    /// Hyperparameters, e.g. `lr`, `momentum`.
    pub hyperparams: Hyperparams,
    /// The parameters of the group, by name, sorted.
    pub params: Vec<String>,
}

/// The part of a loss scaler that changes during training (in checkpoints).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct LossScalerState {
    /// The current scale.
    pub scale: f64,
    /// Clean steps in a row since the scale last changed (`GradScaler`'s
    /// `_growth_tracker`).
    pub growth_tracker: u64,
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs;

    #[test]
    fn manifest_save_removes_what_killed_writes_left() {
        let dir = tempfile::tempdir().unwrap();
        let leftovers = [
            ".model.step4.safetensors.tmp.999999.7",
            ".manifest.json.tmp.999999.8",
        ];
        for name in leftovers {
            fs::write(dir.path().join(name), b"partial").unwrap();
        }
        fs::write(dir.path().join(".keep"), b"not ours").unwrap();
        let record = write_atomic(dir.path().join("model.step5.safetensors"), |w| {
            w.write_all(b"weights")
        })
        .unwrap();
        let mut manifest = Manifest::new();
        manifest.record("model.step5.safetensors", record);
        manifest.save(dir.path()).unwrap();
        let mut names: Vec<String> = fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        assert_eq!(names, [".keep", MANIFEST_FILE, "model.step5.safetensors"]);
    }
}
