//! The RL loop end to end on a tiny random model: orchestration
//! equivalences, bounded staleness, checkpoints and resume.

use std::path::Path;

use serde_json::{json, Map, Value};
use temper_rl::config::{self, RlConfig};
use temper_rl::rl::{run_rl, RunOptions};
use temper_rl::StepMetrics;

/// An environment whose reward (LCS ratio of the raw completion with the
/// answer) is graded, so even a random model gets non-zero advantages and
/// every step trains.
fn graded_env(dir: &Path) -> String {
    let env = dir.join("graded-env");
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
    env.display().to_string()
}

fn tiny_config(dir: &Path, extra: &str) -> RlConfig {
    let env = graded_env(dir);
    let text = format!(
        r#"
        seed = 7
        [model]
        preset = "tiny"
        [model.tiny]
        hidden_size = 32
        num_layers = 1
        num_heads = 2
        num_kv_heads = 1
        intermediate_size = 64
        max_position_embeddings = 256
        [lora]
        rank = 4
        alpha = 8.0
        [[env]]
        id = "{env}"
        [sampling]
        max_tokens = 8
        group_size = 4
        [trainer]
        lr = 1e-2
        batch_size = 2
        max_steps = 4
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
        dir.display()
    );
    config::resolve(&text, &[]).unwrap()
}

/// The `metrics.jsonl` records of typed step metrics.
fn records(metrics: &[StepMetrics]) -> Vec<Map<String, Value>> {
    metrics.iter().map(|m| m.to_record().unwrap()).collect()
}

/// Metrics without wall-clock fields.
fn comparable(metrics: &[StepMetrics]) -> Vec<Map<String, Value>> {
    records(metrics)
        .iter()
        .map(|r| {
            r.iter()
                .filter(|(k, _)| !k.starts_with("time/") && *k != "tokens_per_s")
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect()
        })
        .collect()
}

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

#[test]
fn async_loop_with_bound_zero_equals_the_synchronous_loop() {
    let a = tempfile::tempdir().unwrap();
    let b = tempfile::tempdir().unwrap();
    let mut ca = tiny_config(a.path(), "");
    ca.async_.max_off_policy_steps = 0;
    ca.async_.enabled = true;
    let mut cb = tiny_config(b.path(), "");
    cb.async_.max_off_policy_steps = 0;
    cb.async_.enabled = false;
    let ra = rt().block_on(run_rl(ca, RunOptions::default())).unwrap();
    let rb = rt().block_on(run_rl(cb, RunOptions::default())).unwrap();
    assert_eq!(ra.steps, 4);
    assert_eq!(comparable(&ra.metrics), comparable(&rb.metrics));
    // It trained (graded rewards), on-policy, with zero sampler/trainer mismatch.
    for m in &records(&ra.metrics) {
        assert!(m["trained_sequences"].as_u64().unwrap() > 0, "{m:?}");
        assert_eq!(m["policy_lag/max"], json!(0.0));
        assert_eq!(m["mismatch/max"], json!(0.0), "{m:?}");
    }
    let adapter = |d: &Path| std::fs::read(d.join("adapter/adapter_model.safetensors")).unwrap();
    assert_eq!(adapter(a.path()), adapter(b.path()));
    // The trained adapter differs from its (B = 0) start: training moved it.
    let rewards: Vec<f64> = records(&ra.metrics)
        .iter()
        .map(|m| m["reward/mean"].as_f64().unwrap())
        .collect();
    assert!(rewards.iter().all(|r| r.is_finite()));
}

#[test]
fn the_trainer_scores_the_sampling_temperature_so_mismatch_is_zero_at_any_temperature() {
    for t in [0.6, 1.0, 1.3] {
        let d = tempfile::tempdir().unwrap();
        let mut c = tiny_config(d.path(), "");
        c.sampling.temperature = t;
        c.async_.max_off_policy_steps = 0;
        c.trainer.max_steps = 3;
        let r = rt().block_on(run_rl(c, RunOptions::default())).unwrap();
        assert_eq!(r.metrics.len(), 3);
        for m in &records(&r.metrics) {
            // On-policy tokens were compared, and learner == sampler exactly.
            assert!(m["mismatch/tokens"].as_u64().unwrap() > 0, "T {t}: {m:?}");
            assert_eq!(m["mismatch/max"], json!(0.0), "T {t}: {m:?}");
            assert_eq!(m["skipped_turns"], json!(0), "T {t}: {m:?}");
        }
    }
}

/// `[model] dtype = "bf16"`: the sampler and the trainer share the bf16
/// kernels, so mismatch stays exactly zero; and the run differs from the
/// f32 one (the setting took effect).
#[test]
fn with_bf16_weights_sampler_and_trainer_still_agree_bit_for_bit() {
    let run = |dtype: &str| {
        let d = tempfile::tempdir().unwrap();
        let mut c = tiny_config(d.path(), "");
        c.model.dtype = Some(dtype.into());
        c.sampling.temperature = 0.8;
        c.async_.max_off_policy_steps = 0;
        c.trainer.max_steps = 3;
        let r = rt().block_on(run_rl(c, RunOptions::default())).unwrap();
        records(&r.metrics)
    };
    let bf16 = run("bf16");
    assert_eq!(bf16.len(), 3);
    for m in &bf16 {
        assert!(m["mismatch/tokens"].as_u64().unwrap() > 0, "{m:?}");
        assert_eq!(m["mismatch/max"], json!(0.0), "{m:?}");
    }
    let f32 = run("f32");
    // On-policy losses depend only on the rewards; the policy's entropy and
    // gradient norm depend on the weights' rounding.
    let numbers = |ms: &[Map<String, Value>]| -> Vec<(Value, Value)> {
        ms.iter()
            .map(|m| (m["entropy"].clone(), m["grad_norm"].clone()))
            .collect()
    };
    assert_ne!(numbers(&bf16), numbers(&f32), "bf16 ran the f32 numbers");
}

#[test]
fn no_rollout_older_than_the_bound_is_trained_on() {
    for bound in [1u64, 2] {
        let d = tempfile::tempdir().unwrap();
        let mut c = tiny_config(d.path(), "");
        c.async_.max_off_policy_steps = bound;
        c.trainer.max_steps = 6;
        let r = rt().block_on(run_rl(c, RunOptions::default())).unwrap();
        assert_eq!(r.metrics.len(), 6);
        for m in &records(&r.metrics) {
            let lag = m["policy_lag/max"].as_f64().unwrap();
            assert!(lag <= bound as f64, "bound {bound}: lag {lag} in {m:?}");
        }
    }
}

/// Issue 35 item 6: a step whose rollouts are all one step old has no
/// on-policy token to compare, so `mismatch/max` is `null` there, not a 0
/// that nothing measured; and the probe rescores one off-policy sequence
/// under the weights that sampled it, so the mismatch is measured — and 0 —
/// on every step that trained.
#[test]
fn every_step_measures_the_mismatch_on_policy_or_by_the_probe() {
    let d = tempfile::tempdir().unwrap();
    let mut c = tiny_config(d.path(), "");
    c.async_.max_off_policy_steps = 1;
    c.trainer.max_steps = 6;
    let r = rt().block_on(run_rl(c, RunOptions::default())).unwrap();
    let (mut probed, mut unmeasured) = (0, 0);
    for m in &records(&r.metrics) {
        if m["mismatch/tokens"] == json!(0) {
            assert_eq!(m["mismatch/max"], Value::Null, "{m:?}");
            assert_eq!(m["mismatch/mean"], Value::Null, "{m:?}");
        } else {
            assert_eq!(m["mismatch/max"], json!(0.0), "{m:?}");
        }
        // Lagged rollouts, or nothing compared on-policy: probed.
        if m["policy_lag/max"].as_f64().unwrap() > 0.0 || m["mismatch/tokens"] == json!(0) {
            assert!(m["mismatch/probe_tokens"].as_u64().unwrap() > 0, "{m:?}");
            assert_eq!(m["mismatch/probe_max"], json!(0.0), "{m:?}");
            probed += 1;
        } else {
            assert_eq!(m["mismatch/probe_max"], Value::Null, "{m:?}");
        }
        if m["mismatch/max"].is_null() && m["mismatch/probe_max"].is_null() {
            unmeasured += 1;
        }
    }
    assert!(
        probed > 0,
        "no step trained on lagged rollouts: {:?}",
        records(&r.metrics)
    );
    assert_eq!(unmeasured, 0, "{:?}", records(&r.metrics));
}

/// Issue 35 item 1: full fine-tuning ends, like LoRA, with its weights
/// exported — the whole model in Hugging Face layout at `RUN/model` (that
/// transformers loads it is `tests/python/check_rl_full_model.py`).
#[test]
fn full_fine_tuning_ends_with_a_hugging_face_model_directory() {
    let d = tempfile::tempdir().unwrap();
    let mut c = tiny_config(d.path(), "");
    c.lora.enabled = false;
    c.async_.max_off_policy_steps = 0;
    c.trainer.max_steps = 2;
    let r = rt().block_on(run_rl(c, RunOptions::default())).unwrap();
    assert_eq!(r.output, d.path().join("model"));
    for f in ["config.json", "model.safetensors"] {
        assert!(
            r.output.join(f).is_file(),
            "{f} missing from {:?}",
            r.output
        );
    }
}

#[test]
fn a_stopped_run_resumes_from_its_checkpoint_and_matches_an_uninterrupted_one() {
    let full = tempfile::tempdir().unwrap();
    let cut = tempfile::tempdir().unwrap();
    let mk = |d: &Path| {
        let mut c = tiny_config(d, "");
        c.async_.max_off_policy_steps = 0;
        c
    };
    let whole = rt()
        .block_on(run_rl(mk(full.path()), RunOptions::default()))
        .unwrap();
    // Two steps, then stop as if killed (checkpoint interval 1).
    let part = rt()
        .block_on(run_rl(
            mk(cut.path()),
            RunOptions {
                stop_after: Some(2),
                ..Default::default()
            },
        ))
        .unwrap();
    assert_eq!(part.steps, 2);
    // A fresh start in a directory with a run is refused.
    let err = rt()
        .block_on(run_rl(mk(cut.path()), RunOptions::default()))
        .unwrap_err();
    assert!(err.to_string().contains("--resume"), "{err}");
    let resumed = rt()
        .block_on(run_rl(
            mk(cut.path()),
            RunOptions {
                resume: true,
                ..Default::default()
            },
        ))
        .unwrap();
    assert_eq!(resumed.steps, 4);
    assert_eq!(comparable(&whole.metrics), comparable(&resumed.metrics));
    let adapter = |d: &Path| std::fs::read(d.join("adapter/adapter_model.safetensors")).unwrap();
    assert_eq!(adapter(full.path()), adapter(cut.path()));
    // The samples log, too, has each step once and as the whole run wrote it.
    let samples = |d: &Path| std::fs::read_to_string(d.join("samples.jsonl")).unwrap();
    assert_eq!(samples(full.path()), samples(cut.path()));
    // Only `keep` checkpoints remain.
    let states: Vec<_> = std::fs::read_dir(cut.path().join("checkpoints/run-1"))
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().starts_with("step-"))
        .collect();
    assert_eq!(states.len(), 2);
}

/// Issue 12: a few rollouts of every step (prompt, completion, reward,
/// env) go to `samples.jsonl` and the last step's into `plots.html`; the
/// evaluation before training is plotted at step 0.
#[test]
fn issue_12_samples_are_logged_and_the_step_0_eval_is_plotted() {
    let d = tempfile::tempdir().unwrap();
    let mut c = tiny_config(d.path(), "");
    c.trainer.max_steps = 2;
    c.log.samples = 3;
    c.eval.num_examples = 2;
    let out = rt().block_on(run_rl(c, RunOptions::default())).unwrap();
    let text = std::fs::read_to_string(d.path().join("samples.jsonl")).unwrap();
    let lines: Vec<Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let steps: Vec<u64> = lines.iter().map(|l| l["step"].as_u64().unwrap()).collect();
    assert_eq!(steps, [1, 1, 1, 2, 2, 2]);
    for l in &lines {
        assert_eq!(l["env"], "graded");
        assert!(l["prompt"].as_str().unwrap().starts_with("echo "), "{l}");
        assert!(l["completion"].is_string() && l["reward"].is_f64(), "{l}");
    }
    // Three distinct prompts (batch_size 2: both groups' first rollouts,
    // then the first group's second).
    assert_eq!(lines[0]["example_id"], lines[2]["example_id"]);
    assert_ne!(lines[0]["example_id"], lines[1]["example_id"]);
    let html = std::fs::read_to_string(d.path().join("plots.html")).unwrap();
    assert!(
        html.contains("Samples of step 2"),
        "the report shows the samples"
    );
    let eval_chart = html.split("<h3>eval/pass@1").nth(1).unwrap();
    assert!(eval_chart.contains("step 0"), "the step-0 eval is plotted");
    assert!(out.eval_before.is_some());
    // metrics.jsonl stays one line per step (the step-0 eval is not one).
    let metrics = std::fs::read_to_string(d.path().join("metrics.jsonl")).unwrap();
    assert_eq!(metrics.lines().count(), 2);

    // `log.samples = 0` writes none.
    let e = tempfile::tempdir().unwrap();
    let mut c = tiny_config(e.path(), "");
    c.trainer.max_steps = 1;
    c.log.samples = 0;
    rt().block_on(run_rl(c, RunOptions::default())).unwrap();
    let text = std::fs::read_to_string(e.path().join("samples.jsonl")).unwrap();
    assert!(text.is_empty());
}

/// Issue 34: a run records itself in run.json (running, then how it
/// ended, with its command line), writes the alerts a step raised into its
/// metrics.jsonl line, and stops only on an alert `[alerts] stop_on` names.
#[test]
fn alerts_are_logged_and_stop_the_run_only_when_stop_on_names_them() {
    use temper_rl::runlog::{read_run_info, RunStatus};
    // Every step's truncation rate is ≥ 0: the rule holds from step 1; the
    // other rules are set so that they cannot hold.
    let alerts = "[alerts]\nwindow = 1\ntruncation_rate = 0.0\nlength_growth = 1e9\n\
                  entropy_collapse = 0.0\nzero_advantage = 2.0\nmismatch = 1e9\n";
    let d = tempfile::tempdir().unwrap();
    let out = rt()
        .block_on(run_rl(tiny_config(d.path(), alerts), RunOptions::default()))
        .unwrap();
    assert_eq!(out.steps, 4, "an alert alone never stops a run");
    let text = std::fs::read_to_string(d.path().join("metrics.jsonl")).unwrap();
    let lines: Vec<Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let first = lines[0]["alerts"]
        .as_array()
        .expect("step 1 raised an alert");
    assert!(
        first[0].as_str().unwrap().starts_with("truncation: "),
        "{first:?}"
    );
    assert!(
        lines[1].get("alerts").is_none(),
        "raised once while it holds"
    );
    let info = read_run_info(d.path()).unwrap().unwrap();
    assert_eq!(
        (info.kind.as_str(), info.status),
        ("rl", RunStatus::Finished)
    );
    assert_eq!(info.pid, std::process::id());
    assert!(!info.command.is_empty() && info.ended.is_some());

    let d = tempfile::tempdir().unwrap();
    let cfg = tiny_config(d.path(), &format!("{alerts}stop_on = [\"truncation\"]\n"));
    let e = rt()
        .block_on(run_rl(cfg, RunOptions::default()))
        .unwrap_err();
    assert!(
        e.to_string().contains("stopped by alert truncation: "),
        "{e}"
    );
    let text = std::fs::read_to_string(d.path().join("metrics.jsonl")).unwrap();
    assert_eq!(
        text.lines().count(),
        1,
        "stopped after the step that raised it"
    );
    let info = read_run_info(d.path()).unwrap().unwrap();
    assert_eq!(info.status, RunStatus::Failed);
    assert!(info.error.unwrap().contains("stopped by alert"));
}
