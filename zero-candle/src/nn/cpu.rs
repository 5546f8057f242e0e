//! Reading CPU storage as typed slices, for the fused layers' CPU kernels.

use candle_core::backend::{BackendDevice, BackendStorage};
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

/// A CPU tensor's values as a storage of their own (contiguous, from
/// offset 0): a result computed before a custom op runs, for the op to
/// hand out. A view (strided, offset, or part of its storage) is copied.
pub(crate) fn owned_storage(tensor: &Tensor, what: &str) -> Result<CpuStorage> {
    with_cpu(tensor, what, |storage, layout| {
        let exact = layout.is_contiguous()
            && layout.start_offset() == 0
            && layout.shape().elem_count() == storage_len(storage);
        if exact {
            return Ok(storage.clone());
        }
        let mut copy = storage
            .device()
            .zeros_impl(layout.shape(), storage.dtype())?;
        storage.copy_strided_src(&mut copy, 0, layout)?;
        Ok(copy)
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

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// A view's values, not its whole storage: a narrowed tensor (an
    /// offset and a part), a transposed one (strided).
    #[test]
    fn a_view_owns_its_values_only() {
        let t = Tensor::arange(0f32, 12., &Device::Cpu).unwrap();
        let values = |storage: CpuStorage| match storage {
            CpuStorage::F32(v) => v,
            other => panic!("{:?}", other.dtype()),
        };
        let part = t.narrow(0, 5, 4).unwrap();
        assert_eq!(values(owned_storage(&part, "t").unwrap()), [5., 6., 7., 8.]);
        let strided = t.reshape((3, 4)).unwrap().t().unwrap();
        let expected: Vec<f32> = strided.flatten_all().unwrap().to_vec1().unwrap();
        assert_eq!(values(owned_storage(&strided, "t").unwrap()), expected);
        assert_eq!(values(owned_storage(&t, "t").unwrap()).len(), 12);
    }
}
