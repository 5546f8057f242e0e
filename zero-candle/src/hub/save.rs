//! `ZeroOptimizer::save_hub`: the trained variables written back in the
//! layout of the hub checkpoint they came from.

use super::{hub_error, Arrangement, HubDir, HubLayout, INDEX_FILE, WEIGHTS_FILE};
use crate::memory::CandleMemory;
use crate::optimizer::weights::{Saved, SavedTensor, WeightsFile};
use crate::{Error, Result, ZeroOptimizer};
use candle_core::WithDType;
use std::io::Write;
use std::path::Path;
use zero_core::{Communicator, Element};

impl<C, T> ZeroOptimizer<C, T>
where
    C: Communicator + 'static,
    T: Element + WithDType,
    C::Memory: CandleMemory<T, C>,
{
    /// Writes the model into `dir` in the layout of `from`, the hub
    /// checkpoint it was loaded from: the same files (one
    /// `model.safetensors`, or the index and its shards), tensor names,
    /// dtypes (each variable's values converted to the file's dtype; a
    /// sharded one's from the engine's masters) and arrangement (`layout`'s
    /// transposed variables written back transposed, its reordered rows
    /// put back), tensors the model does
    /// not train copied as they are, and `from`'s other files (`config.json`,
    /// the tokenizer's) copied beside them, so that `transformers` loads `dir` unchanged. Rank 0 writes, one tensor at
    /// a time (at stage 3 each sharded variable is gathered for its tensor
    /// only); each file appears whole or not at all. `dir` may be `from`'s
    /// own directory. A collective: every rank calls it, and every rank
    /// gets the error if rank 0 cannot write.
    pub fn save_hub(
        &mut self,
        dir: impl AsRef<Path>,
        from: &HubDir,
        layout: &HubLayout,
    ) -> Result<()> {
        let dir = dir.as_ref();
        let names = self.names().to_vec();
        if let Some(var) = names.iter().find(|v| layout.tensor_of(from, v).is_none()) {
            return Err(Error::Variable {
                name: var.clone(),
                detail: format!(
                    "{} has no tensor for it, so it cannot be saved in that checkpoint's layout",
                    from.dir().display()
                ),
            });
        }
        let mut files = Vec::new();
        for (file_name, tensors) in from.files() {
            let mut saved = Vec::with_capacity(tensors.len());
            for name in tensors {
                let Some(tensor) = from.tensor(name) else {
                    continue;
                };
                let source = match (layout.parts_of(name), layout.var_of(name, &names)) {
                    (Some(parts), _) => Saved::Vars {
                        arrangement: parts
                            .first()
                            .map_or(Arrangement::AsIs, |p| layout.arrangement(p).clone()),
                        indices: parts
                            .iter()
                            .map(|part| {
                                names.iter().position(|v| v == part).ok_or_else(|| {
                                    Error::Variable {
                                        name: part.clone(),
                                        detail: format!(
                                            "the layout puts it in {name}, but the model has no \
                                             such variable: build the layout from this model's \
                                             config"
                                        ),
                                    }
                                })
                            })
                            .collect::<Result<_>>()?,
                    },
                    (None, Some(index)) => Saved::Var {
                        index,
                        arrangement: layout.arrangement(&names[index]).clone(),
                    },
                    (None, None) => Saved::Bytes(tensor.data),
                };
                saved.push(SavedTensor {
                    name: name.to_string(),
                    dtype: tensor.dtype,
                    shape: tensor.shape.clone(),
                    from: source,
                });
            }
            files.push(WeightsFile {
                path: dir.join(file_name),
                tensors: saved,
            });
        }
        let rank = self.engine().comm().rank();
        let copied = match rank {
            0 => copy_other_files(from, dir),
            _ => Ok(()),
        };
        self.write_weights(files)?;
        let mut failed = [f32::from(u8::from(copied.is_err()))];
        self.engine_mut()
            .all_reduce_host(&mut failed[..], zero_core::ReduceOp::Max)?;
        match copied {
            Err(e) => Err(e),
            Ok(()) if failed[0] > 0.0 => Err(hub_error(
                dir,
                "rank 0 could not copy the checkpoint's other files; see its error",
            )),
            Ok(()) => Ok(()),
        }
    }
}

/// Creates `dir` and copies `from`'s regular files but its weights into it
/// (each written beside, then moved), and removes a weights file or index
/// of the other layout that `dir` may hold from an earlier save.
fn copy_other_files(from: &HubDir, dir: &Path) -> Result<()> {
    std::fs::create_dir_all(dir)
        .map_err(|e| hub_error(dir, format!("cannot create the directory: {e}")))?;
    let weights: Vec<&str> = from.files().into_iter().map(|(name, _)| name).collect();
    let entries = std::fs::read_dir(from.dir())
        .map_err(|e| hub_error(from.dir(), format!("cannot list: {e}")))?;
    for entry in entries {
        let path = entry
            .map_err(|e| hub_error(from.dir(), format!("cannot list: {e}")))?
            .path();
        let Some(name) = path.file_name().and_then(|n| n.to_str()) else {
            continue;
        };
        if !path.is_file() || weights.contains(&name) {
            continue;
        }
        let bytes =
            std::fs::read(&path).map_err(|e| hub_error(&path, format!("cannot read: {e}")))?;
        zero_core::checkpoint::write_atomic(dir.join(name), |w: &mut dyn Write| {
            w.write_all(&bytes)
        })?;
    }
    let stale = if from.is_sharded() {
        WEIGHTS_FILE
    } else {
        INDEX_FILE
    };
    let stale = dir.join(stale);
    if stale.is_file() {
        std::fs::remove_file(&stale)
            .map_err(|e| hub_error(&stale, format!("cannot remove the stale file: {e}")))?;
    }
    Ok(())
}
