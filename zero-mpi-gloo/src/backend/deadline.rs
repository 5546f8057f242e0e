//! Deadlines for MPI collectives. MPI has none: a collective that a peer never
//! joins waits forever. A watchdog thread (one per process, started with the
//! first communicator) checks every in-flight collective a few times a second
//! and ends the job with `MPI_Abort`, naming the collective, when one has run
//! past its communicator's deadline.
//!
//! The deadline counts time this process spent running. While the process is
//! frozen (`kill -STOP`, a job suspended by the scheduler, a paused VM) the
//! monotonic clock keeps going but nobody waits on anybody; counting that
//! time would end a suspended job the moment it resumes, and make a stopped
//! rank blame its peers for its own absence.

use super::abort::abort_world;
use std::sync::{Arc, Mutex, Once, Weak};
use std::time::{Duration, Instant};

/// How often the watchdog looks.
const PERIOD: Duration = Duration::from_millis(200);

/// A look this much later than planned means the process was frozen, not
/// merely scheduled late (even an oversubscribed node runs every thread
/// many times a second).
const FROZEN_AFTER: Duration = Duration::from_secs(1);

static WATCHED: Mutex<Vec<Weak<Watch>>> = Mutex::new(Vec::new());
static START: Once = Once::new();

/// What one communicator has in flight.
#[derive(Debug)]
pub(crate) struct Watch {
    pub(crate) world_rank: usize,
    pub(crate) rank: usize,
    pub(crate) world_size: usize,
    pub(crate) in_flight: Mutex<Option<InFlight>>,
}

/// One collective in flight.
#[derive(Debug)]
pub(crate) struct InFlight {
    pub(crate) op: &'static str,
    pub(crate) seq: u64,
    pub(crate) since: Instant,
    pub(crate) timeout: Duration,
}

impl Watch {
    /// A new watch, registered with the watchdog (started on first use).
    pub(crate) fn register(world_rank: usize, rank: usize, world_size: usize) -> Arc<Watch> {
        let watch = Arc::new(Watch {
            world_rank,
            rank,
            world_size,
            in_flight: Mutex::new(None),
        });
        START.call_once(|| {
            let spawned = std::thread::Builder::new()
                .name("zero-mpi-watchdog".into())
                .spawn(watchdog);
            if let Err(e) = spawned {
                tracing::warn!("cannot start the MPI watchdog, collectives have no deadline: {e}");
            }
        });
        lock(&WATCHED).push(Arc::downgrade(&watch));
        watch
    }

    /// Marks a collective as in flight (or nothing when there is no deadline).
    pub(crate) fn start(&self, op: &'static str, seq: u64, timeout: Option<Duration>) {
        if let Some(timeout) = timeout {
            *lock(&self.in_flight) = Some(InFlight {
                op,
                seq,
                since: Instant::now(),
                timeout,
            });
        }
    }

    /// Marks the collective as done.
    pub(crate) fn finish(&self) {
        *lock(&self.in_flight) = None;
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // Plain data, valid whatever a panicking holder was doing.
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn watchdog() {
    let mut last_look = Instant::now();
    loop {
        std::thread::sleep(PERIOD);
        let now = Instant::now();
        let late = now.duration_since(last_look).saturating_sub(PERIOD);
        last_look = now;
        let frozen = (late >= FROZEN_AFTER).then_some(late);
        let mut watched = lock(&WATCHED);
        watched.retain(|w| w.strong_count() > 0);
        for watch in watched.iter().filter_map(Weak::upgrade) {
            let overdue = {
                let mut in_flight = lock(&watch.in_flight);
                let Some(f) = in_flight.as_mut() else {
                    continue;
                };
                if let Some(frozen) = frozen {
                    // Not waiting while frozen. A collective that began after
                    // the thaw gets at most the rest of this period for free.
                    f.since = (f.since + frozen).min(now);
                }
                let waited = now.saturating_duration_since(f.since);
                (waited > f.timeout).then_some((f.op, f.seq, f.timeout))
            };
            if let Some((op, seq, timeout)) = overdue {
                // MPI_Abort while the collective's thread is inside MPI: the
                // standard asks MPI_THREAD_MULTIPLE for that, Open MPI and
                // MPICH end the job either way, and the alternative is a hang.
                abort_world(
                    watch.world_rank,
                    &format!(
                        "{op} #{seq} did not complete within the {:.1} s deadline (rank {} \
                         of {} in its communicator): a peer rank crashed, hangs, is stopped, \
                         or issued a different collective; ending the job. Check that every \
                         rank is still running (not stopped, swapped out or stuck in I/O) and \
                         that all run the same program and configuration; if a rank can \
                         legitimately keep the others waiting this long, raise the deadline \
                         (`MpiComm::with_timeout`; `train --timeout-s`)",
                        timeout.as_secs_f64(),
                        watch.rank,
                        watch.world_size
                    ),
                );
            }
        }
    }
}
