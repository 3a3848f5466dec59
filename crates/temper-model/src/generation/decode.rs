//! The decode rules, one copy for every generator: the in-process
//! [`crate::Sampler`] (RL rollouts, `temper eval` in process) and the
//! server's scheduler (`temper serve`) both draw each token with
//! [`next_token`] and end sequences with [`check_stop`] / [`visible_text`].
//!
//! Per step, in order (as vLLM does):
//! 1. `logit_bias` is added to the raw logits;
//! 2. `repetition_penalty` (HF / vLLM: a logit of a token seen in the prompt
//!    or the output is divided by it when positive, multiplied when
//!    negative), then `frequency_penalty · count` and `presence_penalty ·
//!    [count > 0]` (OpenAI; counts over the generated tokens) are subtracted;
//! 3. temperature; then `top_k`, `top_p` and `min_p` (tokens below `min_p ×`
//!    the top probability) truncate; greedy (`T = 0`) takes the argmax of the
//!    processed logits.
//!
//! A sequence ends on an EOS token (unless `ignore_eos`), on one of
//! `stop_token_ids` (both kept in the tokens, not in the text), on a stop
//! string (the text is cut before it), or at `max_tokens` / the context.
//! With `min_tokens` (vLLM's), none of the first `min_tokens` tokens ends
//! it: EOS and `stop_token_ids` are masked out of those draws, and a stop
//! string counts only once it ends past their text.
//!
//! # Which logprobs are reported
//! Logprobs (the sampler's `Completion::logprobs`, the server's `logprobs`)
//! are of the temperature-scaled *model* distribution, `log softmax(logits /
//! T)` — before `logit_bias`, penalties and truncation — because that is the
//! distribution the trainer recomputes. Truncation (`top_k`, `top_p`,
//! `min_p`) only removes tail tokens; bias and penalties move mass, so RL
//! configs refuse them (the importance ratio would be wrong).

use rand::Rng;

use crate::error::{ModelError, Result};
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
    /// Drop tokens whose probability is below `min_p` times the most likely
    /// one's, in [0, 1]; 0 disables.
    pub min_p: f64,
    /// Subtracted once from the logit of every token already generated, in
    /// [-2, 2]; 0 disables.
    pub presence_penalty: f64,
    /// Subtracted per occurrence from the logit of generated tokens, in
    /// [-2, 2]; 0 disables.
    pub frequency_penalty: f64,
    /// Divides positive (multiplies negative) logits of tokens in the prompt
    /// or the output; > 0, 1 disables.
    pub repetition_penalty: f64,
    /// Added to the logit of each token id, in [-100, 100].
    pub logit_bias: Vec<(u32, f32)>,
    /// Strings that end generation; the text is cut before the match.
    pub stop: Vec<String>,
    /// Extra token ids that end generation (kept in `tokens`, not in `text`).
    pub stop_token_ids: Vec<u32>,
    /// Keep going past the model's EOS tokens.
    pub ignore_eos: bool,
    /// Tokens generated before EOS, a stop token id or a stop string may end
    /// the sequence (vLLM's `min_tokens`); 0 disables.
    pub min_tokens: usize,
    /// Leave special tokens (EOS, chat markers) out of the decoded text
    /// (vLLM's `skip_special_tokens`, default true).
    pub skip_special_tokens: bool,
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
            min_p: 0.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            repetition_penalty: 1.0,
            logit_bias: Vec::new(),
            stop: Vec::new(),
            stop_token_ids: Vec::new(),
            ignore_eos: false,
            min_tokens: 0,
            skip_special_tokens: true,
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
        if !(0.0..=1.0).contains(&self.min_p) {
            return bad(format!("min_p must be in [0, 1], got {}", self.min_p));
        }
        for (name, v) in [
            ("presence_penalty", self.presence_penalty),
            ("frequency_penalty", self.frequency_penalty),
        ] {
            if !(-2.0..=2.0).contains(&v) {
                return bad(format!("{name} must be in [-2, 2], got {v}"));
            }
        }
        if !(self.repetition_penalty > 0.0 && self.repetition_penalty.is_finite()) {
            return bad(format!(
                "repetition_penalty must be > 0, got {}",
                self.repetition_penalty
            ));
        }
        if let Some((id, b)) = self
            .logit_bias
            .iter()
            .find(|(_, b)| !(-100.0..=100.0).contains(b))
        {
            return bad(format!(
                "logit_bias of token {id} must be in [-100, 100], got {b}"
            ));
        }
        if self.stop.iter().any(|s| s.is_empty()) {
            return bad("stop strings must not be empty".into());
        }
        Ok(())
    }

    /// Reject token ids outside a vocabulary of `vocab` tokens.
    pub fn validate_vocab(&self, vocab: usize) -> Result<()> {
        let ids = self
            .logit_bias
            .iter()
            .map(|(id, _)| (*id, "logit_bias"))
            .chain(self.stop_token_ids.iter().map(|id| (*id, "stop_token_ids")));
        for (id, field) in ids {
            if id as usize >= vocab {
                return Err(ModelError::InvalidInput(format!(
                    "{field}: token id {id} is outside the vocabulary of {vocab}"
                )));
            }
        }
        Ok(())
    }

    /// Whether the logits are changed before temperature and truncation
    /// (bias or a penalty set): such samples are not drawn from the
    /// distribution the reported logprobs describe.
    pub fn reshapes_distribution(&self) -> bool {
        !self.logit_bias.is_empty()
            || self.presence_penalty != 0.0
            || self.frequency_penalty != 0.0
            || self.repetition_penalty != 1.0
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

/// Apply `logit_bias` and the penalties to `logits` in place (steps 1–2 of
/// the module docs). `prompt` and `generated` are the sequence so far.
pub fn process_logits(logits: &mut [f32], p: &SamplingParams, prompt: &[u32], generated: &[u32]) {
    for &(id, b) in &p.logit_bias {
        if let Some(l) = logits.get_mut(id as usize) {
            *l += b;
        }
    }
    if p.repetition_penalty != 1.0 {
        let r = p.repetition_penalty as f32;
        let mut seen = vec![false; logits.len()];
        for &t in prompt.iter().chain(generated) {
            if let Some(s) = seen.get_mut(t as usize) {
                *s = true;
            }
        }
        for (l, s) in logits.iter_mut().zip(seen) {
            if s {
                *l = if *l > 0.0 { *l / r } else { *l * r };
            }
        }
    }
    if p.presence_penalty != 0.0 || p.frequency_penalty != 0.0 {
        let mut counts: std::collections::HashMap<u32, u32> = std::collections::HashMap::new();
        for &t in generated {
            *counts.entry(t).or_default() += 1;
        }
        for (t, c) in counts {
            if let Some(l) = logits.get_mut(t as usize) {
                *l -= (p.frequency_penalty * c as f64 + p.presence_penalty) as f32;
            }
        }
    }
}

/// The temperature reported logprobs are taken at for sampling temperature
/// `t`: `t` itself, and 1 for greedy (`t = 0`), which has no distribution of
/// its own.
pub fn scoring_temperature(t: f64) -> f64 {
    if t > 0.0 {
        t
    } else {
        1.0
    }
}

/// Draw the next token of a sequence: [`process_logits`] on a copy when
/// bias or penalties are set, and [`hold_back_stops`] before `min_tokens`,
/// then [`sample_token`]. `eos` are the model's EOS tokens.
pub fn next_token(
    logits: &[f32],
    p: &SamplingParams,
    prompt: &[u32],
    generated: &[u32],
    eos: &[u32],
    rng: &mut impl Rng,
) -> u32 {
    let hold = generated.len() < p.min_tokens;
    if p.reshapes_distribution() || hold {
        let mut l = logits.to_vec();
        if p.reshapes_distribution() {
            process_logits(&mut l, p, prompt, generated);
        }
        if hold {
            hold_back_stops(&mut l, p, eos);
        }
        sample_token(&l, p, rng)
    } else {
        sample_token(logits, p, rng)
    }
}

/// Give the tokens that would end a sequence — `eos` (unless `ignore_eos`)
/// and `stop_token_ids` — probability 0: what vLLM does to a draw before
/// `min_tokens` are generated. (Reported logprobs stay the model's.)
pub fn hold_back_stops(logits: &mut [f32], p: &SamplingParams, eos: &[u32]) {
    let eos = eos.iter().filter(|_| !p.ignore_eos);
    for &id in eos.chain(&p.stop_token_ids) {
        if let Some(l) = logits.get_mut(id as usize) {
            *l = f32::NEG_INFINITY;
        }
    }
}

/// [`next_token`] restricted to the tokens `allowed` accepts (a grammar's
/// mask, see the server's structured outputs): bias and penalties, then the
/// mask (other tokens get probability 0), then temperature and truncation
/// over what is left, so greedy takes the most likely allowed token and
/// `T > 0` samples the model's distribution renormalised over the allowed
/// set. `None` when no token of `logits` is allowed.
pub fn next_token_masked(
    logits: &[f32],
    p: &SamplingParams,
    prompt: &[u32],
    generated: &[u32],
    eos: &[u32],
    allowed: impl Fn(usize) -> bool,
    rng: &mut impl Rng,
) -> Option<u32> {
    let mut l = logits.to_vec();
    if p.reshapes_distribution() {
        process_logits(&mut l, p, prompt, generated);
    }
    if generated.len() < p.min_tokens {
        hold_back_stops(&mut l, p, eos);
    }
    let mut any = false;
    for (i, x) in l.iter_mut().enumerate() {
        if allowed(i) && !x.is_nan() {
            any = true;
        } else {
            *x = f32::NEG_INFINITY;
        }
    }
    any.then(|| sample_token(&l, p, rng))
}

/// What the last token did to a sequence.
#[derive(Debug, Clone, PartialEq)]
pub struct StopCheck {
    /// Set when the sequence ends here.
    pub finish: Option<FinishReason>,
    /// The text cut before a matched stop string.
    pub stop_text: Option<String>,
    /// The decoded text so far, when it was decoded (stop strings, or
    /// `want_text` for streaming) and no stop string matched.
    pub text: Option<String>,
}

/// Whether `generated` (its last token just drawn) ends: EOS (unless
/// `ignore_eos`), a stop token id, a stop string, `max_tokens`, or
/// `context_full` (no room for another token). Within the first
/// `min_tokens` tokens only the length limits end it.
pub fn check_stop(
    generated: &[u32],
    p: &SamplingParams,
    eos: &[u32],
    tokenizer: &Tokenizer,
    context_full: bool,
    want_text: bool,
) -> Result<StopCheck> {
    let mut out = StopCheck {
        finish: None,
        stop_text: None,
        text: None,
    };
    let Some(&tok) = generated.last() else {
        return Ok(out);
    };
    let may_stop = generated.len() > p.min_tokens;
    if may_stop && ((!p.ignore_eos && eos.contains(&tok)) || p.stop_token_ids.contains(&tok)) {
        out.finish = Some(FinishReason::Stop);
        return Ok(out);
    }
    if !p.stop.is_empty() || want_text {
        let text = tokenizer.decode(generated, p.skip_special_tokens)?;
        let cut = if !may_stop || p.stop.is_empty() {
            None
        } else if p.min_tokens == 0 {
            earliest_stop(&text, &p.stop, 0)
        } else {
            // Only a match that ends in the text past the first
            // `min_tokens` tokens counts (vLLM checks the new text only).
            let held = tokenizer.decode(&generated[..p.min_tokens], p.skip_special_tokens)?;
            earliest_stop(&text, &p.stop, held.len())
        };
        if let Some(cut) = cut {
            out.stop_text = Some(text[..cut].to_string());
            out.finish = Some(FinishReason::Stop);
            return Ok(out);
        }
        out.text = Some(text);
    }
    if generated.len() >= p.max_tokens || context_full {
        out.finish = Some(FinishReason::Length);
    }
    Ok(out)
}

/// The final text of a finished sequence: cut before a stop string, else
/// everything but a final stop token; special tokens left out unless
/// `skip_special_tokens` is off.
pub fn visible_text(
    generated: &[u32],
    finish: FinishReason,
    stop_text: Option<String>,
    skip_special_tokens: bool,
    tokenizer: &Tokenizer,
) -> Result<String> {
    if let Some(t) = stop_text {
        return Ok(t);
    }
    let visible = match (finish, generated.split_last()) {
        (FinishReason::Stop, Some((_, rest))) => rest,
        _ => generated,
    };
    tokenizer.decode(visible, skip_special_tokens)
}

/// How much of `text` may be streamed now: all of it, less a trailing
/// replacement character (an incomplete UTF-8 sequence that the next token
/// may complete) and less the longest suffix that starts a stop string.
pub fn streamable_len(text: &str, stops: &[String]) -> usize {
    let mut end = text.len();
    if text.ends_with('\u{FFFD}') {
        end -= '\u{FFFD}'.len_utf8();
    }
    let head = &text[..end];
    let mut hold = 0;
    for s in stops {
        for (i, _) in s.char_indices().skip(1) {
            if i > hold && head.ends_with(&s[..i]) {
                hold = i;
            }
        }
    }
    end - hold
}

/// Where the earliest match of a stop string ending past byte `after` of
/// `text` starts.
fn earliest_stop(text: &str, stops: &[String], after: usize) -> Option<usize> {
    stops
        .iter()
        .filter_map(|s| {
            // A match at `i` ends past `after` iff `i + len > after`: search
            // from the first such `i` (down to a character boundary, so check).
            let mut start = (after + 1).saturating_sub(s.len()).min(text.len());
            while !text.is_char_boundary(start) {
                start -= 1;
            }
            loop {
                let i = start + text[start..].find(s.as_str())?;
                if i + s.len() > after {
                    return Some(i);
                }
                start = i + text[i..].chars().next().map_or(1, char::len_utf8);
            }
        })
        .min()
}

/// Draw one token from `logits` under `p` (temperature, top-k, top-p,
/// min-p); the logits are used as given (see [`next_token`]).
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
    if p.top_k == 0 && p.top_p >= 1.0 && p.min_p <= 0.0 {
        // The whole vocabulary: f32 weights from the vectorized exp, summed
        // per block so the draw scans one block, not the whole vocabulary.
        return pick_all(logits, max as f32, inv_t as f32, rng).unwrap_or_else(argmax);
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
    if p.min_p > 0.0 {
        // Sorted: weights[0] is the most likely token's.
        let floor = weights.first().copied().unwrap_or(0.0) * p.min_p;
        let keep = weights.iter().take_while(|&&w| w >= floor).count().max(1);
        order.truncate(keep);
        weights.truncate(keep);
    }
    let total: f64 = weights.iter().sum();
    pick(&weights, &order, total, rng).unwrap_or_else(argmax)
}

/// Inverse-CDF draw: `weights[k]` is the mass of token `ids[k]`.
/// Logits per block of [`pick_all`]'s weights.
const PICK_BLOCK: usize = 512;

/// Draw from `e^((logit − max)·inv_t)` over every token: each block's
/// weights and f64 sum, then one draw `u` against the running sum of the
/// blocks and, within the block where it lands, of its weights.
fn pick_all(logits: &[f32], max: f32, inv_t: f32, rng: &mut impl Rng) -> Option<u32> {
    let mut weights = vec![0f32; logits.len()];
    let sums: Vec<f64> = logits
        .chunks(PICK_BLOCK)
        .zip(weights.chunks_mut(PICK_BLOCK))
        .map(|(x, w)| crate::kernels::exp_weights(x, max, inv_t, w))
        .collect();
    let total: f64 = sums.iter().sum();
    if !(total > 0.0 && total.is_finite()) {
        return None;
    }
    let u = rng.random::<f64>() * total;
    let mut cum = 0.0;
    for (b, &s) in sums.iter().enumerate() {
        if u < cum + s {
            let block = &weights[b * PICK_BLOCK..(b * PICK_BLOCK + PICK_BLOCK).min(logits.len())];
            for (i, &w) in block.iter().enumerate() {
                cum += w as f64;
                if u < cum {
                    return Some((b * PICK_BLOCK + i) as u32);
                }
            }
            // Rounding: the block's running sum fell short of `cum + s`;
            // go on from where it ended.
            continue;
        }
        cum += s;
    }
    weights.iter().rposition(|&w| w > 0.0).map(|i| i as u32)
}

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
    use rand::SeedableRng;
    use rand_chacha::ChaCha8Rng;

    /// `min_tokens`: only a stop string ending past the held-back text
    /// counts, overlapping matches included; the earliest such one wins.
    #[test]
    fn stops_count_only_past_the_held_back_text() {
        let stops = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert_eq!(earliest_stop("aaa", &stops(&["aa"]), 0), Some(0));
        assert_eq!(earliest_stop("aaa", &stops(&["aa"]), 2), Some(1));
        assert_eq!(earliest_stop("aaa", &stops(&["aa"]), 3), None);
        assert_eq!(earliest_stop("xyéz", &stops(&["z", "é"]), 3), Some(2));
        assert_eq!(earliest_stop("xyéz", &stops(&["z", "é"]), 4), Some(4));
        let mut eos_likely = vec![0.0f32; 4];
        eos_likely[3] = 50.0;
        let p = SamplingParams {
            temperature: 0.0,
            min_tokens: 2,
            stop_token_ids: vec![2],
            ..Default::default()
        };
        let mut rng = ChaCha8Rng::seed_from_u64(0);
        let mut l = eos_likely.clone();
        l[2] = 40.0;
        // EOS (3) and the stop id (2) are held back for two draws, then free.
        assert_eq!(next_token(&l, &p, &[], &[], &[3], &mut rng), 0);
        assert_eq!(next_token(&l, &p, &[], &[7], &[3], &mut rng), 0);
        assert_eq!(next_token(&l, &p, &[], &[7, 7], &[3], &mut rng), 3);
    }

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

    /// A vocabulary of several draw blocks, the mass spread over three of
    /// them (the first, a middle one, the last token), at temperature 0.5.
    #[test]
    fn a_large_vocabulary_draws_with_softmax_frequencies() {
        let mut logits = vec![-40.0f32; 3 * PICK_BLOCK + 7];
        let last = logits.len() - 1;
        let picks = [(0, 0.0f32), (PICK_BLOCK + 100, 0.5), (last, 1.0)];
        for &(i, l) in &picks {
            logits[i] = l;
        }
        let w: Vec<f64> = picks.iter().map(|&(_, l)| (l as f64 / 0.5).exp()).collect();
        let z: f64 = w.iter().sum();
        let p = SamplingParams {
            temperature: 0.5,
            ..Default::default()
        };
        let mut rng = ChaCha8Rng::seed_from_u64(7);
        let mut counts = [0usize; 3];
        for _ in 0..60_000 {
            let t = sample_token(&logits, &p, &mut rng) as usize;
            let k = picks
                .iter()
                .position(|&(i, _)| i == t)
                .expect("an unlikely token");
            counts[k] += 1;
        }
        for (c, wi) in counts.iter().zip(&w) {
            let f = *c as f64 / 60_000.0;
            assert!((f - wi / z).abs() < 0.01, "{counts:?}");
        }
    }

    #[test]
    fn stream_holds_back_possible_stop_prefixes() {
        let stops = vec!["</end>".to_string()];
        assert_eq!(streamable_len("hello </e", &stops), 6);
        assert_eq!(streamable_len("hello", &stops), 5);
        assert_eq!(streamable_len("ab\u{FFFD}", &[]), 2);
    }

    /// Frequencies of `n` draws from `logits` under `p` after `generated`.
    fn freqs(logits: &[f32], p: &SamplingParams, generated: &[u32], n: usize) -> Vec<f64> {
        let mut rng = ChaCha8Rng::seed_from_u64(3);
        let mut counts = vec![0usize; logits.len()];
        for _ in 0..n {
            counts[next_token(logits, p, &[], generated, &[], &mut rng) as usize] += 1;
        }
        counts.iter().map(|&c| c as f64 / n as f64).collect()
    }

    #[test]
    fn logit_bias_forces_and_bans_tokens() {
        let logits = [5.0f32, 0.0, 0.0, 0.0];
        let force = SamplingParams {
            logit_bias: vec![(2, 100.0)],
            ..Default::default()
        };
        assert_eq!(freqs(&logits, &force, &[], 500)[2], 1.0);
        let greedy_ban = SamplingParams {
            temperature: 0.0,
            logit_bias: vec![(0, -100.0)],
            ..Default::default()
        };
        let mut rng = ChaCha8Rng::seed_from_u64(0);
        assert_ne!(next_token(&logits, &greedy_ban, &[], &[], &[], &mut rng), 0);
        assert!(force.reshapes_distribution());
    }

    #[test]
    fn frequency_and_presence_penalties_move_mass_off_generated_tokens() {
        // Two equally likely tokens; token 0 was generated three times.
        let logits = [0.0f32, 0.0];
        let plain = freqs(&logits, &SamplingParams::default(), &[0, 0, 0], 20_000);
        assert!((plain[0] - 0.5).abs() < 0.02, "{plain:?}");
        let freq = SamplingParams {
            frequency_penalty: 0.5,
            ..Default::default()
        };
        // logit 0 becomes −1.5: p0 = 1 / (1 + e^1.5) ≈ 0.182.
        let f = freqs(&logits, &freq, &[0, 0, 0], 20_000);
        assert!((f[0] - 0.182).abs() < 0.02, "{f:?}");
        let pres = SamplingParams {
            presence_penalty: 0.5,
            ..Default::default()
        };
        // Once, whatever the count: p0 = 1 / (1 + e^0.5) ≈ 0.378.
        let f = freqs(&logits, &pres, &[0, 0, 0], 20_000);
        assert!((f[0] - 0.378).abs() < 0.02, "{f:?}");
        // A negative penalty encourages repeats.
        let neg = SamplingParams {
            frequency_penalty: -1.0,
            ..Default::default()
        };
        assert!(freqs(&logits, &neg, &[0], 5_000)[0] > 0.6);
    }

    #[test]
    fn repetition_penalty_divides_positive_and_multiplies_negative_logits() {
        let p = SamplingParams {
            repetition_penalty: 2.0,
            ..Default::default()
        };
        let mut l = vec![4.0f32, -1.0, 3.0, 1.0];
        // Token 0 in the prompt, token 1 generated; 2 and 3 unseen.
        process_logits(&mut l, &p, &[0], &[1]);
        assert_eq!(l, vec![2.0, -2.0, 3.0, 1.0]);
        // Greedy now prefers token 2 over the penalised token 0.
        let greedy = SamplingParams {
            temperature: 0.0,
            ..p
        };
        let mut rng = ChaCha8Rng::seed_from_u64(0);
        let logits = [4.0f32, -1.0, 3.0, 1.0];
        assert_eq!(next_token(&logits, &greedy, &[0], &[1], &[], &mut rng), 2);
    }

    #[test]
    fn min_p_masks_tokens_below_a_fraction_of_the_top() {
        // Probabilities ∝ 8, 4, 1, 1: with min_p 0.25 only 0 and 1 survive.
        let logits = [8f32.ln(), 4f32.ln(), 0.0, 0.0];
        let p = SamplingParams {
            min_p: 0.25,
            ..Default::default()
        };
        let f = freqs(&logits, &p, &[], 20_000);
        assert_eq!(f[2] + f[3], 0.0, "{f:?}");
        assert!((f[0] - 2.0 / 3.0).abs() < 0.02, "{f:?}");
        let off = freqs(&logits, &SamplingParams::default(), &[], 20_000);
        assert!(off[2] + off[3] > 0.1, "{off:?}");
    }

    #[test]
    fn a_mask_confines_sampling_and_renormalises() {
        // Probabilities ∝ 8, 4, 2, 2; token 0 masked out.
        let logits = [8f32.ln(), 4f32.ln(), 2f32.ln(), 2f32.ln()];
        let allowed = |i: usize| i != 0;
        let mut rng = ChaCha8Rng::seed_from_u64(5);
        let p = SamplingParams::default();
        let mut counts = [0usize; 4];
        for _ in 0..20_000 {
            let t =
                next_token_masked(&logits, &p, &[], &[], &[], allowed, &mut rng).expect("token");
            counts[t as usize] += 1;
        }
        assert_eq!(counts[0], 0, "{counts:?}");
        // 4 : 2 : 2 over what is left.
        assert!(
            (counts[1] as f64 / 20_000.0 - 0.5).abs() < 0.02,
            "{counts:?}"
        );
        let greedy = SamplingParams {
            temperature: 0.0,
            ..Default::default()
        };
        assert_eq!(
            next_token_masked(&logits, &greedy, &[], &[], &[], allowed, &mut rng),
            Some(1)
        );
        let top_k = SamplingParams {
            top_k: 1,
            ..Default::default()
        };
        assert_eq!(
            next_token_masked(&logits, &top_k, &[], &[], &[], |i| i >= 2, &mut rng),
            Some(2)
        );
        assert_eq!(
            next_token_masked(&logits, &p, &[], &[], &[], |_| false, &mut rng),
            None
        );
    }

    #[test]
    fn out_of_range_values_are_refused() {
        let bad = [
            SamplingParams {
                min_p: 1.5,
                ..Default::default()
            },
            SamplingParams {
                frequency_penalty: 3.0,
                ..Default::default()
            },
            SamplingParams {
                repetition_penalty: 0.0,
                ..Default::default()
            },
            SamplingParams {
                logit_bias: vec![(1, 101.0)],
                ..Default::default()
            },
        ];
        for p in bad {
            assert!(p.validate().is_err(), "{p:?}");
        }
        let ids = SamplingParams {
            stop_token_ids: vec![9],
            ..Default::default()
        };
        assert!(ids.validate_vocab(10).is_ok() && ids.validate_vocab(9).is_err());
    }
}
