//! `bench comm`: the thread backend's collectives against plain memory
//! copies, and small all-reduce latency.

use super::{median, Report};
use std::sync::Barrier;
use std::time::Instant;
use zero_core::prelude::*;

const MIB: usize = 1 << 20;

/// Two threads each copying `bytes` between their own buffers, started
/// together; seconds until both are done, median of `reps`.
fn two_thread_memcpy(bytes: usize, reps: usize) -> f64 {
    let len = bytes / 4;
    let barrier = Barrier::new(2);
    let times: Vec<Vec<f64>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..2)
            .map(|_| {
                let barrier = &barrier;
                s.spawn(move || {
                    let src = vec![1.0f32; len];
                    let mut dst = vec![0.0f32; len];
                    let mut times = Vec::new();
                    for _ in 0..reps + 1 {
                        barrier.wait();
                        let t = Instant::now();
                        dst.copy_from_slice(&src);
                        std::hint::black_box(&mut dst);
                        barrier.wait();
                        times.push(t.elapsed().as_secs_f64());
                    }
                    times
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_default())
            .collect()
    });
    median(times[0][1..].to_vec())
}

/// Reduce-scatter then all-gather of `bytes` of f32 at N = 2: median
/// seconds on rank 0 (the collectives end in a departure barrier, so rank
/// 0's time covers both ranks).
fn rs_ag(bytes: usize, reps: usize) -> Result<f64> {
    let len = bytes / 4;
    let results = ThreadGroup::new(2).run(|comm| -> Result<Vec<f64>> {
        let grads = vec![comm.rank() as f32 + 1.0; len];
        let mut shard = vec![0.0f32; len / 2];
        let mut params = vec![0.0f32; len];
        let mut times = Vec::new();
        for _ in 0..reps + 1 {
            comm.barrier()?;
            let t = Instant::now();
            comm.reduce_scatter(&grads, &mut shard, ReduceOp::Sum)?;
            comm.all_gather(&shard, &mut params)?;
            times.push(t.elapsed().as_secs_f64());
        }
        if params[len - 1] != 3.0 {
            return Err(Error::State(
                "wrong reduce-scatter/all-gather result".into(),
            ));
        }
        Ok(times)
    });
    let mut out = Vec::new();
    for r in results {
        out.push(r??);
    }
    Ok(median(out[0][1..].to_vec()))
}

/// Median latency in microseconds of an 8-byte all-reduce at N = 2.
fn allreduce_8b(iters: usize) -> Result<f64> {
    let results = ThreadGroup::new(2).run(|comm| -> Result<Vec<f64>> {
        let mut x = [1.0f32; 2];
        let mut times = Vec::with_capacity(iters);
        for _ in 0..1000 {
            comm.all_reduce(&mut x, ReduceOp::Max)?;
        }
        for _ in 0..iters {
            let t = Instant::now();
            comm.all_reduce(&mut x, ReduceOp::Max)?;
            times.push(t.elapsed().as_secs_f64() * 1e6);
        }
        Ok(times)
    });
    let mut out = Vec::new();
    for r in results {
        out.push(r??);
    }
    Ok(median(out.swap_remove(0)))
}

/// Runs the suite and records its figures.
pub fn run(report: &mut Report) {
    let bytes = 64 * MIB;
    let reps = 7;
    let memcpy = two_thread_memcpy(bytes, reps);
    match rs_ag(bytes, reps) {
        Ok(t) => {
            report.add(
                "comm.rs_ag_over_memcpy",
                t / memcpy,
                "ratio",
                Some("<= 2.0"),
            );
            report.add("comm.rs_ag_64mib_ms", t * 1e3, "ms", None);
            report.add("comm.memcpy_64mib_2threads_ms", memcpy * 1e3, "ms", None);
            // Algorithm bandwidth: the full buffer through RS + AG.
            report.add("comm.rs_ag_algbw", bytes as f64 / t / 1e9, "GB/s", None);
        }
        Err(e) => eprintln!("comm.rs_ag failed: {e}"),
    }
    match allreduce_8b(20_000) {
        Ok(us) => report.add("comm.allreduce_8b_us", us, "us", Some("<= 10")),
        Err(e) => eprintln!("comm.allreduce_8b failed: {e}"),
    }
}
