//! What `--metrics` writes: one JSON line per step, from rank 0.

use serde::Serialize;
use zero_core::engine::MemoryReport;

/// One line of `--metrics`.
#[derive(Debug, Serialize)]
pub struct StepMetrics {
    /// Optimizer step, from 1.
    pub step: u64,
    /// Mean loss over the global batch of the step.
    pub loss: f64,
    /// Mean loss over the validation windows (GPT, at `--eval-every`
    /// steps).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub val_loss: Option<f64>,
    /// Learning rate used.
    pub lr: f64,
    /// Global gradient norm (L2) before clipping.
    pub grad_norm: Option<f64>,
    /// Wall time of the step in seconds.
    pub step_time_s: f64,
    /// Tokens (bytes) of the global batch per second of step time (GPT).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tokens_per_s: Option<f64>,
    /// Bytes rank 0 sent during the step, over every communicator of its
    /// engine (its group's, the replicas', stage 3's gathers').
    pub bytes_sent: u64,
    /// Rank 0's engine buffers, per category (the engine's own count).
    pub memory: MemoryReport,
    /// The loss scale the step's gradients were divided by (with loss
    /// scaling).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub loss_scale: Option<f64>,
    /// Whether the step was skipped for an inf/NaN gradient (loss scaling).
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub skipped: bool,
    /// The process's peak heap bytes so far (all ranks of a threads run),
    /// as counted by the binary's allocator; absent when not counted.
    pub peak_heap_bytes: Option<usize>,
    /// GPU backends: rank 0's device peak so far (the high-water mark of
    /// the device's stream-ordered memory pool: model, activations,
    /// gradients and the engine's buffers), when the device can tell.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub device_peak_bytes: Option<u64>,
    /// Stage 3, once sharded: rank 0's parameter gathers so far.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gathers: Option<GatherMetrics>,
    /// `--offload optimizer` on a GPU: where rank 0's host time went so far.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub offload: Option<OffloadMetrics>,
}

/// Rank 0's offloaded steps so far (`--metrics`; see
/// [`zero_core::engine::OffloadTimes`]), in milliseconds summed over
/// `steps`.
#[derive(Debug, Serialize)]
pub struct OffloadMetrics {
    /// Steps whose host stepped each bucket as it landed.
    pub steps: u64,
    /// The step thread, waiting for buckets' copies into host memory.
    pub landing_ms: f64,
    /// The step thread, stepping buckets.
    pub stepping_ms: f64,
    /// The step thread, rounding a 16-bit model's stepped weights for the
    /// write-back.
    pub packing_ms: f64,
    /// Waiting after backward for the step thread's last buckets.
    pub join_ms: f64,
    /// Writing the stepped weights back into the model.
    pub write_back_ms: f64,
}

/// Rank 0's stage 3 parameter gathers so far (`--metrics`).
#[derive(Debug, Serialize)]
pub struct GatherMetrics {
    /// Requests whose gather had been issued ahead (prefetched).
    pub prefetch_hits: u64,
    /// Requests that issued their own gather.
    pub prefetch_misses: u64,
    /// Whether gathers run on a thread of their own (only then can one be
    /// issued ahead: not under MPI without `MPI_THREAD_MULTIPLE`).
    pub on_thread: bool,
}
