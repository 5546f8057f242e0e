//! Stage 3 in the adapter: after the first optimizer step of a hooked
//! model, the parameters its ZeRO-aware layers can gather are handed to the
//! engine for good and their variables' storage is freed.
//!
//! A sharded variable keeps its identity (name, shape, dtype, its place in
//! the graph: layers still take it as an op input, so backward still hands
//! its gradient to the hook) but holds no values: its CPU storage is
//! replaced by an empty one. Its values come from the engine's fetcher,
//! gathered for each use. Reading such a variable directly (a plain Candle
//! op, `VarMap::save`) is therefore a mistake: use
//! [`ZeroOptimizer::full_weights`](crate::ZeroOptimizer::full_weights) or
//! the optimizer's checkpoints.

use crate::hook::ZeroHook;
use crate::init::{empty_storage, ShardedVarMap};
use crate::memory::CandleMemory;
use crate::Result;
use candle_core::backend::{BackendDevice, BackendStorage};
use candle_core::backprop::GradStore;
use candle_core::{CpuStorage, CudaStorage, InplaceOp1, Layout, Shape, Tensor, Var, WithDType};
use zero_core::engine::{Engine, Fetcher, GatherMemory, Stage};
use zero_core::{Communicator, Element};

/// Replaces a variable's storage by an empty one of its dtype (on CUDA,
/// one element: CUDA allocates nothing smaller).
struct FreeStorage;

impl InplaceOp1 for FreeStorage {
    fn name(&self) -> &'static str {
        "zero-free-storage"
    }

    fn cpu_fwd(&self, storage: &mut CpuStorage, _layout: &Layout) -> candle_core::Result<()> {
        if let Some(empty) = empty_storage(storage.dtype()) {
            *storage = empty;
        }
        Ok(())
    }

    fn cuda_fwd(&self, storage: &mut CudaStorage, _layout: &Layout) -> candle_core::Result<()> {
        *storage = storage
            .device()
            .zeros_impl(&Shape::from(1), storage.dtype())?;
        Ok(())
    }
}

/// Frees the storage of the variables `fetcher` shards (their values live
/// in the shards now).
fn free_sharded<T: Element, G: GatherMemory<T>>(
    fetcher: &Fetcher<T, G>,
    vars: &[Var],
) -> Result<()> {
    for (i, var) in vars.iter().enumerate() {
        if fetcher.is_sharded(i) {
            var.as_tensor().inplace_op1(&FreeStorage)?;
        }
    }
    Ok(())
}

/// Whether `tensor`'s storage holds its values: `false` for a variable
/// that stage 3 sharded or that a [`ShardedVarMap`] created deferred (it
/// keeps its name, shape and dtype, but its values live in the engine's
/// shards or come from the map's source later).
///
/// Candle cannot refuse such a variable by itself: a plain Candle op (a
/// `matmul`, `VarMap::save`, `to_vec`) reading it panics or reads past its
/// storage. The `zero_candle::nn` layers gather it; elsewhere check first,
/// and read the values through
/// [`ZeroOptimizer::full_weights`](crate::ZeroOptimizer::full_weights).
///
/// ```
/// use candle_core::{DType, Device, Tensor};
/// let t = Tensor::zeros((2, 3), DType::F32, &Device::Cpu)?;
/// assert!(zero_candle::holds_values(&t));
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn holds_values(tensor: &Tensor) -> bool {
    let (storage, layout) = tensor.storage_and_layout();
    let numel = layout.shape().elem_count();
    if numel == 0 {
        return true;
    }
    let held = match &*storage {
        candle_core::Storage::Cpu(cpu) => crate::init::values_len(cpu),
        candle_core::Storage::Cuda(cuda) => crate::nn::ops::cuda::storage_len(cuda),
        _ => None,
    };
    // Only float storages are ever emptied.
    let Some(held) = held else {
        return true;
    };
    // The last element the layout reaches must be inside the storage.
    let last = layout.start_offset()
        + layout
            .dims()
            .iter()
            .zip(layout.stride())
            .map(|(&d, &s)| (d - 1) * s)
            .sum::<usize>();
    last < held
}

/// After an optimizer step: if the engine runs stage 3 and has not
/// sharded yet, shards what the layers can gather (and `grads`, the plain
/// gradients of that step, shows no other use of) and frees those
/// variables' storage. A collective (every rank shards alike).
pub(crate) fn shard_after_step<C, T>(
    engine: &mut Engine<T, C, crate::memory::MemoryOf<T, C>>,
    hook: &ZeroHook<C, T>,
    vars: &[Var],
    grads: &GradStore,
) -> Result<()>
where
    C: Communicator + 'static,
    T: Element + WithDType,
    C::Memory: CandleMemory<T, C>,
{
    if engine.config().stage != Stage::Parameters || engine.fetcher().is_some() {
        return Ok(());
    }
    let mut mask = hook.gatherable();
    // A variable that also got a gradient through the GradStore is used by
    // a plain op, which reads its storage: it keeps its values.
    for (flag, var) in mask.iter_mut().zip(vars) {
        if grads.get(var.as_tensor()).is_some() {
            *flag = false;
        }
    }
    let fetcher = C::Memory::shard_parameters(engine, &mask, vars)?;
    free_sharded(&fetcher, vars)?;
    warn_if_nothing_sharded(engine, &mask, vars, |i| fetcher.is_sharded(i));
    hook.set_fetcher(fetcher);
    Ok(())
}

/// Stage 3 that shards nothing is stage 2 with extra steps: says so (on
/// rank 0), naming the reason and the setting that decides.
fn warn_if_nothing_sharded<T, C, M>(
    engine: &Engine<T, C, M>,
    gatherable: &[bool],
    vars: &[Var],
    is_sharded: impl Fn(usize) -> bool,
) where
    T: Element,
    C: Communicator,
    M: zero_core::engine::ShardMemory<T, C>,
{
    if engine.comm().rank() != 0 || (0..vars.len()).any(is_sharded) {
        return;
    }
    let persist = engine.config().persist_numel;
    let largest = gatherable
        .iter()
        .zip(vars)
        .filter(|(&g, _)| g)
        .map(|(_, v)| v.elem_count())
        .max();
    match largest {
        Some(numel) => tracing::warn!(
            "stage 3 shards no parameter: the largest one the zero_candle::nn layers gather has \
             {numel} elements, not above persist_numel = {persist}, so every rank keeps every \
             parameter whole (stage 2's memory); lower it with \
             EngineConfig::with_persist_numel (0 shards all of them)"
        ),
        None => tracing::warn!(
            "stage 3 shards no parameter: no zero_candle::nn layer built with this optimizer's \
             ZeroHook gathers one (a variable a plain op reads stays whole), so it runs as \
             stage 2"
        ),
    }
}

/// Every variable's full values: the variable's own, or gathered for a
/// sharded one. A collective at stage 3 (every rank calls it).
pub(crate) fn full_weights<C, T>(
    hook: Option<&ZeroHook<C, T>>,
    names: &[String],
    vars: &[Var],
) -> Result<Vec<(String, Tensor)>>
where
    C: Communicator + 'static,
    T: Element + WithDType,
    C::Memory: CandleMemory<T, C>,
{
    let fetcher = hook.and_then(|h| h.fetcher());
    let mut out = Vec::with_capacity(vars.len());
    for (i, (name, var)) in names.iter().zip(vars).enumerate() {
        let tensor = match &fetcher {
            Some(fetcher) if fetcher.is_sharded(i) => {
                let values = fetcher.gather_full(i)?;
                // Master weights are rounded to the model's dtype.
                Tensor::from_vec(values, var.shape(), var.device())?.to_dtype(var.dtype())?
            }
            _ => var.as_tensor().copy()?,
        };
        out.push((name.clone(), tensor));
    }
    Ok(out)
}

/// Stage 3 from the start, for [`ZeroOptimizer::new_sharded`]: every
/// deferred variable of `map` that cannot be sharded (a plain op reads it,
/// or it is at most `persist_numel`) gets its whole values; the others are
/// laid out in the reverse of the order the layers announced them (about
/// the order of their gradients) and sharded, this rank's pieces computed
/// from the map's source. A collective.
///
/// [`ZeroOptimizer::new_sharded`]: crate::ZeroOptimizer::new_sharded
pub(crate) fn shard_from_start<C, T>(
    engine: &mut Engine<T, C, crate::memory::MemoryOf<T, C>>,
    hook: &ZeroHook<C, T>,
    names: &[String],
    vars: &[Var],
    map: &ShardedVarMap,
) -> Result<()>
where
    C: Communicator + 'static,
    T: Element + WithDType,
    C::Memory: CandleMemory<T, C>,
{
    let persist = engine.config().persist_numel;
    let gatherable = hook.gatherable();
    let mask: Vec<bool> = gatherable
        .iter()
        .zip(vars)
        .map(|(&g, var)| g && var.elem_count() > persist)
        .collect();
    for (name, &sharded) in names.iter().zip(&mask) {
        if !sharded {
            map.materialize(name)?;
        }
    }
    let mut order = hook.construction_order();
    order.reverse();
    let fetcher = C::Memory::shard_from_start(engine, &order, &mask, (names, vars), map)?;
    warn_if_nothing_sharded(engine, &gatherable, vars, |i| fetcher.is_sharded(i));
    let sharded: Vec<&str> = names
        .iter()
        .enumerate()
        .filter(|&(i, _)| fetcher.is_sharded(i))
        .map(|(_, n)| n.as_str())
        .collect();
    map.sharded(&sharded);
    // A sharded variable created with its values (on a GPU, or above no
    // deferral threshold) lets them go.
    free_sharded(&fetcher, vars)?;
    // Anything deferred the engine did not shard gets its values.
    map.materialize_all()?;
    hook.plan_first_forward();
    hook.set_fetcher(fetcher);
    Ok(())
}
