//! What the training loop needs of a rank's optimizer, as a trait, so the
//! loop is compiled once for every backend and element type.

use super::metrics::{GatherMetrics, OffloadMetrics};
use super::TrainError;
use candle_core::{Tensor, WithDType};
use zero_candle::hub::{HubDir, HubLayout};
use zero_candle::{CandleMemory, ZeroOptimizer};
use zero_core::checkpoint::Manifest;
use zero_core::engine::{MemoryReport, SaveOptions, SavedCheckpoint, StepReport};
use zero_core::{Communicator, Element, Preemption, ReduceOp};

/// What the training loop needs of a rank's optimizer ([`ZeroOptimizer`]
/// on any backend), so the loop is compiled once.
pub(super) trait RankOptimizer {
    /// `loss.backward()` and one micro-step.
    fn backward_step(&mut self, loss: &Tensor) -> Result<Option<StepReport>, TrainError>;
    fn learning_rate(&self) -> f64;
    fn set_learning_rate(&mut self, lr: f64);
    fn bytes_sent(&self) -> u64;
    fn memory_report(&self) -> MemoryReport;
    /// The device's peak memory so far (GPU backends).
    fn device_peak_bytes(&self) -> Option<u64>;
    /// The mean of `value` over ranks (a collective).
    fn mean_over_ranks(&mut self, value: f64) -> Result<f64, TrainError>;
    /// Whether every rank is to stop now (a collective, once per step).
    fn should_stop(&mut self, preemption: &Preemption) -> Result<bool, TrainError>;
    fn save_checkpoint(
        &mut self,
        dir: &std::path::Path,
        options: &SaveOptions,
    ) -> Result<(), TrainError>;
    /// Starts a background save, after completing the one in flight
    /// (returned); a collective.
    fn save_checkpoint_async(
        &mut self,
        dir: &std::path::Path,
        options: &SaveOptions,
    ) -> Result<Option<SavedCheckpoint>, TrainError>;
    /// Completes the background save in flight if every rank wrote its
    /// files (a collective while one is in flight).
    fn poll_checkpoint(&mut self) -> Result<Option<SavedCheckpoint>, TrainError>;
    /// Waits for the background save in flight and completes it.
    fn wait_checkpoint(&mut self) -> Result<Option<SavedCheckpoint>, TrainError>;
    fn load_checkpoint(&mut self, dir: &std::path::Path) -> Result<Manifest, TrainError>;
    /// Writes every trained variable to a safetensors file, one tensor at
    /// a time (a collective).
    fn save_weights(&mut self, path: &std::path::Path) -> Result<(), TrainError>;
    /// Writes the model in the layout of the hub checkpoint `from` (a
    /// collective).
    fn save_hub(
        &mut self,
        dir: &std::path::Path,
        from: &HubDir,
        layout: &HubLayout,
    ) -> Result<(), TrainError>;
    /// Steps that deferred their all-gathers.
    fn deferred_steps(&self) -> u64;
    /// Stage 3, once sharded: the parameter gathers so far.
    fn gather_metrics(&self) -> Option<GatherMetrics>;
    /// Offload with a step thread: its times so far.
    fn offload_metrics(&self) -> Option<OffloadMetrics>;
}

impl<C, T> RankOptimizer for ZeroOptimizer<C, T>
where
    C: Communicator + 'static,
    T: Element + WithDType,
    C::Memory: CandleMemory<T, C>,
{
    fn backward_step(&mut self, loss: &Tensor) -> Result<Option<StepReport>, TrainError> {
        Ok(ZeroOptimizer::backward_step(self, loss)?)
    }
    fn learning_rate(&self) -> f64 {
        self.engine().learning_rate()
    }
    fn set_learning_rate(&mut self, lr: f64) {
        self.engine_mut().set_learning_rate(lr)
    }
    fn bytes_sent(&self) -> u64 {
        ZeroOptimizer::bytes_sent(self)
    }
    fn memory_report(&self) -> MemoryReport {
        ZeroOptimizer::memory_report(self)
    }
    fn device_peak_bytes(&self) -> Option<u64> {
        ZeroOptimizer::device_peak_bytes(self)
    }
    fn mean_over_ranks(&mut self, value: f64) -> Result<f64, TrainError> {
        let mut v = [value];
        self.engine_mut()
            .all_reduce_host(&mut v[..], ReduceOp::Avg)?;
        Ok(v[0])
    }
    fn should_stop(&mut self, preemption: &Preemption) -> Result<bool, TrainError> {
        Ok(ZeroOptimizer::should_stop(self, preemption)?)
    }
    fn save_checkpoint(
        &mut self,
        dir: &std::path::Path,
        options: &SaveOptions,
    ) -> Result<(), TrainError> {
        self.save_checkpoint_with(dir, options)?;
        Ok(())
    }
    fn save_checkpoint_async(
        &mut self,
        dir: &std::path::Path,
        options: &SaveOptions,
    ) -> Result<Option<SavedCheckpoint>, TrainError> {
        Ok(ZeroOptimizer::save_checkpoint_async(self, dir, options)?)
    }
    fn poll_checkpoint(&mut self) -> Result<Option<SavedCheckpoint>, TrainError> {
        Ok(ZeroOptimizer::poll_checkpoint(self)?)
    }
    fn wait_checkpoint(&mut self) -> Result<Option<SavedCheckpoint>, TrainError> {
        Ok(ZeroOptimizer::wait_checkpoint(self)?)
    }
    fn load_checkpoint(&mut self, dir: &std::path::Path) -> Result<Manifest, TrainError> {
        Ok(ZeroOptimizer::load_checkpoint(self, dir)?)
    }
    fn save_weights(&mut self, path: &std::path::Path) -> Result<(), TrainError> {
        Ok(ZeroOptimizer::save_weights(self, path)?)
    }
    fn save_hub(
        &mut self,
        dir: &std::path::Path,
        from: &HubDir,
        layout: &HubLayout,
    ) -> Result<(), TrainError> {
        Ok(ZeroOptimizer::save_hub(self, dir, from, layout)?)
    }
    fn deferred_steps(&self) -> u64 {
        self.engine().counters().deferred_steps
    }
    fn gather_metrics(&self) -> Option<GatherMetrics> {
        let fetcher = self.engine().fetcher()?;
        let stats = fetcher.stats();
        Some(GatherMetrics {
            prefetch_hits: stats.hits,
            prefetch_misses: stats.misses,
            on_thread: fetcher.threaded(),
        })
    }
    fn offload_metrics(&self) -> Option<OffloadMetrics> {
        let times = self.engine().counters().offload;
        let ms = |d: std::time::Duration| d.as_secs_f64() * 1e3;
        (times.steps > 0).then(|| OffloadMetrics {
            steps: times.steps,
            landing_ms: ms(times.landing),
            stepping_ms: ms(times.stepping),
            packing_ms: ms(times.packing),
            join_ms: ms(times.join),
            write_back_ms: ms(times.write_back),
        })
    }
}
