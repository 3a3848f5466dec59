//! The gate: a rollout's model, offered to a program that was written for
//! an OpenAI endpoint.
//!
//! An agent or environment program that calls `POST /v1/chat/completions`
//! itself (a Harbor `command` agent, a verifiers environment's harness)
//! gets the `/v1` base URL of a loopback endpoint that this rollout serves
//! ([`Gate::base_url`]); an in-process agent gets a [`ChatModel`]
//! ([`Gate::model`]). Both hand each call to the rollout, which answers it
//! with the rollout's model ([`answer_calls`]): the evaluated endpoint, or
//! the policy being trained. Every answered call is kept as the
//! [`ModelTurn`] the model returned — with a trained policy its
//! [`TokenTrace`](crate::TokenTrace): prompt ids, completion ids, the
//! sampler's logprobs, the policy version — so RL trains on exactly the
//! tokens that were sampled, never on re-tokenized text.
//!
//! The rollout's sampling arguments replace the caller's on every call (RL's
//! `[sampling]`, `temper eval -S`): the trainer scores the distribution that
//! was sampled. `stream: true` is answered as server-sent events of the
//! finished turn (one content delta, one delta per tool call, the finish
//! reason, usage, `[DONE]`), since many clients ask for a stream.

use std::future::Future;
use std::sync::Arc;

use async_trait::async_trait;
use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use futures::channel::oneshot;
use rand::Rng;
use serde::Deserialize;
use serde_json::{json, Value};
use tokio::sync::mpsc;

use crate::{ChatModel, ChatRequest, Message, ModelCallError, ModelTurn, SamplingArgs};

/// The model name callers see (`OPENAI_MODEL`, `/v1/models`).
pub const MODEL_NAME: &str = "policy";

/// One model call from the caller's side, waiting for its answer.
pub struct Call {
    /// What was asked (its sampling is replaced by the rollout's).
    pub request: ChatRequest,
    /// Where the answer goes.
    pub reply: oneshot::Sender<Result<ModelTurn, ModelCallError>>,
}

/// The caller's side of the gate. Calls reach the rollout until the last
/// `Gate`, [`Gate::model`] and endpoint are gone.
pub struct Gate {
    tx: mpsc::UnboundedSender<Call>,
}

/// The calls a gate forwards, for [`answer_calls`].
pub type Calls = mpsc::UnboundedReceiver<Call>;

#[derive(Clone)]
struct GateModel {
    tx: mpsc::UnboundedSender<Call>,
}

#[async_trait]
impl ChatModel for GateModel {
    async fn chat(&self, request: ChatRequest) -> Result<ModelTurn, ModelCallError> {
        let (reply, answer) = oneshot::channel();
        let gone = || ModelCallError::Other("the rollout is over".into());
        self.tx.send(Call { request, reply }).map_err(|_| gone())?;
        answer.await.map_err(|_| gone())?
    }
}

/// `n` random lowercase hex digits (ids of chat completions).
fn hex_id(n: usize) -> String {
    let mut rng = rand::rng();
    (0..n)
        .map(|_| char::from_digit(rng.random_range(0..16), 16).unwrap_or('0'))
        .collect()
}

impl Gate {
    /// A gate and the calls that come through it.
    pub fn new() -> (Self, Calls) {
        let (tx, rx) = mpsc::unbounded_channel();
        (Self { tx }, rx)
    }

    /// The gate as a [`ChatModel`], for in-process agents.
    pub fn model(&self) -> Arc<dyn ChatModel> {
        Arc::new(GateModel {
            tx: self.tx.clone(),
        })
    }

    /// Starts the loopback endpoint (on the current tokio runtime; it stops
    /// when the gate's receiver is dropped) and returns its `/v1` base URL.
    pub fn base_url(&self) -> Result<String, String> {
        let listener = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.set_nonblocking(true).map(|()| l))
            .map_err(|e| format!("gate endpoint: {e}"))?;
        let addr = listener
            .local_addr()
            .map_err(|e| format!("gate endpoint: {e}"))?;
        let listener = tokio::net::TcpListener::from_std(listener)
            .map_err(|e| format!("gate endpoint: {e}"))?;
        let model = GateModel {
            tx: self.tx.clone(),
        };
        let closed = self.tx.clone();
        let app = Router::new()
            .route("/v1/chat/completions", post(chat_completions))
            .route("/v1/models", get(models))
            .with_state(model);
        tokio::spawn(async move {
            let _ = axum::serve(listener, app)
                .with_graceful_shutdown(async move { closed.closed().await })
                .await;
        });
        Ok(format!("http://{addr}/v1"))
    }
}

/// Runs `work` (the program or agent that calls through the gate) to its
/// end while answering its calls with `model` under `sampling`. Returns
/// what `work` returned and the turns the caller received, in call order:
/// a turn counts only once the caller has it (a caller that gave up on a
/// call drops it).
pub async fn answer_calls<F: Future>(
    model: &dyn ChatModel,
    sampling: &SamplingArgs,
    mut calls: Calls,
    work: F,
) -> (F::Output, Vec<ModelTurn>) {
    tokio::pin!(work);
    let mut turns: Vec<ModelTurn> = Vec::new();
    let mut open = true;
    let out = loop {
        tokio::select! {
            call = calls.recv(), if open => match call {
                Some(call) => {
                    let mut req = call.request;
                    req.sampling = sampling.clone();
                    match model.chat(req).await {
                        Ok(turn) => {
                            if call.reply.send(Ok(turn.clone())).is_ok() {
                                turns.push(turn);
                            }
                        }
                        Err(e) => {
                            let _ = call.reply.send(Err(e));
                        }
                    }
                }
                None => open = false,
            },
            out = &mut work => break out,
        }
    };
    (out, turns)
}

async fn models() -> Json<Value> {
    Json(
        json!({"object": "list", "data": [{"id": MODEL_NAME, "object": "model", "owned_by": "temper"}]}),
    )
}

#[derive(Deserialize)]
struct ChatBody {
    messages: Vec<Message>,
    #[serde(default)]
    tools: Option<Vec<Value>>,
    #[serde(default)]
    stream: bool,
}

fn error(status: StatusCode, message: String) -> Response {
    (
        status,
        Json(json!({"error": {"message": message, "type": "invalid_request_error"}})),
    )
        .into_response()
}

async fn chat_completions(State(model): State<GateModel>, body: axum::body::Bytes) -> Response {
    let body: ChatBody = match serde_json::from_slice(&body) {
        Ok(b) => b,
        Err(e) => return error(StatusCode::BAD_REQUEST, format!("bad request body: {e}")),
    };
    let request = ChatRequest {
        messages: body.messages,
        tools: body.tools.filter(|t| !t.is_empty()),
        // Replaced by the rollout's sampling arguments.
        sampling: SamplingArgs::default(),
    };
    let turn = match model.chat(request).await {
        Ok(t) => t,
        Err(e) => {
            let status = match e {
                ModelCallError::PromptTooLong(_) => StatusCode::BAD_REQUEST,
                _ => StatusCode::BAD_GATEWAY,
            };
            return error(status, e.to_string());
        }
    };
    let id = format!("chatcmpl-{}", hex_id(16));
    let created = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let usage = json!({
        "prompt_tokens": turn.usage.prompt_tokens,
        "completion_tokens": turn.usage.completion_tokens,
        "total_tokens": turn.usage.prompt_tokens + turn.usage.completion_tokens,
    });
    if body.stream {
        return (
            [(header::CONTENT_TYPE, "text/event-stream")],
            sse_events(&id, created, &turn, usage),
        )
            .into_response();
    }
    Json(json!({
        "id": id,
        "object": "chat.completion",
        "created": created,
        "model": MODEL_NAME,
        "choices": [{"index": 0, "message": turn.message, "finish_reason": turn.finish_reason}],
        "usage": usage,
    }))
    .into_response()
}

/// A finished turn as the events of an OpenAI chat completion stream.
fn sse_events(id: &str, created: u64, turn: &ModelTurn, usage: Value) -> String {
    let chunk = |choices: Value, usage: Option<&Value>| {
        let mut c = json!({
            "id": id, "object": "chat.completion.chunk", "created": created,
            "model": MODEL_NAME, "choices": choices,
        });
        if let Some(u) = usage {
            c["usage"] = u.clone();
        }
        format!("data: {c}\n\n")
    };
    let delta = |d: Value| json!([{"index": 0, "delta": d, "finish_reason": null}]);
    let m = &turn.message;
    let mut first = json!({"role": "assistant", "content": m.content.as_ref().map(|_| m.text())});
    for (k, v) in &m.extra {
        first[k] = v.clone();
    }
    let mut out = chunk(delta(first), None);
    for (i, call) in m.tool_calls.iter().flatten().enumerate() {
        let d = json!({"tool_calls": [{
            "index": i, "id": call.id, "type": call.kind,
            "function": {"name": call.function.name, "arguments": call.function.arguments},
        }]});
        out.push_str(&chunk(delta(d), None));
    }
    out.push_str(&chunk(
        json!([{"index": 0, "delta": {}, "finish_reason": turn.finish_reason}]),
        None,
    ));
    out.push_str(&chunk(json!([]), Some(&usage)));
    out.push_str("data: [DONE]\n\n");
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{FunctionCall, ToolCall, Usage};

    /// Answers every call with a tool call, then text; counts the calls.
    struct Scripted;

    #[async_trait]
    impl ChatModel for Scripted {
        async fn chat(&self, req: ChatRequest) -> Result<ModelTurn, ModelCallError> {
            assert_eq!(req.sampling.max_tokens, 7, "the rollout's sampling applies");
            let mut message = Message::assistant("sum: ");
            if req.messages.len() == 1 {
                message.tool_calls = Some(vec![ToolCall {
                    id: "call_1".into(),
                    kind: "function".into(),
                    function: FunctionCall {
                        name: "add".into(),
                        arguments: "{\"a\":1}".into(),
                    },
                }]);
            }
            Ok(ModelTurn {
                message,
                finish_reason: "stop".into(),
                usage: Usage {
                    prompt_tokens: 3,
                    completion_tokens: 2,
                },
                trace: None,
            })
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_endpoint_answers_plain_and_streamed_calls_and_keeps_each_turn() {
        let (gate, calls) = Gate::new();
        let url = gate.base_url().expect("endpoint");
        drop(gate);
        let sampling = SamplingArgs {
            max_tokens: 7,
            ..SamplingArgs::default()
        };
        let work = async move {
            let c = reqwest::Client::new();
            let post = |body: Value| c.post(format!("{url}/chat/completions")).json(&body).send();
            let user = json!([{"role": "user", "content": "1+?"}]);
            let plain: Value = post(json!({"model": "x", "messages": user, "max_tokens": 99}))
                .await
                .expect("plain")
                .json()
                .await
                .expect("json");
            let two =
                json!([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]);
            let streamed = post(json!({"messages": two, "stream": true}))
                .await
                .expect("stream");
            let kind = streamed.headers()[header::CONTENT_TYPE].clone();
            let text = streamed.text().await.expect("text");
            let bad = post(json!({"nope": 1})).await.expect("bad").status();
            (plain, kind, text, bad)
        };
        let ((plain, kind, text, bad), turns) =
            answer_calls(&Scripted, &sampling, calls, work).await;
        assert_eq!(plain["model"], MODEL_NAME);
        assert_eq!(
            plain["choices"][0]["message"]["tool_calls"][0]["function"]["name"],
            "add"
        );
        assert_eq!(plain["usage"]["total_tokens"], 5);
        assert_eq!(kind, "text/event-stream");
        let events: Vec<&str> = text
            .split("\n\n")
            .filter(|e| !e.is_empty())
            .map(|e| e.strip_prefix("data: ").expect("data event"))
            .collect();
        assert_eq!(events.last(), Some(&"[DONE]"));
        let chunks: Vec<Value> = events[..events.len() - 1]
            .iter()
            .map(|e| serde_json::from_str(e).expect("chunk"))
            .collect();
        assert_eq!(chunks[0]["choices"][0]["delta"]["content"], "sum: ");
        assert_eq!(chunks[1]["choices"][0]["finish_reason"], "stop");
        assert_eq!(chunks[2]["usage"]["completion_tokens"], 2);
        assert_eq!(bad, StatusCode::BAD_REQUEST);
        // Both answered calls are the rollout's turns, in order.
        assert_eq!(turns.len(), 2);
        assert!(turns[0].message.tool_calls.is_some());
        assert!(turns[1].message.tool_calls.is_none());
    }
}
