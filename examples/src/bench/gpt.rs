//! `bench gpt`: the trainer's GPT (2 layers, d_model 64, context 64), its
//! throughput at N=2 threads (stage 2), and the engine's fixed price at
//! world size 1 against a plain candle-nn `AdamW` step on the same model
//! and batch, both timed in one run with rounds interleaved.

use super::Report;
use crate::trainer::{Gpt, GptConfig, TextData};
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
/// Sequences per rank per step.
const BATCH: usize = 16;
const WARMUP: usize = 3;
const STEPS: usize = 20;
const ROUNDS: usize = 3;
const LR: f64 = 1e-3;

/// Text whose content does not matter for timing: seeded bytes.
fn text() -> Result<TextData, String> {
    let mut state = 0x2545_f491_4f6c_dd1du64;
    let bytes: Vec<u8> = (0..200_000)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            b' ' + (state % 90) as u8
        })
        .collect();
    TextData::from_bytes(bytes, CONFIG.context, "bench").map_err(|e| e.to_string())
}

/// One rank's batch of step `step` as a `[BATCH, context + 1]` tensor.
fn batch(
    text: &TextData,
    step: usize,
    world_size: usize,
    rank: usize,
) -> candle_core::Result<Tensor> {
    let first = (step * world_size * BATCH) as u64;
    let ids = text.windows_at(first, rank, BATCH, CONFIG.context, 0);
    Tensor::from_vec(ids, (BATCH, CONFIG.context + 1), &Device::Cpu)
}

fn median(mut times: Vec<f64>) -> f64 {
    times.sort_by(f64::total_cmp);
    times[times.len() / 2]
}

/// Median step time of the engine at `world_size` threads, stage 2.
fn engine_step(text: &TextData, world_size: usize) -> Result<f64, String> {
    let results = ThreadGroup::new(world_size).run(|comm| {
        let rank = comm.rank();
        let varmap = VarMap::new();
        let model = Gpt::new(&varmap, CONFIG, 0, &Device::Cpu).map_err(|e| e.to_string())?;
        let adamw = AdamW::new(AdamWConfig::default().with_lr(LR)).map_err(|e| e.to_string())?;
        let config = EngineConfig::default().with_stage(Stage::Gradients);
        let mut opt = ZeroOptimizer::<_, f32>::new(&varmap, comm, config, Box::new(adamw))
            .map_err(|e| e.to_string())?;
        let mut times = Vec::with_capacity(STEPS);
        for step in 0..WARMUP + STEPS {
            let started = Instant::now();
            let mut run = || -> Result<(), String> {
                let ids = batch(text, step, world_size, rank).map_err(|e| e.to_string())?;
                let loss = model.loss(&ids).map_err(|e| e.to_string())?;
                let grads = loss.backward().map_err(|e| e.to_string())?;
                opt.step(&grads).map_err(|e| e.to_string())?;
                Ok(())
            };
            run()?;
            if step >= WARMUP {
                times.push(started.elapsed().as_secs_f64());
            }
        }
        Ok::<_, String>(median(times))
    });
    match results.into_iter().next() {
        Some(Ok(Ok(t))) => Ok(t),
        Some(Ok(Err(e))) => Err(e),
        Some(Err(e)) => Err(e.to_string()),
        None => Err("no rank ran".into()),
    }
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
            let loss = model.loss(&batch(text, step, 1, 0)?)?;
            opt.backward_step(&loss)?;
            if step >= WARMUP {
                times.push(started.elapsed().as_secs_f64());
            }
        }
        Ok(median(times))
    };
    run().map_err(|e| e.to_string())
}

/// Adds `gpt.tokens_per_s` (N=2, stage 2) and `gpt.w1_over_plain`.
pub fn run(report: &mut Report) {
    println!(
        "bench gpt: GPT {CONFIG:?}, AdamW, {BATCH} sequences per rank, median of {STEPS} steps \
         after {WARMUP}, {ROUNDS} rounds interleaved"
    );
    let text = match text() {
        Ok(text) => text,
        Err(e) => {
            eprintln!("bench gpt: {e}");
            return;
        }
    };
    let (mut n2, mut w1, mut plain) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..ROUNDS {
        let round = engine_step(&text, 2).and_then(|a| {
            let b = engine_step(&text, 1)?;
            Ok((a, b, plain_step(&text)?))
        });
        match round {
            Ok((a, b, c)) => {
                n2.push(a);
                w1.push(b);
                plain.push(c);
            }
            Err(e) => {
                eprintln!("bench gpt failed: {e}");
                return;
            }
        }
    }
    let (n2, w1, plain) = (median(n2), median(w1), median(plain));
    let tokens = (2 * BATCH * CONFIG.context) as f64;
    report.add("gpt.tokens_per_s", tokens / n2, "tokens/s", None);
    report.add("gpt.w1_ms", w1 * 1e3, "ms", None);
    report.add("gpt.plain_candle_ms", plain * 1e3, "ms", None);
    report.add("gpt.w1_over_plain", w1 / plain, "x", Some("<= 1.10"));
}
