//! Preemption: a signal asks the job to stop (Slurm's `--signal`,
//! Kubernetes' SIGTERM, a spot machine's notice), and the ranks agree at a
//! step boundary to stop at the same step, save and exit.

use crate::comm::{Communicator, Host, ReduceOp};
use crate::{Error, Result};
use signal_hook::SigId;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

pub use signal_hook::consts::signal::{SIGINT, SIGTERM};
#[cfg(unix)]
pub use signal_hook::consts::signal::{SIGUSR1, SIGUSR2};

/// The exit status of a process that SIGTERM ended (128 + 15): what a
/// preempted run exits with by default, so that a Kubernetes Job or a
/// restart loop sees an unfinished run, not a success.
pub const PREEMPTED_EXIT_CODE: i32 = 143;

/// Whether to stop at the next step boundary: set by a signal (or by hand),
/// agreed across ranks by [`should_stop`](Preemption::should_stop) (or
/// [`should_stop_with`](Preemption::should_stop_with) over an engine), so that every rank stops at the same step even
/// when only one of them was signalled.
///
/// The signal handlers of [`on_signals`](Preemption::on_signals) only set a
/// flag; the training loop polls it once per step, on every rank at the
/// same point (the agreement is a collective), finishes that step, saves a
/// checkpoint and exits. A second signal exits the process at once, with
/// the exit code given: the save in progress is abandoned, and the
/// previous checkpoint stays loadable (every file is written atomically,
/// the manifest last). Clones share the flag; the handlers are removed
/// when the last clone is dropped.
///
/// Signals are process-wide: ranks that are threads of one process share
/// them. To stop one rank in a test, give it a [`manual`](Preemption::manual)
/// handle and [`request`](Preemption::request) it.
///
/// ```
/// use zero_core::preempt::Preemption;
/// use zero_core::ThreadGroup;
///
/// let results = ThreadGroup::new(2).run(|comm| -> zero_core::Result<u64> {
///     // In a real job: Preemption::on_signals(&[SIGTERM, SIGUSR1], 143)?.
///     let preemption = Preemption::manual();
///     for step in 1.. {
///         // ... one training step ...
///         if zero_core::Communicator::rank(&comm) == 1 && step == 3 {
///             preemption.request(); // only rank 1 is told
///         }
///         if preemption.should_stop(&comm)? {
///             // Save a checkpoint here, then exit with the preemption code.
///             return Ok(step);
///         }
///     }
///     unreachable!()
/// });
/// for result in results {
///     assert_eq!(result??, 3); // every rank stops after step 3
/// }
/// # Ok::<(), zero_core::Error>(())
/// ```
#[derive(Clone)]
pub struct Preemption {
    inner: Arc<Inner>,
}

struct Inner {
    /// Set by a signal handler or [`Preemption::request`].
    flag: Arc<AtomicBool>,
    /// The signals handled, for messages.
    signals: Vec<i32>,
    /// The handlers to remove on drop.
    handlers: Vec<SigId>,
    /// A manual handle that requests itself at this poll (1 for the
    /// first): fault injection for tests.
    request_at_poll: Option<u64>,
    /// Polls so far.
    polls: AtomicU64,
}

impl Drop for Inner {
    fn drop(&mut self) {
        for id in self.handlers.drain(..) {
            signal_hook::low_level::unregister(id);
        }
    }
}

impl std::fmt::Debug for Preemption {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let names: Vec<String> = self.signals().iter().map(|&s| signal_name(s)).collect();
        f.debug_struct("Preemption")
            .field("signals", &names)
            .field("requested", &self.requested())
            .field("request_at_poll", &self.inner.request_at_poll)
            .finish()
    }
}

impl Preemption {
    /// Handles `signals` (e.g. `&[SIGTERM, SIGINT, SIGUSR1]`): the first
    /// asks for a stop at the next step boundary; a second one of them
    /// exits the process at once with `exit_code`
    /// ([`PREEMPTED_EXIT_CODE`] by default in the trainer).
    ///
    /// Fails with [`Error::Signal`] for a signal that cannot be handled
    /// (SIGKILL, SIGSTOP, SIGSEGV, ...).
    pub fn on_signals(signals: &[i32], exit_code: i32) -> Result<Self> {
        let flag = Arc::new(AtomicBool::new(false));
        let mut handlers = Vec::with_capacity(2 * signals.len());
        let unregister = |handlers: &mut Vec<SigId>| {
            for id in handlers.drain(..) {
                signal_hook::low_level::unregister(id);
            }
        };
        if let Some(&signal) = signals
            .iter()
            .find(|s| signal_hook::consts::FORBIDDEN.contains(s))
        {
            return Err(Error::Signal {
                signal: signal_name(signal),
                detail: "a process may not handle it; choose signals such as TERM, INT, USR1"
                    .into(),
            });
        }
        for &signal in signals {
            let registered = (|| {
                // Registered first, so it runs first: on the first signal
                // the flag is still clear; on the second it is set and the
                // process exits.
                handlers.push(signal_hook::flag::register_conditional_shutdown(
                    signal,
                    exit_code,
                    Arc::clone(&flag),
                )?);
                handlers.push(signal_hook::flag::register(signal, Arc::clone(&flag))?);
                Ok::<_, std::io::Error>(())
            })();
            if let Err(e) = registered {
                unregister(&mut handlers);
                return Err(Error::Signal {
                    signal: signal_name(signal),
                    detail: format!(
                        "cannot handle it ({e}); choose signals such as TERM, INT, USR1"
                    ),
                });
            }
        }
        Ok(Self::with(flag, signals.to_vec(), handlers, None))
    }

    /// A handle no signal sets: only [`request`](Preemption::request) does.
    /// For tests, and for loops that decide to stop for reasons of their
    /// own (a time budget, a file that appears).
    pub fn manual() -> Self {
        Self::with(
            Arc::new(AtomicBool::new(false)),
            Vec::new(),
            Vec::new(),
            None,
        )
    }

    /// A [`manual`](Preemption::manual) handle that requests itself at its
    /// `poll`-th agreement (1 for the first): fault injection for tests, so
    /// that a test can stop one rank after a chosen step.
    pub fn requested_at_poll(poll: u64) -> Self {
        Self::with(
            Arc::new(AtomicBool::new(false)),
            Vec::new(),
            Vec::new(),
            Some(poll),
        )
    }

    fn with(
        flag: Arc<AtomicBool>,
        signals: Vec<i32>,
        handlers: Vec<SigId>,
        request_at_poll: Option<u64>,
    ) -> Self {
        Self {
            inner: Arc::new(Inner {
                flag,
                signals,
                handlers,
                request_at_poll,
                polls: AtomicU64::new(0),
            }),
        }
    }

    /// Asks for a stop at the next step boundary, as a signal does.
    pub fn request(&self) {
        self.inner.flag.store(true, Ordering::SeqCst);
    }

    /// Whether this process (this handle) saw a signal or a request. The
    /// ranks may differ: agree with [`should_stop`](Preemption::should_stop)
    /// before acting on it.
    pub fn requested(&self) -> bool {
        self.inner.flag.load(Ordering::SeqCst)
    }

    /// The signals this handle handles.
    pub fn signals(&self) -> &[i32] {
        &self.inner.signals
    }

    /// This rank's vote at a step boundary: whether it was asked to stop.
    /// Counts the poll ([`requested_at_poll`](Preemption::requested_at_poll)).
    pub(crate) fn vote(&self) -> bool {
        let poll = self.inner.polls.fetch_add(1, Ordering::SeqCst) + 1;
        if self.inner.request_at_poll == Some(poll) {
            self.request();
        }
        self.requested()
    }

    /// Whether every rank is to stop now: true if any rank was asked to.
    /// A collective (an all-reduce max of one value): call it on every rank
    /// at the same point, once per step boundary; all ranks get the same
    /// answer. For a communicator an engine owns, use
    /// [`should_stop_with`](Preemption::should_stop_with) (or
    /// `ZeroOptimizer::should_stop`).
    pub fn should_stop<C: Communicator<Memory = Host>>(&self, comm: &C) -> Result<bool> {
        let mut votes = [f32::from(u8::from(self.vote()))];
        comm.all_reduce(&mut votes[..], ReduceOp::Max)?;
        Ok(agreed(votes[0]))
    }

    /// [`should_stop`](Preemption::should_stop) through an all-reduce max
    /// the caller runs (`reduce_max` must reduce its slice across ranks
    /// with [`ReduceOp::Max`]): for an engine,
    /// `preemption.should_stop_with(|votes| engine.all_reduce_host(votes, ReduceOp::Max))`.
    pub fn should_stop_with(
        &self,
        reduce_max: impl FnOnce(&mut [f32]) -> Result<()>,
    ) -> Result<bool> {
        let mut votes = [f32::from(u8::from(self.vote()))];
        reduce_max(&mut votes[..])?;
        Ok(agreed(votes[0]))
    }
}

/// Whether the all-reduced vote says stop.
fn agreed(max_vote: f32) -> bool {
    max_vote > 0.5
}

/// The signal of a name: `TERM`, `SIGTERM` or `term`, or a number.
///
/// Fails with [`Error::Signal`] for a name it does not know.
pub fn signal_from_name(name: &str) -> Result<i32> {
    let trimmed = name.trim();
    if let Ok(number) = trimmed.parse::<i32>() {
        return Ok(number);
    }
    let upper = trimmed.to_ascii_uppercase();
    let bare = upper.strip_prefix("SIG").unwrap_or(&upper);
    NAMED
        .iter()
        .find(|(n, _)| *n == bare)
        .map(|&(_, signal)| signal)
        .ok_or_else(|| Error::Signal {
            signal: name.to_string(),
            detail: format!(
                "unknown signal name; use one of {} (with or without SIG), or a number",
                NAMED.iter().map(|(n, _)| *n).collect::<Vec<_>>().join(", ")
            ),
        })
}

/// `SIGTERM` for 15; the number for a signal without a name here.
pub fn signal_name(signal: i32) -> String {
    NAMED
        .iter()
        .find(|&&(_, s)| s == signal)
        .map_or_else(|| signal.to_string(), |(n, _)| format!("SIG{n}"))
}

/// The signals a job is told to stop with, by name without `SIG`.
#[cfg(unix)]
const NAMED: &[(&str, i32)] = {
    use signal_hook::consts::signal::*;
    &[
        ("TERM", SIGTERM),
        ("INT", SIGINT),
        ("USR1", SIGUSR1),
        ("USR2", SIGUSR2),
        ("HUP", SIGHUP),
        ("QUIT", SIGQUIT),
        ("XCPU", SIGXCPU),
        ("ALRM", SIGALRM),
    ]
};
#[cfg(not(unix))]
const NAMED: &[(&str, i32)] = &[("TERM", SIGTERM), ("INT", SIGINT)];

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ThreadGroup;

    #[cfg(unix)]
    #[test]
    fn names_parse_both_ways() {
        for name in ["TERM", "SIGTERM", "term", " SigTerm ", "15"] {
            assert_eq!(signal_from_name(name).unwrap(), SIGTERM, "{name}");
        }
        assert_eq!(signal_from_name("usr1").unwrap(), SIGUSR1);
        assert_eq!(signal_name(SIGUSR1), "SIGUSR1");
        assert_eq!(signal_name(SIGINT), "SIGINT");
        let err = signal_from_name("TERMINATE").unwrap_err().to_string();
        assert!(err.contains("TERMINATE") && err.contains("USR1"), "{err}");
    }

    #[cfg(unix)]
    #[test]
    fn a_signal_that_cannot_be_caught_is_refused() {
        let err = Preemption::on_signals(&[signal_hook::consts::signal::SIGKILL], 143)
            .unwrap_err()
            .to_string();
        assert!(err.contains("signal 9") && err.contains("TERM"), "{err}");
    }

    #[test]
    fn one_rank_asked_stops_every_rank_at_the_same_boundary() {
        for world_size in [2, 3] {
            let last = world_size - 1;
            let results = ThreadGroup::new(world_size).run(move |comm| -> Result<u64> {
                let rank = Communicator::rank(&comm);
                // Only the last rank is asked, at its 4th poll.
                let preemption = if rank == last {
                    Preemption::requested_at_poll(4)
                } else {
                    Preemption::manual()
                };
                for step in 1..100 {
                    if preemption.should_stop(&comm)? {
                        assert_eq!(preemption.requested(), rank == last);
                        return Ok(step);
                    }
                }
                Ok(0)
            });
            for result in results {
                assert_eq!(result.unwrap().unwrap(), 4, "world size {world_size}");
            }
        }
    }

    #[cfg(unix)]
    #[test]
    fn a_signal_sets_the_flag_and_dropping_the_last_clone_unregisters() {
        // SIGUSR2: no other test of this process sends it, and its default
        // action (terminate) shows if the handler were not in place.
        let preemption = Preemption::on_signals(&[SIGUSR2], 143).unwrap();
        let clone = preemption.clone();
        assert!(!preemption.requested());
        signal_hook::low_level::raise(SIGUSR2).unwrap();
        assert!(clone.requested());
        assert!(format!("{preemption:?}").contains("SIGUSR2"));
        drop(preemption);
        assert_eq!(Arc::strong_count(&clone.inner), 1);
    }
}
