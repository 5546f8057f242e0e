//! `Linear::forward_activated` (the layer and its activation as one op)
//! against the unfused pair `ops::gelu(&layer.forward(x)?)` (and
//! `gelu_erf`, `silu`), and `Linear::forward_on_activated` (an activation
//! on the layer's input, kept as `x`, computed again in the backward)
//! against `layer.forward(&ops::gelu(x)?)`, over the same variables: the
//! same output, input gradient and hook calls (`∂b`, then `∂W`), element
//! for element; and against Candle's own composed ops (`Tensor::gelu`,
//! ...) within rounding, which checks the derivative they share.

mod nn_support;

use candle_core::{DType, Device, Module, Tensor, TensorId, Var};
use candle_nn::{VarBuilder, VarMap};
use nn_support::{assert_close, assert_equal, data, hook, var, weighted_sum, Recorder};
use std::collections::HashMap;
use std::sync::Arc;
use zero_candle::nn::{self, ops, Activation, GatheredParam, GiveBack, GradHook, Linear, Stretch};

const IN: usize = 24;
const OUT: usize = 10;
const ACTIVATIONS: [Activation; 4] = [
    Activation::Gelu,
    Activation::GeluErf,
    Activation::Silu,
    Activation::Relu2,
];

/// Which side of the layer the activation is on.
#[derive(Clone, Copy, Debug)]
enum Side {
    /// `act(x·Wᵀ + b)`: `forward_activated`.
    Output,
    /// `act(x)·Wᵀ + b`: `forward_on_activated`.
    Input,
}

const SIDES: [Side; 2] = [Side::Output, Side::Input];

/// The activation op alone.
fn activate(x: &Tensor, activation: Activation) -> Tensor {
    match activation {
        Activation::Gelu => ops::gelu(x),
        Activation::GeluErf => ops::gelu_erf(x),
        Activation::Silu => ops::silu(x),
        Activation::Relu2 => ops::relu2(x),
    }
    .unwrap()
}

/// The unfused pair: the layer and the activation op, on `side`.
fn pair(layer: &Linear, x: &Tensor, activation: Activation, side: Side) -> Tensor {
    match side {
        Side::Output => activate(&layer.forward(x).unwrap(), activation),
        Side::Input => layer.forward(&activate(x, activation)).unwrap(),
    }
}

/// The fused layer: the layer and its activation on `side` as one op.
fn fused(layer: &Linear, x: &Tensor, activation: Activation, side: Side) -> Tensor {
    match side {
        Side::Output => layer.forward_activated(x, activation),
        Side::Input => layer.forward_on_activated(x, activation),
    }
    .unwrap()
}

/// Candle's composed form of the activation, its own derivative.
fn composed(pre: &Tensor, activation: Activation) -> Tensor {
    match activation {
        Activation::Gelu => pre.gelu(),
        Activation::GeluErf => pre.gelu_erf(),
        Activation::Silu => pre.silu(),
        Activation::Relu2 => pre.relu().and_then(|r| r.sqr()),
    }
    .unwrap()
}

/// The fused layer and the unfused pair over the same variables, each with
/// its own recorder; `x` may be strided. Asks for equal values everywhere
/// and the same hook calls in the same order.
fn compare(bias: bool, x: &Tensor, activation: Activation, side: Side) {
    let dtype = x.dtype();
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, dtype, &Device::Cpu);
    let (fused_calls, pair_calls) = (Recorder::new(), Recorder::new());
    let fused = nn::linear_b(IN, OUT, bias, vb.pp("fc"), hook(&fused_calls)).unwrap();
    let unfused = nn::linear_b(IN, OUT, bias, vb.pp("fc"), hook(&pair_calls)).unwrap();
    assert_eq!(fused.weight().id(), unfused.weight().id());
    let case = format!(
        "{activation:?} on the {side:?} {dtype:?} bias {bias} x {:?}",
        x.dims()
    );

    let got_y = self::fused(&fused, x, activation, side);
    let want_y = pair(&unfused, x, activation, side);
    assert_equal(&format!("{case}: output"), &got_y, &want_y);
    let got = weighted_sum(&got_y, 2).backward().unwrap();
    let want = weighted_sum(&want_y, 2).backward().unwrap();
    let leaf = x.is_variable().then_some(x);
    if let Some(x) = leaf {
        assert_equal(
            &format!("{case}: ∂x"),
            got.get(x).unwrap(),
            want.get(x).unwrap(),
        );
    }
    let (got_calls, want_calls) = (fused_calls.calls(), pair_calls.calls());
    assert_eq!(got_calls.len(), if bias { 2 } else { 1 }, "{case}");
    assert_eq!(
        fused_calls.ids(),
        pair_calls.ids(),
        "{case}: the hook's calls"
    );
    for ((var, got_grad), (_, want_grad)) in got_calls.iter().zip(&want_calls) {
        assert_equal(&format!("{case}: ∂{:?}", var.dims()), got_grad, want_grad);
        assert!(
            got.get(var.as_tensor()).is_none(),
            "{case}: the hook took it"
        );
    }
}

#[test]
fn every_activation_and_dtype_matches_the_unfused_pair_exactly() {
    for dtype in [DType::F32, DType::F64, DType::BF16, DType::F16] {
        for activation in ACTIVATIONS {
            for (bias, side) in [true, false]
                .into_iter()
                .flat_map(|b| SIDES.map(|s| (b, s)))
            {
                compare(bias, var(1, &[7, IN], dtype).as_tensor(), activation, side);
                compare(
                    bias,
                    var(3, &[3, 5, IN], dtype).as_tensor(),
                    activation,
                    side,
                );
            }
        }
    }
}

#[test]
fn strided_and_untracked_inputs_match_the_unfused_pair() {
    for (activation, side) in ACTIVATIONS.into_iter().flat_map(|a| SIDES.map(|s| (a, s))) {
        let strided = var(4, &[5, IN, 3], DType::F32)
            .as_tensor()
            .transpose(1, 2)
            .unwrap();
        assert!(!strided.is_contiguous());
        compare(true, &strided, activation, side);
        let t = var(5, &[IN, 6], DType::BF16).as_tensor().t().unwrap();
        compare(false, &t, activation, side);
        compare(true, &data(6, &[4, IN], DType::F32), activation, side);
    }
}

/// Against Candle's composed ops (its own GELU, SiLU and their
/// derivatives): a wrong derivative shared by the fused layer and the
/// activation op shows here.
#[test]
fn values_and_gradients_agree_with_candles_composed_ops() {
    // Candle's GELU derivative has 6-digit constants: gradients agree to
    // about 1e-6 in f64 too.
    for (dtype, tol, grad_tol) in [(DType::F32, 1e-5, 1e-5), (DType::F64, 1e-12, 1e-5)] {
        for (activation, side) in ACTIVATIONS.into_iter().flat_map(|a| SIDES.map(|s| (a, s))) {
            let varmap = VarMap::new();
            let vb = VarBuilder::from_varmap(&varmap, dtype, &Device::Cpu);
            let reference = candle_nn::linear(IN, OUT, vb.pp("fc")).unwrap();
            let layer = nn::linear(IN, OUT, vb.pp("fc"), None).unwrap();
            // Inputs scaled so that the pre-activations reach GELU's and
            // SiLU's curved parts, both tails included.
            let x = Var::from_tensor(&(data(7, &[3, 4, IN], dtype) * 4.0).unwrap()).unwrap();
            let case = format!("{activation:?} on the {side:?} {dtype:?}");
            let want_y = match side {
                Side::Output => composed(&reference.forward(&x).unwrap(), activation),
                Side::Input => reference.forward(&composed(&x, activation)).unwrap(),
            };
            let got_y = fused(&layer, &x, activation, side);
            assert_close(&format!("{case}: output"), &got_y, &want_y, tol);
            let want = weighted_sum(&want_y, 8).backward().unwrap();
            let got = weighted_sum(&got_y, 8).backward().unwrap();
            for (what, t) in [
                ("∂x", x.as_tensor()),
                ("∂W", reference.weight()),
                ("∂b", reference.bias().unwrap()),
            ] {
                assert_close(
                    &format!("{case}: {what}"),
                    got.get(t).unwrap(),
                    want.get(t).unwrap(),
                    grad_tol,
                );
            }
        }
    }
}

/// A stage-3 stand-in: the layer's variables hold zeros, and the hook lends
/// their real values, whole or in two pieces split inside a row.
struct Lender {
    recorder: Arc<Recorder>,
    values: HashMap<TensorId, Tensor>,
    pieces: usize,
}

struct Keep;

impl GiveBack for Keep {
    fn give_back(&self, _tag: usize, _storage: candle_core::Storage) {}
}

impl GradHook for Lender {
    fn grad_ready(&self, var: &Var, grad: Tensor) -> candle_core::Result<()> {
        self.recorder.grad_ready(var, grad)
    }

    fn gather(&self, var: &Var, piece: usize) -> candle_core::Result<Option<GatheredParam>> {
        let Some(values) = self.values.get(&var.id()) else {
            return Ok(None);
        };
        let n = values.elem_count();
        // Two pieces split one element into a row of the weight.
        let split = if self.pieces == 1 || n < IN {
            n
        } else {
            IN + 1
        };
        let ranges = [0..split, split..n];
        let Some(range) = ranges.get(piece).filter(|r| !r.is_empty()) else {
            return Ok(None);
        };
        // A storage of the stretch alone (`copy` would keep the offset).
        let stretch = values
            .flatten_all()?
            .narrow(0, range.start, range.len())?
            .to_vec1::<f32>()?;
        let stretch = Tensor::from_vec(stretch, range.len(), &Device::Cpu)?;
        let (storage, _) = stretch.storage_and_layout();
        let storage = match &*storage {
            candle_core::Storage::Cpu(cpu) => candle_core::Storage::Cpu(cpu.clone()),
            _ => candle_core::bail!("the test lends CPU values"),
        };
        let stretches = vec![Stretch {
            at: 0..range.len(),
            values: range.clone(),
        }];
        Ok(Some(GatheredParam::new(
            storage,
            stretches,
            var.shape(),
            piece,
            Arc::new(Keep),
        )))
    }
}

#[test]
fn gathered_weights_whole_or_in_pieces_give_the_unfused_values() {
    for pieces in [1, 2] {
        for (activation, side) in ACTIVATIONS.into_iter().flat_map(|a| SIDES.map(|s| (a, s))) {
            let dtype = DType::F32;
            let (w, b) = (data(9, &[OUT, IN], dtype), data(10, &[OUT], dtype));
            let recorder = Recorder::new();
            let (w_var, b_var) = (
                Var::from_tensor(&w.zeros_like().unwrap()).unwrap(),
                Var::from_tensor(&b.zeros_like().unwrap()).unwrap(),
            );
            let lender = Lender {
                recorder: recorder.clone(),
                values: HashMap::from([(w_var.id(), w.clone()), (b_var.id(), b.clone())]),
                pieces,
            };
            let hook: Arc<dyn GradHook> = Arc::new(lender);
            let sharded = Linear::new(
                w_var.as_tensor().clone(),
                Some(b_var.as_tensor().clone()),
                Some(hook),
            );
            let (w_ref, b_ref) = (Var::from_tensor(&w).unwrap(), Var::from_tensor(&b).unwrap());
            let want_calls = Recorder::new();
            let whole = Linear::new(
                w_ref.as_tensor().clone(),
                Some(b_ref.as_tensor().clone()),
                nn_support::hook(&want_calls),
            );
            let x = var(11, &[2, 3, IN], dtype);
            let case = format!("{activation:?} on the {side:?} in {pieces} piece(s)");
            let got_y = fused(&sharded, &x, activation, side);
            let want_y = pair(&whole, &x, activation, side);
            // Pieces sum a split row's parts in f32 in another order.
            assert_close(&format!("{case}: output"), &got_y, &want_y, 1e-6);
            let got = weighted_sum(&got_y, 12).backward().unwrap();
            let want = weighted_sum(&want_y, 12).backward().unwrap();
            assert_close(
                &format!("{case}: ∂x"),
                got.get(&x).unwrap(),
                want.get(&x).unwrap(),
                1e-6,
            );
            assert_close(
                &format!("{case}: ∂W"),
                &recorder.grad_of(w_var.as_tensor()),
                &want_calls.grad_of(w_ref.as_tensor()),
                1e-6,
            );
            assert_close(
                &format!("{case}: ∂b"),
                &recorder.grad_of(b_var.as_tensor()),
                &want_calls.grad_of(b_ref.as_tensor()),
                1e-6,
            );
        }
    }
}
