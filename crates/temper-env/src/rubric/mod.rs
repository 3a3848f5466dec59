//! Rubrics: a weighted sum of reward functions plus zero-weight metrics,
//! per rollout and per group.
//!
//! A reward function sees one rollout through a [`RewardCtx`]; a group
//! function sees every rollout of one prompt (for relative rewards such as
//! "shortest correct answer"). Each function's raw score is reported as a
//! metric under its name; the reward is Σ weight · score, so weight 0 makes
//! a function a metric only.
//!
//! One file per family of reward functions: `builtin` (answer matching,
//! JSON, format, length), `judge` and [`relative_judge`] (LLM judges),
//! `code_tests` and [`suite`] (code run in the sandbox), `program` (reward
//! programs in any language), `json_fields` and `regex_extract`; `spec`
//! reads `env.toml` entries into them, `context` is what they all see.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

use crate::{EnvError, Parser, Rollout, Row, Score};

mod builtin;
mod code_tests;
mod context;
mod json_fields;
mod judge;
mod program;
mod regex_extract;
pub mod relative_judge;
mod reward;
mod spec;
pub mod suite;

pub use builtin::lcs_ratio;
pub use code_tests::{extract_code, CodeTests, CodeTestsConfig};
pub use context::{GroupFn, RewardCtx, RewardFn};
pub use json_fields::{json_fields_score, FieldWeights, JsonFieldsConfig};
pub use judge::{Judge, JudgeConfig};
pub use program::{ProgramReward, MAX_SHIPPED_BYTES};
pub use regex_extract::{RegexExtract, RegexExtractConfig};
pub use reward::{GroupReward, Reward};
pub use spec::{RewardSpec, BUILTIN_REWARDS};

use reward::Kind;

/// Reward functions, group functions and the parser they read answers with.
#[derive(Clone, Default)]
pub struct Rubric {
    /// The parser passed to every function.
    pub parser: Parser,
    funcs: Vec<Reward>,
    group_funcs: Vec<GroupReward>,
    /// Divide the reward by the sum of |weight| (so weights in [0, 1]-scored
    /// functions give a reward in [0, 1]).
    pub normalize: bool,
}

impl std::fmt::Debug for Rubric {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Rubric")
            .field("parser", &self.parser)
            .field("funcs", &self.funcs)
            .finish()
    }
}

impl Rubric {
    /// An empty rubric reading answers with `parser`.
    pub fn new(parser: Parser) -> Self {
        Rubric {
            parser,
            funcs: Vec::new(),
            group_funcs: Vec::new(),
            normalize: false,
        }
    }

    /// Add a reward function.
    pub fn with(mut self, r: Reward) -> Self {
        self.funcs.push(r);
        self
    }

    /// Add a group function.
    pub fn with_group(mut self, g: GroupReward) -> Self {
        self.group_funcs.push(g);
        self
    }

    /// The largest reward this rubric can give, when every function with a
    /// positive weight declares its range (built-ins do; programs do not):
    /// Σ weight · max over positive weights, divided by Σ |weight| when the
    /// rubric normalizes. A negative-weight function is assumed to score
    /// ≥ 0, so it adds nothing to the maximum.
    pub fn max_reward(&self) -> Option<f64> {
        let mut max = 0.0;
        for f in self.funcs.iter().filter(|f| f.weight > 0.0) {
            max += f.weight * f.max_score?;
        }
        if self.group_funcs.iter().any(|g| g.weight > 0.0) {
            return None;
        }
        if self.normalize {
            let total: f64 = self.funcs.iter().map(|f| f.weight.abs()).sum::<f64>()
                + self.group_funcs.iter().map(|g| g.weight.abs()).sum::<f64>();
            if total > 0.0 {
                max /= total;
            }
        }
        Some(max)
    }

    /// The services its functions call (the sandbox, a judge's endpoint).
    pub fn services(&self) -> Vec<Arc<dyn crate::Service>> {
        self.funcs.iter().filter_map(Reward::service).collect()
    }

    /// Score the rollouts of one row. Functions run in order; each runs
    /// concurrently across the group.
    pub async fn score_group(&self, row: &Row, rollouts: &[Rollout]) -> Vec<Score> {
        let ctxs: Vec<RewardCtx<'_>> = rollouts
            .iter()
            .map(|r| RewardCtx {
                prompt: &row.prompt,
                completion: &r.completion,
                answer: row.answer.as_deref(),
                info: &row.info,
                parser: &self.parser,
                rollout: r,
            })
            .collect();
        let n = rollouts.len().max(1) as f64;
        let mut scores = vec![
            Score {
                scoring_ms: Some(0.0),
                ..Score::default()
            };
            rollouts.len()
        ];
        for func in &self.funcs {
            // Functions of the whole group: one call for all its rollouts.
            let t = Instant::now();
            let group = match &func.kind {
                Kind::Program(p) => Some(p.score_group(&ctxs).await),
                Kind::RelativeJudge(j) => Some(
                    j.score_group(&ctxs)
                        .await
                        .map(|v| v.into_iter().map(|x| (x, BTreeMap::new())).collect()),
                ),
                _ => None,
            };
            if let Some(result) = group {
                let share_ms = t.elapsed().as_secs_f64() * 1e3 / n;
                match result {
                    Ok(values) => {
                        for (s, (v, metrics)) in scores.iter_mut().zip(values) {
                            s.reward += func.weight * v;
                            s.metrics.insert(func.name.clone(), v);
                            for (k, m) in metrics {
                                s.metrics.insert(format!("{}/{k}", func.name), m);
                            }
                            add_ms(s, share_ms);
                        }
                    }
                    Err(e) => {
                        match &func.kind {
                            Kind::Program(p) => {
                                tracing::warn!("reward program `{}`: {e}", p.command)
                            }
                            _ => tracing::warn!("reward `{}`: {e}", func.name),
                        }
                        for s in &mut scores {
                            failed(s, &func.name, &e);
                            add_ms(s, share_ms);
                        }
                    }
                }
                continue;
            }
            let values = futures::future::join_all(ctxs.iter().map(|c| async move {
                let t = Instant::now();
                let v = func.score(c).await;
                (v, t.elapsed().as_secs_f64() * 1e3)
            }))
            .await;
            for (s, (v, ms)) in scores.iter_mut().zip(values) {
                match v {
                    Ok((v, metrics)) => {
                        s.reward += func.weight * v;
                        s.metrics.insert(func.name.clone(), v);
                        for (k, m) in metrics {
                            s.metrics.insert(format!("{}/{k}", func.name), m);
                        }
                    }
                    Err(e) => {
                        tracing::warn!("reward `{}`: {e}", func.name);
                        failed(s, &func.name, &e);
                    }
                }
                add_ms(s, ms);
            }
        }
        for g in &self.group_funcs {
            let t = Instant::now();
            let values = (g.f)(&ctxs);
            let share_ms = t.elapsed().as_secs_f64() * 1e3 / n;
            for (s, v) in scores.iter_mut().zip(values) {
                s.reward += g.weight * v;
                s.metrics.insert(g.name.clone(), v);
                add_ms(s, share_ms);
            }
        }
        if self.normalize {
            let total: f64 = self
                .funcs
                .iter()
                .map(|f| f.weight.abs())
                .chain(self.group_funcs.iter().map(|g| g.weight.abs()))
                .sum();
            if total > 0.0 {
                for s in &mut scores {
                    s.reward /= total;
                }
            }
        }
        scores
    }
}

/// Function `name` could not score this rollout: 0, the metric
/// `NAME/error = 1`, and the first such failure as the score's error.
fn failed(s: &mut Score, name: &str, why: &str) {
    s.metrics.insert(name.to_string(), 0.0);
    s.metrics.insert(format!("{name}/error"), 1.0);
    s.error
        .get_or_insert_with(|| format!("reward `{name}`: {why}"));
}

fn add_ms(s: &mut Score, ms: f64) {
    *s.scoring_ms.get_or_insert(0.0) += ms;
}

/// Check a rubric spec list before use; programs start in `dir`.
pub(crate) fn build_rubric(
    parser: Parser,
    specs: &[RewardSpec],
    path: &str,
    dir: Option<&std::path::Path>,
    requirements: &[String],
) -> Result<Rubric, EnvError> {
    let mut rubric = Rubric::new(parser);
    for spec in specs {
        let r = Reward::from_spec_in(spec, dir).map_err(|message| EnvError::Manifest {
            path: path.to_string(),
            message,
        })?;
        rubric = rubric.with(r.with_requirements(requirements));
    }
    Ok(rubric)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn builtin(text: &str) -> Reward {
        let spec: RewardSpec = toml::from_str(text).unwrap();
        Reward::from_spec(&spec).unwrap()
    }

    /// Issue 39: the maximum a rubric can give, which `pass_threshold`
    /// falls back to when it exceeds 1.
    #[test]
    fn max_reward_sums_positive_weights_of_bounded_functions() {
        let answer = || builtin("function = \"exact_match\"\nweight = 1.0");
        let format = || builtin("function = \"format\"\nweight = 0.5");
        let penalty =
            || builtin("function = \"length_penalty\"\nweight = 2.0\nargs = { max_chars = 10 }");
        let r = Rubric::new(Parser::Plain).with(answer()).with(format());
        assert_eq!(r.max_reward(), Some(1.5));
        // A penalty (≤ 0) and a metric-only entry add nothing.
        let metric = builtin("function = \"contains\"\nweight = 0.0");
        let r = r.with(penalty()).with(metric);
        assert_eq!(r.max_reward(), Some(1.5));
        // Normalized: Σ w·max / Σ |w| = 1.5 / 3.5.
        let mut n = Rubric::new(Parser::Plain)
            .with(answer())
            .with(format())
            .with(penalty());
        n.normalize = true;
        assert_eq!(n.max_reward(), Some(1.5 / 3.5));
        // A function of unknown range makes the maximum unknown.
        let custom = Reward::new("custom", 1.0, |_| 3.0);
        assert_eq!(Rubric::new(Parser::Plain).with(custom).max_reward(), None);
        let custom0 = Reward::new("custom", 0.0, |_| 3.0);
        assert_eq!(
            Rubric::new(Parser::Plain)
                .with(answer())
                .with(custom0)
                .max_reward(),
            Some(1.0)
        );
    }
}
