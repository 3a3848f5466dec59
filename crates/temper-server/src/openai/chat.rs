//! `/v1/chat/completions`: the chat template, message normalisation, tool
//! calls, and structured outputs (`response_format` JSON modes, `tool_choice`
//! `"required"` or a named function: see [`crate::structured`]).

use std::time::Instant;

use axum::body::Bytes;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Map, Value};
use tokio::sync::mpsc::UnboundedReceiver;

use super::error::OpenAiError;
use super::protocol::{max_tokens_field, parse_body, top_logprobs_field, ChatRequest};

use super::capture::{self, EpisodeTag};
use super::jobs::{collect, prepare, submit, Prepared};
use super::response::{chat_logprobs, mark_unenforced, unenforced, unenforced_header, usage};
use super::state::{now_secs, OpenAiState};
use super::streaming::{sse, StreamKind};
use super::tools;
use crate::scheduler::{Event, Finished};
use crate::structured::{Constraint, Enforce};

/// Tool settings of a chat request, and its output constraint (with the
/// field it came from, for error messages).
struct ToolMode {
    parse: bool,
    constraint: Option<(Constraint, &'static str)>,
}

/// 400 naming the first key of `obj` outside `known` (`what` says where).
fn unknown_key(obj: &Map<String, Value>, known: &[&str], what: &str) -> Result<(), OpenAiError> {
    match obj.keys().find(|k| !known.contains(&k.as_str())) {
        Some(k) => Err(OpenAiError::BadRequest {
            message: format!(
                "unsupported field `{k}` in {what}: this server does not implement it"
            ),
            param: Some(what.to_string()),
            code: Some("unsupported_field"),
        }),
        None => Ok(()),
    }
}

/// The constraint of `response_format`: `None` for text.
fn response_format_constraint(f: &Value) -> Result<Option<Constraint>, OpenAiError> {
    let bad = |m: String| OpenAiError::invalid("response_format", m);
    let Some(obj) = f.as_object() else {
        return Err(bad(format!("response_format must be an object, got {f}")));
    };
    match obj.get("type").and_then(Value::as_str) {
        Some("text") => {
            unknown_key(obj, &["type"], "response_format")?;
            Ok(None)
        }
        Some("json_object") => {
            unknown_key(obj, &["type"], "response_format")?;
            Ok(Some(Constraint::JsonSchema(
                json!({"type": "object"}),
                Enforce::Strict,
            )))
        }
        Some("json_schema") => {
            unknown_key(obj, &["type", "json_schema"], "response_format")?;
            let Some(js) = obj.get("json_schema").and_then(Value::as_object) else {
                return Err(bad(
                    "response_format of type json_schema needs a `json_schema` object".into(),
                ));
            };
            // `strict: true`: every keyword enforced or a 400 (OpenAI's
            // meaning); otherwise what cannot be enforced is reported.
            unknown_key(
                js,
                &["name", "description", "schema", "strict"],
                "response_format.json_schema",
            )?;
            if !js.get("name").is_some_and(Value::is_string) {
                return Err(bad("response_format.json_schema needs a string `name`".into()));
            }
            if js.get("strict").is_some_and(|s| !s.is_boolean() && !s.is_null()) {
                return Err(bad("response_format.json_schema.strict must be a boolean".into()));
            }
            let enforce = Enforce::from_strict(js.get("strict") == Some(&Value::Bool(true)));
            match js.get("schema") {
                Some(s @ Value::Object(_)) => Ok(Some(Constraint::JsonSchema(s.clone(), enforce))),
                Some(other) => Err(bad(format!(
                    "response_format.json_schema.schema must be a JSON schema object, got {other}"
                ))),
                None => Err(bad("response_format.json_schema needs a `schema`".into())),
            }
        }
        Some(t) => Err(bad(format!(
            "response_format type {t:?} is not supported; use \"text\", \"json_object\" or \"json_schema\""
        ))),
        None => Err(bad("response_format needs a string `type`".into())),
    }
}

/// The schema of one Hermes tool call (`{"name": ..., "arguments": ...}`)
/// to `tool`, an OpenAI `{"type": "function", "function": {...}}` entry,
/// and whether the function is `strict`.
fn tool_call_schema(i: usize, tool: &Value) -> Result<(String, Value, bool), OpenAiError> {
    let bad = |m: String| OpenAiError::invalid("tools", m);
    let f = tool
        .get("function")
        .filter(|_| tool.get("type").and_then(Value::as_str) == Some("function"))
        .and_then(Value::as_object)
        .ok_or_else(|| {
            bad(format!(
                "tools[{i}] must be {{\"type\": \"function\", \"function\": {{...}}}}"
            ))
        })?;
    let name = f
        .get("name")
        .and_then(Value::as_str)
        .ok_or_else(|| bad(format!("tools[{i}].function needs a string `name`")))?;
    // OpenAI: omitted parameters mean a function that takes none.
    let params = match f.get("parameters") {
        None | Some(Value::Null) => {
            json!({"type": "object", "properties": {}, "additionalProperties": false})
        }
        Some(p @ Value::Object(_)) => p.clone(),
        Some(other) => {
            return Err(bad(format!(
                "tools[{i}].function.parameters must be a JSON schema object, got {other}"
            )))
        }
    };
    let schema = json!({
        "type": "object",
        "properties": {"name": {"const": name}, "arguments": params},
        "required": ["name", "arguments"],
        "additionalProperties": false,
    });
    if f.get("strict")
        .is_some_and(|s| !s.is_boolean() && !s.is_null())
    {
        return Err(bad(format!("tools[{i}].function.strict must be a boolean")));
    }
    let strict = f.get("strict") == Some(&Value::Bool(true));
    Ok((name.to_string(), schema, strict))
}

/// `tool_choice`: whether to parse tool calls, and the call the output is
/// constrained to (`"required"`: one call to any of `tools`; a named
/// function: one call to it).
fn tool_choice_mode(
    choice: Option<&Value>,
    tools: Option<&Vec<Value>>,
) -> Result<(bool, Option<Constraint>), OpenAiError> {
    let bad = |m: String| OpenAiError::invalid("tool_choice", m);
    let forced: Option<Option<&str>> = match choice {
        None => return Ok((true, None)),
        Some(Value::String(c)) if c == "auto" => return Ok((true, None)),
        Some(Value::String(c)) if c == "none" => return Ok((false, None)),
        Some(Value::String(c)) if c == "required" => Some(None),
        Some(Value::Object(o)) if o.get("type").and_then(Value::as_str) == Some("function") => {
            let name = o
                .get("function")
                .and_then(|f| f.get("name"))
                .and_then(Value::as_str)
                .ok_or_else(|| {
                    bad("a named tool_choice is {\"type\": \"function\", \"function\": {\"name\": ...}}".into())
                })?;
            Some(Some(name))
        }
        Some(other) => {
            return Err(bad(format!(
                "tool_choice {other} is not supported; use \"auto\", \"none\", \"required\" or {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}"
            )))
        }
    };
    let Some(forced) = forced else {
        return Ok((true, None));
    };
    let Some(tools) = tools.filter(|t| !t.is_empty()) else {
        return Err(bad(
            "tool_choice \"required\" or a named function needs `tools`".into(),
        ));
    };
    let mut schemas = Vec::new();
    // One grammar for every callable tool: strict when each of them is.
    let mut all_strict = true;
    for (i, t) in tools.iter().enumerate() {
        let (name, schema, strict) = tool_call_schema(i, t)?;
        if forced.is_none_or(|want| want == name) {
            schemas.push(schema);
            all_strict &= strict;
        }
    }
    let schema = match (forced, schemas.len()) {
        (Some(name), 0) => {
            return Err(bad(format!(
                "tool_choice names {name:?}, which is not in `tools`"
            )))
        }
        (_, 1) => schemas.remove(0),
        _ => json!({"anyOf": schemas}),
    };
    Ok((
        true,
        Some(Constraint::ToolCall(
            schema,
            Enforce::from_strict(all_strict),
        )),
    ))
}

/// Render the chat prompt; `format` is the output constraint of the
/// request's JSON mode, if any, and the field it came from.
fn chat_prompt(
    s: &OpenAiState,
    req: &ChatRequest,
    format: Option<(Constraint, &'static str)>,
) -> Result<(Vec<u32>, ToolMode), OpenAiError> {
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
    let (parse, tool_constraint) = tool_choice_mode(req.tool_choice.as_ref(), tools.as_ref())?;
    let constraint = match (tool_constraint, format) {
        (Some(_), Some((_, field))) => {
            return Err(OpenAiError::invalid(
                field,
                format!("{field} JSON modes cannot be combined with tool_choice \"required\" or a named function (the output is the tool call)"),
            ))
        }
        (Some(t), None) => Some((t, "tool_choice")),
        (None, f) => f,
    };
    if constraint.is_some() && req.sampling.ignore_eos == Some(true) {
        return Err(OpenAiError::invalid(
            "ignore_eos",
            "ignore_eos cannot be combined with structured outputs: a complete document ends with EOS",
        ));
    }
    if constraint.is_some() && req.sampling.min_tokens.is_some_and(|m| m > 0) {
        return Err(OpenAiError::invalid(
            "min_tokens",
            "min_tokens cannot be combined with structured outputs: a complete document ends with EOS, which min_tokens holds back",
        ));
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
    Ok((
        ids,
        ToolMode {
            parse: use_tools,
            constraint,
        },
    ))
}

/// The roles a chat message may have (OpenAI's; `developer` is rendered as
/// `system`, as OpenAI defines it for chat models).
const ROLES: [&str; 5] = ["system", "developer", "user", "assistant", "tool"];

/// One message as the chat template expects it (what vLLM passes on): a
/// known role, `developer` as `system`, content parts joined to text, an
/// assistant's null or absent content as `""` (templates concatenate it),
/// tool-call arguments parsed to objects.
fn normalize_message(i: usize, m: &Value) -> Result<Value, OpenAiError> {
    let bad = |m: String| OpenAiError::invalid("messages", m);
    let Some(obj) = m.as_object() else {
        return Err(bad(format!("messages[{i}] must be an object")));
    };
    let Some(role) = obj.get("role").and_then(Value::as_str) else {
        return Err(bad(format!("messages[{i}] needs a string `role`")));
    };
    if !ROLES.contains(&role) {
        return Err(bad(format!(
            "messages[{i}] has an unknown role {role:?}; the roles are {}",
            ROLES.join(", ")
        )));
    }
    let mut obj = obj.clone();
    if role == "developer" {
        obj.insert("role".into(), Value::String("system".into()));
    }
    match obj.get("content") {
        Some(Value::String(_)) => {}
        None | Some(Value::Null) if role == "assistant" => {
            obj.insert("content".into(), Value::String(String::new()));
        }
        None | Some(Value::Null) => {
            return Err(bad(format!("messages[{i}] ({role}) needs `content`")));
        }
        Some(Value::Array(parts)) => {
            let mut text = String::new();
            for p in parts {
                match (
                    p.get("type").and_then(Value::as_str),
                    p.get("text").and_then(Value::as_str),
                ) {
                    (Some("text"), Some(t)) => text.push_str(t),
                    _ => {
                        return Err(bad(format!(
                            "messages[{i}]: only text content parts are supported"
                        )))
                    }
                }
            }
            obj.insert("content".into(), Value::String(text));
        }
        Some(other) => {
            return Err(bad(format!(
                "messages[{i}].content must be a string or a list of text parts, got {other}"
            )))
        }
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

/// A chat request on its way: queued on the scheduler.
pub(super) struct ChatRun {
    pub(super) p: Prepared,
    /// Whether the output is parsed for tool calls.
    pub(super) parse_tools: bool,
    pub(super) rx: UnboundedReceiver<Event>,
}

/// Check a chat request, render its prompt, compile its output constraint
/// (`format`: a JSON mode and the field it came from) and queue it: the one
/// way into the engine for `/v1/chat/completions` and `/v1/responses`.
pub(super) async fn start_chat(
    s: &OpenAiState,
    episode: &EpisodeTag,
    req: &ChatRequest,
    format: Option<(Constraint, &'static str)>,
) -> Result<ChatRun, OpenAiError> {
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
    let vllm = req.vllm.clone().check()?;
    let (prompt, tools) = chat_prompt(s, req, format)?;
    let mut p = prepare(
        s,
        &req.model,
        vec![prompt],
        sampling,
        max_tokens,
        None,
        "messages",
    )?;
    p.capture = episode.chat(&req.messages, req.tools.as_ref());
    p.vllm = vllm;
    p.logprobs = logprobs;
    p.top_logprobs = top;
    if let Some((c, param)) = tools.constraint.clone() {
        p.grammar = Some(s.grammar(c, param).await?);
    }
    let rx = submit(s, &p, req.stream.unwrap_or(false))?;
    Ok(ChatRun {
        p,
        parse_tools: tools.parse,
        rx,
    })
}

pub(super) async fn chat_completions(
    State(s): State<OpenAiState>,
    episode: EpisodeTag,
    body: Bytes,
) -> Result<Response, OpenAiError> {
    let started = Instant::now();
    let req: ChatRequest = parse_body(&body)?;
    let format = match &req.response_format {
        None => None,
        Some(f) => response_format_constraint(f)?.map(|c| (c, "response_format")),
    };
    let ChatRun { p, parse_tools, rx } = start_chat(&s, &episode, &req, format).await?;
    let id = s.request_id("chatcmpl");
    if req.stream.unwrap_or(false) {
        let include_usage = req.stream_options.is_some_and(|o| o.include_usage);
        let u = unenforced(&p);
        let r = sse(
            s.clone(),
            rx,
            p,
            StreamKind::Chat { tools: parse_tools },
            id,
            include_usage,
            started,
        );
        return Ok(unenforced_header(&u, r));
    }
    let done = collect(&s, rx, p.total_choices(), started).await?;
    let mut choices = Vec::with_capacity(done.len());
    let mut completion_tokens = 0;
    for f in done {
        completion_tokens += f.tokens.len();
        let scores = capture::score_choice(&s, &p, &f, false).await?;
        let lp = match &scores {
            Some(r) if p.logprobs => chat_logprobs(&s, &f.tokens, r, p.vllm.tokens_as_ids),
            _ => Value::Null,
        };
        let (message, finish) = chat_message(&f, parse_tools, &id);
        capture::record(&s, &p, &id, &f, finish, scores.as_ref(), message.clone())?;
        let mut choice =
            json!({"index": f.index, "message": message, "logprobs": lp, "finish_reason": finish});
        if p.vllm.return_token_ids {
            choice["token_ids"] = json!(f.tokens);
        }
        choices.push(choice);
    }
    let mut body = json!({
        "id": id, "object": "chat.completion", "created": now_secs(), "model": p.model_name,
        "system_fingerprint": p.fingerprint(), "version": p.version, "choices": choices,
        "usage": usage(p.prompt_tokens(), completion_tokens),
    });
    if p.vllm.return_token_ids {
        body["prompt_token_ids"] = json!(p.prompts[0]);
    }
    if let Some(c) = &p.capture {
        // Names the episode a reward (`POST /v1/episodes/ID/reward`) goes to.
        body["episode"] = json!(c.episode);
    }
    let u = unenforced(&p);
    mark_unenforced(&u, &mut body);
    Ok(unenforced_header(&u, Json(body).into_response()))
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
