//! Feedback on served calls: `POST /v1/episodes/{id}/reward` attaches a
//! reward to what the model did in an episode, and a learning server
//! (`temper serve --learn`) keeps the rewarded episodes that opted in to
//! training durably, for its learner.
//!
//! The reward is the episode's, one number (a thumbs up/down, a task
//! outcome, a score), given once: `{"reward": 1.0}`. It is authorized by
//! the episode's token exactly as `GET /v1/episodes/ID` is (a wrong token
//! and an unknown id get the same 404), so a client cannot reward another
//! client's episode. Only an episode created with `{"train": true}` whose
//! records are whole (none dropped by the capture store's bound) is stored;
//! any other reward is kept on the episode in memory and never trained on.
//!
//! The store ([`RewardStore`]) is an append-only JSONL file, one rewarded
//! episode a line, written and `fsync`ed before the reward is answered: a
//! `kill -9` at any point loses no answered reward (a torn last line, from
//! a kill mid-write, was never answered and is cut off when the file is
//! reopened). It is bounded in episodes and bytes; beyond either the oldest
//! go, by rewriting the file to a temporary sibling and renaming it over.

use std::collections::VecDeque;
use std::fs::{File, OpenOptions};
use std::io::{BufRead, BufReader, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use axum::body::Bytes;
use axum::extract::{Path as UrlPath, State};
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use tokio::sync::watch;

use super::capture::{check_id, CaptureRecord};
use super::error::OpenAiError;
use super::state::{now_secs, OpenAiState};
use super::versions::{sync_dir, write_atomic};

/// One rewarded episode as stored (a line of the JSONL file).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StoredEpisode {
    /// Its position in the store: 0, 1, ... in the order rewards arrived
    /// (never reused, also across restarts).
    pub n: u64,
    /// The episode's id.
    pub id: String,
    /// Its reward.
    pub reward: f64,
    /// Unix seconds when the reward arrived.
    pub created: u64,
    /// Its captured calls, in order.
    pub records: Vec<CaptureRecord>,
}

/// Bounds of the rewarded-episode store.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RewardLimits {
    /// Most episodes kept.
    pub max_episodes: usize,
    /// Most bytes of the JSONL file.
    pub max_bytes: usize,
}

impl Default for RewardLimits {
    /// 10 000 episodes, 256 MiB.
    fn default() -> Self {
        Self {
            max_episodes: 10_000,
            max_bytes: 256 << 20,
        }
    }
}

struct Stored {
    episode: Arc<StoredEpisode>,
    /// Its line's length (newline included).
    bytes: usize,
}

struct Inner {
    file: File,
    episodes: VecDeque<Stored>,
    bytes: usize,
    next_n: u64,
}

/// The durable, bounded store of rewarded episodes that opted in to
/// training.
pub struct RewardStore {
    path: PathBuf,
    limits: RewardLimits,
    inner: Mutex<Inner>,
    /// The next `n`: a learner waits on it for new episodes.
    appended: watch::Sender<u64>,
}

impl RewardStore {
    /// Opens (or creates) the store at `path`, cutting off a torn last
    /// line. A damaged line elsewhere is an error: the file was not written
    /// by this store.
    pub fn open(path: &Path, limits: RewardLimits) -> std::io::Result<Self> {
        let bad = |m: String| std::io::Error::new(std::io::ErrorKind::InvalidData, m);
        let mut episodes = VecDeque::new();
        let (mut bytes, mut good_end) = (0usize, 0u64);
        let mut torn = false;
        if path.exists() {
            let mut reader = BufReader::new(File::open(path)?);
            let mut line = String::new();
            loop {
                line.clear();
                let n = reader.read_line(&mut line)?;
                if n == 0 {
                    break;
                }
                let complete = line.ends_with('\n');
                match serde_json::from_str::<StoredEpisode>(line.trim_end()) {
                    Ok(ep) if complete => {
                        good_end += n as u64;
                        bytes += n;
                        episodes.push_back(Stored {
                            episode: Arc::new(ep),
                            bytes: n,
                        });
                    }
                    _ => {
                        // Only the last line may be torn.
                        let mut rest = String::new();
                        if reader.read_line(&mut rest)? > 0 {
                            return Err(bad(format!(
                                "{}: a damaged line at byte {good_end}",
                                path.display()
                            )));
                        }
                        torn = true;
                        break;
                    }
                }
            }
        }
        let file = OpenOptions::new()
            .create(true)
            .read(true)
            .append(true)
            .open(path)?;
        if torn {
            tracing::warn!(path = %path.display(), "cut off a torn last line (a kill mid-write; it was never acknowledged)");
            file.set_len(good_end)?;
            file.sync_all()?;
        }
        if let Some(parent) = path.parent() {
            sync_dir(parent)?;
        }
        let next_n = episodes.back().map_or(0, |s| s.episode.n + 1);
        let store = Self {
            path: path.to_path_buf(),
            limits,
            inner: Mutex::new(Inner {
                file,
                episodes,
                bytes,
                next_n,
            }),
            appended: watch::channel(next_n).0,
        };
        {
            let mut st = store.lock();
            store.bound(&mut st)?;
        }
        Ok(store)
    }

    /// The workspace's poisoning policy (docs/ARCHITECTURE.md): recover;
    /// every critical section leaves whole values behind.
    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Appends a rewarded episode and syncs it to disk (blocking); its `n`.
    pub fn append(
        &self,
        id: &str,
        reward: f64,
        records: Vec<CaptureRecord>,
    ) -> std::io::Result<u64> {
        let mut st = self.lock();
        let ep = StoredEpisode {
            n: st.next_n,
            id: id.to_string(),
            reward,
            created: now_secs(),
            records,
        };
        let mut line = serde_json::to_string(&ep).map_err(std::io::Error::other)?;
        line.push('\n');
        // One write of the whole line, then fsync: acknowledged means on disk.
        st.file.write_all(line.as_bytes())?;
        st.file.sync_data()?;
        let n = ep.n;
        st.next_n += 1;
        st.bytes += line.len();
        st.episodes.push_back(Stored {
            episode: Arc::new(ep),
            bytes: line.len(),
        });
        self.bound(&mut st)?;
        drop(st);
        self.appended.send_replace(n + 1);
        Ok(n)
    }

    /// Drops the oldest episodes beyond the bounds, rewriting the file.
    fn bound(&self, st: &mut Inner) -> std::io::Result<()> {
        let over = |st: &Inner| {
            st.episodes.len() > self.limits.max_episodes.max(1)
                || (st.bytes > self.limits.max_bytes && st.episodes.len() > 1)
        };
        if !over(st) {
            return Ok(());
        }
        let mut dropped = 0;
        while over(st) {
            let Some(old) = st.episodes.pop_front() else {
                break;
            };
            st.bytes -= old.bytes;
            dropped += 1;
        }
        let mut text = String::with_capacity(st.bytes);
        for s in &st.episodes {
            text.push_str(&serde_json::to_string(&*s.episode).map_err(std::io::Error::other)?);
            text.push('\n');
        }
        write_atomic(&self.path, text.as_bytes())?;
        let mut file = OpenOptions::new()
            .read(true)
            .append(true)
            .open(&self.path)?;
        file.seek(SeekFrom::End(0))?;
        st.file = file;
        st.bytes = text.len();
        tracing::warn!(
            dropped,
            kept = st.episodes.len(),
            "rewarded-episode store full: dropped the oldest"
        );
        Ok(())
    }

    /// The stored episodes with `n >= from`, oldest first.
    pub fn since(&self, from: u64) -> std::io::Result<Vec<Arc<StoredEpisode>>> {
        Ok(self
            .lock()
            .episodes
            .iter()
            .filter(|s| s.episode.n >= from)
            .map(|s| s.episode.clone())
            .collect())
    }

    /// Episodes held and their bytes on disk.
    pub fn size(&self) -> std::io::Result<(usize, usize)> {
        let st = self.lock();
        Ok((st.episodes.len(), st.bytes))
    }

    /// Follows the next `n` (it changes when an episode is appended).
    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.appended.subscribe()
    }
}

/// The body of `POST /v1/episodes/{id}/reward`: a reward, or the task's
/// reference for the server's rubric to compute one.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RewardBody {
    reward: Option<f64>,
    rubric: Option<RubricRequest>,
}

/// `{"rubric": {"answer": ..., "info": ...}}`: what the environment's
/// rubric compares the conversation with (both optional).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RubricRequest {
    answer: Option<String>,
    #[serde(default)]
    info: Value,
}

/// The reward of episode `id` by the server's rubric.
async fn rubric_reward(s: &OpenAiState, id: &str, req: RubricRequest) -> Result<f64, OpenAiError> {
    let Some(l) = s.inner.learning.as_ref() else {
        return Err(OpenAiError::invalid(
            "rubric",
            "this server has no rubric (start it with --learn and [learn] rubric)",
        ));
    };
    let Some(rubric) = l.rubric.clone() else {
        return Err(OpenAiError::invalid(
            "rubric",
            "this server has no rubric ([learn] rubric is not set)",
        ));
    };
    let Some(records) = s.inner.captures.calls(id)? else {
        return Err(OpenAiError::EpisodeNotFound(id.to_string()));
    };
    if records.is_empty() {
        return Err(OpenAiError::bad(format!(
            "episode {id:?} has no calls yet: reward it after the model answered"
        )));
    }
    match rubric.score(records, req.answer, req.info).await {
        Ok(r) if r.is_finite() => Ok(r),
        Ok(r) => Err(rubric_failed(l, id, &format!("the rubric returned {r}"))),
        Err(e) => Err(rubric_failed(l, id, &e)),
    }
}

/// A rubric that could not score: counted, logged, answered with a 422 (no
/// reward is recorded, so the client may retry or post its own).
fn rubric_failed(l: &super::Learning, id: &str, why: &str) -> OpenAiError {
    let n = l
        .rubric_errors
        .fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        + 1;
    tracing::warn!(episode = %id, errors = n, "rubric could not score: {why}");
    OpenAiError::RubricFailed(format!(
        "the server's rubric could not score episode {id:?}: {why} ({n} rubric error(s) so far)"
    ))
}

/// `POST /v1/episodes/{id}/reward` (with the episode's token): `{"reward":
/// R}`, or `{"rubric": {"answer": A, "info": I}}` for the server's rubric
/// (`[learn] rubric`) to score the episode's conversation; answers the
/// reward and whether it was stored for training.
pub(super) async fn reward_episode(
    State(s): State<OpenAiState>,
    UrlPath(id): UrlPath<String>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, OpenAiError> {
    check_id(&id)?;
    s.inner.captures.authorize(&id, &headers)?;
    let req: RewardBody = serde_json::from_slice(&body).map_err(|e| {
        OpenAiError::invalid(
            "reward",
            format!(
                "invalid request body: {e} (send {{\"reward\": NUMBER}} or \
                 {{\"rubric\": {{\"answer\": ...}}}})"
            ),
        )
    })?;
    let reward = match (req.reward, req.rubric) {
        (Some(r), None) if r.is_finite() => r,
        (Some(_), None) => {
            return Err(OpenAiError::invalid(
                "reward",
                "reward must be a finite number",
            ))
        }
        (None, Some(rubric)) => rubric_reward(&s, &id, rubric).await?,
        _ => {
            return Err(OpenAiError::invalid(
                "reward",
                "send exactly one of \"reward\" and \"rubric\"",
            ))
        }
    };
    let Some(ep) = s.inner.captures.set_reward(&id, reward)? else {
        return Err(OpenAiError::EpisodeNotFound(id));
    };
    let (stored, reason) = match (&s.inner.learning, ep.train, ep.records) {
        (None, _, _) => (None, Some("this server does not learn from use")),
        (Some(_), false, _) => (None, Some("the episode did not opt in to training")),
        (Some(_), true, None) => (
            None,
            Some("some of the episode's records were dropped (capture store full)"),
        ),
        (Some(l), true, Some(records)) => {
            let store = l.rewards.clone();
            let eid = id.clone();
            let appended =
                tokio::task::spawn_blocking(move || store.append(&eid, reward, records)).await;
            match appended {
                Ok(Ok(n)) => (Some(n), None),
                Ok(Err(e)) => {
                    s.inner.captures.clear_reward(&id)?;
                    return Err(OpenAiError::Internal(format!("storing a reward: {e}")));
                }
                Err(e) => {
                    s.inner.captures.clear_reward(&id)?;
                    return Err(OpenAiError::Internal(format!("reward store task: {e}")));
                }
            }
        }
    };
    Ok(axum::Json(json!({
        "object": "episode.reward", "id": id, "reward": reward,
        "stored": stored.is_some(), "n": stored, "reason": reason,
    }))
    .into_response())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(ep: &str) -> CaptureRecord {
        serde_json::from_value(json!({
            "episode": ep, "seq": 0, "request_id": "r", "endpoint": "completions",
            "choice": 0, "model": "m", "version": 1, "created": 0,
            "prompt_token_ids": [1, 2], "completion_token_ids": [3],
            "logprobs": [-0.5], "finish_reason": "stop", "sampling": {},
            "response": {"text": "x"},
        }))
        .expect("record")
    }

    #[test]
    fn the_store_survives_reopening_cuts_a_torn_line_and_stays_bounded() {
        let dir = tempfile::tempdir().expect("tmp");
        let path = dir.path().join("rewarded.jsonl");
        let limits = RewardLimits {
            max_episodes: 3,
            max_bytes: 1 << 20,
        };
        let s = RewardStore::open(&path, limits).expect("open");
        for i in 0..2 {
            assert_eq!(
                s.append(&format!("ep-{i}"), 1.0, vec![rec("e")])
                    .expect("append"),
                i
            );
        }
        drop(s);
        // A kill mid-write leaves half a line: cut off, the rest kept.
        let mut f = OpenOptions::new().append(true).open(&path).expect("f");
        f.write_all(b"{\"n\":2,\"id\":\"ep-half").expect("write");
        drop(f);
        let s = RewardStore::open(&path, limits).expect("reopen");
        let got: Vec<u64> = s.since(0).expect("since").iter().map(|e| e.n).collect();
        assert_eq!(got, vec![0, 1]);
        // Numbering continues; the bound drops the oldest, on disk too.
        for i in 2..5 {
            assert_eq!(s.append("ep-x", 0.5, vec![rec("e")]).expect("append"), i);
        }
        let got: Vec<u64> = s.since(0).expect("since").iter().map(|e| e.n).collect();
        assert_eq!(got, vec![2, 3, 4]);
        assert_eq!(s.since(4).expect("since").len(), 1);
        drop(s);
        let s = RewardStore::open(&path, limits).expect("reopen");
        let got: Vec<u64> = s.since(0).expect("since").iter().map(|e| e.n).collect();
        assert_eq!(got, vec![2, 3, 4]);
        assert_eq!(
            s.size().expect("size").1 as u64,
            path.metadata().expect("meta").len()
        );
        // A byte bound keeps at least the newest episode.
        let one = s.size().expect("size").1 / 3;
        drop(s);
        let s = RewardStore::open(
            &path,
            RewardLimits {
                max_episodes: 10,
                max_bytes: one + 1,
            },
        )
        .expect("reopen");
        assert_eq!(s.since(0).expect("since").len(), 1);
        // Damage before the last line is refused, not silently dropped.
        drop(s);
        std::fs::write(&path, "garbage\n{\"also\": 1}\n").expect("write");
        assert!(RewardStore::open(&path, limits).is_err());
    }
}
