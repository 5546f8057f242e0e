//! What the GPU tests share: the skip with a printed reason when there is no
//! GPU or library.
#![allow(dead_code)] // each test file uses part of it

/// Whether the CUDA driver reports a device; prints why not otherwise.
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
/// is no GPU or no libnccl.
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
