//! The trainer: a byte-level GPT on text (`--model gpt`) or an MLP
//! classifier, trained with ZeRO sharded data parallelism.
//!
//! `cargo run --release -p zero-examples --bin train -- --model gpt --sample 300 --plot loss.png`

use zero_examples::trainer::{self, Args, TrainError};

/// Counts what the process allocates (`--metrics`' `peak_heap_bytes`,
/// `bench memory`).
#[global_allocator]
static HEAP: zero_examples::heap::CountingAllocator = zero_examples::heap::CountingAllocator;

fn main() {
    let args = match Args::parse_with_config(std::env::args_os()) {
        Ok(args) => args,
        Err(TrainError::CommandLine(e)) => e.exit(),
        Err(e) => {
            eprintln!("error: {e}");
            // clap's code for a usage error.
            std::process::exit(2);
        }
    };
    zero_examples::tune_process(args.ranks_in_process());
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_writer(std::io::stderr)
        .init();
    if let Err(e) = trainer::run(&args) {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}
