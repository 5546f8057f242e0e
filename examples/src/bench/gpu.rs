//! GPU benchmarks (feature `nccl`): the fused kernels against the device's
//! copy bandwidth, measured in the same run with CUDA events.

use super::Report;
use std::sync::Arc;
use zero_nccl::cudarc::driver::{sys::CUevent_flags, CudaContext, CudaStream};
use zero_nccl::kernels::{AdamHyper, AdamState, FusedKernels};

/// Elements of the benchmark shard (64M f32: 256 MiB per buffer).
const SHARD: usize = 64 << 20;
const WARMUP: usize = 3;
const ITERS: usize = 20;

/// Whether a CUDA device is there to benchmark; prints why not.
pub fn device_present() -> bool {
    match zero_nccl::cuda_device_count() {
        Ok(n) if n > 0 => true,
        Ok(_) => {
            println!("gpu benchmarks skipped: the CUDA driver reports no device");
            false
        }
        Err(e) => {
            println!("gpu benchmarks skipped: {e}");
            false
        }
    }
}

/// Runs the GPU suite (after [`device_present`]).
pub fn run(report: &mut Report) {
    if let Err(e) = adam_bandwidth(report) {
        report.failed("gpu.adam_bw_over_d2d", e);
    }
    if let Err(e) = stage2_steps(report) {
        report.failed("gpu.s2_over_plain_adamw", e);
    }
}

/// Milliseconds per call of `f` on `stream`, averaged over `ITERS` after a warm-up.
fn time_ms(
    stream: &Arc<CudaStream>,
    mut f: impl FnMut() -> zero_nccl::Result<()>,
) -> zero_nccl::Result<f64> {
    for _ in 0..WARMUP {
        f()?;
    }
    let start = stream.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
    for _ in 0..ITERS {
        f()?;
    }
    let end = stream.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
    Ok(start.elapsed_ms(&end)? as f64 / ITERS as f64)
}

/// `gpu.adam_bw_over_d2d`: fused Adam's effective bandwidth (28 bytes per
/// parameter: read p, g, m, v; write p, m, v) over device-to-device copy
/// bandwidth (8 bytes per element: read + write). Goal: at least 0.7.
fn adam_bandwidth(report: &mut Report) -> zero_nccl::Result<()> {
    let ctx = CudaContext::new(0)?;
    let stream = ctx.new_stream()?;
    let kernels = FusedKernels::new(&ctx)?;
    let hyper = AdamHyper::default();
    let init: Vec<f32> = (0..SHARD).map(|i| (i % 1000) as f32 * 1e-3).collect();
    let mut params = stream.clone_htod(&init)?;
    let grads = stream.clone_htod(&init)?;
    let mut state = AdamState::new(&stream, SHARD, &hyper)?;
    let adam_ms = time_ms(&stream, || {
        kernels.adam_step(&stream, &mut params, &grads, &mut state, &hyper)
    })?;

    let src = stream.clone_htod(&init)?;
    let mut dst = stream.alloc_zeros::<f32>(SHARD)?;
    let copy_ms = time_ms(&stream, || Ok(stream.memcpy_dtod(&src, &mut dst)?))?;

    let adam_gbs = 28.0 * SHARD as f64 / (adam_ms * 1e6);
    let copy_gbs = 8.0 * SHARD as f64 / (copy_ms * 1e6);
    report.add("gpu.adam_gbs", adam_gbs, "GB/s", None);
    report.add("gpu.d2d_gbs", copy_gbs, "GB/s", None);
    report.add(
        "gpu.adam_bw_over_d2d",
        adam_gbs / copy_gbs,
        "ratio",
        Some(">= 0.7"),
    );
    Ok(())
}

/// Widths of the step benchmark's MLP (about 50M f32 parameters).
const MODEL: [usize; 5] = [1024, 4096, 4096, 4096, 1024];
const BATCH: usize = 64;

/// `gpu.s2_over_plain_adamw`: one training step (forward, backward,
/// optimizer) of the same Candle model on the GPU with `NcclZeroOptimizer`
/// at stage 2 and world size 1, over the same step with candle-nn's AdamW.
/// Goal: at most 1.05. `gpu.bf16_over_f32_s2`: the step of the model in
/// bf16 (f32 master weights and AdamW state in the engine) over the f32
/// one, both at stage 2. `gpu.hooked_over_grad_store_s2`: the f32 step with
/// the layers handing their gradients to a `ZeroHook` during backward
/// (`backward_step`; each bucket's reduction queued as it fills) over the
/// same step through Candle's `GradStore`. Timed on the host around a
/// device synchronization, alternating the four so drift hits each.
fn stage2_steps(report: &mut Report) -> Result<(), Box<dyn std::error::Error>> {
    use crate::trainer::Mlp;
    use candle_core::{DType, Device, Tensor};
    use candle_nn::{Optimizer, VarMap};
    use std::time::Instant;
    use zero_candle::NcclZeroOptimizer;
    use zero_core::engine::{EngineConfig, Stage};
    use zero_core::optim::{AdamW, AdamWConfig};
    use zero_nccl::NcclComm;

    let device = Device::new_cuda(0)?;
    let x = Tensor::randn(0f32, 1.0, (BATCH, MODEL[0]), &device)?;
    let y = Tensor::zeros(BATCH, DType::U32, &device)?;
    let hook = zero_candle::ZeroHook::<NcclComm, f32>::new();
    let build = |dtype: DType, hooked: bool| -> Result<(VarMap, Mlp), Box<dyn std::error::Error>> {
        let varmap = VarMap::new();
        let hook = hooked.then(|| hook.clone() as std::sync::Arc<dyn zero_candle::nn::GradHook>);
        let model = Mlp::with_hook_in(&varmap, &MODEL, 0, &device, hook, dtype)
            .map_err(|e| e.to_string())?;
        Ok((varmap, model))
    };
    let step_with =
        |model: &Mlp,
         dtype: DType,
         opt: &mut dyn FnMut(&candle_core::backprop::GradStore) -> candle_core::Result<()>|
         -> candle_core::Result<()> {
            let logits = model.forward(&x.to_dtype(dtype)?)?.to_dtype(DType::F32)?;
            let loss = candle_nn::loss::cross_entropy(&logits, &y)?;
            opt(&loss.backward()?)
        };
    let zero_optimizer = |vars: &VarMap| -> Result<NcclZeroOptimizer, Box<dyn std::error::Error>> {
        Ok(NcclZeroOptimizer::new(
            vars,
            NcclComm::single(0)?,
            EngineConfig::default().with_stage(Stage::Gradients),
            Box::new(AdamW::new(AdamWConfig::default())?),
        )?)
    };

    let (plain_vars, plain_model) = build(DType::F32, false)?;
    let mut plain =
        candle_nn::AdamW::new(plain_vars.all_vars(), candle_nn::ParamsAdamW::default())?;
    let (zero_vars, zero_model) = build(DType::F32, false)?;
    let mut zero = zero_optimizer(&zero_vars)?;
    let (bf16_vars, bf16_model) = build(DType::BF16, false)?;
    let mut bf16 = zero_optimizer(&bf16_vars)?;
    let (hooked_vars, hooked_model) = build(DType::F32, true)?;
    let mut hooked = zero_optimizer(&hooked_vars)?.with_hook(&hook)?;

    let mut times: [Vec<f64>; 4] = Default::default();
    for i in 0..(WARMUP + ITERS) {
        let mut timed = |k: usize, f: &mut dyn FnMut() -> candle_core::Result<()>| {
            let t = Instant::now();
            let outcome = f().and_then(|()| device.synchronize());
            if i >= WARMUP {
                times[k].push(t.elapsed().as_secs_f64());
            }
            outcome
        };
        timed(0, &mut || {
            step_with(&plain_model, DType::F32, &mut |g| plain.step(g))
        })?;
        timed(1, &mut || {
            step_with(&zero_model, DType::F32, &mut |g| {
                zero.step(g).map(drop).map_err(Into::into)
            })
        })?;
        timed(2, &mut || {
            step_with(&bf16_model, DType::BF16, &mut |g| {
                bf16.step(g).map(drop).map_err(Into::into)
            })
        })?;
        timed(3, &mut || {
            let logits = hooked_model.forward(&x)?;
            let loss = candle_nn::loss::cross_entropy(&logits, &y)?;
            hooked.backward_step(&loss).map(drop).map_err(Into::into)
        })?;
    }
    let [plain_ms, zero_ms, bf16_ms, hooked_ms] = times.map(|mut v| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2] * 1e3
    });
    report.add("gpu.plain_adamw_step_ms", plain_ms, "ms", None);
    report.add("gpu.s2_step_ms", zero_ms, "ms", None);
    report.add(
        "gpu.s2_over_plain_adamw",
        zero_ms / plain_ms,
        "ratio",
        Some("<= 1.05"),
    );
    report.add("gpu.bf16_s2_step_ms", bf16_ms, "ms", None);
    report.add("gpu.bf16_over_f32_s2", bf16_ms / zero_ms, "ratio", None);
    report.add("gpu.hooked_s2_step_ms", hooked_ms, "ms", None);
    report.add(
        "gpu.hooked_over_grad_store_s2",
        hooked_ms / zero_ms,
        "ratio",
        None,
    );
    Ok(())
}
