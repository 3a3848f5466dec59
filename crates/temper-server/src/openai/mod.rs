//! The OpenAI-compatible inference server: `/v1/chat/completions`,
//! `/v1/responses`, `/v1/completions`, `/v1/models`, the token-in / token-out
//! `/v1/generate` for RL and vLLM's `/inference/v1/generate`, vLLM's
//! `/v1/load_lora_adapter` and `/v1/unload_lora_adapter`, `/health` and
//! Prometheus `/metrics`. Chat and completions also take vLLM's request
//! extensions `min_tokens`, `skip_special_tokens`, `cache_salt`,
//! `return_token_ids` and `return_tokens_as_token_ids`.
//!
//! Every generation request becomes [`Job`]s on the continuous-batching
//! [`Scheduler`]. The `model` field picks the base model or a loaded LoRA
//! adapter; the adapter is resolved once, when the request arrives, so a
//! request runs start to finish on the version it started with even if the
//! name is reloaded meanwhile. Every response says which version produced
//! it: `"version"` (0 = base model, else the adapter's load count) and
//! `"system_fingerprint": "<model>@v<version>"`.
//!
//! Logprobs are taken from each decode step's logits where those are
//! bit-identical to the trainer's (the CPU in f32: batch-invariant kernels),
//! and otherwise computed after a sample finishes by
//! [`temper_model::Model::score_with_top`] — the trainer's forward; either
//! way they equal what training computes for the same tokens bit for bit
//! (`echo`'s prompt logprobs always take the second route). They are
//! of the sampling distribution `log softmax(logits / T)` (T = 1 for greedy),
//! before top-k / top-p and before a structured-output mask (the unmasked
//! model's, see [`crate::structured`]). When streaming, a choice's logprobs
//! arrive with its last chunk.
//!
//! One module per concern: `state` (settings, the shared state, adapter
//! loading), `jobs` (request → scheduler jobs → finished samples, scoring),
//! `chat`, `completions`, `generate` and `tokens` (one endpoint each),
//! `responses` (OpenAI's Responses API, turned into a chat request), `adapters`
//! (`/v1/models` and LoRA load / unload), `streaming` (server-sent events),
//! `response` (logprobs and usage), `protocol` (request types), `tools`,
//! `grammars` (structured-output grammars compiled under bounds, cached) and
//! `error`, `capture` (token capture per episode, `/v1/episodes`), `feedback`
//! (rewards on episodes, stored for a learning server) and `versions` (a
//! learning server's promoted versions, rollback). This file holds the router and its middleware.

mod adapters;
pub mod capture;
mod chat;
mod completions;
mod error;
pub mod feedback;
mod generate;
mod grammars;
mod jobs;
mod protocol;
mod response;
mod responses;
mod state;
mod streaming;
mod tokens;
mod tools;
pub mod versions;

use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::json;

pub use error::OpenAiError;
pub use grammars::GrammarLimits;
pub use state::{EpisodeRubric, Learning, OpenAiState, ServeConfig};

use adapters::{list_models, load_lora, unload_lora};
use chat::chat_completions;
use completions::completions;
use generate::generate;
use responses::responses;

/// The router. `/health` and `/metrics` need no key; `/v1/*` and
/// `/inference/v1/generate` do when one is configured.
pub fn app(state: OpenAiState) -> Router {
    let v1 = Router::new()
        .route("/v1/models", get(list_models))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/responses", post(responses))
        .route("/v1/completions", post(completions))
        .route("/v1/generate", post(generate))
        .route("/inference/v1/generate", post(tokens::generate_tokens))
        .route("/v1/load_lora_adapter", post(load_lora))
        .route("/v1/unload_lora_adapter", post(unload_lora))
        .route("/v1/episodes", post(capture::create_episode))
        .route(
            "/v1/episodes/{id}",
            get(capture::get_episode).delete(capture::delete_episode),
        )
        .route("/v1/episodes/{id}/reward", post(feedback::reward_episode))
        .route("/v1/adapters/rollback", post(versions::rollback))
        .route("/v1/adapters/versions", get(versions::list_versions))
        // Per-episode base URLs (token capture): the same handlers, tagged.
        .route("/episodes/{episode}/v1/models", get(list_models))
        .route(
            "/episodes/{episode}/v1/chat/completions",
            post(chat_completions),
        )
        .route("/episodes/{episode}/v1/responses", post(responses))
        .route("/episodes/{episode}/v1/completions", post(completions))
        .route_layer(middleware::from_fn_with_state(state.clone(), auth));
    Router::new()
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .merge(v1)
        .fallback(not_found)
        .layer(middleware::from_fn(json_body_errors))
        .layer(axum::extract::DefaultBodyLimit::max(MAX_BODY_BYTES))
        .layer(middleware::from_fn_with_state(state.clone(), count))
        .with_state(state)
}

/// Largest request body `temper serve` reads.
pub const MAX_BODY_BYTES: usize = 2 << 20;

/// axum answers an over-long body with a plain-text 413; clients of an
/// OpenAI-compatible server expect OpenAI's JSON error.
async fn json_body_errors(req: Request, next: Next) -> Response {
    let resp = next.run(req).await;
    let is_json = resp
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("application/json"));
    if resp.status() == StatusCode::PAYLOAD_TOO_LARGE && !is_json {
        let body = json!({"error": {
            "message": format!("the request body is larger than this server accepts ({} MiB)", MAX_BODY_BYTES >> 20),
            "type": "invalid_request_error", "param": null, "code": "request_too_large",
        }});
        return (StatusCode::PAYLOAD_TOO_LARGE, axum::Json(body)).into_response();
    }
    resp
}

async fn auth(
    State(s): State<OpenAiState>,
    headers: HeaderMap,
    req: Request,
    next: Next,
) -> Response {
    if let Some(key) = &s.inner.cfg.api_key {
        let given = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "));
        // An episode's token stands in for the key on requests about that
        // episode (what an agent given only its episode's base URL sends).
        let episode_token = || {
            capture::named_episode(req.uri().path(), &headers)
                .is_some_and(|id| s.inner.captures.opens(&id, &headers).unwrap_or(false))
        };
        let key_ok = given.is_some_and(|g| capture::same_secret(g, key));
        if !key_ok && !episode_token() {
            return OpenAiError::Unauthorized(
                "Incorrect API key provided (send it as `Authorization: Bearer <key>`)".into(),
            )
            .into_response();
        }
    }
    next.run(req).await
}

const ROUTES: [&str; 10] = [
    "/v1/models",
    "/v1/chat/completions",
    "/v1/responses",
    "/v1/completions",
    "/v1/generate",
    "/inference/v1/generate",
    "/v1/load_lora_adapter",
    "/v1/unload_lora_adapter",
    "/health",
    "/metrics",
];

async fn count(State(s): State<OpenAiState>, req: Request, next: Next) -> Response {
    let route = ROUTES
        .iter()
        .copied()
        .find(|r| *r == req.uri().path())
        .unwrap_or("other");
    let resp = next.run(req).await;
    s.inner.metrics.count_request(route, resp.status().as_u16());
    resp
}

/// `ok` while the engine thread runs; 503 with the reason once it is gone
/// (every generation would fail).
async fn health(State(s): State<OpenAiState>) -> Response {
    match s.inner.scheduler.dead() {
        None => Json(json!({"status": "ok"})).into_response(),
        Some(why) => (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(json!({"status": "engine_dead", "reason": why})),
        )
            .into_response(),
    }
}

async fn metrics(State(s): State<OpenAiState>) -> Response {
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        s.inner.metrics.render(),
    )
        .into_response()
}

async fn not_found(req: Request) -> OpenAiError {
    OpenAiError::NotFound(format!("no route {} {}", req.method(), req.uri().path()))
}
