//! The largest GPT one GPU trains, with offload and without
//! (`bench gpu-largest`), each size tried in a process of its own.

use super::{hooked_gpt, layers_within, open_device, synchronize, wide_gpt, BenchResult, SEED};
use crate::bench::{largest, Report};
use crate::trainer::GptConfig;
use candle_core::{DType, Tensor};
use rand::{rngs::StdRng, Rng, SeedableRng};
use std::time::Instant;
use zero_core::engine::{host_available_bytes, EngineConfig, Offload, Overlap, Stage};
use zero_nccl::cudarc::driver::CudaContext;
use zero_nccl::NcclComm;

/// The argument `bench gpu-largest` passes a trial for each mode.
const TRIAL_MODES: [(&str, Offload); 2] =
    [("plain", Offload::None), ("offload", Offload::Optimizer)];

/// Sizes `bench gpu-largest` tries per mode (`BENCH_LARGEST_TRIALS`
/// overrides it), and how long each may take.
const LARGEST_TRIALS: usize = 6;
const TRIAL_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(300);

/// `bench gpu-largest` (not part of `bench gpu`: each size is built and
/// trained in a process of its own, minutes in all): the largest bf16 GPT
/// of [`wide_gpt`]'s shape, growing layers, that trains two steps on one
/// GPU at stage 2 (AdamW with f32 masters, one sequence per step) without
/// offload and with `--offload optimizer`, found by trying sizes
/// ([`largest::largest_that_trains`], a child process per size: a size
/// that does not fit may end in the host's OOM killer), starting from a
/// guess of 20 device bytes per parameter without offload and, with it,
/// the fewer of 2.5 device bytes and 17 host bytes per parameter. Prints
/// each mode's largest size and the ratio of their parameters (goal: >=
/// 5). `BENCH_LARGEST_MODES=plain` (or `offload`) runs one mode only.
pub fn largest(report: &mut Report) {
    if let Err(e) = largest_run(report) {
        report.failed("gpu largest benchmark", e);
    }
}

fn largest_run(report: &mut Report) -> BenchResult<()> {
    // A bare context (no Candle device, no libraries' handles), released
    // before the trials so that they find the device as it was.
    let ctx = CudaContext::new(0)?;
    let (free, total) = ctx.mem_get_info()?;
    let host = host_available_bytes().unwrap_or(0);
    let name = ctx.name().unwrap_or_default();
    drop(ctx);
    println!(
        "bench gpu-largest: {name} ({:.1} of {:.1} GB free), {:.1} GB of host memory available; \
         {:?} growing layers, bf16, stage 2, AdamW, one sequence per step",
        free as f64 / 1e9,
        total as f64 / 1e9,
        host as f64 / 1e9,
        wide_gpt(0),
    );
    let exe = std::env::current_exe()?;
    // Each mode can run in a call of its own (the offloaded sizes take
    // minutes each): `BENCH_LARGEST_MODES=plain` or `=offload`.
    let modes = std::env::var("BENCH_LARGEST_MODES").unwrap_or_else(|_| "plain,offload".into());
    let trials = match std::env::var("BENCH_LARGEST_TRIALS") {
        Ok(n) => n
            .parse::<usize>()
            .map_err(|e| format!("BENCH_LARGEST_TRIALS={n:?}: {e}"))?,
        Err(_) => LARGEST_TRIALS,
    };
    let mut largest_params = Vec::new();
    for (mode, offload) in TRIAL_MODES {
        if !modes.split(',').any(|m| m.trim() == mode) {
            continue;
        }
        let budget = match offload {
            Offload::None => free as f64 / 20.0,
            Offload::Optimizer => (free as f64 / 2.5).min(host as f64 / 17.0),
        };
        let guess = layers_within(wide_gpt(0), budget as usize).max(1);
        let search = largest::largest_that_trains(guess, trials, |layers| {
            let started = Instant::now();
            let args = [
                "gpu-largest-trial".to_string(),
                layers.to_string(),
                mode.to_string(),
            ];
            let outcome = largest::run_trial(&exe, &args, TRIAL_TIMEOUT);
            println!(
                "bench gpu-largest: {mode}, {layers} layers ({:.2}B parameters): {} ({:.0} s)",
                wide_gpt(layers).num_params() as f64 / 1e9,
                match &outcome {
                    largest::Outcome::Trained => "trained".to_string(),
                    largest::Outcome::Failed(why) => format!("did not train: {why}"),
                },
                started.elapsed().as_secs_f64()
            );
            outcome
        });
        match search.smallest_failed() {
            Some((layers, why)) => println!(
                "bench gpu-largest: {mode}: the smallest size that did not train: {layers} \
                 layers ({why})"
            ),
            None => println!(
                "bench gpu-largest: {mode}: every size tried trained (a lower bound: \
                 {trials} sizes at most)"
            ),
        }
        let Some(layers) = search.largest() else {
            println!("bench gpu-largest: {mode}: no size trained");
            return Ok(());
        };
        let params = wide_gpt(layers).num_params() as f64;
        report.add(
            &format!("gpu.largest_{mode}_layers"),
            layers as f64,
            "layers",
            None,
        );
        report.add(
            &format!("gpu.largest_{mode}_params_b"),
            params / 1e9,
            "B",
            None,
        );
        largest_params.push((mode, params));
    }
    if let [("plain", plain), ("offload", offloaded)] = largest_params[..] {
        report.add(
            "gpu.offload_largest_over_plain",
            offloaded / plain,
            "ratio",
            Some(">= 5"),
        );
    }
    Ok(())
}

/// One size of `bench gpu-largest`, in its own process (`bench
/// gpu-largest-trial LAYERS plain|offload`): builds the GPT and trains it
/// two steps; the exit code says whether it did (0), and the last line of
/// error output why not.
pub fn largest_trial(args: &[String]) -> i32 {
    let parsed = match args {
        [layers, mode] => layers
            .parse::<usize>()
            .ok()
            .filter(|&l| l > 0)
            .zip(TRIAL_MODES.iter().find(|(m, _)| m == mode).map(|(_, o)| *o)),
        _ => None,
    };
    let Some((layers, offload)) = parsed else {
        eprintln!("usage: bench gpu-largest-trial LAYERS plain|offload (LAYERS >= 1)");
        return 2;
    };
    match trial(wide_gpt(layers), offload) {
        Ok(loss) => {
            println!("trained {layers} layers, loss {loss:.4}");
            0
        }
        Err(e) => {
            eprintln!("{e}");
            1
        }
    }
}

/// Trains `config` in bf16 two steps on one sequence ([`largest_trial`]);
/// returns the last loss.
fn trial(config: GptConfig, offload: Offload) -> BenchResult<f32> {
    let (device, ctx) = open_device()?;
    let (model, mut opt) = hooked_gpt(
        &device,
        config,
        DType::BF16,
        NcclComm::single(0)?,
        EngineConfig::default()
            .with_stage(Stage::Gradients)
            .with_offload(offload, 0)
            .with_overlap(match offload {
                Offload::Optimizer => Overlap::Interleaved,
                Offload::None => Overlap::default(),
            }),
    )?;
    let mut rng = StdRng::seed_from_u64(SEED);
    let ids: Vec<u32> = (0..config.context + 1)
        .map(|_| rng.gen_range(0..256))
        .collect();
    let ids = Tensor::from_vec(ids, (1, config.context + 1), &device)?;
    let mut last = f32::NAN;
    for _ in 0..2 {
        let loss = model.loss(&ids)?;
        if opt.backward_step(&loss)?.is_none() {
            return Err("backward_step did not complete a step at one micro-step".into());
        }
        // Read once the step is queued, as `train` does.
        last = loss.to_dtype(DType::F32)?.to_scalar::<f32>()?;
    }
    synchronize(&device, &ctx)?;
    if !last.is_finite() {
        return Err(format!("the loss is {last}").into());
    }
    Ok(last)
}
