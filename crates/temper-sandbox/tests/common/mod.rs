//! Helpers shared by the sandbox integration tests.
#![allow(dead_code)]

use std::sync::{Mutex, MutexGuard};

use temper_sandbox::{ExecRequest, Language, Sandbox, SandboxConfig};

/// Tests run one at a time so that "no children left" sees only its own.
pub fn serial() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

/// A default sandbox that has been shown to run, or `None` (printing why the
/// test `test` is skipped) on a host without the namespaces it needs.
pub fn usable_sandbox(test: &str) -> Option<Sandbox> {
    let sandbox = match Sandbox::new(SandboxConfig::default()) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("SKIPPED {test}: {e}");
            return None;
        }
    };
    if let Err(e) = sandbox.run(&ExecRequest::new(Language::Bash, "true")) {
        eprintln!("SKIPPED {test}: namespaces unavailable on this host: {e}");
        return None;
    }
    Some(sandbox)
}

/// Live direct children of this test process.
pub fn children() -> usize {
    let me = std::process::id().to_string();
    std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| {
            std::fs::read_to_string(e.path().join("status"))
                .map(|s| {
                    s.lines()
                        .any(|l| l.strip_prefix("PPid:").map(str::trim) == Some(&me))
                })
                .unwrap_or(false)
        })
        .count()
}
