//! Training progress on rank 0's stderr: a bar on a terminal, log lines
//! otherwise.

use indicatif::{ProgressBar, ProgressStyle};
use std::io::IsTerminal;

/// A progress bar on a terminal, plain log lines otherwise.
pub(super) struct Progress {
    bar: Option<ProgressBar>,
    enabled: bool,
    every: u64,
    /// What the rate counts: samples/s (MLP) or tokens/s (GPT).
    rate_unit: &'static str,
    /// The last validation loss, shown until the next.
    val_loss: std::cell::Cell<Option<f64>>,
}

impl Progress {
    pub(super) fn new(enabled: bool, steps: u64, rate_unit: &'static str) -> Self {
        let bar = (enabled && std::io::stderr().is_terminal()).then(|| {
            let bar = ProgressBar::new(steps);
            if let Ok(style) = ProgressStyle::with_template(
                "{bar:40} {pos}/{len} steps  {msg}  [{elapsed_precise} < {eta_precise}]",
            ) {
                bar.set_style(style);
            }
            bar
        });
        Self {
            bar,
            enabled,
            every: (steps / 10).max(1),
            rate_unit,
            val_loss: std::cell::Cell::new(None),
        }
    }

    pub(super) fn step(&self, step: u64, loss: f64, rate: f64, val_loss: Option<f64>) {
        if val_loss.is_some() {
            self.val_loss.set(val_loss);
        }
        let unit = self.rate_unit;
        let val = match self.val_loss.get() {
            Some(v) => format!("  val {v:.4}"),
            None => String::new(),
        };
        if let Some(bar) = &self.bar {
            bar.set_position(step);
            bar.set_message(format!("loss {loss:.4}{val}  {rate:.0} {unit}"));
        } else if self.enabled && (step % self.every == 0 || step == 1 || val_loss.is_some()) {
            eprintln!("step {step}: loss {loss:.4}{val}, {rate:.0} {unit}");
        }
    }

    /// Leaves the bar where it is: the run stopped before its end.
    pub(super) fn stop(&self) {
        if let Some(bar) = &self.bar {
            bar.abandon();
        }
    }

    pub(super) fn finish(&self, loss: f64) {
        if let Some(bar) = &self.bar {
            bar.finish_with_message(format!("final loss {loss:.4}"));
        } else if self.enabled {
            eprintln!("done: final loss {loss:.4}");
        }
    }
}
