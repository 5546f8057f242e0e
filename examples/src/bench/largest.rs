//! The search behind `bench gpu-largest`: the most layers a model trains
//! with, each size tried in a child process of its own (a size that does
//! not fit may end in an out-of-memory error, or in the host's OOM killer:
//! either way the search goes on).

use std::io::Read;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// How one size fared.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// It trained.
    Trained,
    /// It did not: why (the child's last line of error output, or how it
    /// ended).
    Failed(String),
}

/// The sizes tried, in order, and how each fared.
#[derive(Clone, Debug, Default)]
pub struct Search {
    pub trials: Vec<(usize, Outcome)>,
}

impl Search {
    /// The largest size that trained.
    pub fn largest(&self) -> Option<usize> {
        self.trials
            .iter()
            .filter(|(_, o)| *o == Outcome::Trained)
            .map(|(n, _)| *n)
            .max()
    }

    /// The smallest size that did not train, and why.
    pub fn smallest_failed(&self) -> Option<(usize, &str)> {
        self.trials
            .iter()
            .filter_map(|(n, o)| match o {
                Outcome::Failed(why) => Some((*n, why.as_str())),
                Outcome::Trained => None,
            })
            .min_by_key(|(n, _)| *n)
    }
}

/// The largest size from 1 up that `trains`, assuming that every size
/// below one that trains trains too: starts at `guess`, grows by a quarter
/// while sizes train and shrinks by a quarter while they do not, then
/// bisects between the two until they are within `1/32` of each other (or
/// adjacent). At most `max_trials` sizes are tried; none twice.
pub fn largest_that_trains(
    guess: usize,
    max_trials: usize,
    mut trains: impl FnMut(usize) -> Outcome,
) -> Search {
    let mut search = Search::default();
    let (mut trained, mut failed): (Option<usize>, Option<usize>) = (None, None);
    let mut next = guess.max(1);
    while search.trials.len() < max_trials {
        let outcome = trains(next);
        match outcome {
            Outcome::Trained => trained = Some(trained.map_or(next, |t| t.max(next))),
            Outcome::Failed(_) => failed = Some(failed.map_or(next, |f| f.min(next))),
        }
        search.trials.push((next, outcome));
        next = match (trained, failed) {
            (Some(t), None) => t + (t / 4).max(1),
            (None, Some(1)) => break,
            (None, Some(f)) => (f - (f / 4).max(1)).max(1),
            (Some(t), Some(f)) => {
                if f <= t + 1 || f - t <= t / 32 {
                    break;
                }
                t + (f - t) / 2
            }
            (None, None) => unreachable!("a size was just tried"),
        };
    }
    search
}

/// Runs `program` with `args` in a child process: [`Outcome::Trained`] if
/// it exits with success within `timeout`, otherwise why not (it is killed
/// at the deadline).
pub fn run_trial(program: &std::path::Path, args: &[String], timeout: Duration) -> Outcome {
    let mut child = match Command::new(program)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::inherit())
        .stderr(Stdio::piped())
        .spawn()
    {
        Ok(child) => child,
        Err(e) => return Outcome::Failed(format!("cannot start {}: {e}", program.display())),
    };
    // Drained on a thread of its own, so that a child writing a lot never
    // blocks on a full pipe.
    let (sender, text) = std::sync::mpsc::channel();
    if let Some(mut stderr) = child.stderr.take() {
        std::thread::spawn(move || {
            let mut text = String::new();
            let _ = stderr.read_to_string(&mut text);
            let _ = sender.send(text);
        });
    }
    let deadline = Instant::now() + timeout;
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break Ok(status),
            Ok(None) if Instant::now() >= deadline => {
                let _ = child.kill();
                let _ = child.wait();
                break Err(format!("did not finish within {timeout:?}"));
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(50)),
            Err(e) => break Err(format!("cannot wait for the trial: {e}")),
        }
    };
    // A grandchild still holding the pipe is not waited for long.
    let text = text
        .recv_timeout(Duration::from_secs(5))
        .unwrap_or_default();
    // Echoed, so that the run's log keeps what each trial said.
    eprint!("{text}");
    let last_line = text
        .lines()
        .rev()
        .find(|l| !l.trim().is_empty())
        .unwrap_or("")
        .trim()
        .to_string();
    match status {
        Ok(status) if status.success() => Outcome::Trained,
        Ok(status) => Outcome::Failed(match last_line.is_empty() {
            true => format!("ended with {status}"),
            false => format!("{last_line} ({status})"),
        }),
        Err(why) => Outcome::Failed(why),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A model that trains up to `limit` layers, counting the tries.
    fn up_to(limit: usize, tried: &mut Vec<usize>) -> impl FnMut(usize) -> Outcome + '_ {
        move |n| {
            tried.push(n);
            match n <= limit {
                true => Outcome::Trained,
                false => Outcome::Failed(format!("{n} layers do not fit")),
            }
        }
    }

    #[test]
    fn the_search_finds_the_limit_from_a_guess_below_or_above_it() {
        for (limit, guess) in [(37, 10), (37, 80), (37, 37), (1, 5), (200, 1), (64, 63)] {
            let mut tried = Vec::new();
            let search = largest_that_trains(guess, 40, up_to(limit, &mut tried));
            let found = search.largest().unwrap();
            let (above, why) = search.smallest_failed().unwrap();
            assert!(
                found <= limit && above > limit,
                "limit {limit} guess {guess}"
            );
            // Within 1/32 of the limit, or exact.
            assert!(above - found <= (found / 32).max(1), "{found}..{above}");
            assert_eq!(why, format!("{above} layers do not fit"));
            let mut unique = tried.clone();
            unique.sort_unstable();
            unique.dedup();
            assert_eq!(unique.len(), tried.len(), "a size tried twice: {tried:?}");
        }
    }

    #[test]
    fn the_search_stops_at_its_trial_budget_and_when_nothing_fits() {
        let mut tried = Vec::new();
        let search = largest_that_trains(1, 3, up_to(1_000, &mut tried));
        assert_eq!(tried, [1, 2, 3]);
        assert_eq!(search.largest(), Some(3));
        assert_eq!(search.smallest_failed(), None);

        let mut tried = Vec::new();
        let search = largest_that_trains(8, 40, up_to(0, &mut tried));
        assert_eq!(search.largest(), None);
        assert_eq!(search.smallest_failed().map(|(n, _)| n), Some(1));
        assert_eq!(tried, [8, 6, 5, 4, 3, 2, 1]);
    }

    fn sh(script: &str, timeout: Duration) -> Outcome {
        run_trial(
            std::path::Path::new("/bin/sh"),
            &["-c".to_string(), script.to_string()],
            timeout,
        )
    }

    #[test]
    fn a_trial_is_its_child_processes_exit_with_its_last_error_line() {
        let long = Duration::from_secs(30);
        assert_eq!(sh("echo fine >&2; exit 0", long), Outcome::Trained);
        let Outcome::Failed(why) = sh("echo first >&2; echo 'out of memory' >&2; exit 3", long)
        else {
            panic!("a failing child counted as trained");
        };
        assert!(why.starts_with("out of memory ("), "{why}");
        let Outcome::Failed(why) = sh("kill -9 $$", long) else {
            panic!("a killed child counted as trained");
        };
        assert!(why.contains("signal"), "{why}");
    }

    #[test]
    fn a_trial_past_its_deadline_is_killed_and_fails() {
        let started = Instant::now();
        let outcome = sh("exec sleep 20", Duration::from_millis(300));
        assert!(started.elapsed() < Duration::from_secs(10));
        assert_eq!(
            outcome,
            Outcome::Failed("did not finish within 300ms".into())
        );
    }
}
