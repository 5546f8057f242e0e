//! The hand-over of gradients to an open pass: flattened into bucket
//! buffers, launched in bucket order as buckets complete, and (a memory
//! with a stream of its own) reduced on the calling thread.

use super::{BackwardPass, MIN_BUCKET_BUFFERS};
use crate::comm::Communicator;
use crate::engine::buffers::{piece_of, Buffers};
use crate::engine::reduce::{
    release_held, submit, take_buffer, write_held, Held, Job, Reducer, Reduction,
};
use crate::engine::shard_memory::deferral;
use crate::engine::sharding::Sharding;
use crate::engine::{ReductionProgress, ShardMemory};
use crate::partition::ParamInfo;
use crate::{Element, Error, Result};
use std::ops::Range;

/// The engine's parts a backward pass works with, borrowed for one call:
/// the partition it fills buckets by, and the communicator, memory and
/// buffers it reduces with. The pass itself is borrowed beside them.
pub(in crate::engine) struct PassParts<'e, T: Element, C, M: ShardMemory<T, C>>
where
    C: Communicator,
{
    pub comm: &'e C,
    /// With shard groups: this rank's replicas.
    pub replicas: Option<&'e C>,
    pub memory: &'e mut M,
    pub buffers: &'e mut Buffers<M::Buffer>,
    pub sharding: &'e Sharding,
    pub params: &'e [ParamInfo],
    /// Per parameter, whether a gradient was handed over this window.
    pub present: &'e mut [bool],
    pub progress: &'e ReductionProgress,
}

impl<T: Element, C: Communicator, M: ShardMemory<T, C>> PassParts<'_, T, C, M> {
    /// Hands (the elements `range` of) one gradient to `pass`: flattens it
    /// into its buckets and launches the buckets it completes. A run
    /// counts towards its bucket once a call has covered it whole, whether
    /// in one range or several.
    pub fn hand_over(
        &mut self,
        pass: &mut BackwardPass<T, M::Buffer>,
        param: usize,
        range: Range<usize>,
        grad: M::Grad<'_>,
        predicted: bool,
    ) -> Result<()> {
        let sharding = self.sharding;
        for &r in &sharding.runs_of_param[param] {
            let run = &sharding.layout.runs[r];
            let k = sharding.bucket_of_run[r];
            let start = sharding.layout.bucket_range(k).start;
            let Some(piece) = piece_of(run, &range, grad, start) else {
                continue;
            };
            if k < pass.next && pass.schedule.step_early {
                return Err(Error::State(format!(
                    "{:?} got a gradient after its bucket had been reduced and stepped (overlap \
                     interleaved): it is used outside the hooked layers, or more often than \
                     predicted. Use overlap after-backward for this model",
                    self.params[param].name
                )));
            }
            let holding = pass.holding();
            let slot = if k < pass.next {
                &mut pass.late[k]
            } else {
                &mut pass.open[k]
            };
            if slot.is_none() {
                let len = sharding.layout.bucket_range(k).len();
                let full = self
                    .buffers
                    .full_grads
                    .as_mut()
                    .filter(|_| pass.schedule.lands);
                *slot = Some(take_buffer(
                    &mut *self.memory,
                    &mut self.buffers.pool,
                    &mut pass.reducer,
                    (holding, pass.buffer_limit),
                    len,
                    (&sharding.layout, full),
                )?);
            }
            let buffer = slot.as_mut().expect("filled above");
            let covered = piece.range.len();
            // A run's first gradient, whole, lands on the zeros
            // `take_buffer` gives: copied, not added (no read of them).
            let first =
                pass.filled[r] == 0 && pass.seen_calls[r] == 0 && covered == run.param_range.len();
            self.memory.flatten(buffer, &[piece], !first)?;
            pass.filled[r] += covered;
            if pass.filled[r] < run.param_range.len() {
                continue;
            }
            pass.filled[r] = 0;
            pass.seen_calls[r] += 1;
            if predicted && pass.seen_calls[r] <= pass.expected_calls[param] && k >= pass.next {
                pass.remaining[k] = pass.remaining[k].saturating_sub(1);
                // Launched before the next bucket of a long gradient is
                // opened, so that it can take this one's place.
                if pass.remaining[k] == 0 {
                    self.launch_ready(pass, false)?;
                }
            }
        }
        self.present[param] = true;
        self.launch_ready(pass, false)
    }

    /// Launches every bucket of `pass` that is due: complete ones in
    /// order, or (at the end of backward, `all`) every one left.
    pub fn launch_ready(&mut self, pass: &mut BackwardPass<T, M::Buffer>, all: bool) -> Result<()> {
        let layout = &self.sharding.layout;
        while pass.next < pass.open.len()
            && (all || (pass.predicted[pass.next] && pass.remaining[pass.next] == 0))
        {
            let k = pass.next;
            let holding = pass.holding();
            let full = self
                .buffers
                .full_grads
                .as_mut()
                .filter(|_| pass.schedule.lands);
            let mut buffer = match pass.open[k].take() {
                Some(buffer) => buffer,
                None => take_buffer(
                    &mut *self.memory,
                    &mut self.buffers.pool,
                    &mut pass.reducer,
                    (holding, pass.buffer_limit),
                    layout.bucket_range(k).len(),
                    (layout, full),
                )?,
            };
            let mut fold_full = pass.schedule.fold_full;
            if pass.schedule.lands && fold_full {
                // The full buffer stays here: the earlier micro-steps are
                // folded in now, as the thread would have.
                let full = self.buffers.full_grads.as_ref().ok_or_else(|| {
                    Error::State("internal: no full gradient buffer in stage 0".into())
                })?;
                self.memory
                    .copy_range(&mut buffer, 0, full, layout.bucket_range(k), true)?;
                fold_full = false;
            }
            let job = Job {
                bucket: k,
                buffer,
                fold_full,
                add: pass.schedule.add_to_shard,
                // What is launched at the end waits for the step's mask.
                step: pass.schedule.step_early && !all,
            };
            submit(&mut pass.reducer, job);
            pass.next += 1;
        }
        self.run_inline(pass);
        Ok(())
    }

    /// Launches every bucket of `pass` left, then, in a second reduction
    /// of their bucket, the gradients that came after it was launched.
    pub fn launch_rest(&mut self, pass: &mut BackwardPass<T, M::Buffer>) -> Result<()> {
        self.launch_ready(pass, true)?;
        // The same on every rank running the same model: which gradients
        // come after their bucket is a property of the graph.
        for k in 0..pass.late.len() {
            if let Some(buffer) = pass.late[k].take() {
                let job = Job {
                    bucket: k,
                    buffer,
                    fold_full: false,
                    add: true,
                    step: false,
                };
                submit(&mut pass.reducer, job);
            }
        }
        self.run_inline(pass);
        Ok(())
    }

    /// Runs the reductions queued for an inline reducer, on this thread;
    /// they complete when the memory settles at the end of the pass, and
    /// stage 0 writes its buckets into the full buffer then. A sum into
    /// the shard (accumulation at stage 2), whose result is used at once,
    /// runs with the memory settled. After a failure nothing more is
    /// issued; joining the pass reports it.
    fn run_inline(&mut self, pass: &mut BackwardPass<T, M::Buffer>) {
        let Reducer::Inline {
            targets,
            map,
            queue,
            held,
            steps,
            result,
        } = &mut pass.reducer
        else {
            return;
        };
        for mut job in std::mem::take(queue) {
            let mut write = None;
            if result.is_ok() {
                let reduction = Reduction {
                    comm: self.comm,
                    replicas: self.replicas,
                    memory: &mut *self.memory,
                    map,
                    targets,
                };
                (*result, write) = reduction.run_inline(&mut job);
                if result.is_ok() {
                    self.progress.add_one();
                }
                // Interleaved (offload): the reduced gradients are on their
                // way into the host shard; the step thread waits for them.
                if let (true, Some(steps), Ok(())) = (job.step, steps.as_mut(), &*result) {
                    *result = self
                        .memory
                        .host_offload()
                        .map_or(Ok(None), |offload| offload.landing())
                        .and_then(|landing| steps.hand_over(job.bucket, landing));
                }
            }
            // A shard offloaded to host memory got its part when the
            // reduction returned, or has its copy queued behind it: the bucket
            // buffer is free for the next bucket at once, so the device
            // holds a bucket or two instead of the whole gradient.
            let landed = write.is_none() && targets.shard.as_ref().is_some_and(M::offloaded);
            if landed {
                self.buffers.pool.push(job.buffer);
                continue;
            }
            if job.add {
                // Settled above: every reduction held so far is complete
                // (none is stage 0's, which writes).
                release_held(&mut self.buffers.pool, held, usize::MAX);
            }
            held.push(Held {
                write,
                reductions: self.memory.deferral().map_or(0, |d| d.deferred_count()),
                buffer: job.buffer,
            });
            // Beyond a few buffers, the oldest is reused behind a fence:
            // what is queued from now on runs after the reductions that
            // read it (a device stream waits on their events; the host does
            // not wait), stage 0's reduced bucket first written into the
            // full buffer, so the pass holds a few bucket buffers instead
            // of one per bucket.
            if held.len() > MIN_BUCKET_BUFFERS && result.is_ok() {
                let fence = held[0].reductions;
                *result = deferral(&mut *self.memory)
                    .and_then(|d| d.fence_deferred(fence))
                    .and_then(|()| {
                        let mut reduction = Reduction {
                            comm: self.comm,
                            replicas: self.replicas,
                            memory: &mut *self.memory,
                            map,
                            targets,
                        };
                        write_held(&mut reduction, &mut self.buffers.pool, held, fence)
                    });
            }
        }
    }
}
