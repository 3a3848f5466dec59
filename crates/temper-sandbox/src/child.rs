//! Code that runs in the cloned child, between `clone` and `execve`.
//!
//! The parent may be multi-threaded (a tokio server), and `clone` copies
//! only the calling thread: a lock another thread held (the allocator's,
//! stdio's) stays locked forever in the child. So everything here was
//! prepared by the parent ([`Plan`]) and this file only issues system calls
//! on borrowed `CStr`s: no allocation, no formatting, no panics. Errors go
//! back over a pipe as `(stage, errno)`.

use std::ffi::CString;
use std::os::raw::{c_char, c_int};

use nix::mount::{mount, umount2, MntFlags, MsFlags};
use nix::sys::resource::{setrlimit, Resource};
use nix::unistd::pivot_root;
use seccompiler::BpfProgram;

/// The uid and gid of the sandbox user inside its namespace.
pub(crate) const INNER_ID: u32 = 1000;

/// Fixed descriptor numbers inside the child.
const FD_SYNC: c_int = 3;
const FD_STATUS: c_int = 4;
/// The optional extra descriptor (program's fd 3) while in init.
const FD_EXTRA: c_int = 5;
/// First descriptor of the opened bind sources.
pub(crate) const FD_BINDS: c_int = 6;
/// At most this many read-only binds.
pub(crate) const MAX_BINDS: usize = 32;

/// Message tags on the status pipe: `[tag, a: i32 LE, b: i32 LE]`.
pub(crate) const MSG_SETUP_ERROR: u8 = 0;
pub(crate) const MSG_EXITED: u8 = 1;
pub(crate) const MSG_LEN: usize = 9;

/// Setup stages, reported by index.
pub(crate) const STAGES: &[&str] = &[
    "wait for uid map",       // 0
    "setresgid",              // 1
    "setresuid",              // 2
    "make mounts private",    // 3
    "mkdir",                  // 4
    "symlink",                // 5
    "mount tmpfs",            // 6
    "bind mount",             // 7
    "make bind read-only",    // 8
    "create device node",     // 9
    "mount proc",             // 10
    "write file",             // 11
    "pivot_root",             // 12
    "detach old root",        // 13
    "make root read-only",    // 14
    "fork program",           // 15
    "set rlimit",             // 16
    "chdir to work dir",      // 17
    "install seccomp filter", // 18
    "execve",                 // 19
];

/// One step of building the new root, in order.
#[derive(Debug, Clone)]
pub(crate) enum Step {
    Mkdir(CString),
    Symlink {
        target: CString,
        link: CString,
    },
    Tmpfs {
        path: CString,
        options: CString,
    },
    /// Recursive bind of `Plan::bind_sources[index]`, then read-only +
    /// nosuid + nodev on the whole tree.
    BindReadOnly {
        index: usize,
        target: CString,
    },
    /// Bind one device node onto an empty file.
    BindDevice {
        source: CString,
        target: CString,
    },
    Proc(CString),
    WriteFile {
        path: CString,
        data: Vec<u8>,
        mode: u32,
    },
}

/// Everything the child needs, built by the parent before `clone`.
pub(crate) struct Plan<'a> {
    /// `[start, end)` of the parent's argument and environment blocks (the
    /// strings `/proc/PID/cmdline` and `environ` show), blanked in the
    /// child's copy of the address space.
    pub host_blocks: [(u64, u64); 2],
    /// Where the new root's tmpfs is mounted before `pivot_root`.
    pub staging: CString,
    pub system_steps: &'a [Step],
    /// Host directories to bind read-only. Opened (`O_PATH`) before we drop
    /// to the sandbox user, so paths under e.g. `/root` (mode 0700) still
    /// work, and bound from `/proc/self/fd/N` (`bind_fd_paths`).
    pub bind_sources: &'a [CString],
    pub bind_fd_paths: &'a [CString],
    pub request_steps: Vec<Step>,
    pub hostname: &'a str,
    /// `PR_SET_PDEATHSIG(SIGKILL)` towards the creating thread.
    pub die_with_thread: bool,
    pub rlimits: Vec<(Resource, u64, u64)>,
    pub work_dir: CString,
    pub filters: &'a [BpfProgram],
    pub exe: CString,
    pub argv: Vec<*const c_char>,
    pub envp: Vec<*const c_char>,
    /// Parent-side descriptors: stdin read, stdout write, stderr write,
    /// sync read, status write, extra (-1 = none).
    pub fds: [c_int; 6],
}

fn errno() -> i32 {
    nix::errno::Errno::last_raw()
}

fn report(stage: u8, err: i32) {
    let mut msg = [0u8; MSG_LEN];
    msg[0] = MSG_SETUP_ERROR;
    msg[1..5].copy_from_slice(&(stage as i32).to_le_bytes());
    msg[5..9].copy_from_slice(&err.to_le_bytes());
    // SAFETY: writing a stack buffer to a descriptor we own.
    unsafe { libc::write(FD_STATUS, msg.as_ptr().cast(), MSG_LEN) };
}

fn fail(stage: u8, err: i32) -> ! {
    report(stage, err);
    // SAFETY: `_exit` is async-signal-safe and skips atexit handlers.
    unsafe { libc::_exit(100) }
}

fn check<T>(stage: u8, r: nix::Result<T>) -> T {
    match r {
        Ok(v) => v,
        Err(e) => fail(stage, e as i32),
    }
}

fn check_raw(stage: u8, r: libc::c_long) {
    if r < 0 {
        fail(stage, errno());
    }
}

const NONE: Option<&'static std::ffi::CStr> = None;

#[repr(C)]
struct MountAttr {
    attr_set: u64,
    attr_clr: u64,
    propagation: u64,
    userns_fd: u64,
}
const MOUNT_ATTR_RDONLY: u64 = 0x1;
const MOUNT_ATTR_NOSUID: u64 = 0x2;
const MOUNT_ATTR_NODEV: u64 = 0x4;
const AT_RECURSIVE: libc::c_uint = 0x8000;

/// Read-only + nosuid + nodev on `path` (and, if `recursive`, every mount
/// below it). Falls back to a single `MS_REMOUNT` on kernels before 5.12.
fn make_read_only(path: &std::ffi::CStr, recursive: bool) -> Result<(), i32> {
    let attr = MountAttr {
        attr_set: MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV,
        attr_clr: 0,
        propagation: 0,
        userns_fd: 0,
    };
    let flags = if recursive { AT_RECURSIVE } else { 0 };
    // SAFETY: valid path and attr struct of the size we pass.
    let r = unsafe {
        libc::syscall(
            libc::SYS_mount_setattr,
            libc::AT_FDCWD,
            path.as_ptr(),
            flags,
            &attr as *const MountAttr,
            std::mem::size_of::<MountAttr>(),
        )
    };
    if r == 0 {
        return Ok(());
    }
    if errno() != libc::ENOSYS {
        return Err(errno());
    }
    mount(
        NONE,
        path,
        NONE,
        MsFlags::MS_BIND
            | MsFlags::MS_REMOUNT
            | MsFlags::MS_RDONLY
            | MsFlags::MS_NOSUID
            | MsFlags::MS_NODEV,
        NONE,
    )
    .map_err(|e| e as i32)
}

fn write_all(fd: c_int, mut data: &[u8]) -> Result<(), i32> {
    while !data.is_empty() {
        // SAFETY: valid buffer and length.
        let n = unsafe { libc::write(fd, data.as_ptr().cast(), data.len()) };
        if n < 0 {
            if errno() == libc::EINTR {
                continue;
            }
            return Err(errno());
        }
        data = &data[n as usize..];
    }
    Ok(())
}

fn run_step(plan: &Plan, step: &Step) {
    match step {
        Step::Mkdir(path) => {
            // SAFETY: valid C string.
            if unsafe { libc::mkdir(path.as_ptr(), 0o755) } != 0 && errno() != libc::EEXIST {
                fail(4, errno());
            }
        }
        Step::Symlink { target, link } => {
            // SAFETY: valid C strings.
            check_raw(5, unsafe { libc::symlink(target.as_ptr(), link.as_ptr()) }
                as _);
        }
        Step::Tmpfs { path, options } => check(
            6,
            mount(
                Some(c"tmpfs"),
                path.as_c_str(),
                Some(c"tmpfs"),
                MsFlags::MS_NOSUID | MsFlags::MS_NODEV,
                Some(options.as_c_str()),
            ),
        ),
        Step::BindReadOnly { index, target } => {
            let Some(source) = plan.bind_fd_paths.get(*index) else {
                fail(7, libc::EINVAL)
            };
            check(
                7,
                mount(
                    Some(source.as_c_str()),
                    target.as_c_str(),
                    NONE,
                    MsFlags::MS_BIND | MsFlags::MS_REC,
                    NONE,
                ),
            );
            if let Err(e) = make_read_only(target, true) {
                fail(8, e);
            }
        }
        Step::BindDevice { source, target } => {
            // SAFETY: valid C string; the descriptor is closed right away.
            let fd = unsafe {
                libc::open(
                    target.as_ptr(),
                    libc::O_WRONLY | libc::O_CREAT | libc::O_CLOEXEC,
                    0o644,
                )
            };
            check_raw(9, fd as _);
            // SAFETY: fd was just opened.
            unsafe { libc::close(fd) };
            check(
                9,
                mount(
                    Some(source.as_c_str()),
                    target.as_c_str(),
                    NONE,
                    MsFlags::MS_BIND,
                    NONE,
                ),
            );
        }
        Step::Proc(path) => check(
            10,
            mount(
                Some(c"proc"),
                path.as_c_str(),
                Some(c"proc"),
                MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC,
                NONE,
            ),
        ),
        Step::WriteFile { path, data, mode } => {
            // SAFETY: valid C string.
            let fd = unsafe {
                libc::open(
                    path.as_ptr(),
                    libc::O_WRONLY | libc::O_CREAT | libc::O_EXCL | libc::O_CLOEXEC,
                    *mode,
                )
            };
            check_raw(11, fd as _);
            let r = write_all(fd, data);
            // SAFETY: fd was just opened.
            unsafe { libc::close(fd) };
            if let Err(e) = r {
                fail(11, e);
            }
        }
    }
}

/// `ifconfig lo up`: the network namespace starts with loopback down.
/// Best effort: a sandbox without loopback still runs.
fn loopback_up() {
    #[repr(C)]
    struct IfReq {
        name: [c_char; libc::IFNAMSIZ],
        flags: libc::c_short,
        _pad: [u8; 22],
    }
    // SAFETY: socket takes integers; the descriptor is closed below.
    let sock = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if sock < 0 {
        return;
    }
    // SAFETY: `IfReq` is plain integers, for which all-zero bytes is valid.
    let mut req: IfReq = unsafe { std::mem::zeroed() };
    req.name[0] = b'l' as c_char;
    req.name[1] = b'o' as c_char;
    // SAFETY: SIOCGIFFLAGS reads the name from and writes the flags into a
    // `struct ifreq`; `req` has its layout (name, flags, padding to 40 bytes).
    if unsafe { libc::ioctl(sock, libc::SIOCGIFFLAGS, &mut req) } == 0 {
        req.flags |= libc::IFF_UP as libc::c_short;
        // SAFETY: as above; SIOCSIFFLAGS only reads `req`.
        unsafe { libc::ioctl(sock, libc::SIOCSIFFLAGS, &mut req) };
    }
    close(sock);
}

/// What the init's `/proc/1/cmdline` and `comm` say instead of the host's.
const INIT_NAME: &[u8] = b"sandbox-init\0";

/// Overwrites this process's copy of the host's argument and environment
/// blocks: `/proc/1/cmdline` (readable by anyone in the namespace, unlike
/// `environ` and `mem`) would otherwise show the host's full command line,
/// flags and paths included. The blocks stay their size (only the kernel
/// may move them), so cmdline reads `sandbox-init` and NULs.
///
/// # Safety
/// `blocks` must be ranges of writable memory of this process that nothing
/// here reads again (the parent's argv and environ strings: the child uses
/// only `plan`'s own copies).
unsafe fn blank_host_blocks(blocks: &[(u64, u64); 2]) {
    for (i, &(start, end)) in blocks.iter().enumerate() {
        let Ok(len) = usize::try_from(end.saturating_sub(start)) else {
            continue;
        };
        if len == 0 {
            continue;
        }
        let base = start as usize as *mut u8;
        // SAFETY: `[base, base + len)` is writable memory of ours that
        // nothing reads again (the caller's contract).
        unsafe { std::ptr::write_bytes(base, 0, len) };
        if i == 0 && len >= INIT_NAME.len() {
            // SAFETY: the block holds at least `INIT_NAME.len()` writable
            // bytes (checked above), and a static cannot overlap it.
            unsafe { std::ptr::copy_nonoverlapping(INIT_NAME.as_ptr(), base, INIT_NAME.len()) };
        }
    }
    // SAFETY: PR_SET_NAME reads a NUL-terminated string of at most 16
    // bytes; `INIT_NAME` is one and is static.
    unsafe { libc::prctl(libc::PR_SET_NAME, INIT_NAME.as_ptr()) };
}

/// `close(2)` on a descriptor number this child manages by hand. Nothing
/// in the child wraps descriptors in owning Rust types (see the module
/// doc), so closing one cannot invalidate an `OwnedFd`.
fn close(fd: c_int) {
    // SAFETY: close takes a plain integer; no Rust value owns `fd` here.
    unsafe { libc::close(fd) };
}

/// `close_range(first, MAX, flags)`: everything from `first` on.
fn close_from(first: u32, flags: libc::c_uint) {
    // SAFETY: close_range takes integers only; no Rust value in the child
    // owns a descriptor (see [`close`]).
    unsafe { libc::syscall(libc::SYS_close_range, first, u32::MAX, flags) };
}

/// `dup2(from, to)`, the errno on failure.
fn dup2(from: c_int, to: c_int) -> Result<(), i32> {
    // SAFETY: dup2 takes integers; `to` is one of the fixed numbers this
    // child assigns, which no Rust value owns (see [`close`]).
    if unsafe { libc::dup2(from, to) } < 0 {
        return Err(errno());
    }
    Ok(())
}

/// `prctl(option, arg)` for the options that take one integer.
fn prctl(option: c_int, arg: libc::c_ulong) {
    // SAFETY: every caller passes an option whose argument is an integer
    // (PDEATHSIG, DUMPABLE), not a pointer.
    unsafe { libc::prctl(option, arg) };
}

/// One byte from the sync pipe: `read(2)`'s return value.
fn read_sync(byte: &mut u8) -> isize {
    // SAFETY: `byte` is a valid, writable one-byte buffer.
    unsafe { libc::read(FD_SYNC, (byte as *mut u8).cast(), 1) }
}

/// `chdir(2)` to a NUL-terminated path.
fn chdir(path: &std::ffi::CStr) -> libc::c_long {
    // SAFETY: `path` is a valid NUL-terminated string.
    unsafe { libc::chdir(path.as_ptr()) as _ }
}

/// `waitpid(-1, .., 0)`: any child, blocking; `(pid or -1, status)`.
fn wait_any() -> (libc::pid_t, c_int) {
    let mut status = 0;
    // SAFETY: `status` is a valid, writable int.
    let r = unsafe { libc::waitpid(-1, &mut status, 0) };
    (r, status)
}

/// The child's entry point: becomes pid 1 of the new namespaces, builds the
/// root, forks the program, waits for it, kills what it left behind and
/// reports the exit status. Never returns.
pub(crate) fn main(plan: &Plan) -> ! {
    // SAFETY: `host_blocks` are the parent's argv/environ string blocks;
    // this child's copy of them is private (clone copied the address
    // space) and it reads only `plan`'s own copies of those strings.
    unsafe { blank_host_blocks(&plan.host_blocks) };
    // Our descriptors to fixed numbers 0..=4, everything else closed
    // (the parent's sockets and other sandboxes' pipes leak into clone).
    let mut high = [-1 as c_int; 6];
    for (i, fd) in plan.fds.iter().enumerate() {
        if *fd < 0 {
            continue;
        }
        // SAFETY: F_DUPFD_CLOEXEC takes an integer argument; `fd` is one
        // of the parent's pipe ends, inherited by clone.
        high[i] = unsafe { libc::fcntl(*fd, libc::F_DUPFD_CLOEXEC, 64) };
        if high[i] < 0 {
            // SAFETY: `_exit` is async-signal-safe and runs no handlers.
            unsafe { libc::_exit(101) };
        }
    }
    for (i, fd) in high.iter().enumerate() {
        if *fd >= 0 && dup2(*fd, i as c_int).is_err() {
            // SAFETY: as above.
            unsafe { libc::_exit(102) };
        }
    }
    for fd in [FD_SYNC, FD_STATUS] {
        // SAFETY: F_SETFD takes an integer argument.
        unsafe { libc::fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC) };
    }
    close_from(FD_BINDS as u32, 0);

    // Wait until the parent has written our uid/gid maps.
    let mut byte = 0u8;
    loop {
        let n = read_sync(&mut byte);
        if n == 1 {
            break;
        }
        if n < 0 && errno() == libc::EINTR {
            continue;
        }
        fail(0, if n < 0 { errno() } else { libc::EPIPE });
    }

    check(
        3,
        mount(
            NONE,
            c"/",
            NONE,
            MsFlags::MS_REC | MsFlags::MS_PRIVATE,
            NONE,
        ),
    );
    for (i, source) in plan.bind_sources.iter().enumerate() {
        // SAFETY: `source` is a valid NUL-terminated path; the new
        // descriptor is moved to its fixed number below.
        let fd = unsafe {
            libc::open(
                source.as_ptr(),
                libc::O_PATH | libc::O_DIRECTORY | libc::O_CLOEXEC,
            )
        };
        check_raw(7, fd as _);
        let want = FD_BINDS + i as c_int;
        if fd != want {
            if let Err(e) = dup2(fd, want) {
                fail(7, e);
            }
            close(fd);
        }
    }

    // Become the sandbox user. Capabilities in our namespace survive
    // (we were not uid 0 *inside* it) until `execve` drops them.
    // Raw system calls: glibc's wrappers broadcast the change to every
    // thread of the parent (setxid), which do not exist here, and hang.
    let id = INNER_ID as libc::c_long;
    // SAFETY: setgroups with size 0 reads no list (a null pointer is allowed).
    let _ = unsafe { libc::syscall(libc::SYS_setgroups, 0, std::ptr::null::<libc::gid_t>()) };
    // SAFETY: setresgid/setresuid take integers only.
    check_raw(1, unsafe { libc::syscall(libc::SYS_setresgid, id, id, id) });
    // SAFETY: as above.
    check_raw(2, unsafe { libc::syscall(libc::SYS_setresuid, id, id, id) });
    // One-shot runs die with the thread blocked in `run` (set after the
    // uid change, which clears it). Pool workers must not: the thread
    // that started one may be gone long before the worker.
    if plan.die_with_thread {
        prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as libc::c_ulong);
    }

    for step in plan.system_steps.iter().chain(plan.request_steps.iter()) {
        run_step(plan, step);
    }
    close_from(FD_BINDS as u32, 0);
    check_raw(12, chdir(&plan.staging));
    check(12, pivot_root(c".", c"."));
    check(13, umount2(c".", MntFlags::MNT_DETACH));
    check_raw(13, chdir(c"/"));
    if let Err(e) = make_read_only(c"/", false) {
        fail(14, e);
    }
    let _ = nix::unistd::sethostname(plan.hostname);
    loopback_up();
    // Our memory holds the parent's environment: keep /proc/1/* closed.
    prctl(libc::PR_SET_DUMPABLE, 0);

    // A raw clone, not fork(3): glibc's fork runs atfork handlers that
    // take locks the parent's other threads may have held.
    // SAFETY: clone with SIGCHLD only and no stack behaves like fork; the
    // new process calls only `program`, which issues system calls on
    // `plan` and never returns.
    let pid = unsafe { libc::syscall(libc::SYS_clone, libc::SIGCHLD as libc::c_ulong, 0, 0, 0, 0) };
    if pid < 0 {
        fail(15, errno());
    }
    if pid == 0 {
        program(plan);
    }
    let pid = pid as libc::pid_t;

    // Init: close the output pipes so the parent sees EOF once the
    // program tree is gone, reap until the program exits.
    for fd in [0, 1, 2, FD_EXTRA] {
        close(fd);
    }
    let mut status = 0;
    loop {
        let (r, s) = wait_any();
        if r == pid {
            status = s;
            break;
        }
        if r < 0 && errno() != libc::EINTR {
            break;
        }
    }
    // Whatever the program left behind dies now.
    // SAFETY: kill takes integers; -1 signals every process this init
    // may signal, i.e. only those inside its pid namespace.
    unsafe { libc::kill(-1, libc::SIGKILL) };
    loop {
        let (r, _) = wait_any();
        if r < 0 && errno() != libc::EINTR {
            break;
        }
    }
    // Nothing of the program is left: let an unprivileged parent (same
    // uid) read /work through /proc/PID/root again.
    prctl(libc::PR_SET_DUMPABLE, 1);
    let mut msg = [0u8; MSG_LEN];
    msg[0] = MSG_EXITED;
    msg[1..5].copy_from_slice(&status.to_le_bytes());
    let _ = write_all(FD_STATUS, &msg);
    // Stay alive (keeping /work readable through /proc/PID/root) until
    // the parent closes the sync pipe.
    loop {
        let n = read_sync(&mut byte);
        if n == 0 || (n < 0 && errno() != libc::EINTR) {
            break;
        }
    }
    // SAFETY: `_exit` is async-signal-safe and runs no handlers.
    unsafe { libc::_exit(0) }
}

/// The program process (the init's forked child): limits, seccomp, exec.
fn program(plan: &Plan) -> ! {
    // SAFETY: SIG_DFL installs no handler code.
    unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
    // SAFETY: sigset_t is plain data for which all-zero bytes is valid;
    // sigemptyset then initialises it properly.
    let mut empty: libc::sigset_t = unsafe { std::mem::zeroed() };
    // SAFETY: `empty` is a valid, writable sigset_t.
    unsafe { libc::sigemptyset(&mut empty) };
    // SAFETY: `empty` is an initialised sigset_t; no old set is asked for.
    unsafe { libc::sigprocmask(libc::SIG_SETMASK, &empty, std::ptr::null_mut()) };
    prctl(libc::PR_SET_PDEATHSIG, 0);
    // SAFETY: setsid takes no arguments.
    unsafe { libc::setsid() };
    for (resource, soft, hard) in &plan.rlimits {
        check(16, setrlimit(*resource, *soft, *hard));
    }
    check_raw(17, chdir(&plan.work_dir));
    close_from(3, libc::CLOSE_RANGE_CLOEXEC);
    if plan.fds[5] >= 0 {
        // The extra descriptor becomes fd 3 and survives execve.
        if let Err(e) = dup2(FD_EXTRA, 3) {
            fail(19, e);
        }
        close(FD_EXTRA);
    }
    for filter in plan.filters {
        if let Err(e) = seccompiler::apply_filter(filter) {
            let code = match e {
                seccompiler::Error::Prctl(io) | seccompiler::Error::Seccomp(io) => {
                    io.raw_os_error().unwrap_or(libc::EINVAL)
                }
                _ => libc::EINVAL,
            };
            fail(18, code);
        }
    }
    // SAFETY: `exe` is NUL-terminated, and the parent built `argv` and
    // `envp` as null-terminated arrays of pointers into strings `plan`
    // keeps alive until after this call.
    unsafe { libc::execve(plan.exe.as_ptr(), plan.argv.as_ptr(), plan.envp.as_ptr()) };
    fail(19, errno())
}
