//! [`Loader`]: the one way to open an environment from a spec string. Each
//! kind of environment is an [`EnvKind`] that recognises its specs; a
//! loader tries its kinds in order. temper-env's own kinds are built in;
//! crates above it (Harbor tasks in `temper-tasks`, and kinds to come) add
//! theirs with [`Loader::with`], so every caller opens every kind the
//! program registered, through the same call.

use std::fmt;
use std::path::Path;
use std::sync::Arc;

use serde_json::Value;

use crate::{envs, external, manifest, EnvError, Environment};

/// One kind of environment a [`Loader`] can open.
pub trait EnvKind: Send + Sync {
    /// What the kind is called in messages (`built-in`, `env.toml`, ...).
    fn name(&self) -> &'static str;

    /// `None` when `spec` is not of this kind; otherwise the environment
    /// loaded with `args` (a JSON object; `null` for defaults), or why it
    /// could not be.
    fn load(&self, spec: &str, args: &Value) -> Option<Result<Arc<dyn Environment>, EnvError>>;
}

/// The kinds of environment a program can load, tried in order: built-in
/// names, `env.toml` directories or files, `verifiers:` environments, the
/// kinds added with [`Loader::with`] (in the order added), and last an
/// external command (any spec with whitespace, or an existing file), which
/// would otherwise claim specs meant for an added kind.
#[derive(Clone)]
pub struct Loader {
    kinds: Vec<Arc<dyn EnvKind>>,
    fallback: Arc<dyn EnvKind>,
}

impl Default for Loader {
    fn default() -> Self {
        Self::new()
    }
}

impl fmt::Debug for Loader {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list()
            .entries(self.kinds.iter().chain([&self.fallback]).map(|k| k.name()))
            .finish()
    }
}

impl Loader {
    /// temper-env's own kinds.
    pub fn new() -> Self {
        Self {
            kinds: vec![Arc::new(Builtin), Arc::new(Manifest), Arc::new(Verifiers)],
            fallback: Arc::new(Command),
        }
    }

    /// This loader with `kind` added (tried after the kinds before it, and
    /// before the external-command fallback).
    pub fn with(mut self, kind: impl EnvKind + 'static) -> Self {
        self.kinds.push(Arc::new(kind));
        self
    }

    /// Load `spec` with `args` (a JSON object; `null` for defaults) as the
    /// first kind that recognises it.
    pub fn load(&self, spec: &str, args: &Value) -> Result<Arc<dyn Environment>, EnvError> {
        self.kinds
            .iter()
            .chain([&self.fallback])
            .find_map(|k| k.load(spec, args))
            .unwrap_or_else(|| Err(EnvError::Unknown(spec.to_string())))
    }

    /// The kinds' names, in the order they are tried.
    pub fn kinds(&self) -> Vec<&'static str> {
        self.kinds
            .iter()
            .chain([&self.fallback])
            .map(|k| k.name())
            .collect()
    }
}

/// A built-in name ([`crate::BUILTIN_ENVS`]).
struct Builtin;

impl EnvKind for Builtin {
    fn name(&self) -> &'static str {
        "built-in"
    }
    fn load(&self, spec: &str, args: &Value) -> Option<Result<Arc<dyn Environment>, EnvError>> {
        envs::builtin(spec, args).map(|env| Ok(Arc::new(env?) as Arc<dyn Environment>))
    }
}

/// A directory with `env.toml`, or a `.toml` file ([`manifest`]).
struct Manifest;

impl EnvKind for Manifest {
    fn name(&self) -> &'static str {
        "env.toml"
    }
    fn load(&self, spec: &str, args: &Value) -> Option<Result<Arc<dyn Environment>, EnvError>> {
        let path = Path::new(spec);
        let is_manifest = path.is_dir() && path.join("env.toml").is_file()
            || path.is_file() && path.extension().is_some_and(|e| e == "toml");
        is_manifest.then(|| manifest::load_manifest(path, args))
    }
}

/// `verifiers:MODULE_OR_PATH` ([`external::ExternalEnv::verifiers`]).
struct Verifiers;

impl EnvKind for Verifiers {
    fn name(&self) -> &'static str {
        "verifiers"
    }
    fn load(&self, spec: &str, args: &Value) -> Option<Result<Arc<dyn Environment>, EnvError>> {
        let target = spec.strip_prefix("verifiers:")?;
        Some(external::ExternalEnv::verifiers(target, args).map(|e| Arc::new(e) as _))
    }
}

/// An external command speaking the JSON-lines protocol (`python3
/// my_env.py`, or an executable file): [`external::ExternalEnv::spawn`].
struct Command;

impl EnvKind for Command {
    fn name(&self) -> &'static str {
        "external command"
    }
    fn load(&self, spec: &str, args: &Value) -> Option<Result<Arc<dyn Environment>, EnvError>> {
        let is_command = spec.contains(char::is_whitespace) || Path::new(spec).is_file();
        is_command.then(|| external::ExternalEnv::spawn(spec, None, args).map(|e| Arc::new(e) as _))
    }
}
