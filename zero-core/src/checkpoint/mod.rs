//! Checkpoints: atomic, checksummed files, safetensors tensors and the
//! manifest that indexes a checkpoint directory.

mod io;

pub use io::*;
