//! The test process's memory, read from `/proc/self/status` (for the test
//! binaries that run alone so their peak RSS is their own).

/// A `/proc/self/status` field in kB (`VmHWM`, `VmRSS`, …) as MB.
pub fn status_mb(field: &str) -> f64 {
    let s = std::fs::read_to_string("/proc/self/status").expect("/proc/self/status");
    let line = s
        .lines()
        .find(|l| l.starts_with(field))
        .expect("status field");
    let kb: f64 = line.split_whitespace().nth(1).unwrap().parse().unwrap();
    kb / 1024.0
}
