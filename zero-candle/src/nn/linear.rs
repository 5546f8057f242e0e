//! `Linear`: `y = x·Wᵀ + b` as one custom op that reads `W` in place and
//! hands `∂W`, `∂b` to the hook.

use super::elem::{dispatch_float, Accum, Elem};
use super::grad_hook::{
    announce, announce_gather, assemble, before_read, gather, gemm_operand, route, route_blocks,
    GatheredParam, GradHook,
};
use super::ops::{activation_input_grad, cuda, recompute_with_input_grad, Activation, GemmOutput};
use super::storage::{on_device, owned_storage, tensor_from, with_cuda, OnDevice};
use super::{bf16_matmul, cpu};
use candle_core::backend::BackendStorage;
use candle_core::op::Add;
use candle_core::{
    bail, CpuStorage, CudaStorage, CustomOp2, CustomOp3, DType, Device, Layout, Module, Result,
    Shape, Storage, Tensor, WithDType,
};
use candle_nn::VarBuilder;
use std::sync::{Arc, Mutex, PoisonError};

mod cublaslt;
mod gathered;

pub use cublaslt::{linear_cublaslt, set_linear_cublaslt};
use gathered::{forward_in_pieces, grad_input_in_pieces, whole_on, MatmulGathered};

/// A linear layer, `y = x·Wᵀ + b`, with candle-nn's weight layout
/// (`weight` is `[out, in]`, `bias` is `[out]`).
///
/// The forward is one custom op over `(x, weight[, bias])`: the matmul reads
/// the weight's storage directly and the bias is added into the matmul's
/// output. Its backward computes `∂b = Σ g`, `∂W = gᵀ·x` (written straight
/// out as `[out, in]`, no zero-filled accumulator) and hands both to the
/// hook, then computes `∂x = g·W`. Inputs of any rank `[.., in]` are
/// flattened to `[rows, in]` (a copy only when `x` is not contiguous).
/// [`Linear::forward_activated`] applies an activation in the same op,
/// and [`Linear::forward_on_activated`] one to its input.
#[derive(Clone)]
pub struct Linear {
    weight: Tensor,
    bias: Option<Tensor>,
    hook: Option<Arc<dyn GradHook>>,
}

impl Linear {
    /// A layer over existing tensors, as `candle_nn::Linear::new`, plus the
    /// hook (`None`: gradients go to the `GradStore`). `weight` can be any
    /// `[out, in]` tensor, for instance an embedding table to tie.
    pub fn new(weight: Tensor, bias: Option<Tensor>, hook: Option<Arc<dyn GradHook>>) -> Self {
        announce(hook.as_ref(), &[Some(&weight), bias.as_ref()]);
        announce_gather(hook.as_ref(), &[Some(&weight), bias.as_ref()]);
        Self { weight, bias, hook }
    }

    /// The `[out, in]` weight.
    pub fn weight(&self) -> &Tensor {
        &self.weight
    }

    /// The `[out]` bias, if any.
    pub fn bias(&self) -> Option<&Tensor> {
        self.bias.as_ref()
    }

    /// The hook the layer's parameter gradients go to.
    pub fn hook(&self) -> Option<&Arc<dyn GradHook>> {
        self.hook.as_ref()
    }

    /// `act(x·Wᵀ + b)` as one op, the values and gradients of
    /// `ops::gelu(&layer.forward(x)?)` (and of `gelu_erf`, `silu`) without
    /// the pass between them: on the CPU the bias and the activation are
    /// one pass over the product; on CUDA with [`set_linear_cublaslt`] on,
    /// tanh-GELU runs in cuBLASLt's epilogue (`GELU_AUX_BIAS`). The op keeps
    /// the pre-activation `x·Wᵀ + b` for its backward (as the unfused pair
    /// keeps it as the activation's input), which computes
    /// `∂pre = g ⊙ act'(pre)` in one pass, then the layer's own backward on
    /// `∂pre`: the hook gets `∂W` and `∂b` as from [`Linear::forward`].
    ///
    /// ```
    /// # fn main() -> candle_core::Result<()> {
    /// use candle_core::{Device, Module, Tensor};
    /// use zero_candle::nn::{ops, Activation, Linear};
    ///
    /// let w = Tensor::new(&[[1f32, -2.0], [0.5, 1.0]], &Device::Cpu)?;
    /// let b = Tensor::new(&[0.1f32, -0.3], &Device::Cpu)?;
    /// let layer = Linear::new(w, Some(b), None);
    /// let x = Tensor::new(&[[0.3f32, 0.7]], &Device::Cpu)?;
    /// let fused = layer.forward_activated(&x, Activation::Gelu)?;
    /// let pair = ops::gelu(&layer.forward(&x)?)?;
    /// assert_eq!(fused.to_vec2::<f32>()?, pair.to_vec2::<f32>()?);
    /// # Ok(()) }
    /// ```
    pub fn forward_activated(&self, x: &Tensor, activation: Activation) -> Result<Tensor> {
        self.apply(x, Sides::output(activation))
    }

    /// `act(x)·Wᵀ + b` as one op, the values and gradients of
    /// `layer.forward(&ops::gelu(x)?)` (and of `gelu_erf`, `silu`), keeping
    /// `x` for the backward and never `act(x)`: the forward computes
    /// `act(x)` for its product and lets it go; the backward computes
    /// `g·W`, then `act(x)` again (for `∂W`) in the same pass over `x` as
    /// `∂x = (g·W) ⊙ act'(x)`. An MLP `fc` then `proj` written
    /// `proj.forward_on_activated(&fc.forward(x)?, act)` keeps one
    /// `[rows, hidden]` tensor per block where `fc.forward_activated`
    /// followed by `proj.forward` keeps two (llm.c's GELU recompute).
    ///
    /// ```
    /// # fn main() -> candle_core::Result<()> {
    /// use candle_core::{Device, Module, Tensor};
    /// use zero_candle::nn::{ops, Activation, Linear};
    ///
    /// let w = Tensor::new(&[[1f32, -2.0], [0.5, 1.0]], &Device::Cpu)?;
    /// let layer = Linear::new(w, None, None);
    /// let h = Tensor::new(&[[0.3f32, -0.7]], &Device::Cpu)?;
    /// let fused = layer.forward_on_activated(&h, Activation::Gelu)?;
    /// let pair = layer.forward(&ops::gelu(&h)?)?;
    /// assert_eq!(fused.to_vec2::<f32>()?, pair.to_vec2::<f32>()?);
    /// # Ok(()) }
    /// ```
    pub fn forward_on_activated(&self, x: &Tensor, activation: Activation) -> Result<Tensor> {
        self.apply(x, Sides::input(activation))
    }
}

/// The activations around one [`FusedLinear`]: on its input, on its
/// output.
#[derive(Clone, Copy, Default)]
struct Sides {
    input: Option<Activation>,
    output: Option<Activation>,
}

impl Sides {
    fn output(kind: Activation) -> Self {
        Self {
            output: Some(kind),
            ..Self::default()
        }
    }

    fn input(kind: Activation) -> Self {
        Self {
            input: Some(kind),
            ..Self::default()
        }
    }
}

impl std::fmt::Debug for Linear {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Linear")
            .field("weight", &self.weight.shape())
            .field("bias", &self.bias.as_ref().map(|b| b.shape()))
            .field("hooked", &self.hook.is_some())
            .finish()
    }
}

impl Module for Linear {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.apply(x, Sides::default())
    }
}

impl Linear {
    /// `act(x)·Wᵀ + b`, then its activation, each if any, as one op.
    fn apply(&self, x: &Tensor, sides: Sides) -> Result<Tensor> {
        let dims = x.dims();
        let Some((&in_dim, leading)) = dims.split_last() else {
            bail!(
                "zero-candle Linear: the input is a scalar; give it a last dimension of {} \
                 features",
                self.weight.dim(1)?
            )
        };
        // One 2-d matmul whatever the rank, as candle-nn does for contiguous
        // inputs; `reshape` copies a strided input first.
        let rows: usize = leading.iter().product();
        let x_rows = if dims.len() == 2 && x.is_contiguous() {
            x.clone()
        } else {
            x.reshape((rows, in_dim))?
        };
        // The product's input: `act(x)`, made here for the forward only
        // (the op keeps `x`).
        let product_input = sides
            .input
            .map(|kind| kind.apply(&x_rows.detach()))
            .transpose()?;
        // Stage 3: the weights the hook keeps sharded, gathered for this
        // forward only (the op gives them back as soon as it has run). A
        // weight gathered in pieces is computed with here, a piece at a
        // time, and the op hands out the result.
        let hook = self.hook.as_ref();
        before_read(hook, &[Some(&self.weight), self.bias.as_ref()])?;
        let weight = gather(hook, Some(&self.weight), 0)?;
        let bias = gather(hook, self.bias.as_ref(), 0)?;
        let in_pieces = |g: &Option<GatheredParam>| g.as_ref().is_some_and(|g| g.whole().is_none());
        let lent = if in_pieces(&weight) || in_pieces(&bias) {
            let x = product_input.clone().unwrap_or_else(|| x_rows.detach());
            let mut y = match weight {
                Some(first) if first.whole().is_none() => {
                    forward_in_pieces(hook, &self.weight, first, &x)?
                }
                whole => x.matmul(&assemble(hook, &self.weight, whole)?.t()?)?,
            };
            if let Some(b) = &self.bias {
                y = y.broadcast_add(&assemble(hook, b, bias)?)?;
            }
            Lent::output(&y)?
        } else {
            Lent {
                weight,
                bias,
                output: None,
            }
        };
        let op = FusedLinear {
            hook: self.hook.clone(),
            lent: Mutex::new(Some(lent)),
            input: sides.input.map(|kind| ActivatedInput {
                kind,
                values: Mutex::new(product_input),
            }),
            activated: sides.output.map(|kind| Activated {
                kind,
                pre: Mutex::new(None),
            }),
        };
        let y = match &self.bias {
            Some(bias) => x_rows.apply_op3(&self.weight, bias, op)?,
            None => x_rows.apply_op2(&self.weight, op)?,
        };
        if dims.len() == 2 {
            return Ok(y);
        }
        let mut out_dims = leading.to_vec();
        out_dims.push(y.dim(1)?);
        y.reshape(out_dims)
    }
}

/// A linear layer with a bias, created as `candle_nn::linear` creates it:
/// `weight` `[out_dim, in_dim]` (Kaiming normal) and `bias` `[out_dim]`
/// (uniform in `±1/√in_dim`).
pub fn linear(
    in_dim: usize,
    out_dim: usize,
    vb: VarBuilder,
    hook: Option<Arc<dyn GradHook>>,
) -> Result<Linear> {
    let layer = candle_nn::linear(in_dim, out_dim, vb)?;
    Ok(Linear::new(
        layer.weight().clone(),
        layer.bias().cloned(),
        hook,
    ))
}

/// A linear layer without bias, created as `candle_nn::linear_no_bias`.
pub fn linear_no_bias(
    in_dim: usize,
    out_dim: usize,
    vb: VarBuilder,
    hook: Option<Arc<dyn GradHook>>,
) -> Result<Linear> {
    let layer = candle_nn::linear_no_bias(in_dim, out_dim, vb)?;
    Ok(Linear::new(layer.weight().clone(), None, hook))
}

/// [`linear`] when `bias`, else [`linear_no_bias`], as `candle_nn::linear_b`.
pub fn linear_b(
    in_dim: usize,
    out_dim: usize,
    bias: bool,
    vb: VarBuilder,
    hook: Option<Arc<dyn GradHook>>,
) -> Result<Linear> {
    if bias {
        linear(in_dim, out_dim, vb, hook)
    } else {
        linear_no_bias(in_dim, out_dim, vb, hook)
    }
}

/// The op `(x [rows, in], W [out, in][, b [out]]) -> x·Wᵀ + b`, or its
/// activation.
struct FusedLinear {
    hook: Option<Arc<dyn GradHook>>,
    /// The forward's gathered weights (stage 3), taken and dropped by the
    /// forward: the op lives on in the graph until backward, they must not.
    lent: Mutex<Option<Lent>>,
    /// The activation applied to the input before the product, if any.
    input: Option<ActivatedInput>,
    /// The activation applied to `x·Wᵀ + b`, if any.
    activated: Option<Activated>,
}

/// An activation on the op's input `x`, and `act(x)` for the forward to
/// compute with, which takes it: the graph keeps `x` alone.
struct ActivatedInput {
    kind: Activation,
    values: Mutex<Option<Tensor>>,
}

/// An activation after the layer, and the pre-activation `x·Wᵀ + b` the
/// forward keeps for the backward (as long as the graph holds the op, as
/// the unfused pair's graph holds the activation's input).
struct Activated {
    kind: Activation,
    pre: Mutex<Option<Tensor>>,
}

impl Activated {
    fn keep(&self, pre: Tensor) {
        *self.pre.lock().unwrap_or_else(PoisonError::into_inner) = Some(pre);
    }

    /// `∂pre = grad ⊙ act'(pre)`, the gradient the layer's backward takes.
    fn pre_grad(&self, grad: &Tensor) -> Result<Tensor> {
        let pre = self
            .pre
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        match pre {
            Some(pre) => activation_input_grad(self.kind, &pre, grad),
            None => bail!(
                "zero-candle Linear: backward ran without its forward's pre-activation \
                 (internal: the activated forward did not run through this op)"
            ),
        }
    }
}

/// Gathered values of a layer's sharded parameters, or the output
/// computed from their pieces.
struct Lent {
    weight: Option<GatheredParam>,
    bias: Option<GatheredParam>,
    output: Option<Storage>,
}

impl Lent {
    /// The forward's result, computed before the op ran.
    fn output(y: &Tensor) -> Result<Self> {
        Ok(Self {
            weight: None,
            bias: None,
            output: Some(owned_storage(y, OUTPUT)?),
        })
    }
}

const OUTPUT: &str = "the Linear output";

impl FusedLinear {
    /// What the forward lent the op, or (`Err`) the result it computed
    /// from a weight's pieces before the op ran, on the op's device.
    fn lent<S: OnDevice>(
        &self,
        x_layout: &Layout,
        w_layout: &Layout,
    ) -> Result<std::result::Result<Lent, (S, Shape)>> {
        let mut lent = self.take_lent();
        match lent.output.take() {
            Some(output) => Ok(Err((
                on_device(output, OUTPUT)?,
                computed_shape(x_layout, w_layout)?,
            ))),
            None => Ok(Ok(lent)),
        }
    }

    fn take_lent(&self) -> Lent {
        self.lent
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take()
            .unwrap_or(Lent {
                weight: None,
                bias: None,
                output: None,
            })
    }
}

impl FusedLinear {
    /// `act(x)`, prepared for the forward, when the op has an input
    /// activation (taken: the op lives on in the graph, it must not).
    fn product_input(&self) -> Result<Option<Tensor>> {
        let Some(input) = &self.input else {
            return Ok(None);
        };
        match input
            .values
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take()
        {
            Some(values) => Ok(Some(values)),
            None => bail!(
                "zero-candle Linear: internal: the forward of an activated input ran twice, or \
                 without its activation"
            ),
        }
    }
}

/// Calls `f` with the storage and layout of `input` when given (the
/// activated input), else with `x`'s.
fn with_input<S: OnDevice, R>(
    input: Option<&Tensor>,
    x: (&S, &Layout),
    f: impl FnOnce(&S, &Layout) -> Result<R>,
) -> Result<R> {
    let Some(input) = input else {
        return f(x.0, x.1);
    };
    let (storage, layout) = input.storage_and_layout();
    match S::of(&storage) {
        Some(storage) => f(storage, layout),
        None => bail!("zero-candle Linear: internal: the activated input is on another device"),
    }
}

/// `x·Wᵀ` on the CPU (`x` the activated input when given): its product
/// and `(rows, out)`.
fn product_cpu(
    input: Option<&Tensor>,
    x: (&CpuStorage, &Layout),
    (w, w_layout): (&CpuStorage, &Layout),
) -> Result<(CpuStorage, usize, usize)> {
    with_input(input, x, |x, x_layout| {
        match bf16_matmul::xwt(x, x_layout, w, w_layout)? {
            Some(done) => Ok(done),
            None => matmul_xwt(x, x_layout, w, w_layout),
        }
    })
}

/// The storage to compute with: the gathered one when there is one.
fn pick<'a, S: OnDevice>(
    lent: &'a Option<GatheredParam>,
    own: (&'a S, &'a Layout),
) -> Result<(&'a S, &'a Layout)> {
    match lent {
        None => Ok(own),
        Some(gathered) => whole_on(gathered),
    }
}

/// `x·Wᵀ` on the storages, `W` read through a transposed layout (no copy);
/// returns the product and its `(rows, out)`.
fn matmul_xwt<S: BackendStorage>(
    x: &S,
    x_layout: &Layout,
    w: &S,
    w_layout: &Layout,
) -> Result<(S, usize, usize)> {
    let (rows, in_dim) = x_layout.shape().dims2()?;
    let (out_dim, w_in) = w_layout.shape().dims2()?;
    if in_dim != w_in {
        bail!(
            "zero-candle Linear: the input has {in_dim} features but the weight is \
             [{out_dim}, {w_in}] ([out, in]); build the layer with in_dim = {in_dim}"
        )
    }
    let product = x.matmul(
        w,
        (1, rows, out_dim, in_dim),
        x_layout,
        &w_layout.transpose(0, 1)?,
    )?;
    Ok((product, rows, out_dim))
}

/// The `[rows, out]` shape of the forward's result.
fn computed_shape(x_layout: &Layout, w_layout: &Layout) -> Result<Shape> {
    let (rows, _) = x_layout.shape().dims2()?;
    let (out_dim, _) = w_layout.shape().dims2()?;
    Ok(Shape::from((rows, out_dim)))
}

fn check_bias(bias_layout: &Layout, out_dim: usize) -> Result<()> {
    match bias_layout.shape().dims() {
        [n] if *n == out_dim => Ok(()),
        dims => bail!(
            "zero-candle Linear: the bias has shape {dims:?} but the weight has {out_dim} \
             outputs; give a bias of shape [{out_dim}]"
        ),
    }
}

/// Adds `bias` to every row of `out`, in place.
fn add_rows<T: WithDType>(out: &mut [T], bias: &[T]) {
    for row in out.chunks_exact_mut(bias.len()) {
        for (o, b) in row.iter_mut().zip(bias) {
            *o += *b;
        }
    }
}

impl FusedLinear {
    /// The CPU epilogue over `out`, the `[rows, out]` product: the bias
    /// (when it is not in `out` yet), then the activation; with an
    /// activation, one pass that leaves `out` the pre-activation, kept for
    /// the backward.
    fn finish_cpu(
        &self,
        mut out: CpuStorage,
        bias: Option<(&CpuStorage, &Layout)>,
        shape: Shape,
    ) -> Result<(CpuStorage, Shape)> {
        let Some(activated) = &self.activated else {
            if let Some((b, b_layout)) = bias {
                add_bias_cpu(&mut out, b, b_layout)?;
            }
            return Ok((out, shape));
        };
        let (y, pre) = dispatch_float!(out.dtype(), "Linear", |T| {
            let bias = bias
                .map(|(b, b_layout)| cpu::slice::<T>(b, b_layout, "the Linear bias"))
                .transpose()?;
            let mut pre = T::cpu_storage_data(out)?;
            let y = activated.kind.add_bias_and_apply(&mut pre, bias);
            (T::to_cpu_storage_owned(y), T::to_cpu_storage_owned(pre))
        });
        activated.keep(tensor_from(Storage::Cpu(pre), shape.clone()));
        Ok((y, shape))
    }

    /// The CUDA epilogue over `pre`, a `[rows, out]` result with its bias:
    /// the activation, if any, `pre` kept for the backward.
    fn finish_cuda(&self, pre: CudaStorage, shape: Shape) -> Result<(CudaStorage, Shape)> {
        let Some(activated) = &self.activated else {
            return Ok((pre, shape));
        };
        let y = cuda::activation_forward(activated.kind, (&pre, &Layout::contiguous(&shape)))?;
        activated.keep(tensor_from(Storage::Cuda(pre), shape.clone()));
        Ok((y, shape))
    }

    /// The forward on CUDA. With [`set_linear_cublaslt`] on: one cuBLASLt
    /// GEMM with the bias (and a tanh-GELU) in its epilogue where cuBLASLt
    /// takes the operands, then [`FusedLinear::finish_cuda`] for an
    /// activation the GEMM did not apply. Else Candle's GEMM, then the bias
    /// and the activation in one kernel (or the bias alone, in place).
    fn forward_cuda(
        &self,
        x: (&CudaStorage, &Layout),
        w: (&CudaStorage, &Layout),
        bias: Option<(&CudaStorage, &Layout)>,
    ) -> Result<(CudaStorage, Shape)> {
        let shape = computed_shape(x.1, w.1)?;
        if let Some(b) = bias {
            check_bias(b.1, w.1.shape().dims2()?.0)?;
        }
        let activation = self.activated.as_ref().map(|a| a.kind);
        let gemm = match linear_cublaslt() {
            true => cuda::linear_forward(x, w, bias, activation == Some(Activation::Gelu))?,
            false => None,
        };
        match gemm {
            Some(GemmOutput::Gelu { y, pre }) => {
                if let Some(activated) = &self.activated {
                    activated.keep(tensor_from(Storage::Cuda(pre), shape.clone()));
                }
                Ok((y, shape))
            }
            Some(GemmOutput::Product(pre)) => self.finish_cuda(pre, shape),
            // Candle's GEMM, then the bias (and the activation) in one pass
            // over its product, in place (Candle's broadcast add would index
            // every element through the shape, into a new buffer).
            None => match bias {
                Some(bias)
                    if bias.1.is_contiguous() && has_epilogue_kernel(bias.0.dtype(), &shape) =>
                {
                    let (mut pre, _, _) = matmul_xwt(x.0, x.1, w.0, w.1)?;
                    let y = cuda::bias_epilogue(activation, &mut pre, shape.elem_count(), bias)?;
                    match (y, &self.activated) {
                        (Some(y), Some(activated)) => {
                            activated.keep(tensor_from(Storage::Cuda(pre), shape.clone()));
                            Ok((y, shape))
                        }
                        _ => Ok((pre, shape)),
                    }
                }
                _ => {
                    let (pre, shape) = forward_generic(x, w, bias)?;
                    self.finish_cuda(pre, shape)
                }
            },
        }
    }
}

/// Whether the bias epilogue's kernels take a product of `dtype` and
/// `shape` (f32, bf16 or f16, not empty); else Candle's GEMM and
/// broadcast add, as for f64.
fn has_epilogue_kernel(dtype: DType, shape: &Shape) -> bool {
    matches!(dtype, DType::F32 | DType::BF16 | DType::F16) && shape.elem_count() > 0
}

fn add_bias_cpu(out: &mut CpuStorage, bias: &CpuStorage, bias_layout: &Layout) -> Result<()> {
    const WHAT: &str = "the Linear bias";
    match out {
        CpuStorage::F32(out) => add_rows(out, cpu::slice(bias, bias_layout, WHAT)?),
        CpuStorage::F64(out) => add_rows(out, cpu::slice(bias, bias_layout, WHAT)?),
        CpuStorage::BF16(out) => add_rows(out, cpu::slice(bias, bias_layout, WHAT)?),
        CpuStorage::F16(out) => add_rows(out, cpu::slice(bias, bias_layout, WHAT)?),
        other => bail!(
            "zero-candle Linear: dtype {:?} is not supported; use f32, f64, bf16 or f16",
            other.dtype()
        ),
    }
    Ok(())
}

/// The forward on any backend through its storage ops: the bias is added
/// by a broadcast add into a new buffer.
fn forward_generic<S: BackendStorage>(
    x: (&S, &Layout),
    w: (&S, &Layout),
    bias: Option<(&S, &Layout)>,
) -> Result<(S, Shape)> {
    let (product, rows, out_dim) = matmul_xwt(x.0, x.1, w.0, w.1)?;
    let out = match bias {
        Some((b, b_layout)) => {
            check_bias(b_layout, out_dim)?;
            product.binary_impl::<Add>(
                b,
                &Layout::contiguous((rows, out_dim)),
                &b_layout.broadcast_as((rows, out_dim))?,
            )?
        }
        None => product,
    };
    Ok((out, Shape::from((rows, out_dim))))
}

impl FusedLinear {
    /// The gradient of `x·Wᵀ + b` given the op's output gradient: itself,
    /// or through the activation.
    fn pre_grad(&self, grad: &Tensor) -> Result<Tensor> {
        match &self.activated {
            None => Ok(grad.clone()),
            Some(activated) => activated.pre_grad(grad),
        }
    }

    /// The gradients of `(x, W, b)` given the op's output gradient. With an
    /// input activation `act(x)` is computed again for the weight's
    /// gradient: where `x` wants a gradient, in the same pass over `x` as
    /// `∂x = ∂act(x) ⊙ act'(x)` (after the product's `∂act(x)`), as llm.c
    /// recomputes its GELU.
    fn backward(
        &self,
        x: &Tensor,
        w: &Tensor,
        b: Option<&Tensor>,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let grad = self.pre_grad(grad)?.contiguous()?;
        let Some(input) = &self.input else {
            return self.product_backward((x, x.track_op()), w, b, &grad);
        };
        if !(x.track_op() && w.track_op()) {
            // One of the two passes alone: no ∂x, or no ∂W to recompute for.
            let activated = input.kind.apply(&x.detach())?;
            let (grad_a, grad_w, grad_b) =
                self.product_backward((&activated, x.track_op()), w, b, &grad)?;
            drop(activated);
            let grad_x = grad_a
                .map(|g| activation_input_grad(input.kind, &x.detach(), &g))
                .transpose()?;
            return Ok((grad_x, grad_w, grad_b));
        }
        // The bias before the weight, as product_backward hands them over.
        let grad_b = self.bias_grad(b, &grad)?;
        let grad_a = self.input_grad(w, &grad)?;
        let (activated, grad_x) = recompute_with_input_grad(input.kind, &x.detach(), grad_a)?;
        let grad_w = self.weight_grad(w, &activated, &grad)?;
        Ok((Some(grad_x), grad_w, grad_b))
    }

    /// The gradients of `(x, W, b)` for `x·Wᵀ + b` given its contiguous
    /// output gradient; `∂x` only when `wants_x`.
    fn product_backward(
        &self,
        (x, wants_x): (&Tensor, bool),
        w: &Tensor,
        b: Option<&Tensor>,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        // Parameters first, bias before weight (their order in
        // `sorted_nodes`), so the hook can move them while ∂x is computed.
        // Arguments that need no gradient (untracked input, frozen weight)
        // cost nothing.
        let (grad_b, grad_w) = match self.param_grads_in_one_gemm(x, w, b, grad)? {
            Some(grads) => grads,
            None => (self.bias_grad(b, grad)?, self.weight_grad(w, x, grad)?),
        };
        let grad_x = match wants_x {
            true => Some(self.input_grad(w, grad)?),
            false => None,
        };
        Ok((grad_x, grad_w, grad_b))
    }

    /// `(∂b, ∂W)` from one cuBLASLt GEMM, the bias gradient in its
    /// epilogue, handed to the hook bias first as [`Self::bias_grad`] and
    /// [`Self::weight_grad`] hand them: on CUDA with [`set_linear_cublaslt`]
    /// on, for a tracked weight and bias whose hook (if any) takes whole
    /// gradients. `None` otherwise, or where cuBLASLt does not take the
    /// operands: the caller computes the two apart.
    fn param_grads_in_one_gemm(
        &self,
        x: &Tensor,
        w: &Tensor,
        b: Option<&Tensor>,
        grad: &Tensor,
    ) -> Result<Option<(Option<Tensor>, Option<Tensor>)>> {
        let hook = self.hook.as_ref();
        let Some(b) = b.filter(|b| b.track_op() && w.track_op()) else {
            return Ok(None);
        };
        let whole = hook.is_none_or(|hook| hook.block_bytes().is_none());
        if !(whole && grad.device().is_cuda() && linear_cublaslt()) {
            return Ok(None);
        }
        let grads = with_cuda(grad, "the Linear output gradient", |g, g_layout| {
            with_cuda(x, "the Linear input", |x, x_layout| {
                cuda::linear_param_grads((g, g_layout), (x, x_layout))
            })
        })?;
        let Some((grad_w, grad_b)) = grads else {
            return Ok(None);
        };
        let (out_dim, in_dim) = w.dims2()?;
        let grad_b = route(hook, b, tensor_from(Storage::Cuda(grad_b), out_dim))?;
        let grad_w = route(
            hook,
            w,
            tensor_from(Storage::Cuda(grad_w), (out_dim, in_dim)),
        )?;
        Ok(Some((grad_b, grad_w)))
    }

    /// The bias's gradient (the output gradient's column sums), handed to
    /// the hook; `None` without a tracked bias or once the hook took it.
    fn bias_grad(&self, b: Option<&Tensor>, grad: &Tensor) -> Result<Option<Tensor>> {
        match b {
            Some(b) if b.track_op() => route(self.hook.as_ref(), b, column_sums(grad)?),
            _ => Ok(None),
        }
    }

    /// `∂W = gradᵀ·x`, handed to the hook a block of rows at a time where
    /// it takes blocks: the whole gradient (as large as the weight) never
    /// exists. `None` for a frozen weight or once the hook took it.
    fn weight_grad(&self, w: &Tensor, x: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        if !w.track_op() {
            return Ok(None);
        }
        let (out_dim, in_dim) = w.dims2()?;
        let size = w.dtype().size_in_bytes();
        route_blocks(
            self.hook.as_ref(),
            w,
            |bytes| bf16_matmul::row_blocks(out_dim, in_dim, size, bytes),
            |rows| match bf16_matmul::grad_weight(grad, x, rows.clone())? {
                Some(grad_w) => Ok(grad_w),
                None => gemm_operand(grad.narrow(1, rows.start, rows.len())?)?
                    .t()?
                    .matmul(&x.detach()),
            },
        )
    }

    /// `∂x = grad·W`. Stage 3 gathers the weight again for it and gives it
    /// back at once.
    fn input_grad(&self, w: &Tensor, grad: &Tensor) -> Result<Tensor> {
        let hook = self.hook.as_ref();
        match gather(hook, Some(w), 0)? {
            Some(gathered) if gathered.whole().is_some() => {
                grad.apply_op1_no_bwd(&MatmulGathered(gathered))
            }
            Some(first) => grad_input_in_pieces(hook, w, first, grad),
            None => match bf16_matmul::grad_input(grad, w)? {
                Some(grad_x) => Ok(grad_x),
                None => grad.matmul(&w.detach()),
            },
        }
    }
}

impl CustomOp2 for FusedLinear {
    fn name(&self) -> &'static str {
        "zero-linear"
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        x_layout: &Layout,
        w: &CpuStorage,
        w_layout: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let input = self.product_input()?;
        let lent = match self.lent(x_layout, w_layout)? {
            Ok(lent) => lent,
            Err((pre, shape)) => return self.finish_cpu(pre, None, shape),
        };
        let (w, w_layout) = pick(&lent.weight, (w, w_layout))?;
        let (product, rows, out_dim) = product_cpu(input.as_ref(), (x, x_layout), (w, w_layout))?;
        self.finish_cpu(product, None, Shape::from((rows, out_dim)))
    }

    fn cuda_fwd(
        &self,
        x: &CudaStorage,
        x_layout: &Layout,
        w: &CudaStorage,
        w_layout: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        let input = self.product_input()?;
        let lent = match self.lent(x_layout, w_layout)? {
            Ok(lent) => lent,
            Err((pre, shape)) => return self.finish_cuda(pre, shape),
        };
        let w = pick(&lent.weight, (w, w_layout))?;
        with_input(input.as_ref(), (x, x_layout), |x, x_layout| {
            self.forward_cuda((x, x_layout), w, None)
        })
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let (grad_x, grad_w, _) = self.backward(x, w, None, grad)?;
        Ok((grad_x, grad_w))
    }
}

impl CustomOp3 for FusedLinear {
    fn name(&self) -> &'static str {
        "zero-linear"
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        x_layout: &Layout,
        w: &CpuStorage,
        w_layout: &Layout,
        b: &CpuStorage,
        b_layout: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let input = self.product_input()?;
        let lent = match self.lent(x_layout, w_layout)? {
            Ok(lent) => lent,
            Err((pre, shape)) => return self.finish_cpu(pre, None, shape),
        };
        let (w, w_layout) = pick(&lent.weight, (w, w_layout))?;
        let (b, b_layout) = pick(&lent.bias, (b, b_layout))?;
        let (out, rows, out_dim) = product_cpu(input.as_ref(), (x, x_layout), (w, w_layout))?;
        check_bias(b_layout, out_dim)?;
        if b.dtype() != out.dtype() {
            bail!(
                "zero-candle Linear: the bias is {:?} but the weight is {:?}; give both one dtype",
                b.dtype(),
                out.dtype()
            )
        }
        self.finish_cpu(out, Some((b, b_layout)), Shape::from((rows, out_dim)))
    }

    fn cuda_fwd(
        &self,
        x: &CudaStorage,
        x_layout: &Layout,
        w: &CudaStorage,
        w_layout: &Layout,
        b: &CudaStorage,
        b_layout: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        let input = self.product_input()?;
        let lent = match self.lent(x_layout, w_layout)? {
            Ok(lent) => lent,
            Err((pre, shape)) => return self.finish_cuda(pre, shape),
        };
        let w = pick(&lent.weight, (w, w_layout))?;
        let b = pick(&lent.bias, (b, b_layout))?;
        with_input(input.as_ref(), (x, x_layout), |x, x_layout| {
            self.forward_cuda((x, x_layout), w, Some(b))
        })
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        b: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        self.backward(x, w, Some(b), grad)
    }
}

/// `Σ_rows grad` of a `[rows, out]` gradient: the bias gradient. On the
/// CPU one pass adding row after row (vectorized, in f32 for 16-bit types:
/// Candle's `sum(0)` walks the columns with a stride and adds in the
/// element type); on CUDA in f32, bf16 and f16 zero-nccl's column sums (a
/// warp reads adjacent columns, f32 sums in a fixed order, rounded once);
/// elsewhere, f64 on CUDA included, Candle's `sum(0)`.
fn column_sums(grad: &Tensor) -> Result<Tensor> {
    const WHAT: &str = "the Linear output gradient";
    let (_, out) = grad.dims2()?;
    match grad.device() {
        Device::Cpu => {
            let sums = cpu::with_cpu(grad, WHAT, |storage, layout| {
                Ok(dispatch_float!(storage.dtype(), "Linear", |T| {
                    let values = cpu::slice::<T>(storage, layout, WHAT)?;
                    let mut sums = vec![<T as Elem>::Acc::ZERO; out];
                    for row in values.chunks_exact(out.max(1)) {
                        for (s, &v) in sums.iter_mut().zip(row) {
                            *s += v.acc();
                        }
                    }
                    T::to_cpu_storage_owned(sums.into_iter().map(T::from_acc).collect())
                }))
            })?;
            Ok(tensor_from(Storage::Cpu(sums), out))
        }
        Device::Cuda(_) if matches!(grad.dtype(), DType::F32 | DType::BF16 | DType::F16) => {
            let sums = with_cuda(grad, WHAT, |storage, layout| {
                cuda::column_sums((storage, layout))
            })?;
            Ok(tensor_from(Storage::Cuda(sums), out))
        }
        _ => grad.sum(0),
    }
}
