//! Stage 0: the replica stepped a group of pieces at a time through two
//! small buffers, and, on a communication thread, each group stepped as
//! soon as the reductions of its buckets are back while later ones are
//! still on the wire (PyTorch's `hook_with_zero_step`).

use super::reduce::{land_next, thread_gone, Reducer};
use super::{Engine, Overlap, ParamCopy, ShardMemory, Stage, StageState, StepPiece, StepPlan};
use crate::comm::Communicator;
use crate::{Element, Error, Result};
use std::ops::Range;

impl<T: Element, C: Communicator, M: ShardMemory<T, C>> Engine<T, C, M> {
    /// Stage 0: steps every parameter through two small buffers (values and
    /// gradients of a few whole pieces at a time, about a bucket), so that
    /// no second copy of the parameters lives beside the replica.
    pub(super) fn step_replica(
        &mut self,
        stepping: &[bool],
        params: &mut M::Params<'_>,
    ) -> Result<()> {
        self.step_replica_with(stepping, params, |_, _, _| Ok(()))
    }

    /// [`Engine::step_replica`], calling `before` with the gradient buffer
    /// and a group's elements of it before each group of pieces that
    /// steps.
    pub(super) fn step_replica_with(
        &mut self,
        stepping: &[bool],
        params: &mut M::Params<'_>,
        mut before: impl FnMut(&mut Self, &mut M::Buffer, Range<usize>) -> Result<()>,
    ) -> Result<()> {
        let Some(mut grads) = self.buffers.full_grads.take() else {
            return Err(Error::State(
                "internal: no reduced gradient buffer in stage 0".into(),
            ));
        };
        let mut values = self.take_pooled()?;
        let mut piece_grads = self.take_pooled()?;
        let result = self.step_groups(
            stepping,
            params,
            (&mut grads, &mut before),
            &mut values,
            &mut piece_grads,
        );
        self.buffers.full_grads = Some(grads);
        self.buffers.pool.push(values);
        self.buffers.pool.push(piece_grads);
        result
    }

    fn step_groups(
        &mut self,
        stepping: &[bool],
        params: &mut M::Params<'_>,
        (grads, before): (
            &mut M::Buffer,
            &mut impl FnMut(&mut Self, &mut M::Buffer, Range<usize>) -> Result<()>,
        ),
        values: &mut M::Buffer,
        piece_grads: &mut M::Buffer,
    ) -> Result<()> {
        let mut first = 0;
        while first < self.plan.owned.len() {
            // Whole pieces (their optimizer state is per piece), as many as
            // fit the pooled buffers; a longer piece gets buffers of its own.
            let start = self.plan.owned[first].flat_range.start;
            let mut end = first + 1;
            while end < self.plan.owned.len()
                && self.plan.owned[end].flat_range.end - start <= self.plan.longest_bucket
            {
                end += 1;
            }
            let len = self.plan.owned[end - 1].flat_range.end - start;
            let (mut own_values, mut own_grads);
            let (values, piece_grads) = if len <= M::buffer_len(values) {
                (&mut *values, &mut *piece_grads)
            } else {
                own_values = self.memory.alloc_zeroed(len)?;
                own_grads = self.memory.alloc_zeroed(len)?;
                (&mut own_values, &mut own_grads)
            };
            let group = first..end;
            first = end;
            if !self.plan.owned[group.clone()]
                .iter()
                .any(|p| stepping[p.param])
            {
                continue;
            }
            before(self, grads, start..start + len)?;
            let copies: Vec<ParamCopy> = self.plan.owned_copies[group.clone()]
                .iter()
                .map(|c| ParamCopy {
                    at: c.at - start,
                    ..c.clone()
                })
                .collect();
            self.memory.read_params(params, &copies, values)?;
            self.memory
                .copy_range(piece_grads, 0, grads, start..start + len, false)?;
            let pieces: Vec<StepPiece<'_>> = self.plan.owned[group.clone()]
                .iter()
                .zip(&self.plan.keys[group])
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
            let plan = StepPlan {
                pieces: &pieces,
                buckets: &whole,
                bucket_active: &[true],
                origin: start,
                // Stage 0's plan has one rank: its shard is the flat buffer.
                shard_len: self.plan.partition.shard_numel,
            };
            self.memory
                .step(self.optimizer.as_mut(), values, piece_grads, plan)?;
            let written: Vec<ParamCopy> = copies
                .into_iter()
                .filter(|c| self.mask.active[c.param])
                .collect();
            self.memory.write_params(params, &written, values)?;
        }
        Ok(())
    }

    /// Whether stage 0's configuration lets each bucket step as soon as it
    /// is reduced: nothing needs every gradient first (no clipping, no
    /// gradient norm, no loss scaling) and the replica is what steps (no
    /// master weights).
    pub(super) fn steps_ddp_as_reduced(&self) -> bool {
        self.config.stage == Stage::Ddp
            && self.config.overlap != Overlap::None
            && self.config.clip.is_none()
            && !self.config.compute_grad_norm
            && self.scaler.is_none()
            && !self.has_master_weights()
            && self.fetcher().is_none()
    }

    /// Stage 0's side communicator, once split.
    fn side(&self) -> Option<&C> {
        match &self.stage {
            StageState::Replicated { side } => side.as_ref(),
            _ => None,
        }
    }

    /// Stage 0 after backward, as PyTorch's `hook_with_zero_step`: with
    /// every bucket launched, each group of parameters steps as soon as
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
    /// stops the step there: the groups before it have stepped.
    pub(super) fn step_ddp_as_reduced(
        &mut self,
        last: Option<&[Option<M::Grad<'_>>]>,
        micro_steps: usize,
        params: &mut M::Params<'_>,
    ) -> Result<Option<bool>> {
        let threaded = self
            .pass
            .as_ref()
            .is_some_and(|p| p.schedule().lands && matches!(p.reducer, Reducer::Thread { .. }));
        let masked = !self.config.check_trainability || self.side().is_some();
        if !threaded || !masked || !self.steps_ddp_as_reduced() {
            return Ok(None);
        }
        let stepping = self
            .flush_pass(last)
            .and_then(|()| self.mask_beside_reductions());
        let stepping = match stepping {
            Ok(Some(stepping)) => stepping,
            Ok(None) => {
                self.join_pass()?;
                return Ok(Some(false));
            }
            Err(e) => {
                if let Err(joined) = self.join_pass() {
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
            self.step_replica_with(&stepping, params, |engine, grads, span| {
                engine.land_span(grads, span, &ranges, factor)
            })
        });
        // The reductions' own failure first: the step stopped because of it.
        self.join_pass().and(stepped)?;
        Ok(Some(true))
    }

    /// Which parameters step, as the step after every reduction would find
    /// them, with the trainable mask all-reduced on the side communicator
    /// (while the reductions go on); `None` if the mask changed (the
    /// buckets are rebuilt after the reductions, as usual).
    fn mask_beside_reductions(&mut self) -> Result<Option<Vec<bool>>> {
        if !self.config.check_trainability {
            return Ok(Some(self.with_gradient(&self.mask.active)));
        }
        let local = self.with_gradient(&self.mask.trainable);
        let side = match &self.stage {
            StageState::Replicated { side: Some(side) } => side,
            _ => {
                return Err(Error::State(
                    "internal: no side communicator for the mask".into(),
                ))
            }
        };
        let active = super::mask_over(&mut self.memory, side, &self.params, &local)?;
        Ok((active == self.mask.active).then_some(active))
    }

    /// Takes buffers back from the communication thread (writing their
    /// buckets into the full buffer) until the pool holds `count` as long
    /// as the longest bucket, or none is out.
    fn land_into_pool(&mut self, count: usize) -> Result<()> {
        let longest = self.plan.longest_bucket;
        let Some(Reducer::Thread { returned, .. }) = self.pass.as_mut().map(|p| &mut p.reducer)
        else {
            return Ok(());
        };
        while returned.in_flight > 0
            && self
                .buffers
                .pool
                .iter()
                .filter(|b| M::buffer_len(b) >= longest)
                .count()
                < count
        {
            let full = self.buffers.full_grads.as_mut();
            land_next(
                returned,
                &mut self.memory,
                &self.plan.layout,
                full,
                &mut self.buffers.pool,
            )?;
        }
        Ok(())
    }

    /// Takes buffers back from the communication thread until every
    /// bucket overlapping `span` (elements of the full buffer `grads`) is
    /// written in, then scales the stepping `ranges` within it by `factor`
    /// (the micro-steps' average).
    fn land_span(
        &mut self,
        grads: &mut M::Buffer,
        span: Range<usize>,
        ranges: &[Range<usize>],
        factor: Option<f64>,
    ) -> Result<()> {
        let Some(Reducer::Thread { returned, .. }) = self.pass.as_mut().map(|p| &mut p.reducer)
        else {
            return Err(Error::State(
                "internal: no communication thread to take buckets from".into(),
            ));
        };
        let layout = &self.plan.layout;
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
                &mut self.memory,
                layout,
                Some(grads),
                &mut self.buffers.pool,
            )?;
        }
        if let Some(factor) = factor {
            let within: Vec<Range<usize>> = ranges
                .iter()
                .map(|r| r.start.max(span.start)..r.end.min(span.end))
                .filter(|r| !r.is_empty())
                .collect();
            self.memory.scale(grads, &within, factor)?;
        }
        Ok(())
    }
}
