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
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};
use zero_core::engine::{
    EngineConfig, HostGrad, HostMemory, Overlap, ParamCopy, ParamWriter, ShardMemory, Stage,
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

/// Writes gathered buckets into a store shared with the test, once the gate
/// is open.
struct GatedWriter {
    store: Arc<Mutex<Vec<Vec<f64>>>>,
    gate: Arc<Gate>,
}

impl ParamWriter<f64, ThreadComm, HostMemory> for GatedWriter {
    fn write(
        &mut self,
        memory: &mut HostMemory,
        copies: &[ParamCopy],
        values: &Vec<f64>,
    ) -> Result<()> {
        self.gate.pass()?;
        let mut store = self.store.lock().unwrap();
        ShardMemory::<f64, ThreadComm>::write_params(memory, &mut *store, copies, values)
    }
}

/// One step with every gradient handed over during "backward" (in reverse
/// order, as backward produces them).
fn handed_over_step(
    e: &mut Engine<f64, ThreadComm>,
    grads: &[Vec<f64>],
    params: &mut Vec<Vec<f64>>,
) -> Result<()> {
    let n = grads.len();
    let order: Vec<(usize, usize)> = (0..n).rev().map(|p| (p, 1)).collect();
    e.begin_backward(&order, params)?;
    for p in (0..n).rev() {
        e.accumulate_param(p, (&grads[p]).into())?;
    }
    let none: Vec<Option<HostGrad<'_, f64>>> = vec![None; n];
    e.step(&none, params)?;
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
                        let mut e =
                            engine(comm, &model, make_opt(Opt::Adam, false), config.clone())?;
                        let store = Arc::new(Mutex::new(model.init()));
                        let gate = Arc::new(Gate::default());
                        gate.open();
                        e.set_param_writer(Box::new(GatedWriter {
                            store: store.clone(),
                            gate,
                        }))?;
                        let mut params = model.init();
                        let mut out = Vec::new();
                        for s in 0..steps {
                            for m in 0..micro {
                                let g = model.grads(&params, rank, s * micro + m);
                                // The writer's store is the replica the
                                // gathers update.
                                *store.lock().unwrap() = params.clone();
                                handed_over_step(&mut e, &g, &mut params)?;
                            }
                            e.finish_gathers()?;
                            params = store.lock().unwrap().clone();
                            out.push(params.clone());
                        }
                        assert_eq!(e.deferred_steps(), steps as u64, "every step deferred");
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
    for defer in [true, false] {
        let config = EngineConfig::default()
            .with_bucket_bytes(64)
            .with_defer_gathers(defer);
        let results = run(world, |comm| {
            let rank = comm.rank();
            let mut e = engine(comm, &model, make_opt(Opt::Adam, false), config.clone())?;
            let store = Arc::new(Mutex::new(model.init()));
            let gate = Arc::new(Gate::default());
            e.set_param_writer(Box::new(GatedWriter {
                store: store.clone(),
                gate: gate.clone(),
            }))?;
            let mut params = model.init();
            let g = model.grads(&params, rank, 0);
            handed_over_step(&mut e, &g, &mut params)?;
            // Returned with the gate shut: nothing gathered yet, unless
            // the step gathered itself (into `params`).
            let pending = e.refresh().pending();
            let untouched = *store.lock().unwrap() == model.init();
            let stepped_in_place = params != model.init();
            gate.open();
            e.wait_for_params()?;
            e.finish_gathers()?;
            let result = if defer {
                store.lock().unwrap().clone()
            } else {
                params.clone()
            };
            // A gradient in a slot (a parameter a plain op reads) keeps
            // the gathers in the step.
            let slots: Vec<Option<HostGrad<'_, f64>>> = g.iter().map(|g| Some(g.into())).collect();
            let before = e.deferred_steps();
            e.step(&slots, &mut params)?;
            let slot_step_deferred = e.deferred_steps() > before;
            Ok((
                pending,
                untouched,
                stepped_in_place,
                result,
                slot_step_deferred,
            ))
        });
        for (pending, untouched, stepped_in_place, result, slot_step_deferred) in results {
            assert_eq!(
                pending, defer,
                "gathers still to come when the step returned"
            );
            assert!(untouched, "the writer wrote nothing before the gate opened");
            assert_eq!(
                stepped_in_place, !defer,
                "the step wrote the replica itself"
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
