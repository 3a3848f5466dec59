//! The one error type of this crate.

use std::path::PathBuf;

/// Everything that can go wrong while loading, running or saving a model.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ModelError {
    /// A file the model directory must contain is not there.
    #[error("missing file {path}: {hint}")]
    MissingFile {
        /// The path that was looked for.
        path: PathBuf,
        /// What the file is for / how to get it.
        hint: String,
    },
    /// A file exists but could not be read or parsed.
    #[error("cannot read {path}: {reason}")]
    BadFile {
        /// The offending file.
        path: PathBuf,
        /// Why it was rejected.
        reason: String,
    },
    /// `config.json` names an architecture we do not implement.
    #[error("unsupported model_type {0:?}: temper supports llama, qwen2 and qwen3")]
    UnsupportedModelType(String),
    /// `config.json` asks for something we do not implement (rope type, activation, ...).
    #[error("unsupported configuration: {0}")]
    UnsupportedConfig(String),
    /// A checkpoint tensor is missing.
    #[error("tensor {name} not found in the checkpoint ({source_desc})")]
    MissingTensor {
        /// Tensor name as in the checkpoint.
        name: String,
        /// Which files were searched.
        source_desc: String,
    },
    /// A checkpoint tensor has the wrong shape for the configuration.
    #[error("tensor {name} has shape {actual:?}, expected {expected:?} from config.json")]
    ShapeMismatch {
        /// Tensor name.
        name: String,
        /// Shape required by the config.
        expected: Vec<usize>,
        /// Shape found in the file.
        actual: Vec<usize>,
    },
    /// Input that cannot be run (empty prompt, token id out of range, ...).
    #[error("invalid input: {0}")]
    InvalidInput(String),
    /// The chat template failed to compile or render.
    #[error("chat template: {0}")]
    Template(String),
    /// Tokenizer failure.
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    /// A tensor operation failed.
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
    /// Filesystem error.
    #[error("io error on {path}: {source}")]
    Io {
        /// The path involved.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
}

/// Result alias for this crate.
pub type Result<T> = std::result::Result<T, ModelError>;

impl ModelError {
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        ModelError::Io {
            path: path.into(),
            source,
        }
    }
    pub(crate) fn bad(path: impl Into<PathBuf>, reason: impl ToString) -> Self {
        ModelError::BadFile {
            path: path.into(),
            reason: reason.to_string(),
        }
    }
}
