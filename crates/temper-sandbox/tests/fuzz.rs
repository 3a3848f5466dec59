//! A bounded, seeded fuzz of every route of the sandbox service (the router
//! `temper sandbox serve` serves): malformed bodies, extreme values, bad
//! paths and ids, wrong or missing keys and client tokens, run in batches
//! so some requests queue. Asserts: no 5xx, the pool back at full size, the
//! session cap held, the service's peak memory under 1 GiB, and a plain
//! `print(1)` still answers afterwards.
//!
//! `TEMPER_FUZZ_CASES` (default 600) and `TEMPER_FUZZ_SEED` (default 13)
//! size and reproduce a run; a failure prints the seed and the request.

mod common;

use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use common::usable_sandbox;
use http_body_util::BodyExt;
use rand::seq::IndexedRandom;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde_json::{json, Value};
use temper_sandbox::service::{app, AppState, Runner, ServiceConfig};
use temper_sandbox::{Pool, PoolConfig};
use tower::ServiceExt;

const KEY: &str = "fuzz-key";
const POOL: usize = 2;
const MAX_SESSIONS: usize = 3;

#[derive(Debug, Clone)]
struct Case {
    method: &'static str,
    uri: String,
    headers: Vec<(&'static str, Vec<u8>)>,
    body: Vec<u8>,
}

fn pick<'a, T>(rng: &mut ChaCha8Rng, items: &'a [T]) -> &'a T {
    items.choose(rng).expect("non-empty")
}

fn weird_string(rng: &mut ChaCha8Rng) -> Value {
    const FIXED: &[&str] = &[
        "",
        ".",
        "./",
        "..",
        "../x",
        "/etc/passwd",
        "a/../../x",
        "a\u{0}b",
        "ok.txt",
        "d/e.txt",
        "~",
        "\u{202e}evil",
        "%2e%2e",
        "a//b",
    ];
    Value::String(match rng.random_range(0..10) {
        0 => "x".repeat(5000),
        1 => "a/".repeat(700) + "f",
        _ => pick(rng, FIXED).to_string(),
    })
}

fn weird_number(rng: &mut ChaCha8Rng) -> Value {
    pick(
        rng,
        &[
            json!(-1),
            json!(0),
            json!(0.001),
            json!(0.3),
            json!(1),
            json!(1e308),
            json!(-1e308),
            json!(i64::MAX),
            json!(i64::MIN),
            json!(u64::MAX),
            json!("10"),
            json!(null),
            json!([1]),
            json!({"a": 1}),
            json!(true),
        ],
    )
    .clone()
}

/// Programs: ordinary, failing, hostile (all bounded by short timeouts).
const PROGRAMS: &[(&str, &str)] = &[
    ("python", "print(1)"),
    ("python", "import sys; sys.exit(3)"),
    ("python", "raise ValueError('x')"),
    ("python", "import os; os.kill(-1, 9)"),
    ("python", "import os; os.kill(1, 9)"),
    ("python", "while True: pass"),
    ("python", "import os\nfor _ in range(200):\n    os.fork()"),
    ("python", "print('x' * 3000000)"),
    (
        "python",
        "b = bytearray(300 << 20)\nb[::4096] = b'\\x01' * len(b[::4096])",
    ),
    ("python", "open('big', 'wb').write(b'0' * (100 << 20))"),
    ("python", "import time; time.sleep(0.2)"),
    ("bash", "echo hi; exit 7"),
    ("bash", ":(){ :|:& };:"),
    ("bash", "kill -9 -1"),
    ("bash", "cat /proc/1/environ; ls /proc"),
    ("sh", "exec 1>&-; sleep 0.1"),
    ("cobol", "DISPLAY 'x'"),
];

fn files(rng: &mut ChaCha8Rng) -> Value {
    let mut map = serde_json::Map::new();
    for _ in 0..rng.random_range(0..4) {
        let Value::String(name) = weird_string(rng) else {
            continue;
        };
        let content = pick(rng, &["aGk=", "!!", "", "===="]);
        map.insert(name, json!(content));
    }
    if rng.random_bool(0.1) {
        map.insert("a".into(), json!(""));
        map.insert("a/b".into(), json!(""));
    }
    Value::Object(map)
}

fn run_code_body(rng: &mut ChaCha8Rng) -> Value {
    let (lang, code) = pick(rng, PROGRAMS);
    let mut body = json!({ "code": code, "language": lang, "run_timeout": 1.0 });
    let obj = body.as_object_mut().expect("object");
    for _ in 0..rng.random_range(0..4) {
        match rng.random_range(0..8) {
            0 => {
                obj.insert("run_timeout".into(), weird_number(rng));
            }
            1 => {
                obj.insert("memory_limit_mb".into(), weird_number(rng));
            }
            2 => {
                obj.insert("files".into(), files(rng));
            }
            3 => {
                let paths: Vec<Value> = (0..3).map(|_| weird_string(rng)).collect();
                obj.insert("fetch_files".into(), Value::Array(paths));
            }
            4 => {
                obj.insert(
                    "stdin".into(),
                    json!("y".repeat(rng.random_range(0..200_000))),
                );
            }
            5 => {
                obj.remove(*pick(rng, &["code", "language"]));
            }
            6 => {
                obj.insert("language".into(), weird_number(rng));
            }
            _ => {
                obj.insert("compile_timeout".into(), weird_number(rng));
            }
        }
    }
    // Keep hostile programs bounded: a timeout over 2 s becomes 1 s.
    if obj
        .get("run_timeout")
        .and_then(Value::as_f64)
        .is_some_and(|t| t > 2.0 && t <= 300.0)
    {
        obj.insert("run_timeout".into(), json!(1.0));
    }
    body
}

fn malformed_body(rng: &mut ChaCha8Rng) -> Vec<u8> {
    match rng.random_range(0..7) {
        0 => Vec::new(),
        1 => b"{\"code\": \"print(1)\", \"language\": ".to_vec(),
        2 => (0..rng.random_range(1..512))
            .map(|_| rng.random())
            .collect(),
        3 => {
            let n = rng.random_range(100..5000);
            ("[".repeat(n) + &"]".repeat(n)).into_bytes()
        }
        4 => b"{\"code\": \"\xff\xfe\", \"language\": \"python\"}".to_vec(),
        5 => b"null".to_vec(),
        _ => json!([1, 2, 3]).to_string().into_bytes(),
    }
}

fn session_body(rng: &mut ChaCha8Rng, route: &str) -> Value {
    match route {
        "create" => {
            let mut b = json!({});
            let o = b.as_object_mut().expect("object");
            if rng.random_bool(0.5) {
                o.insert("timeout".into(), weird_number(rng));
            }
            if rng.random_bool(0.3) {
                o.insert("idle_timeout".into(), weird_number(rng));
            }
            if rng.random_bool(0.3) {
                o.insert("memory_mb".into(), weird_number(rng));
            }
            if rng.random_bool(0.3) {
                o.insert("env".into(), json!({ "1BAD": "x", "OK": "v\u{0}" }));
            }
            b
        }
        "exec" => {
            let (_, code) = pick(rng, &PROGRAMS[11..15]);
            let mut b = json!({ "command": code, "timeout": 1.0 });
            let o = b.as_object_mut().expect("object");
            if rng.random_bool(0.4) {
                o.insert("cwd".into(), weird_string(rng));
            }
            if rng.random_bool(0.3) {
                o.insert("timeout".into(), weird_number(rng));
            }
            if rng.random_bool(0.2) {
                o.insert("env".into(), json!({ "X Y": "1" }));
            }
            b
        }
        _ => json!({ "path": weird_string(rng), "content": pick(rng, &["aGk=", "!!"]) }),
    }
}

fn case(rng: &mut ChaCha8Rng, known_ids: &[String]) -> Case {
    let id = if !known_ids.is_empty() && rng.random_bool(0.6) {
        pick(rng, known_ids).clone()
    } else {
        pick(
            rng,
            &[
                "nope",
                "..",
                "%2e%2e",
                "00000000000000000000000000000000",
                "a%00b",
            ],
        )
        .to_string()
    };
    let (method, uri, body): (&'static str, String, Vec<u8>) = match rng.random_range(0..13) {
        0..=3 => (
            "POST",
            "/run_code".into(),
            run_code_body(rng).to_string().into_bytes(),
        ),
        4 => ("POST", "/run_code".into(), malformed_body(rng)),
        5 => (
            "POST",
            "/sessions".into(),
            session_body(rng, "create").to_string().into_bytes(),
        ),
        6 => ("GET", "/sessions".into(), Vec::new()),
        7 => ("DELETE", format!("/sessions/{id}"), Vec::new()),
        8 => (
            "POST",
            format!("/sessions/{id}/exec"),
            if rng.random_bool(0.8) {
                session_body(rng, "exec").to_string().into_bytes()
            } else {
                malformed_body(rng)
            },
        ),
        9 => (
            "PUT",
            format!("/sessions/{id}/files"),
            session_body(rng, "upload").to_string().into_bytes(),
        ),
        10 => {
            let path = match weird_string(rng) {
                Value::String(p) => p.replace('\u{0}', "%00").replace(' ', "%20"),
                _ => "x".into(),
            };
            let query = if rng.random_bool(0.9) {
                format!("?path={}", path.replace('/', "%2F"))
            } else {
                String::new()
            };
            ("GET", format!("/sessions/{id}/files{query}"), Vec::new())
        }
        11 => (
            *pick(rng, &["GET", "PUT", "PATCH"]),
            pick(rng, &["/run_code", "/nope", "/sessions/x/y/z", "/"]).to_string(),
            Vec::new(),
        ),
        _ => (
            "GET",
            pick(rng, &["/health", "/metrics"]).to_string(),
            Vec::new(),
        ),
    };
    let mut headers: Vec<(&'static str, Vec<u8>)> = Vec::new();
    if rng.random_bool(0.9) {
        headers.push(("content-type", b"application/json".to_vec()));
    } else {
        headers.push(("content-type", b"text/plain".to_vec()));
    }
    match rng.random_range(0..16) {
        0 => {}
        1 => headers.push(("authorization", b"Bearer wrong".to_vec())),
        2 => headers.push(("authorization", b"Bearer ".to_vec())),
        3 => headers.push(("authorization", b"Basic Zm9vOmJhcg==".to_vec())),
        4 => headers.push(("x-api-key", KEY.as_bytes().to_vec())),
        5 => headers.push(("authorization", b"Bearer fuzz-key\xff".to_vec())),
        _ => headers.push(("authorization", format!("Bearer {KEY}").into_bytes())),
    }
    match rng.random_range(0..6) {
        0 => {}
        1 => headers.push(("x-client-token", Vec::new())),
        2 => headers.push(("x-client-token", "t".repeat(300).into_bytes())),
        3 => headers.push(("x-client-token", b"bob\xff".to_vec())),
        4 => headers.push(("x-client-token", b"bob".to_vec())),
        _ => headers.push(("x-client-token", b"alice".to_vec())),
    }
    Case {
        method,
        uri,
        headers,
        body,
    }
}

async fn send(state: AppState, case: &Case) -> (StatusCode, String) {
    let mut req = Request::builder().method(case.method).uri(&case.uri);
    for (name, value) in &case.headers {
        req = req.header(*name, value.as_slice());
    }
    let Ok(req) = req.body(Body::from(case.body.clone())) else {
        // A request hyper itself would refuse to parse: nothing to send.
        return (StatusCode::BAD_REQUEST, String::new());
    };
    let resp = app(state).oneshot(req).await.expect("router is infallible");
    let status = resp.status();
    let bytes = resp.into_body().collect().await.expect("body").to_bytes();
    (status, String::from_utf8_lossy(&bytes).into_owned())
}

fn env_or(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn every_route_survives_the_fuzz_without_a_5xx_and_the_pool_heals() {
    let Some(sandbox) = usable_sandbox("fuzz") else {
        return;
    };
    let pool = Arc::new(
        Pool::new(
            Arc::new(sandbox),
            PoolConfig {
                size: POOL,
                ..PoolConfig::default()
            },
        )
        .expect("pool"),
    );
    let state = AppState::with_config(
        Runner::Pool(pool.clone()),
        ServiceConfig {
            api_key: Some(KEY.into()),
            concurrency: POOL,
            max_queue: 4,
            max_sessions: MAX_SESSIONS,
        },
    );
    let seed = env_or("TEMPER_FUZZ_SEED", 13);
    let cases = env_or("TEMPER_FUZZ_CASES", 600);
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut ids: Vec<String> = Vec::new();
    let mut statuses = std::collections::BTreeMap::<u16, usize>::new();
    let mut done = 0;
    while done < cases {
        // Batches of up to 8 at once: some queue, some get 429.
        let batch: Vec<Case> = (0..rng.random_range(1..=8))
            .map(|_| case(&mut rng, &ids))
            .collect();
        let mut set = tokio::task::JoinSet::new();
        for c in batch {
            let state = state.clone();
            set.spawn(async move {
                let out = send(state, &c).await;
                (c, out)
            });
        }
        while let Some(joined) = set.join_next().await {
            let (c, (status, text)) = joined.expect("no panic in a handler");
            *statuses.entry(status.as_u16()).or_default() += 1;
            assert!(
                !status.is_server_error(),
                "seed {seed}: {} {} -> {status}: {text}\nbody: {}",
                c.method,
                c.uri,
                String::from_utf8_lossy(&c.body[..c.body.len().min(300)])
            );
            if c.method == "POST" && c.uri == "/sessions" && status == StatusCode::OK {
                let v: Value = serde_json::from_str(&text).expect("json");
                ids.push(v["id"].as_str().expect("id").to_string());
            }
            done += 1;
        }
        assert!(state.sessions().len() <= MAX_SESSIONS, "session cap broken");
    }
    eprintln!("fuzz seed {seed}: {done} requests, statuses {statuses:?}");
    // The service's own memory stayed bounded (sandboxes are other
    // processes, in their own cgroups).
    let status = std::fs::read_to_string("/proc/self/status").expect("status");
    let peak_kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmHWM");
    eprintln!("service peak RSS {} MiB", peak_kib >> 10);
    assert!(peak_kib < 1 << 20, "service peak RSS {peak_kib} KiB");

    // The pool heals to full size (a replacement may still be starting).
    let mut waited = 0;
    while pool.idle_workers() < POOL && waited < 100 {
        tokio::time::sleep(Duration::from_millis(50)).await;
        waited += 1;
    }
    assert_eq!(pool.workers(), POOL, "pool not back to full size");
    assert_eq!(pool.idle_workers(), POOL);
    let ok = Case {
        method: "POST",
        uri: "/run_code".into(),
        headers: vec![
            ("content-type", b"application/json".to_vec()),
            ("authorization", format!("Bearer {KEY}").into_bytes()),
        ],
        body: br#"{"code": "print(1)", "language": "python"}"#.to_vec(),
    };
    let (status, text) = send(state.clone(), &ok).await;
    assert_eq!(status, StatusCode::OK, "{text}");
    assert!(text.contains(r#""stdout":"1\n""#), "{text}");
}
