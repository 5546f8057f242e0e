//! Hub models with random weights fine-tuned in bf16 on one GPU as `train
//! --hf` trains them (f32 masters and AdamW state, the layers handing their
//! gradients to a `ZeroHook`), against `transformers`
//! (`examples/pytorch/hf_peer.py --random`: bf16 autocast over f32 weights,
//! SDPA, fused AdamW) at one rank on the same GPU, batch and
//! hyperparameters: tokens/s and peak GPU memory.
//! - GPT-2 small (`Gpt2Config::gpt2_small`, 124M parameters) at stage 2 and
//!   one rank on NCCL;
//! - a Llama of TinyLlama-1.1B's shape at stage 3, at one rank on NCCL and
//!   on four ranks sharing the GPU (`--backend cuda-threads`, the same
//!   global batch).

use super::{synchronize, BenchResult, LR, SEED, SHARED_RANKS, STEPS, WARMUP};
use crate::bench::torch_peer::{run_hf_peer, HfModel, HfPeerArgs};
use crate::bench::Report;
use candle_core::{DType, Device, Tensor};
use rand::{rngs::StdRng, Rng, SeedableRng};
use std::sync::Arc;
use std::time::Instant;
use zero_candle::models::{CausalLm, Gpt2Config, HubConfig, LlamaConfig};
use zero_candle::nn::GradHook;
use zero_candle::{NcclZeroOptimizer, ShardedVarMap, ZeroHook, ZeroOptimizer};
use zero_core::engine::{EngineConfig, Stage};
use zero_core::optim::{AdamW, AdamWConfig};
use zero_core::Communicator;
use zero_nccl::cudarc::driver::CudaContext;
use zero_nccl::{CudaThreadComm, CudaThreadGroup, DeviceComm, DevicePool, NcclComm};

/// One hub model measured against `transformers`.
pub(super) struct HubCase {
    /// The figures' stem: `gpu.<name>_bf16_...`.
    name: &'static str,
    config: HubConfig,
    /// The same shape on the peer's side.
    peer: HfModel,
    /// Sequences per step (over all ranks), on both sides.
    batch: usize,
    /// Predicted tokens per sequence.
    context: usize,
    stage: Stage,
    /// Also measured on [`SHARED_RANKS`] ranks sharing the GPU.
    shared: bool,
}

impl HubCase {
    /// GPT-2 small at stage 2, 8 sequences of its 1024 positions.
    pub(super) fn gpt2_small() -> Self {
        Self {
            name: "gpt2_small",
            config: HubConfig::Gpt2(Gpt2Config::gpt2_small()),
            peer: HfModel::RandomSmall,
            batch: 8,
            context: 1024,
            stage: Stage::Gradients,
            shared: false,
        }
    }

    /// TinyLlama-1.1B's shape (`hf_peer.py`'s `tinyllama`) at stage 3, 4
    /// sequences of 2048 tokens.
    pub(super) fn tinyllama() -> Self {
        // TinyLlama's config.json, as a user's checkpoint gives it.
        let config = LlamaConfig::from_json(&serde_json::json!({
            "model_type": "llama",
            "vocab_size": 32000,
            "hidden_size": 2048,
            "intermediate_size": 5632,
            "num_hidden_layers": 22,
            "num_attention_heads": 32,
            "num_key_value_heads": 4,
            "max_position_embeddings": 2048,
            "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0,
            "tie_word_embeddings": false,
        }))
        .expect("TinyLlama's shape is a valid config");
        Self {
            name: "llama_1b",
            config: HubConfig::Llama(config),
            peer: HfModel::RandomTinyLlama,
            batch: 4,
            context: 2048,
            stage: Stage::Parameters,
            shared: true,
        }
    }

    fn figure(&self, what: &str) -> String {
        format!("gpu.{}_bf16_{what}", self.name)
    }

    /// `[batch, context + 1]` seeded random token ids on `device`.
    fn ids(&self, batch: usize, device: &Device) -> candle_core::Result<Tensor> {
        let mut rng = StdRng::seed_from_u64(SEED);
        let vocab = self.config.vocab_size() as u32;
        let ids: Vec<u32> = (0..batch * (self.context + 1))
            .map(|_| rng.gen_range(0..vocab))
            .collect();
        Tensor::from_vec(ids, (batch, self.context + 1), device)
    }

    /// The step's engine configuration (no gradient norm, no clipping: the
    /// peer computes neither).
    fn engine(&self) -> EngineConfig {
        EngineConfig::default().with_stage(self.stage)
    }
}

/// Every hub case against `transformers`, one after another.
pub(super) fn all_against_transformers(
    report: &mut Report,
    device: &Device,
    ctx: &CudaContext,
    pool: Option<&DevicePool>,
) {
    for case in [HubCase::gpt2_small(), HubCase::tinyllama()] {
        against_transformers(report, device, ctx, pool, &case);
    }
}

/// CUDA device 0 with its memory pool, or `None` (reported as `what`'s
/// failure).
fn open_with_pool(
    report: &mut Report,
    what: &str,
) -> Option<(Device, Arc<CudaContext>, Option<DevicePool>)> {
    match super::open_device() {
        Ok((device, ctx)) => {
            let pool = DevicePool::of(&ctx).ok();
            Some((device, ctx, pool))
        }
        Err(e) => {
            report.failed(&format!("{what} (opening CUDA device 0)"), e);
            None
        }
    }
}

/// `bench gpu-hub`: the hub cases alone.
pub fn hub(report: &mut Report) {
    if let Some((device, ctx, pool)) = open_with_pool(report, "gpu hub benchmark") {
        all_against_transformers(report, &device, &ctx, pool.as_ref());
    }
}

/// `bench gpu-hub-profile` (for `scripts/profile-gpu-step.sh`'s
/// `PROFILE_MODEL`): our side of one hub case alone, at one rank, no
/// peer: `ZERO_BENCH_HUB_CASE` names it (`llama_1b`, the default, or
/// `gpt2_small`), `ZERO_BENCH_HUB_STEPS` its steps (default 4: one
/// untimed, the rest timed).
pub fn hub_profile(report: &mut Report) {
    let name = std::env::var("ZERO_BENCH_HUB_CASE").unwrap_or_else(|_| "llama_1b".into());
    let Some(case) = [HubCase::gpt2_small(), HubCase::tinyllama()]
        .into_iter()
        .find(|c| c.name == name)
    else {
        report.failed(
            "gpu hub profile",
            format!("ZERO_BENCH_HUB_CASE is {name:?}; the cases are llama_1b and gpt2_small"),
        );
        return;
    };
    let steps = match std::env::var("ZERO_BENCH_HUB_STEPS").map(|s| s.parse::<usize>()) {
        Err(_) => 4,
        Ok(Ok(n)) if n >= 2 => n,
        Ok(_) => {
            report.failed(
                "gpu hub profile",
                "ZERO_BENCH_HUB_STEPS must be a whole number of at least 2",
            );
            return;
        }
    };
    let Some((device, ctx, pool)) = open_with_pool(report, "gpu hub profile") else {
        return;
    };
    let steps = Steps {
        warmup: 1,
        timed: steps - 1,
    };
    match one_rank(&device, &ctx, pool.as_ref(), &case, steps) {
        Ok(measured) => report.add(
            &case.figure("profiled_tokens_per_s"),
            measured.tokens_per_s,
            "tokens/s",
            None,
        ),
        Err(e) => report.failed(&format!("gpu {} profile", case.name), e),
    }
}

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
    /// The median step and the host's median time until `backward_step`
    /// returned, seconds.
    times: StepTimes,
}

/// A step's median wall time and the host's median time to issue it (until
/// `backward_step` returned, before the drain): near the step, the host
/// paces it or waits inside it; far below, the GPU does.
#[derive(Clone, Copy)]
struct StepTimes {
    step: f64,
    issued: f64,
}

/// Trains `case` on both sides, ours first (dropped, its memory freed,
/// before the peer starts), and adds `<stem>_{tokens_per_s,peak_gb}`, the
/// same of `transformers` (`<stem>_transformers_*`), ours over theirs
/// (`<stem>_over_transformers`, goal >= 1.0;
/// `<stem>_peak_over_transformers`) and, for a shared case,
/// `<stem>_n4_tokens_per_s` and `<stem>_n4_over_transformers`.
pub(super) fn against_transformers(
    report: &mut Report,
    device: &Device,
    ctx: &CudaContext,
    pool: Option<&DevicePool>,
    case: &HubCase,
) {
    let params = case.config.num_params();
    println!(
        "bench gpu {}: {params} parameters (random), bf16, {} x {} tokens, {:?} at world size \
         1{}, against transformers (SDPA, bf16 autocast)",
        case.name,
        case.batch,
        case.context,
        case.stage,
        if case.shared {
            " and 4 sharing the GPU"
        } else {
            ""
        }
    );
    let ours = match one_rank(device, ctx, pool, case, Steps::BENCH) {
        Ok(measured) => {
            report.add(
                &case.figure("tokens_per_s"),
                measured.tokens_per_s,
                "tokens/s",
                None,
            );
            if let Some(peak) = measured.peak_bytes {
                report.add(&case.figure("peak_gb"), peak as f64 / 1e9, "GB", None);
            }
            let StepTimes { step, issued } = measured.times;
            report.add(&case.figure("step_ms"), step * 1e3, "ms", None);
            report.add(
                &case.figure("host_step_issued_ms"),
                issued * 1e3,
                "ms",
                None,
            );
            Some(measured)
        }
        Err(e) => {
            report.failed(&format!("gpu {} benchmark: ours", case.name), e);
            None
        }
    };
    let shared = case.shared.then(|| match ranks_sharing(device, ctx, case) {
        Ok(tokens_per_s) => {
            let n = SHARED_RANKS;
            report.add(
                &case.figure(&format!("n{n}_tokens_per_s")),
                tokens_per_s,
                "tokens/s",
                None,
            );
            Some(tokens_per_s)
        }
        Err(e) => {
            let what = format!("gpu {} benchmark: {SHARED_RANKS} ranks", case.name);
            report.failed(&what, e);
            None
        }
    });
    let args = HfPeerArgs::random_cuda_bf16(
        case.peer.clone(),
        case.batch,
        case.context,
        STEPS,
        WARMUP,
        adamw_config(),
        SEED,
    );
    let theirs = match run_hf_peer(&args) {
        Ok(theirs) => theirs,
        Err(e) => {
            println!("gpu {} benchmark: no transformers figures: {e}", case.name);
            return;
        }
    };
    println!(
        "bench gpu {}: transformers on torch {} on {}",
        case.name, theirs.torch_version, theirs.device_name
    );
    // Ratios only between models of the same shape.
    if theirs.parameters != Some(params as u64) {
        report.failed(
            &format!("gpu {} benchmark against transformers", case.name),
            format!(
                "hf_peer.py trained {:?} parameters, ours has {params}",
                theirs.parameters
            ),
        );
        return;
    }
    report.add(
        &case.figure("transformers_tokens_per_s"),
        theirs.tokens_per_s,
        "tokens/s",
        None,
    );
    if let Some(peak) = theirs.peak_bytes {
        report.add(
            &case.figure("transformers_peak_gb"),
            peak as f64 / 1e9,
            "GB",
            None,
        );
    }
    if let Some(Some(tokens_per_s)) = shared {
        report.add(
            &case.figure(&format!("n{SHARED_RANKS}_over_transformers")),
            tokens_per_s / theirs.tokens_per_s,
            "ratio",
            None,
        );
    }
    let Some(ours) = ours else { return };
    report.add(
        &case.figure("over_transformers"),
        ours.tokens_per_s / theirs.tokens_per_s,
        "ratio",
        Some(">= 1.0"),
    );
    if let (Some(a), Some(b)) = (ours.peak_bytes, theirs.peak_bytes) {
        report.add(
            &case.figure("peak_over_transformers"),
            a as f64 / b as f64,
            "ratio",
            None,
        );
    }
}

/// Untimed and timed steps: `bench gpu`'s, or a profile's few.
#[derive(Clone, Copy)]
struct Steps {
    warmup: usize,
    timed: usize,
}

impl Steps {
    const BENCH: Self = Self {
        warmup: WARMUP,
        timed: STEPS,
    };
}

/// The median times of `step` on `model`'s loss over `ids`, over
/// `steps.timed` steps after `steps.warmup` (`sync` after each,
/// `at_warmup` once the warm-up is done).
fn median_step(
    steps: Steps,
    model: &CausalLm,
    ids: &Tensor,
    mut step: impl FnMut(&Tensor) -> BenchResult<bool>,
    mut sync: impl FnMut() -> BenchResult<()>,
    mut at_warmup: impl FnMut() -> BenchResult<()>,
) -> BenchResult<StepTimes> {
    let (mut times, mut issued) = (Vec::new(), Vec::new());
    for i in 0..steps.warmup + steps.timed {
        if i == steps.warmup {
            at_warmup()?;
        }
        let started = Instant::now();
        if !step(&model.loss(ids)?)? {
            return Err("backward_step did not complete a step at one micro-step".into());
        }
        let step_issued = started.elapsed();
        sync()?;
        if i >= steps.warmup {
            times.push(started.elapsed().as_secs_f64());
            issued.push(step_issued.as_secs_f64());
        }
    }
    Ok(StepTimes {
        step: crate::bench::median(times),
        issued: crate::bench::median(issued),
    })
}

/// `case` in bf16 with `NcclZeroOptimizer` at one rank on one seeded batch:
/// the median step's tokens/s and the pool's high-water mark over the
/// timed steps. Everything it built is dropped and the device drained
/// before it returns.
fn one_rank(
    device: &Device,
    ctx: &CudaContext,
    pool: Option<&DevicePool>,
    case: &HubCase,
    steps: Steps,
) -> BenchResult<Measured> {
    let ids = case.ids(case.batch, device)?;
    let measured = {
        let map = ShardedVarMap::seeded(SEED);
        let hook = ZeroHook::<NcclComm, f32>::new();
        let model = CausalLm::new(
            map.builder(DType::BF16, device),
            &case.config,
            Some(hook.clone() as Arc<dyn GradHook>),
        )?;
        let mut opt = NcclZeroOptimizer::new_sharded(
            &map,
            NcclComm::single(0)?,
            case.engine(),
            Box::new(AdamW::new(adamw_config())?),
            &hook,
        )?;
        let times = median_step(
            steps,
            &model,
            &ids,
            |loss| Ok(opt.backward_step(loss)?.is_some()),
            || synchronize(device, ctx),
            || {
                // As the peer does: the peak over the timed steps.
                synchronize(device, ctx)?;
                pool.map(DevicePool::reset_high_water).transpose()?;
                Ok(())
            },
        )?;
        Measured {
            tokens_per_s: (case.batch * case.context) as f64 / times.step,
            peak_bytes: pool.map(DevicePool::high_water).transpose()?,
            times,
        }
    };
    // The model, optimizer and communicator are dropped; their
    // asynchronous frees complete before the peer starts.
    synchronize(device, ctx)?;
    pool.map(DevicePool::reset_high_water).transpose()?;
    Ok(measured)
}

/// `case` on [`SHARED_RANKS`] ranks sharing the GPU, the global batch split
/// between them: the global tokens/s at the slowest rank's median step.
fn ranks_sharing(device: &Device, ctx: &CudaContext, case: &HubCase) -> BenchResult<f64> {
    synchronize(device, ctx)?;
    let rows = case.batch / SHARED_RANKS;
    if rows == 0 {
        return Err(format!(
            "{} sequences cannot be split over {SHARED_RANKS} ranks",
            case.batch
        )
        .into());
    }
    let results = CudaThreadGroup::new(SHARED_RANKS).run(|comm| {
        let rank = comm.rank();
        let trained = (|| -> BenchResult<f64> {
            let device = Device::new_cuda_with_stream(comm.context().ordinal())?;
            let ids = case.ids(rows, &device)?;
            let map = ShardedVarMap::seeded(SEED);
            let hook = ZeroHook::<CudaThreadComm, f32>::new();
            let model = CausalLm::new(
                map.builder(DType::BF16, &device),
                &case.config,
                Some(hook.clone() as Arc<dyn GradHook>),
            )?;
            let mut opt = ZeroOptimizer::<CudaThreadComm, f32>::new_sharded(
                &map,
                comm,
                case.engine(),
                Box::new(AdamW::new(adamw_config())?),
                &hook,
            )?;
            median_step(
                Steps::BENCH,
                &model,
                &ids,
                |loss| Ok(opt.backward_step(loss)?.is_some()),
                || Ok(device.synchronize()?),
                || Ok(device.synchronize()?),
            )
            .map(|times| times.step)
        })();
        Ok(trained.map_err(|e| format!("rank {rank}: {e}")))
    })?;
    let mut slowest: f64 = 0.0;
    for result in results {
        let seconds = result?.map_err(|e| -> Box<dyn std::error::Error> { e.into() })?;
        slowest = slowest.max(seconds);
    }
    synchronize(device, ctx)?;
    Ok((case.batch * case.context) as f64 / slowest)
}
