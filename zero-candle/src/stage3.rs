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
use crate::memory::CandleMemory;
use crate::Result;
use candle_core::backprop::GradStore;
use candle_core::{CpuStorage, InplaceOp1, Layout, Tensor, Var, WithDType};
use zero_core::engine::{Engine, Stage};
use zero_core::{Communicator, Element};

/// Replaces a CPU variable's storage by an empty one of its dtype.
struct FreeStorage;

impl InplaceOp1 for FreeStorage {
    fn name(&self) -> &'static str {
        "zero-free-storage"
    }

    fn cpu_fwd(&self, storage: &mut CpuStorage, _layout: &Layout) -> candle_core::Result<()> {
        *storage = empty_like(storage);
        Ok(())
    }
}

fn empty_like(storage: &CpuStorage) -> CpuStorage {
    match storage {
        CpuStorage::U8(_) => CpuStorage::U8(Vec::new()),
        CpuStorage::U32(_) => CpuStorage::U32(Vec::new()),
        CpuStorage::I64(_) => CpuStorage::I64(Vec::new()),
        CpuStorage::BF16(_) => CpuStorage::BF16(Vec::new()),
        CpuStorage::F16(_) => CpuStorage::F16(Vec::new()),
        CpuStorage::F32(_) => CpuStorage::F32(Vec::new()),
        CpuStorage::F64(_) => CpuStorage::F64(Vec::new()),
        other => other.clone(),
    }
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
    for (i, var) in vars.iter().enumerate() {
        if fetcher.is_sharded(i) {
            var.as_tensor().inplace_op1(&FreeStorage)?;
        }
    }
    hook.set_fetcher(fetcher);
    Ok(())
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
