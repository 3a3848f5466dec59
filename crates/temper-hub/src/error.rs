//! [`HubError`]: everything the hub's packages, store, server and client
//! can fail with.

use std::path::Path;

/// A hub error.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum HubError {
    /// A file operation failed.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// Why.
        source: std::io::Error,
    },
    /// The package or directory is not a valid package.
    #[error("bad package: {0}")]
    BadPackage(String),
    /// An archive entry that would leave the package or is not a file.
    #[error("unsafe archive entry {path:?}: {reason}")]
    UnsafeEntry {
        /// The entry's path.
        path: String,
        /// Why it is refused.
        reason: String,
    },
    /// The archive unpacks to more than the limit.
    #[error("the archive unpacks to more than {limit} bytes")]
    TooLarge {
        /// The limit.
        limit: u64,
    },
    /// The archive expands too much for its size.
    #[error("the archive expands {ratio}x (limit {limit}x): refusing a compression bomb")]
    RatioBomb {
        /// Unpacked bytes per archive byte so far.
        ratio: u64,
        /// The limit.
        limit: u64,
    },
    /// Downloaded bytes are not the bytes the hub named.
    #[error("digest mismatch: expected {expected}, got {actual}")]
    DigestMismatch {
        /// The digest the hub resolved.
        expected: String,
        /// The digest of the bytes received.
        actual: String,
    },
    /// A version that exists (or existed) cannot be published again.
    #[error("{0} already exists; versions are immutable (bump the version)")]
    VersionExists(String),
    /// No such package, version or blob.
    #[error("not found: {0}")]
    NotFound(String),
    /// A malformed reference, version requirement or argument.
    #[error("{0}")]
    BadRequest(String),
    /// No or an unknown token.
    #[error("unauthorized: {0}")]
    Unauthorized(String),
    /// A request body over the hub's limit.
    #[error("too large: {0}")]
    PayloadTooLarge(String),
    /// The token lacks the scope.
    #[error("forbidden: {0}")]
    Forbidden(String),
    /// The metadata database failed.
    #[error("database: {0}")]
    Db(#[from] rusqlite::Error),
    /// The hub answered with an error.
    #[error("hub {url} answered {status}: {message}")]
    Remote {
        /// The request URL.
        url: String,
        /// HTTP status.
        status: u16,
        /// The hub's message.
        message: String,
    },
    /// A worker thread failed.
    #[error("internal: {0}")]
    Internal(String),
    /// The hub could not be reached.
    #[error("hub request failed: {}", describe(.0))]
    Http(#[from] reqwest::Error),
}

/// reqwest's message with its causes ("error sending request" alone does
/// not say that the hub timed out or refused the connection).
fn describe(e: &reqwest::Error) -> String {
    let mut out = e.to_string();
    let mut cause = std::error::Error::source(e);
    while let Some(c) = cause {
        out.push_str(": ");
        out.push_str(&c.to_string());
        cause = c.source();
    }
    if e.is_timeout() {
        out.push_str(" (the hub did not answer in time)");
    }
    out
}

impl HubError {
    pub(crate) fn io(path: &Path, source: std::io::Error) -> Self {
        HubError::Io {
            path: path.display().to_string(),
            source,
        }
    }
}
