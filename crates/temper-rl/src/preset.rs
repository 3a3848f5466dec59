//! A tiny model built from nothing: random-initialised Llama-architecture
//! weights, a character-level tokenizer and a ChatML chat template, written
//! as an ordinary Hugging Face directory.
//!
//! Nothing here is special-cased downstream: the directory loads through
//! [`temper_model::Pretrained::load`] like any downloaded checkpoint, and
//! `transformers.AutoModelForCausalLM` / `AutoTokenizer` read it too
//! (`WordLevel` model, one-character `Split` pre-tokenizer, `Fuse` decoder).
//!
//! ```no_run
//! # fn main() -> temper_rl::Result<()> {
//! let dir = std::path::Path::new("runs/tiny");
//! temper_rl::preset::TinyPreset::default().write(dir, 0)?;
//! # Ok(()) }
//! ```

use std::path::Path;

use serde_json::json;
use temper_model::RandomInit;

use crate::error::{Result, RlError};

/// Special tokens, in vocabulary order (ids 0..).
pub const SPECIAL_TOKENS: [&str; 4] = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>"];

/// ChatML without a default system prompt: every character of the prompt is
/// a token for this tokenizer, so it stays short.
pub const CHAT_TEMPLATE: &str = "{%- for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}{%- endfor %}{%- if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{%- endif %}";

/// Sizes of the tiny model.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TinyPreset {
    /// Hidden size.
    pub hidden_size: usize,
    /// Decoder layers.
    pub num_layers: usize,
    /// Attention heads (head_dim = hidden_size / heads).
    pub num_heads: usize,
    /// Key/value heads (grouped-query attention when fewer than heads).
    pub num_kv_heads: usize,
    /// MLP inner size.
    pub intermediate_size: usize,
    /// Longest sequence.
    pub max_position_embeddings: usize,
}

impl Default for TinyPreset {
    fn default() -> Self {
        Self {
            hidden_size: 128,
            num_layers: 4,
            num_heads: 4,
            num_kv_heads: 2,
            intermediate_size: 384,
            max_position_embeddings: 512,
        }
    }
}

impl TinyPreset {
    /// The smallest model the tests train (one layer, hidden size 32,
    /// 256 positions): a step takes milliseconds.
    pub fn smallest() -> Self {
        Self {
            hidden_size: 32,
            num_layers: 1,
            num_heads: 2,
            num_kv_heads: 1,
            intermediate_size: 64,
            max_position_embeddings: 256,
        }
    }
}

/// The character vocabulary after the special tokens: `\n` and printable ASCII.
pub fn vocabulary() -> Vec<String> {
    let mut v: Vec<String> = SPECIAL_TOKENS.iter().map(|s| s.to_string()).collect();
    v.push("\n".into());
    for c in 32u8..127 {
        v.push((c as char).to_string());
    }
    v
}

/// `tokenizer.json` for the character vocabulary.
pub fn tokenizer_json() -> serde_json::Value {
    let vocab = vocabulary();
    let map: serde_json::Map<String, serde_json::Value> = vocab
        .iter()
        .enumerate()
        .map(|(i, t)| (t.clone(), json!(i)))
        .collect();
    let added: Vec<serde_json::Value> = SPECIAL_TOKENS
        .iter()
        .enumerate()
        .map(|(i, t)| {
            json!({"id": i, "content": t, "single_word": false, "lstrip": false,
                   "rstrip": false, "normalized": false, "special": true})
        })
        .collect();
    json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": {"type": "Split", "pattern": {"Regex": "[\\s\\S]"}, "behavior": "Isolated", "invert": false},
        "post_processor": null,
        "decoder": {"type": "Fuse"},
        "model": {"type": "WordLevel", "vocab": map, "unk_token": "<unk>"}
    })
}

impl TinyPreset {
    /// Vocabulary size (special tokens + characters).
    pub fn vocab_size(&self) -> usize {
        vocabulary().len()
    }

    /// Number of weights (embeddings tied with the output layer).
    pub fn parameter_count(&self) -> usize {
        let (h, i) = (self.hidden_size, self.intermediate_size);
        let kv = self.num_kv_heads * (h / self.num_heads.max(1));
        let layer = 2 * h * h + 2 * kv * h + 3 * h * i + 2 * h;
        self.vocab_size() * h + self.num_layers * layer + h
    }

    /// Check the sizes make a model (the run plan calls this before anything is written).
    pub fn validate(&self) -> Result<()> {
        let bad = |m: &str| Err(RlError::Config(format!("tiny model: {m}")));
        if self.hidden_size == 0 || self.num_layers == 0 || self.intermediate_size == 0 {
            return bad("sizes must be >= 1");
        }
        if self.num_heads == 0 || !self.hidden_size.is_multiple_of(self.num_heads) {
            return bad("hidden_size must be a multiple of num_heads");
        }
        if self.num_kv_heads == 0 || !self.num_heads.is_multiple_of(self.num_kv_heads) {
            return bad("num_heads must be a multiple of num_kv_heads");
        }
        if !(self.hidden_size / self.num_heads).is_multiple_of(2) {
            return bad("head_dim must be even (rotary embeddings)");
        }
        Ok(())
    }

    /// Write the model directory `dir` (created if needed): config.json,
    /// model.safetensors (N(0, 0.02) weights, unit norms, as transformers
    /// initialises Llama), tokenizer.json, tokenizer_config.json,
    /// chat_template.jinja and generation_config.json. Same seed ⇒ same bytes.
    pub fn write(&self, dir: &Path, seed: u64) -> Result<()> {
        self.validate()?;
        std::fs::create_dir_all(dir).map_err(|e| RlError::io(dir, e))?;
        let vocab = self.vocab_size();
        let im_end = 2;
        let head_dim = self.hidden_size / self.num_heads;
        let config = json!({
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": head_dim,
            "vocab_size": vocab,
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": 1e-6,
            "rope_theta": 10000.0,
            "hidden_act": "silu",
            "tie_word_embeddings": true,
            "attention_bias": false,
            "mlp_bias": false,
            "bos_token_id": null,
            "eos_token_id": im_end,
            "pad_token_id": 0,
            "torch_dtype": "float32",
        });
        let tok_config = json!({
            "tokenizer_class": "PreTrainedTokenizerFast",
            "eos_token": "<|im_end|>",
            "pad_token": "<|endoftext|>",
            "unk_token": "<unk>",
            "bos_token": null,
            "model_max_length": self.max_position_embeddings,
            "clean_up_tokenization_spaces": false,
        });
        let gen_config = json!({"eos_token_id": [im_end, 0], "pad_token_id": 0});
        let write_json = |name: &str, v: &serde_json::Value| -> Result<()> {
            let path = dir.join(name);
            let text = serde_json::to_string_pretty(v)
                .map_err(|e| RlError::Config(format!("{name}: {e}")))?;
            std::fs::write(&path, text).map_err(|e| RlError::io(&path, e))
        };
        write_json("tokenizer.json", &tokenizer_json())?;
        write_json("tokenizer_config.json", &tok_config)?;
        write_json("generation_config.json", &gen_config)?;
        let tpl = dir.join("chat_template.jinja");
        std::fs::write(&tpl, CHAT_TEMPLATE).map_err(|e| RlError::io(&tpl, e))?;

        temper_model::write_random_model(dir, &config, RandomInit { std: 0.02, seed })?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use temper_model::{LoadOptions, Pretrained};

    #[test]
    fn the_preset_loads_as_a_hugging_face_directory_and_round_trips_text() {
        let dir = tempfile::tempdir().unwrap();
        let preset = TinyPreset {
            hidden_size: 32,
            num_layers: 1,
            num_heads: 2,
            num_kv_heads: 1,
            intermediate_size: 64,
            max_position_embeddings: 64,
        };
        preset.write(dir.path(), 1).unwrap();
        let p = Pretrained::load(dir.path(), &LoadOptions::default()).unwrap();
        assert_eq!(p.config.vocab_size, preset.vocab_size());
        let text = "What is 12 + 34?\n<answer>46</answer>";
        let ids = p.tokenizer.encode(text, false).unwrap();
        assert_eq!(ids.len(), text.chars().count(), "one token per character");
        assert_eq!(p.tokenizer.decode(&ids, true).unwrap(), text);
        let msgs = json!([{"role": "user", "content": "hi"}]);
        let rendered = p
            .chat_template
            .as_ref()
            .unwrap()
            .render(&msgs, None, true, &Default::default())
            .unwrap();
        assert_eq!(
            rendered,
            "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
        );
        let ids = p.tokenizer.encode(&rendered, false).unwrap();
        assert_eq!(ids[0], 1, "<|im_start|> is one special token");
        assert!(p.generation.eos_token_ids.contains(&2));
        // Same seed, same weights; another seed, other weights.
        let again = tempfile::tempdir().unwrap();
        preset.write(again.path(), 1).unwrap();
        let other = tempfile::tempdir().unwrap();
        preset.write(other.path(), 2).unwrap();
        let bytes = |d: &Path| std::fs::read(d.join("model.safetensors")).unwrap();
        assert_eq!(bytes(dir.path()), bytes(again.path()));
        assert_ne!(bytes(dir.path()), bytes(other.path()));
    }

    #[test]
    fn bad_sizes_are_rejected_with_a_reason() {
        let p = TinyPreset {
            hidden_size: 30,
            num_heads: 4,
            ..TinyPreset::default()
        };
        let e = p.write(tempfile::tempdir().unwrap().path(), 0).unwrap_err();
        assert!(e.to_string().contains("multiple of num_heads"), "{e}");
    }
}
