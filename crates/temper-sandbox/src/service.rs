//! The HTTP service: SandboxFusion-compatible `POST /run_code`, the
//! sessions API (`POST /sessions`, `GET /sessions`, `DELETE /sessions/{id}`,
//! `POST /sessions/{id}/exec`, `PUT`/`GET /sessions/{id}/files`),
//! `GET /health` and Prometheus `GET /metrics`. [`app`] builds the router
//! (tests drive it with `oneshot`); the binary only binds and serves.
//!
//! Limits: at most `concurrency` runs and session commands execute at once;
//! at most `max_queue` more wait for a slot (beyond that: 429 with
//! `Retry-After`); at most `max_sessions` sessions live. Sessions belong to
//! the `X-Client-Token` that created them: another token (or none) gets 404
//! for them and `GET /sessions` lists only the caller's own.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::extract::{rejection::JsonRejection, State};
use axum::extract::{Path, Query};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get, post, put};
use axum::{Json, Router};
use base64::Engine as _;
use serde::{Deserialize, Serialize};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::{
    ExecRequest, ExecResult, ExecStatus, Language, Pool, Sandbox, SandboxError, SessionConfig,
    Sessions,
};

/// Longest `run_timeout` accepted, in seconds.
pub const MAX_RUN_TIMEOUT_S: f64 = 300.0;
const B64: base64::engine::GeneralPurpose = base64::engine::general_purpose::STANDARD;

/// Where runs go: a warm pool, or a fresh sandbox per run.
#[derive(Clone)]
pub enum Runner {
    /// Fork from a warm worker (fast path).
    Pool(Arc<Pool>),
    /// New namespaces and interpreter per run.
    Cold(Arc<Sandbox>),
}

/// Counters behind `GET /metrics`.
#[derive(Default)]
struct Metrics {
    /// Indexed like [`Metrics::OUTCOMES`].
    runs: [AtomicU64; 6],
    run_micros: AtomicU64,
    queue_micros: AtomicU64,
    in_flight: AtomicU64,
    queued: AtomicU64,
}

impl Metrics {
    const OUTCOMES: [&'static str; 6] = [
        "success",
        "failed",
        "time_limit_exceeded",
        "bad_request",
        "sandbox_error",
        "rejected_busy",
    ];

    fn count(&self, outcome: usize) {
        self.runs[outcome].fetch_add(1, Ordering::Relaxed);
    }

    fn render(&self) -> String {
        let mut out = String::from(
            "# HELP temper_sandbox_runs_total Runs by outcome.\n# TYPE temper_sandbox_runs_total counter\n",
        );
        for (name, n) in Self::OUTCOMES.iter().zip(&self.runs) {
            out += &format!(
                "temper_sandbox_runs_total{{outcome=\"{name}\"}} {}\n",
                n.load(Ordering::Relaxed)
            );
        }
        out += &format!(
            "# HELP temper_sandbox_run_seconds_total Wall time spent running programs.\n\
             # TYPE temper_sandbox_run_seconds_total counter\n\
             temper_sandbox_run_seconds_total {}\n\
             # HELP temper_sandbox_queue_seconds_total Time requests waited for a run slot.\n\
             # TYPE temper_sandbox_queue_seconds_total counter\n\
             temper_sandbox_queue_seconds_total {}\n\
             # HELP temper_sandbox_in_flight Runs executing now.\n\
             # TYPE temper_sandbox_in_flight gauge\n\
             temper_sandbox_in_flight {}\n\
             # HELP temper_sandbox_queued Requests waiting for a run slot now.\n\
             # TYPE temper_sandbox_queued gauge\n\
             temper_sandbox_queued {}\n",
            self.run_micros.load(Ordering::Relaxed) as f64 / 1e6,
            self.queue_micros.load(Ordering::Relaxed) as f64 / 1e6,
            self.in_flight.load(Ordering::Relaxed),
            self.queued.load(Ordering::Relaxed),
        );
        out
    }
}

/// Limits and the key of the service (`temper sandbox serve` flags).
#[derive(Debug, Clone)]
pub struct ServiceConfig {
    /// Required as `Authorization: Bearer KEY` (or `X-API-Key`) on every
    /// route but `/health` and `/metrics` when set.
    pub api_key: Option<String>,
    /// Runs and session commands executing at once.
    pub concurrency: usize,
    /// Requests waiting for a slot; one more gets 429 with `Retry-After`.
    pub max_queue: usize,
    /// Live sessions at once; one more gets 429.
    pub max_sessions: usize,
}

impl Default for ServiceConfig {
    fn default() -> Self {
        ServiceConfig {
            api_key: None,
            concurrency: std::thread::available_parallelism().map_or(1, |n| n.get()),
            max_queue: DEFAULT_MAX_QUEUE,
            max_sessions: crate::session::DEFAULT_MAX_SESSIONS,
        }
    }
}

/// Default of [`ServiceConfig::max_queue`].
pub const DEFAULT_MAX_QUEUE: usize = 64;
/// Seconds a client is told to wait (`Retry-After`) when the queue is full.
pub const RETRY_AFTER_S: u64 = 1;
/// Header naming the client that owns a session.
pub const CLIENT_TOKEN_HEADER: &str = "x-client-token";
/// Longest accepted client token.
const MAX_CLIENT_TOKEN: usize = 256;

/// Shared state of the service.
#[derive(Clone)]
pub struct AppState {
    runner: Runner,
    sessions: Arc<Sessions>,
    api_key: Option<Arc<str>>,
    slots: Arc<Semaphore>,
    waiting: Arc<AtomicUsize>,
    max_queue: usize,
    metrics: Arc<Metrics>,
    venvs: Option<Arc<crate::Venvs>>,
}

impl AppState {
    /// The live sessions (for a periodic [`Sessions::reap`]).
    pub fn sessions(&self) -> &Arc<Sessions> {
        &self.sessions
    }

    fn sandbox(&self) -> Arc<Sandbox> {
        match &self.runner {
            Runner::Pool(pool) => pool.sandbox().clone(),
            Runner::Cold(sandbox) => sandbox.clone(),
        }
    }

    /// `api_key`: required as `Authorization: Bearer KEY` (or `X-API-Key`)
    /// when set; `concurrency`: runs executing at once; other limits at
    /// their defaults ([`ServiceConfig`]).
    pub fn new(runner: Runner, api_key: Option<String>, concurrency: usize) -> Self {
        AppState::with_config(
            runner,
            ServiceConfig {
                api_key,
                concurrency,
                ..ServiceConfig::default()
            },
        )
    }

    /// The state for `config`.
    pub fn with_config(runner: Runner, config: ServiceConfig) -> Self {
        AppState {
            runner,
            sessions: Arc::new(Sessions::with_limit(config.max_sessions)),
            api_key: config.api_key.map(Arc::from),
            slots: Arc::new(Semaphore::new(config.concurrency.max(1))),
            waiting: Arc::new(AtomicUsize::new(0)),
            max_queue: config.max_queue,
            metrics: Arc::new(Metrics::default()),
            venvs: None,
        }
    }

    /// Serve runs that declare `requirements` from these virtualenvs
    /// (without: such runs get 400).
    pub fn with_venvs(mut self, venvs: Arc<crate::Venvs>) -> Self {
        self.venvs = Some(venvs);
        self
    }

    /// A run slot, and how long we waited for it; 429 when `max_queue`
    /// requests are already waiting.
    async fn slot(&self) -> Result<(OwnedSemaphorePermit, Duration), ApiError> {
        let start = Instant::now();
        if let Ok(permit) = self.slots.clone().try_acquire_owned() {
            return Ok((permit, Duration::ZERO));
        }
        /// Counts a waiter until dropped (also when the client goes away).
        struct Waiting<'a>(&'a AtomicUsize, &'a AtomicU64);
        impl Drop for Waiting<'_> {
            fn drop(&mut self) {
                self.0.fetch_sub(1, Ordering::Relaxed);
                self.1.fetch_sub(1, Ordering::Relaxed);
            }
        }
        if self.waiting.fetch_add(1, Ordering::Relaxed) >= self.max_queue {
            self.waiting.fetch_sub(1, Ordering::Relaxed);
            return Err(ApiError::Busy(format!(
                "all run slots are busy and {} requests are queued; retry later",
                self.max_queue
            )));
        }
        self.metrics.queued.fetch_add(1, Ordering::Relaxed);
        let guard = Waiting(&self.waiting, &self.metrics.queued);
        let permit = self
            .slots
            .clone()
            .acquire_owned()
            .await
            .map_err(|e| ApiError::Internal(e.to_string()))?;
        drop(guard);
        let waited = start.elapsed();
        let micros = u64::try_from(waited.as_micros()).unwrap_or(u64::MAX);
        self.metrics
            .queue_micros
            .fetch_add(micros, Ordering::Relaxed);
        Ok((permit, waited))
    }
}

/// `POST /run_code` body (SandboxFusion field names).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct RunCodeRequest {
    /// Source code.
    pub code: String,
    /// `python` (or `python3`) or `bash`.
    pub language: String,
    /// Standard input.
    #[serde(default)]
    pub stdin: String,
    /// Files written into the work dir: relative path → base64 content.
    #[serde(default)]
    pub files: BTreeMap<String, String>,
    /// Wall-clock limit in seconds (default 10).
    #[serde(default)]
    pub run_timeout: Option<f64>,
    /// Accepted for compatibility; nothing is compiled.
    #[serde(default)]
    pub compile_timeout: Option<f64>,
    /// Address-space limit in MiB; absent or <= 0 = the server default.
    #[serde(default)]
    pub memory_limit_mb: Option<i64>,
    /// Files to return (relative paths), base64-encoded in `files`.
    #[serde(default)]
    pub fetch_files: Vec<String>,
    /// Python packages the run needs (pip requirement strings; a temper
    /// extension): the run uses a virtualenv with exactly these installed,
    /// built once per distinct list and cached by the service.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub requirements: Vec<String>,
}

impl RunCodeRequest {
    /// A request with defaults for everything but the program.
    pub fn new(language: Language, code: impl Into<String>) -> Self {
        RunCodeRequest {
            code: code.into(),
            language: language.name().into(),
            ..Default::default()
        }
    }
}

/// `run_result` of a response.
#[derive(Debug, Serialize, Deserialize)]
pub struct RunResult {
    /// `Finished`, `TimeLimitExceeded`, `MemoryLimitExceeded` (the run's
    /// processes together went over its memory limit; return code -9) or
    /// `Error`.
    pub status: String,
    /// Seconds.
    pub execution_time: f64,
    /// Exit code; minus the signal number when killed by one.
    pub return_code: Option<i32>,
    /// Captured stdout.
    pub stdout: String,
    /// Captured stderr.
    pub stderr: String,
}

/// `POST /run_code` response.
#[derive(Debug, Serialize, Deserialize)]
pub struct RunCodeResponse {
    /// `Success` (exit 0), `Failed` or `SandboxError`.
    pub status: String,
    /// Empty unless `SandboxError`.
    pub message: String,
    /// Always null: nothing is compiled.
    pub compile_result: Option<RunResult>,
    /// The run.
    pub run_result: Option<RunResult>,
    /// Fetched files, base64.
    pub files: BTreeMap<String, String>,
    /// Seconds the request waited for a run slot (not part of
    /// `run_result.execution_time`).
    #[serde(default)]
    pub queue_time: f64,
}

/// The service's error: client errors pass through with their message,
/// internal ones are logged and answered generically.
#[derive(Debug)]
enum ApiError {
    BadRequest(String),
    Unauthorized,
    NotFound(String),
    /// The queue is full: 429 with `Retry-After`.
    Busy(String),
    /// The session cap is reached: 429.
    TooManySessions(String),
    Internal(String),
}

impl From<SandboxError> for ApiError {
    fn from(e: SandboxError) -> Self {
        match e {
            SandboxError::InvalidRequest(m) => ApiError::BadRequest(m),
            e @ SandboxError::Requirements(_) => ApiError::BadRequest(e.to_string()),
            e @ SandboxError::SessionLimit { .. } => ApiError::TooManySessions(e.to_string()),
            other => ApiError::Internal(other.to_string()),
        }
    }
}

impl From<JsonRejection> for ApiError {
    fn from(e: JsonRejection) -> Self {
        ApiError::BadRequest(e.body_text())
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut retry_after = false;
        let (code, message) = match self {
            ApiError::BadRequest(m) => (StatusCode::BAD_REQUEST, m),
            ApiError::Busy(m) => {
                retry_after = true;
                (StatusCode::TOO_MANY_REQUESTS, m)
            }
            ApiError::TooManySessions(m) => (StatusCode::TOO_MANY_REQUESTS, m),
            ApiError::Unauthorized => (StatusCode::UNAUTHORIZED, "missing or wrong API key".into()),
            ApiError::NotFound(m) => (StatusCode::NOT_FOUND, m),
            ApiError::Internal(m) => {
                tracing::error!("sandbox error: {m}");
                (
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "internal sandbox error".into(),
                )
            }
        };
        let body = RunCodeResponse {
            status: "SandboxError".into(),
            message,
            compile_result: None,
            run_result: None,
            files: BTreeMap::new(),
            queue_time: 0.0,
        };
        let mut response = (code, Json(body)).into_response();
        if retry_after {
            response.headers_mut().insert(
                axum::http::header::RETRY_AFTER,
                axum::http::HeaderValue::from(RETRY_AFTER_S),
            );
        }
        response
    }
}

/// The router: `POST /run_code`, `GET /health`, `GET /metrics`.
pub fn app(state: AppState) -> Router {
    Router::new()
        .route("/run_code", post(run_code))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .route("/sessions", post(create_session).get(list_sessions))
        .route("/sessions/{id}", delete(delete_session))
        .route("/sessions/{id}/exec", post(session_exec))
        .route(
            "/sessions/{id}/files",
            put(session_upload).get(session_download),
        )
        .with_state(state)
}

async fn metrics(State(state): State<AppState>) -> String {
    state.metrics.render()
}

async fn health() -> Json<serde_json::Value> {
    Json(serde_json::json!({ "status": "ok" }))
}

fn authorized(state: &AppState, headers: &HeaderMap) -> bool {
    let Some(key) = &state.api_key else {
        return true;
    };
    let given = headers
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .or_else(|| headers.get("x-api-key").and_then(|v| v.to_str().ok()));
    given.is_some_and(|g| crate::secret::constant_time_eq(g.as_bytes(), key.as_bytes()))
}

fn to_exec_request(body: RunCodeRequest) -> Result<ExecRequest, ApiError> {
    let language = match body.language.as_str() {
        "python" | "python3" => Language::Python,
        "bash" | "sh" => Language::Bash,
        other => {
            return Err(ApiError::BadRequest(format!(
                "unsupported language {other:?} (supported: python, bash)"
            )))
        }
    };
    let timeout = body.run_timeout.unwrap_or(10.0);
    if !(timeout > 0.0 && timeout <= MAX_RUN_TIMEOUT_S) {
        return Err(ApiError::BadRequest(format!(
            "run_timeout must be in (0, {MAX_RUN_TIMEOUT_S}] seconds"
        )));
    }
    let mut req = ExecRequest::new(language, body.code);
    req.timeout = Duration::from_secs_f64(timeout);
    req.stdin = body.stdin.into_bytes();
    req.memory_limit_mb = body.memory_limit_mb.filter(|m| *m > 0).map(|m| m as u64);
    req.fetch_files = body.fetch_files;
    for (path, content) in body.files {
        let data = B64
            .decode(content.as_bytes())
            .map_err(|e| ApiError::BadRequest(format!("files[{path:?}] is not base64: {e}")))?;
        req.files.insert(path, data);
    }
    Ok(req)
}

fn to_response(r: ExecResult) -> RunCodeResponse {
    let (status, return_code) = match r.status {
        ExecStatus::TimeLimitExceeded => ("TimeLimitExceeded", None),
        ExecStatus::MemoryLimitExceeded => ("MemoryLimitExceeded", Some(-libc::SIGKILL)),
        ExecStatus::Signaled => ("Finished", r.signal.map(|s| -s)),
        _ => ("Finished", r.return_code),
    };
    let success = r.status == ExecStatus::Finished && r.return_code == Some(0);
    RunCodeResponse {
        status: if success { "Success" } else { "Failed" }.into(),
        message: String::new(),
        compile_result: None,
        run_result: Some(RunResult {
            status: status.into(),
            execution_time: r.execution_time.as_secs_f64(),
            return_code,
            stdout: r.stdout,
            stderr: r.stderr,
        }),
        files: r
            .files
            .into_iter()
            .map(|(k, v)| (k, B64.encode(v)))
            .collect(),
        queue_time: 0.0,
    }
}

async fn run_code(
    State(state): State<AppState>,
    headers: HeaderMap,
    body: Result<Json<RunCodeRequest>, JsonRejection>,
) -> Result<Json<RunCodeResponse>, ApiError> {
    let metrics = state.metrics.clone();
    let outcome = run_code_inner(state, headers, body).await;
    let index = match &outcome {
        Ok(r) if r.status == "Success" => 0,
        Ok(r)
            if r.run_result
                .as_ref()
                .is_some_and(|x| x.status == "TimeLimitExceeded") =>
        {
            2
        }
        Ok(_) => 1,
        Err(ApiError::Busy(_)) => 5,
        Err(
            ApiError::BadRequest(_)
            | ApiError::Unauthorized
            | ApiError::NotFound(_)
            | ApiError::TooManySessions(_),
        ) => 3,
        Err(ApiError::Internal(_)) => 4,
    };
    metrics.count(index);
    outcome
}

async fn run_code_inner(
    state: AppState,
    headers: HeaderMap,
    body: Result<Json<RunCodeRequest>, JsonRejection>,
) -> Result<Json<RunCodeResponse>, ApiError> {
    if !authorized(&state, &headers) {
        return Err(ApiError::Unauthorized);
    }
    let Json(body) = body?;
    let requirements = body.requirements.clone();
    let req = to_exec_request(body)?;
    // A run with requirements gets its virtualenv's own sandbox (built
    // before taking a run slot: a first build takes a while).
    let runner = if requirements.is_empty() {
        state.runner.clone()
    } else {
        let venvs = state.venvs.clone().ok_or_else(|| {
            ApiError::BadRequest(
                "this sandbox service installs no Python packages (`requirements`); \
                 start it without --no-requirements"
                    .into(),
            )
        })?;
        crate::check_requirements(&requirements)?;
        let sandbox = tokio::task::spawn_blocking(move || venvs.sandbox(&requirements))
            .await
            .map_err(|e| ApiError::Internal(e.to_string()))??;
        Runner::Cold(sandbox)
    };
    let (_slot, queued) = state.slot().await?;
    state.metrics.in_flight.fetch_add(1, Ordering::Relaxed);
    let result = tokio::task::spawn_blocking(move || match runner {
        Runner::Pool(pool) => pool.run(&req),
        Runner::Cold(sandbox) => sandbox.run(&req),
    })
    .await;
    state.metrics.in_flight.fetch_sub(1, Ordering::Relaxed);
    let result = result.map_err(|e| ApiError::Internal(e.to_string()))??;
    let micros = u64::try_from(result.execution_time.as_micros()).unwrap_or(u64::MAX);
    state
        .metrics
        .run_micros
        .fetch_add(micros, Ordering::Relaxed);
    let mut response = to_response(result);
    response.queue_time = queued.as_secs_f64();
    Ok(Json(response))
}

/// `POST /sessions` body.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct CreateSessionRequest {
    /// Address-space limit per command in MiB.
    #[serde(default)]
    pub memory_mb: Option<u64>,
    /// Lifetime in seconds (default 3600).
    #[serde(default)]
    pub timeout: Option<f64>,
    /// Idle timeout in seconds (default 600).
    #[serde(default)]
    pub idle_timeout: Option<f64>,
    /// Environment for every command.
    #[serde(default)]
    pub env: BTreeMap<String, String>,
}

/// `POST /sessions/{id}/exec` body.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct SessionExecRequest {
    /// A bash command line.
    pub command: String,
    /// Working directory relative to `/work`.
    #[serde(default)]
    pub cwd: Option<String>,
    /// Extra environment for this command.
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// Seconds (default 10).
    #[serde(default)]
    pub timeout: Option<f64>,
}

/// `POST /sessions/{id}/exec` response.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SessionExecResponse {
    /// `Finished`, `TimeLimitExceeded` or `MemoryLimitExceeded`.
    pub status: String,
    /// Exit code (minus the signal number when killed by one).
    pub exit_code: Option<i32>,
    /// Captured stdout.
    pub stdout: String,
    /// Captured stderr.
    pub stderr: String,
    /// Seconds the command ran.
    #[serde(default)]
    pub execution_time: f64,
    /// Seconds it waited for a run slot before that.
    #[serde(default)]
    pub queue_time: f64,
}

/// Body of `PUT /sessions/{id}/files` and answer of `GET`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SessionFile {
    /// Path relative to `/work`.
    pub path: String,
    /// Base64 content.
    pub content: String,
}

/// Query of `GET /sessions/{id}/files`.
#[derive(Debug, Deserialize)]
pub struct FileQuery {
    /// Path relative to `/work`.
    pub path: String,
}

fn seconds(value: Option<f64>, default: f64, what: &str) -> Result<Duration, ApiError> {
    let v = value.unwrap_or(default);
    if !(v > 0.0 && v.is_finite() && v <= 7.0 * 24.0 * 3600.0) {
        return Err(ApiError::BadRequest(format!(
            "{what} must be a positive number of seconds"
        )));
    }
    Ok(Duration::from_secs_f64(v))
}

/// The caller's `X-Client-Token` (which owns the sessions it creates).
fn client_token(headers: &HeaderMap) -> Result<Option<String>, ApiError> {
    let Some(value) = headers.get(CLIENT_TOKEN_HEADER) else {
        return Ok(None);
    };
    let token = value
        .to_str()
        .map_err(|_| ApiError::BadRequest("X-Client-Token must be visible ASCII".into()))?;
    if token.is_empty() || token.len() > MAX_CLIENT_TOKEN {
        return Err(ApiError::BadRequest(format!(
            "X-Client-Token must be 1 to {MAX_CLIENT_TOKEN} characters"
        )));
    }
    Ok(Some(token.to_string()))
}

/// The session `id` when it belongs to the caller; 404 otherwise (the same
/// answer as for an id that does not exist).
async fn session(
    state: &AppState,
    headers: &HeaderMap,
    id: String,
) -> Result<Arc<crate::Session>, ApiError> {
    let owner = client_token(headers)?;
    let sessions = state.sessions.clone();
    blocking(move || Ok(sessions.get_owned(&id, owner.as_deref()).ok_or(id)))
        .await?
        .map_err(|id| ApiError::NotFound(format!("no session {id:?} (expired or deleted?)")))
}

async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, SandboxError> + Send + 'static,
) -> Result<T, ApiError> {
    Ok(tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| ApiError::Internal(e.to_string()))??)
}

async fn create_session(
    State(state): State<AppState>,
    headers: HeaderMap,
    body: Result<Json<CreateSessionRequest>, JsonRejection>,
) -> Result<Json<serde_json::Value>, ApiError> {
    if !authorized(&state, &headers) {
        return Err(ApiError::Unauthorized);
    }
    let Json(body) = body?;
    let config = SessionConfig {
        memory_mb: body.memory_mb,
        env: body.env,
        timeout: seconds(body.timeout, 3600.0, "timeout")?,
        idle_timeout: seconds(body.idle_timeout, 600.0, "idle_timeout")?,
    };
    let owner = client_token(&headers)?;
    let sandbox = state.sandbox();
    let sessions = state.sessions.clone();
    let id = blocking(move || sessions.create_owned(sandbox, config, owner.as_deref())).await?;
    Ok(Json(serde_json::json!({ "id": id })))
}

async fn list_sessions(
    State(state): State<AppState>,
    headers: HeaderMap,
) -> Result<Json<serde_json::Value>, ApiError> {
    if !authorized(&state, &headers) {
        return Err(ApiError::Unauthorized);
    }
    let Some(owner) = client_token(&headers)? else {
        return Err(ApiError::BadRequest(
            "GET /sessions lists the caller's own sessions: send the X-Client-Token \
             the sessions were created with"
                .into(),
        ));
    };
    Ok(Json(
        serde_json::json!({ "sessions": state.sessions.list_owned(&owner) }),
    ))
}

async fn delete_session(
    State(state): State<AppState>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Result<StatusCode, ApiError> {
    if !authorized(&state, &headers) {
        return Err(ApiError::Unauthorized);
    }
    let owner = client_token(&headers)?;
    let sessions = state.sessions.clone();
    // Dropping the session kills its sandbox: off the async threads.
    let removed = blocking(move || Ok(sessions.delete_owned(&id, owner.as_deref()))).await?;
    if removed {
        Ok(StatusCode::NO_CONTENT)
    } else {
        Err(ApiError::NotFound("no such session".into()))
    }
}

async fn session_exec(
    State(state): State<AppState>,
    headers: HeaderMap,
    Path(id): Path<String>,
    body: Result<Json<SessionExecRequest>, JsonRejection>,
) -> Result<Json<SessionExecResponse>, ApiError> {
    if !authorized(&state, &headers) {
        return Err(ApiError::Unauthorized);
    }
    let Json(body) = body?;
    let timeout = seconds(body.timeout, 10.0, "timeout")?;
    if timeout.as_secs_f64() > MAX_RUN_TIMEOUT_S {
        return Err(ApiError::BadRequest(format!(
            "timeout must be at most {MAX_RUN_TIMEOUT_S} seconds"
        )));
    }
    let session = session(&state, &headers, id).await?;
    // Session commands share the run slots (and queue) with /run_code.
    let (_slot, queued) = state.slot().await?;
    let r = blocking(move || session.exec(&body.command, body.cwd.as_deref(), &body.env, timeout))
        .await?;
    let (status, exit_code) = match r.status {
        ExecStatus::TimeLimitExceeded => ("TimeLimitExceeded", None),
        ExecStatus::MemoryLimitExceeded => ("MemoryLimitExceeded", Some(-libc::SIGKILL)),
        ExecStatus::Signaled => ("Finished", r.signal.map(|s| -s)),
        _ => ("Finished", r.return_code),
    };
    Ok(Json(SessionExecResponse {
        status: status.into(),
        exit_code,
        stdout: r.stdout,
        stderr: r.stderr,
        execution_time: r.execution_time.as_secs_f64(),
        queue_time: queued.as_secs_f64(),
    }))
}

async fn session_upload(
    State(state): State<AppState>,
    headers: HeaderMap,
    Path(id): Path<String>,
    body: Result<Json<SessionFile>, JsonRejection>,
) -> Result<StatusCode, ApiError> {
    if !authorized(&state, &headers) {
        return Err(ApiError::Unauthorized);
    }
    let Json(file) = body?;
    crate::sandbox::relative_path(&file.path)?;
    let data = B64
        .decode(file.content.as_bytes())
        .map_err(|e| ApiError::BadRequest(format!("content is not base64: {e}")))?;
    let session = session(&state, &headers, id).await?;
    let (_slot, _queued) = state.slot().await?;
    blocking(move || session.upload(&file.path, data)).await?;
    Ok(StatusCode::NO_CONTENT)
}

async fn session_download(
    State(state): State<AppState>,
    headers: HeaderMap,
    Path(id): Path<String>,
    query: Result<Query<FileQuery>, axum::extract::rejection::QueryRejection>,
) -> Result<Json<SessionFile>, ApiError> {
    if !authorized(&state, &headers) {
        return Err(ApiError::Unauthorized);
    }
    let Query(q) = query.map_err(|e| ApiError::BadRequest(e.body_text()))?;
    let session = session(&state, &headers, id).await?;
    let path = q.path.clone();
    match blocking(move || session.download(&path)).await? {
        Some(data) => Ok(Json(SessionFile {
            path: q.path,
            content: B64.encode(data),
        })),
        None => Err(ApiError::NotFound(format!("no regular file {:?}", q.path))),
    }
}
