//! The training API driven in process with `oneshot` (no network). The
//! official-SDK end-to-end test is `tests/python/test_training_api.py`.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use http_body_util::BodyExt;
use prost::Message;
use serde_json::{json, Value};
use temper_api::proto;
use temper_model::{LoadOptions, Pretrained};
use temper_server::training_api::{app, ApiConfig, ApiState, BaseModel};
use tower::ServiceExt;

mod common;

use common::training::{call, state, state_with_grace};

async fn result_bytes(s: &ApiState, request_id: &Value) -> (String, Vec<u8>) {
    let req = Request::post("/api/v1/retrieve_future")
        .header("x-api-key", "tml-k")
        .body(Body::from(json!({"request_id": request_id}).to_string()))
        .expect("request");
    let resp = app(s.clone()).oneshot(req).await.expect("response");
    let ct = resp
        .headers()
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_string();
    (
        ct,
        resp.into_body()
            .collect()
            .await
            .expect("body")
            .to_bytes()
            .to_vec(),
    )
}

#[tokio::test]
async fn auth_unknown_routes_and_bad_bodies_get_json_4xx() {
    let dir = tempfile::tempdir().expect("temp dir");
    let s = state(dir.path());
    let req = Request::get("/api/v1/healthz").body(Body::empty()).unwrap();
    let resp = app(s.clone()).oneshot(req).await.unwrap();
    assert_eq!(resp.status(), StatusCode::UNAUTHORIZED);
    let (st, body) = call(&s, "/api/v1/no_such_route", json!({})).await;
    assert_eq!(st, StatusCode::NOT_FOUND);
    assert!(
        body["detail"].as_str().unwrap().contains("not supported"),
        "{body}"
    );
    let (st, body) = call(&s, "/api/v1/create_session", json!({})).await;
    assert_eq!(st, StatusCode::OK);
    assert!(body["session_id"].is_string());
    let req = Request::post("/api/v1/forward_backward")
        .header("x-api-key", "tml-k")
        .body(Body::from(vec![0xff, 0xff, 0xff]))
        .unwrap();
    let resp = app(s.clone()).oneshot(req).await.unwrap();
    assert_eq!(resp.status(), StatusCode::BAD_REQUEST);
    let (st, _) = call(&s, "/api/v1/optim_step", json!({"not": "valid"})).await;
    assert_eq!(st, StatusCode::BAD_REQUEST);
}

#[tokio::test]
async fn train_step_through_futures_and_protobuf() {
    let dir = tempfile::tempdir().expect("temp dir");
    let s = state(dir.path());
    let (_, sess) = call(&s, "/api/v1/create_session", json!({})).await;
    let sid = sess["session_id"].as_str().unwrap().to_string();
    let (_, created) = call(
        &s,
        "/api/v1/create_model",
        json!({"session_id": sid, "model_seq_id": 0, "base_model": "tiny", "lora_config": {"rank": 4}}),
    )
    .await;
    let model_id = created["model_id"].as_str().unwrap().to_string();
    assert_eq!(model_id, format!("{sid}:train:0"));
    let (_, done) = result_bytes(&s, &created["request_id"]).await;
    let done: Value = serde_json::from_slice(&done).unwrap();
    assert_eq!(done["model_id"], model_id.as_str());

    let tokens: Vec<u32> = (40..60).collect();
    let fb = proto::ForwardBackwardRequest {
        model_id: model_id.clone(),
        seq_id: 1,
        data: vec![datum(&tokens, None)],
        loss_fn: "cross_entropy".into(),
        ..Default::default()
    };
    let req = Request::post("/api/v1/forward_backward")
        .header("x-api-key", "tml-k")
        .header("content-type", "application/x-protobuf")
        .body(Body::from(fb.encode_to_vec()))
        .unwrap();
    let resp = app(s.clone()).oneshot(req).await.unwrap();
    let sub: Value =
        serde_json::from_slice(&resp.into_body().collect().await.unwrap().to_bytes()).unwrap();
    let (ct, bytes) = result_bytes(&s, &sub["request_id"]).await;
    assert_eq!(ct, "application/x-protobuf");
    let out = proto::ForwardBackwardOutput::decode(bytes.as_slice()).expect("protobuf result");
    assert!(out.metrics["loss:sum"] > 0.0);
    let lp = &out.loss_fn_outputs[0].fields["logprobs"];
    assert_eq!(
        proto::le::f32_from(&lp.data).unwrap().len(),
        tokens.len() - 1
    );
    assert_eq!(
        proto::le::i64_from(&lp.offsets).unwrap(),
        vec![0, 4 * (tokens.len() as i64 - 1)]
    );
    // A resubmit of the same (model, seq_id) gets the same request id.
    let req = Request::post("/api/v1/forward_backward")
        .header("x-api-key", "tml-k")
        .body(Body::from(fb.encode_to_vec()))
        .unwrap();
    let resp = app(s.clone()).oneshot(req).await.unwrap();
    let again: Value =
        serde_json::from_slice(&resp.into_body().collect().await.unwrap().to_bytes()).unwrap();
    assert_eq!(again["request_id"], sub["request_id"]);

    let (_, op) = call(
        &s,
        "/api/v1/optim_step",
        json!({"model_id": model_id, "seq_id": 2, "adam_params": {"learning_rate": 0.01}}),
    )
    .await;
    let (_, res) = result_bytes(&s, &op["request_id"]).await;
    let res: Value = serde_json::from_slice(&res).unwrap();
    assert!(
        res["metrics"]["grad_norm:mean"].as_f64().unwrap() > 0.0,
        "{res}"
    );

    // An unknown loss fails the future with a user error, HTTP 200.
    let mut bad = fb.clone();
    bad.seq_id = 3;
    bad.loss_fn = "nonsense".into();
    let req = Request::post("/api/v1/forward_backward")
        .header("x-api-key", "tml-k")
        .body(Body::from(bad.encode_to_vec()))
        .unwrap();
    let resp = app(s.clone()).oneshot(req).await.unwrap();
    let sub: Value =
        serde_json::from_slice(&resp.into_body().collect().await.unwrap().to_bytes()).unwrap();
    let (_, res) = result_bytes(&s, &sub["request_id"]).await;
    let res: Value = serde_json::from_slice(&res).unwrap();
    assert_eq!(res["category"], "user");
    assert!(res["error"].as_str().unwrap().contains("nonsense"), "{res}");
}

#[tokio::test]
async fn delivered_results_are_dropped_after_the_grace_period() {
    let dir = tempfile::tempdir().expect("temp dir");
    let s = state_with_grace(dir.path(), Duration::ZERO);
    let (_, sess) = call(&s, "/api/v1/create_session", json!({})).await;
    let sid = sess["session_id"].as_str().unwrap().to_string();
    let (_, created) = call(
        &s,
        "/api/v1/create_model",
        json!({"session_id": sid, "model_seq_id": 0, "base_model": "tiny"}),
    )
    .await;
    let model_id = created["model_id"].as_str().unwrap().to_string();
    let first = created["request_id"].clone();
    let (_, body) = result_bytes(&s, &first).await;
    assert!(String::from_utf8_lossy(&body).contains(&model_id));
    // Still there until the next submission sweeps (the grace is zero here).
    let (_, body) = result_bytes(&s, &first).await;
    assert!(String::from_utf8_lossy(&body).contains(&model_id));
    let (_, op) = call(
        &s,
        "/api/v1/optim_step",
        json!({"model_id": model_id, "seq_id": 1, "adam_params": {"learning_rate": 0.01}}),
    )
    .await;
    assert_ne!(op["request_id"], first);
    let req = Request::post("/api/v1/retrieve_future")
        .header("x-api-key", "tml-k")
        .body(Body::from(json!({"request_id": first}).to_string()))
        .unwrap();
    let resp = app(s.clone()).oneshot(req).await.unwrap();
    assert_eq!(resp.status(), StatusCode::NOT_FOUND);
}

/// Waits for a future and returns its JSON result (or error body).
async fn result_json(s: &ApiState, request_id: &Value) -> Value {
    let (_, bytes) = result_bytes(s, request_id).await;
    serde_json::from_slice(&bytes).expect("json result")
}

fn files_under(dir: &std::path::Path) -> usize {
    std::fs::read_dir(dir).map_or(0, |d| d.count())
}

#[tokio::test]
async fn client_chosen_session_ids_cannot_place_checkpoints_outside_the_root() {
    let root = tempfile::tempdir().expect("temp dir");
    let outside = tempfile::tempdir().expect("temp dir");
    let ckpt = root.path().join("checkpoints");
    std::fs::create_dir_all(&ckpt).unwrap();
    let s = state(&ckpt);
    let escape = outside.path().join("escape");
    for session in [
        escape.to_str().unwrap().to_string(),
        "../../escape".to_string(),
        "..".to_string(),
    ] {
        let (st, body) = call(
            &s,
            "/api/v1/create_model",
            json!({"session_id": session, "model_seq_id": 0, "base_model": "tiny", "lora_config": {"rank": 2}}),
        )
        .await;
        assert_eq!(st, StatusCode::NOT_FOUND, "{session}: {body}");
        assert!(body.to_string().contains("create_session"), "{body}");
        let (st, body) = call(
            &s,
            "/api/v1/save_weights",
            json!({"model_id": format!("{session}:train:0"), "path": "pwn", "seq_id": 1}),
        )
        .await;
        if st == StatusCode::OK {
            let res = result_json(&s, &body["request_id"]).await;
            assert!(res.to_string().contains("unknown model_id"), "{res}");
        }
        let (st, _) = call(
            &s,
            "/api/v1/load_weights",
            json!({"session_id": session, "model_seq_id": 0, "path": "tinker://x/weights/y"}),
        )
        .await;
        assert_eq!(st, StatusCode::NOT_FOUND);
    }
    assert!(
        !escape.exists(),
        "a checkpoint was written outside the root"
    );
    assert_eq!(files_under(outside.path()), 0);
    assert_eq!(files_under(root.path()), 1, "only checkpoints/ in the root");
}

#[tokio::test]
async fn tinker_paths_and_checkpoint_names_cannot_leave_the_root() {
    let root = tempfile::tempdir().expect("temp dir");
    let ckpt = root.path().join("checkpoints");
    std::fs::create_dir_all(&ckpt).unwrap();
    // A checkpoint above the root that `tinker://../weights/outside` would reach.
    let above = root.path().join("weights/outside");
    std::fs::create_dir_all(&above).unwrap();
    std::fs::write(above.join("state.json"), "{}").unwrap();
    let s = state(&ckpt);
    let (_, model_id) = new_model(&s).await;

    for (i, path) in [
        "tinker://../weights/outside",
        "tinker://./weights/outside",
        "tinker://%2e%2e/weights/outside",
        "tinker://a/b/weights/outside",
    ]
    .iter()
    .enumerate()
    {
        let (st, body) = call(
            &s,
            "/api/v1/load_weights",
            json!({"model_id": model_id, "path": path, "seq_id": 10 + i}),
        )
        .await;
        assert_eq!(st, StatusCode::OK);
        let res = result_json(&s, &body["request_id"]).await;
        let text = res.to_string();
        assert!(
            text.contains("invalid model id")
                || text.contains("must be tinker://")
                || text.contains("no checkpoint"),
            "{path}: {res}"
        );
        assert!(
            !text.contains("\"type\":\"load_weights\""),
            "{path} loaded: {res}"
        );
    }
    for (i, name) in ["../pwn", "/tmp/pwn", "..", ".", "a\\b", "a\0b"]
        .iter()
        .enumerate()
    {
        let (_, body) = call(
            &s,
            "/api/v1/save_weights",
            json!({"model_id": model_id, "path": name, "seq_id": 20 + i}),
        )
        .await;
        let res = result_json(&s, &body["request_id"]).await;
        assert!(
            res.to_string().contains("invalid checkpoint name"),
            "{name:?}: {res}"
        );
    }
    assert_eq!(
        files_under(root.path()),
        2,
        "checkpoints/ and weights/ only"
    );
}

#[tokio::test]
async fn session_ids_differ_across_restarts_and_saves_never_silently_overwrite() {
    let root = tempfile::tempdir().expect("temp dir");
    let first = state(root.path());
    let second = state(root.path());
    let (_, a) = call(&first, "/api/v1/create_session", json!({})).await;
    let (_, b) = call(&second, "/api/v1/create_session", json!({})).await;
    assert_ne!(
        a["session_id"], b["session_id"],
        "ids repeat after a restart"
    );

    let (_, created) = call(
        &first,
        "/api/v1/create_model",
        json!({"session_id": a["session_id"], "model_seq_id": 0, "base_model": "tiny", "lora_config": {"rank": 2}}),
    )
    .await;
    let model_id = created["model_id"].as_str().unwrap().to_string();
    result_json(&first, &created["request_id"]).await;
    let save = |seq: i64, overwrite: bool| json!({"model_id": model_id, "path": "dur1", "seq_id": seq, "overwrite": overwrite});
    let (_, r) = call(&first, "/api/v1/save_weights", save(1, false)).await;
    let res = result_json(&first, &r["request_id"]).await;
    assert_eq!(res["path"], format!("tinker://{model_id}/weights/dur1"));
    let (_, r) = call(&first, "/api/v1/save_weights", save(2, false)).await;
    let res = result_json(&first, &r["request_id"]).await;
    assert!(res.to_string().contains("exists"), "{res}");
    let (_, r) = call(&first, "/api/v1/save_weights", save(3, true)).await;
    let res = result_json(&first, &r["request_id"]).await;
    assert_eq!(
        res["path"],
        format!("tinker://{model_id}/weights/dur1"),
        "{res}"
    );
}

fn datum(tokens: &[u32], extra: Option<(&str, Vec<f32>)>) -> proto::Datum {
    let mut inputs = std::collections::HashMap::new();
    inputs.insert(
        "target_tokens".to_string(),
        proto::Tensor {
            encoding: Some(proto::tensor::Encoding::Dense(proto::le::i64_bytes(
                &tokens[1..].iter().map(|&t| t as i64).collect::<Vec<_>>(),
            ))),
            dtype: proto::DType::Int64 as i32,
            shape: vec![tokens.len() as i64 - 1],
        },
    );
    if let Some((name, v)) = extra {
        inputs.insert(
            name.to_string(),
            proto::Tensor {
                encoding: Some(proto::tensor::Encoding::Dense(proto::le::f32_bytes(&v))),
                dtype: proto::DType::Float32 as i32,
                shape: vec![v.len() as i64],
            },
        );
    }
    proto::Datum {
        model_input: vec![proto::Chunk {
            chunk: Some(proto::chunk::Chunk::EncodedText(proto::EncodedTextChunk {
                tokens: proto::le::i32_bytes(&tokens[..tokens.len() - 1]),
            })),
        }],
        loss_fn_inputs: inputs,
    }
}

async fn post_proto(s: &ApiState, path: &str, msg: Vec<u8>) -> (StatusCode, Value) {
    let req = Request::post(path)
        .header("x-api-key", "tml-k")
        .header("content-type", "application/x-protobuf")
        .body(Body::from(msg))
        .unwrap();
    let resp = app(s.clone()).oneshot(req).await.unwrap();
    let st = resp.status();
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    (st, serde_json::from_slice(&body).unwrap_or(Value::Null))
}

async fn new_model(s: &ApiState) -> (String, String) {
    let (_, sess) = call(s, "/api/v1/create_session", json!({})).await;
    let sid = sess["session_id"].as_str().unwrap().to_string();
    let (_, created) = call(
        s,
        "/api/v1/create_model",
        json!({"session_id": sid, "model_seq_id": 0, "base_model": "tiny", "lora_config": {"rank": 2}}),
    )
    .await;
    result_json(s, &created["request_id"]).await;
    (sid, created["model_id"].as_str().unwrap().to_string())
}

#[tokio::test]
async fn oversized_requests_are_400s_naming_the_limit_before_anything_is_allocated() {
    let dir = tempfile::tempdir().expect("temp dir");
    let s = state(dir.path());
    let (sid, model_id) = new_model(&s).await;

    let (st, body) = call(
        &s,
        "/api/v1/create_model",
        json!({"session_id": sid, "model_seq_id": 1, "base_model": "tiny", "lora_config": {"rank": 1u64 << 40}}),
    )
    .await;
    assert_eq!(st, StatusCode::BAD_REQUEST, "{body}");
    assert!(body.to_string().contains("--max-lora-rank"), "{body}");

    // 1e9 samples on a session that does not exist: refused at once.
    let started = std::time::Instant::now();
    let (st, body) = call(
        &s,
        "/api/v1/asample",
        json!({"sampling_session_id": "nope", "num_samples": 1_000_000_000u64,
               "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2]}]}}),
    )
    .await;
    assert_eq!(st, StatusCode::BAD_REQUEST, "{body}");
    assert!(body.to_string().contains("--max-num-samples"), "{body}");
    assert!(started.elapsed() < Duration::from_secs(2));

    let (_, smp) = call(
        &s,
        "/api/v1/create_sampling_session",
        json!({"session_id": sid, "sampling_session_seq_id": 0, "base_model": "tiny"}),
    )
    .await;
    let smp = smp["sampling_session_id"].as_str().unwrap().to_string();
    let ctx = 1 << 20; // longer than any fixture's context
    let long: Vec<u32> = (0..ctx).map(|i| 1 + (i % 50) as u32).collect();
    let (st, body) = call(
        &s,
        "/api/v1/asample",
        json!({"sampling_session_id": smp, "num_samples": 1, "prompt_logprobs": true,
               "prompt": {"chunks": [{"type": "encoded_text", "tokens": long}]}}),
    )
    .await;
    assert_eq!(st, StatusCode::BAD_REQUEST);
    assert!(body.to_string().contains("context length"), "{body}");
    let (st, body) = call(
        &s,
        "/api/v1/asample",
        json!({"sampling_session_id": smp, "num_samples": 1,
               "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 4_000_000]}]}}),
    )
    .await;
    assert_eq!(st, StatusCode::BAD_REQUEST);
    assert!(
        body.to_string().contains("out of range (vocabulary size"),
        "{body}"
    );

    // More tokens than --max-batch-tokens in one forward_backward.
    let seq: Vec<u32> = (0..2049).map(|i| 1 + (i % 50) as u32).collect();
    let fb = proto::ForwardBackwardRequest {
        model_id: model_id.clone(),
        seq_id: 1,
        data: (0..130).map(|_| datum(&seq, None)).collect(),
        loss_fn: "cross_entropy".into(),
        ..Default::default()
    };
    let (st, body) = post_proto(&s, "/api/v1/forward_backward", fb.encode_to_vec()).await;
    assert_eq!(st, StatusCode::BAD_REQUEST, "{body}");
    assert!(body.to_string().contains("--max-batch-tokens"), "{body}");

    // The server still trains after all of that.
    let fb = proto::ForwardBackwardRequest {
        model_id,
        seq_id: 2,
        data: vec![datum(&seq[..20], None)],
        loss_fn: "cross_entropy".into(),
        ..Default::default()
    };
    let (st, body) = post_proto(&s, "/api/v1/forward_backward", fb.encode_to_vec()).await;
    assert_eq!(st, StatusCode::OK);
    let res = result_bytes(&s, &body["request_id"]).await;
    assert_eq!(res.0, "application/x-protobuf");
}

#[tokio::test]
async fn non_finite_loss_inputs_are_refused_with_a_400() {
    let dir = tempfile::tempdir().expect("temp dir");
    let s = state(dir.path());
    let (_, model_id) = new_model(&s).await;
    let seq: Vec<u32> = (1..21).collect();
    for (i, (name, bad)) in [
        ("weights", 3e38f32 * 10.0),
        ("advantages", f32::NAN),
        ("logprobs", f32::NEG_INFINITY),
    ]
    .into_iter()
    .enumerate()
    {
        let mut v = vec![1.0f32; seq.len() - 1];
        v[3] = bad;
        let fb = proto::ForwardBackwardRequest {
            model_id: model_id.clone(),
            seq_id: 1 + i as i32,
            data: vec![datum(&seq, Some((name, v)))],
            loss_fn: "importance_sampling".into(),
            ..Default::default()
        };
        let (st, body) = post_proto(&s, "/api/v1/forward_backward", fb.encode_to_vec()).await;
        assert_eq!(st, StatusCode::BAD_REQUEST, "{name}: {body}");
        assert!(body.to_string().contains("must be finite"), "{body}");
    }
}

/// The training API's `[model] adapter`: a client starts from a served PEFT
/// adapter and step 0 computes exactly that adapter's logprobs
/// (transformers + PEFT on the same PEFT-written adapter, `fixtures/golden`).
#[tokio::test]
async fn a_training_client_starts_from_a_served_peft_adapter_at_its_logprobs() {
    use temper_model::candle_core::{Device, D};
    let dir = tempfile::tempdir().expect("temp dir");
    let fixtures = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures");
    let model = Arc::new(
        Pretrained::load(&fixtures.join("models/tiny-qwen3"), &LoadOptions::default())
            .expect("fixture"),
    );
    let adapter_dir = fixtures.join("adapters/tiny-qwen3-lora");
    let cfg: Value = serde_json::from_str(
        &std::fs::read_to_string(adapter_dir.join("adapter_config.json")).unwrap(),
    )
    .unwrap();
    let rank = cfg["r"].as_u64().unwrap() as usize;
    let s = ApiState::new(
        vec![BaseModel {
            name: "tiny".into(),
            model,
        }],
        ApiConfig {
            api_key: Some("tml-k".into()),
            checkpoint_dir: dir.path().to_path_buf(),
            long_poll: Duration::from_secs(5),
            result_grace: Duration::from_secs(600),
            limits: Default::default(),
            adapters: [(
                "peft".to_string(),
                temper_server::training_api::ServedAdapter {
                    dir: adapter_dir,
                    rank,
                },
            )]
            .into(),
        },
    );
    let (_, sess) = call(&s, "/api/v1/create_session", json!({})).await;
    let sid = sess["session_id"].as_str().unwrap().to_string();
    // What the SDK's create_training_client_from_state sends.
    let (st, body) = call(
        &s,
        "/api/v1/load_weights",
        json!({"session_id": sid, "model_seq_id": 0, "path": "tinker://adapters/peft/nope"}),
    )
    .await;
    assert_eq!(st, StatusCode::NOT_FOUND, "{body}");
    assert!(
        body["detail"].as_str().unwrap().contains("[\"peft\"]"),
        "lists what is served: {body}"
    );
    let (st, body) = call(
        &s,
        "/api/v1/load_weights",
        json!({"session_id": sid, "model_seq_id": 0, "path": "tinker://adapters/peft/peft", "seq_id": 1}),
    )
    .await;
    assert_eq!(st, StatusCode::OK, "{body}");
    let model_id = body["model_id"].as_str().unwrap().to_string();
    let res = result_json(&s, &body["request_id"]).await;
    assert_eq!(res["type"], "load_weights", "{res}");
    let (_, info) = call(&s, "/api/v1/get_info", json!({"model_id": model_id})).await;
    assert_eq!(info["lora_rank"], rank);

    let golden: Value = serde_json::from_str(
        &std::fs::read_to_string(fixtures.join("golden/tiny-qwen3.json")).unwrap(),
    )
    .unwrap();
    let tensors = temper_model::candle_core::safetensors::load(
        fixtures.join("golden/tiny-qwen3.safetensors"),
        &Device::Cpu,
    )
    .unwrap();
    for (i, ids) in golden["inputs"].as_array().unwrap().iter().enumerate() {
        let ids: Vec<u32> = ids
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap() as u32)
            .collect();
        let fb = proto::ForwardBackwardRequest {
            model_id: model_id.clone(),
            seq_id: 10 + i as i32,
            data: vec![datum(&ids, None)],
            loss_fn: "cross_entropy".into(),
            forward_only: true,
            ..Default::default()
        };
        let (st, body) = post_proto(&s, "/api/v1/forward_backward", fb.encode_to_vec()).await;
        assert_eq!(st, StatusCode::OK, "{body}");
        let (_, bytes) = result_bytes(&s, &body["request_id"]).await;
        let out = proto::ForwardBackwardOutput::decode(bytes.as_slice()).expect("protobuf");
        let ours = proto::le::f32_from(&out.loss_fn_outputs[0].fields["logprobs"].data).unwrap();
        let logits = &tensors[&format!("lora_logits.{i}")];
        let max = logits.max_keepdim(D::Minus1).unwrap();
        let shifted = logits.broadcast_sub(&max).unwrap();
        let lse = shifted
            .exp()
            .unwrap()
            .sum_keepdim(D::Minus1)
            .unwrap()
            .log()
            .unwrap();
        let logp = shifted
            .broadcast_sub(&lse)
            .unwrap()
            .to_vec2::<f32>()
            .unwrap();
        assert_eq!(ours.len(), ids.len() - 1);
        for (t, &target) in ids[1..].iter().enumerate() {
            let theirs = logp[t][target as usize];
            assert!(
                (ours[t] - theirs).abs() <= 1e-4,
                "input {i} position {t}: {} vs transformers+PEFT {theirs}",
                ours[t]
            );
        }
    }
}

/// forward (and, with `train`, forward_backward + optim_step) on one datum;
/// returns the forward's `loss:sum` before any update.
async fn loss_then_maybe_step(s: &ApiState, model_id: &str, seq: &mut i32, train: bool) -> f64 {
    let ids: Vec<u32> = (3..40).collect();
    let mut req = proto::ForwardBackwardRequest {
        model_id: model_id.to_string(),
        seq_id: *seq,
        data: vec![datum(&ids, None)],
        loss_fn: "cross_entropy".into(),
        forward_only: true,
        ..Default::default()
    };
    *seq += 1;
    let (_, body) = post_proto(s, "/api/v1/forward_backward", req.encode_to_vec()).await;
    let (_, bytes) = result_bytes(s, &body["request_id"]).await;
    let loss = proto::ForwardBackwardOutput::decode(bytes.as_slice())
        .expect("protobuf")
        .metrics["loss:sum"];
    if train {
        req.forward_only = false;
        req.seq_id = *seq;
        *seq += 1;
        let (_, body) = post_proto(s, "/api/v1/forward_backward", req.encode_to_vec()).await;
        result_bytes(s, &body["request_id"]).await;
        let (_, op) = call(
            s,
            "/api/v1/optim_step",
            json!({"model_id": model_id, "seq_id": *seq, "adam_params": {"learning_rate": 0.01}}),
        )
        .await;
        *seq += 1;
        let res = result_json(s, &op["request_id"]).await;
        assert!(res["metrics"]["grad_norm:mean"].as_f64().is_some(), "{res}");
    }
    loss
}

#[tokio::test]
async fn a_checkpoint_saved_before_a_restart_resumes_with_its_optimizer_and_identical_losses() {
    let dir = tempfile::tempdir().expect("temp dir");
    let (path, want) = {
        let s = state(dir.path());
        let (_, model_id) = new_model(&s).await;
        let mut seq = 1;
        loss_then_maybe_step(&s, &model_id, &mut seq, true).await;
        loss_then_maybe_step(&s, &model_id, &mut seq, true).await;
        let (_, r) = call(
            &s,
            "/api/v1/save_weights",
            json!({"model_id": model_id, "path": "dur1", "seq_id": seq}),
        )
        .await;
        seq += 1;
        let path = result_json(&s, &r["request_id"]).await["path"]
            .as_str()
            .expect("path")
            .to_string();
        // The next three losses the original run sees, training in between.
        let mut want = Vec::new();
        for _ in 0..3 {
            want.push(loss_then_maybe_step(&s, &model_id, &mut seq, true).await);
        }
        (path, want)
    }; // the server is gone: nothing of it remains in memory.
    let s = state(dir.path());
    let (_, sess) = call(&s, "/api/v1/create_session", json!({})).await;
    // create_training_client_from_state_with_optimizer's request.
    let (st, body) = call(
        &s,
        "/api/v1/load_weights",
        json!({"session_id": sess["session_id"], "model_seq_id": 0, "path": path,
               "optimizer": true, "seq_id": 1}),
    )
    .await;
    assert_eq!(st, StatusCode::OK, "{body}");
    let res = result_json(&s, &body["request_id"]).await;
    assert_eq!(res["type"], "load_weights", "{res}");
    let model_id = res["model_id"].as_str().unwrap().to_string();
    let (_, info) = call(&s, "/api/v1/get_info", json!({"model_id": model_id})).await;
    assert_eq!(info["lora_rank"], 2);
    let mut seq = 2;
    let mut got = Vec::new();
    for _ in 0..3 {
        got.push(loss_then_maybe_step(&s, &model_id, &mut seq, true).await);
    }
    assert_eq!(got, want, "losses after the restart differ");
}

#[tokio::test]
async fn results_nobody_retrieves_are_bounded_in_number_and_age() {
    let dir = tempfile::tempdir().expect("temp dir");
    let make = |limits: temper_server::training_api::ApiLimits| {
        let model = Arc::new(
            Pretrained::load(
                &PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/models/tiny-qwen3"),
                &LoadOptions::default(),
            )
            .expect("fixture"),
        );
        ApiState::new(
            vec![BaseModel {
                name: "tiny".into(),
                model,
            }],
            ApiConfig {
                api_key: Some("tml-k".into()),
                checkpoint_dir: dir.path().to_path_buf(),
                long_poll: Duration::from_secs(1),
                result_grace: Duration::from_secs(600),
                limits,
                adapters: Default::default(),
            },
        )
    };
    let status_of = |s: ApiState, id: Value| async move {
        let req = Request::post("/api/v1/retrieve_future")
            .header("x-api-key", "tml-k")
            .body(Body::from(json!({"request_id": id}).to_string()))
            .unwrap();
        app(s).oneshot(req).await.unwrap().status()
    };
    // Failed futures with distinct seq_ids: each keeps a result until retrieved.
    let submit = |s: ApiState, seq: i64| async move {
        let (_, r) = call(
            &s,
            "/api/v1/save_weights",
            json!({"model_id": "nope", "path": "x", "seq_id": seq}),
        )
        .await;
        r["request_id"].clone()
    };
    let s = make(temper_server::training_api::ApiLimits {
        max_results: 3,
        ..Default::default()
    });
    let mut ids = Vec::new();
    for seq in 0..10 {
        ids.push(submit(s.clone(), seq).await);
    }
    assert_eq!(
        status_of(s.clone(), ids[0].clone()).await,
        StatusCode::NOT_FOUND
    );
    assert_eq!(status_of(s.clone(), ids[9].clone()).await, StatusCode::OK);

    let s = make(temper_server::training_api::ApiLimits {
        result_ttl: Duration::ZERO,
        ..Default::default()
    });
    let first = submit(s.clone(), 0).await;
    submit(s.clone(), 1).await; // any later request evicts what has expired
    assert_eq!(status_of(s.clone(), first).await, StatusCode::NOT_FOUND);
}
