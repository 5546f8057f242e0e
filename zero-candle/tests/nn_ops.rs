//! The fused ops of `zero_candle::nn::ops` against the same functions
//! composed of Candle's tensor ops: values and gradients, f32 and f64 to
//! rounding, bf16 and f16 against the f32 composition on the same (rounded)
//! inputs to their own precision, odd sizes, and bad input.

mod nn_support;

use candle_core::{DType, Device, Tensor, Var, D};
use nn_support::{assert_close, data, values, var, weighted_sum};
use zero_candle::nn::ops;

/// Causal attention composed of tensor ops: the mask as a tensor, the
/// `[batch, heads, time, time]` scores and softmax materialized.
fn composed_attention(qkv: &Tensor, heads: usize) -> Tensor {
    composed_windowed_attention(qkv, heads, None)
}

/// [`composed_attention`] where query `i` sees keys `i - window < j <= i`
/// only (`transformers`' sliding-window mask).
fn composed_windowed_attention(qkv: &Tensor, heads: usize, window: Option<usize>) -> Tensor {
    let (batch, time, width) = qkv.dims3().unwrap();
    let head_dim = width / (3 * heads);
    let qkv = qkv.reshape((batch, time, 3, heads, head_dim)).unwrap();
    let part = |i: usize| {
        qkv.narrow(2, i, 1)
            .unwrap()
            .squeeze(2)
            .unwrap()
            .transpose(1, 2)
            .unwrap()
            .contiguous()
            .unwrap()
    };
    let (q, k, v) = (part(0), part(1), part(2));
    let scores = (q.matmul(&k.t().unwrap().contiguous().unwrap()).unwrap()
        / (head_dim as f64).sqrt())
    .unwrap();
    let seen = |i: usize, j: usize| j <= i && window.is_none_or(|w| i - j < w);
    let mask: Vec<f64> = (0..time)
        .flat_map(|i| (0..time).map(move |j| if seen(i, j) { 0.0 } else { f64::NEG_INFINITY }))
        .collect();
    let mask = Tensor::from_vec(mask, (time, time), &Device::Cpu)
        .unwrap()
        .to_dtype(qkv.dtype())
        .unwrap();
    let weights =
        candle_nn::ops::softmax(&scores.broadcast_add(&mask).unwrap(), D::Minus1).unwrap();
    weights
        .matmul(&v)
        .unwrap()
        .transpose(1, 2)
        .unwrap()
        .reshape((batch, time, heads * head_dim))
        .unwrap()
}

/// The output and the input's gradient under [`weighted_sum`] of `f` at `x`.
fn value_and_grad(x: &Var, f: impl Fn(&Tensor) -> Tensor) -> (Tensor, Tensor) {
    let y = f(x.as_tensor());
    let grads = weighted_sum(&y, 99).backward().unwrap();
    let grad = grads
        .get(x.as_tensor())
        .expect("the input has a gradient")
        .clone();
    (y, grad)
}

/// Shapes `(batch, time, heads, head_dim)`: one row, T not a multiple of
/// any tile, head widths 32, 64 and 128, one head and several.
const ATTENTION_SHAPES: [(usize, usize, usize, usize); 6] = [
    (1, 1, 1, 32),
    (2, 7, 2, 4),
    (2, 65, 2, 32),
    (1, 33, 3, 64),
    (1, 17, 1, 128),
    (3, 5, 4, 8),
];

#[test]
fn attention_matches_the_composed_reference_in_f32_and_f64() {
    for dtype in [DType::F32, DType::F64] {
        let tol = if dtype == DType::F32 { 2e-5 } else { 1e-10 };
        for (i, &(batch, time, heads, head_dim)) in ATTENTION_SHAPES.iter().enumerate() {
            let what = format!("{dtype:?} {batch}x{time}, {heads} heads of {head_dim}");
            // Scores of a few units, so that the softmax is far from uniform.
            let qkv = Var::from_tensor(
                &(data(i as u64, &[batch, time, 3 * heads * head_dim], dtype) * 3.0).unwrap(),
            )
            .unwrap();
            let (y, dqkv) = value_and_grad(&qkv, |x| ops::causal_self_attention(x, heads).unwrap());
            let (y_ref, dqkv_ref) = value_and_grad(&qkv, |x| composed_attention(x, heads));
            assert_close(&format!("{what}: output"), &y, &y_ref, tol);
            assert_close(&format!("{what}: gradient"), &dqkv, &dqkv_ref, tol);
        }
    }
}

#[test]
fn attention_in_16_bits_matches_the_f32_reference_to_its_precision() {
    for (dtype, tol) in [(DType::BF16, 1.6e-2), (DType::F16, 2e-3)] {
        for (i, &(batch, time, heads, head_dim)) in ATTENTION_SHAPES.iter().enumerate() {
            let what = format!("{dtype:?} {batch}x{time}, {heads} heads of {head_dim}");
            let qkv = (data(i as u64, &[batch, time, 3 * heads * head_dim], DType::F32) * 3.0)
                .unwrap()
                .to_dtype(dtype)
                .unwrap();
            let half = Var::from_tensor(&qkv).unwrap();
            let wide = Var::from_tensor(&qkv.to_dtype(DType::F32).unwrap()).unwrap();
            let (y, dqkv) =
                value_and_grad(&half, |x| ops::causal_self_attention(x, heads).unwrap());
            let (y_ref, dqkv_ref) = value_and_grad(&wide, |x| composed_attention(x, heads));
            assert_eq!(y.dtype(), dtype);
            assert_eq!(dqkv.dtype(), dtype);
            let y = y.to_dtype(DType::F32).unwrap();
            let dqkv = dqkv.to_dtype(DType::F32).unwrap();
            assert_close(&format!("{what}: output"), &y, &y_ref, tol);
            assert_close(&format!("{what}: gradient"), &dqkv, &dqkv_ref, tol);
        }
    }
}

#[test]
fn attention_is_causal() {
    // Changing position 4 changes no output before it.
    let (batch, time, heads, head_dim) = (1, 6, 2, 4);
    let qkv = data(5, &[batch, time, 3 * heads * head_dim], DType::F32);
    let y = ops::causal_self_attention(&qkv, heads).unwrap();
    let bumped = qkv
        .slice_assign(
            &[0..1, 4..5, 0..3 * heads * head_dim],
            &Tensor::ones((1, 1, 3 * heads * head_dim), DType::F32, &Device::Cpu).unwrap(),
        )
        .unwrap();
    let y2 = ops::causal_self_attention(&bumped, heads).unwrap();
    let (before, after) = (
        values(&y.narrow(1, 0, 4).unwrap()),
        values(&y2.narrow(1, 0, 4).unwrap()),
    );
    assert_eq!(before, after);
    assert_ne!(
        values(&y.narrow(1, 4, 1).unwrap()),
        values(&y2.narrow(1, 4, 1).unwrap())
    );
}

#[test]
fn attention_takes_strided_input_and_refuses_bad_shapes() {
    // A transposed (non-contiguous) input is made contiguous, not misread.
    let qkv = data(3, &[2, 12, 5], DType::F32).transpose(1, 2).unwrap();
    let got = ops::causal_self_attention(&qkv, 2).unwrap();
    let want = composed_attention(&qkv.contiguous().unwrap(), 2);
    assert_close("strided input", &got, &want, 2e-5);

    let err = ops::causal_self_attention(&data(1, &[2, 3, 12], DType::F32), 5)
        .unwrap_err()
        .to_string();
    assert!(err.contains("3 * heads * head_dim"), "{err}");
    let err = ops::causal_self_attention(&data(1, &[3, 12], DType::F32), 2)
        .unwrap_err()
        .to_string();
    assert!(err.contains("[batch, time, 3 * d]"), "{err}");
    let err = ops::causal_self_attention(&data(1, &[2, 3, 12], DType::F32), 0)
        .unwrap_err()
        .to_string();
    assert!(err.contains("heads"), "{err}");
    let ints = Tensor::zeros((1, 2, 6), DType::U32, &Device::Cpu).unwrap();
    let err = ops::causal_self_attention(&ints, 1)
        .unwrap_err()
        .to_string();
    assert!(err.contains("not supported"), "{err}");
}

#[test]
fn attention_over_rows_is_the_op_over_sequences() {
    // The same op: the same values and gradients bit for bit, in the rows'
    // shape; a row count that is not whole sequences is refused.
    for (i, &(batch, time, heads, head_dim)) in ATTENTION_SHAPES.iter().enumerate() {
        let width = 3 * heads * head_dim;
        let qkv =
            Var::from_tensor(&(data(i as u64, &[batch, time, width], DType::F32) * 3.0).unwrap())
                .unwrap();
        let (y, dqkv) = value_and_grad(&qkv, |x| ops::causal_self_attention(x, heads).unwrap());
        let rows = Var::from_tensor(&qkv.reshape((batch * time, width)).unwrap()).unwrap();
        let (y_rows, dqkv_rows) = value_and_grad(&rows, |x| {
            ops::causal_self_attention_rows(x, time, heads).unwrap()
        });
        assert_eq!(y_rows.dims(), &[batch * time, heads * head_dim]);
        assert_eq!(values(&y_rows), values(&y), "{batch}x{time}: output");
        assert_eq!(dqkv_rows.dims(), &[batch * time, width]);
        assert_eq!(
            values(&dqkv_rows),
            values(&dqkv),
            "{batch}x{time}: gradient"
        );
    }
    let err = ops::causal_self_attention_rows(&data(1, &[10, 12], DType::F32), 4, 2)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("[batch * time, 3 * d]") && err.contains("time 4"),
        "{err}"
    );
    let err = ops::causal_self_attention_rows(&data(1, &[2, 3, 12], DType::F32), 3, 2)
        .unwrap_err()
        .to_string();
    assert!(err.contains("[batch * time, 3 * d]"), "{err}");
}

/// Grouped-query attention composed of tensor ops: each K/V head repeated
/// for its group of query heads (Llama's `repeat_kv`), then the composed
/// masked softmax; q `[batch, time, heads, head_dim]`, k and v `[batch,
/// time, kv_heads, head_dim]`, output as q.
fn composed_grouped_attention(q: &Tensor, k: &Tensor, v: &Tensor) -> Tensor {
    composed_grouped_windowed(q, k, v, None)
}

/// [`composed_grouped_attention`] within a sliding window.
fn composed_grouped_windowed(q: &Tensor, k: &Tensor, v: &Tensor, window: Option<usize>) -> Tensor {
    let (batch, time, heads, head_dim) = q.dims4().unwrap();
    let kv_heads = k.dim(2).unwrap();
    let repeat = |x: &Tensor| {
        x.unsqueeze(3)
            .unwrap()
            .repeat((1, 1, 1, heads / kv_heads, 1))
            .unwrap()
            .reshape((batch, time, heads * head_dim))
            .unwrap()
    };
    let qkv = Tensor::cat(
        &[
            &q.reshape((batch, time, heads * head_dim)).unwrap(),
            &repeat(k),
            &repeat(v),
        ],
        2,
    )
    .unwrap();
    composed_windowed_attention(&qkv, heads, window)
        .reshape((batch, time, heads, head_dim))
        .unwrap()
}

/// Grouped shapes `(batch, time, heads, kv_heads, head_dim)`: groups of 2,
/// 4 and 3, one K/V head, equal heads, odd T.
const GROUPED_SHAPES: [(usize, usize, usize, usize, usize); 5] = [
    (2, 7, 4, 2, 8),
    (1, 33, 4, 1, 16),
    (2, 5, 6, 2, 4),
    (1, 17, 2, 2, 32),
    (1, 1, 3, 1, 8),
];

/// The outputs and the three gradients of `f(q, k, v)` under
/// [`weighted_sum`].
fn grouped_value_and_grads(
    [q, k, v]: [&Var; 3],
    f: impl Fn(&Tensor, &Tensor, &Tensor) -> Tensor,
) -> [Tensor; 4] {
    let y = f(q.as_tensor(), k.as_tensor(), v.as_tensor());
    let grads = weighted_sum(&y, 98).backward().unwrap();
    let grad = |x: &Var| grads.get(x.as_tensor()).expect("a gradient").clone();
    [y.clone(), grad(q), grad(k), grad(v)]
}

#[test]
fn grouped_attention_matches_repeated_heads_in_f32_f64_and_16_bits() {
    let cases = [
        (DType::F64, 1e-10),
        (DType::F32, 2e-5),
        (DType::BF16, 1.6e-2),
        (DType::F16, 2e-3),
    ];
    for (dtype, tol) in cases {
        for (i, &(batch, time, heads, kv_heads, head_dim)) in GROUPED_SHAPES.iter().enumerate() {
            let what = format!(
                "{dtype:?} {batch}x{time}, {heads} heads on {kv_heads} K/V heads of {head_dim}"
            );
            // 16-bit inputs: the reference runs in f32 on the same rounded values.
            let input = |seed: u64, h: usize| {
                (data(seed, &[batch, time, h, head_dim], DType::F32) * 3.0)
                    .unwrap()
                    .to_dtype(dtype)
                    .unwrap()
            };
            let (q, k, v) = (
                input(3 * i as u64, heads),
                input(3 * i as u64 + 1, kv_heads),
                input(3 * i as u64 + 2, kv_heads),
            );
            let vars = [&q, &k, &v].map(|t| Var::from_tensor(t).unwrap());
            let reference_dtype = if dtype == DType::F64 {
                dtype
            } else {
                DType::F32
            };
            let wide = [&q, &k, &v]
                .map(|t| Var::from_tensor(&t.to_dtype(reference_dtype).unwrap()).unwrap());
            let got = grouped_value_and_grads([&vars[0], &vars[1], &vars[2]], |q, k, v| {
                ops::causal_attention(q, k, v).unwrap()
            });
            let want =
                grouped_value_and_grads([&wide[0], &wide[1], &wide[2]], composed_grouped_attention);
            for (name, (got, want)) in ["output", "dq", "dk", "dv"]
                .iter()
                .zip(got.iter().zip(&want))
            {
                assert_eq!(got.dtype(), dtype, "{what}: {name}");
                assert_eq!(got.dims(), want.dims(), "{what}: {name}");
                let got = got.to_dtype(reference_dtype).unwrap();
                assert_close(&format!("{what}: {name}"), &got, want, tol);
            }
        }
    }
}

/// Sliding windows against the composed masked softmax: values and the
/// three gradients, a window of one (each query itself), within and across
/// the sequence, and as long as it or longer (plain causal attention,
/// bitwise); a window of 0 is an error.
#[test]
fn sliding_window_attention_matches_the_masked_softmax() {
    let (batch, time, heads, kv_heads, head_dim) = (2, 19, 4, 2, 8);
    for (dtype, tol) in [
        (DType::F64, 1e-10),
        (DType::F32, 2e-5),
        (DType::BF16, 1.6e-2),
    ] {
        let input = |seed: u64, h: usize| {
            (data(seed, &[batch, time, h, head_dim], DType::F32) * 3.0)
                .unwrap()
                .to_dtype(dtype)
                .unwrap()
        };
        let (q, k, v) = (input(40, heads), input(41, kv_heads), input(42, kv_heads));
        let vars = [&q, &k, &v].map(|t| Var::from_tensor(t).unwrap());
        let reference_dtype = if dtype == DType::F64 {
            dtype
        } else {
            DType::F32
        };
        let wide =
            [&q, &k, &v].map(|t| Var::from_tensor(&t.to_dtype(reference_dtype).unwrap()).unwrap());
        let causal = grouped_value_and_grads([&vars[0], &vars[1], &vars[2]], |q, k, v| {
            ops::causal_attention(q, k, v).unwrap()
        });
        for window in [1, 4, 11, time - 1, time, 3 * time] {
            let what = format!("{dtype:?}, window {window}");
            let got = grouped_value_and_grads([&vars[0], &vars[1], &vars[2]], |q, k, v| {
                ops::sliding_window_attention(q, k, v, window).unwrap()
            });
            let want = grouped_value_and_grads([&wide[0], &wide[1], &wide[2]], |q, k, v| {
                composed_grouped_windowed(q, k, v, Some(window))
            });
            for (i, name) in ["output", "dq", "dk", "dv"].iter().enumerate() {
                let value = got[i].to_dtype(reference_dtype).unwrap();
                assert_close(&format!("{what}: {name}"), &value, &want[i], tol);
                if window >= time {
                    let (a, b) = (&got[i], &causal[i]);
                    let same = a.to_dtype(DType::F64).unwrap().flatten_all().unwrap();
                    let plain = b.to_dtype(DType::F64).unwrap().flatten_all().unwrap();
                    assert_eq!(values(&same), values(&plain), "{what}: {name} is causal's");
                }
            }
            if window < time - 1 {
                // The window hides keys that plain causal attention sees.
                let moved = (&got[0] - &causal[0]).unwrap().abs().unwrap();
                let moved = moved.to_dtype(DType::F64).unwrap().max_all().unwrap();
                assert!(moved.to_scalar::<f64>().unwrap() > 1e-2, "{what}");
            }
        }
    }
    let t = |shape: &[usize]| data(1, shape, DType::F32);
    let err =
        ops::sliding_window_attention(&t(&[1, 4, 2, 8]), &t(&[1, 4, 2, 8]), &t(&[1, 4, 2, 8]), 0)
            .unwrap_err()
            .to_string();
    assert!(err.contains("window of at least 1"), "{err}");
}

#[test]
fn grouped_attention_with_equal_heads_is_the_packed_op() {
    let (batch, time, heads, head_dim) = (2, 9, 3, 8);
    let qkv = data(11, &[batch, time, 3 * heads * head_dim], DType::F32);
    let part = |i: usize| {
        qkv.narrow(2, i * heads * head_dim, heads * head_dim)
            .unwrap()
            .reshape((batch, time, heads, head_dim))
            .unwrap()
    };
    let split = ops::causal_attention(&part(0), &part(1), &part(2)).unwrap();
    let packed = ops::causal_self_attention(&qkv, heads).unwrap();
    assert_eq!(
        values(&split.flatten_all().unwrap()),
        values(&packed.flatten_all().unwrap())
    );
}

#[test]
fn grouped_attention_refuses_bad_shapes() {
    let t = |shape: &[usize]| data(1, shape, DType::F32);
    let err = ops::causal_attention(&t(&[1, 4, 3, 8]), &t(&[1, 4, 2, 8]), &t(&[1, 4, 2, 8]))
        .unwrap_err()
        .to_string();
    assert!(err.contains("kv_heads must divide heads"), "{err}");
    let err = ops::causal_attention(&t(&[1, 4, 4, 8]), &t(&[1, 4, 2, 8]), &t(&[1, 4, 1, 8]))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("must both be [batch, time, kv_heads, head_dim]"),
        "{err}"
    );
    let err = ops::causal_attention(&t(&[1, 4, 32]), &t(&[1, 4, 2, 8]), &t(&[1, 4, 2, 8]))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("q must be [batch, time, heads, head_dim]"),
        "{err}"
    );
    let half = t(&[1, 4, 2, 8]).to_dtype(DType::BF16).unwrap();
    let err = ops::causal_attention(&t(&[1, 4, 4, 8]), &half, &half)
        .unwrap_err()
        .to_string();
    assert!(err.contains("one dtype"), "{err}");
}

type Activation = (
    &'static str,
    fn(&Tensor) -> candle_core::Result<Tensor>,
    fn(&Tensor) -> candle_core::Result<Tensor>,
);

const ACTIVATIONS: [Activation; 3] = [
    ("gelu", ops::gelu, Tensor::gelu),
    ("gelu_erf", ops::gelu_erf, Tensor::gelu_erf),
    ("silu", ops::silu, Tensor::silu),
];

#[test]
fn activations_match_candle_s_ops_in_f32_and_f64() {
    for (name, fused, composed) in ACTIVATIONS {
        for dtype in [DType::F32, DType::F64] {
            // Candle's own derivatives use rounded constants (0.797885 for
            // √(2/π) in GELU's): agreement to 1e-5, not to f64 precision.
            let tol = 1e-5;
            let x = Var::from_tensor(&(data(7, &[3, 37], dtype) * 4.0).unwrap()).unwrap();
            let (y, dx) = value_and_grad(&x, |x| fused(x).unwrap());
            let (y_ref, dx_ref) = value_and_grad(&x, |x| composed(x).unwrap());
            assert_close(&format!("{name} {dtype:?}: output"), &y, &y_ref, tol);
            assert_close(&format!("{name} {dtype:?}: gradient"), &dx, &dx_ref, tol);
        }
    }
}

#[test]
fn activations_in_16_bits_compute_in_f32_and_round_once() {
    for (name, fused, composed) in ACTIVATIONS {
        for dtype in [DType::BF16, DType::F16] {
            let x = (data(8, &[5, 29], DType::F32) * 4.0)
                .unwrap()
                .to_dtype(dtype)
                .unwrap();
            let half = Var::from_tensor(&x).unwrap();
            let wide = Var::from_tensor(&x.to_dtype(DType::F32).unwrap()).unwrap();
            let (y, dx) = value_and_grad(&half, |x| fused(x).unwrap());
            let (y_ref, dx_ref) = value_and_grad(&wide, |x| composed(x).unwrap());
            assert_eq!(y.dtype(), dtype);
            // One rounding of the f32 value: within half an ulp of it (the
            // weighted-sum gradient is rounded to `dtype` before the op
            // sees it, so the input gradient gets two roundings).
            let ulp = if dtype == DType::BF16 {
                2f64.powi(-8)
            } else {
                2f64.powi(-11)
            };
            for (i, (g, w)) in values(&y).iter().zip(values(&y_ref)).enumerate() {
                assert!(
                    (g - w).abs() <= ulp * w.abs().max(1e-2),
                    "{name} {dtype:?} output {i}: {g} vs {w}"
                );
            }
            assert_close(
                &format!("{name} {dtype:?}: gradient"),
                &dx.to_dtype(DType::F32).unwrap(),
                &dx_ref,
                4.0 * ulp,
            );
        }
    }
}

/// `(logits [rows, classes], targets [rows])`, seeded, targets in range.
fn classification(seed: u64, rows: usize, classes: usize, dtype: DType) -> (Var, Tensor) {
    let logits = var(seed, &[rows, classes], DType::F32);
    let logits =
        Var::from_tensor(&(logits.as_tensor() * 4.0).unwrap().to_dtype(dtype).unwrap()).unwrap();
    let targets: Vec<u32> = (0..rows)
        .map(|r| ((r * 7 + seed as usize) % classes) as u32)
        .collect();
    (logits, Tensor::new(targets, &Device::Cpu).unwrap())
}

/// The loss and the logits' gradient, scaled by 3 so that the incoming
/// gradient is not one.
fn loss_and_grad(logits: &Var, f: impl Fn(&Tensor) -> Tensor) -> (Tensor, Tensor) {
    let loss = f(logits.as_tensor());
    let grads = (&loss * 3.0).unwrap().backward().unwrap();
    let grad = grads
        .get(logits.as_tensor())
        .expect("logits have a gradient")
        .clone();
    (loss, grad)
}

#[test]
fn cross_entropy_matches_candle_nn_s() {
    for dtype in [DType::F32, DType::F64] {
        let tol = if dtype == DType::F32 { 1e-6 } else { 1e-14 };
        for (rows, classes) in [(1, 1), (1, 5), (9, 256), (33, 7)] {
            let (logits, targets) = classification(rows as u64, rows, classes, dtype);
            let (loss, grad) = loss_and_grad(&logits, |l| ops::cross_entropy(l, &targets).unwrap());
            let (loss_ref, grad_ref) = loss_and_grad(&logits, |l| {
                candle_nn::loss::cross_entropy(l, &targets).unwrap()
            });
            let what = format!("{dtype:?} {rows}x{classes}");
            assert_eq!(loss.dims(), &[] as &[usize]);
            assert_close(&format!("{what}: loss"), &loss, &loss_ref, tol);
            assert_close(&format!("{what}: gradient"), &grad, &grad_ref, tol);
        }
    }
    // i64 targets are read as u32 ones are.
    let (logits, targets) = classification(4, 6, 10, DType::F32);
    let a = ops::cross_entropy(logits.as_tensor(), &targets).unwrap();
    let b = ops::cross_entropy(logits.as_tensor(), &targets.to_dtype(DType::I64).unwrap()).unwrap();
    assert_eq!(values(&a), values(&b));
}

#[test]
fn cross_entropy_of_16_bit_logits_is_f32() {
    for (dtype, tol) in [(DType::BF16, 1e-6), (DType::F16, 1e-6)] {
        let (logits, targets) = classification(3, 12, 40, dtype);
        let wide = Var::from_tensor(&logits.as_tensor().to_dtype(DType::F32).unwrap()).unwrap();
        let (loss, grad) = loss_and_grad(&logits, |l| ops::cross_entropy(l, &targets).unwrap());
        let (loss_ref, grad_ref) = loss_and_grad(&wide, |l| {
            candle_nn::loss::cross_entropy(l, &targets).unwrap()
        });
        assert_eq!(loss.dtype(), DType::F32);
        assert_eq!(grad.dtype(), dtype);
        // The loss is computed on the exact values: f32 to rounding.
        assert_close(&format!("{dtype:?}: loss"), &loss, &loss_ref, tol);
        let ulp = if dtype == DType::BF16 {
            2f64.powi(-8)
        } else {
            2f64.powi(-11)
        };
        assert_close(
            &format!("{dtype:?}: gradient"),
            &grad.to_dtype(DType::F32).unwrap(),
            &grad_ref,
            ulp,
        );
    }
}

#[test]
fn ignored_rows_add_nothing_and_get_no_gradient() {
    let (rows, classes) = (10, 6);
    let (logits, targets) = classification(5, rows, classes, DType::F32);
    let ignore = -100i64;
    let mut raw: Vec<i64> = values(&targets).iter().map(|&t| t as i64).collect();
    let ignored = [1usize, 4, 5, 9];
    for &r in &ignored {
        raw[r] = ignore;
    }
    let targets = Tensor::new(raw.clone(), &Device::Cpu).unwrap();
    let (loss, grad) = loss_and_grad(&logits, |l| {
        ops::cross_entropy_with_ignore(l, &targets, ignore).unwrap()
    });
    // The reference: candle-nn's loss over the kept rows only.
    let kept: Vec<u32> = (0..rows as u32)
        .filter(|r| !ignored.contains(&(*r as usize)))
        .collect();
    let kept_index = Tensor::new(kept.clone(), &Device::Cpu).unwrap();
    let kept_targets: Vec<u32> = kept.iter().map(|&r| raw[r as usize] as u32).collect();
    let kept_targets = Tensor::new(kept_targets, &Device::Cpu).unwrap();
    let (loss_ref, grad_ref) = loss_and_grad(&logits, |l| {
        candle_nn::loss::cross_entropy(&l.index_select(&kept_index, 0).unwrap(), &kept_targets)
            .unwrap()
    });
    assert_close("loss", &loss, &loss_ref, 1e-6);
    assert_close("gradient", &grad, &grad_ref, 1e-6);
    for r in ignored {
        assert!(
            values(&grad.get(r).unwrap()).iter().all(|&g| g == 0.0),
            "row {r}"
        );
    }

    // Every row ignored: 0/0, as PyTorch gives.
    let all = Tensor::new(vec![ignore; rows], &Device::Cpu).unwrap();
    let loss = ops::cross_entropy_with_ignore(logits.as_tensor(), &all, ignore).unwrap();
    assert!(loss.to_scalar::<f32>().unwrap().is_nan());
}

#[test]
fn bad_targets_are_errors_that_name_the_row() {
    let (logits, _) = classification(1, 4, 5, DType::F32);
    let targets = Tensor::new(&[0u32, 1, 5, 2], &Device::Cpu).unwrap();
    let err = ops::cross_entropy(logits.as_tensor(), &targets)
        .unwrap_err()
        .to_string();
    assert!(err.contains("row 2 has target 5, outside 0..5"), "{err}");
    let targets = Tensor::new(&[0i64, -1, 1, 2], &Device::Cpu).unwrap();
    let err = ops::cross_entropy_with_ignore(logits.as_tensor(), &targets, -100)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("row 1 has target -1") && err.contains("ignore index -100"),
        "{err}"
    );
    let err = ops::cross_entropy(
        logits.as_tensor(),
        &Tensor::new(&[0u32, 1], &Device::Cpu).unwrap(),
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("4 rows of logits"), "{err}");
    let floats = Tensor::new(&[0f32, 1.0, 2.0, 3.0], &Device::Cpu).unwrap();
    let err = ops::cross_entropy(logits.as_tensor(), &floats)
        .unwrap_err()
        .to_string();
    assert!(err.contains("u32 or i64"), "{err}");
    let err = ops::cross_entropy(&data(1, &[2, 3, 4], DType::F32), &floats)
        .unwrap_err()
        .to_string();
    assert!(err.contains("[rows, classes]"), "{err}");
}

/// Rotary tables `[time, head_dim / 2]` of `dtype`: the cosines and sines of
/// seeded angles in [-3, 3), computed in f64 and rounded to `dtype` (as a
/// model rounds its tables).
fn rotary_tables(seed: u64, time: usize, head_dim: usize, dtype: DType) -> (Tensor, Tensor) {
    let angles = (data(seed, &[time, head_dim / 2], DType::F64) * 3.0).unwrap();
    let round = |t: Tensor| t.to_dtype(dtype).unwrap();
    (round(angles.cos().unwrap()), round(angles.sin().unwrap()))
}

/// Llama's `x * cos + rotate_half(x) * sin` (`apply_rotary_pos_emb`) for
/// `x` `[batch, time, heads, head_dim]`, composed of tensor ops, with the
/// half-width tables repeated for both halves as `transformers` builds
/// them.
fn composed_rotary(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Tensor {
    let (_, time, _, width) = x.dims4().unwrap();
    let half = width / 2;
    let full = |t: &Tensor| {
        Tensor::cat(&[t, t], 1)
            .unwrap()
            .reshape((1, time, 1, width))
            .unwrap()
    };
    let rotated = Tensor::cat(
        &[
            &x.narrow(D::Minus1, half, half).unwrap().neg().unwrap(),
            &x.narrow(D::Minus1, 0, half).unwrap(),
        ],
        D::Minus1,
    )
    .unwrap();
    (x.broadcast_mul(&full(cos)).unwrap() + rotated.broadcast_mul(&full(sin)).unwrap()).unwrap()
}

/// Shapes `(batch, time, heads, head_dim)`: one pair, odd counts of
/// positions and heads, half widths that are odd, and one larger than a
/// parallel chunk (positions split across threads).
const ROTARY_SHAPES: [(usize, usize, usize, usize); 6] = [
    (1, 1, 1, 2),
    (2, 7, 3, 10),
    (3, 5, 2, 34),
    (1, 33, 4, 64),
    (2, 9, 1, 6),
    (2, 301, 7, 64),
];

#[test]
fn rotary_embedding_matches_rotate_half_in_f32_f64_and_16_bits() {
    let cases = [
        (DType::F64, 1e-12),
        (DType::F32, 1e-6),
        (DType::BF16, 1.6e-2),
        (DType::F16, 2e-3),
    ];
    for (dtype, tol) in cases {
        for (i, &(batch, time, heads, head_dim)) in ROTARY_SHAPES.iter().enumerate() {
            let what = format!("{dtype:?} {batch}x{time}, {heads} heads of {head_dim}");
            let seed = 40 + i as u64;
            // 16-bit inputs: the reference runs in f32 on the same rounded
            // values and tables.
            let x = data(seed, &[batch, time, heads, head_dim], dtype);
            let (cos, sin) = rotary_tables(seed + 100, time, head_dim, dtype);
            let wide = |t: &Tensor| t.to_dtype(dtype.max_f32()).unwrap();
            let fused = Var::from_tensor(&x).unwrap();
            let reference = Var::from_tensor(&wide(&x)).unwrap();
            let (y, dx) = value_and_grad(&fused, |x| ops::rotary_embedding(x, &cos, &sin).unwrap());
            let (y_ref, dx_ref) =
                value_and_grad(&reference, |x| composed_rotary(x, &wide(&cos), &wide(&sin)));
            assert_eq!((y.dtype(), dx.dtype()), (dtype, dtype), "{what}");
            assert_close(&format!("{what}: output"), &wide(&y), &y_ref, tol);
            assert_close(&format!("{what}: gradient"), &wide(&dx), &dx_ref, tol);
        }
    }
}

/// `dtype`, or f32 for the 16-bit types (what their reference computes in).
trait MaxF32 {
    fn max_f32(self) -> DType;
}

impl MaxF32 for DType {
    fn max_f32(self) -> DType {
        if self == DType::F64 {
            DType::F64
        } else {
            DType::F32
        }
    }
}

#[test]
fn rotary_backward_is_the_inverse_rotation() {
    // The gradient of sum(rotate(x) * w) is rotate⁻¹(w): rotating it forward
    // again gives back w.
    let (batch, time, heads, head_dim) = (2, 6, 3, 8);
    let x = var(60, &[batch, time, heads, head_dim], DType::F64);
    let (cos, sin) = rotary_tables(61, time, head_dim, DType::F64);
    let (_, dx) = value_and_grad(&x, |x| ops::rotary_embedding(x, &cos, &sin).unwrap());
    let w = data(99, &[batch, time, heads, head_dim], DType::F64);
    let back = ops::rotary_embedding(&dx, &cos, &sin).unwrap();
    assert_close("rotate(rotate⁻¹(w))", &back, &w, 1e-12);
}

#[test]
fn rotary_takes_strided_input_and_narrowed_tables() {
    let (batch, time, heads, head_dim) = (2, 5, 3, 12);
    // x [batch, heads, time, head_dim] transposed to [batch, time, heads,
    // head_dim]: strided, as a caller's view would be.
    let x = data(70, &[batch, heads, time, head_dim], DType::F32)
        .transpose(1, 2)
        .unwrap();
    // The first `time` rows of a longer table: contiguous at an offset.
    let (cos, sin) = rotary_tables(71, time + 4, head_dim, DType::F32);
    let (cos, sin) = (
        cos.narrow(0, 0, time).unwrap(),
        sin.narrow(0, 0, time).unwrap(),
    );
    let y = ops::rotary_embedding(&x, &cos, &sin).unwrap();
    assert_close("strided", &y, &composed_rotary(&x, &cos, &sin), 1e-6);
}

#[test]
fn rotary_refuses_bad_shapes_and_dtypes() {
    let x = data(80, &[1, 4, 2, 8], DType::F32);
    let (cos, sin) = rotary_tables(81, 4, 8, DType::F32);
    let err = |r: candle_core::Result<Tensor>| r.unwrap_err().to_string();
    let odd = data(82, &[1, 4, 2, 7], DType::F32);
    assert!(err(ops::rotary_embedding(&odd, &cos, &sin)).contains("head_dim 7 is odd"));
    let three = data(83, &[4, 2, 8], DType::F32);
    assert!(
        err(ops::rotary_embedding(&three, &cos, &sin)).contains("[batch, time, heads, head_dim]")
    );
    let (long_cos, _) = rotary_tables(84, 5, 8, DType::F32);
    let message = err(ops::rotary_embedding(&x, &long_cos, &sin));
    assert!(
        message.contains("cos has shape [5, 4], expected [4, 4]"),
        "{message}"
    );
    let message = err(ops::rotary_embedding(
        &x,
        &cos,
        &sin.to_dtype(DType::BF16).unwrap(),
    ));
    assert!(message.contains("sin is BF16 but x is F32"), "{message}");
}

/// Llama's MLP gate composed of tensor ops: `silu(gate) * up`.
fn composed_swiglu(gate: &Tensor, up: &Tensor) -> Tensor {
    (gate.silu().unwrap() * up).unwrap()
}

/// Gemma's MLP gate composed of tensor ops: `gelu(gate) * up`, GELU's tanh
/// form (transformers' `gelu_pytorch_tanh`).
fn composed_geglu(gate: &Tensor, up: &Tensor) -> Tensor {
    (gate.gelu().unwrap() * up).unwrap()
}

/// The output and both inputs' gradients of `f(gate, up)` under
/// [`weighted_sum`].
fn gated_value_and_grads(
    gate: &Var,
    up: &Var,
    f: impl Fn(&Tensor, &Tensor) -> Tensor,
) -> [Tensor; 3] {
    let y = f(gate.as_tensor(), up.as_tensor());
    let grads = weighted_sum(&y, 97).backward().unwrap();
    let grad = |x: &Var| grads.get(x.as_tensor()).expect("a gradient").clone();
    [y.clone(), grad(gate), grad(up)]
}

type GatedFn = fn(&Tensor, &Tensor) -> candle_core::Result<Tensor>;

/// `fused` against `composed` for each `(dtype, tolerance)` of `cases`, on
/// gates of a few units (the activation's curved part and both tails):
/// the output and both gradients, 16-bit runs against the f32 composition
/// on the same (rounded) inputs.
fn assert_gated_matches(
    fused: GatedFn,
    composed: fn(&Tensor, &Tensor) -> Tensor,
    cases: &[(DType, f64)],
) {
    let shapes: [&[usize]; 4] = [&[1], &[3, 37], &[2, 5, 11], &[4, 9000]];
    for &(dtype, tol) in cases {
        for (i, shape) in shapes.iter().enumerate() {
            let what = format!("{dtype:?} {shape:?}");
            let seed = 90 + 2 * i as u64;
            let gate = (data(seed, shape, DType::F32) * 6.0)
                .unwrap()
                .to_dtype(dtype)
                .unwrap();
            let up = (data(seed + 1, shape, DType::F32) * 2.0)
                .unwrap()
                .to_dtype(dtype)
                .unwrap();
            let wide = |t: &Tensor| t.to_dtype(dtype.max_f32()).unwrap();
            let var = |t: &Tensor| Var::from_tensor(t).unwrap();
            let [y, dgate, dup] =
                gated_value_and_grads(&var(&gate), &var(&up), |g, u| fused(g, u).unwrap());
            let [y_ref, dgate_ref, dup_ref] =
                gated_value_and_grads(&var(&wide(&gate)), &var(&wide(&up)), composed);
            assert_eq!(y.dtype(), dtype, "{what}");
            assert_close(&format!("{what}: output"), &wide(&y), &y_ref, tol);
            assert_close(
                &format!("{what}: gate gradient"),
                &wide(&dgate),
                &dgate_ref,
                tol,
            );
            assert_close(&format!("{what}: up gradient"), &wide(&dup), &dup_ref, tol);
        }
    }
}

#[test]
fn swiglu_matches_silu_times_up_in_f32_f64_and_16_bits() {
    // Candle's silu uses libm's exp, the fused op a polynomial within two
    // ulps of it in f32.
    let cases = [
        (DType::F64, 1e-12),
        (DType::F32, 2e-6),
        (DType::BF16, 1.6e-2),
        (DType::F16, 2e-3),
    ];
    assert_gated_matches(ops::swiglu, composed_swiglu, &cases);
}

#[test]
fn geglu_matches_gelu_times_up_in_f32_f64_and_16_bits() {
    // Candle's GELU derivative uses a rounded √(2/π) (0.797885), and its
    // forward libm's tanh, ours one within 3e-7 of it: agreement to 1e-5,
    // as for `ops::gelu`.
    let cases = [
        (DType::F64, 1e-5),
        (DType::F32, 1e-5),
        (DType::BF16, 1.6e-2),
        (DType::F16, 2e-3),
    ];
    assert_gated_matches(ops::geglu, composed_geglu, &cases);
}

#[test]
fn swiglu_takes_strided_input_and_refuses_mismatches() {
    let gate = data(110, &[7, 5], DType::F32).t().unwrap();
    let up = data(111, &[5, 7], DType::F32);
    let y = ops::swiglu(&gate, &up).unwrap();
    assert_close("strided gate", &y, &composed_swiglu(&gate, &up), 2e-6);
    let err = ops::swiglu(&up, &data(112, &[5, 6], DType::F32))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("gate has shape [5, 7] but up has [5, 6]"),
        "{err}"
    );
    let err = ops::swiglu(&up, &up.to_dtype(DType::F16).unwrap())
        .unwrap_err()
        .to_string();
    assert!(err.contains("gate is F32 but up is F16"), "{err}");
}

#[test]
fn geglu_takes_strided_input_and_names_itself_in_errors() {
    let gate = data(113, &[7, 5], DType::F32).t().unwrap();
    let up = data(114, &[5, 7], DType::F32);
    let y = ops::geglu(&gate, &up).unwrap();
    assert_close("strided gate", &y, &composed_geglu(&gate, &up), 1e-5);
    // Not SwiGLU's values: the activation is GELU.
    assert!(values(&y) != values(&composed_swiglu(&gate, &up)));
    let err = ops::geglu(&up, &data(115, &[5, 6], DType::F32))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("geglu: gate has shape [5, 7] but up has [5, 6]"),
        "{err}"
    );
}
