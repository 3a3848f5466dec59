//! Requests, results and configuration.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};

/// A language the sandbox can run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
#[non_exhaustive]
pub enum Language {
    /// CPython 3 (`python3 main.py`).
    #[serde(alias = "python3")]
    Python,
    /// GNU bash (`bash main.sh`).
    #[serde(alias = "sh")]
    Bash,
}

impl Language {
    /// The lowercase name used in the HTTP API.
    pub fn name(self) -> &'static str {
        match self {
            Language::Python => "python",
            Language::Bash => "bash",
        }
    }

    pub(crate) fn file_name(self) -> &'static str {
        match self {
            Language::Python => "main.py",
            Language::Bash => "main.sh",
        }
    }
}

/// One program to run.
#[derive(Debug, Clone)]
pub struct ExecRequest {
    /// The interpreter.
    pub language: Language,
    /// Source code; written read-only to `/code/main.py` (or `main.sh`).
    pub code: String,
    /// Bytes fed to the program's standard input.
    pub stdin: Vec<u8>,
    /// Files written into the work dir (`/work`) before the run; keys are
    /// relative paths without `..`.
    pub files: BTreeMap<String, Vec<u8>>,
    /// Files read back from the work dir after the run (relative paths).
    pub fetch_files: Vec<String>,
    /// Wall-clock limit; on expiry every process of the run is killed.
    pub timeout: Duration,
    /// Address-space limit in MiB (`RLIMIT_AS`); `None` = the config
    /// default, which is also the most a request can ask for.
    pub memory_limit_mb: Option<u64>,
}

impl ExecRequest {
    /// A request with no stdin, no files and a 10 s timeout.
    pub fn new(language: Language, code: impl Into<String>) -> Self {
        ExecRequest {
            language,
            code: code.into(),
            stdin: Vec::new(),
            files: BTreeMap::new(),
            fetch_files: Vec::new(),
            timeout: Duration::from_secs(10),
            memory_limit_mb: None,
        }
    }
}

/// How a run ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub enum ExecStatus {
    /// The program exited on its own (any exit code).
    Finished,
    /// The program was killed by a signal (crash, `RLIMIT_CPU`, ...).
    Signaled,
    /// The wall-clock timeout expired; everything was killed.
    TimeLimitExceeded,
    /// The run's processes together exceeded its memory limit (cgroup);
    /// everything was killed.
    MemoryLimitExceeded,
}

/// What a run produced.
#[derive(Debug, Clone)]
pub struct ExecResult {
    /// How it ended.
    pub status: ExecStatus,
    /// Exit code when [`ExecStatus::Finished`].
    pub return_code: Option<i32>,
    /// Signal number when [`ExecStatus::Signaled`].
    pub signal: Option<i32>,
    /// Captured standard output (lossy UTF-8, at most `output_limit_bytes`).
    pub stdout: String,
    /// Captured standard error (lossy UTF-8, at most `output_limit_bytes`).
    pub stderr: String,
    /// True when stdout was longer than the cap and was cut.
    pub stdout_truncated: bool,
    /// True when stderr was longer than the cap and was cut.
    pub stderr_truncated: bool,
    /// From the start of the program to its end (or to the kill).
    pub execution_time: Duration,
    /// The requested `fetch_files` that existed as regular files.
    pub files: BTreeMap<String, Vec<u8>>,
}

/// Resource limits applied to every run.
#[derive(Debug, Clone)]
pub struct Limits {
    /// `RLIMIT_CPU` in seconds (SIGKILL one second after SIGXCPU).
    pub cpu_seconds: u64,
    /// `RLIMIT_AS` in MiB when a request names none, and the cap on what a
    /// request may name.
    pub memory_mb: u64,
    /// `RLIMIT_NPROC`: processes and threads of the sandbox user.
    pub max_processes: u64,
    /// `RLIMIT_FSIZE` in MiB: largest file the program may write.
    pub max_file_size_mb: u64,
    /// `RLIMIT_NOFILE`.
    pub max_open_files: u64,
    /// Size of each writable tmpfs (`/work`, `/tmp`, `/dev/shm`) in MiB.
    pub tmpfs_mb: u64,
    /// Bytes of stdout and of stderr kept; the rest is read and dropped.
    pub output_limit_bytes: usize,
    /// Bytes kept per fetched file.
    pub fetch_file_limit_bytes: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            cpu_seconds: 30,
            memory_mb: 1024,
            max_processes: 64,
            max_file_size_mb: 64,
            max_open_files: 256,
            tmpfs_mb: 64,
            output_limit_bytes: 1 << 20,
            fetch_file_limit_bytes: 16 << 20,
        }
    }
}

/// How sandboxes are built on this host.
#[derive(Debug, Clone)]
pub struct SandboxConfig {
    /// Resource limits.
    pub limits: Limits,
    /// Python interpreter; `None` = `/usr/bin/python3`, else `python3` on
    /// `PATH` (resolved through `sys.executable`, so pyenv shims work).
    pub python: Option<PathBuf>,
    /// Bash; `None` = `/usr/bin/bash` or `/bin/bash`.
    pub bash: Option<PathBuf>,
    /// A virtualenv whose packages programs see: its `bin/python3` is the
    /// Python interpreter (overriding `python`), and the venv directory is
    /// bound read-only at its own path (it is not relocatable).
    pub venv: Option<PathBuf>,
    /// Extra host directories bound read-only at the same path inside.
    pub extra_ro_binds: Vec<PathBuf>,
    /// Host uid/gid the sandbox user maps to when we run as root (with
    /// `CAP_SETUID`); unprivileged callers always map to themselves.
    pub host_uid_when_root: u32,
    /// Extra writable directories at absolute paths (a task's `/app`,
    /// `/logs`, `/tests`): each a size-capped tmpfs of `limits.tmpfs_mb`
    /// owned by the sandbox user, created in the new root like `/work`.
    /// They may not be `/` nor lie on or under a system directory,
    /// `/proc`, `/dev`, `/work`, `/tmp` or `/code`.
    pub writable_dirs: Vec<PathBuf>,
    /// Share the host's network namespace instead of a private one with
    /// loopback only (a task that needs the internet, when its operator
    /// opts in). Every other namespace, limit and filter stays.
    pub host_network: bool,
}

impl Default for SandboxConfig {
    fn default() -> Self {
        SandboxConfig {
            limits: Limits::default(),
            python: None,
            bash: None,
            venv: None,
            extra_ro_binds: Vec::new(),
            host_uid_when_root: 65534,
            writable_dirs: Vec::new(),
            host_network: false,
        }
    }
}
