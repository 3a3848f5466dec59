//! Successful trials as SFT data (`temper traces export`).
//!
//! A trial's conversation is, by preference:
//!
//! 1. its captured calls (`agent/tokens.jsonl`, see [`crate::capture`]): the
//!    last chat call's request messages plus the answer — exactly what the
//!    model saw and said, whatever program made the calls (an agent that
//!    keeps its history sends all of it with each call);
//! 2. the terminal agent's `agent/messages.json`;
//! 3. the ATIF trajectory: `user` / `system` steps as those roles, `agent`
//!    steps as assistant messages (tool calls in OpenAI's shape) followed by
//!    a `tool` message per observation result.
//!
//! Formats: `chat-jsonl` is what `temper train sft` reads (`{"messages":
//! [...]}` per line, plus `reward`, `task`, `trial`); `sharegpt` is
//! `{"conversations": [{"from": "system"|"human"|"gpt"|"function_call"|
//! "observation", "value": ...}]}`.

use std::path::Path;

use serde_json::{json, Value};

use crate::atif::Trajectory;
use crate::error::TaskError;
use crate::job::{job_results, load_job};

/// Output format.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// `{"messages": [...]}` lines (`temper train sft`'s format).
    ChatJsonl,
    /// `{"conversations": [{"from", "value"}]}` lines.
    ShareGpt,
}

impl std::str::FromStr for Format {
    type Err = TaskError;
    fn from_str(s: &str) -> Result<Self, TaskError> {
        match s {
            "chat-jsonl" => Ok(Format::ChatJsonl),
            "sharegpt" => Ok(Format::ShareGpt),
            other => Err(TaskError::Invalid(format!(
                "unknown format {other:?}; one of chat-jsonl, sharegpt"
            ))),
        }
    }
}

/// What an export found.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Export {
    /// One JSON object per exported trial.
    pub rows: Vec<Value>,
    /// Trials with a result.
    pub trials: usize,
    /// Trials below the reward bar (or without a verifier result).
    pub below: usize,
    /// Trials at or above it that have no assistant turn to train on.
    pub empty: usize,
}

/// The rows of the job at `dir` whose trials scored `reward >= min_reward`.
pub fn export(dir: &Path, min_reward: f64, format: Format) -> Result<Export, TaskError> {
    let config = load_job(dir)?;
    let mut out = Export::default();
    for r in job_results(dir, &config) {
        out.trials += 1;
        let scored = r
            .verifier_result
            .as_ref()
            .and_then(|v| v.rewards.as_ref())
            .is_some_and(|m| m.contains_key("reward"));
        if !scored || r.reward() < min_reward {
            out.below += 1;
            continue;
        }
        let messages = conversation(&dir.join(&r.trial_name).join("agent"))?;
        if !messages
            .iter()
            .any(|m| m["role"] == "assistant" && has_text_or_calls(m))
        {
            out.empty += 1;
            continue;
        }
        out.rows.push(match format {
            Format::ChatJsonl => json!({
                "messages": messages, "reward": r.reward(), "task": r.task_name,
                "trial": r.trial_name,
            }),
            Format::ShareGpt => json!({"conversations": sharegpt(&messages)}),
        });
    }
    Ok(out)
}

fn has_text_or_calls(m: &Value) -> bool {
    m["content"].as_str().is_some_and(|c| !c.trim().is_empty())
        || m["tool_calls"].as_array().is_some_and(|c| !c.is_empty())
}

/// A trial's conversation as OpenAI chat messages (see the module docs).
pub fn conversation(agent_dir: &Path) -> Result<Vec<Value>, TaskError> {
    let records = crate::capture::read_records(agent_dir)?;
    if let Some(last) = records
        .iter()
        .filter(|r| r["endpoint"] == "chat.completions" && r["messages"].is_array())
        .max_by_key(|r| r["seq"].as_u64().unwrap_or(0))
    {
        let mut messages = last["messages"].as_array().cloned().unwrap_or_default();
        let mut answer = last["response"].clone();
        // The captured answer is the server's message object; keep only
        // what a chat template renders.
        if let Some(o) = answer.as_object_mut() {
            o.retain(|k, _| matches!(k.as_str(), "role" | "content" | "tool_calls"));
        }
        messages.push(answer);
        return Ok(messages);
    }
    let read = |name: &str| -> Result<Option<String>, TaskError> {
        let path = agent_dir.join(name);
        match std::fs::read_to_string(&path) {
            Ok(t) => Ok(Some(t)),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(TaskError::io("read", path, e)),
        }
    };
    let json_err = |name: &str, source| TaskError::Json {
        path: agent_dir.join(name),
        source,
    };
    if let Some(t) = read("messages.json")? {
        let v: Vec<Value> = serde_json::from_str(&t).map_err(|e| json_err("messages.json", e))?;
        return Ok(v);
    }
    let Some(t) = read("trajectory.json")? else {
        return Ok(Vec::new());
    };
    let traj: Trajectory = serde_json::from_str(&t).map_err(|e| json_err("trajectory.json", e))?;
    Ok(from_trajectory(&traj))
}

/// ATIF steps as chat messages.
pub fn from_trajectory(t: &Trajectory) -> Vec<Value> {
    let mut out = Vec::new();
    for s in &t.steps {
        match s.source.as_str() {
            "system" | "user" => out.push(json!({"role": s.source, "content": s.message})),
            "agent" => {
                let mut m = json!({"role": "assistant", "content": s.message});
                if let Some(calls) = s.tool_calls.as_ref().filter(|c| !c.is_empty()) {
                    m["tool_calls"] = calls
                        .iter()
                        .map(|c| {
                            json!({"id": c.tool_call_id, "type": "function", "function": {
                                "name": c.function_name,
                                "arguments": Value::Object(c.arguments.clone()).to_string(),
                            }})
                        })
                        .collect();
                }
                out.push(m);
                for r in s.observation.iter().flat_map(|o| &o.results) {
                    out.push(json!({"role": "tool", "tool_call_id": r.source_call_id,
                                    "content": r.content}));
                }
            }
            _ => {}
        }
    }
    out
}

/// Chat messages in ShareGPT's roles.
pub fn sharegpt(messages: &[Value]) -> Vec<Value> {
    let mut out = Vec::new();
    for m in messages {
        let content = m["content"].as_str().unwrap_or_default();
        match m["role"].as_str().unwrap_or_default() {
            "system" => out.push(json!({"from": "system", "value": content})),
            "user" => out.push(json!({"from": "human", "value": content})),
            "tool" => out.push(json!({"from": "observation", "value": content})),
            "assistant" => {
                let calls = m["tool_calls"].as_array().filter(|c| !c.is_empty());
                if !content.is_empty() || calls.is_none() {
                    out.push(json!({"from": "gpt", "value": content}));
                }
                for c in calls.into_iter().flatten() {
                    let f = &c["function"];
                    let args = match &f["arguments"] {
                        Value::String(s) => {
                            serde_json::from_str(s).unwrap_or(Value::String(s.clone()))
                        }
                        other => other.clone(),
                    };
                    out.push(json!({"from": "function_call",
                                    "value": json!({"name": f["name"], "arguments": args}).to_string()}));
                }
            }
            _ => {}
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::atif::{Observation, ObservationResult, Step, ToolCall};

    #[test]
    fn trajectories_become_chat_messages_and_sharegpt() {
        let agent = crate::atif::Agent {
            name: "x".into(),
            version: "1".into(),
            model_name: None,
            tool_definitions: None,
            extra: None,
        };
        let mut t = Trajectory::new("s", agent, "do it");
        let mut s = Step::new("agent", "running");
        s.tool_calls = Some(vec![ToolCall {
            tool_call_id: "call_1".into(),
            function_name: "bash".into(),
            arguments: json!({"command": "ls"})
                .as_object()
                .cloned()
                .unwrap_or_default(),
        }]);
        s.observation = Some(Observation {
            results: vec![ObservationResult {
                source_call_id: "call_1".into(),
                content: "a.txt".into(),
            }],
        });
        t.push(s);
        t.push(Step::new("agent", "done"));
        let m = from_trajectory(&t);
        assert_eq!(
            m,
            vec![
                json!({"role": "user", "content": "do it"}),
                json!({"role": "assistant", "content": "running", "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "bash", "arguments": "{\"command\":\"ls\"}"}}]}),
                json!({"role": "tool", "tool_call_id": "call_1", "content": "a.txt"}),
                json!({"role": "assistant", "content": "done"}),
            ]
        );
        let g = sharegpt(&m);
        let froms: Vec<&str> = g.iter().filter_map(|x| x["from"].as_str()).collect();
        assert_eq!(
            froms,
            ["human", "gpt", "function_call", "observation", "gpt"]
        );
        let call: Value = serde_json::from_str(g[2]["value"].as_str().unwrap_or_default())
            .expect("function_call value is JSON");
        assert_eq!(
            call,
            json!({"name": "bash", "arguments": {"command": "ls"}})
        );
        assert_eq!(g[3]["value"], "a.txt");
        assert_eq!(g[4]["value"], "done");
        assert!("csv".parse::<Format>().is_err());
    }
}
