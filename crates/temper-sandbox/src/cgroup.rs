//! Per-run memory and process limits over *all* processes of a run.
//!
//! `RLIMIT_AS` and `RLIMIT_NPROC` bound each process (and the sandbox
//! user), so a run of many processes could hold many times the limit. When
//! the host lets us, every sandbox (a one-shot run, or a warm worker and so
//! each of its runs) gets its own cgroup, in this order of preference:
//!
//! - cgroup v2 with the `memory` and `pids` controllers: `memory.max`,
//!   `memory.swap.max = 0`, `pids.max`, `memory.oom.group = 1`;
//! - cgroup v1 `memory` (+ `pids` when mounted): `memory.limit_in_bytes`
//!   (and `memory.memsw.limit_in_bytes`), `pids.max`;
//! - neither writable: the documented fallback is the per-process
//!   `RLIMIT_AS` plus the per-user `RLIMIT_NPROC`, which are always set.
//!
//! The cgroups live under the service's own cgroup, in a directory
//! `temper-sandbox-PID-N` created at start-up and removed on drop. A run
//! that hits the memory limit is killed whole and reported as
//! [`crate::ExecStatus::MemoryLimitExceeded`].

use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// Which mechanism enforces the per-run limits on this host.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum RunLimits {
    /// cgroup v2 (`memory` + `pids`) under this directory.
    CgroupV2(PathBuf),
    /// cgroup v1 `memory` under the first directory, `pids` under the
    /// second when that controller is mounted.
    CgroupV1 {
        /// Our directory in the memory hierarchy.
        memory: PathBuf,
        /// Our directory in the pids hierarchy.
        pids: Option<PathBuf>,
    },
    /// No writable cgroup: per-process `RLIMIT_AS` and per-user
    /// `RLIMIT_NPROC` only; the reason is why cgroups are not used.
    Rlimits(String),
}

impl std::fmt::Display for RunLimits {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RunLimits::CgroupV2(dir) => {
                write!(f, "cgroup v2 memory+pids per run under {}", dir.display())
            }
            RunLimits::CgroupV1 { memory, pids } => {
                write!(f, "cgroup v1 memory per run under {}", memory.display())?;
                match pids {
                    Some(p) => write!(f, ", pids under {}", p.display()),
                    None => write!(f, " (no pids controller: RLIMIT_NPROC for processes)"),
                }
            }
            RunLimits::Rlimits(why) => write!(
                f,
                "fallback: RLIMIT_AS per process + RLIMIT_NPROC per user ({why})"
            ),
        }
    }
}

/// The cgroup parent of this process's sandboxes; removed once the
/// [`Cgroups`] and every [`RunCgroup`] in it are gone.
#[derive(Debug)]
pub(crate) struct Cgroups {
    mode: RunLimits,
    next: AtomicU64,
    parent: Arc<ParentDirs>,
}

#[derive(Debug)]
struct ParentDirs(Vec<PathBuf>);

impl Drop for ParentDirs {
    fn drop(&mut self) {
        for d in &self.0 {
            if let Err(e) = std::fs::remove_dir(d) {
                tracing::debug!("removing {}: {e}", d.display());
            }
        }
    }
}

/// `(mount root, mount point)` of the cgroup mount whose fs type is `fstype`
/// and whose super options include `option` (None: any).
fn find_mount(fstype: &str, option: Option<&str>) -> Option<(String, PathBuf)> {
    let info = std::fs::read_to_string("/proc/self/mountinfo").ok()?;
    info.lines().find_map(|line| {
        let (pre, post) = line.split_once(" - ")?;
        let pre: Vec<&str> = pre.split(' ').collect();
        let mut post = post.split(' ');
        let fs = post.next()?;
        let _source = post.next()?;
        let opts = post.next().unwrap_or("");
        let matches = fs == fstype && option.is_none_or(|o| opts.split(',').any(|x| x == o));
        if !matches {
            return None;
        }
        Some((pre.get(3)?.to_string(), PathBuf::from(pre.get(4)?)))
    })
}

/// This process's cgroup path in the v1 hierarchy holding `controller`, or
/// in the v2 hierarchy when `controller` is None.
fn own_path(controller: Option<&str>) -> Option<String> {
    let text = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    text.lines().find_map(|line| {
        let mut parts = line.splitn(3, ':');
        let hier = parts.next()?;
        let ctrls = parts.next()?;
        let path = parts.next()?;
        let ok = match controller {
            None => hier == "0" && ctrls.is_empty(),
            Some(c) => ctrls.split(',').any(|x| x == c),
        };
        ok.then(|| path.to_string())
    })
}

/// The directory of our cgroup in the mount `(root, point)`.
fn own_dir(mount: &(String, PathBuf), path: &str) -> PathBuf {
    let rel = path
        .strip_prefix(mount.0.as_str())
        .unwrap_or(path)
        .trim_start_matches('/');
    mount.1.join(rel)
}

static INSTANCE: AtomicU64 = AtomicU64::new(0);

fn parent_name() -> String {
    format!(
        "temper-sandbox-{}-{}",
        std::process::id(),
        INSTANCE.fetch_add(1, Ordering::Relaxed)
    )
}

/// Removes the empty cgroups a killed service left under `ours` (names
/// `temper-sandbox-PID-N` whose PID no longer runs).
fn remove_stale(ours: &Path) {
    let Ok(entries) = std::fs::read_dir(ours) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(pid) = name
            .to_str()
            .and_then(|n| n.strip_prefix("temper-sandbox-"))
            .and_then(|rest| rest.split('-').next())
        else {
            continue;
        };
        if Path::new("/proc").join(pid).exists() {
            continue;
        }
        let dir = entry.path();
        if let Ok(runs) = std::fs::read_dir(&dir) {
            for run in runs.flatten().filter(|r| r.path().is_dir()) {
                let _ = std::fs::remove_dir(run.path());
            }
        }
        match std::fs::remove_dir(&dir) {
            Ok(()) => tracing::info!("removed stale cgroup {}", dir.display()),
            Err(e) => tracing::debug!("stale cgroup {}: {e}", dir.display()),
        }
    }
}

fn write(path: &Path, value: &str) -> io::Result<()> {
    std::fs::write(path, value)
        .map_err(|e| io::Error::new(e.kind(), format!("{}: {e}", path.display())))
}

fn try_v2() -> Result<PathBuf, String> {
    let mount = find_mount("cgroup2", None).ok_or("no cgroup2 mount")?;
    let path = own_path(None).ok_or("no cgroup v2 entry in /proc/self/cgroup")?;
    let ours = own_dir(&mount, &path);
    remove_stale(&ours);
    let controllers = std::fs::read_to_string(ours.join("cgroup.controllers"))
        .map_err(|e| format!("{}: {e}", ours.display()))?;
    for c in ["memory", "pids"] {
        if !controllers.split_whitespace().any(|x| x == c) {
            return Err(format!("cgroup v2 has no {c} controller for us"));
        }
    }
    let parent = ours.join(parent_name());
    std::fs::create_dir(&parent).map_err(|e| format!("{}: {e}", parent.display()))?;
    let enable = |dir: &Path| write(&dir.join("cgroup.subtree_control"), "+memory +pids");
    let setup = (|| -> io::Result<()> {
        if let Err(e) = enable(&ours) {
            // "No internal processes": move ourselves into a leaf first.
            if e.raw_os_error() != Some(libc::EBUSY) && e.kind() != io::ErrorKind::ResourceBusy {
                return Err(e);
            }
            let leaf = ours.join(format!("temper-service-{}", std::process::id()));
            match std::fs::create_dir(&leaf) {
                Ok(()) => {}
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
                Err(e) => return Err(e),
            }
            write(&leaf.join("cgroup.procs"), &std::process::id().to_string())?;
            enable(&ours)?;
        }
        enable(&parent)
    })();
    if let Err(e) = setup {
        let _ = std::fs::remove_dir(&parent);
        return Err(e.to_string());
    }
    Ok(parent)
}

fn try_v1() -> Result<RunLimits, String> {
    let mount = find_mount("cgroup", Some("memory")).ok_or("no cgroup v1 memory mount")?;
    let path = own_path(Some("memory")).ok_or("no memory entry in /proc/self/cgroup")?;
    let name = parent_name();
    let ours = own_dir(&mount, &path);
    remove_stale(&ours);
    let memory = ours.join(&name);
    std::fs::create_dir(&memory).map_err(|e| format!("{}: {e}", memory.display()))?;
    // Child cgroups must count their descendants (the default on recent
    // kernels; refused on some, where it is already on).
    let _ = write(&memory.join("memory.use_hierarchy"), "1");
    let pids = find_mount("cgroup", Some("pids")).and_then(|m| {
        let ours = own_dir(&m, &own_path(Some("pids"))?);
        remove_stale(&ours);
        let dir = ours.join(&name);
        std::fs::create_dir(&dir).ok().map(|()| dir)
    });
    Ok(RunLimits::CgroupV1 { memory, pids })
}

impl Cgroups {
    /// Finds the best mechanism this host allows (see the module docs).
    pub(crate) fn detect() -> Cgroups {
        let mode = match try_v2() {
            Ok(dir) => RunLimits::CgroupV2(dir),
            Err(v2) => match try_v1() {
                Ok(mode) => mode,
                Err(v1) => RunLimits::Rlimits(format!("{v2}; {v1}")),
            },
        };
        let dirs = match &mode {
            RunLimits::CgroupV2(d) => vec![d.clone()],
            RunLimits::CgroupV1 { memory, pids } => {
                std::iter::once(memory).chain(pids).cloned().collect()
            }
            RunLimits::Rlimits(_) => Vec::new(),
        };
        Cgroups {
            mode,
            next: AtomicU64::new(0),
            parent: Arc::new(ParentDirs(dirs)),
        }
    }

    pub(crate) fn mode(&self) -> &RunLimits {
        &self.mode
    }

    /// A fresh cgroup limited to `memory_bytes` and `max_pids`; None in
    /// the fallback mode.
    pub(crate) fn create(&self, memory_bytes: u64, max_pids: u64) -> io::Result<Option<RunCgroup>> {
        let Some(cg) = self.create_dirs("run")? else {
            return Ok(None);
        };
        if cg.v2 {
            write(&cg.dirs[0].join("pids.max"), &max_pids.to_string())?;
            let _ = write(&cg.dirs[0].join("memory.swap.max"), "0");
            let _ = write(&cg.dirs[0].join("memory.oom.group"), "1");
        } else if let Some(pids) = cg.dirs.get(1) {
            write(&pids.join("pids.max"), &max_pids.to_string())?;
        }
        cg.set_memory(memory_bytes)?;
        Ok(Some(cg))
    }

    /// A fresh cgroup without limits (one per hierarchy we use), named
    /// `PREFIX-N`; None in the fallback mode.
    fn create_dirs(&self, prefix: &str) -> io::Result<Option<RunCgroup>> {
        let name = format!("{prefix}-{}", self.next.fetch_add(1, Ordering::Relaxed));
        let (v2, parents): (bool, Vec<&PathBuf>) = match &self.mode {
            RunLimits::Rlimits(_) => return Ok(None),
            RunLimits::CgroupV2(parent) => (true, vec![parent]),
            RunLimits::CgroupV1 { memory, pids } => {
                (false, std::iter::once(memory).chain(pids).collect())
            }
        };
        let mut cg = RunCgroup {
            v2,
            dirs: Vec::new(),
            _parent: self.parent.clone(),
        };
        for p in parents {
            let dir = p.join(&name);
            std::fs::create_dir(&dir)?;
            // Pushed at once: dropping `cg` on a later error removes it.
            cg.dirs.push(dir);
        }
        Ok(Some(cg))
    }
}

/// A cgroup for a program run on the host (the tasks `command` agent),
/// so that every process it starts — including one that calls `setsid` or
/// double-forks out of its process group — can be killed when it is done.
///
/// The program joins the cgroup between `fork` and `exec`, before it can
/// start anything. Where no cgroup is writable ([`RunLimits::Rlimits`]),
/// nothing is tracked: callers fall back to killing the program's process
/// group, which a process that left the group survives.
#[derive(Debug)]
pub struct HostCgroup {
    cgroup: Option<RunCgroup>,
    /// `cgroup.procs` of each hierarchy, open for the child to write `0`.
    procs: Vec<std::fs::File>,
    mode: RunLimits,
}

/// The cgroup parent of host programs, shared by the whole process.
fn host_cgroups() -> &'static Cgroups {
    static HOST: std::sync::OnceLock<Cgroups> = std::sync::OnceLock::new();
    HOST.get_or_init(Cgroups::detect)
}

impl HostCgroup {
    /// A fresh, empty cgroup (or the fallback, with the reason).
    pub fn new() -> HostCgroup {
        let cgroups = host_cgroups();
        let made = cgroups.create_dirs("host").and_then(|cg| {
            let procs = cg
                .iter()
                .flat_map(|c| &c.dirs)
                .map(|d| {
                    std::fs::OpenOptions::new()
                        .write(true)
                        .open(d.join("cgroup.procs"))
                })
                .collect::<io::Result<Vec<_>>>()?;
            Ok((cg, procs))
        });
        match made {
            Ok((Some(cg), procs)) => HostCgroup {
                cgroup: Some(cg),
                procs,
                mode: cgroups.mode().clone(),
            },
            Ok((None, _)) => HostCgroup {
                cgroup: None,
                procs: Vec::new(),
                mode: cgroups.mode().clone(),
            },
            Err(e) => {
                tracing::warn!("no cgroup for a host program ({e}): its process group only");
                HostCgroup {
                    cgroup: None,
                    procs: Vec::new(),
                    mode: RunLimits::Rlimits(format!("creating a cgroup: {e}")),
                }
            }
        }
    }

    /// How this cgroup tracks processes (`Rlimits`: it does not).
    pub fn mode(&self) -> &RunLimits {
        &self.mode
    }

    /// Whether processes are tracked (a cgroup could be made).
    pub fn is_tracking(&self) -> bool {
        self.cgroup.is_some()
    }

    /// Makes `cmd`'s process join this cgroup after `fork`, before `exec`
    /// (a failure to join fails the spawn). No-op in the fallback mode.
    pub fn attach(&self, cmd: &mut std::process::Command) {
        use std::os::fd::AsRawFd;
        use std::os::unix::process::CommandExt;
        let fds: Vec<i32> = self.procs.iter().map(|f| f.as_raw_fd()).collect();
        if fds.is_empty() {
            return;
        }
        // SAFETY: the closure only calls write(2) (async-signal-safe) on
        // descriptors that stay open for as long as `self` lives, which
        // spans the spawn; it allocates nothing.
        unsafe {
            cmd.pre_exec(move || {
                for fd in &fds {
                    // "0": the writing process itself.
                    if libc::write(*fd, b"0".as_ptr().cast(), 1) != 1 {
                        return Err(io::Error::last_os_error());
                    }
                }
                Ok(())
            });
        }
    }

    /// SIGKILL to every process in the cgroup, repeated until it is empty
    /// (at most `wait`); returns how many processes were signalled.
    pub fn kill_all(&self, wait: Duration) -> usize {
        match &self.cgroup {
            Some(cg) => cg.kill_all(wait),
            None => 0,
        }
    }
}

impl Drop for HostCgroup {
    /// Nothing the program started outlives this value.
    fn drop(&mut self) {
        self.kill_all(Duration::from_secs(2));
    }
}

impl Default for HostCgroup {
    fn default() -> Self {
        HostCgroup::new()
    }
}

/// One sandbox's cgroup (one per controller hierarchy in v1); removed on
/// drop once its processes are gone.
#[derive(Debug)]
pub(crate) struct RunCgroup {
    v2: bool,
    /// The memory (or v2) directory first.
    dirs: Vec<PathBuf>,
    /// Keeps the parent directory until this cgroup is removed.
    _parent: Arc<ParentDirs>,
}

impl RunCgroup {
    /// Moves `pid` (and so everything it will start) into the cgroup.
    pub(crate) fn add(&self, pid: i32) -> io::Result<()> {
        for d in &self.dirs {
            write(&d.join("cgroup.procs"), &pid.to_string())?;
        }
        Ok(())
    }

    /// Sets the memory limit (also between runs of a warm worker).
    pub(crate) fn set_memory(&self, bytes: u64) -> io::Result<()> {
        let dir = &self.dirs[0];
        if self.v2 {
            write(&dir.join("memory.max"), &bytes.to_string())
        } else {
            // memsw (memory + swap) must stay >= memory: order matters.
            let memsw = dir.join("memory.memsw.limit_in_bytes");
            let has_memsw = memsw.exists();
            if has_memsw {
                let _ = write(&memsw, "-1");
            }
            write(&dir.join("memory.limit_in_bytes"), &bytes.to_string())?;
            if has_memsw {
                write(&memsw, &bytes.to_string())?;
            }
            Ok(())
        }
    }

    /// How many times the kernel's OOM killer has fired in this cgroup.
    pub(crate) fn oom_kills(&self) -> u64 {
        let file = if self.v2 {
            "memory.events"
        } else {
            "memory.oom_control"
        };
        std::fs::read_to_string(self.dirs[0].join(file))
            .ok()
            .and_then(|t| {
                t.lines().find_map(|l| {
                    l.strip_prefix("oom_kill ")
                        .and_then(|n| n.trim().parse().ok())
                })
            })
            .unwrap_or(0)
    }
}

/// The pids listed in `dir/cgroup.procs`.
fn procs_of(dir: &Path) -> Vec<i32> {
    std::fs::read_to_string(dir.join("cgroup.procs"))
        .map(|t| t.lines().filter_map(|l| l.trim().parse().ok()).collect())
        .unwrap_or_default()
}

/// SIGKILL to the process `pid` still is once its pid has been seen again
/// in the cgroup after we took hold of it (a pidfd), so a pid reused by an
/// unrelated process is never signalled.
fn kill_member(dir: &Path, pid: i32) -> bool {
    // SAFETY: pidfd_open takes a pid and flags; returns a new descriptor.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    if fd < 0 {
        if std::io::Error::last_os_error().raw_os_error() == Some(libc::ENOSYS) {
            // Before Linux 5.3: a plain kill (the pid was just listed).
            // SAFETY: kill(2), no memory involved.
            return unsafe { libc::kill(pid, libc::SIGKILL) } == 0;
        }
        return false; // gone already
    }
    // SAFETY: a descriptor just returned by pidfd_open, owned from here on.
    let fd = unsafe { <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd as i32) };
    if !procs_of(dir).contains(&pid) {
        return false;
    }
    use std::os::fd::AsRawFd;
    // SAFETY: pidfd_send_signal on our pidfd, no siginfo.
    let r = unsafe {
        libc::syscall(
            libc::SYS_pidfd_send_signal,
            fd.as_raw_fd(),
            libc::SIGKILL,
            std::ptr::null::<libc::siginfo_t>(),
            0u32,
        )
    };
    r == 0
}

impl RunCgroup {
    /// Kills every process in the cgroup: `cgroup.kill` on cgroup v2
    /// (Linux 5.14+), else SIGKILL to each pid in `cgroup.procs`, round
    /// after round until none is left (a process forked mid-round is in
    /// the next) or `wait` has passed. Returns how many were signalled.
    pub(crate) fn kill_all(&self, wait: Duration) -> usize {
        let dir = &self.dirs[0];
        let deadline = std::time::Instant::now() + wait;
        let mut signalled = 0;
        let mut group_killed = false;
        loop {
            let pids = procs_of(dir);
            if pids.is_empty() {
                return signalled;
            }
            if self.v2 && !group_killed {
                group_killed = write(&dir.join("cgroup.kill"), "1").is_ok();
                if group_killed {
                    signalled += pids.len();
                }
            }
            if !group_killed {
                signalled += pids.iter().filter(|p| kill_member(dir, **p)).count();
            }
            if std::time::Instant::now() >= deadline {
                tracing::warn!(
                    "processes still in {} after {wait:?}: {:?}",
                    dir.display(),
                    procs_of(dir)
                );
                return signalled;
            }
            std::thread::sleep(Duration::from_millis(2));
        }
    }
}

impl Drop for RunCgroup {
    fn drop(&mut self) {
        for d in &self.dirs {
            // Processes of a killed namespace take a moment to leave.
            let mut tries = 0;
            while let Err(e) = std::fs::remove_dir(d) {
                tries += 1;
                if tries > 50 {
                    tracing::warn!("could not remove cgroup {}: {e}", d.display());
                    break;
                }
                std::thread::sleep(Duration::from_millis(2));
            }
        }
    }
}
