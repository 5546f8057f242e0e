//! Shared code of the zero-rs trainers and benchmarks.

pub mod bench;
pub mod heap;
pub mod optimizers;
pub mod trainer;

/// Fixes Candle's CPU thread count for the process, at the value Candle
/// would choose, unless `RAYON_NUM_THREADS` already does.
///
/// Candle 0.11 works its thread count out again on every CPU matmul, and
/// unless `RAYON_NUM_THREADS` is set that reads and parses `/proc/cpuinfo`:
/// in `bench stage3` it was 8-15 ms of a 40-55 ms step on 2 cores, more
/// for stage 3 in pieces (more, smaller matmuls). Call it first thing in
/// `main`, before any thread starts (the environment is the process's).
pub fn fix_candle_thread_count() {
    if std::env::var_os("RAYON_NUM_THREADS").is_none() {
        let threads = candle_core::utils::get_num_threads();
        std::env::set_var("RAYON_NUM_THREADS", threads.to_string());
    }
}
