//! Prometheus metrics of the inference server, rendered by hand in the text
//! exposition format (a few counters, gauges and histograms need no crate).

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, PoisonError};

/// A cumulative histogram with fixed upper bounds.
#[derive(Debug)]
pub struct Histogram {
    bounds: Vec<f64>,
    counts: Vec<AtomicU64>,
    count: AtomicU64,
    sum: Mutex<f64>,
}

impl Histogram {
    fn new(bounds: &[f64]) -> Self {
        Self {
            bounds: bounds.to_vec(),
            counts: bounds.iter().map(|_| AtomicU64::new(0)).collect(),
            count: AtomicU64::new(0),
            sum: Mutex::new(0.0),
        }
    }

    /// Record one observation.
    pub fn observe(&self, v: f64) {
        for (b, c) in self.bounds.iter().zip(&self.counts) {
            if v <= *b {
                c.fetch_add(1, Ordering::Relaxed);
            }
        }
        self.count.fetch_add(1, Ordering::Relaxed);
        *self.sum.lock().unwrap_or_else(PoisonError::into_inner) += v;
    }

    fn render(&self, out: &mut String, name: &str, help: &str) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        for (b, c) in self.bounds.iter().zip(&self.counts) {
            let _ = writeln!(
                out,
                "{name}_bucket{{le=\"{b}\"}} {}",
                c.load(Ordering::Relaxed)
            );
        }
        let count = self.count.load(Ordering::Relaxed);
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {count}");
        let sum = *self.sum.lock().unwrap_or_else(PoisonError::into_inner);
        let _ = writeln!(out, "{name}_sum {sum}\n{name}_count {count}");
    }
}

const SECONDS: [f64; 14] = [
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
];
const SIZES: [f64; 10] = [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0];

/// Every metric the server exports.
#[derive(Debug)]
pub struct Metrics {
    requests: Mutex<BTreeMap<(&'static str, u16), u64>>,
    /// Prompt tokens of admitted requests (each prompt once, whatever `n`).
    pub prompt_tokens: AtomicU64,
    /// Generated tokens.
    pub generation_tokens: AtomicU64,
    /// Seconds from request to full answer (generation routes).
    pub latency: Histogram,
    /// Seconds from request to first generated token.
    pub ttft: Histogram,
    /// Sequences in each decode step.
    pub batch_size: Histogram,
    /// Sequences being decoded now.
    pub running: AtomicU64,
    /// Requests waiting for admission.
    pub waiting: AtomicU64,
    /// Sequences evicted to stay within the KV-cache budget.
    pub preemptions: AtomicU64,
    /// KV-cache tokens actually held by running sequences.
    pub kv_used: AtomicU64,
    /// The KV-cache budget in tokens.
    pub kv_budget: AtomicU64,
    /// Requests refused with 503 because the queue was full.
    pub rejected: AtomicU64,
    /// Adapter loads (and swaps).
    pub adapter_loads: AtomicU64,
    /// Prompts that started from a cached prefix (see the scheduler's
    /// prefix cache).
    pub prefix_hits: AtomicU64,
    /// Prompt tokens taken from the prefix cache instead of prefilled.
    pub prefix_reused_tokens: AtomicU64,
    /// Structured-output grammars compiled (started).
    pub grammar_compiles: AtomicU64,
    /// Grammar compiles running now (abandoned ones included).
    pub grammar_compiling: AtomicU64,
    /// Structured-output requests answered from the grammar cache.
    pub grammar_cache_hits: AtomicU64,
}

impl Default for Metrics {
    fn default() -> Self {
        Self {
            requests: Mutex::new(BTreeMap::new()),
            prompt_tokens: AtomicU64::new(0),
            generation_tokens: AtomicU64::new(0),
            latency: Histogram::new(&SECONDS),
            ttft: Histogram::new(&SECONDS),
            batch_size: Histogram::new(&SIZES),
            running: AtomicU64::new(0),
            waiting: AtomicU64::new(0),
            preemptions: AtomicU64::new(0),
            kv_used: AtomicU64::new(0),
            kv_budget: AtomicU64::new(0),
            rejected: AtomicU64::new(0),
            adapter_loads: AtomicU64::new(0),
            prefix_hits: AtomicU64::new(0),
            prefix_reused_tokens: AtomicU64::new(0),
            grammar_compiles: AtomicU64::new(0),
            grammar_compiling: AtomicU64::new(0),
            grammar_cache_hits: AtomicU64::new(0),
        }
    }
}

impl Metrics {
    /// Count one answered request on `route` with HTTP `status`.
    pub fn count_request(&self, route: &'static str, status: u16) {
        *self
            .requests
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .entry((route, status))
            .or_insert(0) += 1;
    }

    /// The Prometheus text exposition.
    pub fn render(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(
            out,
            "# HELP temper_requests_total HTTP requests answered, by route and status.\n# TYPE temper_requests_total counter"
        );
        for ((route, status), n) in self
            .requests
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .iter()
        {
            let _ = writeln!(
                out,
                "temper_requests_total{{route=\"{route}\",status=\"{status}\"}} {n}"
            );
        }
        let counter = |out: &mut String, name: &str, help: &str, v: &AtomicU64| {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} counter\n{name} {}",
                v.load(Ordering::Relaxed)
            );
        };
        let gauge = |out: &mut String, name: &str, help: &str, v: &AtomicU64| {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} gauge\n{name} {}",
                v.load(Ordering::Relaxed)
            );
        };
        counter(
            &mut out,
            "temper_prompt_tokens_total",
            "Prompt tokens of admitted requests.",
            &self.prompt_tokens,
        );
        counter(
            &mut out,
            "temper_generation_tokens_total",
            "Generated tokens.",
            &self.generation_tokens,
        );
        counter(
            &mut out,
            "temper_rejected_requests_total",
            "Requests refused because the queue was full (503).",
            &self.rejected,
        );
        counter(
            &mut out,
            "temper_preemptions_total",
            "Sequences evicted (and later recomputed) to stay within the KV-cache budget.",
            &self.preemptions,
        );
        counter(
            &mut out,
            "temper_prefix_cache_hits_total",
            "Prompts whose prefill started from a cached prefix.",
            &self.prefix_hits,
        );
        counter(
            &mut out,
            "temper_prefix_cache_reused_tokens_total",
            "Prompt tokens taken from the prefix cache instead of being prefilled.",
            &self.prefix_reused_tokens,
        );
        counter(
            &mut out,
            "temper_adapter_loads_total",
            "LoRA adapter loads and swaps.",
            &self.adapter_loads,
        );
        counter(
            &mut out,
            "temper_grammar_compiles_total",
            "Structured-output grammars compiled.",
            &self.grammar_compiles,
        );
        counter(
            &mut out,
            "temper_grammar_cache_hits_total",
            "Structured-output requests answered from the grammar cache (compiled or refused).",
            &self.grammar_cache_hits,
        );
        gauge(
            &mut out,
            "temper_grammar_compiles_running",
            "Grammar compiles running, abandoned ones included.",
            &self.grammar_compiling,
        );
        gauge(
            &mut out,
            "temper_running_sequences",
            "Sequences in the running batch.",
            &self.running,
        );
        gauge(
            &mut out,
            "temper_waiting_requests",
            "Requests queued for admission.",
            &self.waiting,
        );
        gauge(
            &mut out,
            "temper_kv_cache_used_tokens",
            "KV-cache tokens held by running sequences.",
            &self.kv_used,
        );
        gauge(
            &mut out,
            "temper_kv_cache_budget_tokens",
            "KV-cache budget in tokens.",
            &self.kv_budget,
        );
        let budget = self.kv_budget.load(Ordering::Relaxed).max(1) as f64;
        let _ = writeln!(
            out,
            "# HELP temper_kv_cache_usage_ratio KV-cache tokens in use over the budget.\n# TYPE temper_kv_cache_usage_ratio gauge\ntemper_kv_cache_usage_ratio {}",
            self.kv_used.load(Ordering::Relaxed) as f64 / budget
        );
        self.latency.render(
            &mut out,
            "temper_request_latency_seconds",
            "Seconds from request to full answer.",
        );
        self.ttft.render(
            &mut out,
            "temper_time_to_first_token_seconds",
            "Seconds from request to the first generated token.",
        );
        self.batch_size.render(
            &mut out,
            "temper_decode_batch_size",
            "Sequences per decode step.",
        );
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_buckets_are_cumulative() {
        let m = Metrics::default();
        m.latency.observe(0.02);
        m.latency.observe(3.0);
        let text = m.render();
        assert!(text.contains("temper_request_latency_seconds_bucket{le=\"0.025\"} 1"));
        assert!(text.contains("temper_request_latency_seconds_bucket{le=\"5\"} 2"));
        assert!(text.contains("temper_request_latency_seconds_count 2"));
    }
}
