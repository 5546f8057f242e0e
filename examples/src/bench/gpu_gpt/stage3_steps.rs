//! Where a stage-3 step's time goes on the GPU, beside stage 2's (`bench
//! gpu-stage3`): the GPT 12 x 768 at one rank on NCCL (f32 and bf16) and on
//! four ranks sharing the GPU (f32), each step cut into its forward and its
//! backward with the optimizer step, each part timed twice: on the host
//! (how long the call took to return) and on the compute stream (CUDA events
//! recorded around it). A part whose host time is close to its stream time
//! is bound by the host (launches, host waits); the stream time beyond the
//! other stage's is device work or the stream waiting on the gathers. Stage
//! 3 runs with the device's gather budgets and, beside them, with the
//! host's (a layer in 1 MiB pieces, the budgets every memory had before
//! they followed the memory), and with the device's budgets and 32 MiB
//! buckets (a collective per bucket of a layer: the default 4 MiB makes
//! about seven per layer); the fetcher's counters say how many gathers a
//! step issued and how many requests found none issued ahead.

use super::{
    hooked_gpt, open_device, random_ids, synchronize, BenchResult, BATCH, CONFIG, SHARED_RANKS,
};
use crate::bench::Report;
use crate::trainer::Gpt;
use candle_core::{DType, Device, Tensor};
use std::sync::Arc;
use std::time::Instant;
use zero_candle::{CandleMemory, ZeroOptimizer};
use zero_core::engine::{EngineConfig, FetchStats, GatherBudgets, Stage};
use zero_core::Communicator;
use zero_nccl::cudarc::driver::sys::CUevent_flags;
use zero_nccl::cudarc::driver::{CudaContext, CudaEvent, CudaStream};
use zero_nccl::{CudaThreadGroup, DeviceComm, NcclComm};

/// Fewer steps than `bench gpu`'s: the breakdown wants medians, not
/// throughput, and four-rank stage 3 steps are long.
const WARMUP: usize = 3;
const STEPS: usize = 10;

/// What the case runs: the stage and, at stage 3, whose gather budgets.
#[derive(Clone, Copy)]
enum Case {
    Stage2,
    Stage3,
    /// Stage 3 with the host's budgets (`GatherBudgets::HOST`).
    Stage3Pieces,
    /// Stage 3 with the device's budgets and buckets eight times the
    /// default 4 MiB: a layer of the 12 x 768 GPT (28 MB in f32) gathered
    /// in one or two collectives instead of seven.
    Stage3LargeBuckets,
}

impl Case {
    const ALL: [Case; 4] = [
        Case::Stage2,
        Case::Stage3,
        Case::Stage3Pieces,
        Case::Stage3LargeBuckets,
    ];

    fn name(self) -> &'static str {
        match self {
            Case::Stage2 => "s2",
            Case::Stage3 => "s3",
            Case::Stage3Pieces => "s3_host_budgets",
            Case::Stage3LargeBuckets => "s3_32mib_buckets",
        }
    }

    fn config(self) -> EngineConfig {
        let config = EngineConfig::default();
        match self {
            Case::Stage2 => config.with_stage(Stage::Gradients),
            Case::Stage3 => config.with_stage(Stage::Parameters),
            Case::Stage3Pieces => {
                let host = GatherBudgets::HOST;
                config
                    .with_stage(Stage::Parameters)
                    .with_gather_bytes(host.gather_bytes)
                    .with_prefetch_bytes(host.prefetch_bytes)
                    .with_max_live_bytes(host.max_live_bytes)
            }
            Case::Stage3LargeBuckets => config
                .with_stage(Stage::Parameters)
                .with_bucket_bytes(32 << 20),
        }
    }
}

/// The medians of one case's timed steps, in milliseconds, and the
/// fetcher's counters per step.
#[derive(Default)]
struct Phases {
    forward_host: f64,
    forward_stream: f64,
    backward_host: f64,
    backward_stream: f64,
    /// The whole step, until every stream of the context is drained.
    step: f64,
    gathers: f64,
    misses: f64,
}

/// One step's times, before the medians.
struct StepTimes([f64; 5]);

/// `bench gpu-stage3` (not part of `bench gpu`).
pub fn stage3(report: &mut Report) {
    if let Err(e) = stage3_run(report) {
        report.failed("gpu stage-3 breakdown", e);
    }
}

fn stage3_run(report: &mut Report) -> BenchResult<()> {
    let (device, ctx) = open_device()?;
    println!(
        "bench gpu-stage3: {}; GPT {CONFIG:?}, {BATCH} sequences per step; medians of {STEPS} \
         steps after {WARMUP}, in ms: host = until the call returned, stream = between CUDA \
         events on the compute stream",
        ctx.name().unwrap_or_default()
    );
    for dtype in [DType::F32, DType::BF16] {
        let mut cases = Vec::new();
        for case in Case::ALL {
            let measured = one_rank(&device, &ctx, dtype, case);
            synchronize(&device, &ctx)?;
            match measured {
                Ok(phases) => cases.push((case, phases)),
                Err(e) => {
                    let what = format!("gpu stage-3 breakdown: {dtype:?} {}", case.name());
                    report.failed(&what, e);
                }
            }
        }
        add_cases(
            report,
            &format!("gpu.stage3.{}_n1", dtype_name(dtype)),
            &cases,
        );
    }
    let mut cases = Vec::new();
    for case in Case::ALL {
        match ranks_sharing(case) {
            Ok(phases) => cases.push((case, phases)),
            Err(e) => {
                let what = format!(
                    "gpu stage-3 breakdown: {SHARED_RANKS} ranks, {}",
                    case.name()
                );
                report.failed(&what, e);
            }
        }
        synchronize(&device, &ctx)?;
    }
    add_cases(report, &format!("gpu.stage3.f32_n{SHARED_RANKS}"), &cases);
    Ok(())
}

fn dtype_name(dtype: DType) -> &'static str {
    match dtype {
        DType::BF16 => "bf16",
        _ => "f32",
    }
}

/// Each case's phases, and each stage-3 case's step over stage 2's.
fn add_cases(report: &mut Report, prefix: &str, cases: &[(Case, Phases)]) {
    for (case, p) in cases {
        let name = case.name();
        for (phase, value) in [
            ("forward_host_ms", p.forward_host),
            ("forward_stream_ms", p.forward_stream),
            ("backward_host_ms", p.backward_host),
            ("backward_stream_ms", p.backward_stream),
            ("step_ms", p.step),
        ] {
            report.add(&format!("{prefix}_{name}_{phase}"), value, "ms", None);
        }
        if !matches!(case, Case::Stage2) {
            report.add(
                &format!("{prefix}_{name}_gathers_per_step"),
                p.gathers,
                "count",
                None,
            );
            report.add(
                &format!("{prefix}_{name}_misses_per_step"),
                p.misses,
                "count",
                None,
            );
        }
    }
    let Some((_, s2)) = cases.iter().find(|(c, _)| matches!(c, Case::Stage2)) else {
        return;
    };
    for (case, p) in cases.iter().filter(|(c, _)| !matches!(c, Case::Stage2)) {
        report.add(
            &format!("{prefix}_{}_step_over_s2", case.name()),
            p.step / s2.step,
            "ratio",
            matches!(case, Case::Stage3).then_some("<= 1.10"),
        );
    }
}

/// A timing event on `stream` (cudarc's default events keep no time).
fn timed_event(stream: &Arc<CudaStream>) -> BenchResult<CudaEvent> {
    Ok(stream.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?)
}

/// Trains `model` on `ids` with `opt` for [`WARMUP`] + [`STEPS`] steps,
/// timing each timed step's parts; `drain` waits for every stream the step
/// used.
fn phased<C>(
    device: &Device,
    model: &Gpt,
    ids: &Tensor,
    opt: &mut ZeroOptimizer<C, f32>,
    drain: &dyn Fn() -> BenchResult<()>,
) -> BenchResult<Phases>
where
    C: DeviceComm + Communicator + 'static,
    C::Memory: CandleMemory<f32, C>,
{
    let Device::Cuda(cuda) = device else {
        return Err("the stage-3 breakdown needs a CUDA device".into());
    };
    let stream = cuda.cuda_stream();
    let mut steps = Vec::with_capacity(STEPS);
    let mut stats_before = None;
    for step in 0..WARMUP + STEPS {
        if step == WARMUP {
            drain()?;
            stats_before = opt.fetch_stats();
        }
        let start = timed_event(&stream)?;
        let started = Instant::now();
        let loss = model.loss(ids)?;
        let forward_host = started.elapsed();
        let forwarded = timed_event(&stream)?;
        if opt.backward_step(&loss)?.is_none() {
            return Err("backward_step did not complete a step at one micro-step".into());
        }
        let backward_host = started.elapsed() - forward_host;
        let stepped = timed_event(&stream)?;
        drain()?;
        let step_s = started.elapsed();
        if step >= WARMUP {
            steps.push(StepTimes([
                forward_host.as_secs_f64() * 1e3,
                start.elapsed_ms(&forwarded)? as f64,
                backward_host.as_secs_f64() * 1e3,
                forwarded.elapsed_ms(&stepped)? as f64,
                step_s.as_secs_f64() * 1e3,
            ]));
        }
    }
    let median = |i: usize| {
        let mut values: Vec<f64> = steps.iter().map(|s| s.0[i]).collect();
        values.sort_by(f64::total_cmp);
        values[values.len() / 2]
    };
    let (gathers, misses) = per_step(stats_before, opt.fetch_stats());
    Ok(Phases {
        forward_host: median(0),
        forward_stream: median(1),
        backward_host: median(2),
        backward_stream: median(3),
        step: median(4),
        gathers,
        misses,
    })
}

/// Gathers issued and requests that found no gather issued ahead, per timed
/// step (zero without a fetcher: stage 2).
fn per_step(before: Option<FetchStats>, after: Option<FetchStats>) -> (f64, f64) {
    let (Some(before), Some(after)) = (before, after) else {
        return (0.0, 0.0);
    };
    let gathers = |s: &FetchStats| s.gathers.iter().sum::<u64>();
    let steps = STEPS as f64;
    (
        gathers(&after).saturating_sub(gathers(&before)) as f64 / steps,
        after.misses.saturating_sub(before.misses) as f64 / steps,
    )
}

/// One rank on NCCL, as `--backend nccl`.
fn one_rank(
    device: &Device,
    ctx: &Arc<CudaContext>,
    dtype: DType,
    case: Case,
) -> BenchResult<Phases> {
    let ids = random_ids(device, BATCH)?;
    let (model, mut opt) = hooked_gpt(device, CONFIG, dtype, NcclComm::single(0)?, case.config())?;
    phased(device, &model, &ids, &mut opt, &|| synchronize(device, ctx))
}

/// [`SHARED_RANKS`] ranks sharing the GPU (the global batch split between
/// them), f32: rank 0's parts, and the slowest rank's step.
fn ranks_sharing(case: Case) -> BenchResult<Phases> {
    let results = CudaThreadGroup::new(SHARED_RANKS).run(|comm| {
        let rank = comm.rank();
        let phases = (|| -> BenchResult<Phases> {
            let device = Device::new_cuda_with_stream(comm.context().ordinal())?;
            let ids = random_ids(&device, BATCH / SHARED_RANKS)?;
            let (model, mut opt) = hooked_gpt(&device, CONFIG, DType::F32, comm, case.config())?;
            // Not the context's every stream: the peers' share it.
            let drain = || -> BenchResult<()> { Ok(device.synchronize()?) };
            phased(&device, &model, &ids, &mut opt, &drain)
        })();
        Ok(phases.map_err(|e| format!("rank {rank}: {e}")))
    })?;
    let mut ranks = Vec::new();
    for result in results {
        ranks.push(result?.map_err(|e| -> Box<dyn std::error::Error> { e.into() })?);
    }
    let slowest = ranks.iter().map(|p| p.step).fold(0.0, f64::max);
    let mut rank0 = ranks.swap_remove(0);
    rank0.step = slowest;
    Ok(rank0)
}
