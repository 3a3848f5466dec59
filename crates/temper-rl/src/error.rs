//! The training loops' error type.

use std::path::PathBuf;

/// What can go wrong in a training loop.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RlError {
    /// The config or a command-line override is invalid.
    #[error("config: {0}")]
    Config(String),
    /// A dataset row or file is malformed.
    #[error("data: {0}")]
    Data(String),
    /// The trainer or engine failed.
    #[error(transparent)]
    Engine(#[from] temper_engine::EngineError),
    /// The model core failed.
    #[error(transparent)]
    Model(#[from] temper_model::ModelError),
    /// A tensor operation failed.
    #[error(transparent)]
    Candle(#[from] temper_model::candle_core::Error),
    /// An environment failed.
    #[error("environment: {0}")]
    Env(String),
    /// A sampler (e.g. a `temper serve` process) failed.
    #[error("sampler: {0}")]
    Sampler(String),
    /// Work moved off the async runtime (model loading, environment
    /// loading) panicked or was cancelled.
    #[error("{what}: {source}")]
    Blocking {
        /// What was running.
        what: &'static str,
        /// Cause.
        source: tokio::task::JoinError,
    },
    /// An alert that `[alerts] stop_on` names was raised.
    #[error("stopped by alert {0}")]
    Alert(String),
    /// File I/O.
    #[error("io error on {path}: {source}")]
    Io {
        /// Path involved.
        path: PathBuf,
        /// Cause.
        source: std::io::Error,
    },
}

/// Result alias.
pub type Result<T> = std::result::Result<T, RlError>;

impl RlError {
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        RlError::Io {
            path: path.into(),
            source,
        }
    }
}

/// A plan converts into itself infallibly; this lets the loops take either a
/// config (checked into a plan) or a plan.
impl From<std::convert::Infallible> for RlError {
    fn from(never: std::convert::Infallible) -> Self {
        match never {}
    }
}
