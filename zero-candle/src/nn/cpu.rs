//! Reading CPU storage as typed slices, for the fused layers' CPU kernels.

use candle_core::{bail, CpuStorage, Layout, Result, Storage, Tensor, WithDType};

/// The elements of a contiguous `layout` in `storage`, as `T`.
pub(crate) fn slice<'a, T: WithDType>(
    storage: &'a CpuStorage,
    layout: &Layout,
    what: &str,
) -> Result<&'a [T]> {
    let data = T::cpu_storage_as_slice(storage)?;
    match layout.contiguous_offsets() {
        Some((start, end)) => Ok(&data[start..end]),
        None => bail!(
            "zero-candle: {what} must be contiguous here (got strides {:?} for shape {:?}); \
             call .contiguous() on it first",
            layout.stride(),
            layout.shape()
        ),
    }
}

/// Runs `f` on the CPU storage of `tensor` and its layout; an error names
/// `what` when the tensor is on another device.
pub(crate) fn with_cpu<R>(
    tensor: &Tensor,
    what: &str,
    f: impl FnOnce(&CpuStorage, &Layout) -> Result<R>,
) -> Result<R> {
    let (storage, layout) = tensor.storage_and_layout();
    match &*storage {
        Storage::Cpu(cpu) => f(cpu, layout),
        _ => bail!(
            "zero-candle: {what} is on {:?} but this kernel runs on the CPU; \
             keep the layer's input and parameters on one device",
            tensor.device().location()
        ),
    }
}

/// [`with_cpu`] for a tensor that may be absent (an optional bias): `f`
/// gets `None` for `None`.
pub(crate) fn with_cpu_opt<R>(
    tensor: Option<&Tensor>,
    what: &str,
    f: impl FnOnce(Option<(&CpuStorage, &Layout)>) -> Result<R>,
) -> Result<R> {
    match tensor {
        Some(tensor) => with_cpu(tensor, what, |storage, layout| f(Some((storage, layout)))),
        None => f(None),
    }
}

/// A copy of a CPU tensor's values as a storage of its own (contiguous,
/// from offset 0): a result computed before a custom op runs, for the op
/// to hand out.
pub(crate) fn owned_storage(tensor: &Tensor, what: &str) -> Result<CpuStorage> {
    let tensor = tensor.contiguous()?;
    with_cpu(&tensor, what, |storage, layout| {
        if layout.start_offset() == 0 && layout.shape().elem_count() == storage_len(storage) {
            return Ok(storage.clone());
        }
        let copy = tensor.copy()?;
        with_cpu(&copy, what, |storage, _| Ok(storage.clone()))
    })
}

/// Elements of a CPU storage.
pub(crate) fn storage_len(storage: &CpuStorage) -> usize {
    match storage {
        CpuStorage::U8(v) => v.len(),
        CpuStorage::U32(v) => v.len(),
        CpuStorage::I64(v) => v.len(),
        CpuStorage::BF16(v) => v.len(),
        CpuStorage::F16(v) => v.len(),
        CpuStorage::F32(v) => v.len(),
        CpuStorage::F64(v) => v.len(),
        _ => 0,
    }
}
