//! Background saves (`Engine::save_checkpoint_async`): the snapshot of what
//! one rank writes, taken into host memory at the step boundary; the thread
//! that writes it; and what is left for the main thread once every rank's
//! writer is done (the agreement and the manifest, both collectives, which
//! never run on the writer: MPI without full thread support cannot).
//!
//! At most one save is in flight. Its buffers come back from the writer and
//! serve the next snapshot, so a run that saves every K steps allocates
//! them once.

use super::{write_state_file, Files, Pending};
use crate::checkpoint::{FileRecord, Manifest, TensorWriter};
use crate::comm::Communicator;
use crate::optim::OptimizerState;
use crate::{DType, Element, Error, Result};
use std::path::{Path, PathBuf};
use std::thread::JoinHandle;

/// A checkpoint that a background save completed: every rank's files are
/// written and the manifest, its commit point, is in place. Given back on
/// every rank by [`Engine::wait_checkpoint`](crate::Engine::wait_checkpoint)
/// and the calls that complete a save.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct SavedCheckpoint {
    /// The directory saved into.
    pub dir: PathBuf,
    /// Its manifest ([`CheckpointInfo::user`] holds what the save stored).
    ///
    /// [`CheckpointInfo::user`]: crate::checkpoint::CheckpointInfo::user
    pub manifest: Manifest,
}

/// One rank's files of a checkpoint, in host memory.
pub(in crate::engine) struct Snapshot<T> {
    pub dir: PathBuf,
    /// This rank's optimizer file.
    pub state: Option<StateSnapshot<T>>,
    /// Rank 0's model file.
    pub model: Option<ModelSnapshot<T>>,
}

/// A rank's optimizer state as [`write_state_file`] writes it.
pub(in crate::engine) struct StateSnapshot<T> {
    pub file: String,
    pub state: OptimizerState<T>,
    /// Fault injection (tests): fail the write after this many bytes.
    pub fail_after: Option<usize>,
}

/// The model file's tensors (name, dtype, shape, in file order; all of the
/// engine's element type) and their data, end to end: what a blocking save
/// streams into its [`TensorWriter`].
pub(in crate::engine) struct ModelSnapshot<T> {
    pub file: String,
    pub specs: Vec<(String, DType, Vec<usize>)>,
    pub values: Vec<T>,
}

type Written<T> = (Snapshot<T>, Result<Files>);

/// The writer's side of a save in flight: its thread, or the error that
/// stopped the snapshot before there was anything to write.
enum Writer<T> {
    Thread(JoinHandle<Written<T>>),
    Failed(Error),
}

/// The background save of one engine: the save in flight, if any, and the
/// buffers of the last one, kept for the next.
pub(in crate::engine) struct BackgroundSave<T> {
    in_flight: Option<(Pending, Writer<T>)>,
    /// With shard groups, on the ranks of the groups but the first: the
    /// directory of the save the first group writes, in flight.
    elsewhere: Option<PathBuf>,
    /// Rank 0's model data, back from the last writer.
    model_values: Vec<T>,
    /// This rank's optimizer state, back from the last writer.
    state: OptimizerState<T>,
}

impl<T> Default for BackgroundSave<T> {
    fn default() -> Self {
        Self {
            in_flight: None,
            elsewhere: None,
            model_values: Vec::new(),
            state: OptimizerState {
                params: Default::default(),
            },
        }
    }
}

impl<T: Element> BackgroundSave<T> {
    /// Whether a save is in flight (the same on every rank: saves are
    /// collectives).
    pub fn in_flight(&self) -> bool {
        self.in_flight.is_some() || self.elsewhere.is_some()
    }

    /// A save into `dir` that another group writes is in flight: this rank
    /// only takes part in completing it.
    pub fn start_elsewhere(&mut self, dir: &Path) {
        self.elsewhere = Some(dir.to_path_buf());
    }

    /// Whether this rank's writer is done (or never started), so that
    /// joining it does not wait.
    pub fn written(&self) -> bool {
        match &self.in_flight {
            Some((_, Writer::Thread(handle))) => handle.is_finished(),
            _ => true,
        }
    }

    /// The buffer for rank 0's model data, `len` elements: the last
    /// save's, which is that long unless the model changed (it is filled
    /// anew, in order, so its old values need no clearing). A new one is
    /// allocated zeroed: the pages come zeroed from the system, and the
    /// snapshot writes each element once.
    pub fn take_model_values(&mut self, len: usize) -> Vec<T> {
        let values = std::mem::take(&mut self.model_values);
        if values.len() == len {
            values
        } else {
            bytemuck::zeroed_vec(len)
        }
    }

    /// The buffers for this rank's optimizer state: the last save's.
    pub fn take_state(&mut self) -> OptimizerState<T> {
        std::mem::take(&mut self.state)
    }

    /// Starts writing `snapshot` on a thread of its own (or records why
    /// there is none). The caller has completed the previous save.
    pub fn start(&mut self, pending: Pending, snapshot: Result<Snapshot<T>>) {
        debug_assert!(self.in_flight.is_none(), "a save is already in flight");
        let writer = snapshot.and_then(|snapshot| {
            std::thread::Builder::new()
                .name("zero-checkpoint-writer".into())
                .spawn(move || {
                    let written = write_snapshot(&snapshot);
                    (snapshot, written)
                })
                .map_err(|e| Error::Io {
                    path: pending.dir.clone(),
                    source: e,
                })
        });
        let writer = match writer {
            Ok(handle) => Writer::Thread(handle),
            Err(e) => Writer::Failed(e),
        };
        self.in_flight = Some((pending, writer));
    }

    /// Completes the save in flight: joins this rank's writer, agrees with
    /// the other ranks on the outcome, and writes the manifest on rank 0
    /// (collectives, on the main thread); `None` if no save is in flight.
    pub fn complete<C: Communicator>(
        &mut self,
        comm: &C,
        world: Option<&C>,
    ) -> Result<Option<SavedCheckpoint>> {
        let (dir, local) = match (self.elsewhere.take(), self.join()) {
            (Some(dir), _) => (dir, Ok(None)),
            (None, Some((pending, written))) => {
                let dir = pending.dir.clone();
                let manifest = pending.commit(comm, written, "the background save");
                let saved = manifest.map(|manifest| SavedCheckpoint {
                    dir: dir.clone(),
                    manifest,
                });
                (dir, saved.map(Some))
            }
            (None, None) => return Ok(None),
        };
        match world {
            // Shard groups: the first group's outcome is every rank's.
            Some(world) => {
                crate::engine::groups::agree(world, local, &dir, "the background save").map(Some)
            }
            None => local,
        }
    }

    /// Waits for this rank's writer and returns the save with the files it
    /// wrote, or its error; `None` if no save is in flight. The save is no
    /// longer in flight after this, whatever the outcome.
    fn join(&mut self) -> Option<(Pending, Result<Files>)> {
        let (pending, writer) = self.in_flight.take()?;
        let written = match writer {
            Writer::Failed(e) => Err(e),
            Writer::Thread(handle) => match handle.join() {
                Ok((snapshot, written)) => {
                    if let Some(model) = snapshot.model {
                        self.model_values = model.values;
                    }
                    if let Some(state) = snapshot.state {
                        self.state = state.state;
                    }
                    written
                }
                Err(_) => Err(Error::State(format!(
                    "the checkpoint writer of {} panicked; the save is incomplete (no \
                     manifest), the previous checkpoint stays the one to resume from",
                    pending.dir.display()
                ))),
            },
        };
        Some((pending, written))
    }
}

impl<T> Drop for BackgroundSave<T> {
    /// Lets a write in flight finish its files (no manifest is written
    /// without the ranks' agreement, so the save stays incomplete and is
    /// never resumed from); call `Engine::wait_checkpoint` to complete it.
    fn drop(&mut self) {
        if let Some((_, Writer::Thread(handle))) = self.in_flight.take() {
            let _ = handle.join();
        }
    }
}

/// Writes one rank's files of `snapshot`, each atomically, as a blocking
/// save writes them: the optimizer file, then the model file.
fn write_snapshot<T: Element>(snapshot: &Snapshot<T>) -> Result<Files> {
    let dir = &snapshot.dir;
    std::fs::create_dir_all(dir).map_err(|e| Error::Io {
        path: dir.to_path_buf(),
        source: e,
    })?;
    let mut files = Vec::new();
    if let Some(state) = &snapshot.state {
        let record = write_state_file(&dir.join(&state.file), &state.state, state.fail_after)?;
        files.push((state.file.clone(), record));
    }
    if let Some(model) = &snapshot.model {
        files.push((model.file.clone(), write_model_file(dir, model)?));
    }
    Ok(files)
}

/// The model file of `model` in `dir`, written in parts so that the bytes
/// are hashed and written as they go, as a streamed save writes them.
fn write_model_file<T: Element>(dir: &Path, model: &ModelSnapshot<T>) -> Result<FileRecord> {
    let mut writer = TensorWriter::create(dir.join(&model.file), &model.specs)?;
    for part in bytemuck::cast_slice::<T, u8>(&model.values).chunks(PART_BYTES) {
        writer.write(part)?;
    }
    writer.finish()
}

/// Bytes handed to the writer at a time.
const PART_BYTES: usize = 8 << 20;
