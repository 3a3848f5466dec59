//! Errors of environments and model calls.

/// Why an environment could not be loaded or could not produce rows.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum EnvError {
    /// No built-in environment, directory or command answers to this name.
    #[error("unknown environment `{0}`: {hint}", hint = unknown_hint(.0))]
    Unknown(String),
    /// An environment argument is missing, of the wrong type or out of range.
    #[error("environment `{env}`: bad argument: {message}")]
    BadArgs {
        /// The environment.
        env: String,
        /// What is wrong.
        message: String,
    },
    /// `env.toml` could not be read or does not describe an environment.
    #[error("manifest {path}: {message}")]
    Manifest {
        /// The manifest file.
        path: String,
        /// What is wrong.
        message: String,
    },
    /// A dataset file could not be read or has a bad row.
    #[error("dataset {path}: {message}")]
    Dataset {
        /// The data file.
        path: String,
        /// What is wrong.
        message: String,
    },
    /// A service the environment calls (the sandbox, a judge's endpoint)
    /// is down, refuses the key or does not work: found by
    /// [`crate::check_services`] before the first rollout.
    #[error("environment `{env}` cannot run: {message}")]
    Service {
        /// The environment.
        env: String,
        /// Each failing service and why, one per line.
        message: String,
    },
    /// An external environment process failed or broke the protocol.
    #[error("external environment: {0}")]
    External(String),
    /// File system error with the path involved.
    #[error("{path}: {source}")]
    Io {
        /// The path.
        path: String,
        /// The cause.
        source: std::io::Error,
    },
}

/// Why one call to a chat model failed. The evaluator's HTTP model retries
/// the retryable kinds before it gives one back; harnesses record the final
/// error on the rollout instead of raising it.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum ModelCallError {
    /// The endpoint answered with an error status.
    #[error("model endpoint answered {status}: {message}")]
    Status {
        /// HTTP status code.
        status: u16,
        /// The endpoint's message.
        message: String,
    },
    /// No answer within the per-request timeout.
    #[error("model call timed out after {0:.1}s")]
    Timeout(f64),
    /// The connection failed or was dropped mid-answer.
    #[error("model connection failed: {0}")]
    Connection(String),
    /// The answer was not the expected JSON.
    #[error("malformed model answer: {0}")]
    Malformed(String),
    /// The prompt does not fit the model's context.
    #[error("prompt too long: {0}")]
    PromptTooLong(String),
    /// Anything else (an in-process engine's error, for instance).
    #[error("model call failed: {0}")]
    Other(String),
}

impl ModelCallError {
    /// Whether trying again may help: 408/429/5xx, timeouts, dropped
    /// connections and malformed answers (often a proxy cutting a body).
    pub fn is_retryable(&self) -> bool {
        match self {
            ModelCallError::Status { status, .. } => {
                *status == 408 || *status == 429 || *status >= 500
            }
            ModelCallError::Timeout(_)
            | ModelCallError::Connection(_)
            | ModelCallError::Malformed(_) => true,
            ModelCallError::PromptTooLong(_) | ModelCallError::Other(_) => false,
        }
    }
}

/// Why a model turn's token trace cannot be trained on.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum TraceError {
    /// The model returned no token trace (an endpoint that answers with
    /// text only).
    #[error("the model turn has no token trace")]
    Missing,
    /// The trace has no prompt tokens to condition on.
    #[error("the token trace has no prompt tokens")]
    EmptyPrompt,
    /// The sampler did not report one logprob per completion token.
    #[error("the token trace has {logprobs} logprobs for {tokens} completion tokens")]
    LogprobCount {
        /// Logprobs reported.
        logprobs: usize,
        /// Completion tokens.
        tokens: usize,
    },
}

/// What [`crate::Loader::load`] tried for an unknown name, and the likely fix:
/// `temper init` puts environments under `envs/`, so `my-task` typed at the
/// lab root means `envs/my-task`.
fn unknown_hint(spec: &str) -> String {
    let cwd = std::env::current_dir()
        .map(|d| d.display().to_string())
        .unwrap_or_else(|_| ".".into());
    let tried = format!(
        "not a built-in ({}), and there is no {spec}/env.toml in {cwd}",
        crate::BUILTIN_ENVS.join(", ")
    );
    let under_envs = std::path::Path::new("envs").join(spec);
    if under_envs.join("env.toml").is_file() {
        format!("{tried}; did you mean `{}`?", under_envs.display())
    } else {
        tried
    }
}
