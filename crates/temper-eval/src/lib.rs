//! `temper-eval`: evaluate an environment against any OpenAI-compatible
//! endpoint.
//!
//! - [`run_eval`]: bounded concurrency (at most `max_concurrent` model
//!   calls in flight, [`Bounded`]), retries with backoff and a per-request
//!   timeout ([`temper_env::openai::OpenAiChatModel`]); a failure is
//!   recorded on its rollout and never ends the run.
//! - [`results`]: `results.jsonl` and `metadata.json` in verifiers' field
//!   names. Each group of rollouts is written with one `write` and flushed,
//!   so `kill -9` loses at most the groups in flight; [`results::recover`]
//!   keeps the whole groups and `--resume` runs the rest, so a resumed run
//!   has every rollout exactly once.
//! - [`report`]: averages, pass@k, the terminal table and the HTML report.
//! - [`mock`]: an OpenAI-compatible server with fault injection (429, 500,
//!   hangs, malformed JSON, dropped connections) for tests and benchmarks.
//!
//! Key design choice: the unit of work and of durability is the group (all
//! rollouts of one example), because group rubrics score them together.
//!
//! ```no_run
//! use std::sync::Arc;
//! use temper_eval::{run_eval, EvalConfig};
//!
//! # async fn demo(cfg: EvalConfig) -> Result<(), Box<dyn std::error::Error>> {
//! let env = temper_env::Loader::new().load("arithmetic", &serde_json::json!({}))?;
//! let out = run_eval(env, &cfg).await?;
//! println!("avg reward {}", out.metadata.avg_reward);
//! # Ok(()) }
//! ```
#![deny(missing_docs)]

pub mod mock;
pub mod report;
pub mod results;
mod runner;

use std::path::Path;

pub use runner::{
    default_run_dir, endpoint_model, preflight, run_eval, run_eval_with, Bounded, EvalConfig,
    EvalOutcome,
};
pub use temper_env::openai::RetryPolicy;

/// Why an evaluation could not run (single rollouts fail on their own).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum EvalError {
    /// The environment failed to load or produce rows.
    #[error(transparent)]
    Env(#[from] temper_env::EnvError),
    /// The model client could not be built.
    #[error(transparent)]
    Model(#[from] temper_env::ModelCallError),
    /// The endpoint cannot serve this run (down, key refused, no such
    /// model): found by the preflight `GET /models`.
    #[error("{0}")]
    Preflight(String),
    /// Run files are missing or unreadable.
    #[error("results: {0}")]
    Results(String),
    /// File system error.
    #[error("{path}: {source}")]
    Io {
        /// The path.
        path: String,
        /// The cause.
        source: std::io::Error,
    },
}

impl EvalError {
    pub(crate) fn io(path: &Path, source: std::io::Error) -> Self {
        EvalError::Io {
            path: path.display().to_string(),
            source,
        }
    }
}
