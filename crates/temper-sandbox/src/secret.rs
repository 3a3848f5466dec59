//! Keeping the service's API key out of what sandboxed code can read.
//!
//! A sandbox's init is a `clone` of the service (no `execve`), so its
//! `/proc/1/cmdline` and `/proc/1/environ` show the service's original
//! argument and environment block. [`scrub_from_process`] overwrites every
//! occurrence of the secret in those two blocks of this process, so neither
//! `ps` on the host (after start-up) nor any sandbox cloned later sees it.
//! The init is also non-dumpable (`/proc/1/mem`, `environ` closed), and the
//! pid namespace shows no other service process. Beyond the secret, every
//! sandbox's init blanks its own copy of both blocks right after `clone`
//! (see `child.rs`), so `/proc/1/cmdline` inside shows `sandbox-init`, not
//! the host's command line (`temper tasks run ...` and its flags).

use std::fs::OpenOptions;
use std::io;
use std::os::unix::fs::FileExt;

/// Environment variable `temper sandbox serve` reads the API key from.
pub const API_KEY_ENV: &str = "TEMPER_SANDBOX_API_KEY";

/// Compares two secrets in time that depends on their lengths only
/// (`subtle`'s comparison, which the optimizer cannot turn into an early exit).
pub(crate) fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    use subtle::ConstantTimeEq;
    a.ct_eq(b).into()
}

/// The `[arg_start, arg_end)` and `[env_start, env_end)` ranges of this
/// process, from fields 48–51 of `/proc/self/stat`.
pub(crate) fn arg_env_ranges() -> io::Result<[(u64, u64); 2]> {
    let stat = std::fs::read_to_string("/proc/self/stat")?;
    // The command name may hold spaces and parentheses: fields start after
    // the last `)`, with field 3 (state) first.
    let rest = stat
        .rsplit_once(')')
        .map(|(_, r)| r)
        .ok_or_else(|| io::Error::other("unexpected /proc/self/stat format"))?;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let field = |n: usize| -> io::Result<u64> {
        fields
            .get(n - 3)
            .and_then(|f| f.parse().ok())
            .ok_or_else(|| io::Error::other(format!("/proc/self/stat has no field {n}")))
    };
    Ok([(field(48)?, field(49)?), (field(50)?, field(51)?)])
}

/// Overwrites every occurrence of `secret` in this process's argument and
/// environment blocks with `*`; returns how many were found. Call it once
/// the secret has been copied out (clap and `std::env` copy).
pub fn scrub_from_process(secret: &str) -> io::Result<usize> {
    let needle = secret.as_bytes();
    if needle.is_empty() {
        return Ok(0);
    }
    let mem = OpenOptions::new()
        .read(true)
        .write(true)
        .open("/proc/self/mem")?;
    let mut found = 0;
    for (start, end) in arg_env_ranges()? {
        let len = usize::try_from(end.saturating_sub(start))
            .map_err(|_| io::Error::other("argument block too large"))?;
        let mut block = vec![0u8; len];
        mem.read_exact_at(&mut block, start)?;
        let mut i = 0;
        while i + needle.len() <= block.len() {
            if &block[i..i + needle.len()] == needle {
                let stars = vec![b'*'; needle.len()];
                mem.write_all_at(&stars, start + i as u64)?;
                found += 1;
                i += needle.len();
            } else {
                i += 1;
            }
        }
    }
    Ok(found)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scrubbing_removes_a_secret_from_proc_self_environ() {
        // The test process's own environment block (set by cargo before
        // start): a variable there plays the secret.
        let environ = std::fs::read("/proc/self/environ").expect("environ");
        let text = String::from_utf8_lossy(&environ).into_owned();
        let Some(entry) = text
            .split('\0')
            .find(|e| e.starts_with("CARGO_PKG_NAME="))
            .map(|e| e.to_string())
        else {
            eprintln!("SKIPPED: CARGO_PKG_NAME not in the initial environment");
            return;
        };
        let n = scrub_from_process(&entry).expect("scrub");
        assert!(n >= 1);
        let after = std::fs::read("/proc/self/environ").expect("environ");
        assert!(!String::from_utf8_lossy(&after).contains(&entry));
    }
}
