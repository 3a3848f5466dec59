//! DPO against TRL's `DPOTrainer` (fixtures/golden/dpo.json, written by
//! scripts/make_dpo_goldens.py): on the tiny Qwen2 fixture with its PEFT
//! adapter, the same preference rows in TRL's text and conversational
//! formats tokenize to TRL's tokens, and the first step's loss, metrics and
//! LoRA gradients, and — after one AdamW step with torch's settings — the
//! second step's loss and metrics, are TRL's within f32 tolerance.

use std::path::PathBuf;
use std::sync::Arc;

use serde_json::Value;
use temper_engine::{AdamParams, Engine, LocalTrainer, Trainer};
use temper_model::{LoadOptions, Pretrained};
use temper_rl::dpo::{self, PrefPair};
use temper_rl::plan::DpoLoss;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

const METRICS: [&str; 7] = [
    "loss",
    "rewards/chosen",
    "rewards/rejected",
    "rewards/margins",
    "rewards/accuracies",
    "logps/chosen",
    "logps/rejected",
];

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

fn close(what: &str, ours: f64, trl: f64, tol: f64) {
    assert!(
        (ours - trl).abs() <= tol * trl.abs().max(1.0),
        "{what}: temper {ours}, TRL {trl}"
    );
}

#[tokio::test]
async fn dpo_matches_trl_dpo_trainer_loss_metrics_and_lora_gradients() {
    let golden: Value = serde_json::from_str(
        &std::fs::read_to_string(root().join("fixtures/golden/dpo.json")).unwrap(),
    )
    .unwrap();
    let base = Arc::new(
        Pretrained::load(
            &root().join("fixtures/models/tiny-qwen2"),
            &LoadOptions::default(),
        )
        .unwrap(),
    );
    let opt = &golden["optimizer"];
    let mut grads_checked = 0;
    for case in golden["cases"].as_array().unwrap() {
        let name = case["name"].as_str().unwrap();
        let dir = tempfile::tempdir().unwrap();
        let data = dir.path().join("pairs.jsonl");
        let lines: Vec<String> = case["rows"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| r.to_string())
            .collect();
        std::fs::write(&data, lines.join("\n")).unwrap();
        let pairs = dpo::read_pairs(&data, &base, 1024).unwrap();
        for (i, (p, t)) in pairs
            .iter()
            .zip(case["tokens"].as_array().unwrap())
            .enumerate()
        {
            let want = PrefPair {
                prompt: ids(&t["prompt"]),
                chosen: ids(&t["chosen"]),
                rejected: ids(&t["rejected"]),
            };
            assert_eq!(p, &want, "{name}: pair {i} tokenizes unlike TRL");
        }
        let loss = match case["loss_type"].as_str().unwrap() {
            "sigmoid" => DpoLoss::Sigmoid,
            "ipo" => DpoLoss::Ipo,
            other => panic!("loss {other}"),
        };
        let beta = case["beta"].as_f64().unwrap();

        let engine = Engine::new();
        engine.add_base_model("base", base.clone()).wait().unwrap();
        let run = engine
            .create_lora_run_from_peft("base", root().join("fixtures/adapters/tiny-qwen2-lora"))
            .wait()
            .unwrap();
        let trainer = LocalTrainer::new(engine, run.clone(), dir.path().join("ckpt"));
        let batch: Vec<&PrefPair> = pairs.iter().collect();
        let micro = 2 * batch.len();
        // TRL's reference for a loaded adapter: a frozen copy of it.
        let refs = dpo::policy_logps(&trainer, &batch, micro).await.unwrap();

        let m1 = dpo::accumulate(&trainer, loss, beta, &batch, &refs, micro)
            .await
            .unwrap();
        for k in METRICS {
            close(
                &format!("{name} step 1 {k}"),
                m1[k].as_f64().unwrap(),
                case["step1"][k].as_f64().unwrap(),
                1e-5,
            );
        }
        let want = case["grads"].as_object().unwrap();
        if !want.is_empty() {
            let ours = trainer.engine().accumulated_grads(&run).await.unwrap();
            let names: Vec<&String> = ours.iter().map(|(n, _)| n).collect();
            let mut trl_names: Vec<&String> = want.keys().collect();
            trl_names.sort();
            assert_eq!(names, trl_names, "{name}: LoRA tensors");
            for (n, g) in &ours {
                let w: Vec<f64> = want[n]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|x| x.as_f64().unwrap())
                    .collect();
                assert_eq!(g.len(), w.len(), "{name} {n}");
                let scale = w.iter().fold(0f64, |a, x| a.max(x.abs()));
                assert!(scale > 0.0, "{name} {n}: TRL's gradient is zero");
                for (j, (a, b)) in g.iter().zip(&w).enumerate() {
                    assert!(
                        (*a as f64 - b).abs() <= 1e-4 * scale + 1e-7,
                        "{name} {n}[{j}]: temper {a}, TRL {b} (largest |g| {scale})"
                    );
                }
                grads_checked += 1;
            }
        }
        trainer
            .optim_step(AdamParams {
                learning_rate: opt["lr"].as_f64().unwrap(),
                beta1: opt["beta1"].as_f64().unwrap(),
                beta2: opt["beta2"].as_f64().unwrap(),
                eps: opt["eps"].as_f64().unwrap(),
                weight_decay: opt["weight_decay"].as_f64().unwrap(),
                grad_clip_norm: opt["grad_clip"].as_f64().unwrap(),
            })
            .await
            .unwrap();
        let m2 = dpo::accumulate(&trainer, loss, beta, &batch, &refs, micro)
            .await
            .unwrap();
        for k in METRICS {
            close(
                &format!("{name} step 2 {k}"),
                m2[k].as_f64().unwrap(),
                case["step2"][k].as_f64().unwrap(),
                1e-4,
            );
        }
    }
    assert!(grads_checked >= 20, "{grads_checked} gradients compared");
}
