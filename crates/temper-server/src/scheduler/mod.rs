//! Continuous batching: one engine thread owns the model's compute and runs
//! a loop of steps. Each step
//!
//! 1. takes new jobs off the queue (FIFO) while they fit — at most
//!    `max_running` sequences, and the KV-cache tokens in use plus the new
//!    prompts within a budget — and prefills at most `max_prefill_tokens`
//!    prompt tokens in one packed forward per adapter: short prompts whole,
//!    a long one in chunks over several steps (chunked prefill), so a long
//!    prompt never stalls the running sequences for more than one chunk; the
//!    `n` samples of a prompt share that prefill (their caches start as
//!    clones), and a prompt that starts with a finished sequence's tokens
//!    (the next turn of a conversation) starts from that sequence's cache
//!    ([`PrefixCache`](prefix_cache::PrefixCache));
//! 2. samples the next token of every running sequence, streams text deltas
//!    and retires finished sequences, whose slots the next step reuses;
//! 3. if the caches would outgrow the budget, evicts the most recently
//!    admitted sequences (vLLM's recompute preemption): they keep their
//!    tokens and random state and resume, before any new job, by prefilling
//!    prompt + tokens again;
//! 4. runs one batched decode forward per adapter
//!    ([`temper_model::Model::forward_decode`]: linear layers and attention
//!    over all sequences at once) on the last token of every surviving
//!    sequence.
//!
//! So requests join and leave the batch at every step. A job whose client
//! went away (its event receiver dropped) is retired at the next step.
//! Tokens are drawn and sequences ended by [`temper_model::decode`], the
//! rules [`temper_model::Sampler`] uses too (a structured-output job also
//! masks each step's logits with its sample's [`Grammar`](crate::structured::Grammar), see
//! [`crate::structured`]), with a ChaCha8 stream per
//! sample seeded as the sampler seeds it: same seed, same prompt, same weights ⇒
//! same tokens, whatever else is running. Logprobs (when a job asks) are taken
//! from each step's logits where those are bit-identical to the trainer's
//! ([`temper_model::Model::decode_logits_are_exact`]: the CPU in f32); elsewhere
//! callers score finished sequences with
//! [`temper_model::Model::score_with_top`], the trainer's own forward. Either
//! way reported logprobs match training bit for bit.
//!
//! A panic in one batch's work (a kernel `assert!` tripped by a request, a
//! tokenizer or grammar bug) is caught around that work: the requests of
//! that batch fail with a 500 naming the panic and the loop goes on, since
//! the state it drops (their caches, their sequences) is all the failed
//! work touched. A panic anywhere else in the loop leaves state that cannot
//! be trusted: the engine is marked dead with the reason, every request it
//! holds fails, and `/health` answers 503 with that reason
//! ([`Scheduler::dead`]).
//!
//! The files: `job` (what a request hands the scheduler and hears back),
//! `config`, `prefix_cache`, `unwind` (a panic fails its batch's work
//! alone), and the engine thread's `batch_loop` split by concern:
//! admission and prefill, sampling, the model forwards.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, OnceLock};

use temper_model::Pretrained;

use crate::metrics::Metrics;

mod batch_loop;
mod config;
#[cfg(feature = "fault-hooks")]
pub mod fault;
mod job;
mod prefix_cache;
mod unwind;

pub use config::SchedulerConfig;
pub use job::{Event, Finished, Job, LoadedAdapter};

use batch_loop::BatchLoop;

/// Why a job was not queued.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SubmitError {
    /// The queue is full.
    #[error("the server is overloaded: {waiting} requests are waiting (limit {max}); retry later")]
    Overloaded {
        /// Requests waiting.
        waiting: usize,
        /// The limit.
        max: usize,
    },
    /// The job could never fit the KV-cache budget.
    #[error("the request needs {need} KV-cache tokens ({n} × (prompt {prompt} + max_tokens {max_tokens})), more than the server's budget of {budget}; lower n or max_tokens")]
    TooLarge {
        /// Tokens it would reserve.
        need: usize,
        /// Samples.
        n: usize,
        /// Prompt tokens.
        prompt: usize,
        /// Completion tokens.
        max_tokens: usize,
        /// The budget.
        budget: usize,
    },
    /// The engine thread is gone.
    #[error("the inference engine stopped: {0}")]
    Stopped(String),
}

/// Handle to the engine thread; dropping every handle stops it.
pub struct Scheduler {
    tx: mpsc::Sender<Job>,
    waiting: Arc<AtomicUsize>,
    cfg: SchedulerConfig,
    metrics: Arc<Metrics>,
    /// Why the engine thread is gone, once it is (set once, read lock-free).
    dead: Arc<OnceLock<String>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Scheduler {
    /// Start the engine thread over `model`.
    pub fn start(model: Arc<Pretrained>, cfg: SchedulerConfig, metrics: Arc<Metrics>) -> Self {
        let (tx, rx) = mpsc::channel();
        let waiting = Arc::new(AtomicUsize::new(0));
        // Not exact (or not known): callers re-score finished sequences,
        // which is slower but equally right.
        let exact_logprobs = model.model.decode_logits_are_exact().unwrap_or_else(|e| {
            tracing::warn!("cannot tell whether decode logits are exact ({e}); re-scoring instead");
            false
        });
        metrics
            .kv_budget
            .store(cfg.kv_budget_tokens as u64, Ordering::Relaxed);
        let dead = Arc::new(OnceLock::new());
        let batch_loop = BatchLoop::new(
            model,
            cfg.clone(),
            rx,
            waiting.clone(),
            metrics.clone(),
            exact_logprobs,
            dead.clone(),
        );
        let spawned = std::thread::Builder::new()
            .name("temper-engine".into())
            .spawn(move || batch_loop.run());
        let thread = match spawned {
            Ok(h) => Some(h),
            Err(e) => {
                // The sender's receiver is gone with the closure: submits
                // fail with `Stopped` instead of hanging.
                tracing::error!("cannot start the engine thread: {e}");
                let _ = dead.set(format!("the engine thread could not start: {e}"));
                None
            }
        };
        Self {
            tx,
            waiting,
            cfg,
            metrics,
            dead,
            thread,
        }
    }

    /// Why the engine thread is gone, or `None` while it runs (`/health`
    /// answers 503 with this reason).
    pub fn dead(&self) -> Option<String> {
        if let Some(why) = self.dead.get() {
            return Some(why.clone());
        }
        // The thread only returns on its own when every handle is dropped,
        // so while this one lives a finished thread is a dead engine.
        match &self.thread {
            Some(h) if h.is_finished() => Some("the engine thread exited".into()),
            Some(_) => None,
            None => Some("the engine thread could not start".into()),
        }
    }

    /// The limits.
    pub fn config(&self) -> &SchedulerConfig {
        &self.cfg
    }

    /// KV-cache tokens a job needs at most (all samples at full length).
    pub fn reservation(&self, prompt: usize, max_tokens: usize, n: usize) -> usize {
        n * (prompt + max_tokens).min(self.cfg.max_model_len)
    }

    /// Queue a job, or refuse it at once.
    pub fn submit(&self, job: Job) -> Result<(), SubmitError> {
        if let Some(why) = self.dead() {
            return Err(SubmitError::Stopped(why));
        }
        let need = self.reservation(job.prompt.len(), job.params.max_tokens, job.n);
        if need > self.cfg.kv_budget_tokens {
            return Err(SubmitError::TooLarge {
                need,
                n: job.n,
                prompt: job.prompt.len(),
                max_tokens: job.params.max_tokens,
                budget: self.cfg.kv_budget_tokens,
            });
        }
        let waiting = self.waiting.fetch_add(1, Ordering::SeqCst);
        if waiting >= self.cfg.max_queue {
            self.waiting.fetch_sub(1, Ordering::SeqCst);
            self.metrics.rejected.fetch_add(1, Ordering::Relaxed);
            return Err(SubmitError::Overloaded {
                waiting,
                max: self.cfg.max_queue,
            });
        }
        self.metrics
            .waiting
            .store((waiting + 1) as u64, Ordering::Relaxed);
        self.tx.send(job).map_err(|_| {
            self.waiting.fetch_sub(1, Ordering::SeqCst);
            SubmitError::Stopped(
                self.dead()
                    .unwrap_or_else(|| "the engine thread is gone".into()),
            )
        })
    }
}
