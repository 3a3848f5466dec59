//! A whole model — a Hugging Face directory or a GGUF file: weights,
//! tokenizer, chat template and generation defaults, loaded together.

use std::path::{Path, PathBuf};

use candle_core::{DType, Device};

use crate::arch::config::{ids_of, HfConfig, ModelConfig};
use crate::arch::model::Model;
use crate::chat::ChatTemplate;
use crate::error::{ModelError, Result};
use crate::formats::gguf::{is_gguf, GgufFile};
use crate::formats::weights::Checkpoint;
use crate::kernels::ForwardMatmul;
use crate::precision::Precision;
use crate::tokenizer::{load_chat_template, Tokenizer};

/// Sampling defaults from `generation_config.json`.
#[derive(Debug, Clone, Default)]
pub struct GenerationDefaults {
    /// Token ids that end generation (union of config.json,
    /// generation_config.json and the tokenizer's EOS token).
    pub eos_token_ids: Vec<u32>,
    /// Suggested temperature.
    pub temperature: Option<f64>,
    /// Suggested nucleus mass.
    pub top_p: Option<f64>,
    /// Suggested top-k.
    pub top_k: Option<usize>,
}

/// A loaded model.
pub struct Pretrained {
    /// Where it was loaded from: the model directory, or the GGUF file.
    pub dir: PathBuf,
    /// The checked config.
    pub config: ModelConfig,
    /// The network.
    pub model: Model,
    /// The tokenizer.
    pub tokenizer: Tokenizer,
    /// The chat template, if the model has one.
    pub chat_template: Option<ChatTemplate>,
    /// Generation defaults.
    pub generation: GenerationDefaults,
}

/// Where and in which precision to load.
#[derive(Debug, Clone)]
pub struct LoadOptions {
    /// Compute device.
    pub device: Device,
    /// Compute dtype: f32 on CPU; bf16 on CUDA.
    pub dtype: DType,
    /// The matmul weights' precision on the CPU (see
    /// [`Model::set_precision`]); `f32` unless the caller chooses (the CLI
    /// passes its `--dtype`): the numerics are this value's, never a
    /// process-wide setting's.
    pub precision: Precision,
    /// The forward's matmul on the CPU (see [`Model::set_forward_matmul`]):
    /// batch-invariant unless the caller chooses candle's for comparisons.
    pub matmul: ForwardMatmul,
}

/// The numerics a caller picks for the models it loads: the matmul weights'
/// precision and the forward's matmul. The CLI builds it once from
/// `--dtype` and `TEMPER_MATMUL` and passes it down; nothing reads a
/// process-wide setting.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Numerics {
    /// The matmul weights' precision.
    pub precision: Precision,
    /// The forward's matmul.
    pub matmul: ForwardMatmul,
}

impl Numerics {
    /// Load options on `device` in `dtype` with these numerics.
    pub fn load_options(self, device: Device, dtype: DType) -> LoadOptions {
        LoadOptions {
            device,
            dtype,
            precision: self.precision,
            matmul: self.matmul,
        }
    }
}

impl Default for LoadOptions {
    fn default() -> Self {
        Self {
            device: Device::Cpu,
            dtype: DType::F32,
            precision: Precision::F32,
            matmul: ForwardMatmul::default(),
        }
    }
}

impl Pretrained {
    /// Load a model: a Hugging Face directory (config.json, safetensors,
    /// tokenizer.json, and optionally tokenizer_config.json,
    /// chat_template.jinja, generation_config.json), or a GGUF file (config,
    /// weights, tokenizer and chat template all from the file).
    pub fn load(dir: &Path, opts: &LoadOptions) -> Result<Self> {
        if is_gguf(dir) {
            return Self::load_gguf(dir, opts);
        }
        if !dir.is_dir() {
            return Err(ModelError::MissingFile {
                path: dir.to_path_buf(),
                hint: "not a directory or a GGUF file; pass a Hugging Face model directory or a .gguf file".into(),
            });
        }
        let hf = HfConfig::from_file(&dir.join("config.json"))?;
        let config = hf.validate()?;
        let tokenizer = Tokenizer::from_dir(dir)?;
        let ck = Checkpoint::open(dir, opts.dtype, &opts.device)?;
        let mut model = Model::load(&config, &ck, opts.dtype, &opts.device)?;
        model.set_precision(opts.precision)?;
        model.set_forward_matmul(opts.matmul);
        let chat_template = load_chat_template(dir, &tokenizer)?;
        let generation = read_generation_config(dir)?;
        Ok(Self::assemble(
            dir,
            config,
            model,
            tokenizer,
            chat_template,
            generation,
        ))
    }

    /// Load a GGUF file: see [`Pretrained::load`].
    fn load_gguf(path: &Path, opts: &LoadOptions) -> Result<Self> {
        let file = GgufFile::open(path)?;
        let config = file.hf_config()?.validate()?;
        let tokenizer = file.tokenizer()?;
        let chat_template = file
            .chat_template()
            .map(|s| {
                ChatTemplate::new(
                    &s,
                    tokenizer.bos_token().map(str::to_string),
                    tokenizer.eos_token().map(str::to_string),
                )
            })
            .transpose()?;
        let generation = GenerationDefaults {
            eos_token_ids: file.eos_token_ids(),
            ..Default::default()
        };
        let ck = Checkpoint::from_gguf(file, opts.dtype, &opts.device)
            .keep_quantized(opts.precision == Precision::Gguf && opts.dtype == DType::F32);
        let mut model = Model::load(&config, &ck, opts.dtype, &opts.device)?;
        model.set_precision(opts.precision)?;
        model.set_forward_matmul(opts.matmul);
        Ok(Self::assemble(
            path,
            config,
            model,
            tokenizer,
            chat_template,
            generation,
        ))
    }

    fn assemble(
        dir: &Path,
        config: ModelConfig,
        model: Model,
        tokenizer: Tokenizer,
        chat_template: Option<ChatTemplate>,
        mut generation: GenerationDefaults,
    ) -> Self {
        for id in config
            .eos_token_ids
            .iter()
            .copied()
            .chain(tokenizer.eos_token().and_then(|t| tokenizer.token_id(t)))
        {
            if !generation.eos_token_ids.contains(&id) {
                generation.eos_token_ids.push(id);
            }
        }
        tracing::info!(
            dir = %dir.display(),
            family = config.family.model_type(),
            layers = config.num_layers,
            hidden = config.hidden_size,
            vocab = config.vocab_size,
            "loaded model"
        );
        Self {
            dir: dir.to_path_buf(),
            config,
            model,
            tokenizer,
            chat_template,
            generation,
        }
    }
}

fn read_generation_config(dir: &Path) -> Result<GenerationDefaults> {
    let path = dir.join("generation_config.json");
    if !path.exists() {
        return Ok(GenerationDefaults::default());
    }
    let text = std::fs::read_to_string(&path).map_err(|e| ModelError::io(&path, e))?;
    let v: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| ModelError::bad(&path, e))?;
    Ok(GenerationDefaults {
        eos_token_ids: ids_of(v.get("eos_token_id")),
        temperature: v.get("temperature").and_then(|x| x.as_f64()),
        top_p: v.get("top_p").and_then(|x| x.as_f64()),
        top_k: v.get("top_k").and_then(|x| x.as_u64()).map(|x| x as usize),
    })
}
