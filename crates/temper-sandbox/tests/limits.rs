//! Per-run limits over all processes of a run (cgroups), not per process.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::{serial, usable_sandbox};
use temper_sandbox::{ExecRequest, ExecStatus, Language, Pool, PoolConfig, RunLimits, Sandbox};

/// Four children each holding 700 MB: 2.8 GB in all, under RLIMIT_AS each.
const FOUR_BY_700MB: &str = r#"
import os, time
pids = []
for i in range(4):
    pid = os.fork()
    if pid == 0:
        b = b'\x01' * (700 << 20)
        time.sleep(5)
        os._exit(0)
    pids.append(pid)
for p in pids:
    os.waitpid(p, 0)
print("survived")
"#;

/// A sandbox whose runs get cgroups, or `None` printing why not.
fn cgroup_sandbox(test: &str) -> Option<Sandbox> {
    let sandbox = usable_sandbox(test)?;
    if let RunLimits::Rlimits(why) = sandbox.run_limits() {
        eprintln!("SKIPPED {test}: cannot create cgroups here ({why}); `temper sandbox doctor` says so too");
        return None;
    }
    Some(sandbox)
}

fn request() -> ExecRequest {
    let mut req = ExecRequest::new(Language::Python, FOUR_BY_700MB);
    req.timeout = Duration::from_secs(20);
    req.memory_limit_mb = Some(1024);
    req
}

#[test]
fn four_children_of_700mb_under_a_1gib_run_limit_are_killed_fresh_sandbox() {
    let _serial = serial();
    let Some(sandbox) = cgroup_sandbox("four_children_fresh") else {
        return;
    };
    let r = sandbox.run(&request()).expect("run");
    assert_eq!(r.status, ExecStatus::MemoryLimitExceeded, "{r:?}");
    assert!(!r.stdout.contains("survived"), "{r:?}");
    // The sandbox still runs ordinary code.
    let ok = sandbox
        .run(&ExecRequest::new(Language::Python, "print(1)"))
        .expect("run");
    assert_eq!(ok.stdout, "1\n");
}

#[test]
fn four_children_of_700mb_under_a_1gib_run_limit_are_killed_warm_pool() {
    let _serial = serial();
    let Some(sandbox) = cgroup_sandbox("four_children_warm") else {
        return;
    };
    let pool = Pool::new(
        Arc::new(sandbox),
        PoolConfig {
            size: 1,
            ..PoolConfig::default()
        },
    )
    .expect("pool");
    let r = pool.run(&request()).expect("run");
    assert_eq!(r.status, ExecStatus::MemoryLimitExceeded, "{r:?}");
    assert!(!r.stdout.contains("survived"), "{r:?}");
    assert_eq!(pool.workers(), 1, "the pool did not heal");
    let ok = pool
        .run(&ExecRequest::new(Language::Python, "print(1)"))
        .expect("run");
    assert_eq!(ok.stdout, "1\n");
}

#[test]
fn a_run_may_not_exceed_its_process_limit_across_processes() {
    let _serial = serial();
    let Some(sandbox) = cgroup_sandbox("pids_limit") else {
        return;
    };
    let max = sandbox.config().limits.max_processes;
    // Threads count as tasks: try to hold twice the limit at once.
    let code = format!(
        "import threading, time\nn = 0\ntry:\n    for i in range({}):\n        t = threading.Thread(target=time.sleep, args=(3,), daemon=True)\n        t.start()\n        n += 1\nexcept RuntimeError:\n    pass\nprint(n)",
        max * 2
    );
    let r = sandbox
        .run(&ExecRequest::new(Language::Python, code))
        .expect("run");
    let n: u64 = r.stdout.trim().parse().expect("count");
    assert!(n < max, "{n} threads under a limit of {max}");
}

#[test]
fn a_small_memory_request_after_a_run_that_filled_the_tmpfs_still_runs() {
    let _serial = serial();
    let Some(sandbox) = cgroup_sandbox("small_after_full") else {
        return;
    };
    let pool = Pool::new(
        Arc::new(sandbox),
        PoolConfig {
            size: 1,
            ..PoolConfig::default()
        },
    )
    .expect("pool");
    // Leaves ~60 MiB in each of /work, /tmp and /dev/shm (charged to the
    // worker's cgroup until the next run empties them).
    let fill = "for d in ('/work', '/tmp', '/dev/shm'):\n    open(d + '/f', 'wb').write(b'0' * (60 << 20))";
    let r = pool
        .run(&ExecRequest::new(Language::Python, fill))
        .expect("run");
    assert_eq!(r.return_code, Some(0), "{r:?}");
    let mut small = ExecRequest::new(Language::Python, "print(1)");
    small.memory_limit_mb = Some(16);
    let r = pool.run(&small).expect("a small limit after a full tmpfs");
    assert_eq!(r.stdout, "1\n", "{r:?}");
}
