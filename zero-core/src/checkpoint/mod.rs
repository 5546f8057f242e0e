//! Checkpoints: atomic, checksummed files, safetensors tensors, the manifest
//! that indexes a checkpoint directory, the unsharded [`StateDict`], and
//! [`StepCheckpoints`], a directory of checkpoints kept by step.
//!
//! The engine's side (consolidation, sharded save and load, saves in the
//! background) lives in `Engine::consolidate_state_dict`,
//! `Engine::save_checkpoint`, `Engine::save_checkpoint_async` and
//! `Engine::load_checkpoint`.

mod files;
mod manifest;
mod state_dict;
mod steps;
pub(crate) mod stream;
mod tensors;

pub use files::*;
pub use manifest::*;
pub use state_dict::*;
pub use steps::*;
pub use tensors::*;
