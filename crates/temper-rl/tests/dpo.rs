//! `temper train dpo` end to end on the tiny Qwen2 fixture: a preference
//! file trained with LoRA (the held-out pairs measured before and after, a
//! run stopped and resumed ending where the uninterrupted one does), full
//! fine-tuning, and online DPO from an environment's reward; the engine's
//! one-pass pair loss against the two-pass recipe a remote trainer gets.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use serde_json::{json, Map, Value};
use temper_engine::{
    AdamParams, Datum, Engine, ForwardOutput, Loss, Sample, StepStats, Trainer, TrainerFuture,
};
use temper_model::{LoadOptions, Pretrained, SamplingParams};
use temper_rl::config::{self, DpoConfig};
use temper_rl::dpo::{self, run_dpo};
use temper_rl::plan::DpoLoss;
use temper_rl::rl::RunOptions;

fn model() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/models/tiny-qwen2")
}

/// Eight text pairs: a colour word is preferred to a number.
fn pairs_file(dir: &Path) -> PathBuf {
    let path = dir.join("prefs.jsonl");
    let rows: String = ["sky", "grass", "sun", "sea", "snow", "coal", "rose", "leaf"]
        .iter()
        .zip([
            "blue", "green", "yellow", "blue", "white", "black", "red", "green",
        ])
        .map(|(thing, colour)| {
            json!({
                "prompt": format!("The colour of the {thing} is"),
                "chosen": format!(" {colour}."),
                "rejected": " 12345.",
            })
            .to_string()
                + "\n"
        })
        .collect();
    std::fs::write(&path, rows).unwrap();
    path
}

fn config(data: &str, run: &Path, extra: &str) -> DpoConfig {
    let text = format!(
        r#"
        seed = 1
        [model]
        path = "{}"
        [lora]
        rank = 4
        alpha = 8.0
        [data]
        {data}
        [dpo]
        beta = 0.1
        [trainer]
        lr = 1e-2
        batch_size = 3
        max_steps = 6
        [eval]
        num_examples = 0
        [ckpt]
        interval = 1
        [log]
        dir = "{}"
        progress = false
        {extra}
        "#,
        model().display(),
        run.display()
    );
    config::resolve(&text, &[]).unwrap()
}

fn num(m: &Map<String, Value>, k: &str) -> f64 {
    m.get(k)
        .and_then(Value::as_f64)
        .unwrap_or_else(|| panic!("no {k} in {m:?}"))
}

#[test]
fn dpo_on_a_file_learns_the_preference_measures_held_out_pairs_and_resumes_exactly() {
    let d = tempfile::tempdir().unwrap();
    let data = format!(
        "path = \"{}\"\neval_fraction = 0.25",
        pairs_file(d.path()).display()
    );
    let rt = tokio::runtime::Runtime::new().unwrap();
    let run = d.path().join("run");
    let out = rt
        .block_on(run_dpo(config(&data, &run, ""), RunOptions::default()))
        .unwrap();
    assert_eq!(out.steps, 6);
    let first = &out.metrics[0];
    // The reference is the starting policy: step 1's log-ratios are 0.
    assert!((num(first, "loss") - std::f64::consts::LN_2).abs() < 1e-5);
    assert_eq!(num(first, "rewards/margins"), 0.0);
    for k in [
        "rewards/chosen",
        "rewards/rejected",
        "rewards/accuracies",
        "logps/chosen",
        "logps/rejected",
        "grad_norm",
    ] {
        num(first, k);
    }
    let last = out.metrics.last().unwrap();
    assert!(num(last, "loss") < 0.5, "{last:?}");
    assert_eq!(num(last, "rewards/accuracies"), 1.0);
    assert!(num(last, "rewards/margins") > 0.5);
    // Two of the eight pairs are held out: measured before and after.
    let before = out.heldout_before.unwrap();
    let after = out.heldout_after.unwrap();
    assert!((num(&before, "eval/loss") - std::f64::consts::LN_2).abs() < 1e-5);
    assert!(
        num(&after, "eval/loss") < num(&before, "eval/loss"),
        "{before:?} {after:?}"
    );
    assert!(num(&after, "eval/rewards/margins") > 0.0);
    assert!(out.output.join("adapter_model.safetensors").exists());
    assert!(run.join("plots.html").exists());

    // Stopped after 3 steps and resumed: the same last step.
    let run2 = d.path().join("run2");
    rt.block_on(run_dpo(
        config(&data, &run2, ""),
        RunOptions {
            resume: false,
            stop_after: Some(3),
        },
    ))
    .unwrap();
    let resumed = rt
        .block_on(run_dpo(
            config(&data, &run2, ""),
            RunOptions {
                resume: true,
                stop_after: None,
            },
        ))
        .unwrap();
    assert_eq!(resumed.steps, 6);
    let a = out.metrics.last().unwrap();
    let b = resumed.metrics.last().unwrap();
    for k in ["loss", "rewards/margins", "logps/chosen"] {
        assert!((num(a, k) - num(b, k)).abs() < 1e-4, "{k}: {a:?} vs {b:?}");
    }
    // Without --resume an existing run is refused.
    let e = rt
        .block_on(run_dpo(config(&data, &run2, ""), RunOptions::default()))
        .unwrap_err();
    assert!(e.to_string().contains("--resume"), "{e}");
}

#[test]
fn dpo_ipo_with_full_fine_tuning_writes_a_model() {
    let d = tempfile::tempdir().unwrap();
    let data = format!("path = \"{}\"", pairs_file(d.path()).display());
    let run = d.path().join("run");
    let mut cfg = config(&data, &run, "");
    cfg.lora.enabled = false;
    cfg.dpo.loss = "ipo".into();
    cfg.dpo.beta = 0.5;
    cfg.trainer.lr = 1e-3;
    cfg.trainer.max_steps = 3;
    let rt = tokio::runtime::Runtime::new().unwrap();
    let out = rt.block_on(run_dpo(cfg, RunOptions::default())).unwrap();
    // ipo at the reference: (0 − 1/(2β))² = 1.
    assert!((num(&out.metrics[0], "loss") - 1.0).abs() < 1e-5);
    assert!(num(out.metrics.last().unwrap(), "loss") < 1.0);
    assert!(out.output.join("model.safetensors").exists());
}

#[test]
fn online_dpo_pairs_the_best_and_worst_of_each_group() {
    let d = tempfile::tempdir().unwrap();
    // A reward that varies on a random model's text: shorter is better.
    let env = d.path().join("env");
    std::fs::create_dir_all(&env).unwrap();
    std::fs::write(
        env.join("env.toml"),
        r#"
name = "short-add"
version = "0.1.0"
[dataset]
generator = "arithmetic"
args = { digits = 1, ops = ["+"] }
[harness]
type = "single-turn"
[[rubric]]
function = "length_penalty"
weight = 1.0
args = { max_chars = 8 }
"#,
    )
    .unwrap();
    let data = format!(
        "env = {{ id = \"{}\" }}\ngroup_size = 4\nmax_tokens = 6",
        env.display()
    );
    let run = d.path().join("run");
    let mut cfg = config(&data, &run, "");
    cfg.trainer.max_steps = 2;
    cfg.trainer.batch_size = 3;
    let rt = tokio::runtime::Runtime::new().unwrap();
    let out = rt.block_on(run_dpo(cfg, RunOptions::default())).unwrap();
    assert_eq!(out.steps, 2);
    let mut trained = 0;
    for m in &out.metrics {
        let pairs = num(m, "pairs") as usize;
        assert_eq!(pairs + num(m, "pairs/skipped") as usize, 3, "{m:?}");
        num(m, "reward/mean");
        assert_eq!(num(m, "rollouts/errors"), 0.0, "{m:?}");
        if pairs > 0 {
            trained += 1;
            // A chosen completion has the higher reward, not necessarily the
            // higher logprob; the loss is DPO's at the reference on step 1.
            num(m, "rewards/accuracies");
        }
    }
    assert!(trained > 0, "{:?}", out.metrics);
    assert!(
        (num(&out.metrics[0], "loss") - std::f64::consts::LN_2).abs() < 1e-5
            || num(&out.metrics[0], "pairs") == 0.0
    );
}

/// examples/smollm2-dpo/dpo.toml on SmolLM2 (minutes):
/// `TEMPER_SMOLLM2_GGUF=$(scripts/fetch_smollm2.sh) cargo test -p temper-rl
/// --test dpo smollm2 -- --ignored --nocapture`. `TEMPER_DPO_QUICK=N` trains
/// on the file's first N pairs (a quarter held out) for 3 steps of 4 pairs,
/// without the environment's evaluation, for a loaded machine.
#[test]
#[ignore = "needs SmolLM2's GGUF (TEMPER_SMOLLM2_GGUF) and minutes of CPU"]
fn smollm2_dpo_example_learns_the_answer_format() {
    let gguf = std::env::var("TEMPER_SMOLLM2_GGUF").expect("TEMPER_SMOLLM2_GGUF");
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    let d = tempfile::tempdir().unwrap();
    let at = |p: &str| root.join(p).display().to_string();
    let overrides = [
        ("model.path", gguf),
        ("data.path", at("examples/smollm2-dpo/prefs.jsonl")),
        ("eval.env", at("examples/smollm2-rl/env")),
        ("log.dir", d.path().join("run").display().to_string()),
    ]
    .map(|(k, v)| (k.to_string(), v));
    let mut cfg: DpoConfig =
        config::load(&root.join("examples/smollm2-dpo/dpo.toml"), &overrides).unwrap();
    if let Ok(n) = std::env::var("TEMPER_DPO_QUICK") {
        let n: usize = n.parse().expect("TEMPER_DPO_QUICK: a number of pairs");
        let text = std::fs::read_to_string(at("examples/smollm2-dpo/prefs.jsonl")).unwrap();
        let subset = d.path().join("prefs.jsonl");
        let lines: Vec<&str> = text.lines().take(n).collect();
        std::fs::write(&subset, lines.join("\n")).unwrap();
        cfg.data.path = Some(subset);
        cfg.data.eval_fraction = 0.25;
        cfg.trainer.batch_size = 4;
        cfg.trainer.max_steps = 3;
        cfg.eval.num_examples = 0;
    }
    let t0 = std::time::Instant::now();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let out = rt.block_on(run_dpo(cfg, RunOptions::default())).unwrap();
    let (before, after) = (out.heldout_before.unwrap(), out.heldout_after.unwrap());
    let pass = |e: &Option<temper_rl::rl::EvalResult>| e.as_ref().map(|e| e.pass_at_1);
    eprintln!(
        "smollm2 dpo: {} steps in {:.0}s; last loss {:.4}, accuracy {:.2}; held-out pairs loss {:.4} -> {:.4}, accuracy {:.2} -> {:.2}, margin {:.3} -> {:.3}; env pass@1 {:?} -> {:?}",
        out.steps,
        t0.elapsed().as_secs_f64(),
        num(&out.last, "loss"),
        num(&out.last, "rewards/accuracies"),
        num(&before, "eval/loss"),
        num(&after, "eval/loss"),
        num(&before, "eval/rewards/accuracies"),
        num(&after, "eval/rewards/accuracies"),
        num(&before, "eval/rewards/margins"),
        num(&after, "eval/rewards/margins"),
        pass(&out.eval_before),
        pass(&out.eval_after),
    );
    assert!(num(&after, "eval/loss") < num(&before, "eval/loss"));
}

/// examples/smollm2-dpo/online.toml on SmolLM2, shortened to 2 steps of 2
/// prompts and no evaluation: `TEMPER_SMOLLM2_GGUF=… cargo test -p
/// temper-rl --test dpo smollm2 -- --ignored --nocapture`.
#[test]
#[ignore = "needs SmolLM2's GGUF (TEMPER_SMOLLM2_GGUF) and minutes of CPU"]
fn smollm2_online_dpo_pairs_sampled_answers() {
    let gguf = std::env::var("TEMPER_SMOLLM2_GGUF").expect("TEMPER_SMOLLM2_GGUF");
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    let d = tempfile::tempdir().unwrap();
    let overrides = [
        ("model.path", gguf),
        (
            "data.env.id",
            root.join("examples/smollm2-rl/env").display().to_string(),
        ),
        ("log.dir", d.path().join("run").display().to_string()),
        ("trainer.max_steps", "2".into()),
        ("trainer.batch_size", "2".into()),
        ("eval.num_examples", "0".into()),
    ]
    .map(|(k, v)| (k.to_string(), v));
    let cfg: DpoConfig =
        config::load(&root.join("examples/smollm2-dpo/online.toml"), &overrides).unwrap();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let out = rt.block_on(run_dpo(cfg, RunOptions::default())).unwrap();
    for m in &out.metrics {
        eprintln!("smollm2 online dpo: {}", Value::Object(m.clone()));
        assert_eq!(num(m, "rollouts/errors"), 0.0);
    }
    assert_eq!(out.steps, 2);
}

/// A trainer that forwards every call to the in-process one, counts the
/// passes, and says it takes a pair loss only when `pair` is set.
struct Counted {
    inner: temper_engine::LocalTrainer,
    pair: bool,
    forwards: AtomicUsize,
    backwards: AtomicUsize,
}

impl Trainer for Counted {
    fn forward(&self, data: Vec<Datum>, loss: Loss) -> TrainerFuture<ForwardOutput> {
        self.forwards.fetch_add(1, Ordering::Relaxed);
        self.inner.forward(data, loss)
    }
    fn forward_backward(&self, data: Vec<Datum>, loss: Loss) -> TrainerFuture<ForwardOutput> {
        self.backwards.fetch_add(1, Ordering::Relaxed);
        self.inner.forward_backward(data, loss)
    }
    fn optim_step(&self, params: AdamParams) -> TrainerFuture<StepStats> {
        self.inner.optim_step(params)
    }
    fn save_weights_for_sampler(&self, name: &str) -> TrainerFuture<String> {
        self.inner.save_weights_for_sampler(name)
    }
    fn sample(
        &self,
        sampler: &str,
        prompt: Vec<u32>,
        n: usize,
        params: SamplingParams,
    ) -> TrainerFuture<Vec<Sample>> {
        self.inner.sample(sampler, prompt, n, params)
    }
    fn compute_logprobs(
        &self,
        sampler: &str,
        tokens: Vec<u32>,
        temperature: f64,
    ) -> TrainerFuture<Vec<f32>> {
        self.inner.compute_logprobs(sampler, tokens, temperature)
    }
    fn takes_pair_loss(&self) -> bool {
        self.pair
    }
    fn save_state(&self, name: &str) -> TrainerFuture<String> {
        self.inner.save_state(name)
    }
    fn load_state(&self, path: &str, with_optimizer: bool) -> TrainerFuture<()> {
        self.inner.load_state(path, with_optimizer)
    }
}

#[tokio::test]
async fn the_engines_pair_loss_is_one_pass_with_the_two_pass_recipes_gradient() {
    let d = tempfile::tempdir().unwrap();
    let base = Arc::new(Pretrained::load(&model(), &LoadOptions::default()).unwrap());
    let pairs = dpo::read_pairs(&pairs_file(d.path()), &base, 1024).unwrap();
    let batch: Vec<&dpo::PrefPair> = pairs.iter().collect();
    let adapter = model().join("../../adapters/tiny-qwen2-lora");
    let trainer = |pair: bool| {
        let engine = Engine::new();
        engine.add_base_model("base", base.clone()).wait().unwrap();
        let run = engine
            .create_lora_run_from_peft("base", adapter.clone())
            .wait()
            .unwrap();
        Counted {
            inner: temper_engine::LocalTrainer::new(engine, run, d.path().join("ckpt")),
            pair,
            forwards: AtomicUsize::new(0),
            backwards: AtomicUsize::new(0),
        }
    };
    for (loss, beta) in [(DpoLoss::Sigmoid, 0.1), (DpoLoss::Ipo, 0.5)] {
        let (one, two) = (trainer(true), trainer(false));
        let refs = dpo::policy_logps(&one, &batch, 16).await.unwrap();
        // A reference away from the policy, so the pairs are not at the
        // loss's symmetric point and their gradients differ.
        let refs: Vec<dpo::PairLogps> = refs
            .iter()
            .enumerate()
            .map(|(i, &(c, r))| (c - 0.3 * i as f64, r + 0.5))
            .collect();
        for t in [&one, &two] {
            t.forwards.store(0, Ordering::Relaxed);
        }
        // 8 pairs, 6 sequences a call: pairs are never split across calls.
        let m1 = dpo::accumulate(&one, loss, beta, &batch, &refs, 6)
            .await
            .unwrap();
        let m2 = dpo::accumulate(&two, loss, beta, &batch, &refs, 6)
            .await
            .unwrap();
        assert_eq!(one.forwards.load(Ordering::Relaxed), 0, "{loss:?}");
        assert_eq!(one.backwards.load(Ordering::Relaxed), 3, "{loss:?}");
        assert_eq!(two.forwards.load(Ordering::Relaxed), 3, "{loss:?}");
        assert_eq!(two.backwards.load(Ordering::Relaxed), 3, "{loss:?}");
        for (k, v) in &m2 {
            let (a, b) = (num(&m1, k), v.as_f64().unwrap());
            assert!(
                (a - b).abs() <= 1e-6 * b.abs().max(1.0),
                "{loss:?} {k}: {a} vs {b}"
            );
        }
        assert!(num(&m1, "loss") > 0.0);
        let g1 = one
            .inner
            .engine()
            .accumulated_grads(one.inner.run_id())
            .await
            .unwrap();
        let g2 = two
            .inner
            .engine()
            .accumulated_grads(two.inner.run_id())
            .await
            .unwrap();
        assert_eq!(g1.len(), g2.len());
        assert!(!g1.is_empty());
        for ((n1, a), (n2, b)) in g1.iter().zip(&g2) {
            assert_eq!(n1, n2);
            let scale = b.iter().fold(0f32, |m, x| m.max(x.abs()));
            assert!(scale > 0.0, "{loss:?} {n1}: zero gradient");
            for (x, y) in a.iter().zip(b) {
                assert!((x - y).abs() <= 1e-4 * scale, "{loss:?} {n1}: {x} vs {y}");
            }
        }
    }
}
