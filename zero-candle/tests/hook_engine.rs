//! `ZeroOptimizer::backward_step` with a `ZeroHook`: gradients of hooked
//! layers reach the engine during backward and the result is the result of
//! `step(&loss.backward()?)` with the same layers unhooked (bitwise, except
//! where the two add in another order).

mod nn_support;

use candle_core::{DType, Device, Module, Tensor};
use candle_nn::{VarBuilder, VarMap};
use rand::{Rng, SeedableRng};
use std::sync::Arc;
use zero_candle::nn::{self, GradHook};
use zero_candle::{ZeroHook, ZeroOptimizer};
use zero_core::engine::{EngineConfig, NormType, Stage};
use zero_core::optim::{AdamW, AdamWConfig};
use zero_core::{Communicator, ThreadComm, ThreadGroup};

struct Model {
    l1: nn::Linear,
    l2: nn::Linear,
    norm: nn::LayerNorm,
    varmap: VarMap,
}

impl Model {
    fn new(hook: Option<Arc<dyn GradHook>>) -> candle_core::Result<Self> {
        let varmap = VarMap::new();
        let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
        let l1 = nn::linear(6, 8, vb.pp("l1"), hook.clone())?;
        let norm = nn::layer_norm(8, 1e-5, vb.pp("norm"), hook.clone())?;
        let l2 = nn::linear(8, 3, vb.pp("l2"), hook)?;
        nn_support::seed_varmap(&varmap, 5)?;
        Ok(Self {
            l1,
            l2,
            norm,
            varmap,
        })
    }

    /// With `mixed`, also uses `l1.weight` in a plain op, so that weight's
    /// gradient comes both through the hook and through the `GradStore`.
    fn loss(&self, x: &Tensor, mixed: bool) -> candle_core::Result<Tensor> {
        let h = self.l1.forward(x)?.relu()?;
        let out = self.l2.forward(&self.norm.forward(&h)?)?;
        let loss = out.sqr()?.mean_all()?;
        if !mixed {
            return Ok(loss);
        }
        let side = x.matmul(&self.l1.weight().t()?)?.sqr()?.mean_all()?;
        loss + (side * 0.1)?
    }
}

fn train(
    comm: ThreadComm,
    hooked: bool,
    mixed: bool,
    config: &EngineConfig,
) -> zero_candle::Result<Vec<Vec<f32>>> {
    let rank = comm.rank();
    let hook = ZeroHook::<ThreadComm, f32>::new();
    let model = Model::new(hooked.then(|| hook.clone() as Arc<dyn GradHook>))?;
    let adamw = AdamW::new(AdamWConfig::default().with_lr(1e-2))?;
    let mut opt = ZeroOptimizer::new(&model.varmap, comm, config.clone(), Box::new(adamw))?;
    if hooked {
        opt = opt.with_hook(&hook)?;
    }
    let mut rng = rand::rngs::StdRng::seed_from_u64(100 + rank as u64);
    for _ in 0..4 * config.grad_accum_steps {
        let x: Vec<f32> = (0..5 * 6).map(|_| rng.gen_range(-1.0..1.0)).collect();
        let x = Tensor::from_vec(x, (5, 6), &Device::Cpu)?;
        opt.backward_step(&model.loss(&x, mixed)?)?;
    }
    opt.vars()
        .iter()
        .map(|v| Ok(v.flatten_all()?.to_vec1::<f32>()?))
        .collect()
}

#[test]
fn hooked_backward_steps_equal_the_grad_store_path() {
    for stage in [Stage::Ddp, Stage::OptimizerState, Stage::Gradients] {
        for (accum, clip, mixed) in [
            (1, false, false),
            (2, false, false),
            (2, true, false),
            (2, true, true),
        ] {
            let mut config = EngineConfig::default()
                .with_stage(stage)
                .with_bucket_bytes(64)
                .with_grad_accum_steps(accum);
            if clip {
                config = config.with_clip(1.0, NormType::L2);
            }
            let run = |hooked: bool| {
                ThreadGroup::new(2)
                    .run(|comm| train(comm, hooked, mixed, &config))
                    .into_iter()
                    .map(|r| r.expect("no panic").expect("training works"))
                    .collect::<Vec<_>>()
            };
            let (plain, hooked) = (run(false), run(true));
            for (rank, (p, h)) in plain.iter().zip(&hooked).enumerate() {
                for (i, (pv, hv)) in p.iter().zip(h).enumerate() {
                    let what = format!(
                        "stage {stage:?}, {accum} micro-step(s), clip {clip}, mixed {mixed}, \
                         rank {rank}, var {i}"
                    );
                    // Where the two paths add in another order, rounding may
                    // differ (and then every later step differs a little):
                    // with `mixed`, `l1.weight` gets gradients both through
                    // the hook and through the GradStore, and the hooked
                    // path reduces the plain part in a second reduction; the
                    // hooked stage 2 reduces every micro-step, the plain path
                    // their sum; the hooked path partitions in gradient
                    // order, so a clipping norm is summed in another order.
                    if mixed || clip || (stage == Stage::Gradients && accum > 1) {
                        for (a, b) in pv.iter().zip(hv) {
                            assert!(
                                (a - b).abs() <= 1e-6 * a.abs().max(1.0),
                                "{what}: {a} vs {b}"
                            );
                        }
                    } else {
                        assert_eq!(pv, hv, "{what}");
                    }
                }
            }
        }
    }
}

#[test]
fn hooked_layers_outside_backward_step_are_a_clear_error() {
    let results = ThreadGroup::new(1).run(|comm| -> zero_candle::Result<String> {
        let hook = ZeroHook::<ThreadComm, f32>::new();
        let model = Model::new(Some(hook.clone()))?;
        let adamw = AdamW::new(AdamWConfig::default())?;
        let _opt = ZeroOptimizer::new(
            &model.varmap,
            comm,
            EngineConfig::default(),
            Box::new(adamw),
        )?
        .with_hook(&hook)?;
        let x = Tensor::ones((2, 6), DType::F32, &Device::Cpu)?;
        let err = model
            .loss(&x, true)?
            .backward()
            .expect_err("the engine is not lent outside backward_step");
        Ok(err.to_string())
    });
    let message = results.into_iter().next().unwrap().unwrap().unwrap();
    assert!(message.contains("backward_step"), "{message}");
}
