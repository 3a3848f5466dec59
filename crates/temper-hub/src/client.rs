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

/// A client of one hub.
#[derive(Clone)]
pub struct HubClient {
    base: String,
    token: Option<String>,
    http: reqwest::Client,
}

impl HubClient {
    /// A client of the hub at `base` (`http://host:port`).
    pub fn new(base: &str, token: Option<String>) -> Self {
        HubClient {
            base: base.trim_end_matches('/').to_string(),
            token,
            http: reqwest::Client::new(),
        }
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
        let text = resp.text().await.unwrap_or_default();
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

    async fn get_json<T: DeserializeOwned>(&self, path: &str) -> Result<T, HubError> {
        let resp = self.req(reqwest::Method::GET, path).send().await?;
        Ok(self.check(resp).await?.json().await?)
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
        Ok(self.check(resp).await?.json().await?)
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
        let resp = self.check(req.send().await?).await?;
        #[derive(serde::Deserialize)]
        struct Out {
            packages: Vec<PackageSummary>,
        }
        Ok(resp.json::<Out>().await?.packages)
    }

    /// The version `r` resolves to on the hub.
    pub async fn resolve(&self, r: &EnvRef) -> Result<VersionInfo, HubError> {
        let req = self
            .req(
                reqwest::Method::GET,
                &format!("/api/v1/packages/{}/{}/resolve", r.namespace, r.name),
            )
            .query(&[("version", r.spec.to_string())]);
        Ok(self.check(req.send().await?).await?.json().await?)
    }

    /// An archive's bytes, unchecked.
    pub async fn download(
        &self,
        v: &VersionInfo,
        progress: Option<Progress>,
    ) -> Result<Vec<u8>, HubError> {
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
        let total = resp.content_length().unwrap_or(v.size);
        let mut out = Vec::with_capacity(total as usize);
        while let Some(chunk) = resp.chunk().await? {
            out.extend_from_slice(&chunk);
            if let Some(p) = &progress {
                p(out.len() as u64, total);
            }
        }
        Ok(out)
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

/// Pulled packages: `ROOT/NAMESPACE/NAME/VERSION/` (the unpacked files,
/// `temper-package.json`, and `.temper-digest`). A version directory
/// appears by one rename, complete, or not at all.
#[derive(Debug, Clone)]
pub struct Cache {
    root: PathBuf,
}

const DIGEST_FILE: &str = ".temper-digest";

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

    /// The highest cached version matching `r` (yanks are not known
    /// offline).
    pub fn find(&self, r: &EnvRef) -> Result<Option<Cached>, HubError> {
        let dir = self.root.join(&r.namespace).join(&r.name);
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

    /// Check `archive` against `expected` digest and the package rules,
    /// then move it into place. On any error the cache is as it was.
    pub fn install(
        &self,
        archive: &[u8],
        expected: &str,
        limits: &Limits,
    ) -> Result<Cached, HubError> {
        let actual = package::digest(archive);
        if actual != expected {
            return Err(HubError::DigestMismatch {
                expected: expected.to_string(),
                actual,
            });
        }
        std::fs::create_dir_all(&self.root).map_err(|e| HubError::io(&self.root, e))?;
        let staging = tempfile::Builder::new()
            .prefix(".staging-")
            .tempdir_in(&self.root)
            .map_err(|e| HubError::io(&self.root, e))?;
        let unpacked = staging.path().join("pkg");
        let manifest = package::unpack(archive, &unpacked, limits)?;
        let dfile = unpacked.join(DIGEST_FILE);
        std::fs::write(&dfile, format!("{actual}\n")).map_err(|e| HubError::io(&dfile, e))?;
        let parent = self.root.join(&manifest.namespace).join(&manifest.name);
        std::fs::create_dir_all(&parent).map_err(|e| HubError::io(&parent, e))?;
        let dest = parent.join(manifest.version.to_string());
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

/// Make `r` available locally: from the cache without touching the
/// network when a cached version matches (unless `update`), else resolved
/// on the hub, downloaded, checked and installed.
pub async fn pull(
    client: Option<&HubClient>,
    cache: &Cache,
    r: &EnvRef,
    update: bool,
    progress: Option<Progress>,
) -> Result<Cached, HubError> {
    let exact = matches!(r.spec, VersionSpec::Exact(_));
    if !update || exact {
        if let Some(c) = cache.find(r)? {
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
    let exact_ref = EnvRef {
        namespace: r.namespace.clone(),
        name: r.name.clone(),
        spec: VersionSpec::parse(&v.version)?,
    };
    if let Some(c) = cache.find(&exact_ref)? {
        if c.digest == v.digest {
            return Ok(c);
        }
    }
    let bytes = client.download(&v, progress).await?;
    cache.install(&bytes, &v.digest, &Limits::default())
}
