//! Locking the NCCL handle for each call, and aborting it: on request, or
//! when a host wait passes the communicator's deadline.

use super::handle::RawComm;
use super::NcclComm;
use crate::device_comm::host_wait;
use crate::{Error, Result};
use cudarc::driver::CudaEvent;
use cudarc::nccl::result as nccl;
use std::sync::atomic::Ordering;
use std::sync::MutexGuard;

impl NcclComm {
    pub(super) fn lock(&self, op: &'static str) -> Result<MutexGuard<'_, RawComm>> {
        // A poisoned lock only means another thread panicked while holding
        // it; the raw handle itself is still consistent.
        let guard = self.comm.lock().unwrap_or_else(|p| p.into_inner());
        if guard.0.is_null() {
            return Err(Error::Aborted { op });
        }
        Ok(guard)
    }

    /// Blocks the host until `done` has completed or the deadline passes; on
    /// timeout the communicator is aborted so that no rank hangs on it.
    pub(super) fn host_wait(&self, op: &'static str, done: &CudaEvent) -> Result<()> {
        let waited = host_wait(op, self.seq.load(Ordering::Relaxed), done, self.timeout);
        if waited.is_err() {
            self.abort();
        }
        waited
    }

    /// Aborts the communicator: queued and future collectives fail instead of hanging.
    pub fn abort(&self) {
        let mut comm = self.comm.lock().unwrap_or_else(|p| p.into_inner());
        if comm.0.is_null() {
            return;
        }
        // SAFETY: the handle is live (not null) and is nulled right after, so
        // it is neither used nor destroyed again.
        if let Err(e) = unsafe { nccl::comm_abort(comm.0) } {
            tracing::warn!("ncclCommAbort failed: {}", Error::nccl("ncclCommAbort", e));
        }
        comm.0 = std::ptr::null_mut();
    }
}
