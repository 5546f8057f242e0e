//! CUDA's per-thread default stream, which Candle's `Device::new_cuda`
//! computes on.

use cudarc::driver::CudaStream;

/// The stream handle CUDA reads as "the calling thread's default stream"
/// (`cudaStreamPerThread`).
const PER_THREAD_STREAM: usize = 0x2;

/// Whether `stream` is CUDA's per-thread default stream (Candle's
/// `Device::new_cuda`): one handle that names another stream on every
/// thread, so whatever is kept per stream (a workspace, an event) must be
/// kept per thread for it.
pub fn is_per_thread_stream(stream: &CudaStream) -> bool {
    stream.cu_stream() as usize == PER_THREAD_STREAM
}
