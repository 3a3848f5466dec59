//! Token capture from the task runner's side: a fresh episode per trial on a
//! `temper serve` endpoint (`POST /v1/episodes`: its id and token), the
//! agent pointed at the episode's base URL with the episode's token as its
//! API key, and the episode's records fetched into the trial's
//! `agent/tokens.jsonl` afterwards.
//!
//! `temper serve` records every call made under `<root>/episodes/<id>/v1`
//! (prompt and completion token ids, logprobs, policy version; see
//! `temper_server::openai::capture`), so the agent program needs no change:
//! it only sees a different `OPENAI_BASE_URL` and `OPENAI_API_KEY`. The
//! token opens that one episode only, so an agent can neither read nor
//! write another trial's records, and never holds the server's key.

use std::io::Write;
use std::path::Path;

use serde_json::{json, Map, Value};

use crate::atif::{Metrics, Trajectory};
use crate::error::TaskError;

/// The file a captured trial's records go to, under `agent/`.
pub const TOKENS_FILE: &str = "tokens.jsonl";

/// One trial's episode on a temper endpoint.
#[derive(Clone)]
pub struct Episode {
    /// The server's root (`http://host:port`).
    root: String,
    /// The episode id, chosen by the server.
    pub id: String,
    /// The episode's secret (see [`Episode::token`]).
    token: String,
}

impl std::fmt::Debug for Episode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Episode")
            .field("root", &self.root)
            .field("id", &self.id)
            .finish_non_exhaustive()
    }
}

/// `http://host:port` of a `temper serve` base URL ending in `/v1`.
fn root_of(base_url: &str) -> Result<&str, TaskError> {
    base_url
        .trim_end_matches('/')
        .strip_suffix("/v1")
        .ok_or_else(|| {
            TaskError::Invalid(format!(
                "token capture needs a temper serve base URL ending in /v1, got {base_url:?}"
            ))
        })
}

fn client() -> reqwest::Result<reqwest::Client> {
    reqwest::Client::builder()
        .timeout(std::time::Duration::from_secs(60))
        .build()
}

impl Episode {
    /// A fresh episode on the server whose OpenAI base URL is `base_url`
    /// (`http://host:port/v1`, as given to `--base-url`), created with the
    /// server's `api_key`. Blocking: call it off the runtime's threads.
    pub fn create(
        base_url: &str,
        api_key: Option<&str>,
        runtime: &tokio::runtime::Handle,
    ) -> Result<Self, TaskError> {
        let root = root_of(base_url)?;
        let err = |e: String| TaskError::Invalid(format!("creating a capture episode: {e}"));
        runtime.block_on(async {
            let c = client().map_err(|e| err(e.to_string()))?;
            let mut req = c.post(format!("{root}/v1/episodes"));
            if let Some(k) = api_key {
                req = req.bearer_auth(k);
            }
            let resp = req.send().await.map_err(|e| err(e.to_string()))?;
            if !resp.status().is_success() {
                let status = resp.status();
                let body = resp.text().await.unwrap_or_default();
                return Err(err(format!("POST /v1/episodes: {status}: {body}")));
            }
            let v: Value = resp.json().await.map_err(|e| err(e.to_string()))?;
            let field = |k: &str| {
                v.get(k)
                    .and_then(Value::as_str)
                    .map(str::to_string)
                    .ok_or_else(|| err(format!("the answer has no `{k}`: {v}")))
            };
            Ok(Self {
                root: root.to_string(),
                id: field("id")?,
                token: field("token")?,
            })
        })
    }

    /// The base URL the agent gets: every call made under it is recorded.
    pub fn base_url(&self) -> String {
        format!("{}/episodes/{}/v1", self.root, self.id)
    }

    /// The key the agent gets: the episode's token, which opens this
    /// episode's routes only.
    pub fn token(&self) -> &str {
        &self.token
    }

    fn records_url(&self) -> String {
        format!("{}/v1/episodes/{}", self.root, self.id)
    }

    fn request(&self, c: &reqwest::Client, method: reqwest::Method) -> reqwest::RequestBuilder {
        c.request(method, self.records_url())
            .bearer_auth(&self.token)
    }

    /// The episode's records in call order (none when the agent made no
    /// call), then dropped from the server. Blocking: call it off the
    /// runtime's threads.
    pub fn collect(&self, runtime: &tokio::runtime::Handle) -> Result<Vec<Value>, TaskError> {
        let err = |e: String| TaskError::Invalid(format!("episode {}: {e}", self.id));
        runtime.block_on(async {
            let c = client().map_err(|e| err(e.to_string()))?;
            let resp = self
                .request(&c, reqwest::Method::GET)
                .send()
                .await
                .map_err(|e| err(e.to_string()))?;
            if resp.status() == reqwest::StatusCode::NOT_FOUND {
                return Ok(Vec::new());
            }
            if !resp.status().is_success() {
                let status = resp.status();
                let body = resp.text().await.unwrap_or_default();
                return Err(err(format!("GET records: {status}: {body}")));
            }
            let v: Value = resp.json().await.map_err(|e| err(e.to_string()))?;
            if v.get("dropped_records").and_then(Value::as_u64).unwrap_or(0) > 0 {
                tracing::warn!(episode = %self.id, "the server's capture store dropped records of this episode");
            }
            let records = match v.get("records") {
                Some(Value::Array(r)) => r.clone(),
                _ => return Err(err("the answer has no `records` list".into())),
            };
            // Dropping is housekeeping: the records are already here.
            if let Err(e) = self.request(&c, reqwest::Method::DELETE).send().await {
                tracing::warn!(episode = %self.id, "DELETE: {e}");
            }
            Ok(records)
        })
    }
}

/// Writes `records` as JSON lines to `agent_dir/tokens.jsonl`.
pub fn write_records(agent_dir: &Path, records: &[Value]) -> Result<(), TaskError> {
    let path = agent_dir.join(TOKENS_FILE);
    let io = |e: std::io::Error| TaskError::Io {
        what: "write",
        path: path.clone(),
        source: e,
    };
    let mut f = std::io::BufWriter::new(std::fs::File::create(&path).map_err(io)?);
    for r in records {
        writeln!(f, "{r}").map_err(io)?;
    }
    f.flush().map_err(io)
}

/// Reads a trial's `agent/tokens.jsonl` (empty when absent).
pub fn read_records(agent_dir: &Path) -> Result<Vec<Value>, TaskError> {
    let path = agent_dir.join(TOKENS_FILE);
    let text = match std::fs::read_to_string(&path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => {
            return Err(TaskError::Io {
                what: "read",
                path,
                source: e,
            })
        }
    };
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| {
            serde_json::from_str(l).map_err(|e| TaskError::Json {
                path: path.clone(),
                source: e,
            })
        })
        .collect()
}

/// After the agent ran: the episode's records into `agent/tokens.jsonl`,
/// the trajectory's model-call steps' token slots filled where the calls
/// correspond ([`fill_steps`]), and `episode`, `captured_calls` (or
/// `capture_error`) in the agent's metadata. A failure to collect is
/// recorded, not fatal: the trial itself happened.
pub fn finish(
    episode: &Episode,
    runtime: &tokio::runtime::Handle,
    agent_dir: &Path,
    traj: &mut Trajectory,
    metadata: &mut Map<String, Value>,
) {
    metadata.insert("episode".into(), json!(episode.id));
    let records = episode
        .collect(runtime)
        .and_then(|r| write_records(agent_dir, &r).map(|()| r));
    match records {
        Ok(r) => {
            metadata.insert("captured_calls".into(), json!(r.len()));
            fill_steps(traj, &r);
        }
        Err(e) => {
            tracing::warn!("token capture: {e}");
            metadata.insert("capture_error".into(), json!(e.to_string()));
        }
    }
}

/// Fills the token slots (`prompt_token_ids`, `completion_token_ids`,
/// `logprobs`, `extra.policy_version`) of the trajectory's model-call steps
/// (source `agent` with a `model_name`) from `records`, in order, when there
/// are exactly as many such steps as records: only then do they
/// correspond one to one. Slots already filled are kept. Returns whether it
/// filled.
pub fn fill_steps(traj: &mut Trajectory, records: &[Value]) -> bool {
    let mut steps: Vec<_> = traj
        .steps
        .iter_mut()
        .filter(|s| s.source == "agent" && s.model_name.is_some())
        .collect();
    if steps.is_empty() || steps.len() != records.len() {
        return false;
    }
    let ids = |v: &Value| -> Option<Vec<u32>> {
        v.as_array()?
            .iter()
            .map(|x| x.as_u64().and_then(|x| u32::try_from(x).ok()))
            .collect()
    };
    for (step, r) in steps.iter_mut().zip(records) {
        let m = step.metrics.get_or_insert_with(Metrics::default);
        if m.prompt_token_ids.is_none() {
            m.prompt_token_ids = ids(&r["prompt_token_ids"]);
        }
        if m.completion_token_ids.is_none() {
            m.completion_token_ids = ids(&r["completion_token_ids"]);
        }
        if m.logprobs.is_none() {
            m.logprobs = r["logprobs"]
                .as_array()
                .and_then(|a| a.iter().map(|x| x.as_f64().map(|x| x as f32)).collect());
        }
        let extra = m.extra.get_or_insert_with(Map::new);
        for (k, v) in [
            ("policy_version", &r["version"]),
            ("episode_seq", &r["seq"]),
            ("temperature", &r["sampling"]["temperature"]),
        ] {
            if !v.is_null() {
                extra.entry(k).or_insert_with(|| v.clone());
            }
        }
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn episode_urls_hang_off_the_server_root() {
        let root = root_of("http://127.0.0.1:8000/v1/").expect("root");
        assert_eq!(root, "http://127.0.0.1:8000");
        let e = Episode {
            root: root.into(),
            id: "ep-x".into(),
            token: "secret".into(),
        };
        assert_eq!(e.base_url(), "http://127.0.0.1:8000/episodes/ep-x/v1");
        assert_eq!(e.records_url(), "http://127.0.0.1:8000/v1/episodes/ep-x");
        assert!(!format!("{e:?}").contains("secret"));
        assert!(root_of("https://api.example.com/openai").is_err());
    }

    #[test]
    fn steps_are_filled_only_when_calls_and_model_steps_correspond() {
        use crate::atif::{Agent, Step};
        let agent = Agent {
            name: "x".into(),
            version: "1".into(),
            model_name: None,
            tool_definitions: None,
            extra: None,
        };
        let rec = |seq: u64| {
            json!({"seq": seq, "version": 3, "prompt_token_ids": [1, 2], "completion_token_ids": [7],
                   "logprobs": [-0.25], "sampling": {"temperature": 0.5}})
        };
        let mut t = Trajectory::new("s", agent, "task");
        for _ in 0..2 {
            let mut s = Step::new("agent", "answer");
            s.model_name = Some("m".into());
            t.push(s);
        }
        // An exec step without a model call is not a model-call step.
        t.push(Step::new("agent", ""));
        assert!(!fill_steps(&mut t, &[rec(0)]), "2 model steps, 1 call");
        assert!(t.steps.iter().all(|s| s.metrics.is_none()));
        assert!(fill_steps(&mut t, &[rec(0), rec(1)]));
        let m = t.steps[2].metrics.as_ref().expect("filled");
        assert_eq!(m.prompt_token_ids, Some(vec![1, 2]));
        assert_eq!(m.completion_token_ids, Some(vec![7]));
        assert_eq!(m.logprobs, Some(vec![-0.25]));
        let extra = m.extra.as_ref().expect("extra");
        assert_eq!(extra["policy_version"], 3);
        assert_eq!(extra["episode_seq"], 1);
        assert!(t.steps[3].metrics.is_none());
    }
}
