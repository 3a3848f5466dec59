//! A rubric entry of `env.toml` ([`RewardSpec`]) and the reward it names.

use std::time::Duration;

use serde::Deserialize;
use serde_json::Value;

use super::code_tests::{CodeTests, CodeTestsConfig};
use super::json_fields::JsonFieldsConfig;
use super::judge::{Judge, JudgeConfig};
use super::program::ProgramReward;
use super::regex_extract::{RegexExtract, RegexExtractConfig};
use super::relative_judge::{RelativeJudge, RelativeJudgeConfig};
use super::reward::Reward;
use super::suite::{Suite, SuiteConfig};

/// One rubric entry as written in `env.toml`:
/// `{ function = "math_equiv", weight = 1.0, name = "correct", args = {} }`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RewardSpec {
    /// Built-in function name (see [`Reward::from_spec`]); with `command`,
    /// the program's function to call (optional when it has one).
    #[serde(default)]
    pub function: Option<String>,
    /// A reward program (`python3 reward.py`) speaking JSON lines
    /// ([`ProgramReward`]), run from the env directory.
    #[serde(default)]
    pub command: Option<String>,
    /// Seconds a program may take per group before its scores count as
    /// failed (metric `NAME/error`).
    #[serde(default)]
    pub timeout_s: Option<f64>,
    /// Run the program (`python3 FILE.py`) in the sandbox service, one
    /// isolated run per group, instead of as a local process.
    #[serde(default)]
    pub sandbox: bool,
    /// The sandbox service (default `$TEMPER_SANDBOX_URL`, else
    /// `http://127.0.0.1:8080`).
    #[serde(default)]
    pub sandbox_url: Option<String>,
    /// Files and directories (relative to the env directory) shipped with a
    /// sandboxed program, at the same relative paths beside it.
    #[serde(default)]
    pub files: Vec<String>,
    /// Weight in the reward; 0 = metric only.
    #[serde(default = "one")]
    pub weight: f64,
    /// Metric name (defaults to the function name).
    #[serde(default)]
    pub name: Option<String>,
    /// Function arguments.
    #[serde(default)]
    pub args: toml::Table,
}

fn one() -> f64 {
    1.0
}

impl Reward {
    /// An `env.toml` entry: a built-in, or a program (`command`) started in
    /// `dir`.
    pub fn from_spec_in(spec: &RewardSpec, dir: Option<&std::path::Path>) -> Result<Self, String> {
        let Some(command) = &spec.command else {
            if spec.timeout_s.is_some()
                || spec.sandbox
                || spec.sandbox_url.is_some()
                || !spec.files.is_empty()
            {
                return Err(
                    "timeout_s, sandbox, sandbox_url and files apply to reward programs (command = ...)"
                        .into(),
                );
            }
            return Reward::from_spec(spec);
        };
        let args = serde_json::to_value(&spec.args).map_err(|e| e.to_string())?;
        let timeout = Duration::from_secs_f64(spec.timeout_s.unwrap_or(60.0).max(0.01));
        let program = if spec.sandbox {
            ProgramReward::sandboxed(
                command,
                dir,
                spec.function.clone(),
                args,
                timeout,
                spec.sandbox_url.clone(),
            )?
            .with_files(dir, &spec.files)?
        } else {
            if spec.sandbox_url.is_some() || !spec.files.is_empty() {
                return Err(
                    "sandbox_url and files need sandbox = true (a local program reads its directory)"
                        .into(),
                );
            }
            ProgramReward::spawn(command, dir, spec.function.clone(), args, timeout)?
        };
        let name = spec
            .name
            .clone()
            .or_else(|| spec.function.clone())
            .unwrap_or_else(|| "program".into());
        Ok(Reward::program(spec.weight, name, program))
    }

    /// A built-in function from its `env.toml` entry.
    pub fn from_spec(spec: &RewardSpec) -> Result<Self, String> {
        let args = serde_json::to_value(&spec.args).map_err(|e| e.to_string())?;
        let w = spec.weight;
        let get_str = |k: &str| args.get(k).and_then(Value::as_str).map(str::to_string);
        let function = spec
            .function
            .as_deref()
            .ok_or("a rubric entry needs `function` (a built-in) or `command` (a program)")?;
        let r = match function {
            "exact_match" => Reward::exact_match(
                w,
                args.get("case_sensitive")
                    .and_then(Value::as_bool)
                    .unwrap_or(false),
            ),
            "contains" => Reward::contains(w),
            "regex" => {
                let p = get_str("pattern").ok_or("regex needs args.pattern")?;
                Reward::regex(w, &p).map_err(|e| e.to_string())?
            }
            "math_equiv" => Reward::math_equiv(w),
            "numeric_match" => Reward::numeric_match(w),
            "lcs_ratio" | "lcs" => Reward::lcs(w),
            "json_valid" => Reward::json_valid(w),
            "json_schema" => Reward::json_schema(w, args.get("schema").cloned())?,
            "format" => Reward::format(w),
            "length_penalty" => Reward::length_penalty(
                w,
                args.get("max_chars")
                    .and_then(Value::as_u64)
                    .ok_or("length_penalty needs args.max_chars")? as usize,
            ),
            "judge" => {
                let cfg: JudgeConfig =
                    serde_json::from_value(args.clone()).map_err(|e| e.to_string())?;
                Reward::judge(w, Judge::from_config(cfg)?)
            }
            "relative_judge" => {
                let cfg: RelativeJudgeConfig = serde_json::from_value(args.clone())
                    .map_err(|e| format!("relative_judge: {e}"))?;
                Reward::relative_judge(w, RelativeJudge::from_config(cfg)?)
            }
            "code_tests" => {
                let cfg: CodeTestsConfig =
                    serde_json::from_value(args.clone()).map_err(|e| e.to_string())?;
                Reward::code_tests(w, CodeTests::new(cfg)?)
            }
            "mutation_score" | "coverage" => {
                let cfg: SuiteConfig = serde_json::from_value(args.clone())
                    .map_err(|e| format!("{function}: {e}"))?;
                Reward::suite(w, Suite::new(cfg, function == "coverage")?)
            }
            "json_fields" => {
                let cfg: JsonFieldsConfig =
                    serde_json::from_value(args.clone()).map_err(|e| format!("json_fields: {e}"))?;
                Reward::json_fields(w, cfg)
            }
            "regex_extract" => {
                let cfg: RegexExtractConfig = serde_json::from_value(args.clone())
                    .map_err(|e| format!("regex_extract: {e}"))?;
                Reward::regex_extract(w, RegexExtract::new(cfg)?)
            }
            other => {
                return Err(format!(
                    "unknown reward function `{other}` (built-ins: {}; or command = \"...\" for a program)",
                    BUILTIN_REWARDS.join(", ")
                ))
            }
        };
        // Every built-in scores in [0, 1], except the length penalty, which
        // is at most 0.
        let r = r.bounded(if function == "length_penalty" {
            0.0
        } else {
            1.0
        });
        Ok(match &spec.name {
            Some(n) => r.named(n.clone()),
            None => r,
        })
    }
}

/// The built-in reward functions of `env.toml` (README: "Built-in rewards").
pub const BUILTIN_REWARDS: &[&str] = &[
    "exact_match",
    "contains",
    "regex",
    "regex_extract",
    "math_equiv",
    "numeric_match",
    "lcs_ratio",
    "json_valid",
    "json_schema",
    "json_fields",
    "format",
    "length_penalty",
    "judge",
    "relative_judge",
    "code_tests",
    "mutation_score",
    "coverage",
];
