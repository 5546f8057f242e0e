//! `bench checkpoint`: the time a step is blocked by a checkpoint, a
//! background save (`save_checkpoint_async`) over a blocking one, for the
//! hooked MLP 1024-4x4096-10 (54.58M parameters, AdamW) at N=2 threads,
//! stages 2 and 3, side by side in one run.
//!
//! Each case trains `STEPS` steps and saves every `EVERY` into a step
//! directory. The blocked time of a save is what its calls take on the
//! training loop's thread, the slowest rank's: the blocking save; or the
//! background save's snapshot, the per-step polls that complete it and the
//! wait for it at the next save or the end. The figure is the mean blocked
//! time per save, background over blocking. The writer threads share the
//! machine's cores with training, which slows the steps between saves;
//! `checkpoint.*_step_over_plain` reports that apart.

use super::Report;
use crate::trainer::Mlp;
use candle_core::Device;
use rand::SeedableRng;
use std::sync::Arc;
use std::time::Instant;
use zero_candle::nn::GradHook;
use zero_candle::{ShardedVarMap, ZeroHook, ZeroOptimizer};
use zero_core::comm::Host;
use zero_core::engine::{EngineConfig, SaveOptions, Stage};
use zero_core::optim::{AdamW, AdamWConfig};
use zero_core::{Communicator, ThreadGroup};

const WORLD: usize = 2;
/// 1024*4096 + 3*4096*4096 + 4096*10 weights and their biases: 54,583,306.
const WIDTHS: [usize; 6] = [1024, 4096, 4096, 4096, 4096, 10];
const BATCH: usize = 8;
const STEPS: usize = 12;
const EVERY: usize = 4;

/// How a case saves.
#[derive(Clone, Copy, PartialEq)]
enum Save {
    Blocking,
    Background,
}

/// What one rank measures: seconds blocked by saves, per save, and the
/// median time of the steps that did not save.
fn train<C>(comm: C, stage: Stage, save: Save, root: &std::path::Path) -> Result<(f64, f64), String>
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
    let checkpoints = zero_core::checkpoint::StepCheckpoints::new(root);
    let mut rng = rand::rngs::StdRng::seed_from_u64(rank as u64);
    let (mut blocked, mut saves, mut step_times) = (0.0, 0, Vec::new());
    for step in 1..=STEPS {
        let started = Instant::now();
        let (x, y) = super::random_batch(&mut rng, BATCH, WIDTHS[0], WIDTHS[5] as i64)
            .map_err(|e| error(&e))?;
        let loss = model
            .forward(&x)
            .and_then(|logits| candle_nn::loss::cross_entropy(&logits, &y))
            .map_err(|e| error(&e))?;
        opt.backward_step(&loss).map_err(|e| error(&e))?;
        let trained = started.elapsed().as_secs_f64();
        let boundary = Instant::now();
        let dir = checkpoints.next_dir(step as u64);
        let due = step % EVERY == 0;
        match (save, due) {
            (Save::Blocking, true) => {
                opt.save_checkpoint(&dir).map_err(|e| error(&e))?;
            }
            (Save::Background, true) => {
                opt.save_checkpoint_async(&dir, &SaveOptions::default())
                    .map_err(|e| error(&e))?;
            }
            (Save::Background, false) => {
                opt.poll_checkpoint().map_err(|e| error(&e))?;
            }
            (Save::Blocking, false) => {}
        }
        if step == STEPS {
            opt.wait_checkpoint().map_err(|e| error(&e))?;
        }
        blocked += boundary.elapsed().as_secs_f64();
        saves += usize::from(due);
        // The first steps warm up; the steps that saved are not training.
        if step > 2 && !due {
            step_times.push(trained);
        }
    }
    step_times.sort_by(f64::total_cmp);
    Ok((blocked / saves as f64, step_times[step_times.len() / 2]))
}

/// The slowest rank's blocked time per save and rank 0's median step.
fn measure(stage: Stage, save: Save) -> Result<(f64, f64), String> {
    let root = std::env::temp_dir().join(format!(
        "zero-bench-checkpoint-{}-{}",
        std::process::id(),
        stage.number()
    ));
    let results = ThreadGroup::new(WORLD).run(|comm| train(comm, stage, save, &root));
    // Best effort: what is left in the temporary directory wastes space.
    let _ = std::fs::remove_dir_all(&root);
    let mut blocked: f64 = 0.0;
    let mut step = None;
    for r in results {
        let (b, s) = r.map_err(|e| e.to_string())??;
        blocked = blocked.max(b);
        step.get_or_insert(s);
    }
    Ok((blocked, step.unwrap_or(f64::NAN)))
}

pub fn run(report: &mut Report) {
    println!(
        "bench checkpoint: hooked MLP {WIDTHS:?} (54.58M parameters), AdamW, {BATCH} rows per \
         rank, N={WORLD} threads, {STEPS} steps saving every {EVERY}: time blocked per save"
    );
    for (stage, name) in [(Stage::Gradients, "s2"), (Stage::Parameters, "s3")] {
        let measured = measure(stage, Save::Blocking)
            .and_then(|blocking| Ok((blocking, measure(stage, Save::Background)?)));
        let ((blocking, plain_step), (background, busy_step)) = match measured {
            Ok(m) => m,
            Err(e) => {
                println!("  {name}: failed: {e}");
                continue;
            }
        };
        println!(
            "  {name}: blocking {:.0} ms, background {:.0} ms per save; steps {:.0} ms, \
             {:.0} ms beside the writer",
            blocking * 1e3,
            background * 1e3,
            plain_step * 1e3,
            busy_step * 1e3
        );
        report.add(
            &format!("checkpoint.{name}_background_over_blocking"),
            background / blocking,
            "x",
            Some("<= 0.1"),
        );
        report.add(
            &format!("checkpoint.{name}_blocking_ms"),
            blocking * 1e3,
            "ms",
            None,
        );
        report.add(
            &format!("checkpoint.{name}_step_over_plain"),
            busy_step / plain_step,
            "x",
            None,
        );
    }
}
