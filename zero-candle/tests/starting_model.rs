//! Every rank starts from the same model: a plain `VarMap` with Candle's
//! random initializers (other values on every rank) trains, at any world
//! size and stage, the weights a one-rank run trains from rank 0's values;
//! `StartingModel::Verify` refuses ranks that differ, naming the parameter.

use candle_core::{DType, Device, Module, Tensor, Var};
use candle_nn::{VarBuilder, VarMap};
use zero_candle::{nn, ShardedVarMap, ZeroHook, ZeroOptimizer};
use zero_core::engine::{EngineConfig, Stage, StartingModel};
use zero_core::optim::{Sgd, SgdConfig};
use zero_core::{Communicator, ThreadComm, ThreadGroup};

mod nn_support;

/// Rows of the global batch: divisible by every world size tested.
const BATCH: usize = 12;
const STEPS: usize = 4;

/// Two hooked layers; Candle draws their initial values.
struct Net {
    hidden: nn::Linear,
    output: nn::Linear,
}

impl Net {
    fn new(varmap: &VarMap, hook: &std::sync::Arc<ZeroHook<ThreadComm, f32>>) -> Net {
        let vb = VarBuilder::from_varmap(varmap, DType::F32, &Device::Cpu);
        Net {
            hidden: nn::linear(3, 8, vb.pp("hidden"), Some(hook.clone())).unwrap(),
            output: nn::linear(8, 2, vb.pp("output"), Some(hook.clone())).unwrap(),
        }
    }

    fn loss(&self, x: &Tensor, y: &Tensor) -> candle_core::Result<Tensor> {
        let out = self.output.forward(&self.hidden.forward(x)?.tanh()?)?;
        (out - y)?.sqr()?.mean_all()
    }
}

fn batch(step: usize, rows: std::ops::Range<usize>) -> (Tensor, Tensor) {
    nn_support::regression_rows(step, BATCH, rows, (3, 2))
}

fn sorted_vars(varmap: &VarMap) -> Vec<(String, Var)> {
    let mut vars: Vec<_> = varmap
        .data()
        .lock()
        .unwrap()
        .iter()
        .map(|(n, v)| (n.clone(), v.clone()))
        .collect();
    vars.sort_by(|a, b| a.0.cmp(&b.0));
    vars
}

fn values(t: &Tensor) -> Vec<f32> {
    t.flatten_all().unwrap().to_vec1::<f32>().unwrap()
}

fn config(stage: Stage) -> EngineConfig {
    // Small buckets: the broadcast runs in several pieces, and a parameter
    // straddles two of them.
    EngineConfig::default()
        .with_stage(stage)
        .with_bucket_bytes(64)
        .with_persist_numel(0)
}

/// SGD with momentum: unlike Adam, it does not magnify the rounding of a
/// near-zero gradient into a full step, so runs that add the same
/// gradients in another order stay within float noise.
fn sgd() -> Box<Sgd> {
    Box::new(Sgd::new(SgdConfig::default().with_lr(0.1).with_momentum(0.9)).unwrap())
}

/// What one rank saw: its values before and after construction, and the
/// trained weights.
struct RankRun {
    before: Vec<Vec<f32>>,
    after: Vec<Vec<f32>>,
    trained: Vec<Vec<f32>>,
}

fn train_rank(comm: ThreadComm, stage: Stage) -> zero_candle::Result<RankRun> {
    let (rank, world_size) = (comm.rank(), comm.world_size());
    let hook = ZeroHook::<ThreadComm, f32>::new();
    let varmap = VarMap::new();
    let net = Net::new(&varmap, &hook);
    let before = sorted_vars(&varmap)
        .iter()
        .map(|(_, v)| values(v.as_tensor()))
        .collect();
    let mut opt = ZeroOptimizer::new(&varmap, comm, config(stage), sgd())?.with_hook(&hook)?;
    let after = opt.vars().iter().map(|v| values(v.as_tensor())).collect();
    let rows = BATCH / world_size;
    for step in 0..STEPS {
        let (x, y) = batch(step, rank * rows..(rank + 1) * rows);
        opt.backward_step(&net.loss(&x, &y)?)?;
    }
    let trained = opt.full_weights()?.iter().map(|(_, w)| values(w)).collect();
    Ok(RankRun {
        before,
        after,
        trained,
    })
}

/// One rank, the whole batch, from `start`'s values.
fn reference(start: &[Vec<f32>]) -> Vec<Vec<f32>> {
    let runs = ThreadGroup::new(1).run(|comm| -> zero_candle::Result<Vec<Vec<f32>>> {
        let hook = ZeroHook::<ThreadComm, f32>::new();
        let varmap = VarMap::new();
        let net = Net::new(&varmap, &hook);
        for ((_, var), values) in sorted_vars(&varmap).iter().zip(start) {
            var.set(&Tensor::from_slice(values, var.shape(), &Device::Cpu)?)?;
        }
        let mut opt =
            ZeroOptimizer::new(&varmap, comm, config(Stage::Ddp), sgd())?.with_hook(&hook)?;
        for step in 0..STEPS {
            let (x, y) = batch(step, 0..BATCH);
            opt.backward_step(&net.loss(&x, &y)?)?;
        }
        Ok(opt.full_weights()?.iter().map(|(_, w)| values(w)).collect())
    });
    runs.into_iter().next().unwrap().unwrap().unwrap()
}

#[test]
fn every_rank_trains_the_one_rank_run_from_rank_zeros_values() {
    for world_size in 1..=4 {
        for stage in [
            Stage::Ddp,
            Stage::OptimizerState,
            Stage::Gradients,
            Stage::Parameters,
        ] {
            let what = format!("world size {world_size}, stage {}", stage.number());
            let runs: Vec<RankRun> = ThreadGroup::new(world_size)
                .run(|comm| train_rank(comm, stage))
                .into_iter()
                .map(|r| r.expect("no panic").expect("trained"))
                .collect();
            if world_size > 1 {
                assert_ne!(
                    runs[0].before, runs[1].before,
                    "{what}: Candle drew the same values on two ranks; the test shows nothing"
                );
            }
            let start = &runs[0].before;
            for (rank, run) in runs.iter().enumerate() {
                // Bitwise: the broadcast copies, it does not compute.
                assert!(run.after == *start, "{what}: rank {rank} starts elsewhere");
            }
            let want = reference(start);
            for (rank, run) in runs.iter().enumerate() {
                for (p, (got, want)) in run.trained.iter().zip(&want).enumerate() {
                    for (g, w) in got.iter().zip(want) {
                        assert!(
                            (g - w).abs() <= 1e-5 * w.abs().max(1.0),
                            "{what}: rank {rank}, parameter #{p}: {g} against {w}"
                        );
                    }
                }
                assert_eq!(run.trained, runs[0].trained, "{what}: rank {rank}");
            }
        }
    }
}

/// The same values on every rank, but `output.weight` on rank 2.
fn build_identical_but_one(comm: ThreadComm) -> zero_candle::Result<Vec<Vec<f32>>> {
    let rank = comm.rank();
    let hook = ZeroHook::<ThreadComm, f32>::new();
    let varmap = VarMap::new();
    let _net = Net::new(&varmap, &hook);
    for (name, var) in sorted_vars(&varmap) {
        let n = var.elem_count();
        let mut values: Vec<f32> = (0..n).map(|i| (i as f32).sin()).collect();
        if rank == 2 && name == "output.weight" {
            values[n - 1] += 1e-3;
        }
        var.set(&Tensor::from_vec(values, var.shape(), &Device::Cpu)?)?;
    }
    let config = config(Stage::Gradients).with_starting_model(StartingModel::Verify);
    let opt = ZeroOptimizer::new(&varmap, comm, config, sgd())?;
    Ok(opt.vars().iter().map(|v| values(v.as_tensor())).collect())
}

#[test]
fn verify_refuses_ranks_that_differ_naming_the_parameter_and_copies_nothing() {
    for r in ThreadGroup::new(4).run(build_identical_but_one) {
        let err = r
            .expect("no panic")
            .expect_err("rank 2 differs")
            .to_string();
        assert!(
            err.contains("\"output.weight\"") && err.contains("rank 2"),
            "{err}"
        );
    }
    // Three ranks that agree pass, and keep their values.
    let runs: Vec<_> = ThreadGroup::new(2)
        .run(build_identical_but_one)
        .into_iter()
        .map(|r| r.expect("no panic").expect("the ranks agree"))
        .collect();
    assert_eq!(runs[0], runs[1]);
    // And different random values are refused (the first parameter in
    // name order, `hidden.bias`).
    let results = ThreadGroup::new(2).run(|comm| -> zero_candle::Result<()> {
        let hook = ZeroHook::<ThreadComm, f32>::new();
        let varmap = VarMap::new();
        let _net = Net::new(&varmap, &hook);
        let config = config(Stage::Ddp).with_starting_model(StartingModel::Verify);
        ZeroOptimizer::new(&varmap, comm, config, sgd())?;
        Ok(())
    });
    for r in results {
        let err = r.expect("no panic").expect_err("refused").to_string();
        assert!(
            err.contains("\"hidden.bias\"") && err.contains("rank 1"),
            "{err}"
        );
    }
}

#[test]
fn a_sharded_var_maps_model_needs_new_sharded_and_the_error_says_so() {
    let results = ThreadGroup::new(2).run(|comm| -> zero_candle::Result<()> {
        let hook = ZeroHook::<ThreadComm, f32>::new();
        let map = ShardedVarMap::seeded(3);
        let vb = map.builder(DType::F32, &Device::Cpu);
        let layer = nn::linear(4, 4, vb.pp("layer"), Some(hook.clone()))?;
        assert!(!zero_candle::holds_values(layer.weight()));
        ZeroOptimizer::new(map.varmap(), comm, config(Stage::Gradients), sgd())?;
        Ok(())
    });
    for r in results {
        let err = r.expect("no panic").expect_err("refused").to_string();
        assert!(
            err.contains("layer.bias") && err.contains("new_sharded"),
            "{err}"
        );
    }
}
