//! The GPT on ranks sharing the GPU (`--backend cuda-threads`) at stages 0,
//! 2 and 3: each rank's device bytes per parameter and the step times.

use super::{
    hooked_gpt, random_ids, synchronize, BenchResult, BATCH, CONFIG, SHARED_RANKS, STEPS, WARMUP,
};
use crate::bench::Report;
use crate::trainer::GptOps;
use candle_core::{DType, Device};
use std::time::Instant;
use zero_core::engine::{EngineConfig, Stage};
use zero_core::Communicator;
use zero_nccl::cudarc::driver::CudaContext;
use zero_nccl::{CudaThreadGroup, DeviceComm, DevicePool};

/// The f32 GPT at stages 0, 2 and 3 on [`SHARED_RANKS`] ranks sharing the
/// GPU (the global batch of [`BATCH`] split between them): each rank's
/// engine device bytes per parameter (its memory report, the model's
/// weights included, and at stage 3 the gather buffers; at stage 3 also
/// two of its parts: the communication buffers, and the most gathered
/// bytes alive at once), the pool's peak
/// per rank (at stage 3 it includes the first step, on whole weights),
/// stage 2's and 3's step times over stage 0's and 2's, and stage 2's
/// without cudarc's event tracking over with it.
pub(super) fn shared_gpu(
    report: &mut Report,
    device: &Device,
    ctx: &CudaContext,
    pool: Option<&DevicePool>,
) {
    let mut step_s = Vec::new();
    for (stage, name, goal) in [
        (Stage::Ddp, "s0", "<= 17"),
        (Stage::Gradients, "s2", "<= 8"),
        (Stage::Parameters, "s3", "<= 5"),
    ] {
        let measured = ranks_sharing(device, ctx, pool, stage, false);
        let (rank0, peak) = match measured {
            Ok(m) => m,
            Err(e) => {
                let what = format!("gpu gpt benchmark: {SHARED_RANKS} ranks at {stage:?}");
                report.failed(&what, e);
                return;
            }
        };
        let n = SHARED_RANKS;
        report.add(
            &format!("gpu.gpt_f32_n{n}_{name}_engine_bytes_per_param_rank"),
            rank0.per_param(rank0.engine_bytes),
            "B/param",
            Some(goal),
        );
        if stage == Stage::Parameters {
            let parts = [
                ("comm", rank0.comm_bytes),
                ("gather_peak", rank0.gathered_peak),
            ];
            for (part, bytes) in parts {
                report.add(
                    &format!("gpu.gpt_f32_n{n}_s3_{part}_bytes_per_param_rank"),
                    rank0.per_param(bytes),
                    "B/param",
                    None,
                );
            }
        }
        if let Some(peak) = peak {
            report.add(
                &format!("gpu.gpt_f32_n{n}_{name}_peak_bytes_per_param_rank"),
                rank0.per_param(peak as usize) / n as f64,
                "B/param",
                None,
            );
        }
        step_s.push(rank0.slowest_step_s);
    }
    // Each rank's Candle stream puts its context in cudarc's multi-stream
    // mode: every buffer a kernel touches is waited on and recorded. What
    // that costs stage 2's step, against the same ranks without it.
    match ranks_sharing(device, ctx, pool, Stage::Gradients, true) {
        Ok((rank0, _)) => report.add(
            &format!("gpu.gpt_f32_n{SHARED_RANKS}_s2_untracked_step_over_tracked"),
            rank0.slowest_step_s / step_s[1],
            "ratio",
            None,
        ),
        Err(e) => report.failed(
            &format!("gpu gpt benchmark: {SHARED_RANKS} ranks untracked"),
            e,
        ),
    }
    report.add(
        &format!("gpu.gpt_f32_n{SHARED_RANKS}_s2_step_over_s0"),
        step_s[1] / step_s[0],
        "ratio",
        None,
    );
    report.add(
        &format!("gpu.gpt_f32_n{SHARED_RANKS}_s3_step_over_s2"),
        step_s[2] / step_s[1],
        "ratio",
        None,
    );
}

/// A rank's figures of one [`shared_gpu`] case.
struct SharedFigures {
    /// Its median step; in what [`ranks_sharing`] returns (rank 0's
    /// figures), the slowest rank's.
    slowest_step_s: f64,
    /// The engine's device bytes (its memory report).
    engine_bytes: usize,
    /// Of them, the communication buffers (at stage 3 the gathers' too).
    comm_bytes: usize,
    /// Stage 3: the most gathered bytes alive at once.
    gathered_peak: usize,
    /// The model's parameters.
    numel: usize,
}

impl SharedFigures {
    fn per_param(&self, bytes: usize) -> f64 {
        bytes as f64 / self.numel.max(1) as f64
    }
}

fn ranks_sharing(
    device: &Device,
    ctx: &CudaContext,
    pool: Option<&DevicePool>,
    stage: Stage,
    untracked: bool,
) -> BenchResult<(SharedFigures, Option<u64>)> {
    // The peak covers the warm-up steps too (the pool is not shared with
    // the rank threads); the first step's peak is the steady one's.
    synchronize(device, ctx)?;
    if let Some(pool) = pool {
        pool.reset_high_water()?;
    }
    let results = CudaThreadGroup::new(SHARED_RANKS).run(|comm| {
        let rank = comm.rank();
        let trained = (|| -> BenchResult<SharedFigures> {
            let device = Device::new_cuda_with_stream(comm.context().ordinal())?;
            if let (true, Device::Cuda(cuda)) = (untracked, &device) {
                // SAFETY: before any buffer of this rank's Candle context
                // exists; the context has one stream, Candle's, and the
                // engine orders it with the communicator's streams (another
                // `CudaContext` object) by events of its own.
                unsafe { cuda.disable_event_tracking() };
            }
            let ids = random_ids(&device, BATCH / SHARED_RANKS)?;
            let (model, mut opt) = hooked_gpt(
                &device,
                CONFIG,
                DType::F32,
                comm,
                EngineConfig::default().with_stage(stage),
            )?;
            let model = model.with_ops(GptOps::Fused);
            let mut times = Vec::with_capacity(STEPS);
            for step in 0..WARMUP + STEPS {
                if step == WARMUP {
                    device.synchronize()?;
                    opt.engine().comm().barrier()?;
                }
                let started = Instant::now();
                let loss = model.loss(&ids)?;
                opt.backward_step(&loss)?;
                device.synchronize()?;
                if step >= WARMUP {
                    times.push(started.elapsed().as_secs_f64());
                }
            }
            times.sort_by(f64::total_cmp);
            let report = opt.memory_report();
            Ok(SharedFigures {
                slowest_step_s: times[times.len() / 2],
                engine_bytes: report.on_device(),
                comm_bytes: report.comm_buffers,
                gathered_peak: opt.fetch_stats().map_or(0, |s| s.peak_live_bytes),
                numel: opt.vars().iter().map(|v| v.elem_count()).sum(),
            })
        })();
        Ok(trained.map_err(|e| format!("rank {rank}: {e}")))
    })?;
    let mut figures = Vec::new();
    for result in results {
        figures.push(result?.map_err(|e| -> Box<dyn std::error::Error> { e.into() })?);
    }
    synchronize(device, ctx)?;
    let peak = pool.map(DevicePool::high_water).transpose()?;
    if let Some(pool) = pool {
        pool.reset_high_water()?;
    }
    let slowest = figures.iter().map(|f| f.slowest_step_s).fold(0.0, f64::max);
    let mut rank0 = figures.swap_remove(0);
    rank0.slowest_step_s = slowest;
    Ok((rank0, peak))
}
