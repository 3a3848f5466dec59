//! The inference server's error type, answered as OpenAI's error JSON:
//! `{"error": {"message", "type", "param", "code"}}` with the status codes the
//! `openai` client maps to its exception classes.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::json;

/// A request the inference server cannot answer normally.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum OpenAiError {
    /// Invalid parameters (400).
    #[error("{message}")]
    BadRequest {
        /// What is wrong, for the client.
        message: String,
        /// The offending field, if one.
        param: Option<String>,
        /// A machine-readable code (e.g. `context_length_exceeded`).
        code: Option<&'static str>,
    },
    /// Missing or wrong API key (401).
    #[error("{0}")]
    Unauthorized(String),
    /// Unknown model or route (404).
    #[error("{0}")]
    NotFound(String),
    /// The queue is full (503); retry later.
    #[error("{0}")]
    Overloaded(String),
    /// A bug or an unexpected failure (500; logged, answered generically).
    #[error("{0}")]
    Internal(String),
}

impl OpenAiError {
    /// A 400 about `param`.
    pub fn invalid(param: &'static str, message: impl Into<String>) -> Self {
        OpenAiError::BadRequest {
            message: message.into(),
            param: Some(param.to_string()),
            code: None,
        }
    }

    /// A 400 with no single offending field.
    pub fn bad(message: impl Into<String>) -> Self {
        OpenAiError::BadRequest {
            message: message.into(),
            param: None,
            code: None,
        }
    }

    /// The HTTP status.
    pub fn status(&self) -> StatusCode {
        match self {
            OpenAiError::BadRequest { .. } => StatusCode::BAD_REQUEST,
            OpenAiError::Unauthorized(_) => StatusCode::UNAUTHORIZED,
            OpenAiError::NotFound(_) => StatusCode::NOT_FOUND,
            OpenAiError::Overloaded(_) => StatusCode::SERVICE_UNAVAILABLE,
            OpenAiError::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }
}

impl IntoResponse for OpenAiError {
    fn into_response(self) -> Response {
        let status = self.status();
        let (message, kind, param, code) = match self {
            OpenAiError::BadRequest {
                message,
                param,
                code,
            } => (message, "invalid_request_error", param, code),
            OpenAiError::Unauthorized(m) => {
                (m, "invalid_request_error", None, Some("invalid_api_key"))
            }
            OpenAiError::NotFound(m) => (m, "invalid_request_error", None, Some("model_not_found")),
            OpenAiError::Overloaded(m) => (m, "server_error", None, Some("overloaded")),
            OpenAiError::Internal(m) => {
                tracing::error!("internal error: {m}");
                (
                    "internal error (see the server log)".to_string(),
                    "server_error",
                    None,
                    None,
                )
            }
        };
        let body =
            json!({"error": {"message": message, "type": kind, "param": param, "code": code}});
        (status, axum::Json(body)).into_response()
    }
}
