//! ATIF, the Agent Trajectory Interchange Format (Harbor's
//! `agent/trajectory.json`), version 1.5: field names and shapes as in
//! Harbor's trajectory models. `None` fields are omitted, as Harbor writes
//! them (`exclude_none`). Token ids and logprobs go in a step's
//! [`Metrics`], which is where a trainer reads them back.

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

/// The schema version written.
pub const SCHEMA_VERSION: &str = "ATIF-v1.5";

/// A whole trajectory.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Trajectory {
    /// [`SCHEMA_VERSION`].
    pub schema_version: String,
    /// The run's id (the trial name).
    pub session_id: String,
    /// Which agent.
    pub agent: Agent,
    /// The interaction, `step_id` 1, 2, ...
    pub steps: Vec<Step>,
    /// Free text.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub notes: Option<String>,
    /// Totals.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub final_metrics: Option<FinalMetrics>,
    /// Custom root-level data.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub extra: Option<Map<String, Value>>,
}

/// The agent system.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Agent {
    /// Name (`oracle`, `terminal`, ...).
    pub name: String,
    /// Version.
    pub version: String,
    /// Default model.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model_name: Option<String>,
    /// Tool schemas offered to the model.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_definitions: Option<Vec<Value>>,
    /// Agent settings (budgets, ...).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub extra: Option<Map<String, Value>>,
}

/// One step.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Step {
    /// 1-based position.
    pub step_id: u64,
    /// ISO 8601.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timestamp: Option<String>,
    /// `user`, `agent` or `system`.
    pub source: String,
    /// Text (may be empty).
    pub message: String,
    /// Model of an agent step.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model_name: Option<String>,
    /// Actions.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<ToolCall>>,
    /// What the actions returned.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observation: Option<Observation>,
    /// Tokens of the model call behind the step.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metrics: Option<Metrics>,
    /// Custom data.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub extra: Option<Map<String, Value>>,
}

/// One action.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ToolCall {
    /// Unique in the trajectory.
    pub tool_call_id: String,
    /// Tool name (`bash`).
    pub function_name: String,
    /// Arguments.
    pub arguments: Map<String, Value>,
}

/// Results of a step's actions.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Observation {
    /// One per call.
    pub results: Vec<ObservationResult>,
}

/// One action's result.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ObservationResult {
    /// The [`ToolCall::tool_call_id`] it answers.
    pub source_call_id: String,
    /// Output shown to the agent.
    pub content: String,
}

/// Per-step model metrics.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Metrics {
    /// Prompt tokens.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt_tokens: Option<u64>,
    /// Completion tokens.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub completion_tokens: Option<u64>,
    /// Prompt token ids as the sampler saw them (when the endpoint returns
    /// them).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt_token_ids: Option<Vec<u32>>,
    /// Sampled token ids.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub completion_token_ids: Option<Vec<u32>>,
    /// Logprob per completion token.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub logprobs: Option<Vec<f32>>,
    /// Custom metrics (policy version, ...).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub extra: Option<Map<String, Value>>,
}

/// Totals.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct FinalMetrics {
    /// Sum of prompt tokens.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub total_prompt_tokens: Option<u64>,
    /// Sum of completion tokens.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub total_completion_tokens: Option<u64>,
    /// Number of steps.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub total_steps: Option<u64>,
    /// Custom totals.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub extra: Option<Map<String, Value>>,
}

/// Now, ISO 8601 UTC with a `Z`.
pub fn now() -> String {
    chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Micros, true)
}

impl Trajectory {
    /// A trajectory whose first step is the task instruction from the user.
    pub fn new(session_id: &str, agent: Agent, instruction: &str) -> Self {
        let mut t = Trajectory {
            schema_version: SCHEMA_VERSION.into(),
            session_id: session_id.into(),
            agent,
            steps: Vec::new(),
            notes: None,
            final_metrics: None,
            extra: None,
        };
        t.push(Step::new("user", instruction));
        t
    }

    /// Appends `step`, numbering it.
    pub fn push(&mut self, mut step: Step) {
        step.step_id = self.steps.len() as u64 + 1;
        self.steps.push(step);
    }

    /// Fills [`Trajectory::final_metrics`] from the steps.
    pub fn finish(&mut self) {
        let (mut p, mut c) = (0u64, 0u64);
        for m in self.steps.iter().filter_map(|s| s.metrics.as_ref()) {
            p += m.prompt_tokens.unwrap_or(0);
            c += m.completion_tokens.unwrap_or(0);
        }
        self.final_metrics = Some(FinalMetrics {
            total_prompt_tokens: (p > 0).then_some(p),
            total_completion_tokens: (c > 0).then_some(c),
            total_steps: Some(self.steps.len() as u64),
            extra: None,
        });
    }
}

impl Step {
    /// A step with a timestamp and nothing else.
    pub fn new(source: &str, message: impl Into<String>) -> Self {
        Step {
            step_id: 0,
            timestamp: Some(now()),
            source: source.into(),
            message: message.into(),
            model_name: None,
            tool_calls: None,
            observation: None,
            metrics: None,
            extra: None,
        }
    }

    /// Record that this step ran `command` with the `bash` tool (call `id`)
    /// and saw `output`.
    pub fn bash_call(&mut self, id: String, command: &str, output: String) {
        let mut arguments = Map::new();
        arguments.insert("command".into(), Value::String(command.into()));
        self.tool_calls = Some(vec![ToolCall {
            tool_call_id: id.clone(),
            function_name: "bash".into(),
            arguments,
        }]);
        self.observation = Some(Observation {
            results: vec![ObservationResult {
                source_call_id: id,
                content: output,
            }],
        });
    }
}
