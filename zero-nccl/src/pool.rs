//! [`DevicePool`]: the stream-ordered memory pool of a device, whose
//! high-water mark is the device's peak of what `cuMemAllocAsync` handed out
//! (Candle's tensors, the engine's buffers: everything allocated on a
//! stream), like PyTorch's `max_memory_allocated()`.

use cudarc::driver::{sys, CudaContext};

/// The memory pool that `cuMemAllocAsync` draws from on a device.
#[derive(Debug)]
pub struct DevicePool(sys::CUmemoryPool);

impl DevicePool {
    /// The current pool of `ctx`'s device (the default pool unless someone
    /// set another), or why its high-water mark would not count the
    /// allocations of Candle and the engine.
    pub fn of(ctx: &CudaContext) -> Result<Self, String> {
        if !ctx.has_async_alloc() {
            return Err(
                "the device does not support memory pools, so Candle allocates with cuMemAlloc, \
                 which no pool counts"
                    .into(),
            );
        }
        ctx.bind_to_thread()
            .map_err(|e| format!("cannot make the CUDA context current: {e}"))?;
        let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
        // SAFETY: `pool` is a valid out-pointer for one CUmemoryPool, and
        // `cu_device()` is a device handle the driver gave `ctx`, which is
        // alive for the call.
        unsafe { sys::cuDeviceGetMemPool(&mut pool, ctx.cu_device()) }
            .result()
            .map_err(|e| format!("cuDeviceGetMemPool failed: {e}"))?;
        if pool.is_null() {
            return Err("cuDeviceGetMemPool returned no pool".into());
        }
        Ok(Self(pool))
    }

    /// Resets the used-memory high-water mark (to the memory in use now).
    pub fn reset_high_water(&self) -> Result<(), String> {
        let mut zero: u64 = 0;
        // SAFETY: `self.0` is a pool handle from cuDeviceGetMemPool (a
        // device's pools live as long as the process's driver state);
        // CU_MEMPOOL_ATTR_USED_MEM_HIGH takes a pointer to a cuuint64_t,
        // which `zero` is, alive across the call.
        unsafe {
            sys::cuMemPoolSetAttribute(
                self.0,
                sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH,
                (&mut zero as *mut u64).cast(),
            )
        }
        .result()
        .map_err(|e| format!("cuMemPoolSetAttribute(USED_MEM_HIGH) failed: {e}"))
    }

    /// The most bytes of the pool in use at once since the last reset (or
    /// since the process started).
    pub fn high_water(&self) -> Result<u64, String> {
        let mut bytes: u64 = 0;
        // SAFETY: `self.0` is a live pool handle (see `reset_high_water`);
        // CU_MEMPOOL_ATTR_USED_MEM_HIGH writes one cuuint64_t to the
        // pointer, and `bytes` is one, alive across the call.
        unsafe {
            sys::cuMemPoolGetAttribute(
                self.0,
                sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH,
                (&mut bytes as *mut u64).cast(),
            )
        }
        .result()
        .map_err(|e| format!("cuMemPoolGetAttribute(USED_MEM_HIGH) failed: {e}"))?;
        Ok(bytes)
    }
}
