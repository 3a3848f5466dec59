//! The training API over HTTP, wire-compatible with the official `tinker`
//! Python SDK (`docs/tinker-protocol.md` is the spec we follow).
//!
//! Every training and sampling call is a *future*: the submit route answers
//! `{"request_id"}` at once and the client polls `retrieve_future`, which we
//! hold open (long-poll) until the result is ready. Work goes to one
//! [`Engine`], whose single ordered queue gives the per-model `seq_id`
//! ordering the SDK expects. Validation errors fail the future (HTTP 200
//! with `{"error", "category": "user"}`), so one bad request never poisons a
//! session and never skips a `seq_id`.

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::{Path as UrlPath, Request, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use prost::Message;
use serde::Deserialize;
use serde_json::{json, Value};
use temper_engine::{
    AdamParams, Datum, Engine, EngineError, Loss, LossInputs, Pending, RunKind, TrainingRun,
};
use temper_model::{Completion, FinishReason, LoraConfig, Pretrained, SamplingParams, Target};
use tokio::sync::Notify;

use crate::error::ApiError;
use temper_client::proto;

/// LoRA alpha for runs created over the API (the SDK only sends a rank).
pub const LORA_ALPHA: f64 = 32.0;

/// A base model the service may train and sample.
#[derive(Clone)]
pub struct BaseModel {
    /// The name clients use as `base_model`.
    pub name: String,
    /// The loaded model.
    pub model: Arc<Pretrained>,
}

/// Service settings.
#[derive(Clone, Debug)]
pub struct ApiConfig {
    /// Required `X-API-Key` value; `None` accepts any key.
    pub api_key: Option<String>,
    /// Where `save_state` checkpoints go (`{dir}/{model_id}/weights/{name}`).
    pub checkpoint_dir: PathBuf,
    /// How long `retrieve_future` waits for a result before `try_again`.
    pub long_poll: Duration,
    /// How long a result stays retrievable after its first delivery (a
    /// client whose response was lost re-polls); then it is dropped.
    pub result_grace: Duration,
    /// Bounds on what one request may ask for, checked before anything is
    /// allocated.
    pub limits: ApiLimits,
    /// PEFT adapters clients may start training from, by name
    /// (`tinker://adapters/peft/NAME`).
    pub adapters: BTreeMap<String, ServedAdapter>,
}

/// A PEFT LoRA adapter directory a training client can start from.
#[derive(Clone, Debug)]
pub struct ServedAdapter {
    /// The adapter directory (`adapter_config.json`, `adapter_model.safetensors`).
    pub dir: PathBuf,
    /// Its rank (`r` in `adapter_config.json`), reported by `get_info`.
    pub rank: usize,
}

/// The path prefix that names a served PEFT adapter in `load_weights`.
pub const PEFT_ADAPTER_PREFIX: &str = "tinker://adapters/peft/";

/// Per-request bounds (`temper api serve` flags). A request over one gets a
/// 400 naming the limit and its flag; the sequence length is further bounded
/// by the base model's context length.
#[derive(Clone, Debug)]
pub struct ApiLimits {
    /// Largest `lora_config.rank` (`--max-lora-rank`).
    pub max_lora_rank: usize,
    /// Largest `num_samples` of one `asample` (`--max-num-samples`).
    pub max_num_samples: usize,
    /// Most tokens in one `forward_backward` / `forward`, summed over its
    /// datums (`--max-batch-tokens`).
    pub max_batch_tokens: usize,
    /// Largest request body in bytes (`--max-body-mb`).
    pub max_body_bytes: usize,
    /// How long a finished result nobody retrieves is kept
    /// (`--result-ttl-s`).
    pub result_ttl: Duration,
    /// Most finished results kept at once; the oldest go first
    /// (`--max-results`).
    pub max_results: usize,
}

impl Default for ApiLimits {
    fn default() -> Self {
        Self {
            max_lora_rank: 256,
            max_num_samples: 128,
            max_batch_tokens: 262_144,
            max_body_bytes: 256 << 20,
            result_ttl: Duration::from_secs(3600),
            max_results: 4096,
        }
    }
}

fn over_limit(what: &str, got: usize, limit: usize, flag: &str) -> ApiError {
    ApiError::BadRequest(format!(
        "{what} {got} exceeds this server's limit {limit} ({flag})"
    ))
}

enum FutureState {
    Pending,
    Json(Value),
    Proto(Vec<u8>),
    Failed {
        error: String,
        category: &'static str,
    },
}

struct TrainModel {
    run: String,
    base: String,
    rank: usize,
}

struct Sampler {
    key: String,
    base: String,
    model_path: Option<String>,
}

#[derive(Default)]
struct Tables {
    sessions: HashMap<String, bool>,
    models: HashMap<String, TrainModel>,
    samplers: HashMap<String, Sampler>,
    futures: HashMap<String, FutureState>,
    /// First delivery time of finished futures, for eviction.
    delivered: HashMap<String, std::time::Instant>,
    /// When each future finished, for evicting results nobody retrieves.
    finished: HashMap<String, std::time::Instant>,
    /// `(model or sampling session, seq_id)` → request id, so resubmits dedupe.
    seen: HashMap<(String, i64), Value>,
}

struct Inner {
    engine: Engine,
    bases: BTreeMap<String, BaseModel>,
    config: ApiConfig,
    tables: Mutex<Tables>,
    done: Notify,
    ids: AtomicU64,
    /// Random per server start, part of every id: ids never repeat across
    /// restarts, so a new run can never land on an old run's checkpoints.
    boot: String,
}

/// Shared service state (cheap to clone).
#[derive(Clone)]
pub struct ApiState(Arc<Inner>);

impl ApiState {
    /// A service over `bases`, each registered with a fresh [`Engine`].
    pub fn new(bases: Vec<BaseModel>, config: ApiConfig) -> Self {
        let engine = Engine::new();
        for b in &bases {
            // Queued ahead of any request, so it completes first; nothing to wait for.
            drop(engine.add_base_model(&b.name, b.model.clone()));
        }
        Self(Arc::new(Inner {
            engine,
            bases: bases.into_iter().map(|b| (b.name.clone(), b)).collect(),
            config,
            tables: Mutex::new(Tables::default()),
            done: Notify::new(),
            ids: AtomicU64::new(0),
            boot: format!("{:08x}", rand::random::<u32>()),
        }))
    }

    fn tables(&self) -> std::sync::MutexGuard<'_, Tables> {
        self.0.tables.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn next_id(&self, prefix: &str) -> String {
        format!(
            "{prefix}-{}-{}",
            self.0.boot,
            self.0.ids.fetch_add(1, Ordering::Relaxed) + 1
        )
    }

    /// Models and sampling sessions hang off a session this server issued:
    /// a client-chosen session id would become part of checkpoint paths.
    fn known_session(&self, id: &str) -> Result<(), ApiError> {
        if self.tables().sessions.contains_key(id) {
            Ok(())
        } else {
            Err(ApiError::NotFound(format!(
                "unknown session_id {id:?}: ids come from create_session"
            )))
        }
    }

    /// Drop results delivered longer than the grace period ago, and the
    /// resubmit records that point at them.
    /// Also drop results never retrieved after `result_ttl`, and the oldest
    /// finished results beyond `max_results`, so memory stays bounded.
    fn evict_delivered(&self) {
        let grace = self.0.config.result_grace;
        let limits = &self.0.config.limits;
        let mut t = self.tables();
        let now = std::time::Instant::now();
        let mut old: Vec<String> = t
            .delivered
            .iter()
            .filter(|(_, at)| now.duration_since(**at) >= grace)
            .map(|(id, _)| id.clone())
            .collect();
        old.extend(
            t.finished
                .iter()
                .filter(|(_, at)| now.duration_since(**at) >= limits.result_ttl)
                .map(|(id, _)| id.clone()),
        );
        if t.finished.len() > limits.max_results {
            let mut by_age: Vec<(std::time::Instant, String)> = t
                .finished
                .iter()
                .map(|(id, at)| (*at, id.clone()))
                .collect();
            by_age.sort();
            let excess = t.finished.len() - limits.max_results;
            old.extend(by_age.into_iter().take(excess).map(|(_, id)| id));
        }
        if old.is_empty() {
            return;
        }
        for id in &old {
            t.delivered.remove(id);
            t.finished.remove(id);
            t.futures.remove(id);
        }
        let gone: std::collections::HashSet<&str> = old.iter().map(String::as_str).collect();
        t.seen.retain(|_, v| {
            v.get("request_id")
                .and_then(|r| r.as_str())
                .is_none_or(|r| !gone.contains(r))
        });
    }

    /// Register a future whose result `work` produces; returns its id.
    fn spawn_future<F>(&self, work: F) -> String
    where
        F: std::future::Future<Output = std::result::Result<FutureState, EngineError>>
            + Send
            + 'static,
    {
        self.evict_delivered();
        let id = self.next_id("req");
        self.tables()
            .futures
            .insert(id.clone(), FutureState::Pending);
        let state = self.clone();
        let fid = id.clone();
        tokio::spawn(async move {
            let result = match work.await {
                Ok(s) => s,
                Err(e) => FutureState::Failed {
                    error: e.to_string(),
                    category: match e {
                        EngineError::InvalidRequest(_) | EngineError::NotFound(_) => "user",
                        _ => "server",
                    },
                },
            };
            {
                let mut t = state.tables();
                t.finished.insert(fid.clone(), std::time::Instant::now());
                t.futures.insert(fid, result);
            }
            state.0.done.notify_waiters();
        });
        id
    }

    /// A future that has already failed (validation before any work).
    fn failed_future(&self, error: String) -> String {
        self.evict_delivered();
        let id = self.next_id("req");
        let mut t = self.tables();
        t.finished.insert(id.clone(), std::time::Instant::now());
        t.futures.insert(
            id.clone(),
            FutureState::Failed {
                error,
                category: "user",
            },
        );
        id
    }

    /// Return the response already given for `(owner, seq_id)`, or record `make()`'s.
    fn dedupe(&self, owner: &str, seq_id: Option<i64>, make: impl FnOnce() -> Value) -> Value {
        let Some(seq) = seq_id else { return make() };
        let key = (owner.to_string(), seq);
        if let Some(v) = self.tables().seen.get(&key) {
            return v.clone();
        }
        let v = make();
        self.tables().seen.insert(key, v.clone());
        v
    }

    fn model(&self, model_id: &str) -> std::result::Result<(String, String, usize), String> {
        self.tables()
            .models
            .get(model_id)
            .map(|m| (m.run.clone(), m.base.clone(), m.rank))
            .ok_or_else(|| format!("unknown model_id {model_id:?}"))
    }

    /// The base model and LoRA shape of the checkpoint in `dir`: the base
    /// from the live run that saved it, the client's `base_model`, the base
    /// whose directory the checkpoint names, or the only base served.
    fn checkpoint_shape(
        &self,
        dir: &std::path::Path,
        src_model: &str,
        base_model: Option<&str>,
    ) -> std::result::Result<(String, LoraConfig), String> {
        let (kind, base_dir) = TrainingRun::checkpoint_kind(dir).map_err(|e| e.to_string())?;
        let RunKind::Lora {
            rank,
            alpha,
            targets,
        } = kind
        else {
            return Err(
                "a full-parameter checkpoint cannot be loaded through the training API".into(),
            );
        };
        let targets = targets
            .iter()
            .map(|t| {
                Target::from_name(t)
                    .ok_or_else(|| format!("checkpoint names unknown LoRA target {t:?}"))
            })
            .collect::<std::result::Result<Vec<_>, _>>()?;
        let canonical = |p: &std::path::Path| std::fs::canonicalize(p).ok();
        let by_dir = canonical(std::path::Path::new(&base_dir)).and_then(|want| {
            self.0
                .bases
                .values()
                .find(|b| canonical(&b.model.dir).as_ref() == Some(&want))
                .map(|b| b.name.clone())
        });
        let base = self
            .model(src_model)
            .ok()
            .map(|(_, b, _)| b)
            .or_else(|| base_model.map(str::to_string))
            .or(by_dir)
            .or_else(|| (self.0.bases.len() == 1).then(|| self.0.bases.keys().next().cloned()).flatten())
            .ok_or_else(|| {
                format!("the checkpoint's base model {base_dir} is not among those served: pass base_model")
            })?;
        if !self.0.bases.contains_key(&base) {
            return Err(format!("unknown base_model {base:?}"));
        }
        Ok((
            base,
            LoraConfig {
                rank,
                alpha,
                targets,
                use_rslora: false,
            },
        ))
    }

    /// The longest sequence a base model takes.
    fn context_length(&self, base: &str) -> std::result::Result<usize, String> {
        self.0
            .bases
            .get(base)
            .map(|b| b.model.config.max_position_embeddings)
            .ok_or_else(|| format!("base model {base:?} is not served"))
    }

    /// Every token id must be in the base model's vocabulary (a user error,
    /// not a server one, when it is not).
    fn check_vocab(&self, base: &str, what: &str, ids: &[u32]) -> std::result::Result<(), String> {
        let vocab = self
            .0
            .bases
            .get(base)
            .map(|b| b.model.config.vocab_size)
            .ok_or_else(|| format!("base model {base:?} is not served"))?;
        match ids.iter().position(|&t| t as usize >= vocab) {
            Some(i) => Err(format!(
                "{what}: token id {} at position {i} is out of range (vocabulary size {vocab})",
                ids[i]
            )),
            None => Ok(()),
        }
    }
}

/// The router: every route under `/api/v1`, API-key checked.
pub fn app(state: ApiState) -> Router {
    Router::new()
        .route(
            "/api/v1/healthz",
            get(|| async { Json(json!({"status": "ok"})) }),
        )
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

async fn check_api_key(State(s): State<ApiState>, req: Request, next: Next) -> Response {
    if let Some(key) = &s.0.config.api_key {
        let given = req
            .headers()
            .get("x-api-key")
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default();
        if given != key {
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

fn parse<T: for<'de> Deserialize<'de>>(body: &Bytes) -> std::result::Result<T, ApiError> {
    serde_json::from_slice(body)
        .map_err(|e| ApiError::BadRequest(format!("invalid JSON body: {e}")))
}

async fn capabilities(State(s): State<ApiState>) -> Json<Value> {
    let models: Vec<Value> =
        s.0.bases
            .values()
            .map(|b| {
                json!({
                    "model_name": b.name,
                    "max_context_length": b.model.config.max_position_embeddings,
                    "trainable": true,
                    "sampleable": true,
                })
            })
            .collect();
    Json(json!({ "supported_models": models }))
}

async fn client_config() -> Json<Value> {
    // Plain httpx transport, strictly sequential forward_backward chunks,
    // uncompressed protobuf, no JWT exchange, no server-side custom losses.
    Json(json!({
        "pjwt_auth_enabled": false,
        "use_pyqwest_transport": false,
        "proto_compress_fwdbwd": false,
        "parallel_fwdbwd_chunks": false,
        "custom_loss_server_side": false,
        "sample_use_retrieve_futures": false,
        "sample_join_sampling_session": false,
    }))
}

async fn create_session(State(s): State<ApiState>) -> Json<Value> {
    let id = s.next_id("sess");
    s.tables().sessions.insert(id.clone(), false);
    Json(json!({"type": "create_session", "session_id": id}))
}

#[derive(Deserialize)]
struct SessionRef {
    session_id: String,
}

async fn heartbeat(State(s): State<ApiState>, body: Bytes) -> Result<Json<Value>, ApiError> {
    let r: SessionRef = parse(&body)?;
    match s.tables().sessions.get(&r.session_id) {
        Some(false) => Ok(Json(json!({"type": "session_heartbeat"}))),
        Some(true) => Err(ApiError::Gone(format!(
            "session {} is finished",
            r.session_id
        ))),
        None => Err(ApiError::NotFound(format!(
            "unknown session {}",
            r.session_id
        ))),
    }
}

async fn finish_session(State(s): State<ApiState>, UrlPath(id): UrlPath<String>) -> Json<Value> {
    if let Some(f) = s.tables().sessions.get_mut(&id) {
        *f = true;
    }
    Json(json!({}))
}

#[derive(Deserialize)]
struct CreateModel {
    session_id: String,
    model_seq_id: i64,
    base_model: String,
    #[serde(default)]
    lora_config: Option<LoraRequest>,
}

#[derive(Deserialize)]
struct LoraRequest {
    #[serde(default = "default_rank")]
    rank: usize,
    #[serde(default)]
    seed: Option<u64>,
    #[serde(default = "yes")]
    train_mlp: bool,
    #[serde(default = "yes")]
    train_attn: bool,
}

fn default_rank() -> usize {
    32
}
fn yes() -> bool {
    true
}

fn lora_config(req: Option<&LoraRequest>) -> std::result::Result<(LoraConfig, u64), String> {
    let (rank, seed, mlp, attn) = match req {
        Some(l) => (l.rank, l.seed.unwrap_or(0), l.train_mlp, l.train_attn),
        None => (32, 0, true, true),
    };
    let mut targets = Vec::new();
    if attn {
        targets.extend([Target::Q, Target::K, Target::V, Target::O]);
    }
    if mlp {
        targets.extend([Target::Gate, Target::Up, Target::Down]);
    }
    if rank == 0 || targets.is_empty() {
        return Err("LoRA needs rank >= 1 and train_attn or train_mlp".into());
    }
    Ok((
        LoraConfig {
            rank,
            alpha: LORA_ALPHA,
            targets,
            use_rslora: false,
        },
        seed,
    ))
}

async fn create_model(State(s): State<ApiState>, body: Bytes) -> Result<Json<Value>, ApiError> {
    let r: CreateModel = parse(&body)?;
    s.known_session(&r.session_id)?;
    if let Some(l) = &r.lora_config {
        let max = s.0.config.limits.max_lora_rank;
        if l.rank > max {
            return Err(over_limit(
                "lora_config.rank",
                l.rank,
                max,
                "--max-lora-rank",
            ));
        }
    }
    let model_id = format!("{}:train:{}", r.session_id, r.model_seq_id);
    let resp = s.dedupe(&model_id, Some(-1), || {
        let request_id = if !s.0.bases.contains_key(&r.base_model) {
            s.failed_future(format!(
                "unknown base_model {:?}; this server serves {:?}",
                r.base_model,
                s.0.bases.keys().collect::<Vec<_>>()
            ))
        } else {
            match lora_config(r.lora_config.as_ref()) {
                Err(e) => s.failed_future(e),
                Ok((cfg, seed)) => {
                    let rank = cfg.rank;
                    let pending = s.0.engine.create_lora_run(&r.base_model, cfg, seed);
                    let (st, mid, base) = (s.clone(), model_id.clone(), r.base_model.clone());
                    s.spawn_future(async move {
                        let run = pending.await?;
                        st.tables()
                            .models
                            .insert(mid.clone(), TrainModel { run, base, rank });
                        Ok(FutureState::Json(
                            json!({"type": "create_model", "model_id": mid}),
                        ))
                    })
                }
            }
        };
        json!({"request_id": request_id, "model_id": model_id})
    });
    Ok(Json(resp))
}

#[derive(Deserialize)]
struct ModelRef {
    model_id: String,
}

async fn get_info(State(s): State<ApiState>, body: Bytes) -> Result<Json<Value>, ApiError> {
    let r: ModelRef = parse(&body)?;
    let (_, base, rank) = s.model(&r.model_id).map_err(ApiError::NotFound)?;
    let b =
        s.0.bases
            .get(&base)
            .ok_or_else(|| ApiError::Internal(format!("base {base} vanished")))?;
    // An absolute local directory (no ':') lets `get_tokenizer()` load offline.
    let tokenizer_id = std::fs::canonicalize(&b.model.dir)
        .unwrap_or_else(|_| b.model.dir.clone())
        .display()
        .to_string();
    Ok(Json(json!({
        "type": "get_info",
        "model_id": r.model_id,
        "model_data": {
            "arch": b.model.config.family.model_type(),
            "model_name": base,
            "tokenizer_id": tokenizer_id,
        },
        "is_lora": true,
        "lora_rank": rank,
        "model_name": base,
        "optimizer_config": {"type": "adamw"},
    })))
}

/// Decode one protobuf datum into the engine's form.
fn datum_from_proto(d: &proto::Datum) -> std::result::Result<Datum, String> {
    let mut tokens = Vec::new();
    for c in &d.model_input {
        match &c.chunk {
            Some(proto::chunk::Chunk::EncodedText(t)) => tokens
                .extend(proto::le::ids_from_i32(&t.tokens).ok_or("malformed encoded_text tokens")?),
            Some(_) => {
                return Err("only encoded_text chunks are supported (no images or audio)".into())
            }
            None => return Err("empty model_input chunk".into()),
        }
    }
    let mut inputs = LossInputs::default();
    for (name, t) in &d.loss_fn_inputs {
        let dense = match &t.encoding {
            Some(proto::tensor::Encoding::Dense(b)) => b,
            Some(proto::tensor::Encoding::SparseCsr(_)) => {
                return Err(format!(
                    "{name}: sparse tensors are not supported; send 1-D dense"
                ))
            }
            None => return Err(format!("{name}: tensor without data")),
        };
        if t.shape.len() > 1 {
            return Err(format!(
                "{name}: shape {:?}; only 1-D loss inputs are supported",
                t.shape
            ));
        }
        let floats = || -> std::result::Result<Vec<f32>, String> {
            match proto::DType::try_from(t.dtype) {
                Ok(proto::DType::Float32) => {
                    proto::le::f32_from(dense).ok_or(format!("{name}: malformed f32 data"))
                }
                Ok(proto::DType::Int64) => Ok(proto::le::i64_from(dense)
                    .ok_or(format!("{name}: malformed i64 data"))?
                    .into_iter()
                    .map(|x| x as f32)
                    .collect()),
                _ => Err(format!("{name}: unsupported dtype {}", t.dtype)),
            }
        };
        match name.as_str() {
            "target_tokens" => {
                let ids: Vec<i64> = match proto::DType::try_from(t.dtype) {
                    Ok(proto::DType::Int64) => {
                        proto::le::i64_from(dense).ok_or("target_tokens: malformed i64 data")?
                    }
                    Ok(proto::DType::Int32) => proto::le::ids_from_i32(dense)
                        .ok_or("target_tokens: malformed i32 data")?
                        .into_iter()
                        .map(i64::from)
                        .collect(),
                    _ => return Err("target_tokens must be int64".into()),
                };
                inputs.target_tokens = ids
                    .into_iter()
                    .map(|x| u32::try_from(x).map_err(|_| format!("target token {x} out of range")))
                    .collect::<std::result::Result<_, _>>()?;
            }
            "weights" => inputs.weights = Some(finite(name, floats()?)?),
            "logprobs" => inputs.logprobs = Some(finite(name, floats()?)?),
            "advantages" => inputs.advantages = Some(finite(name, floats()?)?),
            // Per-datum clip thresholds are read from loss_fn_config instead.
            "clip_low_threshold" | "clip_high_threshold" => {}
            other => return Err(format!("unsupported loss_fn_inputs key {other:?}")),
        }
    }
    Ok(Datum {
        model_input: tokens,
        loss_fn_inputs: inputs,
    })
}

/// A NaN or inf in a loss input would turn every weight into NaN.
fn finite(name: &str, v: Vec<f32>) -> std::result::Result<Vec<f32>, String> {
    match v.iter().position(|x| !x.is_finite()) {
        Some(i) => Err(format!("{name}[{i}] is {} (inputs must be finite)", v[i])),
        None => Ok(v),
    }
}

/// The loss of a request and its scoring temperature: `loss_fn_config`'s
/// `temperature` (temper's extension of the tinker protocol, which has no
/// temperature on forward_backward) scores every datum at
/// `log softmax(logits / temperature)`, the distribution tokens sampled at
/// that temperature were drawn from. Absent: 1.
fn loss_from_proto(
    r: &proto::ForwardBackwardRequest,
) -> std::result::Result<(Loss, Option<f64>), String> {
    let mut cfg = serde_json::Map::new();
    for (k, v) in &r.loss_fn_config {
        cfg.insert(k.clone(), json!(v));
    }
    for (k, v) in &r.loss_fn_config_v2 {
        match &v.value {
            Some(proto::loss_config_value::Value::Number(n)) => {
                cfg.insert(k.clone(), json!(n));
            }
            Some(proto::loss_config_value::Value::Text(t)) => {
                cfg.insert(k.clone(), json!(t));
            }
            None => {}
        }
    }
    let temperature = match cfg.get("temperature") {
        None => None,
        Some(v) => match v.as_f64() {
            Some(t) if t > 0.0 && t.is_finite() => Some(t),
            _ => {
                return Err(format!(
                    "loss_fn_config temperature must be a number > 0, got {v}"
                ))
            }
        },
    };
    let loss = Loss::from_name(&r.loss_fn, &cfg).map_err(|e| e.to_string())?;
    Ok((loss, temperature))
}

fn forward_output_proto(out: &temper_engine::ForwardOutput) -> Vec<u8> {
    let mut data = Vec::new();
    let mut offsets = vec![0i64];
    for o in &out.loss_fn_outputs {
        data.extend(proto::le::f32_bytes(&o.logprobs));
        offsets.push(data.len() as i64);
    }
    let mut fields = HashMap::new();
    fields.insert(
        "logprobs".to_string(),
        proto::BatchedTensor {
            data,
            offsets: proto::le::i64_bytes(&offsets),
            dtype: proto::DType::Float32 as i32,
            trailing_shape: vec![],
        },
    );
    let metrics: HashMap<String, f64> = out
        .metrics
        .iter()
        .filter(|(k, _)| k.matches(':').count() == 1)
        .map(|(k, v)| (k.clone(), *v))
        .collect();
    proto::ForwardBackwardOutput {
        loss_fn_output_type: "ArrayRecord".into(),
        loss_fn_outputs: vec![proto::ArrayRecord {
            type_tag: "ArrayRecord".into(),
            fields,
            num_datums: out.loss_fn_outputs.len() as i64,
        }],
        metrics,
    }
    .encode_to_vec()
}

async fn forward_backward(State(s): State<ApiState>, body: Bytes) -> Result<Json<Value>, ApiError> {
    let r = proto::ForwardBackwardRequest::decode(body.as_ref()).map_err(|e| {
        ApiError::BadRequest(format!("invalid ForwardBackwardRequest protobuf: {e}"))
    })?;
    let data = r
        .data
        .iter()
        .enumerate()
        .map(|(i, d)| datum_from_proto(d).map_err(|e| format!("datum {i}: {e}")))
        .collect::<std::result::Result<Vec<_>, _>>()
        .map_err(ApiError::BadRequest)?;
    let total: usize = data.iter().map(|d| d.model_input.len()).sum();
    let max = s.0.config.limits.max_batch_tokens;
    if total > max {
        return Err(over_limit(
            "forward_backward tokens",
            total,
            max,
            "--max-batch-tokens",
        ));
    }
    let resp = s.dedupe(&r.model_id, Some(r.seq_id as i64), || {
        let prepared = (|| {
            let (run, base, _) = s.model(&r.model_id)?;
            let ctx = s.context_length(&base)?;
            if let Some((i, d)) = data
                .iter()
                .enumerate()
                .find(|(_, d)| d.model_input.len() > ctx)
            {
                return Err(format!(
                    "datum {i}: {} tokens exceed the model's context length {ctx}",
                    d.model_input.len()
                ));
            }
            for (i, d) in data.iter().enumerate() {
                s.check_vocab(&base, &format!("datum {i} model_input"), &d.model_input)?;
                s.check_vocab(
                    &base,
                    &format!("datum {i} target_tokens"),
                    &d.loss_fn_inputs.target_tokens,
                )?;
            }
            let (loss, temperature) = loss_from_proto(&r)?;
            let mut data = data;
            for d in &mut data {
                d.loss_fn_inputs.temperature = temperature;
            }
            Ok::<_, String>((run, data, loss))
        })();
        let request_id = match prepared {
            Err(e) => s.failed_future(e),
            Ok((run, data, loss)) => {
                let pending = if r.forward_only {
                    s.0.engine.forward(&run, data, loss)
                } else {
                    s.0.engine.forward_backward(&run, data, loss)
                };
                s.spawn_future(async move {
                    let out = pending.await?;
                    Ok(FutureState::Proto(forward_output_proto(&out)))
                })
            }
        };
        json!({"request_id": request_id, "model_id": r.model_id})
    });
    Ok(Json(resp))
}

#[derive(Deserialize)]
struct OptimStep {
    model_id: String,
    #[serde(default)]
    seq_id: Option<i64>,
    #[serde(default, alias = "optim_params", alias = "optimizer_params")]
    adam_params: Option<AdamParams>,
}

async fn optim_step(State(s): State<ApiState>, body: Bytes) -> Result<Json<Value>, ApiError> {
    let r: OptimStep = parse(&body)?;
    let resp = s.dedupe(&r.model_id, r.seq_id, || {
        let request_id = match s.model(&r.model_id) {
            Err(e) => s.failed_future(e),
            Ok((run, _, _)) => {
                let pending = s.0.engine.optim_step(&run, r.adam_params.unwrap_or_default());
                s.spawn_future(async move {
                    let st = pending.await?;
                    Ok(FutureState::Json(json!({
                        "type": "optim_step",
                        "metrics": {"grad_norm:mean": st.grad_norm, "learning_rate:mean": st.learning_rate},
                    })))
                })
            }
        };
        json!({"request_id": request_id, "model_id": r.model_id})
    });
    Ok(Json(resp))
}

/// A checkpoint name must be one plain path segment.
fn checkpoint_name(name: &str) -> std::result::Result<&str, String> {
    if name.is_empty()
        || name.len() > 255
        || name.contains(['/', '\\', '\0'])
        || name == "."
        || name == ".."
    {
        Err(format!(
            "invalid checkpoint name {name:?} (one path segment of at most 255 bytes: no '/', '\\', NUL, '.' or '..')"
        ))
    } else {
        Ok(name)
    }
}

/// A model id as a directory name: server-issued ids are
/// `sess-…:train:N`; anything else (absolute paths, `..`) is refused.
fn model_segment(id: &str) -> std::result::Result<&str, String> {
    let plain = id
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | ':' | '.'));
    if id.is_empty() || id.len() > 255 || !plain || id == "." || id == ".." {
        Err(format!("invalid model id {id:?} in a checkpoint path"))
    } else {
        Ok(id)
    }
}

/// `{root}/{model_id}/{kind}/{name}`, every client-given part checked to be
/// one plain segment, so the result is always inside `root`.
fn checkpoint_dir(
    root: &std::path::Path,
    model_id: &str,
    kind: &str,
    name: &str,
) -> std::result::Result<PathBuf, String> {
    let dir = root
        .join(model_segment(model_id)?)
        .join(kind)
        .join(checkpoint_name(name)?);
    // Belt and braces: no segment above can leave the root.
    if dir.starts_with(root) && dir.components().count() == root.components().count() + 3 {
        Ok(dir)
    } else {
        Err(format!(
            "checkpoint path for {model_id:?}/{name:?} leaves the checkpoint directory"
        ))
    }
}

/// `tinker://{model_id}/{kind}/{name}` → its parts.
fn parse_tinker_path(path: &str) -> std::result::Result<(String, String, String), String> {
    let rest = path
        .strip_prefix("tinker://")
        .ok_or_else(|| format!("checkpoint path {path:?} must start with tinker://"))?;
    let parts: Vec<&str> = rest.split('/').collect();
    match parts.as_slice() {
        [model, kind, name] if !model.is_empty() && !name.is_empty() => Ok((
            model_segment(model)?.to_string(),
            kind.to_string(),
            checkpoint_name(name)?.to_string(),
        )),
        _ => Err(format!(
            "checkpoint path {path:?} must be tinker://MODEL_ID/KIND/NAME"
        )),
    }
}

#[derive(Deserialize)]
struct SaveWeights {
    model_id: String,
    #[serde(default)]
    path: Option<String>,
    #[serde(default)]
    seq_id: Option<i64>,
    #[serde(default)]
    sampling_session_seq_id: Option<i64>,
    /// tinker's `save_state(..., overwrite=False)`: replacing a checkpoint
    /// (only ever one of this model's own) must be asked for.
    #[serde(default)]
    overwrite: bool,
}

async fn save_weights(State(s): State<ApiState>, body: Bytes) -> Result<Json<Value>, ApiError> {
    let r: SaveWeights = parse(&body)?;
    let resp = s.dedupe(&r.model_id, r.seq_id, || {
        let prepared = (|| {
            let (run, _, _) = s.model(&r.model_id)?;
            let name = checkpoint_name(r.path.as_deref().unwrap_or_default())?.to_string();
            let dir = checkpoint_dir(&s.0.config.checkpoint_dir, &r.model_id, "weights", &name)?;
            if dir.exists() && !r.overwrite {
                return Err(format!(
                    "checkpoint tinker://{}/weights/{name} exists; save under another name or pass overwrite=True",
                    r.model_id
                ));
            }
            Ok::<_, String>((run, name, dir))
        })();
        let request_id = match prepared {
            Err(e) => s.failed_future(e),
            Ok((run, name, dir)) => {
                let path = format!("tinker://{}/weights/{name}", r.model_id);
                let pending = s.0.engine.save_state(&run, dir);
                s.spawn_future(async move {
                    pending.await?;
                    Ok(FutureState::Json(
                        json!({"type": "save_weights", "path": path}),
                    ))
                })
            }
        };
        json!({"request_id": request_id, "model_id": r.model_id})
    });
    Ok(Json(resp))
}

#[derive(Deserialize)]
struct LoadWeights {
    #[serde(default)]
    model_id: Option<String>,
    #[serde(default)]
    session_id: Option<String>,
    #[serde(default)]
    model_seq_id: Option<i64>,
    path: String,
    #[serde(default)]
    optimizer: bool,
    #[serde(default)]
    seq_id: Option<i64>,
    #[serde(default)]
    base_model: Option<String>,
}

/// `create_training_client_from_state("tinker://adapters/peft/NAME")`: a new
/// LoRA run starting from a served PEFT adapter — its rank, alpha, targets
/// and weights.
fn load_peft_adapter(
    s: &ApiState,
    r: &LoadWeights,
    target: String,
    name: &str,
) -> Result<Json<Value>, ApiError> {
    let adapters = &s.0.config.adapters;
    let adapter = adapters.get(name).cloned().ok_or_else(|| {
        ApiError::NotFound(format!(
            "no adapter {name:?} is served (temper api serve --adapter NAME=DIR); served: {:?}",
            adapters.keys().collect::<Vec<_>>()
        ))
    })?;
    if r.optimizer {
        return Err(ApiError::BadRequest(
            "a PEFT adapter has no optimizer state: use create_training_client_from_state".into(),
        ));
    }
    if s.model(&target).is_ok() {
        return Err(ApiError::BadRequest(format!(
            "{target} exists: a PEFT adapter starts a new training client (create_training_client_from_state)"
        )));
    }
    let base = match (&r.base_model, s.0.bases.len()) {
        (Some(b), _) => b.clone(),
        (None, 1) => {
            s.0.bases
                .keys()
                .next()
                .cloned()
                .ok_or_else(|| ApiError::Internal("no base model is served".into()))?
        }
        (None, _) => {
            return Err(ApiError::BadRequest(
                "several base models are served: pass base_model".into(),
            ))
        }
    };
    if !s.0.bases.contains_key(&base) {
        return Err(ApiError::NotFound(format!("unknown base_model {base:?}")));
    }
    let resp = s.dedupe(&target, r.seq_id.or(Some(-1)), || {
        let created =
            s.0.engine
                .create_lora_run_from_peft(&base, adapter.dir.clone());
        let (st, mid, path) = (s.clone(), target.clone(), r.path.clone());
        let request_id = s.spawn_future(async move {
            let run = created.await?;
            st.tables().models.insert(
                mid.clone(),
                TrainModel {
                    run,
                    base,
                    rank: adapter.rank,
                },
            );
            Ok(FutureState::Json(
                json!({"type": "load_weights", "path": path, "model_id": mid}),
            ))
        });
        json!({"request_id": request_id, "model_id": target})
    });
    Ok(Json(resp))
}

async fn load_weights(State(s): State<ApiState>, body: Bytes) -> Result<Json<Value>, ApiError> {
    let r: LoadWeights = parse(&body)?;
    let target = match (&r.model_id, &r.session_id, r.model_seq_id) {
        (Some(m), _, _) => m.clone(),
        (None, Some(sess), Some(n)) => {
            s.known_session(sess)?;
            format!("{sess}:train:{n}")
        }
        _ => {
            return Err(ApiError::BadRequest(
                "load_weights needs model_id, or session_id and model_seq_id".into(),
            ))
        }
    };
    if let Some(name) = r.path.strip_prefix(PEFT_ADAPTER_PREFIX) {
        return load_peft_adapter(&s, &r, target, name);
    }
    let resp = s.dedupe(&target, r.seq_id.or(Some(-1)), || {
        let prepared = (|| {
            let (src_model, kind, name) = parse_tinker_path(&r.path)?;
            if kind != "weights" {
                return Err(format!("load_weights needs a training checkpoint (…/weights/…), got {kind}"));
            }
            let dir = checkpoint_dir(&s.0.config.checkpoint_dir, &src_model, "weights", &name)?;
            if !dir.join("state.json").exists() {
                return Err(format!("no checkpoint at {}", r.path));
            }
            Ok::<_, String>((src_model, dir))
        })();
        let request_id = match prepared {
            Err(e) => s.failed_future(e),
            Ok((src_model, dir)) => {
                let st = s.clone();
                let (target, path, optimizer) = (target.clone(), r.path.clone(), r.optimizer);
                match s.model(&target) {
                    Ok((run, _, _)) => {
                        let pending = s.0.engine.load_state(&run, dir, optimizer);
                        s.spawn_future(async move {
                            pending.await?;
                            Ok(FutureState::Json(json!({"type": "load_weights", "path": path, "model_id": target})))
                        })
                    }
                    // Create-via-load: a new run shaped like the checkpoint (from its
                    // own state.json, so this works after a restart too), then load.
                    Err(_) => match s.checkpoint_shape(&dir, &src_model, r.base_model.as_deref()) {
                        Ok((base, cfg)) => {
                            let rank = cfg.rank;
                            let created = s.0.engine.create_lora_run(&base, cfg, 0);
                            s.spawn_future(async move {
                                let run = created.await?;
                                st.0.engine.load_state(&run, dir, optimizer).await?;
                                st.tables().models.insert(target.clone(), TrainModel { run, base, rank });
                                Ok(FutureState::Json(json!({"type": "load_weights", "path": path, "model_id": target})))
                            })
                        }
                        Err(e) => s.failed_future(e),
                    },
                }
            }
        };
        json!({"request_id": request_id, "model_id": target})
    });
    Ok(Json(resp))
}

async fn save_weights_for_sampler(
    State(s): State<ApiState>,
    body: Bytes,
) -> Result<Json<Value>, ApiError> {
    let r: SaveWeights = parse(&body)?;
    let resp = s.dedupe(&r.model_id, r.seq_id, || {
        let session = r
            .model_id
            .split(":train:")
            .next()
            .unwrap_or_default()
            .to_string();
        let prepared = (|| {
            let (run, base, _) = s.model(&r.model_id)?;
            match (&r.path, r.sampling_session_seq_id) {
                (Some(name), _) => {
                    let name = checkpoint_name(name)?;
                    let path = format!("tinker://{}/sampler_weights/{name}", r.model_id);
                    Ok::<_, String>((
                        run,
                        base,
                        path.clone(),
                        json!({"type": "save_weights_for_sampler", "path": path}),
                        None,
                    ))
                }
                (None, Some(n)) => {
                    let sid = format!("{session}:sample:{n}");
                    let key = format!("tinker://{}/sampler_weights/{sid}", r.model_id);
                    Ok((
                        run,
                        base,
                        key,
                        json!({"type": "save_weights_for_sampler", "sampling_session_id": sid}),
                        Some(sid),
                    ))
                }
                (None, None) => {
                    Err("save_weights_for_sampler needs path or sampling_session_seq_id".into())
                }
            }
        })();
        let request_id = match prepared {
            Err(e) => s.failed_future(e),
            Ok((run, base, key, result, session_id)) => {
                let pending = s.0.engine.save_weights_for_sampler(&run, &key);
                let st = s.clone();
                s.spawn_future(async move {
                    pending.await?;
                    if let Some(sid) = session_id {
                        st.tables().samplers.insert(
                            sid,
                            Sampler {
                                key: key.clone(),
                                base,
                                model_path: Some(key),
                            },
                        );
                    }
                    Ok(FutureState::Json(result))
                })
            }
        };
        json!({"request_id": request_id, "model_id": r.model_id})
    });
    Ok(Json(resp))
}

#[derive(Deserialize)]
struct CreateSamplingSession {
    session_id: String,
    sampling_session_seq_id: i64,
    #[serde(default)]
    model_path: Option<String>,
    #[serde(default)]
    base_model: Option<String>,
}

async fn create_sampling_session(
    State(s): State<ApiState>,
    body: Bytes,
) -> Result<Json<Value>, ApiError> {
    let r: CreateSamplingSession = parse(&body)?;
    s.known_session(&r.session_id)?;
    let sid = format!("{}:sample:{}", r.session_id, r.sampling_session_seq_id);
    let sampler = match (&r.model_path, &r.base_model) {
        (Some(path), _) => {
            let (model, kind, _) = parse_tinker_path(path).map_err(ApiError::BadRequest)?;
            if kind != "sampler_weights" {
                return Err(ApiError::BadRequest(format!(
                    "{path}: sampling needs sampler weights (save_weights_for_sampler)"
                )));
            }
            let (_, base, _) = s.model(&model).map_err(ApiError::NotFound)?;
            Sampler {
                key: path.clone(),
                base,
                model_path: Some(path.clone()),
            }
        }
        (None, Some(base)) => {
            if !s.0.bases.contains_key(base) {
                return Err(ApiError::NotFound(format!("unknown base_model {base:?}")));
            }
            let key = format!("base:{base}");
            s.0.engine
                .add_base_sampler(base, &key)
                .await
                .map_err(|e| ApiError::Internal(e.to_string()))?;
            Sampler {
                key,
                base: base.clone(),
                model_path: None,
            }
        }
        (None, None) => return Err(ApiError::BadRequest("give model_path or base_model".into())),
    };
    s.tables().samplers.insert(sid.clone(), sampler);
    Ok(Json(
        json!({"type": "create_sampling_session", "sampling_session_id": sid}),
    ))
}

async fn get_sampler(
    State(s): State<ApiState>,
    UrlPath(id): UrlPath<String>,
) -> Result<Json<Value>, ApiError> {
    let t = s.tables();
    let sm = t
        .samplers
        .get(&id)
        .ok_or_else(|| ApiError::NotFound(format!("unknown sampler {id}")))?;
    Ok(Json(
        json!({"sampler_id": id, "base_model": sm.base, "model_path": sm.model_path}),
    ))
}

#[derive(Deserialize)]
struct ModelInputJson {
    chunks: Vec<Value>,
}

#[derive(Deserialize, Default)]
struct SamplingParamsJson {
    #[serde(default)]
    max_tokens: Option<usize>,
    #[serde(default)]
    seed: Option<serde_json::Number>,
    #[serde(default)]
    stop: Option<Value>,
    #[serde(default)]
    temperature: Option<f64>,
    #[serde(default)]
    top_k: Option<i64>,
    #[serde(default)]
    top_p: Option<f64>,
}

#[derive(Deserialize)]
struct ASample {
    sampling_session_id: String,
    #[serde(default)]
    seq_id: Option<i64>,
    #[serde(default = "one")]
    num_samples: usize,
    prompt: ModelInputJson,
    #[serde(default)]
    sampling_params: SamplingParamsJson,
    #[serde(default)]
    prompt_logprobs: bool,
}

fn one() -> usize {
    1
}

fn prompt_tokens(m: &ModelInputJson) -> std::result::Result<Vec<u32>, String> {
    let mut out = Vec::new();
    for c in &m.chunks {
        if c.get("type")
            .and_then(|t| t.as_str())
            .unwrap_or("encoded_text")
            != "encoded_text"
        {
            return Err("only encoded_text chunks are supported".into());
        }
        let toks = c
            .get("tokens")
            .and_then(|t| t.as_array())
            .ok_or("encoded_text chunk without tokens")?;
        for t in toks {
            let id = t
                .as_u64()
                .and_then(|x| u32::try_from(x).ok())
                .ok_or(format!("bad token {t}"))?;
            out.push(id);
        }
    }
    if out.is_empty() {
        return Err("empty prompt".into());
    }
    Ok(out)
}

fn sampling_params(p: &SamplingParamsJson) -> std::result::Result<SamplingParams, String> {
    let mut out = SamplingParams {
        max_tokens: p.max_tokens.unwrap_or(16),
        temperature: p.temperature.unwrap_or(1.0),
        top_p: p.top_p.unwrap_or(1.0),
        top_k: p.top_k.filter(|&k| k > 0).map_or(0, |k| k as usize),
        // Seeds may exceed 2^63: fold them into u64.
        seed: p.seed.as_ref().map(|n| {
            n.as_u64()
                .or_else(|| n.as_i64().map(|x| x as u64))
                .unwrap_or_else(|| n.as_f64().unwrap_or(0.0) as u64)
        }),
        logprobs: true,
        ..Default::default()
    };
    match &p.stop {
        None | Some(Value::Null) => {}
        Some(Value::String(s)) => out.stop = vec![s.clone()],
        Some(Value::Array(a)) if a.is_empty() => out.ignore_eos = true,
        Some(Value::Array(a)) if a.iter().all(|v| v.is_string()) => {
            out.stop = a
                .iter()
                .filter_map(|v| v.as_str().map(str::to_string))
                .collect()
        }
        Some(Value::Array(a)) if a.iter().all(|v| v.is_u64()) => {
            out.ignore_eos = true;
            out.stop_token_ids = a
                .iter()
                .filter_map(|v| v.as_u64().map(|x| x as u32))
                .collect();
        }
        Some(other) => {
            return Err(format!(
                "stop must be a string, strings or token ids, got {other}"
            ))
        }
    }
    out.validate().map_err(|e| e.to_string())?;
    Ok(out)
}

fn sample_response(seqs: &[Completion], prompt_logprobs: Option<Vec<f32>>) -> Vec<u8> {
    proto::SampleResponse {
        sequences: seqs
            .iter()
            .map(|c| proto::SampledSequence {
                stop_reason: match c.finish_reason {
                    FinishReason::Stop => proto::StopReason::Stop as i32,
                    FinishReason::Length => proto::StopReason::Length as i32,
                },
                tokens: proto::le::i32_bytes(&c.tokens),
                logprobs: c.logprobs.as_ref().map(|l| proto::le::f32_bytes(l)),
            })
            .collect(),
        prompt_logprobs: prompt_logprobs.map(|l| proto::le::f32_bytes(&l)),
        prompt_cache_hit_tokens: 0,
    }
    .encode_to_vec()
}

async fn asample(State(s): State<ApiState>, body: Bytes) -> Result<Json<Value>, ApiError> {
    let r: ASample = parse(&body)?;
    let max = s.0.config.limits.max_num_samples;
    if r.num_samples > max {
        return Err(over_limit(
            "num_samples",
            r.num_samples,
            max,
            "--max-num-samples",
        ));
    }
    if r.num_samples == 0 {
        return Err(ApiError::BadRequest("num_samples must be >= 1".into()));
    }
    let (key, base) = {
        let t = s.tables();
        let sm = t.samplers.get(&r.sampling_session_id).ok_or_else(|| {
            ApiError::NotFound(format!(
                "unknown sampling_session_id {:?}",
                r.sampling_session_id
            ))
        })?;
        (sm.key.clone(), sm.base.clone())
    };
    let prompt = prompt_tokens(&r.prompt).map_err(ApiError::BadRequest)?;
    let params = sampling_params(&r.sampling_params).map_err(ApiError::BadRequest)?;
    let ctx = s.context_length(&base).map_err(ApiError::Internal)?;
    s.check_vocab(&base, "prompt", &prompt)
        .map_err(ApiError::BadRequest)?;
    if prompt.len() + params.max_tokens > ctx {
        return Err(ApiError::BadRequest(format!(
            "prompt ({} tokens) + max_tokens ({}) exceed the model's context length {ctx}",
            prompt.len(),
            params.max_tokens
        )));
    }
    let owner = format!("sample:{}", r.sampling_session_id);
    let resp = s.dedupe(&owner, r.seq_id, || {
        let seq_ids: Vec<String> = (0..r.num_samples).map(|_| s.next_id("seq")).collect();
        let request_id = {
            let temperature = params.temperature;
            let sample =
                s.0.engine
                    .sample(&key, prompt.clone(), r.num_samples, params);
            // Prompt logprobs at the request's sampling temperature: the
            // distribution its sampled tokens were drawn from (greedy scores
            // at 1, as the sampler reports it).
            let lps: Option<Pending<Vec<f32>>> =
                (r.prompt_logprobs && prompt.len() >= 2).then(|| {
                    s.0.engine
                        .compute_logprobs(&key, prompt.clone(), temperature)
                });
            let want_prompt = r.prompt_logprobs;
            s.spawn_future(async move {
                let seqs = sample.await?;
                let prompt_lp = match lps {
                    Some(p) => {
                        let mut v = vec![f32::NAN];
                        v.extend(p.await?);
                        Some(v)
                    }
                    None if want_prompt => Some(vec![f32::NAN]),
                    None => None,
                };
                Ok(FutureState::Proto(sample_response(&seqs, prompt_lp)))
            })
        };
        json!({"request_id": request_id, "sample_sequence_ids": seq_ids})
    });
    Ok(Json(resp))
}

#[derive(Deserialize)]
struct RetrieveFuture {
    request_id: String,
}

async fn retrieve_future(
    State(s): State<ApiState>,
    _headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    let r: RetrieveFuture = parse(&body)?;
    let deadline = tokio::time::Instant::now() + s.0.config.long_poll;
    loop {
        // Register for wake-ups before looking, so a completion between the
        // look and the wait is not missed.
        let notified = s.0.done.notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        {
            let mut t = s.tables();
            if !matches!(
                t.futures.get(&r.request_id),
                None | Some(FutureState::Pending)
            ) {
                let now = std::time::Instant::now();
                t.delivered.entry(r.request_id.clone()).or_insert(now);
            }
            match t.futures.get(&r.request_id) {
                None => {
                    return Err(ApiError::NotFound(format!(
                        "unknown request_id {}",
                        r.request_id
                    )))
                }
                Some(FutureState::Pending) => {}
                Some(FutureState::Json(v)) => return Ok(Json(v.clone()).into_response()),
                Some(FutureState::Proto(b)) => {
                    return Ok((
                        StatusCode::OK,
                        [(header::CONTENT_TYPE, "application/x-protobuf")],
                        b.clone(),
                    )
                        .into_response())
                }
                Some(FutureState::Failed { error, category }) => {
                    return Ok(Json(json!({"error": error, "category": category})).into_response())
                }
            }
        }
        if tokio::time::timeout_at(deadline, notified).await.is_err() {
            return Ok(Json(
                json!({"type": "try_again", "request_id": r.request_id, "queue_state": "active"}),
            )
            .into_response());
        }
    }
}
