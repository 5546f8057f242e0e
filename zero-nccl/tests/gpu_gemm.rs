//! A Linear layer's GEMM through cuBLASLt (`kernels::gemm`), its bias in
//! the epilogue, against the host model of the same plan
//! (`LinearGemm::reference`, f64): f32, bf16 and f16, with and without a
//! bias, shapes off every tile size, and operands that start off cuBLASLt's
//! 256-byte alignment (an offset view). Each case must find an algorithm.
//!
//! Needs a GPU: `#[ignore]`d; `cargo test -p zero-nccl --features nccl
//! --test gpu_gemm -- --ignored` on a GPU machine.
#![cfg(feature = "cuda")]

mod common;

use common::values;
use half::{bf16, f16};
use zero_nccl::cudarc::driver::CudaSlice;
use zero_nccl::kernels::gemm::{Gemm, GemmCompute, GemmElement, LinearGemm};

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

/// Runs the plan of `rows x in -> out` on the device, each operand starting
/// `offset` elements into its buffer, and compares it with the reference.
fn check<E: Element>(gemm: &Gemm, (rows, in_dim, out_dim): (usize, usize, usize), bias: bool) {
    let offset = 1;
    let stream = gemm.stream().clone();
    let plan = LinearGemm::new(rows, in_dim, out_dim).expect("a plan");
    let host = |seed: u64, n: usize| -> Vec<E> {
        values(seed, n + offset)
            .into_iter()
            .map(E::from_f32)
            .collect()
    };
    let (x, w, b) = (
        host(1, rows * in_dim),
        host(2, out_dim * in_dim),
        host(3, out_dim),
    );
    let upload = |v: &[E]| -> CudaSlice<E> { stream.clone_htod(v).expect("an upload") };
    let (dx, dw, db) = (upload(&x), upload(&w), upload(&b));
    let mut dy = stream
        .alloc_zeros::<E>(rows * out_dim + offset)
        .expect("an output");
    let done = {
        let bias_view = db.slice(offset..);
        gemm.linear(
            &plan,
            GemmCompute::F32,
            &dx.slice(offset..),
            &dw.slice(offset..),
            bias.then_some(&bias_view),
            &mut dy.slice_mut(offset..),
        )
        .expect("cuBLASLt's GEMM")
    };
    assert!(done, "no cuBLASLt algorithm for {rows}x{in_dim}->{out_dim}");
    let y: Vec<E> = stream.clone_dtoh(&dy).expect("a download");
    let wide = |v: &[E]| -> Vec<f64> { v[offset..].iter().map(|e| e.to_f64()).collect() };
    let b_wide = wide(&b);
    let want = plan.reference(&wide(&w), &wide(&x), bias.then_some(&b_wide[..]));
    let scale = want.iter().fold(1e-6f64, |m, v| m.max(v.abs()));
    for (i, (got, want)) in wide(&y).iter().zip(&want).enumerate() {
        assert!(
            (got - want).abs() <= E::TOLERANCE * scale,
            "{rows}x{in_dim}->{out_dim} (bias {bias}) [{i}]: got {got}, want {want}"
        );
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn linear_gemm_with_its_bias_in_the_epilogue_matches_the_reference() {
    let ctx = common::cuda_context();
    let gemm = Gemm::new(ctx.default_stream()).unwrap_or_else(|e| panic!("cuBLASLt: {e}"));
    for shape in [(1, 1, 1), (7, 65, 33), (64, 768, 3072), (256, 3072, 768)] {
        for bias in [true, false] {
            check::<f32>(&gemm, shape, bias);
            check::<bf16>(&gemm, shape, bias);
            check::<f16>(&gemm, shape, bias);
        }
    }
}
