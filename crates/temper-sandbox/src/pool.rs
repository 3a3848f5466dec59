//! The warm pool: sandboxes whose program is a Python zygote that forks once
//! per request, so a run costs a fork instead of namespaces + interpreter.
//!
//! Each worker is an ordinary [`Sandbox`] child (same namespaces, rlimits,
//! seccomp) running `zygote.py`, one request at a time. Between runs the
//! zygote kills every process the run left and empties `/work`, `/tmp` and
//! `/dev/shm`. The zygote enforces each run's timeout itself (the worker
//! survives it); a worker that dies or stops answering is killed (its pid
//! namespace with it) and replaced, and every worker is recycled after
//! `max_runs_per_worker` runs.

use std::io::IoSlice;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::time::{Duration, Instant};

use nix::fcntl::{fcntl, FcntlArg, OFlag};
use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use nix::sys::socket::{
    recvmsg, sendmsg, socketpair, AddressFamily, ControlMessage, ControlMessageOwned, MsgFlags,
    SockFlag, SockType,
};
use nix::unistd::pipe2;

use crate::sandbox::{
    check_files, drain, fetch_from_dir, relative_path, to_result, Outputs, Spawned, WORKER_SLACK_MB,
};
use crate::{ExecRequest, ExecResult, Language, Sandbox, SandboxError};

const ZYGOTE: &str = include_str!("zygote.py");
/// A requested file: the name the caller used, and the checked path.
pub(crate) type FetchPath = (String, std::path::PathBuf);

const START_TIMEOUT: Duration = Duration::from_secs(10);
const WORKER_SLACK: Duration = Duration::from_secs(2);

/// Warm-pool settings.
#[derive(Debug, Clone)]
pub struct PoolConfig {
    /// Most workers alive at once; a run waits when all are busy. Default:
    /// one per CPU.
    pub size: usize,
    /// A worker is replaced after this many runs.
    pub max_runs_per_worker: u32,
}

impl Default for PoolConfig {
    fn default() -> Self {
        PoolConfig {
            // One warm worker per CPU: more only queue inside the pool.
            size: std::thread::available_parallelism().map_or(1, |n| n.get()),
            max_runs_per_worker: 100,
        }
    }
}

pub(crate) struct Worker {
    /// Held for its `Drop`: dropping it kills the worker's namespace.
    init: Spawned,
    sock: OwnedFd,
    /// `O_PATH` handle on the worker's `/work`, sent by the zygote.
    work_dir: OwnedFd,
    runs: u32,
}

struct State {
    idle: Vec<Worker>,
    live: usize,
}

/// A pool of warm workers over one [`Sandbox`]; `run` is blocking and may
/// be called from many threads.
pub struct Pool {
    sandbox: Arc<Sandbox>,
    config: PoolConfig,
    state: Mutex<State>,
    freed: Condvar,
}

impl std::fmt::Debug for Pool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pool")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

fn host(what: &'static str) -> impl FnOnce(nix::errno::Errno) -> SandboxError {
    move |e| SandboxError::host(what, e)
}

/// Why a worker did not come up: its setup error, or its stderr.
fn start_failure(req: &ExecRequest, spawned: Spawned) -> SandboxError {
    let io = match drain(
        req,
        4096,
        None,
        Outputs {
            stdout: &spawned.stdout_r,
            stderr: &spawned.stderr_r,
            status: &spawned.status_r,
        },
        Instant::now(),
        None,
    ) {
        Ok(io) => io,
        Err(e) => return e,
    };
    match to_result(io, spawned.start, Default::default()) {
        Err(e) => e,
        Ok(r) => SandboxError::host(
            "start worker",
            std::io::Error::other(format!("zygote did not start: {}", r.stderr.trim())),
        ),
    }
}

/// Reads the zygote's ready byte and the `/work` descriptor sent with it.
fn recv_ready(
    sock: &OwnedFd,
    byte: &mut [u8; 1],
) -> Result<(usize, Option<OwnedFd>), SandboxError> {
    use std::os::fd::FromRawFd;
    let mut iov = [std::io::IoSliceMut::new(byte)];
    let mut space = nix::cmsg_space!([std::os::fd::RawFd; 1]);
    let msg = recvmsg::<()>(
        sock.as_raw_fd(),
        &mut iov,
        Some(&mut space),
        MsgFlags::MSG_CMSG_CLOEXEC,
    )
    .map_err(host("read zygote"))?;
    let mut dir = None;
    for cmsg in msg.cmsgs().map_err(host("read zygote"))? {
        if let ControlMessageOwned::ScmRights(fds) = cmsg {
            for fd in fds {
                // SAFETY: the kernel just installed this descriptor for us.
                let owned = unsafe { OwnedFd::from_raw_fd(fd) };
                dir.get_or_insert(owned);
            }
        }
    }
    Ok((msg.bytes, dir))
}

impl Worker {
    /// The `O_PATH` handle on this worker's `/work`.
    pub(crate) fn work_dir(&self) -> &OwnedFd {
        &self.work_dir
    }
}

impl Pool {
    /// The sandbox the workers are built from.
    pub fn sandbox(&self) -> &Arc<Sandbox> {
        &self.sandbox
    }

    /// Starts `config.size` workers.
    pub fn new(sandbox: Arc<Sandbox>, config: PoolConfig) -> Result<Self, SandboxError> {
        if config.size == 0 {
            return Err(SandboxError::InvalidRequest("pool size must be > 0".into()));
        }
        let pool = Pool {
            sandbox,
            config,
            state: Mutex::new(State {
                idle: Vec::new(),
                live: 0,
            }),
            freed: Condvar::new(),
        };
        let workers = (0..pool.config.size)
            .map(|_| start_worker(&pool.sandbox))
            .collect::<Result<Vec<_>, _>>()?;
        let mut state = pool.lock();
        state.live = workers.len();
        state.idle = workers;
        drop(state);
        Ok(pool)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Takes an idle worker, starts one if below `size`, else waits.
    fn checkout(&self) -> Result<Worker, SandboxError> {
        let mut state = self.lock();
        loop {
            if let Some(w) = state.idle.pop() {
                return Ok(w);
            }
            if state.live < self.config.size {
                state.live += 1;
                drop(state);
                let worker = start_worker(&self.sandbox);
                if worker.is_err() {
                    self.lock().live -= 1;
                    self.freed.notify_one();
                }
                return worker;
            }
            state = self
                .freed
                .wait(state)
                .unwrap_or_else(PoisonError::into_inner);
        }
    }

    fn checkin(&self, worker: Option<Worker>) {
        let mut state = self.lock();
        match worker {
            Some(w) if w.runs < self.config.max_runs_per_worker => state.idle.push(w),
            _ => state.live -= 1,
        }
        drop(state);
        self.freed.notify_one();
    }

    /// Runs `req` on a warm worker (same isolation and result as
    /// [`Sandbox::run`]; the memory limit is capped at the sandbox default).
    pub fn run(&self, req: &ExecRequest) -> Result<ExecResult, SandboxError> {
        if req.timeout.is_zero() {
            return Err(SandboxError::InvalidRequest("timeout must be > 0".into()));
        }
        let (frame, fetch) = encode(self.sandbox.config(), req, true)?;
        let mut worker = self.checkout()?;
        worker.runs += 1;
        let outcome = exec(&self.sandbox, &mut worker, req, &frame, &fetch);
        let keep = matches!(&outcome, Ok((_, true)));
        self.checkin(keep.then_some(worker));
        if !keep {
            // Heal now: the next request finds the pool at full size.
            self.replenish();
        }
        outcome.and_then(|(result, _)| result)
    }

    /// Starts a worker when fewer than `size` are alive.
    fn replenish(&self) {
        let mut state = self.lock();
        if state.live >= self.config.size {
            return;
        }
        state.live += 1;
        drop(state);
        match start_worker(&self.sandbox) {
            Ok(w) => self.lock().idle.push(w),
            Err(e) => {
                tracing::warn!("could not replace a sandbox worker: {e}");
                self.lock().live -= 1;
            }
        }
        self.freed.notify_one();
    }

    /// Workers alive now (busy or idle); `size` once the pool has healed.
    pub fn workers(&self) -> usize {
        self.lock().live
    }

    /// Workers idle now.
    pub fn idle_workers(&self) -> usize {
        self.lock().idle.len()
    }
}

/// Starts one worker: a sandbox running the zygote.
pub(crate) fn start_worker(sandbox: &Sandbox) -> Result<Worker, SandboxError> {
    let bash = sandbox.interpreter(Language::Bash)?;
    let mut req = ExecRequest::new(
        Language::Python,
        ZYGOTE.replace("@BASH@", &bash.exe.to_string_lossy()),
    );
    req.timeout = Duration::from_secs(1);
    let (ours, theirs) = socketpair(
        AddressFamily::Unix,
        SockType::Stream,
        None,
        SockFlag::SOCK_CLOEXEC,
    )
    .map_err(host("socketpair"))?;
    let spawned = sandbox.spawn(&req, Some(&theirs))?;
    drop(theirs);
    // Wait for the zygote's ready byte.
    let mut fds = [PollFd::new(ours.as_fd(), PollFlags::POLLIN)];
    let ms = u16::try_from(START_TIMEOUT.as_millis()).unwrap_or(u16::MAX);
    poll(&mut fds, PollTimeout::from(ms)).map_err(host("poll zygote"))?;
    let mut byte = [0u8; 1];
    let (n, work_dir) = if fds[0]
        .revents()
        .is_some_and(|r| r.contains(PollFlags::POLLIN))
    {
        recv_ready(&ours, &mut byte)?
    } else {
        (0, None)
    };
    let work_dir = match work_dir {
        Some(dir) if n == 1 && byte[0] == b'R' => dir,
        _ => return Err(start_failure(&req, spawned)),
    };
    Ok(Worker {
        init: spawned,
        sock: ours,
        work_dir,
        runs: 0,
    })
}

/// The zygote request for `req`; `clean` empties the work dirs first.
pub(crate) fn encode(
    config: &crate::SandboxConfig,
    req: &ExecRequest,
    clean: bool,
) -> Result<(Vec<u8>, Vec<FetchPath>), SandboxError> {
    if req.timeout.is_zero() {
        return Err(SandboxError::InvalidRequest("timeout must be > 0".into()));
    }
    let limits = &config.limits;
    let mem_mb = req
        .memory_limit_mb
        .unwrap_or(limits.memory_mb)
        .min(limits.memory_mb);
    if mem_mb == 0 {
        return Err(SandboxError::InvalidRequest(
            "memory_limit_mb must be > 0".into(),
        ));
    }
    let len32 = |n: usize| {
        u32::try_from(n).map_err(|_| SandboxError::InvalidRequest("request too large".into()))
    };
    let timeout_ms = u32::try_from(req.timeout.as_millis())
        .map_err(|_| SandboxError::InvalidRequest("timeout too large".into()))?
        .max(1);
    let mut body = Vec::with_capacity(req.code.len() + 64);
    body.push(match req.language {
        Language::Python => 0u8,
        Language::Bash => 1u8,
    });
    body.push(u8::from(clean));
    body.extend_from_slice(&timeout_ms.to_le_bytes());
    body.extend_from_slice(&mem_mb.saturating_mul(1024 * 1024).to_le_bytes());
    body.extend_from_slice(&len32(req.code.len())?.to_le_bytes());
    body.extend_from_slice(req.code.as_bytes());
    body.extend_from_slice(&len32(req.files.len())?.to_le_bytes());
    let rels = check_files(req.files.keys())?;
    for (rel, data) in rels.iter().zip(req.files.values()) {
        let rel = rel.to_string_lossy();
        body.extend_from_slice(&len32(rel.len())?.to_le_bytes());
        body.extend_from_slice(rel.as_bytes());
        body.extend_from_slice(&len32(data.len())?.to_le_bytes());
        body.extend_from_slice(data);
    }
    let fetch = req
        .fetch_files
        .iter()
        .map(|p| relative_path(p).map(|rel| (p.clone(), rel)))
        .collect::<Result<Vec<_>, _>>()?;
    let mut frame = len32(body.len())?.to_le_bytes().to_vec();
    frame.extend_from_slice(&body);
    Ok((frame, fetch))
}

/// One request on one worker; the bool says whether the worker may be
/// reused.
pub(crate) fn exec(
    sandbox: &Sandbox,
    worker: &mut Worker,
    req: &ExecRequest,
    frame: &[u8],
    fetch: &[FetchPath],
) -> Result<(Result<ExecResult, SandboxError>, bool), SandboxError> {
    let pipe = || pipe2(OFlag::O_CLOEXEC).map_err(host("pipe"));
    let (stdin_r, stdin_w) = pipe()?;
    let (stdout_r, stdout_w) = pipe()?;
    let (stderr_r, stderr_w) = pipe()?;
    fcntl(worker.sock.as_fd(), FcntlArg::F_SETFL(OFlag::empty())).map_err(host("fcntl"))?;
    let fds = [
        stdin_r.as_raw_fd(),
        stdout_w.as_raw_fd(),
        stderr_w.as_raw_fd(),
    ];
    if let Some(cg) = &worker.init.cgroup {
        // This run's limit (and the zygote's slack) for the whole worker.
        let limits = &sandbox.config().limits;
        let mib = 1024 * 1024;
        let mb = req
            .memory_limit_mb
            .unwrap_or(limits.memory_mb)
            .min(limits.memory_mb)
            .saturating_add(WORKER_SLACK_MB);
        if let Err(e) = cg.set_memory(mb.saturating_mul(mib)) {
            // Below what the worker holds now (the last run's files are
            // emptied only when this one starts): the server's limit for
            // this run, with RLIMIT_AS still at the requested size.
            tracing::debug!("run memory limit {mb} MiB not settable now: {e}");
            let max = limits.memory_mb.saturating_add(WORKER_SLACK_MB);
            cg.set_memory(max.saturating_mul(mib))
                .map_err(|e| SandboxError::host("set the run's memory limit", e))?;
        }
    }
    let start = Instant::now();
    let sent = sendmsg::<()>(
        worker.sock.as_raw_fd(),
        &[IoSlice::new(frame)],
        &[ControlMessage::ScmRights(&fds)],
        MsgFlags::empty(),
        None,
    )
    .map_err(host("send to zygote"))?;
    let mut rest = &frame[sent..];
    while !rest.is_empty() {
        let n = nix::unistd::write(&worker.sock, rest).map_err(host("send to zygote"))?;
        rest = &rest[n..];
    }
    drop((stdin_r, stdout_w, stderr_w));
    // The zygote enforces the timeout and reports it; our deadline is a
    // backstop for a stuck worker.
    let backstop = ExecRequest {
        timeout: req.timeout.saturating_add(WORKER_SLACK),
        ..req.clone()
    };
    let mut io = drain(
        &backstop,
        sandbox.config().limits.output_limit_bytes,
        Some(stdin_w),
        Outputs {
            stdout: &stdout_r,
            stderr: &stderr_r,
            status: &worker.sock,
        },
        start,
        worker.init.cgroup.as_ref(),
    )?;
    // A run that hit the memory limit takes its worker with it: the worker
    // is killed whole (on drop) and replaced.
    let healthy = io.wait_status.is_some() && io.setup_error.is_none() && !io.oom;
    io.worker_lost();
    let files = if healthy && !fetch.is_empty() {
        fetch_from_dir(
            &worker.work_dir,
            fetch,
            sandbox.config().limits.fetch_file_limit_bytes,
        )
    } else {
        Default::default()
    };
    Ok((to_result(io, start, files), healthy))
}
