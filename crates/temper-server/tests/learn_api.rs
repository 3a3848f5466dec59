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
