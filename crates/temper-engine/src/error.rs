//! The engine's error type.

use std::path::PathBuf;

/// What can go wrong in a training primitive.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum EngineError {
    /// The request is malformed (shapes, ranges, missing loss inputs).
    #[error("invalid request: {0}")]
    InvalidRequest(String),
    /// No such training run / sampler weights / checkpoint.
    #[error("not found: {0}")]
    NotFound(String),
    /// The model core failed.
    #[error(transparent)]
    Model(#[from] temper_model::ModelError),
    /// A tensor operation failed.
    #[error(transparent)]
    Candle(#[from] temper_model::candle_core::Error),
    /// Checkpoint I/O.
    #[error("io error on {path}: {source}")]
    Io {
        /// Path involved.
        path: PathBuf,
        /// Cause.
        source: std::io::Error,
    },
    /// A remote training service failed or could not be reached.
    #[error("remote: {0}")]
    Remote(String),
    /// The engine's worker thread is gone (a call panicked); says why.
    #[error("the engine is dead: {0}")]
    Dead(String),
    /// A checkpoint could not be parsed.
    #[error("bad checkpoint {path}: {reason}")]
    BadCheckpoint {
        /// Path involved.
        path: PathBuf,
        /// Why.
        reason: String,
    },
}

/// Result alias.
pub type Result<T> = std::result::Result<T, EngineError>;

impl EngineError {
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        EngineError::Io {
            path: path.into(),
            source,
        }
    }
}
