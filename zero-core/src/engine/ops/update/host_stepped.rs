//! [`StepPath::HostStepped`](super::StepPath::HostStepped): offload's step
//! thread still stepping after backward (see
//! [`Engine::finish_pass_stepping`]), each active bucket's weights go up,
//! are all-gathered and written into the replica as soon as the thread has
//! stepped it, while it steps the next ones, so the write-back overlaps
//! the last steps instead of following them.

use super::bucket::{gather_buffers, gather_into_replica, Wire};
use crate::comm::Communicator;
use crate::engine::{packed_len, Engine, ShardMemory};
use crate::{Element, Result};

/// The write-back of the buckets offload's step thread steps.
pub(super) struct HostStepped;

impl HostStepped {
    /// `Ok(true)` once every active bucket is written; `Ok(false)` at the
    /// first bucket the thread does not step (its gradient came after its
    /// bucket was reduced, or the thread failed): then the caller steps and
    /// writes back as without the thread (writing the buckets before it
    /// again, which changes nothing).
    pub fn run<T: Element, C: Communicator, M: ShardMemory<T, C>>(
        self,
        engine: &mut Engine<T, C, M>,
        params: &mut M::Params<'_>,
    ) -> Result<bool> {
        let (mut send, mut recv) = gather_buffers(engine)?;
        let dtype = engine.wire.gather;
        let layout = &engine.sharding.layout;
        let mut outcome = Ok(true);
        for k in 0..layout.buckets.len() {
            if !engine.mask.bucket_active[k] {
                continue;
            }
            let Some(steps) = engine.host_steps.as_mut() else {
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
            outcome = engine
                .memory
                .copy_range(&mut send, 0, source, up, false)
                .and_then(|()| {
                    let wire = match packed {
                        Some((_, wire)) => Wire::Packed(wire),
                        None => Wire::As(dtype),
                    };
                    gather_into_replica(
                        &mut engine.memory,
                        &*engine.comm,
                        params,
                        (&send, &mut recv, wire),
                        (layout, &engine.mask.active, k),
                    )
                })
                .map(|()| true);
            if outcome.is_err() {
                break;
            }
        }
        engine.buffers.pool.push(recv);
        outcome
    }
}
