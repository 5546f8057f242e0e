//! A backward pass's [`Schedule`], decided once from [`PassFacts`]: who
//! runs its reductions, and what each bucket's reduction does.

use crate::comm::Communicator;
use crate::engine::buffers::Buffers;
use crate::engine::reduce::{EarlyStep, Targets};
use crate::engine::sharding::Sharding;
use crate::engine::{Overlap, ShardMemory, Stage};
use crate::{Element, Result};
use std::ops::Range;

/// How one backward pass's reductions run: decided once
/// ([`Schedule::decide`]), from the stage, the configuration, the memory
/// and where the accumulation window stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(in crate::engine) struct Schedule {
    pub runner: Runner,
    /// Fold the window's earlier micro-steps (in the full buffer) into
    /// each bucket before it is reduced.
    pub fold_full: bool,
    /// Add each reduced bucket into the gradient shard instead of writing
    /// over it (stage 2's later micro-steps).
    pub add_to_shard: bool,
    /// Step each bucket's shard as soon as it is reduced
    /// ([`Overlap::Interleaved`] on the last micro-step).
    pub step_early: bool,
    /// Stage 0 on a communication thread: the full gradient buffer stays
    /// with the engine, each bucket's earlier micro-steps are folded in as
    /// it is launched, and each reduced bucket is written into the full
    /// buffer when its buffer comes back, so the step can begin with the
    /// buckets already back while later ones are on the wire.
    pub lands: bool,
}

/// Who runs a pass's reductions.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(in crate::engine) enum Runner {
    /// Queued, and run on the caller's thread after backward
    /// ([`Overlap::None`]; stage 3 on a communicator that must not run two
    /// collectives at once, whose gathers run on the caller's thread).
    AfterBackward,
    /// Launched on the caller's thread as buckets fill, by a memory whose
    /// collectives complete after they return (a device stream).
    Inline,
    /// A communication thread, as buckets fill.
    Thread,
}

/// What decides a backward pass's schedule, read from the engine as the
/// pass begins.
#[derive(Clone, Copy, Debug)]
pub(in crate::engine) struct PassFacts {
    pub stage: Stage,
    pub overlap: Overlap,
    /// The pass is the accumulation window's last micro-step.
    pub last_micro_step: bool,
    /// Stage 3 has sharded the parameters (the fetcher gathers them).
    pub sharded_params: bool,
    /// ... and gathers on this thread, blocking, during backward: a
    /// communicator that must not run two collectives at once (MPI).
    pub serial_gathers: bool,
    /// The memory runs collectives on a communication thread
    /// (`ShardMemory::fork`).
    pub forkable: bool,
    /// Its collectives may complete after they return (a `Deferral`).
    pub launches_async: bool,
    /// It offloads with a host stepper (`HostOffload::host_stepper`).
    pub host_stepper: bool,
    /// Earlier micro-steps of the window are in the full gradient buffer.
    pub in_full_buffer: bool,
    /// ... or reduced into the gradient shard already.
    pub in_shard: bool,
    /// Every owned piece lies within one bucket.
    pub by_bucket: bool,
}

impl PassFacts {
    /// Whether the memory reduces during backward at all: with a thread of
    /// its own, or launching on the caller's (a device stream,
    /// after-backward overlap, no stage-3 gathers).
    pub fn reduces_during_backward(&self) -> bool {
        let inline_overlap = match self.overlap {
            Overlap::AfterBackward => true,
            // Steps bucket by bucket on a thread of its own (offload).
            Overlap::Interleaved => self.host_stepper,
            Overlap::None => false,
        };
        self.forkable || (self.launches_async && inline_overlap && !self.sharded_params)
    }
}

impl Schedule {
    /// The schedule of a backward pass beginning now; `None` when the pass
    /// only accumulates (stages 0 and 1 before the last micro-step).
    pub fn decide(facts: &PassFacts) -> Option<Self> {
        let stage = facts.stage;
        if !stage.shards_gradients() && !facts.last_micro_step {
            return None;
        }
        // Stage 3 gathering on this thread, blocking, during backward: the
        // reductions wait until after it.
        let serial = facts.serial_gathers;
        let runner = match facts.overlap {
            _ if serial => Runner::AfterBackward,
            Overlap::None => Runner::AfterBackward,
            Overlap::AfterBackward | Overlap::Interleaved if facts.forkable => Runner::Thread,
            Overlap::AfterBackward | Overlap::Interleaved => Runner::Inline,
        };
        Some(Self {
            runner,
            // Micro-steps given earlier in this window without a pass
            // (slots, or `accumulate_param` alone) are in the full buffer:
            // fold them into each bucket once. Stage 2 then adds to what
            // earlier passes reduced into the shard.
            fold_full: facts.in_full_buffer,
            add_to_shard: stage.shards_gradients() && facts.in_shard,
            // Stage 0 steps the replica after backward, bucket by bucket,
            // with no parameter copy to step early: there the interleaved
            // schedule steps after backward. A piece straddling buckets (a
            // partition not made in gradient order) steps after backward
            // too, with the same result.
            step_early: facts.overlap == Overlap::Interleaved
                && facts.last_micro_step
                && stage != Stage::Ddp
                && facts.by_bucket,
            lands: stage == Stage::Ddp
                && !serial
                && facts.overlap != Overlap::None
                && facts.forkable,
        })
    }

    /// Allocates in `buffers` what a pass with this schedule needs before
    /// it opens.
    pub fn prepare<T: Element, C: Communicator, M: ShardMemory<T, C>>(
        &self,
        buffers: &mut Buffers<M::Buffer>,
        memory: &mut M,
        stage: Stage,
        sharding: &Sharding,
    ) -> Result<()> {
        // Adding into the shard reduce-scatters into `scratch`: later
        // micro-steps need it from the start. Gradients that come after
        // their bucket was launched get it where their reduction runs; a
        // pass with neither never holds it.
        if self.add_to_shard && buffers.scratch.is_none() {
            let longest = sharding.layout.buckets.iter().map(Range::len).max();
            buffers.scratch = Some(memory.alloc_zeroed(longest.unwrap_or(0))?);
        }
        if stage == Stage::Ddp && buffers.full_grads.is_none() {
            buffers.full_grads = Some(memory.alloc_zeroed(sharding.partition.flat_numel())?);
        }
        Ok(())
    }

    /// The buffers a pass with this schedule reduces into (made by
    /// [`Schedule::prepare`]), taken out of `buffers` until the pass is
    /// joined, and the interleaved schedule's `early` step.
    pub fn take_targets<T: Element, B>(
        &self,
        buffers: &mut Buffers<B>,
        stage: Stage,
        early: Option<EarlyStep<T, B>>,
    ) -> Targets<T, B> {
        let folds = match stage {
            Stage::Ddp => !self.lands,
            _ => self.fold_full,
        };
        Targets {
            full: if folds {
                buffers.full_grads.take()
            } else {
                None
            },
            shard: buffers.grad_shard.take(),
            scratch: buffers.scratch.take(),
            early,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn facts(stage: Stage, overlap: Overlap) -> PassFacts {
        PassFacts {
            stage,
            overlap,
            last_micro_step: true,
            sharded_params: false,
            serial_gathers: false,
            forkable: false,
            launches_async: false,
            host_stepper: false,
            in_full_buffer: false,
            in_shard: false,
            by_bucket: true,
        }
    }

    /// Who reduces: a thread where the memory forks, the caller's thread
    /// where its collectives complete later, after backward where stage 3
    /// gathers in the way or nothing overlaps.
    #[test]
    fn the_runner_follows_the_memory_and_the_overlap() {
        let thread = PassFacts {
            forkable: true,
            ..facts(Stage::Gradients, Overlap::AfterBackward)
        };
        assert_eq!(
            Schedule::decide(&thread).map(|s| s.runner),
            Some(Runner::Thread)
        );
        let stream = PassFacts {
            launches_async: true,
            ..facts(Stage::Gradients, Overlap::AfterBackward)
        };
        assert_eq!(
            Schedule::decide(&stream).map(|s| s.runner),
            Some(Runner::Inline)
        );
        let gathers = PassFacts {
            sharded_params: true,
            serial_gathers: true,
            ..thread
        };
        assert_eq!(
            Schedule::decide(&gathers).map(|s| s.runner),
            Some(Runner::AfterBackward)
        );
        let none = PassFacts {
            overlap: Overlap::None,
            ..thread
        };
        assert_eq!(
            Schedule::decide(&none).map(|s| s.runner),
            Some(Runner::AfterBackward)
        );
    }

    /// Stages 0 and 1 accumulate locally before the last micro-step; stage
    /// 2 reduces every pass, adding into the shard once it holds some.
    #[test]
    fn only_sharded_gradients_reduce_before_the_last_micro_step() {
        for stage in [Stage::Ddp, Stage::OptimizerState] {
            let early = PassFacts {
                last_micro_step: false,
                ..facts(stage, Overlap::AfterBackward)
            };
            assert_eq!(Schedule::decide(&early), None, "{stage:?}");
        }
        let later = PassFacts {
            last_micro_step: false,
            in_shard: true,
            ..facts(Stage::Gradients, Overlap::AfterBackward)
        };
        let schedule = Schedule::decide(&later).expect("stage 2 reduces every pass");
        assert!(schedule.add_to_shard && !schedule.step_early);
    }

    /// Stepping early needs the interleaved schedule's last micro-step, a
    /// shard, and pieces within buckets; stage 0 lands its buckets on a
    /// thread instead.
    #[test]
    fn early_steps_and_landing_need_their_stage() {
        let interleaved = facts(Stage::OptimizerState, Overlap::Interleaved);
        assert!(Schedule::decide(&interleaved).is_some_and(|s| s.step_early));
        let straddling = PassFacts {
            by_bucket: false,
            ..interleaved
        };
        assert!(Schedule::decide(&straddling).is_some_and(|s| !s.step_early));
        let ddp = PassFacts {
            forkable: true,
            ..facts(Stage::Ddp, Overlap::Interleaved)
        };
        let schedule = Schedule::decide(&ddp).expect("the last micro-step");
        assert!(schedule.lands && !schedule.step_early);
    }

    /// A memory without a thread reduces during backward only where its
    /// collectives complete later, the overlap allows it, and stage 3 does
    /// not gather meanwhile.
    #[test]
    fn a_memory_reduces_during_backward_with_a_thread_or_a_stream() {
        let base = facts(Stage::Gradients, Overlap::AfterBackward);
        assert!(!base.reduces_during_backward());
        assert!(PassFacts {
            forkable: true,
            ..base
        }
        .reduces_during_backward());
        let stream = PassFacts {
            launches_async: true,
            ..base
        };
        assert!(stream.reduces_during_backward());
        assert!(!PassFacts {
            sharded_params: true,
            ..stream
        }
        .reduces_during_backward());
        let interleaved = PassFacts {
            overlap: Overlap::Interleaved,
            ..stream
        };
        assert!(!interleaved.reduces_during_backward());
        assert!(PassFacts {
            host_stepper: true,
            ..interleaved
        }
        .reduces_during_backward());
    }
}
