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

/// Runs the GPU suite; prints why and adds nothing when there is no GPU.
pub fn run(report: &mut Report) {
    match zero_nccl::cuda_device_count() {
        Ok(n) if n > 0 => {}
        Ok(_) => {
            println!("gpu benchmarks skipped: the CUDA driver reports no device");
            return;
        }
        Err(e) => {
            println!("gpu benchmarks skipped: {e}");
            return;
        }
    }
    if let Err(e) = adam_bandwidth(report) {
        eprintln!("gpu.adam_bw_over_d2d failed: {e}");
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
