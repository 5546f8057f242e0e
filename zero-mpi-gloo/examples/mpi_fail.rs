//! The failure path: one rank fails, the job must end (non-zero) within
//! seconds with that rank named, not hang in the others' next collective.
//!
//! `mpirun -n 3 --oversubscribe --allow-run-as-root target/debug/examples/mpi_fail [MODE]`
//! - `panic` (default): rank 1 panics; `abort_on_panic` prints
//!   `rank 1 failed: <message>` and aborts the job.
//! - `error`: rank 1 gets an error and gives up with `ok_or_abort`.
//! - `hang`: rank 1 sleeps without failing; the others' 2 s deadline ends
//!   the job (`rank 0 failed: all_reduce #1 did not complete within ...`).
//! - `hang-at-exit`: every collective completes, then rank 1 sleeps before
//!   finalizing; the others' deadline on `MPI_Finalize`, which waits for
//!   every process, ends the job.
//! - `hang-async`: as `hang`, but the others wait in an asynchronous
//!   all-reduce; the deadline runs on the progress thread
//!   (`rank 0 failed: all_reduce_async #1 did not complete within ...`).
//!
//! In the first three, the other ranks wait in an all-reduce that rank 1
//! never joins.

use zero_core::{Communicator, ReduceOp};
use zero_mpi_gloo::MpiComm;

fn main() {
    let mode = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "panic".to_string());
    let comm = match MpiComm::init() {
        Ok(comm) => comm,
        Err(e) => {
            eprintln!("mpi_fail: {e}");
            std::process::exit(2);
        }
    };
    let comm = comm.with_timeout(Some(std::time::Duration::from_secs(2)));
    comm.abort_on_panic();
    let mut buf = vec![1.0f32; 1024];
    comm.ok_or_abort(comm.all_reduce(&mut buf[..], ReduceOp::Sum));
    if mode == "hang-at-exit" {
        // Every collective has completed; rank 1 hangs instead of finalizing.
        if comm.rank() == 1 {
            std::thread::sleep(std::time::Duration::from_secs(3600));
        }
        return;
    }
    if comm.rank() == 1 {
        match mode.as_str() {
            "hang" | "hang-async" => std::thread::sleep(std::time::Duration::from_secs(3600)),
            "error" => {
                let failed: Result<(), String> = Err("the loss is NaN at step 3".to_string());
                comm.ok_or_abort(failed);
            }
            _ => panic!("simulated failure in the optimizer step"),
        }
    }
    // Rank 1 never gets here: without the abort the others would wait forever.
    if mode == "hang-async" {
        let work = comm.ok_or_abort(comm.all_reduce_async(&mut buf[..], ReduceOp::Sum));
        comm.ok_or_abort(work.wait());
    } else {
        comm.ok_or_abort(comm.all_reduce(&mut buf[..], ReduceOp::Sum));
    }
    println!("rank {}: unreachable for a world of 2+ ranks", comm.rank());
}
