//! The one error type of this crate.

use std::path::PathBuf;

/// Why a task could not be loaded or a job could not run. A trial whose
/// agent fails, times out or scores 0 is *not* an error: that is recorded
/// in its `result.json`.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TaskError {
    /// A task directory is missing a required file or has a bad one.
    #[error("task {dir}: {reason}")]
    InvalidTask {
        /// The task directory.
        dir: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// `task.toml` does not parse.
    #[error("task {dir}: task.toml: {source}")]
    Config {
        /// The task directory.
        dir: PathBuf,
        /// The TOML error.
        source: toml::de::Error,
    },
    /// `environment/Dockerfile` uses something the sandbox runtime cannot
    /// honour (it needs a container runtime).
    #[error("task {dir}: environment/Dockerfile: {reason}")]
    Unsupported {
        /// The task directory.
        dir: PathBuf,
        /// Which instruction and why.
        reason: String,
    },
    /// The sandbox refused or failed.
    #[error(transparent)]
    Sandbox(#[from] temper_sandbox::SandboxError),
    /// Reading or writing the job directory failed.
    #[error("{what} {path}: {source}")]
    Io {
        /// What we were doing.
        what: &'static str,
        /// The path.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// A job's `config.json` or a trial's `result.json` does not parse.
    #[error("{path}: {source}")]
    Json {
        /// The file.
        path: PathBuf,
        /// The JSON error.
        source: serde_json::Error,
    },
    /// A bad argument (agent name, trial count, job directory, ...).
    #[error("{0}")]
    Invalid(String),
}

impl TaskError {
    pub(crate) fn io(what: &'static str, path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        TaskError::Io {
            what,
            path: path.into(),
            source,
        }
    }
}
