//! Issue 38: rewards never fail quietly. A sandbox started with
//! `--api-key-file` serves sandboxed rewards once the key is given (it used
//! to answer every reward 401: reward 0, `errors 0`, exit 0); a sandbox that
//! is down stops `temper eval`, `temper train rl` and its `--dry-run` before
//! the first rollout, naming it; reward errors are counted, and a run where
//! every reward failed exits non-zero.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use common::{sandbox_serve, Server};
use serde_json::Value;

/// `temper` without any sandbox key or URL from the caller's environment.
fn temper() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_temper"));
    c.arg("--threads")
        .arg("1")
        .env_remove("TEMPER_SANDBOX_API_KEY")
        .env_remove("TEMPER_SANDBOX_API_KEY_FILE")
        .env_remove("TEMPER_SANDBOX_URL");
    c
}

fn text(out: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// `temper sandbox serve --api-key-file KEYFILE` on a free port, as the
/// docs recommend; `None` where this host cannot make sandboxes.
fn keyed_sandbox(key_file: &Path) -> Option<(Server, String)> {
    sandbox_serve(&["--api-key-file", key_file.to_str().unwrap()], &[])
}

/// The mock OpenAI server (kept alive by the returned runtime).
fn mock_openai() -> (String, tokio::runtime::Runtime) {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let (addr, _) = rt
        .block_on(temper_eval::mock::spawn(Default::default()))
        .unwrap();
    (format!("http://{addr}/v1"), rt)
}

/// A URL where nothing listens.
fn dead_url() -> String {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    drop(l);
    format!("http://{addr}")
}

/// An environment of three rows (the last with `info.fail`) whose
/// reward is `reward.py`, run locally or in the sandbox at `sandbox_url`.
fn env_dir(dir: &Path, sandbox_url: Option<&str>, reward_body: &str) -> PathBuf {
    let env = dir.join("env");
    std::fs::create_dir_all(&env).unwrap();
    let rows: String = (0..3)
        .map(|i| {
            format!(
                "{{\"question\": \"q{i}\", \"answer\": \"a\", \"info\": {{\"fail\": {}}}}}\n",
                i == 2
            )
        })
        .collect();
    std::fs::write(env.join("rows.jsonl"), rows).unwrap();
    let sandbox = match sandbox_url {
        Some(url) => format!("sandbox = true\nsandbox_url = {url:?}\n"),
        None => String::new(),
    };
    std::fs::write(
        env.join("env.toml"),
        format!(
            "name = \"checks\"\n[dataset]\ntrain = \"rows.jsonl\"\neval = \"rows.jsonl\"\n\
             [[rubric]]\ncommand = \"python3 reward.py\"\nname = \"r\"\n{sandbox}\
             [eval]\nnum_examples = 3\nrollouts_per_example = 1\nmax_tokens = 8\ntemperature = 0.0\n"
        ),
    )
    .unwrap();
    let helper = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../python");
    std::fs::write(
        env.join("reward.py"),
        format!(
            "import sys\nsys.path.insert(0, {:?})\nfrom temper_reward import reward, serve\n\
             {reward_body}\nif __name__ == '__main__':\n    serve()\n",
            helper.display().to_string()
        ),
    )
    .unwrap();
    env
}

const ALWAYS_ONE: &str = "@reward\ndef r(**_):\n    return 1.0\n";

fn eval(env: &Path, base: &str, save: &Path, vars: &[(&str, &str)]) -> Output {
    temper()
        .arg("eval")
        .arg(env)
        .args(["-m", "mock", "-b", base, "--quiet", "--save-dir"])
        .arg(save)
        .envs(vars.iter().copied())
        .output()
        .unwrap()
}

fn has_results(save: &Path) -> bool {
    walk(save).iter().any(|p| p.ends_with("results.jsonl"))
}

fn walk(dir: &Path) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    entries
        .flatten()
        .flat_map(|e| {
            let p = e.path();
            if p.is_dir() {
                walk(&p)
            } else {
                vec![p]
            }
        })
        .collect()
}

#[test]
fn a_sandbox_started_with_an_api_key_file_serves_rewards_once_the_key_is_given() {
    let dir = tempfile::tempdir().unwrap();
    let key_file = dir.path().join("sandbox.key");
    std::fs::write(&key_file, "k3y-for-rewards\n").unwrap();
    let Some((_sandbox, url)) = keyed_sandbox(&key_file) else {
        return;
    };
    let (base, _rt) = mock_openai();
    let env = env_dir(dir.path(), Some(&url), ALWAYS_ONE);

    // No key: before this issue, reward 0, `errors 0`, exit 0. Now the run
    // stops before its first rollout and says what to set.
    let save = dir.path().join("no-key");
    let out = eval(&env, &base, &save, &[]);
    let (_, err) = text(&out);
    assert!(!out.status.success(), "{err}");
    assert!(
        err.contains(&format!("the sandbox service at {url}")),
        "{err}"
    );
    assert!(
        err.contains("401") && err.contains("no key was sent"),
        "{err}"
    );
    assert!(err.contains("TEMPER_SANDBOX_API_KEY_FILE"), "{err}");
    assert!(!has_results(&save), "no rollout may run");

    // The key file the sandbox reads, named to temper: the reward scores.
    let key_var = key_file.to_str().unwrap();
    for vars in [
        [("TEMPER_SANDBOX_API_KEY_FILE", key_var)],
        [("TEMPER_SANDBOX_API_KEY", "k3y-for-rewards")],
    ] {
        let save = dir.path().join(format!("with-{}", vars[0].0));
        let out = eval(&env, &base, &save, &vars);
        let (stdout, err) = text(&out);
        assert!(out.status.success(), "{vars:?}: {err}");
        assert!(stdout.contains("reward     1.0000"), "{stdout}");
        assert!(stdout.contains("reward errors 0"), "{stdout}");
    }

    // A wrong key is named as refused.
    let out = eval(
        &env,
        &base,
        &dir.path().join("wrong"),
        &[("TEMPER_SANDBOX_API_KEY", "nope")],
    );
    let (_, err) = text(&out);
    assert!(!out.status.success());
    assert!(err.contains("the key sent was refused"), "{err}");
}

/// A tiny model and an RL config `name` on `env` (two steps of two groups
/// of two).
fn rl_config(dir: &Path, env: &Path, name: &str) -> (PathBuf, PathBuf) {
    let model = dir.join("model");
    if !model.exists() {
        temper_rl::preset::TinyPreset::smallest()
            .write(&model, 3)
            .unwrap();
    }
    let run = dir.join(format!("run-{name}"));
    let cfg = dir.join(format!("{name}.toml"));
    std::fs::write(
        &cfg,
        format!(
            "seed = 1\n[model]\npath = {:?}\n[lora]\nrank = 2\n[[env]]\nid = {:?}\n\
             [sampling]\nmax_tokens = 4\ngroup_size = 2\n[trainer]\nbatch_size = 2\nmax_steps = 2\n\
             [eval]\nnum_examples = 0\n[log]\ndir = {:?}\nprogress = true\n",
            model.display().to_string(),
            env.display().to_string(),
            run.display().to_string()
        ),
    )
    .unwrap();
    (cfg, run)
}

#[test]
fn a_sandbox_that_is_down_stops_eval_and_rl_before_the_first_rollout() {
    let dir = tempfile::tempdir().unwrap();
    let url = dead_url();
    let env = env_dir(dir.path(), Some(&url), ALWAYS_ONE);
    let named = |err: &str| {
        err.contains(&format!("the sandbox service at {url}")) && err.contains("cannot reach it")
    };

    let (base, _rt) = mock_openai();
    let save = dir.path().join("eval");
    let out = eval(&env, &base, &save, &[]);
    let (_, err) = text(&out);
    assert!(!out.status.success() && named(&err), "{err}");
    assert!(!has_results(&save));

    let (cfg, run) = rl_config(dir.path(), &env, "down");
    let out = temper()
        .args(["train", "rl"])
        .arg(&cfg)
        .arg("--dry-run")
        .output()
        .unwrap();
    let (_, err) = text(&out);
    assert!(!out.status.success() && named(&err), "dry run: {err}");

    let out = temper().args(["train", "rl"]).arg(&cfg).output().unwrap();
    let (_, err) = text(&out);
    assert!(!out.status.success() && named(&err), "train: {err}");
    assert!(
        !run.join("metrics.jsonl").exists()
            || std::fs::read_to_string(run.join("metrics.jsonl"))
                .unwrap()
                .is_empty(),
        "no step may run"
    );
}

#[test]
fn reward_errors_are_counted_and_a_run_where_every_reward_failed_exits_non_zero() {
    let dir = tempfile::tempdir().unwrap();
    let (base, _rt) = mock_openai();
    // Row 2 fails; rows 0 and 1 score.
    let some = env_dir(
        &dir.path().join("some"),
        None,
        "@reward\ndef r(info, **_):\n    if info['fail']:\n        raise RuntimeError('no luck')\n    return 1.0\n",
    );
    let out = eval(&some, &base, &dir.path().join("some-out"), &[]);
    let (stdout, err) = text(&out);
    assert!(out.status.success(), "{err}");
    assert!(stdout.contains("reward errors 1"), "{stdout}");
    assert!(
        stdout.contains("1 × reward `r`: RuntimeError: no luck"),
        "{stdout}"
    );
    // Each rollout's line says why.
    let results = walk(&dir.path().join("some-out"))
        .into_iter()
        .find(|p| p.ends_with("results.jsonl"))
        .unwrap();
    let lines: Vec<Value> = std::fs::read_to_string(results)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(
        lines
            .iter()
            .filter(|l| l["reward_error"].is_string())
            .count(),
        1
    );

    let all = env_dir(
        &dir.path().join("all"),
        None,
        "@reward\ndef r(**_):\n    raise RuntimeError('never')\n",
    );
    let out = eval(&all, &base, &dir.path().join("all-out"), &[]);
    let (stdout, err) = text(&out);
    assert!(!out.status.success(), "{stdout}");
    assert!(stdout.contains("reward errors 3"), "{stdout}");
    assert!(
        err.contains("every rollout's reward failed (3 of 3)") && err.contains("never"),
        "{err}"
    );

    // RL: a step where every reward failed ends the run, non-zero.
    let (cfg, run) = rl_config(dir.path(), &all, "all");
    let out = temper().args(["train", "rl"]).arg(&cfg).output().unwrap();
    let (_, err) = text(&out);
    assert!(!out.status.success(), "{err}");
    assert!(
        err.contains("step 0: every rollout's reward failed (4 of 4)") && err.contains("never"),
        "{err}"
    );
    assert!(!run.join("metrics.jsonl").exists() || metrics(&run).is_empty());

    // Where some fail, RL counts them per step and goes on; time/reward is
    // the part of time/generate spent scoring.
    let (cfg, run) = rl_config(dir.path(), &some, "some");
    let out = temper().args(["train", "rl"]).arg(&cfg).output().unwrap();
    let (_, err) = text(&out);
    assert!(out.status.success(), "{err}");
    let steps = metrics(&run);
    assert_eq!(steps.len(), 2);
    let errors: u64 = steps
        .iter()
        .map(|m| m["reward_errors"].as_u64().unwrap())
        .sum();
    assert!(errors > 0, "{steps:?}");
    assert!(err.contains("reward-errors"), "{err}");
    for m in &steps {
        let (reward, generate) = (
            m["time/reward"].as_f64().unwrap(),
            m["time/generate"].as_f64().unwrap(),
        );
        assert!(reward > 0.0 && reward <= generate, "{m:?}");
    }
}

fn metrics(run: &Path) -> Vec<serde_json::Map<String, Value>> {
    std::fs::read_to_string(run.join("metrics.jsonl"))
        .unwrap_or_default()
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap())
        .filter_map(|v| v.as_object().cloned())
        .collect()
}
