//! Online DPO (`[data] env`): each step, the current policy samples a
//! group of completions for each prompt, exactly as an RL step does (RL's
//! [`RolloutPlan`] samples and scores them), and each group with distinct
//! rewards gives one pair — its highest-reward completion chosen, its
//! lowest rejected. A group whose rewards are all equal says nothing about
//! preference and is skipped, as is a multi-turn episode (a pair is one
//! prompt and two completions of it).

use std::sync::Arc;
use std::time::Instant;

use serde_json::{json, Map, Value};
use temper_engine::Trainer;
use temper_model::Pretrained;

use crate::config::{RlConfig, RlTrainerSection, SamplingSection};
use crate::error::{Result, RlError};
use crate::plan::{DpoPlan, PrefSource, RlPlan};
use crate::policy::{Batcher, EnginePolicy, Renderer};
use crate::pref_pair::{PairLogps, PrefPair};
use crate::publish::Published;
use crate::rollout::RolloutPlan;

/// The sampling side of an online DPO run.
pub struct Online {
    plan: RolloutPlan,
    trainer: Arc<dyn Trainer>,
    renderer: Renderer,
    batcher: Batcher,
    /// Sampler handle of the weights before the first step: the reference.
    reference: String,
}

impl Online {
    /// The environment of `cfg.data`, loaded as an RL run with the same
    /// sampling would load it, and a frozen snapshot of `trainer`'s current
    /// weights as the reference (taken before any checkpoint is loaded).
    pub async fn new(
        cfg: &DpoPlan,
        base: &Arc<Pretrained>,
        trainer: Arc<dyn Trainer>,
    ) -> Result<Self> {
        let PrefSource::Env {
            env,
            group_size,
            temperature,
            max_tokens,
        } = &cfg.data
        else {
            return Err(RlError::Config("online DPO needs [data] env".into()));
        };
        let rl = RlConfig {
            seed: cfg.seed,
            model: cfg.config().model.clone(),
            lora: cfg.lora.clone(),
            env: vec![env.clone()],
            sampling: SamplingSection {
                temperature: *temperature,
                max_tokens: *max_tokens,
                group_size: *group_size,
                ..SamplingSection::default()
            },
            trainer: RlTrainerSection {
                batch_size: cfg.optim.batch_size,
                max_steps: cfg.optim.max_steps,
                ..RlTrainerSection::default()
            },
            ..RlConfig::default()
        };
        let plan = RolloutPlan::load(&RlPlan::try_from(rl)?).await?;
        let reference = trainer.save_weights_for_sampler("dpo-reference").await?;
        Ok(Self {
            plan,
            renderer: Renderer::new(base.clone())?,
            batcher: Batcher::spawn(trainer.clone()),
            trainer,
            reference,
        })
    }

    /// Step `step`'s pairs, their reference logprobs, and what sampling
    /// them measured (`reward/mean`, `pairs`, `pairs/skipped`,
    /// `rollouts/errors`, `time/sample`).
    pub async fn pairs(
        &self,
        step: u64,
    ) -> Result<(Vec<PrefPair>, Vec<PairLogps>, Map<String, Value>)> {
        let t0 = Instant::now();
        let handle = self
            .trainer
            .save_weights_for_sampler(&format!("dpo-policy-{step}"))
            .await?;
        let published = Published {
            version: step,
            model: Arc::new(EnginePolicy::new(
                self.renderer.clone(),
                self.batcher.clone(),
                handle.clone(),
                step,
            )),
        };
        let batch = self
            .plan
            .sample_batch(step, &published, Some(&self.batcher))
            .await;
        self.trainer.release_sampler(&handle).await?;
        let (mut pairs, mut skipped, mut rewards) = (Vec::new(), 0usize, Vec::new());
        let errors = batch
            .groups_g
            .iter()
            .flat_map(|g| g.rollouts.iter().zip(&g.scores))
            .filter(|(r, s)| r.error.is_some() || s.error.is_some())
            .count();
        for g in &batch.groups_g {
            let r = g.rewards_r();
            rewards.extend(&r);
            match pair_of(g) {
                Some(p) => pairs.push(p),
                None => skipped += 1,
            }
        }
        let sample_s = t0.elapsed().as_secs_f64();
        let mut refs = Vec::with_capacity(pairs.len());
        for p in &pairs {
            refs.push((
                self.reference_logp(p, &p.chosen).await?,
                self.reference_logp(p, &p.rejected).await?,
            ));
        }
        let mut info = Map::new();
        info.insert(
            "reward/mean".into(),
            json!(rewards.iter().sum::<f64>() / rewards.len().max(1) as f64),
        );
        info.insert("pairs".into(), json!(pairs.len()));
        info.insert("pairs/skipped".into(), json!(skipped));
        info.insert("rollouts/errors".into(), json!(errors));
        info.insert("time/sample".into(), json!(sample_s));
        Ok((pairs, refs, info))
    }

    async fn reference_logp(&self, p: &PrefPair, completion: &[u32]) -> Result<f64> {
        let mut tokens = p.prompt.clone();
        tokens.extend_from_slice(completion);
        let lp = self
            .trainer
            .compute_logprobs(&self.reference, tokens, 1.0)
            .await?;
        Ok(lp[p.prompt.len() - 1..].iter().map(|&x| x as f64).sum())
    }
}

/// A group's pair: the highest-reward single-turn completion chosen, the
/// lowest rejected; `None` on a tie, an error, or a multi-turn episode.
fn pair_of(g: &crate::sampled::Group) -> Option<PrefPair> {
    let mut scored = Vec::new();
    for (r, s) in g.rollouts.iter().zip(&g.scores) {
        if r.error.is_some() || s.error.is_some() || r.model_turns.len() != 1 {
            continue;
        }
        let t = r.model_turns[0].trace.as_ref()?;
        if t.completion_ids.is_empty() || t.prompt_ids.is_empty() {
            continue;
        }
        scored.push((s.reward, t));
    }
    let best = scored.iter().max_by(|a, b| a.0.total_cmp(&b.0))?;
    let worst = scored.iter().min_by(|a, b| a.0.total_cmp(&b.0))?;
    if best.0 <= worst.0 || best.1.prompt_ids != worst.1.prompt_ids {
        return None;
    }
    Some(PrefPair {
        prompt: best.1.prompt_ids.clone(),
        chosen: best.1.completion_ids.clone(),
        rejected: worst.1.completion_ids.clone(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sampled::Group;
    use temper_env::{Message, ModelTurn, Rollout, Row, Score, TokenTrace, Usage};

    fn rollout(completion: &[u32], turns: usize) -> Rollout {
        let turn = ModelTurn {
            message: Message::assistant("x"),
            finish_reason: "stop".into(),
            usage: Usage::default(),
            trace: Some(TokenTrace {
                prompt_ids: vec![1, 2],
                completion_ids: completion.to_vec(),
                logprobs: vec![-1.0; completion.len()],
                version: 0,
                temperature: 1.0,
            }),
        };
        Rollout {
            model_turns: vec![turn; turns],
            ..Rollout::default()
        }
    }

    fn group(rewards: &[f64], turns: usize) -> Group {
        Group {
            env: 0,
            row: Row {
                example_id: 0,
                prompt: vec![Message::user("q")],
                answer: None,
                info: serde_json::Value::Null,
            },
            rollouts: (0..rewards.len())
                .map(|i| rollout(&[10 + i as u32], turns))
                .collect(),
            scores: rewards
                .iter()
                .map(|&reward| Score {
                    reward,
                    ..Score::default()
                })
                .collect(),
            version: 0,
        }
    }

    #[test]
    fn the_best_and_worst_rollouts_pair_up_and_ties_and_episodes_are_skipped() {
        let p = pair_of(&group(&[0.5, 1.0, 0.0, 0.5], 1)).unwrap();
        assert_eq!(p.prompt, vec![1, 2]);
        assert_eq!(p.chosen, vec![11], "reward 1.0");
        assert_eq!(p.rejected, vec![12], "reward 0.0");
        assert!(pair_of(&group(&[0.5, 0.5, 0.5], 1)).is_none(), "a tie");
        assert!(pair_of(&group(&[0.0, 1.0], 2)).is_none(), "multi-turn");
        // A rollout that failed to score is no evidence either way.
        let mut g = group(&[0.0, 1.0, 0.5], 1);
        g.scores[0].error = Some("sandbox down".into());
        assert_eq!(pair_of(&g).unwrap().rejected, vec![12]);
    }
}
