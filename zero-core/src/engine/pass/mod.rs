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

mod handover;
mod join;
mod schedule;

pub(super) use handover::PassParts;
pub(super) use schedule::{PassFacts, Runner, Schedule};

use super::reduce::{start_host_steps, Back, BucketMap, Job, Reducer, Reduction, Returns, Targets};
use super::shard_memory::{deferral, HostStepper};
use super::worker::CommWorker;
use super::{ReductionProgress, ShardMemory};
use crate::comm::Communicator;
use crate::{DType, Element, Error, Result};
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
    pub(super) fn new(
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

    pub(in crate::engine) fn schedule(&self) -> Schedule {
        self.schedule
    }
}

/// Starts one backward pass's reductions on the communication thread
/// (`worker`, when one runs); without one, they run after backward instead
/// (the same result, without overlap).
pub(in crate::engine) fn start_on_thread<T, C, M>(
    worker: Option<&CommWorker<M>>,
    (comm, replicas): (Arc<C>, Option<Arc<C>>),
    map: BucketMap,
    progress: ReductionProgress,
    targets: Targets<T, M::Buffer>,
) -> Reducer<T, M::Buffer>
where
    T: Element,
    C: Communicator,
    M: ShardMemory<T, C>,
{
    let buckets = map.full.len();
    let (jobs, job_rx) = mpsc::channel::<Job<M::Buffer>>();
    let (returned_tx, returned) = mpsc::channel::<Back<M::Buffer>>();
    let task = ReductionTask {
        comm,
        replicas,
        map,
        progress,
        targets,
        jobs: job_rx,
        returned: returned_tx,
    };
    let started = match worker {
        Some(worker) => worker.run(task, ReductionTask::run),
        None => Err(task),
    };
    match started {
        Ok(ticket) => Reducer::Thread {
            jobs,
            returned: Returns::new(buckets, returned),
            ticket,
        },
        Err(task) => {
            tracing::warn!("no communication thread; reducing after backward");
            Reducer::Queued {
                targets: task.targets,
                map: task.map,
                queue: Vec::new(),
            }
        }
    }
}

/// A pass's reductions launched on the calling thread as buckets fill, by
/// a memory whose collectives complete after they return; with the
/// interleaved schedule (offload), the host steps on a thread of its own
/// (`stepper`, over the shard's buckets and the write-back's dtype).
pub(in crate::engine) fn start_inline<T, C, M>(
    memory: &mut M,
    mut targets: Targets<T, M::Buffer>,
    map: BucketMap,
    stepper: Option<HostStepper>,
    shard: (Vec<Range<usize>>, Option<DType>),
) -> Result<Reducer<T, M::Buffer>>
where
    T: Element,
    C: Communicator,
    M: ShardMemory<T, C>,
{
    let region = targets.shard.as_mut().and_then(M::host_region);
    let steps = match (targets.early.take(), stepper, region) {
        (None, _, _) => None,
        (Some(early), Some(stepper), Some(region)) => Some(Box::new(start_host_steps::<T, C, M>(
            early, stepper, shard, region,
        )?)),
        (Some(early), _, _) => {
            targets.early = Some(early);
            return Err(Error::State(
                "internal: an inline pass steps early only on a host stepper, from a \
                 gradient shard in host memory"
                    .into(),
            ));
        }
    };
    deferral(memory)?.defer_completion();
    Ok(Reducer::Inline {
        targets,
        map,
        queue: Vec::new(),
        held: Vec::new(),
        steps,
        result: Ok(()),
    })
}

/// One backward pass's reductions on the communication thread: each job
/// reduced as it comes, in order, and its buffer sent back.
struct ReductionTask<T: Element, C, B> {
    comm: Arc<C>,
    replicas: Option<Arc<C>>,
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
                    replicas: task.replicas.as_deref(),
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
