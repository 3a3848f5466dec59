//! SFT end to end on a tiny model, and distilling eval results into SFT data.

use serde_json::{json, Value};
use temper_model::{GenerationRequest, LoadOptions, Pretrained, Sampler, SamplingParams};
use temper_rl::config::{self, SftConfig};
use temper_rl::rl::RunOptions;
use temper_rl::sft::{run_sft, successful_rollouts};

#[test]
fn sft_memorises_assistant_turns_and_exports_a_loadable_model() {
    let d = tempfile::tempdir().unwrap();
    let data = d.path().join("chat.jsonl");
    let rows: String = ["red", "blue"]
        .iter()
        .map(|c| {
            json!({"messages": [
                {"role": "user", "content": format!("color {c}?")},
                {"role": "assistant", "content": format!("<c>{c}</c>")}
            ]})
            .to_string()
                + "\n"
        })
        .collect();
    std::fs::write(&data, rows).unwrap();
    let text = format!(
        r#"
        [model]
        preset = "tiny"
        [model.tiny]
        hidden_size = 64
        num_layers = 2
        num_heads = 2
        num_kv_heads = 1
        intermediate_size = 128
        [lora]
        enabled = false
        [data]
        path = "{}"
        [trainer]
        lr = 3e-3
        batch_size = 2
        max_steps = 60
        [ckpt]
        interval = 0
        [log]
        dir = "{}"
        progress = false
        "#,
        data.display(),
        d.path().join("run").display()
    );
    let cfg: SftConfig = config::resolve(&text, &[]).unwrap();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let out = rt.block_on(run_sft(cfg, RunOptions::default())).unwrap();
    assert_eq!(out.steps, 60);
    let losses: Vec<f64> = out
        .metrics
        .iter()
        .map(|m| m["loss"].as_f64().unwrap())
        .collect();
    assert!(
        losses[59] < 0.1 * losses[0],
        "loss {} -> {}",
        losses[0],
        losses[59]
    );
    // The exported directory is a model like any other: it answers greedily
    // with what it was trained on.
    let p = Pretrained::load(&out.output, &LoadOptions::default()).unwrap();
    let tpl = p.chat_template.as_ref().unwrap();
    let prompt = tpl
        .render(
            &json!([{"role": "user", "content": "color blue?"}]),
            None,
            true,
            &Default::default(),
        )
        .unwrap();
    let ids = p.tokenizer.encode(&prompt, false).unwrap();
    let s = Sampler::new(&p.model, &p.tokenizer, p.generation.eos_token_ids.clone());
    let c = s
        .generate(
            &[GenerationRequest {
                prompt: ids,
                n: 1,
                params: SamplingParams {
                    max_tokens: 16,
                    temperature: 0.0,
                    ..Default::default()
                },
            }],
            None,
        )
        .unwrap();
    assert_eq!(c[0][0].text, "<c>blue</c>");
    assert!(d.path().join("run/plots.html").exists());
}

#[test]
fn generate_sft_keeps_successful_rollouts_only() {
    let d = tempfile::tempdir().unwrap();
    let p = d.path().join("results.jsonl");
    let line = |reward: f64, error: Value| {
        json!({"example_id": 0, "prompt": [{"role": "user", "content": "q"}],
               "completion": [{"role": "assistant", "content": "a"}],
               "reward": reward, "error": error})
        .to_string()
    };
    std::fs::write(
        &p,
        format!(
            "{}\n{}\n{}\n{{\"torn",
            line(1.0, Value::Null),
            line(0.0, Value::Null),
            line(1.0, json!("timeout"))
        ),
    )
    .unwrap();
    let (rows, read) = successful_rollouts(&p, 1.0).unwrap();
    assert_eq!(read, 3);
    assert_eq!(rows.len(), 1);
    assert_eq!(rows[0]["messages"][1]["content"], "a");
}

/// Issue 12: SFT evaluates on `[eval]` (its dry run showed `[eval]`, but it
/// ran none): before training, every `eval.interval` steps and at the end,
/// on the data's environment by default; plotted from step 0.
#[test]
fn issue_12_sft_evaluates_on_the_eval_section() {
    let d = tempfile::tempdir().unwrap();
    let run = d.path().join("run");
    let text = format!(
        r#"
        [model]
        preset = "tiny"
        [model.tiny]
        hidden_size = 32
        num_layers = 1
        num_heads = 2
        num_kv_heads = 1
        intermediate_size = 64
        [lora]
        rank = 2
        [data]
        env = {{ id = "arithmetic", args = {{ digits = 1 }} }}
        answer_format = "{{answer}}"
        [trainer]
        batch_size = 2
        max_steps = 4
        [eval]
        num_examples = 3
        interval = 2
        [ckpt]
        interval = 0
        [log]
        dir = "{}"
        progress = false
        "#,
        run.display()
    );
    let cfg: SftConfig = config::resolve(&text, &[]).unwrap();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let out = rt.block_on(run_sft(cfg, RunOptions::default())).unwrap();
    let before = out.eval_before.expect("an evaluation before training");
    let after = out.eval_after.expect("an evaluation after training");
    assert_eq!((before.step, before.n), (0, 3));
    assert_eq!((after.step, after.n), (4, 3));
    for step in [0, 2, 4] {
        let dir = run.join(format!("evals/step-{step:06}"));
        assert!(dir.join("results.jsonl").is_file(), "{}", dir.display());
    }
    let evaluated: Vec<u64> = out
        .metrics
        .iter()
        .filter(|m| m.contains_key("eval/pass@1") && m.contains_key("eval/reward"))
        .map(|m| m["step"].as_u64().unwrap())
        .collect();
    assert_eq!(evaluated, [2, 4]);
    let html = std::fs::read_to_string(run.join("plots.html")).unwrap();
    let chart = html.split("eval/pass@1").nth(1).unwrap();
    assert!(chart.contains("step 0"), "the step-0 evaluation is plotted");

    // A file dataset names no environment: no evaluation, as before.
    let data = d.path().join("chat.jsonl");
    std::fs::write(
        &data,
        json!({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]})
            .to_string()
            + "\n",
    )
    .unwrap();
    let text = text
        .replace(
            "env = { id = \"arithmetic\", args = { digits = 1 } }\n        answer_format = \"{answer}\"",
            &format!("path = \"{}\"", data.display()),
        )
        .replace(&run.display().to_string(), &d.path().join("run2").display().to_string());
    let cfg: SftConfig = config::resolve(&text, &[]).unwrap();
    let out = rt.block_on(run_sft(cfg, RunOptions::default())).unwrap();
    assert!(out.eval_before.is_none() && out.eval_after.is_none());
}

/// Issue 12: SFT checkpoints in the RL loop's format — a stopped run resumes
/// to the uninterrupted run's losses and weights — and keeps only
/// `ckpt.keep` checkpoints (it kept them all).
#[test]
fn sft_resumes_from_its_checkpoint_and_keeps_ckpt_keep_of_them() {
    let d = tempfile::tempdir().unwrap();
    let data = d.path().join("chat.jsonl");
    let rows: String = ["red", "blue", "green"]
        .iter()
        .map(|c| {
            json!({"messages": [
                {"role": "user", "content": format!("color {c}?")},
                {"role": "assistant", "content": format!("<c>{c}</c>")}
            ]})
            .to_string()
                + "\n"
        })
        .collect();
    std::fs::write(&data, rows).unwrap();
    let cfg = |run: &str| -> SftConfig {
        let text = format!(
            r#"
            seed = 2
            [model]
            preset = "tiny"
            [model.tiny]
            hidden_size = 32
            num_layers = 1
            num_heads = 2
            num_kv_heads = 1
            intermediate_size = 64
            [lora]
            rank = 4
            [data]
            path = "{}"
            [trainer]
            lr = 1e-2
            batch_size = 2
            max_steps = 6
            [ckpt]
            interval = 1
            keep = 2
            [log]
            dir = "{}"
            progress = false
            "#,
            data.display(),
            d.path().join(run).display()
        );
        config::resolve(&text, &[]).unwrap()
    };
    let rt = tokio::runtime::Runtime::new().unwrap();
    let whole = rt
        .block_on(run_sft(cfg("whole"), RunOptions::default()))
        .unwrap();
    let stop = RunOptions {
        stop_after: Some(4),
        ..Default::default()
    };
    let cut = rt.block_on(run_sft(cfg("cut"), stop)).unwrap();
    assert_eq!(cut.steps, 4);
    let resume = RunOptions {
        resume: true,
        ..Default::default()
    };
    let resumed = rt.block_on(run_sft(cfg("cut"), resume)).unwrap();
    assert_eq!(resumed.steps, 6);
    let losses = |m: &[serde_json::Map<String, Value>]| -> Vec<f64> {
        m.iter().map(|r| r["loss"].as_f64().unwrap()).collect()
    };
    assert_eq!(losses(&whole.metrics), losses(&resumed.metrics));
    let adapter = |run: &str| {
        std::fs::read(d.path().join(run).join("adapter/adapter_model.safetensors")).unwrap()
    };
    assert_eq!(adapter("whole"), adapter("cut"));
    let latest: Value = serde_json::from_str(
        &std::fs::read_to_string(d.path().join("cut/checkpoints/latest.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(latest["step"], 6);
    let state = std::path::PathBuf::from(latest["state_path"].as_str().unwrap());
    let kept = std::fs::read_dir(state.parent().unwrap())
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().starts_with("step-"))
        .count();
    assert_eq!(kept, 2, "ckpt.keep = 2");
}

/// Issue 39: the `epoch` metric counts passes over an environment's
/// training rows too (it stayed 0: the rows are drawn all at once). Three
/// distinct questions, two per step: step k's first example is example
/// 2(k−1), in pass ⌊2(k−1)/3⌋ — even with teacher noise changing answers.
#[test]
fn sft_from_an_environment_counts_epochs_over_its_distinct_rows() {
    let d = tempfile::tempdir().unwrap();
    let env = d.path().join("env");
    std::fs::create_dir_all(&env).unwrap();
    let rows: String = (1..=3)
        .map(|i| {
            json!({"question": format!("{i} + 1?"), "answer": format!("{}", i + 1)}).to_string()
                + "\n"
        })
        .collect();
    std::fs::write(env.join("train.jsonl"), rows).unwrap();
    std::fs::write(
        env.join("eval.jsonl"),
        json!({"question": "9 + 1?", "answer": "10"}).to_string() + "\n",
    )
    .unwrap();
    std::fs::write(
        env.join("env.toml"),
        "name = \"three\"\n[dataset]\ntrain = \"train.jsonl\"\neval = \"eval.jsonl\"\n\
         [parser]\ntype = \"plain\"\n[[rubric]]\nfunction = \"exact_match\"\nweight = 1.0\n",
    )
    .unwrap();
    let text = format!(
        r#"
        [model]
        preset = "tiny"
        [model.tiny]
        hidden_size = 32
        num_layers = 1
        num_heads = 2
        num_kv_heads = 1
        intermediate_size = 64
        [lora]
        rank = 2
        [data]
        env = {{ id = "{}" }}
        answer_format = "{{answer}}"
        teacher_noise = 0.5
        [trainer]
        batch_size = 2
        max_steps = 6
        [eval]
        num_examples = 0
        [ckpt]
        interval = 0
        [log]
        dir = "{}"
        progress = false
        "#,
        env.display(),
        d.path().join("run").display()
    );
    let cfg: SftConfig = config::resolve(&text, &[]).unwrap();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let out = rt.block_on(run_sft(cfg, RunOptions::default())).unwrap();
    let epochs: Vec<u64> = out
        .metrics
        .iter()
        .map(|m| m["epoch"].as_u64().unwrap())
        .collect();
    assert_eq!(epochs, [0, 0, 1, 2, 2, 3]);
}
