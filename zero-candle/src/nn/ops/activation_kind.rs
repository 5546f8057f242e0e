//! [`Activation`], which element-wise activation an op computes: the CPU op
//! and the CUDA entry points both take it.

/// Which element-wise activation an op computes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Activation {
    /// GELU, tanh approximation (`Tensor::gelu`):
    /// `0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))`.
    Gelu,
    /// GELU, exact (`Tensor::gelu_erf`): `0.5 x (1 + erf(x / sqrt(2)))`.
    GeluErf,
    /// SiLU (`Tensor::silu`): `x / (1 + exp(-x))`.
    Silu,
    /// Squared ReLU (`transformers`' `relu2`: Primer's, Nemotron's and
    /// Arcee's MLPs): `max(x, 0)²`.
    Relu2,
}
