//! `bench checkpoint`: the time a step is blocked by a checkpoint, a
//! background save (`save_checkpoint_async`) over a blocking one, for the
//! hooked MLP 1024-4x4096-10 (54.58M parameters, AdamW) at N=2 threads,
//! stages 2 and 3, side by side in one run.
//!
//! Each case trains `STEPS` steps and saves every `EVERY` into a step
//! directory (not at the last step, so that a background save has steps to
//! overlap). The blocked time of a save is what its calls take on the
//! training loop's thread, the slowest rank's: the blocking save; or the
//! background save's snapshot, the per-step polls that complete it and any
//! wait for it at the next save (a writer slower than `EVERY` steps shows
//! there). The figure is the median over the saves, background over
//! blocking. A run's first background save also allocates the buffers the
//! later ones reuse, a cost paid once per run, reported beside it
//! (`checkpoint.*_first_over_blocking`); the wait at the end of the run for
//! the last save's writer blocks no step and is reported apart
//! (`checkpoint.*_end_wait_ms`). The writer threads share the machine's
//! cores with training, which slows the steps between saves;
//! `checkpoint.*_step_over_plain` reports that.

use super::{median, Report};
use crate::trainer::Mlp;
use candle_core::Device;
use rand::SeedableRng;
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;
use zero_candle::nn::GradHook;
use zero_candle::{CandleMemory, ShardedVarMap, ZeroHook, ZeroOptimizer};
use zero_core::comm::Host;
use zero_core::engine::{EngineConfig, SaveOptions, Stage};
use zero_core::optim::{AdamW, AdamWConfig};
use zero_core::{Communicator, ThreadGroup};

const WORLD: usize = 2;
/// 1024*4096 + 3*4096*4096 + 4096*10 weights and their biases: 54,583,306.
const WIDTHS: [usize; 6] = [1024, 4096, 4096, 4096, 4096, 10];
const BATCH: usize = 8;
const STEPS: usize = 26;
const EVERY: usize = 6;

/// How a case saves.
#[derive(Clone, Copy, PartialEq)]
pub(super) enum Save {
    Blocking,
    Background,
}

/// What one rank measures, in seconds: per save, the time it blocked the
/// loop (the call; for a background save also the polls until the next
/// save and the wait for it there) and the call alone; the wait at the end
/// for the last background save; and the median step that did not save.
pub(super) struct Measured {
    pub(super) blocked: Vec<f64>,
    pub(super) calls: Vec<f64>,
    pub(super) end_wait: f64,
    pub(super) step: f64,
}

/// How often a run saves: `steps` steps, a save after every `every`-th
/// but the last (so that a background save has steps to overlap).
#[derive(Clone, Copy)]
pub(super) struct Schedule {
    pub(super) steps: usize,
    pub(super) every: usize,
}

/// Trains `opt` for `schedule.steps` steps (`step` runs one, forward and
/// backward, and returns once the device is done), saving into step
/// directories of `root` as `save` says, and measures what the saves cost
/// the loop. `sync` waits for the device after a save's call, so that what
/// the call left queued counts with it.
pub(super) fn timed_saves<C>(
    opt: &mut ZeroOptimizer<C, f32>,
    save: Save,
    root: &Path,
    schedule: Schedule,
    mut step: impl FnMut(&mut ZeroOptimizer<C, f32>) -> Result<(), String>,
    sync: impl Fn() -> Result<(), String>,
) -> Result<Measured, String>
where
    C: Communicator + 'static,
    C::Memory: CandleMemory<f32, C>,
{
    let error = |e: &dyn std::fmt::Display| e.to_string();
    let checkpoints = zero_core::checkpoint::StepCheckpoints::new(root);
    let (mut blocked, mut calls, mut step_times) = (Vec::new(), Vec::new(), Vec::new());
    let mut end_wait = 0.0;
    let Schedule { steps, every } = schedule;
    for at in 1..=steps {
        let started = Instant::now();
        step(opt)?;
        let trained = started.elapsed().as_secs_f64();
        let boundary = Instant::now();
        let dir = checkpoints.next_dir(at as u64);
        let due = at % every == 0 && at < steps;
        match (save, due) {
            (Save::Blocking, true) => {
                opt.save_checkpoint(&dir).map_err(|e| error(&e))?;
                sync()?;
            }
            (Save::Background, true) => {
                // The save waits for the one in flight (counted with that
                // one), then takes its snapshot.
                opt.wait_checkpoint().map_err(|e| error(&e))?;
                if let Some(last) = blocked.last_mut() {
                    *last += boundary.elapsed().as_secs_f64();
                }
                let call = Instant::now();
                opt.save_checkpoint_async(&dir, &SaveOptions::default())
                    .map_err(|e| error(&e))?;
                sync()?;
                calls.push(call.elapsed().as_secs_f64());
                blocked.push(call.elapsed().as_secs_f64());
            }
            (Save::Background, false) => {
                opt.poll_checkpoint().map_err(|e| error(&e))?;
            }
            (Save::Blocking, false) => {}
        }
        let spent = boundary.elapsed().as_secs_f64();
        if at == steps {
            let end = Instant::now();
            opt.wait_checkpoint().map_err(|e| error(&e))?;
            end_wait = end.elapsed().as_secs_f64();
        }
        match (save, due) {
            (Save::Blocking, true) => {
                calls.push(spent);
                blocked.push(spent);
            }
            (Save::Background, false) => {
                if let Some(last) = blocked.last_mut() {
                    *last += spent;
                }
            }
            _ => {}
        }
        // The first steps warm up; the steps that saved are not training.
        if at > 2 && !due {
            step_times.push(trained);
        }
    }
    Ok(Measured {
        blocked,
        calls,
        end_wait,
        step: median(step_times),
    })
}

fn train<C>(comm: C, stage: Stage, save: Save, root: &Path) -> Result<Measured, String>
where
    C: Communicator<Memory = Host> + 'static,
{
    let rank = comm.rank();
    let error = |e: &dyn std::fmt::Display| e.to_string();
    let map = ShardedVarMap::seeded(0);
    let hook = ZeroHook::<C, f32>::new();
    let model = Mlp::build(
        &map,
        &WIDTHS,
        &Device::Cpu,
        Some(hook.clone() as Arc<dyn GradHook>),
        candle_core::DType::F32,
    )
    .map_err(|e| error(&e))?;
    let adamw = AdamW::new(AdamWConfig::default().with_lr(1e-3)).map_err(|e| error(&e))?;
    let config = EngineConfig::default().with_stage(stage);
    let mut opt = ZeroOptimizer::<C, f32>::new_sharded(&map, comm, config, Box::new(adamw), &hook)
        .map_err(|e| error(&e))?;
    let mut rng = rand::rngs::StdRng::seed_from_u64(rank as u64);
    let step = |opt: &mut ZeroOptimizer<C, f32>| {
        let (x, y) = super::random_batch(&mut rng, BATCH, WIDTHS[0], WIDTHS[5] as i64)
            .map_err(|e| error(&e))?;
        let loss = model
            .forward(&x)
            .and_then(|logits| candle_nn::loss::cross_entropy(&logits, &y))
            .map_err(|e| error(&e))?;
        opt.backward_step(&loss).map_err(|e| error(&e))?;
        Ok(())
    };
    let schedule = Schedule {
        steps: STEPS,
        every: EVERY,
    };
    timed_saves(&mut opt, save, root, schedule, step, || Ok(()))
}

/// Per save the slowest rank's times; rank 0's median step.
fn measure(stage: Stage, save: Save) -> Result<Measured, String> {
    let root = std::env::temp_dir().join(format!(
        "zero-bench-checkpoint-{}-{}",
        std::process::id(),
        stage.number()
    ));
    let results = ThreadGroup::new(WORLD).run(|comm| train(comm, stage, save, &root));
    // Best effort: what is left in the temporary directory wastes space.
    let _ = std::fs::remove_dir_all(&root);
    let mut out: Option<Measured> = None;
    for r in results {
        let m = r.map_err(|e| e.to_string())??;
        match out.as_mut() {
            None => out = Some(m),
            Some(o) => {
                let slowest = |a: &mut Vec<f64>, b: &[f64]| {
                    a.iter_mut().zip(b).for_each(|(a, b)| *a = a.max(*b))
                };
                slowest(&mut o.blocked, &m.blocked);
                slowest(&mut o.calls, &m.calls);
                o.end_wait = o.end_wait.max(m.end_wait);
            }
        }
    }
    out.ok_or_else(|| "no rank ran".into())
}

pub fn run(report: &mut Report) {
    println!(
        "bench checkpoint: hooked MLP {WIDTHS:?} (54.58M parameters), AdamW, {BATCH} rows per \
         rank, N={WORLD} threads, {STEPS} steps saving every {EVERY} before the last: time \
         blocked per save"
    );
    for (stage, name) in [(Stage::Gradients, "s2"), (Stage::Parameters, "s3")] {
        let measured = measure(stage, Save::Blocking)
            .and_then(|blocking| Ok((blocking, measure(stage, Save::Background)?)));
        match measured {
            Ok((blocking, background)) => report_saves(
                report,
                &format!("checkpoint.{name}"),
                &blocking,
                &background,
            ),
            Err(e) => println!("  {name}: failed: {e}"),
        }
    }
}

/// Prints the saves' times of a case and reports its figures under
/// `prefix`: background over blocking (the median over the saves), the
/// first background save over blocking, the wait at the end, the blocking
/// save's time and the steps beside the writer over plain ones.
pub(super) fn report_saves(
    report: &mut Report,
    prefix: &str,
    blocking: &Measured,
    background: &Measured,
) {
    let ms = |values: &[f64]| {
        let shown: Vec<String> = values.iter().map(|v| format!("{:.0}", v * 1e3)).collect();
        shown.join(", ")
    };
    println!(
        "  {prefix}: blocked per save: blocking {} ms; background {} ms (the snapshot {} ms), \
         then {:.0} ms at the end; steps {:.0} ms, {:.0} ms beside the writer",
        ms(&blocking.blocked),
        ms(&background.blocked),
        ms(&background.calls),
        background.end_wait * 1e3,
        blocking.step * 1e3,
        background.step * 1e3
    );
    let blocked = median(blocking.blocked.clone());
    let first = background.blocked.first().copied().unwrap_or(f64::NAN);
    report.add(
        &format!("{prefix}_background_over_blocking"),
        median(background.blocked.clone()) / blocked,
        "x",
        Some("<= 0.1"),
    );
    report.add(
        &format!("{prefix}_first_over_blocking"),
        first / blocked,
        "x",
        None,
    );
    report.add(
        &format!("{prefix}_end_wait_ms"),
        background.end_wait * 1e3,
        "ms",
        None,
    );
    report.add(&format!("{prefix}_blocking_ms"), blocked * 1e3, "ms", None);
    report.add(
        &format!("{prefix}_step_over_plain"),
        background.step / blocking.step,
        "x",
        None,
    );
}
