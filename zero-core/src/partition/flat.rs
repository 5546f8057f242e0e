//! The flat partitioner. (stub, being written)

/// Placeholder.
pub struct Flat;
