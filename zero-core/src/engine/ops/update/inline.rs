//! [`ShardUpdate::Inline`](super::ShardUpdate::Inline): a memory whose
//! collectives complete on its stream, in order (the GPU's), steps each
//! bucket, all-gathers it and writes it into the replica, all queued on
//! the calling thread.

use super::bucket::{gather_buffers, gather_into_replica, step_bucket, BucketStep, Buckets, Wire};
use crate::comm::Communicator;
use crate::engine::{Engine, ShardMemory};
use crate::{Element, Result};

/// The inline update of the shard's buckets.
pub(super) struct Inline<'s, B> {
    pub buckets: Buckets<'s, B>,
}

impl<B> Inline<'_, B> {
    /// Each active bucket stepped, all-gathered and written into the
    /// replica, through one chunk buffer and one pooled bucket buffer,
    /// which the stream's order lets the next bucket reuse at once.
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
        let (mut send, mut recv) = gather_buffers(engine)?;
        let dtype = engine.wire.gather;
        let stepper = BucketStep::new(
            &engine.sharding,
            stepping,
            &engine.mask.bucket_active,
            &engine.window.early_stepped,
            engine.buffers.grad_shard.as_ref(),
        )?;
        let layout = &engine.sharding.layout;
        let mut outcome = Ok(());
        for (k, group) in groups.iter().enumerate() {
            if !stepper.bucket_active[k] {
                continue;
            }
            outcome = step_bucket(
                &mut engine.memory,
                engine.optimizer.home_mut()?,
                params,
                (engine.buffers.param_shard.here_mut()?, grad_chunk.as_mut()),
                &stepper,
                (k, group.clone()),
                &mut send,
            )
            .and_then(|()| {
                gather_into_replica(
                    &mut engine.memory,
                    &*engine.comm,
                    params,
                    (&send, &mut recv, Wire::As(dtype)),
                    (layout, &engine.mask.active, k),
                )
            });
            if outcome.is_err() {
                break;
            }
        }
        engine.buffers.pool.push(recv);
        outcome
    }
}
