//! Device storages in the fused ops' backward passes: CUDA tensors' storage,
//! results wrapped back into tensors, and what a forward keeps for its
//! backward.

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
