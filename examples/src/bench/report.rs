//! Collects figures and prints them as a table and as JSON lines.

use serde::Serialize;

/// One measured figure.
#[derive(Clone, Debug, Serialize)]
pub struct Figure {
    /// Dotted name, e.g. `comm.allreduce_8b_us`.
    pub name: String,
    /// The value.
    pub value: f64,
    /// Its unit (`ratio`, `us`, `GB/s`, `bytes`).
    pub unit: String,
    /// The goal, as text, when there is one (`<= 2.0`).
    #[serde(skip)]
    pub goal: Option<String>,
}

/// The figures of one benchmark run, and the cases that failed.
#[derive(Debug, Default)]
pub struct Report {
    figures: Vec<Figure>,
    failures: Vec<String>,
}

impl Report {
    /// Records a figure, and prints it at once on stderr (a run stopped
    /// before [`Report::print`] keeps what it measured).
    pub fn add(&mut self, name: &str, value: f64, unit: &str, goal: Option<&str>) {
        eprintln!("measured {name} = {value:.6} {unit}");
        self.figures.push(Figure {
            name: name.to_string(),
            value,
            unit: unit.to_string(),
            goal: goal.map(str::to_string),
        });
    }

    /// Records a case that failed (`what` failed: `error`), and prints it at
    /// once on stderr; the run goes on, [`Report::print`] lists it again
    /// and `bench` exits with status 1.
    pub fn failed(&mut self, what: &str, error: impl std::fmt::Display) {
        let line = format!("{what} failed: {error}");
        eprintln!("{line}");
        self.failures.push(line);
    }

    /// The cases that failed, as [`Report::failed`] recorded them.
    pub fn failures(&self) -> &[String] {
        &self.failures
    }

    /// Prints the human table, then one JSON object per figure per line,
    /// then the failed cases (on stderr).
    pub fn print(&self) {
        println!("{:<36} {:>14} {:<8} goal", "figure", "value", "unit");
        for f in &self.figures {
            println!(
                "{:<36} {:>14.4} {:<8} {}",
                f.name,
                f.value,
                f.unit,
                f.goal.as_deref().unwrap_or("")
            );
        }
        for f in &self.figures {
            match serde_json::to_string(f) {
                Ok(line) => println!("{line}"),
                Err(e) => eprintln!("cannot serialize figure {}: {e}", f.name),
            }
        }
        if !self.failures.is_empty() {
            eprintln!("{} case(s) failed:", self.failures.len());
            for line in &self.failures {
                eprintln!("  {line}");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn failures_are_kept_beside_the_figures() {
        let mut report = Report::default();
        report.add("a.b", 1.0, "ratio", None);
        report.failed("case x", "no device");
        assert_eq!(report.failures(), ["case x failed: no device"]);
        assert_eq!(report.figures.len(), 1);
    }
}
