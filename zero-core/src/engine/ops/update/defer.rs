//! [`ShardUpdate::Deferred`](super::ShardUpdate::Deferred): the buckets
//! stepped in forward order (buckets follow gradient order, so the last
//! one holds the first layers), each one's owned pieces written into the
//! parameters and the bucket handed to the communication thread, whose
//! all-gathers run into the next forward (`deferred.rs`): the first
//! layers' parameters are on the wire while the rest step.

use super::bucket::{bucket_copies, copies_from, longest_chunk, step_bucket, BucketStep, Buckets};
use crate::comm::Communicator;
use crate::engine::deferred::{GatherJob, Payload, Pending};
use crate::engine::{Engine, ParamAccess, ParamCopy, ShardMemory};
use crate::{Element, Error, Result};
use std::sync::{mpsc, Arc};

/// The update whose gathers are left running.
pub(super) struct Deferred<'s, B> {
    pub buckets: Buckets<'s, B>,
}

impl<B: Send + Sync + 'static> Deferred<'_, B> {
    pub fn run<T: Element, C: Communicator, M: ShardMemory<T, C, Buffer = B>>(
        self,
        engine: &mut Engine<T, C, M>,
        params: &mut M::Params<'_>,
    ) -> Result<()> {
        let Buckets {
            groups,
            mut grad_chunk,
            stepping,
        } = self.buckets;
        let access = engine
            .stage
            .deferred_gathers()
            .and_then(|gathers| gathers.access.take())
            .ok_or_else(|| Error::State("internal: no parameter access to defer with".into()))?;
        let order: Vec<usize> = (0..groups.len())
            .rev()
            .filter(|&k| engine.mask.bucket_active[k])
            .collect();
        let copies: Vec<Vec<ParamCopy>> = order
            .iter()
            .map(|&k| bucket_copies(&engine.sharding.layout, &engine.mask.active, k))
            .collect();
        let (job_tx, jobs) = mpsc::channel();
        let (mut send, payload) = match gather_payload(engine, access, jobs) {
            Ok(ready) => ready,
            Err((e, access)) => {
                if let Some(gathers) = engine.stage.deferred_gathers() {
                    gathers.access = Some(access);
                }
                return Err(e);
            }
        };
        engine
            .refresh
            .start(needed_per_param(engine.params.len(), &copies));
        let started = match engine.worker.as_ref().filter(|w| w.alive()) {
            Some(worker) => worker.run(payload, |memory, payload| payload.run(memory)),
            None => Err(payload),
        };
        let stepper = BucketStep::new(
            &engine.sharding,
            stepping,
            &engine.mask.bucket_active,
            &engine.window.early_stepped,
            engine.buffers.grad_shard.as_ref(),
        )?;
        let mut stepped = Ok(());
        for (&k, copies) in order.iter().zip(copies) {
            let chunk = engine.sharding.layout.buckets[k].clone();
            let owned = copies_from(
                &engine.sharding.owned_copies[groups[k].clone()],
                chunk.start,
            );
            stepped = step_bucket(
                &mut engine.memory,
                engine.optimizer.home_mut()?,
                params,
                (engine.buffers.param_shard.here_mut()?, grad_chunk.as_mut()),
                &stepper,
                (k, groups[k].clone()),
                &mut send,
            )
            .and_then(|()| engine.memory.write_params(params, &owned, &send));
            if stepped.is_err() {
                break;
            }
            // The thread runs until the channel closes.
            let _ = job_tx.send(GatherJob {
                owned,
                chunk: chunk.len(),
                len: engine.sharding.layout.bucket_range(k).len(),
                copies,
            });
        }
        // Closing the channel ends the thread after the last job.
        drop(job_tx);
        let gathered = leave_running(engine, started);
        stepped.and(gathered)
    }
}

/// Leaves the gathers `started` on the communication thread running into
/// the next forward, or, without a thread, runs them here.
fn leave_running<T: Element, C: Communicator, M: ShardMemory<T, C>>(
    engine: &mut Engine<T, C, M>,
    started: std::result::Result<Pending<T, C, M>, Payload<T, C, M>>,
) -> Result<()> {
    match started {
        Ok(handle) => {
            if let Some(gathers) = engine.stage.deferred_gathers() {
                gathers.pending = Some(handle);
                gathers.steps += 1;
            }
            Ok(())
        }
        Err(payload) => {
            // No thread: the same all-gathers, in the same order, here.
            tracing::warn!("no communication thread; gathering before the step returns");
            let finished = payload.run(&mut engine.memory);
            finished.put_back(&mut engine.buffers.pool, engine.stage.deferred_gathers())
        }
    }
}

/// What the gathers take: the engine's communicator, the parameter
/// access, the `jobs`, a chunk buffer of their own and a pooled bucket
/// buffer; and beside it a chunk buffer to step into. On failure the
/// access comes back with the error.
#[allow(clippy::type_complexity)]
fn gather_payload<T: Element, C: Communicator, M: ShardMemory<T, C>>(
    engine: &mut Engine<T, C, M>,
    access: Box<dyn ParamAccess<T, C, M>>,
    jobs: mpsc::Receiver<GatherJob>,
) -> std::result::Result<(M::Buffer, Payload<T, C, M>), (Error, Box<dyn ParamAccess<T, C, M>>)> {
    let chunk = longest_chunk(&engine.sharding);
    let buffers = engine.memory.alloc_zeroed(chunk).and_then(|thread_send| {
        let send = engine.memory.alloc_zeroed(chunk)?;
        let (recv, _) = crate::engine::reduce::take_shortest(
            &mut engine.memory,
            &mut engine.buffers.pool,
            engine.sharding.longest_bucket,
        )?;
        Ok((send, thread_send, recv))
    });
    let (send, thread_send, recv) = match buffers {
        Ok(buffers) => buffers,
        Err(e) => return Err((e, access)),
    };
    let payload = Payload {
        comm: Arc::clone(&engine.comm),
        jobs,
        send: thread_send,
        recv,
        access,
        refresh: Arc::clone(&engine.refresh),
        dtype: engine.wire.gather,
    };
    Ok((send, payload))
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
