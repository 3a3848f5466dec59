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
    LoraAdapter::load_peft(
        &root().join("adapters").join(format!("{name}-lora")),
        &p.config,
        p.model.dtype(),
        p.model.device(),
    )
    .expect("adapter loads")
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

/// The quantized GGUF formats the matmul reads as blocks (`--dtype gguf`).
pub const QUANT_FORMATS: [temper_model::GgufQuant; 3] = [
    temper_model::GgufQuant::Q8_0,
    temper_model::GgufQuant::Q4_0,
    temper_model::GgufQuant::Q4_1,
];

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
        let base = load(name);
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
