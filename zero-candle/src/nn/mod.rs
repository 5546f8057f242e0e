//! ZeRO-aware layers: candle-nn's layers whose parameter gradients leave
//! Candle's backward pass the moment each is computed.
//!
//! A model written with candle-nn moves over by changing its imports and
//! giving each constructor one more argument, the hook:
//!
//! ```
//! use std::sync::Arc;
//! use candle_core::{DType, Device, Module, Tensor};
//! use candle_nn::{VarBuilder, VarMap};
//! use zero_candle::nn::{self, GradCollector, GradHook};
//!
//! # fn main() -> candle_core::Result<()> {
//! let varmap = VarMap::new();
//! let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
//! let collector = Arc::new(GradCollector::new());
//! let hook: Option<Arc<dyn GradHook>> = Some(collector.clone());
//! let fc1 = nn::linear(8, 16, vb.pp("fc1"), hook.clone())?;
//! let norm = nn::layer_norm(16, 1e-5, vb.pp("norm"), hook.clone())?;
//! let fc2 = nn::linear_no_bias(16, 4, vb.pp("fc2"), hook.clone())?;
//!
//! let x = Tensor::randn(0f32, 1.0, (2, 8), &Device::Cpu)?;
//! let loss = fc2.forward(&norm.forward(&fc1.forward(&x)?.relu()?)?)?.sqr()?.mean_all()?;
//! let mut grads = loss.backward()?; // no parameter gradient in here
//! collector.merge_into(&mut grads)?; // now all five are
//! # assert_eq!(grads.get_ids().count(), 5);
//! # Ok(())
//! # }
//! ```
//!
//! # The hook
//! Every constructor takes `hook: Option<Arc<dyn GradHook>>`.
//! - **`Some(hook)`**: during `loss.backward()` the layer's backward calls
//!   [`GradHook::grad_ready`] with each parameter variable and its gradient,
//!   and returns `None` to Candle for it, so **the parameter gradients are
//!   not in the `GradStore` that `backward()` returns**. The engine's hook
//!   launches bucket reductions from there; [`GradCollector`] just keeps
//!   them, for `ZeroOptimizer::step(&GradStore)` after backward. Only
//!   variables go to the hook: a parameter that is a view of a variable, or
//!   a tracked tensor, gets its gradient through Candle as usual.
//! - **`None`**: the layer behaves like candle-nn's: every gradient goes to
//!   the `GradStore`.
//!
//! A hooked parameter's gradient is complete when its call comes (Candle's
//! backward reaches an op only after every consumer of its output). The
//! order of the calls is the order of the variables in
//! `loss.sorted_nodes()` (public in candle-core 0.11), computable before
//! backward runs; a variable used by several hooked ops (a tied weight) gets
//! one call per use, the last at its place in that order.
//!
//! # The layers
//! - [`Linear`] ([`linear`], [`linear_no_bias`], [`linear_b`]) and
//!   [`Embedding`] ([`embedding`]) are fused custom ops: the forward reads
//!   the weight's storage in place, the backward computes the input
//!   gradient and hands the weight (and bias) gradient to the hook.
//!   [`Linear::forward_activated`] applies an [`Activation`] (GELU, either
//!   form, SiLU or squared ReLU) in the same op, keeping the pre-activation for the
//!   backward (on CUDA tanh-GELU in cuBLASLt's epilogue, as the bias and
//!   its gradient: [`set_linear_cublaslt`]); [`Linear::forward_on_activated`] applies one to
//!   its input, keeping the input alone (the activation is computed again
//!   in the backward): an MLP's hidden layer kept once, not twice.
//! - [`LayerNorm`] ([`layer_norm`], [`layer_norm_no_bias`]) and [`RmsNorm`]
//!   ([`rms_norm`]) have a real backward for their weight and bias (candle-nn
//!   0.11's contiguous fast paths have none, and cut the graph there),
//!   `forward_residual`, a pre-norm block's `x + residual` and the norm of
//!   the sum in one pass, and `with_weight_offset`, a scale of
//!   `offset + weight` (Gemma's RMSNorm: `x̂ · (1 + weight)`).
//! - [`tap`] hands any other variable's gradient to the hook, at the cost of
//!   a copy of the variable per forward.
//! - [`ops`] has the parameter-free parts of a transformer as single ops
//!   with their own backward: causal self-attention over a packed `qkv`
//!   or over q, k, v with grouped K/V heads (no `time x time` tensor kept), GELU, SiLU, squared ReLU, the gated
//!   MLP's `act(gate) * up` (SwiGLU, GeGLU) and cross-entropy.
//!
//! Constructors create their variables through the `VarBuilder` with
//! candle-nn's names, shapes and initializations (they call candle-nn's own
//! constructors), so checkpoints and seeded runs are interchangeable.
//!
//! Devices: everything runs on the CPU (f32, f64, bf16, f16). On CUDA
//! (feature `cuda`), `Linear` and `Embedding` run through Candle's storage
//! ops, and `LayerNorm`/`RmsNorm` and [`ops`] through our own NVRTC kernels
//! (f32, bf16, f16; compiled and assembled in CI, tested on an H100, except
//! attention on tensor cores and its grouped form, not yet run on a GPU);
//! other devices get the norms as plain tensor ops with tapped parameters.
//!
//! Unlike candle-nn, a fused op computes no gradient for an input that needs
//! none (a plain, untracked tensor such as the model's input data), so such
//! an input has no `GradStore` entry.

mod bf16_matmul;
mod cpu;
mod elem;
mod embedding;
mod experts;
mod grad_hook;
mod layer_norm;
mod linear;
pub mod ops;
mod storage;
mod tap;

pub use embedding::{embedding, Embedding};
pub(crate) use experts::{ExpertForm, ExpertMlps};
pub(crate) use grad_hook::{vars_behind, Behind};
pub use grad_hook::{GatheredParam, GiveBack, GradCollector, GradHook, Stretch};
pub use layer_norm::{layer_norm, layer_norm_no_bias, rms_norm, LayerNorm, RmsNorm};
pub use linear::{linear, linear_b, linear_cublaslt, linear_no_bias, set_linear_cublaslt, Linear};
pub use ops::Activation;
pub(crate) use storage::OnDevice;
pub use tap::tap;
