//! KV caches of finished sequences, reused by prompts that start with them.

use std::collections::VecDeque;
use std::sync::Arc;

use temper_model::KvCache;

use super::job::LoadedAdapter;

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
pub(super) struct PrefixCache {
    /// Least recently used first.
    entries: VecDeque<PrefixEntry>,
    tokens: usize,
    pub(super) budget: usize,
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
    pub(super) fn new(budget: usize) -> Self {
        Self {
            entries: VecDeque::new(),
            tokens: 0,
            budget,
        }
    }

    /// Keep `cache` (holding `ids`); entries it extends are dropped.
    pub(super) fn insert(
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
    pub(super) fn lookup(
        &mut self,
        prompt: &[u32],
        key: usize,
        salt: Option<&str>,
    ) -> Option<KvCache> {
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
