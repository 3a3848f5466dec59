//! Harbor task directories as a temper [`Environment`], so `temper eval`
//! and `temper train rl` run them like any other environment.
//!
//! A row is a task; a rollout is one trial of it ([`run_trial`]: sandbox
//! session, agent, verifier) with the agent of the environment's arguments;
//! the score is the verifier's `reward`. The agent reaches the model only
//! through the rollout's [`ChatModel`] (the evaluated endpoint, or the
//! policy being trained), by a gate ([`temper_env::gate`]):
//!
//! - `terminal` calls it in-process ([`Terminal::with_model`]);
//! - `command` gets `OPENAI_BASE_URL` pointing at a loopback
//!   OpenAI-compatible endpoint that this rollout serves from the same
//!   model, so any agent program works unchanged;
//! - `oracle` and `nop` make no calls.
//!
//! Every call through the gate is recorded as the [`ModelTurn`] the model
//! returned — with a trained policy, its [`TokenTrace`](temper_env::TokenTrace):
//! prompt ids, completion ids, the sampler's logprobs, the policy version —
//! and the rollout's `model_turns` are exactly those turns, in call order.
//! RL trains on them through its multi-turn path; nothing is re-tokenized
//! from text. The same records land in the trial's `agent/tokens.jsonl`,
//! in the fields `temper serve`'s capture writes. The environment's
//! sampling arguments (RL's `[sampling]`, `temper eval -S`) apply to every
//! call: an agent's own temperature or token limit is replaced, so the
//! trainer scores the distribution that was sampled.
//!
//! A task directory has no train/eval split: both splits are the tasks
//! (training order shuffled by the seed). Point `[eval] env` at another
//! directory for a held-out set.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use serde::Deserialize;
use serde_json::{json, Value};
use temper_env::gate::{answer_calls, Gate, MODEL_NAME};
use temper_env::{
    stable_hash, stop, ChatModel, EnvError, EnvKind, Environment, EvalDefaults, Loader, Message,
    ModelTurn, Rollout, Row, SamplingArgs, Score, Split, TokenUsage,
};

use crate::agent::{Agent, Nop, Oracle};
use crate::atif::Trajectory;
use crate::command::CommandAgent;
use crate::task::{discover, is_task_dir, Task};
use crate::terminal::{Terminal, TerminalConfig};
use crate::trial::{run_trial, TrialOptions, TrialResult};

/// The arguments of a tasks environment (`[[env]] args`,
/// `temper eval --env-args`).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TasksEnvArgs {
    /// `terminal` (default), `command`, `oracle` or `nop`.
    #[serde(default = "terminal")]
    pub agent: String,
    /// The `command` agent's program (`sh -c`).
    #[serde(default)]
    pub command: Option<String>,
    /// Only these tasks (by name); all when absent.
    #[serde(default)]
    pub tasks: Option<Vec<String>>,
    /// The terminal agent's most model turns per trial.
    #[serde(default = "thirty")]
    pub max_turns: u32,
    /// The terminal agent's most prompt + completion tokens per trial.
    #[serde(default)]
    pub max_total_tokens: Option<u64>,
    /// Replaces every task's `[agent] timeout_sec`.
    #[serde(default)]
    pub agent_timeout_sec: Option<f64>,
    /// The terminal agent's limit per command, in seconds.
    #[serde(default = "command_timeout")]
    pub command_timeout_sec: f64,
    /// Bytes of a command's output the terminal agent shows the model.
    #[serde(default = "output_bytes")]
    pub max_output_bytes: usize,
    /// Keep every trial's directory (Harbor's trial layout) under this
    /// directory; by default trials run in a temporary directory that is
    /// removed after scoring.
    #[serde(default)]
    pub trials_dir: Option<PathBuf>,
    /// Give tasks with `allow_internet = true` the host network.
    #[serde(default)]
    pub allow_internet: bool,
}

fn terminal() -> String {
    "terminal".into()
}
fn thirty() -> u32 {
    30
}
fn command_timeout() -> f64 {
    120.0
}
fn output_bytes() -> usize {
    8192
}

/// Harbor tasks as an [`Environment`].
#[derive(Debug)]
pub struct TasksEnv {
    id: String,
    tasks: Vec<Arc<Task>>,
    args: TasksEnvArgs,
}

/// True when `path` is a task directory or a directory holding task
/// directories (and not an `env.toml` environment).
pub fn is_tasks_path(path: &Path) -> bool {
    if !path.is_dir() || path.join("env.toml").is_file() {
        return false;
    }
    is_task_dir(path)
        || std::fs::read_dir(path)
            .map(|d| d.filter_map(Result::ok).any(|e| is_task_dir(&e.path())))
            .unwrap_or(false)
}

/// Harbor tasks as a kind of environment: a task directory or a directory
/// of them loads as a [`TasksEnv`] with `args` as [`TasksEnvArgs`].
#[derive(Debug, Clone, Copy, Default)]
pub struct TasksKind;

impl EnvKind for TasksKind {
    fn name(&self) -> &'static str {
        "Harbor tasks"
    }
    fn load(&self, spec: &str, args: &Value) -> Option<Result<Arc<dyn Environment>, EnvError>> {
        let path = Path::new(spec);
        is_tasks_path(path).then(|| TasksEnv::load(path, args).map(|e| Arc::new(e) as _))
    }
}

/// The loader of every kind of environment the workspace has: temper-env's
/// own plus Harbor tasks. The CLI and the training loops load through it;
/// a new kind is added here. Built once per process: the registry is
/// fixed at compile time, and every caller shares it.
pub fn loader() -> &'static Loader {
    static LOADER: std::sync::OnceLock<Loader> = std::sync::OnceLock::new();
    LOADER.get_or_init(|| Loader::new().with(TasksKind))
}

fn bad(env: &str, message: impl Into<String>) -> EnvError {
    EnvError::BadArgs {
        env: env.into(),
        message: message.into(),
    }
}

impl TasksEnv {
    /// The tasks under `dir` (a task, or a directory of tasks) with `args`.
    pub fn load(dir: &Path, args: &Value) -> Result<Self, EnvError> {
        let id = dir.display().to_string();
        let args: TasksEnvArgs = temper_env::parse_args(&id, args)?;
        match args.agent.as_str() {
            "terminal" | "oracle" | "nop" => {}
            "command" if args.command.is_some() => {}
            "command" => return Err(bad(&id, "agent \"command\" needs `command` (the program)")),
            other => {
                return Err(bad(
                    &id,
                    format!(
                        "unknown agent {other:?}; one of {}",
                        crate::AGENTS.join(", ")
                    ),
                ))
            }
        }
        if args.max_turns == 0 {
            return Err(bad(&id, "max_turns must be at least 1"));
        }
        if let Some(t) = args.agent_timeout_sec {
            if !(t.is_finite() && t > 0.0) {
                return Err(bad(&id, "agent_timeout_sec must be a positive number"));
            }
        }
        if !(args.command_timeout_sec.is_finite() && args.command_timeout_sec > 0.0) {
            return Err(bad(&id, "command_timeout_sec must be a positive number"));
        }
        let mut tasks = discover(&[dir.to_path_buf()]).map_err(|e| bad(&id, e.to_string()))?;
        if let Some(names) = &args.tasks {
            for n in names {
                if !tasks.iter().any(|t| &t.name == n) {
                    return Err(bad(&id, format!("no task named {n:?} here")));
                }
            }
            tasks.retain(|t| names.contains(&t.name));
        }
        if tasks.is_empty() {
            return Err(bad(&id, "no tasks"));
        }
        Ok(Self {
            id,
            tasks: tasks.into_iter().map(Arc::new).collect(),
            args,
        })
    }

    /// The tasks, by name order.
    pub fn tasks(&self) -> impl Iterator<Item = &Task> {
        self.tasks.iter().map(|t| t.as_ref())
    }

    /// The agent of one trial, its model calls going through `gate`.
    fn agent(&self, gate: &Gate, sampling: &SamplingArgs) -> Result<Box<dyn Agent>, String> {
        let a = &self.args;
        let runtime = tokio::runtime::Handle::current();
        Ok(match a.agent.as_str() {
            "oracle" => Box::new(Oracle),
            "nop" => Box::new(Nop),
            "terminal" => {
                let config = TerminalConfig {
                    base_url: "in-process".into(),
                    model: MODEL_NAME.into(),
                    api_key: None,
                    max_turns: a.max_turns,
                    max_total_tokens: a.max_total_tokens,
                    // What the agent asks for; the gate applies `sampling`.
                    max_tokens_per_turn: sampling.max_tokens,
                    temperature: sampling.temperature,
                    command_timeout: Duration::from_secs_f64(a.command_timeout_sec),
                    max_output_bytes: a.max_output_bytes,
                    capture: false,
                };
                Box::new(Terminal::with_model(config, gate.model(), runtime))
            }
            "command" => Box::new(CommandAgent {
                program: a
                    .command
                    .clone()
                    .ok_or_else(|| "agent command needs `command`".to_string())?,
                base_url: Some(gate.base_url()?),
                model: Some(MODEL_NAME.into()),
                api_key: None,
                capture: false,
                runtime,
            }),
            other => return Err(format!("unknown agent {other:?}")),
        })
    }
}

#[async_trait]
impl Environment for TasksEnv {
    fn id(&self) -> &str {
        &self.id
    }

    /// The tasks (up to `n`) for either split: by name for `Eval`, in a
    /// seeded order for `Train`.
    fn rows(&self, split: Split, n: usize, seed: u64) -> Result<Vec<Row>, EnvError> {
        let mut tasks: Vec<&Arc<Task>> = self.tasks.iter().collect();
        if split == Split::Train {
            tasks.sort_by_key(|t| stable_hash(format!("{seed}/{}", t.name).as_bytes()));
        }
        Ok(tasks
            .into_iter()
            .take(n)
            .enumerate()
            .map(|(i, t)| Row {
                example_id: i as u64,
                prompt: vec![Message::user(t.instruction.clone())],
                answer: None,
                info: json!({ "task": t.name }),
            })
            .collect())
    }

    async fn rollout(&self, model: &dyn ChatModel, row: &Row, sampling: &SamplingArgs) -> Rollout {
        let started = Instant::now();
        let mut rollout = self.trial(model, row, sampling).await;
        rollout.timing.generation_ms = started.elapsed().as_secs_f64() * 1e3;
        rollout.timing.total_ms = rollout.timing.generation_ms;
        rollout
    }

    /// The verifier's `reward` of each trial, its other `reward.json`
    /// entries as metrics. A trial without a reward is an errored rollout
    /// (never trained on); its score is 0 with the metric `verifier/error`.
    async fn score_group(&self, _row: &Row, rollouts: &[Rollout]) -> Vec<Score> {
        rollouts
            .iter()
            .map(|r| {
                let rewards: BTreeMap<String, f64> = r
                    .state
                    .get("rewards")
                    .and_then(|v| serde_json::from_value(v.clone()).ok())
                    .unwrap_or_default();
                match rewards.get("reward") {
                    Some(&reward) if r.error.is_none() => Score {
                        reward,
                        metrics: rewards,
                        ..Score::default()
                    },
                    _ => Score {
                        reward: 0.0,
                        metrics: BTreeMap::from([("verifier/error".to_string(), 1.0)]),
                        // A failed trial is already the rollout's error.
                        error: r
                            .error
                            .is_none()
                            .then(|| "the verifier wrote no reward".to_string()),
                        ..Score::default()
                    },
                }
            })
            .collect()
    }

    fn eval_defaults(&self) -> EvalDefaults {
        EvalDefaults {
            num_examples: self.tasks.len(),
            rollouts_per_example: 1,
            sampling: SamplingArgs {
                max_tokens: 1024,
                temperature: 0.7,
                ..SamplingArgs::default()
            },
            pass_threshold: None,
        }
    }
}

impl TasksEnv {
    /// One trial of `row`'s task, its model calls answered by `model`.
    async fn trial(&self, model: &dyn ChatModel, row: &Row, sampling: &SamplingArgs) -> Rollout {
        let failed = |e: String| Rollout {
            error: Some(e),
            stop_condition: Some(stop::ERROR.into()),
            ..Rollout::default()
        };
        let Some(name) = row.info.get("task").and_then(Value::as_str) else {
            return failed("the row names no task".into());
        };
        let Some(task) = self.tasks.iter().find(|t| t.name == name).cloned() else {
            return failed(format!("no task {name:?} in {}", self.id));
        };
        // Where the trial's files go: kept, or a temporary directory.
        let (trial_dir, _tmp) = match &self.args.trials_dir {
            Some(d) => (
                d.join(format!("{}__{}", task.name, crate::job::random_id(8))),
                None,
            ),
            None => match tempfile::Builder::new().prefix("temper-trial-").tempdir() {
                Ok(t) => (t.path().join(&task.name), Some(t)),
                Err(e) => return failed(format!("temporary trial directory: {e}")),
            },
        };
        let (gate, calls) = Gate::new();
        let agent = match self.agent(&gate, sampling) {
            Ok(a) => a,
            Err(e) => return failed(e),
        };
        drop(gate);
        let options = TrialOptions {
            agent_timeout: self.args.agent_timeout_sec.map(Duration::from_secs_f64),
            allow_internet: self.args.allow_internet,
            ..TrialOptions::default()
        };
        let dir = trial_dir.clone();
        let trial =
            tokio::task::spawn_blocking(move || run_trial(&task, agent.as_ref(), &dir, &options));
        // Answer the agent's calls until the trial ends.
        let (joined, turns) = answer_calls(model, sampling, calls, trial).await;
        let result = match joined {
            Ok(Ok(r)) => r,
            Ok(Err(e)) => return failed(format!("trial: {e}")),
            Err(e) => return failed(format!("trial panicked: {e}")),
        };
        let agent_dir = trial_dir.join("agent");
        if let Err(e) = crate::capture::write_records(&agent_dir, &records(&result, &turns)) {
            tracing::warn!("{e}");
        }
        let trajectory = std::fs::read_to_string(agent_dir.join("trajectory.json"))
            .ok()
            .and_then(|t| serde_json::from_str::<Trajectory>(&t).ok());
        let mut rollout = rollout_of(&result, trajectory.as_ref(), turns);
        if self.args.trials_dir.is_some() {
            rollout.state["trial_dir"] = json!(trial_dir);
        }
        rollout
    }
}

/// The captured calls as `agent/tokens.jsonl` records (the fields of
/// `temper serve`'s capture), for the turns that carry tokens.
fn records(result: &TrialResult, turns: &[ModelTurn]) -> Vec<Value> {
    turns
        .iter()
        .filter_map(|t| t.trace.as_ref().map(|tr| (t, tr)))
        .enumerate()
        .map(|(seq, (t, tr))| {
            json!({
                "episode": result.trial_name,
                "seq": seq,
                "endpoint": "chat.completions",
                "model": MODEL_NAME,
                "version": tr.version,
                "prompt_token_ids": tr.prompt_ids,
                "completion_token_ids": tr.completion_ids,
                "logprobs": tr.logprobs,
                "finish_reason": t.finish_reason,
                "sampling": { "temperature": tr.temperature },
            })
        })
        .collect()
}

/// The rollout of a finished trial.
fn rollout_of(result: &TrialResult, traj: Option<&Trajectory>, turns: Vec<ModelTurn>) -> Rollout {
    let rewards = result
        .verifier_result
        .as_ref()
        .and_then(|v| v.rewards.clone());
    let exception = result
        .exception_info
        .as_ref()
        .map(|e| format!("{}: {}", e.exception_type, e.exception_message));
    let error = match &rewards {
        Some(r) if r.contains_key("reward") => None,
        Some(_) => Some("the verifier's reward.json has no `reward` entry".to_string()),
        None => Some(exception.clone().unwrap_or_else(|| "no reward".into())),
    };
    let metadata = result
        .agent_result
        .as_ref()
        .and_then(|a| a.metadata.clone())
        .unwrap_or_default();
    let stop_reason = metadata.get("stop_reason").and_then(Value::as_str);
    let stop_condition = match (&error, stop_reason) {
        (Some(_), _) => stop::ERROR,
        (None, Some("max_turns")) => stop::MAX_TURNS,
        (None, Some("max_total_tokens")) => stop::MAX_TOKENS,
        (None, _) => stop::COMPLETED,
    };
    let is_truncated = stop_reason == Some("max_total_tokens")
        || turns.last().is_some_and(|t| t.finish_reason == "length");
    let usage = result.agent_result.as_ref();
    Rollout {
        completion: traj.map(completion_of).unwrap_or_default(),
        is_completed: error.is_none(),
        is_truncated,
        stop_condition: Some(stop_condition.into()),
        error,
        token_usage: TokenUsage {
            input_tokens: usage.and_then(|u| u.n_input_tokens).unwrap_or(0),
            output_tokens: usage.and_then(|u| u.n_output_tokens).unwrap_or(0),
        },
        timing: Default::default(),
        model_turns: turns,
        state: json!({
            "task": result.task_name,
            "trial": result.trial_name,
            "rewards": rewards,
            "exception": exception,
            "agent": metadata,
        }),
    }
}

/// The trajectory as chat messages: the agent's steps as assistant turns,
/// what its commands printed as user turns.
fn completion_of(traj: &Trajectory) -> Vec<Message> {
    let mut out = Vec::new();
    for step in traj.steps.iter().filter(|s| s.source == "agent") {
        let mut text = step.message.clone();
        if text.is_empty() {
            for call in step.tool_calls.iter().flatten() {
                if let Some(c) = call.arguments.get("command").and_then(Value::as_str) {
                    text.push_str(&format!("```bash\n{c}\n```\n"));
                }
            }
        }
        out.push(Message::assistant(text));
        for r in step.observation.iter().flat_map(|o| &o.results) {
            out.push(Message::user(format!("Output:\n{}", r.content)));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn examples() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples/tasks")
    }

    #[test]
    fn a_directory_of_tasks_loads_as_an_environment_with_its_args_checked() {
        let env = loader()
            .load(
                &examples().display().to_string(),
                &json!({"agent": "oracle", "tasks": ["hello-file", "write-config"]}),
            )
            .expect("load");
        let rows = env.rows(Split::Eval, 10, 0).expect("rows");
        let names: Vec<_> = rows.iter().map(|r| r.info["task"].clone()).collect();
        assert_eq!(names, vec![json!("hello-file"), json!("write-config")]);
        assert_eq!(env.eval_defaults().num_examples, 2);
        // One task directory is an environment of one task.
        let one = examples().join("hello-file");
        let env = loader()
            .load(&one.display().to_string(), &Value::Null)
            .expect("one");
        assert_eq!(env.rows(Split::Train, 5, 3).expect("rows").len(), 1);
        for (args, want) in [
            (json!({"agent": "claude"}), "unknown agent"),
            (json!({"agent": "command"}), "needs `command`"),
            (json!({"tasks": ["no-such-task"]}), "no-such-task"),
            (json!({"max_turn": 3}), "max_turn"),
            (json!({"max_turns": 0}), "max_turns"),
        ] {
            let e = loader()
                .load(&examples().display().to_string(), &args)
                .err()
                .expect("refused")
                .to_string();
            assert!(e.contains(want), "{args}: {e}");
        }
        // Other specs still load through temper-env.
        assert!(loader().load("arithmetic", &Value::Null).is_ok());
    }

    #[test]
    fn a_trial_without_a_reward_is_an_errored_rollout_scored_zero() {
        let ok = Rollout {
            state: json!({"rewards": {"reward": 0.75, "exact": 0.0}}),
            ..Rollout::default()
        };
        let missing = Rollout {
            error: Some("RewardFileNotFoundError: ...".into()),
            state: json!({"rewards": null}),
            ..Rollout::default()
        };
        let env = TasksEnv::load(&examples(), &Value::Null).expect("load");
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("rt");
        let row = &env.rows(Split::Eval, 1, 0).expect("rows")[0];
        let scores = rt.block_on(env.score_group(row, &[ok, missing]));
        assert_eq!(scores[0].reward, 0.75);
        assert_eq!(scores[0].metrics["exact"], 0.0);
        assert_eq!(scores[1].reward, 0.0);
        assert_eq!(scores[1].metrics["verifier/error"], 1.0);
    }
}
