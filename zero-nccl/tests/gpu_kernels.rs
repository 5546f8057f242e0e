//! The fused kernels against torch.optim's own results: `golden/kernels.py`
//! runs torch's single-tensor SGD, Adam, AdamW, Adagrad and RMSprop (f32,
//! CPU) on the inputs generated here, and writes the final parameters and
//! state to `golden/kernels.rs`, with each case's hyperparameters. Also the
//! norms' handling of NaN and infinities, and flatten/unflatten.
//!
//! Needs a GPU and NVRTC: `#[ignore]`d, so a plain `cargo test` reports them
//! as not run; `cargo test -p zero-nccl --features nccl -- --ignored` on a
//! GPU machine runs them, and fails saying why when no GPU is there.
#![cfg(feature = "cuda")]

mod common;
#[rustfmt::skip]
#[path = "golden/kernels.rs"]
mod golden;

use common::values;
use golden::{N, STEPS};
use std::sync::Arc;
use zero_nccl::cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut};
use zero_nccl::kernels::*;

fn setup() -> (Arc<CudaStream>, FusedKernels) {
    let ctx = common::cuda_context();
    let kernels = FusedKernels::new(&ctx)
        .unwrap_or_else(|e| panic!("compiling the fused kernels failed: {e}"));
    let stream = ctx
        .new_stream()
        .unwrap_or_else(|e| panic!("creating a stream failed: {e}"));
    (stream, kernels)
}

fn floats(bits: &[u32]) -> Vec<f32> {
    bits.iter().copied().map(f32::from_bits).collect()
}

/// `|got - want| <= rtol * |want| + atol` element by element.
fn assert_close(what: &str, got: &[f32], want: &[f32], rtol: f32, atol: f32) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let tol = rtol * w.abs() + atol;
        assert!(
            (g - w).abs() <= tol,
            "{what}[{i}]: got {g}, torch {w} (tolerance {tol})"
        );
    }
}

/// Parameters agree with torch to float rounding: the kernels may contract
/// a multiply-add into an FMA where torch's CPU loop does not.
fn assert_params(what: &str, got: &[f32], want: &[f32]) {
    assert_close(&format!("{what}: params"), got, want, 1e-5, 1e-6);
}

/// State tensors agree to a few units in the last place of the tensor's
/// scale: tight enough to catch a complement such as `1 - beta2` rounded
/// in f32 (1.3e-5 off for 0.999) instead of torch's f64.
fn assert_state(what: &str, got: &[f32], want: &[f32]) {
    let scale = want.iter().fold(0f32, |m, w| m.max(w.abs()));
    assert_close(what, got, want, 4e-6, 1e-6 * scale);
}

/// `STEPS` steps of one parameter `values(1, N)` with gradients
/// `values(100 + t, N)`, as golden/kernels.py's `run`; the final parameters.
fn run_steps(
    stream: &Arc<CudaStream>,
    mut step: impl FnMut(&mut CudaSlice<f32>, &CudaSlice<f32>),
) -> Vec<f32> {
    let mut p = stream.clone_htod(&values(1, N)).expect("upload params");
    for t in 0..STEPS {
        let g = stream
            .clone_htod(&values(100 + t as u64, N))
            .expect("upload grads");
        step(&mut p, &g);
    }
    stream.clone_dtoh(&p).expect("download params")
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn sgd_matches_torch() {
    let (stream, k) = setup();
    for case in golden::SGD {
        let hyper = SgdHyper {
            lr: case.lr,
            momentum: case.momentum,
            dampening: case.dampening,
            weight_decay: case.weight_decay,
            nesterov: case.nesterov,
            maximize: case.maximize,
        };
        let what = format!("sgd {hyper:?}");
        let mut state = SgdState::new();
        let got = run_steps(&stream, |p, g| {
            k.sgd_step(&stream, p, g, &mut state, &hyper)
                .expect("sgd step")
        });
        assert_params(&what, &got, &floats(case.params));
        assert_eq!(state.step, STEPS as u64);
        let exported = state.export(&stream).expect("export");
        match case.momentum_buffer {
            Some(want) => assert_state(
                &format!("{what}: momentum_buffer"),
                &exported.tensors["momentum_buffer"],
                &floats(want),
            ),
            None => assert!(!exported.tensors.contains_key("momentum_buffer")),
        }
    }
}

/// The engine steps a shard segment by segment over one flat state. With
/// momentum switched on mid-run, torch starts every parameter's buffer as a
/// copy of its gradient, in the step that switches it on or, for a
/// parameter without a gradient then, in its next step.
#[test]
#[ignore = "needs a CUDA GPU"]
fn sgd_momentum_switched_on_mid_run_starts_each_buffer_from_its_gradient() {
    let (stream, k) = setup();
    let (lens, at) = (golden::SGD_MIDRUN_LENS, golden::SGD_MIDRUN_AT);
    let (lr, momentum, dampening) = golden::SGD_MIDRUN_HYPER;
    let mut params: Vec<CudaSlice<f32>> = lens
        .iter()
        .enumerate()
        .map(|(j, &n)| stream.clone_htod(&values(1 + j as u64, n)).expect("upload"))
        .collect();
    let mut state = SgdState::new();
    let mut steps = [0u64; 3];
    for step in 1..=golden::SGD_MIDRUN_STEPS {
        let hyper = SgdHyper {
            lr,
            momentum: if step >= golden::SGD_MIDRUN_MOMENTUM_FROM {
                momentum
            } else {
                0.0
            },
            dampening,
            ..SgdHyper::default()
        };
        for j in 0..3 {
            if (step, j) == golden::SGD_MIDRUN_SKIP {
                continue;
            }
            steps[j] += 1;
            let g = values(100 + 10 * step as u64 + j as u64, lens[j]);
            let g = stream.clone_htod(&g).expect("upload grads");
            k.sgd_step_at(
                &stream,
                &mut params[j],
                &g,
                &mut state,
                at[j],
                golden::SGD_MIDRUN_STATE_LEN,
                steps[j],
                &hyper,
            )
            .expect("sgd step");
        }
    }
    let buffer = state.export(&stream).expect("export").tensors["momentum_buffer"].clone();
    assert_eq!(buffer.len(), golden::SGD_MIDRUN_STATE_LEN);
    for (j, want) in golden::SGD_MIDRUN.iter().enumerate() {
        let got = stream.clone_dtoh(&params[j]).expect("download");
        assert_params(&format!("parameter {j}"), &got, &floats(want.params));
        assert_state(
            &format!("parameter {j}: momentum_buffer"),
            &buffer[at[j]..at[j] + lens[j]],
            &floats(want.momentum_buffer),
        );
    }
    // The padding between segments was never stepped.
    assert_eq!(state.momentum_unstarted(), &[300..320, 520..540]);
    assert!(buffer[300..320]
        .iter()
        .chain(&buffer[520..540])
        .all(|&x| x == 0.0));
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn adam_and_adamw_match_torch() {
    let (stream, k) = setup();
    for case in golden::ADAM {
        let hyper = AdamHyper {
            lr: case.lr,
            betas: case.betas,
            eps: case.eps,
            weight_decay: case.weight_decay,
            amsgrad: case.amsgrad,
            maximize: case.maximize,
            decoupled_weight_decay: case.decoupled_weight_decay,
        };
        let what = format!("adam {hyper:?}");
        let mut state = AdamState::new(&stream, N, &hyper).expect("state");
        let got = run_steps(&stream, |p, g| {
            k.adam_step(&stream, p, g, &mut state, &hyper)
                .expect("adam step")
        });
        assert_params(&what, &got, &floats(case.params));
        let exported = state.export(&stream).expect("export");
        assert_eq!(exported.scalars["step"], STEPS as f64);
        let t = &exported.tensors;
        assert_state(
            &format!("{what}: exp_avg"),
            &t["exp_avg"],
            &floats(case.exp_avg),
        );
        assert_state(
            &format!("{what}: exp_avg_sq"),
            &t["exp_avg_sq"],
            &floats(case.exp_avg_sq),
        );
        match case.max_exp_avg_sq {
            Some(want) => assert_state(
                &format!("{what}: max_exp_avg_sq"),
                &t["max_exp_avg_sq"],
                &floats(want),
            ),
            None => assert!(!t.contains_key("max_exp_avg_sq")),
        }
        let back = AdamState::import(&stream, &exported, N).expect("import");
        assert_eq!(back.step, STEPS as u64);
        assert_eq!(back.max_exp_avg_sq.is_some(), case.amsgrad);
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn adagrad_matches_torch() {
    let (stream, k) = setup();
    for case in golden::ADAGRAD {
        let hyper = AdagradHyper {
            lr: case.lr,
            lr_decay: case.lr_decay,
            weight_decay: case.weight_decay,
            initial_accumulator_value: case.initial_accumulator_value,
            eps: case.eps,
            maximize: false,
        };
        let what = format!("adagrad {hyper:?}");
        let mut state = AdagradState::new(&stream, N, &hyper).expect("state");
        let got = run_steps(&stream, |p, g| {
            k.adagrad_step(&stream, p, g, &mut state, &hyper)
                .expect("adagrad step")
        });
        assert_params(&what, &got, &floats(case.params));
        let exported = state.export(&stream).expect("export");
        assert_state(
            &format!("{what}: sum"),
            &exported.tensors["sum"],
            &floats(case.sum),
        );
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn rmsprop_matches_torch() {
    let (stream, k) = setup();
    for case in golden::RMSPROP {
        let hyper = RmspropHyper {
            lr: case.lr,
            alpha: case.alpha,
            eps: case.eps,
            weight_decay: case.weight_decay,
            momentum: case.momentum,
            centered: case.centered,
            maximize: false,
        };
        let what = format!("rmsprop {hyper:?}");
        let mut state = RmspropState::new(&stream, N, &hyper).expect("state");
        let got = run_steps(&stream, |p, g| {
            k.rmsprop_step(&stream, p, g, &mut state, &hyper)
                .expect("rmsprop step")
        });
        assert_params(&what, &got, &floats(case.params));
        let exported = state.export(&stream).expect("export");
        let t = &exported.tensors;
        assert_state(
            &format!("{what}: square_avg"),
            &t["square_avg"],
            &floats(case.square_avg),
        );
        for (name, want) in [
            ("grad_avg", case.grad_avg),
            ("momentum_buffer", case.momentum_buffer),
        ] {
            match want {
                // A signed running sum: compared at the tensor's scale.
                Some(want) => assert_state(&format!("{what}: {name}"), &t[name], &floats(want)),
                None => assert!(!t.contains_key(name), "{what}: unexpected {name}"),
            }
        }
    }
}

/// The norm of `host` by `norm_partial`, in two launches (two halves) to
/// cover accumulation across calls.
fn device_norm(stream: &Arc<CudaStream>, k: &FusedKernels, host: &[f32], kind: NormKind) -> f64 {
    let mut acc = NormAccumulator::new(stream).expect("accumulator");
    let (a, b) = host.split_at(host.len() / 2);
    for half in [a, b] {
        let buf = stream.clone_htod(half).expect("upload");
        k.norm_partial(stream, &buf, kind, &mut acc)
            .expect("norm_partial");
    }
    acc.read(stream, kind).expect("read")
}

/// NaN and infinities reach the caller as `torch.linalg.vector_norm`
/// reports them, for every kind: the inf-norm used to drop NaN (fmax).
#[test]
#[ignore = "needs a CUDA GPU"]
fn norms_propagate_nan_and_infinity() {
    let (stream, k) = setup();
    let finite = values(5, 2000);
    let l1: f64 = finite.iter().map(|&x| (x as f64).abs()).sum();
    let l2: f64 = finite.iter().map(|&x| (x as f64) * (x as f64)).sum();
    let max = finite.iter().fold(0f32, |m, x| m.max(x.abs())) as f64;
    let rel = |got: f64, want: f64| ((got - want) / want).abs();
    assert!(rel(device_norm(&stream, &k, &finite, NormKind::L1), l1) < 1e-12);
    assert!(rel(device_norm(&stream, &k, &finite, NormKind::L2), l2) < 1e-12);
    assert_eq!(device_norm(&stream, &k, &finite, NormKind::Inf), max);

    // One NaN in either half, among finite values, and next to an infinity.
    for at in [3, 1500] {
        let mut with_nan = finite.clone();
        with_nan[at] = f32::NAN;
        let mut with_both = with_nan.clone();
        with_both[(at + 700) % 2000] = f32::NEG_INFINITY;
        for kind in [NormKind::L1, NormKind::L2, NormKind::Inf] {
            for (what, host) in [("NaN", &with_nan), ("NaN and -inf", &with_both)] {
                let got = device_norm(&stream, &k, host, kind);
                assert!(got.is_nan(), "{kind:?} with {what} at {at}: got {got}");
            }
        }
    }
    let mut with_inf = finite.clone();
    with_inf[1234] = f32::NEG_INFINITY;
    for kind in [NormKind::L1, NormKind::L2, NormKind::Inf] {
        let got = device_norm(&stream, &k, &with_inf, kind);
        assert_eq!(got, f64::INFINITY, "{kind:?} with -inf");
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn flatten_unflatten_round_trip() {
    let (stream, k) = setup();
    let lens = [1usize, 7, 1000, 3, 4096, 0, 33];
    let host: Vec<Vec<f32>> = lens
        .iter()
        .enumerate()
        .map(|(i, &n)| values(7 + i as u64, n))
        .collect();
    let pieces: Vec<CudaSlice<f32>> = host
        .iter()
        .map(|h| stream.clone_htod(h).expect("upload"))
        .collect();
    // Pack with a gap of 5 elements after each piece, as an aligned layout would.
    let mut offsets = Vec::new();
    let mut total = 0;
    for &n in &lens {
        offsets.push(total);
        total += n + 5;
    }
    let mut flat = stream.alloc_zeros::<f32>(total).expect("flat");
    let refs: Vec<(usize, &dyn DevicePtr<f32>)> = offsets
        .iter()
        .zip(&pieces)
        .map(|(&o, p)| (o, p as &dyn DevicePtr<f32>))
        .collect();
    k.flatten(&stream, &refs, &mut flat).expect("flatten");
    let flat_host = stream.clone_dtoh(&flat).expect("download");
    for ((&o, h), &n) in offsets.iter().zip(&host).zip(&lens) {
        assert_eq!(&flat_host[o..o + n], &h[..]);
        assert!(flat_host[o + n..o + n + 5].iter().all(|&x| x == 0.0));
    }
    let mut outs: Vec<CudaSlice<f32>> = lens
        .iter()
        .map(|&n| stream.alloc_zeros::<f32>(n).expect("out"))
        .collect();
    {
        let mut refs: Vec<(usize, &mut dyn DevicePtrMut<f32>)> = offsets
            .iter()
            .zip(outs.iter_mut())
            .map(|(&o, p)| (o, p as &mut dyn DevicePtrMut<f32>))
            .collect();
        k.unflatten(&stream, &flat, &mut refs).expect("unflatten");
    }
    for (out, h) in outs.iter().zip(&host) {
        assert_eq!(&stream.clone_dtoh(out).expect("download")[..], &h[..]);
    }
    // Out of bounds is an error, not a fault.
    let mut small = stream.alloc_zeros::<f32>(3).expect("small");
    let bad: Vec<(usize, &dyn DevicePtr<f32>)> = vec![(0, &pieces[2] as &dyn DevicePtr<f32>)];
    assert!(k.flatten(&stream, &bad, &mut small).is_err());
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn flatten_bf16_and_f64() {
    let (stream, k) = setup();
    let a: Vec<half::bf16> = values(3, 100)
        .into_iter()
        .map(half::bf16::from_f32)
        .collect();
    let b: Vec<f64> = values(4, 50).into_iter().map(f64::from).collect();
    let da = stream.clone_htod(&a).expect("upload");
    let mut fa = stream.alloc_zeros::<half::bf16>(100).expect("flat");
    k.flatten(&stream, &[(0, &da as &dyn DevicePtr<half::bf16>)], &mut fa)
        .expect("flatten bf16");
    assert_eq!(stream.clone_dtoh(&fa).expect("download"), a);
    let db = stream.clone_htod(&b).expect("upload");
    let mut fb = stream.alloc_zeros::<f64>(60).expect("flat");
    k.flatten(&stream, &[(10, &db as &dyn DevicePtr<f64>)], &mut fb)
        .expect("flatten f64");
    assert_eq!(&stream.clone_dtoh(&fb).expect("download")[10..], &b[..]);
}
