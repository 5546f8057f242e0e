//! Benchmark suites, one file each; `main` dispatches on the first argument.

#[cfg(feature = "mpi")]
mod mpi;
mod report;
pub use report::{Figure, Report};

/// Runs the suite named by the first command-line argument (all if none).
pub fn main() {
    let which: Vec<String> = std::env::args().skip(1).collect();
    let all = ["comm", "optim", "step", "gpu"];
    let selected: Vec<&str> = if which.is_empty() {
        all.to_vec()
    } else {
        which.iter().map(String::as_str).collect()
    };
    let mut report = Report::default();
    for name in selected {
        match name {
            "comm" => {
                #[cfg(feature = "mpi")]
                mpi::run_if_launched(&mut report);
            }
            "optim" => {}
            "step" => {}
            "gpu" => {}
            other => {
                eprintln!("unknown benchmark suite {other:?}; expected one of {all:?}");
                std::process::exit(2);
            }
        }
    }
    // Under mpirun every rank runs the suites; one report is enough.
    #[cfg(feature = "mpi")]
    if !mpi::is_printing_rank() {
        return;
    }
    report.print();
}
