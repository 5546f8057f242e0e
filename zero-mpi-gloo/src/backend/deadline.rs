//! Deadlines for MPI collectives. MPI has none: a collective that a peer never
//! joins waits forever. A watchdog thread (one per process, started with the
//! first communicator) checks every in-flight collective a few times a second
//! and ends the job with `MPI_Abort`, naming the collective, when one has run
//! past its communicator's deadline.

use super::abort_world;
use std::sync::{Arc, Mutex, Once, Weak};
use std::time::{Duration, Instant};

/// How often the watchdog looks.
const PERIOD: Duration = Duration::from_millis(200);

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
    loop {
        std::thread::sleep(PERIOD);
        let mut watched = lock(&WATCHED);
        watched.retain(|w| w.strong_count() > 0);
        for watch in watched.iter().filter_map(Weak::upgrade) {
            let overdue = lock(&watch.in_flight)
                .as_ref()
                .filter(|f| f.since.elapsed() > f.timeout)
                .map(|f| (f.op, f.seq, f.since.elapsed().as_secs_f64()));
            if let Some((op, seq, waited)) = overdue {
                // MPI_Abort while the collective's thread is inside MPI: the
                // standard asks MPI_THREAD_MULTIPLE for that, Open MPI and
                // MPICH end the job either way, and the alternative is a hang.
                abort_world(
                    watch.world_rank,
                    &format!(
                        "{op} #{seq} did not complete within {waited:.1} s (rank {} of a \
                         communicator of {} ranks): a peer rank failed, hangs, or issued a \
                         different collective; ending the job",
                        watch.rank, watch.world_size
                    ),
                );
            }
        }
    }
}
