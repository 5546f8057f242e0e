//! Gradient reductions that overlap backward.
//!
//! A framework that hands gradients over during backward first calls
//! [`Engine::begin_backward`] with the order in which they will arrive (for
//! Candle, the variables' order in `loss.sorted_nodes()`). On the first call
//! the engine re-partitions its parameters in that order
//! ([`Interleaved`](crate::partition::Interleaved)), so that bucket `k` is
//! one contiguous stretch of the order. Then, for this backward pass:
//! - each gradient is flattened into its bucket's buffer, taken from a small
//!   pool (no full gradient buffer in stage 2);
//! - a bucket is complete when every gradient predicted for it has arrived;
//!   bucket `k` is launched once it is complete and every lower bucket has
//!   been, so every rank issues the same collectives in the same order;
//! - launched buckets are reduced (all-reduce in stage 0, reduce-scatter into
//!   the gradient shard in stages 1 and 2) on a communication thread while
//!   backward goes on ([`Overlap::AfterBackward`]), or all after backward on
//!   the caller's thread ([`Overlap::None`]): the same operations in the same
//!   order, so both give the same bits;
//! - the step flushes what was not predicted (parameters used outside hooked
//!   layers, unused ones) in bucket order, then adds, in a second reduction
//!   of their bucket, gradients that arrived after their bucket had been
//!   launched (a weight also used by a plain op). Reduction is linear, so the
//!   result is the same up to float rounding;
//! - at stage 0 the step then steps each window of parameters as soon as
//!   the reductions of its buckets are back, while later ones are still on
//!   the wire ([`Engine::step_ddp_as_reduced`], PyTorch's
//!   `hook_with_zero_step`), where nothing needs every gradient first.
//!
//! Stage 2 reduce-scatters every micro-step into the shard (sums, averaged
//! at the step), so no full gradient buffer lives across an accumulation
//! window. Stages 0 and 1 accumulate earlier micro-steps in their full
//! buffer, locally, and reduce on the last one, folding the sum into each
//! bucket as it is launched.

use super::{Engine, Overlap, ShardMemory, Stage, StepPiece, StepPlan};
use crate::comm::{Communicator, ReduceOp};
use crate::optim::{FunctionalOptimizer, Hyperparams, OptimizerState, ParamKey, ParamMut};
use crate::partition::Interleaved;
use crate::{DType, Element, Error, Result};
use std::ops::Range;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc, Arc};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

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

/// All-gathers of stepped buckets allowed in flight at once after backward.
const GATHERS_IN_FLIGHT: usize = 1;

/// Counts the bucket reductions an engine has completed, across steps: a
/// handle to watch overlap happen (tests, probes, progress displays).
#[derive(Clone, Debug, Default)]
pub struct ReductionProgress(Arc<AtomicUsize>);

impl ReductionProgress {
    /// Reductions completed so far.
    pub fn completed(&self) -> usize {
        self.0.load(Ordering::Acquire)
    }

    /// Waits until at least `count` reductions have completed; `false` if
    /// `timeout` passed first.
    pub fn wait_for(&self, count: usize, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        while self.completed() < count {
            if Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(Duration::from_micros(100));
        }
        true
    }

    fn add_one(&self) {
        self.0.fetch_add(1, Ordering::AcqRel);
    }
}

/// Where reduced buckets land (and, interleaved, what steps them); lent to
/// the communication thread for a backward pass.
pub(super) struct Targets<T: Element, B> {
    /// The full gradient buffer: stage 0's reduced gradients; in stages 0
    /// and 1 also the earlier micro-steps to fold into each bucket.
    pub full: Option<B>,
    /// The gradient shard (stages 1 and 2).
    pub shard: Option<B>,
    /// A shard-bucket-sized buffer to reduce-scatter into when adding;
    /// allocated only once something adds.
    pub scratch: Option<B>,
    /// The optimizer step of buckets reduced during backward.
    pub early: Option<EarlyStep<T, B>>,
}

/// The optimizer step of the buckets whose reduction completes during
/// backward ([`Overlap::Interleaved`]), lent to the communication thread.
pub(super) struct EarlyStep<T: Element, B> {
    optimizer: Box<dyn FunctionalOptimizer<T>>,
    /// The parameter shard.
    params: B,
    keys: Vec<ParamKey>,
    /// Per owned piece, its shard range and whether it steps.
    pieces: Vec<(Range<usize>, bool)>,
    /// Per bucket, its range of `pieces`.
    bucket_pieces: Vec<Range<usize>>,
    /// `1/m` for `m > 1` micro-steps: the average, taken before stepping.
    scale: Option<f64>,
    /// Per bucket, whether it was stepped.
    stepped: Vec<bool>,
}

/// One bucket reduction.
pub(super) struct Job<B> {
    bucket: usize,
    buffer: B,
    /// Add the accumulated micro-steps (`Targets::full`) before reducing.
    fold_full: bool,
    /// Add the reduced bucket into the target instead of overwriting it.
    add: bool,
    /// Step the bucket's shard once reduced (interleaved).
    step: bool,
}

/// A bucket buffer back from the communication thread.
pub(super) struct Back<B> {
    bucket: usize,
    /// `Some(add)` once reduced (`add`: to be added into the full buffer
    /// rather than written over it); `None` if the reduction failed or was
    /// never issued (an earlier one failed).
    reduced: Option<bool>,
    buffer: B,
}

/// The buffers coming back from the communication thread, and what is
/// still out there.
pub(super) struct Returns<B> {
    rx: mpsc::Receiver<Back<B>>,
    /// Jobs sent whose buffer has not come back yet.
    in_flight: usize,
    /// Per bucket, its jobs sent whose buffer has not come back yet.
    pending: Vec<usize>,
    /// A job could not be sent (the thread is gone): `pending` no longer
    /// tells which buckets are reduced.
    lost: bool,
}

impl<B> Returns<B> {
    fn sent(&mut self, bucket: usize) {
        self.in_flight += 1;
        self.pending[bucket] += 1;
    }

    /// The next buffer back: waiting for it (`block`) or only if it is
    /// there. `None` when there is none (or, blocking, the thread is gone:
    /// it panicked, which joining reports).
    fn next(&mut self, block: bool) -> Option<Back<B>> {
        let back = if block {
            self.rx.recv().ok()?
        } else {
            self.rx.try_recv().ok()?
        };
        self.in_flight = self.in_flight.saturating_sub(1);
        self.pending[back.bucket] = self.pending[back.bucket].saturating_sub(1);
        Some(back)
    }
}

/// What the communication thread needs to know about the buckets.
#[derive(Clone, Debug)]
pub(super) struct BucketMap {
    stage: Stage,
    /// Per bucket, its range in bucket-major order.
    full: Vec<Range<usize>>,
    /// Per bucket, its range in the shard.
    shard: Vec<Range<usize>>,
    /// The dtype gradients travel in.
    wire: DType,
}

/// Runs one bucket reduction with `comm` and `memory` into `targets`.
fn reduce_bucket<T, C, M>(
    comm: &C,
    memory: &mut M,
    map: &BucketMap,
    targets: &mut Targets<T, M::Buffer>,
    job: &mut Job<M::Buffer>,
) -> Result<()>
where
    T: Element,
    C: Communicator,
    M: ShardMemory<T, C>,
{
    reduce_only(comm, memory, map, targets, job)?;
    if !job.step {
        return Ok(());
    }
    let Some(early) = targets.early.as_mut() else {
        return Ok(());
    };
    let k = job.bucket;
    let grads = match map.stage {
        Stage::Ddp => targets.full.as_mut(),
        _ => targets.shard.as_mut(),
    }
    .ok_or_else(|| Error::State("internal: a reduction target is missing".into()))?;
    if let Some(factor) = early.scale {
        memory.scale(grads, &[map.shard[k].clone()], factor)?;
    }
    let pieces: Vec<StepPiece<'_>> = early.pieces[early.bucket_pieces[k].clone()]
        .iter()
        .zip(&early.keys[early.bucket_pieces[k].clone()])
        .map(|((range, steps), key)| StepPiece {
            key,
            range: range.clone(),
            active: *steps,
        })
        .collect();
    let plan = StepPlan {
        pieces: &pieces,
        buckets: &map.shard[k..=k],
        bucket_active: &[true],
        origin: 0,
        shard_len: map.shard.last().map_or(0, |b| b.end),
    };
    memory.step(early.optimizer.as_mut(), &mut early.params, grads, plan)?;
    early.stepped[k] = true;
    Ok(())
}

fn reduce_only<T, C, M>(
    comm: &C,
    memory: &mut M,
    map: &BucketMap,
    targets: &mut Targets<T, M::Buffer>,
    job: &mut Job<M::Buffer>,
) -> Result<()>
where
    T: Element,
    C: Communicator,
    M: ShardMemory<T, C>,
{
    let missing = || Error::State("internal: a reduction target is missing".into());
    let range = map.full[job.bucket].clone();
    let len = range.len();
    if map.stage == Stage::Ddp {
        all_reduce_bucket(comm, memory, map, targets, job)?;
        // Without the full buffer (lent to no thread: `Window::lands`) the
        // caller writes the bucket in when its buffer comes back.
        if targets.full.is_none() {
            return Ok(());
        }
        return write_full(memory, map, targets, job.bucket, &job.buffer, job.add);
    }
    if job.fold_full {
        let full = targets.full.as_ref().ok_or_else(missing)?;
        memory.copy_range(&mut job.buffer, 0, full, range.clone(), true)?;
    }
    let shard_range = map.shard[job.bucket].clone();
    let shard = targets.shard.as_mut().ok_or_else(missing)?;
    if !job.add {
        return memory.reduce_scatter_as(
            comm,
            &job.buffer,
            0..len,
            shard,
            shard_range,
            ReduceOp::Avg,
            map.wire,
        );
    }
    let n = shard_range.len();
    // Allocated on first need (a gradient that came after its bucket was
    // launched), by whichever memory runs the reduction.
    let scratch = match &mut targets.scratch {
        Some(scratch) if M::buffer_len(scratch) >= n => scratch,
        slot => {
            let longest = map.shard.iter().map(Range::len).max().unwrap_or(0);
            slot.insert(memory.alloc_zeroed(longest)?)
        }
    };
    memory.reduce_scatter_as(
        comm,
        &job.buffer,
        0..len,
        scratch,
        0..n,
        ReduceOp::Avg,
        map.wire,
    )?;
    memory.copy_range(shard, shard_range.start, scratch, 0..n, true)
}

/// Stage 0's reduction of one bucket: adds the accumulated micro-steps
/// when asked (`fold_full`), then all-reduces the bucket buffer in place.
fn all_reduce_bucket<T, C, M>(
    comm: &C,
    memory: &mut M,
    map: &BucketMap,
    targets: &Targets<T, M::Buffer>,
    job: &mut Job<M::Buffer>,
) -> Result<()>
where
    T: Element,
    C: Communicator,
    M: ShardMemory<T, C>,
{
    let range = map.full[job.bucket].clone();
    let len = range.len();
    if job.fold_full {
        let full = targets
            .full
            .as_ref()
            .ok_or_else(|| Error::State("internal: no full gradient buffer".into()))?;
        memory.copy_range(&mut job.buffer, 0, full, range, true)?;
    }
    memory.all_reduce_as(comm, &mut job.buffer, 0..len, ReduceOp::Avg, map.wire)
}

/// Stage 0: writes (`add`: adds) a reduced bucket into the full buffer.
fn write_full<T, C, M>(
    memory: &mut M,
    map: &BucketMap,
    targets: &mut Targets<T, M::Buffer>,
    bucket: usize,
    buffer: &M::Buffer,
    add: bool,
) -> Result<()>
where
    T: Element,
    C: Communicator,
    M: ShardMemory<T, C>,
{
    let range = map.full[bucket].clone();
    let full = targets
        .full
        .as_mut()
        .ok_or_else(|| Error::State("internal: no full gradient buffer".into()))?;
    memory.copy_range(full, range.start, buffer, 0..range.len(), add)
}

/// What the communication thread gives back: the targets and the first
/// failure (`None` if it never got the targets).
type Returned<T, B> = Option<(Targets<T, B>, Result<()>)>;

/// Who runs the reductions of a backward pass.
enum Reducer<T: Element, B> {
    /// Queued until the end of backward, then run on the caller's thread.
    Deferred {
        targets: Targets<T, B>,
        queue: Vec<Job<B>>,
    },
    /// Run on the caller's thread as each bucket is launched, by a memory
    /// whose collectives complete after they return
    /// ([`ShardMemory::launches_async`]): the buffers are held until the
    /// memory settles at the end of backward.
    Inline {
        targets: Targets<T, B>,
        /// The buckets, built once for the pass.
        map: BucketMap,
        queue: Vec<Job<B>>,
        /// Every buffer a reduction used, with, at stage 0, the bucket to
        /// write into the full buffer once settled (and whether to add).
        held: Vec<(Option<(usize, bool)>, B)>,
        result: Result<()>,
    },
    /// Sent to a communication thread as each bucket is launched.
    Thread {
        jobs: mpsc::Sender<Job<B>>,
        returned: Returns<B>,
        handle: JoinHandle<Returned<T, B>>,
    },
}

/// The state of one backward pass whose gradients are being handed over.
pub(super) struct Window<T: Element, B> {
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
    fold_full: bool,
    add: bool,
    /// Buckets completed during backward are stepped by the reducer.
    step_early: bool,
    /// Stage 0 on a communication thread: the full gradient buffer stays
    /// with the engine, each bucket's earlier micro-steps are folded in as
    /// it is launched, and each reduced bucket is written into the full
    /// buffer when its buffer comes back, so the step can begin with the
    /// buckets already back while later ones are on the wire.
    lands: bool,
    reducer: Reducer<T, B>,
    /// Bucket buffers held before a new one waits ([`MIN_BUCKET_BUFFERS`]).
    buffer_limit: usize,
}

impl<T: Element, B> Window<T, B> {
    /// How many bucket buffers are being filled.
    fn holding(&self) -> usize {
        self.open.iter().chain(&self.late).flatten().count()
    }
}

/// The order hash as exactly representable `f64` pieces, then their
/// negatives: one `Max` all-reduce tells whether every rank agrees.
pub(super) fn order_fingerprint(expected: &[(usize, usize)]) -> [f64; 8] {
    let words = expected
        .iter()
        .flat_map(|&(param, calls)| [param as u64, calls as u64]);
    hash_fingerprint(fnv1a(words))
}

/// FNV-1a of a sequence of words: stable across processes and builds
/// (std's hasher is not), so ranks can compare what they computed.
pub(super) fn fnv1a(words: impl IntoIterator<Item = u64>) -> u64 {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for word in words {
        for byte in word.to_le_bytes() {
            hash ^= u64::from(byte);
            hash = hash.wrapping_mul(0x0100_0000_01b3);
        }
    }
    hash
}

/// A 64-bit hash as 4 exact 16-bit pieces and their negations: one Max
/// all-reduce then tells whether every rank has the same hash.
fn hash_fingerprint(hash: u64) -> [f64; 8] {
    let mut out = [0.0; 8];
    for i in 0..4 {
        let piece = ((hash >> (16 * i)) & 0xffff) as f64;
        out[i] = piece;
        out[i + 4] = -piece;
    }
    out
}

impl<T, C, M> Engine<T, C, M>
where
    T: Element,
    C: Communicator + 'static,
    M: ShardMemory<T, C> + 'static,
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
        if self.window.is_some() {
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
        // One all-reduce checks that every rank predicts the same gradient
        // order and, at stage 3, that its forward gathered the same layers
        // (the fetcher also plans the backward's gathers here).
        let forward = match self.fetcher.clone() {
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
        let worker_memory = self.memory.fork();
        // Stage 0 stepping each bucket as it is reduced all-reduces the
        // trainable mask beside the reductions: on a communicator of its own
        // (the same decision on every rank: it depends on the configuration).
        if self.side.is_none()
            && worker_memory.is_some()
            && self.config.check_trainability
            && self.steps_ddp_as_reduced()
            && self.comm.concurrent_groups()
        {
            let world: Vec<usize> = (0..self.comm.world_size()).collect();
            self.side = self.comm.split(&world)?;
        }
        // A memory whose collectives are asynchronous (a GPU stream) needs
        // no thread: its reductions are queued as buckets fill.
        let inline = worker_memory.is_none()
            && self.memory.launches_async()
            && self.config.overlap == Overlap::AfterBackward
            && self.fetcher.is_none();
        if worker_memory.is_none() && !inline {
            // This memory reduces in the step; the gradients go to the full
            // buffer as before.
            return Ok(());
        }
        self.plan_in_order(expected)?;
        let last_micro_step = self.micro_steps + 1 >= self.config.grad_accum_steps;
        if !self.config.stage.shards_gradients() && !last_micro_step {
            // Stages 0 and 1 accumulate locally until the last micro-step.
            return Ok(());
        }

        let buckets = self.layout.buckets.len();
        let mut expected_calls = vec![0; self.params.len()];
        for &(param, calls) in expected {
            expected_calls[param] = calls;
        }
        let mut remaining = vec![0usize; buckets];
        for (param, &calls) in expected_calls.iter().enumerate() {
            for &run in &self.runs_of_param[param] {
                remaining[self.bucket_of_run[run]] += calls;
            }
        }
        let predicted = remaining.iter().map(|&r| r > 0).collect();

        let stage = self.config.stage;
        // Micro-steps given earlier in this window without a pass (slots,
        // or `accumulate_param` alone) are in the full buffer: fold them
        // into each bucket once. Stage 2 then adds to what earlier passes
        // reduced into the shard.
        let fold_full = self.window_open;
        let add = stage.shards_gradients() && self.shard_accumulated;
        // Adding into the shard reduce-scatters into `scratch`: later
        // micro-steps need it from the start. Gradients that come after
        // their bucket was launched get it where their reduction runs
        // (`reduce_only`); a pass with neither never holds it.
        if add && self.scratch.is_none() {
            let longest = self.layout.buckets.iter().map(Range::len).max();
            self.scratch = Some(self.memory.alloc_zeroed(longest.unwrap_or(0))?);
        }
        if stage == Stage::Ddp && self.full_grads.is_none() {
            self.full_grads = Some(self.memory.alloc_zeroed(self.plan.flat_numel())?);
        }
        // Stage 0 steps the replica after backward, bucket by bucket, with
        // no parameter copy to step early: there the interleaved schedule
        // steps after backward.
        let early = match self.config.overlap {
            Overlap::Interleaved if last_micro_step && stage != Stage::Ddp => {
                // Master weights, when kept, are not read again.
                self.refresh_param_shard(params)?;
                self.params_read = true;
                self.lend_early_step(&expected_calls)?
            }
            _ => None,
        };
        let step_early = early.is_some();
        if stage.shards_gradients() && fold_full {
            // Folded into this pass's reductions: the next pass must not
            // fold them again.
            self.window_open = false;
        }
        // Stage 3 on a communicator that must not run two collectives at
        // once (MPI) gathers on this thread during backward: the
        // reductions wait until after it.
        let serial = self.fetcher.as_ref().is_some_and(|f| !f.threaded());
        let lands = stage == Stage::Ddp
            && !serial
            && self.config.overlap != Overlap::None
            && worker_memory.is_some();
        let targets = Targets {
            full: if (stage == Stage::Ddp && !lands) || (stage != Stage::Ddp && fold_full) {
                self.full_grads.take()
            } else {
                None
            },
            shard: self.grad_shard.take(),
            scratch: self.scratch.take(),
            early,
        };
        let reducer = match self.config.overlap {
            _ if serial => Reducer::Deferred {
                targets,
                queue: Vec::new(),
            },
            Overlap::None => Reducer::Deferred {
                targets,
                queue: Vec::new(),
            },
            Overlap::AfterBackward | Overlap::Interleaved => match worker_memory {
                Some(worker_memory) => self.spawn_reducer(worker_memory, targets),
                None => {
                    self.memory.defer_completion();
                    Reducer::Inline {
                        targets,
                        map: self.bucket_map(),
                        queue: Vec::new(),
                        held: Vec::new(),
                        result: Ok(()),
                    }
                }
            },
        };
        let longest = (0..buckets)
            .map(|k| self.layout.bucket_range(k).len())
            .max();
        let bucket_bytes = longest.unwrap_or(1).max(1) * std::mem::size_of::<T>();
        let buffer_limit = match reducer {
            // Held until the end of backward: no buffer comes back earlier.
            Reducer::Inline { .. } => usize::MAX,
            _ => (BUCKET_BUFFER_BYTES / bucket_bytes).max(MIN_BUCKET_BUFFERS),
        };
        self.window = Some(Window {
            expected_calls,
            seen_calls: vec![0; self.layout.runs.len()],
            filled: vec![0; self.layout.runs.len()],
            remaining,
            predicted,
            open: (0..buckets).map(|_| None).collect(),
            late: (0..buckets).map(|_| None).collect(),
            next: 0,
            fold_full,
            add,
            step_early,
            lands,
            reducer,
            buffer_limit,
        });
        // A model whose first buckets get no hooked gradient launches
        // nothing until the end; one whose buckets are all predicted starts
        // with the first arrival.
        Ok(())
    }

    /// Lends the optimizer and the parameter shard for the interleaved
    /// schedule: the pieces of predicted parameters step with their bucket.
    /// `None` when a piece straddles buckets (a partition not made in
    /// gradient order): then everything steps after backward, with the same
    /// result.
    fn lend_early_step(
        &mut self,
        expected_calls: &[usize],
    ) -> Result<Option<EarlyStep<T, M::Buffer>>> {
        let Some(bucket_pieces) = self.pieces_by_bucket() else {
            return Ok(None);
        };
        let base = self.plan_rank * self.plan.shard_numel;
        let pieces = self
            .owned
            .iter()
            .map(|piece| {
                let at = piece.flat_range.start - base;
                let p = piece.param;
                let trains = if self.config.check_trainability {
                    self.trainable[p]
                } else {
                    self.active[p]
                };
                (at..at + piece.len(), trains && expected_calls[p] > 0)
            })
            .collect();
        let micro_steps = self.micro_steps + 1;
        let kind = self.optimizer.kind().to_string();
        let optimizer = std::mem::replace(&mut self.optimizer, Box::new(LentOptimizer(kind)));
        let params = std::mem::replace(&mut self.param_shard, self.memory.alloc_zeroed(0)?);
        Ok(Some(EarlyStep {
            optimizer,
            params,
            // Lent like the optimizer (the engine is lent to backward, so
            // nothing reads them meanwhile); back at the join.
            keys: std::mem::take(&mut self.keys),
            pieces,
            bucket_pieces,
            scale: (micro_steps > 1).then(|| 1.0 / micro_steps as f64),
            stepped: vec![false; self.layout.buckets.len()],
        }))
    }

    /// Starts the communication thread of one backward pass; if no thread
    /// can be started, the reductions run after backward instead (the same
    /// result, without overlap).
    fn spawn_reducer(
        &mut self,
        mut memory: M,
        targets: Targets<T, M::Buffer>,
    ) -> Reducer<T, M::Buffer> {
        let (jobs, job_rx) = mpsc::channel::<Job<M::Buffer>>();
        let (returned_tx, returned) = mpsc::channel::<Back<M::Buffer>>();
        // The targets travel once the thread exists, so a failed start
        // loses nothing.
        let (targets_tx, targets_rx) = mpsc::channel::<Targets<T, M::Buffer>>();
        let comm = Arc::clone(&self.comm);
        let map = self.bucket_map();
        let progress = self.progress.clone();
        let spawned = std::thread::Builder::new()
            .name(format!("zero-comm-{}", self.comm.rank()))
            .spawn(move || {
                let mut targets = targets_rx.recv().ok()?;
                let mut result = Ok(());
                for mut job in job_rx {
                    // After a failure, issue nothing more: the peers fail
                    // their pending collectives within the deadline too.
                    let mut reduced = None;
                    if result.is_ok() {
                        result = reduce_bucket(&*comm, &mut memory, &map, &mut targets, &mut job);
                        if result.is_ok() {
                            progress.add_one();
                            reduced = Some(job.add);
                        }
                    }
                    // The engine may have finished with the pool already.
                    let _ = returned_tx.send(Back {
                        bucket: job.bucket,
                        reduced,
                        buffer: job.buffer,
                    });
                }
                Some((targets, result))
            });
        match spawned {
            Ok(handle) => {
                // The thread waits for this message: it cannot be gone.
                let _ = targets_tx.send(targets);
                Reducer::Thread {
                    jobs,
                    returned: Returns {
                        rx: returned,
                        in_flight: 0,
                        pending: vec![0; self.layout.buckets.len()],
                        lost: false,
                    },
                    handle,
                }
            }
            Err(e) => {
                tracing::warn!("no communication thread ({e}); reducing after backward");
                Reducer::Deferred {
                    targets,
                    queue: Vec::new(),
                }
            }
        }
    }

    /// Re-partitions in the order of `expected` (then the other parameters,
    /// by name) if nothing depends on the current partition yet: no step
    /// taken, no state, nothing accumulated. Later changes of the order keep
    /// the partition (overlap may suffer; results do not).
    pub(super) fn plan_in_order(&mut self, expected: &[(usize, usize)]) -> Result<()> {
        let mut order = Vec::with_capacity(self.params.len());
        let mut placed = vec![false; self.params.len()];
        // Stage 3: the parameters that may be sharded first, the persistent
        // ones after a break, so that no bucket holds both kinds.
        let persist = self.config.persist_numel;
        let small =
            |p: usize| self.config.stage == Stage::Parameters && self.params[p].numel() <= persist;
        for pass_small in [false, true] {
            for &(param, _) in expected {
                if !placed[param] && small(param) == pass_small {
                    placed[param] = true;
                    order.push(param);
                }
            }
        }
        let large = order.iter().filter(|&&p| !small(p)).count();
        order.extend((0..self.params.len()).filter(|&p| !placed[p]));
        if self.planned_order.as_deref() == Some(&order[..]) {
            return Ok(());
        }
        let fresh = self.steps == 0
            && self.micro_steps == 0
            && !self.window_open
            && self.memory.state_bytes(self.optimizer.as_ref()) == 0
            // Master weights loaded from a checkpoint live in this plan's
            // shard.
            && !self.masters_fresh;
        if !fresh || self.config.partitioner != super::PartitionerKind::Flat {
            if self.planned_order.is_some() {
                tracing::debug!("gradient-ready order changed; keeping the partition");
            }
            self.planned_order = Some(order);
            return Ok(());
        }
        let world = match self.config.stage {
            Stage::Ddp => 1,
            _ => self.comm.world_size(),
        };
        // The parameters no gradient was predicted for start a bucket of
        // their own: a bucket launched on its predicted gradients then never
        // waits for, or misses, one of them.
        let predicted = placed.iter().filter(|&&p| p).count();
        let mut breaks = vec![large, predicted];
        if self.config.stage == Stage::Parameters {
            breaks.extend(super::setup::stage3_breaks::<T>(
                &self.params,
                &order[..large],
                &self.config,
            ));
        }
        let plan = Interleaved::default().partition_in_order(
            &self.params,
            &order,
            world,
            // Buckets hold `T`, not the parameters' dtype.
            super::setup::partition_bucket_bytes::<T>(
                &self.params,
                self.config.bucket_bytes,
                world,
            ),
            &breaks,
        )?;
        self.install_plan(plan)?;
        self.planned_order = Some(order);
        Ok(())
    }
}

impl<T, C, M> Engine<T, C, M>
where
    T: Element,
    C: Communicator,
    M: ShardMemory<T, C>,
{
    /// Hands (the elements `range` of) one gradient to the open backward
    /// pass: flattens it into its buckets and launches the buckets it
    /// completes. A run counts towards its bucket once a call has covered
    /// it whole, whether in one range or several.
    pub(super) fn window_accumulate(
        &mut self,
        param: usize,
        range: Range<usize>,
        grad: M::Grad<'_>,
        predicted: bool,
    ) -> Result<()> {
        for i in 0..self.runs_of_param[param].len() {
            let r = self.runs_of_param[param][i];
            let Some(window) = self.window.as_mut() else {
                return Err(Error::State("internal: no backward pass is open".into()));
            };
            let run = &self.layout.runs[r];
            let k = self.bucket_of_run[r];
            let start = self.layout.bucket_range(k).start;
            let Some(piece) = super::piece_of(run, &range, grad, start) else {
                continue;
            };
            if k < window.next && window.step_early {
                return Err(Error::State(format!(
                    "{:?} got a gradient after its bucket had been reduced and stepped (overlap \
                     interleaved): it is used outside the hooked layers, or more often than \
                     predicted. Use overlap after-backward for this model",
                    self.params[param].name
                )));
            }
            let holding = window.holding();
            let slot = if k < window.next {
                &mut window.late[k]
            } else {
                &mut window.open[k]
            };
            if slot.is_none() {
                let len = self.layout.bucket_range(k).len();
                let full = self.full_grads.as_mut().filter(|_| window.lands);
                *slot = Some(take_buffer(
                    &mut self.memory,
                    &mut self.pool,
                    &mut window.reducer,
                    (holding, window.buffer_limit),
                    len,
                    (&self.layout, full),
                )?);
            }
            let buffer = slot.as_mut().expect("filled above");
            let covered = piece.range.len();
            self.memory.flatten(buffer, &[piece], true)?;
            window.filled[r] += covered;
            if window.filled[r] < run.param_range.len() {
                continue;
            }
            window.filled[r] = 0;
            window.seen_calls[r] += 1;
            if predicted && window.seen_calls[r] <= window.expected_calls[param] && k >= window.next
            {
                window.remaining[k] = window.remaining[k].saturating_sub(1);
                // Launched before the next bucket of a long gradient is
                // opened, so that it can take this one's place.
                if window.remaining[k] == 0 {
                    self.launch_ready(false)?;
                }
            }
        }
        self.present[param] = true;
        self.launch_ready(false)
    }

    /// Launches every bucket that is due: complete ones in order, or (at the
    /// end of backward, `all`) every one left.
    fn launch_ready(&mut self, all: bool) -> Result<()> {
        let Some(window) = self.window.as_mut() else {
            return Ok(());
        };
        while window.next < window.open.len()
            && (all || (window.predicted[window.next] && window.remaining[window.next] == 0))
        {
            let k = window.next;
            let holding = window.holding();
            let full = self.full_grads.as_mut().filter(|_| window.lands);
            let mut buffer = match window.open[k].take() {
                Some(buffer) => buffer,
                None => take_buffer(
                    &mut self.memory,
                    &mut self.pool,
                    &mut window.reducer,
                    (holding, window.buffer_limit),
                    self.layout.bucket_range(k).len(),
                    (&self.layout, full),
                )?,
            };
            let mut fold_full = window.fold_full;
            if window.lands && fold_full {
                // The full buffer stays here: the earlier micro-steps are
                // folded in now, as the thread would have.
                let full = self.full_grads.as_ref().ok_or_else(|| {
                    Error::State("internal: no full gradient buffer in stage 0".into())
                })?;
                self.memory
                    .copy_range(&mut buffer, 0, full, self.layout.bucket_range(k), true)?;
                fold_full = false;
            }
            let job = Job {
                bucket: k,
                buffer,
                fold_full,
                add: window.add,
                // What is launched at the end waits for the step's mask.
                step: window.step_early && !all,
            };
            submit(&mut window.reducer, job);
            window.next += 1;
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
        let Some(window) = self.window.as_mut() else {
            return;
        };
        let Reducer::Inline {
            targets,
            map,
            queue,
            held,
            result,
        } = &mut window.reducer
        else {
            return;
        };
        for mut job in std::mem::take(queue) {
            let mut write = None;
            if result.is_ok() {
                let comm = &*self.comm;
                *result = if map.stage == Stage::Ddp {
                    // Written into the full buffer once settled.
                    write = Some((job.bucket, job.add));
                    all_reduce_bucket(comm, &mut self.memory, map, targets, &mut job)
                } else if job.add {
                    self.memory.settle(comm).and_then(|()| {
                        let done = reduce_bucket(comm, &mut self.memory, map, targets, &mut job);
                        self.memory.defer_completion();
                        done
                    })
                } else {
                    reduce_bucket(comm, &mut self.memory, map, targets, &mut job)
                };
                if result.is_ok() {
                    self.progress.add_one();
                }
            }
            held.push((write, job.buffer));
        }
    }

    /// Closes the open backward pass: hands over `grads` (the gradients
    /// that came after backward, one slot per parameter), launches every
    /// bucket left, adds the late gradients, waits for every reduction and
    /// takes the buffers back. `Ok(true)` if a pass was open.
    pub(super) fn finish_window(&mut self, grads: Option<&[Option<M::Grad<'_>>]>) -> Result<bool> {
        if self.window.is_none() {
            return Ok(false);
        }
        let flushed = self.flush_window(grads);
        let joined = self.join_window();
        flushed.and(joined)?;
        Ok(true)
    }

    fn flush_window(&mut self, grads: Option<&[Option<M::Grad<'_>>]>) -> Result<()> {
        if let Some(grads) = grads {
            for (param, grad) in grads.iter().enumerate() {
                if let Some(grad) = *grad {
                    let numel = self.params[param].numel();
                    self.window_accumulate(param, 0..numel, grad, false)?;
                }
            }
        }
        self.launch_ready(true)?;
        let Some(window) = self.window.as_mut() else {
            return Ok(());
        };
        // The same on every rank running the same model: which gradients
        // come after their bucket is a property of the graph.
        for k in 0..window.late.len() {
            if let Some(buffer) = window.late[k].take() {
                let job = Job {
                    bucket: k,
                    buffer,
                    fold_full: false,
                    add: true,
                    step: false,
                };
                submit(&mut window.reducer, job);
            }
        }
        self.run_inline();
        Ok(())
    }

    /// Waits for every reduction of the open pass (running them here if
    /// they were deferred), puts the buffers back and closes the pass.
    fn join_window(&mut self) -> Result<()> {
        let Some(mut window) = self.window.take() else {
            return Ok(());
        };
        // Buffers still open (a pass abandoned halfway) go back to the pool.
        self.pool.extend(window.open.drain(..).flatten());
        self.pool.extend(window.late.drain(..).flatten());
        let (targets, result) = match window.reducer {
            Reducer::Deferred { mut targets, queue } => {
                let map = self.bucket_map();
                let mut result = Ok(());
                for mut job in queue {
                    if result.is_ok() {
                        result = reduce_bucket(
                            &*self.comm,
                            &mut self.memory,
                            &map,
                            &mut targets,
                            &mut job,
                        );
                        if result.is_ok() {
                            self.progress.add_one();
                        }
                    }
                    // Without a thread after all, stage 0's buckets still
                    // land in the engine's full buffer.
                    let back = Back {
                        bucket: job.bucket,
                        reduced: result.is_ok().then_some(job.add),
                        buffer: job.buffer,
                    };
                    let full = self.full_grads.as_mut().filter(|_| window.lands);
                    let landed = land(&mut self.memory, &self.layout, full, &mut self.pool, back);
                    result = result.and(landed.map(drop));
                }
                (targets, result)
            }
            Reducer::Inline {
                mut targets,
                map,
                queue,
                held,
                result,
            } => {
                // `flush_window` ran every queued job (none is left after a
                // failure stopped it either: they were never issued).
                self.pool.extend(queue.into_iter().map(|job| job.buffer));
                let mut result = result.and(self.memory.settle(&*self.comm));
                for (write, buffer) in held {
                    if let (Some((bucket, add)), Ok(())) = (write, &result) {
                        result =
                            write_full(&mut self.memory, &map, &mut targets, bucket, &buffer, add);
                    }
                    self.pool.push(buffer);
                }
                (targets, result)
            }
            Reducer::Thread {
                jobs,
                mut returned,
                handle,
            } => {
                drop(jobs);
                let joined = handle.join();
                let mut landed = Ok(());
                while let Some(back) = returned.next(false) {
                    let full = self.full_grads.as_mut().filter(|_| window.lands);
                    let written = land(&mut self.memory, &self.layout, full, &mut self.pool, back);
                    landed = landed.and(written.map(drop));
                }
                match joined {
                    Ok(Some((targets, result))) => (targets, result.and(landed)),
                    Ok(None) | Err(_) => {
                        return Err(Error::State(
                            "the communication thread panicked; the engine's gradient buffers \
                             are lost, rebuild the optimizer"
                                .into(),
                        ))
                    }
                }
            }
        };
        if targets.full.is_some() {
            self.full_grads = targets.full;
        }
        self.grad_shard = targets.shard;
        self.scratch = targets.scratch;
        if let Some(early) = targets.early {
            self.optimizer = early.optimizer;
            self.param_shard = early.params;
            self.keys = early.keys;
            self.early_stepped = early.stepped;
        }
        result
    }

    /// Whether a backward pass's gradients are being handed over.
    pub(super) fn window_is_open(&self) -> bool {
        self.window.is_some()
    }

    fn bucket_map(&self) -> BucketMap {
        BucketMap {
            stage: self.config.stage,
            full: (0..self.layout.buckets.len())
                .map(|k| self.layout.bucket_range(k))
                .collect(),
            shard: self.layout.buckets.clone(),
            wire: self.reduce_dtype(),
        }
    }

    /// Per bucket, its range of the owned pieces; `None` when a piece
    /// straddles buckets (a partition not made in gradient order), which
    /// then cannot be stepped bucket by bucket.
    pub(super) fn pieces_by_bucket(&self) -> Option<Vec<Range<usize>>> {
        let base = self.plan_rank * self.plan.shard_numel;
        let mut groups = Vec::with_capacity(self.layout.buckets.len());
        let mut next = 0;
        for bucket in &self.layout.buckets {
            let first = next;
            while let Some(piece) = self.owned.get(next) {
                let at = piece.flat_range.start - base;
                if at >= bucket.end {
                    break;
                }
                if at + piece.len() > bucket.end {
                    return None;
                }
                next += 1;
            }
            groups.push(first..next);
        }
        Some(groups)
    }

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
            || self.fetcher.is_some()
        {
            return Ok(false);
        }
        let Some(groups) = self.pieces_by_bucket() else {
            return Ok(false);
        };
        let Some(mut worker_memory) = self.memory.fork() else {
            return Ok(false);
        };
        let (base, shard_len) = (
            self.plan_rank * self.plan.shard_numel,
            self.plan.shard_numel,
        );
        let pieces = super::step_pieces(&self.owned, &self.keys, base, |p| stepping[p]);
        let grads = match self.grad_shard.as_ref() {
            Some(grads) => grads,
            None => {
                return Err(Error::State(
                    "internal: no gradient shard in stage 1 or 2".into(),
                ))
            }
        };
        let gather_dtype = self.gather_dtype();
        // The optimizer writes the shard while the thread sends from it, so
        // each bucket's chunk is first copied into a staging buffer of one
        // chunk (the serial gather sends from the shard itself): the
        // scratch bucket, which is that long, when it exists, else one for
        // this step only. The gather itself takes one bucket buffer, as the
        // serial one does (the next is taken after it came back).
        let longest_chunk = self.layout.buckets.iter().map(Range::len).max();
        let longest_chunk = longest_chunk.unwrap_or(0);
        // Without a shard copy (`lean_shard`), each bucket's owned pieces
        // are read from the replica into that staging buffer and stepped
        // there, with their gradients copied beside them.
        let lean = self.lean_shard();
        let mut grad_chunk = None;
        if lean {
            self.param_shard = self.memory.alloc_zeroed(0)?;
            grad_chunk = Some(self.memory.alloc_zeroed(longest_chunk)?);
        }
        let stepper = BucketStep {
            owned_copies: &self.owned_copies,
            pieces: &pieces,
            layout: &self.layout,
            bucket_active: &self.bucket_active,
            early_stepped: &self.early_stepped,
            grads,
            shard_len,
        };
        if defer {
            if let Some(access) = self.param_access.take() {
                // Forward order: buckets follow gradient order, so the last
                // one holds the first layers. Each bucket is stepped, its
                // owned pieces written into the parameters, and handed to
                // the gather thread in that order, so the first layers'
                // parameters are on the wire while the rest step.
                let order: Vec<usize> = (0..groups.len())
                    .rev()
                    .filter(|&k| self.bucket_active[k])
                    .collect();
                let copies: Vec<Vec<super::ParamCopy>> = order
                    .iter()
                    .map(|&k| bucket_copies(&self.layout, &self.active, k))
                    .collect();
                let buffers = self
                    .memory
                    .alloc_zeroed(longest_chunk)
                    .and_then(|thread_send| {
                        let send = self.memory.alloc_zeroed(longest_chunk)?;
                        let (recv, _) =
                            take_shortest(&mut self.memory, &mut self.pool, self.longest_bucket)?;
                        Ok((send, thread_send, recv))
                    });
                let (mut send, thread_send, recv) = match buffers {
                    Ok(buffers) => buffers,
                    Err(e) => {
                        self.param_access = Some(access);
                        return Err(e);
                    }
                };
                self.refresh
                    .start(needed_per_param(self.params.len(), &copies));
                let (job_tx, jobs) = mpsc::channel();
                let payload = super::deferred::Payload {
                    memory: worker_memory,
                    comm: Arc::clone(&self.comm),
                    jobs,
                    send: thread_send,
                    recv,
                    access,
                    refresh: Arc::clone(&self.refresh),
                    dtype: gather_dtype,
                };
                let started = super::deferred::start(self.spawner, self.comm.rank(), payload);
                let mut stepped = Ok(());
                for (&k, copies) in order.iter().zip(copies) {
                    let chunk = self.layout.buckets[k].clone();
                    let owned = copies_from(&self.owned_copies[groups[k].clone()], chunk.start);
                    stepped = step_bucket(
                        &mut self.memory,
                        self.optimizer.as_mut(),
                        params,
                        (&mut self.param_shard, grad_chunk.as_mut()),
                        &stepper,
                        (k, groups[k].clone()),
                        &mut send,
                    )
                    .and_then(|()| self.memory.write_params(params, &owned, &send));
                    if stepped.is_err() {
                        break;
                    }
                    // The thread runs until the channel closes.
                    let _ = job_tx.send(super::deferred::GatherJob {
                        owned,
                        chunk: chunk.len(),
                        len: self.layout.bucket_range(k).len(),
                        copies,
                    });
                }
                // Closing the channel ends the thread after the last job.
                drop(job_tx);
                let gathered = match started {
                    Ok(handle) => {
                        self.deferred = Some(handle);
                        self.deferred_steps += 1;
                        Ok(())
                    }
                    Err(payload) => {
                        let finished = payload.run();
                        self.take_back(finished)
                    }
                };
                return stepped.and(gathered).map(|()| true);
            }
        }
        let scratch = &mut self.scratch;
        let had_scratch = scratch.is_some();
        let mut staging: Vec<M::Buffer> = scratch.take().into_iter().collect();
        let comm = &*self.comm;
        let memory = &mut self.memory;
        let pool = &mut self.pool;
        let optimizer = &mut self.optimizer;
        let param_shard = &mut self.param_shard;
        let layout = &self.layout;
        let active = &self.active;
        let bucket_active = &self.bucket_active;
        let (jobs, job_rx) = mpsc::channel::<(usize, M::Buffer, M::Buffer)>();
        let (done_tx, done) = mpsc::channel::<(usize, M::Buffer, M::Buffer, Result<()>)>();
        let outcome = std::thread::scope(|scope| -> Result<bool> {
            scope.spawn(move || {
                let mut failed = false;
                for (k, send, mut recv) in job_rx {
                    let result = if failed {
                        Err(Error::State("an earlier all-gather failed".into()))
                    } else {
                        let n = layout.buckets[k].len();
                        let all = layout.bucket_range(k).len();
                        // The parameters' dtype on the wire where master
                        // weights are kept (as `gather_buckets`).
                        worker_memory.all_gather_as(
                            comm,
                            &send,
                            0..n,
                            &mut recv,
                            0..all,
                            gather_dtype,
                        )
                    };
                    failed |= result.is_err();
                    if done_tx.send((k, send, recv, result)).is_err() {
                        break;
                    }
                }
            });
            let write = |k: usize,
                         send: M::Buffer,
                         recv: M::Buffer,
                         result: Result<()>,
                         params: &mut M::Params<'_>,
                         memory: &mut M,
                         pool: &mut Vec<M::Buffer>,
                         staging: &mut Vec<M::Buffer>|
             -> Result<()> {
                let written = result.and_then(|()| {
                    memory.write_params(params, &bucket_copies(layout, active, k), &recv)
                });
                staging.push(send);
                pool.push(recv);
                written
            };
            let mut outcome = Ok(());
            let mut pending = 0usize;
            for (k, group) in groups.iter().enumerate() {
                if !bucket_active[k] {
                    continue;
                }
                let send = match staging.pop() {
                    Some(send) => Ok(send),
                    None => memory.alloc_zeroed(longest_chunk),
                };
                let mut send = match send {
                    Ok(send) => send,
                    Err(e) => {
                        outcome = Err(e);
                        break;
                    }
                };
                outcome = step_bucket(
                    memory,
                    optimizer.as_mut(),
                    params,
                    (&mut *param_shard, grad_chunk.as_mut()),
                    &stepper,
                    (k, group.clone()),
                    &mut send,
                );
                if outcome.is_err() {
                    staging.push(send);
                    break;
                }
                // One gather in flight (the next bucket steps meanwhile): its
                // buffers are what this overlap costs in memory.
                while pending >= GATHERS_IN_FLIGHT {
                    let Ok((k, send, recv, result)) = done.recv() else {
                        break;
                    };
                    pending -= 1;
                    let written = write(k, send, recv, result, params, memory, pool, &mut staging);
                    outcome = outcome.and(written);
                }
                // Overwritten whole by the gather: no need to zero.
                let recv = take_shortest(memory, pool, layout.bucket_range(k).len());
                match recv {
                    Ok((recv, _)) => {
                        // The thread is alive while `jobs` is: it stops
                        // only when the channel closes.
                        let _ = jobs.send((k, send, recv));
                        pending += 1;
                    }
                    Err(e) => {
                        staging.push(send);
                        outcome = Err(e);
                        break;
                    }
                }
                // Write back what has arrived meanwhile.
                while let Ok((k, send, recv, result)) = done.try_recv() {
                    pending -= 1;
                    let written = write(k, send, recv, result, params, memory, pool, &mut staging);
                    outcome = outcome.and(written);
                }
            }
            drop(jobs);
            while pending > 0 {
                let Ok((k, send, recv, result)) = done.recv() else {
                    break;
                };
                pending -= 1;
                let written = write(k, send, recv, result, params, memory, pool, &mut staging);
                outcome = outcome.and(written);
            }
            outcome.map(|()| true)
        });
        if had_scratch {
            *scratch = staging.pop();
        }
        outcome
    }

    /// Whether stage 0's configuration lets each bucket step as soon as it
    /// is reduced: nothing needs every gradient first (no clipping, no
    /// gradient norm, no loss scaling) and the replica is what steps (no
    /// master weights).
    fn steps_ddp_as_reduced(&self) -> bool {
        self.config.stage == Stage::Ddp
            && self.config.overlap != Overlap::None
            && self.config.clip.is_none()
            && !self.config.compute_grad_norm
            && self.scaler.is_none()
            && !self.has_master_weights()
            && self.fetcher.is_none()
    }

    /// Stage 0 after backward, as PyTorch's `hook_with_zero_step`: with
    /// every bucket launched, each window of parameters steps as soon as
    /// the reductions of its buckets are back, while later buckets are
    /// still on the wire, instead of after the last one. The same
    /// operations on the same values as stepping after every reduction,
    /// so the same bits.
    ///
    /// For a pass on a communication thread when
    /// [`steps_ddp_as_reduced`](Self::steps_ddp_as_reduced) and the
    /// trainable mask (if checked) can be all-reduced on the side
    /// communicator meanwhile. `None`: not this pass, nothing done;
    /// `Some(false)`: the mask changed, so the pass was joined and the step
    /// goes on as usual; `Some(true)`: stepped. A reduction that fails
    /// stops the step there: the windows before it have stepped.
    pub(super) fn step_ddp_as_reduced(
        &mut self,
        last: Option<&[Option<M::Grad<'_>>]>,
        micro_steps: usize,
        params: &mut M::Params<'_>,
    ) -> Result<Option<bool>> {
        let threaded = self
            .window
            .as_ref()
            .is_some_and(|w| w.lands && matches!(w.reducer, Reducer::Thread { .. }));
        let masked = !self.config.check_trainability || self.side.is_some();
        if !threaded || !masked || !self.steps_ddp_as_reduced() {
            return Ok(None);
        }
        let stepping = self
            .flush_window(last)
            .and_then(|()| self.mask_beside_reductions());
        let stepping = match stepping {
            Ok(Some(stepping)) => stepping,
            Ok(None) => {
                self.join_window()?;
                return Ok(Some(false));
            }
            Err(e) => {
                if let Err(joined) = self.join_window() {
                    tracing::debug!(
                        "after a failed hand-over, the reductions failed too: {joined}"
                    );
                }
                return Err(e);
            }
        };
        let ranges = self.stepping_ranges(&stepping);
        let factor = (micro_steps > 1).then(|| 1.0 / micro_steps as f64);
        // The step's two buffers are bucket buffers coming back, not two
        // more beside those still out.
        let stepped = self.land_into_pool(2).and_then(|()| {
            self.step_replica_with(&stepping, params, |engine, grads, window| {
                engine.land_window(grads, window, &ranges, factor)
            })
        });
        // The reductions' own failure first: the step stopped because of it.
        self.join_window().and(stepped)?;
        Ok(Some(true))
    }

    /// Which parameters step, as the step after every reduction would find
    /// them, with the trainable mask all-reduced on the side communicator
    /// (while the reductions go on); `None` if the mask changed (the
    /// buckets are rebuilt after the reductions, as usual).
    fn mask_beside_reductions(&mut self) -> Result<Option<Vec<bool>>> {
        if !self.config.check_trainability {
            return Ok(Some(self.with_gradient(&self.active)));
        }
        let local = self.with_gradient(&self.trainable);
        let side = self
            .side
            .as_ref()
            .ok_or_else(|| Error::State("internal: no side communicator for the mask".into()))?;
        let active = super::mask_over(&mut self.memory, side, &self.params, &local)?;
        Ok((active == self.active).then_some(active))
    }

    /// Takes buffers back from the communication thread (writing their
    /// buckets into the full buffer) until the pool holds `count` as long
    /// as the longest bucket, or none is out.
    fn land_into_pool(&mut self, count: usize) -> Result<()> {
        let longest = self.longest_bucket;
        let Some(Window {
            reducer: Reducer::Thread { returned, .. },
            ..
        }) = self.window.as_mut()
        else {
            return Ok(());
        };
        while returned.in_flight > 0
            && self
                .pool
                .iter()
                .filter(|b| M::buffer_len(b) >= longest)
                .count()
                < count
        {
            let full = self.full_grads.as_mut();
            land_next(
                returned,
                &mut self.memory,
                &self.layout,
                full,
                &mut self.pool,
            )?;
        }
        Ok(())
    }

    /// Takes buffers back from the communication thread until every
    /// bucket overlapping `window` (elements of the full buffer `grads`) is
    /// written in, then scales the stepping `ranges` within it by `factor`
    /// (the micro-steps' average).
    fn land_window(
        &mut self,
        grads: &mut M::Buffer,
        window: Range<usize>,
        ranges: &[Range<usize>],
        factor: Option<f64>,
    ) -> Result<()> {
        let Some(Window {
            reducer: Reducer::Thread { returned, .. },
            ..
        }) = self.window.as_mut()
        else {
            return Err(Error::State(
                "internal: no communication thread to take buckets from".into(),
            ));
        };
        let layout = &self.layout;
        let needed: Vec<usize> = (0..layout.buckets.len())
            .filter(|&k| {
                let bucket = layout.bucket_range(k);
                bucket.start < window.end && window.start < bucket.end
            })
            .collect();
        if returned.lost {
            return Err(thread_gone());
        }
        while needed.iter().any(|&k| returned.pending[k] > 0) {
            land_next(
                returned,
                &mut self.memory,
                layout,
                Some(grads),
                &mut self.pool,
            )?;
        }
        if let Some(factor) = factor {
            let within: Vec<Range<usize>> = ranges
                .iter()
                .map(|r| r.start.max(window.start)..r.end.min(window.end))
                .filter(|r| !r.is_empty())
                .collect();
            self.memory.scale(grads, &within, factor)?;
        }
        Ok(())
    }

    /// A handle on the count of completed bucket reductions.
    pub fn reduction_progress(&self) -> ReductionProgress {
        self.progress.clone()
    }
}

/// What stepping one bucket of the shard reads (see [`step_bucket`]).
struct BucketStep<'a, B> {
    /// The owned pieces as copies between the replica and the shard.
    owned_copies: &'a [super::ParamCopy],
    /// The owned pieces to step, at shard offsets.
    pieces: &'a [StepPiece<'a>],
    layout: &'a super::Layout,
    bucket_active: &'a [bool],
    /// Per bucket, whether the interleaved schedule stepped it already.
    early_stepped: &'a [bool],
    /// The reduced gradient shard.
    grads: &'a B,
    shard_len: usize,
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
    let shard_range = at.layout.buckets[k].clone();
    if let Some(grad_chunk) = grad_chunk {
        return step_from_replica(
            memory,
            optimizer,
            params,
            (&at.owned_copies[group.clone()], &at.pieces[group]),
            (shard_range, at.shard_len),
            (send, grad_chunk, at.grads),
        );
    }
    if at.early_stepped.get(k) != Some(&true) {
        let plan = StepPlan {
            pieces: &at.pieces[group],
            buckets: &at.layout.buckets,
            bucket_active: at.bucket_active,
            origin: 0,
            shard_len: at.shard_len,
        };
        memory.step(optimizer, param_shard, at.grads, plan)?;
    }
    memory.copy_range(send, 0, param_shard, shard_range, false)
}

/// `copies` (at shard offsets) at their places in a buffer that holds the
/// shard from `start` on (one bucket's chunk).
fn copies_from(copies: &[super::ParamCopy], start: usize) -> Vec<super::ParamCopy> {
    copies
        .iter()
        .map(|c| super::ParamCopy {
            at: c.at - start,
            ..c.clone()
        })
        .collect()
}

/// Where bucket `k`'s active parameters lie in the gathered bucket.
fn bucket_copies(layout: &super::Layout, active: &[bool], k: usize) -> Vec<super::ParamCopy> {
    let start = layout.bucket_range(k).start;
    layout
        .runs_of(k)
        .iter()
        .filter(|run| active[run.param])
        .map(|run| super::ParamCopy {
            param: run.param,
            param_range: run.param_range.clone(),
            at: run.pos - start,
        })
        .collect()
}

/// Per parameter, how many of the gathers (the buckets' `copies`, in
/// order) must be written before it is current: one past the last that
/// holds a piece of it.
fn needed_per_param(params: usize, copies: &[Vec<super::ParamCopy>]) -> Vec<usize> {
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
    (copies, pieces): (&[super::ParamCopy], &[super::StepPiece<'_>]),
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
    let pieces: Vec<super::StepPiece<'_>> = pieces
        .iter()
        .map(|p| super::StepPiece {
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

/// A buffer of at least `len` elements, zeroed there: the shortest that
/// fits from the pool (after collecting what the communication thread has
/// returned), or a new one of exactly `len`. With `limit` buffers held
/// (`holding` being filled, the rest queued), first waits for the oldest
/// queued one to come back, so the pool stays small when the communication
/// thread falls behind. (It cannot wait forever: the oldest queued
/// reduction needs only buckets every rank launches before waiting on
/// anything, and a failed one still returns its buffer.)
///
/// Stage 0's reduced buckets are written into `full` as their buffers come
/// back ([`Window::lands`]; `None` otherwise).
fn take_buffer<T, C, M>(
    memory: &mut M,
    pool: &mut Vec<M::Buffer>,
    reducer: &mut Reducer<T, M::Buffer>,
    (holding, limit): (usize, usize),
    len: usize,
    (layout, mut full): (&super::Layout, Option<&mut M::Buffer>),
) -> Result<M::Buffer>
where
    T: Element,
    C: Communicator,
    M: ShardMemory<T, C>,
{
    if let Reducer::Thread { returned, .. } = reducer {
        while let Some(back) = returned.next(false) {
            land(memory, layout, full.as_deref_mut(), pool, back)?;
        }
        if returned.in_flight > 0 && returned.in_flight + holding >= limit {
            // `None`: the thread is gone (it panicked); joining reports it.
            if let Some(back) = returned.next(true) {
                land(memory, layout, full, pool, back)?;
            }
        }
    }
    let (mut buffer, reused) = take_shortest(memory, pool, len)?;
    if reused {
        memory.zero(&mut buffer, 0..len)?;
    }
    Ok(buffer)
}

/// The shortest buffer of `pool` with at least `len` elements (`true`:
/// reused, holding whatever it held), or a new zeroed one of exactly `len`.
/// The shortest, not the first that fits: a short request must not take
/// a bucket buffer that a later one then has to allocate again.
fn take_shortest<T, C, M>(
    memory: &mut M,
    pool: &mut Vec<M::Buffer>,
    len: usize,
) -> Result<(M::Buffer, bool)>
where
    T: Element,
    C: Communicator,
    M: ShardMemory<T, C>,
{
    let fits = pool
        .iter()
        .enumerate()
        .filter(|(_, b)| M::buffer_len(b) >= len)
        .min_by_key(|(_, b)| M::buffer_len(b))
        .map(|(i, _)| i);
    match fits {
        Some(i) => Ok((pool.swap_remove(i), true)),
        None => Ok((memory.alloc_zeroed(len)?, false)),
    }
}

/// Takes a buffer back from the communication thread into `pool`, first
/// writing (adding) its reduced bucket into `full` when given (stage 0,
/// [`Window::lands`]). `Ok(false)` if its reduction failed or never ran.
fn land<T, C, M>(
    memory: &mut M,
    layout: &super::Layout,
    full: Option<&mut M::Buffer>,
    pool: &mut Vec<M::Buffer>,
    back: Back<M::Buffer>,
) -> Result<bool>
where
    T: Element,
    C: Communicator,
    M: ShardMemory<T, C>,
{
    let written = match (back.reduced, full) {
        (Some(add), Some(full)) => {
            let range = layout.bucket_range(back.bucket);
            memory
                .copy_range(full, range.start, &back.buffer, 0..range.len(), add)
                .map(|()| true)
        }
        (reduced, _) => Ok(reduced.is_some()),
    };
    pool.push(back.buffer);
    written
}

/// Waits for the next buffer back from the communication thread and lands
/// it (see [`land`]); an error if its reduction failed or the thread is
/// gone, which stops a step that steps buckets as they come back.
fn land_next<T, C, M>(
    returned: &mut Returns<M::Buffer>,
    memory: &mut M,
    layout: &super::Layout,
    full: Option<&mut M::Buffer>,
    pool: &mut Vec<M::Buffer>,
) -> Result<()>
where
    T: Element,
    C: Communicator,
    M: ShardMemory<T, C>,
{
    let Some(back) = returned.next(true) else {
        return Err(thread_gone());
    };
    if !land(memory, layout, full, pool, back)? {
        return Err(Error::State(
            "a bucket reduction failed; the step stopped before its parameters".into(),
        ));
    }
    Ok(())
}

fn thread_gone() -> Error {
    Error::State("the communication thread stopped before every bucket was reduced".into())
}

fn submit<T: Element, B>(reducer: &mut Reducer<T, B>, job: Job<B>) {
    match reducer {
        Reducer::Deferred { queue, .. } | Reducer::Inline { queue, .. } => queue.push(job),
        // A send fails only if the thread is gone (it panicked); joining
        // reports that.
        Reducer::Thread { jobs, returned, .. } => {
            let bucket = job.bucket;
            if jobs.send(job).is_ok() {
                returned.sent(bucket);
            } else {
                returned.lost = true;
            }
        }
    }
}

/// Stands in for the optimizer while the communication thread has it (the
/// engine is lent to the backward pass then, so nothing calls this).
struct LentOptimizer(String);

impl LentOptimizer {
    fn lent() -> Error {
        Error::State("internal: the optimizer is lent to the communication thread".into())
    }
}

impl<T: Element> FunctionalOptimizer<T> for LentOptimizer {
    fn kind(&self) -> &str {
        &self.0
    }

    fn step(&mut self, _: &mut [ParamMut<'_, T>], _: &[Option<&[T]>]) -> Result<()> {
        Err(Self::lent())
    }

    fn num_groups(&self) -> usize {
        0
    }

    fn add_group(&mut self, _: &Hyperparams) -> Result<usize> {
        Err(Self::lent())
    }

    fn hyperparams(&self, _: usize) -> Hyperparams {
        Hyperparams::new()
    }

    fn set_hyperparams(&mut self, _: usize, _: &Hyperparams) -> Result<()> {
        Err(Self::lent())
    }

    fn learning_rate(&self, _: usize) -> f64 {
        f64::NAN
    }

    fn set_learning_rate(&mut self, _: usize, _: f64) {}

    fn export_state(&self) -> OptimizerState<T> {
        OptimizerState::default()
    }

    fn import_state(&mut self, _: OptimizerState<T>) -> Result<()> {
        Err(Self::lent())
    }
}
