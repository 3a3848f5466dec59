//! Held-out evaluation during a run (RL or SFT), through `temper eval`'s
//! runner: the current policy on the eval split of the eval environment
//! (loaded once per run by an [`Evaluator`]); results land in
//! `run_dir/evals/step-N`.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use serde_json::Value;
use temper_env::{ChatModel, Environment, SamplingArgs};

use crate::config::{EvalSection, RlConfig, SftConfig};
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
    /// Fraction of rollouts at or above the pass threshold (`temper eval`'s
    /// pass@1; runs checkpointed before the rename wrote `accuracy`).
    #[serde(alias = "accuracy")]
    pub pass_at_1: f64,
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
            "eval before training: pass@1 {:.1}%  reward {:.3}  ({} rollouts, {} distinct held-out questions)",
            100.0 * self.pass_at_1,
            self.reward,
            self.n,
            self.distinct
        )
    }

    /// Its point on `plots.html`'s eval charts (not a `metrics.jsonl`
    /// line): `step`, `eval/pass@1`, `eval/reward`.
    pub fn plot_record(&self) -> serde_json::Map<String, Value> {
        let mut m = serde_json::Map::new();
        m.insert("step".into(), self.step.into());
        m.insert("eval/pass@1".into(), self.pass_at_1.into());
        m.insert("eval/reward".into(), self.reward.into());
        m
    }

    /// The progress line of an evaluation during training.
    pub fn step_line(&self) -> String {
        format!(
            "  eval @ step {}: pass@1 {:.1}%  reward {:.3}",
            self.step,
            100.0 * self.pass_at_1,
            self.reward
        )
    }
}

/// Held-out evaluation of a run: the eval environment, loaded once (off
/// the async runtime) and reused by every evaluation, and how to sample.
pub struct Evaluator {
    env: Arc<dyn Environment>,
    spec: String,
    args: Value,
    eval: EvalSection,
    max_tokens: usize,
    seed: u64,
    pass_threshold: f64,
    last_step: u64,
    services: Vec<String>,
}

impl Evaluator {
    /// The evaluator of an RL run: `[eval]`, defaulting to the first
    /// `[[env]]`; `None` when `eval.num_examples` is 0.
    pub async fn for_rl(cfg: &RlConfig) -> Result<Option<Self>> {
        let first = cfg.env.first();
        let spec = cfg.eval.env.clone().or_else(|| first.map(|e| e.id.clone()));
        let args = cfg.eval.args.clone().unwrap_or_else(|| {
            first
                .filter(|e| Some(&e.id) == spec.as_ref())
                .map(|e| e.args.clone())
                .unwrap_or(Value::Null)
        });
        Self::load(
            spec,
            args,
            &cfg.eval,
            Some(cfg.sampling.max_tokens),
            cfg.seed,
            cfg.trainer.max_steps,
            cfg.eval_pass_threshold(),
        )
        .await
    }

    /// The evaluator of an SFT run: `[eval]`, defaulting to `[data] env`;
    /// `None` when `eval.num_examples` is 0 or no environment is named (a
    /// file dataset and no `eval.env`). Completions get the environment's
    /// own `max_tokens` (what `temper eval` would use).
    pub async fn for_sft(cfg: &SftConfig, max_steps: u64) -> Result<Option<Self>> {
        let data_env = cfg.data.env.as_ref();
        let spec = cfg
            .eval
            .env
            .clone()
            .or_else(|| data_env.map(|e| e.id.clone()));
        let args = cfg.eval.args.clone().unwrap_or_else(|| {
            data_env
                .filter(|e| Some(&e.id) == spec.as_ref())
                .map(|e| e.args.clone())
                .unwrap_or(Value::Null)
        });
        Self::load(spec, args, &cfg.eval, None, cfg.seed, max_steps, 1.0).await
    }

    async fn load(
        spec: Option<String>,
        args: Value,
        eval: &EvalSection,
        max_tokens: Option<usize>,
        seed: u64,
        last_step: u64,
        pass_threshold: f64,
    ) -> Result<Option<Self>> {
        let Some(spec) = spec.filter(|_| eval.num_examples > 0) else {
            return Ok(None);
        };
        // Loading may read files or start an external environment's process.
        let (s, a) = (spec.clone(), args.clone());
        let env = tokio::task::spawn_blocking(move || temper_tasks::load_environment(&s, &a))
            .await
            .map_err(|source| RlError::Blocking {
                what: "loading the eval environment",
                source,
            })?
            .map_err(|e| RlError::Env(format!("{spec}: {e}")))?;
        let services = temper_env::check_services(env.as_ref())
            .await
            .map_err(|e| RlError::Env(format!("{spec}: {e}")))?;
        let max_tokens = max_tokens.unwrap_or_else(|| env.eval_defaults().sampling.max_tokens);
        Ok(Some(Self {
            env,
            spec,
            args,
            eval: eval.clone(),
            max_tokens,
            seed,
            pass_threshold,
            last_step,
            services,
        }))
    }

    /// The services the eval environment calls, checked when loaded.
    pub fn services(&self) -> &[String] {
        &self.services
    }

    /// Whether an evaluation is due after `step` steps: every
    /// `eval.interval` steps and after the last.
    pub fn due(&self, step: u64) -> bool {
        (self.eval.interval > 0 && step.is_multiple_of(self.eval.interval))
            || step == self.last_step
    }

    /// Evaluate `model` (policy `step`) on the held-out split, through
    /// `temper eval`'s runner; results land in `run_dir/evals/step-N`.
    pub async fn evaluate(
        &self,
        model: Arc<dyn ChatModel>,
        run_dir: &Path,
        step: u64,
        batcher: Option<&Batcher>,
    ) -> Result<EvalResult> {
        let dir = run_dir.join("evals").join(format!("step-{step:06}"));
        if dir.exists() {
            std::fs::remove_dir_all(&dir).map_err(|e| RlError::io(&dir, e))?;
        }
        let n = self.eval.num_examples;
        if let Some(b) = batcher {
            b.expect(n);
        }
        let ecfg = temper_eval::EvalConfig {
            env_spec: self.spec.clone(),
            env_args: self.args.clone(),
            env_package: None,
            model: format!("policy@{step}"),
            base_url: "in-process".into(),
            api_key: None,
            api_key_env: None,
            num_examples: n,
            split: temper_env::Split::Eval,
            rollouts_per_example: 1,
            max_concurrent: n.max(1),
            sampling: SamplingArgs {
                max_tokens: self.max_tokens,
                temperature: self.eval.temperature,
                top_p: 1.0,
                seed: Some(mix(&[self.seed, 0xE7A1])),
                ..Default::default()
            },
            seed: self.seed,
            run_dir: dir.clone(),
            request_timeout: std::time::Duration::from_secs(3600),
            retry: Default::default(),
            pass_threshold: self.pass_threshold,
            resume: false,
            progress: false,
        };
        let out = temper_eval::run_eval_with(self.env.clone(), model, &ecfg)
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
            pass_at_1: out.metadata.pass_at_k.get("1").copied().unwrap_or(0.0),
            n: out.metadata.num_rollouts,
            distinct: distinct.len(),
            dir,
        })
    }

    /// Evaluate `policy` (version `step`) if an evaluation is
    /// [`due`](Self::due).
    pub(crate) async fn evaluate_if_due(
        &self,
        step: u64,
        policy: &Published,
        run_dir: &Path,
        batcher: Option<&Batcher>,
    ) -> Result<Option<EvalResult>> {
        if !self.due(step) {
            return Ok(None);
        }
        let model = policy.model.clone();
        Ok(Some(self.evaluate(model, run_dir, step, batcher).await?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Issue 12: one name, pass@1, for the held-out metric; a checkpoint
    /// written before the rename (`accuracy`) still resumes.
    #[test]
    fn pass_at_1_is_the_name_and_old_checkpoints_still_read() {
        let old = r#"{"step":0,"reward":0.5,"accuracy":0.25,"n":4,"distinct":3,"dir":"e"}"#;
        let r: EvalResult = serde_json::from_str(old).unwrap();
        assert_eq!(r.pass_at_1, 0.25);
        assert!(
            r.before_line().contains("pass@1 25.0%"),
            "{}",
            r.before_line()
        );
        assert!(r.step_line().contains("pass@1 25.0%"));
        assert_eq!(r.plot_record()["eval/pass@1"], 0.25);
        let saved = serde_json::to_string(&r).unwrap();
        assert!(saved.contains("\"pass_at_1\":0.25") && !saved.contains("accuracy"));
    }
}
