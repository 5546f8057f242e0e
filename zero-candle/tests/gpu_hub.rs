//! The hub models (GPT-2 and the Llama family: Llama with grouped and tied
//! heads, Qwen2 with YaRN, Qwen3 with its head norms and a sliding window,
//! Phi-3 with fused projections, Gemma, Gemma 2 and Gemma 3 with their
//! offset norms, GELU-gated MLP and capped scores and logits, Phi-3 with
//! longrope and half-rotated heads, SmolLM3 with a NoPE layer, Granite with
//! its multipliers, OLMo 2 and 3 with their output norms, the mixtures of
//! experts of Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE and FlexOlmo; at one
//! rank, every family read since) on the GPU against `transformers`: the
//! fixtures of `tests/fixtures/{gpt2,llama}` (tiny random models and the
//! logits and one SGD step `transformers` and `torch.optim.SGD` compute in
//! f64) trained at stage 3, at one rank on NCCL with the device built as
//! the trainer builds it (`Device::new_cuda`) and on two ranks sharing the
//! GPU (`CudaThreadGroup`, each rank's own stream, as `--backend
//! cuda-threads`). Needs a CUDA GPU: `#[ignore]`d, run on a GPU machine
//! with `cargo test -p zero-candle --features nccl -- --ignored`.
#![cfg(feature = "nccl")]

mod hub_support;

use candle_core::{DType, Device, Tensor};
use hub_support::gpu_fixtures::{BALANCED, FIXTURES, LATER};
use hub_support::{input_ids, relative_error, values, Golden, LR};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use zero_candle::hub::HubDir;
use zero_candle::models::CausalLm;
use zero_candle::{CandleMemory, ZeroHook, ZeroOptimizer};
use zero_core::engine::{EngineConfig, Stage};
use zero_core::optim::{Sgd, SgdConfig};
use zero_core::Communicator;
use zero_nccl::{CudaThreadGroup, DeviceComm, NcclComm};

/// f32 on the GPU against f64: the CPU tests' 1e-5, with room for the
/// GPU's summation orders.
const TOLERANCE: f64 = 1e-4;

/// The fixtures: `ZERO_HUB_FIXTURES` where set (a part of them, from
/// `scripts/gpu-hub-parts.sh`, for a device call that cannot carry them
/// all), else under the current directory when it is the repository's root
/// (a bundle built elsewhere runs there, `scripts/gpu-check.sh`), else
/// beside this crate's sources.
fn fixtures() -> PathBuf {
    if let Some(dir) = std::env::var_os("ZERO_HUB_FIXTURES") {
        return PathBuf::from(dir);
    }
    let here = PathBuf::from("zero-candle/tests/fixtures");
    if here.is_dir() {
        return here;
    }
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

/// The fixtures of `list` to run: all of them, or with `ZERO_HUB_FIXTURES`
/// those whose folder is there (named, and at least one).
fn chosen<'a>(
    list: impl Iterator<Item = &'a (&'static str, &'static str)>,
) -> Vec<(&'static str, &'static str)> {
    let all: Vec<_> = list.copied().collect();
    if std::env::var_os("ZERO_HUB_FIXTURES").is_none() {
        return all;
    }
    let (here, away): (Vec<_>, Vec<_>) = all
        .into_iter()
        .partition(|(f, _)| fixtures().join(f).is_dir());
    let names = |v: &[(&str, &str)]| v.iter().map(|(f, _)| *f).collect::<Vec<_>>().join(" ");
    println!(
        "ZERO_HUB_FIXTURES: running {}; not here: {}",
        names(&here),
        names(&away)
    );
    assert!(
        !here.is_empty(),
        "ZERO_HUB_FIXTURES={:?} holds none of these fixtures",
        fixtures()
    );
    here
}

fn golden_of(fixture: &str) -> Golden {
    let family = fixture.split('/').next().unwrap();
    hub_support::golden(&fixtures().join(family))
}

/// Loads `dir` on `device`, checks the logits, takes one SGD step at stage
/// 3 on this rank's rows of `ids` and saves in the hub layout to `out`.
fn step_and_save<C>(
    comm: C,
    device: &Device,
    dir: &Path,
    ids: &Tensor,
    golden_logits: &[f64],
    out: &Path,
) -> zero_candle::Result<()>
where
    C: Communicator + 'static,
    C::Memory: CandleMemory<f32, C>,
{
    let (world, rank) = (comm.world_size(), comm.rank());
    let hook = ZeroHook::<C, f32>::new();
    let (config, map) = CausalLm::open_hub(dir)?;
    let as_hook: Arc<dyn zero_candle::nn::GradHook> = hook.clone();
    let model = CausalLm::new(map.builder(DType::F32, device), &config, Some(as_hook))?;
    let engine = EngineConfig::default()
        .with_stage(Stage::Parameters)
        .with_persist_numel(64)
        .with_bucket_bytes(16 << 10);
    let sgd = Sgd::new(SgdConfig::default().with_lr(LR))?;
    let mut opt = ZeroOptimizer::new_sharded(&map, comm, engine, Box::new(sgd), &hook)?;
    let ids = ids.to_device(device)?;
    if world == 1 {
        let time = ids.dim(1)? - 1;
        let logits = model.forward(&ids.narrow(1, 0, time)?)?;
        let err = relative_error(&values(&logits.to_device(&Device::Cpu)?), golden_logits);
        assert!(
            err < TOLERANCE,
            "{}: logits differ by {err:e}",
            dir.display()
        );
    }
    let rows = ids.dim(0)? / world;
    opt.backward_step(&model.loss(&ids.narrow(0, rank * rows, rows)?)?)?;
    opt.save_hub(out, &HubDir::open(dir)?, &config.hub_layout())
}

/// Every tensor saved in `out` equals the golden step's.
fn check_step(fixture: &str, prefix: &str, golden: &Golden, out: &Path, case: &str) {
    let saved = HubDir::open(out).unwrap();
    let mut count = 0;
    for name in saved.names() {
        let ours = saved.tensor(name).unwrap().to_vec_as::<f64>().unwrap();
        let theirs = values(&golden[&format!("{prefix}sgd.{name}")]);
        let err = relative_error(&ours, &theirs);
        assert!(
            err < TOLERANCE,
            "{fixture} {case}: {name} differs by {err:e}"
        );
        count += 1;
    }
    assert!(count > 0, "{fixture} {case}: nothing saved");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn one_rank_on_nccl_computes_the_logits_and_the_step_of_transformers() {
    for (fixture, prefix) in chosen(FIXTURES.iter().chain(BALANCED).chain(LATER)) {
        let golden = golden_of(fixture);
        let out = tempfile::tempdir().unwrap();
        let comm = NcclComm::single(0).unwrap_or_else(|e| panic!("NcclComm::single(0): {e}"));
        // As the trainer builds it for NCCL: the per-thread default stream.
        let device = Device::new_cuda(comm.context().ordinal()).unwrap();
        let logits = values(&golden[&format!("{prefix}logits")]);
        let dir = fixtures().join(fixture);
        step_and_save(
            comm,
            &device,
            &dir,
            &input_ids(&golden),
            &logits,
            out.path(),
        )
        .unwrap();
        check_step(fixture, prefix, &golden, out.path(), "on one rank");
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn two_ranks_sharing_the_gpu_take_the_step_of_transformers() {
    for (fixture, prefix) in chosen(FIXTURES.iter()) {
        let golden = golden_of(fixture);
        let out = tempfile::tempdir().unwrap();
        let (dir, ids) = (fixtures().join(fixture), input_ids(&golden));
        CudaThreadGroup::new(2)
            .run(|comm| {
                let device = Device::new_cuda_with_stream(comm.context().ordinal())
                    .map_err(zero_candle::Error::from);
                Ok(device.and_then(|d| step_and_save(comm, &d, &dir, &ids, &[], out.path())))
            })
            .unwrap_or_else(|e| panic!("this test needs a CUDA GPU: {e}"))
            .into_iter()
            .for_each(|r| r.unwrap().unwrap());
        check_step(fixture, prefix, &golden, out.path(), "on two ranks");
    }
}
