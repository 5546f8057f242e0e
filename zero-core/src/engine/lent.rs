//! What a step that runs beside backward (the interleaved schedule,
//! offload's step thread) borrows: the optimizer, home or lent (while it
//! is away the engine knows only its learning rates, and a rate set
//! meanwhile is applied when it comes back), and with it the parameter
//! shard and the pieces' keys ([`EarlyStep::lend`], [`EarlyStep::put_back`]).

use super::buffers::{Borrower, ParamShard};
use super::reduce::EarlyStep;
use super::{ShardMemory, Sharding};
use crate::comm::Communicator;
use crate::optim::FunctionalOptimizer;
use crate::{Element, Error, Result};

pub(super) enum HeldOptimizer<T: Element> {
    Home(Box<dyn FunctionalOptimizer<T>>),
    /// Away: each group's learning rate, whether one was set since it
    /// left, and the bytes of state it held when it left.
    Lent {
        rates: Vec<f64>,
        set: bool,
        state_bytes: usize,
    },
}

impl<T: Element> HeldOptimizer<T> {
    /// The optimizer, unless it is lent.
    pub(super) fn home(&self) -> Result<&dyn FunctionalOptimizer<T>> {
        match self {
            Self::Home(optimizer) => Ok(optimizer.as_ref()),
            Self::Lent { .. } => Err(lent()),
        }
    }

    /// The optimizer to change or step, unless it is lent.
    pub(super) fn home_mut(&mut self) -> Result<&mut dyn FunctionalOptimizer<T>> {
        match self {
            Self::Home(optimizer) => Ok(optimizer.as_mut()),
            Self::Lent { .. } => Err(lent()),
        }
    }

    /// The learning rate of `group`, home or away.
    pub(super) fn learning_rate(&self, group: usize) -> f64 {
        match self {
            Self::Home(optimizer) => optimizer.learning_rate(group),
            Self::Lent { rates, .. } => rates.get(group).copied().unwrap_or(f64::NAN),
        }
    }

    /// Sets every group's learning rate; while lent, from the step after
    /// the one under way (whose buckets may have stepped already).
    pub(super) fn set_learning_rate(&mut self, lr: f64) {
        match self {
            Self::Home(optimizer) => {
                for group in 0..optimizer.num_groups() {
                    optimizer.set_learning_rate(group, lr);
                }
            }
            Self::Lent { rates, set, .. } => {
                rates.fill(lr);
                *set = true;
            }
        }
    }

    /// The bytes of state `measure` counts in the optimizer; while it is
    /// lent, as many as when it left.
    pub(super) fn state_bytes(
        &self,
        measure: impl FnOnce(&dyn FunctionalOptimizer<T>) -> usize,
    ) -> usize {
        match self {
            Self::Home(optimizer) => measure(optimizer.as_ref()),
            Self::Lent { state_bytes, .. } => *state_bytes,
        }
    }

    /// Lends the optimizer out; it holds `state_bytes` of state.
    pub(super) fn lend(&mut self, state_bytes: usize) -> Result<Box<dyn FunctionalOptimizer<T>>> {
        let away = Self::Lent {
            rates: Vec::new(),
            set: false,
            state_bytes,
        };
        match std::mem::replace(self, away) {
            Self::Home(optimizer) => {
                let rates = (0..optimizer.num_groups())
                    .map(|group| optimizer.learning_rate(group))
                    .collect();
                *self = Self::Lent {
                    rates,
                    set: false,
                    state_bytes,
                };
                Ok(optimizer)
            }
            already @ Self::Lent { .. } => {
                *self = already;
                Err(lent())
            }
        }
    }

    /// Takes the lent optimizer back, with the rates set while it was away.
    pub(super) fn take_back(&mut self, mut optimizer: Box<dyn FunctionalOptimizer<T>>) {
        if let Self::Lent {
            rates, set: true, ..
        } = self
        {
            for (group, &lr) in rates.iter().enumerate() {
                optimizer.set_learning_rate(group, lr);
            }
        }
        *self = Self::Home(optimizer);
    }
}

impl<T: Element, B> EarlyStep<T, B> {
    /// Lends the optimizer, the parameter shard and the owned pieces' keys
    /// for one interleaved step: the owned pieces of parameters `trains`
    /// marks step with their bucket, averaged over `micro_steps`. Nothing
    /// is lent on an error.
    pub(super) fn lend<C: Communicator, M: ShardMemory<T, C, Buffer = B>>(
        memory: &M,
        optimizer: &mut HeldOptimizer<T>,
        shard: &mut ParamShard<B>,
        sharding: &mut Sharding,
        trains: impl Fn(usize) -> bool,
        micro_steps: usize,
    ) -> Result<Self> {
        let bucket_pieces = sharding
            .pieces_by_bucket()
            .ok_or_else(|| {
                Error::State(
                    "internal: the interleaved schedule needs pieces within buckets".into(),
                )
            })?
            .to_vec();
        let base = sharding.base();
        let pieces = (sharding.owned.iter())
            .map(|piece| {
                let at = piece.flat_range.start - base;
                (at..at + piece.len(), trains(piece.param))
            })
            .collect();
        let state_bytes = optimizer.state_bytes(|o| memory.state_bytes(o));
        let params = shard.lend::<T, C, M>(Borrower::Step)?;
        let optimizer = match optimizer.lend(state_bytes) {
            Ok(optimizer) => optimizer,
            Err(e) => {
                shard.put(params);
                return Err(e);
            }
        };
        Ok(EarlyStep {
            optimizer,
            params,
            // Lent like the optimizer (the engine is lent to backward, so
            // nothing reads them meanwhile); back with `put_back`.
            keys: std::mem::take(&mut sharding.keys),
            pieces,
            bucket_pieces,
            scale: (micro_steps > 1).then(|| 1.0 / micro_steps as f64),
            stepped: vec![false; sharding.layout.buckets.len()],
        })
    }

    /// Puts back what [`EarlyStep::lend`] lent; which buckets stepped.
    pub(super) fn put_back(
        self,
        optimizer: &mut HeldOptimizer<T>,
        shard: &mut ParamShard<B>,
        sharding: &mut Sharding,
    ) -> Vec<bool> {
        optimizer.take_back(self.optimizer);
        shard.put(self.params);
        sharding.keys = self.keys;
        self.stepped
    }
}

fn lent() -> Error {
    Error::State(
        "the optimizer is stepping beside the backward pass (Overlap::Interleaved or offload's \
         step thread) until the step returns; read or change it after the step"
            .into(),
    )
}
