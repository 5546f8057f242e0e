//! The engine's master weights: whether it keeps them, and reading and writing
//! them (see the `precision` module).

use crate::comm::Communicator;
use crate::engine::precision::Masters;
use crate::engine::{Engine, ParamCopy, ShardMemory};
use crate::{Element, Result};

impl<T: Element, C: Communicator, M: ShardMemory<T, C>> Engine<T, C, M> {
    /// Makes the next step read the owned pieces of the weights from the
    /// replica again, replacing the master weights: call it after changing
    /// the model's weights by hand (an engine without master weights reads
    /// them at every step anyway). Loading a checkpoint sets the masters
    /// from the checkpoint; no call needed.
    pub fn reload_master_weights(&mut self) {
        self.truth.set_fresh(false);
    }

    /// The master weights, to read or set piece by piece.
    pub(in crate::engine) fn masters(&mut self) -> Result<Masters<'_, T, C, M>> {
        let stage = self.config.stage;
        let (comm, memory) = (&*self.comm, &mut self.memory);
        Ok(Masters::new(
            (comm, memory),
            self.buffers.param_shard.here_mut()?,
            &self.sharding,
            stage,
        ))
    }

    /// Brings the owned pieces of the shard up to date before a step:
    /// without master weights, from the replica (a user may have changed
    /// it since the last step); with them, only when they are stale.
    pub(in crate::engine) fn refresh_param_shard(
        &mut self,
        params: &mut M::Params<'_>,
    ) -> Result<()> {
        if self.truth.fresh() {
            return Ok(());
        }
        if self.stage.sharded_params().is_some() {
            // Stage 3: a sharded parameter's replica is gone.
            let copies: Vec<ParamCopy> = self
                .sharding
                .owned_copies
                .iter()
                .filter(|c| !self.stage.is_sharded(c.param))
                .cloned()
                .collect();
            self.memory
                .read_params(params, &copies, self.buffers.param_shard.here_mut()?)?;
        } else {
            self.memory.read_params(
                params,
                &self.sharding.owned_copies,
                self.buffers.param_shard.here_mut()?,
            )?;
        }
        self.truth.set_fresh(true);
        Ok(())
    }
}
