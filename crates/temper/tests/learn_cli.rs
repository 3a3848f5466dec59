//! `temper serve --learn` (issue 36) as a real process on the fixture
//! model: rewarded, opted-in episodes are trained on with the captured
//! logprobs (mismatch 0), the candidate is gated on a held-out environment
//! and promoted (responses then report its version); a `kill -9` loses no
//! acknowledged reward and no promoted version, and the restarted server
//! serves the last live version; a candidate worse than the live one by
//! more than the margin is kept aside with the reason; rollback returns to
//! a named version.

use std::io::{BufRead, BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

struct Served(Child);

impl Drop for Served {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn fixture_model() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/models/tiny-qwen3")
}

/// Starts `temper serve --learn config` and waits for it to listen.
fn serve(config: &Path) -> (Served, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_temper"))
        .args([
            "serve",
            "--port",
            "0",
            "--served-model-name",
            "tiny",
            "--model",
        ])
        .arg(fixture_model())
        .arg("--learn")
        .arg(config)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("serve starts");
    let mut lines = BufReader::new(child.stderr.take().expect("stderr")).lines();
    let mut seen = String::new();
    let addr = loop {
        let line = lines
            .next()
            .unwrap_or_else(|| panic!("the server exited:\n{seen}"))
            .expect("line");
        eprintln!("server: {line}");
        if let Some(rest) = line.split("listening on http://").nth(1) {
            break rest.split_whitespace().next().expect("address").to_string();
        }
        seen += &line;
        seen.push('\n');
    };
    std::thread::spawn(move || {
        for line in lines.by_ref().map_while(Result::ok) {
            eprintln!("server: {line}");
        }
    });
    (Served(child), addr)
}

/// One HTTP/1.1 request over std: (status, body).
fn http(addr: &str, method: &str, path: &str, token: Option<&str>, body: &str) -> (u16, Value) {
    let mut s = std::net::TcpStream::connect(addr).expect("connect");
    let auth = token.map_or(String::new(), |t| format!("Authorization: Bearer {t}\r\n"));
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\n{auth}Content-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .expect("write");
    let mut resp = String::new();
    s.read_to_string(&mut resp).expect("read");
    let (head, body) = resp.split_once("\r\n\r\n").expect("head");
    let status = head
        .split_whitespace()
        .nth(1)
        .expect("status")
        .parse()
        .expect("code");
    (status, serde_json::from_str(body).unwrap_or(Value::Null))
}

/// An opted-in episode with one chat call to the live policy, rewarded:
/// the version that answered.
fn rewarded_call(addr: &str, reward: f64, seed: u64) -> u64 {
    let (st, ep) = http(addr, "POST", "/v1/episodes", None, r#"{"train": true}"#);
    assert_eq!(st, 200, "{ep}");
    let (id, token) = (
        ep["id"].as_str().expect("id"),
        ep["token"].as_str().expect("token"),
    );
    let body = json!({"model": "live", "messages": [{"role": "user", "content": "What is 2 + 2?"}],
                      "max_tokens": 6, "temperature": 1.0, "seed": seed});
    let (st, answer) = http(
        addr,
        "POST",
        &format!("/episodes/{id}/v1/chat/completions"),
        Some(token),
        &body.to_string(),
    );
    assert_eq!(st, 200, "{answer}");
    assert_eq!(answer["episode"], id);
    let (st, v) = http(
        addr,
        "POST",
        &format!("/v1/episodes/{id}/reward"),
        Some(token),
        &json!({"reward": reward}).to_string(),
    );
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["stored"], true, "{v}");
    answer["version"].as_u64().expect("version")
}

fn events(state: &Path) -> Vec<Value> {
    std::fs::read_to_string(state.join("learn.jsonl"))
        .unwrap_or_default()
        .lines()
        .map(|l| serde_json::from_str(l).expect("learn.jsonl line"))
        .collect()
}

/// Waits until `learn.jsonl` holds an event `what` beyond the first `after`.
fn wait_for(state: &Path, what: &str, after: usize) -> Value {
    let t = Instant::now();
    loop {
        if let Some(e) = events(state)
            .into_iter()
            .skip(after)
            .find(|e| e["event"] == what)
        {
            return e;
        }
        assert!(
            t.elapsed() < Duration::from_secs(300),
            "no {what} event: {:?}",
            events(state)
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

fn live(addr: &str) -> u64 {
    let (st, v) = http(addr, "GET", "/v1/adapters/versions", None, "");
    assert_eq!(st, 200, "{v}");
    v["live"].as_u64().expect("live")
}

fn config(dir: &Path, margin: f64) -> PathBuf {
    let path = dir.join(format!("learn-{margin}.toml"));
    let text = format!(
        r#"seed = 0
[lora]
rank = 2
[trainer]
lr = 0.01
batch_size = 2
[eval]
env = "arithmetic"
num_examples = 2
[learn]
dir = "{}"
margin = {margin:?}
duty_cycle = 1.0
eval_max_tokens = 4
"#,
        dir.join("state").display()
    );
    std::fs::write(&path, text).expect("config");
    path
}

#[test]
fn a_learning_server_promotes_gates_rolls_back_and_survives_kill_9() {
    let tmp = tempfile::tempdir().expect("tmp");
    let state = tmp.path().join("state");
    // A margin of 10: any candidate is good enough.
    let (mut server, addr) = serve(&config(tmp.path(), 10.0));
    // A fresh state directory: the untrained adapter is version 1.
    assert_eq!(live(&addr), 1);
    assert_eq!(events(&state)[0]["event"], "promoted");

    // Two answers to one prompt, rewarded 1 and 0: one group, one step.
    assert_eq!(rewarded_call(&addr, 1.0, 1), 1);
    assert_eq!(rewarded_call(&addr, 0.0, 2), 1);
    let step = wait_for(&state, "promoted", 1);
    assert_eq!(step["candidate"], 2);
    assert_eq!(step["parent"], 1);
    assert!(
        step["mismatch_tokens"].as_u64().expect("tokens") > 0,
        "{step}"
    );
    assert_eq!(
        step["mismatch_max"], 0.0,
        "captured logprobs are the trainer's: {step}"
    );
    assert_eq!(live(&addr), 2);
    // Episodes that did not opt in are answered, never stored.
    let (_, ep) = http(&addr, "POST", "/v1/episodes", None, "{}");
    let (id, token) = (
        ep["id"].as_str().expect("id"),
        ep["token"].as_str().expect("token"),
    );
    let body =
        json!({"model": "live", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2});
    let (st, answer) = http(
        &addr,
        "POST",
        &format!("/episodes/{id}/v1/chat/completions"),
        Some(token),
        &body.to_string(),
    );
    assert_eq!((st, answer["version"].clone()), (200, json!(2)), "{answer}");
    let (_, v) = http(
        &addr,
        "POST",
        &format!("/v1/episodes/{id}/reward"),
        Some(token),
        r#"{"reward": 1}"#,
    );
    assert_eq!(v["stored"], false, "{v}");

    // Two more rewards, then kill -9 at once (mid-step, or just before).
    rewarded_call(&addr, 1.0, 3);
    rewarded_call(&addr, 0.5, 4);
    let stored = std::fs::read_to_string(state.join("rewarded.jsonl")).expect("rewarded");
    let pid = server.0.id() as i32;
    // SAFETY: kill(2) on our own child's pid.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGKILL) }, 0);
    let _ = server.0.wait();
    drop(server);
    // No acknowledged reward was lost, and no other episode got in.
    let after = std::fs::read_to_string(state.join("rewarded.jsonl")).expect("rewarded");
    assert_eq!(after, stored);
    assert_eq!(after.lines().count(), 4);
    assert!(!after.contains(id), "a not-opted-in episode was stored");
    let live_before: u64 = serde_json::from_str::<Value>(
        &std::fs::read_to_string(state.join("live.json")).expect("live.json"),
    )
    .expect("json")["version"]
        .as_u64()
        .expect("version");
    assert!(live_before >= 2);

    // Restarted with a margin of -10 (a candidate must beat the live
    // version by 10: none can): the last live version is served, and the
    // next candidate is kept aside with the reason.
    let (_server, addr) = serve(&config(tmp.path(), -10.0));
    assert_eq!(live(&addr), live_before);
    let n = events(&state).len();
    rewarded_call(&addr, 1.0, 5);
    assert_eq!(rewarded_call(&addr, 0.0, 6), live_before);
    let rejected = wait_for(&state, "rejected", n);
    let reason = rejected["reason"].as_str().expect("reason");
    assert!(reason.contains("below live version"), "{reason}");
    let c = rejected["candidate"].as_u64().expect("candidate");
    assert!(state
        .join(format!("candidates/c{c:06}/rejected.json"))
        .exists());
    assert_eq!(live(&addr), live_before);
    // Every promoted version is on disk; rollback returns to version 1.
    for v in 1..=live_before {
        assert!(state.join(format!("versions/v{v:06}/adapter")).is_dir());
    }
    let (st, v) = http(
        &addr,
        "POST",
        "/v1/adapters/rollback",
        None,
        r#"{"version": 1}"#,
    );
    assert_eq!(st, 200, "{v}");
    let (_, ep) = http(&addr, "POST", "/v1/episodes", None, "{}");
    let (id, token) = (
        ep["id"].as_str().expect("id"),
        ep["token"].as_str().expect("token"),
    );
    let (_, answer) = http(
        &addr,
        "POST",
        &format!("/episodes/{id}/v1/chat/completions"),
        Some(token),
        &body.to_string(),
    );
    assert_eq!(answer["version"], 1, "{answer}");
    wait_for(&state, "rollback", n);
}
