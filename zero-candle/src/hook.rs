//! [`ZeroHook`]: the gradient hook that hands each parameter gradient of
//! a `zero_candle::nn` model to the engine the moment backward computes it.

use crate::memory::{CandleMemory, KindFetcher, MemoryOf};
use crate::nn::{GatheredParam, GiveBack, GradHook, Stretch};
use crate::precision::RoundedPool;
use candle_core::backprop::GradStore;
use candle_core::{Storage, Tensor, TensorId, Var, WithDType};
use std::collections::HashMap;
use std::ops::Range;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use zero_core::engine::Refresh;
use zero_core::{Communicator, Element, Engine};

/// How much of a weight gradient a hooked layer computes at a time
/// ([`GradHook::block_bytes`]): small next to a bucket, large enough that
/// the blocks' matmuls run at full speed.
const BLOCK_BYTES: usize = 1 << 20;

/// Stage 3's fetcher, what takes its lent buffers back, and where each
/// piece of each sharded parameter lies in its buffer (worked out once, so
/// that lending a piece allocates nothing).
struct Sharded<C, T>
where
    C: Communicator + 'static,
    T: Element + WithDType,
    C::Memory: CandleMemory<T, C>,
{
    fetcher: Arc<KindFetcher<T, C, C::Memory>>,
    lender: Arc<dyn GiveBack>,
    /// Per parameter and piece.
    stretches: Arc<Vec<Vec<Arc<[Stretch]>>>>,
    /// The same stretches one after another from 0: their places in a
    /// rounded copy (a 16-bit model under f32 masters).
    packed: Arc<Vec<Vec<Arc<[Stretch]>>>>,
    /// Where the rounded copies' storages come from and go back to.
    rounded: Arc<RoundedPool>,
}

impl<C, T> Clone for Sharded<C, T>
where
    C: Communicator + 'static,
    T: Element + WithDType,
    C::Memory: CandleMemory<T, C>,
{
    fn clone(&self) -> Self {
        Self {
            fetcher: self.fetcher.clone(),
            lender: self.lender.clone(),
            stretches: self.stretches.clone(),
            packed: self.packed.clone(),
            rounded: self.rounded.clone(),
        }
    }
}

/// The engine of communicator `C` for elements `T`.
type EngineOf<C, T> = Engine<T, C, MemoryOf<T, C>>;

/// A gradient hook connected to a [`ZeroOptimizer`](crate::ZeroOptimizer).
///
/// Build the model's `zero_candle::nn` layers with it, connect it with
/// [`ZeroOptimizer::with_hook`](crate::ZeroOptimizer::with_hook), and train
/// with [`ZeroOptimizer::backward_step`](crate::ZeroOptimizer::backward_step):
/// during backward each hooked parameter gradient goes straight into the
/// engine's flat gradient buffer and is dropped, so the `GradStore` never
/// holds it. Gradients of parameters used outside hooked layers still come
/// through the `GradStore`; a weight used both ways gets the sum.
///
/// ```no_run
/// use std::sync::Arc;
/// use candle_core::{DType, Device, Module, Tensor};
/// use candle_nn::{VarBuilder, VarMap};
/// use zero_candle::{nn, ZeroHook, ZeroOptimizer};
/// use zero_core::{ThreadGroup, ThreadComm, engine::EngineConfig, optim::{Adam, AdamConfig}};
///
/// ThreadGroup::new(2).run(|comm| -> zero_candle::Result<()> {
///     let hook = ZeroHook::<ThreadComm, f32>::new();
///     let varmap = VarMap::new();
///     let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
///     let layer = nn::linear(4, 2, vb.pp("layer"), Some(hook.clone()))?;
///     let adam = Adam::new(AdamConfig::default())?;
///     let mut opt = ZeroOptimizer::new(&varmap, comm, EngineConfig::default(), Box::new(adam))?
///         .with_hook(&hook)?;
///     let x = Tensor::ones((3, 4), DType::F32, &Device::Cpu)?;
///     let loss = layer.forward(&x)?.sqr()?.mean_all()?;
///     opt.backward_step(&loss)?;
///     Ok(())
/// });
/// ```
pub struct ZeroHook<C, T>
where
    C: Communicator + 'static,
    T: Element + WithDType,
    C::Memory: CandleMemory<T, C>,
{
    inner: Mutex<Inner<C, T>>,
    /// [`GradHook::block_bytes`]; 0: whole gradients.
    block_bytes: AtomicUsize,
}

struct Inner<C, T>
where
    C: Communicator + 'static,
    T: Element + WithDType,
    C::Memory: CandleMemory<T, C>,
{
    /// The engine, lent by the optimizer for the length of a backward pass.
    engine: Option<EngineOf<C, T>>,
    /// Parameter index by variable (a lookup only: nothing iterates it).
    index: HashMap<TensorId, usize>,
    names: Vec<String>,
    vars: Vec<Var>,
    /// Per variable, how many layers announced they report it.
    announced: HashMap<TensorId, usize>,
    /// The variables in the order layers first announced them (the order
    /// the model was built in).
    announce_order: Vec<TensorId>,
    /// Per parameter, the calls of the backward pass under way, and of the
    /// last one that completed (`None`: no pass completed yet).
    calls: Vec<usize>,
    last_calls: Option<Vec<usize>>,
    /// Per variable, how many layers announced they can gather it.
    gathering: HashMap<TensorId, usize>,
    /// Stage 3: the gathers of the sharded parameters, once sharded, and
    /// the same as what takes their buffers back.
    fetcher: Option<Sharded<C, T>>,
    /// Until then, the parameters the layers asked for, in the forward and
    /// backward of the last step (they plan the first sharded step's
    /// prefetches).
    used: [Vec<usize>; 2],
    in_backward: bool,
    /// The next forward use starts a new forward.
    forward_done: bool,
    /// Which parameters the last step's deferred all-gathers have made
    /// current (stages 1 and 2, `defer_gathers`).
    refresh: Option<Arc<Refresh>>,
}

impl<C, T> ZeroHook<C, T>
where
    C: Communicator + 'static,
    T: Element + WithDType,
    C::Memory: CandleMemory<T, C>,
{
    /// A hook not yet connected to an optimizer: give it to the layers, then
    /// to [`ZeroOptimizer::with_hook`](crate::ZeroOptimizer::with_hook).
    pub fn new() -> Arc<Self> {
        Arc::new(Self {
            inner: Mutex::new(Inner {
                engine: None,
                index: HashMap::new(),
                names: Vec::new(),
                vars: Vec::new(),
                announced: HashMap::new(),
                announce_order: Vec::new(),
                calls: Vec::new(),
                last_calls: None,
                gathering: HashMap::new(),
                fetcher: None,
                used: [Vec::new(), Vec::new()],
                in_backward: false,
                forward_done: false,
                refresh: None,
            }),
            block_bytes: AtomicUsize::new(BLOCK_BYTES),
        })
    }

    /// How much of a weight's gradient a hooked layer computes at a time
    /// (Linear: blocks of its rows, handed to the engine one by one), or
    /// `None` for whole gradients. Default 1 MiB: the peak then holds no
    /// whole weight gradient. Blocks give the same bits as whole
    /// gradients; `None` is there to compare.
    pub fn set_block_bytes(&self, bytes: Option<usize>) {
        self.block_bytes
            .store(bytes.map_or(0, |b| b.max(1)), Ordering::Relaxed);
    }

    fn lock(&self) -> MutexGuard<'_, Inner<C, T>> {
        // A poisoned lock means a panic during a backward pass; what it
        // guards (the lent engine, a lookup table) is still consistent.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Connects the hook to an optimizer's parameters (and what says when
    /// they are current after a step); `false` if it is already connected.
    pub(crate) fn connect(&self, names: &[String], vars: &[Var], refresh: Arc<Refresh>) -> bool {
        let mut inner = self.lock();
        if !inner.vars.is_empty() {
            return false;
        }
        inner.refresh = Some(refresh);
        inner.index = vars
            .iter()
            .enumerate()
            .map(|(i, v)| (v.as_tensor().id(), i))
            .collect();
        inner.names = names.to_vec();
        inner.vars = vars.to_vec();
        inner.calls = vec![0; vars.len()];
        true
    }

    /// The hooked gradients `loss.backward()` will hand over, in the order
    /// it will (the variables' order in `loss.sorted_nodes()`), each with
    /// its number of calls: as counted in the last backward pass, or, for a
    /// variable that got none then, as many as layers announced it.
    pub(crate) fn expected(&self, loss: &Tensor) -> Vec<(usize, usize)> {
        let mut inner = self.lock();
        // A pass that failed halfway counted some calls; start afresh.
        inner.calls.fill(0);
        inner.in_backward = true;
        inner.used[1].clear();
        let mut expected = Vec::new();
        let mut listed = vec![false; inner.vars.len()];
        let mut expect = |id: TensorId, inner: &Inner<C, T>| {
            let Some(&i) = inner.index.get(&id) else {
                return;
            };
            let seen = inner.last_calls.as_ref().map_or(0, |calls| calls[i]);
            let calls = match seen {
                0 => inner.announced.get(&id).copied().unwrap_or(0),
                seen => seen,
            };
            if calls > 0 && !std::mem::replace(&mut listed[i], true) {
                expected.push((i, calls));
            }
        };
        for node in loss.sorted_nodes() {
            if node.is_variable() {
                expect(node.id(), &inner);
            } else if let Some(vars) = crate::nn::vars_behind(node.id()) {
                // A checkpointed block or a mixture's experts: their
                // variables' gradients come when backward reaches the op
                // (they are not in the outer graph).
                for &id in vars.iter() {
                    expect(id, &inner);
                }
            }
        }
        expected
    }

    /// Records that a backward pass completed: its calls predict the next.
    pub(crate) fn backward_done(&self) {
        let mut inner = self.lock();
        inner.in_backward = false;
        inner.forward_done = true;
        let calls = vec![0; inner.calls.len()];
        let done = std::mem::replace(&mut inner.calls, calls);
        inner.last_calls = Some(done);
    }

    /// The connected parameters in the order their layers were built
    /// (announced them); parameters no layer announced are left out.
    pub(crate) fn construction_order(&self) -> Vec<usize> {
        let inner = self.lock();
        inner
            .announce_order
            .iter()
            .filter_map(|id| inner.index.get(id).copied())
            .collect()
    }

    /// Stage 3 from the start: the first forward's gathers are planned in
    /// the order the layers were built (nothing ran yet to record one).
    pub(crate) fn plan_first_forward(&self) {
        let order = self.construction_order();
        let mut inner = self.lock();
        if inner.used[0].is_empty() {
            inner.used[0] = order;
        }
    }

    /// Stage 3: which parameters the model's layers can gather on use:
    /// every layer that uses the variable announced it can (a norm or a
    /// tap reads its parameters itself), on the CPU or a CUDA GPU (the
    /// layers compute with gathered storage there), in the engine's dtype.
    pub(crate) fn gatherable(&self) -> Vec<bool> {
        let inner = self.lock();
        inner
            .vars
            .iter()
            .map(|var| {
                let id = var.as_tensor().id();
                let gathering = inner.gathering.get(&id).copied().unwrap_or(0);
                let announced = inner.announced.get(&id).copied().unwrap_or(0);
                gathering > 0
                    && gathering == announced
                    && (var.device().is_cpu() || var.device().is_cuda())
                    // A 16-bit model under f32 masters: the gathered
                    // masters are rounded to the model's dtype on use.
                    && (var.dtype() == <T as WithDType>::DTYPE || crate::precision::is_half(var.dtype()))
            })
            .collect()
    }

    /// Stage 3: from now on the layers gather the sharded parameters
    /// through `fetcher`, whose first passes are planned from the uses
    /// recorded so far.
    pub(crate) fn set_fetcher(&self, fetcher: Arc<KindFetcher<T, C, C::Memory>>) {
        let mut inner = self.lock();
        let [forward, backward] = std::mem::take(&mut inner.used);
        fetcher.seed(&forward, &backward);
        let lender: Arc<dyn GiveBack> = Arc::new(Lender::<C, T>(fetcher.clone()));
        let stretches: Vec<Vec<Arc<[Stretch]>>> = (0..inner.vars.len())
            .map(|param| {
                (0..fetcher.pieces(param))
                    .map(|piece| {
                        let spans = fetcher.piece_spans(param, piece).unwrap_or_default();
                        spans
                            .iter()
                            .map(|(at, values)| Stretch {
                                at: at.clone(),
                                values: values.clone(),
                            })
                            .collect()
                    })
                    .collect()
            })
            .collect();
        let packed = stretches
            .iter()
            .map(|pieces| {
                pieces
                    .iter()
                    .map(|piece| {
                        let mut next = 0;
                        piece
                            .iter()
                            .map(|s| {
                                let at = next..next + s.at.len();
                                next = at.end;
                                Stretch {
                                    at,
                                    values: s.values.clone(),
                                }
                            })
                            .collect()
                    })
                    .collect()
            })
            .collect();
        inner.fetcher = Some(Sharded {
            fetcher,
            lender,
            stretches: Arc::new(stretches),
            packed: Arc::new(packed),
            rounded: Arc::new(RoundedPool::default()),
        });
    }

    /// The fetcher of the sharded parameters (stage 3).
    pub(crate) fn fetcher(&self) -> Option<Arc<KindFetcher<T, C, C::Memory>>> {
        self.lock().fetcher.as_ref().map(|s| s.fetcher.clone())
    }

    /// Lends the engine for a backward pass.
    pub(crate) fn lend(&self, engine: EngineOf<C, T>) {
        self.lock().engine = Some(engine);
    }

    /// Takes the lent engine back.
    pub(crate) fn take_back(&self) -> Option<EngineOf<C, T>> {
        self.lock().engine.take()
    }
}

impl<C, T> Inner<C, T>
where
    C: Communicator + 'static,
    T: Element + WithDType,
    C::Memory: CandleMemory<T, C>,
{
    /// Where `var`'s gradient goes: its parameter's index, the lent engine,
    /// and the parameter's name, variable and count of calls.
    fn receiver(&mut self, var: &Var) -> candle_core::Result<Receiver<'_, C, T>> {
        let Some(&i) = self.index.get(&var.as_tensor().id()) else {
            candle_core::bail!(
                "a layer reported the gradient of a variable ({:?}) that its ZeroHook's optimizer \
                 does not train; connect the hook to the optimizer built from the model's \
                 VarMap (ZeroOptimizer::with_hook)",
                var.dims()
            )
        };
        let Some(engine) = self.engine.as_mut() else {
            candle_core::bail!(
                "a layer built with a ZeroHook ran backward outside ZeroOptimizer::backward_step; \
                 call opt.backward_step(&loss) (it runs loss.backward() with the engine ready) \
                 instead of loss.backward()"
            )
        };
        Ok(Receiver {
            param: i,
            engine,
            name: &self.names[i],
            var: &self.vars[i],
            calls: &mut self.calls[i],
        })
    }
}

/// Where one gradient goes (see [`Inner::receiver`]).
struct Receiver<'a, C, T>
where
    C: Communicator + 'static,
    T: Element + WithDType,
    C::Memory: CandleMemory<T, C>,
{
    param: usize,
    engine: &'a mut EngineOf<C, T>,
    name: &'a String,
    var: &'a Var,
    calls: &'a mut usize,
}

impl<C, T> GradHook for ZeroHook<C, T>
where
    C: Communicator + 'static,
    T: Element + WithDType,
    C::Memory: CandleMemory<T, C>,
{
    fn grad_ready(&self, var: &Var, grad: Tensor) -> candle_core::Result<()> {
        let mut inner = self.lock();
        let to = inner.receiver(var)?;
        *to.calls += 1;
        let mut store = GradStore::default();
        store.insert(var.as_tensor(), grad);
        let (param, engine) = (to.param, to.engine);
        C::Memory::with_grads(
            std::slice::from_ref(to.name),
            std::slice::from_ref(to.var),
            &store,
            &mut |slots| match slots.first().copied().flatten() {
                Some(grad) => Ok(engine.accumulate_param(param, .., grad)?),
                None => Ok(()),
            },
        )?;
        Ok(())
    }

    fn block_bytes(&self) -> Option<usize> {
        let bytes = self.block_bytes.load(Ordering::Relaxed);
        (C::Memory::TAKES_BLOCKS && bytes > 0).then_some(bytes)
    }

    fn grad_block_ready(
        &self,
        var: &Var,
        rows: Range<usize>,
        grad: Tensor,
    ) -> candle_core::Result<()> {
        let mut inner = self.lock();
        let to = inner.receiver(var)?;
        if rows.start == 0 {
            *to.calls += 1;
        }
        let row_len = var.elem_count() / var.dim(0)?.max(1);
        let start = rows.start * row_len;
        let range = start..start + grad.elem_count();
        let (param, engine) = (to.param, to.engine);
        C::Memory::with_grad_block(to.name, var, &grad, &mut |grad| {
            Ok(engine.accumulate_param(param, range.clone(), grad)?)
        })?;
        Ok(())
    }

    fn before_read(&self, var: &Var) -> candle_core::Result<()> {
        let (refresh, i) = {
            let inner = self.lock();
            let Some(&i) = inner.index.get(&var.as_tensor().id()) else {
                return Ok(());
            };
            let Some(refresh) = inner.refresh.clone() else {
                return Ok(());
            };
            (refresh, i)
        };
        refresh.wait(i).map_err(candle_core::Error::wrap)
    }

    fn will_report(&self, var: &Var) {
        let mut inner = self.lock();
        let count = inner.announced.entry(var.id()).or_default();
        *count += 1;
        if *count == 1 {
            inner.announce_order.push(var.id());
        }
    }

    fn will_gather(&self, var: &Var) {
        *self.lock().gathering.entry(var.id()).or_default() += 1;
    }

    fn gather(&self, var: &Var, piece: usize) -> candle_core::Result<Option<GatheredParam>> {
        let (sharded, i) = {
            let mut inner = self.lock();
            let Some(&i) = inner.index.get(&var.as_tensor().id()) else {
                return Ok(None);
            };
            let Some(sharded) = inner.fetcher.clone() else {
                if piece > 0 {
                    return Ok(None);
                }
                // Not sharded yet: remember the order of use.
                let pass = usize::from(inner.in_backward);
                if pass == 0 && inner.forward_done {
                    inner.forward_done = false;
                    inner.used[0].clear();
                }
                inner.used[pass].push(i);
                return Ok(None);
            };
            (sharded, i)
        };
        let Some(stretches) = sharded.stretches.get(i).and_then(|p| p.get(piece)) else {
            return Ok(None);
        };
        let (fetcher, stretches) = (&sharded.fetcher, Arc::clone(stretches));
        let gathered = fetcher
            .acquire(i, piece)
            .map_err(candle_core::Error::wrap)?;
        let unit = gathered.unit();
        let device = var.device();
        let buffer = gathered.into_buffer();
        // In the model's dtype already: the masters, or masters the memory
        // rounded before gathering them.
        if var.dtype() == C::Memory::gathered_dtype(&buffer) {
            let storage = C::Memory::lend(buffer, device).map_err(candle_core::Error::wrap)?;
            return Ok(Some(GatheredParam::new(
                storage,
                stretches,
                var.shape(),
                unit,
                sharded.lender.clone(),
            )));
        }
        // Master weights: the model computes with them rounded to its
        // dtype (the values the write-back gives a replicated weight), in a
        // storage of their own; the gathered masters go back at once.
        let packed = &sharded.packed[i][piece];
        let (rounded, buffer) = C::Memory::round(
            buffer,
            (&stretches, packed),
            var.dtype(),
            device,
            &sharded.rounded,
        );
        match buffer {
            Some(buffer) => fetcher.release_buffer(unit, buffer),
            None => fetcher.forget_buffer(unit),
        }
        let (storage, stretches, lender) = rounded.map_err(candle_core::Error::wrap)?;
        Ok(Some(GatheredParam::new(
            storage,
            stretches,
            var.shape(),
            unit,
            lender,
        )))
    }
}

/// Takes the storages of stage 3's gathers back into the fetcher's pool.
struct Lender<C, T>(Arc<KindFetcher<T, C, C::Memory>>)
where
    C: Communicator + 'static,
    T: Element + WithDType,
    C::Memory: CandleMemory<T, C>;

impl<C, T> GiveBack for Lender<C, T>
where
    C: Communicator + 'static,
    T: Element + WithDType,
    C::Memory: CandleMemory<T, C>,
{
    fn give_back(&self, unit: usize, storage: Storage) {
        match C::Memory::take_back(storage) {
            Some(buffer) => self.0.release_buffer(unit, buffer),
            // Not the storage lent: its bytes are no longer the pool's.
            None => self.0.forget_buffer(unit),
        }
    }
}
