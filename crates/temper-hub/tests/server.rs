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
