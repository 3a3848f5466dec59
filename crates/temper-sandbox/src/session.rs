//! Persistent sessions for multi-turn agents: one warm worker kept for one
//! client, whose `/work` survives between commands.
//!
//! A session is a pool worker that is never cleaned between requests: each
//! `exec` is a bash command forked by the session's zygote (cwd and env
//! applied first), `upload` writes files through the same channel, and
//! `download` reads beneath the worker's `/work` handle. A command that
//! times out is killed by the zygote and the session lives on; a session
//! past its lifetime or idle timeout is reclaimed by [`Sessions::reap`].
//! Processes do not outlive the command that started them (the zygote kills
//! them before answering), so a session keeps files, not servers. These
//! calls block (they wait for the sandbox): use `spawn_blocking` in async
//! code.

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use crate::pool::{encode, exec, start_worker, Worker};
use crate::sandbox::{fetch_from_dir, relative_path};
use crate::{ExecRequest, ExecResult, Language, Sandbox, SandboxError};

/// How a session is created.
#[derive(Debug, Clone)]
pub struct SessionConfig {
    /// Address-space limit per command in MiB (capped at the sandbox's).
    pub memory_mb: Option<u64>,
    /// Environment variables set for every command.
    pub env: BTreeMap<String, String>,
    /// Lifetime from creation.
    pub timeout: Duration,
    /// Reclaimed after this long without a call.
    pub idle_timeout: Duration,
}

impl Default for SessionConfig {
    fn default() -> Self {
        SessionConfig {
            memory_mb: None,
            env: BTreeMap::new(),
            timeout: Duration::from_secs(3600),
            idle_timeout: Duration::from_secs(600),
        }
    }
}

/// One session (see the module docs).
pub struct Session {
    sandbox: Arc<Sandbox>,
    config: SessionConfig,
    worker: Mutex<Option<Worker>>,
    created: Instant,
    last_used: Mutex<Instant>,
}

impl std::fmt::Debug for Session {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Session")
            .field("config", &self.config)
            .field("created", &self.created)
            .finish_non_exhaustive()
    }
}

/// `'...'` with embedded quotes escaped, for bash.
fn quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}

fn valid_env_name(name: &str) -> bool {
    let mut chars = name.chars();
    chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

impl Session {
    /// Starts the session's worker.
    pub fn new(sandbox: Arc<Sandbox>, config: SessionConfig) -> Result<Self, SandboxError> {
        if let Some(bad) = config.env.keys().find(|k| !valid_env_name(k)) {
            return Err(SandboxError::InvalidRequest(format!(
                "invalid environment variable name {bad:?}"
            )));
        }
        let worker = start_worker(&sandbox)?;
        Ok(Session {
            sandbox,
            config,
            worker: Mutex::new(Some(worker)),
            created: Instant::now(),
            last_used: Mutex::new(Instant::now()),
        })
    }

    /// True once past the lifetime or the idle timeout.
    pub fn expired(&self, now: Instant) -> bool {
        let idle = *self
            .last_used
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        now.duration_since(self.created) > self.config.timeout
            || now.duration_since(idle) > self.config.idle_timeout
    }

    fn call(&self, req: &ExecRequest) -> Result<ExecResult, SandboxError> {
        *self
            .last_used
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = Instant::now();
        let (frame, fetch) = encode(self.sandbox.config(), req, false)?;
        let mut slot = self.worker.lock().unwrap_or_else(PoisonError::into_inner);
        let worker = slot.as_mut().ok_or_else(|| {
            SandboxError::InvalidRequest("the session's sandbox has died; create a new one".into())
        })?;
        match exec(&self.sandbox, worker, req, &frame, &fetch) {
            Ok((result, true)) => result,
            Ok((result, false)) => {
                // The worker is gone (killed from inside, or stuck): so is
                // the session's state.
                *slot = None;
                result
            }
            Err(e) => {
                *slot = None;
                Err(e)
            }
        }
    }

    /// Runs `command` with bash in `cwd` (relative to `/work`) with the
    /// session's env plus `env`.
    pub fn exec(
        &self,
        command: &str,
        cwd: Option<&str>,
        env: &BTreeMap<String, String>,
        timeout: Duration,
    ) -> Result<ExecResult, SandboxError> {
        self.exec_with_files(command, cwd, env, timeout, BTreeMap::new())
    }

    /// [`Session::exec`] after writing `files` (paths relative to `/work`)
    /// in the same round trip: an upload and the command that uses it cost
    /// one call.
    pub fn exec_with_files(
        &self,
        command: &str,
        cwd: Option<&str>,
        env: &BTreeMap<String, String>,
        timeout: Duration,
        files: BTreeMap<String, Vec<u8>>,
    ) -> Result<ExecResult, SandboxError> {
        let mut script = String::new();
        for (k, v) in self.config.env.iter().chain(env) {
            if !valid_env_name(k) {
                return Err(SandboxError::InvalidRequest(format!(
                    "invalid environment variable name {k:?}"
                )));
            }
            script += &format!("export {k}={}\n", quote(v));
        }
        // `""`, `"."` and `"./"` name /work itself.
        let names_work = |c: &str| c.split('/').all(|part| part.is_empty() || part == ".");
        if let Some(cwd) = cwd.filter(|c| !names_work(c)) {
            let rel = relative_path(cwd)?;
            script += &format!(
                "cd -- {} || exit 1\n",
                quote(&format!("/work/{}", rel.display()))
            );
        }
        script += command;
        script.push('\n');
        let mut req = ExecRequest::new(Language::Bash, script);
        req.timeout = timeout;
        req.memory_limit_mb = self.config.memory_mb;
        req.files = files;
        self.call(&req)
    }

    /// Writes `data` to `path` (relative to `/work`).
    pub fn upload(&self, path: &str, data: Vec<u8>) -> Result<(), SandboxError> {
        let mut req = ExecRequest::new(Language::Bash, "true");
        req.files.insert(path.to_string(), data);
        req.timeout = Duration::from_secs(10);
        let r = self.call(&req)?;
        if r.return_code != Some(0) {
            return Err(SandboxError::InvalidRequest(format!(
                "upload of {path:?} failed: {}",
                r.stderr.trim()
            )));
        }
        Ok(())
    }

    /// Reads `path` (relative to `/work`); `None` when it is missing, not a
    /// regular file, or a symlink.
    pub fn download(&self, path: &str) -> Result<Option<Vec<u8>>, SandboxError> {
        *self
            .last_used
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = Instant::now();
        let rel: PathBuf = relative_path(path)?;
        let slot = self.worker.lock().unwrap_or_else(PoisonError::into_inner);
        let worker = slot.as_ref().ok_or_else(|| {
            SandboxError::InvalidRequest("the session's sandbox has died; create a new one".into())
        })?;
        let cap = self.sandbox.config().limits.fetch_file_limit_bytes;
        let mut files = fetch_from_dir(worker.work_dir(), &[(path.to_string(), rel)], cap);
        Ok(files.remove(path))
    }
}

/// Live sessions by id, with expiry, an owner each and a cap on how many.
///
/// Ids are 128-bit random capabilities. A session created with an owner
/// token is reachable only with that token ([`Sessions::get_owned`]); the
/// listing shows a caller only the sessions of its own token.
#[derive(Debug)]
pub struct Sessions {
    by_id: Mutex<HashMap<String, Entry>>,
    max: usize,
}

#[derive(Debug)]
struct Entry {
    session: Arc<Session>,
    owner: Option<String>,
}

/// Default for [`Sessions::with_limit`] (`temper sandbox serve --max-sessions`).
pub const DEFAULT_MAX_SESSIONS: usize = 16;

impl Default for Sessions {
    fn default() -> Self {
        Sessions::with_limit(DEFAULT_MAX_SESSIONS)
    }
}

/// A 128-bit random id, hex.
fn new_id() -> Result<String, SandboxError> {
    use std::io::Read;
    let mut bytes = [0u8; 16];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut bytes))
        .map_err(|e| SandboxError::host("read /dev/urandom for a session id", e))?;
    Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
}

/// Constant-time comparison of owner tokens.
fn same_owner(a: Option<&str>, b: Option<&str>) -> bool {
    match (a, b) {
        (None, None) => true,
        (Some(a), Some(b)) => crate::secret::constant_time_eq(a.as_bytes(), b.as_bytes()),
        _ => false,
    }
}

impl Sessions {
    /// At most `max` live sessions (at least one).
    pub fn with_limit(max: usize) -> Self {
        Sessions {
            by_id: Mutex::new(HashMap::new()),
            max: max.max(1),
        }
    }

    /// The cap on live sessions.
    pub fn limit(&self) -> usize {
        self.max
    }

    /// Creates a session with no owner token and returns its id.
    pub fn create(
        &self,
        sandbox: Arc<Sandbox>,
        config: SessionConfig,
    ) -> Result<String, SandboxError> {
        self.create_owned(sandbox, config, None)
    }

    /// Creates a session owned by `owner` and returns its id;
    /// [`SandboxError::SessionLimit`] when `limit()` are live.
    pub fn create_owned(
        &self,
        sandbox: Arc<Sandbox>,
        config: SessionConfig,
        owner: Option<&str>,
    ) -> Result<String, SandboxError> {
        self.reap();
        let id = new_id()?;
        // Reserve the slot first so concurrent creates cannot overshoot.
        {
            let map = self.lock();
            if map.len() >= self.max {
                return Err(SandboxError::SessionLimit { max: self.max });
            }
        }
        let session = Arc::new(Session::new(sandbox, config)?);
        let mut map = self.lock();
        if map.len() >= self.max {
            drop(map);
            return Err(SandboxError::SessionLimit { max: self.max });
        }
        map.insert(
            id.clone(),
            Entry {
                session,
                owner: owner.map(str::to_string),
            },
        );
        Ok(id)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Entry>> {
        self.by_id.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The live session `id`, whoever owns it (library use).
    pub fn get(&self, id: &str) -> Option<Arc<Session>> {
        self.reap();
        self.lock().get(id).map(|e| e.session.clone())
    }

    /// The live session `id` when it belongs to `owner`.
    pub fn get_owned(&self, id: &str, owner: Option<&str>) -> Option<Arc<Session>> {
        self.reap();
        self.lock()
            .get(id)
            .filter(|e| same_owner(e.owner.as_deref(), owner))
            .map(|e| e.session.clone())
    }

    /// Ids of all live sessions (library use).
    pub fn list(&self) -> Vec<String> {
        self.reap();
        let mut ids: Vec<String> = self.lock().keys().cloned().collect();
        ids.sort();
        ids
    }

    /// Ids of the live sessions owned by `owner`.
    pub fn list_owned(&self, owner: &str) -> Vec<String> {
        self.reap();
        let mut ids: Vec<String> = self
            .lock()
            .iter()
            .filter(|(_, e)| same_owner(e.owner.as_deref(), Some(owner)))
            .map(|(id, _)| id.clone())
            .collect();
        ids.sort();
        ids
    }

    /// Number of live sessions.
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    /// True when no session is live.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Deletes `id` (its sandbox is killed); false when there was none.
    pub fn delete(&self, id: &str) -> bool {
        let removed = self.lock().remove(id);
        removed.is_some()
    }

    /// Deletes `id` when it belongs to `owner`; false otherwise.
    pub fn delete_owned(&self, id: &str, owner: Option<&str>) -> bool {
        let mut map = self.lock();
        if !map
            .get(id)
            .is_some_and(|e| same_owner(e.owner.as_deref(), owner))
        {
            return false;
        }
        let removed = map.remove(id);
        drop(map);
        removed.is_some()
    }

    /// Drops every expired session; returns how many.
    pub fn reap(&self) -> usize {
        let now = Instant::now();
        let mut map = self.lock();
        let expired: Vec<String> = map
            .iter()
            .filter(|(_, e)| e.session.expired(now))
            .map(|(id, _)| id.clone())
            .collect();
        let dropped: Vec<Entry> = expired.iter().filter_map(|id| map.remove(id)).collect();
        drop(map);
        // Killing the sandboxes happens here, outside the lock.
        dropped.len()
    }
}
