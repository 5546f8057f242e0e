//! The MLP: `layers.{i}.weight` `[out, in]`, `layers.{i}.bias` `[out]`, ReLU
//! between layers, built from `zero_candle::nn`'s fused Linear (which reads
//! the weight in place and writes its gradient straight out).

use crate::trainer::TrainError;
use candle_core::{DType, Device, Tensor};
use candle_nn::{Init, Module, VarMap};
use std::path::Path;
use zero_candle::nn::Linear;
use zero_candle::ShardedVarMap;

/// A multi-layer perceptron over variables of a [`VarMap`].
pub struct Mlp {
    layers: Vec<Linear>,
}

impl Mlp {
    /// Creates the variables in `varmap` on `device`, initialized from
    /// `seed` like PyTorch's `nn.Linear` (uniform in ±1/sqrt(fan_in)),
    /// identically on every rank (each element a function of the seed, its
    /// name and its index: see [`Mlp::build`]).
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

    /// [`Mlp::with_hook`] with variables of `dtype` (the same seeded
    /// values, rounded): a 16-bit model for mixed precision.
    pub fn with_hook_in(
        varmap: &VarMap,
        widths: &[usize],
        seed: u64,
        device: &Device,
        hook: Option<std::sync::Arc<dyn zero_candle::nn::GradHook>>,
        dtype: DType,
    ) -> Result<Self, TrainError> {
        let map = ShardedVarMap::seeded(seed);
        let mlp = Self::build(&map, widths, device, hook, dtype)?;
        copy_vars(&map, varmap)?;
        Ok(mlp)
    }

    /// Creates the variables through `map` (whose source gives their
    /// values: [`SeededInit`](zero_candle::SeededInit) draws them uniform
    /// in ±1/sqrt(fan_in), as PyTorch's `nn.Linear`; large ones may be
    /// deferred for stage 3).
    pub fn build(
        map: &ShardedVarMap,
        widths: &[usize],
        device: &Device,
        hook: Option<std::sync::Arc<dyn zero_candle::nn::GradHook>>,
        dtype: DType,
    ) -> Result<Self, TrainError> {
        let mut layers = Vec::new();
        for (i, pair) in widths.windows(2).enumerate() {
            let (fan_in, fan_out) = (pair[0], pair[1]);
            let bound = 1.0 / (fan_in as f64).sqrt();
            let init = Init::Uniform {
                lo: -bound,
                up: bound,
            };
            let w = map.get(
                (fan_out, fan_in),
                &format!("layers.{i}.weight"),
                init,
                dtype,
                device,
            )?;
            let b = map.get(fan_out, &format!("layers.{i}.bias"), init, dtype, device)?;
            // Without a hook the gradients land in backward's GradStore,
            // for `ZeroOptimizer::step`.
            layers.push(Linear::new(w, Some(b), hook.clone()));
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

/// Puts the variables of `map` into `varmap` (a model built through a
/// [`ShardedVarMap`] for callers that hold a plain `VarMap`).
pub fn copy_vars(map: &ShardedVarMap, varmap: &VarMap) -> Result<(), TrainError> {
    map.materialize_all()
        .map_err(|e| TrainError::Internal(format!("cannot initialize the model: {e}")))?;
    let from = map
        .varmap()
        .data()
        .lock()
        .map_err(|_| TrainError::Internal("VarMap lock poisoned".into()))?;
    let mut to = varmap
        .data()
        .lock()
        .map_err(|_| TrainError::Internal("VarMap lock poisoned".into()))?;
    to.extend(from.iter().map(|(n, v)| (n.clone(), v.clone())));
    Ok(())
}

/// Every tensor of a safetensors weights file (`--save`), by name, as f32.
pub fn read_weights(path: &Path) -> Result<Vec<(String, Vec<f32>)>, TrainError> {
    let tensors =
        candle_core::safetensors::load(path, &Device::Cpu).map_err(|e| TrainError::Data {
            path: path.to_path_buf(),
            detail: format!("cannot load weights: {e}"),
        })?;
    let mut weights = Vec::with_capacity(tensors.len());
    for (name, tensor) in tensors {
        let values = tensor
            .flatten_all()?
            .to_dtype(DType::F32)?
            .to_vec1::<f32>()?;
        weights.push((name, values));
    }
    weights.sort_by(|a, b| a.0.cmp(&b.0));
    Ok(weights)
}
