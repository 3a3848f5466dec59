//! Promoted policy versions of a learning server (`temper serve --learn`):
//! every version its learner promoted is kept on disk, one names the live
//! one, and `POST /v1/adapters/rollback` returns to any earlier one.
//!
//! Layout under the learning state directory:
//! `versions/vNNNNNN/adapter/` (the PEFT adapter served), `meta.json` and
//! whatever else the learner keeps beside it (its trainer state), and
//! `live.json` (`{"version": N}`). A version directory is renamed into
//! place whole, and `live.json` is replaced by an atomic rename, so a kill
//! at any point leaves every promoted version intact and `live.json`
//! naming one of them: the restarted server serves it.
//!
//! The live version is served under one adapter name (the learner's
//! `adapter_name`); a response's `"version"` is the promoted version that
//! answered (after a rollback to 2, responses say 2 again: same weights).

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use axum::body::Bytes;
use axum::extract::State;
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Value};
use tokio::sync::watch;

use super::error::OpenAiError;
use super::state::OpenAiState;

/// Writes `bytes` to `path` atomically: a synced temporary sibling renamed
/// over it, then the directory synced (the rename itself is durable).
pub fn write_atomic(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    use std::io::Write;
    let parent = path
        .parent()
        .ok_or_else(|| std::io::Error::other("a path without a parent"))?;
    let name = path
        .file_name()
        .and_then(|n| n.to_str())
        .ok_or_else(|| std::io::Error::other("a path without a file name"))?;
    let tmp = parent.join(format!(".{name}.tmp"));
    {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
    }
    std::fs::rename(&tmp, path)?;
    sync_dir(parent)
}

/// Syncs a directory, so the names created or renamed in it are durable.
pub fn sync_dir(dir: &Path) -> std::io::Result<()> {
    std::fs::File::open(dir)?.sync_all()
}

/// The promoted versions on disk and which one is live.
pub struct PolicyVersions {
    root: PathBuf,
    name: String,
    /// Held while the live version changes (promotion, rollback).
    live: Mutex<Option<u64>>,
    announce: watch::Sender<Option<u64>>,
}

impl PolicyVersions {
    /// The versions under `root` (created if missing), served as adapter
    /// `name`.
    pub fn open(root: &Path, name: &str) -> std::io::Result<Self> {
        std::fs::create_dir_all(root.join("versions"))?;
        let live_path = root.join("live.json");
        let live = if live_path.exists() {
            let v: Value = serde_json::from_slice(&std::fs::read(&live_path)?)
                .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))?;
            let n = v["version"].as_u64().ok_or_else(|| {
                std::io::Error::new(
                    std::io::ErrorKind::InvalidData,
                    format!("{}: no version", live_path.display()),
                )
            })?;
            Some(n)
        } else {
            None
        };
        Ok(Self {
            root: root.to_path_buf(),
            name: name.to_string(),
            live: Mutex::new(live),
            announce: watch::channel(live).0,
        })
    }

    /// The adapter name the live version is served under.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The live version (`None` before the first promotion).
    pub fn live(&self) -> Option<u64> {
        *self.announce.borrow()
    }

    /// Follows the live version.
    pub fn subscribe(&self) -> watch::Receiver<Option<u64>> {
        self.announce.subscribe()
    }

    /// Version `v`'s directory.
    pub fn dir_of(&self, v: u64) -> PathBuf {
        self.root.join("versions").join(format!("v{v:06}"))
    }

    /// The promoted versions, oldest first.
    pub fn list(&self) -> std::io::Result<Vec<u64>> {
        let mut out: Vec<u64> = std::fs::read_dir(self.root.join("versions"))?
            .filter_map(|e| e.ok())
            .filter_map(|e| {
                e.file_name()
                    .to_str()
                    .and_then(|n| n.strip_prefix('v'))
                    .and_then(|n| n.parse().ok())
            })
            .collect();
        out.sort_unstable();
        Ok(out)
    }

    /// The workspace's poisoning policy (docs/ARCHITECTURE.md): recover;
    /// every critical section leaves whole values behind.
    fn lock(&self) -> std::sync::MutexGuard<'_, Option<u64>> {
        self.live
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn set_live(&self, held: &mut Option<u64>, v: u64) -> Result<(), OpenAiError> {
        let text = json!({"version": v}).to_string();
        write_atomic(&self.root.join("live.json"), text.as_bytes())
            .map_err(|e| OpenAiError::Internal(format!("writing live.json: {e}")))?;
        *held = Some(v);
        self.announce.send_replace(Some(v));
        Ok(())
    }
}

fn versions(s: &OpenAiState) -> Result<&Arc<PolicyVersions>, OpenAiError> {
    s.inner
        .learning
        .as_ref()
        .map(|l| &l.versions)
        .ok_or_else(|| {
            OpenAiError::NotFound(
                "this server does not learn from use (start temper serve with --learn CONFIG)"
                    .into(),
            )
        })
}

impl OpenAiState {
    /// Serves the live version (at start-up); which one, if any.
    pub fn serve_live(&self) -> Result<Option<u64>, OpenAiError> {
        let vs = versions(self)?;
        let live = *vs.lock();
        if let Some(v) = live {
            self.load_adapter_as(vs.name(), &vs.dir_of(v).join("adapter"), Some(v))?;
        }
        Ok(live)
    }

    /// Promotes the candidate staged in `staged` (its `adapter/` inside) to
    /// version `v` and serves it — only if the live version is still
    /// `parent` (a rollback meanwhile makes the candidate stale: 409).
    /// Blocking (renames, reads the adapter).
    pub fn promote(&self, staged: &Path, v: u64, parent: Option<u64>) -> Result<(), OpenAiError> {
        let vs = versions(self)?;
        let mut live = vs.lock();
        if *live != parent {
            return Err(OpenAiError::Conflict(format!(
                "the live version is {live:?}, not the candidate's parent {parent:?}"
            )));
        }
        let dest = vs.dir_of(v);
        if dest.exists() {
            return Err(OpenAiError::Conflict(format!("version {v} already exists")));
        }
        let io = |e: std::io::Error| OpenAiError::Internal(format!("promoting version {v}: {e}"));
        std::fs::rename(staged, &dest).map_err(io)?;
        sync_dir(&vs.root.join("versions")).map_err(io)?;
        self.load_adapter_as(vs.name(), &dest.join("adapter"), Some(v))?;
        vs.set_live(&mut live, v)?;
        tracing::info!(version = v, "promoted");
        Ok(())
    }

    /// Serves promoted version `v` again; the version it replaced.
    /// Blocking.
    pub fn rollback(&self, v: u64) -> Result<Option<u64>, OpenAiError> {
        let vs = versions(self)?;
        let mut live = vs.lock();
        let dir = vs.dir_of(v);
        if !dir.join("adapter").is_dir() {
            return Err(OpenAiError::NotFound(format!(
                "no promoted version {v} (see GET /v1/adapters/versions)"
            )));
        }
        let before = *live;
        self.load_adapter_as(vs.name(), &dir.join("adapter"), Some(v))?;
        vs.set_live(&mut live, v)?;
        tracing::info!(version = v, from = ?before, "rolled back");
        Ok(before)
    }
}

/// The body of `POST /v1/adapters/rollback`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RollbackBody {
    version: u64,
}

/// `POST /v1/adapters/rollback`: `{"version": N}` serves promoted version
/// N again.
pub(super) async fn rollback(
    State(s): State<OpenAiState>,
    body: Bytes,
) -> Result<Json<Value>, OpenAiError> {
    let req: RollbackBody = serde_json::from_slice(&body).map_err(|e| {
        OpenAiError::invalid(
            "version",
            format!("invalid request body: {e} (send {{\"version\": N}})"),
        )
    })?;
    let name = versions(&s)?.name().to_string();
    let st = s.clone();
    let before = tokio::task::spawn_blocking(move || st.rollback(req.version))
        .await
        .map_err(|e| OpenAiError::Internal(format!("rollback task: {e}")))??;
    Ok(Json(json!({
        "object": "adapter.rollback", "model": name, "version": req.version, "previous": before,
    })))
}

/// `GET /v1/adapters/versions`: the promoted versions (each with the
/// `meta.json` its learner wrote) and the live one.
pub(super) async fn list_versions(
    State(s): State<OpenAiState>,
) -> Result<Json<Value>, OpenAiError> {
    let vs = versions(&s)?.clone();
    let data = tokio::task::spawn_blocking(move || -> Result<Value, OpenAiError> {
        let list = vs
            .list()
            .map_err(|e| OpenAiError::Internal(format!("listing versions: {e}")))?;
        let data: Vec<Value> = list
            .into_iter()
            .map(|v| {
                let meta = std::fs::read(vs.dir_of(v).join("meta.json"))
                    .ok()
                    .and_then(|b| serde_json::from_slice::<Value>(&b).ok())
                    .unwrap_or(Value::Null);
                json!({"version": v, "meta": meta})
            })
            .collect();
        Ok(json!({"object": "list", "model": vs.name(), "live": vs.live(), "data": data}))
    })
    .await
    .map_err(|e| OpenAiError::Internal(format!("versions task: {e}")))??;
    Ok(Json(data))
}
