//! The engine's side of a backward pass: opened by [`Engine::begin_backward`],
//! given gradients as backward makes them, and closed by the step or the next
//! micro-step (the pass itself, its schedule and reductions are the `pass`
//! module's).

use crate::comm::Communicator;
use crate::engine::consistency::check_same_graph;
use crate::engine::pass::PassParts;
use crate::engine::pass::{
    start_inline, start_on_thread, BackwardPass, PassFacts, Runner, Schedule,
};
use crate::engine::reduce::{BucketMap, EarlyStep, Reducer};
use crate::engine::worker::CommWorker;
use crate::engine::{Engine, ReductionProgress, ShardMemory};
use crate::{Element, Error, Result};
use std::sync::Arc;

impl<T, C, M> Engine<T, C, M>
where
    T: Element,
    C: Communicator,
    M: ShardMemory<T, C>,
{
    /// Opens the hand-over of one backward pass's gradients: `expected`
    /// lists, in the order their gradients will arrive, the parameters whose
    /// gradients will be handed over with [`Engine::accumulate_param`] and
    /// how many calls each gets (2 for a weight used by two hooked ops). A
    /// collective (one small all-reduce checks that every rank predicts the
    /// same order; a rank whose graph differs is an error on every rank).
    ///
    /// On the first call, before any step, the parameters are re-partitioned
    /// in this order, so that buckets complete one after another during
    /// backward. Then, unless the schedule is [`Overlap::None`](crate::engine::Overlap::None), each bucket
    /// is reduced on a communication thread as soon as it is complete (see
    /// [`Overlap`](crate::engine::Overlap)). The step (or [`Engine::accumulate`]) that
    /// follows closes the pass. A prediction that turns out wrong costs
    /// overlap, never correctness, except with [`Overlap::Interleaved`](crate::engine::Overlap::Interleaved): a
    /// gradient that arrives after its bucket was stepped is an error.
    ///
    /// With [`Overlap::Interleaved`](crate::engine::Overlap::Interleaved), on the last micro-step, the owned
    /// pieces are read from `params` here (the step does not read them
    /// again): change no parameter between this call and the step.
    pub fn begin_backward(
        &mut self,
        expected: &[(usize, usize)],
        params: &mut M::Params<'_>,
    ) -> Result<()> {
        self.finish_gathers()?;
        if self.pass.is_some() {
            return Err(Error::State(
                "begin_backward called while the previous backward pass's gradients are still \
                 pending; finish it with step (or accumulate) first"
                    .into(),
            ));
        }
        if let Some(&(param, _)) = expected.iter().find(|(p, _)| *p >= self.params.len()) {
            return Err(Error::Config(format!(
                "begin_backward: parameter #{param} does not exist (there are {})",
                self.params.len()
            )));
        }
        // At stage 3 the fetcher also plans the backward's gathers here.
        let forward = match self.fetcher().cloned() {
            Some(fetcher) => {
                let predicted: Vec<usize> = expected.iter().map(|&(p, _)| p).collect();
                fetcher.begin_backward(&predicted)?
            }
            None => 0,
        };
        check_same_graph(&mut self.memory, &*self.comm, expected, forward)?;
        // The same answer on every rank: it depends on the memory's type.
        let forkable = self.memory.fork().is_some();
        // Stage 0 stepping each bucket as it is reduced all-reduces the
        // trainable mask beside the reductions, on a communicator of its
        // own (the same decision on every rank: it depends on the
        // configuration).
        let side = forkable
            && self.config.check_trainability
            && self.config.steps_ddp_as_reduced(self.wire.masters)
            && self.comm.concurrent_groups();
        self.stage.split_side(&*self.comm, side)?;
        if !PassFacts::of(self, forkable).reduces_during_backward() {
            // This memory reduces in the step; the gradients go to the full
            // buffer as before.
            return Ok(());
        }
        self.plan_in_order(expected)?;
        let Some(schedule) = Schedule::decide(&PassFacts::of(self, forkable)) else {
            // Stages 0 and 1 accumulate locally until the last micro-step.
            return Ok(());
        };
        self.open_pass(schedule, expected, params)
    }

    /// Opens the pass: the buffers its schedule needs, the reductions'
    /// targets and their runner.
    fn open_pass(
        &mut self,
        schedule: Schedule,
        expected: &[(usize, usize)],
        params: &mut M::Params<'_>,
    ) -> Result<()> {
        let mut expected_calls = vec![0; self.params.len()];
        for &(param, calls) in expected {
            expected_calls[param] = calls;
        }
        let remaining = self.sharding.arrivals_per_bucket(&expected_calls);

        let stage = self.config.stage;
        // What can fail comes before anything is lent or taken.
        schedule.prepare(&mut self.buffers, &mut self.memory, stage, &self.sharding)?;
        let early = if schedule.step_early {
            // Master weights, when kept, are not read again.
            self.refresh_param_shard(params)?;
            self.window.params_read = true;
            let flags = self.mask.beside_backward(self.config.check_trainability);
            let trains = |p: usize| flags[p] && expected_calls[p] > 0;
            Some(EarlyStep::lend::<C, M>(
                &self.memory,
                &mut self.optimizer,
                &mut self.buffers.param_shard,
                &mut self.sharding,
                trains,
                self.window.micro_steps + 1,
            )?)
        } else {
            None
        };
        if stage.shards_gradients() && schedule.fold_full {
            // Folded into this pass's reductions: the next pass must not
            // fold them again.
            self.window.in_full_buffer = false;
        }
        let targets = schedule.take_targets(&mut self.buffers, stage, early);
        let thread = schedule.runner == Runner::Thread
            && CommWorker::ensure(&mut self.worker, || self.memory.fork(), self.comm.rank());
        let replicas = self.groups.as_ref().map(|g| &g.replicas);
        let replica_wire = replicas.is_some().then_some(self.wire.replica);
        let map = || BucketMap::new(&self.sharding.layout, stage, self.wire.reduce, replica_wire);
        let reducer = match schedule.runner {
            Runner::Thread => {
                let worker = if thread { self.worker.as_ref() } else { None };
                let comms = (Arc::clone(&self.comm), replicas.cloned());
                start_on_thread(worker, comms, map(), self.progress.clone(), targets)
            }
            Runner::Inline => {
                let stepper = self.abilities.host_stepper.clone();
                let steps = (
                    self.sharding.layout.buckets.clone(),
                    self.wire.packed_write_back,
                );
                start_inline(&mut self.memory, targets, map(), stepper, steps)?
            }
            Runner::AfterBackward => Reducer::Queued {
                targets,
                map: map(),
                queue: Vec::new(),
            },
        };
        let bucket_bytes = self.sharding.longest_bucket.max(1) * std::mem::size_of::<T>();
        self.pass = Some(BackwardPass::new(
            schedule,
            (expected_calls, remaining),
            &self.sharding.layout,
            reducer,
            bucket_bytes,
        ));
        Ok(())
    }
}

impl<T, C, M> Engine<T, C, M>
where
    T: Element,
    C: Communicator,
    M: ShardMemory<T, C>,
{
    /// Closes the open backward pass: hands over `grads` (the gradients
    /// that came after backward, one slot per parameter), launches every
    /// bucket left, adds the late gradients, waits for every reduction and
    /// takes the buffers back. `Ok(true)` if a pass was open.
    pub(in crate::engine) fn finish_pass(
        &mut self,
        grads: Option<&[Option<M::Grad<'_>>]>,
    ) -> Result<bool> {
        let finished = self.finish_pass_stepping(grads);
        let stepped = self.finish_host_steps();
        let opened = finished?;
        stepped?;
        Ok(opened)
    }

    /// [`Engine::finish_pass`], except that offload's step thread, if the
    /// pass has one, goes on with its last buckets: the write-back takes
    /// each as it is stepped (`ShardUpdate::run`), and anything else that
    /// reads the shards or the optimizer first waits for the thread
    /// ([`Engine::finish_host_steps`]). Meanwhile the engine holds neither
    /// shard nor the optimizer, so nothing can read them by mistake.
    pub(in crate::engine) fn finish_pass_stepping(
        &mut self,
        grads: Option<&[Option<M::Grad<'_>>]>,
    ) -> Result<bool> {
        if self.pass.is_none() {
            return Ok(false);
        }
        let flushed = self.flush_pass(grads);
        let joined = self.join_pass();
        flushed.and(joined)?;
        Ok(true)
    }

    /// Hands the gradients given after backward (`grads`, one slot per
    /// parameter) to the open pass, and launches every bucket left.
    pub(in crate::engine) fn flush_pass(
        &mut self,
        grads: Option<&[Option<M::Grad<'_>>]>,
    ) -> Result<()> {
        let (mut parts, Some(pass)) = self.pass_parts() else {
            return Err(Error::State("internal: no backward pass is open".into()));
        };
        for (param, grad) in grads.into_iter().flatten().enumerate() {
            if let Some(grad) = *grad {
                let numel = parts.params[param].numel();
                parts.hand_over(pass, param, 0..numel, grad, false)?;
            }
        }
        parts.launch_rest(pass)
    }

    /// The parts of the engine a pass works with, and the open pass, if
    /// any.
    #[allow(clippy::type_complexity)]
    pub(in crate::engine) fn pass_parts(
        &mut self,
    ) -> (
        PassParts<'_, T, C, M>,
        Option<&mut BackwardPass<T, M::Buffer>>,
    ) {
        let parts = PassParts {
            comm: &*self.comm,
            replicas: self.groups.as_ref().map(|g| &*g.replicas),
            memory: &mut self.memory,
            buffers: &mut self.buffers,
            sharding: &self.sharding,
            params: &self.params,
            present: &mut self.window.present,
            progress: &self.progress,
        };
        (parts, self.pass.as_mut())
    }

    /// Waits for offload's step thread after its last bucket, if it is
    /// still stepping (see [`Engine::finish_pass_stepping`]), and takes
    /// back the optimizer and both shards; reports its first failure.
    pub(in crate::engine) fn finish_host_steps(&mut self) -> Result<()> {
        let Some(steps) = self.host_steps.take() else {
            return Ok(());
        };
        let Some(done) = steps.finish() else {
            return Err(Error::State(
                "the offload's step thread panicked; the optimizer and the shards are lost, \
                 rebuild the optimizer"
                    .into(),
            ));
        };
        self.window.early_stepped = done.early.put_back(
            &mut self.optimizer,
            &mut self.buffers.param_shard,
            &mut self.sharding,
        );
        if done.grad_shard.is_some() {
            self.buffers.grad_shard = done.grad_shard;
        }
        self.offload_times.add_step(done.times);
        done.result
    }

    /// Waits for every reduction of the open pass (running them here if
    /// they were deferred), puts the buffers back and closes the pass;
    /// offload's step thread, if the pass has one, goes on stepping (held
    /// in `host_steps`, with the gradient shard it reads).
    pub(in crate::engine) fn join_pass(&mut self) -> Result<()> {
        let Some(pass) = self.pass.take() else {
            return Ok(());
        };
        let joined = self.pass_parts().0.join(pass)?;
        if let Some(steps) = joined.host_steps {
            self.host_steps = Some(steps);
        }
        if let Some(early) = joined.early {
            self.window.early_stepped = early.put_back(
                &mut self.optimizer,
                &mut self.buffers.param_shard,
                &mut self.sharding,
            );
        }
        joined.result
    }

    /// A handle on the count of completed bucket reductions.
    pub fn reduction_progress(&self) -> ReductionProgress {
        self.progress.clone()
    }
}

impl PassFacts {
    /// What decides the schedule of `engine`'s pass beginning now.
    fn of<T: Element, C: Communicator, M: ShardMemory<T, C>>(
        engine: &Engine<T, C, M>,
        forkable: bool,
    ) -> Self {
        Self {
            stage: engine.config.stage,
            overlap: engine.config.overlap,
            last_micro_step: engine.window.micro_steps + 1 >= engine.config.grad_accum_steps,
            sharded_params: engine.fetcher().is_some(),
            serial_gathers: engine.fetcher().is_some_and(|f| !f.overlaps()),
            forkable,
            launches_async: engine.abilities.launches_async,
            host_stepper: engine.abilities.host_stepper.is_some(),
            in_full_buffer: engine.window.in_full_buffer,
            in_shard: engine.window.in_shard,
            by_bucket: engine.sharding.pieces_by_bucket().is_some(),
        }
    }
}
