//! GGUF files — what llama.cpp, Ollama and LM Studio users have — read into
//! the same pieces a Hugging Face directory gives: a [`HfConfig`], checkpoint
//! tensors under their Hugging Face names, a `tokenizers` tokenizer and the
//! chat template.
//!
//! The container is parsed and every tensor type dequantised by candle's
//! `quantized` module; this file only maps llama.cpp's conventions back to
//! transformers' ones, following transformers' own GGUF loader (config keys,
//! tensor names, the q/k row permutation llama.cpp applies to Llama, and the
//! tokenizer it rebuilds from `tokenizer.ggml.*`), so a GGUF loads here as it
//! does there.

use std::fs::File;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, PoisonError};

use candle_core::quantized::gguf_file::{Content, Value};
use candle_core::{DType, Device, Tensor};
use serde_json::json;

use crate::arch::config::HfConfig;
use crate::error::{ModelError, Result};
use crate::kernels::{QuantFormat, QuantWeight};

/// Whether `path` is a file that starts with the GGUF magic.
pub fn is_gguf(path: &Path) -> bool {
    if !path.is_file() {
        return false;
    }
    let mut magic = [0u8; 4];
    File::open(path)
        .and_then(|mut f| f.read_exact(&mut magic))
        .is_ok()
        && &magic == b"GGUF"
}

/// An open GGUF file: its metadata, and tensors read on demand.
pub struct GgufFile {
    pub(crate) path: PathBuf,
    content: Content,
    file: Mutex<File>,
    arch: String,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("path", &self.path)
            .field("arch", &self.arch)
            .field("tensors", &self.content.tensor_infos.len())
            .finish()
    }
}

/// The GGUF name of a Hugging Face checkpoint tensor (llama.cpp's
/// `tensor_mapping` for the Llama / Qwen2 / Qwen3 decoders).
pub fn gguf_tensor_name(hf: &str) -> Option<String> {
    match hf {
        "model.embed_tokens.weight" => return Some("token_embd.weight".into()),
        "lm_head.weight" => return Some("output.weight".into()),
        "model.norm.weight" => return Some("output_norm.weight".into()),
        _ => {}
    }
    let rest = hf.strip_prefix("model.layers.")?;
    let (layer, leaf) = rest.split_once('.')?;
    layer.parse::<usize>().ok()?;
    let (module, kind) = leaf.rsplit_once('.')?;
    let g = match module {
        "input_layernorm" => "attn_norm",
        "post_attention_layernorm" => "ffn_norm",
        "self_attn.q_proj" => "attn_q",
        "self_attn.k_proj" => "attn_k",
        "self_attn.v_proj" => "attn_v",
        "self_attn.o_proj" => "attn_output",
        "self_attn.q_norm" => "attn_q_norm",
        "self_attn.k_norm" => "attn_k_norm",
        "mlp.gate_proj" => "ffn_gate",
        "mlp.up_proj" => "ffn_up",
        "mlp.down_proj" => "ffn_down",
        _ => return None,
    };
    Some(format!("blk.{layer}.{g}.{kind}"))
}

/// llama.cpp's per-frequency RoPE divisors (`rope_freqs.weight`) for Llama 3
/// scaling (`convert_hf_to_gguf.py`): 1 for short wavelengths, `factor` for
/// long ones, a smooth blend between.
pub(crate) fn llama3_factors(
    theta: f64,
    head_dim: usize,
    factor: f64,
    low: f64,
    high: f64,
    orig: f64,
) -> Vec<f64> {
    (0..head_dim)
        .step_by(2)
        .map(|i| {
            let freq = 1.0 / theta.powf(i as f64 / head_dim as f64);
            let wavelen = 2.0 * std::f64::consts::PI / freq;
            if wavelen < orig / high {
                1.0
            } else if wavelen > orig / low {
                factor
            } else {
                let smooth = (orig / wavelen - low) / (high - low);
                1.0 / ((1.0 - smooth) / factor + smooth)
            }
        })
        .collect()
}

/// Llama 3 scaling parameters `(factor, low, high, orig)` reproducing
/// `factors` (as stored, f32), if any: the parameters are determined up to a
/// common scale, so `low_freq_factor` is taken as 1.
fn llama3_from_factors(
    factors: &[f64],
    theta: f64,
    head_dim: usize,
) -> Option<(f64, f64, f64, f64)> {
    if factors.len() != head_dim / 2 || factors.is_empty() {
        return None;
    }
    let factor = factors.iter().cloned().fold(f64::MIN, f64::max);
    if factor <= 1.0 {
        return None;
    }
    let wavelen =
        |i: usize| 2.0 * std::f64::consts::PI * theta.powf(2.0 * i as f64 / head_dim as f64);
    // In the blend, s = (orig / wavelen - low) / (high - low) with
    // 1/f = (1 - s)/factor + s: s is affine in 1/wavelen.
    let blend: Vec<(f64, f64)> = factors
        .iter()
        .enumerate()
        .filter(|(_, f)| (**f - 1.0).abs() > 1e-6 && (**f - factor).abs() > 1e-6 * factor)
        .map(|(i, f)| {
            let s = (1.0 / f - 1.0 / factor) / (1.0 - 1.0 / factor);
            (1.0 / wavelen(i), s)
        })
        .collect();
    let candidates: Vec<(f64, f64)> = match blend.as_slice() {
        [(x0, s0), .., (x1, s1)] if (x1 - x0).abs() > 0.0 => {
            let a = (s1 - s0) / (x1 - x0);
            let b = s0 - a * x0;
            // s = orig/(high-low) · x − low/(high-low), low = 1.
            if b >= 0.0 {
                return None;
            }
            let span = -1.0 / b;
            vec![(1.0 + span, a * span)]
        }
        _ => {
            // No (or one) blended frequency: try Llama 3's own constants.
            [8192.0, 4096.0, 2048.0, 1024.0, 512.0, 256.0, 128.0, 64.0]
                .iter()
                .map(|&o| (4.0, o))
                .collect()
        }
    };
    for (high, orig) in candidates {
        for orig in [orig.round(), orig] {
            let want = llama3_factors(theta, head_dim, factor, 1.0, high, orig);
            let ok = want
                .iter()
                .zip(factors)
                .all(|(w, f)| ((*w as f32) as f64 - f).abs() <= 1e-5 * w.abs().max(1.0));
            if ok {
                let high = if (high - high.round()).abs() < 1e-4 {
                    high.round()
                } else {
                    high
                };
                return Some((factor, 1.0, high, orig));
            }
        }
    }
    None
}

/// llama.cpp stores Llama's q/k projections with the rows of each head
/// reordered from "halves" to "interleaved" rotary layout; this maps rows
/// `[heads, 2, d/2]` → `[heads, d/2, 2]` (its inverse when `unpermute`).
pub(crate) fn permute_qk(w: &Tensor, heads: usize, unpermute: bool) -> Result<Tensor> {
    let dims = w.dims().to_vec();
    let rows = dims.first().copied().unwrap_or(0);
    if heads == 0 || rows == 0 || !rows.is_multiple_of(2 * heads) {
        return Err(ModelError::UnsupportedConfig(format!(
            "q/k rows {rows} do not split into {heads} heads of even width"
        )));
    }
    let half = rows / heads / 2;
    let mut shape = vec![heads];
    if unpermute {
        shape.extend([half, 2]);
    } else {
        shape.extend([2, half]);
    }
    shape.extend_from_slice(&dims[1..]);
    Ok(w.reshape(shape)?
        .transpose(1, 2)?
        .contiguous()?
        .reshape(dims)?)
}

/// Names of the ggml tensor types candle cannot read (llama.cpp's `ggml.h`).
fn ggml_type_name(t: u32) -> Option<&'static str> {
    Some(match t {
        4 => "Q4_2 (removed)",
        5 => "Q4_3 (removed)",
        16 => "IQ2_XXS",
        17 => "IQ2_XS",
        18 => "IQ3_XXS",
        19 => "IQ1_S",
        20 => "IQ4_NL",
        21 => "IQ3_S",
        22 => "IQ2_S",
        23 => "IQ4_XS",
        24 => "I8",
        25 => "I16",
        26 => "I32",
        27 => "I64",
        28 => "F64",
        29 => "IQ1_M",
        34 => "TQ1_0",
        35 => "TQ2_0",
        39 => "MXFP4",
        _ => return None,
    })
}

pub(crate) fn meta_u64(v: &Value) -> Option<u64> {
    match v {
        Value::U8(x) => Some(*x as u64),
        Value::I8(x) => u64::try_from(*x).ok(),
        Value::U16(x) => Some(*x as u64),
        Value::I16(x) => u64::try_from(*x).ok(),
        Value::U32(x) => Some(*x as u64),
        Value::I32(x) => u64::try_from(*x).ok(),
        Value::U64(x) => Some(*x),
        Value::I64(x) => u64::try_from(*x).ok(),
        _ => None,
    }
}

pub(crate) fn meta_f64(v: &Value) -> Option<f64> {
    match v {
        Value::F32(x) => Some(*x as f64),
        Value::F64(x) => Some(*x),
        other => meta_u64(other).map(|x| x as f64),
    }
}

impl GgufFile {
    /// Read the header and metadata of `path`.
    pub fn open(path: &Path) -> Result<Self> {
        let mut file = File::open(path).map_err(|e| ModelError::io(path, e))?;
        let content = Content::read(&mut file).map_err(|e| {
            let msg = e.to_string();
            if let Some(t) = msg
                .strip_prefix("unknown dtype for tensor ")
                .and_then(|rest| rest.split_whitespace().next())
            {
                ModelError::UnsupportedConfig(format!(
                    "{}: GGUF tensor type {t}{} (supported: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K..Q6_K, Q8_K)",
                    path.display(),
                    t.parse::<u32>()
                        .ok()
                        .and_then(ggml_type_name)
                        .map(|n| format!(" ({n})"))
                        .unwrap_or_default()
                ))
            } else {
                ModelError::bad(path, format!("GGUF: {msg}"))
            }
        })?;
        let arch = match content.metadata.get("general.architecture") {
            Some(Value::String(s)) => s.clone(),
            _ => return Err(ModelError::bad(path, "GGUF has no general.architecture")),
        };
        Ok(Self {
            path: path.to_path_buf(),
            content,
            file: Mutex::new(file),
            arch,
        })
    }

    /// The file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// `general.architecture`.
    pub fn architecture(&self) -> &str {
        &self.arch
    }

    /// `general.name`: the model's name as its converter wrote it (`None`
    /// when absent or blank).
    pub fn general_name(&self) -> Option<&str> {
        match self.metadata("general.name") {
            Some(Value::String(s)) if !s.trim().is_empty() => Some(s.trim()),
            _ => None,
        }
    }

    /// A metadata value.
    pub fn metadata(&self, key: &str) -> Option<&Value> {
        self.content.metadata.get(key)
    }

    fn arch_key(&self, key: &str) -> Option<&Value> {
        self.metadata(&format!("{}.{key}", self.arch))
    }

    fn req_u64(&self, key: &str) -> Result<u64> {
        let full = format!("{}.{key}", self.arch);
        self.metadata(&full)
            .and_then(meta_u64)
            .ok_or_else(|| ModelError::bad(&self.path, format!("GGUF metadata {full} missing")))
    }

    fn has_tensor(&self, gguf_name: &str) -> bool {
        self.content.tensor_infos.contains_key(gguf_name)
    }

    /// The model's `config.json`, as transformers' GGUF loader derives it.
    pub fn hf_config(&self) -> Result<HfConfig> {
        let model_type = match self.arch.as_str() {
            "llama" | "qwen2" | "qwen3" => self.arch.clone(),
            other => return Err(ModelError::UnsupportedModelType(other.to_string())),
        };
        let heads = self.req_u64("attention.head_count")?;
        let hidden = self.req_u64("embedding_length")?;
        let vocab = match self.arch_key("vocab_size").and_then(meta_u64) {
            Some(v) => v,
            None => match self.metadata("tokenizer.ggml.tokens") {
                Some(Value::Array(a)) => a.len() as u64,
                _ => {
                    return Err(ModelError::bad(
                        &self.path,
                        "GGUF has neither a vocab_size nor tokenizer.ggml.tokens",
                    ))
                }
            },
        };
        let head_dim = self
            .arch_key("attention.key_length")
            .or_else(|| self.arch_key("rope.dimension_count"))
            .and_then(meta_u64)
            .unwrap_or(hidden / heads.max(1));
        let mut cfg = json!({
            "model_type": model_type,
            "hidden_size": hidden,
            "intermediate_size": self.req_u64("feed_forward_length")?,
            "num_hidden_layers": self.req_u64("block_count")?,
            "num_attention_heads": heads,
            "num_key_value_heads": self.arch_key("attention.head_count_kv").and_then(meta_u64).unwrap_or(heads),
            "head_dim": head_dim,
            "vocab_size": vocab,
            "tie_word_embeddings": !self.has_tensor("output.weight"),
            "attention_bias": self.has_tensor("blk.0.attn_output.bias"),
            "mlp_bias": self.has_tensor("blk.0.ffn_up.bias"),
        });
        let obj = cfg
            .as_object_mut()
            .ok_or_else(|| ModelError::bad(&self.path, "config"))?;
        if let Some(v) = self.arch_key("context_length").and_then(meta_u64) {
            obj.insert("max_position_embeddings".into(), json!(v));
        }
        if let Some(v) = self
            .arch_key("attention.layer_norm_rms_epsilon")
            .and_then(meta_f64)
        {
            obj.insert("rms_norm_eps".into(), json!(v));
        }
        let theta = self
            .arch_key("rope.freq_base")
            .and_then(meta_f64)
            .unwrap_or(10_000.0);
        obj.insert("rope_theta".into(), json!(theta));
        if self.has_tensor("rope_freqs.weight") {
            let factors = self.raw_tensor("rope_freqs.weight")?.to_vec1::<f32>()?;
            let factors: Vec<f64> = factors.into_iter().map(f64::from).collect();
            let (factor, low, high, orig) = llama3_from_factors(&factors, theta, head_dim as usize)
                .ok_or_else(|| {
                    ModelError::UnsupportedConfig(
                        "GGUF rope_freqs.weight factors that are not Llama 3 rope scaling".into(),
                    )
                })?;
            obj.insert(
                "rope_scaling".into(),
                json!({"rope_type": "llama3", "factor": factor, "low_freq_factor": low,
                       "high_freq_factor": high, "original_max_position_embeddings": orig}),
            );
        }
        match self.arch_key("rope.scaling.type") {
            None => {}
            Some(Value::String(s)) if s == "none" => {}
            Some(Value::String(s)) if s == "linear" => {
                let factor = self
                    .arch_key("rope.scaling.factor")
                    .and_then(meta_f64)
                    .ok_or_else(|| {
                        ModelError::UnsupportedConfig("linear rope scaling without a factor".into())
                    })?;
                obj.insert(
                    "rope_scaling".into(),
                    json!({"rope_type": "linear", "factor": factor}),
                );
            }
            Some(other) => {
                return Err(ModelError::UnsupportedConfig(format!(
                    "GGUF rope.scaling.type {other:?} (supported: none, linear)"
                )))
            }
        }
        for (key, name) in [
            ("tokenizer.ggml.bos_token_id", "bos_token_id"),
            ("tokenizer.ggml.eos_token_id", "eos_token_id"),
        ] {
            if let Some(v) = self.metadata(key).and_then(meta_u64) {
                obj.insert(name.into(), json!(v));
            }
        }
        serde_json::from_value(cfg).map_err(|e| ModelError::bad(&self.path, e))
    }

    /// Whether the checkpoint has the tensor with Hugging Face name `hf`.
    pub fn contains(&self, hf: &str) -> bool {
        gguf_tensor_name(hf).is_some_and(|g| self.has_tensor(&g))
    }

    /// Read and dequantise the tensor called `name` in the file (f32, CPU).
    fn raw_tensor(&self, name: &str) -> Result<Tensor> {
        let q = {
            let mut f = self.file.lock().unwrap_or_else(PoisonError::into_inner);
            self.content
                .tensor(&mut *f, name, &Device::Cpu)
                .map_err(|e| ModelError::bad(&self.path, format!("tensor {name}: {e}")))?
        };
        Ok(q.dequantize(&Device::Cpu)?)
    }

    /// Read, dequantise and un-permute the tensor with Hugging Face name `hf`.
    pub fn tensor(&self, hf: &str, dtype: DType, device: &Device) -> Result<Tensor> {
        let missing = || ModelError::MissingTensor {
            name: hf.to_string(),
            source_desc: self.path.display().to_string(),
        };
        let name = gguf_tensor_name(hf).ok_or_else(missing)?;
        if !self.has_tensor(&name) {
            return Err(missing());
        }
        let mut t = self.raw_tensor(&name)?;
        if let Some(heads) = self.qk_heads(&name)? {
            t = permute_qk(&t, heads, true)?;
        }
        Ok(t.to_dtype(dtype)?.to_device(device)?)
    }

    /// The tensor with Hugging Face name `hf` kept in its quantized blocks
    /// (un-permuted like [`GgufFile::tensor`]), when it is a matrix in a
    /// format the quantized matmul reads ([`QuantFormat`]); `None` for any
    /// other type, which [`GgufFile::tensor`] dequantizes.
    pub fn quant_tensor(&self, hf: &str) -> Result<Option<QuantWeight>> {
        use candle_core::quantized::GgmlDType;
        let Some(name) = gguf_tensor_name(hf).filter(|g| self.has_tensor(g)) else {
            return Ok(None);
        };
        let info = &self.content.tensor_infos[&name];
        let format = match info.ggml_dtype {
            GgmlDType::Q8_0 => QuantFormat::Q8_0,
            GgmlDType::Q4_0 => QuantFormat::Q4_0,
            GgmlDType::Q4_1 => QuantFormat::Q4_1,
            GgmlDType::Q5_0 => QuantFormat::Q5_0,
            GgmlDType::Q5_1 => QuantFormat::Q5_1,
            GgmlDType::Q4K => QuantFormat::Q4K,
            GgmlDType::Q5K => QuantFormat::Q5K,
            GgmlDType::Q6K => QuantFormat::Q6K,
            _ => return Ok(None),
        };
        let (rows, cols) = match info.shape.dims() {
            [r, c] if c.is_multiple_of(format.block_values()) => (*r, *c),
            _ => return Ok(None),
        };
        let q = {
            let mut f = self
                .file
                .lock()
                .map_err(|_| ModelError::bad(&self.path, "file lock poisoned"))?;
            self.content
                .tensor(&mut *f, &name, &Device::Cpu)
                .map_err(|e| ModelError::bad(&self.path, format!("tensor {name}: {e}")))?
        };
        let bytes = q.data()?.into_owned();
        let row_bytes = format.row_bytes(cols);
        if bytes.len() != rows * row_bytes {
            return Err(ModelError::bad(
                &self.path,
                format!(
                    "tensor {name}: {} bytes for {rows}×{cols} {}",
                    bytes.len(),
                    format.as_str()
                ),
            ));
        }
        let mut t = Tensor::from_vec(bytes, (rows, row_bytes), &Device::Cpu)?;
        if let Some(heads) = self.qk_heads(&name)? {
            // Rows move whole: the permutation applies to the blocks as is.
            t = permute_qk(&t, heads, true)?;
        }
        Ok(Some(QuantWeight::new(t, format, cols)?))
    }

    /// The head count whose q/k row order llama.cpp permuted in `name`
    /// (Llama's attn_q / attn_k), if any.
    fn qk_heads(&self, name: &str) -> Result<Option<usize>> {
        if self.arch != "llama" || !(name.contains(".attn_q.") || name.contains(".attn_k.")) {
            return Ok(None);
        }
        let heads = self.req_u64("attention.head_count")? as usize;
        Ok(Some(if name.contains(".attn_k.") {
            self.arch_key("attention.head_count_kv")
                .and_then(meta_u64)
                .map_or(heads, |h| h as usize)
        } else {
            heads
        }))
    }

    /// The chat template (`tokenizer.chat_template`), if any.
    pub fn chat_template(&self) -> Option<String> {
        match self.metadata("tokenizer.chat_template") {
            Some(Value::String(s)) => Some(s.clone()),
            _ => None,
        }
    }

    /// Every `tokenizer.*` metadata entry, as stored (for re-export).
    pub fn tokenizer_metadata(&self) -> Vec<(String, Value)> {
        let mut keys: Vec<&String> = self
            .content
            .metadata
            .keys()
            .filter(|k| k.starts_with("tokenizer."))
            .collect();
        keys.sort();
        keys.into_iter()
            .map(|k| (k.clone(), self.content.metadata[k].clone()))
            .collect()
    }

    /// End-of-generation ids: EOS, and EOT / EOM where the file names them.
    pub fn eos_token_ids(&self) -> Vec<u32> {
        let mut ids = Vec::new();
        for key in [
            "tokenizer.ggml.eos_token_id",
            "tokenizer.ggml.eot_token_id",
            "tokenizer.ggml.eom_token_id",
        ] {
            if let Some(id) = self.metadata(key).and_then(meta_u64) {
                if !ids.contains(&(id as u32)) {
                    ids.push(id as u32);
                }
            }
        }
        ids
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Issue 14: every common GGUF tensor type is read and dequantised — to
    /// exactly candle's dequantisation of the stored blocks, and close to
    /// the values that were quantised.
    #[test]
    fn every_common_tensor_type_is_read_and_dequantised() {
        use candle_core::quantized::{GgmlDType, QTensor};
        let dir = tempfile::tempdir().expect("temp dir");
        let t = Tensor::randn(0f32, 1.0, (4, 256), &Device::Cpu).expect("randn");
        let want = t
            .flatten_all()
            .and_then(|x| x.to_vec1::<f32>())
            .expect("values");
        for (dtype, tol) in [
            (GgmlDType::F32, 0.0),
            (GgmlDType::F16, 1e-3),
            (GgmlDType::BF16, 1e-2),
            (GgmlDType::Q8_0, 2e-2),
            (GgmlDType::Q5_0, 8e-2),
            (GgmlDType::Q5_1, 8e-2),
            (GgmlDType::Q4_0, 0.15),
            (GgmlDType::Q4_1, 0.15),
            (GgmlDType::Q6K, 4e-2),
            (GgmlDType::Q5K, 8e-2),
            (GgmlDType::Q4K, 0.15),
            (GgmlDType::Q3K, 0.3),
            (GgmlDType::Q2K, 0.6),
        ] {
            let q = QTensor::quantize(&t, dtype).expect("quantize");
            let path = dir.path().join(format!("{dtype:?}.gguf"));
            let arch = Value::String("llama".into());
            let mut f = File::create(&path).expect("create");
            candle_core::quantized::gguf_file::write(
                &mut f,
                &[("general.architecture", &arch)],
                &[("blk.0.ffn_down.weight", &q)],
            )
            .expect("write");
            drop(f);
            let g = GgufFile::open(&path).expect("open");
            let got = g
                .raw_tensor("blk.0.ffn_down.weight")
                .and_then(|x| Ok(x.flatten_all()?.to_vec1::<f32>()?))
                .expect("read");
            let exact = q
                .dequantize(&Device::Cpu)
                .and_then(|x| x.flatten_all()?.to_vec1::<f32>())
                .expect("dequantize");
            assert_eq!(got, exact, "{dtype:?}: not the stored blocks");
            let err = got
                .iter()
                .zip(&want)
                .map(|(a, b)| (a - b).powi(2))
                .sum::<f32>()
                .sqrt()
                / want.iter().map(|b| b * b).sum::<f32>().sqrt();
            assert!(err <= tol, "{dtype:?}: relative error {err} > {tol}");
        }
    }

    #[test]
    fn tensor_names_map_to_llama_cpp() {
        assert_eq!(
            gguf_tensor_name("model.layers.3.self_attn.q_proj.weight").as_deref(),
            Some("blk.3.attn_q.weight")
        );
        assert_eq!(
            gguf_tensor_name("model.layers.0.post_attention_layernorm.weight").as_deref(),
            Some("blk.0.ffn_norm.weight")
        );
        assert_eq!(
            gguf_tensor_name("model.layers.1.self_attn.k_norm.weight").as_deref(),
            Some("blk.1.attn_k_norm.weight")
        );
        assert_eq!(gguf_tensor_name("model.layers.x.mlp.up_proj.weight"), None);
    }

    #[test]
    fn qk_permutation_round_trips_and_moves_rows() {
        let w = Tensor::arange(0f32, 8.0, &Device::Cpu)
            .unwrap()
            .reshape((8, 1))
            .unwrap();
        // 2 heads of width 4: halves [0,1 | 2,3] → interleaved [0,2,1,3].
        let p = permute_qk(&w, 2, false).unwrap();
        assert_eq!(
            p.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            vec![0., 2., 1., 3., 4., 6., 5., 7.]
        );
        let back = permute_qk(&p, 2, true).unwrap();
        assert_eq!(
            back.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            (0..8).map(|x| x as f32).collect::<Vec<_>>()
        );
    }

    #[test]
    fn llama31_rope_factors_are_recognised() {
        // Llama 3.1 / 3.2: theta 500000, head_dim 128, factor 8 (3.2: 32), 1, 4, 8192.
        for factor in [8.0, 32.0] {
            let f: Vec<f64> = llama3_factors(500000.0, 128, factor, 1.0, 4.0, 8192.0)
                .into_iter()
                .map(|x| (x as f32) as f64)
                .collect();
            assert_eq!(
                llama3_from_factors(&f, 500000.0, 128),
                Some((factor, 1.0, 4.0, 8192.0))
            );
        }
        // Arbitrary divisors are not Llama 3 scaling.
        let odd: Vec<f64> = (0..64).map(|i| 1.0 + (i % 3) as f64).collect();
        assert_eq!(llama3_from_factors(&odd, 500000.0, 128), None);
    }
}
