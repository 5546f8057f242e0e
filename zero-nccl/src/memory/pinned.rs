//! Page-locked host memory for offload ([`ShardMemory::pin_host`]): an
//! offloaded shard registered with the driver, so that copies to and from
//! it run as direct transfers at the link's speed instead of through the
//! driver's pageable staging.
//!
//! [`ShardMemory::pin_host`]: zero_core::engine::ShardMemory::pin_host

use cudarc::driver::{sys, CudaContext};
use std::ffi::c_void;
use std::sync::Arc;
use zero_core::engine::HostPin;
use zero_core::{Error, Result};

/// Keeps a registered host range page-locked; unregisters it when dropped.
struct Registered {
    ctx: Arc<CudaContext>,
    ptr: *mut c_void,
}

// SAFETY: the pointer is only handed back to the driver (on drop), which
// takes it from any thread; the memory itself belongs to its buffer.
unsafe impl Send for Registered {}
unsafe impl Sync for Registered {}

impl Drop for Registered {
    fn drop(&mut self) {
        // A drop has no one to report to: should unregistering fail, the
        // range stays locked until the process ends.
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: `ptr` was registered by `pin` and is still allocated
            // (the buffer drops this before its memory).
            let _ = unsafe { sys::cuMemHostUnregister(self.ptr) }.result();
        }
    }
}

/// Page-locks `values` on `ctx` until the returned guard is dropped.
pub(super) fn pin(ctx: &Arc<CudaContext>, values: &mut [f32]) -> Result<Option<HostPin>> {
    if values.is_empty() {
        return Ok(None);
    }
    let bytes = std::mem::size_of_val(values);
    let ptr = values.as_mut_ptr().cast::<c_void>();
    let locked = ctx.bind_to_thread().and_then(|()| {
        // SAFETY: `values` is a live allocation of `bytes` bytes, which the
        // caller keeps in place until the guard is dropped.
        unsafe { sys::cuMemHostRegister_v2(ptr, bytes, sys::CU_MEMHOSTREGISTER_PORTABLE) }.result()
    });
    match locked {
        Ok(()) => Ok(Some(Box::new(Registered {
            ctx: Arc::clone(ctx),
            ptr,
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
