//! zero-candle over NCCL. Needs a CUDA GPU: `#[ignore]`d, run on a GPU
//! machine with `cargo test -p zero-candle --features nccl -- --ignored`.
#![cfg(feature = "nccl")]

use candle_core::{DType, Device, Module, Tensor};
use candle_nn::{VarBuilder, VarMap};
use zero_candle::{nn, NcclZeroOptimizer, ZeroHook};
use zero_core::engine::{EngineConfig, Stage};
use zero_core::optim::{Sgd, SgdConfig};
use zero_nccl::NcclComm;

/// One rank's weights after `steps` steps of a two-layer hooked MLP at
/// `stage` on NCCL.
fn train(stage: Stage, steps: usize) -> Vec<f32> {
    let comm = NcclComm::single(0).unwrap_or_else(|e| panic!("NcclComm::single(0) failed: {e}"));
    let device = Device::new_cuda(0).expect("a CUDA device 0");
    let hook = ZeroHook::<NcclComm, f32>::new();
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &device);
    let up = nn::linear(32, 64, vb.pp("up"), Some(hook.clone())).expect("up");
    let down = nn::linear(64, 8, vb.pp("down"), Some(hook.clone())).expect("down");
    let sgd = Sgd::new(SgdConfig::default().with_lr(0.05)).expect("SGD");
    let config = EngineConfig::default()
        .with_stage(stage)
        .with_persist_numel(64);
    let mut opt = NcclZeroOptimizer::new(&varmap, comm, config, Box::new(sgd))
        .and_then(|o| o.with_hook(&hook))
        .expect("the optimizer");
    for s in 0..steps {
        let x: Vec<f32> = (0..16 * 32)
            .map(|j| ((j * 13 + s * 5) % 17) as f32 / 17.0 - 0.5)
            .collect();
        let x = Tensor::from_vec(x, (16, 32), &device).expect("x");
        let y = down
            .forward(&up.forward(&x).and_then(|h| h.relu()).expect("h"))
            .expect("y");
        let loss = y.sqr().and_then(|y| y.mean_all()).expect("loss");
        opt.backward_step(&loss).expect("a step");
    }
    opt.full_weights()
        .expect("weights")
        .into_iter()
        .flat_map(|(_, t)| {
            t.flatten_all()
                .and_then(|t| t.to_vec1::<f32>())
                .expect("values")
        })
        .collect()
}

/// Stage 3 on NCCL (one rank: the gathers copy) trains stage 2's weights:
/// the layers compute with the gathered weights, their variables freed.
#[test]
#[ignore = "needs a CUDA GPU"]
fn stage_3_on_nccl_trains_stage_2_s_weights() {
    let s2 = train(Stage::Gradients, 4);
    let s3 = train(Stage::Parameters, 4);
    let diff = s2
        .iter()
        .zip(&s3)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f32::max);
    assert!(diff <= 1e-5, "stage 3 is {diff} from stage 2");
}
