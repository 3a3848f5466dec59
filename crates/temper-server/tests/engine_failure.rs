//! Issue 35 §4: failures that show. A panic in one batch's work (as a
//! kernel `assert!` tripped by a request would raise) fails that request
//! alone with a 500 naming the panic, and the next request succeeds; a
//! panic in the batch loop's own state kills the engine, and `/health`
//! then answers 503 with the reason instead of "ok". The panics are real,
//! raised on the engine thread by the `fault-hooks` test hooks.
//!
//! One test, in its own binary: the hooks are process-wide.

mod common;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use common::{post, send, server, MODEL};
use serde_json::{json, Value};
use temper_server::openai::app;
use temper_server::scheduler::fault;

async fn health(r: &axum::Router) -> (StatusCode, Value) {
    let (status, bytes) = send(r, Request::get("/health").body(Body::empty()).unwrap()).await;
    (status, serde_json::from_slice(&bytes).unwrap())
}

fn completion(prompt: &[u32]) -> Value {
    json!({"model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0.0})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panicking_batch_fails_alone_and_a_dead_engine_fails_health() {
    let (_, state) = server();
    let r = app(state);
    assert_eq!(health(&r).await, (StatusCode::OK, json!({"status": "ok"})));

    // Token 7 trips an assertion in the prefill: that request gets a 500
    // naming the panic; the engine lives on.
    fault::panic_on_token(7);
    let (status, body) = post(&r, "/v1/completions", completion(&[5, 7, 9])).await;
    assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR, "{body}");
    let msg = body["error"]["message"].as_str().unwrap_or_default();
    assert!(
        msg.contains("prefill panicked") && msg.contains("fault hook: token 7"),
        "{body}"
    );
    assert_eq!(body["error"]["code"], "engine_error");
    assert_eq!(health(&r).await.0, StatusCode::OK);
    let (status, body) = post(&r, "/v1/completions", completion(&[5, 8, 9])).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(body["choices"][0]["finish_reason"], "length", "{body}");

    // A panic outside any batch's work: the engine's state cannot be
    // trusted, so it dies; the request it held fails, /health says why,
    // and later requests are refused with 503 instead of hanging.
    fault::panic_in_loop();
    let (status, body) = post(&r, "/v1/completions", completion(&[5, 8, 9])).await;
    assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR, "{body}");
    let (status, h) = health(&r).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{h}");
    assert_eq!(h["status"], "engine_dead");
    let reason = h["reason"].as_str().unwrap_or_default();
    assert!(
        reason.contains("the engine thread panicked")
            && reason.contains("fault hook: the batch loop's own state"),
        "{h}"
    );
    let (status, body) = post(&r, "/v1/completions", completion(&[5, 8, 9])).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{body}");
    assert_eq!(body["error"]["code"], "engine_unavailable");
    assert!(
        body["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("fault hook")),
        "{body}"
    );
}
