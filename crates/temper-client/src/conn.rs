//! The transport of the tinker wire protocol, as the tinker SDK drives it
//! (`docs/tinker-protocol.md`; every request checked against the SDK's own
//! types by `tests/python/test_tinker_client.py`): the `X-API-Key` header
//! (or the JWT it is exchanged for, when the service asks), submits retried
//! like the SDK's operation layer, futures polled like its
//! `retrieve_future` loop, and the session heartbeat.

use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

use rand::Rng;
use serde_json::{json, Value};
use temper_engine::{EngineError, Result};

/// The tinker SDK version whose wire protocol this client speaks (sent as
/// `sdk_version`, which a service may use to pick its feature flags).
pub const SDK_VERSION: &str = "0.38.0";

/// How often the session is kept alive (the SDK's period).
const HEARTBEAT: Duration = Duration::from_secs(10);
/// A poll's own timeout (the SDK's); the service long-polls within it.
const POLL_TIMEOUT: Duration = Duration::from_secs(45);
/// Any other request's.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(60);
/// How long a refused or failed submit is retried (the SDK's 5 minutes).
const RETRY_FOR: Duration = Duration::from_secs(300);
/// Bare 400s a poll tolerates (a proxy may inject them; the SDK's budget).
const BAD_POLLS: u32 = 3;

pub(crate) fn remote(e: impl std::fmt::Display) -> EngineError {
    EngineError::Remote(e.to_string())
}

/// A request body.
#[derive(Clone)]
pub(crate) enum Body {
    Json(Value),
    Proto(Vec<u8>),
}

/// A resolved future.
pub(crate) enum Reply {
    Json(Value),
    Proto(Vec<u8>),
}

/// What a future resolves to, named as the SDK names it in
/// `X-Tinker-Request-Type`; forward and sample results are protobuf.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Kind {
    CreateModel,
    Forward,
    ForwardBackward,
    OptimStep,
    SaveWeights,
    SaveWeightsForSampler,
    LoadWeights,
    Sample,
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::CreateModel => "CreateModel",
            Kind::Forward => "Forward",
            Kind::ForwardBackward => "ForwardBackward",
            Kind::OptimStep => "OptimStep",
            Kind::SaveWeights => "SaveWeights",
            Kind::SaveWeightsForSampler => "SaveWeightsForSampler",
            Kind::LoadWeights => "LoadWeights",
            Kind::Sample => "Sample",
        }
    }

    fn proto(self) -> bool {
        matches!(self, Kind::Forward | Kind::ForwardBackward | Kind::Sample)
    }
}

/// The service's `client/config` flags this client honours.
#[derive(Debug, Clone)]
pub(crate) struct Flags {
    /// Most datums per `forward_backward` request.
    pub max_chunk_len: usize,
    /// Most (encoded) datum bytes per `forward_backward` request.
    pub max_chunk_bytes: usize,
}

/// A connection to one service.
pub(crate) struct Conn {
    http: reqwest::Client,
    base: String,
    api_key: String,
    /// With JWT exchange on (`pjwt_auth_enabled`): the short-lived token
    /// sent in the key's place, refreshed when the service rejects it.
    jwt: Option<Mutex<String>>,
    pub flags: Flags,
}

/// Statuses the SDK retries a submit on.
fn retryable(s: reqwest::StatusCode) -> bool {
    matches!(s.as_u16(), 408 | 409 | 429) || s.is_server_error()
}

fn backoff(attempt: u32) -> Duration {
    Duration::from_secs((1u64 << attempt.min(5)).min(30))
}

async fn status_error(route: &str, resp: reqwest::Response) -> EngineError {
    let status = resp.status();
    let text = resp.text().await.unwrap_or_default();
    if status.is_client_error() {
        EngineError::InvalidRequest(format!("{route}: {status}: {text}"))
    } else {
        remote(format!("{route}: {status}: {text}"))
    }
}

impl Conn {
    /// Connect to `base_url` and read its `client/config` (exchanging the
    /// key for a JWT when it asks).
    pub async fn open(base_url: &str, api_key: &str) -> Result<Self> {
        let mut conn = Self {
            http: reqwest::Client::builder()
                .user_agent(concat!("temper/", env!("CARGO_PKG_VERSION")))
                .connect_timeout(Duration::from_secs(5))
                .build()
                .map_err(remote)?,
            base: base_url.trim_end_matches('/').to_string(),
            api_key: api_key.to_string(),
            jwt: None,
            flags: Flags {
                max_chunk_len: 1024,
                max_chunk_bytes: 5_000_000,
            },
        };
        let cfg = conn
            .post_json("client/config", json!({"sdk_version": SDK_VERSION}))
            .await?;
        let size = |k: &str, d: usize| {
            cfg.get(k)
                .and_then(Value::as_u64)
                .map_or(d, |v| (v as usize).max(1))
        };
        conn.flags = Flags {
            max_chunk_len: size("fwdbwd_max_chunk_len", 1024),
            max_chunk_bytes: size("fwdbwd_max_chunk_bytes_count", 5_000_000),
        };
        if cfg.get("pjwt_auth_enabled").and_then(Value::as_bool) == Some(true) {
            let token = conn.exchange().await?;
            conn.jwt = Some(Mutex::new(token));
        }
        Ok(conn)
    }

    /// The key exchanged for a JWT (`POST auth/token`).
    async fn exchange(&self) -> Result<String> {
        let resp = self
            .build(
                "auth/token",
                &Body::Json(json!({})),
                &[],
                REQUEST_TIMEOUT,
                &self.api_key,
            )
            .send()
            .await
            .map_err(|e| remote(format!("auth/token: {e}")))?;
        if !resp.status().is_success() {
            return Err(status_error("auth/token", resp).await);
        }
        let v: Value = resp.json().await.map_err(remote)?;
        v.get("jwt")
            .and_then(Value::as_str)
            .map(str::to_string)
            .ok_or_else(|| remote(format!("auth/token: no jwt in {v}")))
    }

    fn credential(&self) -> String {
        match &self.jwt {
            Some(t) => t.lock().unwrap_or_else(PoisonError::into_inner).clone(),
            None => self.api_key.clone(),
        }
    }

    fn build(
        &self,
        route: &str,
        body: &Body,
        headers: &[(&'static str, String)],
        timeout: Duration,
        key: &str,
    ) -> reqwest::RequestBuilder {
        let mut req = self
            .http
            .post(format!("{}/api/v1/{route}", self.base))
            .timeout(timeout);
        if !key.is_empty() {
            req = req.header("X-API-Key", key);
        }
        for (k, v) in headers {
            req = req.header(*k, v);
        }
        match body {
            Body::Json(v) => req.json(v),
            Body::Proto(b) => req
                .header("Content-Type", "application/x-protobuf")
                .body(b.clone()),
        }
    }

    /// One attempt; a rejected JWT is refreshed and the attempt repeated.
    async fn send(
        &self,
        route: &str,
        body: &Body,
        headers: &[(&'static str, String)],
        timeout: Duration,
    ) -> std::result::Result<reqwest::Response, String> {
        let key = self.credential();
        let resp = self
            .build(route, body, headers, timeout, &key)
            .send()
            .await
            .map_err(|e| format!("{route}: {e}"))?;
        let Some(jwt) = &self.jwt else {
            return Ok(resp);
        };
        if resp.status() != reqwest::StatusCode::UNAUTHORIZED {
            return Ok(resp);
        }
        let fresh = self.exchange().await.map_err(|e| e.to_string())?;
        *jwt.lock().unwrap_or_else(PoisonError::into_inner) = fresh.clone();
        self.build(route, body, headers, timeout, &fresh)
            .send()
            .await
            .map_err(|e| format!("{route}: {e}"))
    }

    /// POST, retrying what the SDK's operation layer retries (408, 409,
    /// 429, 5xx, no connection) with backoff for up to 5 minutes, resending
    /// the same body under the same idempotency key.
    pub async fn post(
        &self,
        route: &str,
        body: Body,
        headers: &[(&'static str, String)],
    ) -> Result<reqwest::Response> {
        let mut headers = headers.to_vec();
        headers.push((
            "X-Idempotency-Key",
            format!("temper-{:032x}", rand::rng().random::<u128>()),
        ));
        let start = Instant::now();
        let mut attempt = 0;
        loop {
            let why = match self.send(route, &body, &headers, REQUEST_TIMEOUT).await {
                Ok(r) if r.status().is_success() => return Ok(r),
                Ok(r) if retryable(r.status()) => format!("{route}: {}", r.status()),
                Ok(r) => return Err(status_error(route, r).await),
                Err(e) => e,
            };
            if start.elapsed() >= RETRY_FOR {
                return Err(remote(format!("{why} (retried for {RETRY_FOR:?})")));
            }
            let wait = backoff(attempt);
            tracing::warn!("{why}; retrying in {wait:?}");
            tokio::time::sleep(wait).await;
            attempt += 1;
        }
    }

    /// POST a JSON body, read a JSON answer.
    pub async fn post_json(&self, route: &str, body: Value) -> Result<Value> {
        self.post(route, Body::Json(body), &[])
            .await?
            .json()
            .await
            .map_err(remote)
    }

    /// Submit, returning the request id of the future.
    pub async fn submit(
        &self,
        route: &str,
        body: Body,
        headers: &[(&'static str, String)],
    ) -> Result<String> {
        let v: Value = self
            .post(route, body, headers)
            .await?
            .json()
            .await
            .map_err(remote)?;
        v.get("request_id")
            .and_then(Value::as_str)
            .map(str::to_string)
            .ok_or_else(|| remote(format!("{route}: no request_id in {v}")))
    }

    /// Poll a future until it resolves, as the SDK does: a `try_again`, an
    /// HTTP 408 or a 5xx is polled again at once (the service long-polls), a
    /// 429 or a lost connection after a backoff, a bare 400 up to three
    /// times. `None`: the service expired the request (HTTP 410), which
    /// only a resubmission can recover.
    pub async fn wait(&self, request_id: &str, kind: Kind) -> Result<Option<Reply>> {
        let accept = if kind.proto() {
            "application/x-protobuf"
        } else {
            "application/json"
        };
        let body = Body::Json(json!({"request_id": request_id, "allow_metadata_only": false}));
        let (mut iteration, mut attempt, mut bad) = (0u64, 0u32, 0u32);
        loop {
            let headers = [
                ("Accept", accept.to_string()),
                ("X-Tinker-Request-Type", kind.name().to_string()),
                ("X-Tinker-Request-Iteration", iteration.to_string()),
            ];
            iteration += 1;
            let resp = match self
                .send("retrieve_future", &body, &headers, POLL_TIMEOUT)
                .await
            {
                Ok(r) => r,
                Err(e) => {
                    let wait = backoff(attempt);
                    tracing::warn!("{e}; polling {request_id} again in {wait:?}");
                    tokio::time::sleep(wait).await;
                    attempt += 1;
                    continue;
                }
            };
            let status = resp.status();
            match status.as_u16() {
                200..=299 => {}
                408 | 500..=599 => {
                    attempt = 0;
                    continue;
                }
                429 => {
                    tokio::time::sleep(backoff(attempt)).await;
                    attempt += 1;
                    continue;
                }
                410 => return Ok(None),
                400 if bad < BAD_POLLS => {
                    bad += 1;
                    continue;
                }
                _ => return Err(status_error("retrieve_future", resp).await),
            }
            attempt = 0;
            let is_proto = resp
                .headers()
                .get("content-type")
                .and_then(|v| v.to_str().ok())
                .is_some_and(|c| c.contains("application/x-protobuf"));
            if is_proto {
                return Ok(Some(Reply::Proto(
                    resp.bytes().await.map_err(remote)?.to_vec(),
                )));
            }
            let v: Value = resp.json().await.map_err(remote)?;
            if v.get("type").and_then(Value::as_str) == Some("try_again") {
                if let Some(q) = v.get("queue_state").and_then(Value::as_str) {
                    if q != "active" {
                        tracing::info!("request {request_id} is queued: {q}");
                    }
                }
                continue;
            }
            // Only sent to a poll allowing it, which these never do; the
            // next poll gets the payload.
            if v.get("status").and_then(Value::as_str) == Some("complete_metadata") {
                continue;
            }
            if let Some(err) = v.get("error") {
                let msg = err
                    .as_str()
                    .map(str::to_string)
                    .unwrap_or_else(|| err.to_string());
                return Err(match v.get("category").and_then(Value::as_str) {
                    Some("user") => EngineError::InvalidRequest(msg),
                    _ => remote(msg),
                });
            }
            return Ok(Some(Reply::Json(v)));
        }
    }

    /// [`wait`](Self::wait) for a call that cannot be resubmitted.
    pub async fn resolve(&self, request_id: &str, kind: Kind) -> Result<Reply> {
        self.wait(request_id, kind).await?.ok_or_else(|| {
            remote(format!(
                "the service expired request {request_id} ({}) before it was retrieved (HTTP 410)",
                kind.name()
            ))
        })
    }

    /// Keep `session_id` alive every 10 s until the service says it is
    /// finished (410) or the task is aborted; failures are retried on the
    /// next beat, with a warning after two minutes without one.
    pub fn heartbeat(conn: std::sync::Arc<Self>, session_id: String) -> tokio::task::AbortHandle {
        tokio::spawn(async move {
            let body = Body::Json(json!({"session_id": session_id, "type": "session_heartbeat"}));
            let mut last = Instant::now();
            loop {
                tokio::time::sleep(HEARTBEAT).await;
                match conn.send("session_heartbeat", &body, &[], HEARTBEAT).await {
                    Ok(r) if r.status() == reqwest::StatusCode::GONE => {
                        tracing::info!("session {session_id} finished; heartbeat stops");
                        return;
                    }
                    Ok(r) if r.status().is_success() => last = Instant::now(),
                    Ok(r) => tracing::debug!("session_heartbeat: {}", r.status()),
                    Err(e) => tracing::debug!("{e}"),
                }
                if last.elapsed() > Duration::from_secs(120) {
                    tracing::warn!(
                        "no heartbeat of session {session_id} has reached the service for {:?}",
                        last.elapsed()
                    );
                }
            }
        })
        .abort_handle()
    }
}
