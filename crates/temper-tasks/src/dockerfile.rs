//! What the sandbox runtime makes of `environment/Dockerfile`.
//!
//! There is no image build: a trial runs on the host's own read-only
//! system directories (`/usr`, `/etc`, `/bin`, `/lib*`) with writable
//! tmpfs directories on top. From the Dockerfile we honour:
//!
//! - `WORKDIR` — the commands' working directory (created writable);
//! - `ENV` — environment of every command;
//! - `COPY` / `ADD` of local files from the build context (`environment/`)
//!   to a path outside the system directories (its top-level directory
//!   becomes a writable tmpfs, e.g. `/app`);
//! - `RUN` — run once in the trial's sandbox before the agent starts, as
//!   the sandbox user and without network (so `mkdir`, `echo`, `python3 -c`
//!   work; `apt-get install` and `pip install` fail the trial's setup).
//!
//! `FROM`, `USER`, `CMD`, `ENTRYPOINT`, `EXPOSE`, `LABEL`, `ARG`,
//! `VOLUME`, `HEALTHCHECK`, `SHELL`, `STOPSIGNAL` are ignored and listed in
//! the trial's notes. A `COPY` into a system directory, `ADD` of a URL,
//! wildcards, `COPY --from` and heredocs are refused with
//! [`TaskError::Unsupported`]: such tasks need a container runtime.

use std::collections::BTreeSet;
use std::path::{Component, Path, PathBuf};

use crate::{files, TaskError};

/// Directories the host provides read-only; nothing can be copied there.
const SYSTEM: &[&str] = &[
    "/usr", "/etc", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/proc", "/dev",
];

/// The working directory when the Dockerfile sets none (Terminal-Bench
/// and Harbor tasks conventionally use `/app`).
pub const DEFAULT_WORKDIR: &str = "/app";

/// One setup step, in Dockerfile order.
#[derive(Debug, Clone, PartialEq)]
pub enum SetupStep {
    /// Copy the task's `src` (a file or a directory, inside `environment/`)
    /// to `dest` (absolute; a trailing `/` or a directory source means
    /// "into").
    Copy {
        /// Path relative to the task directory (`environment/...`).
        src: PathBuf,
        /// Absolute path in the sandbox.
        dest: String,
    },
    /// Run `command` with bash in `cwd`.
    Run {
        /// The shell command.
        command: String,
        /// Absolute working directory.
        cwd: String,
    },
}

/// The environment a task's Dockerfile describes, as the sandbox runs it.
#[derive(Debug, Clone, PartialEq)]
pub struct EnvPlan {
    /// Final `WORKDIR` (absolute).
    pub workdir: String,
    /// `ENV` in order.
    pub env: Vec<(String, String)>,
    /// `COPY`, `ADD` and `RUN`, in order.
    pub steps: Vec<SetupStep>,
    /// Top-level directories that must be writable (`/app`, ...).
    pub writable: BTreeSet<PathBuf>,
    /// Instructions ignored, for the trial's record.
    pub ignored: Vec<String>,
}

impl EnvPlan {
    /// The plan of a task without a Dockerfile.
    pub fn empty() -> Self {
        let mut writable = BTreeSet::new();
        writable.insert(PathBuf::from(DEFAULT_WORKDIR));
        EnvPlan {
            workdir: DEFAULT_WORKDIR.into(),
            env: Vec::new(),
            steps: Vec::new(),
            writable,
            ignored: Vec::new(),
        }
    }
}

/// `a/./b/../c` → `/a/c` against `base`; `None` if it climbs above `/`.
fn absolute(base: &str, p: &str) -> Option<String> {
    let joined = if p.starts_with('/') {
        PathBuf::from(p)
    } else {
        Path::new(base).join(p)
    };
    let mut parts: Vec<String> = Vec::new();
    for c in joined.components() {
        match c {
            Component::RootDir | Component::CurDir => {}
            Component::ParentDir => {
                parts.pop()?;
            }
            Component::Normal(n) => parts.push(n.to_string_lossy().into_owned()),
            Component::Prefix(_) => return None,
        }
    }
    Some(format!("/{}", parts.join("/")))
}

/// The top-level directory a path lives in, after checking it is one the
/// sandbox can make writable. `/tmp` and `/work` are writable already.
fn writable_root(dir: &Path, path: &str) -> Result<Option<PathBuf>, TaskError> {
    let p = Path::new(path);
    if let Some(sys) = SYSTEM.iter().find(|s| p.starts_with(s)) {
        return Err(TaskError::Unsupported {
            dir: dir.to_path_buf(),
            reason: format!(
                "{path} lies under {sys}, which the sandbox runtime shares read-only with the \
                 host; this task needs a container runtime"
            ),
        });
    }
    let top = p.components().nth(1).map(|c| Path::new("/").join(c));
    Ok(top.filter(|t| t != Path::new("/tmp") && t != Path::new("/work")))
}

/// Splits the Dockerfile into logical instructions (continuations joined,
/// comments and blank lines dropped).
fn instructions(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut cur = String::new();
    for line in text.lines() {
        let trimmed = line.trim();
        if cur.is_empty() && (trimmed.is_empty() || trimmed.starts_with('#')) {
            continue;
        }
        if !cur.is_empty() && trimmed.starts_with('#') {
            continue;
        }
        if let Some(body) = trimmed.strip_suffix('\\') {
            cur.push_str(body);
            cur.push(' ');
        } else {
            cur.push_str(trimmed);
            out.push(std::mem::take(&mut cur));
        }
    }
    if !cur.trim().is_empty() {
        out.push(cur);
    }
    out
}

/// `["a", "b"]` (exec form) or whitespace-separated words, where `"..."`
/// and `'...'` group (quotes removed) and `\` escapes the next character.
fn words(args: &str) -> Vec<String> {
    if args.trim_start().starts_with('[') {
        if let Ok(v) = serde_json::from_str::<Vec<String>>(args.trim()) {
            return v;
        }
    }
    let mut out = Vec::new();
    let mut cur = String::new();
    let mut in_word = false;
    let mut quote: Option<char> = None;
    let mut chars = args.chars();
    while let Some(c) = chars.next() {
        match (quote, c) {
            (Some(q), c) if c == q => quote = None,
            (Some('"') | None, '\\') => {
                if let Some(n) = chars.next() {
                    cur.push(n);
                }
                in_word = true;
            }
            (Some(_), c) => cur.push(c),
            (None, '"' | '\'') => {
                quote = Some(c);
                in_word = true;
            }
            (None, c) if c.is_whitespace() => {
                if in_word {
                    out.push(std::mem::take(&mut cur));
                    in_word = false;
                }
            }
            (None, c) => {
                cur.push(c);
                in_word = true;
            }
        }
    }
    if in_word {
        out.push(cur);
    }
    out
}

/// The build context, relative to the task directory.
const CONTEXT: &str = "environment";

/// `src` of a `COPY` as a path relative to the task directory, inside the
/// build context (a leading `/` is the context's root, as in Docker);
/// `None` when `..` climbs out of it.
fn in_context(src: &str) -> Option<PathBuf> {
    let mut parts: Vec<&std::ffi::OsStr> = Vec::new();
    for c in Path::new(src).components() {
        match c {
            Component::Normal(n) => parts.push(n),
            Component::RootDir | Component::CurDir => {}
            Component::ParentDir => {
                parts.pop()?;
            }
            Component::Prefix(_) => return None,
        }
    }
    let mut rel = PathBuf::from(CONTEXT);
    rel.extend(parts);
    Some(rel)
}

/// `'...'` for bash.
pub(crate) fn shell_quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}

/// Parses `environment/Dockerfile` of the task at `task_dir` (context =
/// `environment/`).
pub fn plan(task_dir: &Path) -> Result<EnvPlan, TaskError> {
    let mut plan = EnvPlan::empty();
    if files::open(task_dir, Path::new(CONTEXT))?.is_none() {
        return Ok(plan);
    }
    let Some(dockerfile) = files::open(task_dir, &Path::new(CONTEXT).join("Dockerfile"))? else {
        return Ok(plan);
    };
    let text =
        String::from_utf8(dockerfile.read(task_dir)?).map_err(|_| TaskError::InvalidTask {
            dir: task_dir.to_path_buf(),
            reason: "environment/Dockerfile is not UTF-8".into(),
        })?;
    let unsupported = |reason: String| TaskError::Unsupported {
        dir: task_dir.to_path_buf(),
        reason,
    };
    plan.writable.clear();
    let mut workdir = "/".to_string();
    let mut set_workdir = false;
    for inst in instructions(&text) {
        let (op, args) = inst.split_once(char::is_whitespace).unwrap_or((&inst, ""));
        let args = args.trim();
        match op.to_ascii_uppercase().as_str() {
            "WORKDIR" => {
                workdir = absolute(&workdir, args)
                    .ok_or_else(|| unsupported(format!("WORKDIR {args} climbs above /")))?;
                set_workdir = true;
                if let Some(top) = writable_root(task_dir, &workdir)? {
                    plan.writable.insert(top);
                }
            }
            "ENV" => {
                if args.contains('=') {
                    for w in words(args) {
                        let (k, v) = w
                            .split_once('=')
                            .ok_or_else(|| unsupported(format!("ENV {args}: mixed forms")))?;
                        plan.env.push((k.into(), v.into()));
                    }
                } else if let Some((k, v)) = args.split_once(char::is_whitespace) {
                    plan.env.push((k.into(), v.trim().into()));
                }
            }
            "COPY" | "ADD" => {
                if args.contains("<<") {
                    return Err(unsupported(format!("{op} heredocs are not supported")));
                }
                let mut ws = words(args);
                if ws.iter().any(|w| w.starts_with("--from")) {
                    return Err(unsupported(format!(
                        "{op} --from needs a container runtime (multi-stage build)"
                    )));
                }
                ws.retain(|w| !w.starts_with("--"));
                let Some(dest) = ws.pop().filter(|_| !ws.is_empty()) else {
                    return Err(unsupported(format!(
                        "{op} {args}: needs a source and a dest"
                    )));
                };
                let into = dest.ends_with('/') || ws.len() > 1;
                let dest_abs = absolute(&workdir, &dest)
                    .ok_or_else(|| unsupported(format!("{op} dest {dest} climbs above /")))?;
                if let Some(top) = writable_root(task_dir, &dest_abs)? {
                    plan.writable.insert(top);
                }
                for src in ws {
                    if src.contains("://") || src.contains(['*', '?', '[']) {
                        return Err(unsupported(format!(
                            "{op} {src}: URLs and wildcards are not supported"
                        )));
                    }
                    let rel = in_context(&src).ok_or_else(|| {
                        unsupported(format!("{op} {src} lies outside the build context"))
                    })?;
                    // Checked (no symlinks) here and read through `files`
                    // again when copied.
                    if files::open(task_dir, &rel)?.is_none() {
                        return Err(unsupported(format!(
                            "{op} {src}: no such file in the build context"
                        )));
                    }
                    let dest = if into && !dest_abs.ends_with('/') {
                        format!("{dest_abs}/")
                    } else {
                        dest_abs.clone()
                    };
                    plan.steps.push(SetupStep::Copy { src: rel, dest });
                }
            }
            "RUN" => {
                let command = if args.trim_start().starts_with('[') {
                    words(args)
                        .iter()
                        .map(|w| shell_quote(w))
                        .collect::<Vec<_>>()
                        .join(" ")
                } else {
                    args.to_string()
                };
                if command.contains("<<") {
                    return Err(unsupported("RUN heredocs are not supported".into()));
                }
                plan.steps.push(SetupStep::Run {
                    command,
                    cwd: workdir.clone(),
                });
            }
            other => plan.ignored.push(format!(
                "{other} {}",
                args.chars().take(80).collect::<String>()
            )),
        }
    }
    if !set_workdir {
        workdir = DEFAULT_WORKDIR.into();
        plan.writable.insert(PathBuf::from(DEFAULT_WORKDIR));
    }
    plan.workdir = workdir;
    Ok(plan)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn task_with(dockerfile: &str, files: &[&str]) -> tempfile::TempDir {
        let t = tempfile::tempdir().expect("tempdir");
        std::fs::create_dir_all(t.path().join("environment/sub")).expect("mkdir");
        std::fs::write(t.path().join("environment/Dockerfile"), dockerfile).expect("write");
        for f in files {
            std::fs::write(t.path().join("environment").join(f), "x").expect("write");
        }
        t
    }

    #[test]
    fn honoured_instructions_become_steps() {
        let t = task_with(
            "FROM python:3.12\n# comment\nWORKDIR /app\nENV A=1 B=\"two words\"\nENV C three\n\
             COPY data.csv ./\nCOPY sub /app/lib\nRUN mkdir -p out \\\n  && echo hi > out/x\n\
             CMD [\"bash\"]\n",
            &["data.csv"],
        );
        let p = plan(t.path()).expect("plan");
        assert_eq!(p.workdir, "/app");
        assert_eq!(
            p.env,
            vec![
                ("A".into(), "1".into()),
                ("B".into(), "two words".into()),
                ("C".into(), "three".into())
            ]
        );
        assert_eq!(p.steps.len(), 3);
        assert!(matches!(&p.steps[0], SetupStep::Copy { dest, .. } if dest == "/app/"));
        assert!(matches!(&p.steps[1], SetupStep::Copy { dest, .. } if dest == "/app/lib"));
        assert!(
            matches!(&p.steps[2], SetupStep::Run { command, cwd } if command.contains("echo hi") && cwd == "/app")
        );
        assert_eq!(
            p.writable.iter().collect::<Vec<_>>(),
            vec![Path::new("/app")]
        );
        assert_eq!(p.ignored.len(), 2, "FROM and CMD: {:?}", p.ignored);
    }

    #[test]
    fn what_needs_a_container_runtime_is_refused() {
        for bad in [
            "COPY x.sh /usr/local/bin/\n",
            "COPY --from=build /a /app\n",
            "ADD https://example.com/x /app/\n",
            "COPY *.py /app/\n",
            "COPY ../../etc/passwd /app/\n",
            "WORKDIR /etc/app\n",
        ] {
            let t = task_with(bad, &["x.sh"]);
            assert!(
                matches!(plan(t.path()), Err(TaskError::Unsupported { .. })),
                "{bad:?} accepted"
            );
        }
    }

    #[test]
    fn no_workdir_means_app() {
        let t = task_with("FROM ubuntu\nRUN true\n", &[]);
        let p = plan(t.path()).expect("plan");
        assert_eq!(p.workdir, "/app");
        assert!(p.writable.contains(Path::new("/app")));
        assert!(matches!(&p.steps[0], SetupStep::Run { cwd, .. } if cwd == "/"));
    }
}
