//! `bench hybrid`: hybrid sharding (`--shard-group`) against full sharding
//! at stage 3, side by side in one run, on four thread ranks posing as two
//! machines of two: a [`Delayed`] link fast within a machine and slow
//! between them. The step time (median of the steps after the first few)
//! and the bytes sent over the slow link per step, summed over the ranks,
//! each beside what a ring should send.
//!
//! A ring of `N` ranks over `M` machines of consecutive ranks crosses
//! between machines at `M` of its edges, each carrying `(N - 1) / N` of the
//! buffer for a reduce-scatter or an all-gather. Full sharding at stage 3
//! reduce-scatters the gradients and gathers the sharded weights over all
//! `N` ranks, once a step (the host's budgets keep a gathered layer from
//! forward to backward): `2 M (N - 1) / N P` bytes a step for `P` bytes of
//! weights (less what persists: the biases). In groups of `g` (a machine),
//! gathers and reductions stay in the machine, and each rank all-reduces
//! its shard (`P / g`) with its `R = N / g` replicas, a ring that crosses
//! at every edge: `N 2 (R - 1) / R P / g`. At N = 4, g = 2: `3 P` against
//! `2 P`, 0.67: a ring's count does not reach the 0.4 at this
//! size. With the replicas' average in bf16
//! (`EngineConfig::replica_reduce_dtype`) the groups send half of it, `P`:
//! 0.33.

use super::stage3::train;
use super::Report;
use std::time::Duration;
use zero_core::comm::Delayed;
use zero_core::engine::{EngineConfig, Stage};
use zero_core::{DType, ThreadGroup};

const WORLD: usize = 4;
const MACHINE: usize = 2;
const WIDTHS: [usize; 5] = [784, 1024, 1024, 1024, 10];
const BATCH: usize = 32;
const STEPS: usize = 10;
const ROUNDS: usize = 3;
/// Within a machine: 5 µs, 2 GB/s; between machines ten times slower, 50
/// µs and 200 MB/s (scaled to this host's compute, as `bench overlap`'s
/// link: a step here is tens of milliseconds).
const FAST: (Duration, f64) = (Duration::from_micros(5), 2e9);
const SLOW: (Duration, f64) = (Duration::from_micros(50), 2e8);

/// The cases, side by side: full sharding, groups of a machine, and groups
/// averaging across replicas in bf16.
const CASES: [(&str, Option<usize>, Option<DType>); 3] = [
    ("full", None, None),
    ("hybrid", Some(MACHINE), None),
    ("hybrid_bf16", Some(MACHINE), Some(DType::BF16)),
];

/// The median step time (rank 0's) and the bytes sent between machines per
/// step (every rank's), in groups of `group` averaging in `replica_dtype`.
fn measure(group: Option<usize>, replica_dtype: Option<DType>) -> Result<(f64, f64), String> {
    let results = ThreadGroup::new(WORLD).run(|comm| {
        let comm = Delayed::between_machines(comm, MACHINE, FAST, SLOW);
        let mut config = EngineConfig::default().with_stage(Stage::Parameters);
        config.shard_group = group;
        config.replica_reduce_dtype = replica_dtype;
        train(
            comm,
            config,
            (&WIDTHS, BATCH, STEPS),
            false,
            Delayed::slow_bytes,
        )
    });
    let mut time = None;
    let mut bytes = 0.0;
    for result in results {
        let (median, sent) = result.map_err(|e| e.to_string())??;
        time = time.or(Some(median));
        bytes += sent;
    }
    Ok((time.ok_or("no rank ran")?, bytes))
}

/// Adds `hybrid.step_over_full` and `hybrid.slow_bytes_over_full`, with the
/// figures behind them.
pub fn run(report: &mut Report) {
    println!(
        "bench hybrid: stage 3, MLP {WIDTHS:?} with ZeroHook, AdamW, {BATCH} rows per rank, \
         N={WORLD} threads as machines of {MACHINE} (links {} us + {} GB/s within, {} us + {} \
         GB/s between); full sharding vs --shard-group {MACHINE}, its replicas averaging in \
         f32 and in bf16; median of the steps after the third, {ROUNDS} rounds interleaved",
        FAST.0.as_micros(),
        FAST.1 / 1e9,
        SLOW.0.as_micros(),
        SLOW.1 / 1e9
    );
    let mut bytes = [0.0; 3];
    let names = CASES.map(|(name, _, _)| name);
    let medians = super::interleaved_medians(&names, ROUNDS, |i| {
        let (time, sent) = measure(CASES[i].1, CASES[i].2)?;
        bytes[i] = sent;
        Ok(time)
    });
    let medians = match medians {
        Ok(medians) => medians,
        Err(e) => {
            eprintln!("bench hybrid: {e}");
            return;
        }
    };
    let params: usize = WIDTHS.windows(2).map(|w| w[0] * w[1] + w[1]).sum();
    let p = (params * 4) as f64;
    let (n, m, g) = (WORLD as f64, (WORLD / MACHINE) as f64, MACHINE as f64);
    let r = n / g;
    let groups = n * 2.0 * (r - 1.0) / r * p / g;
    // bf16: half the bytes of each element.
    let expected = [2.0 * m * (n - 1.0) / n * p, groups, groups / 2.0];
    for (i, name) in names.iter().enumerate() {
        report.add(
            &format!("hybrid.{name}_step_ms"),
            medians[i] * 1e3,
            "ms",
            None,
        );
        report.add(
            &format!("hybrid.{name}_slow_mb"),
            bytes[i] / 1e6,
            "MB/step",
            None,
        );
        report.add(
            &format!("hybrid.{name}_slow_over_ring_formula"),
            bytes[i] / expected[i],
            "ratio",
            None,
        );
    }
    report.add(
        "hybrid.step_over_full",
        medians[1] / medians[0],
        "ratio",
        Some("<= 0.7"),
    );
    report.add(
        "hybrid.slow_bytes_over_full",
        bytes[1] / bytes[0],
        "ratio",
        Some("<= 0.4"),
    );
    report.add(
        "hybrid.bf16_step_over_full",
        medians[2] / medians[0],
        "ratio",
        Some("<= 0.7"),
    );
    report.add(
        "hybrid.bf16_slow_bytes_over_full",
        bytes[2] / bytes[0],
        "ratio",
        Some("<= 0.4"),
    );
}
