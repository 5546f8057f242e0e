//! The CUDA entry points of the fused layers when zero-candle is built
//! without the `cuda` feature: the same names as `cuda.rs`, each an error.
//! Candle then has no CUDA device either, so none of them is reachable
//! from a tensor; they keep the ops' `cuda_fwd` free of `cfg`.

use super::rotary_dims::{RotaryDims, Turn};
use super::GemmOutput;
use super::{Activation, AttentionDims};
use candle_core::{bail, CudaStorage, Layout, Result};

/// A CUDA storage with its layout.
pub(crate) type Arg<'a> = (&'a CudaStorage, &'a Layout);

/// Without CUDA there is no CUDA storage to measure.
pub(crate) fn storage_len(_storage: &CudaStorage) -> Option<usize> {
    None
}

fn no_cuda<T>() -> Result<T> {
    bail!("zero-candle was built without the `cuda` feature; enable it to run the fused layers on a GPU")
}

pub(crate) fn attention_forward(
    _qkv: Arg,
    _dims: &AttentionDims,
) -> Result<(CudaStorage, CudaStorage)> {
    no_cuda()
}

pub(crate) fn attention_backward(
    _qkv: Arg,
    _out: Arg,
    _lse: &CudaStorage,
    _grad: Arg,
    _dims: &AttentionDims,
) -> Result<CudaStorage> {
    no_cuda()
}

pub(crate) fn attention_forward_split(
    _qkv: [Arg; 3],
    _dims: &AttentionDims,
) -> Result<(CudaStorage, CudaStorage)> {
    no_cuda()
}

pub(crate) fn attention_backward_split(
    _qkv: [Arg; 3],
    _out: Arg,
    _lse: &CudaStorage,
    _grad: Arg,
    _dims: &AttentionDims,
) -> Result<[CudaStorage; 3]> {
    no_cuda()
}

pub(crate) fn norm_forward(
    _x: Arg,
    _weight: Arg,
    _bias: Option<Arg>,
    _eps: f64,
    _remove_mean: bool,
    _weight_offset: f64,
) -> Result<CudaStorage> {
    no_cuda()
}

pub(crate) fn residual_norm_forward(
    _x: Arg,
    _residual: Arg,
    _weight: Arg,
    _bias: Option<Arg>,
    _eps: f64,
    _remove_mean: bool,
    _weight_offset: f64,
) -> Result<(CudaStorage, CudaStorage)> {
    no_cuda()
}

#[allow(clippy::type_complexity)]
pub(crate) fn norm_backward(
    _x: Arg,
    _weight: Arg,
    _grad: Arg,
    _eps: f64,
    _remove_mean: bool,
    _weight_offset: f64,
    _want_x: bool,
) -> Result<(Option<CudaStorage>, CudaStorage, CudaStorage)> {
    no_cuda()
}

pub(crate) fn activation_forward(_kind: Activation, _x: Arg) -> Result<CudaStorage> {
    no_cuda()
}

pub(crate) fn activation_backward(_kind: Activation, _x: Arg, _grad: Arg) -> Result<CudaStorage> {
    no_cuda()
}

pub(crate) fn activation_recompute_backward(
    _kind: Activation,
    _x: Arg,
    _grad: (&mut CudaStorage, &Layout),
) -> Result<CudaStorage> {
    no_cuda()
}

pub(crate) fn cross_entropy_forward(
    _logits: Arg,
    _targets: Arg,
    _ignore_index: Option<i64>,
) -> Result<(CudaStorage, CudaStorage)> {
    no_cuda()
}

pub(crate) fn cross_entropy_backward(
    _logits: Arg,
    _targets: Arg,
    _saved: &CudaStorage,
    _grad: Arg,
    _ignore_index: Option<i64>,
) -> Result<CudaStorage> {
    no_cuda()
}

pub(crate) fn rotary_embedding(
    _x: Arg,
    _cos: Arg,
    _sin: Arg,
    _dims: &RotaryDims,
    _turn: Turn,
) -> Result<CudaStorage> {
    no_cuda()
}

pub(crate) fn column_sums(_grad: Arg) -> Result<CudaStorage> {
    no_cuda()
}

pub(crate) fn gated_forward(_kind: Activation, _gate: Arg, _up: Arg) -> Result<CudaStorage> {
    no_cuda()
}

pub(crate) fn gated_backward(
    _kind: Activation,
    _gate: Arg,
    _up: Arg,
    _grad: Arg,
) -> Result<(CudaStorage, CudaStorage)> {
    no_cuda()
}

pub(crate) fn embedding_backward(
    _ids: Arg,
    _grad: Arg,
    _table: (usize, usize),
) -> Result<CudaStorage> {
    no_cuda()
}

pub(crate) fn embedding_lookup(
    _ids: Arg,
    _part: (&CudaStorage, std::ops::Range<usize>),
    _values: std::ops::Range<usize>,
    _table: (usize, usize),
    _out: &mut CudaStorage,
) -> Result<()> {
    no_cuda()
}

pub(crate) fn bias_epilogue(
    _activation: Option<Activation>,
    _pre: &mut CudaStorage,
    _len: usize,
    _bias: Arg,
) -> Result<Option<CudaStorage>> {
    no_cuda()
}

/// Without CUDA the Linear layers keep their generic path.
pub(crate) fn linear_param_grads(
    _grad: Arg,
    _x: Arg,
) -> Result<Option<(CudaStorage, CudaStorage)>> {
    Ok(None)
}

/// Without CUDA the Linear layers keep their generic path.
pub(crate) fn linear_forward(
    _x: Arg,
    _w: Arg,
    _bias: Option<Arg>,
    _gelu: bool,
) -> Result<Option<GemmOutput>> {
    Ok(None)
}
