//! A bounded, seeded fuzz of every route of `temper serve` (the OpenAI
//! router) and `temper api serve` (the training API): valid requests with
//! fields replaced by extreme or wrong values, malformed and invalid-UTF-8
//! bodies, deep nesting, unknown ids, path tricks, wrong or missing keys.
//! Asserts: no 5xx other than the documented 503 "overloaded", no panic,
//! the process's peak memory under 4 GiB, and an ordinary request still
//! answers afterwards.
//!
//! `TEMPER_FUZZ_CASES` (default 300 per server) and `TEMPER_FUZZ_SEED`
//! (default 7) size and reproduce a run; a failure prints the seed and the
//! request.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use axum::Router;
use http_body_util::BodyExt;
use rand::seq::IndexedRandom;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde_json::{json, Value};
use temper_model::{LoadOptions, Pretrained};
use temper_server::openai::{self, OpenAiState, ServeConfig};
use temper_server::training_api::{self, ApiConfig, ApiState, BaseModel};
use tower::ServiceExt;

fn env_or(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures")
}

fn model() -> Arc<Pretrained> {
    Arc::new(
        Pretrained::load(
            &fixtures().join("models/tiny-qwen3"),
            &LoadOptions::default(),
        )
        .expect("fixture model"),
    )
}

fn pick<'a, T>(rng: &mut ChaCha8Rng, items: &'a [T]) -> &'a T {
    items.choose(rng).expect("non-empty")
}

fn weird(rng: &mut ChaCha8Rng) -> Value {
    let nested = (0..200).fold(json!(1), |v, _| json!([v]));
    pick(
        rng,
        &[
            json!(-1),
            json!(0),
            json!(1e308),
            json!(-1e308),
            json!(i64::MAX),
            json!(i64::MIN),
            json!(u64::MAX),
            json!(1_000_000_000u64),
            json!("NaN"),
            json!(""),
            json!("../../etc/passwd"),
            json!("/tmp/escape"),
            json!("a\u{0}b"),
            json!("x".repeat(5000)),
            json!(null),
            json!([]),
            json!([1, "a", null]),
            json!({"a": {"b": 1}}),
            json!(true),
            nested,
        ],
    )
    .clone()
}

/// A valid body for `route`, then 0..3 fields replaced or added at random.
fn mutate(rng: &mut ChaCha8Rng, mut body: Value) -> Value {
    let Some(obj) = body.as_object_mut() else {
        return body;
    };
    for _ in 0..rng.random_range(0..4) {
        let keys: Vec<String> = obj.keys().cloned().collect();
        let key = if keys.is_empty() || rng.random_bool(0.2) {
            pick(
                rng,
                &[
                    "n",
                    "max_tokens",
                    "temperature",
                    "seed",
                    "logprobs",
                    "stop",
                    "tools",
                    "response_format",
                    "tool_choice",
                ],
            )
            .to_string()
        } else {
            pick(rng, &keys).clone()
        };
        obj.insert(key, weird(rng));
    }
    body
}

fn raw_body(rng: &mut ChaCha8Rng, valid: Value) -> Vec<u8> {
    match rng.random_range(0..10) {
        0 => vec![0xff, 0xfe, 0x00, 0x7b],
        1 => b"{\"model\": ".to_vec(),
        2 => Vec::new(),
        3 => "[".repeat(10_000).into_bytes(),
        _ => mutate(rng, valid).to_string().into_bytes(),
    }
}

async fn send(
    router: &Router,
    method: &str,
    uri: &str,
    key: Option<(&str, String)>,
    body: Vec<u8>,
) -> (StatusCode, Vec<u8>) {
    let mut req = Request::builder().method(method).uri(uri);
    if let Some((h, v)) = key {
        req = req.header(h, v);
    }
    let req = req
        .header("content-type", "application/json")
        .body(Body::from(body))
        .expect("request");
    let resp = router
        .clone()
        .oneshot(req)
        .await
        .expect("a response, not a panic");
    let status = resp.status();
    let bytes = tokio::time::timeout(Duration::from_secs(60), resp.into_body().collect())
        .await
        .expect("the body completes")
        .map(|b| b.to_bytes().to_vec())
        .unwrap_or_default();
    (status, bytes)
}

fn peak_rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmHWM:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        })
        .unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fuzzing_every_openai_route_gets_no_5xx_and_the_server_still_answers() {
    let cases = env_or("TEMPER_FUZZ_CASES", 300);
    let seed = env_or("TEMPER_FUZZ_SEED", 7);
    let m = model();
    let mut cfg = ServeConfig::defaults("tiny", &m);
    cfg.api_key = Some("sk-fuzz".into());
    cfg.scheduler.max_model_len = 256;
    cfg.lora_roots = vec![fixtures()
        .join("adapters")
        .canonicalize()
        .expect("fixtures")];
    let router = openai::app(OpenAiState::new(m, cfg));
    let adapter = fixtures()
        .join("adapters/tiny-qwen3-lora")
        .display()
        .to_string();
    let routes: Vec<(&str, &str, Value)> = vec![
        ("GET", "/v1/models", Value::Null),
        ("GET", "/health", Value::Null),
        ("GET", "/metrics", Value::Null),
        (
            "POST",
            "/v1/chat/completions",
            json!({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}),
        ),
        (
            "POST",
            "/v1/chat/completions",
            json!({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
                   "response_format": {"type": "json_schema", "json_schema": {"name": "t",
                       "schema": {"type": "object", "properties": {"a": {"type": "integer"}}}}}}),
        ),
        (
            "POST",
            "/v1/chat/completions",
            json!({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
                   "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required"}),
        ),
        (
            "POST",
            "/v1/completions",
            json!({"model": "tiny", "prompt": "hello", "max_tokens": 3, "logprobs": 2}),
        ),
        (
            "POST",
            "/v1/generate",
            json!({"model": "tiny", "prompt_token_ids": [1, 2, 3], "max_tokens": 3, "n": 2}),
        ),
        (
            "POST",
            "/v1/load_lora_adapter",
            json!({"lora_name": "a", "lora_path": adapter}),
        ),
        ("POST", "/v1/unload_lora_adapter", json!({"lora_name": "a"})),
        ("POST", "/v1/nope", json!({})),
    ];
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut ok = 0;
    for i in 0..cases {
        let (method, uri, valid) = pick(&mut rng, &routes).clone();
        let key = match rng.random_range(0..10) {
            0 => None,
            1 => Some(("authorization", "Bearer wrong".to_string())),
            _ => Some(("authorization", "Bearer sk-fuzz".to_string())),
        };
        let body = if method == "GET" {
            Vec::new()
        } else {
            raw_body(&mut rng, valid)
        };
        let shown = String::from_utf8_lossy(&body[..body.len().min(300)]).into_owned();
        let (st, reply) = send(&router, method, uri, key, body).await;
        ok += usize::from(st.is_success());
        assert!(
            !st.is_server_error() || st == StatusCode::SERVICE_UNAVAILABLE,
            "seed {seed} case {i}: {method} {uri} {shown} -> {st} {}",
            String::from_utf8_lossy(&reply)
        );
    }
    // The fuzz reached the routes' real work, not only their refusals.
    assert!(
        ok as u64 > cases / 5,
        "only {ok} of {cases} requests succeeded"
    );
    let (st, reply) = send(
        &router,
        "POST",
        "/v1/completions",
        Some(("authorization", "Bearer sk-fuzz".into())),
        json!({"model": "tiny", "prompt": "hello", "max_tokens": 2})
            .to_string()
            .into_bytes(),
    )
    .await;
    assert_eq!(st, StatusCode::OK, "{}", String::from_utf8_lossy(&reply));
    assert!(peak_rss_kib() < 4 << 20, "peak RSS {} KiB", peak_rss_kib());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fuzzing_every_training_api_route_gets_no_5xx_and_the_server_still_trains() {
    let cases = env_or("TEMPER_FUZZ_CASES", 300);
    let seed = env_or("TEMPER_FUZZ_SEED", 7);
    let dir = tempfile::tempdir().expect("temp dir");
    let ckpt = dir.path().join("checkpoints");
    std::fs::create_dir_all(&ckpt).expect("dir");
    let state = ApiState::new(
        vec![BaseModel {
            name: "tiny".into(),
            model: model(),
        }],
        ApiConfig {
            api_key: Some("tml-fuzz".into()),
            checkpoint_dir: ckpt.clone(),
            long_poll: Duration::from_millis(200),
            result_grace: Duration::from_secs(60),
            limits: Default::default(),
            adapters: Default::default(),
        },
    );
    let router = training_api::app(state);
    let key = || Some(("x-api-key", "tml-fuzz".to_string()));
    let (_, sess) = send(
        &router,
        "POST",
        "/api/v1/create_session",
        key(),
        b"{}".to_vec(),
    )
    .await;
    let sess: Value = serde_json::from_slice(&sess).expect("json");
    let sid = sess["session_id"].as_str().expect("session").to_string();
    let model_id = format!("{sid}:train:0");
    let routes: Vec<(&str, String, Value)> = vec![
        ("GET", "/api/v1/healthz".into(), Value::Null),
        ("GET", "/api/v1/get_server_capabilities".into(), Value::Null),
        ("POST", "/api/v1/create_session".into(), json!({})),
        (
            "POST",
            "/api/v1/session_heartbeat".into(),
            json!({"session_id": sid}),
        ),
        (
            "POST",
            "/api/v1/create_model".into(),
            json!({"session_id": sid, "model_seq_id": 0, "base_model": "tiny", "lora_config": {"rank": 2}}),
        ),
        (
            "POST",
            "/api/v1/get_info".into(),
            json!({"model_id": model_id}),
        ),
        (
            "POST",
            "/api/v1/optim_step".into(),
            json!({"model_id": model_id, "seq_id": 5, "adam_params": {"learning_rate": 0.01}}),
        ),
        (
            "POST",
            "/api/v1/save_weights".into(),
            json!({"model_id": model_id, "path": "c1", "seq_id": 6}),
        ),
        (
            "POST",
            "/api/v1/load_weights".into(),
            json!({"model_id": model_id, "path": format!("tinker://{model_id}/weights/c1"), "seq_id": 7}),
        ),
        (
            "POST",
            "/api/v1/save_weights_for_sampler".into(),
            json!({"model_id": model_id, "sampling_session_seq_id": 0, "seq_id": 8}),
        ),
        (
            "POST",
            "/api/v1/create_sampling_session".into(),
            json!({"session_id": sid, "sampling_session_seq_id": 1, "base_model": "tiny"}),
        ),
        (
            "POST",
            "/api/v1/asample".into(),
            json!({"sampling_session_id": format!("{sid}:sample:1"), "num_samples": 2, "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3]}]}, "sampling_params": {"max_tokens": 3}, "prompt_logprobs": true}),
        ),
        (
            "POST",
            "/api/v1/retrieve_future".into(),
            json!({"request_id": "req-1"}),
        ),
        ("POST", "/api/v1/forward_backward".into(), json!({})),
        ("POST", format!("/api/v1/sessions/{sid}/finish"), json!({})),
        ("GET", "/api/v1/samplers/x".into(), Value::Null),
        ("POST", "/api/v1/nope".into(), json!({})),
    ];
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut ok = 0;
    let mut futures = Vec::new();
    for i in 0..cases {
        let (method, uri, valid) = pick(&mut rng, &routes).clone();
        let k = match rng.random_range(0..10) {
            0 => None,
            1 => Some(("x-api-key", "tml-wrong".to_string())),
            _ => key(),
        };
        let body = if method == "GET" {
            Vec::new()
        } else {
            raw_body(&mut rng, valid)
        };
        let shown = String::from_utf8_lossy(&body[..body.len().min(300)]).into_owned();
        let (st, reply) = send(&router, method, &uri, k, body).await;
        ok += usize::from(st.is_success());
        if let Some(id) = serde_json::from_slice::<Value>(&reply)
            .ok()
            .and_then(|v| v.get("request_id").cloned())
        {
            futures.push((i, uri.clone(), id));
        }
        assert!(
            !st.is_server_error(),
            "seed {seed} case {i}: {method} {uri} {shown} -> {st} {}",
            String::from_utf8_lossy(&reply)
        );
    }
    assert!(
        ok as u64 > cases / 5,
        "only {ok} of {cases} requests succeeded"
    );
    // Nothing was written outside the checkpoint root.
    let outside: Vec<_> = std::fs::read_dir(dir.path())
        .expect("dir")
        .map(|e| e.expect("entry").file_name())
        .collect();
    assert_eq!(outside, vec![std::ffi::OsString::from("checkpoints")]);
    // A new session still creates a model.
    let (_, sess) = send(
        &router,
        "POST",
        "/api/v1/create_session",
        key(),
        b"{}".to_vec(),
    )
    .await;
    let sess: Value = serde_json::from_slice(&sess).expect("json");
    let body = json!({"session_id": sess["session_id"], "model_seq_id": 0, "base_model": "tiny", "lora_config": {"rank": 2}});
    let (st, reply) = send(
        &router,
        "POST",
        "/api/v1/create_model",
        key(),
        body.to_string().into_bytes(),
    )
    .await;
    assert_eq!(st, StatusCode::OK, "{}", String::from_utf8_lossy(&reply));
    assert!(peak_rss_kib() < 4 << 20, "peak RSS {} KiB", peak_rss_kib());
}
