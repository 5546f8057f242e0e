//! What the GPU tests of the Candle optimizer share: a small MLP with
//! deterministic weights, its batches, and weight comparisons.
#![allow(dead_code)]

use candle_core::{DType, Device, Module, Tensor};
use candle_nn::{VarBuilder, VarMap};
use std::sync::Arc;
use zero_candle::nn::{self, GradHook};

/// How a test builds its Candle device. The trainer builds it with
/// `Device::new_cuda`: CUDA's per-thread default stream, and no event
/// tracking by cudarc. `Device::new_cuda_with_stream` gives a stream of its
/// own, on which cudarc waits and records around every buffer a kernel or
/// copy touches: a missing fence is hidden there and real in the trainer,
/// so the GPU tests run both.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Built {
    /// `Device::new_cuda`, as the trainer builds it.
    AsTheTrainer,
    /// `Device::new_cuda_with_stream`.
    OwnStream,
}

/// Both ways, the trainer's first.
pub const BUILDS: [Built; 2] = [Built::AsTheTrainer, Built::OwnStream];

/// Asserts that runs on the two [`BUILDS`] trained weights at most
/// rounding apart (`diff`, the largest difference): the same kernels in the
/// same order, up to cuBLAS choosing another algorithm on another stream.
pub fn assert_builds_agree(dtype: DType, diff: f32, what: &str) {
    let tolerance = if dtype == DType::F32 { 1e-5 } else { 1e-2 };
    assert!(
        diff <= tolerance,
        "{what}: a device built as the trainer builds it trains weights {diff} from one on a \
         stream of its own (a fence that only cudarc's event tracking supplies?)"
    );
}

impl Built {
    /// GPU `ordinal`, built this way (on the calling thread: with the
    /// per-thread stream, the thread that uses it).
    pub fn device(self, ordinal: usize) -> candle_core::Result<Device> {
        match self {
            Built::AsTheTrainer => Device::new_cuda(ordinal),
            Built::OwnStream => Device::new_cuda_with_stream(ordinal),
        }
    }
}

pub const IN: usize = 32;
pub const HIDDEN: usize = 64;
pub const OUT: usize = 8;
pub const BATCH: usize = 16;

/// A two-layer MLP with deterministic weights, on `device` in `dtype`.
pub fn mlp(device: &Device, dtype: DType) -> (VarMap, impl Module) {
    mlp_of(device, dtype, |i, o, vb| candle_nn::linear(i, o, vb))
}

/// [`mlp`] built from `zero_candle::nn` layers that report their
/// gradients to `hook` during backward (what the overlapped schedules
/// need).
pub fn hooked_mlp(device: &Device, dtype: DType, hook: Arc<dyn GradHook>) -> (VarMap, impl Module) {
    mlp_of(device, dtype, move |i, o, vb| {
        nn::linear(i, o, vb, Some(hook.clone()))
    })
}

/// [`mlp`] with its layers made by `linear(in, out, vb)`.
fn mlp_of<L: Module + 'static>(
    device: &Device,
    dtype: DType,
    linear: impl Fn(usize, usize, VarBuilder) -> candle_core::Result<L>,
) -> (VarMap, impl Module) {
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, dtype, device);
    let up = linear(IN, HIDDEN, vb.pp("up")).expect("up");
    let down = linear(HIDDEN, OUT, vb.pp("down")).expect("down");
    init(&varmap, device, dtype);
    let model = candle_nn::seq()
        .add(up)
        .add(candle_nn::Activation::Relu)
        .add(down);
    (varmap, model)
}

/// Deterministic values for every variable of `varmap`, by name.
fn init(varmap: &VarMap, device: &Device, dtype: DType) {
    let mut vars: Vec<_> = varmap
        .data()
        .lock()
        .expect("varmap")
        .iter()
        .map(|(n, v)| (n.clone(), v.clone()))
        .collect();
    vars.sort_by(|a, b| a.0.cmp(&b.0));
    for (i, (_, var)) in vars.iter().enumerate() {
        let n = var.elem_count();
        let values: Vec<f32> = (0..n)
            .map(|j| (((i * 31 + j * 7) % 23) as f32 / 23.0 - 0.5) * 0.2)
            .collect();
        let t = Tensor::from_vec(values, var.dims(), device)
            .and_then(|t| t.to_dtype(dtype))
            .expect("init");
        var.set(&t).expect("set");
    }
}

/// Step `s`'s batch.
pub fn batch(device: &Device, dtype: DType, s: usize) -> (Tensor, Tensor) {
    let x: Vec<f32> = (0..BATCH * IN)
        .map(|j| ((j * 13 + s * 5) % 17) as f32 / 17.0 - 0.5)
        .collect();
    let y: Vec<f32> = (0..BATCH * OUT)
        .map(|j| ((j * 3 + s) % 7) as f32 / 7.0)
        .collect();
    let x = Tensor::from_vec(x, (BATCH, IN), device).and_then(|t| t.to_dtype(dtype));
    let y = Tensor::from_vec(y, (BATCH, OUT), device).and_then(|t| t.to_dtype(dtype));
    (x.expect("x"), y.expect("y"))
}

/// Every variable's values in f32, by name.
pub fn weights(varmap: &VarMap) -> Vec<(String, Vec<f32>)> {
    let mut out: Vec<(String, Vec<f32>)> = varmap
        .data()
        .lock()
        .expect("varmap")
        .iter()
        .map(|(n, v)| {
            let values = v
                .as_tensor()
                .to_dtype(DType::F32)
                .and_then(|t| t.flatten_all())
                .and_then(|t| t.to_vec1::<f32>())
                .expect("weights");
            (n.clone(), values)
        })
        .collect();
    out.sort_by(|a, b| a.0.cmp(&b.0));
    out
}

pub fn max_diff(a: &[(String, Vec<f32>)], b: &[(String, Vec<f32>)]) -> f32 {
    a.iter()
        .zip(b)
        .flat_map(|((_, x), (_, y))| x.iter().zip(y).map(|(u, v)| (u - v).abs()))
        .fold(0.0, f32::max)
}
