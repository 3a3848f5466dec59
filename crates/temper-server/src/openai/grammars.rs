//! Structured-output grammars for requests, compiled under bounds: a client
//! sends the schema, so compiling it is work the client chooses.
//!
//! - **Cache.** Compiled grammars (and client errors) are kept by the
//!   SHA-256 of the constraint, least recently used dropped first: the same
//!   schema compiles once, a refused one is refused again without work.
//! - **Concurrency.** At most [`GrammarLimits::max_compiles`] compile at
//!   once, each on a blocking thread; a request waits for a slot at most
//!   the compile time limit, then gets 429 with `Retry-After`.
//! - **Time.** A compile not done within
//!   [`GrammarLimits::compile_timeout`] is a 400 naming the limit (and is
//!   remembered as such).
//! - **Abandonment.** llguidance cannot interrupt a compile, so a compile
//!   whose client went away (or timed out) runs to its end on its thread;
//!   it keeps its slot until then, so abandoned compiles never exceed the
//!   cap, and its result still fills the cache. Generation itself stops as
//!   soon as its client goes away (the scheduler drops the job).

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::time::Duration;

use tokio::sync::Semaphore;

use super::error::OpenAiError;
use crate::metrics::Metrics;
use crate::structured::{Constraint, Grammar, GrammarCompiler, StructuredError};

/// Bounds of grammar compilation in `temper serve`.
#[derive(Debug, Clone, Copy)]
pub struct GrammarLimits {
    /// A compile running longer is a 400 (`--grammar-compile-timeout-s`).
    pub compile_timeout: Duration,
    /// Compiles running at once (`--max-grammar-compiles`).
    pub max_compiles: usize,
    /// Compiled grammars and refusals kept (`--grammar-cache-size`; 0: none).
    pub cache_entries: usize,
}

impl Default for GrammarLimits {
    /// 10 s, 2 at once, 256 kept.
    fn default() -> Self {
        Self {
            compile_timeout: Duration::from_secs(10),
            max_compiles: 2,
            cache_entries: 256,
        }
    }
}

/// A compile's outcome as cached: a fresh grammar state to fork per request,
/// or the client error to answer again.
type Outcome = Result<Arc<Mutex<Grammar>>, String>;

struct Cache {
    limit: usize,
    /// Digest → (outcome, last use).
    entries: HashMap<[u8; 32], (Outcome, u64)>,
    clock: u64,
}

impl Cache {
    fn get(&mut self, key: &[u8; 32]) -> Option<Outcome> {
        self.clock += 1;
        let now = self.clock;
        self.entries.get_mut(key).map(|(o, used)| {
            *used = now;
            o.clone()
        })
    }

    /// Keeps the first outcome of a key: a compile that finishes after its
    /// request timed out does not turn the remembered refusal into a success.
    fn insert_first(&mut self, key: [u8; 32], o: Outcome) {
        if self.limit == 0 || self.entries.contains_key(&key) {
            return;
        }
        if self.entries.len() >= self.limit {
            // A few hundred entries at most: a scan is cheaper than upkeep.
            if let Some(old) = self
                .entries
                .iter()
                .min_by_key(|(_, (_, used))| *used)
                .map(|(k, _)| *k)
            {
                self.entries.remove(&old);
            }
        }
        self.clock += 1;
        self.entries.insert(key, (o, self.clock));
    }
}

/// The server's grammar compilation: the compiler (built on first use),
/// the compile slots and the cache.
pub(super) struct Grammars {
    limits: GrammarLimits,
    metrics: Arc<Metrics>,
    compiler: Arc<OnceLock<Result<GrammarCompiler, String>>>,
    slots: Arc<Semaphore>,
    cache: Arc<Mutex<Cache>>,
}

fn fork(o: &Outcome) -> Result<Grammar, String> {
    match o {
        Ok(g) => g
            .lock()
            .map(|g| g.fork())
            .or_else(|p| Ok(p.into_inner().fork())),
        Err(m) => Err(m.clone()),
    }
}

impl Grammars {
    pub(super) fn new(limits: GrammarLimits, metrics: Arc<Metrics>) -> Self {
        Self {
            limits,
            metrics,
            compiler: Arc::new(OnceLock::new()),
            slots: Arc::new(Semaphore::new(limits.max_compiles.max(1))),
            cache: Arc::new(Mutex::new(Cache {
                limit: limits.cache_entries,
                entries: HashMap::new(),
                clock: 0,
            })),
        }
    }

    fn cached(&self, key: &[u8; 32]) -> Result<Option<Outcome>, OpenAiError> {
        let hit = self
            .cache
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(key);
        if hit.is_some() {
            self.metrics
                .grammar_cache_hits
                .fetch_add(1, Ordering::Relaxed);
        }
        Ok(hit)
    }

    /// A fresh grammar state for `c`, or a 400 about `param` (a schema that
    /// does not compile, exceeds a limit or takes too long), or a 429 when
    /// every compile slot stays busy. `build` makes the compiler the first
    /// time (blocking; run on the compile thread).
    pub(super) async fn grammar(
        &self,
        c: Constraint,
        param: &'static str,
        build: impl FnOnce() -> Result<GrammarCompiler, String> + Send + 'static,
    ) -> Result<Grammar, OpenAiError> {
        let refused = |m: String| OpenAiError::invalid(param, m);
        let key = c.digest();
        if let Some(o) = self.cached(&key)? {
            return fork(&o).map_err(refused);
        }
        let limit = self.limits.compile_timeout;
        let secs = limit.as_secs_f64();
        let permit = match tokio::time::timeout(limit, self.slots.clone().acquire_owned()).await {
            Ok(Ok(p)) => p,
            _ => {
                return Err(OpenAiError::RateLimited {
                    message: format!(
                        "{} structured-output schemas are compiling (--max-grammar-compiles); \
                         none finished within {secs} s: retry later",
                        self.limits.max_compiles.max(1)
                    ),
                    retry_after_s: limit.as_secs().max(1),
                })
            }
        };
        // Another request may have compiled it while this one waited.
        if let Some(o) = self.cached(&key)? {
            return fork(&o).map_err(refused);
        }
        let (tx, rx) = tokio::sync::oneshot::channel();
        let compiler = self.compiler.clone();
        let cache = self.cache.clone();
        let metrics = self.metrics.clone();
        metrics.grammar_compiles.fetch_add(1, Ordering::Relaxed);
        metrics.grammar_compiling.fetch_add(1, Ordering::Relaxed);
        tokio::task::spawn_blocking(move || {
            // Held until the compile ends, even when nobody waits for it.
            let _permit = permit;
            let outcome: Outcome = match compiler.get_or_init(build) {
                Err(e) => Err(e.clone()),
                Ok(compiler) => match compiler.compile(&c) {
                    Ok(g) => Ok(Arc::new(Mutex::new(g))),
                    Err(StructuredError::Compile(m)) => {
                        Err(format!("{param}: the schema does not compile: {m}"))
                    }
                    Err(other) => Err(other.to_string()),
                },
            };
            cache
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .insert_first(key, outcome.clone());
            metrics.grammar_compiling.fetch_sub(1, Ordering::Relaxed);
            let _ = tx.send(outcome);
        });
        match tokio::time::timeout(limit, rx).await {
            Ok(Ok(o)) => fork(&o).map_err(refused),
            Ok(Err(_)) => Err(OpenAiError::Internal(
                "the grammar compile thread died".into(),
            )),
            Err(_) => {
                let m = format!(
                    "{param}: the schema took longer than {secs} s to compile \
                     (--grammar-compile-timeout-s); simplify it"
                );
                self.cache
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .insert_first(key, Err(m.clone()));
                Err(refused(m))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cache_keeps_the_first_outcome_and_drops_the_least_recently_used() {
        let mut c = Cache {
            limit: 2,
            entries: HashMap::new(),
            clock: 0,
        };
        c.insert_first([1; 32], Err("one".into()));
        c.insert_first([1; 32], Err("later".into()));
        assert_eq!(
            c.get(&[1; 32]).and_then(|o| o.err()).as_deref(),
            Some("one")
        );
        c.insert_first([2; 32], Err("two".into()));
        // Using 1 makes 2 the least recently used.
        assert!(c.get(&[1; 32]).is_some());
        c.insert_first([3; 32], Err("three".into()));
        assert!(c.get(&[2; 32]).is_none(), "2 was the least recently used");
        assert!(c.get(&[1; 32]).is_some() && c.get(&[3; 32]).is_some());
        let mut off = Cache {
            limit: 0,
            entries: HashMap::new(),
            clock: 0,
        };
        off.insert_first([1; 32], Err("x".into()));
        assert!(off.get(&[1; 32]).is_none());
    }
}
