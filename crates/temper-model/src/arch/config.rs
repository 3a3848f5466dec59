//! `config.json` in two steps: [`HfConfig`] mirrors the file, [`ModelConfig`] is
//! the checked form the model is built from.

use std::path::Path;

use serde::Deserialize;

use crate::error::{ModelError, Result};

/// The decoder families we implement. They share one forward; these are the
/// differences between them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    /// Llama 2/3 (optional `attention_bias`, Llama-3 rope scaling).
    Llama,
    /// Qwen2 / Qwen2.5: bias on q, k, v.
    Qwen2,
    /// Qwen3: RMSNorm on q and k per head, no bias.
    Qwen3,
}

impl Family {
    /// The `model_type` string of `config.json`.
    pub fn model_type(self) -> &'static str {
        match self {
            Family::Llama => "llama",
            Family::Qwen2 => "qwen2",
            Family::Qwen3 => "qwen3",
        }
    }
}

/// How rotary frequencies are scaled.
#[derive(Debug, Clone, PartialEq)]
pub enum RopeScaling {
    /// Plain RoPE.
    Default,
    /// Positions divided by `factor`.
    Linear {
        /// Scale factor.
        factor: f64,
    },
    /// Llama 3.x frequency-dependent scaling.
    Llama3 {
        /// Scale factor for low frequencies.
        factor: f64,
        /// Wavelength threshold (as a fraction of the original context).
        low_freq_factor: f64,
        /// Wavelength threshold (as a fraction of the original context).
        high_freq_factor: f64,
        /// Context length the model was pre-trained with.
        original_max_position_embeddings: f64,
    },
}

/// `config.json` as written by transformers (the fields we read).
#[derive(Debug, Clone, Deserialize)]
pub struct HfConfig {
    /// `llama`, `qwen2` or `qwen3`.
    pub model_type: String,
    /// Width of the residual stream.
    pub hidden_size: usize,
    /// Width of the MLP.
    pub intermediate_size: usize,
    /// Number of decoder layers.
    pub num_hidden_layers: usize,
    /// Query heads.
    pub num_attention_heads: usize,
    /// Key/value heads (GQA); defaults to `num_attention_heads`.
    pub num_key_value_heads: Option<usize>,
    /// Per-head width; defaults to `hidden_size / num_attention_heads`.
    pub head_dim: Option<usize>,
    /// Vocabulary size.
    pub vocab_size: usize,
    /// Longest context.
    #[serde(default = "default_max_pos")]
    pub max_position_embeddings: usize,
    /// RMSNorm epsilon.
    #[serde(default = "default_eps")]
    pub rms_norm_eps: f64,
    /// RoPE base (older layout).
    pub rope_theta: Option<f64>,
    /// RoPE scaling (older layout).
    pub rope_scaling: Option<serde_json::Value>,
    /// RoPE base and scaling (transformers >= 5 layout).
    pub rope_parameters: Option<serde_json::Value>,
    /// Whether `lm_head` shares the embedding matrix.
    #[serde(default)]
    pub tie_word_embeddings: Option<bool>,
    /// Bias on q/k/v/o (Llama, Qwen3).
    #[serde(default)]
    pub attention_bias: Option<bool>,
    /// Bias on the MLP (Llama).
    #[serde(default)]
    pub mlp_bias: Option<bool>,
    /// Activation; only `silu` is supported.
    #[serde(default = "default_act")]
    pub hidden_act: String,
    /// Qwen2 sliding window switch; unsupported when true.
    #[serde(default)]
    pub use_sliding_window: Option<bool>,
    /// Beginning-of-sequence id.
    pub bos_token_id: Option<serde_json::Value>,
    /// End-of-sequence id(s).
    pub eos_token_id: Option<serde_json::Value>,
}

fn default_max_pos() -> usize {
    4096
}
fn default_eps() -> f64 {
    1e-6
}
fn default_act() -> String {
    "silu".into()
}

/// The checked configuration a model is built from.
#[derive(Debug, Clone)]
pub struct ModelConfig {
    /// Which family.
    pub family: Family,
    /// Residual width.
    pub hidden_size: usize,
    /// MLP width.
    pub intermediate_size: usize,
    /// Layers.
    pub num_layers: usize,
    /// Query heads.
    pub num_heads: usize,
    /// Key/value heads.
    pub num_kv_heads: usize,
    /// Per-head width.
    pub head_dim: usize,
    /// Vocabulary size.
    pub vocab_size: usize,
    /// Longest supported context.
    pub max_position_embeddings: usize,
    /// RMSNorm epsilon.
    pub rms_norm_eps: f64,
    /// RoPE base.
    pub rope_theta: f64,
    /// RoPE scaling.
    pub rope_scaling: RopeScaling,
    /// `lm_head` shares the embedding.
    pub tie_word_embeddings: bool,
    /// Bias on q, k, v.
    pub qkv_bias: bool,
    /// Bias on o_proj.
    pub o_bias: bool,
    /// Bias on the MLP projections.
    pub mlp_bias: bool,
    /// Per-head RMSNorm on q and k (Qwen3).
    pub qk_norm: bool,
    /// End-of-sequence ids from config.json.
    pub eos_token_ids: Vec<u32>,
}

impl HfConfig {
    /// Read and parse `config.json`.
    pub fn from_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| {
            if e.kind() == std::io::ErrorKind::NotFound {
                ModelError::MissingFile {
                    path: path.to_path_buf(),
                    hint: "a Hugging Face model directory needs config.json".into(),
                }
            } else {
                ModelError::io(path, e)
            }
        })?;
        serde_json::from_str(&text).map_err(|e| ModelError::bad(path, e))
    }

    /// Check the configuration and resolve defaults.
    pub fn validate(&self) -> Result<ModelConfig> {
        let family = match self.model_type.as_str() {
            "llama" => Family::Llama,
            "qwen2" => Family::Qwen2,
            "qwen3" => Family::Qwen3,
            other => return Err(ModelError::UnsupportedModelType(other.to_string())),
        };
        if self.hidden_act != "silu" {
            return Err(ModelError::UnsupportedConfig(format!(
                "hidden_act {:?} (only silu)",
                self.hidden_act
            )));
        }
        if self.use_sliding_window == Some(true) {
            return Err(ModelError::UnsupportedConfig(
                "use_sliding_window = true".into(),
            ));
        }
        let num_kv_heads = self.num_key_value_heads.unwrap_or(self.num_attention_heads);
        if self.num_attention_heads == 0
            || num_kv_heads == 0
            || !self.num_attention_heads.is_multiple_of(num_kv_heads)
        {
            return Err(ModelError::UnsupportedConfig(format!(
                "num_attention_heads {} must be a positive multiple of num_key_value_heads {}",
                self.num_attention_heads, num_kv_heads
            )));
        }
        let head_dim = self
            .head_dim
            .unwrap_or(self.hidden_size / self.num_attention_heads);
        if head_dim == 0 || !head_dim.is_multiple_of(2) {
            return Err(ModelError::UnsupportedConfig(format!(
                "head_dim {head_dim} must be even and positive"
            )));
        }
        let (rope_theta, rope_scaling) = self.rope()?;
        let attention_bias = self.attention_bias.unwrap_or(false);
        let eos_token_ids = ids_of(self.eos_token_id.as_ref());
        Ok(ModelConfig {
            family,
            hidden_size: self.hidden_size,
            intermediate_size: self.intermediate_size,
            num_layers: self.num_hidden_layers,
            num_heads: self.num_attention_heads,
            num_kv_heads,
            head_dim,
            vocab_size: self.vocab_size,
            max_position_embeddings: self.max_position_embeddings,
            rms_norm_eps: self.rms_norm_eps,
            rope_theta,
            rope_scaling,
            tie_word_embeddings: self.tie_word_embeddings.unwrap_or(false),
            qkv_bias: family == Family::Qwen2 || attention_bias,
            o_bias: family != Family::Qwen2 && attention_bias,
            mlp_bias: self.mlp_bias.unwrap_or(false),
            qk_norm: family == Family::Qwen3,
            eos_token_ids,
        })
    }

    /// RoPE base and scaling from either layout (`rope_theta` + `rope_scaling`,
    /// or transformers 5's `rope_parameters`).
    fn rope(&self) -> Result<(f64, RopeScaling)> {
        let params = self.rope_parameters.as_ref().or(self.rope_scaling.as_ref());
        let theta = self
            .rope_theta
            .or_else(|| {
                self.rope_parameters
                    .as_ref()
                    .and_then(|p| p.get("rope_theta"))
                    .and_then(|v| v.as_f64())
            })
            .unwrap_or(10_000.0);
        let Some(p) = params.filter(|p| !p.is_null()) else {
            return Ok((theta, RopeScaling::Default));
        };
        let kind = p
            .get("rope_type")
            .or_else(|| p.get("type"))
            .and_then(|v| v.as_str())
            .unwrap_or("default");
        let num = |key: &str| -> Result<f64> {
            p.get(key).and_then(|v| v.as_f64()).ok_or_else(|| {
                ModelError::UnsupportedConfig(format!("rope scaling {kind:?} needs {key}"))
            })
        };
        let scaling = match kind {
            "default" => RopeScaling::Default,
            "linear" => RopeScaling::Linear {
                factor: num("factor")?,
            },
            "llama3" => RopeScaling::Llama3 {
                factor: num("factor")?,
                low_freq_factor: num("low_freq_factor")?,
                high_freq_factor: num("high_freq_factor")?,
                original_max_position_embeddings: num("original_max_position_embeddings")?,
            },
            other => {
                return Err(ModelError::UnsupportedConfig(format!(
                    "rope_type {other:?} (supported: default, linear, llama3)"
                )))
            }
        };
        Ok((theta, scaling))
    }
}

/// Token ids given as a number or a list of numbers.
pub(crate) fn ids_of(v: Option<&serde_json::Value>) -> Vec<u32> {
    match v {
        Some(serde_json::Value::Number(n)) => {
            n.as_u64().map(|x| vec![x as u32]).unwrap_or_default()
        }
        Some(serde_json::Value::Array(a)) => a
            .iter()
            .filter_map(|x| x.as_u64().map(|x| x as u32))
            .collect(),
        _ => Vec::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(extra: serde_json::Value) -> HfConfig {
        let mut base = serde_json::json!({
            "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "vocab_size": 100
        });
        if let (Some(b), Some(e)) = (base.as_object_mut(), extra.as_object()) {
            for (k, v) in e {
                b.insert(k.clone(), v.clone());
            }
        }
        serde_json::from_value(base).expect("valid json")
    }

    #[test]
    fn unknown_model_type_is_a_clear_error() {
        let err = cfg(serde_json::json!({"model_type": "gpt2"}))
            .validate()
            .expect_err("gpt2 is unsupported");
        assert!(err.to_string().contains("gpt2"), "{err}");
    }

    #[test]
    fn rope_parameters_layout_is_read() {
        let c = cfg(serde_json::json!({"rope_parameters": {
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64}}))
        .validate()
        .expect("valid");
        assert_eq!(c.rope_theta, 500000.0);
        assert!(matches!(c.rope_scaling, RopeScaling::Llama3 { factor, .. } if factor == 8.0));
    }

    #[test]
    fn unsupported_rope_is_rejected() {
        let err = cfg(serde_json::json!({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}))
            .validate()
            .expect_err("yarn unsupported");
        assert!(err.to_string().contains("yarn"));
    }

    #[test]
    fn family_flags() {
        let q2 = cfg(serde_json::json!({"model_type": "qwen2"}))
            .validate()
            .expect("ok");
        assert!(q2.qkv_bias && !q2.o_bias && !q2.qk_norm);
        let q3 = cfg(serde_json::json!({"model_type": "qwen3", "head_dim": 32}))
            .validate()
            .expect("ok");
        assert!(!q3.qkv_bias && q3.qk_norm && q3.head_dim == 32);
    }
}
