//! `bench memory`: the heap a training process really holds at each stage,
//! with gradients through Candle's `GradStore` and with the layers handing
//! them to the engine during backward (`hooked_*`),
//! counted by the binary's allocator (see [`crate::heap`]), not computed
//! from buffer sizes: the replica, Candle's gradients and activations, the
//! engine's buffers and every temporary copy.

use super::Report;
use crate::heap;
use crate::trainer::Mlp;
use candle_core::Device;
use candle_nn::VarMap;
use rand::SeedableRng;
use std::sync::Arc;
use zero_candle::nn::GradHook;
use zero_candle::{ZeroHook, ZeroOptimizer};
use zero_core::engine::{EngineConfig, Stage};
use zero_core::optim::{AdamW, AdamWConfig};
use zero_core::{Communicator, ThreadComm, ThreadGroup};

const WORLD_SIZE: usize = 2;
/// MLP 1024-4x2048-10: 14.7M f32 parameters.
const WIDTHS: [usize; 6] = [1024, 2048, 2048, 2048, 2048, 10];
const BATCH: usize = 8;
/// Enough steps for every buffer to exist (Adam's state after the first).
const STEPS: usize = 3;

/// Process peak heap bytes above what was live before, for one stage;
/// `hooked`: the layers hand their gradients to the engine during backward
/// (`ZeroHook`, `backward_step`) instead of through the `GradStore`;
/// `defer`: with the all-gathers deferred into the next forward.
fn peak_above_baseline(stage: Stage, hooked: bool, defer: bool) -> Result<usize, String> {
    heap::reset_peak();
    let baseline = heap::current_bytes().ok_or("the counting allocator is not installed")?;
    let results = ThreadGroup::new(WORLD_SIZE).run(|comm| {
        let rank = comm.rank();
        let run = || -> Result<(), crate::trainer::TrainError> {
            let varmap = VarMap::new();
            let hook = ZeroHook::<ThreadComm, f32>::new();
            let model = Mlp::with_hook(
                &varmap,
                &WIDTHS,
                0,
                &Device::Cpu,
                hooked.then(|| hook.clone() as Arc<dyn GradHook>),
            )?;
            let adamw = AdamW::new(AdamWConfig::default().with_lr(1e-3))?;
            let config = EngineConfig::default()
                .with_stage(stage)
                .with_defer_gathers(defer);
            let mut opt = ZeroOptimizer::<_, f32>::new(&varmap, comm, config, Box::new(adamw))?;
            if hooked {
                opt = opt.with_hook(&hook)?;
            }
            let mut rng = rand::rngs::StdRng::seed_from_u64(rank as u64);
            for _ in 0..STEPS {
                let (x, y) = super::random_batch(&mut rng, BATCH, WIDTHS[0], 10)?;
                let loss = candle_nn::loss::cross_entropy(&model.forward(&x)?, &y)?;
                opt.backward_step(&loss)?;
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
    let mut hooked_peaks = Vec::new();
    for (name, stage) in [
        ("s0", Stage::Ddp),
        ("s1", Stage::OptimizerState),
        ("s2", Stage::Gradients),
    ] {
        for (hooked, prefix, out) in [
            (false, "", &mut peaks),
            (true, "hooked_", &mut hooked_peaks),
        ] {
            match peak_above_baseline(stage, hooked, false) {
                Ok(peak) => {
                    report.add(
                        &format!("memory.{prefix}{name}_peak_bytes"),
                        peak as f64,
                        "bytes",
                        None,
                    );
                    out.push(peak as f64);
                }
                Err(e) => {
                    eprintln!("bench memory: stage {name}: {e}");
                    return;
                }
            }
        }
    }
    match peak_above_baseline(Stage::Gradients, true, true) {
        Ok(peak) => {
            report.add("memory.deferred_s2_peak_bytes", peak as f64, "bytes", None);
            report.add(
                "memory.deferred_s2_peak_over_hooked_s2_peak",
                peak as f64 / hooked_peaks[2],
                "ratio",
                None,
            );
        }
        Err(e) => eprintln!("bench memory: stage 2, deferred gathers: {e}"),
    }
    report.add(
        "memory.hooked_s0_peak_bytes_per_param",
        hooked_peaks[0] / WORLD_SIZE as f64 / params as f64,
        "bytes",
        Some("<= 18"),
    );
    report.add(
        "memory.hooked_s2_peak_over_hooked_s0_peak",
        hooked_peaks[2] / hooked_peaks[0],
        "ratio",
        Some("<= 0.70"),
    );
    for (i, name) in ["s0", "s1", "s2"].iter().enumerate() {
        report.add(
            &format!("memory.hooked_{name}_peak_over_grad_store_{name}_peak"),
            hooked_peaks[i] / peaks[i],
            "ratio",
            None,
        );
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
