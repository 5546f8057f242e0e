//! A custom optimizer (Lion through `SimpleOptimizer`) trained through
//! `ZeroOptimizer` at stages 0-3 and world sizes 1-4, with a second
//! parameter group and a frozen parameter, gives the weights of one rank
//! on the whole batch; a checkpoint saved at one world size and stage
//! resumes at another as if the run had not stopped.

use candle_core::{DType, Device, Module, Tensor};
use candle_nn::{VarBuilder, VarMap};
use std::path::Path;
use zero_candle::{nn, ZeroHook, ZeroOptimizer};
use zero_core::engine::{EngineConfig, Stage};
use zero_core::optim::{Simple, SimpleOptimizer};
// Through the re-export: no serde of the user's own needed.
use zero_core::serde::{Deserialize, Serialize};
use zero_core::{Communicator, ThreadComm, ThreadGroup};

mod nn_support;

#[derive(Clone, Serialize, Deserialize)]
#[serde(crate = "zero_core::serde")]
struct LionConfig {
    lr: f64,
    betas: (f64, f64),
    weight_decay: f64,
}

/// Lion, as the `zero_core::optim` docs write it.
struct Lion;

impl SimpleOptimizer<f32> for Lion {
    type Config = LionConfig;
    const KIND: &'static str = "lion";
    const STATE: &'static [&'static str] = &["exp_avg"];

    fn update(c: &LionConfig, _: u64, param: &mut [f32], grad: &[f32], state: &mut [Vec<f32>]) {
        let (lr, wd) = (c.lr as f32, c.weight_decay as f32);
        let (b1, b2) = (c.betas.0 as f32, c.betas.1 as f32);
        for ((p, &g), m) in param.iter_mut().zip(grad).zip(&mut state[0]) {
            let update = b1 * *m + (1.0 - b1) * g;
            let sign = if update == 0.0 { 0.0 } else { update.signum() };
            *p = *p * (1.0 - lr * wd) - lr * sign;
            *m = b2 * *m + (1.0 - b2) * g;
        }
    }
}

const BATCH: usize = 12;
const FROZEN: &str = "hidden.bias";

fn lion() -> Box<Simple<Lion, f32>> {
    let config = LionConfig {
        lr: 0.01,
        betas: (0.9, 0.99),
        weight_decay: 0.1,
    };
    Box::new(Simple::new(config).expect("Lion"))
}

fn config(stage: Stage) -> EngineConfig {
    let output = zero_core::serde_json::json!({ "lr": 0.002, "weight_decay": 0.0 });
    EngineConfig::default()
        .with_stage(stage)
        .with_bucket_bytes(96)
        .with_persist_numel(0)
        .with_param_group(
            vec!["output.bias".into(), "output.weight".into()],
            output.as_object().cloned().unwrap_or_default(),
        )
}

fn batch(step: usize, rows: std::ops::Range<usize>) -> (Tensor, Tensor) {
    nn_support::regression_rows(step, BATCH, rows, (4, 2))
}

type Weights = Vec<(String, Vec<f32>)>;

/// Steps `steps` (global step numbers) at `stage` on this rank, loading
/// `load` first and saving into `save` after; the full weights.
fn train(
    comm: ThreadComm,
    stage: Stage,
    steps: std::ops::Range<usize>,
    load: Option<&Path>,
    save: Option<&Path>,
) -> zero_candle::Result<Weights> {
    let (rank, world_size) = (comm.rank(), comm.world_size());
    let hook = ZeroHook::<ThreadComm, f32>::new();
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
    let hidden = nn::linear(4, 16, vb.pp("hidden"), Some(hook.clone()))?;
    let output = nn::linear(16, 2, vb.pp("output"), Some(hook.clone()))?;
    // Candle's random values, made rank 0's by the optimizer; the same on
    // every run for the comparison.
    let mut vars: Vec<_> = varmap.data().lock().unwrap().clone().into_iter().collect();
    vars.sort_by(|a, b| a.0.cmp(&b.0));
    for (i, (_, var)) in vars.iter().enumerate() {
        let n = var.elem_count();
        let values: Vec<f32> = (0..n)
            .map(|j| (((i * 31 + j * 7) % 23) as f32 / 23.0 - 0.5) * 0.5)
            .collect();
        if rank == 0 {
            var.set(&Tensor::from_vec(values, var.shape(), &Device::Cpu)?)?;
        }
    }
    let mut opt = ZeroOptimizer::new(&varmap, comm, config(stage), lion())?.with_hook(&hook)?;
    opt.set_trainable(FROZEN, false)?;
    if let Some(dir) = load {
        opt.load_checkpoint(dir)?;
    }
    let rows = BATCH / world_size;
    for step in steps {
        let (x, y) = batch(step, rank * rows..(rank + 1) * rows);
        let out = output.forward(&hidden.forward(&x)?.tanh()?)?;
        opt.backward_step(&(out - y)?.sqr()?.mean_all()?)?;
    }
    if let Some(dir) = save {
        opt.save_checkpoint(dir)?;
    }
    opt.full_weights()?
        .into_iter()
        .map(|(name, w)| Ok((name, w.flatten_all()?.to_vec1::<f32>()?)))
        .collect()
}

fn run(
    world_size: usize,
    stage: Stage,
    steps: std::ops::Range<usize>,
    load: Option<&Path>,
    save: Option<&Path>,
) -> Vec<Weights> {
    ThreadGroup::new(world_size)
        .run(|comm| train(comm, stage, steps.clone(), load, save))
        .into_iter()
        .enumerate()
        .map(|(rank, r)| match r {
            Ok(Ok(weights)) => weights,
            Ok(Err(e)) => panic!("rank {rank}: {e}"),
            Err(e) => panic!("rank {rank}: {e}"),
        })
        .collect()
}

fn assert_close(what: &str, got: &Weights, want: &Weights) {
    for ((name, got), (_, want)) in got.iter().zip(want) {
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            assert!(
                (g - w).abs() <= 1e-5,
                "{what}: {name}[{i}] is {g}, one rank gives {w}"
            );
        }
    }
}

#[test]
fn lion_through_zero_optimizer_trains_one_ranks_weights_at_every_stage_and_world_size() {
    let want = run(1, Stage::Ddp, 0..4, None, None).remove(0);
    let start = run(1, Stage::Ddp, 0..0, None, None).remove(0);
    let frozen = |w: &Weights| w.iter().find(|(n, _)| n == FROZEN).cloned();
    assert_eq!(frozen(&want), frozen(&start), "the frozen bias moved");
    assert_ne!(want, start, "Lion moved nothing");
    for world_size in 1..=4 {
        for stage in [
            Stage::Ddp,
            Stage::OptimizerState,
            Stage::Gradients,
            Stage::Parameters,
        ] {
            let what = format!("world size {world_size}, stage {}", stage.number());
            for (rank, got) in run(world_size, stage, 0..4, None, None).iter().enumerate() {
                assert_close(&format!("{what}, rank {rank}"), got, &want);
            }
        }
    }
}

#[test]
fn lions_checkpoint_resumes_at_another_world_size_and_stage() {
    let want = run(1, Stage::Ddp, 0..4, None, None).remove(0);
    for (saved_at, resumed_at) in [
        ((4, Stage::Parameters), (1, Stage::Gradients)),
        ((2, Stage::Gradients), (3, Stage::Parameters)),
        ((3, Stage::OptimizerState), (4, Stage::Ddp)),
    ] {
        let dir = tempfile::tempdir().expect("tempdir");
        run(saved_at.0, saved_at.1, 0..2, None, Some(dir.path()));
        let resumed = run(resumed_at.0, resumed_at.1, 2..4, Some(dir.path()), None);
        let what = format!("saved at {saved_at:?}, resumed at {resumed_at:?}");
        for (rank, got) in resumed.iter().enumerate() {
            assert_close(&format!("{what}, rank {rank}"), got, &want);
        }
    }
}
