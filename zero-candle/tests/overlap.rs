//! Reductions overlapped with backward: the three schedules give the same
//! weights bitwise; overlap is shown to happen (without timing); a rank
//! whose graph differs is a clear error on every rank.

mod nn_support;

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp1, DType, Device, Layout, Module, Shape, Tensor, Var};
use candle_nn::{VarBuilder, VarMap};
use rand::{Rng, SeedableRng};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;
use zero_candle::nn::{self, GradHook};
use zero_candle::{ZeroHook, ZeroOptimizer};
use zero_core::comm::{Delayed, Host};
use zero_core::engine::{EngineConfig, NormType, Overlap, ReductionProgress, Stage};
use zero_core::optim::{
    AdamW, AdamWConfig, FunctionalOptimizer, Hyperparams, OptimizerState, ParamMut,
};
use zero_core::{Communicator, ThreadComm, ThreadGroup};

const VOCAB: usize = 11;
const HIDDEN: usize = 8;
const SEQ: usize = 5;

/// A small language model with every case the bucketing must handle.
struct Model {
    /// Tied: the embedding table is also the output projection (two hooked
    /// uses of one variable).
    embedding: nn::Embedding,
    head: nn::Linear,
    l1: nn::Linear,
    norm: nn::LayerNorm,
    l2: nn::Linear,
    /// Never used: gets no gradient on any rank.
    _unused: nn::Linear,
    /// A `[SEQ, SEQ]` mixing matrix used as the left operand of a matmul,
    /// through `tap` (not announced: predicted from the second step on).
    mix: Var,
    /// Read `mix` with a plain op instead (its gradient then comes through
    /// the `GradStore`).
    plain_mix: bool,
    hook: Option<Arc<dyn GradHook>>,
    varmap: VarMap,
}

impl Model {
    fn new(hook: Option<Arc<dyn GradHook>>) -> candle_core::Result<Self> {
        let varmap = VarMap::new();
        let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
        let embedding = nn::embedding(VOCAB, HIDDEN, vb.pp("emb"), hook.clone())?;
        let head = nn::Linear::new(embedding.embeddings().clone(), None, hook.clone());
        let l1 = nn::linear(HIDDEN, 16, vb.pp("l1"), hook.clone())?;
        let norm = nn::layer_norm(16, 1e-5, vb.pp("norm"), hook.clone())?;
        let l2 = nn::linear(16, HIDDEN, vb.pp("l2"), hook.clone())?;
        let unused = nn::linear(HIDDEN, 3, vb.pp("unused"), hook.clone())?;
        vb.get_with_hints((SEQ, SEQ), "mix", candle_nn::Init::Const(0.2))?;
        let mix = varmap.data().lock().unwrap()["mix"].clone();
        nn_support::seed_varmap(&varmap, 7)?;
        Ok(Self {
            embedding,
            head,
            l1,
            norm,
            l2,
            _unused: unused,
            mix,
            plain_mix: false,
            hook,
            varmap,
        })
    }

    fn loss(&self, tokens: &Tensor, targets: &Tensor) -> candle_core::Result<Tensor> {
        let h = self.embedding.forward(tokens)?; // [B, SEQ, HIDDEN]
        let h = self.l1.forward(&h)?.relu()?;
        let h = self.l2.forward(&self.norm.forward(&h)?)?;
        let mix = match self.plain_mix {
            true => self.mix.as_tensor().clone(),
            false => nn::tap(&self.mix, self.hook.clone())?,
        };
        let h = mix.broadcast_matmul(&h)?; // left operand
        let logits = self.head.forward(&h)?.flatten_to(1)?;
        candle_nn::loss::cross_entropy(&logits, &targets.flatten_all()?)
    }
}

fn batch(rng: &mut rand::rngs::StdRng) -> candle_core::Result<(Tensor, Tensor)> {
    let tokens: Vec<u32> = (0..3 * SEQ)
        .map(|_| rng.gen_range(0..VOCAB as u32))
        .collect();
    let targets: Vec<u32> = (0..3 * SEQ)
        .map(|_| rng.gen_range(0..VOCAB as u32))
        .collect();
    Ok((
        Tensor::from_vec(tokens, (3, SEQ), &Device::Cpu)?,
        Tensor::from_vec(targets, (3, SEQ), &Device::Cpu)?,
    ))
}

/// The weights after three steps, and how many steps deferred their
/// all-gathers.
fn train_model<C>(
    comm: C,
    config: &EngineConfig,
    plain_mix: bool,
) -> zero_candle::Result<(Vec<Vec<f32>>, u64)>
where
    C: Communicator<Memory = Host> + 'static,
{
    let rank = comm.rank();
    let hook = ZeroHook::<C, f32>::new();
    let mut model = Model::new(Some(hook.clone()))?;
    model.plain_mix = plain_mix;
    let adamw = AdamW::new(AdamWConfig::default().with_lr(1e-2))?;
    let mut opt = ZeroOptimizer::new(&model.varmap, comm, config.clone(), Box::new(adamw))?
        .with_hook(&hook)?;
    let mut rng = rand::rngs::StdRng::seed_from_u64(100 + rank as u64);
    for _ in 0..3 * config.grad_accum_steps {
        let (tokens, targets) = batch(&mut rng)?;
        opt.backward_step(&model.loss(&tokens, &targets)?)?;
    }
    // Read outside the model's forward: wait for deferred gathers.
    opt.sync_params()?;
    let weights = opt
        .vars()
        .iter()
        .map(|v| Ok(v.flatten_all()?.to_vec1::<f32>()?))
        .collect::<zero_candle::Result<_>>()?;
    Ok((weights, opt.engine().counters().deferred_steps))
}

fn train(comm: ThreadComm, config: &EngineConfig) -> zero_candle::Result<Vec<Vec<f32>>> {
    Ok(train_model(comm, config, false)?.0)
}

fn run(world: usize, config: &EngineConfig) -> Vec<Vec<Vec<f32>>> {
    ThreadGroup::new(world)
        .run(|comm| train(comm, config))
        .into_iter()
        .map(|r| r.expect("no panic").expect("training works"))
        .collect()
}

/// Like [`run`], over a link that delays every collective by `latency`,
/// with `mix` read by a hooked tap or a plain op; with the deferred steps.
fn run_delayed(
    world: usize,
    config: &EngineConfig,
    latency: Duration,
    plain_mix: bool,
) -> Vec<(Vec<Vec<f32>>, u64)> {
    ThreadGroup::new(world)
        .run(|comm| {
            let link = Delayed::new(comm, latency, f64::INFINITY);
            train_model(link, config, plain_mix)
        })
        .into_iter()
        .map(|r| r.expect("no panic").expect("training works"))
        .collect()
}

#[test]
fn every_schedule_gives_the_same_weights_bitwise() {
    for stage in [Stage::Ddp, Stage::OptimizerState, Stage::Gradients] {
        for (accum, clip) in [(1, false), (2, false), (2, true)] {
            let mut config = EngineConfig::default()
                .with_stage(stage)
                .with_bucket_bytes(64)
                .with_grad_accum_steps(accum);
            if clip {
                config = config.with_clip(0.5, NormType::L2);
            }
            let serial = run(2, &config.clone().with_overlap(Overlap::None));
            let mut schedules = vec![Overlap::AfterBackward];
            if !clip {
                schedules.push(Overlap::Interleaved);
            }
            for overlap in schedules {
                let overlapped = run(2, &config.clone().with_overlap(overlap));
                assert_eq!(
                    serial, overlapped,
                    "stage {stage:?}, {accum} micro-step(s), clip {clip}, {overlap:?}"
                );
            }
            // Training moved every used parameter; the unused one stayed.
            let fresh = ThreadGroup::new(1)
                .run(|_| -> candle_core::Result<Vec<Vec<f32>>> {
                    let model = Model::new(None)?;
                    let data = model.varmap.data().lock().unwrap();
                    let mut names: Vec<&String> = data.keys().collect();
                    names.sort();
                    names
                        .iter()
                        .map(|n| data[*n].flatten_all()?.to_vec1::<f32>())
                        .collect()
                })
                .remove(0)
                .unwrap()
                .unwrap();
            for (i, (before, after)) in fresh.iter().zip(&serial[0]).enumerate() {
                // Name order: emb, l1.bias, l1.weight, l2.bias, l2.weight,
                // mix, norm.bias, norm.weight, unused.bias, unused.weight.
                let unused = i >= 8;
                assert_eq!(before == after, unused, "parameter #{i}, stage {stage:?}");
            }
        }
    }
}

#[test]
fn stage_2_keeps_no_full_gradient_across_an_accumulation_window() {
    for (stage, full) in [(Stage::OptimizerState, true), (Stage::Gradients, false)] {
        let results = ThreadGroup::new(2).run(|comm| -> zero_candle::Result<usize> {
            let hook = ZeroHook::<ThreadComm, f32>::new();
            let model = Model::new(Some(hook.clone()))?;
            let adamw = AdamW::new(AdamWConfig::default())?;
            let config = EngineConfig::default()
                .with_stage(stage)
                .with_bucket_bytes(64)
                .with_grad_accum_steps(2);
            let mut opt = ZeroOptimizer::new(&model.varmap, comm, config, Box::new(adamw))?
                .with_hook(&hook)?;
            let mut rng = rand::rngs::StdRng::seed_from_u64(1);
            let (tokens, targets) = batch(&mut rng)?;
            // The first micro-step: accumulated, not stepped.
            assert!(opt
                .backward_step(&model.loss(&tokens, &targets)?)?
                .is_none());
            Ok(opt.memory_report().grads)
        });
        for grads in results {
            let grads = grads.expect("no panic").expect("micro-step works");
            assert_eq!(
                grads > 0,
                full,
                "{stage:?}: {grads} bytes of full gradients"
            );
        }
    }
}

#[test]
fn three_ranks_and_large_buckets_agree_too() {
    for bucket_bytes in [32, 1 << 20] {
        let config = EngineConfig::default().with_bucket_bytes(bucket_bytes);
        let serial = run(3, &config.clone().with_overlap(Overlap::None));
        let overlapped = run(3, &config.clone().with_overlap(Overlap::Interleaved));
        assert_eq!(serial, overlapped, "bucket_bytes {bucket_bytes}");
    }
}

/// An identity whose backward, the last thing backward runs when applied
/// to the model's input, waits for the first bucket reduction of the step.
struct Probe {
    progress: ReductionProgress,
    before: usize,
}

impl CustomOp1 for Probe {
    fn name(&self) -> &'static str {
        "overlap-probe"
    }

    fn cpu_fwd(
        &self,
        storage: &CpuStorage,
        layout: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        Ok((
            storage.to_dtype(layout, storage.dtype())?,
            layout.shape().clone(),
        ))
    }

    fn bwd(
        &self,
        _arg: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<Option<Tensor>> {
        if !self
            .progress
            .wait_for(self.before + 1, Duration::from_secs(3))
        {
            candle_core::bail!("probe: no bucket reduction completed during backward");
        }
        Ok(Some(grad.clone()))
    }
}

/// A 6-32-32-4 MLP of hooked layers.
struct Mlp {
    varmap: VarMap,
    layers: [nn::Linear; 3],
}

impl Mlp {
    fn new<C: Communicator<Memory = Host> + 'static>(
        hook: &Arc<ZeroHook<C, f32>>,
    ) -> candle_core::Result<Self> {
        let h: Option<Arc<dyn GradHook>> = Some(hook.clone());
        let varmap = VarMap::new();
        let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
        let layers = [
            nn::linear(6, 32, vb.pp("l1"), h.clone())?,
            nn::linear(32, 32, vb.pp("l2"), h.clone())?,
            nn::linear(32, 4, vb.pp("l3"), h)?,
        ];
        Ok(Self { varmap, layers })
    }

    fn loss(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let [l1, l2, l3] = &self.layers;
        l3.forward(&l2.forward(&l1.forward(x)?.relu()?)?.relu()?)?
            .sqr()?
            .mean_all()
    }
}

fn probe_run(comm: ThreadComm, overlap: Overlap) -> zero_candle::Result<()> {
    let hook = ZeroHook::<ThreadComm, f32>::new();
    let mlp = Mlp::new(&hook)?;
    let config = EngineConfig::default()
        .with_bucket_bytes(256)
        .with_overlap(overlap);
    let adamw = AdamW::new(AdamWConfig::default())?;
    let mut opt =
        ZeroOptimizer::new(&mlp.varmap, comm, config, Box::new(adamw))?.with_hook(&hook)?;
    // A variable input, so that backward reaches the probe, after every
    // layer.
    let x = Var::ones((3, 6), DType::F32, &Device::Cpu)?;
    let progress = opt.engine().reduction_progress();
    let probe = Probe {
        before: progress.completed(),
        progress,
    };
    let input = x.as_tensor().apply_op1(probe)?;
    opt.backward_step(&mlp.loss(&input)?)?;
    Ok(())
}

#[test]
fn reductions_run_during_backward_only_when_overlapped() {
    for overlap in [Overlap::AfterBackward, Overlap::Interleaved] {
        for result in ThreadGroup::new(2).run(|comm| probe_run(comm, overlap)) {
            result
                .expect("no panic")
                .expect("bucket 0 reduced before backward ended");
        }
    }
    for result in ThreadGroup::new(2).run(|comm| probe_run(comm, Overlap::None)) {
        let err = result
            .expect("no panic")
            .expect_err("nothing reduced during backward");
        assert!(err.to_string().contains("probe"), "{err}");
    }
}

/// AdamW noting, at each call of its step, how many bucket reductions
/// had completed.
struct Watched {
    inner: AdamW<f32>,
    progress: Arc<Mutex<Option<ReductionProgress>>>,
    seen: Arc<Mutex<Vec<usize>>>,
}

impl FunctionalOptimizer<f32> for Watched {
    fn kind(&self) -> &str {
        self.inner.kind()
    }

    fn step(
        &mut self,
        params: &mut [ParamMut<'_, f32>],
        grads: &[Option<&[f32]>],
    ) -> zero_core::Result<()> {
        let progress = self.progress.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(progress) = progress.as_ref() {
            let mut seen = self.seen.lock().unwrap_or_else(PoisonError::into_inner);
            seen.push(progress.completed());
        }
        self.inner.step(params, grads)
    }

    fn num_groups(&self) -> usize {
        self.inner.num_groups()
    }

    fn add_group(&mut self, hyper: &Hyperparams) -> zero_core::Result<usize> {
        self.inner.add_group(hyper)
    }

    fn hyperparams(&self, group: usize) -> Hyperparams {
        self.inner.hyperparams(group)
    }

    fn set_hyperparams(&mut self, group: usize, hyper: &Hyperparams) -> zero_core::Result<()> {
        self.inner.set_hyperparams(group, hyper)
    }

    fn learning_rate(&self, group: usize) -> f64 {
        self.inner.learning_rate(group)
    }

    fn set_learning_rate(&mut self, group: usize, lr: f64) {
        self.inner.set_learning_rate(group, lr)
    }

    fn export_state(&self) -> OptimizerState<f32> {
        self.inner.export_state()
    }

    fn import_state(&mut self, state: OptimizerState<f32>) -> zero_core::Result<()> {
        self.inner.import_state(state)
    }
}

/// One stage 0 step of a three-layer MLP over a link that takes `latency`
/// per collective: the reductions completed when the optimizer first
/// stepped, and the step's bucket reductions in all.
fn first_step_sees(
    comm: ThreadComm,
    config: EngineConfig,
    latency: Duration,
) -> zero_candle::Result<(usize, usize)> {
    let comm = Delayed::new(comm, latency, f64::INFINITY);
    let hook = ZeroHook::<Delayed<ThreadComm>, f32>::new();
    let mlp = Mlp::new(&hook)?;
    let progress = Arc::new(Mutex::new(None));
    let seen = Arc::new(Mutex::new(Vec::new()));
    let watched = Watched {
        inner: AdamW::new(AdamWConfig::default())?,
        progress: Arc::clone(&progress),
        seen: Arc::clone(&seen),
    };
    let config = config.with_stage(Stage::Ddp).with_bucket_bytes(1 << 10);
    let mut opt =
        ZeroOptimizer::new(&mlp.varmap, comm, config, Box::new(watched))?.with_hook(&hook)?;
    let before = opt.engine().reduction_progress().completed();
    *progress.lock().unwrap_or_else(PoisonError::into_inner) =
        Some(opt.engine().reduction_progress());
    let x = Tensor::ones((3, 6), DType::F32, &Device::Cpu)?;
    opt.backward_step(&mlp.loss(&x)?)?;
    let buckets = opt.engine().sharding().layout().buckets.len();
    let first = seen.lock().unwrap_or_else(PoisonError::into_inner)[0];
    Ok((first - before, buckets))
}

#[test]
fn stage_0_steps_each_bucket_as_soon_as_it_is_reduced() {
    // Each collective takes 200 ms: the first parameters step once their
    // bucket is back, while the later buckets are still on the link.
    let latency = Duration::from_millis(200);
    let overlapped = EngineConfig::default().with_overlap(Overlap::AfterBackward);
    for result in ThreadGroup::new(2).run(|comm| first_step_sees(comm, overlapped.clone(), latency))
    {
        let (completed, buckets) = result.expect("no panic").expect("the step works");
        assert!(buckets >= 3, "{buckets} buckets");
        assert!(
            completed < buckets,
            "the optimizer first ran after {completed} of {buckets} reductions"
        );
    }
    // Clipping needs the global norm, and `none` reduces in the step: both
    // step after the last reduction.
    let clipped = overlapped.clone().with_clip(1.0, NormType::L2);
    let serial = EngineConfig::default().with_overlap(Overlap::None);
    for config in [clipped, serial] {
        for result in ThreadGroup::new(2).run(|comm| first_step_sees(comm, config.clone(), latency))
        {
            let (completed, buckets) = result.expect("no panic").expect("the step works");
            assert_eq!(completed, buckets, "{config:?}");
        }
    }
}

#[test]
fn a_rank_with_another_graph_is_an_error_on_every_rank() {
    let results = ThreadGroup::new(2).run(|comm| -> zero_candle::Result<()> {
        let rank = comm.rank();
        let hook = ZeroHook::<ThreadComm, f32>::new();
        let h: Option<Arc<dyn GradHook>> = Some(hook.clone());
        let varmap = VarMap::new();
        let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
        let l1 = nn::linear(4, 4, vb.pp("l1"), h.clone())?;
        let l2 = nn::linear(4, 4, vb.pp("l2"), h)?;
        let adamw = AdamW::new(AdamWConfig::default())?;
        let mut opt = ZeroOptimizer::new(&varmap, comm, EngineConfig::default(), Box::new(adamw))?
            .with_hook(&hook)?;
        let x = Tensor::ones((2, 4), DType::F32, &Device::Cpu)?;
        // Rank 1 skips a layer.
        let h = l1.forward(&x)?;
        let h = if rank == 0 { l2.forward(&h)? } else { h };
        opt.backward_step(&h.sqr()?.mean_all()?)?;
        Ok(())
    });
    for result in results {
        let err = result.expect("no panic").expect_err("the graphs differ");
        assert!(err.to_string().contains("graphs differ"), "{err}");
    }
}

#[test]
fn deferred_gathers_give_the_same_weights_bitwise() {
    // Over a slow link, a layer that did not wait for its parameters would
    // compute with the previous step's: the weights would differ.
    let latency = Duration::from_millis(2);
    for (stage, overlap, accum) in [
        (Stage::Gradients, Overlap::AfterBackward, 1),
        (Stage::Gradients, Overlap::AfterBackward, 2),
        (Stage::OptimizerState, Overlap::AfterBackward, 1),
        (Stage::Gradients, Overlap::Interleaved, 1),
    ] {
        let config = EngineConfig::default()
            .with_stage(stage)
            .with_bucket_bytes(256)
            .with_grad_accum_steps(accum)
            .with_overlap(overlap);
        for world in [2, 3] {
            let gathered = run(world, &config);
            let deferred = run_delayed(
                world,
                &config.clone().with_defer_gathers(true),
                latency,
                false,
            );
            for (rank, ((weights, deferred_steps), gathered)) in
                deferred.iter().zip(&gathered).enumerate()
            {
                let case =
                    format!("{stage:?} {overlap:?}, {accum} micro-step(s), rank {rank} of {world}");
                assert_eq!(weights, gathered, "{case}");
                assert_eq!(*deferred_steps, 3, "{case}: every step deferred");
            }
        }
    }
}

#[test]
fn a_parameter_read_by_a_plain_op_keeps_the_gathers_in_the_step() {
    let config = EngineConfig::default().with_bucket_bytes(256);
    let gathered = ThreadGroup::new(2)
        .run(|comm| train_model(comm, &config, true))
        .into_iter()
        .map(|r| r.expect("no panic").expect("training works").0)
        .collect::<Vec<_>>();
    let deferred = run_delayed(
        2,
        &config.clone().with_defer_gathers(true),
        Duration::ZERO,
        true,
    );
    for ((weights, deferred_steps), gathered) in deferred.iter().zip(&gathered) {
        assert_eq!(weights, gathered);
        assert_eq!(
            *deferred_steps, 0,
            "mix's gradient came through the GradStore"
        );
    }
}
