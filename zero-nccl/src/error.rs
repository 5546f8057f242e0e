//! The error type of `zero-nccl`, and its conversion into `zero_core::Error`.

/// Everything that can go wrong in `zero-nccl`.
///
/// Each variant names the operation and the values involved; the message says
/// what to do about it.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A shared library (libcuda, libnvrtc, libnccl) could not be loaded.
    #[error("{library} not found: {hint} (tried {tried:?})")]
    LibraryNotFound {
        /// The library, e.g. `libcuda.so`.
        library: &'static str,
        /// The file names that were tried.
        tried: Vec<String>,
        /// What to install or set.
        hint: &'static str,
    },
    /// A shared library is there only under a versioned file name that
    /// cudarc does not load (it loads `libnccl.so`, say, and finds only
    /// `libnccl.so.2`, as pip's wheels and Debian's `libnccl2` install it).
    #[error(
        "{found} is installed, but cudarc loads the library as {wanted}, which is not there: \
         link it in the same directory (ln -s {found} {wanted}), or install the development \
         package that provides {wanted}"
    )]
    LibraryNeedsLink {
        /// The file that loads, e.g. `libnccl.so.2`.
        found: String,
        /// The name cudarc asks for, e.g. `libnccl.so`.
        wanted: &'static str,
    },
    /// A CUDA driver call failed.
    #[cfg(feature = "cuda")]
    #[error("CUDA driver error: {0}")]
    Driver(#[from] cudarc::driver::DriverError),
    /// A cuBLASLt call failed (a Linear layer's GEMM).
    #[cfg(feature = "cuda")]
    #[error("cuBLASLt error: {0}")]
    Cublas(#[from] cudarc::cublaslt::result::CublasError),
    /// NVRTC could not compile the fused kernels.
    #[cfg(feature = "cuda")]
    #[error("NVRTC could not compile the fused kernels: {0}")]
    Compile(#[from] cudarc::nvrtc::CompileError),
    /// An NCCL call failed.
    #[error("NCCL {call} failed with {code}: {message}")]
    Nccl {
        /// The NCCL function or collective, e.g. `ncclAllReduce`.
        call: &'static str,
        /// The `ncclResult_t` name, e.g. `ncclUnhandledCudaError`.
        code: String,
        /// NCCL's description of the error (set `NCCL_DEBUG=WARN` for more).
        message: String,
    },
    /// A CUDA library call panicked (cudarc panics on missing symbols, e.g.
    /// a driver older than the bindings); the panic was caught.
    #[error(
        "a CUDA library call panicked during {during}: {message}; \
         is the NVIDIA driver new enough for this build (set CUDARC_CUDA_VERSION to match it)?"
    )]
    Panicked {
        /// What was being done.
        during: &'static str,
        /// The panic message.
        message: String,
    },
    /// An environment variable is missing or has an invalid value.
    #[error("environment variable {var}={value:?}: {detail}")]
    Env {
        /// The variable.
        var: &'static str,
        /// Its value, empty if unset.
        value: String,
        /// What is wrong and what to set.
        detail: String,
    },
    /// No launcher environment (MPI or torchrun-style) was found.
    #[error(
        "no launcher environment found: set RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and \
         MASTER_PORT (torchrun style), launch with mpirun (OMPI_COMM_WORLD_RANK / PMI_RANK), \
         or use NcclComm::single for one GPU"
    )]
    NoLaunchEnv,
    /// The TCP exchange of the NCCL unique id failed.
    #[error("rendezvous at {addr} (rank {rank}): {detail}")]
    Rendezvous {
        /// `host:port` of rank 0's server.
        addr: String,
        /// This rank.
        rank: usize,
        /// What went wrong.
        detail: String,
    },
    /// The TCP exchange of the NCCL unique id did not finish before its deadline.
    #[error(
        "rendezvous at {addr} (rank {rank}) timed out after {waited_s:.1} s: {detail}; \
         are MASTER_ADDR/MASTER_PORT the same on every rank and is rank 0 running?"
    )]
    RendezvousTimeout {
        /// `host:port` of rank 0's server.
        addr: String,
        /// This rank.
        rank: usize,
        /// Seconds waited.
        waited_s: f64,
        /// The last error seen, or which ranks never arrived.
        detail: String,
    },
    /// One of `zero-core`'s errors: a buffer of the wrong length for an
    /// operation, a rank outside the group, an argument this backend does
    /// not support, and the others it names.
    #[error(transparent)]
    Core(#[from] zero_core::Error),
    /// The communicator was aborted (after a timeout) and cannot be used.
    #[error("{op}: the NCCL communicator was aborted after an earlier failure; create a new one")]
    Aborted {
        /// The operation that was refused.
        op: &'static str,
    },
    /// A host-side wait on a collective did not finish before its deadline.
    #[error(
        "{op} #{seq} did not complete within {waited_s:.1} s; the communicator was aborted. \
         Is every rank running the same model and configuration?"
    )]
    Timeout {
        /// The collective.
        op: &'static str,
        /// Its sequence number on this communicator.
        seq: u64,
        /// Seconds waited.
        waited_s: f64,
    },
}

/// `Result` with [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

#[cfg(feature = "nccl")]
impl From<cudarc::nccl::result::NcclError> for Error {
    fn from(e: cudarc::nccl::result::NcclError) -> Self {
        Error::nccl("NCCL", e)
    }
}

#[cfg(feature = "nccl")]
impl Error {
    /// An [`Error::Nccl`] for a failed `call`, with NCCL's own description.
    pub(crate) fn nccl(call: &'static str, e: cudarc::nccl::result::NcclError) -> Self {
        // SAFETY: ncclGetErrorString returns a pointer to a static,
        // NUL-terminated string for every ncclResult_t value (or null, checked).
        let message = unsafe {
            let ptr = cudarc::nccl::sys::ncclGetErrorString(e.0);
            if ptr.is_null() {
                String::new()
            } else {
                std::ffi::CStr::from_ptr(ptr).to_string_lossy().into_owned()
            }
        };
        Error::Nccl {
            call,
            code: format!("{:?}", e.0),
            message,
        }
    }
}

impl From<Error> for zero_core::Error {
    /// Maps onto the closest `zero_core` variant; the message is kept whole.
    fn from(e: Error) -> Self {
        match e {
            Error::Core(e) => e,
            Error::Timeout { op, seq, waited_s } => zero_core::Error::CollectiveTimeout {
                op,
                seq,
                missing: Vec::new(),
                waited_s,
            },
            e @ (Error::LibraryNotFound { .. } | Error::LibraryNeedsLink { .. }) => {
                zero_core::Error::Unsupported {
                    op: "nccl",
                    detail: e.to_string(),
                }
            }
            e @ (Error::Env { .. } | Error::NoLaunchEnv) => zero_core::Error::Config(e.to_string()),
            e @ (Error::Rendezvous { .. } | Error::RendezvousTimeout { .. }) => {
                zero_core::Error::PeerFailed {
                    op: "rendezvous",
                    seq: 0,
                    failed: Vec::new(),
                    reason: e.to_string(),
                }
            }
            other => zero_core::Error::State(format!("NCCL backend: {other}")),
        }
    }
}
