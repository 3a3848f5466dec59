//! `temper train rl` as a user runs it: kill -9 mid-run and `--resume`, and
//! RL against an external `temper serve` sampler (adapter hot-swap over HTTP).

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{Map, Value};

fn temper() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_temper"));
    c.arg("--threads").arg("1");
    c
}

/// A tiny random model and an environment with a graded reward (LCS of the
/// raw completion), so every step trains.
fn setup(dir: &Path) -> (PathBuf, PathBuf) {
    let model = dir.join("model");
    temper_rl::preset::TinyPreset::smallest()
        .write(&model, 3)
        .unwrap();
    let env = dir.join("env");
    std::fs::create_dir_all(&env).unwrap();
    let rows: String = (0..40)
        .map(|i| format!("{{\"question\": \"echo {i}\", \"answer\": \"aaaa{i}\"}}\n"))
        .collect();
    std::fs::write(env.join("train.jsonl"), rows).unwrap();
    std::fs::write(
        env.join("env.toml"),
        "name = \"graded\"\n[dataset]\ntrain = \"train.jsonl\"\n[parser]\ntype = \"plain\"\n\
         [[rubric]]\nfunction = \"lcs\"\nweight = 1.0\n",
    )
    .unwrap();
    (model, env)
}

fn config(dir: &Path, model: &Path, env: &Path, run: &Path, extra: &str) -> PathBuf {
    let text = format!(
        r#"seed = 5
[model]
path = "{}"
[lora]
rank = 4
alpha = 8.0
[[env]]
id = "{}"
[sampling]
max_tokens = 8
group_size = 4
[trainer]
lr = 1e-2
batch_size = 2
max_steps = 8
[async]
max_off_policy_steps = 0
[eval]
num_examples = 0
[ckpt]
interval = 1
keep = 2
[log]
dir = "{}"
progress = false
{extra}
"#,
        model.display(),
        env.display(),
        run.display()
    );
    let path = dir.join(format!(
        "{}.toml",
        run.file_name().unwrap().to_string_lossy()
    ));
    std::fs::write(&path, text).unwrap();
    path
}

fn metrics(run: &Path) -> Vec<Map<String, Value>> {
    std::fs::read_to_string(run.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| {
            serde_json::from_str::<Value>(l)
                .unwrap()
                .as_object()
                .cloned()
                .unwrap()
        })
        .map(|m| {
            m.into_iter()
                .filter(|(k, _)| !k.starts_with("time/") && k != "tokens_per_s")
                .collect()
        })
        .collect()
}

fn latest_step(run: &Path) -> u64 {
    std::fs::read_to_string(run.join("checkpoints/latest.json"))
        .ok()
        .and_then(|t| serde_json::from_str::<Value>(&t).ok())
        .and_then(|v| v["step"].as_u64())
        .unwrap_or(0)
}

#[test]
fn kill_nine_mid_run_then_resume_matches_an_uninterrupted_run() {
    let d = tempfile::tempdir().unwrap();
    let (model, env) = setup(d.path());
    let whole = d.path().join("whole");
    let cut = d.path().join("cut");
    let cfg_whole = config(d.path(), &model, &env, &whole, "");
    let cfg_cut = config(d.path(), &model, &env, &cut, "");

    let a = train_rl(&cfg_whole, &[], &whole);

    let mut child = temper()
        .args(["train", "rl"])
        .arg(&cfg_cut)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let t0 = Instant::now();
    while latest_step(&cut) < 3 {
        assert!(
            t0.elapsed() < Duration::from_secs(120),
            "no checkpoint appeared"
        );
        if child.try_wait().unwrap().is_some() {
            panic!("the run finished before it could be killed; make it longer");
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    child.kill().unwrap(); // SIGKILL
    child.wait().unwrap();
    let killed_at = latest_step(&cut);
    assert!(killed_at < 8, "killed after the end");

    let st = temper()
        .args(["train", "rl", "--resume"])
        .arg(&cut)
        .output()
        .unwrap();
    assert!(
        st.status.success(),
        "{}",
        String::from_utf8_lossy(&st.stderr)
    );
    let b = metrics(&cut);
    let steps: Vec<u64> = b.iter().map(|m| m["step"].as_u64().unwrap()).collect();
    assert_eq!(steps, (1..=8).collect::<Vec<_>>(), "each step exactly once");
    assert_eq!(
        a, b,
        "resumed run differs from the uninterrupted one (killed at {killed_at})"
    );
    let adapter = |r: &Path| std::fs::read(r.join("adapter/adapter_model.safetensors")).unwrap();
    assert_eq!(adapter(&whole), adapter(&cut));
}

struct Server(std::process::Child);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Start a temper server command on a free port and wait for the line
/// announcing its address (the URL is the first word after `marker`).
fn spawn_server(args: &[String], marker: &str) -> (Server, String) {
    let mut child = temper()
        .args(args)
        .args(["--port", "0"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
    let url = loop {
        let line = lines.next().expect("the server exited").unwrap();
        if let Some(rest) = line.split(marker).nth(1) {
            break rest.split_whitespace().next().unwrap().to_string();
        }
    };
    // Keep draining stderr so the server never blocks on a full pipe.
    std::thread::spawn(move || for _ in lines.by_ref() {});
    (Server(child), url)
}

/// `temper train rl CFG EXTRA...`, which must succeed; its step metrics.
fn train_rl(cfg: &Path, extra: &[&str], run: &Path) -> Vec<Map<String, Value>> {
    let st = temper()
        .args(["train", "rl"])
        .arg(cfg)
        .args(extra)
        .output()
        .unwrap();
    assert!(
        st.status.success(),
        "{}",
        String::from_utf8_lossy(&st.stderr)
    );
    metrics(run)
}

#[test]
fn rl_against_an_external_temper_serve_hot_swaps_the_adapter() {
    let d = tempfile::tempdir().unwrap();
    let (model, env) = setup(d.path());
    let (_server, url) = spawn_server(
        &[
            "serve".into(),
            "--model".into(),
            model.display().to_string(),
            "--lora-root".into(),
            d.path().display().to_string(),
        ],
        "listening on ",
    );
    let run = d.path().join("ext");
    let cfg = config(
        d.path(),
        &model,
        &env,
        &run,
        &format!("[sampler]\nurl = \"{url}\"\nadapter_name = \"policy\"\n"),
    );
    let m = train_rl(
        &cfg,
        &[
            "--trainer.max_steps",
            "4",
            "--async.max_off_policy_steps",
            "1",
        ],
        &run,
    );
    assert_eq!(m.len(), 4);
    assert!(m
        .iter()
        .any(|r| r["trained_sequences"].as_u64().unwrap() > 0));
    for r in &m {
        assert!(r["policy_lag/max"].as_f64().unwrap() <= 1.0, "{r:?}");
    }
    // The server now serves the final published policy: initial load + one per step.
    let models: Value = reqwest_get(&format!("{url}/v1/models"));
    let ids: Vec<&str> = models["data"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|m| m["id"].as_str())
        .collect();
    assert!(ids.contains(&"policy"), "{models}");
    // A request to the adapter reports the version the trainer published last.
    let body = serde_json::json!({"model": "policy", "prompt_token_ids": [1, 5, 6], "max_tokens": 2, "temperature": 0.0});
    let out = reqwest_post(&format!("{url}/v1/generate"), &body);
    assert_eq!(out["version"].as_u64(), Some(5), "{out}");
}

#[test]
fn rl_trains_through_a_remote_training_api() {
    let d = tempfile::tempdir().unwrap();
    let (model, env) = setup(d.path());
    let (_server, url) = spawn_server(
        &[
            "api".into(),
            "serve".into(),
            "--model".into(),
            format!("base={}", model.display()),
            "--checkpoints".into(),
            d.path().join("api-ckpt").display().to_string(),
        ],
        "API on ",
    );
    let run = d.path().join("remote");
    let cfg = config(
        d.path(),
        &model,
        &env,
        &run,
        &format!("[remote_trainer]\nurl = \"{url}\"\nbase_model = \"base\"\n"),
    );
    let m = train_rl(
        &cfg,
        &["--trainer.max_steps", "3", "--lora.alpha", "32.0"],
        &run,
    );
    assert_eq!(m.len(), 3);
    assert!(m
        .iter()
        .any(|r| r["trained_sequences"].as_u64().unwrap() > 0));
    for r in &m {
        // Sampled and trained by the server's engine: still zero mismatch.
        assert_eq!(r["mismatch/max"].as_f64(), Some(0.0), "{r:?}");
    }
    let latest = std::fs::read_to_string(run.join("checkpoints/latest.json")).unwrap();
    assert!(
        latest.contains("tinker://"),
        "checkpoints live on the server: {latest}"
    );
}

fn reqwest_get(url: &str) -> Value {
    http("GET", url, None)
}

fn reqwest_post(url: &str, body: &Value) -> Value {
    http("POST", url, Some(body))
}

/// A minimal blocking HTTP/1.1 client over std (the tests need no runtime).
fn http(method: &str, url: &str, body: Option<&Value>) -> Value {
    use std::io::{Read, Write};
    let rest = url.strip_prefix("http://").unwrap();
    let (host, path) = rest
        .split_once('/')
        .map_or((rest, "/".to_string()), |(h, p)| (h, format!("/{p}")));
    let mut s = std::net::TcpStream::connect(host).unwrap();
    let payload = body.map(|b| b.to_string()).unwrap_or_default();
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{payload}",
        payload.len()
    )
    .unwrap();
    let mut resp = String::new();
    s.read_to_string(&mut resp).unwrap();
    let (head, body) = resp.split_once("\r\n\r\n").unwrap();
    assert!(head.starts_with("HTTP/1.1 200"), "{head}\n{body}");
    let body = if head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        dechunk(body)
    } else {
        body.to_string()
    };
    serde_json::from_str(&body).unwrap()
}

fn dechunk(mut s: &str) -> String {
    let mut out = String::new();
    loop {
        let (len, rest) = s.split_once("\r\n").unwrap();
        let n = usize::from_str_radix(len.trim(), 16).unwrap();
        if n == 0 {
            return out;
        }
        out.push_str(&rest[..n]);
        s = &rest[n + 2..];
    }
}

/// Issue 39: a finished run prints the commands that serve, evaluate and
/// export what it trained, with its real paths — and the serve command
/// works as printed.
#[test]
fn issue39_a_finished_run_prints_next_commands_that_work() {
    let d = tempfile::tempdir().unwrap();
    let (model, env) = setup(d.path());
    let run = d.path().join("next");
    let cfg = config(d.path(), &model, &env, &run, "");
    let out = temper()
        .args(["train", "rl"])
        .arg(&cfg)
        .args(["--trainer.max_steps", "2"])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let adapter = run.join("adapter");
    let serve = format!(
        "temper serve --model {} --lora policy={}",
        model.display(),
        adapter.display()
    );
    let export = format!("temper export {} --format gguf --out ", run.display());
    let eval = format!(
        "temper eval {} -m policy -b http://127.0.0.1:8000/v1",
        env.display()
    );
    for want in [&serve, &export, &eval] {
        assert!(
            stdout.contains(want.as_str()),
            "missing {want:?} in\n{stdout}"
        );
    }
    // Run the serve command as printed (on a free port): it serves `policy`.
    let line = stdout.lines().find(|l| l.contains(&serve)).unwrap();
    let args: Vec<String> = line
        .split('#')
        .next()
        .unwrap()
        .split_whitespace()
        .skip(1)
        .map(String::from)
        .collect();
    let (_server, url) = spawn_server(&args, "listening on ");
    let models = http("GET", &format!("{url}/v1/models"), None);
    assert!(models.to_string().contains("\"policy\""), "{models}");
}
