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

use crate::error::{ModelError, Result};
use crate::kernels::{
    fused_attention_supported, fused_lm_head_supported, lm_head_logprobs, use_matmul_nt,
};
use crate::lora::LoraAdapter;
use crate::model::{log_softmax_last, Model, Segment};

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
    /// alone. Elsewhere each sequence is scored on its own, so its numbers
    /// still do not depend on what else is in the batch. Activation memory
    /// grows with the batch's tokens: see [`pack_sequences`].
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
        let mut ids = Vec::new();
        let mut targets = Vec::new();
        let mut segs = Vec::with_capacity(batch.len());
        for (i, s) in batch.iter().enumerate() {
            if s.input.len() != s.targets.len() || s.input.is_empty() {
                return Err(ModelError::InvalidInput(format!(
                    "score: sequence {i} has {} input tokens and {} targets (must be equal and non-zero)",
                    s.input.len(),
                    s.targets.len()
                )));
            }
            ids.extend_from_slice(s.input);
            targets.extend_from_slice(s.targets);
            segs.push(Segment {
                len: s.input.len(),
                cache: None,
            });
        }
        if let Some(&bad) = targets.iter().find(|&&t| t as usize >= vocab) {
            return Err(ModelError::InvalidInput(format!(
                "target token {bad} out of range for vocabulary size {vocab}"
            )));
        }
        let hidden = self.forward_hidden(&ids, &mut segs, lora)?;
        let (logprobs, entropy) = lm_head_logprobs(
            &hidden,
            self.head_weight(),
            &targets,
            temperature,
            self.head_packed(),
        )?;
        let mut out = Vec::with_capacity(batch.len());
        let mut start = 0;
        for s in batch {
            let len = s.input.len();
            out.push(TokenScores {
                logprobs: logprobs.narrow(0, start, len)?,
                entropy: entropy.narrow(0, start, len)?,
            });
            start += len;
        }
        Ok(out)
    }
}

/// Tokens per packed training forward ([`pack_sequences`]). Measured on
/// SmolLM2 (LoRA r=16, 8×128 tokens, 2 threads, `temper bench model`):
/// packs of 128 / 256 / 512 / 1,024 tokens train at 174 / 190 / 185 / 158
/// tokens/s in f32 (252 / 269 / 266 / 236 in bf16), with peak RSS 754 /
/// 903 / 1,200 / 1,775 MB: past 256 rows a layer's activations no longer
/// stay in cache and the allocator maps and faults in fresh pages.
pub const PACK_TOKENS: usize = 256;

/// Split sequences of lengths `lens` into consecutive packs of at most
/// `max_tokens` tokens each (a longer sequence is a pack of its own), for
/// [`Model::score_batch`]. Returns index ranges into `lens`.
pub fn pack_sequences(lens: &[usize], max_tokens: usize) -> Vec<std::ops::Range<usize>> {
    let mut packs = Vec::new();
    let (mut start, mut tokens) = (0, 0);
    for (i, &len) in lens.iter().enumerate() {
        if i > start && tokens + len > max_tokens {
            packs.push(start..i);
            (start, tokens) = (i, 0);
        }
        tokens += len;
    }
    if start < lens.len() {
        packs.push(start..lens.len());
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
    use super::pack_sequences;

    #[test]
    fn packs_are_consecutive_and_within_the_budget() {
        assert!(pack_sequences(&[], 10).is_empty());
        assert_eq!(pack_sequences(&[4, 4, 4], 10), vec![0..2, 2..3]);
        assert_eq!(pack_sequences(&[4, 6, 1], 10), vec![0..2, 2..3]);
        // A sequence over the budget is a pack of its own.
        assert_eq!(pack_sequences(&[3, 20, 3], 10), vec![0..1, 1..2, 2..3]);
        assert_eq!(pack_sequences(&[20], 10), vec![0..1]);
    }
}
