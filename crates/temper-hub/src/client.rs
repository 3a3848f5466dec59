//! [`HubClient`]: the hub's HTTP API from Rust; [`Cache`]: pulled
//! packages on disk; [`pull`]: a reference to a local directory, offline
//! when the cache already holds a match.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use futures::StreamExt;
use serde::de::DeserializeOwned;

use crate::package::{self, Limits, PackageManifest};
use crate::refs::{EnvRef, VersionSpec};
use crate::server::{PackageInfo, PackageSummary};
use crate::store::VersionInfo;
use crate::HubError;

/// Called with (bytes done, bytes total) as an upload or download goes.
pub type Progress = Arc<dyn Fn(u64, u64) + Send + Sync>;

/// Most bytes of a hub's error message or JSON answer the client reads;
/// a hub sending more is refused, not buffered.
const MAX_ERROR_BYTES: usize = 64 << 10;
const MAX_JSON_BYTES: usize = 16 << 20;

/// A client of one hub.
#[derive(Clone)]
pub struct HubClient {
    base: String,
    token: Option<String>,
    http: reqwest::Client,
    max_download: u64,
}

/// Read at most `max` bytes of a response body: more is an error, and
/// nothing is reserved from the `Content-Length` the server claims.
async fn read_capped(
    mut resp: reqwest::Response,
    max: usize,
    what: &str,
) -> Result<Vec<u8>, HubError> {
    let mut out = Vec::new();
    while let Some(chunk) = resp.chunk().await? {
        if out.len() + chunk.len() > max {
            return Err(HubError::PayloadTooLarge(format!(
                "the hub's {what} is over {max} bytes"
            )));
        }
        out.extend_from_slice(&chunk);
    }
    Ok(out)
}

/// A hub that stops answering must not hang `temper env install` forever:
/// connecting gets [`CONNECT_TIMEOUT`], and each read of an answer (not the
/// whole download, which may be large and slow) [`READ_TIMEOUT`].
pub const CONNECT_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);
/// See [`CONNECT_TIMEOUT`].
pub const READ_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(60);

fn http_client(connect: std::time::Duration, read: std::time::Duration) -> reqwest::Client {
    reqwest::Client::builder()
        .connect_timeout(connect)
        .read_timeout(read)
        .build()
        // Building fails only where the TLS backend cannot start, and then
        // so does the plain constructor; keep its behaviour there.
        .unwrap_or_else(|_| reqwest::Client::new())
}

impl HubClient {
    /// A client of the hub at `base` (`http://host:port`), downloading at
    /// most the hub's default package limit per archive.
    pub fn new(base: &str, token: Option<String>) -> Self {
        HubClient {
            base: base.trim_end_matches('/').to_string(),
            token,
            http: http_client(CONNECT_TIMEOUT, READ_TIMEOUT),
            max_download: (crate::server::DEFAULT_MAX_PACKAGE_MB as u64) << 20,
        }
    }

    /// Refuse archives over `bytes` (a hub is not trusted to send what it
    /// says).
    pub fn with_max_download(mut self, bytes: u64) -> Self {
        self.max_download = bytes;
        self
    }

    /// Other limits than [`CONNECT_TIMEOUT`] and [`READ_TIMEOUT`].
    pub fn with_timeouts(
        mut self,
        connect: std::time::Duration,
        read: std::time::Duration,
    ) -> Self {
        self.http = http_client(connect, read);
        self
    }

    /// The hub's URL.
    pub fn base(&self) -> &str {
        &self.base
    }

    fn req(&self, method: reqwest::Method, path: &str) -> reqwest::RequestBuilder {
        let r = self.http.request(method, format!("{}{path}", self.base));
        match &self.token {
            Some(t) => r.bearer_auth(t),
            None => r,
        }
    }

    async fn check(&self, resp: reqwest::Response) -> Result<reqwest::Response, HubError> {
        if resp.status().is_success() {
            return Ok(resp);
        }
        let status = resp.status().as_u16();
        let url = resp.url().to_string();
        let text = match read_capped(resp, MAX_ERROR_BYTES, "error message").await {
            Ok(b) => String::from_utf8_lossy(&b).into_owned(),
            Err(e) => e.to_string(),
        };
        let message = serde_json::from_str::<serde_json::Value>(&text)
            .ok()
            .and_then(|v| v.get("error").and_then(|e| e.as_str()).map(str::to_string))
            .unwrap_or(text);
        Err(match status {
            404 => HubError::NotFound(message),
            409 => HubError::VersionExists(message),
            _ => HubError::Remote {
                url,
                status,
                message,
            },
        })
    }

    async fn json<T: DeserializeOwned>(&self, resp: reqwest::Response) -> Result<T, HubError> {
        let resp = self.check(resp).await?;
        let url = resp.url().to_string();
        let bytes = read_capped(resp, MAX_JSON_BYTES, "answer").await?;
        serde_json::from_slice(&bytes)
            .map_err(|e| HubError::BadRequest(format!("{url}: not the JSON expected: {e}")))
    }

    async fn get_json<T: DeserializeOwned>(&self, path: &str) -> Result<T, HubError> {
        let resp = self.req(reqwest::Method::GET, path).send().await?;
        self.json(resp).await
    }

    /// The token's scope (`None` anonymous).
    pub async fn whoami(&self) -> Result<Option<String>, HubError> {
        let v: serde_json::Value = self.get_json("/api/v1/whoami").await?;
        Ok(v.get("scope").and_then(|s| s.as_str()).map(str::to_string))
    }

    /// Publish an archive.
    pub async fn publish(
        &self,
        manifest: &PackageManifest,
        archive: Vec<u8>,
        progress: Option<Progress>,
    ) -> Result<VersionInfo, HubError> {
        let total = archive.len() as u64;
        let data = bytes::Bytes::from(archive);
        // Chunks, so the progress callback sees the upload go.
        let chunks: Vec<bytes::Bytes> = (0..data.len())
            .step_by(256 * 1024)
            .map(|i| data.slice(i..(i + 256 * 1024).min(data.len())))
            .collect();
        let mut done = 0u64;
        let stream = futures::stream::iter(chunks).map(move |c| {
            done += c.len() as u64;
            if let Some(p) = &progress {
                p(done, total);
            }
            Ok::<_, std::io::Error>(c)
        });
        let resp = self
            .req(
                reqwest::Method::POST,
                &format!("/api/v1/packages/{}/{}", manifest.namespace, manifest.name),
            )
            .header(reqwest::header::CONTENT_TYPE, "application/gzip")
            .header(reqwest::header::CONTENT_LENGTH, total)
            .body(reqwest::Body::wrap_stream(stream))
            .send()
            .await?;
        self.json(resp).await
    }

    /// A package and its versions.
    pub async fn info(&self, namespace: &str, name: &str) -> Result<PackageInfo, HubError> {
        self.get_json(&format!("/api/v1/packages/{namespace}/{name}"))
            .await
    }

    /// Search by free text and/or tag.
    pub async fn search(
        &self,
        q: Option<&str>,
        tag: Option<&str>,
    ) -> Result<Vec<PackageSummary>, HubError> {
        let mut req = self.req(reqwest::Method::GET, "/api/v1/search");
        let mut params = Vec::new();
        if let Some(q) = q {
            params.push(("q", q));
        }
        if let Some(t) = tag {
            params.push(("tag", t));
        }
        req = req.query(&params);
        #[derive(serde::Deserialize)]
        struct Out {
            packages: Vec<PackageSummary>,
        }
        Ok(self.json::<Out>(req.send().await?).await?.packages)
    }

    /// The version `r` resolves to on the hub.
    pub async fn resolve(&self, r: &EnvRef) -> Result<VersionInfo, HubError> {
        let req = self
            .req(
                reqwest::Method::GET,
                &format!("/api/v1/packages/{}/{}/resolve", r.namespace, r.name),
            )
            .query(&[("version", r.spec.to_string())]);
        self.json(req.send().await?).await
    }

    /// An archive's bytes, unchecked but for the download cap.
    pub async fn download(
        &self,
        v: &VersionInfo,
        progress: Option<Progress>,
    ) -> Result<Vec<u8>, HubError> {
        let mut out = Vec::new();
        self.download_to(v, &mut out, progress).await?;
        Ok(out)
    }

    /// Stream an archive into `out`, at most the download cap (checked
    /// against the `Content-Length` before a byte is read, and against the
    /// bytes as they come); returns its digest and size.
    pub async fn download_to<W: tokio::io::AsyncWrite + Unpin>(
        &self,
        v: &VersionInfo,
        out: &mut W,
        progress: Option<Progress>,
    ) -> Result<(String, u64), HubError> {
        use sha2::Digest;
        use tokio::io::AsyncWriteExt;
        let resp = self
            .req(
                reqwest::Method::GET,
                &format!(
                    "/api/v1/packages/{}/{}/{}/download",
                    v.namespace, v.name, v.version
                ),
            )
            .send()
            .await?;
        let mut resp = self.check(resp).await?;
        let max = self.max_download;
        let too_large = |n: u64| {
            HubError::PayloadTooLarge(format!(
                "the hub sends {n} bytes for {}/{}@{}, over the download limit of {max} \
                 (--max-download-mb)",
                v.namespace, v.name, v.version
            ))
        };
        if let Some(n) = resp.content_length().filter(|&n| n > max) {
            return Err(too_large(n));
        }
        let total = resp.content_length().unwrap_or(v.size).min(max);
        let mut hash = sha2::Sha256::new();
        let mut done = 0u64;
        while let Some(chunk) = resp.chunk().await? {
            done += chunk.len() as u64;
            if done > max {
                return Err(too_large(done));
            }
            hash.update(&chunk);
            out.write_all(&chunk)
                .await
                .map_err(|e| HubError::Internal(format!("writing the download: {e}")))?;
            if let Some(p) = &progress {
                p(done, total.max(done));
            }
        }
        out.flush()
            .await
            .map_err(|e| HubError::Internal(format!("writing the download: {e}")))?;
        Ok((format!("sha256:{}", package::hex(&hash.finalize())), done))
    }

    /// Yank (or un-yank) a version.
    pub async fn yank(
        &self,
        namespace: &str,
        name: &str,
        version: &str,
        yanked: bool,
    ) -> Result<(), HubError> {
        let resp = self
            .req(
                reqwest::Method::POST,
                &format!("/api/v1/packages/{namespace}/{name}/{version}/yank"),
            )
            .json(&serde_json::json!({ "yanked": yanked }))
            .send()
            .await?;
        self.check(resp).await.map(drop)
    }

    /// Delete a version.
    pub async fn delete(&self, namespace: &str, name: &str, version: &str) -> Result<(), HubError> {
        let resp = self
            .req(
                reqwest::Method::DELETE,
                &format!("/api/v1/packages/{namespace}/{name}/{version}"),
            )
            .send()
            .await?;
        self.check(resp).await.map(drop)
    }
}

/// A package in the local cache.
#[derive(Debug, Clone)]
pub struct Cached {
    /// The unpacked directory (holds env.toml).
    pub dir: PathBuf,
    /// `namespace/name`.
    pub id: String,
    /// Its version.
    pub version: semver::Version,
    /// The archive's digest.
    pub digest: String,
    /// Whether it came from the cache without the network.
    pub from_cache: bool,
}

/// What an archive must be to enter the cache: the package asked for, at
/// the version and digest the hub resolved it to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Wanted {
    /// Owner.
    pub namespace: String,
    /// Name.
    pub name: String,
    /// Version.
    pub version: semver::Version,
    /// `sha256:` digest.
    pub digest: String,
}

impl Wanted {
    /// The version a hub resolved `r` to, checked to be an answer to `r`: a
    /// hub answering with another package or a version outside the range
    /// is refused.
    pub fn resolved(r: &EnvRef, v: &VersionInfo) -> Result<Self, HubError> {
        let version = semver::Version::parse(&v.version).map_err(|e| {
            HubError::BadPackage(format!("the hub resolved {r} to {:?}: {e}", v.version))
        })?;
        if v.namespace != r.namespace || v.name != r.name || !r.spec.matches(&version) {
            return Err(HubError::BadPackage(format!(
                "asked for {r}, the hub resolved {}/{}@{}",
                v.namespace, v.name, v.version
            )));
        }
        Ok(Wanted {
            namespace: v.namespace.clone(),
            name: v.name.clone(),
            version,
            digest: v.digest.clone(),
        })
    }
}

/// Pulled packages, by hub: `ROOT/HUB/NAMESPACE/NAME/VERSION/` (the
/// unpacked files, `temper-package.json`, and `.temper-digest`), where
/// `HUB` is [`Cache::hub_key`] of the hub's URL, so two hubs never share
/// an entry. A version directory appears by one rename, complete, or not
/// at all.
#[derive(Debug, Clone)]
pub struct Cache {
    root: PathBuf,
}

use crate::package::DIGEST_FILE;
/// In each hub's directory: the hub's URL, for messages.
const HUB_FILE: &str = ".temper-hub";

impl Cache {
    /// A cache at `root`.
    pub fn new(root: impl Into<PathBuf>) -> Self {
        Cache { root: root.into() }
    }

    /// `$TEMPER_HUB_CACHE`, else `$XDG_CACHE_HOME/temper/hub`, else
    /// `~/.cache/temper/hub`.
    pub fn default_root() -> Option<PathBuf> {
        if let Some(p) = std::env::var_os("TEMPER_HUB_CACHE") {
            return Some(PathBuf::from(p));
        }
        let base = std::env::var_os("XDG_CACHE_HOME")
            .map(PathBuf::from)
            .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))?;
        Some(base.join("temper").join("hub"))
    }

    /// The root.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// The directory name of the hub at `url`: its host and port, readable,
    /// then 16 hex digits of the sha256 of the whole URL (lower-cased, no
    /// trailing `/`), so different URLs never share one.
    pub fn hub_key(url: &str) -> String {
        use sha2::Digest;
        let norm = url.trim().trim_end_matches('/').to_ascii_lowercase();
        let rest = norm.split_once("://").map_or(norm.as_str(), |(_, r)| r);
        let readable: String = rest
            .chars()
            .take(64)
            .map(|c| {
                if c.is_ascii_alphanumeric() || c == '.' || c == '-' {
                    c
                } else {
                    '_'
                }
            })
            .collect();
        let h = package::hex(&sha2::Sha256::digest(norm.as_bytes()));
        format!("{readable}-{}", &h[..16])
    }

    fn hub_dir(&self, hub: &str) -> PathBuf {
        self.root.join(Self::hub_key(hub))
    }

    /// The highest version matching `r` cached from `hub` (yanks are not
    /// known offline). With no hub, any hub's copy, if every hub holding
    /// one agrees on its version and digest.
    pub fn find(&self, hub: Option<&str>, r: &EnvRef) -> Result<Option<Cached>, HubError> {
        if let Some(hub) = hub {
            return find_in(&self.hub_dir(hub), r);
        }
        let rd = match std::fs::read_dir(&self.root) {
            Ok(rd) => rd,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(HubError::io(&self.root, e)),
        };
        let mut found: Vec<(String, Cached)> = Vec::new();
        for item in rd {
            let item = item.map_err(|e| HubError::io(&self.root, e))?;
            let dir = item.path();
            if !dir.join(HUB_FILE).is_file() {
                continue;
            }
            if let Some(c) = find_in(&dir, r)? {
                let url = std::fs::read_to_string(dir.join(HUB_FILE)).unwrap_or_default();
                found.push((url.trim().to_string(), c));
            }
        }
        let Some((_, first)) = found.first() else {
            return Ok(None);
        };
        if found
            .iter()
            .any(|(_, c)| (&c.version, &c.digest) != (&first.version, &first.digest))
        {
            let hubs: Vec<String> = found
                .iter()
                .map(|(u, c)| format!("{u} has {}@{}", c.id, c.version))
                .collect();
            return Err(HubError::BadRequest(format!(
                "{r} is cached from several hubs that differ ({}); name the hub (--hub or TEMPER_HUB_URL)",
                hubs.join(", ")
            )));
        }
        Ok(found.into_iter().next().map(|(_, c)| c))
    }

    /// A new temporary file in `hub`'s directory, for a download that
    /// [`Cache::install_file`] then moves in.
    pub fn download_file(&self, hub: &str) -> Result<tempfile::NamedTempFile, HubError> {
        let dir = self.prepare(hub)?;
        tempfile::Builder::new()
            .prefix(".download-")
            .tempfile_in(&dir)
            .map_err(|e| HubError::io(&dir, e))
    }

    fn prepare(&self, hub: &str) -> Result<PathBuf, HubError> {
        let dir = self.hub_dir(hub);
        std::fs::create_dir_all(&dir).map_err(|e| HubError::io(&dir, e))?;
        let f = dir.join(HUB_FILE);
        if !f.is_file() {
            std::fs::write(&f, format!("{}\n", hub.trim_end_matches('/')))
                .map_err(|e| HubError::io(&f, e))?;
        }
        Ok(dir)
    }

    /// Check `archive` against `want` (digest, then the manifest's
    /// namespace, name and version) and the package rules, then move it into
    /// `hub`'s place. On any error the cache is as it was.
    pub fn install(
        &self,
        hub: &str,
        archive: &[u8],
        want: &Wanted,
        limits: &Limits,
    ) -> Result<Cached, HubError> {
        let actual = package::digest(archive);
        self.install_checked(hub, archive, archive.len() as u64, actual, want, limits)
    }

    /// [`Cache::install`] from a file (a download), read as a stream.
    pub fn install_file(
        &self,
        hub: &str,
        archive: &Path,
        want: &Wanted,
        limits: &Limits,
    ) -> Result<Cached, HubError> {
        use sha2::Digest;
        let open = || std::fs::File::open(archive).map_err(|e| HubError::io(archive, e));
        let mut hash = sha2::Sha256::new();
        let len = std::io::copy(&mut open()?, &mut hash).map_err(|e| HubError::io(archive, e))?;
        let actual = format!("sha256:{}", package::hex(&hash.finalize()));
        let reader = std::io::BufReader::new(open()?);
        self.install_checked(hub, reader, len, actual, want, limits)
    }

    fn install_checked<R: std::io::BufRead>(
        &self,
        hub: &str,
        archive: R,
        len: u64,
        actual: String,
        want: &Wanted,
        limits: &Limits,
    ) -> Result<Cached, HubError> {
        if actual != want.digest {
            return Err(HubError::DigestMismatch {
                expected: want.digest.clone(),
                actual,
            });
        }
        let root = self.prepare(hub)?;
        let staging = tempfile::Builder::new()
            .prefix(".staging-")
            .tempdir_in(&root)
            .map_err(|e| HubError::io(&root, e))?;
        let unpacked = staging.path().join("pkg");
        let manifest = package::unpack_from(archive, len, &unpacked, limits)?;
        // The archive must be what was asked for: a hub cannot plant one
        // package under another's name or version.
        if (&manifest.namespace, &manifest.name, &manifest.version)
            != (&want.namespace, &want.name, &want.version)
        {
            return Err(HubError::BadPackage(format!(
                "asked for {}/{}@{}, the archive is {}@{}",
                want.namespace,
                want.name,
                want.version,
                manifest.id(),
                manifest.version
            )));
        }
        let dfile = unpacked.join(DIGEST_FILE);
        std::fs::write(&dfile, format!("{actual}\n")).map_err(|e| HubError::io(&dfile, e))?;
        let parent = root.join(&want.namespace).join(&want.name);
        std::fs::create_dir_all(&parent).map_err(|e| HubError::io(&parent, e))?;
        let dest = parent.join(want.version.to_string());
        if let Err(e) = std::fs::rename(&unpacked, &dest) {
            // Another pull may have won the race: keep its copy if it holds
            // the same bytes.
            let theirs = std::fs::read_to_string(dest.join(DIGEST_FILE))
                .map_err(|_| HubError::io(&dest, e))?;
            if theirs.trim() != actual {
                return Err(HubError::BadPackage(format!(
                    "{} holds {}, the hub serves {actual} for the same version; remove it to pull again",
                    dest.display(),
                    theirs.trim()
                )));
            }
        }
        Ok(Cached {
            dir: dest,
            id: manifest.id(),
            version: manifest.version,
            digest: actual,
            from_cache: false,
        })
    }
}

/// The highest version matching `r` under one hub's directory.
fn find_in(hub_dir: &Path, r: &EnvRef) -> Result<Option<Cached>, HubError> {
    let dir = hub_dir.join(&r.namespace).join(&r.name);
    let rd = match std::fs::read_dir(&dir) {
        Ok(rd) => rd,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(HubError::io(&dir, e)),
    };
    let mut best: Option<(semver::Version, PathBuf)> = None;
    for item in rd {
        let item = item.map_err(|e| HubError::io(&dir, e))?;
        let Some(v) = item
            .file_name()
            .to_str()
            .and_then(|s| semver::Version::parse(s).ok())
        else {
            continue;
        };
        if r.spec.matches(&v) && best.as_ref().is_none_or(|(b, _)| v > *b) {
            best = Some((v, item.path()));
        }
    }
    let Some((version, path)) = best else {
        return Ok(None);
    };
    let dfile = path.join(DIGEST_FILE);
    let digest = std::fs::read_to_string(&dfile).map_err(|e| HubError::io(&dfile, e))?;
    Ok(Some(Cached {
        dir: path,
        id: r.id(),
        version,
        digest: digest.trim().to_string(),
        from_cache: true,
    }))
}

/// Make `r` available locally: from the cache without touching the
/// network when a version cached from this hub matches (unless `update`),
/// else resolved on the hub, checked to answer `r`, streamed to disk
/// (within the client's download cap), checked and installed. Without a
/// client, only the cache answers.
pub async fn pull(
    client: Option<&HubClient>,
    cache: &Cache,
    r: &EnvRef,
    update: bool,
    progress: Option<Progress>,
) -> Result<Cached, HubError> {
    let exact = matches!(r.spec, VersionSpec::Exact(_));
    let hub = client.map(HubClient::base);
    if !update || exact {
        if let Some(c) = cache.find(hub, r)? {
            return Ok(c);
        }
    }
    let client = client.ok_or_else(|| {
        HubError::BadRequest(format!(
            "{r} is not in the cache at {} and no hub is configured (temper login URL, or TEMPER_HUB_URL)",
            cache.root().display()
        ))
    })?;
    let v = client.resolve(r).await?;
    let want = Wanted::resolved(r, &v)?;
    let exact_ref = EnvRef {
        namespace: r.namespace.clone(),
        name: r.name.clone(),
        spec: VersionSpec::Exact(want.version.clone()),
    };
    if let Some(c) = cache.find(Some(client.base()), &exact_ref)? {
        if c.digest == want.digest {
            return Ok(c);
        }
    }
    let tmp = cache.download_file(client.base())?;
    let file = tmp.reopen().map_err(|e| HubError::io(tmp.path(), e))?;
    let mut out = tokio::fs::File::from_std(file);
    let (digest, _) = client.download_to(&v, &mut out, progress).await?;
    drop(out);
    if digest != want.digest {
        return Err(HubError::DigestMismatch {
            expected: want.digest,
            actual: digest,
        });
    }
    let c = client.base().to_string();
    let path = tmp.path().to_path_buf();
    let cache = cache.clone();
    // Unpacking is file work: off the async threads.
    let out = tokio::task::spawn_blocking(move || {
        cache.install_file(&c, &path, &want, &Limits::default())
    })
    .await
    .map_err(|e| HubError::Internal(format!("worker failed: {e}")))?;
    drop(tmp);
    out
}
