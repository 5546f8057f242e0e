//! The error type of `zero-candle`.

/// Everything that can go wrong in the Candle adapter.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// An error of the engine, a communicator or a checkpoint.
    #[error(transparent)]
    Zero(#[from] zero_core::Error),
    /// An error of Candle.
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
    /// A variable cannot be handled by this optimizer.
    #[error("variable {name:?}: {detail}")]
    Variable {
        /// The variable's name.
        name: String,
        /// What is wrong and what to do.
        detail: String,
    },
    /// A Hugging Face model directory or one of its files is unusable.
    #[error("{path}: {detail}")]
    Hub {
        /// The directory or file.
        path: std::path::PathBuf,
        /// What is wrong and what to do.
        detail: String,
    },
}

/// `Result` with [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl From<Error> for candle_core::Error {
    fn from(e: Error) -> Self {
        match e {
            Error::Candle(e) => e,
            other => candle_core::Error::wrap(other),
        }
    }
}
