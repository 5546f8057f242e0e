//! Every collective of the thread backend against a sequential reference
//! that adds in rank order with the same accumulation, for N = 1..8, every
//! dtype, and sizes including 0 and sizes smaller than N. Also async
//! overlap, subgroups and the bytes_sent cost model.

use half::{bf16, f16};
use rand::{rngs::StdRng, Rng, SeedableRng};
use std::time::{Duration, Instant};
use zero_core::prelude::*;
use zero_core::ThreadComm;

const OPS: [ReduceOp; 5] = [
    ReduceOp::Sum,
    ReduceOp::Avg,
    ReduceOp::Max,
    ReduceOp::Min,
    ReduceOp::Product,
];

/// Deterministic data of `rank` for test case `case`.
fn data<T: Element>(case: u64, rank: usize, len: usize) -> Vec<T> {
    let mut rng = StdRng::seed_from_u64(case * 1009 + rank as u64);
    (0..len)
        .map(|_| T::from_f64(rng.gen_range(-2.0..2.0)))
        .collect()
}

/// Rounds to the accumulator's precision: an f64 operation on two f32
/// values rounded to f32 equals the f32 operation.
fn round_acc<T: Element>(v: f64) -> f64 {
    if T::DTYPE == DType::F64 {
        v
    } else {
        v as f32 as f64
    }
}

/// The reduction of `inputs` in rank order.
fn reference<T: Element>(inputs: &[Vec<T>], op: ReduceOp) -> Vec<T> {
    let n = inputs.len();
    (0..inputs[0].len())
        .map(|i| {
            let mut acc = inputs[0][i].to_f64();
            for input in &inputs[1..] {
                let x = input[i].to_f64();
                acc = round_acc::<T>(match op {
                    ReduceOp::Sum | ReduceOp::Avg => acc + x,
                    ReduceOp::Product => acc * x,
                    ReduceOp::Max => acc.max(x),
                    ReduceOp::Min => acc.min(x),
                });
            }
            if op == ReduceOp::Avg {
                acc = round_acc::<T>(acc / n as f64);
            }
            from_acc::<T>(acc)
        })
        .collect()
}

/// Rounds the accumulator to `T` the way `Element::from_acc` does: 16-bit
/// types round from f32 (`half` rounds some f64 subnormals differently).
fn from_acc<T: Element>(acc: f64) -> T {
    match T::DTYPE {
        DType::BF16 => bytemuck::cast(bf16::from_f32(acc as f32)),
        DType::F16 => bytemuck::cast(f16::from_f32(acc as f32)),
        _ => T::from_f64(acc),
    }
}

fn bits<T: Element>(v: &[T]) -> &[u8] {
    bytemuck::cast_slice(v)
}

fn sizes(n: usize) -> Vec<usize> {
    let mut s = vec![0, 1, n.saturating_sub(1), n, n + 1, 37, 1031];
    s.dedup();
    s
}

/// Runs every collective on `comm` and checks the results.
fn check_dtype<T: Element>(comm: &ThreadComm, case0: u64) -> Result<()> {
    let n = comm.world_size();
    let rank = comm.rank();
    let all = |case: u64, len: usize| (0..n).map(|r| data::<T>(case, r, len)).collect::<Vec<_>>();
    for (si, len) in sizes(n).into_iter().enumerate() {
        let case = case0 * 100 + si as u64 * 10;
        for (oi, op) in OPS.into_iter().enumerate() {
            let case = case + oi as u64;
            // all_reduce
            let inputs = all(case, len);
            let expected = reference(&inputs, op);
            let mut buf = inputs[rank].clone();
            comm.all_reduce(&mut buf, op)?;
            assert_eq!(bits(&buf), bits(&expected), "all_reduce {op:?} len {len}");
            // all_reduce_async gives the same bits
            let mut buf = inputs[rank].clone();
            comm.all_reduce_async(&mut buf, op)?.wait()?;
            assert_eq!(bits(&buf), bits(&expected), "all_reduce_async {op:?}");

            // reduce_scatter with `len` elements per rank
            let inputs = all(case + 5000, n * len);
            let expected = reference(&inputs, op);
            let mine = &expected[rank * len..(rank + 1) * len];
            let mut recv = vec![T::default(); len];
            comm.reduce_scatter(&inputs[rank], &mut recv, op)?;
            assert_eq!(bits(&recv), bits(mine), "reduce_scatter {op:?} len {len}");
            let mut recv = vec![T::default(); len];
            comm.reduce_scatter_async(&inputs[rank], &mut recv, op)?
                .wait()?;
            assert_eq!(bits(&recv), bits(mine), "reduce_scatter_async {op:?}");

            // reduce to a root
            let root = (case as usize) % n;
            let inputs = all(case + 7000, len);
            let mut buf = inputs[rank].clone();
            comm.reduce(&mut buf, op, root)?;
            if rank == root {
                assert_eq!(bits(&buf), bits(&reference(&inputs, op)), "reduce {op:?}");
            } else {
                assert_eq!(bits(&buf), bits(&inputs[rank]), "reduce left non-root");
            }
        }

        // all_gather
        let inputs = all(case + 1, len);
        let expected: Vec<T> = inputs.concat();
        let mut recv = vec![T::default(); n * len];
        comm.all_gather(&inputs[rank], &mut recv)?;
        assert_eq!(bits(&recv), bits(&expected), "all_gather len {len}");
        let mut recv = vec![T::default(); n * len];
        comm.all_gather_async(&inputs[rank], &mut recv)?.wait()?;
        assert_eq!(bits(&recv), bits(&expected), "all_gather_async");

        // broadcast from every root
        for root in 0..n {
            let inputs = all(case + 2 + root as u64, len);
            let mut buf = inputs[rank].clone();
            comm.broadcast(&mut buf, root)?;
            assert_eq!(bits(&buf), bits(&inputs[root]), "broadcast root {root}");
            let mut buf = inputs[rank].clone();
            comm.broadcast_async(&mut buf, root)?.wait()?;
            assert_eq!(bits(&buf), bits(&inputs[root]), "broadcast_async");
        }

        // variable-length gathers, with some zero counts
        let mut rng = StdRng::seed_from_u64(case);
        let counts: Vec<usize> = (0..n)
            .map(|_| {
                if rng.gen_bool(0.3) {
                    0
                } else {
                    rng.gen_range(0..=len)
                }
            })
            .collect();
        let inputs: Vec<Vec<T>> = (0..n).map(|r| data::<T>(case + 3, r, counts[r])).collect();
        let expected: Vec<T> = inputs.concat();
        let total = expected.len();
        let mut recv = vec![T::default(); total];
        comm.all_gather_varlen(&inputs[rank], &counts, &mut recv)?;
        assert_eq!(bits(&recv), bits(&expected), "all_gather_varlen {counts:?}");
        let root = n - 1;
        let mut recv = vec![T::default(); total];
        let target = (rank == root).then_some(&mut recv[..]);
        comm.gather_varlen(&inputs[rank], &counts, target, root)?;
        if rank == root {
            assert_eq!(bits(&recv), bits(&expected), "gather_varlen {counts:?}");
        }
    }
    Ok(())
}

#[test]
fn every_collective_matches_the_reference() {
    for n in 1..=8 {
        let results = ThreadGroup::new(n)
            .with_timeout(Duration::from_secs(30))
            .run(|comm| -> Result<()> {
                check_dtype::<f32>(&comm, 1)?;
                check_dtype::<f64>(&comm, 2)?;
                check_dtype::<bf16>(&comm, 3)?;
                check_dtype::<f16>(&comm, 4)?;
                // all_gather_bytes with different lengths per rank
                let mine = vec![comm.rank() as u8; comm.rank() * 3];
                let gathered = comm.all_gather_bytes(&mine)?;
                for (r, g) in gathered.iter().enumerate() {
                    assert_eq!(g, &vec![r as u8; r * 3]);
                }
                comm.barrier()
            });
        for (rank, r) in results.into_iter().enumerate() {
            match r {
                Ok(Ok(())) => {}
                other => panic!("N={n} rank {rank}: {other:?}"),
            }
        }
    }
}

#[test]
fn sixteen_bit_sums_accumulate_in_f32() {
    // 1 + 7 * 2^-8 in bf16: rounding to bf16 after each addition would lose
    // every 2^-8 (bf16 has 8 bits of precision).
    let results = ThreadGroup::new(8).run(|comm| {
        let v = if comm.rank() == 0 { 1.0 } else { 1.0 / 256.0 };
        let mut buf = [bf16::from_f32(v)];
        comm.all_reduce(&mut buf, ReduceOp::Sum).map(|()| buf[0])
    });
    for r in results {
        let got = r.unwrap().unwrap();
        assert_eq!(got, bf16::from_f32(1.0 + 7.0 / 256.0));
    }
}

#[test]
fn async_collectives_overlap_with_compute() {
    let len = 1 << 18;
    let results = ThreadGroup::new(3).run(|comm| -> Result<(usize, f64)> {
        let rank = comm.rank();
        let mut grads = vec![rank as f32 + 1.0; len];
        let mut shard = vec![0.0f32; len / 4];
        let params = vec![rank as f32; len / 4];
        let mut gathered = vec![0.0f32; 3 * len / 4];
        if rank == 2 {
            // Make the others see an incomplete collective first; long
            // enough that a blocking test() would show next to scheduling
            // noise.
            std::thread::sleep(Duration::from_millis(1000));
        }
        let mut not_ready = 0;
        let mut slowest_test = 0.0f64;
        {
            let mut work = comm.all_reduce_async(&mut grads, ReduceOp::Avg)?;
            let mut ag = comm.all_gather_async(&params, &mut gathered)?;
            // Compute while communication is in flight.
            let mut acc = 0.0f64;
            loop {
                for i in 0..10_000 {
                    acc += (i as f64).sqrt();
                }
                let t = Instant::now();
                let done = work.test()?;
                slowest_test = slowest_test.max(t.elapsed().as_secs_f64());
                if done {
                    break;
                }
                not_ready += 1;
            }
            assert!(acc > 0.0);
            while !ag.test()? {}
            work.wait()?;
            ag.wait()?;
        }
        assert!(grads.iter().all(|&g| g == 2.0), "avg of 1, 2, 3");
        for r in 0..3 {
            assert!(gathered[r * len / 4..(r + 1) * len / 4]
                .iter()
                .all(|&x| x == r as f32));
        }
        let grads_copy = vec![rank as f32; len];
        comm.reduce_scatter_async(&grads_copy[..3 * len / 4], &mut shard, ReduceOp::Sum)?
            .wait()?;
        assert!(shard.iter().all(|&x| x == 3.0), "0 + 1 + 2");
        Ok((not_ready, slowest_test))
    });
    for (rank, r) in results.into_iter().enumerate() {
        let (not_ready, slowest_test) = r.unwrap().unwrap();
        if rank != 2 {
            assert!(
                not_ready > 0,
                "rank {rank} should have seen the work pending"
            );
        }
        assert!(slowest_test < 0.5, "test() blocked for {slowest_test} s");
    }
}

#[test]
fn subgroup_of_ranks_0_and_2() {
    let results = ThreadGroup::new(4).run(|comm| -> Result<Option<f32>> {
        let sub = comm.split(&[0, 2])?;
        let out = match &sub {
            Some(sub) => {
                assert_eq!(sub.world_size(), 2);
                assert_eq!(sub.rank(), comm.rank() / 2);
                assert_eq!(sub.next_seq(), 0, "a subgroup has its own sequence numbers");
                let mut x = [comm.rank() as f32 + 1.0; 5];
                for _ in 0..3 {
                    sub.all_reduce(&mut x, ReduceOp::Sum)?;
                }
                let gathered = sub.all_gather_bytes(&[comm.rank() as u8])?;
                assert_eq!(gathered, vec![vec![0u8], vec![2u8]]);
                Some(x[0])
            }
            None => None,
        };
        comm.barrier()?;
        Ok(out)
    });
    let got: Vec<Option<f32>> = results.into_iter().map(|r| r.unwrap().unwrap()).collect();
    // (1 + 3) -> 8 -> 16 after three sums.
    assert_eq!(got, vec![Some(16.0), None, Some(16.0), None]);
}

#[test]
fn subgroup_member_leaving_fails_its_peer() {
    let results = ThreadGroup::new(4)
        .with_timeout(Duration::from_secs(30))
        .run(|comm| -> Result<()> {
            let sub = comm.split(&[0, 2])?;
            if let Some(sub) = sub {
                if comm.rank() == 2 {
                    drop(sub);
                    return Ok(());
                }
                let t = Instant::now();
                let err = sub.barrier().unwrap_err();
                assert!(t.elapsed() < Duration::from_secs(5));
                assert!(
                    matches!(&err, Error::PeerFailed { op: "barrier", seq: 0, failed, .. } if failed == &[1]),
                    "{err}"
                );
            }
            Ok(())
        });
    for r in results {
        r.unwrap().unwrap();
    }
}

#[test]
fn bytes_sent_follows_the_ring_model() {
    let results = ThreadGroup::new(4).run(|comm| -> Result<Vec<u64>> {
        let mut seen = Vec::new();
        let mut buf = vec![1.0f32; 1000]; // 4000 bytes
        comm.all_reduce(&mut buf, ReduceOp::Sum)?;
        seen.push(comm.bytes_sent());
        let send = vec![1.0f32; 400]; // 1600 bytes
        let mut recv = vec![0.0f32; 100];
        comm.reduce_scatter(&send, &mut recv, ReduceOp::Sum)?;
        seen.push(comm.bytes_sent());
        let mut gathered = vec![0.0f32; 400];
        comm.all_gather(&recv, &mut gathered)?;
        seen.push(comm.bytes_sent());
        let mut b = vec![0.0f64; 50]; // 400 bytes
        comm.broadcast(&mut b, 1)?;
        seen.push(comm.bytes_sent());
        comm.reduce(&mut b, ReduceOp::Sum, 1)?;
        seen.push(comm.bytes_sent());
        comm.barrier()?;
        seen.push(comm.bytes_sent());
        Ok(seen)
    });
    for (rank, r) in results.into_iter().enumerate() {
        let seen = r.unwrap().unwrap();
        let root = rank == 1;
        let after_bcast = 6000 + 1200 + 1200 + if root { 400 } else { 0 };
        let after_reduce = after_bcast + if root { 0 } else { 400 };
        assert_eq!(
            seen,
            vec![6000, 7200, 8400, after_bcast, after_reduce, after_reduce],
            "rank {rank}"
        );
    }
    let single = ThreadGroup::new(1).run(|comm| {
        let mut buf = vec![1.0f32; 10];
        comm.all_reduce(&mut buf, ReduceOp::Sum)
            .map(|()| comm.bytes_sent())
    });
    assert_eq!(single[0].as_ref().unwrap().as_ref().unwrap(), &0);
}

#[test]
fn communicators_can_be_moved_into_own_threads() {
    let comms = ThreadGroup::new(3).communicators();
    let handles: Vec<_> = comms
        .into_iter()
        .map(|comm| {
            std::thread::spawn(move || {
                let mut x = [comm.rank() as f64];
                comm.all_reduce(&mut x, ReduceOp::Max).map(|()| x[0])
            })
        })
        .collect();
    for h in handles {
        assert_eq!(h.join().unwrap().unwrap(), 2.0);
    }
}
