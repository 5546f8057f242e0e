//! Bucket reductions: the jobs a backward pass launches, who runs them
//! ([`Reducer`]), where reduced buckets land ([`Targets`]), and the pool of
//! bucket buffers they go through.

use super::shard_memory::deferral;
use super::worker::Ticket;
use super::{HostRegion, ShardMemory, ShardStep, Stage, StepPiece};
use crate::comm::{Communicator, ReduceOp};
use crate::optim::{FunctionalOptimizer, ParamKey};
use crate::{DType, Element, Error, Result};
use std::ops::Range;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

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

    pub(super) fn add_one(&self) {
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
    pub optimizer: Box<dyn FunctionalOptimizer<T>>,
    /// The parameter shard.
    pub params: B,
    pub keys: Vec<ParamKey>,
    /// Per owned piece, its shard range and whether it steps.
    pub pieces: Vec<(Range<usize>, bool)>,
    /// Per bucket, its range of `pieces`.
    pub bucket_pieces: Vec<Range<usize>>,
    /// `1/m` for `m > 1` micro-steps: the average, taken before stepping.
    pub scale: Option<f64>,
    /// Per bucket, whether it was stepped.
    pub stepped: Vec<bool>,
}

impl<T: Element, P> EarlyStep<T, P> {
    /// This step with `params` for its parameter shard, and the shard it
    /// had: the step thread takes the step without the shard, whose host
    /// region it steps through.
    pub fn with_params<Q>(self, params: Q) -> (EarlyStep<T, Q>, P) {
        let EarlyStep {
            optimizer,
            params: had,
            keys,
            pieces,
            bucket_pieces,
            scale,
            stepped,
        } = self;
        let step = EarlyStep {
            optimizer,
            params,
            keys,
            pieces,
            bucket_pieces,
            scale,
            stepped,
        };
        (step, had)
    }
}

/// The interleaved step of an inline pass over shards in host memory
/// (offload on a GPU): a thread of its own steps each bucket as its reduced
/// gradients land in the host's gradient shard, while backward goes on,
/// with the optimizer lent to it. The calling thread only queues each
/// bucket's copy and hands the bucket over with what waits for it: the step
/// thread waits for the copy and reads the gradients where they landed, so
/// backward's launches never wait for a copy, and nothing is copied again
/// on the host. After backward the thread goes on with its last buckets
/// while the calling thread writes back each bucket it has stepped
/// ([`HostSteps::wait_stepped`], then [`HostSteps::params`]): the weights
/// go up bucket by bucket, overlapped with the remaining steps.
///
/// The thread touches both shards through [`HostRegion`]s, one bucket's
/// range at a time. The parameter shard is held here; the gradient shard
/// stays with the pass's targets during backward (the field order of
/// [`Reducer::Inline`] drops this first), then is held here
/// ([`HostSteps::end_backward`]). The thread is joined before either is
/// given back ([`HostSteps::finish`]) or dropped.
pub(super) struct HostSteps<T: Element, B> {
    /// Each reduced bucket, with what waits for its copy into the shard;
    /// closed at the end of backward.
    grads: Option<mpsc::Sender<(usize, Option<super::Landing>)>>,
    /// Each bucket the thread has stepped, in the order stepped.
    stepped: mpsc::Receiver<usize>,
    /// Per bucket, whether it was handed over, and whether it was stepped.
    handed: Vec<bool>,
    done: Vec<bool>,
    /// The calling thread's waits for the thread after backward.
    waited: Duration,
    thread: Option<std::thread::JoinHandle<Stepped<T>>>,
    /// The parameter shard the thread steps.
    params: Option<B>,
    /// The gradient shard the thread reads, once backward is over.
    grad_shard: Option<B>,
    /// The 16-bit dtype each stepped bucket's weights are packed in, into
    /// its range of the gradient shard (its gradients are spent), for the
    /// write-back to send up half the bytes ([`super::pack_narrow`]).
    packed: Option<DType>,
}

/// The most buckets the step thread steps in one call.
const STEP_BATCH: usize = 4;

/// What the step thread gives back: the lent step (without its parameter
/// shard, which [`HostSteps`] holds), the first failure and its times
/// (landing, stepping, packing).
type Stepped<T> = (EarlyStep<T, ()>, Result<()>, [Duration; 3]);

/// Offload's steps, finished ([`HostSteps::finish`]).
pub(super) struct StepsDone<T: Element, B> {
    /// The lent step, with the parameter shard back.
    pub early: EarlyStep<T, B>,
    /// The gradient shard, if held ([`HostSteps::end_backward`]).
    pub grad_shard: Option<B>,
    /// The thread's first failure.
    pub result: Result<()>,
    /// The step thread's waits for copies, its stepping and its packing,
    /// and the calling thread's waits for it after backward (join
    /// included).
    pub times: [Duration; 4],
}

impl<T: Element, B> HostSteps<T, B> {
    /// Hands bucket `k` to the step thread, which steps it once `landing`
    /// has returned. Nothing touches the bucket's range of either shard
    /// after this, until the thread reports it stepped or is joined.
    pub fn hand_over(&mut self, k: usize, landing: Option<super::Landing>) -> Result<()> {
        let gone =
            || Error::State("the offload's step thread is gone; joining the pass says why".into());
        let grads = self.grads.as_ref().ok_or_else(gone)?;
        grads.send((k, landing)).map_err(|_| gone())?;
        if let Some(handed) = self.handed.get_mut(k) {
            *handed = true;
        }
        Ok(())
    }

    /// Backward is over: no bucket comes any more (the thread ends after
    /// the last one handed over), and the gradient shard the thread reads
    /// is held here until it is joined.
    pub fn end_backward(&mut self, grad_shard: Option<B>) {
        self.grads = None;
        self.grad_shard = grad_shard;
    }

    /// Waits, after backward, until the thread has stepped bucket `k`:
    /// `true` once it has (its range of [`HostSteps::params`] is then the
    /// stepped weights, which the thread no longer touches); `false` if it
    /// never will (the bucket was not handed over, or the thread stopped at
    /// a failure, which [`HostSteps::finish`] reports).
    pub fn wait_stepped(&mut self, k: usize) -> bool {
        if self.grads.is_some() || !self.handed.get(k).copied().unwrap_or(false) {
            return false;
        }
        let started = Instant::now();
        while !self.done[k] {
            match self.stepped.recv() {
                Ok(j) => self.done[j] = true,
                Err(_) => break,
            }
        }
        self.waited += started.elapsed();
        self.done[k]
    }

    /// The parameter shard, whose buckets reported stepped
    /// ([`HostSteps::wait_stepped`]) may be read while the thread steps
    /// the others.
    pub fn params(&self) -> Option<&B> {
        self.params.as_ref()
    }

    /// Where the stepped buckets' weights are packed in 16 bits, and the
    /// dtype: the gradient shard (held once backward is over), whose
    /// buckets reported stepped may be read while the thread steps the
    /// others; `None` where the weights are not packed.
    pub fn packed(&self) -> Option<(&B, DType)> {
        Some((self.grad_shard.as_ref()?, self.packed?))
    }

    /// Joins the thread after its last bucket: the lent step with the
    /// parameter shard, the gradient shard, the first failure and the
    /// times; `None` if the thread panicked.
    pub fn finish(mut self) -> Option<StepsDone<T, B>> {
        self.grads = None;
        let started = Instant::now();
        let (early, result, [landing, stepping, packing]) = self.thread.take()?.join().ok()?;
        let (early, ()) = early.with_params(self.params.take()?);
        Some(StepsDone {
            early,
            grad_shard: self.grad_shard.take(),
            result,
            times: [landing, stepping, packing, self.waited + started.elapsed()],
        })
    }
}

impl<T: Element, B> Drop for HostSteps<T, B> {
    /// Dropped unfinished (an error or a panic on the calling thread): the
    /// thread still touches the shards, so it is joined before they go.
    fn drop(&mut self) {
        self.grads = None;
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// Starts the thread of [`HostSteps`] for memory `M`: it steps each bucket
/// `k` handed over, from its range `shard[k]` of the gradient shard
/// `grads` (which must stay alive and in place until the steps are
/// finished or dropped) into the same range of `early`'s parameter shard,
/// which is held by the steps meanwhile; with `packed`, then packs the
/// stepped weights in that 16-bit dtype into the bucket's range of the
/// gradient shard.
pub(super) fn start_host_steps<T, C, M>(
    early: EarlyStep<T, M::Buffer>,
    stepper: super::HostStepper,
    (shard, packed): (Vec<Range<usize>>, Option<DType>),
    grads: HostRegion<T>,
) -> Result<HostSteps<T, M::Buffer>>
where
    T: Element,
    C: Communicator,
    M: ShardMemory<T, C>,
{
    let (early, mut params) = early.with_params(());
    let Some(params_region) = M::host_region(&mut params) else {
        return Err(Error::State(
            "internal: the offload's step thread steps a parameter shard in host memory".into(),
        ));
    };
    let buckets = shard.len();
    let (sender, handed) = mpsc::channel::<(usize, Option<super::Landing>)>();
    let (stepped_tx, stepped) = mpsc::channel::<usize>();
    let step_thread = StepThread {
        early,
        stepper,
        shard,
        packed,
        grads,
        params: params_region,
        handed,
        stepped: stepped_tx,
        times: [Duration::ZERO; 3],
    };
    let thread = std::thread::Builder::new()
        .name("zero-offload-step".into())
        .spawn(move || step_thread.run())
        .map_err(|e| Error::State(format!("cannot start the offload's step thread: {e}")))?;
    Ok(HostSteps {
        grads: Some(sender),
        stepped,
        handed: vec![false; buckets],
        done: vec![false; buckets],
        waited: Duration::ZERO,
        thread: Some(thread),
        params: Some(params),
        grad_shard: None,
        packed,
    })
}

/// Offload's step thread: the lent step, the two shards' host regions, the
/// buckets' ranges of them, and the channels buckets come in by and go
/// out by once stepped.
struct StepThread<T: Element> {
    early: EarlyStep<T, ()>,
    stepper: super::HostStepper,
    shard: Vec<Range<usize>>,
    packed: Option<DType>,
    grads: HostRegion<T>,
    params: HostRegion<T>,
    handed: mpsc::Receiver<(usize, Option<super::Landing>)>,
    stepped: mpsc::Sender<usize>,
    /// Waiting for landings, stepping (packing included), packing.
    times: [Duration; 3],
}

impl<T: Element> StepThread<T> {
    /// Runs until the channel closes (the end of backward); after a
    /// failure nothing more is stepped. Gives back the lent step, the
    /// first failure and the times (landing, stepping, packing).
    #[allow(clippy::type_complexity)]
    fn run(mut self) -> Stepped<T> {
        let mut result = Ok(());
        let mut next = None;
        loop {
            let Some((first, landing)) = next.take().or_else(|| self.handed.recv().ok()) else {
                break;
            };
            if result.is_err() {
                continue;
            }
            let (last, landing) = self.batch(first, landing, &mut next);
            let started = Instant::now();
            result = landing.map_or(Ok(()), |landing| landing());
            let landed = Instant::now();
            self.times[0] += landed - started;
            result = result.and_then(|()| self.step(first, last));
            self.times[1] += landed.elapsed();
            if result.is_ok() {
                for k in first..=last {
                    // The receiver lives until this thread is joined.
                    let _ = self.stepped.send(k);
                }
            }
        }
        let [landing, stepping, packing] = self.times;
        (
            self.early,
            result,
            [landing, stepping.saturating_sub(packing), packing],
        )
    }

    /// The buckets handed over meanwhile that follow `first` step with it,
    /// in one call (its pieces in parallel), behind the last one's landing
    /// (copies land in order): a thread that fell behind catches up in
    /// fewer, larger calls. Returns the last bucket and its landing; a
    /// bucket that does not follow is kept in `next`.
    #[allow(clippy::type_complexity)]
    fn batch(
        &self,
        first: usize,
        landing: Option<super::Landing>,
        next: &mut Option<(usize, Option<super::Landing>)>,
    ) -> (usize, Option<super::Landing>) {
        let (mut last, mut landing) = (first, landing);
        while last + 1 - first < STEP_BATCH {
            match self.handed.try_recv() {
                Ok((k, later)) if k == last + 1 => (last, landing) = (k, later),
                Ok(other) => {
                    *next = Some(other);
                    break;
                }
                Err(_) => break,
            }
        }
        (last, landing)
    }

    /// Steps the landed buckets `first..=last` and, with `packed`, packs
    /// their stepped weights in the gradients' place.
    fn step(&mut self, first: usize, last: usize) -> Result<()> {
        let range = match (self.shard.get(first), self.shard.get(last)) {
            (Some(a), Some(b)) => a.start..b.end,
            _ => {
                return Err(Error::State(format!(
                    "internal: bucket {last} handed to the step thread"
                )))
            }
        };
        // SAFETY: both shards are kept alive and in place until this thread
        // is joined; the buckets' gradients have landed, and nothing else
        // touches their ranges of either shard until this thread reports
        // them stepped (then the calling thread only reads the parameters or
        // the weights packed in the gradients' place, and this thread no
        // longer touches either) or is joined (`HostSteps::hand_over`).
        let (bucket_grads, bucket_params) = unsafe {
            (
                self.grads.range_mut(range.clone()),
                self.params.range_mut(range.clone()),
            )
        };
        step_landed(
            &mut self.early,
            &self.stepper,
            &self.shard,
            first..last + 1,
            bucket_grads,
            bucket_params,
        )?;
        if let Some(wire) = self.packed {
            // Each bucket's weights at the start of its own range, where the
            // write-back reads them (on the offload's threads).
            let packing = Instant::now();
            let shard = &self.shard;
            self.stepper.run(|| {
                for bucket in &shard[first..=last] {
                    let at = bucket.start - range.start..bucket.end - range.start;
                    super::pack_narrow(&bucket_params[at.clone()], wire, &mut bucket_grads[at]);
                }
            });
            self.times[2] += packing.elapsed();
        }
        Ok(())
    }
}

/// Steps the consecutive `buckets` of the lent step's pieces: `params` and
/// `grads` are the buckets' ranges of the shards, the gradients reduced
/// (averaged here over the micro-steps, as [`Reduction::run`] does).
fn step_landed<T: Element, B>(
    early: &mut EarlyStep<T, B>,
    stepper: &super::HostStepper,
    shard: &[Range<usize>],
    buckets: Range<usize>,
    grads: &mut [T],
    params: &mut [T],
) -> Result<()> {
    let bucket = shard[buckets.start].start..shard[buckets.end - 1].end;
    if let Some(factor) = early.scale {
        let whole = 0..grads.len();
        stepper.run(|| {
            super::shard_memory::host_scale(&mut *grads, std::slice::from_ref(&whole), factor)
        });
    }
    let owned = early.bucket_pieces[buckets.start].start..early.bucket_pieces[buckets.end - 1].end;
    let pieces: Vec<StepPiece<'_>> = early.pieces[owned.clone()]
        .iter()
        .zip(&early.keys[owned])
        .map(|((range, steps), key)| StepPiece {
            key,
            range: range.start - bucket.start..range.end - bucket.start,
            active: *steps,
        })
        .collect();
    let whole = 0..bucket.len();
    let plan = ShardStep {
        pieces: &pieces,
        buckets: std::slice::from_ref(&whole),
        bucket_active: &[true],
        origin: bucket.start,
        shard_len: shard.last().map_or(0, |b| b.end),
    };
    stepper.step(early.optimizer.as_mut(), params, grads, plan)?;
    early.stepped[buckets].fill(true);
    Ok(())
}

/// One bucket reduction.
pub(super) struct Job<B> {
    pub bucket: usize,
    pub buffer: B,
    /// Add the accumulated micro-steps (`Targets::full`) before reducing.
    pub fold_full: bool,
    /// Add the reduced bucket into the target instead of overwriting it.
    pub add: bool,
    /// Step the bucket's shard once reduced (interleaved).
    pub step: bool,
}

/// A bucket buffer back from the communication thread.
pub(super) struct Back<B> {
    pub bucket: usize,
    /// `Some(add)` once reduced (`add`: to be added into the full buffer
    /// rather than written over it); `None` if the reduction failed or was
    /// never issued (an earlier one failed).
    pub reduced: Option<bool>,
    pub buffer: B,
}

/// The buffers coming back from the communication thread, and what is
/// still out there.
pub(super) struct Returns<B> {
    pub rx: mpsc::Receiver<Back<B>>,
    /// Jobs sent whose buffer has not come back yet.
    pub in_flight: usize,
    /// Per bucket, its jobs sent whose buffer has not come back yet.
    pub pending: Vec<usize>,
    /// A job could not be sent (the thread is gone): `pending` no longer
    /// tells which buckets are reduced.
    pub lost: bool,
}

impl<B> Returns<B> {
    pub fn new(buckets: usize, rx: mpsc::Receiver<Back<B>>) -> Self {
        Self {
            rx,
            in_flight: 0,
            pending: vec![0; buckets],
            lost: false,
        }
    }

    pub fn sent(&mut self, bucket: usize) {
        self.in_flight += 1;
        self.pending[bucket] += 1;
    }

    /// The next buffer back: waiting for it (`block`) or only if it is
    /// there. `None` when there is none (or, blocking, the thread is gone:
    /// it panicked, which joining reports).
    pub fn next(&mut self, block: bool) -> Option<Back<B>> {
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
    pub stage: Stage,
    /// Per bucket, its range in bucket-major order.
    pub full: Vec<Range<usize>>,
    /// Per bucket, its range in the shard.
    pub shard: Vec<Range<usize>>,
    /// The dtype gradients travel in.
    pub wire: DType,
    /// With shard groups: the dtype of each bucket's average across the
    /// replicas before it steps during backward.
    pub replica_wire: Option<DType>,
}

impl BucketMap {
    /// The buckets of `layout` reduced at `stage`, in `wire` on the wire,
    /// averaged across replicas in `replica_wire` before they step.
    pub fn new(
        layout: &super::Layout,
        stage: Stage,
        wire: DType,
        replica_wire: Option<DType>,
    ) -> Self {
        Self {
            stage,
            full: (0..layout.buckets.len())
                .map(|k| layout.bucket_range(k))
                .collect(),
            shard: layout.buckets.clone(),
            wire,
            replica_wire,
        }
    }
}

/// One bucket reduction's context: the communicator, the memory that runs
/// it, the buckets, and where reduced buckets land.
pub(super) struct Reduction<'a, T: Element, C: Communicator, M: ShardMemory<T, C>> {
    pub comm: &'a C,
    /// With shard groups: this rank's replicas.
    pub replicas: Option<&'a C>,
    pub memory: &'a mut M,
    pub map: &'a BucketMap,
    pub targets: &'a mut Targets<T, M::Buffer>,
}

impl<T: Element, C: Communicator, M: ShardMemory<T, C>> Reduction<'_, T, C, M> {
    /// Reduces `job` on the calling thread for a memory whose collectives
    /// complete after they return (`Runner::Inline`): a bucket added into
    /// the shard settles what came before first. Returns how it went and,
    /// at stage 0, the bucket to write into the full buffer once settled
    /// (and whether to add).
    pub fn run_inline(mut self, job: &mut Job<M::Buffer>) -> (Result<()>, Option<(usize, bool)>) {
        if self.map.stage == Stage::Ddp {
            return (self.all_reduce(job), Some((job.bucket, job.add)));
        }
        if !job.add {
            return (self.run(job), None);
        }
        let settled = deferral(&mut *self.memory).and_then(|d| d.settle(self.comm));
        let done = settled.and_then(|()| {
            let done = self.run(job);
            if let Some(deferral) = self.memory.deferral() {
                deferral.defer_completion();
            }
            done
        });
        (done, None)
    }

    /// Reduces `job`'s bucket into the targets and, interleaved, steps it.
    pub fn run(&mut self, job: &mut Job<M::Buffer>) -> Result<()> {
        self.reduce(job)?;
        if !job.step {
            return Ok(());
        }
        let Some(early) = self.targets.early.as_mut() else {
            return Ok(());
        };
        let k = job.bucket;
        let grads = match self.map.stage {
            Stage::Ddp => self.targets.full.as_mut(),
            _ => self.targets.shard.as_mut(),
        }
        .ok_or_else(missing_target)?;
        if let (Some(replicas), Some(wire)) = (self.replicas, self.map.replica_wire) {
            // Every group steps the same average (as `after_ready` does
            // for the buckets that step after backward).
            let range = self.map.shard[k].clone();
            (self.memory).all_reduce_as(replicas, grads, range, ReduceOp::Avg, wire)?;
        }
        if let Some(factor) = early.scale {
            self.memory
                .scale(grads, &[self.map.shard[k].clone()], factor)?;
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
        let plan = ShardStep {
            pieces: &pieces,
            buckets: &self.map.shard[k..=k],
            bucket_active: &[true],
            origin: 0,
            shard_len: self.map.shard.last().map_or(0, |b| b.end),
        };
        self.memory
            .step(early.optimizer.as_mut(), &mut early.params, grads, plan)?;
        early.stepped[k] = true;
        Ok(())
    }

    /// Stage 0: all-reduces the bucket and writes it into the full buffer
    /// (unless the full buffer stayed with the engine: `Schedule::lands`,
    /// whose caller writes it when the buffer comes back). Stages 1-3:
    /// reduce-scatters it into the gradient shard, or adds it there.
    fn reduce(&mut self, job: &mut Job<M::Buffer>) -> Result<()> {
        let range = self.map.full[job.bucket].clone();
        let len = range.len();
        if self.map.stage == Stage::Ddp {
            self.all_reduce(job)?;
            if self.targets.full.is_none() {
                return Ok(());
            }
            return self.write_full(job.bucket, &job.buffer, job.add);
        }
        if job.fold_full {
            let full = self.targets.full.as_ref().ok_or_else(missing_target)?;
            self.memory
                .copy_range(&mut job.buffer, 0, full, range.clone(), true)?;
        }
        let shard_range = self.map.shard[job.bucket].clone();
        let shard = self.targets.shard.as_mut().ok_or_else(missing_target)?;
        if !job.add {
            return self.memory.reduce_scatter_as(
                self.comm,
                &job.buffer,
                0..len,
                shard,
                shard_range,
                ReduceOp::Avg,
                self.map.wire,
            );
        }
        let n = shard_range.len();
        // Allocated on first need (a gradient that came after its bucket was
        // launched), by whichever memory runs the reduction.
        let scratch = match &mut self.targets.scratch {
            Some(scratch) if M::buffer_len(scratch) >= n => scratch,
            slot => {
                let longest = self.map.shard.iter().map(Range::len).max().unwrap_or(0);
                slot.insert(self.memory.alloc_zeroed(longest)?)
            }
        };
        self.memory.reduce_scatter_as(
            self.comm,
            &job.buffer,
            0..len,
            scratch,
            0..n,
            ReduceOp::Avg,
            self.map.wire,
        )?;
        self.memory
            .copy_range(shard, shard_range.start, scratch, 0..n, true)
    }

    /// Stage 0's reduction of one bucket: adds the accumulated micro-steps
    /// when asked (`fold_full`), then all-reduces the bucket buffer in place.
    pub fn all_reduce(&mut self, job: &mut Job<M::Buffer>) -> Result<()> {
        let range = self.map.full[job.bucket].clone();
        let len = range.len();
        if job.fold_full {
            let full = self.targets.full.as_ref().ok_or_else(missing_target)?;
            self.memory
                .copy_range(&mut job.buffer, 0, full, range, true)?;
        }
        self.memory.all_reduce_as(
            self.comm,
            &mut job.buffer,
            0..len,
            ReduceOp::Avg,
            self.map.wire,
        )
    }

    /// Stage 0: writes (`add`: adds) a reduced bucket into the full buffer.
    pub fn write_full(&mut self, bucket: usize, buffer: &M::Buffer, add: bool) -> Result<()> {
        let range = self.map.full[bucket].clone();
        let full = self.targets.full.as_mut().ok_or_else(missing_target)?;
        self.memory
            .copy_range(full, range.start, buffer, 0..range.len(), add)
    }
}

fn missing_target() -> Error {
    Error::State("internal: a reduction target is missing".into())
}

/// Who runs the reductions of a backward pass.
pub(super) enum Reducer<T: Element, B> {
    /// Queued until the end of backward, then run on the caller's thread.
    Queued {
        targets: Targets<T, B>,
        map: BucketMap,
        queue: Vec<Job<B>>,
    },
    /// Run on the caller's thread as each bucket is launched, by a memory
    /// whose collectives complete after they return
    /// ([`ShardMemory::deferral`]): the buffers are held until the
    /// memory settles at the end of backward, or reused earlier behind a
    /// fence (`Deferral::fence_deferred`; stages 1-2).
    Inline {
        /// The interleaved step on a thread of its own (offload). First:
        /// dropped (its thread joined) before `targets`, whose gradient
        /// shard the thread reads.
        steps: Option<Box<HostSteps<T, B>>>,
        targets: Targets<T, B>,
        /// The buckets, built once for the pass.
        map: BucketMap,
        queue: Vec<Job<B>>,
        /// The buffers of reductions not known to be complete, oldest
        /// first.
        held: Vec<Held<B>>,
        result: Result<()>,
    },
    /// Sent to the communication thread as each bucket is launched.
    Thread {
        jobs: mpsc::Sender<Job<B>>,
        returned: Returns<B>,
        /// The targets back, with the first failure, once `jobs` closes.
        ticket: Ticket<(Targets<T, B>, Result<()>)>,
    },
}

impl<T: Element, B> Reducer<T, B> {
    /// Whether offload's step thread steps this pass's buckets.
    pub(super) fn has_host_steps(&self) -> bool {
        matches!(self, Reducer::Inline { steps: Some(_), .. })
    }
}

/// A bucket buffer an inline reduction read, held until the reduction is
/// known to be complete.
pub(super) struct Held<B> {
    /// Stage 0: the bucket to write into the full buffer once settled (and
    /// whether to add).
    pub write: Option<(usize, bool)>,
    /// The memory's `Deferral::deferred_count` once the reduction was
    /// issued: a fence at this count orders later work after it.
    pub reductions: usize,
    pub buffer: B,
}

/// Returns to `pool` every held buffer that nothing is to be written from
/// and whose reduction is among the first `fence` deferred.
pub(super) fn release_held<B>(pool: &mut Vec<B>, held: &mut Vec<Held<B>>, fence: usize) {
    let (free, kept): (Vec<_>, Vec<_>) = std::mem::take(held)
        .into_iter()
        .partition(|h| h.write.is_none() && h.reductions <= fence);
    pool.extend(free.into_iter().map(|h| h.buffer));
    *held = kept;
}

/// Returns to `pool` every held buffer whose reduction is among the first
/// `fence` deferred (complete to what is queued from now on), writing
/// stage 0's reduced buckets into the full buffer first; an error if a
/// write failed (no more is written then, but every buffer goes back).
pub(super) fn write_held<T, C, M>(
    reduction: &mut Reduction<'_, T, C, M>,
    pool: &mut Vec<M::Buffer>,
    held: &mut Vec<Held<M::Buffer>>,
    fence: usize,
) -> Result<()>
where
    T: Element,
    C: Communicator,
    M: ShardMemory<T, C>,
{
    let (done, kept): (Vec<_>, Vec<_>) = std::mem::take(held)
        .into_iter()
        .partition(|h| h.reductions <= fence);
    *held = kept;
    let mut written = Ok(());
    for Held { write, buffer, .. } in done {
        if let (Some((bucket, add)), Ok(())) = (write, &written) {
            written = reduction.write_full(bucket, &buffer, add);
        }
        pool.push(buffer);
    }
    written
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
pub(super) fn take_buffer<T, C, M>(
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
pub(super) fn take_shortest<T, C, M>(
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
pub(super) fn land<T, C, M>(
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
pub(super) fn land_next<T, C, M>(
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

pub(super) fn thread_gone() -> Error {
    Error::State("the communication thread stopped before every bucket was reduced".into())
}

pub(super) fn submit<T: Element, B>(reducer: &mut Reducer<T, B>, job: Job<B>) {
    match reducer {
        Reducer::Queued { queue, .. } | Reducer::Inline { queue, .. } => queue.push(job),
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
