//! Python packages for runs that declare them: one virtualenv per distinct
//! requirement list, built once with pip, cached on disk, and bound
//! read-only into that list's own [`Sandbox`].
//!
//! The sandbox sees the host's read-only `/usr`, so `import pytest` fails
//! there unless the host happens to have it. A request's `requirements`
//! name what it needs instead; the service builds `ROOT/KEY` (KEY: a hash of
//! the interpreter and the sorted list) with `python3 -m venv` and
//! `pip install --only-binary=:all:`, wheels only, so installing runs no
//! package code on the host; package code runs only inside sandboxes.
//! Requirements are names with version specifiers and markers: no paths,
//! URLs or pip options (the operator adds those with `pip_args`, e.g. an
//! offline wheel directory).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use sha2::{Digest, Sha256};

use crate::{Language, Sandbox, SandboxConfig, SandboxError};

/// Most requirements in one list.
pub const MAX_REQUIREMENTS: usize = 32;
/// Longest requirement string.
pub const MAX_REQUIREMENT_LEN: usize = 100;
/// Marks a finished build (a directory without it is rebuilt).
const COMPLETE: &str = ".temper-complete";

/// Where and how virtualenvs are built.
#[derive(Debug, Clone)]
pub struct VenvConfig {
    /// Cache directory: one subdirectory per requirement list.
    pub root: PathBuf,
    /// Extra `pip install` arguments from the operator (an index, a
    /// `--find-links` wheel directory, `--no-index`).
    pub pip_args: Vec<String>,
    /// Longest a build may take before it is killed and fails.
    pub build_timeout: Duration,
}

type Entry = Arc<Mutex<Option<Result<Arc<Sandbox>, String>>>>;

/// The cached virtualenvs and their sandboxes.
pub struct Venvs {
    config: VenvConfig,
    base: SandboxConfig,
    python: PathBuf,
    entries: Mutex<HashMap<String, Entry>>,
}

impl std::fmt::Debug for Venvs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Venvs")
            .field("config", &self.config)
            .field("python", &self.python)
            .finish_non_exhaustive()
    }
}

/// Checks each requirement (a package name with optional extras, version
/// specifiers and markers: no path, URL or option) and returns the list
/// trimmed, sorted and without duplicates.
pub fn check_requirements(requirements: &[String]) -> Result<Vec<String>, SandboxError> {
    if requirements.len() > MAX_REQUIREMENTS {
        return Err(SandboxError::InvalidRequest(format!(
            "at most {MAX_REQUIREMENTS} requirements"
        )));
    }
    let mut out = Vec::new();
    for r in requirements {
        let r = r.trim();
        let allowed = |c: char| c.is_ascii_alphanumeric() || " -_.[],<>=!~;*'\"()".contains(c);
        if r.is_empty()
            || r.len() > MAX_REQUIREMENT_LEN
            || !r.starts_with(|c: char| c.is_ascii_alphanumeric())
            || !r.chars().all(allowed)
        {
            let shown: String = r.chars().take(40).collect();
            return Err(SandboxError::InvalidRequest(format!(
                "requirement {shown:?}: give a package name with optional extras, version \
                 specifiers and markers (at most {MAX_REQUIREMENT_LEN} characters; no paths, \
                 URLs or pip options)"
            )));
        }
        out.push(r.to_string());
    }
    out.sort();
    out.dedup();
    Ok(out)
}

impl Venvs {
    /// Virtualenvs made from the interpreter of sandboxes built from
    /// `base`; each is served by a sandbox with `base`'s limits. The cache
    /// directory is created; it may not lie under a directory the sandbox
    /// mounts its own file system on (`/tmp`, `/work`, ...), where the
    /// bound virtualenv would be hidden.
    pub fn new(mut config: VenvConfig, base: SandboxConfig) -> Result<Self, SandboxError> {
        std::fs::create_dir_all(&config.root)
            .and_then(|()| std::fs::canonicalize(&config.root))
            .map(|root| config.root = root)
            .map_err(|e| SandboxError::host("creating the virtualenv cache directory", e))?;
        if let Some(r) = crate::sandbox::RESERVED
            .iter()
            .find(|r| config.root.starts_with(r))
        {
            return Err(SandboxError::InvalidRequest(format!(
                "the virtualenv cache {} lies under {r}, which each sandbox replaces: pick another directory",
                config.root.display()
            )));
        }
        let python = Sandbox::new(base.clone())?
            .interpreter(Language::Python)?
            .exe
            .clone();
        Ok(Venvs {
            config,
            base,
            python,
            entries: Mutex::new(HashMap::new()),
        })
    }

    /// The cache directory of `requirements` (checked and sorted first).
    pub fn dir(&self, requirements: &[String]) -> Result<PathBuf, SandboxError> {
        let reqs = check_requirements(requirements)?;
        Ok(self.config.root.join(self.key(&reqs)))
    }

    fn key(&self, reqs: &[String]) -> String {
        let mut h = Sha256::new();
        h.update(self.python.as_os_str().as_encoded_bytes());
        for arg in &self.config.pip_args {
            h.update(b"\0arg\0");
            h.update(arg.as_bytes());
        }
        for r in reqs {
            h.update(b"\0req\0");
            h.update(r.as_bytes());
        }
        h.finalize()[..12]
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect()
    }

    /// The sandbox whose Python has exactly `requirements` installed,
    /// building its virtualenv first if no earlier call (in this process
    /// or an earlier one) did. Blocking: call it from `spawn_blocking`.
    /// A failed build is remembered, so later requests fail at once.
    pub fn sandbox(&self, requirements: &[String]) -> Result<Arc<Sandbox>, SandboxError> {
        let reqs = check_requirements(requirements)?;
        let key = self.key(&reqs);
        let entry = {
            let mut map = self.entries.lock().unwrap_or_else(PoisonError::into_inner);
            map.entry(key.clone()).or_default().clone()
        };
        let mut slot = entry.lock().unwrap_or_else(PoisonError::into_inner);
        if slot.is_none() {
            let dir = self.config.root.join(&key);
            let built = self
                .build(&dir, &reqs)
                .and_then(|()| {
                    let config = SandboxConfig {
                        venv: Some(dir.clone()),
                        ..self.base.clone()
                    };
                    Sandbox::new(config).map_err(|e| e.to_string())
                })
                .map(Arc::new);
            if let Err(e) = &built {
                tracing::warn!("requirements {reqs:?}: {e}");
            }
            *slot = Some(built);
        }
        match slot.as_ref() {
            Some(Ok(sandbox)) => Ok(sandbox.clone()),
            Some(Err(e)) => Err(SandboxError::Requirements(format!("{reqs:?}: {e}"))),
            None => Err(SandboxError::Requirements("no build result".into())),
        }
    }

    /// `python3 -m venv DIR` and `pip install` the requirements into it,
    /// unless `DIR` holds a finished build.
    fn build(&self, dir: &Path, reqs: &[String]) -> Result<(), String> {
        if dir.join(COMPLETE).is_file() {
            return Ok(());
        }
        if dir.exists() {
            std::fs::remove_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        }
        std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        let log_path = dir.join("build.log");
        let started = Instant::now();
        tracing::info!("building a virtualenv for {reqs:?} in {}", dir.display());
        let mut venv = std::process::Command::new(&self.python);
        venv.arg("-m").arg("venv").arg(dir);
        self.run_logged(venv, &log_path)?;
        let mut pip = std::process::Command::new(dir.join("bin").join("python3"));
        pip.args([
            "-m",
            "pip",
            "install",
            "--disable-pip-version-check",
            "--no-input",
            "--only-binary=:all:",
        ])
        .args(&self.config.pip_args)
        .args(reqs);
        self.run_logged(pip, &log_path)?;
        std::fs::write(dir.join("requirements.txt"), reqs.join("\n") + "\n")
            .and_then(|()| std::fs::write(dir.join(COMPLETE), b""))
            .map_err(|e| format!("{}: {e}", dir.display()))?;
        tracing::info!(
            "virtualenv for {reqs:?} built in {:.1}s",
            started.elapsed().as_secs_f64()
        );
        Ok(())
    }

    /// Runs `cmd` with its output appended to `log`, within the build
    /// timeout; on failure, the log's last lines.
    fn run_logged(&self, mut cmd: std::process::Command, log: &Path) -> Result<(), String> {
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(log)
            .map_err(|e| format!("{}: {e}", log.display()))?;
        let err = file
            .try_clone()
            .map_err(|e| format!("{}: {e}", log.display()))?;
        let mut child = cmd
            .stdin(std::process::Stdio::null())
            .stdout(file)
            .stderr(err)
            .spawn()
            .map_err(|e| format!("{cmd:?}: {e}"))?;
        let deadline = Instant::now() + self.config.build_timeout;
        let status = loop {
            match child.try_wait() {
                Ok(Some(status)) => break status,
                Ok(None) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(50))
                }
                Ok(None) => {
                    let _ = child.kill();
                    let _ = child.wait();
                    return Err(format!(
                        "the build took longer than {}s",
                        self.config.build_timeout.as_secs()
                    ));
                }
                Err(e) => return Err(e.to_string()),
            }
        };
        if status.success() {
            return Ok(());
        }
        let text = std::fs::read_to_string(log).unwrap_or_default();
        let tail: Vec<&str> = text.lines().rev().take(8).collect();
        let tail: Vec<&str> = tail.into_iter().rev().collect();
        Err(format!(
            "{:?} failed ({status}): {}",
            cmd.get_program(),
            tail.join(" | ")
        ))
    }
}
