//! Service settings, per-request limits and the shared state: the engine,
//! the served base models, and the tables of sessions, models, samplers
//! and futures.

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use serde_json::Value;
use temper_engine::{Engine, RunKind, TrainingRun};
use temper_model::{LoraConfig, Pretrained, Target};
use tokio::sync::Notify;

use super::futures::FutureState;
use crate::error::ApiError;

/// LoRA alpha for runs created over the API (the SDK only sends a rank).
pub const LORA_ALPHA: f64 = temper_model::LoraConfig::DEFAULT_ALPHA;

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

pub(super) fn over_limit(what: &str, got: usize, limit: usize, flag: &str) -> ApiError {
    ApiError::BadRequest(format!(
        "{what} {got} exceeds this server's limit {limit} ({flag})"
    ))
}

pub(super) struct TrainModel {
    pub(super) run: String,
    pub(super) base: String,
    pub(super) rank: usize,
}

pub(super) struct Sampler {
    pub(super) key: String,
    pub(super) base: String,
    pub(super) model_path: Option<String>,
}

#[derive(Default)]
pub(super) struct Tables {
    pub(super) sessions: HashMap<String, bool>,
    pub(super) models: HashMap<String, TrainModel>,
    pub(super) samplers: HashMap<String, Sampler>,
    pub(super) futures: HashMap<String, FutureState>,
    /// First delivery time of finished futures, for eviction.
    pub(super) delivered: HashMap<String, std::time::Instant>,
    /// When each future finished, for evicting results nobody retrieves.
    pub(super) finished: HashMap<String, std::time::Instant>,
    /// `(model or sampling session, seq_id)` → request id, so resubmits dedupe.
    pub(super) seen: HashMap<(String, i64), Value>,
}

pub(super) struct Inner {
    pub(super) engine: Engine,
    pub(super) bases: BTreeMap<String, BaseModel>,
    pub(super) config: ApiConfig,
    pub(super) tables: Mutex<Tables>,
    pub(super) done: Notify,
    pub(super) ids: AtomicU64,
    /// Random per server start, part of every id: ids never repeat across
    /// restarts, so a new run can never land on an old run's checkpoints.
    boot: String,
}

/// Shared service state (cheap to clone).
#[derive(Clone)]
pub struct ApiState(pub(super) Arc<Inner>);

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

    pub(super) fn tables(&self) -> std::sync::MutexGuard<'_, Tables> {
        self.0.tables.lock().unwrap_or_else(PoisonError::into_inner)
    }

    pub(super) fn next_id(&self, prefix: &str) -> String {
        format!(
            "{prefix}-{}-{}",
            self.0.boot,
            self.0.ids.fetch_add(1, Ordering::Relaxed) + 1
        )
    }

    /// Models and sampling sessions hang off a session this server issued:
    /// a client-chosen session id would become part of checkpoint paths.
    pub(super) fn known_session(&self, id: &str) -> Result<(), ApiError> {
        if self.tables().sessions.contains_key(id) {
            Ok(())
        } else {
            Err(ApiError::NotFound(format!(
                "unknown session_id {id:?}: ids come from create_session"
            )))
        }
    }

    pub(super) fn model(
        &self,
        model_id: &str,
    ) -> std::result::Result<(String, String, usize), String> {
        self.tables()
            .models
            .get(model_id)
            .map(|m| (m.run.clone(), m.base.clone(), m.rank))
            .ok_or_else(|| format!("unknown model_id {model_id:?}"))
    }

    /// The base model and LoRA shape of the checkpoint in `dir`: the base
    /// from the live run that saved it, the client's `base_model`, the base
    /// whose directory the checkpoint names, or the only base served.
    pub(super) fn checkpoint_shape(
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
    pub(super) fn context_length(&self, base: &str) -> std::result::Result<usize, String> {
        self.0
            .bases
            .get(base)
            .map(|b| b.model.config.max_position_embeddings)
            .ok_or_else(|| format!("base model {base:?} is not served"))
    }

    /// Every token id must be in the base model's vocabulary (a user error,
    /// not a server one, when it is not).
    pub(super) fn check_vocab(
        &self,
        base: &str,
        what: &str,
        ids: &[u32],
    ) -> std::result::Result<(), String> {
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
