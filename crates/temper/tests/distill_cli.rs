//! On-policy distillation with an endpoint teacher: a real `temper serve`
//! process answers `/v1/completions` with the prompt's logprobs for token
//! ids, and a run distilled from it measures what the same teacher loaded
//! in process measures; a served model with another tokenizer is refused.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use serde_json::Value;

fn temper() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_temper"));
    c.arg("--threads").arg("1");
    c
}

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../fixtures/models")
        .join(name)
}

struct Server(std::process::Child);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// `temper serve --model DIR` on a free port; its URL.
fn serve(model: &Path) -> (Server, String) {
    let mut child = temper()
        .args([
            "serve",
            "--port",
            "0",
            "--served-model-name",
            "teacher",
            "--model",
        ])
        .arg(model)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
    let url = loop {
        let line = lines.next().expect("temper serve exited").unwrap();
        if let Some(rest) = line.split("listening on ").nth(1) {
            break rest.split_whitespace().next().unwrap().to_string();
        }
    };
    std::thread::spawn(move || for _ in lines.by_ref() {});
    (Server(child), url)
}

fn config(dir: &Path, name: &str, teacher: &str) -> (PathBuf, PathBuf) {
    let env = dir.join("env");
    std::fs::create_dir_all(&env).unwrap();
    let rows: String = (0..20)
        .map(|i| format!("{{\"question\": \"echo {i}\", \"answer\": \"aaaa{i}\"}}\n"))
        .collect();
    std::fs::write(env.join("train.jsonl"), rows).unwrap();
    std::fs::write(
        env.join("env.toml"),
        "name = \"graded\"\n[dataset]\ntrain = \"train.jsonl\"\n[parser]\ntype = \"plain\"\n\
         [[rubric]]\nfunction = \"lcs\"\nweight = 1.0\n",
    )
    .unwrap();
    let run = dir.join(name);
    let text = format!(
        r#"seed = 1
[model]
path = "{student}"
[lora]
rank = 4
alpha = 8.0
[[env]]
id = "{env}"
[sampling]
max_tokens = 8
group_size = 2
[trainer]
lr = 1e-2
batch_size = 2
max_steps = 3
[async]
max_off_policy_steps = 0
[eval]
num_examples = 0
[ckpt]
interval = 0
[log]
dir = "{run}"
progress = false
[distill]
teacher = {teacher}
reward_coef = 0.5
"#,
        student = fixture("tiny-qwen2").display(),
        env = env.display(),
        run = run.display(),
    );
    let path = dir.join(format!("{name}.toml"));
    std::fs::write(&path, text).unwrap();
    (path, run)
}

fn train(cfg: &Path) -> std::process::Output {
    temper().args(["train", "rl"]).arg(cfg).output().unwrap()
}

fn metrics(run: &Path) -> Vec<serde_json::Map<String, Value>> {
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
        .collect()
}

#[test]
fn an_endpoint_teacher_scores_like_the_same_teacher_in_process() {
    let d = tempfile::tempdir().unwrap();
    let (_server, url) = serve(&fixture("tiny-qwen3"));
    let (local_cfg, local_run) = config(
        d.path(),
        "local",
        &format!("{{ path = \"{}\" }}", fixture("tiny-qwen3").display()),
    );
    let (http_cfg, http_run) = config(
        d.path(),
        "http",
        &format!("{{ url = \"{url}\", model = \"teacher\" }}"),
    );
    for cfg in [&local_cfg, &http_cfg] {
        let out = train(cfg);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let (a, b) = (metrics(&local_run), metrics(&http_run));
    assert_eq!(a.len(), 3);
    assert_eq!(b.len(), 3);
    for (x, y) in a.iter().zip(&b) {
        // The same samples (seeded), scored by the same teacher weights.
        assert_eq!(x["distill/tokens"], y["distill/tokens"], "{x:?}\n{y:?}");
        assert!(x["distill/tokens"].as_u64().unwrap() > 0);
        for k in ["distill/reverse_kl", "distill/teacher_logprob", "loss"] {
            let (p, q) = (x[k].as_f64().unwrap(), y[k].as_f64().unwrap());
            assert!(
                (p - q).abs() < 1e-4 * (1.0 + p.abs()),
                "{k}: in process {p}, endpoint {q}"
            );
        }
    }
}

#[test]
fn an_endpoint_teacher_with_another_tokenizer_is_refused() {
    let d = tempfile::tempdir().unwrap();
    let (_server, url) = serve(&fixture("tiny-llama"));
    let (cfg, run) = config(
        d.path(),
        "bad",
        &format!("{{ url = \"{url}\", model = \"teacher\" }}"),
    );
    let out = train(&cfg);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains("the teacher's tokenizer differs from the student's")
            && err.contains("probe text"),
        "{err}"
    );
    assert!(!run.join("metrics.jsonl").exists() || metrics(&run).is_empty());
}
