//! [`RawComm`], the owned `ncclComm_t`, destroyed when dropped.

use crate::Error;
use cudarc::nccl::{result as nccl, sys};

/// An owned `ncclComm_t`; null once aborted.
pub(super) struct RawComm(pub(super) sys::ncclComm_t);

// SAFETY: an NCCL communicator is not tied to the thread that created it; NCCL
// only requires that calls on one communicator are not concurrent, which the
// `Mutex` around `RawComm` in `NcclComm` guarantees (group calls included: the
// lock is held from ncclGroupStart to ncclGroupEnd).
unsafe impl Send for RawComm {}

impl Drop for RawComm {
    fn drop(&mut self) {
        if self.0.is_null() {
            return;
        }
        // SAFETY: `self.0` came from ncclCommInitRank/ncclCommSplit, has not
        // been destroyed or aborted (it would be null), and is not used after.
        // ncclCommDestroy finalizes (flushes queued work) before freeing.
        if let Err(e) = unsafe { nccl::comm_destroy(self.0) } {
            tracing::warn!(
                "ncclCommDestroy failed: {}",
                Error::nccl("ncclCommDestroy", e)
            );
        }
        self.0 = std::ptr::null_mut();
    }
}
