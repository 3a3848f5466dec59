//! The scheduler's limits.

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
    /// start with them (0: off). See [`PrefixCache`](super::prefix_cache::PrefixCache).
    pub prefix_cache_tokens: usize,
}
