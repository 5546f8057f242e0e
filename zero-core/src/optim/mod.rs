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
//! Implement [`FunctionalOptimizer`] for your type: keep state per
//! `(key.name, key.offset)`, skip `None` gradients, and export state as named
//! tensors. A sign-SGD, for instance:
//!
//! ```
//! use zero_core::optim::*;
//! use zero_core::Result;
//!
//! /// `p -= lr * sign(g)`; stateless.
//! struct SignSgd { lr: f64 }
//!
//! impl FunctionalOptimizer<f32> for SignSgd {
//!     fn kind(&self) -> &str { "sign_sgd" }
//!     fn step(&mut self, params: &mut [ParamMut<'_, f32>], grads: &[Option<&[f32]>]) -> Result<()> {
//!         for (param, grad) in params.iter_mut().zip(grads) {
//!             let Some(grad) = grad else { continue };
//!             for (p, g) in param.data.iter_mut().zip(*grad) {
//!                 *p -= self.lr as f32 * g.signum();
//!             }
//!         }
//!         Ok(())
//!     }
//!     fn num_groups(&self) -> usize { 1 }
//!     fn add_group(&mut self, _: &Hyperparams) -> Result<usize> {
//!         Err(zero_core::Error::Optimizer("sign_sgd: one group only".into()))
//!     }
//!     fn hyperparams(&self, _: usize) -> Hyperparams {
//!         serde_json::json!({ "lr": self.lr }).as_object().cloned().unwrap_or_default()
//!     }
//!     fn set_hyperparams(&mut self, _: usize, h: &Hyperparams) -> Result<()> {
//!         if let Some(lr) = h.get("lr").and_then(|v| v.as_f64()) { self.lr = lr; }
//!         Ok(())
//!     }
//!     fn learning_rate(&self, _: usize) -> f64 { self.lr }
//!     fn set_learning_rate(&mut self, _: usize, lr: f64) { self.lr = lr; }
//!     fn export_state(&self) -> OptimizerState<f32> { OptimizerState::default() }
//!     fn import_state(&mut self, _: OptimizerState<f32>) -> Result<()> { Ok(()) }
//! }
//!
//! let mut opt = SignSgd { lr: 0.5 };
//! let key = ParamKey::new("w", 0, 0);
//! let mut w = vec![1.0f32, 1.0];
//! opt.step(&mut [ParamMut { key: &key, data: &mut w }], &[Some(&[3.0, -0.1][..])])?;
//! assert_eq!(w, [0.5, 1.5]);
//! # Ok::<(), zero_core::Error>(())
//! ```
//!
//! `tests/optim_custom.rs` has a complete Lion with state export.

mod adagrad;
mod adam;
mod core;
mod float;
mod rmsprop;
mod sgd;

pub use adagrad::{Adagrad, AdagradConfig};
pub use adam::{Adam, AdamConfig, AdamW, AdamWConfig};
pub use float::Float;
pub use rmsprop::{RmsProp, RmsPropConfig};
pub use sgd::{Sgd, SgdConfig};

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
/// Implement it for your own optimizer (see the [module docs](self) and
/// `tests/optim_custom.rs` for Lion).
pub trait FunctionalOptimizer<T: Element>: Send {
    /// A short name, e.g. `"adam"` (recorded in checkpoints).
    fn kind(&self) -> &str;

    /// Updates every `params[i]` whose `grads[i]` is `Some`; the two slices
    /// have the same length and each gradient is as long as its piece.
    fn step(&mut self, params: &mut [ParamMut<'_, T>], grads: &[Option<&[T]>]) -> Result<()>;

    /// Number of parameter groups.
    fn num_groups(&self) -> usize;

    /// Adds a group; keys missing from `hyper` take the constructor's values
    /// (`torch.optim`'s `defaults`, not group 0's current ones).
    /// Returns the new group's index.
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
