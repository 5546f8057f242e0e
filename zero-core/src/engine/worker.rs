//! The engine's communication thread: one per engine, started the first
//! time a step or backward pass overlaps its collectives, and kept for the
//! engine's life. It runs tasks in the order they are sent, with a memory
//! of its own ([`ShardMemory::fork`](super::ShardMemory::fork)); what a task
//! needs of the engine's buffers is moved in with it and comes back with
//! its result. Every task is sent only once the engine's own collectives
//! of the moment are issued, so the thread never pairs a collective
//! differently from the peers' threads.

use std::sync::mpsc::{self, Receiver, Sender, SyncSender};
use std::thread::JoinHandle;

type Task<M> = Box<dyn FnOnce(&mut M) + Send>;

pub(super) struct CommWorker<M> {
    tasks: Sender<Task<M>>,
    handle: JoinHandle<()>,
}

impl<M: Send + 'static> CommWorker<M> {
    /// Starts the thread of rank `rank` with `memory`.
    pub fn start(memory: M, rank: usize) -> std::io::Result<Self> {
        let (tasks, queue) = mpsc::channel::<Task<M>>();
        let handle = std::thread::Builder::new()
            .name(format!("zero-comm-{rank}"))
            .spawn(move || {
                let mut memory = memory;
                for task in queue {
                    task(&mut memory);
                }
            })?;
        Ok(Self { tasks, handle })
    }

    /// Starts the thread in `slot` with `fork`'s memory unless it runs;
    /// `false` when the memory runs no collectives off the caller's thread
    /// (`fork` gives none) or no thread could be started (then the
    /// collectives run on the caller's thread, in the same order).
    pub fn ensure(slot: &mut Option<Self>, fork: impl FnOnce() -> Option<M>, rank: usize) -> bool {
        if slot.as_ref().is_some_and(Self::alive) {
            return true;
        }
        let Some(memory) = fork() else {
            return false;
        };
        match Self::start(memory, rank) {
            Ok(worker) => {
                *slot = Some(worker);
                true
            }
            Err(e) => {
                tracing::warn!("no communication thread ({e}); communicating on this thread");
                false
            }
        }
    }

    /// Whether the thread still runs (a task that panicked ended it).
    pub fn alive(&self) -> bool {
        !self.handle.is_finished()
    }

    /// Runs `f` on `payload` after the tasks sent before; `Err(payload)`
    /// back if the thread is gone, so that nothing moved in is lost.
    pub fn run<P, R>(
        &self,
        payload: P,
        f: impl FnOnce(&mut M, P) -> R + Send + 'static,
    ) -> Result<Ticket<R>, P>
    where
        P: Send + 'static,
        R: Send + 'static,
    {
        let (payload_tx, payload_rx) = mpsc::sync_channel::<P>(1);
        let (result_tx, result_rx): (SyncSender<R>, Receiver<R>) = mpsc::sync_channel(1);
        let task: Task<M> = Box::new(move |memory| {
            if let Ok(payload) = payload_rx.recv() {
                // The engine may have stopped waiting (dropped mid-pass).
                let _ = result_tx.send(f(memory, payload));
            }
        });
        if self.tasks.send(task).is_err() {
            return Err(payload);
        }
        payload_tx.send(payload).map_err(|e| e.0)?;
        Ok(Ticket(result_rx))
    }
}

/// A task's result, once it has run.
pub(super) struct Ticket<R>(Receiver<R>);

impl<R> Ticket<R> {
    /// Waits for the result; `None` if the task panicked (which ends the
    /// thread; the next use starts another).
    pub fn wait(self) -> Option<R> {
        self.0.recv().ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tasks_run_in_order_on_one_thread_and_a_panic_ends_it() {
        let worker = CommWorker::start(Vec::<usize>::new(), 0).expect("thread");
        let first = worker.run(1, |seen: &mut Vec<usize>, x| {
            seen.push(x);
            std::thread::current().id()
        });
        let second = worker.run(2, |seen: &mut Vec<usize>, x| {
            seen.push(x);
            (seen.clone(), std::thread::current().id())
        });
        let first = first.ok().and_then(Ticket::wait).expect("first ran");
        let (seen, second) = second.ok().and_then(Ticket::wait).expect("second ran");
        assert_eq!(seen, vec![1, 2], "in the order sent, on one memory");
        assert_eq!(first, second, "on one thread");
        assert_ne!(first, std::thread::current().id());

        let panicked = worker.run((), |_: &mut Vec<usize>, ()| -> usize {
            panic!("task failed")
        });
        assert!(
            panicked.ok().and_then(Ticket::wait).is_none(),
            "a panic is no result"
        );
        while worker.alive() {
            std::thread::yield_now();
        }
        let payload = vec![7u8; 3];
        match worker.run(payload, |_: &mut Vec<usize>, p| p.len()) {
            Err(back) => assert_eq!(back, vec![7u8; 3], "the payload comes back"),
            Ok(_) => panic!("a task was accepted by a thread that is gone"),
        }
    }
}
