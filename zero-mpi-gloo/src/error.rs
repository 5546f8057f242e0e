//! The error type of `zero-mpi-gloo`.

/// Everything that can go wrong in the MPI backend.
///
/// Collectives return [`zero_core::Error`] (the [`Communicator`] trait's
/// error); this enum covers construction and setup, and converts into
/// [`zero_core::Error`] where the two meet.
///
/// [`Communicator`]: zero_core::Communicator
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The crate was built without its `mpi` feature.
    #[error(
        "{op}: zero-mpi-gloo was built without the `mpi` feature; enable it \
         (`zero-mpi-gloo/mpi`, or `mpi` on zero-candle / zero-examples) and install \
         an MPI library (scripts/install-deps.sh)"
    )]
    FeatureDisabled {
        /// The operation that needed MPI.
        op: &'static str,
    },
    /// `MpiComm::init` was called while MPI was already initialized.
    #[error(
        "MPI is already initialized in this process; build the communicator with \
         `MpiComm::from_communicator` instead of `MpiComm::init`"
    )]
    AlreadyInitialized,
    /// MPI is not initialized (or was already finalized).
    #[error("{op}: MPI is not initialized (or already finalized); call `MpiComm::init` first")]
    NotInitialized {
        /// The operation that needed MPI.
        op: &'static str,
    },
    /// The MPI library does not provide the thread support the backend needs.
    #[error(
        "{op}: MPI provides thread level {provided}, the communicator is used from \
         another thread than the one that initialized MPI; initialize MPI with at least \
         MPI_THREAD_SERIALIZED (`MpiComm::init` does) or call it from the main thread"
    )]
    ThreadLevel {
        /// The operation.
        op: &'static str,
        /// The thread level MPI provides.
        provided: String,
    },
    /// A count or displacement does not fit MPI's 32-bit `int` counts.
    #[error(
        "{op}: {what} = {value} exceeds MPI's 32-bit count limit ({max}); \
         split the buffer into smaller buckets"
    )]
    CountOverflow {
        /// The operation.
        op: &'static str,
        /// What overflowed.
        what: &'static str,
        /// The value.
        value: usize,
        /// The largest value MPI accepts.
        max: usize,
    },
    /// An asynchronous collective ended without a result: its job panicked
    /// on the progress thread.
    #[error(
        "{op} #{seq} ended without a result: it panicked on the MPI progress thread \
         (the panic message is printed above); this is a bug in zero-mpi-gloo, please \
         report it with that message"
    )]
    AsyncLost {
        /// The operation.
        op: &'static str,
        /// Its sequence number on the communicator.
        seq: u64,
    },
    /// An error from `zero-core` (buffer sizes, ranks, mismatches).
    #[error(transparent)]
    Core(#[from] zero_core::Error),
}

/// `Result` with [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl From<Error> for zero_core::Error {
    fn from(e: Error) -> Self {
        match e {
            Error::Core(e) => e,
            Error::FeatureDisabled { op } => zero_core::Error::Unsupported {
                op,
                detail: Error::FeatureDisabled { op }.to_string(),
            },
            Error::NotInitialized { op } => {
                zero_core::Error::State(Error::NotInitialized { op }.to_string())
            }
            e @ (Error::AlreadyInitialized | Error::AsyncLost { .. }) => {
                zero_core::Error::State(e.to_string())
            }
            e @ Error::ThreadLevel { op, .. } | e @ Error::CountOverflow { op, .. } => {
                zero_core::Error::Unsupported {
                    op,
                    detail: e.to_string(),
                }
            }
        }
    }
}
