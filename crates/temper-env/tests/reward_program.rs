//! Python reward programs (issue 38): the protocol is immune to what
//! scored code prints or reads, `temper_reward.run` enforces its limits,
//! data files travel into the sandbox, and a refused sandbox key is loud.

mod common;

use std::time::Duration;

use common::{sandbox_service, write_reward_py};
use serde_json::{json, Value};
use temper_env::rubric::RewardSpec;
use temper_env::{Message, Parser, Reward, Rollout, Row, Rubric, Score};

fn rollout(text: &str) -> Rollout {
    Rollout {
        completion: vec![Message::assistant(text)],
        is_completed: true,
        ..Rollout::default()
    }
}

fn row(info: Value) -> Row {
    Row {
        example_id: 0,
        prompt: vec![Message::user("q?")],
        answer: None,
        info,
    }
}

/// A rubric of the one reward in `dir/reward.py`, run locally or in the
/// sandbox at `sandbox` (with `extra` TOML lines in its entry).
fn program_rubric(dir: &std::path::Path, sandbox: Option<&str>, extra: &str) -> Rubric {
    let toml = match sandbox {
        Some(url) => format!(
            "command = \"python3 reward.py\"\nname = \"r\"\ntimeout_s = 60.0\nsandbox = true\nsandbox_url = {url:?}\n{extra}"
        ),
        None => format!("command = \"python3 reward.py\"\nname = \"r\"\ntimeout_s = 60.0\n{extra}"),
    };
    let spec: RewardSpec = toml::from_str(&toml).unwrap();
    Rubric::new(Parser::Plain).with(Reward::from_spec_in(&spec, Some(dir)).unwrap())
}

/// The scored code prints to stdout (with and without a newline, as JSON
/// that looks like an answer, through `os.write(1)` and from a child
/// process) and reads stdin: the answers still come through, right.
const NOISY: &str = r#"
import os, subprocess, sys

@reward
def noisy(text, **_):
    print("partial line, no newline", end="")
    print('{"id": 1, "result": [{"reward": -1}]}')
    os.write(1, b'{"id": 1, "result": [{"reward": -2}]}\n')
    subprocess.run(["echo", "from a child process"])
    stolen = sys.stdin.read()
    return float(len(text)), {"stole": float(len(stolen))}
"#;

fn check_noisy(s: &[Score]) {
    assert_eq!(s[0].metrics.get("r/error"), None, "{:?}", s[0].metrics);
    let rewards: Vec<f64> = s.iter().map(|s| s.reward).collect();
    assert_eq!(rewards, [3.0, 5.0]);
    assert_eq!(s[0].metrics["r/stole"], 0.0, "stdin is not the protocol's");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reward_whose_code_prints_to_stdout_still_scores_right() {
    let dir = tempfile::tempdir().unwrap();
    write_reward_py(dir.path(), NOISY);
    let rubric = program_rubric(dir.path(), None, "");
    // Two groups through the same process: the first group's noise must
    // not be read as the second's answer.
    for _ in 0..2 {
        let s = rubric
            .score_group(&row(json!({})), &[rollout("abc"), rollout("hello")])
            .await;
        check_noisy(&s);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sandboxed_reward_whose_code_prints_to_stdout_still_scores_right() {
    let Some(url) = sandbox_service(false).await else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    write_reward_py(dir.path(), NOISY);
    let rubric = program_rubric(dir.path(), Some(&url), "");
    let s = rubric
        .score_group(&row(json!({})), &[rollout("abc"), rollout("hello")])
        .await;
    check_noisy(&s);
}

/// A reward that runs the completion's text as Python with `run` and
/// reports what it saw.
const RUNS_CODE: &str = r#"
import time
from temper_reward import run

@reward
def runs(text, args, **_):
    t = time.monotonic()
    r = run(text, files={"data/n.txt": "41"}, stdin="7", timeout=args["timeout"],
            max_output=args["max_output"])
    return float(r.ok), {
        "returncode": float(r.returncode), "timed_out": float(r.timed_out),
        "truncated": float(r.output_truncated), "stdout_len": float(len(r.stdout)),
        "stdout": float(r.stdout.strip()) if r.stdout.strip().isdigit() else -1.0,
        "stderr_has_boom": float("boom" in r.stderr),
        "seconds": time.monotonic() - t,
    }
"#;

/// What [`RUNS_CODE`] sees of a well-behaved, a failing, an endless and a
/// chatty program.
async fn check_run_limits(rubric: &Rubric) {
    let programs = [
        // Reads a shipped file and stdin.
        "import sys\nprint(int(open('data/n.txt').read()) + 1 + int(sys.stdin.read()) - 7)",
        "import sys\nsys.stderr.write('boom')\nsys.exit(3)",
        "while True:\n    pass",
        "while True:\n    print('x' * 100)",
        // A background child holding stdout open does not hold the run.
        "import subprocess\nsubprocess.Popen(['sleep', '30'])\nprint(5)",
    ];
    let rollouts: Vec<Rollout> = programs.iter().map(|p| rollout(p)).collect();
    let started = std::time::Instant::now();
    let s = rubric.score_group(&row(json!({})), &rollouts).await;
    let m = |i: usize, k: &str| s[i].metrics[&format!("r/{k}")];
    assert_eq!(s[0].metrics.get("r/error"), None, "{:?}", s[0].metrics);
    assert_eq!(
        (s[0].reward, m(0, "stdout"), m(0, "returncode")),
        (1.0, 42.0, 0.0)
    );
    assert_eq!((s[1].reward, m(1, "returncode")), (0.0, 3.0));
    assert_eq!(m(1, "stderr_has_boom"), 1.0);
    // Killed at the 1 s limit, not left to run.
    assert_eq!((s[2].reward, m(2, "timed_out")), (0.0, 1.0));
    assert!((1.0..5.0).contains(&m(2, "seconds")), "{}", m(2, "seconds"));
    assert_eq!(m(2, "returncode"), -9.0);
    // Killed once its output passed 1000 bytes, long before the time limit.
    assert_eq!(
        (s[3].reward, m(3, "truncated"), m(3, "timed_out")),
        (0.0, 1.0, 0.0)
    );
    assert!(m(3, "stdout_len") <= 1000.0, "{}", m(3, "stdout_len"));
    assert!(m(3, "seconds") < 1.0, "{}", m(3, "seconds"));
    assert_eq!((s[4].reward, m(4, "stdout")), (1.0, 5.0));
    assert!(m(4, "seconds") < 1.0, "{}", m(4, "seconds"));
    assert!(started.elapsed() < Duration::from_secs(30));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_enforces_its_time_and_output_limits() {
    let dir = tempfile::tempdir().unwrap();
    write_reward_py(dir.path(), RUNS_CODE);
    let rubric = program_rubric(
        dir.path(),
        None,
        "args = { timeout = 1.0, max_output = 1000 }",
    );
    check_run_limits(&rubric).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_enforces_its_limits_inside_the_sandbox() {
    let Some(url) = sandbox_service(false).await else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    write_reward_py(dir.path(), RUNS_CODE);
    let rubric = program_rubric(
        dir.path(),
        Some(&url),
        "args = { timeout = 1.0, max_output = 1000 }",
    );
    check_run_limits(&rubric).await;
}

/// `files = [...]` ship data with a sandboxed reward, at the same relative
/// paths; what may be shipped is checked when the environment loads.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn data_files_travel_into_the_sandbox_with_the_reward() {
    let Some(url) = sandbox_service(false).await else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    write_reward_py(
        dir.path(),
        r#"
import json

@reward
def lookup(text, **_):
    table = json.load(open("data/table.json"))
    extra = open("data/more/extra.txt").read()
    return float(table[text]), {"extra": float(extra)}
"#,
    );
    std::fs::create_dir_all(dir.path().join("data/more")).unwrap();
    std::fs::write(
        dir.path().join("data/table.json"),
        r#"{"a": 0.25, "b": 0.75}"#,
    )
    .unwrap();
    std::fs::write(dir.path().join("data/more/extra.txt"), "9").unwrap();
    let rubric = program_rubric(dir.path(), Some(&url), "files = [\"data\"]");
    let s = rubric
        .score_group(&row(json!({})), &[rollout("a"), rollout("b")])
        .await;
    assert_eq!(s[0].metrics.get("r/error"), None, "{:?}", s[0].metrics);
    assert_eq!((s[0].reward, s[1].reward), (0.25, 0.75));
    assert_eq!(s[1].metrics["r/extra"], 9.0);

    // Without the files the same reward fails, visibly.
    let rubric = program_rubric(dir.path(), Some(&url), "");
    let s = rubric.score_group(&row(json!({})), &[rollout("a")]).await;
    assert_eq!(s[0].metrics["r/error"], 1.0);
    assert!(
        s[0].error
            .as_deref()
            .unwrap_or("")
            .contains("FileNotFoundError"),
        "{:?}",
        s[0].error
    );

    // Paths that leave the directory, missing files, and files on a local
    // program are refused at load.
    for (extra, want) in [
        ("files = [\"../x\"]", "without `..`"),
        ("files = [\"/etc/passwd\"]", "relative path"),
        ("files = [\"nope.txt\"]", "nope.txt"),
    ] {
        let spec: RewardSpec = toml::from_str(&format!(
            "command = \"python3 reward.py\"\nsandbox = true\nsandbox_url = {url:?}\n{extra}"
        ))
        .unwrap();
        let e = Reward::from_spec_in(&spec, Some(dir.path())).err().unwrap();
        assert!(e.contains(want), "{extra}: {e}");
    }
    let spec: RewardSpec =
        toml::from_str("command = \"python3 reward.py\"\nfiles = [\"data\"]").unwrap();
    let e = Reward::from_spec_in(&spec, Some(dir.path())).err().unwrap();
    assert!(e.contains("need sandbox = true"), "{e}");
}

/// Issue 38: each rollout's `timing.scoring_ms` is its own scoring time
/// (a group-wide function's time shared out evenly), not the group's total
/// repeated on every rollout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scoring_time_is_measured_per_rollout() {
    use temper_env::{Env, EvalDefaults, Generated, Harness, PromptTemplate, Task};
    let slow = Reward::new("slow", 1.0, |c| {
        if temper_env::last_assistant_text(c.completion) == "slow" {
            std::thread::sleep(Duration::from_millis(300));
        }
        1.0
    });
    let dir = tempfile::tempdir().unwrap();
    write_reward_py(
        dir.path(),
        "import time\n@reward\ndef r(**_):\n    time.sleep(0.1)\n    return 1.0\n",
    );
    let rubric = program_rubric(dir.path(), None, "").with(slow);
    let dataset = Generated::new("t", PromptTemplate::default(), |_| Task {
        question: "q".into(),
        answer: String::new(),
        info: json!({}),
    });
    let env = Env::new(
        "t",
        std::sync::Arc::new(dataset),
        Harness::SingleTurn,
        rubric,
        EvalDefaults::default(),
    );
    let mut rollouts = vec![rollout("slow"), rollout("fast"), rollout("fast")];
    for r in &mut rollouts {
        r.timing.generation_ms = 5.0;
    }
    temper_env::score_and_time(&env, &row(json!({})), &mut rollouts).await;
    let ms: Vec<f64> = rollouts.iter().map(|r| r.timing.scoring_ms).collect();
    // The program scores the group in one call (≥ 100 ms, 1/3 each); only
    // the first rollout is slow in `slow`.
    assert!(ms[0] >= 300.0 + 100.0 / 3.0, "{ms:?}");
    assert!(ms[1] < 300.0 && ms[2] < 300.0, "{ms:?}");
    assert!(ms[1] >= 100.0 / 3.0, "{ms:?}");
    assert_eq!(rollouts[1].timing.total_ms, 5.0 + ms[1]);
}
