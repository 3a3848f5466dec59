//! Issue 17: Harbor tasks as an RL environment. A run on two example tasks
//! with the `terminal` agent on the tiny model completes its steps and
//! trains on the tokens captured from the agents' model calls — the
//! built-in agent's in-process calls, and an agent program's (the `command`
//! agent running `examples/agents/shell_agent.py`) calls over HTTP.

use std::path::{Path, PathBuf};

use serde_json::{json, Value};
use temper_rl::config::{self, RlConfig};
use temper_rl::rl::{run_rl, RunOptions};

fn examples() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples/tasks")
}

/// False (and a SKIPPED line) where this host gives no namespaces: trials
/// need the sandbox, like the sandbox's own tests.
fn sandbox_usable(test: &str) -> bool {
    use temper_sandbox::{ExecRequest, Language, Sandbox, SandboxConfig};
    let ok = Sandbox::new(SandboxConfig::default())
        .and_then(|s| s.run(&ExecRequest::new(Language::Bash, "true")));
    if let Err(e) = &ok {
        eprintln!("SKIPPED {test}: namespaces unavailable on this host: {e}");
    }
    ok.is_ok()
}

/// A task whose verifier draws its reward at random: a random tiny model
/// solves no example task (all-zero groups teach nothing), so this one
/// gives its groups non-zero advantages and the step something to train.
fn coin_task(root: &Path) -> PathBuf {
    let dir = root.join("coin");
    std::fs::create_dir_all(dir.join("tests")).unwrap();
    std::fs::create_dir_all(dir.join("environment")).unwrap();
    std::fs::write(dir.join("instruction.md"), "Say anything.\n").unwrap();
    std::fs::write(
        dir.join("task.toml"),
        "version = \"1.0\"\n[verifier]\ntimeout_sec = 30.0\n[agent]\ntimeout_sec = 60.0\n\
         [environment]\nmemory_mb = 512\nstorage_mb = 64\n",
    )
    .unwrap();
    std::fs::write(
        dir.join("environment/Dockerfile"),
        "FROM ubuntu:24.04\nWORKDIR /app\n",
    )
    .unwrap();
    std::fs::write(
        dir.join("tests/test.sh"),
        "#!/bin/bash\necho \"0.$RANDOM$RANDOM\" > /logs/verifier/reward.txt\n",
    )
    .unwrap();
    dir
}

fn config(dir: &Path) -> RlConfig {
    let coin = coin_task(dir);
    let text = format!(
        r#"
        seed = 11
        [model]
        preset = "tiny"
        [model.tiny]
        hidden_size = 32
        num_layers = 1
        num_heads = 2
        num_kv_heads = 1
        intermediate_size = 64
        max_position_embeddings = 2048
        [lora]
        rank = 4
        alpha = 8.0
        [[env]]
        id = "{examples}"
        weight = 2.0
        args = {{ agent = "terminal", tasks = ["hello-file", "write-config"], max_turns = 2, agent_timeout_sec = 60.0, trials_dir = "{trials}" }}
        [[env]]
        id = "{coin}"
        args = {{ agent = "command", command = "MAX_TURNS=2 python3 {shell_agent}", trials_dir = "{coin_trials}" }}
        [sampling]
        max_tokens = 12
        group_size = 4
        [trainer]
        lr = 1e-2
        batch_size = 3
        max_steps = 2
        [async]
        enabled = false
        [eval]
        num_examples = 0
        [ckpt]
        interval = 0
        [log]
        dir = "{run}"
        progress = false
        "#,
        examples = examples().display(),
        trials = dir.join("trials").display(),
        coin = coin.display(),
        shell_agent = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../examples/agents/shell_agent.py")
            .display(),
        coin_trials = dir.join("coin-trials").display(),
        run = dir.join("run").display(),
    );
    config::resolve(&text, &[]).unwrap()
}

/// Every trial directory under `dir`: (result.json, tokens.jsonl records,
/// trajectory.json).
fn trials(dir: &Path) -> Vec<(Value, Vec<Value>, Value)> {
    let read = |p: PathBuf| -> Value {
        serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap()
    };
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).unwrap() {
        let d = e.unwrap().path();
        let records = temper_tasks::capture::read_records(&d.join("agent")).unwrap();
        out.push((
            read(d.join("result.json")),
            records,
            read(d.join("agent/trajectory.json")),
        ));
    }
    out
}

#[test]
fn rl_on_two_example_tasks_with_the_terminal_agent_trains_on_captured_tokens() {
    if !sandbox_usable("rl_on_two_example_tasks_with_the_terminal_agent_trains_on_captured_tokens")
    {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let cfg = config(tmp.path());
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let out = rt.block_on(run_rl(cfg, RunOptions::default())).unwrap();
    assert_eq!(out.steps, 2);

    // The example tasks ran for real: 2 steps x 2 groups x 4 rollouts, the
    // verifier scored each (0: a random model solves nothing), and every
    // model call of the agent was captured with its tokens.
    let examples = trials(&tmp.path().join("trials"));
    assert_eq!(examples.len(), 16);
    for (result, records, traj) in &examples {
        assert_eq!(result["verifier_result"]["rewards"]["reward"], json!(0.0));
        let model_steps = traj["steps"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|s| s["source"] == "agent")
            .count();
        assert!((1..=2).contains(&records.len()), "{}", result["trial_name"]);
        assert_eq!(records.len(), model_steps, "one record per model turn");
        for r in records {
            let n = r["completion_token_ids"].as_array().unwrap().len();
            assert_eq!(r["logprobs"].as_array().unwrap().len(), n);
            assert!(!r["prompt_token_ids"].as_array().unwrap().is_empty());
        }
    }
    let coin = trials(&tmp.path().join("coin-trials"));
    assert_eq!(coin.len(), 8, "2 steps x 1 group x 4 rollouts");
    // The coin groups' agent program made its calls over HTTP; their
    // captured completion tokens are exactly what is trained (their rewards
    // differ; the example tasks' groups are all 0).
    for (result, records, _) in &coin {
        assert!(
            (1..=2).contains(&records.len()),
            "{}: {:?}",
            result["trial_name"],
            result["exception_info"]
        );
    }
    let captured: usize = coin
        .iter()
        .flat_map(|(_, records, _)| records)
        .map(|r| r["completion_token_ids"].as_array().unwrap().len())
        .sum();
    assert!(captured > 0);

    let (mut trained, mut measured) = (0, 0);
    for m in &out.metrics {
        let r = m.to_record().unwrap();
        assert_eq!(r["zero_advantage_groups"], json!(2), "{r:?}");
        assert_eq!(r["skipped_turns"], json!(0), "{r:?}");
        assert!(r["trained_sequences"].as_u64().unwrap() > 0, "{r:?}");
        // The sampler's logprobs are the trainer's: zero mismatch, measured
        // on every trained token (on-policy, synchronous loop).
        assert_eq!(r["mismatch/max"], json!(0.0), "{r:?}");
        trained += r["trained_tokens"].as_u64().unwrap() as usize;
        measured += r["mismatch/tokens"].as_u64().unwrap() as usize;
    }
    assert_eq!(trained, captured, "trained tokens = captured tokens");
    assert_eq!(measured, captured);
}
