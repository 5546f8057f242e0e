//! Background checkpoint saves on the GPU (`bench gpu-checkpoint`): the
//! time a step of the GPT 12 x 768 (f32, one rank on NCCL, stages 2 and 3)
//! is blocked by a save, in the background over blocking, measured as
//! `bench checkpoint` measures the MLP on the host (`timed_saves`): the
//! snapshot copies the optimizer state and the weights from the device into
//! host memory, and a thread writes them while the steps go on.

use super::{hooked_gpt, open_device, random_ids, synchronize, BenchResult, BATCH, CONFIG};
use crate::bench::checkpoint::{report_saves, timed_saves, Measured, Save, Schedule};
use crate::bench::Report;
use candle_core::{DType, Device};
use std::sync::Arc;
use zero_candle::NcclZeroOptimizer;
use zero_core::engine::{EngineConfig, Stage};
use zero_nccl::cudarc::driver::CudaContext;
use zero_nccl::NcclComm;

/// As the host's figure: four saves, six steps apart.
const SCHEDULE: Schedule = Schedule {
    steps: 26,
    every: 6,
};

/// `bench gpu-checkpoint` (not part of `bench gpu`: it writes about 6 GB
/// of checkpoints into the temporary directory).
pub fn saves(report: &mut Report) {
    if let Err(e) = saves_run(report) {
        report.failed("gpu checkpoint benchmark", e);
    }
}

fn saves_run(report: &mut Report) -> BenchResult<()> {
    let (device, ctx) = open_device()?;
    println!(
        "bench gpu-checkpoint: {}; GPT {CONFIG:?} f32, {BATCH} sequences, one rank on NCCL, \
         {} steps saving every {} before the last: time blocked per save",
        ctx.name().unwrap_or_default(),
        SCHEDULE.steps,
        SCHEDULE.every
    );
    for (stage, name) in [(Stage::Gradients, "s2"), (Stage::Parameters, "s3")] {
        // A stage that fails leaves the other's figures.
        let blocking = run_case(&device, &ctx, stage, Save::Blocking);
        let background = blocking
            .and_then(|blocking| Ok((blocking, run_case(&device, &ctx, stage, Save::Background)?)));
        let figure = format!("gpu.gpt_{name}_checkpoint");
        match background {
            Ok((blocking, background)) => report_saves(report, &figure, &blocking, &background),
            Err(e) => report.failed(&figure, e),
        }
    }
    Ok(())
}

/// Trains the GPT at `stage`, saving as `save` says into a temporary
/// directory removed after; everything it built is dropped and the device
/// drained before it returns.
fn run_case(
    device: &Device,
    ctx: &Arc<CudaContext>,
    stage: Stage,
    save: Save,
) -> BenchResult<Measured> {
    let root = std::env::temp_dir().join(format!(
        "zero-bench-gpu-checkpoint-{}-{}",
        std::process::id(),
        stage.number()
    ));
    let measured = (|| -> BenchResult<Measured> {
        let ids = random_ids(device, BATCH)?;
        let (model, mut opt) = hooked_gpt(
            device,
            CONFIG,
            DType::F32,
            NcclComm::single(0)?,
            EngineConfig::default().with_stage(stage),
        )?;
        let sync = || synchronize(device, ctx).map_err(|e| e.to_string());
        let step = |opt: &mut NcclZeroOptimizer| {
            let loss = model.loss(&ids).map_err(|e| e.to_string())?;
            opt.backward_step(&loss).map_err(|e| e.to_string())?;
            sync()
        };
        Ok(timed_saves(&mut opt, save, &root, SCHEDULE, step, sync)?)
    })();
    // Best effort: what is left in the temporary directory wastes space.
    let _ = std::fs::remove_dir_all(&root);
    synchronize(device, ctx)?;
    measured
}
