//! The unprivileged path (a laptop user, no root): when the suite runs as
//! root, this test re-runs itself as uid 65534 through `setpriv`, where the
//! sandbox user maps to the caller itself and init keeps its parent-death
//! signal. Guards the regression where pool workers died with the thread
//! that started them (that only shows without root).

use std::sync::Arc;
use std::time::Duration;

use temper_sandbox::{ExecRequest, Language, Pool, PoolConfig, Sandbox, SandboxConfig, Session};

const INNER: &str = "TEMPER_SANDBOX_UNPRIVILEGED_CHILD";

fn checks() {
    let sandbox = Arc::new(Sandbox::new(SandboxConfig::default()).expect("sandbox"));
    let mut req = ExecRequest::new(
        Language::Python,
        "import os\nopen('o.txt', 'w').write(str(os.getuid()))\nprint(1)",
    );
    req.fetch_files = vec!["o.txt".into()];
    let r = sandbox.run(&req).expect("cold run");
    assert_eq!(r.stdout, "1\n", "stderr: {}", r.stderr);
    assert_eq!(r.files.get("o.txt").map(Vec::as_slice), Some(&b"1000"[..]));

    let config = PoolConfig {
        size: 1,
        max_runs_per_worker: 10,
    };
    let sb = sandbox.clone();
    let pool = std::thread::spawn(move || Pool::new(sb, config).expect("pool"))
        .join()
        .expect("thread");
    std::thread::sleep(Duration::from_millis(100));
    let r = pool
        .run(&ExecRequest::new(Language::Bash, "echo warm"))
        .expect("warm run");
    assert_eq!(r.stdout, "warm\n");

    let session = Session::new(sandbox, Default::default()).expect("session");
    session.upload("f", b"x".to_vec()).expect("upload");
    assert_eq!(
        session.download("f").expect("download"),
        Some(b"x".to_vec())
    );
}

#[test]
fn works_without_root() {
    if std::env::var_os(INNER).is_some() {
        checks();
        return;
    }
    if !nix_is_root() {
        if Sandbox::new(SandboxConfig::default())
            .and_then(|s| s.run(&ExecRequest::new(Language::Bash, "true")))
            .is_err()
        {
            eprintln!("SKIPPED works_without_root: namespaces unavailable on this host");
            return;
        }
        checks();
        return;
    }
    let exe = match std::env::current_exe() {
        Ok(e) => e,
        Err(e) => {
            eprintln!("SKIPPED works_without_root: no current_exe: {e}");
            return;
        }
    };
    let out = std::process::Command::new("setpriv")
        .args(["--reuid", "65534", "--regid", "65534", "--clear-groups"])
        .arg(&exe)
        .args([
            "works_without_root",
            "--exact",
            "--nocapture",
            "--test-threads",
            "1",
        ])
        .env_clear()
        .env("PATH", "/usr/bin:/bin")
        .env("HOME", "/tmp")
        .env(INNER, "1")
        .current_dir("/tmp")
        .output();
    match out {
        Err(e) => eprintln!("SKIPPED works_without_root: cannot run setpriv: {e}"),
        Ok(out)
            if String::from_utf8_lossy(&out.stderr).contains("Permission denied")
                && !out.status.success()
                && out.stdout.is_empty() =>
        {
            eprintln!(
                "SKIPPED works_without_root: test binary not runnable as uid 65534: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        Ok(out) => {
            let stdout = String::from_utf8_lossy(&out.stdout);
            assert!(
                out.status.success() && stdout.contains("1 passed"),
                "unprivileged run failed:\n{stdout}\n{}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
    }
}

fn nix_is_root() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("Uid:"))
                .and_then(|l| l.split_whitespace().nth(1).map(|e| e == "0"))
        })
        .unwrap_or(false)
}
