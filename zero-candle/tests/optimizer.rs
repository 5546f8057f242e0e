//! `ZeroOptimizer` in a Candle training loop: it matches candle-nn's own
//! AdamW on the global batch, skips variables without gradients, ignores
//! integer variables, and reports errors instead of panicking.

use candle_core::{DType, Device, Tensor, Var};
use candle_nn::{AdamW, Module, Optimizer, ParamsAdamW, VarBuilder, VarMap};
use zero_candle::ZeroOptimizer;
use zero_core::engine::{EngineConfig, Stage};
use zero_core::optim::{AdamWConfig, LrDecay, LrSchedule, Sgd, SgdConfig};
use zero_core::{Communicator, ThreadGroup};

const IN: usize = 5;
const OUT: usize = 3;
const ROWS_PER_RANK: usize = 4;

/// Deterministic weights, the same on every rank.
fn model(varmap: &VarMap) -> candle_nn::Linear {
    let vb = VarBuilder::from_varmap(varmap, DType::F32, &Device::Cpu);
    let linear = candle_nn::linear(IN, OUT, vb.pp("layer")).unwrap();
    let data = varmap.data().lock().unwrap();
    let w: Vec<f32> = (0..IN * OUT)
        .map(|i| ((i * 7 % 11) as f32 - 5.0) / 10.0)
        .collect();
    data["layer.weight"]
        .set(&Tensor::from_vec(w, (OUT, IN), &Device::Cpu).unwrap())
        .unwrap();
    data["layer.bias"]
        .set(&Tensor::from_vec(vec![0.1f32, -0.2, 0.3], OUT, &Device::Cpu).unwrap())
        .unwrap();
    linear
}

/// Rows `rank * ROWS_PER_RANK ..` of the global batch of `step`.
fn batch(step: usize, first_row: usize, rows: usize) -> Tensor {
    let x: Vec<f32> = (0..rows * IN)
        .map(|i| (((first_row * IN + i) * 13 + step * 5) % 17) as f32 / 17.0 - 0.5)
        .collect();
    Tensor::from_vec(x, (rows, IN), &Device::Cpu).unwrap()
}

fn loss(model: &candle_nn::Linear, x: &Tensor) -> Tensor {
    // Mean over rows, so ranks' mean gradients equal the global batch's.
    model
        .forward(x)
        .unwrap()
        .sqr()
        .unwrap()
        .sum(1)
        .unwrap()
        .mean_all()
        .unwrap()
}

fn weights(varmap: &VarMap) -> Vec<f32> {
    let data = varmap.data().lock().unwrap();
    let mut names: Vec<_> = data.keys().cloned().collect();
    names.sort();
    names
        .iter()
        .filter(|n| data[*n].dtype() == DType::F32)
        .flat_map(|n| {
            data[n]
                .as_tensor()
                .flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap()
        })
        .collect()
}

#[test]
fn stage_two_on_three_ranks_matches_candle_adamw_on_the_global_batch() {
    let (world, steps, lr, wd) = (3, 8, 0.05, 0.01);
    let reference = {
        let varmap = VarMap::new();
        let linear = model(&varmap);
        let params = ParamsAdamW {
            lr,
            weight_decay: wd,
            ..Default::default()
        };
        let mut opt = AdamW::new(varmap.all_vars(), params).unwrap();
        for step in 0..steps {
            let x = batch(step, 0, world * ROWS_PER_RANK);
            opt.backward_step(&loss(&linear, &x)).unwrap();
        }
        weights(&varmap)
    };
    for stage in [Stage::Ddp, Stage::OptimizerState, Stage::Gradients] {
        let results = ThreadGroup::new(world).run(|comm| {
            let rank = comm.rank();
            let varmap = VarMap::new();
            let linear = model(&varmap);
            let adamw = zero_core::optim::AdamW::new(
                AdamWConfig::default().with_lr(lr).with_weight_decay(wd),
            )
            .unwrap();
            let config = EngineConfig::default()
                .with_stage(stage)
                .with_bucket_bytes(16);
            let mut opt =
                ZeroOptimizer::<_, f32>::new(&varmap, comm, config, Box::new(adamw)).unwrap();
            for step in 0..steps {
                let x = batch(step, rank * ROWS_PER_RANK, ROWS_PER_RANK);
                // Through the candle_nn::Optimizer trait, as a user would.
                Optimizer::backward_step(&mut opt, &loss(&linear, &x)).unwrap();
            }
            weights(&varmap)
        });
        for (rank, result) in results.into_iter().enumerate() {
            let got = result.unwrap();
            for (i, (a, b)) in got.iter().zip(&reference).enumerate() {
                assert!(
                    (a - b).abs() < 1e-5,
                    "{stage:?} rank {rank} element {i}: {a} vs candle-nn's {b}"
                );
            }
        }
    }
}

#[test]
fn variables_without_gradients_are_not_touched_and_integer_variables_ignored() {
    let results = ThreadGroup::new(2).run(|comm| {
        let varmap = VarMap::new();
        let linear = model(&varmap);
        let unused = Var::from_tensor(&Tensor::ones(4, DType::F32, &Device::Cpu).unwrap()).unwrap();
        let counter =
            Var::from_tensor(&Tensor::zeros(2, DType::I64, &Device::Cpu).unwrap()).unwrap();
        {
            let mut data = varmap.data().lock().unwrap();
            data.insert("unused".into(), unused.clone());
            data.insert("counter".into(), counter.clone());
        }
        let sgd = Sgd::new(SgdConfig::default().with_lr(0.1).with_weight_decay(0.5)).unwrap();
        let mut opt =
            ZeroOptimizer::<_, f32>::new(&varmap, comm, EngineConfig::default(), Box::new(sgd))
                .unwrap();
        assert_eq!(opt.names(), ["layer.bias", "layer.weight", "unused"]);
        let before = weights(&varmap);
        opt.backward_step(&loss(&linear, &batch(0, 0, 2))).unwrap();
        let after = weights(&varmap);
        assert_ne!(before, after, "the linear layer must train");
        // Weight decay would move `unused` if it were stepped with a zero gradient.
        assert_eq!(unused.as_tensor().to_vec1::<f32>().unwrap(), vec![1.0; 4]);
        assert_eq!(counter.as_tensor().to_vec1::<i64>().unwrap(), vec![0, 0]);
    });
    for r in results {
        r.unwrap();
    }
}

#[test]
fn mismatched_models_across_ranks_are_an_error_on_every_rank() {
    let results = ThreadGroup::new(2).run(|comm| {
        let varmap = VarMap::new();
        let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
        let width = if comm.rank() == 0 { 4 } else { 5 };
        candle_nn::linear(width, 2, vb.pp("layer")).unwrap();
        let sgd = Sgd::new(SgdConfig::default()).unwrap();
        ZeroOptimizer::<_, f32>::new(&varmap, comm, EngineConfig::default(), Box::new(sgd))
            .err()
            .map(|e| e.to_string())
    });
    for r in results {
        let message = r.unwrap().expect("construction must fail");
        assert!(message.contains("layer.weight"), "{message}");
    }
}

#[test]
fn memory_shrinks_with_the_stage() {
    let report = |stage| {
        let results = ThreadGroup::new(4).run(|comm| {
            let varmap = VarMap::new();
            let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
            let linear = candle_nn::linear(64, 64, vb.pp("layer")).unwrap();
            let adamw = zero_core::optim::AdamW::new(AdamWConfig::default()).unwrap();
            // Buckets smaller than the model: stage 2's bucket buffer is
            // then a fraction of the full gradient buffer it replaces.
            let config = EngineConfig::default()
                .with_stage(stage)
                .with_bucket_bytes(1024);
            let mut opt =
                ZeroOptimizer::<_, f32>::new(&varmap, comm, config, Box::new(adamw)).unwrap();
            let x = Tensor::ones((2, 64), DType::F32, &Device::Cpu).unwrap();
            opt.backward_step(&linear.forward(&x).unwrap().sum_all().unwrap())
                .unwrap();
            opt.memory_report()
        });
        results.into_iter().next().unwrap().unwrap()
    };
    let (s0, s1, s2) = (
        report(Stage::Ddp),
        report(Stage::OptimizerState),
        report(Stage::Gradients),
    );
    let params = 64 * 64 + 64;
    assert_eq!(
        s0.optimizer_state,
        params * 8 + 2 * 8,
        "exp_avg, exp_avg_sq, steps"
    );
    assert!(s1.optimizer_state * 4 <= s0.optimizer_state + 4 * 32 * 8 + 4 * 16);
    assert_eq!(s2.grads, 0);
    assert!(s2.grads + s2.grad_shard < (s0.grads + s0.grad_shard) / 3);
    // Without accumulation stages 1 and 2 hold the same buffers: stage 1
    // keeps a full gradient buffer only across an accumulation window.
    assert_eq!(s1.grads, 0);
    assert!(s2.total() <= s1.total() && s1.total() < s0.total());
}

/// Each rank's learning rate of the optimizer steps of micro-steps `micro`
/// (two per step), set before each from `schedule` at the engine's step
/// count; the run starts from checkpoint `ckpt` if `resume`, and saves it.
fn scheduled_rates(
    schedule: &LrSchedule,
    micro: std::ops::Range<usize>,
    ckpt: &std::path::Path,
    resume: bool,
) -> Vec<Vec<f64>> {
    let results = ThreadGroup::new(2).run(|comm| {
        let rank = comm.rank();
        let varmap = VarMap::new();
        let linear = model(&varmap);
        let config = EngineConfig::default().with_grad_accum_steps(2);
        let sgd = Box::new(Sgd::new(SgdConfig::default()).unwrap());
        let mut opt = ZeroOptimizer::<_, f32>::new(&varmap, comm, config, sgd).unwrap();
        if resume {
            opt.load_checkpoint(ckpt).unwrap();
        }
        let mut rates = Vec::new();
        for micro in micro.clone() {
            opt.set_learning_rate(schedule.lr_at(opt.engine().steps()));
            let x = batch(micro, rank * ROWS_PER_RANK, ROWS_PER_RANK);
            if opt.backward_step(&loss(&linear, &x)).unwrap().is_some() {
                rates.push(opt.learning_rate());
            }
        }
        opt.save_checkpoint(ckpt).unwrap();
        rates
    });
    results.into_iter().map(Result::unwrap).collect()
}

#[test]
fn a_schedule_read_at_the_engines_step_count_gives_each_step_its_rate() {
    // Two micro-steps per step, and a checkpoint after step 3 that a fresh
    // run resumes from: the engine counts optimizer steps, and the
    // checkpoint restores the count.
    let decay = LrDecay::Cosine {
        total_steps: 6,
        min_lr: 0.01,
    };
    let schedule = LrSchedule::new(0.1, 2, decay).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let ckpt = dir.path().join("ckpt");
    let first = scheduled_rates(&schedule, 0..6, &ckpt, false);
    let second = scheduled_rates(&schedule, 6..12, &ckpt, true);
    let expected: Vec<f64> = (0..6).map(|step| schedule.lr_at(step)).collect();
    for (first, second) in first.into_iter().zip(second) {
        assert_eq!([first, second].concat(), expected);
    }
}
