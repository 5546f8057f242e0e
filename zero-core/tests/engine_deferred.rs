//! Deferred all-gathers (`EngineConfig::defer_gathers`): a step that
//! leaves its all-gathers running gives the same parameters as one that
//! gathers before returning, at stages 1 and 2, both overlapped schedules,
//! with accumulation; it really returns first (a writer held shut proves it
//! without timing); a gradient given in a slot keeps the gathers in the
//! step.

mod common;

use common::{
    assert_trajectories, engine, make_opt, reference_trajectory, run, Model, Opt, Synthetic,
};
use std::ops::Range;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};
use zero_core::engine::{
    EngineConfig, HostGrad, HostMemory, Overlap, ParamAccess, ParamCopy, ParamStore, ShardMemory,
    Stage,
};
use zero_core::{Communicator, Engine, Error, Result, ThreadComm};

/// A gate the test opens; writers wait at it (at most 30 s, then fail).
#[derive(Default)]
struct Gate {
    open: Mutex<bool>,
    opened: Condvar,
}

impl Gate {
    fn open(&self) {
        *self.open.lock().unwrap() = true;
        self.opened.notify_all();
    }

    fn pass(&self) -> Result<()> {
        let deadline = Instant::now() + Duration::from_secs(30);
        let mut open = self.open.lock().unwrap();
        while !*open {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(Error::State("the test never opened the gate".into()));
            }
            open = self.opened.wait_timeout(open, left).unwrap().0;
        }
        Ok(())
    }
}

/// The replica, shared by the test, the engine's calls and the gather
/// thread.
type Store = Arc<Mutex<Vec<Vec<f64>>>>;

/// The store as the parameters of an engine call.
struct Shared(Store);

impl ParamStore<f64> for Shared {
    fn read(&mut self, param: usize, range: Range<usize>, out: &mut [f64]) -> Result<()> {
        self.0.lock().unwrap().read(param, range, out)
    }

    fn write(&mut self, param: usize, range: Range<usize>, values: &[f64]) -> Result<()> {
        self.0.lock().unwrap().write(param, range, values)
    }
}

/// The store as the gather thread reaches it; its writes wait at the gate.
struct GatedAccess {
    store: Store,
    gate: Arc<Gate>,
}

impl ParamAccess<f64, ThreadComm, HostMemory> for GatedAccess {
    fn read(
        &mut self,
        memory: &mut HostMemory,
        copies: &[ParamCopy],
        values: &mut Vec<f64>,
    ) -> Result<()> {
        let mut store = Shared(self.store.clone());
        ShardMemory::<f64, ThreadComm>::read_params(memory, &mut store, copies, values)
    }

    fn write(
        &mut self,
        memory: &mut HostMemory,
        copies: &[ParamCopy],
        values: &Vec<f64>,
    ) -> Result<()> {
        self.gate.pass()?;
        let mut store = Shared(self.store.clone());
        ShardMemory::<f64, ThreadComm>::write_params(memory, &mut store, copies, values)
    }
}

/// An engine whose gather thread reaches `store` through `gate`.
fn gated_engine(
    comm: ThreadComm,
    model: &Synthetic,
    config: &EngineConfig,
    store: &Store,
    gate: &Arc<Gate>,
) -> Result<Engine<f64, ThreadComm>> {
    let mut e = engine(comm, model, make_opt(Opt::Adam, false), config.clone())?;
    e.set_param_access(Box::new(GatedAccess {
        store: store.clone(),
        gate: gate.clone(),
    }))?;
    Ok(e)
}

/// One step with every gradient handed over during "backward" (in reverse
/// order, as backward produces them).
fn handed_over_step(
    e: &mut Engine<f64, ThreadComm>,
    grads: &[Vec<f64>],
    store: &Store,
) -> Result<()> {
    let n = grads.len();
    let mut params = Shared(store.clone());
    let order: Vec<(usize, usize)> = (0..n).rev().map(|p| (p, 1)).collect();
    e.begin_backward(&order, &mut params)?;
    for p in (0..n).rev() {
        e.accumulate_param(p, .., (&grads[p]).into())?;
    }
    let none: Vec<Option<HostGrad<'_, f64>>> = vec![None; n];
    e.step(&none, &mut params)?;
    Ok(())
}

#[test]
fn deferred_gathers_give_the_parameters_of_gathers_in_the_step() {
    let model = Synthetic::medium();
    let steps = 3;
    for world in [2, 3] {
        for micro in [1, 2] {
            let expected = reference_trajectory(&model, Opt::Adam, world, micro, steps);
            for stage in [Stage::OptimizerState, Stage::Gradients] {
                for overlap in [Overlap::AfterBackward, Overlap::Interleaved] {
                    let config = EngineConfig::default()
                        .with_stage(stage)
                        .with_bucket_bytes(64)
                        .with_grad_accum_steps(micro)
                        .with_overlap(overlap)
                        .with_defer_gathers(true);
                    let trajectories = run(world, |comm| {
                        let rank = comm.rank();
                        let store: Store = Arc::new(Mutex::new(model.init()));
                        let gate = Arc::new(Gate::default());
                        gate.open();
                        let mut e = gated_engine(comm, &model, &config, &store, &gate)?;
                        let mut out = Vec::new();
                        for s in 0..steps {
                            for m in 0..micro {
                                // The next micro-step's forward: after the
                                // gathers (the layers wait for them).
                                e.refresh().wait_all()?;
                                let params = store.lock().unwrap().clone();
                                let g = model.grads(&params, rank, s * micro + m);
                                handed_over_step(&mut e, &g, &store)?;
                            }
                            e.finish_gathers()?;
                            out.push(store.lock().unwrap().clone());
                        }
                        assert_eq!(
                            e.counters().deferred_steps,
                            steps as u64,
                            "every step deferred"
                        );
                        Ok(out)
                    });
                    assert_trajectories(
                        &trajectories,
                        &expected[..steps],
                        1e-9,
                        &format!("world {world}, {micro} micro-steps, {stage:?} {overlap:?}"),
                    );
                }
            }
        }
    }
}

#[test]
fn a_deferred_step_returns_before_its_gathers_and_one_with_slots_does_not() {
    let model = Synthetic::medium();
    let world = 2;
    let expected = reference_trajectory(&model, Opt::Adam, world, 1, 1);
    let close = |a: &[Vec<f64>], b: &[Vec<f64>]| {
        a.iter()
            .flatten()
            .zip(b.iter().flatten())
            .all(|(x, y)| (x - y).abs() <= 1e-9)
    };
    for defer in [true, false] {
        let config = EngineConfig::default()
            .with_bucket_bytes(64)
            .with_defer_gathers(defer);
        let results = run(world, |comm| {
            let rank = comm.rank();
            let store: Store = Arc::new(Mutex::new(model.init()));
            let gate = Arc::new(Gate::default());
            let mut e = gated_engine(comm, &model, &config, &store, &gate)?;
            let g = model.grads(&model.init(), rank, 0);
            handed_over_step(&mut e, &g, &store)?;
            // Returned with the gate shut: the other rank's pieces are not
            // in yet, unless the step gathered them itself.
            let pending = e.refresh().pending();
            let complete_at_return = close(&store.lock().unwrap(), &expected[0]);
            gate.open();
            e.refresh().wait_all()?;
            e.finish_gathers()?;
            let result = store.lock().unwrap().clone();
            // A gradient in a slot (a parameter a plain op reads) keeps
            // the gathers in the step.
            let slots: Vec<Option<HostGrad<'_, f64>>> = g.iter().map(|g| Some(g.into())).collect();
            let before = e.counters().deferred_steps;
            e.step(&slots, &mut Shared(store.clone()))?;
            let slot_step_deferred = e.counters().deferred_steps > before;
            Ok((pending, complete_at_return, result, slot_step_deferred))
        });
        for (pending, complete_at_return, result, slot_step_deferred) in results {
            assert_eq!(
                pending, defer,
                "gathers still to come when the step returned"
            );
            assert_eq!(
                complete_at_return, !defer,
                "the step gathered before returning"
            );
            common::assert_close(&result, &expected[0], 1e-9, &format!("defer {defer}"));
            assert!(
                !slot_step_deferred,
                "a step with slots gathered before returning"
            );
        }
    }
}

#[test]
fn defer_gathers_is_refused_where_there_is_nothing_to_defer() {
    let model = Synthetic::medium();
    for config in [
        EngineConfig::default().with_stage(Stage::Ddp),
        EngineConfig::default().with_overlap(Overlap::None),
    ] {
        let errors = run(1, |comm| {
            let config = config.clone().with_defer_gathers(true);
            Ok(engine(comm, &model, make_opt(Opt::Adam, false), config)
                .err()
                .map(|e| e.to_string()))
        });
        let message = errors[0].clone().expect("refused");
        assert!(message.contains("defer_gathers"), "{message}");
    }
}
