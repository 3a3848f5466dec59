//! What Harbor's models need of a job and its trials that temper has no
//! use for itself: UUIDs, the task checksum Harbor computes, and how
//! temper's sandbox is named in an `EnvironmentConfig`.
//!
//! Harbor (0.25) reads a job with pydantic models: `id` fields are UUIDs,
//! `TrialResult.task_checksum` is required, and `EnvironmentConfig.type`
//! is one of Harbor's own runtimes. temper's sandbox is none of them, so
//! it is named the way Harbor names an environment from outside its list:
//! by `import_path`, with what temper gave the sandbox in `kwargs`.

use std::path::{Path, PathBuf};

use rand::Rng;
use serde_json::{json, Value};
use sha2::{Digest, Sha256};

use crate::TaskError;

/// The `import_path` of temper's sandbox in an `EnvironmentConfig`. It
/// names the runtime for readers (Harbor's `harbor view` and models load
/// it); it is not a Python class, so `harbor run` cannot rerun the trial.
pub const SANDBOX_IMPORT_PATH: &str = "temper.sandbox:TemperSandbox";

/// A random (version 4) UUID, as Harbor's `uuid4()` writes it.
pub fn uuid_v4() -> String {
    let mut b: [u8; 16] = rand::rng().random();
    b[6] = (b[6] & 0x0f) | 0x40;
    b[8] = (b[8] & 0x3f) | 0x80;
    let h: String = b.iter().map(|x| format!("{x:02x}")).collect();
    format!(
        "{}-{}-{}-{}-{}",
        &h[..8],
        &h[8..12],
        &h[12..16],
        &h[16..20],
        &h[20..]
    )
}

/// Harbor's `EnvironmentConfig` for temper's sandbox: `import_path`
/// instead of a `type`, and `kwargs` (temper's specifics).
pub fn environment_config(kwargs: Value) -> Value {
    json!({ "import_path": SANDBOX_IMPORT_PATH, "kwargs": kwargs })
}

/// Harbor's `Task.checksum` of the task directory `dir`: `dirhash`'s
/// sha256 with its default protocol (an entry is `data:<sha256 of the
/// file>` or `dirhash:<hash of the directory>` and `name:<name>`; a
/// directory hashes its entries' descriptors, sorted), following symlinks,
/// leaving out empty directories and `.harborignore` files. temper does not
/// read `.harborignore` patterns, so a task whose `tests/` or `solution/`
/// ignores files through one gets a different checksum than Harbor's.
pub fn task_checksum(dir: &Path) -> Result<String, TaskError> {
    let mut ancestors = Vec::new();
    dir_hash(dir, &mut ancestors)?
        .ok_or_else(|| TaskError::Invalid(format!("{}: nothing to hash (no files)", dir.display())))
}

fn sha256_hex(bytes: &[u8]) -> String {
    Sha256::digest(bytes)
        .iter()
        .map(|x| format!("{x:02x}"))
        .collect()
}

/// The directory's hash, or `None` when it holds no file (dirhash leaves
/// such directories out).
fn dir_hash(dir: &Path, ancestors: &mut Vec<PathBuf>) -> Result<Option<String>, TaskError> {
    let real = dir
        .canonicalize()
        .map_err(|e| TaskError::io("resolve", dir.to_path_buf(), e))?;
    if ancestors.contains(&real) {
        return Err(TaskError::Invalid(format!(
            "{}: a symlink loops back to a directory above it",
            dir.display()
        )));
    }
    ancestors.push(real);
    let mut entries = Vec::new();
    let rd = std::fs::read_dir(dir).map_err(|e| TaskError::io("read", dir.to_path_buf(), e))?;
    for e in rd {
        let e = e.map_err(|e| TaskError::io("read", dir.to_path_buf(), e))?;
        let path = e.path();
        let name = e.file_name().to_string_lossy().into_owned();
        // Follows symlinks, as dirhash does.
        let meta = std::fs::metadata(&path).map_err(|e| TaskError::io("stat", path.clone(), e))?;
        if meta.is_dir() {
            if let Some(h) = dir_hash(&path, ancestors)? {
                entries.push(format!("dirhash:{h}\0name:{name}"));
            }
        } else if name != ".harborignore" {
            let bytes = std::fs::read(&path).map_err(|e| TaskError::io("read", path.clone(), e))?;
            entries.push(format!("data:{}\0name:{name}", sha256_hex(&bytes)));
        }
    }
    ancestors.pop();
    if entries.is_empty() {
        return Ok(None);
    }
    entries.sort();
    Ok(Some(sha256_hex(entries.join("\0\0").as_bytes())))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uuids_are_version_4() {
        let a = uuid_v4();
        assert_eq!(a.len(), 36);
        let parts: Vec<&str> = a.split('-').collect();
        assert_eq!(
            parts.iter().map(|p| p.len()).collect::<Vec<_>>(),
            [8, 4, 4, 4, 12]
        );
        assert!(parts[2].starts_with('4'));
        assert!(matches!(&parts[3][..1], "8" | "9" | "a" | "b"));
        assert_ne!(a, uuid_v4());
    }

    #[test]
    fn checksum_is_dirhash_sha256() {
        let d = tempfile::tempdir().expect("tempdir");
        std::fs::write(d.path().join("a.txt"), "hello\n").expect("write");
        std::fs::create_dir_all(d.path().join("sub/empty")).expect("mkdir");
        std::fs::write(d.path().join("sub/b"), "").expect("write");
        std::fs::write(d.path().join("sub/.harborignore"), "x\n").expect("write");
        // What Python's `dirhash.dirhash(dir, "sha256")` (dirhash 0.5.0,
        // Harbor 0.25's) gives for this tree without the .harborignore.
        let want = "f4428d8d4dfd9fa52b498c2ee53e51aaa2a1a8cf745ebd0e0c510e7dedfbef22";
        assert_eq!(task_checksum(d.path()).expect("checksum"), want);
        // Content and names both count.
        std::fs::write(d.path().join("sub/b"), "x").expect("write");
        assert_ne!(task_checksum(d.path()).expect("checksum"), want);
    }
}
