//! [`ShardUpdate::OnThread`](super::ShardUpdate::OnThread): the active
//! buckets stepped in order, each all-gathered on the communication thread
//! while the next one steps, and written into the replica as they come
//! back.

use super::bucket::{bucket_copies, longest_chunk, step_bucket, BucketStep, Buckets};
use crate::comm::Communicator;
use crate::engine::{Engine, Layout, ShardMemory};
use crate::optim::FunctionalOptimizer;
use crate::{DType, Element, Error, Result};
use std::ops::Range;
use std::sync::{mpsc, Arc};

/// All-gathers of stepped buckets allowed in flight at once after backward.
const GATHERS_IN_FLIGHT: usize = 1;

/// A bucket's all-gather back from the communication thread: the bucket,
/// the chunk sent, the gathered bucket, and how it went.
type BucketBack<B> = (usize, B, B, Result<()>);

/// The update with its gathers on the communication thread.
pub(super) struct OnThread<'s, B> {
    pub buckets: Buckets<'s, B>,
}

impl<B: Send + Sync + 'static> OnThread<'_, B> {
    /// `Ok(false)`, nothing done, when the thread is gone (the serial
    /// update gathers the same way).
    pub fn run<T: Element, C: Communicator, M: ShardMemory<T, C, Buffer = B>>(
        self,
        engine: &mut Engine<T, C, M>,
        params: &mut M::Params<'_>,
    ) -> Result<bool> {
        let Buckets {
            groups,
            mut grad_chunk,
            stepping,
        } = self.buckets;
        let (jobs, job_rx) = mpsc::channel::<(usize, M::Buffer, M::Buffer)>();
        let (done_tx, done) = mpsc::channel::<BucketBack<M::Buffer>>();
        let task = GatherTask::new(engine, job_rx, done_tx);
        let Some(Ok(ticket)) = engine.worker.as_ref().map(|w| w.run(task, GatherTask::run)) else {
            return Ok(false);
        };
        // The optimizer writes the shard while the thread sends from it, so
        // each bucket's chunk is first copied into a staging buffer of one
        // chunk (the serial gather sends from the shard itself): the
        // scratch bucket, which is that long, when it exists, else one for
        // this step only. The gather itself takes one bucket buffer, as the
        // serial one does (the next is taken after it came back).
        let had_scratch = engine.buffers.scratch.is_some();
        let mut staging: Vec<M::Buffer> = engine.buffers.scratch.take().into_iter().collect();
        let stepper = BucketStep::new(
            &engine.sharding,
            stepping,
            &engine.mask.bucket_active,
            &engine.window.early_stepped,
            engine.buffers.grad_shard.as_ref(),
        )?;
        let mut arrivals = Arrivals {
            memory: &mut engine.memory,
            pool: &mut engine.buffers.pool,
            staging: &mut staging,
            layout: &engine.sharding.layout,
            active: &engine.mask.active,
            done,
            pending: 0,
            written: Ok(()),
        };
        let chunk = longest_chunk(&engine.sharding);
        let optimizer = engine.optimizer.home_mut()?;
        let param_shard = engine.buffers.param_shard.here_mut()?;
        let mut outcome = Ok(());
        for (k, group) in groups.iter().enumerate() {
            if !stepper.bucket_active[k] {
                continue;
            }
            let shard = (&mut *param_shard, grad_chunk.as_mut());
            outcome = arrivals.staging_buffer(chunk).and_then(|send| {
                arrivals.step_and_send(
                    (&mut *optimizer, &stepper, shard),
                    params,
                    (k, group.clone()),
                    send,
                    &jobs,
                )
            });
            if outcome.is_err() {
                break;
            }
        }
        drop(jobs);
        arrivals.wait_until(params, 0);
        let outcome = outcome.and(arrivals.written);
        // Closing `jobs` ended the task.
        let ended = ticket.wait().ok_or_else(|| {
            Error::State(
                "the communication thread panicked during the all-gathers; this rank's \
                 parameters were not all updated: restart the run from its last checkpoint"
                    .into(),
            )
        });
        if had_scratch {
            engine.buffers.scratch = staging.pop();
        }
        outcome.and(ended).map(|()| true)
    }
}

/// The all-gathers of [`OnThread`] on the communication thread: each
/// stepped bucket it is sent, in order, sent back gathered; after a
/// failure, it issues nothing more (the peers' collectives fail within
/// their deadline).
struct GatherTask<C, B> {
    comm: Arc<C>,
    /// Per bucket, the elements of one rank's chunk and of the bucket.
    sizes: Vec<(usize, usize)>,
    /// The dtype on the wire: the parameters' where master weights are
    /// kept (as the serial update's gathers).
    dtype: DType,
    jobs: mpsc::Receiver<(usize, B, B)>,
    done: mpsc::Sender<BucketBack<B>>,
}

impl<C: Communicator, B> GatherTask<C, B> {
    /// The task for `engine`'s buckets, taking jobs from `jobs` and sending
    /// them back through `done`.
    fn new<T: Element, M: ShardMemory<T, C, Buffer = B>>(
        engine: &Engine<T, C, M>,
        jobs: mpsc::Receiver<(usize, B, B)>,
        done: mpsc::Sender<BucketBack<B>>,
    ) -> Self {
        let layout = &engine.sharding.layout;
        Self {
            comm: Arc::clone(&engine.comm),
            sizes: (0..layout.buckets.len())
                .map(|k| (layout.buckets[k].len(), layout.bucket_range(k).len()))
                .collect(),
            dtype: engine.wire.gather,
            jobs,
            done,
        }
    }

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
struct Arrivals<'a, T: Element, C: Communicator, M: ShardMemory<T, C>> {
    memory: &'a mut M,
    pool: &'a mut Vec<M::Buffer>,
    staging: &'a mut Vec<M::Buffer>,
    layout: &'a Layout,
    active: &'a [bool],
    /// The gathered buckets coming back, and how many are still out.
    done: mpsc::Receiver<BucketBack<M::Buffer>>,
    pending: usize,
    /// The first failed gather or write.
    written: Result<()>,
}

impl<T: Element, C: Communicator, M: ShardMemory<T, C>> Arrivals<'_, T, C, M> {
    /// A staging buffer of `chunk` elements for the next bucket's chunk.
    fn staging_buffer(&mut self, chunk: usize) -> Result<M::Buffer> {
        match self.staging.pop() {
            Some(send) => Ok(send),
            None => self.memory.alloc_zeroed(chunk),
        }
    }

    /// Steps bucket `k` (owned pieces `group`) into `send` and sends it
    /// ([`Arrivals::send`]); on a failed step, `send` goes back to the
    /// staging list.
    #[allow(clippy::type_complexity)]
    fn step_and_send(
        &mut self,
        (optimizer, stepper, shard): (
            &mut dyn FunctionalOptimizer<T>,
            &BucketStep<'_, M::Buffer>,
            (&mut M::Buffer, Option<&mut M::Buffer>),
        ),
        params: &mut M::Params<'_>,
        (k, group): (usize, Range<usize>),
        mut send: M::Buffer,
        jobs: &mpsc::Sender<(usize, M::Buffer, M::Buffer)>,
    ) -> Result<()> {
        let stepped = step_bucket(
            self.memory,
            optimizer,
            params,
            shard,
            stepper,
            (k, group),
            &mut send,
        );
        if let Err(e) = stepped {
            self.staging.push(send);
            return Err(e);
        }
        self.send(params, jobs, k, send)
    }

    /// Sends bucket `k`'s stepped chunk `send` to the thread once fewer
    /// than [`GATHERS_IN_FLIGHT`] are out (the next bucket steps meanwhile:
    /// their buffers are what this overlap costs in memory), and writes
    /// back what has arrived meanwhile. Fails only when the chunk could not
    /// be sent (its buffer goes back to the staging list).
    fn send(
        &mut self,
        params: &mut M::Params<'_>,
        jobs: &mpsc::Sender<(usize, M::Buffer, M::Buffer)>,
        k: usize,
        send: M::Buffer,
    ) -> Result<()> {
        self.wait_until(params, GATHERS_IN_FLIGHT - 1);
        // Overwritten whole by the gather: no need to zero.
        let recv = crate::engine::reduce::take_shortest(
            self.memory,
            self.pool,
            self.layout.bucket_range(k).len(),
        );
        match recv {
            Ok((recv, _)) => {
                // The thread is alive while `jobs` is: it stops only when
                // the channel closes.
                let _ = jobs.send((k, send, recv));
                self.pending += 1;
            }
            Err(e) => {
                self.staging.push(send);
                return Err(e);
            }
        }
        self.take_arrived(params);
        Ok(())
    }

    /// Waits for gathered buckets and writes them until at most `out` are
    /// still out (or the thread is gone).
    fn wait_until(&mut self, params: &mut M::Params<'_>, out: usize) {
        while self.pending > out {
            let Ok(back) = self.done.recv() else {
                break;
            };
            self.pending -= 1;
            self.write(params, back);
        }
    }

    /// Writes the gathered buckets that have come back.
    fn take_arrived(&mut self, params: &mut M::Params<'_>) {
        while let Ok(back) = self.done.try_recv() {
            self.pending -= 1;
            self.write(params, back);
        }
    }

    /// Writes a gathered bucket's active parameters into `params` (if its
    /// gather succeeded; else keeps the first failure) and keeps its
    /// buffers.
    fn write(&mut self, params: &mut M::Params<'_>, back: BucketBack<M::Buffer>) {
        let (k, send, recv, result) = back;
        let written = result.and_then(|()| {
            self.memory
                .write_params(params, &bucket_copies(self.layout, self.active, k), &recv)
        });
        self.staging.push(send);
        self.pool.push(recv);
        if self.written.is_ok() {
            self.written = written;
        }
    }
}
