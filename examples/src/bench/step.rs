//! `bench step`: one MLP training step at N=2 on the thread backend, stages
//! 0, 1 and 2 timed in one run, and each stage's memory per rank.

use super::Report;
use crate::trainer::{Dataset, Mlp};
use candle_core::{Device, Tensor};
use candle_nn::VarMap;
use std::time::Instant;
use zero_candle::ZeroOptimizer;
use zero_core::engine::{EngineConfig, MemoryReport, Stage};
use zero_core::optim::{AdamW, AdamWConfig};
use zero_core::ThreadGroup;

const WORLD_SIZE: usize = 2;
const HIDDEN: [usize; 2] = [1024, 1024];
const BATCH: usize = 8;
const WARMUP: usize = 3;
const STEPS: usize = 25;
const ROUNDS: usize = 3;
/// Smaller than the model, so stage 2's bucket buffer is a fraction of it.
const BUCKET_BYTES: usize = 2 << 20;

/// Median step time and rank 0's memory for one stage.
fn measure(stage: Stage, data: &Dataset) -> Result<(f64, MemoryReport), String> {
    let results = ThreadGroup::new(WORLD_SIZE).run(|comm| {
        let rank = zero_core::Communicator::rank(&comm);
        let varmap = VarMap::new();
        let mut widths = vec![data.width];
        widths.extend(HIDDEN);
        widths.push(data.classes);
        let model =
            Mlp::new(&varmap, &widths, 0, &candle_core::Device::Cpu).map_err(|e| e.to_string())?;
        let adamw = AdamW::new(AdamWConfig::default().with_lr(1e-3)).map_err(|e| e.to_string())?;
        let config = EngineConfig::default()
            .with_stage(stage)
            .with_bucket_bytes(BUCKET_BYTES);
        let mut opt = ZeroOptimizer::<_, f32>::new(&varmap, comm, config, Box::new(adamw))
            .map_err(|e| e.to_string())?;
        let mut times = Vec::with_capacity(STEPS);
        for step in 0..WARMUP + STEPS {
            let started = Instant::now();
            let (x, y) = data.batch(step as u64, WORLD_SIZE, rank, BATCH);
            let run = || -> candle_core::Result<()> {
                let x = Tensor::from_vec(x, (BATCH, data.width), &Device::Cpu)?;
                let y = Tensor::from_vec(y, BATCH, &Device::Cpu)?;
                let loss = candle_nn::loss::cross_entropy(&model.forward(&x)?, &y)?;
                let grads = loss.backward()?;
                opt.step(&grads)?;
                Ok(())
            };
            run().map_err(|e| e.to_string())?;
            if step >= WARMUP {
                times.push(started.elapsed().as_secs_f64());
            }
        }
        times.sort_by(f64::total_cmp);
        Ok::<_, String>((times[times.len() / 2], opt.memory_report()))
    });
    match results.into_iter().next() {
        Some(Ok(Ok(r))) => Ok(r),
        Some(Ok(Err(e))) => Err(e),
        Some(Err(e)) => Err(e.to_string()),
        None => Err("no rank ran".into()),
    }
}

/// Adds `step.s1_over_s0`, `step.s2_over_s0` and per-stage memory figures.
pub fn run(report: &mut Report) {
    let data = Dataset::synthetic(0);
    println!(
        "bench step: MLP {}-{HIDDEN:?}-{}, AdamW, {BATCH} rows per rank, N={WORLD_SIZE} threads, \
         {} KiB buckets, \
         median of {STEPS} steps after {WARMUP}, rounds interleaved",
        data.width,
        data.classes,
        BUCKET_BYTES >> 10
    );
    let stages = [
        ("s0", Stage::Ddp),
        ("s1", Stage::OptimizerState),
        ("s2", Stage::Gradients),
    ];
    // Stages alternate over rounds so that drift in the machine's load
    // affects each alike; each stage's figure is the median of its rounds.
    let mut rounds: Vec<Vec<f64>> = vec![Vec::new(); stages.len()];
    let mut memories = vec![MemoryReport::default(); stages.len()];
    for _ in 0..ROUNDS {
        for (i, (name, stage)) in stages.iter().enumerate() {
            match measure(*stage, &data) {
                Ok((median, memory)) => {
                    rounds[i].push(median);
                    memories[i] = memory;
                }
                Err(e) => {
                    eprintln!("bench step: stage {name} failed: {e}");
                    return;
                }
            }
        }
    }
    let mut medians = Vec::new();
    for (i, (name, _)) in stages.iter().enumerate() {
        rounds[i].sort_by(f64::total_cmp);
        let median = rounds[i][rounds[i].len() / 2];
        let memory = memories[i];
        {
            {
                report.add(&format!("step.{name}_ms"), median * 1e3, "ms", None);
                for (category, bytes) in [
                    ("params", memory.params),
                    ("grads", memory.grads),
                    ("grad_shard", memory.grad_shard),
                    ("optimizer_state", memory.optimizer_state),
                    ("comm_buffers", memory.comm_buffers),
                    ("total", memory.total()),
                ] {
                    report.add(
                        &format!("step.{name}_memory_{category}"),
                        bytes as f64,
                        "bytes",
                        None,
                    );
                }
                medians.push(median);
            }
        }
    }
    report.add(
        "step.s1_over_s0",
        medians[1] / medians[0],
        "ratio",
        Some("<= 1.0"),
    );
    report.add(
        "step.s2_over_s0",
        medians[2] / medians[0],
        "ratio",
        Some("<= 1.0"),
    );
}
