//! The in-process backend: N ranks as N threads of one process. (stub, being written)

/// Placeholder.
pub struct ThreadGroup;
/// Placeholder.
pub struct ThreadComm;
