//! Ending the whole MPI job when a rank gives up.

/// Prints `rank R failed: <reason>` on stderr and calls `MPI_Abort` on
/// `MPI_COMM_WORLD`, or exits with code 1 where MPI is not running.
pub(super) fn abort_world(world_rank: usize, reason: &str) -> ! {
    use std::io::Write;
    let mut stderr = std::io::stderr().lock();
    let _ = writeln!(stderr, "rank {world_rank} failed: {reason}");
    let _ = stderr.flush();
    drop(stderr);
    if mpi::environment::is_initialized() && !mpi::environment::is_finalized() {
        // SAFETY: MPI is initialized and not finalized; MPI_Abort may be called
        // from any thread in practice (Open MPI, MPICH) and does not return.
        unsafe {
            mpi::ffi::MPI_Abort(mpi::ffi::RSMPI_COMM_WORLD, 1);
        }
    }
    std::process::exit(1)
}
