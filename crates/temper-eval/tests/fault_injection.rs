//! The evaluator against a misbehaving endpoint: every fault the mock can
//! inject, and still every rollout exactly once.

use std::collections::BTreeMap;
use std::sync::atomic::Ordering;
use std::time::Duration;

use serde_json::json;
use temper_eval::mock::{self, Faults, MockConfig};
use temper_eval::results::read_results;
use temper_eval::{run_eval, EvalConfig, RetryPolicy};

fn config(base_url: String, dir: &std::path::Path, n: usize, r: usize) -> EvalConfig {
    EvalConfig {
        env_spec: "arithmetic".into(),
        env_args: json!({"digits": 2}),
        env_package: None,
        model: "mock".into(),
        base_url,
        api_key: None,
        api_key_env: None,
        num_examples: n,
        split: temper_env::Split::Eval,
        rollouts_per_example: r,
        max_concurrent: 64,
        sampling: Default::default(),
        seed: 0,
        run_dir: dir.join("run"),
        request_timeout: Duration::from_millis(300),
        retry: RetryPolicy {
            // Half of all requests fail: 31 tries make a rollout that never
            // gets through a 1-in-2^31 event.
            max_retries: 30,
            base_delay: Duration::from_millis(5),
            max_delay: Duration::from_millis(50),
        },
        pass_threshold: 1.0,
        resume: false,
        progress: false,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn five_hundred_rollouts_survive_every_fault_exactly_once() {
    let (addr, stats) = mock::spawn(MockConfig {
        faults: Faults::chaos(Duration::from_secs(2)),
        ..MockConfig::default()
    })
    .await
    .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(format!("http://{addr}/v1"), dir.path(), 250, 2);
    let env = temper_env::Loader::new()
        .load("arithmetic", &cfg.env_args)
        .unwrap();
    let out = run_eval(env, &cfg).await.unwrap();

    let lines = read_results(&cfg.run_dir.join("results.jsonl")).unwrap();
    assert_eq!(lines.len(), 500);
    let mut per_example: BTreeMap<u64, usize> = BTreeMap::new();
    for l in &lines {
        *per_example.entry(l.example_id).or_default() += 1;
        assert_eq!(l.error, None, "retries should absorb every fault");
        assert!(l.is_completed);
    }
    assert_eq!(per_example.len(), 250);
    assert!(per_example.values().all(|&c| c == 2));
    assert_eq!(
        per_example.keys().copied().collect::<Vec<_>>(),
        (0..250).collect::<Vec<_>>()
    );
    // The faults really happened: about half of all requests.
    let faults = stats.faults.load(Ordering::Relaxed);
    assert!(faults >= 250, "only {faults} faults injected");
    assert_eq!(stats.ok.load(Ordering::Relaxed), 500);
    // The mock answers right for 2 prompts in 3: the reward sees it.
    let m = &out.metadata;
    assert!(
        m.avg_reward > 0.5 && m.avg_reward < 0.8,
        "avg reward {}",
        m.avg_reward
    );
    assert_eq!(m.num_rollouts, 500);
    assert_eq!(m.status, "completed");
    assert!(m.pass_at_k.contains_key("1") && m.pass_at_k.contains_key("2"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exhausted_retries_are_recorded_on_the_rollout_not_raised() {
    // Every request fails with 500.
    let (addr, _) = mock::spawn(MockConfig {
        faults: Faults {
            cycle: 1,
            server_error: vec![0],
            ..Faults::default()
        },
        ..MockConfig::default()
    })
    .await
    .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = config(format!("http://{addr}/v1"), dir.path(), 5, 1);
    cfg.retry.max_retries = 2;
    let env = temper_env::Loader::new()
        .load("arithmetic", &cfg.env_args)
        .unwrap();
    let out = run_eval(env, &cfg).await.unwrap();
    let lines = read_results(&cfg.run_dir.join("results.jsonl")).unwrap();
    assert_eq!(lines.len(), 5);
    for l in &lines {
        assert!(
            l.error.as_deref().unwrap_or("").contains("500"),
            "{:?}",
            l.error
        );
        assert_eq!(l.stop_condition.as_deref(), Some("has_error"));
        assert!(!l.is_completed);
        assert_eq!(l.reward, 0.0);
    }
    assert_eq!(out.metadata.num_errors, 5);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resume_runs_only_what_is_missing() {
    let (addr, stats) = mock::spawn(MockConfig::default()).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(format!("http://{addr}/v1"), dir.path(), 20, 2);
    let env = temper_env::Loader::new()
        .load("arithmetic", &cfg.env_args)
        .unwrap();
    run_eval(env.clone(), &cfg).await.unwrap();
    let full = read_results(&cfg.run_dir.join("results.jsonl")).unwrap();
    // Cut the file back to 7 whole groups plus half a group and a torn line.
    let text = std::fs::read_to_string(cfg.run_dir.join("results.jsonl")).unwrap();
    let mut keep: Vec<&str> = text.lines().take(15).collect();
    keep.push("{\"example_id\": 99, \"pro");
    std::fs::write(cfg.run_dir.join("results.jsonl"), keep.join("\n")).unwrap();
    let before = stats.requests.load(Ordering::Relaxed);
    let mut again = cfg.clone();
    again.resume = true;
    let out = run_eval(env, &again).await.unwrap();
    let lines = read_results(&cfg.run_dir.join("results.jsonl")).unwrap();
    assert_eq!(lines.len(), 40);
    // 7 groups kept, 13 groups (26 rollouts) re-run.
    assert_eq!(out.new_rollouts, 26);
    assert_eq!(stats.requests.load(Ordering::Relaxed) - before, 26);
    let ids = |ls: &[temper_eval::results::ResultLine]| {
        let mut v: Vec<(u64, String)> = ls
            .iter()
            .map(|l| (l.example_id, l.prompt[1].text()))
            .collect();
        v.sort();
        v
    };
    assert_eq!(ids(&lines), ids(&full));
}

#[tokio::test]
async fn a_fresh_run_refuses_to_overwrite_results() {
    let (addr, _) = mock::spawn(MockConfig::default()).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(format!("http://{addr}/v1"), dir.path(), 2, 1);
    let env = temper_env::Loader::new()
        .load("arithmetic", &cfg.env_args)
        .unwrap();
    run_eval(env.clone(), &cfg).await.unwrap();
    assert!(run_eval(env, &cfg).await.is_err());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tool_calls_round_trip_through_the_openai_wire_format() {
    // The mock calls `calculate` with the question's expression, then
    // answers with the tool's result.
    let (addr, stats) = mock::spawn(MockConfig {
        tool_calls: true,
        ..MockConfig::default()
    })
    .await
    .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = config(format!("http://{addr}/v1"), dir.path(), 20, 1);
    cfg.env_spec = "calculator-tools".into();
    cfg.env_args = json!({"digits": 3, "terms": 3});
    let env = temper_env::Loader::new()
        .load(&cfg.env_spec, &cfg.env_args)
        .unwrap();
    let out = run_eval(env, &cfg).await.unwrap();
    assert_eq!(out.metadata.avg_reward, 1.0);
    assert_eq!(out.metadata.avg_metrics["tool_calls"], 1.0);
    assert_eq!(stats.requests.load(Ordering::Relaxed), 40);
    for l in read_results(&cfg.run_dir.join("results.jsonl")).unwrap() {
        let roles: Vec<&str> = l.completion.iter().map(|m| m.role.as_str()).collect();
        assert_eq!(roles, ["assistant", "tool", "assistant"]);
        let call = &l.completion[0].tool_calls.as_ref().unwrap()[0];
        assert_eq!(
            l.completion[1].tool_call_id.as_deref(),
            Some(call.id.as_str())
        );
        assert_eq!(l.stop_condition.as_deref(), Some("no_tools_called"));
    }
}
