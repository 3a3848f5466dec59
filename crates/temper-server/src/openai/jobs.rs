//! From a parsed request to scheduler jobs and back: resolve the model and
//! settle lengths, submit every choice, collect the finished samples, and
//! score them for logprobs.

use std::sync::Arc;
use std::time::Instant;

use temper_model::TopLogprobs;
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};

use super::error::OpenAiError;
use super::protocol::{cache_salt_field, Sampling, VllmFields};

use super::state::OpenAiState;
use crate::scheduler::{Event, Finished, Job, LoadedAdapter, SubmitError};
use crate::structured::Grammar;

/// A request ready for the scheduler.
pub(super) struct Prepared {
    /// Set when the request belongs to an episode (token capture).
    pub(super) capture: Option<super::capture::CaptureCtx>,
    pub(super) prompts: Vec<Vec<u32>>,
    pub(super) sampling: Sampling,
    pub(super) adapter: Option<Arc<LoadedAdapter>>,
    pub(super) model_name: String,
    pub(super) version: u64,
    pub(super) top_logprobs: usize,
    pub(super) logprobs: bool,
    /// Structured output: the fresh grammar state every sample starts from.
    pub(super) grammar: Option<Grammar>,
    /// vLLM's request extensions.
    pub(super) vllm: Extensions,
}

/// vLLM's request extensions, checked.
#[derive(Debug, Clone, Default)]
pub(super) struct Extensions {
    /// The prefix cache's partition (see [`crate::scheduler::Job::cache_salt`]).
    pub(super) cache_salt: Option<Arc<str>>,
    /// Return `prompt_token_ids` and each choice's `token_ids`.
    pub(super) return_token_ids: bool,
    /// Logprob tokens as `token_id:<id>`.
    pub(super) tokens_as_ids: bool,
}

impl VllmFields {
    /// Check into [`Extensions`].
    pub(super) fn check(self) -> Result<Extensions, OpenAiError> {
        Ok(Extensions {
            cache_salt: cache_salt_field(self.cache_salt)?,
            return_token_ids: self.return_token_ids.unwrap_or(false),
            tokens_as_ids: self.return_tokens_as_token_ids.unwrap_or(false),
        })
    }
}

impl Prepared {
    pub(super) fn fingerprint(&self) -> String {
        format!("{}@v{}", self.model_name, self.version)
    }

    pub(super) fn prompt_tokens(&self) -> usize {
        self.prompts.iter().map(Vec::len).sum()
    }

    pub(super) fn total_choices(&self) -> usize {
        self.prompts.len() * self.sampling.n
    }

    /// What the scheduler should record per token: logprobs and top
    /// alternatives when the client asked, logprobs alone when the call is
    /// captured, nothing otherwise.
    fn top_logprobs(&self) -> Option<usize> {
        if self.logprobs {
            Some(self.top_logprobs)
        } else {
            self.capture.as_ref().map(|_| 0)
        }
    }
}

/// Resolve the model, check lengths, settle `max_tokens`.
pub(super) fn prepare(
    s: &OpenAiState,
    model: &str,
    prompts: Vec<Vec<u32>>,
    mut sampling: Sampling,
    max_tokens: Option<usize>,
    default_max_tokens: Option<usize>,
    what: &str,
) -> Result<Prepared, OpenAiError> {
    let adapter = s.resolve(model)?;
    let len = s.inner.cfg.scheduler.max_model_len;
    let vocab = s.inner.model.config.vocab_size;
    let budget = s.inner.cfg.scheduler.kv_budget_tokens;
    let n = sampling.n;
    sampling.params.validate_vocab(vocab).map_err(|e| {
        let field = if e.to_string().starts_with("logit_bias") {
            "logit_bias"
        } else {
            "stop_token_ids"
        };
        OpenAiError::invalid(field, e.to_string())
    })?;
    let mut settled = usize::MAX;
    for p in &prompts {
        if p.is_empty() {
            return Err(OpenAiError::invalid(
                "prompt",
                "the prompt must not be empty",
            ));
        }
        if let Some(&bad) = p.iter().find(|&&t| t as usize >= vocab) {
            return Err(OpenAiError::invalid(
                "prompt",
                format!("token id {bad} is out of range for vocabulary size {vocab}"),
            ));
        }
        let exceeded = |requested: String| {
            OpenAiError::BadRequest {
            message: format!(
                "This model's maximum context length is {len} tokens. However, you requested {requested}. Please reduce the length of the {what} or completion."
            ),
            param: Some("messages".into()),
            code: Some("context_length_exceeded"),
        }
        };
        if p.len() >= len {
            return Err(exceeded(format!(
                "{} tokens in the {what}, which leaves no room for a completion",
                p.len()
            )));
        }
        let m = match max_tokens {
            Some(m) => {
                if p.len() + m > len {
                    return Err(exceeded(format!(
                        "{} tokens ({} in the {what}, {m} in the completion)",
                        p.len() + m,
                        p.len()
                    )));
                }
                m
            }
            None => {
                // Unset: the rest of the context (capped by `default_max_tokens`),
                // shrunk to what the KV budget can ever hold.
                let rest = len - p.len();
                let rest = default_max_tokens.map_or(rest, |d| d.min(rest));
                let fits = (budget / n).saturating_sub(p.len());
                rest.min(fits).max(1)
            }
        };
        settled = settled.min(m);
    }
    sampling.params.max_tokens = settled;
    if sampling.params.min_tokens > settled {
        return Err(OpenAiError::invalid(
            "min_tokens",
            format!(
                "min_tokens must be less than or equal to max_tokens={settled}, got {}",
                sampling.params.min_tokens
            ),
        ));
    }
    let (model_name, version) = match &adapter {
        Some(a) => (a.name.clone(), a.version),
        None => (s.inner.cfg.model_name.clone(), 0),
    };
    Ok(Prepared {
        capture: None,
        prompts,
        sampling,
        adapter,
        model_name,
        version,
        top_logprobs: 0,
        logprobs: false,
        grammar: None,
        vllm: Extensions::default(),
    })
}

/// Queue every prompt of `p` on one event channel (choice index =
/// prompt index × n + sample index).
pub(super) fn submit(
    s: &OpenAiState,
    p: &Prepared,
    stream: bool,
) -> Result<UnboundedReceiver<Event>, OpenAiError> {
    // Each prompt is queued as one job: a request with more prompts than the
    // queue holds could never be admitted, so it is a 400, not a "retry".
    // (`--max-queue 0` is draining: every request is a 503.)
    let max_queue = s.inner.scheduler.config().max_queue;
    if p.prompts.len() > max_queue.max(1) {
        return Err(OpenAiError::BadRequest {
            message: format!(
                "this request has {} prompts; the server queues at most {max_queue} (--max-queue): split it",
                p.prompts.len()
            ),
            param: Some("prompt".into()),
            code: None,
        });
    }
    let (tx, rx) = unbounded_channel();
    for (i, prompt) in p.prompts.iter().enumerate() {
        let job = Job {
            prompt: prompt.clone(),
            n: p.sampling.n,
            first_index: i * p.sampling.n,
            params: p.sampling.params.clone(),
            top_logprobs: p.top_logprobs(),
            adapter: p.adapter.clone(),
            stream,
            events: tx.clone(),
            grammar: p.grammar.as_ref().map(Grammar::fork),
            cache_salt: p.vllm.cache_salt.clone(),
        };
        s.inner.scheduler.submit(job).map_err(|e| match e {
            SubmitError::Overloaded { .. } => OpenAiError::Overloaded(e.to_string()),
            SubmitError::TooLarge { .. } => OpenAiError::BadRequest {
                message: e.to_string(),
                param: Some("max_tokens".into()),
                code: Some("context_length_exceeded"),
            },
            SubmitError::Stopped(_) => OpenAiError::Unavailable(e.to_string()),
        })?;
    }
    Ok(rx)
}

/// Wait for every choice; `Finished` in choice order.
pub(super) async fn collect(
    s: &OpenAiState,
    mut rx: UnboundedReceiver<Event>,
    total: usize,
    started: Instant,
) -> Result<Vec<Finished>, OpenAiError> {
    let mut out: Vec<Option<Finished>> = vec![None; total];
    let mut left = total;
    let mut first = true;
    while left > 0 {
        match rx.recv().await {
            Some(Event::Done(f)) => {
                if first {
                    s.inner
                        .metrics
                        .ttft
                        .observe(started.elapsed().as_secs_f64());
                    first = false;
                }
                let i = f.index;
                if i < total && out[i].is_none() {
                    out[i] = Some(f);
                    left -= 1;
                }
            }
            Some(Event::Delta { .. }) => {}
            Some(Event::Failed(m)) => return Err(OpenAiError::Engine(m)),
            Some(Event::Rejected(m)) => return Err(OpenAiError::grammar_limit(m)),
            None => return Err(OpenAiError::Internal("the engine dropped a request".into())),
        }
    }
    s.inner
        .metrics
        .latency
        .observe(started.elapsed().as_secs_f64());
    Ok(out.into_iter().flatten().collect())
}

/// Canonical logprobs of choice `f`'s tokens after `prompt` with the `k`
/// most likely alternatives (see the module docs): the scheduler's, taken
/// from the decode logits, when it has them; otherwise (or with
/// `prompt_too`: also of the prompt's tokens 1.., for `echo`) by
/// [`temper_model::Model::score_with_top`] on the finished sequence.
pub(super) async fn score(
    s: &OpenAiState,
    adapter: Option<Arc<LoadedAdapter>>,
    prompt: &[u32],
    f: &Finished,
    temperature: f64,
    k: usize,
    prompt_too: bool,
) -> Result<TopLogprobs, OpenAiError> {
    if let (Some(d), false) = (&f.top_logprobs, prompt_too) {
        let vocab = s.inner.model.config.vocab_size;
        if d.logprobs.len() == f.tokens.len() && d.top.iter().all(|t| t.len() == k.min(vocab)) {
            return Ok(d.clone());
        }
        tracing::warn!("decode logprobs do not cover the choice; re-scoring it");
    }
    let model = s.inner.model.clone();
    let t = temper_model::decode::scoring_temperature(temperature);
    let full: Vec<u32> = prompt.iter().chain(&f.tokens).copied().collect();
    let completion = f.tokens.len();
    tokio::task::spawn_blocking(move || {
        let lora = adapter.as_ref().map(|a| &a.lora);
        let mut r = model
            .model
            .score_with_top(&full[..full.len() - 1], &full[1..], lora, t, k)?;
        if !prompt_too {
            let skip = r.logprobs.len() - completion;
            r.logprobs.drain(..skip);
            r.top.drain(..skip);
        }
        Ok::<_, temper_model::ModelError>(r)
    })
    .await
    .map_err(|e| OpenAiError::Internal(format!("scoring task: {e}")))?
    .map_err(|e| OpenAiError::Internal(format!("scoring: {e}")))
}
