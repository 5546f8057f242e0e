//! GPU benchmark of the trainer's GPT (feature `nccl`): 12 layers, 12 heads,
//! d_model 768, context 256, 16 sequences per step, trained on one GPU as
//! `--backend nccl` does (`NcclZeroOptimizer` at stage 2 and world size 1,
//! AdamW lr 1e-3, the layers handing their gradients to a `ZeroHook` during
//! backward), against PyTorch's `examples/pytorch/gpt_peer.py` on the same
//! GPU in the same run: tokens/s and peak GPU memory.
//!
//! Peak memory is the high-water mark of the device's memory pool over the
//! timed steps: Candle allocates with `cuMemAllocAsync`, which draws from
//! that pool, so its used-memory mark counts every live tensor (weights,
//! gradients, optimizer state, activations) like PyTorch's
//! `max_memory_allocated()`, which the peer reports over its timed steps.
//! NCCL's own buffers are in neither figure.
//!
//! The same GPT at stages 0, 2 and 3 on four ranks sharing the GPU
//! (`--backend cuda-threads`) gives each rank's device bytes per parameter,
//! and stage 3 at one rank its step time over stage 2's. The bf16 GPT with
//! its optimizer's side offloaded to host memory gives the step time over
//! the plain one's (from page-locked shards, from pageable ones, on half
//! the host's cores, with the transfers on a stream of their own, sending
//! the f32 masters up instead of bf16 weights rounded on the host, and at
//! four times the sequences per step), where its host time goes (the step
//! thread's waits for copies and stepping, the wait for its last buckets
//! after backward, the write-back), and the largest model with offload
//! over without, projected from the measured bytes per parameter (`bench
//! gpu-largest` searches for it: [`largest()`]).
//!
//! Last, hub models with random weights in bf16 against `transformers` with
//! SDPA on the same GPU (`examples/pytorch/hf_peer.py`): GPT-2 small at
//! stage 2, and a Llama of TinyLlama-1.1B's shape at stage 3 on one rank
//! and on four sharing the GPU (`hub_models.rs`). Background checkpoint
//! saves of the GPT over blocking ones: `bench gpu-checkpoint` (`saves.rs`);
//! where a stage-3 step's time goes beside stage 2's: `bench gpu-stage3`
//! (`stage3_steps.rs`).

mod case;
mod headline;
mod hub_models;
mod largest_gpt;
mod peer;
mod saves;
mod shared;
mod stage3_steps;
mod suite;

pub use headline::headline;
pub use hub_models::{hub, hub_profile};
pub use largest_gpt::{largest, largest_trial};
pub use saves::saves;
pub use stage3_steps::stage3;
pub use suite::{run, Part};

use crate::trainer::{Gpt, GptConfig};
use candle_core::{DType, Device, Tensor};
use candle_nn::VarMap;
use rand::{rngs::StdRng, Rng, SeedableRng};
use std::sync::Arc;
use zero_candle::nn::GradHook;
use zero_candle::{CandleMemory, ZeroHook, ZeroOptimizer};
use zero_core::engine::EngineConfig;
use zero_core::optim::{AdamW, AdamWConfig};
use zero_core::Communicator;
use zero_nccl::cudarc::driver::CudaContext;

const CONFIG: GptConfig = GptConfig {
    layers: 12,
    heads: 12,
    d_model: 768,
    context: 256,
};
const BATCH: usize = 16;
/// The offload's large-batch case: four times [`BATCH`].
const LARGE_BATCH: usize = 4 * BATCH;
const WARMUP: usize = 3;
const STEPS: usize = 20;
const SEED: u64 = 0;
const LR: f64 = 1e-3;

type BenchResult<T> = Result<T, Box<dyn std::error::Error>>;

/// Ranks sharing the GPU (`CudaThreadGroup`, as `--backend cuda-threads`).
const SHARED_RANKS: usize = 4;

/// Candle's device 0 and its CUDA context (the primary context, which
/// `NcclComm::single(0)` shares).
fn open_device() -> BenchResult<(Device, Arc<CudaContext>)> {
    let device = Device::new_cuda(0)?;
    let Device::Cuda(cuda) = &device else {
        return Err("Device::new_cuda returned a non-CUDA device".into());
    };
    let ctx = cuda.cuda_stream().context().clone();
    Ok((device, ctx))
}

/// `[batch, context + 1]` random byte ids (seeded), on the device.
fn random_ids(device: &Device, batch: usize) -> candle_core::Result<Tensor> {
    let mut rng = StdRng::seed_from_u64(SEED);
    let ids: Vec<u32> = (0..batch * (CONFIG.context + 1))
        .map(|_| rng.gen_range(0..256))
        .collect();
    Tensor::from_vec(ids, (batch, CONFIG.context + 1), device)
}

/// The GPT of `config` in `dtype` on `device` (seeded), its layers hooked
/// to a `ZeroOptimizer` over `comm` configured by `engine`, stepping AdamW
/// at [`LR`]: the model and optimizer as the trainer builds them.
fn hooked_gpt<C>(
    device: &Device,
    config: GptConfig,
    dtype: DType,
    comm: C,
    engine: EngineConfig,
) -> BenchResult<(Gpt, ZeroOptimizer<C, f32>)>
where
    C: Communicator + 'static,
    C::Memory: CandleMemory<f32, C>,
{
    let varmap = VarMap::new();
    let hook = ZeroHook::<C, f32>::new();
    let model = Gpt::with_hook_in(
        &varmap,
        config,
        SEED,
        device,
        Some(hook.clone() as Arc<dyn GradHook>),
        dtype,
    )?;
    let opt = ZeroOptimizer::<C, f32>::new(
        &varmap,
        comm,
        engine,
        Box::new(AdamW::new(AdamWConfig::default().with_lr(LR))?),
    )?
    .with_hook(&hook)?;
    Ok((model, opt))
}

/// Waits for every stream of the context: Candle's and the engine's.
fn synchronize(device: &Device, ctx: &CudaContext) -> BenchResult<()> {
    device.synchronize()?;
    ctx.synchronize()?;
    Ok(())
}

/// The wide GPT of the headline and of `bench gpu-largest`, with `layers`
/// blocks: d_model 2048, 16 heads, context 256.
fn wide_gpt(layers: usize) -> GptConfig {
    GptConfig {
        layers,
        heads: 16,
        d_model: 2048,
        context: 256,
    }
}

/// The most layers of `config`'s shape within `params` parameters.
fn layers_within(config: GptConfig, params: usize) -> usize {
    let fixed = GptConfig {
        layers: 0,
        ..config
    }
    .num_params();
    let per_layer = GptConfig {
        layers: 1,
        ..config
    }
    .num_params()
        - fixed;
    params.saturating_sub(fixed) / per_layer
}
