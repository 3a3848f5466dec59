//! The test-case runner for code rewards: one program against K test cases,
//! each its own sandboxed run with its own timeout.

use std::time::Duration;

use crate::{ExecRequest, ExecResult, ExecStatus, Language, SandboxError};

/// One test case.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub enum TestCase {
    /// Feed `stdin`; pass when stdout equals `expected_stdout` up to
    /// trailing whitespace on each line and trailing blank lines.
    Io {
        /// Standard input.
        stdin: String,
        /// Expected standard output.
        expected_stdout: String,
    },
    /// Append `code` (e.g. `assert f(2) == 4`) to the program; pass when the
    /// whole exits 0.
    Assert {
        /// Code appended after the program.
        code: String,
    },
}

/// The outcome of one case.
#[derive(Debug, Clone)]
pub struct CaseResult {
    /// Whether the case passed.
    pub passed: bool,
    /// The run behind it.
    pub result: ExecResult,
}

/// The outcome of all cases.
#[derive(Debug, Clone)]
pub struct TestReport {
    /// One entry per case, in order.
    pub cases: Vec<CaseResult>,
    /// Cases passed.
    pub passed: usize,
    /// `passed / cases` (0 when there are no cases): the reward.
    pub fraction_passed: f64,
}

fn normalize(s: &str) -> String {
    let lines: Vec<&str> = s.lines().map(str::trim_end).collect();
    let end = lines
        .iter()
        .rposition(|l| !l.is_empty())
        .map_or(0, |i| i + 1);
    lines[..end].join("\n")
}

/// Runs `code` against every case through `run` ([`crate::Sandbox::run`],
/// [`crate::Pool::run`], ...). A case that fails, crashes or times out is a
/// failed case; only a sandbox failure is an error.
pub fn run_test_cases(
    run: impl Fn(&ExecRequest) -> Result<ExecResult, SandboxError>,
    language: Language,
    code: &str,
    cases: &[TestCase],
    per_case_timeout: Duration,
) -> Result<TestReport, SandboxError> {
    let mut results = Vec::with_capacity(cases.len());
    for case in cases {
        let (req, expected) = match case {
            TestCase::Io {
                stdin,
                expected_stdout,
            } => {
                let mut req = ExecRequest::new(language, code);
                req.stdin = stdin.clone().into_bytes();
                (req, Some(expected_stdout))
            }
            TestCase::Assert { code: check } => (
                ExecRequest::new(language, format!("{code}\n{check}\n")),
                None,
            ),
        };
        let req = ExecRequest {
            timeout: per_case_timeout,
            ..req
        };
        let result = run(&req)?;
        let finished_ok = result.status == ExecStatus::Finished && result.return_code == Some(0);
        let passed =
            finished_ok && expected.is_none_or(|want| normalize(&result.stdout) == normalize(want));
        results.push(CaseResult { passed, result });
    }
    let passed = results.iter().filter(|c| c.passed).count();
    let fraction_passed = if results.is_empty() {
        0.0
    } else {
        passed as f64 / results.len() as f64
    };
    Ok(TestReport {
        cases: results,
        passed,
        fraction_passed,
    })
}

#[cfg(test)]
mod tests {
    use super::normalize;

    #[test]
    fn output_comparison_ignores_trailing_whitespace_only() {
        assert_eq!(normalize("1 \n2\n\n"), normalize("1\n2"));
        assert_ne!(normalize("1\n2"), normalize("1\n 2"));
    }
}
