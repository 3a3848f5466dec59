//! A relative LLM judge (the shape of ART's RULER): the rollouts of one
//! group go to a judge model in one chat call, which answers a score in
//! [0, 1] for each. Relative scoring is easier for a judge than absolute
//! scoring, and group-relative advantages only need the order within a
//! group.
//!
//! The request: a system message holding the grading standards (the
//! rubric), and a user message holding the shared prompt once
//! (`<context>` with its messages as JSON) and then each distinct
//! completion as `<trajectory id="N">` with its messages as JSON. The
//! answer: `{"scores": [{"trajectory_id": "N", "explanation": "...",
//! "score": 0.7}, ...]}`, asked for with a JSON-schema `response_format`
//! (off with `json_schema = false` for endpoints without structured
//! outputs). Anything else — no JSON, a missing or repeated id, a wrong
//! count, a score outside [0, 1], a failed call — is an error for the whole
//! group, which the rubric counts (`NAME/error`), never a silent 0.

use std::sync::Arc;

use serde::Deserialize;
use serde_json::{json, Value};

use super::context::RewardCtx;
use super::judge::judge_endpoint;
use crate::{ChatModel, ChatRequest, Message, SamplingArgs};

/// `relative_judge` arguments.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RelativeJudgeConfig {
    /// OpenAI-compatible base URL (`http://host:port/v1`).
    pub base_url: String,
    /// Judge model name.
    pub model: String,
    /// Environment variable holding the API key.
    #[serde(default)]
    pub api_key_env: Option<String>,
    /// Grading standards (default [`DEFAULT_RUBRIC`]).
    #[serde(default)]
    pub rubric: Option<String>,
    /// Judge completion tokens.
    #[serde(default = "default_tokens")]
    pub max_tokens: usize,
    /// Ask for the answer's shape with a JSON-schema `response_format`.
    #[serde(default = "yes")]
    pub json_schema: bool,
}

fn default_tokens() -> usize {
    1024
}

fn yes() -> bool {
    true
}

/// The grading standards used when the entry gives no `rubric`: the judge
/// reads the task from the prompt itself.
pub const DEFAULT_RUBRIC: &str = "\
- A response that achieves the task's goal must score clearly higher than one that does not.
- Between two responses that both achieve it, the more direct and efficient one scores higher.
- Small differences in quality give small differences in score; large ones, large differences.
- A response that makes progress towards the goal without reaching it may get partial credit.";

/// A judge that scores every rollout of a group in one call.
pub struct RelativeJudge {
    model: Arc<dyn ChatModel>,
    /// The endpoint, when the judge is one (checked before a run).
    pub(crate) endpoint: Option<Arc<crate::openai::OpenAiChatModel>>,
    rubric: String,
    max_tokens: usize,
    json_schema: bool,
}

impl RelativeJudge {
    /// A relative judge over any [`ChatModel`] (`rubric` `None` = the
    /// default standards).
    pub fn new(model: Arc<dyn ChatModel>, rubric: Option<String>) -> Self {
        RelativeJudge {
            model,
            endpoint: None,
            rubric: rubric.unwrap_or_else(|| DEFAULT_RUBRIC.into()),
            max_tokens: default_tokens(),
            json_schema: true,
        }
    }

    /// A relative judge on an OpenAI-compatible endpoint, with the same
    /// client as the absolute `judge`.
    pub fn from_config(cfg: RelativeJudgeConfig) -> Result<Self, String> {
        let endpoint = judge_endpoint(&cfg.base_url, &cfg.model, cfg.api_key_env.as_deref())?;
        Ok(RelativeJudge::on_endpoint(endpoint, cfg))
    }

    /// A relative judge on this endpoint (a test may tune its retries),
    /// with `cfg`'s other settings.
    pub fn on_endpoint(
        endpoint: Arc<crate::openai::OpenAiChatModel>,
        cfg: RelativeJudgeConfig,
    ) -> Self {
        let mut j = RelativeJudge::new(endpoint.clone(), cfg.rubric);
        j.endpoint = Some(endpoint);
        j.max_tokens = cfg.max_tokens;
        j.json_schema = cfg.json_schema;
        j
    }

    /// The judge's request for a group whose distinct completions are
    /// `trajectories` (1-based ids in order), all after `prompt`.
    pub fn request(&self, prompt: &[Message], trajectories: &[&[Message]]) -> ChatRequest {
        let system = format!(
            "All of the trajectories below were given the same task. Consider each of them and \
             give it a score between 0 and 1, using your best judgement of the task's goal.\n\n\
             Grading standards:\n{}\n\n\
             Answer with only a JSON object: {{\"scores\": [{{\"trajectory_id\": \"1\", \
             \"explanation\": \"...\", \"score\": 0.5}}, ...]}}, one entry per trajectory.",
            self.rubric.trim()
        );
        let mut user = String::new();
        if !prompt.is_empty() {
            user.push_str(&format!("<context>\n{}\n</context>\n\n", to_json(prompt)));
        }
        user.push_str("Trajectories:\n\n");
        let parts: Vec<String> = trajectories
            .iter()
            .enumerate()
            .map(|(i, t)| {
                format!(
                    "<trajectory id=\"{}\">\n{}\n</trajectory>",
                    i + 1,
                    to_json(t)
                )
            })
            .collect();
        user.push_str(&parts.join("\n\n"));
        let mut sampling = SamplingArgs {
            max_tokens: self.max_tokens,
            temperature: 0.0,
            ..SamplingArgs::default()
        };
        if self.json_schema {
            sampling.extra.insert(
                "response_format".into(),
                response_format(trajectories.len()),
            );
        }
        ChatRequest {
            messages: vec![Message::system(system), Message::user(user)],
            tools: None,
            sampling,
        }
    }

    /// One score in [0, 1] per rollout of the group, from one judge call;
    /// identical completions are sent once and share their score.
    pub async fn score_group(&self, ctxs: &[RewardCtx<'_>]) -> Result<Vec<f64>, String> {
        let Some(first) = ctxs.first() else {
            return Ok(Vec::new());
        };
        let mut distinct: Vec<&[Message]> = Vec::new();
        let slot: Vec<usize> = ctxs
            .iter()
            .map(|c| match distinct.iter().position(|d| *d == c.completion) {
                Some(i) => i,
                None => {
                    distinct.push(c.completion);
                    distinct.len() - 1
                }
            })
            .collect();
        let req = self.request(first.prompt, &distinct);
        let turn = self
            .model
            .chat(req)
            .await
            .map_err(|e| format!("judge call failed: {e}"))?;
        let text = turn.message.text();
        if turn.finish_reason == "length" {
            return Err(format!(
                "the judge's reply stopped at max_tokens ({}) before it ended: {}",
                self.max_tokens,
                clip(&text)
            ));
        }
        let scores = parse_scores(&text, distinct.len())?;
        Ok(slot.into_iter().map(|i| scores[i]).collect())
    }
}

fn to_json(messages: &[Message]) -> String {
    serde_json::to_string(messages).unwrap_or_default()
}

/// The JSON schema of an answer for `n` trajectories. `strict` is off so
/// that an endpoint which cannot enforce a keyword still takes the schema.
fn response_format(n: usize) -> Value {
    let ids: Vec<String> = (1..=n).map(|i| i.to_string()).collect();
    json!({
        "type": "json_schema",
        "json_schema": {
            "name": "scores",
            "strict": false,
            "schema": {
                "type": "object",
                "properties": {
                    "scores": {
                        "type": "array",
                        "minItems": n,
                        "maxItems": n,
                        "items": {
                            "type": "object",
                            "properties": {
                                "trajectory_id": {"type": "string", "enum": ids},
                                "explanation": {"type": "string", "maxLength": 120},
                                "score": {"type": "number", "minimum": 0, "maximum": 1}
                            },
                            "required": ["trajectory_id", "explanation", "score"],
                            "additionalProperties": false
                        }
                    }
                },
                "required": ["scores"],
                "additionalProperties": false
            }
        }
    })
}

/// The scores of trajectories `1..=n`, in order, from the judge's reply: a
/// JSON object (bare, fenced, or the outermost `{...}` of the text) whose
/// `scores` name each id exactly once with a score in [0, 1].
pub fn parse_scores(text: &str, n: usize) -> Result<Vec<f64>, String> {
    let v = json_object(text)
        .ok_or_else(|| format!("no JSON object in the judge's reply: {}", clip(text)))?;
    let items = v
        .get("scores")
        .and_then(Value::as_array)
        .ok_or_else(|| format!("the judge's reply has no `scores` list: {}", clip(text)))?;
    if items.len() != n {
        return Err(format!(
            "the judge scored {} trajectories, not {n}: {}",
            items.len(),
            clip(text)
        ));
    }
    let mut out: Vec<Option<f64>> = vec![None; n];
    for item in items {
        let id = match item.get("trajectory_id") {
            Some(Value::String(s)) => s.trim().parse::<usize>().ok(),
            Some(Value::Number(x)) => x.as_u64().map(|x| x as usize),
            _ => None,
        }
        .filter(|id| (1..=n).contains(id))
        .ok_or_else(|| format!("a score without a trajectory_id in 1..={n}: {item}"))?;
        let score = item
            .get("score")
            .and_then(Value::as_f64)
            .ok_or_else(|| format!("trajectory {id}: no numeric score: {item}"))?;
        if !(0.0..=1.0).contains(&score) {
            return Err(format!("trajectory {id}: score {score} is outside [0, 1]"));
        }
        if out[id - 1].replace(score).is_some() {
            return Err(format!("trajectory {id} was scored twice"));
        }
    }
    // n entries, each id in range and none twice: every id is present.
    Ok(out.into_iter().flatten().collect())
}

fn json_object(text: &str) -> Option<Value> {
    let t = text.trim();
    if let Ok(v @ Value::Object(_)) = serde_json::from_str::<Value>(t) {
        return Some(v);
    }
    let (start, end) = (t.find('{')?, t.rfind('}')?);
    match serde_json::from_str::<Value>(t.get(start..=end)?) {
        Ok(v @ Value::Object(_)) => Some(v),
        _ => None,
    }
}

fn clip(s: &str) -> String {
    let c: String = s.chars().take(200).collect();
    if c.len() < s.len() {
        format!("{c}…")
    } else {
        c
    }
}
