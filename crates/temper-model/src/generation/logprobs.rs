//! The training forward: per-token logprobs of target tokens (and entropy)
//! for a batch of sequences, differentiable w.r.t. LoRA or all weights.
//!
//! # Why sampler and trainer agree exactly
//! A sequence is scored as one segment of [`Model::forward_hidden`] with
//! input `tokens[..n-1]` and targets `tokens[1..]`. On the CPU in f32 every
//! kernel on that path is batch-invariant (`docs/kernels.md`): a token's bits
//! do not depend on the other rows of the call, its row's place, the thread
//! count, or whether it came from a full pass, a prefill chunk or a decode
//! step. So the sampler and the server take logprobs straight from their
//! decode logits ([`Model::decode_logits_are_exact`]) and they equal this
//! function's bit for bit. Where the forward is not invariant (a GPU, bf16,
//! `TEMPER_MATMUL=candle`, a trainable LM head) results move by ~1e-6 with the
//! shapes, so the canonical computation is this function on one sequence, and
//! the sampler and server re-score each finished sequence with it.

use candle_core::{DType, Tensor, D};

use crate::arch::model::{log_softmax_last, Model, Segment};
use crate::error::{ModelError, Result};
use crate::kernels::PackedSeq;
use crate::kernels::{
    fused_attention_supported, fused_lm_head_supported, lm_head_logprobs, use_matmul_nt,
};
use crate::lora::LoraAdapter;

/// Rows of `[len, vocab]` logits materialised at a time.
pub const SCORE_CHUNK: usize = 512;

/// Per-position outputs of the training forward.
#[derive(Debug, Clone)]
pub struct TokenScores {
    /// `[len]` f32: `log softmax(logits / temperature)[target]`; part of the graph.
    pub logprobs: Tensor,
    /// `[len]` f32: entropy of `softmax(logits / temperature)`; part of the graph.
    pub entropy: Tensor,
}

/// One sequence to score: `targets[i]` is the token that follows `input[..=i]`.
#[derive(Debug, Clone, Copy)]
pub struct ScoreInput<'a> {
    /// Model input tokens.
    pub input: &'a [u32],
    /// Target tokens, same length as `input`.
    pub targets: &'a [u32],
}

impl Model {
    /// Whether a decode step's logits ([`Model::forward_hidden`] or
    /// [`Model::forward_decode`], then [`Model::logits`]) are bit-identical
    /// to the training forward's for the same token: every kernel on the
    /// path is batch-invariant (the CPU in f32 with the batch-invariant
    /// matmul). Then logprobs taken from decode logits with
    /// [`crate::kernels::row_logprob`] / [`crate::kernels::row_log_softmax`]
    /// equal [`Model::score`]'s, and no re-scoring pass is needed.
    pub fn decode_logits_are_exact(&self) -> Result<bool> {
        let probe = Tensor::zeros((1, 1), self.dtype(), self.device())?;
        let head = self.head_weight();
        Ok(fused_lm_head_supported(&probe, head)
            && fused_attention_supported(&probe)
            && use_matmul_nt(&probe, head))
    }

    /// Logprobs and entropy of `targets` after each prefix of `input`
    /// (temperature-scaled: logits are divided by `temperature` first; pass
    /// 1.0 for the plain model distribution).
    pub fn score(
        &self,
        input: &[u32],
        targets: &[u32],
        lora: Option<&LoraAdapter>,
        temperature: f64,
    ) -> Result<TokenScores> {
        if input.len() != targets.len() || input.is_empty() {
            return Err(ModelError::InvalidInput(format!(
                "score: {} input tokens and {} targets (must be equal and non-zero)",
                input.len(),
                targets.len()
            )));
        }
        check_temperature(temperature)?;
        let vocab = self.config().vocab_size;
        if let Some(&bad) = targets.iter().find(|&&t| t as usize >= vocab) {
            return Err(ModelError::InvalidInput(format!(
                "target token {bad} out of range for vocabulary size {vocab}"
            )));
        }
        let mut segs = [Segment {
            len: input.len(),
            cache: None,
        }];
        let hidden = self.forward_hidden(input, &mut segs, lora)?;
        let head = self.head_weight();
        if fused_lm_head_supported(&hidden, head) {
            // The LM head, log-softmax, gather and entropy in one op that
            // never keeps `[len, vocab]` logits (see `kernels`).
            let (logprobs, entropy) =
                lm_head_logprobs(&hidden, head, targets, temperature, self.head_packed())?;
            return Ok(TokenScores { logprobs, entropy });
        }
        // `[len, vocab]` logits are the largest tensor of a step (151k-token
        // vocabularies); work through them in fixed row chunks. The chunking
        // depends only on the sequence, so it is part of the canonical
        // computation and sampler and trainer still agree bit for bit.
        let mut logprobs = Vec::new();
        let mut entropy = Vec::new();
        let mut start = 0;
        while start < input.len() {
            let len = SCORE_CHUNK.min(input.len() - start);
            let mut logits = self
                .logits(&hidden.narrow(0, start, len)?)?
                .to_dtype(DType::F32)?;
            if temperature != 1.0 {
                logits = logits.affine(1.0 / temperature, 0.0)?;
            }
            let lp = log_softmax_last(&logits)?;
            let idx = Tensor::new(&targets[start..start + len], self.device())?.unsqueeze(1)?;
            logprobs.push(lp.gather(&idx, 1)?.squeeze(1)?);
            entropy.push((lp.exp()? * &lp)?.sum(D::Minus1)?.neg()?);
            start += len;
        }
        let join = |mut parts: Vec<Tensor>| -> Result<Tensor> {
            if parts.len() == 1 {
                Ok(parts.swap_remove(0))
            } else {
                Ok(Tensor::cat(&parts, 0)?)
            }
        };
        Ok(TokenScores {
            logprobs: join(logprobs)?,
            entropy: join(entropy)?,
        })
    }

    /// [`Model::score`] for every sequence of a batch, as one packed
    /// forward when the forward is batch-invariant
    /// ([`Model::decode_logits_are_exact`]): the sequences' tokens run through
    /// every layer together (one graph, weights read once, matmuls over all
    /// rows) and each sequence's numbers are bit-identical to scoring it
    /// alone. Consecutive sequences that share a prefix of at least
    /// [`MIN_SHARED_PREFIX`] positions (an RL group's completions of one
    /// prompt) run it once ([`Model::forward_packed`]); their numbers are still
    /// those of scoring each alone, and the prefix rows' gradients sum
    /// theirs. Elsewhere each sequence is scored on its own, so its numbers
    /// still do not depend on what else is in the batch. Activation memory
    /// grows with the batch's rows: see [`pack_batch`].
    pub fn score_batch(
        &self,
        batch: &[ScoreInput<'_>],
        lora: Option<&LoraAdapter>,
        temperature: f64,
    ) -> Result<Vec<TokenScores>> {
        if batch.len() <= 1 || !self.decode_logits_are_exact()? {
            return batch
                .iter()
                .map(|s| self.score(s.input, s.targets, lora, temperature))
                .collect();
        }
        check_temperature(temperature)?;
        let vocab = self.config().vocab_size;
        for (i, s) in batch.iter().enumerate() {
            if s.input.len() != s.targets.len() || s.input.is_empty() {
                return Err(ModelError::InvalidInput(format!(
                    "score: sequence {i} has {} input tokens and {} targets (must be equal and non-zero)",
                    s.input.len(),
                    s.targets.len()
                )));
            }
            if let Some(&bad) = s.targets.iter().find(|&&t| t as usize >= vocab) {
                return Err(ModelError::InvalidInput(format!(
                    "target token {bad} out of range for vocabulary size {vocab}"
                )));
            }
        }
        let (ids, targets, seqs, rows) = shared_layout(batch);
        let hidden = self.forward_packed(&ids, &seqs, lora)?;
        let (logprobs, entropy) = lm_head_logprobs(
            &hidden,
            self.head_weight(),
            &targets,
            temperature,
            self.head_packed(),
        )?;
        let pick = |t: &Tensor, parts: &[(usize, usize)]| -> Result<Tensor> {
            let mut pieces = Vec::with_capacity(parts.len());
            for &(start, len) in parts {
                pieces.push(t.narrow(0, start, len)?);
            }
            Ok(if pieces.len() == 1 {
                pieces.swap_remove(0)
            } else {
                Tensor::cat(&pieces, 0)?
            })
        };
        rows.iter()
            .map(|parts| {
                Ok(TokenScores {
                    logprobs: pick(&logprobs, parts)?,
                    entropy: pick(&entropy, parts)?,
                })
            })
            .collect()
    }
}

/// The shortest prefix that consecutive sequences of a batch must share for
/// [`Model::score_batch`] to run it once for all of them.
pub const MIN_SHARED_PREFIX: usize = 8;

/// Positions `a` and `b` share from the start: input and target both equal.
fn shared_positions(a: &ScoreInput<'_>, b: &ScoreInput<'_>) -> usize {
    a.input
        .iter()
        .zip(a.targets)
        .zip(b.input.iter().zip(b.targets))
        .take_while(|(x, y)| x == y)
        .count()
}

/// Runs of consecutive sequences that share a prefix (an RL group: one
/// prompt, several completions), with the positions they share (0: none,
/// a run of one). Each sequence keeps at least one position of its own. A
/// run ends where the next sequence shares fewer than [`MIN_SHARED_PREFIX`]
/// positions with its first, or less than half of what the run shares so
/// far (the next prompt, after a common system prompt).
fn prefix_runs(batch: &[ScoreInput<'_>]) -> Vec<(std::ops::Range<usize>, usize)> {
    let mut runs = Vec::new();
    let mut i = 0;
    while i < batch.len() {
        let mut j = i + 1;
        let mut shared = usize::MAX;
        while j < batch.len() {
            let own = |s: &ScoreInput<'_>| s.input.len().saturating_sub(1);
            let next = shared
                .min(shared_positions(&batch[i], &batch[j]))
                .min(own(&batch[i]))
                .min(own(&batch[j]));
            if next < MIN_SHARED_PREFIX || (shared != usize::MAX && next < shared / 2) {
                break;
            }
            shared = next;
            j += 1;
        }
        runs.push((i..j, if j > i + 1 { shared } else { 0 }));
        i = j;
    }
    runs
}

/// What `batch` costs against [`pack_batch`]'s budget: the rows
/// [`Model::score_batch`] runs for it (a shared prefix once), less its
/// longest shared prefix. Counting that prefix would split an RL group with
/// a long prompt over several packs and run the prompt once per pack; not
/// counting the others keeps a pack's rows within the budget plus one
/// prompt.
fn pack_cost(batch: &[ScoreInput<'_>]) -> usize {
    let runs = prefix_runs(batch);
    let rows: usize = runs
        .iter()
        .map(|(r, shared)| {
            shared
                + batch[r.clone()]
                    .iter()
                    .map(|s| s.input.len() - shared)
                    .sum::<usize>()
        })
        .sum();
    rows - runs.iter().map(|r| r.1).max().unwrap_or(0)
}

/// The packed forward of a batch: ids, targets, sequences (a run's shared
/// prefix first, then each of its sequences' own rows after it), and where
/// each input sequence's rows are, as (first row, rows) parts.
#[allow(clippy::type_complexity)]
fn shared_layout(
    batch: &[ScoreInput<'_>],
) -> (Vec<u32>, Vec<u32>, Vec<PackedSeq>, Vec<Vec<(usize, usize)>>) {
    let (mut ids, mut targets, mut seqs, mut rows) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    // Appends `s`'s positions from `from` as a sequence; returns its first
    // row and its index.
    let mut push = |s: &ScoreInput<'_>, from: usize, after: Option<usize>| {
        let at = ids.len();
        ids.extend_from_slice(&s.input[from..]);
        targets.extend_from_slice(&s.targets[from..]);
        seqs.push(PackedSeq {
            len: s.input.len() - from,
            after,
        });
        (at, seqs.len() - 1)
    };
    for (run, shared) in prefix_runs(batch) {
        if shared == 0 {
            for s in &batch[run] {
                let (at, _) = push(s, 0, None);
                rows.push(vec![(at, s.input.len())]);
            }
            continue;
        }
        let first = &batch[run.start];
        let prefix = ScoreInput {
            input: &first.input[..shared],
            targets: &first.targets[..shared],
        };
        let (p_at, p_index) = push(&prefix, 0, None);
        for s in &batch[run] {
            let (at, _) = push(s, shared, Some(p_index));
            rows.push(vec![(p_at, shared), (at, s.input.len() - shared)]);
        }
    }
    (ids, targets, seqs, rows)
}

/// Tokens per packed training forward ([`pack_batch`]). Measured on
/// SmolLM2 (LoRA r=16, 8×128 tokens, 2 threads, `temper bench model`):
/// packs of 128 / 256 / 512 / 1,024 tokens train at 174 / 190 / 185 / 158
/// tokens/s in f32 (252 / 269 / 266 / 236 in bf16), with peak RSS 754 /
/// 903 / 1,200 / 1,775 MB: past 256 rows a layer's activations no longer
/// stay in cache and the allocator maps and faults in fresh pages.
pub const PACK_TOKENS: usize = 256;

/// Split a batch into consecutive packs for [`Model::score_batch`], each
/// of at most `max_tokens` rows beside its longest shared prefix (a prefix
/// that consecutive sequences share runs once; a sequence over the budget
/// is a pack of its own). Returns index ranges into `batch`.
pub fn pack_batch(batch: &[ScoreInput<'_>], max_tokens: usize) -> Vec<std::ops::Range<usize>> {
    let mut packs = Vec::new();
    let mut start = 0;
    while start < batch.len() {
        let mut end = start + 1;
        while end < batch.len() && pack_cost(&batch[start..end + 1]) <= max_tokens {
            end += 1;
        }
        packs.push(start..end);
        start = end;
    }
    packs
}

fn check_temperature(temperature: f64) -> Result<()> {
    if temperature > 0.0 && temperature.is_finite() {
        Ok(())
    } else {
        Err(ModelError::InvalidInput(format!(
            "score: temperature must be > 0, got {temperature}"
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Sequences of the given token lists (targets: the tokens shifted).
    fn batch(seqs: &[Vec<u32>]) -> Vec<(Vec<u32>, Vec<u32>)> {
        seqs.iter()
            .map(|s| (s[..s.len() - 1].to_vec(), s[1..].to_vec()))
            .collect()
    }

    fn inputs(b: &[(Vec<u32>, Vec<u32>)]) -> Vec<ScoreInput<'_>> {
        b.iter()
            .map(|(i, t)| ScoreInput {
                input: i,
                targets: t,
            })
            .collect()
    }

    fn distinct(len: usize, seed: u32) -> Vec<u32> {
        (0..len as u32).map(|i| 1000 * seed + i).collect()
    }

    #[test]
    fn packs_are_consecutive_and_within_the_budget() {
        let b = batch(&[distinct(5, 1), distinct(5, 2), distinct(5, 3)]);
        assert!(pack_batch(&[], 10).is_empty());
        assert_eq!(pack_batch(&inputs(&b), 10), vec![0..2, 2..3]);
        let b = batch(&[distinct(5, 1), distinct(7, 2), distinct(2, 3)]);
        assert_eq!(pack_batch(&inputs(&b), 10), vec![0..2, 2..3]);
        // A sequence over the budget is a pack of its own.
        let b = batch(&[distinct(4, 1), distinct(21, 2), distinct(4, 3)]);
        assert_eq!(pack_batch(&inputs(&b), 10), vec![0..1, 1..2, 2..3]);
    }

    #[test]
    fn a_packs_longest_shared_prefix_does_not_count_against_the_budget() {
        // Three completions of one 20-token prompt: the 19 positions whose
        // input and target lie in the prompt run once, and the pack's cost
        // is the 3 × 7 rows after them (not 3 × 26 = 78); then an unrelated
        // sequence.
        let prompt = distinct(20, 1);
        let with = |tail: &[u32]| [prompt.clone(), tail.to_vec()].concat();
        let b = batch(&[
            with(&[1, 2, 3, 4, 5, 6, 7]),
            with(&[1, 2, 9, 9, 9, 9, 9]),
            with(&[8, 8, 8, 8, 8, 8, 8]),
            distinct(11, 2),
        ]);
        let b = inputs(&b);
        assert_eq!(prefix_runs(&b), vec![(0..3, 19), (3..4, 0)]);
        assert_eq!(pack_cost(&b[..3]), 21);
        assert_eq!(pack_batch(&b, 21), vec![0..3, 3..4]);
        assert_eq!(pack_batch(&b, 20), vec![0..2, 2..3, 3..4]);
        // Only the longest shared prefix is free: two groups of two
        // completions after 20-token prompts cost 2 × 7 + 19 + 2 × 7.
        let other = distinct(20, 3);
        let with2 = |tail: &[u32]| [other.clone(), tail.to_vec()].concat();
        let two = batch(&[
            with(&[1, 2, 3, 4, 5, 6, 7]),
            with(&[8, 8, 8, 8, 8, 8, 8]),
            with2(&[1, 2, 3, 4, 5, 6, 7]),
            with2(&[8, 8, 8, 8, 8, 8, 8]),
        ]);
        let two = inputs(&two);
        assert_eq!(prefix_runs(&two), vec![(0..2, 19), (2..4, 19)]);
        assert_eq!(pack_cost(&two), 14 + 19 + 14);
        // Shared positions need equal targets too, and every sequence
        // keeps a position of its own.
        assert_eq!(shared_positions(&b[0], &b[1]), 21);
        let short = batch(&[prompt.clone(), with(&[5, 5])]);
        assert_eq!(prefix_runs(&inputs(&short)), vec![(0..2, 18)]);
        // A common start shorter than `MIN_SHARED_PREFIX` is not shared,
        // and a run ends where the next sequence shares less than half.
        let b = batch(&[distinct(12, 1), distinct(12, 2)]);
        assert_eq!(prefix_runs(&inputs(&b)), vec![(0..1, 0), (1..2, 0)]);
        let system = distinct(10, 3);
        let turn = |q: u32, a: u32| [system.clone(), distinct(12, q), vec![a; 3]].concat();
        let b = batch(&[turn(4, 1), turn(4, 2), turn(5, 1), turn(5, 2)]);
        assert_eq!(prefix_runs(&inputs(&b)), vec![(0..2, 21), (2..4, 21)]);
    }
}
