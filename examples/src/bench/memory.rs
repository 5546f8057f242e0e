//! `bench memory`: the heap a training process really holds at each stage,
//! counted by the binary's allocator (see [`crate::heap`]), not computed
//! from buffer sizes: the replica, Candle's gradients and activations, the
//! engine's buffers and every temporary copy.

use super::Report;
use crate::heap;
use crate::trainer::Mlp;
use candle_core::Device;
use candle_nn::VarMap;
use rand::SeedableRng;
use zero_candle::ZeroOptimizer;
use zero_core::engine::{EngineConfig, Stage};
use zero_core::optim::{AdamW, AdamWConfig};
use zero_core::{Communicator, ThreadGroup};

const WORLD_SIZE: usize = 2;
/// MLP 1024-4x2048-10: 14.7M f32 parameters.
const WIDTHS: [usize; 6] = [1024, 2048, 2048, 2048, 2048, 10];
const BATCH: usize = 8;
/// Enough steps for every buffer to exist (Adam's state after the first).
const STEPS: usize = 3;

/// Process peak heap bytes above what was live before, for one stage.
fn peak_above_baseline(stage: Stage) -> Result<usize, String> {
    heap::reset_peak();
    let baseline = heap::current_bytes().ok_or("the counting allocator is not installed")?;
    let results = ThreadGroup::new(WORLD_SIZE).run(|comm| {
        let rank = comm.rank();
        let run = || -> Result<(), crate::trainer::TrainError> {
            let varmap = VarMap::new();
            let model = Mlp::new(&varmap, &WIDTHS, 0, &Device::Cpu)?;
            let adamw = AdamW::new(AdamWConfig::default().with_lr(1e-3))?;
            let config = EngineConfig::default().with_stage(stage);
            let mut opt = ZeroOptimizer::<_, f32>::new(&varmap, comm, config, Box::new(adamw))?;
            let mut rng = rand::rngs::StdRng::seed_from_u64(rank as u64);
            for _ in 0..STEPS {
                let (x, y) = super::random_batch(&mut rng, BATCH, WIDTHS[0], 10)?;
                let loss = candle_nn::loss::cross_entropy(&model.forward(&x)?, &y)?;
                let grads = loss.backward()?;
                opt.step(&grads)?;
            }
            Ok(())
        };
        run().map_err(|e| e.to_string())
    });
    for result in results {
        match result {
            Ok(Ok(())) => {}
            Ok(Err(e)) => return Err(e),
            Err(e) => return Err(e.to_string()),
        }
    }
    let peak = heap::peak_bytes().ok_or("the counting allocator is not installed")?;
    Ok(peak.saturating_sub(baseline))
}

/// Adds `memory.s*_peak_bytes`, the ratios to stage 0 and stage 0's bytes
/// per parameter per rank.
pub fn run(report: &mut Report) {
    let params: usize = WIDTHS.windows(2).map(|w| w[0] * w[1] + w[1]).sum();
    println!(
        "bench memory: MLP {WIDTHS:?} ({:.1}M f32 parameters), AdamW, {BATCH} rows per rank, \
         N={WORLD_SIZE} threads in one process, default buckets; process peak heap over \
         {STEPS} steps, counted by the allocator",
        params as f64 / 1e6
    );
    let mut peaks = Vec::new();
    for (name, stage) in [
        ("s0", Stage::Ddp),
        ("s1", Stage::OptimizerState),
        ("s2", Stage::Gradients),
    ] {
        match peak_above_baseline(stage) {
            Ok(peak) => {
                report.add(
                    &format!("memory.{name}_peak_bytes"),
                    peak as f64,
                    "bytes",
                    None,
                );
                peaks.push(peak as f64);
            }
            Err(e) => {
                eprintln!("bench memory: stage {name}: {e}");
                return;
            }
        }
    }
    report.add(
        "memory.s0_peak_bytes_per_param",
        peaks[0] / WORLD_SIZE as f64 / params as f64,
        "bytes",
        Some("<= 18"),
    );
    report.add(
        "memory.s1_peak_over_s0_peak",
        peaks[1] / peaks[0],
        "ratio",
        Some("<= 0.80"),
    );
    report.add(
        "memory.s2_peak_over_s0_peak",
        peaks[2] / peaks[0],
        "ratio",
        Some("<= 0.70"),
    );
}
