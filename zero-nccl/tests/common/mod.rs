//! What the GPU tests share: a context or a communicator on GPU 0 for tests
//! marked `#[ignore = "needs a CUDA GPU"]`, which fail saying why when run
//! (`-- --ignored`) without a GPU, rather than pass having checked nothing.
#![allow(dead_code)] // each test file uses part of it

/// Panics, naming what is missing, unless the CUDA driver reports a device.
pub fn require_gpu() {
    match zero_nccl::cuda_device_count() {
        Ok(0) => panic!(
            "this test needs a CUDA GPU, and the driver reports none; run the ignored tests \
             on a GPU machine"
        ),
        Err(e) => panic!(
            "this test needs a CUDA GPU, and there is no usable driver ({e}); run the ignored \
             tests on a GPU machine"
        ),
        Ok(_) => {}
    }
}

/// A context on GPU 0; panics saying why when there is none.
#[cfg(feature = "cuda")]
pub fn cuda_context() -> std::sync::Arc<zero_nccl::cudarc::driver::CudaContext> {
    require_gpu();
    zero_nccl::cudarc::driver::CudaContext::new(0)
        .unwrap_or_else(|e| panic!("creating a CUDA context on GPU 0 failed: {e}"))
}

/// An NCCL communicator of one rank on GPU 0; panics saying why when there
/// is no GPU or no libnccl.
#[cfg(feature = "nccl")]
pub fn nccl_comm() -> zero_nccl::NcclComm {
    require_gpu();
    zero_nccl::NcclComm::single(0).unwrap_or_else(|e| panic!("NcclComm::single(0) failed: {e}"))
}

/// Whether the CUDA driver reports a device; prints why not otherwise. For
/// tests that still skip by returning early (they pass having checked
/// nothing): prefer `#[ignore = "needs a CUDA GPU"]` with [`require_gpu`].
pub fn gpu_present() -> bool {
    match zero_nccl::cuda_device_count() {
        Ok(0) => {
            println!("skipping: the CUDA driver reports no device");
            false
        }
        Err(e) => {
            println!("skipping: no CUDA driver found (libcuda.so): {e}");
            false
        }
        Ok(_) => true,
    }
}

/// An NCCL communicator of one rank on GPU 0, or `None` (printed) when there
/// is no GPU or no libnccl: the skipping form of [`nccl_comm`], kept for
/// tests not yet marked `#[ignore]`.
#[cfg(feature = "nccl")]
pub fn single_comm() -> Option<zero_nccl::NcclComm> {
    if !gpu_present() {
        return None;
    }
    match zero_nccl::NcclComm::single(0) {
        Ok(c) => Some(c),
        Err(e @ zero_nccl::Error::LibraryNotFound { .. }) => {
            println!("skipping: {e}");
            None
        }
        Err(e) => panic!("NcclComm::single(0) failed: {e}"),
    }
}

/// Deterministic values in [-1, 1) (`values` in golden/kernels.py).
pub fn values(seed: u64, n: usize) -> Vec<f32> {
    let mut s = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}
