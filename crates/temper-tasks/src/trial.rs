//! One trial: sandbox session → environment setup → agent → verifier →
//! `result.json`, in Harbor's trial directory layout:
//!
//! ```text
//! <task>__<id>/
//!   config.json          what was run
//!   result.json          TrialResult (written last, atomically: its presence
//!                        marks the trial finished, which resume relies on)
//!   exception.txt        why the trial did not finish normally, if it did not
//!   agent/trajectory.json  ATIF
//!   agent/...            the agent's logs; agent/logs/ = the sandbox's /logs/agent
//!   verifier/reward.txt|reward.json, test-stdout.txt, test-stderr.txt
//! ```

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use temper_sandbox::ExecStatus;

use crate::agent::{Agent, AgentContext, AgentFailure};
use crate::atif::now;
use crate::dockerfile::{self, SetupStep};
use crate::task::Task;
use crate::trial_env::{EnvSpec, TrialEnv};
use crate::TaskError;

/// Start and end of a phase.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct TimingInfo {
    /// ISO 8601.
    pub started_at: Option<String>,
    /// ISO 8601.
    pub finished_at: Option<String>,
}

/// Harbor's `exception_info`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ExceptionInfo {
    /// `AgentTimeoutError`, `VerifierTimeoutError`, `RewardFileNotFoundError`, ...
    pub exception_type: String,
    /// Details.
    pub exception_message: String,
    /// Always empty here (no Python traceback); kept for the shape.
    pub exception_traceback: String,
    /// ISO 8601.
    pub occurred_at: String,
}

/// Harbor's `agent_info.model_info`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelInfo {
    /// Model name.
    pub name: String,
    /// Provider, when known.
    pub provider: Option<String>,
}

/// Harbor's `agent_info`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AgentInfo {
    /// Agent name.
    pub name: String,
    /// Agent version.
    pub version: String,
    /// The model, for model-backed agents.
    pub model_info: Option<ModelInfo>,
}

/// Harbor's `agent_result`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct AgentResult {
    /// Prompt tokens.
    pub n_input_tokens: Option<u64>,
    /// Cached prompt tokens (never known here).
    pub n_cache_tokens: Option<u64>,
    /// Completion tokens.
    pub n_output_tokens: Option<u64>,
    /// Cost (never known here: local models).
    pub cost_usd: Option<f64>,
    /// Agent-specific facts.
    pub metadata: Option<Map<String, Value>>,
}

/// Harbor's `verifier_result`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct VerifierResult {
    /// `reward.txt` as `{"reward": x}`, or `reward.json` as written.
    pub rewards: Option<BTreeMap<String, f64>>,
}

/// What temper adds to Harbor's result (Harbor's model allows extras).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct TemperInfo {
    /// Dockerfile instructions not honoured, and other caveats.
    pub notes: Vec<String>,
    /// Milliseconds from the sandbox session being ready to the verifier's
    /// end (the runtime's overhead on a trivial task).
    pub session_to_verified_ms: Option<f64>,
    /// Milliseconds to start the sandbox session.
    pub session_start_ms: Option<f64>,
}

/// `result.json` of a trial: Harbor's `TrialResult` (it validates with
/// Harbor's model; `temper` is an extra field, which Harbor ignores).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TrialResult {
    /// Unique id (a UUID).
    pub id: String,
    /// Task name.
    pub task_name: String,
    /// Trial name (`<task>__<id>`).
    pub trial_name: String,
    /// `file://` URI of the trial directory.
    pub trial_uri: String,
    /// Where the task came from (Harbor's `LocalTaskId`).
    pub task_id: Value,
    /// Harbor's checksum of the task directory ([`crate::harbor::task_checksum`];
    /// empty in results written before temper recorded it).
    #[serde(default)]
    pub task_checksum: String,
    /// What was run: Harbor's `TrialConfig` (see [`trial_config`]).
    pub config: Value,
    /// Who ran.
    pub agent_info: AgentInfo,
    /// What the agent spent.
    pub agent_result: Option<AgentResult>,
    /// The rewards.
    pub verifier_result: Option<VerifierResult>,
    /// Why the trial did not finish normally.
    pub exception_info: Option<ExceptionInfo>,
    /// Start.
    pub started_at: String,
    /// End.
    pub finished_at: Option<String>,
    /// Session start and Dockerfile steps.
    pub environment_setup: Option<TimingInfo>,
    /// Agent installation (nothing to install for built-in agents).
    pub agent_setup: Option<TimingInfo>,
    /// The agent's work.
    pub agent_execution: Option<TimingInfo>,
    /// The verifier.
    pub verifier: Option<TimingInfo>,
    /// temper's additions.
    #[serde(default)]
    pub temper: TemperInfo,
}

impl TrialResult {
    /// The `reward` entry (0 when the trial has none).
    pub fn reward(&self) -> f64 {
        self.verifier_result
            .as_ref()
            .and_then(|v| v.rewards.as_ref())
            .and_then(|r| r.get("reward").copied())
            .unwrap_or(0.0)
    }
}

/// Knobs of a trial beyond the task's own.
#[derive(Debug, Clone, Default)]
pub struct TrialOptions {
    /// Multiplies `[agent] timeout_sec` (1 when `None`).
    pub agent_timeout_multiplier: Option<f64>,
    /// Replaces `[agent] timeout_sec`.
    pub agent_timeout: Option<Duration>,
    /// Give tasks with `allow_internet = true` the host's network (off:
    /// every trial has loopback only).
    pub allow_internet: bool,
}

fn exception(kind: &str, message: impl Into<String>) -> ExceptionInfo {
    ExceptionInfo {
        exception_type: kind.into(),
        exception_message: message.into(),
        exception_traceback: String::new(),
        occurred_at: now(),
    }
}

/// Parses the verifier's reward files from the host copy of
/// `/logs/verifier`: `reward.txt` (one number) wins over `reward.json` (a
/// flat object of numbers).
pub fn read_rewards(dir: &Path) -> Result<BTreeMap<String, f64>, ExceptionInfo> {
    let txt = dir.join("reward.txt");
    let json = dir.join("reward.json");
    if let Ok(text) = std::fs::read_to_string(&txt) {
        let v: f64 = text.trim().parse().map_err(|_| {
            exception(
                "RewardFileEmptyError",
                format!(
                    "reward.txt holds {:?}, not a number",
                    text.chars().take(80).collect::<String>()
                ),
            )
        })?;
        if !v.is_finite() {
            return Err(exception(
                "RewardFileEmptyError",
                "reward.txt is not finite",
            ));
        }
        return Ok(BTreeMap::from([("reward".to_string(), v)]));
    }
    if let Ok(text) = std::fs::read_to_string(&json) {
        let bad = |why: String| exception("RewardFileEmptyError", format!("reward.json: {why}"));
        let v: Map<String, Value> = serde_json::from_str(&text).map_err(|e| bad(e.to_string()))?;
        let mut out = BTreeMap::new();
        for (k, v) in v {
            let n = v
                .as_f64()
                .filter(|n| n.is_finite())
                .ok_or_else(|| bad(format!("{k} is not a number")))?;
            out.insert(k, n);
        }
        return Ok(out);
    }
    Err(exception(
        "RewardFileNotFoundError",
        "the verifier wrote neither /logs/verifier/reward.txt nor reward.json",
    ))
}

fn write_json(path: &Path, v: &impl Serialize) -> Result<(), TaskError> {
    let text = serde_json::to_string_pretty(v).map_err(|source| TaskError::Json {
        path: path.to_path_buf(),
        source,
    })?;
    // Write then rename: a reader (resume) never sees half a file.
    let tmp = path.with_extension("json.tmp");
    std::fs::write(&tmp, text).map_err(|e| TaskError::io("write", tmp.clone(), e))?;
    std::fs::rename(&tmp, path).map_err(|e| TaskError::io("rename", path.to_path_buf(), e))
}

/// Runs one trial of `task` with `agent` in `trial_dir` (created; must not
/// hold a result yet) and writes its `result.json`. Only host I/O errors
/// are `Err`: everything that happens in the sandbox is in the result.
pub fn run_trial(
    task: &Task,
    agent: &dyn Agent,
    trial_dir: &Path,
    options: &TrialOptions,
) -> Result<TrialResult, TaskError> {
    let trial_name = trial_dir
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let agent_dir = trial_dir.join("agent");
    let verifier_dir = trial_dir.join("verifier");
    for d in [&agent_dir, &verifier_dir] {
        std::fs::create_dir_all(d).map_err(|e| TaskError::io("create", d.clone(), e))?;
    }
    let cfg = &task.config;
    let agent_timeout = options.agent_timeout.unwrap_or_else(|| {
        Duration::from_secs_f64(
            cfg.agent.timeout_sec * options.agent_timeout_multiplier.unwrap_or(1.0),
        )
    });
    let verifier_timeout = Duration::from_secs_f64(cfg.verifier.timeout_sec);
    let config = trial_config(task, agent, trial_dir, options);
    write_json(&trial_dir.join("config.json"), &config)?;
    let mut result = TrialResult {
        id: crate::harbor::uuid_v4(),
        task_name: task.name.clone(),
        trial_name: trial_name.clone(),
        trial_uri: format!("file://{}", trial_dir.display()),
        task_id: serde_json::json!({ "path": task.dir }),
        task_checksum: crate::harbor::task_checksum(&task.dir)?,
        config,
        agent_info: AgentInfo {
            name: agent.name().into(),
            version: agent.version().into(),
            model_info: agent.model_name().map(|name| ModelInfo {
                name,
                provider: None,
            }),
        },
        agent_result: None,
        verifier_result: None,
        exception_info: None,
        started_at: now(),
        finished_at: None,
        environment_setup: None,
        agent_setup: None,
        agent_execution: None,
        verifier: None,
        temper: TemperInfo::default(),
    };
    run_phases(
        task,
        agent,
        trial_dir,
        (agent_timeout, verifier_timeout),
        options.allow_internet,
        &mut result,
    );
    result.finished_at = Some(now());
    if let Some(e) = &result.exception_info {
        // Harbor's trial layout: the exception, as text, beside the result.
        let path = trial_dir.join("exception.txt");
        std::fs::write(
            &path,
            format!("{}: {}\n", e.exception_type, e.exception_message),
        )
        .map_err(|e| TaskError::io("write", path, e))?;
    }
    write_json(&trial_dir.join("result.json"), &result)?;
    Ok(result)
}

/// A trial's `config.json`: Harbor's `TrialConfig`. The task by `path`
/// only (Harbor refuses `path` with `name`), the agent as Harbor's
/// `AgentConfig` (its settings in `kwargs`), timeouts as Harbor's
/// overrides of the task's, and the sandbox by `import_path` with the
/// limits it was given in `kwargs`.
pub fn trial_config(
    task: &Task,
    agent: &dyn Agent,
    trial_dir: &Path,
    options: &TrialOptions,
) -> Value {
    let trial_name = trial_dir
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let env = &task.config.environment;
    let mut agent_config = serde_json::json!({
        "name": agent.name(), "kwargs": agent.settings(),
    });
    if let Some(m) = agent.model_name() {
        agent_config["model_name"] = m.into();
    }
    if let Some(t) = options.agent_timeout {
        agent_config["override_timeout_sec"] = t.as_secs_f64().into();
    }
    let mut config = serde_json::json!({
        "task": { "path": task.dir },
        "trial_name": trial_name,
        "agent": agent_config,
        "environment": crate::harbor::environment_config(serde_json::json!({
            "host_network": env.allow_internet && options.allow_internet,
            "memory_mb": env.memory_mb,
            "storage_mb": env.storage_mb.min(MAX_STORAGE_MB),
            "cpus": env.cpus,
        })),
    });
    if let Some(parent) = trial_dir.parent() {
        config["trials_dir"] = serde_json::json!(parent);
    }
    if let Some(m) = options.agent_timeout_multiplier {
        config["agent_timeout_multiplier"] = m.into();
    }
    config
}

/// The largest `storage_mb` a trial's writable directories get.
const MAX_STORAGE_MB: u64 = 4096;

/// The phases; each failure is recorded in `result` and ends the trial.
fn run_phases(
    task: &Task,
    agent: &dyn Agent,
    trial_dir: &Path,
    (agent_timeout, verifier_timeout): (Duration, Duration),
    allow_internet: bool,
    result: &mut TrialResult,
) {
    let agent_dir = trial_dir.join("agent");
    let verifier_dir = trial_dir.join("verifier");
    // Environment.
    let mut setup = TimingInfo {
        started_at: Some(now()),
        finished_at: None,
    };
    let env = match start_env(
        task,
        agent_timeout,
        verifier_timeout,
        allow_internet,
        result,
    ) {
        Ok(env) => env,
        Err(e) => {
            setup.finished_at = Some(now());
            result.environment_setup = Some(setup);
            result.exception_info = Some(e);
            return;
        }
    };
    setup.finished_at = Some(now());
    result.environment_setup = Some(setup);
    let ready = Instant::now();
    result.agent_setup = Some(TimingInfo {
        started_at: Some(now()),
        finished_at: Some(now()),
    });

    // Agent.
    let mut exec = TimingInfo {
        started_at: Some(now()),
        finished_at: None,
    };
    let ctx = AgentContext {
        env: &env,
        task,
        trial_name: &result.trial_name,
        deadline: Instant::now() + agent_timeout,
        logs_dir: &agent_dir,
    };
    let outcome = agent.run(&ctx);
    exec.finished_at = Some(now());
    result.agent_execution = Some(exec);
    let traj_path = agent_dir.join("trajectory.json");
    if let Err(e) = write_json(&traj_path, &outcome.trajectory) {
        tracing::warn!("{e}");
    }
    result.agent_result = Some(AgentResult {
        n_input_tokens: outcome.n_input_tokens,
        n_cache_tokens: None,
        n_output_tokens: outcome.n_output_tokens,
        cost_usd: None,
        metadata: (!outcome.metadata.is_empty()).then_some(outcome.metadata),
    });
    let env_alive = outcome.failure.as_ref().is_none_or(|f| f.env_alive);
    if let Some(AgentFailure { kind, message, .. }) = outcome.failure {
        result.exception_info = Some(exception(&kind, message));
    }
    if !env_alive {
        // The session is gone (memory limit, sandbox failure): no verifier.
        return;
    }
    // Into a subdirectory: what runs in the sandbox must not overwrite the
    // trajectory and logs written here.
    if let Err(e) = env.fetch_dir("/logs/agent", &agent_dir.join("logs")) {
        result
            .temper
            .notes
            .push(format!("could not copy /logs/agent: {e}"));
    }

    // Verifier: the tests arrive only now, so the agent never saw them.
    let mut ver = TimingInfo {
        started_at: Some(now()),
        finished_at: None,
    };
    let verified = verify(task, &env, &verifier_dir, verifier_timeout);
    ver.finished_at = Some(now());
    result.verifier = Some(ver);
    result.temper.session_to_verified_ms = Some(ready.elapsed().as_secs_f64() * 1e3);
    match verified {
        Ok(rewards) => {
            result.verifier_result = Some(VerifierResult {
                rewards: Some(rewards),
            })
        }
        Err(e) => {
            // An agent failure stays the trial's exception; the verifier's
            // goes to the notes then.
            if result.exception_info.is_none() {
                result.exception_info = Some(e);
            } else {
                result.temper.notes.push(format!(
                    "verifier: {}: {}",
                    e.exception_type, e.exception_message
                ));
            }
        }
    }
    drop(env);
}

fn start_env(
    task: &Task,
    agent_timeout: Duration,
    verifier_timeout: Duration,
    allow_internet: bool,
    result: &mut TrialResult,
) -> Result<TrialEnv, ExceptionInfo> {
    let cfg = &task.config;
    let setup_err = |e: &dyn std::fmt::Display| exception("EnvironmentSetupError", e.to_string());
    if cfg.environment.gpus > 0 {
        return Err(exception(
            "EnvironmentSetupError",
            "the task asks for GPUs; the sandbox runtime gives none",
        ));
    }
    if let Some(image) = &cfg.environment.docker_image {
        result.temper.notes.push(format!(
            "docker_image {image} ignored: the sandbox runs on the host's system directories"
        ));
    }
    let host_network = cfg.environment.allow_internet && allow_internet;
    if host_network {
        result
            .temper
            .notes
            .push("allow_internet = true: the trial shares the host's network".into());
    } else if cfg.environment.allow_internet {
        result.temper.notes.push(
            "allow_internet = true not honoured: loopback only (run with --allow-internet to \
             share the host's network)"
                .into(),
        );
    }
    let plan = dockerfile::plan(&task.dir).map_err(|e| setup_err(&e))?;
    for i in &plan.ignored {
        result.temper.notes.push(format!("Dockerfile: ignored {i}"));
    }
    let mut writable: Vec<PathBuf> = plan.writable.iter().cloned().collect();
    for d in ["/logs", "/tests", "/solution"] {
        if !writable.iter().any(|w| w == Path::new(d)) {
            writable.push(PathBuf::from(d));
        }
    }
    let mut env: BTreeMap<String, String> = plan.env.iter().cloned().collect();
    env.extend(cfg.environment.env.clone());
    let total = agent_timeout
        + verifier_timeout
        + Duration::from_secs_f64(cfg.environment.build_timeout_sec);
    let spec = EnvSpec {
        writable,
        memory_mb: cfg.environment.memory_mb,
        storage_mb: cfg.environment.storage_mb.min(MAX_STORAGE_MB),
        cpu_seconds: total.as_secs().saturating_add(1),
        env,
        lifetime: total + Duration::from_secs(60),
        host_network,
    };
    let t0 = Instant::now();
    let env = TrialEnv::start(&spec, &plan.workdir).map_err(|e| setup_err(&e))?;
    result.temper.session_start_ms = Some(t0.elapsed().as_secs_f64() * 1e3);
    let build_deadline =
        Instant::now() + Duration::from_secs_f64(cfg.environment.build_timeout_sec);
    let mut dirs = format!(
        "mkdir -p /logs/agent /logs/verifier {}",
        crate::dockerfile::shell_quote(&plan.workdir)
    );
    if plan.workdir == "/" {
        dirs = "mkdir -p /logs/agent /logs/verifier".into();
    }
    let r = env
        .exec(&dirs, Some("/"), &BTreeMap::new(), Duration::from_secs(10))
        .map_err(|e| setup_err(&e))?;
    if r.return_code != Some(0) {
        return Err(exception("EnvironmentSetupError", r.stderr));
    }
    for step in &plan.steps {
        match step {
            SetupStep::Copy { src, dest } => {
                env.put(&task.dir, src, dest).map_err(|e| setup_err(&e))?
            }
            SetupStep::Run { command, cwd } => {
                let left = build_deadline.saturating_duration_since(Instant::now());
                let r = env
                    .exec(command, Some(cwd), &BTreeMap::new(), left)
                    .map_err(|e| setup_err(&e))?;
                if r.status != ExecStatus::Finished || r.return_code != Some(0) {
                    return Err(exception(
                        "EnvironmentSetupError",
                        format!(
                            "Dockerfile RUN {command:?} failed in the sandbox ({}); tasks that \
                             install packages need a container runtime",
                            crate::agent::render_output(&r).trim()
                        ),
                    ));
                }
            }
        }
    }
    Ok(env)
}

fn verify(
    task: &Task,
    env: &TrialEnv,
    verifier_dir: &Path,
    timeout: Duration,
) -> Result<BTreeMap<String, f64>, ExceptionInfo> {
    let sandbox_err = |e: &dyn std::fmt::Display| exception("VerifierError", e.to_string());
    // A reward or test file the agent planted does not count.
    env.put_after(
        "rm -rf /logs/verifier && mkdir -p /logs/verifier && find /tests -mindepth 1 -delete",
        &task.dir,
        Path::new("tests"),
        "/tests",
    )
    .map_err(|e| sandbox_err(&e))?;
    let r = env
        .exec(
            "bash /tests/test.sh",
            None,
            &task.config.verifier.env,
            timeout,
        )
        .map_err(|e| sandbox_err(&e))?;
    let _ = std::fs::write(verifier_dir.join("test-stdout.txt"), &r.stdout);
    let _ = std::fs::write(verifier_dir.join("test-stderr.txt"), &r.stderr);
    match r.status {
        ExecStatus::TimeLimitExceeded => {
            return Err(exception(
                "VerifierTimeoutError",
                format!(
                    "tests/test.sh ran past {} s and was killed",
                    timeout.as_secs_f64()
                ),
            ))
        }
        ExecStatus::MemoryLimitExceeded => {
            return Err(exception(
                "MemoryLimitExceeded",
                "the verifier exceeded [environment] memory_mb and was killed",
            ))
        }
        _ => {}
    }
    env.fetch_dir("/logs/verifier", verifier_dir)
        .map_err(|e| sandbox_err(&e))?;
    read_rewards(verifier_dir)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rewards_of(files: &[(&str, &str)]) -> Result<BTreeMap<String, f64>, String> {
        let d = tempfile::tempdir().expect("tempdir");
        for (name, text) in files {
            std::fs::write(d.path().join(name), text).expect("write");
        }
        read_rewards(d.path()).map_err(|e| e.exception_type)
    }

    #[test]
    fn reward_files_are_read_as_harbor_defines_them() {
        let one = |v: f64| Ok(BTreeMap::from([("reward".to_string(), v)]));
        assert_eq!(rewards_of(&[("reward.txt", "1\n")]), one(1.0));
        assert_eq!(rewards_of(&[("reward.txt", " 0.25 ")]), one(0.25));
        // reward.txt wins over reward.json.
        assert_eq!(
            rewards_of(&[("reward.txt", "0"), ("reward.json", r#"{"reward": 1}"#)]),
            one(0.0)
        );
        assert_eq!(
            rewards_of(&[("reward.json", r#"{"reward": 0.5, "tests_passed": 3}"#)]),
            Ok(BTreeMap::from([
                ("reward".to_string(), 0.5),
                ("tests_passed".to_string(), 3.0)
            ]))
        );
        for bad in [
            ("reward.txt", ""),
            ("reward.txt", "pass"),
            ("reward.txt", "NaN"),
            ("reward.json", r#"{"reward": "1"}"#),
            ("reward.json", r#"{"nested": {"a": 1}}"#),
            ("reward.json", "[1]"),
        ] {
            assert_eq!(
                rewards_of(&[bad]),
                Err("RewardFileEmptyError".into()),
                "{bad:?}"
            );
        }
        assert_eq!(rewards_of(&[]), Err("RewardFileNotFoundError".into()));
    }
}
