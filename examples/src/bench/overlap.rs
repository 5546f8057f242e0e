//! `bench overlap`: an MLP with its `ZeroHook`, stage 2 at N=2 threads,
//! stepped with every overlap schedule in one run, over the thread backend
//! as it is and over a [`Delayed`] link calibrated in the same run so that a
//! step's communication takes as long as its backward (the case hiding
//! communication behind backward is for). Two shapes: the trainer's MLP,
//! whose two large layers hold nearly every parameter, and a deep stack of
//! equal layers (the shape of a transformer's blocks), whose gradients
//! become ready evenly through backward; both also at stage 0, where every
//! collective is a gradient reduction.

use super::Report;
use crate::trainer::{Dataset, Mlp};
use candle_core::{Device, Tensor, Var};
use candle_nn::VarMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};
use zero_candle::nn::{GatheredParam, GradHook};
use zero_candle::{ZeroHook, ZeroOptimizer};
use zero_core::comm::{Delayed, Host};
use zero_core::engine::{EngineConfig, Overlap, Stage};
use zero_core::optim::{AdamW, AdamWConfig};
use zero_core::{Communicator, ThreadGroup};

const WORLD_SIZE: usize = 2;
const BATCH: usize = 64;
const WARMUP: usize = 3;
const STEPS: usize = 15;
const ROUNDS: usize = 3;

/// One model shape measured, and the prefix of its figures.
struct Shape {
    prefix: &'static str,
    hidden: &'static [usize],
    bucket_bytes: usize,
}

/// The trainer's MLP (16-3x1024-4): the second layer's gradient, half the
/// parameters, is among the last ready, so its reductions trail backward.
const WIDE: Shape = Shape {
    prefix: "",
    hidden: &[1024; 3],
    bucket_bytes: 512 << 10,
};

/// 16-12x512-4: one bucket per layer.
const DEEP: Shape = Shape {
    prefix: "deep_",
    hidden: &[512; 12],
    bucket_bytes: 1 << 20,
};

/// A step's communication time on the simulated link over the backward time
/// of a serial step without it.
const COMM_OVER_BACKWARD: f64 = 1.0;

/// Medians of one case on rank 0, in seconds.
#[derive(Clone, Copy, Debug, Default)]
struct Times {
    step: f64,
    forward: f64,
    /// From `backward_step` to the last gradient handed to the hook (the
    /// first layer's: its input needs none, so backward ends there). With
    /// overlap this includes waiting for a bucket buffer to come back.
    backward: f64,
    /// Of `backward`, the time spent handing gradients to the engine:
    /// flattening them into bucket buffers and, with overlap, waiting for a
    /// buffer while reductions are in flight.
    handover: f64,
}

/// What one measured case saw.
struct Measured {
    times: Times,
    /// What the last step's collectives sent from rank 0, counted the way
    /// [`Delayed`] charges them (ring bytes).
    bytes_per_step: u64,
    /// The engine's buckets, and the longest one's ring bytes (what one
    /// reduce-scatter or all-gather of it sends).
    buckets: usize,
    bucket_bytes_sent: usize,
}

/// Hands every gradient on to `inner` (the `ZeroHook`), noting when the
/// last one was handed over and how long handing over took.
struct Timed<H> {
    inner: Arc<H>,
    last: Mutex<Option<(Instant, Duration)>>,
}

impl<H: GradHook> Timed<H> {
    /// Runs one handover, adding its time to the pass's.
    fn timed(&self, handover: impl FnOnce() -> candle_core::Result<()>) -> candle_core::Result<()> {
        let started = Instant::now();
        handover()?;
        let now = Instant::now();
        let mut last = self.last.lock().unwrap_or_else(PoisonError::into_inner);
        let handover = last.map_or(Duration::ZERO, |(_, handover)| handover);
        *last = Some((now, handover + (now - started)));
        Ok(())
    }
}

impl<H: GradHook> GradHook for Timed<H> {
    fn grad_ready(&self, var: &Var, grad: Tensor) -> candle_core::Result<()> {
        self.timed(|| self.inner.grad_ready(var, grad))
    }

    fn block_bytes(&self) -> Option<usize> {
        self.inner.block_bytes()
    }

    fn grad_block_ready(
        &self,
        var: &Var,
        rows: std::ops::Range<usize>,
        grad: Tensor,
    ) -> candle_core::Result<()> {
        self.timed(|| self.inner.grad_block_ready(var, rows, grad))
    }

    fn will_report(&self, var: &Var) {
        self.inner.will_report(var);
    }

    fn will_gather(&self, var: &Var) {
        self.inner.will_gather(var);
    }

    fn gather(&self, var: &Var, piece: usize) -> candle_core::Result<Option<GatheredParam>> {
        self.inner.gather(var, piece)
    }

    fn before_read(&self, var: &Var) -> candle_core::Result<()> {
        self.inner.before_read(var)
    }
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

/// How one case steps: the stage, the overlap schedule, and whether the
/// all-gathers are deferred into the next forward.
type Schedule = (Stage, Overlap, bool);

/// Steps the MLP of `shape` with a `ZeroOptimizer` over `comm`; rank 0's
/// medians.
fn steps<C>(
    comm: C,
    shape: &Shape,
    (stage, overlap, defer): Schedule,
    data: &Dataset,
) -> Result<Measured, String>
where
    C: Communicator<Memory = Host> + 'static,
{
    let rank = comm.rank();
    let varmap = VarMap::new();
    let mut widths = vec![data.width];
    widths.extend(shape.hidden);
    widths.push(data.classes);
    let hook = ZeroHook::<C, f32>::new();
    let timed = Arc::new(Timed {
        inner: hook.clone(),
        last: Mutex::new(None),
    });
    let model = Mlp::with_hook(
        &varmap,
        &widths,
        0,
        &Device::Cpu,
        Some(timed.clone() as Arc<dyn GradHook>),
    )
    .map_err(|e| e.to_string())?;
    let adamw = AdamW::new(AdamWConfig::default().with_lr(1e-3)).map_err(|e| e.to_string())?;
    let config = EngineConfig::default()
        .with_stage(stage)
        .with_bucket_bytes(shape.bucket_bytes)
        .with_overlap(overlap)
        .with_defer_gathers(defer);
    let mut opt = ZeroOptimizer::<C, f32>::new(&varmap, comm, config, Box::new(adamw))
        .and_then(|o| o.with_hook(&hook))
        .map_err(|e| e.to_string())?;
    let (mut step_times, mut forward, mut backward, mut handover) =
        (vec![], vec![], vec![], vec![]);
    let mut bytes_per_step = 0;
    for step in 0..WARMUP + STEPS {
        let sent = opt.bytes_sent();
        let started = Instant::now();
        let (x, y) = data.batch(step as u64, WORLD_SIZE, rank, BATCH);
        let x =
            Tensor::from_vec(x, (BATCH, data.width), &Device::Cpu).map_err(|e| e.to_string())?;
        let y = Tensor::from_vec(y, BATCH, &Device::Cpu).map_err(|e| e.to_string())?;
        let loss = model
            .forward(&x)
            .and_then(|logits| candle_nn::loss::cross_entropy(&logits, &y))
            .map_err(|e| e.to_string())?;
        let forwarded = Instant::now();
        opt.backward_step(&loss).map_err(|e| e.to_string())?;
        let done = Instant::now();
        let (last_grad, handed_over) = timed
            .last
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take()
            .ok_or("no gradient reached the hook")?;
        if step >= WARMUP {
            step_times.push((done - started).as_secs_f64());
            forward.push((forwarded - started).as_secs_f64());
            backward.push((last_grad - forwarded).as_secs_f64());
            handover.push(handed_over.as_secs_f64());
        }
        bytes_per_step = opt.bytes_sent() - sent;
    }
    let layout = opt.engine().sharding().layout();
    let longest = (0..layout.buckets.len())
        .map(|k| layout.bucket_range(k).len())
        .max()
        .unwrap_or(0);
    Ok(Measured {
        times: Times {
            step: median(step_times),
            forward: median(forward),
            backward: median(backward),
            handover: median(handover),
        },
        bytes_per_step,
        buckets: layout.buckets.len(),
        bucket_bytes_sent: longest * std::mem::size_of::<f32>() * (WORLD_SIZE - 1) / WORLD_SIZE,
    })
}

/// One case on a fresh thread group, over a link of `bytes_per_sec` when
/// given (no latency: every bucket's collective is delayed alike, as they
/// are about the same size, and a step's two small all-reduces, the
/// gradient-order check and the trainable mask, hardly at all).
fn measure(
    link: Option<f64>,
    shape: &Shape,
    schedule: Schedule,
    data: &Dataset,
) -> Result<Measured, String> {
    let results = ThreadGroup::new(WORLD_SIZE).run(|comm| match link {
        Some(bytes_per_sec) => steps(
            Delayed::new(comm, Duration::ZERO, bytes_per_sec),
            shape,
            schedule,
            data,
        ),
        None => steps(comm, shape, schedule, data),
    });
    match results.into_iter().next() {
        Some(Ok(r)) => r,
        Some(Err(e)) => Err(e.to_string()),
        None => Err("no rank ran".into()),
    }
}

/// Adds, for each shape (the deep one's names start `overlap.deep_`),
/// `overlap.step_over_serial` (over the calibrated link),
/// `overlap.undelayed_step_over_serial`,
/// `overlap.delayed_interleaved_over_serial`,
/// `overlap.deferred_step_over_serial` (after-backward with the all-gathers
/// deferred into the next forward, over the link),
/// `overlap.undelayed_deferred_over_serial`,
/// `overlap.s0_step_over_serial` (the same at stage 0), and the times they
/// come from.
pub fn run(report: &mut Report) {
    let data = Dataset::synthetic(0);
    for shape in [WIDE, DEEP] {
        if let Err(e) = run_shape(report, &shape, &data) {
            eprintln!(
                "bench overlap, MLP with {} hidden layers: {e}",
                shape.hidden.len()
            );
        }
    }
}

/// The cases of one shape: name, over the link or not, schedule.
type Case = (&'static str, bool, Schedule);

fn run_shape(report: &mut Report, shape: &Shape, data: &Dataset) -> Result<(), String> {
    const S2: Stage = Stage::Gradients;
    // The link is calibrated on serial steps without delay: their backward
    // time (the median of a few runs, as one can fall on a burst of other
    // load), and what their collectives send.
    let mut calibrations = Vec::with_capacity(ROUNDS);
    for _ in 0..ROUNDS {
        let calibration = measure(None, shape, (S2, Overlap::None, false), data)
            .map_err(|e| format!("calibration failed: {e}"))?;
        calibrations.push(calibration);
    }
    calibrations.sort_by(|a, b| a.times.backward.total_cmp(&b.times.backward));
    let calibration = &calibrations[calibrations.len() / 2];
    let comm_time = COMM_OVER_BACKWARD * calibration.times.backward;
    let bytes_per_sec = calibration.bytes_per_step as f64 / comm_time;
    let bucket_delay = calibration.bucket_bytes_sent as f64 / bytes_per_sec;
    println!(
        "bench overlap: MLP {}-{}x{}-{} with ZeroHook, AdamW, stages 2 and 0, {BATCH} rows per \
         rank, N={WORLD_SIZE} threads, {} KiB buckets ({} of them); plain threads and a link \
         of {:.0} MB/s ({:.2} ms per bucket collective; a step's {:.1} MB in {:.1} ms, \
         {COMM_OVER_BACKWARD} x the calibration's backward); median of {STEPS} steps after \
         {WARMUP}, rounds interleaved",
        data.width,
        shape.hidden.len(),
        shape.hidden[0],
        data.classes,
        shape.bucket_bytes >> 10,
        calibration.buckets,
        bytes_per_sec / 1e6,
        bucket_delay * 1e3,
        calibration.bytes_per_step as f64 / 1e6,
        comm_time * 1e3,
    );
    // Stage 0 over the same link: all-reduces, as many bytes as stage 2's
    // reduce-scatters and all-gathers together, all of them gradient
    // reductions that may run during backward.
    let cases: [Case; 9] = [
        ("serial", false, (S2, Overlap::None, false)),
        ("overlapped", false, (S2, Overlap::AfterBackward, false)),
        ("delayed_serial", true, (S2, Overlap::None, false)),
        (
            "delayed_overlapped",
            true,
            (S2, Overlap::AfterBackward, false),
        ),
        (
            "delayed_interleaved",
            true,
            (S2, Overlap::Interleaved, false),
        ),
        ("delayed_deferred", true, (S2, Overlap::AfterBackward, true)),
        ("deferred", false, (S2, Overlap::AfterBackward, true)),
        (
            "delayed_serial_s0",
            true,
            (Stage::Ddp, Overlap::None, false),
        ),
        (
            "delayed_overlapped_s0",
            true,
            (Stage::Ddp, Overlap::AfterBackward, false),
        ),
    ];
    let names: Vec<&str> = cases.iter().map(|c| c.0).collect();
    // The medians of the steps' parts, per case, beside the step medians.
    let mut parts: Vec<Vec<Times>> = vec![Vec::new(); cases.len()];
    let medians = super::interleaved_medians(&names, ROUNDS, |i| {
        let (_, delayed, schedule) = cases[i];
        let measured = measure(delayed.then_some(bytes_per_sec), shape, schedule, data)?;
        parts[i].push(measured.times);
        Ok(measured.times.step)
    })?;
    let part = |case: usize, of: fn(&Times) -> f64| median(parts[case].iter().map(of).collect());
    let p = shape.prefix;
    let mut add = |name: &str, value: f64, unit: &str, goal: Option<&str>| {
        report.add(&format!("overlap.{p}{name}"), value, unit, goal);
    };
    add("backward_ms", calibration.times.backward * 1e3, "ms", None);
    add("link_delay_ms", comm_time * 1e3, "ms", None);
    add("bucket_delay_ms", bucket_delay * 1e3, "ms", None);
    // What the link adds to a serial step (expected: `link_delay_ms`).
    add("comm_ms", (medians[2] - medians[0]) * 1e3, "ms", None);
    add("forward_ms", part(0, |t| t.forward) * 1e3, "ms", None);
    for (case, ((name, _, _), median)) in cases.iter().zip(&medians).enumerate() {
        add(&format!("{name}_ms"), median * 1e3, "ms", None);
        add(
            &format!("{name}_forward_ms"),
            part(case, |t| t.forward) * 1e3,
            "ms",
            None,
        );
        add(
            &format!("{name}_backward_ms"),
            part(case, |t| t.backward) * 1e3,
            "ms",
            None,
        );
        add(
            &format!("{name}_handover_ms"),
            part(case, |t| t.handover) * 1e3,
            "ms",
            None,
        );
    }
    add(
        "step_over_serial",
        medians[3] / medians[2],
        "ratio",
        Some("<= 0.75"),
    );
    add(
        "undelayed_step_over_serial",
        medians[1] / medians[0],
        "ratio",
        Some("<= 1.0"),
    );
    add(
        "delayed_interleaved_over_serial",
        medians[4] / medians[2],
        "ratio",
        Some("< 1.0"),
    );
    add(
        "deferred_step_over_serial",
        medians[5] / medians[2],
        "ratio",
        Some("<= 0.75"),
    );
    add(
        "undelayed_deferred_over_serial",
        medians[6] / medians[0],
        "ratio",
        Some("<= 1.0"),
    );
    add(
        "s0_step_over_serial",
        medians[8] / medians[7],
        "ratio",
        Some("<= 0.75"),
    );
    Ok(())
}
