//! `temper hub serve`: the registry's HTTP API and web page over a
//! [`MetaStore`] and a [`BlobStore`].
//!
//! | method | path | what |
//! |---|---|---|
//! | GET | `/health` | `{"status":"ok"}` |
//! | GET | `/metrics` | Prometheus text |
//! | GET | `/api/v1/search?q=&tag=&namespace=` | matching packages (latest version each) |
//! | GET | `/api/v1/packages/{ns}/{name}` | the package and its versions |
//! | GET | `/api/v1/packages/{ns}/{name}/resolve?version=^1` | the version a reference resolves to |
//! | POST | `/api/v1/packages/{ns}/{name}` | publish (body: the archive) |
//! | GET | `/api/v1/packages/{ns}/{name}/{version}/download` | the archive (`x-temper-digest`) |
//! | GET | `/api/v1/blobs/{digest}` | the archive by digest |
//! | POST | `/api/v1/packages/{ns}/{name}/{version}/yank` | `{"yanked": true}` (or false) |
//! | DELETE | `/api/v1/packages/{ns}/{name}/{version}` | delete a version |
//! | GET | `/api/v1/whoami` | the token's scope |
//! | GET | `/`, `/envs/{ns}/{name}` | the web page |
//!
//! Writes need `Authorization: Bearer TOKEN` with `publish:NS`; reads need
//! a token only when anonymous read is off. A write's token (and a
//! publish's declared length) is checked before a byte of its body is
//! read, and an upload streams to a temporary file while it is hashed, so
//! no request holds an archive in memory. Every response carries a strict
//! `Content-Security-Policy`, `nosniff` and `Referrer-Policy`.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, PoisonError};

use axum::body::{Body, Bytes};
use axum::extract::{Path, Query as QueryParams, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{Html, IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use futures::StreamExt;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::package::{self, Limits};
use crate::refs::VersionSpec;
use crate::store::{BlobStore, MetaStore, NewVersion, Query, Scope, VersionInfo};
use crate::{web, HubError};

/// The hub's default largest archive, MiB (`--max-package-mb`); also the
/// client's default download cap.
pub const DEFAULT_MAX_PACKAGE_MB: usize = 256;

/// How the hub behaves.
#[derive(Debug, Clone)]
pub struct HubSettings {
    /// Reads without a token.
    pub anonymous_read: bool,
    /// Largest archive accepted, bytes.
    pub max_package_bytes: usize,
    /// Bounds on what a published archive may unpack to.
    pub limits: Limits,
}

impl Default for HubSettings {
    fn default() -> Self {
        HubSettings {
            anonymous_read: true,
            max_package_bytes: DEFAULT_MAX_PACKAGE_MB << 20,
            limits: Limits::default(),
        }
    }
}

/// Counters for `/metrics`.
#[derive(Debug, Default)]
pub struct HubMetrics {
    published: AtomicU64,
    publish_rejected: AtomicU64,
    downloads: AtomicU64,
    download_bytes: AtomicU64,
    upload_bytes: AtomicU64,
    resolves: AtomicU64,
    searches: AtomicU64,
    auth_failures: AtomicU64,
}

impl HubMetrics {
    fn render(&self) -> String {
        let mut out = String::new();
        let mut counter = |name: &str, help: &str, v: &AtomicU64| {
            out.push_str(&format!(
                "# HELP {name} {help}\n# TYPE {name} counter\n{name} {}\n",
                v.load(Ordering::Relaxed)
            ));
        };
        counter(
            "temper_hub_published_total",
            "Versions published.",
            &self.published,
        );
        counter(
            "temper_hub_publish_rejected_total",
            "Publishes refused (bad package, existing version).",
            &self.publish_rejected,
        );
        counter(
            "temper_hub_downloads_total",
            "Archives served.",
            &self.downloads,
        );
        counter(
            "temper_hub_download_bytes_total",
            "Archive bytes served.",
            &self.download_bytes,
        );
        counter(
            "temper_hub_upload_bytes_total",
            "Archive bytes accepted.",
            &self.upload_bytes,
        );
        counter(
            "temper_hub_resolves_total",
            "References resolved.",
            &self.resolves,
        );
        counter("temper_hub_searches_total", "Searches.", &self.searches);
        counter(
            "temper_hub_auth_failures_total",
            "Requests refused for a missing, unknown or out-of-scope token.",
            &self.auth_failures,
        );
        out
    }
}

/// The server's state: the stores, settings and counters.
#[derive(Clone)]
pub struct HubState {
    /// Versions and tokens.
    pub meta: Arc<dyn MetaStore>,
    /// Archives.
    pub blobs: Arc<dyn BlobStore>,
    /// Settings.
    pub settings: Arc<HubSettings>,
    /// Counters.
    pub metrics: Arc<HubMetrics>,
    /// Serialises "store blob + insert row" against "delete row + blob", so
    /// a delete never removes a blob a publish is about to reference.
    write_lock: Arc<std::sync::Mutex<()>>,
    /// Where uploads are streamed before they are checked.
    upload_dir: std::path::PathBuf,
}

impl HubState {
    /// State over `meta` and `blobs`.
    pub fn new(meta: Arc<dyn MetaStore>, blobs: Arc<dyn BlobStore>, settings: HubSettings) -> Self {
        HubState {
            meta,
            blobs,
            settings: Arc::new(settings),
            metrics: Arc::new(HubMetrics::default()),
            write_lock: Arc::new(std::sync::Mutex::new(())),
            upload_dir: std::env::temp_dir(),
        }
    }

    /// Stream uploads to temporary files in `dir` (best on the blob
    /// store's file system, so storing one is a rename).
    pub fn with_upload_dir(mut self, dir: std::path::PathBuf) -> Self {
        self.upload_dir = dir;
        self
    }

    /// The embedded default: `DIR/hub.sqlite` and `DIR/blobs/`.
    pub fn open_dir(dir: &std::path::Path, settings: HubSettings) -> Result<Self, HubError> {
        std::fs::create_dir_all(dir).map_err(|e| HubError::io(dir, e))?;
        let meta = crate::store::SqliteMeta::open(&dir.join("hub.sqlite"))?;
        let blobs = crate::store::FsBlobs::open(&dir.join("blobs"))?;
        let uploads = blobs.tmp_dir();
        Ok(Self::new(Arc::new(meta), Arc::new(blobs), settings).with_upload_dir(uploads))
    }
}

/// A new random API token: `tmpr_` + 64 hex digits.
pub fn new_token() -> String {
    use rand::RngCore;
    let mut b = [0u8; 32];
    rand::rng().fill_bytes(&mut b);
    format!("tmpr_{}", package::hex(&b))
}

/// The stored form of a token: hex sha256 (tokens are random, so no salt
/// or slow hash is needed).
pub fn hash_token(token: &str) -> String {
    package::hex(&Sha256::digest(token.as_bytes()))
}

/// Create a token with `scope` in `meta`; returns the token (shown once).
pub fn create_token(meta: &dyn MetaStore, scope: &Scope, label: &str) -> Result<String, HubError> {
    let token = new_token();
    meta.insert_token(&hash_token(&token), scope, label)?;
    Ok(token)
}

/// The hub's error answer: client errors pass through, internal ones are
/// logged and answered generically.
pub struct ApiError(HubError);

impl From<HubError> for ApiError {
    fn from(e: HubError) -> Self {
        ApiError(e)
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = match &self.0 {
            HubError::BadPackage(_)
            | HubError::UnsafeEntry { .. }
            | HubError::TooLarge { .. }
            | HubError::RatioBomb { .. }
            | HubError::BadRequest(_) => StatusCode::BAD_REQUEST,
            HubError::VersionExists(_) => StatusCode::CONFLICT,
            HubError::NotFound(_) => StatusCode::NOT_FOUND,
            HubError::Unauthorized(_) => StatusCode::UNAUTHORIZED,
            HubError::Forbidden(_) => StatusCode::FORBIDDEN,
            HubError::PayloadTooLarge(_) => StatusCode::PAYLOAD_TOO_LARGE,
            _ => StatusCode::INTERNAL_SERVER_ERROR,
        };
        let message = if status == StatusCode::INTERNAL_SERVER_ERROR {
            tracing::error!("hub: {}", self.0);
            "internal error".to_string()
        } else {
            self.0.to_string()
        };
        (status, Json(serde_json::json!({ "error": message }))).into_response()
    }
}

type ApiResult<T> = Result<T, ApiError>;

/// Run a store call off the async threads.
async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, HubError> + Send + 'static,
) -> Result<T, HubError> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| HubError::Internal(format!("worker failed: {e}")))?
}

/// The caller's scope from `Authorization: Bearer`; `Ok(None)` without a
/// header, an error for an unknown token.
async fn caller(state: &HubState, headers: &HeaderMap) -> Result<Option<Scope>, HubError> {
    let Some(value) = headers.get(header::AUTHORIZATION) else {
        return Ok(None);
    };
    let token = value
        .to_str()
        .ok()
        .and_then(|v| v.strip_prefix("Bearer "))
        .ok_or_else(|| HubError::Unauthorized("use `Authorization: Bearer TOKEN`".into()))?
        .trim()
        .to_string();
    let meta = state.meta.clone();
    let scope = blocking(move || meta.token_scope(&hash_token(&token))).await?;
    scope
        .map(Some)
        .ok_or_else(|| HubError::Unauthorized("unknown token".into()))
}

async fn require_read(state: &HubState, headers: &HeaderMap) -> Result<(), HubError> {
    let r = caller(state, headers).await;
    let r = match r {
        Ok(None) if !state.settings.anonymous_read => Err(HubError::Unauthorized(
            "this hub needs a token to read (temper login)".into(),
        )),
        Ok(_) => Ok(()),
        Err(e) => Err(e),
    };
    if r.is_err() {
        state.metrics.auth_failures.fetch_add(1, Ordering::Relaxed);
    }
    r
}

async fn require_publish(state: &HubState, headers: &HeaderMap, ns: &str) -> Result<(), HubError> {
    let r = match caller(state, headers).await {
        Ok(Some(Scope::Publish { namespace })) if namespace == ns => Ok(()),
        Ok(Some(s)) => Err(HubError::Forbidden(format!(
            "the token's scope is {}, not publish:{ns}",
            s.as_string()
        ))),
        Ok(None) => Err(HubError::Unauthorized(format!(
            "writing to {ns} needs a token with publish:{ns}"
        ))),
        Err(e) => Err(e),
    };
    if r.is_err() {
        state.metrics.auth_failures.fetch_add(1, Ordering::Relaxed);
    }
    r
}

/// The router.
pub fn app(state: HubState) -> Router {
    // No body limit layer: the two handlers that take a body (publish,
    // yank) check the caller first and then bound what they read.
    Router::new()
        .route(
            "/health",
            get(|| async { Json(serde_json::json!({"status": "ok"})) }),
        )
        .route("/metrics", get(metrics))
        .route("/api/v1/whoami", get(whoami))
        .route("/api/v1/search", get(search))
        .route(
            "/api/v1/packages/{ns}/{name}",
            get(package_info).post(publish),
        )
        .route("/api/v1/packages/{ns}/{name}/resolve", get(resolve))
        .route(
            "/api/v1/packages/{ns}/{name}/{version}",
            axum::routing::delete(delete_version),
        )
        .route(
            "/api/v1/packages/{ns}/{name}/{version}/download",
            get(download),
        )
        .route("/api/v1/packages/{ns}/{name}/{version}/yank", post(yank))
        .route("/api/v1/blobs/{digest}", get(blob))
        .route("/", get(web_index))
        .route("/envs/{ns}/{name}", get(web_package))
        .layer(axum::middleware::map_response(security_headers))
        .with_state(state)
}

/// The web page runs no script, loads nothing but its own inline style
/// (by hash) and http(s) images, and cannot be framed; every response says
/// so, so an HTML error or a README link cannot turn into script.
fn content_security_policy() -> &'static str {
    static CSP: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    CSP.get_or_init(|| {
        format!(
            "default-src 'none'; script-src 'none'; style-src '{}'; img-src 'self' https: http:; \
             form-action 'self'; base-uri 'none'; frame-ancestors 'none'",
            web::style_hash()
        )
    })
}

async fn security_headers(mut resp: Response) -> Response {
    let h = resp.headers_mut();
    if let Ok(v) = header::HeaderValue::from_str(content_security_policy()) {
        h.insert(header::CONTENT_SECURITY_POLICY, v);
    }
    h.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        header::HeaderValue::from_static("nosniff"),
    );
    h.insert(
        header::REFERRER_POLICY,
        header::HeaderValue::from_static("no-referrer"),
    );
    resp
}

async fn metrics(State(s): State<HubState>) -> impl IntoResponse {
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        s.metrics.render(),
    )
}

async fn whoami(
    State(s): State<HubState>,
    headers: HeaderMap,
) -> ApiResult<Json<serde_json::Value>> {
    let scope = caller(&s, &headers).await?;
    Ok(Json(serde_json::json!({
        "scope": scope.map(|s| s.as_string()),
        "anonymous_read": s.settings.anonymous_read,
    })))
}

/// One package in a search.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PackageSummary {
    /// `namespace/name`.
    pub id: String,
    /// The latest version that is not yanked (else the latest).
    pub latest: VersionInfo,
    /// How many live versions.
    pub versions: usize,
}

/// A package and its versions.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PackageInfo {
    /// `namespace/name`.
    pub id: String,
    /// The latest version that is not yanked (else the latest).
    pub latest: VersionInfo,
    /// Every live version, oldest first.
    pub versions: Vec<VersionInfo>,
}

fn latest(versions: &[VersionInfo]) -> Option<&VersionInfo> {
    VersionSpec::Latest.pick(versions).or(versions.last())
}

pub(crate) fn summaries(rows: Vec<VersionInfo>) -> Vec<PackageSummary> {
    let mut out: Vec<PackageSummary> = Vec::new();
    let mut start = 0;
    for i in 1..=rows.len() {
        let boundary = i == rows.len()
            || (rows[i].namespace.as_str(), rows[i].name.as_str())
                != (rows[start].namespace.as_str(), rows[start].name.as_str());
        if boundary {
            let group = &rows[start..i];
            if let Some(l) = latest(group) {
                out.push(PackageSummary {
                    id: format!("{}/{}", l.namespace, l.name),
                    latest: l.clone(),
                    versions: group.len(),
                });
            }
            start = i;
        }
    }
    out
}

pub(crate) async fn run_search(s: &HubState, q: Query) -> Result<Vec<PackageSummary>, HubError> {
    s.metrics.searches.fetch_add(1, Ordering::Relaxed);
    let meta = s.meta.clone();
    Ok(summaries(blocking(move || meta.search(&q)).await?))
}

async fn search(
    State(s): State<HubState>,
    headers: HeaderMap,
    QueryParams(q): QueryParams<Query>,
) -> ApiResult<Json<serde_json::Value>> {
    require_read(&s, &headers).await?;
    let packages = run_search(&s, q).await?;
    Ok(Json(serde_json::json!({ "packages": packages })))
}

pub(crate) async fn load_package(
    s: &HubState,
    ns: &str,
    name: &str,
) -> Result<PackageInfo, HubError> {
    let (meta, n, m) = (s.meta.clone(), ns.to_string(), name.to_string());
    let versions = blocking(move || meta.versions(&n, &m)).await?;
    let l = latest(&versions)
        .cloned()
        .ok_or_else(|| HubError::NotFound(format!("{ns}/{name}")))?;
    Ok(PackageInfo {
        id: format!("{ns}/{name}"),
        latest: l,
        versions,
    })
}

async fn package_info(
    State(s): State<HubState>,
    headers: HeaderMap,
    Path((ns, name)): Path<(String, String)>,
) -> ApiResult<Json<PackageInfo>> {
    require_read(&s, &headers).await?;
    Ok(Json(load_package(&s, &ns, &name).await?))
}

#[derive(Deserialize)]
struct ResolveParams {
    #[serde(default)]
    version: Option<String>,
}

async fn resolve(
    State(s): State<HubState>,
    headers: HeaderMap,
    Path((ns, name)): Path<(String, String)>,
    QueryParams(p): QueryParams<ResolveParams>,
) -> ApiResult<Json<VersionInfo>> {
    require_read(&s, &headers).await?;
    s.metrics.resolves.fetch_add(1, Ordering::Relaxed);
    let spec = VersionSpec::parse(p.version.as_deref().unwrap_or(""))?;
    let info = load_package(&s, &ns, &name).await?;
    let v = spec.pick(&info.versions).cloned().ok_or_else(|| {
        HubError::NotFound(format!(
            "no version of {ns}/{name} matches {spec} (yanked versions need an exact version)"
        ))
    })?;
    Ok(Json(v))
}

/// The declared `Content-Length`, if any; a malformed one is refused.
fn content_length(headers: &HeaderMap) -> Result<Option<u64>, HubError> {
    headers
        .get(header::CONTENT_LENGTH)
        .map(|v| {
            v.to_str()
                .ok()
                .and_then(|t| t.trim().parse::<u64>().ok())
                .ok_or_else(|| HubError::BadRequest("malformed Content-Length".into()))
        })
        .transpose()
}

/// An upload streamed to a temporary file, hashed as it came.
struct Upload {
    file: tempfile::NamedTempFile,
    digest: String,
    size: u64,
}

/// Stream `body` to a temporary file under `dir`, hashing it, and refuse
/// it once it passes `max` bytes. Only called once the caller is
/// authorised and the declared length is within `max`.
async fn receive(body: Body, dir: &std::path::Path, max: u64) -> Result<Upload, HubError> {
    use tokio::io::AsyncWriteExt;
    let file = tempfile::Builder::new()
        .prefix("upload-")
        .tempfile_in(dir)
        .map_err(|e| HubError::io(dir, e))?;
    let std_file = file.reopen().map_err(|e| HubError::io(file.path(), e))?;
    let mut out = tokio::io::BufWriter::new(tokio::fs::File::from_std(std_file));
    let mut hash = Sha256::new();
    let mut size = 0u64;
    let mut stream = body.into_data_stream();
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.map_err(|e| HubError::BadRequest(format!("reading the upload: {e}")))?;
        size += chunk.len() as u64;
        if size > max {
            return Err(HubError::PayloadTooLarge(format!(
                "the upload passes {max} bytes (the hub's --max-package-mb)"
            )));
        }
        hash.update(&chunk);
        out.write_all(&chunk)
            .await
            .map_err(|e| HubError::io(file.path(), e))?;
    }
    out.flush()
        .await
        .map_err(|e| HubError::io(file.path(), e))?;
    Ok(Upload {
        digest: format!("sha256:{}", package::hex(&hash.finalize())),
        file,
        size,
    })
}

/// Most README bytes kept for the web page; a longer README is not shown.
pub const MAX_README_BYTES: usize = 1 << 20;

/// Keeps the top-level README (up to [`MAX_README_BYTES`]) while an
/// archive is checked.
struct ReadmeSink {
    readme: Option<Vec<u8>>,
    capturing: bool,
}

impl package::FileSink for ReadmeSink {
    fn begin(&mut self, file: &package::FileEntry) -> Result<(), HubError> {
        self.capturing = file.path.eq_ignore_ascii_case("README.md");
        if self.capturing {
            self.readme = Some(Vec::new());
        }
        Ok(())
    }
    fn write(&mut self, bytes: &[u8]) -> Result<(), HubError> {
        if self.capturing {
            if let Some(r) = &mut self.readme {
                if r.len() + bytes.len() > MAX_README_BYTES {
                    self.readme = None;
                    self.capturing = false;
                } else {
                    r.extend_from_slice(bytes);
                }
            }
        }
        Ok(())
    }
}

async fn publish(
    State(s): State<HubState>,
    headers: HeaderMap,
    Path((ns, name)): Path<(String, String)>,
    body: Body,
) -> ApiResult<(StatusCode, Json<VersionInfo>)> {
    // Not a byte of the body is read before the caller is authorised and
    // the declared length is within the limit.
    require_publish(&s, &headers, &ns).await?;
    let max = s.settings.max_package_bytes as u64;
    let r = async {
        if let Some(len) = content_length(&headers)? {
            if len > max {
                return Err(HubError::PayloadTooLarge(format!(
                    "Content-Length {len} is over the hub's limit of {max} bytes (--max-package-mb)"
                )));
            }
        }
        let upload = receive(body, &s.upload_dir, max).await?;
        let state = s.clone();
        // Check the whole archive before anything is stored: a refused or
        // half-sent upload leaves no trace (the temporary file goes with
        // `upload`).
        blocking(move || {
            let Upload { file, digest, size } = upload;
            let reader =
                std::io::BufReader::new(file.reopen().map_err(|e| HubError::io(file.path(), e))?);
            let mut sink = ReadmeSink {
                readme: None,
                capturing: false,
            };
            let manifest = package::check_archive(reader, size, &state.settings.limits, &mut sink)?;
            if manifest.namespace != ns || manifest.name != name {
                return Err(HubError::BadRequest(format!(
                    "the archive is {}, published to {ns}/{name}",
                    manifest.id()
                )));
            }
            let new = NewVersion {
                manifest,
                digest: digest.clone(),
                size,
                readme: sink.readme.and_then(|r| String::from_utf8(r).ok()),
            };
            let _guard = state
                .write_lock
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            // Blob first, row second: a crash between them leaves an
            // unreferenced blob (never served), never a version without bytes.
            state.blobs.put_file(&digest, file)?;
            let inserted = state.meta.insert_version(&new);
            if inserted.is_err() && !state.meta.digest_live(&digest)? {
                // The loser of a race leaves nothing behind; under the lock no
                // other publish can be between its put and its insert.
                state.blobs.delete(&digest)?;
            }
            inserted
        })
        .await
    }
    .await;
    match r {
        Ok(v) => {
            s.metrics.published.fetch_add(1, Ordering::Relaxed);
            s.metrics.upload_bytes.fetch_add(v.size, Ordering::Relaxed);
            tracing::info!(
                "published {}/{}@{} {}",
                v.namespace,
                v.name,
                v.version,
                v.digest
            );
            Ok((StatusCode::CREATED, Json(v)))
        }
        Err(e) => {
            s.metrics.publish_rejected.fetch_add(1, Ordering::Relaxed);
            Err(e.into())
        }
    }
}

/// Bytes read per step when streaming an archive out.
const DOWNLOAD_CHUNK: usize = 256 << 10;

/// Serve an archive as a stream read from the blob store, so a download
/// holds one chunk in memory, not the archive.
async fn serve_blob(s: &HubState, digest: String) -> ApiResult<Response> {
    let blobs = s.blobs.clone();
    let d = digest.clone();
    let (reader, len) = blocking(move || blobs.open(&d))
        .await?
        .ok_or_else(|| HubError::NotFound(digest.clone()))?;
    s.metrics.downloads.fetch_add(1, Ordering::Relaxed);
    s.metrics.download_bytes.fetch_add(len, Ordering::Relaxed);
    let chunks = futures::stream::try_unfold(reader, |mut reader| async move {
        let (reader, chunk) = tokio::task::spawn_blocking(move || {
            let mut buf = vec![0u8; DOWNLOAD_CHUNK];
            let n = std::io::Read::read(&mut reader, &mut buf)?;
            buf.truncate(n);
            Ok::<_, std::io::Error>((reader, buf))
        })
        .await
        .map_err(std::io::Error::other)??;
        Ok::<_, std::io::Error>((!chunk.is_empty()).then(|| (Bytes::from(chunk), reader)))
    });
    Ok((
        [
            (header::CONTENT_TYPE, "application/gzip".to_string()),
            (header::CONTENT_LENGTH, len.to_string()),
            (header::HeaderName::from_static("x-temper-digest"), digest),
        ],
        Body::from_stream(chunks),
    )
        .into_response())
}

async fn download(
    State(s): State<HubState>,
    headers: HeaderMap,
    Path((ns, name, version)): Path<(String, String, String)>,
) -> ApiResult<Response> {
    require_read(&s, &headers).await?;
    let info = load_package(&s, &ns, &name).await?;
    let v = info
        .versions
        .iter()
        .find(|v| v.version == version)
        .ok_or_else(|| HubError::NotFound(format!("{ns}/{name}@{version}")))?;
    serve_blob(&s, v.digest.clone()).await
}

async fn blob(
    State(s): State<HubState>,
    headers: HeaderMap,
    Path(digest): Path<String>,
) -> ApiResult<Response> {
    require_read(&s, &headers).await?;
    let (meta, d) = (s.meta.clone(), digest.clone());
    // Only bytes of a live version are served (not orphans, not deleted).
    if !blocking(move || meta.digest_live(&d)).await? {
        return Err(HubError::NotFound(digest).into());
    }
    serve_blob(&s, digest).await
}

/// Largest yank body (`{"yanked": false}` is 17 bytes).
const MAX_YANK_BODY: usize = 4096;

#[derive(Deserialize)]
struct YankBody {
    #[serde(default = "yes")]
    yanked: bool,
}

fn yes() -> bool {
    true
}

async fn yank(
    State(s): State<HubState>,
    headers: HeaderMap,
    Path((ns, name, version)): Path<(String, String, String)>,
    body: Body,
) -> ApiResult<Json<serde_json::Value>> {
    require_publish(&s, &headers, &ns).await?;
    if content_length(&headers)?.is_some_and(|n| n > MAX_YANK_BODY as u64) {
        return Err(HubError::PayloadTooLarge(format!(
            "a yank body is at most {MAX_YANK_BODY} bytes"
        ))
        .into());
    }
    let body = axum::body::to_bytes(body, MAX_YANK_BODY)
        .await
        .map_err(|_| {
            HubError::PayloadTooLarge(format!("a yank body is at most {MAX_YANK_BODY} bytes"))
        })?;
    let yanked = if body.is_empty() {
        true
    } else {
        serde_json::from_slice::<YankBody>(&body)
            .map_err(|e| HubError::BadRequest(format!("body: {e} (send {{\"yanked\": true}})")))?
            .yanked
    };
    let meta = s.meta.clone();
    let (n, m, v) = (ns.clone(), name.clone(), version.clone());
    blocking(move || meta.set_yanked(&n, &m, &v, yanked)).await?;
    Ok(Json(
        serde_json::json!({ "id": format!("{ns}/{name}"), "version": version, "yanked": yanked }),
    ))
}

async fn delete_version(
    State(s): State<HubState>,
    headers: HeaderMap,
    Path((ns, name, version)): Path<(String, String, String)>,
) -> ApiResult<Json<serde_json::Value>> {
    require_publish(&s, &headers, &ns).await?;
    let state = s.clone();
    let (n, m, v) = (ns.clone(), name.clone(), version.clone());
    blocking(move || {
        let _guard = state
            .write_lock
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let digest = state.meta.delete_version(&n, &m, &v)?;
        if !state.meta.digest_live(&digest)? {
            state.blobs.delete(&digest)?;
        }
        Ok(())
    })
    .await?;
    Ok(Json(
        serde_json::json!({ "id": format!("{ns}/{name}"), "version": version, "deleted": true }),
    ))
}

#[derive(Deserialize)]
struct WebQuery {
    #[serde(default)]
    q: Option<String>,
    #[serde(default)]
    tag: Option<String>,
}

fn html_error(e: HubError) -> Response {
    let status = match e {
        HubError::NotFound(_) => StatusCode::NOT_FOUND,
        HubError::Unauthorized(_) => StatusCode::UNAUTHORIZED,
        _ => StatusCode::INTERNAL_SERVER_ERROR,
    };
    if status == StatusCode::INTERNAL_SERVER_ERROR {
        tracing::error!("hub web: {e}");
    }
    (
        status,
        Html(web::error_page(status.as_u16(), &e.to_string())),
    )
        .into_response()
}

async fn web_index(
    State(s): State<HubState>,
    headers: HeaderMap,
    QueryParams(q): QueryParams<WebQuery>,
) -> Response {
    if let Err(e) = require_read(&s, &headers).await {
        return html_error(e);
    }
    let query = Query {
        q: q.q.clone().filter(|t| !t.trim().is_empty()),
        tag: q.tag.clone().filter(|t| !t.trim().is_empty()),
        namespace: None,
    };
    match run_search(&s, query).await {
        Ok(p) => Html(web::index_page(
            q.q.as_deref().unwrap_or(""),
            q.tag.as_deref(),
            &p,
        ))
        .into_response(),
        Err(e) => html_error(e),
    }
}

async fn web_package(
    State(s): State<HubState>,
    headers: HeaderMap,
    Path((ns, name)): Path<(String, String)>,
) -> Response {
    if let Err(e) = require_read(&s, &headers).await {
        return html_error(e);
    }
    let info = match load_package(&s, &ns, &name).await {
        Ok(i) => i,
        Err(e) => return html_error(e),
    };
    let meta = s.meta.clone();
    let v = info.latest.version.clone();
    let readme = blocking(move || meta.readme(&ns, &name, &v)).await;
    match readme {
        Ok(r) => Html(web::package_page(&info, r.as_deref())).into_response(),
        Err(e) => html_error(e),
    }
}
