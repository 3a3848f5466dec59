//! Batched generation with a KV cache.
//!
//! Prompts are prefilled together (one packed forward), the `n` samples of a
//! prompt share its prefill (the cache is cloned, not recomputed), and every
//! decode step runs all live sequences through one packed forward.
//!
//! # Which logprobs are reported
//! `Completion::logprobs[i]` is `log softmax(logits / T)[token_i]` — the
//! temperature-scaled model distribution *before* top-k / top-p truncation
//! (greedy, `T = 0`, reports the `T = 1` distribution). It is computed by the
//! training forward ([`Model::score`] over the finished sequence), so it is
//! bit-identical to what the trainer computes for the same tokens and weights;
//! see [`crate::scoring`]. Tokens are drawn from the decode pass's logits,
//! which agree with those to float rounding (~1e-6).

use candle_core::{DType, Tensor};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::error::{ModelError, Result};
use crate::lora::LoraAdapter;
use crate::model::{KvCache, Model, Segment};
use crate::tokenizer::Tokenizer;

/// How to sample.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    /// Most tokens to generate (>= 1).
    pub max_tokens: usize,
    /// Softmax temperature; 0 means greedy.
    pub temperature: f64,
    /// Nucleus mass in (0, 1]; 1 disables.
    pub top_p: f64,
    /// Keep only the k most likely tokens; 0 disables.
    pub top_k: usize,
    /// Strings that end generation; the text is cut before the match.
    pub stop: Vec<String>,
    /// Extra token ids that end generation (kept in `tokens`, not in `text`).
    pub stop_token_ids: Vec<u32>,
    /// Keep going past the model's EOS tokens.
    pub ignore_eos: bool,
    /// Same seed, same prompt, same weights ⇒ same tokens. `None`: random.
    pub seed: Option<u64>,
    /// Compute per-token logprobs (one extra scoring forward per sequence).
    pub logprobs: bool,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            max_tokens: 16,
            temperature: 1.0,
            top_p: 1.0,
            top_k: 0,
            stop: Vec::new(),
            stop_token_ids: Vec::new(),
            ignore_eos: false,
            seed: None,
            logprobs: true,
        }
    }
}

impl SamplingParams {
    /// Reject values that cannot be sampled with.
    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(ModelError::InvalidInput(m));
        if self.max_tokens == 0 {
            return bad("max_tokens must be >= 1".into());
        }
        if !(self.temperature >= 0.0 && self.temperature.is_finite()) {
            return bad(format!(
                "temperature must be >= 0, got {}",
                self.temperature
            ));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return bad(format!("top_p must be in (0, 1], got {}", self.top_p));
        }
        if self.stop.iter().any(|s| s.is_empty()) {
            return bad("stop strings must not be empty".into());
        }
        Ok(())
    }
}

/// Why a sequence ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// An EOS / stop token or a stop string.
    Stop,
    /// `max_tokens` or the context length was reached.
    Length,
}

impl FinishReason {
    /// `"stop"` or `"length"`, as in the OpenAI API.
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
        }
    }
}

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
    pub fn generate(
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
        for r in requests {
            r.params.validate()?;
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

        // Prefill every prompt once, in one packed forward.
        let mut caches: Vec<KvCache> = requests.iter().map(|_| KvCache::new(num_layers)).collect();
        let ids: Vec<u32> = requests
            .iter()
            .flat_map(|r| r.prompt.iter().copied())
            .collect();
        let last_rows: Vec<u32> = requests
            .iter()
            .scan(0usize, |end, r| {
                *end += r.prompt.len();
                Some((*end - 1) as u32)
            })
            .collect();
        let first_logits = {
            let mut segs: Vec<Segment<'_>> = requests
                .iter()
                .zip(caches.iter_mut())
                .map(|(r, c)| Segment {
                    len: r.prompt.len(),
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
            for j in 0..r.n {
                let mut rng = ChaCha8Rng::seed_from_u64(seed);
                rng.set_stream(j as u64);
                lives.push(Live {
                    req: ri,
                    cache: caches[ri].clone(),
                    logits: first_logits[ri].clone(),
                    tokens: Vec::new(),
                    rng,
                    finish: None,
                    stop_text: None,
                });
            }
        }

        loop {
            for live in lives.iter_mut().filter(|l| l.finish.is_none()) {
                let p = &requests[live.req].params;
                let tok = sample_token(&live.logits, p, &mut live.rng);
                live.tokens.push(tok);
                let is_eos = !p.ignore_eos && self.eos_token_ids.contains(&tok);
                if is_eos || p.stop_token_ids.contains(&tok) {
                    live.finish = Some(FinishReason::Stop);
                } else if !p.stop.is_empty() {
                    let text = self.tokenizer.decode(&live.tokens, true)?;
                    if let Some(cut) = earliest_stop(&text, &p.stop) {
                        live.stop_text = Some(text[..cut].to_string());
                        live.finish = Some(FinishReason::Stop);
                    }
                }
                if live.finish.is_none()
                    && (live.tokens.len() >= p.max_tokens || live.cache.len() + 1 >= max_pos)
                {
                    live.finish = Some(FinishReason::Length);
                }
            }
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
                let mut segs: Vec<Segment<'_>> = active
                    .iter_mut()
                    .map(|l| Segment {
                        len: 1,
                        cache: Some(&mut l.cache),
                    })
                    .collect();
                let hidden = self.model.forward_hidden(&ids, &mut segs, lora)?;
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
            let logprobs = if r.params.logprobs {
                Some(self.reported_logprobs(&r.prompt, &live.tokens, lora, r.params.temperature)?)
            } else {
                None
            };
            let text = match live.stop_text {
                Some(t) => t,
                None => {
                    let visible = match (finish, live.tokens.last()) {
                        (FinishReason::Stop, Some(_)) => &live.tokens[..live.tokens.len() - 1],
                        _ => &live.tokens[..],
                    };
                    self.tokenizer.decode(visible, true)?
                }
            };
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
        let t = if temperature > 0.0 { temperature } else { 1.0 };
        let scores = self
            .model
            .score(&full[..full.len() - 1], &full[1..], lora, t)?;
        let all: Vec<f32> = scores.logprobs.to_vec1()?;
        Ok(all[all.len() - completion.len()..].to_vec())
    }
}

fn earliest_stop(text: &str, stops: &[String]) -> Option<usize> {
    stops.iter().filter_map(|s| text.find(s.as_str())).min()
}

/// Draw one token from `logits` under `p` (temperature, top-k, top-p).
pub fn sample_token(logits: &[f32], p: &SamplingParams, rng: &mut impl Rng) -> u32 {
    let argmax = || {
        let mut best = 0usize;
        for (i, &x) in logits.iter().enumerate() {
            if x > logits[best] {
                best = i;
            }
        }
        best as u32
    };
    if p.temperature <= 0.0 || p.top_k == 1 {
        return argmax();
    }
    let inv_t = 1.0 / p.temperature;
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    if p.top_k == 0 && p.top_p >= 1.0 {
        let weights: Vec<f64> = logits
            .iter()
            .map(|&x| ((x as f64 - max) * inv_t).exp())
            .collect();
        let total: f64 = weights.iter().sum();
        return pick(
            &weights,
            (0..logits.len()).collect::<Vec<_>>().as_slice(),
            total,
            rng,
        )
        .unwrap_or_else(argmax);
    }
    let mut order: Vec<usize> = (0..logits.len()).collect();
    order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]));
    if p.top_k > 0 && p.top_k < order.len() {
        order.truncate(p.top_k);
    }
    let mut weights: Vec<f64> = order
        .iter()
        .map(|&i| ((logits[i] as f64 - max) * inv_t).exp())
        .collect();
    let total: f64 = weights.iter().sum();
    if p.top_p < 1.0 {
        let mut cum = 0.0;
        let mut keep = weights.len();
        for (k, w) in weights.iter().enumerate() {
            cum += w / total;
            if cum >= p.top_p {
                keep = k + 1;
                break;
            }
        }
        order.truncate(keep);
        weights.truncate(keep);
    }
    let total: f64 = weights.iter().sum();
    pick(&weights, &order, total, rng).unwrap_or_else(argmax)
}

/// Inverse-CDF draw: `weights[k]` is the mass of token `ids[k]`.
fn pick(weights: &[f64], ids: &[usize], total: f64, rng: &mut impl Rng) -> Option<u32> {
    if !(total > 0.0 && total.is_finite()) {
        return None;
    }
    let u = rng.random::<f64>() * total;
    let mut cum = 0.0;
    for (k, w) in weights.iter().enumerate() {
        cum += w;
        if u < cum {
            return Some(ids[k] as u32);
        }
    }
    ids.last().map(|&i| i as u32)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_picks_argmax() {
        let p = SamplingParams {
            temperature: 0.0,
            ..Default::default()
        };
        let mut rng = ChaCha8Rng::seed_from_u64(0);
        assert_eq!(sample_token(&[0.1, 3.0, -1.0, 2.9], &p, &mut rng), 1);
    }

    #[test]
    fn top_k_and_top_p_restrict_the_support() {
        let logits = [5.0f32, 4.0, 0.0, -1.0, -2.0];
        let mut rng = ChaCha8Rng::seed_from_u64(7);
        let k2 = SamplingParams {
            top_k: 2,
            ..Default::default()
        };
        let p = SamplingParams {
            top_p: 0.5,
            ..Default::default()
        };
        for _ in 0..500 {
            assert!(sample_token(&logits, &k2, &mut rng) < 2);
            assert_eq!(sample_token(&logits, &p, &mut rng), 0);
        }
    }

    #[test]
    fn temperature_one_matches_softmax_frequencies() {
        let logits = [0.0f32, (2.0f32).ln(), (3.0f32).ln()];
        let mut rng = ChaCha8Rng::seed_from_u64(1);
        let mut counts = [0usize; 3];
        let p = SamplingParams::default();
        for _ in 0..60_000 {
            counts[sample_token(&logits, &p, &mut rng) as usize] += 1;
        }
        for (c, want) in counts.iter().zip([1.0 / 6.0, 2.0 / 6.0, 3.0 / 6.0]) {
            let f = *c as f64 / 60_000.0;
            assert!((f - want).abs() < 0.01, "{counts:?}");
        }
    }
}
