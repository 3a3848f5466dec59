//! Token capture: the calls of an *episode* recorded at the token level, so
//! the trajectory of any program that speaks the OpenAI API is known
//! exactly (what the model saw, what it sampled, with which weights).
//!
//! `POST /v1/episodes` creates an episode and answers its id and its
//! *token*, a secret that every later request about the episode must
//! present — as `Authorization: Bearer TOKEN` (in place of the API key: an
//! agent given only the episode's base URL and token can use any OpenAI
//! client unmodified, and never sees the server's key) or as
//! `X-Temper-Episode-Token: TOKEN` beside the key. Knowing an id is not
//! enough to read or append to an episode (one API key is shared by every
//! client of a server). A wrong token and an unknown id get the same 404.
//!
//! A request belongs to episode `ID` when it is sent under the per-episode
//! base URL `/episodes/ID/v1/...` (it is just a `base_url`) or carries the
//! header `X-Temper-Episode: ID`.
//! Each finished choice of a chat or completions call of an episode adds one
//! [`CaptureRecord`]: prompt token ids after the chat template, completion
//! token ids, their logprobs (always computed, whether or not the client
//! asked for logprobs, by the same `Model::score` forward the trainer uses),
//! the model / adapter name and version (the policy version), the finish
//! reason and the sampling settings. `GET /v1/episodes/ID` answers the
//! records in call order; `DELETE /v1/episodes/ID` drops the episode.
//!
//! The store is in memory and bounded ([`CaptureLimits`]): when it is full
//! the oldest episodes go first; an episode that alone outgrows the budget
//! loses its oldest records, and says how many (`dropped_records`).

use std::collections::{HashMap, VecDeque};
use std::sync::{Mutex, PoisonError};

use axum::extract::{FromRequestParts, Path, State};
use axum::http::request::Parts;
use axum::http::{header, HeaderMap};
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

/// The header that carries an episode's token beside the API key.
pub const EPISODE_TOKEN_HEADER: &str = "x-temper-episode-token";

/// Longest episode id.
pub const MAX_EPISODE_ID_LEN: usize = 128;

/// The tokens a request presents for an episode: `X-Temper-Episode-Token`
/// and the bearer token.
fn presented(headers: &HeaderMap) -> impl Iterator<Item = &str> {
    let named = headers
        .get(EPISODE_TOKEN_HEADER)
        .and_then(|v| v.to_str().ok());
    let bearer = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "));
    named.into_iter().chain(bearer)
}

/// Equal, in time independent of where they differ.
pub(crate) fn same_secret(a: &str, b: &str) -> bool {
    use subtle::ConstantTimeEq;
    a.as_bytes().ct_eq(b.as_bytes()).into()
}

/// A fresh random string of `n` characters of `[a-z0-9]` (ids and tokens;
/// `rand`'s thread generator is a CSPRNG seeded by the OS).
fn random_string(n: usize) -> String {
    use rand::Rng;
    const CHARS: &[u8] = b"abcdefghijklmnopqrstuvwxyz0123456789";
    let mut rng = rand::rng();
    (0..n)
        .map(|_| CHARS[rng.random_range(0..CHARS.len())] as char)
        .collect()
}

/// The episode a request names, if any: `/episodes/ID/...` or
/// `/v1/episodes/ID`, else the `X-Temper-Episode` header (raw, unchecked).
pub(super) fn named_episode(path: &str, headers: &HeaderMap) -> Option<String> {
    path.strip_prefix("/episodes/")
        .or_else(|| path.strip_prefix("/v1/episodes/"))
        .map(|rest| rest.split('/').next().unwrap_or_default().to_string())
        .or_else(|| {
            headers
                .get(EPISODE_HEADER)
                .and_then(|v| v.to_str().ok())
                .map(str::to_string)
        })
}

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

pub(super) fn check_id(id: &str) -> Result<(), OpenAiError> {
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

impl FromRequestParts<OpenAiState> for EpisodeTag {
    type Rejection = OpenAiError;

    async fn from_request_parts(
        parts: &mut Parts,
        s: &OpenAiState,
    ) -> Result<Self, Self::Rejection> {
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
            s.inner.captures.authorize(id, &parts.headers)?;
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

struct Episode {
    /// The secret every request about the episode presents.
    token: String,
    /// The client opted in to training on it (`"train": true` at creation).
    train: bool,
    /// Its reward, once `POST /v1/episodes/ID/reward` gave one.
    reward: Option<f64>,
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

    fn lock(&self) -> std::sync::MutexGuard<'_, Store> {
        self.store.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A new, empty episode: its id and token. The oldest episodes make
    /// room when the store holds its most.
    fn create(&self, train: bool) -> Result<(String, String), OpenAiError> {
        let mut st = self.lock();
        let st = &mut *st;
        let id = loop {
            let id = format!("ep-{}", random_string(24));
            if !st.episodes.contains_key(&id) {
                break id;
            }
        };
        let token = random_string(40);
        while st.episodes.len() >= self.limits.max_episodes.max(1) {
            if !evict_oldest(st) {
                break;
            }
        }
        st.order.push_back(id.clone());
        st.episodes.insert(
            id.clone(),
            Episode {
                token: token.clone(),
                train,
                reward: None,
                records: VecDeque::new(),
                bytes: 0,
                next_seq: 0,
                dropped: 0,
            },
        );
        Ok((id, token))
    }

    /// Whether `headers` present episode `id`'s token; an unknown id and a
    /// wrong token are the same 404 (ids are no secret, tokens are).
    pub(super) fn authorize(&self, id: &str, headers: &HeaderMap) -> Result<(), OpenAiError> {
        if self.opens(id, headers)? {
            Ok(())
        } else {
            Err(OpenAiError::EpisodeNotFound(id.to_string()))
        }
    }

    /// Whether episode `id` exists and `headers` present its token.
    pub(super) fn opens(&self, id: &str, headers: &HeaderMap) -> Result<bool, OpenAiError> {
        let st = self.lock();
        Ok(st
            .episodes
            .get(id)
            .is_some_and(|ep| presented(headers).any(|t| same_secret(t, &ep.token))))
    }

    fn push(&self, mut rec: CaptureRecord) -> Result<(), OpenAiError> {
        let mut st = self.lock();
        let st = &mut *st;
        // Deleted or evicted while the call ran: its token is gone, and a
        // record must not bring the episode back without one.
        let Some(ep) = st.episodes.get_mut(&rec.episode) else {
            tracing::debug!(episode = %rec.episode, "episode gone before its call finished");
            return Ok(());
        };
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
        let st = self.lock();
        Ok(st.episodes.get(id).map(|ep| {
            let records: Vec<&str> = ep.records.iter().map(String::as_str).collect();
            format!(
                "{{\"object\":\"episode\",\"id\":{},\"train\":{},\"reward\":{},\
                 \"dropped_records\":{},\"records\":[{}]}}",
                Value::String(id.to_string()),
                ep.train,
                ep.reward.map_or(Value::Null, Value::from),
                ep.dropped,
                records.join(",")
            )
        }))
    }

    /// Gives episode `id` its reward (once: a second is refused) and
    /// answers what a durable store needs of it: whether it opted in to
    /// training, its records (`None` when some were dropped: an episode
    /// trained on must be whole) — or `None` when there is no such episode.
    pub(super) fn set_reward(
        &self,
        id: &str,
        reward: f64,
    ) -> Result<Option<RewardedEpisode>, OpenAiError> {
        let mut st = self.lock();
        let Some(ep) = st.episodes.get_mut(id) else {
            return Ok(None);
        };
        if ep.reward.is_some() {
            return Err(OpenAiError::Conflict(format!(
                "episode {id:?} already has a reward"
            )));
        }
        if ep.records.is_empty() {
            return Err(OpenAiError::bad(format!(
                "episode {id:?} has no calls yet: reward it after the model answered"
            )));
        }
        ep.reward = Some(reward);
        let records = if ep.dropped > 0 {
            None
        } else {
            let parsed: Result<Vec<CaptureRecord>, _> =
                ep.records.iter().map(|r| serde_json::from_str(r)).collect();
            Some(parsed.map_err(|e| OpenAiError::Internal(format!("capture record: {e}")))?)
        };
        Ok(Some(RewardedEpisode {
            train: ep.train,
            records,
        }))
    }

    /// Takes back a reward [`set_reward`](Self::set_reward) gave (storing it
    /// failed, so the client may retry).
    /// The calls of episode `id` so far (`None`: no such episode), for
    /// the server's rubric; an error when some were dropped.
    pub(super) fn calls(&self, id: &str) -> Result<Option<Vec<CaptureRecord>>, OpenAiError> {
        let st = self.lock();
        let Some(ep) = st.episodes.get(id) else {
            return Ok(None);
        };
        if ep.dropped > 0 {
            return Err(OpenAiError::bad(format!(
                "some of episode {id:?}'s calls were dropped (capture store full): \
                 the rubric cannot see its conversation"
            )));
        }
        let parsed: Result<Vec<CaptureRecord>, _> =
            ep.records.iter().map(|r| serde_json::from_str(r)).collect();
        parsed
            .map(Some)
            .map_err(|e| OpenAiError::Internal(format!("capture record: {e}")))
    }

    pub(super) fn clear_reward(&self, id: &str) -> Result<(), OpenAiError> {
        if let Some(ep) = self.lock().episodes.get_mut(id) {
            ep.reward = None;
        }
        Ok(())
    }

    fn remove(&self, id: &str) -> Result<bool, OpenAiError> {
        let mut st = self.lock();
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

/// What rewarding an episode hands to the durable store.
pub(super) struct RewardedEpisode {
    /// The client opted in to training on it.
    pub(super) train: bool,
    /// Its records, when none were dropped.
    pub(super) records: Option<Vec<CaptureRecord>>,
}

/// The body of `POST /v1/episodes` (optional).
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct CreateEpisode {
    /// Opt in to training: once rewarded, a learning server
    /// (`temper serve --learn`) may train on the episode.
    #[serde(default)]
    train: bool,
}

/// `POST /v1/episodes` (body optional: `{"train": true}` opts in to
/// training): a new episode, `{"object": "episode", "id", "token",
/// "train"}`.
pub(super) async fn create_episode(
    State(s): State<OpenAiState>,
    body: axum::body::Bytes,
) -> Result<Response, OpenAiError> {
    let req: CreateEpisode = if body.iter().all(u8::is_ascii_whitespace) {
        CreateEpisode::default()
    } else {
        // `null` is no options, as an empty body is (clients send either).
        serde_json::from_slice::<Option<CreateEpisode>>(&body)
            .map_err(|e| OpenAiError::bad(format!("invalid request body: {e}")))?
            .unwrap_or_default()
    };
    if req.train && s.inner.learning.is_none() {
        return Err(OpenAiError::invalid(
            "train",
            "this server does not learn from use: start temper serve with --learn CONFIG",
        ));
    }
    let (id, token) = s.inner.captures.create(req.train)?;
    Ok(
        axum::Json(json!({"object": "episode", "id": id, "token": token, "train": req.train}))
            .into_response(),
    )
}

/// `GET /v1/episodes/{id}` (with the episode's token).
pub(super) async fn get_episode(
    State(s): State<OpenAiState>,
    Path(id): Path<String>,
    headers: HeaderMap,
) -> Result<Response, OpenAiError> {
    check_id(&id)?;
    s.inner.captures.authorize(&id, &headers)?;
    match s.inner.captures.get(&id)? {
        Some(body) => Ok(([(header::CONTENT_TYPE, "application/json")], body).into_response()),
        None => Err(OpenAiError::EpisodeNotFound(id)),
    }
}

/// `DELETE /v1/episodes/{id}` (with the episode's token).
pub(super) async fn delete_episode(
    State(s): State<OpenAiState>,
    Path(id): Path<String>,
    headers: HeaderMap,
) -> Result<Response, OpenAiError> {
    check_id(&id)?;
    s.inner.captures.authorize(&id, &headers)?;
    if !s.inner.captures.remove(&id)? {
        return Err(OpenAiError::EpisodeNotFound(id));
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
        let one = serde_json::to_string(&rec("ep-x", 10)).expect("json").len();
        let s = CaptureStore::new(CaptureLimits {
            max_episodes: 2,
            // Ids are all the same length, so every record is `one` long.
            max_bytes: 3 * (one + 24) + 8,
        });
        let (a, _) = s.create(false).expect("create");
        let (b, _) = s.create(false).expect("create");
        s.push(rec(&a, 10)).expect("push");
        s.push(rec(&b, 10)).expect("push");
        let (c, _) = s.create(false).expect("create");
        s.push(rec(&c, 10)).expect("push");
        // Two episodes at most: the oldest went, and a record of it finds
        // no episode to revive.
        assert!(records(&s, &a).is_none());
        s.push(rec(&a, 10)).expect("push");
        assert!(records(&s, &a).is_none());
        assert_eq!(records(&s, &c).expect("c")["records"][0]["seq"], 0);
        // Bytes: c grows; b (older) is evicted first, then c's oldest records.
        for _ in 0..4 {
            s.push(rec(&c, 10)).expect("push");
        }
        assert!(records(&s, &b).is_none());
        let got = records(&s, &c).expect("c");
        let seqs: Vec<u64> = got["records"]
            .as_array()
            .expect("records")
            .iter()
            .map(|r| r["seq"].as_u64().expect("seq"))
            .collect();
        assert_eq!(seqs, vec![2, 3, 4]);
        assert_eq!(got["dropped_records"], 2);
        assert!(s.lock().bytes <= 3 * (one + 24) + 8);
        assert!(s.remove(&c).expect("remove"));
        assert!(!s.remove(&c).expect("remove"));
        assert_eq!(s.lock().bytes, 0);
    }

    #[test]
    fn only_the_episodes_token_opens_it() {
        let s = CaptureStore::new(CaptureLimits::default());
        let (id, token) = s.create(false).expect("create");
        let (other, other_token) = s.create(false).expect("create");
        assert_ne!(id, other);
        assert_ne!(token, other_token);
        assert!(id.starts_with("ep-") && valid_episode_id(&id));
        assert_eq!(token.len(), 40);
        let with = |name: &str, v: &str| {
            let mut h = HeaderMap::new();
            h.insert(
                axum::http::HeaderName::from_bytes(name.as_bytes()).expect("name"),
                v.parse().expect("value"),
            );
            h
        };
        let bearer = |t: &str| with("authorization", &format!("Bearer {t}"));
        assert!(s.opens(&id, &bearer(&token)).expect("opens"));
        assert!(s
            .opens(&id, &with(EPISODE_TOKEN_HEADER, &token))
            .expect("opens"));
        assert!(!s.opens(&id, &bearer(&other_token)).expect("opens"));
        assert!(!s.opens(&id, &HeaderMap::new()).expect("opens"));
        assert!(!s.opens("ep-unknown", &bearer(&token)).expect("opens"));
        assert!(s.authorize(&other, &bearer(&token)).is_err());
        assert!(
            same_secret("abc", "abc") && !same_secret("abc", "abd") && !same_secret("ab", "abc")
        );
    }
}
