//! The headline of stage 3 on the GPU (`bench gpu-headline`): a GPT that
//! does not fit the device at stage 0 trains at stage 3.

use super::{
    layers_within, open_device, random_ids, wide_gpt, BenchResult, LR, SEED, SHARED_RANKS,
};
use crate::bench::Report;
use crate::trainer::{Gpt, GptConfig};
use candle_core::{DType, Device};
use std::sync::Arc;
use std::time::Instant;
use zero_candle::nn::GradHook;
use zero_candle::{ZeroHook, ZeroOptimizer};
use zero_core::engine::{EngineConfig, Stage};
use zero_core::optim::{AdamW, AdamWConfig};
use zero_core::Communicator;
use zero_nccl::{CudaThreadComm, CudaThreadGroup, DeviceComm, DevicePool};

/// The headline of stage 3 on the GPU (`bench gpu-headline`, not part of
/// `bench gpu`: building the model takes a while): a GPT that does not fit
/// the device at stage 0 with [`SHARED_RANKS`] ranks sharing it trains at
/// stage 3.
///
/// The size is chosen from the device's free memory `F`: d_model 2048, 16
/// heads, context 256, and the most layers whose f32 AdamW training state
/// (16 bytes per parameter: weights, gradients, two moments) is at most
/// `F / 2.5`. At stage 0 every rank holds all of it, `4 x 16 Ψ >= 1.6 F`:
/// it cannot fit; at stage 3 the ranks hold it once between them, leaving
/// the rest for the gathers and activations. A `ShardedVarMap` defers the
/// large weights: each rank computes each on the host in turn, uploads it
/// and keeps its pieces, so the device never holds the whole model. Each
/// rank trains on one sequence for three steps.
pub fn headline(report: &mut Report) {
    if let Err(e) = headline_run(report) {
        report.failed("gpu headline benchmark", e);
    }
}

fn headline_run(report: &mut Report) -> BenchResult<()> {
    const STATE_BYTES: usize = 16;
    let (_, ctx) = open_device()?;
    let (free, total) = ctx.mem_get_info()?;
    let config = wide_gpt(0);
    let config = GptConfig {
        layers: layers_within(config, (free as f64 / 2.5) as usize / STATE_BYTES),
        ..config
    };
    if config.layers == 0 {
        return Err(format!("{free} free bytes leave no room for one layer").into());
    }
    let params = config.num_params();
    let stage0_bytes = SHARED_RANKS * STATE_BYTES * params;
    println!(
        "bench gpu-headline: {} ({:.1} of {:.1} GB free); GPT {config:?}, {:.2}B parameters: \
         stage 0 on {SHARED_RANKS} ranks needs {:.1} GB of training state, stage 3 {:.1} GB",
        ctx.name().unwrap_or_default(),
        free as f64 / 1e9,
        total as f64 / 1e9,
        params as f64 / 1e9,
        stage0_bytes as f64 / 1e9,
        (STATE_BYTES * params) as f64 / 1e9,
    );
    let pool = DevicePool::of(&ctx).ok();
    if let Some(pool) = &pool {
        pool.reset_high_water()?;
    }
    let started = Instant::now();
    let results = CudaThreadGroup::new(SHARED_RANKS).run(|comm| {
        let rank = comm.rank();
        let trained = (|| -> BenchResult<(f64, f32)> {
            let device = Device::new_cuda_with_stream(comm.context().ordinal())?;
            let config_engine = EngineConfig::default().with_stage(Stage::Parameters);
            let map = zero_candle::ShardedVarMap::seeded(SEED);
            let hook = ZeroHook::<CudaThreadComm, f32>::new();
            let model = Gpt::build(
                &map,
                config,
                &device,
                Some(hook.clone() as Arc<dyn GradHook>),
                DType::F32,
            )?;
            let mut opt = ZeroOptimizer::<CudaThreadComm, f32>::new_sharded(
                &map,
                comm,
                config_engine,
                Box::new(AdamW::new(AdamWConfig::default().with_lr(LR))?),
                &hook,
            )?;
            let ids = random_ids(&device, 1)?;
            let mut step_s = 0.0;
            let mut loss_value = f32::NAN;
            for _ in 0..3 {
                let started = Instant::now();
                let loss = model.loss(&ids)?;
                opt.backward_step(&loss)?;
                // Read once the step is queued, as `train` does.
                loss_value = loss.to_scalar::<f32>()?;
                device.synchronize()?;
                step_s = started.elapsed().as_secs_f64();
            }
            Ok((step_s, loss_value))
        })();
        Ok(trained.map_err(|e| format!("rank {rank}: {e}")))
    })?;
    let mut figures = Vec::new();
    for result in results {
        figures.push(result?.map_err(|e| -> Box<dyn std::error::Error> { e.into() })?);
    }
    let (step_s, loss) = figures[0];
    if !loss.is_finite() {
        return Err(format!("the loss is {loss}").into());
    }
    println!(
        "bench gpu-headline: trained 3 steps in {:.1} s (the last {step_s:.2} s), loss {loss:.4}",
        started.elapsed().as_secs_f64()
    );
    report.add("gpu.s3_headline_params_b", params as f64 / 1e9, "B", None);
    report.add(
        "gpu.s3_headline_s0_state_over_device",
        stage0_bytes as f64 / total as f64,
        "ratio",
        Some("> 1 (does not fit at stage 0)"),
    );
    if let Some(pool) = &pool {
        report.add(
            "gpu.s3_headline_peak_over_device",
            pool.high_water()? as f64 / total as f64,
            "ratio",
            Some("< 1 (trains at stage 3)"),
        );
    }
    report.add("gpu.s3_headline_step_s", step_s, "s", None);
    Ok(())
}
