//! The registry over real HTTP on a random loopback port: publish,
//! search, resolve, download, yank, delete, tokens, and the failure cases
//! (half-sent uploads, concurrent pushes of one version, tampered blobs).

mod common;
use common::listing;

use std::path::{Path, PathBuf};

use temper_hub::package::{pack_dir, Packed};
use temper_hub::server::create_token;
use temper_hub::{pull, Cache, EnvRef, HubClient, HubError, HubSettings, HubState, Scope};
use tokio::io::AsyncWriteExt;

struct Hub {
    url: String,
    dir: tempfile::TempDir,
    state: HubState,
}

async fn start(settings: HubSettings) -> Hub {
    let dir = tempfile::tempdir().expect("tmp");
    let state = HubState::open_dir(dir.path(), settings).expect("open hub");
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let url = format!("http://{}", listener.local_addr().expect("addr"));
    tokio::spawn(temper_server::http::serve(
        listener,
        temper_hub::app(state.clone()),
        temper_server::http::ConnLimits::default(),
        std::future::pending(),
    ));
    Hub { url, dir, state }
}

impl Hub {
    fn token(&self, scope: Scope) -> String {
        create_token(self.state.meta.as_ref(), &scope, "test").expect("token")
    }
    fn publisher(&self, ns: &str) -> HubClient {
        let t = self.token(Scope::Publish {
            namespace: ns.into(),
        });
        HubClient::new(&self.url, Some(t))
    }
    fn blob_files(&self) -> Vec<PathBuf> {
        let mut out = Vec::new();
        let mut stack = vec![self.dir.path().join("blobs")];
        while let Some(d) = stack.pop() {
            for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
                let p = e.path();
                if p.is_dir() {
                    stack.push(p);
                } else {
                    out.push(p);
                }
            }
        }
        out
    }
}

fn env_dir(
    root: &Path,
    ns: &str,
    name: &str,
    version: &str,
    description: &str,
    tags: &[&str],
) -> PathBuf {
    let dir = root.join(format!("{ns}-{name}-{version}-{}", description.len()));
    std::fs::create_dir_all(&dir).expect("mkdir");
    let tags: Vec<String> = tags.iter().map(|t| format!("{t:?}")).collect();
    std::fs::write(
        dir.join("env.toml"),
        format!(
            "name = \"{name}\"\nnamespace = \"{ns}\"\nversion = \"{version}\"\n\
             description = \"{description}\"\ntags = [{}]\n[dataset]\neval = \"eval.jsonl\"\n\
             [[rubric]]\nfunction = \"exact_match\"\n",
            tags.join(", ")
        ),
    )
    .expect("write");
    std::fs::write(
        dir.join("eval.jsonl"),
        "{\"question\": \"1+1?\", \"answer\": \"2\"}\n",
    )
    .expect("write");
    std::fs::write(
        dir.join("README.md"),
        format!("# {name}\n\n{description}\n"),
    )
    .expect("write");
    dir
}

fn pack(
    root: &Path,
    ns: &str,
    name: &str,
    version: &str,
    description: &str,
    tags: &[&str],
) -> Packed {
    pack_dir(&env_dir(root, ns, name, version, description, tags), None).expect("pack")
}

#[tokio::test]
async fn publish_search_resolve_download_yank_and_delete() {
    let hub = start(HubSettings::default()).await;
    let src = tempfile::tempdir().expect("tmp");
    let acme = hub.publisher("acme");
    for (v, d) in [
        ("1.0.0", "Capitals of Europe"),
        ("1.1.0", "Capitals of Europe"),
        ("2.0.0", "Capitals of the world"),
    ] {
        let p = pack(src.path(), "acme", "capitals", v, d, &["geo"]);
        let info = acme
            .publish(&p.manifest, p.bytes, None)
            .await
            .expect("publish");
        assert_eq!((info.version.as_str(), info.digest), (v, p.digest));
    }
    let p = pack(
        src.path(),
        "acme",
        "sums",
        "0.1.0",
        "Add two numbers",
        &["math"],
    );
    acme.publish(&p.manifest, p.bytes, None)
        .await
        .expect("publish");

    let anon = HubClient::new(&hub.url, None);
    let ids = |v: Vec<temper_hub::PackageSummary>| v.into_iter().map(|p| p.id).collect::<Vec<_>>();
    assert_eq!(
        ids(anon.search(None, None).await.expect("list")),
        ["acme/capitals", "acme/sums"]
    );
    assert_eq!(
        ids(anon.search(Some("WORLD"), None).await.expect("text")),
        ["acme/capitals"]
    );
    assert_eq!(
        ids(anon.search(None, Some("math")).await.expect("tag")),
        ["acme/sums"]
    );
    assert_eq!(
        ids(anon.search(Some("sums"), Some("geo")).await.expect("both")),
        Vec::<String>::new()
    );
    let listed = anon.search(None, Some("geo")).await.expect("tag");
    assert_eq!(
        (listed[0].latest.version.as_str(), listed[0].versions),
        ("2.0.0", 3)
    );

    let resolve = |s: &str| {
        let anon = anon.clone();
        let r = EnvRef::parse(s).expect("ref");
        async move { anon.resolve(&r).await.map(|v| v.version) }
    };
    assert_eq!(resolve("acme/capitals@^1").await.expect("^1"), "1.1.0");
    assert_eq!(resolve("acme/capitals").await.expect("latest"), "2.0.0");
    assert!(matches!(
        resolve("acme/capitals@^3").await,
        Err(HubError::NotFound(_))
    ));

    // Yanked: gone from resolution, still there by exact version.
    acme.yank("acme", "capitals", "1.1.0", true)
        .await
        .expect("yank");
    assert_eq!(resolve("acme/capitals@^1").await.expect("^1"), "1.0.0");
    let exact = anon
        .resolve(&EnvRef::parse("acme/capitals@1.1.0").expect("ref"))
        .await
        .expect("exact yanked");
    assert!(exact.yanked);
    let bytes = anon.download(&exact, None).await.expect("download yanked");
    assert_eq!(temper_hub::package::digest(&bytes), exact.digest);
    let blob = reqwest::get(format!("{}/api/v1/blobs/{}", hub.url, exact.digest))
        .await
        .expect("blob");
    assert_eq!(
        blob.bytes().await.expect("bytes").as_ref(),
        bytes.as_slice()
    );

    // Delete: gone, its blob removed, and the number is never reused.
    acme.delete("acme", "capitals", "2.0.0")
        .await
        .expect("delete");
    assert_eq!(resolve("acme/capitals").await.expect("latest"), "1.0.0");
    let again = pack(
        src.path(),
        "acme",
        "capitals",
        "2.0.0",
        "Capitals, again",
        &[],
    );
    let e = acme
        .publish(&again.manifest, again.bytes, None)
        .await
        .expect_err("reused");
    assert!(matches!(e, HubError::VersionExists(_)), "{e}");
    assert_eq!(hub.blob_files().len(), 3, "{:?}", hub.blob_files());

    let metrics = reqwest::get(format!("{}/metrics", hub.url))
        .await
        .expect("metrics")
        .text()
        .await
        .expect("text");
    assert!(
        metrics.contains("temper_hub_published_total 4"),
        "{metrics}"
    );
    assert!(
        metrics.contains("temper_hub_publish_rejected_total 1"),
        "{metrics}"
    );
    let health = reqwest::get(format!("{}/health", hub.url))
        .await
        .expect("health");
    assert_eq!(health.status(), 200);
}

#[tokio::test]
async fn writes_need_a_token_for_the_namespace_and_versions_are_immutable() {
    let hub = start(HubSettings::default()).await;
    let src = tempfile::tempdir().expect("tmp");
    let p = pack(src.path(), "acme", "capitals", "1.0.0", "Capitals", &[]);
    let status = |e: HubError| match e {
        HubError::Remote { status, .. } => status,
        other => panic!("expected an HTTP error, got {other}"),
    };
    let anon = HubClient::new(&hub.url, None);
    let e = anon
        .publish(&p.manifest, p.bytes.clone(), None)
        .await
        .expect_err("anonymous publish");
    assert_eq!(status(e), 401);
    let bogus = HubClient::new(&hub.url, Some("tmpr_not-a-token".into()));
    assert_eq!(
        status(
            bogus
                .publish(&p.manifest, p.bytes.clone(), None)
                .await
                .expect_err("bogus")
        ),
        401
    );
    let other = hub.publisher("other");
    assert_eq!(
        status(
            other
                .publish(&p.manifest, p.bytes.clone(), None)
                .await
                .expect_err("other ns")
        ),
        403
    );
    let reader = HubClient::new(&hub.url, Some(hub.token(Scope::Read)));
    assert_eq!(
        status(
            reader
                .publish(&p.manifest, p.bytes.clone(), None)
                .await
                .expect_err("read")
        ),
        403
    );

    let acme = hub.publisher("acme");
    acme.publish(&p.manifest, p.bytes.clone(), None)
        .await
        .expect("publish");
    // The same version with other bytes: refused.
    let changed = pack(
        src.path(),
        "acme",
        "capitals",
        "1.0.0",
        "Capitals, changed",
        &[],
    );
    assert_ne!(changed.digest, p.digest);
    let e = acme
        .publish(&changed.manifest, changed.bytes, None)
        .await
        .expect_err("overwrite");
    assert!(matches!(e, HubError::VersionExists(_)), "{e}");
    assert_eq!(
        status(
            other
                .yank("acme", "capitals", "1.0.0", true)
                .await
                .expect_err("yank")
        ),
        403
    );
    assert_eq!(
        status(
            other
                .delete("acme", "capitals", "1.0.0")
                .await
                .expect_err("delete")
        ),
        403
    );
    // Tokens are stored hashed: the database never holds one.
    let token = hub.token(Scope::Read);
    let db = std::fs::read(hub.dir.path().join("hub.sqlite")).expect("db");
    assert!(!db.windows(token.len()).any(|w| w == token.as_bytes()));
}

#[tokio::test]
async fn a_private_hub_needs_a_token_to_read() {
    let hub = start(HubSettings {
        anonymous_read: false,
        ..Default::default()
    })
    .await;
    let anon = HubClient::new(&hub.url, None);
    match anon.search(None, None).await {
        Err(HubError::Remote { status: 401, .. }) => {}
        other => panic!("anonymous read on a private hub: {other:?}"),
    }
    let page = reqwest::get(&hub.url).await.expect("page");
    assert_eq!(page.status(), 401);
    let reader = HubClient::new(&hub.url, Some(hub.token(Scope::Read)));
    assert!(reader.search(None, None).await.expect("read").is_empty());
}

#[tokio::test]
async fn a_half_sent_upload_leaves_no_version_and_no_blob() {
    let hub = start(HubSettings::default()).await;
    let src = tempfile::tempdir().expect("tmp");
    let p = pack(src.path(), "acme", "capitals", "1.0.0", "Capitals", &[]);
    let token = hub.token(Scope::Publish {
        namespace: "acme".into(),
    });
    let addr = hub.url.trim_start_matches("http://");
    let mut s = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let head = format!(
        "POST /api/v1/packages/acme/capitals HTTP/1.1\r\nHost: {addr}\r\nAuthorization: Bearer {token}\r\n\
         Content-Type: application/gzip\r\nContent-Length: {}\r\n\r\n",
        p.bytes.len()
    );
    s.write_all(head.as_bytes()).await.expect("head");
    s.write_all(&p.bytes[..p.bytes.len() / 2])
        .await
        .expect("half");
    s.flush().await.expect("flush");
    drop(s);
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    let anon = HubClient::new(&hub.url, None);
    assert!(matches!(
        anon.info("acme", "capitals").await,
        Err(HubError::NotFound(_))
    ));
    assert!(hub.blob_files().is_empty(), "{:?}", hub.blob_files());
    // The whole upload then goes through.
    let acme = HubClient::new(&hub.url, Some(token));
    acme.publish(&p.manifest, p.bytes, None)
        .await
        .expect("publish");
}

#[tokio::test]
async fn of_concurrent_pushes_of_one_version_exactly_one_wins() {
    let hub = start(HubSettings::default()).await;
    let src = tempfile::tempdir().expect("tmp");
    let acme = hub.publisher("acme");
    // Eight different archives, all claiming acme/capitals@1.0.0.
    let packs: Vec<Packed> = (0..8)
        .map(|i| {
            pack(
                src.path(),
                "acme",
                "capitals",
                "1.0.0",
                &format!("take {}", "x".repeat(i + 1)),
                &[],
            )
        })
        .collect();
    let tasks: Vec<_> = packs
        .iter()
        .map(|p| {
            let (c, m, b) = (acme.clone(), p.manifest.clone(), p.bytes.clone());
            tokio::spawn(async move { c.publish(&m, b, None).await })
        })
        .collect();
    let mut winners = Vec::new();
    let mut conflicts = 0;
    for t in tasks {
        match t.await.expect("task") {
            Ok(v) => winners.push(v),
            Err(HubError::VersionExists(_)) => conflicts += 1,
            Err(e) => panic!("unexpected: {e}"),
        }
    }
    assert_eq!((winners.len(), conflicts), (1, 7));
    let info = acme.info("acme", "capitals").await.expect("info");
    assert_eq!(info.versions.len(), 1);
    let bytes = acme
        .download(&info.versions[0], None)
        .await
        .expect("download");
    assert_eq!(temper_hub::package::digest(&bytes), winners[0].digest);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pulls_are_cached_offline_and_a_tampered_blob_is_refused() {
    let hub = start(HubSettings::default()).await;
    let src = tempfile::tempdir().expect("tmp");
    let acme = hub.publisher("acme");
    let v1 = pack(src.path(), "acme", "capitals", "1.0.0", "Capitals", &[]);
    acme.publish(&v1.manifest, v1.bytes.clone(), None)
        .await
        .expect("publish");
    let cache_dir = tempfile::tempdir().expect("tmp");
    let cache = Cache::new(cache_dir.path());
    let r = EnvRef::parse("acme/capitals@^1").expect("ref");
    let c = pull(Some(&acme), &cache, &r, false, None)
        .await
        .expect("pull");
    assert_eq!(
        (c.digest.as_str(), c.from_cache),
        (v1.digest.as_str(), false)
    );
    assert!(c.dir.join("eval.jsonl").is_file());

    // No client at all: a cached pull cannot touch the network.
    let again = pull(None, &cache, &r, false, None)
        .await
        .expect("cached pull");
    assert!(again.from_cache);
    assert_eq!(again.dir, c.dir);

    // 1.1.0 published, then its blob corrupted on the hub's disk.
    let v2 = pack(src.path(), "acme", "capitals", "1.1.0", "Capitals v2", &[]);
    acme.publish(&v2.manifest, v2.bytes.clone(), None)
        .await
        .expect("publish");
    let blobs = temper_hub::FsBlobs::open(&hub.dir.path().join("blobs")).expect("blobs");
    let path = blobs.path(&v2.digest).expect("path");
    let mut bad = v2.bytes.clone();
    let last = bad.len() - 1;
    bad[last] ^= 0xff;
    std::fs::write(&path, bad).expect("tamper");
    let before = listing(cache_dir.path());
    let e = pull(Some(&acme), &cache, &r, true, None)
        .await
        .expect_err("tampered pull");
    assert!(matches!(e, HubError::DigestMismatch { .. }), "{e}");
    assert_eq!(listing(cache_dir.path()), before, "the cache changed");
    // Restored: the update goes through.
    std::fs::write(&path, &v2.bytes).expect("restore");
    let c2 = pull(Some(&acme), &cache, &r, true, None)
        .await
        .expect("update");
    assert_eq!(c2.version.to_string(), "1.1.0");
}

#[tokio::test]
async fn the_web_page_lists_searches_and_shows_an_environment() {
    let hub = start(HubSettings::default()).await;
    let src = tempfile::tempdir().expect("tmp");
    let acme = hub.publisher("acme");
    let p = pack(
        src.path(),
        "acme",
        "capitals",
        "1.2.0",
        "Capitals <of> Europe",
        &["geo"],
    );
    acme.publish(&p.manifest, p.bytes, None)
        .await
        .expect("publish");
    let get = |path: String| async move {
        let r = reqwest::get(path).await.expect("get");
        (r.status().as_u16(), r.text().await.expect("text"))
    };
    let (s, index) = get(format!("{}/", hub.url)).await;
    assert_eq!(s, 200);
    assert!(index.contains("href=\"/envs/acme/capitals\""), "{index}");
    assert!(index.contains("Capitals &lt;of&gt; Europe"), "{index}");
    let (_, none) = get(format!("{}/?q=nothing-like-this", hub.url)).await;
    assert!(none.contains("0 environments"), "{none}");
    let (s, page) = get(format!("{}/envs/acme/capitals", hub.url)).await;
    assert_eq!(s, 200);
    assert!(
        page.contains("<h1>capitals</h1>"),
        "README not rendered: {page}"
    );
    assert!(page.contains(&p.digest), "{page}");
    assert!(page.contains("temper eval acme/capitals@1.2.0"), "{page}");
    let (s, _) = get(format!("{}/envs/acme/nope", hub.url)).await;
    assert_eq!(s, 404);
}

/// Send a request head (and the first KiB of a body it promises), then
/// read the answer's status line: within `wait`, else `None`.
async fn status_before_body(addr: &str, head: &str, wait: std::time::Duration) -> Option<String> {
    use tokio::io::AsyncReadExt;
    let mut s = tokio::net::TcpStream::connect(addr).await.expect("connect");
    s.write_all(head.as_bytes()).await.expect("head");
    s.write_all(&[0u8; 1024]).await.expect("body start");
    s.flush().await.expect("flush");
    let read = async {
        let mut got = Vec::new();
        let mut buf = [0u8; 1024];
        while !got.windows(4).any(|w| w == b"\r\n\r\n") {
            match s.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => got.extend_from_slice(&buf[..n]),
            }
        }
        String::from_utf8_lossy(&got)
            .lines()
            .next()
            .unwrap_or_default()
            .to_string()
    };
    tokio::time::timeout(wait, read).await.ok()
}

/// Tests that measure this process's memory take turns.
static MEMORY: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

fn rss_bytes() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").expect("status");
    let kb: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmRSS");
    kb * 1024
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn issue31_publish_without_token_is_refused_before_the_body() {
    let hub = start(HubSettings::default()).await;
    let addr = hub.url.trim_start_matches("http://").to_string();
    let wait = std::time::Duration::from_secs(5);
    // A terabyte promised, a KiB sent: the answer cannot wait for the rest.
    let head = |path: &str, auth: &str| {
        format!(
            "POST {path} HTTP/1.1\r\nHost: {addr}\r\n{auth}Content-Type: application/gzip\r\n\
             Content-Length: {}\r\n\r\n",
            1u64 << 40
        )
    };
    let publish = "/api/v1/packages/acme/capitals";
    let yank = "/api/v1/packages/acme/capitals/1.0.0/yank";
    // Eight at once with no token (the attack), and a bogus token.
    let mut tasks = Vec::new();
    for i in 0..8 {
        let (addr, h) = (
            addr.clone(),
            head(if i % 2 == 0 { publish } else { yank }, ""),
        );
        tasks.push(tokio::spawn(async move {
            status_before_body(&addr, &h, wait).await
        }));
    }
    for t in tasks {
        let status = t.await.expect("task").expect("the hub waited for the body");
        assert!(status.starts_with("HTTP/1.1 401"), "{status}");
    }
    let bogus = "Authorization: Bearer tmpr_bogus\r\n";
    for path in [publish, yank] {
        let status = status_before_body(&addr, &head(path, bogus), wait)
            .await
            .expect("the hub waited for the body");
        assert!(status.starts_with("HTTP/1.1 401"), "{path}: {status}");
    }
    // Authorised, but a declared length over the limit: 413, also at once.
    let token = hub.token(Scope::Publish {
        namespace: "acme".into(),
    });
    let auth = format!("Authorization: Bearer {token}\r\n");
    for path in [publish, yank] {
        let status = status_before_body(&addr, &head(path, &auth), wait)
            .await
            .expect("the hub waited for the body");
        assert!(status.starts_with("HTTP/1.1 413"), "{path}: {status}");
    }

    // Authorised and with no declared length, 160 MiB of junk streams to
    // disk, not memory, and is refused as not an archive.
    let _turn = MEMORY.lock().await;
    let base = rss_bytes();
    let peak = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(base));
    let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let sampler = {
        let (peak, done) = (peak.clone(), done.clone());
        tokio::spawn(async move {
            while !done.load(std::sync::atomic::Ordering::Relaxed) {
                peak.fetch_max(rss_bytes(), std::sync::atomic::Ordering::Relaxed);
                tokio::time::sleep(std::time::Duration::from_millis(10)).await;
            }
        })
    };
    let chunk = bytes::Bytes::from(vec![0x5au8; 1 << 20]);
    let sent: u64 = 160 << 20;
    let body = futures::stream::iter((0..160).map(move |_| Ok::<_, std::io::Error>(chunk.clone())));
    let resp = reqwest::Client::new()
        .post(format!("{}{publish}", hub.url))
        .bearer_auth(&token)
        .body(reqwest::Body::wrap_stream(body))
        .send()
        .await
        .expect("upload");
    done.store(true, std::sync::atomic::Ordering::Relaxed);
    sampler.await.expect("sampler");
    assert_eq!(resp.status(), 400, "{:?}", resp.text().await);
    let grew = peak
        .load(std::sync::atomic::Ordering::Relaxed)
        .saturating_sub(base);
    assert!(
        grew < sent / 3,
        "memory grew {} MiB for a {} MiB upload",
        grew >> 20,
        sent >> 20
    );
    // Nothing of it stays on disk.
    assert!(hub.blob_files().is_empty(), "{:?}", hub.blob_files());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn issue31_downloads_stream_from_disk_not_memory() {
    let hub = start(HubSettings::default()).await;
    let src = tempfile::tempdir().expect("tmp");
    let dir = env_dir(src.path(), "acme", "big", "1.0.0", "Big", &[]);
    // 32 MiB that gzip cannot shrink.
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    let data: Vec<u8> = (0..32u32 << 20)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect();
    std::fs::write(dir.join("big.bin"), &data).expect("write");
    drop(data);
    let p = pack_dir(&dir, None).expect("pack");
    let size = p.bytes.len() as u64;
    hub.publisher("acme")
        .publish(&p.manifest, p.bytes, None)
        .await
        .expect("publish");
    let _turn = MEMORY.lock().await;
    let base = rss_bytes();
    // Six downloads at once whose clients read one KiB and stall: the hub
    // must not hold six archives to send.
    let addr = hub.url.trim_start_matches("http://").to_string();
    let mut conns = Vec::new();
    for _ in 0..6 {
        use tokio::io::AsyncReadExt;
        let mut s = tokio::net::TcpStream::connect(&addr)
            .await
            .expect("connect");
        s.write_all(
            format!(
                "GET /api/v1/packages/acme/big/1.0.0/download HTTP/1.1\r\nHost: {addr}\r\n\r\n"
            )
            .as_bytes(),
        )
        .await
        .expect("request");
        let mut buf = [0u8; 1024];
        let n = s.read(&mut buf).await.expect("read");
        let head = String::from_utf8_lossy(&buf[..n]).to_string();
        assert!(head.starts_with("HTTP/1.1 200"), "{head}");
        assert!(
            head.to_ascii_lowercase()
                .contains(&format!("content-length: {size}")),
            "{head}"
        );
        conns.push(s);
    }
    tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    let grew = rss_bytes().saturating_sub(base);
    drop(conns);
    assert!(
        grew < 3 * size,
        "memory grew {} MiB for six stalled downloads of {} MiB",
        grew >> 20,
        size >> 20
    );
    // And a download that is read goes through whole.
    let bytes = HubClient::new(&hub.url, None)
        .download(
            &hub.publisher("acme")
                .info("acme", "big")
                .await
                .expect("info")
                .latest,
            None,
        )
        .await
        .expect("download");
    assert_eq!(bytes.len() as u64, size);
}

/// Every `href="..."` and `src="..."` value in `html`.
fn urls(html: &str) -> Vec<String> {
    let mut out = Vec::new();
    for attr in ["href=\"", "src=\""] {
        let mut rest = html;
        while let Some(i) = rest.find(attr) {
            rest = &rest[i + attr.len()..];
            let end = rest.find('"').unwrap_or(rest.len());
            out.push(rest[..end].to_string());
        }
    }
    out
}

#[tokio::test]
async fn issue31_readme_links_cannot_run_script() {
    let hub = start(HubSettings::default()).await;
    let src = tempfile::tempdir().expect("tmp");
    let dir = env_dir(src.path(), "acme", "capitals", "1.0.0", "Capitals", &[]);
    std::fs::write(
        dir.join("README.md"),
        "# capitals\n\n\
         [a](javascript:alert(1)) [b](JaVaScRiPt:alert(1)) [c](jav&#x61;script:alert(1))\n\
         [d](java&#09;script:alert(1)) [e](<java\u{1}script:alert(1)>) [f](data:text/html,x)\n\
         ![g](javascript:alert(1)) ![h](data:image/svg+xml;base64,PHN2Zz4=) [i](vbscript:x)\n\
         <javascript:alert(1)> [j][r] [k](%20javascript:alert(1))\n\n\
         [r]: javascript:alert(1)\n\n\
         [ok1](https://example.com/docs) [ok2](docs/usage.md) [ok3](#usage) ![ok4](http://example.com/x.png)\n",
    )
    .expect("write");
    let p = pack_dir(&dir, None).expect("pack");
    hub.publisher("acme")
        .publish(&p.manifest, p.bytes, None)
        .await
        .expect("publish");
    let resp = reqwest::get(format!("{}/envs/acme/capitals", hub.url))
        .await
        .expect("get");
    assert_eq!(resp.status(), 200);
    let header = |name: &str| {
        resp.headers()
            .get(name)
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_string()
    };
    let csp = header("content-security-policy");
    assert!(csp.contains("default-src 'none'"), "{csp}");
    assert!(csp.contains("script-src 'none'"), "{csp}");
    assert_eq!(header("x-content-type-options"), "nosniff");
    assert_eq!(header("referrer-policy"), "no-referrer");
    let page = resp.text().await.expect("text");
    // The page's own style is the one the policy allows by hash.
    let style = page
        .split_once("<style>")
        .and_then(|(_, r)| r.split_once("</style>"))
        .map(|(s, _)| s)
        .expect("style");
    use base64::Engine;
    use sha2::Digest;
    let hash = base64::engine::general_purpose::STANDARD.encode(sha2::Sha256::digest(style));
    assert!(csp.contains(&format!("style-src 'sha256-{hash}'")), "{csp}");
    let found = urls(&page);
    for u in &found {
        let squeezed: String = u
            .chars()
            .filter(|c| !c.is_ascii_whitespace() && !c.is_control())
            .collect::<String>()
            .to_ascii_lowercase();
        for scheme in ["javascript:", "data:", "vbscript:", "&#"] {
            assert!(!squeezed.contains(scheme), "live {u:?} in {page}");
        }
    }
    for ok in [
        "https://example.com/docs",
        "docs/usage.md",
        "#usage",
        "http://example.com/x.png",
    ] {
        assert!(found.iter().any(|u| u == ok), "{ok} lost: {found:?}");
    }
    // The API answers carry the same headers.
    let api = reqwest::get(format!("{}/api/v1/search", hub.url))
        .await
        .expect("get");
    assert_eq!(
        api.headers()
            .get("x-content-type-options")
            .and_then(|v| v.to_str().ok()),
        Some("nosniff")
    );
}

/// A hub that answers every resolve with `resolved` and every download
/// with `archive`, whatever was asked.
async fn lying_hub(resolved: temper_hub::VersionInfo, archive: Vec<u8>) -> String {
    use axum::routing::get;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let url = format!("http://{}", listener.local_addr().expect("addr"));
    let app = axum::Router::new()
        .route(
            "/api/v1/packages/{ns}/{name}/resolve",
            get(move || {
                let v = resolved.clone();
                async move { axum::Json(v) }
            }),
        )
        .route(
            "/api/v1/packages/{ns}/{name}/{version}/download",
            get(move || {
                let a = archive.clone();
                async move { a }
            }),
        );
    tokio::spawn(temper_server::http::serve(
        listener,
        app,
        temper_server::http::ConnLimits::default(),
        std::future::pending(),
    ));
    url
}

fn info_of(p: &Packed, namespace: &str, name: &str, version: &str) -> temper_hub::VersionInfo {
    temper_hub::VersionInfo {
        namespace: namespace.into(),
        name: name.into(),
        version: version.into(),
        digest: p.digest.clone(),
        size: p.bytes.len() as u64,
        description: String::new(),
        tags: vec![],
        license: None,
        temper: None,
        yanked: false,
        published_at: String::new(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn issue31_pull_cannot_poison_the_cache_across_names_or_hubs() {
    let src = tempfile::tempdir().expect("tmp");
    let real = pack(src.path(), "acme", "capitals", "0.1.0", "Capitals", &[]);
    let cache_dir = tempfile::tempdir().expect("tmp");
    let cache = Cache::new(cache_dir.path());
    // A hub answering evil/thing with acme/capitals@0.1.0's archive (and
    // its true digest): refused, and nothing of acme lands in the cache.
    let evil = lying_hub(info_of(&real, "evil", "thing", "0.1.0"), real.bytes.clone()).await;
    let evil = HubClient::new(&evil, None);
    let e = pull(
        Some(&evil),
        &cache,
        &EnvRef::parse("evil/thing@0.1.0").expect("ref"),
        false,
        None,
    )
    .await
    .expect_err("planted");
    assert!(e.to_string().contains("asked for evil/thing@0.1.0"), "{e}");
    // A hub resolving a request to another package or version: refused
    // before any download.
    for (ask, info) in [
        (
            "acme/capitals@0.1.0",
            info_of(&real, "evil", "thing", "0.1.0"),
        ),
        (
            "acme/capitals@^1",
            info_of(&real, "acme", "capitals", "0.1.0"),
        ),
    ] {
        let liar = lying_hub(info, real.bytes.clone()).await;
        let e = pull(
            Some(&HubClient::new(&liar, None)),
            &cache,
            &EnvRef::parse(ask).expect("ref"),
            false,
            None,
        )
        .await
        .expect_err("wrong answer accepted");
        assert!(e.to_string().contains("the hub resolved"), "{ask}: {e}");
    }
    let planted: Vec<String> = listing(cache_dir.path())
        .into_iter()
        .filter(|p| p.contains("acme") || p.contains("evil") || p.contains(".staging"))
        .collect();
    assert!(planted.is_empty(), "{planted:?}");

    // Two honest hubs, each with its own acme/capitals@0.1.0.
    let (a, b) = (
        start(HubSettings::default()).await,
        start(HubSettings::default()).await,
    );
    let theirs = pack(
        src.path(),
        "acme",
        "capitals",
        "0.1.0",
        "Other capitals",
        &[],
    );
    assert_ne!(real.digest, theirs.digest);
    let (pa, pb) = (a.publisher("acme"), b.publisher("acme"));
    pa.publish(&real.manifest, real.bytes.clone(), None)
        .await
        .expect("publish a");
    pb.publish(&theirs.manifest, theirs.bytes.clone(), None)
        .await
        .expect("publish b");
    let r = EnvRef::parse("acme/capitals@0.1.0").expect("ref");
    let from_a = pull(Some(&pa), &cache, &r, false, None)
        .await
        .expect("pull a");
    let from_b = pull(Some(&pb), &cache, &r, false, None)
        .await
        .expect("pull b");
    assert_eq!(
        (
            from_a.digest.as_str(),
            from_b.digest.as_str(),
            from_b.from_cache
        ),
        (real.digest.as_str(), theirs.digest.as_str(), false)
    );
    assert_ne!(from_a.dir, from_b.dir);
    let again = pull(Some(&pa), &cache, &r, false, None)
        .await
        .expect("pull a");
    assert_eq!(
        (again.digest, again.from_cache),
        (real.digest.clone(), true)
    );
    let e = pull(None, &cache, &r, false, None)
        .await
        .expect_err("which hub?");
    assert!(e.to_string().contains("several hubs"), "{e}");
}

/// A hub that answers resolve with a small valid answer and every
/// download with `head` followed by zeros until the client hangs up.
async fn flooding_hub(head: &'static str) -> String {
    use tokio::io::AsyncReadExt;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let url = format!("http://{}", listener.local_addr().expect("addr"));
    tokio::spawn(async move {
        loop {
            let Ok((mut s, _)) = listener.accept().await else {
                return;
            };
            tokio::spawn(async move {
                let mut req = Vec::new();
                let mut buf = [0u8; 1024];
                while !req.windows(4).any(|w| w == b"\r\n\r\n") {
                    match s.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => req.extend_from_slice(&buf[..n]),
                    }
                }
                let line = String::from_utf8_lossy(&req)
                    .lines()
                    .next()
                    .unwrap_or_default()
                    .to_string();
                if line.contains("/resolve") {
                    let json = format!(
                        "{{\"namespace\":\"acme\",\"name\":\"capitals\",\"version\":\"0.1.0\",\
                         \"digest\":\"sha256:{}\",\"size\":1,\"description\":\"\",\"tags\":[],\
                         \"license\":null,\"temper\":null,\"yanked\":false,\"published_at\":\"\"}}",
                        "0".repeat(64)
                    );
                    let _ = s
                        .write_all(
                            format!(
                                "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n\
                                 Content-Length: {}\r\nConnection: close\r\n\r\n{json}",
                                json.len()
                            )
                            .as_bytes(),
                        )
                        .await;
                    return;
                }
                if s.write_all(head.as_bytes()).await.is_err() {
                    return;
                }
                let zeros = vec![0u8; 64 << 10];
                let chunked = head.contains("chunked");
                loop {
                    let r = if chunked {
                        let mut c = format!("{:x}\r\n", zeros.len()).into_bytes();
                        c.extend_from_slice(&zeros);
                        c.extend_from_slice(b"\r\n");
                        s.write_all(&c).await
                    } else {
                        s.write_all(&zeros).await
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn issue31_a_hub_cannot_crash_the_client_with_a_huge_download() {
    let r = EnvRef::parse("acme/capitals@0.1.0").expect("ref");
    for (head, cap) in [
        // 2^50 bytes declared: refused before a byte is read or reserved.
        (
            "HTTP/1.1 200 OK\r\nContent-Length: 1125899906842624\r\n\r\n",
            (temper_hub::server::DEFAULT_MAX_PACKAGE_MB as u64) << 20,
        ),
        // No length, an endless body: cut at the client's cap.
        (
            "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n",
            4 << 20,
        ),
    ] {
        let url = flooding_hub(head).await;
        let cache_dir = tempfile::tempdir().expect("tmp");
        let cache = Cache::new(cache_dir.path());
        let client = HubClient::new(&url, None).with_max_download(cap);
        let e = tokio::time::timeout(
            std::time::Duration::from_secs(30),
            pull(Some(&client), &cache, &r, false, None),
        )
        .await
        .expect("the pull hung")
        .expect_err("flood accepted");
        assert!(
            matches!(&e, HubError::PayloadTooLarge(m) if m.contains("download limit")),
            "{e}"
        );
        // Nothing is left behind but the hub's directory and its URL file.
        let left: Vec<String> = listing(cache_dir.path())
            .into_iter()
            .filter(|p| p.contains('/'))
            .filter(|p| !p.ends_with(".temper-hub"))
            .collect();
        assert!(left.is_empty(), "{left:?}");
    }
}

#[tokio::test]
async fn issue31_uninstallable_packages_are_refused_at_publish() {
    let hub = start(HubSettings::default()).await;
    let acme = hub.publisher("acme");
    let src = tempfile::tempdir().expect("tmp");
    let good = pack(src.path(), "acme", "capitals", "1.0.0", "Capitals", &[]);
    for (what, archive, word) in common::uninstallable_packages() {
        let e = acme
            .publish(&good.manifest, archive, None)
            .await
            .expect_err(what);
        match &e {
            HubError::Remote {
                status: 400,
                message,
                ..
            } => assert!(message.contains(word), "{what}: {message}"),
            other => panic!("{what}: expected a 400, got {other}"),
        }
    }
    assert!(matches!(
        acme.info("acme", "capitals").await,
        Err(HubError::NotFound(_))
    ));
    assert!(hub.blob_files().is_empty(), "{:?}", hub.blob_files());
    acme.publish(&good.manifest, good.bytes, None)
        .await
        .expect("a good package still publishes");
}

/// A hub that accepts the connection and then says nothing fails the call
/// after the read timeout instead of hanging it.
#[tokio::test]
async fn a_silent_hub_times_out_instead_of_hanging() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let url = format!("http://{}", listener.local_addr().expect("addr"));
    // Accept and hold connections open without ever answering.
    let silent = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((sock, _)) = listener.accept().await {
            held.push(sock);
        }
    });
    let client = HubClient::new(&url, None).with_timeouts(
        std::time::Duration::from_secs(2),
        std::time::Duration::from_millis(500),
    );
    let started = std::time::Instant::now();
    let r = tokio::time::timeout(
        std::time::Duration::from_secs(20),
        client.search(None, None),
    )
    .await
    .expect("the client hung past its read timeout");
    let err = r.expect_err("a silent hub cannot answer").to_string();
    assert!(
        err.to_lowercase().contains("timed out") || err.contains("timeout"),
        "{err}"
    );
    assert!(started.elapsed() < std::time::Duration::from_secs(10));
    silent.abort();
}
