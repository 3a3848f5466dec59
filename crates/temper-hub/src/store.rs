//! Storage behind two small traits: [`MetaStore`] (versions, tokens) and
//! [`BlobStore`] (archives by digest). The embedded defaults are
//! [`SqliteMeta`] and [`FsBlobs`]; a Postgres `MetaStore` and an
//! S3-compatible `BlobStore` slot in behind the same traits.

use std::path::{Path, PathBuf};
use std::sync::{Mutex, PoisonError};

use rusqlite::{params, Connection, OptionalExtension};
use serde::{Deserialize, Serialize};

use crate::package::PackageManifest;
use crate::HubError;

/// One published version, as the API and the web page show it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct VersionInfo {
    /// Owner.
    pub namespace: String,
    /// Name.
    pub name: String,
    /// Version.
    pub version: String,
    /// Archive digest.
    pub digest: String,
    /// Archive bytes.
    pub size: u64,
    /// One line on what it is.
    pub description: String,
    /// Tags.
    pub tags: Vec<String>,
    /// License.
    pub license: Option<String>,
    /// The temper versions it needs.
    pub temper: Option<String>,
    /// Hidden from resolution (still pullable by exact version).
    pub yanked: bool,
    /// When (RFC 3339).
    pub published_at: String,
}

/// A version to record (the archive is already in the blob store).
#[derive(Debug, Clone)]
pub struct NewVersion {
    /// The package's manifest.
    pub manifest: PackageManifest,
    /// Archive digest.
    pub digest: String,
    /// Archive bytes.
    pub size: u64,
    /// README.md's text, for the web page.
    pub readme: Option<String>,
}

/// Filters of a search; all given ones must match.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct Query {
    /// Free text over namespace, name and description (case-insensitive).
    #[serde(default)]
    pub q: Option<String>,
    /// An exact tag.
    #[serde(default)]
    pub tag: Option<String>,
    /// An exact namespace.
    #[serde(default)]
    pub namespace: Option<String>,
}

/// What a token may do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Scope {
    /// Read (when anonymous read is off).
    Read,
    /// Read, and publish / yank / delete in one namespace.
    Publish {
        /// The namespace.
        namespace: String,
    },
}

impl Scope {
    /// `read` or `publish:NAMESPACE`.
    pub fn as_string(&self) -> String {
        match self {
            Scope::Read => "read".into(),
            Scope::Publish { namespace } => format!("publish:{namespace}"),
        }
    }

    /// Parse [`Scope::as_string`]'s form.
    pub fn parse(s: &str) -> Option<Scope> {
        match s.split_once(':') {
            None if s == "read" => Some(Scope::Read),
            Some(("publish", ns)) if crate::package::valid_name(ns) => Some(Scope::Publish {
                namespace: ns.to_string(),
            }),
            _ => None,
        }
    }
}

/// Versions and tokens. Implementations must make `insert_version` atomic:
/// of concurrent inserts of one version exactly one succeeds.
pub trait MetaStore: Send + Sync {
    /// Record a version; [`HubError::VersionExists`] if it exists or was
    /// deleted (versions are never reused).
    fn insert_version(&self, v: &NewVersion) -> Result<VersionInfo, HubError>;
    /// Every live (not deleted) version of a package, oldest first.
    fn versions(&self, namespace: &str, name: &str) -> Result<Vec<VersionInfo>, HubError>;
    /// The README stored with a version.
    fn readme(
        &self,
        namespace: &str,
        name: &str,
        version: &str,
    ) -> Result<Option<String>, HubError>;
    /// Live versions matching `query` (all versions of each matching package).
    fn search(&self, query: &Query) -> Result<Vec<VersionInfo>, HubError>;
    /// Set or clear `yanked`.
    fn set_yanked(
        &self,
        namespace: &str,
        name: &str,
        version: &str,
        yanked: bool,
    ) -> Result<(), HubError>;
    /// Delete a version (a tombstone stays, so the number is never reused);
    /// returns its digest.
    fn delete_version(
        &self,
        namespace: &str,
        name: &str,
        version: &str,
    ) -> Result<String, HubError>;
    /// Whether a live version references `digest`.
    fn digest_live(&self, digest: &str) -> Result<bool, HubError>;
    /// Store a token's hash and scope.
    fn insert_token(&self, hash: &str, scope: &Scope, label: &str) -> Result<(), HubError>;
    /// The scope of the token with this hash.
    fn token_scope(&self, hash: &str) -> Result<Option<Scope>, HubError>;
}

/// A blob's bytes to stream, and their length.
pub type BlobReader = (Box<dyn std::io::Read + Send>, u64);

/// Archives by digest. `put` must be atomic: a reader sees all the bytes or
/// none.
pub trait BlobStore: Send + Sync {
    /// Store `bytes` under `digest` (a no-op when present).
    fn put(&self, digest: &str, bytes: &[u8]) -> Result<(), HubError>;
    /// Store the (already written) temporary file `file` under `digest`
    /// (a no-op when present). The default reads it and calls `put`.
    fn put_file(&self, digest: &str, file: tempfile::NamedTempFile) -> Result<(), HubError> {
        let bytes = std::fs::read(file.path()).map_err(|e| HubError::io(file.path(), e))?;
        self.put(digest, &bytes)
    }
    /// The bytes under `digest`.
    fn get(&self, digest: &str) -> Result<Option<Vec<u8>>, HubError>;
    /// A reader of the bytes under `digest` and their length, to stream
    /// them. The default reads them all through `get`.
    fn open(&self, digest: &str) -> Result<Option<BlobReader>, HubError> {
        Ok(self.get(digest)?.map(|b| {
            let len = b.len() as u64;
            (
                Box::new(std::io::Cursor::new(b)) as Box<dyn std::io::Read + Send>,
                len,
            )
        }))
    }
    /// Remove `digest`'s bytes.
    fn delete(&self, digest: &str) -> Result<(), HubError>;
}

/// SQLite metadata: one file, WAL mode.
pub struct SqliteMeta {
    conn: Mutex<Connection>,
}

const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS versions (
    namespace TEXT NOT NULL,
    name TEXT NOT NULL,
    version TEXT NOT NULL,
    digest TEXT NOT NULL,
    size INTEGER NOT NULL,
    description TEXT NOT NULL,
    tags TEXT NOT NULL,
    license TEXT,
    temper TEXT,
    manifest TEXT NOT NULL,
    readme TEXT,
    yanked INTEGER NOT NULL DEFAULT 0,
    deleted INTEGER NOT NULL DEFAULT 0,
    published_at TEXT NOT NULL,
    PRIMARY KEY (namespace, name, version)
);
CREATE TABLE IF NOT EXISTS tokens (
    hash TEXT PRIMARY KEY,
    scope TEXT NOT NULL,
    label TEXT NOT NULL,
    created_at TEXT NOT NULL
);
";

const COLUMNS: &str =
    "namespace, name, version, digest, size, description, tags, license, temper, yanked, published_at";

fn row_to_info(r: &rusqlite::Row<'_>) -> rusqlite::Result<VersionInfo> {
    let tags: String = r.get(6)?;
    Ok(VersionInfo {
        namespace: r.get(0)?,
        name: r.get(1)?,
        version: r.get(2)?,
        digest: r.get(3)?,
        size: r.get::<_, i64>(4)?.max(0) as u64,
        description: r.get(5)?,
        tags: serde_json::from_str(&tags).unwrap_or_default(),
        license: r.get(7)?,
        temper: r.get(8)?,
        yanked: r.get::<_, i64>(9)? != 0,
        published_at: r.get(10)?,
    })
}

impl SqliteMeta {
    /// Open (create) the database at `path`.
    pub fn open(path: &Path) -> Result<Self, HubError> {
        let conn = Connection::open(path)?;
        let _mode: String =
            conn.pragma_update_and_check(None, "journal_mode", "WAL", |r| r.get(0))?;
        conn.busy_timeout(std::time::Duration::from_secs(10))?;
        conn.execute_batch(SCHEMA)?;
        Ok(SqliteMeta {
            conn: Mutex::new(conn),
        })
    }

    fn conn(&self) -> std::sync::MutexGuard<'_, Connection> {
        // A panic while holding the lock leaves SQLite consistent (each
        // statement is atomic), so a poisoned lock is still usable.
        self.conn.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl MetaStore for SqliteMeta {
    fn insert_version(&self, v: &NewVersion) -> Result<VersionInfo, HubError> {
        let m = &v.manifest;
        let tags =
            serde_json::to_string(&m.tags).map_err(|e| HubError::BadPackage(e.to_string()))?;
        let manifest = serde_json::to_string(m).map_err(|e| HubError::BadPackage(e.to_string()))?;
        let now = chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Secs, true);
        let version = m.version.to_string();
        let conn = self.conn();
        let res = conn.execute(
            "INSERT INTO versions (namespace, name, version, digest, size, description, tags, \
             license, temper, manifest, readme, published_at) \
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12)",
            params![
                m.namespace,
                m.name,
                version,
                v.digest,
                v.size as i64,
                m.description,
                tags,
                m.license,
                m.temper,
                manifest,
                v.readme,
                now
            ],
        );
        match res {
            Ok(_) => Ok(VersionInfo {
                namespace: m.namespace.clone(),
                name: m.name.clone(),
                version,
                digest: v.digest.clone(),
                size: v.size,
                description: m.description.clone(),
                tags: m.tags.clone(),
                license: m.license.clone(),
                temper: m.temper.clone(),
                yanked: false,
                published_at: now,
            }),
            Err(rusqlite::Error::SqliteFailure(e, _))
                if e.code == rusqlite::ErrorCode::ConstraintViolation =>
            {
                Err(HubError::VersionExists(format!("{}@{version}", m.id())))
            }
            Err(e) => Err(e.into()),
        }
    }

    fn versions(&self, namespace: &str, name: &str) -> Result<Vec<VersionInfo>, HubError> {
        let conn = self.conn();
        let mut st = conn.prepare(&format!(
            "SELECT {COLUMNS} FROM versions WHERE namespace = ?1 AND name = ?2 AND deleted = 0"
        ))?;
        let mut out: Vec<VersionInfo> = st
            .query_map(params![namespace, name], row_to_info)?
            .collect::<Result<_, _>>()?;
        sort_versions(&mut out);
        Ok(out)
    }

    fn readme(
        &self,
        namespace: &str,
        name: &str,
        version: &str,
    ) -> Result<Option<String>, HubError> {
        let conn = self.conn();
        let r: Option<Option<String>> = conn
            .query_row(
                "SELECT readme FROM versions WHERE namespace = ?1 AND name = ?2 AND version = ?3 \
                 AND deleted = 0",
                params![namespace, name, version],
                |r| r.get(0),
            )
            .optional()?;
        Ok(r.flatten())
    }

    fn search(&self, query: &Query) -> Result<Vec<VersionInfo>, HubError> {
        let conn = self.conn();
        // Packages with a matching version; then all their live versions.
        let like = query.q.as_deref().map(|q| {
            let escaped = q
                .to_lowercase()
                .replace('\\', "\\\\")
                .replace('%', "\\%")
                .replace('_', "\\_");
            format!("%{escaped}%")
        });
        let mut st = conn.prepare(&format!(
            "SELECT {COLUMNS} FROM versions v WHERE deleted = 0 AND EXISTS (
                SELECT 1 FROM versions m WHERE m.namespace = v.namespace AND m.name = v.name
                AND m.deleted = 0
                AND (?1 IS NULL OR lower(m.namespace || '/' || m.name || ' ' || m.description) LIKE ?1 ESCAPE '\\')
                AND (?2 IS NULL OR EXISTS (SELECT 1 FROM json_each(m.tags) WHERE value = ?2))
                AND (?3 IS NULL OR m.namespace = ?3))"
        ))?;
        let mut out: Vec<VersionInfo> = st
            .query_map(params![like, query.tag, query.namespace], row_to_info)?
            .collect::<Result<_, _>>()?;
        sort_versions(&mut out);
        Ok(out)
    }

    fn set_yanked(
        &self,
        namespace: &str,
        name: &str,
        version: &str,
        yanked: bool,
    ) -> Result<(), HubError> {
        let n = self.conn().execute(
            "UPDATE versions SET yanked = ?4 WHERE namespace = ?1 AND name = ?2 AND version = ?3 \
             AND deleted = 0",
            params![namespace, name, version, yanked as i64],
        )?;
        if n == 0 {
            return Err(HubError::NotFound(format!("{namespace}/{name}@{version}")));
        }
        Ok(())
    }

    fn delete_version(
        &self,
        namespace: &str,
        name: &str,
        version: &str,
    ) -> Result<String, HubError> {
        let conn = self.conn();
        let digest: Option<String> = conn
            .query_row(
                "UPDATE versions SET deleted = 1, readme = NULL WHERE namespace = ?1 AND name = ?2 \
                 AND version = ?3 AND deleted = 0 RETURNING digest",
                params![namespace, name, version],
                |r| r.get(0),
            )
            .optional()?;
        digest.ok_or_else(|| HubError::NotFound(format!("{namespace}/{name}@{version}")))
    }

    fn digest_live(&self, digest: &str) -> Result<bool, HubError> {
        let n: i64 = self.conn().query_row(
            "SELECT count(*) FROM versions WHERE digest = ?1 AND deleted = 0",
            params![digest],
            |r| r.get(0),
        )?;
        Ok(n > 0)
    }

    fn insert_token(&self, hash: &str, scope: &Scope, label: &str) -> Result<(), HubError> {
        let now = chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Secs, true);
        self.conn().execute(
            "INSERT INTO tokens (hash, scope, label, created_at) VALUES (?1, ?2, ?3, ?4)",
            params![hash, scope.as_string(), label, now],
        )?;
        Ok(())
    }

    fn token_scope(&self, hash: &str) -> Result<Option<Scope>, HubError> {
        let s: Option<String> = self
            .conn()
            .query_row(
                "SELECT scope FROM tokens WHERE hash = ?1",
                params![hash],
                |r| r.get(0),
            )
            .optional()?;
        Ok(s.as_deref().and_then(Scope::parse))
    }
}

/// Oldest first by semver (unparsable last, by text).
fn sort_versions(v: &mut [VersionInfo]) {
    v.sort_by(|a, b| {
        let key = |x: &VersionInfo| semver::Version::parse(&x.version).ok();
        (
            a.namespace.as_str(),
            a.name.as_str(),
            key(a),
            a.version.as_str(),
        )
            .cmp(&(
                b.namespace.as_str(),
                b.name.as_str(),
                key(b),
                b.version.as_str(),
            ))
    });
}

/// Archives as files named by digest under a directory; written to a
/// temporary file, synced, then renamed, so a half-written blob is never
/// visible.
pub struct FsBlobs {
    root: PathBuf,
}

impl FsBlobs {
    /// Blobs under `root` (created).
    pub fn open(root: &Path) -> Result<Self, HubError> {
        std::fs::create_dir_all(root.join("tmp")).map_err(|e| HubError::io(root, e))?;
        Ok(FsBlobs {
            root: root.to_path_buf(),
        })
    }

    /// Its temporary directory, on the blobs' file system.
    pub fn tmp_dir(&self) -> PathBuf {
        self.root.join("tmp")
    }

    /// Where `digest`'s bytes live (`sha256/ab/abcd...`).
    pub fn path(&self, digest: &str) -> Result<PathBuf, HubError> {
        let hex = digest
            .strip_prefix("sha256:")
            .filter(|h| h.len() == 64 && h.chars().all(|c| c.is_ascii_hexdigit()))
            .ok_or_else(|| HubError::BadRequest(format!("{digest:?} is not a sha256: digest")))?;
        Ok(self.root.join("sha256").join(&hex[..2]).join(hex))
    }
}

impl BlobStore for FsBlobs {
    fn put(&self, digest: &str, bytes: &[u8]) -> Result<(), HubError> {
        use std::io::Write;
        if self.path(digest)?.exists() {
            return Ok(());
        }
        let tmp_dir = self.tmp_dir();
        let mut tmp =
            tempfile::NamedTempFile::new_in(&tmp_dir).map_err(|e| HubError::io(&tmp_dir, e))?;
        tmp.write_all(bytes)
            .map_err(|e| HubError::io(tmp.path(), e))?;
        self.put_file(digest, tmp)
    }

    fn put_file(&self, digest: &str, file: tempfile::NamedTempFile) -> Result<(), HubError> {
        let path = self.path(digest)?;
        if path.exists() {
            return Ok(());
        }
        let dir = path.parent().unwrap_or(&self.root);
        std::fs::create_dir_all(dir).map_err(|e| HubError::io(dir, e))?;
        file.as_file()
            .sync_all()
            .map_err(|e| HubError::io(file.path(), e))?;
        match file.persist(&path) {
            Ok(_) => Ok(()),
            // Another file system: copy through a temporary file here.
            Err(e) => {
                let src = e.file.path().to_path_buf();
                let tmp_dir = self.tmp_dir();
                let mut tmp = tempfile::NamedTempFile::new_in(&tmp_dir)
                    .map_err(|e| HubError::io(&tmp_dir, e))?;
                let mut from = std::fs::File::open(&src).map_err(|e| HubError::io(&src, e))?;
                std::io::copy(&mut from, &mut tmp).map_err(|e| HubError::io(tmp.path(), e))?;
                tmp.as_file()
                    .sync_all()
                    .map_err(|e| HubError::io(&path, e))?;
                tmp.persist(&path)
                    .map_err(|e| HubError::io(&path, e.error))?;
                Ok(())
            }
        }
    }

    fn get(&self, digest: &str) -> Result<Option<Vec<u8>>, HubError> {
        let path = self.path(digest)?;
        match std::fs::read(&path) {
            Ok(b) => Ok(Some(b)),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(HubError::io(&path, e)),
        }
    }

    fn open(&self, digest: &str) -> Result<Option<BlobReader>, HubError> {
        let path = self.path(digest)?;
        let f = match std::fs::File::open(&path) {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(HubError::io(&path, e)),
        };
        let len = f.metadata().map_err(|e| HubError::io(&path, e))?.len();
        Ok(Some((Box::new(f), len)))
    }

    fn delete(&self, digest: &str) -> Result<(), HubError> {
        let path = self.path(digest)?;
        match std::fs::remove_file(&path) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(HubError::io(&path, e)),
        }
    }
}
