//! zero-candle over NCCL. Needs a CUDA GPU: `#[ignore]`d, run on a GPU
//! machine with `cargo test -p zero-candle --features nccl -- --ignored`.
#![cfg(feature = "nccl")]

use candle_core::{DType, Device};
use candle_nn::{VarBuilder, VarMap};
use zero_candle::NcclZeroOptimizer;
use zero_core::engine::{EngineConfig, Stage};
use zero_core::optim::{AdamW, AdamWConfig};
use zero_nccl::NcclComm;

/// Stage 3 shards parameters on host memory only: on NCCL it is refused
/// when the optimizer is built, before any step (not after the first one,
/// where sharding would begin), saying what to use instead.
#[test]
#[ignore = "needs a CUDA GPU"]
fn stage_3_is_refused_when_the_optimizer_is_built() {
    let comm = NcclComm::single(0).unwrap_or_else(|e| panic!("NcclComm::single(0) failed: {e}"));
    let device = Device::new_cuda(0).expect("a CUDA device 0");
    let varmap = VarMap::new();
    VarBuilder::from_varmap(&varmap, DType::F32, &device)
        .get((256, 256), "w")
        .expect("a variable");
    let adamw = AdamW::new(AdamWConfig::default()).expect("AdamW");
    let config = EngineConfig::default().with_stage(Stage::Parameters);
    let built = NcclZeroOptimizer::new(&varmap, comm, config, Box::new(adamw));
    let err = built.err().expect("stage 3 on NCCL must be refused");
    assert!(err.to_string().contains("use stage 2"), "{err}");
}
