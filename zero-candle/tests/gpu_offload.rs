//! ZeRO-Offload on a GPU (`EngineConfig::offload`): the optimizer's side in
//! host memory trains the weights of stage 2 without offload (f32 within
//! the rounding of a host step against the device kernel; bf16 with f32
//! masters), holds less on the device, and its checkpoints resume without
//! offload and on threads; each run builds its device both as the trainer
//! does (`Device::new_cuda`) and on a stream of its own. Needs a CUDA
//! GPU: `#[ignore]`d, run on a GPU machine with
//! `cargo test -p zero-candle --features nccl -- --ignored`.
#![cfg(feature = "nccl")]

use candle_core::{DType, Device, Module};
use std::path::Path;
use zero_candle::{NcclZeroOptimizer, ZeroHook, ZeroOptimizer};
use zero_core::engine::{EngineConfig, MemoryReport, Offload, OffloadTimes, Overlap, Stage};
use zero_core::optim::{AdamW, AdamWConfig, FunctionalOptimizer, Simple, SimpleOptimizer};
use zero_core::serde::{Deserialize, Serialize};
use zero_core::{Communicator, ThreadGroup};
use zero_nccl::NcclComm;

mod gpu_support;
use gpu_support::{assert_builds_agree, batch, hooked_mlp, max_diff, mlp, weights, Built, BUILDS};

fn adamw() -> Box<AdamW<f32>> {
    Box::new(AdamW::new(AdamWConfig::default().with_lr(1e-2)).expect("AdamW"))
}

/// Builds a run's optimizer.
type MakeOptimizer = fn() -> Box<dyn FunctionalOptimizer<f32>>;

#[derive(Clone, Serialize, Deserialize)]
#[serde(crate = "zero_core::serde")]
struct HeavyBallConfig {
    lr: f64,
    momentum: f64,
}

/// A user's optimizer, which no fused kernel runs: `v = momentum v + g`,
/// `p -= lr v`.
struct HeavyBall;

impl SimpleOptimizer<f32> for HeavyBall {
    type Config = HeavyBallConfig;
    const KIND: &'static str = "heavy_ball";
    const STATE: &'static [&'static str] = &["velocity"];

    fn update(
        c: &HeavyBallConfig,
        _: u64,
        param: &mut [f32],
        grad: &[f32],
        state: &mut [Vec<f32>],
    ) {
        for ((p, &g), v) in param.iter_mut().zip(grad).zip(&mut state[0]) {
            *v = c.momentum as f32 * *v + g;
            *p -= c.lr as f32 * *v;
        }
    }
}

fn heavy_ball() -> Box<dyn FunctionalOptimizer<f32>> {
    let config = HeavyBallConfig {
        lr: 0.05,
        momentum: 0.9,
    };
    Box::new(Simple::<HeavyBall, f32>::new(config).expect("HeavyBall"))
}

fn config(offload: Offload) -> EngineConfig {
    EngineConfig::default()
        .with_stage(Stage::Gradients)
        .with_bucket_bytes(16 << 10)
        .with_offload(offload, 2)
}

/// [`config`] whose host steps each bucket as it lands (offload), or that
/// reduces in the step (without).
fn interleaved(offload: Offload) -> EngineConfig {
    config(offload).with_overlap(Overlap::Interleaved)
}

/// Trains steps `first..first + steps` on the GPU (loading `load` first,
/// saving into `save` after); the weights, the memory report and the
/// offload's times. The model's layers report their gradients during
/// backward when `config` interleaves (only then does a bucket step before
/// backward ends); otherwise they come as slots after a plain backward.
fn train_gpu_built(
    built: Built,
    (dtype, make): (DType, MakeOptimizer),
    config: EngineConfig,
    (first, steps): (usize, usize),
    load: Option<&Path>,
    save: Option<&Path>,
) -> (Vec<(String, Vec<f32>)>, MemoryReport, OffloadTimes) {
    let comm = NcclComm::single(0).unwrap_or_else(|e| panic!("NcclComm::single(0) failed: {e}"));
    let device = built.device(0).expect("a CUDA device 0");
    let what = format!("{built:?} {:?} {:?}", config.offload, config.overlap);
    let hook = (config.overlap == Overlap::Interleaved).then(ZeroHook::<NcclComm, f32>::new);
    let (varmap, model): (_, Box<dyn Module>) = match &hook {
        Some(hook) => {
            let (varmap, model) = hooked_mlp(&device, dtype, hook.clone());
            (varmap, Box::new(model))
        }
        None => {
            let (varmap, model) = mlp(&device, dtype);
            (varmap, Box::new(model))
        }
    };
    let mut opt = NcclZeroOptimizer::new(&varmap, comm, config, make())
        .and_then(|opt| match &hook {
            Some(hook) => opt.with_hook(hook),
            None => Ok(opt),
        })
        .unwrap_or_else(|e| panic!("{what}: {e}"));
    if let Some(dir) = load {
        opt.load_checkpoint(dir).expect("load");
    }
    for s in first..first + steps {
        let (x, y) = batch(&device, dtype, s);
        let loss = candle_nn::loss::mse(&model.forward(&x).expect("forward"), &y).expect("loss");
        opt.backward_step(&loss).expect("step");
    }
    if let Some(dir) = save {
        opt.save_checkpoint(dir).expect("save");
    }
    let times = opt.engine().counters().offload;
    (weights(&varmap), opt.memory_report(), times)
}

/// [`train_gpu_with`] AdamW.
fn train_gpu(
    dtype: DType,
    config: EngineConfig,
    first: usize,
    steps: usize,
    load: Option<&Path>,
    save: Option<&Path>,
) -> (Vec<(String, Vec<f32>)>, MemoryReport, OffloadTimes) {
    train_gpu_with((dtype, || adamw()), config, first, steps, load, save)
}

/// [`train_gpu_built`] with the optimizer `make` builds and the device
/// built both ways ([`BUILDS`]): the weights agree, and the trainer's
/// build's run is returned.
fn train_gpu_with(
    (dtype, make): (DType, MakeOptimizer),
    config: EngineConfig,
    first: usize,
    steps: usize,
    load: Option<&Path>,
    save: Option<&Path>,
) -> (Vec<(String, Vec<f32>)>, MemoryReport, OffloadTimes) {
    let [trainer, own] = BUILDS.map(|built| {
        train_gpu_built(
            built,
            (dtype, make),
            config.clone(),
            (first, steps),
            load,
            save,
        )
    });
    assert_builds_agree(
        dtype,
        max_diff(&trainer.0, &own.0),
        &format!("{dtype:?} {:?} {:?}", config.offload, config.overlap),
    );
    trainer
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn offload_trains_the_weights_of_stage_2_on_the_gpu() {
    for dtype in [DType::F32, DType::BF16] {
        let (plain, plain_report, _) = train_gpu(dtype, config(Offload::None), 0, 6, None, None);
        let (offloaded, report, _) = train_gpu(dtype, config(Offload::Optimizer), 0, 6, None, None);
        // Stepping each bucket on the host as it lands (hooked layers):
        // the weights of the same layers without offload.
        let (hooked, _, _) = train_gpu(dtype, interleaved(Offload::None), 0, 6, None, None);
        let (landed, _, times) =
            train_gpu(dtype, interleaved(Offload::Optimizer), 0, 6, None, None);
        // The host AdamW and the device kernel round differently (f32);
        // bf16 weights may round the last bit the other way.
        let tolerance = if dtype == DType::F32 { 1e-5 } else { 1e-2 };
        let diff = max_diff(&plain, &offloaded);
        assert!(diff <= tolerance, "{dtype:?}: offload differs by {diff}");
        let diff = max_diff(&hooked, &landed);
        assert!(
            diff <= tolerance,
            "{dtype:?}: interleaved offload differs by {diff}"
        );
        // The same with the transfers on a stream of their own.
        let streamed = interleaved(Offload::Optimizer).with_offload_copy_stream(true);
        let (streamed, _, _) = train_gpu(dtype, streamed, 0, 6, None, None);
        let diff = max_diff(&hooked, &streamed);
        assert!(
            diff <= tolerance,
            "{dtype:?}: offload with a copy stream differs by {diff}"
        );
        // The interleaved schedule's step thread stepped, and its times
        // count the steps it stepped in.
        assert!((1..=6).contains(&times.steps), "{dtype:?}: {times:?}");
        assert!(times.write_back > std::time::Duration::ZERO, "{times:?}");
        assert_eq!(plain_report.offloaded, 0);
        assert!(
            report.offloaded >= report.optimizer_state + report.grad_shard,
            "{dtype:?}: {report:?}"
        );
        assert!(
            report.on_device() < plain_report.on_device(),
            "{dtype:?}: the device holds {} with offload, {} without",
            report.on_device(),
            plain_report.on_device()
        );
    }
}

/// Trains `steps` on one rank of the thread backend (f32, no offload), from
/// the checkpoint `load` if given: the weights.
fn train_threads(
    make: MakeOptimizer,
    load: Option<&Path>,
    steps: std::ops::Range<usize>,
) -> Vec<(String, Vec<f32>)> {
    let threads = ThreadGroup::new(1).run(|comm| {
        assert_eq!(comm.world_size(), 1);
        let (varmap, model) = mlp(&Device::Cpu, DType::F32);
        let mut opt = ZeroOptimizer::<_, f32>::new(&varmap, comm, config(Offload::None), make())?;
        if let Some(dir) = load {
            opt.load_checkpoint(dir)?;
        }
        for s in steps.clone() {
            let (x, y) = batch(&Device::Cpu, DType::F32, s);
            let loss = candle_nn::loss::mse(&model.forward(&x)?, &y)?;
            opt.backward_step(&loss)?;
        }
        Ok::<_, zero_candle::Error>(weights(&varmap))
    });
    threads
        .into_iter()
        .next()
        .expect("one rank")
        .expect("no panic")
        .expect("trained on threads")
}

/// An optimizer with no fused kernel is refused on the GPU alone, with
/// offload named as the way; offloaded, the host steps it and the GPU
/// trains the weights the same model trains on threads.
#[test]
#[ignore = "needs a CUDA GPU"]
fn a_custom_optimizer_trains_on_the_gpu_offloaded() {
    let comm = NcclComm::single(0).unwrap_or_else(|e| panic!("NcclComm::single(0) failed: {e}"));
    let device = Built::AsTheTrainer.device(0).expect("a CUDA device 0");
    let (varmap, _) = mlp(&device, DType::F32);
    let err = NcclZeroOptimizer::new(&varmap, comm, config(Offload::None), heavy_ball())
        .err()
        .expect("no kernel runs HeavyBall")
        .to_string();
    assert!(
        err.contains("\"heavy_ball\" has no fused CUDA kernel")
            && err.contains("Offload::Optimizer"),
        "{err}"
    );
    for overlap in [Overlap::None, Overlap::Interleaved] {
        let offloaded = config(Offload::Optimizer).with_overlap(overlap);
        let (gpu, report, _) =
            train_gpu_with((DType::F32, heavy_ball), offloaded, 0, 6, None, None);
        assert!(
            report.optimizer_state > 0 && report.offloaded > 0,
            "{report:?}"
        );
        let on_threads = train_threads(heavy_ball, None, 0..6);
        let diff = max_diff(&gpu, &on_threads);
        assert!(
            diff <= 1e-4,
            "{overlap:?}: the GPU's weights differ from the threads' by {diff}"
        );
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn an_offloaded_checkpoint_resumes_without_offload_and_on_threads() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (whole, _, _) = train_gpu(DType::F32, config(Offload::None), 0, 6, None, None);
    train_gpu(
        DType::F32,
        config(Offload::Optimizer),
        0,
        3,
        None,
        Some(dir.path()),
    );
    let (gpu, _, _) = train_gpu(
        DType::F32,
        config(Offload::None),
        3,
        3,
        Some(dir.path()),
        None,
    );
    assert!(
        max_diff(&whole, &gpu) <= 1e-5,
        "GPU resume: {}",
        max_diff(&whole, &gpu)
    );
    // And back: saved without offload, resumed offloaded.
    let back = tempfile::tempdir().expect("tempdir");
    train_gpu(
        DType::F32,
        config(Offload::None),
        0,
        3,
        None,
        Some(back.path()),
    );
    let (offloaded, _, _) = train_gpu(
        DType::F32,
        config(Offload::Optimizer),
        3,
        3,
        Some(back.path()),
        None,
    );
    assert!(max_diff(&whole, &offloaded) <= 1e-5);
    // On threads, from the offloaded checkpoint.
    let on_threads = train_threads(|| adamw(), Some(dir.path()), 3..6);
    assert!(
        max_diff(&whole, &on_threads) <= 1e-4,
        "threads resume: {}",
        max_diff(&whole, &on_threads)
    );
}
