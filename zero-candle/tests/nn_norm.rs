//! `zero_candle::nn::{LayerNorm, RmsNorm}` against references.
//!
//! candle-nn 0.11's contiguous `LayerNorm`/`RmsNorm` run without backward
//! (no gradient for the weight, the bias or the input), so gradients are
//! checked against candle-nn's slow paths in plain tensor ops
//! (`candle_nn::ops::layer_norm_slow`, `rms_norm_slow`), which do have a
//! backward; outputs are also checked against candle-nn's layers. Our
//! variance is taken around the mean in a second pass and the output is
//! `(x - mean)·rstd·w + b`, so values agree to rounding, not bitwise.
//!
//! `forward_residual` (the residual add fused into the norm) is checked
//! against `x + residual` then `forward`: the same values and gradients,
//! bit for bit, in every dtype.
//!
//! A weight offset (Gemma's `x̂ · (1 + w)`) is checked, through `forward`
//! and `forward_residual`, against the slow paths given `w + 1` as their
//! weight, which Candle differentiates through the add.

mod nn_support;

use candle_core::{DType, Device, Module, Tensor, Var};
use candle_nn::{LayerNormConfig, VarBuilder, VarMap};
use nn_support::{assert_close, assert_equal, data, hook, var, weighted_sum, Recorder};
use zero_candle::nn;

const SIZE: usize = 16;
const EPS: f64 = 1e-5;

/// Sets the named variable of `varmap` to seeded values, so the weight and
/// bias are not the trivial ones and zeros.
fn randomize(varmap: &VarMap, name: &str, seed: u64) {
    let data_map = varmap.data().lock().unwrap();
    let var = &data_map[name];
    let values = (data(seed, var.dims(), DType::F32) + 1.0).unwrap();
    var.set(&values.to_dtype(var.dtype()).unwrap()).unwrap();
}

/// What a norm test compares: the output, and the gradients of the input,
/// weight and bias.
struct Outcome {
    y: Tensor,
    grad_x: Tensor,
    grad_weight: Tensor,
    grad_bias: Option<Tensor>,
}

fn assert_outcomes_close(what: &str, got: &Outcome, want: &Outcome, tol: f64) {
    assert_close(&format!("{what}: output"), &got.y, &want.y, tol);
    assert_close(&format!("{what}: ∂x"), &got.grad_x, &want.grad_x, tol);
    assert_close(
        &format!("{what}: ∂weight"),
        &got.grad_weight,
        &want.grad_weight,
        tol,
    );
    match (&got.grad_bias, &want.grad_bias) {
        (Some(g), Some(w)) => assert_close(&format!("{what}: ∂bias"), g, w, tol),
        (None, None) => {}
        _ => panic!("{what}: ∂bias present in one run only"),
    }
}

/// Our layer norm (with or without bias, or RMS) on `x`, the parameters'
/// gradients taken from the hook.
fn ours(kind: Kind, dtype: DType, x: &Var, seed: u64) -> (Outcome, VarMap) {
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, dtype, &Device::Cpu);
    let recorder = Recorder::new();
    let layer: Box<dyn Module> = match kind {
        Kind::LayerNorm => {
            Box::new(nn::layer_norm(SIZE, EPS, vb.pp("ln"), hook(&recorder)).unwrap())
        }
        Kind::LayerNormNoBias => {
            Box::new(nn::layer_norm_no_bias(SIZE, EPS, vb.pp("ln"), hook(&recorder)).unwrap())
        }
        Kind::RmsNorm => Box::new(nn::rms_norm(SIZE, EPS, vb.pp("ln"), hook(&recorder)).unwrap()),
    };
    randomize(&varmap, "ln.weight", seed);
    if kind == Kind::LayerNorm {
        randomize(&varmap, "ln.bias", seed + 1);
    }
    let y = layer.forward(x).unwrap();
    let grads = weighted_sum(&y, seed + 2).backward().unwrap();
    let weight = varmap.data().lock().unwrap()["ln.weight"].clone();
    assert!(grads.get(&weight).is_none(), "the hook took ∂weight");
    let grad_bias = (kind == Kind::LayerNorm).then(|| {
        let bias = varmap.data().lock().unwrap()["ln.bias"].clone();
        assert!(grads.get(&bias).is_none(), "the hook took ∂bias");
        recorder.grad_of(&bias)
    });
    let outcome = Outcome {
        y,
        grad_x: grads.get(x).unwrap().clone(),
        grad_weight: recorder.grad_of(&weight),
        grad_bias,
    };
    (outcome, varmap)
}

/// candle-nn's slow path, in plain ops, over the parameters of `varmap`
/// converted to `dtype`, on `x` converted to `dtype`.
fn reference(kind: Kind, dtype: DType, x: &Var, varmap: &VarMap, seed: u64) -> Outcome {
    let param = |name: &str| {
        let t = varmap.data().lock().unwrap()[name].as_tensor().clone();
        Var::from_tensor(&t.to_dtype(dtype).unwrap()).unwrap()
    };
    let x_ref = Var::from_tensor(&x.as_tensor().to_dtype(dtype).unwrap()).unwrap();
    let weight = param("ln.weight");
    let bias = match kind {
        Kind::LayerNorm => Some(param("ln.bias")),
        _ => None,
    };
    let eps = EPS as f32;
    let y = match kind {
        Kind::LayerNorm => {
            candle_nn::ops::layer_norm_slow(&x_ref, &weight, bias.as_ref().unwrap(), eps)
        }
        Kind::LayerNormNoBias => {
            let zeros = Tensor::zeros(SIZE, dtype, &Device::Cpu).unwrap();
            candle_nn::ops::layer_norm_slow(&x_ref, &weight, &zeros, eps)
        }
        Kind::RmsNorm => candle_nn::ops::rms_norm_slow(&x_ref, &weight, eps),
    }
    .unwrap();
    let grads = weighted_sum(&y, seed + 2).backward().unwrap();
    Outcome {
        grad_x: grads.get(&x_ref).unwrap().clone(),
        grad_weight: grads.get(&weight).unwrap().clone(),
        grad_bias: bias.map(|b| grads.get(&b).unwrap().clone()),
        y,
    }
}

#[derive(Clone, Copy, PartialEq, Debug)]
enum Kind {
    LayerNorm,
    LayerNormNoBias,
    RmsNorm,
}

const KINDS: [Kind; 3] = [Kind::LayerNorm, Kind::LayerNormNoBias, Kind::RmsNorm];

#[test]
fn f32_and_f64_match_the_plain_ops_reference() {
    for (dtype, tol) in [(DType::F32, 2e-5), (DType::F64, 1e-12)] {
        for kind in KINDS {
            for shape in [&[5, SIZE][..], &[2, 3, SIZE][..]] {
                let x = var(10, shape, dtype);
                let (got, varmap) = ours(kind, dtype, &x, 20);
                let want = reference(kind, dtype, &x, &varmap, 20);
                assert_outcomes_close(&format!("{kind:?} {dtype:?} {shape:?}"), &got, &want, tol);
            }
        }
    }
}

/// 16-bit inputs: statistics and parameter gradients are accumulated in f32
/// and rounded once, so they are compared with the f32 computation on the
/// same (rounded) values, to the 16-bit type's precision.
#[test]
fn half_precision_matches_the_f32_reference_to_its_precision() {
    for (dtype, tol) in [(DType::BF16, 2e-2), (DType::F16, 2e-3)] {
        for kind in KINDS {
            let x = var(11, &[2, 3, SIZE], dtype);
            let (got, varmap) = ours(kind, dtype, &x, 21);
            let want = reference(kind, DType::F32, &x, &varmap, 21);
            let up = |t: &Tensor| t.to_dtype(DType::F32).unwrap();
            let got = Outcome {
                y: up(&got.y),
                grad_x: up(&got.grad_x),
                grad_weight: up(&got.grad_weight),
                grad_bias: got.grad_bias.as_ref().map(up),
            };
            // The reference's loss weights are f32 values, ours 16-bit ones.
            assert_outcomes_close(&format!("{kind:?} {dtype:?}"), &got, &want, tol);
        }
    }
}

#[test]
fn outputs_match_candle_nn_layers() {
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
    let config = LayerNormConfig::from(EPS);
    let theirs_ln = candle_nn::layer_norm(SIZE, config, vb.pp("ln")).unwrap();
    let theirs_rms = candle_nn::rms_norm(SIZE, EPS, vb.pp("rms")).unwrap();
    randomize(&varmap, "ln.weight", 30);
    randomize(&varmap, "ln.bias", 31);
    randomize(&varmap, "rms.weight", 32);
    let ours_ln = nn::layer_norm(SIZE, config, vb.pp("ln"), None).unwrap();
    let ours_rms = nn::rms_norm(SIZE, EPS, vb.pp("rms"), None).unwrap();
    let x = data(33, &[4, 3, SIZE], DType::F32);
    let x_strided = data(34, &[4, SIZE, 3], DType::F32).transpose(1, 2).unwrap();
    for x in [&x, &x_strided] {
        assert_close(
            "layer norm",
            &ours_ln.forward(x).unwrap(),
            &theirs_ln.forward(x).unwrap(),
            2e-6,
        );
        assert_close(
            "rms norm",
            &ours_rms.forward(x).unwrap(),
            &theirs_rms.forward(x).unwrap(),
            2e-6,
        );
    }
}

#[test]
fn without_a_hook_the_gradients_are_in_the_grad_store() {
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
    let ln = nn::layer_norm(SIZE, EPS, vb.pp("ln"), None).unwrap();
    let rms = nn::rms_norm(SIZE, EPS, vb.pp("rms"), None).unwrap();
    let x = var(40, &[3, SIZE], DType::F32);
    let y = rms.forward(&ln.forward(&x).unwrap()).unwrap();
    let grads = weighted_sum(&y, 41).backward().unwrap();
    for param in [ln.weight(), ln.bias().unwrap(), rms.weight(), x.as_tensor()] {
        assert!(
            grads.get(param).is_some(),
            "{:?} has a gradient",
            param.id()
        );
    }
}

#[test]
fn mismatched_sizes_are_errors_not_panics() {
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
    let ln = nn::layer_norm(SIZE, EPS, vb.pp("ln"), None).unwrap();
    let err = ln
        .forward(&Tensor::zeros((2, SIZE + 1), DType::F32, &Device::Cpu).unwrap())
        .unwrap_err()
        .to_string();
    assert!(err.contains("last dimension"), "{err}");
}

/// A norm of `kind` over `weight` (and `bias`, for `Kind::LayerNorm`).
enum Norm {
    Layer(nn::LayerNorm),
    Rms(nn::RmsNorm),
}

impl Norm {
    fn new(
        kind: Kind,
        weight: &Var,
        bias: &Var,
        hook: Option<std::sync::Arc<dyn nn::GradHook>>,
    ) -> Self {
        let weight = weight.as_tensor().clone();
        match kind {
            Kind::LayerNorm => Norm::Layer(nn::LayerNorm::new(
                weight,
                bias.as_tensor().clone(),
                EPS,
                hook,
            )),
            Kind::LayerNormNoBias => Norm::Layer(nn::LayerNorm::new_no_bias(weight, EPS, hook)),
            Kind::RmsNorm => Norm::Rms(nn::RmsNorm::new(weight, EPS, hook)),
        }
    }

    fn with_weight_offset(self, offset: f64) -> Self {
        match self {
            Norm::Layer(n) => Norm::Layer(n.with_weight_offset(offset)),
            Norm::Rms(n) => Norm::Rms(n.with_weight_offset(offset)),
        }
    }

    /// `(h, y)`: fused, or `h = x + residual` then the norm.
    fn run(&self, fused: bool, x: &Tensor, residual: &Tensor) -> (Tensor, Tensor) {
        if fused {
            return match self {
                Norm::Layer(n) => n.forward_residual(x, residual),
                Norm::Rms(n) => n.forward_residual(x, residual),
            }
            .unwrap();
        }
        let h = (x + residual).unwrap();
        let y = match self {
            Norm::Layer(n) => n.forward(&h),
            Norm::Rms(n) => n.forward(&h),
        }
        .unwrap();
        (h, y)
    }
}

/// What the residual tests compare.
struct ResidualOutcome {
    h: Tensor,
    y: Tensor,
    grad_x: Option<Tensor>,
    grad_residual: Tensor,
    grad_weight: Tensor,
    grad_bias: Option<Tensor>,
}

/// `kind` after a residual add, fused or not, on `x` `shape` (a variable,
/// or with `!x_tracked` a plain tensor) and a residual that is the
/// transpose of a variable when `strided`. The loss uses `y` and `h` (the
/// residual stream goes on), so `h`'s gradient has two sources. The
/// parameters' gradients come from the hook, or with `!hooked` from the
/// `GradStore`.
fn residual_run(
    kind: Kind,
    dtype: DType,
    fused: bool,
    shape: &[usize],
    flags: (bool, bool, bool),
) -> ResidualOutcome {
    let (x_tracked, strided, hooked) = flags;
    let x_var = var(50, shape, dtype);
    let x = if x_tracked {
        x_var.as_tensor().clone()
    } else {
        x_var.as_tensor().detach()
    };
    let residual_var = if strided {
        var(51, &[shape[1], shape[0]], dtype)
    } else {
        var(51, shape, dtype)
    };
    let residual = if strided {
        residual_var.as_tensor().t().unwrap()
    } else {
        residual_var.as_tensor().clone()
    };
    let weight = Var::from_tensor(&(data(52, &[SIZE], dtype) + 1.0).unwrap()).unwrap();
    let bias = var(53, &[SIZE], dtype);
    let recorder = Recorder::new();
    let norm = Norm::new(
        kind,
        &weight,
        &bias,
        if hooked { hook(&recorder) } else { None },
    );
    let (h, y) = norm.run(fused, &x, &residual);
    let loss = (weighted_sum(&y, 54) + weighted_sum(&h, 55)).unwrap();
    let grads = loss.backward().unwrap();
    let param_grad = |v: &Var| {
        if hooked {
            assert!(
                grads.get(v).is_none(),
                "the hook took the parameter's gradient"
            );
            recorder.grad_of(v)
        } else {
            grads.get(v).unwrap().clone()
        }
    };
    ResidualOutcome {
        h,
        y,
        grad_x: grads.get(x_var.as_tensor()).cloned(),
        grad_residual: grads.get(residual_var.as_tensor()).unwrap().clone(),
        grad_weight: param_grad(&weight),
        grad_bias: (kind == Kind::LayerNorm).then(|| param_grad(&bias)),
    }
}

fn assert_residual_outcomes_equal(what: &str, got: &ResidualOutcome, want: &ResidualOutcome) {
    assert_equal(&format!("{what}: h"), &got.h, &want.h);
    assert_equal(&format!("{what}: y"), &got.y, &want.y);
    match (&got.grad_x, &want.grad_x) {
        (Some(g), Some(w)) => assert_equal(&format!("{what}: ∂x"), g, w),
        (None, None) => {}
        (g, w) => panic!("{what}: ∂x is {:?}, want {:?}", g.is_some(), w.is_some()),
    }
    assert_equal(
        &format!("{what}: ∂residual"),
        &got.grad_residual,
        &want.grad_residual,
    );
    assert_equal(
        &format!("{what}: ∂weight"),
        &got.grad_weight,
        &want.grad_weight,
    );
    match (&got.grad_bias, &want.grad_bias) {
        (Some(g), Some(w)) => assert_equal(&format!("{what}: ∂bias"), g, w),
        (None, None) => {}
        _ => panic!("{what}: ∂bias present in one run only"),
    }
}

#[test]
fn the_fused_residual_add_equals_add_then_norm_bit_for_bit() {
    for dtype in [DType::F32, DType::F64, DType::BF16, DType::F16] {
        for kind in KINDS {
            for shape in [&[5, SIZE][..], &[2, 3, SIZE][..]] {
                let flags = (true, false, true);
                let got = residual_run(kind, dtype, true, shape, flags);
                let want = residual_run(kind, dtype, false, shape, flags);
                assert_residual_outcomes_equal(
                    &format!("{kind:?} {dtype:?} {shape:?}"),
                    &got,
                    &want,
                );
            }
        }
    }
}

#[test]
fn the_fused_residual_add_takes_strided_untracked_and_unhooked_inputs() {
    for kind in KINDS {
        for flags in [
            (false, false, true),
            (true, true, true),
            (true, false, false),
        ] {
            let shape = [7, SIZE];
            let got = residual_run(kind, DType::F32, true, &shape, flags);
            let want = residual_run(kind, DType::F32, false, &shape, flags);
            assert_residual_outcomes_equal(&format!("{kind:?} {flags:?}"), &got, &want);
            // A plain input gets no gradient (as with the other fused ops).
            assert_eq!(got.grad_x.is_some(), flags.0, "{kind:?} {flags:?}: ∂x");
        }
    }
}

#[test]
fn the_fused_residual_add_refuses_mismatched_inputs() {
    let ln = nn::LayerNorm::new_no_bias(
        Tensor::ones(SIZE, DType::F32, &Device::Cpu).unwrap(),
        EPS,
        None,
    );
    let x = Tensor::zeros((2, SIZE), DType::F32, &Device::Cpu).unwrap();
    let wide = Tensor::zeros((3, SIZE), DType::F32, &Device::Cpu).unwrap();
    let err = ln.forward_residual(&x, &wide).unwrap_err().to_string();
    assert!(err.contains("one shape and dtype"), "{err}");
    let f64_residual = x.to_dtype(DType::F64).unwrap();
    let err = ln
        .forward_residual(&x, &f64_residual)
        .unwrap_err()
        .to_string();
    assert!(err.contains("one shape and dtype"), "{err}");
    let narrow = Tensor::zeros((2, SIZE + 1), DType::F32, &Device::Cpu).unwrap();
    let err = ln
        .forward_residual(&narrow, &narrow)
        .unwrap_err()
        .to_string();
    assert!(err.contains("last dimension"), "{err}");
}

/// Gemma's offset: its RMSNorm scales by `1 + w`.
const OFFSET: f64 = 1.0;

/// How [`offset_run`] normalizes `h = x + residual`.
#[derive(Clone, Copy, PartialEq, Debug)]
enum OffsetPath {
    /// `h` added by Candle, then our layer's `forward`.
    Forward,
    /// Our layer's `forward_residual`.
    Residual,
    /// `h` added by Candle, then `x̂ · (w + OFFSET) (+ b)` in plain ops:
    /// candle-nn's slow paths with `w + OFFSET` as their weight.
    Composed,
}

/// `kind` with a weight offset of [`OFFSET`] over a weight centred on zero
/// (as Gemma's checkpoints store it), on `h = x + residual`, computed in
/// `dtype` from inputs drawn in `input_dtype` (so that a 16-bit run and its
/// f32 reference see the same values). Our layer's parameter gradients
/// come from the hook when `hooked`, else from the `GradStore`.
fn offset_run(
    kind: Kind,
    path: OffsetPath,
    (input_dtype, dtype): (DType, DType),
    hooked: bool,
) -> Outcome {
    let input = |seed: u64, shape: &[usize], scale: f64| {
        let values = (data(seed, shape, input_dtype) * scale).unwrap();
        Var::from_tensor(&values.to_dtype(dtype).unwrap()).unwrap()
    };
    let shape = [2, 3, SIZE];
    let x = input(60, &shape, 2.0);
    let residual = input(61, &shape, 1.0);
    let weight = input(62, &[SIZE], 0.5);
    let bias = input(63, &[SIZE], 1.0);
    let recorder = Recorder::new();
    let y = if path == OffsetPath::Composed {
        let h = (x.as_tensor() + residual.as_tensor()).unwrap();
        let scale = (weight.as_tensor() + OFFSET).unwrap();
        let eps = EPS as f32;
        match kind {
            Kind::LayerNorm => candle_nn::ops::layer_norm_slow(&h, &scale, &bias, eps),
            Kind::LayerNormNoBias => {
                let zeros = Tensor::zeros(SIZE, dtype, &Device::Cpu).unwrap();
                candle_nn::ops::layer_norm_slow(&h, &scale, &zeros, eps)
            }
            Kind::RmsNorm => candle_nn::ops::rms_norm_slow(&h, &scale, eps),
        }
        .unwrap()
    } else {
        let norm = Norm::new(
            kind,
            &weight,
            &bias,
            if hooked { hook(&recorder) } else { None },
        )
        .with_weight_offset(OFFSET);
        let fused = path == OffsetPath::Residual;
        norm.run(fused, x.as_tensor(), residual.as_tensor()).1
    };
    let grads = weighted_sum(&y, 64).backward().unwrap();
    let param_grad = |v: &Var| {
        if hooked && path != OffsetPath::Composed {
            assert!(
                grads.get(v).is_none(),
                "the hook took the parameter's gradient"
            );
            recorder.grad_of(v)
        } else {
            grads.get(v).unwrap().clone()
        }
    };
    Outcome {
        grad_x: grads.get(x.as_tensor()).unwrap().clone(),
        grad_weight: param_grad(&weight),
        grad_bias: (kind == Kind::LayerNorm).then(|| param_grad(&bias)),
        y,
    }
}

/// The offset enters the output and the input's gradient (`ĝ = g·(1 + w)`:
/// with `w` near zero, a `dx` computed from `w` alone is far off), and the
/// weight's gradient reaches the hook as the composition computes it.
#[test]
fn a_weight_offset_scales_by_one_plus_w_in_f32_and_f64() {
    for (dtype, tol) in [(DType::F32, 1e-6), (DType::F64, 1e-12)] {
        for kind in KINDS {
            let want = offset_run(kind, OffsetPath::Composed, (dtype, dtype), false);
            for path in [OffsetPath::Forward, OffsetPath::Residual] {
                for hooked in [false, true] {
                    let got = offset_run(kind, path, (dtype, dtype), hooked);
                    let what = format!("{kind:?} {dtype:?} {path:?} hooked {hooked}");
                    assert_outcomes_close(&what, &got, &want, tol);
                }
            }
        }
    }
}

/// In 16 bits `1 + w` is summed in f32, as transformers' Gemma does, and
/// the result rounded once: within bf16's precision of the f32 composition
/// on the same (rounded) inputs.
#[test]
fn a_weight_offset_in_bf16_matches_the_f32_composition_to_its_precision() {
    let up = |t: &Tensor| t.to_dtype(DType::F32).unwrap();
    for kind in KINDS {
        let want = offset_run(kind, OffsetPath::Composed, (DType::BF16, DType::F32), false);
        for path in [OffsetPath::Forward, OffsetPath::Residual] {
            let got = offset_run(kind, path, (DType::BF16, DType::BF16), true);
            assert_eq!(got.y.dtype(), DType::BF16);
            let got = Outcome {
                y: up(&got.y),
                grad_x: up(&got.grad_x),
                grad_weight: up(&got.grad_weight),
                grad_bias: got.grad_bias.as_ref().map(up),
            };
            assert_outcomes_close(&format!("{kind:?} {path:?}"), &got, &want, 2e-2);
        }
    }
}

/// No offset is the plain `x̂ · w`, down to the sign of a zero: a weight of
/// `-0.0` gives `-0.0 · x̂`, which `w + 0.0` would turn into `+0.0 · x̂`.
#[test]
fn no_weight_offset_is_the_plain_scale_down_to_the_sign_of_zero() {
    let weight = Tensor::new(&[-0.0f32, 0.0, 1.5, -2.0], &Device::Cpu).unwrap();
    let x = data(70, &[6, 4], DType::F32);
    let residual = data(71, &[6, 4], DType::F32);
    let plain = nn::RmsNorm::new(weight.clone(), EPS, None);
    assert_eq!(plain.weight_offset(), 0.0);
    let zero = nn::RmsNorm::new(weight.clone(), EPS, None).with_weight_offset(0.0);
    let want = candle_nn::ops::rms_norm_slow(&(&x + &residual).unwrap(), &weight, EPS as f32)
        .unwrap()
        .to_vec2::<f32>()
        .unwrap();
    for norm in [&plain, &zero] {
        let (_, y_residual) = norm.forward_residual(&x, &residual).unwrap();
        let y_plain = norm.forward(&(&x + &residual).unwrap()).unwrap();
        for y in [y_plain, y_residual] {
            for (row, want_row) in y.to_vec2::<f32>().unwrap().iter().zip(&want) {
                for (g, w) in row[..2].iter().zip(&want_row[..2]) {
                    assert_eq!(g.to_bits(), w.to_bits(), "{row:?} vs {want_row:?}");
                }
                for (g, w) in row[2..].iter().zip(&want_row[2..]) {
                    assert!((g - w).abs() <= 1e-6 * w.abs().max(1.0), "{g} vs {w}");
                }
            }
        }
    }
    let layer = nn::LayerNorm::new_no_bias(weight, EPS, None).with_weight_offset(1.0);
    assert_eq!(layer.weight_offset(), 1.0);
    assert_eq!(layer.clone().with_weight_offset(0.0).weight_offset(), 0.0);
}
