//! The hub as a team uses it: `temper hub serve`, `temper hub token
//! create`, `temper login`, `temper env push/search/info/pull/yank`, and
//! `temper eval owner/name@range` recording what it resolved.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Output, Stdio};

use temper_eval::mock::{self, MockConfig};

fn temper(home: &Path) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_temper"));
    c.env("TEMPER_CONFIG_DIR", home.join("config"))
        .env("TEMPER_HUB_CACHE", home.join("cache"))
        .env_remove("TEMPER_HUB_URL")
        .env_remove("TEMPER_HUB_TOKEN");
    c
}

fn ok(out: Output) -> String {
    assert!(
        out.status.success(),
        "failed: {}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The hub process, and its stdout kept open (it prints after the first line).
struct Server(
    Child,
    #[allow(dead_code)] BufReader<std::process::ChildStdout>,
);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn serve(home: &Path) -> (Server, String) {
    let mut child = temper(home)
        .args(["hub", "serve", "--addr", "127.0.0.1:0", "--dir"])
        .arg(home.join("hub"))
        .stdout(Stdio::piped())
        .spawn()
        .expect("spawn hub");
    let stdout = child.stdout.take().expect("stdout");
    let mut line = String::new();
    let mut stdout = BufReader::new(stdout);
    stdout.read_line(&mut line).expect("read");
    let addr = line
        .trim()
        .strip_prefix("listening on ")
        .unwrap_or_else(|| panic!("unexpected first line {line:?}"))
        .to_string();
    (Server(child, stdout), format!("http://{addr}"))
}

#[test]
fn push_search_pull_and_eval_through_a_hub() {
    let home = tempfile::tempdir().expect("tmp");
    let home = home.path();
    let (server, url) = serve(home);
    let token = ok(temper(home)
        .args(["hub", "token", "create", "--namespace", "acme", "--dir"])
        .arg(home.join("hub"))
        .output()
        .expect("token"));
    let token = token.trim();
    assert!(token.starts_with("tmpr_"));

    ok(temper(home)
        .args(["login", &url, "--token", token])
        .output()
        .expect("login"));
    let login = home.join("config/hub.toml");
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(&login)
        .expect("login file")
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o600);

    // A scaffolded environment, given an owner, pushed twice with --bump.
    ok(temper(home)
        .args(["env", "new", "capitals", "--dir"])
        .arg(home)
        .output()
        .expect("new"));
    let dir = home.join("capitals");
    let toml = std::fs::read_to_string(dir.join("env.toml")).expect("env.toml");
    std::fs::write(
        dir.join("env.toml"),
        format!("namespace = \"acme\"\ntags = [\"demo\"]\n{toml}").replace(
            "TODO: one line on what this environment tests.",
            "Capitals of Europe",
        ),
    )
    .expect("write");
    let pushed = ok(temper(home)
        .args(["env", "push"])
        .arg(&dir)
        .output()
        .expect("push"));
    assert!(
        pushed.contains("published acme/capitals@0.1.0 sha256:"),
        "{pushed}"
    );
    let pushed = ok(temper(home)
        .args(["env", "push", "--bump", "minor"])
        .arg(&dir)
        .output()
        .expect("push"));
    assert!(pushed.contains("published acme/capitals@0.2.0"), "{pushed}");
    assert!(std::fs::read_to_string(dir.join("env.toml"))
        .expect("read")
        .contains("version = \"0.2.0\""));
    let again = temper(home)
        .args(["env", "push"])
        .arg(&dir)
        .output()
        .expect("push");
    assert!(!again.status.success());
    assert!(String::from_utf8_lossy(&again.stderr).contains("immutable"));

    let found = ok(temper(home)
        .args(["env", "search", "europe"])
        .output()
        .expect("search"));
    assert!(
        found.contains("acme/capitals") && found.contains("0.2.0"),
        "{found}"
    );
    let info = ok(temper(home)
        .args(["env", "info", "acme/capitals"])
        .output()
        .expect("info"));
    assert!(info.contains("0.1.0") && info.contains("0.2.0"), "{info}");
    ok(temper(home)
        .args(["env", "yank", "acme/capitals@0.2.0"])
        .output()
        .expect("yank"));
    let info = ok(temper(home)
        .args(["env", "info", "acme/capitals"])
        .output()
        .expect("info"));
    assert!(info.contains("(yanked)"), "{info}");

    // The yanked 0.2.0 is skipped by a range: eval gets 0.1.0 and records it.
    let rt = tokio::runtime::Runtime::new().expect("rt");
    let (addr, _) = rt
        .block_on(mock::spawn(MockConfig::default()))
        .expect("mock");
    let save = home.join("evals");
    let out = temper(home)
        .args([
            "eval",
            "acme/capitals@>=0.1",
            "-n",
            "2",
            "-m",
            "mock",
            "--quiet",
            "-b",
        ])
        .arg(format!("http://{addr}/v1"))
        .arg("--save-dir")
        .arg(&save)
        .output()
        .expect("eval");
    ok(out);
    let env_dir = std::fs::read_dir(&save)
        .expect("save")
        .next()
        .expect("env")
        .expect("entry")
        .path();
    let run = std::fs::read_dir(env_dir)
        .expect("runs")
        .next()
        .expect("run")
        .expect("entry")
        .path();
    let meta: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(run.join("metadata.json")).expect("meta"))
            .expect("json");
    let pkg = &meta["env_package"];
    assert_eq!(pkg["reference"], "acme/capitals@>=0.1");
    assert_eq!(pkg["id"], "acme/capitals");
    assert_eq!(pkg["version"], "0.1.0");
    assert!(
        pkg["digest"]
            .as_str()
            .is_some_and(|d| d.starts_with("sha256:")),
        "{meta}"
    );

    // Pulled, then pulled again with the hub down: the cache answers.
    let pulled = ok(temper(home)
        .args(["env", "pull", "acme/capitals@0.2.0"])
        .output()
        .expect("pull"));
    assert!(
        Path::new(pulled.trim()).join("env.toml").is_file(),
        "{pulled}"
    );
    drop(server);
    let offline = temper(home)
        .args(["env", "pull", "acme/capitals@0.2.0"])
        .output()
        .expect("pull");
    assert_eq!(ok(offline), pulled);
    // The cache is per hub: another hub's URL does not get this hub's copy.
    let elsewhere = temper(home)
        .args([
            "env",
            "pull",
            "acme/capitals@0.2.0",
            "--hub",
            "http://127.0.0.1:9",
        ])
        .output()
        .expect("pull");
    assert!(!elsewhere.status.success());

    // A train config's `[[env]] id` is a hub reference too: the dry run
    // shows the pulled version and digest the run would record.
    let model = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/models/tiny-qwen3");
    let cfg = home.join("rl.toml");
    std::fs::write(
        &cfg,
        format!(
            "[model]\npath = {:?}\n\n[[env]]\nid = \"acme/capitals@^0.1\"\n",
            model.display().to_string()
        ),
    )
    .expect("write rl.toml");
    let plan = ok(temper(home)
        .args(["train", "rl"])
        .arg(&cfg)
        .arg("--dry-run")
        .output()
        .expect("dry run"));
    assert!(
        plan.contains("acme/capitals@^0.1") && plan.contains("0.1.0") && plan.contains("sha256:"),
        "{plan}"
    );
}

/// HumanEval (validated in temper-env's rubric tests) published to a hub and
/// pulled back byte for byte. Runs when `TEMPER_HUMANEVAL` names the
/// environment directory (`scripts/fetch_humaneval.sh` prints it; CI sets it).
#[test]
fn humaneval_publishes_to_a_hub_and_pulls_back_identical() {
    let Some(src) = std::env::var_os("TEMPER_HUMANEVAL") else {
        eprintln!("skipped: TEMPER_HUMANEVAL is not set (scripts/fetch_humaneval.sh)");
        return;
    };
    let src = Path::new(&src);
    let home = tempfile::tempdir().expect("tmp");
    let home = home.path();
    let (_server, url) = serve(home);
    let token = ok(temper(home)
        .args(["hub", "token", "create", "--namespace", "openai", "--dir"])
        .arg(home.join("hub"))
        .output()
        .expect("token"));
    ok(temper(home)
        .args(["login", &url, "--token", token.trim()])
        .output()
        .expect("login"));
    ok(temper(home)
        .args(["env", "push"])
        .arg(src)
        .args(["--namespace", "openai"])
        .output()
        .expect("push"));
    let found = ok(temper(home)
        .args(["env", "search", "HumanEval"])
        .output()
        .expect("search"));
    assert!(found.contains("openai/humaneval"), "search: {found}");
    let dir = ok(temper(home)
        .args(["env", "pull", "openai/humaneval@1.0.3"])
        .output()
        .expect("pull"));
    let dir = Path::new(dir.trim());
    for f in ["env.toml", "humaneval.jsonl"] {
        let a = std::fs::read(src.join(f)).expect("source file");
        let b = std::fs::read(dir.join(f)).expect("pulled file");
        assert!(a == b, "{f} differs after push and pull");
    }
    let rows = std::fs::read_to_string(dir.join("humaneval.jsonl")).expect("rows");
    assert_eq!(rows.lines().count(), 164);
}

/// A hub that lies: `evil/thing` resolves (with the true digest) to the
/// archive of another package, `acme/huge` declares 2^50 bytes, and
/// `acme/flood` sends zeros with no length until the client hangs up. Each
/// answer closes its connection (and says so: a client reusing it would be
/// reset).
fn lying_hub(archive: Vec<u8>, digest: String) -> String {
    use std::io::{Read, Write};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let url = format!("http://{}", listener.local_addr().expect("addr"));
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(mut s) = conn else { return };
            let (archive, digest) = (archive.clone(), digest.clone());
            std::thread::spawn(move || {
                let mut req = Vec::new();
                let mut buf = [0u8; 1024];
                while !req.windows(4).any(|w| w == b"\r\n\r\n") {
                    match s.read(&mut buf) {
                        Ok(0) | Err(_) => return,
                        Ok(n) => req.extend_from_slice(&buf[..n]),
                    }
                }
                let line = String::from_utf8_lossy(&req)
                    .lines()
                    .next()
                    .unwrap_or_default()
                    .to_string();
                let Some((ns, name)) = ["evil/thing", "acme/huge", "acme/flood"]
                    .iter()
                    .find(|id| line.contains(&format!("/packages/{id}/")))
                    .and_then(|id| id.split_once('/'))
                else {
                    let _ = s.write_all(
                        b"HTTP/1.1 404 Not Found\r\nConnection: close\r\nContent-Length: 0\r\n\r\n",
                    );
                    return;
                };
                if line.contains("/resolve") {
                    let json = serde_json::json!({
                        "namespace": ns, "name": name, "version": "0.1.0",
                        "digest": digest, "size": archive.len(), "description": "",
                        "tags": [], "license": null, "temper": null, "yanked": false,
                        "published_at": "",
                    })
                    .to_string();
                    let _ = write!(
                        s,
                        "HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{json}",
                        json.len()
                    );
                    return;
                }
                let head = match name {
                    "thing" => format!(
                        "HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: {}\r\n\r\n",
                        archive.len()
                    ),
                    "huge" => "HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 1125899906842624\r\n\r\n".into(),
                    _ => "HTTP/1.1 200 OK\r\nConnection: close\r\nTransfer-Encoding: chunked\r\n\r\n".into(),
                };
                if s.write_all(head.as_bytes()).is_err() {
                    return;
                }
                if name == "thing" {
                    let _ = s.write_all(&archive);
                    return;
                }
                let zeros = vec![0u8; 64 << 10];
                loop {
                    let r = if name == "flood" {
                        write!(s, "{:x}\r\n", zeros.len())
                            .and_then(|()| s.write_all(&zeros))
                            .and_then(|()| s.write_all(b"\r\n"))
                    } else {
                        s.write_all(&zeros)
                    };
                    if r.is_err() {
                        return;
                    }
                }
            });
        }
    });
    url
}

#[test]
fn issue31_env_pull_refuses_a_hub_that_lies_or_floods() {
    let home = tempfile::tempdir().expect("tmp");
    let home = home.path();
    let src = home.join("capitals");
    std::fs::create_dir_all(&src).expect("mkdir");
    std::fs::write(
        src.join("env.toml"),
        "name = \"capitals\"\nnamespace = \"acme\"\nversion = \"0.1.0\"\n\
         [dataset]\neval = \"eval.jsonl\"\n[[rubric]]\nfunction = \"exact_match\"\n",
    )
    .expect("write");
    std::fs::write(
        src.join("eval.jsonl"),
        "{\"question\": \"2?\", \"answer\": \"4\"}\n",
    )
    .expect("write");
    let p = temper_hub::pack_dir(&src, None).expect("pack");
    let url = lying_hub(p.bytes, p.digest);
    let pull = |reference: &str, extra: &[&str]| {
        let out = temper(home)
            .args(["env", "pull", reference, "--hub", &url])
            .args(extra)
            .output()
            .expect("pull");
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    // Another package's archive under evil/thing: refused, nothing cached.
    let (code, err) = pull("evil/thing@0.1.0", &[]);
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("asked for evil/thing@0.1.0"), "{err}");
    let cache = home.join("cache");
    let mut stack = vec![cache.clone()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            assert!(
                name != "acme" && name != "evil" && !name.starts_with(".staging"),
                "{:?}",
                e.path()
            );
            if e.path().is_dir() {
                stack.push(e.path());
            }
        }
    }
    // 2^50 bytes declared: a clean error (exit 1), not an allocation abort.
    let (code, err) = pull("acme/huge@0.1.0", &[]);
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("download limit of 268435456"), "{err}");
    // An endless body: cut at --max-download-mb.
    let (code, err) = pull("acme/flood@0.1.0", &["--max-download-mb", "1"]);
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("download limit of 1048576"), "{err}");
}
