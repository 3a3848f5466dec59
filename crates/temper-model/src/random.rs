//! Random-initialised model directories, for presets, tests and benchmarks.
//!
//! One writer for every caller: `config.json` as given, and
//! `model.safetensors` with every projection drawn from N(0, std²) by a
//! seeded generator (unit norms, as transformers initialises Llama), so the
//! same config and seed always give the same bytes.

use std::collections::HashMap;
use std::path::Path;

use candle_core::{DType, Device, Tensor};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::arch::config::{HfConfig, ModelConfig};
use crate::error::{ModelError, Result};
use crate::lora::Target;

/// How the weights of a random model are drawn.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RandomInit {
    /// Standard deviation of the projections and embeddings.
    pub std: f32,
    /// Seed of the generator.
    pub seed: u64,
}

/// Write a random model into `dir` (created if needed): `config.json`
/// (`config`, pretty-printed) and `model.safetensors`. Returns the validated
/// config.
///
/// Weights are drawn in checkpoint order — the embedding, `lm_head` when the
/// embeddings are not tied, then per layer [`Target::ALL`] — and the norms
/// are ones (as are Qwen3's q/k norms; biases, where the family has them,
/// are zeros).
pub fn write_random_model(
    dir: &Path,
    config: &serde_json::Value,
    init: RandomInit,
) -> Result<ModelConfig> {
    let config_path = dir.join("config.json");
    let hf: HfConfig =
        serde_json::from_value(config.clone()).map_err(|e| ModelError::bad(&config_path, e))?;
    let cfg = hf.validate()?;
    std::fs::create_dir_all(dir).map_err(|e| ModelError::io(dir, e))?;
    let text =
        serde_json::to_string_pretty(config).map_err(|e| ModelError::bad(&config_path, e))?;
    std::fs::write(&config_path, text).map_err(|e| ModelError::io(&config_path, e))?;
    let weights = random_weights(&cfg, init)?;
    candle_core::safetensors::save(&weights, dir.join("model.safetensors"))?;
    Ok(cfg)
}

/// The tensors of a random model of shape `cfg` (f32, on the CPU), named as
/// in a Hugging Face checkpoint.
pub fn random_weights(cfg: &ModelConfig, init: RandomInit) -> Result<HashMap<String, Tensor>> {
    let mut rng = ChaCha8Rng::seed_from_u64(init.seed);
    let mut normal = |rows: usize, cols: usize| -> Result<Tensor> {
        let data: Vec<f32> = (0..rows * cols)
            .map(|_| init.std * gaussian(&mut rng))
            .collect();
        Ok(Tensor::from_vec(data, (rows, cols), &Device::Cpu)?)
    };
    let ones = |n: usize| Tensor::ones(n, DType::F32, &Device::Cpu);
    let (vocab, h) = (cfg.vocab_size, cfg.hidden_size);
    let mut weights: HashMap<String, Tensor> = HashMap::new();
    weights.insert("model.embed_tokens.weight".into(), normal(vocab, h)?);
    if !cfg.tie_word_embeddings {
        weights.insert("lm_head.weight".into(), normal(vocab, h)?);
    }
    for l in 0..cfg.num_layers {
        let p = format!("model.layers.{l}");
        for t in Target::ALL {
            let (o, i) = t.shape(cfg);
            weights.insert(format!("{p}.{}.weight", t.path()), normal(o, i)?);
        }
        // The family's extras, neutral: zero biases, unit q/k norms.
        for (t, on) in [
            (Target::Q, cfg.qkv_bias),
            (Target::K, cfg.qkv_bias),
            (Target::V, cfg.qkv_bias),
            (Target::O, cfg.o_bias),
            (Target::Gate, cfg.mlp_bias),
            (Target::Up, cfg.mlp_bias),
            (Target::Down, cfg.mlp_bias),
        ] {
            if on {
                let out = t.shape(cfg).0;
                weights.insert(
                    format!("{p}.{}.bias", t.path()),
                    Tensor::zeros(out, DType::F32, &Device::Cpu)?,
                );
            }
        }
        if cfg.qk_norm {
            for n in ["q_norm", "k_norm"] {
                weights.insert(format!("{p}.self_attn.{n}.weight"), ones(cfg.head_dim)?);
            }
        }
        weights.insert(format!("{p}.input_layernorm.weight"), ones(h)?);
        weights.insert(format!("{p}.post_attention_layernorm.weight"), ones(h)?);
    }
    weights.insert("model.norm.weight".into(), ones(h)?);
    Ok(weights)
}

/// A standard normal draw (Box–Muller), from a seeded generator so the
/// weights are reproducible.
fn gaussian(rng: &mut impl Rng) -> f32 {
    let u1: f64 = rng.random::<f64>().max(f64::MIN_POSITIVE);
    let u2: f64 = rng.random::<f64>();
    ((-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()) as f32
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(tied: bool) -> serde_json::Value {
        serde_json::json!({
            "model_type": "llama", "hidden_size": 16, "intermediate_size": 32,
            "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
            "vocab_size": 24, "max_position_embeddings": 64, "tie_word_embeddings": tied
        })
    }

    /// Same config and seed ⇒ same bytes; `lm_head` only when untied; the
    /// directory loads through the real checkpoint reader.
    #[test]
    fn a_random_model_is_reproducible_and_loads() {
        let init = RandomInit { std: 0.02, seed: 3 };
        let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let cfg = write_random_model(a.path(), &config(false), init).unwrap();
        write_random_model(b.path(), &config(false), init).unwrap();
        let bytes = |d: &Path| std::fs::read(d.join("model.safetensors")).unwrap();
        assert_eq!(bytes(a.path()), bytes(b.path()));
        let ck = crate::Checkpoint::open(a.path(), DType::F32, &Device::Cpu).unwrap();
        crate::Model::load(&cfg, &ck, DType::F32, &Device::Cpu).unwrap();
        let hf: HfConfig = serde_json::from_value(config(true)).unwrap();
        let tied = random_weights(&hf.validate().unwrap(), init).unwrap();
        assert!(!tied.contains_key("lm_head.weight"));
    }
}
