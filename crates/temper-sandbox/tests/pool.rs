//! The warm pool: same results as a cold run, no state carried between
//! runs on one worker, broken workers replaced, nothing left after drop.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{children, serial, usable_sandbox};
use temper_sandbox::{ExecRequest, ExecStatus, Language, Pool, PoolConfig};

fn pool(test: &str, config: PoolConfig) -> Option<Pool> {
    let sandbox = usable_sandbox(test)?;
    Some(Pool::new(Arc::new(sandbox), config).expect("pool"))
}

fn req(language: Language, code: &str) -> ExecRequest {
    let mut r = ExecRequest::new(language, code);
    r.timeout = Duration::from_secs(10);
    r
}

#[test]
fn pool_runs_python_and_bash_like_a_cold_sandbox() {
    let _serial = serial();
    let Some(pool) = pool("pool_runs_python_and_bash", PoolConfig::default()) else {
        return;
    };
    let r = pool
        .run(&req(Language::Python, "print(__name__)"))
        .expect("run");
    assert_eq!(
        (r.status, r.return_code, r.stdout.as_str()),
        (ExecStatus::Finished, Some(0), "__main__\n")
    );
    let r = pool
        .run(&req(
            Language::Python,
            "import sys\nprint('x', file=sys.stderr)\nsys.exit(3)",
        ))
        .expect("run");
    assert_eq!((r.return_code, r.stderr.as_str()), (Some(3), "x\n"));
    let mut q = req(
        Language::Bash,
        "read a; cat in/f.txt; echo \"$a\" > out.txt; echo ok",
    );
    q.stdin = b"hi\n".to_vec();
    q.files.insert("in/f.txt".into(), b"file\n".to_vec());
    q.fetch_files = vec!["out.txt".into()];
    let r = pool.run(&q).expect("run");
    assert_eq!(r.stdout, "file\nok\n", "stderr: {}", r.stderr);
    assert_eq!(
        r.files.get("out.txt").map(Vec::as_slice),
        Some(&b"hi\n"[..])
    );
}

#[test]
fn pool_runs_leave_nothing_for_the_next_run() {
    let config = PoolConfig {
        size: 1,
        max_runs_per_worker: 100,
    };
    let _serial = serial();
    let Some(pool) = pool("pool_runs_leave_nothing", config) else {
        return;
    };
    let r = pool
        .run(&req(
            Language::Bash,
            "echo a > /work/a; echo b > /tmp/b; (sleep 1000 &); echo started",
        ))
        .expect("run");
    assert_eq!(r.stdout, "started\n");
    let r = pool
        .run(&req(
            Language::Bash,
            "ls -A /work /tmp /dev/shm; grep -l sleep /proc/[0-9]*/comm 2>/dev/null | wc -l",
        ))
        .expect("run");
    assert_eq!(
        r.stdout, "/dev/shm:\n\n/tmp:\n\n/work:\n0\n",
        "stderr: {}",
        r.stderr
    );
}

#[test]
fn pool_times_out_a_run_and_keeps_serving() {
    let config = PoolConfig {
        size: 1,
        max_runs_per_worker: 100,
    };
    let _serial = serial();
    let Some(pool) = pool("pool_times_out_a_run_and_keeps_serving", config) else {
        return;
    };
    let mut q = req(Language::Python, "while True:\n    pass\n");
    q.timeout = Duration::from_millis(500);
    let t = Instant::now();
    let r = pool.run(&q).expect("run");
    assert_eq!(r.status, ExecStatus::TimeLimitExceeded);
    assert!(t.elapsed() < Duration::from_secs(3));
    let r = pool.run(&req(Language::Python, "print(2)")).expect("run");
    assert_eq!(r.stdout, "2\n");
}

#[test]
fn pool_survives_kill_minus_one_and_recycles() {
    let config = PoolConfig {
        size: 1,
        max_runs_per_worker: 2,
    };
    let _serial = serial();
    let Some(pool) = pool("pool_survives_kill_minus_one", config) else {
        return;
    };
    // Kills the zygote too: that run fails, the worker is replaced.
    let _ = pool.run(&req(Language::Bash, "kill -9 -1; echo still here"));
    for i in 0..5 {
        let r = pool
            .run(&req(Language::Python, &format!("print({i})")))
            .expect("run");
        assert_eq!(r.stdout, format!("{i}\n"));
    }
}

#[test]
fn pool_is_fast_and_cleans_up_on_drop() {
    let _serial = serial();
    let Some(pool) = pool("pool_is_fast", PoolConfig::default()) else {
        return;
    };
    let mut times: Vec<Duration> = (0..30)
        .map(|_| {
            let t = Instant::now();
            let r = pool.run(&req(Language::Python, "print(1)")).expect("run");
            assert_eq!(r.stdout, "1\n");
            t.elapsed()
        })
        .collect();
    times.sort();
    eprintln!("pool print(1): p50 {:?}, max {:?}", times[15], times[29]);
    assert!(
        times[15] < Duration::from_millis(100),
        "p50 {:?}",
        times[15]
    );
    drop(pool);
    assert_eq!(children(), 0, "workers left after the pool was dropped");
}

#[test]
fn test_case_runner_scores_the_fraction_passed() {
    use temper_sandbox::{run_test_cases, TestCase};
    let _serial = serial();
    let Some(pool) = pool("test_case_runner", PoolConfig::default()) else {
        return;
    };
    // Reads stdin only when there is some, so assert-style cases can reuse it.
    let code = "import sys\n\ndef double(x):\n    return 2 * x\n\ndata = sys.stdin.read()\nif data:\n    print(double(int(data)))\n";
    let io = |i: &str, o: &str| TestCase::Io {
        stdin: i.into(),
        expected_stdout: o.into(),
    };
    let cases = [
        io("2\n", "4\n"),
        io("5", "10  \n\n"),
        io("3", "7"),
        TestCase::Assert {
            code: "assert double(4) == 8".into(),
        },
        TestCase::Assert {
            code: "assert double(4) == 9".into(),
        },
        TestCase::Assert {
            code: "while True: pass".into(),
        },
    ];
    let report = run_test_cases(
        |r| pool.run(r),
        Language::Python,
        code,
        &cases,
        Duration::from_millis(500),
    )
    .expect("report");
    let passed: Vec<bool> = report.cases.iter().map(|c| c.passed).collect();
    assert_eq!(passed, [true, true, false, true, false, false]);
    assert_eq!(report.cases[5].result.status, ExecStatus::TimeLimitExceeded);
    assert!((report.fraction_passed - 0.5).abs() < 1e-9);
}

/// Workers outlive the thread that started them (tokio's blocking threads
/// come and go): regression test for init's parent-death signal, which
/// follows the creating *thread*.
#[test]
fn workers_outlive_the_thread_that_started_them() {
    let _serial = serial();
    let config = PoolConfig {
        size: 1,
        max_runs_per_worker: 100,
    };
    let Some(pool) = std::thread::spawn(move || pool("workers_outlive_the_thread", config))
        .join()
        .expect("thread")
    else {
        return;
    };
    std::thread::sleep(Duration::from_millis(100));
    let r = pool.run(&req(Language::Python, "print(3)")).expect("run");
    assert_eq!(r.stdout, "3\n");
}
