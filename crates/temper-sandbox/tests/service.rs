//! `POST /run_code` and `GET /health` through `app(state).oneshot(..)`: no
//! socket is opened.

mod common;

use std::sync::Arc;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use common::usable_sandbox;
use http_body_util::BodyExt;
use temper_sandbox::service::{app, AppState, RunCodeResponse, Runner, ServiceConfig};
use temper_sandbox::{Language, Pool, PoolConfig};
use tower::ServiceExt;

fn state(api_key: Option<&str>) -> Option<AppState> {
    let sandbox = usable_sandbox("service test")?;
    Some(AppState::new(
        Runner::Cold(Arc::new(sandbox)),
        api_key.map(str::to_string),
        4,
    ))
}

async fn post(state: AppState, body: &str, key: Option<&str>) -> (StatusCode, String) {
    let mut req = Request::post("/run_code").header("content-type", "application/json");
    if let Some(k) = key {
        req = req.header("authorization", format!("Bearer {k}"));
    }
    let resp = app(state)
        .oneshot(req.body(Body::from(body.to_string())).expect("request"))
        .await
        .expect("response");
    let status = resp.status();
    let bytes = resp.into_body().collect().await.expect("body").to_bytes();
    (status, String::from_utf8_lossy(&bytes).into_owned())
}

#[tokio::test]
async fn run_code_is_sandboxfusion_compatible() {
    let Some(state) = state(None) else { return };
    let body = r#"{"code": "import sys\nprint(open('in.txt').read() + sys.stdin.read())\nopen('out.txt','w').write('o')",
        "language": "python", "stdin": "B", "files": {"in.txt": "QQ=="},
        "run_timeout": 5, "compile_timeout": 5, "memory_limit_mb": -1, "fetch_files": ["out.txt"]}"#;
    let (code, text) = post(state, body, None).await;
    assert_eq!(code, StatusCode::OK, "{text}");
    let r: RunCodeResponse = serde_json::from_str(&text).expect("json");
    assert_eq!(r.status, "Success");
    let run = r.run_result.expect("run_result");
    assert_eq!(
        (run.status.as_str(), run.return_code, run.stdout.as_str()),
        ("Finished", Some(0), "AB\n")
    );
    assert_eq!(r.files.get("out.txt").map(String::as_str), Some("bw=="));
}

#[tokio::test]
async fn failures_and_timeouts_are_reported_not_raised() {
    let Some(state) = state(None) else { return };
    let (code, text) = post(
        state.clone(),
        r#"{"code": "exit 4", "language": "bash"}"#,
        None,
    )
    .await;
    assert_eq!(code, StatusCode::OK);
    let r: RunCodeResponse = serde_json::from_str(&text).expect("json");
    assert_eq!(r.status, "Failed");
    assert_eq!(r.run_result.expect("run").return_code, Some(4));

    let body = r#"{"code": "while True: pass", "language": "python", "run_timeout": 0.5}"#;
    let (_, text) = post(state, body, None).await;
    let r: RunCodeResponse = serde_json::from_str(&text).expect("json");
    assert_eq!(r.run_result.expect("run").status, "TimeLimitExceeded");
}

#[tokio::test]
async fn bad_requests_get_4xx_with_a_message() {
    let Some(state) = state(None) else { return };
    for body in [
        "not json",
        r#"{"language": "python"}"#,
        r#"{"code": "1", "language": "cobol"}"#,
        r#"{"code": "1", "language": "python", "run_timeout": -1}"#,
        r#"{"code": "1", "language": "python", "files": {"a": "!!"}}"#,
        r#"{"code": "1", "language": "python", "files": {"../a": "QQ=="}}"#,
    ] {
        let (code, text) = post(state.clone(), body, None).await;
        assert!(code.is_client_error(), "{body}: {code} {text}");
        let r: RunCodeResponse = serde_json::from_str(&text).expect("json error body");
        assert!(!r.message.is_empty(), "{body}: empty message");
    }
}

#[tokio::test]
async fn api_key_is_required_when_set_and_health_is_open() {
    let Some(state) = state(Some("s3cret")) else {
        return;
    };
    let body = r#"{"code": "print(1)", "language": "python"}"#;
    assert_eq!(
        post(state.clone(), body, None).await.0,
        StatusCode::UNAUTHORIZED
    );
    assert_eq!(
        post(state.clone(), body, Some("wrong")).await.0,
        StatusCode::UNAUTHORIZED
    );
    assert_eq!(
        post(state.clone(), body, Some("s3cret")).await.0,
        StatusCode::OK
    );
    let resp = app(state)
        .oneshot(
            Request::get("/health")
                .body(Body::empty())
                .expect("request"),
        )
        .await
        .expect("response");
    assert_eq!(resp.status(), StatusCode::OK);
}

#[tokio::test]
async fn rust_client_talks_to_a_served_app_on_loopback() {
    let Some(state) = state(Some("k")) else {
        return;
    };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let server = tokio::spawn(async move { axum::serve(listener, app(state)).await });
    // Never through a proxy: the request must stay on this machine.
    let http = || {
        reqwest::Client::builder()
            .no_proxy()
            .build()
            .expect("http client")
    };
    let client = temper_sandbox::Client::with_http_client(
        format!("http://{addr}"),
        Some("k".into()),
        http(),
    );
    client.health().await.expect("health");
    let mut req = temper_sandbox::service::RunCodeRequest::new(Language::Bash, "echo $((6*7))");
    req.run_timeout = Some(5.0);
    let r = client.run_code(&req).await.expect("run_code");
    assert_eq!(r.status, "Success");
    assert_eq!(r.run_result.expect("run").stdout, "42\n");
    let bad = temper_sandbox::service::RunCodeRequest::new(Language::Bash, "true");
    let wrong = temper_sandbox::Client::local(format!("http://{addr}"), None).expect("client");
    match wrong.run_code(&bad).await {
        Err(temper_sandbox::ClientError::Status { status, .. }) => assert_eq!(status, 401),
        other => panic!("expected 401, got {other:?}"),
    }
    server.abort();
}

async fn call(state: AppState, method: &str, uri: &str, body: &str) -> (StatusCode, String) {
    call_as(state, None, method, uri, body).await
}

/// A call with `X-Client-Token: token` when given.
async fn call_as(
    state: AppState,
    token: Option<&str>,
    method: &str,
    uri: &str,
    body: &str,
) -> (StatusCode, String) {
    let mut req = Request::builder()
        .method(method)
        .uri(uri)
        .header("content-type", "application/json");
    if let Some(t) = token {
        req = req.header("x-client-token", t);
    }
    let req = req.body(Body::from(body.to_string())).expect("request");
    let resp = app(state).oneshot(req).await.expect("response");
    let status = resp.status();
    let bytes = resp.into_body().collect().await.expect("body").to_bytes();
    (status, String::from_utf8_lossy(&bytes).into_owned())
}

#[tokio::test]
async fn sessions_api_create_exec_upload_download_delete() {
    let Some(state) = state(None) else { return };
    let (code, text) = call(state.clone(), "POST", "/sessions", r#"{"env": {"A": "1"}}"#).await;
    assert_eq!(code, StatusCode::OK, "{text}");
    let id = serde_json::from_str::<serde_json::Value>(&text).expect("json")["id"]
        .as_str()
        .expect("id")
        .to_string();
    let (code, text) = call(
        state.clone(),
        "PUT",
        &format!("/sessions/{id}/files"),
        r#"{"path": "in.txt", "content": "aGk="}"#,
    )
    .await;
    assert_eq!(code, StatusCode::NO_CONTENT, "{text}");
    let exec = r#"{"command": "cat in.txt; echo $A > out.txt; exit 2", "timeout": 5}"#;
    let (code, text) = call(state.clone(), "POST", &format!("/sessions/{id}/exec"), exec).await;
    assert_eq!(code, StatusCode::OK, "{text}");
    let r: temper_sandbox::service::SessionExecResponse =
        serde_json::from_str(&text).expect("json");
    assert_eq!((r.stdout.as_str(), r.exit_code), ("hi", Some(2)));
    let (code, text) = call(
        state.clone(),
        "GET",
        &format!("/sessions/{id}/files?path=out.txt"),
        "",
    )
    .await;
    assert_eq!(code, StatusCode::OK, "{text}");
    assert!(text.contains("\"content\":\"MQo=\""), "{text}");
    let (code, _) = call(
        state.clone(),
        "GET",
        &format!("/sessions/{id}/files?path=nope"),
        "",
    )
    .await;
    assert_eq!(code, StatusCode::NOT_FOUND);
    // Listing needs the client's token (these sessions have none).
    let (code, text) = call(state.clone(), "GET", "/sessions", "").await;
    assert_eq!(code, StatusCode::BAD_REQUEST, "{text}");
    let (code, _) = call(state.clone(), "POST", "/sessions", r#"{"timeout": -3}"#).await;
    assert_eq!(code, StatusCode::BAD_REQUEST);
    let (code, _) = call(state.clone(), "DELETE", &format!("/sessions/{id}"), "").await;
    assert_eq!(code, StatusCode::NO_CONTENT);
    let (code, text) = call(state, "POST", &format!("/sessions/{id}/exec"), exec).await;
    assert_eq!(code, StatusCode::NOT_FOUND, "{text}");
}

#[tokio::test]
async fn the_service_keeps_serving_during_a_fork_bomb() {
    let Some(state) = state(None) else { return };
    let bomb = post(
        state.clone(),
        r#"{"code": ":(){ :|:& };:", "language": "bash", "run_timeout": 2}"#,
        None,
    );
    let others = async {
        tokio::time::sleep(std::time::Duration::from_millis(300)).await;
        let mut outs = Vec::new();
        for _ in 0..4 {
            outs.push(
                post(
                    state.clone(),
                    r#"{"code": "print(7)", "language": "python"}"#,
                    None,
                )
                .await,
            );
        }
        outs
    };
    let (_, outs) = tokio::join!(bomb, others);
    for (code, text) in outs {
        assert_eq!(code, StatusCode::OK);
        let r: RunCodeResponse = serde_json::from_str(&text).expect("json");
        assert_eq!(r.run_result.expect("run").stdout, "7\n", "{text}");
    }
}

#[tokio::test]
async fn huge_memory_limits_are_capped_not_overflowed() {
    let Some(state) = state(None) else { return };
    let body = r#"{"code": "import resource; print(resource.getrlimit(resource.RLIMIT_AS)[0] >> 20)",
        "language": "python", "memory_limit_mb": 1000000000000000}"#;
    let (code, text) = post(state, body, None).await;
    assert_eq!(code, StatusCode::OK, "{text}");
    let r: RunCodeResponse = serde_json::from_str(&text).expect("json");
    let cap = temper_sandbox::Limits::default().memory_mb;
    assert_eq!(r.run_result.expect("run").stdout, format!("{cap}\n"));
}

fn session_id(text: &str) -> String {
    serde_json::from_str::<serde_json::Value>(text).expect("json")["id"]
        .as_str()
        .expect("id")
        .to_string()
}

#[tokio::test]
async fn sessions_belong_to_the_client_that_created_them() {
    let Some(state) = state(None) else { return };
    let (alice, bob) = (Some("alice-token-1"), Some("bob-token-2"));
    let (code, text) = call_as(state.clone(), alice, "POST", "/sessions", "{}").await;
    assert_eq!(code, StatusCode::OK, "{text}");
    let a = session_id(&text);
    assert_eq!(a.len(), 32, "128-bit hex capability id: {a}");
    let (code, text) = call_as(state.clone(), bob, "POST", "/sessions", "{}").await;
    assert_eq!(code, StatusCode::OK, "{text}");
    let b = session_id(&text);

    // Each lists only its own.
    let (code, text) = call_as(state.clone(), alice, "GET", "/sessions", "").await;
    assert_eq!(code, StatusCode::OK, "{text}");
    assert!(text.contains(&a) && !text.contains(&b), "{text}");
    let (_, text) = call_as(state.clone(), bob, "GET", "/sessions", "").await;
    assert!(text.contains(&b) && !text.contains(&a), "{text}");

    // Alice writes a secret; Bob (or a caller with no token) cannot reach it.
    let exec = r#"{"command": "echo secret > s.txt"}"#;
    let (code, text) = call_as(
        state.clone(),
        alice,
        "POST",
        &format!("/sessions/{a}/exec"),
        exec,
    )
    .await;
    assert_eq!(code, StatusCode::OK, "{text}");
    for who in [bob, None] {
        for (method, uri, body) in [
            (
                "POST",
                format!("/sessions/{a}/exec"),
                r#"{"command": "cat s.txt"}"#,
            ),
            ("GET", format!("/sessions/{a}/files?path=s.txt"), ""),
            (
                "PUT",
                format!("/sessions/{a}/files"),
                r#"{"path": "x", "content": ""}"#,
            ),
            ("DELETE", format!("/sessions/{a}"), ""),
        ] {
            let (code, text) = call_as(state.clone(), who, method, &uri, body).await;
            assert_eq!(
                code,
                StatusCode::NOT_FOUND,
                "{who:?} {method} {uri}: {text}"
            );
            assert!(!text.contains("secret"), "{text}");
        }
    }
    // Alice still has it, intact.
    let (code, text) = call_as(
        state.clone(),
        alice,
        "GET",
        &format!("/sessions/{a}/files?path=s.txt"),
        "",
    )
    .await;
    assert_eq!(code, StatusCode::OK, "{text}");
    let (code, _) = call_as(
        state.clone(),
        alice,
        "DELETE",
        &format!("/sessions/{a}"),
        "",
    )
    .await;
    assert_eq!(code, StatusCode::NO_CONTENT);
    let (code, _) = call_as(state, bob, "DELETE", &format!("/sessions/{b}"), "").await;
    assert_eq!(code, StatusCode::NO_CONTENT);
}

fn pool_state(config: ServiceConfig, size: usize) -> Option<(AppState, Arc<Pool>)> {
    let sandbox = Arc::new(usable_sandbox("pool service test")?);
    let pool = Arc::new(
        Pool::new(
            sandbox,
            PoolConfig {
                size,
                ..PoolConfig::default()
            },
        )
        .expect("pool"),
    );
    Some((
        AppState::with_config(Runner::Pool(pool.clone()), config),
        pool,
    ))
}

const BAD_PATHS: [&str; 7] = ["", ".", "./", "/etc/passwd", "../x", "a/../../x", "a\u{0}b"];

#[tokio::test]
async fn bad_file_paths_are_a_400_and_never_kill_a_worker_or_session() {
    let Some((state, pool)) = pool_state(ServiceConfig::default(), 2) else {
        return;
    };
    let long = "x".repeat(5000);
    let mut paths: Vec<&str> = BAD_PATHS.to_vec();
    paths.push(&long);
    for path in &paths {
        let files = serde_json::json!({ "code": "print(1)", "language": "python",
            "files": { *path: "aGk=" } });
        let (code, text) = post(state.clone(), &files.to_string(), None).await;
        assert_eq!(code, StatusCode::BAD_REQUEST, "files {path:?}: {text}");
        let fetch = serde_json::json!({ "code": "print(1)", "language": "python",
            "fetch_files": [path] });
        let (code, text) = post(state.clone(), &fetch.to_string(), None).await;
        assert_eq!(
            code,
            StatusCode::BAD_REQUEST,
            "fetch_files {path:?}: {text}"
        );
    }
    // A file that is also a directory of another cannot be written.
    let both = r#"{"code": "print(1)", "language": "python", "files": {"a": "", "a/b": ""}}"#;
    let (code, text) = post(state.clone(), both, None).await;
    assert_eq!(code, StatusCode::BAD_REQUEST, "{text}");
    assert_eq!(pool.workers(), 2);

    let (code, text) = call(state.clone(), "POST", "/sessions", "{}").await;
    assert_eq!(code, StatusCode::OK, "{text}");
    let id = session_id(&text);
    for path in &paths {
        let body = serde_json::json!({ "path": path, "content": "aGk=" });
        let (code, text) = call(
            state.clone(),
            "PUT",
            &format!("/sessions/{id}/files"),
            &body.to_string(),
        )
        .await;
        assert_eq!(code, StatusCode::BAD_REQUEST, "upload {path:?}: {text}");
    }
    // A directory in the way of an upload: a 400 too, and the session lives.
    let (code, _) = call(
        state.clone(),
        "POST",
        &format!("/sessions/{id}/exec"),
        r#"{"command": "mkdir d"}"#,
    )
    .await;
    assert_eq!(code, StatusCode::OK);
    let (code, text) = call(
        state.clone(),
        "PUT",
        &format!("/sessions/{id}/files"),
        r#"{"path": "d", "content": "aGk="}"#,
    )
    .await;
    assert_eq!(code, StatusCode::BAD_REQUEST, "{text}");
    let (code, text) = call(
        state.clone(),
        "POST",
        &format!("/sessions/{id}/exec"),
        r#"{"command": "echo alive"}"#,
    )
    .await;
    assert_eq!(code, StatusCode::OK, "{text}");
    assert!(text.contains("alive"), "{text}");
    let (code, _) = call(state, "DELETE", &format!("/sessions/{id}"), "").await;
    assert_eq!(code, StatusCode::NO_CONTENT);
}

#[tokio::test]
async fn kill_minus_one_in_user_code_is_a_killed_result_and_the_pool_heals() {
    let Some((state, pool)) = pool_state(ServiceConfig::default(), 3) else {
        return;
    };
    let body = r#"{"code": "import os\nprint('before', flush=True)\nos.kill(-1, 9)", "language": "python"}"#;
    for _ in 0..3 {
        let (code, text) = post(state.clone(), body, None).await;
        assert_eq!(code, StatusCode::OK, "{text}");
        let r: RunCodeResponse = serde_json::from_str(&text).expect("json");
        assert_eq!(r.status, "Failed", "{text}");
        let run = r.run_result.expect("run");
        assert_eq!(run.return_code, Some(-9), "{text}");
        assert_eq!(pool.workers(), 3, "pool did not heal");
    }
    assert_eq!(pool.idle_workers(), 3);
    let (code, text) = post(state, r#"{"code": "print(1)", "language": "python"}"#, None).await;
    assert_eq!(code, StatusCode::OK);
    assert!(text.contains("\"stdout\":\"1\\n\""), "{text}");
}

#[tokio::test]
async fn the_session_cap_is_a_429() {
    let config = ServiceConfig {
        max_sessions: 2,
        ..ServiceConfig::default()
    };
    let Some((state, _pool)) = pool_state(config, 1) else {
        return;
    };
    let mut ids = Vec::new();
    for _ in 0..2 {
        let (code, text) = call(state.clone(), "POST", "/sessions", "{}").await;
        assert_eq!(code, StatusCode::OK, "{text}");
        ids.push(session_id(&text));
    }
    let (code, text) = call(state.clone(), "POST", "/sessions", "{}").await;
    assert_eq!(code, StatusCode::TOO_MANY_REQUESTS, "{text}");
    assert!(text.contains("at most 2 sessions"), "{text}");
    let (code, _) = call(
        state.clone(),
        "DELETE",
        &format!("/sessions/{}", ids[0]),
        "",
    )
    .await;
    assert_eq!(code, StatusCode::NO_CONTENT);
    let (code, text) = call(state, "POST", "/sessions", "{}").await;
    assert_eq!(code, StatusCode::OK, "{text}");
}

#[tokio::test]
async fn a_full_queue_answers_429_with_retry_after_promptly() {
    // One slot, no queue: a session command holding the slot makes both a
    // run and another session command wait -> refused at once.
    let config = ServiceConfig {
        concurrency: 1,
        max_queue: 0,
        ..ServiceConfig::default()
    };
    let Some((state, _pool)) = pool_state(config, 1) else {
        return;
    };
    let (_, text) = call(state.clone(), "POST", "/sessions", "{}").await;
    let id = session_id(&text);
    let exec_uri = format!("/sessions/{id}/exec");
    let busy = call(
        state.clone(),
        "POST",
        &exec_uri,
        r#"{"command": "sleep 3"}"#,
    );
    let probe = async {
        tokio::time::sleep(std::time::Duration::from_millis(500)).await;
        let t = std::time::Instant::now();
        let req = Request::post("/run_code")
            .header("content-type", "application/json")
            .body(Body::from(r#"{"code": "print(1)", "language": "python"}"#))
            .expect("request");
        let resp = app(state.clone()).oneshot(req).await.expect("response");
        let waited = t.elapsed();
        let retry = resp
            .headers()
            .get("retry-after")
            .map(|v| v.to_str().expect("ascii").to_string());
        (resp.status(), retry, waited)
    };
    let ((code, text), (status, retry, waited)) = tokio::join!(busy, probe);
    assert_eq!(code, StatusCode::OK, "{text}");
    let r: temper_sandbox::service::SessionExecResponse =
        serde_json::from_str(&text).expect("json");
    assert!(r.execution_time > 2.5 && r.queue_time < 0.5, "{text}");
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(retry.as_deref(), Some("1"));
    assert!(waited < std::time::Duration::from_secs(1), "{waited:?}");
    // With the slot free again, a run answers and reports its queue time.
    let (code, text) = post(state, r#"{"code": "print(1)", "language": "python"}"#, None).await;
    assert_eq!(code, StatusCode::OK, "{text}");
    let r: RunCodeResponse = serde_json::from_str(&text).expect("json");
    assert!(r.queue_time >= 0.0);
}

#[tokio::test]
async fn queue_time_is_reported_apart_from_run_time() {
    let config = ServiceConfig {
        concurrency: 1,
        ..ServiceConfig::default()
    };
    let Some((state, _pool)) = pool_state(config, 1) else {
        return;
    };
    let sleeper = post(
        state.clone(),
        r#"{"code": "import time; time.sleep(1.5)", "language": "python"}"#,
        None,
    );
    let quick = async {
        tokio::time::sleep(std::time::Duration::from_millis(300)).await;
        post(
            state.clone(),
            r#"{"code": "print(1)", "language": "python"}"#,
            None,
        )
        .await
    };
    let (_, (code, text)) = tokio::join!(sleeper, quick);
    assert_eq!(code, StatusCode::OK, "{text}");
    let r: RunCodeResponse = serde_json::from_str(&text).expect("json");
    assert!(r.queue_time > 0.8, "queue_time {}", r.queue_time);
    assert!(r.run_result.expect("run").execution_time < 0.8);
    let (_, metrics) = call(state, "GET", "/metrics", "").await;
    let queued: f64 = metrics
        .lines()
        .find_map(|l| l.strip_prefix("temper_sandbox_queue_seconds_total "))
        .expect("queue metric")
        .parse()
        .expect("number");
    assert!(queued > 0.8, "{metrics}");
}

/// Issue 38: `requirements` are refused (400, with what to do) by a service
/// that installs no packages, and checked before anything reaches pip by
/// one that does: no path, URL or pip option.
#[tokio::test]
async fn requirements_are_checked_before_any_install() {
    let Some(plain) = state(None) else { return };
    let body = r#"{"code": "print(1)", "language": "python", "requirements": ["pytest"]}"#;
    let (code, text) = post(plain, body, None).await;
    assert_eq!(code, StatusCode::BAD_REQUEST, "{text}");
    assert!(text.contains("installs no Python packages"), "{text}");

    let Some(state) = state(None) else { return };
    let home = std::env::var("HOME").unwrap_or_default();
    if home.is_empty() || home.starts_with("/tmp") || home.starts_with("/work") {
        eprintln!("SKIPPED: no venv cache directory outside /tmp and /work");
        return;
    }
    let cache = tempfile_in(&home);
    let config = temper_sandbox::VenvConfig {
        root: cache.clone(),
        pip_args: Vec::new(),
        build_timeout: std::time::Duration::from_secs(5),
    };
    let venvs = temper_sandbox::Venvs::new(config, temper_sandbox::SandboxConfig::default())
        .expect("venvs");
    let state = state.with_venvs(Arc::new(venvs));
    for bad in [
        "--index-url=http://evil",
        "-r /etc/passwd",
        "pkg @ https://evil/pkg.whl",
        "./local/dir",
        "/abs/wheel.whl",
        "",
    ] {
        let body =
            serde_json::json!({"code": "print(1)", "language": "python", "requirements": [bad]});
        let (code, text) = post(state.clone(), &body.to_string(), None).await;
        assert_eq!(code, StatusCode::BAD_REQUEST, "{bad:?}: {text}");
        assert!(text.contains("no paths, URLs or pip options"), "{text}");
    }
    // Nothing was built.
    assert_eq!(std::fs::read_dir(&cache).expect("cache").count(), 0);
    let _ = std::fs::remove_dir_all(&cache);
    // A cache under a directory each sandbox mounts over is refused.
    let config = temper_sandbox::VenvConfig {
        root: "/tmp/temper-venvs-test".into(),
        pip_args: Vec::new(),
        build_timeout: std::time::Duration::from_secs(5),
    };
    let e = temper_sandbox::Venvs::new(config, temper_sandbox::SandboxConfig::default())
        .expect_err("refused");
    assert!(e.to_string().contains("lies under /tmp"), "{e}");
}

/// A fresh directory under `parent` (no tempfile dependency here).
fn tempfile_in(parent: &str) -> std::path::PathBuf {
    let dir = std::path::Path::new(parent).join(format!(
        ".temper-venvs-test-{}-{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos())
    ));
    std::fs::create_dir_all(&dir).expect("cache dir");
    dir
}
