//! # zero-mpi-gloo
//!
//! The CPU path of zero-rs across processes and machines: [`MpiComm`], a
//! [`Communicator`](zero_core::Communicator) over host buffers for processes
//! launched by `mpirun` (or `srun`), built on the `mpi` crate (rsmpi).
//!
//! Everything real sits behind the crate feature `mpi`, which needs an MPI
//! library and libclang at build time (`scripts/install-deps.sh`). Without
//! the feature the crate still compiles and holds the same names: an
//! [`MpiComm`] whose constructors return [`Error::FeatureDisabled`], and
//! [`Algorithm`], so code that names them builds either way.
//!
//! What the backend does:
//! - every collective of the trait, for f32, f64, bf16 and f16; 16-bit
//!   reductions are widened to f32, reduced, and rounded once;
//! - large reduce-scatter, all-gather and all-reduce run as a ring of
//!   `MPI_Sendrecv` (faster than Open MPI's `MPI_Reduce_scatter_block` on
//!   shared memory), small ones as the library's collective: [`Algorithm`];
//! - asynchronous collectives that return before they complete: staged
//!   copies run by a progress thread in call order (see "Asynchronous forms"
//!   on [`MpiComm`]);
//! - failures end the job instead of hanging it: [`MpiComm::abort_on_panic`],
//!   [`MpiComm::abort`], [`MpiComm::ok_or_abort`].
//!
//! Tests: `scripts/test-mpi.sh` runs `tests/mpi_collectives.rs` and
//! `tests/mpi_async.rs` under `mpirun -n 2`, `3` and `4`, checks that a
//! panicking rank ends the job, and runs the trainer under `mpirun`.
#![warn(missing_docs)]

mod error;
pub use error::{Error, Result};

#[cfg(feature = "mpi")]
mod backend;
/// The `mpi` crate (rsmpi) this backend is built on, for
/// [`MpiComm::from_communicator`] and calls the backend does not wrap.
#[cfg(feature = "mpi")]
pub use ::mpi;
#[cfg(feature = "mpi")]
pub use backend::{Algorithm, MpiComm};

#[cfg(not(feature = "mpi"))]
mod dummy;
#[cfg(not(feature = "mpi"))]
pub use dummy::{Algorithm, MpiComm};

/// Whether this process was started by an MPI launcher (`mpirun`, `mpiexec`,
/// `srun` with PMI): one of `OMPI_COMM_WORLD_SIZE`, `PMI_SIZE` or
/// `PMIX_RANK` is set. Tests and benchmarks use it to skip when run alone.
pub fn launched_by_mpirun() -> bool {
    ["OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK"]
        .iter()
        .any(|v| std::env::var_os(v).is_some())
}
