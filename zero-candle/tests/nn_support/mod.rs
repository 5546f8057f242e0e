//! Helpers shared by the `nn_*` tests: seeded data, comparisons, and a hook
//! that records every call.

#![allow(dead_code)]

use candle_core::{DType, Device, Tensor, TensorId, Var};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::sync::{Arc, Mutex};
use zero_candle::nn::GradHook;

/// A seeded tensor of values in [-1, 1), of `dtype`.
pub fn data(seed: u64, shape: &[usize], dtype: DType) -> Tensor {
    let mut rng = StdRng::seed_from_u64(seed);
    let n: usize = shape.iter().product();
    let values: Vec<f64> = (0..n).map(|_| rng.gen_range(-1.0..1.0)).collect();
    Tensor::from_vec(values, shape, &Device::Cpu)
        .unwrap()
        .to_dtype(dtype)
        .unwrap()
}

/// A seeded variable (a leaf that gets a gradient), of `dtype`.
pub fn var(seed: u64, shape: &[usize], dtype: DType) -> Var {
    Var::from_tensor(&data(seed, shape, dtype)).unwrap()
}

/// The elements of `t` as f64, in row-major order.
pub fn values(t: &Tensor) -> Vec<f64> {
    t.flatten_all()
        .unwrap()
        .to_dtype(DType::F64)
        .unwrap()
        .to_vec1::<f64>()
        .unwrap()
}

/// `got` equals `want` element for element (`==` on the values: bitwise up
/// to the sign of zero).
pub fn assert_equal(what: &str, got: &Tensor, want: &Tensor) {
    assert_eq!(got.dims(), want.dims(), "{what}: shapes");
    assert_eq!(got.dtype(), want.dtype(), "{what}: dtypes");
    let (got, want) = (values(got), values(want));
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert!(g == w, "{what}: element {i} is {g:e}, want {w:e} exactly");
    }
}

/// `|got - want| <= tol · max(1, max |want|)` element for element.
pub fn assert_close(what: &str, got: &Tensor, want: &Tensor, tol: f64) {
    assert_eq!(got.dims(), want.dims(), "{what}: shapes");
    assert_eq!(got.dtype(), want.dtype(), "{what}: dtypes");
    let (got, want) = (values(got), values(want));
    let scale = want.iter().fold(1.0f64, |m, w| m.max(w.abs()));
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert!(
            (g - w).abs() <= tol * scale,
            "{what}: element {i} is {g:e}, want {w:e} (tolerance {tol:e} x {scale})"
        );
    }
}

/// `Σ t·weights`: a loss whose gradient with respect to `t` is `weights`,
/// not uniform, so that a transposed or misplaced gradient shows.
pub fn weighted_sum(t: &Tensor, seed: u64) -> Tensor {
    let weights = data(seed, t.dims(), t.dtype());
    (t * weights).unwrap().sum_all().unwrap()
}

/// A hook that records every call, in order.
#[derive(Default)]
pub struct Recorder {
    calls: Mutex<Vec<(Var, Tensor)>>,
}

impl Recorder {
    pub fn new() -> Arc<Self> {
        Arc::new(Self::default())
    }

    /// Every call so far, in order.
    pub fn calls(&self) -> Vec<(Var, Tensor)> {
        self.calls.lock().unwrap().clone()
    }

    /// The ids of the variables of every call, in order.
    pub fn ids(&self) -> Vec<TensorId> {
        self.calls().iter().map(|(v, _)| v.id()).collect()
    }

    /// The gradients handed over for `var`, in order.
    pub fn grads_of(&self, var: &Tensor) -> Vec<Tensor> {
        self.calls()
            .into_iter()
            .filter(|(v, _)| v.id() == var.id())
            .map(|(_, g)| g)
            .collect()
    }

    /// The single gradient handed over for `var`.
    pub fn grad_of(&self, var: &Tensor) -> Tensor {
        let mut grads = self.grads_of(var);
        assert_eq!(grads.len(), 1, "expected one hook call for {:?}", var.id());
        grads.remove(0)
    }
}

impl GradHook for Recorder {
    fn grad_ready(&self, var: &Var, grad: Tensor) -> candle_core::Result<()> {
        self.calls.lock().unwrap().push((var.clone(), grad));
        Ok(())
    }
}

/// `recorder` as a layer's hook.
pub fn hook(recorder: &Arc<Recorder>) -> Option<Arc<dyn GradHook>> {
    Some(recorder.clone())
}

/// Sets every variable of `varmap` to values in [-0.5, 0.5) drawn in name
/// order from `seed`: the same model on every rank and in every run.
pub fn seed_varmap(varmap: &candle_nn::VarMap, seed: u64) -> candle_core::Result<()> {
    let mut rng = StdRng::seed_from_u64(seed);
    let data = varmap.data().lock().unwrap();
    let mut names: Vec<&String> = data.keys().collect();
    names.sort();
    for name in names {
        let var = &data[name];
        let values: Vec<f32> = (0..var.elem_count())
            .map(|_| rng.gen_range(-0.5..0.5))
            .collect();
        var.set(&Tensor::from_vec(values, var.dims(), &Device::Cpu)?)?;
    }
    Ok(())
}

/// Three sequences of `seq` token ids below `vocab`, and three of targets.
pub fn token_batch(
    rng: &mut StdRng,
    vocab: usize,
    seq: usize,
) -> candle_core::Result<(Tensor, Tensor)> {
    let mut ids =
        |n: usize| -> Vec<u32> { (0..n).map(|_| rng.gen_range(0..vocab as u32)).collect() };
    let (tokens, targets) = (ids(3 * seq), ids(3 * seq));
    Ok((
        Tensor::from_vec(tokens, (3, seq), &Device::Cpu)?,
        Tensor::from_vec(targets, (3, seq), &Device::Cpu)?,
    ))
}

/// Rows `rows` of step `step`'s global batch of `batch` rows for a small
/// regression: `inputs` values in [-1, 1] per row, `outputs` targets; the
/// same rows whichever rank asks, so that ranks splitting a batch see what
/// one rank sees whole.
pub fn regression_rows(
    step: usize,
    batch: usize,
    rows: std::ops::Range<usize>,
    (inputs, outputs): (usize, usize),
) -> (Tensor, Tensor) {
    let n = rows.len();
    let value = |i: usize, k: usize, salt: usize| {
        (((step * batch + i) * 7 + k * 13 + salt) % 19) as f32 / 9.0 - 1.0
    };
    let x: Vec<f32> = rows
        .clone()
        .flat_map(|i| (0..inputs).map(move |k| value(i, k, 0)))
        .collect();
    let y: Vec<f32> = rows
        .flat_map(|i| (0..outputs).map(move |k| value(i, k, 3)))
        .collect();
    (
        Tensor::from_vec(x, (n, inputs), &Device::Cpu).unwrap(),
        Tensor::from_vec(y, (n, outputs), &Device::Cpu).unwrap(),
    )
}
