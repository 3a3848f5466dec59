//! Held-out evaluation during a run (RL or SFT), through `temper eval`'s
//! runner: the current policy on the eval split of the eval environment
//! (loaded once per run by an [`Evaluator`]); results land in
//! `run_dir/evals/step-N`.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use serde_json::Value;
use temper_env::{ChatModel, Environment, SamplingArgs};

use crate::config::{EnvSection, EvalSection, RlConfig};
use crate::error::{Result, RlError};
use crate::policy::Batcher;
use crate::publish::Published;
use crate::rollout::mix;
use std::collections::BTreeMap;

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
    /// The mean of each rubric component (`correct`, `format`, …), so a
    /// pass rate is never read without what made up the reward.
    #[serde(default)]
    pub components: BTreeMap<String, f64>,
    /// Seconds the evaluation took.
    #[serde(default)]
    pub time_s: f64,
    /// A rollout passed at reward ≥ this.
    #[serde(default = "one")]
    pub pass_threshold: f64,
}

fn one() -> f64 {
    1.0
}

impl EvalResult {
    /// The progress line of the evaluation before training.
    pub fn before_line(&self) -> String {
        format!(
            "eval before training: pass@1 {:.1}%  reward {:.3}{}  ({} rollouts, {} distinct held-out questions, reward ≥ {} passes, {:.1}s)",
            100.0 * self.pass_at_1,
            self.reward,
            self.components_text(),
            self.n,
            self.distinct,
            self.pass_threshold,
            self.time_s
        )
    }

    /// `  [correct 0.400, format 0.900]`, or nothing for a one-part rubric
    /// (its component is the reward).
    fn components_text(&self) -> String {
        if self.components.len() < 2 {
            return String::new();
        }
        let parts: Vec<String> = self
            .components
            .iter()
            .map(|(k, v)| format!("{k} {v:.3}"))
            .collect();
        format!("  [{}]", parts.join(", "))
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
            "  eval @ step {}: pass@1 {:.1}%  reward {:.3}{}  ({:.1}s)",
            self.step,
            100.0 * self.pass_at_1,
            self.reward,
            self.components_text(),
            self.time_s
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
    pass_threshold: temper_env::PassThreshold,
    last_step: u64,
    /// Show `temper eval`'s progress bar (done/total, rate, ETA) while an
    /// evaluation runs (on a terminal; hidden otherwise).
    progress: bool,
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
        )
        .await
        .map(|ev| ev.map(|e| e.with_progress(cfg.log.progress)))
    }

    /// SFT's and DPO's evaluator: `[eval] env`, else the data's environment
    /// (with its arguments unless `[eval] args` are given); `None` when
    /// `eval.num_examples` is 0 or no environment is named (a file dataset
    /// and no `eval.env`). Completions get the environment's own
    /// `max_tokens` (what `temper eval` would use).
    pub async fn for_trainer(
        eval: &EvalSection,
        data_env: Option<&EnvSection>,
        seed: u64,
        progress: bool,
        max_steps: u64,
    ) -> Result<Option<Self>> {
        let spec = eval.env.clone().or_else(|| data_env.map(|e| e.id.clone()));
        let args = eval.args.clone().unwrap_or_else(|| {
            data_env
                .filter(|e| Some(&e.id) == spec.as_ref())
                .map(|e| e.args.clone())
                .unwrap_or(Value::Null)
        });
        Self::load(spec, args, eval, None, seed, max_steps)
            .await
            .map(|ev| ev.map(|e| e.with_progress(progress)))
    }

    fn with_progress(mut self, progress: bool) -> Self {
        self.progress = progress;
        self
    }

    async fn load(
        spec: Option<String>,
        args: Value,
        eval: &EvalSection,
        max_tokens: Option<usize>,
        seed: u64,
        last_step: u64,
    ) -> Result<Option<Self>> {
        let Some(spec) = spec.filter(|_| eval.num_examples > 0) else {
            return Ok(None);
        };
        // Loading may read files or start an external environment's process.
        let (s, a) = (spec.clone(), args.clone());
        let env = tokio::task::spawn_blocking(move || temper_tasks::loader().load(&s, &a))
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
        let pass_threshold = temper_env::pass_threshold(eval.pass_threshold, &*env);
        Ok(Some(Self {
            env,
            spec,
            args,
            eval: eval.clone(),
            max_tokens,
            seed,
            pass_threshold,
            last_step,
            progress: false,
            services,
        }))
    }

    /// What the user should read once about the pass threshold (set when
    /// it came from the rubric's maximum).
    pub fn notice(&self) -> Option<&str> {
        self.pass_threshold.notice.as_deref()
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
            pass_threshold: self.pass_threshold.value,
            resume: false,
            progress: self.progress,
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
            components: out.metadata.avg_metrics.clone(),
            time_s: out.metadata.time,
            pass_threshold: self.pass_threshold.value,
        })
    }

    /// Evaluate `policy` (version `step`) if the run has an evaluator and
    /// an evaluation is [`due`](Self::due).
    pub(crate) async fn evaluate_if_due(
        this: Option<&Self>,
        step: u64,
        policy: &Published,
        run_dir: &Path,
        batcher: Option<&Batcher>,
    ) -> Result<Option<EvalResult>> {
        let Some(ev) = this.filter(|ev| ev.due(step)) else {
            return Ok(None);
        };
        let model = policy.model.clone();
        Ok(Some(ev.evaluate(model, run_dir, step, batcher).await?))
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

    /// Issue 39: an evaluation's progress lines show the rubric's parts
    /// apart ("answer correct" vs "format ok"), what a pass is, and how
    /// long the evaluation took.
    #[test]
    fn eval_lines_show_components_threshold_and_time() {
        let mut r: EvalResult = serde_json::from_str(
            r#"{"step":3,"reward":0.9,"pass_at_1":0.4,"n":10,"distinct":10,"dir":"e"}"#,
        )
        .unwrap();
        r.components = [("correct".to_string(), 0.4), ("format".to_string(), 1.0)].into();
        r.pass_threshold = 1.5;
        r.time_s = 12.25;
        let before = r.before_line();
        assert!(
            before.contains("[correct 0.400, format 1.000]")
                && before.contains("reward ≥ 1.5 passes")
                && before.contains("12.2s"),
            "{before}"
        );
        let step = r.step_line();
        assert!(
            step.contains("[correct 0.400, format 1.000]") && step.contains("(12.2s)"),
            "{step}"
        );
        // One component is the reward itself: not repeated.
        r.components.remove("format");
        assert!(!r.step_line().contains('['), "{}", r.step_line());
    }
}
