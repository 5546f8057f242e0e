//! The MLP: `layers.{i}.weight` `[out, in]`, `layers.{i}.bias` `[out]`, ReLU
//! between layers, built from `zero_candle::nn`'s fused Linear (which reads
//! the weight in place and writes its gradient straight out).

use crate::trainer::TrainError;
use candle_core::{DType, Device, Tensor, Var};
use candle_nn::{Module, VarMap};
use rand::{rngs::StdRng, Rng, SeedableRng};
use std::path::Path;
use zero_candle::nn::Linear;

/// A multi-layer perceptron over variables of a [`VarMap`].
pub struct Mlp {
    layers: Vec<Linear>,
}

impl Mlp {
    /// Creates the variables in `varmap` on `device`, initialized from
    /// `seed` like PyTorch's `nn.Linear` (uniform in ±1/sqrt(fan_in)),
    /// identically on every rank.
    pub fn new(
        varmap: &VarMap,
        widths: &[usize],
        seed: u64,
        device: &Device,
    ) -> Result<Self, TrainError> {
        Self::with_hook(varmap, widths, seed, device, None)
    }

    /// [`Mlp::new`] with layers that hand their gradients to `hook` during
    /// backward (a `zero_candle::ZeroHook`, for `ZeroOptimizer::backward_step`).
    pub fn with_hook(
        varmap: &VarMap,
        widths: &[usize],
        seed: u64,
        device: &Device,
        hook: Option<std::sync::Arc<dyn zero_candle::nn::GradHook>>,
    ) -> Result<Self, TrainError> {
        Self::with_hook_in(varmap, widths, seed, device, hook, DType::F32)
    }

    /// [`Mlp::with_hook`] with variables of `dtype` (the same seeded f32
    /// values, rounded): a 16-bit model for mixed precision.
    pub fn with_hook_in(
        varmap: &VarMap,
        widths: &[usize],
        seed: u64,
        device: &Device,
        hook: Option<std::sync::Arc<dyn zero_candle::nn::GradHook>>,
        dtype: DType,
    ) -> Result<Self, TrainError> {
        let mut rng = StdRng::seed_from_u64(seed);
        let mut data = varmap
            .data()
            .lock()
            .map_err(|_| TrainError::Internal("VarMap lock poisoned".into()))?;
        let mut layers = Vec::new();
        for (i, pair) in widths.windows(2).enumerate() {
            let (fan_in, fan_out) = (pair[0], pair[1]);
            let bound = 1.0 / (fan_in as f32).sqrt();
            let w: Vec<f32> = (0..fan_in * fan_out)
                .map(|_| rng.gen_range(-bound..bound))
                .collect();
            let b: Vec<f32> = (0..fan_out).map(|_| rng.gen_range(-bound..bound)).collect();
            let w = Tensor::from_vec(w, (fan_out, fan_in), device)?.to_dtype(dtype)?;
            let b = Tensor::from_vec(b, fan_out, device)?.to_dtype(dtype)?;
            let (w, b) = (Var::from_tensor(&w)?, Var::from_tensor(&b)?);
            data.insert(format!("layers.{i}.weight"), w.clone());
            data.insert(format!("layers.{i}.bias"), b.clone());
            // Without a hook the gradients land in backward's GradStore,
            // for `ZeroOptimizer::step`.
            layers.push(Linear::new(
                w.as_tensor().clone(),
                Some(b.as_tensor().clone()),
                hook.clone(),
            ));
        }
        Ok(Self { layers })
    }

    /// Logits for `x` `[rows, in]`.
    pub fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let mut h = x.clone();
        for (i, layer) in self.layers.iter().enumerate() {
            h = layer.forward(&h)?;
            if i + 1 < self.layers.len() {
                h = h.relu()?;
            }
        }
        Ok(h)
    }
}

/// Loads every variable of `varmap` by name from a safetensors file; a
/// missing or mis-shaped tensor is an error naming it.
pub fn load_weights(varmap: &VarMap, path: &Path) -> Result<(), TrainError> {
    let bad = |detail: String| TrainError::Data {
        path: path.to_path_buf(),
        detail,
    };
    let tensors = candle_core::safetensors::load(path, &Device::Cpu)
        .map_err(|e| bad(format!("cannot load weights: {e}")))?;
    let data = varmap
        .data()
        .lock()
        .map_err(|_| TrainError::Internal("VarMap lock poisoned".into()))?;
    let mut names: Vec<&String> = data.keys().collect();
    names.sort();
    for name in names {
        let var = &data[name];
        let Some(t) = tensors.get(name) else {
            return Err(bad(format!(
                "has no tensor {name:?} (shape {:?})",
                var.dims()
            )));
        };
        if t.dims() != var.dims() {
            return Err(bad(format!(
                "tensor {name:?} has shape {:?}, the model needs {:?}",
                t.dims(),
                var.dims()
            )));
        }
        var.set(&t.to_dtype(var.dtype())?.to_device(var.device())?)?;
    }
    Ok(())
}

/// Writes the weights under their names (safetensors, as `VarMap::save`).
pub fn save_weights(weights: &[(String, Tensor)], path: &Path) -> Result<(), TrainError> {
    let tensors: std::collections::HashMap<&str, Tensor> = weights
        .iter()
        .map(|(n, t)| (n.as_str(), t.clone()))
        .collect();
    candle_core::safetensors::save(&tensors, path).map_err(|e| TrainError::Data {
        path: path.to_path_buf(),
        detail: format!("cannot write weights: {e}"),
    })
}
