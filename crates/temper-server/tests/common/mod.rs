//! Helpers shared by the OpenAI server's integration tests: the fixture
//! model, a server over it, and requests sent in process with `oneshot`.
// Each test file uses some of these.
#![allow(dead_code)]

use std::path::PathBuf;
use std::sync::Arc;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use axum::Router;
use http_body_util::BodyExt;
use serde_json::Value;
use temper_model::{LoadOptions, Pretrained};
use temper_server::openai::{OpenAiState, ServeConfig};
use tower::ServiceExt;

pub mod training;

pub const MODEL: &str = "tiny";

pub fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures")
}

pub fn adapter_dir() -> PathBuf {
    fixtures().join("adapters/tiny-qwen3-lora")
}

pub fn load() -> Arc<Pretrained> {
    Arc::new(
        Pretrained::load(
            &fixtures().join("models/tiny-qwen3"),
            &LoadOptions::default(),
        )
        .expect("fixture model"),
    )
}

pub fn server_with(model: Arc<Pretrained>, edit: impl FnOnce(&mut ServeConfig)) -> OpenAiState {
    let mut cfg = ServeConfig::defaults(MODEL, &model);
    cfg.scheduler.max_model_len = 512;
    // Adapters at run time: the fixtures' and the tests' temp directories.
    cfg.lora_roots = vec![
        fixtures()
            .join("adapters")
            .canonicalize()
            .expect("fixtures"),
        std::env::temp_dir().canonicalize().expect("temp dir"),
    ];
    edit(&mut cfg);
    OpenAiState::new(model, cfg)
}

pub fn server() -> (Arc<Pretrained>, OpenAiState) {
    let m = load();
    (m.clone(), server_with(m, |_| {}))
}

pub async fn send(router: &Router, req: Request<Body>) -> (StatusCode, Vec<u8>) {
    let resp = router.clone().oneshot(req).await.expect("response");
    let status = resp.status();
    let bytes = resp.into_body().collect().await.expect("body").to_bytes();
    (status, bytes.to_vec())
}

pub async fn post(router: &Router, path: &str, body: Value) -> (StatusCode, Value) {
    let req = Request::post(path)
        .header("content-type", "application/json")
        .body(Body::from(body.to_string()))
        .expect("request");
    let (status, bytes) = send(router, req).await;
    (
        status,
        serde_json::from_slice(&bytes).unwrap_or(Value::Null),
    )
}

pub fn f32s(v: &Value) -> Vec<f32> {
    v.as_array()
        .expect("array")
        .iter()
        .map(|x| x.as_f64().expect("number") as f32)
        .collect()
}

pub fn u32s(v: &Value) -> Vec<u32> {
    v.as_array()
        .expect("array")
        .iter()
        .map(|x| x.as_u64().expect("int") as u32)
        .collect()
}

pub fn sse_payloads(bytes: &[u8]) -> Vec<String> {
    String::from_utf8(bytes.to_vec())
        .expect("utf8")
        .split("\n\n")
        .filter_map(|e| e.strip_prefix("data: ").map(str::to_string))
        .collect()
}
