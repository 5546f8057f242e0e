//! `bench gpt`: the trainer's GPT (2 layers, d_model 64, 4 heads), side by
//! side in one run:
//! - its throughput at N=2 threads (stage 2, context 64, 16 sequences per
//!   rank: the README's run) computing with the fused ops
//!   ([`GptOps::Fused`]) and with Candle's composed ones
//!   ([`GptOps::Composed`]), and the process's peak heap of each at
//!   context 256; the same for the fused ops with the MLP's GELU kept
//!   ([`GptOps::FusedGeluKept`]) rather than recomputed in the backward;
//! - the same model and global batch trained by PyTorch on the same cores
//!   (`examples/pytorch/gpt_peer.py`, when torch is installed);
//! - the engine's fixed price at world size 1 against a plain candle-nn
//!   `AdamW` step on the same model and batch.
//!
//! Rounds are interleaved so that drift in the machine's load affects each
//! case alike; each figure is a median.

use super::torch_peer::{run_gpt_peer, PeerArgs};
use super::{interleaved_medians, median, Report};
use crate::heap;
use crate::trainer::{Gpt, GptConfig, GptOps, TextData};
use candle_core::{Device, Tensor};
use candle_nn::{Optimizer, VarMap};
use std::time::Instant;
use zero_candle::ZeroOptimizer;
use zero_core::engine::{EngineConfig, Stage};
use zero_core::optim::{AdamW, AdamWConfig};
use zero_core::{Communicator, ThreadGroup};

const CONFIG: GptConfig = GptConfig {
    layers: 2,
    heads: 4,
    d_model: 64,
    context: 64,
};
/// The context of the memory figure: where attention's `time x time`
/// intermediates dominate what a step keeps.
const LONG_CONTEXT: usize = 256;
/// Sequences per rank per step.
const BATCH: usize = 16;
const WORLD_SIZE: usize = 2;
const WARMUP: usize = 3;
const STEPS: usize = 20;
/// Steps of the memory runs (the peak comes in the first).
const MEMORY_STEPS: usize = 3;
const ROUNDS: usize = 3;
const LR: f64 = 1e-3;

/// Text whose content does not matter for timing: seeded bytes.
fn text(context: usize) -> Result<TextData, String> {
    let mut state = 0x2545_f491_4f6c_dd1du64;
    let bytes: Vec<u8> = (0..200_000)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            b' ' + (state % 90) as u8
        })
        .collect();
    TextData::from_bytes(bytes, context, "bench").map_err(|e| e.to_string())
}

/// One rank's batch of step `step` as a `[BATCH, context + 1]` tensor.
fn batch(
    text: &TextData,
    context: usize,
    step: usize,
    world_size: usize,
    rank: usize,
) -> candle_core::Result<Tensor> {
    let first = (step * world_size * BATCH) as u64;
    let ids = text.windows_at(first, rank, BATCH, context, 0);
    Tensor::from_vec(ids, (BATCH, context + 1), &Device::Cpu)
}

/// One engine run: the median step time after `warmup`, and the most heap
/// the process held during it above what it held before.
struct EngineRun {
    step_s: f64,
    peak_heap: Option<usize>,
}

/// `warmup + steps` steps of the engine at `world_size` threads, stage 2,
/// the model at `context` computing with `ops`.
fn engine_run(
    text: &TextData,
    context: usize,
    world_size: usize,
    ops: GptOps,
    warmup: usize,
    steps: usize,
) -> Result<EngineRun, String> {
    let config = GptConfig { context, ..CONFIG };
    let before = heap::current_bytes();
    heap::reset_peak();
    let results = ThreadGroup::new(world_size).run(|comm| {
        let rank = comm.rank();
        let varmap = VarMap::new();
        let model = Gpt::new(&varmap, config, 0, &Device::Cpu)
            .map_err(|e| e.to_string())?
            .with_ops(ops);
        let adamw = AdamW::new(AdamWConfig::default().with_lr(LR)).map_err(|e| e.to_string())?;
        let engine = EngineConfig::default().with_stage(Stage::Gradients);
        let mut opt = ZeroOptimizer::<_, f32>::new(&varmap, comm, engine, Box::new(adamw))
            .map_err(|e| e.to_string())?;
        let mut times = Vec::with_capacity(steps);
        for step in 0..warmup + steps {
            let started = Instant::now();
            let mut run = || -> Result<(), String> {
                let ids =
                    batch(text, context, step, world_size, rank).map_err(|e| e.to_string())?;
                let loss = model.loss(&ids).map_err(|e| e.to_string())?;
                let grads = loss.backward().map_err(|e| e.to_string())?;
                opt.step(&grads).map_err(|e| e.to_string())?;
                Ok(())
            };
            run()?;
            if step >= warmup {
                times.push(started.elapsed().as_secs_f64());
            }
        }
        Ok::<_, String>(median(times))
    });
    let peak_heap = match (heap::peak_bytes(), before) {
        (Some(peak), Some(before)) => Some(peak.saturating_sub(before)),
        _ => None,
    };
    let step_s = match results.into_iter().next() {
        Some(Ok(Ok(t))) => t,
        Some(Ok(Err(e))) => return Err(e),
        Some(Err(e)) => return Err(e.to_string()),
        None => return Err("no rank ran".into()),
    };
    Ok(EngineRun { step_s, peak_heap })
}

/// Median step time of candle-nn's own `AdamW` on the same model and batch.
fn plain_step(text: &TextData) -> Result<f64, String> {
    let run = || -> Result<f64, Box<dyn std::error::Error>> {
        let varmap = VarMap::new();
        let model = Gpt::new(&varmap, CONFIG, 0, &Device::Cpu)?;
        let params = candle_nn::ParamsAdamW {
            lr: LR,
            ..Default::default()
        };
        let mut opt = candle_nn::AdamW::new(varmap.all_vars(), params)?;
        let mut times = Vec::with_capacity(STEPS);
        for step in 0..WARMUP + STEPS {
            let started = Instant::now();
            let loss = model.loss(&batch(text, CONFIG.context, step, 1, 0)?)?;
            opt.backward_step(&loss)?;
            if step >= WARMUP {
                times.push(started.elapsed().as_secs_f64());
            }
        }
        Ok(median(times))
    };
    run().map_err(|e| e.to_string())
}

/// PyTorch's median step time on the same model and global batch (one
/// process, as many threads as the machine has cores).
fn torch_step() -> Result<f64, String> {
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let args = PeerArgs {
        layers: CONFIG.layers,
        heads: CONFIG.heads,
        d_model: CONFIG.d_model,
        context: CONFIG.context,
        batch: WORLD_SIZE * BATCH,
        steps: STEPS,
        warmup: WARMUP,
        threads: Some(threads),
        ..PeerArgs::default()
    };
    Ok(run_gpt_peer(&args)?.step_ms / 1e3)
}

/// Adds the throughput figures (fused, composed, PyTorch), the heap at
/// context 256, and `gpt.w1_over_plain`.
pub fn run(report: &mut Report) {
    println!(
        "bench gpt: GPT {CONFIG:?}, AdamW, {BATCH} sequences per rank at N={WORLD_SIZE}, \
         median of {STEPS} steps after {WARMUP}, {ROUNDS} rounds interleaved"
    );
    if let Err(e) = throughput(report) {
        eprintln!("bench gpt failed: {e}");
    }
    if let Err(e) = long_context_heap(report) {
        eprintln!("bench gpt (heap at context {LONG_CONTEXT}) failed: {e}");
    }
}

fn throughput(report: &mut Report) -> Result<(), String> {
    let text = text(CONFIG.context)?;
    // PyTorch is measured only if it runs at all; its absence is reported,
    // not a failure of the suite.
    let torch = match torch_step() {
        Ok(_) => true,
        Err(e) => {
            println!("bench gpt: no PyTorch figure: {e}");
            false
        }
    };
    let mut names = vec![
        "fused N=2",
        "composed N=2",
        "fused W=1",
        "plain candle",
        "fused, GELU kept N=2",
    ];
    if torch {
        names.push("pytorch");
    }
    let medians = interleaved_medians(&names, ROUNDS, |case| match case {
        0 => Ok(engine_run(
            &text,
            CONFIG.context,
            WORLD_SIZE,
            GptOps::Fused,
            WARMUP,
            STEPS,
        )?
        .step_s),
        1 => Ok(engine_run(
            &text,
            CONFIG.context,
            WORLD_SIZE,
            GptOps::Composed,
            WARMUP,
            STEPS,
        )?
        .step_s),
        2 => Ok(engine_run(&text, CONFIG.context, 1, GptOps::Fused, WARMUP, STEPS)?.step_s),
        3 => plain_step(&text),
        4 => Ok(engine_run(
            &text,
            CONFIG.context,
            WORLD_SIZE,
            GptOps::FusedGeluKept,
            WARMUP,
            STEPS,
        )?
        .step_s),
        _ => torch_step(),
    })?;
    let tokens = (WORLD_SIZE * BATCH * CONFIG.context) as f64;
    let (fused, composed) = (tokens / medians[0], tokens / medians[1]);
    report.add("gpt.tokens_per_s", fused, "tokens/s", None);
    report.add("gpt.composed_tokens_per_s", composed, "tokens/s", None);
    report.add(
        "gpt.fused_over_composed",
        fused / composed,
        "x",
        Some(">= 1.5"),
    );
    // What the GELU's recompute costs (or saves) against keeping it.
    report.add(
        "gpt.gelu_recomputed_over_kept",
        medians[4] / medians[0],
        "x",
        None,
    );
    if torch {
        let torch = tokens / medians[5];
        report.add("gpt.torch_tokens_per_s", torch, "tokens/s", None);
        report.add("gpt.fused_over_torch", fused / torch, "x", None);
    }
    report.add("gpt.w1_ms", medians[2] * 1e3, "ms", None);
    report.add("gpt.plain_candle_ms", medians[3] * 1e3, "ms", None);
    report.add(
        "gpt.w1_over_plain",
        medians[2] / medians[3],
        "x",
        Some("<= 1.10"),
    );
    Ok(())
}

/// The process's peak heap over a few steps at context 256, fused and
/// composed (the README's run otherwise).
fn long_context_heap(report: &mut Report) -> Result<(), String> {
    let text = text(LONG_CONTEXT)?;
    let mut peaks = [0.0f64; 3];
    let cases = [GptOps::Fused, GptOps::Composed, GptOps::FusedGeluKept];
    for (peak, ops) in peaks.iter_mut().zip(cases) {
        let run = engine_run(&text, LONG_CONTEXT, WORLD_SIZE, ops, 0, MEMORY_STEPS)?;
        let Some(bytes) = run.peak_heap else {
            println!("bench gpt: no heap figure: the counting allocator is not installed");
            return Ok(());
        };
        *peak = bytes as f64;
    }
    report.add("gpt.ctx256_peak_heap_mb", peaks[0] / 1e6, "MB", None);
    report.add(
        "gpt.ctx256_composed_peak_heap_mb",
        peaks[1] / 1e6,
        "MB",
        None,
    );
    report.add(
        "gpt.ctx256_fused_over_composed_heap",
        peaks[0] / peaks[1],
        "x",
        Some("<= 0.6"),
    );
    report.add(
        "gpt.ctx256_gelu_recomputed_over_kept_heap",
        peaks[0] / peaks[2],
        "x",
        None,
    );
    Ok(())
}
