//! The parent side: build a [`Plan`], clone the child, feed and drain it.

use std::collections::BTreeMap;
use std::ffi::CString;
use std::io;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Component, Path, PathBuf};
use std::time::{Duration, Instant};

use nix::fcntl::{fcntl, FcntlArg, OFlag};
use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use nix::sched::CloneFlags;
use nix::sys::resource::Resource;
use nix::sys::signal::{kill, Signal};
use nix::sys::wait::waitpid;
use nix::unistd::{pipe2, Pid};
use seccompiler::BpfProgram;

use crate::cgroup::{Cgroups, RunCgroup, RunLimits};
use crate::child::{
    self, Plan, Step, FD_BINDS, INNER_ID, MAX_BINDS, MSG_EXITED, MSG_LEN, MSG_SETUP_ERROR, STAGES,
};
use crate::{seccomp, ExecRequest, ExecResult, ExecStatus, Language, SandboxConfig, SandboxError};

/// Where the new root is assembled inside the child's mount namespace (a
/// tmpfs is mounted over it there; the host's directory is untouched).
const STAGING: &str = "/tmp";
/// System directories exposed read-only (or recreated as symlinks).
const SYSTEM_PATHS: &[&str] = &[
    "/usr", "/etc", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32",
];
const DEVICES: &[&str] = &["null", "zero", "full", "random", "urandom"];
const STACK_SIZE: usize = 256 * 1024;
/// How long to keep draining output after the program has exited.
const DRAIN_GRACE: Duration = Duration::from_secs(2);
/// How often a run's cgroup is checked for an OOM kill.
const OOM_POLL: Duration = Duration::from_millis(50);
/// Memory a warm worker's zygote may use beyond its run's limit.
pub(crate) const WORKER_SLACK_MB: u64 = 64;

/// An interpreter found on the host.
#[derive(Debug, Clone)]
pub struct Interpreter {
    /// Absolute path of the executable (same path inside the sandbox).
    pub exe: PathBuf,
    /// Install prefix bound read-only when it is not under `/usr`.
    pub prefix: Option<PathBuf>,
}

/// Runs programs in fresh namespaces. Cheap to share: `run` takes `&self`
/// and may be called from many threads at once.
pub struct Sandbox {
    config: SandboxConfig,
    python: Result<Interpreter, String>,
    bash: Result<Interpreter, String>,
    system_steps: Vec<Step>,
    bind_sources: Vec<CString>,
    bind_fd_paths: Vec<CString>,
    filters: Vec<BpfProgram>,
    env: Vec<CString>,
    cgroups: Cgroups,
}

impl std::fmt::Debug for Sandbox {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sandbox")
            .field("config", &self.config)
            .field("python", &self.python)
            .field("bash", &self.bash)
            .finish_non_exhaustive()
    }
}

fn cstring(bytes: impl AsRef<[u8]>) -> Result<CString, SandboxError> {
    CString::new(bytes.as_ref())
        .map_err(|_| SandboxError::InvalidRequest("a path or argument contains a NUL byte".into()))
}

fn staged(path: &Path) -> Result<CString, SandboxError> {
    let mut s = STAGING.as_bytes().to_vec();
    s.extend_from_slice(path.as_os_str().as_bytes());
    cstring(s)
}

fn find_python(config: &SandboxConfig) -> Result<Interpreter, String> {
    if let Some(venv) = &config.venv {
        return venv_python(venv);
    }
    let candidate = config
        .python
        .clone()
        .unwrap_or_else(|| PathBuf::from("python3"));
    // Ask the interpreter itself: resolves pyenv shims and venvs.
    let out = std::process::Command::new(&candidate)
        .args([
            "-c",
            "import sys; print(sys.executable); print(sys.base_prefix)",
        ])
        .output();
    let fallback = Path::new("/usr/bin/python3");
    match out {
        Ok(out) if out.status.success() => {
            let text = String::from_utf8_lossy(&out.stdout);
            let mut lines = text.lines();
            let exe = lines.next().unwrap_or_default();
            let prefix = lines.next().unwrap_or_default();
            let exe = std::fs::canonicalize(exe).map_err(|e| format!("{exe}: {e}"))?;
            let prefix = PathBuf::from(prefix);
            let prefix = (!prefix.starts_with("/usr")).then_some(prefix);
            Ok(Interpreter { exe, prefix })
        }
        _ if config.python.is_none() && fallback.exists() => Ok(Interpreter {
            exe: fallback.to_path_buf(),
            prefix: None,
        }),
        Ok(out) => Err(format!(
            "{} exited with {}",
            candidate.display(),
            out.status
        )),
        Err(e) => Err(format!("{}: {e}", candidate.display())),
    }
}

/// A virtualenv's interpreter: `VENV/bin/python3` itself (not the file
/// its symlink names, or Python would not find `pyvenv.cfg` and the venv's
/// packages), with the base install's prefix to bind.
fn venv_python(venv: &Path) -> Result<Interpreter, String> {
    let venv = std::fs::canonicalize(venv).map_err(|e| format!("{}: {e}", venv.display()))?;
    let exe = venv.join("bin").join("python3");
    let out = std::process::Command::new(&exe)
        .args(["-c", "import sys; print(sys.base_prefix)"])
        .output()
        .map_err(|e| format!("{}: {e}", exe.display()))?;
    if !out.status.success() {
        return Err(format!("{} exited with {}", exe.display(), out.status));
    }
    let prefix = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
    Ok(Interpreter {
        exe,
        prefix: (!prefix.starts_with("/usr")).then_some(prefix),
    })
}

fn find_bash(config: &SandboxConfig) -> Result<Interpreter, String> {
    let candidates = match &config.bash {
        Some(p) => vec![p.clone()],
        None => vec![PathBuf::from("/usr/bin/bash"), PathBuf::from("/bin/bash")],
    };
    candidates
        .into_iter()
        .find(|p| p.is_file())
        .map(|exe| Interpreter { exe, prefix: None })
        .ok_or_else(|| "no bash at /usr/bin/bash or /bin/bash".to_string())
}

/// `a/b/c` → `[a, a/b]` style ancestors (excluding `/` and `path` itself).
fn ancestors_of(path: &Path) -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = path
        .ancestors()
        .skip(1)
        .filter(|p| !p.as_os_str().is_empty() && *p != Path::new("/"))
        .map(Path::to_path_buf)
        .collect();
    out.reverse();
    out
}

/// Longest accepted file name component, in bytes (`NAME_MAX`).
pub const MAX_NAME_BYTES: usize = 255;
/// Longest accepted relative file path, in bytes.
pub const MAX_PATH_BYTES: usize = 1024;

/// Checks a user-supplied relative path: no root, no `..`, no NUL, names
/// at most [`MAX_NAME_BYTES`], at most [`MAX_PATH_BYTES`] in all, and at
/// least one name (so `""`, `"."` and `"./"` are refused). Returns it
/// normalised (`./` dropped).
pub(crate) fn relative_path(p: &str) -> Result<PathBuf, SandboxError> {
    let bad = |why: &str| {
        let shown: String = p.chars().take(64).collect();
        let more = if shown.len() < p.len() { "..." } else { "" };
        Err(SandboxError::InvalidRequest(format!(
            "file path {shown:?}{more} {why}"
        )))
    };
    if p.contains('\0') {
        return bad("contains a NUL byte");
    }
    if p.len() > MAX_PATH_BYTES {
        return bad(&format!("is longer than {MAX_PATH_BYTES} bytes"));
    }
    let path = Path::new(p);
    let mut out = PathBuf::new();
    for c in path.components() {
        match c {
            Component::Normal(name) if name.len() > MAX_NAME_BYTES => {
                return bad(&format!("has a name longer than {MAX_NAME_BYTES} bytes"))
            }
            Component::Normal(name) => out.push(name),
            Component::CurDir => {}
            _ => return bad("must be relative and must not contain `..`"),
        }
    }
    if out.as_os_str().is_empty() {
        return bad("names no file");
    }
    Ok(out)
}

/// Checks every path of `files` and that none is also a directory of
/// another (`a` and `a/b`), which could not both be written.
pub(crate) fn check_files<'a>(
    files: impl IntoIterator<Item = &'a String>,
) -> Result<Vec<PathBuf>, SandboxError> {
    let paths = files
        .into_iter()
        .map(|p| relative_path(p))
        .collect::<Result<Vec<_>, _>>()?;
    let set: std::collections::BTreeSet<&Path> = paths.iter().map(PathBuf::as_path).collect();
    for p in &paths {
        if let Some(dir) = p.ancestors().skip(1).find(|a| set.contains(a)) {
            return Err(SandboxError::InvalidRequest(format!(
                "file {:?} is also a directory of {:?}",
                dir.display(),
                p.display()
            )));
        }
    }
    Ok(paths)
}

/// Paths a writable directory may not be, nor lie under: the read-only
/// system directories and the sandbox's own mounts.
pub(crate) const RESERVED: &[&str] = &["/proc", "/dev", "/work", "/tmp", "/code"];

/// Checks `SandboxConfig::writable_dirs`: absolute, no `..`, not `/`, not
/// on or under a reserved or system path, none nested in another.
fn checked_writable_dirs(dirs: &[PathBuf]) -> Result<Vec<PathBuf>, SandboxError> {
    let mut out: Vec<PathBuf> = Vec::new();
    for dir in dirs {
        let bad = |why: &str| {
            Err(SandboxError::InvalidRequest(format!(
                "writable dir {:?} {why}",
                dir.display()
            )))
        };
        if !dir.is_absolute() {
            return bad("must be absolute");
        }
        let mut clean = PathBuf::from("/");
        for c in dir.components() {
            match c {
                Component::RootDir | Component::CurDir => {}
                Component::Normal(name) if name.len() <= MAX_NAME_BYTES => clean.push(name),
                _ => return bad("must not contain `..` or over-long names"),
            }
        }
        if clean == Path::new("/") {
            return bad("must not be `/`");
        }
        if let Some(r) = SYSTEM_PATHS
            .iter()
            .chain(RESERVED)
            .find(|r| clean.starts_with(r))
        {
            return bad(&format!("lies under {r}, which the sandbox owns"));
        }
        if let Some(other) = out
            .iter()
            .find(|o| clean.starts_with(o.as_path()) || o.starts_with(&clean))
        {
            return bad(&format!("overlaps {:?}", other.display()));
        }
        out.push(clean);
    }
    Ok(out)
}

impl Sandbox {
    /// Finds the interpreters, compiles the seccomp filter and plans the
    /// read-only root. Fails only when seccomp cannot be built.
    pub fn new(config: SandboxConfig) -> Result<Self, SandboxError> {
        let python = find_python(&config);
        let bash = find_bash(&config);
        if let Err(e) = &python {
            tracing::warn!("python unavailable in the sandbox: {e}");
        }
        let filters = seccomp::build_filters()?;
        let tmpfs_mb = config.limits.tmpfs_mb;

        let mut steps = vec![Step::Tmpfs {
            path: cstring(STAGING)?,
            options: cstring(format!("size={}m,mode=0755", tmpfs_mb.max(1)))?,
        }];
        for dir in ["/proc", "/dev", "/work", "/tmp", "/code"] {
            steps.push(Step::Mkdir(staged(Path::new(dir))?));
        }
        let mut binds: Vec<PathBuf> = Vec::new();
        for path in SYSTEM_PATHS {
            let path = Path::new(path);
            match std::fs::symlink_metadata(path) {
                Ok(m) if m.file_type().is_symlink() => {
                    let target = std::fs::read_link(path)
                        .map_err(|e| SandboxError::host("read system symlink", e))?;
                    steps.push(Step::Symlink {
                        target: cstring(target.as_os_str().as_bytes())?,
                        link: staged(path)?,
                    });
                }
                Ok(m) if m.is_dir() => binds.push(path.to_path_buf()),
                _ => {}
            }
        }
        let prefixes = [&python, &bash]
            .into_iter()
            .filter_map(|i| i.as_ref().ok().and_then(|i| i.prefix.clone()));
        binds.extend(prefixes);
        if let (Some(venv), Ok(_)) = (&config.venv, &python) {
            binds.extend(std::fs::canonicalize(venv).ok());
        }
        binds.extend(config.extra_ro_binds.iter().cloned());
        if binds.len() > MAX_BINDS {
            return Err(SandboxError::InvalidRequest(format!(
                "at most {MAX_BINDS} read-only binds"
            )));
        }
        let mut bind_sources = Vec::new();
        let mut bind_fd_paths = Vec::new();
        for bind in &binds {
            for dir in ancestors_of(bind) {
                steps.push(Step::Mkdir(staged(&dir)?));
            }
            steps.push(Step::Mkdir(staged(bind)?));
            steps.push(Step::BindReadOnly {
                index: bind_sources.len(),
                target: staged(bind)?,
            });
            bind_fd_paths.push(cstring(format!(
                "/proc/self/fd/{}",
                FD_BINDS as usize + bind_sources.len()
            ))?);
            bind_sources.push(cstring(bind.as_os_str().as_bytes())?);
        }
        steps.push(Step::Tmpfs {
            path: staged(Path::new("/dev"))?,
            options: cstring("size=1m,mode=0755")?,
        });
        for dev in DEVICES {
            let source = Path::new("/dev").join(dev);
            if source.exists() {
                steps.push(Step::BindDevice {
                    source: cstring(source.as_os_str().as_bytes())?,
                    target: staged(&source)?,
                });
            }
        }
        for (name, target) in [
            ("fd", "/proc/self/fd"),
            ("stdin", "/proc/self/fd/0"),
            ("stdout", "/proc/self/fd/1"),
            ("stderr", "/proc/self/fd/2"),
        ] {
            steps.push(Step::Symlink {
                target: cstring(target)?,
                link: staged(&Path::new("/dev").join(name))?,
            });
        }
        steps.push(Step::Mkdir(staged(Path::new("/dev/shm"))?));
        for (dir, mode) in [("/dev/shm", "1777"), ("/work", "0755"), ("/tmp", "1777")] {
            steps.push(Step::Tmpfs {
                path: staged(Path::new(dir))?,
                options: cstring(format!("size={tmpfs_mb}m,mode={mode}"))?,
            });
        }
        for dir in checked_writable_dirs(&config.writable_dirs)? {
            for parent in ancestors_of(&dir) {
                steps.push(Step::Mkdir(staged(&parent)?));
            }
            steps.push(Step::Mkdir(staged(&dir)?));
            steps.push(Step::Tmpfs {
                path: staged(&dir)?,
                options: cstring(format!("size={}m,mode=0755", tmpfs_mb.max(1)))?,
            });
        }
        steps.push(Step::Proc(staged(Path::new("/proc"))?));

        let mut path = String::from("/usr/local/bin:/usr/bin:/bin");
        if let Ok(Interpreter { exe, .. }) = &python {
            if let Some(dir) = exe.parent() {
                path = format!("{}:{path}", dir.display());
            }
        }
        let env = [
            format!("PATH={path}"),
            "HOME=/work".into(),
            "TMPDIR=/tmp".into(),
            "LANG=C.UTF-8".into(),
            "PYTHONDONTWRITEBYTECODE=1".into(),
            "PYTHONIOENCODING=utf-8".into(),
        ]
        .into_iter()
        .map(cstring)
        .collect::<Result<_, _>>()?;

        Ok(Sandbox {
            config,
            python,
            bash,
            system_steps: steps,
            bind_sources,
            bind_fd_paths,
            filters,
            env,
            cgroups: Cgroups::detect(),
        })
    }

    /// What enforces the per-run memory and process limits on this host
    /// (cgroup v2, cgroup v1, or the rlimit fallback).
    pub fn run_limits(&self) -> &RunLimits {
        self.cgroups.mode()
    }

    /// The configuration this sandbox was built with.
    pub fn config(&self) -> &SandboxConfig {
        &self.config
    }

    /// The interpreter used for `language`, or why there is none.
    pub fn interpreter(&self, language: Language) -> Result<&Interpreter, SandboxError> {
        let (found, name) = match language {
            Language::Python => (&self.python, "python"),
            Language::Bash => (&self.bash, "bash"),
        };
        found
            .as_ref()
            .map_err(|reason| SandboxError::NoInterpreter {
                language: name,
                reason: reason.clone(),
            })
    }

    /// Runs one program in fresh namespaces and waits for it (blocking; call
    /// it from `spawn_blocking` in async code).
    pub fn run(&self, req: &ExecRequest) -> Result<ExecResult, SandboxError> {
        let spawned = self.spawn(req, None)?;
        self.finish(spawned, req)
    }

    /// Clones the child for `req` and starts it; `extra_fd` becomes the
    /// program's fd 3 (the warm pool's control socket).
    pub(crate) fn spawn(
        &self,
        req: &ExecRequest,
        extra_fd: Option<&OwnedFd>,
    ) -> Result<Spawned, SandboxError> {
        if req.timeout.is_zero() {
            return Err(SandboxError::InvalidRequest("timeout must be > 0".into()));
        }
        let interpreter = self.interpreter(req.language)?;
        let limits = &self.config.limits;
        let memory_mb = req
            .memory_limit_mb
            .unwrap_or(limits.memory_mb)
            .min(limits.memory_mb);
        if memory_mb == 0 {
            return Err(SandboxError::InvalidRequest(
                "memory_limit_mb must be > 0".into(),
            ));
        }

        let mut request_steps = Vec::new();
        let work = Path::new("/work");
        let rels = check_files(req.files.keys())?;
        for (rel, data) in rels.into_iter().zip(req.files.values()) {
            for dir in ancestors_of(&rel) {
                request_steps.push(Step::Mkdir(staged(&work.join(dir))?));
            }
            request_steps.push(Step::WriteFile {
                path: staged(&work.join(&rel))?,
                data: data.clone(),
                mode: 0o644,
            });
        }
        let fetch: Vec<(String, PathBuf)> = req
            .fetch_files
            .iter()
            .map(|p| relative_path(p).map(|rel| (p.clone(), rel)))
            .collect::<Result<_, _>>()?;
        let code_path = Path::new("/code").join(req.language.file_name());
        request_steps.push(Step::WriteFile {
            path: staged(&code_path)?,
            data: req.code.as_bytes().to_vec(),
            mode: 0o444,
        });

        let exe = cstring(interpreter.exe.as_os_str().as_bytes())?;
        let args = [exe.clone(), cstring(code_path.as_os_str().as_bytes())?];
        let mut argv: Vec<_> = args.iter().map(|a| a.as_ptr()).collect();
        argv.push(std::ptr::null());
        let mut envp: Vec<_> = self.env.iter().map(|a| a.as_ptr()).collect();
        envp.push(std::ptr::null());
        let mib = 1024 * 1024;
        let cpu = limits.cpu_seconds.max(1);
        let rlimits = vec![
            (Resource::RLIMIT_CPU, cpu, cpu + 1),
            (
                Resource::RLIMIT_AS,
                memory_mb.saturating_mul(mib),
                memory_mb.saturating_mul(mib),
            ),
            (
                Resource::RLIMIT_NPROC,
                limits.max_processes,
                limits.max_processes,
            ),
            (
                Resource::RLIMIT_FSIZE,
                limits.max_file_size_mb.saturating_mul(mib),
                limits.max_file_size_mb.saturating_mul(mib),
            ),
            (
                Resource::RLIMIT_NOFILE,
                limits.max_open_files,
                limits.max_open_files,
            ),
            (Resource::RLIMIT_CORE, 0, 0),
        ];

        let pipe = || pipe2(OFlag::O_CLOEXEC).map_err(|e| SandboxError::host("pipe", e));
        let (stdin_r, stdin_w) = pipe()?;
        let (stdout_r, stdout_w) = pipe()?;
        let (stderr_r, stderr_w) = pipe()?;
        let (sync_r, sync_w) = pipe()?;
        let (status_r, status_w) = pipe()?;

        // The init's copy of the host's argument and environment blocks,
        // blanked in the child: a sandbox must not read `temper ...`'s
        // command line at /proc/1/cmdline.
        let host_blocks = crate::secret::arg_env_ranges()
            .map_err(|e| SandboxError::host("read this process's argument block", e))?;
        let plan = Plan {
            host_blocks,
            staging: cstring(STAGING)?,
            system_steps: &self.system_steps,
            bind_sources: &self.bind_sources,
            bind_fd_paths: &self.bind_fd_paths,
            request_steps,
            hostname: "sandbox",
            die_with_thread: extra_fd.is_none(),
            rlimits,
            work_dir: cstring("/work")?,
            filters: &self.filters,
            exe,
            argv,
            envp,
            fds: [
                stdin_r.as_raw_fd(),
                stdout_w.as_raw_fd(),
                stderr_w.as_raw_fd(),
                sync_r.as_raw_fd(),
                status_w.as_raw_fd(),
                extra_fd.map_or(-1, |fd| fd.as_raw_fd()),
            ],
        };
        let mut stack = vec![0u8; STACK_SIZE];
        let mut flags = CloneFlags::CLONE_NEWUSER
            | CloneFlags::CLONE_NEWPID
            | CloneFlags::CLONE_NEWNS
            | CloneFlags::CLONE_NEWIPC
            | CloneFlags::CLONE_NEWUTS
            | CloneFlags::CLONE_NEWCGROUP;
        if !self.config.host_network {
            flags |= CloneFlags::CLONE_NEWNET;
        }
        // SAFETY: the callback runs in a copy of this address space and only
        // issues system calls on `plan` (see `child.rs`); it never returns.
        let pid = unsafe {
            nix::sched::clone(
                Box::new(|| child::main(&plan)),
                &mut stack,
                flags,
                Some(libc::SIGCHLD),
            )
        }
        .map_err(|e| SandboxError::host("clone into new namespaces", e))?;
        let child = Child { pid, reaped: false };
        drop((stdin_r, stdout_w, stderr_w, sync_r, status_w));

        write_id_maps(pid, self.config.host_uid_when_root)?;
        // The whole run (or worker) in one cgroup, before anything starts.
        let cg_mb = if extra_fd.is_some() {
            memory_mb.saturating_add(WORKER_SLACK_MB)
        } else {
            memory_mb
        };
        let cgroup = self
            .cgroups
            .create(
                cg_mb.saturating_mul(mib),
                limits.max_processes.saturating_add(2),
            )
            .map_err(|e| SandboxError::host("create the run's cgroup", e))?;
        if let Some(cg) = &cgroup {
            cg.add(pid.as_raw())
                .map_err(|e| SandboxError::host("move the run into its cgroup", e))?;
        }
        let start = Instant::now();
        nix::unistd::write(&sync_w, &[1]).map_err(|e| SandboxError::host("start child", e))?;
        Ok(Spawned {
            child,
            cgroup,
            stdin_w,
            stdout_r,
            stderr_r,
            status_r,
            sync_w,
            start,
            fetch,
        })
    }

    fn finish(&self, s: Spawned, req: &ExecRequest) -> Result<ExecResult, SandboxError> {
        let limits = &self.config.limits;
        let io = drain(
            req,
            limits.output_limit_bytes,
            Some(s.stdin_w),
            Outputs {
                stdout: &s.stdout_r,
                stderr: &s.stderr_r,
                status: &s.status_r,
            },
            s.start,
            s.cgroup.as_ref(),
        )?;
        let files = if io.wait_status.is_some() && !s.fetch.is_empty() {
            fetch_files(s.child.pid, &s.fetch, limits.fetch_file_limit_bytes)
        } else {
            BTreeMap::new()
        };
        let mut child = s.child;
        if io.wait_status.is_none() {
            // Timed out (or init died): SIGKILL to pid 1 takes down the
            // whole pid namespace.
            let _ = kill(child.pid, Signal::SIGKILL);
        }
        drop(s.sync_w);
        child.wait();
        to_result(io, s.start, files)
    }
}

/// A started child: its init, the parent ends of its pipes.
pub(crate) struct Spawned {
    pub child: Child,
    /// Dropped after `child` (field order): removed once the run is gone.
    pub cgroup: Option<RunCgroup>,
    pub stdin_w: OwnedFd,
    pub stdout_r: OwnedFd,
    pub stderr_r: OwnedFd,
    pub status_r: OwnedFd,
    pub sync_w: OwnedFd,
    pub start: Instant,
    pub fetch: Vec<(String, PathBuf)>,
}

/// Turns what `drain` saw into a result (or the setup error).
pub(crate) fn to_result(
    io: Drained,
    start: Instant,
    files: BTreeMap<String, Vec<u8>>,
) -> Result<ExecResult, SandboxError> {
    let execution_time = io.finished_at.unwrap_or_else(Instant::now) - start;
    if let Some((stage, errno)) = io.setup_error {
        let stage = STAGES.get(stage as usize).copied().unwrap_or("unknown");
        return Err(SandboxError::Setup {
            stage,
            source: io::Error::from_raw_os_error(errno),
        });
    }
    let (status, return_code, signal) = match io.wait_status {
        _ if io.oom => (ExecStatus::MemoryLimitExceeded, None, Some(libc::SIGKILL)),
        None if io.timed_out => (ExecStatus::TimeLimitExceeded, None, None),
        Some(_) if io.killed_on_timeout => (ExecStatus::TimeLimitExceeded, None, None),
        None => {
            return Err(SandboxError::host(
                "sandbox init",
                io::Error::other("exited without reporting a status"),
            ))
        }
        Some(s) if libc::WIFEXITED(s) => (ExecStatus::Finished, Some(libc::WEXITSTATUS(s)), None),
        Some(s) if libc::WIFSIGNALED(s) => (ExecStatus::Signaled, None, Some(libc::WTERMSIG(s))),
        Some(_) => (ExecStatus::Signaled, None, None),
    };
    Ok(ExecResult {
        status,
        return_code,
        signal,
        stdout: String::from_utf8_lossy(&io.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&io.stderr).into_owned(),
        stdout_truncated: io.stdout_truncated,
        stderr_truncated: io.stderr_truncated,
        execution_time,
        files,
    })
}

/// The cloned init process; killed (with its whole pid namespace) and
/// reaped on drop, so no error path leaks processes.
pub(crate) struct Child {
    pub pid: Pid,
    reaped: bool,
}

impl Child {
    pub(crate) fn wait(&mut self) {
        while let Err(nix::errno::Errno::EINTR) = waitpid(self.pid, None) {}
        self.reaped = true;
    }
}

impl Drop for Child {
    fn drop(&mut self) {
        if !self.reaped {
            let _ = kill(self.pid, Signal::SIGKILL);
            self.wait();
        }
    }
}

fn write_id_maps(pid: Pid, host_uid_when_root: u32) -> Result<(), SandboxError> {
    let proc = PathBuf::from(format!("/proc/{pid}"));
    let euid = nix::unistd::geteuid();
    let (uid, gid) = if euid.is_root() {
        (host_uid_when_root, host_uid_when_root)
    } else {
        // Unprivileged: we may only map ourselves, and must deny setgroups.
        std::fs::write(proc.join("setgroups"), "deny")
            .map_err(|e| SandboxError::host("write setgroups", e))?;
        (euid.as_raw(), nix::unistd::getegid().as_raw())
    };
    std::fs::write(proc.join("uid_map"), format!("{INNER_ID} {uid} 1\n"))
        .map_err(|e| SandboxError::host("write uid_map", e))?;
    std::fs::write(proc.join("gid_map"), format!("{INNER_ID} {gid} 1\n"))
        .map_err(|e| SandboxError::host("write gid_map", e))?;
    Ok(())
}

#[derive(Default)]
pub(crate) struct Drained {
    stdout: Vec<u8>,
    stderr: Vec<u8>,
    stdout_truncated: bool,
    stderr_truncated: bool,
    pub wait_status: Option<i32>,
    pub setup_error: Option<(i32, i32)>,
    finished_at: Option<Instant>,
    timed_out: bool,
    /// The worker killed the run at its timeout (warm pool, sessions).
    killed_on_timeout: bool,
    /// The run's cgroup hit its memory limit (the run is killed whole).
    pub oom: bool,
}

impl Drained {
    /// A warm worker vanished mid-run without a status or a timeout (the
    /// program killed it, e.g. `os.kill(-1, 9)`): record the run as killed
    /// by SIGKILL, which is what happened to it. True when that was so.
    pub(crate) fn worker_lost(&mut self) -> bool {
        if self.wait_status.is_some() || self.setup_error.is_some() || self.timed_out || self.oom {
            return false;
        }
        self.wait_status = Some(libc::SIGKILL);
        self.stderr
            .extend_from_slice(b"\n[sandbox: the run's worker was killed; it has been replaced]\n");
        true
    }
}

fn set_nonblocking(fd: &impl AsFd) -> Result<(), SandboxError> {
    fcntl(fd.as_fd(), FcntlArg::F_SETFL(OFlag::O_NONBLOCK))
        .map(drop)
        .map_err(|e| SandboxError::host("set O_NONBLOCK", e))
}

/// Reads `fd` into `buf` up to `cap` bytes (dropping the rest); returns
/// false at EOF.
fn read_some(fd: &OwnedFd, buf: &mut Vec<u8>, cap: usize, truncated: &mut bool) -> bool {
    let mut chunk = [0u8; 65536];
    loop {
        match nix::unistd::read(fd, &mut chunk) {
            Ok(0) => return false,
            Ok(n) => {
                let room = cap.saturating_sub(buf.len());
                buf.extend_from_slice(&chunk[..n.min(room)]);
                if n > room {
                    *truncated = true;
                }
            }
            Err(nix::errno::Errno::EINTR) => continue,
            Err(nix::errno::Errno::EAGAIN) => return true,
            Err(_) => return false,
        }
    }
}

/// The read ends `drain` watches.
pub(crate) struct Outputs<'a> {
    pub stdout: &'a OwnedFd,
    pub stderr: &'a OwnedFd,
    /// Status messages (the init's pipe, or a worker's socket).
    pub status: &'a OwnedFd,
}

/// Feeds stdin and collects stdout, stderr and the status messages until
/// the program has exited and its output pipes closed, or the timeout.
pub(crate) fn drain(
    req: &ExecRequest,
    cap: usize,
    stdin_w: Option<OwnedFd>,
    outputs: Outputs<'_>,
    start: Instant,
    cgroup: Option<&RunCgroup>,
) -> Result<Drained, SandboxError> {
    let Outputs {
        stdout: stdout_r,
        stderr: stderr_r,
        status: status_r,
    } = outputs;
    let oom_before = cgroup.map(RunCgroup::oom_kills);
    let oom_now = || match (cgroup, oom_before) {
        (Some(cg), Some(before)) => cg.oom_kills() > before,
        _ => false,
    };
    for fd in [stdout_r, stderr_r, status_r] {
        set_nonblocking(fd)?;
    }
    if let Some(w) = &stdin_w {
        set_nonblocking(w)?;
    }
    // A timeout too large to add is as good as none.
    let deadline = start
        .checked_add(req.timeout)
        .unwrap_or_else(|| start + Duration::from_secs(100 * 365 * 24 * 3600));
    let mut out = Drained::default();
    let mut stdin = stdin_w.filter(|_| !req.stdin.is_empty());
    let mut stdin_off = 0;
    let (mut out_open, mut err_open, mut status_open) = (true, true, true);
    let mut status_buf = Vec::new();
    loop {
        let done = out.wait_status.is_some() || !status_open;
        if done && !out_open && !err_open {
            break;
        }
        if oom_now() {
            // Stop here: the caller kills the whole run.
            out.oom = true;
            break;
        }
        let now = Instant::now();
        let limit = match out.finished_at {
            Some(t) => (t + DRAIN_GRACE).min(deadline.max(t + Duration::from_millis(50))),
            None => deadline,
        };
        if now >= limit {
            out.timed_out = out.wait_status.is_none();
            break;
        }
        let mut fds = Vec::with_capacity(4);
        let mut kinds = Vec::with_capacity(4);
        if out_open {
            fds.push(PollFd::new(stdout_r.as_fd(), PollFlags::POLLIN));
            kinds.push(0);
        }
        if err_open {
            fds.push(PollFd::new(stderr_r.as_fd(), PollFlags::POLLIN));
            kinds.push(1);
        }
        if status_open {
            fds.push(PollFd::new(status_r.as_fd(), PollFlags::POLLIN));
            kinds.push(2);
        }
        if let Some(w) = &stdin {
            fds.push(PollFd::new(w.as_fd(), PollFlags::POLLOUT));
            kinds.push(3);
        }
        let mut wait = limit - now;
        if cgroup.is_some() {
            wait = wait.min(OOM_POLL);
        }
        let wait_ms = wait.as_millis().clamp(1, i32::MAX as u128) as i32;
        match poll(
            &mut fds,
            PollTimeout::try_from(wait_ms).unwrap_or(PollTimeout::MAX),
        ) {
            Ok(_) | Err(nix::errno::Errno::EINTR) => {}
            Err(e) => return Err(SandboxError::host("poll", e)),
        }
        let ready: Vec<(usize, PollFlags)> = fds
            .iter()
            .zip(&kinds)
            .filter_map(|(fd, kind)| fd.revents().filter(|r| !r.is_empty()).map(|r| (*kind, r)))
            .collect();
        drop(fds);
        for (kind, revents) in ready {
            match kind {
                0 => {
                    out_open = read_some(stdout_r, &mut out.stdout, cap, &mut out.stdout_truncated)
                }
                1 => {
                    err_open = read_some(stderr_r, &mut out.stderr, cap, &mut out.stderr_truncated)
                }
                2 => {
                    let mut ignored = false;
                    status_open = read_some(status_r, &mut status_buf, usize::MAX, &mut ignored);
                    while status_buf.len() >= MSG_LEN {
                        let msg: Vec<u8> = status_buf.drain(..MSG_LEN).collect();
                        let a = i32::from_le_bytes([msg[1], msg[2], msg[3], msg[4]]);
                        let b = i32::from_le_bytes([msg[5], msg[6], msg[7], msg[8]]);
                        match msg[0] {
                            MSG_SETUP_ERROR if out.setup_error.is_none() => {
                                out.setup_error = Some((a, b))
                            }
                            MSG_EXITED => {
                                out.wait_status = Some(a);
                                out.killed_on_timeout = b != 0;
                                out.finished_at = Some(Instant::now());
                            }
                            _ => {}
                        }
                    }
                    if !status_open && out.finished_at.is_none() {
                        out.finished_at = Some(Instant::now());
                    }
                }
                _ => {
                    if revents.intersects(PollFlags::POLLERR | PollFlags::POLLHUP) {
                        stdin = None;
                    } else if let Some(w) = &stdin {
                        match nix::unistd::write(w, &req.stdin[stdin_off..]) {
                            Ok(n) => stdin_off += n,
                            Err(nix::errno::Errno::EAGAIN | nix::errno::Errno::EINTR) => {}
                            Err(_) => stdin = None,
                        }
                        if stdin_off >= req.stdin.len() {
                            stdin = None;
                        }
                    }
                }
            }
        }
    }
    // An OOM kill just before the program exited still counts.
    out.oom |= oom_now();
    Ok(out)
}

/// Reads requested files from the live child's `/work` through
/// `/proc/PID/root`, refusing symlinks and anything that escapes the dir.
pub(crate) fn fetch_files(
    pid: Pid,
    fetch: &[(String, PathBuf)],
    cap: usize,
) -> BTreeMap<String, Vec<u8>> {
    let work = format!("/proc/{pid}/root/work");
    let dir = match nix::fcntl::open(
        Path::new(&work),
        OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC,
        nix::sys::stat::Mode::empty(),
    ) {
        Ok(d) => d,
        Err(e) => {
            tracing::warn!("cannot open sandbox work dir: {e}");
            return BTreeMap::new();
        }
    };
    fetch_from_dir(&dir, fetch, cap)
}

/// Reads requested files beneath `dir` (symlinks refused, capped).
pub(crate) fn fetch_from_dir(
    dir: &OwnedFd,
    fetch: &[(String, PathBuf)],
    cap: usize,
) -> BTreeMap<String, Vec<u8>> {
    let mut files = BTreeMap::new();
    for (name, rel) in fetch {
        match open_beneath(dir, rel).and_then(|fd| read_capped(fd, cap)) {
            Ok(data) => {
                files.insert(name.clone(), data);
            }
            Err(e) => tracing::debug!("fetch {name}: {e}"),
        }
    }
    files
}

fn open_beneath(dir: &OwnedFd, rel: &Path) -> io::Result<OwnedFd> {
    #[repr(C)]
    struct OpenHow {
        flags: u64,
        mode: u64,
        resolve: u64,
    }
    let path = CString::new(rel.as_os_str().as_bytes()).map_err(io::Error::other)?;
    let how = OpenHow {
        flags: (libc::O_RDONLY | libc::O_NONBLOCK | libc::O_CLOEXEC | libc::O_NOFOLLOW) as u64,
        mode: 0,
        resolve: libc::RESOLVE_BENEATH
            | libc::RESOLVE_NO_SYMLINKS
            | libc::RESOLVE_NO_MAGICLINKS
            | libc::RESOLVE_NO_XDEV,
    };
    // SAFETY: valid dirfd, C string and open_how of the size we pass.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_openat2,
            dir.as_raw_fd(),
            path.as_ptr(),
            &how as *const OpenHow,
            std::mem::size_of::<OpenHow>(),
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: the kernel just gave us this descriptor.
    Ok(unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd as i32) })
}

fn read_capped(fd: OwnedFd, cap: usize) -> io::Result<Vec<u8>> {
    use std::io::Read;
    let file = std::fs::File::from(fd);
    if !file.metadata()?.is_file() {
        return Err(io::Error::other("not a regular file"));
    }
    let mut data = Vec::new();
    file.take(cap as u64).read_to_end(&mut data)?;
    Ok(data)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn relative_paths_are_checked() {
        assert!(relative_path("a/b.txt").is_ok());
        assert_eq!(relative_path("./a").ok(), Some(PathBuf::from("a")));
        let long_name = "x".repeat(5000);
        let long_path = "d/".repeat(600) + "f";
        for bad in [
            "",
            ".",
            "./",
            "./.",
            "/etc/passwd",
            "../x",
            "a/../../x",
            "a\0b",
            &long_name,
            &long_path,
        ] {
            assert!(relative_path(bad).is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn a_file_that_is_also_a_directory_is_refused() {
        let files = ["a".to_string(), "a/b".to_string()];
        assert!(check_files(&files).is_err());
        let files = ["a/c".to_string(), "a/b".to_string()];
        assert!(check_files(&files).is_ok());
    }

    #[test]
    fn writable_dirs_are_checked() {
        let ok = checked_writable_dirs(&[PathBuf::from("/app"), PathBuf::from("/logs/./x")]);
        assert_eq!(
            ok.ok(),
            Some(vec![PathBuf::from("/app"), PathBuf::from("/logs/x")])
        );
        for bad in [
            vec!["app"],
            vec!["/"],
            vec!["/usr/local/app"],
            vec!["/etc"],
            vec!["/work/x"],
            vec!["/a/../etc"],
            vec!["/app", "/app/sub"],
        ] {
            let dirs: Vec<PathBuf> = bad.iter().map(PathBuf::from).collect();
            assert!(checked_writable_dirs(&dirs).is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn ancestors_exclude_root_and_self() {
        assert_eq!(
            ancestors_of(Path::new("/root/.pyenv/v")),
            vec![PathBuf::from("/root"), PathBuf::from("/root/.pyenv")]
        );
        assert!(ancestors_of(Path::new("x")).is_empty());
    }
}
