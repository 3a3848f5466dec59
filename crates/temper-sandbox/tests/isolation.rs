//! The adversarial suite (issue 5): each test runs a hostile program and
//! checks that it is contained, that the result says what happened, and
//! that nothing is left running on the host afterwards.
//!
//! Tests share one `Sandbox` and run one at a time (a global lock), so the
//! "no leftover processes" check after each test sees only its own run.

use std::collections::BTreeMap;
use std::sync::{Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use temper_sandbox::{ExecRequest, ExecResult, ExecStatus, Language, Sandbox, SandboxConfig};

struct Env {
    sandbox: Option<Sandbox>,
    skip_reason: String,
    lock: Mutex<()>,
}

fn env() -> &'static Env {
    static ENV: OnceLock<Env> = OnceLock::new();
    ENV.get_or_init(|| {
        let probe = Sandbox::new(SandboxConfig::default()).and_then(|s| {
            s.run(&ExecRequest::new(Language::Bash, "true"))?;
            Ok(s)
        });
        match probe {
            Ok(s) => Env {
                sandbox: Some(s),
                skip_reason: String::new(),
                lock: Mutex::new(()),
            },
            Err(e) => Env {
                sandbox: None,
                skip_reason: e.to_string(),
                lock: Mutex::new(()),
            },
        }
    })
}

/// The shared sandbox and the suite lock, or `None` (with a printed
/// reason) on a host without user namespaces.
fn sandbox(test: &str) -> Option<(&'static Sandbox, MutexGuard<'static, ()>)> {
    let env = env();
    let guard = env.lock.lock().unwrap_or_else(|e| e.into_inner());
    match &env.sandbox {
        Some(s) => Some((s, guard)),
        None => {
            eprintln!(
                "SKIPPED {test}: namespaces unavailable on this host: {}",
                env.skip_reason
            );
            None
        }
    }
}

/// Every process below this test process (sandboxes are its children).
fn descendants() -> Vec<String> {
    let me = std::process::id().to_string();
    let mut parent_of = BTreeMap::new();
    for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let pid = entry.file_name().to_string_lossy().to_string();
        if !pid.chars().all(|c| c.is_ascii_digit()) {
            continue;
        }
        if let Ok(status) = std::fs::read_to_string(entry.path().join("status")) {
            let ppid = status
                .lines()
                .find_map(|l| l.strip_prefix("PPid:"))
                .map(|p| p.trim().to_string())
                .unwrap_or_default();
            let name = status
                .lines()
                .find_map(|l| l.strip_prefix("Name:"))
                .map(|p| p.trim().to_string())
                .unwrap_or_default();
            parent_of.insert(pid, (ppid, name));
        }
    }
    let mut out = Vec::new();
    for (pid, (_, name)) in &parent_of {
        let mut cur = pid.clone();
        let mut hops = 0;
        while let Some((ppid, _)) = parent_of.get(&cur) {
            if *ppid == me && pid != &me {
                out.push(format!("{pid} {name}"));
                break;
            }
            cur = ppid.clone();
            hops += 1;
            if hops > 64 {
                break;
            }
        }
    }
    // Threads of this test binary are not processes; the list holds only
    // real children (sandbox inits and what they forked).
    out
}

fn assert_no_leftovers() {
    let left = descendants();
    assert!(left.is_empty(), "processes left behind: {left:?}");
}

fn run(sb: &Sandbox, language: Language, code: &str, timeout_s: u64) -> ExecResult {
    let mut req = ExecRequest::new(language, code);
    req.timeout = Duration::from_secs(timeout_s);
    sb.run(&req).expect("sandbox run")
}

#[test]
fn python_print_round_trip() {
    let Some((sb, _g)) = sandbox("python_print_round_trip") else {
        return;
    };
    let r = run(sb, Language::Python, "print(1)", 10);
    assert_eq!(r.status, ExecStatus::Finished);
    assert_eq!(r.return_code, Some(0));
    assert_eq!(r.stdout, "1\n");
    assert_no_leftovers();
}

#[test]
fn exit_code_stderr_and_stdin() {
    let Some((sb, _g)) = sandbox("exit_code_stderr_and_stdin") else {
        return;
    };
    let mut req = ExecRequest::new(
        Language::Bash,
        "read x; echo \"got $x\"; echo oops >&2; exit 3",
    );
    req.stdin = b"hello\n".to_vec();
    let r = sb.run(&req).expect("run");
    assert_eq!(r.return_code, Some(3));
    assert_eq!(r.stdout, "got hello\n");
    assert_eq!(r.stderr, "oops\n");
    assert_no_leftovers();
}

#[test]
fn files_in_and_out_and_symlinks_not_followed() {
    let Some((sb, _g)) = sandbox("files_in_and_out") else {
        return;
    };
    let mut req = ExecRequest::new(
        Language::Python,
        "import os\n\
         data = open('data/in.txt').read()\n\
         open('out.txt', 'w').write(data.upper())\n\
         os.symlink('/etc/passwd', 'link.txt')\n",
    );
    req.files.insert("data/in.txt".into(), b"abc".to_vec());
    req.fetch_files = vec!["out.txt".into(), "link.txt".into(), "missing.txt".into()];
    let r = sb.run(&req).expect("run");
    assert_eq!(r.return_code, Some(0), "stderr: {}", r.stderr);
    assert_eq!(r.files.get("out.txt").map(Vec::as_slice), Some(&b"ABC"[..]));
    assert!(!r.files.contains_key("link.txt"), "a symlink was followed");
    assert!(!r.files.contains_key("missing.txt"));
    assert_no_leftovers();
}

#[test]
fn bad_file_paths_are_rejected() {
    let Some((sb, _g)) = sandbox("bad_file_paths_are_rejected") else {
        return;
    };
    for bad in ["../escape", "/etc/passwd", ""] {
        let mut req = ExecRequest::new(Language::Bash, "true");
        req.files.insert(bad.into(), b"x".to_vec());
        assert!(sb.run(&req).is_err(), "{bad:?} accepted");
    }
}

#[test]
fn fork_bomb_is_contained() {
    let Some((sb, _g)) = sandbox("fork_bomb_is_contained") else {
        return;
    };
    let t = Instant::now();
    let r = run(sb, Language::Bash, ":(){ :|:& };:", 2);
    assert!(
        t.elapsed() < Duration::from_secs(6),
        "took {:?}",
        t.elapsed()
    );
    assert_no_leftovers();
    let ok = run(sb, Language::Python, "print('alive')", 10);
    assert_eq!(
        ok.stdout, "alive\n",
        "sandbox unusable after fork bomb: {r:?}"
    );
}

#[test]
fn memory_bomb_hits_the_limit() {
    let Some((sb, _g)) = sandbox("memory_bomb_hits_the_limit") else {
        return;
    };
    let mut req = ExecRequest::new(
        Language::Python,
        "a = []\nwhile True:\n    a.append(bytearray(10**7))\n",
    );
    req.memory_limit_mb = Some(256);
    req.timeout = Duration::from_secs(10);
    let r = sb.run(&req).expect("run");
    assert_ne!(r.return_code, Some(0));
    assert!(r.stderr.contains("MemoryError"), "stderr: {}", r.stderr);
    assert_no_leftovers();
}

#[test]
fn infinite_loop_times_out() {
    let Some((sb, _g)) = sandbox("infinite_loop_times_out") else {
        return;
    };
    let t = Instant::now();
    let r = run(sb, Language::Python, "while True:\n    pass\n", 1);
    assert_eq!(r.status, ExecStatus::TimeLimitExceeded);
    assert!(
        t.elapsed() < Duration::from_secs(3),
        "took {:?}",
        t.elapsed()
    );
    assert_no_leftovers();
}

#[test]
fn busy_child_left_behind_is_killed() {
    let Some((sb, _g)) = sandbox("busy_child_left_behind_is_killed") else {
        return;
    };
    let t = Instant::now();
    let r = run(
        sb,
        Language::Bash,
        "(while true; do :; done) &\nsetsid sleep 1000 &\necho started",
        10,
    );
    assert_eq!(r.status, ExecStatus::Finished);
    assert_eq!(r.stdout, "started\n");
    assert!(
        t.elapsed() < Duration::from_secs(3),
        "took {:?}",
        t.elapsed()
    );
    assert_no_leftovers();
}

#[test]
fn kill_minus_one_is_contained() {
    let Some((sb, _g)) = sandbox("kill_minus_one_is_contained") else {
        return;
    };
    let r = run(
        sb,
        Language::Bash,
        "sleep 100 &\nkill -9 -1\necho still here",
        10,
    );
    assert_eq!(r.stdout, "still here\n");
    assert_no_leftovers();
}

#[test]
fn huge_stdout_is_capped() {
    let Some((sb, _g)) = sandbox("huge_stdout_is_capped") else {
        return;
    };
    let t = Instant::now();
    let r = run(
        sb,
        Language::Python,
        "import sys\nchunk = 'x' * (1 << 20)\nfor _ in range(100):\n    sys.stdout.write(chunk)\n",
        20,
    );
    assert_eq!(r.status, ExecStatus::Finished);
    assert!(r.stdout_truncated);
    assert_eq!(r.stdout.len(), sb.config().limits.output_limit_bytes);
    assert!(
        t.elapsed() < Duration::from_secs(10),
        "took {:?}",
        t.elapsed()
    );
    assert_no_leftovers();
}

#[test]
fn secrets_are_unreadable() {
    let Some((sb, _g)) = sandbox("secrets_are_unreadable") else {
        return;
    };
    let own_file = std::env::current_exe().expect("exe");
    let code = format!(
        "for f in /etc/shadow /proc/1/environ /proc/1/mem {}; do\n\
           if head -c1 \"$f\" >/dev/null 2>&1; then echo \"READ $f\"; fi\n\
         done\n\
         ls /root /home 2>/dev/null | head -5\n\
         echo done",
        own_file.display()
    );
    let r = run(sb, Language::Bash, &code, 10);
    assert_eq!(r.stdout.trim_end().lines().last(), Some("done"));
    assert!(!r.stdout.contains("READ"), "readable: {}", r.stdout);
    assert_no_leftovers();
}

#[test]
fn writes_outside_the_work_dir_fail() {
    let Some((sb, _g)) = sandbox("writes_outside_the_work_dir_fail") else {
        return;
    };
    let r = run(
        sb,
        Language::Bash,
        "for f in /x /usr/x /etc/x /code/x /root/x /proc/x; do\n\
           if (echo x > \"$f\") 2>/dev/null; then echo \"WROTE $f\"; fi\n\
         done\n\
         echo ok > /work/ok && echo ok > /tmp/ok && cat /work/ok /tmp/ok",
        10,
    );
    assert!(!r.stdout.contains("WROTE"), "{}", r.stdout);
    assert_eq!(r.stdout, "ok\nok\n", "stderr: {}", r.stderr);
    assert_no_leftovers();
}

#[test]
fn disk_fill_stops_at_the_tmpfs_cap() {
    let Some((sb, _g)) = sandbox("disk_fill_stops_at_the_tmpfs_cap") else {
        return;
    };
    let r = run(
        sb,
        Language::Bash,
        "dd if=/dev/zero of=/work/big bs=1M count=500 2>/dev/null; echo rc=$?; du -m /work/big | cut -f1",
        20,
    );
    let cap = sb.config().limits.tmpfs_mb;
    let mut lines = r.stdout.lines();
    assert_ne!(lines.next(), Some("rc=0"), "500 MB written: {r:?}");
    let mb: u64 = lines
        .next()
        .and_then(|l| l.trim().parse().ok())
        .unwrap_or(u64::MAX);
    assert!(mb <= cap, "wrote {mb} MB, cap {cap}");
    assert_no_leftovers();
}

#[test]
fn only_loopback_and_no_route_to_host_ports() {
    let Some((sb, _g)) = sandbox("only_loopback_and_no_route_to_host_ports") else {
        return;
    };
    // A listener on the host's loopback: the sandbox's loopback is another one.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = listener.local_addr().expect("addr").port();
    let code = format!(
        "import socket\n\
         print(sorted(n for _, n in socket.if_nameindex()))\n\
         s = socket.socket()\n\
         s.settimeout(2)\n\
         try:\n    s.connect(('127.0.0.1', {port}))\n    print('CONNECTED')\n\
         except OSError as e:\n    print('refused', e.errno)\n"
    );
    let r = run(sb, Language::Python, &code, 10);
    let mut lines = r.stdout.lines();
    assert_eq!(lines.next(), Some("['lo']"), "stderr: {}", r.stderr);
    assert!(
        lines.next().is_some_and(|l| l.starts_with("refused")),
        "{}",
        r.stdout
    );
    let dev = run(
        sb,
        Language::Bash,
        "tail -n +3 /proc/net/dev | cut -d: -f1 | tr -d ' '",
        10,
    );
    assert_eq!(dev.stdout, "lo\n");
    assert_no_leftovers();
}

#[test]
fn dangerous_syscalls_are_denied() {
    let Some((sb, _g)) = sandbox("dangerous_syscalls_are_denied") else {
        return;
    };
    // bpf(2) by number: its syscall number differs across architectures.
    let bpf = if cfg!(target_arch = "aarch64") {
        280
    } else {
        321
    };
    let code = "import ctypes, os\n\
        libc = ctypes.CDLL(None, use_errno=True)\n\
        def call(name, *args):\n\
        \x20   r = getattr(libc, name)(*args)\n\
        \x20   print(name, r, os.strerror(ctypes.get_errno()) if r == -1 else '')\n\
        call('ptrace', 0, 0, 0, 0)\n\
        call('ptrace', 16, 1, 0, 0)\n\
        call('unshare', 0x10000000)\n\
        call('mount', b'none', b'/work', b'tmpfs', 0, None)\n\
        call('syscall', BPF, 0, 0, 0)\n"
        .replace("BPF", &bpf.to_string());
    let r = run(sb, Language::Python, &code, 10);
    let lines: Vec<&str> = r.stdout.lines().collect();
    assert_eq!(lines.len(), 5, "stdout: {} stderr: {}", r.stdout, r.stderr);
    for line in lines {
        assert!(line.contains(" -1 "), "not denied: {line}");
    }
    assert_no_leftovers();
}

#[test]
fn setuid_binaries_do_not_elevate() {
    let Some((sb, _g)) = sandbox("setuid_binaries_do_not_elevate") else {
        return;
    };
    let r = run(
        sb,
        Language::Bash,
        "grep -E ' /usr ' /proc/self/mountinfo | grep -q nosuid && echo nosuid\n\
         grep NoNewPrivs /proc/self/status | tr -d '\\t'\n\
         grep CapEff /proc/self/status | tr -d '\\t'",
        10,
    );
    assert_eq!(r.stdout, "nosuid\nNoNewPrivs:1\nCapEff:0000000000000000\n");
    assert_no_leftovers();
}

#[test]
fn concurrent_runs_are_independent() {
    let Some((sb, _g)) = sandbox("concurrent_runs_are_independent") else {
        return;
    };
    let results: Vec<ExecResult> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..8)
            .map(|i| {
                s.spawn(move || {
                    let code = format!("echo {i} > /work/me; sleep 0.2; ls /work; cat /work/me");
                    run(sb, Language::Bash, &code, 10)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("thread"))
            .collect()
    });
    for (i, r) in results.iter().enumerate() {
        assert_eq!(r.stdout, format!("me\n{i}\n"));
    }
    assert_no_leftovers();
}

#[test]
fn nothing_is_left_on_the_host() {
    let Some((sb, _g)) = sandbox("nothing_is_left_on_the_host") else {
        return;
    };
    let mounts = || std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    let tmp = || -> Vec<_> {
        std::fs::read_dir("/tmp")
            .into_iter()
            .flatten()
            .flatten()
            .map(|e| e.file_name())
            .collect()
    };
    let (m0, t0) = (mounts(), tmp());
    let mut req = ExecRequest::new(Language::Bash, "echo x > /work/a; echo y > /tmp/b");
    req.files.insert("in.txt".into(), b"z".to_vec());
    sb.run(&req).expect("run");
    assert_eq!(mounts(), m0, "host mounts changed");
    let new: Vec<_> = tmp().into_iter().filter(|e| !t0.contains(e)).collect();
    assert!(
        !new.iter()
            .any(|n| n == "a" || n == "b" || n == "in.txt" || n == "work"),
        "{new:?}"
    );
    assert_no_leftovers();
}

#[test]
fn other_sandboxes_work_dirs_are_invisible() {
    let Some((sb, _g)) = sandbox("other_sandboxes_work_dirs_are_invisible") else {
        return;
    };
    std::thread::scope(|s| {
        let holder = s.spawn(|| {
            run(
                sb,
                Language::Bash,
                "echo secret > /work/marker-4f1e; sleep 1; cat /work/marker-4f1e",
                10,
            )
        });
        std::thread::sleep(Duration::from_millis(300));
        let seeker = run(
            sb,
            Language::Bash,
            "find / -name 'marker-4f1e' 2>/dev/null; ls /proc | grep -c '^[0-9]'",
            10,
        );
        // Only its own bash, find/ls and the init are visible; no marker.
        assert!(!seeker.stdout.contains("marker"), "{}", seeker.stdout);
        let holder = holder.join().expect("thread");
        assert_eq!(holder.stdout, "secret\n");
    });
    assert_no_leftovers();
}

/// Strings of this process's command line and initial environment that
/// are long enough to be recognisable (and not generic).
fn host_strings() -> Vec<String> {
    let mut out: Vec<String> = std::env::args().filter(|a| a.len() >= 6).collect();
    let environ = std::fs::read("/proc/self/environ").expect("environ");
    out.extend(
        String::from_utf8_lossy(&environ)
            .split('\0')
            .filter(|e| e.len() >= 12)
            .map(str::to_string),
    );
    out
}

/// Issue 31, item 9: a sandbox's init is a clone of the host process, so
/// its `/proc/1/cmdline` used to show the host's whole command line (for
/// `temper tasks run ...`, every flag and path). The init blanks its copy:
/// nothing of the host's argv or environment is readable from inside,
/// through a one-shot run or a warm pool worker (sessions).
#[test]
fn issue31_proc1_cmdline_shows_no_host_command_line() {
    let Some((sb, _g)) = sandbox("issue31_proc1_cmdline_shows_no_host_command_line") else {
        return;
    };
    // Every process the sandbox can see: cmdline and comm; the init's
    // environ (the others' is the sandbox's own environment).
    let probe = "for p in /proc/[0-9]*; do\n\
                   tr '\\0' ' ' < $p/cmdline 2>/dev/null; echo\n\
                   cat $p/comm 2>/dev/null\n\
                 done\n\
                 tr '\\0' ' ' < /proc/1/environ 2>/dev/null\n\
                 echo; tr '\\0' '|' < /proc/1/cmdline";
    let host = host_strings();
    assert!(!host.is_empty());
    let one_shot = run(sb, Language::Bash, probe, 10);
    assert_eq!(one_shot.return_code, Some(0), "{}", one_shot.stderr);
    let session = temper_sandbox::Session::new(
        std::sync::Arc::new(Sandbox::new(SandboxConfig::default()).expect("sandbox")),
        temper_sandbox::SessionConfig::default(),
    )
    .expect("session");
    let warm = session
        .exec(probe, None, &BTreeMap::new(), Duration::from_secs(10))
        .expect("exec");
    drop(session);
    for (what, r) in [("one-shot run", &one_shot), ("session", &warm)] {
        for s in &host {
            assert!(
                !r.stdout.contains(s.as_str()),
                "{what}: the host's {s:?} is visible:\n{}",
                r.stdout
            );
        }
        let last = r.stdout.trim_end().lines().last().unwrap_or_default();
        assert!(last.starts_with("sandbox-init|"), "{what}: {last:?}");
        assert!(r.stdout.contains("sandbox-init\n"), "{what}: comm");
    }
    assert_no_leftovers();
}

/// Host processes whose command line holds `marker`.
fn host_processes_with(marker: &str) -> Vec<String> {
    std::fs::read_dir("/proc")
        .expect("proc")
        .flatten()
        .filter_map(|e| std::fs::read(e.path().join("cmdline")).ok())
        .map(|c| String::from_utf8_lossy(&c).replace('\0', " "))
        .filter(|c| c.contains(marker))
        .collect()
}

/// Issue 31, item 9: a host program attached to a [`HostCgroup`] cannot
/// leave anything behind by leaving its process group: a `setsid` child
/// and a double-forked one are killed by `kill_all` (and by drop).
#[test]
fn issue31_host_cgroup_kills_children_that_left_the_process_group() {
    // One test at a time, like the rest of the suite.
    let _g = env().lock.lock().unwrap_or_else(|e| e.into_inner());
    let cg = temper_sandbox::HostCgroup::new();
    if !cg.is_tracking() {
        eprintln!(
            "SKIPPED issue31_host_cgroup_kills_children_that_left_the_process_group: \
             no writable cgroup: {}",
            cg.mode()
        );
        return;
    }
    let marker = "6421.77";
    let mut cmd = std::process::Command::new("sh");
    cmd.arg("-c")
        .arg(format!(
            "setsid sleep {marker} </dev/null >/dev/null 2>&1 &\n\
             ( setsid sh -c 'sleep {marker}1' </dev/null >/dev/null 2>&1 & ) &\n\
             sleep 0.2"
        ))
        .stdout(std::process::Stdio::null());
    std::os::unix::process::CommandExt::process_group(&mut cmd, 0);
    cg.attach(&mut cmd);
    let status = cmd.status().expect("sh runs");
    assert!(status.success());
    // The program is gone; its children live on outside its group.
    let started = host_processes_with(marker);
    assert!(started.len() >= 2, "the children started: {started:?}");
    let killed = cg.kill_all(Duration::from_secs(2));
    assert!(killed >= 2, "signalled {killed}");
    let left = host_processes_with(marker);
    assert!(left.is_empty(), "outlived kill_all: {left:?}");
    // Dropping an unused one kills nothing and leaves no cgroup behind.
    drop(cg);
}
