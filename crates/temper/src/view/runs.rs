//! What a runs directory holds, read from the files the trainers, `temper
//! eval` and `temper tasks` write: which directories are runs (by their
//! files), how each stands, and its metrics, samples, evaluations and
//! checkpoints. Every path built from a request goes through
//! [`RunsRoot::resolve`] or [`RunsRoot::file`], which keep it inside the
//! root (symlinks included).

use std::path::{Component, Path, PathBuf};

use serde::Serialize;
use serde_json::{Map, Value};
use temper_rl::runlog::{read_run_info, RunInfo, RunStatus};
use temper_rl::samples::LoggedSample;

/// Why a request for a run could not be answered.
#[derive(Debug, thiserror::Error)]
pub enum ViewError {
    /// The request is malformed (a path that leaves the root, a bad number).
    #[error("{0}")]
    BadRequest(String),
    /// The path resolves outside the runs directory (a symlink).
    #[error("{0}")]
    Forbidden(String),
    /// No such run or file.
    #[error("{0}")]
    NotFound(String),
    /// A file of the run could not be read or parsed.
    #[error("{0}")]
    Io(String),
}

/// The kinds of run directory, told apart by their files.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Kind {
    /// `metrics.jsonl` / `run.json` (`temper train rl|sft`, ...).
    Train,
    /// `metadata.json` + `results.jsonl` (`temper eval`).
    Eval,
    /// `config.json` with trials (`temper tasks run`).
    Job,
}

/// What a directory holds, by its files; `None` when it is not a run.
pub fn kind_of(dir: &Path) -> Option<Kind> {
    if dir.join("metrics.jsonl").is_file() || dir.join("run.json").is_file() {
        Some(Kind::Train)
    } else if dir.join("metadata.json").is_file() && dir.join("results.jsonl").is_file() {
        Some(Kind::Eval)
    } else if dir.join("config.json").is_file() && !dir.join("metadata.json").exists() {
        Some(Kind::Job)
    } else {
        None
    }
}

/// A runs directory (canonical).
#[derive(Debug, Clone)]
pub struct RunsRoot {
    root: PathBuf,
}

/// How deep below the root runs are looked for (`runs/project/name`).
const MAX_DEPTH: usize = 4;

impl RunsRoot {
    /// `dir`, which must exist.
    pub fn open(dir: &Path) -> std::io::Result<Self> {
        Ok(Self {
            root: dir.canonicalize()?,
        })
    }

    /// The root directory.
    pub fn path(&self) -> &Path {
        &self.root
    }

    /// The directory of run `id` (a relative path with `/`, `.` for the
    /// root itself): only plain components, and once symlinks are
    /// resolved still inside the root.
    pub fn resolve(&self, id: &str) -> Result<PathBuf, ViewError> {
        if id == "." {
            return Ok(self.root.clone());
        }
        let rel = Path::new(id);
        if id.is_empty()
            || id.contains('\\')
            || !rel.components().all(|c| matches!(c, Component::Normal(_)))
        {
            return Err(ViewError::BadRequest(format!(
                "run id {id:?}: a relative path inside the runs directory, without `..`"
            )));
        }
        self.inside(&self.root.join(rel), id)
    }

    /// `dir/name` (a fixed file name of a run), if it exists inside the root.
    pub fn file(&self, dir: &Path, name: &str) -> Result<Option<PathBuf>, ViewError> {
        let p = dir.join(name);
        if !p.exists() {
            return Ok(None);
        }
        self.inside(&p, name).map(Some)
    }

    fn inside(&self, p: &Path, shown: &str) -> Result<PathBuf, ViewError> {
        let canon = p
            .canonicalize()
            .map_err(|_| ViewError::NotFound(format!("no run {shown:?}")))?;
        if !canon.starts_with(&self.root) {
            return Err(ViewError::Forbidden(format!(
                "{shown:?} leads outside the runs directory"
            )));
        }
        Ok(canon)
    }

    /// The id of `dir` (inside the root).
    pub fn id_of(&self, dir: &Path) -> String {
        match dir.strip_prefix(&self.root) {
            Ok(rel) if rel.as_os_str().is_empty() => ".".into(),
            Ok(rel) => rel
                .components()
                .map(|c| c.as_os_str().to_string_lossy().into_owned())
                .collect::<Vec<_>>()
                .join("/"),
            Err(_) => dir.display().to_string(),
        }
    }

    /// Every run below the root (the root itself when it is one), sorted
    /// by id. Symlinked and hidden directories are not entered, and a run's
    /// own subdirectories (its evaluations, checkpoints) are not listed as
    /// runs.
    pub fn runs(&self) -> Vec<RunSummary> {
        let mut dirs = Vec::new();
        find_runs(&self.root, 0, &mut dirs);
        let mut out: Vec<RunSummary> = dirs
            .iter()
            .filter_map(|(d, k)| summarize(self, d, *k))
            .collect();
        out.sort_by(|a, b| a.id.cmp(&b.id));
        out
    }
}

fn find_runs(dir: &Path, depth: usize, out: &mut Vec<(PathBuf, Kind)>) {
    if let Some(k) = kind_of(dir) {
        out.push((dir.to_path_buf(), k));
        return;
    }
    if depth >= MAX_DEPTH {
        return;
    }
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    let mut subdirs: Vec<PathBuf> = entries
        .filter_map(|e| e.ok())
        .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
        .filter(|e| !e.file_name().to_string_lossy().starts_with('.'))
        .map(|e| e.path())
        .collect();
    subdirs.sort();
    for d in subdirs {
        find_runs(&d, depth + 1, out);
    }
}

/// How a run stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Status {
    /// Being written.
    Running,
    /// Done.
    Finished,
    /// Ended early on request.
    Stopped,
    /// Ended with an error, or its process is gone without saying how it
    /// ended.
    Failed,
}

impl Status {
    /// Its name.
    pub fn as_str(self) -> &'static str {
        match self {
            Status::Running => "running",
            Status::Finished => "finished",
            Status::Stopped => "stopped",
            Status::Failed => "failed",
        }
    }
}

/// One row of the runs list.
#[derive(Debug, Clone, Serialize)]
pub struct RunSummary {
    /// Path relative to the root (`.` for the root itself).
    pub id: String,
    /// `rl`, `sft` (what `run.json` says), `eval` or `job`.
    pub kind: String,
    /// How it stands.
    pub status: Status,
    /// Why it failed.
    pub error: Option<String>,
    /// The last step recorded (trials done for a job).
    pub step: Option<u64>,
    /// The steps it will run (trials planned for a job).
    pub max_steps: Option<u64>,
    /// The last training reward (`reward/mean`), or an eval's mean reward.
    pub reward: Option<f64>,
    /// The last held-out pass@1, or an eval's pass@1.
    pub heldout: Option<f64>,
    /// The model.
    pub model: String,
    /// The environment(s).
    pub env: String,
    /// Unix seconds when it started.
    pub started: Option<u64>,
    /// Alerts raised so far.
    pub alerts: usize,
}

/// Whether process `pid` is alive on this machine.
fn pid_alive(pid: u32) -> bool {
    let Ok(pid) = libc::pid_t::try_from(pid) else {
        return false;
    };
    // SAFETY: signal 0 only checks that the process exists.
    let r = unsafe { libc::kill(pid, 0) };
    r == 0 || std::io::Error::last_os_error().raw_os_error() == Some(libc::EPERM)
}

/// A training run's status: `run.json`'s, where a `running` run whose
/// process is gone failed (killed); without `run.json` (runs from before
/// it existed), running while `metrics.jsonl` changed in the last minute,
/// else finished at the last step, else stopped.
fn train_status(
    info: Option<&RunInfo>,
    dir: &Path,
    step: Option<u64>,
    max: Option<u64>,
) -> (Status, Option<String>) {
    match info {
        Some(i) => match i.status {
            RunStatus::Running if pid_alive(i.pid) => (Status::Running, None),
            RunStatus::Running => (
                Status::Failed,
                Some(format!(
                    "its process ({}) ended without recording how",
                    i.pid
                )),
            ),
            RunStatus::Finished => (Status::Finished, None),
            RunStatus::Stopped => (Status::Stopped, None),
            RunStatus::Failed => (Status::Failed, i.error.clone()),
        },
        None => {
            let fresh = std::fs::metadata(dir.join("metrics.jsonl"))
                .and_then(|m| m.modified())
                .ok()
                .and_then(|t| t.elapsed().ok())
                .is_some_and(|age| age.as_secs() < 60);
            if fresh && step != max {
                (Status::Running, None)
            } else if step.is_some() && step == max {
                (Status::Finished, None)
            } else {
                (Status::Stopped, None)
            }
        }
    }
}

/// Read a JSON-lines file's objects; a torn last line (a run being
/// written) is skipped.
pub fn read_records(path: &Path) -> Result<Vec<Map<String, Value>>, ViewError> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| ViewError::Io(format!("read {}: {e}", path.display())))?;
    Ok(text
        .lines()
        .filter_map(|l| match serde_json::from_str::<Value>(l) {
            Ok(Value::Object(m)) => Some(m),
            _ => None,
        })
        .collect())
}

/// A run's `metrics.jsonl` records (none before the first step).
pub fn metrics(root: &RunsRoot, dir: &Path) -> Result<Vec<Map<String, Value>>, ViewError> {
    match root.file(dir, "metrics.jsonl")? {
        Some(p) => read_records(&p),
        None => Ok(Vec::new()),
    }
}

/// The samples of `step` from a run's `samples.jsonl`.
pub fn samples(root: &RunsRoot, dir: &Path, step: u64) -> Result<Vec<LoggedSample>, ViewError> {
    let Some(p) = root.file(dir, "samples.jsonl")? else {
        return Ok(Vec::new());
    };
    let text = std::fs::read_to_string(&p)
        .map_err(|e| ViewError::Io(format!("read {}: {e}", p.display())))?;
    Ok(text
        .lines()
        .filter_map(|l| serde_json::from_str::<LoggedSample>(l).ok())
        .filter(|s| s.step == step)
        .collect())
}

/// The run's resolved config (`config.toml`) as TOML text and parsed.
pub fn config(root: &RunsRoot, dir: &Path) -> Result<Option<(String, toml::Table)>, ViewError> {
    let Some(p) = root.file(dir, "config.toml")? else {
        return Ok(None);
    };
    let text = std::fs::read_to_string(&p)
        .map_err(|e| ViewError::Io(format!("read {}: {e}", p.display())))?;
    let table = text.parse::<toml::Table>().unwrap_or_default();
    Ok(Some((text, table)))
}

/// The run's `run.json`.
pub fn run_info(root: &RunsRoot, dir: &Path) -> Result<Option<RunInfo>, ViewError> {
    if root.file(dir, "run.json")?.is_none() {
        return Ok(None);
    }
    read_run_info(dir).map_err(|e| ViewError::Io(e.to_string()))
}

fn last_f64(records: &[Map<String, Value>], key: &str) -> Option<f64> {
    records
        .iter()
        .rev()
        .find_map(|r| r.get(key).and_then(Value::as_f64))
}

fn str_at<'a>(t: &'a toml::Table, path: &[&str]) -> Option<&'a toml::Value> {
    let (last, head) = path.split_last()?;
    let mut cur = t;
    for k in head {
        cur = cur.get(*k)?.as_table()?;
    }
    cur.get(*last)
}

/// The model a config trains: `[model] path` or its preset.
pub fn config_model(t: &toml::Table) -> String {
    str_at(t, &["model", "path"])
        .and_then(toml::Value::as_str)
        .map(|p| {
            Path::new(p)
                .file_name()
                .map_or(p.to_string(), |n| n.to_string_lossy().into_owned())
        })
        .or_else(|| {
            str_at(t, &["model", "preset"])
                .and_then(toml::Value::as_str)
                .map(|p| format!("preset {p}"))
        })
        .unwrap_or_default()
}

/// The environments of a config (`[[env]] id`s), or SFT's data.
pub fn config_env(t: &toml::Table) -> String {
    if let Some(envs) = t.get("env").and_then(toml::Value::as_array) {
        return envs
            .iter()
            .filter_map(|e| e.get("id").and_then(toml::Value::as_str))
            .collect::<Vec<_>>()
            .join(", ");
    }
    // SFT: `[data] path`, or an environment's rows (`[data.env] id`).
    str_at(t, &["data", "path"])
        .or_else(|| str_at(t, &["data", "env", "id"]))
        .and_then(toml::Value::as_str)
        .unwrap_or_default()
        .to_string()
}

fn summarize(root: &RunsRoot, dir: &Path, kind: Kind) -> Option<RunSummary> {
    let id = root.id_of(dir);
    let started_of = |p: &Path| {
        std::fs::metadata(p)
            .and_then(|m| m.modified())
            .ok()
            .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
            .map(|d| d.as_secs())
    };
    match kind {
        Kind::Train => {
            let records = metrics(root, dir).unwrap_or_default();
            let info = run_info(root, dir).ok().flatten();
            let cfg = config(root, dir)
                .ok()
                .flatten()
                .map(|(_, t)| t)
                .unwrap_or_default();
            let step = records
                .iter()
                .rev()
                .find_map(|r| r.get("step").and_then(Value::as_u64));
            let max_steps = str_at(&cfg, &["trainer", "max_steps"])
                .and_then(toml::Value::as_integer)
                .and_then(|n| u64::try_from(n).ok());
            let (status, error) = train_status(info.as_ref(), dir, step, max_steps);
            let kind = info.as_ref().map(|i| i.kind.clone()).unwrap_or_else(|| {
                if cfg.contains_key("env") || cfg.contains_key("sampling") {
                    "rl".into()
                } else {
                    "sft".into()
                }
            });
            Some(RunSummary {
                id,
                kind,
                status,
                error,
                step,
                max_steps,
                reward: last_f64(&records, "reward/mean"),
                heldout: last_f64(&records, "eval/pass@1"),
                model: config_model(&cfg),
                env: config_env(&cfg),
                started: info
                    .as_ref()
                    .map(|i| i.started)
                    .or_else(|| started_of(&dir.join("config.toml"))),
                alerts: records
                    .iter()
                    .filter_map(|r| r.get("alerts").and_then(Value::as_array))
                    .map(Vec::len)
                    .sum(),
            })
        }
        Kind::Eval => {
            let meta = temper_eval::results::read_metadata(dir).ok()?;
            Some(RunSummary {
                id,
                kind: "eval".into(),
                status: if meta.status == "running" {
                    Status::Running
                } else {
                    Status::Finished
                },
                error: None,
                step: Some(meta.num_rollouts as u64),
                max_steps: Some((meta.num_examples * meta.rollouts_per_example) as u64),
                reward: Some(meta.avg_reward),
                heldout: meta.pass_at_k.get("1").copied(),
                model: meta.model.clone(),
                env: meta.env_id.clone(),
                started: chrono::DateTime::parse_from_rfc3339(&meta.date)
                    .ok()
                    .and_then(|d| u64::try_from(d.timestamp()).ok()),
                alerts: 0,
            })
        }
        Kind::Job => {
            let cfg = temper_tasks::load_job(dir).ok()?;
            let results = temper_tasks::job::job_results(dir, &cfg);
            let done = results.len() as u64;
            let planned = cfg.trials.len() as u64;
            Some(RunSummary {
                id,
                kind: "job".into(),
                status: if done < planned {
                    Status::Running
                } else {
                    Status::Finished
                },
                error: None,
                step: Some(done),
                max_steps: Some(planned),
                reward: None,
                heldout: None,
                model: cfg
                    .agent
                    .model
                    .clone()
                    .unwrap_or_else(|| cfg.agent.name.clone()),
                env: format!("{} task(s)", cfg.tasks.len()),
                started: chrono::DateTime::parse_from_rfc3339(&cfg.created_at)
                    .ok()
                    .and_then(|d| u64::try_from(d.timestamp()).ok())
                    .or_else(|| started_of(&dir.join("config.json"))),
                alerts: 0,
            })
        }
    }
}

/// One held-out evaluation of a training run (`evals/step-N`).
#[derive(Debug, Clone, Serialize)]
pub struct EvalEntry {
    /// Its run id (for `/report`).
    pub id: String,
    /// The step it evaluated.
    pub step: u64,
    /// pass@1.
    pub pass_at_1: Option<f64>,
    /// Mean reward.
    pub reward: f64,
    /// Rollouts.
    pub rollouts: usize,
}

/// The held-out evaluations of a training run, by step.
pub fn evals(root: &RunsRoot, dir: &Path) -> Vec<EvalEntry> {
    let Ok(Some(evals)) = root.file(dir, "evals") else {
        return Vec::new();
    };
    let Ok(entries) = std::fs::read_dir(&evals) else {
        return Vec::new();
    };
    let mut out: Vec<EvalEntry> = entries
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            let step = name.strip_prefix("step-")?.parse::<u64>().ok()?;
            let d = root.file(&evals, &name).ok()??;
            let meta = temper_eval::results::read_metadata(&d).ok()?;
            Some(EvalEntry {
                id: root.id_of(&d),
                step,
                pass_at_1: meta.pass_at_k.get("1").copied(),
                reward: meta.avg_reward,
                rollouts: meta.num_rollouts,
            })
        })
        .collect();
    out.sort_by_key(|e| e.step);
    out
}

/// A checkpoint or exported weights of a run, and how to use them.
#[derive(Debug, Clone, Serialize)]
pub struct Checkpoint {
    /// What it is.
    pub what: String,
    /// Its path (as the trainer wrote it).
    pub path: String,
    /// Commands that serve, export or resume it.
    pub commands: Vec<String>,
}

/// Quote `s` for a POSIX shell when it needs it.
pub fn sh_quote(s: &str) -> String {
    if !s.is_empty()
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_./=:@%+,".contains(c))
    {
        s.to_string()
    } else {
        format!("'{}'", s.replace('\'', "'\\''"))
    }
}

/// The checkpoints of a training run: the latest resumable state, the
/// exported adapter or model; each with the commands that use it.
pub fn checkpoints(
    root: &RunsRoot,
    dir: &Path,
    kind: &str,
    model_path: Option<&str>,
) -> Vec<Checkpoint> {
    // Distillation is `temper train rl` with a teacher.
    let trainer = match kind {
        "sft" | "dpo" => kind,
        _ => "rl",
    };
    let run = sh_quote(&dir.display().to_string());
    let base = model_path
        .map(sh_quote)
        .unwrap_or_else(|| "BASE_MODEL".into());
    let mut out = Vec::new();
    if let Ok(Some(latest)) = root.file(dir, "checkpoints/latest.json") {
        if let Ok(v) = std::fs::read_to_string(&latest)
            .map_err(|e| e.to_string())
            .and_then(|t| serde_json::from_str::<Value>(&t).map_err(|e| e.to_string()))
        {
            let step = v.get("step").and_then(Value::as_u64).unwrap_or(0);
            let state = v.get("state_path").and_then(Value::as_str).unwrap_or("");
            out.push(Checkpoint {
                what: format!("trainer state after step {step}"),
                path: state.to_string(),
                commands: vec![
                    format!("temper train {trainer} --resume {run}   # continue from step {step}"),
                    format!(
                        "temper export {} --format peft --out {}",
                        sh_quote(state),
                        sh_quote(&format!("{}/export-step-{step}", dir.display()))
                    ),
                ],
            });
        }
    }
    if let Ok(Some(adapter)) = root.file(dir, "adapter") {
        let a = sh_quote(&adapter.display().to_string());
        out.push(Checkpoint {
            what: "the trained LoRA adapter (PEFT)".into(),
            path: adapter.display().to_string(),
            commands: vec![
                format!("temper serve --model {base} --lora trained={a}"),
                format!("temper export {run} --format gguf --quant q8_0 --out model.gguf"),
            ],
        });
    }
    if let Ok(Some(model)) = root.file(dir, "model") {
        let m = sh_quote(&model.display().to_string());
        out.push(Checkpoint {
            what: "the trained model (Hugging Face directory)".into(),
            path: model.display().to_string(),
            commands: vec![
                format!("temper serve --model {m}"),
                format!("temper export {m} --format gguf --quant q8_0 --out model.gguf"),
            ],
        });
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn root_with_runs() -> (tempfile::TempDir, RunsRoot) {
        let dir = tempfile::tempdir().unwrap();
        let run = dir.path().join("proj/rl-a");
        std::fs::create_dir_all(run.join("evals/step-000000")).unwrap();
        std::fs::write(
            run.join("metrics.jsonl"),
            "{\"step\":1,\"reward/mean\":0.5}\n{\"step\":2,\"rew",
        )
        .unwrap();
        std::fs::write(run.join("config.toml"), "[model]\npath = \"/m/SmolLM2.gguf\"\n[trainer]\nmax_steps = 2\n[[env]]\nid = \"arith\"\n").unwrap();
        std::fs::create_dir_all(dir.path().join(".hidden/x")).unwrap();
        std::fs::write(dir.path().join(".hidden/x/metrics.jsonl"), "").unwrap();
        let root = RunsRoot::open(dir.path()).unwrap();
        (dir, root)
    }

    #[test]
    fn runs_are_found_by_their_files_and_summarized() {
        let (_d, root) = root_with_runs();
        let runs = root.runs();
        assert_eq!(runs.len(), 1, "{runs:?}");
        let r = &runs[0];
        assert_eq!((r.id.as_str(), r.kind.as_str()), ("proj/rl-a", "rl"));
        assert_eq!(
            (r.step, r.max_steps, r.reward),
            (Some(1), Some(2), Some(0.5))
        );
        assert_eq!(
            (r.model.as_str(), r.env.as_str()),
            ("SmolLM2.gguf", "arith")
        );
        // No run.json, metrics just written, step 1 of 2: running.
        assert_eq!(r.status, Status::Running);
    }

    #[test]
    fn a_run_json_of_a_dead_process_reads_as_failed() {
        let (d, root) = root_with_runs();
        let info = RunInfo {
            kind: "rl".into(),
            command: vec!["temper".into()],
            cwd: "/".into(),
            // No process has this id (above Linux's pid_max).
            pid: 999_999_999,
            started: 1,
            status: RunStatus::Running,
            ended: None,
            error: None,
        };
        std::fs::write(
            d.path().join("proj/rl-a/run.json"),
            serde_json::to_string(&info).unwrap(),
        )
        .unwrap();
        let r = &root.runs()[0];
        assert_eq!(r.status, Status::Failed);
        assert!(
            r.error.as_deref().unwrap_or("").contains("ended without"),
            "{r:?}"
        );
        let alive = RunInfo {
            pid: std::process::id(),
            ..info
        };
        std::fs::write(
            d.path().join("proj/rl-a/run.json"),
            serde_json::to_string(&alive).unwrap(),
        )
        .unwrap();
        assert_eq!(root.runs()[0].status, Status::Running);
    }

    #[test]
    fn ids_stay_inside_the_root() {
        let (d, root) = root_with_runs();
        assert!(root.resolve("proj/rl-a").is_ok());
        assert!(root.resolve(".").is_ok());
        for bad in ["../x", "proj/../../etc", "/etc", "", "./proj", "a\\b"] {
            assert!(
                matches!(root.resolve(bad), Err(ViewError::BadRequest(_))),
                "{bad}"
            );
        }
        assert!(matches!(root.resolve("nope"), Err(ViewError::NotFound(_))));
        // A symlink out of the root is refused, as is a run's file linked out.
        let outside = tempfile::tempdir().unwrap();
        std::fs::write(outside.path().join("metrics.jsonl"), "{\"step\":1}\n").unwrap();
        std::os::unix::fs::symlink(outside.path(), d.path().join("escape")).unwrap();
        assert!(matches!(
            root.resolve("escape"),
            Err(ViewError::Forbidden(_))
        ));
        let run = root.resolve("proj/rl-a").unwrap();
        std::os::unix::fs::symlink(
            outside.path().join("metrics.jsonl"),
            run.join("samples.jsonl"),
        )
        .unwrap();
        assert!(matches!(
            samples(&root, &run, 1),
            Err(ViewError::Forbidden(_))
        ));
        // Symlinked directories are not listed as runs.
        assert_eq!(root.runs().len(), 1);
    }
}
