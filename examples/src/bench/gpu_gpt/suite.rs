//! The GPT suite (`bench gpu`, `bench gpu-zero`): which cases run, in what
//! order, and the figures each gives.

use super::case::{ours, Measured, Variant};
use super::{
    hub_models, open_device, peer, random_ids, shared, BATCH, CONFIG, LARGE_BATCH, LR, STEPS,
    WARMUP,
};
use crate::bench::Report;
use crate::trainer::GptOps;
use candle_core::{DType, Device, Tensor};
use std::cell::RefCell;
use zero_core::engine::{host_available_bytes, Offload};
use zero_nccl::cudarc::driver::CudaContext;
use zero_nccl::DevicePool;

/// Which of the GPT suite's cases to run.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Part {
    /// Every case.
    All,
    /// The cases behind the ZeRO figures.
    Zero,
}

/// Runs the GPT suite (after `gpu::device_present`); `Part::Zero` only
/// the cases behind the ZeRO figures (offload, stage 3, ranks sharing the
/// GPU): no composed ops, checkpointing or PyTorch peers.
pub fn run(report: &mut Report, part: Part) {
    let (device, ctx) = match open_device() {
        Ok(opened) => opened,
        Err(e) => {
            report.failed("gpu gpt benchmark (opening CUDA device 0)", e);
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
            report.failed("gpu gpt benchmark (the batch on the GPU)", e);
            return;
        }
    };

    // One case at a time, each dropped (and the device drained) before the
    // next is built, so that their memory does not overlap. A case that
    // fails is noted and reported with the others after them.
    let failed_cases = RefCell::new(Vec::new());
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
            let what = format!("gpu gpt benchmark: {name}");
            failed_cases.borrow_mut().push((what, e.to_string()));
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
    // The Linear layers on Candle's GEMMs and our bias kernels, against
    // the default: cuBLASLt with the bias (and GELU) in the forward GEMM's
    // epilogue and the bias gradient in the weight gradient's.
    let candle_gemm = Variant {
        candle_gemm: true,
        ..Variant::default()
    };
    let plain = |name: &str, dtype: DType| {
        (part == Part::All)
            .then(|| case_with(name, GptOps::Fused, dtype, candle_gemm))
            .flatten()
    };
    let (f32_plain, bf16_plain) = (
        plain("ours f32 Candle GEMM", DType::F32),
        plain("ours bf16 Candle GEMM", DType::BF16),
    );
    for (name, lt, plain) in [
        ("f32", &f32_fused, f32_plain),
        ("bf16", &bf16_fused, bf16_plain),
    ] {
        if let (Some(lt), Some(plain)) = (lt, plain) {
            report.add(
                &format!("gpu.gpt_{name}_cublaslt_over_plain"),
                lt.tokens_per_s / plain.tokens_per_s,
                "x",
                None,
            );
        }
    }

    // The MLP's GELU recomputed in the backward (the default: the hidden
    // layer kept once) against kept from the forward (kept twice).
    for (name, dtype, recomputed) in [
        ("f32", DType::F32, &f32_fused),
        ("bf16", DType::BF16, &bf16_fused),
    ] {
        let kept = (part == Part::All)
            .then(|| {
                case(
                    &format!("ours {name} GELU kept"),
                    GptOps::FusedGeluKept,
                    dtype,
                )
            })
            .flatten();
        let (Some(recomputed), Some(kept)) = (recomputed, kept) else {
            continue;
        };
        report.add(
            &format!("gpu.gpt_{name}_gelu_recomputed_over_kept"),
            recomputed.tokens_per_s / kept.tokens_per_s,
            "x",
            None,
        );
        if let (Some(a), Some(b)) = (recomputed.peak_bytes, kept.peak_bytes) {
            report.add(
                &format!("gpu.gpt_{name}_gelu_recomputed_peak_over_kept"),
                a as f64 / b as f64,
                "x",
                None,
            );
        }
    }

    // The bf16 step waits on the host (the profile): what cudarc's events
    // per allocation cost it.
    let untracked = (part == Part::All)
        .then(|| {
            let variant = Variant {
                untracked: true,
                ..Variant::default()
            };
            case_with("ours bf16 untracked", GptOps::Fused, DType::BF16, variant)
        })
        .flatten();
    if let (Some(plain), Some(untracked)) = (&bf16_fused, untracked) {
        report.add(
            "gpu.gpt_bf16_untracked_over_tracked",
            untracked.tokens_per_s / plain.tokens_per_s,
            "x",
            None,
        );
    }

    // What the engine's pool setting (freed memory kept) saves: the same
    // steps with CUDA's default release threshold.
    let released = Variant {
        released: true,
        ..Variant::default()
    };
    for (name, dtype, retained) in [
        ("f32", DType::F32, &f32_fused),
        ("bf16", DType::BF16, &bf16_fused),
    ] {
        let case_name = format!("ours {name} released");
        let measured = (part == Part::All && pool.is_some())
            .then(|| case_with(&case_name, GptOps::Fused, dtype, released))
            .flatten();
        if let (Some(retained), Some(released)) = (retained, measured) {
            report.add(
                &format!("gpu.gpt_{name}_released_over_retained"),
                released.tokens_per_s / retained.tokens_per_s,
                "x",
                None,
            );
        }
    }

    // Where a step's time goes on the host: issue 53's f32 step took 71.5
    // ms against 59 ms of kernels (the profile), PyTorch's 62 against 60.
    for (name, measured) in [("f32", &f32_fused), ("bf16", &bf16_fused)] {
        if let Some(m) = measured {
            let [forward, step] = m.issued_ms;
            report.add(&format!("gpu.gpt_{name}_step_ms"), m.step_ms, "ms", None);
            report.add(
                &format!("gpu.gpt_{name}_host_forward_issued_ms"),
                forward,
                "ms",
                None,
            );
            report.add(
                &format!("gpu.gpt_{name}_host_step_issued_ms"),
                step,
                "ms",
                None,
            );
        }
    }
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
            Err(e) => report.failed("gpu gpt benchmark: the large batch on the GPU", e),
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
            report.failed("gpu gpt benchmark: ours f32 stage 3", e);
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
    for (what, e) in failed_cases.take() {
        report.failed(&what, e);
    }
    shared::shared_gpu(report, &device, &ctx, pool.as_ref());
    if part == Part::Zero {
        return;
    }

    checkpointing(report, &device, &ctx, pool.as_ref());

    // PyTorch in a child process, after our cases have released the GPU's
    // memory.
    peer::against_torch(report, f32_fused.as_ref(), bf16_fused.as_ref());
    hub_models::all_against_transformers(report, &device, &ctx, pool.as_ref());
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
/// gpu-largest` measures in minutes
/// ([`largest()`](super::largest())): offload's reach is set by the
/// host's memory as much as by the GPU's.
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
            report.failed("gpu gpt benchmark: checkpointing's batch on the GPU", e);
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
            let what = format!("gpu gpt benchmark: checkpointing at batch {CKPT_BATCH}");
            report.failed(&what, e);
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
