//! Training configs: one TOML file per run, any key overridable from the
//! command line with a dotted path (`--trainer.lr 1e-4`).
//!
//! Unknown keys are errors (a typo never silently falls back to a default),
//! and the resolved config is saved into the run directory, so a run can be
//! reproduced — and resumed — from what it actually used.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::error::{Result, RlError};
use crate::preset::TinyPreset;

/// Which model to start from.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields, default)]
pub struct ModelSection {
    /// A Hugging Face model directory or a GGUF file.
    pub path: Option<PathBuf>,
    /// Or a built-in preset, written into the run directory: `"tiny"`.
    pub preset: Option<String>,
    /// Continue from this PEFT LoRA adapter directory (ours, or one PEFT /
    /// Unsloth / Tinker wrote): its rank, alpha and targets replace `[lora]`'s.
    pub adapter: Option<PathBuf>,
    /// Precision of the matmul weights on the CPU: `"f32"`, `"bf16"`,
    /// `"gguf"` (a GGUF's quantized matrices kept as blocks) or `"auto"`
    /// (bf16 where the CPU has avx512_bf16). Unset: the command's
    /// `--dtype` (default f32).
    pub dtype: Option<String>,
    /// The forward's matmul on the CPU: `"invariant"` (every row reduced in
    /// one fixed order, so sampler and trainer agree bit for bit) or
    /// `"candle"` (candle's gemm, for comparisons). Unset: the command's
    /// `TEMPER_MATMUL` (default invariant).
    pub matmul: Option<String>,
    /// Sizes for the `tiny` preset.
    pub tiny: TinyPreset,
}

/// LoRA settings; `enabled = false` trains every weight.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LoraSection {
    /// Train a LoRA adapter (true) or all weights (false).
    pub enabled: bool,
    /// Rank.
    pub rank: usize,
    /// Scaling numerator.
    pub alpha: f64,
    /// Target modules (q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj); empty = all.
    pub targets: Vec<String>,
    /// rsLoRA scaling.
    pub rslora: bool,
}

impl Default for LoraSection {
    fn default() -> Self {
        Self {
            enabled: true,
            rank: 16,
            alpha: temper_model::LoraConfig::DEFAULT_ALPHA,
            targets: Vec::new(),
            rslora: false,
        }
    }
}

/// One training environment and its share of the groups.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EnvSection {
    /// A built-in name, a directory with env.toml, a Harbor task directory
    /// or a directory of them (`args`: the agent and its budgets, see
    /// `temper_tasks::TasksEnvArgs`), or an external command.
    pub id: String,
    /// Relative mixing weight.
    #[serde(default = "one")]
    pub weight: f64,
    /// Environment arguments.
    #[serde(default = "empty_object")]
    pub args: serde_json::Value,
    /// Set by `temper train` when `id` was a hub reference: what it
    /// resolved to (then `id` is the pulled directory).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub package: Option<temper_env::PackageRef>,
}

fn one() -> f64 {
    1.0
}

fn empty_object() -> serde_json::Value {
    serde_json::Value::Object(Default::default())
}

/// How rollouts are sampled.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SamplingSection {
    /// Softmax temperature.
    pub temperature: f64,
    /// Nucleus mass.
    pub top_p: f64,
    /// Most tokens per model turn.
    pub max_tokens: usize,
    /// Rollouts per prompt (the group of group-relative advantages).
    pub group_size: usize,
    /// Drop tokens below `min_p` × the top probability (0 = off); like
    /// `top_p` it truncates the tail, and logprobs stay the model's.
    pub min_p: f64,
    /// Token ids that end a turn, besides EOS.
    pub stop_token_ids: Vec<u32>,
    /// Refused in RL (see [`SamplingSection::check`]); 0 = off.
    pub presence_penalty: f64,
    /// Refused in RL; 0 = off.
    pub frequency_penalty: f64,
    /// Refused in RL; 1 = off.
    pub repetition_penalty: f64,
    /// Refused in RL; token id (a TOML key is a string) → bias.
    pub logit_bias: std::collections::BTreeMap<String, f64>,
}

impl Default for SamplingSection {
    fn default() -> Self {
        Self {
            temperature: 1.0,
            top_p: 1.0,
            max_tokens: 64,
            group_size: 8,
            min_p: 0.0,
            stop_token_ids: Vec::new(),
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            repetition_penalty: 1.0,
            logit_bias: Default::default(),
        }
    }
}

impl SamplingSection {
    /// Penalties and logit bias move probability mass, so a sample would
    /// not come from the distribution whose logprobs the trainer
    /// recomputes (the model's, at `temperature`): the importance ratio
    /// would be wrong. Refuse them rather than train on a silent mismatch.
    pub fn check(&self) -> Result<()> {
        let mut set = Vec::new();
        if self.presence_penalty != 0.0 {
            set.push("presence_penalty");
        }
        if self.frequency_penalty != 0.0 {
            set.push("frequency_penalty");
        }
        if self.repetition_penalty != 1.0 {
            set.push("repetition_penalty");
        }
        if !self.logit_bias.is_empty() {
            set.push("logit_bias");
        }
        if set.is_empty() {
            return Ok(());
        }
        Err(RlError::Config(format!(
            "[sampling] {} change the sampled distribution away from the model's, whose \
             logprobs the trainer recomputes, so RL refuses them (truncation, top_p and \
             min_p, is allowed); use them in `temper eval` and `temper serve` requests",
            set.join(", ")
        )))
    }
}

/// RL optimisation: `[trainer]` of `temper train rl` (SFT's is
/// [`SftTrainerSection`]; each rejects the other's keys).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RlTrainerSection {
    /// `importance_sampling`, `ppo` or `cispo`.
    pub loss: String,
    /// Learning rate.
    pub lr: f64,
    /// Linear warm-up steps.
    pub warmup_steps: u64,
    /// Groups (prompts) per optimizer step.
    pub batch_size: usize,
    /// Sequences per forward_backward call (gradients accumulate); 0 = all at once.
    pub micro_batch: usize,
    /// Global gradient-norm clip; 0 disables.
    pub grad_clip: f64,
    /// Decoupled weight decay.
    pub weight_decay: f64,
    /// Optimizer steps.
    pub max_steps: u64,
    /// Divide advantages by the group's reward standard deviation.
    pub normalize_std: bool,
    /// PPO/CISPO lower clip.
    pub clip_low: f64,
    /// PPO/CISPO upper clip.
    pub clip_high: f64,
}

impl Default for RlTrainerSection {
    fn default() -> Self {
        Self {
            loss: temper_engine::Loss::ImportanceSampling.name().into(),
            lr: 1e-4,
            warmup_steps: 0,
            batch_size: 8,
            micro_batch: 0,
            grad_clip: 1.0,
            weight_decay: 0.0,
            max_steps: 100,
            normalize_std: false,
            clip_low: temper_engine::DEFAULT_CLIP_LOW,
            clip_high: temper_engine::DEFAULT_CLIP_HIGH,
        }
    }
}

/// SFT optimisation: `[trainer]` of `temper train sft` (always
/// cross-entropy on assistant tokens).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SftTrainerSection {
    /// Learning rate.
    pub lr: f64,
    /// Linear warm-up steps.
    pub warmup_steps: u64,
    /// Conversations per optimizer step.
    pub batch_size: usize,
    /// Sequences per forward_backward call (gradients accumulate); 0 = all at once.
    pub micro_batch: usize,
    /// Global gradient-norm clip; 0 disables.
    pub grad_clip: f64,
    /// Decoupled weight decay.
    pub weight_decay: f64,
    /// Optimizer steps.
    pub max_steps: u64,
    /// Longest sequence in tokens.
    pub max_seq_len: usize,
}

impl Default for SftTrainerSection {
    fn default() -> Self {
        let rl = RlTrainerSection::default();
        Self {
            lr: rl.lr,
            warmup_steps: rl.warmup_steps,
            batch_size: rl.batch_size,
            micro_batch: rl.micro_batch,
            grad_clip: rl.grad_clip,
            weight_decay: rl.weight_decay,
            max_steps: rl.max_steps,
            max_seq_len: 2048,
        }
    }
}

/// Off-policy bound of the async loop.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AsyncSection {
    /// Rollouts from a policy more than this many steps behind the trainer
    /// are dropped; 0 makes sampling wait for every new policy.
    pub max_off_policy_steps: u64,
    /// Run sampling in its own task, overlapping training (true), or the
    /// plain synchronous loop — generate, then train — (false).
    pub enabled: bool,
}

impl Default for AsyncSection {
    fn default() -> Self {
        Self {
            max_off_policy_steps: 1,
            enabled: true,
        }
    }
}

/// Periodic held-out evaluation.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct EvalSection {
    /// Environment id (default: the first `[[env]]`).
    pub env: Option<String>,
    /// Environment args (default: that env's training args).
    pub args: Option<serde_json::Value>,
    /// Evaluate every this many steps (0 = only before and after training).
    pub interval: u64,
    /// Held-out examples.
    pub num_examples: usize,
    /// Sampling temperature for evaluation (0 = greedy).
    pub temperature: f64,
    /// A rollout passes (eval pass@1, training pass@1) at reward ≥ this
    /// (default: the environment's `[eval] pass_threshold`, else 1, or the
    /// rubric's maximum when that exceeds 1).
    pub pass_threshold: Option<f64>,
}

impl Default for EvalSection {
    fn default() -> Self {
        Self {
            env: None,
            args: None,
            interval: 0,
            num_examples: 100,
            temperature: 0.0,
            pass_threshold: None,
        }
    }
}

/// Checkpointing.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CkptSection {
    /// Save every this many steps (0 = only at the end).
    pub interval: u64,
    /// Checkpoints kept (older ones are deleted).
    pub keep: usize,
}

impl Default for CkptSection {
    fn default() -> Self {
        Self {
            interval: 10,
            keep: 2,
        }
    }
}

/// Where and how the run reports.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LogSection {
    /// The run directory (metrics.jsonl, plots.html, checkpoints, adapter).
    pub dir: PathBuf,
    /// Live progress line in the terminal.
    pub progress: bool,
    /// Rollouts per step written to `samples.jsonl` (prompt, completion,
    /// reward, env) and shown in `plots.html`; 0 = none. RL only.
    pub samples: usize,
    /// Also write TensorBoard event files beside `metrics.jsonl`.
    pub tensorboard: bool,
}

impl Default for LogSection {
    fn default() -> Self {
        Self {
            dir: PathBuf::from("runs/rl"),
            progress: true,
            samples: 4,
            tensorboard: false,
        }
    }
}

/// Where rollouts come from.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields, default)]
pub struct SamplerSection {
    /// Base URL of an external OpenAI-compatible server with temper's
    /// token endpoint and vLLM's adapter routes (e.g. `temper serve`).
    /// Unset: sample in-process from the trainer's own weights.
    pub url: Option<String>,
    /// Adapter name the policy is published under on that server.
    pub adapter_name: String,
    /// Environment variable holding the server's API key.
    pub api_key_env: Option<String>,
}

/// On-policy distillation (`[distill]`): with a `teacher`, `temper train rl`
/// scores every sampled token by the teacher, and its advantage is
/// `kl_coef · (logp_teacher − logp_student) + reward_coef · reward advantage`
/// (the per-token reverse KL to the teacher, optionally mixed with the
/// environment's group-relative reward).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DistillSection {
    /// The teacher; unset: plain RL.
    pub teacher: Option<TeacherSection>,
    /// Weight of the reverse-KL term (> 0).
    pub kl_coef: f64,
    /// Weight of the environment's reward advantage (0 = pure distillation).
    pub reward_coef: f64,
}

impl Default for DistillSection {
    fn default() -> Self {
        Self {
            teacher: None,
            kl_coef: 1.0,
            reward_coef: 0.0,
        }
    }
}

impl DistillSection {
    /// No teacher: the run is plain RL (and its saved config has no section).
    pub fn is_off(&self) -> bool {
        self.teacher.is_none()
    }
}

/// The teacher of `[distill]`: a local model (`path`, optional `adapter`)
/// run in process, or an endpoint (`url`) that returns prompt logprobs for
/// token ids (`/v1/completions` with `echo`, e.g. `temper serve` or vLLM).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields, default)]
pub struct TeacherSection {
    /// A Hugging Face model directory or a GGUF file.
    pub path: Option<PathBuf>,
    /// A PEFT LoRA adapter applied to `path`.
    pub adapter: Option<PathBuf>,
    /// Precision of the teacher's matmul weights (as `[model] dtype`);
    /// unset: the student's.
    pub dtype: Option<String>,
    /// Or the base URL of an OpenAI-compatible server.
    pub url: Option<String>,
    /// The model (or adapter) name on that server.
    pub model: Option<String>,
    /// Environment variable holding that server's API key.
    pub api_key_env: Option<String>,
}

/// A remote training API (tinker protocol, e.g. `temper api serve`) in
/// place of the in-process engine.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RemoteTrainerSection {
    /// Base URL; unset trains in process.
    pub url: Option<String>,
    /// Environment variable holding the API key (sent as `X-API-Key`);
    /// unset: `TINKER_API_KEY`, as the tinker SDK reads it, if set.
    pub api_key_env: Option<String>,
    /// The server's name for the base model (`--model NAME=DIR`); `[model]`
    /// must point at the same weights locally, for the tokenizer and template.
    pub base_model: String,
}

impl Default for RemoteTrainerSection {
    fn default() -> Self {
        Self {
            url: None,
            api_key_env: None,
            base_model: "base".into(),
        }
    }
}

/// Supervised fine-tuning data.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields, default)]
pub struct DataSection {
    /// Chat JSONL (`messages`, or `prompt` + `completion`).
    pub path: Option<PathBuf>,
    /// Or an environment whose training rows, with their reference answers
    /// as assistant turns, form the dataset.
    pub env: Option<EnvSection>,
    /// How the reference answer becomes the assistant message, `{answer}`
    /// replaced (with `env`).
    pub answer_format: Option<String>,
    /// Fraction (0..1) of environment answers replaced by a systematic
    /// near miss (a numeric answer plus one): simulates traces distilled
    /// from a teacher with a consistent bias, the usual starting point of
    /// SFT-then-RL (imitation copies the bias; a verifier's reward removes it).
    pub teacher_noise: f64,
    /// Passes over a file dataset (SFT stops at whichever of `epochs` and
    /// `trainer.max_steps` comes first).
    pub epochs: Option<u64>,
}

/// `[alerts]`: the rules' thresholds.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AlertsSection {
    /// Compute alerts at all.
    pub enabled: bool,
    /// Steps averaged by each rule (the windows compared).
    pub window: usize,
    /// `length_growth`: the mean completion length of the last `window`
    /// steps is at least `1 + length_growth` times that of the `window`
    /// steps before, while their mean reward rose.
    pub length_growth: f64,
    /// `entropy_collapse`: the mean entropy of the last `window` steps is
    /// at most this fraction of the first `window` steps'.
    pub entropy_collapse: f64,
    /// `truncation`: the mean truncation rate of the last `window` steps is
    /// at least this.
    pub truncation_rate: f64,
    /// `heldout_divergence`: the held-out pass@1 fell by at least this
    /// between two evaluations while the mean training reward of the
    /// `window` steps before each rose.
    pub heldout_drop: f64,
    /// `zero_advantage`: at least this fraction of the groups of the last
    /// `window` steps had all-equal rewards.
    pub zero_advantage: f64,
    /// `mismatch`: `mismatch/max` or `mismatch/probe_max` above this where the sampler is the
    /// in-process engine (which samples with the learner's exact weights
    /// and kernels: 0 expected).
    pub mismatch: f64,
    /// Rules that stop the run (with an error naming the alert) when raised.
    pub stop_on: Vec<String>,
}

impl Default for AlertsSection {
    fn default() -> Self {
        Self {
            enabled: true,
            window: 5,
            length_growth: 0.5,
            entropy_collapse: 0.2,
            truncation_rate: 0.3,
            heldout_drop: 0.05,
            zero_advantage: 0.8,
            mismatch: 0.0,
            stop_on: Vec::new(),
        }
    }
}

/// `temper train rl` config.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields, default)]
pub struct RlConfig {
    /// Base seed: sampling seeds, LoRA init and data order derive from it.
    pub seed: u64,
    /// Model.
    pub model: ModelSection,
    /// LoRA.
    pub lora: LoraSection,
    /// Environments.
    pub env: Vec<EnvSection>,
    /// Sampling.
    pub sampling: SamplingSection,
    /// Trainer.
    pub trainer: RlTrainerSection,
    /// Async bound.
    #[serde(rename = "async")]
    pub async_: AsyncSection,
    /// Evaluation.
    pub eval: EvalSection,
    /// Checkpoints.
    pub ckpt: CkptSection,
    /// Logging.
    pub log: LogSection,
    /// External sampler.
    pub sampler: SamplerSection,
    /// Remote trainer.
    pub remote_trainer: RemoteTrainerSection,
    /// On-policy distillation from a teacher (off without `teacher`).
    #[serde(skip_serializing_if = "DistillSection::is_off")]
    pub distill: DistillSection,
    /// Alerts for a run going wrong.
    pub alerts: AlertsSection,
}

/// `temper train sft` config.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields, default)]
pub struct SftConfig {
    /// Base seed (data order, LoRA init).
    pub seed: u64,
    /// Model.
    pub model: ModelSection,
    /// LoRA.
    pub lora: LoraSection,
    /// Data.
    pub data: DataSection,
    /// Trainer.
    pub trainer: SftTrainerSection,
    /// Evaluation on an environment (optional).
    pub eval: EvalSection,
    /// Checkpoints.
    pub ckpt: CkptSection,
    /// Logging.
    pub log: LogSection,
    /// Remote trainer.
    pub remote_trainer: RemoteTrainerSection,
}

/// `[data]` of `temper train dpo`: preference pairs from a file, or made
/// online from an environment's reward.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PrefDataSection {
    /// Preference JSONL/Parquet in TRL's formats: `prompt` + `chosen` +
    /// `rejected` (text or message lists), or `chosen` + `rejected`
    /// conversations sharing their first messages (the implicit prompt).
    pub path: Option<PathBuf>,
    /// Held-out pairs (a second file), scored before, during and after training.
    pub eval_path: Option<PathBuf>,
    /// Or hold out this fraction (0..1) of `path`'s pairs (seeded).
    pub eval_fraction: f64,
    /// Passes over `path` (training stops at whichever of `epochs` and
    /// `trainer.max_steps` comes first).
    pub epochs: Option<u64>,
    /// Or online DPO: prompts of this environment; each is sampled
    /// `group_size` times by the current policy and the highest- and
    /// lowest-reward completions become a pair (ties are skipped).
    pub env: Option<EnvSection>,
    /// With `env`: completions sampled per prompt.
    pub group_size: usize,
    /// With `env`: sampling temperature.
    pub temperature: f64,
    /// With `env`: most tokens per completion.
    pub max_tokens: usize,
}

impl Default for PrefDataSection {
    fn default() -> Self {
        Self {
            path: None,
            eval_path: None,
            eval_fraction: 0.0,
            epochs: None,
            env: None,
            group_size: 4,
            temperature: 1.0,
            max_tokens: 256,
        }
    }
}

/// `[dpo]`: the preference objective.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DpoSection {
    /// `sigmoid` (the DPO paper's loss) or `ipo` (on per-token average
    /// logprobs, as TRL computes it).
    pub loss: String,
    /// Strength of the pull towards the reference policy.
    pub beta: f64,
}

impl Default for DpoSection {
    fn default() -> Self {
        Self {
            loss: "sigmoid".into(),
            beta: 0.1,
        }
    }
}

/// `temper train dpo` config.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields, default)]
pub struct DpoConfig {
    /// Base seed (data order, held-out split, LoRA init, sampling).
    pub seed: u64,
    /// Model.
    pub model: ModelSection,
    /// LoRA.
    pub lora: LoraSection,
    /// Preference data.
    pub data: PrefDataSection,
    /// The objective.
    pub dpo: DpoSection,
    /// Trainer (as SFT's; `batch_size` counts pairs, or prompts online).
    pub trainer: SftTrainerSection,
    /// Evaluation on an environment (optional).
    pub eval: EvalSection,
    /// Checkpoints.
    pub ckpt: CkptSection,
    /// Logging.
    pub log: LogSection,
}

impl DpoConfig {
    /// The resolved config as `--dry-run` prints it: only the keys that
    /// apply (the online keys only with `[data] env`, no RL-only
    /// `log.samples`). It parses back to the same config.
    pub fn dry_run(&self) -> Result<String> {
        let mut root = to_value(self)?;
        drop_model_keys(&mut root, &self.model);
        remove(&mut root, &["log", "samples"]);
        let unused: &[&str] = if self.data.env.is_none() {
            &["group_size", "temperature", "max_tokens"]
        } else {
            &["eval_fraction"]
        };
        for k in unused {
            remove(&mut root, &["data", k]);
        }
        pretty(&root)
    }
}

/// Parse `text` (TOML), apply `overrides` (`key.path=value` pairs, value as
/// a TOML literal or else a string) and deserialize.
pub fn resolve<T: serde::de::DeserializeOwned>(
    text: &str,
    overrides: &[(String, String)],
) -> Result<T> {
    resolve_with(text, &[], overrides)
}

/// [`resolve`], first filling each of `defaults` whose key the text leaves
/// unset and whose table it has (`distill.teacher.dtype` only where there
/// is a teacher): how the CLI's global flags reach a config without a
/// process-wide setting. Overrides still win.
pub fn resolve_with<T: serde::de::DeserializeOwned>(
    text: &str,
    defaults: &[(String, String)],
    overrides: &[(String, String)],
) -> Result<T> {
    let mut root: toml::Value = toml::from_str(text).map_err(|e| RlError::Config(e.to_string()))?;
    for (key, value) in defaults {
        let (parent, leaf) = key.rsplit_once('.').unwrap_or(("", key));
        let table = parent
            .split('.')
            .filter(|p| !p.is_empty())
            .try_fold(&mut root, |t, p| t.get_mut(p));
        if let Some(toml::Value::Table(t)) = table {
            t.entry(leaf.to_string())
                .or_insert_with(|| parse_value(value));
        }
    }
    for (key, value) in overrides {
        set_path(&mut root, key, parse_value(value))?;
    }
    T::deserialize(root).map_err(|e| RlError::Config(e.to_string()))
}

/// Read the TOML file `path` and [`resolve`] it.
pub fn load<T: serde::de::DeserializeOwned>(
    path: &Path,
    overrides: &[(String, String)],
) -> Result<T> {
    load_with(path, &[], overrides)
}

/// Read the TOML file `path` and [`resolve_with`] it.
pub fn load_with<T: serde::de::DeserializeOwned>(
    path: &Path,
    defaults: &[(String, String)],
    overrides: &[(String, String)],
) -> Result<T> {
    let text = std::fs::read_to_string(path).map_err(|e| RlError::io(path, e))?;
    resolve_with(&text, defaults, overrides).map_err(|e| match e {
        RlError::Config(m) => RlError::Config(format!("{}: {m}", path.display())),
        other => other,
    })
}

/// Split command-line words into `(key, value)` overrides: `--a.b 3`,
/// `--a.b=3`. A flag with no value (`--lora.enabled` followed by another
/// flag or nothing) means `true`.
pub fn parse_overrides(words: &[String]) -> Result<Vec<(String, String)>> {
    let mut out = Vec::new();
    let mut i = 0;
    while i < words.len() {
        let w = &words[i];
        let Some(key) = w.strip_prefix("--") else {
            return Err(RlError::Config(format!(
                "unexpected argument {w:?}: overrides look like --section.key VALUE"
            )));
        };
        if let Some((k, v)) = key.split_once('=') {
            out.push((k.to_string(), v.to_string()));
            i += 1;
        } else if i + 1 < words.len() && !words[i + 1].starts_with("--") {
            out.push((key.to_string(), words[i + 1].clone()));
            i += 2;
        } else {
            out.push((key.to_string(), "true".into()));
            i += 1;
        }
    }
    Ok(out)
}

fn parse_value(s: &str) -> toml::Value {
    toml::from_str::<toml::Table>(&format!("v = {s}"))
        .ok()
        .and_then(|mut t| t.remove("v"))
        .unwrap_or_else(|| toml::Value::String(s.to_string()))
}

fn set_path(root: &mut toml::Value, key: &str, value: toml::Value) -> Result<()> {
    let parts: Vec<&str> = key.split('.').collect();
    if parts.iter().any(|p| p.is_empty()) {
        return Err(RlError::Config(format!("bad override key {key:?}")));
    }
    let mut cur = root;
    for (i, part) in parts.iter().enumerate() {
        let last = i + 1 == parts.len();
        cur = match cur {
            toml::Value::Table(t) => {
                if last {
                    t.insert(part.to_string(), value);
                    return Ok(());
                }
                t.entry(part.to_string())
                    .or_insert_with(|| toml::Value::Table(Default::default()))
            }
            toml::Value::Array(a) => {
                let idx: usize = part.parse().map_err(|_| {
                    RlError::Config(format!("{key}: {part:?} is not an index into a list"))
                })?;
                let len = a.len();
                let slot = a.get_mut(idx).ok_or_else(|| {
                    RlError::Config(format!("{key}: index {idx} out of range (list has {len})"))
                })?;
                if last {
                    *slot = value;
                    return Ok(());
                }
                slot
            }
            _ => {
                return Err(RlError::Config(format!(
                    "{key}: {part:?} is inside a value that is not a table"
                )))
            }
        };
    }
    Ok(())
}

impl RlConfig {
    /// The resolved config as `--dry-run` prints it: only the keys that
    /// apply to this run (no `[model.tiny]` without the tiny preset, no
    /// ratio clips unless the loss clips, no external sampler / remote
    /// trainer keys without their `url`). It parses back to the same
    /// config.
    pub fn dry_run(&self) -> Result<String> {
        let mut root = to_value(self)?;
        drop_model_keys(&mut root, &self.model);
        if !matches!(self.trainer.loss.as_str(), "ppo" | "cispo") {
            remove(&mut root, &["trainer", "clip_low"]);
            remove(&mut root, &["trainer", "clip_high"]);
        }
        if self.sampler.url.is_none() {
            remove(&mut root, &["sampler"]);
        }
        if self.remote_trainer.url.is_none() {
            remove(&mut root, &["remote_trainer"]);
        }
        pretty(&root)
    }
}

impl SftConfig {
    /// The resolved config as `--dry-run` prints it: only the keys that
    /// apply (no RL-only `log.samples`; `answer_format` and `teacher_noise`
    /// only with `[data] env`; no `[model.tiny]` without the tiny preset;
    /// no remote trainer keys without its `url`). It parses back to the
    /// same config.
    pub fn dry_run(&self) -> Result<String> {
        let mut root = to_value(self)?;
        drop_model_keys(&mut root, &self.model);
        remove(&mut root, &["log", "samples"]);
        if self.remote_trainer.url.is_none() {
            remove(&mut root, &["remote_trainer"]);
        }
        if self.data.env.is_none() {
            remove(&mut root, &["data", "answer_format"]);
            remove(&mut root, &["data", "teacher_noise"]);
        }
        pretty(&root)
    }
}

fn drop_model_keys(root: &mut toml::Value, model: &ModelSection) {
    if model.preset.as_deref() != Some("tiny") {
        remove(root, &["model", "tiny"]);
    }
}

fn to_value<T: Serialize>(cfg: &T) -> Result<toml::Value> {
    toml::Value::try_from(cfg).map_err(|e| RlError::Config(e.to_string()))
}

fn pretty(root: &toml::Value) -> Result<String> {
    toml::to_string_pretty(root).map_err(|e| RlError::Config(e.to_string()))
}

/// Remove the key at `path` (a no-op when absent).
fn remove(root: &mut toml::Value, path: &[&str]) {
    let Some((last, parents)) = path.split_last() else {
        return;
    };
    let mut cur = root;
    for p in parents {
        match cur.get_mut(*p) {
            Some(next) => cur = next,
            None => return,
        }
    }
    if let Some(t) = cur.as_table_mut() {
        t.remove(*last);
    }
}

/// The resolved config as TOML (for `--dry-run` and the run directory).
pub fn to_toml<T: Serialize>(cfg: &T) -> Result<String> {
    toml::to_string_pretty(cfg).map_err(|e| RlError::Config(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    const EXAMPLE: &str = r#"
        seed = 3
        [model]
        preset = "tiny"
        [[env]]
        id = "arithmetic"
        args = { digits = 2 }
        [trainer]
        lr = 1e-3
    "#;

    #[test]
    fn overrides_reach_nested_keys_lists_and_types() {
        let ov = parse_overrides(&[
            "--trainer.lr".into(),
            "5e-4".into(),
            "--env.0.args.digits=3".into(),
            "--lora.enabled".into(),
            "false".into(),
            "--log.dir".into(),
            "runs/x".into(),
            "--trainer.normalize_std".into(),
        ])
        .unwrap();
        let cfg: RlConfig = resolve(EXAMPLE, &ov).unwrap();
        assert_eq!(cfg.seed, 3);
        assert_eq!(cfg.trainer.lr, 5e-4);
        assert_eq!(cfg.env[0].args["digits"], 3);
        assert!(!cfg.lora.enabled);
        assert!(cfg.trainer.normalize_std);
        assert_eq!(cfg.log.dir, PathBuf::from("runs/x"));
        // Defaults fill the rest; the dump parses back to the same config.
        assert_eq!(cfg.sampling.group_size, 8);
        let again: RlConfig = resolve(&to_toml(&cfg).unwrap(), &[]).unwrap();
        assert_eq!(again, cfg);
    }

    /// Issue 35 §5: the CLI's `--dtype` reaches a config as a default, not
    /// as a process-wide setting: it fills an unset `[model] dtype`, leaves
    /// the file's own value, adds no teacher, and an override still wins.
    #[test]
    fn defaults_fill_only_unset_keys_of_existing_tables() {
        let d = ["model.dtype", "distill.teacher.dtype"].map(|k| (k.to_string(), "bf16".into()));
        let cfg: RlConfig = resolve_with(EXAMPLE, &d, &[]).unwrap();
        assert_eq!(cfg.model.dtype.as_deref(), Some("bf16"));
        assert!(
            cfg.distill.teacher.is_none(),
            "a default must not create a teacher"
        );
        let own = EXAMPLE.replace("preset = \"tiny\"", "preset = \"tiny\"\ndtype = \"f32\"");
        let cfg: RlConfig = resolve_with(&own, &d, &[]).unwrap();
        assert_eq!(
            cfg.model.dtype.as_deref(),
            Some("f32"),
            "the file's value wins"
        );
        let ov = [("model.dtype".to_string(), "gguf".to_string())];
        let cfg: RlConfig = resolve_with(&own, &d, &ov).unwrap();
        assert_eq!(cfg.model.dtype.as_deref(), Some("gguf"), "an override wins");
        let with_teacher = format!("{EXAMPLE}\n[distill.teacher]\npath = \"t\"\n");
        let cfg: RlConfig = resolve_with(&with_teacher, &d, &[]).unwrap();
        let teacher = cfg.distill.teacher.expect("teacher");
        assert_eq!(teacher.dtype.as_deref(), Some("bf16"));
        // Without defaults a library caller gets f32, whatever else ran.
        let cfg: RlConfig = resolve(EXAMPLE, &[]).unwrap();
        assert_eq!(cfg.model.dtype, None);
    }

    /// Issue 15: the sampling fields of `temper eval -S` exist in RL
    /// configs; truncation passes, distribution-moving ones are refused
    /// with the reason.
    #[test]
    fn rl_sampling_refuses_penalties_and_logit_bias() {
        let ok: SamplingSection =
            toml::from_str("min_p = 0.05\nstop_token_ids = [7]\ntop_p = 0.9").unwrap();
        assert_eq!(ok.min_p, 0.05);
        assert!(ok.check().is_ok());
        for (text, field) in [
            ("presence_penalty = 0.5", "presence_penalty"),
            ("frequency_penalty = 0.5", "frequency_penalty"),
            ("repetition_penalty = 1.2", "repetition_penalty"),
            ("logit_bias = { 42 = -100.0 }", "logit_bias"),
        ] {
            let s: SamplingSection = toml::from_str(text).unwrap();
            let e = s.check().unwrap_err().to_string();
            assert!(e.contains(field) && e.contains("trainer recomputes"), "{e}");
        }
    }

    #[test]
    fn typos_and_bad_overrides_are_errors() {
        let e = resolve::<RlConfig>("[trainer]\nlearning_rate = 1.0\n", &[]).unwrap_err();
        assert!(e.to_string().contains("learning_rate"), "{e}");
        let e = resolve::<RlConfig>(EXAMPLE, &[("env.5.id".into(), "x".into())]).unwrap_err();
        assert!(e.to_string().contains("out of range"), "{e}");
        let e = resolve::<RlConfig>(EXAMPLE, &[("trainer.lr".into(), "fast".into())]).unwrap_err();
        assert!(
            e.to_string().contains("lr") || e.to_string().contains("invalid type"),
            "{e}"
        );
        assert!(parse_overrides(&["trainer.lr".into()]).is_err());
    }

    /// Issue 39: training took no pass threshold (`[eval] pass_threshold`
    /// was an unknown key); RL and SFT both read it now.
    #[test]
    fn eval_pass_threshold_is_a_training_key() {
        let text = format!("{EXAMPLE}\n[eval]\npass_threshold = 1.5\n");
        let rl = resolve::<RlConfig>(&text, &[]).unwrap();
        assert_eq!(rl.eval.pass_threshold, Some(1.5));
        let sft = resolve::<SftConfig>("[eval]\npass_threshold = 0.5\n", &[]).unwrap();
        assert_eq!(sft.eval.pass_threshold, Some(0.5));
    }

    /// Issue 12: RL and SFT shared one trainer section, so each silently
    /// accepted the other's keys.
    #[test]
    fn rl_and_sft_trainer_sections_reject_each_others_keys() {
        let e = resolve::<RlConfig>("[trainer]\nmax_seq_len = 512\n", &[]).unwrap_err();
        assert!(e.to_string().contains("max_seq_len"), "{e}");
        for key in ["loss = \"ppo\"", "clip_low = 0.5", "normalize_std = true"] {
            let e = resolve::<SftConfig>(&format!("[trainer]\n{key}\n"), &[]).unwrap_err();
            assert!(
                e.to_string().contains(key.split(' ').next().unwrap()),
                "{e}"
            );
        }
        let e = resolve::<SftConfig>("[sampling]\ntemperature = 1.0\n", &[]).unwrap_err();
        assert!(e.to_string().contains("sampling"), "{e}");
    }

    /// Issue 12: dry runs printed keys that do not apply (`[model.tiny]`
    /// for a model path, `teacher_noise` for a file dataset, SFT `loss`).
    #[test]
    fn issue_12_dry_runs_print_only_the_keys_that_apply() {
        let rl: RlConfig = resolve(
            "[model]\npath = \"m.gguf\"\n[[env]]\nid = \"arithmetic\"\n",
            &[],
        )
        .unwrap();
        let text = rl.dry_run().unwrap();
        for absent in [
            "[model.tiny]",
            "max_seq_len",
            "[sampler]",
            "[remote_trainer]",
        ] {
            assert!(!text.contains(absent), "{absent} in\n{text}");
        }
        for present in ["loss = ", "samples = ", "[eval]"] {
            assert!(text.contains(present), "{present} not in\n{text}");
        }
        assert_eq!(resolve::<RlConfig>(&text, &[]).unwrap(), rl);
        // The ratio clips only with a loss that clips.
        assert!(!text.contains("clip_low"), "{text}");
        let ppo: RlConfig = resolve(
            "[model]\npath = \"m.gguf\"\n[[env]]\nid = \"arithmetic\"\n[trainer]\nloss = \"ppo\"\n",
            &[],
        )
        .unwrap();
        assert!(ppo.dry_run().unwrap().contains("clip_low = 0.8"));
        // The tiny preset keeps its sizes.
        let tiny: RlConfig = resolve(EXAMPLE, &[]).unwrap();
        assert!(tiny.dry_run().unwrap().contains("[model.tiny]"));

        let sft: SftConfig = resolve(
            "[model]\npath = \"m\"\n[data]\npath = \"chat.jsonl\"\n",
            &[],
        )
        .unwrap();
        let text = sft.dry_run().unwrap();
        for absent in [
            "loss",
            "clip_low",
            "normalize_std",
            "teacher_noise",
            "answer_format",
            "samples",
            "[model.tiny]",
        ] {
            assert!(!text.contains(absent), "{absent} in\n{text}");
        }
        assert!(
            text.contains("max_seq_len") && text.contains("[eval]"),
            "{text}"
        );
        assert_eq!(resolve::<SftConfig>(&text, &[]).unwrap(), sft);
        let from_env: SftConfig = resolve(
            "[model]\npath = \"m\"\n[data]\nenv = { id = \"arithmetic\" }\n",
            &[],
        )
        .unwrap();
        assert!(from_env.dry_run().unwrap().contains("teacher_noise"));
    }
}
