//! Stage 3's products with a gathered weight: whole (`g·W` for the
//! input's gradient, [`MatmulGathered`]) or in pieces, a stretch of rows at
//! a time ([`forward_in_pieces`], [`grad_input_in_pieces`]).

use super::super::bf16_matmul;
use super::super::grad_hook::{
    for_each_stretch, gemm_operand, row_parts, GatheredParam, GradHook, RowPart,
};
use super::super::storage::OnDevice;
use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, CudaStorage, CustomOp1, Layout, Result, Shape, Tensor};
use std::sync::Arc;

/// `x·Wᵀ` with `W` gathered in pieces: whole rows of `W` give columns of
/// the product; a row split over two stretches gives the sum of its
/// parts' products (accumulated in f32, or f64 for f64).
pub(super) fn forward_in_pieces(
    hook: Option<&Arc<dyn GradHook>>,
    w: &Tensor,
    first: GatheredParam,
    x: &Tensor,
) -> Result<Tensor> {
    let (out_dim, in_dim) = w.dims2()?;
    let wide = wide_dtype(x.dtype());
    let mut blocks: Vec<(usize, Tensor)> = Vec::new();
    let mut partial: std::collections::BTreeMap<usize, Tensor> = Default::default();
    for_each_stretch(hook, w, Some(first), |values, stretch| {
        for part in row_parts(values, in_dim) {
            match part {
                RowPart::Rows { rows, at } => {
                    let product = stretch.matmul(x, at, (rows.len(), in_dim), true)?;
                    blocks.push((rows.start, product));
                }
                RowPart::Partial { row, cols, at } => {
                    let part = stretch
                        .tensor(at..at + cols.len(), x.device())?
                        .reshape((cols.len(), 1))?;
                    let product = gemm_operand(x.narrow(1, cols.start, cols.len())?)?
                        .matmul(&part)?
                        .to_dtype(wide)?;
                    let sum = match partial.remove(&row) {
                        Some(sum) => (sum + product)?,
                        None => product,
                    };
                    partial.insert(row, sum);
                }
            }
        }
        Ok(())
    })?;
    for (row, sum) in partial {
        blocks.push((row, sum.to_dtype(x.dtype())?));
    }
    blocks.sort_by_key(|(start, _)| *start);
    let mut next = 0;
    for (start, block) in &blocks {
        if *start != next {
            bail!("zero-candle Linear: the gathered pieces of a weight miss rows {next}..{start}")
        }
        next += block.dim(1)?;
    }
    if next != out_dim {
        bail!("zero-candle Linear: the gathered pieces of a weight cover {next} of {out_dim} rows")
    }
    let blocks: Vec<Tensor> = blocks.into_iter().map(|(_, b)| b).collect();
    Tensor::cat(&blocks, 1)
}

/// `g·W` with `W` gathered in pieces: the sum over `W`'s rows of their
/// products, accumulated in f32 (f64 for f64).
pub(super) fn grad_input_in_pieces(
    hook: Option<&Arc<dyn GradHook>>,
    w: &Tensor,
    first: GatheredParam,
    g: &Tensor,
) -> Result<Tensor> {
    let (rows, _) = g.dims2()?;
    let in_dim = w.dim(1)?;
    let wide = wide_dtype(g.dtype());
    let mut sum = Tensor::zeros((rows, in_dim), wide, g.device())?;
    for_each_stretch(hook, w, Some(first), |values, stretch| {
        for part in row_parts(values, in_dim) {
            let product = match part {
                RowPart::Rows { rows, at } => {
                    let g = g.narrow(1, rows.start, rows.len())?;
                    stretch.matmul(&g, at, (rows.len(), in_dim), false)?
                }
                RowPart::Partial { row, cols, at } => {
                    let part = stretch
                        .tensor(at..at + cols.len(), g.device())?
                        .reshape((1, cols.len()))?;
                    gemm_operand(g.narrow(1, row, 1)?)?
                        .matmul(&part)?
                        .pad_with_zeros(1, cols.start, in_dim - cols.end)?
                }
            };
            sum = (&sum + product.to_dtype(wide)?)?;
        }
        Ok(())
    })?;
    sum.to_dtype(g.dtype())
}

/// What sums of a dtype's products accumulate in.
fn wide_dtype(dtype: candle_core::DType) -> candle_core::DType {
    match dtype {
        candle_core::DType::F64 => candle_core::DType::F64,
        _ => candle_core::DType::F32,
    }
}

/// A parameter gathered whole, on the op's device.
pub(super) fn whole_on<S: OnDevice>(gathered: &GatheredParam) -> Result<(&S, &Layout)> {
    match gathered.whole_on::<S>() {
        Some(whole) => Ok(whole),
        None => bail!(
            "zero-candle Linear: internal: a weight gathered in pieces, or on another device, \
             reached the whole-weight op"
        ),
    }
}

/// `g·W` with a gathered `W` (stage 3's backward): `g [rows, out]`,
/// `W [out, in]`, as `Tensor::matmul` computes it.
pub(super) struct MatmulGathered(pub(super) GatheredParam);

/// `g·W` on the storages.
fn matmul_gw<S: BackendStorage>(
    g: &S,
    g_layout: &Layout,
    w: &S,
    w_layout: &Layout,
) -> Result<(S, Shape)> {
    let (rows, out_dim) = g_layout.shape().dims2()?;
    let (_, in_dim) = w_layout.shape().dims2()?;
    let product = g.matmul(w, (1, rows, in_dim, out_dim), g_layout, w_layout)?;
    Ok((product, Shape::from((rows, in_dim))))
}

impl CustomOp1 for MatmulGathered {
    fn name(&self) -> &'static str {
        "zero-linear-grad-input"
    }

    fn cpu_fwd(&self, g: &CpuStorage, g_layout: &Layout) -> Result<(CpuStorage, Shape)> {
        let (w, w_layout) = whole_on(&self.0)?;
        if let Some(done) = bf16_matmul::grad_input_storage(g, g_layout, w, w_layout)? {
            return Ok(done);
        }
        matmul_gw(g, g_layout, w, w_layout)
    }

    fn cuda_fwd(&self, g: &CudaStorage, g_layout: &Layout) -> Result<(CudaStorage, Shape)> {
        let (w, w_layout) = whole_on(&self.0)?;
        matmul_gw(g, g_layout, w, w_layout)
    }
}
