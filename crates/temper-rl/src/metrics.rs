//! What one RL step measured, as a type: [`StepMetrics`] is built from the
//! step's groups, its trained turns and the train step's output, then
//! written as one line of `metrics.jsonl`.
//!
//! The JSON keys (`reward/mean`, `mismatch/max`, `time/step`, ...) are the
//! interface to `temper view`, `plots.html` and the check scripts; they are
//! spelled once, in the `serde(rename)` attributes below. Field order is key
//! order in the file (serde_json keeps insertion order).

use std::collections::BTreeMap;

use serde::ser::{Serialize, SerializeMap, Serializer};
use serde_json::{Map, Value};

use crate::datum::{ReverseKl, TrainTurns};
use crate::error::{Result, RlError};
use crate::eval::EvalResult;
use crate::probe::ProbeOutput;
use crate::sampled::Group;
use crate::step::StepOutput;

/// One step's metrics: one line of `metrics.jsonl`.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct StepMetrics {
    /// Steps completed, this one included (the policy version it produced).
    pub step: u64,
    /// What the step's (fresh) rollouts scored.
    #[serde(flatten)]
    pub rollouts: RolloutMetrics,
    /// What became training data, and what did not.
    #[serde(flatten)]
    pub data: DataMetrics,
    /// What the train step reported.
    #[serde(flatten)]
    pub train: TrainMetrics,
    /// On-policy distillation: the reverse KL to the teacher.
    #[serde(flatten, skip_serializing_if = "Option::is_none")]
    pub distill: Option<DistillMetrics>,
    /// Wall-clock times.
    #[serde(flatten)]
    pub time: TimeMetrics,
}

/// Rewards and rollout shapes of the groups that were not dropped as stale.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct RolloutMetrics {
    /// Mean reward.
    #[serde(rename = "reward/mean")]
    pub reward_mean: f64,
    /// Reward standard deviation (population).
    #[serde(rename = "reward/std")]
    pub reward_std: f64,
    /// Per environment: `reward/{id}/mean` and `reward/{id}/std`.
    #[serde(flatten)]
    pub reward_by_env: RewardByEnv,
    /// Each rubric metric's mean: `metric/{name}`.
    #[serde(flatten)]
    pub rubric: RubricMetrics,
    /// Fraction of rollouts at or above the pass threshold: pass@1, the
    /// name `temper eval` gives it.
    #[serde(rename = "pass@1")]
    pub pass_rate: f64,
    /// Mean completion tokens per rollout.
    #[serde(rename = "seq_len/mean")]
    pub seq_len_mean: f64,
    /// Fraction of rollouts that hit a token limit.
    pub truncation_rate: f64,
    /// Rollouts that ended in an error (scored, never trained on).
    pub rollout_errors: usize,
    /// Rollouts a reward function could not score (it counted 0 for them):
    /// a sandbox that refused the key, a reward program that crashed.
    pub reward_errors: usize,
    /// Mean policy lag (steps) of the groups trained on.
    #[serde(rename = "policy_lag/mean")]
    pub policy_lag_mean: f64,
    /// Largest policy lag of the groups trained on.
    #[serde(rename = "policy_lag/max")]
    pub policy_lag_max: f64,
}

/// Mean and standard deviation of the reward per environment, in `[[env]]`
/// order.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RewardByEnv(pub Vec<(String, f64, f64)>);

impl Serialize for RewardByEnv {
    fn serialize<S: Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        let mut map = s.serialize_map(Some(2 * self.0.len()))?;
        for (id, mean, std) in &self.0 {
            map.serialize_entry(&format!("reward/{id}/mean"), mean)?;
            map.serialize_entry(&format!("reward/{id}/std"), std)?;
        }
        map.end()
    }
}

/// The mean of each rubric metric by name.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RubricMetrics(pub BTreeMap<String, f64>);

impl Serialize for RubricMetrics {
    fn serialize<S: Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        let mut map = s.serialize_map(Some(self.0.len()))?;
        for (name, mean) in &self.0 {
            map.serialize_entry(&format!("metric/{name}"), mean)?;
        }
        map.end()
    }
}

/// From groups to training data.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct DataMetrics {
    /// Groups dropped this step for lagging more than the bound.
    pub dropped_stale: u64,
    /// Groups dropped so far in the run.
    #[serde(rename = "dropped_stale/total")]
    pub dropped_stale_total: u64,
    /// Groups whose rewards were all equal (nothing to learn from).
    pub zero_advantage_groups: u64,
    /// Model turns without a usable token trace (never trained on).
    pub skipped_turns: u64,
    /// Datums trained on.
    pub trained_sequences: usize,
    /// Completion tokens trained on.
    pub trained_tokens: usize,
    /// Multi-turn episodes trained as one sequence.
    #[serde(rename = "multi_turn/merged")]
    pub multi_turn_merged: u64,
    /// Multi-turn episodes trained turn by turn because the chat template
    /// rewrote history (a turn's prompt did not extend the previous turn).
    #[serde(rename = "multi_turn/fallbacks")]
    pub multi_turn_fallbacks: u64,
}

/// The train step's report.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct TrainMetrics {
    /// Summed loss over the micro-batches.
    pub loss: f64,
    /// Largest |learner − sampler| logprob over on-policy tokens; `null`
    /// on a step that had none (nothing was measured, so no number).
    #[serde(rename = "mismatch/max")]
    pub mismatch_max: Option<f64>,
    /// Mean |learner − sampler| logprob over on-policy tokens (`null` as
    /// above).
    #[serde(rename = "mismatch/mean")]
    pub mismatch_mean: Option<f64>,
    /// How many on-policy (lag 0) tokens the mismatch was measured on.
    #[serde(rename = "mismatch/tokens")]
    pub mismatch_tokens: usize,
    /// The probe's mismatch: one off-policy sequence rescored under the
    /// weights that sampled it (`null` on a step with no off-policy
    /// sequence, or whose sampler's weights are not at hand).
    #[serde(rename = "mismatch/probe_max")]
    pub probe_max: Option<f64>,
    /// Tokens the probe compared.
    #[serde(rename = "mismatch/probe_tokens")]
    pub probe_tokens: usize,
    /// Mean entropy over the trained tokens that report one.
    pub entropy: f64,
    /// Gradient norm before clipping (0 when nothing was trained).
    pub grad_norm: f64,
    /// Learning rate of the step.
    pub lr: f64,
    /// Seconds in forward_backward + optim_step.
    #[serde(rename = "time/train")]
    pub train_s: f64,
}

/// On-policy distillation's measure of the step: how far the student's
/// samples are from the teacher.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct DistillMetrics {
    /// Mean over the sampled tokens of `logp_student − logp_teacher`: the
    /// per-token reverse KL(student ‖ teacher), estimated on the student's
    /// own samples.
    #[serde(rename = "distill/reverse_kl")]
    pub reverse_kl: f64,
    /// Mean teacher logprob of the sampled tokens.
    #[serde(rename = "distill/teacher_logprob")]
    pub teacher_logprob: f64,
    /// Tokens the teacher scored.
    #[serde(rename = "distill/tokens")]
    pub tokens: usize,
    /// Seconds the teacher took to score them.
    #[serde(rename = "time/teacher")]
    pub teacher_s: f64,
}

impl DistillMetrics {
    /// From the reverse KL a batch's datums measured and the teacher's time.
    pub fn of(kl: &ReverseKl, teacher_s: f64) -> Self {
        let n = kl.tokens.max(1) as f64;
        Self {
            reverse_kl: kl.sum / n,
            teacher_logprob: kl.teacher_sum / n,
            tokens: kl.tokens,
            teacher_s,
        }
    }
}

/// Wall-clock times (and the held-out evaluation when one ran), in the
/// order they are known.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct TimeMetrics {
    /// Seconds spent sampling the batch, scoring included.
    #[serde(rename = "time/generate")]
    pub generate_s: f64,
    /// Seconds of `time/generate` during which at least one group was
    /// being scored (groups score while others still generate).
    #[serde(rename = "time/reward")]
    pub reward_s: f64,
    /// Trained tokens per second of training.
    pub tokens_per_s: f64,
    /// Seconds the trainer waited for the batch.
    #[serde(rename = "time/wait")]
    pub wait_s: f64,
    /// Seconds publishing the new weights to the sampler.
    #[serde(rename = "time/publish")]
    pub publish_s: f64,
    /// Held-out pass@1, when an evaluation ran after this step.
    #[serde(rename = "eval/pass@1", skip_serializing_if = "Option::is_none")]
    pub eval_pass_at_1: Option<f64>,
    /// Held-out mean reward, when an evaluation ran after this step.
    #[serde(rename = "eval/reward", skip_serializing_if = "Option::is_none")]
    pub eval_reward: Option<f64>,
    /// Seconds of that evaluation (part of `time/step`).
    #[serde(rename = "time/eval", skip_serializing_if = "Option::is_none")]
    pub eval_s: Option<f64>,
    /// Seconds for the whole step.
    #[serde(rename = "time/step")]
    pub step_s: f64,
    /// Seconds since the run (this session) started.
    #[serde(rename = "time/elapsed")]
    pub elapsed_s: f64,
}

/// Mean of `xs` (0 for none).
pub(crate) fn mean(xs: &[f64]) -> f64 {
    if xs.is_empty() {
        0.0
    } else {
        xs.iter().sum::<f64>() / xs.len() as f64
    }
}

/// Population standard deviation of `xs` (0 for none).
fn std_dev(xs: &[f64]) -> f64 {
    let mu = mean(xs);
    (xs.iter().map(|x| (x - mu).powi(2)).sum::<f64>() / xs.len().max(1) as f64).sqrt()
}

impl RolloutMetrics {
    /// Over the rollouts of `groups_g` (the fresh groups); `env_ids` names
    /// the environments by index.
    /// A rollout of environment `e` passes at reward ≥ `pass_thresholds[e]`
    /// (1 where none is given).
    pub fn of(groups_g: &[Group], step: u64, env_ids: &[String], pass_thresholds: &[f64]) -> Self {
        let mut rewards = Vec::new();
        let mut passes = 0usize;
        let mut per_env: BTreeMap<usize, Vec<f64>> = BTreeMap::new();
        let mut rubric: BTreeMap<String, Vec<f64>> = BTreeMap::new();
        let mut lens = Vec::new();
        let mut lags = Vec::new();
        let (mut truncated, mut errors, mut reward_errors) = (0usize, 0usize, 0usize);
        for g in groups_g {
            lags.push(step.saturating_sub(g.version) as f64);
            for (r, s) in g.rollouts.iter().zip(&g.scores) {
                rewards.push(s.reward);
                passes +=
                    usize::from(s.reward >= pass_thresholds.get(g.env).copied().unwrap_or(1.0));
                per_env.entry(g.env).or_default().push(s.reward);
                for (k, v) in &s.metrics {
                    rubric.entry(k.clone()).or_default().push(*v);
                }
                lens.push(r.token_usage.output_tokens as f64);
                truncated += usize::from(r.is_truncated);
                errors += usize::from(r.error.is_some());
                reward_errors += usize::from(s.error.is_some());
            }
        }
        let reward_by_env = per_env
            .iter()
            .map(|(e, rs)| {
                let id = env_ids
                    .get(*e)
                    .cloned()
                    .unwrap_or_else(|| format!("env{e}"));
                (id, mean(rs), std_dev(rs))
            })
            .collect();
        Self {
            reward_mean: mean(&rewards),
            reward_std: std_dev(&rewards),
            reward_by_env: RewardByEnv(reward_by_env),
            rubric: RubricMetrics(rubric.iter().map(|(k, v)| (k.clone(), mean(v))).collect()),
            pass_rate: passes as f64 / rewards.len().max(1) as f64,
            seq_len_mean: mean(&lens),
            truncation_rate: truncated as f64 / lens.len().max(1) as f64,
            rollout_errors: errors,
            reward_errors,
            policy_lag_mean: mean(&lags),
            policy_lag_max: lags.iter().copied().fold(0.0, f64::max),
        }
    }
}

impl DataMetrics {
    /// What `turns` kept of a batch that had `dropped_stale` stale groups.
    pub fn of(turns: &TrainTurns, dropped_stale: u64, dropped_stale_total: u64) -> Self {
        Self {
            dropped_stale,
            dropped_stale_total,
            zero_advantage_groups: turns.zero_advantage_groups,
            skipped_turns: turns.skipped_turns,
            trained_sequences: turns.seqs_d().len(),
            trained_tokens: turns.tokens(),
            multi_turn_merged: turns.multi_turn_merged,
            multi_turn_fallbacks: turns.multi_turn_fallbacks,
        }
    }
}

impl TrainMetrics {
    /// From the train step's output and the mismatch probe's.
    pub fn of(out: &StepOutput, probe: Option<ProbeOutput>) -> Self {
        let measured = out.mismatch_tokens > 0;
        Self {
            loss: out.loss_sum,
            mismatch_max: measured.then_some(out.mismatch_max),
            mismatch_mean: measured.then(|| out.mismatch_sum / out.mismatch_tokens as f64),
            mismatch_tokens: out.mismatch_tokens,
            probe_max: probe.map(|p| p.max),
            probe_tokens: probe.map_or(0, |p| p.tokens),
            entropy: out.entropy_sum / out.entropy_tokens.max(1) as f64,
            grad_norm: out.grad_norm,
            lr: out.lr,
            train_s: out.train_s,
        }
    }
}

impl TimeMetrics {
    /// Record the held-out evaluation that ran after this step.
    pub fn with_eval(mut self, eval: Option<&EvalResult>) -> Self {
        self.eval_pass_at_1 = eval.map(|r| r.pass_at_1);
        self.eval_reward = eval.map(|r| r.reward);
        self.eval_s = eval.map(|r| r.time_s);
        self
    }
}

/// A `metrics.jsonl` line read back (a resumed run's earlier steps).
/// Lines written before the keys were renamed (`pass_rate`,
/// `eval/accuracy`) or added (`multi_turn/*`, `reward_errors`,
/// `time/reward`: 0 then) still read; any other
/// missing or mistyped key is an error naming it.
impl TryFrom<&Map<String, Value>> for StepMetrics {
    type Error = RlError;

    fn try_from(m: &Map<String, Value>) -> Result<Self> {
        let bad = |k: &str| RlError::Data(format!("metrics.jsonl: missing or bad {k:?} in {m:?}"));
        let get = |k: &str| m.get(k);
        let f = |k: &str| get(k).and_then(Value::as_f64).ok_or_else(|| bad(k));
        let u = |k: &str| get(k).and_then(Value::as_u64).ok_or_else(|| bad(k));
        let n = |k: &str| u(k).and_then(|v| usize::try_from(v).map_err(|_| bad(k)));
        let f_or = |k: &str, old: &str| get(k).or_else(|| get(old)).and_then(Value::as_f64);
        let since = |k: &str| match get(k) {
            None => Ok(0),
            Some(v) => v.as_u64().ok_or_else(|| bad(k)),
        };
        // Absent (lines written before it existed) or null: not measured.
        let opt_f = |k: &str| match get(k) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => v.as_f64().map(Some).ok_or_else(|| bad(k)),
        };
        let mut reward_by_env = Vec::new();
        let mut rubric = BTreeMap::new();
        for (k, v) in m {
            if let Some(name) = k.strip_prefix("metric/") {
                rubric.insert(name.to_string(), v.as_f64().ok_or_else(|| bad(k))?);
            } else if let Some(id) = k
                .strip_prefix("reward/")
                .and_then(|rest| rest.strip_suffix("/mean"))
            {
                let std = format!("reward/{id}/std");
                reward_by_env.push((id.to_string(), f(k)?, f(&std)?));
            }
        }
        Ok(Self {
            step: u("step")?,
            rollouts: RolloutMetrics {
                reward_mean: f("reward/mean")?,
                reward_std: f("reward/std")?,
                reward_by_env: RewardByEnv(reward_by_env),
                rubric: RubricMetrics(rubric),
                pass_rate: f_or("pass@1", "pass_rate").ok_or_else(|| bad("pass@1"))?,
                seq_len_mean: f("seq_len/mean")?,
                truncation_rate: f("truncation_rate")?,
                rollout_errors: n("rollout_errors")?,
                reward_errors: since("reward_errors")? as usize,
                policy_lag_mean: f("policy_lag/mean")?,
                policy_lag_max: f("policy_lag/max")?,
            },
            data: DataMetrics {
                dropped_stale: u("dropped_stale")?,
                dropped_stale_total: u("dropped_stale/total")?,
                zero_advantage_groups: u("zero_advantage_groups")?,
                skipped_turns: u("skipped_turns")?,
                trained_sequences: n("trained_sequences")?,
                trained_tokens: n("trained_tokens")?,
                multi_turn_merged: since("multi_turn/merged")?,
                multi_turn_fallbacks: since("multi_turn/fallbacks")?,
            },
            train: TrainMetrics {
                loss: f("loss")?,
                mismatch_max: opt_f("mismatch/max")?,
                mismatch_mean: opt_f("mismatch/mean")?,
                mismatch_tokens: n("mismatch/tokens")?,
                probe_max: opt_f("mismatch/probe_max")?,
                probe_tokens: since("mismatch/probe_tokens")? as usize,
                entropy: f("entropy")?,
                grad_norm: f("grad_norm")?,
                lr: f("lr")?,
                train_s: f("time/train")?,
            },
            distill: match get("distill/reverse_kl") {
                None => None,
                Some(_) => Some(DistillMetrics {
                    reverse_kl: f("distill/reverse_kl")?,
                    teacher_logprob: f("distill/teacher_logprob")?,
                    tokens: n("distill/tokens")?,
                    teacher_s: f("time/teacher")?,
                }),
            },
            time: TimeMetrics {
                generate_s: f("time/generate")?,
                reward_s: get("time/reward").and_then(Value::as_f64).unwrap_or(0.0),
                tokens_per_s: f("tokens_per_s")?,
                wait_s: f("time/wait")?,
                publish_s: f("time/publish")?,
                eval_pass_at_1: f_or("eval/pass@1", "eval/accuracy"),
                eval_reward: get("eval/reward").and_then(Value::as_f64),
                eval_s: get("time/eval").and_then(Value::as_f64),
                step_s: f("time/step")?,
                elapsed_s: f("time/elapsed")?,
            },
        })
    }
}

/// `metrics` as a `metrics.jsonl` record (a JSON object, keys in field
/// order).
fn record_of(what: &str, metrics: &impl serde::Serialize) -> Result<Map<String, Value>> {
    match serde_json::to_value(metrics) {
        Ok(Value::Object(m)) => Ok(m),
        Ok(other) => Err(RlError::Data(format!(
            "{what} serialised to {other}, not an object"
        ))),
        Err(e) => Err(RlError::Data(format!("{what}: {e}"))),
    }
}

impl StepMetrics {
    /// The `metrics.jsonl` record.
    pub fn to_record(&self) -> Result<Map<String, Value>> {
        record_of("step metrics", self)
    }

    /// The progress line printed after each step.
    pub fn progress_line(&self, max_steps: u64) -> String {
        let (r, d, t, time) = (&self.rollouts, &self.data, &self.train, &self.time);
        let mismatch = match (t.mismatch_max, t.probe_max) {
            (Some(m), None) => format!("{m:.1e}"),
            (Some(m), Some(p)) => format!("{m:.1e} (probe {p:.1e})"),
            (None, Some(p)) => format!("{p:.1e} (probe)"),
            (None, None) => "n/a".into(),
        };
        let eval = time
            .eval_s
            .map(|s| format!(", eval {s:.1}s"))
            .unwrap_or_default();
        // A step where every group had equal rewards trained nothing; say
        // so, and what usually fixes it.
        let idle = if d.trained_sequences == 0 && d.zero_advantage_groups > 0 {
            "\n  nothing trained: every group's rollouts got equal rewards (raise [sampling] temperature or group_size, or give the rubric partial credit)"
        } else {
            ""
        };
        // Only when there are any: a reward that fails must not pass unseen.
        let reward_errors = if r.reward_errors > 0 {
            format!("  reward-errors {}", r.reward_errors)
        } else {
            String::new()
        };
        let kl = self
            .distill
            .as_ref()
            .map(|d| format!("  kl {:.4} (teacher {:.1}s)", d.reverse_kl, d.teacher_s))
            .unwrap_or_default();
        format!(
            "step {:>4}/{max_steps}  reward {:.3}{reward_errors}  pass@1 {:>5.1}%{kl}  len {:>5.1}  lag {:.2}  dropped {}  zero-adv {}  mismatch {mismatch}  ent {:.3}  |g| {:.3}  {:.1}s (gen {:.1}s, reward {:.1}s, train {:.1}s, wait {:.1}s{eval}){idle}",
            self.step,
            r.reward_mean,
            100.0 * r.pass_rate,
            r.seq_len_mean,
            r.policy_lag_mean,
            d.dropped_stale_total,
            // Groups with all-equal rewards train nothing: a step where every
            // group is zero-advantage shows `ent 0 |g| 0` for that reason.
            d.zero_advantage_groups,
            t.entropy,
            t.grad_norm,
            time.step_s,
            time.generate_s,
            time.reward_s,
            t.train_s,
            time.wait_s,
        )
    }
}

/// One SFT step's `metrics.jsonl` line (keys in this order).
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct SftStepMetrics {
    /// Steps done (1 after the first).
    pub step: u64,
    /// Passes over the data begun before this step (for an environment's
    /// rows: over its distinct prompts).
    pub epoch: u64,
    /// Summed loss over the micro-batches.
    pub loss: f64,
    /// Tokens with a loss weight (assistant tokens).
    pub trained_tokens: usize,
    /// Gradient norm before clipping.
    pub grad_norm: f64,
    /// Learning rate of the step.
    pub lr: f64,
    /// Tokens (all of the batch's) per second of the step.
    pub tokens_per_s: f64,
    /// Seconds of the train step.
    #[serde(rename = "time/step")]
    pub step_s: f64,
    /// Held-out pass@1, when an evaluation ran after this step.
    #[serde(rename = "eval/pass@1", skip_serializing_if = "Option::is_none")]
    pub eval_pass_at_1: Option<f64>,
    /// Held-out mean reward, when an evaluation ran after this step.
    #[serde(rename = "eval/reward", skip_serializing_if = "Option::is_none")]
    pub eval_reward: Option<f64>,
    /// Seconds since the run (or its resume) started.
    #[serde(rename = "time/elapsed")]
    pub elapsed_s: f64,
}

impl SftStepMetrics {
    /// The `metrics.jsonl` line.
    pub fn to_record(&self) -> Result<Map<String, Value>> {
        record_of("SFT step metrics", self)
    }

    /// The progress line printed every ten steps and at the end.
    pub fn progress_line(&self, max_steps: u64) -> String {
        format!(
            "sft step {:>4}/{max_steps}  loss {:.4}  |g| {:.3}  lr {:.2e}  {:.0} tok/s",
            self.step, self.loss, self.grad_norm, self.lr, self.tokens_per_s
        )
    }
}

/// The metrics plotted into `plots.html`.
pub const PLOTTED: &[&str] = &[
    "reward/mean",
    "pass@1",
    "eval/pass@1",
    "distill/reverse_kl",
    "seq_len/mean",
    "entropy",
    "grad_norm",
    "mismatch/max",
    "policy_lag/mean",
    "time/step",
];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn progress_line_shows_the_zero_advantage_group_count() {
        let mut m = StepMetrics {
            step: 2,
            ..Default::default()
        };
        m.data.zero_advantage_groups = 3;
        m.time.step_s = 1.0;
        let line = m.progress_line(5);
        assert!(line.contains("zero-adv 3"), "{line}");
        assert!(!line.contains("reward-errors"), "{line}");
        // Rewards that could not be computed are in the line, loudly.
        m.rollouts.reward_errors = 7;
        m.time.reward_s = 0.5;
        let line = m.progress_line(5);
        assert!(line.contains("reward-errors 7"), "{line}");
        assert!(line.contains("reward 0.5s"), "{line}");
    }

    /// Issue 39: a step that trained nothing says why and what to change;
    /// a step that trained says nothing of the kind; an evaluation's time
    /// is shown apart from the step's other parts.
    #[test]
    fn progress_line_says_when_nothing_trained_and_shows_eval_time() {
        let mut m = StepMetrics {
            step: 2,
            ..Default::default()
        };
        m.data.zero_advantage_groups = 4;
        let line = m.progress_line(5);
        assert!(
            line.contains("nothing trained") && line.contains("temperature"),
            "{line}"
        );
        m.data.trained_sequences = 8;
        assert!(!m.progress_line(5).contains("nothing trained"));
        assert!(!m.progress_line(5).contains("eval "));
        m.time.eval_s = Some(3.25);
        assert!(
            m.progress_line(5).contains(", eval 3.2s)"),
            "{}",
            m.progress_line(5)
        );
    }

    /// Issue 39: training's pass@1 uses each environment's own threshold.
    #[test]
    fn pass_rate_uses_each_environments_threshold() {
        let group = |env: usize, rewards: &[f64]| Group {
            env,
            row: temper_env::Row {
                example_id: 0,
                prompt: vec![],
                answer: None,
                info: Value::Null,
            },
            rollouts: rewards.iter().map(|_| Default::default()).collect(),
            scores: rewards
                .iter()
                .map(|r| temper_env::Score {
                    reward: *r,
                    ..Default::default()
                })
                .collect(),
            version: 0,
        };
        // env 0 (threshold 1.5): 1.5 passes, 1.0 does not; env 1 (1): 1.0 passes.
        let groups = [group(0, &[1.5, 1.0]), group(1, &[1.0, 0.0])];
        let ids = ["a".to_string(), "b".to_string()];
        let m = RolloutMetrics::of(&groups, 0, &ids, &[1.5, 1.0]);
        assert_eq!(m.pass_rate, 0.5);
        let m = RolloutMetrics::of(&groups, 0, &ids, &[]);
        assert_eq!(m.pass_rate, 0.75, "1 where none is given");
    }

    /// A resumed run reads its earlier steps back as typed metrics: the
    /// record round-trips, an older line (renamed keys, no `multi_turn/*`)
    /// still reads, and a missing key is an error naming it.
    #[test]
    fn a_record_reads_back_as_the_same_step_metrics() {
        let mut m = StepMetrics {
            step: 3,
            ..Default::default()
        };
        m.rollouts.reward_mean = 0.25;
        m.rollouts.pass_rate = 0.5;
        m.rollouts.reward_by_env =
            RewardByEnv(vec![("envs/a".into(), 0.5, 0.1), ("b".into(), 0.0, 0.0)]);
        m.rollouts.rubric = RubricMetrics([("correct".to_string(), 0.5)].into());
        m.data.trained_tokens = 17;
        m.data.multi_turn_fallbacks = 2;
        m.train.loss = -0.125;
        m.time.eval_pass_at_1 = Some(0.75);
        m.time.eval_reward = Some(1.5);
        m.time.reward_s = 0.25;
        m.rollouts.reward_errors = 4;
        let record = m.to_record().unwrap();
        assert_eq!(StepMetrics::try_from(&record).unwrap(), m);

        let mut old = record.clone();
        for (new, was) in [("pass@1", "pass_rate"), ("eval/pass@1", "eval/accuracy")] {
            let v = old.remove(new).unwrap();
            old.insert(was.into(), v);
        }
        old.remove("multi_turn/merged");
        old.remove("multi_turn/fallbacks");
        old.remove("reward_errors");
        old.remove("time/reward");
        old.remove("mismatch/probe_max");
        old.remove("mismatch/probe_tokens");
        let back = StepMetrics::try_from(&old).unwrap();
        assert_eq!(
            (back.rollouts.pass_rate, back.time.eval_pass_at_1),
            (0.5, Some(0.75))
        );
        assert_eq!(back.data.multi_turn_fallbacks, 0);
        assert_eq!((back.rollouts.reward_errors, back.time.reward_s), (0, 0.0));

        let mut torn = record;
        torn.remove("grad_norm");
        let e = StepMetrics::try_from(&torn).unwrap_err();
        assert!(e.to_string().contains("grad_norm"), "{e}");
    }

    /// The keys (and their order) of a `metrics.jsonl` line are what
    /// `temper view`, `plots.html` and the check scripts read.
    #[test]
    fn a_record_has_the_metrics_jsonl_keys_in_order() {
        let mut m = StepMetrics {
            step: 1,
            ..Default::default()
        };
        m.rollouts.reward_by_env = RewardByEnv(vec![("arithmetic".into(), 0.5, 0.1)]);
        m.rollouts.rubric = RubricMetrics([("correct".to_string(), 0.5)].into());
        m.rollouts.rollout_errors = 2;
        m.time.eval_pass_at_1 = Some(0.25);
        m.time.eval_reward = Some(0.5);
        let record = m.to_record().unwrap();
        let keys: Vec<&str> = record.keys().map(String::as_str).collect();
        assert_eq!(
            keys,
            [
                "step",
                "reward/mean",
                "reward/std",
                "reward/arithmetic/mean",
                "reward/arithmetic/std",
                "metric/correct",
                "pass@1",
                "seq_len/mean",
                "truncation_rate",
                "rollout_errors",
                "reward_errors",
                "policy_lag/mean",
                "policy_lag/max",
                "dropped_stale",
                "dropped_stale/total",
                "zero_advantage_groups",
                "skipped_turns",
                "trained_sequences",
                "trained_tokens",
                "multi_turn/merged",
                "multi_turn/fallbacks",
                "loss",
                "mismatch/max",
                "mismatch/mean",
                "mismatch/tokens",
                "mismatch/probe_max",
                "mismatch/probe_tokens",
                "entropy",
                "grad_norm",
                "lr",
                "time/train",
                "time/generate",
                "time/reward",
                "tokens_per_s",
                "time/wait",
                "time/publish",
                "eval/pass@1",
                "eval/reward",
                "time/step",
                "time/elapsed",
            ]
        );
        // Counts are integers, measurements floats — as before.
        assert_eq!(record["step"], serde_json::json!(1));
        assert_eq!(record["rollout_errors"], serde_json::json!(2));
        assert_eq!(record["policy_lag/max"], serde_json::json!(0.0));
        // Without an evaluation the eval keys are absent.
        m.time.eval_pass_at_1 = None;
        m.time.eval_reward = None;
        assert!(!m.to_record().unwrap().contains_key("eval/pass@1"));
    }
}
