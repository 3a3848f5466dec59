//! Admission: waiting jobs and preempted sequences into the prefill queue,
//! prefill chunks into running sequences, and preemption when the KV-cache
//! budget runs out.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use temper_model::{KvCache, TopLogprobs};

use super::{BatchLoop, JobCtx, Pending, Prefill, Seq};
use crate::scheduler::job::{Event, Job};
use crate::scheduler::unwind::unwinding;
use crate::structured::Grammar;

impl BatchLoop {
    /// Resume preempted sequences, then admit waiting jobs in order, while
    /// they fit: at most `max_running` sequences, and KV-cache tokens in use
    /// (or reserved by prompts still prefilling) plus the new prompts plus
    /// one token of growth per sequence within the budget. Admitted work
    /// joins the prefill queue; [`BatchLoop::prefill_step`] runs it in chunks.
    pub(super) fn admit(&mut self) {
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
    pub(super) fn prefill_step(&mut self) {
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

    /// When the next decode step would take the KV cache past the budget,
    /// evict the most recently admitted sequences (their caches are dropped;
    /// they resume by recomputation, first in line). One sequence always
    /// stays: a job is only accepted if it fits the budget on its own.
    pub(super) fn preempt(&mut self) {
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
            top_logprobs: job.top_logprobs,
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
                top_logprobs: TopLogprobs::default(),
            });
        }
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
