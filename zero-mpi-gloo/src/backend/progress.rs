//! The progress thread: runs the asynchronous collectives of every
//! communicator of the process, one at a time, in the order they were
//! started.
//!
//! One thread per process, not one per communicator: every MPI call holds
//! the process-wide lock, and a collective sits inside MPI (holding it) until
//! its peers join. Two threads issuing collectives on two communicators could
//! take the lock in one order on one rank and in the other order on another,
//! each rank then waiting inside MPI for a peer that waits for the lock. One
//! queue makes the process's issue order its call order, on every
//! communicator, so the orders match across ranks whenever the calls do. A
//! blocking collective first waits for every job queued before it
//! ([`wait_idle`]) for the same reason.

use std::collections::VecDeque;
use std::panic::AssertUnwindSafe;
use std::sync::{Condvar, Mutex, MutexGuard};

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
}

/// The queue and the one condition both sides wait on (a job queued, a job
/// finished).
static QUEUE: Mutex<Queue> = Mutex::new(Queue {
    jobs: VecDeque::new(),
    queued: 0,
    finished: 0,
    thread_started: false,
});
static CHANGED: Condvar = Condvar::new();

/// Queues `job` behind every job queued before it, starting the thread on
/// first use. Gives the job back when the thread cannot be started; the
/// caller then runs it itself (after [`wait_idle`]).
pub(crate) fn submit(job: Job) -> Result<(), Job> {
    let mut queue = lock();
    if !queue.thread_started {
        let spawned = std::thread::Builder::new()
            .name("zero-mpi-progress".into())
            .spawn(run);
        if let Err(e) = spawned {
            tracing::warn!("cannot start the MPI progress thread, async collectives block: {e}");
            return Err(job);
        }
        queue.thread_started = true;
    }
    queue.jobs.push_back(job);
    queue.queued += 1;
    CHANGED.notify_all();
    Ok(())
}

/// Blocks until every job queued before this call has run and been dropped
/// (with it, its hold on its communicator).
pub(crate) fn wait_idle() {
    let mut queue = lock();
    let target = queue.queued;
    while queue.finished < target {
        queue = CHANGED
            .wait(queue)
            .unwrap_or_else(|poisoned| poisoned.into_inner());
    }
}

fn run() {
    loop {
        let job = {
            let mut queue = lock();
            loop {
                if let Some(job) = queue.jobs.pop_front() {
                    break job;
                }
                queue = CHANGED
                    .wait(queue)
                    .unwrap_or_else(|poisoned| poisoned.into_inner());
            }
        };
        // A panicking job (a broken invariant; the panic hook has reported
        // it, and ended the job under `abort_on_panic`) must not take every
        // later job down with the thread. Its `Work` finds the result channel
        // closed and says so.
        let _ = std::panic::catch_unwind(AssertUnwindSafe(job));
        lock().finished += 1;
        CHANGED.notify_all();
    }
}

fn lock() -> MutexGuard<'static, Queue> {
    // The counters and the queue are updated in single statements: a panic
    // cannot leave them half-changed.
    QUEUE
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    /// Jobs run in the order they were queued, a panicking one does not stop
    /// the thread, and `wait_idle` returns only after every earlier job.
    #[test]
    fn jobs_run_in_order_and_survive_a_panic() {
        let ran = Arc::new(Mutex::new(Vec::new()));
        for k in 0..50 {
            let ran = Arc::clone(&ran);
            let job: Job = Box::new(move || {
                if k == 10 {
                    panic!("a job that panics on purpose");
                }
                ran.lock().unwrap_or_else(|p| p.into_inner()).push(k);
            });
            if let Err(job) = submit(job) {
                job();
            }
        }
        wait_idle();
        let ran = ran.lock().unwrap_or_else(|p| p.into_inner()).clone();
        let expected: Vec<i32> = (0..50).filter(|&k| k != 10).collect();
        assert_eq!(ran, expected);
    }
}
