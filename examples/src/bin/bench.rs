//! Benchmarks that print figures: a human table, then one JSON object per
//! figure on its own line (`{"name": ..., "value": ..., "unit": ...}`).
//!
//! `bench comm`, `bench optim`, `bench step`, `bench gpu`; no argument runs all
//! that this build supports.

fn main() {
    zero_examples::bench::main();
}
