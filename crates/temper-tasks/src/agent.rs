//! Agents: what acts in a trial's environment between setup and the
//! verifier. [`Oracle`] runs the task's `solution/solve.sh`, [`Nop`] does
//! nothing; the `terminal` and `command` agents live in their own modules.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::{Duration, Instant};

use serde_json::{Map, Value};
use temper_sandbox::{ExecResult, ExecStatus};

use crate::atif::{self, Step, Trajectory};
use crate::task::Task;
use crate::trial_env::TrialEnv;

/// What an agent gets for one trial.
pub struct AgentContext<'a> {
    /// The trial's sandbox session.
    pub env: &'a TrialEnv,
    /// The task.
    pub task: &'a Task,
    /// The trial's name (the trajectory's `session_id`).
    pub trial_name: &'a str,
    /// When the agent's time is up (`[agent] timeout_sec` from its start).
    pub deadline: Instant,
    /// The trial's `agent/` directory on the host (logs go here).
    pub logs_dir: &'a Path,
}

impl AgentContext<'_> {
    /// Time left before the deadline (zero when past it).
    pub fn remaining(&self) -> Duration {
        self.deadline.saturating_duration_since(Instant::now())
    }
}

/// Why an agent stopped early; recorded as the trial's `exception_info`
/// (Harbor's exception type names where Harbor has one).
#[derive(Debug, Clone, PartialEq)]
pub struct AgentFailure {
    /// `AgentTimeoutError`, `MemoryLimitExceeded`, `SandboxError`, ...
    pub kind: String,
    /// Details.
    pub message: String,
    /// False when the environment is gone (the verifier cannot run).
    pub env_alive: bool,
}

/// What an agent did.
#[derive(Debug, Clone)]
pub struct AgentOutcome {
    /// The ATIF trajectory.
    pub trajectory: Trajectory,
    /// Prompt tokens, summed.
    pub n_input_tokens: Option<u64>,
    /// Completion tokens, summed.
    pub n_output_tokens: Option<u64>,
    /// Agent-specific facts (turns, stop reason, ...).
    pub metadata: Map<String, Value>,
    /// Set when the agent stopped early.
    pub failure: Option<AgentFailure>,
}

/// An agent.
pub trait Agent: Send + Sync {
    /// Name in results and trajectories.
    fn name(&self) -> &str;
    /// Version.
    fn version(&self) -> &str {
        env!("CARGO_PKG_VERSION")
    }
    /// The model it calls, if any.
    fn model_name(&self) -> Option<String> {
        None
    }
    /// Settings recorded in the trajectory's `agent.extra`.
    fn settings(&self) -> Map<String, Value> {
        Map::new()
    }
    /// Works on the task until done or the deadline.
    fn run(&self, ctx: &AgentContext<'_>) -> AgentOutcome;

    /// The ATIF `agent` block.
    fn atif_agent(&self) -> atif::Agent {
        let settings = self.settings();
        atif::Agent {
            name: self.name().into(),
            version: self.version().into(),
            model_name: self.model_name(),
            tool_definitions: None,
            extra: (!settings.is_empty()).then_some(settings),
        }
    }
}

/// The text an agent (or a log) sees for a command's result.
pub fn render_output(r: &ExecResult) -> String {
    let mut out = String::new();
    out.push_str(&r.stdout);
    if !r.stderr.is_empty() {
        if !out.is_empty() && !out.ends_with('\n') {
            out.push('\n');
        }
        out.push_str(&r.stderr);
    }
    if r.stdout_truncated || r.stderr_truncated {
        out.push_str("\n[output truncated]");
    }
    match r.status {
        ExecStatus::Finished => {
            out.push_str(&format!("\n[exit code {}]", r.return_code.unwrap_or(-1)))
        }
        ExecStatus::TimeLimitExceeded => out.push_str("\n[killed: time limit]"),
        ExecStatus::MemoryLimitExceeded => out.push_str("\n[killed: memory limit]"),
        _ => out.push_str(&format!("\n[killed by signal {}]", r.signal.unwrap_or(0))),
    }
    out
}

/// Maps a command's end to an agent failure: a timeout at the agent's
/// deadline, or the memory limit (which takes the session with it).
pub fn failure_of(r: &ExecResult, at_deadline: bool) -> Option<AgentFailure> {
    match r.status {
        ExecStatus::TimeLimitExceeded if at_deadline => Some(AgentFailure {
            kind: "AgentTimeoutError".into(),
            message: "the agent ran past [agent] timeout_sec and was killed".into(),
            env_alive: true,
        }),
        ExecStatus::MemoryLimitExceeded => Some(AgentFailure {
            kind: "MemoryLimitExceeded".into(),
            message: "the trial's processes exceeded [environment] memory_mb and were killed"
                .into(),
            env_alive: false,
        }),
        _ => None,
    }
}

/// A sandbox error while acting: the session is unusable.
pub fn sandbox_failure(e: &dyn std::fmt::Display) -> AgentFailure {
    AgentFailure {
        kind: "SandboxError".into(),
        message: e.to_string(),
        env_alive: false,
    }
}

/// Does nothing: the baseline every task must score 0 on.
#[derive(Debug, Default)]
pub struct Nop;

impl Agent for Nop {
    fn name(&self) -> &str {
        "nop"
    }
    fn run(&self, ctx: &AgentContext<'_>) -> AgentOutcome {
        let t = Trajectory::new(ctx.trial_name, self.atif_agent(), &ctx.task.instruction);
        finished(t, None)
    }
}

/// The outcome of an agent that counts no tokens: its trajectory closed.
fn finished(mut t: Trajectory, failure: Option<AgentFailure>) -> AgentOutcome {
    t.finish();
    AgentOutcome {
        trajectory: t,
        n_input_tokens: None,
        n_output_tokens: None,
        metadata: Map::new(),
        failure,
    }
}

/// Runs the task's `solution/solve.sh` (copied to `/solution`) in the
/// workdir: the check that a task is solvable and its verifier sound.
#[derive(Debug, Default)]
pub struct Oracle;

impl Agent for Oracle {
    fn name(&self) -> &str {
        "oracle"
    }
    fn run(&self, ctx: &AgentContext<'_>) -> AgentOutcome {
        let mut t = Trajectory::new(ctx.trial_name, self.atif_agent(), &ctx.task.instruction);
        let no_solution = |message: String| AgentFailure {
            kind: "NoSolution".into(),
            message,
            env_alive: true,
        };
        match ctx.task.has_solution() {
            Ok(true) => {}
            Ok(false) => {
                return finished(
                    t,
                    Some(no_solution("the task has no solution/solve.sh".into())),
                )
            }
            Err(e) => return finished(t, Some(no_solution(e.to_string()))),
        }
        match ctx
            .env
            .put(&ctx.task.dir, Path::new("solution"), "/solution")
        {
            Ok(()) => {}
            // A refused task file: the session itself is fine.
            Err(e @ crate::TaskError::InvalidTask { .. }) => {
                return finished(t, Some(no_solution(e.to_string())))
            }
            Err(e) => return finished(t, Some(sandbox_failure(&e))),
        }
        let command = "bash /solution/solve.sh";
        let env: BTreeMap<String, String> = ctx.task.config.solution.env.clone();
        let r = match ctx.env.exec(command, None, &env, ctx.remaining()) {
            Ok(r) => r,
            Err(e) => return finished(t, Some(sandbox_failure(&e))),
        };
        let shown = render_output(&r);
        let _ = std::fs::write(ctx.logs_dir.join("oracle.txt"), &shown);
        let mut step = Step::new("agent", "");
        step.bash_call("call_1".into(), command, shown);
        t.push(step);
        let failure = failure_of(&r, true);
        finished(t, failure)
    }
}
