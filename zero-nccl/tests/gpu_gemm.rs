//! A Linear layer's GEMM through cuBLASLt (`kernels::gemm`), its bias (and
//! a tanh-GELU with its pre-activation in the aux matrix,
//! `GELU_AUX_BIAS`) in the epilogue, against the host model of the same
//! plan (`LinearGemm::reference`, f64): f32, bf16 and f16, with and without
//! a bias, shapes off every tile size, and operands that start off
//! cuBLASLt's 256-byte alignment (an offset view; the bias and the aux
//! matrix 16 bytes in, as `Gemm::linear` refuses less). Each case must
//! find an algorithm; a bias aligned to less than 16 bytes is refused. The
//! weight gradient with the bias gradient in its epilogue (`BGRADB`,
//! `Gemm::weight_grad`) likewise, where cuBLASLt has an algorithm for it,
//! which it must have for the GPT's shapes in bf16.
//!
//! Needs a GPU: `#[ignore]`d; `cargo test -p zero-nccl --features nccl
//! --test gpu_gemm -- --ignored` on a GPU machine.
#![cfg(feature = "cuda")]

mod common;

use common::values;
use half::{bf16, f16};
use zero_nccl::cudarc::driver::CudaSlice;
use zero_nccl::kernels::gemm::{Gemm, GemmCompute, GemmElement, LinearGemm};

/// The epilogue a case runs.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Epilogue {
    /// The bias alone.
    Plain,
    /// The tanh-GELU after the bias, the pre-activation in the aux matrix.
    GeluAux,
}

/// An element type with its conversions and its tolerance (relative to the
/// output's largest magnitude).
trait Element: GemmElement + zero_nccl::cudarc::driver::ValidAsZeroBits {
    fn from_f32(v: f32) -> Self;
    fn to_f64(self) -> f64;
    const TOLERANCE: f64;
}

impl Element for f32 {
    fn from_f32(v: f32) -> Self {
        v
    }
    fn to_f64(self) -> f64 {
        self as f64
    }
    const TOLERANCE: f64 = 1e-5;
}

impl Element for bf16 {
    fn from_f32(v: f32) -> Self {
        bf16::from_f32(v)
    }
    fn to_f64(self) -> f64 {
        self.to_f64()
    }
    const TOLERANCE: f64 = 2.0 / 256.0;
}

impl Element for f16 {
    fn from_f32(v: f32) -> Self {
        f16::from_f32(v)
    }
    fn to_f64(self) -> f64 {
        self.to_f64()
    }
    const TOLERANCE: f64 = 2.0 / 2048.0;
}

/// Runs the plan of `rows x in -> out` on the device, the input, weight
/// and output starting one element into their buffers and the bias and
/// aux matrix `epilogue_offset` elements into theirs, and compares it with
/// the reference.
fn check<E: Element>(
    gemm: &Gemm,
    (rows, in_dim, out_dim): (usize, usize, usize),
    bias: bool,
    epilogue: Epilogue,
) {
    let epilogue_offset = 16 / std::mem::size_of::<E>();
    assert!(
        run::<E>(
            gemm,
            (rows, in_dim, out_dim),
            bias,
            epilogue,
            epilogue_offset
        ),
        "no cuBLASLt algorithm for {rows}x{in_dim}->{out_dim} (bias {bias}, {epilogue:?})"
    );
}

/// [`check`] with the bias and aux matrix `epilogue_offset` elements in:
/// whether cuBLASLt ran it (and then its values were checked).
fn run<E: Element>(
    gemm: &Gemm,
    (rows, in_dim, out_dim): (usize, usize, usize),
    bias: bool,
    epilogue: Epilogue,
    epilogue_offset: usize,
) -> bool {
    let offset = 1;
    let stream = gemm.stream().clone();
    let plan = LinearGemm::new(rows, in_dim, out_dim).expect("a plan");
    let plan = match epilogue {
        Epilogue::Plain => plan,
        Epilogue::GeluAux => plan.with_gelu_aux().expect("an aux matrix cuBLASLt takes"),
    };
    let host = |seed: u64, n: usize, offset: usize| -> Vec<E> {
        values(seed, n + offset)
            .into_iter()
            .map(E::from_f32)
            .collect()
    };
    let (x, w, b) = (
        host(1, rows * in_dim, offset),
        host(2, out_dim * in_dim, offset),
        host(3, out_dim, epilogue_offset),
    );
    let upload = |v: &[E]| -> CudaSlice<E> { stream.clone_htod(v).expect("an upload") };
    let (dx, dw, db) = (upload(&x), upload(&w), upload(&b));
    let alloc = |offset: usize| {
        stream
            .alloc_zeros::<E>(rows * out_dim + offset)
            .expect("an output")
    };
    let (mut dy, mut dpre) = (alloc(offset), alloc(epilogue_offset));
    let done = {
        let bias_view = db.slice(epilogue_offset..);
        let mut pre_view = dpre.slice_mut(epilogue_offset..);
        gemm.linear(
            &plan,
            GemmCompute::F32,
            &dx.slice(offset..),
            &dw.slice(offset..),
            bias.then_some(&bias_view),
            &mut dy.slice_mut(offset..),
            (epilogue == Epilogue::GeluAux).then_some(&mut pre_view),
        )
        .expect("cuBLASLt's GEMM")
    };
    if !done {
        return false;
    }
    let case = format!("{rows}x{in_dim}->{out_dim} (bias {bias}, {epilogue:?})");
    let y: Vec<E> = stream.clone_dtoh(&dy).expect("a download");
    let pre: Vec<E> = stream.clone_dtoh(&dpre).expect("a download");
    let wide_at =
        |v: &[E], offset: usize| -> Vec<f64> { v[offset..].iter().map(|e| e.to_f64()).collect() };
    let wide = |v: &[E]| wide_at(v, offset);
    let b_wide = wide_at(&b, epilogue_offset);
    let want = plan.reference(&wide(&w), &wide(&x), bias.then_some(&b_wide[..]));
    // Tolerances scale with the pre-activation (GELU's slope is at most
    // about 1.13, so D's errors are of the same size).
    let pre_want = want.aux.as_ref().unwrap_or(&want.d);
    let scale = pre_want.iter().fold(1e-6f64, |m, v| m.max(v.abs()));
    let compare = |what: &str, got: &[f64], want: &[f64]| {
        for (i, (got, want)) in got.iter().zip(want).enumerate() {
            assert!(
                (got - want).abs() <= E::TOLERANCE * scale,
                "{case} {what} [{i}]: got {got}, want {want}"
            );
        }
    };
    compare("D", &wide(&y), &want.d);
    if let Some(aux) = &want.aux {
        compare(
            "aux (the pre-activation)",
            &wide_at(&pre, epilogue_offset),
            aux,
        );
    }
    true
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_bias_or_aux_matrix_aligned_to_less_than_16_bytes_is_refused() {
    let ctx = common::cuda_context();
    let gemm = Gemm::new(ctx.default_stream()).unwrap_or_else(|e| panic!("cuBLASLt: {e}"));
    let shape = (7, 65, 40);
    assert!(!run::<f32>(&gemm, shape, true, Epilogue::Plain, 1));
    assert!(!run::<bf16>(&gemm, shape, false, Epilogue::GeluAux, 1));
    // Without a bias or aux matrix the other operands' offsets are taken.
    assert!(run::<f32>(&gemm, shape, false, Epilogue::Plain, 1));
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn linear_gemm_with_its_bias_in_the_epilogue_matches_the_reference() {
    let ctx = common::cuda_context();
    let gemm = Gemm::new(ctx.default_stream()).unwrap_or_else(|e| panic!("cuBLASLt: {e}"));
    for shape in [(1, 1, 1), (7, 65, 33), (64, 768, 3072), (256, 3072, 768)] {
        for bias in [true, false] {
            check::<f32>(&gemm, shape, bias, Epilogue::Plain);
            check::<bf16>(&gemm, shape, bias, Epilogue::Plain);
            check::<f16>(&gemm, shape, bias, Epilogue::Plain);
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn linear_gemm_with_gelu_aux_in_the_epilogue_matches_the_reference() {
    let ctx = common::cuda_context();
    let gemm = Gemm::new(ctx.default_stream()).unwrap_or_else(|e| panic!("cuBLASLt: {e}"));
    // Output widths a multiple of 8, as the aux matrix needs.
    for shape in [(1, 1, 8), (7, 65, 40), (64, 768, 3072), (256, 3072, 768)] {
        for bias in [true, false] {
            check::<f32>(&gemm, shape, bias, Epilogue::GeluAux);
            check::<bf16>(&gemm, shape, bias, Epilogue::GeluAux);
            check::<f16>(&gemm, shape, bias, Epilogue::GeluAux);
        }
    }
}

/// [`Gemm::weight_grad`] over `rows x in -> out` against the row-major
/// gradients a Linear layer wants (`LinearGemm::reference` is checked
/// against them on the host; an f64 reference of the GPT's shapes would
/// take minutes): `∂b` whole, `∂W` at every entry of a small weight and
/// at about 4,096 spread over a large one. The input and output gradient
/// start one element into their buffers, the bias gradient 16 bytes into
/// its. Whether cuBLASLt ran it (and then both were checked).
fn run_weight_grad<E: Element>(
    gemm: &Gemm,
    (rows, in_dim, out_dim): (usize, usize, usize),
) -> bool {
    let (offset, bias_offset) = (1, 16 / std::mem::size_of::<E>());
    let stream = gemm.stream().clone();
    let plan = LinearGemm::weight_grad(rows, in_dim, out_dim).expect("a plan");
    let host = |seed: u64, n: usize| -> Vec<E> {
        values(seed, n + offset)
            .into_iter()
            .map(E::from_f32)
            .collect()
    };
    let (x, g) = (host(4, rows * in_dim), host(5, rows * out_dim));
    let upload = |v: &[E]| -> CudaSlice<E> { stream.clone_htod(v).expect("an upload") };
    let (dx, dg) = (upload(&x), upload(&g));
    let alloc = |n: usize| stream.alloc_zeros::<E>(n).expect("an output");
    let (mut dw, mut db) = (
        alloc(out_dim * in_dim + offset),
        alloc(out_dim + bias_offset),
    );
    let done = gemm
        .weight_grad(
            &plan,
            GemmCompute::F32,
            &dx.slice(offset..),
            &dg.slice(offset..),
            &mut dw.slice_mut(offset..),
            &mut db.slice_mut(bias_offset..),
        )
        .expect("cuBLASLt's GEMM");
    if !done {
        return false;
    }
    let case = format!("weight gradient {rows}x{in_dim}->{out_dim}");
    let wide =
        |v: &[E], offset: usize| -> Vec<f64> { v[offset..].iter().map(|e| e.to_f64()).collect() };
    let (x, g) = (wide(&x, offset), wide(&g, offset));
    let got_w = wide(&stream.clone_dtoh(&dw).expect("a download"), offset);
    let got_b = wide(&stream.clone_dtoh(&db).expect("a download"), bias_offset);
    let stride = (out_dim * in_dim / 4096).max(1);
    let (at, want_w): (Vec<usize>, Vec<f64>) = (0..out_dim * in_dim)
        .step_by(stride)
        .map(|at| {
            let (o, i) = (at / in_dim, at % in_dim);
            let sum: f64 = (0..rows)
                .map(|r| g[r * out_dim + o] * x[r * in_dim + i])
                .sum();
            (at, sum)
        })
        .unzip();
    let want_b: Vec<f64> = (0..out_dim)
        .map(|o| (0..rows).map(|r| g[r * out_dim + o]).sum())
        .collect();
    let got_w: Vec<f64> = at.iter().map(|&at| got_w[at]).collect();
    for (what, got, want) in [("∂W", &got_w, &want_w), ("∂b", &got_b, &want_b)] {
        // Each relative to its largest magnitude, as the outputs round.
        let scale = want.iter().fold(1e-6f64, |m, v| m.max(v.abs()));
        for (i, (got, want)) in got.iter().zip(want).enumerate() {
            assert!(
                (got - want).abs() <= E::TOLERANCE * scale,
                "{case} {what} [{i}]: got {got}, want {want}"
            );
        }
    }
    true
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn weight_gradient_with_the_bias_gradient_in_the_epilogue_matches_the_reference() {
    let ctx = common::cuda_context();
    let gemm = Gemm::new(ctx.default_stream()).unwrap_or_else(|e| panic!("cuBLASLt: {e}"));
    // Any shape: checked where cuBLASLt takes it.
    let mut ran = Vec::new();
    for shape in [(1, 1, 1), (7, 65, 33), (129, 40, 24)] {
        ran.push((shape, "f32", run_weight_grad::<f32>(&gemm, shape)));
        ran.push((shape, "bf16", run_weight_grad::<bf16>(&gemm, shape)));
        ran.push((shape, "f16", run_weight_grad::<f16>(&gemm, shape)));
    }
    println!("BGRADB ran (shape, dtype, ran): {ran:?}");
    // The GPT's Linear layers (2048 rows of 768 features): cuBLASLt must
    // take them in bf16, else the Linear backward keeps its column sums.
    for shape in [(2048, 768, 2304), (2048, 768, 3072), (2048, 3072, 768)] {
        assert!(
            run_weight_grad::<bf16>(&gemm, shape),
            "no cuBLASLt algorithm for the bf16 weight gradient {shape:?} with BGRADB"
        );
        run_weight_grad::<f32>(&gemm, shape);
    }
}
