//! The eval loop: rows → groups of rollouts → scores → `results.jsonl`.

use std::collections::HashSet;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use futures::StreamExt;
use serde_json::Value;
use temper_env::openai::{OpenAiChatModel, RetryPolicy};
use temper_env::{
    score_and_time, ChatModel, ChatRequest, Environment, ModelCallError, ModelTurn, Row,
    SamplingArgs, Split,
};
use tokio::sync::Semaphore;

use crate::report::summarize;
use crate::results::{
    read_results, recover, write_metadata, Metadata, ResultLine, ResultsWriter, RunUsage,
};
use crate::EvalError;

/// Everything one evaluation needs.
#[derive(Debug, Clone)]
pub struct EvalConfig {
    /// How the environment was named (`arithmetic`, a directory, a command).
    pub env_spec: String,
    /// Environment arguments.
    pub env_args: Value,
    /// The hub package the environment was pulled from (recorded in
    /// `metadata.json`).
    pub env_package: Option<temper_env::PackageRef>,
    /// Model name sent to the endpoint.
    pub model: String,
    /// OpenAI-compatible base URL.
    pub base_url: String,
    /// API key.
    pub api_key: Option<String>,
    /// The variable the key came from (recorded; the key is not).
    pub api_key_env: Option<String>,
    /// Examples.
    pub num_examples: usize,
    /// Which rows: the held-out `Eval` split (the default of `temper
    /// eval`), or `Train` (to sample training data from a teacher).
    pub split: Split,
    /// Rollouts per example.
    pub rollouts_per_example: usize,
    /// Most model calls in flight.
    pub max_concurrent: usize,
    /// Sampling arguments.
    pub sampling: SamplingArgs,
    /// Seed of the eval rows.
    pub seed: u64,
    /// Run directory (`results.jsonl`, `metadata.json`).
    pub run_dir: PathBuf,
    /// Per-request timeout.
    pub request_timeout: Duration,
    /// Retries.
    pub retry: RetryPolicy,
    /// A rollout passes at reward ≥ this (pass@k).
    pub pass_threshold: f64,
    /// Continue the run in `run_dir`.
    pub resume: bool,
    /// Show a progress bar.
    pub progress: bool,
}

/// A [`ChatModel`] with at most `n` calls in flight.
pub struct Bounded<M> {
    inner: M,
    permits: Semaphore,
}

impl<M> Bounded<M> {
    /// Wrap `inner`.
    pub fn new(inner: M, n: usize) -> Self {
        Bounded {
            inner,
            permits: Semaphore::new(n.max(1)),
        }
    }
}

#[async_trait]
impl<M: ChatModel> ChatModel for Bounded<M> {
    async fn chat(&self, req: ChatRequest) -> Result<ModelTurn, ModelCallError> {
        let _permit = self
            .permits
            .acquire()
            .await
            .map_err(|e| ModelCallError::Other(e.to_string()))?;
        self.inner.chat(req).await
    }
}

/// The outcome of [`run_eval`].
#[derive(Debug, Clone)]
pub struct EvalOutcome {
    /// The final metadata (also in `metadata.json`).
    pub metadata: Metadata,
    /// Rollouts run in this session (not counting resumed ones).
    pub new_rollouts: usize,
}

/// Evaluate `env` against the endpoint in `cfg`.
pub async fn run_eval(
    env: Arc<dyn Environment>,
    cfg: &EvalConfig,
) -> Result<EvalOutcome, EvalError> {
    let mut model = OpenAiChatModel::new(&cfg.base_url, &cfg.model, cfg.api_key.clone())?;
    model.retry = cfg.retry;
    model.timeout = cfg.request_timeout;
    preflight(&model, cfg).await?;
    // The services the environment calls (sandbox, judge) too: one that is
    // down or refuses the key would otherwise score every rollout 0.
    temper_env::check_services(env.as_ref()).await?;
    run_eval_with(env, Arc::new(model), cfg).await
}

/// One `GET /models` before any rollout, so that a server that is down, a
/// wrong key or a wrong model name ends the run at once with the reason,
/// instead of every rollout retrying for half a minute and scoring 0.
pub async fn preflight(model: &OpenAiChatModel, cfg: &EvalConfig) -> Result<(), EvalError> {
    let timeout = cfg.request_timeout.min(Duration::from_secs(30));
    match served_models(model, cfg.api_key_env.as_deref(), timeout).await? {
        None => {
            // No model list to check against: the first rollouts will tell.
            tracing::warn!(
                "{}/models is not served; skipping the model-name check",
                model.base_url()
            );
            Ok(())
        }
        Some(ids) if ids.iter().any(|id| id == model.model()) => Ok(()),
        Some(ids) => Err(EvalError::Preflight(format!(
            "the endpoint {} does not serve model `{}`; it offers: {} (choose one with -m)",
            model.base_url(),
            model.model(),
            if ids.is_empty() {
                "nothing".to_string()
            } else {
                ids.join(", ")
            }
        ))),
    }
}

/// The model to evaluate when none is named: the endpoint's only one (as
/// `temper serve` has), found by `GET /models`. Several, or no list, is an
/// error that says to choose with -m.
pub async fn endpoint_model(
    base_url: &str,
    api_key: Option<String>,
    api_key_env: Option<&str>,
    timeout: Duration,
) -> Result<String, EvalError> {
    let probe = OpenAiChatModel::new(base_url, "", api_key)?;
    match served_models(&probe, api_key_env, timeout.min(Duration::from_secs(30))).await? {
        Some(mut ids) if ids.len() == 1 => Ok(ids.remove(0)),
        Some(ids) => Err(EvalError::Preflight(format!(
            "the endpoint {base_url} serves {} models ({}); choose one with -m",
            ids.len(),
            ids.join(", ")
        ))),
        None => Err(EvalError::Preflight(format!(
            "the endpoint {base_url} does not list its models (GET /models); name one with -m"
        ))),
    }
}

/// `GET /models`: the served ids (`None`: the endpoint has no such route),
/// or why the endpoint cannot be used, in words a user can act on.
async fn served_models(
    model: &OpenAiChatModel,
    api_key_env: Option<&str>,
    timeout: Duration,
) -> Result<Option<Vec<String>>, EvalError> {
    let url = format!("{}/models", model.base_url());
    let fail = |why: String| Err(EvalError::Preflight(why));
    match model.list_models(timeout).await {
        Ok(ids) => Ok(ids),
        Err(ModelCallError::Status { status, message }) if status == 401 || status == 403 => {
            let key = match api_key_env {
                Some(var) => format!("the key in ${var} was refused"),
                None => "no key was sent".to_string(),
            };
            fail(format!(
                "{url} answered {status} ({message}): {key}; check -k / the API key (-k names the environment variable that holds it)"
            ))
        }
        Err(ModelCallError::Status { status, message }) => {
            fail(format!("{url} answered {status}: {message}"))
        }
        Err(ModelCallError::Connection(reason)) => fail(format!(
            "cannot reach {url}: {reason} (is the server running? -b sets the base URL)"
        )),
        Err(ModelCallError::Timeout(s)) => fail(format!("{url} did not answer within {s:.0}s")),
        Err(e) => fail(format!("{url}: {e}")),
    }
}

/// Evaluate `env` with any [`ChatModel`] (the endpoint fields of `cfg` are
/// only recorded).
pub async fn run_eval_with(
    env: Arc<dyn Environment>,
    model: Arc<dyn ChatModel>,
    cfg: &EvalConfig,
) -> Result<EvalOutcome, EvalError> {
    let started = Instant::now();
    std::fs::create_dir_all(&cfg.run_dir).map_err(|e| EvalError::io(&cfg.run_dir, e))?;
    let results_path = cfg.run_dir.join("results.jsonl");
    let r = cfg.rollouts_per_example.max(1);

    let (done, prior_time, date) = if cfg.resume {
        let done: HashSet<u64> = recover(&results_path, r)?.into_iter().collect();
        let prior = crate::results::read_metadata(&cfg.run_dir).ok();
        (
            done,
            prior.as_ref().map_or(0.0, |m| m.time),
            prior.map(|m| m.date),
        )
    } else {
        if results_path.exists() {
            return Err(EvalError::Results(format!(
                "{} exists; use --resume to continue that run",
                results_path.display()
            )));
        }
        (HashSet::new(), 0.0, None)
    };
    let date = date.unwrap_or_else(|| chrono::Utc::now().to_rfc3339());

    let rows_env = env.clone();
    let (n, seed, split) = (cfg.num_examples, cfg.seed, cfg.split);
    let rows = tokio::task::spawn_blocking(move || rows_env.rows(split, n, seed))
        .await
        .map_err(|e| EvalError::Results(e.to_string()))??;
    // What was evaluated: an environment with fewer rows than asked for
    // gives them all, and the run says so.
    let evaluated = rows.len();
    let todo: Vec<Row> = rows
        .into_iter()
        .filter(|r| !done.contains(&r.example_id))
        .collect();

    let run_id = cfg
        .run_dir
        .file_name()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default();
    let mut meta = Metadata {
        env_id: env.id().to_string(),
        model: cfg.model.clone(),
        base_url: cfg.base_url.clone(),
        num_examples: evaluated,
        split: cfg.split,
        rollouts_per_example: r,
        sampling_args: cfg.sampling.clone(),
        avg_reward: 0.0,
        avg_metrics: Default::default(),
        pass_at_k: Default::default(),
        usage: RunUsage::default(),
        time: prior_time,
        date,
        run_id,
        status: "running".into(),
        num_rollouts: done.len() * r,
        num_errors: 0,
        num_reward_errors: 0,
        env_spec: cfg.env_spec.clone(),
        env_args: cfg.env_args.clone(),
        env_package: cfg.env_package.clone(),
        max_concurrent: cfg.max_concurrent,
        seed: cfg.seed,
        api_key_env: cfg.api_key_env.clone(),
        pass_threshold: cfg.pass_threshold,
    };
    write_metadata(&cfg.run_dir, &meta)?;

    let writer = Arc::new(ResultsWriter::open(&results_path)?);
    let bounded: Arc<dyn ChatModel> = Arc::new(Bounded::new(model, cfg.max_concurrent));
    let total = (todo.len() + done.len()) * r;
    let bar = progress_bar(cfg.progress, total as u64, (done.len() * r) as u64);
    let reward_sum = Arc::new(Mutex::new((0.0f64, 0usize)));
    let written = Arc::new(AtomicUsize::new(0));
    let write_error: Arc<Mutex<Option<std::io::Error>>> = Arc::new(Mutex::new(None));

    let groups = futures::stream::iter(todo.into_iter().map(|row| {
        let env = env.clone();
        let model = bounded.clone();
        let sampling = cfg.sampling.clone();
        let writer = writer.clone();
        let bar = bar.clone();
        let reward_sum = reward_sum.clone();
        let written = written.clone();
        let write_error = write_error.clone();
        async move {
            let mut rollouts = futures::future::join_all(
                (0..r).map(|_| env.rollout(model.as_ref(), &row, &sampling)),
            )
            .await;
            let scores = score_and_time(env.as_ref(), &row, &mut rollouts).await;
            let lines: Vec<ResultLine> = rollouts
                .into_iter()
                .zip(scores)
                .map(|(ro, sc)| ResultLine {
                    example_id: row.example_id,
                    prompt: row.prompt.clone(),
                    completion: ro.completion,
                    answer: row.answer.clone(),
                    info: row.info.clone(),
                    reward: sc.reward,
                    metrics: sc.metrics,
                    reward_error: sc.error,
                    timing: ro.timing,
                    is_completed: ro.is_completed,
                    is_truncated: ro.is_truncated,
                    error: ro.error,
                    stop_condition: ro.stop_condition,
                    token_usage: ro.token_usage,
                })
                .collect();
            if let Err(e) = writer.append(&lines) {
                write_error
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .get_or_insert(e);
                return;
            }
            written.fetch_add(lines.len(), Ordering::Relaxed);
            {
                let mut s = reward_sum.lock().unwrap_or_else(PoisonError::into_inner);
                s.0 += lines.iter().map(|l| l.reward).sum::<f64>();
                s.1 += lines.len();
                bar.set_message(format!("avg reward {:.3}", s.0 / s.1 as f64));
            }
            bar.inc(lines.len() as u64);
        }
    }))
    .buffer_unordered(cfg.max_concurrent.max(1));
    groups.collect::<Vec<()>>().await;
    bar.finish_and_clear();
    if let Some(e) = write_error
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .take()
    {
        return Err(EvalError::io(&results_path, e));
    }
    writer.sync().map_err(|e| EvalError::io(&results_path, e))?;

    let lines = read_results(&results_path)?;
    let s = summarize(&lines, cfg.pass_threshold);
    meta.avg_reward = s.avg_reward;
    meta.avg_metrics = s.avg_metrics;
    meta.pass_at_k = s.pass_at_k;
    meta.usage = s.usage;
    meta.num_rollouts = s.num_rollouts;
    meta.num_errors = s.num_errors;
    meta.num_reward_errors = s.num_reward_errors;
    meta.time = prior_time + started.elapsed().as_secs_f64();
    meta.status = "completed".into();
    write_metadata(&cfg.run_dir, &meta)?;
    Ok(EvalOutcome {
        metadata: meta,
        new_rollouts: written.load(Ordering::Relaxed),
    })
}

fn progress_bar(show: bool, total: u64, done: u64) -> indicatif::ProgressBar {
    if !show {
        return indicatif::ProgressBar::hidden();
    }
    let bar = indicatif::ProgressBar::new(total);
    if let Ok(style) = indicatif::ProgressStyle::with_template(
        "{bar:40} {pos}/{len} rollouts  {per_sec}  eta {eta}  {msg}",
    ) {
        bar.set_style(style);
    }
    bar.set_position(done);
    bar
}

/// `outputs/evals/{env}--{model}/{run_id}` with `/` in names replaced.
pub fn default_run_dir(save_dir: &std::path::Path, env_id: &str, model: &str) -> PathBuf {
    let clean = |s: &str| s.replace(['/', '\\', ' ', ':'], "_");
    let run_id = format!(
        "{}-{:04x}",
        chrono::Utc::now().format("%Y%m%d-%H%M%S"),
        rand::random::<u16>()
    );
    save_dir
        .join(format!("{}--{}", clean(env_id), clean(model)))
        .join(run_id)
}
