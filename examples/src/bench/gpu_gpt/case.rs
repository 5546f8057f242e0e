//! One case of the GPT suite: the GPT trained on one GPU as the trainer
//! trains it, its figures measured ([`ours`]).

use super::{hooked_gpt, synchronize, BenchResult, CONFIG, STEPS, WARMUP};
use crate::trainer::GptOps;
use candle_core::{DType, Device, Tensor};
use std::time::Instant;
use zero_core::engine::{EngineConfig, Offload, OffloadTimes, Overlap, Stage};
use zero_nccl::cudarc::driver::CudaContext;
use zero_nccl::{DevicePool, NcclComm};

/// One case's figures.
pub(super) struct Measured {
    pub(super) tokens_per_s: f64,
    /// Bytes; `None` when the pool's high-water mark cannot be read.
    pub(super) peak_bytes: Option<u64>,
    /// The engine's own device bytes (its memory report less what it
    /// offloaded) per parameter, the model's weights included.
    pub(super) engine_device_bytes_per_param: f64,
    /// What the engine offloaded to host memory, per parameter.
    pub(super) engine_host_bytes_per_param: f64,
    /// The median step, milliseconds.
    pub(super) step_ms: f64,
    /// The host's medians, milliseconds from a step's start until the
    /// forward returned and until `backward_step` returned (before the
    /// drain): near `step_ms`, the host paces the step (or waits inside
    /// it); far below, the GPU does.
    pub(super) issued_ms: [f64; 2],
    /// Offload's host times, per timed step on average.
    pub(super) offload_ms: OffloadMs,
}

/// [`OffloadTimes`] per step, in milliseconds.
#[derive(Default)]
pub(super) struct OffloadMs {
    pub(super) landing: f64,
    pub(super) stepping: f64,
    pub(super) packing: f64,
    pub(super) join: f64,
    pub(super) write_back: f64,
}

impl OffloadMs {
    /// The times of the steps between `before` and `after`.
    fn between(before: OffloadTimes, after: OffloadTimes) -> Self {
        let steps = after.steps.saturating_sub(before.steps).max(1) as f64;
        let ms = |a: std::time::Duration, b: std::time::Duration| {
            a.saturating_sub(b).as_secs_f64() * 1e3 / steps
        };
        Self {
            landing: ms(after.landing, before.landing),
            stepping: ms(after.stepping, before.stepping),
            packing: ms(after.packing, before.packing),
            join: ms(after.join, before.join),
            write_back: ms(after.write_back, before.write_back),
        }
    }
}

/// How a case trains, besides its ops and dtype.
#[derive(Clone, Copy, Default)]
pub(super) struct Variant {
    /// Activation checkpointing of every block.
    pub(super) checkpointed: bool,
    /// ZeRO-Offload of the optimizer's side.
    pub(super) offload: Offload,
    /// Stage 3 (from the first step's end) instead of stage 2.
    pub(super) stage3: bool,
    /// Offloaded shards in pageable memory (not page-locked).
    pub(super) pageable: bool,
    /// The offload's host threads (0: rayon's global pool, every core).
    pub(super) offload_threads: usize,
    /// Offload's transfers on a stream of their own.
    pub(super) copy_stream: bool,
    /// Offload's write-back sends the f32 masters up (rounded on the
    /// device) instead of the weights rounded to bf16 on the host.
    pub(super) masters_up: bool,
    /// The Linear layers on Candle's GEMMs with the bias (and its
    /// gradient) in kernels of their own (`set_linear_cublaslt(false)`),
    /// instead of the default cuBLASLt GEMMs with them in the epilogues.
    pub(super) candle_gemm: bool,
    /// The case's buffers without cudarc's per-buffer events (two created
    /// with each allocation and destroyed with it; on this context, which
    /// has one stream, never recorded or waited on).
    pub(super) untracked: bool,
    /// The device's pool at CUDA's default release threshold (0: freed
    /// memory handed back at every synchronization) instead of the
    /// engine's, which keeps it.
    pub(super) released: bool,
}

/// Builds the GPT in `dtype` computing with `ops`, hooked to an
/// `NcclZeroOptimizer` as the trainer does, trains it `WARMUP + STEPS`
/// steps on `ids` and returns the median step's tokens/s and the pool's
/// high-water mark over the timed steps. Everything it built is dropped
/// and the device drained before it returns.
pub(super) fn ours(
    device: &Device,
    ctx: &CudaContext,
    pool: Option<&DevicePool>,
    ids: &Tensor,
    ops: GptOps,
    dtype: DType,
    variant: Variant,
) -> BenchResult<Measured> {
    // Process-wide: off for this case only (or off for every case, by
    // `ZERO_LINEAR_CUBLASLT=0`).
    let cublaslt = zero_candle::nn::linear_cublaslt();
    zero_candle::nn::set_linear_cublaslt(cublaslt && !variant.candle_gemm);
    if variant.untracked {
        // SAFETY: Candle's context here has one stream, its own (the
        // communicator's stream belongs to another `CudaContext` object),
        // so cudarc records and waits on no buffer's events either way;
        // the engine orders its streams with events of its own.
        unsafe { ctx.disable_event_tracking() };
    }
    let measured = (|| -> BenchResult<Measured> {
        // No gradient norm and no clipping: the PyTorch peer computes neither.
        let (model, mut opt) = hooked_gpt(
            device,
            CONFIG,
            dtype,
            NcclComm::single(0)?,
            EngineConfig::default()
                .with_stage(match variant.stage3 {
                    true => Stage::Parameters,
                    false => Stage::Gradients,
                })
                .with_offload(variant.offload, variant.offload_threads)
                .with_offload_pin_memory(!variant.pageable)
                .with_offload_copy_stream(variant.copy_stream)
                .with_gather_in_param_dtype(!variant.masters_up)
                // Offloaded, the host steps each bucket as it lands.
                .with_overlap(match variant.offload {
                    Offload::Optimizer => Overlap::Interleaved,
                    Offload::None => Overlap::default(),
                }),
        )?;
        let model = model.with_ops(ops).with_checkpointing(variant.checkpointed);
        if variant.released {
            let pool = pool.ok_or("the released case needs the device's memory pool")?;
            pool.set_release_threshold(0)?;
        }

        let mut times = Vec::with_capacity(STEPS);
        let mut issued = [(); 2].map(|()| Vec::with_capacity(STEPS));
        let mut offload_before = OffloadTimes::default();
        for step in 0..WARMUP + STEPS {
            if step == WARMUP {
                // As the peer does: the peak over the timed steps.
                synchronize(device, ctx)?;
                if let Some(pool) = pool {
                    pool.reset_high_water()?;
                }
                offload_before = opt.engine().counters().offload;
            }
            let started = Instant::now();
            let loss = model.loss(ids)?;
            let forward_issued = started.elapsed();
            if opt.backward_step(&loss)?.is_none() {
                return Err("backward_step did not complete a step at one micro-step".into());
            }
            let step_issued = started.elapsed();
            synchronize(device, ctx)?;
            if step >= WARMUP {
                times.push(started.elapsed().as_secs_f64());
                issued[0].push(forward_issued.as_secs_f64());
                issued[1].push(step_issued.as_secs_f64());
            }
        }
        let peak_bytes = pool.map(DevicePool::high_water).transpose()?;
        let median_ms = |times| crate::bench::median(times) * 1e3;
        let step_ms = median_ms(times);
        let numel = opt
            .vars()
            .iter()
            .map(|v| v.elem_count())
            .sum::<usize>()
            .max(1) as f64;
        let memory = opt.memory_report();
        Ok(Measured {
            tokens_per_s: (ids.dim(0)? * CONFIG.context) as f64 / (step_ms / 1e3),
            peak_bytes,
            engine_device_bytes_per_param: memory.on_device() as f64 / numel,
            engine_host_bytes_per_param: memory.offloaded as f64 / numel,
            step_ms,
            issued_ms: issued.map(median_ms),
            offload_ms: OffloadMs::between(offload_before, opt.engine().counters().offload),
        })
    })();
    zero_candle::nn::set_linear_cublaslt(cublaslt);
    if let (true, Some(pool)) = (variant.released, pool) {
        pool.retain_freed()?;
    }
    if variant.untracked {
        // SAFETY: restores the default for the buffers of the cases after.
        unsafe { ctx.enable_event_tracking() };
    }
    let measured = measured?;
    // The case's model, optimizer and communicator are dropped; their
    // asynchronous frees complete before the next case is built.
    synchronize(device, ctx)?;
    if let Some(pool) = pool {
        pool.reset_high_water()?;
    }
    Ok(measured)
}
