//! Token capture: the calls of an *episode* recorded at the token level, so
//! the trajectory of any program that speaks the OpenAI API is known
//! exactly (what the model saw, what it sampled, with which weights).
//!
//! A request belongs to episode `ID` when it is sent under the per-episode
//! base URL `/episodes/ID/v1/...` (any OpenAI client can use it unmodified:
//! it is just a `base_url`) or carries the header `X-Temper-Episode: ID`.
//! Each finished choice of a chat or completions call of an episode adds one
//! [`CaptureRecord`]: prompt token ids after the chat template, completion
//! token ids, their logprobs (always computed, whether or not the client
//! asked for logprobs, by the same `Model::score` forward the trainer uses),
//! the model / adapter name and version (the policy version), the finish
//! reason and the sampling settings. `GET /v1/episodes/ID` answers the
//! records in call order; `DELETE /v1/episodes/ID` drops them.
//!
//! The store is in memory and bounded ([`CaptureLimits`]): when it is full
//! the oldest episodes go first; an episode that alone outgrows the budget
//! loses its oldest records, and says how many (`dropped_records`).

use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;

use axum::extract::{FromRequestParts, Path, State};
use axum::http::header;
use axum::http::request::Parts;
use axum::response::{IntoResponse, Response};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use temper_model::TopLogprobs;

use super::error::OpenAiError;
use super::jobs::{score, Prepared};
use super::state::{now_secs, OpenAiState};
use crate::scheduler::Finished;

/// The header that tags a request with an episode.
pub const EPISODE_HEADER: &str = "x-temper-episode";

/// Longest episode id.
pub const MAX_EPISODE_ID_LEN: usize = 128;

/// Bounds of the in-memory capture store.
#[derive(Debug, Clone, Copy)]
pub struct CaptureLimits {
    /// Most episodes held at once.
    pub max_episodes: usize,
    /// Most bytes of records (as JSON) held at once.
    pub max_bytes: usize,
}

impl Default for CaptureLimits {
    /// 10 000 episodes, 512 MiB.
    fn default() -> Self {
        Self {
            max_episodes: 10_000,
            max_bytes: 512 << 20,
        }
    }
}

/// One captured choice of one call.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CaptureRecord {
    /// The episode.
    pub episode: String,
    /// Position in the episode (0, 1, ...; call order, then choice order).
    pub seq: u64,
    /// The response's `id`.
    pub request_id: String,
    /// `chat.completions`, `responses` or `completions`.
    pub endpoint: String,
    /// The choice's index in the response.
    pub choice: usize,
    /// Base model or adapter name.
    pub model: String,
    /// The policy version: 0 = base model, else the adapter's load count.
    pub version: u64,
    /// Unix seconds when the choice finished.
    pub created: u64,
    /// Exactly the tokens the model was given (chat template applied).
    pub prompt_token_ids: Vec<u32>,
    /// The sampled tokens (a final stop token included).
    pub completion_token_ids: Vec<u32>,
    /// Log-probability of each completion token under
    /// `log softmax(logits / T)` (T = 1 when greedy), before top-k / top-p
    /// and penalties: what `Model::score` gives at `sampling.temperature`.
    pub logprobs: Vec<f32>,
    /// `stop`, `length`, `tool_calls`, ...
    pub finish_reason: String,
    /// Sampling settings the tokens were drawn with.
    pub sampling: Value,
    /// Chat: the request's messages as sent (before the template).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub messages: Option<Value>,
    /// Chat: the request's tool schemas.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tools: Option<Value>,
    /// Chat: the assistant message answered; completions: `{"text": ...}`.
    pub response: Value,
}

/// What a request of an episode needs to be recorded, carried on
/// [`Prepared`].
#[derive(Debug, Clone)]
pub(super) struct CaptureCtx {
    pub(super) episode: String,
    pub(super) endpoint: &'static str,
    pub(super) messages: Option<Value>,
    pub(super) tools: Option<Value>,
}

/// The episode a request is tagged with, if any (an extractor: a bad id is
/// a 400 before the body is read).
#[derive(Debug, Clone, Default)]
pub(super) struct EpisodeTag(pub(super) Option<String>);

/// Checks an episode id: 1..=128 of `[A-Za-z0-9_.-]`, not `.` or `..`
/// (ids may name files of whoever stores them).
pub fn valid_episode_id(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= MAX_EPISODE_ID_LEN
        && id != "."
        && id != ".."
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-'))
}

fn check_id(id: &str) -> Result<(), OpenAiError> {
    if valid_episode_id(id) {
        Ok(())
    } else {
        Err(OpenAiError::BadRequest {
            message: format!(
                "episode id {:?} is invalid: use 1 to {MAX_EPISODE_ID_LEN} characters of \
                 [A-Za-z0-9_.-]",
                id.chars().take(MAX_EPISODE_ID_LEN + 1).collect::<String>()
            ),
            param: None,
            code: Some("invalid_episode"),
        })
    }
}

impl<S: Send + Sync> FromRequestParts<S> for EpisodeTag {
    type Rejection = OpenAiError;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, Self::Rejection> {
        // The raw path: a percent-encoded id is refused, not decoded.
        let from_path = parts
            .uri
            .path()
            .strip_prefix("/episodes/")
            .map(|rest| rest.split('/').next().unwrap_or_default().to_string());
        let from_header = match parts.headers.get(EPISODE_HEADER) {
            None => None,
            Some(v) => Some(
                v.to_str()
                    .map_err(|_| OpenAiError::bad("X-Temper-Episode must be ASCII"))?
                    .to_string(),
            ),
        };
        let id = match (from_path, from_header) {
            (Some(p), Some(h)) if p != h => {
                return Err(OpenAiError::bad(format!(
                    "the URL's episode {p:?} and X-Temper-Episode {h:?} differ"
                )))
            }
            (Some(p), _) => Some(p),
            (None, h) => h,
        };
        if let Some(id) = &id {
            check_id(id)?;
        }
        Ok(EpisodeTag(id))
    }
}

impl EpisodeTag {
    /// The capture context of a chat request.
    pub(super) fn chat(
        &self,
        messages: &[Value],
        tools: Option<&Vec<Value>>,
    ) -> Option<CaptureCtx> {
        self.0.as_ref().map(|e| CaptureCtx {
            episode: e.clone(),
            endpoint: "chat.completions",
            messages: Some(Value::Array(messages.to_vec())),
            tools: tools.map(|t| Value::Array(t.clone())),
        })
    }

    /// The capture context of a completions request.
    pub(super) fn completion(&self) -> Option<CaptureCtx> {
        self.0.as_ref().map(|e| CaptureCtx {
            episode: e.clone(),
            endpoint: "completions",
            messages: None,
            tools: None,
        })
    }
}

/// Scores of choice `f` when the client asked for logprobs or the call is
/// captured (one forward serves both); `prompt_too` as in [`score`].
pub(super) async fn score_choice(
    s: &OpenAiState,
    p: &Prepared,
    f: &Finished,
    prompt_too: bool,
) -> Result<Option<TopLogprobs>, OpenAiError> {
    if !p.logprobs && p.capture.is_none() {
        return Ok(None);
    }
    let prompt = p
        .prompts
        .get(f.index / p.sampling.n.max(1))
        .ok_or_else(|| OpenAiError::Internal("a choice without a prompt".into()))?;
    let k = if p.logprobs { p.top_logprobs } else { 0 };
    score(
        s,
        p.adapter.clone(),
        prompt,
        f,
        p.sampling.params.temperature,
        k,
        prompt_too,
    )
    .await
    .map(Some)
}

/// Records choice `f` of request `request_id` when `p` is captured.
/// `scores`: from [`score_choice`] (its last `f.tokens.len()` entries are
/// the completion's).
pub(super) fn record(
    s: &OpenAiState,
    p: &Prepared,
    request_id: &str,
    f: &Finished,
    finish_reason: &str,
    scores: Option<&TopLogprobs>,
    response: Value,
) -> Result<(), OpenAiError> {
    let Some(ctx) = &p.capture else {
        return Ok(());
    };
    let scores =
        scores.ok_or_else(|| OpenAiError::Internal("a captured choice was not scored".into()))?;
    let skip = scores
        .logprobs
        .len()
        .checked_sub(f.tokens.len())
        .ok_or_else(|| OpenAiError::Internal("fewer scores than tokens".into()))?;
    let prompt = p
        .prompts
        .get(f.index / p.sampling.n.max(1))
        .ok_or_else(|| OpenAiError::Internal("a choice without a prompt".into()))?;
    let sp = &p.sampling.params;
    let rec = CaptureRecord {
        episode: ctx.episode.clone(),
        seq: 0,
        request_id: request_id.to_string(),
        endpoint: ctx.endpoint.to_string(),
        choice: f.index,
        model: p.model_name.clone(),
        version: p.version,
        created: now_secs(),
        prompt_token_ids: prompt.clone(),
        completion_token_ids: f.tokens.clone(),
        logprobs: scores.logprobs[skip..].to_vec(),
        finish_reason: finish_reason.to_string(),
        sampling: json!({
            "temperature": sp.temperature, "top_p": sp.top_p, "top_k": sp.top_k,
            "min_p": sp.min_p, "max_tokens": sp.max_tokens, "seed": sp.seed,
            "presence_penalty": sp.presence_penalty, "frequency_penalty": sp.frequency_penalty,
            "repetition_penalty": sp.repetition_penalty,
        }),
        messages: ctx.messages.clone(),
        tools: ctx.tools.clone(),
        response,
    };
    s.inner.captures.push(rec)
}

#[derive(Default)]
struct Episode {
    /// Records as JSON text (their size is what the budget counts).
    records: VecDeque<String>,
    bytes: usize,
    next_seq: u64,
    dropped: u64,
}

#[derive(Default)]
struct Store {
    episodes: HashMap<String, Episode>,
    /// Episode ids, oldest first (eviction order).
    order: VecDeque<String>,
    bytes: usize,
}

/// The captured records of all episodes, bounded.
pub(super) struct CaptureStore {
    limits: CaptureLimits,
    store: Mutex<Store>,
}

impl CaptureStore {
    pub(super) fn new(limits: CaptureLimits) -> Self {
        Self {
            limits,
            store: Mutex::new(Store::default()),
        }
    }

    fn lock(&self) -> Result<std::sync::MutexGuard<'_, Store>, OpenAiError> {
        self.store
            .lock()
            .map_err(|_| OpenAiError::Internal("capture store lock poisoned".into()))
    }

    fn push(&self, mut rec: CaptureRecord) -> Result<(), OpenAiError> {
        let mut st = self.lock()?;
        let st = &mut *st;
        if !st.episodes.contains_key(&rec.episode) {
            while st.episodes.len() >= self.limits.max_episodes.max(1) {
                if !evict_oldest(st) {
                    break;
                }
            }
            st.order.push_back(rec.episode.clone());
        }
        let ep = st.episodes.entry(rec.episode.clone()).or_default();
        rec.seq = ep.next_seq;
        ep.next_seq += 1;
        let text = serde_json::to_string(&rec)
            .map_err(|e| OpenAiError::Internal(format!("capture record: {e}")))?;
        ep.bytes += text.len();
        st.bytes += text.len();
        ep.records.push_back(text);
        // Over budget: other episodes go first, oldest first; then this
        // one's oldest records (counted, so the gap is visible).
        while st.bytes > self.limits.max_bytes {
            if st.order.len() > 1 && st.order.front() != Some(&rec.episode) {
                if !evict_oldest(st) {
                    break;
                }
                continue;
            }
            if st.order.len() > 1 {
                // This episode is the oldest: move it back and evict the next.
                st.order.retain(|e| e != &rec.episode);
                st.order.push_back(rec.episode.clone());
                continue;
            }
            let Some(ep) = st.episodes.get_mut(&rec.episode) else {
                break;
            };
            if ep.records.len() <= 1 {
                break;
            }
            if let Some(old) = ep.records.pop_front() {
                ep.bytes -= old.len();
                st.bytes -= old.len();
                ep.dropped += 1;
            }
        }
        Ok(())
    }

    /// The records of `id` as the JSON body of `GET /v1/episodes/ID`.
    fn get(&self, id: &str) -> Result<Option<String>, OpenAiError> {
        let st = self.lock()?;
        Ok(st.episodes.get(id).map(|ep| {
            let records: Vec<&str> = ep.records.iter().map(String::as_str).collect();
            format!(
                "{{\"object\":\"episode\",\"id\":{},\"dropped_records\":{},\"records\":[{}]}}",
                Value::String(id.to_string()),
                ep.dropped,
                records.join(",")
            )
        }))
    }

    fn remove(&self, id: &str) -> Result<bool, OpenAiError> {
        let mut st = self.lock()?;
        let Some(ep) = st.episodes.remove(id) else {
            return Ok(false);
        };
        st.bytes -= ep.bytes;
        st.order.retain(|e| e != id);
        Ok(true)
    }
}

/// Drops the oldest episode; false when there is none.
fn evict_oldest(st: &mut Store) -> bool {
    let Some(old) = st.order.pop_front() else {
        return false;
    };
    if let Some(ep) = st.episodes.remove(&old) {
        st.bytes -= ep.bytes;
        tracing::warn!(episode = %old, records = ep.records.len(),
            "capture store full: dropped the oldest episode");
    }
    true
}

/// 404 in OpenAI's error shape (the generic `NotFound` says
/// `model_not_found`, which would mislead here).
fn unknown(id: &str) -> Response {
    let body = json!({"error": {
        "message": format!("no captured calls for episode {id:?} (none made, already deleted, or evicted)"),
        "type": "invalid_request_error", "param": null, "code": "episode_not_found",
    }});
    (axum::http::StatusCode::NOT_FOUND, axum::Json(body)).into_response()
}

/// `GET /v1/episodes/{id}`.
pub(super) async fn get_episode(
    State(s): State<OpenAiState>,
    Path(id): Path<String>,
) -> Result<Response, OpenAiError> {
    check_id(&id)?;
    Ok(match s.inner.captures.get(&id)? {
        Some(body) => ([(header::CONTENT_TYPE, "application/json")], body).into_response(),
        None => unknown(&id),
    })
}

/// `DELETE /v1/episodes/{id}`.
pub(super) async fn delete_episode(
    State(s): State<OpenAiState>,
    Path(id): Path<String>,
) -> Result<Response, OpenAiError> {
    check_id(&id)?;
    if !s.inner.captures.remove(&id)? {
        return Ok(unknown(&id));
    }
    Ok(axum::Json(json!({"object": "episode.deleted", "id": id, "deleted": true})).into_response())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(ep: &str, pad: usize) -> CaptureRecord {
        CaptureRecord {
            episode: ep.into(),
            seq: 0,
            request_id: "r".into(),
            endpoint: "completions".into(),
            choice: 0,
            model: "m".into(),
            version: 0,
            created: 0,
            prompt_token_ids: vec![1; pad],
            completion_token_ids: vec![2],
            logprobs: vec![-0.5],
            finish_reason: "stop".into(),
            sampling: json!({}),
            messages: None,
            tools: None,
            response: json!({"text": "x"}),
        }
    }

    fn records(s: &CaptureStore, id: &str) -> Option<Value> {
        s.get(id)
            .expect("get")
            .map(|b| serde_json::from_str(&b).expect("json"))
    }

    #[test]
    fn ids_are_checked() {
        for ok in ["a", "ep-1_x.Y", &"z".repeat(MAX_EPISODE_ID_LEN)] {
            assert!(valid_episode_id(ok), "{ok}");
        }
        for bad in [
            "",
            ".",
            "..",
            "a/b",
            "a%2Fb",
            "a b",
            "é",
            &"z".repeat(MAX_EPISODE_ID_LEN + 1),
        ] {
            assert!(!valid_episode_id(bad), "{bad}");
        }
    }

    #[test]
    fn the_store_stays_within_its_bounds_and_says_what_it_dropped() {
        let one = serde_json::to_string(&rec("a", 10)).expect("json").len();
        let s = CaptureStore::new(CaptureLimits {
            max_episodes: 2,
            max_bytes: 3 * one + 8,
        });
        s.push(rec("a", 10)).expect("push");
        s.push(rec("b", 10)).expect("push");
        s.push(rec("c", 10)).expect("push");
        // Two episodes at most: the oldest went.
        assert!(records(&s, "a").is_none());
        assert_eq!(records(&s, "c").expect("c")["records"][0]["seq"], 0);
        // Bytes: c grows; b (older) is evicted first, then c's oldest records.
        for _ in 0..4 {
            s.push(rec("c", 10)).expect("push");
        }
        assert!(records(&s, "b").is_none());
        let c = records(&s, "c").expect("c");
        let seqs: Vec<u64> = c["records"]
            .as_array()
            .expect("records")
            .iter()
            .map(|r| r["seq"].as_u64().expect("seq"))
            .collect();
        assert_eq!(seqs, vec![2, 3, 4]);
        assert_eq!(c["dropped_records"], 2);
        assert!(s.lock().expect("lock").bytes <= 3 * one + 8);
        assert!(s.remove("c").expect("remove"));
        assert!(!s.remove("c").expect("remove"));
        assert_eq!(s.lock().expect("lock").bytes, 0);
    }
}
