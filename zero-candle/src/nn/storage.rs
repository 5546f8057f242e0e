//! Device storages in the fused ops' backward passes: CUDA tensors' storage,
//! results wrapped back into tensors, and what a forward keeps for its
//! backward.

use candle_core::backend::{BackendDevice, BackendStorage};
use candle_core::op::BackpropOp;
use candle_core::{bail, CpuStorage, CudaStorage, Layout, Result, Shape, Storage, Tensor};
use std::sync::{Mutex, PoisonError};

/// Runs `f` on the CUDA storage of `tensor` and its layout; an error names
/// `what` when the tensor is on another device.
pub(crate) fn with_cuda<R>(
    tensor: &Tensor,
    what: &str,
    f: impl FnOnce(&CudaStorage, &Layout) -> Result<R>,
) -> Result<R> {
    let (storage, layout) = tensor.storage_and_layout();
    match &*storage {
        Storage::Cuda(cuda) => f(cuda, layout),
        _ => bail!(
            "zero-candle: {what} is on {:?} but this kernel runs on CUDA; keep the op's \
             inputs on one device",
            tensor.device().location()
        ),
    }
}

/// [`with_cuda`] for a tensor that may be absent (an optional bias): `f`
/// gets `None` for `None`.
pub(crate) fn with_cuda_opt<R>(
    tensor: Option<&Tensor>,
    what: &str,
    f: impl FnOnce(Option<(&CudaStorage, &Layout)>) -> Result<R>,
) -> Result<R> {
    match tensor {
        Some(tensor) => with_cuda(tensor, what, |storage, layout| f(Some((storage, layout)))),
        None => f(None),
    }
}

/// `tensor`'s values as a storage of their own, contiguous from element 0
/// (a result computed before an op runs, which the op hands out): on the
/// CPU the tensor's own when it is exactly that, else a copy.
pub(crate) fn owned_storage(tensor: &Tensor, what: &str) -> Result<Storage> {
    if tensor.device().is_cpu() {
        return Ok(Storage::Cpu(super::cpu::owned_storage(tensor, what)?));
    }
    with_cuda(tensor, what, |storage, layout| {
        let mut copy = storage
            .device()
            .zeros_impl(layout.shape(), storage.dtype())?;
        storage.copy_strided_src(&mut copy, 0, layout)?;
        Ok(Storage::Cuda(copy))
    })
}

/// The backend storage `S` in `storage`; an error names `what` when it is
/// on another device.
pub(crate) fn on_device<S: OnDevice>(storage: Storage, what: &str) -> Result<S> {
    match S::take(storage) {
        Some(s) => Ok(s),
        None => bail!("zero-candle: {what} was computed on another device than the op runs on"),
    }
}

/// A contiguous tensor of `shape` over a result `storage`, outside the graph.
pub(crate) fn tensor_from(storage: Storage, shape: impl Into<Shape>) -> Tensor {
    Tensor::from_storage(storage, shape, BackpropOp::none(), false)
}

/// What an op's forward keeps for its backward besides its inputs and
/// output (attention's row statistics, the loss's row count), on the
/// device the forward ran on.
pub(crate) enum Saved {
    Cpu(CpuStorage),
    Cuda(CudaStorage),
}

/// A slot the forward fills once and the backward reads (an op's methods
/// take `&self`).
#[derive(Default)]
pub(crate) struct SavedSlot(Mutex<Option<Saved>>);

impl SavedSlot {
    pub(crate) fn put(&self, saved: Saved) {
        *self.0.lock().unwrap_or_else(PoisonError::into_inner) = Some(saved);
    }

    /// Runs `f` on what the forward saved; an error names `op` when the
    /// forward saved nothing (it did not run through this op instance).
    pub(crate) fn read<R>(&self, op: &str, f: impl FnOnce(&Saved) -> Result<R>) -> Result<R> {
        let guard = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        match guard.as_ref() {
            Some(saved) => f(saved),
            None => bail!("zero-candle {op}: backward ran without its forward's saved statistics"),
        }
    }
}

/// A backend's storage type, as found in a [`Storage`]: what a fused op's
/// forward on that backend reads a gathered parameter as.
pub(crate) trait OnDevice: BackendStorage + Sized {
    fn of(storage: &Storage) -> Option<&Self>;
    fn take(storage: Storage) -> Option<Self>;
}

impl OnDevice for CpuStorage {
    fn of(storage: &Storage) -> Option<&Self> {
        match storage {
            Storage::Cpu(s) => Some(s),
            _ => None,
        }
    }

    fn take(storage: Storage) -> Option<Self> {
        match storage {
            Storage::Cpu(s) => Some(s),
            _ => None,
        }
    }
}

impl OnDevice for CudaStorage {
    fn of(storage: &Storage) -> Option<&Self> {
        match storage {
            Storage::Cuda(s) => Some(s),
            _ => None,
        }
    }

    fn take(storage: Storage) -> Option<Self> {
        match storage {
            Storage::Cuda(s) => Some(s),
            _ => None,
        }
    }
}
