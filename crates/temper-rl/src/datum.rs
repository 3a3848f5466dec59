//! From scored groups to training data: each model turn of a rollout with a
//! non-zero advantage becomes one [`Datum`] — prompt and completion tokens
//! exactly as sampled, the sampler's logprobs, and the advantage spread
//! over the completion tokens.
//!
//! A turn whose [`TokenTrace`] is missing or inconsistent is counted
//! (`skipped_turns`) and left out; it is never filled in with zeros.

use temper_engine::{Datum, LossInputs};
use temper_env::TokenTrace;

use crate::rollout::Group;

/// One model turn to train on; only [`TrainTurns::of`] makes one, so its
/// trace is checked.
#[derive(Debug, Clone, PartialEq)]
pub struct TrainTurn {
    trace: TokenTrace,
    advantage: f64,
}

impl TrainTurn {
    /// Its tokens as sampled (checked: a non-empty prompt, a non-empty
    /// completion and one logprob per completion token).
    pub fn trace(&self) -> &TokenTrace {
        &self.trace
    }

    /// Its rollout's advantage.
    pub fn advantage(&self) -> f64 {
        self.advantage
    }
}

/// The turns of a batch to train on, and what was left out.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TrainTurns {
    turns_d: Vec<TrainTurn>,
    /// Groups whose advantages were all zero (nothing to learn).
    pub zero_advantage_groups: u64,
    /// Turns without a usable trace.
    pub skipped_turns: u64,
}

impl TrainTurns {
    /// The turns of `groups_g` with their advantages `advantages_g[g][r]`.
    /// Rollouts that ended in an error are not trained on.
    pub fn of(groups_g: &[Group], advantages_g: &[Vec<f64>]) -> Self {
        let mut out = TrainTurns::default();
        for (g, advantages_r) in groups_g.iter().zip(advantages_g) {
            if advantages_r.iter().all(|a| *a == 0.0) {
                out.zero_advantage_groups += 1;
                continue;
            }
            for (r, &advantage) in g.rollouts.iter().zip(advantages_r) {
                if r.error.is_some() {
                    continue;
                }
                for turn in &r.model_turns {
                    match turn.trainable_trace() {
                        // An empty completion has nothing to train.
                        Ok(trace) if trace.completion_ids.is_empty() => {}
                        Ok(trace) => out.turns_d.push(TrainTurn {
                            trace: trace.clone(),
                            advantage,
                        }),
                        Err(e) => {
                            tracing::debug!("turn not trained: {e}");
                            out.skipped_turns += 1;
                        }
                    }
                }
            }
        }
        out
    }

    /// The turns to train on, one per datum, in batch order.
    pub fn turns_d(&self) -> &[TrainTurn] {
        &self.turns_d
    }

    /// Completion tokens to train on.
    pub fn tokens(&self) -> usize {
        self.turns_d
            .iter()
            .map(|t| t.trace.completion_ids.len())
            .sum()
    }

    /// The datums, one per turn. Token-level normalisation: every trained
    /// token weighs 1/N over the N completion tokens of the batch.
    pub fn datums(&self) -> Vec<Datum> {
        let n_tokens = self.tokens().max(1) as f64;
        self.turns_d
            .iter()
            .map(|t| datum(&t.trace, (t.advantage / n_tokens) as f32))
            .collect()
    }
}

/// The datum of one checked trace: inputs are every token but the last,
/// targets every token but the first; the completion's targets carry the
/// sampler's logprob and the advantage `scale`, the prompt's carry zeros
/// (no loss).
fn datum(t: &TokenTrace, scale: f32) -> Datum {
    let p = t.prompt_ids.len();
    let mut all_t = t.prompt_ids.clone();
    all_t.extend_from_slice(&t.completion_ids);
    let n = all_t.len();
    let mut advantages_t = vec![0.0f32; n - 1];
    let mut logprobs_t = vec![0.0f32; n - 1];
    // A checked trace has one logprob per completion token.
    for (i, &q) in t.logprobs.iter().enumerate() {
        advantages_t[p - 1 + i] = scale;
        logprobs_t[p - 1 + i] = q;
    }
    Datum {
        model_input: all_t[..n - 1].to_vec(),
        loss_fn_inputs: LossInputs {
            target_tokens: all_t[1..].to_vec(),
            weights: None,
            logprobs: Some(logprobs_t),
            advantages: Some(advantages_t),
            // Score at the temperature the sampler drew at.
            temperature: Some(t.scoring_temperature()),
        },
    }
}
