//! The service's error type: every failure becomes a 4xx/5xx with a JSON
//! `{"detail": ...}` body (the tinker SDK puts it in its exception text).

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};

/// A request the service cannot answer normally.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ApiError {
    /// Malformed or invalid input (400).
    #[error("{0}")]
    BadRequest(String),
    /// Missing or wrong API key (401).
    #[error("{0}")]
    Unauthorized(String),
    /// Unknown id or route (404).
    #[error("{0}")]
    NotFound(String),
    /// The session was finished (410).
    #[error("{0}")]
    Gone(String),
    /// A bug or an unexpected failure (500; logged, answered generically).
    #[error("{0}")]
    Internal(String),
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let (status, detail) = match self {
            ApiError::BadRequest(m) => (StatusCode::BAD_REQUEST, m),
            ApiError::Unauthorized(m) => (StatusCode::UNAUTHORIZED, m),
            ApiError::NotFound(m) => (StatusCode::NOT_FOUND, m),
            ApiError::Gone(m) => (StatusCode::GONE, m),
            ApiError::Internal(m) => {
                tracing::error!("internal error: {m}");
                (
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "internal error (see the server log)".to_string(),
                )
            }
        };
        (status, axum::Json(serde_json::json!({ "detail": detail }))).into_response()
    }
}
