//! The one way a task directory's files are read.
//!
//! Everything a task contributes — `task.toml`, `instruction.md`,
//! `tests/`, `solution/`, `environment/Dockerfile` and the files its
//! `COPY`/`ADD` name — is opened through [`open`], which walks from the
//! task directory one component at a time with `openat(O_NOFOLLOW)`:
//! a symlink anywhere on the way (the file itself, a parent directory, a
//! directory being copied, an entry inside one) is refused, as is anything
//! that is not a regular file or a directory (FIFOs, devices, sockets) and
//! any `..`. The file's bytes are read from the descriptor that was
//! checked, so swapping a path for a link after the check changes nothing.
//! A task run as root therefore never hands the agent (or the model
//! endpoint) a host file such as `/etc/shadow` through a link.

use std::ffi::{CString, OsStr};
use std::fs::File;
use std::io::Read;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Component, Path, PathBuf};

use crate::TaskError;

/// Most bytes one task file may have.
pub const MAX_FILE: u64 = 64 << 20;

/// What a task path is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// A regular file.
    File,
    /// A directory.
    Dir,
}

/// A task file or directory, opened beneath the task directory with no
/// symlink on the way.
#[derive(Debug)]
pub struct Entry {
    file: File,
    /// File or directory.
    pub kind: Kind,
    /// Permission bits.
    pub mode: u32,
    /// Size in bytes.
    pub size: u64,
    /// Path relative to the task directory (for messages).
    pub rel: PathBuf,
}

fn refused(task_dir: &Path, reason: String) -> TaskError {
    TaskError::InvalidTask {
        dir: task_dir.to_path_buf(),
        reason,
    }
}

fn stat_of(fd: &OwnedFd) -> std::io::Result<libc::stat> {
    // SAFETY: `stat` is plain integers, for which all-zero bytes is valid.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: fstat on a descriptor we own into a valid, writable struct.
    if unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(st)
}

/// Opens `name` in the directory `dir` without following a symlink; `None`
/// when it does not exist.
fn open_at(
    task_dir: &Path,
    dir: &OwnedFd,
    name: &OsStr,
    rel: &Path,
) -> Result<Option<Entry>, TaskError> {
    let io = |e: std::io::Error| TaskError::io("open task file", task_dir.join(rel), e);
    let c_name = CString::new(name.as_bytes())
        .map_err(|_| refused(task_dir, format!("{}: a NUL byte in a path", rel.display())))?;
    // Look first (no open of a device or FIFO), then open and check that
    // what was opened is what was looked at.
    // SAFETY: `stat` is plain integers, for which all-zero bytes is valid.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: fstatat on a valid directory descriptor, a NUL-terminated
    // name and a valid, writable struct.
    let r = unsafe {
        libc::fstatat(
            dir.as_raw_fd(),
            c_name.as_ptr(),
            &mut st,
            libc::AT_SYMLINK_NOFOLLOW,
        )
    };
    if r != 0 {
        let e = std::io::Error::last_os_error();
        return match e.kind() {
            std::io::ErrorKind::NotFound => Ok(None),
            _ => Err(io(e)),
        };
    }
    let kind = match st.st_mode & libc::S_IFMT {
        libc::S_IFREG => Kind::File,
        libc::S_IFDIR => Kind::Dir,
        libc::S_IFLNK => {
            return Err(refused(
                task_dir,
                format!(
                    "{} is a symlink; a task's files must be regular files and directories \
                     inside the task directory (symlinks are never followed)",
                    rel.display()
                ),
            ))
        }
        _ => {
            return Err(refused(
                task_dir,
                format!(
                    "{} is not a regular file or directory (a FIFO, socket or device)",
                    rel.display()
                ),
            ))
        }
    };
    let dir_flag = if kind == Kind::Dir {
        libc::O_DIRECTORY
    } else {
        0
    };
    // SAFETY: openat on a valid directory descriptor and C string.
    let fd = unsafe {
        libc::openat(
            dir.as_raw_fd(),
            c_name.as_ptr(),
            libc::O_RDONLY | libc::O_NOFOLLOW | libc::O_CLOEXEC | libc::O_NONBLOCK | dir_flag,
        )
    };
    if fd < 0 {
        let e = std::io::Error::last_os_error();
        if e.raw_os_error() == Some(libc::ELOOP) {
            return Err(refused(
                task_dir,
                format!("{} became a symlink while being opened", rel.display()),
            ));
        }
        return Err(io(e));
    }
    // SAFETY: a descriptor just returned by openat, owned from here on.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    let now = stat_of(&fd).map_err(io)?;
    if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino) {
        return Err(refused(
            task_dir,
            format!("{} changed while being opened", rel.display()),
        ));
    }
    Ok(Some(Entry {
        file: File::from(fd),
        kind,
        mode: now.st_mode & 0o7777,
        size: u64::try_from(now.st_size).unwrap_or(0),
        rel: rel.to_path_buf(),
    }))
}

/// Opens `rel` (relative, no `..`) beneath `task_dir`, refusing a symlink
/// in any component and anything but regular files and directories.
/// `Ok(None)` when it does not exist.
pub fn open(task_dir: &Path, rel: &Path) -> Result<Option<Entry>, TaskError> {
    let mut names = Vec::new();
    for c in rel.components() {
        match c {
            Component::Normal(n) => names.push(n),
            Component::CurDir => {}
            _ => {
                return Err(refused(
                    task_dir,
                    format!(
                        "{}: task paths are relative and stay inside the task directory",
                        rel.display()
                    ),
                ))
            }
        }
    }
    let root = File::open(task_dir)
        .map_err(|e| TaskError::io("open task dir", task_dir.to_path_buf(), e))?;
    let mut cur = Entry {
        kind: Kind::Dir,
        mode: 0,
        size: 0,
        rel: PathBuf::new(),
        file: root,
    };
    if !cur.file.metadata().is_ok_and(|m| m.is_dir()) {
        return Err(refused(task_dir, "the task path is not a directory".into()));
    }
    for name in names {
        let rel_now = cur.rel.join(name);
        if cur.kind != Kind::Dir {
            return Err(refused(
                task_dir,
                format!("{} is not a directory", cur.rel.display()),
            ));
        }
        let dir = OwnedFd::from(cur.file);
        match open_at(task_dir, &dir, name, &rel_now)? {
            Some(next) => cur = next,
            None => return Ok(None),
        }
    }
    Ok(Some(cur))
}

/// [`open`] of a file that must exist and be a regular file.
pub fn open_file(task_dir: &Path, rel: &Path) -> Result<Entry, TaskError> {
    match open(task_dir, rel)? {
        Some(e) if e.kind == Kind::File => Ok(e),
        Some(_) => Err(refused(
            task_dir,
            format!("{} is a directory, not a file", rel.display()),
        )),
        None => Err(refused(task_dir, format!("{} is missing", rel.display()))),
    }
}

/// The text of the task file `rel` (must exist, UTF-8, at most
/// [`MAX_FILE`] bytes).
pub fn read_to_string(task_dir: &Path, rel: &str) -> Result<String, TaskError> {
    let bytes = open_file(task_dir, Path::new(rel))?.read(task_dir)?;
    String::from_utf8(bytes).map_err(|_| refused(task_dir, format!("{rel} is not UTF-8")))
}

impl Entry {
    /// The file's bytes (at most [`MAX_FILE`]).
    pub fn read(mut self, task_dir: &Path) -> Result<Vec<u8>, TaskError> {
        if self.size > MAX_FILE {
            return Err(refused(
                task_dir,
                format!(
                    "{} is larger than {} MiB",
                    self.rel.display(),
                    MAX_FILE >> 20
                ),
            ));
        }
        let mut out = Vec::new();
        (&mut self.file)
            .take(MAX_FILE + 1)
            .read_to_end(&mut out)
            .map_err(|e| TaskError::io("read task file", task_dir.join(&self.rel), e))?;
        if out.len() as u64 > MAX_FILE {
            return Err(refused(
                task_dir,
                format!("{} grew past {} MiB", self.rel.display(), MAX_FILE >> 20),
            ));
        }
        Ok(out)
    }

    /// Whether any execute bit is set.
    pub fn is_executable(&self) -> bool {
        self.mode & 0o111 != 0
    }

    /// Calls `visit` with every regular file below this directory (its
    /// path relative to this directory, the opened entry), in name order;
    /// a symlink or special file anywhere below is refused like in
    /// [`open`]. One file is open at a time (plus one per directory level).
    pub fn for_each_file(
        self,
        task_dir: &Path,
        mut visit: impl FnMut(&Path, Entry) -> Result<(), TaskError>,
    ) -> Result<(), TaskError> {
        let base = self.rel.clone();
        walk(task_dir, self, &base, &mut visit)
    }
}

fn walk(
    task_dir: &Path,
    dir: Entry,
    base: &Path,
    visit: &mut dyn FnMut(&Path, Entry) -> Result<(), TaskError>,
) -> Result<(), TaskError> {
    let fd = OwnedFd::from(dir.file);
    // The names of exactly the directory that was checked (its descriptor),
    // whatever its path points at now.
    let listing = Path::new("/proc/self/fd").join(fd.as_raw_fd().to_string());
    let io = |e: std::io::Error| TaskError::io("read task dir", task_dir.join(&dir.rel), e);
    let mut names: Vec<_> = std::fs::read_dir(&listing)
        .map_err(io)?
        .map(|e| e.map(|e| e.file_name()))
        .collect::<Result<_, _>>()
        .map_err(io)?;
    names.sort();
    for name in names {
        let rel = dir.rel.join(&name);
        let Some(entry) = open_at(task_dir, &fd, &name, &rel)? else {
            continue; // removed meanwhile
        };
        match entry.kind {
            Kind::Dir => walk(task_dir, entry, base, visit)?,
            Kind::File => visit(rel.strip_prefix(base).unwrap_or(&rel), entry)?,
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::symlink;

    fn refused_msg(r: Result<Option<Entry>, TaskError>) -> String {
        match r {
            Err(e) => e.to_string(),
            Ok(e) => panic!("accepted: {e:?}"),
        }
    }

    #[test]
    fn files_open_beneath_the_task_and_symlinks_are_refused_anywhere() {
        let t = tempfile::tempdir().expect("tempdir");
        let d = t.path();
        std::fs::create_dir_all(d.join("tests/sub")).expect("mkdir");
        std::fs::write(d.join("tests/sub/a.txt"), "a").expect("write");
        std::fs::write(d.join("instruction.md"), "do it").expect("write");
        assert_eq!(read_to_string(d, "instruction.md").expect("read"), "do it");
        assert!(open(d, Path::new("missing.md")).expect("open").is_none());
        let mut names = Vec::new();
        open(d, Path::new("tests"))
            .expect("open")
            .expect("exists")
            .for_each_file(d, |p, e| {
                names.push((p.to_path_buf(), e.read(d)?));
                Ok(())
            })
            .expect("walk");
        assert_eq!(names, vec![(PathBuf::from("sub/a.txt"), b"a".to_vec())]);

        // The file itself, a parent directory, an entry in a walked one.
        symlink("/etc/passwd", d.join("link.md")).expect("symlink");
        assert!(refused_msg(open(d, Path::new("link.md"))).contains("symlink"));
        symlink(d.join("tests"), d.join("alias")).expect("symlink");
        assert!(refused_msg(open(d, Path::new("alias/sub/a.txt"))).contains("symlink"));
        symlink("/etc", d.join("tests/sub/etc")).expect("symlink");
        let e = open(d, Path::new("tests"))
            .expect("open")
            .expect("exists")
            .for_each_file(d, |_, _| Ok(()))
            .expect_err("walked through a symlink");
        assert!(e.to_string().contains("tests/sub/etc"), "{e}");
        // Climbing out, and special files.
        assert!(refused_msg(open(d, Path::new("../x"))).contains("inside the task"));
        let fifo = CString::new(d.join("pipe").as_os_str().as_bytes()).expect("c");
        // SAFETY: mkfifo on a valid C string.
        assert_eq!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o644) }, 0);
        assert!(refused_msg(open(d, Path::new("pipe"))).contains("FIFO"));
    }
}
