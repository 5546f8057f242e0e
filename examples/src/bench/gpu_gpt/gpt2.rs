//! GPT-2 small (`Gpt2Config::gpt2_small`: 124M parameters, seeded random
//! weights) fine-tuned in bf16 on one GPU as `train --hf --backend nccl`
//! trains a GPT-2 (`NcclZeroOptimizer` at stage 2 and world size 1, f32
//! masters and AdamW state, the layers handing their gradients to a
//! `ZeroHook`), against `transformers` (`examples/pytorch/hf_peer.py
//! --random small`: bf16 autocast over f32 weights, SDPA, fused AdamW) on
//! the same GPU, batch and hyperparameters: tokens/s and peak GPU memory.

use super::{synchronize, BenchResult, LR, SEED, STEPS, WARMUP};
use crate::bench::torch_peer::{run_hf_peer, HfPeerArgs};
use crate::bench::Report;
use candle_core::{DType, Device, Tensor};
use rand::{rngs::StdRng, Rng, SeedableRng};
use std::sync::Arc;
use std::time::Instant;
use zero_candle::models::{Gpt2, Gpt2Config};
use zero_candle::nn::GradHook;
use zero_candle::{NcclZeroOptimizer, ShardedVarMap, ZeroHook};
use zero_core::engine::{EngineConfig, Stage};
use zero_core::optim::{AdamW, AdamWConfig};
use zero_nccl::cudarc::driver::CudaContext;
use zero_nccl::{DevicePool, NcclComm};

/// Sequences per step, on both sides.
const BATCH: usize = 8;
/// Predicted tokens per sequence: GPT-2 small's `n_positions`.
const CONTEXT: usize = 1024;

/// Both sides' optimizer: PyTorch's AdamW defaults at the suite's lr,
/// passed to the peer as flags.
fn adamw_config() -> AdamWConfig {
    AdamWConfig::default().with_lr(LR)
}

/// Our side's figures.
struct Measured {
    tokens_per_s: f64,
    /// Bytes; `None` when the pool's high-water mark cannot be read.
    peak_bytes: Option<u64>,
}

/// Trains GPT-2 small on both sides, ours first (dropped, its memory
/// freed, before the peer starts), and adds
/// `gpu.gpt2_small_bf16_{tokens_per_s,peak_gb}`, the same of
/// `transformers` (`gpu.gpt2_small_bf16_transformers_*`), and ours over
/// theirs: `gpu.gpt2_small_bf16_over_transformers` (goal >= 1.0) and
/// `gpu.gpt2_small_bf16_peak_over_transformers`.
pub(super) fn against_transformers(
    report: &mut Report,
    device: &Device,
    ctx: &CudaContext,
    pool: Option<&DevicePool>,
) {
    let config = Gpt2Config::gpt2_small();
    println!(
        "bench gpu gpt2: GPT-2 small ({} parameters, random), bf16, {BATCH} x {CONTEXT} tokens, \
         stage 2 at world size 1, against transformers (SDPA, bf16 autocast)",
        config.num_params()
    );
    let ours = match ours(device, ctx, pool, &config) {
        Ok(measured) => {
            report.add(
                "gpu.gpt2_small_bf16_tokens_per_s",
                measured.tokens_per_s,
                "tokens/s",
                None,
            );
            if let Some(peak) = measured.peak_bytes {
                report.add("gpu.gpt2_small_bf16_peak_gb", peak as f64 / 1e9, "GB", None);
            }
            Some(measured)
        }
        Err(e) => {
            eprintln!("gpu gpt2 benchmark: ours failed: {e}");
            None
        }
    };
    let args =
        HfPeerArgs::gpt2_small_cuda_bf16(BATCH, CONTEXT, STEPS, WARMUP, adamw_config(), SEED);
    let theirs = match run_hf_peer(&args) {
        Ok(theirs) => theirs,
        Err(e) => {
            println!("gpu gpt2 benchmark: no transformers figures: {e}");
            return;
        }
    };
    println!(
        "bench gpu gpt2: transformers on torch {} on {}",
        theirs.torch_version, theirs.device_name
    );
    // Ratios only between models of the same shape.
    if theirs.parameters != Some(config.num_params() as u64) {
        eprintln!(
            "gpu gpt2 benchmark: hf_peer.py trained {:?} parameters, GPT-2 small has {}; no \
             transformers figures",
            theirs.parameters,
            config.num_params()
        );
        return;
    }
    report.add(
        "gpu.gpt2_small_bf16_transformers_tokens_per_s",
        theirs.tokens_per_s,
        "tokens/s",
        None,
    );
    if let Some(peak) = theirs.peak_bytes {
        report.add(
            "gpu.gpt2_small_bf16_transformers_peak_gb",
            peak as f64 / 1e9,
            "GB",
            None,
        );
    }
    let Some(ours) = ours else { return };
    report.add(
        "gpu.gpt2_small_bf16_over_transformers",
        ours.tokens_per_s / theirs.tokens_per_s,
        "ratio",
        Some(">= 1.0"),
    );
    if let (Some(a), Some(b)) = (ours.peak_bytes, theirs.peak_bytes) {
        report.add(
            "gpu.gpt2_small_bf16_peak_over_transformers",
            a as f64 / b as f64,
            "ratio",
            None,
        );
    }
}

/// GPT-2 small in bf16 with `NcclZeroOptimizer` at stage 2, `WARMUP +
/// STEPS` steps on one seeded batch of random token ids: the median step's
/// tokens/s and the pool's high-water mark over the timed steps.
/// Everything it built is dropped and the device drained before it
/// returns.
fn ours(
    device: &Device,
    ctx: &CudaContext,
    pool: Option<&DevicePool>,
    config: &Gpt2Config,
) -> BenchResult<Measured> {
    let mut rng = StdRng::seed_from_u64(SEED);
    let vocab = config.vocab_size as u32;
    let ids: Vec<u32> = (0..BATCH * (CONTEXT + 1))
        .map(|_| rng.gen_range(0..vocab))
        .collect();
    let ids = Tensor::from_vec(ids, (BATCH, CONTEXT + 1), device)?;
    let measured = {
        let map = ShardedVarMap::seeded(SEED);
        let hook = ZeroHook::<NcclComm, f32>::new();
        let model = Gpt2::new(
            map.builder(DType::BF16, device),
            config,
            Some(hook.clone() as Arc<dyn GradHook>),
        )?;
        // No gradient norm and no clipping: the peer computes neither.
        let mut opt = NcclZeroOptimizer::new_sharded(
            &map,
            NcclComm::single(0)?,
            EngineConfig::default().with_stage(Stage::Gradients),
            Box::new(AdamW::new(adamw_config())?),
            &hook,
        )?;
        let mut times = Vec::with_capacity(STEPS);
        for step in 0..WARMUP + STEPS {
            if step == WARMUP {
                // As the peer does: the peak over the timed steps.
                synchronize(device, ctx)?;
                if let Some(pool) = pool {
                    pool.reset_high_water()?;
                }
            }
            let started = Instant::now();
            let loss = model.loss(&ids)?;
            if opt.backward_step(&loss)?.is_none() {
                return Err("backward_step did not complete a step at one micro-step".into());
            }
            synchronize(device, ctx)?;
            if step >= WARMUP {
                times.push(started.elapsed().as_secs_f64());
            }
        }
        let peak_bytes = pool.map(DevicePool::high_water).transpose()?;
        times.sort_by(f64::total_cmp);
        Measured {
            tokens_per_s: (BATCH * CONTEXT) as f64 / times[times.len() / 2],
            peak_bytes,
        }
    };
    // The model, optimizer and communicator are dropped; their
    // asynchronous frees complete before the peer starts.
    synchronize(device, ctx)?;
    if let Some(pool) = pool {
        pool.reset_high_water()?;
    }
    Ok(measured)
}
