//! `temper eval`, `temper env new` and `temper view` as a user runs them,
//! against the mock OpenAI server.

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
    let rt = tokio::runtime::Runtime::new().unwrap();
    let (addr, _) = rt
        .block_on(mock::spawn(MockConfig {
            latency,
            ..MockConfig::default()
        }))
        .unwrap();
    (format!("http://{addr}/v1"), rt)
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
    // The scaffold's defaults: 8 examples × 2 rollouts.
    let g = groups(&run);
    assert_eq!(g.len(), 8);
    assert!(g.values().all(|v| v.len() == 2));
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
            && html.contains("How many seconds are in 5 minutes?")
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
