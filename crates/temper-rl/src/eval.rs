//! Held-out evaluation during a run, through `temper eval`'s runner: the
//! published policy on the eval split of the eval environment; results
//! land in `run_dir/evals/step-N`.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use serde_json::Value;
use temper_env::{ChatModel, SamplingArgs};

use crate::config::RlConfig;
use crate::error::{Result, RlError};
use crate::policy::Batcher;
use crate::publish::Published;
use crate::rollout::mix;

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

impl RlConfig {
    /// A rollout passes at reward ≥ 1 (a correct answer under a rubric
    /// whose main reward has weight 1).
    pub fn eval_pass_threshold(&self) -> f64 {
        1.0
    }
}

impl EvalResult {
    /// The progress line of the evaluation before training.
    pub fn before_line(&self) -> String {
        format!(
            "eval before training: accuracy {:.1}%  reward {:.3}  ({} rollouts, {} distinct held-out questions)",
            100.0 * self.accuracy,
            self.reward,
            self.n,
            self.distinct
        )
    }

    /// The progress line of an evaluation during training.
    pub fn step_line(&self) -> String {
        format!(
            "  eval @ step {}: accuracy {:.1}%  reward {:.3}",
            self.step,
            100.0 * self.accuracy,
            self.reward
        )
    }
}

/// Evaluate `policy` (version `step`) if an evaluation is due after `step`
/// steps: every `eval.interval` steps and after the last.
pub(crate) async fn evaluate_if_due(
    cfg: &RlConfig,
    step: u64,
    policy: &Published,
    run_dir: &Path,
    batcher: Option<&Batcher>,
) -> Result<Option<EvalResult>> {
    let due = cfg.eval.num_examples > 0
        && ((cfg.eval.interval > 0 && step.is_multiple_of(cfg.eval.interval))
            || step == cfg.trainer.max_steps);
    if !due {
        return Ok(None);
    }
    let model = policy.model.clone();
    Ok(Some(evaluate(cfg, model, run_dir, step, batcher).await?))
}

/// Evaluate `model` (policy `step`) on the held-out split of the eval env,
/// through `temper eval`'s runner; results land in `run_dir/evals/step-N`.
pub(crate) async fn evaluate(
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
        split: temper_env::Split::Eval,
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
