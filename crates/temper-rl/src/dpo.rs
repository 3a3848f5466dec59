//! Direct preference optimisation (`temper train dpo`): pairs of a chosen
//! and a rejected completion of one prompt, trained so that the policy's
//! log-ratio to a frozen reference grows on the chosen side and shrinks on
//! the rejected one.
//!
//! The objective follows TRL's `DPOTrainer` exactly: `π` and `ref` are the
//! policy's and the reference's logprobs of a completion, SUMMED over its
//! tokens, `Δ = π − ref`, and a batch's loss is the mean over its pairs of
//!
//! | `[dpo] loss` | per pair |
//! | --- | --- |
//! | `sigmoid` | `−log σ(β (Δ_c − Δ_r))` |
//! | `ipo` | `(Δ_c / n_c − Δ_r / n_r − 1 / (2β))²`, `n` the completion's tokens |
//!
//! with TRL's metrics: `rewards/chosen` = mean `β Δ_c`, `rewards/rejected`,
//! `rewards/margins` (their difference), `rewards/accuracies` (the fraction
//! of pairs with `β Δ_c > β Δ_r`), `logps/chosen`, `logps/rejected`.
//!
//! The loss couples a pair's two sequences. A trainer that takes a pair
//! loss (the in-process engine: [`Trainer::takes_pair_loss`]) computes it
//! in one `forward_backward` per step ([`temper_engine::Loss::Dpo`], each
//! pair's chosen and rejected side in the same call, the reference's summed
//! logprobs passed in as loss inputs). One that does not (a remote trainer:
//! the tinker wire has no pair loss) is trained the way Tinker's client-side
//! custom losses are, and the run says so when it starts: a `forward` for
//! the logprobs, the loss and its gradient `g = ∂L/∂π` here, then a
//! cross-entropy `forward_backward` with per-token weights `−g`, whose
//! gradient is the DPO loss's — the same gradient for twice the passes. The
//! optimiser, checkpoints, metrics log and evaluation are SFT's.
//!
//! The reference is the policy before the first step (the base model for a
//! new LoRA adapter, whose update starts at zero — TRL's "adapter
//! disabled"; the base plus `[model] adapter` when continuing one, as TRL's
//! copy of the initial adapter). For a preference file its logprobs are
//! computed once, up front, and kept: no second model is held, LoRA or full.
//! Online pairs are new each step, so they are scored by a frozen snapshot
//! of the starting weights (for LoRA, a copy of the adapter only; for full
//! fine-tuning, of the whole model).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use rand::seq::SliceRandom;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use serde_json::{json, Map, Value};
use temper_engine::{Datum, Loss, PairLoss, Trainer};
use temper_model::{ChatTemplate, Pretrained, Tokenizer};

use crate::checkpoint;
use crate::error::{Result, RlError};
use crate::eval::EvalResult;
use crate::plan::{DpoLoss, DpoPlan, PrefSource};
use crate::rl::RunOptions;
use crate::sft::{epoch_batch, run_start, RunEval};
use crate::step::{forward_backward_chunks, optim_step};

pub use crate::pref_pair::{PairLogps, PrefPair};

/// A completion's summed logprob, from one datum's per-target logprobs.
fn completion_logp(pair: &PrefPair, logprobs: &[f32]) -> f64 {
    let skip = pair.prompt.len() - 1;
    logprobs[skip..].iter().map(|&x| x as f64).sum()
}

/// Is `v` a list of chat messages (TRL's conversational format)?
fn is_messages(v: &Value) -> bool {
    v.as_array()
        .is_some_and(|a| a.iter().all(|m| m.get("role").is_some()))
}

/// Tokenize one row of a preference file as TRL does:
///
/// - text: `prompt` as is, `chosen` / `rejected` with the EOS token appended
///   unless they end with it; the completion is what tokenizing `prompt +
///   completion` adds after the prompt's tokens;
/// - conversational: the prompt rendered with the generation prompt, each
///   side as the template renders `prompt + completion`, the completion again
///   the tokens after the prompt's; a row with only `chosen` and `rejected`
///   takes their common leading messages as the prompt.
pub fn tokenize_pair(
    template: Option<&ChatTemplate>,
    tokenizer: &Tokenizer,
    eos: &str,
    row: &Value,
    max_len: usize,
) -> Result<PrefPair> {
    let (chosen, rejected) = match (row.get("chosen"), row.get("rejected")) {
        (Some(c), Some(r)) => (c, r),
        _ => {
            return Err(RlError::Data(
                "a preference row needs `chosen` and `rejected` (and `prompt`)".into(),
            ))
        }
    };
    let encode = |text: &str, special: bool| -> Result<Vec<u32>> {
        Ok(tokenizer
            .inner()
            .encode(text, special)
            .map_err(|e| RlError::Data(format!("tokenize: {e}")))?
            .get_ids()
            .to_vec())
    };
    let (prompt_ids, chosen_full, rejected_full) = if is_messages(chosen) && is_messages(rejected) {
        let template = template.ok_or_else(|| {
            RlError::Data("conversational pairs need a model with a chat template".into())
        })?;
        let (c, r) = (chosen.as_array().unwrap_or(&Vec::new()).clone(), {
            rejected.as_array().unwrap_or(&Vec::new()).clone()
        });
        let (prompt, c, r) = match row.get("prompt") {
            Some(p) if is_messages(p) => (p.as_array().cloned().unwrap_or_default(), c, r),
            Some(_) => {
                return Err(RlError::Data(
                    "conversational `chosen`/`rejected` need a message-list `prompt`".into(),
                ))
            }
            None => {
                // TRL's implicit prompt: the messages both conversations share.
                let k = c.iter().zip(&r).take_while(|(a, b)| a == b).count();
                (c[..k].to_vec(), c[k..].to_vec(), r[k..].to_vec())
            }
        };
        if prompt.is_empty() || c.is_empty() || r.is_empty() {
            return Err(RlError::Data(
                "a conversational pair needs prompt messages and a chosen and a rejected reply"
                    .into(),
            ));
        }
        let extra = Map::new();
        let render = |m: &[Value], gen: bool| -> Result<Vec<u32>> {
            let text = template.render(&Value::Array(m.to_vec()), None, gen, &extra)?;
            encode(&text, false)
        };
        let full = |side: Vec<Value>| -> Result<Vec<u32>> {
            let mut all = prompt.clone();
            all.extend(side);
            render(&all, false)
        };
        (render(&prompt, true)?, full(c)?, full(r)?)
    } else {
        let text = |v: &Value, what: &str| -> Result<String> {
            v.as_str().map(str::to_string).ok_or_else(|| {
                RlError::Data(format!(
                    "`{what}` must be text, or every field a list of chat messages"
                ))
            })
        };
        let prompt = text(
            row.get("prompt")
                .ok_or_else(|| RlError::Data("a text pair needs `prompt`".into()))?,
            "prompt",
        )?;
        let with_eos = |s: String| if s.ends_with(eos) { s } else { s + eos };
        let (c, r) = (
            with_eos(text(chosen, "chosen")?),
            with_eos(text(rejected, "rejected")?),
        );
        (
            encode(&prompt, true)?,
            encode(&format!("{prompt}{c}"), true)?,
            encode(&format!("{prompt}{r}"), true)?,
        )
    };
    let p = prompt_ids.len();
    for (side, full) in [("chosen", &chosen_full), ("rejected", &rejected_full)] {
        if full.len() <= p || full[..p] != prompt_ids[..] {
            return Err(RlError::Data(format!(
                "prompt + {side} does not tokenize as the prompt's tokens followed by the \
                 completion's (or the completion is empty)"
            )));
        }
        if full.len() > max_len {
            return Err(RlError::Data(format!(
                "prompt + {side} is {} tokens, longer than max_seq_len {max_len}",
                full.len()
            )));
        }
    }
    if p == 0 {
        return Err(RlError::Data("the prompt tokenizes to nothing".into()));
    }
    Ok(PrefPair {
        chosen: chosen_full[p..].to_vec(),
        rejected: rejected_full[p..].to_vec(),
        prompt: prompt_ids,
    })
}

/// The pairs of a preference JSONL/Parquet file; errors name the row.
pub fn read_pairs(path: &Path, base: &Pretrained, max_len: usize) -> Result<Vec<PrefPair>> {
    let rows = temper_env::manifest::read_records(path)
        .map_err(|e| RlError::Data(format!("{}: {e}", path.display())))?;
    let eos = eos_text(base)?;
    let pairs = rows
        .iter()
        .enumerate()
        .map(|(i, r)| {
            // Parquet stores message lists as JSON text.
            let mut r = r.clone();
            for k in ["prompt", "chosen", "rejected"] {
                if let Some(Value::String(s)) = r.get(k) {
                    if s.trim_start().starts_with('[') {
                        if let Ok(v) = serde_json::from_str::<Value>(s) {
                            if is_messages(&v) {
                                r[k] = v;
                            }
                        }
                    }
                }
            }
            tokenize_pair(
                base.chat_template.as_ref(),
                &base.tokenizer,
                &eos,
                &r,
                max_len,
            )
            .map_err(|e| RlError::Data(format!("{}: row {}: {e}", path.display(), i + 1)))
        })
        .collect::<Result<Vec<_>>>()?;
    if pairs.is_empty() {
        return Err(RlError::Data(format!("{}: no pairs", path.display())));
    }
    Ok(pairs)
}

/// The EOS token's text (TRL appends it to text completions).
fn eos_text(base: &Pretrained) -> Result<String> {
    let id = *base
        .generation
        .eos_token_ids
        .first()
        .ok_or_else(|| RlError::Data("the model has no EOS token".into()))?;
    base.tokenizer
        .decode(&[id], false)
        .map_err(|e| RlError::Data(format!("decode the EOS token: {e}")))
}

/// One pair's loss, its gradient with respect to the policy's summed
/// completion logprobs, and its implicit rewards.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PairTerms {
    /// The pair's loss.
    pub loss: f64,
    /// `∂loss/∂π_c`.
    pub d_chosen: f64,
    /// `∂loss/∂π_r`.
    pub d_rejected: f64,
    /// `β (π_c − ref_c)`.
    pub reward_chosen: f64,
    /// `β (π_r − ref_r)`.
    pub reward_rejected: f64,
}

/// `−log σ(x)`, stable for large |x|.
fn neg_log_sigmoid(x: f64) -> f64 {
    if x > 0.0 {
        (-x).exp().ln_1p()
    } else {
        -x + x.exp().ln_1p()
    }
}

fn sigmoid(x: f64) -> f64 {
    1.0 / (1.0 + (-x).exp())
}

/// The loss of one pair (see the module docs) and its gradient.
pub fn pair_terms(
    loss: DpoLoss,
    beta: f64,
    policy: PairLogps,
    reference: PairLogps,
    lens: (usize, usize),
) -> PairTerms {
    let (dc, dr) = (policy.0 - reference.0, policy.1 - reference.1);
    let (loss, d_chosen, d_rejected) = match loss {
        DpoLoss::Sigmoid => {
            let h = beta * (dc - dr);
            // d/dh −log σ(h) = −σ(−h).
            let g = -beta * sigmoid(-h);
            (neg_log_sigmoid(h), g, -g)
        }
        DpoLoss::Ipo => {
            let (nc, nr) = (lens.0.max(1) as f64, lens.1.max(1) as f64);
            let e = dc / nc - dr / nr - 1.0 / (2.0 * beta);
            (e * e, 2.0 * e / nc, -2.0 * e / nr)
        }
    };
    PairTerms {
        loss,
        d_chosen,
        d_rejected,
        reward_chosen: beta * dc,
        reward_rejected: beta * dr,
    }
}

/// The summed completion logprobs of `pairs` under the trainer's current
/// weights (no gradients), `micro` sequences per call.
pub async fn policy_logps(
    trainer: &dyn Trainer,
    pairs: &[&PrefPair],
    micro: usize,
) -> Result<Vec<PairLogps>> {
    let data: Vec<Datum> = pairs.iter().flat_map(|p| p.datums(1.0, 1.0)).collect();
    let mut logps = Vec::with_capacity(data.len());
    for chunk in data.chunks(micro.max(2)) {
        let out = trainer.forward(chunk.to_vec(), Loss::CrossEntropy).await?;
        logps.extend(out.loss_fn_outputs.into_iter().map(|o| o.logprobs));
    }
    Ok(pairs
        .iter()
        .enumerate()
        .map(|(i, p)| {
            (
                completion_logp(p, &logps[2 * i]),
                completion_logp(p, &logps[2 * i + 1]),
            )
        })
        .collect())
}

/// A batch's mean loss and TRL's metrics, from its pairs' terms and the
/// policy's logprobs.
fn batch_metrics(prefix: &str, terms: &[PairTerms], logps: &[PairLogps]) -> Map<String, Value> {
    let n = terms.len().max(1) as f64;
    let mean = |f: &dyn Fn(usize) -> f64| (0..terms.len()).map(f).sum::<f64>() / n;
    let mut m = Map::new();
    let mut put = |k: &str, v: f64| {
        m.insert(format!("{prefix}{k}"), json!(v));
    };
    put("loss", mean(&|i| terms[i].loss));
    put("rewards/chosen", mean(&|i| terms[i].reward_chosen));
    put("rewards/rejected", mean(&|i| terms[i].reward_rejected));
    put(
        "rewards/margins",
        mean(&|i| terms[i].reward_chosen - terms[i].reward_rejected),
    );
    put(
        "rewards/accuracies",
        mean(&|i| f64::from(u8::from(terms[i].reward_chosen > terms[i].reward_rejected))),
    );
    put("logps/chosen", mean(&|i| logps[i].0));
    put("logps/rejected", mean(&|i| logps[i].1));
    m
}

/// One DPO gradient accumulation over `pairs` (their reference logprobs
/// `refs`): returns the batch metrics. The gradient of the batch's mean
/// loss is left in the trainer for the next `optim_step`: in one
/// `forward_backward` per `micro` sequences where the trainer takes a pair
/// loss, else by the two-pass recipe (see the module docs).
pub async fn accumulate(
    trainer: &dyn Trainer,
    plan_loss: DpoLoss,
    beta: f64,
    pairs: &[&PrefPair],
    refs: &[PairLogps],
    micro: usize,
) -> Result<Map<String, Value>> {
    if !trainer.takes_pair_loss() {
        return accumulate_two_pass(trainer, plan_loss, beta, pairs, refs, micro).await;
    }
    if pairs.len() != refs.len() {
        return Err(RlError::Data(format!(
            "{} pairs but {} reference logprobs",
            pairs.len(),
            refs.len()
        )));
    }
    let loss = Loss::Dpo {
        kind: match plan_loss {
            DpoLoss::Sigmoid => PairLoss::Sigmoid,
            DpoLoss::Ipo => PairLoss::Ipo,
        },
        beta,
        scale: 1.0 / pairs.len().max(1) as f64,
    };
    let data: Vec<Datum> = pairs
        .iter()
        .zip(refs)
        .flat_map(|(p, &r)| p.pair_datums(r))
        .collect();
    let mut out = Vec::with_capacity(data.len());
    // An even chunk keeps every pair in one call.
    let even = 2 * micro.div_ceil(2).max(1);
    forward_backward_chunks(trainer, &loss, &data, even, |_, fb| {
        out.extend(fb.loss_fn_outputs.iter().map(|o| o.logprobs.clone()));
        Ok(())
    })
    .await?;
    let logps: Vec<PairLogps> = pairs
        .iter()
        .enumerate()
        .map(|(i, p)| {
            (
                completion_logp(p, &out[2 * i]),
                completion_logp(p, &out[2 * i + 1]),
            )
        })
        .collect();
    let terms = terms_of(plan_loss, beta, pairs, &logps, refs);
    Ok(batch_metrics("", &terms, &logps))
}

/// Each pair's loss terms from its policy and reference logprobs.
fn terms_of(
    plan_loss: DpoLoss,
    beta: f64,
    pairs: &[&PrefPair],
    logps: &[PairLogps],
    refs: &[PairLogps],
) -> Vec<PairTerms> {
    pairs
        .iter()
        .zip(logps.iter().zip(refs))
        .map(|(p, (&pol, &rf))| {
            pair_terms(plan_loss, beta, pol, rf, (p.chosen.len(), p.rejected.len()))
        })
        .collect()
}

/// [`accumulate`] for a trainer without a pair loss: a forward for the
/// policy's logprobs, then a cross-entropy `forward_backward` weighted by
/// the pair loss's gradient.
async fn accumulate_two_pass(
    trainer: &dyn Trainer,
    plan_loss: DpoLoss,
    beta: f64,
    pairs: &[&PrefPair],
    refs: &[PairLogps],
    micro: usize,
) -> Result<Map<String, Value>> {
    let logps = policy_logps(trainer, pairs, micro).await?;
    let terms = terms_of(plan_loss, beta, pairs, &logps, refs);
    let n = pairs.len().max(1) as f64;
    // Cross-entropy weights −∂L/∂π per completion token: its gradient is L's.
    let data: Vec<Datum> = pairs
        .iter()
        .zip(&terms)
        .flat_map(|(p, t)| p.datums((-t.d_chosen / n) as f32, (-t.d_rejected / n) as f32))
        .collect();
    forward_backward_chunks(trainer, &Loss::CrossEntropy, &data, micro.max(2), |_, _| {
        Ok(())
    })
    .await?;
    Ok(batch_metrics("", &terms, &logps))
}

/// The held-out pairs' metrics (prefixed `eval/`) under the current weights.
async fn evaluate_pairs(
    trainer: &dyn Trainer,
    plan: &DpoPlan,
    pairs: &[PrefPair],
    refs: &[PairLogps],
    micro: usize,
) -> Result<Map<String, Value>> {
    let all: Vec<&PrefPair> = pairs.iter().collect();
    let logps = policy_logps(trainer, &all, micro).await?;
    let terms = terms_of(plan.loss, plan.beta, &all, &logps, refs);
    Ok(batch_metrics("eval/", &terms, &logps))
}

/// What a finished DPO run reports.
#[derive(Debug, Clone)]
pub struct DpoOutcome {
    /// Steps completed.
    pub steps: u64,
    /// The trained adapter (LoRA) or model (full) directory.
    pub output: PathBuf,
    /// The last step's metrics.
    pub last: Map<String, Value>,
    /// Held-out pair metrics before training (`eval/…`), when there are
    /// held-out pairs.
    pub heldout_before: Option<Map<String, Value>>,
    /// And after the last step.
    pub heldout_after: Option<Map<String, Value>>,
    /// Held-out environment evaluation before training (`[eval]`).
    pub eval_before: Option<EvalResult>,
    /// And after.
    pub eval_after: Option<EvalResult>,
    /// Every step's metrics.
    pub metrics: Vec<Map<String, Value>>,
}

/// The training and held-out pairs of a preference file.
fn file_pairs(
    plan: &DpoPlan,
    base: &Pretrained,
    path: &Path,
    eval_path: Option<&Path>,
    eval_fraction: f64,
) -> Result<(Vec<PrefPair>, Vec<PrefPair>)> {
    let max_len = plan.trainer.max_seq_len;
    let mut train = read_pairs(path, base, max_len)?;
    let heldout = match eval_path {
        Some(p) => read_pairs(p, base, max_len)?,
        None if eval_fraction > 0.0 => {
            train.shuffle(&mut ChaCha8Rng::seed_from_u64(plan.seed ^ 0xD9_0E7A));
            let k = ((train.len() as f64 * eval_fraction).round() as usize)
                .clamp(1, train.len().saturating_sub(1));
            train.split_off(train.len() - k)
        }
        None => Vec::new(),
    };
    if train.is_empty() {
        return Err(RlError::Data("no training pairs are left".into()));
    }
    Ok((train, heldout))
}

/// `temper train dpo`: see the module docs. Shuffled epochs (seeded),
/// checkpoints, metrics and resume as SFT's; held-out pairs evaluated
/// before training, every `[eval] interval` steps and at the end.
pub async fn run_dpo<P>(plan: P, opts: RunOptions) -> Result<DpoOutcome>
where
    P: TryInto<DpoPlan>,
    RlError: From<P::Error>,
{
    let cfg: DpoPlan = plan.try_into()?;
    let run_dir = cfg.log.dir.clone();
    let record = checkpoint::open_run(&run_dir, opts.resume, cfg.config(), "dpo")?;
    let stop_early = opts.stop_after.is_some();
    let out = dpo_loop(cfg, opts, run_dir).await;
    record.end(match &out {
        Ok(_) => Ok(!stop_early),
        Err(e) => Err(e.to_string()),
    })?;
    out
}

/// A preference file's pairs, and their reference logprobs: the weights
/// before any step, scored before a resume loads a checkpoint. Empty for
/// online pairs.
#[derive(Default)]
struct FileData {
    train: Vec<PrefPair>,
    heldout: Vec<PrefPair>,
    train_refs: Vec<PairLogps>,
    heldout_refs: Vec<PairLogps>,
}

impl FileData {
    async fn load(cfg: &DpoPlan, base: &Arc<Pretrained>, trainer: &dyn Trainer) -> Result<Self> {
        let PrefSource::File {
            path,
            eval_path,
            eval_fraction,
            ..
        } = &cfg.data
        else {
            return Ok(Self::default());
        };
        let (train, heldout) = {
            let (cfg2, base2) = (cfg.clone(), base.clone());
            let (path, eval_path, f) = (path.clone(), eval_path.clone(), *eval_fraction);
            tokio::task::spawn_blocking(move || {
                file_pairs(&cfg2, &base2, &path, eval_path.as_deref(), f)
            })
            .await
            .map_err(|source| RlError::Blocking {
                what: "loading the preference data",
                source,
            })??
        };
        let t0 = Instant::now();
        let micro = micro_of(cfg);
        let tr: Vec<&PrefPair> = train.iter().collect();
        let train_refs = policy_logps(trainer, &tr, micro).await?;
        let ho: Vec<&PrefPair> = heldout.iter().collect();
        let heldout_refs = policy_logps(trainer, &ho, micro).await?;
        if cfg.log.progress {
            eprintln!(
                "reference logprobs of {} pairs ({} held out) in {:.1}s",
                train.len() + heldout.len(),
                heldout.len(),
                t0.elapsed().as_secs_f64()
            );
        }
        Ok(Self {
            train,
            heldout,
            train_refs,
            heldout_refs,
        })
    }

    /// Steps per pass over the training pairs.
    fn per_epoch(&self, bs: usize) -> u64 {
        (self.train.len().div_ceil(bs) as u64).max(1)
    }
}

/// Sequences per `forward_backward`: the plan's micro-batch rounded up to
/// whole pairs.
fn micro_of(cfg: &DpoPlan) -> usize {
    2 * cfg
        .optim
        .micro_batch_of(2 * cfg.optim.batch_size)
        .div_ceil(2)
}

/// Step `step`'s gradient, left in the trainer: this step's online pairs,
/// or the file's next batch (a seeded shuffle per epoch). Where the pairs
/// came from goes into `m`; returns the batch metrics, empty when there was
/// nothing to train.
async fn step_gradient(
    cfg: &DpoPlan,
    trainer: &dyn Trainer,
    online: Option<&crate::dpo_online::Online>,
    data: &FileData,
    step: u64,
    m: &mut Map<String, Value>,
) -> Result<Map<String, Value>> {
    let micro = micro_of(cfg);
    if let Some(online) = online {
        let (pairs, refs, info) = online.pairs(step).await?;
        m.extend(info);
        if pairs.is_empty() {
            return Ok(Map::new());
        }
        let p: Vec<&PrefPair> = pairs.iter().collect();
        return accumulate(trainer, cfg.loss, cfg.beta, &p, &refs, micro).await;
    }
    let bs = cfg.optim.batch_size;
    let (epoch, idx) = epoch_batch(cfg.seed, step, data.per_epoch(bs), bs, data.train.len());
    let pairs: Vec<&PrefPair> = idx.iter().map(|&i| &data.train[i]).collect();
    let refs: Vec<PairLogps> = idx.iter().map(|&i| data.train_refs[i]).collect();
    m.insert("epoch".into(), json!(epoch));
    accumulate(trainer, cfg.loss, cfg.beta, &pairs, &refs, micro).await
}

/// [`run_dpo`] once the run directory is set up.
async fn dpo_loop(cfg: DpoPlan, opts: RunOptions, run_dir: PathBuf) -> Result<DpoOutcome> {
    let (base, trainer) =
        crate::open_trainer::trainer_for(&cfg.model, None, cfg.seed, &run_dir).await?;
    let micro = micro_of(&cfg);
    if !trainer.takes_pair_loss() {
        warn_two_pass(cfg.log.progress);
    }
    let online = match &cfg.data {
        PrefSource::Env { .. } => {
            Some(crate::dpo_online::Online::new(&cfg, &base, trainer.clone()).await?)
        }
        PrefSource::File { .. } => None,
    };
    let data = FileData::load(&cfg, &base, &*trainer).await?;
    let max_steps = match cfg.data {
        PrefSource::File {
            epochs: Some(e), ..
        } => cfg
            .optim
            .max_steps
            .min(e * data.per_epoch(cfg.optim.batch_size)),
        _ => cfg.optim.max_steps,
    };
    let spec = run_start!(cfg.config(), opts.resume, max_steps);
    let (start, eval_before, mut log, run_eval) = spec.open(&run_dir, &trainer, &base).await?;
    let (mut heldout_before, mut heldout_after, mut eval_after) = (None, None, None);
    let mut baseline = eval_before
        .as_ref()
        .map(EvalResult::plot_record)
        .unwrap_or_default();
    let heldout = |trainer| evaluate_pairs(trainer, &cfg, &data.heldout, &data.heldout_refs, micro);
    if !data.heldout.is_empty() {
        let m = heldout(&*trainer).await?;
        if cfg.log.progress && start == 0 {
            eprintln!("{}", heldout_line("before", &m));
        }
        baseline.extend(m.clone());
        heldout_before = Some(m);
    }
    if !baseline.is_empty() {
        baseline.insert("step".into(), json!(start));
        log.set_baseline(baseline);
    }
    let end = opts
        .stop_after
        .map_or(max_steps, |n| (start + n).min(max_steps));
    let mut last = Map::new();
    let saver = checkpoint::Saver::new(&run_dir, &*trainer, &cfg.ckpt, cfg.seed);
    let t_run = Instant::now();
    let mut step = start;
    while step < end {
        let t0 = Instant::now();
        let mut m = Map::new();
        m.insert("step".into(), json!(step + 1));
        let metrics = step_gradient(&cfg, &*trainer, online.as_ref(), &data, step, &mut m).await?;
        let trained = !metrics.is_empty();
        m.extend(metrics);
        let lr = cfg.optim.learning_rate(step);
        if trained {
            let (_, grad_norm) = optim_step(&*trainer, &cfg.optim, step).await?;
            m.insert("grad_norm".into(), json!(grad_norm));
        }
        step += 1;
        m.insert("lr".into(), json!(lr));
        m.insert("time/step".into(), json!(t0.elapsed().as_secs_f64()));
        let due = (cfg.eval.interval > 0 && step.is_multiple_of(cfg.eval.interval)) || step == end;
        if !data.heldout.is_empty() && due {
            let h = heldout(&*trainer).await?;
            if cfg.log.progress {
                eprintln!("{}", heldout_line(&format!("step {step}"), &h));
            }
            m.extend(h.clone());
            heldout_after = Some(h);
        }
        if let Some(r) = RunEval::after(run_eval.as_ref(), &run_dir, step).await? {
            m.insert("eval/pass@1".into(), json!(r.pass_at_1));
            m.insert("eval/reward".into(), json!(r.reward));
            eval_after = Some(r);
        }
        m.insert("time/elapsed".into(), json!(t_run.elapsed().as_secs_f64()));
        if cfg.log.progress && (step.is_multiple_of(10) || step == end || step == 1) {
            eprintln!("{}", progress_line(&m, step, max_steps, lr));
        }
        last = m.clone();
        log.write(m)?;
        saver
            .save_if_due(step, max_steps, eval_before.clone())
            .await?;
    }
    log.write_plots(&run_dir, "temper DPO run", PLOTS, "")?;
    let output = checkpoint::export_weights(&*trainer, &run_dir, cfg.model.lora.is_some()).await?;
    Ok(DpoOutcome {
        steps: step,
        output,
        last,
        heldout_before,
        heldout_after,
        eval_before,
        eval_after,
        metrics: log.records().to_vec(),
    })
}

/// What a DPO run plots.
const PLOTS: &[&str] = &[
    "loss",
    "rewards/accuracies",
    "rewards/margins",
    "eval/loss",
    "eval/rewards/accuracies",
    "eval/pass@1",
    "grad_norm",
];

/// Say that a trainer without the pair loss makes each step two passes.
fn warn_two_pass(progress: bool) {
    let why = "this trainer takes no pair loss (the tinker wire has none): each DPO step \
               is a forward plus a weighted cross-entropy forward_backward, two passes";
    tracing::warn!("{why}");
    if progress {
        eprintln!("{why}");
    }
}

/// `dpo step    3/8  loss 0.6931  acc 0.50  margin 0.000  lr 1.00e-5  1.93s`.
fn progress_line(m: &Map<String, Value>, step: u64, max_steps: u64, lr: f64) -> String {
    let get = |k: &str| m.get(k).and_then(Value::as_f64).unwrap_or(f64::NAN);
    format!(
        "dpo step {step:>4}/{max_steps}  loss {:.4}  acc {:.2}  margin {:.3}  lr {lr:.2e}  {:.2}s",
        get("loss"),
        get("rewards/accuracies"),
        get("rewards/margins"),
        get("time/step"),
    )
}

/// `held-out pairs before: loss 0.6931  accuracy 0.00  margin 0.000`.
pub fn heldout_line(when: &str, m: &Map<String, Value>) -> String {
    let get = |k: &str| m.get(k).and_then(Value::as_f64).unwrap_or(f64::NAN);
    format!(
        "held-out pairs {when}: loss {:.4}  accuracy {:.2}  margin {:.3}",
        get("eval/loss"),
        get("eval/rewards/accuracies"),
        get("eval/rewards/margins"),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sigmoid_and_ipo_match_their_formulas_and_gradients() {
        let (pol, rf, lens) = ((-10.0, -12.0), (-11.0, -11.5), (4, 5));
        for (loss, beta) in [(DpoLoss::Sigmoid, 0.1), (DpoLoss::Ipo, 0.5)] {
            let t = pair_terms(loss, beta, pol, rf, lens);
            let f = |c: f64, r: f64| pair_terms(loss, beta, (c, r), rf, lens).loss;
            let h = 1e-5;
            let dc = (f(pol.0 + h, pol.1) - f(pol.0 - h, pol.1)) / (2.0 * h);
            let dr = (f(pol.0, pol.1 + h) - f(pol.0, pol.1 - h)) / (2.0 * h);
            assert!((t.d_chosen - dc).abs() < 1e-7, "{loss:?} {t:?} {dc}");
            assert!((t.d_rejected - dr).abs() < 1e-7, "{loss:?} {t:?} {dr}");
        }
        // sigmoid: −log σ(β((−10+11) − (−12+11.5))) = −log σ(0.15).
        let t = pair_terms(DpoLoss::Sigmoid, 0.1, pol, rf, lens);
        assert!((t.loss - (1.0 + (-0.15f64).exp()).ln()).abs() < 1e-12);
        assert!((t.reward_chosen - 0.1).abs() < 1e-12);
        assert!((t.reward_rejected + 0.05).abs() < 1e-12);
        // ipo: (1/4 − (−0.5)/5 − 1/(2·0.5))² = (0.25 + 0.1 − 1)².
        let t = pair_terms(DpoLoss::Ipo, 0.5, pol, rf, lens);
        assert!((t.loss - 0.65f64.powi(2)).abs() < 1e-12);
        // Stable far out: no overflow to inf.
        let t = pair_terms(DpoLoss::Sigmoid, 1.0, (0.0, 2000.0), (0.0, 0.0), (1, 1));
        assert!((t.loss - 2000.0).abs() < 1e-9 && t.loss.is_finite());
    }
}
