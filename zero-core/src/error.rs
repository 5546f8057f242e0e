//! The error type of `zero-core`.

use std::path::PathBuf;

/// Everything that can go wrong in `zero-core`.
///
/// Each variant names the operation and the values involved, and its message
/// says what to do about it.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A collective did not complete before its deadline.
    #[error(
        "{op} #{seq} timed out after {waited_s:.1} s: rank(s) {missing:?} never joined; \
         is every rank running the same model and configuration?"
    )]
    CollectiveTimeout {
        /// The collective, e.g. `all_gather`.
        op: &'static str,
        /// The sequence number of the collective on this communicator.
        seq: u64,
        /// The ranks that did not arrive.
        missing: Vec<usize>,
        /// Seconds waited.
        waited_s: f64,
    },
    /// A peer rank failed (panicked, returned early or dropped its communicator).
    #[error("{op} #{seq} aborted: rank(s) {failed:?} failed or left the group ({reason})")]
    PeerFailed {
        /// The collective that observed the failure.
        op: &'static str,
        /// The sequence number of the collective on this communicator.
        seq: u64,
        /// The ranks that failed.
        failed: Vec<usize>,
        /// Why they failed, as far as it is known.
        reason: String,
    },
    /// Ranks called different collectives (or sizes) at the same sequence number.
    #[error(
        "collective mismatch at #{seq}: rank {rank} called {this}, but rank {other_rank} called {other}; \
         every rank must issue the same collectives in the same order with the same sizes"
    )]
    CollectiveMismatch {
        /// The sequence number.
        seq: u64,
        /// This rank.
        rank: usize,
        /// What this rank called (operation, dtype, sizes).
        this: String,
        /// The rank that called something else.
        other_rank: usize,
        /// What the other rank called.
        other: String,
    },
    /// A rank of a [`crate::ThreadGroup::run`] panicked.
    #[error("rank {rank} panicked: {message}")]
    RankPanicked {
        /// The rank.
        rank: usize,
        /// The panic message.
        message: String,
    },
    /// A buffer has the wrong length for a collective.
    #[error("{op}: {what} has {got} elements, expected {expected}")]
    BufferSize {
        /// The operation.
        op: &'static str,
        /// Which buffer.
        what: &'static str,
        /// Its length.
        got: usize,
        /// The length required.
        expected: usize,
    },
    /// A rank index is outside the group.
    #[error("{op}: rank {rank} is outside a group of {world_size} ranks")]
    InvalidRank {
        /// The operation.
        op: &'static str,
        /// The offending rank.
        rank: usize,
        /// The group's size.
        world_size: usize,
    },
    /// A reduction that the backend cannot perform for this element type.
    #[error("{op}: {detail}")]
    Unsupported {
        /// The operation.
        op: &'static str,
        /// What is not supported and what to use instead.
        detail: String,
    },
    /// The ranks disagree on the model or configuration.
    #[error("ranks disagree: rank {rank} has {this}, rank {other_rank} has {other}")]
    RankMismatch {
        /// This rank.
        rank: usize,
        /// This rank's value of the first difference.
        this: String,
        /// The rank that differs.
        other_rank: usize,
        /// Its value.
        other: String,
    },
    /// With [`StartingModel::Verify`](crate::engine::StartingModel::Verify):
    /// a rank built other starting values than rank 0.
    #[error(
        "rank {rank} starts from other values of parameter {param:?} than rank 0 (the first \
         that differs); build the model identically on every rank (a seeded initializer such \
         as zero_candle's ShardedVarMap, or the same file), or let construction copy rank 0's \
         values (StartingModel::Broadcast, the default)"
    )]
    StartingModelDiffers {
        /// The first parameter, in collective order, that differs.
        param: String,
        /// The first rank whose values differ from rank 0's.
        rank: usize,
    },
    /// A parameter's dtype cannot be trained by an engine of this element
    /// type: the engine's type must be the parameter's, or wider (master
    /// weights for a 16-bit parameter).
    #[error(
        "parameter {name:?} is {param} but the engine's element type is {engine}; an engine \
         steps parameters of its own type, or keeps wider master weights of bf16/f16 ones: \
         build it with the parameters' type (no master weights) or with f32 (f32 masters)"
    )]
    ParamDType {
        /// The parameter.
        name: String,
        /// Its dtype.
        param: crate::DType,
        /// The engine's element type.
        engine: crate::DType,
    },
    /// Invalid configuration or arguments.
    #[error("invalid configuration: {0}")]
    Config(String),
    /// An optimizer failure (unknown parameter, bad state, bad hyperparameter).
    #[error("optimizer: {0}")]
    Optimizer(String),
    /// The call is not valid in the engine's current state.
    #[error("{0}")]
    State(String),
    /// Clipping met a gradient norm that is infinite or NaN: the step was
    /// refused on every rank, leaving parameters and optimizer state as
    /// they were.
    #[error(
        "optimizer step {step} refused on every rank: the global gradient norm is {norm}, so \
         clipping cannot scale it; an inf or NaN gradient came out of backward. Lower the \
         learning rate, check the loss for overflow, or skip this batch and step again"
    )]
    NonFiniteGradNorm {
        /// The norm (inf or NaN).
        norm: f64,
        /// The number of the refused optimizer step (1 for the first).
        step: u64,
    },
    /// A checkpoint file is missing, corrupted, or does not match the model.
    #[error("checkpoint {path}: {detail}")]
    Checkpoint {
        /// The file or directory at fault.
        path: PathBuf,
        /// What is wrong with it.
        detail: String,
    },
    /// A preemption signal cannot be handled: an unknown name, or a signal
    /// a process may not catch.
    #[error("signal {signal}: {detail}")]
    Signal {
        /// The signal, by name or number.
        signal: String,
        /// What is wrong and what to do.
        detail: String,
    },
    /// An I/O error on a file.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// A safetensors (de)serialization error.
    #[error(transparent)]
    SafeTensors(#[from] safetensors::SafeTensorError),
    /// A JSON (de)serialization error.
    #[error(transparent)]
    Json(#[from] serde_json::Error),
}

/// `Result` with [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Returns early with [`Error::Config`] built from a format string.
#[macro_export]
macro_rules! bail_config {
    ($($arg:tt)*) => {
        return Err($crate::Error::Config(format!($($arg)*)))
    };
}
