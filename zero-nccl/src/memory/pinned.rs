//! Page-locked host memory for offload ([`HostTransfers::pin_host`]): an
//! offloaded shard registered with the driver, so that copies to and from
//! it run as direct transfers at the link's speed instead of through the
//! driver's pageable staging.
//!
//! [`HostTransfers::pin_host`]: zero_core::engine::HostTransfers::pin_host

use crate::device_comm::{host_wait, host_wait_polling};
use cudarc::driver::{sys, CudaContext, CudaEvent, CudaSlice};
use std::collections::VecDeque;
use std::ffi::c_void;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use zero_core::engine::{HostLock, HostPin, Landing};
use zero_core::{Error, Result};

/// Keeps a registered host range page-locked until unlocked, which first
/// waits for every queued copy that may read or write it.
struct Registered {
    ctx: Arc<CudaContext>,
    ptr: *mut c_void,
    pending: Pending,
    timeout: Duration,
}

// SAFETY: the pointer is only handed back to the driver (on unlock), which
// takes it from any thread; the memory itself belongs to its buffer.
unsafe impl Send for Registered {}
unsafe impl Sync for Registered {}

impl HostLock for Registered {
    fn unlock(self: Box<Self>) -> bool {
        // An unlock has no one to report to. A copy that does not land
        // within the deadline (behind a dead peer's reduction, or a device
        // that slow) may still run: the range stays locked and the buffer
        // keeps its memory. Should unregistering fail, the range stays
        // locked until the process ends.
        let pending = lock(&self.pending).clone();
        for copy in &pending {
            if host_wait(LANDING, 0, copy, self.timeout).is_err() {
                return false;
            }
        }
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: `ptr` was registered by `pin` and is still allocated
            // (the buffer unlocks before it frees its memory).
            let _ = unsafe { sys::cuMemHostUnregister(self.ptr) }.result();
        }
        true
    }
}

/// Page-locks `values` on `ctx` until the returned guard is unlocked (which
/// first waits, within `timeout`, for the copies `transfers` tracks).
pub(super) fn pin(
    ctx: &Arc<CudaContext>,
    values: &mut [f32],
    transfers: &Transfers,
    timeout: Duration,
) -> Result<Option<HostPin>> {
    if values.is_empty() {
        return Ok(None);
    }
    let bytes = std::mem::size_of_val(values);
    let ptr = values.as_mut_ptr().cast::<c_void>();
    let locked = ctx.bind_to_thread().and_then(|()| {
        // SAFETY: `values` is a live allocation of `bytes` bytes, which the
        // caller keeps in place until the guard is unlocked.
        unsafe { sys::cuMemHostRegister_v2(ptr, bytes, sys::CU_MEMHOSTREGISTER_PORTABLE) }.result()
    });
    match locked {
        Ok(()) => Ok(Some(Box::new(Registered {
            ctx: Arc::clone(ctx),
            ptr,
            pending: Arc::clone(&transfers.pending),
            timeout,
        }))),
        Err(e) => Err(Error::Config(format!(
            "offload could not page-lock {:.2} GiB of host memory for the GPU's transfers \
             ({e}); raise the locked-memory limit (`ulimit -l`, a container's memlock), or \
             turn pinning off (`EngineConfig::offload_pin_memory = false`, the trainer's \
             `--offload-pinned false`: transfers are then slower)",
            bytes as f64 / (1u64 << 30) as f64
        ))),
    }
}

/// Copies in flight before the host waits for the oldest: offload's device
/// side holds at most this many staged buckets more than without queueing,
/// and the host is at most this many copies ahead of the device (each copy
/// follows the compute stream's work queued before it, so this bounds how
/// far backward's launches run ahead of the GPU: 8 default buckets are a
/// few milliseconds of a GPT's backward).
const IN_FLIGHT: usize = 8;

const LANDING: &str = "offload: copying between host and device memory";

/// The longest sleep between polls for a copy: a bucket's copy takes about
/// a millisecond, and neither the step thread nor backward's launches
/// should oversleep it by as much.
const LANDING_POLL: Duration = Duration::from_micros(200);

/// The completion events of the copies queued to or from page-locked host
/// memory not yet seen complete (offload's transfers on their stream,
/// stage 3's gathers from an offloaded shard on the compute stream),
/// shared with the page-locks, whose unlock waits for each.
pub(super) type Pending = Arc<Mutex<Vec<Arc<CudaEvent>>>>;

/// Adds a queued copy's completion event to `pending`, less the events
/// already complete.
pub(super) fn track(pending: &Pending, done: Arc<CudaEvent>) {
    let mut events = lock(pending);
    events.retain(|e| !e.is_complete());
    events.push(done);
}

/// Offload's queued transfers between page-locked host memory and the
/// device: each copy's completion event and, for a download, the device
/// buffer it reads (kept until the copy is done), oldest first. The events
/// are tracked in `pending` too, which the page-locks ([`pin`]) share and
/// whose unlock waits for them: no copy reads or writes freed memory.
#[derive(Default)]
pub(super) struct Transfers {
    copies: VecDeque<(Arc<CudaEvent>, Option<CudaSlice<f32>>)>,
    pending: Pending,
}

impl Transfers {
    /// Records a queued copy (`done` follows it on the stream), reading
    /// `source` where it is a download; lets go of landed downloads'
    /// buffers and, past [`IN_FLIGHT`], waits for the oldest within
    /// `timeout`.
    pub(super) fn queued(
        &mut self,
        done: CudaEvent,
        source: Option<CudaSlice<f32>>,
        timeout: Duration,
    ) -> Result<()> {
        let done = Arc::new(done);
        track(&self.pending, Arc::clone(&done));
        self.copies.push_back((done, source));
        while let Some((oldest, _)) = self.copies.front() {
            if !oldest.is_complete() {
                if self.copies.len() <= IN_FLIGHT {
                    break;
                }
                host_wait_polling(LANDING, 0, oldest, timeout, LANDING_POLL)
                    .map_err(Error::from)?;
            }
            self.copies.pop_front();
        }
        Ok(())
    }

    /// What waits, within `timeout`, for the copies queued so far (and
    /// not for later ones); `None` when every one has landed.
    /// It may run on another thread (the offload's step thread), which it
    /// binds to the device's context first.
    pub(super) fn landing(&self, timeout: Duration) -> Option<Landing> {
        let (newest, _) = self.copies.back()?;
        let newest = Arc::clone(newest);
        Some(Box::new(move || {
            newest
                .context()
                .bind_to_thread()
                .map_err(|e| Error::from(crate::Error::from(e)))?;
            host_wait_polling(LANDING, 0, &newest, timeout, LANDING_POLL).map_err(Error::from)
        }))
    }

    /// The copies' events the page-locks wait for, to share with stage 3's
    /// gathers from an offloaded shard.
    pub(super) fn pending(&self) -> Pending {
        Arc::clone(&self.pending)
    }

    /// Waits, within `timeout`, until every queued copy has landed.
    pub(super) fn land(&mut self, timeout: Duration) -> Result<()> {
        if let Some((newest, _)) = self.copies.back() {
            host_wait_polling(LANDING, 0, newest, timeout, LANDING_POLL).map_err(Error::from)?;
        }
        self.copies.clear();
        // Others' copies (stage 3's gathers) may still run.
        lock(&self.pending).retain(|e| !e.is_complete());
        Ok(())
    }
}

fn lock(pending: &Pending) -> std::sync::MutexGuard<'_, Vec<Arc<CudaEvent>>> {
    pending
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}
