//! Checkpoints: atomic, checksummed files, safetensors tensors, the manifest
//! that indexes a checkpoint directory, and the unsharded [`StateDict`].
//!
//! The engine's side (consolidation, sharded save and load) lives in
//! `Engine::consolidate_state_dict`, `Engine::save_checkpoint` and
//! `Engine::load_checkpoint`.

mod files;
mod manifest;
mod state_dict;
pub(crate) mod stream;
mod tensors;

pub use files::*;
pub use manifest::*;
pub use state_dict::*;
pub use tensors::*;
