//! Stages 1 and 2 after the reductions: the shard stepped bucket by bucket,
//! each bucket all-gathered as soon as it is stepped (on the communication
//! thread, while the next bucket steps; on a memory with its own stream,
//! queued on the calling thread), or left to the communication thread to
//! run into the next forward (`deferred.rs`).

use super::deferred::{GatherJob, Payload};
use super::{
    packed_len, Engine, Layout, Overlap, ParamCopy, ShardMemory, Stage, StepPiece, StepPlan,
};
use crate::comm::Communicator;
use crate::optim::FunctionalOptimizer;
use crate::{DType, Element, Error, Result};
use std::ops::Range;
use std::sync::{mpsc, Arc};

/// All-gathers of stepped buckets allowed in flight at once after backward.
const GATHERS_IN_FLIGHT: usize = 1;

/// A bucket's all-gather back from the communication thread: the bucket,
/// the chunk sent, the gathered bucket, and how it went.
type Gathered<B> = (usize, B, B, Result<()>);

impl<T: Element, C: Communicator, M: ShardMemory<T, C>> Engine<T, C, M> {
    /// Stages 1 and 2, overlapped: steps the shard bucket by bucket and
    /// all-gathers each bucket on a communication thread as soon as it is
    /// stepped, writing the gathered parameters into the replica as they
    /// arrive: the optimizer runs while earlier buckets are on the wire.
    /// `Ok(false)` (nothing done) when this memory or partition cannot.
    ///
    /// With `defer`, and a [`ParamAccess`](super::ParamAccess) set, the
    /// all-gathers run after this returns instead (see `deferred.rs`).
    pub(super) fn step_and_gather_overlapped(
        &mut self,
        stepping: &[bool],
        params: &mut M::Params<'_>,
        defer: bool,
    ) -> Result<bool> {
        // Stage 3 gathers only the replicated parameters' few buckets.
        if self.config.overlap == Overlap::None
            || self.config.stage == Stage::Ddp
            || self.fetcher().is_some()
        {
            return Ok(false);
        }
        let Some(groups) = self.plan.pieces_by_bucket() else {
            return Ok(false);
        };
        // A memory whose collectives run on a stream of their own (the
        // GPU's) queues the same pipeline on this thread instead.
        let forkable = self.memory.fork().is_some();
        if !forkable && !self.memory.launches_async() {
            return Ok(false);
        }
        if self.buffers.grad_shard.is_none() {
            return Err(no_grad_shard());
        }
        let defer = defer
            && forkable
            && self
                .deferred_gathers()
                .is_some_and(|gathers| gathers.access.is_some());
        // Without a communication thread, the serial step issues the same
        // all-gathers in the same order; deferral keeps its own order and
        // gathers on this thread instead.
        if forkable && !self.ensure_worker() && !defer {
            return Ok(false);
        }
        // Without a shard copy (`lean_shard`), each bucket's owned pieces
        // are read from the replica into a staging buffer and stepped
        // there, with their gradients copied beside them.
        let mut grad_chunk = None;
        if self.lean_shard() {
            self.buffers.param_shard = self.memory.alloc_zeroed(0)?;
            grad_chunk = Some(self.memory.alloc_zeroed(self.longest_chunk())?);
        }
        if !forkable {
            self.step_and_gather_inline(stepping, params, &groups, grad_chunk)?;
            return Ok(true);
        }
        if defer {
            self.step_and_defer(stepping, params, &groups, grad_chunk)?;
            return Ok(true);
        }
        self.step_and_gather_on_thread(stepping, params, &groups, grad_chunk)
    }

    /// A memory whose collectives complete on its stream, in order (the
    /// GPU's): each active bucket stepped, all-gathered and written into the
    /// replica, all queued on this thread, through one chunk buffer and one
    /// pooled bucket buffer, which the stream's order lets the next bucket
    /// reuse at once.
    fn step_and_gather_inline(
        &mut self,
        stepping: &[bool],
        params: &mut M::Params<'_>,
        groups: &[Range<usize>],
        mut grad_chunk: Option<M::Buffer>,
    ) -> Result<()> {
        let (mut send, mut recv) = self.gather_buffers()?;
        let dtype = self.gather_dtype();
        let stepper = BucketStep::new(
            &self.plan,
            stepping,
            &self.mask.bucket_active,
            &self.window.early_stepped,
            self.buffers.grad_shard.as_ref(),
        )?;
        let layout = &self.plan.layout;
        let mut outcome = Ok(());
        for (k, group) in groups.iter().enumerate() {
            if !stepper.bucket_active[k] {
                continue;
            }
            outcome = step_bucket(
                &mut self.memory,
                self.optimizer.as_mut(),
                params,
                (&mut self.buffers.param_shard, grad_chunk.as_mut()),
                &stepper,
                (k, group.clone()),
                &mut send,
            )
            .and_then(|()| {
                gather_into_replica(
                    &mut self.memory,
                    &*self.comm,
                    params,
                    (&send, &mut recv, Wire::As(dtype)),
                    (layout, &self.mask.active, k),
                )
            });
            if outcome.is_err() {
                break;
            }
        }
        self.buffers.pool.push(recv);
        outcome
    }

    /// Offload's step thread still stepping after backward (see
    /// [`Engine::finish_pass_stepping`]): each active bucket's weights go
    /// up, are all-gathered and written into the replica as soon as the
    /// thread has stepped it, while it steps the next ones, so the
    /// write-back overlaps the last steps instead of following them.
    /// `Ok(true)` once every active bucket is written; `Ok(false)` at the
    /// first bucket the thread does not step (its gradient came after its
    /// bucket was reduced, or the thread failed): then the caller steps and
    /// writes back as without the thread (writing the buckets before it
    /// again, which changes nothing).
    pub(super) fn write_back_as_stepped(&mut self, params: &mut M::Params<'_>) -> Result<bool> {
        let (mut send, mut recv) = self.gather_buffers()?;
        let dtype = self.gather_dtype();
        let layout = &self.plan.layout;
        let mut outcome = Ok(true);
        for k in 0..layout.buckets.len() {
            if !self.mask.bucket_active[k] {
                continue;
            }
            let Some(steps) = self.host_steps.as_mut() else {
                outcome = Ok(false);
                break;
            };
            if !steps.wait_stepped(k) {
                outcome = Ok(false);
                break;
            }
            let bucket = layout.buckets[k].clone();
            // A 16-bit model's weights go up packed in its dtype (half the
            // bytes of the masters), gathered and widened on the device.
            let packed = steps.packed();
            let (source, up) = match (packed, steps.params()) {
                (Some((grads, _)), _) => (
                    grads,
                    bucket.start..bucket.start + packed_len::<T>(bucket.len()),
                ),
                (None, Some(shard)) => (shard, bucket.clone()),
                (None, None) => {
                    outcome = Ok(false);
                    break;
                }
            };
            outcome = self
                .memory
                .copy_range(&mut send, 0, source, up, false)
                .and_then(|()| {
                    let wire = match packed {
                        Some((_, wire)) => Wire::Packed(wire),
                        None => Wire::As(dtype),
                    };
                    gather_into_replica(
                        &mut self.memory,
                        &*self.comm,
                        params,
                        (&send, &mut recv, wire),
                        (layout, &self.mask.active, k),
                    )
                })
                .map(|()| true);
            if outcome.is_err() {
                break;
            }
        }
        self.buffers.pool.push(recv);
        outcome
    }

    /// A buffer for one bucket's chunk (to send) and a pooled one for the
    /// whole gathered bucket (to receive; the caller gives it back): what a
    /// bucket-by-bucket write-back goes through, which the stream's order
    /// lets each bucket reuse at once.
    fn gather_buffers(&mut self) -> Result<(M::Buffer, M::Buffer)> {
        let send = self.memory.alloc_zeroed(self.longest_chunk())?;
        // Overwritten whole by each gather: no need to zero.
        let (recv, _) = super::reduce::take_shortest(
            &mut self.memory,
            &mut self.buffers.pool,
            self.plan.longest_bucket,
        )?;
        Ok((send, recv))
    }

    /// Elements of the longest bucket's chunk (one rank's part of it).
    fn longest_chunk(&self) -> usize {
        self.plan
            .layout
            .buckets
            .iter()
            .map(Range::len)
            .max()
            .unwrap_or(0)
    }

    /// Steps the buckets in forward order (buckets follow gradient order,
    /// so the last one holds the first layers), writes each one's owned
    /// pieces into the parameters and hands it to the communication thread, so
    /// the first layers' parameters are on the wire while the rest step.
    fn step_and_defer(
        &mut self,
        stepping: &[bool],
        params: &mut M::Params<'_>,
        groups: &[Range<usize>],
        mut grad_chunk: Option<M::Buffer>,
    ) -> Result<()> {
        let access = self
            .deferred_gathers()
            .and_then(|gathers| gathers.access.take())
            .ok_or_else(|| Error::State("internal: no parameter access to defer with".into()))?;
        let order: Vec<usize> = (0..groups.len())
            .rev()
            .filter(|&k| self.mask.bucket_active[k])
            .collect();
        let copies: Vec<Vec<ParamCopy>> = order
            .iter()
            .map(|&k| bucket_copies(&self.plan.layout, &self.mask.active, k))
            .collect();
        let longest_chunk = self.longest_chunk();
        let buffers = self
            .memory
            .alloc_zeroed(longest_chunk)
            .and_then(|thread_send| {
                let send = self.memory.alloc_zeroed(longest_chunk)?;
                let (recv, _) = super::reduce::take_shortest(
                    &mut self.memory,
                    &mut self.buffers.pool,
                    self.plan.longest_bucket,
                )?;
                Ok((send, thread_send, recv))
            });
        let (mut send, thread_send, recv) = match buffers {
            Ok(buffers) => buffers,
            Err(e) => {
                if let Some(gathers) = self.deferred_gathers() {
                    gathers.access = Some(access);
                }
                return Err(e);
            }
        };
        self.refresh
            .start(needed_per_param(self.params.len(), &copies));
        let (job_tx, jobs) = mpsc::channel();
        let payload = Payload {
            comm: Arc::clone(&self.comm),
            jobs,
            send: thread_send,
            recv,
            access,
            refresh: Arc::clone(&self.refresh),
            dtype: self.gather_dtype(),
        };
        let started = match self.worker.as_ref().filter(|w| w.alive()) {
            Some(worker) => worker.run(payload, |memory, payload| payload.run(memory)),
            None => Err(payload),
        };
        let stepper = BucketStep::new(
            &self.plan,
            stepping,
            &self.mask.bucket_active,
            &self.window.early_stepped,
            self.buffers.grad_shard.as_ref(),
        )?;
        let mut stepped = Ok(());
        for (&k, copies) in order.iter().zip(copies) {
            let chunk = self.plan.layout.buckets[k].clone();
            let owned = copies_from(&self.plan.owned_copies[groups[k].clone()], chunk.start);
            stepped = step_bucket(
                &mut self.memory,
                self.optimizer.as_mut(),
                params,
                (&mut self.buffers.param_shard, grad_chunk.as_mut()),
                &stepper,
                (k, groups[k].clone()),
                &mut send,
            )
            .and_then(|()| self.memory.write_params(params, &owned, &send));
            if stepped.is_err() {
                break;
            }
            // The thread runs until the channel closes.
            let _ = job_tx.send(GatherJob {
                owned,
                chunk: chunk.len(),
                len: self.plan.layout.bucket_range(k).len(),
                copies,
            });
        }
        // Closing the channel ends the thread after the last job.
        drop(job_tx);
        let gathered = match started {
            Ok(handle) => {
                if let Some(gathers) = self.deferred_gathers() {
                    gathers.pending = Some(handle);
                    gathers.steps += 1;
                }
                Ok(())
            }
            Err(payload) => {
                // No thread: the same all-gathers, in the same order, here.
                tracing::warn!("no communication thread; gathering before the step returns");
                let finished = payload.run(&mut self.memory);
                self.take_back(finished)
            }
        };
        stepped.and(gathered)
    }

    /// Steps the active buckets in order, each all-gathered on a scoped
    /// communication thread while the next one steps, and writes the
    /// gathered buckets into the replica as they come back.
    fn step_and_gather_on_thread(
        &mut self,
        stepping: &[bool],
        params: &mut M::Params<'_>,
        groups: &[Range<usize>],
        mut grad_chunk: Option<M::Buffer>,
    ) -> Result<bool> {
        let layout = &self.plan.layout;
        let (jobs, job_rx) = mpsc::channel::<(usize, M::Buffer, M::Buffer)>();
        let (done_tx, done) = mpsc::channel::<Gathered<M::Buffer>>();
        let task = GatherTask {
            comm: Arc::clone(&self.comm),
            sizes: (0..layout.buckets.len())
                .map(|k| (layout.buckets[k].len(), layout.bucket_range(k).len()))
                .collect(),
            dtype: self.gather_dtype(),
            jobs: job_rx,
            done: done_tx,
        };
        let Some(Ok(ticket)) = self.worker.as_ref().map(|w| w.run(task, GatherTask::run)) else {
            // The thread is gone: the serial step gathers the same way.
            return Ok(false);
        };
        // The optimizer writes the shard while the thread sends from it, so
        // each bucket's chunk is first copied into a staging buffer of one
        // chunk (the serial gather sends from the shard itself): the
        // scratch bucket, which is that long, when it exists, else one for
        // this step only. The gather itself takes one bucket buffer, as the
        // serial one does (the next is taken after it came back).
        let longest_chunk = self.longest_chunk();
        let had_scratch = self.buffers.scratch.is_some();
        let mut staging: Vec<M::Buffer> = self.buffers.scratch.take().into_iter().collect();
        let stepper = BucketStep::new(
            &self.plan,
            stepping,
            &self.mask.bucket_active,
            &self.window.early_stepped,
            self.buffers.grad_shard.as_ref(),
        )?;
        let layout = &self.plan.layout;
        let optimizer = &mut self.optimizer;
        let param_shard = &mut self.buffers.param_shard;
        let mut landing = Landing {
            memory: &mut self.memory,
            pool: &mut self.buffers.pool,
            staging: &mut staging,
            layout,
            active: &self.mask.active,
            done,
            pending: 0,
        };
        let outcome = {
            let mut outcome = Ok(());
            for (k, group) in groups.iter().enumerate() {
                if !stepper.bucket_active[k] {
                    continue;
                }
                let mut send = match landing.staging.pop() {
                    Some(send) => send,
                    None => match landing.memory.alloc_zeroed(longest_chunk) {
                        Ok(send) => send,
                        Err(e) => {
                            outcome = Err(e);
                            break;
                        }
                    },
                };
                outcome = step_bucket(
                    landing.memory,
                    optimizer.as_mut(),
                    params,
                    (&mut *param_shard, grad_chunk.as_mut()),
                    &stepper,
                    (k, group.clone()),
                    &mut send,
                );
                if outcome.is_err() {
                    landing.staging.push(send);
                    break;
                }
                // One gather in flight (the next bucket steps meanwhile): its
                // buffers are what this overlap costs in memory.
                outcome = outcome.and(landing.wait_until(params, GATHERS_IN_FLIGHT - 1));
                // Overwritten whole by the gather: no need to zero.
                let recv = super::reduce::take_shortest(
                    landing.memory,
                    landing.pool,
                    layout.bucket_range(k).len(),
                );
                match recv {
                    Ok((recv, _)) => {
                        // The thread is alive while `jobs` is: it stops
                        // only when the channel closes.
                        let _ = jobs.send((k, send, recv));
                        landing.pending += 1;
                    }
                    Err(e) => {
                        landing.staging.push(send);
                        outcome = Err(e);
                        break;
                    }
                }
                // Write back what has arrived meanwhile.
                outcome = outcome.and(landing.take_arrived(params));
            }
            drop(jobs);
            outcome.and(landing.wait_until(params, 0))
        };
        // Closing `jobs` ended the task.
        let ended = ticket.wait().ok_or_else(|| {
            Error::State(
                "the communication thread panicked during the all-gathers; this rank's \
                 parameters were not all updated: restart the run from its last checkpoint"
                    .into(),
            )
        });
        if had_scratch {
            self.buffers.scratch = staging.pop();
        }
        outcome.and(ended).map(|()| true)
    }
}

fn no_grad_shard() -> Error {
    Error::State("internal: no gradient shard in stage 1 or 2".into())
}

/// The all-gathers of [`Engine::step_and_gather_on_thread`] on the
/// communication thread: each stepped bucket it is sent, in order, sent
/// back gathered; after a failure, it issues nothing more (the peers'
/// collectives fail within their deadline).
struct GatherTask<C, B> {
    comm: Arc<C>,
    /// Per bucket, the elements of one rank's chunk and of the bucket.
    sizes: Vec<(usize, usize)>,
    /// The dtype on the wire: the parameters' where master weights are
    /// kept (as `gather_buckets`).
    dtype: DType,
    jobs: mpsc::Receiver<(usize, B, B)>,
    done: mpsc::Sender<Gathered<B>>,
}

impl<C: Communicator, B> GatherTask<C, B> {
    fn run<T: Element, M: ShardMemory<T, C, Buffer = B>>(memory: &mut M, task: Self) {
        let mut failed = false;
        for (k, send, mut recv) in task.jobs {
            let result = if failed {
                Err(Error::State("an earlier all-gather failed".into()))
            } else {
                let (n, all) = task.sizes[k];
                memory.all_gather_as(&*task.comm, &send, 0..n, &mut recv, 0..all, task.dtype)
            };
            failed |= result.is_err();
            if task.done.send((k, send, recv, result)).is_err() {
                break;
            }
        }
    }
}

/// Where gathered buckets go: written into the replica, their buffers
/// back to the pool and the staging list.
struct Landing<'a, T: Element, C: Communicator, M: ShardMemory<T, C>> {
    memory: &'a mut M,
    pool: &'a mut Vec<M::Buffer>,
    staging: &'a mut Vec<M::Buffer>,
    layout: &'a Layout,
    active: &'a [bool],
    /// The gathered buckets coming back, and how many are still out.
    done: mpsc::Receiver<Gathered<M::Buffer>>,
    pending: usize,
}

impl<T: Element, C: Communicator, M: ShardMemory<T, C>> Landing<'_, T, C, M> {
    /// Waits for gathered buckets and writes them until at most `out` are
    /// still out (or the thread is gone); the first write error.
    fn wait_until(&mut self, params: &mut M::Params<'_>, out: usize) -> Result<()> {
        let mut outcome = Ok(());
        while self.pending > out {
            let Ok(back) = self.done.recv() else {
                break;
            };
            self.pending -= 1;
            outcome = outcome.and(self.write(params, back));
        }
        outcome
    }

    /// Writes the gathered buckets that have come back.
    fn take_arrived(&mut self, params: &mut M::Params<'_>) -> Result<()> {
        let mut outcome = Ok(());
        while let Ok(back) = self.done.try_recv() {
            self.pending -= 1;
            outcome = outcome.and(self.write(params, back));
        }
        outcome
    }

    /// Writes a gathered bucket's active parameters into `params` (if its
    /// gather succeeded) and keeps its buffers.
    fn write(&mut self, params: &mut M::Params<'_>, back: Gathered<M::Buffer>) -> Result<()> {
        let (k, send, recv, result) = back;
        let written = result.and_then(|()| {
            self.memory
                .write_params(params, &bucket_copies(self.layout, self.active, k), &recv)
        });
        self.staging.push(send);
        self.pool.push(recv);
        written
    }
}

/// What stepping one bucket of the shard reads (see [`step_bucket`]).
struct BucketStep<'a, B> {
    plan: &'a super::plan::Plan,
    /// The owned pieces to step, at shard offsets.
    pieces: Vec<StepPiece<'a>>,
    bucket_active: &'a [bool],
    /// Per bucket, whether the interleaved schedule stepped it already.
    early_stepped: &'a [bool],
    /// The reduced gradient shard.
    grads: &'a B,
}

impl<'a, B> BucketStep<'a, B> {
    /// What stepping reads: the plan and its pieces (those of `stepping`
    /// parameters active), the active buckets, those the interleaved
    /// schedule stepped, the reduced gradient shard (an error if none).
    fn new(
        plan: &'a super::plan::Plan,
        stepping: &[bool],
        bucket_active: &'a [bool],
        early_stepped: &'a [bool],
        grads: Option<&'a B>,
    ) -> Result<Self> {
        Ok(Self {
            plan,
            pieces: plan.step_pieces(|p| stepping[p]),
            bucket_active,
            early_stepped,
            grads: grads.ok_or_else(no_grad_shard)?,
        })
    }
}

/// Steps bucket `k` (owned pieces `group`) and leaves its updated chunk in
/// `send`: from the parameter shard, or, without one (`grad_chunk` given,
/// a lean shard), from the replica through `send` itself.
fn step_bucket<T, C, M>(
    memory: &mut M,
    optimizer: &mut dyn FunctionalOptimizer<T>,
    params: &mut M::Params<'_>,
    (param_shard, grad_chunk): (&mut M::Buffer, Option<&mut M::Buffer>),
    at: &BucketStep<'_, M::Buffer>,
    (k, group): (usize, Range<usize>),
    send: &mut M::Buffer,
) -> Result<()>
where
    T: Element,
    C: Communicator,
    M: ShardMemory<T, C>,
{
    let shard_range = at.plan.layout.buckets[k].clone();
    let shard_len = at.plan.partition.shard_numel;
    if let Some(grad_chunk) = grad_chunk {
        return step_from_replica(
            memory,
            optimizer,
            params,
            (&at.plan.owned_copies[group.clone()], &at.pieces[group]),
            (shard_range, shard_len),
            (send, grad_chunk, at.grads),
        );
    }
    if at.early_stepped.get(k) != Some(&true) {
        let plan = StepPlan {
            pieces: &at.pieces[group],
            buckets: &at.plan.layout.buckets,
            bucket_active: at.bucket_active,
            origin: 0,
            shard_len,
        };
        memory.step(optimizer, param_shard, at.grads, plan)?;
    }
    memory.copy_range(send, 0, param_shard, shard_range, false)
}

/// `copies` (at shard offsets) at their places in a buffer that holds the
/// shard from `start` on (one bucket's chunk).
fn copies_from(copies: &[ParamCopy], start: usize) -> Vec<ParamCopy> {
    copies
        .iter()
        .map(|c| ParamCopy {
            at: c.at - start,
            ..c.clone()
        })
        .collect()
}

/// What a stepped chunk holds and the dtype it is gathered in.
#[derive(Clone, Copy)]
enum Wire {
    /// The chunk's values, gathered rounded to the dtype
    /// ([`ShardMemory::all_gather_as`]).
    As(DType),
    /// The chunk's values already rounded to the 16-bit dtype, packed
    /// ([`ShardMemory::all_gather_packed`]).
    Packed(DType),
}

/// All-gathers bucket `k` (`active` parameters of `layout`) from this
/// rank's stepped chunk in `send` into `recv`, as `wire` says, and writes
/// it into the replica.
fn gather_into_replica<T, C, M>(
    memory: &mut M,
    comm: &C,
    params: &mut M::Params<'_>,
    (send, recv, wire): (&M::Buffer, &mut M::Buffer, Wire),
    (layout, active, k): (&Layout, &[bool], usize),
) -> Result<()>
where
    T: Element,
    C: Communicator,
    M: ShardMemory<T, C>,
{
    let (n, all) = (layout.buckets[k].len(), layout.bucket_range(k).len());
    match wire {
        Wire::As(dtype) => memory.all_gather_as(comm, send, 0..n, recv, 0..all, dtype)?,
        Wire::Packed(dtype) => memory.all_gather_packed(comm, send, n, recv, 0..all, dtype)?,
    }
    memory.write_params(params, &bucket_copies(layout, active, k), recv)
}

/// Where bucket `k`'s active parameters lie in the gathered bucket.
fn bucket_copies(layout: &Layout, active: &[bool], k: usize) -> Vec<ParamCopy> {
    let start = layout.bucket_range(k).start;
    layout
        .runs_of(k)
        .iter()
        .filter(|run| active[run.param])
        .map(|run| ParamCopy {
            param: run.param,
            param_range: run.param_range.clone(),
            at: run.pos - start,
        })
        .collect()
}

/// Per parameter, how many of the gathers (the buckets' `copies`, in
/// order) must be written before it is current: one past the last that
/// holds a piece of it.
fn needed_per_param(params: usize, copies: &[Vec<ParamCopy>]) -> Vec<usize> {
    let mut needed = vec![0; params];
    for (i, bucket) in copies.iter().enumerate() {
        for copy in bucket {
            needed[copy.param] = i + 1;
        }
    }
    needed
}

/// Steps the owned pieces of one bucket without a shard copy: reads their
/// values from the replica into `values` and their gradients (shard range
/// `shard_range` of `grads`) into `grad_chunk`, and steps them there.
/// `copies` and `pieces` are the bucket's owned pieces, at shard offsets;
/// `shard_len` is the whole shard's length.
fn step_from_replica<T, C, M>(
    memory: &mut M,
    optimizer: &mut dyn FunctionalOptimizer<T>,
    params: &mut M::Params<'_>,
    (copies, pieces): (&[ParamCopy], &[StepPiece<'_>]),
    (shard_range, shard_len): (Range<usize>, usize),
    (values, grad_chunk, grads): (&mut M::Buffer, &mut M::Buffer, &M::Buffer),
) -> Result<()>
where
    T: Element,
    C: Communicator,
    M: ShardMemory<T, C>,
{
    let start = shard_range.start;
    let copies = copies_from(copies, start);
    memory.read_params(params, &copies, values)?;
    memory.copy_range(grad_chunk, 0, grads, shard_range.clone(), false)?;
    let pieces: Vec<StepPiece<'_>> = pieces
        .iter()
        .map(|p| StepPiece {
            range: p.range.start - start..p.range.end - start,
            ..*p
        })
        .collect();
    let whole = [Range {
        start: 0,
        end: shard_range.len(),
    }];
    let plan = StepPlan {
        pieces: &pieces,
        buckets: &whole,
        bucket_active: &[true],
        origin: start,
        shard_len,
    };
    memory.step(optimizer, values, grad_chunk, plan)
}
