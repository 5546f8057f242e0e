//! `bench overlap`: the trainer's MLP with its `ZeroHook`, stage 2 at N=2
//! threads, stepped with every overlap schedule in one run, over the thread
//! backend as it is and over a [`Delayed`] link (where communication costs
//! what a network would, so hiding it behind backward shows).

use super::Report;
use crate::trainer::{Dataset, Mlp};
use candle_core::{Device, Tensor};
use candle_nn::VarMap;
use std::sync::Arc;
use std::time::{Duration, Instant};
use zero_candle::{ZeroHook, ZeroOptimizer};
use zero_core::comm::{Delayed, Host};
use zero_core::engine::{EngineConfig, Overlap, Stage};
use zero_core::optim::{AdamW, AdamWConfig};
use zero_core::{Communicator, ThreadGroup};

const WORLD_SIZE: usize = 2;
const HIDDEN: [usize; 3] = [1024, 1024, 1024];
const BATCH: usize = 64;
const WARMUP: usize = 3;
const STEPS: usize = 15;
const ROUNDS: usize = 3;
const BUCKET_BYTES: usize = 512 << 10;
/// The simulated link: 50 µs per collective, 1 GB/s.
const LATENCY: Duration = Duration::from_micros(50);
const BYTES_PER_SEC: f64 = 1e9;

/// Median step time (forward, `backward_step`) on rank 0.
fn measure<C>(comm: C, overlap: Overlap, data: &Dataset) -> Result<f64, String>
where
    C: Communicator<Memory = Host> + 'static,
{
    let rank = comm.rank();
    let varmap = VarMap::new();
    let mut widths = vec![data.width];
    widths.extend(HIDDEN);
    widths.push(data.classes);
    let hook = ZeroHook::<C, f32>::new();
    let model = Mlp::with_hook(
        &varmap,
        &widths,
        0,
        &Device::Cpu,
        Some(hook.clone() as Arc<dyn zero_candle::nn::GradHook>),
    )
    .map_err(|e| e.to_string())?;
    let adamw = AdamW::new(AdamWConfig::default().with_lr(1e-3)).map_err(|e| e.to_string())?;
    let config = EngineConfig::default()
        .with_stage(Stage::Gradients)
        .with_bucket_bytes(BUCKET_BYTES)
        .with_overlap(overlap);
    let mut opt = ZeroOptimizer::<C, f32>::new(&varmap, comm, config, Box::new(adamw))
        .and_then(|o| o.with_hook(&hook))
        .map_err(|e| e.to_string())?;
    let mut times = Vec::with_capacity(STEPS);
    for step in 0..WARMUP + STEPS {
        let started = Instant::now();
        let (x, y) = data.batch(step as u64, WORLD_SIZE, rank, BATCH);
        let x =
            Tensor::from_vec(x, (BATCH, data.width), &Device::Cpu).map_err(|e| e.to_string())?;
        let y = Tensor::from_vec(y, BATCH, &Device::Cpu).map_err(|e| e.to_string())?;
        let loss = model
            .forward(&x)
            .and_then(|logits| candle_nn::loss::cross_entropy(&logits, &y))
            .map_err(|e| e.to_string())?;
        opt.backward_step(&loss).map_err(|e| e.to_string())?;
        if step >= WARMUP {
            times.push(started.elapsed().as_secs_f64());
        }
    }
    times.sort_by(f64::total_cmp);
    Ok(times[times.len() / 2])
}

fn measure_group(delayed: bool, overlap: Overlap, data: &Dataset) -> Result<f64, String> {
    let results = ThreadGroup::new(WORLD_SIZE).run(|comm| {
        if delayed {
            measure(Delayed::new(comm, LATENCY, BYTES_PER_SEC), overlap, data)
        } else {
            measure(comm, overlap, data)
        }
    });
    match results.into_iter().next() {
        Some(Ok(r)) => r,
        Some(Err(e)) => Err(e.to_string()),
        None => Err("no rank ran".into()),
    }
}

/// Adds `overlap.step_over_serial`, `overlap.delayed_step_over_serial` and
/// `overlap.delayed_interleaved_over_serial`.
pub fn run(report: &mut Report) {
    let data = Dataset::synthetic(0);
    println!(
        "bench overlap: MLP {}-{HIDDEN:?}-{} with ZeroHook, AdamW, stage 2, {BATCH} rows per \
         rank, N={WORLD_SIZE} threads, {} KiB buckets; plain threads and a delayed link \
         ({} us + {} GB/s); median of {STEPS} steps after {WARMUP}, rounds interleaved",
        data.width,
        data.classes,
        BUCKET_BYTES >> 10,
        LATENCY.as_micros(),
        BYTES_PER_SEC / 1e9
    );
    let cases = [
        ("serial", false, Overlap::None),
        ("overlapped", false, Overlap::AfterBackward),
        ("delayed_serial", true, Overlap::None),
        ("delayed_overlapped", true, Overlap::AfterBackward),
        ("delayed_interleaved", true, Overlap::Interleaved),
    ];
    let names: Vec<&str> = cases.iter().map(|c| c.0).collect();
    let medians = match super::interleaved_medians(&names, ROUNDS, |i| {
        measure_group(cases[i].1, cases[i].2, &data)
    }) {
        Ok(medians) => medians,
        Err(e) => {
            eprintln!("bench overlap: {e}");
            return;
        }
    };
    for ((name, _, _), median) in cases.iter().zip(&medians) {
        report.add(&format!("overlap.{name}_ms"), median * 1e3, "ms", None);
    }
    report.add(
        "overlap.step_over_serial",
        medians[1] / medians[0],
        "ratio",
        Some("<= 1.0"),
    );
    report.add(
        "overlap.delayed_step_over_serial",
        medians[3] / medians[2],
        "ratio",
        Some("< 1.0"),
    );
    report.add(
        "overlap.delayed_interleaved_over_serial",
        medians[4] / medians[2],
        "ratio",
        Some("< 1.0"),
    );
}
