//! Shared code of the zero-rs trainers and benchmarks.

pub mod bench;
pub mod heap;
pub mod trainer;

/// Process settings for CPU training, applied by the `train` and `bench`
/// binaries first thing in `main` (before any thread starts: both change
/// process-wide state). A library must not change them behind its user's
/// back; the README tells users what to set. `ranks_in_process` is how many
/// ranks run as threads of this process (the thread backend's world size;
/// 1 for a process per rank).
///
/// - Candle's CPU thread count is fixed at the value Candle would choose
///   (`RAYON_NUM_THREADS`, unless already set). Candle 0.11 works it out
///   again on every matmul, and without the variable that reads and parses
///   `/proc/cpuinfo`: in `bench stage3` it was 8-15 ms of a 40-55 ms step
///   on 2 cores, more for stage 3 in pieces (more, smaller matmuls).
/// - With several ranks in the process, Candle's pool for element-wise ops
///   is turned off (`CANDLE_NUM_THREADS=1`, unless already set), so each
///   rank runs them on its own thread. That pool is one per process: the
///   ranks take turns on it behind a lock, and its workers and callers
///   spin while they wait (25,000 rounds after each op). On 2 cores at
///   N=2 that spinning was 16% of the CPU time at stage 2 and 28% at
///   stage 3 (`perf`), and without the pool `bench stage3`'s steps went
///   from 62-68 ms to 52-58 ms at stage 2 and from 74-84 ms to 45-54 ms at
///   stage 3.
/// - glibc's allocator keeps freed blocks of up to 32 MiB for reuse
///   (`M_MMAP_THRESHOLD` 32 MiB, `M_TRIM_THRESHOLD` 64 MiB). By default it
///   maps blocks above a threshold that it adjusts as blocks are freed,
///   and unmaps them when freed: a training step that frees and allocates
///   the same multi-MB gradients and activations every time then pays page
///   faults for all of them. In `bench step` that made stages 1 and 2
///   1.3-1.9x stage 0 (whose pattern happened to raise the threshold);
///   with it fixed they were 0.80-1.02x. Not when `MALLOC_MMAP_THRESHOLD_`
///   is set: glibc then follows the environment.
pub fn tune_process(ranks_in_process: usize) {
    if std::env::var_os("RAYON_NUM_THREADS").is_none() {
        let threads = candle_core::utils::get_num_threads();
        std::env::set_var("RAYON_NUM_THREADS", threads.to_string());
    }
    if ranks_in_process > 1 && std::env::var_os("CANDLE_NUM_THREADS").is_none() {
        std::env::set_var("CANDLE_NUM_THREADS", "1");
    }
    // Settings given to glibc through its environment variables win.
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    if std::env::var_os("MALLOC_MMAP_THRESHOLD_").is_none() {
        // SAFETY: mallopt only sets allocator parameters, with valid
        // values; it is called before any other thread exists. A refusal
        // (0) leaves glibc's defaults, which are correct, only slower.
        unsafe {
            libc::mallopt(libc::M_MMAP_THRESHOLD, 32 << 20);
            libc::mallopt(libc::M_TRIM_THRESHOLD, 64 << 20);
        }
    }
}
