//! `/v1/responses`: OpenAI's Responses API, on the chat machinery. A
//! request is checked and turned into a chat request (input items to chat
//! messages, flat function tools to chat tools, `text.format` to an output
//! constraint), run by [`start_chat`] like `/v1/chat/completions`, and its
//! one finished sample answered as a `response` object: a `message` output
//! item with the text, a `function_call` item per tool call. Streamed, the
//! Responses API's typed events (`response.created`, ...,
//! `response.output_text.delta`, ..., `response.completed`).
//!
//! Nothing is stored: `previous_response_id` is refused (send the whole
//! conversation as `input`, as stateless clients do).

use std::time::Instant;

use axum::body::Bytes;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Map, Value};
use temper_model::TopLogprobs;

use super::capture::{self, EpisodeTag};
use super::chat::{chat_message, start_chat, ChatRun};
use super::error::OpenAiError;
use super::jobs::{collect, Prepared};
use super::protocol::{parse_body, ChatRequest, ResponsesRequest};
use super::response::{chat_logprobs, unenforced, unenforced_header, UNENFORCED_FIELD};
use super::state::{now_secs, OpenAiState};
use super::streaming::{sse, StreamKind};
use crate::scheduler::Finished;
use crate::structured::{Constraint, Enforce};

/// The `include` values honoured (the second is vacuous: no reasoning
/// items are produced, so there is none to include).
const INCLUDE_LOGPROBS: &str = "message.output_text.logprobs";
const INCLUDE_REASONING: &str = "reasoning.encrypted_content";

fn bad(param: &'static str, message: String) -> OpenAiError {
    OpenAiError::invalid(param, message)
}

/// 400 naming the first key of `obj` outside `known`.
fn known_keys(
    obj: &Map<String, Value>,
    known: &[&str],
    what: &str,
    param: &'static str,
) -> Result<(), OpenAiError> {
    match obj.keys().find(|k| !known.contains(&k.as_str())) {
        Some(k) => Err(OpenAiError::BadRequest {
            message: format!(
                "unsupported field `{k}` in {what}: this server does not implement it"
            ),
            param: Some(param.to_string()),
            code: Some("unsupported_field"),
        }),
        None => Ok(()),
    }
}

/// The text of a message's `content`: a string or a list of text parts
/// (`input_text`, `output_text`, `refusal`).
fn content_text(what: &str, content: Option<&Value>) -> Result<String, OpenAiError> {
    match content {
        Some(Value::String(s)) => Ok(s.clone()),
        Some(Value::Array(parts)) => {
            let mut text = String::new();
            for (k, p) in parts.iter().enumerate() {
                let ty = p.get("type").and_then(Value::as_str);
                let field = match ty {
                    Some("input_text" | "output_text") => "text",
                    Some("refusal") => "refusal",
                    Some(other) => {
                        return Err(bad(
                            "input",
                            format!("{what}.content[{k}] is of type {other:?}; only text content (input_text, output_text) is supported"),
                        ))
                    }
                    None => {
                        return Err(bad(
                            "input",
                            format!("{what}.content[{k}] needs a string `type`"),
                        ))
                    }
                };
                let t = p.get(field).and_then(Value::as_str).ok_or_else(|| {
                    bad(
                        "input",
                        format!("{what}.content[{k}] needs a string `{field}`"),
                    )
                })?;
                text.push_str(t);
            }
            Ok(text)
        }
        None | Some(Value::Null) => Err(bad("input", format!("{what} needs `content`"))),
        Some(other) => Err(bad(
            "input",
            format!("{what}.content must be a string or a list of content parts, got {other}"),
        )),
    }
}

fn str_field<'a>(
    obj: &'a Map<String, Value>,
    key: &str,
    what: &str,
) -> Result<&'a str, OpenAiError> {
    obj.get(key)
        .and_then(Value::as_str)
        .ok_or_else(|| bad("input", format!("{what} needs a string `{key}`")))
}

/// Chat messages of `instructions` and `input`.
fn messages(instructions: Option<&str>, input: &Value) -> Result<Vec<Value>, OpenAiError> {
    let mut out = Vec::new();
    if let Some(i) = instructions {
        out.push(json!({"role": "system", "content": i}));
    }
    let items = match input {
        Value::String(s) => {
            out.push(json!({"role": "user", "content": s}));
            return Ok(out);
        }
        Value::Array(items) => items,
        other => {
            return Err(bad(
                "input",
                format!("input must be a string or a list of input items, got {other}"),
            ))
        }
    };
    for (i, item) in items.iter().enumerate() {
        let what = format!("input[{i}]");
        let Some(obj) = item.as_object() else {
            return Err(bad("input", format!("{what} must be an object")));
        };
        // An easy input message may leave out its type.
        let ty = match obj.get("type") {
            None if obj.contains_key("role") => "message",
            Some(Value::String(t)) => t.as_str(),
            _ => return Err(bad("input", format!("{what} needs a string `type`"))),
        };
        match ty {
            "message" => {
                known_keys(
                    obj,
                    &["type", "role", "content", "id", "status", "phase"],
                    &what,
                    "input",
                )?;
                let role = str_field(obj, "role", &what)?;
                if !["user", "system", "developer", "assistant"].contains(&role) {
                    return Err(bad(
                        "input",
                        format!("{what} has an unknown role {role:?}; the roles are user, system, developer, assistant"),
                    ));
                }
                let text = content_text(&what, obj.get("content"))?;
                out.push(json!({"role": role, "content": text}));
            }
            "function_call" => {
                known_keys(
                    obj,
                    &["type", "call_id", "name", "arguments", "id", "status"],
                    &what,
                    "input",
                )?;
                let call = json!({
                    "id": str_field(obj, "call_id", &what)?,
                    "type": "function",
                    "function": {
                        "name": str_field(obj, "name", &what)?,
                        "arguments": str_field(obj, "arguments", &what)?,
                    },
                });
                // The calls of one turn, and the text before them, are one
                // assistant message (as chat templates render a turn).
                match out.last_mut() {
                    Some(last) if last["role"] == "assistant" => {
                        match last.get_mut("tool_calls").and_then(Value::as_array_mut) {
                            Some(calls) => calls.push(call),
                            None => last["tool_calls"] = json!([call]),
                        }
                    }
                    _ => out.push(json!({"role": "assistant", "content": null, "tool_calls": [call]})),
                }
            }
            "function_call_output" => {
                known_keys(
                    obj,
                    &["type", "call_id", "output", "id", "status", "name"],
                    &what,
                    "input",
                )?;
                let output = obj
                    .get("output")
                    .filter(|o| !o.is_null())
                    .ok_or_else(|| bad("input", format!("{what} needs `output`")))?;
                let content = content_text(&format!("{what}.output"), Some(output))?;
                let mut m = json!({"role": "tool", "content": content});
                if let Some(id) = obj.get("call_id").filter(|v| !v.is_null()) {
                    let id = id.as_str().ok_or_else(|| {
                        bad("input", format!("{what}.call_id must be a string"))
                    })?;
                    m["tool_call_id"] = json!(id);
                }
                out.push(m);
            }
            other => {
                return Err(bad(
                    "input",
                    format!("{what} is of type {other:?}, which this server does not support: input items are messages, function_call and function_call_output"),
                ))
            }
        }
    }
    Ok(out)
}

/// Flat Responses function tools as chat tools.
fn chat_tools(tools: &[Value]) -> Result<Vec<Value>, OpenAiError> {
    let mut out = Vec::with_capacity(tools.len());
    for (i, t) in tools.iter().enumerate() {
        let what = format!("tools[{i}]");
        let Some(obj) = t.as_object() else {
            return Err(bad("tools", format!("{what} must be an object")));
        };
        match obj.get("type").and_then(Value::as_str) {
            Some("function") => {}
            Some(other) => {
                return Err(bad(
                    "tools",
                    format!("{what} is a {other:?} tool; only function tools are supported"),
                ))
            }
            None => return Err(bad("tools", format!("{what} needs a string `type`"))),
        }
        known_keys(
            obj,
            &["type", "name", "description", "parameters", "strict"],
            &what,
            "tools",
        )?;
        if !obj.get("name").is_some_and(Value::is_string) {
            return Err(bad("tools", format!("{what} needs a string `name`")));
        }
        let mut function: Map<String, Value> = obj
            .iter()
            .filter(|(k, v)| k.as_str() != "type" && !v.is_null())
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        // The Responses API's function tools are strict unless they say not.
        function.entry("strict").or_insert(Value::Bool(true));
        out.push(json!({"type": "function", "function": function}));
    }
    Ok(out)
}

/// `tool_choice` in the chat shape, and whether it forces a call.
fn chat_tool_choice(choice: Option<&Value>) -> Result<(Option<Value>, bool), OpenAiError> {
    match choice {
        None | Some(Value::Null) => Ok((None, false)),
        Some(Value::String(c)) if ["auto", "none", "required"].contains(&c.as_str()) => {
            Ok((Some(json!(c)), c == "required"))
        }
        Some(Value::Object(o)) if o.get("type").and_then(Value::as_str) == Some("function") => {
            known_keys(o, &["type", "name"], "tool_choice", "tool_choice")?;
            let name = o.get("name").and_then(Value::as_str).ok_or_else(|| {
                bad(
                    "tool_choice",
                    "a named tool_choice is {\"type\": \"function\", \"name\": ...}".into(),
                )
            })?;
            Ok((
                Some(json!({"type": "function", "function": {"name": name}})),
                true,
            ))
        }
        Some(other) => Err(bad(
            "tool_choice",
            format!("tool_choice {other} is not supported; use \"auto\", \"none\", \"required\" or {{\"type\": \"function\", \"name\": ...}}"),
        )),
    }
}

/// The output constraint of `text.format`.
fn text_format(text: Option<&Value>) -> Result<Option<Constraint>, OpenAiError> {
    let Some(text) = text.filter(|t| !t.is_null()) else {
        return Ok(None);
    };
    let Some(obj) = text.as_object() else {
        return Err(bad("text", format!("text must be an object, got {text}")));
    };
    known_keys(obj, &["format", "verbosity"], "text", "text")?;
    if obj.get("verbosity").is_some_and(|v| !v.is_null()) {
        return Err(bad(
            "text",
            "text.verbosity is not supported (only null)".into(),
        ));
    }
    let Some(f) = obj.get("format").filter(|f| !f.is_null()) else {
        return Ok(None);
    };
    let Some(f) = f.as_object() else {
        return Err(bad(
            "text.format",
            format!("text.format must be an object, got {f}"),
        ));
    };
    match f.get("type").and_then(Value::as_str) {
        Some("text") => {
            known_keys(f, &["type"], "text.format", "text.format")?;
            Ok(None)
        }
        Some("json_object") => {
            known_keys(f, &["type"], "text.format", "text.format")?;
            Ok(Some(Constraint::JsonSchema(
                json!({"type": "object"}),
                Enforce::Strict,
            )))
        }
        Some("json_schema") => {
            // `strict: true`: every keyword enforced or a 400 (OpenAI's
            // meaning); otherwise what cannot be enforced is reported.
            known_keys(
                f,
                &["type", "name", "schema", "description", "strict"],
                "text.format",
                "text.format",
            )?;
            if !f.get("name").is_some_and(Value::is_string) {
                return Err(bad(
                    "text.format",
                    "text.format of type json_schema needs a string `name`".into(),
                ));
            }
            if f.get("strict").is_some_and(|s| !s.is_boolean() && !s.is_null()) {
                return Err(bad(
                    "text.format",
                    "text.format.strict must be a boolean".into(),
                ));
            }
            let enforce = Enforce::from_strict(f.get("strict") == Some(&Value::Bool(true)));
            match f.get("schema") {
                Some(s @ Value::Object(_)) => Ok(Some(Constraint::JsonSchema(s.clone(), enforce))),
                Some(other) => Err(bad(
                    "text.format",
                    format!("text.format.schema must be a JSON schema object, got {other}"),
                )),
                None => Err(bad(
                    "text.format",
                    "text.format of type json_schema needs a `schema`".into(),
                )),
            }
        }
        Some(t) => Err(bad(
            "text.format",
            format!("text.format type {t:?} is not supported; use \"text\", \"json_object\" or \"json_schema\""),
        )),
        None => Err(bad(
            "text.format",
            "text.format needs a string `type`".into(),
        )),
    }
}

/// A checked Responses request as a chat request, its output constraint,
/// and the request fields a `response` object echoes.
struct Plan {
    chat: ChatRequest,
    format: Option<(Constraint, &'static str)>,
    echo: Map<String, Value>,
}

fn plan(req: ResponsesRequest) -> Result<Plan, OpenAiError> {
    if req.previous_response_id.is_some() {
        return Err(bad(
            "previous_response_id",
            "previous_response_id is not supported: this server stores no responses; send the whole conversation as `input`".into(),
        ));
    }
    if req.reasoning.as_ref().is_some_and(|r| !r.is_null()) {
        return Err(bad(
            "reasoning",
            "reasoning settings are not supported (only null)".into(),
        ));
    }
    if let Some(t) = req.truncation.as_deref().filter(|t| *t != "disabled") {
        return Err(bad(
            "truncation",
            format!("truncation {t:?} is not supported; an input that does not fit is an error (\"disabled\")"),
        ));
    }
    if req.parallel_tool_calls == Some(false) {
        return Err(bad(
            "parallel_tool_calls",
            "parallel_tool_calls: false is not supported (the model may call several tools in one turn)".into(),
        ));
    }
    if let Some(n) = req.sampling.n.filter(|&n| n != 1) {
        return Err(bad(
            "n",
            format!("the Responses API answers one output; n must be 1, got {n}"),
        ));
    }
    let mut logprobs = false;
    for inc in req.include.iter().flatten() {
        match inc.as_str() {
            INCLUDE_LOGPROBS => logprobs = true,
            INCLUDE_REASONING => {}
            other => {
                return Err(bad(
                    "include",
                    format!("include {other:?} is not supported; this server can include {INCLUDE_LOGPROBS:?}"),
                ))
            }
        }
    }
    if req.top_logprobs.is_some_and(|k| k > 0) && !logprobs {
        return Err(bad(
            "top_logprobs",
            format!("top_logprobs needs include: [{INCLUDE_LOGPROBS:?}]"),
        ));
    }
    let messages = messages(req.instructions.as_deref(), &req.input)?;
    let tools = req.tools.as_deref().map(chat_tools).transpose()?;
    let (tool_choice, forced) = chat_tool_choice(req.tool_choice.as_ref())?;
    // A forced call is the whole output: there is no text to format.
    let format = text_format(req.text.as_ref())?
        .filter(|_| !forced)
        .map(|c| (c, "text.format"));
    let mut echo = Map::new();
    echo.insert("instructions".into(), json!(req.instructions));
    echo.insert("tools".into(), json!(req.tools.clone().unwrap_or_default()));
    echo.insert(
        "tool_choice".into(),
        req.tool_choice
            .clone()
            .filter(|c| !c.is_null())
            .unwrap_or(json!("auto")),
    );
    echo.insert(
        "text".into(),
        req.text
            .clone()
            .filter(|t| !t.is_null())
            .unwrap_or(json!({"format": {"type": "text"}})),
    );
    echo.insert("max_output_tokens".into(), json!(req.max_output_tokens));
    echo.insert("metadata".into(), json!(req.metadata.unwrap_or_default()));
    echo.insert("parallel_tool_calls".into(), json!(true));
    echo.insert("previous_response_id".into(), Value::Null);
    echo.insert("truncation".into(), json!("disabled"));
    echo.insert("top_logprobs".into(), json!(req.top_logprobs));
    echo.insert("store".into(), json!(false));
    let chat = ChatRequest {
        model: req.model,
        messages,
        tools,
        tool_choice,
        max_tokens: None,
        max_completion_tokens: req.max_output_tokens,
        logprobs: Some(logprobs),
        top_logprobs: req.top_logprobs,
        stream: req.stream,
        stream_options: None,
        chat_template_kwargs: None,
        response_format: None,
        vllm: Default::default(),
        sampling: req.sampling,
    };
    Ok(Plan { chat, format, echo })
}

/// Errors of the chat machinery, naming the Responses API's fields.
fn responses_param(e: OpenAiError) -> OpenAiError {
    match e {
        OpenAiError::BadRequest {
            message,
            param,
            code,
        } => OpenAiError::BadRequest {
            message,
            param: param.map(|p| match p.as_str() {
                "messages" | "prompt" => "input".into(),
                "max_completion_tokens" | "max_tokens" => "max_output_tokens".into(),
                _ => p,
            }),
            code,
        },
        other => other,
    }
}

/// The `response` object of one request, built as the output arrives.
pub(super) struct ResponseShape {
    id: String,
    created: u64,
    model: String,
    fingerprint: String,
    version: u64,
    /// The captured episode (a reward goes to it), as chat's `episode`.
    episode: Option<String>,
    echo: Map<String, Value>,
}

impl ResponseShape {
    fn new(id: &str, p: &Prepared, mut echo: Map<String, Value>) -> Self {
        echo.insert("temperature".into(), json!(p.sampling.params.temperature));
        echo.insert("top_p".into(), json!(p.sampling.params.top_p));
        Self {
            id: id.to_string(),
            created: now_secs(),
            model: p.model_name.clone(),
            fingerprint: p.fingerprint(),
            version: p.version,
            episode: p.capture.as_ref().map(|c| c.episode.clone()),
            echo,
        }
    }

    fn message_id(&self) -> String {
        format!("msg_{}", self.id)
    }

    /// The object, `status` one of in_progress / completed / incomplete.
    fn object(&self, status: &str, output: &[Value], usage: Option<Value>) -> Value {
        let mut v = json!({
            "id": self.id, "object": "response", "created_at": self.created, "status": status,
            "model": self.model, "output": output, "usage": usage, "error": null,
            "incomplete_details": null, "system_fingerprint": self.fingerprint,
            "version": self.version,
        });
        if let Some(e) = &self.episode {
            v["episode"] = json!(e);
        }
        if status == "incomplete" {
            v["incomplete_details"] = json!({"reason": "max_output_tokens"});
        }
        for (k, e) in &self.echo {
            v[k] = e.clone();
        }
        v
    }

    /// The output items of a finished sample: the assistant text as a
    /// `message` (unless the sample is tool calls alone; `message` forces
    /// one), then a `function_call` per tool call.
    fn output(
        &self,
        message: &Value,
        finish: &str,
        logprobs: Option<&Value>,
        force_message: bool,
    ) -> Vec<Value> {
        let calls = message
            .get("tool_calls")
            .and_then(Value::as_array)
            .cloned()
            .unwrap_or_default();
        let content = message.get("content").and_then(Value::as_str);
        let mut out = Vec::new();
        if content.is_some() || calls.is_empty() || force_message {
            let mut text =
                json!({"type": "output_text", "text": content.unwrap_or(""), "annotations": []});
            if let Some(lp) = logprobs {
                text["logprobs"] = lp.clone();
            }
            out.push(json!({
                "id": self.message_id(), "type": "message", "role": "assistant",
                "status": if finish == "length" { "incomplete" } else { "completed" },
                "content": [text],
            }));
        }
        for (k, c) in calls.iter().enumerate() {
            out.push(json!({
                "id": format!("fc_{}_{k}", self.id), "type": "function_call",
                "call_id": c["id"], "name": c["function"]["name"],
                "arguments": c["function"]["arguments"], "status": "completed",
            }));
        }
        out
    }
}

fn status(finish: &str) -> &'static str {
    if finish == "length" {
        "incomplete"
    } else {
        "completed"
    }
}

fn usage(p: &Prepared, output_tokens: usize) -> Value {
    let input = p.prompt_tokens();
    json!({
        "input_tokens": input,
        "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": input + output_tokens,
    })
}

/// The Responses API's streamed events of one response.
pub(super) struct ResponsesStream {
    shape: ResponseShape,
    /// Whether the output is parsed for tool calls.
    pub(super) parse_tools: bool,
    seq: u64,
    /// The message item was opened (text has streamed).
    message_open: bool,
}

impl ResponsesStream {
    fn event(&mut self, ty: &str, mut v: Value) -> Bytes {
        v["type"] = json!(ty);
        v["sequence_number"] = json!(self.seq);
        self.seq += 1;
        Bytes::from(format!("event: {ty}\ndata: {v}\n\n"))
    }

    /// `response.created` and `response.in_progress`.
    pub(super) fn open(&mut self) -> Vec<Bytes> {
        let r = self.shape.object("in_progress", &[], None);
        vec![
            self.event("response.created", json!({"response": r})),
            self.event("response.in_progress", json!({"response": r})),
        ]
    }

    fn open_message(&mut self, out: &mut Vec<Bytes>) {
        if self.message_open {
            return;
        }
        self.message_open = true;
        let id = self.shape.message_id();
        let item = json!({"id": id, "type": "message", "role": "assistant",
                          "status": "in_progress", "content": []});
        let e = self.event(
            "response.output_item.added",
            json!({"output_index": 0, "item": item}),
        );
        out.push(e);
        let e = self.event(
            "response.content_part.added",
            json!({"item_id": id, "output_index": 0, "content_index": 0,
                   "part": {"type": "output_text", "text": "", "annotations": []}}),
        );
        out.push(e);
    }

    /// Text of the message as it may be shown.
    pub(super) fn text_delta(&mut self, delta: &str) -> Vec<Bytes> {
        let mut out = Vec::new();
        self.open_message(&mut out);
        let id = self.shape.message_id();
        out.push(self.event(
            "response.output_text.delta",
            json!({"item_id": id, "output_index": 0, "content_index": 0,
                   "delta": delta, "logprobs": []}),
        ));
        out
    }

    /// The rest of the events once the sample is done: each output item
    /// closed (a function call's arguments in one delta), then
    /// `response.completed` (or `response.incomplete`).
    pub(super) fn finish(
        &mut self,
        message: &Value,
        finish: &str,
        logprobs: Option<&Value>,
        output_tokens: usize,
        p: &Prepared,
    ) -> Vec<Bytes> {
        let output = self
            .shape
            .output(message, finish, logprobs, self.message_open);
        let mut out = Vec::new();
        for (k, item) in output.iter().enumerate() {
            let id = item["id"].clone();
            if item["type"] == "message" {
                let part = item["content"][0].clone();
                let text = part["text"].as_str().unwrap_or("").to_string();
                if !self.message_open {
                    self.open_message(&mut out);
                    if !text.is_empty() {
                        out.extend(self.text_delta(&text));
                    }
                }
                let lp = part.get("logprobs").cloned().unwrap_or(json!([]));
                out.push(self.event(
                    "response.output_text.done",
                    json!({"item_id": id, "output_index": k, "content_index": 0,
                           "text": text, "logprobs": lp}),
                ));
                out.push(self.event(
                    "response.content_part.done",
                    json!({"item_id": id, "output_index": k, "content_index": 0, "part": part}),
                ));
            } else {
                let mut added = item.clone();
                added["arguments"] = json!("");
                added["status"] = json!("in_progress");
                out.push(self.event(
                    "response.output_item.added",
                    json!({"output_index": k, "item": added}),
                ));
                out.push(self.event(
                    "response.function_call_arguments.delta",
                    json!({"item_id": id, "output_index": k, "delta": item["arguments"]}),
                ));
                out.push(self.event(
                    "response.function_call_arguments.done",
                    json!({"item_id": id, "output_index": k, "name": item["name"],
                           "arguments": item["arguments"]}),
                ));
            }
            out.push(self.event(
                "response.output_item.done",
                json!({"output_index": k, "item": item}),
            ));
        }
        let st = status(finish);
        let r = self
            .shape
            .object(st, &output, Some(usage(p, output_tokens)));
        let ty = if st == "incomplete" {
            "response.incomplete"
        } else {
            "response.completed"
        };
        out.push(self.event(ty, json!({"response": r})));
        out
    }

    /// The `error` event of a stream that failed after its headers.
    pub(super) fn failed(&mut self, err: &OpenAiError) -> Bytes {
        let body = match err {
            // The client's fault (a grammar limit hit while generating).
            OpenAiError::BadRequest {
                message,
                param,
                code,
            } => json!({"code": code.unwrap_or("invalid_request_error"), "message": message,
                        "param": param}),
            _ => json!({"code": "server_error", "message": "internal error (see the server log)",
                        "param": null}),
        };
        self.event("error", body)
    }
}

/// The output text's logprobs when the client asked (chat's
/// `logprobs.content` entries have the Responses API's shape).
pub(super) fn output_logprobs(
    s: &OpenAiState,
    p: &Prepared,
    f: &Finished,
    scores: Option<&TopLogprobs>,
) -> Option<Value> {
    match scores {
        Some(r) if p.logprobs => {
            Some(chat_logprobs(s, &f.tokens, r, p.vllm.tokens_as_ids)["content"].clone())
        }
        _ => None,
    }
}

pub(super) async fn responses(
    State(s): State<OpenAiState>,
    episode: EpisodeTag,
    body: Bytes,
) -> Result<Response, OpenAiError> {
    let started = Instant::now();
    let req: ResponsesRequest = parse_body(&body)?;
    let stream = req.stream.unwrap_or(false);
    let Plan { chat, format, echo } = plan(req)?;
    let ChatRun {
        mut p,
        parse_tools,
        rx,
    } = start_chat(&s, &episode, &chat, format)
        .await
        .map_err(responses_param)?;
    if let Some(c) = p.capture.as_mut() {
        c.endpoint = "responses";
    }
    let id = s.request_id("resp");
    let u = unenforced(&p);
    let mut echo = echo;
    if !u.is_empty() {
        echo.insert(UNENFORCED_FIELD.into(), json!(u));
    }
    let shape = ResponseShape::new(&id, &p, echo);
    if stream {
        let r = ResponsesStream {
            shape,
            parse_tools,
            seq: 0,
            message_open: false,
        };
        let r = sse(
            s.clone(),
            rx,
            p,
            StreamKind::Responses(Box::new(r)),
            id,
            false,
            started,
        );
        return Ok(unenforced_header(&u, r));
    }
    let f = collect(&s, rx, 1, started)
        .await?
        .into_iter()
        .next()
        .ok_or_else(|| OpenAiError::Internal("a response without its sample".into()))?;
    let scores = capture::score_choice(&s, &p, &f, false).await?;
    let (message, finish) = chat_message(&f, parse_tools, &id);
    capture::record(&s, &p, &id, &f, finish, scores.as_ref(), message.clone())?;
    let lp = output_logprobs(&s, &p, &f, scores.as_ref());
    let output = shape.output(&message, finish, lp.as_ref(), false);
    let usage_of = usage(&p, f.tokens.len());
    let body = Json(shape.object(status(finish), &output, Some(usage_of)));
    Ok(unenforced_header(&u, body.into_response()))
}
