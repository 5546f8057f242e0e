//! How Candle variables and gradients meet the engine's memory.
//!
//! [`ZeroOptimizer`](crate::ZeroOptimizer) is one type for every backend:
//! the communicator's memory kind ([`Host`] for threads and MPI,
//! `zero_nccl::Cuda` for NCCL) picks, through [`CandleMemory`], the
//! engine's [`ShardMemory`] and how Candle's tensors are handed to it
//! (host slices, or device memory read and written in place).

use crate::nn::{GiveBack, Stretch};
use crate::params::VarStore;
use crate::precision::RoundedPool;
use crate::{Error, Result};
use candle_core::backprop::GradStore;
use candle_core::{CpuStorage, Device, Storage, Tensor, Var, WithDType};
use std::ops::Range;
use std::sync::Arc;
use zero_core::comm::{Host, MemoryKind};
use zero_core::engine::{
    Engine, FetcherOf, GatherMemory, HostGather, HostGrad, HostMemory, ParamAccess, ParamCopy,
    ShardMemory,
};
use zero_core::{Communicator, DType, Element};

/// The engine memory of communicator `C`'s memory kind, and the bridge
/// between it and Candle.
pub trait CandleMemory<T: Element + WithDType, C: Communicator + 'static>: MemoryKind {
    /// The engine's memory for this kind.
    type Memory: ShardMemory<T, C> + 'static;

    /// Checks the variables (sorted by name, floating point) and builds the
    /// memory; may adjust the communicator (CUDA: order it with Candle's
    /// stream).
    fn build(named: &[(String, Var)], comm: C) -> Result<(C, Self::Memory)>;

    /// Calls `f` with one gradient slot per variable (`None` where `grads`
    /// has none).
    fn with_grads<R>(
        names: &[String],
        vars: &[Var],
        grads: &GradStore,
        f: &mut GradsFn<'_, T, C, Self, R>,
    ) -> Result<R>;

    /// Whether [`CandleMemory::with_grad_block`] takes gradients in blocks
    /// of rows (host memory); where it does not, layers hand whole
    /// gradients over.
    const TAKES_BLOCKS: bool = false;

    /// Calls `f` with `grad`, a block of consecutive rows of `var`'s
    /// gradient (`var`'s dims but the first), as the engine's gradient.
    fn with_grad_block<R>(
        name: &str,
        var: &Var,
        grad: &Tensor,
        f: &mut GradFn<'_, T, C, Self, R>,
    ) -> Result<R> {
        let _ = (var, grad, f);
        Err(Error::Variable {
            name: name.to_string(),
            detail: "this backend takes whole gradients, not blocks of rows".into(),
        })
    }

    /// Calls `f` with the variables as the engine's parameters.
    fn with_params<R>(vars: &[Var], f: &mut ParamsFn<'_, T, C, Self, R>) -> Result<R>;

    /// The most bytes of device memory in use at once so far (the device's
    /// stream-ordered pool), where the memory is a device's and it can tell;
    /// `None` on the host.
    fn device_peak_bytes(comm: &C) -> Option<u64> {
        let _ = comm;
        None
    }

    /// Stage 3: shards the parameters `mask` marks (see
    /// `Engine::shard_parameters`).
    fn shard_parameters(
        engine: &mut Engine<T, C, Self::Memory>,
        mask: &[bool],
        vars: &[Var],
    ) -> Result<Arc<KindFetcher<T, C, Self>>>;

    /// Stage 3 from the start: lays out in `order` and shards the
    /// parameters `mask` marks before any step, this rank's pieces of the
    /// deferred variables of `map` computed from its source (see
    /// `Engine::shard_from_start`).
    fn shard_from_start(
        engine: &mut Engine<T, C, Self::Memory>,
        order: &[usize],
        mask: &[bool],
        named: (&[String], &[Var]),
        map: &crate::ShardedVarMap,
    ) -> Result<Arc<KindFetcher<T, C, Self>>>;

    /// Stage 3: streams sharded parameters to rank `root` piece by piece
    /// (see `Engine::stream_params`).
    fn stream_params(
        engine: &mut Engine<T, C, Self::Memory>,
        params: &[usize],
        root: usize,
        sink: &mut zero_core::engine::ParamPieceSink<'_, T>,
    ) -> Result<()> {
        engine.stream_params(params, root, sink)?;
        Ok(())
    }

    /// Stage 3: a gathered buffer as the storage a layer on `device`
    /// computes with (no copy); [`CandleMemory::take_back`] undoes it.
    fn lend(buffer: GatherBuffer<T, C, Self>, device: &Device) -> Result<Storage>;

    /// The buffer of a storage [`CandleMemory::lend`] made (`None` when it
    /// is not one).
    fn take_back(storage: Storage) -> Option<GatherBuffer<T, C, Self>>;

    /// The dtype a gathered buffer holds: `T`'s, unless the memory gathers
    /// in a 16-bit model's dtype (then a layer of that dtype computes with
    /// the buffer as it is, lent, not rounded).
    fn gathered_dtype(buffer: &GatherBuffer<T, C, Self>) -> candle_core::DType {
        let _ = buffer;
        <T as WithDType>::DTYPE
    }

    /// Stage 3 under master weights: the `stretches` of gathered masters
    /// rounded to the model's `dtype` (what the write-back would give a
    /// replicated weight) in a storage of their own on `device`, with
    /// their places in it and who takes it back; and the buffer, to go back
    /// to the fetcher at once (`None`: it could not be kept). `packed` are
    /// the same stretches one after another from 0, and `pool` keeps host
    /// copies.
    fn round(
        buffer: GatherBuffer<T, C, Self>,
        stretches: (&Arc<[Stretch]>, &Arc<[Stretch]>),
        dtype: candle_core::DType,
        device: &Device,
        pool: &Arc<RoundedPool>,
    ) -> (Result<Rounded>, Option<GatherBuffer<T, C, Self>>);
}

/// What [`CandleMemory::round`] gives: the storage, the stretches' places
/// in it, and who takes it back.
pub type Rounded = (Storage, Arc<[Stretch]>, Arc<dyn GiveBack>);

/// The buffer stage 3 gathers a piece into on memory kind `K`.
pub type GatherBuffer<T, C, K> =
    <<MemoryOfKind<T, C, K> as ShardMemory<T, C>>::Gathers as GatherMemory<T>>::Buffer;

/// The engine memory of memory kind `K`.
pub type MemoryOfKind<T, C, K> = <K as CandleMemory<T, C>>::Memory;

/// Stage 3's fetcher on memory kind `K`.
pub type KindFetcher<T, C, K> = FetcherOf<T, C, MemoryOfKind<T, C, K>>;

/// The gradient type of memory kind `K`.
pub type Grad<'g, T, C, K> = <<K as CandleMemory<T, C>>::Memory as ShardMemory<T, C>>::Grad<'g>;

/// The parameter type of memory kind `K`.
pub type Params<'p, T, C, K> = <<K as CandleMemory<T, C>>::Memory as ShardMemory<T, C>>::Params<'p>;

/// What [`CandleMemory::with_grads`] calls: one gradient slot per variable.
pub type GradsFn<'f, T, C, K, R> =
    dyn for<'g> FnMut(&[Option<Grad<'g, T, C, K>>]) -> Result<R> + 'f;

/// What [`CandleMemory::with_grad_block`] calls: one gradient.
pub type GradFn<'f, T, C, K, R> = dyn for<'g> FnMut(Grad<'g, T, C, K>) -> Result<R> + 'f;

/// What [`CandleMemory::with_params`] calls with the parameters.
pub type ParamsFn<'f, T, C, K, R> = dyn for<'p> FnMut(&mut Params<'p, T, C, K>) -> Result<R> + 'f;

/// The engine memory of communicator `C`.
pub type MemoryOf<T, C> = <<C as Communicator>::Memory as CandleMemory<T, C>>::Memory;

impl<T: Element + WithDType, C: Communicator<Memory = Host> + 'static> CandleMemory<T, C> for Host {
    type Memory = HostMemory;

    fn build(_named: &[(String, Var)], comm: C) -> Result<(C, HostMemory)> {
        Ok((comm, HostMemory))
    }

    fn with_grads<R>(
        names: &[String],
        vars: &[Var],
        grads: &GradStore,
        f: &mut GradsFn<'_, T, C, Self, R>,
    ) -> Result<R> {
        with_host_grads::<T, R>(names, vars, grads, f)
    }

    const TAKES_BLOCKS: bool = true;

    fn with_grad_block<R>(
        name: &str,
        var: &Var,
        grad: &Tensor,
        f: &mut GradFn<'_, T, C, Self, R>,
    ) -> Result<R> {
        check_grad(name, var, grad, 1)?;
        let held = hold::<T>(grad)?;
        match slot(&held)? {
            Some(grad) => f(grad),
            None => Err(Error::Variable {
                name: name.to_string(),
                detail: "a gradient block is not on the CPU".into(),
            }),
        }
    }

    fn with_params<R>(vars: &[Var], f: &mut ParamsFn<'_, T, C, Self, R>) -> Result<R> {
        let mut store = VarStore { vars };
        f(&mut store)
    }

    fn shard_parameters(
        engine: &mut Engine<T, C, HostMemory>,
        mask: &[bool],
        vars: &[Var],
    ) -> Result<Arc<zero_core::engine::Fetcher<T>>> {
        let mut store = VarStore { vars };
        Ok(engine.shard_parameters(mask, &mut store)?)
    }

    fn shard_from_start(
        engine: &mut Engine<T, C, HostMemory>,
        order: &[usize],
        mask: &[bool],
        (names, vars): (&[String], &[Var]),
        map: &crate::ShardedVarMap,
    ) -> Result<Arc<zero_core::engine::Fetcher<T>>> {
        let mut store = crate::init::InitStore {
            vars: VarStore { vars },
            names,
            map,
        };
        Ok(engine.shard_from_start(order, mask, &mut store)?)
    }

    fn lend(buffer: HostGather<T>, _device: &Device) -> Result<Storage> {
        Ok(Storage::Cpu(match buffer {
            HostGather::Wide(values) => T::to_cpu_storage_owned(values),
            HostGather::BF16(values) => CpuStorage::BF16(values),
            HostGather::F16(values) => CpuStorage::F16(values),
        }))
    }

    fn take_back(storage: Storage) -> Option<HostGather<T>> {
        // Lent as it came back (same dtype); were it not, the pool would
        // allocate a new buffer next time.
        let Storage::Cpu(storage) = storage else {
            return None;
        };
        Some(match storage {
            storage
                if candle_core::backend::BackendStorage::dtype(&storage)
                    == <T as WithDType>::DTYPE =>
            {
                HostGather::Wide(T::cpu_storage_data(storage).unwrap_or_default())
            }
            CpuStorage::BF16(values) => HostGather::BF16(values),
            CpuStorage::F16(values) => HostGather::F16(values),
            _ => return None,
        })
    }

    fn gathered_dtype(buffer: &HostGather<T>) -> candle_core::DType {
        candle_dtype(buffer.dtype())
    }

    fn round(
        buffer: HostGather<T>,
        (stretches, packed): (&Arc<[Stretch]>, &Arc<[Stretch]>),
        dtype: candle_core::DType,
        _device: &Device,
        pool: &Arc<RoundedPool>,
    ) -> (Result<Rounded>, Option<HostGather<T>>) {
        let HostGather::Wide(values) = &buffer else {
            let error = crate::Error::Zero(zero_core::Error::State(format!(
                "internal: stage 3 asked to round a gather already in {:?} to {dtype:?}",
                buffer.dtype()
            )));
            return (Err(error), Some(buffer));
        };
        let rounded = pool.round(values, stretches, packed, dtype).map(|rounded| {
            let lender: Arc<dyn GiveBack> = pool.clone();
            (Storage::Cpu(rounded), Arc::clone(packed), lender)
        });
        (rounded, Some(buffer))
    }
}

/// What [`with_host_grads`] calls: one host gradient slot per variable.
type HostGradsFn<'f, T, R> = dyn for<'g> FnMut(&[Option<HostGrad<'g, T>>]) -> Result<R> + 'f;

/// Borrows every variable's gradient from CPU storage (other devices and
/// strided gradients through a copy in `T`) and calls `f` with one slot per
/// variable. A 16-bit gradient stays 16-bit: the memory widens it element
/// by element as it flattens it into an f32 bucket, so no widened copy of a
/// whole gradient exists.
fn with_host_grads<T: Element + WithDType, R>(
    names: &[String],
    vars: &[Var],
    grads: &GradStore,
    f: &mut HostGradsFn<'_, T, R>,
) -> Result<R> {
    let mut held = Vec::with_capacity(vars.len());
    for (name, var) in names.iter().zip(vars) {
        match grads.get(var.as_tensor()) {
            Some(grad) => {
                check_grad(name, var, grad, 0)?;
                held.push(Some(hold::<T>(grad)?));
            }
            None => held.push(None),
        }
    }
    let mut slots: Vec<Option<HostGrad<'_, T>>> = Vec::with_capacity(held.len());
    for h in &held {
        slots.push(match h {
            Some(h) => slot(h)?,
            None => None,
        });
    }
    f(&slots)
}

/// Checks that `grad` has `var`'s dtype and dims, the first `skip` of
/// them aside (a block of rows).
fn check_grad(name: &str, var: &Var, grad: &Tensor, skip: usize) -> Result<()> {
    let detail = if grad.dtype() != var.dtype() {
        format!(
            "gradient dtype {:?} differs from the variable's {:?}",
            grad.dtype(),
            var.dtype()
        )
    } else if grad.rank() != var.rank() || grad.dims()[skip..] != var.dims()[skip..] {
        format!(
            "gradient shape {:?} differs from the variable's {:?}",
            grad.dims(),
            var.dims()
        )
    } else {
        return Ok(());
    };
    Err(Error::Variable {
        name: name.to_string(),
        detail,
    })
}

/// A gradient's values as the engine reads them: Candle's CPU storage
/// borrowed, or a copy in `T` (another device, strided).
enum Held<'a, T> {
    Storage(candle_core::StorageRef<'a>, Range<usize>),
    Owned(Vec<T>),
}

fn hold<T: Element + WithDType>(grad: &Tensor) -> Result<Held<'_, T>> {
    let (storage, layout) = grad.storage_and_layout();
    let borrowed = grad.dtype() == <T as WithDType>::DTYPE
        || matches!(
            grad.dtype(),
            candle_core::DType::BF16 | candle_core::DType::F16
        );
    Ok(match (&*storage, layout.contiguous_offsets()) {
        (Storage::Cpu(_), Some((start, end))) if borrowed => Held::Storage(storage, start..end),
        _ => {
            drop(storage);
            Held::Owned(crate::precision::values_as::<T>(grad)?)
        }
    })
}

fn slot<'h, T: Element + WithDType>(held: &'h Held<'_, T>) -> Result<Option<HostGrad<'h, T>>> {
    Ok(match held {
        Held::Storage(storage, range) => match &**storage {
            Storage::Cpu(CpuStorage::BF16(v)) if <T as Element>::DTYPE != DType::BF16 => {
                Some(HostGrad::Bf16(&v[range.clone()]))
            }
            Storage::Cpu(CpuStorage::F16(v)) if <T as Element>::DTYPE != DType::F16 => {
                Some(HostGrad::F16(&v[range.clone()]))
            }
            Storage::Cpu(cpu) => Some(HostGrad::Same(
                &T::cpu_storage_as_slice(cpu)?[range.clone()],
            )),
            _ => None,
        },
        Held::Owned(v) => Some(HostGrad::Same(v.as_slice())),
    })
}

/// Reads and writes the variables from the gather thread of a step that
/// deferred its all-gathers (see `zero_core::engine::ParamAccess`).
pub(crate) struct VarAccess<T, C> {
    vars: Vec<Var>,
    _types: std::marker::PhantomData<fn() -> (T, C)>,
}

impl<T, C> VarAccess<T, C> {
    pub(crate) fn new(vars: Vec<Var>) -> Self {
        Self {
            vars,
            _types: std::marker::PhantomData,
        }
    }

    /// Runs `f` on the variables as the engine's parameters.
    fn with<R>(
        &self,
        mut f: impl FnMut(&mut Params<'_, T, C, C::Memory>) -> zero_core::Result<R>,
    ) -> zero_core::Result<R>
    where
        T: Element + WithDType,
        C: Communicator + 'static,
        C::Memory: CandleMemory<T, C>,
    {
        let mut out = None;
        C::Memory::with_params(&self.vars, &mut |params| {
            out = Some(f(params));
            Ok(())
        })
        .map_err(|e| zero_core::Error::State(e.to_string()))?;
        out.unwrap_or_else(|| Err(zero_core::Error::State("internal: no parameters".into())))
    }
}

impl<T, C> ParamAccess<T, C, MemoryOf<T, C>> for VarAccess<T, C>
where
    T: Element + WithDType,
    C: Communicator + 'static,
    C::Memory: CandleMemory<T, C>,
{
    fn read(
        &mut self,
        memory: &mut MemoryOf<T, C>,
        copies: &[ParamCopy],
        values: &mut <MemoryOf<T, C> as ShardMemory<T, C>>::Buffer,
    ) -> zero_core::Result<()> {
        self.with(|params| memory.read_params(params, copies, values))
    }

    fn write(
        &mut self,
        memory: &mut MemoryOf<T, C>,
        copies: &[ParamCopy],
        values: &<MemoryOf<T, C> as ShardMemory<T, C>>::Buffer,
    ) -> zero_core::Result<()> {
        self.with(|params| memory.write_params(params, copies, values))
    }
}

/// The Candle dtype of a zero-rs one.
pub(crate) fn candle_dtype(dtype: DType) -> candle_core::DType {
    match dtype {
        DType::F32 => candle_core::DType::F32,
        DType::F64 => candle_core::DType::F64,
        DType::BF16 => candle_core::DType::BF16,
        DType::F16 => candle_core::DType::F16,
    }
}
