//! What a request hands the scheduler ([`Job`]) and hears back ([`Event`],
//! [`Finished`]).

use std::sync::Arc;

use temper_model::{FinishReason, LoraAdapter, SamplingParams, TopLogprobs};
use tokio::sync::mpsc::UnboundedSender;

use crate::structured::Grammar;

/// A LoRA adapter as served: a name, the version (1 for the first load of
/// that name, +1 per reload) and the weights (an inference view).
#[derive(Debug)]
pub struct LoadedAdapter {
    /// Name clients put in `model`.
    pub name: String,
    /// Load count of this name.
    pub version: u64,
    /// The weights.
    pub lora: LoraAdapter,
}

/// A prompt to continue `n` times.
pub struct Job {
    /// Prompt token ids (non-empty, checked by the caller).
    pub prompt: Vec<u32>,
    /// Number of samples.
    pub n: usize,
    /// Events of sample `j` carry index `first_index + j` (several jobs
    /// may share one event channel).
    pub first_index: usize,
    /// How to sample; `logprobs` is ignored (see `top_logprobs`).
    pub params: SamplingParams,
    /// `Some(k)`: report each sampled token's logprob and its `k` most
    /// likely alternatives in [`Finished::top_logprobs`], taken from the decode
    /// logits when they are exact (see [`Finished::top_logprobs`]).
    pub top_logprobs: Option<usize>,
    /// `None`: the base model.
    pub adapter: Option<Arc<LoadedAdapter>>,
    /// Send [`Event::Delta`]s as text is generated.
    pub stream: bool,
    /// Where events go; dropping the receiver cancels the job.
    pub events: UnboundedSender<Event>,
    /// Structured output: each sample draws only tokens this grammar allows
    /// (each gets its own copy of this fresh state).
    pub grammar: Option<Grammar>,
    /// vLLM's `cache_salt`: the prefix cache shares this job's prompt only
    /// with jobs of the same salt (`None`: with unsalted jobs).
    pub cache_salt: Option<Arc<str>>,
}

/// What a job hears back.
#[derive(Debug)]
pub enum Event {
    /// New text of sample `index` (streaming jobs only). Text that could be
    /// the start of a stop string, or an incomplete UTF-8 character, is held
    /// back until it is resolved.
    Delta {
        /// Sample index in `0..n`.
        index: usize,
        /// Text to append.
        text: String,
    },
    /// Sample `index` is finished.
    Done(Finished),
    /// The job failed (an internal error; already logged).
    Failed(String),
    /// The job's own request made it fail (its grammar exhausted an engine
    /// limit while generating): a client error, not logged as the server's.
    Rejected(String),
}

/// A finished sample.
#[derive(Debug, Clone)]
pub struct Finished {
    /// Sample index in `0..n`.
    pub index: usize,
    /// Generated token ids (a final stop token included).
    pub tokens: Vec<u32>,
    /// Text without special tokens, cut before a matched stop string, without
    /// a final stop token.
    pub text: String,
    /// Why it ended.
    pub finish_reason: FinishReason,
    /// Each token's `log softmax(logits / T)` (`T = 1` when greedy) and top
    /// alternatives, when the job asked for `top_logprobs` and the decode logits
    /// are bit-identical to the trainer's
    /// ([`temper_model::Model::decode_logits_are_exact`]): then they equal
    /// [`temper_model::Model::score_with_top`]'s without a second forward.
    /// `None` otherwise: the caller scores the finished sequence.
    pub top_logprobs: Option<TopLogprobs>,
}

impl Job {
    pub(super) fn adapter_key(&self) -> usize {
        self.adapter.as_ref().map_or(0, |a| Arc::as_ptr(a) as usize)
    }
}
