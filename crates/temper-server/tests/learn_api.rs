//! Learning from use (issue 36), the server's half: rewards on episodes
//! (authorized by the episode's token, stored durably only for episodes
//! that opted in to training), the episode named on responses, and
//! promoted versions with rollback, surviving a restart. Driven in process
//! with `oneshot`; the learner and a `kill -9` of the real binary are in
//! `crates/temper/tests/learn_cli.rs`.

use std::path::Path;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use axum::Router;
use serde_json::{json, Value};
use temper_server::openai::feedback::RewardLimits;
use temper_server::openai::{app, Learning, OpenAiState, ServeConfig};

mod common;
use common::*;

async fn request(
    router: &Router,
    method: &str,
    path: &str,
    token: Option<&str>,
    body: Option<Value>,
) -> (StatusCode, Value) {
    let mut b = Request::builder().method(method).uri(path);
    if let Some(t) = token {
        b = b.header("Authorization", format!("Bearer {t}"));
    }
    let req = match body {
        Some(v) => b
            .header("content-type", "application/json")
            .body(Body::from(v.to_string())),
        None => b.body(Body::empty()),
    }
    .expect("request");
    let (status, bytes) = send(router, req).await;
    (
        status,
        serde_json::from_slice(&bytes).unwrap_or(Value::Null),
    )
}

fn learning_server(dir: &Path) -> OpenAiState {
    let m = load();
    let mut cfg = ServeConfig::defaults(MODEL, &m);
    cfg.scheduler.max_model_len = 512;
    let learning = Learning::open(dir, "live", RewardLimits::default()).expect("learning state");
    OpenAiState::with_learning(m, cfg, Some(learning))
}

async fn episode(r: &Router, train: bool) -> (String, String) {
    let (status, v) = request(
        r,
        "POST",
        "/v1/episodes",
        None,
        Some(json!({"train": train})),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{v}");
    assert_eq!(v["train"], train);
    (
        v["id"].as_str().expect("id").into(),
        v["token"].as_str().expect("token").into(),
    )
}

async fn chat(r: &Router, ep: &str, token: &str, model: &str) -> Value {
    let (status, v) = request(
        r,
        "POST",
        &format!("/episodes/{ep}/v1/chat/completions"),
        Some(token),
        Some(
            json!({"model": model, "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 4, "temperature": 1.0, "seed": 1}),
        ),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{v}");
    v
}

/// Issue 36: a reward needs the episode's own token (another client's
/// token and an unknown id get the same 404); it is given once; only an
/// episode that opted in is stored for training, durably; responses name
/// their episode and the version that answered; a server that does not
/// learn refuses opting in.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rewards_are_authorized_by_the_episode_token_and_stored_only_when_opted_in() {
    let dir = tempfile::tempdir().expect("tmp");
    let s = learning_server(dir.path());
    let r = app(s.clone());
    let (a, tok_a) = episode(&r, true).await;
    let (b, tok_b) = episode(&r, false).await;
    let answer = chat(&r, &a, &tok_a, MODEL).await;
    assert_eq!(answer["episode"], a.as_str());
    assert_eq!(answer["version"], 0);
    chat(&r, &b, &tok_b, MODEL).await;
    // No episode header, no episode field.
    let (_, plain) = post(
        &r,
        "/v1/chat/completions",
        json!({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
    )
    .await;
    assert!(plain.get("episode").is_none(), "{plain}");

    let reward = |id: &str| format!("/v1/episodes/{id}/reward");
    // Another client's token, no token, an unknown id: one 404.
    let (s1, wrong) = request(
        &r,
        "POST",
        &reward(&a),
        Some(&tok_b),
        Some(json!({"reward": 1.0})),
    )
    .await;
    let (s2, none) = request(&r, "POST", &reward(&a), None, Some(json!({"reward": 1.0}))).await;
    let (s3, unknown) = request(
        &r,
        "POST",
        &reward("ep-unknown"),
        Some(&tok_a),
        Some(json!({"reward": 1.0})),
    )
    .await;
    for (st, v) in [(s1, &wrong), (s2, &none), (s3, &unknown)] {
        assert_eq!(st, StatusCode::NOT_FOUND, "{v}");
        assert_eq!(v["error"]["code"], "episode_not_found");
    }
    assert_eq!(
        wrong["error"]["message"]
            .as_str()
            .map(|m| m.replace(&a, "ID")),
        unknown["error"]["message"]
            .as_str()
            .map(|m| m.replace("ep-unknown", "ID")),
    );
    // Bad bodies are 400s; nothing was stored.
    for bad in [
        json!({}),
        json!({"reward": "good"}),
        json!({"reward": 1.0, "why": "x"}),
    ] {
        let (st, v) = request(&r, "POST", &reward(&a), Some(&tok_a), Some(bad)).await;
        assert_eq!(st, StatusCode::BAD_REQUEST, "{v}");
    }
    let store = s.learning().expect("learning").rewards.clone();
    assert_eq!(store.size().expect("size").0, 0);

    // The owner rewards it: stored (opted in), once.
    let (st, v) = request(
        &r,
        "POST",
        &reward(&a),
        Some(&tok_a),
        Some(json!({"reward": 0.75})),
    )
    .await;
    assert_eq!(st, StatusCode::OK, "{v}");
    assert_eq!(
        (v["stored"].clone(), v["n"].clone()),
        (json!(true), json!(0))
    );
    let (st, v) = request(
        &r,
        "POST",
        &reward(&a),
        Some(&tok_a),
        Some(json!({"reward": 0.0})),
    )
    .await;
    assert_eq!(st, StatusCode::CONFLICT, "{v}");
    // Not opted in: the reward is kept on the episode, never stored.
    let (st, v) = request(
        &r,
        "POST",
        &reward(&b),
        Some(&tok_b),
        Some(json!({"reward": 1.0})),
    )
    .await;
    assert_eq!(st, StatusCode::OK, "{v}");
    assert_eq!(v["stored"], false);
    assert!(
        v["reason"].as_str().expect("reason").contains("opt in"),
        "{v}"
    );
    let (_, got) = request(&r, "GET", &format!("/v1/episodes/{b}"), Some(&tok_b), None).await;
    assert_eq!(
        (got["reward"].clone(), got["train"].clone()),
        (json!(1.0), json!(false))
    );

    // On disk: exactly a's episode, with its captured tokens.
    drop(r);
    drop(s);
    let reopened = Learning::open(dir.path(), "live", RewardLimits::default()).expect("reopen");
    let stored = reopened.rewards.since(0).expect("since");
    assert_eq!(stored.len(), 1);
    assert_eq!(
        (stored[0].id.as_str(), stored[0].reward),
        (a.as_str(), 0.75)
    );
    assert!(!stored[0].records[0].completion_token_ids.is_empty());
    assert_eq!(
        stored[0].records[0].logprobs.len(),
        stored[0].records[0].completion_token_ids.len()
    );

    // A server that does not learn refuses opting in.
    let (_, plain_server) = server();
    let (st, v) = request(
        &app(plain_server),
        "POST",
        "/v1/episodes",
        None,
        Some(json!({"train": true})),
    )
    .await;
    assert_eq!(st, StatusCode::BAD_REQUEST, "{v}");
}

/// The events of a streamed call under episode `ep`.
async fn stream(r: &Router, ep: &str, token: &str, path: &str, body: Value) -> Vec<Value> {
    let req = Request::post(format!("/episodes/{ep}{path}"))
        .header("Authorization", format!("Bearer {token}"))
        .header("content-type", "application/json")
        .body(Body::from(body.to_string()))
        .expect("request");
    let (status, bytes) = send(r, req).await;
    assert_eq!(
        status,
        StatusCode::OK,
        "{}",
        String::from_utf8_lossy(&bytes)
    );
    // Each event's `data:` line (the Responses API's events also have an
    // `event:` line).
    let text = String::from_utf8(bytes).expect("utf8");
    let payloads: Vec<&str> = text
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .collect();
    assert!(payloads.len() > 1, "{text}");
    payloads
        .iter()
        .filter(|p| **p != "[DONE]")
        .map(|p| serde_json::from_str(p).expect("a JSON event"))
        .collect()
}

/// Issue 36: streamed chat completions, completions and responses name
/// their episode and the version that answered as the unstreamed ones do
/// (every chunk; the Responses API on its response object), and a
/// streamed, opted-in call is rewarded and stored like any other.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streamed_responses_name_their_episode_and_version() {
    let dir = tempfile::tempdir().expect("tmp");
    let s = learning_server(dir.path());
    let r = app(s.clone());
    let msgs = json!([{"role": "user", "content": "hi"}]);
    let calls = [
        (
            "/v1/chat/completions",
            json!({"model": MODEL, "messages": msgs, "max_tokens": 4, "stream": true,
                   "temperature": 1.0, "seed": 1}),
        ),
        (
            "/v1/completions",
            json!({"model": MODEL, "prompt": "hi", "max_tokens": 4, "stream": true,
                   "temperature": 1.0, "seed": 1}),
        ),
        (
            "/v1/responses",
            json!({"model": MODEL, "input": "hi", "max_output_tokens": 4, "stream": true,
                   "temperature": 1.0}),
        ),
    ];
    let mut eps = Vec::new();
    for (path, body) in calls {
        let (ep, tok) = episode(&r, true).await;
        let events = stream(&r, &ep, &tok, path, body).await;
        if path == "/v1/responses" {
            let objects: Vec<&Value> = events.iter().filter_map(|e| e.get("response")).collect();
            assert!(objects.len() >= 2, "{events:?}");
            for o in objects {
                assert_eq!(
                    (&o["episode"], &o["version"]),
                    (&json!(ep), &json!(0)),
                    "{o}"
                );
            }
        } else {
            for e in &events {
                assert_eq!(
                    (&e["episode"], &e["version"]),
                    (&json!(ep), &json!(0)),
                    "{e}"
                );
            }
        }
        eps.push((ep, tok));
    }
    // Not under an episode: no field.
    let (_, bytes) = send(
        &r,
        Request::post("/v1/chat/completions")
            .header("content-type", "application/json")
            .body(Body::from(
                json!({"model": MODEL, "messages": msgs, "max_tokens": 2, "stream": true})
                    .to_string(),
            ))
            .expect("request"),
    )
    .await;
    let first: Value = serde_json::from_str(&sse_payloads(&bytes)[0]).expect("chunk");
    assert!(first.get("episode").is_none(), "{first}");
    // The streamed calls were captured: their rewards are stored.
    for (i, (ep, tok)) in eps.iter().enumerate() {
        let (st, v) = request(
            &r,
            "POST",
            &format!("/v1/episodes/{ep}/reward"),
            Some(tok),
            Some(json!({"reward": 1.0})),
        )
        .await;
        assert_eq!(st, StatusCode::OK, "{v}");
        assert_eq!(
            (v["stored"].clone(), v["n"].clone()),
            (json!(true), json!(i))
        );
    }
    let stored = s
        .learning()
        .expect("learning")
        .rewards
        .since(0)
        .expect("since");
    assert!(stored.iter().all(|e| !e.records.is_empty()
        && e.records[0].completion_token_ids.len() == e.records[0].logprobs.len()));
}

fn stage(root: &Path, name: &str) -> std::path::PathBuf {
    let d = root.join(name);
    std::fs::create_dir_all(d.join("adapter")).expect("mkdir");
    for f in ["adapter_config.json", "adapter_model.safetensors"] {
        std::fs::copy(adapter_dir().join(f), d.join("adapter").join(f)).expect("copy");
    }
    d
}

/// Issue 36: promoted versions are kept and served under the learner's
/// adapter name with their version number; a rollback returns to a named
/// earlier one (responses say so); a promotion from a version no longer
/// live is refused; a restarted server serves the last live version.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn promoted_versions_roll_back_and_survive_a_restart() {
    let dir = tempfile::tempdir().expect("tmp");
    let s = learning_server(dir.path());
    let r = app(s.clone());
    assert_eq!(s.serve_live().expect("live"), None);
    let (st, _) = request(
        &r,
        "POST",
        "/v1/adapters/rollback",
        None,
        Some(json!({"version": 1})),
    )
    .await;
    assert_eq!(st, StatusCode::NOT_FOUND);
    s.promote(&stage(dir.path(), "c1"), 1, None)
        .expect("promote 1");
    s.promote(&stage(dir.path(), "c2"), 2, Some(1))
        .expect("promote 2");
    let (ep, tok) = episode(&r, true).await;
    assert_eq!(chat(&r, &ep, &tok, "live").await["version"], 2);
    // Stale parent and an existing number are conflicts.
    assert!(s.promote(&stage(dir.path(), "c3"), 3, Some(1)).is_err());
    assert!(s.promote(&stage(dir.path(), "c2b"), 2, Some(2)).is_err());

    let (st, v) = request(
        &r,
        "POST",
        "/v1/adapters/rollback",
        None,
        Some(json!({"version": 1})),
    )
    .await;
    assert_eq!(st, StatusCode::OK, "{v}");
    assert_eq!(
        (v["version"].clone(), v["previous"].clone()),
        (json!(1), json!(2))
    );
    let answer = chat(&r, &ep, &tok, "live").await;
    assert_eq!(answer["version"], 1);
    assert_eq!(answer["system_fingerprint"], "live@v1");
    let (st, v) = request(
        &r,
        "POST",
        "/v1/adapters/rollback",
        None,
        Some(json!({"version": 9})),
    )
    .await;
    assert_eq!(st, StatusCode::NOT_FOUND, "{v}");
    let (st, v) = request(
        &r,
        "POST",
        "/v1/adapters/rollback",
        None,
        Some(json!({"v": 1})),
    )
    .await;
    assert_eq!(st, StatusCode::BAD_REQUEST, "{v}");
    let (_, list) = request(&r, "GET", "/v1/adapters/versions", None, None).await;
    assert_eq!(list["live"], 1);
    let versions: Vec<u64> = list["data"]
        .as_array()
        .expect("data")
        .iter()
        .map(|v| v["version"].as_u64().expect("version"))
        .collect();
    assert_eq!(versions, vec![1, 2]);

    // A restart serves the live version (1, after the rollback).
    drop(r);
    drop(s);
    let s = learning_server(dir.path());
    assert_eq!(s.serve_live().expect("live"), Some(1));
    let r = app(s);
    let (ep, tok) = episode(&r, true).await;
    assert_eq!(chat(&r, &ep, &tok, "live").await["version"], 1);
}
