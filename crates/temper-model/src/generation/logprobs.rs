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
            && use_matmul_nt(self.forward_matmul(), &probe, head))
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
            let (logprobs, entropy) = lm_head_logprobs(
                &hidden,
                head,
                targets,
                temperature,
                self.head_packed(),
                self.forward_matmul(),
            )?;
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
    /// prompt) run it once ([`Model::forward_packed`]), and so on down a tree
    /// of prefixes (a batch's common system prompt, then each DPO pair's
    /// prompt: see `shared_layout`); their numbers are still those of scoring
    /// each alone, and the prefix rows' gradients sum theirs. Elsewhere each
    /// sequence is scored on its own, so its numbers still do not depend on
    /// what else is in the batch. Activation memory grows with the batch's
    /// rows: see [`pack_batch`].
    pub fn score_batch(
        &self,
        batch: &[ScoreInput<'_>],
        lora: Option<&LoraAdapter>,
        temperature: f64,
    ) -> Result<Vec<TokenScores>> {
        self.score_batch_where(batch, None, lora, temperature)
    }

    /// [`Model::score_batch`] where a loss reads only some positions:
    /// `needed[i][j]` says whether sequence `i`'s position `j` is one (for
    /// DPO, the completion's targets). On the packed path the LM head, its
    /// log-softmax and the entropy run only on the packed rows that some
    /// sequence needs, and the positions that no sequence needs hold NaN (not
    /// computed); a computed position has the bits it has in `score_batch`
    /// (the head's rows do not depend on one another there), so the
    /// invariance contract holds for every position a loss reads. Elsewhere
    /// every position is computed. `None` needs every position.
    pub fn score_batch_where(
        &self,
        batch: &[ScoreInput<'_>],
        needed: Option<&[&[bool]]>,
        lora: Option<&LoraAdapter>,
        temperature: f64,
    ) -> Result<Vec<TokenScores>> {
        if let Some(needed) = needed {
            let bad = needed.len() != batch.len()
                || needed
                    .iter()
                    .zip(batch)
                    .any(|(m, s)| m.len() != s.input.len());
            if bad {
                return Err(ModelError::InvalidInput(format!(
                    "score: {} masks of needed positions for {} sequences (one per position)",
                    needed.len(),
                    batch.len()
                )));
            }
        }
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
        let layout = shared_layout(batch);
        let hidden = self.forward_packed(&layout.ids, &layout.seqs, lora)?;
        // Each packed row's place among the rows the head runs on, if any.
        let n = layout.ids.len();
        let slot: Vec<Option<usize>> = match needed {
            None => (0..n).map(Some).collect(),
            Some(needed) => {
                let mut need = vec![false; n];
                for (parts, mask) in layout.rows.iter().zip(needed) {
                    let rows = parts.iter().flat_map(|&(at, len)| at..at + len);
                    for (row, &m) in rows.zip(mask.iter()) {
                        need[row] |= m;
                    }
                }
                let mut next = 0;
                need.iter()
                    .map(|&m| {
                        m.then(|| {
                            next += 1;
                            next - 1
                        })
                    })
                    .collect()
            }
        };
        let head_rows: Vec<u32> = (0..n as u32)
            .filter(|&r| slot[r as usize].is_some())
            .collect();
        tracing::debug!(
            sequences = batch.len(),
            rows = n,
            head_rows = head_rows.len(),
            "packed training forward"
        );
        let (logprobs, entropy) = if head_rows.is_empty() {
            let none = Tensor::zeros(0, DType::F32, self.device())?;
            (none.clone(), none)
        } else {
            let (hidden, targets) = if head_rows.len() == n {
                (hidden, layout.targets)
            } else {
                let idx = Tensor::new(head_rows.as_slice(), self.device())?;
                let targets = head_rows.iter().map(|&r| layout.targets[r as usize]);
                (hidden.index_select(&idx, 0)?, targets.collect())
            };
            lm_head_logprobs(
                &hidden,
                self.head_weight(),
                &targets,
                temperature,
                self.head_packed(),
                self.forward_matmul(),
            )?
        };
        layout
            .rows
            .iter()
            .map(|parts| {
                let slots: Vec<Option<usize>> = parts
                    .iter()
                    .flat_map(|&(at, len)| slot[at..at + len].iter().copied())
                    .collect();
                Ok(TokenScores {
                    logprobs: gather_slots(&logprobs, &slots)?,
                    entropy: gather_slots(&entropy, &slots)?,
                })
            })
            .collect()
    }
}

/// The entries of `t` at `slots`, in order: `Some(k)` is `t[k]`, `None` a
/// NaN (not computed). Consecutive entries are one narrow (differentiable).
fn gather_slots(t: &Tensor, slots: &[Option<usize>]) -> Result<Tensor> {
    let mut pieces = Vec::new();
    let mut i = 0;
    while i < slots.len() {
        let mut j = i + 1;
        match slots[i] {
            Some(k) => {
                while j < slots.len() && slots[j] == Some(k + j - i) {
                    j += 1;
                }
                pieces.push(t.narrow(0, k, j - i)?);
            }
            None => {
                while j < slots.len() && slots[j].is_none() {
                    j += 1;
                }
                pieces.push(Tensor::full(f32::NAN, j - i, t.device())?.to_dtype(t.dtype())?);
            }
        }
        i = j;
    }
    Ok(if pieces.len() == 1 {
        pieces.swap_remove(0)
    } else {
        Tensor::cat(&pieces, 0)?
    })
}

/// The fewest positions that consecutive sequences of a batch must share,
/// beyond the prefix they already share, for [`Model::score_batch`] to run
/// them once for all of them.
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

/// The packed forward of a batch: a tree of shared prefixes.
struct Layout {
    /// Every packed row's input token.
    ids: Vec<u32>,
    /// Every packed row's target.
    targets: Vec<u32>,
    /// The packed sequences: shared prefixes and each sequence's own rows.
    seqs: Vec<PackedSeq>,
    /// Where each input sequence's positions are, in order, as (first row,
    /// rows) parts: its chain of shared prefixes, then its own rows.
    rows: Vec<Vec<(usize, usize)>>,
    /// The most positions any sequence runs in shared prefixes.
    longest_prefix: usize,
}

/// The packed forward of `batch` (see [`Model::score_batch`]). Consecutive
/// sequences that share at least [`MIN_SHARED_PREFIX`] positions run them
/// once, as a sequence of their own; within such a run, consecutive
/// sequences that share [`MIN_SHARED_PREFIX`] positions more run those once
/// after it, and so on: a DPO batch runs its common system prompt once,
/// each pair's prompt once after it, and the pair's two completions after
/// that; an RL batch each group's prompt once. Each sequence keeps at least
/// one position of its own.
fn shared_layout(batch: &[ScoreInput<'_>]) -> Layout {
    let mut out = Layout {
        ids: Vec::new(),
        targets: Vec::new(),
        seqs: Vec::new(),
        rows: vec![Vec::new(); batch.len()],
        longest_prefix: 0,
    };
    place(batch, 0..batch.len(), 0, None, &[], &mut out);
    out
}

/// Lay out `batch[range]`, which share their first `from` positions (run
/// by `parent`, at the rows `chain`), in `out`.
fn place(
    batch: &[ScoreInput<'_>],
    range: std::ops::Range<usize>,
    from: usize,
    parent: Option<usize>,
    chain: &[(usize, usize)],
    out: &mut Layout,
) {
    // Appends positions `from..to` of `s` as a sequence after `parent`;
    // returns its first row and its index.
    let push = |out: &mut Layout, s: &ScoreInput<'_>, to: usize| {
        let at = out.ids.len();
        out.ids.extend_from_slice(&s.input[from..to]);
        out.targets.extend_from_slice(&s.targets[from..to]);
        out.seqs.push(PackedSeq {
            len: to - from,
            after: parent,
        });
        (at, out.seqs.len() - 1)
    };
    let own = |s: &ScoreInput<'_>| s.input.len().saturating_sub(1);
    let mut i = range.start;
    while i < range.end {
        // The longest run from `i` that shares MIN_SHARED_PREFIX positions
        // beyond `from`, and what the whole run shares.
        let (mut j, mut shared) = (i + 1, usize::MAX);
        while j < range.end {
            let next = shared
                .min(shared_positions(&batch[i], &batch[j]))
                .min(own(&batch[i]))
                .min(own(&batch[j]));
            if next < from + MIN_SHARED_PREFIX {
                break;
            }
            shared = next;
            j += 1;
        }
        let s = &batch[i];
        if j == i + 1 {
            let (at, _) = push(out, s, s.input.len());
            out.rows[i] = [chain, &[(at, s.input.len() - from)]].concat();
            out.longest_prefix = out.longest_prefix.max(from);
        } else {
            let (at, index) = push(out, s, shared);
            let chain = [chain, &[(at, shared - from)]].concat();
            place(batch, i..j, shared, Some(index), &chain, out);
        }
        i = j;
    }
}

/// What `batch` costs against [`pack_batch`]'s budget: the rows
/// [`Model::score_batch`] runs for it (a shared prefix once), less the
/// longest chain of shared prefixes. Counting that chain would split an RL
/// group with a long prompt over several packs and run the prompt once per
/// pack; not counting the others keeps a pack's rows within the budget plus
/// one prompt.
fn pack_cost(batch: &[ScoreInput<'_>]) -> usize {
    let layout = shared_layout(batch);
    layout.ids.len() - layout.longest_prefix
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

    /// The packed sequences of `b`'s layout as (len, after), and its rows.
    fn tree(b: &[ScoreInput<'_>]) -> (Vec<(usize, Option<usize>)>, usize) {
        let l = shared_layout(b);
        let seqs = l.seqs.iter().map(|s| (s.len, s.after)).collect();
        (seqs, l.ids.len())
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
        // The first two share 2 positions more than the third: too few for
        // a level of their own.
        assert_eq!(
            tree(&b).0,
            vec![
                (19, None),
                (7, Some(0)),
                (7, Some(0)),
                (7, Some(0)),
                (10, None)
            ]
        );
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
        assert_eq!(
            tree(&two).0,
            vec![
                (19, None),
                (7, Some(0)),
                (7, Some(0)),
                (19, None),
                (7, Some(3)),
                (7, Some(3))
            ]
        );
        assert_eq!(pack_cost(&two), 14 + 19 + 14);
        // Shared positions need equal targets too, and every sequence
        // keeps a position of its own.
        assert_eq!(shared_positions(&b[0], &b[1]), 21);
        let short = batch(&[prompt.clone(), with(&[5, 5])]);
        assert_eq!(
            tree(&inputs(&short)).0,
            vec![(18, None), (1, Some(0)), (3, Some(0))]
        );
        // A common start shorter than `MIN_SHARED_PREFIX` is not shared.
        let b = batch(&[distinct(12, 1), distinct(12, 2)]);
        assert_eq!(tree(&inputs(&b)).0, vec![(11, None), (11, None)]);
    }

    #[test]
    fn a_batch_of_pairs_runs_its_system_prompt_once_and_each_pairs_prompt_once() {
        // A DPO batch: 4 pairs, each prompt the same 24-token system prompt
        // then 11 tokens of its own question, each side a 9-token completion.
        // The packed forward runs the system prompt once, each pair's
        // question once after it, and the two completions after that: prompt
        // + both completions per pair, not twice the prompt.
        let system = distinct(24, 9);
        let (pairs, question, completion) = (4usize, 11usize, 9usize);
        let mut seqs = Vec::new();
        for p in 0..pairs as u32 {
            let prompt = [system.clone(), distinct(question, 10 + p)].concat();
            for side in 0..2 {
                seqs.push([prompt.clone(), distinct(completion, 20 + 2 * p + side)].concat());
            }
        }
        let b = batch(&seqs);
        let b = inputs(&b);
        let (layout, rows) = tree(&b);
        // Positions run: the system prompt's 23 (its last input's target is
        // a question's first token), each pair's 11 question positions, and
        // each side's 9 (the last prompt token predicts the completion's
        // first; the completion's last token is no input).
        assert_eq!(rows, 23 + pairs * (11 + 2 * completion));
        let unshared: usize = b.iter().map(|s| s.input.len()).sum();
        assert_eq!(unshared, 2 * pairs * (24 + question + completion - 1));
        let mut want = vec![(23, None)];
        for p in 0..pairs {
            let q = 1 + 3 * p;
            want.extend([(11, Some(0)), (9, Some(q)), (9, Some(q))]);
        }
        assert_eq!(layout, want);
        // Each sequence's positions: the system prompt's rows, its pair's
        // question's, its own, in order.
        let l = shared_layout(&b);
        assert_eq!(
            l.rows[3],
            vec![(0, 23), (23 + 29, 11), (23 + 29 + 11 + 9, 9)]
        );
        assert_eq!(l.longest_prefix, 34);
        // The whole batch is one pack; its cost leaves out the longest chain
        // of prefixes (the system prompt and one question).
        assert_eq!(pack_cost(&b), rows - 34);
        assert_eq!(pack_batch(&b, PACK_TOKENS), vec![0..8]);
    }
}
