//! Harnesses: how a rollout talks to the model.
//!
//! - single-turn: one model call;
//! - multi-turn: after each model turn an [`EnvResponder`] answers, until
//!   it says done, the turn limit, the completion-token budget, or an error;
//! - tool-use: OpenAI tool calls run by [`Tool`]s, results fed back as
//!   `tool` messages, until a turn calls no tool or the turn limit.
//!
//! Failures never escape: a model error ends the rollout with `error` and
//! stop condition `has_error`; a tool error is fed back to the model as the
//! tool's result.

use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use serde_json::Value;

use crate::{
    stop, ChatModel, ChatRequest, Message, ModelCallError, ModelTurn, Rollout, Row, SamplingArgs,
};

/// The environment's side of a multi-turn conversation.
///
/// ```
/// use async_trait::async_trait;
/// use temper_env::{EnvResponder, EnvResponse, Message, Row};
///
/// /// Says "again" once, then ends the episode.
/// struct Again;
///
/// #[async_trait]
/// impl EnvResponder for Again {
///     async fn respond(&self, _row: &Row, messages: &[Message], _state: &mut serde_json::Value)
///         -> Result<EnvResponse, String> {
///         let turns = messages.iter().filter(|m| m.role == "assistant").count();
///         Ok(EnvResponse { messages: vec![Message::user("again")], done: turns >= 2 })
///     }
/// }
/// ```
#[async_trait]
pub trait EnvResponder: Send + Sync {
    /// The state a rollout starts with (kept on [`Rollout::state`]).
    fn initial_state(&self, _row: &Row) -> Value {
        Value::Null
    }
    /// Answer the last assistant turn in `messages` (prompt included).
    /// An `Err` ends the rollout with `has_error`.
    async fn respond(
        &self,
        row: &Row,
        messages: &[Message],
        state: &mut Value,
    ) -> Result<EnvResponse, String>;
}

/// The environment's answer to one model turn.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct EnvResponse {
    /// Messages to append (usually one `user` message).
    pub messages: Vec<Message>,
    /// The episode is over.
    pub done: bool,
}

/// A tool the model may call.
#[async_trait]
pub trait Tool: Send + Sync {
    /// The function name.
    fn name(&self) -> &str;
    /// The OpenAI tool schema: `{"type":"function","function":{name,
    /// description, parameters}}`.
    fn schema(&self) -> Value;
    /// Run with the parsed JSON arguments; `Err` is fed back to the model.
    async fn call(&self, args: Value) -> Result<String, String>;
    /// The service it calls, if any (checked before a run).
    fn service(&self) -> Option<Arc<dyn crate::Service>> {
        None
    }
}

/// How a rollout talks to the model.
#[derive(Clone)]
pub enum Harness {
    /// One model call.
    SingleTurn,
    /// Model and environment take turns.
    MultiTurn {
        /// The environment side.
        responder: Arc<dyn EnvResponder>,
        /// Most model turns.
        max_turns: usize,
        /// Most completion tokens over the rollout (`None` = no budget).
        max_total_tokens: Option<u64>,
    },
    /// The model calls tools.
    Tools {
        /// The tools offered.
        tools: Vec<Arc<dyn Tool>>,
        /// Most model turns.
        max_turns: usize,
        /// Per-call timeout.
        tool_timeout: Duration,
    },
}

impl std::fmt::Debug for Harness {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Harness::SingleTurn => write!(f, "SingleTurn"),
            Harness::MultiTurn { max_turns, .. } => write!(f, "MultiTurn(max_turns={max_turns})"),
            Harness::Tools { tools, .. } => write!(
                f,
                "Tools({})",
                tools.iter().map(|t| t.name()).collect::<Vec<_>>().join(",")
            ),
        }
    }
}

/// Accumulates a rollout as turns happen.
struct Recorder {
    rollout: Rollout,
    messages: Vec<Message>,
}

impl Recorder {
    fn new(row: &Row, state: Value) -> Self {
        Recorder {
            rollout: Rollout {
                state,
                ..Rollout::default()
            },
            messages: row.prompt.clone(),
        }
    }
    fn push(&mut self, m: Message) {
        self.messages.push(m.clone());
        self.rollout.completion.push(m);
    }
    fn model_turn(&mut self, turn: ModelTurn) {
        self.rollout.token_usage.input_tokens += turn.usage.prompt_tokens;
        self.rollout.token_usage.output_tokens += turn.usage.completion_tokens;
        if turn.finish_reason == "length" {
            self.rollout.is_truncated = true;
        }
        self.push(turn.message.clone());
        self.rollout.model_turns.push(turn);
    }
    fn finish(mut self, condition: &str, started: Instant) -> Rollout {
        self.rollout.is_completed = true;
        self.rollout.stop_condition = Some(condition.to_string());
        self.timing(started)
    }
    fn fail(mut self, error: String, condition: &str, started: Instant) -> Rollout {
        self.rollout.is_completed = false;
        self.rollout.error = Some(error);
        self.rollout.stop_condition = Some(condition.to_string());
        self.timing(started)
    }
    fn model_error(self, e: ModelCallError, started: Instant) -> Rollout {
        let cond = match e {
            ModelCallError::PromptTooLong(_) => stop::PROMPT_TOO_LONG,
            _ => stop::ERROR,
        };
        self.fail(e.to_string(), cond, started)
    }
    fn timing(mut self, started: Instant) -> Rollout {
        let ms = started.elapsed().as_secs_f64() * 1e3;
        self.rollout.timing.generation_ms = ms;
        self.rollout.timing.total_ms = ms;
        self.rollout
    }
}

impl Harness {
    /// The services its tools call.
    pub fn services(&self) -> Vec<Arc<dyn crate::Service>> {
        match self {
            Harness::Tools { tools, .. } => tools.iter().filter_map(|t| t.service()).collect(),
            _ => Vec::new(),
        }
    }

    /// Run one rollout of `row`.
    pub async fn run(&self, model: &dyn ChatModel, row: &Row, sampling: &SamplingArgs) -> Rollout {
        let started = Instant::now();
        match self {
            Harness::SingleTurn => {
                let mut rec = Recorder::new(row, Value::Null);
                let req = ChatRequest {
                    messages: rec.messages.clone(),
                    tools: None,
                    sampling: sampling.clone(),
                };
                match model.chat(req).await {
                    Ok(turn) => {
                        rec.model_turn(turn);
                        // The one answer is the normal end, unless the
                        // token limit cut it.
                        let cond = if rec.rollout.is_truncated {
                            stop::MAX_TOKENS
                        } else {
                            stop::COMPLETED
                        };
                        rec.finish(cond, started)
                    }
                    Err(e) => rec.model_error(e, started),
                }
            }
            Harness::MultiTurn {
                responder,
                max_turns,
                max_total_tokens,
            } => {
                let mut rec = Recorder::new(row, responder.initial_state(row));
                let mut turns = 0usize;
                loop {
                    let mut turn_sampling = sampling.clone();
                    if let Some(budget) = max_total_tokens {
                        let used = rec.rollout.token_usage.output_tokens;
                        if used >= *budget {
                            rec.rollout.is_truncated = true;
                            return rec.finish(stop::MAX_TOKENS, started);
                        }
                        turn_sampling.max_tokens =
                            turn_sampling.max_tokens.min((budget - used) as usize);
                    }
                    let req = ChatRequest {
                        messages: rec.messages.clone(),
                        tools: None,
                        sampling: turn_sampling,
                    };
                    match model.chat(req).await {
                        Ok(turn) => rec.model_turn(turn),
                        Err(e) => return rec.model_error(e, started),
                    }
                    turns += 1;
                    let mut state = std::mem::take(&mut rec.rollout.state);
                    let resp = responder.respond(row, &rec.messages, &mut state).await;
                    rec.rollout.state = state;
                    match resp {
                        Err(e) => {
                            return rec.fail(format!("environment: {e}"), stop::ERROR, started)
                        }
                        Ok(resp) if resp.done => {
                            for m in resp.messages {
                                rec.push(m);
                            }
                            return rec.finish(stop::ENV_DONE, started);
                        }
                        Ok(resp) => {
                            if turns >= *max_turns {
                                return rec.finish(stop::MAX_TURNS, started);
                            }
                            for m in resp.messages {
                                rec.push(m);
                            }
                        }
                    }
                }
            }
            Harness::Tools {
                tools,
                max_turns,
                tool_timeout,
            } => {
                let mut rec = Recorder::new(row, Value::Null);
                let schemas: Vec<Value> = tools.iter().map(|t| t.schema()).collect();
                let mut turns = 0usize;
                loop {
                    let req = ChatRequest {
                        messages: rec.messages.clone(),
                        tools: Some(schemas.clone()),
                        sampling: sampling.clone(),
                    };
                    let turn = match model.chat(req).await {
                        Ok(turn) => turn,
                        Err(e) => return rec.model_error(e, started),
                    };
                    let calls = turn.message.tool_calls.clone().unwrap_or_default();
                    rec.model_turn(turn);
                    turns += 1;
                    if calls.is_empty() {
                        return rec.finish(stop::NO_TOOLS, started);
                    }
                    for call in calls {
                        let result = run_tool(
                            tools,
                            &call.function.name,
                            &call.function.arguments,
                            *tool_timeout,
                        )
                        .await;
                        rec.push(Message::tool(call.id.clone(), result));
                    }
                    if turns >= *max_turns {
                        return rec.finish(stop::MAX_TURNS, started);
                    }
                }
            }
        }
    }
}

/// Find, parse, run with a timeout; every failure becomes an `Error: …`
/// result for the model to read.
async fn run_tool(
    tools: &[Arc<dyn Tool>],
    name: &str,
    arguments: &str,
    timeout: Duration,
) -> String {
    let Some(tool) = tools.iter().find(|t| t.name() == name) else {
        let names: Vec<&str> = tools.iter().map(|t| t.name()).collect();
        return format!(
            "Error: unknown tool `{name}`; available: {}",
            names.join(", ")
        );
    };
    let args: Value = if arguments.trim().is_empty() {
        Value::Object(Default::default())
    } else {
        match serde_json::from_str(arguments) {
            Ok(v) => v,
            Err(e) => return format!("Error: arguments are not valid JSON: {e}"),
        }
    };
    match tokio::time::timeout(timeout, tool.call(args)).await {
        Ok(Ok(out)) => out,
        Ok(Err(e)) => format!("Error: {e}"),
        Err(_) => format!(
            "Error: tool `{name}` timed out after {:.1}s",
            timeout.as_secs_f64()
        ),
    }
}

/// `calculate(expression)`: evaluates arithmetic (`+ - * / ^`, parentheses,
/// `sqrt`, fractions).
pub struct Calculator;

#[async_trait]
impl Tool for Calculator {
    fn name(&self) -> &str {
        "calculate"
    }
    fn schema(&self) -> Value {
        serde_json::json!({
            "type": "function",
            "function": {
                "name": "calculate",
                "description": "Evaluate an arithmetic expression, e.g. \"(12 + 3) * 4\".",
                "parameters": {
                    "type": "object",
                    "properties": {"expression": {"type": "string", "description": "The expression."}},
                    "required": ["expression"]
                }
            }
        })
    }
    async fn call(&self, args: Value) -> Result<String, String> {
        let expr = args
            .get("expression")
            .and_then(Value::as_str)
            .ok_or("missing string argument `expression`")?;
        let v = crate::math::evaluate(expr).ok_or_else(|| format!("cannot evaluate `{expr}`"))?;
        if !v.is_finite() {
            return Err(format!("`{expr}` is not a finite number"));
        }
        Ok(format_number(v))
    }
}

/// An integer when it is one, else a short decimal.
pub fn format_number(v: f64) -> String {
    if v.fract() == 0.0 && v.abs() < 1e15 {
        format!("{}", v as i64)
    } else {
        let s = format!("{v:.10}");
        s.trim_end_matches('0').trim_end_matches('.').to_string()
    }
}

/// `python(code)`: runs Python in the sandbox service and returns its
/// stdout and stderr.
pub struct PythonTool {
    sandbox: crate::SandboxService,
    requirements: Vec<String>,
}

impl PythonTool {
    /// A tool on this sandbox service.
    pub fn new(sandbox: crate::SandboxService) -> Self {
        PythonTool {
            sandbox,
            requirements: Vec::new(),
        }
    }

    /// Run with these Python packages (`[sandbox] requirements`).
    pub fn with_requirements(mut self, requirements: Vec<String>) -> Self {
        self.requirements = requirements;
        self
    }
}

#[async_trait]
impl Tool for PythonTool {
    fn name(&self) -> &str {
        "python"
    }
    fn service(&self) -> Option<Arc<dyn crate::Service>> {
        Some(Arc::new(self.sandbox.clone()))
    }
    fn schema(&self) -> Value {
        serde_json::json!({
            "type": "function",
            "function": {
                "name": "python",
                "description": "Run a Python program and return what it prints.",
                "parameters": {
                    "type": "object",
                    "properties": {"code": {"type": "string"}},
                    "required": ["code"]
                }
            }
        })
    }
    async fn call(&self, args: Value) -> Result<String, String> {
        let code = args
            .get("code")
            .and_then(Value::as_str)
            .ok_or("missing string argument `code`")?;
        let req = temper_sandbox::service::RunCodeRequest {
            code: code.to_string(),
            language: "python".into(),
            stdin: String::new(),
            files: Default::default(),
            run_timeout: Some(10.0),
            compile_timeout: None,
            memory_limit_mb: None,
            fetch_files: Vec::new(),
            requirements: self.requirements.clone(),
        };
        let resp = self
            .sandbox
            .client()
            .run_code(&req)
            .await
            .map_err(|e| e.to_string())?;
        let run = resp.run_result.ok_or(resp.message)?;
        Ok(format!("{}{}", run.stdout, run.stderr))
    }
}
