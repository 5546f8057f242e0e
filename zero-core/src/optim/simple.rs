//! A custom optimizer in a few lines: [`SimpleOptimizer`] is its
//! hyperparameters (a serde struct under PyTorch's names), the names of its
//! per-element state, and its update of one piece; [`Simple`] makes it a
//! [`FunctionalOptimizer`] with what the built-ins have: parameter groups
//! (added later ones take the constructor's values for the keys they do not
//! give), hyperparameters read and set by name with unknown keys refused,
//! state exported and imported under its names (checked), every piece
//! validated before any is touched, pieces stepped in parallel, `None`
//! gradients left alone.

use super::core::{
    check_non_negative, missing, reject_leftovers, take_step, take_tensor, Core, GroupConfig,
    GroupFields, PieceState,
};
use super::{FunctionalOptimizer, Hyperparams, OptimizerState, ParamMut, ParamState};
use crate::{Element, Error, Result};
use serde::de::DeserializeOwned;
use serde::Serialize;
use serde_json::Value;
use std::marker::PhantomData;

/// An optimizer as its parts. The engine expects nothing of the state's
/// names; checkpoints store them as given (`state.<param>.<name>`).
///
/// Lion (Chen et al. 2023, as `lion-pytorch` steps it):
///
/// ```
/// use serde::{Deserialize, Serialize};
/// use zero_core::optim::{FunctionalOptimizer, ParamKey, ParamMut, Simple, SimpleOptimizer};
///
/// #[derive(Clone, Serialize, Deserialize)]
/// struct LionConfig { lr: f64, betas: (f64, f64), weight_decay: f64 }
///
/// struct Lion;
///
/// impl SimpleOptimizer<f32> for Lion {
///     type Config = LionConfig;
///     const KIND: &'static str = "lion";
///     const STATE: &'static [&'static str] = &["exp_avg"];
///
///     fn update(c: &LionConfig, _step: u64, param: &mut [f32], grad: &[f32], state: &mut [Vec<f32>]) {
///         let (lr, wd) = (c.lr as f32, c.weight_decay as f32);
///         let (b1, b2) = (c.betas.0 as f32, c.betas.1 as f32);
///         for ((p, &g), m) in param.iter_mut().zip(grad).zip(&mut state[0]) {
///             let update = b1 * *m + (1.0 - b1) * g;
///             // torch.sign: 0 at 0 (Rust's signum is 1 there), NaN at NaN.
///             let sign = if update == 0.0 { 0.0 } else { update.signum() };
///             *p = *p * (1.0 - lr * wd) - lr * sign;
///             *m = b2 * *m + (1.0 - b2) * g;
///         }
///     }
/// }
///
/// let config = LionConfig { lr: 0.1, betas: (0.9, 0.99), weight_decay: 0.0 };
/// let mut lion = Simple::<Lion, f32>::new(config)?;
/// let key = ParamKey::new("w", 0, 0);
/// let mut w = vec![1.0f32, 1.0, 1.0];
/// lion.step(&mut [ParamMut { key: &key, data: &mut w }], &[Some(&[3.0, -0.1, 0.0][..])])?;
/// assert_eq!(w, [0.9, 1.1, 1.0]); // a zero gradient moves nothing
/// // Groups added by name take the constructor's values for what they omit.
/// let group = lion.add_group(serde_json::json!({ "lr": 0.01 }).as_object().unwrap())?;
/// assert_eq!(lion.hyperparams(group)["betas"], serde_json::json!([0.9, 0.99]));
/// assert_eq!(lion.export_state().params[&("w".to_string(), 0)].scalars["step"], 1.0);
/// # Ok::<(), zero_core::Error>(())
/// ```
///
/// A custom optimizer runs where the engine steps on the host: the thread
/// and MPI backends, and a GPU model whose optimizer is offloaded
/// (`EngineConfig::with_offload`). Without offload the GPU engine steps
/// its built-ins with fused kernels and refuses other kinds.
pub trait SimpleOptimizer<T: Element>: Send + Sync + 'static {
    /// One parameter group's hyperparameters, a struct serialized as a JSON
    /// object under PyTorch's names (`lr` required; a pair such as `betas`
    /// as a tuple). Derive `serde::Serialize` and `serde::Deserialize`.
    type Config: Clone + Send + Sync + Serialize + DeserializeOwned;

    /// The optimizer's name (`kind`, recorded in checkpoints).
    const KIND: &'static str;

    /// The names of its per-element state tensors, each as long as the
    /// piece it belongs to and zero before the piece's first step.
    const STATE: &'static [&'static str];

    /// Checks a group's values (beyond `lr >= 0`, which is checked for
    /// you); an error says which value and why.
    fn validate(config: &Self::Config) -> Result<()> {
        let _ = config;
        Ok(())
    }

    /// One step of one piece: `step` counts this piece's steps, 1 on its
    /// first; `state[i]` is the tensor named `STATE[i]`.
    fn update(config: &Self::Config, step: u64, param: &mut [T], grad: &[T], state: &mut [Vec<T>]);
}

/// The built-ins' kinds, which a custom optimizer may not take.
const BUILT_IN_KINDS: &[&str] = &["sgd", "adam", "adamw", "adagrad", "rmsprop"];

/// A [`SimpleOptimizer`] as a [`FunctionalOptimizer`].
pub struct Simple<O: SimpleOptimizer<T>, T: Element> {
    core: Core<Group<O, T>, State<O, T>>,
}

impl<O: SimpleOptimizer<T>, T: Element> Simple<O, T> {
    /// The optimizer with one parameter group of `config`.
    pub fn new(config: O::Config) -> Result<Self> {
        if BUILT_IN_KINDS.contains(&O::KIND) {
            return Err(Error::Optimizer(format!(
                "a custom optimizer's KIND is {:?}, the name of a built-in: checkpoints and the \
                 GPU engine would take it for the built-in; choose another name",
                O::KIND
            )));
        }
        Ok(Self {
            core: Core::new(Group::new(config))?,
        })
    }

    /// Adds a parameter group with `config`; returns its index.
    pub fn add_param_group(&mut self, config: O::Config) -> Result<usize> {
        self.core.push_group(Group::new(config))
    }

    /// The configuration of `group`, if it exists.
    pub fn config(&self, group: usize) -> Option<&O::Config> {
        self.core.groups.get(group).map(|g| &g.config)
    }
}

impl<O: SimpleOptimizer<T>, T: Element> FunctionalOptimizer<T> for Simple<O, T> {
    fn kind(&self) -> &str {
        O::KIND
    }

    fn step(&mut self, params: &mut [ParamMut<'_, T>], grads: &[Option<&[T]>]) -> Result<()> {
        self.core.step(
            params,
            grads,
            |_, len| State::new(len),
            |group, state, param, grad| {
                state.step += 1.0;
                O::update(
                    &group.config,
                    state.step as u64,
                    param,
                    grad,
                    &mut state.tensors,
                );
            },
        )
    }

    fn num_groups(&self) -> usize {
        self.core.groups.len()
    }

    fn add_group(&mut self, hyper: &Hyperparams) -> Result<usize> {
        self.core.add_group(hyper)
    }

    fn hyperparams(&self, group: usize) -> Hyperparams {
        self.core.hyperparams(group)
    }

    fn set_hyperparams(&mut self, group: usize, hyper: &Hyperparams) -> Result<()> {
        self.core.set_hyperparams(group, hyper)
    }

    fn learning_rate(&self, group: usize) -> f64 {
        self.core.learning_rate(group)
    }

    fn set_learning_rate(&mut self, group: usize, lr: f64) {
        self.core.set_learning_rate(group, lr)
    }

    fn export_state(&self) -> OptimizerState<T> {
        self.core.export_state()
    }

    fn import_state(&mut self, state: OptimizerState<T>) -> Result<()> {
        self.core.import_state(state)
    }

    fn state_bytes(&self) -> usize {
        self.core.state_bytes()
    }
}

/// One group's configuration, read and written by name through its JSON
/// form.
struct Group<O: SimpleOptimizer<T>, T: Element> {
    config: O::Config,
    _element: PhantomData<fn() -> T>,
}

impl<O: SimpleOptimizer<T>, T: Element> Group<O, T> {
    fn new(config: O::Config) -> Self {
        Self {
            config,
            _element: PhantomData,
        }
    }
}

impl<O: SimpleOptimizer<T>, T: Element> Clone for Group<O, T> {
    fn clone(&self) -> Self {
        Self::new(self.config.clone())
    }
}

impl<O: SimpleOptimizer<T>, T: Element> GroupFields for Group<O, T> {
    const KIND: &'static str = O::KIND;

    fn keys(&self) -> Vec<String> {
        self.to_hyperparams().keys().cloned().collect()
    }

    fn lr(&self) -> f64 {
        self.to_hyperparams()
            .get("lr")
            .and_then(Value::as_f64)
            .unwrap_or(f64::NAN)
    }

    fn set_lr(&mut self, lr: f64) {
        let mut hyper = Hyperparams::new();
        hyper.insert("lr".into(), lr.into());
        // A number where `validate` found one deserializes back.
        let _ = self.apply(&hyper);
    }

    fn to_hyperparams(&self) -> Hyperparams {
        match serde_json::to_value(&self.config) {
            Ok(Value::Object(map)) => map,
            _ => Hyperparams::new(),
        }
    }

    fn apply(&mut self, hyper: &Hyperparams) -> Result<()> {
        let mut map = self.to_hyperparams();
        for (key, value) in hyper {
            if map.contains_key(key) {
                map.insert(key.clone(), value.clone());
            }
        }
        self.config = serde_json::from_value(Value::Object(map)).map_err(|e| {
            Error::Optimizer(format!(
                "{}: hyperparameters {}: {e}",
                O::KIND,
                Value::Object(hyper.clone())
            ))
        })?;
        Ok(())
    }
}

impl<O: SimpleOptimizer<T>, T: Element> GroupConfig for Group<O, T> {
    fn validate(&self) -> Result<()> {
        let lr = match serde_json::to_value(&self.config) {
            Ok(Value::Object(map)) => map.get("lr").and_then(Value::as_f64),
            _ => {
                return Err(Error::Optimizer(format!(
                    "{}: its Config must serialize to a JSON object (a struct with named \
                     fields)",
                    O::KIND
                )))
            }
        };
        let Some(lr) = lr else {
            return Err(Error::Optimizer(format!(
                "{}: its Config needs a number field `lr` (the learning rate schedulers set)",
                O::KIND
            )));
        };
        check_non_negative(O::KIND, "learning rate", lr)?;
        O::validate(&self.config)
    }
}

/// One piece's step count and named tensors.
struct State<O, T> {
    step: f64,
    tensors: Vec<Vec<T>>,
    _optimizer: PhantomData<fn() -> O>,
}

impl<O: SimpleOptimizer<T>, T: Element> State<O, T> {
    fn new(len: usize) -> Self {
        Self {
            step: 0.0,
            tensors: O::STATE.iter().map(|_| vec![T::default(); len]).collect(),
            _optimizer: PhantomData,
        }
    }
}

impl<O: SimpleOptimizer<T>, T: Element> PieceState<T> for State<O, T> {
    fn len(&self) -> Option<usize> {
        self.tensors.first().map(Vec::len)
    }

    fn bytes(&self) -> usize {
        let elements: usize = self.tensors.iter().map(Vec::len).sum();
        elements * std::mem::size_of::<T>() + std::mem::size_of::<f64>()
    }

    fn export(&self) -> ParamState<T> {
        ParamState {
            scalars: [("step".to_string(), self.step)].into(),
            tensors: O::STATE
                .iter()
                .map(|name| name.to_string())
                .zip(self.tensors.iter().cloned())
                .collect(),
        }
    }

    fn import(kind: &str, name: &str, mut state: ParamState<T>) -> Result<Self> {
        let step = take_step(kind, name, &mut state)?;
        let mut len = None;
        let mut tensors = Vec::with_capacity(O::STATE.len());
        for key in O::STATE {
            let tensor = take_tensor(kind, name, &mut state, key, &mut len)?;
            tensors.push(tensor.ok_or_else(|| missing(kind, name, key))?);
        }
        reject_leftovers(kind, name, &state)?;
        Ok(Self {
            step,
            tensors,
            _optimizer: PhantomData,
        })
    }
}
