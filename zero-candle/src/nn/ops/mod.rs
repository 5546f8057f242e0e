//! Fused transformer ops with their own backward: causal attention (over a
//! packed `qkv`, or separate `q`, `k`, `v` with grouped K/V heads, also
//! within a sliding window),
//! GELU (tanh and erf forms), SiLU, SwiGLU's and GeGLU's gates, rotary
//! embeddings and cross-entropy, each one custom op on the CPU and on CUDA.
//!
//! Candle composes these from element-wise and reduction ops, and keeps
//! every intermediate until backward (a `[batch, heads, T, T]` tensor
//! several times over for attention). Here each is one op whose forward
//! keeps only what its backward needs and whose backward is one pass.
//! 16-bit inputs compute in f32 (as autocast does) and round once at the
//! end; on GPUs with tensor cores (sm_80 on), 16-bit attention's products
//! also take the attention weights and their gradients rounded to the
//! input type, as FlashAttention-2 does.

mod activation;
mod activation_kind;
mod attention;
mod attention_dims;
mod clamped;
mod cross_entropy;
#[cfg(feature = "cuda")]
pub(crate) mod cuda;
#[cfg(not(feature = "cuda"))]
pub(crate) mod no_cuda;
mod rotary;
mod rotary_dims;
mod sinks;
mod swiglu;
#[cfg(not(feature = "cuda"))]
pub(crate) use no_cuda as cuda;

pub(crate) use activation::input_grad as activation_input_grad;
pub(crate) use activation::recompute_with_input_grad;
pub use activation::{gelu, gelu_erf, relu2, silu};
pub use activation_kind::Activation;
pub use attention::{
    causal_attention, causal_self_attention, causal_self_attention_rows, sink_attention,
    sliding_window_attention, softcapped_attention,
};
pub use attention_dims::AttentionDims;
pub use cross_entropy::{cross_entropy, cross_entropy_with_ignore};
pub use rotary::rotary_embedding;
pub(crate) use swiglu::Gating;
pub use swiglu::{clamped_swiglu, geglu, swiglu};

/// What a cuBLASLt GEMM of a `Linear` wrote (`cuda::linear_forward`).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) enum GemmOutput {
    /// `x·Wᵀ + b`.
    Product(candle_core::CudaStorage),
    /// `y = gelu(pre)` (tanh form) and `pre = x·Wᵀ + b`, from the epilogue.
    Gelu {
        y: candle_core::CudaStorage,
        pre: candle_core::CudaStorage,
    },
}
