//! Jobs: many trials (tasks × attempts) run concurrently into Harbor's job
//! layout, resumable.
//!
//! ```text
//! jobs/<job_name>/            job_name defaults to the start time, 2026-11-25__19-30-00
//!   config.json               JobConfig: the agent and every planned trial, named up front
//!   result.json               JobResult, written when the job ends
//!   <task>__<id>/             one trial (see `trial`)
//! ```
//!
//! Every file is also Harbor's own: `config.json` validates as Harbor's
//! `JobConfig` (temper's plan in extra fields, which Harbor ignores) and
//! `result.json` as its `JobResult`, with the stats Harbor computes, so
//! `harbor view` shows a temper job.
//!
//! Trials are planned (and named) before any runs, so a job killed midway
//! is resumed by running exactly the planned trials that have no
//! `result.json`; a half-written trial directory is discarded and rerun.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, PoisonError};

use rand::Rng;
use serde::{Deserialize, Serialize};

use crate::agent::Agent;
use crate::task::Task;
use crate::trial::{run_trial, TrialOptions, TrialResult};
use crate::TaskError;

/// `n` random lowercase alphanumerics.
pub fn random_id(n: usize) -> String {
    const CHARS: &[u8] = b"abcdefghijklmnopqrstuvwxyz0123456789";
    let mut rng = rand::rng();
    (0..n)
        .map(|_| CHARS[rng.random_range(0..CHARS.len())] as char)
        .collect()
}

/// Which agent, with what settings: enough to build it again on resume.
/// The API key is never stored. Written as Harbor's `AgentConfig`: `name`,
/// `model_name`, `base_url`, and the rest in `kwargs`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(into = "HarborAgentConfig", from = "HarborAgentConfig")]
pub struct AgentSpec {
    /// `oracle`, `nop`, `terminal` or `command`.
    pub name: String,
    /// Model name for model-backed agents.
    #[serde(default)]
    pub model: Option<String>,
    /// OpenAI-compatible base URL (`http://host:port/v1`).
    #[serde(default)]
    pub base_url: Option<String>,
    /// The program of the `command` agent (run with `sh -c`).
    #[serde(default)]
    pub command: Option<String>,
    /// `terminal`: most model turns.
    #[serde(default)]
    pub max_turns: Option<u32>,
    /// `terminal`: most prompt + completion tokens over the trial.
    #[serde(default)]
    pub max_total_tokens: Option<u64>,
    /// `terminal`: completion tokens per turn.
    #[serde(default)]
    pub max_tokens_per_turn: Option<usize>,
    /// `terminal`: sampling temperature.
    #[serde(default)]
    pub temperature: Option<f64>,
    /// `terminal`, `command`: record every model call of each trial at the
    /// token level (the endpoint must be `temper serve`); see [`crate::capture`].
    #[serde(default)]
    pub capture: bool,
}

/// [`AgentSpec`] as Harbor's `AgentConfig`.
#[derive(Serialize, Deserialize)]
struct HarborAgentConfig {
    name: String,
    #[serde(default, alias = "model", skip_serializing_if = "Option::is_none")]
    model_name: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    base_url: Option<String>,
    #[serde(default)]
    kwargs: AgentKwargs,
    /// Jobs written before temper wrote Harbor's shape kept the settings
    /// at the top (and `model` for `model_name`); read, never written.
    #[serde(flatten, skip_serializing)]
    legacy: AgentKwargs,
}

/// The settings of [`AgentSpec`] Harbor has no field for.
#[derive(Default, Serialize, Deserialize)]
struct AgentKwargs {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    command: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    max_turns: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    max_total_tokens: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    max_tokens_per_turn: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    temperature: Option<f64>,
    #[serde(default)]
    capture: bool,
}

impl From<AgentSpec> for HarborAgentConfig {
    fn from(a: AgentSpec) -> Self {
        HarborAgentConfig {
            name: a.name,
            model_name: a.model,
            base_url: a.base_url,
            kwargs: AgentKwargs {
                command: a.command,
                max_turns: a.max_turns,
                max_total_tokens: a.max_total_tokens,
                max_tokens_per_turn: a.max_tokens_per_turn,
                temperature: a.temperature,
                capture: a.capture,
            },
            legacy: AgentKwargs::default(),
        }
    }
}

impl From<HarborAgentConfig> for AgentSpec {
    fn from(a: HarborAgentConfig) -> Self {
        let (k, l) = (a.kwargs, a.legacy);
        AgentSpec {
            name: a.name,
            model: a.model_name,
            base_url: a.base_url,
            command: k.command.or(l.command),
            max_turns: k.max_turns.or(l.max_turns),
            max_total_tokens: k.max_total_tokens.or(l.max_total_tokens),
            max_tokens_per_turn: k.max_tokens_per_turn.or(l.max_tokens_per_turn),
            temperature: k.temperature.or(l.temperature),
            capture: k.capture || l.capture,
        }
    }
}

/// `agents` in Harbor's `JobConfig` is a list; a temper job has one.
mod one_agent {
    use super::AgentSpec;
    use serde::{de::Error, Deserialize, Deserializer, Serialize, Serializer};

    pub fn serialize<S: Serializer>(a: &AgentSpec, s: S) -> Result<S::Ok, S::Error> {
        std::slice::from_ref(a).serialize(s)
    }

    /// A list (Harbor's `agents`) or one object (`agent`, as jobs written
    /// before temper wrote Harbor's shape have it).
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum ListOrOne {
        List(Vec<AgentSpec>),
        One(AgentSpec),
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<AgentSpec, D::Error> {
        let mut v = match ListOrOne::deserialize(d)? {
            ListOrOne::List(v) => v,
            ListOrOne::One(a) => return Ok(a),
        };
        match v.len() {
            1 => Ok(v.remove(0)),
            n => Err(D::Error::custom(format!(
                "a temper job has one agent, this one lists {n}"
            ))),
        }
    }
}

/// One planned trial.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PlannedTrial {
    /// `<task>__<id>`: the trial's directory name.
    pub trial_name: String,
    /// The task's name.
    pub task_name: String,
    /// The task's directory.
    pub task_path: PathBuf,
}

/// A job's `config.json`: Harbor's `JobConfig` fields (`job_name`,
/// `jobs_dir`, `agents`, `n_attempts`, `n_concurrent_trials`,
/// `agent_timeout_multiplier`, `environment`, `tasks`), then temper's own.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct JobConfig {
    /// The directory name.
    pub job_name: String,
    /// The directory holding the job's directory.
    #[serde(default)]
    pub jobs_dir: PathBuf,
    /// The agent (Harbor's `agents`, a list of one).
    #[serde(rename = "agents", alias = "agent", with = "one_agent")]
    pub agent: AgentSpec,
    /// Trials per task.
    pub n_attempts: u32,
    /// Trials run at once.
    #[serde(rename = "n_concurrent_trials", alias = "n_concurrent")]
    pub n_concurrent: usize,
    /// Multiplies every task's `[agent] timeout_sec`.
    #[serde(default)]
    pub agent_timeout_multiplier: Option<f64>,
    /// The sandbox, as Harbor's `EnvironmentConfig`.
    #[serde(default)]
    pub environment: JobEnvironment,
    /// Each task directory once (Harbor's `tasks`).
    #[serde(default)]
    pub tasks: Vec<TaskRef>,
    /// ISO 8601 (temper's).
    pub created_at: String,
    /// Every trial, in order (temper's: what resume runs).
    pub trials: Vec<PlannedTrial>,
    /// `allow_internet` of jobs written before it moved into
    /// `environment.kwargs`; [`load_job`] moves it there.
    #[serde(default, rename = "allow_internet", skip_serializing)]
    legacy_allow_internet: bool,
}

/// A job's sandbox as Harbor's `EnvironmentConfig`: named by `import_path`
/// ([`crate::harbor::SANDBOX_IMPORT_PATH`]; Harbor has no `type` for it).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct JobEnvironment {
    /// [`crate::harbor::SANDBOX_IMPORT_PATH`].
    pub import_path: String,
    /// What the sandbox is given.
    pub kwargs: SandboxKwargs,
}

impl Default for JobEnvironment {
    fn default() -> Self {
        JobEnvironment {
            import_path: crate::harbor::SANDBOX_IMPORT_PATH.into(),
            kwargs: SandboxKwargs::default(),
        }
    }
}

/// The job-wide settings of temper's sandbox.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct SandboxKwargs {
    /// Tasks with `allow_internet = true` share the host's network.
    #[serde(default)]
    pub allow_internet: bool,
}

/// A task of the job (Harbor's `TaskConfig` by `path`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TaskRef {
    /// The task's directory.
    pub path: PathBuf,
}

/// A job's `result.json`: Harbor's `JobResult` (`job_name` is temper's).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct JobResult {
    /// Unique id (a UUID).
    pub id: String,
    /// The directory name.
    pub job_name: String,
    /// When this run (or resume) of the job started.
    pub started_at: String,
    /// When the result was last written (= `finished_at`).
    pub updated_at: String,
    /// When it ended.
    pub finished_at: String,
    /// Planned trials.
    pub n_total_trials: usize,
    /// Totals.
    pub stats: JobStats,
}

/// Totals of a job: Harbor's `JobStats`, as Harbor computes them from the
/// trials' results, plus temper's `mean_reward` and `n_resumed`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct JobStats {
    /// Trials with a result.
    pub n_completed_trials: usize,
    /// Trials with an exception.
    pub n_errored_trials: usize,
    /// Always 0 in a written result (the job has ended).
    pub n_running_trials: usize,
    /// Planned trials without a result.
    pub n_pending_trials: usize,
    /// Always 0: temper does not cancel trials.
    pub n_cancelled_trials: usize,
    /// Always 0: temper does not retry trials.
    pub n_retries: usize,
    /// Per `<agent>[__<model>]__adhoc` key (Harbor's), the rewards and
    /// exceptions of the trials.
    pub evals: BTreeMap<String, EvalStats>,
    /// Prompt tokens of all trials, where agents counted them.
    pub n_input_tokens: Option<u64>,
    /// Completion tokens of all trials, where agents counted them.
    pub n_output_tokens: Option<u64>,
    /// Mean of `reward` over trials with a result (0 for those without).
    pub mean_reward: f64,
    /// Trials resumed from an earlier run (not run again).
    pub n_resumed: usize,
}

/// Harbor's `AgentDatasetStats`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct EvalStats {
    /// Trials with rewards.
    pub n_trials: usize,
    /// Trials with an exception.
    pub n_errors: usize,
    /// Harbor's default metric, `Mean`: `{"mean": x}` when the trials
    /// report one reward key, else the mean of each key.
    pub metrics: Vec<BTreeMap<String, f64>>,
    /// Reward key → value → trial names.
    pub reward_stats: BTreeMap<String, BTreeMap<String, Vec<String>>>,
    /// Exception type → trial names.
    pub exception_stats: BTreeMap<String, Vec<String>>,
}

impl JobStats {
    /// The stats of `results` out of `n_total` planned trials, computed as
    /// Harbor's `JobStats.increment` and `Mean` metric do.
    pub fn of(results: &[TrialResult], n_total: usize, n_resumed: usize) -> JobStats {
        let mut stats = JobStats {
            n_completed_trials: results.len(),
            n_pending_trials: n_total.saturating_sub(results.len()),
            n_resumed,
            ..JobStats::default()
        };
        let mut rewards: BTreeMap<String, Vec<Option<&BTreeMap<String, f64>>>> = BTreeMap::new();
        for r in results {
            let key = match &r.agent_info.model_info {
                Some(m) => format!("{}__{}__adhoc", r.agent_info.name, m.name),
                None => format!("{}__adhoc", r.agent_info.name),
            };
            let eval = stats.evals.entry(key.clone()).or_default();
            let scored = r.verifier_result.as_ref().and_then(|v| v.rewards.as_ref());
            if let Some(m) = scored {
                eval.n_trials += 1;
                for (k, v) in m {
                    eval.reward_stats
                        .entry(k.clone())
                        .or_default()
                        .entry(v.to_string())
                        .or_default()
                        .push(r.trial_name.clone());
                }
            }
            rewards.entry(key).or_default().push(scored);
            if let Some(e) = &r.exception_info {
                eval.exception_stats
                    .entry(e.exception_type.clone())
                    .or_default()
                    .push(r.trial_name.clone());
                eval.n_errors += 1;
                stats.n_errored_trials += 1;
            }
            if let Some(a) = &r.agent_result {
                if let Some(n) = a.n_input_tokens {
                    *stats.n_input_tokens.get_or_insert(0) += n;
                }
                if let Some(n) = a.n_output_tokens {
                    *stats.n_output_tokens.get_or_insert(0) += n;
                }
            }
        }
        for (key, list) in rewards {
            if let Some(eval) = stats.evals.get_mut(&key) {
                eval.metrics = vec![mean_metric(&list)];
            }
        }
        if !results.is_empty() {
            stats.mean_reward =
                results.iter().map(TrialResult::reward).sum::<f64>() / results.len() as f64;
        }
        stats
    }

    /// Exception type → trial names, over every eval.
    pub fn exceptions(&self) -> BTreeMap<&str, Vec<&str>> {
        let mut out: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
        for e in self.evals.values() {
            for (k, names) in &e.exception_stats {
                out.entry(k)
                    .or_default()
                    .extend(names.iter().map(String::as_str));
            }
        }
        out
    }
}

/// Harbor's `Mean` metric over the trials' rewards (a trial without
/// rewards counts 0).
fn mean_metric(rewards: &[Option<&BTreeMap<String, f64>>]) -> BTreeMap<String, f64> {
    let n = rewards.len().max(1) as f64;
    let keys: std::collections::BTreeSet<&String> =
        rewards.iter().flatten().flat_map(|m| m.keys()).collect();
    if keys.len() <= 1 {
        let sum: f64 = rewards
            .iter()
            .map(|r| r.and_then(|m| m.values().next().copied()).unwrap_or(0.0))
            .sum();
        return BTreeMap::from([("mean".to_string(), sum / n)]);
    }
    keys.into_iter()
        .map(|k| {
            let sum: f64 = rewards
                .iter()
                .map(|r| r.and_then(|m| m.get(k).copied()).unwrap_or(0.0))
                .sum();
            (k.clone(), sum / n)
        })
        .collect()
}

/// Plans a job: names every trial, creates `jobs_dir/<job_name>/` and its
/// `config.json`. The job name defaults to the current time.
pub fn plan_job(
    tasks: &[Task],
    agent: AgentSpec,
    n_attempts: u32,
    n_concurrent: usize,
    jobs_dir: &Path,
    job_name: Option<String>,
) -> Result<(PathBuf, JobConfig), TaskError> {
    if n_attempts == 0 || n_concurrent == 0 {
        return Err(TaskError::Invalid(
            "trials (-n) and concurrency (-c) must be at least 1".into(),
        ));
    }
    let job_name = job_name.unwrap_or_else(|| {
        chrono::Local::now()
            .format("%Y-%m-%d__%H-%M-%S")
            .to_string()
    });
    if job_name.is_empty() || job_name.starts_with('.') || job_name.contains(['/', '\0']) {
        return Err(TaskError::Invalid(format!("bad job name {job_name:?}")));
    }
    let dir = jobs_dir.join(&job_name);
    if dir.join("config.json").exists() {
        return Err(TaskError::Invalid(format!(
            "{} already holds a job; resume it with `temper tasks resume {}`",
            dir.display(),
            dir.display()
        )));
    }
    std::fs::create_dir_all(&dir).map_err(|e| TaskError::io("create", dir.clone(), e))?;
    let mut trials = Vec::new();
    for task in tasks {
        for _ in 0..n_attempts {
            trials.push(PlannedTrial {
                trial_name: format!("{}__{}", task.name, random_id(7)),
                task_name: task.name.clone(),
                task_path: task.dir.clone(),
            });
        }
    }
    let mut task_refs: Vec<TaskRef> = Vec::new();
    for task in tasks {
        if !task_refs.iter().any(|t| t.path == task.dir) {
            task_refs.push(TaskRef {
                path: task.dir.clone(),
            });
        }
    }
    let config = JobConfig {
        job_name,
        jobs_dir: jobs_dir.to_path_buf(),
        agent,
        n_attempts,
        n_concurrent,
        agent_timeout_multiplier: None,
        environment: JobEnvironment::default(),
        tasks: task_refs,
        created_at: crate::atif::now(),
        trials,
        legacy_allow_internet: false,
    };
    save_config(&dir, &config)?;
    Ok((dir, config))
}

/// Writes `config.json`.
pub fn save_config(dir: &Path, config: &JobConfig) -> Result<(), TaskError> {
    let path = dir.join("config.json");
    let text = serde_json::to_string_pretty(config).map_err(|source| TaskError::Json {
        path: path.clone(),
        source,
    })?;
    std::fs::write(&path, text).map_err(|e| TaskError::io("write", path, e))
}

/// Reads a job's `config.json` (also as temper wrote it before it wrote
/// Harbor's shape).
pub fn load_job(dir: &Path) -> Result<JobConfig, TaskError> {
    let path = dir.join("config.json");
    let text =
        std::fs::read_to_string(&path).map_err(|e| TaskError::io("read", path.clone(), e))?;
    let mut config: JobConfig =
        serde_json::from_str(&text).map_err(|source| TaskError::Json { path, source })?;
    if std::mem::take(&mut config.legacy_allow_internet) {
        config.environment.kwargs.allow_internet = true;
    }
    Ok(config)
}

/// A trial's finished result, if it has one.
pub fn read_result(trial_dir: &Path) -> Option<TrialResult> {
    let text = std::fs::read_to_string(trial_dir.join("result.json")).ok()?;
    serde_json::from_str(&text).ok()
}

/// Results of every finished trial of the job at `dir`, in plan order.
pub fn job_results(dir: &Path, config: &JobConfig) -> Vec<TrialResult> {
    config
        .trials
        .iter()
        .filter_map(|t| read_result(&dir.join(&t.trial_name)))
        .collect()
}

/// Runs every planned trial of the job at `dir` that has no result yet,
/// `n_concurrent` at a time, calling `progress` after each; writes the
/// job's `result.json` and returns it.
pub fn run_job(
    dir: &Path,
    config: &JobConfig,
    agent: &dyn Agent,
    progress: &(dyn Fn(&TrialResult, usize, usize) + Sync),
) -> Result<JobResult, TaskError> {
    let started_at = crate::atif::now();
    let mut todo = Vec::new();
    let mut resumed = 0;
    for t in &config.trials {
        let tdir = dir.join(&t.trial_name);
        if read_result(&tdir).is_some() {
            resumed += 1;
            continue;
        }
        if tdir.exists() {
            // Killed mid-trial: its partial files are not a result.
            std::fs::remove_dir_all(&tdir).map_err(|e| TaskError::io("remove", tdir.clone(), e))?;
        }
        todo.push(t.clone());
    }
    let mut tasks: BTreeMap<PathBuf, Task> = BTreeMap::new();
    for t in &todo {
        if !tasks.contains_key(&t.task_path) {
            tasks.insert(t.task_path.clone(), Task::load(&t.task_path)?);
        }
    }
    let options = TrialOptions {
        agent_timeout_multiplier: config.agent_timeout_multiplier,
        agent_timeout: None,
        allow_internet: config.environment.kwargs.allow_internet,
    };
    let next = AtomicUsize::new(0);
    let done = AtomicUsize::new(resumed);
    let first_error: Mutex<Option<TaskError>> = Mutex::new(None);
    let total = config.trials.len();
    std::thread::scope(|s| {
        for _ in 0..config.n_concurrent.min(todo.len().max(1)) {
            s.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::SeqCst);
                let Some(t) = todo.get(i) else { break };
                let Some(task) = tasks.get(&t.task_path) else {
                    break;
                };
                match run_trial(task, agent, &dir.join(&t.trial_name), &options) {
                    Ok(r) => {
                        let n = done.fetch_add(1, Ordering::SeqCst) + 1;
                        progress(&r, n, total);
                    }
                    Err(e) => {
                        let mut slot = first_error.lock().unwrap_or_else(PoisonError::into_inner);
                        slot.get_or_insert(e);
                        break;
                    }
                }
            });
        }
    });
    if let Some(e) = first_error
        .into_inner()
        .unwrap_or_else(PoisonError::into_inner)
    {
        return Err(e);
    }
    let results = job_results(dir, config);
    let finished_at = crate::atif::now();
    let job = JobResult {
        id: crate::harbor::uuid_v4(),
        job_name: config.job_name.clone(),
        started_at,
        updated_at: finished_at.clone(),
        finished_at,
        n_total_trials: total,
        stats: JobStats::of(&results, total, resumed),
    };
    let path = dir.join("result.json");
    let text = serde_json::to_string_pretty(&job).map_err(|source| TaskError::Json {
        path: path.clone(),
        source,
    })?;
    std::fs::write(&path, text).map_err(|e| TaskError::io("write", path, e))?;
    Ok(job)
}

/// The per-task summary table of a job's results.
pub fn summary_table(config: &JobConfig, results: &[TrialResult]) -> String {
    #[derive(Default)]
    struct Row {
        planned: usize,
        done: usize,
        reward: f64,
        errors: BTreeMap<String, usize>,
    }
    let mut rows: BTreeMap<&str, Row> = BTreeMap::new();
    for t in &config.trials {
        rows.entry(&t.task_name).or_default().planned += 1;
    }
    for r in results {
        let row = rows.entry(&r.task_name).or_default();
        row.done += 1;
        row.reward += r.reward();
        if let Some(e) = &r.exception_info {
            *row.errors.entry(e.exception_type.clone()).or_default() += 1;
        }
    }
    let width = rows.keys().map(|k| k.len()).max().unwrap_or(4).max(5);
    let mut out = format!(
        "{:<width$}  {:>6}  {:>11}  errors\n",
        "task", "trials", "mean reward"
    );
    let (mut planned, mut done, mut reward, mut errors) = (0, 0, 0.0, 0);
    for (name, row) in &rows {
        let mean = if row.done > 0 {
            row.reward / row.done as f64
        } else {
            0.0
        };
        let errs = row
            .errors
            .iter()
            .map(|(k, n)| format!("{k}×{n}"))
            .collect::<Vec<_>>()
            .join(", ");
        out += &format!(
            "{name:<width$}  {:>6}  {mean:>11.3}  {}\n",
            format!("{}/{}", row.done, row.planned),
            if errs.is_empty() { "-".into() } else { errs }
        );
        planned += row.planned;
        done += row.done;
        reward += row.reward;
        errors += row.errors.values().sum::<usize>();
    }
    let mean = if done > 0 { reward / done as f64 } else { 0.0 };
    out += &format!(
        "{:<width$}  {:>6}  {mean:>11.3}  {errors}\n",
        "total",
        format!("{done}/{planned}")
    );
    out += &format!(
        "agent {}{}",
        config.agent.name,
        config
            .agent
            .model
            .as_ref()
            .map(|m| format!(" (model {m})"))
            .unwrap_or_default()
    );
    out
}

fn html_escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// A self-contained HTML report of a job: the summary, then one row per
/// trial with its reward, exception, timing and links to its files.
pub fn html_report(config: &JobConfig, results: &[TrialResult]) -> String {
    let mut rows = String::new();
    for r in results {
        let rewards = r
            .verifier_result
            .as_ref()
            .and_then(|v| v.rewards.as_ref())
            .map(|m| {
                m.iter()
                    .map(|(k, v)| format!("{k}={v}"))
                    .collect::<Vec<_>>()
                    .join(" ")
            })
            .unwrap_or_else(|| "-".into());
        let err = r
            .exception_info
            .as_ref()
            .map(|e| format!("{}: {}", e.exception_type, e.exception_message))
            .unwrap_or_default();
        let turns = r
            .agent_result
            .as_ref()
            .and_then(|a| a.metadata.as_ref())
            .and_then(|m| m.get("turns"))
            .map(|t| t.to_string())
            .unwrap_or_default();
        let name = html_escape(&r.trial_name);
        rows += &format!(
            "<tr><td>{}</td><td>{name}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td>\
             <td><a href=\"{name}/agent/trajectory.json\">trajectory</a> \
             <a href=\"{name}/verifier/test-stdout.txt\">test output</a> \
             <a href=\"{name}/result.json\">result</a></td></tr>\n",
            html_escape(&r.task_name),
            r.reward(),
            html_escape(&rewards),
            html_escape(&turns),
            html_escape(&err),
        );
    }
    format!(
        "<!doctype html><html><head><meta charset=\"utf-8\"><title>job {name}</title>\
         <style>body{{font-family:sans-serif;margin:2em}}table{{border-collapse:collapse}}\
         td,th{{border:1px solid #ccc;padding:4px 8px;text-align:left}}pre{{background:#f6f6f6;padding:1em}}</style>\
         </head><body><h1>job {name}</h1><pre>{summary}</pre>\
         <table><tr><th>task</th><th>trial</th><th>reward</th><th>rewards</th><th>turns</th>\
         <th>exception</th><th>files</th></tr>\n{rows}</table></body></html>\n",
        name = html_escape(&config.job_name),
        summary = html_escape(&summary_table(config, results)),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn agent_spec_is_written_as_harbors_agent_config_and_read_back() {
        let spec = AgentSpec {
            name: "terminal".into(),
            model: Some("acme/m".into()),
            base_url: Some("http://127.0.0.1:8000/v1".into()),
            command: None,
            max_turns: Some(3),
            max_total_tokens: Some(900),
            max_tokens_per_turn: Some(64),
            temperature: Some(0.5),
            capture: true,
        };
        let v = serde_json::to_value(&spec).expect("json");
        assert_eq!(
            v,
            serde_json::json!({
                "name": "terminal", "model_name": "acme/m", "base_url": "http://127.0.0.1:8000/v1",
                "kwargs": {"max_turns": 3, "max_total_tokens": 900, "max_tokens_per_turn": 64,
                           "temperature": 0.5, "capture": true},
            })
        );
        assert_eq!(serde_json::from_value::<AgentSpec>(v).expect("back"), spec);
    }

    #[test]
    fn jobs_written_before_harbors_shape_still_load() {
        let d = tempfile::tempdir().expect("tempdir");
        std::fs::write(
            d.path().join("config.json"),
            r#"{"job_name": "old", "created_at": "2026-11-25T19:30:00Z",
                "agent": {"name": "terminal", "model": "m", "base_url": "http://h/v1",
                          "command": null, "max_turns": 2, "capture": true},
                "n_attempts": 1, "n_concurrent": 4, "agent_timeout_multiplier": null,
                "allow_internet": true,
                "trials": [{"trial_name": "t__1", "task_name": "t", "task_path": "/tasks/t"}]}"#,
        )
        .expect("write");
        let c = load_job(d.path()).expect("a legacy config loads");
        assert_eq!(
            (
                c.agent.name.as_str(),
                c.agent.model.as_deref(),
                c.agent.max_turns
            ),
            ("terminal", Some("m"), Some(2))
        );
        assert!(c.agent.capture && c.environment.kwargs.allow_internet);
        assert_eq!((c.n_concurrent, c.trials.len()), (4, 1));
        // Saved again, it is Harbor's shape.
        save_config(d.path(), &c).expect("save");
        let v: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(d.path().join("config.json")).unwrap())
                .expect("json");
        assert_eq!(v["agents"][0]["kwargs"]["max_turns"], 2);
        assert_eq!(v["environment"]["kwargs"]["allow_internet"], true);
        assert!(v.get("allow_internet").is_none() && v.get("agent").is_none());
        assert_eq!(load_job(d.path()).expect("reload"), c);
    }

    #[test]
    fn mean_metric_is_harbors() {
        let one = BTreeMap::from([("reward".to_string(), 1.0)]);
        let half = BTreeMap::from([("reward".to_string(), 0.5)]);
        // One key: {"mean": x}; a trial without rewards counts 0.
        assert_eq!(
            mean_metric(&[Some(&one), Some(&half), None, Some(&half)]),
            BTreeMap::from([("mean".to_string(), 0.5)])
        );
        // Several keys: the mean of each, a missing key counting 0.
        let two = BTreeMap::from([("reward".to_string(), 1.0), ("exact".to_string(), 1.0)]);
        assert_eq!(
            mean_metric(&[Some(&two), Some(&half)]),
            BTreeMap::from([("exact".to_string(), 0.5), ("reward".to_string(), 0.75)])
        );
    }
}
