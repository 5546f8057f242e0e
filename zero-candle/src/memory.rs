//! How Candle variables and gradients meet the engine's memory.
//!
//! [`ZeroOptimizer`](crate::ZeroOptimizer) is one type for every backend:
//! the communicator's memory kind ([`Host`] for threads and MPI,
//! `zero_nccl::Cuda` for NCCL) picks, through [`CandleMemory`], the
//! engine's [`ShardMemory`] and how Candle's tensors are handed to it
//! (host slices, or device memory read and written in place).

use crate::optimizer::with_grad_slices;
use crate::params::VarStore;
use crate::Result;
use candle_core::backprop::GradStore;
use candle_core::{Var, WithDType};
use std::sync::Arc;
use zero_core::comm::{Host, MemoryKind};
use zero_core::engine::{Engine, Fetcher, HostMemory, ShardMemory};
use zero_core::optim::FunctionalOptimizer;
use zero_core::{Communicator, Element};

/// The engine memory of communicator `C`'s memory kind, and the bridge
/// between it and Candle.
pub trait CandleMemory<T: Element + WithDType, C: Communicator + 'static>: MemoryKind {
    /// The engine's memory for this kind.
    type Memory: ShardMemory<T, C> + 'static;

    /// Checks the variables (sorted by name, floating point) and builds the
    /// memory; may adjust the communicator (CUDA: order it with Candle's
    /// stream).
    fn build(
        named: &[(String, Var)],
        comm: C,
        optimizer: &dyn FunctionalOptimizer<T>,
    ) -> Result<(C, Self::Memory)>;

    /// Calls `f` with one gradient slot per variable (`None` where `grads`
    /// has none).
    fn with_grads<R>(
        names: &[String],
        vars: &[Var],
        grads: &GradStore,
        f: &mut GradsFn<'_, T, C, Self, R>,
    ) -> Result<R>;

    /// Calls `f` with the variables as the engine's parameters.
    fn with_params<R>(vars: &[Var], f: &mut ParamsFn<'_, T, C, Self, R>) -> Result<R>;

    /// Stage 3: shards the parameters `mask` marks (see
    /// `Engine::shard_parameters`). Host memory only for now.
    fn shard_parameters(
        engine: &mut Engine<T, C, Self::Memory>,
        mask: &[bool],
        vars: &[Var],
    ) -> Result<Arc<Fetcher<T>>> {
        let _ = (engine, mask, vars);
        Err(zero_core::Error::Config(
            "stage 3 runs on host memory (threads, MPI) for now; on NCCL use stage 2".into(),
        )
        .into())
    }
}

/// The gradient type of memory kind `K`.
pub type Grad<'g, T, C, K> = <<K as CandleMemory<T, C>>::Memory as ShardMemory<T, C>>::Grad<'g>;

/// The parameter type of memory kind `K`.
pub type Params<'p, T, C, K> = <<K as CandleMemory<T, C>>::Memory as ShardMemory<T, C>>::Params<'p>;

/// What [`CandleMemory::with_grads`] calls: one gradient slot per variable.
pub type GradsFn<'f, T, C, K, R> =
    dyn for<'g> FnMut(&[Option<Grad<'g, T, C, K>>]) -> Result<R> + 'f;

/// What [`CandleMemory::with_params`] calls with the parameters.
pub type ParamsFn<'f, T, C, K, R> = dyn for<'p> FnMut(&mut Params<'p, T, C, K>) -> Result<R> + 'f;

/// The engine memory of communicator `C`.
pub type MemoryOf<T, C> = <<C as Communicator>::Memory as CandleMemory<T, C>>::Memory;

impl<T: Element + WithDType, C: Communicator<Memory = Host> + 'static> CandleMemory<T, C> for Host {
    type Memory = HostMemory;

    fn build(
        _named: &[(String, Var)],
        comm: C,
        _optimizer: &dyn FunctionalOptimizer<T>,
    ) -> Result<(C, HostMemory)> {
        Ok((comm, HostMemory))
    }

    fn with_grads<R>(
        names: &[String],
        vars: &[Var],
        grads: &GradStore,
        f: &mut GradsFn<'_, T, C, Self, R>,
    ) -> Result<R> {
        with_grad_slices::<T, R>(names, vars, grads, f)
    }

    fn with_params<R>(vars: &[Var], f: &mut ParamsFn<'_, T, C, Self, R>) -> Result<R> {
        let mut store = VarStore { vars };
        f(&mut store)
    }

    fn shard_parameters(
        engine: &mut Engine<T, C, HostMemory>,
        mask: &[bool],
        vars: &[Var],
    ) -> Result<Arc<Fetcher<T>>> {
        let mut store = VarStore { vars };
        Ok(engine.shard_parameters(mask, &mut store)?)
    }
}
