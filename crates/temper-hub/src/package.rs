//! The package: an environment directory packed into one deterministic
//! `.tar.gz` with a manifest, and its safe unpacking.
//!
//! Layout: `temper-package.json` ([`PackageManifest`]) first, then every
//! file of the directory in byte order of its path, each with mtime 0,
//! uid/gid 0, no user names and mode 0644 (0755 when executable); gzip
//! with mtime 0. So the same directory always gives the same bytes, and
//! the digest (`sha256:` of the archive) names the content.

use std::io::Read;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::HubError;

/// The manifest's file name inside an archive (and an unpacked package).
pub const MANIFEST_FILE: &str = "temper-package.json";
/// The package format this code writes and reads.
pub const FORMAT: u32 = 1;

/// What a package is: identity, description and every file's digest.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PackageManifest {
    /// Package format ([`FORMAT`]).
    pub format: u32,
    /// Owner.
    pub namespace: String,
    /// Name (the env.toml's `name`).
    pub name: String,
    /// Version.
    pub version: semver::Version,
    /// One line on what it is.
    pub description: String,
    /// Search tags.
    pub tags: Vec<String>,
    /// SPDX license id.
    pub license: Option<String>,
    /// The temper versions it needs (semver requirement).
    pub temper: Option<String>,
    /// How temper runs it.
    pub entry: Entry,
    /// Every file but the manifest, sorted by path.
    pub files: Vec<FileEntry>,
}

impl PackageManifest {
    /// `namespace/name`.
    pub fn id(&self) -> String {
        format!("{}/{}", self.namespace, self.name)
    }
}

/// How temper runs a package. All three load through the package's
/// `env.toml`; the kind says what that file holds.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "kebab-case", deny_unknown_fields)]
pub enum Entry {
    /// Data files, a harness and a rubric declared in env.toml.
    EnvToml,
    /// A built-in generator (`[dataset] generator = ...`).
    Builtin {
        /// The generator's name.
        generator: String,
    },
    /// An external program speaking the JSON-lines protocol.
    Command {
        /// The command, run from the package directory.
        command: String,
    },
}

/// One file of a package.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileEntry {
    /// Relative path with `/` separators.
    pub path: String,
    /// Bytes.
    pub size: u64,
    /// Hex sha256 of the content.
    pub sha256: String,
    /// Whether it is executable (mode 0755).
    pub executable: bool,
}

/// A packed directory.
#[derive(Debug, Clone)]
pub struct Packed {
    /// Its manifest.
    pub manifest: PackageManifest,
    /// The archive.
    pub bytes: Vec<u8>,
    /// `sha256:` + hex of `bytes`.
    pub digest: String,
}

/// Bounds on what unpacking accepts, against archive bombs.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Most bytes all files may hold together, unpacked.
    pub max_unpacked_bytes: u64,
    /// Most unpacked bytes per archive byte (beyond the first MiB).
    pub max_ratio: u64,
    /// Most files.
    pub max_files: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_unpacked_bytes: 1 << 30,
            max_ratio: 100,
            max_files: 10_000,
        }
    }
}

/// `sha256:` + hex of `bytes`.
pub fn digest(bytes: &[u8]) -> String {
    format!("sha256:{}", hex(&Sha256::digest(bytes)))
}

pub(crate) fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Whether `s` is a valid namespace or package name: 1–64 of
/// `a-z 0-9 - _`, starting with a letter or digit.
pub fn valid_name(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 64
        && s.chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-' || c == '_')
        && s.chars().next().is_some_and(|c| c.is_ascii_alphanumeric())
}

fn bad(m: impl Into<String>) -> HubError {
    HubError::BadPackage(m.into())
}

/// Pack the environment directory `dir` (an `env.toml` and its files).
/// `namespace` overrides env.toml's `namespace`. Hidden files and
/// `__pycache__` are left out; a symlink is an error, since a package holds
/// regular files only.
pub fn pack_dir(dir: &Path, namespace: Option<&str>) -> Result<Packed, HubError> {
    let toml_path = dir.join("env.toml");
    let m = temper_env::manifest::read_manifest(&toml_path).map_err(|e| bad(e.to_string()))?;
    let namespace = namespace
        .map(str::to_string)
        .or(m.namespace.clone())
        .ok_or_else(|| bad("env.toml has no `namespace` (or pass --namespace)"))?;
    if !valid_name(&namespace) {
        return Err(bad(format!(
            "namespace {namespace:?}: use a-z, 0-9, '-' and '_'"
        )));
    }
    if !valid_name(&m.name) {
        return Err(bad(format!(
            "name {:?}: hub names use a-z, 0-9, '-' and '_'",
            m.name
        )));
    }
    let version_text = m
        .version
        .as_deref()
        .ok_or_else(|| bad("env.toml has no `version`"))?;
    let version = semver::Version::parse(version_text)
        .map_err(|e| bad(format!("version {version_text:?}: {e}")))?;
    if let Some(req) = &m.temper {
        semver::VersionReq::parse(req).map_err(|e| bad(format!("temper = {req:?}: {e}")))?;
    }
    let entry = match (
        &m.command,
        m.dataset.as_ref().and_then(|d| d.generator.clone()),
    ) {
        (Some(command), _) => Entry::Command {
            command: command.clone(),
        },
        (None, Some(generator)) => Entry::Builtin { generator },
        (None, None) => Entry::EnvToml,
    };
    let mut paths = Vec::new();
    collect_files(dir, dir, &mut paths)?;
    paths.sort();
    let mut files = Vec::with_capacity(paths.len());
    let mut contents = Vec::with_capacity(paths.len());
    for (rel, abs) in &paths {
        let bytes = std::fs::read(abs).map_err(|e| HubError::io(abs, e))?;
        let executable = is_executable(abs)?;
        files.push(FileEntry {
            path: rel.clone(),
            size: bytes.len() as u64,
            sha256: hex(&Sha256::digest(&bytes)),
            executable,
        });
        contents.push(bytes);
    }
    let manifest = PackageManifest {
        format: FORMAT,
        namespace,
        name: m.name.clone(),
        version,
        description: m.description.clone().unwrap_or_default(),
        tags: m.tags.clone(),
        license: m.license.clone(),
        temper: m.temper.clone(),
        entry,
        files,
    };
    // Refuse here what the hub and the unpacker would refuse.
    check_manifest(&manifest, &Limits::default())?;
    let bytes = write_archive(&manifest, &contents)?;
    Ok(Packed {
        digest: digest(&bytes),
        manifest,
        bytes,
    })
}

fn is_executable(path: &Path) -> Result<bool, HubError> {
    use std::os::unix::fs::PermissionsExt;
    let meta = std::fs::metadata(path).map_err(|e| HubError::io(path, e))?;
    Ok(meta.permissions().mode() & 0o111 != 0)
}

fn collect_files(
    root: &Path,
    dir: &Path,
    out: &mut Vec<(String, PathBuf)>,
) -> Result<(), HubError> {
    let rd = std::fs::read_dir(dir).map_err(|e| HubError::io(dir, e))?;
    for item in rd {
        let item = item.map_err(|e| HubError::io(dir, e))?;
        let name = item.file_name();
        let name = name.to_str().ok_or_else(|| {
            bad(format!(
                "{}: file names must be UTF-8",
                item.path().display()
            ))
        })?;
        if name.starts_with('.') || name == "__pycache__" || name == MANIFEST_FILE {
            continue;
        }
        let path = item.path();
        let ft = item.file_type().map_err(|e| HubError::io(&path, e))?;
        if ft.is_dir() {
            collect_files(root, &path, out)?;
        } else if ft.is_file() {
            let rel = path
                .strip_prefix(root)
                .map_err(|_| bad(format!("{} is outside {}", path.display(), root.display())))?;
            let rel: Vec<&str> = rel
                .components()
                .filter_map(|c| c.as_os_str().to_str())
                .collect();
            out.push((rel.join("/"), path));
        } else {
            return Err(bad(format!(
                "{}: a package holds regular files only (no symlinks or devices)",
                path.display()
            )));
        }
    }
    Ok(())
}

fn write_archive(manifest: &PackageManifest, contents: &[Vec<u8>]) -> Result<Vec<u8>, HubError> {
    let gz = flate2::GzBuilder::new()
        .mtime(0)
        .operating_system(255)
        .write(Vec::new(), flate2::Compression::default());
    let mut tar = tar::Builder::new(gz);
    tar.mode(tar::HeaderMode::Deterministic);
    let json = serde_json::to_vec_pretty(manifest).map_err(|e| bad(e.to_string()))?;
    let mut append = |path: &str, data: &[u8], executable: bool| -> Result<(), HubError> {
        let mut h = tar::Header::new_gnu();
        h.set_entry_type(tar::EntryType::Regular);
        h.set_size(data.len() as u64);
        h.set_mode(if executable { 0o755 } else { 0o644 });
        h.set_mtime(0);
        h.set_uid(0);
        h.set_gid(0);
        tar.append_data(&mut h, path, data)
            .map_err(|e| bad(format!("{path}: {e}")))
    };
    append(MANIFEST_FILE, &json, false)?;
    for (f, data) in manifest.files.iter().zip(contents) {
        append(&f.path, data, f.executable)?;
    }
    let gz = tar.into_inner().map_err(|e| bad(e.to_string()))?;
    gz.finish().map_err(|e| bad(e.to_string()))
}

/// Longest path component in a package, bytes (the usual file system
/// `NAME_MAX`: a longer one cannot be unpacked).
pub const MAX_COMPONENT_BYTES: usize = 255;
/// Longest path in a package, bytes.
pub const MAX_PATH_BYTES: usize = 1024;
/// Longest version text, pre-release and build metadata included.
pub const MAX_VERSION_BYTES: usize = 64;
/// Longest description, bytes.
pub const MAX_DESCRIPTION_BYTES: usize = 4096;
/// Most tags, and the longest tag in bytes.
pub const MAX_TAGS: usize = 32;
/// Longest tag, license, `temper` requirement, generator or command, bytes.
pub const MAX_FIELD_BYTES: usize = 256;
/// Largest `temper-package.json`, bytes.
pub const MAX_MANIFEST_BYTES: u64 = 16 << 20;
/// The file the cache writes next to an unpacked package: reserved.
pub(crate) const DIGEST_FILE: &str = ".temper-digest";

/// Check one path as packing, publishing and unpacking all do: a
/// canonical relative path (`/`-separated components, none empty, `.` or
/// `..`), no NUL, backslash or control character, each component at most
/// [`MAX_COMPONENT_BYTES`] and the whole at most [`MAX_PATH_BYTES`]. A
/// canonical path means one string per file, so `a/b` and `a//b` cannot
/// both appear and land on one file.
pub fn check_path(path: &str) -> Result<(), HubError> {
    let unsafe_entry = |reason: String| HubError::UnsafeEntry {
        path: path.chars().take(200).collect(),
        reason,
    };
    if path.is_empty() {
        return Err(unsafe_entry("empty path".into()));
    }
    if path.len() > MAX_PATH_BYTES {
        return Err(unsafe_entry(format!(
            "the path is {} bytes (limit {MAX_PATH_BYTES})",
            path.len()
        )));
    }
    if path.starts_with('/') {
        return Err(unsafe_entry("absolute path".into()));
    }
    if path.contains('\0') || path.contains('\\') || path.chars().any(char::is_control) {
        return Err(unsafe_entry(
            "NUL, backslash or a control character in the path".into(),
        ));
    }
    for c in path.split('/') {
        match c {
            "" => {
                return Err(unsafe_entry(
                    "an empty component (`//` or a trailing `/`): paths must be canonical".into(),
                ))
            }
            "." => return Err(unsafe_entry("`.` in the path".into())),
            ".." => return Err(unsafe_entry("`..` leaves the package".into())),
            c if c.len() > MAX_COMPONENT_BYTES => {
                return Err(unsafe_entry(format!(
                    "a path component of {} bytes (limit {MAX_COMPONENT_BYTES})",
                    c.len()
                )))
            }
            _ => {}
        }
    }
    Ok(())
}

/// Check a version's length (a long pre-release or build metadata would
/// be a directory name and, as "latest", shown everywhere).
pub fn check_version(v: &semver::Version) -> Result<(), HubError> {
    let text = v.to_string();
    if text.len() <= MAX_VERSION_BYTES {
        return Ok(());
    }
    let part = if v.build.len() > v.pre.len() {
        "build metadata"
    } else {
        "pre-release"
    };
    Err(bad(format!(
        "version is {} bytes, mostly {part} (limit {MAX_VERSION_BYTES})",
        text.len()
    )))
}

/// The files of one package: no path twice, none both a file and a
/// directory, none equal to another but for case (they would collide on
/// a case-insensitive file system), and none taking the manifest's or the
/// cache's reserved names.
struct PathSet {
    files: std::collections::HashSet<String>,
    dirs: std::collections::HashSet<String>,
}

impl PathSet {
    fn new() -> Self {
        let mut s = PathSet {
            files: Default::default(),
            dirs: Default::default(),
        };
        s.files.insert(MANIFEST_FILE.to_lowercase());
        s.files.insert(DIGEST_FILE.to_lowercase());
        s
    }

    fn add(&mut self, path: &str) -> Result<(), HubError> {
        check_path(path)?;
        let conflict = |reason: &str| HubError::UnsafeEntry {
            path: path.to_string(),
            reason: reason.to_string(),
        };
        let key = path.to_lowercase();
        if self.files.contains(&key) {
            return Err(conflict(
                "appears twice (or twice but for case, or is a reserved name)",
            ));
        }
        if self.dirs.contains(&key) {
            return Err(conflict("is both a file and a directory"));
        }
        let mut end = 0;
        while let Some(i) = key[end..].find('/') {
            let dir = &key[..end + i];
            if self.files.contains(dir) {
                return Err(conflict(&format!(
                    "is under {dir:?}, which is a file (or a reserved name)"
                )));
            }
            self.dirs.insert(dir.to_string());
            end += i + 1;
        }
        self.files.insert(key);
        Ok(())
    }
}

/// Check a manifest as packing, publishing and unpacking all do: format,
/// names, version, field lengths, and every file path (one
/// [`check_path`], no duplicates or file/directory clashes, at most
/// `limits.max_files`), with an `env.toml`.
pub fn check_manifest(m: &PackageManifest, limits: &Limits) -> Result<(), HubError> {
    if m.format != FORMAT {
        return Err(bad(format!(
            "package format {} (this temper reads {FORMAT})",
            m.format
        )));
    }
    if !valid_name(&m.namespace) || !valid_name(&m.name) {
        return Err(bad("invalid namespace or name in the manifest"));
    }
    check_version(&m.version)?;
    if m.description.len() > MAX_DESCRIPTION_BYTES {
        return Err(bad(format!(
            "the description is {} bytes (limit {MAX_DESCRIPTION_BYTES})",
            m.description.len()
        )));
    }
    if m.tags.len() > MAX_TAGS {
        return Err(bad(format!("{} tags (limit {MAX_TAGS})", m.tags.len())));
    }
    let command = match &m.entry {
        Entry::EnvToml => None,
        Entry::Builtin { generator } => Some(generator),
        Entry::Command { command } => Some(command),
    };
    let fields = m
        .tags
        .iter()
        .map(|t| ("a tag", t))
        .chain(m.license.iter().map(|l| ("license", l)))
        .chain(m.temper.iter().map(|t| ("temper", t)))
        .chain(command.map(|c| ("entry", c)));
    for (what, text) in fields {
        if text.len() > MAX_FIELD_BYTES {
            return Err(bad(format!(
                "{what} is {} bytes (limit {MAX_FIELD_BYTES})",
                text.len()
            )));
        }
    }
    if m.files.len() > limits.max_files {
        return Err(bad(format!("more than {} files", limits.max_files)));
    }
    let mut paths = PathSet::new();
    for f in &m.files {
        paths.add(&f.path)?;
        if f.sha256.len() != 64 || !f.sha256.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(bad(format!("{}: the sha256 is not 64 hex digits", f.path)));
        }
    }
    if !m.files.iter().any(|f| f.path == "env.toml") {
        return Err(bad("a package needs env.toml"));
    }
    Ok(())
}

/// One file read from an archive.
#[derive(Debug, Clone)]
pub struct UnpackedFile {
    /// Relative path (checked safe).
    pub path: String,
    /// Content (checked against the manifest).
    pub bytes: Vec<u8>,
    /// Mode 0755.
    pub executable: bool,
}

/// Where [`check_archive`] sends each file's bytes as it reads them. A
/// file's bytes are checked against the manifest only once all have been
/// sent: a sink that keeps them must drop them when the check fails.
pub trait FileSink {
    /// A file begins (its path already checked).
    fn begin(&mut self, file: &FileEntry) -> Result<(), HubError>;
    /// The next bytes of the current file.
    fn write(&mut self, bytes: &[u8]) -> Result<(), HubError>;
}

/// A sink that keeps nothing: only check.
pub struct Discard;

impl FileSink for Discard {
    fn begin(&mut self, _: &FileEntry) -> Result<(), HubError> {
        Ok(())
    }
    fn write(&mut self, _: &[u8]) -> Result<(), HubError> {
        Ok(())
    }
}

struct Collect(Vec<UnpackedFile>);

impl FileSink for Collect {
    fn begin(&mut self, file: &FileEntry) -> Result<(), HubError> {
        self.0.push(UnpackedFile {
            path: file.path.clone(),
            bytes: Vec::new(),
            executable: file.executable,
        });
        Ok(())
    }
    fn write(&mut self, bytes: &[u8]) -> Result<(), HubError> {
        match self.0.last_mut() {
            Some(f) => {
                f.bytes.extend_from_slice(bytes);
                Ok(())
            }
            None => Err(HubError::Internal("bytes before a file began".into())),
        }
    }
}

/// Read and check an archive held in memory; see [`check_archive`].
pub fn read_archive(
    archive: &[u8],
    limits: &Limits,
) -> Result<(PackageManifest, Vec<UnpackedFile>), HubError> {
    let mut files = Collect(Vec::new());
    let manifest = check_archive(archive, archive.len() as u64, limits, &mut files)?;
    Ok((manifest, files.0))
}

/// Read and check an archive of `archive_len` bytes as a stream, sending
/// each file to `sink`: every entry a regular file at a path
/// [`check_path`] accepts, the manifest first and [`check_manifest`]-valid,
/// the files exactly the manifest's (paths, order, sizes and sha256), the
/// totals within `limits`, and the gzip stream whole (its CRC and length
/// trailer checked, nothing after it). Publishing and unpacking both run
/// this, so the hub accepts exactly what a client can install.
pub fn check_archive<R: std::io::BufRead>(
    archive: R,
    archive_len: u64,
    limits: &Limits,
    sink: &mut dyn FileSink,
) -> Result<PackageManifest, HubError> {
    let mut tar = tar::Archive::new(flate2::bufread::GzDecoder::new(archive));
    let mut total: u64 = 0;
    let allowed = |total: u64| -> Result<(), HubError> {
        if total > limits.max_unpacked_bytes {
            return Err(HubError::TooLarge {
                limit: limits.max_unpacked_bytes,
            });
        }
        let slack = 1 << 20;
        if total > slack && total > limits.max_ratio.saturating_mul(archive_len) {
            return Err(HubError::RatioBomb {
                ratio: total / archive_len.max(1),
                limit: limits.max_ratio,
            });
        }
        Ok(())
    };
    let mut manifest: Option<PackageManifest> = None;
    let mut seen = 0usize;
    let mut buf = vec![0u8; 64 * 1024];
    {
        let entries = tar
            .entries()
            .map_err(|e| bad(format!("not a tar.gz: {e}")))?;
        for entry in entries {
            let mut entry = entry.map_err(|e| bad(format!("corrupt archive: {e}")))?;
            let raw = entry.path_bytes().into_owned();
            let path = String::from_utf8(raw).map_err(|_| bad("an entry's path is not UTF-8"))?;
            check_path(&path)?;
            check_kind(&path, entry.header().entry_type())?;
            let Some(m) = &manifest else {
                if path != MANIFEST_FILE {
                    return Err(bad(format!(
                        "the first entry must be {MANIFEST_FILE}, not {path:?}"
                    )));
                }
                // Bounded read: the header's size is not trusted.
                let mut json = Vec::new();
                (&mut entry)
                    .take(MAX_MANIFEST_BYTES + 1)
                    .read_to_end(&mut json)
                    .map_err(|e| bad(format!("{MANIFEST_FILE}: {e}")))?;
                if json.len() as u64 > MAX_MANIFEST_BYTES {
                    return Err(bad(format!(
                        "{MANIFEST_FILE} is over {MAX_MANIFEST_BYTES} bytes"
                    )));
                }
                total += json.len() as u64;
                allowed(total)?;
                let m: PackageManifest = serde_json::from_slice(&json)
                    .map_err(|e| bad(format!("{MANIFEST_FILE}: {e}")))?;
                check_manifest(&m, limits)?;
                manifest = Some(m);
                continue;
            };
            let Some(want) = m.files.get(seen) else {
                return Err(bad(format!(
                    "{path:?} is not in the manifest, which lists {} files",
                    m.files.len()
                )));
            };
            if want.path != path {
                return Err(bad(format!("expected {:?}, found {path:?}", want.path)));
            }
            seen += 1;
            sink.begin(want)?;
            let mut hash = Sha256::new();
            let mut size = 0u64;
            // Read in bounded chunks: the header's size is not trusted.
            loop {
                let n = entry
                    .read(&mut buf)
                    .map_err(|e| bad(format!("{path}: {e}")))?;
                if n == 0 {
                    break;
                }
                total += n as u64;
                size += n as u64;
                allowed(total)?;
                hash.update(&buf[..n]);
                sink.write(&buf[..n])?;
            }
            if want.sha256 != hex(&hash.finalize()) || want.size != size {
                return Err(bad(format!("{path}: content does not match the manifest")));
            }
        }
    }
    let manifest = manifest.ok_or_else(|| bad(format!("no {MANIFEST_FILE}")))?;
    if manifest.files.len() != seen {
        return Err(bad(format!(
            "the manifest lists {} files, the archive holds {seen}",
            manifest.files.len()
        )));
    }
    // Read the gzip stream to its end: only there does the decoder check
    // the CRC and length trailer. The tar end blocks and padding count
    // against the limits like any other byte.
    let mut gz = tar.into_inner();
    loop {
        let n = gz
            .read(&mut buf)
            .map_err(|e| bad(format!("the gzip stream is corrupt or truncated: {e}")))?;
        if n == 0 {
            break;
        }
        total += n as u64;
        allowed(total)?;
    }
    let mut rest = gz.into_inner();
    let after = rest
        .fill_buf()
        .map_err(|e| bad(format!("reading the archive: {e}")))?;
    if !after.is_empty() {
        return Err(bad("bytes after the end of the gzip stream"));
    }
    Ok(manifest)
}

fn check_kind(path: &str, kind: tar::EntryType) -> Result<(), HubError> {
    if kind.is_file() {
        return Ok(());
    }
    let what = if kind.is_symlink() {
        "a symlink"
    } else if kind.is_hard_link() {
        "a hard link"
    } else if kind.is_character_special() || kind.is_block_special() {
        "a device file"
    } else if kind.is_fifo() {
        "a fifo"
    } else if kind.is_dir() {
        "a directory entry"
    } else {
        "not a regular file"
    };
    Err(HubError::UnsafeEntry {
        path: path.to_string(),
        reason: format!("{what}: packages hold regular files only"),
    })
}

/// Writes each file under a new directory as it is read.
struct DirSink {
    dest: PathBuf,
    current: Option<(PathBuf, std::fs::File)>,
}

impl FileSink for DirSink {
    fn begin(&mut self, file: &FileEntry) -> Result<(), HubError> {
        use std::os::unix::fs::OpenOptionsExt;
        // The path passed check_manifest: relative, canonical, no clash,
        // so it stays under `dest` and names a new file.
        let path = self.dest.join(&file.path);
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent).map_err(|e| HubError::io(parent, e))?;
        }
        let f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(if file.executable { 0o755 } else { 0o644 })
            .open(&path)
            .map_err(|e| HubError::io(&path, e))?;
        self.current = Some((path, f));
        Ok(())
    }
    fn write(&mut self, bytes: &[u8]) -> Result<(), HubError> {
        use std::io::Write;
        match &mut self.current {
            Some((path, f)) => f.write_all(bytes).map_err(|e| HubError::io(path, e)),
            None => Err(HubError::Internal("bytes before a file began".into())),
        }
    }
}

/// Check `archive` and write its files (and manifest) under the new
/// directory `dest`, which must not exist. On error `dest` is removed.
pub fn unpack(archive: &[u8], dest: &Path, limits: &Limits) -> Result<PackageManifest, HubError> {
    unpack_from(archive, archive.len() as u64, dest, limits)
}

/// [`unpack`] from a stream of `archive_len` bytes (a downloaded file):
/// files go to disk as they are read, so memory stays bounded.
pub fn unpack_from<R: std::io::BufRead>(
    archive: R,
    archive_len: u64,
    dest: &Path,
    limits: &Limits,
) -> Result<PackageManifest, HubError> {
    std::fs::create_dir(dest).map_err(|e| HubError::io(dest, e))?;
    let result = (|| {
        let mut sink = DirSink {
            dest: dest.to_path_buf(),
            current: None,
        };
        let manifest = check_archive(archive, archive_len, limits, &mut sink)?;
        drop(sink);
        let json = serde_json::to_vec_pretty(&manifest).map_err(|e| bad(e.to_string()))?;
        let mpath = dest.join(MANIFEST_FILE);
        std::fs::write(&mpath, json).map_err(|e| HubError::io(&mpath, e))?;
        Ok(manifest)
    })();
    if result.is_err() {
        let _ = std::fs::remove_dir_all(dest);
    }
    result
}
