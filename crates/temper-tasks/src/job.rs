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
//! Trials are planned (and named) before any runs, so a job killed midway
//! is resumed by running exactly the planned trials that have no
//! `result.json`; a half-written trial directory is discarded and rerun.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

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
/// The API key is never stored.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
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

/// A job's `config.json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct JobConfig {
    /// The directory name.
    pub job_name: String,
    /// ISO 8601.
    pub created_at: String,
    /// The agent.
    pub agent: AgentSpec,
    /// Trials per task.
    pub n_attempts: u32,
    /// Trials run at once.
    pub n_concurrent: usize,
    /// Multiplies every task's `[agent] timeout_sec`.
    #[serde(default)]
    pub agent_timeout_multiplier: Option<f64>,
    /// Tasks with `allow_internet = true` share the host's network.
    #[serde(default)]
    pub allow_internet: bool,
    /// Every trial, in order.
    pub trials: Vec<PlannedTrial>,
}

/// A job's `result.json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct JobResult {
    /// Unique id.
    pub id: String,
    /// The directory name.
    pub job_name: String,
    /// When this run (or resume) of the job started.
    pub started_at: String,
    /// When it ended.
    pub finished_at: String,
    /// Planned trials.
    pub n_total_trials: usize,
    /// Totals.
    pub stats: JobStats,
}

/// Totals of a job.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct JobStats {
    /// Trials with a result.
    pub n_trials: usize,
    /// Trials with an exception.
    pub n_errors: usize,
    /// Mean of `reward` over trials with a result (0 for those without).
    pub mean_reward: f64,
    /// Exception type → trial names.
    pub exception_stats: BTreeMap<String, Vec<String>>,
    /// Trials resumed from an earlier run (not run again).
    pub n_resumed: usize,
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
    let config = JobConfig {
        job_name,
        created_at: crate::atif::now(),
        agent,
        n_attempts,
        n_concurrent,
        agent_timeout_multiplier: None,
        allow_internet: false,
        trials,
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

/// Reads a job's `config.json`.
pub fn load_job(dir: &Path) -> Result<JobConfig, TaskError> {
    let path = dir.join("config.json");
    let text =
        std::fs::read_to_string(&path).map_err(|e| TaskError::io("read", path.clone(), e))?;
    serde_json::from_str(&text).map_err(|source| TaskError::Json { path, source })
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
        allow_internet: config.allow_internet,
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
                        let mut slot = first_error.lock().unwrap_or_else(|p| p.into_inner());
                        slot.get_or_insert(e);
                        break;
                    }
                }
            });
        }
    });
    if let Some(e) = first_error.into_inner().unwrap_or_else(|p| p.into_inner()) {
        return Err(e);
    }
    let results = job_results(dir, config);
    let mut stats = JobStats {
        n_trials: results.len(),
        n_resumed: resumed,
        ..JobStats::default()
    };
    for r in &results {
        if let Some(e) = &r.exception_info {
            stats.n_errors += 1;
            stats
                .exception_stats
                .entry(e.exception_type.clone())
                .or_default()
                .push(r.trial_name.clone());
        }
    }
    if !results.is_empty() {
        stats.mean_reward =
            results.iter().map(TrialResult::reward).sum::<f64>() / results.len() as f64;
    }
    let job = JobResult {
        id: random_id(32),
        job_name: config.job_name.clone(),
        started_at,
        finished_at: crate::atif::now(),
        n_total_trials: total,
        stats,
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
