//! Rubrics: a weighted sum of reward functions plus zero-weight metrics,
//! per rollout and per group.
//!
//! A reward function sees one rollout through a [`RewardCtx`]; a group
//! function sees every rollout of one prompt (for relative rewards such as
//! "shortest correct answer"). Each function's raw score is reported as a
//! metric under its name; the reward is Σ weight · score, so weight 0 makes
//! a function a metric only.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use serde::Deserialize;
use serde_json::Value;

use crate::relative_judge::{RelativeJudge, RelativeJudgeConfig};
use crate::{
    math, ChatModel, ChatRequest, EnvError, Message, Parser, Rollout, Row, SamplingArgs, Score,
};

/// What a reward function sees of one rollout.
#[derive(Debug, Clone, Copy)]
pub struct RewardCtx<'a> {
    /// The prompt messages.
    pub prompt: &'a [Message],
    /// The completion messages.
    pub completion: &'a [Message],
    /// The reference answer.
    pub answer: Option<&'a str>,
    /// The row's task data.
    pub info: &'a Value,
    /// The environment's parser.
    pub parser: &'a Parser,
    /// The whole rollout (stop condition, usage, state).
    pub rollout: &'a Rollout,
}

impl RewardCtx<'_> {
    /// The parsed answer of the completion.
    pub fn parsed(&self) -> Option<String> {
        self.parser.parse_answer(self.completion)
    }
}

/// A reward function over one rollout.
pub type RewardFn = Arc<dyn Fn(&RewardCtx<'_>) -> f64 + Send + Sync>;
/// A reward function over the rollouts of one prompt: one score each.
pub type GroupFn = Arc<dyn Fn(&[RewardCtx<'_>]) -> Vec<f64> + Send + Sync>;

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

#[derive(Clone)]
enum Kind {
    Sync(RewardFn),
    Judge(Arc<Judge>),
    CodeTests(Arc<CodeTests>),
    Suite(Arc<crate::suite::Suite>),
    Program(Arc<ProgramReward>),
    RelativeJudge(Arc<RelativeJudge>),
}

/// A named, weighted reward function.
#[derive(Clone)]
pub struct Reward {
    name: String,
    weight: f64,
    kind: Kind,
    /// The largest raw score the function gives, when known (built-ins);
    /// a program's range is unknown.
    max_score: Option<f64>,
}

impl std::fmt::Debug for Reward {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Reward({} × {})", self.name, self.weight)
    }
}

impl Reward {
    /// A reward from a plain function.
    pub fn new(
        name: impl Into<String>,
        weight: f64,
        f: impl Fn(&RewardCtx<'_>) -> f64 + Send + Sync + 'static,
    ) -> Self {
        Reward {
            name: name.into(),
            weight,
            kind: Kind::Sync(Arc::new(f)),
            max_score: None,
        }
    }

    /// The metric name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Parsed answer equals the reference exactly (trimmed; `case_sensitive`
    /// default false).
    pub fn exact_match(weight: f64, case_sensitive: bool) -> Self {
        Reward::new("exact_match", weight, move |c| {
            let (Some(got), Some(want)) = (c.parsed(), c.answer) else {
                return 0.0;
            };
            let eq = if case_sensitive {
                got.trim() == want.trim()
            } else {
                got.trim().to_lowercase() == want.trim().to_lowercase()
            };
            f64::from(u8::from(eq))
        })
    }

    /// The reference answer occurs in the last assistant message.
    pub fn contains(weight: f64) -> Self {
        Reward::new("contains", weight, |c| {
            let text = crate::last_assistant_text(c.completion).to_lowercase();
            match c.answer {
                Some(a) if !a.trim().is_empty() => {
                    f64::from(u8::from(text.contains(&a.trim().to_lowercase())))
                }
                _ => 0.0,
            }
        })
    }

    /// The parsed answer matches `pattern` (whole-answer match unless the
    /// pattern says otherwise).
    pub fn regex(weight: f64, pattern: &str) -> Result<Self, regex::Error> {
        let re = regex::Regex::new(pattern)?;
        Ok(Reward::new("regex", weight, move |c| {
            c.parsed()
                .map_or(0.0, |a| f64::from(u8::from(re.is_match(&a))))
        }))
    }

    /// Parsed answer is mathematically equal to the reference
    /// ([`math::math_equal`]).
    pub fn math_equiv(weight: f64) -> Self {
        Reward::new("math_equiv", weight, |c| match (c.parsed(), c.answer) {
            (Some(got), Some(want)) => f64::from(u8::from(math::math_equal(&got, want))),
            _ => 0.0,
        })
    }

    /// Parsed answer is a number literal equal to the reference number.
    pub fn numeric_match(weight: f64) -> Self {
        Reward::new("numeric_match", weight, |c| {
            let got = c.parsed().and_then(|a| math::parse_number_literal(&a));
            let want = c.answer.and_then(math::parse_number_literal);
            match (got, want) {
                (Some(g), Some(w)) => f64::from(u8::from((g - w).abs() < 1e-9)),
                _ => 0.0,
            }
        })
    }

    /// Longest-common-subsequence ratio of the parsed answer and the
    /// reference: 2·LCS / (|a| + |b|).
    pub fn lcs(weight: f64) -> Self {
        Reward::new("lcs_ratio", weight, |c| match (c.parsed(), c.answer) {
            (Some(got), Some(want)) => lcs_ratio(&got, want),
            _ => 0.0,
        })
    }

    /// The parsed answer is valid JSON.
    pub fn json_valid(weight: f64) -> Self {
        Reward::new("json_valid", weight, |c| {
            c.parsed().map_or(0.0, |a| {
                f64::from(u8::from(serde_json::from_str::<Value>(&a).is_ok()))
            })
        })
    }

    /// The parsed answer is JSON valid against `schema`, or against the
    /// row's `info.schema` when `schema` is `None`.
    pub fn json_schema(weight: f64, schema: Option<Value>) -> Result<Self, String> {
        let fixed = match schema {
            Some(s) => Some(Arc::new(
                jsonschema::validator_for(&s).map_err(|e| e.to_string())?,
            )),
            None => None,
        };
        Ok(Reward::new("json_schema", weight, move |c| {
            let Some(value) = c
                .parsed()
                .and_then(|a| serde_json::from_str::<Value>(&a).ok())
            else {
                return 0.0;
            };
            let ok = match &fixed {
                Some(v) => v.is_valid(&value),
                None => match c.info.get("schema") {
                    Some(s) => jsonschema::validator_for(s).is_ok_and(|v| v.is_valid(&value)),
                    None => false,
                },
            };
            f64::from(u8::from(ok))
        }))
    }

    /// The parser's format reward.
    pub fn format(weight: f64) -> Self {
        Reward::new("format", weight, |c| c.parser.format_reward(c.completion))
    }

    /// 0 up to `max_chars` characters of assistant text, then falling
    /// linearly to −1 at twice that. Give it a positive weight.
    pub fn length_penalty(weight: f64, max_chars: usize) -> Self {
        Reward::new("length_penalty", weight, move |c| {
            let len: usize = c
                .completion
                .iter()
                .filter(|m| m.role == "assistant")
                .map(|m| m.text().chars().count())
                .sum();
            let max = max_chars.max(1) as f64;
            -((len as f64 - max) / max).clamp(0.0, 1.0)
        })
    }

    /// An LLM judge.
    pub fn judge(weight: f64, judge: Judge) -> Self {
        Reward {
            name: "judge".into(),
            weight,
            kind: Kind::Judge(Arc::new(judge)),
            max_score: None,
        }
    }

    /// A relative LLM judge: one call scores the whole group
    /// ([`RelativeJudge`]).
    pub fn relative_judge(weight: f64, judge: RelativeJudge) -> Self {
        Reward {
            name: "relative_judge".into(),
            weight,
            kind: Kind::RelativeJudge(Arc::new(judge)),
            max_score: None,
        }
    }

    /// Unit tests in the sandbox service.
    pub fn code_tests(weight: f64, tests: CodeTests) -> Self {
        Reward {
            name: "code_tests".into(),
            weight,
            kind: Kind::CodeTests(Arc::new(tests)),
            max_score: None,
        }
    }

    /// A model's tests run against the row's code and its mutants in the
    /// sandbox ([`crate::suite`]): `mutation_score` or `coverage`, by the
    /// suite's mode.
    pub fn suite(weight: f64, suite: crate::suite::Suite) -> Self {
        Reward {
            name: suite.name().into(),
            weight,
            kind: Kind::Suite(Arc::new(suite)),
            max_score: None,
        }
    }

    /// Run sandboxed code with these Python packages (`[sandbox]
    /// requirements` of `env.toml`); other rewards are unchanged. Call it
    /// on a new reward (its runner not yet shared).
    pub fn with_requirements(mut self, requirements: &[String]) -> Self {
        let reqs = requirements.to_vec();
        match &mut self.kind {
            Kind::CodeTests(t) => {
                if let Some(t) = Arc::get_mut(t) {
                    t.requirements = reqs;
                }
            }
            Kind::Suite(s) => {
                if let Some(s) = Arc::get_mut(s) {
                    s.set_requirements(reqs);
                }
            }
            Kind::Program(p) => {
                if let Some(Runner::Sandbox { requirements, .. }) =
                    Arc::get_mut(p).map(|p| &mut p.runner)
                {
                    *requirements = reqs;
                }
            }
            Kind::Sync(_) | Kind::Judge(_) | Kind::RelativeJudge(_) => {}
        }
        self
    }

    /// Rename (the metric key).
    pub fn named(mut self, name: impl Into<String>) -> Self {
        self.name = name.into();
        self
    }

    /// A reward program (see [`ProgramReward`]).
    pub fn program(weight: f64, name: impl Into<String>, program: ProgramReward) -> Self {
        Reward {
            name: name.into(),
            weight,
            kind: Kind::Program(Arc::new(program)),
            max_score: None,
        }
    }

    /// Per-field comparison of the parsed answer's JSON object with the
    /// reference's ([`json_fields_score`]).
    pub fn json_fields(weight: f64, cfg: JsonFieldsConfig) -> Self {
        Reward::new("json_fields", weight, move |c| {
            json_fields_score(c.parsed().as_deref(), c.answer, &cfg)
        })
    }

    /// A value captured from the last assistant message by `pattern`,
    /// compared with the reference ([`RegexExtract`]).
    pub fn regex_extract(weight: f64, cfg: RegexExtract) -> Self {
        Reward::new("regex_extract", weight, move |c| {
            let text = crate::last_assistant_text(c.completion);
            match (cfg.extract(&text), c.answer) {
                (Some(got), Some(want)) => f64::from(u8::from(cfg.same(&got, want))),
                _ => 0.0,
            }
        })
    }

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
                let cfg: crate::suite::SuiteConfig = serde_json::from_value(args.clone())
                    .map_err(|e| format!("{function}: {e}"))?;
                Reward::suite(w, crate::suite::Suite::new(cfg, function == "coverage")?)
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

    /// Declare the largest raw score this function gives.
    pub fn bounded(mut self, max_score: f64) -> Self {
        self.max_score = Some(max_score);
        self
    }

    /// The service it calls, if any.
    fn service(&self) -> Option<Arc<dyn crate::Service>> {
        match &self.kind {
            Kind::Sync(_) => None,
            Kind::Judge(j) => j.endpoint.clone().map(|model| {
                Arc::new(crate::service::EndpointService {
                    model,
                    what: "judge",
                }) as Arc<dyn crate::Service>
            }),
            Kind::RelativeJudge(j) => j.endpoint.clone().map(|model| {
                Arc::new(crate::service::EndpointService {
                    model,
                    what: "judge",
                }) as Arc<dyn crate::Service>
            }),
            Kind::CodeTests(t) => Some(Arc::new(t.sandbox.clone())),
            Kind::Suite(s) => Some(Arc::new(s.sandbox().clone())),
            Kind::Program(p) => match &p.runner {
                Runner::Sandbox { sandbox, .. } => Some(Arc::new(sandbox.clone())),
                Runner::Process(_) => None,
            },
        }
    }

    /// One rollout's score and metrics reported as `NAME/metric`, or why
    /// the function could not give one.
    async fn score(&self, ctx: &RewardCtx<'_>) -> Result<(f64, BTreeMap<String, f64>), String> {
        let plain = |v| (v, BTreeMap::new());
        match &self.kind {
            Kind::Sync(f) => Ok(plain(f(ctx))),
            Kind::Judge(j) => j.score(ctx).await.map(plain),
            Kind::CodeTests(t) => t.score(ctx).await.map(plain),
            Kind::Suite(s) => s.score(ctx).await,
            // Scored per group in `Rubric::score_group`.
            Kind::Program(_) | Kind::RelativeJudge(_) => Ok(plain(0.0)),
        }
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

/// A named, weighted group function.
#[derive(Clone)]
pub struct GroupReward {
    name: String,
    weight: f64,
    f: GroupFn,
}

impl GroupReward {
    /// A group function: one score per rollout of the group.
    pub fn new(
        name: impl Into<String>,
        weight: f64,
        f: impl Fn(&[RewardCtx<'_>]) -> Vec<f64> + Send + Sync + 'static,
    ) -> Self {
        GroupReward {
            name: name.into(),
            weight,
            f: Arc::new(f),
        }
    }
}

/// Reward functions, group functions and the parser they read answers with.
#[derive(Clone, Default)]
pub struct Rubric {
    /// The parser passed to every function.
    pub parser: Parser,
    funcs: Vec<Reward>,
    group_funcs: Vec<GroupReward>,
    /// Divide the reward by the sum of |weight| (so weights in [0, 1]-scored
    /// functions give a reward in [0, 1]).
    pub normalize: bool,
}

impl std::fmt::Debug for Rubric {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Rubric")
            .field("parser", &self.parser)
            .field("funcs", &self.funcs)
            .finish()
    }
}

impl Rubric {
    /// An empty rubric reading answers with `parser`.
    pub fn new(parser: Parser) -> Self {
        Rubric {
            parser,
            funcs: Vec::new(),
            group_funcs: Vec::new(),
            normalize: false,
        }
    }

    /// Add a reward function.
    pub fn with(mut self, r: Reward) -> Self {
        self.funcs.push(r);
        self
    }

    /// Add a group function.
    pub fn with_group(mut self, g: GroupReward) -> Self {
        self.group_funcs.push(g);
        self
    }

    /// The largest reward this rubric can give, when every function with a
    /// positive weight declares its range (built-ins do; programs do not):
    /// Σ weight · max over positive weights, divided by Σ |weight| when the
    /// rubric normalizes. A negative-weight function is assumed to score
    /// ≥ 0, so it adds nothing to the maximum.
    pub fn max_reward(&self) -> Option<f64> {
        let mut max = 0.0;
        for f in self.funcs.iter().filter(|f| f.weight > 0.0) {
            max += f.weight * f.max_score?;
        }
        if self.group_funcs.iter().any(|g| g.weight > 0.0) {
            return None;
        }
        if self.normalize {
            let total: f64 = self.funcs.iter().map(|f| f.weight.abs()).sum::<f64>()
                + self.group_funcs.iter().map(|g| g.weight.abs()).sum::<f64>();
            if total > 0.0 {
                max /= total;
            }
        }
        Some(max)
    }

    /// The services its functions call (the sandbox, a judge's endpoint).
    pub fn services(&self) -> Vec<Arc<dyn crate::Service>> {
        self.funcs.iter().filter_map(Reward::service).collect()
    }

    /// Score the rollouts of one row. Functions run in order; each runs
    /// concurrently across the group.
    pub async fn score_group(&self, row: &Row, rollouts: &[Rollout]) -> Vec<Score> {
        let ctxs: Vec<RewardCtx<'_>> = rollouts
            .iter()
            .map(|r| RewardCtx {
                prompt: &row.prompt,
                completion: &r.completion,
                answer: row.answer.as_deref(),
                info: &row.info,
                parser: &self.parser,
                rollout: r,
            })
            .collect();
        let n = rollouts.len().max(1) as f64;
        let mut scores = vec![
            Score {
                scoring_ms: Some(0.0),
                ..Score::default()
            };
            rollouts.len()
        ];
        for func in &self.funcs {
            // Functions of the whole group: one call for all its rollouts.
            let t = Instant::now();
            let group = match &func.kind {
                Kind::Program(p) => Some(p.score_group(&ctxs).await),
                Kind::RelativeJudge(j) => Some(
                    j.score_group(&ctxs)
                        .await
                        .map(|v| v.into_iter().map(|x| (x, BTreeMap::new())).collect()),
                ),
                _ => None,
            };
            if let Some(result) = group {
                let share_ms = t.elapsed().as_secs_f64() * 1e3 / n;
                match result {
                    Ok(values) => {
                        for (s, (v, metrics)) in scores.iter_mut().zip(values) {
                            s.reward += func.weight * v;
                            s.metrics.insert(func.name.clone(), v);
                            for (k, m) in metrics {
                                s.metrics.insert(format!("{}/{k}", func.name), m);
                            }
                            add_ms(s, share_ms);
                        }
                    }
                    Err(e) => {
                        match &func.kind {
                            Kind::Program(p) => {
                                tracing::warn!("reward program `{}`: {e}", p.command)
                            }
                            _ => tracing::warn!("reward `{}`: {e}", func.name),
                        }
                        for s in &mut scores {
                            failed(s, &func.name, &e);
                            add_ms(s, share_ms);
                        }
                    }
                }
                continue;
            }
            let values = futures::future::join_all(ctxs.iter().map(|c| async move {
                let t = Instant::now();
                let v = func.score(c).await;
                (v, t.elapsed().as_secs_f64() * 1e3)
            }))
            .await;
            for (s, (v, ms)) in scores.iter_mut().zip(values) {
                match v {
                    Ok((v, metrics)) => {
                        s.reward += func.weight * v;
                        s.metrics.insert(func.name.clone(), v);
                        for (k, m) in metrics {
                            s.metrics.insert(format!("{}/{k}", func.name), m);
                        }
                    }
                    Err(e) => {
                        tracing::warn!("reward `{}`: {e}", func.name);
                        failed(s, &func.name, &e);
                    }
                }
                add_ms(s, ms);
            }
        }
        for g in &self.group_funcs {
            let t = Instant::now();
            let values = (g.f)(&ctxs);
            let share_ms = t.elapsed().as_secs_f64() * 1e3 / n;
            for (s, v) in scores.iter_mut().zip(values) {
                s.reward += g.weight * v;
                s.metrics.insert(g.name.clone(), v);
                add_ms(s, share_ms);
            }
        }
        if self.normalize {
            let total: f64 = self
                .funcs
                .iter()
                .map(|f| f.weight.abs())
                .chain(self.group_funcs.iter().map(|g| g.weight.abs()))
                .sum();
            if total > 0.0 {
                for s in &mut scores {
                    s.reward /= total;
                }
            }
        }
        scores
    }
}

/// Function `name` could not score this rollout: 0, the metric
/// `NAME/error = 1`, and the first such failure as the score's error.
fn failed(s: &mut Score, name: &str, why: &str) {
    s.metrics.insert(name.to_string(), 0.0);
    s.metrics.insert(format!("{name}/error"), 1.0);
    s.error
        .get_or_insert_with(|| format!("reward `{name}`: {why}"));
}

fn add_ms(s: &mut Score, ms: f64) {
    *s.scoring_ms.get_or_insert(0.0) += ms;
}

/// 2·LCS / (|a| + |b|) over characters (1 for two empty strings).
pub fn lcs_ratio(a: &str, b: &str) -> f64 {
    let a: Vec<char> = a.chars().take(4096).collect();
    let b: Vec<char> = b.chars().take(4096).collect();
    if a.is_empty() && b.is_empty() {
        return 1.0;
    }
    let mut prev = vec![0usize; b.len() + 1];
    let mut cur = vec![0usize; b.len() + 1];
    for &x in &a {
        for (j, &y) in b.iter().enumerate() {
            cur[j + 1] = if x == y {
                prev[j] + 1
            } else {
                cur[j].max(prev[j + 1])
            };
        }
        std::mem::swap(&mut prev, &mut cur);
    }
    2.0 * prev[b.len()] as f64 / (a.len() + b.len()) as f64
}

/// `judge` arguments.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JudgeConfig {
    /// OpenAI-compatible base URL (`http://host:port/v1`).
    pub base_url: String,
    /// Judge model name.
    pub model: String,
    /// Environment variable holding the API key.
    #[serde(default)]
    pub api_key_env: Option<String>,
    /// Prompt template: `{question}`, `{answer}`, `{response}`.
    #[serde(default = "default_judge_prompt")]
    pub prompt: String,
    /// Judge completion tokens.
    #[serde(default = "default_judge_tokens")]
    pub max_tokens: usize,
}

fn default_judge_prompt() -> String {
    "Question:\n{question}\n\nReference answer:\n{answer}\n\nResponse:\n{response}\n\n\
     Is the response correct and consistent with the reference answer? Reply yes or no."
        .into()
}

fn default_judge_tokens() -> usize {
    16
}

/// An LLM judge: asks a model whether a response is right; 1 for an
/// answer starting with "yes". Verdicts are cached by prompt text, so a
/// resumed or repeated evaluation asks once.
pub struct Judge {
    model: Arc<dyn ChatModel>,
    /// The endpoint, when the judge is one (checked before a run).
    endpoint: Option<Arc<crate::openai::OpenAiChatModel>>,
    prompt: String,
    max_tokens: usize,
    cache: Mutex<HashMap<String, f64>>,
}

impl Judge {
    /// A judge over any [`ChatModel`]; `prompt` has `{question}`,
    /// `{answer}` and `{response}` placeholders.
    pub fn new(model: Arc<dyn ChatModel>, prompt: impl Into<String>) -> Self {
        Judge {
            model,
            endpoint: None,
            prompt: prompt.into(),
            max_tokens: default_judge_tokens(),
            cache: Mutex::new(HashMap::new()),
        }
    }

    /// A judge on an OpenAI-compatible endpoint.
    pub fn from_config(cfg: JudgeConfig) -> Result<Self, String> {
        let model = judge_endpoint(&cfg.base_url, &cfg.model, cfg.api_key_env.as_deref())?;
        let mut j = Judge::new(model.clone(), cfg.prompt);
        j.endpoint = Some(model);
        j.max_tokens = cfg.max_tokens;
        Ok(j)
    }

    async fn score(&self, c: &RewardCtx<'_>) -> Result<f64, String> {
        let question = c
            .prompt
            .iter()
            .rev()
            .find(|m| m.role == "user")
            .map(Message::text)
            .unwrap_or_default();
        let response = c
            .parsed()
            .unwrap_or_else(|| crate::last_assistant_text(c.completion));
        let prompt = self
            .prompt
            .replace("{question}", &question)
            .replace("{answer}", c.answer.unwrap_or(""))
            .replace("{response}", &response);
        if let Some(v) = self
            .cache
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(&prompt)
            .copied()
        {
            return Ok(v);
        }
        let req = ChatRequest {
            messages: vec![Message::user(prompt.clone())],
            tools: None,
            sampling: SamplingArgs {
                max_tokens: self.max_tokens,
                temperature: 0.0,
                ..SamplingArgs::default()
            },
        };
        match self.model.chat(req).await {
            Ok(turn) => {
                let verdict = turn.message.text().trim().to_lowercase();
                let v = f64::from(u8::from(verdict.starts_with("yes")));
                self.cache
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .insert(prompt, v);
                Ok(v)
            }
            Err(e) => Err(format!("judge call failed: {e}")),
        }
    }
}

/// The client of a judge's OpenAI-compatible endpoint (`judge` and
/// `relative_judge`), its key read from `$api_key_env`.
pub(crate) fn judge_endpoint(
    base_url: &str,
    model: &str,
    api_key_env: Option<&str>,
) -> Result<Arc<crate::openai::OpenAiChatModel>, String> {
    let key = match api_key_env {
        Some(var) => Some(std::env::var(var).map_err(|_| format!("judge: ${var} is not set"))?),
        None => None,
    };
    crate::openai::OpenAiChatModel::new(base_url, model, key)
        .map(Arc::new)
        .map_err(|e| e.to_string())
}

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
    sandbox: crate::SandboxService,
    timeout: Duration,
    requirements: Vec<String>,
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

    async fn score(&self, c: &RewardCtx<'_>) -> Result<f64, String> {
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

/// Check a rubric spec list before use; programs start in `dir`.
pub(crate) fn build_rubric(
    parser: Parser,
    specs: &[RewardSpec],
    path: &str,
    dir: Option<&std::path::Path>,
    requirements: &[String],
) -> Result<Rubric, EnvError> {
    let mut rubric = Rubric::new(parser);
    for spec in specs {
        let r = Reward::from_spec_in(spec, dir).map_err(|message| EnvError::Manifest {
            path: path.to_string(),
            message,
        })?;
        rubric = rubric.with(r.with_requirements(requirements));
    }
    Ok(rubric)
}

/// A reward computed by another program, in any language, over the JSON
/// lines of [`crate::external`]: `info` → `{functions}`, then one `score`
/// per group, `{function, args, row: {prompt, answer, info}, rollouts:
/// [{text, parsed, completion, state, stop_condition, error,
/// is_truncated}]}` → one `{reward, metrics}` (or a bare number) per
/// rollout. `python/temper_reward.py` is the Python side.
pub struct ProgramReward {
    runner: Runner,
    command: String,
    function: Option<String>,
    args: Value,
    timeout: Duration,
}

impl ProgramReward {
    /// Start `command` in `dir` and check that it offers `function` (or
    /// exactly one function when `None`).
    pub fn spawn(
        command: &str,
        dir: Option<&std::path::Path>,
        function: Option<String>,
        args: Value,
        timeout: Duration,
    ) -> Result<Self, String> {
        let conn = crate::external::Conn::spawn(command, dir).map_err(|e| e.to_string())?;
        let info = conn
            .call_blocking("info", serde_json::json!({}))
            .map_err(|e| format!("reward program `{command}`: info: {e}"))?;
        let offered: Vec<String> = info["functions"]
            .as_array()
            .map(|a| {
                a.iter()
                    .filter_map(|f| f.as_str().map(str::to_string))
                    .collect()
            })
            .ok_or_else(|| {
                format!("reward program `{command}`: info has no `functions` list: {info}")
            })?;
        match &function {
            Some(f) if !offered.contains(f) => {
                return Err(format!(
                    "reward program `{command}` has no function `{f}`; it offers: {}",
                    offered.join(", ")
                ))
            }
            None if offered.len() != 1 => {
                return Err(format!(
                    "reward program `{command}` offers {} functions ({}); name one with `function`",
                    offered.len(),
                    offered.join(", ")
                ))
            }
            _ => {}
        }
        Ok(ProgramReward {
            runner: Runner::Process(conn),
            command: command.to_string(),
            function,
            args,
            timeout,
        })
    }

    /// The program `python3 FILE.py` (in `dir`) run in the sandbox service:
    /// each group is one isolated run with `FILE.py`, `temper_reward.py`
    /// beside it (and the files of [`ProgramReward::with_files`]), and the
    /// `score` request on stdin.
    pub fn sandboxed(
        command: &str,
        dir: Option<&std::path::Path>,
        function: Option<String>,
        args: Value,
        timeout: Duration,
        sandbox_url: Option<String>,
    ) -> Result<Self, String> {
        use base64::Engine as _;
        let words: Vec<&str> = command.split_whitespace().collect();
        let file = match words.as_slice() {
            ["python3" | "python", file] if file.ends_with(".py") => *file,
            _ => {
                return Err(format!(
                    "in the sandbox a reward program is `python3 FILE.py`, got `{command}`"
                ))
            }
        };
        let path = dir.map_or_else(|| std::path::PathBuf::from(file), |d| d.join(file));
        let code = std::fs::read_to_string(&path)
            .map_err(|e| format!("reward program {}: {e}", path.display()))?;
        // The sandbox runs the code as `__main__` from the work dir, which is
        // not on `sys.path`: put it there so `import temper_reward` works.
        let code = format!("import os as _o, sys as _s; _s.path.insert(0, _o.getcwd())\n{code}");
        let helper = include_str!("../../../python/temper_reward.py");
        let files = [(
            "temper_reward.py".to_string(),
            base64::engine::general_purpose::STANDARD.encode(helper),
        )]
        .into_iter()
        .collect();
        if timeout.as_secs_f64() > temper_sandbox::service::MAX_RUN_TIMEOUT_S {
            return Err(format!(
                "timeout_s: a sandboxed run may take at most {} s",
                temper_sandbox::service::MAX_RUN_TIMEOUT_S
            ));
        }
        let sandbox = crate::SandboxService::new(sandbox_url)?;
        Ok(ProgramReward {
            runner: Runner::Sandbox {
                sandbox,
                code,
                files,
                requirements: Vec::new(),
            },
            command: command.to_string(),
            function,
            args,
            timeout,
        })
    }

    /// Ship `paths` (files or directories, relative to `dir`) with a
    /// sandboxed program: each run gets them at the same relative paths in
    /// its work directory. They travel in every group's request, so their
    /// total is capped at [`MAX_SHIPPED_BYTES`].
    pub fn with_files(
        mut self,
        dir: Option<&std::path::Path>,
        paths: &[String],
    ) -> Result<Self, String> {
        use base64::Engine as _;
        let Runner::Sandbox { files, .. } = &mut self.runner else {
            return Err("files are shipped with sandboxed reward programs only".into());
        };
        let root = dir.unwrap_or_else(|| std::path::Path::new("."));
        let mut found = Vec::new();
        for p in paths {
            let rel = std::path::Path::new(p);
            if p.is_empty()
                || rel.is_absolute()
                || rel
                    .components()
                    .any(|c| !matches!(c, std::path::Component::Normal(_)))
            {
                return Err(format!(
                    "files: {p:?} must be a relative path inside the environment directory, without `..`"
                ));
            }
            collect_files(root, rel, &mut found)?;
        }
        let mut total = 0usize;
        for rel in found {
            let key = rel.to_string_lossy().into_owned();
            if key == "temper_reward.py" {
                return Err("files: temper_reward.py is shipped by temper itself".into());
            }
            let bytes = std::fs::read(root.join(&rel))
                .map_err(|e| format!("files: {}: {e}", root.join(&rel).display()))?;
            total += bytes.len();
            if total > MAX_SHIPPED_BYTES {
                return Err(format!(
                    "files: more than {MAX_SHIPPED_BYTES} bytes to ship with every group; \
                     put per-row data in the rows' `info` instead"
                ));
            }
            files.insert(key, base64::engine::general_purpose::STANDARD.encode(bytes));
        }
        Ok(self)
    }

    /// One `score` call through the runner.
    async fn call_score(&self, params: Value) -> Result<Value, String> {
        match &self.runner {
            Runner::Process(conn) => tokio::time::timeout(self.timeout, conn.call("score", params))
                .await
                .map_err(|_| format!("no answer within {:.1}s", self.timeout.as_secs_f64()))?,
            Runner::Sandbox {
                sandbox,
                code,
                files,
                requirements,
            } => {
                let line = serde_json::json!({"id": 1, "method": "score", "params": params});
                let req = temper_sandbox::service::RunCodeRequest {
                    code: code.clone(),
                    language: "python".into(),
                    stdin: format!("{line}\n"),
                    files: files.clone(),
                    run_timeout: Some(self.timeout.as_secs_f64()),
                    compile_timeout: None,
                    memory_limit_mb: None,
                    fetch_files: Vec::new(),
                    requirements: requirements.clone(),
                };
                let resp = sandbox
                    .client()
                    .run_code(&req)
                    .await
                    .map_err(|e| format!("{}: {e}", sandbox.url()))?;
                // No run result (a sandbox error) means no answer below.
                let (stdout, stderr) = resp
                    .run_result
                    .as_ref()
                    .map_or(("", ""), |r| (r.stdout.as_str(), r.stderr.as_str()));
                let reply = stdout
                    .lines()
                    .filter_map(|l| serde_json::from_str::<Value>(l).ok())
                    .find(|v| v["id"] == 1)
                    .ok_or_else(|| {
                        format!(
                            "sandbox run {} {}: no answer on stdout; stderr: {}",
                            resp.status,
                            resp.message,
                            clip(stderr)
                        )
                    })?;
                match reply.get("error") {
                    Some(e) if !e.is_null() => {
                        Err(e.as_str().map_or_else(|| e.to_string(), str::to_string))
                    }
                    _ => Ok(reply.get("result").cloned().unwrap_or(Value::Null)),
                }
            }
        }
    }

    /// Scores and metrics of the rollouts of one group, in one call.
    pub async fn score_group(
        &self,
        ctxs: &[RewardCtx<'_>],
    ) -> Result<Vec<(f64, BTreeMap<String, f64>)>, String> {
        let Some(first) = ctxs.first() else {
            return Ok(Vec::new());
        };
        let rollouts: Vec<Value> = ctxs
            .iter()
            .map(|c| {
                serde_json::json!({
                    "text": crate::last_assistant_text(c.completion),
                    "parsed": c.parsed(),
                    "completion": c.completion,
                    "state": c.rollout.state,
                    "stop_condition": c.rollout.stop_condition,
                    "error": c.rollout.error,
                    "is_truncated": c.rollout.is_truncated,
                })
            })
            .collect();
        let params = serde_json::json!({
            "function": self.function,
            "args": self.args,
            "row": {"prompt": first.prompt, "answer": first.answer, "info": first.info},
            "rollouts": rollouts,
        });
        let reply = self.call_score(params).await?;
        let items = reply
            .as_array()
            .filter(|a| a.len() == ctxs.len())
            .ok_or_else(|| {
                format!(
                    "`score` must answer a list of {} scores, got {}",
                    ctxs.len(),
                    clip(&reply.to_string())
                )
            })?;
        items.iter().map(program_score).collect()
    }
}

/// The most bytes of `files` shipped with a sandboxed reward program (they
/// travel base64-encoded in each request, and the service takes 2 MB).
pub const MAX_SHIPPED_BYTES: usize = 1 << 20;

/// The regular files at `rel` under `root` (itself, or every file below a
/// directory), as paths relative to `root`. Symbolic links are refused:
/// what is shipped stays inside the environment directory.
fn collect_files(
    root: &std::path::Path,
    rel: &std::path::Path,
    out: &mut Vec<std::path::PathBuf>,
) -> Result<(), String> {
    let path = root.join(rel);
    let meta =
        std::fs::symlink_metadata(&path).map_err(|e| format!("files: {}: {e}", path.display()))?;
    if meta.is_file() {
        out.push(rel.to_path_buf());
    } else if meta.is_dir() {
        let mut entries: Vec<_> = std::fs::read_dir(&path)
            .map_err(|e| format!("files: {}: {e}", path.display()))?
            .map(|e| e.map(|e| e.file_name()))
            .collect::<Result<_, _>>()
            .map_err(|e| format!("files: {}: {e}", path.display()))?;
        entries.sort();
        for name in entries {
            collect_files(root, &rel.join(name), out)?;
        }
    } else {
        return Err(format!(
            "files: {} is not a regular file or directory",
            path.display()
        ));
    }
    Ok(())
}

/// Where a reward program runs.
enum Runner {
    /// A local process, started once.
    Process(Arc<crate::external::Conn>),
    /// One sandbox run per group.
    Sandbox {
        sandbox: crate::SandboxService,
        code: String,
        files: BTreeMap<String, String>,
        /// `[sandbox] requirements`.
        requirements: Vec<String>,
    },
}

/// One rollout's answer: a number or `{reward, metrics}`.
fn program_score(v: &Value) -> Result<(f64, BTreeMap<String, f64>), String> {
    if let Some(x) = v.as_f64() {
        return Ok((x, BTreeMap::new()));
    }
    let reward = v["reward"].as_f64().ok_or_else(|| {
        format!(
            "a score needs a numeric `reward`, got {}",
            clip(&v.to_string())
        )
    })?;
    let mut metrics = BTreeMap::new();
    if let Some(m) = v.get("metrics").and_then(Value::as_object) {
        for (k, x) in m {
            let x = x
                .as_f64()
                .ok_or_else(|| format!("metric `{k}` is not a number: {x}"))?;
            metrics.insert(k.clone(), x);
        }
    }
    Ok((reward, metrics))
}

fn clip(s: &str) -> String {
    s.chars().take(300).collect()
}

/// `json_fields` arguments.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JsonFieldsConfig {
    /// Fields to compare (dotted paths reach nested objects), with a
    /// weight each; a list gives each weight 1; default: every field of
    /// the reference object.
    #[serde(default)]
    pub fields: Option<FieldWeights>,
    /// Compare strings trimmed, case-folded and with runs of whitespace as
    /// one space, and numbers (or numeric strings) by value (default true).
    #[serde(default = "yes")]
    pub normalize: bool,
    /// Relative tolerance for numbers (default 1e-6).
    #[serde(default = "default_tolerance")]
    pub tolerance: f64,
}

fn yes() -> bool {
    true
}

fn default_tolerance() -> f64 {
    1e-6
}

/// `fields` of [`JsonFieldsConfig`].
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum FieldWeights {
    /// Names, weight 1 each.
    Names(Vec<String>),
    /// Name → weight.
    Weighted(BTreeMap<String, f64>),
}

/// The weighted fraction of fields of the reference JSON object (`answer`)
/// that the parsed answer's object matches, in [0, 1]. A fenced or
/// surrounded object (```json … ```) is found by its outer braces; an
/// answer that is no JSON object scores 0.
pub fn json_fields_score(got: Option<&str>, want: Option<&str>, cfg: &JsonFieldsConfig) -> f64 {
    let object = |s: &str| -> Option<Value> {
        let (a, b) = (s.find('{')?, s.rfind('}')?);
        serde_json::from_str::<Value>(s.get(a..=b)?)
            .ok()
            .filter(Value::is_object)
    };
    let (Some(got), Some(want)) = (got.and_then(object), want.and_then(object)) else {
        return 0.0;
    };
    let fields: Vec<(String, f64)> = match &cfg.fields {
        Some(FieldWeights::Names(n)) => n.iter().map(|f| (f.clone(), 1.0)).collect(),
        Some(FieldWeights::Weighted(m)) => m.iter().map(|(f, w)| (f.clone(), *w)).collect(),
        None => want
            .as_object()
            .map(|o| o.keys().map(|k| (k.clone(), 1.0)).collect())
            .unwrap_or_default(),
    };
    let total: f64 = fields.iter().map(|(_, w)| w.abs()).sum();
    if total <= 0.0 {
        return 0.0;
    }
    let at = |v: &Value, path: &str| -> Option<Value> {
        path.split('.')
            .try_fold(v, |cur, key| cur.get(key))
            .cloned()
    };
    let matched: f64 = fields
        .iter()
        .filter(|(f, _)| match (at(&got, f), at(&want, f)) {
            (Some(g), Some(w)) => json_equal(&g, &w, cfg),
            _ => false,
        })
        .map(|(_, w)| w.abs())
        .sum();
    matched / total
}

fn json_equal(a: &Value, b: &Value, cfg: &JsonFieldsConfig) -> bool {
    if !cfg.normalize {
        return a == b;
    }
    let number = |v: &Value| match v {
        Value::Number(n) => n.as_f64(),
        Value::String(s) => s.trim().replace(',', "").parse::<f64>().ok(),
        _ => None,
    };
    let text = |s: &str| {
        s.split_whitespace()
            .collect::<Vec<_>>()
            .join(" ")
            .to_lowercase()
    };
    match (a, b) {
        (Value::Array(x), Value::Array(y)) => {
            x.len() == y.len() && x.iter().zip(y).all(|(p, q)| json_equal(p, q, cfg))
        }
        (Value::Object(x), Value::Object(y)) => {
            x.len() == y.len()
                && x.iter()
                    .all(|(k, v)| y.get(k).is_some_and(|w| json_equal(v, w, cfg)))
        }
        (Value::String(x), Value::String(y)) if number(a).is_none() || number(b).is_none() => {
            text(x) == text(y)
        }
        _ => match (number(a), number(b)) {
            (Some(x), Some(y)) => (x - y).abs() <= cfg.tolerance * y.abs().max(1.0),
            _ => a == b,
        },
    }
}

/// `regex_extract` arguments.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RegexExtractConfig {
    /// The pattern; the value is its group `answer`, else group 1, else the
    /// whole match.
    pub pattern: String,
    /// `exact` (trimmed; case-folded unless `case_sensitive`), `numeric`
    /// or `math` (as `math_equiv`). Default `exact`.
    #[serde(default)]
    pub compare: Option<String>,
    /// Use the first match instead of the last.
    #[serde(default)]
    pub first: bool,
    /// For `exact`.
    #[serde(default)]
    pub case_sensitive: bool,
}

/// A checked [`RegexExtractConfig`].
#[derive(Debug, Clone)]
pub struct RegexExtract {
    re: regex::Regex,
    compare: Compare,
    first: bool,
    case_sensitive: bool,
}

#[derive(Debug, Clone, Copy)]
enum Compare {
    Exact,
    Numeric,
    Math,
}

impl RegexExtract {
    /// Compile the pattern and check `compare`.
    pub fn new(cfg: RegexExtractConfig) -> Result<Self, String> {
        let re = regex::Regex::new(&cfg.pattern).map_err(|e| format!("regex_extract: {e}"))?;
        let compare = match cfg.compare.as_deref() {
            None | Some("exact") => Compare::Exact,
            Some("numeric") => Compare::Numeric,
            Some("math") => Compare::Math,
            Some(other) => {
                return Err(format!(
                    "regex_extract: compare `{other}` (use exact, numeric or math)"
                ))
            }
        };
        Ok(RegexExtract {
            re,
            compare,
            first: cfg.first,
            case_sensitive: cfg.case_sensitive,
        })
    }

    /// The captured value in `text`.
    pub fn extract(&self, text: &str) -> Option<String> {
        let mut caps = self.re.captures_iter(text);
        let c = if self.first { caps.next() } else { caps.last() }?;
        c.name("answer")
            .or_else(|| c.get(1))
            .or_else(|| c.get(0))
            .map(|m| m.as_str().trim().to_string())
    }

    /// Whether `got` equals the reference `want` under `compare`.
    pub fn same(&self, got: &str, want: &str) -> bool {
        match self.compare {
            Compare::Exact if self.case_sensitive => got.trim() == want.trim(),
            Compare::Exact => got.trim().to_lowercase() == want.trim().to_lowercase(),
            Compare::Numeric => match (
                math::parse_number_literal(got),
                math::parse_number_literal(want),
            ) {
                (Some(a), Some(b)) => (a - b).abs() < 1e-9,
                _ => false,
            },
            Compare::Math => math::math_equal(got, want),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn builtin(text: &str) -> Reward {
        let spec: RewardSpec = toml::from_str(text).unwrap();
        Reward::from_spec(&spec).unwrap()
    }

    /// Issue 39: the maximum a rubric can give, which `pass_threshold`
    /// falls back to when it exceeds 1.
    #[test]
    fn max_reward_sums_positive_weights_of_bounded_functions() {
        let answer = || builtin("function = \"exact_match\"\nweight = 1.0");
        let format = || builtin("function = \"format\"\nweight = 0.5");
        let penalty =
            || builtin("function = \"length_penalty\"\nweight = 2.0\nargs = { max_chars = 10 }");
        let r = Rubric::new(Parser::Plain).with(answer()).with(format());
        assert_eq!(r.max_reward(), Some(1.5));
        // A penalty (≤ 0) and a metric-only entry add nothing.
        let metric = builtin("function = \"contains\"\nweight = 0.0");
        let r = r.with(penalty()).with(metric);
        assert_eq!(r.max_reward(), Some(1.5));
        // Normalized: Σ w·max / Σ |w| = 1.5 / 3.5.
        let mut n = Rubric::new(Parser::Plain)
            .with(answer())
            .with(format())
            .with(penalty());
        n.normalize = true;
        assert_eq!(n.max_reward(), Some(1.5 / 3.5));
        // A function of unknown range makes the maximum unknown.
        let custom = Reward::new("custom", 1.0, |_| 3.0);
        assert_eq!(Rubric::new(Parser::Plain).with(custom).max_reward(), None);
        let custom0 = Reward::new("custom", 0.0, |_| 3.0);
        assert_eq!(
            Rubric::new(Parser::Plain)
                .with(answer())
                .with(custom0)
                .max_reward(),
            Some(1.0)
        );
    }
}
