//! `/v1/chat/completions`: the chat template, message normalisation and
//! tool calls.

use std::time::Instant;

use axum::body::Bytes;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};

use super::error::OpenAiError;
use super::protocol::{max_tokens_field, parse_body, top_logprobs_field, ChatRequest};

use super::capture::{self, EpisodeTag};
use super::jobs::{collect, prepare, submit};
use super::response::{chat_logprobs, usage};
use super::state::{now_secs, OpenAiState};
use super::streaming::{sse, StreamKind};
use super::tools;
use crate::scheduler::Finished;

/// Tool settings of a chat request.
struct ToolMode {
    parse: bool,
}

/// Render the chat prompt.
fn chat_prompt(s: &OpenAiState, req: &ChatRequest) -> Result<(Vec<u32>, ToolMode), OpenAiError> {
    let tmpl =
        s.inner.model.chat_template.as_ref().ok_or_else(|| {
            OpenAiError::bad("this model has no chat template; use /v1/completions")
        })?;
    if req.messages.is_empty() {
        return Err(OpenAiError::invalid(
            "messages",
            "messages must not be empty",
        ));
    }
    let mut messages = Vec::with_capacity(req.messages.len());
    for (i, m) in req.messages.iter().enumerate() {
        messages.push(normalize_message(i, m)?);
    }
    let tools = req.tools.clone().filter(|t| !t.is_empty());
    let parse = match &req.tool_choice {
        None => true,
        Some(Value::String(c)) if c == "auto" => true,
        Some(Value::String(c)) if c == "none" => false,
        Some(other) => {
            return Err(OpenAiError::invalid(
                "tool_choice",
                format!("tool_choice {other} is not supported; use \"auto\" or \"none\""),
            ))
        }
    };
    match &req.response_format {
        None => {}
        Some(f) if f.get("type").and_then(Value::as_str) == Some("text") => {}
        Some(f) => {
            return Err(OpenAiError::invalid(
                "response_format",
                format!(
                "response_format {f} is not supported: this server has no constrained decoding; \
                     ask for JSON in the prompt and validate it"
            ),
            ))
        }
    }
    let use_tools = tools.is_some() && parse;
    let tools_json = if use_tools {
        tools.map(Value::Array)
    } else {
        None
    };
    let extra = req.chat_template_kwargs.clone().unwrap_or_default();
    let text = tmpl
        .render(&Value::Array(messages), tools_json.as_ref(), true, &extra)
        .map_err(|e| OpenAiError::invalid("messages", e.to_string()))?;
    let ids = s
        .inner
        .model
        .tokenizer
        .encode(&text, false)
        .map_err(|e| OpenAiError::invalid("messages", format!("tokenizing: {e}")))?;
    Ok((ids, ToolMode { parse: use_tools }))
}

/// Content parts joined to text; tool-call arguments parsed to objects (what
/// chat templates expect, as vLLM does).
fn normalize_message(i: usize, m: &Value) -> Result<Value, OpenAiError> {
    let Some(obj) = m.as_object() else {
        return Err(OpenAiError::invalid(
            "messages",
            format!("messages[{i}] must be an object"),
        ));
    };
    if !obj.get("role").is_some_and(Value::is_string) {
        return Err(OpenAiError::invalid(
            "messages",
            format!("messages[{i}] needs a string `role`"),
        ));
    }
    let mut obj = obj.clone();
    if let Some(Value::Array(parts)) = obj.get("content") {
        let mut text = String::new();
        for p in parts {
            match (
                p.get("type").and_then(Value::as_str),
                p.get("text").and_then(Value::as_str),
            ) {
                (Some("text"), Some(t)) => text.push_str(t),
                _ => {
                    return Err(OpenAiError::invalid(
                        "messages",
                        format!("messages[{i}]: only text content parts are supported"),
                    ))
                }
            }
        }
        obj.insert("content".into(), Value::String(text));
    }
    if let Some(Value::Array(calls)) = obj.get_mut("tool_calls") {
        for c in calls.iter_mut() {
            if let Some(f) = c.get_mut("function").and_then(Value::as_object_mut) {
                if let Some(Value::String(a)) = f.get("arguments") {
                    if let Ok(v) = serde_json::from_str::<Value>(a) {
                        f.insert("arguments".into(), v);
                    }
                }
            }
        }
    }
    Ok(Value::Object(obj))
}

pub(super) async fn chat_completions(
    State(s): State<OpenAiState>,
    episode: EpisodeTag,
    body: Bytes,
) -> Result<Response, OpenAiError> {
    let started = Instant::now();
    let req: ChatRequest = parse_body(&body)?;
    let sampling = req.sampling.clone().check(&s.inner.defaults)?;
    let max_tokens = match max_tokens_field("max_completion_tokens", req.max_completion_tokens)? {
        Some(m) => Some(m),
        None => max_tokens_field("max_tokens", req.max_tokens)?,
    };
    let logprobs = req.logprobs.unwrap_or(false);
    let top = top_logprobs_field("top_logprobs", req.top_logprobs)?;
    if top > 0 && !logprobs {
        return Err(OpenAiError::invalid(
            "top_logprobs",
            "top_logprobs needs logprobs: true",
        ));
    }
    let (prompt, tools) = chat_prompt(&s, &req)?;
    let mut p = prepare(
        &s,
        &req.model,
        vec![prompt],
        sampling,
        max_tokens,
        None,
        "messages",
    )?;
    p.capture = episode.chat(&req.messages, req.tools.as_ref());
    p.logprobs = logprobs;
    p.top_logprobs = top;
    let stream = req.stream.unwrap_or(false);
    let rx = submit(&s, &p, stream)?;
    let id = s.request_id("chatcmpl");
    if stream {
        let include_usage = req.stream_options.is_some_and(|o| o.include_usage);
        return Ok(sse(
            s.clone(),
            rx,
            p,
            StreamKind::Chat { tools: tools.parse },
            id,
            include_usage,
            started,
        ));
    }
    let done = collect(&s, rx, p.total_choices(), started).await?;
    let mut choices = Vec::with_capacity(done.len());
    let mut completion_tokens = 0;
    for f in done {
        completion_tokens += f.tokens.len();
        let scores = capture::score_choice(&s, &p, &f, false).await?;
        let lp = match &scores {
            Some(r) if p.logprobs => chat_logprobs(&s, &f.tokens, r),
            _ => Value::Null,
        };
        let (message, finish) = chat_message(&f, tools.parse, &id);
        capture::record(&s, &p, &id, &f, finish, scores.as_ref(), message.clone())?;
        choices.push(
            json!({"index": f.index, "message": message, "logprobs": lp, "finish_reason": finish}),
        );
    }
    Ok(Json(json!({
        "id": id, "object": "chat.completion", "created": now_secs(), "model": p.model_name,
        "system_fingerprint": p.fingerprint(), "version": p.version, "choices": choices,
        "usage": usage(p.prompt_tokens(), completion_tokens),
    }))
    .into_response())
}

/// The assistant message and finish reason of a finished chat sample.
pub(super) fn chat_message(f: &Finished, parse_tools: bool, id: &str) -> (Value, &'static str) {
    if parse_tools {
        let (content, calls) = tools::parse(&f.text);
        if !calls.is_empty() {
            return (
                json!({"role": "assistant", "content": content, "tool_calls": tools::to_json(&calls, id, f.index)}),
                "tool_calls",
            );
        }
    }
    (
        json!({"role": "assistant", "content": f.text}),
        f.finish_reason.as_str(),
    )
}
