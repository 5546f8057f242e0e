//! Hybrid sharding (`EngineConfig::shard_group`): the state sharded within
//! groups of ranks and replicated across them trains the same model as full
//! sharding and as plain data parallelism, holds what a world of one group
//! holds, and saves checkpoints that load with any group size.

mod common;

use common::{
    assert_close, engine, hooked_micro_step, make_opt, reference_trajectory, run, slots, Model,
    Opt, PlanCheck, Synthetic, TestMemory,
};
use std::sync::Arc;
use zero_core::checkpoint::StateDict;
use zero_core::engine::{EngineConfig, HostGrad, Offload, OffloadMemory, Overlap, Stage};
use zero_core::{Communicator, DType, Engine, Error, SaveOptions, ThreadComm};

const WORLD: usize = 4;
const STEPS: usize = 3;

fn config(stage: Stage, group: Option<usize>) -> EngineConfig {
    let config = EngineConfig::default()
        .with_stage(stage)
        // Several buckets per rank.
        .with_bucket_bytes(256)
        .with_grad_accum_steps(2)
        .with_clip(1.5, zero_core::engine::NormType::L2);
    match group {
        Some(g) => config.with_shard_group(g),
        None => config,
    }
}

/// Every rank's parameters after each step: two micro-steps a step, the
/// first given after backward, the second handed over during it (`hooked`)
/// or also after.
fn trajectories(stage: Stage, group: Option<usize>, hooked: bool) -> Vec<Vec<Vec<Vec<f64>>>> {
    let model = Synthetic::medium();
    run(WORLD, |comm| {
        let config = config(stage, group);
        let e = engine(comm, &model, make_opt(Opt::Adam, false), config)?;
        train(e, hooked)
    })
}

/// [`trajectories`] on the engine `e`.
fn train<M: TestMemory>(
    mut e: Engine<f64, ThreadComm, M>,
    hooked: bool,
) -> zero_core::Result<Vec<Vec<Vec<f64>>>> {
    let model = Synthetic::medium();
    let rank = e.comm().rank();
    let mut params = model.init();
    let mut out = Vec::new();
    for s in 0..STEPS {
        let first = model.grads(&params, rank, 2 * s);
        e.accumulate(&slots(&first))?;
        let second = model.grads(&params, rank, 2 * s + 1);
        if hooked {
            hooked_micro_step(&mut e, &second, &mut params)?;
        } else {
            e.step(&slots(&second), &mut params)?;
        }
        out.push(params.clone());
    }
    Ok(out)
}

/// Offloaded (the shards in host memory, over a device posing as one with
/// a communication thread and as one with a stream), groups train full
/// sharding's weights.
#[test]
fn offloaded_groups_train_the_weights_of_full_sharding() {
    let model = Synthetic::medium();
    for stage in [Stage::Gradients, Stage::Parameters] {
        let full = trajectories(stage, None, true);
        for inline in [false, true] {
            let offloaded = run(WORLD, |comm| {
                let device = PlanCheck::new(Arc::default(), inline);
                let config = config(stage, Some(2)).with_offload(Offload::Optimizer, 2);
                let opt = make_opt(Opt::Adam, false);
                let e = Engine::with_memory(
                    comm,
                    OffloadMemory::new(device),
                    model.infos(),
                    opt,
                    config,
                )?;
                train(e, true)
            });
            for (rank, (o, f)) in offloaded.iter().zip(&full).enumerate() {
                for s in 0..STEPS {
                    let at = format!("{stage:?} inline {inline} rank {rank} step {s}");
                    assert_close(&o[s], &f[s], 1e-12, &at);
                }
            }
        }
    }
}

#[test]
fn groups_of_two_train_as_full_sharding_and_as_one_replica_per_rank() {
    for stage in [Stage::OptimizerState, Stage::Gradients] {
        for hooked in [false, true] {
            let what = format!("{stage:?} hooked {hooked}");
            let full = trajectories(stage, None, hooked);
            // Averages within a group then across the groups: the same mean
            // summed in another order, so equal within rounding.
            for group in [2, 1] {
                let hybrid = trajectories(stage, Some(group), hooked);
                for (rank, (h, f)) in hybrid.iter().zip(&full).enumerate() {
                    for s in 0..STEPS {
                        let at = format!("{what} group {group} rank {rank} step {s}");
                        assert_close(&h[s], &f[s], 1e-12, &at);
                    }
                }
                // Every replica steps the same values.
                for h in &hybrid[1..] {
                    assert_eq!(h, &hybrid[0], "{what} group {group}: ranks differ");
                }
            }
        }
    }
}

#[test]
fn groups_train_the_data_parallel_model() {
    // Micro-batches 2s and 2s + 1 of each rank, averaged over every rank.
    let model = Synthetic::medium();
    let hybrid = trajectories(Stage::Gradients, Some(2), false);
    let unclipped = run(WORLD, |comm| {
        let rank = comm.rank();
        let config = EngineConfig::default()
            .with_stage(Stage::Gradients)
            .with_grad_accum_steps(2)
            .with_shard_group(2);
        let mut e = engine(comm, &model, make_opt(Opt::Adam, false), config)?;
        let mut params = model.init();
        for s in 0..STEPS {
            for m in 0..2 {
                e.step(&slots(&model.grads(&params, rank, 2 * s + m)), &mut params)?;
            }
        }
        Ok(params)
    });
    let expected = reference_trajectory(&model, Opt::Adam, WORLD, 2, STEPS);
    for params in &unclipped {
        assert_close(
            params,
            &expected[STEPS - 1],
            1e-9,
            "hybrid vs data parallel",
        );
    }
    // Clipping by the global norm changes the steps (the norm is above
    // 1.5): the groups clip by the same norm as full sharding (checked
    // above), not by a group's.
    assert!(hybrid[0][STEPS - 1] != unclipped[0]);
}

#[test]
fn a_rank_holds_what_it_would_in_a_world_of_one_group() {
    let model = Synthetic::medium();
    let report = |world: usize, group: Option<usize>| {
        run(world, |comm| {
            let config = config(Stage::Gradients, group);
            let mut e = engine(comm, &model, make_opt(Opt::Adam, false), config)?;
            let mut params = model.init();
            let rank = e.comm().rank();
            e.step(&slots(&model.grads(&params, rank, 0)), &mut params)?;
            e.step(&slots(&model.grads(&params, rank, 1)), &mut params)?;
            Ok(e.memory_report())
        })
    };
    let hybrid = report(WORLD, Some(2));
    let half = report(2, None);
    for (rank, r) in hybrid.iter().enumerate() {
        let alone = &half[rank % 2];
        assert_eq!(r.grad_shard, alone.grad_shard, "rank {rank}");
        assert_eq!(r.optimizer_state, alone.optimizer_state, "rank {rank}");
        assert_eq!(r.params, alone.params, "rank {rank}");
    }
    // The ZeRO formula for a world of two: each group's two gradient
    // shards cover the model's 249 values once (and some padding), where
    // full sharding over four ranks holds half as much per rank.
    let model_bytes = model.infos().iter().map(|p| p.numel() * 8).sum::<usize>();
    let group: usize = hybrid[..2].iter().map(|r| r.grad_shard).sum();
    assert!(
        group >= model_bytes && group <= model_bytes + 2 * 8 * 8,
        "{group}"
    );
    let full = report(WORLD, None);
    for (h, f) in hybrid.iter().zip(&full) {
        assert!(
            h.grad_shard > f.grad_shard + f.grad_shard / 2,
            "{h:?} {f:?}"
        );
    }
}

#[test]
fn bad_group_sizes_are_errors_on_every_rank() {
    let model = Synthetic::medium();
    let build = |group: &(dyn Fn(usize) -> Option<usize> + Sync), stage: Stage| {
        zero_core::ThreadGroup::new(WORLD).run(|comm| {
            let config = config(stage, group(comm.rank()));
            engine(comm, &model, make_opt(Opt::Sgd, false), config).map(|_| ())
        })
    };
    let message = |r: zero_core::Result<zero_core::Result<()>>| match r {
        Ok(Err(e)) => e.to_string(),
        other => panic!("expected an error, got {other:?}"),
    };
    for r in build(&|_| Some(3), Stage::Gradients) {
        let m = message(r);
        assert!(
            m.contains("shard_group 3 does not divide the world of 4"),
            "{m}"
        );
    }
    for r in build(&|_| Some(0), Stage::Gradients) {
        assert!(message(r).contains("shard_group is 0"));
    }
    for r in build(&|_| Some(2), Stage::Ddp) {
        assert!(message(r).contains("stage 0 shards nothing"));
    }
    // Ranks that disagree on the group size.
    for r in build(
        &|rank| Some(if rank == 0 { 2 } else { 4 }),
        Stage::Gradients,
    ) {
        match r {
            Ok(Err(Error::RankMismatch { this, other, .. })) => {
                assert!(this.contains("shard_group") && other.contains("shard_group"));
            }
            other => panic!("expected a rank mismatch, got {other:?}"),
        }
    }
}

/// Trains `steps` steps in groups of `group` (of `WORLD` ranks), saves into
/// `dir`, and returns rank 0's parameters.
fn train_and_save(group: Option<usize>, dir: &std::path::Path) -> Vec<Vec<f64>> {
    let model = Synthetic::medium();
    let out = run(WORLD, |comm| {
        let rank = comm.rank();
        let config = config(Stage::Gradients, group);
        let mut e = engine(comm, &model, make_opt(Opt::Adam, false), config)?;
        let mut params = model.init();
        for s in 0..2 * STEPS {
            e.step(&slots(&model.grads(&params, rank, s)), &mut params)?;
        }
        let manifest = e.save_checkpoint(dir, &mut params, &SaveOptions::default())?;
        let info = manifest.checkpoint.expect("an engine's checkpoint");
        assert_eq!(info.steps, STEPS as u64);
        // Saved as by a world of one group.
        assert_eq!(info.world_size, group.unwrap_or(WORLD));
        Ok(params)
    });
    out[0].clone()
}

fn consolidated_dir(
    dir: &std::path::Path,
    world: usize,
    group: Option<usize>,
) -> std::path::PathBuf {
    dir.join(format!("consolidated-{world}-{group:?}"))
}

/// Loads `dir` on `world` ranks in groups of `group`: rank 0's parameters,
/// and the optimizer state consolidated on the last rank (with groups, its
/// group gathers it).
fn load(
    world: usize,
    group: Option<usize>,
    dir: &std::path::Path,
) -> (Vec<Vec<f64>>, StateDict<f64>) {
    let model = Synthetic::medium();
    let out = run(world, |comm| {
        let config = config(Stage::Gradients, group);
        let mut e = engine(comm, &model, make_opt(Opt::Adam, false), config)?;
        let mut params = model.init();
        e.load_checkpoint(dir, &mut params)?;
        let last = world - 1;
        let dict = e.consolidate_state_dict(last)?;
        assert_eq!(dict.is_some(), e.comm().rank() == last);
        // The same state, streamed into a file by the last rank.
        e.save_consolidated(consolidated_dir(dir, world, group), last)?;
        let beyond = e.consolidate_state_dict(world).unwrap_err();
        assert!(matches!(beyond, Error::InvalidRank { .. }), "{beyond}");
        Ok((params, dict))
    });
    let (params, _) = out[0].clone();
    let dict = out[world - 1]
        .1
        .clone()
        .expect("the last rank consolidates");
    (params, dict)
}

#[test]
fn checkpoints_load_across_group_sizes_and_world_sizes() {
    let hybrid_dir = tempfile::tempdir().unwrap();
    let full_dir = tempfile::tempdir().unwrap();
    let saved = train_and_save(Some(2), hybrid_dir.path());
    let full = train_and_save(None, full_dir.path());
    assert_close(&saved, &full, 1e-12, "trained");
    let (_, full_state) = load(2, None, full_dir.path());
    for (world, group) in [(WORLD, Some(2)), (WORLD, None), (WORLD, Some(1)), (2, None)] {
        let (params, state) = load(world, group, hybrid_dir.path());
        let what = format!("world {world} group {group:?}");
        assert_eq!(params, saved, "{what}: the saved weights");
        assert_eq!(state.steps, full_state.steps, "{what}");
        let file = consolidated_dir(hybrid_dir.path(), world, group);
        assert_eq!(
            StateDict::load(file).unwrap(),
            state,
            "{what}: the consolidated file"
        );
        for (name, s) in &full_state.state {
            for (key, values) in &s.tensors {
                let loaded = &state.state[name].tensors[key];
                let (loaded, values) = (std::slice::from_ref(loaded), std::slice::from_ref(values));
                assert_close(loaded, values, 1e-12, &what);
            }
        }
    }
    // Only the first group wrote rank files: as many as one group's ranks.
    let rank_files = common::listing(hybrid_dir.path())
        .into_iter()
        .filter(|f| f.starts_with("optim."))
        .count();
    assert_eq!(rank_files, 2);
}

/// A background save in groups: the files of a blocking one, bitwise;
/// completed on every rank; a failure of the first group's writes is every
/// rank's error.
#[test]
fn background_saves_in_groups_write_the_blocking_save_s_files() {
    let model = Synthetic::medium();
    let (blocking, background) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let out = run(WORLD, |comm| {
        let rank = comm.rank();
        let mut e = engine(
            comm,
            &model,
            make_opt(Opt::Adam, false),
            config(Stage::Gradients, Some(2)),
        )?;
        let mut params = model.init();
        for s in 0..4 {
            e.step(&slots(&model.grads(&params, rank, s)), &mut params)?;
        }
        let options = SaveOptions::default();
        e.save_checkpoint(blocking.path(), &mut params, &options)?;
        assert_eq!(
            e.save_checkpoint_async(background.path(), &mut params, &options)?,
            None
        );
        let saved = e.wait_checkpoint()?.expect("every rank completes the save");
        assert_eq!(saved.dir, background.path());
        // A failing write on rank 1 (of the first group).
        let failing = SaveOptions {
            fail_after: Some((1, 16)),
            ..SaveOptions::default()
        };
        let broken = background.path().join("broken");
        e.save_checkpoint_async(&broken, &mut params, &failing)?;
        Ok(e.wait_checkpoint().unwrap_err().to_string())
    });
    for (rank, message) in out.iter().enumerate() {
        assert!(message.contains("injected write failure"), "{message}");
        if rank != 1 {
            assert!(message.contains("failed on rank 1"), "{message}");
        }
    }
    let files = |dir: &std::path::Path| {
        let mut names = common::listing(dir);
        names.retain(|n| n.ends_with(".safetensors"));
        names
            .iter()
            .map(|n| std::fs::read(dir.join(n)).unwrap())
            .collect::<Vec<_>>()
    };
    assert_eq!(files(background.path()), files(blocking.path()));
    assert_eq!(
        common::listing(background.path()).len(),
        common::listing(blocking.path()).len() + 1
    );
}

/// The interleaved overlap in groups: each bucket, averaged across the
/// replicas (in full precision or bf16), steps during backward, and trains
/// the weights of the overlap after backward, every rank alike, and (in
/// full precision) those of full sharding.
#[test]
fn interleaved_overlap_in_groups_trains_as_after_backward_and_full_sharding() {
    let model = Synthetic::medium();
    let train = |stage: Stage, group: Option<usize>, overlap: Overlap, replica: Option<DType>| {
        run(WORLD, |comm| {
            let rank = comm.rank();
            let mut config = EngineConfig::default()
                .with_stage(stage)
                .with_bucket_bytes(96)
                .with_overlap(overlap);
            config.shard_group = group;
            config.replica_reduce_dtype = replica;
            let mut e = engine(comm, &model, make_opt(Opt::Sgd, false), config)?;
            let n = e.params().len();
            let mut params = model.init();
            let mut lent = true;
            for s in 0..STEPS {
                let g = model.grads(&params, rank, s);
                let order: Vec<(usize, usize)> = (0..n).rev().map(|p| (p, 1)).collect();
                e.begin_backward(&order, &mut params)?;
                for p in (0..n).rev() {
                    e.accumulate_param(p, .., (&g[p]).into())?;
                }
                // The optimizer steps beside backward: lent until the step.
                lent &= e.optimizer().is_err();
                let none: Vec<Option<HostGrad<'_, f64>>> = vec![None; n];
                e.step(&none, &mut params)?;
            }
            Ok((params, lent))
        })
    };
    for stage in [Stage::OptimizerState, Stage::Gradients] {
        let full = train(stage, None, Overlap::Interleaved, None);
        for replica in [None, Some(DType::BF16)] {
            let interleaved = train(stage, Some(2), Overlap::Interleaved, replica);
            let after = train(stage, Some(2), Overlap::AfterBackward, replica);
            for rank in 0..WORLD {
                assert!(
                    interleaved[rank].1,
                    "{stage:?} rank {rank} stepped during backward"
                );
                assert!(!after[rank].1, "after backward, the optimizer stays home");
                assert_eq!(
                    interleaved[rank].0, interleaved[0].0,
                    "rank {rank}: replicas alike"
                );
                assert_close(
                    &interleaved[rank].0,
                    &after[rank].0,
                    1e-12,
                    "as after backward",
                );
                if replica.is_none() {
                    assert_close(
                        &interleaved[rank].0,
                        &full[rank].0,
                        1e-12,
                        "as full sharding",
                    );
                }
            }
        }
    }
}

/// Offload's host steps each bucket as it lands, before any average
/// across the groups: the interleaved overlap with offload is refused in
/// groups, with what to do instead.
#[test]
fn interleaved_overlap_with_offload_is_refused_with_groups() {
    let model = Synthetic::medium();
    let interleaved = EngineConfig::default()
        .with_stage(Stage::Gradients)
        .with_shard_group(2)
        .with_offload(Offload::Optimizer, 1)
        .with_overlap(Overlap::Interleaved);
    let refused = zero_core::ThreadGroup::new(WORLD).run(|comm| {
        engine(comm, &model, make_opt(Opt::Sgd, false), interleaved.clone()).map(|_| ())
    });
    for r in refused {
        assert!(matches!(r, Ok(Err(Error::Config(m))) if m.contains("after-backward")));
    }
}

/// The replicas' average in bf16 (`replica_reduce_dtype`): every rank holds
/// the same weights, within bf16's rounding of the average in full
/// precision, and not equal to them (the average ran in bf16).
#[test]
fn a_bf16_replica_average_trains_alike_on_every_rank_within_its_rounding() {
    let model = Synthetic::medium();
    for stage in [Stage::OptimizerState, Stage::Gradients] {
        let exact = trajectories(stage, Some(2), true);
        let narrow = run(WORLD, |comm| {
            let config = config(stage, Some(2)).with_replica_reduce_dtype(DType::BF16);
            let e = engine(comm, &model, make_opt(Opt::Adam, false), config)?;
            train(e, true)
        });
        for rank in 1..WORLD {
            assert_eq!(narrow[rank], narrow[0], "rank {rank}, {stage:?}");
        }
        let last = STEPS - 1;
        assert_ne!(
            narrow[0][last], exact[0][last],
            "{stage:?}: averaged in bf16"
        );
        assert_close(
            &narrow[0][last],
            &exact[0][last],
            1e-3,
            "bf16 replica average",
        );
    }
}

/// A replica dtype without groups, or one that is not 16 bits wide, is an
/// error that says what to do.
#[test]
fn a_replica_dtype_needs_groups_and_16_bits() {
    let model = Synthetic::medium();
    let cases = [
        (
            config(Stage::Gradients, None).with_replica_reduce_dtype(DType::BF16),
            "set shard_group too",
        ),
        (
            config(Stage::Gradients, Some(2)).with_replica_reduce_dtype(DType::F32),
            "(bf16 or f16)",
        ),
    ];
    for (refused, says) in cases {
        let results = zero_core::ThreadGroup::new(WORLD).run(|comm| {
            engine(comm, &model, make_opt(Opt::Sgd, false), refused.clone()).map(|_| ())
        });
        for r in results {
            assert!(
                matches!(&r, Ok(Err(Error::Config(m))) if m.contains(says)),
                "{r:?}"
            );
        }
    }
}

/// `counters().bytes_sent` counts every communicator of the engine: in
/// groups, the replicas' average too (one all-reduce of the gradient
/// shard per step between two replicas sends the shard's bytes; in bf16 a
/// quarter of what it sends in f64, everything else alike).
#[test]
fn bytes_sent_counts_the_replicas_average() {
    let model = Synthetic::medium();
    let sent = |replica: Option<DType>| {
        run(WORLD, |comm| {
            let mut config = config(Stage::Gradients, Some(2));
            config.replica_reduce_dtype = replica;
            let mut e = engine(comm, &model, make_opt(Opt::Sgd, false), config)?;
            let shard = e.sharding().plan().shard_numel as u64;
            let before = e.counters().bytes_sent;
            let rank = e.comm().rank();
            let mut params = model.init();
            for s in 0..STEPS {
                e.accumulate(&slots(&model.grads(&params, rank, 2 * s)))?;
                let second = model.grads(&params, rank, 2 * s + 1);
                hooked_micro_step(&mut e, &second, &mut params)?;
            }
            Ok((e.counters().bytes_sent - before, shard))
        })
    };
    let (full, narrow) = (sent(None), sent(Some(DType::BF16)));
    for rank in 0..WORLD {
        let (shard, steps) = (full[rank].1, STEPS as u64);
        assert_eq!(
            full[rank].0 - narrow[rank].0,
            steps * shard * (8 - 2),
            "rank {rank}: the replicas' average, in f64 and in bf16"
        );
    }
}
