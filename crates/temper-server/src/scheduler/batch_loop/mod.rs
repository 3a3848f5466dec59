//! The loop on the engine thread and the state it steps: waiting jobs,
//! prompts being prefilled, running and preempted sequences. Each step's
//! work lives beside it by concern: `admit` (admission, prefill,
//! preemption), `sample` (drawing tokens, retiring sequences) and
//! `forward` (the model's packed prefill and batched decode forwards).

use std::collections::VecDeque;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, OnceLock};

use rand_chacha::ChaCha8Rng;
use temper_model::{KvCache, Pretrained, SamplingParams, TopLogprobs};
use tokio::sync::mpsc::UnboundedSender;

use super::config::SchedulerConfig;
use super::job::{Event, Job, LoadedAdapter};
use super::prefix_cache::PrefixCache;
use super::unwind::panic_message;
use crate::metrics::Metrics;
use crate::structured::Grammar;

mod admit;
mod forward;
mod sample;

struct JobCtx {
    first_index: usize,
    prompt: Vec<u32>,
    params: SamplingParams,
    adapter: Option<Arc<LoadedAdapter>>,
    stream: bool,
    events: UnboundedSender<Event>,
    top_logprobs: Option<usize>,
    cache_salt: Option<Arc<str>>,
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
    top_logprobs: TopLogprobs,
}

/// The loop on the engine thread: it owns the model and the waiting, running,
/// preempted and prefilling sequences, and steps them (named apart from
/// `temper_engine::Engine`, the training engine).
pub(super) struct BatchLoop {
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
    /// Whether decode logits equal the trainer's bit for bit, so logprobs are
    /// taken from them.
    exact_logprobs: bool,
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
    /// A loop over `model` that takes jobs from `rx`.
    pub(super) fn new(
        model: Arc<Pretrained>,
        cfg: SchedulerConfig,
        rx: mpsc::Receiver<Job>,
        waiting_count: Arc<AtomicUsize>,
        metrics: Arc<Metrics>,
        exact_logprobs: bool,
        dead: Arc<OnceLock<String>>,
    ) -> Self {
        let prefix_cache = PrefixCache::new(cfg.prefix_cache_tokens);
        BatchLoop {
            dead,
            model,
            cfg,
            rx,
            waiting_count,
            metrics,
            waiting: VecDeque::new(),
            running: Vec::new(),
            preempted: VecDeque::new(),
            prefilling: Vec::new(),
            exact_logprobs,
            prefix_cache,
        }
    }

    /// Step until every handle is dropped. A panic that escapes a batch's
    /// own work (see the module's doc) ends the engine: its state cannot be
    /// trusted, so it records why, fails every request it holds, and stops
    /// taking new ones.
    pub(super) fn run(mut self) {
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
            // The step's kernels are called from a pool thread (see
            // `temper_model::on_pool`); waiting for jobs stays off the pool.
            temper_model::on_pool(|| {
                #[cfg(feature = "fault-hooks")]
                crate::scheduler::fault::check_loop();
                self.drop_cancelled_waiting();
                self.admit();
                self.prefill_step();
                self.sample_all();
                self.preempt();
                self.decode();
                self.publish();
            });
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
}
