//! The `mutation_score` and `coverage` rubrics: the model writes tests, the
//! sandbox runs them against the row's code under test (`info.code`) and
//! against broken versions of it (mutants).
//!
//! One sandbox run per rollout executes `suite.py` (embedded here), which
//! generates the mutants with Python's `ast` module, drops those that give
//! the same results as the original on the row's sample inputs
//! (`info.samples`, likely-equivalent mutants no test could kill), and runs
//! the tests against each variant in a forked child with its own time
//! limit and its output discarded. The result comes back as a file, not on
//! stdout, so nothing the tested code prints can corrupt it. The mutants a
//! row gets are cached here after the first rollout, so the rest of the run
//! skips generating and filtering them.

use std::collections::{BTreeMap, HashMap};
use std::hash::{Hash, Hasher};
use std::sync::{Arc, Mutex, PoisonError};

use base64::Engine as _;
use serde::Deserialize;
use serde_json::Value;

use super::code_tests::extract_code;
use super::context::RewardCtx;

const DRIVER: &str = include_str!("suite.py");
const RESULT: &str = "suite_result.json";
/// The sandbox service's longest run.
const MAX_RUN_S: f64 = temper_sandbox::service::MAX_RUN_TIMEOUT_S;

/// `mutation_score` and `coverage` arguments.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SuiteConfig {
    /// Sandbox service URL (default `$TEMPER_SANDBOX_URL`, else
    /// `http://127.0.0.1:8080`).
    #[serde(default)]
    pub sandbox_url: Option<String>,
    /// Seconds each run of the tests (on the original, on one mutant) may
    /// take; a run over it fails (on a mutant: the mutant is killed).
    #[serde(default = "default_timeout")]
    pub timeout_s: f64,
    /// Most generated mutants per row (`mutation_score`).
    #[serde(default = "default_max_mutants")]
    pub max_mutants: usize,
    /// The module name the code under test is importable as
    /// (`from solution import f`); its names are also visible to the tests
    /// directly.
    #[serde(default = "default_module")]
    pub module: String,
    /// `assert`: the tests run as a script, then every `test*` function
    /// they define is called. `pytest`: pytest runs them (the environment
    /// must declare `pytest` in `[sandbox] requirements`).
    #[serde(default = "default_runner")]
    pub runner: String,
    /// `coverage`: `line` or `branch` (branch needs Python ≥ 3.12 in the
    /// sandbox, for `sys.monitoring`).
    #[serde(default)]
    pub metric: Option<String>,
    /// `coverage`: multiply by whether the tests pass on the original
    /// (default true), so failing tests earn nothing for what they ran.
    #[serde(default = "yes")]
    pub require_pass: bool,
}

fn default_timeout() -> f64 {
    5.0
}
fn default_max_mutants() -> usize {
    8
}
fn default_module() -> String {
    "solution".into()
}
fn default_runner() -> String {
    "assert".into()
}
fn yes() -> bool {
    true
}

/// What a [`Suite`] scores.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SuiteMode {
    /// Passes on the original × fraction of mutants killed.
    Mutation,
    /// Line coverage of the code under test.
    Line,
    /// Branch coverage of the code under test.
    Branch,
}

/// Runs a model's tests against a row's code (and its mutants) in the
/// sandbox service.
pub struct Suite {
    sandbox: crate::SandboxService,
    cfg: SuiteConfig,
    mode: SuiteMode,
    requirements: Vec<String>,
    /// Per row (hash of code, samples, cap): the kept mutants and how many
    /// were dropped as equivalent.
    mutants: Mutex<HashMap<u64, Arc<RowMutants>>>,
}

/// A row's kept mutants and how many were dropped as equivalent.
type RowMutants = (Vec<String>, f64);

/// One rollout's score and the metrics behind it.
pub type Scored = (f64, BTreeMap<String, f64>);

impl Suite {
    /// A `mutation_score` (`coverage = false`) or `coverage` rubric from its
    /// arguments.
    pub fn new(cfg: SuiteConfig, coverage: bool) -> Result<Self, String> {
        let what = if coverage {
            "coverage"
        } else {
            "mutation_score"
        };
        let mode = match (coverage, cfg.metric.as_deref()) {
            (false, None) => SuiteMode::Mutation,
            (false, Some(_)) => {
                return Err("mutation_score: `metric` is a coverage argument".into())
            }
            (true, None | Some("line")) => SuiteMode::Line,
            (true, Some("branch")) => SuiteMode::Branch,
            (true, Some(other)) => {
                return Err(format!("coverage: metric `{other}` (use line or branch)"))
            }
        };
        if !matches!(cfg.runner.as_str(), "assert" | "pytest") {
            return Err(format!(
                "{what}: runner `{}` (use assert or pytest)",
                cfg.runner
            ));
        }
        if !(cfg.timeout_s > 0.0 && cfg.timeout_s <= MAX_RUN_S) {
            return Err(format!("{what}: timeout_s must be in (0, {MAX_RUN_S}]"));
        }
        let valid_module = !cfg.module.is_empty()
            && !cfg.module.starts_with(|c: char| c.is_ascii_digit())
            && cfg
                .module
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_');
        if !valid_module {
            return Err(format!(
                "{what}: module `{}` is not a Python identifier",
                cfg.module
            ));
        }
        if cfg.max_mutants == 0 && !coverage {
            return Err("mutation_score: max_mutants must be at least 1".into());
        }
        // The service's URL and API key from the environment, as every
        // sandboxed reward gets them.
        let sandbox = crate::SandboxService::new(cfg.sandbox_url.clone())?;
        Ok(Suite {
            sandbox,
            cfg,
            mode,
            requirements: Vec::new(),
            mutants: Mutex::new(HashMap::new()),
        })
    }

    /// Run with these Python packages (`[sandbox] requirements`).
    pub fn set_requirements(&mut self, requirements: Vec<String>) {
        self.requirements = requirements;
    }

    /// The sandbox service it runs on.
    pub fn sandbox(&self) -> &crate::SandboxService {
        &self.sandbox
    }

    /// The rollout's score and metrics, or why it has none (no `info.code`,
    /// the sandbox down): the rubric counts that as a reward error.
    pub async fn score(&self, c: &RewardCtx<'_>) -> Result<Scored, String> {
        let tests = extract_code(&crate::last_assistant_text(c.completion));
        self.run(c.info, &tests).await
    }

    pub(crate) fn name(&self) -> &'static str {
        match self.mode {
            SuiteMode::Mutation => "mutation_score",
            SuiteMode::Line | SuiteMode::Branch => "coverage",
        }
    }

    /// Score `tests` against the row `info` (`code`, `samples`, `mutants`).
    pub async fn run(&self, info: &Value, tests: &str) -> Result<Scored, String> {
        let code = info
            .get("code")
            .and_then(Value::as_str)
            .ok_or("the row has no `info.code` (the code under test)")?;
        let strings = |key: &str| -> Result<Option<Vec<String>>, String> {
            match info.get(key) {
                None | Some(Value::Null) => Ok(None),
                Some(Value::Array(a)) => a
                    .iter()
                    .map(|v| {
                        v.as_str()
                            .map(str::to_string)
                            .ok_or_else(|| format!("info.{key} must be a list of strings"))
                    })
                    .collect::<Result<Vec<_>, _>>()
                    .map(Some),
                Some(_) => Err(format!("info.{key} must be a list of strings")),
            }
        };
        let samples = strings("samples")?.unwrap_or_default();
        let key = {
            let mut h = std::collections::hash_map::DefaultHasher::new();
            (code, &samples, self.cfg.max_mutants, &self.cfg.module).hash(&mut h);
            h.finish()
        };
        let cached = self
            .mutants
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(&key)
            .cloned();
        let given = strings("mutants")?;
        let generated = given.is_none();
        let (mutants, equivalent) = match (given, &cached) {
            (Some(g), _) => (Some(g), None),
            (None, Some(c)) => (Some(c.0.clone()), Some(c.1)),
            (None, None) => (None, None),
        };
        let mut mut_metrics = BTreeMap::new();
        if tests.trim().is_empty() {
            // No tests: nothing passes, nothing is measured.
            mut_metrics.insert("pass_original".to_string(), 0.0);
            return Ok((0.0, mut_metrics));
        }
        let mode = match self.mode {
            SuiteMode::Mutation => "mutation",
            _ => "coverage",
        };
        let variants = 2 * self
            .cfg
            .max_mutants
            .max(mutants.as_ref().map_or(0, Vec::len))
            + 3;
        let run_timeout = (self.cfg.timeout_s * variants as f64 + 5.0).min(MAX_RUN_S);
        let input = serde_json::json!({
            "mode": mode,
            "code": code,
            "tests": tests,
            "module": self.cfg.module,
            "samples": samples,
            "mutants": mutants,
            "max_mutants": self.cfg.max_mutants,
            "timeout": self.cfg.timeout_s,
            "runner": self.cfg.runner,
        });
        let req = temper_sandbox::service::RunCodeRequest {
            code: DRIVER.to_string(),
            language: "python".into(),
            stdin: input.to_string(),
            run_timeout: Some(run_timeout),
            fetch_files: vec![RESULT.to_string()],
            requirements: self.requirements.clone(),
            ..Default::default()
        };
        let resp = self
            .sandbox
            .client()
            .run_code(&req)
            .await
            .map_err(|e| format!("sandbox: {e}"))?;
        let stderr = resp.run_result.as_ref().map_or("", |r| r.stderr.as_str());
        let file = resp.files.get(RESULT).ok_or_else(|| {
            format!(
                "sandbox run {} {}: no result; stderr: {}",
                resp.status,
                resp.message,
                stderr.chars().take(400).collect::<String>()
            )
        })?;
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(file)
            .map_err(|e| format!("result file: {e}"))?;
        let out: Value = serde_json::from_slice(&bytes).map_err(|e| format!("result file: {e}"))?;
        if let Some(e) = out.get("error").and_then(Value::as_str) {
            return Err(e.to_string());
        }
        let num = |k: &str| -> Result<f64, String> {
            out.get(k)
                .and_then(|v| v.as_f64().or_else(|| v.as_bool().map(f64::from)))
                .ok_or_else(|| format!("result has no `{k}`: {out}"))
        };
        let pass = num("pass_original")?;
        let mut metrics = BTreeMap::from([("pass_original".to_string(), pass)]);
        let score = match self.mode {
            SuiteMode::Mutation => {
                let (killed, total) = (num("killed")?, num("mutants")?);
                metrics.insert("killed".into(), killed);
                metrics.insert("mutants".into(), total);
                if generated {
                    let eq = match equivalent {
                        Some(eq) => eq,
                        None => {
                            let eq = num("equivalent")?;
                            let sources: Vec<String> = out
                                .get("mutant_sources")
                                .and_then(Value::as_array)
                                .map(|a| {
                                    a.iter()
                                        .filter_map(|s| s.as_str().map(str::to_string))
                                        .collect()
                                })
                                .unwrap_or_default();
                            self.mutants
                                .lock()
                                .unwrap_or_else(PoisonError::into_inner)
                                .entry(key)
                                .or_insert_with(|| Arc::new((sources, eq)));
                            eq
                        }
                    };
                    metrics.insert("equivalent".into(), eq);
                }
                if total > 0.0 {
                    pass * killed / total
                } else {
                    pass
                }
            }
            SuiteMode::Line | SuiteMode::Branch => {
                let line = num("line")?;
                metrics.insert("line".into(), line);
                let branch = out.get("branch").and_then(Value::as_f64);
                if let Some(b) = branch {
                    metrics.insert("branch".into(), b);
                }
                let cov = if self.mode == SuiteMode::Branch {
                    branch.ok_or(
                        "branch coverage needs Python >= 3.12 (sys.monitoring) in the sandbox",
                    )?
                } else {
                    line
                };
                if self.cfg.require_pass {
                    pass * cov
                } else {
                    cov
                }
            }
        };
        Ok((score, metrics))
    }
}
