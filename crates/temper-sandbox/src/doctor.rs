//! `doctor`: which isolation layers are active on this host, and why not.

use std::path::Path;
use std::time::Duration;

use crate::{seccomp, ExecRequest, ExecStatus, Language, Sandbox};

/// One isolation layer and whether this host gives it to us.
#[derive(Debug, Clone)]
pub struct Layer {
    /// Short name, e.g. `"net namespace"`.
    pub name: &'static str,
    /// True when the layer is in force for every run.
    pub active: bool,
    /// What was observed, or why the layer is missing.
    pub detail: String,
}

fn layer(name: &'static str, active: bool, detail: impl Into<String>) -> Layer {
    Layer {
        name,
        active,
        detail: detail.into(),
    }
}

fn read_trim(path: &str) -> Option<String> {
    std::fs::read_to_string(path)
        .ok()
        .map(|s| s.trim().to_string())
}

const PROBE: &str = r#"
echo "pid=$$"
echo "uid=$(id -u)"
echo "host=$(cat /proc/sys/kernel/hostname)"
echo "ifaces=$(tail -n +3 /proc/net/dev | cut -d: -f1 | tr -d ' ' | tr '\n' ' ')"
while IFS=$'\t' read -r k v; do
  case "$k" in Seccomp:|NoNewPrivs:|CapEff:) echo "${k%:}=$v";; esac
done < /proc/self/status
if touch /usr/.temper-probe 2>/dev/null; then echo rootfs=rw; else echo rootfs=ro; fi
if touch /work/.temper-probe 2>/dev/null; then echo work=rw; else echo work=ro; fi
if cat /etc/shadow >/dev/null 2>&1; then echo shadow=readable; else echo shadow=denied; fi
echo "nproc=$(ulimit -u) as_kib=$(ulimit -v) cpu=$(ulimit -t)"
"#;

/// Probes this host: runs a tiny bash program through `sandbox` and reads
/// back what it saw, plus host facts (user namespaces, seccomp, cgroups).
pub fn doctor(sandbox: &Sandbox) -> Vec<Layer> {
    let mut layers = Vec::new();
    let max_userns = read_trim("/proc/sys/user/max_user_namespaces");
    let unpriv = read_trim("/proc/sys/kernel/unprivileged_userns_clone");
    let root = nix::unistd::geteuid().is_root();

    let mut req = ExecRequest::new(Language::Bash, PROBE);
    req.timeout = Duration::from_secs(10);
    let probe = sandbox.run(&req);
    let kv = |key: &str| -> Option<String> {
        let out = probe.as_ref().ok()?;
        out.stdout
            .lines()
            .find_map(|l| l.strip_prefix(key)?.strip_prefix('=').map(str::to_string))
    };
    match &probe {
        Ok(r) if r.status == ExecStatus::Finished => {
            let mapping = if root {
                format!(
                    "running as root: sandbox user maps to host uid {}",
                    sandbox.config().host_uid_when_root
                )
            } else {
                "unprivileged: sandbox user maps to the caller's uid".to_string()
            };
            layers.push(layer(
                "user namespace",
                true,
                format!("{mapping}; uid inside = {}", kv("uid").unwrap_or_default()),
            ));
        }
        Ok(r) => layers.push(layer(
            "user namespace",
            false,
            format!("probe did not finish: {:?} {}", r.status, r.stderr.trim()),
        )),
        Err(e) => {
            let why = format!(
                "cannot create namespaces: {e} (max_user_namespaces={}, unprivileged_userns_clone={})",
                max_userns.as_deref().unwrap_or("?"),
                unpriv.as_deref().unwrap_or("n/a"),
            );
            layers.push(layer("user namespace", false, why));
        }
    }
    let ok = probe
        .as_ref()
        .is_ok_and(|r| r.status == ExecStatus::Finished);
    let pid = kv("pid");
    layers.push(layer(
        "pid namespace",
        ok && pid.as_deref() == Some("2"),
        format!("program pid inside = {}", pid.as_deref().unwrap_or("?")),
    ));
    let ifaces = kv("ifaces").unwrap_or_default();
    layers.push(layer(
        "net namespace",
        ok && ifaces.trim() == "lo",
        format!("interfaces inside: [{}]", ifaces.trim()),
    ));
    let host = kv("host");
    layers.push(layer(
        "uts + ipc namespaces",
        ok && host.as_deref() == Some("sandbox"),
        format!("hostname inside = {}", host.as_deref().unwrap_or("?")),
    ));
    let rootfs = kv("rootfs");
    let work = kv("work");
    layers.push(layer(
        "mount namespace, read-only root",
        ok && rootfs.as_deref() == Some("ro") && work.as_deref() == Some("rw"),
        format!(
            "/usr is {}, /work is {} (tmpfs, {} MiB), /etc/shadow {}",
            rootfs.as_deref().unwrap_or("?"),
            work.as_deref().unwrap_or("?"),
            sandbox.config().limits.tmpfs_mb,
            kv("shadow").as_deref().unwrap_or("?"),
        ),
    ));
    let sec = kv("Seccomp");
    let seccomp_kernel = Path::new("/proc/sys/kernel/seccomp/actions_avail").exists();
    layers.push(layer(
        "seccomp filter",
        ok && sec.as_deref() == Some("2"),
        format!(
            "Seccomp mode inside = {} (kernel support: {seccomp_kernel}); denied: {}",
            sec.as_deref().unwrap_or("?"),
            seccomp::denied_syscalls().collect::<Vec<_>>().join(", ")
        ),
    ));
    layers.push(layer(
        "no_new_privs + no capabilities",
        ok && kv("NoNewPrivs").as_deref() == Some("1")
            && kv("CapEff").as_deref() == Some("0000000000000000"),
        format!(
            "NoNewPrivs = {}, CapEff = {}",
            kv("NoNewPrivs").as_deref().unwrap_or("?"),
            kv("CapEff").as_deref().unwrap_or("?")
        ),
    ));
    layers.push(layer(
        "rlimits",
        ok,
        format!(
            "inside: {}",
            kv("nproc")
                .map(|n| format!("nproc={n}"))
                .unwrap_or_else(|| "?".into())
        ),
    ));
    let limits = sandbox.run_limits();
    layers.push(layer(
        "per-run memory + pids limit",
        !matches!(limits, crate::RunLimits::Rlimits(_)),
        limits.to_string(),
    ));
    for lang in [Language::Python, Language::Bash] {
        let name = match lang {
            Language::Python => "python interpreter",
            _ => "bash interpreter",
        };
        match sandbox.interpreter(lang) {
            Ok(i) => layers.push(layer(name, true, i.exe.display().to_string())),
            Err(e) => layers.push(layer(name, false, e.to_string())),
        }
    }
    layers
}
