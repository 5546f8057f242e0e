//! Machinery the built-in optimizers share: parameter groups and their
//! hyperparameters, per-piece state, the step driver that validates before it
//! touches anything, and the chunked parallel loop the kernels run in.

use super::{Hyperparams, OptimizerState, ParamMut, ParamState};
use crate::{Error, Result};
use rayon::prelude::*;
use serde_json::Value;
use std::collections::BTreeMap;

/// Elements per parallel chunk: large enough to amortise scheduling, small
/// enough to balance across cores. Longer pieces are split across threads.
pub(crate) const CHUNK_LEN: usize = 64 * 1024;

/// Keys `torch.optim` puts in a param group that have no meaning here; they
/// are accepted and ignored so that PyTorch param groups load unchanged.
const IGNORED_KEYS: &[&str] = &[
    "params",
    "foreach",
    "capturable",
    "differentiable",
    "fused",
    "initial_lr",
    "decoupled_weight_decay",
    "param_names",
];

/// The hyperparameters of one group of one optimizer, as
/// [`group_config!`] writes them from the field list.
pub(crate) trait GroupFields: Clone + Send {
    /// Every key [`GroupFields::apply`] understands: the field names.
    fn keys(&self) -> Vec<String>;
    /// The optimizer's name, for messages.
    const KIND: &'static str;
    /// The learning rate.
    fn lr(&self) -> f64;
    /// Sets the learning rate.
    fn set_lr(&mut self, lr: f64);
    /// The hyperparameters under PyTorch's names.
    fn to_hyperparams(&self) -> Hyperparams;
    /// Overwrites the fields named in `hyper` (already checked against
    /// [`GroupFields::keys`]).
    fn apply(&mut self, hyper: &Hyperparams) -> Result<()>;
}

/// The part of a group's configuration each optimizer writes by hand: which
/// values `torch.optim`'s constructor accepts.
pub(crate) trait GroupConfig: GroupFields {
    /// Checks the values as `torch.optim`'s constructor does.
    fn validate(&self) -> Result<()>;
}

/// The type of a hyperparameter field: how it reads from and writes to
/// PyTorch's JSON param group.
pub(crate) trait HyperValue: Sized {
    /// The value under PyTorch's encoding.
    fn to_json(&self) -> Value;
    /// Reads `key` from `hyper`, if present; `kind` is for messages.
    fn read(kind: &str, hyper: &Hyperparams, key: &str) -> Result<Option<Self>>;
}

impl HyperValue for f64 {
    fn to_json(&self) -> Value {
        num(*self)
    }
    fn read(kind: &str, hyper: &Hyperparams, key: &str) -> Result<Option<Self>> {
        get_f64(kind, hyper, key)
    }
}

impl HyperValue for bool {
    fn to_json(&self) -> Value {
        Value::Bool(*self)
    }
    fn read(kind: &str, hyper: &Hyperparams, key: &str) -> Result<Option<Self>> {
        get_bool(kind, hyper, key)
    }
}

/// `betas`: a JSON array of two numbers.
impl HyperValue for (f64, f64) {
    fn to_json(&self) -> Value {
        Value::Array(vec![num(self.0), num(self.1)])
    }
    fn read(kind: &str, hyper: &Hyperparams, key: &str) -> Result<Option<Self>> {
        get_pair(kind, hyper, key)
    }
}

/// Writes a config struct from its field list: the struct (fields in the
/// order given, which is also the order of its keys and its hyperparameter
/// map), `Default` from the `= default`s, a `with_*` builder for each field
/// that names one, and [`GroupFields`], keyed by the field names (which are
/// PyTorch's). Validation stays by hand, in [`GroupConfig`].
macro_rules! group_config {
    (
        $(#[$doc:meta])*
        pub struct $name:ident($kind:literal) {
            $(
                $(#[$field_doc:meta])*
                pub $field:ident: $ty:ty = $default:expr
                $(, $(#[$with_doc:meta])* fn $with:ident)?;
            )*
        }
    ) => {
        $(#[$doc])*
        #[derive(Clone, Copy, Debug, PartialEq)]
        pub struct $name {
            $(
                $(#[$field_doc])*
                pub $field: $ty,
            )*
        }

        impl Default for $name {
            fn default() -> Self {
                Self {
                    $($field: $default,)*
                }
            }
        }

        impl $name {
            $($(
                $(#[$with_doc])*
                pub fn $with(mut self, $field: $ty) -> Self {
                    self.$field = $field;
                    self
                }
            )?)*
        }

        impl $crate::optim::core::GroupFields for $name {
            fn keys(&self) -> Vec<String> {
                vec![$(stringify!($field).to_string()),*]
            }
            const KIND: &'static str = $kind;

            fn lr(&self) -> f64 {
                self.lr
            }
            fn set_lr(&mut self, lr: f64) {
                self.lr = lr;
            }
            fn to_hyperparams(&self) -> $crate::optim::Hyperparams {
                use $crate::optim::core::HyperValue;
                let mut h = $crate::optim::Hyperparams::new();
                $(h.insert(stringify!($field).into(), self.$field.to_json());)*
                h
            }
            fn apply(&mut self, h: &$crate::optim::Hyperparams) -> $crate::Result<()> {
                use $crate::optim::core::HyperValue;
                $(
                    self.$field = <$ty>::read($kind, h, stringify!($field))?
                        .unwrap_or(self.$field);
                )*
                Ok(())
            }
        }
    };
}
pub(crate) use group_config;

/// Reads a float hyperparameter, if present.
fn get_f64(kind: &str, hyper: &Hyperparams, key: &str) -> Result<Option<f64>> {
    match hyper.get(key) {
        None => Ok(None),
        Some(v) => v.as_f64().map(Some).ok_or_else(|| {
            Error::Optimizer(format!(
                "{kind}: hyperparameter {key:?} must be a number, got {v}"
            ))
        }),
    }
}

/// Reads a boolean hyperparameter, if present.
fn get_bool(kind: &str, hyper: &Hyperparams, key: &str) -> Result<Option<bool>> {
    match hyper.get(key) {
        None => Ok(None),
        Some(v) => v.as_bool().map(Some).ok_or_else(|| {
            Error::Optimizer(format!(
                "{kind}: hyperparameter {key:?} must be true or false, got {v}"
            ))
        }),
    }
}

/// Reads a pair of floats (`betas`), if present.
fn get_pair(kind: &str, hyper: &Hyperparams, key: &str) -> Result<Option<(f64, f64)>> {
    match hyper.get(key) {
        None => Ok(None),
        Some(v) => match v.as_array().map(Vec::as_slice) {
            Some([a, b]) => match (a.as_f64(), b.as_f64()) {
                (Some(a), Some(b)) => Ok(Some((a, b))),
                _ => Err(Error::Optimizer(format!(
                    "{kind}: hyperparameter {key:?} must be two numbers, got {v}"
                ))),
            },
            _ => Err(Error::Optimizer(format!(
                "{kind}: hyperparameter {key:?} must be an array of two numbers, got {v}"
            ))),
        },
    }
}

/// A JSON number (non-finite values, which JSON cannot hold, become null).
fn num(v: f64) -> Value {
    serde_json::Number::from_f64(v).map_or(Value::Null, Value::Number)
}

/// Fails unless `value >= 0` (NaN fails too), with torch's wording.
pub(crate) fn check_non_negative(kind: &str, what: &str, value: f64) -> Result<()> {
    if value >= 0.0 {
        Ok(())
    } else {
        Err(Error::Optimizer(format!(
            "{kind}: invalid {what} value: {value} (must be >= 0)"
        )))
    }
}

/// Fails unless `0 <= value < 1`.
pub(crate) fn check_unit_interval(kind: &str, what: &str, value: f64) -> Result<()> {
    if (0.0..1.0).contains(&value) {
        Ok(())
    } else {
        Err(Error::Optimizer(format!(
            "{kind}: invalid {what}: {value} (must be in [0, 1))"
        )))
    }
}

/// The state of one parameter piece of one optimizer, in typed form.
pub(crate) trait PieceState<T>: Sized + Send {
    /// The number of elements each tensor holds, `None` while it holds none.
    fn len(&self) -> Option<usize>;
    /// Bytes held: tensors at `size_of::<T>()` per element, scalars as f64
    /// (the same count as the trait's default `state_bytes`).
    fn bytes(&self) -> usize;
    /// The state under PyTorch's names.
    fn export(&self) -> ParamState<T>;
    /// [`export`](PieceState::export) into `out`, reusing its buffers
    /// where it can (background checkpoints export at every save).
    fn export_into(&self, out: &mut ParamState<T>) {
        *out = self.export();
    }
    /// Builds the state from PyTorch's names; `name` is for messages.
    fn import(kind: &str, name: &str, state: ParamState<T>) -> Result<Self>;
}

/// Takes the tensor `key` out of `state`, checking its length against `len`
/// (the length of the first tensor taken) when one is known.
pub(crate) fn take_tensor<T>(
    kind: &str,
    name: &str,
    state: &mut ParamState<T>,
    key: &str,
    len: &mut Option<usize>,
) -> Result<Option<Vec<T>>> {
    let Some(tensor) = state.tensors.remove(key) else {
        return Ok(None);
    };
    match *len {
        Some(n) if n != tensor.len() => Err(Error::Optimizer(format!(
            "{kind}: state of parameter {name:?}: {key:?} has {} elements but other tensors have {n}",
            tensor.len()
        ))),
        _ => {
            *len = Some(tensor.len());
            Ok(Some(tensor))
        }
    }
}

/// Fails if `state` still holds anything after the known entries were taken.
pub(crate) fn reject_leftovers<T>(kind: &str, name: &str, state: &ParamState<T>) -> Result<()> {
    let extra: Vec<&str> = state
        .tensors
        .keys()
        .chain(state.scalars.keys())
        .map(String::as_str)
        .collect();
    if extra.is_empty() {
        Ok(())
    } else {
        Err(Error::Optimizer(format!(
            "{kind}: state of parameter {name:?} has entries {extra:?} that a {kind} optimizer does not use; \
             was it exported by another optimizer?"
        )))
    }
}

/// Reads the `step` scalar (required).
pub(crate) fn take_step<T>(kind: &str, name: &str, state: &mut ParamState<T>) -> Result<f64> {
    match state.scalars.remove("step") {
        Some(step) if step >= 0.0 && step.fract() == 0.0 => Ok(step),
        Some(step) => Err(Error::Optimizer(format!(
            "{kind}: state of parameter {name:?}: step {step} is not a non-negative integer"
        ))),
        None => Err(Error::Optimizer(format!(
            "{kind}: state of parameter {name:?} has no \"step\""
        ))),
    }
}

/// A missing required tensor.
pub(crate) fn missing(kind: &str, name: &str, key: &str) -> Error {
    Error::Optimizer(format!(
        "{kind}: state of parameter {name:?} has no {key:?}"
    ))
}

/// Groups and per-piece state of one optimizer.
pub(crate) struct Core<C, S> {
    pub(crate) groups: Vec<C>,
    /// The constructor's hyperparameters: what a group added later takes
    /// for the keys it does not give (`torch.optim`'s `defaults`), whatever
    /// a schedule has done to group 0 since.
    defaults: C,
    pub(crate) state: BTreeMap<(String, usize), S>,
}

impl<C: GroupConfig, S> Core<C, S> {
    /// An optimizer with one group.
    pub(crate) fn new(config: C) -> Result<Self> {
        config.validate()?;
        Ok(Self {
            defaults: config.clone(),
            groups: vec![config],
            state: BTreeMap::new(),
        })
    }

    /// Appends a group.
    pub(crate) fn push_group(&mut self, config: C) -> Result<usize> {
        config.validate()?;
        self.groups.push(config);
        Ok(self.groups.len() - 1)
    }

    fn group_index(&self, group: usize) -> Result<usize> {
        if group < self.groups.len() {
            Ok(group)
        } else {
            Err(Error::Optimizer(format!(
                "{}: parameter group {group} does not exist (there are {})",
                C::KIND,
                self.groups.len()
            )))
        }
    }

    /// `config` updated by `hyper`, validated.
    fn updated(config: &C, hyper: &Hyperparams) -> Result<C> {
        let keys = config.keys();
        if let Some(key) = hyper
            .keys()
            .find(|k| !keys.contains(k) && !IGNORED_KEYS.contains(&k.as_str()))
        {
            return Err(Error::Optimizer(format!(
                "{}: unknown hyperparameter {key:?}; expected one of {keys:?}",
                C::KIND,
            )));
        }
        let mut config = config.clone();
        config.apply(hyper)?;
        config.validate()?;
        Ok(config)
    }

    pub(crate) fn add_group(&mut self, hyper: &Hyperparams) -> Result<usize> {
        let config = Self::updated(&self.defaults, hyper)?;
        self.groups.push(config);
        Ok(self.groups.len() - 1)
    }

    pub(crate) fn hyperparams(&self, group: usize) -> Hyperparams {
        self.groups
            .get(group)
            .map(GroupFields::to_hyperparams)
            .unwrap_or_default()
    }

    pub(crate) fn set_hyperparams(&mut self, group: usize, hyper: &Hyperparams) -> Result<()> {
        let group = self.group_index(group)?;
        self.groups[group] = Self::updated(&self.groups[group], hyper)?;
        Ok(())
    }

    pub(crate) fn learning_rate(&self, group: usize) -> f64 {
        self.groups.get(group).map_or(f64::NAN, GroupFields::lr)
    }

    pub(crate) fn set_learning_rate(&mut self, group: usize, lr: f64) {
        if let Some(config) = self.groups.get_mut(group) {
            config.set_lr(lr);
        }
    }

    /// Validates every piece, then calls `update(config, state, param, grad)`
    /// for each piece with a gradient, creating its state with `init(len)`
    /// on its first step; the pieces step in parallel. Nothing is modified
    /// if validation fails.
    pub(crate) fn step<T>(
        &mut self,
        params: &mut [ParamMut<'_, T>],
        grads: &[Option<&[T]>],
        init: impl Fn(&C, usize) -> S,
        update: impl Fn(&C, &mut S, &mut [T], &[T]) + Sync,
    ) -> Result<()>
    where
        S: PieceState<T>,
        C: Sync,
        T: Send + Sync,
    {
        if params.len() != grads.len() {
            return Err(Error::Optimizer(format!(
                "{}: step got {} parameter pieces but {} gradient slots",
                C::KIND,
                params.len(),
                grads.len()
            )));
        }
        for (param, grad) in params.iter().zip(grads) {
            let Some(grad) = grad else { continue };
            let key = param.key;
            self.group_index(key.group)?;
            if grad.len() != param.data.len() {
                return Err(Error::Optimizer(format!(
                    "{}: parameter {:?} at offset {}: gradient has {} elements, the piece has {}",
                    C::KIND,
                    key.name,
                    key.offset,
                    grad.len(),
                    param.data.len()
                )));
            }
            if let Some(state) = self.state.get(&(key.name.clone(), key.offset)) {
                if let Some(len) = state.len().filter(|&len| len != param.data.len()) {
                    return Err(Error::Optimizer(format!(
                        "{}: state of parameter {:?} at offset {} has {} elements, the piece has {}; \
                         was the state imported from a different partitioning?",
                        C::KIND,
                        key.name,
                        key.offset,
                        len,
                        param.data.len()
                    )));
                }
            }
        }
        // Each piece's state leaves the map while it steps, so that the
        // pieces step in parallel (each split across threads too when
        // long): a call with many short pieces (a bucket of the offload's
        // step thread, cut where the parameters fall) runs on every core,
        // not one piece after another.
        let mut work = Vec::with_capacity(params.len());
        for (param, grad) in params.iter_mut().zip(grads) {
            let Some(grad) = grad else { continue };
            let key = (param.key.name.clone(), param.key.offset);
            let config = &self.groups[param.key.group];
            let state = match self.state.remove(&key) {
                Some(state) => state,
                None => init(config, grad.len()),
            };
            work.push((key, config, state, &mut *param.data, *grad));
        }
        work.par_iter_mut()
            .for_each(|(_, config, state, data, grad)| update(config, state, data, grad));
        self.state
            .extend(work.into_iter().map(|(key, _, state, ..)| (key, state)));
        Ok(())
    }

    pub(crate) fn state_bytes<T>(&self) -> usize
    where
        S: PieceState<T>,
    {
        self.state.values().map(PieceState::bytes).sum()
    }

    pub(crate) fn export_state<T>(&self) -> OptimizerState<T>
    where
        S: PieceState<T>,
    {
        OptimizerState {
            params: self
                .state
                .iter()
                .map(|(key, state)| (key.clone(), state.export()))
                .collect(),
        }
    }

    /// [`Core::export_state`] into `out`, reusing the buffers of the pieces
    /// it already holds.
    pub(crate) fn export_state_into<T>(&self, out: &mut OptimizerState<T>)
    where
        S: PieceState<T>,
    {
        out.params.retain(|key, _| self.state.contains_key(key));
        for (key, state) in &self.state {
            match out.params.get_mut(key) {
                Some(piece) => state.export_into(piece),
                None => {
                    out.params.insert(key.clone(), state.export());
                }
            }
        }
    }

    /// Imports every piece or, on error, none.
    pub(crate) fn import_state<T>(&mut self, state: OptimizerState<T>) -> Result<()>
    where
        S: PieceState<T>,
    {
        let mut imported = Vec::with_capacity(state.params.len());
        for (key, piece) in state.params {
            let piece = S::import(C::KIND, &key.0, piece)?;
            imported.push((key, piece));
        }
        self.state.extend(imported);
        Ok(())
    }
}

/// Runs `kernel` over `grad` and the equally long `bufs`, in chunks of
/// [`CHUNK_LEN`] on the rayon pool when the piece is longer than one, in
/// one call otherwise.
pub(crate) fn for_each_chunk<T, const N: usize, F>(grad: &[T], bufs: [&mut [T]; N], kernel: F)
where
    T: Send + Sync,
    F: Fn(&[T], [&mut [T]; N]) + Sync,
{
    debug_assert!(bufs.iter().all(|b| b.len() == grad.len()));
    if grad.len() <= CHUNK_LEN {
        kernel(grad, bufs);
        return;
    }
    let mut chunks = Vec::with_capacity(grad.len().div_ceil(CHUNK_LEN));
    let (mut grad, mut bufs) = (grad, bufs);
    while grad.len() > CHUNK_LEN {
        let (grad_head, grad_tail) = grad.split_at(CHUNK_LEN);
        let mut pairs = bufs.map(|b| b.split_at_mut(CHUNK_LEN));
        let heads = pairs.each_mut().map(|pair| std::mem::take(&mut pair.0));
        chunks.push((grad_head, heads));
        grad = grad_tail;
        bufs = pairs.map(|pair| pair.1);
    }
    chunks.push((grad, bufs));
    chunks
        .into_par_iter()
        .for_each(|(grad, bufs)| kernel(grad, bufs));
}

/// Calls `$kernel::<_, b1, b2, ...>(args)` with each boolean condition turned
/// into a const generic argument, so that kernels carry no per-element
/// branches on hyperparameters.
macro_rules! with_flags {
    ($kernel:ident [$($done:tt)*] ($($arg:expr),*)) => {
        $kernel::<_, $($done),*>($($arg),*)
    };
    ($kernel:ident [$($done:tt)*] ($($arg:expr),*) $head:expr $(, $rest:expr)*) => {
        if $head {
            with_flags!($kernel [$($done)* true] ($($arg),*) $($rest),*)
        } else {
            with_flags!($kernel [$($done)* false] ($($arg),*) $($rest),*)
        }
    };
}
pub(crate) use with_flags;

/// `torch.lerp(start, end, weight)` for a scalar weight, as ATen computes it:
/// the formula depends on whether `|weight| < 0.5`, decided once per step.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Lerp<T> {
    /// `weight`.
    pub(crate) weight: T,
    /// `1 - weight`, computed in `T`.
    pub(crate) one_minus_weight: T,
    /// Whether `|weight| < 0.5`.
    pub(crate) small: bool,
}

impl<T: super::Float> Lerp<T> {
    pub(crate) fn new(weight: f64) -> Self {
        let weight = T::from_f64(weight);
        Self {
            weight,
            one_minus_weight: T::ONE - weight,
            small: weight.to_f64().abs() < 0.5,
        }
    }

    /// The interpolation with the formula chosen by `SMALL` (== `self.small`).
    #[inline(always)]
    pub(crate) fn apply<const SMALL: bool>(&self, start: T, end: T) -> T {
        if SMALL {
            start + self.weight * (end - start)
        } else {
            end - (end - start) * self.one_minus_weight
        }
    }
}

/// Writes a built-in optimizer around its [`Core`]: the struct, `new`,
/// `add_param_group` and `config`, and
/// [`FunctionalOptimizer`](super::FunctionalOptimizer) with `step` going
/// through [`Core::step`] with `init` and `update`, and every other method
/// forwarded to the core.
macro_rules! optimizer {
    (
        $(#[$doc:meta])*
        pub struct $name:ident<T>($config:ty, $piece:ident);
        init: $init:expr,
        update: $update:expr $(,)?
    ) => {
        $(#[$doc])*
        pub struct $name<T = f32> {
            core: $crate::optim::core::Core<$config, $piece<T>>,
        }

        impl<T: $crate::optim::Float> $name<T> {
            /// An optimizer whose group 0 has `config`.
            pub fn new(config: $config) -> $crate::Result<Self> {
                Ok(Self {
                    core: $crate::optim::core::Core::new(config)?,
                })
            }

            /// Adds a parameter group with `config`; returns its index.
            pub fn add_param_group(&mut self, config: $config) -> $crate::Result<usize> {
                self.core.push_group(config)
            }

            /// The configuration of `group`, if it exists.
            pub fn config(&self, group: usize) -> Option<&$config> {
                self.core.groups.get(group)
            }
        }

        impl<T: $crate::optim::Float> $crate::optim::FunctionalOptimizer<T> for $name<T> {
            fn kind(&self) -> &str {
                <$config as $crate::optim::core::GroupFields>::KIND
            }
            fn step(
                &mut self,
                params: &mut [$crate::optim::ParamMut<'_, T>],
                grads: &[Option<&[T]>],
            ) -> $crate::Result<()> {
                self.core.step(params, grads, $init, $update)
            }
            fn num_groups(&self) -> usize {
                self.core.groups.len()
            }
            fn add_group(&mut self, hyper: &$crate::optim::Hyperparams) -> $crate::Result<usize> {
                self.core.add_group(hyper)
            }
            fn hyperparams(&self, group: usize) -> $crate::optim::Hyperparams {
                self.core.hyperparams(group)
            }
            fn set_hyperparams(
                &mut self,
                group: usize,
                hyper: &$crate::optim::Hyperparams,
            ) -> $crate::Result<()> {
                self.core.set_hyperparams(group, hyper)
            }
            fn learning_rate(&self, group: usize) -> f64 {
                self.core.learning_rate(group)
            }
            fn set_learning_rate(&mut self, group: usize, lr: f64) {
                self.core.set_learning_rate(group, lr)
            }
            fn export_state(&self) -> $crate::optim::OptimizerState<T> {
                self.core.export_state()
            }
            fn export_state_into(&self, out: &mut $crate::optim::OptimizerState<T>) {
                self.core.export_state_into(out)
            }
            fn state_bytes(&self) -> usize {
                self.core.state_bytes()
            }
            fn import_state(
                &mut self,
                state: $crate::optim::OptimizerState<T>,
            ) -> $crate::Result<()> {
                self.core.import_state(state)
            }
        }
    };
}
pub(crate) use optimizer;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::optim::{AdamConfig, ParamKey};
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::{Duration, Instant};

    /// A piece state that holds nothing.
    struct Stateless;

    impl PieceState<f32> for Stateless {
        fn len(&self) -> Option<usize> {
            None
        }
        fn bytes(&self) -> usize {
            0
        }
        fn export(&self) -> ParamState<f32> {
            ParamState::default()
        }
        fn import(_: &str, _: &str, _: ParamState<f32>) -> Result<Self> {
            Ok(Stateless)
        }
    }

    /// Two short pieces of one call step at the same time on a pool of two
    /// threads: each piece's update waits (5 s at most) for the other's to
    /// start, and records how many had started.
    #[test]
    fn the_pieces_of_one_call_step_in_parallel() {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(2)
            .build()
            .expect("a pool of two threads");
        let mut core = Core::<AdamConfig, Stateless>::new(AdamConfig::default()).expect("valid");
        let keys = [ParamKey::new("a", 0, 0), ParamKey::new("b", 0, 0)];
        let (mut a, mut b, grad) = (vec![0f32; 8], vec![0f32; 8], vec![1f32; 8]);
        let started = AtomicUsize::new(0);
        let update = |_: &AdamConfig, _: &mut Stateless, data: &mut [f32], _: &[f32]| {
            started.fetch_add(1, Ordering::SeqCst);
            let deadline = Instant::now() + Duration::from_secs(5);
            while started.load(Ordering::SeqCst) < 2 && Instant::now() < deadline {
                std::thread::yield_now();
            }
            data.fill(started.load(Ordering::SeqCst) as f32);
        };
        pool.install(|| {
            let mut params = [
                ParamMut {
                    key: &keys[0],
                    data: &mut a,
                },
                ParamMut {
                    key: &keys[1],
                    data: &mut b,
                },
            ];
            core.step(
                &mut params,
                &[Some(&grad), Some(&grad)],
                |_, _| Stateless,
                update,
            )
        })
        .expect("stepped");
        assert_eq!(
            (a[0], b[0]),
            (2.0, 2.0),
            "the pieces stepped one after the other"
        );
        assert_eq!(core.state.len(), 2, "each piece's state is back in the map");
    }
}
