//! `bench stage3`: stage 3 against stage 2 on the same hooked MLP, side by
//! side in one run: the step time at N=2 threads (plain, and over a
//! [`Delayed`] link where gathers cost what a network would), and the
//! process's peak heap at N=4 (MLP 1024-4x2048-10, AdamW).
//!
//! Both stages build the model through a `ShardedVarMap` (stage 3 sharded
//! from the start: no rank ever holds it whole). The time is the median of
//! the steps after the first; the memory is the peak after every rank has
//! finished its first step, with the whole run's peak beside it.

use super::Report;
use crate::heap;
use crate::trainer::Mlp;
use candle_core::Device;
use rand::SeedableRng;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use zero_candle::nn::GradHook;
use zero_candle::{ShardedVarMap, ZeroHook, ZeroOptimizer};
use zero_core::comm::{Delayed, Host};
use zero_core::engine::{EngineConfig, Stage};
use zero_core::optim::{AdamW, AdamWConfig};
use zero_core::{Communicator, ThreadGroup};

/// The step figure's model: the overlap benchmark's MLP (1M-element
/// weights, sharded; biases persist).
const STEP_WORLD: usize = 2;
const STEP_WIDTHS: [usize; 5] = [784, 1024, 1024, 1024, 10];
const STEP_BATCH: usize = 64;
const WARMUP: usize = 3;
const STEPS: usize = 12;
const ROUNDS: usize = 3;
/// The memory figure's model: 14.7M f32 parameters.
const MEMORY_WORLD: usize = 4;
const MEMORY_WIDTHS: [usize; 6] = [1024, 2048, 2048, 2048, 2048, 10];
/// A deeper model of about the same size (17M), where one gathered layer
/// is 1/16 of the weights rather than 2/7.
const DEEP_WIDTHS: [usize; 18] = [
    1024, 1024, 1024, 1024, 1024, 1024, 1024, 1024, 1024, 1024, 1024, 1024, 1024, 1024, 1024, 1024,
    1024, 10,
];
const MEMORY_BATCH: usize = 8;
const MEMORY_STEPS: usize = 4;
/// The simulated link of `bench overlap`: 50 µs per collective, 1 GB/s.
const LATENCY: Duration = Duration::from_micros(50);
const BYTES_PER_SEC: f64 = 1e9;

/// The process's peak heap over the first step (memory runs), read by rank
/// 0 before it starts counting the steady state.
static FIRST_STEP_PEAK: AtomicUsize = AtomicUsize::new(0);

/// What one rank measures: the median step time and what `sent` counted
/// per step over the timed steps (`bench hybrid`: bytes over a slow link),
/// and (`memory`) the peak heap from its second step on.
pub(super) fn train<C>(
    comm: C,
    config: EngineConfig,
    (widths, batch, steps): (&[usize], usize, usize),
    memory: bool,
    sent: impl Fn(&C) -> u64,
) -> Result<(f64, f64), String>
where
    C: Communicator<Memory = Host> + 'static,
{
    let rank = comm.rank();
    // Stage 3 builds sharded from the start (each rank only its shard).
    let map = ShardedVarMap::seeded(0);
    let hook = ZeroHook::<C, f32>::new();
    let model = Mlp::build(
        &map,
        widths,
        &Device::Cpu,
        Some(hook.clone() as Arc<dyn GradHook>),
        candle_core::DType::F32,
    )
    .map_err(|e| e.to_string())?;
    let adamw = AdamW::new(AdamWConfig::default().with_lr(1e-3)).map_err(|e| e.to_string())?;
    let mut opt = ZeroOptimizer::<C, f32>::new_sharded(&map, comm, config, Box::new(adamw), &hook)
        .map_err(|e| e.to_string())?;
    let mut rng = rand::rngs::StdRng::seed_from_u64(rank as u64);
    let mut times = Vec::with_capacity(steps);
    let mut counted = (0, 0);
    for step in 0..steps {
        if memory && step == 1 {
            // Every rank has sharded (stage 3): the steady state starts.
            let barrier = || opt.engine().comm().barrier().map_err(|e| e.to_string());
            barrier()?;
            if rank == 0 {
                if let Some(peak) = heap::peak_bytes() {
                    FIRST_STEP_PEAK.store(peak, Ordering::Relaxed);
                }
                heap::reset_peak();
            }
            barrier()?;
        }
        let started = Instant::now();
        let (x, y) = super::random_batch(
            &mut rng,
            batch,
            widths[0],
            *widths.last().unwrap_or(&1) as i64,
        )
        .map_err(|e| e.to_string())?;
        let loss = model
            .forward(&x)
            .and_then(|logits| candle_nn::loss::cross_entropy(&logits, &y))
            .map_err(|e| e.to_string())?;
        let before = sent(opt.engine().comm());
        opt.backward_step(&loss).map_err(|e| e.to_string())?;
        if step >= WARMUP.min(steps - 1) {
            times.push(started.elapsed().as_secs_f64());
            counted.0 += sent(opt.engine().comm()) - before;
            counted.1 += 1;
        }
    }
    times.sort_by(f64::total_cmp);
    Ok((times[times.len() / 2], counted.0 as f64 / counted.1 as f64))
}

/// Rank 0's median step time at `STEP_WORLD` threads.
fn step_time(stage: Stage, delayed: bool) -> Result<f64, String> {
    let results = ThreadGroup::new(STEP_WORLD).run(|comm| {
        let steps = WARMUP + STEPS;
        let config = EngineConfig::default().with_stage(stage);
        let model = (&STEP_WIDTHS[..], STEP_BATCH, steps);
        if delayed {
            let comm = Delayed::new(comm, LATENCY, BYTES_PER_SEC);
            train(comm, config, model, false, |_| 0)
        } else {
            train(comm, config, model, false, |_| 0)
        }
    });
    match results.into_iter().next() {
        Some(Ok(r)) => r.map(|(median, _)| median),
        Some(Err(e)) => Err(e.to_string()),
        None => Err("no rank ran".into()),
    }
}

/// The process's peak heap above its baseline: (from the second step on,
/// over the whole run).
fn peaks(stage: Stage, widths: &[usize]) -> Result<(usize, usize), String> {
    heap::reset_peak();
    let baseline = heap::current_bytes().ok_or("the counting allocator is not installed")?;
    FIRST_STEP_PEAK.store(0, Ordering::Relaxed);
    let results = ThreadGroup::new(MEMORY_WORLD).run(|comm| {
        let config = EngineConfig::default().with_stage(stage);
        train(
            comm,
            config,
            (widths, MEMORY_BATCH, MEMORY_STEPS),
            true,
            |_| 0,
        )
    });
    for result in results {
        result.map_err(|e| e.to_string())??;
    }
    let steady = heap::peak_bytes().ok_or("the counting allocator is not installed")?;
    let run_peak = steady.max(FIRST_STEP_PEAK.load(Ordering::Relaxed));
    Ok((
        steady.saturating_sub(baseline),
        run_peak.saturating_sub(baseline),
    ))
}

/// Adds `step.s3_over_s2`, `step.delayed_s3_over_s2`,
/// `memory.s3_peak_over_s2_peak` and the same for a deeper model.
pub fn run(report: &mut Report) {
    println!(
        "bench stage3: MLP {STEP_WIDTHS:?} with ZeroHook, AdamW, {STEP_BATCH} rows per rank, \
         N={STEP_WORLD} threads, default buckets and persistence (100k elements), plain and \
         over a delayed link ({} us + {} GB/s); median of {STEPS} steps after {WARMUP}, \
         rounds interleaved. Memory: MLP {MEMORY_WIDTHS:?} (and deep_: 16 hidden layers of 1024), \
         N={MEMORY_WORLD}, {MEMORY_BATCH} rows per rank, process peak heap from the second step \
         on",
        LATENCY.as_micros(),
        BYTES_PER_SEC / 1e9
    );
    let cases = [
        ("s2", Stage::Gradients, false),
        ("s3", Stage::Parameters, false),
        ("delayed_s2", Stage::Gradients, true),
        ("delayed_s3", Stage::Parameters, true),
    ];
    let names: Vec<&str> = cases.iter().map(|c| c.0).collect();
    let medians =
        match super::interleaved_medians(&names, ROUNDS, |i| step_time(cases[i].1, cases[i].2)) {
            Ok(medians) => medians,
            Err(e) => {
                eprintln!("bench stage3: {e}");
                return;
            }
        };
    for ((name, _, _), median) in cases.iter().zip(&medians) {
        report.add(&format!("step.{name}_ms"), median * 1e3, "ms", None);
    }
    report.add(
        "step.s3_over_s2",
        medians[1] / medians[0],
        "ratio",
        Some("<= 1.10"),
    );
    report.add(
        "step.delayed_s3_over_s2",
        medians[3] / medians[2],
        "ratio",
        Some("<= 1.10"),
    );

    // Stages 0 and 1 on the same model and harness, for the README's table.
    let params: usize = MEMORY_WIDTHS.windows(2).map(|w| w[0] * w[1] + w[1]).sum();
    for (name, stage) in [("s0", Stage::Ddp), ("s1", Stage::OptimizerState)] {
        match peaks(stage, &MEMORY_WIDTHS) {
            Ok((steady, _)) => report.add(
                &format!("memory.{name}_steady_bytes_per_param"),
                steady as f64 / MEMORY_WORLD as f64 / params as f64,
                "B/param/rank",
                None,
            ),
            Err(e) => eprintln!("bench stage3: memory {name} failed: {e}"),
        }
    }
    for (prefix, widths) in [("", &MEMORY_WIDTHS[..]), ("deep_", &DEEP_WIDTHS[..])] {
        let params: usize = widths.windows(2).map(|w| w[0] * w[1] + w[1]).sum();
        let per_param = |bytes: usize| bytes as f64 / MEMORY_WORLD as f64 / params as f64;
        match (
            peaks(Stage::Gradients, widths),
            peaks(Stage::Parameters, widths),
        ) {
            (Ok((s2, s2_run)), Ok((s3, s3_run))) => {
                let unit = "B/param/rank";
                report.add(
                    &format!("memory.{prefix}s2_steady_bytes_per_param"),
                    per_param(s2),
                    unit,
                    None,
                );
                report.add(
                    &format!("memory.{prefix}s3_steady_bytes_per_param"),
                    per_param(s3),
                    unit,
                    None,
                );
                report.add(
                    &format!("memory.{prefix}s3_peak_over_s2_peak"),
                    s3 as f64 / s2 as f64,
                    "ratio",
                    Some("<= 0.65"),
                );
                report.add(
                    &format!("memory.{prefix}s3_run_peak_over_s2_run_peak"),
                    s3_run as f64 / s2_run as f64,
                    "ratio",
                    None,
                );
            }
            (Err(e), _) | (_, Err(e)) => eprintln!("bench stage3: memory failed: {e}"),
        }
    }
}
