//! The optimizer step: the accumulated gradients reduced (if backward did
//! not), averaged, unscaled and clipped; the owned pieces stepped; the
//! updated parameters gathered into the replica.

use super::update::{AsReduced, Replica, StepPath};
use crate::comm::{Communicator, ReduceOp};
use crate::engine::grads::SteppingGrads;
use crate::engine::scaler::LossScaler;
use crate::engine::StepReport;
use crate::engine::{Engine, GradPiece, Offload, Overlap, ShardMemory, Stage};
use crate::{Element, Error, Result};

impl<T: Element, C: Communicator, M: ShardMemory<T, C>> Engine<T, C, M> {
    /// Closes the accumulation window with an optimizer step (`last`: the
    /// last micro-step's gradients, given with the step), whatever the
    /// step's outcome, and reports it.
    pub(in crate::engine) fn reduce_and_update(
        &mut self,
        last: Option<&[Option<M::Grad<'_>>]>,
        params: &mut M::Params<'_>,
    ) -> Result<StepReport> {
        let micro_steps = self.window.micro_steps + usize::from(last.is_some());
        if let Some(grads) = last {
            self.window.mark_present(grads);
        }
        // Whatever happens below, this window is over: a failed step must
        // not leak its micro-steps into the next one.
        let result = self
            .finish_gathers()
            .and_then(|()| self.stage.end_fetch_pass())
            .and_then(|()| {
                self.with_shard_home(|engine| engine.run_step(last, micro_steps, params))
            });
        self.discard_window();
        let grad_norm = result?;
        let (skipped, loss_scale) = self
            .scaler
            .as_ref()
            .map_or((false, None), LossScaler::outcome);
        if !skipped {
            self.steps += 1;
        }
        Ok(StepReport {
            grad_norm,
            micro_steps,
            skipped,
            loss_scale,
        })
    }

    /// The optimizer step after the last micro-step: the one place that
    /// issues its collectives, in this order on every rank:
    /// 1. the bucket reductions launched during backward end
    ///    ([`Engine::finish_pass`]);
    /// 2. the trainable mask's all-reduce, when checked
    ///    (`Trainability::for_step`);
    /// 3. the bucket reductions of gradients given after backward
    ///    (`reduce_buckets`);
    /// 4. loss scaling's inf/NaN all-reduce (`SteppingGrads::unscale_or_skip`);
    /// 5. the gradient norm's all-reduce (`SteppingGrads::clip`);
    /// 6. the parameters' all-gathers, bucket by bucket (stages 1-3), as
    ///    the step's path says ([`StepPath`], decided once for the window).
    ///
    /// Every branch between them depends only on the configuration and on
    /// what the ranks agree on (the graph, checked at `begin_backward`; the
    /// reduced mask; the reduced norm), so every rank issues the same
    /// collectives in the same order: a collective never pairs with a
    /// different one on another rank. The one exception runs on a
    /// communicator of its own: stage 0 stepping each bucket as it is
    /// reduced all-reduces the mask beside the reductions
    /// ([`StepPath::ReplicaAsReduced`]). Returns the gradient norm.
    fn run_step(
        &mut self,
        last: Option<&[Option<M::Grad<'_>>]>,
        micro_steps: usize,
        params: &mut M::Params<'_>,
    ) -> Result<Option<f64>> {
        match StepPath::of(self, last, micro_steps) {
            StepPath::ReplicaAsReduced => AsReduced.run(self, last, micro_steps, params),
            StepPath::Replica => self.after_ready(
                last,
                micro_steps,
                false,
                params,
                |engine, stepping, params| Replica { stepping }.run(engine, params),
            ),
            StepPath::Shard(update) => self.after_ready(
                last,
                micro_steps,
                false,
                params,
                |engine, stepping, params| update.run(engine, false, stepping, params),
            ),
            StepPath::HostStepped(update) => self.after_ready(
                last,
                micro_steps,
                false,
                params,
                |engine, stepping, params| update.run(engine, true, stepping, params),
            ),
        }
    }

    /// Makes the gradients ready and runs `update` with the parameters that
    /// step: closes the pass (unless its reductions are `reduced` already),
    /// reduces what backward did not, averages the micro-steps, unscales
    /// and clips. Returns the gradient norm; a step loss scaling skips runs
    /// no `update`.
    pub(in crate::engine) fn after_ready<'p>(
        &mut self,
        last: Option<&[Option<M::Grad<'_>>]>,
        micro_steps: usize,
        reduced: bool,
        params: &mut M::Params<'p>,
        update: impl FnOnce(&mut Self, &[bool], &mut M::Params<'p>) -> Result<()>,
    ) -> Result<Option<f64>> {
        let reduced = reduced || self.finish_pass_stepping(last)?;
        // Offload's step thread may still be stepping its last buckets (the
        // write-back takes them as they come, `ShardUpdate::run`): whatever
        // reads the gradient shard before (averaging; clipping and loss
        // scaling, which the interleaved schedule refuses) waits for it.
        if self.config.reads_every_gradient(micro_steps) {
            self.finish_host_steps()?;
        }
        if !reduced && self.window.in_shard {
            return Err(Error::State(
                "this accumulation window began with begin_backward; hand every micro-step's \
                 gradients over the same way (zero_candle: backward_step for every micro-step)"
                    .into(),
            ));
        }
        // The mask is agreed by every rank, whichever group it is in.
        let world = crate::engine::groups::world(&self.comm, &self.groups);
        let stepping = self.mask.for_step(
            self.config.check_trainability,
            &self.window,
            (&mut self.memory, world),
            (&self.params, &self.sharding.layout),
        )?;
        // The owned pieces' current values (the replica may have been changed
        // by the user since the last step; master weights are the truth),
        // unless `begin_backward` read them (and the interleaved schedule
        // may have stepped some since). Stage 0 without master weights steps
        // the replica bucket by bucket instead, and a lean shard reads them
        // as it steps.
        if !self.window.params_read
            && (self.config.stage != Stage::Ddp || self.wire.masters)
            && !self.lean_shard()
        {
            self.refresh_param_shard(params)?;
        }
        let ranges = self.sharding.stepping_ranges(&stepping);
        if !reduced {
            // The serial path: every active bucket reduced now.
            self.with_bucket_buffer(|engine, buffer| engine.reduce_buckets(last, buffer))?;
        }
        if let Some(groups) = &self.groups {
            let grads = reduced_grads(&mut self.buffers.grad_shard, &mut self.buffers.full_grads)?;
            let wire = self.wire.replica;
            let buckets = (
                &self.sharding.layout.buckets[..],
                &self.window.early_stepped[..],
            );
            groups.average(&mut self.memory, grads, buckets, wire)?;
        }
        // Only what reads the gradients asks for them: offload's step thread
        // may still hold the gradient shard (the write-back takes it).
        let (clip, norm) = (self.config.clip, self.config.compute_grad_norm);
        let mut grad_norm = None;
        if self.config.reads_every_gradient(micro_steps) {
            let mut grads = SteppingGrads {
                comm: &*self.comm,
                memory: &mut self.memory,
                grads: reduced_grads(&mut self.buffers.grad_shard, &mut self.buffers.full_grads)?,
                ranges: &ranges,
                replicated: self.config.stage == Stage::Ddp,
            };
            if micro_steps > 1 {
                grads.scale(1.0 / micro_steps as f64)?;
            }
            if grads.unscale_or_skip(self.scaler.as_mut())? {
                return Ok(None);
            }
            grad_norm = grads.clip(clip, norm, self.steps + 1)?;
        }
        update(self, &stepping, params)?;
        Ok(grad_norm)
    }

    /// Whether stages 1 and 2 keep no copy of the parameter shard between
    /// steps: without master weights the replica holds the owned pieces'
    /// values already, and the after-backward schedule reads them bucket by
    /// bucket as it steps and all-gathers (the bucketed updates, on
    /// the communication thread or, for a memory with its own stream, on
    /// this one). The interleaved schedule steps on the communication
    /// thread during backward, and stage 3's shard, once sharded, is the
    /// only copy of its parameters: both keep the shard.
    pub(in crate::engine) fn lean_shard(&self) -> bool {
        let replicated = match self.config.stage {
            Stage::OptimizerState | Stage::Gradients => true,
            // Until it shards, stage 3 runs as stage 2.
            Stage::Parameters => self.fetcher().is_none(),
            Stage::Ddp => false,
        };
        replicated
            && self.config.overlap == Overlap::AfterBackward
            && !self.wire.masters
            && self.config.offload != Offload::Optimizer
            && (self.memory.fork().is_some() || self.abilities.launches_async)
    }

    /// Runs `f` with a pooled bucket buffer when there is no full gradient
    /// buffer to work in (`None` when there is), and pools it again.
    pub(in crate::engine) fn with_bucket_buffer<R>(
        &mut self,
        f: impl FnOnce(&mut Self, Option<&mut M::Buffer>) -> Result<R>,
    ) -> Result<R> {
        let mut bucket_buf = match self.buffers.full_grads {
            Some(_) => None,
            None => Some(
                self.buffers
                    .take_pooled(&mut self.memory, self.sharding.longest_bucket)?,
            ),
        };
        let result = f(self, bucket_buf.as_mut());
        self.buffers.pool.extend(bucket_buf);
        result
    }

    /// Reduces every active bucket: all-reduce in stage 0, reduce-scatter
    /// into the gradient shard otherwise (the serial path: gradients given
    /// after backward).
    fn reduce_buckets(
        &mut self,
        last: Option<&[Option<M::Grad<'_>>]>,
        mut bucket_buf: Option<&mut M::Buffer>,
    ) -> Result<()> {
        let wire = self.wire.reduce;
        for k in 0..self.sharding.layout.buckets.len() {
            if !self.mask.bucket_active[k] {
                continue;
            }
            let range = self.sharding.layout.bucket_range(k);
            let shard_range = self.sharding.layout.buckets[k].clone();
            // Stages 0 and 1 (and stage 2 inside an accumulation window)
            // reduce in place in the full buffer; stage 2 otherwise flattens
            // straight from the caller's gradients into one bucket buffer.
            let (buffer, at, add) =
                match (self.buffers.full_grads.as_mut(), bucket_buf.as_deref_mut()) {
                    (Some(full), _) => (full, range.start, self.window.in_full_buffer),
                    (None, Some(buf)) => (buf, 0, false),
                    (None, None) => {
                        return Err(Error::State(
                            "internal: no buffer to reduce the gradients in".into(),
                        ))
                    }
                };
            let bucket = at..at + range.len();
            if !add {
                self.memory.zero(buffer, bucket.clone())?;
            }
            if let Some(grads) = last {
                let pieces: Vec<GradPiece<M::Grad<'_>>> = self
                    .sharding
                    .layout
                    .runs_of(k)
                    .iter()
                    .filter_map(|run| {
                        grads[run.param].map(|grad| GradPiece {
                            at: at + run.pos - range.start,
                            grad,
                            range: run.param_range.clone(),
                        })
                    })
                    .collect();
                self.memory.flatten(buffer, &pieces, add)?;
            }
            match self.buffers.grad_shard.as_mut() {
                None => {
                    self.memory
                        .all_reduce_as(&self.comm, buffer, bucket, ReduceOp::Avg, wire)?
                }
                Some(shard) => self.memory.reduce_scatter_as(
                    &self.comm,
                    buffer,
                    bucket,
                    shard,
                    shard_range,
                    ReduceOp::Avg,
                    wire,
                )?,
            }
        }
        Ok(())
    }
}

/// The reduced gradients of the owned pieces: the gradient shard, or in
/// stage 0 the full buffer (whose plan has one rank, so shard offsets are
/// flat offsets).
pub(super) fn reduced_grads<'a, B>(
    grad_shard: &'a mut Option<B>,
    full_grads: &'a mut Option<B>,
) -> Result<&'a mut B> {
    match (grad_shard.as_mut(), full_grads.as_mut()) {
        (Some(g), _) | (None, Some(g)) => Ok(g),
        (None, None) => Err(Error::State(
            "internal: no reduced gradient buffer in this stage".into(),
        )),
    }
}
