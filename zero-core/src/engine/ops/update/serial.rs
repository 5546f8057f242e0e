//! [`ShardUpdate::Serial`](super::ShardUpdate::Serial): the whole shard
//! stepped, then put into the replica: all-gathered bucket by bucket
//! (stages 1-3; stage 3 its replicated parameters only) or, in stage 0
//! with master weights, written from the masters every rank holds.

use crate::comm::Communicator;
use crate::engine::{Engine, ParamCopy, ShardMemory, ShardStep, Stage};
use crate::{Element, Error, Result};

/// The serial update.
pub(super) struct Serial<'s> {
    /// Which parameters step.
    pub stepping: &'s [bool],
}

impl Serial<'_> {
    pub fn run<T: Element, C: Communicator, M: ShardMemory<T, C>>(
        &self,
        engine: &mut Engine<T, C, M>,
        params: &mut M::Params<'_>,
    ) -> Result<()> {
        if engine.lean_shard() {
            // This partition cannot be stepped bucket by bucket (a piece
            // straddles buckets), or no thread gathers: a shard copy after
            // all.
            let numel = engine.sharding.partition.shard_numel;
            if engine.buffers.param_shard.len::<T, C, M>() < numel {
                let shard = engine.memory.alloc_zeroed(numel)?;
                engine.buffers.param_shard.put(shard);
            }
            engine.refresh_param_shard(params)?;
        }
        self.step_shard(engine)?;
        if engine.config.stage == Stage::Ddp {
            // Stage 0 with master weights: every rank holds all of them;
            // the active parameters' updated masters go into the replica,
            // rounded.
            let copies: Vec<ParamCopy> = (engine.sharding.owned_copies.iter())
                .filter(|c| engine.mask.active[c.param])
                .cloned()
                .collect();
            let masters = engine.buffers.param_shard.here()?;
            return engine.memory.write_params(params, &copies, masters);
        }
        engine.with_bucket_buffer(|engine, buffer| gather_buckets(engine, params, buffer))
    }

    /// Steps the stepping pieces of the shard, but for the buckets the
    /// interleaved schedule stepped during backward.
    fn step_shard<T: Element, C: Communicator, M: ShardMemory<T, C>>(
        &self,
        engine: &mut Engine<T, C, M>,
    ) -> Result<()> {
        let mut pieces = engine.sharding.step_pieces(|param| self.stepping[param]);
        let early = &engine.window.early_stepped;
        if early.contains(&true) {
            for piece in &mut pieces {
                let k = engine
                    .sharding
                    .layout
                    .buckets
                    .partition_point(|b| b.end <= piece.range.start);
                if early.get(k) == Some(&true) {
                    piece.active = false;
                }
            }
        }
        let plan = ShardStep {
            pieces: &pieces,
            buckets: &engine.sharding.layout.buckets,
            bucket_active: &engine.mask.bucket_active,
            origin: 0,
            shard_len: engine.sharding.partition.shard_numel,
        };
        let grads = match (
            engine.buffers.grad_shard.as_ref(),
            engine.buffers.full_grads.as_ref(),
        ) {
            (Some(g), _) | (None, Some(g)) => g,
            (None, None) => {
                return Err(Error::State(
                    "internal: no reduced gradient buffer in this stage".into(),
                ))
            }
        };
        engine.memory.step(
            engine.optimizer.home_mut()?,
            engine.buffers.param_shard.here_mut()?,
            grads,
            plan,
        )
    }
}

/// All-gathers every active bucket into the full gradient buffer (its
/// gradients are consumed by now) or into `bucket_buf`, and writes the
/// updated parameters into the replica.
fn gather_buckets<T: Element, C: Communicator, M: ShardMemory<T, C>>(
    engine: &mut Engine<T, C, M>,
    params: &mut M::Params<'_>,
    mut bucket_buf: Option<&mut M::Buffer>,
) -> Result<()> {
    let gather_dtype = engine.wire.gather;
    // Stage 3: a sharded parameter's replica is gone; a bucket of sharded
    // parameters only is not gathered at all.
    let written: Vec<bool> = (0..engine.params.len())
        .map(|p| engine.mask.active[p] && !engine.stage.is_sharded(p))
        .collect();
    let layout = &engine.sharding.layout;
    for k in 0..layout.buckets.len() {
        if !engine.mask.bucket_active[k] || !layout.runs_of(k).iter().any(|r| written[r.param]) {
            continue;
        }
        let range = layout.bucket_range(k);
        let (gathered, at) = match (
            engine.buffers.full_grads.as_mut(),
            bucket_buf.as_deref_mut(),
        ) {
            (Some(full), _) => (full, range.start),
            (None, Some(buf)) => (buf, 0),
            (None, None) => {
                return Err(Error::State(
                    "internal: no buffer to gather the parameters into".into(),
                ))
            }
        };
        engine.memory.all_gather_as(
            &engine.comm,
            engine.buffers.param_shard.here()?,
            layout.buckets[k].clone(),
            gathered,
            at..at + range.len(),
            gather_dtype,
        )?;
        let copies: Vec<ParamCopy> = layout
            .runs_of(k)
            .iter()
            .filter(|run| written[run.param])
            .map(|run| ParamCopy {
                param: run.param,
                param_range: run.param_range.clone(),
                at: at + run.pos - range.start,
            })
            .collect();
        engine.memory.write_params(params, &copies, gathered)?;
    }
    Ok(())
}
