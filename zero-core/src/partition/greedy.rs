//! The greedy partitioner. (stub, being written)

/// Placeholder.
pub struct Greedy;
