//! Token capture (issue 17): `temper serve` records the calls of an episode
//! (created by `POST /v1/episodes`, which answers its id and token; calls
//! under the per-episode base URL `/episodes/ID/v1` or with the header
//! `X-Temper-Episode`, presenting the token) at the token level, read back at
//! `/v1/episodes/ID`. Driven in process with
//! `oneshot`, like `openai_api.rs`. The end-to-end check with the official
//! `openai` client and `temper tasks run` is
//! `tests/python/test_capture_agent.py`.

use axum::body::Body;
use axum::http::{Request, StatusCode};
use axum::Router;
use serde_json::{json, Value};
use temper_model::Pretrained;
use temper_server::openai::app;

mod common;
use common::*;

async fn request(
    router: &Router,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: Option<Value>,
) -> (StatusCode, Value) {
    let mut b = Request::builder().method(method).uri(path);
    for (k, v) in headers {
        b = b.header(*k, *v);
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

/// `Model::score` of `completion` after `prompt` at `temperature` (T = 1
/// when greedy): the trainer's logprobs of the sampled tokens.
fn trainer_logprobs(m: &Pretrained, prompt: &[u32], completion: &[u32], t: f64) -> Vec<f32> {
    let full: Vec<u32> = prompt.iter().chain(completion).copied().collect();
    let t = if t > 0.0 { t } else { 1.0 };
    let all: Vec<f32> = m
        .model
        .score(&full[..full.len() - 1], &full[1..], None, t)
        .expect("score")
        .logprobs
        .to_vec1()
        .expect("vec");
    all[all.len() - completion.len()..].to_vec()
}

/// A new episode: its id and token (`auth`: the API key's header, if any).
async fn create(router: &Router, auth: &[(&str, &str)]) -> (String, String) {
    let (status, v) = request(router, "POST", "/v1/episodes", auth, None).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    assert_eq!(v["object"], "episode");
    let id = v["id"].as_str().expect("id").to_string();
    let token = v["token"].as_str().expect("token").to_string();
    (id, token)
}

fn bearer(token: &str) -> String {
    format!("Bearer {token}")
}

fn assert_bits(got: &[f32], want: &[f32], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}");
    for (a, b) in got.iter().zip(want) {
        assert_eq!(a.to_bits(), b.to_bits(), "{what}: {got:?} vs {want:?}");
    }
}

/// Token capture (issue 17): calls tagged with an episode — by the
/// per-episode base URL or the `X-Temper-Episode` header — are recorded with
/// the chat-templated prompt's token ids, the sampled token ids and their
/// logprobs equal bit for bit to `Model::score`, even when the client asked
/// for no logprobs; episodes never mix; bad ids are 400, unknown ones 404.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn episodes_capture_tokens_and_logprobs_equal_to_training_score() {
    let (m, s) = server();
    let r = app(s);
    let (ep_a, tok_a) = create(&r, &[]).await;
    let (ep_b, tok_b) = create(&r, &[]).await;
    let auth_a = bearer(&tok_a);
    let as_a = [("Authorization", auth_a.as_str())];
    let url_a = |route: &str| format!("/episodes/{ep_a}/v1/{route}");
    let msgs_a = json!([{"role": "system", "content": "be brief"},
                        {"role": "user", "content": "hello there"}]);
    // Episode a, by URL: a chat call without logprobs (n = 2), a streamed
    // chat call and a completions call.
    let (status, chat_a) = request(
        &r,
        "POST",
        &url_a("chat/completions"),
        &as_a,
        Some(
            json!({"model": MODEL, "messages": msgs_a, "max_tokens": 8, "n": 2,
                    "temperature": 0.7, "seed": 11}),
        ),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{chat_a}");
    assert!(chat_a["choices"][0]["logprobs"].is_null());
    let (status, bytes) = send(
        &r,
        Request::post(url_a("chat/completions"))
            .header("content-type", "application/json")
            .header("Authorization", auth_a.as_str())
            .body(Body::from(
                json!({"model": MODEL, "messages": [{"role": "user", "content": "stream"}],
                       "max_tokens": 5, "stream": true, "temperature": 1.0, "seed": 3})
                .to_string(),
            ))
            .expect("request"),
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    assert!(sse_payloads(&bytes).iter().any(|p| p == "[DONE]"));
    let (status, cmpl_a) = request(
        &r,
        "POST",
        &url_a("completions"),
        &as_a,
        Some(json!({"model": MODEL, "prompt": "one two", "max_tokens": 4, "temperature": 0})),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{cmpl_a}");
    // Episode b, by header, asking for logprobs: the record's equal the
    // response's.
    let (status, chat_b) = request(
        &r,
        "POST",
        "/v1/chat/completions",
        &[
            ("X-Temper-Episode", ep_b.as_str()),
            ("X-Temper-Episode-Token", tok_b.as_str()),
        ],
        Some(
            json!({"model": MODEL, "messages": [{"role": "user", "content": "other"}],
                    "max_tokens": 6, "temperature": 0.5, "seed": 5, "logprobs": true}),
        ),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{chat_b}");
    // Untagged calls are not recorded anywhere.
    let (status, _) = post(
        &r,
        "/v1/chat/completions",
        json!({"model": MODEL, "messages": [{"role": "user", "content": "untagged"}],
               "max_tokens": 3}),
    )
    .await;
    assert_eq!(status, StatusCode::OK);

    let records_a = format!("/v1/episodes/{ep_a}");
    let records_b = format!("/v1/episodes/{ep_b}");
    let (status, got_a) = request(&r, "GET", &records_a, &as_a, None).await;
    assert_eq!(status, StatusCode::OK, "{got_a}");
    assert_eq!(got_a["object"], "episode");
    assert_eq!(got_a["dropped_records"], 0);
    let recs = got_a["records"].as_array().expect("records");
    assert_eq!(recs.len(), 4, "2 chat choices, 1 streamed, 1 completion");
    let tmpl = m.chat_template.as_ref().expect("template");
    let templated = |msgs: &Value| {
        let text = tmpl
            .render(msgs, None, true, &serde_json::Map::new())
            .expect("render");
        m.tokenizer.encode(&text, false).expect("encode")
    };
    let temps = [0.7, 0.7, 1.0, 0.0];
    for (i, rec) in recs.iter().enumerate() {
        assert_eq!(rec["episode"], ep_a.as_str());
        assert_eq!(rec["seq"], i);
        assert_eq!(rec["model"], MODEL);
        assert_eq!(rec["version"], 0);
        let prompt = u32s(&rec["prompt_token_ids"]);
        let completion = u32s(&rec["completion_token_ids"]);
        assert!(!completion.is_empty());
        assert_eq!(rec["sampling"]["temperature"], temps[i]);
        assert_bits(
            &f32s(&rec["logprobs"]),
            &trainer_logprobs(&m, &prompt, &completion, temps[i]),
            &format!("ep-a record {i}"),
        );
        match i {
            0 | 1 => {
                assert_eq!(prompt, templated(&msgs_a));
                assert_eq!(rec["messages"], msgs_a);
                assert_eq!(rec["endpoint"], "chat.completions");
                assert_eq!(rec["choice"], i);
                let choice = &chat_a["choices"][i];
                assert_eq!(rec["response"], choice["message"]);
                assert_eq!(rec["finish_reason"], choice["finish_reason"]);
                assert_eq!(rec["request_id"], chat_a["id"]);
                // The response's text is the completion tokens' text.
                let text = m.tokenizer.decode(&completion, true).expect("decode");
                let content = choice["message"]["content"].as_str().unwrap_or("");
                assert!(text.starts_with(content), "{text:?} vs {content:?}");
            }
            2 => assert_eq!(
                prompt,
                templated(&json!([{"role": "user", "content": "stream"}]))
            ),
            _ => {
                assert_eq!(rec["endpoint"], "completions");
                assert_eq!(prompt, m.tokenizer.encode("one two", true).expect("encode"));
                assert_eq!(rec["response"]["text"], cmpl_a["choices"][0]["text"]);
                assert_eq!(
                    cmpl_a["usage"]["completion_tokens"].as_u64(),
                    Some(completion.len() as u64)
                );
            }
        }
    }
    assert_eq!(
        chat_a["usage"]["completion_tokens"].as_u64(),
        Some(
            (u32s(&recs[0]["completion_token_ids"]).len()
                + u32s(&recs[1]["completion_token_ids"]).len()) as u64
        )
    );

    let (status, got_b) = request(
        &r,
        "GET",
        &records_b,
        &[("X-Temper-Episode-Token", tok_b.as_str())],
        None,
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{got_b}");
    let recs_b = got_b["records"].as_array().expect("records");
    assert_eq!(recs_b.len(), 1, "episodes do not mix: {got_b}");
    let rec = &recs_b[0];
    assert_eq!(rec["episode"], ep_b.as_str());
    let answered: Vec<f32> = chat_b["choices"][0]["logprobs"]["content"]
        .as_array()
        .expect("content")
        .iter()
        .map(|e| e["logprob"].as_f64().expect("logprob") as f32)
        .collect();
    assert_bits(&f32s(&rec["logprobs"]), &answered, "ep-b vs response");
    assert_bits(
        &f32s(&rec["logprobs"]),
        &trainer_logprobs(
            &m,
            &u32s(&rec["prompt_token_ids"]),
            &u32s(&rec["completion_token_ids"]),
            0.5,
        ),
        "ep-b vs score",
    );

    // Bad ids: 400 (URL, header, both disagreeing, GET); unknown: 404.
    let chat =
        json!({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2});
    let url_chat_a = url_a("chat/completions");
    for (path, headers) in [
        ("/episodes/a%2Fb/v1/chat/completions", vec![]),
        ("/episodes/..%2F..%2Fetc/v1/chat/completions", vec![]),
        ("/v1/chat/completions", vec![("X-Temper-Episode", "../x")]),
        ("/v1/chat/completions", vec![("X-Temper-Episode", "")]),
        (
            url_chat_a.as_str(),
            vec![
                ("X-Temper-Episode", ep_b.as_str()),
                ("Authorization", auth_a.as_str()),
            ],
        ),
    ] {
        let (status, v) = request(&r, "POST", path, &headers, Some(chat.clone())).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{path} {headers:?}: {v}");
        assert!(v["error"]["message"].is_string(), "{v}");
    }
    let long = format!("/v1/episodes/{}", "x".repeat(200));
    for path in ["/v1/episodes/a%20b", "/v1/episodes/%2E%2E", long.as_str()] {
        let (status, v) = request(&r, "GET", path, &[], None).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{path}: {v}");
    }
    let (status, v) = request(&r, "GET", "/v1/episodes/never", &as_a, None).await;
    assert_eq!(status, StatusCode::NOT_FOUND, "{v}");
    assert_eq!(v["error"]["code"], "episode_not_found", "{v}");
    // DELETE drops an episode, and only that one.
    let (status, v) = request(&r, "DELETE", &records_a, &as_a, None).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    let (status, _) = request(&r, "GET", &records_a, &as_a, None).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    let (status, _) = request(&r, "DELETE", &records_a, &as_a, None).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    let auth_b = bearer(&tok_b);
    let (status, _) = request(
        &r,
        "GET",
        &records_b,
        &[("Authorization", auth_b.as_str())],
        None,
    )
    .await;
    assert_eq!(status, StatusCode::OK);
}

/// Issue 31, item 9: an episode is bound to the token its creator got
/// back, not to the shared API key. Holding the key is enough to create an
/// episode, not to append to, read or delete another's: without its token
/// (or with another episode's) every such request is the same 404 as for an
/// id never created, and nothing is recorded. The token alone (as the
/// bearer, what an agent given only its base URL sends) opens its own
/// episode's routes and nothing else. Without the key nothing opens.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn issue31_episodes_are_bound_to_their_token() {
    let m = load();
    let r = app(server_with(m, |c| c.api_key = Some("sk-test".into())));
    let chat =
        json!({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2});
    let key = [("Authorization", "Bearer sk-test")];
    let (status, _) = request(&r, "POST", "/v1/episodes", &[], None).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    let (ep, token) = create(&r, &key).await;
    let (other, other_token) = create(&r, &key).await;
    let url = format!("/episodes/{ep}/v1/chat/completions");
    let records = format!("/v1/episodes/{ep}");
    let own = bearer(&token);
    let foreign = bearer(&other_token);
    // The token alone, as the bearer; the key with the token beside it.
    let (status, v) = request(
        &r,
        "POST",
        &url,
        &[("Authorization", own.as_str())],
        Some(chat.clone()),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{v}");
    let with_key_and_token = [
        ("Authorization", "Bearer sk-test"),
        ("X-Temper-Episode-Token", token.as_str()),
    ];
    let (status, v) = request(&r, "POST", &url, &with_key_and_token, Some(chat.clone())).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    let (status, v) = request(
        &r,
        "POST",
        "/v1/chat/completions",
        &[
            ("Authorization", "Bearer sk-test"),
            ("X-Temper-Episode", ep.as_str()),
            ("X-Temper-Episode-Token", token.as_str()),
        ],
        Some(chat.clone()),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{v}");
    // The key without the token, or another episode's token: 404, as for
    // an id never created (no episode is made implicitly).
    let other_url = format!("/episodes/{other}/v1/chat/completions");
    let with_foreign_token = [
        ("Authorization", "Bearer sk-test"),
        ("X-Temper-Episode-Token", other_token.as_str()),
    ];
    for (path, headers) in [
        (url.as_str(), key.to_vec()),
        (url.as_str(), with_foreign_token.to_vec()),
        (
            "/v1/chat/completions",
            vec![key[0], ("X-Temper-Episode", ep.as_str())],
        ),
        ("/episodes/made-up/v1/chat/completions", key.to_vec()),
    ] {
        let (status, v) = request(&r, "POST", path, &headers, Some(chat.clone())).await;
        assert_eq!(status, StatusCode::NOT_FOUND, "{path} {headers:?}: {v}");
        assert_eq!(v["error"]["code"], "episode_not_found", "{v}");
    }
    for method in ["GET", "DELETE"] {
        for headers in [key.to_vec(), with_foreign_token.to_vec()] {
            let (status, v) = request(&r, method, &records, &headers, None).await;
            assert_eq!(status, StatusCode::NOT_FOUND, "{method} {headers:?}: {v}");
        }
    }
    // Another episode's token is no credential here, nor on other routes.
    let (status, _) = request(
        &r,
        "GET",
        &records,
        &[("Authorization", foreign.as_str())],
        None,
    )
    .await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    for (method, path) in [
        ("GET", "/v1/models"),
        ("POST", "/v1/chat/completions"),
        ("POST", "/v1/episodes"),
        ("POST", other_url.as_str()),
    ] {
        let body = (method == "POST").then(|| chat.clone());
        let (status, v) = request(&r, method, path, &[("Authorization", own.as_str())], body).await;
        assert_eq!(status, StatusCode::UNAUTHORIZED, "{method} {path}: {v}");
    }
    let (status, _) = request(&r, "GET", &records, &[], None).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    // Its own token reads exactly its three calls, then deletes it.
    let (status, v) = request(
        &r,
        "GET",
        &records,
        &[("Authorization", own.as_str())],
        None,
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{v}");
    assert_eq!(v["records"].as_array().map(Vec::len), Some(3), "{v}");
    let (status, v) = request(
        &r,
        "GET",
        &format!("/v1/episodes/{other}"),
        &[("Authorization", foreign.as_str())],
        None,
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{v}");
    assert_eq!(v["records"].as_array().map(Vec::len), Some(0), "{v}");
    let (status, _) = request(&r, "DELETE", &records, &with_key_and_token, None).await;
    assert_eq!(status, StatusCode::OK);
    let (status, _) = request(&r, "GET", &records, &with_key_and_token, None).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
}

/// Concurrent calls of several episodes, batched together by the
/// scheduler: each episode holds exactly its own calls.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_episodes_do_not_mix() {
    let (_, s) = server();
    let r = app(s);
    let mut episodes = Vec::new();
    for _ in 0..3 {
        episodes.push(create(&r, &[]).await);
    }
    let mut calls = Vec::new();
    for i in 0..12 {
        let r = r.clone();
        let (ep, token) = episodes[i as usize % 3].clone();
        calls.push(tokio::spawn(async move {
            let auth = bearer(&token);
            let (status, v) = request(
                &r,
                "POST",
                &format!("/episodes/{ep}/v1/chat/completions"),
                &[("Authorization", auth.as_str())],
                Some(json!({"model": MODEL, "max_tokens": 4, "seed": i,
                            "messages": [{"role": "user", "content": format!("call {i}")}]})),
            )
            .await;
            assert_eq!(status, StatusCode::OK, "{v}");
        }));
    }
    for c in calls {
        c.await.expect("call");
    }
    for (e, (ep, token)) in episodes.iter().enumerate() {
        let e = e as u64;
        let auth = bearer(token);
        let (status, v) = request(
            &r,
            "GET",
            &format!("/v1/episodes/{ep}"),
            &[("Authorization", auth.as_str())],
            None,
        )
        .await;
        assert_eq!(status, StatusCode::OK, "{v}");
        let recs = v["records"].as_array().expect("records");
        let mut seen: Vec<u64> = recs
            .iter()
            .map(|rec| {
                assert_eq!(rec["episode"], ep.as_str());
                let content = rec["messages"][0]["content"].as_str().expect("content");
                let i: u64 = content["call ".len()..].parse().expect("call number");
                assert_eq!(i % 3, e, "a call of another episode: {content}");
                i
            })
            .collect();
        seen.sort_unstable();
        assert_eq!(seen, (0..12).filter(|i| i % 3 == e).collect::<Vec<u64>>());
        let seqs: Vec<u64> = recs.iter().filter_map(|r| r["seq"].as_u64()).collect();
        assert_eq!(seqs, vec![0, 1, 2, 3]);
    }
}
