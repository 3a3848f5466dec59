//! `temper-tasks`: Harbor-format agentic tasks run locally, one temper
//! sandbox session per trial, with built-in agents.
//!
//! A task is a directory in Harbor's format (`instruction.md`, `task.toml`,
//! `environment/Dockerfile`, `tests/test.sh`, optional `solution/solve.sh`).
//! A trial starts a sandbox session (namespaces, no network, cgroup memory
//! limit, writable tmpfs directories such as `/app` and `/logs` over the
//! host's read-only system directories), applies what the Dockerfile says
//! that the sandbox can honour ([`dockerfile`]), lets an [`Agent`] work
//! until done or `[agent] timeout_sec`, then copies `tests/` in and runs
//! `tests/test.sh` in the same session, which writes
//! `/logs/verifier/reward.txt` or `reward.json`. Results land in Harbor's
//! job layout ([`job`], [`trial`]) with an ATIF trajectory per trial
//! ([`atif`]).
//!
//! The same trials are a temper environment ([`environment`]): a task
//! directory given to `temper eval` or as an `[[env]] id` loads through
//! [`loader`] (temper-env's [`temper_env::Loader`] with [`TasksKind`]
//! added) as a [`TasksEnv`], whose rollouts record the
//! agent's model calls with their token traces, so RL trains on them.
//!
//! Key design choice: no image build and no container daemon. A trial's
//! environment is the host's own toolchain in a namespace sandbox, ready in
//! milliseconds, so tasks must run on what the host has (bash, python,
//! coreutils); a Dockerfile that installs packages or copies into system
//! directories is refused with a clear error (it needs a container
//! runtime), never half-applied.
//!
//! ```
//! use temper_tasks::TaskConfig;
//!
//! let cfg = TaskConfig::parse(r#"
//!     version = "1.0"
//!     [verifier]
//!     timeout_sec = 30.0
//!     [environment]
//!     memory_mb = 512
//!     allow_internet = false
//! "#)?;
//! assert_eq!(cfg.verifier.timeout_sec, 30.0);
//! assert_eq!(cfg.agent.timeout_sec, 600.0); // Harbor's default
//! assert_eq!(cfg.environment.memory_mb, 512);
//! assert!(!cfg.environment.allow_internet);
//! # Ok::<(), toml::de::Error>(())
//! ```
#![deny(missing_docs)]

pub mod agent;
pub mod atif;
pub mod capture;
pub mod command;
pub mod dockerfile;
pub mod environment;
mod error;
pub mod files;
pub mod harbor;
pub mod job;
pub mod task;
pub mod terminal;
pub mod traces;
pub mod trial;
pub mod trial_env;

pub use agent::{Agent, AgentContext, AgentOutcome, Nop, Oracle};
pub use environment::{loader, TasksEnv, TasksEnvArgs, TasksKind};
pub use error::TaskError;
pub use job::{load_job, plan_job, run_job, summary_table, AgentSpec, JobConfig, JobResult};
pub use task::{discover, Task, TaskConfig};
pub use trial::{run_trial, TrialOptions, TrialResult};

/// The agents `-a` accepts.
pub const AGENTS: &[&str] = &["oracle", "nop", "terminal", "command"];

/// Builds the agent `spec` names. `api_key` is the endpoint's key (never
/// stored in the job); `runtime` runs the model calls of model-backed
/// agents.
pub fn build_agent(
    spec: &AgentSpec,
    api_key: Option<String>,
    runtime: &tokio::runtime::Handle,
) -> Result<Box<dyn Agent>, TaskError> {
    let need = |what: &str, v: &Option<String>| {
        v.clone()
            .ok_or_else(|| TaskError::Invalid(format!("agent {} needs {what}", spec.name)))
    };
    match spec.name.as_str() {
        "oracle" => Ok(Box::new(Oracle)),
        "nop" => Ok(Box::new(Nop)),
        "terminal" => Ok(Box::new(terminal::Terminal::new(
            terminal::TerminalConfig::from_spec(spec, api_key)?,
            runtime.clone(),
        )?)),
        "command" => Ok(Box::new(command::CommandAgent {
            program: need("a program (--agent-command)", &spec.command)?,
            base_url: spec.base_url.clone(),
            model: spec.model.clone(),
            api_key,
            capture: spec.capture,
            runtime: runtime.clone(),
        })),
        other => Err(TaskError::Invalid(format!(
            "unknown agent {other:?}; one of {}",
            AGENTS.join(", ")
        ))),
    }
}
