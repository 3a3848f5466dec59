//! `terminal`: a built-in multi-turn shell agent over any OpenAI-compatible
//! endpoint, in the spirit of Terminus.
//!
//! Each turn the model sees the conversation so far and answers with one
//! fenced ```` ```bash ```` block; the block runs in the trial's sandbox
//! session (in the task's workdir, files persisting between turns) and its
//! output, cut to [`TerminalConfig::max_output_bytes`], comes back as the
//! next user message. The model ends the episode by answering
//! `TASK_COMPLETE` without a block. A plain-text protocol rather than tool
//! calls, so any chat model can drive it. Budgets: turns, total tokens
//! (prompt + completion as the endpoint reports them), and the task's
//! agent timeout, which also bounds every command and model call.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use serde_json::{json, Map, Value};
use temper_env::openai::{OpenAiChatModel, RetryPolicy};
use temper_env::{ChatModel, ChatRequest, Message, SamplingArgs};

use crate::agent::{
    failure_of, render_output, sandbox_failure, Agent, AgentContext, AgentFailure, AgentOutcome,
};
use crate::atif::{Metrics, Step, Trajectory};
use crate::capture::Episode;
use crate::job::AgentSpec;
use crate::TaskError;

/// The word that ends an episode.
pub const DONE: &str = "TASK_COMPLETE";

/// Settings of the terminal agent.
#[derive(Debug, Clone)]
pub struct TerminalConfig {
    /// `http://host:port/v1`.
    pub base_url: String,
    /// Model name.
    pub model: String,
    /// Bearer key.
    pub api_key: Option<String>,
    /// Most model turns.
    pub max_turns: u32,
    /// Most prompt + completion tokens over the episode.
    pub max_total_tokens: Option<u64>,
    /// Completion tokens per turn.
    pub max_tokens_per_turn: usize,
    /// Sampling temperature.
    pub temperature: f64,
    /// Most seconds one command may run (also capped by the deadline).
    pub command_timeout: Duration,
    /// Bytes of a command's output shown to the model (head and tail kept).
    pub max_output_bytes: usize,
    /// Token capture: each trial calls a fresh episode's base URL on the
    /// `temper serve` at `base_url`; its records land in
    /// `agent/tokens.jsonl` and fill the steps' token slots.
    pub capture: bool,
}

impl TerminalConfig {
    /// From a job's agent spec.
    pub fn from_spec(spec: &AgentSpec, api_key: Option<String>) -> Result<Self, TaskError> {
        let base_url = spec.base_url.clone().ok_or_else(|| {
            TaskError::Invalid("agent terminal needs an endpoint (-b URL)".into())
        })?;
        let model = spec
            .model
            .clone()
            .ok_or_else(|| TaskError::Invalid("agent terminal needs a model (-m NAME)".into()))?;
        Ok(TerminalConfig {
            base_url,
            model,
            api_key,
            max_turns: spec.max_turns.unwrap_or(30),
            max_total_tokens: spec.max_total_tokens,
            max_tokens_per_turn: spec.max_tokens_per_turn.unwrap_or(1024),
            temperature: spec.temperature.unwrap_or(0.7),
            command_timeout: Duration::from_secs(120),
            max_output_bytes: 8192,
            capture: spec.capture,
        })
    }
}

/// The agent.
pub struct Terminal {
    config: TerminalConfig,
    model: Arc<dyn ChatModel>,
    runtime: tokio::runtime::Handle,
}

impl std::fmt::Debug for Terminal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Terminal")
            .field("config", &self.config.model)
            .finish_non_exhaustive()
    }
}

impl Terminal {
    /// An agent calling `config.base_url`; model calls run on `runtime`.
    pub fn new(config: TerminalConfig, runtime: tokio::runtime::Handle) -> Result<Self, TaskError> {
        let model = http_model(&config, &config.base_url, config.api_key.clone())?;
        Ok(Self::with_model(config, model, runtime))
    }

    /// An agent on any [`ChatModel`] (an in-process sampler, for RL);
    /// `config.base_url` and `api_key` are then unused.
    pub fn with_model(
        config: TerminalConfig,
        model: Arc<dyn ChatModel>,
        runtime: tokio::runtime::Handle,
    ) -> Self {
        Terminal {
            config,
            model,
            runtime,
        }
    }
}

/// The OpenAI client of `config` at `base_url` with `api_key`.
fn http_model(
    config: &TerminalConfig,
    base_url: &str,
    api_key: Option<String>,
) -> Result<Arc<dyn ChatModel>, TaskError> {
    let mut model = OpenAiChatModel::new(base_url, &config.model, api_key)
        .map_err(|e| TaskError::Invalid(format!("endpoint {base_url}: {e}")))?;
    model.retry = RetryPolicy {
        max_retries: 2,
        ..RetryPolicy::default()
    };
    Ok(Arc::new(model))
}

/// The system prompt.
pub fn system_prompt(workdir: &str, command_timeout: Duration) -> String {
    format!(
        "You are an agent solving a task in a Linux shell (bash, coreutils, python3; no \
         internet). Your working directory is {workdir}; files you write persist between turns.\n\
         Each turn, answer with exactly one fenced code block:\n```bash\n<commands>\n```\n\
         It runs non-interactively (no editors, no prompts) with a {}-second limit, and you will \
         see its output and exit code. Background processes do not survive a turn.\n\
         When the task is done, answer with {DONE} and no code block.",
        command_timeout.as_secs()
    )
}

/// The last ```` ```bash ````/```` ```sh ````/```` ``` ```` block of `text`.
pub fn extract_command(text: &str) -> Option<String> {
    let mut found = None;
    let mut rest = text;
    while let Some(start) = rest.find("```") {
        let after = &rest[start + 3..];
        let Some(nl) = after.find('\n') else { break };
        let lang = after[..nl].trim();
        let body = &after[nl + 1..];
        let Some(end) = body.find("```") else { break };
        if matches!(lang, "" | "bash" | "sh" | "shell" | "console") {
            let cmd = body[..end].trim();
            if !cmd.is_empty() {
                found = Some(cmd.to_string());
            }
        }
        rest = &body[end + 3..];
    }
    found
}

/// Head and tail of `s` within `max` bytes.
fn clip(s: &str, max: usize) -> String {
    if s.len() <= max {
        return s.to_string();
    }
    let head_end = (0..=max / 4)
        .rev()
        .find(|i| s.is_char_boundary(*i))
        .unwrap_or(0);
    let tail_start = (s.len() - (max - max / 4)..s.len())
        .find(|i| s.is_char_boundary(*i))
        .unwrap_or(s.len());
    format!(
        "{}\n[... {} bytes omitted ...]\n{}",
        &s[..head_end],
        tail_start - head_end,
        &s[tail_start..]
    )
}

impl Agent for Terminal {
    fn name(&self) -> &str {
        "terminal"
    }
    fn model_name(&self) -> Option<String> {
        Some(self.config.model.clone())
    }
    fn settings(&self) -> Map<String, Value> {
        let c = &self.config;
        json!({
            "max_turns": c.max_turns,
            "max_total_tokens": c.max_total_tokens,
            "max_tokens_per_turn": c.max_tokens_per_turn,
            "temperature": c.temperature,
            "command_timeout_sec": c.command_timeout.as_secs_f64(),
        })
        .as_object()
        .cloned()
        .unwrap_or_default()
    }

    fn run(&self, ctx: &AgentContext<'_>) -> AgentOutcome {
        let c = &self.config;
        let mut traj = Trajectory::new(ctx.trial_name, self.atif_agent(), &ctx.task.instruction);
        // Token capture: this trial's calls go to a fresh episode's URL.
        let episode = match c
            .capture
            .then(|| Episode::create(&c.base_url, c.api_key.as_deref(), &self.runtime))
        {
            None => None,
            Some(Ok(e)) => Some(e),
            Some(Err(e)) => return setup_failure(traj, e),
        };
        let model = match &episode {
            None => self.model.clone(),
            // The episode's token opens its routes (see `crate::capture`).
            Some(e) => match http_model(c, &e.base_url(), Some(e.token().to_string())) {
                Ok(m) => m,
                Err(e) => return setup_failure(traj, e),
            },
        };
        let system = system_prompt(&ctx.env.workdir, c.command_timeout);
        let mut messages = vec![
            Message::system(system),
            Message::user(ctx.task.instruction.clone()),
        ];
        let (mut prompt_tokens, mut completion_tokens) = (0u64, 0u64);
        let mut turns = 0u32;
        let mut failure: Option<AgentFailure> = None;
        let stop_reason;
        loop {
            if turns >= c.max_turns {
                stop_reason = "max_turns";
                break;
            }
            if c.max_total_tokens
                .is_some_and(|m| prompt_tokens + completion_tokens >= m)
            {
                stop_reason = "max_total_tokens";
                break;
            }
            let left = ctx.remaining();
            if left.is_zero() {
                stop_reason = "timeout";
                failure = Some(timeout_failure());
                break;
            }
            turns += 1;
            let req = ChatRequest {
                messages: messages.clone(),
                tools: None,
                sampling: SamplingArgs {
                    max_tokens: c.max_tokens_per_turn,
                    temperature: c.temperature,
                    ..SamplingArgs::default()
                },
            };
            // The timer must be created inside the runtime.
            let call = self
                .runtime
                .block_on(async { tokio::time::timeout(left, model.chat(req)).await });
            let turn = match call {
                Err(_) => {
                    stop_reason = "timeout";
                    failure = Some(timeout_failure());
                    break;
                }
                Ok(Err(e)) => {
                    stop_reason = "model_error";
                    failure = Some(AgentFailure {
                        kind: "ModelCallError".into(),
                        message: e.to_string(),
                        env_alive: true,
                    });
                    break;
                }
                Ok(Ok(t)) => t,
            };
            prompt_tokens += turn.usage.prompt_tokens;
            completion_tokens += turn.usage.completion_tokens;
            let text = turn.message.text();
            let mut step = Step::new("agent", text.clone());
            step.model_name = Some(c.model.clone());
            step.metrics = Some(Metrics {
                prompt_tokens: Some(turn.usage.prompt_tokens),
                completion_tokens: Some(turn.usage.completion_tokens),
                prompt_token_ids: turn.trace.as_ref().map(|t| t.prompt_ids.clone()),
                completion_token_ids: turn.trace.as_ref().map(|t| t.completion_ids.clone()),
                logprobs: turn.trace.as_ref().map(|t| t.logprobs.clone()),
                extra: turn.trace.as_ref().map(|t| {
                    json!({"policy_version": t.version, "temperature": t.temperature})
                        .as_object()
                        .cloned()
                        .unwrap_or_default()
                }),
            });
            messages.push(Message::assistant(text.clone()));
            let Some(command) = extract_command(&text) else {
                traj.push(step);
                if text.contains(DONE) {
                    stop_reason = "task_complete";
                    break;
                }
                messages.push(Message::user(format!(
                    "No ```bash block found. Answer with one ```bash block, or {DONE} when done."
                )));
                continue;
            };
            let timeout = c.command_timeout.min(ctx.remaining());
            let at_deadline = timeout < c.command_timeout;
            let r = match ctx.env.exec(&command, None, &BTreeMap::new(), timeout) {
                Ok(r) => r,
                Err(e) => {
                    traj.push(step);
                    stop_reason = "sandbox_error";
                    failure = Some(sandbox_failure(&e));
                    break;
                }
            };
            let shown = clip(&render_output(&r), c.max_output_bytes);
            step.bash_call(format!("call_{turns}"), &command, shown.clone());
            traj.push(step);
            if let Some(f) = failure_of(&r, at_deadline) {
                stop_reason = if f.env_alive {
                    "timeout"
                } else {
                    "memory_limit"
                };
                failure = Some(f);
                break;
            }
            messages.push(Message::user(format!("Output:\n{shown}")));
        }
        traj.finish();
        let mut metadata = Map::new();
        metadata.insert("turns".into(), json!(turns));
        metadata.insert("stop_reason".into(), json!(stop_reason));
        if let Some(e) = &episode {
            crate::capture::finish(e, &self.runtime, ctx.logs_dir, &mut traj, &mut metadata);
        }
        let _ = std::fs::write(
            ctx.logs_dir.join("messages.json"),
            serde_json::to_string_pretty(&messages).unwrap_or_default(),
        );
        AgentOutcome {
            trajectory: traj,
            n_input_tokens: Some(prompt_tokens),
            n_output_tokens: Some(completion_tokens),
            metadata,
            failure,
        }
    }
}

fn setup_failure(mut traj: Trajectory, e: TaskError) -> AgentOutcome {
    traj.finish();
    AgentOutcome {
        trajectory: traj,
        n_input_tokens: None,
        n_output_tokens: None,
        metadata: Map::new(),
        failure: Some(AgentFailure {
            kind: "AgentSetupError".into(),
            message: e.to_string(),
            env_alive: true,
        }),
    }
}

fn timeout_failure() -> AgentFailure {
    AgentFailure {
        kind: "AgentTimeoutError".into(),
        message: "the agent ran past [agent] timeout_sec".into(),
        env_alive: true,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_last_shell_block_is_the_command() {
        let t =
            "Let me look.\n```bash\nls\n```\nthen\n```python\nprint(1)\n```\n```sh\ncat a.txt\n```";
        assert_eq!(extract_command(t).as_deref(), Some("cat a.txt"));
        assert_eq!(extract_command("TASK_COMPLETE"), None);
        assert_eq!(extract_command("```bash\n\n```"), None);
        assert_eq!(
            extract_command("```\necho hi\n```").as_deref(),
            Some("echo hi")
        );
    }

    #[test]
    fn long_output_keeps_head_and_tail() {
        let s: String = (0..1000).map(|i| format!("{i}\n")).collect();
        let c = clip(&s, 200);
        assert!(c.starts_with("0\n1\n"));
        assert!(c.ends_with("999\n"));
        assert!(c.len() < 260);
    }
}
