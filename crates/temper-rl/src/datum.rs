//! From scored groups to training data: each rollout with a non-zero
//! advantage becomes training sequences — tokens exactly as sampled, the
//! sampler's logprobs, and the advantage spread over the model's tokens.
//!
//! A multi-turn episode is ONE sequence when every turn's prompt extends the
//! previous turn's prompt + completion token for token (the chat template
//! did not rewrite history): the model's completions are trained, the
//! environment's tokens between them are context only (advantage 0). The
//! loss and gradients equal those of the per-turn form (causal attention
//! sees the same prefix at every trained token), while the shared history
//! is processed once instead of once per turn. When a template rewrites
//! history the prefix check fails, and the episode falls back to one
//! sequence per turn and is counted (`multi_turn/fallbacks`).
//!
//! A turn whose [`TokenTrace`] is missing or inconsistent is counted
//! (`skipped_turns`) and left out; it is never filled in with zeros.

use temper_engine::{Datum, LossInputs};
use temper_env::TokenTrace;

use crate::sampled::Group;

/// Tokens of a [`TrainSeq`] that were sampled by the model: trained on.
#[derive(Debug, Clone, PartialEq)]
pub struct Span {
    /// Position of the first sampled token in the sequence (>= 1: there is
    /// always a prompt to condition on).
    pub start: usize,
    /// The sampler's logprob of each sampled token.
    pub logprobs: Vec<f32>,
    /// Policy version that sampled them.
    pub version: u64,
}

impl Span {
    /// The datum positions (targets) of its tokens: target `i` predicts
    /// token `i + 1`.
    pub fn targets(&self) -> std::ops::Range<usize> {
        self.start - 1..self.start - 1 + self.logprobs.len()
    }
}

/// One training sequence (one datum): a single turn, or a whole multi-turn
/// episode. Only [`TrainTurns::of`] makes one, so its traces are checked.
#[derive(Debug, Clone, PartialEq)]
pub struct TrainSeq {
    tokens: Vec<u32>,
    spans: Vec<Span>,
    advantage: f64,
    temperature: f64,
}

impl TrainSeq {
    /// A single checked turn.
    fn of_turn(t: &TokenTrace, advantage: f64) -> Self {
        let mut tokens = t.prompt_ids.clone();
        tokens.extend_from_slice(&t.completion_ids);
        Self {
            tokens,
            spans: vec![Span {
                start: t.prompt_ids.len(),
                logprobs: t.logprobs.clone(),
                version: t.version,
            }],
            advantage,
            temperature: t.scoring_temperature(),
        }
    }

    /// The turns of one episode as one sequence, when each turn's prompt
    /// extends the previous turn's prompt + completion and every turn was
    /// sampled at one temperature; `None` otherwise.
    fn of_episode(traces: &[&TokenTrace], advantage: f64) -> Option<Self> {
        let (first, last) = (traces.first()?, traces.last()?);
        let temperature = first.scoring_temperature();
        for pair in traces.windows(2) {
            let (prev, next) = (pair[0], pair[1]);
            let p = prev.prompt_ids.len();
            let extends = next.prompt_ids.len() >= p + prev.completion_ids.len()
                && next.prompt_ids[..p] == prev.prompt_ids[..]
                && next.prompt_ids[p..p + prev.completion_ids.len()] == prev.completion_ids[..];
            if !extends || next.scoring_temperature() != temperature {
                return None;
            }
        }
        let mut tokens = last.prompt_ids.clone();
        tokens.extend_from_slice(&last.completion_ids);
        let spans = traces
            .iter()
            .filter(|t| !t.completion_ids.is_empty())
            .map(|t| Span {
                start: t.prompt_ids.len(),
                logprobs: t.logprobs.clone(),
                version: t.version,
            })
            .collect();
        Some(Self {
            tokens,
            spans,
            advantage,
            temperature,
        })
    }

    /// All its tokens, as sampled.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    /// The model's tokens in it (the rest is prompt or environment).
    pub fn spans(&self) -> &[Span] {
        &self.spans
    }

    /// Its rollout's advantage.
    pub fn advantage(&self) -> f64 {
        self.advantage
    }

    /// Model tokens to train on.
    pub fn completion_tokens(&self) -> usize {
        self.spans.iter().map(|s| s.logprobs.len()).sum()
    }

    /// The temperature its tokens were sampled (and are scored) at.
    pub fn temperature(&self) -> f64 {
        self.temperature
    }

    /// The datum: inputs are every token but the last, targets every token
    /// but the first; the model's targets carry the sampler's logprob and
    /// the advantage `advantage(target, sampler logprob)`, the others zeros
    /// (no loss).
    fn datum(&self, advantage: impl Fn(usize, f32) -> f32) -> Datum {
        let n = self.tokens.len();
        let mut advantages_t = vec![0.0f32; n - 1];
        let mut logprobs_t = vec![0.0f32; n - 1];
        for span in &self.spans {
            for (i, &q) in span.targets().zip(&span.logprobs) {
                advantages_t[i] = advantage(i, q);
                logprobs_t[i] = q;
            }
        }
        Datum {
            model_input: self.tokens[..n - 1].to_vec(),
            loss_fn_inputs: LossInputs {
                target_tokens: self.tokens[1..].to_vec(),
                weights: None,
                logprobs: Some(logprobs_t),
                advantages: Some(advantages_t),
                sequence_ratio_mask: None,
                // Score at the temperature the sampler drew at.
                temperature: Some(self.temperature),
            },
        }
    }
}

/// The sequences of a batch to train on, and what was left out.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TrainTurns {
    seqs_d: Vec<TrainSeq>,
    /// Groups whose advantages were all zero (nothing to learn).
    pub zero_advantage_groups: u64,
    /// Turns without a usable trace.
    pub skipped_turns: u64,
    /// Multi-turn episodes trained as one sequence.
    pub multi_turn_merged: u64,
    /// Multi-turn episodes whose turns did not extend each other (the chat
    /// template rewrote history), trained turn by turn.
    pub multi_turn_fallbacks: u64,
}

impl TrainTurns {
    /// The sequences of `groups_g` with their advantages `advantages_g[g][r]`:
    /// one per episode where the turns extend each other, else one per
    /// turn. Rollouts that ended in an error are not trained on.
    pub fn of(groups_g: &[Group], advantages_g: &[Vec<f64>]) -> Self {
        Self::build(groups_g, advantages_g, true, true)
    }

    /// Like [`of`](Self::of), but always one sequence per turn (the form a
    /// merged episode must train identically to).
    pub fn per_turn(groups_g: &[Group], advantages_g: &[Vec<f64>]) -> Self {
        Self::build(groups_g, advantages_g, false, true)
    }

    /// Like [`of`](Self::of), but groups with all-equal rewards are kept:
    /// in distillation every sampled token has a teacher to learn from.
    pub fn of_all(groups_g: &[Group], advantages_g: &[Vec<f64>]) -> Self {
        Self::build(groups_g, advantages_g, true, false)
    }

    fn build(groups_g: &[Group], advantages_g: &[Vec<f64>], merge: bool, skip_equal: bool) -> Self {
        let mut out = TrainTurns::default();
        for (g, advantages_r) in groups_g.iter().zip(advantages_g) {
            let all_zero = advantages_r.iter().all(|a| *a == 0.0);
            out.zero_advantage_groups += u64::from(all_zero);
            if skip_equal && all_zero {
                continue;
            }
            for (r, &advantage) in g.rollouts.iter().zip(advantages_r) {
                if r.error.is_some() {
                    continue;
                }
                let mut traces = Vec::with_capacity(r.model_turns.len());
                for turn in &r.model_turns {
                    match turn.trainable_trace() {
                        Ok(trace) => traces.push(trace),
                        Err(e) => {
                            tracing::debug!("turn not trained: {e}");
                            out.skipped_turns += 1;
                        }
                    }
                }
                // An empty completion has nothing to train.
                let trained = traces
                    .iter()
                    .filter(|t| !t.completion_ids.is_empty())
                    .count();
                if merge && trained > 1 {
                    if let Some(seq) = TrainSeq::of_episode(&traces, advantage) {
                        out.multi_turn_merged += 1;
                        out.seqs_d.push(seq);
                        continue;
                    }
                    out.multi_turn_fallbacks += 1;
                }
                for trace in traces.iter().filter(|t| !t.completion_ids.is_empty()) {
                    out.seqs_d.push(TrainSeq::of_turn(trace, advantage));
                }
            }
        }
        out
    }

    /// The sequences to train on, one per datum, in batch order.
    pub fn seqs_d(&self) -> &[TrainSeq] {
        &self.seqs_d
    }

    /// Model (completion) tokens to train on.
    pub fn tokens(&self) -> usize {
        self.seqs_d.iter().map(TrainSeq::completion_tokens).sum()
    }

    /// Tokens the trainer processes: the datums' input lengths.
    pub fn input_tokens(&self) -> usize {
        self.seqs_d.iter().map(|s| s.tokens.len() - 1).sum()
    }

    /// The datums, one per sequence. Token-level normalisation: every
    /// trained token weighs 1/N over the N model tokens of the batch,
    /// however the turns are grouped into sequences.
    pub fn datums(&self) -> Vec<Datum> {
        let n_tokens = self.tokens().max(1) as f64;
        self.seqs_d
            .iter()
            .map(|s| {
                let scale = (s.advantage / n_tokens) as f32;
                s.datum(|_, _| scale)
            })
            .collect()
    }

    /// The datums of on-policy distillation. `teacher_d[d]` holds the
    /// teacher's logprobs of `seqs_d()[d].tokens()[1..]` (what
    /// [`Teacher::score`](crate::teacher::Teacher::score) returns); each
    /// sampled token's advantage is `kl_coef · (logp_teacher −
    /// logp_student) + reward_coef · (its rollout's reward advantage)`,
    /// with `logp_student` the sampler's logprob, normalised over the
    /// batch's tokens as in [`datums`](Self::datums). Also returns the
    /// per-token reverse KL it measured.
    pub fn distill_datums(
        &self,
        teacher_d: &[Vec<f32>],
        kl_coef: f64,
        reward_coef: f64,
    ) -> Result<(Vec<Datum>, ReverseKl), String> {
        if teacher_d.len() != self.seqs_d.len() {
            return Err(format!(
                "the teacher scored {} sequences of {}",
                teacher_d.len(),
                self.seqs_d.len()
            ));
        }
        let n_tokens = self.tokens().max(1) as f64;
        let mut kl = ReverseKl::default();
        let mut datums_d = Vec::with_capacity(self.seqs_d.len());
        for (s, teacher_t) in self.seqs_d.iter().zip(teacher_d) {
            if teacher_t.len() + 1 != s.tokens.len() {
                return Err(format!(
                    "the teacher returned {} logprobs for a sequence of {} tokens",
                    teacher_t.len(),
                    s.tokens.len()
                ));
            }
            for span in &s.spans {
                for (i, &q) in span.targets().zip(&span.logprobs) {
                    let t = f64::from(teacher_t[i]);
                    kl.sum += f64::from(q) - t;
                    kl.teacher_sum += t;
                    kl.tokens += 1;
                }
            }
            let reward = reward_coef * s.advantage;
            datums_d.push(s.datum(|i, q| {
                let a = kl_coef * (f64::from(teacher_t[i]) - f64::from(q)) + reward;
                (a / n_tokens) as f32
            }));
        }
        Ok((datums_d, kl))
    }
}

/// The reverse KL to the teacher measured on a batch's sampled tokens: per
/// token, `logp_student − logp_teacher` (its expectation under the student
/// is KL(student ‖ teacher)).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct ReverseKl {
    /// Sum over the tokens of `logp_student − logp_teacher`.
    pub sum: f64,
    /// Sum of the teacher's logprobs of the tokens.
    pub teacher_sum: f64,
    /// Tokens measured.
    pub tokens: usize,
}

#[cfg(test)]
mod tests {
    use super::*;
    use temper_env::{Message, ModelTurn, Rollout, Row, Score};

    fn turn(prompt_ids: Vec<u32>, completion_ids: Vec<u32>) -> ModelTurn {
        let logprobs = completion_ids.iter().map(|&t| -(t as f32) / 10.0).collect();
        ModelTurn {
            message: Message::assistant("x"),
            finish_reason: "stop".into(),
            usage: Default::default(),
            trace: Some(TokenTrace {
                prompt_ids,
                completion_ids,
                logprobs,
                version: 0,
                temperature: 1.0,
            }),
        }
    }

    fn group(turns: Vec<ModelTurn>) -> Vec<Group> {
        let rollout = Rollout {
            model_turns: turns,
            ..Default::default()
        };
        let score = |reward| Score {
            reward,
            ..Default::default()
        };
        vec![Group {
            env: 0,
            row: Row {
                example_id: 0,
                prompt: vec![],
                answer: None,
                info: Default::default(),
            },
            rollouts: vec![rollout.clone(), Rollout::default()],
            scores: vec![score(1.0), score(0.0)],
            version: 0,
        }]
    }

    /// Three turns whose prompts extend each other: prompt [1 2], model
    /// [3 4], env [5], model [6], env [7 8], model [9].
    fn extending() -> Vec<ModelTurn> {
        vec![
            turn(vec![1, 2], vec![3, 4]),
            turn(vec![1, 2, 3, 4, 5], vec![6]),
            turn(vec![1, 2, 3, 4, 5, 6, 7, 8], vec![9]),
        ]
    }

    #[test]
    fn an_episode_whose_turns_extend_each_other_is_one_sequence() {
        let groups_g = group(extending());
        let advantages_g = vec![vec![0.5, -0.5]];
        let merged = TrainTurns::of(&groups_g, &advantages_g);
        assert_eq!(merged.seqs_d().len(), 1);
        assert_eq!(
            (merged.multi_turn_merged, merged.multi_turn_fallbacks),
            (1, 0)
        );
        let d = &merged.datums()[0];
        assert_eq!(d.model_input, vec![1, 2, 3, 4, 5, 6, 7, 8]);
        let inputs = &d.loss_fn_inputs;
        assert_eq!(inputs.target_tokens, vec![2, 3, 4, 5, 6, 7, 8, 9]);
        // The model's tokens (3 4, 6, 9) carry the advantage over N = 4
        // trained tokens and their logprobs; the environment's carry zeros.
        let a = 0.5 / 4.0;
        assert_eq!(
            inputs.advantages,
            Some(vec![0.0, a, a, 0.0, a, 0.0, 0.0, a])
        );
        assert_eq!(
            inputs.logprobs,
            Some(vec![0.0, -0.3, -0.4, 0.0, -0.6, 0.0, 0.0, -0.9])
        );
        // Same trained tokens as turn by turn, fewer processed: 8 vs 2+6+9-3.
        let per_turn = TrainTurns::per_turn(&groups_g, &advantages_g);
        assert_eq!(per_turn.seqs_d().len(), 3);
        assert_eq!(merged.tokens(), per_turn.tokens());
        assert_eq!(
            (merged.input_tokens(), per_turn.input_tokens()),
            (8, 3 + 5 + 8)
        );
    }

    #[test]
    fn a_template_that_rewrites_history_falls_back_to_turns_and_is_counted() {
        let mut turns = extending();
        // The template re-rendered turn 1's answer differently (4 → 40).
        if let Some(t) = turns[2].trace.as_mut() {
            t.prompt_ids = vec![1, 2, 3, 40, 5, 6, 7, 8];
        }
        let groups_g = group(turns);
        let out = TrainTurns::of(&groups_g, &[vec![0.5, -0.5]]);
        assert_eq!((out.multi_turn_merged, out.multi_turn_fallbacks), (0, 1));
        assert_eq!(out.seqs_d().len(), 3);
        assert_eq!(out.tokens(), 4);
        // A turn sampled at another temperature cannot share a datum either.
        let mut turns = extending();
        if let Some(t) = turns[1].trace.as_mut() {
            t.temperature = 0.7;
        }
        let out = TrainTurns::of(&group(turns), &[vec![0.5, -0.5]]);
        assert_eq!((out.multi_turn_merged, out.multi_turn_fallbacks), (0, 1));
    }
}
