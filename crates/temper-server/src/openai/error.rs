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
    /// No such episode, or not with the token presented (404; the same
    /// answer for both).
    #[error("no episode {0:?} with this token")]
    EpisodeNotFound(String),
    /// The request conflicts with the resource's state (409), e.g. a
    /// second reward for one episode.
    #[error("{0}")]
    Conflict(String),
    /// The server's rubric could not score an episode (422, with why; no
    /// reward was recorded).
    #[error("{0}")]
    RubricFailed(String),
    /// The queue is full (503); retry later.
    #[error("{0}")]
    Overloaded(String),
    /// Too many requests of one kind at once (429 with `Retry-After`).
    #[error("{message}")]
    RateLimited {
        /// What is busy, for the client.
        message: String,
        /// Seconds to wait before retrying.
        retry_after_s: u64,
    },
    /// The inference engine failed on this request (500, with the
    /// engine's reason, e.g. the panic a batch hit).
    #[error("{0}")]
    Engine(String),
    /// The inference engine is gone (503, with the reason).
    #[error("{0}")]
    Unavailable(String),
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

    /// A 400: the request's grammar exhausted an engine limit while
    /// generating (`message` names it).
    pub fn grammar_limit(message: impl Into<String>) -> Self {
        OpenAiError::BadRequest {
            message: format!(
                "the request's schema exceeds a limit of the structured-output engine: {}",
                message.into()
            ),
            param: None,
            code: Some("grammar_limit"),
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
            OpenAiError::NotFound(_) | OpenAiError::EpisodeNotFound(_) => StatusCode::NOT_FOUND,
            OpenAiError::Conflict(_) => StatusCode::CONFLICT,
            OpenAiError::RubricFailed(_) => StatusCode::UNPROCESSABLE_ENTITY,
            OpenAiError::Overloaded(_) => StatusCode::SERVICE_UNAVAILABLE,
            OpenAiError::RateLimited { .. } => StatusCode::TOO_MANY_REQUESTS,
            OpenAiError::Internal(_) | OpenAiError::Engine(_) => StatusCode::INTERNAL_SERVER_ERROR,
            OpenAiError::Unavailable(_) => StatusCode::SERVICE_UNAVAILABLE,
        }
    }
}

impl IntoResponse for OpenAiError {
    fn into_response(self) -> Response {
        let status = self.status();
        let retry_after = match &self {
            OpenAiError::RateLimited { retry_after_s, .. } => Some(*retry_after_s),
            _ => None,
        };
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
            OpenAiError::EpisodeNotFound(id) => (
                format!(
                    "no episode {id:?} with this token (never created, deleted, evicted, or the \
                     wrong X-Temper-Episode-Token / bearer token)"
                ),
                "invalid_request_error",
                None,
                Some("episode_not_found"),
            ),
            OpenAiError::Conflict(m) => (m, "invalid_request_error", None, Some("conflict")),
            OpenAiError::RubricFailed(m) => (m, "server_error", None, Some("rubric_failed")),
            OpenAiError::Overloaded(m) => (m, "server_error", None, Some("overloaded")),
            OpenAiError::Engine(m) => (m, "server_error", None, Some("engine_error")),
            OpenAiError::Unavailable(m) => (m, "server_error", None, Some("engine_unavailable")),
            OpenAiError::RateLimited { message, .. } => (
                message,
                "rate_limit_error",
                None,
                Some("rate_limit_exceeded"),
            ),
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
        let mut resp = (status, axum::Json(body)).into_response();
        if let Some(s) = retry_after {
            resp.headers_mut()
                .insert(axum::http::header::RETRY_AFTER, s.into());
        }
        resp
    }
}
