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
//!    ([`PrefixCache`]);
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
//! masks each step's logits with its sample's [`Grammar`], see
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

use std::collections::VecDeque;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, OnceLock};

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rayon::prelude::*;
use temper_model::candle_core::{DType, Tensor};
use temper_model::decode::{
    check_stop, next_token, next_token_masked, scoring_temperature, streamable_len, visible_text,
};
use temper_model::kernels::{row_log_softmax, row_logprob};
use temper_model::{
    top_k, FinishReason, KvCache, LoraAdapter, Pretrained, SamplingParams, Segment, TopLogprobs,
};
use tokio::sync::mpsc::UnboundedSender;

use crate::metrics::Metrics;
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

/// Limits of the scheduler.
#[derive(Debug, Clone)]
pub struct SchedulerConfig {
    /// Most sequences decoded at once.
    pub max_running: usize,
    /// KV-cache tokens that running sequences may reserve in total.
    pub kv_budget_tokens: usize,
    /// Most requests waiting for admission; more are refused (503).
    pub max_queue: usize,
    /// Longest sequence (prompt + completion) in tokens.
    pub max_model_len: usize,
    /// Prompt tokens prefilled per step; a longer prompt is prefilled in
    /// chunks of this size over several steps.
    pub max_prefill_tokens: usize,
    /// KV-cache tokens of finished sequences kept for reuse by prompts that
    /// start with them (0: off). See [`PrefixCache`].
    pub prefix_cache_tokens: usize,
}

/// KV caches of finished sequences, kept so that a prompt starting with one
/// of their token sequences — the next call of a multi-turn conversation,
/// which resends the whole history; a shared system prompt — is prefilled
/// only past the shared prefix. The result is bit-identical to prefilling
/// the whole prompt: every kernel gives a token the same values whether its
/// keys and values came from a cache or from a one-shot prefill (the
/// invariance contract, `docs/kernels.md`). Entries are per adapter
/// version and per cache salt (vLLM's `cache_salt`: requests share cached
/// prefixes only with requests of the same salt, so one tenant cannot time
/// another's prompts), bounded by a token budget, evicted least recently
/// used first.
struct PrefixCache {
    /// Least recently used first.
    entries: VecDeque<PrefixEntry>,
    tokens: usize,
    budget: usize,
}

struct PrefixEntry {
    /// The token ids whose keys and values `cache` holds.
    ids: Vec<u32>,
    cache: KvCache,
    /// Held so the key (its address) stays unique while the entry lives.
    adapter: Option<Arc<LoadedAdapter>>,
    salt: Option<Arc<str>>,
}

impl PrefixEntry {
    fn adapter_key(&self) -> usize {
        self.adapter.as_ref().map_or(0, |a| Arc::as_ptr(a) as usize)
    }

    fn matches(&self, key: usize, salt: Option<&str>) -> bool {
        self.adapter_key() == key && self.salt.as_deref() == salt
    }
}

impl PrefixCache {
    fn new(budget: usize) -> Self {
        Self {
            entries: VecDeque::new(),
            tokens: 0,
            budget,
        }
    }

    /// Keep `cache` (holding `ids`); entries it extends are dropped.
    fn insert(
        &mut self,
        ids: Vec<u32>,
        cache: KvCache,
        adapter: Option<Arc<LoadedAdapter>>,
        salt: Option<Arc<str>>,
    ) {
        if ids.is_empty() || ids.len() > self.budget || cache.len() != ids.len() {
            return;
        }
        let entry = PrefixEntry {
            ids,
            cache,
            adapter,
            salt,
        };
        let key = entry.adapter_key();
        let salt = entry.salt.clone();
        let before = self.entries.len();
        self.entries
            .retain(|e| !(e.matches(key, salt.as_deref()) && entry.ids.starts_with(&e.ids)));
        if self.entries.len() != before {
            self.tokens = self.entries.iter().map(|e| e.ids.len()).sum();
        }
        self.tokens += entry.ids.len();
        self.entries.push_back(entry);
        while self.tokens > self.budget {
            match self.entries.pop_front() {
                Some(old) => self.tokens -= old.ids.len(),
                None => break,
            }
        }
    }

    /// A copy of the longest cached prefix of `prompt` under adapter `key`
    /// and `salt`, leaving at least the prompt's last token to prefill (its
    /// logits are needed); `None` when nothing is shared.
    fn lookup(&mut self, prompt: &[u32], key: usize, salt: Option<&str>) -> Option<KvCache> {
        let usable = prompt.len().saturating_sub(1);
        let (at, len) = self
            .entries
            .iter()
            .enumerate()
            .filter(|(_, e)| e.matches(key, salt))
            .map(|(i, e)| {
                let common = e.ids.iter().zip(prompt).take_while(|(a, b)| a == b).count();
                (i, common.min(usable))
            })
            .max_by_key(|&(i, len)| (len, i))?;
        if len == 0 {
            return None;
        }
        let entry = self.entries.remove(at)?;
        let copy = entry.cache.truncated(len);
        self.entries.push_back(entry);
        match copy {
            Ok(c) => Some(c),
            Err(e) => {
                tracing::warn!("prefix cache: {e}");
                None
            }
        }
    }
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
    /// How to sample; `logprobs` is ignored (see `scores`).
    pub params: SamplingParams,
    /// `Some(k)`: report each sampled token's logprob and its `k` most
    /// likely alternatives in [`Finished::scores`], taken from the decode
    /// logits when they are exact (see [`Finished::scores`]).
    pub scores: Option<usize>,
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
    /// alternatives, when the job asked for `scores` and the decode logits
    /// are bit-identical to the trainer's
    /// ([`temper_model::Model::decode_logits_are_exact`]): then they equal
    /// [`temper_model::Model::score_with_top`]'s without a second forward.
    /// `None` otherwise: the caller scores the finished sequence.
    pub scores: Option<TopLogprobs>,
}

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

/// The message of a caught panic's payload (`panic!` gives a `&str` or a
/// `String`).
fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic without a message".into())
}

/// Run `work`, turning a panic into an error that names it (`what` says
/// which work).
fn unwinding<T, E: std::fmt::Display>(
    what: &str,
    work: impl FnOnce() -> Result<T, E>,
) -> Result<T, String> {
    match catch_unwind(AssertUnwindSafe(work)) {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(format!("{what} failed: {e}")),
        Err(p) => Err(format!("{what} panicked: {}", panic_message(&*p))),
    }
}

/// Test hooks that make the engine panic as a kernel `assert!` would
/// (feature `fault-hooks`, enabled only by this crate's tests).
#[cfg(feature = "fault-hooks")]
pub mod fault {
    use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};

    static PANIC_ON_TOKEN: AtomicU32 = AtomicU32::new(u32::MAX);
    static PANIC_IN_LOOP: AtomicBool = AtomicBool::new(false);

    /// Every prefill forward over a prompt holding token `id` panics.
    pub fn panic_on_token(id: u32) {
        PANIC_ON_TOKEN.store(id, Ordering::SeqCst);
    }

    /// The loop's next step panics outside any batch's work (once).
    pub fn panic_in_loop() {
        PANIC_IN_LOOP.store(true, Ordering::SeqCst);
    }

    pub(super) fn check_prefill(ids: &[u32]) {
        let id = PANIC_ON_TOKEN.load(Ordering::SeqCst);
        assert!(!ids.contains(&id), "fault hook: token {id} in a prefill");
    }

    pub(super) fn check_loop() {
        if PANIC_IN_LOOP.swap(false, Ordering::SeqCst) {
            panic!("fault hook: the batch loop's own state");
        }
    }
}

impl Scheduler {
    /// Start the engine thread over `model`.
    pub fn start(model: Arc<Pretrained>, cfg: SchedulerConfig, metrics: Arc<Metrics>) -> Self {
        let (tx, rx) = mpsc::channel();
        let waiting = Arc::new(AtomicUsize::new(0));
        // Not exact (or not known): callers re-score finished sequences,
        // which is slower but equally right.
        let exact_scores = model.model.decode_logits_are_exact().unwrap_or_else(|e| {
            tracing::warn!("cannot tell whether decode logits are exact ({e}); re-scoring instead");
            false
        });
        metrics
            .kv_budget
            .store(cfg.kv_budget_tokens as u64, Ordering::Relaxed);
        let dead = Arc::new(OnceLock::new());
        let batch_loop = BatchLoop {
            dead: dead.clone(),
            model,
            cfg: cfg.clone(),
            rx,
            waiting_count: waiting.clone(),
            metrics: metrics.clone(),
            waiting: VecDeque::new(),
            running: Vec::new(),
            preempted: VecDeque::new(),
            prefilling: Vec::new(),
            exact_scores,
            prefix_cache: PrefixCache::new(cfg.prefix_cache_tokens),
        };
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

struct JobCtx {
    first_index: usize,
    prompt: Vec<u32>,
    params: SamplingParams,
    adapter: Option<Arc<LoadedAdapter>>,
    stream: bool,
    events: UnboundedSender<Event>,
    scores: Option<usize>,
    cache_salt: Option<Arc<str>>,
}

impl Job {
    fn adapter_key(&self) -> usize {
        self.adapter.as_ref().map_or(0, |a| Arc::as_ptr(a) as usize)
    }
}

/// The distinct values of `keys`, in first-seen order.
fn distinct(keys: impl Iterator<Item = usize>) -> Vec<usize> {
    let mut out: Vec<usize> = Vec::new();
    for k in keys {
        if !out.contains(&k) {
            out.push(k);
        }
    }
    out
}

impl JobCtx {
    fn adapter_key(&self) -> usize {
        self.adapter.as_ref().map_or(0, |a| Arc::as_ptr(a) as usize)
    }
}

struct Seq {
    job: Arc<JobCtx>,
    index: usize,
    cache: KvCache,
    logits: Vec<f32>,
    tokens: Vec<u32>,
    rng: ChaCha8Rng,
    sent: String,
    /// The grammar state after `tokens` (kept through preemption: the
    /// tokens are kept too).
    grammar: Option<Grammar>,
    /// Scores of `tokens` so far (when the job asked and they are exact).
    scores: TopLogprobs,
}

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
    if let (Some(k), true) = (seq.job.scores, exact) {
        // The unmasked, unprocessed model's distribution (what training
        // scores), reduced as the trainer's LM head reduces it.
        let t = scoring_temperature(p.temperature);
        if k == 0 {
            seq.scores
                .logprobs
                .push(row_logprob(&seq.logits, tok as usize, t));
            seq.scores.top.push(Vec::new());
        } else {
            let row = row_log_softmax(&seq.logits, t);
            seq.scores.logprobs.push(row[tok as usize]);
            seq.scores.top.push(top_k(&row, k));
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

/// The loop on the engine thread: it owns the model and the waiting, running,
/// preempted and prefilling sequences, and steps them (named apart from
/// `temper_engine::Engine`, the training engine).
struct BatchLoop {
    model: Arc<Pretrained>,
    cfg: SchedulerConfig,
    rx: mpsc::Receiver<Job>,
    waiting_count: Arc<AtomicUsize>,
    metrics: Arc<Metrics>,
    waiting: VecDeque<Job>,
    running: Vec<Seq>,
    /// Evicted sequences waiting to resume (before any new job).
    preempted: VecDeque<Seq>,
    /// Admitted prompts whose prefill is not finished.
    prefilling: Vec<Prefill>,
    /// Whether decode logits equal the trainer's bit for bit, so scores are
    /// taken from them.
    exact_scores: bool,
    prefix_cache: PrefixCache,
    /// Set with the reason when the loop dies.
    dead: Arc<OnceLock<String>>,
}

/// What a finished prefill turns into.
enum Pending {
    /// A new job: its `n` samples start from the prefilled cache.
    New(Box<Job>),
    /// A preempted sequence: prompt + its tokens so far, recomputed.
    Resume(Box<Seq>),
}

impl Pending {
    fn events(&self) -> &UnboundedSender<Event> {
        match self {
            Pending::New(j) => &j.events,
            Pending::Resume(s) => &s.job.events,
        }
    }

    fn adapter(&self) -> Option<Arc<LoadedAdapter>> {
        match self {
            Pending::New(j) => j.adapter.clone(),
            Pending::Resume(s) => s.job.adapter.clone(),
        }
    }

    fn adapter_key(&self) -> usize {
        match self {
            Pending::New(j) => j.adapter_key(),
            Pending::Resume(s) => s.job.adapter_key(),
        }
    }

    fn cache_salt(&self) -> Option<&str> {
        match self {
            Pending::New(j) => j.cache_salt.as_deref(),
            Pending::Resume(s) => s.job.cache_salt.as_deref(),
        }
    }
}

/// A prompt being prefilled chunk by chunk into `cache`.
struct Prefill {
    what: Pending,
    /// Every token to prefill; `cache.len()` of them are done.
    input: Vec<u32>,
    cache: KvCache,
    /// Sequences it becomes (a job's `n`, or 1).
    seqs: usize,
}

impl BatchLoop {
    /// Step until every handle is dropped. A panic that escapes a batch's
    /// own work (see the module's doc) ends the engine: its state cannot be
    /// trusted, so it records why, fails every request it holds, and stops
    /// taking new ones.
    fn run(mut self) {
        let Err(payload) = catch_unwind(AssertUnwindSafe(|| self.steps())) else {
            return;
        };
        let why = format!("the engine thread panicked: {}", panic_message(&*payload));
        tracing::error!("{why}; the server cannot generate until it is restarted");
        let _ = self.dead.set(why.clone());
        self.fail_all(&why);
    }

    /// Fail every job the loop holds or that is queued for it.
    fn fail_all(&mut self, why: &str) {
        let fail = |events: &UnboundedSender<Event>| {
            let _ = events.send(Event::Failed(why.to_string()));
        };
        while let Ok(j) = self.rx.try_recv() {
            self.waiting.push_back(j);
        }
        self.waiting.iter().for_each(|j| fail(&j.events));
        self.running.iter().for_each(|s| fail(&s.job.events));
        self.preempted.iter().for_each(|s| fail(&s.job.events));
        self.prefilling.iter().for_each(|p| fail(p.what.events()));
    }

    fn steps(&mut self) {
        loop {
            if self.running.is_empty()
                && self.waiting.is_empty()
                && self.preempted.is_empty()
                && self.prefilling.is_empty()
            {
                match self.rx.recv() {
                    Ok(j) => self.waiting.push_back(j),
                    Err(_) => return,
                }
            }
            while let Ok(j) = self.rx.try_recv() {
                self.waiting.push_back(j);
            }
            #[cfg(feature = "fault-hooks")]
            fault::check_loop();
            self.drop_cancelled_waiting();
            self.admit();
            self.prefill_step();
            self.sample_all();
            self.preempt();
            self.decode();
            self.publish();
        }
    }

    fn dequeued(&self, k: usize) {
        let left = self.waiting_count.fetch_sub(k, Ordering::SeqCst) - k;
        self.metrics.waiting.store(left as u64, Ordering::Relaxed);
    }

    /// KV-cache tokens held by running sequences or reserved by prompts
    /// being prefilled (all of each prompt, once per sample).
    fn kv_used(&self) -> usize {
        let running: usize = self.running.iter().map(|s| s.cache.len()).sum();
        let prefilling: usize = self.prefilling.iter().map(|p| p.input.len() * p.seqs).sum();
        running + prefilling
    }

    /// Sequences running or about to run once their prefill is done.
    fn live_seqs(&self) -> usize {
        self.running.len() + self.prefilling.iter().map(|p| p.seqs).sum::<usize>()
    }

    fn publish(&self) {
        self.metrics
            .running
            .store(self.running.len() as u64, Ordering::Relaxed);
        self.metrics
            .kv_used
            .store(self.kv_used() as u64, Ordering::Relaxed);
    }

    fn drop_cancelled_waiting(&mut self) {
        let before = self.waiting.len();
        self.waiting.retain(|j| !j.events.is_closed());
        let gone = before - self.waiting.len();
        if gone > 0 {
            self.dequeued(gone);
        }
        self.preempted.retain(|s| !s.job.events.is_closed());
    }

    /// Resume preempted sequences, then admit waiting jobs in order, while
    /// they fit: at most `max_running` sequences, and KV-cache tokens in use
    /// (or reserved by prompts still prefilling) plus the new prompts plus
    /// one token of growth per sequence within the budget. Admitted work
    /// joins the prefill queue; [`BatchLoop::prefill_step`] runs it in chunks.
    fn admit(&mut self) {
        let budget = self.cfg.kv_budget_tokens;
        let mut used = self.kv_used();
        let mut seqs = self.live_seqs();
        while let Some(s) = self.preempted.front() {
            let len = s.job.prompt.len() + s.tokens.len();
            let fits = seqs < self.cfg.max_running && used + len + seqs < budget;
            if !(seqs == 0 || fits) {
                break;
            }
            let Some(s) = self.preempted.pop_front() else {
                break;
            };
            used += len;
            seqs += 1;
            let input = s.job.prompt.iter().chain(&s.tokens).copied().collect();
            self.push_prefill(Pending::Resume(Box::new(s)), input, 1);
        }
        let mut admitted = 0;
        if self.preempted.is_empty() {
            while let Some(job) = self.waiting.front() {
                let need = job.prompt.len() * job.n;
                let fits =
                    seqs + job.n <= self.cfg.max_running && used + need + seqs + job.n <= budget;
                if !(seqs == 0 || fits) {
                    break;
                }
                let Some(job) = self.waiting.pop_front() else {
                    break;
                };
                used += need;
                seqs += job.n;
                admitted += 1;
                self.metrics
                    .prompt_tokens
                    .fetch_add(job.prompt.len() as u64, Ordering::Relaxed);
                let (input, n) = (job.prompt.clone(), job.n);
                self.push_prefill(Pending::New(Box::new(job)), input, n);
            }
        }
        if admitted > 0 {
            self.dequeued(admitted);
        }
    }

    /// Queue `input` for prefill, starting from the longest prefix of it
    /// the prefix cache holds for its adapter.
    fn push_prefill(&mut self, what: Pending, input: Vec<u32>, seqs: usize) {
        let cache = match self
            .prefix_cache
            .lookup(&input, what.adapter_key(), what.cache_salt())
        {
            Some(c) => {
                self.metrics.prefix_hits.fetch_add(1, Ordering::Relaxed);
                self.metrics
                    .prefix_reused_tokens
                    .fetch_add(c.len() as u64, Ordering::Relaxed);
                c
            }
            None => KvCache::new(self.model.model.config().num_layers),
        };
        self.prefilling.push(Prefill {
            cache,
            what,
            input,
            seqs,
        });
    }

    /// Prefill at most `max_prefill_tokens` prompt tokens of the queued
    /// prompts, in one packed forward per adapter: prompts that fit whole
    /// first (shortest first), then a chunk of the oldest long one. A prompt
    /// whose last chunk ran starts decoding. So a long prompt is spread over
    /// several steps and never stalls the running sequences' decode for more
    /// than one chunk; the attention kernel gives a chunk's tokens the same
    /// values as a one-shot prefill.
    fn prefill_step(&mut self) {
        self.prefilling.retain(|p| !p.what.events().is_closed());
        if self.prefilling.is_empty() {
            return;
        }
        let mut left = self.cfg.max_prefill_tokens.max(1);
        let mut order: Vec<usize> = (0..self.prefilling.len()).collect();
        order.sort_by_key(|&i| {
            let p = &self.prefilling[i];
            let rest = p.input.len() - p.cache.len();
            (rest > left, if rest > left { i } else { rest })
        });
        // (index into `prefilling`, tokens this step)
        let mut chunks: Vec<(usize, usize)> = Vec::new();
        for i in order {
            if left == 0 {
                break;
            }
            let p = &self.prefilling[i];
            let take = (p.input.len() - p.cache.len()).min(left);
            left -= take;
            chunks.push((i, take));
        }
        chunks.sort_unstable();
        let keys = distinct(
            chunks
                .iter()
                .map(|&(i, _)| self.prefilling[i].what.adapter_key()),
        );
        let mut failed: Vec<(usize, String)> = Vec::new();
        let mut logits: Vec<(usize, Vec<f32>)> = Vec::new();
        for key in keys {
            let group: Vec<(usize, usize)> = chunks
                .iter()
                .copied()
                .filter(|&(i, _)| self.prefilling[i].what.adapter_key() == key)
                .collect();
            // A panic fails this group's prompts only: the forward wrote
            // nothing but their caches, which are dropped with them.
            match unwinding("prefill", || self.prefill_chunks(&group)) {
                Ok(rows) => logits.extend(rows),
                Err(e) => {
                    tracing::error!("{e}");
                    failed.extend(group.iter().map(|&(i, _)| (i, e.clone())));
                }
            }
        }
        let mut rows: Vec<Option<Vec<f32>>> = vec![None; self.prefilling.len()];
        for (i, row) in logits {
            rows[i] = Some(row);
        }
        let mut errors: Vec<Option<String>> = vec![None; self.prefilling.len()];
        for (i, msg) in failed {
            errors[i] = Some(msg);
        }
        let all = std::mem::take(&mut self.prefilling);
        for ((p, row), err) in all.into_iter().zip(rows).zip(errors) {
            if let Some(msg) = err {
                let _ = p.what.events().send(Event::Failed(msg));
                continue;
            }
            match (row, p.what) {
                (Some(row), Pending::New(job)) => self.start_job(*job, p.cache, row),
                (Some(row), Pending::Resume(mut s)) => {
                    s.cache = p.cache;
                    s.logits = row;
                    self.running.push(*s);
                }
                (None, what) => self.prefilling.push(Prefill { what, ..p }),
            }
        }
    }

    /// One packed forward over the chunks `(index, tokens)` of queued
    /// prompts (all under one adapter), each appended to its cache; the
    /// logits after the last token of every prompt that is now complete.
    fn prefill_chunks(
        &mut self,
        chunks: &[(usize, usize)],
    ) -> temper_model::Result<Vec<(usize, Vec<f32>)>> {
        let model = self.model.clone();
        let model = &model.model;
        let adapter = chunks
            .first()
            .and_then(|&(i, _)| self.prefilling[i].what.adapter());
        let lora = adapter.as_ref().map(|a| &a.lora);
        let mut ids: Vec<u32> = Vec::new();
        let mut last_rows: Vec<(usize, u32)> = Vec::new();
        for &(i, take) in chunks {
            let p = &self.prefilling[i];
            let from = p.cache.len();
            ids.extend_from_slice(&p.input[from..from + take]);
            if from + take == p.input.len() {
                last_rows.push((i, (ids.len() - 1) as u32));
            }
        }
        let mut segs: Vec<Segment<'_>> = Vec::with_capacity(chunks.len());
        let mut cursor = self.prefilling.iter_mut().enumerate();
        for &(i, take) in chunks {
            // `chunks` is sorted by index, so one pass finds every cache.
            let Some((_, p)) = cursor.find(|(j, _)| *j == i) else {
                return Err(temper_model::ModelError::InvalidInput(
                    "prefill chunks out of order".into(),
                ));
            };
            segs.push(Segment {
                len: take,
                cache: Some(&mut p.cache),
            });
        }
        #[cfg(feature = "fault-hooks")]
        fault::check_prefill(&ids);
        let hidden = model.forward_hidden(&ids, &mut segs, lora)?;
        drop(segs);
        if last_rows.is_empty() {
            return Ok(Vec::new());
        }
        let idx: Vec<u32> = last_rows.iter().map(|&(_, r)| r).collect();
        let rows = hidden.index_select(&Tensor::new(idx.as_slice(), model.device())?, 0)?;
        let logits = model
            .logits(&rows)?
            .to_dtype(DType::F32)?
            .to_vec2::<f32>()?;
        Ok(last_rows.iter().map(|&(i, _)| i).zip(logits).collect())
    }

    /// When the next decode step would take the KV cache past the budget,
    /// evict the most recently admitted sequences (their caches are dropped;
    /// they resume by recomputation, first in line). One sequence always
    /// stays: a job is only accepted if it fits the budget on its own.
    fn preempt(&mut self) {
        let budget = self.cfg.kv_budget_tokens;
        let mut need = self.kv_used() + self.running.len();
        while need > budget && self.running.len() > 1 {
            let Some(mut s) = self.running.pop() else {
                break;
            };
            need -= s.cache.len() + 1;
            s.cache = KvCache::new(self.model.model.config().num_layers);
            self.preempted.push_front(s);
            self.metrics.preemptions.fetch_add(1, Ordering::Relaxed);
        }
    }

    fn start_job(&mut self, job: Job, cache: KvCache, logits: Vec<f32>) {
        let seed = job.params.seed.unwrap_or_else(|| rand::rng().random());
        let ctx = Arc::new(JobCtx {
            first_index: job.first_index,
            prompt: job.prompt,
            params: job.params,
            adapter: job.adapter,
            stream: job.stream,
            events: job.events,
            scores: job.scores,
            cache_salt: job.cache_salt,
        });
        let mut prefilled = Some(cache);
        for index in 0..job.n {
            let mut rng = ChaCha8Rng::seed_from_u64(seed);
            rng.set_stream(index as u64);
            // Each sample writes its own cache: copies for all but the last,
            // which takes the prefilled one.
            let own = match prefilled.take() {
                Some(c) if index + 1 < job.n => {
                    let copy = c.truncated(c.len());
                    prefilled = Some(c);
                    match copy {
                        Ok(copy) => copy,
                        Err(e) => {
                            tracing::error!("copying a prefilled cache: {e}");
                            let _ = ctx.events.send(Event::Failed(format!("{e}")));
                            return;
                        }
                    }
                }
                Some(c) => c,
                None => return,
            };
            self.running.push(Seq {
                job: ctx.clone(),
                index,
                cache: own,
                logits: logits.clone(),
                tokens: Vec::new(),
                rng,
                sent: String::new(),
                grammar: job.grammar.as_ref().map(Grammar::fork),
                scores: TopLogprobs::default(),
            });
        }
    }

    /// Draw the next token of every running sequence; retire the finished
    /// and the cancelled.
    fn sample_all(&mut self) {
        let eos = self.model.generation.eos_token_ids.clone();
        let mut keep = Vec::with_capacity(self.running.len());
        let mut running = std::mem::take(&mut self.running);
        running.retain(|s| !s.job.events.is_closed());
        // Drawing a token (and its logprobs) reads the sequence's own
        // logits and random stream only: sequences run across threads,
        // with the same result as one after another.
        let exact = self.exact_scores;
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
            scores: (seq.job.scores.is_some() && self.exact_scores)
                .then(|| std::mem::take(&mut seq.scores)),
        }))
    }

    /// One packed decode forward per adapter over every running sequence.
    fn decode(&mut self) {
        if self.running.is_empty() {
            return;
        }
        self.metrics.batch_size.observe(self.running.len() as f64);
        let mut keys: Vec<usize> = Vec::new();
        for s in &self.running {
            let k = s.job.adapter_key();
            if !keys.contains(&k) {
                keys.push(k);
            }
        }
        let model = self.model.clone();
        let mut failed: Vec<(usize, String)> = Vec::new();
        for key in keys {
            let mut group: Vec<&mut Seq> = self
                .running
                .iter_mut()
                .filter(|s| s.job.adapter_key() == key)
                .collect();
            let adapter = group.first().and_then(|s| s.job.adapter.clone());
            let lora = adapter.as_ref().map(|a| &a.lora);
            let ids: Vec<u32> = group
                .iter()
                .map(|s| s.tokens.last().copied().unwrap_or(0))
                .collect();
            // A panic fails this adapter's sequences only: the forward
            // wrote nothing but their caches, which are dropped with them.
            let result = unwinding("decode step", || -> temper_model::Result<Vec<Vec<f32>>> {
                let mut caches: Vec<&mut KvCache> =
                    group.iter_mut().map(|s| &mut s.cache).collect();
                let hidden = model.model.forward_decode(&ids, &mut caches, lora)?;
                Ok(model
                    .model
                    .logits(&hidden)?
                    .to_dtype(DType::F32)?
                    .to_vec2::<f32>()?)
            });
            match result {
                Ok(rows) => {
                    for (s, row) in group.into_iter().zip(rows) {
                        s.logits = row;
                    }
                }
                Err(e) => {
                    tracing::error!("{e}");
                    failed.push((key, e));
                }
            }
        }
        for (key, msg) in failed {
            let mut keep = Vec::with_capacity(self.running.len());
            for s in std::mem::take(&mut self.running) {
                if s.job.adapter_key() == key {
                    let _ = s.job.events.send(Event::Failed(msg.clone()));
                } else {
                    keep.push(s);
                }
            }
            self.running = keep;
        }
    }
}
