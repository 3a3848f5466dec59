//! The package: an environment directory packed into one deterministic
//! `.tar.gz` with a manifest, and its safe unpacking.
//!
//! Layout: `temper-package.json` ([`PackageManifest`]) first, then every
//! file of the directory in byte order of its path, each with mtime 0,
//! uid/gid 0, no user names and mode 0644 (0755 when executable); gzip
//! with mtime 0. So the same directory always gives the same bytes, and
//! the digest (`sha256:` of the archive) names the content.

use std::io::Read;
use std::path::{Component, Path, PathBuf};

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

/// Read and check an archive: every entry a regular file at a safe
/// relative path, the manifest first, the files exactly the manifest's
/// (sizes and sha256), and the totals within `limits`.
pub fn read_archive(
    archive: &[u8],
    limits: &Limits,
) -> Result<(PackageManifest, Vec<UnpackedFile>), HubError> {
    let mut tar = tar::Archive::new(flate2::read::GzDecoder::new(archive));
    let entries = tar
        .entries()
        .map_err(|e| bad(format!("not a tar.gz: {e}")))?;
    let mut total: u64 = 0;
    let mut manifest: Option<PackageManifest> = None;
    let mut files: Vec<UnpackedFile> = Vec::new();
    let allowed = |total: u64| -> Result<(), HubError> {
        if total > limits.max_unpacked_bytes {
            return Err(HubError::TooLarge {
                limit: limits.max_unpacked_bytes,
            });
        }
        let slack = 1 << 20;
        if total > slack && total > limits.max_ratio.saturating_mul(archive.len() as u64) {
            return Err(HubError::RatioBomb {
                ratio: total / (archive.len() as u64).max(1),
                limit: limits.max_ratio,
            });
        }
        Ok(())
    };
    for entry in entries {
        let mut entry = entry.map_err(|e| bad(format!("corrupt archive: {e}")))?;
        let raw = entry.path_bytes().into_owned();
        let path = String::from_utf8(raw).map_err(|_| bad("an entry's path is not UTF-8"))?;
        check_path(&path)?;
        let kind = entry.header().entry_type();
        if !kind.is_file() {
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
            return Err(HubError::UnsafeEntry {
                path,
                reason: format!("{what}: packages hold regular files only"),
            });
        }
        if files.len() >= limits.max_files {
            return Err(bad(format!("more than {} files", limits.max_files)));
        }
        // Read in bounded chunks: the header's size is not trusted.
        let mut bytes = Vec::new();
        let mut buf = [0u8; 64 * 1024];
        loop {
            let n = entry
                .read(&mut buf)
                .map_err(|e| bad(format!("{path}: {e}")))?;
            if n == 0 {
                break;
            }
            total += n as u64;
            allowed(total)?;
            bytes.extend_from_slice(&buf[..n]);
        }
        let executable = entry.header().mode().is_ok_and(|m| m & 0o111 != 0);
        if manifest.is_none() {
            if path != MANIFEST_FILE {
                return Err(bad(format!(
                    "the first entry must be {MANIFEST_FILE}, not {path:?}"
                )));
            }
            let m: PackageManifest =
                serde_json::from_slice(&bytes).map_err(|e| bad(format!("{MANIFEST_FILE}: {e}")))?;
            if m.format != FORMAT {
                return Err(bad(format!(
                    "package format {} (this temper reads {FORMAT})",
                    m.format
                )));
            }
            if !valid_name(&m.namespace) || !valid_name(&m.name) {
                return Err(bad("invalid namespace or name in the manifest"));
            }
            manifest = Some(m);
            continue;
        }
        if files.iter().any(|f| f.path == path) || path == MANIFEST_FILE {
            return Err(bad(format!("{path:?} appears twice")));
        }
        files.push(UnpackedFile {
            path,
            bytes,
            executable,
        });
    }
    let manifest = manifest.ok_or_else(|| bad(format!("no {MANIFEST_FILE}")))?;
    if manifest.files.len() != files.len() {
        return Err(bad(format!(
            "the manifest lists {} files, the archive holds {}",
            manifest.files.len(),
            files.len()
        )));
    }
    for (want, got) in manifest.files.iter().zip(&files) {
        if want.path != got.path {
            return Err(bad(format!(
                "expected {:?}, found {:?}",
                want.path, got.path
            )));
        }
        let sha = hex(&Sha256::digest(&got.bytes));
        if want.sha256 != sha || want.size != got.bytes.len() as u64 {
            return Err(bad(format!(
                "{}: content does not match the manifest",
                got.path
            )));
        }
    }
    if !files.iter().any(|f| f.path == "env.toml") {
        return Err(bad("a package needs env.toml"));
    }
    Ok((manifest, files))
}

/// A relative path of normal components only: no `..`, no `.`, no root.
fn check_path(path: &str) -> Result<(), HubError> {
    let unsafe_entry = |reason: &str| HubError::UnsafeEntry {
        path: path.to_string(),
        reason: reason.to_string(),
    };
    if path.is_empty() || path.contains('\0') || path.contains('\\') {
        return Err(unsafe_entry("empty, NUL or backslash in the path"));
    }
    for c in Path::new(path).components() {
        match c {
            Component::Normal(_) => {}
            Component::ParentDir => return Err(unsafe_entry("`..` leaves the package")),
            Component::RootDir | Component::Prefix(_) => return Err(unsafe_entry("absolute path")),
            Component::CurDir => return Err(unsafe_entry("`.` in the path")),
        }
    }
    Ok(())
}

/// Check `archive` and write its files (and manifest) under the new
/// directory `dest`, which must not exist. On error `dest` is removed.
pub fn unpack(archive: &[u8], dest: &Path, limits: &Limits) -> Result<PackageManifest, HubError> {
    let (manifest, files) = read_archive(archive, limits)?;
    let result = write_files(dest, &manifest, &files);
    if result.is_err() {
        let _ = std::fs::remove_dir_all(dest);
    }
    result.map(|()| manifest)
}

fn write_files(
    dest: &Path,
    manifest: &PackageManifest,
    files: &[UnpackedFile],
) -> Result<(), HubError> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::create_dir(dest).map_err(|e| HubError::io(dest, e))?;
    let json = serde_json::to_vec_pretty(manifest).map_err(|e| bad(e.to_string()))?;
    let mpath = dest.join(MANIFEST_FILE);
    std::fs::write(&mpath, json).map_err(|e| HubError::io(&mpath, e))?;
    for f in files {
        let path = dest.join(&f.path);
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent).map_err(|e| HubError::io(parent, e))?;
        }
        std::fs::write(&path, &f.bytes).map_err(|e| HubError::io(&path, e))?;
        let mode = if f.executable { 0o755 } else { 0o644 };
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode))
            .map_err(|e| HubError::io(&path, e))?;
    }
    Ok(())
}
