//! Draws a `train --metrics` file's training and validation loss against
//! the step into a PNG.
//!
//! `cargo run --release -p zero-examples --bin plot -- metrics.jsonl loss.png`

use clap::Parser;
use std::path::PathBuf;
use zero_examples::trainer::LossHistory;

/// Draw the loss curves of a `train --metrics` file as a PNG.
#[derive(Debug, Parser)]
#[command(name = "plot", version, about)]
struct Args {
    /// The metrics file (`train --metrics FILE`, one JSON object per step).
    metrics: PathBuf,
    /// The PNG to write.
    #[arg(default_value = "loss.png")]
    output: PathBuf,
    /// The title above the plot.
    #[arg(long, default_value = "Training loss")]
    title: String,
}

fn main() {
    let args = Args::parse();
    let result = LossHistory::from_metrics(&args.metrics)
        .and_then(|history| history.plot(&args.output, &args.title));
    match result {
        Ok(()) => eprintln!("wrote {}", args.output.display()),
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(1);
        }
    }
}
