//! Sampling: which rows each step's groups prompt, and rolling each group
//! out against a published policy — inline (the synchronous loop) or in a
//! producer task that runs ahead of the trainer by at most
//! `max_off_policy_steps` policy versions.
//!
//! Randomness is derived from `(seed, step, group, rollout)` and rows from
//! the step, so a resumed run samples exactly what the uninterrupted run
//! would have.

use std::ops::Range;
use std::sync::Arc;
use std::time::Instant;

use temper_env::{Environment, Rollout, Row, SamplingArgs, Split};
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;

use crate::config::{AsyncSection, SamplingSection};
use crate::error::{Result, RlError};
use crate::plan::RlPlan;
use crate::policy::Batcher;
use crate::publish::Published;
use crate::sampled::{Batch, Group};

/// Everything sampling reads: the environments, their training rows and
/// the order they are mixed in.
pub struct RolloutPlan {
    sampling: SamplingSection,
    batch_size: usize,
    seed: u64,
    envs: Vec<Arc<dyn Environment>>,
    pools: Vec<Vec<Row>>,
    schedule: Vec<usize>,
    services: Vec<String>,
}

impl RolloutPlan {
    /// Load `cfg`'s environments and enough training rows of each for the
    /// run — off the async runtime: loading reads files, and an external
    /// environment starts a process and answers `rows` over a pipe.
    pub async fn load(cfg: &RlPlan) -> Result<Self> {
        let total_groups = (cfg.trainer.max_steps as usize) * cfg.trainer.batch_size;
        let total_weight = cfg.env.iter().map(|x| x.weight).sum::<f64>();
        let (seed, sections) = (cfg.seed, cfg.env.clone());
        let loaded = tokio::task::spawn_blocking(move || {
            sections
                .iter()
                .map(|e| {
                    let env = temper_tasks::loader()
                        .load(&e.id, &e.args)
                        .map_err(|err| RlError::Env(format!("{}: {err}", e.id)))?;
                    let share = (total_groups as f64 * e.weight / total_weight).ceil() as usize;
                    let rows = env
                        .rows(Split::Train, share.clamp(1, 100_000), seed)
                        .map_err(|err| RlError::Env(format!("{}: {err}", e.id)))?;
                    if rows.is_empty() {
                        return Err(RlError::Env(format!("{} has no training rows", e.id)));
                    }
                    Ok((env, rows))
                })
                .collect::<Result<Vec<_>>>()
        })
        .await
        .map_err(|source| RlError::Blocking {
            what: "loading the environments",
            source,
        })??;
        let (envs, pools): (Vec<Arc<dyn Environment>>, _) = loaded.into_iter().unzip();
        // Before the first rollout: a sandbox that is down or refuses the
        // key would otherwise train on all-zero rewards.
        let mut services = Vec::new();
        for (env, section) in envs.iter().zip(&cfg.env) {
            let checked = temper_env::check_services(env.as_ref())
                .await
                .map_err(|err| RlError::Env(format!("{}: {err}", section.id)))?;
            services.extend(checked);
        }
        let schedule = mixing_schedule(&cfg.env.iter().map(|e| e.weight).collect::<Vec<_>>())?;
        Ok(Self {
            sampling: cfg.sampling.clone(),
            batch_size: cfg.trainer.batch_size,
            seed: cfg.seed,
            envs,
            pools,
            schedule,
            services,
        })
    }

    /// Each environment's pass threshold, by index: `configured` (the
    /// run's `[eval] pass_threshold`) or the environment's own.
    pub fn pass_thresholds(&self, configured: Option<f64>) -> Vec<temper_env::PassThreshold> {
        self.envs
            .iter()
            .map(|e| temper_env::pass_threshold(configured, &**e))
            .collect()
    }

    /// The services the environments call, each checked when loaded.
    pub fn services(&self) -> &[String] {
        &self.services
    }

    /// The environments' ids, by index.
    pub fn env_ids(&self) -> Vec<String> {
        self.envs.iter().map(|e| e.id().to_string()).collect()
    }

    /// The groups of batch `step`: (env index, row).
    fn batch_rows(&self, step: u64) -> Vec<(usize, Row)> {
        let b = self.batch_size as u64;
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
            max_tokens: self.sampling.max_tokens,
            temperature: self.sampling.temperature,
            top_p: self.sampling.top_p,
            seed: Some(seed),
            min_p: (self.sampling.min_p > 0.0).then_some(self.sampling.min_p),
            stop_token_ids: self.sampling.stop_token_ids.clone(),
            ..Default::default()
        }
    }

    /// Roll out and score every group of batch `step` against `policy`.
    pub async fn sample_batch(
        &self,
        step: u64,
        policy: &Published,
        batcher: Option<&Batcher>,
    ) -> Batch {
        let t0 = Instant::now();
        let rows = self.batch_rows(step);
        let g_size = self.sampling.group_size;
        if let Some(b) = batcher {
            b.expect(rows.len() * g_size);
        }
        let groups_g = rows.into_iter().enumerate().map(|(g, (e, row))| {
            let env = self.envs[e].clone();
            let model = policy.model.clone();
            let fallback = policy.version;
            let args_r: Vec<SamplingArgs> = (0..g_size)
                .map(|k| self.sampling(mix(&[self.seed, step, g as u64, k as u64])))
                .collect();
            async move {
                let mut rollouts: Vec<Rollout> = futures::future::join_all(
                    args_r.iter().map(|a| env.rollout(model.as_ref(), &row, a)),
                )
                .await;
                let scoring_from = Instant::now();
                let scores = temper_env::score_and_time(env.as_ref(), &row, &mut rollouts).await;
                let scoring = (scoring_from, Instant::now());
                let version = rollouts
                    .iter()
                    .flat_map(|r| r.model_turns.iter())
                    .filter_map(|t| t.trace.as_ref())
                    .map(|t| t.version)
                    .min()
                    .unwrap_or(fallback);
                let group = Group {
                    env: e,
                    row,
                    rollouts,
                    scores,
                    version,
                };
                (group, scoring)
            }
        });
        let (groups_g, scoring): (Vec<Group>, Vec<(Instant, Instant)>) =
            futures::future::join_all(groups_g)
                .await
                .into_iter()
                .unzip();
        Batch {
            step,
            groups_g,
            generate_s: t0.elapsed().as_secs_f64(),
            reward_s: covered_s(scoring),
        }
    }
}

/// Seconds covered by the union of `spans`: the wall time during which at
/// least one of them was running.
pub(crate) fn covered_s(mut spans: Vec<(Instant, Instant)>) -> f64 {
    spans.sort();
    let mut total = 0.0;
    let mut current: Option<(Instant, Instant)> = None;
    for (a, b) in spans {
        current = match current {
            Some((s, e)) if a <= e => Some((s, e.max(b))),
            Some((s, e)) => {
                total += (e - s).as_secs_f64();
                Some((a, b))
            }
            None => Some((a, b)),
        };
    }
    if let Some((s, e)) = current {
        total += (e - s).as_secs_f64();
    }
    total
}

/// A seed from small integers (SplitMix64 over the parts).
pub(crate) fn mix(parts: &[u64]) -> u64 {
    let mut h: u64 = 0x243F_6A88_85A3_08D3;
    for &p in parts {
        h ^= p.wrapping_add(0x9E37_79B9_7F4A_7C15);
        h = (h ^ (h >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        h = (h ^ (h >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        h ^= h >> 31;
    }
    h
}

/// A deterministic interleaving of environments by weight (smooth weighted
/// round robin over a cycle of at most 100 slots).
fn mixing_schedule(weights: &[f64]) -> Result<Vec<usize>> {
    // The plan's own check, repeated for callers that bypass a plan.
    crate::plan::check_env_weights(weights)?;
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

/// Where the loop's batches come from.
pub enum Rollouts {
    /// Sampled when asked, from the newest published policy (the
    /// synchronous loop: generate, then train).
    Inline {
        /// The plan.
        plan: Arc<RolloutPlan>,
        /// The published policies.
        policies: watch::Receiver<Option<Published>>,
        /// The in-process sampler's batcher.
        batcher: Option<Batcher>,
    },
    /// Sampled ahead by a producer task: batch `j` starts once version
    /// `j − max_off_policy_steps` is published.
    Ahead {
        /// Batches in step order.
        batches: mpsc::Receiver<Batch>,
        /// The producer.
        producer: JoinHandle<()>,
    },
}

impl Rollouts {
    /// Start sampling the batches of `steps`.
    pub fn start(
        plan: Arc<RolloutPlan>,
        cfg: &AsyncSection,
        policies: watch::Receiver<Option<Published>>,
        batcher: Option<Batcher>,
        steps: Range<u64>,
    ) -> Self {
        if !cfg.enabled {
            return Rollouts::Inline {
                plan,
                policies,
                batcher,
            };
        }
        let max_off = cfg.max_off_policy_steps;
        let (tx, batches) = mpsc::channel::<Batch>(1 + max_off as usize);
        let mut policies = policies;
        let producer = tokio::spawn(async move {
            for j in steps {
                let need = j.saturating_sub(max_off);
                let policy = match policies
                    .wait_for(|p| p.as_ref().is_some_and(|p| p.version >= need))
                    .await
                {
                    Ok(p) => p.clone(),
                    Err(_) => return,
                };
                let Some(policy) = policy else { return };
                let batch = plan.sample_batch(j, &policy, batcher.as_ref()).await;
                if tx.send(batch).await.is_err() {
                    return;
                }
            }
        });
        Rollouts::Ahead { batches, producer }
    }

    /// The batch of `step`.
    pub async fn next(&mut self, step: u64) -> Result<Batch> {
        match self {
            Rollouts::Inline {
                plan,
                policies,
                batcher,
            } => {
                let policy = policies
                    .borrow()
                    .clone()
                    .ok_or_else(|| RlError::Sampler("no policy is published yet".into()))?;
                Ok(plan.sample_batch(step, &policy, batcher.as_ref()).await)
            }
            Rollouts::Ahead { batches, .. } => batches
                .recv()
                .await
                .ok_or_else(|| RlError::Sampler("the rollout producer stopped".into())),
        }
    }
}

impl Drop for Rollouts {
    fn drop(&mut self) {
        if let Rollouts::Ahead { producer, .. } = self {
            producer.abort();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn time_covered_counts_overlapping_spans_once() {
        use std::time::Duration;
        let t = Instant::now();
        let at = |ms: u64| t + Duration::from_millis(ms);
        // [0, 100) and [50, 150) overlap: 150 ms; [300, 400): 100 ms more.
        let spans = vec![(at(300), at(400)), (at(0), at(100)), (at(50), at(150))];
        assert!((covered_s(spans) - 0.25).abs() < 1e-9);
        assert_eq!(covered_s(Vec::new()), 0.0);
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
}
