//! Sampling: the next token of every running sequence, streamed text, and
//! finished sequences retired (into the prefix cache).

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::Ordering;

use rayon::prelude::*;
use temper_model::decode::{
    check_stop, next_token, next_token_masked, scoring_temperature, streamable_len, visible_text,
};
use temper_model::kernels::{row_log_softmax, row_logprob};
use temper_model::top_k;

use super::{BatchLoop, Seq};
use crate::scheduler::job::{Event, Finished};
use crate::scheduler::unwind::panic_message;

/// Draw `seq`'s next token from its logits (under its grammar's mask) and,
/// when asked and `exact`, record the token's logprob and top alternatives.
fn pick(seq: &mut Seq, exact: bool, eos: &[u32]) -> Result<u32, StepError> {
    let p = &seq.job.params;
    let tok = match &mut seq.grammar {
        None => next_token(
            &seq.logits,
            p,
            &seq.job.prompt,
            &seq.tokens,
            eos,
            &mut seq.rng,
        ),
        Some(g) => {
            let mask = g.mask()?;
            next_token_masked(
                &seq.logits,
                p,
                &seq.job.prompt,
                &seq.tokens,
                eos,
                |i| mask.allows(i),
                &mut seq.rng,
            )
            .ok_or(StepError::EmptyMask)?
        }
    };
    if let (Some(k), true) = (seq.job.top_logprobs, exact) {
        // The unmasked, unprocessed model's distribution (what training
        // scores), reduced as the trainer's LM head reduces it.
        let t = scoring_temperature(p.temperature);
        if k == 0 {
            seq.top_logprobs
                .logprobs
                .push(row_logprob(&seq.logits, tok as usize, t));
            seq.top_logprobs.top.push(Vec::new());
        } else {
            let row = row_log_softmax(&seq.logits, t);
            seq.top_logprobs.logprobs.push(row[tok as usize]);
            seq.top_logprobs.top.push(top_k(&row, k));
        }
    }
    Ok(tok)
}

/// Why a sampling step failed.
#[derive(Debug, thiserror::Error)]
enum StepError {
    #[error(transparent)]
    Model(#[from] temper_model::ModelError),
    #[error(transparent)]
    Grammar(#[from] crate::structured::StructuredError),
    #[error("the grammar allows no token of the model's vocabulary")]
    EmptyMask,
    #[error("sampling panicked: {0}")]
    Panicked(String),
}

impl BatchLoop {
    /// Draw the next token of every running sequence; retire the finished
    /// and the cancelled.
    pub(super) fn sample_all(&mut self) {
        let eos = self.model.generation.eos_token_ids.clone();
        let mut keep = Vec::with_capacity(self.running.len());
        let mut running = std::mem::take(&mut self.running);
        running.retain(|s| !s.job.events.is_closed());
        // Drawing a token (and its logprobs) reads the sequence's own
        // logits and random stream only: sequences run across threads,
        // with the same result as one after another.
        let exact = self.exact_logprobs;
        let picks: Vec<Result<u32, StepError>> = running
            .par_iter_mut()
            .map(|s| {
                // A panic fails this sequence alone: it is dropped.
                catch_unwind(AssertUnwindSafe(|| pick(s, exact, &eos)))
                    .unwrap_or_else(|p| Err(StepError::Panicked(panic_message(&*p))))
            })
            .collect();
        let mut generated = 0u64;
        for (mut seq, tok) in running.into_iter().zip(picks) {
            generated += 1;
            let step = tok.and_then(|tok| {
                catch_unwind(AssertUnwindSafe(|| self.sample_one(&mut seq, tok, &eos)))
                    .unwrap_or_else(|p| Err(StepError::Panicked(panic_message(&*p))))
            });
            match step {
                Ok(None) => keep.push(seq),
                Ok(Some(done)) => {
                    if self.prefix_cache.budget > 0 {
                        // Every token the cache holds: the prompt and every
                        // generated token but the last, which was never run
                        // through the model.
                        let cached_ids: Vec<u32> = seq
                            .job
                            .prompt
                            .iter()
                            .chain(&done.tokens)
                            .take(seq.cache.len())
                            .copied()
                            .collect();
                        // An exact-size copy: a running cache's buffers have
                        // room to grow (up to twice its length), and the
                        // budget counts tokens.
                        match seq.cache.truncated(seq.cache.len()) {
                            Ok(cache) => self.prefix_cache.insert(
                                cached_ids,
                                cache,
                                seq.job.adapter.clone(),
                                seq.job.cache_salt.clone(),
                            ),
                            Err(e) => tracing::warn!("prefix cache: {e}"),
                        }
                    }
                    let _ = seq.job.events.send(Event::Done(done));
                }
                Err(e @ (StepError::Grammar(_) | StepError::EmptyMask)) => {
                    // The request's own schema hit an engine limit: its
                    // client hears why; the log gets one short line at
                    // debug level (a client can cause these at will).
                    tracing::debug!("constrained sample refused: {e:.200}");
                    let _ = seq.job.events.send(Event::Rejected(format!("{e}")));
                }
                Err(e) => {
                    tracing::error!("sampling failed: {e}");
                    let _ = seq.job.events.send(Event::Failed(format!("{e}")));
                }
            }
        }
        self.metrics
            .generation_tokens
            .fetch_add(generated, Ordering::Relaxed);
        self.running = keep;
    }

    /// Take `tok` (from [`pick`]) as `seq`'s next token; when the sequence
    /// ends, what to report.
    fn sample_one(
        &self,
        seq: &mut Seq,
        tok: u32,
        eos: &[u32],
    ) -> Result<Option<Finished>, StepError> {
        let tokenizer = &self.model.tokenizer;
        let p = &seq.job.params;
        seq.tokens.push(tok);
        let full = seq.cache.len() + 1 >= self.cfg.max_model_len;
        let check = check_stop(&seq.tokens, p, eos, tokenizer, full, seq.job.stream)?;
        if check.finish.is_none() {
            if let Some(g) = &mut seq.grammar {
                g.advance(tok)?;
            }
        }
        if let (Some(text), true) = (&check.text, seq.job.stream) {
            let end = streamable_len(text, &p.stop);
            if end > seq.sent.len() && text.starts_with(seq.sent.as_str()) {
                let delta = text[seq.sent.len()..end].to_string();
                seq.sent.push_str(&delta);
                let _ = seq.job.events.send(Event::Delta {
                    index: seq.job.first_index + seq.index,
                    text: delta,
                });
            }
        }
        let Some(finish_reason) = check.finish else {
            return Ok(None);
        };
        let text = visible_text(
            &seq.tokens,
            finish_reason,
            check.stop_text,
            p.skip_special_tokens,
            tokenizer,
        )?;
        Ok(Some(Finished {
            index: seq.job.first_index + seq.index,
            tokens: std::mem::take(&mut seq.tokens),
            text,
            finish_reason,
            top_logprobs: (seq.job.top_logprobs.is_some() && self.exact_logprobs)
                .then(|| std::mem::take(&mut seq.top_logprobs)),
        }))
    }
}
