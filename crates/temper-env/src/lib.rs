//! `temper-env`: environments — a dataset, a harness, a rubric and a
//! parser — and the built-in tasks.
//!
//! - [`Environment`]: the trait trainers and the evaluator drive: `rows`
//!   (train and eval splits, disjoint, deterministic in the seed),
//!   `rollout` (talks to the model only through [`ChatModel`]),
//!   `score_group` (a [`Rubric`] over all rollouts of one row),
//!   `eval_defaults`.
//! - [`Env`]: dataset + [`Harness`] (single-turn, multi-turn with an
//!   [`EnvResponder`], tool-use with [`Tool`]s) + [`Rubric`] (+ [`Parser`]).
//!   Every built-in and every `env.toml` is one.
//! - [`Loader`]: the one way to open an environment from a spec: a
//!   registry of [`EnvKind`]s tried in order — a built-in name
//!   ([`BUILTIN_ENVS`]), a directory with `env.toml` ([`manifest`]), a
//!   verifiers environment (`verifiers:MODULE_OR_PATH`, run by a bridge
//!   through the JSON-lines protocol), the kinds crates above add
//!   ([`Loader::with`]: Harbor tasks in `temper-tasks`), and last an
//!   external command speaking that protocol ([`external`]).
//! - [`gate`]: a rollout's model as a loopback OpenAI endpoint, for
//!   programs that call the model themselves.
//! - [`openai::OpenAiChatModel`]: the [`ChatModel`] for OpenAI-compatible
//!   endpoints (retries, timeouts), used by `temper eval` and the judge.
//!
//! The contract trainers build on (issue 7):
//!
//! | item | what |
//! |---|---|
//! | [`Row`] | `example_id`, `prompt: Vec<Message>` (system prompt and few-shot included), `answer`, `info` |
//! | [`Message`] | OpenAI chat message; unknown fields kept, so OpenAI JSON round-trips |
//! | [`SamplingArgs`] | `max_tokens`, `temperature`, `top_p`, `seed`, `stop`, `extra` |
//! | [`ChatRequest`] / [`ModelTurn`] | what a harness asks / what a model answers (a trained policy's [`TokenTrace`] — token ids, logprobs, version, temperature — reaches [`Rollout::model_turns`] as a type) |
//! | [`ChatModel`] | `async fn chat(&self, ChatRequest) -> Result<ModelTurn, ModelCallError>` |
//! | [`Rollout`] | `completion`, `is_completed`, `is_truncated`, `stop_condition`, `error`, `token_usage`, `timing`, `model_turns`, `state` |
//! | [`Score`] | `reward`, `metrics`, `error` (a reward that could not score) |
//! | [`Environment`] | `id`, `rows(Split, n, seed)`, `rollout(&dyn ChatModel, &Row, &SamplingArgs)`, `score_group(&Row, &[Rollout])`, `eval_defaults`, `services` |
//! | [`check_services`] | every service an environment calls (sandbox, judge) answers, checked before the first rollout |
//! | [`Loader`] | `load(spec, &serde_json::Value) -> Arc<dyn Environment>` over registered [`EnvKind`]s |
//! | [`score_and_time`] | `score_group` that also fills `timing.scoring_ms` |
//!
//! Key design choice: harnesses never see an HTTP client, only
//! [`ChatModel`], so the same environment is evaluated against a remote
//! endpoint and trained against the in-process engine; and failures are
//! values on the [`Rollout`], never errors that end a run.
//!
//! ```
//! use serde_json::json;
//! use temper_env::{Loader, Split};
//!
//! let env = Loader::new().load("arithmetic", &json!({"digits": 2, "ops": ["+"], "system_prompt": ""}))?;
//! let rows = env.rows(Split::Eval, 3, 0)?;
//! assert_eq!(rows.len(), 3);
//! assert!(rows[0].prompt[0].text().starts_with("What is "));
//! # Ok::<(), temper_env::EnvError>(())
//! ```
#![deny(missing_docs)]

mod env;
mod envs;
mod error;
pub mod external;
pub mod gate;
mod harness;
mod loader;
pub mod manifest;
pub mod math;
mod model;
pub mod openai;
mod parser;
pub mod rubric;
pub mod service;
mod types;

pub use env::{
    is_eval_question, parse_args, pass_threshold, score_and_time, stable_hash, Dataset, Env,
    Environment, Generated, PassThreshold, PromptTemplate, Task,
};
pub use envs::{wordle_feedback, BUILTIN_ENVS};
pub use error::{EnvError, ModelCallError, TraceError};
pub use harness::{
    format_number, Calculator, EnvResponder, EnvResponse, Harness, PythonTool, Tool,
};
pub use loader::{EnvKind, Loader};
pub use model::ChatModel;
pub use parser::{last_boxed, last_number, FieldSpec, Parser};
pub use rubric::{GroupReward, Reward, RewardCtx, Rubric};
pub use service::{check_services, SandboxService, Service, SANDBOX_KEY_FILE_ENV};
pub use types::{
    greedy_group_warning, last_assistant_text, stop, ChatRequest, Content, EvalDefaults,
    FunctionCall, Message, ModelTurn, Rollout, Row, SamplingArgs, Score, Split, Timing, TokenTrace,
    TokenUsage, ToolCall, Usage,
};

/// Countdown's answer check, public for tests and trainers' reward shaping.
pub use envs::countdown_valid;

/// An environment pulled from a hub, as a run records it (eval
/// `metadata.json`, a training run's `config.toml`), so the run names the
/// exact bytes it used.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PackageRef {
    /// As written (`acme/capitals@^1`).
    pub reference: String,
    /// `namespace/name`.
    pub id: String,
    /// The version it resolved to.
    pub version: String,
    /// The archive's digest (`sha256:...`).
    pub digest: String,
}
