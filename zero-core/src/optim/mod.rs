//! Functional optimizers: the [`FunctionalOptimizer`] trait and the built-ins,
//! which follow `torch.optim`'s documented algorithms and state names.
//!
//! An optimizer knows nothing of sharding. It is called with the pieces of
//! parameters a rank owns, each named by a [`ParamKey`] (parameter name,
//! offset of the piece within the parameter, group), and one gradient slot
//! per piece; `None` means "do not touch": no update, no state change, and
//! the piece's step count does not advance. State is kept per key, so a
//! parameter split into two pieces on one rank steps exactly like the whole.
//!
//! The built-ins ([`Sgd`], [`Adam`], [`AdamW`], [`Adagrad`], [`RmsProp`])
//! run on host memory in f32 or f64 ([`Float`]) and reproduce
//! `torch.optim`'s single-tensor (`foreach=False`) algorithms operation for
//! operation: f64 agrees with torch float64 to about 1e-12, f32 with torch
//! float32 to about 1e-6 (`tests/optim_golden.rs`). Each step is one fused
//! pass per piece, split across the rayon pool for pieces over 256K
//! elements. Hyperparameters and state use PyTorch's names.
//!
//! ```
//! use zero_core::optim::{Adam, AdamConfig, FunctionalOptimizer, ParamKey, ParamMut};
//!
//! let mut adam = Adam::<f32>::new(AdamConfig::default().with_lr(1e-2))?;
//! let key = ParamKey::new("layer.weight", 0, 0);
//! let mut weight = vec![1.0f32, -1.0];
//! adam.step(&mut [ParamMut { key: &key, data: &mut weight }], &[Some(&[0.5, -0.5][..])])?;
//! // The first Adam step moves each element by about lr, against its gradient.
//! assert!((weight[0] - 0.99).abs() < 1e-6 && (weight[1] + 0.99).abs() < 1e-6);
//! adam.set_learning_rate(0, 5e-3); // e.g. from a scheduler
//! let state = adam.export_state();
//! assert_eq!(state.params[&("layer.weight".to_string(), 0)].scalars["step"], 1.0);
//! # Ok::<(), zero_core::Error>(())
//! ```
//!
//! # Writing your own
//!
//! A custom optimizer is its hyperparameters, its per-element state and its
//! update: implement [`SimpleOptimizer`] and [`Simple`] makes it a
//! [`FunctionalOptimizer`] with parameter groups, hyperparameters by name,
//! checked state export and import, and the parallel step of the
//! built-ins. See [`SimpleOptimizer`] for Lion written this way.
//!
//! A user crate derives with `serde` (`features = ["derive"]`), or through
//! the re-export: `#[serde(crate = "zero_core::serde")]`. The engine expects
//! nothing of the state's names. Custom optimizers step where the engine
//! steps on the host (threads, MPI); the GPU engine runs the built-ins as
//! fused kernels and refuses other kinds, naming them. For full control,
//! implement [`FunctionalOptimizer`] itself.
//!
//! # Learning-rate schedules
//!
//! [`LrSchedule`] gives the learning rate of each optimizer step: linear
//! warmup, then constant, linear or cosine decay to a floor ([`LrDecay`]),
//! as `transformers`' schedules compute it.

mod adagrad;
mod adam;
mod core;
mod float;
mod rmsprop;
mod schedule;
mod sgd;
mod simple;

pub use adagrad::{Adagrad, AdagradConfig};
pub use adam::{Adam, AdamConfig, AdamW, AdamWConfig};
pub use float::Float;
pub use rmsprop::{RmsProp, RmsPropConfig};
pub use schedule::{LrDecay, LrSchedule};
pub use sgd::{Sgd, SgdConfig};
pub use simple::{Simple, SimpleOptimizer};

use crate::{Element, Result};
use serde_json::{Map, Value};
use std::collections::BTreeMap;

/// Hyperparameters of a parameter group, under PyTorch's names (`lr`,
/// `momentum`, `betas`, `eps`, `weight_decay`, `amsgrad`, `maximize`, ...).
pub type Hyperparams = Map<String, Value>;

/// Identifies a piece of a parameter an optimizer steps.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ParamKey {
    /// The parameter's name.
    pub name: String,
    /// Offset of the piece within the (flattened) parameter.
    pub offset: usize,
    /// The parameter group whose hyperparameters apply.
    pub group: usize,
}

impl ParamKey {
    /// A key for the piece of `name` starting at `offset`, in group `group`.
    pub fn new(name: impl Into<String>, offset: usize, group: usize) -> Self {
        Self {
            name: name.into(),
            offset,
            group,
        }
    }
}

/// A piece of a parameter to update in place.
#[derive(Debug)]
pub struct ParamMut<'a, T> {
    /// Which piece this is.
    pub key: &'a ParamKey,
    /// Its values.
    pub data: &'a mut [T],
}

/// The state of one parameter piece: named scalars (`step`) and named
/// element-wise tensors (`exp_avg`, `momentum_buffer`, ...), each as long as
/// the piece.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ParamState<T> {
    /// Scalar state, e.g. `step`.
    pub scalars: BTreeMap<String, f64>,
    /// Element-wise state, e.g. `exp_avg`.
    pub tensors: BTreeMap<String, Vec<T>>,
}

/// An optimizer's state: per parameter piece, keyed by (name, offset).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct OptimizerState<T> {
    /// State per `(parameter name, offset of the piece)`.
    pub params: BTreeMap<(String, usize), ParamState<T>>,
}

/// An optimizer that updates parameter pieces from gradients, with
/// parameter groups and exportable state.
///
/// For your own optimizer, [`SimpleOptimizer`] is the short way in (see
/// the [module docs](self#writing-your-own)); implementing this trait
/// directly gives full control.
///
/// The engine calls it with the pieces this rank owns: a `None` gradient
/// leaves its piece and its state untouched.
///
/// ```
/// use zero_core::optim::{FunctionalOptimizer, ParamKey, ParamMut, Sgd, SgdConfig};
///
/// let mut sgd: Box<dyn FunctionalOptimizer<f32>> =
///     Box::new(Sgd::new(SgdConfig::default().with_lr(0.5).with_momentum(0.9))?);
/// let (a, b) = (ParamKey::new("a", 0, 0), ParamKey::new("b", 0, 0));
/// let (mut pa, mut pb) = (vec![1.0f32], vec![1.0f32]);
/// let mut params = [
///     ParamMut { key: &a, data: &mut pa },
///     ParamMut { key: &b, data: &mut pb },
/// ];
/// sgd.step(&mut params, &[Some(&[2.0][..]), None])?;
/// assert_eq!((pa[0], pb[0]), (0.0, 1.0));
/// // Only `a` has state (its momentum buffer).
/// assert_eq!(sgd.export_state().params.len(), 1);
/// # Ok::<(), zero_core::Error>(())
/// ```
pub trait FunctionalOptimizer<T: Element>: Send {
    /// A short name, e.g. `"adam"` (recorded in checkpoints).
    fn kind(&self) -> &str;

    /// Updates every `params[i]` whose `grads[i]` is `Some`; the two slices
    /// have the same length and each gradient is as long as its piece.
    fn step(&mut self, params: &mut [ParamMut<'_, T>], grads: &[Option<&[T]>]) -> Result<()>;

    /// Number of parameter groups.
    fn num_groups(&self) -> usize;

    /// Adds a group; keys missing from `hyper` take the constructor's values
    /// (`torch.optim`'s `defaults`, not group 0's current ones, which a
    /// scheduler may have changed since). Returns the new group's index.
    fn add_group(&mut self, hyper: &Hyperparams) -> Result<usize>;

    /// The hyperparameters of `group`, under PyTorch's names.
    fn hyperparams(&self, group: usize) -> Hyperparams;

    /// Replaces the hyperparameters of `group` (keys not given are kept).
    fn set_hyperparams(&mut self, group: usize, hyper: &Hyperparams) -> Result<()>;

    /// The learning rate of `group`.
    fn learning_rate(&self, group: usize) -> f64;

    /// Sets the learning rate of `group`.
    fn set_learning_rate(&mut self, group: usize, lr: f64);

    /// A copy of the state of every piece stepped so far.
    fn export_state(&self) -> OptimizerState<T>;

    /// [`export_state`](FunctionalOptimizer::export_state) into `out`,
    /// reusing its buffers where they fit (a background checkpoint exports
    /// at every save into the last one's). The default exports afresh.
    fn export_state_into(&self, out: &mut OptimizerState<T>) {
        *out = self.export_state();
    }

    /// Replaces the state of the pieces in `state` (others are kept).
    fn import_state(&mut self, state: OptimizerState<T>) -> Result<()>;

    /// Bytes of state held for all pieces (the engine's memory report).
    /// The default exports the state to count it; built-ins count directly.
    fn state_bytes(&self) -> usize {
        self.export_state()
            .params
            .values()
            .map(|p| {
                p.tensors.values().map(Vec::len).sum::<usize>() * std::mem::size_of::<T>()
                    + p.scalars.len() * std::mem::size_of::<f64>()
            })
            .sum()
    }
}
