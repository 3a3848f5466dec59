//! The training API over HTTP, wire-compatible with the official `tinker`
//! Python SDK (`docs/tinker-protocol.md` is the spec we follow).
//!
//! Every training and sampling call is a *future*: the submit route answers
//! `{"request_id"}` at once and the client polls `retrieve_future`, which we
//! hold open (long-poll) until the result is ready. Work goes to one
//! [`temper_engine::Engine`], whose single ordered queue gives the per-model `seq_id`
//! ordering the SDK expects. Validation errors fail the future (HTTP 200
//! with `{"error", "category": "user"}`), so one bad request never poisons a
//! session and never skips a `seq_id`.
//!
//! One module per concern: `state` (settings, limits, the shared tables),
//! `futures` (results, eviction, `seq_id` dedupe, `retrieve_future`),
//! `sessions` (sessions and training models), `wire` (JSON and protobuf
//! request decoding), `training` (`forward_backward`, `optim_step`),
//! `checkpoints` (save / load and their checked paths) and `sampling`.

mod checkpoints;
mod futures;
mod sampling;
mod sessions;
mod state;
mod training;
mod wire;

use axum::extract::{Request, State};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::json;

use crate::error::ApiError;
use checkpoints::{load_weights, save_weights, save_weights_for_sampler};
use futures::retrieve_future;
use sampling::{asample, create_sampling_session, get_sampler};
use sessions::{
    capabilities, client_config, create_model, create_session, finish_session, get_info, heartbeat,
};
pub use state::{
    ApiConfig, ApiLimits, ApiState, BaseModel, ServedAdapter, LORA_ALPHA, PEFT_ADAPTER_PREFIX,
};
use training::{forward_backward, optim_step};

/// The router: every route under `/api/v1`, API-key checked.
pub fn app(state: ApiState) -> Router {
    Router::new()
        .route("/api/v1/healthz", get(healthz))
        .route("/api/v1/get_server_capabilities", get(capabilities))
        .route("/api/v1/client/config", post(client_config))
        .route(
            "/api/v1/client/dynamic_config",
            post(|| async { Json(json!({})) }),
        )
        .route("/api/v1/create_session", post(create_session))
        .route("/api/v1/session_heartbeat", post(heartbeat))
        .route(
            "/api/v1/telemetry",
            post(|| async { Json(json!({"status": "accepted"})) }),
        )
        .route("/api/v1/sessions/{session_id}/finish", post(finish_session))
        .route("/api/v1/create_model", post(create_model))
        .route("/api/v1/get_info", post(get_info))
        .route("/api/v1/forward_backward", post(forward_backward))
        .route("/api/v1/optim_step", post(optim_step))
        .route("/api/v1/save_weights", post(save_weights))
        .route("/api/v1/load_weights", post(load_weights))
        .route(
            "/api/v1/save_weights_for_sampler",
            post(save_weights_for_sampler),
        )
        .route(
            "/api/v1/create_sampling_session",
            post(create_sampling_session),
        )
        .route("/api/v1/samplers/{sampler_id}", get(get_sampler))
        .route("/api/v1/asample", post(asample))
        .route("/api/v1/retrieve_future", post(retrieve_future))
        .fallback(not_supported)
        .layer(axum::extract::DefaultBodyLimit::max(
            state.0.config.limits.max_body_bytes,
        ))
        .layer(middleware::from_fn_with_state(state.clone(), check_api_key))
        .with_state(state)
}

/// `ok` while the engine's worker runs; 503 with the reason once it is
/// gone (every training and sampling call would fail), as `/health` does
/// for the inference server.
async fn healthz(State(s): State<ApiState>) -> Response {
    match s.0.engine.dead() {
        None => Json(json!({"status": "ok"})).into_response(),
        Some(why) => (
            axum::http::StatusCode::SERVICE_UNAVAILABLE,
            Json(json!({"status": "engine_dead", "reason": why})),
        )
            .into_response(),
    }
}

async fn check_api_key(State(s): State<ApiState>, req: Request, next: Next) -> Response {
    if let Some(key) = &s.0.config.api_key {
        let given = req
            .headers()
            .get("x-api-key")
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default();
        if !crate::openai::capture::same_secret(given, key) {
            return ApiError::Unauthorized("missing or wrong X-API-Key".into()).into_response();
        }
    }
    next.run(req).await
}

async fn not_supported(req: Request) -> ApiError {
    ApiError::NotFound(format!(
        "{} {} is not supported by temper's training API",
        req.method(),
        req.uri().path()
    ))
}
