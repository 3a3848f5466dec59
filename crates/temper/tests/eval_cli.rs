//! `temper eval`, `temper env new` and `temper view` as a user runs them,
//! against the mock OpenAI server.

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use temper_eval::mock::{self, MockConfig};

fn temper() -> Command {
    Command::new(env!("CARGO_BIN_EXE_temper"))
}

fn run_dir_of(save_dir: &Path) -> PathBuf {
    // save_dir/{env}--{model}/{run_id}
    let env_dir = std::fs::read_dir(save_dir)
        .unwrap()
        .next()
        .unwrap()
        .unwrap()
        .path();
    std::fs::read_dir(env_dir)
        .unwrap()
        .next()
        .unwrap()
        .unwrap()
        .path()
}

/// (example_id → [prompt question]) of a results file, counting duplicates.
fn groups(run_dir: &Path) -> BTreeMap<u64, Vec<String>> {
    let text = std::fs::read_to_string(run_dir.join("results.jsonl")).unwrap();
    let mut out: BTreeMap<u64, Vec<String>> = BTreeMap::new();
    for line in text.lines() {
        let v: serde_json::Value = serde_json::from_str(line).unwrap();
        let q = v["prompt"].as_array().unwrap().last().unwrap()["content"]
            .as_str()
            .unwrap()
            .to_string();
        out.entry(v["example_id"].as_u64().unwrap())
            .or_default()
            .push(q);
    }
    out
}

fn mock_server(latency: Duration) -> (String, tokio::runtime::Runtime) {
    mock_with(MockConfig {
        latency,
        ..MockConfig::default()
    })
}

fn mock_with(cfg: MockConfig) -> (String, tokio::runtime::Runtime) {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let (addr, _) = rt.block_on(mock::spawn(cfg)).unwrap();
    (format!("http://{addr}/v1"), rt)
}

/// `temper eval arithmetic -n 3 -b BASE EXTRA…` into a fresh save dir.
fn eval_against(base: &str, extra: &[&str]) -> std::process::Output {
    let dir = tempfile::tempdir().unwrap();
    temper()
        .args(["eval", "arithmetic", "-n", "3", "--quiet", "-b", base])
        .args(extra)
        .arg("--save-dir")
        .arg(dir.path())
        .output()
        .unwrap()
}

#[test]
fn kill_nine_mid_run_then_resume_ends_with_the_same_set() {
    let (base, _rt) = mock_server(Duration::from_millis(25));
    let args = |save: &Path| {
        vec![
            "eval".to_string(),
            "arithmetic".into(),
            "-a".into(),
            r#"{"digits": 2}"#.into(),
            "-m".into(),
            "mock".into(),
            "-b".into(),
            base.clone(),
            "-n".into(),
            "150".into(),
            "-r".into(),
            "2".into(),
            "-c".into(),
            "4".into(),
            "--quiet".into(),
            "--save-dir".into(),
            save.display().to_string(),
        ]
    };
    // Reference: one uninterrupted run.
    let ref_dir = tempfile::tempdir().unwrap();
    let st = temper()
        .args(args(ref_dir.path()))
        .stdout(Stdio::null())
        .status()
        .unwrap();
    assert!(st.success());
    let reference = groups(&run_dir_of(ref_dir.path()));
    assert_eq!(reference.len(), 150);

    // Killed run.
    let dir = tempfile::tempdir().unwrap();
    let mut child = temper()
        .args(args(dir.path()))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    let run_dir = loop {
        assert!(Instant::now() < deadline, "no results appeared");
        std::thread::sleep(Duration::from_millis(20));
        let Ok(mut envs) = std::fs::read_dir(dir.path()) else {
            continue;
        };
        let Some(Ok(env_dir)) = envs.next() else {
            continue;
        };
        let Some(Ok(run)) = std::fs::read_dir(env_dir.path()).unwrap().next() else {
            continue;
        };
        let results = run.path().join("results.jsonl");
        let n = std::fs::read_to_string(&results)
            .map(|t| t.lines().count())
            .unwrap_or(0);
        if n >= 60 {
            break run.path();
        }
    };
    child.kill().unwrap(); // SIGKILL
    child.wait().unwrap();
    let partial = std::fs::read_to_string(run_dir.join("results.jsonl"))
        .unwrap()
        .lines()
        .count();
    assert!(
        partial < 300,
        "the run finished before the kill ({partial} lines)"
    );
    let meta: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(run_dir.join("metadata.json")).unwrap())
            .unwrap();
    assert_eq!(meta["status"], "running");

    let out = temper()
        .args(["eval", "--quiet", "--resume"])
        .arg(&run_dir)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let resumed = groups(&run_dir);
    assert_eq!(resumed.len(), 150);
    for (id, qs) in &resumed {
        assert_eq!(qs.len(), 2, "example {id} has {} rollouts", qs.len());
        assert_eq!(qs[0], qs[1]);
    }
    let key = |g: &BTreeMap<u64, Vec<String>>| {
        g.iter()
            .map(|(k, v)| (*k, v[0].clone()))
            .collect::<Vec<_>>()
    };
    assert_eq!(key(&resumed), key(&reference));
    let meta: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(run_dir.join("metadata.json")).unwrap())
            .unwrap();
    assert_eq!(meta["status"], "completed");
    assert_eq!(meta["num_rollouts"], 300);
}

/// `temper env new units --dir DIR`, as a user starts; the new env's directory.
fn env_new_units(dir: &Path) -> PathBuf {
    let st = temper()
        .args(["env", "new", "units", "--dir"])
        .arg(dir)
        .stdout(Stdio::null())
        .status()
        .unwrap();
    assert!(st.success());
    dir.join("units")
}

#[test]
fn env_new_then_eval_then_view_as_in_the_readme() {
    let (base, _rt) = mock_server(Duration::ZERO);
    let dir = tempfile::tempdir().unwrap();
    let env_dir = env_new_units(dir.path());
    for f in ["env.toml", "train.jsonl", "eval.jsonl", "README.md"] {
        assert!(env_dir.join(f).is_file(), "{f}");
    }
    let save = dir.path().join("outputs");
    let out = temper()
        .arg("eval")
        .arg(&env_dir)
        .args(["-m", "mock", "-b", &base, "--quiet", "--save-dir"])
        .arg(&save)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("pass@1"), "{stdout}");
    let run = run_dir_of(&save);
    // The scaffold's defaults: its 4 held-out rows × 1 greedy rollout.
    let g = groups(&run);
    assert_eq!(g.len(), 4);
    assert!(g.values().all(|v| v.len() == 1));
    // The mock answers 42 to these questions: all wrong, all well formatted.
    let meta: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(run.join("metadata.json")).unwrap()).unwrap();
    assert_eq!(meta["avg_reward"], 0.0);
    assert_eq!(meta["avg_metrics"]["format"], 1.0);
    assert_eq!(meta["env_id"], "units");

    let out = temper().arg("view").arg(&run).output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let html = std::fs::read_to_string(run.join("report.html")).unwrap();
    assert!(
        html.contains("<svg")
            && html.contains("pass@k")
            && html.contains("What is the capital of France?")
    );
    assert!(!html.contains("<script"), "self-contained, no scripts");
}

/// The questions of a scaffolded env's `split.jsonl`.
fn questions(env_dir: &Path, split: &str) -> std::collections::BTreeSet<String> {
    std::fs::read_to_string(env_dir.join(format!("{split}.jsonl")))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["question"].to_string())
        .map(|q| q.trim_matches('"').to_string())
        .collect()
}

/// Issue 12: `temper eval --split train` samples training questions (for
/// `temper generate-sft`); the default stays the held-out split.
#[test]
fn issue_12_eval_split_train_samples_training_questions() {
    let (base, _rt) = mock_server(Duration::ZERO);
    let dir = tempfile::tempdir().unwrap();
    let env_dir = env_new_units(dir.path());
    let (train, held_out) = (questions(&env_dir, "train"), questions(&env_dir, "eval"));
    assert!(train.is_disjoint(&held_out));
    for (split, expected) in [(Some("train"), &train), (None, &held_out)] {
        let save = dir.path().join(format!("out-{split:?}"));
        let mut cmd = temper();
        cmd.arg("eval")
            .arg(&env_dir)
            .args(["-m", "mock", "-b", &base, "--quiet", "-n", "3", "-r", "1"]);
        if let Some(s) = split {
            cmd.args(["--split", s]);
        }
        let out = cmd.arg("--save-dir").arg(&save).output().unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let stdout = String::from_utf8_lossy(&out.stdout);
        let name = split.unwrap_or("eval");
        assert!(stdout.contains(&format!("3 {name} examples")), "{stdout}");
        let run = run_dir_of(&save);
        let asked: Vec<String> = groups(&run).into_values().flatten().collect();
        assert_eq!(asked.len(), 3);
        assert!(asked.iter().all(|q| expected.contains(q)), "{asked:?}");
        let meta: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(run.join("metadata.json")).unwrap())
                .unwrap();
        assert_eq!(meta["split"], name);
    }
    let out = temper()
        .arg("eval")
        .arg(&env_dir)
        .args(["--split", "test"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("use train or eval"));
}

struct Server(std::process::Child);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// `temper serve` on the tiny test model; its base URL.
fn tiny_server() -> (Server, String) {
    use std::io::BufRead;
    let model = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/models/tiny-qwen3");
    let mut child = temper()
        .args(["serve", "--port", "0", "--model"])
        .arg(&model)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = std::io::BufReader::new(child.stderr.take().unwrap()).lines();
    let url = loop {
        let line = lines.next().expect("the server exited").unwrap();
        if let Some(rest) = line.split("listening on ").nth(1) {
            break rest.split_whitespace().next().unwrap().to_string();
        }
    };
    std::thread::spawn(move || for _ in lines.by_ref() {});
    (Server(child), format!("{url}/v1"))
}

/// Issue 15: every `temper env new --template` loads and runs against a
/// real server (the tiny model), with no greedy-group warning, and a
/// single-turn rollout ends `completed`.
#[test]
fn every_env_template_loads_and_evals_against_the_tiny_model() {
    let (_server, base) = tiny_server();
    let dir = tempfile::tempdir().unwrap();
    for t in [
        "single-turn",
        "multi-turn",
        "tools",
        "json",
        "code",
        "python-reward",
    ] {
        let name = format!("my-{t}");
        let out = temper()
            .args(["env", "new", &name, "--template", t, "--dir"])
            .arg(dir.path())
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{t}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let env_dir = dir.path().join(&name);
        let toml = std::fs::read_to_string(env_dir.join("env.toml")).unwrap();
        assert!(toml.contains(&format!("name = \"{name}\"")), "{t}: {toml}");
        assert!(!toml.to_lowercase().contains("unit conversion"), "{t}");
        let save = dir.path().join(format!("out-{t}"));
        let eval = |sandbox_url: Option<&str>| {
            let mut cmd = temper();
            match sandbox_url {
                Some(url) => cmd.env("TEMPER_SANDBOX_URL", url),
                None => cmd.env_remove("TEMPER_SANDBOX_URL"),
            };
            cmd.arg("eval")
                .arg(&env_dir)
                .args([
                    "-m",
                    "tiny-qwen3",
                    "-b",
                    &base,
                    "-n",
                    "2",
                    "-t",
                    "4",
                    "--quiet",
                    "--save-dir",
                ])
                .arg(&save)
                .output()
                .unwrap()
        };
        // The code template's tests run in the sandbox service: without
        // one the run stops before its first rollout, naming it (issue 38).
        let sandbox = if t == "code" {
            let out = eval(Some("http://127.0.0.1:9"));
            let stderr = String::from_utf8_lossy(&out.stderr);
            assert!(!out.status.success(), "{stderr}");
            assert!(
                stderr.contains("the sandbox service at http://127.0.0.1:9"),
                "{stderr}"
            );
            let Some(sandbox) = common::sandbox_serve(&[], &[]) else {
                continue;
            };
            Some(sandbox)
        } else {
            None
        };
        let out = eval(sandbox.as_ref().map(|(_, url)| url.as_str()));
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{t}: {stderr}");
        assert!(!stderr.contains("warning: "), "{t}: {stderr}");
        let run = run_dir_of(&save);
        let text = std::fs::read_to_string(run.join("results.jsonl")).unwrap();
        let lines: Vec<serde_json::Value> = text
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert_eq!(lines.len(), 2, "{t}");
        for l in &lines {
            assert!(l["error"].is_null(), "{t}: {l}");
            if t != "multi-turn" && t != "tools" {
                // One answer ends a single-turn rollout: `completed`, or
                // the token limit when `-t` cut it.
                let want = if l["is_truncated"] == true {
                    "max_total_completion_tokens_reached"
                } else {
                    "completed"
                };
                assert_eq!(l["stop_condition"], want, "{t}: {l}");
            }
        }
    }
}

/// Issue 16: `temper init DIR`, then `temper eval --config eval.toml` from
/// DIR against a running `temper serve`, with no edits (only `-b`: the test
/// server's port is not 8000); the model is the server's only one. The RL
/// and SFT configs it writes pass `--dry-run` and train one real step on
/// the tiny model.
#[test]
fn init_then_eval_against_temper_serve_with_no_edits() {
    let (_server, base) = tiny_server();
    let tmp = tempfile::tempdir().unwrap();
    let lab = tmp.path().join("lab");
    let out = temper().arg("init").arg(&lab).output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for f in [
        "README.md",
        "eval.toml",
        "rl.toml",
        "sft.toml",
        "envs/my-task/env.toml",
        "envs/my-task/train.jsonl",
        "envs/my-task/eval.jsonl",
    ] {
        assert!(lab.join(f).is_file(), "{f}");
    }
    let readme = std::fs::read_to_string(lab.join("README.md")).unwrap();
    for cmd in [
        "temper serve --model",
        "temper eval --config eval.toml",
        "temper view",
        "temper train sft sft.toml",
        "temper train rl rl.toml",
    ] {
        assert!(readme.contains(cmd), "README lacks `{cmd}`");
    }

    let out = temper()
        .current_dir(&lab)
        .args(["eval", "--config", "eval.toml", "--quiet", "-b", &base])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(stderr.contains("model: tiny-qwen3"), "{stderr}");
    let run = run_dir_of(&lab.join("outputs/evals"));
    let meta: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(run.join("metadata.json")).unwrap()).unwrap();
    assert_eq!(meta["env_id"], "my-task");
    assert_eq!(meta["model"], "tiny-qwen3");
    assert_eq!(meta["num_examples"], 4);
    let results = std::fs::read_to_string(run.join("results.jsonl")).unwrap();
    assert_eq!(results.lines().count(), 4);
    for l in results.lines() {
        let v: serde_json::Value = serde_json::from_str(l).unwrap();
        assert!(v["error"].is_null(), "{v}");
    }
    // Issue 39: eval defaults have one place, the environment's [eval]: the
    // generated eval.toml does not shadow it.
    let env_toml = lab.join("envs/my-task/env.toml");
    let text = std::fs::read_to_string(&env_toml).unwrap();
    assert!(text.contains("num_examples = 8"), "{text}");
    std::fs::write(
        &env_toml,
        text.replace("num_examples = 8", "num_examples = 2"),
    )
    .unwrap();
    let save = lab.join("outputs/one-place");
    let out = temper()
        .current_dir(&lab)
        .args(["eval", "--config", "eval.toml", "--quiet", "-b", &base])
        .arg("--save-dir")
        .arg(&save)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let results = std::fs::read_to_string(run_dir_of(&save).join("results.jsonl")).unwrap();
    assert_eq!(results.lines().count(), 2, "env.toml's [eval] num_examples");
    // Issue 39: the environment's README commands run from the lab's root
    // as written (only the port differs).
    let env_readme = std::fs::read_to_string(lab.join("envs/my-task/README.md")).unwrap();
    let cmd = env_readme
        .lines()
        .find(|l| l.starts_with("temper eval "))
        .unwrap_or_else(|| panic!("{env_readme}"));
    assert_eq!(
        cmd, "temper eval envs/my-task -b http://127.0.0.1:8000/v1",
        "{env_readme}"
    );
    let out = temper()
        .current_dir(&lab)
        .args(["eval", "envs/my-task", "-b", &base, "--quiet", "-n", "1"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // Issue 39: rl.toml takes the SmolLM2 recipe's measured defaults.
    let rl: toml::Value = std::fs::read_to_string(lab.join("rl.toml"))
        .unwrap()
        .parse()
        .unwrap();
    assert_eq!(rl["trainer"]["micro_batch"].as_integer(), Some(0));
    assert_eq!(rl["async"]["max_off_policy_steps"].as_integer(), Some(0));
    assert!(rl["eval"]["num_examples"].as_integer().unwrap() >= 40);
    // A second `init` into the same, now full, directory refuses.
    let out = temper().arg("init").arg(&lab).output().unwrap();
    assert!(!out.status.success());

    let model = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/models/tiny-qwen3");
    for (kind, file) in [("rl", "rl.toml"), ("sft", "sft.toml")] {
        let out = temper()
            .current_dir(&lab)
            .args(["train", kind, file, "--dry-run"])
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "{kind} --dry-run: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(stdout.contains("envs/my-task"), "{kind}: {stdout}");
        let out = temper()
            .current_dir(&lab)
            .args(["train", kind, file, "--model.path"])
            .arg(&model)
            .args([
                "--trainer.max_steps",
                "1",
                "--eval.num_examples",
                "0",
                "--log.progress",
                "false",
            ])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{kind}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(
            lab.join("runs").join(kind).join("metrics.jsonl").is_file(),
            "{kind}"
        );
    }
}

/// Issue 16: `--config` fills what the command line leaves unset; flags win.
#[test]
fn eval_config_file_and_flags() {
    let (base, _rt) = mock_server(Duration::ZERO);
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("eval.toml");
    let save = dir.path().join("out");
    std::fs::write(
        &cfg,
        format!(
            "env = \"arithmetic\"\nbase_url = {base:?}\nnum_examples = 5\nrollouts_per_example = 2\n\
             temperature = 0.5\nsave_dir = {:?}\nsampling_args = {{ top_p = 0.9 }}\n",
            save.display().to_string()
        ),
    )
    .unwrap();
    let out = temper()
        .args(["eval", "--config"])
        .arg(&cfg)
        .args(["-n", "3", "--quiet"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let run = run_dir_of(&save);
    let meta: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(run.join("metadata.json")).unwrap()).unwrap();
    assert_eq!(meta["num_examples"], 3, "the flag wins");
    assert_eq!(meta["rollouts_per_example"], 2, "from the file");
    assert_eq!(meta["model"], "mock", "the endpoint's only model");
    assert_eq!(meta["sampling_args"]["temperature"], 0.5);
    assert_eq!(meta["sampling_args"]["top_p"], 0.9);
    // An unknown key is an error that names it.
    std::fs::write(&cfg, "env = \"arithmetic\"\nrollouts = 2\n").unwrap();
    let out = temper()
        .args(["eval", "--config"])
        .arg(&cfg)
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("rollouts"));
}

/// Issue 15: the sampling fields reach the endpoint through `-S`, as JSON or
/// `key=value`, and the server honours them or names what it lacks.
#[test]
fn eval_sampling_args_reach_the_server() {
    let (_server, base) = tiny_server();
    let dir = tempfile::tempdir().unwrap();
    let env_dir = env_new_units(dir.path());
    let run = |extra: &[&str], save: &str| {
        let save = dir.path().join(save);
        let out = temper()
            .arg("eval")
            .arg(&env_dir)
            .args([
                "-m",
                "tiny-qwen3",
                "-b",
                &base,
                "-n",
                "2",
                "-t",
                "4",
                "--quiet",
            ])
            .args(extra)
            .arg("--save-dir")
            .arg(&save)
            .output()
            .unwrap();
        (out, save)
    };
    let (out, save) = run(
        &[
            "-S",
            "min_p=0.05",
            "-S",
            r#"{"frequency_penalty": 0.5, "presence_penalty": 0.25}"#,
            "-S",
            r#"logit_bias={"42": -100}"#,
            "-S",
            "repetition_penalty=1.1",
            "-S",
            "stop_token_ids=[7]",
        ],
        "ok",
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let meta: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(run_dir_of(&save).join("metadata.json")).unwrap(),
    )
    .unwrap();
    let s = &meta["sampling_args"];
    assert_eq!(s["min_p"], 0.05);
    assert_eq!(s["frequency_penalty"], 0.5);
    assert_eq!(s["presence_penalty"], 0.25);
    assert_eq!(s["repetition_penalty"], 1.1);
    assert_eq!(s["logit_bias"]["42"], -100.0);
    assert_eq!(s["stop_token_ids"], serde_json::json!([7]));
    // A field the server does not implement: every rollout fails with the
    // server's message naming it, and the run exits non-zero.
    let (out, _) = run(&["-S", "guided_json={}"], "bad");
    assert!(!out.status.success());
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains("unsupported field `guided_json`"),
        "{stdout}"
    );
}

/// Issue 15: several greedy rollouts per prompt draw a warning.
#[test]
fn eval_warns_when_several_rollouts_are_greedy() {
    let (base, _rt) = mock_server(Duration::ZERO);
    let out = eval_against(&base, &["-m", "mock", "-r", "3", "-T", "0"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(
        err.contains("warning: 3 rollouts per prompt at temperature 0"),
        "{err}"
    );
    let out = eval_against(&base, &["-m", "mock", "-r", "3", "-T", "0.7"]);
    assert!(!String::from_utf8_lossy(&out.stderr).contains("warning:"));
}

#[test]
fn env_new_refuses_bad_names_and_existing_dirs() {
    let dir = tempfile::tempdir().unwrap();
    let bad = temper()
        .args(["env", "new", "../x", "--dir"])
        .arg(dir.path())
        .output()
        .unwrap();
    assert!(!bad.status.success());
    assert!(temper()
        .args(["env", "new", "ok", "--dir"])
        .arg(dir.path())
        .output()
        .unwrap()
        .status
        .success());
    assert!(!temper()
        .args(["env", "new", "ok", "--dir"])
        .arg(dir.path())
        .output()
        .unwrap()
        .status
        .success());
}

/// Issue 15: with the endpoint down, `temper eval` stops at once (no 29 s
/// of retries) and says which URL it could not reach and why.
#[test]
fn eval_with_the_endpoint_down_fails_fast_naming_it() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port(); // the listener is dropped: nothing listens there
    let base = format!("http://127.0.0.1:{port}/v1");
    let t0 = Instant::now();
    let out = eval_against(&base, &["-m", "mock"]);
    assert!(t0.elapsed() < Duration::from_secs(10), "{:?}", t0.elapsed());
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains(&format!("cannot reach {base}/models")),
        "{err}"
    );
    assert!(err.to_lowercase().contains("refused"), "{err}");
}

/// Issue 15: a refused key is named as such, not scored as reward 0.
#[test]
fn eval_with_a_wrong_key_says_check_the_key() {
    let (base, _rt) = mock_with(MockConfig {
        api_key: Some("right".into()),
        ..MockConfig::default()
    });
    let out = temper()
        .env("TEMPER_TEST_KEY", "wrong")
        .args([
            "eval",
            "arithmetic",
            "-n",
            "2",
            "--quiet",
            "-m",
            "mock",
            "-k",
            "TEMPER_TEST_KEY",
            "-b",
            &base,
        ])
        .arg("--save-dir")
        .arg(tempfile::tempdir().unwrap().path())
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("401") && err.contains("check -k / the API key"),
        "{err}"
    );
    assert!(err.contains("$TEMPER_TEST_KEY"), "{err}");
    // The right key passes the preflight and the rollouts.
    let out = temper()
        .env("TEMPER_TEST_KEY", "right")
        .args([
            "eval",
            "arithmetic",
            "-n",
            "2",
            "--quiet",
            "-m",
            "mock",
            "-k",
            "TEMPER_TEST_KEY",
            "-b",
            &base,
        ])
        .arg("--save-dir")
        .arg(tempfile::tempdir().unwrap().path())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Issue 15: an unknown model name lists what the server offers.
#[test]
fn eval_with_an_unknown_model_lists_the_served_ones() {
    let (base, _rt) = mock_with(MockConfig {
        models: vec!["qwen".into(), "qwen-lora".into()],
        ..MockConfig::default()
    });
    let out = eval_against(&base, &["-m", "gpt-5"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("does not serve model `gpt-5`") && err.contains("it offers: qwen, qwen-lora"),
        "{err}"
    );
    // Issue 16: with no -m, an endpoint with several models must be told which.
    let out = eval_against(&base, &[]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("serves 2 models (qwen, qwen-lora); choose one with -m"),
        "{err}"
    );
}

/// Issue 15: the distinct errors are printed with counts, and a run where
/// every rollout failed exits non-zero.
#[test]
fn eval_where_every_rollout_fails_lists_errors_and_exits_non_zero() {
    let (base, _rt) = mock_with(MockConfig {
        faults: mock::Faults {
            cycle: 1,
            server_error: vec![0],
            ..mock::Faults::default()
        },
        ..MockConfig::default()
    });
    let out = eval_against(&base, &["-m", "mock", "-r", "1", "--max-retries", "0"]);
    assert!(!out.status.success());
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stdout.contains("3 × model endpoint answered 500: boom"),
        "{stdout}"
    );
    assert!(stderr.contains("every rollout failed (3 of 3)"), "{stderr}");
}

/// Issue 39: a pass threshold belongs to the environment. With a rubric
/// worth 1.5 (answer 1 + format 0.5) and no threshold, a well-formatted
/// wrong answer (reward 0.5) must not pass, and `temper eval` says once
/// which threshold it used; `[eval] pass_threshold` in env.toml is honoured
/// and recorded in metadata.json.
#[test]
fn issue39_env_pass_threshold_and_the_rubric_maximum() {
    let (base, _rt) = mock_server(Duration::ZERO);
    let dir = tempfile::tempdir().unwrap();
    let env_dir = env_new_units(dir.path());
    let toml_path = env_dir.join("env.toml");
    let original = std::fs::read_to_string(&toml_path).unwrap();
    let worth_1_5 = original.replace(
        "function = \"format\"\nweight = 0.0",
        "function = \"format\"\nweight = 0.5",
    );
    assert_ne!(worth_1_5, original, "the scaffold's format entry moved");
    let eval = |save: &Path| {
        let out = temper()
            .arg("eval")
            .arg(&env_dir)
            .args(["-m", "mock", "-b", &base, "--quiet", "--save-dir"])
            .arg(save)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr).to_string();
        assert!(out.status.success(), "{stderr}");
        let meta: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(run_dir_of(save).join("metadata.json")).unwrap(),
        )
        .unwrap();
        (
            meta,
            stderr,
            String::from_utf8_lossy(&out.stdout).to_string(),
        )
    };

    std::fs::write(&toml_path, &worth_1_5).unwrap();
    let (meta, stderr, stdout) = eval(&dir.path().join("a"));
    assert_eq!(meta["avg_reward"], 0.5, "format only: {meta}");
    assert_eq!(meta["pass_threshold"], 1.5);
    assert_eq!(meta["pass_at_k"]["1"], 0.0, "a wrong answer passed");
    assert_eq!(
        stderr.matches("the rubric's maximum reward is 1.5").count(),
        1,
        "{stderr}"
    );
    assert!(stdout.contains("(a pass is reward ≥ 1.5)"), "{stdout}");

    let with_threshold = worth_1_5.replace("# pass_threshold = 1.0", "pass_threshold = 0.5");
    assert_ne!(
        with_threshold, worth_1_5,
        "the scaffold's pass_threshold line moved"
    );
    std::fs::write(&toml_path, &with_threshold).unwrap();
    let (meta, stderr, _) = eval(&dir.path().join("b"));
    assert_eq!(meta["pass_threshold"], 0.5);
    assert_eq!(meta["pass_at_k"]["1"], 1.0);
    assert!(!stderr.contains("maximum reward"), "{stderr}");

    // The flag still wins over the environment.
    let out = temper()
        .arg("eval")
        .arg(&env_dir)
        .args([
            "-m",
            "mock",
            "-b",
            &base,
            "--quiet",
            "--pass-threshold",
            "2",
        ])
        .arg("--save-dir")
        .arg(dir.path().join("c"))
        .output()
        .unwrap();
    assert!(out.status.success());
    let meta: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(run_dir_of(&dir.path().join("c")).join("metadata.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(meta["pass_threshold"], 2.0);
}

/// Issue 39: `temper eval my-task` at a lab's root (where `temper init`
/// put the environment under `envs/`) names what it tried and suggests
/// `envs/my-task`, instead of a bare "unknown environment".
#[test]
fn issue39_unknown_env_names_the_path_and_suggests_envs() {
    let dir = tempfile::tempdir().unwrap();
    env_new_units(&dir.path().join("envs"));
    let out = temper()
        .current_dir(dir.path())
        .args([
            "eval",
            "units",
            "-m",
            "mock",
            "-b",
            "http://127.0.0.1:9/v1",
            "--quiet",
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("no units/env.toml in") && stderr.contains("did you mean `envs/units`?"),
        "{stderr}"
    );
}

/// Issue 39: `temper view` tells a rollout's latency (request to answer,
/// shared with the rollouts running beside it) from what one rollout cost
/// (the run's wall time over its rollouts). Against a mock that takes
/// 200 ms per call, 8 rollouts at once: each waits ~200 ms, but the run
/// costs ~25 ms per rollout, and the summary says both, labelled.
#[test]
fn issue39_view_reports_latency_and_wall_time_per_rollout_apart() {
    let (base, _rt) = mock_server(Duration::from_millis(200));
    let dir = tempfile::tempdir().unwrap();
    let out = temper()
        .args([
            "eval",
            "arithmetic",
            "-n",
            "8",
            "-c",
            "8",
            "--quiet",
            "-b",
            &base,
        ])
        .arg("--save-dir")
        .arg(dir.path())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let run = run_dir_of(dir.path());
    let results = std::fs::read_to_string(run.join("results.jsonl")).unwrap();
    for l in results.lines() {
        let v: serde_json::Value = serde_json::from_str(l).unwrap();
        let ms = v["timing"]["generation_ms"].as_f64().unwrap();
        assert!(ms >= 200.0, "each rollout records its own latency: {v}");
    }
    let out = temper().arg("view").arg(&run).output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}");
    let number_before = |line: &str, unit: &str| -> f64 {
        let l = stdout
            .lines()
            .find(|l| l.starts_with(line))
            .unwrap_or_else(|| panic!("no `{line}` line: {stdout}"));
        let at = l.find(unit).unwrap();
        l[..at].rsplit([' ', ':']).next().unwrap().parse().unwrap()
    };
    let wall_each = number_before("time ", " ms per rollout");
    let latency = number_before("latency ", " ms mean per rollout");
    assert!(
        stdout.contains("ms per rollout (8 rollouts, up to 8 at once)"),
        "{stdout}"
    );
    assert!(latency >= 200.0, "{stdout}");
    assert!(
        wall_each < latency / 2.0,
        "8 concurrent rollouts cost less each than one's latency: {stdout}"
    );
    let html = std::fs::read_to_string(run.join("report.html")).unwrap();
    assert!(html.contains("<th>latency ms</th><th>generation ms</th>"));
}

/// Issue 39: `temper env new --template python-reward` outside the
/// repository writes an environment whose reward is a Python function with
/// its helper beside it, and `temper eval` scores with it: the function's
/// own metric (`answered`) is in every result, so it ran.
#[test]
fn python_reward_template_scores_with_its_python_function_outside_the_repo() {
    let (_server, base) = tiny_server();
    let dir = tempfile::tempdir().unwrap();
    let out = temper()
        .current_dir(dir.path())
        .args(["env", "new", "py-task", "--template", "python-reward"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let env_dir = dir.path().join("py-task");
    for f in [
        "env.toml",
        "reward.py",
        "temper_reward.py",
        "train.jsonl",
        "eval.jsonl",
    ] {
        assert!(env_dir.join(f).is_file(), "{f}");
    }
    let readme = std::fs::read_to_string(env_dir.join("README.md")).unwrap();
    assert!(
        readme.contains("command = \".venv/bin/python reward.py\""),
        "{readme}"
    );
    let run_eval = |save: &str| {
        temper()
            .current_dir(dir.path())
            .args(["eval", "py-task", "-m", "tiny-qwen3", "-b", &base])
            .args(["-n", "2", "-t", "8", "--quiet", "--save-dir", save])
            .output()
            .unwrap()
    };
    let out = run_eval("out");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let results =
        std::fs::read_to_string(run_dir_of(&dir.path().join("out")).join("results.jsonl")).unwrap();
    assert_eq!(results.lines().count(), 2);
    for l in results.lines() {
        let v: serde_json::Value = serde_json::from_str(l).unwrap();
        assert!(v["error"].is_null() && v["reward_error"].is_null(), "{v}");
        assert!(v["metrics"]["correct/answered"].is_number(), "{v}");
    }
    // The Python function is what scores: make it give 0.25 to everything.
    let reward_py = env_dir.join("reward.py");
    let code = std::fs::read_to_string(&reward_py)
        .unwrap()
        .replace("return (1.0 if right else 0.0),", "return 0.25,");
    std::fs::write(&reward_py, code).unwrap();
    let out = run_eval("out2");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let results =
        std::fs::read_to_string(run_dir_of(&dir.path().join("out2")).join("results.jsonl"))
            .unwrap();
    for l in results.lines() {
        let v: serde_json::Value = serde_json::from_str(l).unwrap();
        assert_eq!(v["reward"], 0.25, "{v}");
    }
}
