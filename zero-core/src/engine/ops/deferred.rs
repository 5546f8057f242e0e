//! The engine's side of deferred all-gathers: the layers' access to the
//! replica, and waiting for the gathers before anything else reads it (see the
//! `deferred` module).

use crate::comm::Communicator;
use crate::engine::deferred::{ParamAccess, Refresh};
use crate::engine::{Engine, ShardMemory};
use crate::{Element, Error, Result};
use std::sync::Arc;

impl<T: Element, C: Communicator, M: ShardMemory<T, C>> Engine<T, C, M> {
    /// Lets steps defer their all-gathers
    /// ([`EngineConfig::defer_gathers`](crate::engine::EngineConfig::defer_gathers)):
    /// `access` reads and writes the framework's parameters from the
    /// communication thread. Without one, steps gather before they return. Stage
    /// 0 and sharded stage 3 gather nothing after a step: there it is kept
    /// by no one.
    pub fn set_param_access(&mut self, access: Box<dyn ParamAccess<T, C, M>>) -> Result<()> {
        self.finish_gathers()?;
        if let Some(gathers) = self.stage.deferred_gathers() {
            gathers.access = Some(access);
        }
        Ok(())
    }

    /// What layers wait on before reading their parameters after a step
    /// that deferred its all-gathers ([`Refresh::wait_all`] for all of
    /// them).
    pub fn refresh(&self) -> &Arc<Refresh> {
        &self.refresh
    }

    /// Waits for the last step's deferred all-gathers and takes back what
    /// their thread held; the error of a failed one. Every engine call that
    /// communicates or reads the parameters does this first.
    pub fn finish_gathers(&mut self) -> Result<()> {
        let Some(pending) = self.stage.deferred_gathers().and_then(|g| g.pending.take()) else {
            return Ok(());
        };
        let finished = pending.wait().ok_or_else(|| {
            Error::State(
                "the thread of the deferred all-gathers panicked; this rank's parameters were \
                 not all updated: restart the run from its last checkpoint"
                    .into(),
            )
        })?;
        finished.put_back(&mut self.buffers.pool, self.stage.deferred_gathers())
    }
}
