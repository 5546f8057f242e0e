//! `zero_candle::nn::Linear` against `candle_nn::Linear` built over the same
//! variables: the same outputs, the same input gradient, and the hook gets
//! exactly the weight and bias gradients candle-nn's backward puts in its
//! `GradStore` (while ours has none for them).

mod nn_support;

use candle_core::{DType, Device, Module, Tensor};
use candle_nn::{VarBuilder, VarMap};
use nn_support::{assert_equal, data, hook, var, weighted_sum, Recorder};
use zero_candle::nn;

const IN: usize = 24;
const OUT: usize = 10;

/// Runs both layers on an input of `x_shape` and asks for equal values
/// everywhere: the same matmuls and reductions run in the same order (but
/// the 16-bit bias gradient, which ours sums in f32).
fn compare(bias: bool, x_shape: &[usize], dtype: DType) {
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, dtype, &Device::Cpu);
    let reference = candle_nn::linear_b(IN, OUT, bias, vb.pp("fc")).unwrap();
    let recorder = Recorder::new();
    // Same VarMap, same names: the same variables.
    let layer = nn::linear_b(IN, OUT, bias, vb.pp("fc"), hook(&recorder)).unwrap();
    assert_eq!(layer.weight().id(), reference.weight().id());

    let x = var(1, x_shape, dtype);
    let want_y = reference.forward(&x).unwrap();
    let got_y = layer.forward(&x).unwrap();
    let want = weighted_sum(&want_y, 2).backward().unwrap();
    let got = weighted_sum(&got_y, 2).backward().unwrap();

    assert_equal("output", &got_y, &want_y);
    assert_equal("∂x", got.get(&x).unwrap(), want.get(&x).unwrap());
    let weight = reference.weight();
    assert_equal(
        "∂weight",
        &recorder.grad_of(weight),
        want.get(weight).unwrap(),
    );
    assert!(got.get(weight).is_none(), "the hook took ∂weight");
    if let Some(b) = reference.bias() {
        let want_b = if matches!(dtype, DType::BF16 | DType::F16) {
            // Ours adds the rows in f32 and rounds once (Candle's sum adds
            // in the 16-bit type): the f32 sum of the same 16-bit rows.
            let rows = want_y.elem_count() / OUT;
            let grad_y = nn_support::data(2, want_y.dims(), dtype);
            let sum = grad_y
                .reshape((rows, OUT))
                .unwrap()
                .to_dtype(DType::F32)
                .unwrap();
            sum.sum(0).unwrap().to_dtype(dtype).unwrap()
        } else {
            want.get(b).unwrap().clone()
        };
        assert_equal("∂bias", &recorder.grad_of(b), &want_b);
        assert!(got.get(b).is_none(), "the hook took ∂bias");
    }
    assert_eq!(recorder.calls().len(), if bias { 2 } else { 1 });
}

#[test]
fn f32_matches_candle_nn_exactly_on_2d_3d_and_4d_inputs() {
    for bias in [true, false] {
        compare(bias, &[7, IN], DType::F32);
        compare(bias, &[3, 5, IN], DType::F32);
        compare(bias, &[2, 3, 4, IN], DType::F32);
    }
}

#[test]
fn f64_bf16_and_f16_match_candle_nn_exactly() {
    for dtype in [DType::F64, DType::BF16, DType::F16] {
        compare(true, &[3, 5, IN], dtype);
        compare(false, &[4, IN], dtype);
    }
}

/// Strided inputs give what candle-nn gives for the same values laid out
/// contiguously. (candle-nn itself is wrong on a strided 3-d input: its
/// batched matmul of a transposed lhs with a broadcast weight returns wrong
/// values on candle-core 0.11.1's CPU backend, in the family of
/// huggingface/candle#3744; our Linear never batches its matmul.)
#[test]
fn a_strided_input_gives_candle_nn_values() {
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
    let reference = candle_nn::linear(IN, OUT, vb.pp("fc")).unwrap();
    let recorder = Recorder::new();
    let layer = nn::linear(IN, OUT, vb.pp("fc"), hook(&recorder)).unwrap();
    for (seed, x) in [
        (3, var(3, &[IN, 6], DType::F32).as_tensor().t().unwrap()),
        (
            4,
            var(4, &[5, IN, 3], DType::F32)
                .as_tensor()
                .transpose(1, 2)
                .unwrap(),
        ),
    ] {
        assert!(!x.is_contiguous());
        let leaf = candle_core::Var::from_tensor(&x.contiguous().unwrap()).unwrap();
        let want_y = reference.forward(&leaf).unwrap();
        let got_y = layer.forward(&x).unwrap();
        assert_equal("strided output", &got_y, &want_y);
        let got = weighted_sum(&got_y, seed).backward().unwrap();
        let want = weighted_sum(&want_y, seed).backward().unwrap();
        let weight = reference.weight();
        assert_equal(
            "∂weight",
            recorder.grads_of(weight).last().unwrap(),
            want.get(weight).unwrap(),
        );
        assert!(got.get(weight).is_none());
    }
}

#[test]
fn without_a_hook_the_gradients_are_in_the_grad_store() {
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
    let reference = candle_nn::linear(IN, OUT, vb.pp("fc")).unwrap();
    let layer = nn::linear(IN, OUT, vb.pp("fc"), None).unwrap();
    let x = var(6, &[4, IN], DType::F32);
    let want = weighted_sum(&reference.forward(&x).unwrap(), 7)
        .backward()
        .unwrap();
    let got = weighted_sum(&layer.forward(&x).unwrap(), 7)
        .backward()
        .unwrap();
    for t in [x.as_tensor(), reference.weight(), reference.bias().unwrap()] {
        assert_equal("GradStore entry", got.get(t).unwrap(), want.get(t).unwrap());
    }
}

#[test]
fn an_input_without_gradient_costs_no_input_gradient() {
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
    let reference = candle_nn::linear(IN, OUT, vb.pp("fc")).unwrap();
    let recorder = Recorder::new();
    let layer = nn::linear(IN, OUT, vb.pp("fc"), hook(&recorder)).unwrap();
    let x = data(8, &[4, IN], DType::F32); // plain data, as a model's input
    let want = weighted_sum(&reference.forward(&x).unwrap(), 9)
        .backward()
        .unwrap();
    let got = weighted_sum(&layer.forward(&x).unwrap(), 9)
        .backward()
        .unwrap();
    assert!(
        got.get(&x).is_none(),
        "no ∂x computed for an untracked input"
    );
    assert_equal(
        "∂weight",
        &recorder.grad_of(reference.weight()),
        want.get(reference.weight()).unwrap(),
    );
}

#[test]
fn constructors_create_candle_nn_names_shapes_and_init() {
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
    let layer = nn::linear(IN, OUT, vb.pp("a"), None).unwrap();
    nn::linear_no_bias(IN, OUT, vb.pp("b"), None).unwrap();
    let mut names: Vec<String> = varmap.data().lock().unwrap().keys().cloned().collect();
    names.sort();
    assert_eq!(names, ["a.bias", "a.weight", "b.weight"]);
    assert_eq!(layer.weight().dims(), [OUT, IN]);
    assert_eq!(layer.bias().unwrap().dims(), [OUT]);
    // candle-nn's bias init: uniform in ±1/√in.
    let bound = 1.0 / (IN as f64).sqrt();
    let b = nn_support::values(layer.bias().unwrap());
    assert!(b.iter().all(|v| v.abs() <= bound), "{b:?}");
}

#[test]
fn mismatched_shapes_are_errors_not_panics() {
    let w = Tensor::zeros((OUT, IN), DType::F32, &Device::Cpu).unwrap();
    let layer = nn::Linear::new(w, None, None);
    let err = layer
        .forward(&Tensor::zeros((2, IN + 1), DType::F32, &Device::Cpu).unwrap())
        .unwrap_err()
        .to_string();
    assert!(err.contains("in_dim"), "{err}");
    let w = Tensor::zeros((OUT, IN), DType::F32, &Device::Cpu).unwrap();
    let b = Tensor::zeros(OUT + 1, DType::F32, &Device::Cpu).unwrap();
    let err = nn::Linear::new(w, Some(b), None)
        .forward(&Tensor::zeros((2, IN), DType::F32, &Device::Cpu).unwrap())
        .unwrap_err()
        .to_string();
    assert!(err.contains("bias"), "{err}");
}
