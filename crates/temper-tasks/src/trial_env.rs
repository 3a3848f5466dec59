//! A trial's environment: one temper sandbox session with the task's
//! writable directories, limits and files.
//!
//! The session is the sandbox's ordinary multi-turn session (one warm
//! worker, every command forked from its zygote): its `/work` is the
//! staging area for uploads, and the task's directories (`/app`, `/logs`,
//! `/tests`, `/solution`, ...) are extra tmpfs mounts made writable through
//! [`SandboxConfig::writable_dirs`]. Files survive between commands;
//! processes do not outlive the command that started them. Dropping the
//! environment kills the worker and with it every mount and process.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, PoisonError};
use std::time::Duration;

use base64::Engine;
use temper_sandbox::{
    ExecResult, Limits, Sandbox, SandboxConfig, SandboxError, Session, SessionConfig,
};

use crate::dockerfile::shell_quote;
use crate::{files, TaskError};

/// Where uploads are staged inside the session (under `/work`).
const STAGE: &str = ".temper-stage";

/// How to build a trial's sandbox.
#[derive(Debug, Clone)]
pub struct EnvSpec {
    /// Absolute directories to make writable (tmpfs).
    pub writable: Vec<PathBuf>,
    /// Memory limit in MiB (all the trial's processes together, where
    /// cgroups are available; `RLIMIT_AS` per process otherwise).
    pub memory_mb: u64,
    /// Size cap of each writable directory in MiB.
    pub storage_mb: u64,
    /// CPU seconds per process (`RLIMIT_CPU`).
    pub cpu_seconds: u64,
    /// Environment of every command.
    pub env: BTreeMap<String, String>,
    /// Lifetime of the session.
    pub lifetime: Duration,
    /// Share the host's network (else loopback only).
    pub host_network: bool,
}

/// One trial's live sandbox session.
pub struct TrialEnv {
    session: Session,
    /// The working directory of commands (the Dockerfile's `WORKDIR`).
    pub workdir: String,
    staged: std::sync::atomic::AtomicU64,
}

impl std::fmt::Debug for TrialEnv {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TrialEnv")
            .field("workdir", &self.workdir)
            .finish_non_exhaustive()
    }
}

/// Sandboxes by the settings that shape them: building one looks up the
/// interpreters (a `python3` process) and compiles seccomp, which costs
/// more than the session itself, so trials with equal settings share one.
type SandboxKey = (Vec<PathBuf>, u64, u64, u64, bool);
static SANDBOXES: std::sync::Mutex<Vec<(SandboxKey, Arc<Sandbox>)>> =
    std::sync::Mutex::new(Vec::new());
/// Distinct sandboxes kept (oldest dropped first).
const MAX_CACHED: usize = 32;

fn sandbox_for(spec: &EnvSpec) -> Result<Arc<Sandbox>, TaskError> {
    let key: SandboxKey = (
        spec.writable.clone(),
        spec.memory_mb,
        spec.storage_mb,
        spec.cpu_seconds,
        spec.host_network,
    );
    let mut cache = SANDBOXES.lock().unwrap_or_else(PoisonError::into_inner);
    if let Some((_, s)) = cache.iter().find(|(k, _)| *k == key) {
        return Ok(s.clone());
    }
    let config = SandboxConfig {
        limits: Limits {
            cpu_seconds: spec.cpu_seconds.max(1),
            memory_mb: spec.memory_mb,
            max_processes: 512,
            max_file_size_mb: spec.storage_mb.min(4096),
            max_open_files: 1024,
            tmpfs_mb: spec.storage_mb,
            ..Limits::default()
        },
        writable_dirs: spec.writable.clone(),
        host_network: spec.host_network,
        ..SandboxConfig::default()
    };
    let sandbox = Arc::new(Sandbox::new(config)?);
    if cache.len() >= MAX_CACHED {
        cache.remove(0);
    }
    cache.push((key, sandbox.clone()));
    Ok(sandbox)
}

impl TrialEnv {
    /// Starts the session.
    pub fn start(spec: &EnvSpec, workdir: &str) -> Result<Self, TaskError> {
        let sandbox = sandbox_for(spec)?;
        let session = Session::new(
            sandbox,
            SessionConfig {
                memory_mb: Some(spec.memory_mb),
                env: spec.env.clone(),
                timeout: spec.lifetime,
                idle_timeout: spec.lifetime,
            },
        )?;
        Ok(TrialEnv {
            session,
            workdir: workdir.to_string(),
            staged: Default::default(),
        })
    }

    /// Runs `command` with bash in `cwd` (absolute; the workdir when
    /// `None`) with `env` added, killed after `timeout`.
    pub fn exec(
        &self,
        command: &str,
        cwd: Option<&str>,
        env: &BTreeMap<String, String>,
        timeout: Duration,
    ) -> Result<ExecResult, SandboxError> {
        let cwd = cwd.unwrap_or(&self.workdir);
        let script = format!("cd -- {} || exit 1\n{command}", shell_quote(cwd));
        self.session
            .exec(&script, None, env, timeout.max(Duration::from_millis(1)))
    }

    /// Copies the task file or directory `rel` (relative to `task_dir`) to
    /// `dest` (absolute; a trailing `/` or a directory source means into
    /// `dest`), keeping executable bits. Read through [`files`]: a symlink
    /// or special file anywhere in it or on its path is refused.
    pub fn put(&self, task_dir: &Path, rel: &Path, dest: &str) -> Result<(), TaskError> {
        self.put_after("true", task_dir, rel, dest)
    }

    /// [`TrialEnv::put`] after running `before` (which must succeed), in
    /// one round trip with the sandbox.
    pub fn put_after(
        &self,
        before: &str,
        task_dir: &Path,
        rel: &Path,
        dest: &str,
    ) -> Result<(), TaskError> {
        let n = self
            .staged
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let stage = format!("{STAGE}/{n}");
        let src = files::open(task_dir, rel)?.ok_or_else(|| TaskError::InvalidTask {
            dir: task_dir.to_path_buf(),
            reason: format!("{} is missing", rel.display()),
        })?;
        let mut executable = Vec::new();
        let mut upload = BTreeMap::new();
        let script = if src.kind == files::Kind::Dir {
            src.for_each_file(task_dir, |under, entry| {
                let rel_s = under.to_string_lossy().into_owned();
                if entry.is_executable() {
                    executable.push(format!("{}/{rel_s}", dest.trim_end_matches('/')));
                }
                upload.insert(format!("{stage}/{rel_s}"), entry.read(task_dir)?);
                Ok(())
            })?;
            format!(
                "mkdir -p -- {d} && if [ -d /work/{stage} ]; then cp -R /work/{stage}/. {d}/; fi",
                d = shell_quote(dest)
            )
        } else {
            let name = rel
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default();
            let target = if dest.ends_with('/') {
                format!("{dest}{name}")
            } else {
                dest.to_string()
            };
            if src.is_executable() {
                executable.push(target.clone());
            }
            upload.insert(format!("{stage}/file"), src.read(task_dir)?);
            let parent = Path::new(&target)
                .parent()
                .map(|p| p.to_string_lossy().into_owned())
                .unwrap_or_else(|| "/".into());
            format!(
                "mkdir -p -- {} && cp /work/{stage}/file {}",
                shell_quote(&parent),
                shell_quote(&target)
            )
        };
        let chmod = executable
            .iter()
            .map(|p| format!(" && chmod +x {}", shell_quote(p)))
            .collect::<String>();
        let script =
            format!("( {before} ) && {script}{chmod}; rc=$?; rm -rf /work/{stage}; exit $rc");
        let r = self.session.exec_with_files(
            &format!("cd / || exit 1\n{script}"),
            None,
            &BTreeMap::new(),
            Duration::from_secs(60),
            upload,
        )?;
        if r.return_code != Some(0) {
            return Err(TaskError::Invalid(format!(
                "copy {} to {dest} in the sandbox failed: {}",
                rel.display(),
                r.stderr.trim()
            )));
        }
        Ok(())
    }

    /// Copies the sandbox directory `dir` (absolute) into host `dest`:
    /// regular files and directories only, paths checked to stay inside
    /// `dest`. Missing `dir` copies nothing.
    pub fn fetch_dir(&self, dir: &str, dest: &Path) -> Result<(), TaskError> {
        let script = format!(
            "if [ -d {d} ]; then tar -C {d} -cf - . | base64 -w0; fi",
            d = shell_quote(dir)
        );
        let r = self.exec(
            &script,
            Some("/"),
            &BTreeMap::new(),
            Duration::from_secs(60),
        )?;
        if r.return_code != Some(0) || r.stdout_truncated {
            return Err(TaskError::Invalid(format!(
                "reading {dir} from the sandbox failed (exit {:?}{}): {}",
                r.return_code,
                if r.stdout_truncated {
                    ", too large"
                } else {
                    ""
                },
                r.stderr.trim()
            )));
        }
        if r.stdout.is_empty() {
            return Ok(());
        }
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(r.stdout.trim())
            .map_err(|e| TaskError::Invalid(format!("reading {dir}: bad base64: {e}")))?;
        unpack_safely(&bytes, dest)
    }
}

/// Unpacks a tar of regular files and directories into `dest`; anything
/// else (links, devices) and any path that is absolute or has `..` is
/// skipped, so nothing lands outside `dest`.
fn unpack_safely(bytes: &[u8], dest: &Path) -> Result<(), TaskError> {
    let mut archive = tar::Archive::new(bytes);
    let entries = archive
        .entries()
        .map_err(|e| TaskError::io("read tar", dest.to_path_buf(), e))?;
    for entry in entries {
        let mut entry = entry.map_err(|e| TaskError::io("read tar", dest.to_path_buf(), e))?;
        let kind = entry.header().entry_type();
        let path = match entry.path() {
            Ok(p) => p.into_owned(),
            Err(_) => continue,
        };
        let mut rel = PathBuf::new();
        let mut ok = true;
        for c in path.components() {
            match c {
                std::path::Component::Normal(n) => rel.push(n),
                std::path::Component::CurDir => {}
                _ => ok = false,
            }
        }
        if !ok || rel.as_os_str().is_empty() {
            continue;
        }
        let target = dest.join(&rel);
        if kind.is_dir() {
            std::fs::create_dir_all(&target)
                .map_err(|e| TaskError::io("create", target.clone(), e))?;
        } else if kind.is_file() {
            if let Some(parent) = target.parent() {
                std::fs::create_dir_all(parent)
                    .map_err(|e| TaskError::io("create", parent.to_path_buf(), e))?;
            }
            // A symlink could only exist here if we had written one: we
            // never do, so the parent chain is plain directories.
            let mut f = std::fs::File::create(&target)
                .map_err(|e| TaskError::io("create", target.clone(), e))?;
            std::io::copy(&mut entry, &mut f)
                .map_err(|e| TaskError::io("write", target.clone(), e))?;
        }
    }
    Ok(())
}
