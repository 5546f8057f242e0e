//! `ZeroOptimizer<C>` for a device communicator `C` (`zero_nccl::DeviceComm`:
//! `NcclComm`, one process per GPU, or `CudaThreadComm`, ranks as threads
//! sharing a GPU): Candle models on GPUs, with the engine's buffers in GPU
//! memory (`zero_nccl::CudaMemory`, feature `nccl`).
//!
//! Gradients and parameters never leave the GPU: the engine reads each
//! gradient's `CudaSlice` in place (under Candle's read lock) and writes
//! updated parameters through an in-place op, on Candle's own stream, so no
//! host round trip and no host synchronization happen on the step path.
//! With `EngineConfig::offload` (ZeRO-Offload, `OffloadMemory`), the master
//! weights, the gradient shard and the optimizer state live in host memory
//! instead: each bucket's reduced part is copied down as backward fills it,
//! the host steps, and each stepped bucket goes back up to be all-gathered.

use crate::memory::{CandleMemory, GradsFn, KindFetcher, ParamsFn, Rounded};
use crate::nn::{GiveBack, Stretch};
use crate::optimizer::ZeroConfig;
use crate::precision::RoundedPool;
use crate::{Error, Result, ZeroOptimizer};
use candle_core::backend::BackendStorage;
use candle_core::backprop::GradStore;
use candle_core::cuda_backend::{CudaDType, CudaDevice, CudaStorage, CudaStorageSlice};
use candle_core::{CpuStorage, DType, Device, Layout, Storage, Tensor, Var};
use half::{bf16, f16};
use std::cell::RefCell;
use std::ops::Range;
use std::sync::Arc;
use zero_core::engine::{Engine, OffloadMemory};
use zero_nccl::cudarc::driver::{CudaSlice, CudaView};
use zero_nccl::{
    Cuda, CudaMemory, DeviceComm, DeviceGather, DeviceParams, DeviceView, DeviceViewMut,
    GatherValues, NcclComm,
};

/// [`ZeroOptimizer`] on GPUs over NCCL: f32 variables on the
/// communicator's GPU (or bf16/f16 ones, with f32 master weights, f32
/// optimizer state and gradients reduced in f32), a built-in optimizer of `zero-core` (SGD, Adam,
/// AdamW, Adagrad, RMSprop) whose hyperparameters drive fused CUDA kernels, or any optimizer
/// offloaded (`EngineConfig::with_offload(Offload::Optimizer, threads)`: the host steps it).
///
/// ```no_run
/// use candle_core::{DType, Device};
/// use candle_nn::{Optimizer, VarBuilder, VarMap};
/// use zero_candle::NcclZeroOptimizer;
/// use zero_core::{engine::{EngineConfig, Stage}, optim::{AdamW, AdamWConfig}};
/// use zero_nccl::NcclComm;
///
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let comm = NcclComm::from_env()?; // mpirun or torchrun-style variables
/// let device = Device::new_cuda(comm.context().ordinal())?;
/// let varmap = VarMap::new();
/// let vb = VarBuilder::from_varmap(&varmap, DType::F32, &device);
/// let layer = candle_nn::linear(1024, 1024, vb.pp("layer"))?;
/// let mut opt = NcclZeroOptimizer::new(
///     &varmap,
///     comm,
///     EngineConfig::default().with_stage(Stage::Gradients),
///     Box::new(AdamW::new(AdamWConfig::default())?),
/// )?;
/// // forward, loss, then: opt.backward_step(&loss)?
/// # Ok(()) }
/// ```
pub type NcclZeroOptimizer = ZeroOptimizer<NcclComm, f32>;

/// [`ZeroConfig`] of [`NcclZeroOptimizer`], for [`candle_nn::Optimizer::new`].
pub type NcclZeroConfig = ZeroConfig<NcclComm, f32>;

impl<C: DeviceComm> CandleMemory<f32, C> for Cuda {
    /// The GPU's memory, whose optimizer side moves to host memory with
    /// `EngineConfig::offload`.
    type Memory = OffloadMemory<CudaMemory>;

    fn build(named: &[(String, Var)], comm: C) -> Result<(C, OffloadMemory<CudaMemory>)> {
        let mut stream = None;
        for (name, var) in named {
            if !matches!(var.dtype(), DType::F32 | DType::BF16 | DType::F16) {
                return Err(Error::Variable {
                    name: name.clone(),
                    detail: format!(
                        "dtype {:?}: the CUDA engine trains f32 variables, and bf16 or f16 \
                         ones with f32 master weights; convert it or keep it out of the \
                         VarMap given to the optimizer",
                        var.dtype()
                    ),
                });
            }
            let Device::Cuda(device) = var.device() else {
                return Err(Error::Variable {
                    name: name.clone(),
                    detail: format!(
                        "lives on {:?}; an NCCL optimizer trains variables on the \
                         communicator's GPU (build the model on `Device::new_cuda`)",
                        var.device().location()
                    ),
                });
            };
            let s = device.cuda_stream();
            if s.context() != comm.context() {
                return Err(Error::Variable {
                    name: name.clone(),
                    detail: format!(
                        "lives on GPU {}, the communicator on GPU {}; build the model on \
                         `Device::new_cuda(comm.context().ordinal())`",
                        s.context().ordinal(),
                        comm.context().ordinal()
                    ),
                });
            }
            stream.get_or_insert(s);
        }
        // Collectives and kernels follow Candle's stream, so the step is
        // ordered after the backward pass and before the next forward
        // without any host synchronization.
        let comm = match stream {
            Some(s) if !Arc::ptr_eq(&s, comm.compute_stream()) => comm.with_compute_stream(s)?,
            _ => comm,
        };
        let memory = CudaMemory::new(&comm)?;
        Ok((comm, OffloadMemory::new(memory)))
    }

    fn device_peak_bytes(comm: &C) -> Option<u64> {
        let pool = zero_nccl::DevicePool::of(comm.context()).ok()?;
        pool.high_water().ok()
    }

    fn with_grads<R>(
        names: &[String],
        vars: &[Var],
        grads: &GradStore,
        f: &mut GradsFn<'_, f32, C, Self, R>,
    ) -> Result<R> {
        let grads = contiguous_grads(names, vars, grads)?;
        with_device_grads::<C, R>(names, &grads, f)
    }

    fn with_params<R>(vars: &[Var], f: &mut ParamsFn<'_, f32, C, Self, R>) -> Result<R> {
        let mut params = CandleParams { vars };
        f(&mut params)
    }

    fn shard_parameters(
        engine: &mut Engine<f32, C, OffloadMemory<CudaMemory>>,
        mask: &[bool],
        vars: &[Var],
    ) -> Result<Arc<KindFetcher<f32, C, Cuda>>> {
        let mut params = CandleParams { vars };
        Ok(engine.shard_parameters(mask, &mut params)?)
    }

    /// A deferred variable's values are computed on the host, only the
    /// ranges this rank reads (its own pieces), one at a time, and uploaded
    /// for the engine to read, so the device holds at most one piece of a
    /// deferred variable at a time.
    fn shard_from_start(
        engine: &mut Engine<f32, C, OffloadMemory<CudaMemory>>,
        order: &[usize],
        mask: &[bool],
        (names, vars): (&[String], &[Var]),
        map: &crate::ShardedVarMap,
    ) -> Result<Arc<KindFetcher<f32, C, Cuda>>> {
        let mut params = InitParams {
            vars: CandleParams { vars },
            names,
            map,
            uploaded: None,
        };
        Ok(engine.shard_from_start(order, mask, &mut params)?)
    }

    fn lend(buffer: DeviceGather, device: &Device) -> Result<Storage> {
        Ok(Storage::Cuda(lend(buffer, device)?))
    }

    fn take_back(storage: Storage) -> Option<DeviceGather> {
        match storage {
            Storage::Cuda(storage) => take_back(storage),
            _ => None,
        }
    }

    fn gathered_dtype(buffer: &DeviceGather) -> DType {
        crate::memory::candle_dtype(buffer.values().dtype())
    }

    /// The gathered buffer up to the unit's last stretch rounded to the
    /// 16-bit `dtype` in one launch of the engine's narrowing kernel (the
    /// stretches keep their places; a pooled buffer's tail, left from a
    /// larger unit, is not converted); the f32 buffer goes back at once.
    fn round(
        buffer: DeviceGather,
        (stretches, _packed): (&Arc<[Stretch]>, &Arc<[Stretch]>),
        dtype: DType,
        device: &Device,
        _pool: &Arc<RoundedPool>,
    ) -> (Result<Rounded>, Option<DeviceGather>) {
        let Device::Cuda(cuda) = device else {
            return (Err(not_on_the_gpu()), Some(buffer));
        };
        let used = stretches.iter().map(|s| s.at.end).max().unwrap_or(0);
        let numel = used.max(1).min(buffer.values().len());
        // Makes Candle's stream (the compute stream) wait for the gather.
        let values = match buffer.into_values() {
            GatherValues::F32(values) => values,
            // Gathered in a 16-bit dtype: the layers lend those as they are.
            other => {
                let error = Error::Zero(zero_core::Error::State(format!(
                    "internal: stage 3 asked to round a gather already in {:?} to {dtype:?}",
                    other.dtype()
                )));
                return (
                    Err(error),
                    Some(DeviceGather::new(other, cuda.cuda_stream())),
                );
            }
        };
        let rounded = narrowed(&values, numel, dtype, cuda).map(|rounded| {
            let lender: Arc<dyn GiveBack> = Arc::new(DropStorage);
            (Storage::Cuda(rounded), Arc::clone(stretches), lender)
        });
        (rounded, Some(DeviceGather::new(values, cuda.cuda_stream())))
    }
}

/// `values[..numel]` rounded to nearest even in the 16-bit `dtype`, a new
/// storage on `device`'s stream (which reads `values` after what it has
/// queued so far).
fn narrowed(
    values: &CudaSlice<f32>,
    numel: usize,
    dtype: DType,
    device: &CudaDevice,
) -> Result<CudaStorage> {
    fn into<H: zero_nccl::kernels::Half + CudaDType>(
        values: &CudaSlice<f32>,
        numel: usize,
        device: &CudaDevice,
    ) -> Result<CudaStorage> {
        let kernels = crate::nn::ops::cuda::fused_kernels("stage 3's rounding", device)?;
        let stream = device.cuda_stream();
        // SAFETY: the narrowing below writes every element before the
        // storage is read.
        let mut out = unsafe { stream.alloc::<H>(numel) }
            .map_err(|e| Error::Zero(zero_nccl::Error::from(e).into()))?;
        kernels
            .narrow_ranges(&stream, values, &mut [(0, &mut out, 0..numel)])
            .map_err(|e| Error::Zero(e.into()))?;
        Ok(CudaStorage::wrap_cuda_slice(out, device.clone()))
    }
    match dtype {
        DType::BF16 => into::<bf16>(values, numel, device),
        DType::F16 => into::<f16>(values, numel, device),
        other => Err(Error::Zero(zero_core::Error::State(format!(
            "stage 3 rounds gathered f32 weights to bf16 or f16 on the GPU, not {other:?}; \
             use an f32, bf16 or f16 model"
        )))),
    }
}

/// The error of a stage-3 layer off the GPU.
fn not_on_the_gpu() -> Error {
    Error::Zero(zero_core::Error::State(
        "stage 3 on the GPU lends gathered parameters to layers on the GPU only".into(),
    ))
}

/// A gathered buffer as a Candle storage on `device` (no copy).
fn lend(buffer: DeviceGather, device: &Device) -> Result<CudaStorage> {
    let Device::Cuda(device) = device else {
        return Err(not_on_the_gpu());
    };
    let device = device.clone();
    Ok(match buffer.into_values() {
        GatherValues::F32(values) => CudaStorage::wrap_cuda_slice(values, device),
        GatherValues::BF16(values) => CudaStorage::wrap_cuda_slice(values, device),
        GatherValues::F16(values) => CudaStorage::wrap_cuda_slice(values, device),
    })
}

/// The buffer of a storage [`lend`] made.
fn take_back(storage: CudaStorage) -> Option<DeviceGather> {
    let CudaStorage { slice, device } = storage;
    let values = match slice {
        CudaStorageSlice::F32(values) => GatherValues::F32(values),
        CudaStorageSlice::BF16(values) => GatherValues::BF16(values),
        CudaStorageSlice::F16(values) => GatherValues::F16(values),
        _ => return None,
    };
    Some(DeviceGather::new(values, device.cuda_stream()))
}

/// Lets a lent storage go (Candle frees it on its stream).
struct DropStorage;

impl GiveBack for DropStorage {
    fn give_back(&self, _tag: usize, _storage: Storage) {}
}

/// Each variable's gradient, contiguous (a no-op for the usual contiguous
/// gradient), checked against the variable.
fn contiguous_grads(
    names: &[String],
    vars: &[Var],
    grads: &GradStore,
) -> Result<Vec<Option<Tensor>>> {
    names
        .iter()
        .zip(vars)
        .map(|(name, var)| {
            let Some(grad) = grads.get(var.as_tensor()) else {
                return Ok(None);
            };
            if grad.dtype() != var.dtype() || grad.dims() != var.dims() {
                return Err(Error::Variable {
                    name: name.clone(),
                    detail: format!(
                        "gradient {:?} {:?} does not match the variable, {:?} {:?}",
                        grad.dtype(),
                        grad.dims(),
                        var.dtype(),
                        var.dims()
                    ),
                });
            }
            Ok(Some(grad.contiguous()?))
        })
        .collect()
}

/// Holds every gradient's storage read lock and calls `f` with device views
/// of them, one slot per variable.
fn with_device_grads<C: DeviceComm, R>(
    names: &[String],
    grads: &[Option<Tensor>],
    f: &mut GradsFn<'_, f32, C, Cuda, R>,
) -> Result<R> {
    let guards: Vec<_> = grads
        .iter()
        .map(|g| g.as_ref().map(|t| t.storage_and_layout()))
        .collect();
    let mut views = Vec::with_capacity(guards.len());
    for (name, guard) in names.iter().zip(&guards) {
        views.push(match guard {
            None => None,
            Some((storage, layout)) => {
                let Storage::Cuda(cuda) = &**storage else {
                    return Err(Error::Variable {
                        name: name.clone(),
                        detail: "its gradient is not on a CUDA device".into(),
                    });
                };
                let (start, end) = contiguous(layout, name)?;
                Some(TypedView::of(cuda, start..end)?)
            }
        });
    }
    let slots: Vec<Option<DeviceView<'_>>> = views
        .iter()
        .map(|v| v.as_ref().map(TypedView::view))
        .collect();
    f(&slots)
}

/// A range of a Candle CUDA storage, in its dtype.
enum TypedView<'a> {
    F32(CudaView<'a, f32>),
    Bf16(CudaView<'a, bf16>),
    F16(CudaView<'a, f16>),
}

impl<'a> TypedView<'a> {
    fn of(storage: &'a CudaStorage, range: Range<usize>) -> candle_core::Result<Self> {
        Ok(match storage.dtype() {
            DType::BF16 => Self::Bf16(storage.as_cuda_slice::<bf16>()?.slice(range)),
            DType::F16 => Self::F16(storage.as_cuda_slice::<f16>()?.slice(range)),
            _ => Self::F32(storage.as_cuda_slice::<f32>()?.slice(range)),
        })
    }

    fn view(&self) -> DeviceView<'_> {
        match self {
            Self::F32(v) => v.into(),
            Self::Bf16(v) => v.into(),
            Self::F16(v) => v.into(),
        }
    }
}

fn contiguous(layout: &Layout, name: &str) -> Result<(usize, usize)> {
    layout.contiguous_offsets().ok_or_else(|| Error::Variable {
        name: name.to_string(),
        detail: "is not contiguous; the CUDA engine reads and writes contiguous memory".into(),
    })
}

/// Candle variables as the CUDA engine's [`DeviceParams`].
struct CandleParams<'a> {
    vars: &'a [Var],
}

fn candle_failure(param: usize, e: impl std::fmt::Display) -> zero_core::Error {
    zero_core::Error::State(format!(
        "cannot access parameter #{param} on the GPU through Candle: {e}"
    ))
}

impl DeviceParams for CandleParams<'_> {
    fn with_param(
        &mut self,
        param: usize,
        f: &mut dyn FnMut(DeviceView<'_>) -> zero_core::Result<()>,
    ) -> zero_core::Result<()> {
        let var = &self.vars[param];
        let (storage, layout) = var.storage_and_layout();
        let Storage::Cuda(cuda) = &*storage else {
            return Err(candle_failure(
                param,
                "the variable is not on a CUDA device",
            ));
        };
        let (start, end) = layout
            .contiguous_offsets()
            .ok_or_else(|| candle_failure(param, "the variable is not contiguous"))?;
        let view = TypedView::of(cuda, start..end).map_err(|e| candle_failure(param, e))?;
        f(view.view())
    }

    fn with_param_mut(
        &mut self,
        param: usize,
        f: &mut dyn FnMut(DeviceViewMut<'_>) -> zero_core::Result<()>,
    ) -> zero_core::Result<()> {
        // Candle hands out its storage mutably only to an in-place op; the
        // op runs `f` under the variable's write lock.
        let op = WriteParam {
            f: RefCell::new(f),
            failure: RefCell::new(None),
        };
        let outcome = self.vars[param].as_tensor().inplace_op1(&op);
        if let Some(e) = op.failure.into_inner() {
            return Err(e);
        }
        outcome.map_err(|e| candle_failure(param, e))
    }
}

/// The engine's view of a model built by a `ShardedVarMap` on the GPU:
/// deferred variables (no values yet) are computed from the map's source
/// and uploaded: the ranges the engine reads, or, where it asks for a whole
/// variable, all of it, kept while the engine reads its pieces.
struct InitParams<'a> {
    vars: CandleParams<'a>,
    names: &'a [String],
    map: &'a crate::ShardedVarMap,
    /// The deferred variable last uploaded, in f32 (rounded to its dtype).
    uploaded: Option<(usize, CudaSlice<f32>)>,
}

impl InitParams<'_> {
    fn upload(&mut self, param: usize) -> zero_core::Result<Option<&CudaSlice<f32>>> {
        let name = &self.names[param];
        let Some((init, shape)) = self.map.deferred(name) else {
            return Ok(None);
        };
        if self.uploaded.as_ref().is_none_or(|(p, _)| *p != param) {
            // The previous one goes first.
            self.uploaded = None;
            let var = &self.vars.vars[param];
            let Device::Cuda(device) = var.device() else {
                return Err(candle_failure(
                    param,
                    "the variable is not on a CUDA device",
                ));
            };
            let mut values = vec![0f32; var.elem_count()];
            let filled = crate::init::fill_from(
                self.map.source(),
                (name, &shape, init),
                0..values.len(),
                var.dtype(),
                &mut values,
            );
            filled.map_err(|e| candle_failure(param, e))?;
            let uploaded = device
                .cuda_stream()
                .clone_htod(&values)
                .map_err(|e| candle_failure(param, e))?;
            self.uploaded = Some((param, uploaded));
        }
        Ok(self.uploaded.as_ref().map(|(_, values)| values))
    }
}

impl DeviceParams for InitParams<'_> {
    /// A deferred variable: only `range` is computed and uploaded.
    fn with_param_range(
        &mut self,
        param: usize,
        range: std::ops::Range<usize>,
        f: &mut dyn FnMut(DeviceView<'_>, usize) -> zero_core::Result<()>,
    ) -> zero_core::Result<()> {
        let name = &self.names[param];
        let Some((init, shape)) = self.map.deferred(name) else {
            return self
                .vars
                .with_param(param, &mut |view| f(view, range.start));
        };
        let var = &self.vars.vars[param];
        let Device::Cuda(device) = var.device() else {
            return Err(candle_failure(
                param,
                "the variable is not on a CUDA device",
            ));
        };
        if range.end > var.elem_count() {
            return Err(candle_failure(
                param,
                format!("range {range:?} of {} elements", var.elem_count()),
            ));
        }
        let mut values = vec![0f32; range.len()];
        crate::init::fill_from(
            self.map.source(),
            (name, &shape, init),
            range,
            var.dtype(),
            &mut values,
        )
        .map_err(|e| candle_failure(param, e))?;
        let uploaded = device
            .cuda_stream()
            .clone_htod(&values)
            .map_err(|e| candle_failure(param, e))?;
        f((&uploaded).into(), 0)
    }

    fn with_param(
        &mut self,
        param: usize,
        f: &mut dyn FnMut(DeviceView<'_>) -> zero_core::Result<()>,
    ) -> zero_core::Result<()> {
        match self.upload(param)? {
            Some(values) => f(values.into()),
            None => self.vars.with_param(param, f),
        }
    }

    fn with_param_mut(
        &mut self,
        param: usize,
        f: &mut dyn FnMut(DeviceViewMut<'_>) -> zero_core::Result<()>,
    ) -> zero_core::Result<()> {
        if self.map.deferred(&self.names[param]).is_some() {
            return Err(zero_core::Error::State(format!(
                "internal: the engine wrote {:?} before it was sharded or given values",
                self.names[param]
            )));
        }
        self.vars.with_param_mut(param, f)
    }
}

/// What the CUDA engine does with a writable parameter.
type ParamWriter<'g> = dyn FnMut(DeviceViewMut<'_>) -> zero_core::Result<()> + 'g;

/// The in-place op of [`CandleParams::with_param_mut`].
struct WriteParam<'f, 'g> {
    f: RefCell<&'f mut ParamWriter<'g>>,
    /// The engine's own error, kept whole instead of through Candle's.
    failure: RefCell<Option<zero_core::Error>>,
}

impl candle_core::InplaceOp1 for WriteParam<'_, '_> {
    fn name(&self) -> &'static str {
        "zero-rs parameter write"
    }

    fn cpu_fwd(&self, _: &mut CpuStorage, _: &Layout) -> candle_core::Result<()> {
        candle_core::bail!("the CUDA engine writes CUDA variables only")
    }

    fn cuda_fwd(&self, storage: &mut CudaStorage, layout: &Layout) -> candle_core::Result<()> {
        let Some((start, end)) = layout.contiguous_offsets() else {
            candle_core::bail!("the variable is not contiguous")
        };
        let mut f = self.f.borrow_mut();
        let written = match storage.dtype() {
            DType::BF16 => {
                (*f)((&mut storage.as_cuda_slice_mut::<bf16>()?.slice_mut(start..end)).into())
            }
            DType::F16 => {
                (*f)((&mut storage.as_cuda_slice_mut::<f16>()?.slice_mut(start..end)).into())
            }
            _ => (*f)((&mut storage.as_cuda_slice_mut::<f32>()?.slice_mut(start..end)).into()),
        };
        if let Err(e) = written {
            *self.failure.borrow_mut() = Some(e);
            candle_core::bail!("the CUDA engine's write failed");
        }
        Ok(())
    }
}
