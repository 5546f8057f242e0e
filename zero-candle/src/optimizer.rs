//! `ZeroOptimizer`: the engine behind `candle_nn::Optimizer`.

pub(crate) mod weights;

use crate::hook::ZeroHook;
use crate::init::ShardedVarMap;
use crate::memory::{CandleMemory, MemoryOf};
use crate::stage3::holds_values;
use crate::{Error, Result};
use candle_core::backprop::GradStore;
use candle_core::{Tensor, Var, WithDType};
use candle_nn::VarMap;
use std::path::Path;
use std::sync::Arc;
use weights::{Arrangement, Saved, SavedTensor, WeightsFile};
use zero_core::checkpoint::Manifest;
use zero_core::engine::{
    Engine, EngineConfig, FetchStats, MemoryReport, SaveOptions, SavedCheckpoint, Stage, StepReport,
};
use zero_core::optim::{FunctionalOptimizer, Hyperparams};
use zero_core::{Communicator, DType, Element, ParamInfo, ReduceOp};

/// What [`ZeroOptimizer`] needs besides the variables, for
/// [`candle_nn::Optimizer::new`].
pub struct ZeroConfig<C, T: Element> {
    /// The communicator of this rank.
    pub comm: C,
    /// Stage, partitioner, buckets, accumulation, clipping.
    pub engine: EngineConfig,
    /// The functional optimizer that steps the shard.
    pub optimizer: Box<dyn FunctionalOptimizer<T>>,
}

/// A ZeRO sharded optimizer for Candle models, on any backend.
///
/// Built from a [`VarMap`] (variable names give the order of every
/// collective), a communicator, an [`EngineConfig`] and a functional
/// optimizer; every rank builds the same model and configuration (checked:
/// a difference is an error naming it). Construction makes every rank's
/// values rank 0's ([`EngineConfig::starting_model`]), so Candle's random
/// initializers need no seed. Each rank computes the loss of its own part of
/// the batch; the gradients are averaged over the ranks, so a step is the
/// step of the whole batch. Each [`ZeroOptimizer::step`] is one micro-step:
/// with `grad_accum_steps = k`, every k-th call reduces the gradients and
/// updates the variables. Variables absent from the `GradStore` get no
/// update (their optimizer state does not advance); integer variables are
/// ignored.
///
/// The communicator picks where the engine's buffers live (see
/// [`CandleMemory`]): host memory for the thread and MPI backends (any
/// [`FunctionalOptimizer`], any float dtype); GPU memory for NCCL
/// (`ZeroOptimizer<NcclComm>`, alias `NcclZeroOptimizer`, or
/// `ZeroOptimizer<CudaThreadComm>`, with feature `nccl`: f32, bf16 or f16
/// variables on the communicator's GPU (16-bit ones with f32 master
/// weights), a built-in optimizer, gradients and weights never leaving the
/// device unless `EngineConfig::offload` moves the optimizer's side to host
/// memory; stages 0-3). Checkpoints have one format: a GPU run resumes on
/// threads or MPI and back.
///
/// ```no_run
/// use candle_core::{DType, Device};
/// use candle_nn::{VarBuilder, VarMap, Optimizer};
/// use zero_core::{ThreadGroup, engine::EngineConfig, optim::{Adam, AdamConfig}};
/// use zero_candle::ZeroOptimizer;
///
/// ThreadGroup::new(2).run(|comm| {
///     let varmap = VarMap::new();
///     let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
///     let layer = candle_nn::linear(4, 2, vb.pp("layer")).unwrap();
///     let mut opt = ZeroOptimizer::<_, f32>::new(
///         &varmap, comm, EngineConfig::default(), Box::new(Adam::new(AdamConfig::default()).unwrap()),
///     ).unwrap();
///     // forward, loss, then: opt.backward_step(&loss)
/// });
/// ```
pub struct ZeroOptimizer<C, T = f32>
where
    C: Communicator + 'static,
    T: Element + WithDType,
    C::Memory: CandleMemory<T, C>,
{
    /// The engine; lent to the gradient hook during
    /// [`ZeroOptimizer::backward_step`] and back before it returns.
    engine: Option<Engine<T, C, MemoryOf<T, C>>>,
    /// The hook the model's `zero_candle::nn` layers report to, if any.
    hook: Option<Arc<ZeroHook<C, T>>>,
    names: Vec<String>,
    vars: Vec<Var>,
    last: Option<StepReport>,
}

impl<C, T> ZeroOptimizer<C, T>
where
    C: Communicator + 'static,
    T: Element + WithDType,
    C::Memory: CandleMemory<T, C>,
{
    /// Builds the optimizer over every floating-point variable of `varmap`,
    /// ordered by name, and makes every rank's values rank 0's (or checks
    /// that they are: [`EngineConfig::starting_model`]). A collective:
    /// every rank calls it.
    pub fn new(
        varmap: &VarMap,
        comm: C,
        config: EngineConfig,
        optimizer: Box<dyn FunctionalOptimizer<T>>,
    ) -> Result<Self> {
        Self::from_named_vars(named_vars(varmap)?, comm, config, optimizer)
    }

    /// Builds the optimizer over the variables of `map`, with `hook`
    /// connected (build the model's `zero_candle::nn` layers with `hook`
    /// through [`ShardedVarMap::builder`] first).
    ///
    /// At stage 3 the parameters are sharded from the start: every rank
    /// computes only its shard of each deferred variable from the map's
    /// source (a seeded initializer, a file), so no rank ever holds a whole
    /// sharded parameter, and the first step already runs sharded. Deferred
    /// variables that cannot be sharded (read by a plain op, or at most
    /// `persist_numel` elements) get their whole values. At other stages
    /// the deferred variables get their whole values and this is
    /// [`ZeroOptimizer::new`] then [`ZeroOptimizer::with_hook`]. A
    /// collective: every rank builds the same model in the same order.
    pub fn new_sharded(
        map: &ShardedVarMap,
        comm: C,
        config: EngineConfig,
        optimizer: Box<dyn FunctionalOptimizer<T>>,
        hook: &Arc<ZeroHook<C, T>>,
    ) -> Result<Self> {
        let stage3 = config.stage == Stage::Parameters;
        if !stage3 {
            map.materialize_all()?;
        }
        // Every rank computes the same values from the map's source: no
        // starting model to copy or check.
        let named = named_vars(map.varmap())?;
        let mut opt = Self::build(named, comm, config, optimizer, false)?.with_hook(hook)?;
        if stage3 {
            let (engine, names, vars) = (lent(&mut opt.engine), &opt.names, &opt.vars);
            crate::stage3::shard_from_start(engine, hook, names, vars, map)?;
        }
        Ok(opt)
    }

    /// Builds the optimizer over named variables (sorted by name here).
    /// Every rank then holds rank 0's values, or construction checked that
    /// it does ([`EngineConfig::starting_model`]).
    pub fn from_named_vars(
        named: Vec<(String, Var)>,
        comm: C,
        config: EngineConfig,
        optimizer: Box<dyn FunctionalOptimizer<T>>,
    ) -> Result<Self> {
        Self::build(named, comm, config, optimizer, true)
    }

    /// The optimizer over `named`; with `sync_start`, every rank's values
    /// made (or checked to be) rank 0's.
    fn build(
        mut named: Vec<(String, Var)>,
        comm: C,
        config: EngineConfig,
        optimizer: Box<dyn FunctionalOptimizer<T>>,
        sync_start: bool,
    ) -> Result<Self> {
        named.retain(|(_, v)| v.dtype().is_float());
        named.sort_by(|a, b| a.0.cmp(&b.0));
        let mut params = Vec::with_capacity(named.len());
        for (name, var) in &named {
            let dtype = zero_dtype(name, var.dtype())?;
            params.push(ParamInfo::new(name.clone(), var.dims().to_vec(), dtype));
        }
        let (comm, memory) = C::Memory::build(&named, comm)?;
        let engine = Engine::with_memory(comm, memory, params, optimizer, config)?;
        let (names, vars): (Vec<String>, Vec<Var>) = named.into_iter().unzip();
        if sync_start {
            // Local, and the same on every rank (the consistency check in
            // the engine's constructor compared the models).
            if let Some(i) = vars.iter().position(|v| !holds_values(v.as_tensor())) {
                return Err(Error::Variable {
                    name: names[i].clone(),
                    detail: "holds no values (a ShardedVarMap created it deferred, or stage 3 \
                             sharded it); build the optimizer of a ShardedVarMap with \
                             ZeroOptimizer::new_sharded"
                        .into(),
                });
            }
        }
        let mut opt = Self {
            engine: Some(engine),
            hook: None,
            names,
            vars,
            last: None,
        };
        if sync_start {
            let (engine, vars) = (lent(&mut opt.engine), &opt.vars);
            C::Memory::with_params(vars, &mut |params| Ok(engine.sync_starting_model(params)?))?;
        }
        Ok(opt)
    }

    /// Connects `hook`, which the model's `zero_candle::nn` layers were
    /// built with: [`ZeroOptimizer::backward_step`] then receives their
    /// parameter gradients during backward (see [`ZeroHook`]). A hook serves
    /// one optimizer.
    pub fn with_hook(mut self, hook: &Arc<ZeroHook<C, T>>) -> Result<Self> {
        let refresh = self.engine().refresh().clone();
        if !hook.connect(&self.names, &self.vars, refresh) {
            return Err(Error::Variable {
                name: "<hook>".into(),
                detail: "this ZeroHook is already connected to another optimizer; build a hook \
                         per optimizer"
                    .into(),
            });
        }
        self.hook = Some(hook.clone());
        // Hooked layers wait for their parameters, so the step may leave
        // its all-gathers running (`EngineConfig::defer_gathers`).
        let writer = crate::memory::VarAccess::<T, C>::new(self.vars.clone());
        self.engine_mut().set_param_access(Box::new(writer))?;
        Ok(self)
    }

    /// Waits until every variable holds the values of the last step.
    /// Needed only with `EngineConfig::defer_gathers`, before reading
    /// variables outside the hooked layers' forward (logging them, a plain
    /// Candle model sharing them, `VarMap::save`); the optimizer's own
    /// methods wait themselves.
    pub fn sync_params(&mut self) -> Result<()> {
        Ok(self.engine_mut().finish_gathers()?)
    }

    /// Runs `loss.backward()` and one micro-step. With a [`ZeroHook`]
    /// connected, the hooked layers hand their parameter gradients to the
    /// engine as backward computes them (none of them stays in the
    /// `GradStore`), and the engine reduces each gradient bucket as soon as
    /// it is complete, on a communication thread, while backward goes on
    /// (the [`Overlap`](zero_core::engine::Overlap) schedule of the
    /// configuration; see `zero_core::engine::Engine::begin_backward`).
    /// Without a hook, this is `step(&loss.backward()?)`.
    ///
    /// The three schedules give the same weights, bitwise. Against the
    /// plain path the result agrees up to float rounding: the hooked path
    /// partitions the parameters in gradient order (norms are summed in
    /// another order), stage 2 reduces every micro-step of an accumulation
    /// window, and a weight used both by a hooked layer and by a plain op
    /// gets its plain part in a second reduction.
    pub fn backward_step(&mut self, loss: &Tensor) -> Result<Option<StepReport>> {
        let scaled = crate::precision::scale_loss(loss, self.engine().loss_scale())?;
        let loss = &scaled;
        crate::recompute::clear_pending();
        let Some(hook) = self.hook.clone() else {
            let mut grads = loss.backward()?;
            crate::recompute::merge_pending(&mut grads)?;
            return self.step(&grads);
        };
        let grads = {
            /// Takes the engine back from the hook however backward ends
            /// (an error, or a panic unwinding through it).
            struct Return<'a, C, T>
            where
                C: Communicator + 'static,
                T: Element + WithDType,
                C::Memory: CandleMemory<T, C>,
            {
                hook: &'a ZeroHook<C, T>,
                slot: &'a mut Option<Engine<T, C, MemoryOf<T, C>>>,
            }
            impl<C, T> Drop for Return<'_, C, T>
            where
                C: Communicator + 'static,
                T: Element + WithDType,
                C::Memory: CandleMemory<T, C>,
            {
                fn drop(&mut self) {
                    *self.slot = self.hook.take_back();
                }
            }
            let expected = hook.expected(loss);
            let (engine, vars) = (lent(&mut self.engine), &self.vars);
            C::Memory::with_params(vars, &mut |params| {
                Ok(engine.begin_backward(&expected, params)?)
            })?;
            if let Some(engine) = self.engine.take() {
                hook.lend(engine);
            }
            let _return = Return {
                hook: &hook,
                slot: &mut self.engine,
            };
            loss.backward()
        };
        match grads {
            Ok(mut grads) => {
                crate::recompute::merge_pending(&mut grads)?;
                hook.backward_done();
                let report = self.step(&grads)?;
                if report.is_some() {
                    // Stage 3: the first step ran on whole weights; shard now.
                    crate::stage3::shard_after_step(
                        lent(&mut self.engine),
                        &hook,
                        &self.vars,
                        &grads,
                    )?;
                }
                Ok(report)
            }
            Err(e) => {
                // Part of this micro-step reached the engine: drop it, so
                // the next one starts clean.
                self.engine_mut().discard_window();
                Err(e.into())
            }
        }
    }

    /// One micro-step with the gradients of `grads`; returns the step's
    /// report when it completed an optimizer step.
    pub fn step(&mut self, grads: &GradStore) -> Result<Option<StepReport>> {
        if self.hook.is_none() && self.engine().config().stage == Stage::Parameters {
            static WARNED: std::sync::Once = std::sync::Once::new();
            WARNED.call_once(|| {
                tracing::warn!(
                    "stage 3 shards the parameters of zero_candle::nn layers built with a \
                     ZeroHook (connected with with_hook, trained with backward_step); without \
                     one it runs as stage 2"
                )
            });
        }
        let (engine, vars) = (lent(&mut self.engine), &self.vars);
        let report = C::Memory::with_grads(&self.names, vars, grads, &mut |slots| {
            C::Memory::with_params(vars, &mut |params| Ok(engine.step(slots, params)?))
        })?;
        if report.is_some() {
            self.last = report;
        }
        Ok(report)
    }

    /// Adds a micro-step's gradients without communicating or updating.
    pub fn accumulate(&mut self, grads: &GradStore) -> Result<()> {
        let engine = lent(&mut self.engine);
        C::Memory::with_grads(&self.names, &self.vars, grads, &mut |slots| {
            Ok(engine.accumulate(slots)?)
        })
    }

    /// Reduces the accumulated micro-steps and updates the variables.
    pub fn step_accumulated(&mut self) -> Result<StepReport> {
        let engine = lent(&mut self.engine);
        let report = C::Memory::with_params(&self.vars, &mut |params| {
            Ok(engine.step_accumulated(params)?)
        })?;
        self.last = Some(report);
        Ok(report)
    }

    /// Saves a sharded checkpoint of the optimizer state and the weights
    /// into `dir` (see [`Engine::save_checkpoint`]). A collective.
    pub fn save_checkpoint(&mut self, dir: impl AsRef<Path>) -> Result<Manifest> {
        self.save_checkpoint_with(dir, &SaveOptions::default())
    }

    /// [`ZeroOptimizer::save_checkpoint`] with options: `options.user` is
    /// stored in the manifest (data position, learning rate, ...).
    pub fn save_checkpoint_with(
        &mut self,
        dir: impl AsRef<Path>,
        options: &SaveOptions,
    ) -> Result<Manifest> {
        let (engine, dir) = (lent(&mut self.engine), dir.as_ref());
        C::Memory::with_params(&self.vars, &mut |params| {
            Ok(engine.save_checkpoint(dir, params, options)?)
        })
    }

    /// Saves a checkpoint in the background: takes a snapshot into host
    /// memory and returns while a thread of this rank writes the files of
    /// [`ZeroOptimizer::save_checkpoint_with`] (see
    /// [`Engine::save_checkpoint_async`]). First completes the save in
    /// flight, if any, and returns it. A collective.
    pub fn save_checkpoint_async(
        &mut self,
        dir: impl AsRef<Path>,
        options: &SaveOptions,
    ) -> Result<Option<SavedCheckpoint>> {
        let (engine, dir) = (lent(&mut self.engine), dir.as_ref());
        C::Memory::with_params(&self.vars, &mut |params| {
            Ok(engine.save_checkpoint_async(dir, params, options)?)
        })
    }

    /// Completes the background save in flight once every rank has written
    /// its files (see [`Engine::poll_checkpoint`]); call it on every rank
    /// once per step. A collective while a save is in flight.
    pub fn poll_checkpoint(&mut self) -> Result<Option<SavedCheckpoint>> {
        Ok(self.engine_mut().poll_checkpoint()?)
    }

    /// Waits for the background save in flight and completes it (see
    /// [`Engine::wait_checkpoint`]); call it before the optimizer is
    /// dropped. A collective while a save is in flight.
    pub fn wait_checkpoint(&mut self) -> Result<Option<SavedCheckpoint>> {
        Ok(self.engine_mut().wait_checkpoint()?)
    }

    /// Loads a checkpoint saved at any world size, stage and partitioner:
    /// the weights into the variables, this rank's optimizer state, the
    /// hyperparameters and the step counter (see
    /// [`Engine::load_checkpoint`]). A collective.
    pub fn load_checkpoint(&mut self, dir: impl AsRef<Path>) -> Result<Manifest> {
        let (engine, dir) = (lent(&mut self.engine), dir.as_ref());
        C::Memory::with_params(&self.vars, &mut |params| {
            Ok(engine.load_checkpoint(dir, params)?)
        })
    }

    /// Whether every rank is to stop at this step boundary because one of
    /// them got a preemption signal (see
    /// [`Preemption::should_stop`](zero_core::Preemption::should_stop)). A
    /// collective: call it on every rank once per step, after the step.
    pub fn should_stop(&mut self, preemption: &zero_core::Preemption) -> Result<bool> {
        let engine = self.engine_mut();
        let reduce_max = |votes: &mut [f32]| engine.all_reduce_host(votes, ReduceOp::Max);
        Ok(preemption.should_stop_with(reduce_max)?)
    }

    /// `loss` multiplied by the loss scale, for a loop that runs backward
    /// itself and hands the gradients to [`ZeroOptimizer::step`]
    /// ([`ZeroOptimizer::backward_step`] scales for you); `loss` itself
    /// without loss scaling. See [`EngineConfig::loss_scale`].
    pub fn scale_loss(&self, loss: &Tensor) -> Result<Tensor> {
        crate::precision::scale_loss(loss, self.engine().loss_scale())
    }

    /// The current loss scale (`None` without loss scaling).
    pub fn loss_scale(&self) -> Option<f64> {
        self.engine().loss_scale()
    }

    /// After changing the variables by hand in a model with f32 master
    /// weights (16-bit variables, `ZeroOptimizer<_, f32>`): makes the next
    /// step take the weights from the variables again. Without master
    /// weights the engine reads them at every step anyway.
    pub fn reload_master_weights(&mut self) {
        self.engine_mut().reload_master_weights()
    }

    /// Every variable's full values, by name (a copy). At stage 3 the
    /// sharded variables hold no values of their own (see
    /// `zero_candle`'s stage 3 notes); this gathers them, so it is a
    /// collective there: every rank calls it.
    pub fn full_weights(&self) -> Result<Vec<(String, Tensor)>> {
        self.engine().refresh().wait_all()?;
        crate::stage3::full_weights(self.hook.as_deref(), &self.names, &self.vars)
    }

    /// Writes every variable's full values to the safetensors file `path`
    /// under its name, in its dtype (master weights rounded to it), one
    /// tensor at a time: rank 0 writes, and at stage 3 each sharded
    /// variable is gathered, written and dropped before the next, so no
    /// rank holds more than one whole tensor beyond what training holds.
    /// The file appears whole or not at all (written beside it, then
    /// moved). `VarMap::load`, [`ShardedVarMap::from_safetensors`] and the
    /// trainer's `--init` read it. A collective: every rank calls it, and
    /// every rank gets the error if rank 0 cannot write.
    pub fn save_weights(&mut self, path: impl AsRef<Path>) -> Result<()> {
        let mut tensors = Vec::with_capacity(self.vars.len());
        for (index, (name, var)) in self.names.iter().zip(&self.vars).enumerate() {
            tensors.push(SavedTensor {
                name: name.clone(),
                dtype: zero_dtype(name, var.dtype())?,
                shape: var.dims().to_vec(),
                from: Saved::Var {
                    index,
                    arrangement: Arrangement::AsIs,
                },
            });
        }
        self.write_weights(vec![WeightsFile {
            path: path.as_ref().to_path_buf(),
            tensors,
        }])
    }

    /// Stage 3: the counters of the parameter gathers, once the parameters
    /// are sharded (from construction with [`ZeroOptimizer::new_sharded`],
    /// else after the first optimizer step of `backward_step`).
    pub fn fetch_stats(&self) -> Option<FetchStats> {
        self.hook
            .as_ref()
            .and_then(|h| h.fetcher())
            .map(|f| f.stats())
    }

    /// The report of the last completed optimizer step.
    pub fn last_report(&self) -> Option<StepReport> {
        self.last
    }

    /// The variable names, in collective order.
    pub fn names(&self) -> &[String] {
        &self.names
    }

    /// The variables, in collective order.
    pub fn vars(&self) -> &[Var] {
        &self.vars
    }

    /// The engine.
    pub fn engine(&self) -> &Engine<T, C, MemoryOf<T, C>> {
        match &self.engine {
            Some(engine) => engine,
            None => unreachable!("the engine is back before backward_step returns"),
        }
    }

    /// The engine, mutably.
    pub fn engine_mut(&mut self) -> &mut Engine<T, C, MemoryOf<T, C>> {
        lent(&mut self.engine)
    }

    /// Freezes or unfreezes a variable (see [`Engine::set_trainable`]).
    pub fn set_trainable(&mut self, name: &str, trainable: bool) -> Result<()> {
        Ok(self.engine_mut().set_trainable(name, trainable)?)
    }

    /// Applies trainability changes now (when the per-step check is off).
    pub fn refresh_trainability(&mut self) -> Result<()> {
        Ok(self.engine_mut().refresh_trainability()?)
    }

    /// Adds a parameter group (see [`Engine::add_param_group`]).
    pub fn add_param_group(&mut self, names: &[&str], hyperparams: &Hyperparams) -> Result<usize> {
        Ok(self.engine_mut().add_param_group(names, hyperparams)?)
    }

    /// Bytes held per category on this rank.
    pub fn memory_report(&self) -> MemoryReport {
        self.engine().memory_report()
    }

    /// The device's peak memory in use so far (every allocation on the
    /// device's stream-ordered pool: the model, activations, the engine's
    /// buffers), on a GPU backend that can tell; `None` on the host.
    pub fn device_peak_bytes(&self) -> Option<u64> {
        C::Memory::device_peak_bytes(self.engine().comm())
    }

    /// Bytes this rank has sent, over every communicator of the engine
    /// (see [`Counters::bytes_sent`](zero_core::engine::Counters::bytes_sent)).
    pub fn bytes_sent(&self) -> u64 {
        self.engine().counters().bytes_sent
    }
}

/// The engine's name for a Candle float dtype.
pub(crate) fn zero_dtype(name: &str, dtype: candle_core::DType) -> Result<DType> {
    Ok(match dtype {
        candle_core::DType::F32 => DType::F32,
        candle_core::DType::F64 => DType::F64,
        candle_core::DType::BF16 => DType::BF16,
        candle_core::DType::F16 => DType::F16,
        other => {
            return Err(Error::Variable {
                name: name.to_string(),
                detail: format!(
                    "dtype {other:?} is not supported by zero-rs; convert it to f32, f64, bf16 \
                     or f16, or keep it out of the VarMap given to the optimizer"
                ),
            })
        }
    })
}

/// The engine, which is only away during `backward_step` (an internal
/// invariant: every path there puts it back, panics included).
pub(crate) fn lent<E>(slot: &mut Option<E>) -> &mut E {
    match slot {
        Some(engine) => engine,
        None => unreachable!("the engine is back before backward_step returns"),
    }
}

/// The variables of `varmap` with their names.
pub(crate) fn named_vars(varmap: &VarMap) -> Result<Vec<(String, Var)>> {
    let data = varmap.data().lock().map_err(|_| Error::Variable {
        name: "<varmap>".into(),
        detail: "the VarMap's lock is poisoned by a panic in another thread".into(),
    })?;
    Ok(data.iter().map(|(n, v)| (n.clone(), v.clone())).collect())
}

/// Names variables `param.{i}` by position, zero-padded so that name order
/// is position order (`candle_nn::Optimizer::new` gets no names).
pub(crate) fn positional_names(vars: Vec<Var>) -> Vec<(String, Var)> {
    let width = vars.len().to_string().len();
    vars.into_iter()
        .enumerate()
        .map(|(i, v)| (format!("param.{i:0width$}"), v))
        .collect()
}

impl<C, T> candle_nn::Optimizer for ZeroOptimizer<C, T>
where
    C: Communicator + 'static,
    T: Element + WithDType,
    C::Memory: CandleMemory<T, C>,
{
    type Config = ZeroConfig<C, T>;

    /// Builds the optimizer over `vars`, named `param.{i}` by position: every
    /// rank must pass them in the same order. Prefer [`ZeroOptimizer::new`]
    /// with a `VarMap`, whose names are stable.
    fn new(vars: Vec<Var>, config: Self::Config) -> candle_core::Result<Self> {
        Ok(Self::from_named_vars(
            positional_names(vars),
            config.comm,
            config.engine,
            config.optimizer,
        )?)
    }

    fn step(&mut self, grads: &GradStore) -> candle_core::Result<()> {
        ZeroOptimizer::step(self, grads)?;
        Ok(())
    }

    /// [`ZeroOptimizer::backward_step`]: with a [`ZeroHook`] connected,
    /// gradients reach the engine during backward.
    fn backward_step(&mut self, loss: &Tensor) -> candle_core::Result<()> {
        ZeroOptimizer::backward_step(self, loss)?;
        Ok(())
    }

    fn learning_rate(&self) -> f64 {
        self.engine().learning_rate()
    }

    fn set_learning_rate(&mut self, lr: f64) {
        self.engine_mut().set_learning_rate(lr)
    }
}
