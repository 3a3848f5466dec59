//! The data that flows between an environment, a harness and a model:
//! OpenAI chat messages, sampling arguments, rows, rollouts and scores.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::error::TraceError;

/// An OpenAI chat message. Unknown fields (`reasoning_content`, `refusal`,
/// ...) are kept in `extra`, so a message read from OpenAI JSON serializes
/// back to the same JSON.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Message {
    /// `system`, `user`, `assistant` or `tool`.
    pub role: String,
    /// Text, or a list of content parts; `None` for an assistant turn that
    /// only calls tools.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub content: Option<Content>,
    /// Tool calls of an assistant turn.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<ToolCall>>,
    /// The call a `tool` message answers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    /// Participant or tool name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// Fields this type does not model, kept verbatim.
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

/// Message content: a string or a list of OpenAI content parts.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Content {
    /// Plain text.
    Text(String),
    /// Content parts (`{"type":"text","text":...}`, images, ...).
    Parts(Vec<Value>),
}

impl Message {
    /// A message with text content.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Message {
            role: role.into(),
            content: Some(Content::Text(content.into())),
            tool_calls: None,
            tool_call_id: None,
            name: None,
            extra: Map::new(),
        }
    }
    /// A `system` message.
    pub fn system(content: impl Into<String>) -> Self {
        Message::new("system", content)
    }
    /// A `user` message.
    pub fn user(content: impl Into<String>) -> Self {
        Message::new("user", content)
    }
    /// An `assistant` message.
    pub fn assistant(content: impl Into<String>) -> Self {
        Message::new("assistant", content)
    }
    /// A `tool` message answering `tool_call_id`.
    pub fn tool(tool_call_id: impl Into<String>, content: impl Into<String>) -> Self {
        Message {
            tool_call_id: Some(tool_call_id.into()),
            ..Message::new("tool", content)
        }
    }
    /// The text of the content: the string, or the text parts joined.
    pub fn text(&self) -> String {
        match &self.content {
            None => String::new(),
            Some(Content::Text(s)) => s.clone(),
            Some(Content::Parts(parts)) => parts
                .iter()
                .filter_map(|p| p.get("text").and_then(Value::as_str))
                .collect::<Vec<_>>()
                .join(""),
        }
    }
}

/// One tool call in OpenAI format.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ToolCall {
    /// The call's id, echoed by the `tool` message that answers it.
    pub id: String,
    /// Always `function`.
    #[serde(rename = "type", default = "function_type")]
    pub kind: String,
    /// The function and its JSON-encoded arguments.
    pub function: FunctionCall,
}

fn function_type() -> String {
    "function".into()
}

/// The function part of a tool call.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FunctionCall {
    /// Tool name.
    pub name: String,
    /// Arguments as a JSON string (as the model wrote them: may be invalid).
    #[serde(default)]
    pub arguments: String,
}

/// Token counts of one model call (OpenAI `usage`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Usage {
    /// Prompt tokens.
    #[serde(default)]
    pub prompt_tokens: u64,
    /// Completion tokens.
    #[serde(default)]
    pub completion_tokens: u64,
}

/// Sampling arguments of a chat request.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SamplingArgs {
    /// Most completion tokens per model call.
    pub max_tokens: usize,
    /// Sampling temperature.
    pub temperature: f64,
    /// Nucleus sampling mass.
    pub top_p: f64,
    /// Seed, when the endpoint honours one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seed: Option<u64>,
    /// Stop strings.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub stop: Vec<String>,
    /// Token ids that end a sample (vLLM's `stop_token_ids`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub stop_token_ids: Vec<u32>,
    /// Drop tokens below `min_p` × the top probability.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_p: Option<f64>,
    /// OpenAI presence penalty.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub presence_penalty: Option<f64>,
    /// OpenAI frequency penalty.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub frequency_penalty: Option<f64>,
    /// vLLM / HF repetition penalty.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub repetition_penalty: Option<f64>,
    /// Token id → bias added to its logit.
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub logit_bias: std::collections::BTreeMap<u32, f64>,
    /// Anything else, sent verbatim in the request body of a remote
    /// endpoint (`temper eval -S`), which answers 400 to what it lacks.
    #[serde(default, flatten)]
    pub extra: Map<String, Value>,
}

impl Default for SamplingArgs {
    fn default() -> Self {
        SamplingArgs {
            max_tokens: 512,
            temperature: 1.0,
            top_p: 1.0,
            seed: None,
            stop: Vec::new(),
            stop_token_ids: Vec::new(),
            min_p: None,
            presence_penalty: None,
            frequency_penalty: None,
            repetition_penalty: None,
            logit_bias: Default::default(),
            extra: Map::new(),
        }
    }
}

/// A warning when `n` rollouts of one prompt are sampled greedily: they
/// are identical, so pass@k equals pass@1 and group-relative advantages
/// are all zero.
pub fn greedy_group_warning(n: usize, temperature: f64) -> Option<String> {
    (n > 1 && temperature <= 0.0).then(|| {
        format!(
            "{n} rollouts per prompt at temperature {temperature}: greedy decoding makes them identical \
             (pass@k = pass@1, zero group advantages); use temperature > 0 or 1 rollout"
        )
    })
}

/// One request to a chat model.
#[derive(Debug, Clone, PartialEq)]
pub struct ChatRequest {
    /// The conversation so far.
    pub messages: Vec<Message>,
    /// OpenAI tool schemas (`{"type":"function","function":{...}}`).
    pub tools: Option<Vec<Value>>,
    /// Sampling arguments.
    pub sampling: SamplingArgs,
}

/// One model answer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelTurn {
    /// The assistant message, possibly with tool calls.
    pub message: Message,
    /// `stop`, `length`, `tool_calls`, ...
    pub finish_reason: String,
    /// Token counts.
    pub usage: Usage,
    /// The tokens as sampled, when the model is a policy being trained
    /// (`None` for an endpoint that answers with text only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub trace: Option<TokenTrace>,
}

impl ModelTurn {
    /// The turn's trace, if it holds what training needs; otherwise why not.
    pub fn trainable_trace(&self) -> Result<&TokenTrace, TraceError> {
        let trace = self.trace.as_ref().ok_or(TraceError::Missing)?;
        trace.check()?;
        Ok(trace)
    }
}

/// The tokens of one model turn exactly as the sampler drew them: what a
/// trainer needs to score the turn again (the ids are trained on as
/// sampled — no re-tokenization drift).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TokenTrace {
    /// The rendered prompt's token ids.
    pub prompt_ids: Vec<u32>,
    /// The sampled token ids (a final stop token included).
    pub completion_ids: Vec<u32>,
    /// The sampler's logprob of each completion token.
    pub logprobs: Vec<f32>,
    /// Policy version (optimizer steps) of the weights that sampled it.
    pub version: u64,
    /// Sampling temperature the completion was drawn at (0 = greedy). The
    /// trainer scores the completion at the same temperature, so the
    /// importance ratio compares the distribution the sampler drew from.
    pub temperature: f64,
}

impl TokenTrace {
    /// The temperature a learner scores this turn at: the sampling
    /// temperature, or 1 for greedy turns (a sampler reports greedy
    /// logprobs at temperature 1).
    pub fn scoring_temperature(&self) -> f64 {
        if self.temperature > 0.0 {
            self.temperature
        } else {
            1.0
        }
    }

    /// Check that the trace holds what training needs: a prompt to
    /// condition on and one logprob per completion token.
    ///
    /// ```
    /// use temper_env::{TokenTrace, TraceError};
    ///
    /// let mut t = TokenTrace {
    ///     prompt_ids: vec![1, 5],
    ///     completion_ids: vec![7, 2],
    ///     logprobs: vec![-0.3, -1.2],
    ///     version: 0,
    ///     temperature: 1.0,
    /// };
    /// assert_eq!(t.check(), Ok(()));
    /// t.logprobs.pop(); // a sampler that lost a logprob
    /// assert_eq!(t.check(), Err(TraceError::LogprobCount { logprobs: 1, tokens: 2 }));
    /// ```
    pub fn check(&self) -> Result<(), TraceError> {
        if self.prompt_ids.is_empty() {
            return Err(TraceError::EmptyPrompt);
        }
        if self.logprobs.len() != self.completion_ids.len() {
            return Err(TraceError::LogprobCount {
                logprobs: self.logprobs.len(),
                tokens: self.completion_ids.len(),
            });
        }
        Ok(())
    }
}

/// Which half of an environment's rows: the two are disjoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Split {
    /// Rows to train on.
    Train,
    /// Rows to evaluate on (never produced for `Train`).
    Eval,
}

impl Split {
    /// `train` or `eval`.
    pub fn as_str(self) -> &'static str {
        match self {
            Split::Train => "train",
            Split::Eval => "eval",
        }
    }
}

/// One dataset row, ready to prompt with.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Row {
    /// Index of the row in its split.
    pub example_id: u64,
    /// Chat messages including the system prompt and few-shot turns.
    pub prompt: Vec<Message>,
    /// Reference answer.
    #[serde(default)]
    pub answer: Option<String>,
    /// Task data for the harness and the rubric (a JSON object).
    #[serde(default)]
    pub info: Value,
}

/// Token totals of a rollout, in verifiers' field names.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct TokenUsage {
    /// Prompt tokens summed over the model calls.
    pub input_tokens: u64,
    /// Completion tokens summed over the model calls.
    pub output_tokens: u64,
}

/// Wall-clock times of a rollout, in milliseconds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Timing {
    /// Time in the harness (model calls, tools, environment responses).
    pub generation_ms: f64,
    /// Time in the rubric.
    pub scoring_ms: f64,
    /// Both.
    pub total_ms: f64,
}

/// Why a rollout stopped (verifiers' stop-condition names).
pub mod stop {
    /// A single-turn rollout got its one answer: the normal end, not a
    /// limit.
    pub const COMPLETED: &str = "completed";
    /// A multi-turn or tool harness reached its turn limit.
    pub const MAX_TURNS: &str = "max_turns_reached";
    /// The completion-token budget of the rollout is spent.
    pub const MAX_TOKENS: &str = "max_total_completion_tokens_reached";
    /// The environment said the episode is over.
    pub const ENV_DONE: &str = "has_final_env_response";
    /// A tool-use turn made no tool call.
    pub const NO_TOOLS: &str = "no_tools_called";
    /// A model call or the environment failed.
    pub const ERROR: &str = "has_error";
    /// The prompt does not fit the model.
    pub const PROMPT_TOO_LONG: &str = "prompt_too_long";
}

/// The result of running a harness on one row.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Rollout {
    /// Messages after the prompt: assistant turns, tool and environment
    /// responses.
    pub completion: Vec<Message>,
    /// The rollout ran to a normal stop (no error).
    pub is_completed: bool,
    /// The last model turn hit its token limit, or the token budget ran out.
    pub is_truncated: bool,
    /// Why it stopped; see [`stop`].
    pub stop_condition: Option<String>,
    /// The error that ended it, if any.
    pub error: Option<String>,
    /// Token totals.
    pub token_usage: TokenUsage,
    /// Times.
    pub timing: Timing,
    /// Every model answer in order, with its [`TokenTrace`] (token ids,
    /// logprobs) when the model is a trained policy.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub model_turns: Vec<ModelTurn>,
    /// Harness state at the end (for multi-turn environments: their state).
    #[serde(default, skip_serializing_if = "Value::is_null")]
    pub state: Value,
}

impl Rollout {
    /// The text of the last assistant message ("" when there is none).
    pub fn last_assistant_text(&self) -> String {
        last_assistant_text(&self.completion)
    }
}

/// The text of the last assistant message in `messages`.
pub fn last_assistant_text(messages: &[Message]) -> String {
    messages
        .iter()
        .rev()
        .find(|m| m.role == "assistant")
        .map(Message::text)
        .unwrap_or_default()
}

/// The rubric's verdict on one rollout: weighted reward plus named metrics
/// (every reward function's raw score appears among the metrics).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Score {
    /// Σ weight · score.
    pub reward: f64,
    /// Each function's score by name.
    pub metrics: BTreeMap<String, f64>,
    /// Why a reward function could not score this rollout (the first
    /// failure; that function scored 0): a sandbox that refused the key,
    /// a program that crashed. Counted in the summary, never silent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// Milliseconds the rubric spent on this rollout, where it measured
    /// them (a group-wide function's time is shared out evenly);
    /// [`crate::score_and_time`] falls back to the group's time over its
    /// size.
    #[serde(skip)]
    pub scoring_ms: Option<f64>,
}

/// What `temper eval` runs by default on an environment.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EvalDefaults {
    /// Examples.
    pub num_examples: usize,
    /// Rollouts per example.
    pub rollouts_per_example: usize,
    /// Sampling arguments.
    pub sampling: SamplingArgs,
    /// A rollout passes at reward ≥ this (`[eval] pass_threshold`); unset,
    /// see [`crate::pass_threshold`].
    pub pass_threshold: Option<f64>,
}

impl Default for EvalDefaults {
    fn default() -> Self {
        EvalDefaults {
            num_examples: 20,
            rollouts_per_example: 1,
            sampling: SamplingArgs::default(),
            pass_threshold: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn message_round_trips_openai_json() {
        let cases = [
            r#"{"role":"user","content":"hi"}"#,
            r#"{"role":"assistant","content":null,"tool_calls":[{"id":"c1","type":"function","function":{"name":"calc","arguments":"{\"x\":1}"}}]}"#,
            r#"{"role":"tool","content":"2","tool_call_id":"c1"}"#,
            r#"{"role":"user","content":[{"type":"text","text":"a"},{"type":"text","text":"b"}]}"#,
            r#"{"role":"assistant","content":"x","reasoning_content":"because","refusal":null}"#,
        ];
        for case in cases {
            let want: Value = serde_json::from_str(case).unwrap();
            let msg: Message = serde_json::from_str(case).unwrap();
            let mut got = serde_json::to_value(&msg).unwrap();
            // `content: null` is the one field written back as absent.
            if want.get("content") == Some(&Value::Null) {
                got["content"] = Value::Null;
            }
            assert_eq!(
                serde_json::to_string(&got).unwrap().len(),
                serde_json::to_string(&want).unwrap().len(),
                "{case}"
            );
            assert_eq!(got, want, "{case}");
        }
        let parts: Message = serde_json::from_str(cases[3]).unwrap();
        assert_eq!(parts.text(), "ab");
    }

    #[test]
    fn sampling_extra_is_flattened() {
        let s: SamplingArgs = serde_json::from_str(
            r#"{"max_tokens":8,"temperature":0.5,"top_p":1.0,"top_k":5,"min_p":0.1}"#,
        )
        .unwrap();
        assert_eq!(s.extra["top_k"], 5);
        assert_eq!(serde_json::to_value(&s).unwrap()["top_k"], 5);
        // The fields every sampler honours are typed, not extras.
        assert_eq!(s.min_p, Some(0.1));
        assert!(!s.extra.contains_key("min_p"));
        assert_eq!(serde_json::to_value(&s).unwrap()["min_p"], 0.1);
    }
}
