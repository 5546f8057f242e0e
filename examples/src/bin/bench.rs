//! Benchmarks that print figures: a human table, then one JSON object per
//! figure on its own line (`{"name": ..., "value": ..., "unit": ...}`).
//!
//! `bench comm`, `bench optim`, `bench step`, `bench memory`, `bench precision`, `bench gpt`,
//! `bench hf`, `bench gpu`; no argument runs all
//! that this build supports.

/// Counts what the process allocates (`--metrics`' `peak_heap_bytes`,
/// `bench memory`).
#[global_allocator]
static HEAP: zero_examples::heap::CountingAllocator = zero_examples::heap::CountingAllocator;

fn main() {
    // Most benchmarks run their ranks as threads of this process; those
    // at world size 1 compare two runs under the same settings.
    zero_examples::tune_process(2);
    zero_examples::bench::main();
}
