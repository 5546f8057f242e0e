//! Several ranks on one GPU (`CudaThreadGroup`): every collective gives the
//! thread backend's result bit for bit (both combine the ranks in rank
//! order, 16-bit types in f32), refusals and dead peers fail every rank
//! within the deadline, and the engine over CUDA memory at 1 to 4 ranks
//! trains the weights of the host engine on the thread backend.
//!
//! The plan of each collective (which rank copies or reduces what) is
//! tested without a GPU in `src/local/collective.rs`. These need a GPU:
//! `cargo test -p zero-nccl --features nccl -- --ignored` on a GPU machine.
#![cfg(feature = "nccl")]

use half::bf16;
use rand::{Rng, SeedableRng};
use std::sync::Arc;
use std::time::{Duration, Instant};
use zero_core::engine::{EngineConfig, HostGrad, NormType, Stage, UnitBucket};
use zero_core::optim::{AdamW, AdamWConfig, FunctionalOptimizer};
use zero_core::{Communicator, DType, Element, Engine, Error, ParamInfo, ReduceOp, ThreadGroup};
use zero_nccl::cudarc::driver::{CudaSlice, CudaStream, DeviceRepr};
use zero_nccl::{cuda_engine, CudaThreadComm, CudaThreadGroup, DeviceComm, DeviceView};

const OPS: [ReduceOp; 5] = [
    ReduceOp::Sum,
    ReduceOp::Avg,
    ReduceOp::Max,
    ReduceOp::Min,
    ReduceOp::Product,
];

fn values<T: Element>(rank: usize, len: usize, salt: u64) -> Vec<T> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(salt * 1000 + rank as u64);
    (0..len)
        .map(|_| T::from_f64(rng.gen_range(-3.0..3.0)))
        .collect()
}

fn expect_ok<R>(results: Vec<zero_core::Result<R>>) -> Vec<R> {
    results
        .into_iter()
        .enumerate()
        .map(|(rank, r)| r.unwrap_or_else(|e| panic!("rank {rank}: {e}")))
        .collect()
}

fn on_gpu<R: Send>(n: usize, f: impl Fn(CudaThreadComm) -> zero_core::Result<R> + Sync) -> Vec<R> {
    let group = CudaThreadGroup::new(n);
    expect_ok(
        group
            .run(f)
            .unwrap_or_else(|e| panic!("this test needs a CUDA GPU: {e}")),
    )
}

fn on_threads<R: Send>(
    n: usize,
    f: impl Fn(zero_core::ThreadComm) -> zero_core::Result<R> + Sync,
) -> Vec<R> {
    expect_ok(
        ThreadGroup::new(n)
            .run(f)
            .into_iter()
            .map(|r| r.and_then(|r| r))
            .collect(),
    )
}

fn up<T: Element + DeviceRepr>(comm: &CudaThreadComm, v: &[T]) -> CudaSlice<T> {
    comm.compute_stream().clone_htod(v).unwrap()
}

/// Each of `values` copied to the device on `stream`.
fn upload(stream: &Arc<CudaStream>, values: &[Vec<f32>]) -> Vec<CudaSlice<f32>> {
    values
        .iter()
        .map(|v| stream.clone_htod(v).unwrap())
        .collect()
}

fn down<T: Element + DeviceRepr>(comm: &CudaThreadComm, v: &CudaSlice<T>) -> Vec<T> {
    comm.compute_stream().clone_dtoh(v).unwrap()
}

/// Every collective at world sizes 1 to 4 against the thread backend, bit
/// for bit, in element type `T`.
fn collectives_match<T: Element + DeviceRepr + PartialEq + std::fmt::Debug>() {
    let len = 1031;
    for n in 1..=4 {
        for (k, op) in OPS.into_iter().enumerate() {
            let salt = k as u64;
            let gpu = on_gpu(n, |c| {
                let r = c.rank();
                let mut all = up(&c, &values::<T>(r, len, salt));
                c.all_reduce(&mut all, op)?;
                let send = up(&c, &values::<T>(r, n * len, salt));
                let mut scattered = up(&c, &vec![T::from_f64(0.0); len]);
                c.reduce_scatter(&send, &mut scattered, op)?;
                let mut reduced = up(&c, &values::<T>(r, len, salt));
                c.reduce(&mut reduced, op, n - 1)?;
                Ok((down(&c, &all), down(&c, &scattered), down(&c, &reduced)))
            });
            let host = on_threads(n, |c| {
                let r = c.rank();
                let mut all = values::<T>(r, len, salt);
                c.all_reduce(&mut all, op)?;
                let mut scattered = vec![T::from_f64(0.0); len];
                c.reduce_scatter(&values::<T>(r, n * len, salt), &mut scattered, op)?;
                let mut reduced = values::<T>(r, len, salt);
                c.reduce(&mut reduced, op, n - 1)?;
                Ok((all, scattered, reduced))
            });
            for r in 0..n {
                assert_eq!(gpu[r].0, host[r].0, "all_reduce {op:?} n={n} rank {r}");
                assert_eq!(gpu[r].1, host[r].1, "reduce_scatter {op:?} n={n} rank {r}");
            }
            assert_eq!(gpu[n - 1].2, host[n - 1].2, "reduce {op:?} n={n}");
        }
        let counts: Vec<usize> = (0..n).map(|r| [3, 1, 17, 5][r]).collect();
        let total: usize = counts.iter().sum();
        let counts = &counts;
        let gpu = on_gpu(n, |c| {
            let r = c.rank();
            let send = up(&c, &values::<T>(r, len, 9));
            let mut gathered = up(&c, &vec![T::from_f64(0.0); n * len]);
            c.all_gather(&send, &mut gathered)?;
            let mut cast = up(&c, &values::<T>(r, len, 10));
            c.broadcast(&mut cast, 0)?;
            let mine = up(&c, &values::<T>(r, counts[r], 11));
            let mut varlen = up(&c, &vec![T::from_f64(0.0); total]);
            c.all_gather_varlen(&mine, counts, &mut varlen)?;
            let mut to_root = up(&c, &vec![T::from_f64(0.0); total]);
            c.gather_varlen(&mine, counts, (r == n - 1).then_some(&mut to_root), n - 1)?;
            Ok((
                down(&c, &gathered),
                down(&c, &cast),
                down(&c, &varlen),
                down(&c, &to_root),
            ))
        });
        let host = on_threads(n, |c| {
            let r = c.rank();
            let mut gathered = vec![T::from_f64(0.0); n * len];
            c.all_gather(&values::<T>(r, len, 9), &mut gathered)?;
            let mut cast = values::<T>(r, len, 10);
            c.broadcast(&mut cast, 0)?;
            let mine = values::<T>(r, counts[r], 11);
            let mut varlen = vec![T::from_f64(0.0); total];
            c.all_gather_varlen(&mine, counts, &mut varlen)?;
            let mut to_root = vec![T::from_f64(0.0); total];
            c.gather_varlen(
                &mine,
                counts,
                (r == n - 1).then_some(&mut to_root[..]),
                n - 1,
            )?;
            Ok((gathered, cast, varlen, to_root))
        });
        for r in 0..n {
            assert_eq!(gpu[r].0, host[r].0, "all_gather n={n} rank {r}");
            assert_eq!(gpu[r].1, host[r].1, "broadcast n={n} rank {r}");
            assert_eq!(gpu[r].2, host[r].2, "all_gather_varlen n={n} rank {r}");
        }
        assert_eq!(gpu[n - 1].3, host[n - 1].3, "gather_varlen n={n}");
    }
}

/// A stage-3 layer's buckets per rank (one empty), as `DeviceGathers`
/// gathers them, and the gap left in the buffer after the first.
const BUCKETS: [usize; 3] = [5, 0, 11];
const GAP: usize = 3;

/// The buckets' places: each rank's chunks one after another in the
/// shard; every rank's, in rank order, in the buffer.
fn unit_buckets(n: usize) -> (Vec<UnitBucket>, usize) {
    let (mut shard, mut at) = (0, 0);
    let buckets = BUCKETS
        .iter()
        .enumerate()
        .map(|(k, &len)| {
            let bucket = UnitBucket {
                shard: shard..shard + len,
                at: at..at + n * len,
            };
            shard += len;
            at += n * len + if k == 0 { GAP } else { 0 };
            bucket
        })
        .collect();
    (buckets, at)
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_layer_s_buckets_gather_in_one_pass_as_bucket_by_bucket() {
    for n in 1..=4 {
        let gpu = on_gpu(n, |c| {
            let r = c.rank();
            let (buckets, len) = unit_buckets(n);
            let shard = up(&c, &values::<f32>(r, BUCKETS.iter().sum(), 12));
            let mut gathered = up(&c, &vec![-1.0f32; len]);
            let done = c.all_gather_buckets_event(&shard, &mut gathered, &buckets)?;
            c.compute_stream().wait(&done).unwrap();
            // In place: each rank's slot of each place holds its chunk.
            let mut in_place = vec![-1.0f32; len];
            let mine = values::<f32>(r, BUCKETS.iter().sum(), 12);
            for bucket in &buckets {
                let slot = bucket.at.start + r * bucket.shard.len();
                in_place[slot..slot + bucket.shard.len()]
                    .copy_from_slice(&mine[bucket.shard.clone()]);
            }
            let mut in_place = up(&c, &in_place);
            let done = c.all_gather_buckets_in_place_event(&mut in_place, &buckets)?;
            c.compute_stream().wait(&done).unwrap();
            Ok((down(&c, &gathered), down(&c, &in_place)))
        });
        let host = on_threads(n, |c| {
            let (buckets, len) = unit_buckets(n);
            let mine = values::<f32>(c.rank(), BUCKETS.iter().sum(), 12);
            let mut gathered = vec![-1.0f32; len];
            for bucket in &buckets {
                c.all_gather(
                    &mine[bucket.shard.clone()],
                    &mut gathered[bucket.at.clone()],
                )?;
            }
            Ok(gathered)
        });
        for r in 0..n {
            assert_eq!(gpu[r].0, host[r], "n={n} rank {r}");
            assert_eq!(gpu[r].1, host[r], "in place, n={n} rank {r}");
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn collectives_give_the_thread_backend_s_results_bitwise_f32() {
    collectives_match::<f32>();
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn collectives_give_the_thread_backend_s_results_bitwise_bf16_and_f64() {
    collectives_match::<bf16>();
    collectives_match::<f64>();
}

#[test]
fn a_missing_driver_or_gpu_is_an_error_not_a_panic() {
    let count = zero_nccl::cuda_device_count();
    let group = CudaThreadGroup::on_devices(2, &[0, 1_000]);
    let err = group
        .run(|_| Ok(()))
        .expect_err("GPU 1000 does not exist, whatever the machine");
    match count {
        Err(_) => assert!(err.to_string().contains("libcuda.so not found"), "{err}"),
        Ok(n) => assert!(
            err.to_string().contains(&format!("reports {n} GPU(s)")),
            "{err}"
        ),
    }
    assert!(CudaThreadGroup::new(0).communicators().is_err());
    assert!(CudaThreadGroup::new(17).communicators().is_err());
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn different_calls_fail_every_rank_with_a_mismatch() {
    let results = CudaThreadGroup::new(3)
        .run(|c| {
            let len = if c.rank() == 2 { 9 } else { 8 };
            let mut buf = up(&c, &vec![1.0f32; len]);
            c.all_reduce(&mut buf, ReduceOp::Sum)
        })
        .unwrap_or_else(|e| panic!("this test needs a CUDA GPU: {e}"));
    for (rank, r) in results.into_iter().enumerate() {
        match r {
            Err(Error::CollectiveMismatch { .. }) => {}
            other => panic!("rank {rank}: expected a mismatch, got {other:?}"),
        }
    }
    // A refused argument fails the peers at once, naming the rank.
    let results = CudaThreadGroup::new(2)
        .run(|c| {
            let send = up(&c, &[1.0f32; 8]);
            let mut recv = up(&c, &vec![0.0f32; if c.rank() == 1 { 3 } else { 4 }]);
            c.reduce_scatter(&send, &mut recv, ReduceOp::Sum)
        })
        .unwrap();
    assert!(
        matches!(results[1], Err(Error::BufferSize { .. })),
        "{:?}",
        results[1]
    );
    match &results[0] {
        Err(Error::PeerFailed { failed, .. }) => assert_eq!(failed, &vec![1]),
        other => panic!("expected rank 1's failure, got {other:?}"),
    }
}

/// Of three ranks with a 20 s deadline, rank 1 panicked and its peers
/// failed naming it, well within the deadline of `start`.
fn assert_rank_1_failed_its_peers<R: std::fmt::Debug>(
    results: &[zero_core::Result<R>],
    start: Instant,
) {
    assert!(
        start.elapsed() < Duration::from_secs(15),
        "{:?}",
        start.elapsed()
    );
    assert!(matches!(
        results[1],
        Err(Error::RankPanicked { rank: 1, .. })
    ));
    for rank in [0, 2] {
        match &results[rank] {
            Err(Error::PeerFailed { failed, .. }) => assert_eq!(failed, &vec![1]),
            other => panic!("rank {rank}: expected rank 1's failure, got {other:?}"),
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_rank_that_panics_fails_its_peers_within_the_deadline() {
    let start = Instant::now();
    let results = CudaThreadGroup::new(3)
        .with_timeout(Duration::from_secs(20))
        .run(|c| {
            let mut buf = up(&c, &vec![1.0f32; 64]);
            c.all_reduce(&mut buf, ReduceOp::Sum)?;
            if c.rank() == 1 {
                panic!("rank 1 dies between collectives");
            }
            c.all_reduce(&mut buf, ReduceOp::Sum)?;
            Ok(())
        })
        .unwrap();
    assert_rank_1_failed_its_peers(&results, start);
}

fn params() -> Vec<ParamInfo> {
    vec![
        ParamInfo::new("a.bias", vec![7], DType::F32),
        ParamInfo::new("a.weight", vec![7, 13], DType::F32),
        ParamInfo::new("b.weight", vec![300], DType::F32),
        ParamInfo::new("c.frozen", vec![5], DType::F32).with_trainable(false),
    ]
}

/// Initial weights (the same on every rank) and per-rank, per-step gradients.
fn data(rank: usize, steps: usize) -> (Vec<Vec<f32>>, Vec<Vec<Vec<f32>>>) {
    let mut rng = rand::rngs::StdRng::seed_from_u64(3);
    let init = params()
        .iter()
        .map(|p| (0..p.numel()).map(|_| rng.gen_range(-1.0..1.0)).collect())
        .collect();
    let mut rng = rand::rngs::StdRng::seed_from_u64(100 + rank as u64);
    let grads = (0..steps)
        .map(|_| {
            params()
                .iter()
                .map(|p| (0..p.numel()).map(|_| rng.gen_range(-1.0..1.0)).collect())
                .collect()
        })
        .collect();
    (init, grads)
}

fn adamw() -> Box<dyn FunctionalOptimizer<f32>> {
    Box::new(AdamW::new(AdamWConfig::default().with_lr(1e-2)).unwrap())
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn the_engine_on_ranks_sharing_a_gpu_trains_the_host_engine_s_weights() {
    let steps = 5;
    for n in 1..=4 {
        for stage in [Stage::Ddp, Stage::OptimizerState, Stage::Gradients] {
            for accumulate in [1, 2] {
                let config = EngineConfig::default()
                    .with_stage(stage)
                    .with_bucket_bytes(256)
                    .with_clip(0.5, NormType::L2);
                let host = on_threads(n, |comm| {
                    let (mut weights, grads) = data(comm.rank(), steps);
                    let mut engine = Engine::new(comm, params(), adamw(), config.clone())?;
                    for (s, step) in grads.iter().enumerate() {
                        let slots: Vec<Option<HostGrad<'_, f32>>> =
                            step.iter().map(|g| Some(HostGrad::from(&g[..]))).collect();
                        if accumulate == 2 && s % 2 == 0 {
                            engine.accumulate(&slots)?;
                        } else {
                            engine.step(&slots, &mut weights)?;
                        }
                    }
                    Ok(weights)
                });
                let gpu = on_gpu(n, |comm| {
                    let stream = comm.compute_stream().clone();
                    let (init, grads) = data(comm.rank(), steps);
                    let mut engine = cuda_engine(comm, params(), adamw(), config.clone())?;
                    let mut weights: Vec<CudaSlice<f32>> = upload(&stream, &init);
                    for (s, step) in grads.iter().enumerate() {
                        let device: Vec<CudaSlice<f32>> = upload(&stream, step);
                        let slots: Vec<Option<DeviceView<'_>>> =
                            device.iter().map(|g| Some(g.into())).collect();
                        if accumulate == 2 && s % 2 == 0 {
                            engine.accumulate(&slots)?;
                        } else {
                            engine.step(&slots, &mut weights)?;
                        }
                    }
                    Ok(weights
                        .iter()
                        .map(|w| stream.clone_dtoh(w).unwrap())
                        .collect::<Vec<_>>())
                });
                for r in 0..n {
                    for (i, (d, h)) in gpu[r].iter().zip(&host[r]).enumerate() {
                        for (j, (x, y)) in d.iter().zip(h).enumerate() {
                            assert!(
                                (x - y).abs() <= 1e-5 * (1.0 + y.abs()),
                                "n={n} {stage:?} accumulate {accumulate}: rank {r} \
                                 parameter {i} element {j}: gpu {x}, host {y}"
                            );
                        }
                    }
                }
            }
        }
    }
}

/// Stage 3 through the engine over CUDA memory: the sharded parameters'
/// values, gathered piece by piece on the gathers' own stream (the compute
/// stream waiting per piece), follow the host engine's stage 3 on the
/// thread backend (`zero-core`'s `engine_stage3` test drives the host side
/// the same way), and the gathers run ahead of their use.
#[test]
#[ignore = "needs a CUDA GPU"]
fn stage_3_on_ranks_sharing_a_gpu_gathers_the_host_engine_s_weights() {
    let steps = 4;
    let infos = params();
    for n in 1..=4 {
        // Whole parameters, and pieces of 64 elements.
        for gather_bytes in [1 << 20, 256] {
            let config = EngineConfig::default()
                .with_stage(Stage::Parameters)
                .with_bucket_bytes(256)
                .with_persist_numel(10)
                .with_gather_bytes(gather_bytes)
                .with_prefetch_bytes(1 << 20);
            let gatherable = vec![true; infos.len()];
            let host = on_threads(n, |comm| {
                let (mut weights, grads) = data(comm.rank(), steps);
                let mut engine = Engine::new(comm, params(), adamw(), config.clone())?;
                let mut seen = Vec::new();
                for (s, step) in grads.iter().enumerate() {
                    let slots: Vec<Option<HostGrad<'_, f32>>> =
                        step.iter().map(|g| Some(HostGrad::from(&g[..]))).collect();
                    engine.step(&slots, &mut weights)?;
                    if s == 0 {
                        engine.shard_parameters(&gatherable, &mut weights)?;
                    }
                    let fetcher = engine.fetcher().expect("sharded").clone();
                    let mut values = Vec::new();
                    for (p, replica) in weights.iter().enumerate() {
                        let mut out = replica.clone();
                        for piece in 0..fetcher.pieces(p) {
                            let g = fetcher.acquire(p, piece)?;
                            for (at, places) in g.spans() {
                                let gathered = g.buffer().as_wide().expect("f32 gathered in f32");
                                out[places.clone()].copy_from_slice(&gathered[at.clone()]);
                            }
                            fetcher.release(g);
                        }
                        values.push(out);
                    }
                    seen.push(values);
                }
                Ok(seen)
            });
            let gpu = on_gpu(n, |comm| {
                let stream = comm.compute_stream().clone();
                let (init, grads) = data(comm.rank(), steps);
                let mut engine = cuda_engine(comm, params(), adamw(), config.clone())?;
                let mut weights: Vec<CudaSlice<f32>> = upload(&stream, &init);
                let mut seen = Vec::new();
                for (s, step) in grads.iter().enumerate() {
                    let device: Vec<CudaSlice<f32>> = upload(&stream, step);
                    let slots: Vec<Option<DeviceView<'_>>> =
                        device.iter().map(|g| Some(g.into())).collect();
                    engine.step(&slots, &mut weights)?;
                    if s == 0 {
                        engine.shard_parameters(&gatherable, &mut weights)?;
                    }
                    let fetcher = engine.fetcher().expect("sharded").clone();
                    let mut values = Vec::new();
                    for (p, replica) in weights.iter().enumerate() {
                        let mut out = stream.clone_dtoh(replica).unwrap();
                        for piece in 0..fetcher.pieces(p) {
                            let g = fetcher.acquire(p, piece)?;
                            for (at, places) in g.spans() {
                                let zero_nccl::GatherValues::F32(gathered) = g.buffer().values()
                                else {
                                    panic!("an f32 model gathers in f32");
                                };
                                let part = gathered.slice(at.clone());
                                out[places.clone()]
                                    .copy_from_slice(&stream.clone_dtoh(&part).unwrap());
                            }
                            fetcher.release(g);
                        }
                        values.push(out);
                    }
                    seen.push(values);
                }
                let stats = engine.fetcher().expect("sharded").stats();
                assert!(stats.hits > 0, "no gather ran ahead of its use: {stats:?}");
                Ok(seen)
            });
            for r in 0..n {
                for (s, (d, h)) in gpu[r].iter().zip(&host[r]).enumerate() {
                    for (p, (x, y)) in d.iter().zip(h).enumerate() {
                        for (j, (x, y)) in x.iter().zip(y).enumerate() {
                            assert!(
                                (x - y).abs() <= 1e-5 * (1.0 + y.abs()),
                                "n={n} gather_bytes={gather_bytes}: rank {r} step {s} \
                                 parameter {p} ({}) element {j}: gpu {x}, host {y}",
                                infos[p].name
                            );
                        }
                    }
                }
            }
        }
    }
}

/// Stage 3 on the GPU: a rank that dies between two gathers of a forward
/// fails its peers' next gathers (queued on their gather streams) within
/// the deadline, naming it.
#[test]
#[ignore = "needs a CUDA GPU"]
fn a_rank_that_dies_mid_forward_fails_its_peers_stage_3_gathers() {
    let start = Instant::now();
    let config = EngineConfig::default()
        .with_stage(Stage::Parameters)
        .with_bucket_bytes(256)
        .with_persist_numel(10)
        .with_gather_bytes(256);
    let results = CudaThreadGroup::new(3)
        .with_timeout(Duration::from_secs(20))
        .run(|comm| {
            let rank = comm.rank();
            let stream = comm.compute_stream().clone();
            let (init, grads) = data(rank, 1);
            let mut engine = cuda_engine(comm, params(), adamw(), config.clone())?;
            let mut weights: Vec<CudaSlice<f32>> = upload(&stream, &init);
            let device: Vec<CudaSlice<f32>> = upload(&stream, &grads[0]);
            let slots: Vec<Option<DeviceView<'_>>> =
                device.iter().map(|g| Some(g.into())).collect();
            engine.step(&slots, &mut weights)?;
            let fetcher = engine.shard_parameters(&vec![true; weights.len()], &mut weights)?;
            let sharded: Vec<usize> = (0..weights.len())
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
            // What was queued must have run: read one value back.
            fetcher.gather_full(sharded[0])?;
            Ok(())
        })
        .unwrap();
    assert_rank_1_failed_its_peers(&results, start);
}
