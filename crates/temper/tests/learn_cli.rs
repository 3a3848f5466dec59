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

/// Issue 36, rewards from a rubric configured on the server: `[learn]
/// rubric` names an environment whose rubric scores an episode's
/// conversation when the client posts `{"rubric": {"answer": ...}}`; the
/// reward is recorded and stored like a client's; a conversation the
/// rubric cannot score is a counted 422 and records nothing (a later
/// reward still goes in).
#[test]
fn the_servers_rubric_rewards_episodes_and_counts_its_failures() {
    let tmp = tempfile::tempdir().expect("tmp");
    let env_dir = tmp.path().join("contains-env");
    std::fs::create_dir_all(&env_dir).expect("env dir");
    std::fs::write(
        env_dir.join("env.toml"),
        r#"name = "contains"
version = "0.1.0"
[dataset]
generator = "arithmetic"
args = { digits = 1, ops = ["+"] }
[[rubric]]
function = "contains"
weight = 1.0
"#,
    )
    .expect("env.toml");
    let state = tmp.path().join("state");
    let cfg = tmp.path().join("learn.toml");
    std::fs::write(
        &cfg,
        format!(
            "[lora]\nrank = 2\n[trainer]\nmax_steps = 0\n[eval]\nenv = \"arithmetic\"\n\
             num_examples = 1\n[learn]\ndir = \"{}\"\neval_max_tokens = 2\nrubric = \"{}\"\n",
            state.display(),
            env_dir.display()
        ),
    )
    .expect("config");
    let (_server, addr) = serve(&cfg);
    let episode = || {
        let (_, ep) = http(&addr, "POST", "/v1/episodes", None, r#"{"train": true}"#);
        (
            ep["id"].as_str().expect("id").to_string(),
            ep["token"].as_str().expect("token").to_string(),
        )
    };
    let chat = |id: &str, token: &str| {
        let body = json!({"model": "live", "messages": [{"role": "user", "content": "hi"}],
                          "max_tokens": 6, "temperature": 1.0, "seed": 3});
        let (st, a) = http(
            &addr,
            "POST",
            &format!("/episodes/{id}/v1/chat/completions"),
            Some(token),
            &body.to_string(),
        );
        assert_eq!(st, 200, "{a}");
        a["choices"][0]["message"]["content"]
            .as_str()
            .expect("content")
            .to_string()
    };
    let reward = |id: &str, token: &str, body: Value| {
        http(
            &addr,
            "POST",
            &format!("/v1/episodes/{id}/reward"),
            Some(token),
            &body.to_string(),
        )
    };
    // The reference occurs in the answer: 1; it does not: 0.
    let (a, tok_a) = episode();
    let said = chat(&a, &tok_a);
    assert!(!said.trim().is_empty(), "{said:?}");
    let (st, v) = reward(&a, &tok_a, json!({"rubric": {"answer": said.trim()}}));
    assert_eq!(st, 200, "{v}");
    assert_eq!(
        (v["reward"].clone(), v["stored"].clone()),
        (json!(1.0), json!(true))
    );
    let (b, tok_b) = episode();
    chat(&b, &tok_b);
    let (st, v) = reward(
        &b,
        &tok_b,
        json!({"rubric": {"answer": "\u{2603}never said"}}),
    );
    assert_eq!((st, v["reward"].clone()), (200, json!(0.0)), "{v}");
    // Both, or neither: a 400.
    let (c, tok_c) = episode();
    let (st, v) = reward(&c, &tok_c, json!({"reward": 1.0, "rubric": {}}));
    assert_eq!(st, 400, "{v}");
    // A completions call has no conversation: a counted 422, no reward.
    let (st, v) = http(
        &addr,
        "POST",
        &format!("/episodes/{c}/v1/completions"),
        Some(&tok_c),
        &json!({"model": "live", "prompt": "hi", "max_tokens": 2}).to_string(),
    );
    assert_eq!(st, 200, "{v}");
    let (st, v) = reward(&c, &tok_c, json!({"rubric": {"answer": "x"}}));
    assert_eq!(st, 422, "{v}");
    assert_eq!(v["error"]["code"], "rubric_failed");
    let msg = v["error"]["message"].as_str().expect("message");
    assert!(
        msg.contains("chat conversations") && msg.contains("1 rubric error"),
        "{msg}"
    );
    let (st, v) = reward(&c, &tok_c, json!({"reward": 0.5}));
    assert_eq!((st, v["stored"].clone()), (200, json!(true)), "{v}");
    let stored: Vec<f64> = std::fs::read_to_string(state.join("rewarded.jsonl"))
        .expect("rewarded")
        .lines()
        .map(|l| {
            serde_json::from_str::<Value>(l).expect("line")["reward"]
                .as_f64()
                .expect("reward")
        })
        .collect();
    assert_eq!(stored, vec![1.0, 0.0, 0.5]);
}

/// Issue 36, DPO pairs from feedback: with `objective = "dpo"`, two
/// answers to one prompt rewarded differently are a pair (the better one
/// chosen) and a DPO step trains on it against the live version's weights
/// (loss ln 2 at the start: the policy is the reference), gated and
/// promoted like an RL step; a batch whose rewards are all equal has no
/// pair and is skipped with the reason.
#[test]
fn a_dpo_learning_server_trains_on_pairs_of_differently_rewarded_answers() {
    let tmp = tempfile::tempdir().expect("tmp");
    let state = tmp.path().join("state");
    let cfg = tmp.path().join("learn.toml");
    std::fs::write(
        &cfg,
        format!(
            "seed = 0\n[lora]\nrank = 2\n[trainer]\nlr = 0.01\nbatch_size = 2\n[eval]\n\
             env = \"arithmetic\"\nnum_examples = 2\n[learn]\ndir = \"{}\"\nmargin = 10.0\n\
             duty_cycle = 1.0\neval_max_tokens = 4\nobjective = \"dpo\"\n",
            state.display()
        ),
    )
    .expect("config");
    let (_server, addr) = serve(&cfg);
    // Equal rewards: nothing to prefer.
    rewarded_call(&addr, 0.5, 1);
    rewarded_call(&addr, 0.5, 2);
    let skipped = wait_for(&state, "skipped", 1);
    assert_eq!(skipped["episodes"], json!([0, 1]), "{skipped}");
    // Different rewards: one pair, one step.
    rewarded_call(&addr, 1.0, 3);
    rewarded_call(&addr, 0.0, 4);
    let step = wait_for(&state, "promoted", 1);
    assert_eq!(
        (
            step["objective"].clone(),
            step["pairs"].clone(),
            step["episodes"].clone()
        ),
        (json!("dpo"), json!(1), json!([2, 3])),
        "{step}"
    );
    let loss = step["loss"].as_f64().expect("loss");
    assert!((loss - std::f64::consts::LN_2).abs() < 1e-6, "{step}");
    assert!(
        step["grad_norm"].as_f64().expect("grad_norm") > 0.0,
        "{step}"
    );
    assert_eq!(live(&addr), step["candidate"].as_u64().expect("candidate"));
    view_shows_the_learning_server(&state, &step);
}

/// Issue 36: `temper view STATE_DIR` lists the learning server as a
/// running `learn` run at its last step, with the held-out score of its
/// last candidate, and charts it.
fn view_shows_the_learning_server(state: &Path, step: &Value) {
    let mut view = Command::new(env!("CARGO_BIN_EXE_temper"))
        .args(["view", "--port", "0"])
        .arg(state)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("view starts");
    let mut out = BufReader::new(view.stdout.take().expect("stdout")).lines();
    let addr = loop {
        let line = out.next().expect("view's address").expect("line");
        if let Some(a) = line.strip_prefix("listening on ") {
            break a.trim().to_string();
        }
    };
    let _view = Served(view);
    let (st, v) = http(&addr, "GET", "/api/runs", None, "");
    assert_eq!(st, 200, "{v}");
    let run = &v["runs"][0];
    assert_eq!(
        (
            run["id"].clone(),
            run["kind"].clone(),
            run["status"].clone()
        ),
        (json!("."), json!("learn"), json!("running")),
        "{v}"
    );
    assert_eq!(run["step"], 1, "{v}");
    assert_eq!(run["env"], "arithmetic", "{v}");
    assert_eq!(run["heldout"], step["eval"]["pass@1"], "{v}");
    let (st, metrics) = http(&addr, "GET", "/api/metrics?id=.", None, "");
    assert_eq!(st, 200, "{metrics}");
    let text = metrics.to_string();
    assert!(
        text.contains("live/pass@1") && text.contains("\"promoted\""),
        "{text}"
    );
}
