//! LoRA adapters: trainable low-rank updates `W + (alpha/r)·B·A` on the linear
//! layers of a frozen base, saved and loaded in the PEFT layout
//! (`adapter_config.json` + `adapter_model.safetensors`) so PEFT and vLLM can
//! use them.
//!
//! An adapter is separate from the [`Model`](crate::Model): the base weights
//! are shared, read-only, and every forward call names the adapter it runs
//! with (or none).

use std::collections::HashMap;
use std::path::Path;

use candle_core::{DType, Device, Tensor, Var};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

use crate::arch::config::ModelConfig;
use crate::error::{ModelError, Result};

/// A linear layer LoRA can target, named as in the checkpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Target {
    /// `self_attn.q_proj`
    Q,
    /// `self_attn.k_proj`
    K,
    /// `self_attn.v_proj`
    V,
    /// `self_attn.o_proj`
    O,
    /// `mlp.gate_proj`
    Gate,
    /// `mlp.up_proj`
    Up,
    /// `mlp.down_proj`
    Down,
}

impl Target {
    /// Every target, in checkpoint order.
    pub const ALL: [Target; 7] = [
        Target::Q,
        Target::K,
        Target::V,
        Target::O,
        Target::Gate,
        Target::Up,
        Target::Down,
    ];

    /// The module name (`q_proj`, ...).
    pub fn name(self) -> &'static str {
        match self {
            Target::Q => "q_proj",
            Target::K => "k_proj",
            Target::V => "v_proj",
            Target::O => "o_proj",
            Target::Gate => "gate_proj",
            Target::Up => "up_proj",
            Target::Down => "down_proj",
        }
    }

    /// Path of the module inside a decoder layer.
    pub fn path(self) -> &'static str {
        match self {
            Target::Q => "self_attn.q_proj",
            Target::K => "self_attn.k_proj",
            Target::V => "self_attn.v_proj",
            Target::O => "self_attn.o_proj",
            Target::Gate => "mlp.gate_proj",
            Target::Up => "mlp.up_proj",
            Target::Down => "mlp.down_proj",
        }
    }

    /// Parse a module name.
    pub fn from_name(s: &str) -> Option<Target> {
        Target::ALL.into_iter().find(|t| t.name() == s)
    }

    /// `(out_features, in_features)` of this module.
    pub fn shape(self, cfg: &ModelConfig) -> (usize, usize) {
        let h = cfg.hidden_size;
        let q = cfg.num_heads * cfg.head_dim;
        let kv = cfg.num_kv_heads * cfg.head_dim;
        let i = cfg.intermediate_size;
        match self {
            Target::Q => (q, h),
            Target::K | Target::V => (kv, h),
            Target::O => (h, q),
            Target::Gate | Target::Up => (i, h),
            Target::Down => (h, i),
        }
    }
}

/// Shape of an adapter.
#[derive(Debug, Clone, PartialEq)]
pub struct LoraConfig {
    /// Rank r.
    pub rank: usize,
    /// Scaling numerator: the update is `alpha / r · B·A` (or `alpha/√r` with rsLoRA).
    pub alpha: f64,
    /// Modules that get an adapter.
    pub targets: Vec<Target>,
    /// rsLoRA scaling `alpha/√r`.
    pub use_rslora: bool,
}

impl LoraConfig {
    /// The default scaling numerator: what `[lora] alpha` defaults to, and
    /// what the training API (whose protocol has no alpha) always uses.
    pub const DEFAULT_ALPHA: f64 = 32.0;
}

impl Default for LoraConfig {
    /// Rank 16, alpha 32, every linear layer (the prime-rl defaults).
    fn default() -> Self {
        Self {
            rank: 16,
            alpha: Self::DEFAULT_ALPHA,
            targets: Target::ALL.to_vec(),
            use_rslora: false,
        }
    }
}

impl LoraConfig {
    /// The factor the low-rank product is multiplied by.
    pub fn scale(&self) -> f64 {
        if self.use_rslora {
            self.alpha / (self.rank as f64).sqrt()
        } else {
            self.alpha / self.rank as f64
        }
    }
}

/// One adapted module: `A` is `[r, in]`, `B` is `[out, r]`.
#[derive(Debug, Clone)]
pub struct LoraPair {
    /// Down projection.
    pub a: Var,
    /// Up projection.
    pub b: Var,
}

/// A LoRA adapter for every decoder layer of one model.
#[derive(Debug, Clone)]
pub struct LoraAdapter {
    config: LoraConfig,
    /// False for an inference view: forwards build no autograd graph.
    track_gradients: bool,
    /// `layers[i][target]`.
    layers: Vec<HashMap<Target, LoraPair>>,
}

/// `adapter_config.json` in PEFT's format (the fields we read and write).
#[derive(Debug, Clone, Serialize, Deserialize)]
struct PeftConfig {
    #[serde(default = "peft_type")]
    peft_type: String,
    #[serde(default)]
    task_type: Option<String>,
    r: usize,
    lora_alpha: f64,
    target_modules: serde_json::Value,
    #[serde(default)]
    lora_dropout: f64,
    #[serde(default)]
    bias: Option<String>,
    #[serde(default)]
    use_rslora: bool,
    #[serde(default)]
    fan_in_fan_out: bool,
    #[serde(default)]
    base_model_name_or_path: Option<String>,
    #[serde(default)]
    rank_pattern: serde_json::Value,
    #[serde(default)]
    alpha_pattern: serde_json::Value,
    #[serde(default)]
    modules_to_save: serde_json::Value,
    #[serde(default)]
    use_dora: bool,
}

fn peft_type() -> String {
    "LORA".into()
}

fn is_empty_json(v: &serde_json::Value) -> bool {
    match v {
        serde_json::Value::Null => true,
        serde_json::Value::Object(o) => o.is_empty(),
        serde_json::Value::Array(a) => a.is_empty(),
        _ => false,
    }
}

/// PEFT's tensor name for one half of one adapted module.
fn peft_key(layer: usize, target: Target, half: &str) -> String {
    format!(
        "base_model.model.model.layers.{layer}.{}.lora_{half}.weight",
        target.path()
    )
}

impl LoraAdapter {
    /// A fresh adapter: `A` ~ U(-1/√in, 1/√in) (PEFT's Kaiming-uniform
    /// default), `B` = 0, so the adapted model starts equal to the base.
    pub fn new(
        cfg: &ModelConfig,
        config: LoraConfig,
        seed: u64,
        dtype: DType,
        device: &Device,
    ) -> Result<Self> {
        if config.rank == 0 {
            return Err(ModelError::InvalidInput("LoRA rank must be >= 1".into()));
        }
        if config.targets.is_empty() {
            return Err(ModelError::InvalidInput(
                "LoRA needs at least one target module".into(),
            ));
        }
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let mut layers = Vec::with_capacity(cfg.num_layers);
        for _ in 0..cfg.num_layers {
            let mut map = HashMap::new();
            for &t in &config.targets {
                let (out, inp) = t.shape(cfg);
                let bound = 1.0 / (inp as f32).sqrt();
                let a: Vec<f32> = (0..config.rank * inp)
                    .map(|_| rng.random_range(-bound..bound))
                    .collect();
                let a = Tensor::from_vec(a, (config.rank, inp), device)?.to_dtype(dtype)?;
                let b = Tensor::zeros((out, config.rank), dtype, device)?;
                map.insert(
                    t,
                    LoraPair {
                        a: Var::from_tensor(&a)?,
                        b: Var::from_tensor(&b)?,
                    },
                );
            }
            layers.push(map);
        }
        Ok(Self {
            config,
            track_gradients: true,
            layers,
        })
    }

    /// The adapter's shape.
    pub fn config(&self) -> &LoraConfig {
        &self.config
    }

    /// The same tensors (shared, not copied) marked for inference: forwards
    /// through the view compute the same numbers but record no autograd
    /// graph, which makes sampling with a training adapter cheaper.
    pub fn inference_view(&self) -> Self {
        Self {
            track_gradients: false,
            ..self.clone()
        }
    }

    /// Whether forwards through this adapter record gradients.
    pub fn tracks_gradients(&self) -> bool {
        self.track_gradients
    }

    /// Multiplier of `B·A`.
    pub fn scale(&self) -> f64 {
        self.config.scale()
    }

    /// The adapted module `target` of layer `layer`, if any.
    pub fn get(&self, layer: usize, target: Target) -> Option<&LoraPair> {
        self.layers.get(layer).and_then(|m| m.get(&target))
    }

    /// Every trainable tensor with its PEFT name, in a stable order.
    pub fn named_vars(&self) -> Vec<(String, Var)> {
        let mut out = Vec::new();
        for (i, m) in self.layers.iter().enumerate() {
            let mut ts: Vec<_> = m.keys().copied().collect();
            ts.sort();
            for t in ts {
                if let Some(p) = m.get(&t) {
                    out.push((peft_key(i, t, "A"), p.a.clone()));
                    out.push((peft_key(i, t, "B"), p.b.clone()));
                }
            }
        }
        out
    }

    /// Just the trainable tensors.
    pub fn vars(&self) -> Vec<Var> {
        self.named_vars().into_iter().map(|(_, v)| v).collect()
    }

    /// A deep copy whose tensors share nothing with `self` (a frozen snapshot
    /// for the sampler while training goes on).
    pub fn snapshot(&self) -> Result<Self> {
        let mut layers = Vec::with_capacity(self.layers.len());
        for m in &self.layers {
            let mut n = HashMap::new();
            for (t, p) in m {
                n.insert(
                    *t,
                    LoraPair {
                        a: Var::from_tensor(&p.a.as_tensor().copy()?)?,
                        b: Var::from_tensor(&p.b.as_tensor().copy()?)?,
                    },
                );
            }
            layers.push(n);
        }
        Ok(Self {
            config: self.config.clone(),
            track_gradients: self.track_gradients,
            layers,
        })
    }

    /// Write `adapter_config.json` + `adapter_model.safetensors` (PEFT layout)
    /// into `dir`, atomically: files are written under temporary names and
    /// renamed.
    pub fn save_peft(&self, dir: &Path, base_model: &str) -> Result<()> {
        std::fs::create_dir_all(dir).map_err(|e| ModelError::io(dir, e))?;
        let cfg = PeftConfig {
            peft_type: "LORA".into(),
            task_type: Some("CAUSAL_LM".into()),
            r: self.config.rank,
            lora_alpha: self.config.alpha,
            target_modules: serde_json::Value::Array(
                self.config
                    .targets
                    .iter()
                    .map(|t| serde_json::Value::String(t.name().into()))
                    .collect(),
            ),
            lora_dropout: 0.0,
            bias: Some("none".into()),
            use_rslora: self.config.use_rslora,
            fan_in_fan_out: false,
            base_model_name_or_path: Some(base_model.to_string()),
            rank_pattern: serde_json::json!({}),
            alpha_pattern: serde_json::json!({}),
            modules_to_save: serde_json::Value::Null,
            use_dora: false,
        };
        let cfg_text = serde_json::to_string_pretty(&cfg)
            .map_err(|e| ModelError::bad(dir, format!("serialising adapter config: {e}")))?;
        let tensors: Vec<(String, Tensor)> = self
            .named_vars()
            .into_iter()
            .map(|(n, v)| (n, v.as_tensor().clone()))
            .collect();
        let weights_tmp = dir.join(".adapter_model.safetensors.tmp");
        candle_core::safetensors::save(
            &tensors.iter().cloned().collect::<HashMap<_, _>>(),
            &weights_tmp,
        )?;
        let cfg_tmp = dir.join(".adapter_config.json.tmp");
        std::fs::write(&cfg_tmp, cfg_text).map_err(|e| ModelError::io(&cfg_tmp, e))?;
        let weights = dir.join("adapter_model.safetensors");
        std::fs::rename(&weights_tmp, &weights).map_err(|e| ModelError::io(&weights, e))?;
        let cfg_path = dir.join("adapter_config.json");
        std::fs::rename(&cfg_tmp, &cfg_path).map_err(|e| ModelError::io(&cfg_path, e))?;
        Ok(())
    }

    /// Load a PEFT LoRA adapter directory for a model with config `cfg`.
    pub fn load_peft(dir: &Path, cfg: &ModelConfig, dtype: DType, device: &Device) -> Result<Self> {
        let cfg_path = dir.join("adapter_config.json");
        let text = std::fs::read_to_string(&cfg_path).map_err(|e| {
            if e.kind() == std::io::ErrorKind::NotFound {
                ModelError::MissingFile {
                    path: cfg_path.clone(),
                    hint: "a PEFT adapter directory needs adapter_config.json".into(),
                }
            } else {
                ModelError::io(&cfg_path, e)
            }
        })?;
        let pc: PeftConfig =
            serde_json::from_str(&text).map_err(|e| ModelError::bad(&cfg_path, e))?;
        if pc.peft_type != "LORA" {
            return Err(ModelError::bad(
                &cfg_path,
                format!("peft_type {:?} (only LORA)", pc.peft_type),
            ));
        }
        for (what, bad) in [
            ("rank_pattern", !is_empty_json(&pc.rank_pattern)),
            ("alpha_pattern", !is_empty_json(&pc.alpha_pattern)),
            ("modules_to_save", !is_empty_json(&pc.modules_to_save)),
            ("use_dora", pc.use_dora),
            ("fan_in_fan_out", pc.fan_in_fan_out),
            ("bias", pc.bias.as_deref().is_some_and(|b| b != "none")),
        ] {
            if bad {
                return Err(ModelError::bad(
                    &cfg_path,
                    format!("{what} is not supported"),
                ));
            }
        }
        let targets: Vec<Target> = match &pc.target_modules {
            serde_json::Value::Array(a) => {
                let mut ts = Vec::new();
                for v in a {
                    let name = v.as_str().unwrap_or_default();
                    let t = Target::from_name(name).ok_or_else(|| {
                        ModelError::bad(&cfg_path, format!("unsupported target module {name:?}"))
                    })?;
                    ts.push(t);
                }
                ts.sort();
                ts
            }
            serde_json::Value::String(s) if s == "all-linear" => Target::ALL.to_vec(),
            other => {
                return Err(ModelError::bad(
                    &cfg_path,
                    format!("target_modules {other} (expected a list of module names)"),
                ))
            }
        };
        let config = LoraConfig {
            rank: pc.r,
            alpha: pc.lora_alpha,
            targets: targets.clone(),
            use_rslora: pc.use_rslora,
        };
        let st_path = dir.join("adapter_model.safetensors");
        if !st_path.exists() {
            return Err(ModelError::MissingFile {
                path: st_path,
                hint: "a PEFT adapter directory needs adapter_model.safetensors".into(),
            });
        }
        let tensors = candle_core::safetensors::load(&st_path, device)?;
        let mut layers = Vec::with_capacity(cfg.num_layers);
        for i in 0..cfg.num_layers {
            let mut map = HashMap::new();
            for &t in &targets {
                let (out, inp) = t.shape(cfg);
                let get = |half: &str, shape: [usize; 2]| -> Result<Var> {
                    let key = peft_key(i, t, half);
                    // PEFT writes without the adapter name; accept `.default.` too.
                    let alt =
                        key.replace(&format!("lora_{half}."), &format!("lora_{half}.default."));
                    let tensor =
                        tensors
                            .get(&key)
                            .or_else(|| tensors.get(&alt))
                            .ok_or_else(|| ModelError::MissingTensor {
                                name: key.clone(),
                                source_desc: st_path.display().to_string(),
                            })?;
                    if tensor.dims() != shape {
                        return Err(ModelError::ShapeMismatch {
                            name: key,
                            expected: shape.to_vec(),
                            actual: tensor.dims().to_vec(),
                        });
                    }
                    Ok(Var::from_tensor(&tensor.to_dtype(dtype)?)?)
                };
                let a = get("A", [pc.r, inp])?;
                let b = get("B", [out, pc.r])?;
                map.insert(t, LoraPair { a, b });
            }
            layers.push(map);
        }
        Ok(Self {
            config,
            track_gradients: true,
            layers,
        })
    }
}
