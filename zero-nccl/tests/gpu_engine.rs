//! The engine on CUDA memory at world size 1 on NCCL against the engine on
//! host memory on the thread backend: same parameters, gradients, optimizer
//! and stage, so the weights must agree to float rounding (the fused kernels
//! follow `torch.optim` operation by operation, as the host optimizers do;
//! the GPU may contract multiply-adds, hence a tolerance rather than
//! bitwise). Checkpoints cross between the two memories both ways.
//!
//! Needs a GPU and libnccl: `cargo test -p zero-nccl --features nccl --
//! --ignored` on a GPU machine.
#![cfg(feature = "nccl")]

use rand::{Rng, SeedableRng};
use zero_core::engine::{EngineConfig, HostGrad, NormType, Overlap, Stage};
use zero_core::optim::{
    Adagrad, AdagradConfig, Adam, AdamConfig, AdamW, AdamWConfig, FunctionalOptimizer, Sgd,
    SgdConfig,
};
use zero_core::{DType, Engine, ParamInfo, ThreadGroup};
use zero_nccl::cudarc::driver::CudaSlice;
use zero_nccl::{cuda_engine, DevicePool, DeviceView, NcclComm};

fn comm() -> NcclComm {
    NcclComm::single(0).unwrap_or_else(|e| panic!("this test needs a CUDA GPU and libnccl: {e}"))
}

fn params() -> Vec<ParamInfo> {
    vec![
        ParamInfo::new("a.bias", vec![7], DType::F32),
        ParamInfo::new("a.weight", vec![7, 13], DType::F32),
        ParamInfo::new("b.weight", vec![300], DType::F32),
        ParamInfo::new("c.frozen", vec![5], DType::F32).with_trainable(false),
    ]
}

/// Per step, one gradient slot per parameter.
type StepGrads = Vec<Vec<Option<Vec<f32>>>>;
/// Builds a fresh optimizer for each engine of a comparison.
type MakeOptimizer = Box<dyn Fn() -> Box<dyn FunctionalOptimizer<f32>> + Sync>;

/// Initial weights and per-step gradients; parameter 2 has no gradient on
/// odd steps (its step count falls behind, splitting the fused launches).
fn data(steps: usize) -> (Vec<Vec<f32>>, StepGrads) {
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    let ps = params();
    let init = ps
        .iter()
        .map(|p| (0..p.numel()).map(|_| rng.gen_range(-1.0..1.0)).collect())
        .collect();
    let grads = (0..steps)
        .map(|s| {
            ps.iter()
                .enumerate()
                .map(|(i, p)| {
                    (!(i == 2 && s % 2 == 1))
                        .then(|| (0..p.numel()).map(|_| rng.gen_range(-1.0..1.0)).collect())
                })
                .collect()
        })
        .collect();
    (init, grads)
}

fn host_result(
    config: &EngineConfig,
    optimizer: impl Fn() -> Box<dyn FunctionalOptimizer<f32>> + Sync,
    steps: usize,
) -> Vec<Vec<f32>> {
    let (init, grads) = data(steps);
    let mut out = ThreadGroup::new(1).run(|comm| {
        let mut engine = Engine::new(comm, params(), optimizer(), config.clone()).unwrap();
        let mut weights = init.clone();
        for step in &grads {
            let slots: Vec<Option<HostGrad<'_, f32>>> = step
                .iter()
                .map(|g| g.as_deref().map(HostGrad::from))
                .collect();
            engine.step(&slots, &mut weights).unwrap();
        }
        weights
    });
    out.remove(0).unwrap()
}

fn device_result(
    comm: NcclComm,
    config: &EngineConfig,
    optimizer: Box<dyn FunctionalOptimizer<f32>>,
    steps: usize,
) -> Vec<Vec<f32>> {
    let stream = comm.compute_stream().clone();
    let (init, grads) = data(steps);
    let mut engine = cuda_engine(comm, params(), optimizer, config.clone()).unwrap();
    let mut weights: Vec<CudaSlice<f32>> =
        init.iter().map(|w| stream.clone_htod(w).unwrap()).collect();
    device_steps(&mut engine, &mut weights, &grads);
    weights
        .iter()
        .map(|w| stream.clone_dtoh(w).unwrap())
        .collect()
}

fn assert_close(device: &[Vec<f32>], host: &[Vec<f32>], what: &str) {
    for (i, (d, h)) in device.iter().zip(host).enumerate() {
        for (j, (x, y)) in d.iter().zip(h).enumerate() {
            assert!(
                (x - y).abs() <= 1e-5 * (1.0 + y.abs()),
                "{what}: parameter {i} element {j}: device {x}, host {y}"
            );
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn cuda_memory_matches_host_memory_at_world_size_one() {
    let cases: Vec<(&str, MakeOptimizer)> = vec![
        (
            "adam",
            Box::new(|| Box::new(Adam::new(AdamConfig::default().with_lr(1e-2)).unwrap())),
        ),
        (
            "adamw",
            Box::new(|| Box::new(AdamW::new(AdamWConfig::default().with_lr(1e-2)).unwrap())),
        ),
        (
            // Its sums start at the group's value the first time a piece
            // steps, wherever the engine's plan for that step begins.
            "adagrad from 0.1",
            Box::new(|| {
                Box::new(
                    Adagrad::new(AdagradConfig {
                        lr: 0.05,
                        initial_accumulator_value: 0.1,
                        ..Default::default()
                    })
                    .unwrap(),
                )
            }),
        ),
        (
            "sgd momentum",
            Box::new(|| {
                Box::new(Sgd::new(SgdConfig::default().with_lr(0.1).with_momentum(0.9)).unwrap())
            }),
        ),
    ];
    for stage in [Stage::Ddp, Stage::OptimizerState, Stage::Gradients] {
        for (name, optimizer) in &cases {
            let config = EngineConfig::default()
                .with_stage(stage)
                .with_bucket_bytes(256)
                .with_clip(0.5, NormType::L2);
            let host = host_result(&config, optimizer, 6);
            let device = device_result(comm(), &config, optimizer(), 6);
            assert_close(&device, &host, &format!("{name}, {stage:?}"));
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn cuda_memory_accumulates_like_host_memory() {
    let comm = comm();
    let config = EngineConfig::default()
        .with_stage(Stage::Gradients)
        .with_grad_accum_steps(3);
    let adam = || -> Box<dyn FunctionalOptimizer<f32>> {
        Box::new(Adam::new(AdamConfig::default()).unwrap())
    };
    let host = host_result(&config, adam, 9);
    let device = device_result(comm, &config, adam(), 9);
    assert_close(&device, &host, "accumulation");
}

/// The engine leaves the device's pool keeping what is freed (CUDA's
/// default threshold of 0 hands it back at every synchronization), and a
/// user can set it back.
#[test]
#[ignore = "needs a CUDA GPU"]
fn the_engine_keeps_freed_device_memory_in_the_pool() {
    let comm = comm();
    let pool = DevicePool::of(comm.context()).unwrap();
    pool.set_release_threshold(0).unwrap();
    assert_eq!(pool.release_threshold().unwrap(), 0);
    let adam = Box::new(Adam::new(AdamConfig::default()).unwrap());
    let engine = cuda_engine(comm, params(), adam, EngineConfig::default()).unwrap();
    assert_eq!(pool.release_threshold().unwrap(), DevicePool::RETAIN_ALL);
    pool.set_release_threshold(1 << 30).unwrap();
    assert_eq!(pool.release_threshold().unwrap(), 1 << 30);
    drop(engine);
    pool.retain_freed().unwrap();
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn an_optimizer_without_a_kernel_is_a_clear_error() {
    let comm = comm();
    // Adagrad has a kernel; the same update under a custom kind does not.
    let inner = zero_core::optim::Adagrad::new(Default::default()).unwrap();
    struct Custom(zero_core::optim::Adagrad<f32>);
    impl FunctionalOptimizer<f32> for Custom {
        fn kind(&self) -> &str {
            "lion"
        }
        fn step(
            &mut self,
            p: &mut [zero_core::optim::ParamMut<'_, f32>],
            g: &[Option<&[f32]>],
        ) -> zero_core::Result<()> {
            self.0.step(p, g)
        }
        fn num_groups(&self) -> usize {
            self.0.num_groups()
        }
        fn add_group(&mut self, h: &zero_core::optim::Hyperparams) -> zero_core::Result<usize> {
            self.0.add_group(h)
        }
        fn hyperparams(&self, g: usize) -> zero_core::optim::Hyperparams {
            self.0.hyperparams(g)
        }
        fn set_hyperparams(
            &mut self,
            g: usize,
            h: &zero_core::optim::Hyperparams,
        ) -> zero_core::Result<()> {
            self.0.set_hyperparams(g, h)
        }
        fn learning_rate(&self, g: usize) -> f64 {
            self.0.learning_rate(g)
        }
        fn set_learning_rate(&mut self, g: usize, lr: f64) {
            self.0.set_learning_rate(g, lr)
        }
        fn export_state(&self) -> zero_core::optim::OptimizerState<f32> {
            self.0.export_state()
        }
        fn import_state(
            &mut self,
            s: zero_core::optim::OptimizerState<f32>,
        ) -> zero_core::Result<()> {
            self.0.import_state(s)
        }
    }
    let err = cuda_engine(
        comm,
        params(),
        Box::new(Custom(inner)),
        EngineConfig::default(),
    )
    .err()
    .expect("a custom optimizer kind must be refused");
    assert!(err.to_string().contains("no fused CUDA kernel"), "{err}");
}

/// Steps `engine` (CUDA memory) through `grads`.
fn device_steps(
    engine: &mut zero_nccl::CudaEngine,
    weights: &mut Vec<CudaSlice<f32>>,
    grads: &[Vec<Option<Vec<f32>>>],
) {
    let stream = engine.comm().compute_stream().clone();
    for step in grads {
        let device: Vec<Option<CudaSlice<f32>>> = step
            .iter()
            .map(|g| g.as_ref().map(|g| stream.clone_htod(g).unwrap()))
            .collect();
        let slots: Vec<Option<DeviceView<'_>>> =
            device.iter().map(|g| g.as_ref().map(Into::into)).collect();
        engine.step(&slots, weights).unwrap();
    }
}

/// Two host ranks (threads) step through `grads` (the same on both, so the
/// mean is the gradient itself), loading `resume` first when given and
/// saving into `save` at the end when given.
fn host_steps_two_ranks(
    config: &EngineConfig,
    init: &[Vec<f32>],
    grads: &[Vec<Option<Vec<f32>>>],
    resume: Option<&std::path::Path>,
    save: Option<&std::path::Path>,
) -> Vec<Vec<f32>> {
    let mut out = ThreadGroup::new(2).run(|comm| {
        let adam: Box<dyn FunctionalOptimizer<f32>> =
            Box::new(Adam::new(AdamConfig::default().with_lr(1e-2)).unwrap());
        let mut engine = Engine::new(comm, params(), adam, config.clone()).unwrap();
        let mut weights = init.to_vec();
        if let Some(dir) = resume {
            engine.load_checkpoint(dir, &mut weights).unwrap();
        }
        for step in grads {
            let slots: Vec<Option<HostGrad<'_, f32>>> = step
                .iter()
                .map(|g| g.as_deref().map(HostGrad::from))
                .collect();
            engine.step(&slots, &mut weights).unwrap();
        }
        if let Some(dir) = save {
            engine
                .save_checkpoint(dir, &mut weights, &zero_core::SaveOptions::default())
                .unwrap();
        }
        weights
    });
    out.remove(0).unwrap()
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn checkpoints_cross_between_cuda_and_host_memory() {
    let (init, grads) = data(6);
    let (first, second) = grads.split_at(3);
    let config = EngineConfig::default()
        .with_stage(Stage::Gradients)
        .with_bucket_bytes(256);
    let adam = || -> Box<dyn FunctionalOptimizer<f32>> {
        Box::new(Adam::new(AdamConfig::default().with_lr(1e-2)).unwrap())
    };
    let uninterrupted = host_steps_two_ranks(&config, &init, &grads, None, None);

    // GPU for three steps, then two host ranks resume.
    let dir = std::env::temp_dir().join(format!("zero-nccl-ckpt-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let comm = comm();
    let stream = comm.compute_stream().clone();
    let mut engine = cuda_engine(comm, params(), adam(), config.clone()).unwrap();
    let mut weights: Vec<CudaSlice<f32>> =
        init.iter().map(|w| stream.clone_htod(w).unwrap()).collect();
    device_steps(&mut engine, &mut weights, first);
    engine
        .save_checkpoint(&dir, &mut weights, &zero_core::SaveOptions::default())
        .unwrap();
    let resumed_on_host = host_steps_two_ranks(&config, &init, second, Some(&dir), None);
    assert_close(&resumed_on_host, &uninterrupted, "GPU save, host resume");

    // Two host ranks for three steps, then the GPU resumes (stage 1 here).
    let _ = std::fs::remove_dir_all(&dir);
    host_steps_two_ranks(&config, &init, first, None, Some(&dir));
    let comm = NcclComm::single(0).unwrap();
    let stream = comm.compute_stream().clone();
    let stage1 = config.clone().with_stage(Stage::OptimizerState);
    let mut engine = cuda_engine(comm, params(), adam(), stage1).unwrap();
    let mut weights: Vec<CudaSlice<f32>> =
        init.iter().map(|w| stream.clone_htod(w).unwrap()).collect();
    engine.load_checkpoint(&dir, &mut weights).unwrap();
    device_steps(&mut engine, &mut weights, second);
    let resumed_on_gpu: Vec<Vec<f32>> = weights
        .iter()
        .map(|w| stream.clone_dtoh(w).unwrap())
        .collect();
    assert_close(&resumed_on_gpu, &uninterrupted, "host save, GPU resume");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Gradients handed over during backward (`begin_backward` +
/// `accumulate_param`): with `after-backward`, each bucket's reduction is
/// queued on NCCL's stream as soon as the bucket fills, with no
/// communication thread and no wait on the compute stream until the step;
/// with `none`, nothing is reduced before the step. The weights are the
/// same bitwise.
#[test]
#[ignore = "needs a CUDA GPU"]
fn reductions_start_during_backward_and_give_the_weights_of_the_serial_schedule() {
    let (init, grads) = data(6);
    let trainable: Vec<bool> = params().iter().map(|p| p.trainable).collect();
    let run = |stage: Stage, overlap: Overlap| -> (Vec<Vec<f32>>, usize) {
        let comm = comm();
        let stream = comm.compute_stream().clone();
        let config = EngineConfig::default()
            .with_stage(stage)
            .with_bucket_bytes(256)
            .with_overlap(overlap);
        let adam = Box::new(Adam::new(AdamConfig::default().with_lr(1e-2)).unwrap());
        let mut engine = cuda_engine(comm, params(), adam, config).unwrap();
        let progress = engine.reduction_progress();
        let mut weights: Vec<CudaSlice<f32>> =
            init.iter().map(|w| stream.clone_htod(w).unwrap()).collect();
        let mut during_backward = 0;
        for step in &grads {
            let device: Vec<Option<CudaSlice<f32>>> = step
                .iter()
                .zip(&trainable)
                .map(|(g, &t)| {
                    g.as_ref()
                        .filter(|_| t)
                        .map(|g| stream.clone_htod(g).unwrap())
                })
                .collect();
            // Reverse order, as backward produces them.
            let order: Vec<(usize, usize)> = (0..device.len())
                .rev()
                .filter(|&p| device[p].is_some())
                .map(|p| (p, 1))
                .collect();
            engine.begin_backward(&order, &mut weights).unwrap();
            let before = progress.completed();
            for &(p, _) in &order {
                let grad = device[p].as_ref().expect("in the order");
                engine.accumulate_param(p, .., grad.into()).unwrap();
            }
            during_backward += progress.completed() - before;
            let none: Vec<Option<DeviceView<'_>>> = vec![None; device.len()];
            engine.step(&none, &mut weights).unwrap();
        }
        let host = weights
            .iter()
            .map(|w| stream.clone_dtoh(w).unwrap())
            .collect();
        (host, during_backward)
    };
    for stage in [Stage::Ddp, Stage::OptimizerState, Stage::Gradients] {
        let (serial, serial_during) = run(stage, Overlap::None);
        let (overlapped, overlapped_during) = run(stage, Overlap::AfterBackward);
        assert_eq!(serial_during, 0, "{stage:?}: none reduced during backward");
        assert!(
            overlapped_during > 0,
            "{stage:?}: nothing reduced during backward"
        );
        assert_eq!(overlapped, serial, "{stage:?}");
    }
}
