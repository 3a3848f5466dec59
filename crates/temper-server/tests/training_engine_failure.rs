//! Issue 35 §4 for the training API: when a call panics on the engine's
//! worker (raised there for real by temper-engine's `fault-hooks`), the
//! call fails instead of hanging, `/api/v1/healthz` answers 503 with the
//! reason instead of "ok", and later calls fail with that reason too.
//!
//! One test, in its own binary: the hook is process-wide.

use axum::body::Body;
use axum::http::{Request, StatusCode};
use serde_json::{json, Value};
use temper_server::training_api::ApiState;

mod common;

use common::training::{call, send, state};

async fn healthz(s: &ApiState) -> (StatusCode, Value) {
    let req = Request::get("/api/v1/healthz")
        .header("x-api-key", "tml-k")
        .body(Body::empty())
        .expect("request");
    send(s, req).await
}

/// Creates a LoRA model and returns its future's result.
async fn create_model(s: &ApiState, seq: u64) -> Value {
    let (_, sess) = call(s, "/api/v1/create_session", json!({})).await;
    let sid = sess["session_id"].as_str().expect("session id").to_string();
    let (_, created) = call(
        s,
        "/api/v1/create_model",
        json!({"session_id": sid, "model_seq_id": seq, "base_model": "tiny", "lora_config": {"rank": 4}}),
    )
    .await;
    let (_, done) = call(
        s,
        "/api/v1/retrieve_future",
        json!({"request_id": created["request_id"]}),
    )
    .await;
    done
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panicking_training_call_fails_and_healthz_says_the_engine_is_dead() {
    let dir = tempfile::tempdir().expect("temp dir");
    let s = state(dir.path());
    assert_eq!(healthz(&s).await, (StatusCode::OK, json!({"status": "ok"})));
    let done = create_model(&s, 0).await;
    assert!(done["model_id"].is_string(), "{done}");

    // The next call panics on the worker: it fails (not a hang), and the
    // engine, whose state that call may have left half written, is dead.
    temper_engine::fault::panic_next_job();
    let done = create_model(&s, 0).await;
    assert!(done["model_id"].is_null(), "{done}");
    assert!(done.to_string().contains("panicked"), "{done}");

    let (status, h) = healthz(&s).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{h}");
    assert_eq!(h["status"], "engine_dead");
    let reason = h["reason"].as_str().unwrap_or_default();
    assert!(
        reason.contains("the engine thread panicked")
            && reason.contains("fault hook: a training call panicked"),
        "{h}"
    );
    // Later calls fail at once, naming the reason.
    let done = create_model(&s, 0).await;
    assert!(done.to_string().contains("fault hook"), "{done}");
}
