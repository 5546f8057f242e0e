//! What the engine holds, in exact bytes.

use serde::{Deserialize, Serialize};

/// Bytes held per category on one rank.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemoryReport {
    /// The parameter replica the framework holds (at stage 3, of the
    /// parameters not sharded) plus the engine's parameter shard (master
    /// weights, stage 3's only copy, or a working copy).
    pub params: usize,
    /// The full flat gradient buffer, while it exists (stage 0 keeps it,
    /// stage 1 once it accumulates; stages 2-3 only during an accumulation
    /// window given outside a backward pass).
    pub grads: usize,
    /// The rank's reduced gradient shard (stages 1-3).
    pub grad_shard: usize,
    /// Optimizer state of the pieces this rank steps.
    pub optimizer_state: usize,
    /// Bucket buffers for collectives (and what the memory stages them in).
    pub comm_buffers: usize,
    /// Of the bytes above, those in host memory instead of the device
    /// (offload: the parameter and gradient shards and the optimizer
    /// state); the device holds `total() - offloaded`. `0` without offload
    /// (and on host memories, where there is no device).
    #[serde(default)]
    pub offloaded: usize,
}

impl MemoryReport {
    /// The bytes on the device: all but the offloaded ones.
    pub fn on_device(&self) -> usize {
        self.total() - self.offloaded
    }

    /// The sum of all categories.
    pub fn total(&self) -> usize {
        self.params + self.grads + self.grad_shard + self.optimizer_state + self.comm_buffers
    }
}
