//! Server settings and the shared state: the model, its scheduler, the
//! loaded LoRA adapters and their versions.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError, RwLock};
use std::time::{SystemTime, UNIX_EPOCH};

use temper_model::{LoraAdapter, Pretrained};

use super::capture::{CaptureLimits, CaptureStore};
use super::error::OpenAiError;
use super::feedback::{RewardLimits, RewardStore};
use super::grammars::{GrammarLimits, Grammars};
use super::protocol::SamplingDefaults;
use super::versions::PolicyVersions;

use crate::metrics::Metrics;
use crate::scheduler::{LoadedAdapter, Scheduler, SchedulerConfig};
use crate::structured::{Constraint, Grammar, GrammarCompiler};

/// Server settings.
#[derive(Debug, Clone)]
pub struct ServeConfig {
    /// The name of the base model in `model` fields and `/v1/models`.
    pub model_name: String,
    /// Other names the base model answers to in `model` fields (not listed
    /// in `/v1/models`): `temper serve` keeps a GGUF's file name here.
    pub model_aliases: Vec<String>,
    /// Required bearer token on `/v1/*`; `None` accepts any.
    pub api_key: Option<String>,
    /// Scheduler limits.
    pub scheduler: SchedulerConfig,
    /// Directories `POST /v1/load_lora_adapter` may load adapters from
    /// (canonical paths); empty: loading at run time is off.
    pub lora_roots: Vec<PathBuf>,
    /// Bounds of the token-capture store (`/v1/episodes`).
    pub capture: CaptureLimits,
    /// Bounds of structured-output grammar compilation.
    pub grammars: GrammarLimits,
}

impl ServeConfig {
    /// Defaults for `model`: 256 running sequences, a KV budget of 4 GiB of
    /// cache (at least one full-length sequence), 1024 queued requests,
    /// 512 prompt tokens prefilled per step, a prefix cache of a quarter of
    /// the KV budget.
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
            model_aliases: Vec::new(),
            api_key: None,
            lora_roots: Vec::new(),
            capture: CaptureLimits::default(),
            grammars: GrammarLimits::default(),
            scheduler: SchedulerConfig {
                max_running: 256,
                kv_budget_tokens,
                max_queue: 1024,
                max_model_len,
                max_prefill_tokens: 512,
                prefix_cache_tokens: kv_budget_tokens / 4,
            },
        }
    }
}

/// What a learning server (`temper serve --learn`) keeps durably: the
/// rewarded episodes that opted in to training, and the promoted versions.
#[derive(Clone)]
pub struct Learning {
    /// Rewarded, opted-in episodes (`rewarded.jsonl`).
    pub rewards: Arc<RewardStore>,
    /// Promoted versions (`versions/`, `live.json`).
    pub versions: Arc<PolicyVersions>,
    /// The server's own reward (`[learn] rubric`): an environment's rubric
    /// run on an episode's conversation when a client asks for it
    /// (`POST /v1/episodes/ID/reward {"rubric": {...}}`).
    pub rubric: Option<Arc<dyn EpisodeRubric>>,
    /// Rubric runs that could not score (no reward was recorded for them).
    pub rubric_errors: Arc<AtomicU64>,
}

/// A reward the server computes from an episode's captured calls.
pub trait EpisodeRubric: Send + Sync {
    /// The reward of the episode whose calls are `records` (in order),
    /// given the task's reference `answer` and `info` from the client; an
    /// error when the rubric could not score it (never a made-up 0).
    fn score(
        &self,
        records: Vec<super::capture::CaptureRecord>,
        answer: Option<String>,
        info: serde_json::Value,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = Result<f64, String>> + Send>>;
}

impl Learning {
    /// The learning state in `dir` (created if missing): the live version
    /// is served as adapter `adapter_name`.
    pub fn open(
        dir: &std::path::Path,
        adapter_name: &str,
        limits: RewardLimits,
    ) -> std::io::Result<Self> {
        std::fs::create_dir_all(dir)?;
        Ok(Self {
            rewards: Arc::new(RewardStore::open(&dir.join("rewarded.jsonl"), limits)?),
            versions: Arc::new(PolicyVersions::open(dir, adapter_name)?),
            rubric: None,
            rubric_errors: Arc::new(AtomicU64::new(0)),
        })
    }
}

/// Shared state: the model, its scheduler, the adapters.
#[derive(Clone)]
pub struct OpenAiState {
    pub(super) inner: Arc<Inner>,
}

pub(super) struct Inner {
    pub(super) model: Arc<Pretrained>,
    pub(super) cfg: ServeConfig,
    pub(super) scheduler: Scheduler,
    pub(super) adapters: RwLock<HashMap<String, Arc<LoadedAdapter>>>,
    /// Load counts per name; kept across unloads so versions never repeat.
    versions: Mutex<HashMap<String, u64>>,
    pub(super) metrics: Arc<Metrics>,
    pub(super) captures: CaptureStore,
    /// Set on a learning server.
    pub(super) learning: Option<Learning>,
    pub(super) defaults: SamplingDefaults,
    pub(super) created: u64,
    next_id: AtomicU64,
    /// Structured-output grammars; the compiler is built on the first
    /// structured-output request (a server that never gets one never pays
    /// for the vocabulary trie).
    grammars: Grammars,
}

pub(super) fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

impl OpenAiState {
    /// Start the scheduler over `model`.
    pub fn new(model: Arc<Pretrained>, cfg: ServeConfig) -> Self {
        Self::with_learning(model, cfg, None)
    }

    /// [`new`](Self::new), learning from use when `learning` is set
    /// (rewards stored, versions promoted and rolled back).
    pub fn with_learning(
        model: Arc<Pretrained>,
        cfg: ServeConfig,
        learning: Option<Learning>,
    ) -> Self {
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
                metrics: metrics.clone(),
                captures: CaptureStore::new(cfg.capture),
                learning,
                defaults,
                created: now_secs(),
                next_id: AtomicU64::new(start & 0xffff_ffff_ffff),
                grammars: Grammars::new(cfg.grammars, metrics.clone()),
            }),
        }
    }

    /// The learning state, on a learning server.
    pub fn learning(&self) -> Option<&Learning> {
        self.inner.learning.as_ref()
    }

    /// The metrics registry.
    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.inner.metrics
    }

    /// A client's `lora_path`, allowed only inside a configured root. The
    /// error is the same whether or not the path exists, so it reveals
    /// nothing about the server's files.
    pub(super) fn adapter_dir_in_roots(&self, path: &str) -> Result<PathBuf, OpenAiError> {
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
        self.load_adapter_as(name, dir, None)
    }

    /// [`load_adapter`](Self::load_adapter) with the version responses
    /// report: `Some(v)` for a learning server's promoted version `v`,
    /// `None` for the name's load count.
    pub(super) fn load_adapter_as(
        &self,
        name: &str,
        dir: &std::path::Path,
        as_version: Option<u64>,
    ) -> Result<u64, OpenAiError> {
        if name.is_empty() {
            return Err(OpenAiError::invalid(
                "lora_name",
                "lora_name must not be empty",
            ));
        }
        if self.is_base(name) {
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
            .unwrap_or_else(PoisonError::into_inner);
        let version = as_version.unwrap_or(versions.get(name).copied().unwrap_or(0) + 1);
        let adapter = Arc::new(LoadedAdapter {
            name: name.to_string(),
            version,
            lora,
        });
        self.inner
            .adapters
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(name.to_string(), adapter);
        versions.insert(name.to_string(), version);
        self.inner
            .metrics
            .adapter_loads
            .fetch_add(1, Ordering::Relaxed);
        tracing::info!(name, version, dir = %dir.display(), "loaded LoRA adapter");
        Ok(version)
    }

    /// Whether `model` names the base model (its name or an alias).
    fn is_base(&self, model: &str) -> bool {
        let cfg = &self.inner.cfg;
        model == cfg.model_name || cfg.model_aliases.iter().any(|a| a == model)
    }

    pub(super) fn resolve(&self, model: &str) -> Result<Option<Arc<LoadedAdapter>>, OpenAiError> {
        if self.is_base(model) {
            return Ok(None);
        }
        let table = self
            .inner
            .adapters
            .read()
            .unwrap_or_else(PoisonError::into_inner);
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

    /// A grammar for a structured-output constraint on this model
    /// (compiled under [`GrammarLimits`], or cached). A schema that does not
    /// compile or exceeds a limit is a 400 about `param` naming why.
    pub(super) async fn grammar(
        &self,
        c: Constraint,
        param: &'static str,
    ) -> Result<Grammar, OpenAiError> {
        let m = self.inner.model.clone();
        self.inner
            .grammars
            .grammar(c, param, move || {
                let vocab = m.config.vocab_size;
                GrammarCompiler::new(&m.tokenizer, vocab, &m.generation.eos_token_ids).map_err(
                    |e| {
                        tracing::warn!("structured outputs unavailable: {e}");
                        e.to_string()
                    },
                )
            })
            .await
    }

    pub(super) fn request_id(&self, prefix: &str) -> String {
        let n = self.inner.next_id.fetch_add(1, Ordering::Relaxed);
        format!("{prefix}-{n:016x}")
    }
}
