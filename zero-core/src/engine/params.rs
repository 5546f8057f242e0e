//! The model's parameters as the engine knows them: in collective order, by
//! name, and each one's optimizer group.

use super::EngineConfig;
use crate::optim::FunctionalOptimizer;
use crate::partition::ParamInfo;
use crate::{Element, Error, Result};
use std::collections::BTreeMap;
use std::ops::Deref;

/// The parameters in collective order (a slice of [`ParamInfo`] through
/// `Deref`), found by name, each in an optimizer group.
#[derive(Clone, Debug)]
pub struct ParamTable {
    list: Vec<ParamInfo>,
    index: BTreeMap<String, usize>,
    group_of: Vec<usize>,
}

impl Deref for ParamTable {
    type Target = [ParamInfo];

    fn deref(&self) -> &[ParamInfo] {
        &self.list
    }
}

impl<'a> IntoIterator for &'a ParamTable {
    type Item = &'a ParamInfo;
    type IntoIter = std::slice::Iter<'a, ParamInfo>;

    fn into_iter(self) -> Self::IntoIter {
        self.list.iter()
    }
}

impl ParamTable {
    /// Indexes `list` by name and adds `config.param_groups` to
    /// `optimizer`. Errors: a name given twice, a trainable parameter the
    /// engine's element type cannot step, a group naming no parameter, a
    /// parameter in two groups.
    pub(super) fn new<T: Element>(
        list: Vec<ParamInfo>,
        config: &EngineConfig,
        optimizer: &mut dyn FunctionalOptimizer<T>,
    ) -> Result<Self> {
        let mut index = BTreeMap::new();
        for (i, p) in list.iter().enumerate() {
            if index.insert(p.name.clone(), i).is_some() {
                return Err(Error::Config(format!(
                    "parameter name {:?} appears twice; names must be unique",
                    p.name
                )));
            }
            if p.trainable && !super::precision::engine_steps::<T>(p.dtype) {
                return Err(Error::ParamDType {
                    name: p.name.clone(),
                    param: p.dtype,
                    engine: T::DTYPE,
                });
            }
        }
        let mut table = Self {
            group_of: vec![0; list.len()],
            list,
            index,
        };
        for spec in &config.param_groups {
            let group = optimizer.add_group(&spec.hyperparams)?;
            for name in &spec.params {
                let i = table.find(name, "a parameter group")?;
                if table.group_of[i] != 0 {
                    return Err(Error::Config(format!(
                        "parameter {name:?} is in two parameter groups"
                    )));
                }
                table.group_of[i] = group;
            }
        }
        Ok(table)
    }

    /// The index of the parameter named `name`.
    pub fn index(&self, name: &str) -> Option<usize> {
        self.index.get(name).copied()
    }

    /// The optimizer group of each parameter.
    pub fn groups(&self) -> &[usize] {
        &self.group_of
    }

    /// The index of `name`, or an error saying that what `by` named is not
    /// a parameter.
    pub(super) fn find(&self, name: &str, by: &str) -> Result<usize> {
        self.index(name).ok_or_else(|| {
            Error::Config(format!(
                "{by} names {name:?}, which is not a parameter of the model"
            ))
        })
    }

    /// Moves the parameters at `members` into `group`.
    pub(super) fn move_to_group(&mut self, members: &[usize], group: usize) {
        for &i in members {
            self.group_of[i] = group;
        }
    }

    /// Checks one micro-step's gradient slots (`lens`: each slot's length,
    /// `None` for an empty one): one per parameter, each as long as it.
    pub(super) fn check_grads<G>(&self, grads: &[Option<G>], len: fn(&G) -> usize) -> Result<()> {
        let lens = grads.iter().map(|g| g.as_ref().map(len));
        if lens.len() != self.list.len() {
            return Err(Error::Config(format!(
                "got {} gradient slots for {} parameters; pass one slot per parameter (None to skip)",
                lens.len(),
                self.list.len()
            )));
        }
        for (p, len) in self.list.iter().zip(lens) {
            if let Some(len) = len {
                if len != p.numel() {
                    return Err(Error::Config(format!(
                        "gradient of {:?} has {len} elements, the parameter has {} ({:?}); pass \
                         each parameter's whole, contiguous gradient in parameter order",
                        p.name,
                        p.numel(),
                        p.shape
                    )));
                }
            }
        }
        Ok(())
    }
}
