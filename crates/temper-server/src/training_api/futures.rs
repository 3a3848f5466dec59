//! Futures: every training and sampling call answers a request id at once;
//! `retrieve_future` long-polls for the result. Results are evicted after
//! delivery, after a time-to-live, or beyond a count; resubmits of the same
//! `seq_id` are answered with the first response (dedupe).

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Value};
use temper_engine::EngineError;

use super::state::ApiState;
use super::wire::parse;
use crate::error::ApiError;

pub(super) enum FutureState {
    Pending,
    Json(Value),
    Proto(Vec<u8>),
    Failed {
        error: String,
        category: &'static str,
    },
}

impl ApiState {
    /// Drop results delivered longer than the grace period ago, and the
    /// resubmit records that point at them.
    /// Also drop results never retrieved after `result_ttl`, and the oldest
    /// finished results beyond `max_results`, so memory stays bounded.
    fn evict_delivered(&self) {
        let grace = self.0.config.result_grace;
        let limits = &self.0.config.limits;
        let mut t = self.tables();
        let now = std::time::Instant::now();
        let mut old: Vec<String> = t
            .delivered
            .iter()
            .filter(|(_, at)| now.duration_since(**at) >= grace)
            .map(|(id, _)| id.clone())
            .collect();
        old.extend(
            t.finished
                .iter()
                .filter(|(_, at)| now.duration_since(**at) >= limits.result_ttl)
                .map(|(id, _)| id.clone()),
        );
        if t.finished.len() > limits.max_results {
            let mut by_age: Vec<(std::time::Instant, String)> = t
                .finished
                .iter()
                .map(|(id, at)| (*at, id.clone()))
                .collect();
            by_age.sort();
            let excess = t.finished.len() - limits.max_results;
            old.extend(by_age.into_iter().take(excess).map(|(_, id)| id));
        }
        if old.is_empty() {
            return;
        }
        for id in &old {
            t.delivered.remove(id);
            t.finished.remove(id);
            t.futures.remove(id);
        }
        let gone: std::collections::HashSet<&str> = old.iter().map(String::as_str).collect();
        t.seen.retain(|_, v| {
            v.get("request_id")
                .and_then(|r| r.as_str())
                .is_none_or(|r| !gone.contains(r))
        });
    }

    /// Register a future whose result `work` produces; returns its id.
    pub(super) fn spawn_future<F>(&self, work: F) -> String
    where
        F: std::future::Future<Output = std::result::Result<FutureState, EngineError>>
            + Send
            + 'static,
    {
        self.evict_delivered();
        let id = self.next_id("req");
        self.tables()
            .futures
            .insert(id.clone(), FutureState::Pending);
        let state = self.clone();
        let fid = id.clone();
        tokio::spawn(async move {
            let result = match work.await {
                Ok(s) => s,
                Err(e) => FutureState::Failed {
                    error: e.to_string(),
                    category: match e {
                        EngineError::InvalidRequest(_) | EngineError::NotFound(_) => "user",
                        _ => "server",
                    },
                },
            };
            {
                let mut t = state.tables();
                t.finished.insert(fid.clone(), std::time::Instant::now());
                t.futures.insert(fid, result);
            }
            state.0.done.notify_waiters();
        });
        id
    }

    /// A future that has already failed (validation before any work).
    pub(super) fn failed_future(&self, error: String) -> String {
        self.evict_delivered();
        let id = self.next_id("req");
        let mut t = self.tables();
        t.finished.insert(id.clone(), std::time::Instant::now());
        t.futures.insert(
            id.clone(),
            FutureState::Failed {
                error,
                category: "user",
            },
        );
        id
    }

    /// Return the response already given for `(owner, seq_id)`, or record `make()`'s.
    pub(super) fn dedupe(
        &self,
        owner: &str,
        seq_id: Option<i64>,
        make: impl FnOnce() -> Value,
    ) -> Value {
        let Some(seq) = seq_id else { return make() };
        let key = (owner.to_string(), seq);
        if let Some(v) = self.tables().seen.get(&key) {
            return v.clone();
        }
        let v = make();
        self.tables().seen.insert(key, v.clone());
        v
    }
}

#[derive(Deserialize)]
struct RetrieveFuture {
    request_id: String,
}

pub(super) async fn retrieve_future(
    State(s): State<ApiState>,
    _headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    let r: RetrieveFuture = parse(&body)?;
    let deadline = tokio::time::Instant::now() + s.0.config.long_poll;
    loop {
        // Register for wake-ups before looking, so a completion between the
        // look and the wait is not missed.
        let notified = s.0.done.notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        {
            let mut t = s.tables();
            if !matches!(
                t.futures.get(&r.request_id),
                None | Some(FutureState::Pending)
            ) {
                let now = std::time::Instant::now();
                t.delivered.entry(r.request_id.clone()).or_insert(now);
            }
            match t.futures.get(&r.request_id) {
                None => {
                    return Err(ApiError::NotFound(format!(
                        "unknown request_id {}",
                        r.request_id
                    )))
                }
                Some(FutureState::Pending) => {}
                Some(FutureState::Json(v)) => return Ok(Json(v.clone()).into_response()),
                Some(FutureState::Proto(b)) => {
                    return Ok((
                        StatusCode::OK,
                        [(header::CONTENT_TYPE, "application/x-protobuf")],
                        b.clone(),
                    )
                        .into_response())
                }
                Some(FutureState::Failed { error, category }) => {
                    return Ok(Json(json!({"error": error, "category": category})).into_response())
                }
            }
        }
        if tokio::time::timeout_at(deadline, notified).await.is_err() {
            return Ok(Json(
                json!({"type": "try_again", "request_id": r.request_id, "queue_state": "active"}),
            )
            .into_response());
        }
    }
}
