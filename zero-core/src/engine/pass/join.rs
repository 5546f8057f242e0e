//! The end of a pass: every reduction waited for (or run, when they were
//! queued), the buffers and targets back where the engine keeps them.

use super::handover::PassParts;
use super::BackwardPass;
use crate::comm::Communicator;
use crate::engine::reduce::{
    land, write_held, Back, BucketMap, EarlyStep, Held, HostSteps, Job, Reducer, Reduction,
    Returns, Targets,
};
use crate::engine::shard_memory::deferral;
use crate::engine::worker::Ticket;
use crate::engine::ShardMemory;
use crate::{Element, Error, Result};

/// What a joined pass gives back beyond the buffers: the optimizer and
/// the shard lent to step early, offload's step thread if it goes on with
/// its last buckets, and the first failure.
pub(in crate::engine) struct Joined<T: Element, B> {
    pub early: Option<EarlyStep<T, B>>,
    pub host_steps: Option<Box<HostSteps<T, B>>>,
    pub result: Result<()>,
}

impl<T: Element, C: Communicator, M: ShardMemory<T, C>> PassParts<'_, T, C, M> {
    /// Waits for every reduction of `pass` (running them here if they were
    /// queued) and puts its buffers and targets back. The outer error is a
    /// communication thread that panicked (the buffers it held are lost).
    pub fn join(&mut self, mut pass: BackwardPass<T, M::Buffer>) -> Result<Joined<T, M::Buffer>> {
        // Buffers still open (a pass abandoned halfway) go back to the pool.
        self.buffers.pool.extend(pass.open.drain(..).flatten());
        self.buffers.pool.extend(pass.late.drain(..).flatten());
        let lands = pass.schedule.lands;
        let mut host_steps = None;
        let (mut targets, result) = match pass.reducer {
            Reducer::Queued {
                targets,
                map,
                queue,
            } => self.reduce_queued(targets, queue, &map, lands),
            Reducer::Inline {
                targets,
                map,
                queue,
                held,
                steps,
                result,
            } => {
                // `launch_rest` ran every queued job (none is left after a
                // failure stopped it either: they were never issued).
                self.buffers
                    .pool
                    .extend(queue.into_iter().map(|job| job.buffer));
                let (mut targets, result) = self.join_inline(targets, &map, held, result);
                if let Some(mut steps) = steps {
                    // The thread goes on with its last buckets, reading the
                    // gradient shard: held with it until it is finished.
                    steps.end_backward(targets.shard.take());
                    host_steps = Some(steps);
                }
                (targets, result)
            }
            Reducer::Thread {
                jobs,
                returned,
                ticket,
            } => {
                drop(jobs);
                self.join_thread(returned, ticket, lands)?
            }
        };
        if targets.full.is_some() {
            self.buffers.full_grads = targets.full.take();
        }
        self.buffers.grad_shard = targets.shard.take();
        self.buffers.scratch = targets.scratch.take();
        Ok(Joined {
            early: targets.early,
            host_steps,
            result,
        })
    }

    /// Ends an inline pass: settles its reductions and writes what they
    /// held.
    fn join_inline(
        &mut self,
        mut targets: Targets<T, M::Buffer>,
        map: &BucketMap,
        mut held: Vec<Held<M::Buffer>>,
        result: Result<()>,
    ) -> (Targets<T, M::Buffer>, Result<()>) {
        // Settled even after a failure: it ends the deferral.
        let settled = deferral(&mut *self.memory).and_then(|d| d.settle(self.comm));
        let mut result = result.and(settled);
        if result.is_ok() {
            let mut reduction = Reduction {
                comm: self.comm,
                replicas: self.replicas,
                memory: &mut *self.memory,
                map,
                targets: &mut targets,
            };
            result = write_held(
                &mut reduction,
                &mut self.buffers.pool,
                &mut held,
                usize::MAX,
            );
        } else {
            self.buffers.pool.extend(held.into_iter().map(|h| h.buffer));
        }
        (targets, result)
    }

    /// Ends a pass on the communication thread: waits for its task and
    /// lands the buckets still coming back (into the full buffer when the
    /// pass `lands`).
    #[allow(clippy::type_complexity)]
    fn join_thread(
        &mut self,
        mut returned: Returns<M::Buffer>,
        ticket: Ticket<(Targets<T, M::Buffer>, Result<()>)>,
        lands: bool,
    ) -> Result<(Targets<T, M::Buffer>, Result<()>)> {
        let joined = ticket.wait();
        let mut landed = Ok(());
        while let Some(back) = returned.next(false) {
            let written = self.land(back, lands);
            landed = landed.and(written.map(drop));
        }
        match joined {
            Some((targets, result)) => Ok((targets, result.and(landed))),
            None => Err(Error::State(
                "the communication thread panicked; the engine's gradient buffers are lost, \
                 rebuild the optimizer"
                    .into(),
            )),
        }
    }

    /// Runs a pass's queued reductions, in order, on this thread; without
    /// a thread after all, stage 0's buckets still land in the engine's
    /// full buffer (`lands`).
    fn reduce_queued(
        &mut self,
        mut targets: Targets<T, M::Buffer>,
        queue: Vec<Job<M::Buffer>>,
        map: &BucketMap,
        lands: bool,
    ) -> (Targets<T, M::Buffer>, Result<()>) {
        let mut result = Ok(());
        for mut job in queue {
            if result.is_ok() {
                let mut reduction = Reduction {
                    comm: self.comm,
                    replicas: self.replicas,
                    memory: &mut *self.memory,
                    map,
                    targets: &mut targets,
                };
                result = reduction.run(&mut job);
                if result.is_ok() {
                    self.progress.add_one();
                }
            }
            let back = Back {
                bucket: job.bucket,
                reduced: result.is_ok().then_some(job.add),
                buffer: job.buffer,
            };
            let landed = self.land(back, lands);
            result = result.and(landed.map(drop));
        }
        (targets, result)
    }

    /// Puts a bucket buffer that came back into the pool, its reduced
    /// bucket first written into the full buffer when the pass `lands`.
    fn land(&mut self, back: Back<M::Buffer>, lands: bool) -> Result<bool> {
        let full = self.buffers.full_grads.as_mut().filter(|_| lands);
        land(
            &mut *self.memory,
            &self.sharding.layout,
            full,
            &mut self.buffers.pool,
            back,
        )
    }
}
