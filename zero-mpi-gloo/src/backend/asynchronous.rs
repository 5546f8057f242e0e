//! The asynchronous collectives: the input copied into buffers the job owns,
//! the collective run by the progress thread, the result copied out when the
//! [`Work`] is waited (see "Asynchronous forms" on [`MpiComm`]).

use super::{other_threads_allowed, progress, Entered, Group, MpiComm};
use crate::error::Error;
use std::sync::mpsc::{self, TryRecvError};
use std::sync::Arc;
use zero_core::{Element, ReduceOp, Result, Work};

impl MpiComm {
    pub(super) fn start_all_reduce<'a, T: Element>(
        &'a self,
        buf: &'a mut [T],
        op: ReduceOp,
    ) -> Result<Work<'a>> {
        self.count_all_reduce(buf);
        self.start(
            "all_reduce_async",
            buf.to_vec(),
            move |group, staged| group.all_reduce(staged, op),
            move |staged| buf.copy_from_slice(&staged),
        )
    }

    pub(super) fn start_reduce_scatter<'a, T: Element>(
        &'a self,
        send: &'a [T],
        recv: &'a mut [T],
        op: ReduceOp,
    ) -> Result<Work<'a>> {
        const OP: &str = "reduce_scatter_async";
        self.check_reduce_scatter(OP, send, recv)?;
        self.count_reduce_scatter(recv);
        self.start(
            OP,
            (send.to_vec(), vec![T::default(); recv.len()]),
            move |group, (send, result)| group.reduce_scatter(send, result, op),
            move |(_, result)| recv.copy_from_slice(&result),
        )
    }

    pub(super) fn start_all_gather<'a, T: Element>(
        &'a self,
        send: &'a [T],
        recv: &'a mut [T],
    ) -> Result<Work<'a>> {
        const OP: &str = "all_gather_async";
        self.check_all_gather(OP, send, recv)?;
        self.count_all_gather(send);
        self.start(
            OP,
            (send.to_vec(), vec![T::default(); recv.len()]),
            move |group, (send, result)| group.all_gather(send, result),
            move |(_, result)| recv.copy_from_slice(&result),
        )
    }

    pub(super) fn start_broadcast<'a, T: Element>(
        &'a self,
        buf: &'a mut [T],
        root: usize,
    ) -> Result<Work<'a>> {
        const OP: &str = "broadcast_async";
        self.check_root(OP, root)?;
        self.count_broadcast(buf, root);
        // Only the root's values are read.
        let staged = if self.group.rank == root {
            buf.to_vec()
        } else {
            vec![T::default(); buf.len()]
        };
        self.start(
            OP,
            staged,
            move |group, staged| group.broadcast(staged, root),
            move |staged| buf.copy_from_slice(&staged),
        )
    }

    /// Queues collective `op` on the progress thread. `staged` (owned copies
    /// of the caller's buffers) moves into the job, which runs `collective`
    /// on it under the MPI lock and its deadline; the returned `Work` hands
    /// the staged buffers back to `deliver` (which copies the result into the
    /// caller's buffers) once the job has run.
    ///
    /// The job owns everything MPI touches: the staged buffers and a share of
    /// the communicator. A leaked `Work` only leaves a result nobody reads.
    fn start<'a, S: Send + 'static>(
        &'a self,
        op: &'static str,
        staged: S,
        collective: impl FnOnce(&Group, &mut S) -> Result<()> + Send + 'static,
        mut deliver: impl FnMut(S) + Send + 'a,
    ) -> Result<Work<'a>> {
        let seq = self.next_seq();
        let group = Group::clone(&self.group);
        let watch = Arc::clone(&self.watch);
        let (threading, timeout) = (self.threading, self.timeout);
        let (done, outcome) = mpsc::sync_channel::<Result<S>>(1);
        let job: progress::Job = Box::new(move || {
            let mut staged = staged;
            let result =
                Entered::begin(group.calls(threading), threading, &watch, op, seq, timeout)
                    .map_err(zero_core::Error::from)
                    .and_then(|_entered| collective(&group, &mut staged));
            // The receiver is gone when the `Work` was leaked or dropped
            // during a panic: nobody wants the result then.
            let _ = done.send(result.map(|()| staged));
        });
        if other_threads_allowed(threading) {
            if let Err(job) = self.group.comm.progress.submit(job) {
                // No progress thread: run here, in order, like a blocking call.
                self.group.comm.progress.wait_idle();
                job();
            }
        } else {
            // Only this (the main) thread may call MPI: run to completion.
            self.group.comm.progress.wait_idle();
            job();
        }
        Ok(Work::new(move |block| {
            let result = if block {
                outcome.recv().map_err(|_| lost(op, seq))?
            } else {
                match outcome.try_recv() {
                    Ok(result) => result,
                    Err(TryRecvError::Empty) => return Ok(false),
                    Err(TryRecvError::Disconnected) => return Err(lost(op, seq)),
                }
            };
            deliver(result?);
            Ok(true)
        }))
    }
}

fn lost(op: &'static str, seq: u64) -> zero_core::Error {
    Error::AsyncLost { op, seq }.into()
}
