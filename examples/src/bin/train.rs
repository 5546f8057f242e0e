//! The trainer: a byte-level GPT on text (`--model gpt`) or an MLP
//! classifier, trained with ZeRO sharded data parallelism.
//!
//! `cargo run --release -p zero-examples --bin train -- --model gpt --sample 300 --plot loss.png`

use zero_examples::trainer::{self, Args, Backend, Outcome, TrainError};

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
    match trainer::run(&args) {
        Ok(summary) => {
            // A preempted run is unfinished: a restart loop or a Kubernetes
            // Job must not see a success.
            if let Outcome::Preempted { step, checkpoint } = &summary.outcome {
                // Under MPI, rank 0 said it before the ranks' last barrier.
                if summary.rank == 0 && args.backend != Backend::Mpi {
                    let argv = std::env::args_os();
                    let message =
                        trainer::preempted_message(&args, *step, checkpoint.as_deref(), argv);
                    eprintln!("{message}");
                }
                std::process::exit(args.preempt_exit_code);
            }
        }
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(1);
        }
    }
}
