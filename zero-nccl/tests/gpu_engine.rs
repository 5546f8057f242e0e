//! The device engine at world size 1 on NCCL against the host engine on the
//! thread backend: same parameters, gradients, optimizer and stage, so the
//! weights must agree to float rounding (the fused kernels follow
//! `torch.optim` operation by operation, as the host optimizers do; the GPU
//! may contract multiply-adds, hence a tolerance rather than bitwise).
//! Needs a GPU and libnccl; skips with a printed reason otherwise.
#![cfg(feature = "nccl")]

mod common;

use rand::{Rng, SeedableRng};
use zero_core::engine::{EngineConfig, NormType, Stage};
use zero_core::optim::{Adam, AdamConfig, AdamW, AdamWConfig, FunctionalOptimizer, Sgd, SgdConfig};
use zero_core::{DType, Engine, ParamInfo, ThreadGroup};
use zero_nccl::cudarc::driver::{CudaSlice, DevicePtr};
use zero_nccl::{DeviceEngine, NcclComm};

fn comm() -> Option<NcclComm> {
    common::single_comm()
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
            let slots: Vec<Option<&[f32]>> = step.iter().map(|g| g.as_deref()).collect();
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
    let mut engine = DeviceEngine::new(comm, params(), optimizer, config.clone()).unwrap();
    let mut weights: Vec<CudaSlice<f32>> =
        init.iter().map(|w| stream.clone_htod(w).unwrap()).collect();
    for step in &grads {
        let device: Vec<Option<CudaSlice<f32>>> = step
            .iter()
            .map(|g| g.as_ref().map(|g| stream.clone_htod(g).unwrap()))
            .collect();
        let slots: Vec<Option<&dyn DevicePtr<f32>>> = device
            .iter()
            .map(|g| g.as_ref().map(|g| g as &dyn DevicePtr<f32>))
            .collect();
        engine.step(&slots, &mut weights).unwrap();
    }
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
fn device_engine_matches_the_host_engine_at_world_size_one() {
    let Some(_probe) = comm() else { return };
    drop(_probe);
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
            let comm = comm().expect("the GPU was there a moment ago");
            let device = device_result(comm, &config, optimizer(), 6);
            assert_close(&device, &host, &format!("{name}, {stage:?}"));
        }
    }
}

#[test]
fn device_engine_accumulates_like_the_host_engine() {
    let Some(comm) = comm() else { return };
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

#[test]
fn an_optimizer_without_a_kernel_is_a_clear_error() {
    let Some(comm) = comm() else { return };
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
    let err = DeviceEngine::new(
        comm,
        params(),
        Box::new(Custom(inner)),
        EngineConfig::default(),
    )
    .err()
    .expect("a custom optimizer kind must be refused");
    assert!(err.to_string().contains("no fused CUDA kernel"), "{err}");
}
