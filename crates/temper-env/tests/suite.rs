//! The `mutation_score` and `coverage` rubrics (issue 38) and `[sandbox]
//! requirements`, against the real sandbox service.

use std::sync::Arc;

use serde_json::{json, Value};
use temper_env::rubric::RewardSpec;
use temper_env::{Message, Parser, Reward, Rollout, Row, Rubric, Score};

/// A function with two boundary comparisons: `x < lo` → `x <= lo` (and
/// `x > hi` → `x >= hi`) give the same results on every input, so they are
/// the equivalent mutants the sample inputs must filter out.
const CLAMP: &str = "def clamp(x, lo, hi):\n    \"\"\"Clamp x into [lo, hi].\"\"\"\n    if x < lo:\n        return lo\n    if x > hi:\n        return hi\n    return x\n";

fn samples() -> Value {
    json!([
        "clamp(5, 0, 10)",
        "clamp(-3, 0, 10)",
        "clamp(12, 0, 10)",
        "clamp(0, 0, 10)",
        "clamp(10, 0, 10)"
    ])
}

fn row(info: Value) -> Row {
    Row {
        example_id: 0,
        prompt: vec![Message::user("Write tests for clamp.")],
        answer: None,
        info,
    }
}

fn answer(tests: &str) -> Rollout {
    Rollout {
        completion: vec![Message::assistant(format!(
            "Here are tests:\n```python\n{tests}\n```"
        ))],
        is_completed: true,
        ..Rollout::default()
    }
}

/// The sandbox service on a free port (with virtualenvs built under
/// `venvs` with `pip_args` when given), or `None` where this host cannot
/// create the namespaces it needs.
async fn sandbox_service(venvs: Option<(&std::path::Path, Vec<String>)>) -> Option<String> {
    use temper_sandbox::service::{app, AppState, Runner};
    use temper_sandbox::{ExecRequest, Language, Sandbox, SandboxConfig, VenvConfig, Venvs};
    let sandbox = Sandbox::new(SandboxConfig::default()).ok()?;
    if let Err(e) = sandbox.run(&ExecRequest::new(Language::Python, "print(1)")) {
        eprintln!("SKIPPED: sandbox unavailable on this host: {e}");
        return None;
    }
    let mut state = AppState::new(Runner::Cold(Arc::new(sandbox)), None, 4);
    if let Some((root, pip_args)) = venvs {
        let config = VenvConfig {
            root: root.to_path_buf(),
            pip_args,
            build_timeout: std::time::Duration::from_secs(300),
        };
        let venvs = Venvs::new(config, SandboxConfig::default()).expect("venvs");
        state = state.with_venvs(Arc::new(venvs));
    }
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.ok()?;
    let addr = listener.local_addr().ok()?;
    tokio::spawn(async move { axum::serve(listener, app(state)).await });
    Some(format!("http://{addr}"))
}

fn reward(function: &str, url: &str, extra: &str) -> Reward {
    let timeout = if extra.contains("timeout_s") {
        ""
    } else {
        ", timeout_s = 2.0"
    };
    let spec: RewardSpec = toml::from_str(&format!(
        "function = {function:?}\nargs = {{ sandbox_url = {url:?}{timeout}{extra} }}"
    ))
    .unwrap();
    Reward::from_spec(&spec).unwrap()
}

async fn scores(r: Reward, info: Value, answers: &[&str]) -> Vec<Score> {
    let rollouts: Vec<Rollout> = answers.iter().map(|t| answer(t)).collect();
    Rubric::new(Parser::Plain)
        .with(r)
        .score_group(&row(info), &rollouts)
        .await
}

const STRONG: &str =
    "assert clamp(5, 0, 10) == 5\nassert clamp(-3, 0, 10) == 0\nassert clamp(12, 0, 10) == 10";
const WEAK: &str = "def test_middle():\n    assert clamp(5, 0, 10) == 5";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mutation_score_is_pass_on_original_times_fraction_killed() {
    let Some(url) = sandbox_service(None).await else {
        return;
    };
    let info = json!({"code": CLAMP, "samples": samples()});
    let wrong = "assert clamp(5, 0, 10) == 6";
    let s = scores(
        reward("mutation_score", &url, ""),
        info,
        &[STRONG, WEAK, wrong, "no code at all"],
    )
    .await;
    for x in &s {
        assert_eq!(
            x.metrics.get("mutation_score/error"),
            None,
            "{:?}",
            x.metrics
        );
    }
    let m = |i: usize, k: &str| s[i].metrics[&format!("mutation_score/{k}")];
    // clamp has 7 distinct mutants; the two boundary comparisons are
    // equivalent on the samples (and on every input), 5 remain.
    assert_eq!(m(0, "equivalent"), 2.0);
    assert_eq!(m(0, "mutants"), 5.0);
    // Three asserts kill every remaining mutant.
    assert_eq!((m(0, "pass_original"), m(0, "killed")), (1.0, 5.0));
    assert_eq!(s[0].reward, 1.0);
    // One middle value misses the mutants of the lo and hi branches.
    assert_eq!(m(1, "pass_original"), 1.0);
    assert_eq!(m(1, "killed"), 3.0, "{:?}", s[1].metrics);
    assert!((s[1].reward - 3.0 / 5.0).abs() < 1e-9);
    // A test that fails on the original earns nothing, however many
    // mutants it "kills".
    assert_eq!((m(2, "pass_original"), s[2].reward), (0.0, 0.0));
    assert_eq!(s[3].reward, 0.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn equivalent_mutants_are_dropped_only_with_sample_inputs() {
    let Some(url) = sandbox_service(None).await else {
        return;
    };
    // Without samples nothing can be told equivalent: all 7 mutants stay,
    // the two equivalent ones survive every test, and even the strongest
    // tests cannot reach 1.
    let s = scores(
        reward("mutation_score", &url, ", max_mutants = 20"),
        json!({"code": CLAMP}),
        &[STRONG],
    )
    .await;
    let m = |k: &str| s[0].metrics[&format!("mutation_score/{k}")];
    assert_eq!(
        (m("mutants"), m("equivalent"), m("killed")),
        (7.0, 0.0, 5.0)
    );
    assert!((s[0].reward - 5.0 / 7.0).abs() < 1e-9);

    // max_mutants caps the kept (non-equivalent) mutants.
    let s = scores(
        reward("mutation_score", &url, ", max_mutants = 2"),
        json!({"code": CLAMP, "samples": samples()}),
        &[STRONG],
    )
    .await;
    assert_eq!(s[0].metrics["mutation_score/mutants"], 2.0);
    assert_eq!(s[0].reward, 1.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mutants_given_in_the_row_are_used_as_they_are() {
    let Some(url) = sandbox_service(None).await else {
        return;
    };
    let info = json!({
        "code": "def double(x):\n    return 2 * x\n",
        "mutants": [
            "def double(x):\n    return x + x\n",
            "def double(x):\n    return 3 * x\n",
        ],
    });
    let s = scores(
        reward("mutation_score", &url, ""),
        info,
        &["assert double(4) == 8"],
    )
    .await;
    // The first "mutant" is equivalent, but the row's mutants are not
    // filtered: the row's author decides.
    assert_eq!(s[0].metrics["mutation_score/mutants"], 2.0);
    assert_eq!(s[0].metrics["mutation_score/killed"], 1.0);
    assert_eq!(s[0].reward, 0.5);
    assert_eq!(s[0].metrics.get("mutation_score/equivalent"), None);
}

/// What the tests print, and a test that loops on a mutant, decide only
/// their own outcome: the result never travels on stdout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn printing_and_hanging_tests_cannot_corrupt_the_result() {
    let Some(url) = sandbox_service(None).await else {
        return;
    };
    let noisy = format!(
        "import os, sys\nprint('{{\"killed\": 99}}')\nos.write(1, b'{{\"pass_original\": 0}}\\n')\nsys.stderr.write('noise')\n{STRONG}"
    );
    // Loops forever unless clamp returns its middle argument.
    let hangs = "while clamp(5, 0, 10) != 5:\n    pass\nassert clamp(-3, 0, 10) == 0";
    let s = scores(
        reward("mutation_score", &url, ", timeout_s = 1.0"),
        json!({"code": CLAMP, "samples": samples()}),
        &[&noisy, hangs],
    )
    .await;
    assert_eq!(s[0].reward, 1.0, "{:?}", s[0].metrics);
    assert_eq!(s[0].metrics["mutation_score/killed"], 5.0);
    // The mutants that break the middle case hang, time out, and count as
    // killed; the others are killed or not by the second assert.
    assert_eq!(s[1].metrics["mutation_score/pass_original"], 1.0);
    assert!(
        s[1].metrics["mutation_score/killed"] >= 2.0,
        "{:?}",
        s[1].metrics
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn coverage_is_the_fraction_of_lines_the_passing_tests_run() {
    let Some(url) = sandbox_service(None).await else {
        return;
    };
    let info = json!({"code": CLAMP});
    let s = scores(
        reward("coverage", &url, ""),
        info.clone(),
        &[STRONG, WEAK, "assert clamp(-3, 0, 10) == 1"],
    )
    .await;
    // clamp's lines with code: def, two ifs, three returns. The middle
    // value runs def, both ifs and the last return: 4 of 6.
    assert_eq!(s[0].reward, 1.0, "{:?}", s[0].metrics);
    assert_eq!(s[0].metrics["coverage/line"], 1.0);
    assert!((s[1].reward - 4.0 / 6.0).abs() < 1e-9, "{:?}", s[1].metrics);
    assert_eq!(s[1].metrics["coverage/pass_original"], 1.0);
    // A failing test ran 3 lines but earns nothing (require_pass), unless
    // asked otherwise.
    assert_eq!(s[2].reward, 0.0);
    assert!((s[2].metrics["coverage/line"] - 0.5).abs() < 1e-9);
    let s = scores(
        reward("coverage", &url, ", require_pass = false"),
        info,
        &["assert clamp(-3, 0, 10) == 1"],
    )
    .await;
    assert!((s[0].reward - 0.5).abs() < 1e-9);
}

#[test]
fn bad_arguments_are_refused_when_the_rubric_is_built() {
    let bad = |function: &str, args: &str| {
        let spec: RewardSpec =
            toml::from_str(&format!("function = {function:?}\nargs = {{ {args} }}")).unwrap();
        Reward::from_spec(&spec).err().unwrap()
    };
    assert!(bad("coverage", "metric = \"path\"").contains("line or branch"));
    assert!(bad("mutation_score", "runner = \"nose\"").contains("assert or pytest"));
    assert!(bad("mutation_score", "module = \"my-mod\"").contains("identifier"));
    assert!(bad("mutation_score", "max_mutant = 3").contains("unknown field"));
    assert!(bad("mutation_score", "metric = \"line\"").contains("coverage argument"));
}

/// The row must say what code is under test: a missing `info.code` is an
/// error metric, not a silent zero.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_row_without_code_reports_an_error() {
    let Some(url) = sandbox_service(None).await else {
        return;
    };
    let s = scores(reward("mutation_score", &url, ""), json!({}), &[STRONG]).await;
    assert_eq!(s[0].reward, 0.0);
    assert_eq!(s[0].metrics["mutation_score/error"], 1.0);
}

/// A wheel `tempermark` (module `tempermark`, `VALUE = 42`) in `dir`, made
/// by hand so the test needs no package index.
fn write_wheel(dir: &std::path::Path) {
    let script = r#"
import sys, zipfile
with zipfile.ZipFile(sys.argv[1] + "/tempermark-1.0-py3-none-any.whl", "w") as z:
    z.writestr("tempermark/__init__.py", "VALUE = 42\n")
    z.writestr("tempermark-1.0.dist-info/METADATA", "Metadata-Version: 2.1\nName: tempermark\nVersion: 1.0\n")
    z.writestr("tempermark-1.0.dist-info/WHEEL", "Wheel-Version: 1.0\nGenerator: temper-test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
    z.writestr("tempermark-1.0.dist-info/RECORD", "tempermark/__init__.py,,\ntempermark-1.0.dist-info/METADATA,,\ntempermark-1.0.dist-info/WHEEL,,\ntempermark-1.0.dist-info/RECORD,,\n")
"#;
    let ok = std::process::Command::new("python3")
        .args(["-c", script])
        .arg(dir)
        .status()
        .unwrap()
        .success();
    assert!(ok, "writing the test wheel");
}

/// Issue 38: code in the sandbox sees a package only when its environment
/// declares it in `[sandbox] requirements`; the virtualenv is built once
/// and reused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sandboxed_reward_imports_a_package_only_when_declared() {
    let wheels = tempfile::tempdir().unwrap();
    write_wheel(wheels.path());
    // Not under /tmp or /work: the sandbox mounts its own over them.
    let home = std::env::var("HOME").unwrap_or_default();
    let Some(parent) = [home.as_str(), env!("CARGO_TARGET_TMPDIR")]
        .into_iter()
        .find(|p| !p.is_empty() && !p.starts_with("/tmp") && !p.starts_with("/work"))
    else {
        eprintln!("SKIPPED: no directory outside /tmp and /work for the venv cache");
        return;
    };
    let cache = tempfile::tempdir_in(parent).unwrap();
    let pip_args = vec![
        "--no-index".to_string(),
        format!("--find-links={}", wheels.path().display()),
    ];
    let Some(url) = sandbox_service(Some((cache.path(), pip_args))).await else {
        return;
    };
    let env_dir = tempfile::tempdir().unwrap();
    let helper = concat!(env!("CARGO_MANIFEST_DIR"), "/../../python/temper_reward.py");
    std::fs::copy(helper, env_dir.path().join("temper_reward.py")).unwrap();
    std::fs::write(
        env_dir.path().join("reward.py"),
        "from temper_reward import reward, serve\n\n@reward\ndef marked(text, **_):\n    import tempermark\n    return tempermark.VALUE / 42\n\nserve()\n",
    )
    .unwrap();
    std::fs::write(
        env_dir.path().join("rows.jsonl"),
        "{\"question\": \"q\", \"answer\": \"a\"}\n",
    )
    .unwrap();
    let manifest = |requirements: &str| {
        format!(
            "name = \"pkg\"\n{requirements}\n[dataset]\neval = \"rows.jsonl\"\n\n[[rubric]]\ncommand = \"python3 reward.py\"\nsandbox = true\nsandbox_url = {url:?}\ntimeout_s = 120.0\n"
        )
    };
    let score = |text: String| {
        let dir = env_dir.path().to_path_buf();
        async move {
            std::fs::write(dir.join("env.toml"), text).unwrap();
            let env = temper_env::Loader::new()
                .load(dir.to_str().unwrap(), &Value::Null)
                .unwrap();
            let row = env.rows(temper_env::Split::Eval, 1, 0).unwrap().remove(0);
            let rollout = Rollout {
                completion: vec![Message::assistant("x")],
                ..Rollout::default()
            };
            env.score_group(&row, &[rollout]).await.remove(0)
        }
    };
    let with = score(manifest(
        "[sandbox]\nrequirements = [\"tempermark==1.0\"]\n",
    ))
    .await;
    assert_eq!(
        with.metrics.get("program/error"),
        None,
        "{:?}",
        with.metrics
    );
    assert_eq!(with.reward, 1.0);
    let without = score(manifest("")).await;
    assert_eq!(without.reward, 0.0);
    assert_eq!(without.metrics["program/error"], 1.0);
    // Built once: one virtualenv directory, marked complete.
    let built: Vec<_> = std::fs::read_dir(cache.path()).unwrap().collect();
    assert_eq!(built.len(), 1);
    // A requirement that is a path or an option is refused when the
    // environment loads, before anything reaches pip.
    std::fs::write(
        env_dir.path().join("env.toml"),
        manifest("[sandbox]\nrequirements = [\"--index-url=http://evil\"]\n"),
    )
    .unwrap();
    let e = temper_env::Loader::new()
        .load(env_dir.path().to_str().unwrap(), &Value::Null)
        .err()
        .unwrap();
    assert!(
        e.to_string().contains("no paths, URLs or pip options"),
        "{e}"
    );
}

/// `examples/test-writing` as committed: 48 held-out functions, and its
/// rubric scores a good answer 1 and an answer whose assert is wrong 0,
/// with coverage reported as a metric only (weight 0).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_test_writing_example_rewards_tests_that_kill_mutants() {
    let Some(url) = sandbox_service(None).await else {
        return;
    };
    // The committed example, pointed at the test's sandbox service (a
    // user's run reads $TEMPER_SANDBOX_URL instead).
    let example =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples/test-writing");
    let dir = tempfile::tempdir().unwrap();
    for f in ["train.jsonl", "eval.jsonl"] {
        std::fs::copy(example.join(f), dir.path().join(f)).unwrap();
    }
    let manifest = std::fs::read_to_string(example.join("env.toml")).unwrap();
    let pointed = manifest.replace(
        "timeout_s = 2.0 }",
        &format!("timeout_s = 2.0, sandbox_url = {url:?} }}"),
    );
    assert_eq!(pointed.matches("sandbox_url").count(), 2);
    std::fs::write(dir.path().join("env.toml"), pointed).unwrap();
    let env = temper_env::Loader::new()
        .load(dir.path().to_str().unwrap(), &Value::Null)
        .unwrap();
    let rows = env.rows(temper_env::Split::Eval, 1000, 0).unwrap();
    assert_eq!(rows.len(), 48);
    let row = rows
        .into_iter()
        .find(|r| r.info["code"] == "def add_k(x):\n    return x + 5\n")
        .expect("the add_k(5) row");
    let good = answer("assert add_k(0) == 5\nassert add_k(-3) == 2");
    let wrong = answer("assert add_k(0) == 0");
    let s = env.score_group(&row, &[good, wrong]).await;
    assert_eq!(s[0].reward, 1.0, "{:?}", s[0].metrics);
    assert_eq!(s[0].metrics["mutation_score/mutants"], 4.0);
    assert_eq!(s[0].metrics["coverage"], 1.0);
    assert_eq!(s[1].reward, 0.0);
}
