//! The progress threads: each runs the asynchronous collectives queued on
//! it, one at a time, in the order they were started.
//!
//! Under `MPI_THREAD_SERIALIZED` there is one for the whole process, not one
//! per communicator: every MPI call holds the process-wide lock, and a
//! collective sits inside MPI (holding it) until its peers join. Two threads
//! issuing collectives on two communicators could take the lock in one
//! order on one rank and in the other order on another, each rank then
//! waiting inside MPI for a peer that waits for the lock. One queue makes
//! the process's issue order its call order, on every communicator, so the
//! orders match across ranks whenever the calls do. A blocking collective
//! first waits for every job queued before it ([`Progress::wait_idle`]) for
//! the same reason.
//!
//! Under `MPI_THREAD_MULTIPLE` each communicator has its own (a collective
//! holds only its communicator's lock): the order that must match across
//! ranks is then each communicator's, and one communicator's collective
//! waiting for its peers holds up no other's.

use std::collections::VecDeque;
use std::panic::AssertUnwindSafe;
use std::sync::{Arc, Condvar, LazyLock, Mutex, MutexGuard};

/// An asynchronous collective: owns everything it touches (staged copies of
/// the caller's buffers, its communicator), so it stays sound when the
/// caller's `Work` is leaked.
pub(crate) type Job = Box<dyn FnOnce() + Send + 'static>;

struct Queue {
    jobs: VecDeque<Job>,
    /// Jobs queued so far, and jobs run (and dropped) so far.
    queued: u64,
    finished: u64,
    thread_started: bool,
    /// No more jobs will come: the thread ends once the queue is empty.
    closed: bool,
}

/// A queue of asynchronous collectives and the thread that runs them.
pub(crate) struct Progress {
    queue: Mutex<Queue>,
    /// The one condition both sides wait on (a job queued, a job finished).
    changed: Condvar,
}

/// The process's queue (`MPI_THREAD_SERIALIZED` and below).
static PROCESS: LazyLock<Arc<Progress>> = LazyLock::new(|| Arc::new(Progress::new()));

impl Progress {
    fn new() -> Self {
        Self {
            queue: Mutex::new(Queue {
                jobs: VecDeque::new(),
                queued: 0,
                finished: 0,
                thread_started: false,
                closed: false,
            }),
            changed: Condvar::new(),
        }
    }

    /// The process's queue.
    pub(crate) fn process() -> Arc<Progress> {
        Arc::clone(&PROCESS)
    }

    /// A queue of one communicator's own (`MPI_THREAD_MULTIPLE`); close it
    /// ([`Progress::close`]) when the communicator goes.
    pub(crate) fn own() -> Arc<Progress> {
        Arc::new(Progress::new())
    }

    /// Queues `job` behind every job queued on this queue before it,
    /// starting the thread on first use. Gives the job back when the thread
    /// cannot be started; the caller then runs it itself (after
    /// [`Progress::wait_idle`]).
    pub(crate) fn submit(self: &Arc<Self>, job: Job) -> Result<(), Job> {
        let mut queue = self.lock();
        if !queue.thread_started {
            let progress = Arc::clone(self);
            let spawned = std::thread::Builder::new()
                .name("zero-mpi-progress".into())
                .spawn(move || progress.run());
            if let Err(e) = spawned {
                tracing::warn!(
                    "cannot start the MPI progress thread, async collectives block: {e}"
                );
                return Err(job);
            }
            queue.thread_started = true;
        }
        queue.jobs.push_back(job);
        queue.queued += 1;
        self.changed.notify_all();
        Ok(())
    }

    /// Blocks until every job queued on this queue before this call has run
    /// and been dropped (with it, its hold on its communicator).
    pub(crate) fn wait_idle(&self) {
        let mut queue = self.lock();
        let target = queue.queued;
        while queue.finished < target {
            queue = self
                .changed
                .wait(queue)
                .unwrap_or_else(|poisoned| poisoned.into_inner());
        }
    }

    /// Ends the thread once the jobs queued so far have run.
    pub(crate) fn close(&self) {
        self.lock().closed = true;
        self.changed.notify_all();
    }

    fn run(&self) {
        loop {
            let job = {
                let mut queue = self.lock();
                loop {
                    if let Some(job) = queue.jobs.pop_front() {
                        break job;
                    }
                    if queue.closed {
                        return;
                    }
                    queue = self
                        .changed
                        .wait(queue)
                        .unwrap_or_else(|poisoned| poisoned.into_inner());
                }
            };
            // A panicking job (a broken invariant; the panic hook has
            // reported it, and ended the job under `abort_on_panic`) must not
            // take every later job down with the thread. Its `Work` finds the
            // result channel closed and says so.
            let _ = std::panic::catch_unwind(AssertUnwindSafe(job));
            self.lock().finished += 1;
            self.changed.notify_all();
        }
    }

    fn lock(&self) -> MutexGuard<'_, Queue> {
        // The counters and the queue are updated in single statements: a
        // panic cannot leave them half-changed.
        self.queue
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    /// Jobs run in the order they were queued, a panicking one does not stop
    /// the thread, and `wait_idle` returns only after every earlier job; on
    /// the process's queue and on a communicator's own.
    #[test]
    fn jobs_run_in_order_and_survive_a_panic() {
        for progress in [Progress::process(), Progress::own()] {
            let ran = Arc::new(Mutex::new(Vec::new()));
            for k in 0..50 {
                let ran = Arc::clone(&ran);
                let job: Job = Box::new(move || {
                    if k == 10 {
                        panic!("a job that panics on purpose");
                    }
                    ran.lock().unwrap_or_else(|p| p.into_inner()).push(k);
                });
                if let Err(job) = progress.submit(job) {
                    job();
                }
            }
            progress.wait_idle();
            let ran = ran.lock().unwrap_or_else(|p| p.into_inner()).clone();
            let expected: Vec<i32> = (0..50).filter(|&k| k != 10).collect();
            assert_eq!(ran, expected);
        }
    }

    /// A closed queue's thread ends once its jobs have run.
    #[test]
    fn a_closed_queue_ends_its_thread_after_its_jobs() {
        let progress = Progress::own();
        let ran = Arc::new(Mutex::new(0));
        for _ in 0..5 {
            let ran = Arc::clone(&ran);
            let job: Job = Box::new(move || {
                std::thread::sleep(std::time::Duration::from_millis(2));
                *ran.lock().unwrap_or_else(|p| p.into_inner()) += 1;
            });
            assert!(progress.submit(job).is_ok(), "the thread starts");
        }
        progress.close();
        // The thread holds the only other handle until it ends.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while Arc::strong_count(&progress) > 1 {
            assert!(
                std::time::Instant::now() < deadline,
                "the thread did not end"
            );
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        assert_eq!(*ran.lock().unwrap_or_else(|p| p.into_inner()), 5);
    }
}
