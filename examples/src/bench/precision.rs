//! `bench precision`: mixed precision's memory and speed. A bf16 model
//! with f32 master weights and f32 AdamW state against the same model in
//! f32: the process's peak heap per parameter per rank at stage 2 (N=4,
//! counted by the binary's allocator, see [`crate::heap`]), and the step
//! time at stage 2 (N=2).

use super::Report;
use crate::heap;
use crate::trainer::Mlp;
use candle_core::{DType, Device};
use candle_nn::VarMap;
use rand::SeedableRng;
use std::sync::Arc;
use std::time::Instant;
use zero_candle::nn::GradHook;
use zero_candle::{ZeroHook, ZeroOptimizer};
use zero_core::engine::{EngineConfig, Stage};
use zero_core::optim::{AdamW, AdamWConfig};
use zero_core::{Communicator, ThreadComm, ThreadGroup};

/// MLP 1024-4x2048-10: 14.7M parameters (the `bench memory` model).
const MEMORY_WIDTHS: [usize; 6] = [1024, 2048, 2048, 2048, 2048, 10];
const MEMORY_WORLD: usize = 4;
/// MLP 1024-2x1024-10 for the step time.
const STEP_WIDTHS: [usize; 4] = [1024, 1024, 1024, 10];
const STEP_WORLD: usize = 2;
const BATCH: usize = 8;
/// Enough steps for every buffer to exist (Adam's state after the first).
const MEMORY_STEPS: usize = 3;
const WARMUP: usize = 3;
const STEPS: usize = 15;
const ROUNDS: usize = 3;

/// One rank's run of `steps` steps of the MLP of `widths` in `dtype` (f32
/// engine: master weights for a 16-bit model), at stage 2; `hooked`:
/// gradients handed to the engine during backward. Returns the median step
/// time.
fn train(
    comm: ThreadComm,
    widths: &[usize],
    dtype: DType,
    hooked: bool,
    warmup: usize,
    steps: usize,
) -> Result<f64, crate::trainer::TrainError> {
    let rank = comm.rank();
    let varmap = VarMap::new();
    let hook = ZeroHook::<ThreadComm, f32>::new();
    let model = Mlp::with_hook_in(
        &varmap,
        widths,
        0,
        &Device::Cpu,
        hooked.then(|| hook.clone() as Arc<dyn GradHook>),
        dtype,
    )?;
    let adamw = AdamW::new(AdamWConfig::default().with_lr(1e-3))?;
    let config = EngineConfig::default().with_stage(Stage::Gradients);
    let mut opt = ZeroOptimizer::<_, f32>::new(&varmap, comm, config, Box::new(adamw))?;
    if hooked {
        opt = opt.with_hook(&hook)?;
    }
    let mut rng = rand::rngs::StdRng::seed_from_u64(rank as u64);
    let classes = widths[widths.len() - 1] as i64;
    let mut times = Vec::with_capacity(steps);
    for step in 0..warmup + steps {
        let started = Instant::now();
        let (x, y) = super::random_batch(&mut rng, BATCH, widths[0], classes)?;
        let logits = model.forward(&x.to_dtype(dtype)?)?.to_dtype(DType::F32)?;
        let loss = candle_nn::loss::cross_entropy(&logits, &y)?;
        opt.backward_step(&loss)?;
        if step >= warmup {
            times.push(started.elapsed().as_secs_f64());
        }
    }
    times.sort_by(f64::total_cmp);
    Ok(times.get(times.len() / 2).copied().unwrap_or(0.0))
}

/// Runs `f` on `world` ranks; rank 0's value or the first error.
fn on_ranks<R: Send>(
    world: usize,
    f: impl Fn(ThreadComm) -> Result<R, crate::trainer::TrainError> + Sync,
) -> Result<R, String> {
    let mut first = None;
    for result in ThreadGroup::new(world).run(|comm| f(comm).map_err(|e| e.to_string())) {
        match result {
            Ok(Ok(v)) => {
                first.get_or_insert(v);
            }
            Ok(Err(e)) => return Err(e),
            Err(e) => return Err(e.to_string()),
        }
    }
    first.ok_or_else(|| "no rank ran".into())
}

/// Process peak heap bytes per parameter per rank over a short stage-2 run.
fn peak_bytes_per_param(dtype: DType, hooked: bool) -> Result<f64, String> {
    let params: usize = MEMORY_WIDTHS.windows(2).map(|w| w[0] * w[1] + w[1]).sum();
    heap::reset_peak();
    let baseline = heap::current_bytes().ok_or("the counting allocator is not installed")?;
    on_ranks(MEMORY_WORLD, |comm| {
        train(comm, &MEMORY_WIDTHS, dtype, hooked, 0, MEMORY_STEPS)
    })?;
    let peak = heap::peak_bytes().ok_or("the counting allocator is not installed")?;
    Ok(peak.saturating_sub(baseline) as f64 / MEMORY_WORLD as f64 / params as f64)
}

/// Adds `memory.bf16_s2_bytes_per_param` (and its f32 and `GradStore`
/// neighbours) and `step.bf16_over_f32`.
pub fn run(report: &mut Report) {
    println!(
        "bench precision: MLP {MEMORY_WIDTHS:?}, AdamW, stage 2, N={MEMORY_WORLD} threads, \
         {BATCH} rows per rank, {MEMORY_STEPS} steps: process peak heap per parameter per rank; \
         MLP {STEP_WIDTHS:?}, N={STEP_WORLD}: median of {STEPS} steps after {WARMUP}, \
         {ROUNDS} interleaved rounds"
    );
    // Ideal for bf16 with f32 masters and Adam at N=4: 2 (bf16 weights) +
    // 2/4 (bf16 gradient shard) + 12/4 (f32 masters and moments).
    let ideal = 2.0 + 2.0 / 4.0 + 12.0 / 4.0;
    for (name, dtype, hooked, goal) in [
        (
            "memory.bf16_s2_bytes_per_param",
            DType::BF16,
            true,
            Some("<= 7.15 (1.3 x 5.5)"),
        ),
        (
            "memory.bf16_s2_grad_store_bytes_per_param",
            DType::BF16,
            false,
            None,
        ),
        ("memory.f32_s2_bytes_per_param", DType::F32, true, None),
    ] {
        match peak_bytes_per_param(dtype, hooked) {
            Ok(bytes) => {
                report.add(name, bytes, "bytes", goal);
                if name == "memory.bf16_s2_bytes_per_param" {
                    report.add(
                        "memory.bf16_s2_over_ideal",
                        bytes / ideal,
                        "ratio",
                        Some("<= 1.3"),
                    );
                }
            }
            Err(e) => {
                eprintln!("bench precision: {name}: {e}");
                return;
            }
        }
    }

    let dtypes = [DType::F32, DType::BF16];
    let medians = super::interleaved_medians(&["step f32", "step bf16"], ROUNDS, |i| {
        on_ranks(STEP_WORLD, |comm| {
            train(comm, &STEP_WIDTHS, dtypes[i], true, WARMUP, STEPS)
        })
    });
    let (f32_s, bf16_s) = match medians.as_deref() {
        Ok([f32_s, bf16_s]) => (*f32_s, *bf16_s),
        Ok(_) => return,
        Err(e) => {
            eprintln!("bench precision: {e}");
            return;
        }
    };
    report.add("step.f32_s2_ms", f32_s * 1e3, "ms", None);
    report.add("step.bf16_s2_ms", bf16_s * 1e3, "ms", None);
    report.add("step.bf16_over_f32", bf16_s / f32_s, "ratio", None);
}
