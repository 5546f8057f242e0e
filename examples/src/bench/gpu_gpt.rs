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

use super::torch_peer::{run_gpt_peer, PeerArgs, PeerAttention, PeerDevice, PeerDtype};
use super::{largest, Report};
use crate::trainer::{Gpt, GptConfig, GptOps};
use candle_core::{DType, Device, Tensor};
use candle_nn::VarMap;
use rand::{rngs::StdRng, Rng, SeedableRng};
use std::sync::Arc;
use std::time::Instant;
use zero_candle::nn::GradHook;
use zero_candle::{NcclZeroOptimizer, ZeroHook, ZeroOptimizer};
use zero_core::engine::{
    host_available_bytes, EngineConfig, Offload, OffloadTimes, Overlap, Stage,
};
use zero_core::optim::{AdamW, AdamWConfig};
use zero_core::Communicator;
use zero_nccl::cudarc::driver::CudaContext;
use zero_nccl::{CudaThreadComm, CudaThreadGroup, DeviceComm, DevicePool, NcclComm};

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

/// One case's figures.
struct Measured {
    tokens_per_s: f64,
    /// Bytes; `None` when the pool's high-water mark cannot be read.
    peak_bytes: Option<u64>,
    /// The engine's own device bytes (its memory report less what it
    /// offloaded) per parameter, the model's weights included.
    engine_device_bytes_per_param: f64,
    /// What the engine offloaded to host memory, per parameter.
    engine_host_bytes_per_param: f64,
    /// The median step, milliseconds.
    step_ms: f64,
    /// Offload's host times, per timed step on average.
    offload_ms: OffloadMs,
}

/// [`OffloadTimes`] per step, in milliseconds.
#[derive(Default)]
struct OffloadMs {
    landing: f64,
    stepping: f64,
    packing: f64,
    join: f64,
    write_back: f64,
}

impl OffloadMs {
    /// The times of the steps between `before` and `after`.
    fn between(before: OffloadTimes, after: OffloadTimes) -> Self {
        let steps = after.steps.saturating_sub(before.steps).max(1) as f64;
        let ms = |a: std::time::Duration, b: std::time::Duration| {
            a.saturating_sub(b).as_secs_f64() * 1e3 / steps
        };
        Self {
            landing: ms(after.landing, before.landing),
            stepping: ms(after.stepping, before.stepping),
            packing: ms(after.packing, before.packing),
            join: ms(after.join, before.join),
            write_back: ms(after.write_back, before.write_back),
        }
    }
}

/// Which of the GPT suite's cases to run.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Part {
    /// Every case.
    All,
    /// The cases behind the ZeRO figures.
    Zero,
}

/// How a case trains, besides its ops and dtype.
#[derive(Clone, Copy, Default)]
struct Variant {
    /// Activation checkpointing of every block.
    checkpointed: bool,
    /// ZeRO-Offload of the optimizer's side.
    offload: Offload,
    /// Stage 3 (from the first step's end) instead of stage 2.
    stage3: bool,
    /// Offloaded shards in pageable memory (not page-locked).
    pageable: bool,
    /// The offload's host threads (0: rayon's global pool, every core).
    offload_threads: usize,
    /// Offload's transfers on a stream of their own.
    copy_stream: bool,
    /// Offload's write-back sends the f32 masters up (rounded on the
    /// device) instead of the weights rounded to bf16 on the host.
    masters_up: bool,
}

/// Runs the GPT suite (after `gpu::device_present`); `Part::Zero` only
/// the cases behind the ZeRO figures (offload, stage 3, ranks sharing the
/// GPU): no composed ops, checkpointing or PyTorch peers.
pub fn run(report: &mut Report, part: Part) {
    let (device, ctx) = match open_device() {
        Ok(opened) => opened,
        Err(e) => {
            eprintln!("gpu gpt benchmark failed: cannot open CUDA device 0: {e}");
            return;
        }
    };
    println!(
        "bench gpu gpt: {} ({CONFIG:?}, {BATCH} sequences, NcclZeroOptimizer stage 2 at \
         world size 1, AdamW lr {LR}; median of {STEPS} steps after {WARMUP})",
        ctx.name()
            .unwrap_or_else(|e| format!("GPU 0 (name unavailable: {e})"))
    );
    let pool = match DevicePool::of(&ctx) {
        Ok(pool) => Some(pool),
        Err(why) => {
            println!("gpu gpt benchmark: no peak memory figures for our cases: {why}");
            None
        }
    };
    let ids = match random_ids(&device, BATCH) {
        Ok(ids) => ids,
        Err(e) => {
            eprintln!("gpu gpt benchmark failed: cannot put the batch on the GPU: {e}");
            return;
        }
    };

    // One case at a time, each dropped (and the device drained) before the
    // next is built, so that their memory does not overlap.
    let case_on = |ids: &Tensor, name: &str, ops: GptOps, dtype: DType, variant: Variant| match ours(
        &device,
        &ctx,
        pool.as_ref(),
        ids,
        ops,
        dtype,
        variant,
    ) {
        Ok(measured) => Some(measured),
        Err(e) => {
            eprintln!("gpu gpt benchmark: {name} failed: {e}");
            None
        }
    };
    let case_with = |name: &str, ops: GptOps, dtype: DType, variant: Variant| {
        case_on(&ids, name, ops, dtype, variant)
    };
    let case =
        |name: &str, ops: GptOps, dtype: DType| case_with(name, ops, dtype, Variant::default());
    let f32_fused = case("ours f32 fused", GptOps::Fused, DType::F32);
    let f32_composed = (part == Part::All)
        .then(|| case("ours f32 composed", GptOps::Composed, DType::F32))
        .flatten();
    let bf16_fused = case("ours bf16 fused", GptOps::Fused, DType::BF16);

    if let Some(m) = &f32_fused {
        report.add("gpu.gpt_tokens_per_s", m.tokens_per_s, "tokens/s", None);
        if let Some(peak) = m.peak_bytes {
            report.add("gpu.gpt_peak_gb", peak as f64 / 1e9, "GB", None);
        }
    }
    if let Some(m) = &f32_composed {
        report.add(
            "gpu.gpt_composed_tokens_per_s",
            m.tokens_per_s,
            "tokens/s",
            None,
        );
    }
    if let Some(m) = &bf16_fused {
        report.add(
            "gpu.gpt_bf16_tokens_per_s",
            m.tokens_per_s,
            "tokens/s",
            None,
        );
        if let Some(peak) = m.peak_bytes {
            report.add("gpu.gpt_bf16_peak_gb", peak as f64 / 1e9, "GB", None);
        }
    }

    let offloaded = Variant {
        offload: Offload::Optimizer,
        ..Variant::default()
    };
    let bf16_offload = case_with("ours bf16 offload", GptOps::Fused, DType::BF16, offloaded);
    if let (Some(plain), Some(offload)) = (&bf16_fused, &bf16_offload) {
        report.add(
            "gpu.gpt_bf16_offload_step_over_plain",
            plain.tokens_per_s / offload.tokens_per_s,
            "ratio",
            Some("<= 1.5"),
        );
        report.add(
            "gpu.gpt_bf16_engine_device_bytes_per_param",
            plain.engine_device_bytes_per_param,
            "B/param",
            None,
        );
        report.add(
            "gpu.gpt_bf16_offload_engine_device_bytes_per_param",
            offload.engine_device_bytes_per_param,
            "B/param",
            Some("<= 2.5"),
        );
        if let Some(peak) = offload.peak_bytes {
            report.add(
                "gpu.gpt_bf16_offload_peak_gb",
                peak as f64 / 1e9,
                "GB",
                None,
            );
        }
        // Where the offloaded step's host time goes: the step thread's
        // waits for copies and its stepping (both overlap backward), the
        // wait for its last buckets after backward, and the write-back.
        offload_breakdown(report, "offload", plain, offload);
        offload_capacity(report, &ctx, plain, offload);
        // A variant of the offloaded case: its step over the plain one's
        // as figure `gpu.gpt_bf16_offload_{figure}_step_over_plain`.
        let offload_case = |report: &mut Report, name: &str, figure: &str, variant: Variant| {
            let m = case_with(name, GptOps::Fused, DType::BF16, variant)?;
            report.add(
                &format!("gpu.gpt_bf16_offload_{figure}_step_over_plain"),
                plain.tokens_per_s / m.tokens_per_s,
                "ratio",
                None,
            );
            Some(m)
        };
        // With their host time's breakdown: the transfers on a stream of
        // their own (a bucket's copy down beside backward's kernels instead
        // of between them); the f32 masters sent up as they are, against
        // rounding on the host (one more pass over the weights there) for
        // half the bytes.
        for (name, figure, variant) in [
            (
                "ours bf16 offload, copy stream",
                "copy_stream",
                Variant {
                    copy_stream: true,
                    ..offloaded
                },
            ),
            (
                "ours bf16 offload, f32 masters up",
                "masters_up",
                Variant {
                    masters_up: true,
                    ..offloaded
                },
            ),
        ] {
            if let Some(m) = offload_case(report, name, figure, variant) {
                offload_breakdown(report, &format!("offload_{figure}"), plain, &m);
            }
        }
        // What the page-locked shards and the host's thread count are
        // worth: the same step from pageable memory, and on half the cores.
        let pageable = Variant {
            pageable: true,
            ..offloaded
        };
        offload_case(report, "ours bf16 offload pageable", "pageable", pageable);
        let cores = std::thread::available_parallelism().map_or(2, usize::from);
        let half_cores = Variant {
            offload_threads: (cores / 2).max(1),
            ..offloaded
        };
        offload_case(
            report,
            "ours bf16 offload, half the cores",
            "half_cores",
            half_cores,
        );
        // Four times the sequences per step: the GPU's work grows with
        // them, offload's copies and host step do not (report; the goal is
        // the figure at the suite's batch).
        match random_ids(&device, LARGE_BATCH) {
            Ok(large) => {
                let bf16 = |name: &str, variant: Variant| {
                    case_on(&large, name, GptOps::Fused, DType::BF16, variant)
                };
                let large_plain = bf16("ours bf16, large batch", Variant::default());
                let large_offload = bf16("ours bf16 offload, large batch", offloaded);
                if let (Some(plain), Some(offload)) = (large_plain, large_offload) {
                    report.add(
                        "gpu.gpt_bf16_large_batch_offload_step_over_plain",
                        plain.tokens_per_s / offload.tokens_per_s,
                        "ratio",
                        None,
                    );
                    offload_breakdown(report, "large_batch_offload", &plain, &offload);
                }
            }
            Err(e) => eprintln!("gpu gpt benchmark: no large batch on the GPU: {e}"),
        }
    }

    if let Some(m) = &f32_fused {
        report.add(
            "gpu.gpt_f32_engine_device_bytes_per_param",
            m.engine_device_bytes_per_param,
            "B/param",
            Some("<= 17"),
        );
    }
    // Stage 3 at one rank: what the gathers' overlap costs where nothing
    // is sent.
    let f32_stage3 = match ours(
        &device,
        &ctx,
        pool.as_ref(),
        &ids,
        GptOps::Fused,
        DType::F32,
        Variant {
            stage3: true,
            ..Variant::default()
        },
    ) {
        Ok(measured) => Some(measured),
        Err(e) => {
            eprintln!("gpu gpt benchmark: ours f32 stage 3 failed: {e}");
            None
        }
    };
    if let (Some(s2), Some(s3)) = (&f32_fused, &f32_stage3) {
        report.add(
            "gpu.gpt_f32_s3_step_over_s2",
            s2.tokens_per_s / s3.tokens_per_s,
            "ratio",
            Some("<= 1.10"),
        );
        report.add(
            "gpu.gpt_f32_s3_engine_device_bytes_per_param",
            s3.engine_device_bytes_per_param,
            "B/param",
            None,
        );
    }
    shared_gpu(report, &device, &ctx, pool.as_ref());
    if part == Part::Zero {
        return;
    }

    checkpointing(report, &device, &ctx, pool.as_ref());

    // PyTorch in a child process, after our cases have released the GPU's
    // memory: f32 with the trainer's manual attention, and bf16 autocast
    // with SDPA (PyTorch's fast path).
    let peer = |dtype: PeerDtype, attention: PeerAttention| {
        run_gpt_peer(&PeerArgs {
            layers: CONFIG.layers,
            heads: CONFIG.heads,
            d_model: CONFIG.d_model,
            context: CONFIG.context,
            batch: BATCH,
            steps: STEPS,
            warmup: WARMUP,
            device: PeerDevice::Cuda,
            dtype,
            attention,
            threads: None,
            seed: SEED,
            python: "python3".into(),
        })
    };
    match peer(PeerDtype::F32, PeerAttention::Manual) {
        Ok(torch) => {
            println!(
                "bench gpu gpt: PyTorch {} on {}",
                torch.torch_version, torch.device_name
            );
            report.add(
                "gpu.torch_gpt_tokens_per_s",
                torch.tokens_per_s,
                "tokens/s",
                None,
            );
            if let Some(m) = &f32_fused {
                report.add(
                    "gpu.gpt_over_torch",
                    m.tokens_per_s / torch.tokens_per_s,
                    "ratio",
                    Some(">= 0.7"),
                );
            }
            if let Some(theirs) = torch.peak_bytes {
                report.add("gpu.torch_gpt_peak_gb", theirs as f64 / 1e9, "GB", None);
            }
            match (
                f32_fused.as_ref().and_then(|m| m.peak_bytes),
                torch.peak_bytes,
            ) {
                (Some(ours), Some(theirs)) => report.add(
                    "gpu.gpt_peak_over_torch",
                    ours as f64 / theirs as f64,
                    "ratio",
                    Some("<= 1.3"),
                ),
                (None, _) => {
                    println!("gpu gpt benchmark: no gpu.gpt_peak_over_torch: our peak is unknown")
                }
                (_, None) => println!(
                    "gpu gpt benchmark: no gpu.gpt_peak_over_torch: gpt_peer.py reported no \
                     peak memory"
                ),
            }
        }
        Err(e) => println!(
            "gpu gpt benchmark: no PyTorch f32 figures (gpu.gpt_over_torch, \
             gpu.gpt_peak_over_torch): {e}"
        ),
    }
    match peer(PeerDtype::Bf16, PeerAttention::Sdpa) {
        Ok(torch) => {
            report.add(
                "gpu.torch_sdpa_bf16_tokens_per_s",
                torch.tokens_per_s,
                "tokens/s",
                None,
            );
            if let Some(m) = &bf16_fused {
                report.add(
                    "gpu.gpt_bf16_over_torch_sdpa",
                    m.tokens_per_s / torch.tokens_per_s,
                    "ratio",
                    Some(">= 0.5"),
                );
            }
        }
        Err(e) => println!(
            "gpu gpt benchmark: no PyTorch bf16 figures (gpu.gpt_bf16_over_torch_sdpa): {e}"
        ),
    }
}

/// Where an offloaded step's host time goes (figures `gpu.gpt_bf16_{case}_*_ms`):
/// the step thread's waits for copies, its stepping and its rounding of the
/// stepped weights to bf16 (all beside backward), the calling thread's
/// waits for it after backward (for each bucket to write back, and at the
/// end), and the write-back's own time.
fn offload_breakdown(report: &mut Report, case: &str, plain: &Measured, offload: &Measured) {
    let times = &offload.offload_ms;
    println!(
        "{case}: bf16 step {:.1} ms (plain {:.1} ms): step thread waiting for copies {:.1} ms, \
         stepping {:.1} ms, rounding {:.1} ms; after backward, waiting for it {:.1} ms, writing \
         back {:.1} ms",
        offload.step_ms,
        plain.step_ms,
        times.landing,
        times.stepping,
        times.packing,
        times.join,
        times.write_back
    );
    for (name, ms) in [
        ("landing", times.landing),
        ("stepping", times.stepping),
        ("packing", times.packing),
        ("join", times.join),
        ("write_back", times.write_back),
    ] {
        report.add(&format!("gpu.gpt_bf16_{case}_{name}_ms"), ms, "ms", None);
    }
}

/// The largest model one GPU trains with offload over without, projected
/// from the measured engine bytes per parameter (weights, gradients,
/// optimizer state: the device's, and with offload the host's too) and
/// this machine's device memory and available host memory. Activations
/// are left out (they grow with the batch, not the model), so both sizes
/// are upper bounds. A projection, in seconds, of what `bench
/// gpu-largest` measures in minutes ([`largest()`]): offload's reach is set
/// by the host's memory as much as by the GPU's.
fn offload_capacity(report: &mut Report, ctx: &CudaContext, plain: &Measured, offload: &Measured) {
    let (Ok((_, device)), Some(host)) = (ctx.mem_get_info(), host_available_bytes()) else {
        eprintln!("gpu gpt benchmark: no offload capacity figure (memory sizes unknown)");
        return;
    };
    let without = device as f64 / plain.engine_device_bytes_per_param;
    let with = (device as f64 / offload.engine_device_bytes_per_param)
        .min(host as f64 / offload.engine_host_bytes_per_param);
    report.add(
        "gpu.offload_largest_params_projected",
        with / 1e9,
        "B params",
        None,
    );
    report.add(
        "gpu.offload_largest_over_plain_projected",
        with / without,
        "ratio",
        Some(">= 5"),
    );
}

/// Ranks sharing the GPU (`CudaThreadGroup`, as `--backend cuda-threads`).
const SHARED_RANKS: usize = 4;

/// The f32 GPT at stages 0, 2 and 3 on [`SHARED_RANKS`] ranks sharing the
/// GPU (the global batch of [`BATCH`] split between them): each rank's
/// engine device bytes per parameter (its memory report, the model's
/// weights included, and at stage 3 the gather buffers), the pool's peak
/// per rank (at stage 3 it includes the first step, on whole weights), and
/// stage 2's and 3's step times over stage 0's and 2's.
fn shared_gpu(report: &mut Report, device: &Device, ctx: &CudaContext, pool: Option<&DevicePool>) {
    let mut step_s = Vec::new();
    for (stage, name, goal) in [
        (Stage::Ddp, "s0", "<= 17"),
        (Stage::Gradients, "s2", "<= 8"),
        (Stage::Parameters, "s3", "<= 5"),
    ] {
        let measured = ranks_sharing(device, ctx, pool, stage);
        let (seconds, bytes_per_param, peak) = match measured {
            Ok(m) => m,
            Err(e) => {
                eprintln!("gpu gpt benchmark: {SHARED_RANKS} ranks at {stage:?} failed: {e}");
                return;
            }
        };
        let n = SHARED_RANKS;
        report.add(
            &format!("gpu.gpt_f32_n{n}_{name}_engine_bytes_per_param_rank"),
            bytes_per_param,
            "B/param",
            Some(goal),
        );
        if let Some((peak, numel)) = peak {
            report.add(
                &format!("gpu.gpt_f32_n{n}_{name}_peak_bytes_per_param_rank"),
                peak as f64 / n as f64 / numel as f64,
                "B/param",
                None,
            );
        }
        step_s.push(seconds);
    }
    report.add(
        &format!("gpu.gpt_f32_n{SHARED_RANKS}_s2_step_over_s0"),
        step_s[1] / step_s[0],
        "ratio",
        None,
    );
    report.add(
        &format!("gpu.gpt_f32_n{SHARED_RANKS}_s3_step_over_s2"),
        step_s[2] / step_s[1],
        "ratio",
        None,
    );
}

/// Rank 0's figures of one [`shared_gpu`] case: the slowest rank's median
/// step (s), the engine's device bytes per parameter, and the pool's peak
/// over the run with the model's parameter count.
type SharedFigures = (f64, f64, Option<(u64, usize)>);

fn ranks_sharing(
    device: &Device,
    ctx: &CudaContext,
    pool: Option<&DevicePool>,
    stage: Stage,
) -> BenchResult<SharedFigures> {
    // The peak covers the warm-up steps too (the pool is not shared with
    // the rank threads); the first step's peak is the steady one's.
    synchronize(device, ctx)?;
    if let Some(pool) = pool {
        pool.reset_high_water()?;
    }
    let results = CudaThreadGroup::new(SHARED_RANKS).run(|comm| {
        let rank = comm.rank();
        let trained = (|| -> BenchResult<(f64, f64, usize)> {
            let device = Device::new_cuda_with_stream(comm.context().ordinal())?;
            let ids = random_ids(&device, BATCH / SHARED_RANKS)?;
            let varmap = VarMap::new();
            let hook = ZeroHook::<CudaThreadComm, f32>::new();
            let model = Gpt::with_hook_in(
                &varmap,
                CONFIG,
                SEED,
                &device,
                Some(hook.clone() as Arc<dyn GradHook>),
                DType::F32,
            )?
            .with_ops(GptOps::Fused);
            let mut opt = ZeroOptimizer::<CudaThreadComm, f32>::new(
                &varmap,
                comm,
                EngineConfig::default().with_stage(stage),
                Box::new(AdamW::new(AdamWConfig::default().with_lr(LR))?),
            )?
            .with_hook(&hook)?;
            let mut times = Vec::with_capacity(STEPS);
            for step in 0..WARMUP + STEPS {
                if step == WARMUP {
                    device.synchronize()?;
                    opt.engine().comm().barrier()?;
                }
                let started = Instant::now();
                let loss = model.loss(&ids)?;
                opt.backward_step(&loss)?;
                device.synchronize()?;
                if step >= WARMUP {
                    times.push(started.elapsed().as_secs_f64());
                }
            }
            times.sort_by(f64::total_cmp);
            let numel: usize = opt.vars().iter().map(|v| v.elem_count()).sum();
            let bytes = opt.memory_report().on_device() as f64 / numel.max(1) as f64;
            Ok((times[times.len() / 2], bytes, numel))
        })();
        Ok(trained.map_err(|e| format!("rank {rank}: {e}")))
    })?;
    let mut figures = Vec::new();
    for result in results {
        figures.push(result?.map_err(|e| -> Box<dyn std::error::Error> { e.into() })?);
    }
    synchronize(device, ctx)?;
    let peak = pool
        .map(DevicePool::high_water)
        .transpose()?
        .map(|peak| (peak, figures[0].2));
    if let Some(pool) = pool {
        pool.reset_high_water()?;
    }
    let slowest = figures.iter().map(|f| f.0).fold(0.0, f64::max);
    Ok((slowest, figures[0].1, peak))
}

/// Activation checkpointing (`Gpt::with_checkpointing`) at 64 sequences,
/// f32, against the same run without: `gpu.gpt_ckpt_peak_over_plain` and
/// `gpu.gpt_ckpt_tokens_over_plain`.
fn checkpointing(
    report: &mut Report,
    device: &Device,
    ctx: &CudaContext,
    pool: Option<&DevicePool>,
) {
    const CKPT_BATCH: usize = 64;
    let ids = match random_ids(device, CKPT_BATCH) {
        Ok(ids) => ids,
        Err(e) => {
            eprintln!("gpu gpt benchmark: no checkpointing figures: {e}");
            return;
        }
    };
    let run = |checkpointed| {
        let variant = Variant {
            checkpointed,
            ..Variant::default()
        };
        ours(device, ctx, pool, &ids, GptOps::Fused, DType::F32, variant)
    };
    let (plain, recomputed) = match (run(false), run(true)) {
        (Ok(plain), Ok(recomputed)) => (plain, recomputed),
        (Err(e), _) | (_, Err(e)) => {
            eprintln!("gpu gpt benchmark: checkpointing at batch {CKPT_BATCH} failed: {e}");
            return;
        }
    };
    println!(
        "bench gpu gpt: batch {CKPT_BATCH}: {:.0} tokens/s plain, {:.0} checkpointed",
        plain.tokens_per_s, recomputed.tokens_per_s
    );
    report.add(
        "gpu.gpt_ckpt_tokens_over_plain",
        recomputed.tokens_per_s / plain.tokens_per_s,
        "ratio",
        Some(">= 0.7"),
    );
    if let (Some(a), Some(b)) = (plain.peak_bytes, recomputed.peak_bytes) {
        report.add("gpu.gpt_b64_peak_gb", a as f64 / 1e9, "GB", None);
        report.add("gpu.gpt_ckpt_b64_peak_gb", b as f64 / 1e9, "GB", None);
        report.add(
            "gpu.gpt_ckpt_peak_over_plain",
            b as f64 / a as f64,
            "ratio",
            Some("<= 0.35"),
        );
    }
}

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

/// Waits for every stream of the context: Candle's and the engine's.
fn synchronize(device: &Device, ctx: &CudaContext) -> BenchResult<()> {
    device.synchronize()?;
    ctx.synchronize()?;
    Ok(())
}

/// Builds the GPT in `dtype` computing with `ops`, hooked to an
/// `NcclZeroOptimizer` as the trainer does, trains it `WARMUP + STEPS`
/// steps on `ids` and returns the median step's tokens/s and the pool's
/// high-water mark over the timed steps. Everything it built is dropped
/// and the device drained before it returns.
fn ours(
    device: &Device,
    ctx: &CudaContext,
    pool: Option<&DevicePool>,
    ids: &Tensor,
    ops: GptOps,
    dtype: DType,
    variant: Variant,
) -> BenchResult<Measured> {
    let measured = {
        let varmap = VarMap::new();
        let hook = ZeroHook::<NcclComm, f32>::new();
        let model = Gpt::with_hook_in(
            &varmap,
            CONFIG,
            SEED,
            device,
            Some(hook.clone() as Arc<dyn GradHook>),
            dtype,
        )?
        .with_ops(ops)
        .with_checkpointing(variant.checkpointed);
        // No gradient norm and no clipping: the PyTorch peer computes neither.
        let mut opt = NcclZeroOptimizer::new(
            &varmap,
            NcclComm::single(0)?,
            EngineConfig::default()
                .with_stage(match variant.stage3 {
                    true => Stage::Parameters,
                    false => Stage::Gradients,
                })
                .with_offload(variant.offload, variant.offload_threads)
                .with_offload_pin_memory(!variant.pageable)
                .with_offload_copy_stream(variant.copy_stream)
                .with_gather_in_param_dtype(!variant.masters_up)
                // Offloaded, the host steps each bucket as it lands.
                .with_overlap(match variant.offload {
                    Offload::Optimizer => Overlap::Interleaved,
                    Offload::None => Overlap::default(),
                }),
            Box::new(AdamW::new(AdamWConfig::default().with_lr(LR))?),
        )?
        .with_hook(&hook)?;

        let mut times = Vec::with_capacity(STEPS);
        let mut offload_before = OffloadTimes::default();
        for step in 0..WARMUP + STEPS {
            if step == WARMUP {
                // As the peer does: the peak over the timed steps.
                synchronize(device, ctx)?;
                if let Some(pool) = pool {
                    pool.reset_high_water()?;
                }
                offload_before = opt.engine().offload_times();
            }
            let started = Instant::now();
            let loss = model.loss(ids)?;
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
        let numel = opt
            .vars()
            .iter()
            .map(|v| v.elem_count())
            .sum::<usize>()
            .max(1) as f64;
        let memory = opt.memory_report();
        let median = times[times.len() / 2];
        Measured {
            tokens_per_s: (ids.dim(0)? * CONFIG.context) as f64 / median,
            peak_bytes,
            engine_device_bytes_per_param: memory.on_device() as f64 / numel,
            engine_host_bytes_per_param: memory.offloaded as f64 / numel,
            step_ms: median * 1e3,
            offload_ms: OffloadMs::between(offload_before, opt.engine().offload_times()),
        }
    };
    // The case's model, optimizer and communicator are dropped; their
    // asynchronous frees complete before the next case is built.
    synchronize(device, ctx)?;
    if let Some(pool) = pool {
        pool.reset_high_water()?;
    }
    Ok(measured)
}

/// The headline of stage 3 on the GPU (`bench gpu-headline`, not part of
/// `bench gpu`: building the model takes a while): a GPT that does not fit
/// the device at stage 0 with [`SHARED_RANKS`] ranks sharing it trains at
/// stage 3.
///
/// The size is chosen from the device's free memory `F`: d_model 2048, 16
/// heads, context 256, and the most layers whose f32 AdamW training state
/// (16 bytes per parameter: weights, gradients, two moments) is at most
/// `F / 2.5`. At stage 0 every rank holds all of it, `4 x 16 Ψ >= 1.6 F`:
/// it cannot fit; at stage 3 the ranks hold it once between them, leaving
/// the rest for the gathers and activations. A `ShardedVarMap` defers the
/// large weights: each rank computes each on the host in turn, uploads it
/// and keeps its pieces, so the device never holds the whole model. Each
/// rank trains on one sequence for three steps.
pub fn headline(report: &mut Report) {
    if let Err(e) = headline_run(report) {
        eprintln!("gpu headline benchmark failed: {e}");
    }
}

fn headline_run(report: &mut Report) -> BenchResult<()> {
    const STATE_BYTES: usize = 16;
    let (_, ctx) = open_device()?;
    let (free, total) = ctx.mem_get_info()?;
    let config = wide_gpt(0);
    let config = GptConfig {
        layers: layers_within(config, (free as f64 / 2.5) as usize / STATE_BYTES),
        ..config
    };
    if config.layers == 0 {
        return Err(format!("{free} free bytes leave no room for one layer").into());
    }
    let params = config.num_params();
    let stage0_bytes = SHARED_RANKS * STATE_BYTES * params;
    println!(
        "bench gpu-headline: {} ({:.1} of {:.1} GB free); GPT {config:?}, {:.2}B parameters: \
         stage 0 on {SHARED_RANKS} ranks needs {:.1} GB of training state, stage 3 {:.1} GB",
        ctx.name().unwrap_or_default(),
        free as f64 / 1e9,
        total as f64 / 1e9,
        params as f64 / 1e9,
        stage0_bytes as f64 / 1e9,
        (STATE_BYTES * params) as f64 / 1e9,
    );
    let pool = DevicePool::of(&ctx).ok();
    if let Some(pool) = &pool {
        pool.reset_high_water()?;
    }
    let started = Instant::now();
    let results = CudaThreadGroup::new(SHARED_RANKS).run(|comm| {
        let rank = comm.rank();
        let trained = (|| -> BenchResult<(f64, f32)> {
            let device = Device::new_cuda_with_stream(comm.context().ordinal())?;
            let config_engine = EngineConfig::default().with_stage(Stage::Parameters);
            let map = zero_candle::ShardedVarMap::seeded(SEED);
            let hook = ZeroHook::<CudaThreadComm, f32>::new();
            let model = Gpt::build(
                &map,
                config,
                &device,
                Some(hook.clone() as Arc<dyn GradHook>),
                DType::F32,
            )?;
            let mut opt = ZeroOptimizer::<CudaThreadComm, f32>::new_sharded(
                &map,
                comm,
                config_engine,
                Box::new(AdamW::new(AdamWConfig::default().with_lr(LR))?),
                &hook,
            )?;
            let ids = random_ids(&device, 1)?;
            let mut step_s = 0.0;
            let mut loss_value = f32::NAN;
            for _ in 0..3 {
                let started = Instant::now();
                let loss = model.loss(&ids)?;
                loss_value = loss.to_scalar::<f32>()?;
                opt.backward_step(&loss)?;
                device.synchronize()?;
                step_s = started.elapsed().as_secs_f64();
            }
            Ok((step_s, loss_value))
        })();
        Ok(trained.map_err(|e| format!("rank {rank}: {e}")))
    })?;
    let mut figures = Vec::new();
    for result in results {
        figures.push(result?.map_err(|e| -> Box<dyn std::error::Error> { e.into() })?);
    }
    let (step_s, loss) = figures[0];
    if !loss.is_finite() {
        return Err(format!("the loss is {loss}").into());
    }
    println!(
        "bench gpu-headline: trained 3 steps in {:.1} s (the last {step_s:.2} s), loss {loss:.4}",
        started.elapsed().as_secs_f64()
    );
    report.add("gpu.s3_headline_params_b", params as f64 / 1e9, "B", None);
    report.add(
        "gpu.s3_headline_s0_state_over_device",
        stage0_bytes as f64 / total as f64,
        "ratio",
        Some("> 1 (does not fit at stage 0)"),
    );
    if let Some(pool) = &pool {
        report.add(
            "gpu.s3_headline_peak_over_device",
            pool.high_water()? as f64 / total as f64,
            "ratio",
            Some("< 1 (trains at stage 3)"),
        );
    }
    report.add("gpu.s3_headline_step_s", step_s, "s", None);
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

/// The argument `bench gpu-largest` passes a trial for each mode.
const TRIAL_MODES: [(&str, Offload); 2] =
    [("plain", Offload::None), ("offload", Offload::Optimizer)];

/// Sizes `bench gpu-largest` tries per mode (`BENCH_LARGEST_TRIALS`
/// overrides it), and how long each may take.
const LARGEST_TRIALS: usize = 6;
const TRIAL_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(300);

/// `bench gpu-largest` (not part of `bench gpu`: each size is built and
/// trained in a process of its own, minutes in all): the largest bf16 GPT
/// of [`wide_gpt`]'s shape, growing layers, that trains two steps on one
/// GPU at stage 2 (AdamW with f32 masters, one sequence per step) without
/// offload and with `--offload optimizer`, found by trying sizes
/// ([`largest::largest_that_trains`], a child process per size: a size
/// that does not fit may end in the host's OOM killer), starting from a
/// guess of 20 device bytes per parameter without offload and, with it,
/// the fewer of 2.5 device bytes and 17 host bytes per parameter. Prints
/// each mode's largest size and the ratio of their parameters (goal: >=
/// 5). `BENCH_LARGEST_MODES=plain` (or `offload`) runs one mode only.
pub fn largest(report: &mut Report) {
    if let Err(e) = largest_run(report) {
        eprintln!("gpu largest benchmark failed: {e}");
    }
}

fn largest_run(report: &mut Report) -> BenchResult<()> {
    // A bare context (no Candle device, no libraries' handles), released
    // before the trials so that they find the device as it was.
    let ctx = CudaContext::new(0)?;
    let (free, total) = ctx.mem_get_info()?;
    let host = host_available_bytes().unwrap_or(0);
    let name = ctx.name().unwrap_or_default();
    drop(ctx);
    println!(
        "bench gpu-largest: {name} ({:.1} of {:.1} GB free), {:.1} GB of host memory available; \
         {:?} growing layers, bf16, stage 2, AdamW, one sequence per step",
        free as f64 / 1e9,
        total as f64 / 1e9,
        host as f64 / 1e9,
        wide_gpt(0),
    );
    let exe = std::env::current_exe()?;
    // Each mode can run in a call of its own (the offloaded sizes take
    // minutes each): `BENCH_LARGEST_MODES=plain` or `=offload`.
    let modes = std::env::var("BENCH_LARGEST_MODES").unwrap_or_else(|_| "plain,offload".into());
    let trials = match std::env::var("BENCH_LARGEST_TRIALS") {
        Ok(n) => n
            .parse::<usize>()
            .map_err(|e| format!("BENCH_LARGEST_TRIALS={n:?}: {e}"))?,
        Err(_) => LARGEST_TRIALS,
    };
    let mut largest_params = Vec::new();
    for (mode, offload) in TRIAL_MODES {
        if !modes.split(',').any(|m| m.trim() == mode) {
            continue;
        }
        let budget = match offload {
            Offload::None => free as f64 / 20.0,
            Offload::Optimizer => (free as f64 / 2.5).min(host as f64 / 17.0),
        };
        let guess = layers_within(wide_gpt(0), budget as usize).max(1);
        let search = largest::largest_that_trains(guess, trials, |layers| {
            let started = Instant::now();
            let args = [
                "gpu-largest-trial".to_string(),
                layers.to_string(),
                mode.to_string(),
            ];
            let outcome = largest::run_trial(&exe, &args, TRIAL_TIMEOUT);
            println!(
                "bench gpu-largest: {mode}, {layers} layers ({:.2}B parameters): {} ({:.0} s)",
                wide_gpt(layers).num_params() as f64 / 1e9,
                match &outcome {
                    largest::Outcome::Trained => "trained".to_string(),
                    largest::Outcome::Failed(why) => format!("did not train: {why}"),
                },
                started.elapsed().as_secs_f64()
            );
            outcome
        });
        match search.smallest_failed() {
            Some((layers, why)) => println!(
                "bench gpu-largest: {mode}: the smallest size that did not train: {layers} \
                 layers ({why})"
            ),
            None => println!(
                "bench gpu-largest: {mode}: every size tried trained (a lower bound: \
                 {trials} sizes at most)"
            ),
        }
        let Some(layers) = search.largest() else {
            println!("bench gpu-largest: {mode}: no size trained");
            return Ok(());
        };
        let params = wide_gpt(layers).num_params() as f64;
        report.add(
            &format!("gpu.largest_{mode}_layers"),
            layers as f64,
            "layers",
            None,
        );
        report.add(
            &format!("gpu.largest_{mode}_params_b"),
            params / 1e9,
            "B",
            None,
        );
        largest_params.push((mode, params));
    }
    if let [("plain", plain), ("offload", offloaded)] = largest_params[..] {
        report.add(
            "gpu.offload_largest_over_plain",
            offloaded / plain,
            "ratio",
            Some(">= 5"),
        );
    }
    Ok(())
}

/// One size of `bench gpu-largest`, in its own process (`bench
/// gpu-largest-trial LAYERS plain|offload`): builds the GPT and trains it
/// two steps; the exit code says whether it did (0), and the last line of
/// error output why not.
pub fn largest_trial(args: &[String]) -> i32 {
    let parsed = match args {
        [layers, mode] => layers
            .parse::<usize>()
            .ok()
            .filter(|&l| l > 0)
            .zip(TRIAL_MODES.iter().find(|(m, _)| m == mode).map(|(_, o)| *o)),
        _ => None,
    };
    let Some((layers, offload)) = parsed else {
        eprintln!("usage: bench gpu-largest-trial LAYERS plain|offload (LAYERS >= 1)");
        return 2;
    };
    match trial(wide_gpt(layers), offload) {
        Ok(loss) => {
            println!("trained {layers} layers, loss {loss:.4}");
            0
        }
        Err(e) => {
            eprintln!("{e}");
            1
        }
    }
}

/// Trains `config` in bf16 two steps on one sequence ([`largest_trial`]);
/// returns the last loss.
fn trial(config: GptConfig, offload: Offload) -> BenchResult<f32> {
    let (device, ctx) = open_device()?;
    let varmap = VarMap::new();
    let hook = ZeroHook::<NcclComm, f32>::new();
    let model = Gpt::with_hook_in(
        &varmap,
        config,
        SEED,
        &device,
        Some(hook.clone() as Arc<dyn GradHook>),
        DType::BF16,
    )?;
    let mut opt = NcclZeroOptimizer::new(
        &varmap,
        NcclComm::single(0)?,
        EngineConfig::default()
            .with_stage(Stage::Gradients)
            .with_offload(offload, 0)
            .with_overlap(match offload {
                Offload::Optimizer => Overlap::Interleaved,
                Offload::None => Overlap::default(),
            }),
        Box::new(AdamW::new(AdamWConfig::default().with_lr(LR))?),
    )?
    .with_hook(&hook)?;
    let mut rng = StdRng::seed_from_u64(SEED);
    let ids: Vec<u32> = (0..config.context + 1)
        .map(|_| rng.gen_range(0..256))
        .collect();
    let ids = Tensor::from_vec(ids, (1, config.context + 1), &device)?;
    let mut last = f32::NAN;
    for _ in 0..2 {
        let loss = model.loss(&ids)?;
        last = loss.to_dtype(DType::F32)?.to_scalar::<f32>()?;
        if opt.backward_step(&loss)?.is_none() {
            return Err("backward_step did not complete a step at one micro-step".into());
        }
    }
    synchronize(&device, &ctx)?;
    if !last.is_finite() {
        return Err(format!("the loss is {last}").into());
    }
    Ok(last)
}
