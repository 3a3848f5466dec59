//! The OpenAI-compatible inference server: `/v1/chat/completions`,
//! `/v1/completions`, `/v1/models`, the token-in / token-out `/v1/generate`
//! for RL, vLLM's `/v1/load_lora_adapter` and `/v1/unload_lora_adapter`,
//! `/health` and Prometheus `/metrics`.
//!
//! Every generation request becomes [`Job`]s on the continuous-batching
//! [`Scheduler`]. The `model` field picks the base model or a loaded LoRA
//! adapter; the adapter is resolved once, when the request arrives, so a
//! request runs start to finish on the version it started with even if the
//! name is reloaded meanwhile. Every response says which version produced
//! it: `"version"` (0 = base model, else the adapter's load count) and
//! `"system_fingerprint": "<model>@v<version>"`.
//!
//! Logprobs are computed after a sample finishes, by
//! [`temper_model::Model::score_with_top`] — the trainer's forward — so they
//! equal what training computes for the same tokens bit for bit. They are
//! of the sampling distribution `log softmax(logits / T)` (T = 1 for greedy),
//! before top-k / top-p. When streaming, a choice's logprobs arrive with its
//! last chunk.

mod error;
mod protocol;
mod tools;

use std::collections::HashMap;
use std::collections::VecDeque;
use std::convert::Infallible;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::{json, Map, Value};
use temper_model::{LoraAdapter, Pretrained, TopLogprobs};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};

pub use error::OpenAiError;
use protocol::{
    max_tokens_field, parse_body, top_logprobs_field, ChatRequest, CompletionRequest,
    GenerateRequest, LoadLoraRequest, PromptInput, Sampling, SamplingDefaults, UnloadLoraRequest,
};

use crate::metrics::Metrics;
use crate::scheduler::{
    Event, Finished, Job, LoadedAdapter, Scheduler, SchedulerConfig, SubmitError,
};

/// Server settings.
#[derive(Debug, Clone)]
pub struct ServeConfig {
    /// The name of the base model in `model` fields and `/v1/models`.
    pub model_name: String,
    /// Required bearer token on `/v1/*`; `None` accepts any.
    pub api_key: Option<String>,
    /// Scheduler limits.
    pub scheduler: SchedulerConfig,
    /// Directories `POST /v1/load_lora_adapter` may load adapters from
    /// (canonical paths); empty: loading at run time is off.
    pub lora_roots: Vec<PathBuf>,
}

impl ServeConfig {
    /// Defaults for `model`: 256 running sequences, a KV budget of 4 GiB of
    /// cache (at least one full-length sequence), 1024 queued requests,
    /// 512 prompt tokens prefilled per step.
    pub fn defaults(model_name: impl Into<String>, model: &Pretrained) -> Self {
        let cfg = &model.config;
        let max_model_len = cfg.max_position_embeddings;
        let bytes_per_token = 2
            * cfg.num_layers
            * cfg.num_kv_heads
            * cfg.head_dim
            * model.model.dtype().size_in_bytes();
        let kv_budget_tokens = ((4usize << 30) / bytes_per_token.max(1)).max(max_model_len);
        Self {
            model_name: model_name.into(),
            api_key: None,
            lora_roots: Vec::new(),
            scheduler: SchedulerConfig {
                max_running: 256,
                kv_budget_tokens,
                max_queue: 1024,
                max_model_len,
                max_prefill_tokens: 512,
            },
        }
    }
}

/// Shared state: the model, its scheduler, the adapters.
#[derive(Clone)]
pub struct OpenAiState {
    inner: Arc<Inner>,
}

struct Inner {
    model: Arc<Pretrained>,
    cfg: ServeConfig,
    scheduler: Scheduler,
    adapters: RwLock<HashMap<String, Arc<LoadedAdapter>>>,
    /// Load counts per name; kept across unloads so versions never repeat.
    versions: Mutex<HashMap<String, u64>>,
    metrics: Arc<Metrics>,
    defaults: SamplingDefaults,
    created: u64,
    next_id: AtomicU64,
}

fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

impl OpenAiState {
    /// Start the scheduler over `model`.
    pub fn new(model: Arc<Pretrained>, cfg: ServeConfig) -> Self {
        let metrics = Arc::new(Metrics::default());
        let mut sched = cfg.scheduler.clone();
        sched.max_model_len = sched
            .max_model_len
            .clamp(2, model.config.max_position_embeddings.max(2));
        let scheduler = Scheduler::start(model.clone(), sched.clone(), metrics.clone());
        let defaults = SamplingDefaults {
            temperature: model.generation.temperature,
            top_p: model.generation.top_p,
            top_k: model.generation.top_k,
        };
        let start = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        Self {
            inner: Arc::new(Inner {
                model,
                cfg: ServeConfig {
                    scheduler: sched,
                    ..cfg
                },
                scheduler,
                adapters: RwLock::new(HashMap::new()),
                versions: Mutex::new(HashMap::new()),
                metrics,
                defaults,
                created: now_secs(),
                next_id: AtomicU64::new(start & 0xffff_ffff_ffff),
            }),
        }
    }

    /// The metrics registry.
    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.inner.metrics
    }

    /// A client's `lora_path`, allowed only inside a configured root. The
    /// error is the same whether or not the path exists, so it reveals
    /// nothing about the server's files.
    fn adapter_dir_in_roots(&self, path: &str) -> Result<PathBuf, OpenAiError> {
        let roots = &self.inner.cfg.lora_roots;
        if roots.is_empty() {
            return Err(OpenAiError::invalid(
                "lora_path",
                "loading adapters at run time is off: start temper serve with --lora-root DIR",
            ));
        }
        std::path::Path::new(path)
            .canonicalize()
            .ok()
            .filter(|p| p.is_dir() && roots.iter().any(|r| p.starts_with(r)))
            .ok_or_else(|| {
                OpenAiError::invalid(
                    "lora_path",
                    format!("lora_path {path:?} is not an adapter directory under a --lora-root"),
                )
            })
    }

    /// Load (or atomically replace) adapter `name` from a PEFT directory;
    /// blocking (reads files). Returns the new version.
    pub fn load_adapter(&self, name: &str, dir: &std::path::Path) -> Result<u64, OpenAiError> {
        if name.is_empty() {
            return Err(OpenAiError::invalid(
                "lora_name",
                "lora_name must not be empty",
            ));
        }
        if name == self.inner.cfg.model_name {
            return Err(OpenAiError::invalid(
                "lora_name",
                format!("lora_name {name:?} is the base model's name"),
            ));
        }
        let m = &self.inner.model;
        let lora = LoraAdapter::load_peft(dir, &m.config, m.model.dtype(), m.model.device())
            .map_err(|e| {
                OpenAiError::invalid(
                    "lora_path",
                    format!("cannot load LoRA adapter from {}: {e}", dir.display()),
                )
            })?
            .inference_view();
        let mut versions = self
            .inner
            .versions
            .lock()
            .map_err(|_| OpenAiError::Internal("adapter versions lock poisoned".into()))?;
        let version = versions.get(name).copied().unwrap_or(0) + 1;
        let adapter = Arc::new(LoadedAdapter {
            name: name.to_string(),
            version,
            lora,
        });
        self.inner
            .adapters
            .write()
            .map_err(|_| OpenAiError::Internal("adapter table lock poisoned".into()))?
            .insert(name.to_string(), adapter);
        versions.insert(name.to_string(), version);
        self.inner
            .metrics
            .adapter_loads
            .fetch_add(1, Ordering::Relaxed);
        tracing::info!(name, version, dir = %dir.display(), "loaded LoRA adapter");
        Ok(version)
    }

    fn resolve(&self, model: &str) -> Result<Option<Arc<LoadedAdapter>>, OpenAiError> {
        if model == self.inner.cfg.model_name {
            return Ok(None);
        }
        let table = self
            .inner
            .adapters
            .read()
            .map_err(|_| OpenAiError::Internal("adapter table lock poisoned".into()))?;
        match table.get(model) {
            Some(a) => Ok(Some(a.clone())),
            None => Err(OpenAiError::NotFound(format!(
                "The model `{model}` does not exist. Served: {}",
                std::iter::once(self.inner.cfg.model_name.as_str())
                    .chain(table.keys().map(String::as_str))
                    .collect::<Vec<_>>()
                    .join(", ")
            ))),
        }
    }

    fn request_id(&self, prefix: &str) -> String {
        let n = self.inner.next_id.fetch_add(1, Ordering::Relaxed);
        format!("{prefix}-{n:016x}")
    }
}

/// The router. `/health` and `/metrics` need no key; `/v1/*` does when one
/// is configured.
pub fn app(state: OpenAiState) -> Router {
    let v1 = Router::new()
        .route("/v1/models", get(list_models))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/completions", post(completions))
        .route("/v1/generate", post(generate))
        .route("/v1/load_lora_adapter", post(load_lora))
        .route("/v1/unload_lora_adapter", post(unload_lora))
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
        if given != Some(key.as_str()) {
            return OpenAiError::Unauthorized(
                "Incorrect API key provided (send it as `Authorization: Bearer <key>`)".into(),
            )
            .into_response();
        }
    }
    next.run(req).await
}

const ROUTES: [&str; 8] = [
    "/v1/models",
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/generate",
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

async fn health() -> Json<Value> {
    Json(json!({"status": "ok"}))
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

async fn list_models(State(s): State<OpenAiState>) -> Result<Json<Value>, OpenAiError> {
    let base = &s.inner.cfg.model_name;
    let len = s.inner.cfg.scheduler.max_model_len;
    let mut data = vec![json!({
        "id": base, "object": "model", "created": s.inner.created, "owned_by": "temper",
        "root": base, "parent": null,
        "max_model_len": len, "version": 0,
    })];
    let table = s
        .inner
        .adapters
        .read()
        .map_err(|_| OpenAiError::Internal("adapter table lock poisoned".into()))?;
    let mut names: Vec<&String> = table.keys().collect();
    names.sort();
    for n in names {
        let a = &table[n];
        data.push(json!({
            "id": n, "object": "model", "created": s.inner.created, "owned_by": "temper",
            "root": n, "parent": base, "max_model_len": len, "version": a.version,
        }));
    }
    Ok(Json(json!({"object": "list", "data": data})))
}

async fn load_lora(State(s): State<OpenAiState>, body: Bytes) -> Result<Json<Value>, OpenAiError> {
    let req: LoadLoraRequest = parse_body(&body)?;
    let dir = s.adapter_dir_in_roots(&req.lora_path)?;
    let st = s.clone();
    let name = req.lora_name.clone();
    let version = tokio::task::spawn_blocking(move || st.load_adapter(&name, &dir))
        .await
        .map_err(|e| OpenAiError::Internal(format!("adapter load task: {e}")))??;
    Ok(Json(json!({
        "lora_name": req.lora_name, "lora_path": req.lora_path, "version": version,
        "status": if version == 1 { "loaded" } else { "swapped" },
    })))
}

async fn unload_lora(
    State(s): State<OpenAiState>,
    body: Bytes,
) -> Result<Json<Value>, OpenAiError> {
    let req: UnloadLoraRequest = parse_body(&body)?;
    let removed = s
        .inner
        .adapters
        .write()
        .map_err(|_| OpenAiError::Internal("adapter table lock poisoned".into()))?
        .remove(&req.lora_name);
    match removed {
        Some(a) => Ok(Json(json!({
            "lora_name": req.lora_name, "version": a.version, "status": "unloaded",
        }))),
        None => Err(OpenAiError::NotFound(format!(
            "no LoRA adapter named {:?} is loaded",
            req.lora_name
        ))),
    }
}

/// A request ready for the scheduler.
struct Prepared {
    prompts: Vec<Vec<u32>>,
    sampling: Sampling,
    adapter: Option<Arc<LoadedAdapter>>,
    model_name: String,
    version: u64,
    top_logprobs: usize,
    logprobs: bool,
}

impl Prepared {
    fn fingerprint(&self) -> String {
        format!("{}@v{}", self.model_name, self.version)
    }

    fn prompt_tokens(&self) -> usize {
        self.prompts.iter().map(Vec::len).sum()
    }

    fn total_choices(&self) -> usize {
        self.prompts.len() * self.sampling.n
    }
}

/// Resolve the model, check lengths, settle `max_tokens`.
fn prepare(
    s: &OpenAiState,
    model: &str,
    prompts: Vec<Vec<u32>>,
    mut sampling: Sampling,
    max_tokens: Option<usize>,
    default_max_tokens: Option<usize>,
    what: &str,
) -> Result<Prepared, OpenAiError> {
    let adapter = s.resolve(model)?;
    let len = s.inner.cfg.scheduler.max_model_len;
    let vocab = s.inner.model.config.vocab_size;
    let budget = s.inner.cfg.scheduler.kv_budget_tokens;
    let n = sampling.n;
    let mut settled = usize::MAX;
    for p in &prompts {
        if p.is_empty() {
            return Err(OpenAiError::invalid(
                "prompt",
                "the prompt must not be empty",
            ));
        }
        if let Some(&bad) = p.iter().find(|&&t| t as usize >= vocab) {
            return Err(OpenAiError::invalid(
                "prompt",
                format!("token id {bad} is out of range for vocabulary size {vocab}"),
            ));
        }
        let exceeded = |requested: String| {
            OpenAiError::BadRequest {
            message: format!(
                "This model's maximum context length is {len} tokens. However, you requested {requested}. Please reduce the length of the {what} or completion."
            ),
            param: Some("messages"),
            code: Some("context_length_exceeded"),
        }
        };
        if p.len() >= len {
            return Err(exceeded(format!(
                "{} tokens in the {what}, which leaves no room for a completion",
                p.len()
            )));
        }
        let m = match max_tokens {
            Some(m) => {
                if p.len() + m > len {
                    return Err(exceeded(format!(
                        "{} tokens ({} in the {what}, {m} in the completion)",
                        p.len() + m,
                        p.len()
                    )));
                }
                m
            }
            None => {
                // Unset: the rest of the context (capped by `default_max_tokens`),
                // shrunk to what the KV budget can ever hold.
                let rest = len - p.len();
                let rest = default_max_tokens.map_or(rest, |d| d.min(rest));
                let fits = (budget / n).saturating_sub(p.len());
                rest.min(fits).max(1)
            }
        };
        settled = settled.min(m);
    }
    sampling.params.max_tokens = settled;
    let (model_name, version) = match &adapter {
        Some(a) => (a.name.clone(), a.version),
        None => (s.inner.cfg.model_name.clone(), 0),
    };
    Ok(Prepared {
        prompts,
        sampling,
        adapter,
        model_name,
        version,
        top_logprobs: 0,
        logprobs: false,
    })
}

/// Queue every prompt of `p` on one event channel (choice index =
/// prompt index × n + sample index).
fn submit(
    s: &OpenAiState,
    p: &Prepared,
    stream: bool,
) -> Result<UnboundedReceiver<Event>, OpenAiError> {
    // Each prompt is queued as one job: a request with more prompts than the
    // queue holds could never be admitted, so it is a 400, not a "retry".
    // (`--max-queue 0` is draining: every request is a 503.)
    let max_queue = s.inner.scheduler.config().max_queue;
    if p.prompts.len() > max_queue.max(1) {
        return Err(OpenAiError::BadRequest {
            message: format!(
                "this request has {} prompts; the server queues at most {max_queue} (--max-queue): split it",
                p.prompts.len()
            ),
            param: Some("prompt"),
            code: None,
        });
    }
    let (tx, rx) = unbounded_channel();
    for (i, prompt) in p.prompts.iter().enumerate() {
        let job = Job {
            prompt: prompt.clone(),
            n: p.sampling.n,
            first_index: i * p.sampling.n,
            params: p.sampling.params.clone(),
            adapter: p.adapter.clone(),
            stream,
            events: tx.clone(),
        };
        s.inner.scheduler.submit(job).map_err(|e| match e {
            SubmitError::Overloaded { .. } => OpenAiError::Overloaded(e.to_string()),
            SubmitError::TooLarge { .. } => OpenAiError::BadRequest {
                message: e.to_string(),
                param: Some("max_tokens"),
                code: Some("context_length_exceeded"),
            },
            _ => OpenAiError::Internal(e.to_string()),
        })?;
    }
    Ok(rx)
}

/// Wait for every choice; `Finished` in choice order.
async fn collect(
    s: &OpenAiState,
    mut rx: UnboundedReceiver<Event>,
    total: usize,
    started: Instant,
) -> Result<Vec<Finished>, OpenAiError> {
    let mut out: Vec<Option<Finished>> = vec![None; total];
    let mut left = total;
    let mut first = true;
    while left > 0 {
        match rx.recv().await {
            Some(Event::Done(f)) => {
                if first {
                    s.inner
                        .metrics
                        .ttft
                        .observe(started.elapsed().as_secs_f64());
                    first = false;
                }
                let i = f.index;
                if i < total && out[i].is_none() {
                    out[i] = Some(f);
                    left -= 1;
                }
            }
            Some(Event::Delta { .. }) => {}
            Some(Event::Failed(m)) => return Err(OpenAiError::Internal(m)),
            None => return Err(OpenAiError::Internal("the engine dropped a request".into())),
        }
    }
    s.inner
        .metrics
        .latency
        .observe(started.elapsed().as_secs_f64());
    Ok(out.into_iter().flatten().collect())
}

/// Canonical logprobs of `tokens` after `prompt` (see the module docs);
/// `prompt_too`: also of the prompt's tokens 1.. (for `echo`).
async fn score(
    s: &OpenAiState,
    adapter: Option<Arc<LoadedAdapter>>,
    prompt: Vec<u32>,
    tokens: Vec<u32>,
    temperature: f64,
    k: usize,
    prompt_too: bool,
) -> Result<TopLogprobs, OpenAiError> {
    let model = s.inner.model.clone();
    let t = if temperature > 0.0 { temperature } else { 1.0 };
    tokio::task::spawn_blocking(move || {
        let full: Vec<u32> = prompt.iter().chain(&tokens).copied().collect();
        let lora = adapter.as_ref().map(|a| &a.lora);
        let mut r = model
            .model
            .score_with_top(&full[..full.len() - 1], &full[1..], lora, t, k)?;
        if !prompt_too {
            let skip = r.logprobs.len() - tokens.len();
            r.logprobs.drain(..skip);
            r.top.drain(..skip);
        }
        Ok::<_, temper_model::ModelError>(r)
    })
    .await
    .map_err(|e| OpenAiError::Internal(format!("scoring task: {e}")))?
    .map_err(|e| OpenAiError::Internal(format!("scoring: {e}")))
}

fn token_text(s: &OpenAiState, id: u32) -> String {
    s.inner
        .model
        .tokenizer
        .decode(&[id], false)
        .unwrap_or_default()
}

/// Chat-style logprobs: `{"content": [{token, logprob, bytes, top_logprobs}]}`.
fn chat_logprobs(s: &OpenAiState, tokens: &[u32], lp: &TopLogprobs) -> Value {
    let entry = |id: u32, logprob: f32| {
        let t = token_text(s, id);
        json!({"token": t, "logprob": logprob, "bytes": t.as_bytes()})
    };
    let content: Vec<Value> = tokens
        .iter()
        .zip(&lp.logprobs)
        .zip(&lp.top)
        .map(|((&id, &logprob), top)| {
            let mut e = entry(id, logprob);
            e["top_logprobs"] = Value::Array(top.iter().map(|&(t, l)| entry(t, l)).collect());
            e
        })
        .collect();
    json!({"content": content})
}

/// A token's logprob and its top alternatives (`None`: the first prompt token).
type TokenEntry = Option<(f32, Vec<(u32, f32)>)>;

/// Completions-style logprobs over `tokens` (with `first_is_prompt_start`,
/// the first token has no logprob: nothing precedes it).
fn completion_logprobs(
    s: &OpenAiState,
    tokens: &[u32],
    lp: &[TokenEntry],
    text_start: usize,
) -> Value {
    let mut offset = text_start;
    let mut toks = Vec::new();
    let mut offsets = Vec::new();
    for &id in tokens {
        let t = token_text(s, id);
        offsets.push(offset);
        offset += t.len();
        toks.push(t);
    }
    let token_logprobs: Vec<Value> = lp.iter().map(|e| json!(e.as_ref().map(|x| x.0))).collect();
    let top: Vec<Value> = lp
        .iter()
        .map(|e| match e {
            None => Value::Null,
            Some((_, top)) => {
                let mut m = Map::new();
                for &(t, l) in top {
                    m.insert(token_text(s, t), json!(l));
                }
                Value::Object(m)
            }
        })
        .collect();
    json!({"tokens": toks, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets})
}

fn usage(prompt: usize, completion: usize) -> Value {
    json!({"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion})
}

/// Tool settings of a chat request.
struct ToolMode {
    parse: bool,
}

/// Render the chat prompt.
fn chat_prompt(s: &OpenAiState, req: &ChatRequest) -> Result<(Vec<u32>, ToolMode), OpenAiError> {
    let tmpl =
        s.inner.model.chat_template.as_ref().ok_or_else(|| {
            OpenAiError::bad("this model has no chat template; use /v1/completions")
        })?;
    if req.messages.is_empty() {
        return Err(OpenAiError::invalid(
            "messages",
            "messages must not be empty",
        ));
    }
    let mut messages = Vec::with_capacity(req.messages.len());
    for (i, m) in req.messages.iter().enumerate() {
        messages.push(normalize_message(i, m)?);
    }
    let tools = req.tools.clone().filter(|t| !t.is_empty());
    let parse = match &req.tool_choice {
        None => true,
        Some(Value::String(c)) if c == "auto" => true,
        Some(Value::String(c)) if c == "none" => false,
        Some(other) => {
            return Err(OpenAiError::invalid(
                "tool_choice",
                format!("tool_choice {other} is not supported; use \"auto\" or \"none\""),
            ))
        }
    };
    let use_tools = tools.is_some() && parse;
    let tools_json = if use_tools {
        tools.map(Value::Array)
    } else {
        None
    };
    let extra = req.chat_template_kwargs.clone().unwrap_or_default();
    let text = tmpl
        .render(&Value::Array(messages), tools_json.as_ref(), true, &extra)
        .map_err(|e| OpenAiError::invalid("messages", e.to_string()))?;
    let ids = s
        .inner
        .model
        .tokenizer
        .encode(&text, false)
        .map_err(|e| OpenAiError::invalid("messages", format!("tokenizing: {e}")))?;
    Ok((ids, ToolMode { parse: use_tools }))
}

/// Content parts joined to text; tool-call arguments parsed to objects (what
/// chat templates expect, as vLLM does).
fn normalize_message(i: usize, m: &Value) -> Result<Value, OpenAiError> {
    let Some(obj) = m.as_object() else {
        return Err(OpenAiError::invalid(
            "messages",
            format!("messages[{i}] must be an object"),
        ));
    };
    if !obj.get("role").is_some_and(Value::is_string) {
        return Err(OpenAiError::invalid(
            "messages",
            format!("messages[{i}] needs a string `role`"),
        ));
    }
    let mut obj = obj.clone();
    if let Some(Value::Array(parts)) = obj.get("content") {
        let mut text = String::new();
        for p in parts {
            match (
                p.get("type").and_then(Value::as_str),
                p.get("text").and_then(Value::as_str),
            ) {
                (Some("text"), Some(t)) => text.push_str(t),
                _ => {
                    return Err(OpenAiError::invalid(
                        "messages",
                        format!("messages[{i}]: only text content parts are supported"),
                    ))
                }
            }
        }
        obj.insert("content".into(), Value::String(text));
    }
    if let Some(Value::Array(calls)) = obj.get_mut("tool_calls") {
        for c in calls.iter_mut() {
            if let Some(f) = c.get_mut("function").and_then(Value::as_object_mut) {
                if let Some(Value::String(a)) = f.get("arguments") {
                    if let Ok(v) = serde_json::from_str::<Value>(a) {
                        f.insert("arguments".into(), v);
                    }
                }
            }
        }
    }
    Ok(Value::Object(obj))
}

async fn chat_completions(State(s): State<OpenAiState>, body: Bytes) -> Response {
    match chat_inner(s, body).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}

async fn chat_inner(s: OpenAiState, body: Bytes) -> Result<Response, OpenAiError> {
    let started = Instant::now();
    let req: ChatRequest = parse_body(&body)?;
    let sampling = req.sampling.clone().check(&s.inner.defaults)?;
    let max_tokens = match max_tokens_field("max_completion_tokens", req.max_completion_tokens)? {
        Some(m) => Some(m),
        None => max_tokens_field("max_tokens", req.max_tokens)?,
    };
    let logprobs = req.logprobs.unwrap_or(false);
    let top = top_logprobs_field("top_logprobs", req.top_logprobs)?;
    if top > 0 && !logprobs {
        return Err(OpenAiError::invalid(
            "top_logprobs",
            "top_logprobs needs logprobs: true",
        ));
    }
    let (prompt, tools) = chat_prompt(&s, &req)?;
    let mut p = prepare(
        &s,
        &req.model,
        vec![prompt],
        sampling,
        max_tokens,
        None,
        "messages",
    )?;
    p.logprobs = logprobs;
    p.top_logprobs = top;
    let stream = req.stream.unwrap_or(false);
    let rx = submit(&s, &p, stream)?;
    let id = s.request_id("chatcmpl");
    if stream {
        let include_usage = req.stream_options.is_some_and(|o| o.include_usage);
        return Ok(sse(
            s.clone(),
            rx,
            p,
            StreamKind::Chat { tools: tools.parse },
            id,
            include_usage,
            started,
        ));
    }
    let done = collect(&s, rx, p.total_choices(), started).await?;
    let mut choices = Vec::with_capacity(done.len());
    let mut completion_tokens = 0;
    for f in done {
        completion_tokens += f.tokens.len();
        let lp = if p.logprobs {
            let r = score(
                &s,
                p.adapter.clone(),
                p.prompts[0].clone(),
                f.tokens.clone(),
                p.sampling.params.temperature,
                p.top_logprobs,
                false,
            )
            .await?;
            chat_logprobs(&s, &f.tokens, &r)
        } else {
            Value::Null
        };
        let (message, finish) = chat_message(&f, tools.parse, &id);
        choices.push(
            json!({"index": f.index, "message": message, "logprobs": lp, "finish_reason": finish}),
        );
    }
    Ok(Json(json!({
        "id": id, "object": "chat.completion", "created": now_secs(), "model": p.model_name,
        "system_fingerprint": p.fingerprint(), "version": p.version, "choices": choices,
        "usage": usage(p.prompt_tokens(), completion_tokens),
    }))
    .into_response())
}

/// The assistant message and finish reason of a finished chat sample.
fn chat_message(f: &Finished, parse_tools: bool, id: &str) -> (Value, &'static str) {
    if parse_tools {
        let (content, calls) = tools::parse(&f.text);
        if !calls.is_empty() {
            return (
                json!({"role": "assistant", "content": content, "tool_calls": tools::to_json(&calls, id, f.index)}),
                "tool_calls",
            );
        }
    }
    (
        json!({"role": "assistant", "content": f.text}),
        f.finish_reason.as_str(),
    )
}

async fn completions(State(s): State<OpenAiState>, body: Bytes) -> Response {
    match completions_inner(s, body).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}

async fn completions_inner(s: OpenAiState, body: Bytes) -> Result<Response, OpenAiError> {
    let started = Instant::now();
    let req: CompletionRequest = parse_body(&body)?;
    let sampling = req.sampling.clone().check(&s.inner.defaults)?;
    if req.suffix.is_some() {
        return Err(OpenAiError::invalid("suffix", "suffix is not supported"));
    }
    if req.best_of.is_some_and(|b| b != sampling.n as i64) {
        return Err(OpenAiError::invalid(
            "best_of",
            "best_of must equal n when given",
        ));
    }
    let max_tokens = max_tokens_field("max_tokens", req.max_tokens)?;
    let top = top_logprobs_field("logprobs", req.logprobs)?;
    let tok = &s.inner.model.tokenizer;
    let encode = |t: &str| {
        tok.encode(t, true)
            .map_err(|e| OpenAiError::invalid("prompt", format!("tokenizing: {e}")))
    };
    let (prompts, texts): (Vec<Vec<u32>>, Vec<Option<String>>) = match req.prompt {
        PromptInput::Text(t) => (vec![encode(&t)?], vec![Some(t)]),
        PromptInput::Texts(ts) => {
            let mut ids = Vec::new();
            for t in &ts {
                ids.push(encode(t)?);
            }
            (ids, ts.into_iter().map(Some).collect())
        }
        PromptInput::Ids(ids) => (vec![ids], vec![None]),
        PromptInput::IdLists(l) => {
            let n = l.len();
            (l, vec![None; n])
        }
    };
    if prompts.is_empty() {
        return Err(OpenAiError::invalid(
            "prompt",
            "the prompt must not be empty",
        ));
    }
    let mut p = prepare(
        &s,
        &req.model,
        prompts,
        sampling,
        max_tokens,
        Some(16),
        "prompt",
    )?;
    p.logprobs = req.logprobs.is_some();
    p.top_logprobs = top;
    let echo = req.echo.unwrap_or(false);
    let stream = req.stream.unwrap_or(false);
    if stream && echo {
        return Err(OpenAiError::invalid(
            "echo",
            "echo is not supported with stream",
        ));
    }
    let rx = submit(&s, &p, stream)?;
    let id = s.request_id("cmpl");
    if stream {
        let include_usage = req.stream_options.is_some_and(|o| o.include_usage);
        return Ok(sse(
            s.clone(),
            rx,
            p,
            StreamKind::Completion,
            id,
            include_usage,
            started,
        ));
    }
    let done = collect(&s, rx, p.total_choices(), started).await?;
    let mut choices = Vec::with_capacity(done.len());
    let mut completion_tokens = 0;
    for f in done {
        completion_tokens += f.tokens.len();
        let pi = f.index / p.sampling.n;
        let prompt = &p.prompts[pi];
        let prompt_text = if echo {
            match &texts[pi] {
                Some(t) => t.clone(),
                None => tok
                    .decode(prompt, false)
                    .map_err(|e| OpenAiError::Internal(format!("decoding: {e}")))?,
            }
        } else {
            String::new()
        };
        let lp = if p.logprobs {
            let r = score(
                &s,
                p.adapter.clone(),
                prompt.clone(),
                f.tokens.clone(),
                p.sampling.params.temperature,
                top,
                echo,
            )
            .await?;
            let entries: Vec<TokenEntry> = if echo {
                std::iter::once(None)
                    .chain(r.logprobs.iter().zip(r.top).map(|(&l, t)| Some((l, t))))
                    .collect()
            } else {
                r.logprobs
                    .iter()
                    .zip(r.top)
                    .map(|(&l, t)| Some((l, t)))
                    .collect()
            };
            let toks: Vec<u32> = if echo {
                prompt.iter().chain(&f.tokens).copied().collect()
            } else {
                f.tokens.clone()
            };
            completion_logprobs(&s, &toks, &entries, 0)
        } else {
            Value::Null
        };
        choices.push(json!({
            "index": f.index, "text": format!("{prompt_text}{}", f.text), "logprobs": lp,
            "finish_reason": f.finish_reason.as_str(),
        }));
    }
    Ok(Json(json!({
        "id": id, "object": "text_completion", "created": now_secs(), "model": p.model_name,
        "system_fingerprint": p.fingerprint(), "version": p.version, "choices": choices,
        "usage": usage(p.prompt_tokens(), completion_tokens),
    }))
    .into_response())
}

async fn generate(State(s): State<OpenAiState>, body: Bytes) -> Response {
    match generate_inner(s, body).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}

async fn generate_inner(s: OpenAiState, body: Bytes) -> Result<Response, OpenAiError> {
    let started = Instant::now();
    let req: GenerateRequest = parse_body(&body)?;
    let sampling = req.sampling.clone().check(&s.inner.defaults)?;
    let max_tokens = max_tokens_field("max_tokens", req.max_tokens)?;
    let p = prepare(
        &s,
        &req.model,
        vec![req.prompt_token_ids],
        sampling,
        max_tokens,
        Some(16),
        "prompt",
    )?;
    let rx = submit(&s, &p, false)?;
    let done = collect(&s, rx, p.total_choices(), started).await?;
    let mut choices = Vec::with_capacity(done.len());
    let mut completion_tokens = 0;
    for f in done {
        completion_tokens += f.tokens.len();
        let r = score(
            &s,
            p.adapter.clone(),
            p.prompts[0].clone(),
            f.tokens.clone(),
            p.sampling.params.temperature,
            0,
            false,
        )
        .await?;
        choices.push(json!({
            "index": f.index, "token_ids": f.tokens, "logprobs": r.logprobs, "text": f.text,
            "finish_reason": f.finish_reason.as_str(),
        }));
    }
    Ok(Json(json!({
        "id": s.request_id("gen"), "object": "generation", "created": now_secs(),
        "model": p.model_name, "version": p.version, "system_fingerprint": p.fingerprint(),
        "choices": choices, "usage": usage(p.prompt_tokens(), completion_tokens),
    }))
    .into_response())
}

enum StreamKind {
    Chat { tools: bool },
    Completion,
}

struct ChoiceState {
    /// Text received from the engine.
    text: String,
    /// Bytes of `text` sent as content.
    sent: usize,
    started: bool,
}

impl ChoiceState {
    fn sent_text(&self) -> &str {
        self.text.get(..self.sent).unwrap_or("")
    }
}

struct StreamState {
    s: OpenAiState,
    rx: UnboundedReceiver<Event>,
    p: Prepared,
    kind: StreamKind,
    id: String,
    include_usage: bool,
    started: Instant,
    created: u64,
    choices: Vec<ChoiceState>,
    left: usize,
    completion_tokens: usize,
    queue: VecDeque<Bytes>,
    first_token: bool,
    finished: bool,
}

impl StreamState {
    fn chunk(&self, choices: Value, usage: Option<Value>) -> Bytes {
        let object = match self.kind {
            StreamKind::Chat { .. } => "chat.completion.chunk",
            StreamKind::Completion => "text_completion",
        };
        let mut v = json!({
            "id": self.id, "object": object, "created": self.created, "model": self.p.model_name,
            "system_fingerprint": self.p.fingerprint(), "version": self.p.version, "choices": choices,
        });
        if let Some(u) = usage {
            v["usage"] = u;
        }
        Bytes::from(format!("data: {v}\n\n"))
    }

    /// Send content for choice `i` up to what may be shown now.
    fn push_content(&mut self, i: usize, final_text: Option<&str>) {
        let tools = matches!(self.kind, StreamKind::Chat { tools: true });
        let c = &self.choices[i];
        let text: &str = final_text.unwrap_or(&c.text);
        // Mid-stream with tools on, hold back a possible `<tool_call>` and
        // trailing whitespace (the parsed content is trimmed); the final text
        // goes out whole.
        let end = if tools && final_text.is_none() {
            text[..tools::content_prefix_len(text)].trim_end().len()
        } else {
            text.len()
        };
        if end <= c.sent || !text.is_char_boundary(c.sent) || !text.is_char_boundary(end) {
            return;
        }
        let delta = text[c.sent..end].to_string();
        self.choices[i].sent = end;
        let choice = match self.kind {
            StreamKind::Chat { .. } => {
                let mut d = json!({"content": delta});
                if !self.choices[i].started {
                    d["role"] = json!("assistant");
                    self.choices[i].started = true;
                }
                json!([{"index": i, "delta": d, "logprobs": null, "finish_reason": null}])
            }
            StreamKind::Completion => {
                json!([{"index": i, "text": delta, "logprobs": null, "finish_reason": null}])
            }
        };
        let b = self.chunk(choice, None);
        self.queue.push_back(b);
    }

    async fn handle(&mut self, ev: Event) -> Result<(), OpenAiError> {
        if self.first_token && matches!(ev, Event::Delta { .. } | Event::Done(_)) {
            self.first_token = false;
            self.s
                .inner
                .metrics
                .ttft
                .observe(self.started.elapsed().as_secs_f64());
        }
        match ev {
            Event::Delta { index, text } => {
                if index < self.choices.len() {
                    self.choices[index].text.push_str(&text);
                    self.push_content(index, None);
                }
                Ok(())
            }
            Event::Done(f) => {
                let i = f.index;
                if i >= self.choices.len() {
                    return Ok(());
                }
                self.left -= 1;
                self.completion_tokens += f.tokens.len();
                let lp = if self.p.logprobs {
                    let r = score(
                        &self.s,
                        self.p.adapter.clone(),
                        self.p.prompts[i / self.p.sampling.n].clone(),
                        f.tokens.clone(),
                        self.p.sampling.params.temperature,
                        self.p.top_logprobs,
                        false,
                    )
                    .await?;
                    match self.kind {
                        StreamKind::Chat { .. } => chat_logprobs(&self.s, &f.tokens, &r),
                        StreamKind::Completion => {
                            let e: Vec<_> = r
                                .logprobs
                                .iter()
                                .zip(r.top)
                                .map(|(&l, t)| Some((l, t)))
                                .collect();
                            completion_logprobs(&self.s, &f.tokens, &e, 0)
                        }
                    }
                } else {
                    Value::Null
                };
                let last = match self.kind {
                    StreamKind::Chat { tools } => {
                        let (message, finish) = chat_message(&f, tools, &self.id);
                        let content = message
                            .get("content")
                            .and_then(Value::as_str)
                            .unwrap_or("")
                            .to_string();
                        if content.starts_with(self.choices[i].sent_text()) {
                            self.push_content(i, Some(&content));
                        }
                        let mut delta = json!({});
                        if !self.choices[i].started {
                            delta["role"] = json!("assistant");
                            delta["content"] = json!("");
                        }
                        if let Some(Value::Array(calls)) = message.get("tool_calls") {
                            let calls: Vec<Value> = calls
                                .iter()
                                .enumerate()
                                .map(|(k, c)| {
                                    let mut c = c.clone();
                                    c["index"] = json!(k);
                                    c
                                })
                                .collect();
                            delta["tool_calls"] = Value::Array(calls);
                        }
                        json!([{"index": i, "delta": delta, "logprobs": lp, "finish_reason": finish}])
                    }
                    StreamKind::Completion => {
                        if f.text.starts_with(self.choices[i].sent_text()) {
                            self.push_content(i, Some(&f.text));
                        }
                        json!([{"index": i, "text": "", "logprobs": lp, "finish_reason": f.finish_reason.as_str()}])
                    }
                };
                let b = self.chunk(last, None);
                self.queue.push_back(b);
                if self.left == 0 {
                    self.s
                        .inner
                        .metrics
                        .latency
                        .observe(self.started.elapsed().as_secs_f64());
                    if self.include_usage {
                        let u = usage(self.p.prompt_tokens(), self.completion_tokens);
                        let b = self.chunk(json!([]), Some(u));
                        self.queue.push_back(b);
                    }
                    self.queue
                        .push_back(Bytes::from_static(b"data: [DONE]\n\n"));
                    self.finished = true;
                }
                Ok(())
            }
            Event::Failed(m) => Err(OpenAiError::Internal(m)),
        }
    }
}

/// A server-sent-event response. Dropping it (the client went away) drops
/// the event receiver, which cancels the request in the scheduler.
fn sse(
    s: OpenAiState,
    rx: UnboundedReceiver<Event>,
    p: Prepared,
    kind: StreamKind,
    id: String,
    include_usage: bool,
    started: Instant,
) -> Response {
    let total = p.total_choices();
    let state = StreamState {
        s,
        rx,
        kind,
        id,
        include_usage,
        started,
        created: now_secs(),
        choices: (0..total)
            .map(|_| ChoiceState {
                text: String::new(),
                sent: 0,
                started: false,
            })
            .collect(),
        left: total,
        completion_tokens: 0,
        queue: VecDeque::new(),
        first_token: true,
        finished: false,
        p,
    };
    let stream = futures_util::stream::unfold(Some(state), |st| async move {
        let mut st = st?;
        loop {
            if let Some(b) = st.queue.pop_front() {
                return Some((Ok::<Bytes, Infallible>(b), Some(st)));
            }
            if st.finished {
                return None;
            }
            let failure = match st.rx.recv().await {
                Some(ev) => match st.handle(ev).await {
                    Ok(()) => continue,
                    Err(e) => e,
                },
                None => OpenAiError::Internal("the engine dropped a request".into()),
            };
            // Headers are sent: report the failure in-band and end the stream.
            tracing::error!("stream failed: {failure}");
            let body = json!({"error": {"message": "internal error (see the server log)", "type": "server_error"}});
            return Some((Ok(Bytes::from(format!("data: {body}\n\n"))), None));
        }
    });
    Response::builder()
        .status(StatusCode::OK)
        .header(header::CONTENT_TYPE, "text/event-stream")
        .header(header::CACHE_CONTROL, "no-cache")
        .body(Body::from_stream(stream))
        .unwrap_or_else(|_| OpenAiError::Internal("building the stream".into()).into_response())
}

#[cfg(test)]
mod tests {
    use super::*;
    use temper_model::{FinishReason, LoadOptions, SamplingParams};

    fn state() -> OpenAiState {
        let dir =
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/models/tiny-qwen3");
        let m = Pretrained::load(&dir, &LoadOptions::default()).expect("fixture");
        let cfg = ServeConfig::defaults("tiny", &m);
        OpenAiState::new(Arc::new(m), cfg)
    }

    /// A streamed answer that ends in a Hermes tool call: the content before
    /// it streams (the tag never leaks), the last chunk carries `tool_calls`
    /// with finish_reason `tool_calls` — the same message as non-streamed.
    #[tokio::test]
    async fn streamed_tool_calls_end_with_tool_calls() {
        let s = state();
        let (_tx, rx) = unbounded_channel();
        let p = Prepared {
            prompts: vec![vec![1, 2]],
            sampling: Sampling {
                params: SamplingParams::default(),
                n: 1,
            },
            adapter: None,
            model_name: "tiny".into(),
            version: 0,
            top_logprobs: 0,
            logprobs: false,
        };
        let mut st = StreamState {
            s,
            rx,
            p,
            kind: StreamKind::Chat { tools: true },
            id: "chatcmpl-t".into(),
            include_usage: false,
            started: Instant::now(),
            created: 0,
            choices: vec![ChoiceState {
                text: String::new(),
                sent: 0,
                started: false,
            }],
            left: 1,
            completion_tokens: 0,
            queue: VecDeque::new(),
            first_token: true,
            finished: false,
        };
        let call = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>";
        let full = format!("Let me check. {call}");
        for piece in ["Let me ", "check. <tool", &call[5..]] {
            st.handle(Event::Delta {
                index: 0,
                text: piece.to_string(),
            })
            .await
            .expect("delta");
        }
        let done = Finished {
            index: 0,
            tokens: vec![3, 4, 5],
            text: full.clone(),
            finish_reason: FinishReason::Stop,
        };
        let (message, finish) = chat_message(&done, true, "chatcmpl-t");
        st.handle(Event::Done(done)).await.expect("done");
        let events: Vec<String> = st
            .queue
            .iter()
            .map(|b| String::from_utf8(b.to_vec()).expect("utf8"))
            .collect();
        assert_eq!(events.last().map(String::as_str), Some("data: [DONE]\n\n"));
        let chunks: Vec<Value> = events[..events.len() - 1]
            .iter()
            .map(|e| serde_json::from_str(e.trim_start_matches("data: ").trim()).expect("json"))
            .collect();
        let content: String = chunks
            .iter()
            .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
            .collect();
        assert_eq!(content, "Let me check.");
        assert_eq!(message["content"], "Let me check.");
        assert_eq!(finish, "tool_calls");
        let last = &chunks[chunks.len() - 1]["choices"][0];
        assert_eq!(last["finish_reason"], "tool_calls");
        let tc = &last["delta"]["tool_calls"][0];
        assert_eq!(tc["index"], 0);
        assert_eq!(tc["type"], "function");
        assert_eq!(tc["function"]["name"], "get_weather");
        assert_eq!(tc["function"]["arguments"], "{\"city\":\"Paris\"}");
        assert_eq!(tc["id"], message["tool_calls"][0]["id"]);
        assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    }
}
