//! Stage 0: the replica stepped a group of pieces at a time through two
//! small buffers ([`Replica`]), and, on a communication thread, each group
//! stepped as soon as the reductions of its buckets are back while later
//! ones are still on the wire ([`AsReduced`], PyTorch's
//! `hook_with_zero_step`).

use crate::comm::Communicator;
use crate::engine::reduce::{land_next, thread_gone, Reducer};
use crate::engine::{Engine, ParamCopy, ShardMemory, ShardStep, StageState, StepPiece};
use crate::{Element, Error, Result};
use std::ops::Range;

/// [`StepPath::Replica`](super::StepPath::Replica): the replica stepped
/// after every reduction.
pub(in crate::engine) struct Replica<'s> {
    /// Which parameters step.
    pub stepping: &'s [bool],
}

impl Replica<'_> {
    /// Steps every parameter through two small buffers (values and
    /// gradients of a few whole pieces at a time, about a bucket), so that
    /// no second copy of the parameters lives beside the replica.
    pub fn run<T: Element, C: Communicator, M: ShardMemory<T, C>>(
        self,
        engine: &mut Engine<T, C, M>,
        params: &mut M::Params<'_>,
    ) -> Result<()> {
        self.run_with(engine, params, |_, _, _| Ok(()))
    }

    /// [`Replica::run`], calling `before` with the gradient buffer and a
    /// group's elements of it before each group of pieces that steps.
    fn run_with<T: Element, C: Communicator, M: ShardMemory<T, C>>(
        self,
        engine: &mut Engine<T, C, M>,
        params: &mut M::Params<'_>,
        mut before: impl FnMut(&mut Engine<T, C, M>, &mut M::Buffer, Range<usize>) -> Result<()>,
    ) -> Result<()> {
        let Some(mut grads) = engine.buffers.full_grads.take() else {
            return Err(Error::State(
                "internal: no reduced gradient buffer in stage 0".into(),
            ));
        };
        let longest = engine.sharding.longest_bucket;
        let mut values = engine.buffers.take_pooled(&mut engine.memory, longest)?;
        let mut piece_grads = engine.buffers.take_pooled(&mut engine.memory, longest)?;
        let mut result = Ok(());
        let mut first = 0;
        while first < engine.sharding.owned.len() && result.is_ok() {
            let group = next_group(engine, first);
            first = group.end;
            result = self.step_group(
                engine,
                params,
                (&mut grads, &mut before),
                group,
                (&mut values, &mut piece_grads),
            );
        }
        engine.buffers.full_grads = Some(grads);
        engine.buffers.pool.push(values);
        engine.buffers.pool.push(piece_grads);
        result
    }

    /// Steps the owned pieces `group` (if any of them steps), through the
    /// pooled `values` and `piece_grads` when they are long enough.
    fn step_group<T: Element, C: Communicator, M: ShardMemory<T, C>>(
        &self,
        engine: &mut Engine<T, C, M>,
        params: &mut M::Params<'_>,
        (grads, before): (
            &mut M::Buffer,
            &mut impl FnMut(&mut Engine<T, C, M>, &mut M::Buffer, Range<usize>) -> Result<()>,
        ),
        group: Range<usize>,
        (values, piece_grads): (&mut M::Buffer, &mut M::Buffer),
    ) -> Result<()> {
        let stepping = self.stepping;
        let owned = &engine.sharding.owned;
        if !owned[group.clone()].iter().any(|p| stepping[p.param]) {
            return Ok(());
        }
        let start = owned[group.start].flat_range.start;
        let len = owned[group.end - 1].flat_range.end - start;
        // A piece longer than the pooled buffers gets buffers of its own.
        let (mut own_values, mut own_grads);
        let (values, piece_grads) = if len <= M::buffer_len(values) {
            (values, piece_grads)
        } else {
            own_values = engine.memory.alloc_zeroed(len)?;
            own_grads = engine.memory.alloc_zeroed(len)?;
            (&mut own_values, &mut own_grads)
        };
        before(engine, grads, start..start + len)?;
        let copies: Vec<ParamCopy> = engine.sharding.owned_copies[group.clone()]
            .iter()
            .map(|c| ParamCopy {
                at: c.at - start,
                ..c.clone()
            })
            .collect();
        engine.memory.read_params(params, &copies, values)?;
        engine
            .memory
            .copy_range(piece_grads, 0, grads, start..start + len, false)?;
        let pieces: Vec<StepPiece<'_>> = engine.sharding.owned[group.clone()]
            .iter()
            .zip(&engine.sharding.keys[group])
            .map(|(piece, key)| {
                let at = piece.flat_range.start - start;
                StepPiece {
                    key,
                    range: at..at + piece.len(),
                    active: stepping[piece.param],
                }
            })
            .collect();
        let whole = [Range { start: 0, end: len }];
        let plan = ShardStep {
            pieces: &pieces,
            buckets: &whole,
            bucket_active: &[true],
            origin: start,
            // Stage 0's plan has one rank: its shard is the flat buffer.
            shard_len: engine.sharding.partition.shard_numel,
        };
        engine
            .memory
            .step(engine.optimizer.home_mut()?, values, piece_grads, plan)?;
        let written: Vec<ParamCopy> = copies
            .into_iter()
            .filter(|c| engine.mask.active[c.param])
            .collect();
        engine.memory.write_params(params, &written, values)
    }
}

/// The owned pieces from `first` on that step together: whole pieces
/// (their optimizer state is per piece), as many as fit a pooled buffer
/// (as long as the longest bucket), and at least one.
fn next_group<T: Element, C: Communicator, M: ShardMemory<T, C>>(
    engine: &Engine<T, C, M>,
    first: usize,
) -> Range<usize> {
    let owned = &engine.sharding.owned;
    let start = owned[first].flat_range.start;
    let mut end = first + 1;
    while end < owned.len() && owned[end].flat_range.end - start <= engine.sharding.longest_bucket {
        end += 1;
    }
    first..end
}

/// [`StepPath::ReplicaAsReduced`](super::StepPath::ReplicaAsReduced): with
/// every bucket launched, each group of parameters steps as soon as the
/// reductions of its buckets are back. The same operations on the same
/// values as stepping after every reduction, so the same bits.
pub(in crate::engine) struct AsReduced;

impl AsReduced {
    /// Steps, unless the trainable mask changed: then the pass is joined
    /// and the replica steps after every reduction ([`Replica`]). A
    /// reduction that fails stops the step there: the groups before it
    /// have stepped. Returns the gradient norm (none: nothing here needs
    /// every gradient).
    pub fn run<T: Element, C: Communicator, M: ShardMemory<T, C>>(
        self,
        engine: &mut Engine<T, C, M>,
        last: Option<&[Option<M::Grad<'_>>]>,
        micro_steps: usize,
        params: &mut M::Params<'_>,
    ) -> Result<Option<f64>> {
        let stepping = engine
            .flush_pass(last)
            .and_then(|()| mask_beside_reductions(engine));
        let stepping = match stepping {
            Ok(Some(stepping)) => stepping,
            Ok(None) => {
                engine.join_pass()?;
                // Already reduced: the step goes on as usual.
                return engine.after_ready(
                    last,
                    micro_steps,
                    true,
                    params,
                    |engine, stepping, params| Replica { stepping }.run(engine, params),
                );
            }
            Err(e) => {
                if let Err(joined) = engine.join_pass() {
                    tracing::debug!(
                        "after a failed hand-over, the reductions failed too: {joined}"
                    );
                }
                return Err(e);
            }
        };
        let ranges = engine.sharding.stepping_ranges(&stepping);
        let factor = (micro_steps > 1).then(|| 1.0 / micro_steps as f64);
        // The step's two buffers are bucket buffers coming back, not two
        // more beside those still out.
        let stepped = land_into_pool(engine, 2).and_then(|()| {
            Replica {
                stepping: &stepping,
            }
            .run_with(engine, params, |engine, grads, span| {
                land_span(engine, grads, span, &ranges, factor)
            })
        });
        // The reductions' own failure first: the step stopped because of it.
        engine.join_pass().and(stepped)?;
        Ok(None)
    }
}

/// Which parameters step, as the step after every reduction would find
/// them, with the trainable mask all-reduced on the side communicator
/// (while the reductions go on); `None` if the mask changed (the buckets
/// are rebuilt after the reductions, as usual).
fn mask_beside_reductions<T: Element, C: Communicator, M: ShardMemory<T, C>>(
    engine: &mut Engine<T, C, M>,
) -> Result<Option<Vec<bool>>> {
    if !engine.config.check_trainability {
        return Ok(Some(engine.window.with_gradient(&engine.mask.active)));
    }
    let local = engine.window.with_gradient(&engine.mask.trainable);
    let side = match &engine.stage {
        StageState::Replicated { side: Some(side) } => side,
        _ => {
            return Err(Error::State(
                "internal: no side communicator for the mask".into(),
            ))
        }
    };
    let active = crate::engine::mask_over(&mut engine.memory, side, &engine.params, &local)?;
    Ok((active == engine.mask.active).then_some(active))
}

/// Takes buffers back from the communication thread (writing their
/// buckets into the full buffer) until the pool holds `count` as long as
/// the longest bucket, or none is out.
fn land_into_pool<T: Element, C: Communicator, M: ShardMemory<T, C>>(
    engine: &mut Engine<T, C, M>,
    count: usize,
) -> Result<()> {
    let longest = engine.sharding.longest_bucket;
    let Some(Reducer::Thread { returned, .. }) = engine.pass.as_mut().map(|p| &mut p.reducer)
    else {
        return Ok(());
    };
    while returned.in_flight > 0
        && engine
            .buffers
            .pool
            .iter()
            .filter(|b| M::buffer_len(b) >= longest)
            .count()
            < count
    {
        let full = engine.buffers.full_grads.as_mut();
        land_next(
            returned,
            &mut engine.memory,
            &engine.sharding.layout,
            full,
            &mut engine.buffers.pool,
        )?;
    }
    Ok(())
}

/// Takes buffers back from the communication thread until every bucket
/// overlapping `span` (elements of the full buffer `grads`) is written in,
/// then scales the stepping `ranges` within it by `factor` (the
/// micro-steps' average).
fn land_span<T: Element, C: Communicator, M: ShardMemory<T, C>>(
    engine: &mut Engine<T, C, M>,
    grads: &mut M::Buffer,
    span: Range<usize>,
    ranges: &[Range<usize>],
    factor: Option<f64>,
) -> Result<()> {
    let Some(Reducer::Thread { returned, .. }) = engine.pass.as_mut().map(|p| &mut p.reducer)
    else {
        return Err(Error::State(
            "internal: no communication thread to take buckets from".into(),
        ));
    };
    let layout = &engine.sharding.layout;
    let needed: Vec<usize> = (0..layout.buckets.len())
        .filter(|&k| {
            let bucket = layout.bucket_range(k);
            bucket.start < span.end && span.start < bucket.end
        })
        .collect();
    if returned.lost {
        return Err(thread_gone());
    }
    while needed.iter().any(|&k| returned.pending[k] > 0) {
        land_next(
            returned,
            &mut engine.memory,
            layout,
            Some(grads),
            &mut engine.buffers.pool,
        )?;
    }
    if let Some(factor) = factor {
        let within: Vec<Range<usize>> = ranges
            .iter()
            .map(|r| r.start.max(span.start)..r.end.min(span.end))
            .filter(|r| !r.is_empty())
            .collect();
        engine.memory.scale(grads, &within, factor)?;
    }
    Ok(())
}
