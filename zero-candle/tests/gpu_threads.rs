//! The Candle optimizer on ranks sharing one GPU (`CudaThreadComm`): at 1 to
//! 4 ranks, stages 0 to 2, f32 and bf16 (f32 masters), gradient
//! accumulation, clipping and every overlap schedule, it trains the weights
//! of the thread backend on the CPU; checkpoints saved on the GPU at 4 ranks
//! resume on threads at 2, and back. Each GPU run builds its devices both
//! as the trainer does (`Device::new_cuda`) and on streams of their own
//! (`gpu_support::Built`).
//!
//! SGD with momentum keeps the comparison tight: its update is linear in
//! the gradient, so the CPU's and the GPU's matmul rounding stays at
//! rounding level (an adaptive optimizer would magnify it where a gradient
//! is near zero), while a misplaced shard or a wrong reduction moves weights
//! by the learning rate. Needs a CUDA GPU: `#[ignore]`d, run on a GPU
//! machine with `cargo test -p zero-candle --features nccl -- --ignored`.
#![cfg(feature = "nccl")]

use candle_core::{DType, Device, Module};
use std::path::Path;
use zero_candle::{CandleMemory, ZeroOptimizer};
use zero_core::engine::{EngineConfig, NormType, Overlap, Stage};
use zero_core::optim::{Sgd, SgdConfig};
use zero_core::{Communicator, ThreadGroup};
use zero_nccl::{CudaThreadGroup, DeviceComm};

mod gpu_support;
use gpu_support::{assert_builds_agree, batch, max_diff, mlp, weights, Built, BUILDS};

type Weights = Vec<(String, Vec<f32>)>;

fn sgd() -> Box<Sgd<f32>> {
    Box::new(Sgd::new(SgdConfig::default().with_lr(0.05).with_momentum(0.9)).expect("SGD"))
}

/// One rank's training: micro-steps `first..first + steps`, rank `r` of
/// `n` taking batch `s * n + r` of each (so every world size sees the same
/// data per step), loading `load` first and saving into `save` after.
#[allow(clippy::too_many_arguments)]
fn train_rank<C>(
    comm: C,
    device: &Device,
    dtype: DType,
    config: EngineConfig,
    first: usize,
    steps: usize,
    load: Option<&Path>,
    save: Option<&Path>,
) -> zero_candle::Result<Weights>
where
    C: Communicator,
    C::Memory: CandleMemory<f32, C>,
{
    let (rank, n) = (comm.rank(), comm.world_size());
    let (varmap, model) = mlp(device, dtype);
    let mut opt = ZeroOptimizer::<C, f32>::new(&varmap, comm, config, sgd())?;
    if let Some(dir) = load {
        opt.load_checkpoint(dir)?;
    }
    for s in first..first + steps {
        let (x, y) = batch(device, dtype, s * n + rank);
        let loss = candle_nn::loss::mse(&model.forward(&x)?, &y)?;
        opt.backward_step(&loss)?;
    }
    if let Some(dir) = save {
        opt.save_checkpoint(dir)?;
    }
    Ok(weights(&varmap))
}

fn all_ok(results: Vec<zero_core::Result<zero_candle::Result<Weights>>>) -> Vec<Weights> {
    results
        .into_iter()
        .enumerate()
        .map(|(rank, r)| {
            r.map_err(zero_candle::Error::from)
                .and_then(|r| r)
                .unwrap_or_else(|e| panic!("rank {rank}: {e}"))
        })
        .collect()
}

/// Trains on `n` ranks sharing the GPU, each rank's device built as
/// `built` says (on its own thread).
fn on_gpu_built(
    built: Built,
    n: usize,
    dtype: DType,
    config: &EngineConfig,
    (first, steps): (usize, usize),
    load: Option<&Path>,
    save: Option<&Path>,
) -> Vec<Weights> {
    let results = CudaThreadGroup::new(n)
        .run(|comm| {
            let device = built
                .device(comm.context().ordinal())
                .map_err(zero_candle::Error::from);
            Ok(device.and_then(|device| {
                train_rank(
                    comm,
                    &device,
                    dtype,
                    config.clone(),
                    first,
                    steps,
                    load,
                    save,
                )
            }))
        })
        .unwrap_or_else(|e| panic!("this test needs a CUDA GPU: {e}"));
    all_ok(results)
}

/// [`on_gpu_built`] both ways ([`BUILDS`]): the weights agree (the same
/// kernels in the same order, up to cuBLAS choosing another algorithm on
/// another stream), and the trainer's build's are returned.
fn on_gpu(
    n: usize,
    dtype: DType,
    config: &EngineConfig,
    steps: (usize, usize),
    load: Option<&Path>,
    save: Option<&Path>,
) -> Vec<Weights> {
    let [trainer, own] =
        BUILDS.map(|built| on_gpu_built(built, n, dtype, config, steps, load, save));
    assert_builds_agree(
        dtype,
        max_diff_all(&trainer, &own),
        &format!("n={n} {dtype:?}"),
    );
    trainer
}

/// The largest difference between two runs' weights, over every rank.
fn max_diff_all(a: &[Weights], b: &[Weights]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| max_diff(x, y))
        .fold(0.0, f32::max)
}

fn on_threads(
    n: usize,
    dtype: DType,
    config: &EngineConfig,
    (first, steps): (usize, usize),
    load: Option<&Path>,
    save: Option<&Path>,
) -> Vec<Weights> {
    let results = ThreadGroup::new(n).run(|comm| {
        train_rank(
            comm,
            &Device::Cpu,
            dtype,
            config.clone(),
            first,
            steps,
            load,
            save,
        )
    });
    all_ok(results)
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn ranks_sharing_a_gpu_train_the_thread_backend_s_weights() {
    for n in 1..=4 {
        for stage in [Stage::Ddp, Stage::OptimizerState, Stage::Gradients] {
            for overlap in [Overlap::None, Overlap::AfterBackward, Overlap::Interleaved] {
                let config = EngineConfig::default()
                    .with_stage(stage)
                    .with_overlap(overlap)
                    .with_bucket_bytes(4 << 10);
                let gpu = on_gpu(n, DType::F32, &config, (0, 4), None, None);
                let host = on_threads(n, DType::F32, &config, (0, 4), None, None);
                let what = format!("n={n} {stage:?} {overlap:?}");
                for r in 0..n {
                    let diff = max_diff(&gpu[r], &host[r]);
                    assert!(diff <= 1e-4, "{what}: rank {r} differs by {diff}");
                    // Every rank holds the same replica.
                    assert_eq!(gpu[r], gpu[0], "{what}: rank {r}'s replica");
                }
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn accumulation_clipping_and_bf16_match_the_thread_backend() {
    for n in [2, 4] {
        let config = EngineConfig::default()
            .with_stage(Stage::Gradients)
            .with_bucket_bytes(4 << 10)
            .with_grad_accum_steps(2)
            .with_clip(0.1, NormType::L2);
        let gpu = on_gpu(n, DType::F32, &config, (0, 6), None, None);
        let host = on_threads(n, DType::F32, &config, (0, 6), None, None);
        let diff = max_diff(&gpu[0], &host[0]);
        assert!(diff <= 1e-4, "n={n} accumulate + clip: {diff}");
        // bf16 weights with f32 masters: the replicas round alike up to a
        // last bit where the CPU's and GPU's bf16 matmuls differ.
        let config = EngineConfig::default()
            .with_stage(Stage::Gradients)
            .with_bucket_bytes(4 << 10);
        let gpu = on_gpu(n, DType::BF16, &config, (0, 4), None, None);
        let host = on_threads(n, DType::BF16, &config, (0, 4), None, None);
        let diff = max_diff(&gpu[0], &host[0]);
        assert!(diff <= 1e-2, "n={n} bf16: {diff}");
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn checkpoints_cross_between_four_ranks_on_a_gpu_and_two_threads() {
    let config = EngineConfig::default()
        .with_stage(Stage::Gradients)
        .with_bucket_bytes(4 << 10);
    // Saved by 4 ranks on the GPU after 3 steps, resumed by 4 threads: the
    // GPU's uninterrupted run. (Each world size sees its own batches.)
    let dir = tempfile::tempdir().expect("tempdir");
    let gpu_whole = on_gpu(4, DType::F32, &config, (0, 6), None, None);
    on_gpu(4, DType::F32, &config, (0, 3), None, Some(dir.path()));
    let resumed = on_threads(4, DType::F32, &config, (3, 3), Some(dir.path()), None);
    let diff = max_diff(&resumed[0], &gpu_whole[0]);
    assert!(diff <= 1e-4, "GPU (4) -> threads (4): {diff}");
    // And a world-size change: 4 GPU ranks' checkpoint resumed by 2 threads
    // matches 4 ranks' first half followed by 2 ranks' second half on threads.
    let reference = {
        let mid = tempfile::tempdir().expect("tempdir");
        on_threads(4, DType::F32, &config, (0, 3), None, Some(mid.path()));
        on_threads(2, DType::F32, &config, (3, 3), Some(mid.path()), None)
    };
    let on_two = on_threads(2, DType::F32, &config, (3, 3), Some(dir.path()), None);
    let diff = max_diff(&on_two[0], &reference[0]);
    assert!(diff <= 1e-4, "GPU (4) -> threads (2): {diff}");
    // Back: saved by 2 threads, resumed by 4 ranks on the GPU.
    let back = tempfile::tempdir().expect("tempdir");
    on_threads(2, DType::F32, &config, (0, 3), None, Some(back.path()));
    let gpu = on_gpu(4, DType::F32, &config, (3, 3), Some(back.path()), None);
    let reference = {
        let mid = tempfile::tempdir().expect("tempdir");
        on_threads(2, DType::F32, &config, (0, 3), None, Some(mid.path()));
        on_threads(4, DType::F32, &config, (3, 3), Some(mid.path()), None)
    };
    let diff = max_diff(&gpu[0], &reference[0]);
    assert!(diff <= 1e-4, "threads (2) -> GPU (4): {diff}");
}

/// Candle's random initializers on the GPU, a bf16 model under f32 masters
/// and an f32 one: after construction every rank holds rank 0's values,
/// bit for bit (the broadcast at construction runs on the device memory's
/// own collectives).
#[test]
#[ignore = "needs a CUDA GPU"]
fn ranks_sharing_a_gpu_start_from_rank_zeros_random_model() {
    for (built, dtype) in BUILDS
        .into_iter()
        .flat_map(|b| [(b, DType::F32), (b, DType::BF16)])
    {
        let results = CudaThreadGroup::new(4)
            .run(|comm| {
                let built = (|| -> zero_candle::Result<(Weights, Weights)> {
                    let device = built.device(comm.context().ordinal())?;
                    // Candle seeds every CUDA device's generator alike.
                    device.set_seed(comm.rank() as u64)?;
                    let varmap = candle_nn::VarMap::new();
                    let vb = candle_nn::VarBuilder::from_varmap(&varmap, dtype, &device);
                    candle_nn::linear(48, 40, vb.pp("a"))?;
                    candle_nn::linear(40, 8, vb.pp("b"))?;
                    let before = weights(&varmap);
                    let config = EngineConfig::default().with_bucket_bytes(4 << 10);
                    let opt = ZeroOptimizer::<_, f32>::new(&varmap, comm, config, sgd())?;
                    drop(opt);
                    Ok((before, weights(&varmap)))
                })();
                Ok(built)
            })
            .unwrap_or_else(|e| panic!("this test needs a CUDA GPU: {e}"));
        let runs: Vec<_> = results
            .into_iter()
            .map(|r| r.expect("no panic").expect("built"))
            .collect();
        assert_ne!(
            runs[0].0, runs[1].0,
            "{built:?} {dtype:?}: Candle drew one model twice"
        );
        for (rank, (_, after)) in runs.iter().enumerate() {
            assert_eq!(
                *after, runs[0].0,
                "{built:?} {dtype:?}: rank {rank} starts elsewhere"
            );
        }
    }
}
