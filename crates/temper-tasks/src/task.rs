//! Harbor's task directory: `instruction.md`, `task.toml`, `environment/`,
//! `tests/test.sh`, optional `solution/solve.sh`.
//!
//! Field names and defaults follow Harbor's `TaskConfig` model (schema
//! version 1.x): `[verifier] timeout_sec = 600`, `[agent] timeout_sec`
//! (600 when absent), `[environment] cpus = 1, memory_mb = 2048,
//! storage_mb = 10240, allow_internet = true`, and `[task]`, `[metadata]`
//! and `[solution]`. Unknown keys are kept out of the way (ignored), as
//! Harbor's models ignore them.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::{files, TaskError};

/// `[task]`: package metadata (name in `org/name` form).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct PackageInfo {
    /// `org/name`.
    pub name: String,
    /// Free text.
    #[serde(default)]
    pub description: String,
}

/// `[verifier]`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct VerifierConfig {
    /// Most seconds `tests/test.sh` may run.
    #[serde(default = "default_timeout")]
    pub timeout_sec: f64,
    /// Extra environment for the verifier.
    #[serde(default)]
    pub env: BTreeMap<String, String>,
}

/// `[agent]`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AgentConfig {
    /// Most seconds the agent may work.
    #[serde(default = "default_timeout")]
    pub timeout_sec: f64,
}

/// `[solution]`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct SolutionConfig {
    /// Extra environment for `solution/solve.sh`.
    #[serde(default)]
    pub env: BTreeMap<String, String>,
}

/// `[environment]`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EnvironmentConfig {
    /// Docker build timeout (unused here: nothing is built).
    #[serde(default = "default_build_timeout")]
    pub build_timeout_sec: f64,
    /// A prebuilt image; the sandbox runtime cannot pull images.
    #[serde(default)]
    pub docker_image: Option<String>,
    /// CPUs (recorded; the sandbox does not pin CPUs).
    #[serde(default = "default_cpus")]
    pub cpus: u32,
    /// Memory limit of the trial's processes together.
    #[serde(default = "default_memory_mb")]
    pub memory_mb: u64,
    /// Disk: caps each writable directory's tmpfs.
    #[serde(default = "default_storage_mb")]
    pub storage_mb: u64,
    /// GPUs (the sandbox runtime has none to give: must be 0).
    #[serde(default)]
    pub gpus: u32,
    /// Whether the task may reach the internet.
    #[serde(default = "default_true")]
    pub allow_internet: bool,
    /// Environment variables for every command.
    #[serde(default)]
    pub env: BTreeMap<String, String>,
}

fn default_timeout() -> f64 {
    600.0
}
fn default_build_timeout() -> f64 {
    600.0
}
fn default_cpus() -> u32 {
    1
}
fn default_memory_mb() -> u64 {
    2048
}
fn default_storage_mb() -> u64 {
    10240
}
fn default_true() -> bool {
    true
}

impl Default for VerifierConfig {
    fn default() -> Self {
        VerifierConfig {
            timeout_sec: default_timeout(),
            env: BTreeMap::new(),
        }
    }
}

impl Default for AgentConfig {
    fn default() -> Self {
        AgentConfig {
            timeout_sec: default_timeout(),
        }
    }
}

impl Default for EnvironmentConfig {
    fn default() -> Self {
        EnvironmentConfig {
            build_timeout_sec: default_build_timeout(),
            docker_image: None,
            cpus: default_cpus(),
            memory_mb: default_memory_mb(),
            storage_mb: default_storage_mb(),
            gpus: 0,
            allow_internet: true,
            env: BTreeMap::new(),
        }
    }
}

/// `task.toml`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct TaskConfig {
    /// `schema_version` (older files say `version`).
    #[serde(default, alias = "version")]
    pub schema_version: Option<String>,
    /// `[task]`.
    #[serde(default)]
    pub task: Option<PackageInfo>,
    /// `[metadata]`: free-form.
    #[serde(default)]
    pub metadata: BTreeMap<String, toml::Value>,
    /// `[verifier]`.
    #[serde(default)]
    pub verifier: VerifierConfig,
    /// `[agent]`.
    #[serde(default)]
    pub agent: AgentConfig,
    /// `[environment]`.
    #[serde(default)]
    pub environment: EnvironmentConfig,
    /// `[solution]`.
    #[serde(default)]
    pub solution: SolutionConfig,
}

impl TaskConfig {
    /// Parses `task.toml` text.
    pub fn parse(text: &str) -> Result<Self, toml::de::Error> {
        toml::from_str(text)
    }
}

/// A loaded task directory.
#[derive(Debug, Clone)]
pub struct Task {
    /// The directory's name: the task's name in job and trial names.
    pub name: String,
    /// The directory (absolute).
    pub dir: PathBuf,
    /// `task.toml`.
    pub config: TaskConfig,
    /// `instruction.md`.
    pub instruction: String,
}

/// Task names become directory names: keep them to a safe alphabet.
fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 128
        && !name.starts_with('.')
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
}

impl Task {
    /// Loads the task at `dir`: `task.toml`, `instruction.md` and
    /// `tests/test.sh` must exist.
    pub fn load(dir: &Path) -> Result<Self, TaskError> {
        let dir = std::fs::canonicalize(dir)
            .map_err(|e| TaskError::io("open task dir", dir.to_path_buf(), e))?;
        let invalid = |reason: String| TaskError::InvalidTask {
            dir: dir.clone(),
            reason,
        };
        let name = dir
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        if !valid_name(&name) {
            return Err(invalid(format!(
                "directory name {name:?} is not a task name ([A-Za-z0-9._-], not starting with '.')"
            )));
        }
        // Every file through `files`: a symlink (say instruction.md ->
        // /etc/shadow) is refused, never followed.
        let toml_text = files::read_to_string(&dir, "task.toml")?;
        let config = TaskConfig::parse(&toml_text).map_err(|source| TaskError::Config {
            dir: dir.clone(),
            source,
        })?;
        let instruction = files::read_to_string(&dir, "instruction.md")?;
        files::open_file(&dir, Path::new("tests/test.sh"))?;
        for (what, t) in [
            ("[agent] timeout_sec", config.agent.timeout_sec),
            ("[verifier] timeout_sec", config.verifier.timeout_sec),
        ] {
            if !(t.is_finite() && t > 0.0) {
                return Err(invalid(format!("{what} must be > 0, not {t}")));
            }
        }
        if config.environment.memory_mb == 0 {
            return Err(invalid("[environment] memory_mb must be > 0".into()));
        }
        Ok(Task {
            name,
            dir,
            config,
            instruction,
        })
    }

    /// Whether the task ships `solution/solve.sh` (a regular file; a
    /// symlink there or in its path is an error).
    pub fn has_solution(&self) -> Result<bool, TaskError> {
        Ok(files::open(&self.dir, Path::new("solution/solve.sh"))?
            .is_some_and(|e| e.kind == files::Kind::File))
    }
}

/// True when `dir` looks like a task (has `task.toml`).
pub fn is_task_dir(dir: &Path) -> bool {
    dir.join("task.toml").is_file()
}

/// Expands `paths` (task directories, or directories of task directories)
/// into tasks, sorted by name within each path; a name seen twice is an
/// error (trial directories are named after tasks).
pub fn discover(paths: &[PathBuf]) -> Result<Vec<Task>, TaskError> {
    let mut tasks = Vec::new();
    for path in paths {
        if is_task_dir(path) {
            tasks.push(Task::load(path)?);
            continue;
        }
        let entries =
            std::fs::read_dir(path).map_err(|e| TaskError::io("read tasks dir", path, e))?;
        let mut dirs: Vec<PathBuf> = entries
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| is_task_dir(p))
            .collect();
        if dirs.is_empty() {
            return Err(TaskError::Invalid(format!(
                "{}: neither a task (no task.toml) nor a directory of tasks",
                path.display()
            )));
        }
        dirs.sort();
        for dir in dirs {
            tasks.push(Task::load(&dir)?);
        }
    }
    let mut seen = std::collections::BTreeSet::new();
    for t in &tasks {
        if !seen.insert(t.name.clone()) {
            return Err(TaskError::Invalid(format!(
                "two tasks are named {:?}; task names must be unique in a job",
                t.name
            )));
        }
    }
    Ok(tasks)
}
