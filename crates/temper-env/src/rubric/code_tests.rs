//! The `code_tests` reward: the completion's code against the row's unit
//! tests in the sandbox service.

use std::time::Duration;

use serde::Deserialize;
use serde_json::Value;

use super::context::RewardCtx;

/// `code_tests` arguments.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CodeTestsConfig {
    /// Sandbox service URL (default `$TEMPER_SANDBOX_URL`, else
    /// `http://127.0.0.1:8080`).
    #[serde(default)]
    pub sandbox_url: Option<String>,
    /// Seconds per test.
    #[serde(default = "default_test_timeout")]
    pub timeout_s: f64,
}

fn default_test_timeout() -> f64 {
    10.0
}

/// Runs the completion's Python code against the row's tests in the
/// sandbox service (`POST /run_code`): the score is the fraction of tests
/// that pass. Tests come from `info.tests`, a list of Python snippets
/// (usually `assert` lines) appended to the code one at a time. An optional
/// `info.prefix` goes before the code: HumanEval's signature and docstring,
/// so an answer may be just the function body (or, as chat models write
/// it, the whole function, which redefines the docstring-only one).
pub struct CodeTests {
    pub(super) sandbox: crate::SandboxService,
    timeout: Duration,
    pub(super) requirements: Vec<String>,
}

impl CodeTests {
    /// A runner for the service named in `cfg` (its key from the
    /// environment: [`crate::SandboxService::new`]).
    pub fn new(cfg: CodeTestsConfig) -> Result<Self, String> {
        Ok(CodeTests {
            sandbox: crate::SandboxService::new(cfg.sandbox_url)?,
            timeout: Duration::from_secs_f64(cfg.timeout_s.max(0.1)),
            requirements: Vec::new(),
        })
    }

    /// Fraction of `tests` that pass after `code`.
    pub async fn pass_rate(&self, code: &str, tests: &[String]) -> Result<f64, String> {
        if tests.is_empty() {
            return Ok(0.0);
        }
        let runs = tests.iter().map(|t| {
            let req = temper_sandbox::service::RunCodeRequest {
                code: format!("{code}\n\n{t}\n"),
                language: "python".into(),
                stdin: String::new(),
                files: Default::default(),
                run_timeout: Some(self.timeout.as_secs_f64()),
                compile_timeout: None,
                memory_limit_mb: None,
                fetch_files: Vec::new(),
                requirements: self.requirements.clone(),
            };
            async move { self.sandbox.client().run_code(&req).await }
        });
        let mut passed = 0usize;
        for r in futures::future::join_all(runs).await {
            let r = r.map_err(|e| e.to_string())?;
            if r.status == "SandboxError" {
                return Err(format!("sandbox error: {}", r.message));
            }
            passed += usize::from(r.status == "Success");
        }
        Ok(passed as f64 / tests.len() as f64)
    }

    pub(super) async fn score(&self, c: &RewardCtx<'_>) -> Result<f64, String> {
        let text = crate::last_assistant_text(c.completion);
        let code = match c.info.get("prefix") {
            None | Some(Value::Null) => extract_code(&text),
            Some(Value::String(prefix)) => format!("{prefix}\n{}", extract_code(&text)),
            Some(other) => return Err(format!("info.prefix must be a string, got {other}")),
        };
        let tests: Vec<String> = c
            .info
            .get("tests")
            .and_then(Value::as_array)
            .map(|a| {
                a.iter()
                    .filter_map(Value::as_str)
                    .map(str::to_string)
                    .collect()
            })
            .unwrap_or_default();
        self.pass_rate(&code, &tests).await
    }
}

/// The last fenced code block (```python … ```), or the whole text without
/// its blank first and trailing lines (the indentation of a bare function
/// body is kept: it is the code).
pub fn extract_code(text: &str) -> String {
    let mut best = None;
    let mut rest = text;
    while let Some(start) = rest.find("```") {
        let after = &rest[start + 3..];
        let body_start = after.find('\n').map_or(after.len(), |i| i + 1);
        let body = &after[body_start..];
        match body.find("```") {
            Some(end) => {
                best = Some(body[..end].to_string());
                rest = &body[end + 3..];
            }
            None => break,
        }
    }
    best.unwrap_or_else(|| {
        let body = text.trim_end();
        // Drop whole blank lines only, not the first line's indentation.
        let start = body
            .char_indices()
            .take_while(|(_, c)| c.is_whitespace())
            .filter(|(_, c)| *c == '\n')
            .last()
            .map_or(0, |(i, _)| i + 1);
        body[start..].to_string()
    })
}
