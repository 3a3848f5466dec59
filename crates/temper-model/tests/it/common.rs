//! Fixture helpers shared by the integration tests.
#![allow(dead_code)]

use std::collections::HashMap;
use std::path::PathBuf;

use temper_model::candle_core::{Device, Tensor};
use temper_model::{LoadOptions, LoraAdapter, Pretrained};

pub const FAMILIES: [&str; 3] = ["tiny-llama", "tiny-qwen2", "tiny-qwen3"];

pub fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures")
}

pub fn load(name: &str) -> Pretrained {
    load_as(name, temper_model::Precision::F32)
}

/// A fixture with its matmul weights in `precision`.
pub fn load_as(name: &str, precision: temper_model::Precision) -> Pretrained {
    let opts = LoadOptions {
        precision,
        ..LoadOptions::default()
    };
    Pretrained::load(&root().join("models").join(name), &opts)
        .unwrap_or_else(|e| panic!("loading {name}: {e}"))
}

pub fn golden(name: &str) -> (serde_json::Value, HashMap<String, Tensor>) {
    let dir = root().join("golden");
    let json: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(dir.join(format!("{name}.json"))).expect("golden json"),
    )
    .expect("valid json");
    let tensors = temper_model::candle_core::safetensors::load(
        dir.join(format!("{name}.safetensors")),
        &Device::Cpu,
    )
    .expect("golden tensors");
    (json, tensors)
}

pub fn adapter(p: &Pretrained, name: &str) -> LoraAdapter {
    if name.starts_with("wide-") {
        return random_adapter(p);
    }
    LoraAdapter::load_peft(
        &root().join("adapters").join(format!("{name}-lora")),
        &p.config,
        p.model.dtype(),
        p.model.device(),
    )
    .expect("adapter loads")
}

/// A rank-4 adapter on every target with random `A` and `B` (a fresh
/// adapter's `B` is 0, which would leave `A` without gradients).
pub fn random_adapter(p: &Pretrained) -> LoraAdapter {
    let cfg = temper_model::LoraConfig {
        rank: 4,
        alpha: 8.0,
        ..Default::default()
    };
    let a =
        LoraAdapter::new(&p.config, cfg, 3, p.model.dtype(), p.model.device()).expect("adapter");
    for (i, (n, v)) in a.named_vars().into_iter().enumerate() {
        if n.contains("lora_B") {
            let (rows, cols) = v.as_tensor().dims2().expect("matrix");
            let vals: Vec<f32> = (0..rows * cols)
                .map(|j| (((j * 31 + i * 17) % 23) as f32 - 11.0) * 0.01)
                .collect();
            let t = Tensor::from_vec(vals, (rows, cols), p.model.device()).expect("tensor");
            v.set(&t.to_dtype(p.model.dtype()).expect("dtype"))
                .expect("set");
        }
    }
    a
}

pub fn ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array()
        .expect("id list")
        .iter()
        .map(|x| x.as_u64().expect("id") as u32)
        .collect()
}

pub fn logits_of(p: &Pretrained, input: &[u32], lora: Option<&LoraAdapter>) -> Tensor {
    let mut segs = [temper_model::Segment {
        len: input.len(),
        cache: None,
    }];
    let h = p
        .model
        .forward_hidden(input, &mut segs, lora)
        .expect("forward");
    p.model.logits(&h).expect("logits")
}

/// max |a - b| / max |b|
pub fn rel_err(a: &Tensor, b: &Tensor) -> f32 {
    let diff = (a - b)
        .expect("same shape")
        .abs()
        .unwrap()
        .max_all()
        .unwrap();
    let scale = b.abs().unwrap().max_all().unwrap();
    diff.to_scalar::<f32>().unwrap() / scale.to_scalar::<f32>().unwrap()
}

/// Each sequence as training input: tokens `[..n-1]`, targets `[1..]`.
pub fn next_token_inputs(seqs: &[Vec<u32>]) -> Vec<temper_model::ScoreInput<'_>> {
    seqs.iter()
        .map(|s| temper_model::ScoreInput {
            input: &s[..s.len() - 1],
            targets: &s[1..],
        })
        .collect()
}

/// The GGUF exports every `--dtype gguf` test runs, as (model, type): each
/// block format the matmul keeps ([`temper_model::QuantFormat`]). The
/// fixtures' rows (64, 128 values) take the 32-value formats; K-quants need
/// rows of 256, so they run on the `wide-*` random models ([`wide_model`]):
/// Q4_K_M gives Q4_K and Q6_K matrices, Q5_K every matrix in Q5_K.
pub const QUANT_CASES: [(&str, temper_model::GgufQuant); 13] = {
    use temper_model::GgufQuant::*;
    [
        ("tiny-llama", Q8_0),
        ("tiny-qwen2", Q8_0),
        ("tiny-qwen3", Q8_0),
        ("tiny-llama", Q4_0),
        ("tiny-qwen2", Q4_0),
        ("tiny-qwen3", Q4_0),
        ("tiny-llama", Q4_1),
        ("tiny-qwen2", Q4_1),
        ("tiny-qwen3", Q4_1),
        ("tiny-qwen2", Q5_0),
        ("tiny-llama", Q5_1),
        ("wide-llama", Q4KM),
        ("wide-qwen3", Q5K),
    ]
};

/// The fixture a `wide-*` model is built from (its tokenizer, family and
/// golden inputs); any other name is its own.
pub fn base_fixture(name: &str) -> String {
    match name.strip_prefix("wide-") {
        Some(family) => format!("tiny-{family}"),
        None => name.to_string(),
    }
}

/// The golden inputs of `name` (its base fixture's for a `wide-*` model).
pub fn golden_inputs(name: &str) -> Vec<Vec<u32>> {
    let (g, _) = golden(&base_fixture(name));
    g["inputs"]
        .as_array()
        .expect("inputs")
        .iter()
        .map(ids)
        .collect()
}

/// `wide-<family>`: the fixture `tiny-<family>` (tokenizer, vocabulary,
/// family) with 256-wide random weights — hidden 256, MLP 512, head
/// dimension 64 — written once per test process under the target directory
/// (rewritten each run, so a change to the writer is never read stale).
pub fn wide_model(name: &str) -> PathBuf {
    static WRITTEN: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());
    let base = root().join("models").join(base_fixture(name));
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(name);
    let mut written = WRITTEN.lock().unwrap_or_else(|e| e.into_inner());
    if written.iter().any(|n| n == name) {
        return dir;
    }
    written.push(name.to_string());
    std::fs::create_dir_all(&dir).expect("wide model dir");
    for entry in std::fs::read_dir(&base).expect("fixture dir") {
        let path = entry.expect("entry").path();
        let file = path.file_name().expect("name").to_owned();
        if file != "config.json" && file != "model.safetensors" {
            std::fs::copy(&path, dir.join(file)).expect("copy fixture file");
        }
    }
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(base.join("config.json")).expect("config"))
            .expect("config json");
    for (k, v) in [
        ("hidden_size", 256),
        ("intermediate_size", 512),
        ("head_dim", 64),
        ("num_attention_heads", 4),
        ("num_key_value_heads", 2),
    ] {
        config[k] = v.into();
    }
    temper_model::write_random_model(
        &dir,
        &config,
        temper_model::RandomInit { std: 0.05, seed: 7 },
    )
    .expect("wide model");
    dir
}

/// The fixture `name` exported to a `quant` GGUF file in `dir` (once), loaded
/// back with `precision`: `gguf` keeps its blocks, `f32` dequantizes them.
pub fn load_quantized(
    name: &str,
    quant: temper_model::GgufQuant,
    dir: &std::path::Path,
    precision: temper_model::Precision,
) -> Pretrained {
    let path = dir.join(format!("{name}-{quant:?}.gguf"));
    if !path.exists() {
        let base = if name.starts_with("wide-") {
            Pretrained::load(&wide_model(name), &LoadOptions::default())
                .unwrap_or_else(|e| panic!("loading {name}: {e}"))
        } else {
            load(name)
        };
        temper_model::save_gguf(&base, &base.model, &path, quant).expect("export gguf");
    }
    let opts = LoadOptions {
        precision,
        ..LoadOptions::default()
    };
    let p =
        Pretrained::load(&path, &opts).unwrap_or_else(|e| panic!("loading {name} {quant:?}: {e}"));
    assert_eq!(
        p.model.is_quantized(),
        precision == temper_model::Precision::Gguf,
        "{name} {quant:?} {precision}"
    );
    p
}

/// A DPO batch: after one system prompt, pairs of a question and two
/// completions (token ids below `vocab`). The last pair's completions share
/// their first 3 tokens.
pub fn preference_pairs(vocab: u32) -> (Vec<Vec<u32>>, Vec<usize>) {
    let system: Vec<u32> = (0..30).map(|i| (7 * i + 3) % vocab).collect();
    let mut seqs = Vec::new();
    let mut prompt_lens = Vec::new();
    for p in 0..4u32 {
        let question: Vec<u32> = (0..9 + p).map(|i| (11 * i + 5 * p + 1) % vocab).collect();
        let prompt = [&system[..], &question[..]].concat();
        for side in 0..2u32 {
            let start: Vec<u32> = if p == 3 { vec![4, 4, 4] } else { Vec::new() };
            let own = (0..3 + 2 * p + side).map(|i| (13 * i + 17 * side + 3 * p + 2) % vocab);
            seqs.push([&prompt[..], &start[..], &own.collect::<Vec<_>>()[..]].concat());
            prompt_lens.push(prompt.len());
        }
    }
    (seqs, prompt_lens)
}
