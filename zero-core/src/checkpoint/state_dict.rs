//! The unsharded optimizer state, PyTorch-like: full-length state tensors per
//! parameter name, and hyperparameters with membership per group.

use super::files::checkpoint_error;
use super::manifest::{CheckpointKind, GroupState, Manifest, MANIFEST_FILE};
use super::tensors::load_tensors;
use crate::optim::{FunctionalOptimizer, OptimizerState, ParamState};
use crate::{Element, Error, Result};
use std::collections::BTreeMap;
use std::path::Path;

/// The consolidated optimizer file of a checkpoint without a tag.
pub const CONSOLIDATED_FILE: &str = "optimizer.safetensors";

/// The consolidated optimizer file of the checkpoint tagged `tag`
/// (`optimizer.<tag>.safetensors`; [`CONSOLIDATED_FILE`] when `tag` is
/// empty). Saves into a directory use a tag the directory's current
/// checkpoint does not, so a failed save never touches the file the current
/// manifest points to.
pub fn consolidated_file_name(tag: &str) -> String {
    if tag.is_empty() {
        CONSOLIDATED_FILE.to_string()
    } else {
        format!("optimizer.{tag}.safetensors")
    }
}

/// An optimizer's state in unsharded form, like PyTorch's
/// `optimizer.state_dict()`: per parameter name its state with full-length
/// tensors (scalars such as `step` as they are), and the parameter groups.
///
/// Made by `Engine::consolidate_state_dict` (from the shards of every rank)
/// or [`state_dict_from_plain`] (from an unsharded optimizer); loaded by
/// `Engine::load_state_dict` at any world size, stage and partitioner, or by
/// [`load_into_plain`].
#[derive(Clone, Debug, Default, PartialEq)]
pub struct StateDict<T> {
    /// The optimizer's kind, e.g. `"sgd"`.
    pub optimizer: String,
    /// State per parameter name; parameters never stepped have none.
    pub state: BTreeMap<String, ParamState<T>>,
    /// The parameter groups, in group order.
    pub param_groups: Vec<GroupState>,
    /// Optimizer steps the engine had taken (0 for a plain optimizer).
    pub steps: u64,
}

/// Converts the state of a plain (unsharded) optimizer, whose pieces are
/// whole parameters (keys `(name, 0)`), into a [`StateDict`].
///
/// `param_groups` gives the parameter names of each of the optimizer's
/// groups, in group order. A piece at a non-zero offset is an error: that
/// state came from a sharded optimizer; consolidate it instead.
pub fn state_dict_from_plain<T: Element>(
    optimizer: &dyn FunctionalOptimizer<T>,
    param_groups: &[Vec<String>],
) -> Result<StateDict<T>> {
    if param_groups.len() != optimizer.num_groups() {
        return Err(Error::Config(format!(
            "state_dict_from_plain: {} group membership list(s) given for an optimizer with {} group(s)",
            param_groups.len(),
            optimizer.num_groups()
        )));
    }
    let mut state = BTreeMap::new();
    for ((name, offset), piece) in optimizer.export_state().params {
        if offset != 0 {
            return Err(Error::Config(format!(
                "state_dict_from_plain: parameter {name:?} has a piece at offset {offset}; \
                 this optimizer is sharded, use Engine::consolidate_state_dict"
            )));
        }
        state.insert(name, piece);
    }
    let param_groups = param_groups
        .iter()
        .enumerate()
        .map(|(g, names)| {
            let mut params = names.clone();
            params.sort();
            GroupState {
                hyperparams: optimizer.hyperparams(g),
                params,
            }
        })
        .collect();
    Ok(StateDict {
        optimizer: optimizer.kind().to_string(),
        state,
        param_groups,
        steps: 0,
    })
}

/// The state of a [`StateDict`] keyed as a plain optimizer keys it: one
/// piece per parameter, at offset 0.
pub fn plain_state_from_dict<T: Element>(dict: &StateDict<T>) -> OptimizerState<T> {
    OptimizerState {
        params: dict
            .state
            .iter()
            .map(|(name, piece)| ((name.clone(), 0), piece.clone()))
            .collect(),
    }
}

/// Loads `dict` into a plain (unsharded) optimizer: hyperparameters per
/// group (groups the optimizer lacks are added) and state per parameter.
pub fn load_into_plain<T: Element>(
    dict: &StateDict<T>,
    optimizer: &mut dyn FunctionalOptimizer<T>,
) -> Result<()> {
    if dict.optimizer != optimizer.kind() {
        return Err(Error::Optimizer(format!(
            "the state dict is of a {:?} optimizer, this optimizer is {:?}",
            dict.optimizer,
            optimizer.kind()
        )));
    }
    for (g, group) in dict.param_groups.iter().enumerate() {
        if g < optimizer.num_groups() {
            optimizer.set_hyperparams(g, &group.hyperparams)?;
        } else {
            optimizer.add_group(&group.hyperparams)?;
        }
    }
    optimizer.import_state(plain_state_from_dict(dict))
}

/// Tensor name of state `state` of parameter `param` in a consolidated file.
pub(crate) fn consolidated_name(param: &str, state: &str) -> String {
    format!("state.{param}.{state}")
}

/// Tensor name of state `state` of the piece of `param` at `offset` in a
/// per-rank file.
pub(crate) fn piece_name(param: &str, offset: usize, state: &str) -> String {
    format!("state.{param}.{offset}.{state}")
}

impl<T: Element> StateDict<T> {
    /// Reads the consolidated optimizer state written by
    /// `Engine::save_consolidated` into `dir` (verifying checksums).
    pub fn load(dir: impl AsRef<Path>) -> Result<Self> {
        let dir = dir.as_ref();
        let manifest = Manifest::load(dir)?;
        let manifest_path = dir.join(MANIFEST_FILE);
        let info = manifest
            .checkpoint
            .as_ref()
            .ok_or_else(|| checkpoint_error(&manifest_path, "has no checkpoint description"))?;
        if info.kind != CheckpointKind::Consolidated {
            return Err(checkpoint_error(
                &manifest_path,
                "is a sharded checkpoint, not a consolidated optimizer state; \
                 load it with Engine::load_checkpoint",
            ));
        }
        let file = consolidated_file_name(&info.tag);
        let bytes = manifest.read_file(dir, &file)?;
        let path = dir.join(&file);
        let tensors = load_tensors(&path, &bytes)?;
        let mut state: BTreeMap<String, ParamState<T>> = BTreeMap::new();
        let mut used = 0;
        for p in &info.params {
            let prefix = format!("state.{}.", p.name);
            for (name, t) in tensors.range(prefix.clone()..) {
                let Some(rest) = name.strip_prefix(&prefix) else {
                    break;
                };
                if rest.contains('.') {
                    continue;
                }
                used += 1;
                let entry = state.entry(p.name.clone()).or_default();
                if t.shape.is_empty() {
                    let v = t
                        .to_vec::<f64>()
                        .map_err(|e| checkpoint_error(&path, format!("scalar {name:?}: {e}")))?;
                    let value = v.first().copied().ok_or_else(|| {
                        checkpoint_error(&path, format!("scalar {name:?} is empty"))
                    })?;
                    entry.scalars.insert(rest.to_string(), value);
                } else {
                    let v = t
                        .to_vec::<T>()
                        .map_err(|e| checkpoint_error(&path, format!("tensor {name:?}: {e}")))?;
                    if v.len() != p.numel() {
                        return Err(checkpoint_error(
                            &path,
                            format!(
                                "tensor {name:?} has {} elements, parameter {:?} has {}",
                                v.len(),
                                p.name,
                                p.numel()
                            ),
                        ));
                    }
                    entry.tensors.insert(rest.to_string(), v);
                }
            }
        }
        if used != tensors.len() {
            let unknown = tensors
                .keys()
                .find(|n| {
                    !info.params.iter().any(|p| {
                        n.strip_prefix(&format!("state.{}.", p.name))
                            .is_some_and(|rest| !rest.contains('.'))
                    })
                })
                .cloned()
                .unwrap_or_default();
            return Err(checkpoint_error(
                &path,
                format!("tensor {unknown:?} belongs to no parameter listed in the manifest"),
            ));
        }
        Ok(StateDict {
            optimizer: info.optimizer.clone(),
            state,
            param_groups: info.param_groups.clone(),
            steps: info.steps,
        })
    }
}
