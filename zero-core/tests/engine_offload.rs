//! ZeRO-Offload (`OffloadMemory`): the optimizer's side in host memory, the
//! rest on the device. Host memory stands in for the device here, so what
//! is checked is the offload's logic: every buffer placed and moved right
//! (the trained weights are those of the device alone, bit for bit, at
//! every stage, schedule and world size, with accumulation, clipping and
//! master weights), the shards and state counted as offloaded, the host
//! stepping buckets while backward goes on, checkpoints across offload on
//! and off, and the refusals.

mod common;

use common::lion::lion;
use common::{
    assert_close, hooked_micro_step, make_opt, run, Model, Opt, PlanCheck, Seen, Synthetic,
};
use half::bf16;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use zero_core::engine::{
    CastParams, HostGrad, HostMemory, MemoryReport, NormType, Offload, OffloadMemory, OffloadTimes,
    Overlap, ShardMemory,
};
use zero_core::optim::{
    Adam, AdamConfig, FunctionalOptimizer, Hyperparams, OptimizerState, ParamMut,
};
use zero_core::{Communicator, DType, Engine, EngineConfig, ParamInfo, ParamStore, Result, Stage};

type Offloaded = OffloadMemory<HostMemory>;

/// How the gradients reach the engine.
#[derive(Clone, Copy, Debug)]
enum Path {
    /// Handed over one by one during backward (`begin_backward`).
    Hooked,
    /// All at once with the step.
    Plain,
}

/// What [`train_from`] gives: the replica after each step, the memory
/// report, and the final replica.
type Trained = (Vec<Vec<Vec<f64>>>, MemoryReport, Vec<Vec<f64>>);

/// Trains `e` from `params` for `steps` steps of `micro` micro-steps of
/// `model`'s synthetic gradients, the first being step `first`.
fn train_from<C, M>(
    e: &mut Engine<f64, C, M>,
    model: &Synthetic,
    path: Path,
    micro: usize,
    mut params: Vec<Vec<f64>>,
    (first, steps): (usize, usize),
) -> Result<Trained>
where
    C: Communicator,
    M: for<'g, 'p> ShardMemory<
        f64,
        C,
        Grad<'g> = HostGrad<'g, f64>,
        Params<'p> = dyn ParamStore<f64> + 'p,
    >,
{
    let rank = e.comm().rank();
    let mut out = Vec::new();
    for s in first..first + steps {
        for m in 0..micro {
            let g = model.grads(&params, rank, s * micro + m);
            match path {
                Path::Hooked => hooked_micro_step(e, &g, &mut params)?,
                Path::Plain => {
                    let slots: Vec<Option<HostGrad<'_, f64>>> =
                        g.iter().map(|g| Some(g.into())).collect();
                    e.step(&slots, &mut params)?;
                }
            }
        }
        out.push(params.clone());
    }
    Ok((out, e.memory_report(), params))
}

/// [`train_from`] from the model's initial values at step 0: the replica
/// after each step and the memory report.
fn train<C, M>(
    e: &mut Engine<f64, C, M>,
    model: &Synthetic,
    path: Path,
    micro: usize,
    steps: usize,
) -> Result<(Vec<Vec<Vec<f64>>>, MemoryReport)>
where
    C: Communicator,
    M: for<'g, 'p> ShardMemory<
        f64,
        C,
        Grad<'g> = HostGrad<'g, f64>,
        Params<'p> = dyn ParamStore<f64> + 'p,
    >,
{
    let (out, report, _) = train_from(e, model, path, micro, model.init(), (0, steps))?;
    Ok((out, report))
}

fn config(stage: Stage, overlap: Overlap, micro: usize) -> EngineConfig {
    let config = EngineConfig::default()
        .with_stage(stage)
        .with_bucket_bytes(96)
        .with_grad_accum_steps(micro)
        .with_overlap(overlap);
    // The interleaved schedule steps before the global norm exists.
    match overlap {
        Overlap::Interleaved => config,
        _ => config.with_clip(2.0, NormType::L2),
    }
}

/// What the offloaded report must say: the parameter shard, the gradient
/// shard and the optimizer state in host memory, the rest on the device.
fn assert_offloaded(report: &MemoryReport, what: &str) {
    assert!(
        report.grad_shard > 0 && report.optimizer_state > 0,
        "{what}: {report:?}"
    );
    assert_eq!(
        report.offloaded,
        2 * report.grad_shard + report.optimizer_state,
        "{what}: the shards and the state are the offloaded bytes: {report:?}"
    );
    assert_eq!(report.on_device(), report.total() - report.offloaded);
}

/// Over a device that reduces on a communication thread, and over one
/// whose collectives complete on its stream with no such thread (as the
/// CUDA memory's), offloading changes no bit of the trained weights.
#[test]
fn offload_trains_the_weights_of_the_device_alone_bit_for_bit() {
    let model = Synthetic::medium();
    let (micro, steps) = (2, 3);
    let device = |inline| OffloadMemory::new(PlanCheck::new(Arc::default(), inline));
    let offloaded_seen: Arc<Mutex<Seen>> = Arc::default();
    for inline in [false, true] {
        for world in [1, 2, 3] {
            for stage in [Stage::OptimizerState, Stage::Gradients, Stage::Parameters] {
                for overlap in [Overlap::None, Overlap::AfterBackward, Overlap::Interleaved] {
                    // Stage 3 refuses the interleaved schedule.
                    if stage == Stage::Parameters && overlap == Overlap::Interleaved {
                        continue;
                    }
                    for path in [Path::Hooked, Path::Plain] {
                        let what =
                            format!("inline {inline} N={world} {stage:?} {overlap:?} {path:?}");
                        let config = config(stage, overlap, micro);
                        // Without a communication thread the device alone
                        // reduces interleaved passes in the step; offloaded,
                        // it reduces each micro-step during backward and
                        // steps on the host as buckets land: the sums of
                        // the after-backward schedule, which reduces during
                        // backward too.
                        let alone = match (inline, overlap) {
                            (true, Overlap::Interleaved) => {
                                config.clone().with_overlap(Overlap::AfterBackward)
                            }
                            _ => config.clone(),
                        };
                        let device_alone = run(world, |comm| {
                            let mut e = Engine::with_memory(
                                comm,
                                device(inline),
                                model.infos(),
                                make_opt(Opt::Adam, false),
                                alone.clone(),
                            )?;
                            train(&mut e, &model, path, micro, steps)
                        });
                        let offloaded = run(world, |comm| {
                            let mut e = Engine::with_memory(
                                comm,
                                OffloadMemory::new(PlanCheck::new(offloaded_seen.clone(), inline)),
                                model.infos(),
                                make_opt(Opt::Adam, false),
                                config.clone().with_offload(Offload::Optimizer, 2),
                            )?;
                            train(&mut e, &model, path, micro, steps)
                        });
                        for (rank, ((want, plain), (got, report))) in
                            device_alone.iter().zip(&offloaded).enumerate()
                        {
                            assert_eq!(got, want, "{what} rank {rank}: weights differ");
                            assert_eq!(plain.offloaded, 0, "{what}: offloaded without offload");
                            assert_offloaded(report, &format!("{what} rank {rank}"));
                            // Reducing during backward on a device with no
                            // communication thread, each bucket buffer is
                            // free once its part has landed on the host
                            // (without offload all are held to the end).
                            if inline && overlap == Overlap::AfterBackward {
                                if let Path::Hooked = path {
                                    assert!(
                                        2 * report.comm_buffers <= plain.comm_buffers,
                                        "{what}: {} bytes of bucket buffers, {} without offload",
                                        report.comm_buffers,
                                        plain.comm_buffers
                                    );
                                }
                            }
                        }
                    }
                }
            }
        }
    }
    // The shards were page-locked, the reduced buckets' parts queued to
    // land later (read by the host before landing, they would be stale)
    // and the stepped ones queued to go up.
    // Nor did the host write a shard an upload was still reading.
    let seen = offloaded_seen.lock().expect("no panic");
    assert!(seen.pinned > 0, "no shard was page-locked");
    assert!(seen.queued_downloads > 0, "no download was queued");
    assert!(seen.queued_uploads > 0, "no upload was queued");
    assert_eq!(
        seen.changed_uploads, 0,
        "a shard changed under a queued upload"
    );
}

/// The host engine with its own memory trains the same weights too: the
/// wrapper adds nothing but placement.
#[test]
fn offload_over_threads_matches_the_plain_host_engine() {
    let model = Synthetic::medium();
    let config = config(Stage::Gradients, Overlap::AfterBackward, 2);
    let plain = run(2, |comm| {
        let mut e = Engine::new(
            comm,
            model.infos(),
            make_opt(Opt::Adam, false),
            config.clone(),
        )?;
        Ok(train(&mut e, &model, Path::Hooked, 2, 3)?.0)
    });
    let offloaded = run(2, |comm| {
        let mut e = Engine::with_memory(
            comm,
            Offloaded::new(HostMemory),
            model.infos(),
            make_opt(Opt::Adam, false),
            config.clone().with_offload(Offload::Optimizer, 0),
        )?;
        Ok(train(&mut e, &model, Path::Hooked, 2, 3)?.0)
    });
    assert_eq!(plain, offloaded);
}

/// A device memory that steps some optimizers only (as the CUDA memory runs
/// the built-ins' kernels) refuses a custom one at construction, naming
/// it; offloaded, the host steps it (the device is never asked to), and it
/// trains the weights it trains on the host engine, bit for bit.
#[test]
fn a_custom_optimizer_the_device_cannot_step_runs_offloaded() {
    let model = Synthetic::medium();
    let lion = || -> Box<dyn FunctionalOptimizer<f64>> { Box::new(lion(0.01, (0.9, 0.99), 0.1)) };
    let device = |inline| {
        OffloadMemory::new(PlanCheck::new(Arc::default(), inline).stepping_only(&["adam"]))
    };
    for world in [1, 2] {
        for stage in [Stage::OptimizerState, Stage::Gradients, Stage::Parameters] {
            let config = config(stage, Overlap::AfterBackward, 2);
            let what = format!("N={world} {stage:?}");
            let host = run(world, |comm| {
                let mut e = Engine::new(comm, model.infos(), lion(), config.clone())?;
                Ok(train(&mut e, &model, Path::Hooked, 2, 3)?.0)
            });
            for inline in [false, true] {
                let refused = run(world, |comm| {
                    Ok(Engine::with_memory(
                        comm,
                        device(inline),
                        model.infos(),
                        lion(),
                        config.clone(),
                    )
                    .err()
                    .map(|e| e.to_string()))
                });
                for err in refused {
                    let err = err.unwrap_or_else(|| panic!("{what}: the device took Lion"));
                    assert!(err.contains("\"lion\": no kernel here"), "{what}: {err}");
                }
                let offloaded = run(world, |comm| {
                    let mut e = Engine::with_memory(
                        comm,
                        device(inline),
                        model.infos(),
                        lion(),
                        config.clone().with_offload(Offload::Optimizer, 2),
                    )?;
                    Ok(train(&mut e, &model, Path::Hooked, 2, 3)?.0)
                });
                assert_eq!(offloaded, host, "{what} inline {inline}: weights differ");
            }
        }
    }
}

fn bf16_model() -> Vec<ParamInfo> {
    vec![
        ParamInfo::new("a", [5, 10], DType::BF16),
        ParamInfo::new("b", [30], DType::BF16),
    ]
}

/// A bf16 model with f32 master weights: the masters are offloaded, the
/// bf16 replica gets the same values as without offload.
#[test]
fn offload_keeps_the_f32_masters_of_a_bf16_model_in_host_memory() {
    let infos = bf16_model();
    let train = |offload: Offload| {
        run(2, |comm| {
            let adam: Box<dyn FunctionalOptimizer<f32>> =
                Box::new(Adam::new(AdamConfig::default().with_lr(0.01))?);
            let mut e = Engine::<f32, _, _>::with_memory(
                comm,
                Offloaded::new(HostMemory),
                infos.clone(),
                adam,
                EngineConfig::default()
                    .with_stage(Stage::Gradients)
                    .with_bucket_bytes(64)
                    .with_offload(offload, 1),
            )?;
            let rank = e.comm().rank();
            let mut replica = CastParams(
                infos
                    .iter()
                    .map(|p| vec![bf16::from_f32(0.5); p.numel()])
                    .collect::<Vec<Vec<bf16>>>(),
            );
            for step in 0..4 {
                let grads: Vec<Vec<f32>> = infos
                    .iter()
                    .enumerate()
                    .map(|(p, info)| {
                        (0..info.numel())
                            .map(|i| ((i + p + step + rank) % 5) as f32 / 4.0 - 0.4)
                            .collect()
                    })
                    .collect();
                let slots: Vec<Option<HostGrad<'_, f32>>> =
                    grads.iter().map(|g| Some(g.as_slice().into())).collect();
                e.step(&slots, &mut replica)?;
            }
            Ok((replica.0, e.memory_report()))
        })
    };
    let (device_alone, offloaded) = (train(Offload::None), train(Offload::Optimizer));
    for ((want, _), (got, report)) in device_alone.iter().zip(&offloaded) {
        assert_eq!(got, want);
        assert_ne!(got[0][0], bf16::from_f32(0.5), "the model trained");
        assert_offloaded(report, "bf16 with masters");
    }
}

/// What a [`Watched`] optimizer runs before each step, given the pieces;
/// an error fails the step.
type BeforeStep = Box<dyn Fn(&[ParamMut<'_, f64>]) -> Result<()> + Send>;

/// A bf16 model whose host steps each bucket as it lands: the write-back
/// sends each stepped bucket up in bf16, rounded on the host (2 bytes a
/// weight, not the masters' 4), and the replica gets the values the device
/// alone gives it, bit for bit, at one rank and two.
#[test]
fn offload_sends_a_16_bit_models_weights_up_in_its_dtype() {
    let infos = bf16_model();
    let steps = 3;
    // Gathering in the masters' dtype sends them up as they are.
    for (world, gather16) in [(1, true), (2, true), (1, false)] {
        let seen: Vec<Arc<Mutex<Seen>>> = (0..world).map(|_| Arc::default()).collect();
        let train = |offload: Offload| {
            run(world, |comm| {
                let rank = comm.rank();
                let adam: Box<dyn FunctionalOptimizer<f32>> =
                    Box::new(Adam::new(AdamConfig::default().with_lr(0.01))?);
                // Without offload the device alone reduces an interleaved
                // pass in the step: the after-backward schedule's sums.
                let overlap = match offload {
                    Offload::None => Overlap::AfterBackward,
                    _ => Overlap::Interleaved,
                };
                let mut e = Engine::<f32, _, _>::with_memory(
                    comm,
                    OffloadMemory::new(PlanCheck::new(seen[rank].clone(), true)),
                    infos.clone(),
                    adam,
                    EngineConfig::default()
                        .with_stage(Stage::Gradients)
                        .with_bucket_bytes(64)
                        .with_overlap(overlap)
                        .with_offload(offload, 1)
                        .with_gather_in_param_dtype(gather16),
                )?;
                let mut replica = CastParams(
                    infos
                        .iter()
                        .map(|p| vec![bf16::from_f32(0.5); p.numel()])
                        .collect::<Vec<Vec<bf16>>>(),
                );
                let order: Vec<(usize, usize)> = (0..infos.len()).rev().map(|p| (p, 1)).collect();
                for step in 0..steps {
                    e.begin_backward(&order, &mut replica)?;
                    for (p, info) in infos.iter().enumerate().rev() {
                        let grad: Vec<f32> = (0..info.numel())
                            .map(|i| ((i * 7 + p + step + rank) % 11) as f32 / 8.0 - 0.6)
                            .collect();
                        e.accumulate_param(p, .., grad.as_slice().into())?;
                    }
                    let none: Vec<Option<HostGrad<'_, f32>>> = vec![None; infos.len()];
                    e.step(&none, &mut replica)?;
                }
                let shard: usize = e.sharding().layout().buckets.iter().map(|b| b.len()).sum();
                Ok((replica.0, shard, e.counters().offload.packing))
            })
        };
        let device_alone = train(Offload::None);
        let before: Vec<usize> = seen
            .iter()
            .map(|s| s.lock().expect("no panic").uploaded_bytes)
            .collect();
        let offloaded = train(Offload::Optimizer);
        for (rank, ((want, ..), (got, shard, packing))) in
            device_alone.iter().zip(&offloaded).enumerate()
        {
            assert_eq!(got, want, "N={world} rank {rank}");
            assert_ne!(got[0][0], bf16::from_f32(0.5), "the model trained");
            let uploaded = seen[rank].lock().expect("no panic").uploaded_bytes - before[rank];
            let bytes = if gather16 { 2 } else { 4 };
            // The rounding's time is counted apart from the stepping's.
            assert_eq!(*packing > Duration::ZERO, gather16, "N={world} rank {rank}");
            assert_eq!(
                uploaded,
                steps * bytes * shard,
                "N={world} rank {rank}: bytes sent up for {shard} weights a step"
            );
        }
    }
}

/// An optimizer that counts its steps and records, at each, how many
/// gradients the test had handed over by then; and runs `before` first.
struct Watched {
    inner: Box<dyn FunctionalOptimizer<f64>>,
    handed: Arc<AtomicUsize>,
    seen: Arc<Mutex<Vec<usize>>>,
    before: Option<BeforeStep>,
}

impl FunctionalOptimizer<f64> for Watched {
    fn kind(&self) -> &str {
        self.inner.kind()
    }
    fn step(&mut self, params: &mut [ParamMut<'_, f64>], grads: &[Option<&[f64]>]) -> Result<()> {
        if let Some(before) = &self.before {
            before(params)?;
        }
        let handed = self.handed.load(Ordering::SeqCst);
        self.seen.lock().expect("no panic").push(handed);
        self.inner.step(params, grads)
    }
    fn num_groups(&self) -> usize {
        self.inner.num_groups()
    }
    fn add_group(&mut self, hyper: &Hyperparams) -> Result<usize> {
        self.inner.add_group(hyper)
    }
    fn hyperparams(&self, group: usize) -> Hyperparams {
        self.inner.hyperparams(group)
    }
    fn set_hyperparams(&mut self, group: usize, hyper: &Hyperparams) -> Result<()> {
        self.inner.set_hyperparams(group, hyper)
    }
    fn learning_rate(&self, group: usize) -> f64 {
        self.inner.learning_rate(group)
    }
    fn set_learning_rate(&mut self, group: usize, lr: f64) {
        self.inner.set_learning_rate(group, lr)
    }
    fn export_state(&self) -> OptimizerState<f64> {
        self.inner.export_state()
    }
    fn import_state(&mut self, state: OptimizerState<f64>) -> Result<()> {
        self.inner.import_state(state)
    }
    fn state_bytes(&self) -> usize {
        self.inner.state_bytes()
    }
}

/// With the interleaved schedule the host steps each bucket as it lands:
/// the first bucket is stepped while a gradient is still to come. Over a
/// device with a communication thread, that thread steps; over one without
/// (as the GPU's), a step thread of the offload's, which waits for each
/// bucket's own copy into host memory: backward never waits for a copy (on
/// a GPU, for the stream to catch up).
#[test]
fn the_host_steps_buckets_as_they_land_not_after_the_whole_gradient() {
    let model = Synthetic::medium();
    let n = model.infos().len();
    for inline in [false, true] {
        let handed = Arc::new(AtomicUsize::new(0));
        let seen = Arc::new(Mutex::new(Vec::new()));
        let device = Arc::new(Mutex::new(Seen::default()));
        let trained = run(1, |comm| {
            let mut e = Engine::with_memory(
                comm,
                OffloadMemory::new(PlanCheck::new(device.clone(), inline)),
                model.infos(),
                Box::new(Watched {
                    inner: make_opt(Opt::Adam, false),
                    handed: handed.clone(),
                    seen: seen.clone(),
                    before: None,
                }),
                config(Stage::Gradients, Overlap::Interleaved, 1)
                    .with_offload(Offload::Optimizer, 1),
            )?;
            let mut params = model.init();
            let g = model.grads(&params, 0, 0);
            let order: Vec<(usize, usize)> = (0..n).rev().map(|p| (p, 1)).collect();
            e.begin_backward(&order, &mut params)?;
            // Every gradient but the first parameter's (`a.bias`, handed
            // over last): several whole buckets, which must be stepped
            // before it.
            for p in (1..n).rev() {
                handed.fetch_add(1, Ordering::SeqCst);
                e.accumulate_param(p, .., (&g[p]).into())?;
            }
            let deadline = Instant::now() + Duration::from_secs(20);
            while seen.lock().expect("no panic").is_empty() {
                assert!(
                    Instant::now() < deadline,
                    "inline {inline}: no bucket stepped while a gradient was still to come"
                );
                std::thread::sleep(Duration::from_millis(1));
            }
            if inline {
                let device = device.lock().expect("no panic");
                assert_eq!(
                    device.full_lands, 0,
                    "backward waited for every queued copy"
                );
                assert!(
                    device.partial_lands > 0,
                    "no bucket's copy landed on its own"
                );
                assert_eq!(
                    device.taker_lands, 0,
                    "backward waited for a copy it had queued, instead of the step thread"
                );
            }
            handed.fetch_add(1, Ordering::SeqCst);
            e.accumulate_param(0, .., (&g[0]).into())?;
            let none: Vec<Option<HostGrad<'_, f64>>> = vec![None; n];
            let waits = |d: &Seen| (d.full_lands, d.synchronous_uploads);
            let before = waits(&device.lock().expect("no panic"));
            e.step(&none, &mut params)?;
            let times = e.counters().offload;
            if inline {
                // Every bucket was stepped during backward: the write-back
                // only queues uploads, and never waits for the device.
                assert_eq!(
                    waits(&device.lock().expect("no panic")),
                    before,
                    "the write-back waited for the device (full lands, synchronous uploads)"
                );
                assert_eq!(times.steps, 1, "{times:?}");
                assert!(
                    times.stepping > Duration::ZERO && times.write_back > Duration::ZERO,
                    "the step thread's and the write-back's times: {times:?}"
                );
            } else {
                assert_eq!(
                    times,
                    OffloadTimes::default(),
                    "the communication thread steps: no step thread"
                );
            }
            Ok(params)
        });
        let seen = seen.lock().expect("no panic");
        assert!(
            seen[0] < n,
            "inline {inline}: stepped before the last gradient: {seen:?}"
        );
        assert!(
            seen.len() > 1,
            "inline {inline}: stepped bucket by bucket: {seen:?}"
        );
        assert_eq!(
            trained,
            after_backward(&model, inline, 1),
            "inline {inline}"
        );
    }
}

/// The weights after `steps` hooked steps of an offloaded stage-2 engine
/// at N = 1 that steps after backward (over a device posing `inline` or
/// not), from the model's initial values.
fn after_backward(model: &Synthetic, inline: bool, steps: usize) -> Vec<Vec<Vec<f64>>> {
    run(1, |comm| {
        let mut e = Engine::with_memory(
            comm,
            OffloadMemory::new(PlanCheck::new(Arc::default(), inline)),
            model.infos(),
            make_opt(Opt::Adam, false),
            EngineConfig::default()
                .with_stage(Stage::Gradients)
                .with_bucket_bytes(96)
                .with_offload(Offload::Optimizer, 1),
        )?;
        let (_, _, params) = train_from(&mut e, model, Path::Hooked, 1, model.init(), (0, steps))?;
        Ok(params)
    })
}

/// An offloaded stage-2 engine over `device` whose interleaved steps run
/// `before` first (in the step thread's calls).
fn watched_offload<C: Communicator<Memory = zero_core::comm::Host>>(
    comm: C,
    model: &Synthetic,
    device: PlanCheck,
    before: BeforeStep,
) -> Result<Engine<f64, C, OffloadMemory<PlanCheck>>> {
    Engine::with_memory(
        comm,
        OffloadMemory::new(device),
        model.infos(),
        Box::new(Watched {
            inner: make_opt(Opt::Adam, false),
            handed: Arc::default(),
            seen: Arc::default(),
            before: Some(before),
        }),
        config(Stage::Gradients, Overlap::Interleaved, 1).with_offload(Offload::Optimizer, 1),
    )
}

/// After backward, offload's step thread goes on with its last buckets
/// while the write-back takes each bucket it has stepped: in every step,
/// weights are on their way to the device before the last bucket is
/// stepped (a write-back that waited for every bucket first would leave the
/// held step below waiting out its 5 s). The weights are those of the
/// after-backward schedule, bit for bit, and no upload's source changed
/// before it landed.
#[test]
fn the_write_back_takes_each_bucket_as_the_step_thread_steps_it() {
    let model = Synthetic::medium();
    let (steps, last) = (3, model.infos()[0].name.clone());
    let device = Arc::new(Mutex::new(Seen::default()));
    // Uploads queued before this step, and per step those queued by the
    // time its last bucket stepped.
    let mark = Arc::new(AtomicUsize::new(0));
    let early_uploads = Arc::new(Mutex::new(Vec::new()));
    let trained = run(1, |comm| {
        let (watched, since, early_uploads, last) = (
            device.clone(),
            mark.clone(),
            early_uploads.clone(),
            last.clone(),
        );
        // The first parameter's gradient comes last: its bucket is stepped
        // last, once this step's first weights are queued (or at 5 s).
        let hold: BeforeStep = Box::new(move |params| {
            if !params.iter().any(|p| p.key.name == last) {
                return Ok(());
            }
            let uploads = || watched.lock().expect("no panic").queued_uploads;
            let since = since.load(Ordering::SeqCst);
            let deadline = Instant::now() + Duration::from_secs(5);
            while uploads() <= since && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(1));
            }
            early_uploads
                .lock()
                .expect("no panic")
                .push(uploads() - since);
            Ok(())
        });
        let mut e = watched_offload(comm, &model, PlanCheck::new(device.clone(), true), hold)?;
        let mut params = model.init();
        for step in 0..steps {
            mark.store(
                device.lock().expect("no panic").queued_uploads,
                Ordering::SeqCst,
            );
            hooked_micro_step(&mut e, &model.grads(&params, 0, step), &mut params)?;
        }
        Ok(params)
    });
    let early_uploads = early_uploads.lock().expect("no panic");
    assert_eq!(early_uploads.len(), steps, "{early_uploads:?}");
    assert!(
        early_uploads.iter().all(|&n| n > 0),
        "the write-back waited for the last bucket's step: uploads queued before it, per step: \
         {early_uploads:?}"
    );
    assert_eq!(device.lock().expect("no panic").changed_uploads, 0);
    assert_eq!(trained, after_backward(&model, true, steps));
}

/// A step thread that fell behind catches up in larger calls: the buckets
/// handed over while it stepped one go into its next call together (a few
/// at a time), with the weights of the after-backward schedule, bit for
/// bit.
#[test]
fn a_step_thread_behind_steps_the_buckets_that_came_meanwhile_together() {
    let model = Synthetic::medium();
    let n = model.infos().len();
    let handed = Arc::new(AtomicUsize::new(0));
    let per_call = Arc::new(Mutex::new(Vec::new()));
    let trained = run(1, |comm| {
        let (all_in, per_call) = (handed.clone(), per_call.clone());
        // The first call waits (5 s at most) until every gradient is in.
        let before: BeforeStep = Box::new(move |params| {
            let mut per_call = per_call.lock().expect("no panic");
            if per_call.is_empty() {
                let deadline = Instant::now() + Duration::from_secs(5);
                while all_in.load(Ordering::SeqCst) < n && Instant::now() < deadline {
                    std::thread::sleep(Duration::from_millis(1));
                }
            }
            per_call.push(params.iter().map(|p| p.data.len()).sum::<usize>());
            Ok(())
        });
        let mut e = watched_offload(comm, &model, PlanCheck::new(Arc::default(), true), before)?;
        let mut params = model.init();
        let g = model.grads(&params, 0, 0);
        let order: Vec<(usize, usize)> = (0..n).rev().map(|p| (p, 1)).collect();
        e.begin_backward(&order, &mut params)?;
        for p in (0..n).rev() {
            e.accumulate_param(p, .., (&g[p]).into())?;
            handed.fetch_add(1, Ordering::SeqCst);
        }
        let none: Vec<Option<HostGrad<'_, f64>>> = vec![None; n];
        e.step(&none, &mut params)?;
        Ok((params, e.sharding().layout().buckets.len()))
    });
    let (trained, buckets) = trained.into_iter().unzip::<_, _, Vec<_>, Vec<_>>();
    let per_call = per_call.lock().expect("no panic");
    assert!(
        per_call.len() < buckets[0],
        "{} buckets, each stepped alone: elements per call {per_call:?}",
        buckets[0]
    );
    assert_eq!(trained, after_backward(&model, true, 1));
}

/// A host step that fails on a bucket in the middle of the shard, after
/// backward, fails the engine's step with the optimizer's error, and the
/// engine goes on: the optimizer and the shards are back, and the next
/// steps train.
#[test]
fn a_failing_host_step_fails_the_step_and_the_engine_goes_on() {
    let model = Synthetic::medium();
    let middle = model.infos()[2].name.clone();
    let failures = Arc::new(AtomicUsize::new(0));
    let armed = Arc::new(std::sync::atomic::AtomicBool::new(false));
    run(1, |comm| {
        let (fail, failed, middle) = (armed.clone(), failures.clone(), middle.clone());
        let before: BeforeStep = Box::new(move |params| {
            if params.iter().any(|p| p.key.name == middle) && fail.swap(false, Ordering::SeqCst) {
                failed.fetch_add(1, Ordering::SeqCst);
                return Err(zero_core::Error::Optimizer("bucket refused".into()));
            }
            Ok(())
        });
        let mut e = watched_offload(comm, &model, PlanCheck::new(Arc::default(), true), before)?;
        let mut params = model.init();
        for step in 0..4 {
            armed.store(step == 1, Ordering::SeqCst);
            let before = params.clone();
            let stepped = hooked_micro_step(&mut e, &model.grads(&params, 0, step), &mut params);
            if step == 1 {
                let err = stepped.expect_err("the optimizer refused a bucket");
                assert!(err.to_string().contains("bucket refused"), "{err}");
            } else {
                stepped?;
                assert_ne!(params, before, "step {step} trained");
            }
        }
        assert_eq!(e.steps(), 3, "the failed step is not counted");
        Ok(())
    });
    assert_eq!(failures.load(Ordering::SeqCst), 1);
}

/// An offloaded run's checkpoint resumes without offload, and the other
/// way round, on the trajectory of an uninterrupted run.
#[test]
fn checkpoints_resume_across_offload_on_and_off() {
    let model = Synthetic::medium();
    let config = config(Stage::Gradients, Overlap::AfterBackward, 1);
    let engine = |comm, offload| {
        Engine::with_memory(
            comm,
            Offloaded::new(HostMemory),
            model.infos(),
            make_opt(Opt::Adam, false),
            config.clone().with_offload(offload, 1),
        )
    };
    let uninterrupted = run(2, |comm| {
        let mut e = engine(comm, Offload::None)?;
        Ok(train_from(&mut e, &model, Path::Hooked, 1, model.init(), (0, 4))?.0)
    });
    for (first, second) in [
        (Offload::Optimizer, Offload::None),
        (Offload::None, Offload::Optimizer),
    ] {
        let dir = tempfile::tempdir().unwrap();
        run(2, |comm| {
            let mut e = engine(comm, first)?;
            let (_, _, mut params) =
                train_from(&mut e, &model, Path::Hooked, 1, model.init(), (0, 2))?;
            e.save_checkpoint(dir.path(), &mut params, &zero_core::SaveOptions::default())?;
            Ok(())
        });
        let resumed = run(2, |comm| {
            let mut e = engine(comm, second)?;
            // Whatever the replica holds, the checkpoint's weights win.
            let mut params: Vec<Vec<f64>> =
                model.init().iter().map(|p| vec![0.0; p.len()]).collect();
            e.load_checkpoint(dir.path(), &mut params)?;
            Ok(train_from(&mut e, &model, Path::Hooked, 1, params, (2, 2))?.0)
        });
        // Within rounding: a resumed run is not bitwise the uninterrupted
        // one even without offload (the checkpoint's state is rebuilt).
        for (rank, (got, want)) in resumed.iter().zip(&uninterrupted).enumerate() {
            for (s, (got, want)) in got.iter().zip(&want[2..]).enumerate() {
                let what = format!("{first:?} then {second:?}, rank {rank}, step {}", s + 2);
                assert_close(got, want, 1e-12, &what);
            }
        }
    }
}

#[test]
fn offload_is_refused_where_it_cannot_be_with_what_to_do() {
    let model = Synthetic::medium();
    // The error building an engine over host memory, or over the offload
    // wrapper (`device`), with `config`.
    let refused = |device: bool, config: EngineConfig| {
        let errors = run(1, |comm| {
            let opt = make_opt(Opt::Adam, false);
            let built = if device {
                let memory = Offloaded::new(HostMemory);
                Engine::with_memory(comm, memory, model.infos(), opt, config.clone()).map(drop)
            } else {
                Engine::new(comm, model.infos(), opt, config.clone()).map(drop)
            };
            Ok(built.err().map(|e| e.to_string()))
        });
        errors[0].clone().expect("refused")
    };
    let offload = EngineConfig::default().with_offload(Offload::Optimizer, 0);
    // Host memory has nothing to offload.
    let err = refused(false, offload.clone());
    assert!(err.contains("NCCL") && err.contains("host memory"), "{err}");
    // Stage 0 has no shard to offload.
    let err = refused(true, offload.with_stage(Stage::Ddp));
    assert!(
        err.contains("offload") && err.contains("stage 1, 2 or 3"),
        "{err}"
    );
    // A copy stream for transfers there are none of.
    let err = refused(true, EngineConfig::default().with_offload_copy_stream(true));
    assert!(
        err.contains("offload is off") && err.contains("turn offload on"),
        "{err}"
    );
}
