//! The engine's step plans keep the contract a memory with a flat
//! optimizer state relies on (the CUDA memory keeps its state in one buffer
//! over the shard): whatever stretch of the shard a plan's buffers hold
//! (`StepPlan::origin`) and however few pieces it steps, a piece is always
//! at the same shard position, inside `StepPlan::shard_len`, and no two
//! pieces overlap. Checked here on host memory, at every stage, schedule,
//! world size and accumulation, so CI guards what only a GPU could run.

mod common;

use common::{assert_trajectories, make_opt, reference_trajectory, run, Model, Opt, Synthetic};
use std::collections::BTreeMap;
use std::ops::Range;
use std::sync::{Arc, Mutex};
use zero_core::comm::Host;
use zero_core::engine::{
    EngineConfig, GradPiece, HostGrad, HostMemory, NormType, Overlap, ParamCopy, ParamStore,
    ShardMemory, Stage, StepPiece, StepPlan,
};
use zero_core::optim::OptimizerState;
use zero_core::{Communicator, DType, Element, Engine, FunctionalOptimizer, ReduceOp, Result};

/// What the plans showed, across every step of one engine (and its forks).
#[derive(Default)]
struct Seen {
    /// Per piece `(name, offset)`: its shard position and length.
    positions: BTreeMap<(String, usize), (usize, usize)>,
    shard_len: Option<usize>,
    plans: usize,
    /// Plans whose buffers start inside the shard, or that step only some
    /// of the pieces: the cases a flat state gets wrong if the contract
    /// breaks.
    partial: usize,
    /// Reductions issued while the memory deferred their completion.
    deferred: usize,
    violations: Vec<String>,
}

impl Seen {
    fn check(&mut self, plan: &StepPlan<'_>, buffer_len: usize) {
        self.plans += 1;
        let shard_len = *self.shard_len.get_or_insert(plan.shard_len);
        if plan.shard_len != shard_len {
            self.violations
                .push(format!("shard_len {} after {shard_len}", plan.shard_len));
        }
        for bucket in plan.buckets {
            if bucket.end > buffer_len {
                self.violations
                    .push(format!("bucket {bucket:?} past a buffer of {buffer_len}"));
            }
        }
        for piece in plan.pieces {
            let at = plan.origin + piece.range.start;
            let key = (piece.key.name.clone(), piece.key.offset);
            let len = piece.range.len();
            if piece.range.end > buffer_len || at + len > shard_len {
                self.violations.push(format!(
                    "{key:?} at {at} ({:?} of a buffer of {buffer_len}) past a shard of \
                     {shard_len}",
                    piece.range
                ));
            }
            let first = *self.positions.entry(key.clone()).or_insert((at, len));
            if first != (at, len) {
                self.violations
                    .push(format!("{key:?} at {at} (+{len}), earlier at {first:?}"));
            }
        }
        if plan.origin > 0 || plan.pieces.len() < self.positions.len() {
            self.partial += 1;
        }
    }

    /// Fails on any violation, or if two pieces' positions overlap.
    fn assert_kept(&self, what: &str) {
        assert!(self.violations.is_empty(), "{what}: {:?}", self.violations);
        let mut spans: Vec<&(usize, usize)> = self.positions.values().collect();
        spans.sort();
        for pair in spans.windows(2) {
            assert!(
                pair[0].0 + pair[0].1 <= pair[1].0,
                "{what}: pieces at {:?} and {:?} overlap",
                pair[0],
                pair[1]
            );
        }
    }
}

/// Host memory that records every step plan in `seen`. With `inline`, it
/// poses as a device memory: no communication thread (no `fork`), and
/// collectives "complete" only when settled (`launches_async`), so the
/// engine reduces on the calling thread during backward.
struct PlanCheck {
    inner: HostMemory,
    seen: Arc<Mutex<Seen>>,
    inline: bool,
    /// While deferring: reductions issued and not yet settled.
    deferring: Option<usize>,
}

impl PlanCheck {
    fn new(seen: Arc<Mutex<Seen>>, inline: bool) -> Self {
        Self {
            inner: HostMemory,
            seen,
            inline,
            deferring: None,
        }
    }

    /// Counts a reduction issued while deferring.
    fn issued(&mut self) {
        if let Some(n) = self.deferring.as_mut() {
            *n += 1;
        }
    }
}

impl<T: Element, C: Communicator<Memory = Host>> ShardMemory<T, C> for PlanCheck {
    type Buffer = Vec<T>;
    type Grad<'g> = HostGrad<'g, T>;
    type Params<'p> = dyn ParamStore<T> + 'p;

    fn step(
        &mut self,
        optimizer: &mut dyn FunctionalOptimizer<T>,
        params: &mut Vec<T>,
        grads: &Vec<T>,
        plan: StepPlan<'_>,
    ) -> Result<()> {
        self.seen
            .lock()
            .expect("no test thread panicked")
            .check(&plan, params.len().min(grads.len()));
        <HostMemory as ShardMemory<T, C>>::step(&mut self.inner, optimizer, params, grads, plan)
    }

    fn fork(&self) -> Option<Self> {
        (!self.inline).then(|| Self::new(self.seen.clone(), false))
    }

    fn launches_async(&self) -> bool {
        self.inline
    }

    fn defer_completion(&mut self) {
        self.deferring.get_or_insert(0);
    }

    fn settle(&mut self, _comm: &C) -> Result<()> {
        if let Some(n) = self.deferring.take() {
            self.seen.lock().expect("no test thread panicked").deferred += n;
        }
        Ok(())
    }

    fn grad_len(grad: &HostGrad<'_, T>) -> usize {
        <HostMemory as ShardMemory<T, C>>::grad_len(grad)
    }

    fn alloc_zeroed(&mut self, numel: usize) -> Result<Vec<T>> {
        <HostMemory as ShardMemory<T, C>>::alloc_zeroed(&mut self.inner, numel)
    }

    fn buffer_len(buffer: &Vec<T>) -> usize {
        <HostMemory as ShardMemory<T, C>>::buffer_len(buffer)
    }

    fn into_host_vec(buffer: Vec<T>) -> std::result::Result<Vec<T>, Vec<T>> {
        <HostMemory as ShardMemory<T, C>>::into_host_vec(buffer)
    }

    fn from_host_vec(values: Vec<T>) -> std::result::Result<Vec<T>, Vec<T>> {
        <HostMemory as ShardMemory<T, C>>::from_host_vec(values)
    }

    fn zero(&mut self, buffer: &mut Vec<T>, range: Range<usize>) -> Result<()> {
        <HostMemory as ShardMemory<T, C>>::zero(&mut self.inner, buffer, range)
    }

    fn flatten(
        &mut self,
        buffer: &mut Vec<T>,
        pieces: &[GradPiece<HostGrad<'_, T>>],
        add: bool,
    ) -> Result<()> {
        <HostMemory as ShardMemory<T, C>>::flatten(&mut self.inner, buffer, pieces, add)
    }

    fn copy_range(
        &mut self,
        dst: &mut Vec<T>,
        dst_at: usize,
        src: &Vec<T>,
        src_range: Range<usize>,
        add: bool,
    ) -> Result<()> {
        <HostMemory as ShardMemory<T, C>>::copy_range(
            &mut self.inner,
            dst,
            dst_at,
            src,
            src_range,
            add,
        )
    }

    fn read_params(
        &mut self,
        params: &mut (dyn ParamStore<T> + '_),
        copies: &[ParamCopy],
        buffer: &mut Vec<T>,
    ) -> Result<()> {
        <HostMemory as ShardMemory<T, C>>::read_params(&mut self.inner, params, copies, buffer)
    }

    fn write_params(
        &mut self,
        params: &mut (dyn ParamStore<T> + '_),
        copies: &[ParamCopy],
        buffer: &Vec<T>,
    ) -> Result<()> {
        <HostMemory as ShardMemory<T, C>>::write_params(&mut self.inner, params, copies, buffer)
    }

    fn scale(&mut self, buffer: &mut Vec<T>, ranges: &[Range<usize>], factor: f64) -> Result<()> {
        <HostMemory as ShardMemory<T, C>>::scale(&mut self.inner, buffer, ranges, factor)
    }

    fn norm_partial(
        &mut self,
        comm: &C,
        buffer: &Vec<T>,
        ranges: &[Range<usize>],
        norm: NormType,
    ) -> Result<f64> {
        <HostMemory as ShardMemory<T, C>>::norm_partial(&mut self.inner, comm, buffer, ranges, norm)
    }

    fn all_reduce(
        &mut self,
        comm: &C,
        buffer: &mut Vec<T>,
        range: Range<usize>,
        op: ReduceOp,
    ) -> Result<()> {
        <HostMemory as ShardMemory<T, C>>::all_reduce(&mut self.inner, comm, buffer, range, op)
    }

    fn reduce_scatter(
        &mut self,
        comm: &C,
        send: &Vec<T>,
        send_range: Range<usize>,
        recv: &mut Vec<T>,
        recv_range: Range<usize>,
        op: ReduceOp,
    ) -> Result<()> {
        <HostMemory as ShardMemory<T, C>>::reduce_scatter(
            &mut self.inner,
            comm,
            send,
            send_range,
            recv,
            recv_range,
            op,
        )
    }

    fn all_gather(
        &mut self,
        comm: &C,
        send: &Vec<T>,
        send_range: Range<usize>,
        recv: &mut Vec<T>,
        recv_range: Range<usize>,
    ) -> Result<()> {
        <HostMemory as ShardMemory<T, C>>::all_gather(
            &mut self.inner,
            comm,
            send,
            send_range,
            recv,
            recv_range,
        )
    }

    fn all_reduce_as(
        &mut self,
        comm: &C,
        buffer: &mut Vec<T>,
        range: Range<usize>,
        op: ReduceOp,
        wire: DType,
    ) -> Result<()> {
        self.issued();
        <HostMemory as ShardMemory<T, C>>::all_reduce_as(
            &mut self.inner,
            comm,
            buffer,
            range,
            op,
            wire,
        )
    }

    fn reduce_scatter_as(
        &mut self,
        comm: &C,
        send: &Vec<T>,
        send_range: Range<usize>,
        recv: &mut Vec<T>,
        recv_range: Range<usize>,
        op: ReduceOp,
        wire: DType,
    ) -> Result<()> {
        self.issued();
        <HostMemory as ShardMemory<T, C>>::reduce_scatter_as(
            &mut self.inner,
            comm,
            send,
            send_range,
            recv,
            recv_range,
            op,
            wire,
        )
    }

    fn all_gather_as(
        &mut self,
        comm: &C,
        send: &Vec<T>,
        send_range: Range<usize>,
        recv: &mut Vec<T>,
        recv_range: Range<usize>,
        wire: DType,
    ) -> Result<()> {
        <HostMemory as ShardMemory<T, C>>::all_gather_as(
            &mut self.inner,
            comm,
            send,
            send_range,
            recv,
            recv_range,
            wire,
        )
    }

    fn buffer_to_host(
        &mut self,
        comm: &C,
        buffer: &Vec<T>,
        range: Range<usize>,
        out: &mut [T],
    ) -> Result<()> {
        <HostMemory as ShardMemory<T, C>>::buffer_to_host(&mut self.inner, comm, buffer, range, out)
    }

    fn buffer_from_host(&mut self, buffer: &mut Vec<T>, at: usize, values: &[T]) -> Result<()> {
        <HostMemory as ShardMemory<T, C>>::buffer_from_host(&mut self.inner, buffer, at, values)
    }

    fn all_reduce_host<V: Element>(
        &mut self,
        comm: &C,
        values: &mut [V],
        op: ReduceOp,
    ) -> Result<()> {
        <HostMemory as ShardMemory<T, C>>::all_reduce_host::<V>(&mut self.inner, comm, values, op)
    }

    fn gather_varlen_host(
        &mut self,
        comm: &C,
        send: &[T],
        counts: &[usize],
        recv: Option<&mut [T]>,
        root: usize,
    ) -> Result<()> {
        <HostMemory as ShardMemory<T, C>>::gather_varlen_host(
            &mut self.inner,
            comm,
            send,
            counts,
            recv,
            root,
        )
    }

    fn export_state(
        &mut self,
        comm: &C,
        optimizer: &dyn FunctionalOptimizer<T>,
        pieces: &[StepPiece<'_>],
    ) -> Result<OptimizerState<T>> {
        <HostMemory as ShardMemory<T, C>>::export_state(&mut self.inner, comm, optimizer, pieces)
    }

    fn import_state(
        &mut self,
        optimizer: &mut dyn FunctionalOptimizer<T>,
        pieces: &[StepPiece<'_>],
        state: OptimizerState<T>,
    ) -> Result<()> {
        <HostMemory as ShardMemory<T, C>>::import_state(&mut self.inner, optimizer, pieces, state)
    }

    fn state_bytes(&self, optimizer: &dyn FunctionalOptimizer<T>) -> usize {
        <HostMemory as ShardMemory<T, C>>::state_bytes(&self.inner, optimizer)
    }

    fn read_param_host(
        &mut self,
        comm: &C,
        params: &mut (dyn ParamStore<T> + '_),
        param: usize,
        out: &mut [T],
    ) -> Result<()> {
        <HostMemory as ShardMemory<T, C>>::read_param_host(
            &mut self.inner,
            comm,
            params,
            param,
            out,
        )
    }

    fn write_param_host(
        &mut self,
        params: &mut (dyn ParamStore<T> + '_),
        param: usize,
        values: &[T],
    ) -> Result<()> {
        <HostMemory as ShardMemory<T, C>>::write_param_host(&mut self.inner, params, param, values)
    }
}

#[test]
fn step_plans_keep_each_piece_at_its_shard_position() {
    let model = Synthetic::medium();
    let (micro, steps) = (2, 3);
    let n = model.infos().len();
    for world in [1, 2, 3] {
        let expected = reference_trajectory(&model, Opt::Adam, world, micro, steps);
        for stage in [Stage::Ddp, Stage::OptimizerState, Stage::Gradients] {
            for overlap in [Overlap::None, Overlap::AfterBackward, Overlap::Interleaved] {
                let what = format!("N={world} {stage:?} {overlap:?}");
                // Small buckets: stage 0 steps in many windows, the
                // schedules bucket by bucket.
                let config = EngineConfig::default()
                    .with_stage(stage)
                    .with_bucket_bytes(96)
                    .with_grad_accum_steps(micro)
                    .with_overlap(overlap);
                let seen: Vec<Arc<Mutex<Seen>>> = (0..world).map(|_| Arc::default()).collect();
                let trajectories = run(world, |comm| {
                    let rank = comm.rank();
                    let memory = PlanCheck::new(seen[rank].clone(), false);
                    let optimizer = make_opt(Opt::Adam, false);
                    let mut e = Engine::with_memory(
                        comm,
                        memory,
                        model.infos(),
                        optimizer,
                        config.clone(),
                    )?;
                    let mut params = model.init();
                    let mut out = Vec::new();
                    for s in 0..steps {
                        for m in 0..micro {
                            let g = model.grads(&params, rank, s * micro + m);
                            // Handed over in reverse, as backward produces them.
                            let order: Vec<(usize, usize)> = (0..n).rev().map(|p| (p, 1)).collect();
                            e.begin_backward(&order, &mut params)?;
                            for p in (0..n).rev() {
                                e.accumulate_param(p, (&g[p]).into())?;
                            }
                            let none: Vec<Option<HostGrad<'_, f64>>> = vec![None; n];
                            e.step(&none, &mut params)?;
                        }
                        out.push(params.clone());
                    }
                    Ok(out)
                });
                assert_trajectories(&trajectories, &expected[..steps], 1e-9, &what);
                for (rank, seen) in seen.iter().enumerate() {
                    let seen = seen.lock().expect("no test thread panicked");
                    seen.assert_kept(&format!("{what} rank {rank}"));
                    assert!(seen.plans > 0, "{what} rank {rank}: no step plan");
                }
                // Stage 0 steps in windows; the schedules step a bucket at a
                // time at stages 1 and 2 (after-backward with the shard
                // read from the replica, interleaved during backward).
                let partial: usize = seen
                    .iter()
                    .map(|s| s.lock().expect("no panic").partial)
                    .sum();
                if stage == Stage::Ddp || overlap != Overlap::None {
                    assert!(
                        partial > 0,
                        "{what}: no plan stepped only part of the shard"
                    );
                }
            }
        }
    }
}

/// A memory with asynchronous collectives and no communication thread
/// (the CUDA memory) gets its reductions launched on the calling thread as
/// buckets fill, and trains what the reference trains, at every stage, with
/// accumulation: the inline reducer settles before it uses a result
/// (stage 0 writes its buckets into the full buffer after settling). At
/// stages 1 and 2 it steps and gathers bucket by bucket on the calling
/// thread too, with no copy of the parameter shard.
#[test]
fn a_memory_with_asynchronous_collectives_reduces_during_backward_on_the_calling_thread() {
    let model = Synthetic::medium();
    let (micro, steps) = (2, 3);
    let n = model.infos().len();
    for world in [1, 2, 3] {
        let expected = reference_trajectory(&model, Opt::Adam, world, micro, steps);
        for stage in [Stage::Ddp, Stage::OptimizerState, Stage::Gradients] {
            let what = format!("N={world} {stage:?}");
            let config = EngineConfig::default()
                .with_stage(stage)
                .with_bucket_bytes(96)
                .with_grad_accum_steps(micro);
            let seen: Vec<Arc<Mutex<Seen>>> = (0..world).map(|_| Arc::default()).collect();
            let trajectories = run(world, |comm| {
                let rank = comm.rank();
                let memory = PlanCheck::new(seen[rank].clone(), true);
                let optimizer = make_opt(Opt::Adam, false);
                let mut e =
                    Engine::with_memory(comm, memory, model.infos(), optimizer, config.clone())?;
                let progress = e.reduction_progress();
                let mut params = model.init();
                let mut out = Vec::new();
                for s in 0..steps {
                    for m in 0..micro {
                        let g = model.grads(&params, rank, s * micro + m);
                        let order: Vec<(usize, usize)> = (0..n).rev().map(|p| (p, 1)).collect();
                        e.begin_backward(&order, &mut params)?;
                        let before = progress.completed();
                        for p in (0..n).rev() {
                            e.accumulate_param(p, (&g[p]).into())?;
                        }
                        // Stage 2 reduces every micro-step, the others on
                        // the last: every bucket is launched once its last
                        // gradient is in, before the step closes the pass.
                        if stage == Stage::Gradients || m + 1 == micro {
                            assert!(
                                progress.completed() > before,
                                "{stage:?}: nothing reduced during backward"
                            );
                        }
                        let none: Vec<Option<HostGrad<'_, f64>>> = vec![None; n];
                        e.step(&none, &mut params)?;
                    }
                    out.push(params.clone());
                }
                // No copy of the parameter shard beside the replica: each
                // bucket's owned pieces were read from the replica, stepped
                // and gathered (stages 1 and 2, as stage 0 steps the replica).
                let replica: usize = model
                    .infos()
                    .iter()
                    .map(|p| p.numel() * p.dtype.size_in_bytes())
                    .sum();
                assert_eq!(
                    e.memory_report().params,
                    replica,
                    "{stage:?}: the engine holds parameters beside the replica"
                );
                Ok(out)
            });
            assert_trajectories(&trajectories, &expected[..steps], 1e-9, &what);
            for seen in &seen {
                let seen = seen.lock().expect("no test thread panicked");
                seen.assert_kept(&what);
                assert!(seen.deferred > 0, "{what}: no reduction was deferred");
            }
        }
    }
}
