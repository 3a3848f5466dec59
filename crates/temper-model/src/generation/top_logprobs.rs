//! [`Model::score_with_top`]: the canonical training forward of
//! [`Model::score`], plus the `k` most likely alternatives at each position —
//! what an OpenAI-style `top_logprobs` answer needs.
//!
//! It repeats `score`'s computation op for op (one segment, same input and
//! targets, same row chunks), so its target logprobs are bit-identical to
//! `score`'s; a test in `tests/it/top_logprobs.rs` holds it to that.

use candle_core::{DType, Tensor};

use crate::arch::model::{log_softmax_last, Model, Segment};
use crate::error::{ModelError, Result};
use crate::generation::logprobs::SCORE_CHUNK;
use crate::kernels::{for_each_logprob_row, fused_lm_head_supported};
use crate::lora::LoraAdapter;

/// Target logprobs and, per position, the top alternatives.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TopLogprobs {
    /// `log softmax(logits / temperature)[target]` per position (equal to
    /// [`Model::score`]'s `logprobs`).
    pub logprobs: Vec<f32>,
    /// Per position, the `k` most likely `(token, logprob)` pairs, most
    /// likely first (ties: lower id first). Empty lists when `k == 0`.
    pub top: Vec<Vec<(u32, f32)>>,
}

impl Model {
    /// [`Model::score`]'s logprobs of `targets` after each prefix of `input`,
    /// without the autograd graph, plus the `k` most likely tokens at each
    /// position under the same distribution.
    pub fn score_with_top(
        &self,
        input: &[u32],
        targets: &[u32],
        lora: Option<&LoraAdapter>,
        temperature: f64,
        k: usize,
    ) -> Result<TopLogprobs> {
        if k == 0 {
            let s = self.score(input, targets, lora, temperature)?;
            return Ok(TopLogprobs {
                logprobs: s.logprobs.to_vec1()?,
                top: vec![Vec::new(); input.len()],
            });
        }
        if input.len() != targets.len() || input.is_empty() {
            return Err(ModelError::InvalidInput(format!(
                "score: {} input tokens and {} targets (must be equal and non-zero)",
                input.len(),
                targets.len()
            )));
        }
        if !(temperature > 0.0 && temperature.is_finite()) {
            return Err(ModelError::InvalidInput(format!(
                "score: temperature must be > 0, got {temperature}"
            )));
        }
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
        let mut logprobs = Vec::with_capacity(input.len());
        let mut top = Vec::with_capacity(input.len());
        let head = self.head_weight();
        if fused_lm_head_supported(&hidden, head) {
            // The same blocks and reductions as `score`'s fused LM head.
            let kernel = (self.head_packed(), self.forward_matmul());
            for_each_logprob_row(&hidden, head, temperature, kernel, |i, row| {
                logprobs.push(row[targets[i] as usize]);
                top.push(top_k(row, k));
                Ok(())
            })?;
            return Ok(TopLogprobs { logprobs, top });
        }
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
            logprobs.extend(lp.gather(&idx, 1)?.squeeze(1)?.to_vec1::<f32>()?);
            for row in lp.to_vec2::<f32>()? {
                top.push(top_k(&row, k));
            }
            start += len;
        }
        Ok(TopLogprobs { logprobs, top })
    }
}

/// The `k` largest entries of `row` as `(id, value)`, largest first (ties:
/// lower id first): [`TopLogprobs::top`]'s order, for a row of logprobs
/// taken elsewhere (a decode step's, with [`crate::kernels::row_log_softmax`]).
pub fn top_k(row: &[f32], k: usize) -> Vec<(u32, f32)> {
    let mut ids: Vec<u32> = (0..row.len() as u32).collect();
    let kk = k.min(ids.len());
    let by_prob = |a: &u32, b: &u32| row[*b as usize].total_cmp(&row[*a as usize]).then(a.cmp(b));
    if kk < ids.len() {
        ids.select_nth_unstable_by(kk, by_prob);
        ids.truncate(kk);
    }
    ids.sort_by(by_prob);
    ids.into_iter().map(|i| (i, row[i as usize])).collect()
}
