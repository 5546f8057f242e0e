//! One backward pass's gradients, reduced bucket by bucket as backward
//! produces them.
//!
//! A framework that hands gradients over during backward first calls
//! [`Engine::begin_backward`] with the order in which they will arrive (for
//! Candle, the variables' order in `loss.sorted_nodes()`). On the first call
//! the engine re-partitions its parameters in that order
//! ([`Interleaved`](crate::partition::Interleaved)), so that bucket `k` is
//! one contiguous stretch of the order. The pass's [`Schedule`] is decided
//! there, once; then, for this backward pass:
//! - each gradient is flattened into its bucket's buffer, taken from a small
//!   pool (no full gradient buffer in stage 2);
//! - a bucket is complete when every gradient predicted for it has arrived;
//!   bucket `k` is launched once it is complete and every lower bucket has
//!   been, so every rank issues the same collectives in the same order;
//! - launched buckets are reduced (all-reduce in stage 0, reduce-scatter into
//!   the gradient shard in stages 1-3) by the pass's [`Runner`];
//! - the step flushes what was not predicted (parameters used outside hooked
//!   layers, unused ones) in bucket order, then adds, in a second reduction
//!   of their bucket, gradients that arrived after their bucket had been
//!   launched (a weight also used by a plain op). Reduction is linear, so the
//!   result is the same up to float rounding.
//!
//! Stage 2 reduce-scatters every micro-step into the shard (sums, averaged
//! at the step), so no full gradient buffer lives across an accumulation
//! window. Stages 0 and 1 accumulate earlier micro-steps in their full
//! buffer, locally, and reduce on the last one, folding the sum into each
//! bucket as it is launched.

use super::consistency::{hash_fingerprint, order_fingerprint};
use super::reduce::{
    land, release_held, start_host_steps, submit, take_buffer, write_held, Back, BucketMap,
    EarlyStep, Held, HostSteps, Job, LentOptimizer, Reducer, Reduction, Returns, Targets,
};
use super::shard_memory::deferral;
use super::worker::Ticket;
use super::{Engine, Overlap, ReductionProgress, ShardMemory, Stage, StageState};
use crate::comm::{Communicator, ReduceOp};
use crate::{Element, Error, Result};
use std::ops::Range;
use std::sync::{mpsc, Arc};

/// Bucket buffers a backward pass holds (being filled, or queued on the
/// communication thread) before it waits for a queued one to come back
/// rather than allocate another: at least two (one filling while one
/// reduces, DeepSpeed's double buffering), and as many as hold
/// [`BUCKET_BUFFER_BYTES`] (small buckets need more in flight to keep the
/// link busy). More are allocated only while nothing is queued (a gradient
/// block spanning a bucket boundary fills two).
const MIN_BUCKET_BUFFERS: usize = 2;
/// See [`MIN_BUCKET_BUFFERS`]: two default buckets.
const BUCKET_BUFFER_BYTES: usize = 8 << 20;

/// How one backward pass's reductions run: decided once, in
/// [`Engine::schedule`], from the stage, the configuration, the memory and
/// where the accumulation window stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Schedule {
    pub runner: Runner,
    /// Fold the window's earlier micro-steps (in the full buffer) into
    /// each bucket before it is reduced.
    pub fold_full: bool,
    /// Add each reduced bucket into the gradient shard instead of writing
    /// over it (stage 2's later micro-steps).
    pub add_to_shard: bool,
    /// Step each bucket's shard as soon as it is reduced
    /// ([`Overlap::Interleaved`] on the last micro-step).
    pub step_early: bool,
    /// Stage 0 on a communication thread: the full gradient buffer stays
    /// with the engine, each bucket's earlier micro-steps are folded in as
    /// it is launched, and each reduced bucket is written into the full
    /// buffer when its buffer comes back, so the step can begin with the
    /// buckets already back while later ones are on the wire.
    pub lands: bool,
}

/// Who runs a pass's reductions.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Runner {
    /// Queued, and run on the caller's thread after backward
    /// ([`Overlap::None`]; stage 3 on a communicator that must not run two
    /// collectives at once, whose gathers run on the caller's thread).
    AfterBackward,
    /// Launched on the caller's thread as buckets fill, by a memory whose
    /// collectives complete after they return (a device stream).
    Inline,
    /// A communication thread, as buckets fill.
    Thread,
}

/// The state of one backward pass whose gradients are being handed over.
pub(super) struct BackwardPass<T: Element, B> {
    schedule: Schedule,
    /// Per parameter, the calls predicted.
    expected_calls: Vec<usize>,
    /// Per run, the calls that covered it whole, and the elements of the
    /// call under way (a gradient handed over in ranges).
    seen_calls: Vec<usize>,
    filled: Vec<usize>,
    /// Per bucket, the predicted pieces still to arrive.
    remaining: Vec<usize>,
    /// Per bucket, whether any arrival was predicted (a bucket with none
    /// waits for the end of backward).
    predicted: Vec<bool>,
    /// Per bucket, the buffer being filled, and one for gradients that
    /// arrived after the bucket was launched.
    open: Vec<Option<B>>,
    late: Vec<Option<B>>,
    /// The lowest bucket not launched yet.
    next: usize,
    pub(super) reducer: Reducer<T, B>,
    /// Bucket buffers held before a new one waits ([`MIN_BUCKET_BUFFERS`]).
    buffer_limit: usize,
}

impl<T: Element, B> BackwardPass<T, B> {
    /// A pass over `layout`'s buckets expecting `expected_calls` hand-overs
    /// per parameter (`remaining` per bucket), its reductions run by
    /// `reducer`, buckets of at most `bucket_bytes`.
    fn new(
        schedule: Schedule,
        (expected_calls, remaining): (Vec<usize>, Vec<usize>),
        layout: &super::Layout,
        reducer: Reducer<T, B>,
        bucket_bytes: usize,
    ) -> Self {
        let buffer_limit = match reducer {
            // No buffer comes back from a thread: an inline pass reuses its
            // own behind fences (`run_inline`).
            Reducer::Inline { .. } => usize::MAX,
            _ => (BUCKET_BUFFER_BYTES / bucket_bytes).max(MIN_BUCKET_BUFFERS),
        };
        let buckets = layout.buckets.len();
        // A model whose first buckets get no hooked gradient launches
        // nothing until the end; one whose buckets are all predicted starts
        // with the first arrival.
        Self {
            schedule,
            expected_calls,
            seen_calls: vec![0; layout.runs.len()],
            filled: vec![0; layout.runs.len()],
            predicted: remaining.iter().map(|&r| r > 0).collect(),
            remaining,
            open: (0..buckets).map(|_| None).collect(),
            late: (0..buckets).map(|_| None).collect(),
            next: 0,
            reducer,
            buffer_limit,
        }
    }

    /// How many bucket buffers are being filled.
    fn holding(&self) -> usize {
        self.open.iter().chain(&self.late).flatten().count()
    }

    pub(super) fn schedule(&self) -> Schedule {
        self.schedule
    }
}

impl<T, C, M> Engine<T, C, M>
where
    T: Element,
    C: Communicator,
    M: ShardMemory<T, C>,
{
    /// Opens the hand-over of one backward pass's gradients: `expected`
    /// lists, in the order their gradients will arrive, the parameters whose
    /// gradients will be handed over with [`Engine::accumulate_param`] and
    /// how many calls each gets (2 for a weight used by two hooked ops). A
    /// collective (one small all-reduce checks that every rank predicts the
    /// same order; a rank whose graph differs is an error on every rank).
    ///
    /// On the first call, before any step, the parameters are re-partitioned
    /// in this order, so that buckets complete one after another during
    /// backward. Then, unless the schedule is [`Overlap::None`], each bucket
    /// is reduced on a communication thread as soon as it is complete (see
    /// [`Overlap`]). The step (or [`Engine::accumulate`]) that
    /// follows closes the pass. A prediction that turns out wrong costs
    /// overlap, never correctness, except with [`Overlap::Interleaved`]: a
    /// gradient that arrives after its bucket was stepped is an error.
    ///
    /// With [`Overlap::Interleaved`], on the last micro-step, the owned
    /// pieces are read from `params` here (the step does not read them
    /// again): change no parameter between this call and the step.
    pub fn begin_backward(
        &mut self,
        expected: &[(usize, usize)],
        params: &mut M::Params<'_>,
    ) -> Result<()> {
        self.finish_gathers()?;
        if self.pass.is_some() {
            return Err(Error::State(
                "begin_backward called while the previous backward pass's gradients are still \
                 pending; finish it with step (or accumulate) first"
                    .into(),
            ));
        }
        if let Some(&(param, _)) = expected.iter().find(|(p, _)| *p >= self.params.len()) {
            return Err(Error::Config(format!(
                "begin_backward: parameter #{param} does not exist (there are {})",
                self.params.len()
            )));
        }
        self.check_same_graph(expected)?;
        // The same answer on every rank: it depends on the memory's type.
        let forkable = self.memory.fork().is_some();
        self.split_side_communicator(forkable)?;
        if !self.reduces_during_backward(forkable) {
            // This memory reduces in the step; the gradients go to the full
            // buffer as before.
            return Ok(());
        }
        self.plan_in_order(expected)?;
        let Some(schedule) = self.schedule(forkable) else {
            // Stages 0 and 1 accumulate locally until the last micro-step.
            return Ok(());
        };
        self.open_pass(schedule, expected, params)
    }

    /// Checks, with one all-reduce, that every rank predicts the same
    /// gradient order and, at stage 3, that its forward gathered the same
    /// layers (the fetcher also plans the backward's gathers here).
    fn check_same_graph(&mut self, expected: &[(usize, usize)]) -> Result<()> {
        let forward = match self.fetcher().cloned() {
            Some(fetcher) => {
                let predicted: Vec<usize> = expected.iter().map(|&(p, _)| p).collect();
                fetcher.begin_backward(&predicted)?
            }
            None => 0,
        };
        let mut mine = [0.0; 16];
        mine[..8].copy_from_slice(&order_fingerprint(expected));
        mine[8..].copy_from_slice(&hash_fingerprint(forward));
        let mut agreed = mine;
        self.memory
            .all_reduce_host(&self.comm, &mut agreed[..], ReduceOp::Max)?;
        let differs =
            |at: usize| (at..at + 4).any(|i| agreed[i] != mine[i] || -agreed[i + 4] != mine[i]);
        if differs(0) {
            return Err(Error::Config(format!(
                "rank {} predicts another gradient order than some other rank ({} hooked \
                 gradient(s) here): the ranks' backward graphs differ. Every rank must run the \
                 same model on the same kind of input (no rank-dependent branches or layers)",
                self.comm.rank(),
                expected.len()
            )));
        }
        if differs(8) {
            return Err(Error::Config(format!(
                "rank {}'s forward pass used other sharded layers (or used them in another \
                 order) than some other rank's: the ranks' models differ. Every rank must \
                 run the same model on the same kind of input (no rank-dependent branches \
                 or layers)",
                self.comm.rank()
            )));
        }
        Ok(())
    }

    /// Stage 0 stepping each bucket as it is reduced all-reduces the
    /// trainable mask beside the reductions: on a communicator of its own
    /// (the same decision on every rank: it depends on the configuration).
    fn split_side_communicator(&mut self, forkable: bool) -> Result<()> {
        let wanted = forkable
            && self.config.check_trainability
            && self.steps_ddp_as_reduced()
            && self.comm.concurrent_groups();
        if let StageState::Replicated { side: side @ None } = &mut self.stage {
            if wanted {
                let world: Vec<usize> = (0..self.comm.world_size()).collect();
                *side = self.comm.split(&world)?;
            }
        }
        Ok(())
    }

    /// Opens the pass: the buffers its schedule needs, the reductions'
    /// targets and their runner.
    fn open_pass(
        &mut self,
        schedule: Schedule,
        expected: &[(usize, usize)],
        params: &mut M::Params<'_>,
    ) -> Result<()> {
        let mut expected_calls = vec![0; self.params.len()];
        for &(param, calls) in expected {
            expected_calls[param] = calls;
        }
        let remaining = self.sharding.arrivals_per_bucket(&expected_calls);

        let stage = self.config.stage;
        // Adding into the shard reduce-scatters into `scratch`: later
        // micro-steps need it from the start. Gradients that come after
        // their bucket was launched get it where their reduction runs; a
        // pass with neither never holds it.
        if schedule.add_to_shard && self.buffers.scratch.is_none() {
            let longest = self.sharding.layout.buckets.iter().map(Range::len).max();
            self.buffers.scratch = Some(self.memory.alloc_zeroed(longest.unwrap_or(0))?);
        }
        if stage == Stage::Ddp && self.buffers.full_grads.is_none() {
            self.buffers.full_grads = Some(
                self.memory
                    .alloc_zeroed(self.sharding.partition.flat_numel())?,
            );
        }
        let early = if schedule.step_early {
            // Master weights, when kept, are not read again.
            self.refresh_param_shard(params)?;
            self.window.params_read = true;
            Some(self.lend_early_step(&expected_calls)?)
        } else {
            None
        };
        if stage.shards_gradients() && schedule.fold_full {
            // Folded into this pass's reductions: the next pass must not
            // fold them again.
            self.window.in_full_buffer = false;
        }
        let targets = Targets {
            full: if (stage == Stage::Ddp && !schedule.lands)
                || (stage != Stage::Ddp && schedule.fold_full)
            {
                self.buffers.full_grads.take()
            } else {
                None
            },
            shard: self.buffers.grad_shard.take(),
            scratch: self.buffers.scratch.take(),
            early,
        };
        let reducer = match schedule.runner {
            Runner::Thread => self.start_reducer(targets),
            Runner::Inline => self.start_inline(targets)?,
            Runner::AfterBackward => Reducer::Queued {
                targets,
                queue: Vec::new(),
            },
        };
        let bucket_bytes = self.sharding.longest_bucket.max(1) * std::mem::size_of::<T>();
        self.pass = Some(BackwardPass::new(
            schedule,
            (expected_calls, remaining),
            &self.sharding.layout,
            reducer,
            bucket_bytes,
        ));
        Ok(())
    }

    /// A pass's reductions launched on this thread as buckets fill, by a
    /// memory whose collectives complete after they return; with the
    /// interleaved schedule (offload), the host steps on a thread of its
    /// own.
    fn start_inline(
        &mut self,
        mut targets: Targets<T, M::Buffer>,
    ) -> Result<Reducer<T, M::Buffer>> {
        let region = targets.shard.as_mut().and_then(M::host_region);
        let steps = match (
            targets.early.take(),
            self.abilities.host_stepper.clone(),
            region,
        ) {
            (None, _, _) => None,
            (Some(early), Some(stepper), Some(region)) => {
                Some(Box::new(start_host_steps::<T, C, M>(
                    early,
                    self.memory.alloc_zeroed(0)?,
                    stepper,
                    (
                        self.sharding.layout.buckets.clone(),
                        self.wire.packed_write_back,
                    ),
                    region,
                )?))
            }
            (Some(early), _, _) => {
                targets.early = Some(early);
                return Err(Error::State(
                    "internal: an inline pass steps early only on a host stepper, from a \
                     gradient shard in host memory"
                        .into(),
                ));
            }
        };
        deferral(&mut self.memory)?.defer_completion();
        Ok(Reducer::Inline {
            targets,
            map: self.bucket_map(),
            queue: Vec::new(),
            held: Vec::new(),
            steps,
            result: Ok(()),
        })
    }

    /// Lends the optimizer and the parameter shard for the interleaved
    /// schedule: the pieces of predicted parameters step with their bucket.
    fn lend_early_step(&mut self, expected_calls: &[usize]) -> Result<EarlyStep<T, M::Buffer>> {
        let bucket_pieces = self
            .sharding
            .pieces_by_bucket()
            .ok_or_else(|| {
                Error::State(
                    "internal: the interleaved schedule needs pieces within buckets".into(),
                )
            })?
            .to_vec();
        let base = self.sharding.base();
        let pieces = self
            .sharding
            .owned
            .iter()
            .map(|piece| {
                let at = piece.flat_range.start - base;
                let p = piece.param;
                let trains = if self.config.check_trainability {
                    self.mask.trainable[p]
                } else {
                    self.mask.active[p]
                };
                (at..at + piece.len(), trains && expected_calls[p] > 0)
            })
            .collect();
        let micro_steps = self.window.micro_steps + 1;
        let kind = self.optimizer.kind().to_string();
        let optimizer = std::mem::replace(&mut self.optimizer, Box::new(LentOptimizer(kind)));
        let params = std::mem::replace(&mut self.buffers.param_shard, self.memory.alloc_zeroed(0)?);
        Ok(EarlyStep {
            optimizer,
            params,
            // Lent like the optimizer (the engine is lent to backward, so
            // nothing reads them meanwhile); back at the join.
            keys: std::mem::take(&mut self.sharding.keys),
            pieces,
            bucket_pieces,
            scale: (micro_steps > 1).then(|| 1.0 / micro_steps as f64),
            stepped: vec![false; self.sharding.layout.buckets.len()],
        })
    }

    /// Starts one backward pass's reductions on the communication thread;
    /// without one, they run after backward instead (the same result,
    /// without overlap).
    fn start_reducer(&mut self, targets: Targets<T, M::Buffer>) -> Reducer<T, M::Buffer> {
        let (jobs, job_rx) = mpsc::channel::<Job<M::Buffer>>();
        let (returned_tx, returned) = mpsc::channel::<Back<M::Buffer>>();
        let task = ReductionTask {
            comm: Arc::clone(&self.comm),
            map: self.bucket_map(),
            progress: self.progress.clone(),
            targets,
            jobs: job_rx,
            returned: returned_tx,
        };
        let started = match (self.ensure_worker(), self.worker.as_ref()) {
            (true, Some(worker)) => worker.run(task, ReductionTask::run),
            _ => Err(task),
        };
        match started {
            Ok(ticket) => Reducer::Thread {
                jobs,
                returned: Returns::new(self.sharding.layout.buckets.len(), returned),
                ticket,
            },
            Err(task) => {
                tracing::warn!("no communication thread; reducing after backward");
                Reducer::Queued {
                    targets: task.targets,
                    queue: Vec::new(),
                }
            }
        }
    }
}

/// One backward pass's reductions on the communication thread: each job
/// reduced as it comes, in order, and its buffer sent back.
struct ReductionTask<T: Element, C, B> {
    comm: Arc<C>,
    map: BucketMap,
    progress: ReductionProgress,
    targets: Targets<T, B>,
    jobs: mpsc::Receiver<Job<B>>,
    returned: mpsc::Sender<Back<B>>,
}

impl<T: Element, C: Communicator, B> ReductionTask<T, C, B> {
    /// Runs until the pass closes its job channel; the targets back, with
    /// the first failure.
    fn run<M: ShardMemory<T, C, Buffer = B>>(
        memory: &mut M,
        mut task: Self,
    ) -> (Targets<T, B>, Result<()>) {
        let mut result = Ok(());
        for mut job in task.jobs {
            // After a failure, issue nothing more: the peers fail their
            // pending collectives within the deadline too.
            let mut reduced = None;
            if result.is_ok() {
                let mut reduction = Reduction {
                    comm: &*task.comm,
                    memory: &mut *memory,
                    map: &task.map,
                    targets: &mut task.targets,
                };
                result = reduction.run(&mut job);
                if result.is_ok() {
                    task.progress.add_one();
                    reduced = Some(job.add);
                }
            }
            // The engine may have finished with the pool already.
            let _ = task.returned.send(Back {
                bucket: job.bucket,
                reduced,
                buffer: job.buffer,
            });
        }
        (task.targets, result)
    }
}

impl<T, C, M> Engine<T, C, M>
where
    T: Element,
    C: Communicator,
    M: ShardMemory<T, C>,
{
    /// Whether this memory reduces during backward at all: with a thread
    /// of its own ([`ShardMemory::fork`]), or launching on the caller's
    /// (a device stream, after-backward overlap, no stage-3 gathers).
    fn reduces_during_backward(&self, forkable: bool) -> bool {
        forkable || self.reduces_inline()
    }

    fn reduces_inline(&self) -> bool {
        let overlap = match self.config.overlap {
            Overlap::AfterBackward => true,
            // Steps bucket by bucket on a thread of its own (offload).
            Overlap::Interleaved => self.abilities.host_stepper.is_some(),
            Overlap::None => false,
        };
        self.memory.fork().is_none()
            && self.abilities.launches_async
            && overlap
            && self.fetcher().is_none()
    }

    /// The schedule of a backward pass beginning now; `None` when the pass
    /// only accumulates (stages 0 and 1 before the last micro-step).
    pub(super) fn schedule(&self, forkable: bool) -> Option<Schedule> {
        let stage = self.config.stage;
        let last_micro_step = self.window.micro_steps + 1 >= self.config.grad_accum_steps;
        if !stage.shards_gradients() && !last_micro_step {
            return None;
        }
        // Stage 3 on a communicator that must not run two collectives at
        // once (MPI) gathers on this thread, blocking, during backward: the
        // reductions wait until after it.
        let serial = self.fetcher().is_some_and(|f| !f.overlaps());
        let runner = match self.config.overlap {
            _ if serial => Runner::AfterBackward,
            Overlap::None => Runner::AfterBackward,
            Overlap::AfterBackward | Overlap::Interleaved if forkable => Runner::Thread,
            Overlap::AfterBackward | Overlap::Interleaved => Runner::Inline,
        };
        Some(Schedule {
            runner,
            // Micro-steps given earlier in this window without a pass
            // (slots, or `accumulate_param` alone) are in the full buffer:
            // fold them into each bucket once. Stage 2 then adds to what
            // earlier passes reduced into the shard.
            fold_full: self.window.in_full_buffer,
            add_to_shard: stage.shards_gradients() && self.window.in_shard,
            // Stage 0 steps the replica after backward, bucket by bucket,
            // with no parameter copy to step early: there the interleaved
            // schedule steps after backward. A piece straddling buckets (a
            // partition not made in gradient order) steps after backward
            // too, with the same result.
            step_early: self.config.overlap == Overlap::Interleaved
                && last_micro_step
                && stage != Stage::Ddp
                && self.sharding.pieces_by_bucket().is_some(),
            lands: stage == Stage::Ddp
                && !serial
                && self.config.overlap != Overlap::None
                && forkable,
        })
    }

    /// Hands (the elements `range` of) one gradient to the open backward
    /// pass: flattens it into its buckets and launches the buckets it
    /// completes. A run counts towards its bucket once a call has covered
    /// it whole, whether in one range or several.
    pub(super) fn hand_over(
        &mut self,
        param: usize,
        range: Range<usize>,
        grad: M::Grad<'_>,
        predicted: bool,
    ) -> Result<()> {
        for i in 0..self.sharding.runs_of_param[param].len() {
            let r = self.sharding.runs_of_param[param][i];
            let Some(pass) = self.pass.as_mut() else {
                return Err(Error::State("internal: no backward pass is open".into()));
            };
            let run = &self.sharding.layout.runs[r];
            let k = self.sharding.bucket_of_run[r];
            let start = self.sharding.layout.bucket_range(k).start;
            let Some(piece) = super::piece_of(run, &range, grad, start) else {
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
                let len = self.sharding.layout.bucket_range(k).len();
                let full = self
                    .buffers
                    .full_grads
                    .as_mut()
                    .filter(|_| pass.schedule.lands);
                *slot = Some(take_buffer(
                    &mut self.memory,
                    &mut self.buffers.pool,
                    &mut pass.reducer,
                    (holding, pass.buffer_limit),
                    len,
                    (&self.sharding.layout, full),
                )?);
            }
            let buffer = slot.as_mut().expect("filled above");
            let covered = piece.range.len();
            self.memory.flatten(buffer, &[piece], true)?;
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
                    self.launch_ready(false)?;
                }
            }
        }
        self.window.present[param] = true;
        self.launch_ready(false)
    }

    /// Launches every bucket that is due: complete ones in order, or (at the
    /// end of backward, `all`) every one left.
    fn launch_ready(&mut self, all: bool) -> Result<()> {
        let Some(pass) = self.pass.as_mut() else {
            return Ok(());
        };
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
                    &mut self.memory,
                    &mut self.buffers.pool,
                    &mut pass.reducer,
                    (holding, pass.buffer_limit),
                    self.sharding.layout.bucket_range(k).len(),
                    (&self.sharding.layout, full),
                )?,
            };
            let mut fold_full = pass.schedule.fold_full;
            if pass.schedule.lands && fold_full {
                // The full buffer stays here: the earlier micro-steps are
                // folded in now, as the thread would have.
                let full = self.buffers.full_grads.as_ref().ok_or_else(|| {
                    Error::State("internal: no full gradient buffer in stage 0".into())
                })?;
                self.memory.copy_range(
                    &mut buffer,
                    0,
                    full,
                    self.sharding.layout.bucket_range(k),
                    true,
                )?;
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
        self.run_inline();
        Ok(())
    }

    /// Runs the reductions queued for an inline reducer, on this thread;
    /// they complete when the memory settles at the end of the pass, and
    /// stage 0 writes its buckets into the full buffer then. A sum into
    /// the shard (accumulation at stage 2), whose result is used at once,
    /// runs with the memory settled. After a failure nothing more is
    /// issued; joining the pass reports it.
    fn run_inline(&mut self) {
        let Some(pass) = self.pass.as_mut() else {
            return;
        };
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
                    comm: &*self.comm,
                    memory: &mut self.memory,
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
                *result = deferral(&mut self.memory)
                    .and_then(|d| d.fence_deferred(fence))
                    .and_then(|()| {
                        let mut reduction = Reduction {
                            comm: &*self.comm,
                            memory: &mut self.memory,
                            map,
                            targets,
                        };
                        write_held(&mut reduction, &mut self.buffers.pool, held, fence)
                    });
            }
        }
    }

    /// Closes the open backward pass: hands over `grads` (the gradients
    /// that came after backward, one slot per parameter), launches every
    /// bucket left, adds the late gradients, waits for every reduction and
    /// takes the buffers back. `Ok(true)` if a pass was open.
    pub(super) fn finish_pass(&mut self, grads: Option<&[Option<M::Grad<'_>>]>) -> Result<bool> {
        let finished = self.finish_pass_stepping(grads);
        let stepped = self.finish_host_steps();
        let opened = finished?;
        stepped?;
        Ok(opened)
    }

    /// [`Engine::finish_pass`], except that offload's step thread, if the
    /// pass has one, goes on with its last buckets: the write-back takes
    /// each as it is stepped (`update_shard`), and anything else that
    /// reads the shards or the optimizer first waits for the thread
    /// ([`Engine::finish_host_steps`]). Meanwhile the engine holds neither
    /// shard nor the optimizer, so nothing can read them by mistake.
    pub(super) fn finish_pass_stepping(
        &mut self,
        grads: Option<&[Option<M::Grad<'_>>]>,
    ) -> Result<bool> {
        if self.pass.is_none() {
            return Ok(false);
        }
        let flushed = self.flush_pass(grads);
        let joined = self.join_reductions();
        flushed.and(joined)?;
        Ok(true)
    }

    pub(super) fn flush_pass(&mut self, grads: Option<&[Option<M::Grad<'_>>]>) -> Result<()> {
        if let Some(grads) = grads {
            for (param, grad) in grads.iter().enumerate() {
                if let Some(grad) = *grad {
                    let numel = self.params[param].numel();
                    self.hand_over(param, 0..numel, grad, false)?;
                }
            }
        }
        self.launch_ready(true)?;
        let Some(pass) = self.pass.as_mut() else {
            return Ok(());
        };
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
        self.run_inline();
        Ok(())
    }

    /// Waits for every reduction of the open pass (running them here if
    /// they were deferred) and for offload's step thread, puts the buffers
    /// back and closes the pass.
    pub(super) fn join_pass(&mut self) -> Result<()> {
        let joined = self.join_reductions();
        let stepped = self.finish_host_steps();
        joined.and(stepped)
    }

    /// Waits for offload's step thread after its last bucket, if it is
    /// still stepping (see [`Engine::finish_pass_stepping`]), and takes
    /// back the optimizer and both shards; reports its first failure.
    pub(super) fn finish_host_steps(&mut self) -> Result<()> {
        let Some(steps) = self.host_steps.take() else {
            return Ok(());
        };
        let Some(done) = steps.finish() else {
            return Err(Error::State(
                "the offload's step thread panicked; the optimizer and the shards are lost, \
                 rebuild the optimizer"
                    .into(),
            ));
        };
        self.optimizer = done.early.optimizer;
        self.buffers.param_shard = done.early.params;
        self.sharding.keys = done.early.keys;
        self.window.early_stepped = done.early.stepped;
        if done.grad_shard.is_some() {
            self.buffers.grad_shard = done.grad_shard;
        }
        let [landing, stepping, packing, waited] = done.times;
        let times = &mut self.offload_times;
        times.steps += 1;
        times.landing += landing;
        times.stepping += stepping;
        times.packing += packing;
        times.join += waited;
        done.result
    }

    /// [`Engine::join_pass`] but for offload's step thread, which goes on
    /// stepping (held in `host_steps`, with the gradient shard it reads).
    fn join_reductions(&mut self) -> Result<()> {
        let Some(mut pass) = self.pass.take() else {
            return Ok(());
        };
        // Buffers still open (a pass abandoned halfway) go back to the pool.
        self.buffers.pool.extend(pass.open.drain(..).flatten());
        self.buffers.pool.extend(pass.late.drain(..).flatten());
        let (targets, result) = match pass.reducer {
            Reducer::Queued { targets, queue } => {
                self.reduce_queued(targets, queue, pass.schedule.lands)
            }
            Reducer::Inline {
                targets,
                map,
                queue,
                held,
                steps,
                result,
            } => {
                // `flush_pass` ran every queued job (none is left after a
                // failure stopped it either: they were never issued).
                self.buffers
                    .pool
                    .extend(queue.into_iter().map(|job| job.buffer));
                self.join_inline(targets, &map, held, steps, result)
            }
            Reducer::Thread {
                jobs,
                returned,
                ticket,
            } => {
                drop(jobs);
                self.join_thread(returned, ticket, pass.schedule.lands)?
            }
        };
        if targets.full.is_some() {
            self.buffers.full_grads = targets.full;
        }
        self.buffers.grad_shard = targets.shard;
        self.buffers.scratch = targets.scratch;
        if let Some(early) = targets.early {
            self.optimizer = early.optimizer;
            self.buffers.param_shard = early.params;
            self.sharding.keys = early.keys;
            self.window.early_stepped = early.stepped;
        }
        result
    }

    /// Ends an inline pass: settles its reductions, writes what they held
    /// and, offloaded, leaves the step thread going on with its last
    /// buckets (`host_steps`, with the gradient shard it reads).
    fn join_inline(
        &mut self,
        mut targets: Targets<T, M::Buffer>,
        map: &BucketMap,
        mut held: Vec<Held<M::Buffer>>,
        steps: Option<Box<HostSteps<T, M::Buffer>>>,
        result: Result<()>,
    ) -> (Targets<T, M::Buffer>, Result<()>) {
        // Settled even after a failure: it ends the deferral.
        let settled = deferral(&mut self.memory).and_then(|d| d.settle(&*self.comm));
        let mut result = result.and(settled);
        if result.is_ok() {
            let mut reduction = Reduction {
                comm: &*self.comm,
                memory: &mut self.memory,
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
        if let Some(mut steps) = steps {
            // The thread goes on with its last buckets, reading the
            // gradient shard: held with it until it is finished.
            steps.end_backward(targets.shard.take());
            self.host_steps = Some(steps);
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
            let full = self.buffers.full_grads.as_mut().filter(|_| lands);
            let written = land(
                &mut self.memory,
                &self.sharding.layout,
                full,
                &mut self.buffers.pool,
                back,
            );
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
        lands: bool,
    ) -> (Targets<T, M::Buffer>, Result<()>) {
        let map = self.bucket_map();
        let mut result = Ok(());
        for mut job in queue {
            if result.is_ok() {
                let mut reduction = Reduction {
                    comm: &*self.comm,
                    memory: &mut self.memory,
                    map: &map,
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
            let full = self.buffers.full_grads.as_mut().filter(|_| lands);
            let landed = land(
                &mut self.memory,
                &self.sharding.layout,
                full,
                &mut self.buffers.pool,
                back,
            );
            result = result.and(landed.map(drop));
        }
        (targets, result)
    }

    /// Whether a backward pass's gradients are being handed over.
    pub(super) fn pass_is_open(&self) -> bool {
        self.pass.is_some()
    }

    fn bucket_map(&self) -> BucketMap {
        BucketMap {
            stage: self.config.stage,
            full: (0..self.sharding.layout.buckets.len())
                .map(|k| self.sharding.layout.bucket_range(k))
                .collect(),
            shard: self.sharding.layout.buckets.clone(),
            wire: self.wire.reduce,
        }
    }

    /// A handle on the count of completed bucket reductions.
    pub fn reduction_progress(&self) -> ReductionProgress {
        self.progress.clone()
    }
}
