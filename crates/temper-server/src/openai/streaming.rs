//! Server-sent events: chunks per choice as text arrives, logprobs and
//! tool calls with the last chunk, then `[DONE]`; for `/v1/responses`, the
//! Responses API's typed events instead (see `responses`). With vLLM's
//! `return_token_ids`, the prompt's ids come with the first chunk (chat: of
//! the stream; completions: of each choice) and a choice's generated ids
//! with its last chunk.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::time::Instant;

use axum::body::{Body, Bytes};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::{json, Value};
use tokio::sync::mpsc::UnboundedReceiver;

use super::error::OpenAiError;

use super::capture;
use super::chat::chat_message;
use super::jobs::Prepared;
use super::response::{chat_logprobs, completion_logprobs, mark_unenforced, usage};
use super::responses::{output_logprobs, ResponsesStream};
use super::state::{now_secs, OpenAiState};
use super::tools;
use crate::scheduler::Event;

pub(super) enum StreamKind {
    Chat {
        tools: bool,
    },
    Completion,
    /// `/v1/responses`: its own typed events (one choice).
    Responses(Box<ResponsesStream>),
}

impl StreamKind {
    /// Whether the output is parsed for tool calls.
    fn tools(&self) -> bool {
        match self {
            StreamKind::Chat { tools } => *tools,
            StreamKind::Responses(r) => r.parse_tools,
            StreamKind::Completion => false,
        }
    }
}

struct ChoiceState {
    /// Text received from the engine.
    text: String,
    /// Bytes of `text` sent as content.
    sent: usize,
    started: bool,
    /// A chunk of this choice went out (completions' `prompt_token_ids`).
    chunked: bool,
}

impl ChoiceState {
    fn sent_text(&self) -> &str {
        self.text.get(..self.sent).unwrap_or("")
    }
}

struct StreamState {
    s: OpenAiState,
    rx: UnboundedReceiver<Event>,
    p: Prepared,
    kind: StreamKind,
    id: String,
    include_usage: bool,
    started: Instant,
    created: u64,
    choices: Vec<ChoiceState>,
    left: usize,
    completion_tokens: usize,
    queue: VecDeque<Bytes>,
    first_token: bool,
    finished: bool,
    /// Chat's `prompt_token_ids` went out (with the first chunk).
    prompt_ids_sent: bool,
}

impl StreamState {
    pub(super) fn chunk(&mut self, mut choices: Value, usage: Option<Value>) -> Bytes {
        let object = match self.kind {
            StreamKind::Completion => "text_completion",
            _ => "chat.completion.chunk",
        };
        let ids = self.p.vllm.return_token_ids;
        if let (true, StreamKind::Completion, Some(list)) =
            (ids, &self.kind, choices.as_array_mut())
        {
            for c in list {
                let Some(i) = c["index"].as_u64().map(|i| i as usize) else {
                    continue;
                };
                if let Some(st) = self.choices.get_mut(i).filter(|st| !st.chunked) {
                    st.chunked = true;
                    let pi = i / self.p.sampling.n;
                    c["prompt_token_ids"] = json!(self.p.prompts.get(pi));
                }
            }
        }
        let mut v = json!({
            "id": self.id, "object": object, "created": self.created, "model": self.p.model_name,
            "system_fingerprint": self.p.fingerprint(), "version": self.p.version, "choices": choices,
        });
        if ids && matches!(self.kind, StreamKind::Chat { .. }) && !self.prompt_ids_sent {
            self.prompt_ids_sent = true;
            v["prompt_token_ids"] = json!(self.p.prompts.first());
        }
        if let Some(c) = &self.p.capture {
            // As the unstreamed body: the episode a reward goes to.
            v["episode"] = json!(c.episode);
        }
        if let Some(u) = usage {
            v["usage"] = u;
        }
        if let Some(g) = &self.p.grammar {
            mark_unenforced(g.unenforced(), &mut v);
        }
        Bytes::from(format!("data: {v}\n\n"))
    }

    /// Send content for choice `i` up to what may be shown now.
    fn push_content(&mut self, i: usize, final_text: Option<&str>) {
        let tools = self.kind.tools();
        let c = &self.choices[i];
        let text: &str = final_text.unwrap_or(&c.text);
        // Mid-stream with tools on, hold back a possible `<tool_call>` and
        // trailing whitespace (the parsed content is trimmed); the final text
        // goes out whole.
        let end = if tools && final_text.is_none() {
            text[..tools::content_prefix_len(text)].trim_end().len()
        } else {
            text.len()
        };
        if end <= c.sent || !text.is_char_boundary(c.sent) || !text.is_char_boundary(end) {
            return;
        }
        let delta = text[c.sent..end].to_string();
        self.choices[i].sent = end;
        let choice = match &mut self.kind {
            StreamKind::Responses(r) => {
                let events = r.text_delta(&delta);
                self.queue.extend(events);
                return;
            }
            StreamKind::Chat { .. } => {
                let mut d = json!({"content": delta});
                if !self.choices[i].started {
                    d["role"] = json!("assistant");
                    self.choices[i].started = true;
                }
                json!([{"index": i, "delta": d, "logprobs": null, "finish_reason": null}])
            }
            StreamKind::Completion => {
                json!([{"index": i, "text": delta, "logprobs": null, "finish_reason": null}])
            }
        };
        let b = self.chunk(choice, None);
        self.queue.push_back(b);
    }

    async fn handle(&mut self, ev: Event) -> Result<(), OpenAiError> {
        if self.first_token && matches!(ev, Event::Delta { .. } | Event::Done(_)) {
            self.first_token = false;
            self.s
                .inner
                .metrics
                .ttft
                .observe(self.started.elapsed().as_secs_f64());
        }
        match ev {
            Event::Delta { index, text } => {
                if index < self.choices.len() {
                    self.choices[index].text.push_str(&text);
                    self.push_content(index, None);
                }
                Ok(())
            }
            Event::Done(f) => {
                let i = f.index;
                if i >= self.choices.len() {
                    return Ok(());
                }
                self.left -= 1;
                self.completion_tokens += f.tokens.len();
                let scores = capture::score_choice(&self.s, &self.p, &f, false).await?;
                // Chat and Responses: the assistant message (tool calls parsed).
                let chat = match self.kind {
                    StreamKind::Completion => None,
                    _ => Some(chat_message(&f, self.kind.tools(), &self.id)),
                };
                if self.p.capture.is_some() {
                    let (response, finish) = chat
                        .clone()
                        .unwrap_or_else(|| (json!({"text": f.text}), f.finish_reason.as_str()));
                    capture::record(
                        &self.s,
                        &self.p,
                        &self.id,
                        &f,
                        finish,
                        scores.as_ref(),
                        response,
                    )?;
                }
                let as_ids = self.p.vllm.tokens_as_ids;
                // The final text goes out whole: what was held back, too.
                let final_text = match &chat {
                    Some((m, _)) => m.get("content").and_then(Value::as_str).unwrap_or(""),
                    None => f.text.as_str(),
                };
                if final_text.starts_with(self.choices[i].sent_text()) {
                    self.push_content(i, Some(final_text));
                }
                let responses = matches!(self.kind, StreamKind::Responses(_));
                let last = match chat {
                    Some((message, finish)) if responses => {
                        let lp = output_logprobs(&self.s, &self.p, &f, scores.as_ref());
                        if let StreamKind::Responses(r) = &mut self.kind {
                            let events =
                                r.finish(&message, finish, lp.as_ref(), f.tokens.len(), &self.p);
                            self.queue.extend(events);
                        }
                        None
                    }
                    Some((message, finish)) => {
                        let lp = match scores {
                            Some(r) if self.p.logprobs => {
                                chat_logprobs(&self.s, &f.tokens, &r, as_ids)
                            }
                            _ => Value::Null,
                        };
                        let mut delta = json!({});
                        if !self.choices[i].started {
                            delta["role"] = json!("assistant");
                            delta["content"] = json!("");
                        }
                        if let Some(Value::Array(calls)) = message.get("tool_calls") {
                            let calls: Vec<Value> = calls
                                .iter()
                                .enumerate()
                                .map(|(k, c)| {
                                    let mut c = c.clone();
                                    c["index"] = json!(k);
                                    c
                                })
                                .collect();
                            delta["tool_calls"] = Value::Array(calls);
                        }
                        Some(
                            json!([{"index": i, "delta": delta, "logprobs": lp, "finish_reason": finish}]),
                        )
                    }
                    None => {
                        let lp = match scores {
                            Some(r) if self.p.logprobs => {
                                let e: Vec<_> = r
                                    .logprobs
                                    .iter()
                                    .zip(r.top)
                                    .map(|(&l, t)| Some((l, t)))
                                    .collect();
                                completion_logprobs(&self.s, &f.tokens, &e, 0, as_ids)
                            }
                            _ => Value::Null,
                        };
                        Some(
                            json!([{"index": i, "text": "", "logprobs": lp, "finish_reason": f.finish_reason.as_str()}]),
                        )
                    }
                };
                if let Some(mut last) = last {
                    if self.p.vllm.return_token_ids {
                        last[0]["token_ids"] = json!(f.tokens);
                    }
                    let b = self.chunk(last, None);
                    self.queue.push_back(b);
                }
                if self.left == 0 {
                    self.s
                        .inner
                        .metrics
                        .latency
                        .observe(self.started.elapsed().as_secs_f64());
                    // The Responses API ends with `response.completed`.
                    if !responses {
                        if self.include_usage {
                            let u = usage(self.p.prompt_tokens(), self.completion_tokens);
                            let b = self.chunk(json!([]), Some(u));
                            self.queue.push_back(b);
                        }
                        self.queue
                            .push_back(Bytes::from_static(b"data: [DONE]\n\n"));
                    }
                    self.finished = true;
                }
                Ok(())
            }
            Event::Failed(m) => Err(OpenAiError::Engine(m)),
            Event::Rejected(m) => Err(OpenAiError::grammar_limit(m)),
        }
    }
}

/// A server-sent-event response. Dropping it (the client went away) drops
/// the event receiver, which cancels the request in the scheduler.
pub(super) fn sse(
    s: OpenAiState,
    rx: UnboundedReceiver<Event>,
    p: Prepared,
    kind: StreamKind,
    id: String,
    include_usage: bool,
    started: Instant,
) -> Response {
    let total = p.total_choices();
    let mut state = StreamState {
        s,
        rx,
        kind,
        id,
        include_usage,
        started,
        created: now_secs(),
        choices: (0..total)
            .map(|_| ChoiceState {
                text: String::new(),
                sent: 0,
                started: false,
                chunked: false,
            })
            .collect(),
        left: total,
        completion_tokens: 0,
        queue: VecDeque::new(),
        first_token: true,
        finished: false,
        prompt_ids_sent: false,
        p,
    };
    if let StreamKind::Responses(r) = &mut state.kind {
        let events = r.open();
        state.queue.extend(events);
    }
    let stream = futures_util::stream::unfold(Some(state), |st| async move {
        let mut st = st?;
        loop {
            if let Some(b) = st.queue.pop_front() {
                return Some((Ok::<Bytes, Infallible>(b), Some(st)));
            }
            if st.finished {
                return None;
            }
            let failure = match st.rx.recv().await {
                Some(ev) => match st.handle(ev).await {
                    Ok(()) => continue,
                    Err(e) => e,
                },
                None => OpenAiError::Internal("the engine dropped a request".into()),
            };
            // Headers are sent: report the failure in-band and end the stream.
            let b = match (&mut st.kind, failure) {
                (StreamKind::Responses(r), e) => {
                    if !matches!(e, OpenAiError::BadRequest { .. }) {
                        tracing::error!("stream failed: {e}");
                    }
                    r.failed(&e)
                }
                (_, OpenAiError::BadRequest { message, code, .. }) => {
                    let body = json!({"error": {"message": message, "type": "invalid_request_error", "code": code}});
                    Bytes::from(format!("data: {body}\n\n"))
                }
                (_, other) => {
                    tracing::error!("stream failed: {other}");
                    let body = json!({"error": {"message": "internal error (see the server log)", "type": "server_error"}});
                    Bytes::from(format!("data: {body}\n\n"))
                }
            };
            return Some((Ok(b), None));
        }
    });
    Response::builder()
        .status(StatusCode::OK)
        .header(header::CONTENT_TYPE, "text/event-stream")
        .header(header::CACHE_CONTROL, "no-cache")
        .body(Body::from_stream(stream))
        .unwrap_or_else(|_| OpenAiError::Internal("building the stream".into()).into_response())
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;
    use std::sync::Arc;

    use temper_model::{FinishReason, LoadOptions, Pretrained, SamplingParams};
    use tokio::sync::mpsc::unbounded_channel;

    use super::*;
    use crate::openai::protocol::Sampling;
    use crate::openai::ServeConfig;
    use crate::scheduler::Finished;

    fn state() -> OpenAiState {
        let dir =
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/models/tiny-qwen3");
        let m = Pretrained::load(&dir, &LoadOptions::default()).expect("fixture");
        let cfg = ServeConfig::defaults("tiny", &m);
        OpenAiState::new(Arc::new(m), cfg)
    }

    /// A streamed answer that ends in a Hermes tool call: the content before
    /// it streams (the tag never leaks), the last chunk carries `tool_calls`
    /// with finish_reason `tool_calls` — the same message as non-streamed.
    #[tokio::test]
    async fn streamed_tool_calls_end_with_tool_calls() {
        let s = state();
        let (_tx, rx) = unbounded_channel();
        let p = Prepared {
            capture: None,
            prompts: vec![vec![1, 2]],
            sampling: Sampling {
                params: SamplingParams::default(),
                n: 1,
            },
            adapter: None,
            model_name: "tiny".into(),
            version: 0,
            top_logprobs: 0,
            logprobs: false,
            grammar: None,
            vllm: Default::default(),
        };
        let mut st = StreamState {
            s,
            rx,
            p,
            kind: StreamKind::Chat { tools: true },
            id: "chatcmpl-t".into(),
            include_usage: false,
            started: Instant::now(),
            created: 0,
            choices: vec![ChoiceState {
                text: String::new(),
                sent: 0,
                started: false,
                chunked: false,
            }],
            left: 1,
            completion_tokens: 0,
            queue: VecDeque::new(),
            first_token: true,
            finished: false,
            prompt_ids_sent: false,
        };
        let call = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>";
        let full = format!("Let me check. {call}");
        for piece in ["Let me ", "check. <tool", &call[5..]] {
            st.handle(Event::Delta {
                index: 0,
                text: piece.to_string(),
            })
            .await
            .expect("delta");
        }
        let done = Finished {
            index: 0,
            tokens: vec![3, 4, 5],
            text: full.clone(),
            finish_reason: FinishReason::Stop,
            top_logprobs: None,
        };
        let (message, finish) = chat_message(&done, true, "chatcmpl-t");
        st.handle(Event::Done(done)).await.expect("done");
        let events: Vec<String> = st
            .queue
            .iter()
            .map(|b| String::from_utf8(b.to_vec()).expect("utf8"))
            .collect();
        assert_eq!(events.last().map(String::as_str), Some("data: [DONE]\n\n"));
        let chunks: Vec<Value> = events[..events.len() - 1]
            .iter()
            .map(|e| serde_json::from_str(e.trim_start_matches("data: ").trim()).expect("json"))
            .collect();
        let content: String = chunks
            .iter()
            .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
            .collect();
        assert_eq!(content, "Let me check.");
        assert_eq!(message["content"], "Let me check.");
        assert_eq!(finish, "tool_calls");
        let last = &chunks[chunks.len() - 1]["choices"][0];
        assert_eq!(last["finish_reason"], "tool_calls");
        let tc = &last["delta"]["tool_calls"][0];
        assert_eq!(tc["index"], 0);
        assert_eq!(tc["type"], "function");
        assert_eq!(tc["function"]["name"], "get_weather");
        assert_eq!(tc["function"]["arguments"], "{\"city\": \"Paris\"}");
        assert_eq!(tc["id"], message["tool_calls"][0]["id"]);
        assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    }
}
