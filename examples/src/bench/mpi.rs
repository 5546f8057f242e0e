//! The MPI backend against the MPI library's own collectives, in the same run
//! (feature `mpi`; `mpirun -n 2 --oversubscribe --allow-run-as-root target/release/bench comm`).
//!
//! Figures (median over iterations of the slowest rank's time):
//! - `mpi.rs_over_native_allreduce`: our reduce-scatter of a 64 MiB f32
//!   buffer / `MPI_Allreduce` of the same buffer (goal <= 0.7: a
//!   reduce-scatter moves half of what an all-reduce moves);
//! - `mpi.ag_over_native_allgather`: our all-gather into 64 MiB /
//!   `MPI_Allgather` of the same sizes (goal <= 1.0);
//! - supporting figures: the ring against `MPI_Reduce_scatter_block`, our
//!   all-reduce against `MPI_Allreduce`, bandwidths, and the small-buffer
//!   ratios behind `Algorithm::RING_MIN_BYTES`.
//!
//! Only rank 0 prints (see [`is_printing_rank`]).

use super::Report;
use std::time::Instant;
use zero_core::{Communicator, ReduceOp};
use zero_mpi_gloo::mpi::collective::{CommunicatorCollectives, SystemOperation};
use zero_mpi_gloo::{launched_by_mpirun, Algorithm, MpiComm};

const BUFFER_BYTES: usize = 64 << 20;
const ITERATIONS: usize = 7;

/// Runs [`run`] when this process was started by `mpirun`/`srun`; prints why
/// it skips otherwise.
pub fn run_if_launched(report: &mut Report) {
    if launched_by_mpirun() {
        run(report);
    } else {
        eprintln!(
            "bench mpi: skipped, not launched by mpirun; \
             try `mpirun -n 2 --oversubscribe --allow-run-as-root target/release/bench comm`"
        );
    }
}

/// Whether this process prints the report: not launched by MPI, or rank 0.
pub fn is_printing_rank() -> bool {
    ["OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK"]
        .iter()
        .find_map(|v| std::env::var(v).ok())
        .is_none_or(|rank| rank.trim() == "0")
}

/// Median over `ITERATIONS` (after one warm-up) of the slowest rank's time
/// for `f`, in seconds.
fn time(comm: &MpiComm, mut f: impl FnMut()) -> f64 {
    let mut times = Vec::with_capacity(ITERATIONS);
    for i in 0..=ITERATIONS {
        comm.ok_or_abort(comm.barrier());
        let start = Instant::now();
        f();
        let mut elapsed = [start.elapsed().as_secs_f64()];
        comm.ok_or_abort(comm.all_reduce(&mut elapsed[..], ReduceOp::Max));
        if i > 0 {
            times.push(elapsed[0]);
        }
    }
    times.sort_by(f64::total_cmp);
    times[times.len() / 2]
}

/// Measures the MPI figures; every rank must call it.
pub fn run(report: &mut Report) {
    let world = match MpiComm::init() {
        Ok(comm) => comm,
        Err(e) => {
            eprintln!("bench mpi: skipped: {e}");
            return;
        }
    };
    world.abort_on_panic();
    let w = world.world_size();
    if w < 2 {
        eprintln!("bench mpi: skipped, needs at least 2 ranks (mpirun -n 2)");
        return;
    }
    let all: Vec<usize> = (0..w).collect();
    let split = |algorithm| match world.split(&all) {
        Ok(Some(comm)) => comm.with_algorithm(algorithm),
        other => world.abort(&format!("bench mpi: split gave {other:?}")),
    };
    let ring = split(Algorithm::Ring);
    let native = split(Algorithm::Native);
    let auto = split(Algorithm::Auto);

    // Full buffer of `w * n` f32 elements, about 64 MiB.
    let n = BUFFER_BYTES / 4 / w;
    let full = w * n;
    let send: Vec<f32> = (0..full).map(|i| (i % 17) as f32).collect();
    let mut shard = vec![0f32; n];
    let mut out = vec![0f32; full];

    let rs_ours = time(&world, || {
        auto.ok_or_abort(auto.reduce_scatter(&send[..], &mut shard[..], ReduceOp::Sum))
    });
    let rs_native = time(&world, || {
        native.ok_or_abort(native.reduce_scatter(&send[..], &mut shard[..], ReduceOp::Sum))
    });
    let ar_native = time(&world, || {
        native
            .raw()
            .all_reduce_into(&send[..], &mut out[..], SystemOperation::sum())
    });
    let mut ar_buf = send.clone();
    let ar_ours = time(&world, || {
        auto.ok_or_abort(auto.all_reduce(&mut ar_buf[..], ReduceOp::Sum))
    });
    let ag_ours = time(&world, || {
        auto.ok_or_abort(auto.all_gather(&send[..n], &mut out[..]))
    });
    let ag_native = time(&world, || {
        native.raw().all_gather_into(&send[..n], &mut out[..])
    });

    // Small buffers: where the library's latency-tuned algorithms win.
    let mut small = Vec::new();
    for bytes in [16usize << 10, 256 << 10, 1 << 20] {
        let sn = bytes / 4 / w;
        let ssend = &send[..w * sn];
        let mut sshard = vec![0f32; sn];
        let t_ring = time(&world, || {
            for _ in 0..10 {
                ring.ok_or_abort(ring.reduce_scatter(ssend, &mut sshard[..], ReduceOp::Sum));
            }
        });
        let t_native = time(&world, || {
            for _ in 0..10 {
                native.ok_or_abort(native.reduce_scatter(ssend, &mut sshard[..], ReduceOp::Sum));
            }
        });
        small.push((bytes >> 10, t_ring / t_native));
    }

    let gbps = |bytes: usize, s: f64| bytes as f64 * (w - 1) as f64 / w as f64 / s / 1e9;
    report.add(
        "mpi.rs_over_native_allreduce",
        rs_ours / ar_native,
        "ratio",
        Some("<= 0.7"),
    );
    report.add(
        "mpi.ag_over_native_allgather",
        ag_ours / ag_native,
        "ratio",
        Some("<= 1.0"),
    );
    report.add(
        "mpi.rs_over_native_rs",
        rs_ours / rs_native,
        "ratio",
        Some("<= 1.0"),
    );
    report.add(
        "mpi.allreduce_over_native_allreduce",
        ar_ours / ar_native,
        "ratio",
        Some("<= 1.0"),
    );
    report.add("mpi.rs_64mib_ms", rs_ours * 1e3, "ms", None);
    report.add("mpi.native_allreduce_64mib_ms", ar_native * 1e3, "ms", None);
    report.add("mpi.ag_64mib_ms", ag_ours * 1e3, "ms", None);
    report.add(
        "mpi.rs_bus_bandwidth",
        gbps(BUFFER_BYTES, rs_ours),
        "GB/s",
        None,
    );
    report.add(
        "mpi.ag_bus_bandwidth",
        gbps(BUFFER_BYTES, ag_ours),
        "GB/s",
        None,
    );
    for (kib, ratio) in small {
        report.add(
            &format!("mpi.rs_ring_over_native_{kib}kib"),
            ratio,
            "ratio",
            None,
        );
    }
    report.add("mpi.world_size", w as f64, "ranks", None);
}
