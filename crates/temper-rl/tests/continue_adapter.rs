//! `[model] adapter = "DIR"`: training continues from a PEFT-written adapter,
//! with its rank / alpha / targets, and step 0 computes exactly the adapter's
//! logprobs — checked against transformers + PEFT on the same adapter
//! (`fixtures/golden`, made by `scripts/make_fixtures.py`).

use std::path::PathBuf;

use temper_engine::{Datum, Loss, LossInputs};
use temper_model::candle_core::{Device, D};
use temper_rl::config::RlConfig;
use temper_rl::rl::local_trainer;

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures")
}

fn config(adapter: &std::path::Path, lora_enabled: bool) -> RlConfig {
    let toml = format!(
        "[model]\npath = {:?}\nadapter = {:?}\n[lora]\nenabled = {lora_enabled}\nrank = 3\nalpha = 1.0\n",
        fixtures().join("models/tiny-qwen2").display().to_string(),
        adapter.display().to_string(),
    );
    temper_rl::config::resolve(&toml, &[]).expect("config")
}

#[test]
fn continuing_from_a_peft_adapter_starts_at_its_logprobs() {
    let adapter = fixtures().join("adapters/tiny-qwen2-lora");
    let cfg = config(&adapter, true);
    let dir = tempfile::tempdir().expect("tmp");
    let (_base, trainer) = local_trainer(&cfg.model, &cfg.lora, 0, dir.path()).expect("trainer");
    let golden: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(fixtures().join("golden/tiny-qwen2.json")).expect("golden"),
    )
    .expect("json");
    let tensors = temper_model::candle_core::safetensors::load(
        fixtures().join("golden/tiny-qwen2.safetensors"),
        &Device::Cpu,
    )
    .expect("golden tensors");
    let inputs = golden["inputs"].as_array().expect("inputs");
    let data: Vec<Datum> = inputs
        .iter()
        .map(|v| {
            let ids: Vec<u32> = v
                .as_array()
                .expect("ids")
                .iter()
                .map(|x| x.as_u64().expect("id") as u32)
                .collect();
            Datum {
                model_input: ids[..ids.len() - 1].to_vec(),
                loss_fn_inputs: LossInputs {
                    target_tokens: ids[1..].to_vec(),
                    ..Default::default()
                },
            }
        })
        .collect();
    let out = trainer
        .engine()
        .forward(trainer.run_id(), data.clone(), Loss::CrossEntropy)
        .wait()
        .expect("forward");
    for (i, (d, o)) in data.iter().zip(&out.loss_fn_outputs).enumerate() {
        // transformers + PEFT logits of the full input; logprob of each next token.
        let logits = &tensors[&format!("lora_logits.{i}")];
        let max = logits.max_keepdim(D::Minus1).unwrap();
        let shifted = logits.broadcast_sub(&max).unwrap();
        let lse = shifted
            .exp()
            .unwrap()
            .sum_keepdim(D::Minus1)
            .unwrap()
            .log()
            .unwrap();
        let logp = shifted
            .broadcast_sub(&lse)
            .unwrap()
            .to_vec2::<f32>()
            .unwrap();
        for (t, (&target, &ours)) in d
            .loss_fn_inputs
            .target_tokens
            .iter()
            .zip(&o.logprobs)
            .enumerate()
        {
            let theirs = logp[t][target as usize];
            assert!(
                (ours - theirs).abs() <= 1e-4,
                "input {i} position {t}: logprob {ours} vs transformers+PEFT {theirs}"
            );
        }
    }
    // The base alone differs: the adapter really is in use.
    let base_logits = &tensors["logits.0"];
    let lora_logits = &tensors["lora_logits.0"];
    let diff = (base_logits - lora_logits)
        .unwrap()
        .abs()
        .unwrap()
        .max_all()
        .unwrap();
    assert!(diff.to_scalar::<f32>().unwrap() > 1e-3);
}

#[test]
fn an_adapter_without_lora_enabled_is_a_config_error() {
    let adapter = fixtures().join("adapters/tiny-qwen2-lora");
    let cfg = config(&adapter, false);
    let dir = tempfile::tempdir().expect("tmp");
    let err = local_trainer(&cfg.model, &cfg.lora, 0, dir.path())
        .err()
        .expect("rejected");
    assert!(err.to_string().contains("adapter"), "{err}");
}
