//! The Linear layers' GEMMs through cuBLASLt ([`Gemm`]): the forward with
//! the bias (and a tanh-GELU) in its epilogue, the weight gradient with the
//! bias gradient in its.

use super::{alloc_out, cached, out, view, Arg, Cache};
use crate::nn::ops::GemmOutput;
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::CudaDevice;
use candle_core::{bail, CudaStorage, DType, Result};
use std::collections::HashMap;
use std::sync::{Arc, OnceLock};
use zero_nccl::kernels::gemm::{Gemm, GemmCompute, LinearGemm};

/// The cuBLASLt GEMM of `device`'s stream, made on first use (a handle and
/// its 32 MiB workspace per stream). CUDA's per-thread default stream
/// (`Device::new_cuda`) is another stream on every thread, with one handle:
/// its GEMMs are kept per thread (two threads' GEMMs sharing one workspace
/// would write over each other) and go with the thread.
fn gemm(device: &CudaDevice) -> Result<Arc<Gemm>> {
    static CACHE: Cache<Gemm> = OnceLock::new();
    thread_local! {
        static PER_THREAD: std::cell::RefCell<HashMap<usize, Arc<Gemm>>> =
            Default::default();
    }
    let stream = device.cuda_stream();
    let make = || Gemm::new(stream.clone()).map_err(linear_error);
    if zero_nccl::is_per_thread_stream(&stream) {
        let ctx = stream.context().cu_ctx() as usize;
        return PER_THREAD.with(|cache| {
            if let Some(gemm) = cache.borrow().get(&ctx) {
                return Ok(gemm.clone());
            }
            let gemm = Arc::new(make()?);
            cache.borrow_mut().insert(ctx, gemm.clone());
            Ok(gemm)
        });
    }
    // The entry holds an Arc of the stream: its handle stays unique.
    cached(&CACHE, stream.cu_stream() as usize, make)
}

/// A failure of the cuBLASLt path as Candle's error, with the way back.
fn linear_error(e: zero_nccl::Error) -> candle_core::Error {
    candle_core::Error::Msg(format!(
        "zero-candle Linear on CUDA through cuBLASLt: {e}; ZERO_LINEAR_CUBLASLT=0 in the \
         environment (or zero_candle::nn::set_linear_cublaslt(false)) keeps Candle's GEMMs"
    ))
}

/// How a GEMM of `dtype` accumulates, as Candle's own for that dtype
/// (its `set_gemm_reduced_precision_*` switches); `None` where cuBLASLt's
/// path would differ (f16 with f16 accumulation) or there is none.
fn gemm_compute(dtype: DType) -> Option<GemmCompute> {
    use candle_core::cuda::{
        gemm_reduced_precision_bf16, gemm_reduced_precision_f16, gemm_reduced_precision_f32,
    };
    match dtype {
        DType::F32 if gemm_reduced_precision_f32() => Some(GemmCompute::Tf32),
        DType::BF16 if gemm_reduced_precision_bf16() => Some(GemmCompute::Bf16),
        DType::F16 if gemm_reduced_precision_f16() => None,
        DType::F32 | DType::BF16 | DType::F16 => Some(GemmCompute::F32),
        _ => None,
    }
}

/// A Linear layer's forward `x·Wᵀ (+ bias)` as one cuBLASLt GEMM, the bias
/// added in its epilogue (`x [rows, in]`, `W [out, in]`, `bias [out]`);
/// with `gelu`, also the tanh-GELU (`GELU_AUX_BIAS`: `y` the GELU, the aux
/// output the pre-activation) where cuBLASLt's aux matrix can take the
/// shape, else the product alone for the caller to activate. `None` where
/// cuBLASLt does not take it (operands not contiguous or of mixed dtypes, a
/// shape or alignment it has no algorithm for): the caller keeps Candle's
/// GEMM and add.
pub(crate) fn linear_forward(
    x: Arg,
    w: Arg,
    bias: Option<Arg>,
    gelu: bool,
) -> Result<Option<GemmOutput>> {
    const OP: &str = "Linear";
    let (Ok((rows, in_dim)), Ok((out_dim, w_in))) = (x.1.shape().dims2(), w.1.shape().dims2())
    else {
        return Ok(None);
    };
    let dtype = x.0.dtype();
    let plain = |arg: Arg| arg.1.is_contiguous() && arg.0.dtype() == dtype;
    let usable = w_in == in_dim && plain(x) && plain(w) && bias.is_none_or(plain);
    let (Some(plain_plan), Some(compute), true) = (
        LinearGemm::new(rows, in_dim, out_dim),
        gemm_compute(dtype),
        usable,
    ) else {
        return Ok(None);
    };
    let gelu_plan = if gelu {
        plain_plan.with_gelu_aux()
    } else {
        None
    };
    let device = x.0.device.clone();
    let gemm = gemm(&device)?;
    by_dtype!(dtype, OP, |T| {
        let input = view::<T>(OP, "the input", x)?;
        let weight = view::<T>(OP, "the weight", w)?;
        let bias = bias.map(|b| view::<T>(OP, "the bias", b)).transpose()?;
        let len = rows * out_dim;
        let mut y = alloc_out::<T>(&device, len)?;
        let wrap = |slice| CudaStorage::wrap_cuda_slice(slice, device.clone());
        if let Some(plan) = gelu_plan {
            let mut pre = alloc_out::<T>(&device, len)?;
            let done = gemm
                .linear(
                    &plan,
                    compute,
                    &input,
                    &weight,
                    bias.as_ref(),
                    &mut out(&mut y, len),
                    Some(&mut out(&mut pre, len)),
                )
                .map_err(linear_error)?;
            if done {
                return Ok(Some(GemmOutput::Gelu {
                    y: wrap(y),
                    pre: wrap(pre),
                }));
            }
        }
        let done = gemm
            .linear(
                &plain_plan,
                compute,
                &input,
                &weight,
                bias.as_ref(),
                &mut out(&mut y, len),
                None,
            )
            .map_err(linear_error)?;
        Ok(done.then(|| GemmOutput::Product(wrap(y))))
    })
}

/// A Linear layer's weight and bias gradients, `(∂W [out, in], ∂b [out])`,
/// from its output gradient `grad [rows, out]` and input `x [rows, in]` in
/// one cuBLASLt GEMM, the bias gradient in its epilogue (`BGRADB`). `None`
/// where cuBLASLt does not take them (operands not contiguous or of mixed
/// dtypes, no algorithm for the shape): the caller computes both apart.
pub(crate) fn linear_param_grads(grad: Arg, x: Arg) -> Result<Option<(CudaStorage, CudaStorage)>> {
    const OP: &str = "Linear weight gradient";
    let (Ok((rows, out_dim)), Ok((x_rows, in_dim))) = (grad.1.shape().dims2(), x.1.shape().dims2())
    else {
        return Ok(None);
    };
    let dtype = grad.0.dtype();
    let plain = |arg: Arg| arg.1.is_contiguous() && arg.0.dtype() == dtype;
    let (Some(plan), Some(compute), true) = (
        LinearGemm::weight_grad(rows, in_dim, out_dim),
        gemm_compute(dtype),
        x_rows == rows && plain(grad) && plain(x),
    ) else {
        return Ok(None);
    };
    let device = grad.0.device.clone();
    let gemm = gemm(&device)?;
    by_dtype!(dtype, OP, |T| {
        let g = view::<T>(OP, "the output gradient", grad)?;
        let input = view::<T>(OP, "the input", x)?;
        let (w_len, b_len) = (out_dim * in_dim, out_dim);
        let mut grad_w = alloc_out::<T>(&device, w_len)?;
        let mut grad_b = alloc_out::<T>(&device, b_len)?;
        let done = gemm
            .weight_grad(
                &plan,
                compute,
                &input,
                &g,
                &mut out(&mut grad_w, w_len),
                &mut out(&mut grad_b, b_len),
            )
            .map_err(linear_error)?;
        let wrap = |slice| CudaStorage::wrap_cuda_slice(slice, device.clone());
        Ok(done.then(|| (wrap(grad_w), wrap(grad_b))))
    })
}
