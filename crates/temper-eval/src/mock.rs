//! A mock OpenAI-compatible `/v1/chat/completions` server with fault
//! injection, for tests and for the orchestration benchmark (at zero
//! latency it measures the client side only).
//!
//! Answers are deterministic: a question `What is A op B?` is answered in
//! `<answer></answer>` tags, right for two prompts in three (by a hash of
//! the question) and off by one otherwise; anything else gets
//! `<answer>42</answer>`. With `tool_calls = true`, a request that offers
//! tools and has no tool result yet gets a `calculate` call first.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::HeaderMap;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::{json, Value};

/// Which requests fail, and how. Faults are assigned by request number:
/// request `i` (from 1) fails with the fault at `i % cycle` when that slot
/// names one, so retries of a request land on other slots.
#[derive(Debug, Clone, Default)]
pub struct Faults {
    /// Length of the cycle; 0 = no faults.
    pub cycle: u64,
    /// Slots answering 429 (with `Retry-After: 0`).
    pub too_many: Vec<u64>,
    /// Slots answering 500.
    pub server_error: Vec<u64>,
    /// Slots that hang for `hang` before answering.
    pub hang_slots: Vec<u64>,
    /// How long a hang lasts.
    pub hang: Duration,
    /// Slots answering 200 with a body that is not JSON.
    pub malformed: Vec<u64>,
    /// Slots that send headers, then drop the connection mid-body.
    pub drop: Vec<u64>,
}

impl Faults {
    /// Half the requests fail: one slot in ten each of 429, 500, hang,
    /// malformed JSON and dropped connection.
    pub fn chaos(hang: Duration) -> Self {
        Faults {
            cycle: 10,
            too_many: vec![1],
            server_error: vec![3],
            hang_slots: vec![5],
            hang,
            malformed: vec![7],
            drop: vec![9],
        }
    }
}

/// Mock settings.
#[derive(Debug, Clone, Default)]
pub struct MockConfig {
    /// Delay before every answer.
    pub latency: Duration,
    /// Fault plan.
    pub faults: Faults,
    /// Answer tool-offering requests with a `calculate` call first.
    pub tool_calls: bool,
    /// The ids `/v1/models` lists; empty lists `mock` (what the tests and
    /// benchmarks pass as `-m`).
    pub models: Vec<String>,
    /// When set, requests without `Authorization: Bearer KEY` get 401.
    pub api_key: Option<String>,
}

/// Request counters.
#[derive(Debug, Default)]
pub struct MockStats {
    /// Requests received.
    pub requests: AtomicU64,
    /// Requests answered with a fault.
    pub faults: AtomicU64,
    /// Requests answered normally.
    pub ok: AtomicU64,
}

#[derive(Clone)]
struct AppState {
    cfg: Arc<MockConfig>,
    stats: Arc<MockStats>,
}

/// The router (for `oneshot` tests or [`serve`]).
pub fn app(cfg: MockConfig, stats: Arc<MockStats>) -> Router {
    Router::new()
        .route("/v1/chat/completions", post(chat))
        .route("/chat/completions", post(chat))
        .route("/v1/models", get(models))
        .route("/models", get(models))
        .with_state(AppState {
            cfg: Arc::new(cfg),
            stats,
        })
}

/// Serve on `listener` until the process ends.
pub async fn serve(
    listener: tokio::net::TcpListener,
    cfg: MockConfig,
    stats: Arc<MockStats>,
) -> std::io::Result<()> {
    axum::serve(listener, app(cfg, stats)).await
}

/// Bind `127.0.0.1:0`, serve in a task, return the address and counters.
pub async fn spawn(cfg: MockConfig) -> std::io::Result<(SocketAddr, Arc<MockStats>)> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let stats = Arc::new(MockStats::default());
    let s = stats.clone();
    tokio::spawn(async move {
        if let Err(e) = serve(listener, cfg, s).await {
            tracing::error!("mock server: {e}");
        }
    });
    Ok((addr, stats))
}

fn hash(s: &str) -> u64 {
    temper_env::stable_hash(s.as_bytes())
}

/// The mock's answer text for a user message.
pub fn answer_for(question: &str) -> String {
    let parsed = question
        .strip_prefix("What is ")
        .and_then(|q| q.strip_suffix('?'))
        .and_then(temper_env::math::evaluate);
    match parsed {
        Some(v) => {
            let v = v.round() as i64;
            let v = if hash(question).is_multiple_of(3) {
                v + 1
            } else {
                v
            };
            format!("<answer>{v}</answer>")
        }
        None => "<answer>42</answer>".into(),
    }
}

/// 401 unless the request carries the configured key.
fn unauthorized(cfg: &MockConfig, headers: &HeaderMap) -> Option<Response> {
    let key = cfg.api_key.as_ref()?;
    let sent = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "));
    if sent == Some(key.as_str()) {
        return None;
    }
    Some(
        (
            StatusCode::UNAUTHORIZED,
            "{\"error\":{\"message\":\"Incorrect API key provided\"}}",
        )
            .into_response(),
    )
}

async fn models(State(st): State<AppState>, headers: HeaderMap) -> Response {
    if let Some(r) = unauthorized(&st.cfg, &headers) {
        return r;
    }
    let ids: Vec<&str> = if st.cfg.models.is_empty() {
        vec!["mock"]
    } else {
        st.cfg.models.iter().map(String::as_str).collect()
    };
    let data: Vec<Value> = ids
        .iter()
        .map(|id| json!({"id": id, "object": "model", "owned_by": "mock"}))
        .collect();
    Json(json!({"object": "list", "data": data})).into_response()
}

async fn chat(State(st): State<AppState>, headers: HeaderMap, body: Bytes) -> Response {
    if let Some(r) = unauthorized(&st.cfg, &headers) {
        return r;
    }
    let n = st.stats.requests.fetch_add(1, Ordering::Relaxed) + 1;
    if !st.cfg.latency.is_zero() {
        tokio::time::sleep(st.cfg.latency).await;
    }
    let f = &st.cfg.faults;
    if f.cycle > 0 {
        let slot = n % f.cycle;
        let fault = |v: &Vec<u64>| v.contains(&slot);
        if fault(&f.too_many) {
            st.stats.faults.fetch_add(1, Ordering::Relaxed);
            return (
                StatusCode::TOO_MANY_REQUESTS,
                [(header::RETRY_AFTER, "0")],
                "{\"error\":{\"message\":\"slow down\"}}",
            )
                .into_response();
        }
        if fault(&f.server_error) {
            st.stats.faults.fetch_add(1, Ordering::Relaxed);
            return (
                StatusCode::INTERNAL_SERVER_ERROR,
                "{\"error\":{\"message\":\"boom\"}}",
            )
                .into_response();
        }
        if fault(&f.hang_slots) {
            st.stats.faults.fetch_add(1, Ordering::Relaxed);
            tokio::time::sleep(f.hang).await;
        }
        if fault(&f.malformed) {
            st.stats.faults.fetch_add(1, Ordering::Relaxed);
            return (
                StatusCode::OK,
                [(header::CONTENT_TYPE, "application/json")],
                "{\"choices\": [{\"mess",
            )
                .into_response();
        }
        if fault(&f.drop) {
            st.stats.faults.fetch_add(1, Ordering::Relaxed);
            let chunks: Vec<Result<Bytes, std::io::Error>> = vec![
                Ok(Bytes::from_static(b"{\"choices\": [")),
                Err(std::io::Error::other("connection dropped by the mock")),
            ];
            return Response::builder()
                .header(header::CONTENT_TYPE, "application/json")
                .body(Body::from_stream(futures::stream::iter(chunks)))
                .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response());
        }
    }
    let req: Value = match serde_json::from_slice(&body) {
        Ok(v) => v,
        Err(e) => {
            return (
                StatusCode::BAD_REQUEST,
                format!("{{\"error\":{{\"message\":\"{e}\"}}}}"),
            )
                .into_response()
        }
    };
    let messages = req["messages"].as_array().cloned().unwrap_or_default();
    let prompt_chars: usize = messages
        .iter()
        .map(|m| m["content"].as_str().map_or(0, str::len))
        .sum();
    let question = messages
        .iter()
        .rev()
        .find(|m| m["role"] == "user")
        .and_then(|m| m["content"].as_str())
        .unwrap_or("")
        .to_string();
    let has_tool_result = messages.iter().any(|m| m["role"] == "tool");
    let offers_tools = req["tools"].as_array().is_some_and(|t| !t.is_empty());
    let message = if st.cfg.tool_calls && offers_tools && !has_tool_result {
        let expr = question
            .strip_prefix("What is ")
            .and_then(|q| q.strip_suffix('?'))
            .unwrap_or("1 + 1");
        json!({"role": "assistant", "content": null, "tool_calls": [{
            "id": format!("call_{n}"), "type": "function",
            "function": {"name": "calculate", "arguments": json!({"expression": expr}).to_string()}
        }]})
    } else if has_tool_result {
        let last_tool = messages
            .iter()
            .rev()
            .find(|m| m["role"] == "tool")
            .and_then(|m| m["content"].as_str())
            .unwrap_or("");
        json!({"role": "assistant", "content": format!("<answer>{last_tool}</answer>")})
    } else {
        json!({"role": "assistant", "content": answer_for(&question)})
    };
    let finish = if message.get("tool_calls").is_some() {
        "tool_calls"
    } else {
        "stop"
    };
    st.stats.ok.fetch_add(1, Ordering::Relaxed);
    Json(json!({
        "id": format!("mock-{n}"),
        "object": "chat.completion",
        "model": req["model"],
        "choices": [{"index": 0, "message": message, "finish_reason": finish}],
        "usage": {"prompt_tokens": prompt_chars / 4 + 1, "completion_tokens": 8, "total_tokens": prompt_chars / 4 + 9}
    }))
    .into_response()
}
