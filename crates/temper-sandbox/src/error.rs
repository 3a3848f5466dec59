//! The one error type of this crate.

use std::io;

/// Why the sandbox could not run a request. A program that fails, crashes or
/// times out is *not* an error: that is an [`crate::ExecResult`].
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SandboxError {
    /// The request was malformed (bad file path, zero timeout, ...).
    #[error("invalid request: {0}")]
    InvalidRequest(String),
    /// The interpreter for a language could not be found on this host.
    #[error("no interpreter for {language}: {reason}")]
    NoInterpreter {
        /// The language that was asked for.
        language: &'static str,
        /// What was tried.
        reason: String,
    },
    /// The cap on live sessions is reached.
    #[error("at most {max} sessions may be live at once; delete one or wait for one to expire")]
    SessionLimit {
        /// The cap.
        max: usize,
    },
    /// The Python packages a request declared could not be installed
    /// (a requirement pip cannot resolve, or this service installs none).
    #[error("requirements: {0}")]
    Requirements(String),
    /// The seccomp filter could not be compiled for this architecture.
    #[error("seccomp filter: {0}")]
    Seccomp(String),
    /// A host-side system call failed (pipe, clone, uid_map, ...).
    #[error("{what}: {source}")]
    Host {
        /// What we were doing.
        what: &'static str,
        /// The underlying OS error.
        source: io::Error,
    },
    /// The isolated child failed while building its sandbox, before the
    /// program started.
    #[error("sandbox setup failed at step `{stage}`: {source}")]
    Setup {
        /// The setup step that failed.
        stage: &'static str,
        /// The errno the step returned.
        source: io::Error,
    },
}

impl SandboxError {
    pub(crate) fn host(what: &'static str, source: impl Into<io::Error>) -> Self {
        SandboxError::Host {
            what,
            source: source.into(),
        }
    }
}
