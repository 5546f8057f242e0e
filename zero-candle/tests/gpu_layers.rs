//! The fused layers on a GPU against the same ops on the CPU (the
//! reference): values and gradients (inputs, and the norms' weight and
//! bias) of causal attention (packed, and split with grouped K/V heads,
//! also within sliding windows and with gpt-oss's sinks; bf16 and f16 on
//! tensor cores from sm_80;
//! heads of 256, wider than the kernels, composed), LayerNorm/RMSNorm (also after
//! a residual add; RMSNorm also with Gemma's weight offset), GELU (both
//! forms), SiLU, SwiGLU, GeGLU, rotary embeddings,
//! cross-entropy and the `Embedding` table's gradient, and `Linear` (alone,
//! with its activation in one op, `forward_activated`, and on its input,
//! `forward_on_activated`; its bias gradient
//! also over up to 70001 rows, in f64 too) through Candle's GEMM and through cuBLASLt
//! (`set_linear_cublaslt`: tanh-GELU in the forward's epilogue, the bias gradient in the
//! weight gradient's), in f32, bf16 and f16, at shapes that are not multiples of the kernels'
//! tiles (T = 1, 7, 65, 200; head_dim 32, 48, 64, 128; a single row).
//!
//! Both devices get the same input values (rounded to the dtype once, on the
//! host), so the differences are the kernels' own: f32 agrees to about 1e-4
//! of the tensor's scale, 16-bit types to a few units in the last place.
//! `cargo test -p zero-candle --features cuda --test gpu_layers -- --ignored`
#![cfg(feature = "cuda")]

use candle_core::{DType, Device, Module, Result, Tensor, Var};
use zero_candle::nn::ops::{
    causal_attention, causal_self_attention, causal_self_attention_rows, cross_entropy,
    cross_entropy_with_ignore, geglu, gelu, gelu_erf, rotary_embedding, silu, sink_attention,
    sliding_window_attention, swiglu,
};
use zero_candle::nn::{set_linear_cublaslt, Activation, Embedding, LayerNorm, Linear, RmsNorm};

const DTYPES: [DType; 3] = [DType::F32, DType::BF16, DType::F16];

fn gpu() -> Device {
    Device::new_cuda(0).expect("a CUDA device (these tests need a GPU)")
}

/// Deterministic values in `[-scale, scale)`, as an f32 CPU tensor of
/// `shape` converted to `dtype` (so both devices see the same rounding).
fn values(shape: &[usize], seed: u64, scale: f32, dtype: DType) -> Result<Tensor> {
    let n: usize = shape.iter().product();
    let mut state = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    let data: Vec<f32> = (0..n)
        .map(|_| {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((state >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
        })
        .collect();
    Tensor::from_vec(data, shape, &Device::Cpu)?.to_dtype(dtype)
}

/// Relative tolerance of `dtype` against the tensor's largest magnitude.
fn tolerance(dtype: DType) -> f32 {
    match dtype {
        DType::BF16 => 4.0 / 256.0, // a few ulps of an 8-bit mantissa
        DType::F16 => 4.0 / 2048.0, // a few ulps of an 11-bit mantissa
        _ => 1e-4,
    }
}

fn host(t: &Tensor) -> Vec<f32> {
    t.to_dtype(DType::F32)
        .and_then(|t| t.to_device(&Device::Cpu))
        .and_then(|t| t.flatten_all())
        .and_then(|t| t.to_vec1::<f32>())
        .expect("copying a result to the host")
}

/// Asserts `gpu` matches `cpu` within `tolerance(dtype)` of cpu's scale,
/// or within `floor` (the f32 rounding of values computed from the inputs:
/// an output far smaller than its inputs, such as GELU's far negative tail
/// `0.5·x·(1 + tanh(..))`, carries the absolute error of the terms it
/// cancels, on either device).
fn assert_close(what: &str, gpu: &Tensor, cpu: &Tensor, dtype: DType, floor: f32) {
    assert_eq!(gpu.dims(), cpu.dims(), "{what}: shapes differ");
    let (g, c) = (host(gpu), host(cpu));
    let scale = c.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-6);
    let tol = (tolerance(dtype) * scale).max(floor);
    let mut worst = (0usize, 0f32);
    for (i, (a, b)) in g.iter().zip(&c).enumerate() {
        if a.is_nan() && b.is_nan() {
            continue;
        }
        let diff = (a - b).abs();
        assert!(
            diff.is_finite(),
            "{what} [{dtype:?}]: element {i}: gpu {a} vs cpu {b}"
        );
        if diff > worst.1 {
            worst = (i, diff);
        }
    }
    let (i, diff) = worst;
    assert!(
        diff <= tol,
        "{what} [{dtype:?}]: element {i}: gpu {} vs cpu {} (|diff| {diff:e} > {tol:e}, scale {scale})",
        g[i],
        c[i]
    );
}

/// Runs `f` on `inputs` (moved to `device`) as variables, backpropagates
/// `sum(f(..) * upstream)`, and returns the output and each input's gradient.
fn run(
    device: &Device,
    inputs: &[&Tensor],
    upstream: &Tensor,
    f: &dyn Fn(&[Tensor]) -> Result<Tensor>,
) -> Result<(Tensor, Vec<Tensor>)> {
    let vars = inputs
        .iter()
        .map(|t| Var::from_tensor(&t.to_device(device)?))
        .collect::<Result<Vec<_>>>()?;
    let tensors: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
    let y = f(&tensors)?;
    let loss = y
        .broadcast_mul(&upstream.to_device(device)?)?
        .to_dtype(DType::F32)?
        .sum_all()?;
    let grads = loss.backward()?;
    let grads = vars
        .iter()
        .map(|v| {
            grads
                .get(v.as_tensor())
                .cloned()
                .ok_or_else(|| candle_core::Error::Msg("an input got no gradient".into()))
        })
        .collect::<Result<Vec<_>>>()?;
    Ok((y, grads))
}

/// Compares `f` on the GPU against the CPU, output and every gradient.
fn compare(
    what: &str,
    dtype: DType,
    inputs: &[&Tensor],
    upstream: &Tensor,
    f: &dyn Fn(&[Tensor]) -> Result<Tensor>,
) -> Result<()> {
    let (y_cpu, g_cpu) = run(&Device::Cpu, inputs, upstream, f)?;
    let (y_gpu, g_gpu) = run(&gpu(), inputs, upstream, f)?;
    assert!(y_gpu.device().is_cuda(), "{what}: the GPU run left the GPU");
    let largest = inputs
        .iter()
        .chain([&upstream])
        .flat_map(|t| host(t))
        .fold(0f32, |m, v| m.max(v.abs()));
    let floor = 8.0 * f32::EPSILON * largest;
    assert_close(&format!("{what} output"), &y_gpu, &y_cpu, dtype, floor);
    for (i, (g, c)) in g_gpu.iter().zip(&g_cpu).enumerate() {
        assert_close(&format!("{what} gradient of input {i}"), g, c, dtype, floor);
    }
    Ok(())
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn attention_matches_the_cpu() -> Result<()> {
    // (batch, time, heads, head_dim)
    let shapes = [
        (2, 1, 2, 32),
        (1, 7, 3, 64),
        (2, 65, 2, 128),
        (1, 200, 2, 64),
        (1, 33, 1, 48),
        (1, 40, 1, 100),
    ];
    for dtype in DTYPES {
        for (seed, &(b, t, h, d)) in shapes.iter().enumerate() {
            let qkv = values(&[b, t, 3 * h * d], seed as u64, 2.0, dtype)?;
            let upstream = values(&[b, t, h * d], 100 + seed as u64, 1.0, dtype)?;
            compare(
                &format!("attention b{b} t{t} h{h} d{d}"),
                dtype,
                &[&qkv],
                &upstream,
                &|x| causal_self_attention(&x[0], h),
            )?;
            compare(
                &format!("attention over rows b{b} t{t} h{h} d{d}"),
                dtype,
                &[&qkv.flatten_to(1)?],
                &upstream.flatten_to(1)?,
                &|x| causal_self_attention_rows(&x[0], t, h),
            )?;
        }
    }
    Ok(())
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn grouped_attention_matches_the_cpu() -> Result<()> {
    // (batch, time, heads, kv_heads, head_dim): both tensor-core widths,
    // groups of 2, 4 and 3, one K/V head, T within a tile, across tiles and
    // odd, a narrower head (16-bit loads).
    let shapes = [
        (2, 65, 4, 2, 64),
        (1, 130, 4, 1, 128),
        (1, 7, 8, 2, 128),
        (2, 200, 4, 4, 64),
        (1, 33, 6, 2, 48),
        (1, 129, 32, 8, 128),
    ];
    for dtype in DTYPES {
        for (seed, &(b, t, h, kvh, d)) in shapes.iter().enumerate() {
            let seed = 10 * seed as u64;
            let q = values(&[b, t, h, d], seed, 2.0, dtype)?;
            let k = values(&[b, t, kvh, d], seed + 1, 2.0, dtype)?;
            let v = values(&[b, t, kvh, d], seed + 2, 2.0, dtype)?;
            let upstream = values(&[b, t, h, d], seed + 3, 1.0, dtype)?;
            compare(
                &format!("grouped attention b{b} t{t} h{h} kv{kvh} d{d}"),
                dtype,
                &[&q, &k, &v],
                &upstream,
                &|x| causal_attention(&x[0], &x[1], &x[2]),
            )?;
        }
    }
    Ok(())
}

/// Sliding windows on both kernel families: only itself, within a key
/// tile, a tile's rows and one more, across tiles; both tensor-core widths
/// (tiles of 64 and 32 keys) and the CUDA-core kernels (f32).
#[test]
#[ignore = "needs a CUDA GPU"]
fn sliding_window_attention_matches_the_cpu() -> Result<()> {
    let shapes = [(1, 196, 4, 2, 64), (2, 139, 2, 2, 128), (1, 70, 4, 1, 48)];
    for dtype in DTYPES {
        for (seed, &(b, t, h, kvh, d)) in shapes.iter().enumerate() {
            for window in [1, 17, 33, 65, 100] {
                let seed = 100 * seed as u64 + window as u64;
                let q = values(&[b, t, h, d], seed, 2.0, dtype)?;
                let k = values(&[b, t, kvh, d], seed + 1, 2.0, dtype)?;
                let v = values(&[b, t, kvh, d], seed + 2, 2.0, dtype)?;
                let upstream = values(&[b, t, h, d], seed + 3, 1.0, dtype)?;
                compare(
                    &format!("window {window} attention b{b} t{t} h{h} kv{kvh} d{d}"),
                    dtype,
                    &[&q, &k, &v],
                    &upstream,
                    &|x| sliding_window_attention(&x[0], &x[1], &x[2], window),
                )?;
            }
        }
    }
    Ok(())
}

/// gpt-oss's sinks joined to the fused attention (their gradient to a
/// hook), windowed and not, on both tensor-core widths and the CUDA cores
/// (f32): output and the gradients of q, k, v and the sinks against the CPU.
#[test]
#[ignore = "needs a CUDA GPU"]
fn sink_attention_matches_the_cpu() -> Result<()> {
    use std::sync::Arc;
    use zero_candle::nn::{GradCollector, GradHook};
    for dtype in DTYPES {
        for (seed, &(b, t, h, kvh, d)) in [(1, 70, 4, 2, 64), (2, 33, 4, 1, 128)].iter().enumerate()
        {
            for window in [None, Some(17)] {
                let seed = 1000 + 10 * seed as u64;
                let on = |device: &Device| -> Result<Vec<Tensor>> {
                    let var = |shape: &[usize], seed, scale| {
                        Var::from_tensor(&values(shape, seed, scale, dtype)?.to_device(device)?)
                    };
                    let (q, k, v) = (
                        var(&[b, t, h, d], seed, 2.0)?,
                        var(&[b, t, kvh, d], seed + 1, 2.0)?,
                        var(&[b, t, kvh, d], seed + 2, 2.0)?,
                    );
                    let sinks = var(&[h], seed + 3, 3.0)?;
                    let upstream =
                        values(&[b, t, h, d], seed + 4, 1.0, dtype)?.to_device(device)?;
                    let collector = Arc::new(GradCollector::new());
                    let hook: Arc<dyn GradHook> = collector.clone();
                    let y = sink_attention(&q, &k, &v, &sinks, window, Some(hook))?;
                    let grads = (&y * upstream)?
                        .to_dtype(DType::F32)?
                        .sum_all()?
                        .backward()?;
                    let mut out = vec![y];
                    for x in [&q, &k, &v] {
                        out.push(grads.get(x).cloned().expect("a gradient"));
                    }
                    out.push(collector.get(&sinks).expect("the sinks' gradient"));
                    Ok(out)
                };
                let (cpu, gpu) = (on(&Device::Cpu)?, on(&gpu())?);
                assert!(gpu[0].device().is_cuda(), "the GPU run left the GPU");
                let what = format!("sinks b{b} t{t} h{h} kv{kvh} d{d} window {window:?}");
                for (name, (g, c)) in ["output", "dq", "dk", "dv", "dsinks"]
                    .iter()
                    .zip(gpu.iter().zip(&cpu))
                {
                    assert_close(
                        &format!("{what} {name}"),
                        g,
                        c,
                        dtype,
                        8.0 * f32::EPSILON * 3.0,
                    );
                }
            }
        }
    }
    Ok(())
}

/// Heads of 256 (Gemma's), wider than the fused kernels take: the split
/// attention runs composed of Candle's ops on CUDA, grouped and not,
/// windowed and not, one position and several, and matches the fused CPU
/// op (which rounds once where the composition rounds the scores and the
/// weights to the input type: within the same few ulps).
#[test]
#[ignore = "needs a CUDA GPU"]
fn wide_head_attention_runs_composed_and_matches_the_cpu() -> Result<()> {
    // (batch, time, heads, kv_heads, head_dim)
    let shapes = [
        (2, 33, 4, 2, 256),
        (1, 1, 4, 2, 256),
        (1, 70, 8, 1, 256),
        (2, 17, 2, 2, 256),
    ];
    for dtype in DTYPES {
        for (seed, &(b, t, h, kvh, d)) in shapes.iter().enumerate() {
            for window in [None, Some(1), Some(5)] {
                let seed = 1000 + 10 * seed as u64 + window.unwrap_or(0) as u64;
                let q = values(&[b, t, h, d], seed, 2.0, dtype)?;
                let k = values(&[b, t, kvh, d], seed + 1, 2.0, dtype)?;
                let v = values(&[b, t, kvh, d], seed + 2, 2.0, dtype)?;
                let upstream = values(&[b, t, h, d], seed + 3, 1.0, dtype)?;
                compare(
                    &format!("wide attention window {window:?} b{b} t{t} h{h} kv{kvh} d{d}"),
                    dtype,
                    &[&q, &k, &v],
                    &upstream,
                    &|x| match window {
                        Some(w) => sliding_window_attention(&x[0], &x[1], &x[2], w),
                        None => causal_attention(&x[0], &x[1], &x[2]),
                    },
                )?;
            }
        }
    }
    Ok(())
}

/// The packed form has no composed fallback: a head wider than the
/// kernels is an error that names it.
#[test]
#[ignore = "needs a CUDA GPU"]
fn head_dim_above_128_is_a_clear_error() -> Result<()> {
    let qkv = Tensor::zeros((1, 4, 3 * 160), DType::F32, &gpu())?;
    let err = causal_self_attention(&qkv, 1).unwrap_err().to_string();
    assert!(err.contains("head_dim 160"), "{err}");
    Ok(())
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn layer_norm_and_rms_norm_match_the_cpu() -> Result<()> {
    let shapes: [&[usize]; 4] = [&[1, 768], &[37, 100], &[2, 3, 1000], &[5, 33]];
    for dtype in DTYPES {
        for (seed, shape) in shapes.iter().enumerate() {
            let n = *shape.last().unwrap_or(&1);
            let seed = seed as u64;
            // An offset mean, so that removing it matters.
            let x = (values(shape, seed, 2.0, dtype)? + 0.5)?;
            let w = (values(&[n], 10 + seed, 0.5, dtype)? + 1.0)?;
            let b = values(&[n], 20 + seed, 0.5, dtype)?;
            let upstream = values(shape, 30 + seed, 1.0, dtype)?;
            compare(
                &format!("LayerNorm {shape:?}"),
                dtype,
                &[&x, &w, &b],
                &upstream,
                &|t| LayerNorm::new(t[1].clone(), t[2].clone(), 1e-5, None).forward(&t[0]),
            )?;
            compare(
                &format!("RmsNorm {shape:?}"),
                dtype,
                &[&x, &w],
                &upstream,
                &|t| RmsNorm::new(t[1].clone(), 1e-5, None).forward(&t[0]),
            )?;
            // Gemma's: a weight centred on zero, scaling by 1 + w.
            let centred = values(&[n], 90 + seed, 0.5, dtype)?;
            compare(
                &format!("RmsNorm with a weight offset {shape:?}"),
                dtype,
                &[&x, &centred],
                &upstream,
                &|t| {
                    RmsNorm::new(t[1].clone(), 1e-5, None)
                        .with_weight_offset(1.0)
                        .forward(&t[0])
                },
            )?;
        }
    }
    Ok(())
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn norms_after_a_residual_add_match_the_cpu() -> Result<()> {
    let shapes: [&[usize]; 3] = [&[1, 768], &[37, 100], &[2, 3, 1000]];
    for dtype in DTYPES {
        for (seed, shape) in shapes.iter().enumerate() {
            let n = *shape.last().unwrap_or(&1);
            let seed = seed as u64;
            let x = (values(shape, 40 + seed, 2.0, dtype)? + 0.5)?;
            let residual = values(shape, 50 + seed, 2.0, dtype)?;
            let w = (values(&[n], 60 + seed, 0.5, dtype)? + 1.0)?;
            let b = values(&[n], 70 + seed, 0.5, dtype)?;
            // Both outputs stacked: the gradient of `h` then has two
            // sources, the norm and the upstream's half for `h` itself.
            let mut stacked = vec![2];
            stacked.extend_from_slice(shape);
            let upstream = values(&stacked, 80 + seed, 1.0, dtype)?;
            let stack = |(h, y): (Tensor, Tensor)| Tensor::stack(&[&h, &y], 0);
            compare(
                &format!("LayerNorm after a residual add {shape:?}"),
                dtype,
                &[&x, &residual, &w, &b],
                &upstream,
                &|t| {
                    let norm = LayerNorm::new(t[2].clone(), t[3].clone(), 1e-5, None);
                    stack(norm.forward_residual(&t[0], &t[1])?)
                },
            )?;
            compare(
                &format!("RmsNorm after a residual add {shape:?}"),
                dtype,
                &[&x, &residual, &w],
                &upstream,
                &|t| stack(RmsNorm::new(t[2].clone(), 1e-5, None).forward_residual(&t[0], &t[1])?),
            )?;
            let centred = (&w - 1.0)?;
            compare(
                &format!("RmsNorm with a weight offset after a residual add {shape:?}"),
                dtype,
                &[&x, &residual, &centred],
                &upstream,
                &|t| {
                    let norm = RmsNorm::new(t[2].clone(), 1e-5, None).with_weight_offset(1.0);
                    stack(norm.forward_residual(&t[0], &t[1])?)
                },
            )?;
            // On the GPU too, `h` is the add's, bit for bit.
            let (x, residual) = (x.to_device(&gpu())?, residual.to_device(&gpu())?);
            let norm = RmsNorm::new(w.to_device(&gpu())?, 1e-5, None);
            let (h, _) = norm.forward_residual(&x, &residual)?;
            assert_eq!(
                host(&h),
                host(&(&x + &residual)?),
                "h {shape:?} [{dtype:?}]"
            );
        }
    }
    Ok(())
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn activations_match_the_cpu() -> Result<()> {
    let shapes: [&[usize]; 3] = [&[1], &[1000], &[3, 257]];
    type Act = fn(&Tensor) -> Result<Tensor>;
    let acts: [(&str, Act); 3] = [("gelu", gelu), ("gelu_erf", gelu_erf), ("silu", silu)];
    for dtype in DTYPES {
        for (seed, shape) in shapes.iter().enumerate() {
            let x = values(shape, seed as u64, 6.0, dtype)?;
            let upstream = values(shape, 50 + seed as u64, 1.0, dtype)?;
            for (name, act) in acts {
                compare(
                    &format!("{name} {shape:?}"),
                    dtype,
                    &[&x],
                    &upstream,
                    &|t| act(&t[0]),
                )?;
            }
        }
    }
    Ok(())
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn linear_through_cublaslt_matches_the_cpu() -> Result<()> {
    set_linear_cublaslt(true);
    let shapes = [(1, 1, 1), (7, 65, 33), (64, 768, 3072)];
    for dtype in DTYPES {
        compare_linear("Linear", dtype, &shapes, 0, &|layer, x| layer.forward(x))?;
    }
    // Back to the default.
    set_linear_cublaslt(true);
    Ok(())
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn linear_with_its_activation_matches_the_cpu() -> Result<()> {
    // (rows, in, out): 8 and 3072 outputs take the tanh-GELU in cuBLASLt's
    // epilogue (its aux matrix wants a multiple of 8), 33 keeps it out of
    // the GEMM.
    let shapes = [(1, 1, 8), (7, 65, 33), (64, 768, 3072)];
    let activations = [
        Activation::Gelu,
        Activation::GeluErf,
        Activation::Silu,
        Activation::Relu2,
    ];
    // Process-wide, as `linear_through_cublaslt_matches_the_cpu` sets it:
    // either path must match the CPU.
    for cublaslt in [false, true] {
        set_linear_cublaslt(cublaslt);
        for dtype in DTYPES {
            for activation in activations {
                let what = format!("Linear then {activation:?} (cuBLASLt {cublaslt})");
                compare_linear(&what, dtype, &shapes, 40, &|layer, x| {
                    layer.forward_activated(x, activation)
                })?;
            }
        }
    }
    // Back to the default.
    set_linear_cublaslt(true);
    Ok(())
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn linear_on_its_activated_input_matches_the_cpu() -> Result<()> {
    // The activation on the input, computed again in the backward
    // (`forward_on_activated`, the GPTs' MLP projection).
    let shapes = [(1, 1, 8), (7, 65, 33), (64, 3072, 768)];
    let activations = [
        Activation::Gelu,
        Activation::GeluErf,
        Activation::Silu,
        Activation::Relu2,
    ];
    for dtype in DTYPES {
        for activation in activations {
            let what = format!("{activation:?} then Linear");
            compare_linear(&what, dtype, &shapes, 80, &|layer, x| {
                layer.forward_on_activated(x, activation)
            })?;
        }
    }
    Ok(())
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn linear_bias_gradient_matches_the_cpu() -> Result<()> {
    // Either path: the weight-gradient GEMM's BGRADB epilogue through
    // cuBLASLt, or zero-nccl's column sums (process-wide, as the tests
    // above set it).
    for cublaslt in [false, true] {
        set_linear_cublaslt(cublaslt);
        bias_gradients_match_the_cpu()?;
    }
    // Back to the default.
    set_linear_cublaslt(true);
    Ok(())
}

/// [`linear_bias_gradient_matches_the_cpu`] on the path set.
fn bias_gradients_match_the_cpu() -> Result<()> {
    // The bias gradient on the GPU (Candle's `sum(0)` for f64) against the
    // CPU's row-by-row sum: rows not multiples of the column sums' 8 row
    // lanes nor of their chunks (129: two chunks, 1001: eight of 126,
    // 70001: the 512-chunk cap, 511 of 137), widths not multiples of their
    // 32 columns, and a [batch, time, in] input. Each sum is checked to
    // come out bit for bit the same a second time.
    let shapes: [(&[usize], usize); 6] = [
        (&[1, 1], 1),
        (&[7, 3], 33),
        (&[129, 5], 100),
        (&[1001, 4], 300),
        (&[70_001, 2], 33),
        (&[3, 43, 8], 65),
    ];
    for dtype in DTYPES.into_iter().chain([DType::F64]) {
        for (seed, &(x_shape, out_dim)) in shapes.iter().enumerate() {
            let seed = 60 + 4 * seed as u64;
            let in_dim = x_shape[x_shape.len() - 1];
            let rows: usize = x_shape[..x_shape.len() - 1].iter().product();
            let x = values(x_shape, seed, 1.0, dtype)?;
            let w = values(&[out_dim, in_dim], seed + 1, 1.0, dtype)?;
            let b = values(&[out_dim], seed + 2, 1.0, dtype)?;
            let mut y_shape = x_shape[..x_shape.len() - 1].to_vec();
            y_shape.push(out_dim);
            // Shifted off zero so that the sums grow with the rows.
            let upstream = (values(&y_shape, seed + 3, 1.0, dtype)? + 0.25)?;
            let bias_grad = |device: &Device| -> Result<Tensor> {
                let (_, grads) = run(device, &[&x, &w, &b], &upstream, &|t| {
                    Linear::new(t[1].clone(), Some(t[2].clone()), None).forward(&t[0])
                })?;
                Ok(grads[2].clone())
            };
            let (gpu_grad, cpu_grad) = (bias_grad(&gpu())?, bias_grad(&Device::Cpu)?);
            assert!(
                gpu_grad.device().is_cuda(),
                "the bias gradient left the GPU"
            );
            let what = format!("Linear bias gradient, {rows} rows of {out_dim}");
            assert_close(
                &what,
                &gpu_grad,
                &cpu_grad,
                dtype,
                8.0 * f32::EPSILON * rows as f32,
            );
            // A fixed order of sums: the same bits every run.
            let again = bias_grad(&gpu())?;
            assert_eq!(
                host(&again),
                host(&gpu_grad),
                "{what} [{dtype:?}]: not deterministic"
            );
        }
    }
    Ok(())
}

/// `forward(layer, x)` of a Linear with a bias and without one against
/// the CPU, values and gradients, for each `(rows, in, out)` of `shapes`;
/// the input starts one row into its buffer, off cuBLASLt's 256-byte
/// alignment. The values are seeded from `seed` on.
fn compare_linear(
    what: &str,
    dtype: DType,
    shapes: &[(usize, usize, usize)],
    seed: u64,
    forward: &dyn Fn(&Linear, &Tensor) -> Result<Tensor>,
) -> Result<()> {
    for (i, &(rows, in_dim, out_dim)) in shapes.iter().enumerate() {
        let seed = seed + i as u64;
        let x = values(&[rows + 1, in_dim], seed, 1.0, dtype)?;
        let w = values(&[out_dim, in_dim], 10 + seed, 1.0, dtype)?;
        let b = values(&[out_dim], 20 + seed, 1.0, dtype)?;
        let upstream = values(&[rows, out_dim], 30 + seed, 1.0, dtype)?;
        let what = format!("{what} {rows}x{in_dim}->{out_dim} {dtype:?}");
        compare(&what, dtype, &[&x, &w, &b], &upstream, &|t| {
            let layer = Linear::new(t[1].clone(), Some(t[2].clone()), None);
            forward(&layer, &t[0].narrow(0, 1, rows)?)
        })?;
        compare(
            &format!("{what} without bias"),
            dtype,
            &[&x, &w],
            &upstream,
            &|t| {
                forward(
                    &Linear::new(t[1].clone(), None, None),
                    &t[0].narrow(0, 1, rows)?,
                )
            },
        )?;
    }
    Ok(())
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn swiglu_and_geglu_match_the_cpu() -> Result<()> {
    let shapes: [&[usize]; 3] = [&[1], &[1000], &[3, 257]];
    for dtype in DTYPES {
        for (seed, shape) in shapes.iter().enumerate() {
            let seed = seed as u64;
            let gate = values(shape, 60 + seed, 6.0, dtype)?;
            let up = values(shape, 70 + seed, 2.0, dtype)?;
            let upstream = values(shape, 80 + seed, 1.0, dtype)?;
            compare(
                &format!("swiglu {shape:?}"),
                dtype,
                &[&gate, &up],
                &upstream,
                &|t| swiglu(&t[0], &t[1]),
            )?;
            compare(
                &format!("geglu {shape:?}"),
                dtype,
                &[&gate, &up],
                &upstream,
                &|t| geglu(&t[0], &t[1]),
            )?;
        }
    }
    Ok(())
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn rotary_embedding_matches_the_cpu() -> Result<()> {
    // (batch, time, heads, head_dim): one pair, odd counts, Llama widths.
    let shapes = [
        (1, 1, 1, 2),
        (2, 7, 3, 10),
        (2, 65, 4, 64),
        (1, 200, 2, 128),
    ];
    for dtype in DTYPES {
        for (seed, &(batch, time, heads, head_dim)) in shapes.iter().enumerate() {
            let seed = seed as u64;
            let x = values(&[batch, time, heads, head_dim], 90 + seed, 3.0, dtype)?;
            let upstream = values(&[batch, time, heads, head_dim], 100 + seed, 1.0, dtype)?;
            // The op is linear in x for any tables; the tables get no
            // gradient, so they are constants of the function compared.
            let cos = values(&[time, head_dim / 2], 110 + seed, 1.0, dtype)?;
            let sin = values(&[time, head_dim / 2], 120 + seed, 1.0, dtype)?;
            compare(
                &format!("rotary_embedding {batch}x{time}, {heads} heads of {head_dim}"),
                dtype,
                &[&x],
                &upstream,
                &|t| {
                    let device = t[0].device();
                    rotary_embedding(&t[0], &cos.to_device(device)?, &sin.to_device(device)?)
                },
            )?;
        }
    }
    Ok(())
}

/// Class indices in `0..vocab`, every `ignore_every`-th replaced by `ignore`.
fn targets(
    rows: usize,
    vocab: usize,
    ignore: Option<(usize, i64)>,
    dtype: DType,
) -> Result<Tensor> {
    let data: Vec<i64> = (0..rows)
        .map(|i| match ignore {
            Some((every, index)) if i % every == 0 => index,
            _ => ((i * 7919 + 13) % vocab) as i64,
        })
        .collect();
    Tensor::from_vec(data, rows, &Device::Cpu)?.to_dtype(dtype)
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn cross_entropy_matches_the_cpu() -> Result<()> {
    // (rows, vocab)
    let shapes = [(1, 50257), (37, 1000), (64, 33)];
    for dtype in DTYPES {
        for (seed, &(rows, vocab)) in shapes.iter().enumerate() {
            let logits = values(&[rows, vocab], seed as u64, 8.0, dtype)?;
            let upstream = Tensor::new(1.5f32, &Device::Cpu)?;
            for target_dtype in [DType::U32, DType::I64] {
                let plain = targets(rows, vocab, None, target_dtype)?;
                compare(
                    &format!("cross_entropy {rows}x{vocab} {target_dtype:?}"),
                    dtype,
                    &[&logits],
                    &upstream,
                    &|t| cross_entropy(&t[0], &plain.to_device(t[0].device())?),
                )?;
                // u32 targets cannot hold -100: ignore a class index instead.
                let ignore = if target_dtype == DType::U32 { 5 } else { -100 };
                let with_ignored = targets(rows, vocab, Some((3, ignore)), target_dtype)?;
                compare(
                    &format!("cross_entropy_with_ignore {rows}x{vocab} {target_dtype:?}"),
                    dtype,
                    &[&logits],
                    &upstream,
                    &|t| {
                        let targets = with_ignored.to_device(t[0].device())?;
                        cross_entropy_with_ignore(&t[0], &targets, ignore)
                    },
                )?;
            }
        }
    }
    Ok(())
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn cross_entropy_with_every_row_ignored_is_nan_with_zero_gradient() -> Result<()> {
    let device = gpu();
    let logits = Var::from_tensor(&values(&[4, 10], 7, 1.0, DType::F32)?.to_device(&device)?)?;
    let ignored = Tensor::new(&[-100i64, -100, -100, -100], &device)?;
    let loss = cross_entropy_with_ignore(logits.as_tensor(), &ignored, -100)?;
    assert!(
        loss.to_scalar::<f32>()?.is_nan(),
        "the mean over no rows is NaN"
    );
    let grads = loss.backward()?;
    let grad = grads
        .get(logits.as_tensor())
        .ok_or_else(|| candle_core::Error::Msg("no logits gradient".into()))?;
    assert!(
        host(grad).iter().all(|&g| g == 0.0),
        "ignored rows get no gradient"
    );
    Ok(())
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn cross_entropy_target_out_of_range_is_nan_on_the_gpu() -> Result<()> {
    // The CPU op refuses it; the GPU cannot without a host sync, so the
    // loss and the row's gradient are NaN and nothing is read out of bounds.
    let device = gpu();
    let logits = Var::from_tensor(&values(&[3, 10], 8, 1.0, DType::F32)?.to_device(&device)?)?;
    let bad = Tensor::new(&[1u32, 10, 2], &device)?;
    let loss = cross_entropy(logits.as_tensor(), &bad)?;
    assert!(loss.to_scalar::<f32>()?.is_nan());
    let grads = loss.backward()?;
    let grad = grads
        .get(logits.as_tensor())
        .ok_or_else(|| candle_core::Error::Msg("no logits gradient".into()))?;
    let grad = host(grad);
    assert!(
        grad[10..20].iter().all(|g| g.is_nan()),
        "the bad row's gradient is NaN"
    );
    assert!(
        grad[..10].iter().all(|g| g.is_finite()),
        "other rows are untouched"
    );
    Ok(())
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn embedding_gradient_matches_the_cpu_bitwise() -> Result<()> {
    // The GPU adds each id's rows in f32, in their order, and rounds once:
    // the CPU's f32 sums of the same values, rounded to the dtype, exactly.
    let device = gpu();
    let (vocab, dim) = (50, 300);
    // Skewed ids, as in text: some take many rows, some never occur.
    let ids: Vec<u32> = (0..1000u32)
        .map(|i| (i * i + 7 * i) % 37 % (1 + i % 20))
        .collect();
    for dtype in DTYPES {
        for ids_dtype in [DType::U32, DType::I64] {
            let ids = Tensor::new(ids.as_slice(), &Device::Cpu)?.to_dtype(ids_dtype)?;
            let grad = values(&[ids.dim(0)?, dim], 11, 1.0, dtype)?;
            let on_gpu =
                table_gradient(&ids.to_device(&device)?, &grad.to_device(&device)?, vocab)?;
            let on_cpu =
                table_gradient(&ids, &grad.to_dtype(DType::F32)?, vocab)?.to_dtype(dtype)?;
            assert_eq!(
                host(&on_gpu),
                host(&on_cpu),
                "{dtype:?} with {ids_dtype:?} ids"
            );
        }
    }
    Ok(())
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn embedding_lookup_matches_the_cpu_and_makes_ids_outside_the_vocabulary_nan() -> Result<()> {
    let device = gpu();
    let (vocab, dim) = (50, 300);
    let all: Vec<u32> = (0..1000u32)
        .map(|i| (i * i + 7 * i) % vocab as u32)
        .collect();
    for dtype in DTYPES {
        let table = values(&[vocab, dim], 5, 1.0, dtype)?;
        let layer = Embedding::new(table.to_device(&device)?, dim, None);
        for ids_dtype in [DType::U8, DType::U32, DType::I64] {
            let ids = Tensor::new(all.as_slice(), &Device::Cpu)?.to_dtype(ids_dtype)?;
            let on_gpu = layer.forward(&ids.to_device(&device)?)?;
            let on_cpu = Embedding::new(table.clone(), dim, None).forward(&ids)?;
            assert_eq!(
                host(&on_gpu),
                host(&on_cpu),
                "{dtype:?} with {ids_dtype:?} ids"
            );
        }
        // Ids outside the vocabulary: NaN rows, the others as on the CPU,
        // and the context still works (no trap).
        let cpu_layer = Embedding::new(table.clone(), dim, None);
        let good = host(&cpu_layer.forward(&Tensor::new(&all[..10], &Device::Cpu)?)?);
        for (ids_dtype, bad) in [(DType::U32, vocab as f64), (DType::I64, -2.0)] {
            let mut with_bad: Vec<f64> = all[..10].iter().map(|&id| id as f64).collect();
            with_bad[3] = bad;
            let ids = Tensor::new(with_bad.as_slice(), &Device::Cpu)?.to_dtype(ids_dtype)?;
            let ids = ids.to_device(&device)?;
            let rows = host(&layer.forward(&ids)?);
            for (i, (row, want)) in rows.chunks(dim).zip(good.chunks(dim)).enumerate() {
                if i == 3 {
                    assert!(
                        row.iter().all(|v| v.is_nan()),
                        "{dtype:?} {ids_dtype:?}: id {bad}"
                    );
                } else {
                    assert_eq!(row, want, "{dtype:?} {ids_dtype:?}: row {i}");
                }
            }
        }
    }
    Ok(())
}

/// The gradient of an `Embedding`'s `[vocab, dim]` table when its lookup of
/// `ids` gets the gradient `grad` (`[ids, dim]`).
fn table_gradient(ids: &Tensor, grad: &Tensor, vocab: usize) -> Result<Tensor> {
    let dim = grad.dim(1)?;
    let table = Var::from_tensor(&Tensor::zeros((vocab, dim), grad.dtype(), grad.device())?)?;
    let lookup = Embedding::new(table.as_tensor().clone(), dim, None).forward(ids)?;
    let grads = (lookup * grad)?.sum_all()?.backward()?;
    grads
        .get(table.as_tensor())
        .cloned()
        .ok_or_else(|| candle_core::Error::Msg("no table gradient".into()))
}

/// The gradient of `x` (in f32) from five contributions: `x * a`, `x * b`,
/// `x * c` and two rows of a concatenation `[pad, x, x]` (views of one
/// gradient, 4 and 4 + n elements in), summed by the backward in one order
/// on every device.
fn summed_gradient(device: &Device, dtype: DType, n: usize) -> Result<Vec<u32>> {
    let on =
        |seed: u64, len: usize, scale: f32| values(&[len], seed, scale, dtype)?.to_device(device);
    let x = Var::from_tensor(&on(4, n, 1.0)?)?;
    let pad = Tensor::zeros(4, dtype, device)?;
    let catted = Tensor::cat(&[&pad, x.as_tensor(), x.as_tensor()], 0)?;
    let mut loss = (catted * on(5, 2 * n + 4, 2.0)?)?.sum_all()?;
    for (seed, scale) in [(1, 4.0), (2, 4.0), (3, 0.01)] {
        loss = (loss + (x.as_tensor() * on(seed, n, scale)?)?.sum_all()?)?;
    }
    let grad = loss.backward()?.get(&x).expect("x has a gradient").clone();
    Ok(host(&grad).into_iter().map(f32::to_bits).collect())
}

/// The backward's sums of a tensor's gradients: the workspace's Candle
/// adds contiguous f32, bf16 and f16 ones 16 bytes a thread on CUDA
/// (`vendor/candle-core`, `grad_sum.rs`), rounding each sum once as the
/// CPU's do: the same bits, for whole 16-byte vectors at aligned and
/// unaligned offsets and for the lengths that take Candle's own kernel.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gradient_sums_match_the_cpu_bit_for_bit() -> Result<()> {
    let gpu = gpu();
    for dtype in DTYPES {
        for n in [1, 7, 8, 4096, 4100, 65_544] {
            let want = summed_gradient(&Device::Cpu, dtype, n)?;
            let got = summed_gradient(&gpu, dtype, n)?;
            let differ = want.iter().zip(&got).filter(|(a, b)| a != b).count();
            assert_eq!(
                differ, 0,
                "{dtype:?}, {n} elements: {differ} sums differ from the CPU's"
            );
        }
    }
    Ok(())
}
