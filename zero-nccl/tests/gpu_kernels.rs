//! The fused kernels against host references written here from PyTorch's
//! documented algorithms (torch.optim.{SGD, Adam, AdamW, Adagrad, RMSprop}).
//! Needs a GPU and NVRTC; skips with a printed reason otherwise.
#![cfg(feature = "cuda")]

mod common;

use std::sync::Arc;
use zero_nccl::cudarc::driver::{CudaContext, CudaSlice, CudaStream, DevicePtr, DevicePtrMut};
use zero_nccl::kernels::*;

const N: usize = 1000;
const STEPS: usize = 10;

fn setup() -> Option<(Arc<CudaStream>, FusedKernels)> {
    if !common::gpu_present() {
        return None;
    }
    let ctx = CudaContext::new(0).expect("context on GPU 0");
    let kernels = match FusedKernels::new(&ctx) {
        Ok(k) => k,
        Err(e @ zero_nccl::Error::LibraryNotFound { .. }) => {
            println!("skipping: {e}");
            return None;
        }
        Err(e) => panic!("compiling the kernels failed: {e}"),
    };
    Some((ctx.new_stream().expect("stream"), kernels))
}

/// Deterministic values in [-1, 1).
fn values(seed: u64, n: usize) -> Vec<f32> {
    let mut s = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

fn assert_close(what: &str, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let tol = 1e-6 + 1e-5 * w.abs();
        assert!((g - w).abs() <= tol, "{what}[{i}]: got {g}, want {w}");
    }
}

fn lerp(a: f32, b: f32, w: f32) -> f32 {
    if w < 0.5 {
        a + w * (b - a)
    } else {
        b - (b - a) * (1.0 - w)
    }
}

fn run_steps(
    stream: &Arc<CudaStream>,
    mut step: impl FnMut(&mut CudaSlice<f32>, &CudaSlice<f32>),
    mut host: impl FnMut(&mut [f32], &[f32]),
) {
    let mut p_host = values(1, N);
    let mut p = stream.clone_htod(&p_host).expect("upload params");
    for t in 0..STEPS {
        let g_host = values(100 + t as u64, N);
        let g = stream.clone_htod(&g_host).expect("upload grads");
        step(&mut p, &g);
        host(&mut p_host, &g_host);
    }
    let got = stream.clone_dtoh(&p).expect("download params");
    assert_close("params", &got, &p_host);
}

#[test]
fn sgd_matches_torch() {
    let Some((stream, k)) = setup() else { return };
    for (momentum, dampening, nesterov, wd, maximize) in [
        (0.0, 0.0, false, 0.0, false),
        (0.9, 0.0, false, 0.01, false),
        (0.9, 0.0, true, 0.0, true),
        (0.5, 0.3, false, 0.1, false),
    ] {
        let hyper = SgdHyper {
            lr: 0.05,
            momentum,
            dampening,
            weight_decay: wd,
            nesterov,
            maximize,
        };
        let mut state = SgdState::new();
        let mut buf: Option<Vec<f32>> = None;
        run_steps(
            &stream,
            |p, g| {
                k.sgd_step(&stream, p, g, &mut state, &hyper)
                    .expect("sgd step")
            },
            |p, g| {
                let (lr, m, d, wd) = (
                    hyper.lr as f32,
                    momentum as f32,
                    dampening as f32,
                    wd as f32,
                );
                let first = buf.is_none();
                let b = buf.get_or_insert_with(|| vec![0.0; N]);
                for i in 0..N {
                    let mut grad = if maximize { -g[i] } else { g[i] };
                    if wd != 0.0 {
                        grad += wd * p[i];
                    }
                    if m != 0.0 {
                        b[i] = if first {
                            grad
                        } else {
                            b[i] * m + (1.0 - d) * grad
                        };
                        grad = if nesterov { grad + m * b[i] } else { b[i] };
                    }
                    p[i] += -lr * grad;
                }
            },
        );
        assert_eq!(state.step, STEPS as u64);
    }
}

#[test]
fn adam_and_adamw_match_torch() {
    let Some((stream, k)) = setup() else { return };
    for (decoupled, amsgrad, maximize, wd) in [
        (false, false, false, 0.0),
        (false, true, false, 0.01),
        (true, false, true, 0.01),
        (true, true, false, 0.1),
    ] {
        let hyper = AdamHyper {
            lr: 1e-2,
            weight_decay: wd,
            amsgrad,
            maximize,
            decoupled_weight_decay: decoupled,
            ..AdamHyper::default()
        };
        let mut state = AdamState::new(&stream, N, &hyper).expect("state");
        let (mut m, mut v, mut vmax) = (vec![0f32; N], vec![0f32; N], vec![0f32; N]);
        let mut t = 0u64;
        run_steps(
            &stream,
            |p, g| {
                k.adam_step(&stream, p, g, &mut state, &hyper)
                    .expect("adam step")
            },
            |p, g| {
                t += 1;
                let (b1, b2) = hyper.betas;
                let step_size = (hyper.lr / (1.0 - b1.powf(t as f64))) as f32;
                let bc2_sqrt = (1.0 - b2.powf(t as f64)).sqrt() as f32;
                let (lr, eps, wd) = (hyper.lr as f32, hyper.eps as f32, wd as f32);
                for i in 0..N {
                    let mut grad = if maximize { -g[i] } else { g[i] };
                    if wd != 0.0 {
                        if decoupled {
                            p[i] *= 1.0 - lr * wd;
                        } else {
                            grad += wd * p[i];
                        }
                    }
                    m[i] = lerp(m[i], grad, 1.0 - b1 as f32);
                    v[i] = v[i] * b2 as f32 + (1.0 - b2 as f32) * (grad * grad);
                    let mut second = v[i];
                    if amsgrad {
                        vmax[i] = vmax[i].max(v[i]);
                        second = vmax[i];
                    }
                    let denom = second.sqrt() / bc2_sqrt + eps;
                    p[i] += -step_size * (m[i] / denom);
                }
            },
        );
        let exported = state.export(&stream).expect("export");
        assert_eq!(exported.scalars["step"], STEPS as f64);
        assert_close("exp_avg", &exported.tensors["exp_avg"], &m);
        assert_close("exp_avg_sq", &exported.tensors["exp_avg_sq"], &v);
        let back = AdamState::import(&stream, &exported, N).expect("import");
        assert_eq!(back.step, STEPS as u64);
        assert_eq!(back.max_exp_avg_sq.is_some(), amsgrad);
    }
}

#[test]
fn adagrad_matches_torch() {
    let Some((stream, k)) = setup() else { return };
    let hyper = AdagradHyper {
        lr: 0.1,
        lr_decay: 0.01,
        weight_decay: 0.01,
        initial_accumulator_value: 0.1,
        ..AdagradHyper::default()
    };
    let mut state = AdagradState::new(&stream, N, &hyper).expect("state");
    let mut sum = vec![0.1f32; N];
    let mut t = 0u64;
    run_steps(
        &stream,
        |p, g| {
            k.adagrad_step(&stream, p, g, &mut state, &hyper)
                .expect("adagrad step")
        },
        |p, g| {
            t += 1;
            let clr = (hyper.lr / (1.0 + (t as f64 - 1.0) * hyper.lr_decay)) as f32;
            for i in 0..N {
                let grad = g[i] + hyper.weight_decay as f32 * p[i];
                sum[i] += grad * grad;
                let std = sum[i].sqrt() + hyper.eps as f32;
                p[i] += -clr * (grad / std);
            }
        },
    );
}

#[test]
fn rmsprop_matches_torch() {
    let Some((stream, k)) = setup() else { return };
    for (centered, momentum) in [(false, 0.0), (true, 0.0), (true, 0.9), (false, 0.5)] {
        let hyper = RmspropHyper {
            lr: 1e-2,
            centered,
            momentum,
            weight_decay: 0.01,
            ..RmspropHyper::default()
        };
        let mut state = RmspropState::new(&stream, N, &hyper).expect("state");
        let (mut sq, mut ga, mut buf) = (vec![0f32; N], vec![0f32; N], vec![0f32; N]);
        run_steps(
            &stream,
            |p, g| {
                k.rmsprop_step(&stream, p, g, &mut state, &hyper)
                    .expect("rmsprop step")
            },
            |p, g| {
                let (lr, alpha, eps, m) = (
                    hyper.lr as f32,
                    hyper.alpha as f32,
                    hyper.eps as f32,
                    momentum as f32,
                );
                for i in 0..N {
                    let grad = g[i] + hyper.weight_decay as f32 * p[i];
                    sq[i] = sq[i] * alpha + (1.0 - alpha) * (grad * grad);
                    let mut avg = if centered {
                        ga[i] = lerp(ga[i], grad, 1.0 - alpha);
                        (sq[i] - ga[i] * ga[i]).sqrt()
                    } else {
                        sq[i].sqrt()
                    };
                    avg += eps;
                    if m > 0.0 {
                        buf[i] = buf[i] * m + grad / avg;
                        p[i] += -lr * buf[i];
                    } else {
                        p[i] += -lr * (grad / avg);
                    }
                }
            },
        );
    }
}

#[test]
fn flatten_unflatten_round_trip() {
    let Some((stream, k)) = setup() else { return };
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
fn flatten_bf16_and_f64() {
    let Some((stream, k)) = setup() else { return };
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
