//! Writing a model back out in the formats serving stacks run: a Hugging Face
//! directory ([`save_hf`]) and a GGUF file ([`save_gguf`]) carrying the
//! tokenizer and chat template, quantised by candle's `quantized` module.
//!
//! The GGUF follows llama.cpp's conventions (`convert_hf_to_gguf.py`): tensor
//! names, Llama's q/k row permutation, 1-D norms kept in F32, `tokenizer.ggml.*`
//! metadata, Llama 3 rope scaling as `rope_freqs.weight`; K-quants fall back to a legacy type for rows not a multiple of
//! 256, as llama.cpp's quantiser does.

use std::collections::HashMap;
use std::fs::File;
use std::io::BufWriter;
use std::path::Path;
use std::str::FromStr;

use candle_core::quantized::gguf_file::{self, Value};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{DType, Device, Tensor};
use serde_json::{json, Value as Json};

use crate::arch::config::{Family, ModelConfig, RopeScaling};
use crate::arch::model::Model;
use crate::error::{ModelError, Result};
use crate::formats::gguf::{gguf_tensor_name, llama3_factors, permute_qk, GgufFile};
use crate::formats::gguf_tokenizer::tokenizer_metadata;
use crate::pretrained::Pretrained;

/// Tensor type of an exported GGUF.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GgufQuant {
    /// 32-bit floats (lossless).
    F32,
    /// 16-bit floats.
    F16,
    /// bfloat16.
    Bf16,
    /// 8-bit blocks.
    Q8_0,
    /// 4-bit blocks, scale only.
    Q4_0,
    /// 4-bit blocks, scale and minimum.
    Q4_1,
    /// 5-bit blocks, scale only.
    Q5_0,
    /// 5-bit blocks, scale and minimum.
    Q5_1,
    /// 2-bit K-quant.
    Q2K,
    /// 3-bit K-quant.
    Q3K,
    /// 4-bit K-quant.
    Q4K,
    /// 5-bit K-quant.
    Q5K,
    /// 6-bit K-quant.
    Q6K,
    /// llama.cpp's `Q4_K_M` mix: Q4_K, with Q6_K for the embedding / output
    /// and for `attn_v` / `ffn_down`.
    Q4KM,
}

impl FromStr for GgufQuant {
    type Err = ModelError;
    fn from_str(s: &str) -> Result<Self> {
        Ok(match s.to_ascii_lowercase().as_str() {
            "f32" => Self::F32,
            "f16" => Self::F16,
            "bf16" => Self::Bf16,
            "q8_0" => Self::Q8_0,
            "q4_0" => Self::Q4_0,
            "q4_1" => Self::Q4_1,
            "q5_0" => Self::Q5_0,
            "q5_1" => Self::Q5_1,
            "q2_k" => Self::Q2K,
            "q3_k" => Self::Q3K,
            "q4_k" => Self::Q4K,
            "q5_k" => Self::Q5K,
            "q6_k" => Self::Q6K,
            "q4_k_m" => Self::Q4KM,
            other => {
                return Err(ModelError::InvalidInput(format!(
                    "unknown GGUF quantisation {other:?} (f32, f16, bf16, q8_0, q4_0, q4_1, q5_0, q5_1, q2_k, q3_k, q4_k, q5_k, q6_k, q4_k_m)"
                )))
            }
        })
    }
}

impl GgufQuant {
    /// The type of a 2-D weight called `gguf_name` with rows of `cols`.
    fn dtype_for(self, gguf_name: &str, cols: usize) -> GgmlDType {
        let t = match self {
            Self::F32 => GgmlDType::F32,
            Self::F16 => GgmlDType::F16,
            Self::Bf16 => GgmlDType::BF16,
            Self::Q8_0 => GgmlDType::Q8_0,
            Self::Q4_0 => GgmlDType::Q4_0,
            Self::Q4_1 => GgmlDType::Q4_1,
            Self::Q5_0 => GgmlDType::Q5_0,
            Self::Q5_1 => GgmlDType::Q5_1,
            Self::Q2K => GgmlDType::Q2K,
            Self::Q3K => GgmlDType::Q3K,
            Self::Q4K => GgmlDType::Q4K,
            Self::Q5K => GgmlDType::Q5K,
            Self::Q6K => GgmlDType::Q6K,
            Self::Q4KM => {
                if gguf_name.starts_with("token_embd")
                    || gguf_name.starts_with("output.")
                    || gguf_name.contains(".attn_v.")
                    || gguf_name.contains(".ffn_down.")
                {
                    GgmlDType::Q6K
                } else {
                    GgmlDType::Q4K
                }
            }
        };
        if cols.is_multiple_of(t.block_size()) {
            return t;
        }
        // llama.cpp's fallbacks for rows that do not fill a K-quant block.
        let fallback = match t {
            GgmlDType::Q2K | GgmlDType::Q3K => GgmlDType::Q4_0,
            GgmlDType::Q4K => GgmlDType::Q5_0,
            GgmlDType::Q5K => GgmlDType::Q5_1,
            _ => GgmlDType::Q8_0,
        };
        if cols.is_multiple_of(fallback.block_size()) {
            fallback
        } else {
            GgmlDType::F16
        }
    }

    /// llama.cpp's `general.file_type` code.
    fn file_type(self) -> u32 {
        match self {
            Self::F32 => 0,
            Self::F16 => 1,
            Self::Q4_0 => 2,
            Self::Q4_1 => 3,
            Self::Q8_0 => 7,
            Self::Q5_0 => 8,
            Self::Q5_1 => 9,
            Self::Q2K => 10,
            Self::Q3K => 12,
            Self::Q4K => 14,
            Self::Q4KM => 15,
            Self::Q5K => 16,
            Self::Q6K => 18,
            Self::Bf16 => 32,
        }
    }
}

/// `config.json` for a model config (what transformers reads back).
pub fn hf_config_json(cfg: &ModelConfig, bos: Option<u32>) -> Json {
    let arch = match cfg.family {
        Family::Llama => "LlamaForCausalLM",
        Family::Qwen2 => "Qwen2ForCausalLM",
        Family::Qwen3 => "Qwen3ForCausalLM",
    };
    let mut rope = json!({"rope_type": "default", "rope_theta": cfg.rope_theta});
    match cfg.rope_scaling {
        RopeScaling::Default => {}
        RopeScaling::Linear { factor } => {
            rope = json!({"rope_type": "linear", "rope_theta": cfg.rope_theta, "factor": factor})
        }
        RopeScaling::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max_position_embeddings,
        } => {
            rope = json!({"rope_type": "llama3", "rope_theta": cfg.rope_theta, "factor": factor,
                "low_freq_factor": low_freq_factor, "high_freq_factor": high_freq_factor,
                "original_max_position_embeddings": original_max_position_embeddings})
        }
    }
    let mut v = json!({
        "architectures": [arch],
        "model_type": cfg.family.model_type(),
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "vocab_size": cfg.vocab_size,
        "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_parameters": rope,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "hidden_act": "silu",
        "torch_dtype": "float32",
    });
    if let Some(o) = v.as_object_mut() {
        if cfg.rope_scaling != RopeScaling::Default {
            // The pre-transformers-5 key, which vLLM and older readers use.
            o.insert("rope_scaling".into(), o["rope_parameters"].clone());
        }
        if cfg.family == Family::Llama {
            o.insert("attention_bias".into(), json!(cfg.qkv_bias));
            o.insert("mlp_bias".into(), json!(cfg.mlp_bias));
        }
        if cfg.family == Family::Qwen2 {
            o.insert("use_sliding_window".into(), json!(false));
        }
        if let Some(b) = bos {
            o.insert("bos_token_id".into(), json!(b));
        }
        match cfg.eos_token_ids.as_slice() {
            [] => {}
            [one] => {
                o.insert("eos_token_id".into(), json!(one));
            }
            many => {
                o.insert("eos_token_id".into(), json!(many));
            }
        }
    }
    v
}

fn write_json(path: &Path, v: &Json) -> Result<()> {
    let text = serde_json::to_string_pretty(v).map_err(|e| ModelError::bad(path, e))?;
    std::fs::write(path, text).map_err(|e| ModelError::io(path, e))
}

/// Save `model` (e.g. `base.model` with an adapter merged) as a Hugging Face
/// directory: `model.safetensors`, `config.json`, the tokenizer and chat
/// template of `base` (copied from its directory, or rebuilt from its GGUF)
/// and `generation_config.json`.
pub fn save_hf(base: &Pretrained, model: &Model, dir: &Path) -> Result<()> {
    std::fs::create_dir_all(dir).map_err(|e| ModelError::io(dir, e))?;
    let weights: HashMap<String, Tensor> = model
        .named_weights()?
        .into_iter()
        .map(|(n, t)| Ok((n, t.to_dtype(DType::F32)?.to_device(&Device::Cpu)?)))
        .collect::<Result<_>>()?;
    candle_core::safetensors::save(&weights, dir.join("model.safetensors"))?;
    let tok = &base.tokenizer;
    let bos_id = tok.bos_token().and_then(|t| tok.token_id(t));
    let mut cfg = model.config().clone();
    cfg.eos_token_ids = base.generation.eos_token_ids.clone();
    write_json(&dir.join("config.json"), &hf_config_json(&cfg, bos_id))?;
    if base.dir.is_dir() {
        for f in [
            "tokenizer.json",
            "tokenizer_config.json",
            "chat_template.jinja",
            "special_tokens_map.json",
        ] {
            let src = base.dir.join(f);
            if src.exists() {
                std::fs::copy(&src, dir.join(f)).map_err(|e| ModelError::io(&src, e))?;
            }
        }
    } else {
        let g = GgufFile::open(&base.dir)?;
        write_json(&dir.join("tokenizer.json"), &g.tokenizer_json()?)?;
        let mut tc = json!({"tokenizer_class": "PreTrainedTokenizerFast"});
        if let Some(o) = tc.as_object_mut() {
            if let Some(b) = tok.bos_token() {
                o.insert("bos_token".into(), json!(b));
            }
            if let Some(e) = tok.eos_token() {
                o.insert("eos_token".into(), json!(e));
            }
        }
        write_json(&dir.join("tokenizer_config.json"), &tc)?;
        if let Some(t) = g.chat_template() {
            let p = dir.join("chat_template.jinja");
            std::fs::write(&p, t).map_err(|e| ModelError::io(&p, e))?;
        }
    }
    let mut gen = json!({"eos_token_id": base.generation.eos_token_ids});
    if let Some(o) = gen.as_object_mut() {
        if let Some(b) = bos_id {
            o.insert("bos_token_id".into(), json!(b));
        }
        if let Some(t) = base.generation.temperature {
            o.insert("temperature".into(), json!(t));
        }
        if let Some(t) = base.generation.top_p {
            o.insert("top_p".into(), json!(t));
        }
        if let Some(t) = base.generation.top_k {
            o.insert("top_k".into(), json!(t));
        }
    }
    write_json(&dir.join("generation_config.json"), &gen)?;
    Ok(())
}

/// A model's name: a GGUF's `general.name`, else the file or directory name
/// (what `temper serve` calls it, so an exported model keeps its base's name).
pub fn model_name(path: &Path) -> String {
    if crate::formats::gguf::is_gguf(path) {
        if let Some(n) = crate::formats::gguf::GgufFile::open(path)
            .ok()
            .and_then(|g| g.general_name().map(str::to_string))
        {
            return n;
        }
    }
    path_name(path)
}

/// The file or directory name of `path` (resolved, so `.` has one), else
/// `model`.
pub fn path_name(path: &Path) -> String {
    path.canonicalize()
        .ok()
        .and_then(|p| p.file_name().map(|f| f.to_string_lossy().into_owned()))
        .unwrap_or_else(|| "model".into())
}

/// Save `model` (e.g. `base.model` with an adapter merged) as a GGUF file
/// with `base`'s tokenizer and chat template, weights in `quant`.
pub fn save_gguf(base: &Pretrained, model: &Model, path: &Path, quant: GgufQuant) -> Result<()> {
    let cfg = model.config();
    let arch = cfg.family.model_type();
    let k = |s: &str| format!("{arch}.{s}");
    let mut meta: Vec<(String, Value)> = vec![
        ("general.architecture".into(), Value::String(arch.into())),
        ("general.name".into(), Value::String(model_name(&base.dir))),
        ("general.file_type".into(), Value::U32(quant.file_type())),
        ("general.quantization_version".into(), Value::U32(2)),
        (
            k("context_length"),
            Value::U32(cfg.max_position_embeddings as u32),
        ),
        (k("embedding_length"), Value::U32(cfg.hidden_size as u32)),
        (k("block_count"), Value::U32(cfg.num_layers as u32)),
        (
            k("feed_forward_length"),
            Value::U32(cfg.intermediate_size as u32),
        ),
        (k("attention.head_count"), Value::U32(cfg.num_heads as u32)),
        (
            k("attention.head_count_kv"),
            Value::U32(cfg.num_kv_heads as u32),
        ),
        (
            k("attention.layer_norm_rms_epsilon"),
            Value::F32(cfg.rms_norm_eps as f32),
        ),
        (k("rope.freq_base"), Value::F32(cfg.rope_theta as f32)),
        (k("rope.dimension_count"), Value::U32(cfg.head_dim as u32)),
        (k("attention.key_length"), Value::U32(cfg.head_dim as u32)),
        (k("attention.value_length"), Value::U32(cfg.head_dim as u32)),
        (k("vocab_size"), Value::U32(cfg.vocab_size as u32)),
    ];
    if let RopeScaling::Linear { factor } = cfg.rope_scaling {
        meta.push((k("rope.scaling.type"), Value::String("linear".into())));
        meta.push((k("rope.scaling.factor"), Value::F32(factor as f32)));
    }
    meta.extend(tokenizer_metadata(
        &base.dir,
        &base.tokenizer,
        &base.generation.eos_token_ids,
        cfg.vocab_size,
    )?);

    let mut tensors: Vec<(String, QTensor)> = Vec::new();
    for (hf, t) in model.named_weights()? {
        let name = gguf_tensor_name(&hf).ok_or_else(|| {
            ModelError::UnsupportedConfig(format!("no GGUF name for tensor {hf}"))
        })?;
        let mut t = t.to_dtype(DType::F32)?.to_device(&Device::Cpu)?;
        if cfg.family == Family::Llama && (name.contains(".attn_q.") || name.contains(".attn_k.")) {
            let heads = if name.contains(".attn_k.") {
                cfg.num_kv_heads
            } else {
                cfg.num_heads
            };
            t = permute_qk(&t, heads, false)?;
        }
        let dtype = if t.rank() == 1 {
            GgmlDType::F32
        } else {
            quant.dtype_for(&name, t.dims()[t.rank() - 1])
        };
        let q = QTensor::quantize(&t, dtype)?;
        tensors.push((name, q));
    }
    if let RopeScaling::Llama3 {
        factor,
        low_freq_factor,
        high_freq_factor,
        original_max_position_embeddings,
    } = cfg.rope_scaling
    {
        // llama.cpp carries Llama 3 scaling as per-frequency divisors.
        let f: Vec<f32> = llama3_factors(
            cfg.rope_theta,
            cfg.head_dim,
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max_position_embeddings,
        )
        .into_iter()
        .map(|x| x as f32)
        .collect();
        let n = f.len();
        let t = Tensor::from_vec(f, n, &Device::Cpu)?;
        tensors.push((
            "rope_freqs.weight".into(),
            QTensor::quantize(&t, GgmlDType::F32)?,
        ));
    }
    let file = File::create(path).map_err(|e| ModelError::io(path, e))?;
    let mut w = BufWriter::new(file);
    let meta_refs: Vec<(&str, &Value)> = meta.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let tensor_refs: Vec<(&str, &QTensor)> = tensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
    gguf_file::write(&mut w, &meta_refs, &tensor_refs)?;
    use std::io::Write;
    w.flush().map_err(|e| ModelError::io(path, e))?;
    Ok(())
}
