//! `LayerNorm` and `RmsNorm` with a real backward for their weight and bias,
//! and with the residual add before them fused in.
//!
//! candle-nn 0.11's contiguous fast paths run with `apply_op*_no_bwd`: their
//! output is not part of the graph, so neither the weight, the bias nor the
//! input get a gradient through them. Here the normalization is one custom
//! op over `(x, weight[, bias])` on the CPU and on CUDA, with a backward
//! that computes all three gradients in one pass over the rows (on CUDA: a
//! kernel for the input's gradient, then the weight and bias gradients
//! summed over chunks of rows and the chunks in a fixed order); on other
//! devices it is candle-nn's slow path in plain tensor ops, the parameters
//! [`tap`]ped.
//!
//! [`LayerNorm::forward_residual`] (and [`RmsNorm::forward_residual`]) is a
//! pre-norm block's `h = x + residual; y = norm(h)` in one pass over the
//! rows (one kernel on CUDA) that returns both. Candle's custom ops return
//! one tensor each, so the pass runs first and its two results leave
//! through two ops that hand them out: a sum over `(x, residual)` whose
//! backward is the add's (the gradient of `h`, from the norm and from `h`'s
//! other uses, to both), and the norm above over `(h, weight[, bias])`,
//! whose backward is unchanged. `h` is rounded to the input type before it
//! is normalized, as a separate add rounds it, so values and gradients are
//! the unfused pair's.
//!
//! [`LayerNorm::with_weight_offset`] scales by `offset + weight` instead of
//! `weight` (Gemma's RMSNorm, `x̂ · (1 + weight)`), the sum taken where the
//! statistics are, in f32 for 16-bit inputs.

use super::cpu;
use super::elem::{dispatch_float, Elem};
use super::grad_hook::{announce, before_read, check_holds_values, route, GradHook};
use super::ops::cuda;
use super::storage::{on_device, tensor_from, with_cuda, with_cuda_opt, OnDevice};
use super::tap::tap;
use candle_core::backend::BackendStorage;
use candle_core::{
    bail, CpuStorage, CudaStorage, CustomOp2, CustomOp3, DType, Device, Layout, Module, Result,
    Shape, Storage, Tensor, Var, D,
};
use candle_nn::{LayerNormConfig, VarBuilder};
use std::sync::{Arc, Mutex, PoisonError};

mod cpu_kernels;

use cpu_kernels::{norm_backward, norm_forward, residual_norm_forward};

/// Layer normalization over the last dimension, as `candle_nn::LayerNorm`:
/// `y = (x - mean) / √(var + eps) · weight + bias` (or, without
/// `remove_mean`, RMS normalization `y = x / √(mean(x²) + eps) · weight`).
/// With a [weight offset](LayerNorm::with_weight_offset) the scale is
/// `weight_offset + weight` instead of `weight`.
///
/// Statistics are accumulated in f32 for f16/bf16 inputs (and in the
/// input's own type for f32/f64), as candle-nn does.
#[derive(Clone)]
pub struct LayerNorm {
    weight: Tensor,
    bias: Option<Tensor>,
    remove_mean: bool,
    eps: f64,
    weight_offset: f64,
    hook: Option<Arc<dyn GradHook>>,
}

impl LayerNorm {
    /// A layer norm over existing tensors, as `candle_nn::LayerNorm::new`,
    /// plus the hook (`None`: gradients go to the `GradStore`).
    pub fn new(weight: Tensor, bias: Tensor, eps: f64, hook: Option<Arc<dyn GradHook>>) -> Self {
        announce(hook.as_ref(), &[Some(&weight), Some(&bias)]);
        Self {
            weight,
            bias: Some(bias),
            remove_mean: true,
            eps,
            weight_offset: 0.0,
            hook,
        }
    }

    /// A layer norm without bias, as `candle_nn::LayerNorm::new_no_bias`.
    pub fn new_no_bias(weight: Tensor, eps: f64, hook: Option<Arc<dyn GradHook>>) -> Self {
        announce(hook.as_ref(), &[Some(&weight)]);
        Self {
            weight,
            bias: None,
            remove_mean: true,
            eps,
            weight_offset: 0.0,
            hook,
        }
    }

    /// RMS normalization, as `candle_nn::LayerNorm::rms_norm`.
    pub fn rms_norm(weight: Tensor, eps: f64, hook: Option<Arc<dyn GradHook>>) -> Self {
        announce(hook.as_ref(), &[Some(&weight)]);
        Self {
            weight,
            bias: None,
            remove_mean: false,
            eps,
            weight_offset: 0.0,
            hook,
        }
    }

    /// The `[size]` weight.
    pub fn weight(&self) -> &Tensor {
        &self.weight
    }

    /// The `[size]` bias, if any.
    pub fn bias(&self) -> Option<&Tensor> {
        self.bias.as_ref()
    }

    /// The epsilon added to the variance.
    pub fn eps(&self) -> f64 {
        self.eps
    }

    /// Whether the mean is subtracted (false: RMS normalization).
    pub fn remove_mean(&self) -> bool {
        self.remove_mean
    }

    /// The layer with its output scaled by `offset + weight` instead of
    /// `weight`: `y = x̂ · (offset + weight) (+ bias)`, the sum taken in the
    /// statistics' precision (f32 for 16-bit inputs). Gemma's RMSNorm is
    /// `x̂ · (1 + weight)`, its checkpoints storing the weight centred on
    /// zero: load them unchanged with an offset of `1.0`. The weight's
    /// gradient is `Σ_rows g·x̂` whatever the offset; the input's sees the
    /// whole scale `offset + weight`. The default is `0.0`, the plain
    /// `x̂ · weight`.
    ///
    /// ```
    /// use candle_core::{DType, Device, Module, Tensor};
    /// use zero_candle::nn::RmsNorm;
    ///
    /// # fn main() -> candle_core::Result<()> {
    /// let zeros = Tensor::zeros(4, DType::F32, &Device::Cpu)?;
    /// let gemma = RmsNorm::new(zeros, 1e-6, None).with_weight_offset(1.0);
    /// let ones = RmsNorm::new(Tensor::ones(4, DType::F32, &Device::Cpu)?, 1e-6, None);
    /// let x = Tensor::randn(0f32, 1.0, (2, 4), &Device::Cpu)?;
    /// assert_eq!(gemma.forward(&x)?.to_vec2::<f32>()?, ones.forward(&x)?.to_vec2::<f32>()?);
    /// # Ok(())
    /// # }
    /// ```
    pub fn with_weight_offset(mut self, offset: f64) -> Self {
        self.weight_offset = offset;
        self
    }

    /// The offset added to the weight before it scales the output (`0.0`
    /// unless set with [`LayerNorm::with_weight_offset`]).
    pub fn weight_offset(&self) -> f64 {
        self.weight_offset
    }

    /// The scalars the kernels take, the offset as they add it: no offset
    /// as `-0.0`, since `w + -0.0` is `w` for every `w`, where `w + 0.0`
    /// would turn a weight of `-0.0` into `+0.0` (and the sign of a zero
    /// output with it).
    fn scalars(&self) -> NormScalars {
        NormScalars {
            eps: self.eps,
            remove_mean: self.remove_mean,
            weight_offset: if self.weight_offset == 0.0 {
                -0.0
            } else {
                self.weight_offset
            },
        }
    }

    /// The hook the layer's parameter gradients go to.
    pub fn hook(&self) -> Option<&Arc<dyn GradHook>> {
        self.hook.as_ref()
    }

    /// `(h, y)` with `h = x + residual` and `y` the norm of `h`, as
    /// `let h = (x + residual)?; let y = norm.forward(&h)?` computes them
    /// (the same values and gradients), in one pass over `x` and `residual`
    /// on the CPU and on CUDA. `x` and `residual` have one shape and dtype.
    ///
    /// ```
    /// use candle_core::{DType, Device, Module, Tensor};
    /// use zero_candle::nn::LayerNorm;
    ///
    /// # fn main() -> candle_core::Result<()> {
    /// let norm = LayerNorm::new_no_bias(Tensor::ones(4, DType::F32, &Device::Cpu)?, 1e-5, None);
    /// let x = Tensor::randn(0f32, 1.0, (2, 4), &Device::Cpu)?;
    /// let residual = Tensor::randn(0f32, 1.0, (2, 4), &Device::Cpu)?;
    /// let (h, y) = norm.forward_residual(&x, &residual)?;
    /// let unfused = (&x + &residual)?;
    /// assert_eq!(h.to_vec2::<f32>()?, unfused.to_vec2::<f32>()?);
    /// assert_eq!(y.to_vec2::<f32>()?, norm.forward(&unfused)?.to_vec2::<f32>()?);
    /// # Ok(())
    /// # }
    /// ```
    pub fn forward_residual(&self, x: &Tensor, residual: &Tensor) -> Result<(Tensor, Tensor)> {
        if !(x.device().is_cpu() || x.device().is_cuda()) {
            let h = (x + residual)?;
            let y = self.forward(&h)?;
            return Ok((h, y));
        }
        self.check_input(x)?;
        if residual.shape() != x.shape() || residual.dtype() != x.dtype() {
            bail!(
                "zero-candle LayerNorm::forward_residual: x is {:?} {:?} but the residual {:?} \
                 {:?}; pass two tensors of one shape and dtype (broadcast the residual first)",
                x.dims(),
                x.dtype(),
                residual.dims(),
                residual.dtype()
            )
        }
        let params = [Some(&self.weight), self.bias.as_ref()];
        before_read(self.hook.as_ref(), &params)?;
        check_holds_values(&params)?;
        let x = x.contiguous()?;
        let residual = residual.contiguous()?;
        let weight = self.weight.contiguous()?;
        let bias = self.bias.as_ref().map(|b| b.contiguous()).transpose()?;
        let (h, y) = self.sum_and_normalize(&x, &residual, &weight, bias.as_ref())?;
        let h = x.apply_op2(
            &residual,
            ResidualSum {
                sum: Mutex::new(Some(h)),
            },
        )?;
        let y = self.apply_norm(&h, &weight, bias.as_ref(), Some(y))?;
        Ok((h, y))
    }

    /// The fused pass of [`LayerNorm::forward_residual`] over contiguous
    /// tensors on the CPU or CUDA: the storages of `h` and `y`.
    fn sum_and_normalize(
        &self,
        x: &Tensor,
        residual: &Tensor,
        weight: &Tensor,
        bias: Option<&Tensor>,
    ) -> Result<(Storage, Storage)> {
        const X: &str = "the LayerNorm input";
        const RESIDUAL: &str = "the residual";
        const WEIGHT: &str = "the LayerNorm weight";
        const BIAS: &str = "the LayerNorm bias";
        let scalars = self.scalars();
        if x.device().is_cuda() {
            return with_cuda(x, X, |x_storage, x_layout| {
                with_cuda(residual, RESIDUAL, |r_storage, r_layout| {
                    with_cuda(weight, WEIGHT, |w_storage, w_layout| {
                        with_cuda_opt(bias, BIAS, |bias| {
                            let (h, y) = cuda::residual_norm_forward(
                                (x_storage, x_layout),
                                (r_storage, r_layout),
                                (w_storage, w_layout),
                                bias,
                                scalars.eps,
                                scalars.remove_mean,
                                scalars.weight_offset,
                            )?;
                            Ok((Storage::Cuda(h), Storage::Cuda(y)))
                        })
                    })
                })
            });
        }
        let (h, y) = dispatch_float!(x.dtype(), "LayerNorm", |T| {
            cpu::with_cpu(x, X, |x_storage, x_layout| {
                cpu::with_cpu(residual, RESIDUAL, |r_storage, r_layout| {
                    cpu::with_cpu(weight, WEIGHT, |w_storage, w_layout| {
                        cpu::with_cpu_opt(bias, BIAS, |bias| {
                            let bias = match bias {
                                Some((storage, layout)) => {
                                    Some(cpu::slice::<T>(storage, layout, BIAS)?)
                                }
                                None => None,
                            };
                            Ok(residual_norm_forward(
                                cpu::slice::<T>(x_storage, x_layout, X)?,
                                cpu::slice::<T>(r_storage, r_layout, RESIDUAL)?,
                                cpu::slice::<T>(w_storage, w_layout, WEIGHT)?,
                                bias,
                                scalars,
                            ))
                        })
                    })
                })
            })?
        });
        Ok((Storage::Cpu(h), Storage::Cpu(y)))
    }

    /// The norm op over contiguous `x`, `weight` (and `bias`), handing out
    /// `computed` as its output when given.
    fn apply_norm(
        &self,
        x: &Tensor,
        weight: &Tensor,
        bias: Option<&Tensor>,
        computed: Option<Storage>,
    ) -> Result<Tensor> {
        let op = FusedNorm {
            scalars: self.scalars(),
            hook: self.hook.clone(),
            computed: Mutex::new(computed),
        };
        match bias {
            Some(bias) => x.apply_op3(weight, bias, op),
            None => x.apply_op2(weight, op),
        }
    }

    /// Shapes and dtypes of the input against the parameters.
    fn check_input(&self, x: &Tensor) -> Result<()> {
        let size = x.dim(D::Minus1)?;
        let weight_ok = self.weight.dims() == [size];
        let bias_ok = self.bias.as_ref().is_none_or(|b| b.dims() == [size]);
        if !weight_ok || !bias_ok || size == 0 {
            bail!(
                "zero-candle LayerNorm: the input is {:?} but the weight is {:?} and the bias {:?}; \
                 the parameters must be [n] with n the input's last dimension, n > 0",
                x.dims(),
                self.weight.dims(),
                self.bias.as_ref().map(|b| b.dims())
            )
        }
        let dtypes_ok = self.weight.dtype() == x.dtype()
            && self.bias.as_ref().is_none_or(|b| b.dtype() == x.dtype());
        if !dtypes_ok {
            bail!(
                "zero-candle LayerNorm: the input is {:?} but the weight is {:?} and the bias {:?}; \
                 convert the input (or build the layer) so that all three share one dtype",
                x.dtype(),
                self.weight.dtype(),
                self.bias.as_ref().map(|b| b.dtype())
            )
        }
        Ok(())
    }

    /// Devices without the fused kernel: candle-nn's slow path, which has a
    /// backward through plain ops; a hook gets the parameters' gradients
    /// through [`tap`].
    fn forward_with_tensor_ops(&self, x: &Tensor) -> Result<Tensor> {
        let param = |t: &Tensor| -> Result<Tensor> {
            match &self.hook {
                Some(hook) if t.is_variable() => tap(&Var::from_tensor(t)?, Some(hook.clone())),
                _ => Ok(t.clone()),
            }
        };
        let weight = param(&self.weight)?;
        let bias = self.bias.as_ref().map(param).transpose()?;
        let x_dtype = x.dtype();
        let internal_dtype = match x_dtype {
            DType::F16 | DType::BF16 => DType::F32,
            dtype => dtype,
        };
        let size = x.dim(D::Minus1)?;
        let x = x.to_dtype(internal_dtype)?;
        let x = if self.remove_mean {
            let mean = (x.sum_keepdim(D::Minus1)? / size as f64)?;
            x.broadcast_sub(&mean)?
        } else {
            x
        };
        let variance = (x.sqr()?.sum_keepdim(D::Minus1)? / size as f64)?;
        let normed = x.broadcast_div(&(variance + self.eps)?.sqrt()?)?;
        let y = if self.weight_offset == 0.0 {
            normed.to_dtype(x_dtype)?.broadcast_mul(&weight)?
        } else {
            // The scale `offset + w` in the statistics' precision, as the
            // fused op takes it: a zero-centred 16-bit weight plus 1 rounded
            // to 16 bits would lose most of its bits.
            let scale = (weight.to_dtype(internal_dtype)? + self.weight_offset)?;
            normed.broadcast_mul(&scale)?.to_dtype(x_dtype)?
        };
        match bias {
            Some(bias) => y.broadcast_add(&bias),
            None => Ok(y),
        }
    }
}

impl std::fmt::Debug for LayerNorm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LayerNorm")
            .field("weight", &self.weight.shape())
            .field("bias", &self.bias.as_ref().map(|b| b.shape()))
            .field("remove_mean", &self.remove_mean)
            .field("eps", &self.eps)
            .field("weight_offset", &self.weight_offset)
            .field("hooked", &self.hook.is_some())
            .finish()
    }
}

impl Module for LayerNorm {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.check_input(x)?;
        let params = [Some(&self.weight), self.bias.as_ref()];
        before_read(self.hook.as_ref(), &params)?;
        check_holds_values(&params)?;
        if !(x.device().is_cpu() || x.device().is_cuda()) {
            return self.forward_with_tensor_ops(x);
        }
        // The kernels read rows directly; `contiguous` copies only when
        // needed, and Candle carries gradients back through that copy.
        let x = x.contiguous()?;
        let weight = self.weight.contiguous()?;
        let bias = self.bias.as_ref().map(|b| b.contiguous()).transpose()?;
        self.apply_norm(&x, &weight, bias.as_ref(), None)
    }
}

/// A layer norm created as `candle_nn::layer_norm` creates it (`weight`
/// ones and, when `config.affine`, `bias` zeros; `gamma`/`beta` names are
/// accepted as aliases). `config` is an `eps` or a `LayerNormConfig`.
pub fn layer_norm<C: Into<LayerNormConfig>>(
    size: usize,
    config: C,
    vb: VarBuilder,
    hook: Option<Arc<dyn GradHook>>,
) -> Result<LayerNorm> {
    let layer = candle_nn::layer_norm(size, config, vb)?;
    announce(hook.as_ref(), &[Some(layer.weight()), layer.bias()]);
    Ok(LayerNorm {
        weight: layer.weight().clone(),
        bias: layer.bias().cloned(),
        remove_mean: layer.remove_mean(),
        eps: layer.eps(),
        weight_offset: 0.0,
        hook,
    })
}

/// A layer norm without bias, as `candle_nn::layer_norm_no_bias`.
pub fn layer_norm_no_bias(
    size: usize,
    eps: f64,
    vb: VarBuilder,
    hook: Option<Arc<dyn GradHook>>,
) -> Result<LayerNorm> {
    let config = LayerNormConfig {
        eps,
        remove_mean: true,
        affine: false,
    };
    layer_norm(size, config, vb, hook)
}

/// RMS normalization over the last dimension, as `candle_nn::RmsNorm`:
/// `y = x / √(mean(x²) + eps) · weight`, for contiguous and strided inputs
/// alike, with a gradient for `weight`.
#[derive(Clone, Debug)]
pub struct RmsNorm(LayerNorm);

impl RmsNorm {
    /// RMS normalization with an existing weight, as `candle_nn::RmsNorm::new`.
    pub fn new(weight: Tensor, eps: f64, hook: Option<Arc<dyn GradHook>>) -> Self {
        Self(LayerNorm::rms_norm(weight, eps, hook))
    }

    /// The underlying [`LayerNorm`].
    pub fn into_inner(self) -> LayerNorm {
        self.0
    }

    /// The `[size]` weight.
    pub fn weight(&self) -> &Tensor {
        self.0.weight()
    }

    /// The epsilon added to the mean square.
    pub fn eps(&self) -> f64 {
        self.0.eps()
    }

    /// The norm with its output scaled by `offset + weight`: Gemma's
    /// `x̂ · (1 + weight)` with `offset = 1.0`, over the zero-centred weight
    /// its checkpoints store. See [`LayerNorm::with_weight_offset`].
    pub fn with_weight_offset(self, offset: f64) -> Self {
        Self(self.0.with_weight_offset(offset))
    }

    /// The offset added to the weight (`0.0` unless set).
    pub fn weight_offset(&self) -> f64 {
        self.0.weight_offset()
    }

    /// `(h, y)` with `h = x + residual` and `y` the RMS norm of `h`, in one
    /// pass: see [`LayerNorm::forward_residual`].
    pub fn forward_residual(&self, x: &Tensor, residual: &Tensor) -> Result<(Tensor, Tensor)> {
        self.0.forward_residual(x, residual)
    }
}

impl Module for RmsNorm {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.0.forward(x)
    }
}

/// RMS normalization created as `candle_nn::rms_norm` creates it (`weight`
/// ones).
pub fn rms_norm(
    size: usize,
    eps: f64,
    vb: VarBuilder,
    hook: Option<Arc<dyn GradHook>>,
) -> Result<RmsNorm> {
    let config = LayerNormConfig {
        eps,
        remove_mean: false,
        affine: false,
    };
    Ok(RmsNorm(layer_norm(size, config, vb, hook)?))
}

/// The op `(x [.., n], weight [n][, bias [n]])`, on the CPU and CUDA (other
/// devices never reach it: see [`LayerNorm::forward`]).
struct FusedNorm {
    scalars: NormScalars,
    hook: Option<Arc<dyn GradHook>>,
    /// The output when the fused pass of [`LayerNorm::forward_residual`]
    /// computed it before the op ran, taken by the forward.
    computed: Mutex<Option<Storage>>,
}

/// A norm's scalars, as its kernels take them.
#[derive(Clone, Copy, Debug)]
struct NormScalars {
    eps: f64,
    remove_mean: bool,
    /// Added to the weight: the output is `x̂ · (weight_offset + w) (+ b)`.
    weight_offset: f64,
}

/// The op `(x, residual) -> x + residual` of
/// [`LayerNorm::forward_residual`]: its forward hands out the sum the fused
/// pass computed, its backward is the add's.
struct ResidualSum {
    sum: Mutex<Option<Storage>>,
}

impl ResidualSum {
    fn take<S: OnDevice>(&self) -> Result<S> {
        const WHAT: &str = "the residual sum";
        let sum = self
            .sum
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        match sum {
            Some(sum) => on_device(sum, WHAT),
            None => bail!(
                "zero-candle LayerNorm::forward_residual: {WHAT} was handed out already; an op \
                 runs its forward once"
            ),
        }
    }
}

impl CustomOp2 for ResidualSum {
    fn name(&self) -> &'static str {
        "zero-residual-sum"
    }

    fn cpu_fwd(
        &self,
        _x: &CpuStorage,
        x_layout: &Layout,
        _residual: &CpuStorage,
        _residual_layout: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        Ok((self.take()?, x_layout.shape().clone()))
    }

    fn cuda_fwd(
        &self,
        _x: &CudaStorage,
        x_layout: &Layout,
        _residual: &CudaStorage,
        _residual_layout: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        Ok((self.take()?, x_layout.shape().clone()))
    }

    fn bwd(
        &self,
        x: &Tensor,
        residual: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        Ok((
            x.track_op().then(|| grad.clone()),
            residual.track_op().then(|| grad.clone()),
        ))
    }
}

impl FusedNorm {
    /// The output computed before the op ran, if any (taken: the op lives
    /// on in the graph until backward, the output's storage in `y`).
    fn computed<S: OnDevice>(&self) -> Result<Option<S>> {
        let computed = self
            .computed
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        computed
            .map(|y| on_device(y, "the norm of the residual sum"))
            .transpose()
    }

    fn op_name(&self) -> &'static str {
        if self.scalars.remove_mean {
            "zero-layer-norm"
        } else {
            "zero-rms-norm"
        }
    }

    fn forward(
        &self,
        x: (&CpuStorage, &Layout),
        weight: (&CpuStorage, &Layout),
        bias: Option<(&CpuStorage, &Layout)>,
    ) -> Result<(CpuStorage, Shape)> {
        let shape = x.1.shape().clone();
        if let Some(y) = self.computed()? {
            return Ok((y, shape));
        }
        let out = dispatch_float!(x.0.dtype(), "LayerNorm", |T| {
            self.forward_typed::<T>(x, weight, bias)?
        });
        Ok((out, shape))
    }

    fn forward_cuda(
        &self,
        x: (&CudaStorage, &Layout),
        weight: (&CudaStorage, &Layout),
        bias: Option<(&CudaStorage, &Layout)>,
    ) -> Result<(CudaStorage, Shape)> {
        let y = match self.computed()? {
            Some(y) => y,
            None => cuda::norm_forward(
                x,
                weight,
                bias,
                self.scalars.eps,
                self.scalars.remove_mean,
                self.scalars.weight_offset,
            )?,
        };
        Ok((y, x.1.shape().clone()))
    }

    fn forward_typed<T: Elem>(
        &self,
        x: (&CpuStorage, &Layout),
        weight: (&CpuStorage, &Layout),
        bias: Option<(&CpuStorage, &Layout)>,
    ) -> Result<CpuStorage> {
        let x = cpu::slice::<T>(x.0, x.1, "the LayerNorm input")?;
        let weight = cpu::slice::<T>(weight.0, weight.1, "the LayerNorm weight")?;
        let bias = match bias {
            Some((storage, layout)) => {
                Some(cpu::slice::<T>(storage, layout, "the LayerNorm bias")?)
            }
            None => None,
        };
        let y = norm_forward(x, weight, bias, self.scalars);
        Ok(T::to_cpu_storage_owned(y))
    }

    fn backward(
        &self,
        x: &Tensor,
        weight: &Tensor,
        bias: Option<&Tensor>,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let want = Wanted {
            x: x.track_op(),
            weight: weight.track_op(),
            bias: bias.is_some_and(|b| b.track_op()),
        };
        if !(want.x || want.weight || want.bias) {
            return Ok((None, None, None));
        }
        let grad = grad.contiguous()?;
        let grads = if x.device().is_cuda() {
            self.backward_cuda(x, weight, &grad, want)?
        } else {
            self.backward_cpu(x, weight, &grad, want)?
        };
        let hook = self.hook.as_ref();
        // Bias before weight: their order in `sorted_nodes`.
        let grad_bias = match (bias, grads.bias) {
            (Some(bias), Some(grad_bias)) => route(hook, bias, grad_bias)?,
            _ => None,
        };
        let grad_weight = match grads.weight {
            Some(grad_weight) => route(hook, weight, grad_weight)?,
            None => None,
        };
        Ok((grads.x, grad_weight, grad_bias))
    }

    fn backward_cpu(
        &self,
        x: &Tensor,
        weight: &Tensor,
        grad: &Tensor,
        want: Wanted,
    ) -> Result<NormGrads> {
        Ok(dispatch_float!(x.dtype(), "LayerNorm", |T| {
            self.backward_typed::<T>(x, weight, grad, want)?
        }))
    }

    /// The three gradients from the CUDA kernels (the weight's and bias's
    /// always computed: the same pass sums them).
    fn backward_cuda(
        &self,
        x: &Tensor,
        weight: &Tensor,
        grad: &Tensor,
        want: Wanted,
    ) -> Result<NormGrads> {
        let size = weight.elem_count();
        let (dx, dw, db) = with_cuda(x, "the LayerNorm input", |x_storage, x_layout| {
            with_cuda(weight, "the LayerNorm weight", |w_storage, w_layout| {
                with_cuda(
                    grad,
                    "the LayerNorm output gradient",
                    |g_storage, g_layout| {
                        cuda::norm_backward(
                            (x_storage, x_layout),
                            (w_storage, w_layout),
                            (g_storage, g_layout),
                            self.scalars.eps,
                            self.scalars.remove_mean,
                            self.scalars.weight_offset,
                            want.x,
                        )
                    },
                )
            })
        })?;
        let as_tensor = |s: CudaStorage, shape: Shape| tensor_from(Storage::Cuda(s), shape);
        Ok(NormGrads {
            x: match dx {
                Some(dx) if want.x => Some(as_tensor(dx, x.shape().clone())),
                _ => None,
            },
            weight: want.weight.then(|| as_tensor(dw, Shape::from(size))),
            bias: want.bias.then(|| as_tensor(db, Shape::from(size))),
        })
    }

    fn backward_typed<T: Elem>(
        &self,
        x: &Tensor,
        weight: &Tensor,
        grad: &Tensor,
        want: Wanted,
    ) -> Result<NormGrads> {
        let shape = x.shape().clone();
        let size = x.dim(D::Minus1)?;
        let (grad_x, grad_weight, grad_bias) =
            cpu::with_cpu(x, "the LayerNorm input", |x_storage, x_layout| {
                cpu::with_cpu(weight, "the LayerNorm weight", |w_storage, w_layout| {
                    cpu::with_cpu(
                        grad,
                        "the LayerNorm output gradient",
                        |g_storage, g_layout| {
                            Ok(norm_backward(
                                cpu::slice::<T>(x_storage, x_layout, "the LayerNorm input")?,
                                cpu::slice::<T>(w_storage, w_layout, "the LayerNorm weight")?,
                                cpu::slice::<T>(
                                    g_storage,
                                    g_layout,
                                    "the LayerNorm output gradient",
                                )?,
                                self.scalars,
                                want.x,
                            ))
                        },
                    )
                })
            })?;
        let from_acc = |v: Vec<T::Acc>| -> Vec<T> { v.into_iter().map(T::from_acc).collect() };
        Ok(NormGrads {
            x: match grad_x {
                Some(grad_x) if want.x => Some(Tensor::from_vec(grad_x, shape, &Device::Cpu)?),
                _ => None,
            },
            weight: if want.weight {
                Some(Tensor::from_vec(from_acc(grad_weight), size, &Device::Cpu)?)
            } else {
                None
            },
            bias: if want.bias {
                Some(Tensor::from_vec(from_acc(grad_bias), size, &Device::Cpu)?)
            } else {
                None
            },
        })
    }
}

/// Which of the op's arguments need a gradient.
#[derive(Clone, Copy)]
struct Wanted {
    x: bool,
    weight: bool,
    bias: bool,
}

struct NormGrads {
    x: Option<Tensor>,
    weight: Option<Tensor>,
    bias: Option<Tensor>,
}

impl CustomOp2 for FusedNorm {
    fn name(&self) -> &'static str {
        self.op_name()
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        x_layout: &Layout,
        weight: &CpuStorage,
        weight_layout: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        self.forward((x, x_layout), (weight, weight_layout), None)
    }

    fn cuda_fwd(
        &self,
        x: &CudaStorage,
        x_layout: &Layout,
        weight: &CudaStorage,
        weight_layout: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        self.forward_cuda((x, x_layout), (weight, weight_layout), None)
    }

    fn bwd(
        &self,
        x: &Tensor,
        weight: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let (grad_x, grad_weight, _) = self.backward(x, weight, None, grad)?;
        Ok((grad_x, grad_weight))
    }
}

impl CustomOp3 for FusedNorm {
    fn name(&self) -> &'static str {
        self.op_name()
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        x_layout: &Layout,
        weight: &CpuStorage,
        weight_layout: &Layout,
        bias: &CpuStorage,
        bias_layout: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        self.forward(
            (x, x_layout),
            (weight, weight_layout),
            Some((bias, bias_layout)),
        )
    }

    fn cuda_fwd(
        &self,
        x: &CudaStorage,
        x_layout: &Layout,
        weight: &CudaStorage,
        weight_layout: &Layout,
        bias: &CudaStorage,
        bias_layout: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        self.forward_cuda(
            (x, x_layout),
            (weight, weight_layout),
            Some((bias, bias_layout)),
        )
    }

    fn bwd(
        &self,
        x: &Tensor,
        weight: &Tensor,
        bias: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        self.backward(x, weight, Some(bias), grad)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The tensor-ops path (devices without the fused op) computes what the
    /// fused op does, with and without a weight offset; here it runs on the
    /// CPU. In bf16 both sum `offset + w` in f32.
    #[test]
    fn the_tensor_ops_path_takes_the_weight_offset() -> Result<()> {
        let cpu = &Device::Cpu;
        let x = (Tensor::arange(0f32, 24.0, cpu)? * 0.37)?
            .sin()?
            .reshape((3, 8))?;
        let weight = ((Tensor::arange(0f32, 8.0, cpu)? / 8.0)? - 0.5)?;
        let bias = (Tensor::arange(0f32, 8.0, cpu)? / 10.0)?;
        for (dtype, tol) in [(DType::F32, 1e-6), (DType::BF16, 1e-2)] {
            let (x, weight, bias) = (
                x.to_dtype(dtype)?,
                weight.to_dtype(dtype)?,
                bias.to_dtype(dtype)?,
            );
            for offset in [0.0, 1.0] {
                for norm in [
                    LayerNorm::rms_norm(weight.clone(), 1e-5, None),
                    LayerNorm::new(weight.clone(), bias.clone(), 1e-5, None),
                ] {
                    let norm = norm.with_weight_offset(offset);
                    let fused = norm.forward(&x)?.to_dtype(DType::F32)?;
                    let slow = norm.forward_with_tensor_ops(&x)?.to_dtype(DType::F32)?;
                    let diff = (fused - slow)?.abs()?.max_all()?.to_scalar::<f32>()?;
                    assert!(diff <= tol, "{norm:?} {dtype:?}: differ by {diff}");
                }
            }
        }
        Ok(())
    }
}
