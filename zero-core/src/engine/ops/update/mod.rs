//! How an optimizer step's update runs, decided once per accumulation
//! window as a [`StepPath`] (the `decide` function, from [`StepFacts`]),
//! and each path's own type: the step's `run_step` is one `match` on it.
//!
//! A new path is a variant here, its type in a file of its own and its
//! tests.

mod bucket;
mod defer;
mod host_stepped;
mod inline;
mod on_thread;
mod replica;
mod serial;

pub(super) use replica::{AsReduced, Replica};

use crate::comm::Communicator;
use crate::engine::reduce::Reducer;
use crate::engine::worker::CommWorker;
use crate::engine::{Engine, Overlap, ShardMemory, Stage, StageState};
use crate::{Element, Result};
use bucket::Buckets;
use defer::Deferred;
use host_stepped::HostStepped;
use inline::Inline;
use on_thread::OnThread;
use serial::Serial;

/// What one optimizer step does once the gradients are reduced, decided
/// before anything runs ([`decide`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum StepPath {
    /// Stage 0 on a communication thread, with nothing that needs every
    /// gradient first: each group of pieces steps as soon as its buckets
    /// are reduced, while later ones are on the wire ([`AsReduced`],
    /// PyTorch's `hook_with_zero_step`).
    ReplicaAsReduced,
    /// Stage 0 without master weights: the replica stepped a group of
    /// pieces at a time after every reduction ([`Replica`]).
    Replica,
    /// Stages 1-3, and stage 0 with master weights: the shard stepped and
    /// put into the replica as the update says.
    Shard(ShardUpdate),
    /// Offload's step thread still stepping its last buckets after
    /// backward: each bucket written back as soon as it is stepped
    /// ([`HostStepped`]); from the first the thread does not step, the
    /// update goes on as the `ShardUpdate` says.
    HostStepped(ShardUpdate),
}

/// How the stepped shard reaches the replica.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum ShardUpdate {
    /// The whole shard stepped, then gathered bucket by bucket (stage 3:
    /// its replicated parameters only) or, in stage 0, written from the
    /// master weights ([`Serial`]).
    Serial,
    /// Each bucket stepped, all-gathered and written, all queued on this
    /// thread by a memory with a stream of its own (`inline.rs`).
    Inline,
    /// Each bucket all-gathered on the communication thread while the next
    /// one steps (`on_thread.rs`).
    OnThread,
    /// Each bucket stepped and handed to the communication thread, whose
    /// all-gathers run into the next forward (`defer.rs`).
    Deferred,
}

/// What the step's path depends on: the stage, the configuration, the
/// memory's capabilities and the window. Every field is the same on every
/// rank (the configuration and graph are checked alike), so every rank
/// takes the same path and issues the same collectives.
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct StepFacts {
    /// Stage 0.
    pub replicated: bool,
    /// Master weights kept (a trainable parameter narrower than `T`).
    pub masters: bool,
    /// Stage 0's configuration lets each bucket step as it is reduced
    /// (`EngineConfig::steps_ddp_as_reduced`).
    pub ddp_as_reduced: bool,
    /// The open pass runs on a communication thread and lands its buckets
    /// in the full buffer, and the trainable mask can be all-reduced beside
    /// it.
    pub pass_lands_on_thread: bool,
    /// The open pass has offload's step thread.
    pub host_steps: bool,
    /// Something reads every gradient before the update (several
    /// micro-steps to average, clipping, a gradient norm, loss scaling).
    pub whole_grads: bool,
    /// [`Overlap::None`].
    pub no_overlap: bool,
    /// Stage 3 once sharded.
    pub sharded_params: bool,
    /// Every owned piece lies within one bucket.
    pub by_bucket: bool,
    /// The memory runs collectives on a communication thread
    /// ([`ShardMemory::fork`]).
    pub forkable: bool,
    /// The memory's collectives complete on a stream of its own, in order
    /// ([`ShardMemory::deferral`]).
    pub launches_async: bool,
    /// Deferred gathers asked for, and possible this window.
    pub defer: bool,
}

/// The path a step with these facts takes; `worker` starts the
/// communication thread if it does not run, and says whether it does (it
/// is asked only when the path needs one).
pub(super) fn decide(facts: &StepFacts, worker: impl FnOnce() -> bool) -> StepPath {
    if facts.replicated && facts.pass_lands_on_thread && facts.ddp_as_reduced {
        return StepPath::ReplicaAsReduced;
    }
    if facts.replicated && !facts.masters {
        return StepPath::Replica;
    }
    let update = shard_update(facts, worker);
    if facts.host_steps && !facts.whole_grads {
        StepPath::HostStepped(update)
    } else {
        StepPath::Shard(update)
    }
}

fn shard_update(facts: &StepFacts, worker: impl FnOnce() -> bool) -> ShardUpdate {
    if facts.no_overlap
        || facts.replicated
        || facts.sharded_params
        || !facts.by_bucket
        || !(facts.forkable || facts.launches_async)
    {
        return ShardUpdate::Serial;
    }
    if !facts.forkable {
        return ShardUpdate::Inline;
    }
    let defer = facts.defer;
    // Without a communication thread the serial update issues the same
    // all-gathers in the same order; deferral gathers on this thread.
    if !defer && !worker() {
        return ShardUpdate::Serial;
    }
    if defer {
        ShardUpdate::Deferred
    } else {
        ShardUpdate::OnThread
    }
}

impl StepPath {
    /// This window's path for `engine` ([`decide`] on its facts); `last`:
    /// the gradients given with the step.
    pub(super) fn of<T: Element, C: Communicator, M: ShardMemory<T, C>>(
        engine: &mut Engine<T, C, M>,
        last: Option<&[Option<M::Grad<'_>>]>,
        micro_steps: usize,
    ) -> Self {
        let config = &engine.config;
        let forkable = engine.memory.fork().is_some();
        // Deferred gathers leave the replica stale until the layers' next
        // forward waits for it: only when every gradient of the window came
        // through hooked layers (which wait) and none through a slot.
        let defer = config.defer_gathers
            && !engine.window.plain_grads
            && last.is_some_and(|grads| grads.iter().all(Option::is_none))
            && forkable
            && matches!(&engine.stage, StageState::Sharded(gathers) if gathers.access.is_some());
        // The pass lands each reduced bucket in the full buffer on a
        // communication thread, with the trainable mask (if checked)
        // all-reduced on the side communicator meanwhile.
        let threaded = (engine.pass.as_ref())
            .is_some_and(|p| p.schedule().lands && matches!(p.reducer, Reducer::Thread { .. }));
        let side = matches!(&engine.stage, StageState::Replicated { side: Some(_) });
        let facts = StepFacts {
            replicated: config.stage == Stage::Ddp,
            masters: engine.wire.masters,
            ddp_as_reduced: config.steps_ddp_as_reduced(engine.wire.masters),
            pass_lands_on_thread: threaded && (!config.check_trainability || side),
            host_steps: engine
                .pass
                .as_ref()
                .is_some_and(|p| p.reducer.has_host_steps()),
            whole_grads: config.reads_every_gradient(micro_steps),
            no_overlap: config.overlap == Overlap::None,
            sharded_params: engine.fetcher().is_some(),
            by_bucket: engine.sharding.pieces_by_bucket().is_some(),
            forkable,
            launches_async: engine.abilities.launches_async,
            defer,
        };
        let (memory, rank) = (&engine.memory, engine.comm.rank());
        let path = decide(&facts, || {
            CommWorker::ensure(&mut engine.worker, || memory.fork(), rank)
        });
        tracing::trace!(?path, "optimizer step");
        path
    }
}

impl ShardUpdate {
    /// The shard stepped and put into the replica, after offload's step
    /// thread's write-back when `host_stepped`.
    pub(super) fn run<T: Element, C: Communicator, M: ShardMemory<T, C>>(
        self,
        engine: &mut Engine<T, C, M>,
        host_stepped: bool,
        stepping: &[bool],
        params: &mut M::Params<'_>,
    ) -> Result<()> {
        // Offload's step thread stepped during backward: what is left is
        // the write-back, counted in its times (its waits for the thread
        // apart).
        let offloaded = host_stepped
            || (engine.window.early_stepped.contains(&true)
                && engine.abilities.host_stepper.is_some());
        let (started, joined) = (std::time::Instant::now(), engine.offload_times.join);
        let written = if host_stepped {
            HostStepped.run(engine, params)
        } else {
            Ok(false)
        };
        // Whatever the write-back did not take needs the optimizer and the
        // shards back; the thread's failure says more than what it caused.
        engine.finish_host_steps()?;
        if !written? {
            self.step_and_put(engine, stepping, params)?;
        }
        if offloaded {
            let waited = engine.offload_times.join - joined;
            engine.offload_times.write_back += started.elapsed().saturating_sub(waited);
        }
        engine.window.early_stepped.clear();
        Ok(())
    }

    /// Steps the `stepping` parameters' pieces of the shard and puts them
    /// into the replica.
    fn step_and_put<T: Element, C: Communicator, M: ShardMemory<T, C>>(
        self,
        engine: &mut Engine<T, C, M>,
        stepping: &[bool],
        params: &mut M::Params<'_>,
    ) -> Result<()> {
        let serial = Serial { stepping };
        match self {
            ShardUpdate::Serial => serial.run(engine, params),
            ShardUpdate::Inline => Inline {
                buckets: Buckets::new(engine, stepping)?,
            }
            .run(engine, params),
            ShardUpdate::Deferred => Deferred {
                buckets: Buckets::new(engine, stepping)?,
            }
            .run(engine, params),
            ShardUpdate::OnThread => {
                let buckets = Buckets::new(engine, stepping)?;
                let gathered = OnThread { buckets }.run(engine, params)?;
                if gathered {
                    Ok(())
                } else {
                    // The thread is gone: the serial update gathers the
                    // same way.
                    serial.run(engine, params)
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Stage 2 after an overlapped backward on host memory.
    fn stage2() -> StepFacts {
        StepFacts {
            by_bucket: true,
            forkable: true,
            ..StepFacts::default()
        }
    }

    #[test]
    fn stage0_steps_as_reduced_only_on_a_landing_thread_pass_it_allows() {
        let ddp = StepFacts {
            replicated: true,
            ddp_as_reduced: true,
            pass_lands_on_thread: true,
            ..stage2()
        };
        assert_eq!(decide(&ddp, || true), StepPath::ReplicaAsReduced);
        let serial_pass = StepFacts {
            pass_lands_on_thread: false,
            ..ddp
        };
        assert_eq!(decide(&serial_pass, || true), StepPath::Replica);
        let clipped = StepFacts {
            ddp_as_reduced: false,
            ..ddp
        };
        assert_eq!(decide(&clipped, || true), StepPath::Replica);
        let masters = StepFacts {
            masters: true,
            ..clipped
        };
        assert_eq!(
            decide(&masters, || panic!("stage 0 needs no thread to write back")),
            StepPath::Shard(ShardUpdate::Serial)
        );
    }

    #[test]
    fn a_sharded_stage_overlaps_where_the_memory_and_partition_allow() {
        assert_eq!(
            decide(&stage2(), || true),
            StepPath::Shard(ShardUpdate::OnThread)
        );
        // No thread could be started: the same gathers, serially.
        assert_eq!(
            decide(&stage2(), || false),
            StepPath::Shard(ShardUpdate::Serial)
        );
        let device = StepFacts {
            forkable: false,
            launches_async: true,
            ..stage2()
        };
        assert_eq!(
            decide(&device, || panic!("a device memory queues on its stream")),
            StepPath::Shard(ShardUpdate::Inline)
        );
        let deferred = StepFacts {
            defer: true,
            ..stage2()
        };
        // Deferral gathers on this thread when there is no other.
        assert_eq!(
            decide(&deferred, || panic!("deferral does not need the thread")),
            StepPath::Shard(ShardUpdate::Deferred)
        );
        for serial in [
            StepFacts {
                no_overlap: true,
                ..stage2()
            },
            StepFacts {
                sharded_params: true,
                ..stage2()
            },
            StepFacts {
                by_bucket: false,
                ..stage2()
            },
            StepFacts {
                forkable: false,
                ..stage2()
            },
        ] {
            assert_eq!(
                decide(&serial, || panic!("a serial update starts no thread")),
                StepPath::Shard(ShardUpdate::Serial),
                "{serial:?}"
            );
        }
    }

    #[test]
    fn offloads_step_thread_writes_back_unless_the_step_needs_every_gradient() {
        let offload = StepFacts {
            host_steps: true,
            ..stage2()
        };
        assert_eq!(
            decide(&offload, || true),
            StepPath::HostStepped(ShardUpdate::OnThread)
        );
        let averaged = StepFacts {
            whole_grads: true,
            ..offload
        };
        assert_eq!(
            decide(&averaged, || true),
            StepPath::Shard(ShardUpdate::OnThread)
        );
    }
}
