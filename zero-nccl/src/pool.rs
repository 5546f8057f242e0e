//! [`DevicePool`]: the stream-ordered memory pool of a device, whose
//! high-water mark is the device's peak of what `cuMemAllocAsync` handed out
//! (Candle's tensors, the engine's buffers: everything allocated on a
//! stream), like PyTorch's `max_memory_allocated()`, and whose release
//! threshold says how much freed memory it keeps for the next allocations.

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
        self.set(sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH, 0)
    }

    /// The most bytes of the pool in use at once since the last reset (or
    /// since the process started).
    pub fn high_water(&self) -> Result<u64, String> {
        self.get(sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH)
    }

    /// Keeps every freed byte in the pool for the next allocations
    /// ([`DevicePool::set_release_threshold`] at [`DevicePool::RETAIN_ALL`]),
    /// as PyTorch's caching allocator does. CUDA's default threshold, 0,
    /// hands what is free back to the driver at every stream, event or
    /// context synchronization, and a training step, which allocates its
    /// activations again each time, then has them mapped again each step.
    /// The GPU engine sets this when it is built (`CudaMemory::new`).
    pub fn retain_freed(&self) -> Result<(), String> {
        self.set_release_threshold(Self::RETAIN_ALL)
    }

    /// The release threshold that keeps every freed byte.
    pub const RETAIN_ALL: u64 = u64::MAX;

    /// The bytes of freed memory the pool keeps at a synchronization
    /// before it hands the rest back to the driver
    /// (`CU_MEMPOOL_ATTR_RELEASE_THRESHOLD`; 0, CUDA's default, keeps
    /// none). The pool is the device's, shared by everything in the
    /// process that allocates on it.
    pub fn set_release_threshold(&self, bytes: u64) -> Result<(), String> {
        self.set(
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            bytes,
        )
    }

    /// The pool's release threshold (see [`DevicePool::set_release_threshold`]).
    pub fn release_threshold(&self) -> Result<u64, String> {
        self.get(sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD)
    }

    /// Sets a pool attribute that takes a `cuuint64_t`.
    fn set(&self, attribute: sys::CUmemPool_attribute, value: u64) -> Result<(), String> {
        let mut value = value;
        // SAFETY: `self.0` is a pool handle from cuDeviceGetMemPool (a
        // device's pools live as long as the process's driver state); the
        // two attributes this type sets (USED_MEM_HIGH, RELEASE_THRESHOLD)
        // take a pointer to a cuuint64_t, which `value` is, alive across
        // the call.
        unsafe { sys::cuMemPoolSetAttribute(self.0, attribute, (&mut value as *mut u64).cast()) }
            .result()
            .map_err(|e| format!("cuMemPoolSetAttribute({attribute:?}) failed: {e}"))
    }

    /// Reads a pool attribute that is a `cuuint64_t`.
    fn get(&self, attribute: sys::CUmemPool_attribute) -> Result<u64, String> {
        let mut value: u64 = 0;
        // SAFETY: `self.0` is a live pool handle (see `set`); the two
        // attributes this type reads (USED_MEM_HIGH, RELEASE_THRESHOLD) write
        // one cuuint64_t to the pointer, and `value` is one, alive across the
        // call.
        unsafe { sys::cuMemPoolGetAttribute(self.0, attribute, (&mut value as *mut u64).cast()) }
            .result()
            .map_err(|e| format!("cuMemPoolGetAttribute({attribute:?}) failed: {e}"))?;
        Ok(value)
    }
}
