//! Benchmark suites, one file each; `main` dispatches on the first argument.

mod optim;
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
            "comm" => {}
            "optim" => optim::run(&mut report),
            "step" => {}
            "gpu" => {}
            other => {
                eprintln!("unknown benchmark suite {other:?}; expected one of {all:?}");
                std::process::exit(2);
            }
        }
    }
    report.print();
}
