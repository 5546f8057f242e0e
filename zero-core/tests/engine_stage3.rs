//! Stage 3 through the engine alone, as a framework's layers use it: after
//! `shard_parameters` the sharded parameters' values exist only as what
//! the fetcher gathers (whole or in pieces), the model computes its
//! gradients from them, and the weights follow stage 2's. The same driver
//! runs over device memory in `zero-nccl`'s `gpu_threads` tests.

mod common;

use common::{
    assert_close, engine, make_opt, run, slots, Mlp, Model, Opt, PlanCheck, Seen, TestMemory,
};
use std::sync::{Arc, Mutex};
use zero_core::engine::{
    EngineConfig, Fetcher, GatherBudgets, GatherMemory, HostMemory, MemoryReport, NormType,
    Offload, OffloadMemory, Stage,
};
use zero_core::{Communicator, Engine, Error, Result, ThreadComm, ThreadGroup};

/// The values of parameter `p`: gathered through `fetcher` piece by piece
/// when it is sharded, else the replica's.
fn values<G: GatherMemory<f64, Buffer = zero_core::engine::HostGather<f64>>>(
    fetcher: Option<&Arc<Fetcher<f64, G>>>,
    replica: &[Vec<f64>],
    p: usize,
) -> Result<Vec<f64>> {
    let Some(fetcher) = fetcher.filter(|f| f.is_sharded(p)) else {
        return Ok(replica[p].clone());
    };
    let mut out = vec![f64::NAN; replica[p].len()];
    for piece in 0..fetcher.pieces(p) {
        let gathered = fetcher.acquire(p, piece)?;
        for (at, places) in gathered.spans() {
            let buffer = gathered
                .buffer()
                .as_wide()
                .expect("f64 values gathered as such");
            out[places.clone()].copy_from_slice(&buffer[at.clone()]);
        }
        fetcher.release(gathered);
    }
    assert!(
        out.iter().all(|v| !v.is_nan()),
        "parameter {p}: a place no piece brought"
    );
    Ok(out)
}

/// Trains `steps` steps (each of `micro` micro-steps) of `model` on one
/// rank, sharding after the first step at stage 3; returns the weights the
/// model computed with at each step after the first, and the fetcher's hits.
fn train(
    comm: ThreadComm,
    model: &Mlp,
    config: &EngineConfig,
    steps: usize,
) -> Result<(Vec<Vec<Vec<f64>>>, u64)> {
    let e: Engine<f64, ThreadComm> =
        engine(comm, model, make_opt(Opt::Adam, false), config.clone())?;
    let (seen, hits, _) = train_engine(e, model, steps)?;
    Ok((seen, hits))
}

/// What [`train_engine`] gives: the weights computed with at each step
/// after the first, the fetcher's hits, the memory report at the end.
type Trained = (Vec<Vec<Vec<f64>>>, u64, MemoryReport);

/// [`train`] on the engine `e`; also gives the memory report at the end.
fn train_engine<M: TestMemory>(
    mut e: Engine<f64, ThreadComm, M>,
    model: &Mlp,
    steps: usize,
) -> Result<Trained> {
    let rank = e.comm().rank();
    let config = e.config().clone();
    let micro = config.grad_accum_steps;
    let mut replica = model.init();
    let mut seen = Vec::new();
    for s in 0..steps {
        for m in 0..micro {
            let fetcher = e.fetcher().cloned();
            let weights = (0..replica.len())
                .map(|p| values(fetcher.as_ref(), &replica, p))
                .collect::<Result<Vec<_>>>()?;
            if m == 0 && s > 0 {
                seen.push(weights.clone());
            }
            let g = model.grads(&weights, rank, s * micro + m);
            e.step(&slots(&g), &mut replica)?;
        }
        if s == 0 && config.stage == Stage::Parameters {
            let gatherable = vec![true; replica.len()];
            let fetcher = e.shard_parameters(&gatherable, &mut replica)?;
            let sharded = (0..replica.len()).filter(|&p| fetcher.is_sharded(p));
            assert!(sharded.count() > 0, "nothing was sharded");
        }
    }
    let hits = e.fetcher().map_or(0, |f| f.stats().hits);
    Ok((seen, hits, e.memory_report()))
}

#[test]
fn stage_3_through_the_engine_trains_stage_2_s_weights() {
    let model = Mlp::new(&[6, 16, 12, 4]);
    let steps = 4;
    for world in 1..=3 {
        // Whole layers, and pieces of 32 elements.
        for gather_bytes in [1 << 20, 256] {
            for (micro, clip) in [(1, false), (2, true)] {
                let base = EngineConfig::default()
                    .with_bucket_bytes(128)
                    .with_grad_accum_steps(micro)
                    .with_persist_numel(20);
                let base = if clip {
                    base.with_clip(0.5, NormType::L2)
                } else {
                    base
                };
                let s2 = base.clone().with_stage(Stage::Gradients);
                let s3 = base
                    .with_stage(Stage::Parameters)
                    .with_gather_bytes(gather_bytes)
                    .with_prefetch_bytes(1 << 20);
                let expected = run(world, |comm| train(comm, &model, &s2, steps));
                let got = run(world, |comm| train(comm, &model, &s3, steps));
                let what = format!("N={world} gather_bytes={gather_bytes} micro={micro}");
                for ((want, _), (seen, hits)) in expected.iter().zip(&got) {
                    for (s, (w, g)) in want.iter().zip(seen).enumerate() {
                        assert_close(g, w, 1e-12, &format!("{what} step {}", s + 1));
                    }
                    // Every use after the first sharded pass replays the
                    // recorded order: the gather thread runs ahead.
                    assert!(*hits > 0, "{what}: no prefetch hit");
                }
            }
        }
    }
}

/// Hybrid sharding at stage 3: parameters sharded and gathered within
/// groups of two of four ranks train full sharding's weights.
#[test]
fn stage_3_in_groups_trains_the_weights_of_full_sharding() {
    let model = Mlp::new(&[6, 16, 12, 4]);
    let base = EngineConfig::default()
        .with_bucket_bytes(128)
        .with_grad_accum_steps(2)
        .with_clip(0.5, NormType::L2)
        .with_persist_numel(20)
        .with_stage(Stage::Parameters)
        .with_gather_bytes(256);
    let expected = run(4, |comm| train(comm, &model, &base, 4));
    let grouped = base.with_shard_group(2);
    let got = run(4, |comm| train(comm, &model, &grouped, 4));
    for (rank, ((want, _), (seen, _))) in expected.iter().zip(&got).enumerate() {
        for (s, (w, g)) in want.iter().zip(seen).enumerate() {
            assert_close(g, w, 1e-12, &format!("rank {rank} step {}", s + 1));
        }
    }
}

/// Offloaded (the parameter shard, i.e. the masters, in host memory and
/// stepped there; each gathered chunk brought up from it), stage 3 trains
/// the weights of stage 3 without offload, bit for bit. Host memory stands
/// in for the device.
#[test]
fn offloaded_stage_3_trains_the_weights_of_stage_3_on_the_device_alone() {
    let model = Mlp::new(&[6, 16, 12, 4]);
    for world in 1..=3 {
        for gather_bytes in [1 << 20, 256] {
            let config = EngineConfig::default()
                .with_stage(Stage::Parameters)
                .with_bucket_bytes(128)
                .with_grad_accum_steps(2)
                .with_clip(0.5, NormType::L2)
                .with_persist_numel(20)
                .with_gather_bytes(gather_bytes);
            let trained = |offload| {
                run(world, |comm| {
                    let e = Engine::with_memory(
                        comm,
                        OffloadMemory::new(HostMemory),
                        model.infos(),
                        make_opt(Opt::Adam, false),
                        config.clone().with_offload(offload, 1),
                    )?;
                    let (seen, _, report) = train_engine(e, &model, 4)?;
                    Ok((seen, report.offloaded))
                })
            };
            let (alone, offloaded) = (trained(Offload::None), trained(Offload::Optimizer));
            for (rank, ((want, none), (got, some))) in alone.iter().zip(&offloaded).enumerate() {
                let what = format!("N={world} gather_bytes={gather_bytes} rank {rank}");
                assert_eq!(got, want, "{what}: the weights differ");
                assert_eq!(*none, 0, "{what}: offloaded without offload");
                assert!(*some > 0, "{what}: nothing offloaded");
            }
        }
    }
}

/// A rank that dies between two gathers of a forward (its layers panic)
/// fails its peers' next gathers within the deadline: they return an
/// error naming it, never hang.
#[test]
fn a_rank_that_dies_mid_forward_fails_its_peers_gathers_within_the_deadline() {
    let model = Mlp::new(&[6, 16, 12, 4]);
    let deadline = std::time::Duration::from_secs(2);
    let config = EngineConfig::default()
        .with_stage(Stage::Parameters)
        .with_bucket_bytes(128)
        .with_persist_numel(20)
        .with_gather_bytes(256);
    let started = std::time::Instant::now();
    let results = ThreadGroup::new(3).with_timeout(deadline).run(|comm| {
        let rank = comm.rank();
        let mut e: Engine<f64, ThreadComm> =
            engine(comm, &model, make_opt(Opt::Adam, false), config.clone())?;
        let mut replica = model.init();
        let g = model.grads(&replica, rank, 0);
        e.step(&slots(&g), &mut replica)?;
        let fetcher = e.shard_parameters(&vec![true; replica.len()], &mut replica)?;
        let sharded: Vec<usize> = (0..replica.len())
            .filter(|&p| fetcher.is_sharded(p))
            .collect();
        for (k, &p) in sharded.iter().enumerate() {
            if rank == 1 && k == 1 {
                panic!("rank 1's layer fails mid-forward");
            }
            for piece in 0..fetcher.pieces(p) {
                let gathered = fetcher.acquire(p, piece)?;
                fetcher.release(gathered);
            }
        }
        Ok(())
    });
    let waited = started.elapsed();
    assert!(waited < deadline * 5, "the peers waited {waited:?}");
    for (rank, result) in results.into_iter().enumerate() {
        match (rank, result) {
            (1, Err(panicked)) => assert!(panicked.to_string().contains("mid-forward")),
            (_, Ok(Err(Error::PeerFailed { failed, .. }))) => assert_eq!(failed, vec![1]),
            (_, Ok(Err(Error::CollectiveTimeout { .. }))) => {}
            (rank, other) => panic!("rank {rank}: expected a failure naming rank 1, got {other:?}"),
        }
    }
}

/// Stage 3's gather budgets left unset are the memory's: host memory
/// gathers a 4 MiB layer in pieces of about 1 MiB (`GatherBudgets::HOST`);
/// set, they are the configuration's (`0`: whole layers).
#[test]
fn unset_gather_budgets_are_the_memory_s_and_set_ones_the_configuration_s() {
    // A 512 x 1024 f64 weight: 4 MiB.
    let model = Mlp::new(&[512, 1024, 4]);
    let pieces = |gather_bytes: Option<usize>| {
        let mut config = EngineConfig::default()
            .with_stage(Stage::Parameters)
            .with_persist_numel(20);
        config.gather_bytes = gather_bytes;
        let seen = run(1, |comm| {
            let mut e = engine(comm, &model, make_opt(Opt::Sgd, false), config.clone())?;
            let mut replica = model.init();
            let fetcher = e.shard_parameters(&vec![true; replica.len()], &mut replica)?;
            let largest = (0..replica.len())
                .max_by_key(|&p| replica[p].len())
                .expect("parameters");
            assert_eq!(replica[largest].len(), 512 * 1024);
            Ok(fetcher.pieces(largest))
        });
        seen[0]
    };
    let host = pieces(None);
    assert!((4..=5).contains(&host), "the host's 1 MiB pieces: {host}");
    assert_eq!(pieces(Some(0)), 1, "gather_bytes 0 gathers whole layers");
    let larger = pieces(Some(2 << 20));
    assert!(
        (2..host).contains(&larger),
        "2 MiB pieces: {larger}, 1 MiB: {host}"
    );
    assert_eq!(
        EngineConfig::default().gather_budgets(GatherBudgets::DEVICE),
        GatherBudgets::DEVICE
    );
}

/// On a memory posing as a device, stage 3 with no budget set gathers a
/// 4 MiB layer whole: one piece, one all-gather per bucket of it, where
/// host memory's budgets take four or five pieces and a collective per
/// bucket of each (a GEMM per piece on a device).
#[test]
fn a_device_gathers_a_layer_whole_when_no_budget_is_set() {
    let model = Mlp::new(&[512, 1024, 4]);
    let config = EngineConfig::default()
        .with_stage(Stage::Parameters)
        .with_persist_numel(20);
    let gathered = |device: bool| {
        let seen = Arc::new(Mutex::new(Seen::default()));
        let pieces = run(1, |comm| {
            let mut e = Engine::with_memory(
                comm,
                PlanCheck::new(seen.clone(), device),
                model.infos(),
                make_opt(Opt::Sgd, false),
                config.clone(),
            )?;
            let mut replica = model.init();
            let fetcher = e.shard_parameters(&vec![true; replica.len()], &mut replica)?;
            let largest = (0..replica.len())
                .max_by_key(|&p| replica[p].len())
                .expect("parameters");
            seen.lock().expect("no panic").gathers = 0;
            let whole = fetcher.gather_full(largest)?;
            assert_eq!(
                whole, replica[largest],
                "device {device}: the gathered layer"
            );
            Ok(fetcher.pieces(largest))
        })[0];
        let collectives = seen.lock().expect("no panic").gathers;
        (pieces, collectives)
    };
    let (host_pieces, host_collectives) = gathered(false);
    let (device_pieces, device_collectives) = gathered(true);
    assert!((4..=5).contains(&host_pieces), "host: {host_pieces} pieces");
    assert_eq!(device_pieces, 1, "device: the layer in one piece");
    assert!(
        device_collectives < host_collectives,
        "device: {device_collectives} all-gathers, host: {host_collectives}"
    );
}
