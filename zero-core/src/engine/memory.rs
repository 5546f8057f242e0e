//! What the engine holds, in exact bytes.

use serde::{Deserialize, Serialize};

/// Bytes held per category on one rank.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemoryReport {
    /// The full parameter replica (held by the framework in stages 0-2) plus
    /// the engine's working copy of the rank's parameter shard.
    pub params: usize,
    /// The full flat gradient buffer, while it exists (stages 0 and 1 keep
    /// it; stage 2 only during gradient accumulation).
    pub grads: usize,
    /// The rank's reduced gradient shard (stages 1 and 2).
    pub grad_shard: usize,
    /// Optimizer state of the pieces this rank steps.
    pub optimizer_state: usize,
    /// Bucket buffers for collectives.
    pub comm_buffers: usize,
}

impl MemoryReport {
    /// The sum of all categories.
    pub fn total(&self) -> usize {
        self.params + self.grads + self.grad_shard + self.optimizer_state + self.comm_buffers
    }
}
