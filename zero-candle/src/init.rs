//! Building a model that no rank holds whole: [`ShardedVarMap`] creates a
//! model's variables through a `VarBuilder` without values (at stage 3
//! `ZeroOptimizer::new_sharded` fills this rank's shard of the large ones
//! from the source, the rest whole), and
//! [`ParamSource`] says where values come from: [`SeededInit`], which
//! computes any element from (seed, name, index) so that the model is the
//! same at every world size, or [`SafetensorsInit`], a memory-mapped file.
//!
//! ```no_run
//! use candle_core::{DType, Device};
//! use zero_candle::{nn, ShardedVarMap, ZeroHook, ZeroOptimizer};
//! use zero_core::{ThreadComm, ThreadGroup, engine::{EngineConfig, Stage}, optim::{Adam, AdamConfig}};
//!
//! ThreadGroup::new(2).run(|comm| -> zero_candle::Result<()> {
//!     let config = EngineConfig::default().with_stage(Stage::Parameters);
//!     // Variables are created without values; new_sharded fills them.
//!     let vars = ShardedVarMap::seeded(7);
//!     let hook = ZeroHook::<ThreadComm, f32>::new();
//!     let vb = vars.builder(DType::F32, &Device::Cpu);
//!     let layer = nn::linear(4096, 4096, vb.pp("layer"), Some(hook.clone()))?;
//!     let adam = Box::new(Adam::new(AdamConfig::default())?);
//!     // Each rank fills only its shard; the first step already runs sharded.
//!     let mut opt = ZeroOptimizer::new_sharded(&vars, comm, config, adam, &hook)?;
//!     # let _ = (layer, &mut opt);
//!     Ok(())
//! });
//! ```

use crate::params::VarStore;
use crate::{Error, Result};
use candle_core::backend::{BackendDevice, BackendStorage};
use candle_core::op::BackpropOp;
use candle_core::{
    CpuStorage, CudaStorage, DType, Device, InplaceOp1, Layout, Shape, Storage, Tensor, Var,
    WithDType,
};
use candle_nn::init::{FanInOut, NormalOrUniform};
use candle_nn::var_builder::SimpleBackend;
use candle_nn::{Init, VarBuilder, VarMap};
use half::{bf16, f16};
use rayon::prelude::*;
use std::collections::HashMap;
use std::ops::Range;
use std::path::Path;
use std::sync::{Arc, Mutex, MutexGuard};
use zero_core::checkpoint::MappedTensors;
use zero_core::Element;
use zero_core::ParamStore;

/// Elements computed at a time when filling a parameter (bounds the f64
/// staging buffer).
const BLOCK: usize = 1 << 14;

/// Where a parameter's initial values come from, element range by element
/// range, so that a rank can compute only its shard.
pub trait ParamSource: Send + Sync {
    /// Elements `range` of the flattened (row-major) parameter `name` of
    /// `shape`, asked for with `init` (a `VarBuilder` hint the source may
    /// ignore), into `out` (`out.len() == range.len()`). Every call for the
    /// same element gives the same value.
    fn fill(
        &self,
        name: &str,
        shape: &[usize],
        init: Init,
        range: Range<usize>,
        out: &mut [f64],
    ) -> Result<()>;

    /// Called when the parameter is created: an error if the source cannot
    /// give it (a file without the tensor, or with another shape).
    fn check(&self, name: &str, shape: &[usize]) -> Result<()> {
        let _ = (name, shape);
        Ok(())
    }

    /// The shape of the tensor `name` where the source holds one (a file's
    /// tensor); `None` for a source that computes its values (a seed).
    /// What lets a model read a tensor it does not train (a buffer, such as
    /// GLM-4.5's `e_score_correction_bias`) without knowing its shape.
    fn shape_of(&self, name: &str) -> Option<Vec<usize>> {
        let _ = name;
        None
    }
}

/// Counter-based initialization: element `i` of parameter `name` is a
/// function of (seed, name, i) alone, drawn from the `VarBuilder` hint's
/// distribution (candle-nn's: constants, uniform, normal, Kaiming with
/// PyTorch's gains and fans). The same seed gives the same model at every
/// world size and stage, whether a rank computes all of it or its shard.
///
/// The stream is SplitMix64 over a key from the seed and the name (FNV-1a);
/// normal draws use Box-Muller on two such uniforms. It is not Candle's
/// `Init::var` stream (which depends on the order of creation and cannot
/// be cut into shards): the values differ from a plain `VarMap`'s, with the
/// same distribution.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SeededInit {
    seed: u64,
}

impl SeededInit {
    /// The initializer of `seed`.
    pub fn new(seed: u64) -> Self {
        Self { seed }
    }

    /// Element `index` of parameter `name` of `shape`, initialized by `init`.
    pub fn value(&self, name: &str, shape: &[usize], init: Init, index: usize) -> f64 {
        resolve(init, shape).draw(self.key(name), index)
    }

    fn key(&self, name: &str) -> u64 {
        let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
        for byte in name.bytes() {
            hash ^= u64::from(byte);
            hash = hash.wrapping_mul(0x0100_0000_01b3);
        }
        splitmix(self.seed ^ splitmix(hash))
    }
}

impl ParamSource for SeededInit {
    fn fill(
        &self,
        name: &str,
        shape: &[usize],
        init: Init,
        range: Range<usize>,
        out: &mut [f64],
    ) -> Result<()> {
        let key = self.key(name);
        let dist = resolve(init, shape);
        for (o, i) in out.iter_mut().zip(range) {
            *o = dist.draw(key, i);
        }
        Ok(())
    }
}

/// A distribution with its parameters worked out from a hint and a shape.
#[derive(Clone, Copy)]
enum Dist {
    Const(f64),
    Uniform(f64, f64),
    Normal(f64, f64),
}

impl Dist {
    /// Element `i` of the stream `key`.
    fn draw(self, key: u64, i: usize) -> f64 {
        match self {
            Dist::Const(c) => c,
            Dist::Uniform(lo, up) => lo + (up - lo) * uniform(key, 2 * i as u64),
            Dist::Normal(mean, std) => mean + std * normal(key, i as u64),
        }
    }
}

/// candle-nn's meaning of each hint (`Init::var`).
fn resolve(init: Init, shape: &[usize]) -> Dist {
    match init {
        Init::Const(c) => Dist::Const(c),
        Init::Uniform { lo, up } => Dist::Uniform(lo, up),
        Init::Randn { mean, stdev } => Dist::Normal(mean, stdev),
        Init::Kaiming {
            dist,
            fan,
            non_linearity,
        } => {
            let fan = fan_of(fan, shape) as f64;
            let std = non_linearity.gain() / fan.sqrt();
            match dist {
                NormalOrUniform::Uniform => {
                    let bound = 3f64.sqrt() * std;
                    Dist::Uniform(-bound, bound)
                }
                NormalOrUniform::Normal => Dist::Normal(0.0, std),
            }
        }
    }
}

/// candle-nn's `FanInOut::for_shape`.
fn fan_of(fan: FanInOut, dims: &[usize]) -> usize {
    let receptive: usize = dims.iter().skip(2).product();
    match fan {
        FanInOut::FanIn if dims.len() >= 2 => dims[1] * receptive,
        FanInOut::FanOut if !dims.is_empty() => dims[0] * receptive,
        _ => 1,
    }
}

fn splitmix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Draw `counter` of stream `key`, uniform in [0, 1) with 53 bits.
fn uniform(key: u64, counter: u64) -> f64 {
    (splitmix(key ^ splitmix(counter)) >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
}

/// Standard normal for element `i` (Box-Muller on draws 2i and 2i + 1).
fn normal(key: u64, i: u64) -> f64 {
    let u1 = 1.0 - uniform(key, 2 * i);
    let u2 = uniform(key, 2 * i + 1);
    (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
}

/// Values from a safetensors file (`--init FILE`), memory-mapped: a rank
/// reads only the elements it asks for, one tensor at a time, whatever
/// their dtype in the file (converted).
pub struct SafetensorsInit {
    file: MappedTensors,
}

impl SafetensorsInit {
    /// Maps `path`; an error names it if it is not a safetensors file.
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        Ok(Self {
            file: MappedTensors::open(path)?,
        })
    }
}

impl ParamSource for SafetensorsInit {
    fn fill(
        &self,
        name: &str,
        shape: &[usize],
        _init: Init,
        range: Range<usize>,
        out: &mut [f64],
    ) -> Result<()> {
        self.check(name, shape)?;
        let tensor = self
            .file
            .get(name)
            .ok_or_else(|| missing(&self.file, name))?;
        Ok(tensor.read_range_as(range, out)?)
    }

    fn shape_of(&self, name: &str) -> Option<Vec<usize>> {
        self.file.get(name).map(|tensor| tensor.shape.clone())
    }

    fn check(&self, name: &str, shape: &[usize]) -> Result<()> {
        let tensor = self
            .file
            .get(name)
            .ok_or_else(|| missing(&self.file, name))?;
        if tensor.shape != shape {
            return Err(Error::Variable {
                name: name.into(),
                detail: format!(
                    "{} holds it as {:?}, the model needs {shape:?}; load weights saved from \
                     this model",
                    self.file.path().display(),
                    tensor.shape
                ),
            });
        }
        Ok(())
    }
}

fn missing(file: &MappedTensors, name: &str) -> Error {
    Error::Variable {
        name: name.into(),
        detail: format!(
            "{} has no tensor of that name; load weights saved from this model",
            file.path().display()
        ),
    }
}

/// A `VarMap` whose variables come from a [`ParamSource`] and are created
/// without values, for [`ZeroOptimizer::new_sharded`] to fill: at stage 3
/// each rank computes only its shard of the large ones, so no rank ever
/// holds them whole; at other stages (and for the parameters stage 3 keeps
/// whole) every rank computes whole values. Which parameters are large is
/// [`EngineConfig::persist_numel`](zero_core::engine::EngineConfig::persist_numel),
/// the one setting of it.
///
/// Build the model through [`ShardedVarMap::builder`] (a `VarBuilder`, so
/// `zero_candle::nn`'s and candle-nn's constructors work unchanged) or
/// [`ShardedVarMap::get`]. A float variable on the CPU or a CUDA GPU is
/// created *deferred*: with its name, shape and dtype but no values
/// ([`holds_values`](crate::holds_values) is `false`) until
/// `new_sharded` (or [`ShardedVarMap::materialize_all`]) gives them. Every
/// rank computes the same values, at every world size and stage.
///
/// ```
/// use candle_core::{DType, Device};
/// use zero_candle::{holds_values, ShardedVarMap};
///
/// let map = ShardedVarMap::seeded(7);
/// let layer = candle_nn::linear(64, 64, map.builder(DType::F32, &Device::Cpu).pp("fc"))?;
/// assert!(!holds_values(layer.weight())); // until new_sharded fills it
/// // The same values at every world size and stage, or outside an optimizer:
/// map.materialize_all()?;
/// assert!(holds_values(layer.weight()));
/// let again = ShardedVarMap::seeded(7);
/// let twin = candle_nn::linear(64, 64, again.builder(DType::F32, &Device::Cpu).pp("fc"))?;
/// again.materialize_all()?;
/// let diff = (layer.weight() - twin.weight())?.abs()?.sum_all()?.to_scalar::<f32>()?;
/// assert_eq!(diff, 0.0);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
///
/// [`ZeroOptimizer::new_sharded`]: crate::ZeroOptimizer::new_sharded
#[derive(Clone)]
pub struct ShardedVarMap {
    inner: Arc<MapInner>,
}

struct MapInner {
    varmap: VarMap,
    /// The deferred variables' hints and shapes, by name.
    deferred: Mutex<HashMap<String, (Init, Vec<usize>)>>,
    source: Box<dyn ParamSource>,
}

impl ShardedVarMap {
    /// Variables from `source`.
    pub fn new(source: impl ParamSource + 'static) -> Self {
        Self {
            inner: Arc::new(MapInner {
                varmap: VarMap::new(),
                deferred: Mutex::new(HashMap::new()),
                source: Box::new(source),
            }),
        }
    }

    /// Variables initialized by [`SeededInit`] with `seed`.
    pub fn seeded(seed: u64) -> Self {
        Self::new(SeededInit::new(seed))
    }

    /// Variables read from a safetensors file (memory-mapped: a sharded
    /// variable is never read whole).
    pub fn from_safetensors(path: impl AsRef<Path>) -> Result<Self> {
        Ok(Self::new(SafetensorsInit::open(path)?))
    }

    /// The variables, by name (deferred ones hold no values).
    pub fn varmap(&self) -> &VarMap {
        &self.inner.varmap
    }

    /// A `VarBuilder` creating variables of `dtype` on `device` here.
    pub fn builder(&self, dtype: DType, device: &Device) -> VarBuilder<'static> {
        VarBuilder::from_backend(Box::new(self.clone()), dtype, device.clone())
    }

    /// The variable `name`: created (deferred or with its values) on the
    /// first call, the same variable after; an error if asked again with
    /// another shape.
    pub fn get(
        &self,
        shape: impl Into<Shape>,
        name: &str,
        init: Init,
        dtype: DType,
        device: &Device,
    ) -> Result<Tensor> {
        let shape = shape.into();
        let mut vars = lock(self.inner.varmap.data());
        if let Some(var) = vars.get(name) {
            if var.shape() != &shape {
                return Err(Error::Variable {
                    name: name.into(),
                    detail: format!(
                        "created as {:?} and asked for again as {:?}",
                        var.dims(),
                        shape.dims()
                    ),
                });
            }
            return Ok(var.as_tensor().clone());
        }
        self.inner.source.check(name, shape.dims())?;
        let defer = (device.is_cpu() || device.is_cuda()) && dtype.is_float();
        let var = if defer {
            lock(&self.inner.deferred).insert(name.into(), (init, shape.dims().to_vec()));
            deferred_var(shape, dtype, device)?
        } else {
            let values = self.values(name, shape.dims(), init, dtype)?;
            // A variable from the values themselves (no copy).
            let var = Var::from_tensor(&Tensor::from_storage(
                Storage::Cpu(values),
                shape,
                BackpropOp::none(),
                true,
            ))?;
            if device.is_cpu() {
                var
            } else {
                Var::from_tensor(&var.as_tensor().to_device(device)?)?
            }
        };
        let tensor = var.as_tensor().clone();
        vars.insert(name.into(), var);
        Ok(tensor)
    }

    /// Whether `name` is deferred (holds no values yet).
    pub fn is_deferred(&self, name: &str) -> bool {
        lock(&self.inner.deferred).contains_key(name)
    }

    /// Gives the deferred variable `name` its whole values (it is no longer
    /// deferred); nothing for another variable.
    pub fn materialize(&self, name: &str) -> Result<()> {
        let Some((init, shape)) = lock(&self.inner.deferred).remove(name) else {
            return Ok(());
        };
        let var = lock(self.inner.varmap.data()).get(name).cloned();
        let Some(var) = var else {
            return Ok(());
        };
        let values = self.values(name, &shape, init, var.dtype())?;
        var.as_tensor()
            .inplace_op1(&Replace(Mutex::new(Some(values))))?;
        Ok(())
    }

    /// Gives every deferred variable its whole values.
    pub fn materialize_all(&self) -> Result<()> {
        let names: Vec<String> = lock(&self.inner.deferred).keys().cloned().collect();
        for name in names {
            self.materialize(&name)?;
        }
        Ok(())
    }

    /// The hint and shape a deferred variable was created with.
    pub(crate) fn deferred(&self, name: &str) -> Option<(Init, Vec<usize>)> {
        lock(&self.inner.deferred).get(name).cloned()
    }

    /// Marks the deferred variables as sharded: no longer waiting for
    /// values (the engine's shard holds them).
    pub(crate) fn sharded(&self, names: &[&str]) {
        let mut deferred = lock(&self.inner.deferred);
        for name in names {
            deferred.remove(*name);
        }
    }

    pub(crate) fn source(&self) -> &dyn ParamSource {
        self.inner.source.as_ref()
    }

    /// The whole values of `name` in `dtype`, computed in blocks.
    fn values(&self, name: &str, shape: &[usize], init: Init, dtype: DType) -> Result<CpuStorage> {
        let numel = shape.iter().product();
        let source = self.source();
        Ok(match dtype {
            DType::F32 => CpuStorage::F32(filled(source, name, shape, init, numel)?),
            DType::F64 => CpuStorage::F64(filled(source, name, shape, init, numel)?),
            DType::BF16 => CpuStorage::BF16(filled::<bf16>(source, name, shape, init, numel)?),
            DType::F16 => CpuStorage::F16(filled::<f16>(source, name, shape, init, numel)?),
            other => {
                return Err(Error::Variable {
                    name: name.into(),
                    detail: format!(
                        "dtype {other:?}: a ShardedVarMap creates f32, f64, bf16 or f16 variables"
                    ),
                })
            }
        })
    }
}

/// Fills `out` with elements `range` of `name` from `source`, through an
/// f64 block at a time (the blocks on rayon's pool: a source gives each
/// element the same value whichever call asks), each value rounded to the
/// variable's `dtype` first (so that f32 master weights of a bf16 model
/// hold the bf16 values, as when they are read from a whole bf16
/// variable).
pub(crate) fn fill_from<D: Element>(
    source: &dyn ParamSource,
    (name, shape, init): (&str, &[usize], Init),
    range: Range<usize>,
    dtype: DType,
    out: &mut [D],
) -> Result<()> {
    let round: fn(f64) -> f64 = match dtype {
        DType::BF16 => |v| <bf16 as Element>::from_f64(v).to_f64(),
        DType::F16 => |v| <f16 as Element>::from_f64(v).to_f64(),
        DType::F32 => |v| f64::from(v as f32),
        _ => |v| v,
    };
    let len = BLOCK.min(out.len());
    let staging = || vec![0f64; len];
    let fill_block = |block: &mut Vec<f64>, (k, chunk): (usize, &mut [D])| {
        let start = range.start + k * BLOCK;
        let staged = &mut block[..chunk.len()];
        source.fill(name, shape, init, start..start + chunk.len(), staged)?;
        for (d, &v) in chunk.iter_mut().zip(staged.iter()) {
            *d = D::from_f64(round(v));
        }
        Ok(())
    };
    // On the pool's own threads (a caller already in a parallel loop,
    // perhaps holding a lock another of its tasks takes) or for one block:
    // here, in order.
    if rayon::current_thread_index().is_some() || out.len() <= BLOCK {
        let mut block = staging();
        return out
            .chunks_mut(BLOCK)
            .enumerate()
            .try_for_each(|chunk| fill_block(&mut block, chunk));
    }
    out.par_chunks_mut(BLOCK)
        .enumerate()
        .try_for_each_init(staging, fill_block)
}

fn filled<D: Element + WithDType>(
    source: &dyn ParamSource,
    name: &str,
    shape: &[usize],
    init: Init,
    numel: usize,
) -> Result<Vec<D>> {
    let mut values = vec![D::default(); numel];
    let dtype = <D as WithDType>::DTYPE;
    fill_from(source, (name, shape, init), 0..numel, dtype, &mut values)?;
    Ok(values)
}

/// A variable of `shape` and `dtype` on `device` (the CPU or a CUDA GPU)
/// with an empty storage (on CUDA, one element): nothing of its size is
/// allocated.
fn deferred_var(shape: Shape, dtype: DType, device: &Device) -> Result<Var> {
    let storage = empty_storage(dtype).ok_or_else(|| Error::Variable {
        name: "<deferred>".into(),
        detail: format!("dtype {dtype:?}: only float variables can be deferred"),
    })?;
    let storage = match device {
        Device::Cuda(cuda) => Storage::Cuda(cuda.zeros_impl(&Shape::from(1), dtype)?),
        _ => Storage::Cpu(storage),
    };
    let tensor = Tensor::from_storage(storage, shape, BackpropOp::none(), true);
    Ok(Var::from_tensor(&tensor)?)
}

/// Replaces a variable's storage (a deferred variable's empty one) by
/// values computed on the host (uploaded, on CUDA).
struct Replace(Mutex<Option<CpuStorage>>);

impl Replace {
    /// The values, once, checked against the variable's dtype and layout.
    fn values(&self, dtype: DType, layout: &Layout) -> candle_core::Result<CpuStorage> {
        let mut slot = self.0.lock().unwrap_or_else(|p| p.into_inner());
        let Some(values) = slot.take() else {
            candle_core::bail!("zero-replace-storage: applied twice")
        };
        if values.dtype() != dtype || values_len(&values) != Some(layout.shape().elem_count()) {
            candle_core::bail!(
                "zero-replace-storage: {:?} values for a {dtype:?} variable of shape {:?}",
                values.dtype(),
                layout.dims()
            )
        }
        Ok(values)
    }
}

impl InplaceOp1 for Replace {
    fn name(&self) -> &'static str {
        "zero-replace-storage"
    }

    fn cpu_fwd(&self, storage: &mut CpuStorage, layout: &Layout) -> candle_core::Result<()> {
        *storage = self.values(storage.dtype(), layout)?;
        Ok(())
    }

    fn cuda_fwd(&self, storage: &mut CudaStorage, layout: &Layout) -> candle_core::Result<()> {
        let values = self.values(storage.dtype(), layout)?;
        *storage = storage.device().storage_from_cpu_storage(&values)?;
        Ok(())
    }
}

/// The elements a float CPU storage holds (`None` for other dtypes).
pub(crate) fn values_len(storage: &CpuStorage) -> Option<usize> {
    Some(match storage {
        CpuStorage::F32(v) => v.len(),
        CpuStorage::F64(v) => v.len(),
        CpuStorage::BF16(v) => v.len(),
        CpuStorage::F16(v) => v.len(),
        _ => return None,
    })
}

impl SimpleBackend for ShardedVarMap {
    fn get(
        &self,
        s: Shape,
        name: &str,
        h: Init,
        dtype: DType,
        dev: &Device,
    ) -> candle_core::Result<Tensor> {
        Ok(ShardedVarMap::get(self, s, name, h, dtype, dev)?)
    }

    /// A tensor the source holds that the model reads but does not train
    /// (a buffer): whole on every rank, in `dtype` on `dev`, and not a
    /// variable (no optimizer sees it; a hub save copies the file's tensor
    /// back as it was). An error where the source holds no such tensor (a
    /// seed computes only variables).
    fn get_unchecked(&self, name: &str, dtype: DType, dev: &Device) -> candle_core::Result<Tensor> {
        let Some(shape) = self.source().shape_of(name) else {
            candle_core::bail!(
                "{name:?}: the ShardedVarMap's source holds no tensor of that name (a seeded one \
                 holds none); variables are created with a shape (a VarBuilder's get_with_hints)"
            )
        };
        let values = self.values(name, &shape, Init::Const(0.0), dtype)?;
        Tensor::from_storage(Storage::Cpu(values), shape, BackpropOp::none(), false).to_device(dev)
    }

    /// Whether `name` is a variable created here or a tensor the source
    /// holds ([`get_unchecked`](SimpleBackend::get_unchecked) reads it).
    fn contains_tensor(&self, name: &str) -> bool {
        lock(self.inner.varmap.data()).contains_key(name) || self.source().shape_of(name).is_some()
    }
}

/// A lock, poisoned or not (what it guards stays consistent: maps updated
/// in one statement).
fn lock<V>(mutex: &Mutex<V>) -> MutexGuard<'_, V> {
    mutex.lock().unwrap_or_else(|p| p.into_inner())
}

/// An empty CPU storage of a float `dtype` (`None` for other dtypes).
pub(crate) fn empty_storage(dtype: DType) -> Option<CpuStorage> {
    Some(match dtype {
        DType::BF16 => CpuStorage::BF16(Vec::new()),
        DType::F16 => CpuStorage::F16(Vec::new()),
        DType::F32 => CpuStorage::F32(Vec::new()),
        DType::F64 => CpuStorage::F64(Vec::new()),
        _ => return None,
    })
}

/// The engine's view of a model built by a [`ShardedVarMap`]: deferred
/// variables are read from the map's source (only the ranges asked for),
/// the others from the variables.
pub(crate) struct InitStore<'a> {
    pub(crate) vars: VarStore<'a>,
    pub(crate) names: &'a [String],
    pub(crate) map: &'a ShardedVarMap,
}

impl<T: Element + WithDType> ParamStore<T> for InitStore<'_> {
    fn read(&mut self, param: usize, range: Range<usize>, out: &mut [T]) -> zero_core::Result<()> {
        let name = &self.names[param];
        match self.map.deferred(name) {
            Some((init, shape)) => {
                let dtype = self.vars.vars[param].dtype();
                fill_from(self.map.source(), (name, &shape, init), range, dtype, out)
                    .map_err(into_zero)
            }
            None => self.vars.read(param, range, out),
        }
    }

    fn write(&mut self, param: usize, range: Range<usize>, values: &[T]) -> zero_core::Result<()> {
        let name = &self.names[param];
        if self.map.deferred(name).is_some() {
            return Err(zero_core::Error::State(format!(
                "internal: the engine wrote {name:?} before it was sharded or given values"
            )));
        }
        self.vars.write(param, range, values)
    }
}

/// An adapter error as the engine's.
fn into_zero(e: Error) -> zero_core::Error {
    match e {
        Error::Zero(e) => e,
        other => zero_core::Error::State(other.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Filled a block at a time on rayon's pool, from an offset that is
    /// not a block's start: each element is the source's own, rounded to
    /// the variable's dtype, wherever its block fell.
    #[test]
    fn a_range_over_many_blocks_holds_each_element_of_the_source() {
        let source = SeededInit::new(7);
        let shape = [5 * BLOCK + 123];
        let init = Init::Randn {
            mean: 0.0,
            stdev: 1.0,
        };
        let range = 1000..shape[0];
        let mut filled = vec![0f32; range.len()];
        fill_from(
            &source,
            ("w", &shape, init),
            range.clone(),
            DType::BF16,
            &mut filled,
        )
        .expect("filled");
        let mut one = [0f64];
        for (i, &got) in range.clone().zip(&filled).step_by(997) {
            source
                .fill("w", &shape, init, i..i + 1, &mut one)
                .expect("one element");
            let want = <bf16 as Element>::from_f64(one[0]).to_f64() as f32;
            assert_eq!(got, want, "element {i}");
        }
        assert!(filled.iter().any(|&v| v != filled[0]), "not one value");
    }
}
