//! The validated plan of a run: the config file as written ([`RlConfig`],
//! [`SftConfig`]) becomes an [`RlPlan`] / [`SftPlan`] by one `TryFrom`
//! each, and every check of a run's settings lives here. The loops take a
//! plan, so they never see a config that was not checked; what they need
//! in a richer form than the file's (the loss, the LoRA config, where the
//! model comes from) the plan holds as a type.
//!
//! A plan reads through to its file's sections (`plan.sampling.temperature`),
//! which it never changes: the file is what `config.toml` in the run
//! directory saves.

use std::ops::Deref;
use std::path::PathBuf;

use temper_engine::Loss;
use temper_model::{ForwardMatmul, LoraConfig, Precision, Target};

use crate::config::{
    DataSection, DistillSection, DpoConfig, EnvSection, LoraSection, ModelSection, PrefDataSection,
    RemoteTrainerSection, RlConfig, RlTrainerSection, SftConfig, SftTrainerSection,
};
use crate::error::{Result, RlError};
use crate::preset::TinyPreset;

/// Where the base model comes from.
#[derive(Debug, Clone, PartialEq)]
pub enum ModelSource {
    /// A Hugging Face model directory or a GGUF file.
    Path(PathBuf),
    /// The built-in tiny model of these sizes, written into the run directory.
    Tiny(TinyPreset),
}

/// The model to train and how: `[model]` + `[lora]`, checked.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelPlan {
    /// The base model.
    pub source: ModelSource,
    /// Continue from this PEFT adapter (its rank, alpha and targets win).
    pub adapter: Option<PathBuf>,
    /// The LoRA adapter to train; `None` trains every weight.
    pub lora: Option<LoraConfig>,
    /// The matmul weights' precision (`[model] dtype`, else `--dtype`).
    pub precision: Precision,
    /// The forward's matmul (`[model] matmul`, else `TEMPER_MATMUL`).
    pub matmul: ForwardMatmul,
}

/// The optimiser's schedule: what RL and SFT share of `[trainer]`.
#[derive(Debug, Clone, PartialEq)]
pub struct Optim {
    /// Learning rate.
    pub lr: f64,
    /// Linear warm-up steps.
    pub warmup_steps: u64,
    /// Groups (RL) or conversations (SFT) per optimizer step, >= 1.
    pub batch_size: usize,
    /// Sequences per forward_backward call; 0 = all at once.
    pub micro_batch: usize,
    /// Global gradient-norm clip; 0 disables.
    pub grad_clip: f64,
    /// Decoupled weight decay.
    pub weight_decay: f64,
    /// Optimizer steps.
    pub max_steps: u64,
}

/// The optimiser fields of a `[trainer]` section. RL's and SFT's sections
/// are different types that share these fields by name, so one macro reads
/// both rather than two hand-written copies.
macro_rules! optim_of {
    ($t:expr) => {
        Optim {
            lr: $t.lr,
            warmup_steps: $t.warmup_steps,
            batch_size: $t.batch_size,
            micro_batch: $t.micro_batch,
            grad_clip: $t.grad_clip,
            weight_decay: $t.weight_decay,
            max_steps: $t.max_steps,
        }
    };
}

/// Linear warm-up to `lr` over `warmup` steps, then constant.
pub fn learning_rate(lr: f64, warmup: u64, step: u64) -> f64 {
    if warmup == 0 {
        lr
    } else {
        lr * ((step + 1) as f64 / warmup as f64).min(1.0)
    }
}

impl Optim {
    /// Linear warm-up to `lr` over `warmup_steps`, then constant.
    pub fn learning_rate(&self, step: u64) -> f64 {
        learning_rate(self.lr, self.warmup_steps, step)
    }

    /// Sequences per forward_backward call for a batch of `n`.
    pub fn micro_batch_of(&self, n: usize) -> usize {
        if self.micro_batch == 0 {
            n.max(1)
        } else {
            self.micro_batch
        }
    }
}

/// Where the teacher of on-policy distillation runs.
#[derive(Debug, Clone, PartialEq)]
pub enum TeacherSource {
    /// In process, by the same engine: a model directory or GGUF file, with
    /// an optional PEFT adapter.
    Local {
        /// The model.
        path: PathBuf,
        /// The adapter applied to it.
        adapter: Option<PathBuf>,
        /// Its matmul weights' precision.
        precision: Precision,
    },
    /// A server that returns prompt logprobs for token ids.
    Endpoint {
        /// Base URL.
        url: String,
        /// The model name on it.
        model: String,
        /// Environment variable holding its API key.
        api_key_env: Option<String>,
    },
}

impl std::fmt::Display for TeacherSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TeacherSource::Local { path, adapter, .. } => {
                write!(f, "{}", path.display())?;
                match adapter {
                    Some(a) => write!(f, " + adapter {}", a.display()),
                    None => Ok(()),
                }
            }
            TeacherSource::Endpoint { url, model, .. } => write!(f, "{model} at {url}"),
        }
    }
}

/// `[distill]`, checked: the teacher and how its reverse KL mixes with the
/// environment's reward.
#[derive(Debug, Clone, PartialEq)]
pub struct DistillPlan {
    /// The teacher.
    pub teacher: TeacherSource,
    /// Weight of `logp_teacher − logp_student` in each token's advantage.
    pub kl_coef: f64,
    /// Weight of the group-relative reward advantage.
    pub reward_coef: f64,
}

/// A checked `temper train rl` run.
#[derive(Debug, Clone)]
pub struct RlPlan {
    cfg: RlConfig,
    /// `[model]` + `[lora]`.
    pub model: ModelPlan,
    /// `[trainer]`'s optimiser settings.
    pub optim: Optim,
    /// `[trainer] loss` with its clips.
    pub loss: Loss,
    /// `[remote_trainer]` when it has a `url`.
    pub remote: Option<RemoteTrainerSection>,
    /// `[distill]` when it names a teacher: on-policy distillation.
    pub distill: Option<DistillPlan>,
}

/// Where SFT's conversations come from.
#[derive(Debug, Clone, PartialEq)]
pub enum DataSource {
    /// A chat JSONL/Parquet file, for at most `epochs` passes.
    File {
        /// The file.
        path: PathBuf,
        /// Passes over it (`None`: until `max_steps`).
        epochs: Option<u64>,
    },
    /// An environment's training rows with their reference answers.
    Env {
        /// The environment.
        env: EnvSection,
        /// How the answer becomes the assistant message (`{answer}` replaced).
        answer_format: String,
        /// Fraction (0..=1) of answers replaced by a near miss.
        teacher_noise: f64,
    },
}

/// A checked `temper train sft` run.
#[derive(Debug, Clone)]
pub struct SftPlan {
    cfg: SftConfig,
    /// `[model]` + `[lora]`.
    pub model: ModelPlan,
    /// `[trainer]`'s optimiser settings.
    pub optim: Optim,
    /// `[data]`.
    pub data: DataSource,
    /// `[remote_trainer]` when it has a `url`.
    pub remote: Option<RemoteTrainerSection>,
}

impl Deref for RlPlan {
    type Target = RlConfig;
    fn deref(&self) -> &RlConfig {
        &self.cfg
    }
}

impl Deref for SftPlan {
    type Target = SftConfig;
    fn deref(&self) -> &SftConfig {
        &self.cfg
    }
}

impl RlPlan {
    /// The file this plan was checked from (saved as the run's `config.toml`).
    pub fn config(&self) -> &RlConfig {
        &self.cfg
    }
}

impl SftPlan {
    /// The file this plan was checked from (saved as the run's `config.toml`).
    pub fn config(&self) -> &SftConfig {
        &self.cfg
    }
}

fn bad<T>(msg: impl Into<String>) -> Result<T> {
    Err(RlError::Config(msg.into()))
}

impl TryFrom<RlConfig> for RlPlan {
    type Error = RlError;

    fn try_from(cfg: RlConfig) -> Result<Self> {
        let remote = remote_of(&cfg.remote_trainer, &cfg.lora)?;
        let model = model_plan(&cfg.model, &cfg.lora)?;
        check_env_weights(&cfg.env.iter().map(|e| e.weight).collect::<Vec<_>>())?;
        if cfg.trainer.batch_size == 0 || cfg.sampling.group_size == 0 {
            return bad("trainer.batch_size and sampling.group_size must be >= 1");
        }
        cfg.sampling.check()?;
        if cfg.sampler.url.is_some() && !cfg.lora.enabled {
            return bad("an external sampler receives LoRA adapters: set lora.enabled = true");
        }
        if cfg.sampler.url.is_some() && remote.is_some() {
            // The weights never leave the service, so no adapter can be
            // pushed to another server: the service samples them itself.
            return bad(
                "with [remote_trainer] url, rollouts are sampled by the training service's own \
                 sampling client (the weights stay there): leave [sampler] url unset",
            );
        }
        let loss = rl_loss(&cfg.trainer)?;
        let distill = distill_plan(&cfg.distill, model.precision)?;
        let optim = optim_of!(cfg.trainer);
        Ok(Self {
            model,
            optim,
            loss,
            remote,
            distill,
            cfg,
        })
    }
}

/// The optimiser of SFT's `[trainer]` section (DPO uses the same), checked.
fn sft_optim(t: &SftTrainerSection) -> Result<Optim> {
    if t.batch_size == 0 {
        return bad("trainer.batch_size must be >= 1");
    }
    if t.max_seq_len == 0 {
        return bad("trainer.max_seq_len must be >= 1");
    }
    Ok(optim_of!(t))
}

impl TryFrom<SftConfig> for SftPlan {
    type Error = RlError;

    fn try_from(cfg: SftConfig) -> Result<Self> {
        let remote = remote_of(&cfg.remote_trainer, &cfg.lora)?;
        let model = model_plan(&cfg.model, &cfg.lora)?;
        let data = data_source(&cfg.data)?;
        let optim = sft_optim(&cfg.trainer)?;
        Ok(Self {
            model,
            optim,
            data,
            remote,
            cfg,
        })
    }
}

/// DPO's loss on a pair's log-ratios (TRL's `loss_type`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum DpoLoss {
    /// `−log σ(β·((π_c − ref_c) − (π_r − ref_r)))`, sums over completion tokens.
    Sigmoid,
    /// `(Δ_c/n_c − Δ_r/n_r − 1/(2β))²`: log-ratios averaged per completion token.
    Ipo,
}

/// Where a DPO run's pairs come from.
#[derive(Debug, Clone, PartialEq)]
pub enum PrefSource {
    /// A preference file, for at most `epochs` passes, with its held-out pairs.
    File {
        /// The training file.
        path: PathBuf,
        /// Held-out pairs from a second file.
        eval_path: Option<PathBuf>,
        /// Or this fraction of `path` held out.
        eval_fraction: f64,
        /// Passes over it.
        epochs: Option<u64>,
    },
    /// Online: groups sampled from an environment's prompts.
    Env {
        /// The environment.
        env: EnvSection,
        /// Completions per prompt (>= 2).
        group_size: usize,
        /// Sampling temperature.
        temperature: f64,
        /// Most tokens per completion.
        max_tokens: usize,
    },
}

/// A checked `temper train dpo` run.
#[derive(Debug, Clone)]
pub struct DpoPlan {
    cfg: DpoConfig,
    /// `[model]` + `[lora]`.
    pub model: ModelPlan,
    /// `[trainer]`'s optimiser settings.
    pub optim: Optim,
    /// `[data]`.
    pub data: PrefSource,
    /// `[dpo] loss`.
    pub loss: DpoLoss,
    /// `[dpo] beta`.
    pub beta: f64,
}

impl Deref for DpoPlan {
    type Target = DpoConfig;
    fn deref(&self) -> &DpoConfig {
        &self.cfg
    }
}

impl DpoPlan {
    /// The file this plan was checked from (saved as the run's `config.toml`).
    pub fn config(&self) -> &DpoConfig {
        &self.cfg
    }
}

impl TryFrom<DpoConfig> for DpoPlan {
    type Error = RlError;

    fn try_from(cfg: DpoConfig) -> Result<Self> {
        let model = model_plan(&cfg.model, &cfg.lora)?;
        let loss = match cfg.dpo.loss.as_str() {
            "sigmoid" => DpoLoss::Sigmoid,
            "ipo" => DpoLoss::Ipo,
            other => return bad(format!("dpo.loss {other:?}: use \"sigmoid\" or \"ipo\"")),
        };
        if !(cfg.dpo.beta.is_finite() && cfg.dpo.beta > 0.0) {
            return bad(format!("dpo.beta must be > 0, got {}", cfg.dpo.beta));
        }
        let data = pref_source(&cfg.data)?;
        let optim = sft_optim(&cfg.trainer)?;
        Ok(Self {
            model,
            optim,
            data,
            loss,
            beta: cfg.dpo.beta,
            cfg,
        })
    }
}

fn pref_source(d: &PrefDataSection) -> Result<PrefSource> {
    match (&d.path, &d.env) {
        (Some(path), None) => {
            if !(0.0..1.0).contains(&d.eval_fraction) {
                return bad("data.eval_fraction must be in [0, 1)");
            }
            if d.eval_path.is_some() && d.eval_fraction > 0.0 {
                return bad("[data] has both `eval_path` and `eval_fraction`; pick one");
            }
            Ok(PrefSource::File {
                path: path.clone(),
                eval_path: d.eval_path.clone(),
                eval_fraction: d.eval_fraction,
                epochs: d.epochs,
            })
        }
        (None, Some(env)) => {
            if d.eval_path.is_some() || d.eval_fraction > 0.0 || d.epochs.is_some() {
                return bad(
                    "data.eval_path, eval_fraction and epochs go with a preference file (`path`); \
                     online DPO is evaluated on the environment ([eval])",
                );
            }
            if d.group_size < 2 {
                return bad("data.group_size must be >= 2 (a pair needs two completions)");
            }
            if !(d.temperature.is_finite() && d.temperature > 0.0) {
                return bad("data.temperature must be > 0 (greedy groups are all alike)");
            }
            if d.max_tokens == 0 {
                return bad("data.max_tokens must be >= 1");
            }
            Ok(PrefSource::Env {
                env: env.clone(),
                group_size: d.group_size,
                temperature: d.temperature,
                max_tokens: d.max_tokens,
            })
        }
        (Some(_), Some(_)) => bad("[data] has both `path` and `env`; pick one"),
        (None, None) => bad("[data] needs `path` (preference JSONL/Parquet) or `env` (online DPO)"),
    }
}

/// At least one environment, every mixing weight finite and > 0.
pub(crate) fn check_env_weights(weights: &[f64]) -> Result<()> {
    if weights.is_empty() {
        return bad("at least one [[env]] is needed");
    }
    if weights.iter().any(|w| !(w.is_finite() && *w > 0.0)) {
        return bad("env weights must be > 0");
    }
    Ok(())
}

/// A `dtype` key as a [`Precision`] (unset: `unset`); errors name the
/// section `what`.
fn precision_of(dtype: Option<&str>, what: &str, unset: Precision) -> Result<Precision> {
    match dtype {
        Some(d) => d
            .parse::<Precision>()
            .map_err(|e| RlError::Config(format!("{what} {e}"))),
        None => Ok(unset),
    }
}

/// `[distill]` with a teacher, checked; `None` without one. A local
/// teacher without a `dtype` gets the student's precision (`student`).
fn distill_plan(d: &DistillSection, student: Precision) -> Result<Option<DistillPlan>> {
    let Some(t) = &d.teacher else {
        return Ok(None);
    };
    if !(d.kl_coef.is_finite() && d.kl_coef > 0.0) {
        return bad(format!(
            "distill.kl_coef must be > 0, got {} (without the KL term this is plain RL: remove [distill])",
            d.kl_coef
        ));
    }
    if !(d.reward_coef.is_finite() && d.reward_coef >= 0.0) {
        return bad(format!(
            "distill.reward_coef must be >= 0, got {}",
            d.reward_coef
        ));
    }
    let teacher = match (&t.path, &t.url) {
        (Some(path), None) => {
            if t.model.is_some() || t.api_key_env.is_some() {
                return bad("distill.teacher: `model` and `api_key_env` go with `url`, not `path`");
            }
            let precision = precision_of(t.dtype.as_deref(), "distill.teacher:", student)?;
            TeacherSource::Local {
                path: path.clone(),
                adapter: t.adapter.clone(),
                precision,
            }
        }
        (None, Some(url)) => {
            if t.adapter.is_some() || t.dtype.is_some() {
                return bad(
                    "distill.teacher: `adapter` and `dtype` go with a local `path`; an endpoint \
                     serves its adapter under a model name (`model`)",
                );
            }
            let Some(model) = &t.model else {
                return bad(
                    "distill.teacher: an endpoint teacher needs `model` (its name on the server)",
                );
            };
            TeacherSource::Endpoint {
                url: url.trim_end_matches('/').to_string(),
                model: model.clone(),
                api_key_env: t.api_key_env.clone(),
            }
        }
        (Some(_), Some(_)) => return bad("distill.teacher has both `path` and `url`; pick one"),
        (None, None) => {
            return bad("distill.teacher needs `path` (a local model) or `url` (an endpoint)")
        }
    };
    Ok(Some(DistillPlan {
        teacher,
        kl_coef: d.kl_coef,
        reward_coef: d.reward_coef,
    }))
}

/// `[trainer] loss` as a [`Loss`]: the policy-gradient losses only (the
/// names and clip defaults are temper-engine's).
fn rl_loss(t: &RlTrainerSection) -> Result<Loss> {
    let rl = ["importance_sampling", "ppo", "cispo"];
    if !rl.contains(&t.loss.as_str()) {
        return bad(format!("trainer.loss {:?}: use {}", t.loss, rl.join(", ")));
    }
    // Only the clipped losses take clip thresholds (the engine refuses keys a
    // loss does not take).
    let config = if t.loss == "importance_sampling" {
        serde_json::Map::new()
    } else {
        serde_json::Map::from_iter([
            ("clip_low_threshold".to_string(), t.clip_low.into()),
            ("clip_high_threshold".to_string(), t.clip_high.into()),
        ])
    };
    Loss::from_name(&t.loss, &config).map_err(|e| RlError::Config(format!("trainer.loss: {e}")))
}

impl ModelPlan {
    /// `[model]` + `[lora]`, checked.
    pub fn of(m: &ModelSection, l: &LoraSection) -> Result<ModelPlan> {
        model_plan(m, l)
    }
}

fn model_plan(m: &ModelSection, l: &LoraSection) -> Result<ModelPlan> {
    let source = match (&m.path, m.preset.as_deref()) {
        (Some(p), None) => ModelSource::Path(p.clone()),
        (None, Some("tiny")) => {
            m.tiny.validate()?;
            ModelSource::Tiny(m.tiny.clone())
        }
        (None, Some(other)) => {
            return bad(format!("unknown model preset {other:?} (known: \"tiny\")"))
        }
        (Some(_), Some(_)) => return bad("[model] has both `path` and `preset`; pick one"),
        (None, None) => {
            return bad("[model] needs `path` (a Hugging Face directory) or `preset = \"tiny\"`")
        }
    };
    if m.adapter.is_some() && !l.enabled {
        return bad("[model] adapter needs [lora] enabled = true (it continues a LoRA run)");
    }
    // Unset: f32 (the CLI fills an unset key from `--dtype` before planning).
    let precision = precision_of(m.dtype.as_deref(), "[model]", Precision::F32)?;
    if precision != Precision::F32 && !l.enabled {
        return bad(format!(
            "{} weights (from [model] dtype or --dtype) need [lora] enabled = true: full-parameter training keeps f32 weights; set [model] dtype = \"f32\"",
            precision.as_str()
        ));
    }
    let matmul = match m.matmul.as_deref() {
        Some(s) => s.parse::<ForwardMatmul>().map_err(|e| match e {
            temper_model::ModelError::InvalidInput(m) => RlError::Config(format!("[model] {m}")),
            other => RlError::Config(other.to_string()),
        })?,
        None => ForwardMatmul::default(),
    };
    Ok(ModelPlan {
        source,
        adapter: m.adapter.clone(),
        precision,
        matmul,
        lora: if l.enabled {
            Some(lora_config(l)?)
        } else {
            None
        },
    })
}

/// The LoRA config of `[lora]` (whether or not it is enabled).
pub fn lora_config(l: &LoraSection) -> Result<LoraConfig> {
    let targets = if l.targets.is_empty() {
        Target::ALL.to_vec()
    } else {
        l.targets
            .iter()
            .map(|t| {
                Target::from_name(t)
                    .ok_or_else(|| RlError::Config(format!("unknown LoRA target {t:?}")))
            })
            .collect::<Result<Vec<_>>>()?
    };
    if l.rank == 0 {
        return bad("lora.rank must be >= 1");
    }
    Ok(LoraConfig {
        rank: l.rank,
        alpha: l.alpha,
        targets,
        use_rslora: l.rslora,
    })
}

fn remote_of(r: &RemoteTrainerSection, l: &LoraSection) -> Result<Option<RemoteTrainerSection>> {
    if r.url.is_none() {
        return Ok(None);
    }
    if !l.enabled || l.alpha != LoraConfig::DEFAULT_ALPHA {
        return bad(format!(
            "a remote training API trains LoRA adapters with alpha {a}: set lora.enabled = true, lora.alpha = {a}",
            a = LoraConfig::DEFAULT_ALPHA
        ));
    }
    Ok(Some(r.clone()))
}

fn data_source(d: &DataSection) -> Result<DataSource> {
    match (&d.path, &d.env) {
        (Some(path), None) => Ok(DataSource::File {
            path: path.clone(),
            epochs: d.epochs,
        }),
        (None, Some(env)) => {
            if !(0.0..=1.0).contains(&d.teacher_noise) {
                return bad("data.teacher_noise must be in [0, 1]");
            }
            Ok(DataSource::Env {
                env: env.clone(),
                answer_format: d.answer_format.clone().unwrap_or_else(|| "{answer}".into()),
                teacher_noise: d.teacher_noise,
            })
        }
        (Some(_), Some(_)) => bad("[data] has both `path` and `env`; pick one"),
        (None, None) => bad("[data] needs `path` (chat JSONL/Parquet) or `env`"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::resolve;

    const RL: &str = "[model]\npreset = \"tiny\"\n[[env]]\nid = \"arithmetic\"\n";
    const SFT: &str = "[model]\npath = \"m\"\n[data]\npath = \"chat.jsonl\"\n";

    fn rl(extra: &[(&str, &str)]) -> Result<RlPlan> {
        let ov: Vec<(String, String)> = extra
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        RlPlan::try_from(resolve::<RlConfig>(RL, &ov)?)
    }

    fn sft(extra: &[(&str, &str)]) -> Result<SftPlan> {
        let ov: Vec<(String, String)> = extra
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        SftPlan::try_from(resolve::<SftConfig>(SFT, &ov)?)
    }

    #[test]
    fn a_valid_rl_config_becomes_typed_values() {
        let p = rl(&[("trainer.loss", "\"cispo\""), ("trainer.clip_high", "2.0")]).unwrap();
        assert!(matches!(p.model.source, ModelSource::Tiny(_)));
        let lora = p.model.lora.as_ref().unwrap();
        assert_eq!((lora.rank, lora.alpha), (16, LoraConfig::DEFAULT_ALPHA));
        assert_eq!(format!("{:?}", p.loss), "cispo(0.8, 2)");
        assert_eq!(p.optim.batch_size, 8);
        assert!(p.remote.is_none());
        // The defaults of the loss are temper-engine's.
        let p = rl(&[("trainer.loss", "\"ppo\"")]).unwrap();
        assert_eq!(
            p.loss.config(),
            vec![
                ("clip_low_threshold", temper_engine::DEFAULT_CLIP_LOW),
                ("clip_high_threshold", temper_engine::DEFAULT_CLIP_HIGH)
            ]
        );
        let full = rl(&[("lora.enabled", "false")]).unwrap();
        assert!(full.model.lora.is_none());
        assert_eq!(p.model.precision, temper_model::Precision::F32);
        let bf16 = rl(&[("model.dtype", "\"bf16\"")]).unwrap();
        assert_eq!(bf16.model.precision, temper_model::Precision::Bf16);
    }

    /// Every check of a run lives in the plan: each of these was checked
    /// somewhere else (or not at all) before.
    #[test]
    fn every_bad_setting_is_a_config_error_of_the_plan() {
        let cases: &[(&[(&str, &str)], &str)] = &[
            (&[("trainer.loss", "\"dro\"")], "trainer.loss"),
            (&[("trainer.loss", "\"cross_entropy\"")], "trainer.loss"),
            (&[("trainer.batch_size", "0")], "batch_size"),
            (&[("sampling.group_size", "0")], "group_size"),
            (&[("env.0.weight", "0.0")], "weights"),
            (&[("lora.rank", "0")], "rank"),
            (&[("lora.targets", "[\"qkv\"]")], "LoRA target"),
            (&[("model.preset", "\"huge\"")], "preset"),
            (&[("model.path", "\"m\"")], "both"),
            (&[("model.tiny.num_heads", "3")], "tiny model"),
            (
                &[("model.dtype", "\"fp16\"")],
                "expected \"f32\", \"bf16\", \"gguf\" or \"auto\"",
            ),
            (
                &[("model.dtype", "\"bf16\""), ("lora.enabled", "false")],
                "full-parameter training keeps f32 weights",
            ),
            (
                &[("model.adapter", "\"a\""), ("lora.enabled", "false")],
                "adapter",
            ),
            (
                &[("sampler.url", "\"http://x\""), ("lora.enabled", "false")],
                "sampler",
            ),
            (
                &[
                    ("remote_trainer.url", "\"http://x\""),
                    ("lora.alpha", "16.0"),
                ],
                "alpha 32",
            ),
            (
                &[
                    ("remote_trainer.url", "\"http://x\""),
                    ("lora.alpha", "32.0"),
                    ("sampler.url", "\"http://y\""),
                ],
                "sampled by the training service",
            ),
        ];
        for (ov, want) in cases {
            let e = rl(ov).expect_err(want).to_string();
            assert!(e.contains(want), "{ov:?}: {e}");
        }
        let teacher = ("distill.teacher.path", "\"t\"");
        let cases: &[(&[(&str, &str)], &str)] = &[
            (
                &[teacher, ("distill.kl_coef", "0.0")],
                "kl_coef must be > 0",
            ),
            (&[teacher, ("distill.reward_coef", "-1.0")], "reward_coef"),
            (&[teacher, ("distill.teacher.url", "\"http://x\"")], "both"),
            (&[("distill.teacher.adapter", "\"a\"")], "needs `path`"),
            (&[("distill.teacher.url", "\"http://x\"")], "needs `model`"),
            (
                &[teacher, ("distill.teacher.model", "\"m\"")],
                "go with `url`",
            ),
            (
                &[teacher, ("distill.teacher.dtype", "\"fp8\"")],
                "distill.teacher",
            ),
        ];
        for (ov, want) in cases {
            let e = rl(ov).expect_err(want).to_string();
            assert!(e.contains(want), "{ov:?}: {e}");
        }
        let d = rl(&[teacher, ("distill.teacher.adapter", "\"a\"")])
            .unwrap()
            .distill
            .unwrap();
        assert!(matches!(
            d.teacher,
            TeacherSource::Local {
                adapter: Some(_),
                ..
            }
        ));
        assert_eq!((d.kl_coef, d.reward_coef), (1.0, 0.0));
        assert!(rl(&[]).unwrap().distill.is_none());
        let no_env = RlPlan::try_from(resolve::<RlConfig>("[model]\npath = \"m\"\n", &[]).unwrap());
        assert!(no_env.unwrap_err().to_string().contains("[[env]]"));

        let cases: &[(&[(&str, &str)], &str)] = &[
            (&[("trainer.batch_size", "0")], "batch_size"),
            (&[("trainer.max_seq_len", "0")], "max_seq_len"),
            (&[("data.env", "{ id = \"arithmetic\" }")], "both"),
            (
                &[
                    ("remote_trainer.url", "\"http://x\""),
                    ("lora.enabled", "false"),
                ],
                "alpha 32",
            ),
        ];
        for (ov, want) in cases {
            let e = sft(ov).expect_err(want).to_string();
            assert!(e.contains(want), "{ov:?}: {e}");
        }
        let noisy =
            "[model]\npath = \"m\"\n[data]\nenv = { id = \"arithmetic\" }\nteacher_noise = 1.5\n";
        let e = SftPlan::try_from(resolve::<SftConfig>(noisy, &[]).unwrap()).unwrap_err();
        assert!(e.to_string().contains("teacher_noise"), "{e}");
        assert!(matches!(sft(&[]).unwrap().data, DataSource::File { .. }));
    }

    #[test]
    fn warmup_ramps_linearly() {
        assert_eq!(learning_rate(1.0, 0, 0), 1.0);
        assert_eq!(learning_rate(1.0, 4, 0), 0.25);
        assert_eq!(learning_rate(1.0, 4, 9), 1.0);
    }
}
