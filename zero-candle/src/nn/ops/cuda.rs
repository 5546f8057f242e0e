//! The CUDA entry points of the fused layers (feature `cuda`): each takes
//! Candle's CUDA storages, launches zero-nccl's layer kernels
//! ([`LayerKernels`]) on the device's stream, and wraps the results as new
//! storages of that device. Nothing here waits for the GPU.
//!
//! The kernels are compiled with NVRTC the first time a device runs one
//! (seconds), then kept for the process in a small cache keyed by the
//! device's CUDA context (every Candle device of one GPU shares its primary
//! context, hence the module).

use super::rotary_dims::{RotaryDims, Turn};
use super::{Activation, AttentionDims};
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::{CudaDType, CudaDevice};
use candle_core::{bail, CudaStorage, DType, Layout, Result};
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use zero_nccl::cudarc::driver::{
    CudaSlice, CudaStream, CudaView, CudaViewMut, DevicePtr, DevicePtrMut,
};
use zero_nccl::kernels::layers::{
    ActivationKind, AttentionShape, LayerElement, LayerKernels, Normalization, RotaryShape,
    RotaryTurn,
};
use zero_nccl::kernels::FusedKernels;

/// A CUDA storage with its layout.
pub(crate) type Arg<'a> = (&'a CudaStorage, &'a Layout);

/// A storage type of the kernels that Candle also stores.
trait Float: LayerElement + CudaDType {
    const DTYPE: DType;
}

impl Float for f32 {
    const DTYPE: DType = DType::F32;
}

impl Float for half::bf16 {
    const DTYPE: DType = DType::BF16;
}

impl Float for half::f16 {
    const DTYPE: DType = DType::F16;
}

/// Runs `$body` with `$T` the Rust type of `$dtype` (f32, bf16 or f16).
macro_rules! by_dtype {
    ($dtype:expr, $op:expr, |$T:ident| $body:expr) => {
        match $dtype {
            DType::F32 => {
                type $T = f32;
                $body
            }
            DType::BF16 => {
                type $T = half::bf16;
                $body
            }
            DType::F16 => {
                type $T = half::f16;
                $body
            }
            other => bail!(
                "zero-candle {}: dtype {other:?} has no CUDA kernel; use f32, bf16 or f16 on the \
                 GPU (f64 runs on the CPU)",
                $op
            ),
        }
    };
}

/// A per-process cache of what a device needs made once.
type Cache<V> = OnceLock<Mutex<HashMap<usize, Arc<V>>>>;

/// `cache`'s entry under `key`, made by `make` the first time. The lock is
/// held while making: a second thread asking for the same entry waits for
/// it instead of making its own.
fn cached<V>(cache: &Cache<V>, key: usize, make: impl FnOnce() -> Result<V>) -> Result<Arc<V>> {
    let mut cache = cache
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(PoisonError::into_inner);
    if let Some(value) = cache.get(&key) {
        return Ok(value.clone());
    }
    let value = Arc::new(make()?);
    cache.insert(key, value.clone());
    Ok(value)
}

/// The layer kernels of `device`'s context, compiled on first use.
fn kernels(op: &str, device: &CudaDevice) -> Result<Arc<LayerKernels>> {
    static CACHE: Cache<LayerKernels> = OnceLock::new();
    let stream = device.cuda_stream();
    let ctx = stream.context();
    // The CUcontext handle identifies the GPU's primary context; the cached
    // kernels hold an Arc of it, so it outlives every entry.
    cached(&CACHE, ctx.cu_ctx() as usize, || {
        LayerKernels::new(ctx).map_err(|e| kernel_error(op, e))
    })
}

/// The engine's kernels (copies, conversions, optimizers) of `device`'s
/// context, compiled on first use: for what a layer's storage needs of
/// them, as stage 3's rounding of gathered weights (the engine's, so
/// unused without `nccl`).
#[cfg_attr(not(feature = "nccl"), allow(dead_code))]
pub(crate) fn fused_kernels(op: &str, device: &CudaDevice) -> Result<Arc<FusedKernels>> {
    static CACHE: Cache<FusedKernels> = OnceLock::new();
    let stream = device.cuda_stream();
    let ctx = stream.context();
    cached(&CACHE, ctx.cu_ctx() as usize, || {
        FusedKernels::new(ctx).map_err(|e| kernel_error(op, e))
    })
}

/// A zero-nccl error as Candle's, naming the op.
fn kernel_error(op: &str, e: zero_nccl::Error) -> candle_core::Error {
    candle_core::Error::Msg(format!("zero-candle {op} on CUDA: {e}"))
}

/// The contiguous elements of `arg` as a typed view.
fn view<'a, T: Float>(op: &str, what: &str, arg: Arg<'a>) -> Result<CudaView<'a, T>> {
    let range = typed_range::<T>(op, what, arg)?;
    Ok(arg.0.as_cuda_slice::<T>()?.slice(range))
}

/// [`view`], writable.
fn view_mut<'a, T: Float>(
    op: &str,
    what: &str,
    (storage, layout): (&'a mut CudaStorage, &Layout),
) -> Result<CudaViewMut<'a, T>> {
    let range = typed_range::<T>(op, what, (storage, layout))?;
    Ok(storage.as_cuda_slice_mut::<T>()?.slice_mut(range))
}

/// The elements of `arg`, checked contiguous and of `T`.
fn typed_range<T: Float>(op: &str, what: &str, arg: Arg) -> Result<std::ops::Range<usize>> {
    let (storage, layout) = arg;
    let Some((start, end)) = layout.contiguous_offsets() else {
        bail!(
            "zero-candle {op}: {what} is not contiguous (shape {:?}, stride {:?}); call \
             .contiguous() on it first",
            layout.shape(),
            layout.stride()
        )
    };
    if storage.dtype() != T::DTYPE {
        bail!(
            "zero-candle {op}: {what} is {:?}, expected {:?}; convert it with .to_dtype()",
            storage.dtype(),
            T::DTYPE
        );
    }
    Ok(start..end)
}

/// The elements a float CUDA storage holds (`None` for other dtypes).
pub(crate) fn storage_len(storage: &CudaStorage) -> Option<usize> {
    Some(match storage.dtype() {
        DType::F32 => storage.as_cuda_slice::<f32>().ok()?.len(),
        DType::F64 => storage.as_cuda_slice::<f64>().ok()?.len(),
        DType::BF16 => storage.as_cuda_slice::<half::bf16>().ok()?.len(),
        DType::F16 => storage.as_cuda_slice::<half::f16>().ok()?.len(),
        _ => return None,
    })
}

/// An output of `len` elements on `device`, for a kernel that writes every
/// one of them. At least one element is allocated (CUDA refuses empty
/// allocations); kernels see the first `len`.
fn alloc_out<T: Float>(device: &CudaDevice, len: usize) -> Result<CudaSlice<T>> {
    // SAFETY: every caller hands `out(..len)` to a kernel that writes all
    // `len` elements before anything reads them (stream order); an element
    // past `len` is outside every tensor's shape.
    unsafe { device.alloc::<T>(len.max(1)) }
}

fn out<T: Float>(slice: &mut CudaSlice<T>, len: usize) -> CudaViewMut<'_, T> {
    slice.slice_mut(..len)
}

/// Runs `f` with `arg`'s kernels and stream.
fn launch_on<R>(
    op: &str,
    arg: Arg,
    f: impl FnOnce(&LayerKernels, &Arc<CudaStream>) -> zero_nccl::Result<R>,
) -> Result<R> {
    let device = &arg.0.device;
    let kernels = kernels(op, device)?;
    let stream = device.cuda_stream();
    f(kernels.as_ref(), &stream).map_err(|e| kernel_error(op, e))
}

fn attention_shape(dims: &AttentionDims) -> AttentionShape {
    AttentionShape {
        batch: dims.batch,
        time: dims.time,
        heads: dims.heads,
        kv_heads: dims.kv_heads,
        head_dim: dims.head_dim,
        scale: dims.scale,
        window: dims.window,
    }
}

pub(crate) fn attention_forward(
    qkv: Arg,
    dims: &AttentionDims,
) -> Result<(CudaStorage, CudaStorage)> {
    const OP: &str = "causal_self_attention";
    let shape = attention_shape(dims);
    let device = qkv.0.device.clone();
    by_dtype!(qkv.0.dtype(), OP, |T| {
        let input = view::<T>(OP, "qkv", qkv)?;
        let mut y = alloc_out::<T>(&device, shape.out_len())?;
        let mut lse = alloc_out::<f32>(&device, shape.lse_len())?;
        launch_on(OP, qkv, |kernels, stream| {
            kernels.attention_forward(
                stream,
                &shape,
                &input,
                &mut out(&mut y, shape.out_len()),
                &mut out(&mut lse, shape.lse_len()),
            )
        })?;
        Ok((
            CudaStorage::wrap_cuda_slice(y, device.clone()),
            CudaStorage::wrap_cuda_slice(lse, device),
        ))
    })
}

pub(crate) fn attention_backward(
    qkv: Arg,
    out_arg: Arg,
    lse: &CudaStorage,
    grad: Arg,
    dims: &AttentionDims,
) -> Result<CudaStorage> {
    const OP: &str = "causal_self_attention backward";
    let shape = attention_shape(dims);
    let device = qkv.0.device.clone();
    let lse = saved_lse(OP, lse, shape.lse_len())?;
    by_dtype!(qkv.0.dtype(), OP, |T| {
        let input = view::<T>(OP, "qkv", qkv)?;
        let output = view::<T>(OP, "the forward's output", out_arg)?;
        let grad = view::<T>(OP, "the output gradient", grad)?;
        let mut dqkv = alloc_out::<T>(&device, shape.qkv_len())?;
        launch_on(OP, qkv, |kernels, stream| {
            kernels.attention_backward(
                stream,
                &shape,
                &input,
                &output,
                &lse,
                &grad,
                &mut out(&mut dqkv, shape.qkv_len()),
            )
        })?;
        Ok(CudaStorage::wrap_cuda_slice(dqkv, device))
    })
}

pub(crate) fn attention_forward_split(
    [q, k, v]: [Arg; 3],
    dims: &AttentionDims,
) -> Result<(CudaStorage, CudaStorage)> {
    const OP: &str = "causal_attention";
    let shape = attention_shape(dims);
    let device = q.0.device.clone();
    by_dtype!(q.0.dtype(), OP, |T| {
        let (q_view, k_view, v_view) = (
            view::<T>(OP, "q", q)?,
            view::<T>(OP, "k", k)?,
            view::<T>(OP, "v", v)?,
        );
        let mut y = alloc_out::<T>(&device, shape.out_len())?;
        let mut lse = alloc_out::<f32>(&device, shape.lse_len())?;
        launch_on(OP, q, |kernels, stream| {
            kernels.attention_forward_split(
                stream,
                &shape,
                &q_view,
                &k_view,
                &v_view,
                &mut out(&mut y, shape.out_len()),
                &mut out(&mut lse, shape.lse_len()),
            )
        })?;
        Ok((
            CudaStorage::wrap_cuda_slice(y, device.clone()),
            CudaStorage::wrap_cuda_slice(lse, device),
        ))
    })
}

pub(crate) fn attention_backward_split(
    [q, k, v]: [Arg; 3],
    out_arg: Arg,
    lse: &CudaStorage,
    grad: Arg,
    dims: &AttentionDims,
) -> Result<[CudaStorage; 3]> {
    const OP: &str = "causal_attention backward";
    let shape = attention_shape(dims);
    let device = q.0.device.clone();
    let lse = saved_lse(OP, lse, shape.lse_len())?;
    by_dtype!(q.0.dtype(), OP, |T| {
        let (q_view, k_view, v_view) = (
            view::<T>(OP, "q", q)?,
            view::<T>(OP, "k", k)?,
            view::<T>(OP, "v", v)?,
        );
        let output = view::<T>(OP, "the forward's output", out_arg)?;
        let grad = view::<T>(OP, "the output gradient", grad)?;
        let (q_len, kv_len) = (shape.q_len(), shape.kv_len());
        let mut dq = alloc_out::<T>(&device, q_len)?;
        let mut dk = alloc_out::<T>(&device, kv_len)?;
        let mut dv = alloc_out::<T>(&device, kv_len)?;
        launch_on(OP, q, |kernels, stream| {
            kernels.attention_backward_split(
                stream,
                &shape,
                [&q_view, &k_view, &v_view],
                &output,
                &lse,
                &grad,
                [
                    &mut out(&mut dq, q_len),
                    &mut out(&mut dk, kv_len),
                    &mut out(&mut dv, kv_len),
                ],
            )
        })?;
        Ok([dq, dk, dv].map(|g| CudaStorage::wrap_cuda_slice(g, device.clone())))
    })
}

/// The first `len` elements of a log-sum-exp the forward saved (outputs are
/// allocated with at least one element).
fn saved_lse<'a>(op: &str, lse: &'a CudaStorage, len: usize) -> Result<CudaView<'a, f32>> {
    let lse = lse.as_cuda_slice::<f32>()?;
    match lse.try_slice(..len) {
        Some(view) => Ok(view),
        None => bail!(
            "zero-candle {op}: the saved log-sum-exp has {} elements, expected {len}; was it \
             saved by this op's forward?",
            lse.len()
        ),
    }
}

fn normalization(remove_mean: bool) -> Normalization {
    if remove_mean {
        Normalization::Layer
    } else {
        Normalization::Rms
    }
}

/// The norm of `x`, scaled by `weight_offset + weight` (plus `bias`), in
/// one kernel.
pub(crate) fn norm_forward(
    x: Arg,
    weight: Arg,
    bias: Option<Arg>,
    eps: f64,
    remove_mean: bool,
    weight_offset: f64,
) -> Result<CudaStorage> {
    const OP: &str = "LayerNorm";
    let device = x.0.device.clone();
    by_dtype!(x.0.dtype(), OP, |T| {
        let input = view::<T>(OP, "the input", x)?;
        let weight = view::<T>(OP, "the weight", weight)?;
        let bias = bias.map(|b| view::<T>(OP, "the bias", b)).transpose()?;
        let len = input.len();
        let mut y = alloc_out::<T>(&device, len)?;
        launch_on(OP, x, |kernels, stream| {
            kernels.norm_forward(
                stream,
                normalization(remove_mean),
                eps as f32,
                weight_offset as f32,
                &input,
                &weight,
                bias.as_ref().map(|b| b as &dyn DevicePtr<T>),
                &mut out(&mut y, len),
            )
        })?;
        Ok(CudaStorage::wrap_cuda_slice(y, device))
    })
}

/// `(h, y)`: `h = x + residual` and `y` the norm of `h` (as
/// [`norm_forward`]), in one kernel.
pub(crate) fn residual_norm_forward(
    x: Arg,
    residual: Arg,
    weight: Arg,
    bias: Option<Arg>,
    eps: f64,
    remove_mean: bool,
    weight_offset: f64,
) -> Result<(CudaStorage, CudaStorage)> {
    const OP: &str = "LayerNorm after a residual add";
    let device = x.0.device.clone();
    by_dtype!(x.0.dtype(), OP, |T| {
        let input = view::<T>(OP, "the input", x)?;
        let residual = view::<T>(OP, "the residual", residual)?;
        let weight = view::<T>(OP, "the weight", weight)?;
        let bias = bias.map(|b| view::<T>(OP, "the bias", b)).transpose()?;
        let len = input.len();
        let mut h = alloc_out::<T>(&device, len)?;
        let mut y = alloc_out::<T>(&device, len)?;
        launch_on(OP, x, |kernels, stream| {
            kernels.residual_norm_forward(
                stream,
                normalization(remove_mean),
                eps as f32,
                weight_offset as f32,
                &input,
                &residual,
                &weight,
                bias.as_ref().map(|b| b as &dyn DevicePtr<T>),
                &mut out(&mut h, len),
                &mut out(&mut y, len),
            )
        })?;
        Ok((
            CudaStorage::wrap_cuda_slice(h, device.clone()),
            CudaStorage::wrap_cuda_slice(y, device),
        ))
    })
}

/// `(dx, dw, db)` of [`norm_forward`] (`dx` when `want_x`).
#[allow(clippy::type_complexity)]
pub(crate) fn norm_backward(
    x: Arg,
    weight: Arg,
    grad: Arg,
    eps: f64,
    remove_mean: bool,
    weight_offset: f64,
    want_x: bool,
) -> Result<(Option<CudaStorage>, CudaStorage, CudaStorage)> {
    const OP: &str = "LayerNorm backward";
    let device = x.0.device.clone();
    by_dtype!(x.0.dtype(), OP, |T| {
        let input = view::<T>(OP, "the input", x)?;
        let weight = view::<T>(OP, "the weight", weight)?;
        let grad = view::<T>(OP, "the output gradient", grad)?;
        let (len, n) = (input.len(), weight.len());
        let mut dx = if want_x {
            Some(alloc_out::<T>(&device, len)?)
        } else {
            None
        };
        let mut dw = alloc_out::<T>(&device, n)?;
        let mut db = alloc_out::<T>(&device, n)?;
        launch_on(OP, x, |kernels, stream| {
            let mut dx_view = dx.as_mut().map(|dx| out(dx, len));
            kernels.norm_backward(
                stream,
                normalization(remove_mean),
                eps as f32,
                weight_offset as f32,
                &input,
                &weight,
                &grad,
                dx_view.as_mut().map(|v| v as &mut dyn DevicePtrMut<T>),
                &mut out(&mut dw, n),
                &mut out(&mut db, n),
            )
        })?;
        Ok((
            dx.map(|dx| CudaStorage::wrap_cuda_slice(dx, device.clone())),
            CudaStorage::wrap_cuda_slice(dw, device.clone()),
            CudaStorage::wrap_cuda_slice(db, device),
        ))
    })
}

fn activation_kind(kind: Activation) -> ActivationKind {
    match kind {
        Activation::Gelu => ActivationKind::Gelu,
        Activation::GeluErf => ActivationKind::GeluErf,
        Activation::Silu => ActivationKind::Silu,
        Activation::Relu2 => ActivationKind::Relu2,
    }
}

pub(crate) fn activation_forward(kind: Activation, x: Arg) -> Result<CudaStorage> {
    const OP: &str = "activation";
    let device = x.0.device.clone();
    by_dtype!(x.0.dtype(), OP, |T| {
        let input = view::<T>(OP, "the input", x)?;
        let len = input.len();
        let mut y = alloc_out::<T>(&device, len)?;
        launch_on(OP, x, |kernels, stream| {
            kernels.activation_forward(stream, activation_kind(kind), &input, &mut out(&mut y, len))
        })?;
        Ok(CudaStorage::wrap_cuda_slice(y, device))
    })
}

pub(crate) fn activation_backward(kind: Activation, x: Arg, grad: Arg) -> Result<CudaStorage> {
    const OP: &str = "activation backward";
    let device = x.0.device.clone();
    by_dtype!(x.0.dtype(), OP, |T| {
        let input = view::<T>(OP, "the input", x)?;
        let grad = view::<T>(OP, "the output gradient", grad)?;
        let len = input.len();
        let mut dx = alloc_out::<T>(&device, len)?;
        launch_on(OP, x, |kernels, stream| {
            kernels.activation_backward(
                stream,
                activation_kind(kind),
                &input,
                &grad,
                &mut out(&mut dx, len),
            )
        })?;
        Ok(CudaStorage::wrap_cuda_slice(dx, device))
    })
}

/// A layer's backward with `kind` on its input `x`, one pass over `x`:
/// `grad` (contiguous, the gradient of `act(x)`) becomes `grad ⊙ act'(x)` in
/// place, and `act(x)` is returned, the values of [`activation_forward`]
/// and [`activation_backward`].
pub(crate) fn activation_recompute_backward(
    kind: Activation,
    x: Arg,
    grad: (&mut CudaStorage, &Layout),
) -> Result<CudaStorage> {
    const OP: &str = "activation recompute backward";
    let device = x.0.device.clone();
    by_dtype!(x.0.dtype(), OP, |T| {
        let input = view::<T>(OP, "the input", x)?;
        let len = input.len();
        // Its length against the input's: checked by the launch.
        let grad = &mut view_mut::<T>(OP, "the gradient", grad)?;
        let mut y = alloc_out::<T>(&device, len)?;
        launch_on(OP, x, |kernels, stream| {
            kernels.activation_recompute_backward(
                stream,
                activation_kind(kind),
                &input,
                grad,
                &mut out(&mut y, len),
            )
        })?;
        Ok(CudaStorage::wrap_cuda_slice(y, device))
    })
}

/// A Linear layer's epilogue after a plain GEMM, one pass: `pre` (its
/// contiguous `[rows, out]` product, a storage of its own) gets `bias` added
/// in place; with an activation, `act(pre)` is returned.
pub(crate) fn bias_epilogue(
    activation: Option<Activation>,
    pre: &mut CudaStorage,
    len: usize,
    bias: Arg,
) -> Result<Option<CudaStorage>> {
    const OP: &str = "Linear bias";
    let device = pre.device.clone();
    by_dtype!(pre.dtype(), OP, |T| {
        let bias = view::<T>(OP, "the bias", bias)?;
        let kernels = kernels(OP, &device)?;
        let stream = device.cuda_stream();
        let pre = &mut pre.as_cuda_slice_mut::<T>()?.slice_mut(..len);
        let launched = match activation {
            None => kernels.bias_add(&stream, pre, &bias).map(|()| None),
            Some(kind) => {
                let mut y = alloc_out::<T>(&device, len)?;
                let kind = activation_kind(kind);
                kernels
                    .bias_activation_forward(&stream, kind, pre, &bias, &mut out(&mut y, len))
                    .map(|()| Some(y))
            }
        };
        let y = launched.map_err(|e| kernel_error(OP, e))?;
        Ok(y.map(|y| CudaStorage::wrap_cuda_slice(y, device)))
    })
}

/// `Σ_rows grad` of a contiguous `[rows, n]` gradient (a Linear's bias
/// gradient), summed in f32 in a fixed order and rounded once.
pub(crate) fn column_sums(grad: Arg) -> Result<CudaStorage> {
    const OP: &str = "Linear bias gradient";
    let (rows, n) = grad.1.shape().dims2()?;
    let device = grad.0.device.clone();
    by_dtype!(grad.0.dtype(), OP, |T| {
        let values = view::<T>(OP, "the output gradient", grad)?;
        let mut sums = alloc_out::<T>(&device, n)?;
        launch_on(OP, grad, |kernels, stream| {
            kernels.column_sums(stream, rows, &values, &mut out(&mut sums, n))
        })?;
        Ok(CudaStorage::wrap_cuda_slice(sums, device))
    })
}

/// `act(gate) * up` (SwiGLU's gate for SiLU, GeGLU's for GELU).
pub(crate) fn gated_forward(kind: Activation, gate: Arg, up: Arg) -> Result<CudaStorage> {
    const OP: &str = "gated activation";
    let device = gate.0.device.clone();
    by_dtype!(gate.0.dtype(), OP, |T| {
        let gate_view = view::<T>(OP, "the gate", gate)?;
        let up = view::<T>(OP, "up", up)?;
        let len = gate_view.len();
        let mut y = alloc_out::<T>(&device, len)?;
        launch_on(OP, gate, |kernels, stream| {
            kernels.gated_forward(
                stream,
                activation_kind(kind),
                &gate_view,
                &up,
                &mut out(&mut y, len),
            )
        })?;
        Ok(CudaStorage::wrap_cuda_slice(y, device))
    })
}

/// `(dgate, dup)` of [`gated_forward`] for the output gradient `grad`.
pub(crate) fn gated_backward(
    kind: Activation,
    gate: Arg,
    up: Arg,
    grad: Arg,
) -> Result<(CudaStorage, CudaStorage)> {
    const OP: &str = "gated activation backward";
    let device = gate.0.device.clone();
    by_dtype!(gate.0.dtype(), OP, |T| {
        let gate_view = view::<T>(OP, "the gate", gate)?;
        let up = view::<T>(OP, "up", up)?;
        let grad = view::<T>(OP, "the output gradient", grad)?;
        let len = gate_view.len();
        let mut dgate = alloc_out::<T>(&device, len)?;
        let mut dup = alloc_out::<T>(&device, len)?;
        launch_on(OP, gate, |kernels, stream| {
            kernels.gated_backward(
                stream,
                activation_kind(kind),
                &gate_view,
                &up,
                &grad,
                &mut out(&mut dgate, len),
                &mut out(&mut dup, len),
            )
        })?;
        Ok((
            CudaStorage::wrap_cuda_slice(dgate, device.clone()),
            CudaStorage::wrap_cuda_slice(dup, device),
        ))
    })
}

/// `x` (the forward's input, or the backward's output gradient) rotated
/// by the tables' angles, or by their opposites.
pub(crate) fn rotary_embedding(
    x: Arg,
    cos: Arg,
    sin: Arg,
    dims: &RotaryDims,
    turn: Turn,
) -> Result<CudaStorage> {
    const OP: &str = "rotary_embedding";
    let shape = RotaryShape {
        batch: dims.batch,
        time: dims.time,
        heads: dims.heads,
        head_dim: dims.head_dim,
    };
    let turn = match turn {
        Turn::Forward => RotaryTurn::Forward,
        Turn::Backward => RotaryTurn::Backward,
    };
    let device = x.0.device.clone();
    by_dtype!(x.0.dtype(), OP, |T| {
        let input = view::<T>(OP, "x", x)?;
        let cos = view::<T>(OP, "cos", cos)?;
        let sin = view::<T>(OP, "sin", sin)?;
        let len = shape.x_len();
        let mut y = alloc_out::<T>(&device, len)?;
        launch_on(OP, x, |kernels, stream| {
            kernels.rotary_embedding(
                stream,
                &shape,
                turn,
                &input,
                &cos,
                &sin,
                &mut out(&mut y, len),
            )
        })?;
        Ok(CudaStorage::wrap_cuda_slice(y, device))
    })
}

/// The targets as a typed view: u32 or i64.
enum Targets<'a> {
    U32(CudaView<'a, u32>),
    I64(CudaView<'a, i64>),
}

fn targets_of<'a>(op: &str, targets: Arg<'a>) -> Result<Targets<'a>> {
    let (storage, layout) = targets;
    let Some((start, end)) = layout.contiguous_offsets() else {
        bail!("zero-candle {op}: the targets are not contiguous; call .contiguous() on them first")
    };
    Ok(match storage.dtype() {
        DType::U32 => Targets::U32(storage.as_cuda_slice::<u32>()?.slice(start..end)),
        DType::I64 => Targets::I64(storage.as_cuda_slice::<i64>()?.slice(start..end)),
        other => bail!(
            "zero-candle {op}: targets are {other:?}; use u32 or i64 class indices \
             (.to_dtype(DType::U32))"
        ),
    })
}

/// The forward's `saved` is f32 `[rows + 1]`: each row's log-sum-exp, then
/// the number of rows counted (target not the ignore index).
///
/// Unlike the CPU op, which refuses it, a target outside `[0, classes)` that
/// is not the ignore index cannot be reported without waiting for the GPU:
/// the kernels never read through it and make the loss NaN instead (and its
/// row's gradient NaN).
pub(crate) fn cross_entropy_forward(
    logits: Arg,
    targets: Arg,
    ignore_index: Option<i64>,
) -> Result<(CudaStorage, CudaStorage)> {
    const OP: &str = "cross_entropy";
    let device = logits.0.device.clone();
    let targets = targets_of(OP, targets)?;
    by_dtype!(logits.0.dtype(), OP, |T| {
        let input = view::<T>(OP, "the logits", logits)?;
        let rows = match &targets {
            Targets::U32(t) => t.len(),
            Targets::I64(t) => t.len(),
        };
        let mut loss = alloc_out::<f32>(&device, 1)?;
        let mut saved = alloc_out::<f32>(&device, rows + 1)?;
        launch_on(OP, logits, |kernels, stream| {
            let (loss, saved) = (&mut out(&mut loss, 1), &mut out(&mut saved, rows + 1));
            match &targets {
                Targets::U32(t) => {
                    kernels.cross_entropy_forward(stream, ignore_index, &input, t, loss, saved)
                }
                Targets::I64(t) => {
                    kernels.cross_entropy_forward(stream, ignore_index, &input, t, loss, saved)
                }
            }
        })?;
        Ok((
            CudaStorage::wrap_cuda_slice(loss, device.clone()),
            CudaStorage::wrap_cuda_slice(saved, device),
        ))
    })
}

pub(crate) fn cross_entropy_backward(
    logits: Arg,
    targets: Arg,
    saved: &CudaStorage,
    grad: Arg,
    ignore_index: Option<i64>,
) -> Result<CudaStorage> {
    const OP: &str = "cross_entropy backward";
    let device = logits.0.device.clone();
    let targets = targets_of(OP, targets)?;
    let saved = saved.as_cuda_slice::<f32>()?.slice(..);
    let grad = view::<f32>(OP, "the loss gradient", grad)?;
    by_dtype!(logits.0.dtype(), OP, |T| {
        let input = view::<T>(OP, "the logits", logits)?;
        let len = input.len();
        let mut dlogits = alloc_out::<T>(&device, len)?;
        launch_on(OP, logits, |kernels, stream| {
            let dlogits = &mut out(&mut dlogits, len);
            match &targets {
                Targets::U32(t) => kernels.cross_entropy_backward(
                    stream,
                    ignore_index,
                    &input,
                    t,
                    &saved,
                    &grad,
                    dlogits,
                ),
                Targets::I64(t) => kernels.cross_entropy_backward(
                    stream,
                    ignore_index,
                    &input,
                    t,
                    &saved,
                    &grad,
                    dlogits,
                ),
            }
        })?;
        Ok(CudaStorage::wrap_cuda_slice(dlogits, device))
    })
}

/// The gradient of an embedding lookup's `[vocab, dim]` table from the
/// lookup's ids (u32 or i64) and its output gradient `[ids, dim]`: each
/// id's rows summed in f32 in their order (see
/// [`LayerKernels::embedding_backward`]).
pub(crate) fn embedding_backward(
    ids: Arg,
    grad: Arg,
    (vocab, dim): (usize, usize),
) -> Result<CudaStorage> {
    const OP: &str = "Embedding backward";
    let device = grad.0.device.clone();
    let ids = targets_of(OP, ids)?;
    by_dtype!(grad.0.dtype(), OP, |T| {
        let grad_view = view::<T>(OP, "the output gradient", grad)?;
        let len = vocab * dim;
        let mut table = alloc_out::<T>(&device, len)?;
        launch_on(OP, grad, |kernels, stream| {
            let table = &mut out(&mut table, len);
            match &ids {
                Targets::U32(t) => kernels.embedding_backward(stream, vocab, t, &grad_view, table),
                Targets::I64(t) => kernels.embedding_backward(stream, vocab, t, &grad_view, table),
            }
        })?;
        Ok(CudaStorage::wrap_cuda_slice(table, device))
    })
}

/// Writes into `out` (`[ids, dim]`) the rows of the lookup `table[ids]`
/// that `part` holds: its elements `at` are elements `values` of the
/// row-major `[vocab, dim]` table (see [`LayerKernels::embedding_lookup`]).
/// Ids are u32 or i64; the rows of ids outside the vocabulary are NaN.
pub(crate) fn embedding_lookup(
    ids: Arg,
    (part, at): (&CudaStorage, std::ops::Range<usize>),
    values: std::ops::Range<usize>,
    table: (usize, usize),
    out: &mut CudaStorage,
) -> Result<()> {
    const OP: &str = "Embedding";
    let ids_view = targets_of(OP, ids)?;
    if part.dtype() != out.dtype() {
        bail!(
            "zero-candle {OP}: internal: a table part of {:?} looked up into rows of {:?}",
            part.dtype(),
            out.dtype()
        )
    }
    by_dtype!(out.dtype(), OP, |T| {
        let part = part.as_cuda_slice::<T>()?;
        if at.end > part.len() {
            bail!("zero-candle {OP}: internal: a gathered piece has no elements {at:?}")
        }
        let part = part.slice(at);
        let out = out.as_cuda_slice_mut::<T>()?;
        launch_on(OP, ids, |kernels, stream| match &ids_view {
            Targets::U32(t) => kernels.embedding_lookup(stream, table, t, &part, values, out),
            Targets::I64(t) => kernels.embedding_lookup(stream, table, t, &part, values, out),
        })
    })
}

mod gemm;
pub(crate) use gemm::{linear_forward, linear_param_grads};
