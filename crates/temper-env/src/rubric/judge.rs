//! The `judge` reward: an LLM judge asked whether a response is right.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

use serde::Deserialize;

use super::context::RewardCtx;
use crate::{ChatModel, ChatRequest, Message, SamplingArgs};

/// `judge` arguments.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JudgeConfig {
    /// OpenAI-compatible base URL (`http://host:port/v1`).
    pub base_url: String,
    /// Judge model name.
    pub model: String,
    /// Environment variable holding the API key.
    #[serde(default)]
    pub api_key_env: Option<String>,
    /// Prompt template: `{question}`, `{answer}`, `{response}`.
    #[serde(default = "default_judge_prompt")]
    pub prompt: String,
    /// Judge completion tokens.
    #[serde(default = "default_judge_tokens")]
    pub max_tokens: usize,
}

fn default_judge_prompt() -> String {
    "Question:\n{question}\n\nReference answer:\n{answer}\n\nResponse:\n{response}\n\n\
     Is the response correct and consistent with the reference answer? Reply yes or no."
        .into()
}

fn default_judge_tokens() -> usize {
    16
}

/// An LLM judge: asks a model whether a response is right; 1 for an
/// answer starting with "yes". Verdicts are cached by prompt text, so a
/// resumed or repeated evaluation asks once.
pub struct Judge {
    model: Arc<dyn ChatModel>,
    /// The endpoint, when the judge is one (checked before a run).
    pub(super) endpoint: Option<Arc<crate::openai::OpenAiChatModel>>,
    prompt: String,
    max_tokens: usize,
    cache: Mutex<HashMap<String, f64>>,
}

impl Judge {
    /// A judge over any [`ChatModel`]; `prompt` has `{question}`,
    /// `{answer}` and `{response}` placeholders.
    pub fn new(model: Arc<dyn ChatModel>, prompt: impl Into<String>) -> Self {
        Judge {
            model,
            endpoint: None,
            prompt: prompt.into(),
            max_tokens: default_judge_tokens(),
            cache: Mutex::new(HashMap::new()),
        }
    }

    /// A judge on an OpenAI-compatible endpoint.
    pub fn from_config(cfg: JudgeConfig) -> Result<Self, String> {
        let model = judge_endpoint(&cfg.base_url, &cfg.model, cfg.api_key_env.as_deref())?;
        let mut j = Judge::new(model.clone(), cfg.prompt);
        j.endpoint = Some(model);
        j.max_tokens = cfg.max_tokens;
        Ok(j)
    }

    pub(super) async fn score(&self, c: &RewardCtx<'_>) -> Result<f64, String> {
        let question = c
            .prompt
            .iter()
            .rev()
            .find(|m| m.role == "user")
            .map(Message::text)
            .unwrap_or_default();
        let response = c
            .parsed()
            .unwrap_or_else(|| crate::last_assistant_text(c.completion));
        let prompt = self
            .prompt
            .replace("{question}", &question)
            .replace("{answer}", c.answer.unwrap_or(""))
            .replace("{response}", &response);
        if let Some(v) = self
            .cache
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(&prompt)
            .copied()
        {
            return Ok(v);
        }
        let req = ChatRequest {
            messages: vec![Message::user(prompt.clone())],
            tools: None,
            sampling: SamplingArgs {
                max_tokens: self.max_tokens,
                temperature: 0.0,
                ..SamplingArgs::default()
            },
        };
        match self.model.chat(req).await {
            Ok(turn) => {
                let verdict = turn.message.text().trim().to_lowercase();
                let v = f64::from(u8::from(verdict.starts_with("yes")));
                self.cache
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .insert(prompt, v);
                Ok(v)
            }
            Err(e) => Err(format!("judge call failed: {e}")),
        }
    }
}

/// The client of a judge's OpenAI-compatible endpoint (`judge` and
/// `relative_judge`), its key read from `$api_key_env`.
pub(crate) fn judge_endpoint(
    base_url: &str,
    model: &str,
    api_key_env: Option<&str>,
) -> Result<Arc<crate::openai::OpenAiChatModel>, String> {
    let key = match api_key_env {
        Some(var) => Some(std::env::var(var).map_err(|_| format!("judge: ${var} is not set"))?),
        None => None,
    };
    crate::openai::OpenAiChatModel::new(base_url, model, key)
        .map(Arc::new)
        .map_err(|e| e.to_string())
}
