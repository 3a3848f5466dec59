//! Batched generation with a KV cache.
//!
//! Prompts are prefilled together (one packed forward), each distinct prompt
//! once: the `n` samples of a prompt, and requests that repeat a prompt (the
//! rollouts of an RL group), share its prefill (the cache is cloned, not
//! recomputed), and every decode step runs all live sequences through one
//! batched decode step ([`Model::forward_decode`], the server's).
//!
//! Each token is drawn and each sequence ended by the shared rules of
//! [`crate::generation::decode`] (the server's scheduler uses the same functions).
//!
//! # Which logprobs are reported
//! `Completion::logprobs[i]` is `log softmax(logits / T)[token_i]` — the
//! temperature-scaled model distribution *before* logit bias, penalties and
//! top-k / top-p / min-p truncation (greedy, `T = 0`, reports the `T = 1`
//! distribution), bit-identical to what the trainer computes for the same
//! tokens and weights ([`Model::score`]; see [`crate::generation::logprobs`]).
//!
//! On the CPU in f32 with the batch-invariant matmul (the default) every
//! kernel of the forward gives a row the same bits in a decode step as in the
//! trainer's full-sequence pass, so the logprob is taken straight from the
//! decode step's logits (with the LM head's own reduction,
//! [`crate::kernels::row_logprob`]). Elsewhere (a GPU, bf16,
//! `TEMPER_MATMUL=candle`, a trainable LM head) the finished sequence is
//! re-scored by the training forward, one extra forward per sequence.

use std::collections::HashMap;

use candle_core::{DType, Tensor};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rayon::prelude::*;

use crate::arch::model::{KvCache, Model, Segment};
use crate::error::{ModelError, Result};
use crate::generation::decode::{check_stop, next_token, scoring_temperature, visible_text};
pub use crate::generation::decode::{sample_token, FinishReason, SamplingParams};
use crate::kernels::row_logprob;
use crate::lora::LoraAdapter;
use crate::tokenizer::Tokenizer;

/// One generated sequence.
#[derive(Debug, Clone, PartialEq)]
pub struct Completion {
    /// Generated token ids (a final stop token included).
    pub tokens: Vec<u32>,
    /// Logprob of each token (see the module docs for which), when asked.
    pub logprobs: Option<Vec<f32>>,
    /// Decoded text without special tokens, cut before a matched stop string.
    pub text: String,
    /// Why it ended.
    pub finish_reason: FinishReason,
}

/// A prompt to continue `n` times.
#[derive(Debug, Clone)]
pub struct GenerationRequest {
    /// Prompt token ids (non-empty).
    pub prompt: Vec<u32>,
    /// Number of samples.
    pub n: usize,
    /// Sampling parameters.
    pub params: SamplingParams,
}

/// Generates from a model (optionally with a LoRA adapter).
pub struct Sampler<'a> {
    model: &'a Model,
    tokenizer: &'a Tokenizer,
    eos_token_ids: Vec<u32>,
}

struct Live {
    req: usize,
    cache: KvCache,
    logits: Vec<f32>,
    tokens: Vec<u32>,
    rng: ChaCha8Rng,
    finish: Option<FinishReason>,
    stop_text: Option<String>,
    /// Logprobs taken during decode (see the module docs).
    logprobs: Vec<f32>,
}

impl<'a> Sampler<'a> {
    /// A sampler over `model` that stops on `eos_token_ids`.
    pub fn new(model: &'a Model, tokenizer: &'a Tokenizer, eos_token_ids: Vec<u32>) -> Self {
        Self {
            model,
            tokenizer,
            eos_token_ids,
        }
    }

    /// Generate for every request; returns `n` completions per request, in order.
    /// Runs on a thread of the kernels' pool ([`crate::on_pool`]).
    pub fn generate(
        &self,
        requests: &[GenerationRequest],
        lora: Option<&LoraAdapter>,
    ) -> Result<Vec<Vec<Completion>>> {
        crate::on_pool(|| self.generate_here(requests, lora))
    }

    fn generate_here(
        &self,
        requests: &[GenerationRequest],
        lora: Option<&LoraAdapter>,
    ) -> Result<Vec<Vec<Completion>>> {
        if requests.is_empty() {
            return Ok(Vec::new());
        }
        // Sampling never needs gradients: same numbers, no autograd graph.
        let view = lora.map(LoraAdapter::inference_view);
        let lora = view.as_ref();
        let max_pos = self.model.config().max_position_embeddings;
        let vocab = self.model.config().vocab_size;
        for r in requests {
            r.params.validate()?;
            r.params.validate_vocab(vocab)?;
            if r.n == 0 {
                return Err(ModelError::InvalidInput("n must be >= 1".into()));
            }
            if r.prompt.is_empty() {
                return Err(ModelError::InvalidInput("prompt must not be empty".into()));
            }
            if r.prompt.len() >= max_pos {
                return Err(ModelError::InvalidInput(format!(
                    "prompt of {} tokens leaves no room in the context length {max_pos}",
                    r.prompt.len()
                )));
            }
        }
        let num_layers = self.model.config().num_layers;
        let decode_logprobs = self.model.decode_logits_are_exact()?;

        // Prefill every distinct prompt once, in one packed forward. The
        // rollouts of an RL group arrive as separate requests with one
        // prompt; with batch-invariant kernels a prompt's cache and first
        // logits are the same bits however many requests share it.
        let mut distinct: Vec<&[u32]> = Vec::new();
        let mut index_of: HashMap<&[u32], usize> = HashMap::new();
        let prompt_of: Vec<usize> = requests
            .iter()
            .map(|r| {
                *index_of.entry(r.prompt.as_slice()).or_insert_with(|| {
                    distinct.push(r.prompt.as_slice());
                    distinct.len() - 1
                })
            })
            .collect();
        let mut caches: Vec<KvCache> = distinct.iter().map(|_| KvCache::new(num_layers)).collect();
        let ids: Vec<u32> = distinct.iter().flat_map(|p| p.iter().copied()).collect();
        let last_rows: Vec<u32> = distinct
            .iter()
            .scan(0usize, |end, p| {
                *end += p.len();
                Some((*end - 1) as u32)
            })
            .collect();
        let first_logits = {
            let mut segs: Vec<Segment<'_>> = distinct
                .iter()
                .zip(caches.iter_mut())
                .map(|(p, c)| Segment {
                    len: p.len(),
                    cache: Some(c),
                })
                .collect();
            let hidden = self.model.forward_hidden(&ids, &mut segs, lora)?;
            let rows =
                hidden.index_select(&Tensor::new(last_rows.as_slice(), self.model.device())?, 0)?;
            self.model
                .logits(&rows)?
                .to_dtype(DType::F32)?
                .to_vec2::<f32>()?
        };

        let mut lives = Vec::new();
        for (ri, r) in requests.iter().enumerate() {
            let seed = r.params.seed.unwrap_or_else(|| rand::rng().random());
            let pi = prompt_of[ri];
            for j in 0..r.n {
                let mut rng = ChaCha8Rng::seed_from_u64(seed);
                rng.set_stream(j as u64);
                lives.push(Live {
                    req: ri,
                    cache: caches[pi].truncated(caches[pi].len())?,
                    logits: first_logits[pi].clone(),
                    tokens: Vec::new(),
                    rng,
                    finish: None,
                    stop_text: None,
                    logprobs: Vec::new(),
                });
            }
        }

        loop {
            // A draw reads only its own sequence's logits, tokens and random
            // stream: sequences run across threads, same result as in turn.
            lives.par_iter_mut().try_for_each(|live| -> Result<()> {
                if live.finish.is_some() {
                    return Ok(());
                }
                let p = &requests[live.req].params;
                let prompt = &requests[live.req].prompt;
                let tok = next_token(
                    &live.logits,
                    p,
                    prompt,
                    &live.tokens,
                    &self.eos_token_ids,
                    &mut live.rng,
                );
                if p.logprobs && decode_logprobs {
                    let t = scoring_temperature(p.temperature);
                    live.logprobs
                        .push(row_logprob(&live.logits, tok as usize, t));
                }
                live.tokens.push(tok);
                let full = live.cache.len() + 1 >= max_pos;
                let check = check_stop(
                    &live.tokens,
                    p,
                    &self.eos_token_ids,
                    self.tokenizer,
                    full,
                    false,
                )?;
                live.stop_text = check.stop_text;
                live.finish = check.finish;
                Ok(())
            })?;
            let mut active: Vec<&mut Live> =
                lives.iter_mut().filter(|l| l.finish.is_none()).collect();
            if active.is_empty() {
                break;
            }
            let ids: Vec<u32> = active
                .iter()
                .map(|l| *l.tokens.last().unwrap_or(&0))
                .collect();
            let logits = {
                // The server's batched decode step: one code path for both,
                // and each token's bits equal a full forward's.
                let mut caches: Vec<&mut KvCache> =
                    active.iter_mut().map(|l| &mut l.cache).collect();
                let hidden = self.model.forward_decode(&ids, &mut caches, lora)?;
                self.model
                    .logits(&hidden)?
                    .to_dtype(DType::F32)?
                    .to_vec2::<f32>()?
            };
            for (l, row) in active.into_iter().zip(logits) {
                l.logits = row;
            }
        }

        let mut out: Vec<Vec<Completion>> = requests.iter().map(|_| Vec::new()).collect();
        for live in lives {
            let r = &requests[live.req];
            let finish = live.finish.unwrap_or(FinishReason::Length);
            let logprobs = if r.params.logprobs && decode_logprobs {
                Some(live.logprobs)
            } else if r.params.logprobs {
                Some(self.reported_logprobs(&r.prompt, &live.tokens, lora, r.params.temperature)?)
            } else {
                None
            };
            let text = visible_text(
                &live.tokens,
                finish,
                live.stop_text,
                r.params.skip_special_tokens,
                self.tokenizer,
            )?;
            out[live.req].push(Completion {
                tokens: live.tokens,
                logprobs,
                text,
                finish_reason: finish,
            });
        }
        Ok(out)
    }

    /// Logprobs of `completion` after `prompt`, by the training forward.
    fn reported_logprobs(
        &self,
        prompt: &[u32],
        completion: &[u32],
        lora: Option<&LoraAdapter>,
        temperature: f64,
    ) -> Result<Vec<f32>> {
        let full: Vec<u32> = prompt.iter().chain(completion).copied().collect();
        let t = scoring_temperature(temperature);
        let scores = self
            .model
            .score(&full[..full.len() - 1], &full[1..], lora, t)?;
        let all: Vec<f32> = scores.logprobs.to_vec1()?;
        Ok(all[all.len() - completion.len()..].to_vec())
    }
}
