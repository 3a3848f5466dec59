//! The RL loop: samplers roll out groups from the newest published policy
//! while the trainer trains; group-relative advantages; bounded staleness.
//!
//! Versions: policy version `v` is the weights after `v` optimizer steps.
//! Batch `j` is trained by step `j` (which turns version `j` into `j+1`);
//! the producer starts batch `j` only once version `j − max_off_policy_steps`
//! is published, so with a bound of 0 sampling and training alternate (the
//! synchronous loop), and with a bound of `k` sampling runs up to `k` steps
//! ahead. Every rollout carries the version that sampled it; a group whose
//! version lags its step by more than the bound is dropped, never trained
//! on (it can happen with an external sampler that swaps adapters late).
//!
//! Randomness is derived from `(seed, step, group, rollout)`, so a resumed
//! run samples exactly what the uninterrupted run would have, and the data
//! position is a function of the step.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use serde::{Deserialize, Serialize};
use serde_json::{json, Map, Value};
use temper_engine::{AdamParams, Datum, Engine, LocalTrainer, Loss, LossInputs, Trainer};
use temper_env::{ChatModel, Environment, Rollout, Row, SamplingArgs, Score, Split};
use temper_model::{LoadOptions, LoraConfig, Pretrained, Target};
use tokio::sync::{mpsc, watch};

use crate::config::{LoraSection, ModelSection, RlConfig};
use crate::error::{Result, RlError};
use crate::policy::{Batcher, EnginePolicy, HttpPolicy, Renderer};
use temper_env::TokenTrace;
use crate::runlog::{write_atomic, MetricsLog};

/// One prompt's rollouts, scored.
#[derive(Debug, Clone)]
pub struct Group {
    /// Index of the environment in the config's `[[env]]` list.
    pub env: usize,
    /// The row.
    pub row: Row,
    /// Its rollouts.
    pub rollouts: Vec<Rollout>,
    /// Their scores.
    pub scores: Vec<Score>,
    /// Oldest policy version among the rollouts' model turns.
    pub version: u64,
}

/// One step's groups.
#[derive(Debug, Clone)]
pub struct Batch {
    /// The step that trains on it.
    pub step: u64,
    /// Groups.
    pub groups: Vec<Group>,
    /// Seconds spent generating it.
    pub generate_s: f64,
}

/// How `run_rl` was asked to run.
#[derive(Debug, Clone, Default)]
pub struct RunOptions {
    /// Continue from the run directory's latest checkpoint.
    pub resume: bool,
    /// Stop (as if killed) after this many steps of this session — for
    /// tests of resumption; `None` runs to `max_steps`.
    pub stop_after: Option<u64>,
}

/// What a finished run reports.
#[derive(Debug, Clone)]
pub struct RlOutcome {
    /// The run directory.
    pub run_dir: PathBuf,
    /// Steps completed (in total, across resumes).
    pub steps: u64,
    /// Held-out reward before training (when evaluated).
    pub eval_before: Option<EvalResult>,
    /// Held-out reward after training.
    pub eval_after: Option<EvalResult>,
    /// The trained adapter (PEFT) or model (HF) directory.
    pub output: PathBuf,
    /// Every step's metrics.
    pub metrics: Vec<Map<String, Value>>,
}

/// A held-out evaluation.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EvalResult {
    /// Policy version evaluated.
    pub step: u64,
    /// Mean reward.
    pub reward: f64,
    /// Fraction of rollouts at or above the pass threshold.
    pub accuracy: f64,
    /// Rollouts.
    pub n: usize,
    /// Distinct prompts among them (a small task space repeats questions).
    pub distinct: usize,
    /// Where `temper eval`'s results.jsonl / metadata.json went.
    pub dir: PathBuf,
}

/// `checkpoints/latest.json`: what a resume needs beyond the weights.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct LoopState {
    step: u64,
    state_path: String,
    dropped_stale: u64,
    seed: u64,
    eval_before: Option<EvalResult>,
}

/// Resolve `[model]` to a model directory, writing the preset if asked.
pub fn model_dir(m: &ModelSection, run_dir: &Path) -> Result<PathBuf> {
    match (&m.path, m.preset.as_deref()) {
        (Some(p), None) => Ok(p.clone()),
        (None, Some("tiny")) => {
            let dir = run_dir.join("base-model");
            if !dir.join("model.safetensors").exists() {
                m.tiny.write(&dir, 0)?;
            }
            Ok(dir)
        }
        (None, Some(other)) => Err(RlError::Config(format!(
            "unknown model preset {other:?} (known: \"tiny\")"
        ))),
        (Some(_), Some(_)) => Err(RlError::Config(
            "[model] has both `path` and `preset`; pick one".into(),
        )),
        (None, None) => Err(RlError::Config(
            "[model] needs `path` (a Hugging Face directory) or `preset = \"tiny\"`".into(),
        )),
    }
}

/// The LoRA config of `[lora]`.
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
        return Err(RlError::Config("lora.rank must be >= 1".into()));
    }
    Ok(LoraConfig {
        rank: l.rank,
        alpha: l.alpha,
        targets,
        use_rslora: l.rslora,
    })
}

/// The in-process trainer for `[model]` + `[lora]`: the loaded base, and a
/// [`LocalTrainer`] whose checkpoints go under `run_dir/checkpoints`.
pub fn local_trainer(
    model: &ModelSection,
    lora: &LoraSection,
    seed: u64,
    run_dir: &Path,
) -> Result<(Arc<Pretrained>, Arc<LocalTrainer>)> {
    let dir = model_dir(model, run_dir)?;
    let base = Arc::new(Pretrained::load(&dir, &LoadOptions::default())?);
    let engine = Engine::new();
    engine.add_base_model("base", base.clone()).wait()?;
    let run = if let Some(adapter) = &model.adapter {
        if !lora.enabled {
            return Err(RlError::Config(
                "[model] adapter needs [lora] enabled = true (it continues a LoRA run)".into(),
            ));
        }
        tracing::info!(adapter = %adapter.display(), "continuing from a PEFT adapter (its rank/alpha/targets are used)");
        engine
            .create_lora_run_from_peft("base", adapter.clone())
            .wait()?
    } else if lora.enabled {
        engine
            .create_lora_run("base", lora_config(lora)?, seed)
            .wait()?
    } else {
        engine.create_full_run("base").wait()?
    };
    let trainer = LocalTrainer::new(engine, run, run_dir.join("checkpoints"));
    Ok((base, Arc::new(trainer)))
}

fn mix(parts: &[u64]) -> u64 {
    // SplitMix64 over the parts: well-spread seeds from small integers.
    let mut h: u64 = 0x243F_6A88_85A3_08D3;
    for &p in parts {
        h ^= p.wrapping_add(0x9E37_79B9_7F4A_7C15);
        h = (h ^ (h >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        h = (h ^ (h >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        h ^= h >> 31;
    }
    h
}

/// Where the published policy can be sampled.
#[derive(Clone)]
struct Published {
    version: u64,
    model: Arc<dyn ChatModel>,
}

/// How new weights reach the sampler.
enum Publisher {
    Engine {
        trainer: Arc<dyn Trainer>,
        renderer: Renderer,
        batcher: Batcher,
        /// Handles still published, oldest first.
        live: std::collections::VecDeque<String>,
        /// How many to keep: every version a producer may still sample from.
        keep: usize,
    },
    Http {
        trainer: Arc<dyn Trainer>,
        policy: HttpPolicy,
        dir: PathBuf,
        versions: Arc<std::sync::Mutex<BTreeMap<u64, u64>>>,
    },
}

impl Publisher {
    async fn publish(&mut self, version: u64) -> Result<Published> {
        match self {
            Publisher::Engine {
                trainer,
                renderer,
                batcher,
                live,
                keep,
            } => {
                let handle = trainer
                    .save_weights_for_sampler(&format!("policy-{version}"))
                    .await?;
                live.push_back(handle.clone());
                // A long run would otherwise keep one weight snapshot per step.
                while live.len() > *keep {
                    if let Some(old) = live.pop_front() {
                        trainer.release_sampler(&old).await?;
                    }
                }
                let model = EnginePolicy::new(renderer.clone(), batcher.clone(), handle, version);
                Ok(Published {
                    version,
                    model: Arc::new(model),
                })
            }
            Publisher::Http {
                trainer,
                policy,
                dir,
                versions,
            } => {
                // Two alternating directories: the server may still be
                // reading the previous one.
                let d = dir.join(format!("v{}", version % 2));
                trainer.export_peft(&d).await?;
                let server_version = policy.load_adapter(&d).await?;
                versions
                    .lock()
                    .map_err(|_| RlError::Sampler("version map poisoned".into()))?
                    .insert(server_version, version);
                Ok(Published {
                    version,
                    model: Arc::new(VersionMapped {
                        inner: policy.clone(),
                        versions: versions.clone(),
                    }),
                })
            }
        }
    }
}

/// An HTTP policy whose turns report our policy version, mapped from the
/// server's adapter version.
struct VersionMapped {
    inner: HttpPolicy,
    versions: Arc<std::sync::Mutex<BTreeMap<u64, u64>>>,
}

#[async_trait::async_trait]
impl ChatModel for VersionMapped {
    async fn chat(
        &self,
        req: temper_env::ChatRequest,
    ) -> std::result::Result<temper_env::ModelTurn, temper_env::ModelCallError> {
        let mut turn = self.inner.chat(req).await?;
        if let Some(t) = turn.trace.as_mut() {
            let map = self
                .versions
                .lock()
                .map_err(|_| temper_env::ModelCallError::Other("version map poisoned".into()))?;
            // A version the server made that we never published (someone
            // else loaded an adapter) counts as the oldest: it is dropped.
            t.version = map.get(&t.version).copied().unwrap_or(0);
        }
        Ok(turn)
    }
}

/// Everything the loop reads, shared by the producer and the trainer.
struct Ctx {
    cfg: RlConfig,
    envs: Vec<Arc<dyn Environment>>,
    pools: Vec<Vec<Row>>,
    schedule: Vec<usize>,
}

impl Ctx {
    /// The groups of batch `step`: (env index, row).
    fn batch_rows(&self, step: u64) -> Vec<(usize, Row)> {
        let b = self.cfg.trainer.batch_size as u64;
        (0..b)
            .map(|g| {
                let i = (step * b + g) as usize;
                let e = self.schedule[i % self.schedule.len()];
                // How many earlier groups used env e: its row position.
                let cycles = i / self.schedule.len();
                let per_cycle = self.schedule.iter().filter(|&&x| x == e).count();
                let before = self.schedule[..i % self.schedule.len()]
                    .iter()
                    .filter(|&&x| x == e)
                    .count();
                let pos = cycles * per_cycle + before;
                let pool = &self.pools[e];
                (e, pool[pos % pool.len()].clone())
            })
            .collect()
    }

    fn sampling(&self, seed: u64) -> SamplingArgs {
        SamplingArgs {
            max_tokens: self.cfg.sampling.max_tokens,
            temperature: self.cfg.sampling.temperature,
            top_p: self.cfg.sampling.top_p,
            seed: Some(seed),
            ..Default::default()
        }
    }
}

/// A deterministic interleaving of environments by weight (smooth weighted
/// round robin over a cycle of at most 100 slots).
fn mixing_schedule(weights: &[f64]) -> Result<Vec<usize>> {
    if weights.is_empty() {
        return Err(RlError::Config("at least one [[env]] is needed".into()));
    }
    if weights.iter().any(|w| !(w.is_finite() && *w > 0.0)) {
        return Err(RlError::Config("env weights must be > 0".into()));
    }
    let total: f64 = weights.iter().sum();
    let slots = 100usize;
    let mut current = vec![0.0; weights.len()];
    let mut out = Vec::with_capacity(slots);
    for _ in 0..slots {
        for (c, w) in current.iter_mut().zip(weights) {
            *c += w;
        }
        let (best, _) =
            current.iter().enumerate().fold(
                (0, f64::MIN),
                |acc, (i, &c)| if c > acc.1 { (i, c) } else { acc },
            );
        current[best] -= total;
        out.push(best);
    }
    Ok(out)
}

async fn generate_batch(
    ctx: &Ctx,
    step: u64,
    policy: &Published,
    batcher: Option<&Batcher>,
) -> Batch {
    let t0 = Instant::now();
    let rows = ctx.batch_rows(step);
    let g_size = ctx.cfg.sampling.group_size;
    if let Some(b) = batcher {
        b.expect(rows.len() * g_size);
    }
    let seed = ctx.cfg.seed;
    let groups = rows.into_iter().enumerate().map(|(g, (e, row))| {
        let env = ctx.envs[e].clone();
        let model = policy.model.clone();
        let fallback = policy.version;
        let args: Vec<SamplingArgs> = (0..g_size)
            .map(|k| ctx.sampling(mix(&[seed, step, g as u64, k as u64])))
            .collect();
        async move {
            let rollouts: Vec<Rollout> = futures::future::join_all(
                args.iter().map(|a| env.rollout(model.as_ref(), &row, a)),
            )
            .await;
            let mut rollouts = rollouts;
            let scores = temper_env::score_and_time(env.as_ref(), &row, &mut rollouts).await;
            let version = rollouts
                .iter()
                .flat_map(|r| r.model_turns.iter())
                .filter_map(|t| t.trace.as_ref())
                .map(|t| t.version)
                .min()
                .unwrap_or(fallback);
            Group {
                env: e,
                row,
                rollouts,
                scores,
                version,
            }
        }
    });
    let groups = futures::future::join_all(groups).await;
    Batch {
        step,
        groups,
        generate_s: t0.elapsed().as_secs_f64(),
    }
}

/// Advantages of one group: reward minus the group mean, optionally over
/// the group's standard deviation. All zero when every reward is equal.
pub fn group_advantages(rewards: &[f64], normalize_std: bool) -> Vec<f64> {
    let n = rewards.len().max(1) as f64;
    let mean = rewards.iter().sum::<f64>() / n;
    let var = rewards.iter().map(|r| (r - mean).powi(2)).sum::<f64>() / n;
    let std = var.sqrt();
    rewards
        .iter()
        .map(|r| {
            let a = r - mean;
            if normalize_std {
                a / (std + 1e-6)
            } else {
                a
            }
        })
        .collect()
}

fn loss_of(cfg: &RlConfig) -> Result<Loss> {
    match cfg.trainer.loss.as_str() {
        "importance_sampling" => Ok(Loss::ImportanceSampling),
        "ppo" => Ok(Loss::Ppo {
            clip_low: cfg.trainer.clip_low,
            clip_high: cfg.trainer.clip_high,
        }),
        "cispo" => Ok(Loss::Cispo {
            clip_low: cfg.trainer.clip_low,
            clip_high: cfg.trainer.clip_high,
        }),
        other => Err(RlError::Config(format!(
            "trainer.loss {other:?}: use importance_sampling, ppo or cispo"
        ))),
    }
}

fn mean(xs: &[f64]) -> f64 {
    if xs.is_empty() {
        0.0
    } else {
        xs.iter().sum::<f64>() / xs.len() as f64
    }
}

/// One training step on `batch`; returns the step's metrics.
async fn train_step(
    ctx: &Ctx,
    trainer: &dyn Trainer,
    batch: &Batch,
    step: u64,
    dropped_total: &mut u64,
) -> Result<Map<String, Value>> {
    let cfg = &ctx.cfg;
    let max_off = cfg.async_.max_off_policy_steps;
    let mut m = Map::new();
    let mut rewards = Vec::new();
    let mut per_env: BTreeMap<usize, Vec<f64>> = BTreeMap::new();
    let mut lens = Vec::new();
    let mut truncated = 0usize;
    let mut lags = Vec::new();
    let mut dropped = 0u64;
    let mut zero_adv = 0u64;
    let mut skipped_turns = 0u64;
    let mut errors = 0usize;
    let mut metric_sums: BTreeMap<String, Vec<f64>> = BTreeMap::new();
    // (turn tokens, advantage) to train on.
    let mut items: Vec<(TokenTrace, f64)> = Vec::new();
    for g in &batch.groups {
        let lag = step.saturating_sub(g.version);
        if lag > max_off {
            dropped += 1;
            continue;
        }
        lags.push(lag as f64);
        let rs: Vec<f64> = g.scores.iter().map(|s| s.reward).collect();
        for (r, s) in g.rollouts.iter().zip(&g.scores) {
            rewards.push(s.reward);
            per_env.entry(g.env).or_default().push(s.reward);
            for (k, v) in &s.metrics {
                metric_sums.entry(k.clone()).or_default().push(*v);
            }
            lens.push(r.token_usage.output_tokens as f64);
            truncated += usize::from(r.is_truncated);
            errors += usize::from(r.error.is_some());
        }
        let adv = group_advantages(&rs, cfg.trainer.normalize_std);
        if adv.iter().all(|a| *a == 0.0) {
            zero_adv += 1;
            continue;
        }
        for (r, a) in g.rollouts.iter().zip(adv) {
            if r.error.is_some() {
                continue;
            }
            for turn in &r.model_turns {
                // A turn without a usable token trace cannot be trained: it
                // is counted, never filled in with zeros.
                let Ok(t) = turn.trainable_trace() else {
                    skipped_turns += 1;
                    continue;
                };
                if !t.completion_ids.is_empty() {
                    items.push((t.clone(), a));
                }
            }
        }
    }
    *dropped_total += dropped;

    // Token-level normalisation: every trained token weighs 1/N.
    let n_tokens: usize = items.iter().map(|(t, _)| t.completion_ids.len()).sum();
    let data: Vec<Datum> = items
        .iter()
        .map(|(t, a)| {
            let p = t.prompt_ids.len();
            let mut all = t.prompt_ids.clone();
            all.extend_from_slice(&t.completion_ids);
            let n = all.len();
            let scale = (*a / n_tokens.max(1) as f64) as f32;
            let mut adv = vec![0.0f32; n - 1];
            let mut lp = vec![0.0f32; n - 1];
            // `items` holds only turns with one logprob per completion token.
            for (i, &q) in t.logprobs.iter().enumerate() {
                adv[p - 1 + i] = scale;
                lp[p - 1 + i] = q;
            }
            Datum {
                model_input: all[..n - 1].to_vec(),
                loss_fn_inputs: LossInputs {
                    target_tokens: all[1..].to_vec(),
                    weights: None,
                    logprobs: Some(lp),
                    advantages: Some(adv),
                    // Score at the temperature the sampler drew at.
                    temperature: Some(t.scoring_temperature()),
                },
            }
        })
        .collect();

    let t_train = Instant::now();
    let loss = loss_of(cfg)?;
    let mut mismatch_max = 0.0f64;
    let mut mismatch_sum = 0.0f64;
    let mut entropy_sum = 0.0f64;
    let mut entropy_tokens = 0usize;
    let mut loss_sum = 0.0f64;
    let micro = if cfg.trainer.micro_batch == 0 {
        data.len().max(1)
    } else {
        cfg.trainer.micro_batch
    };
    let mut grad_norm = 0.0;
    let lr = learning_rate(cfg.trainer.lr, cfg.trainer.warmup_steps, step);
    if !data.is_empty() {
        let mut offset = 0;
        for chunk in data.chunks(micro) {
            let out = trainer
                .forward_backward(chunk.to_vec(), loss.clone())
                .await?;
            loss_sum += out.metrics.get("loss:sum").copied().unwrap_or(0.0);
            for (k, o) in out.loss_fn_outputs.iter().enumerate() {
                let (t, _) = &items[offset + k];
                let p = t.prompt_ids.len();
                let n = t.completion_ids.len();
                let Some(learner) = o.logprobs.get(p - 1..p - 1 + n) else {
                    return Err(RlError::Data(format!(
                        "the trainer returned {} logprobs for a datum of {} targets",
                        o.logprobs.len(),
                        p - 1 + n
                    )));
                };
                for (&l, &q) in learner.iter().zip(&t.logprobs) {
                    if t.version == step {
                        let d = (f64::from(l) - f64::from(q)).abs();
                        mismatch_max = mismatch_max.max(d);
                        mismatch_sum += d;
                    }
                }
                // A training API (the tinker protocol) returns no entropy;
                // the metric then averages over the tokens that have one.
                if let Some(ent) = o.entropy.get(p - 1..p - 1 + n) {
                    entropy_sum += ent.iter().map(|&e| f64::from(e)).sum::<f64>();
                    entropy_tokens += ent.len();
                }
            }
            offset += chunk.len();
        }
        let stats = trainer
            .optim_step(AdamParams {
                learning_rate: lr,
                weight_decay: cfg.trainer.weight_decay,
                grad_clip_norm: cfg.trainer.grad_clip,
                ..AdamParams::default()
            })
            .await?;
        grad_norm = stats.grad_norm;
    }
    let train_s = t_train.elapsed().as_secs_f64();
    let on_policy_tokens: usize = items
        .iter()
        .filter(|(t, _)| t.version == step)
        .map(|(t, _)| t.completion_ids.len())
        .sum();

    let threshold = cfg.eval_pass_threshold();
    m.insert("step".into(), json!(step + 1));
    m.insert("reward/mean".into(), json!(mean(&rewards)));
    let rm = mean(&rewards);
    let rstd = (rewards.iter().map(|r| (r - rm).powi(2)).sum::<f64>()
        / rewards.len().max(1) as f64)
        .sqrt();
    m.insert("reward/std".into(), json!(rstd));
    for (e, rs) in &per_env {
        let id = ctx
            .envs
            .get(*e)
            .map_or_else(|| format!("env{e}"), |env| env.id().to_string());
        let mu = mean(rs);
        let sd = (rs.iter().map(|r| (r - mu).powi(2)).sum::<f64>() / rs.len().max(1) as f64).sqrt();
        m.insert(format!("reward/{id}/mean"), json!(mu));
        m.insert(format!("reward/{id}/std"), json!(sd));
    }
    for (k, v) in &metric_sums {
        m.insert(format!("metric/{k}"), json!(mean(v)));
    }
    let passes = rewards.iter().filter(|r| **r >= threshold).count();
    m.insert(
        "pass_rate".into(),
        json!(passes as f64 / rewards.len().max(1) as f64),
    );
    m.insert("seq_len/mean".into(), json!(mean(&lens)));
    m.insert(
        "truncation_rate".into(),
        json!(truncated as f64 / lens.len().max(1) as f64),
    );
    m.insert("rollout_errors".into(), json!(errors));
    m.insert("policy_lag/mean".into(), json!(mean(&lags)));
    m.insert(
        "policy_lag/max".into(),
        json!(lags.iter().copied().fold(0.0, f64::max)),
    );
    m.insert("dropped_stale".into(), json!(dropped));
    m.insert("dropped_stale/total".into(), json!(*dropped_total));
    m.insert("zero_advantage_groups".into(), json!(zero_adv));
    m.insert("skipped_turns".into(), json!(skipped_turns));
    m.insert("trained_sequences".into(), json!(data.len()));
    m.insert("trained_tokens".into(), json!(n_tokens));
    m.insert("loss".into(), json!(loss_sum));
    m.insert("mismatch/max".into(), json!(mismatch_max));
    m.insert(
        "mismatch/mean".into(),
        json!(mismatch_sum / on_policy_tokens.max(1) as f64),
    );
    // Mismatch is only defined on tokens sampled by the weights being
    // trained (lag 0); this says how many there were.
    m.insert("mismatch/tokens".into(), json!(on_policy_tokens));
    m.insert(
        "entropy".into(),
        json!(entropy_sum / entropy_tokens.max(1) as f64),
    );
    m.insert("grad_norm".into(), json!(grad_norm));
    m.insert("lr".into(), json!(lr));
    m.insert("time/train".into(), json!(train_s));
    m.insert("time/generate".into(), json!(batch.generate_s));
    m.insert(
        "tokens_per_s".into(),
        json!(n_tokens as f64 / train_s.max(1e-9)),
    );
    Ok(m)
}

/// Linear warm-up to `lr` over `warmup` steps, then constant.
pub fn learning_rate(lr: f64, warmup: u64, step: u64) -> f64 {
    if warmup == 0 {
        lr
    } else {
        lr * ((step + 1) as f64 / warmup as f64).min(1.0)
    }
}

impl RlConfig {
    /// A rollout passes at reward ≥ 1 (a correct answer under a rubric
    /// whose main reward has weight 1).
    pub fn eval_pass_threshold(&self) -> f64 {
        1.0
    }
}

/// Evaluate `model` (policy `step`) on the held-out split of the eval env,
/// through `temper eval`'s runner; results land in `run_dir/evals/step-N`.
async fn evaluate(
    cfg: &RlConfig,
    model: Arc<dyn ChatModel>,
    run_dir: &Path,
    step: u64,
    batcher: Option<&Batcher>,
) -> Result<EvalResult> {
    let (spec, args) = eval_env(cfg);
    let env = temper_env::load_environment(&spec, &args)
        .map_err(|e| RlError::Env(format!("{spec}: {e}")))?;
    let dir = run_dir.join("evals").join(format!("step-{step:06}"));
    if dir.exists() {
        std::fs::remove_dir_all(&dir).map_err(|e| RlError::io(&dir, e))?;
    }
    let n = cfg.eval.num_examples;
    if let Some(b) = batcher {
        b.expect(n);
    }
    let ecfg = temper_eval::EvalConfig {
        env_spec: spec.clone(),
        env_args: args,
        model: format!("policy@{step}"),
        base_url: "in-process".into(),
        api_key: None,
        api_key_env: None,
        num_examples: n,
        rollouts_per_example: 1,
        max_concurrent: n.max(1),
        sampling: SamplingArgs {
            max_tokens: cfg.sampling.max_tokens,
            temperature: cfg.eval.temperature,
            top_p: 1.0,
            seed: Some(mix(&[cfg.seed, 0xE7A1])),
            ..Default::default()
        },
        seed: cfg.seed,
        run_dir: dir.clone(),
        request_timeout: std::time::Duration::from_secs(3600),
        retry: Default::default(),
        pass_threshold: cfg.eval_pass_threshold(),
        resume: false,
        progress: false,
    };
    let out = temper_eval::run_eval_with(env, model, &ecfg)
        .await
        .map_err(|e| RlError::Env(format!("evaluation: {e}")))?;
    let results = std::fs::read_to_string(dir.join("results.jsonl")).unwrap_or_default();
    let distinct: std::collections::HashSet<String> = results
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .map(|v| v["prompt"].to_string())
        .collect();
    Ok(EvalResult {
        step,
        reward: out.metadata.avg_reward,
        accuracy: out.metadata.pass_at_k.get("1").copied().unwrap_or(0.0),
        n: out.metadata.num_rollouts,
        distinct: distinct.len(),
        dir,
    })
}

fn eval_env(cfg: &RlConfig) -> (String, Value) {
    let first = cfg.env.first();
    let spec = cfg
        .eval
        .env
        .clone()
        .or_else(|| first.map(|e| e.id.clone()))
        .unwrap_or_default();
    let args = cfg.eval.args.clone().unwrap_or_else(|| {
        first
            .filter(|e| e.id == spec)
            .map(|e| e.args.clone())
            .unwrap_or(Value::Null)
    });
    (spec, args)
}

fn progress_line(m: &Map<String, Value>, max_steps: u64, step_s: f64) -> String {
    let f = |k: &str| m.get(k).and_then(Value::as_f64).unwrap_or(0.0);
    let mismatch = if f("mismatch/tokens") > 0.0 {
        format!("{:.1e}", f("mismatch/max"))
    } else {
        "n/a".into()
    };
    format!(
        "step {:>4}/{max_steps}  reward {:.3}  pass {:>5.1}%  len {:>5.1}  lag {:.2}  dropped {}  zero-adv {}  mismatch {mismatch}  ent {:.3}  |g| {:.3}  {:.1}s (gen {:.1}s, train {:.1}s, wait {:.1}s)",
        f("step") as u64,
        f("reward/mean"),
        100.0 * f("pass_rate"),
        f("seq_len/mean"),
        f("policy_lag/mean"),
        f("dropped_stale/total") as u64,
        // Groups with all-equal rewards train nothing: a step where every
        // group is zero-advantage shows `ent 0 |g| 0` for that reason.
        f("zero_advantage_groups") as u64,
        f("entropy"),
        f("grad_norm"),
        step_s,
        f("time/generate"),
        f("time/train"),
        f("time/wait"),
    )
}

/// The metrics plotted into `plots.html`.
pub const PLOTTED: &[&str] = &[
    "reward/mean",
    "pass_rate",
    "eval/accuracy",
    "seq_len/mean",
    "entropy",
    "grad_norm",
    "mismatch/max",
    "policy_lag/mean",
    "time/step",
];

/// Run `temper train rl` with `cfg` in `cfg.log.dir`.
pub async fn run_rl(cfg: RlConfig, opts: RunOptions) -> Result<RlOutcome> {
    let run_dir = cfg.log.dir.clone();
    std::fs::create_dir_all(&run_dir).map_err(|e| RlError::io(&run_dir, e))?;
    if !opts.resume && run_dir.join("checkpoints").join("latest.json").exists() {
        return Err(RlError::Config(format!(
            "{} already holds a run; pass --resume {0} to continue it, or choose another --log.dir",
            run_dir.display()
        )));
    }
    write_atomic(
        &run_dir.join("config.toml"),
        crate::config::to_toml(&cfg)?.as_bytes(),
    )?;
    let (base, trainer): (Arc<Pretrained>, Arc<dyn Trainer>) = match &cfg.remote_trainer.url {
        None => {
            let (base, local) = local_trainer(&cfg.model, &cfg.lora, cfg.seed, &run_dir)?;
            (base, local)
        }
        Some(url) => {
            if !cfg.lora.enabled || cfg.lora.alpha != 32.0 {
                return Err(RlError::Config(
                    "a remote training API trains LoRA adapters with alpha 32: set lora.enabled = true, lora.alpha = 32".into(),
                ));
            }
            let dir = model_dir(&cfg.model, &run_dir)?;
            let base = Arc::new(Pretrained::load(&dir, &LoadOptions::default())?);
            let key = cfg
                .remote_trainer
                .api_key_env
                .as_ref()
                .and_then(|v| std::env::var(v).ok())
                .unwrap_or_default();
            let remote = temper_client::RemoteTrainer::connect(
                url,
                &key,
                &cfg.remote_trainer.base_model,
                cfg.lora.rank,
                Some(cfg.seed),
            )
            .await
            .map_err(|e| RlError::Sampler(format!("training API {url}: {e}")))?;
            (base, Arc::new(remote))
        }
    };
    run_rl_with(cfg, opts, base, trainer).await
}

/// [`run_rl`] with a given trainer (in-process, or a remote training API)
/// and the base model it trains (for its tokenizer and chat template).
pub async fn run_rl_with(
    cfg: RlConfig,
    opts: RunOptions,
    base: Arc<Pretrained>,
    trainer: Arc<dyn Trainer>,
) -> Result<RlOutcome> {
    let run_dir = cfg.log.dir.clone();
    if cfg.trainer.batch_size == 0 || cfg.sampling.group_size == 0 {
        return Err(RlError::Config(
            "trainer.batch_size and sampling.group_size must be >= 1".into(),
        ));
    }
    let _ = loss_of(&cfg)?;
    let mut envs = Vec::new();
    let mut pools = Vec::new();
    let total_groups = (cfg.trainer.max_steps as usize) * cfg.trainer.batch_size;
    for e in &cfg.env {
        let env = temper_env::load_environment(&e.id, &e.args)
            .map_err(|err| RlError::Env(format!("{}: {err}", e.id)))?;
        let share = (total_groups as f64 * e.weight / cfg.env.iter().map(|x| x.weight).sum::<f64>())
            .ceil() as usize;
        let rows = env
            .rows(Split::Train, share.clamp(1, 100_000), cfg.seed)
            .map_err(|err| RlError::Env(format!("{}: {err}", e.id)))?;
        if rows.is_empty() {
            return Err(RlError::Env(format!("{} has no training rows", e.id)));
        }
        envs.push(env);
        pools.push(rows);
    }
    let schedule = mixing_schedule(&cfg.env.iter().map(|e| e.weight).collect::<Vec<_>>())?;
    let ctx = Arc::new(Ctx {
        cfg: cfg.clone(),
        envs,
        pools,
        schedule,
    });

    // Resume.
    let latest_path = run_dir.join("checkpoints").join("latest.json");
    let mut start = 0u64;
    let mut dropped_total = 0u64;
    let mut eval_before = None;
    if opts.resume {
        let text =
            std::fs::read_to_string(&latest_path).map_err(|e| RlError::io(&latest_path, e))?;
        let st: LoopState = serde_json::from_str(&text)
            .map_err(|e| RlError::Config(format!("{}: {e}", latest_path.display())))?;
        trainer.load_state(&st.state_path, true).await?;
        start = st.step;
        dropped_total = st.dropped_stale;
        eval_before = st.eval_before;
        tracing::info!(step = start, "resumed from {}", st.state_path);
    }
    let mut log = MetricsLog::open(&run_dir, opts.resume.then_some(start))?;

    // Publishing.
    let renderer = Renderer::new(base.clone())?;
    let batcher = match &cfg.sampler.url {
        None => Some(Batcher::spawn(trainer.clone())),
        Some(_) => None,
    };
    let mut publisher = match &cfg.sampler.url {
        None => Publisher::Engine {
            trainer: trainer.clone(),
            renderer: renderer.clone(),
            batcher: batcher
                .clone()
                .ok_or_else(|| RlError::Sampler("no batcher".into()))?,
            live: Default::default(),
            // The producer may hold version j − max_off while j + 1 is
            // published; one more for the batch being handed over.
            keep: cfg.async_.max_off_policy_steps as usize + 3,
        },
        Some(url) => {
            if !cfg.lora.enabled {
                return Err(RlError::Config(
                    "an external sampler receives LoRA adapters: set lora.enabled = true".into(),
                ));
            }
            let key = cfg
                .sampler
                .api_key_env
                .as_ref()
                .and_then(|v| std::env::var(v).ok());
            let name = if cfg.sampler.adapter_name.is_empty() {
                "policy".to_string()
            } else {
                cfg.sampler.adapter_name.clone()
            };
            Publisher::Http {
                trainer: trainer.clone(),
                policy: HttpPolicy::new(renderer.clone(), url, &name, key),
                dir: run_dir.join("published"),
                versions: Default::default(),
            }
        }
    };
    let first = publisher.publish(start).await?;

    if eval_before.is_none() && cfg.eval.num_examples > 0 && start == 0 {
        let r = evaluate(&cfg, first.model.clone(), &run_dir, 0, batcher.as_ref()).await?;
        if cfg.log.progress {
            eprintln!(
                "eval before training: accuracy {:.1}%  reward {:.3}  ({} rollouts, {} distinct held-out questions)",
                100.0 * r.accuracy,
                r.reward,
                r.n,
                r.distinct
            );
        }
        eval_before = Some(r);
    }

    let max_steps = cfg.trainer.max_steps;
    let end = opts
        .stop_after
        .map_or(max_steps, |n| (start + n).min(max_steps));
    let max_off = cfg.async_.max_off_policy_steps;
    let (pub_tx, pub_rx) = watch::channel(first.clone());
    let (batch_tx, mut batch_rx) = mpsc::channel::<Batch>(1 + max_off as usize);
    let producer = cfg.async_.enabled.then(|| {
        let ctx = ctx.clone();
        let mut pub_rx = pub_rx.clone();
        let batcher = batcher.clone();
        tokio::spawn(async move {
            for j in start..end {
                let need = j.saturating_sub(max_off);
                let policy = match pub_rx.wait_for(|p| p.version >= need).await {
                    Ok(p) => p.clone(),
                    Err(_) => return,
                };
                let batch = generate_batch(&ctx, j, &policy, batcher.as_ref()).await;
                if batch_tx.send(batch).await.is_err() {
                    return;
                }
            }
        })
    });
    let mut current = first;

    let mut last_eval = None;
    let mut last_ckpt = String::new();
    let mut step = start;
    let run_started = Instant::now();
    while step < end {
        let t_step = Instant::now();
        let batch = if producer.is_some() {
            batch_rx
                .recv()
                .await
                .ok_or_else(|| RlError::Sampler("the rollout producer stopped".into()))?
        } else {
            generate_batch(&ctx, step, &current, batcher.as_ref()).await
        };
        let wait_s = t_step.elapsed().as_secs_f64();
        let mut m = train_step(&ctx, trainer.as_ref(), &batch, step, &mut dropped_total).await?;
        let t_pub = Instant::now();
        let published = publisher.publish(step + 1).await?;
        let _ = pub_tx.send(published.clone());
        current = published.clone();
        let pub_s = t_pub.elapsed().as_secs_f64();
        step += 1;
        m.insert("time/wait".into(), json!(wait_s));
        m.insert("time/publish".into(), json!(pub_s));
        let eval_due = cfg.eval.num_examples > 0
            && ((cfg.eval.interval > 0 && step.is_multiple_of(cfg.eval.interval))
                || step == max_steps);
        if eval_due {
            let r = evaluate(
                &cfg,
                published.model.clone(),
                &run_dir,
                step,
                batcher.as_ref(),
            )
            .await?;
            m.insert("eval/accuracy".into(), json!(r.accuracy));
            m.insert("eval/reward".into(), json!(r.reward));
            last_eval = Some(r);
        }
        let step_s = t_step.elapsed().as_secs_f64();
        m.insert("time/step".into(), json!(step_s));
        m.insert(
            "time/elapsed".into(),
            json!(run_started.elapsed().as_secs_f64()),
        );
        if cfg.log.progress {
            eprintln!("{}", progress_line(&m, max_steps, step_s));
            if let Some(r) = last_eval.as_ref().filter(|_| eval_due) {
                eprintln!(
                    "  eval @ step {step}: accuracy {:.1}%  reward {:.3}",
                    100.0 * r.accuracy,
                    r.reward
                );
            }
        }
        log.write(m)?;
        let ckpt_due =
            (cfg.ckpt.interval > 0 && step.is_multiple_of(cfg.ckpt.interval)) || step == max_steps;
        if ckpt_due {
            last_ckpt = checkpoint(
                &run_dir,
                trainer.as_ref(),
                step,
                dropped_total,
                cfg.seed,
                &eval_before,
                cfg.ckpt.keep,
            )
            .await?;
        }
        log.write_plots(&run_dir, "temper RL run", PLOTTED)?;
    }
    if let Some(p) = producer {
        p.abort();
    }

    let output = if step == max_steps {
        if cfg.remote_trainer.url.is_some() {
            // The weights stay with the training service: its checkpoint path.
            PathBuf::from(&last_ckpt)
        } else if cfg.lora.enabled {
            let d = run_dir.join("adapter");
            trainer.export_peft(&d).await?;
            d
        } else {
            run_dir.join("checkpoints")
        }
    } else {
        run_dir.join("checkpoints")
    };
    log.write_plots(&run_dir, "temper RL run", PLOTTED)?;
    Ok(RlOutcome {
        run_dir,
        steps: step,
        eval_before,
        eval_after: last_eval,
        output,
        metrics: log.records().to_vec(),
    })
}

/// Save trainer state for `step`, then (atomically) point
/// `checkpoints/latest.json` at it, then delete checkpoints beyond `keep`.
/// A kill at any point leaves `latest.json` naming a complete checkpoint.
async fn checkpoint(
    run_dir: &Path,
    trainer: &dyn Trainer,
    step: u64,
    dropped_stale: u64,
    seed: u64,
    eval_before: &Option<EvalResult>,
    keep: usize,
) -> Result<String> {
    let name = format!("step-{step:06}");
    let path = trainer.save_state(&name).await?;
    let st = LoopState {
        step,
        state_path: path.clone(),
        dropped_stale,
        seed,
        eval_before: eval_before.clone(),
    };
    let text = serde_json::to_string_pretty(&st).map_err(|e| RlError::Config(e.to_string()))?;
    let ckpt_dir = run_dir.join("checkpoints");
    write_atomic(&ckpt_dir.join("latest.json"), text.as_bytes())?;
    // Prune older local state directories (siblings named step-N).
    let state = PathBuf::from(&path);
    if let Some(parent) = state.parent().filter(|p| p.is_dir()) {
        let mut old: Vec<PathBuf> = std::fs::read_dir(parent)
            .map_err(|e| RlError::io(parent, e))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| {
                p.file_name()
                    .and_then(|n| n.to_str())
                    .is_some_and(|n| n.starts_with("step-"))
            })
            .collect();
        old.sort();
        let keep = keep.max(1);
        if old.len() > keep {
            for p in &old[..old.len() - keep] {
                if *p != state {
                    let _ = std::fs::remove_dir_all(p);
                }
            }
        }
    }
    Ok(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn progress_line_shows_the_zero_advantage_group_count() {
        let mut m = Map::new();
        m.insert("step".into(), json!(2));
        m.insert("zero_advantage_groups".into(), json!(3));
        let line = progress_line(&m, 5, 1.0);
        assert!(line.contains("zero-adv 3"), "{line}");
    }

    #[test]
    fn advantages_are_centred_and_optionally_scaled() {
        assert_eq!(
            group_advantages(&[1.0, 0.0, 0.0, 1.0], false),
            vec![0.5, -0.5, -0.5, 0.5]
        );
        let a = group_advantages(&[1.0, 0.0, 0.0, 1.0], true);
        assert!((a[0] - 1.0).abs() < 1e-5 && (a[1] + 1.0).abs() < 1e-5);
        assert!(group_advantages(&[0.3; 4], true).iter().all(|x| *x == 0.0));
    }

    #[test]
    fn the_mixing_schedule_follows_the_weights() {
        let s = mixing_schedule(&[3.0, 1.0]).unwrap();
        assert_eq!(s.iter().filter(|&&e| e == 0).count(), 75);
        assert_eq!(s.iter().filter(|&&e| e == 1).count(), 25);
        // Interleaved, not blocked.
        assert!(s[..8].contains(&1));
        assert!(mixing_schedule(&[]).is_err());
        assert!(mixing_schedule(&[1.0, 0.0]).is_err());
    }

    #[test]
    fn groups_older_than_the_bound_are_dropped_not_trained() {
        let dir = tempfile::tempdir().unwrap();
        let mut cfg: RlConfig = crate::config::resolve(
            "[model]\npreset = \"tiny\"\n[model.tiny]\nhidden_size = 32\nnum_layers = 1\n\
             num_heads = 2\nnum_kv_heads = 1\nintermediate_size = 64\n[lora]\nrank = 2\n",
            &[],
        )
        .unwrap();
        cfg.async_.max_off_policy_steps = 1;
        let (_base, trainer) = local_trainer(&cfg.model, &cfg.lora, 0, dir.path()).unwrap();
        let ctx = Ctx {
            cfg,
            envs: Vec::new(),
            pools: Vec::new(),
            schedule: vec![0],
        };
        let group = |version: u64| {
            let turn = |lp: f32, reward: f64| {
                let t = TokenTrace {
                    prompt_ids: vec![1, 5, 6],
                    completion_ids: vec![7, 8],
                    logprobs: vec![lp, lp],
                    version,
                    temperature: 1.0,
                };
                (
                    Rollout {
                        model_turns: vec![temper_env::ModelTurn {
                            message: temper_env::Message::assistant("x"),
                            finish_reason: "stop".into(),
                            usage: Default::default(),
                            trace: Some(t),
                        }],
                        ..Default::default()
                    },
                    Score {
                        reward,
                        metrics: Default::default(),
                    },
                )
            };
            let (r1, s1) = turn(-1.0, 1.0);
            let (r2, s2) = turn(-2.0, 0.0);
            Group {
                env: 0,
                row: Row {
                    example_id: 0,
                    prompt: vec![],
                    answer: None,
                    info: Value::Null,
                },
                rollouts: vec![r1, r2],
                scores: vec![s1, s2],
                version,
            }
        };
        let rt = tokio::runtime::Runtime::new().unwrap();
        let mut dropped = 0;
        // Step 3, bound 1: version 1 is two steps old (dropped), version 2 is fine.
        let batch = Batch {
            step: 3,
            groups: vec![group(1), group(2)],
            generate_s: 0.0,
        };
        let m = rt
            .block_on(train_step(&ctx, trainer.as_ref(), &batch, 3, &mut dropped))
            .unwrap();
        assert_eq!(dropped, 1);
        assert_eq!(m["dropped_stale"], json!(1));
        assert_eq!(
            m["trained_sequences"],
            json!(2),
            "only the fresh group's two rollouts"
        );
        assert_eq!(m["policy_lag/max"], json!(1.0));
        // Everything stale: nothing trained, no optimizer step.
        let batch = Batch {
            step: 5,
            groups: vec![group(1), group(3)],
            generate_s: 0.0,
        };
        let m = rt
            .block_on(train_step(&ctx, trainer.as_ref(), &batch, 5, &mut dropped))
            .unwrap();
        assert_eq!(dropped, 3);
        assert_eq!(m["trained_sequences"], json!(0));
        assert_eq!(m["grad_norm"], json!(0.0));
    }

    #[test]
    fn warmup_ramps_linearly() {
        assert_eq!(learning_rate(1.0, 0, 0), 1.0);
        assert_eq!(learning_rate(1.0, 4, 0), 0.25);
        assert_eq!(learning_rate(1.0, 4, 9), 1.0);
    }
}
