//! `temper sandbox serve` as a process: the API key given on the command
//! line, in a file or in the environment never reaches sandboxed code (nor
//! the host's `ps` once the server is up).

mod common;

use std::process::Command;

use common::{sandbox_serve as serve, Server};

/// Reads every /proc/*/{cmdline,environ,mem} and /proc/self/* it can from
/// inside the sandbox and prints what it found containing the key (read
/// from stdin, so its own memory is not searched).
const HUNT: &str = r#"
import os, sys
needle = sys.stdin.read().encode()
me = str(os.getpid())
hits = []
for pid in os.listdir('/proc'):
    if not (pid.isdigit() or pid in ('self', 'thread-self')):
        continue
    for name in ('cmdline', 'environ', 'status', 'maps', 'stat', 'comm'):
        try:
            with open('/proc/%s/%s' % (pid, name), 'rb') as f:
                if needle in f.read():
                    hits.append('%s/%s' % (pid, name))
        except OSError:
            pass
    if pid in (me, 'self', 'thread-self'):
        continue
    try:
        with open('/proc/%s/mem' % pid, 'rb') as f:
            for line in open('/proc/%s/maps' % pid):
                lo, hi = (int(x, 16) for x in line.split()[0].split('-'))
                try:
                    f.seek(lo)
                    if needle in f.read(hi - lo):
                        hits.append('%s/mem' % pid)
                        break
                except OSError:
                    pass
    except OSError:
        pass
print('pids', sorted(p for p in os.listdir('/proc') if p.isdigit()))
print('hits', hits)
"#;

fn hunt(url: &str, key: &str) -> String {
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    rt.block_on(async {
        let http = reqwest::Client::builder()
            .no_proxy()
            .build()
            .expect("client");
        let resp = http
            .post(format!("{url}/run_code"))
            .bearer_auth(key)
            .json(&serde_json::json!({
                "code": HUNT, "language": "python", "stdin": key, "run_timeout": 30,
            }))
            .send()
            .await
            .expect("run_code");
        assert_eq!(resp.status(), 200);
        let body: serde_json::Value = resp.json().await.expect("json");
        let run = &body["run_result"];
        assert_eq!(run["return_code"], 0, "{body}");
        run["stdout"].as_str().expect("stdout").to_string()
    })
}

fn host_cmdline_and_environ(server: &Server) -> Vec<u8> {
    let pid = server.0.id();
    let mut all = std::fs::read(format!("/proc/{pid}/cmdline")).expect("cmdline");
    all.extend(std::fs::read(format!("/proc/{pid}/environ")).expect("environ"));
    all
}

fn contains(hay: &[u8], needle: &str) -> bool {
    hay.windows(needle.len()).any(|w| w == needle.as_bytes())
}

#[test]
fn sandboxed_code_never_sees_the_api_key_from_flag_file_or_env() {
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("key");
    let file_key = "file-key-5c1f0e9a7b2d4c68";
    std::fs::write(&file, format!("{file_key}\n")).expect("write key");
    let flag_key = "flag-key-0d9e8c7b6a5f4e3d";
    let env_key = "env-key-1a2b3c4d5e6f7a8b";
    type Case<'a> = (&'a str, Vec<&'a str>, Vec<(&'a str, &'a str)>);
    let cases: Vec<Case> = vec![
        (flag_key, vec!["--api-key", flag_key], vec![]),
        (
            file_key,
            vec!["--api-key-file", file.to_str().expect("utf-8 path")],
            vec![],
        ),
        (env_key, vec![], vec![("TEMPER_SANDBOX_API_KEY", env_key)]),
        // The file clients read too ($TEMPER_SANDBOX_API_KEY_FILE).
        (
            file_key,
            vec![],
            vec![(
                "TEMPER_SANDBOX_API_KEY_FILE",
                file.to_str().expect("utf-8 path"),
            )],
        ),
        // Both set: the key itself wins, as in the clients.
        (
            env_key,
            vec![],
            vec![
                ("TEMPER_SANDBOX_API_KEY", env_key),
                (
                    "TEMPER_SANDBOX_API_KEY_FILE",
                    file.to_str().expect("utf-8 path"),
                ),
            ],
        ),
    ];
    for (key, args, env) in cases {
        let Some((server, url)) = serve(&args, &env) else {
            return;
        };
        let seen = hunt(&url, key);
        assert!(seen.contains("hits []"), "key {key} visible inside: {seen}");
        // Only the sandbox's own processes: its init, the zygote and the run.
        let pids = seen
            .lines()
            .find_map(|l| l.strip_prefix("pids "))
            .expect("pids line");
        assert!(
            pids.matches('\'').count() / 2 <= 3,
            "extra processes: {pids}"
        );
        assert!(
            !contains(&host_cmdline_and_environ(&server), key),
            "key {key} still in the server's /proc cmdline or environ"
        );
        // The key is still enforced.
        let rt = tokio::runtime::Runtime::new().expect("runtime");
        let status = rt.block_on(async {
            reqwest::Client::builder()
                .no_proxy()
                .build()
                .expect("client")
                .post(format!("{url}/run_code"))
                .json(&serde_json::json!({"code": "print(1)", "language": "python"}))
                .send()
                .await
                .expect("send")
                .status()
        });
        assert_eq!(status, 401);
    }
}

#[test]
fn an_empty_api_key_refuses_to_start_instead_of_serving_open() {
    for (args, env) in [
        (vec!["--api-key", ""], vec![]),
        (vec![], vec![("TEMPER_SANDBOX_API_KEY", "")]),
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_temper"))
            .args(["sandbox", "serve", "--port", "0", "--pool-size", "1"])
            .args(&args)
            .envs(env.iter().copied())
            .output()
            .expect("run temper");
        assert!(!out.status.success(), "{args:?} {env:?} started");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("empty"), "{err}");
    }
}
