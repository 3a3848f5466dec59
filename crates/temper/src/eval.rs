//! `temper eval`: run an environment against an OpenAI-compatible
//! endpoint; and the hidden `temper mock-openai` used by tests and the
//! orchestration benchmark.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::Args;
use serde_json::Value;
use temper_env::Split;
use temper_eval::report::{summarize, summary_table};
use temper_eval::results::{read_metadata, read_results};
use temper_eval::{default_run_dir, run_eval, EvalConfig, RetryPolicy};

/// `temper eval` flags (verifiers' short flags).
#[derive(Args)]
pub struct EvalArgs {
    /// A built-in environment, a directory with env.toml, a Harbor task
    /// directory or a directory of them (agent and budgets in --env-args:
    /// `{"agent": "oracle"}`), a command, or a hub reference (`owner/name`,
    /// `owner/name@1.2`), pulled into the cache.
    #[arg(required_unless_present_any = ["resume", "config"])]
    env: Option<String>,
    /// A TOML file of these flags (long names, `_` for `-`: `env`,
    /// `model`, `base_url`, `num_examples`, `rollouts_per_example`,
    /// `sampling_args = {...}`, ...); flags on the command line win.
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
    /// Environment arguments as JSON (`{"digits": 2}`).
    #[arg(short = 'a', long = "env-args")]
    env_args: Option<String>,
    /// Model name (default: the endpoint's only model, from GET /models).
    #[arg(short = 'm', long)]
    model: Option<String>,
    /// OpenAI-compatible base URL [default: http://127.0.0.1:8000/v1].
    #[arg(short = 'b', long = "base-url")]
    base_url: Option<String>,
    /// Environment variable holding the API key.
    #[arg(short = 'k', long = "api-key-var")]
    api_key_var: Option<String>,
    /// Examples (default: the environment's).
    #[arg(short = 'n', long = "num-examples")]
    num_examples: Option<usize>,
    /// Which rows: `eval` (held out) or `train` (e.g. to sample a teacher
    /// on training questions for `temper generate-sft`).
    #[arg(long, value_parser = parse_split)]
    split: Option<Split>,
    /// Rollouts per example (default: the environment's).
    #[arg(short = 'r', long = "rollouts-per-example")]
    rollouts: Option<usize>,
    /// Most model calls in flight [default: 32].
    #[arg(short = 'c', long = "max-concurrent")]
    concurrency: Option<usize>,
    /// Completion tokens per call (default: the environment's).
    #[arg(short = 't', long = "max-tokens")]
    max_tokens: Option<usize>,
    /// Temperature (default: the environment's).
    #[arg(short = 'T', long)]
    temperature: Option<f64>,
    /// More sampling arguments: JSON (`{"top_p": 0.9, "min_p": 0.05}`) or
    /// `key=value` (`-S min_p=0.05 -S logit_bias='{"42": -100}'`);
    /// repeatable, later ones win.
    #[arg(short = 'S', long = "sampling-args")]
    sampling_args: Vec<String>,
    /// Where runs go: DIR/{env}--{model}/{run_id} [default: outputs/evals].
    #[arg(long = "save-dir")]
    save_dir: Option<PathBuf>,
    /// Continue the run in this directory (its metadata.json has the rest).
    #[arg(short = 'R', long)]
    resume: Option<PathBuf>,
    /// Seed of the eval rows [default: 0].
    #[arg(long)]
    seed: Option<u64>,
    /// Per-request timeout, seconds [default: 600].
    #[arg(long)]
    timeout: Option<f64>,
    /// Retries per request [default: 6].
    #[arg(long = "max-retries")]
    max_retries: Option<u32>,
    /// A rollout passes (pass@k) at reward ≥ this [default: the
    /// environment's `[eval] pass_threshold`, else 1, or the rubric's
    /// maximum when that exceeds 1].
    #[arg(long = "pass-threshold")]
    pass_threshold: Option<f64>,
    /// No progress bar.
    #[arg(long)]
    quiet: bool,
}

/// `temper eval --config FILE`: the flags as TOML keys. Paths in it are
/// relative to the working directory, as in the train configs.
#[derive(Default, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct EvalFile {
    env: Option<String>,
    env_args: Option<Value>,
    model: Option<String>,
    base_url: Option<String>,
    api_key_var: Option<String>,
    num_examples: Option<usize>,
    split: Option<String>,
    rollouts_per_example: Option<usize>,
    max_concurrent: Option<usize>,
    max_tokens: Option<usize>,
    temperature: Option<f64>,
    sampling_args: Option<Value>,
    save_dir: Option<PathBuf>,
    seed: Option<u64>,
    timeout: Option<f64>,
    max_retries: Option<u32>,
    pass_threshold: Option<f64>,
}

impl EvalArgs {
    /// Fill what the command line left unset from `--config`.
    fn with_config(mut self) -> Result<Self> {
        let Some(path) = self.config.clone() else {
            return Ok(self);
        };
        let text =
            std::fs::read_to_string(&path).with_context(|| format!("read {}", path.display()))?;
        let f: EvalFile = toml::from_str(&text).with_context(|| format!("{}", path.display()))?;
        let json = |what: &str, v: Option<Value>| -> Result<Option<String>> {
            match v {
                None => Ok(None),
                Some(v @ Value::Object(_)) => Ok(Some(v.to_string())),
                Some(other) => bail!("{}: {what} must be a table, got {other}", path.display()),
            }
        };
        self.env = self.env.or(f.env);
        self.env_args = self.env_args.or(json("env_args", f.env_args)?);
        self.model = self.model.or(f.model);
        self.base_url = self.base_url.or(f.base_url);
        self.api_key_var = self.api_key_var.or(f.api_key_var);
        self.num_examples = self.num_examples.or(f.num_examples);
        if self.split.is_none() {
            self.split = f
                .split
                .as_deref()
                .map(parse_split)
                .transpose()
                .map_err(|e| anyhow::anyhow!("{}: split {e}", path.display()))?;
        }
        self.rollouts = self.rollouts.or(f.rollouts_per_example);
        self.concurrency = self.concurrency.or(f.max_concurrent);
        self.max_tokens = self.max_tokens.or(f.max_tokens);
        self.temperature = self.temperature.or(f.temperature);
        // The file's sampling arguments first: later -S arguments win.
        if let Some(s) = json("sampling_args", f.sampling_args)? {
            self.sampling_args.insert(0, s);
        }
        self.save_dir = self.save_dir.or(f.save_dir);
        self.seed = self.seed.or(f.seed);
        self.timeout = self.timeout.or(f.timeout);
        self.max_retries = self.max_retries.or(f.max_retries);
        self.pass_threshold = self.pass_threshold.or(f.pass_threshold);
        Ok(self)
    }
}

fn parse_split(s: &str) -> std::result::Result<Split, String> {
    match s {
        "eval" => Ok(Split::Eval),
        "train" => Ok(Split::Train),
        other => Err(format!("{other:?}: use train or eval")),
    }
}

fn json_arg(flag: &str, s: &Option<String>) -> Result<Value> {
    match s {
        Some(s) => serde_json::from_str(s).with_context(|| format!("{flag} is not JSON")),
        None => Ok(Value::Object(Default::default())),
    }
}

/// One `-S` argument: a JSON object, or `key=value` with the value read
/// as JSON when it parses (numbers, lists, objects) and as a string if not.
fn sampling_arg(arg: &str) -> Result<serde_json::Map<String, Value>> {
    let t = arg.trim();
    if t.starts_with('{') {
        return match serde_json::from_str(t) {
            Ok(Value::Object(m)) => Ok(m),
            _ => bail!("-S {arg:?} is not a JSON object"),
        };
    }
    let Some((k, v)) = t.split_once('=') else {
        bail!("-S {arg:?}: use key=value or a JSON object");
    };
    let k = k.trim();
    if k.is_empty() {
        bail!("-S {arg:?}: the key is empty");
    }
    let v = serde_json::from_str(v.trim()).unwrap_or_else(|_| Value::String(v.to_string()));
    Ok(std::iter::once((k.to_string(), v)).collect())
}

/// Run `temper eval`.
pub fn run(a: EvalArgs) -> Result<()> {
    let a = a.with_config()?;
    let rt = tokio::runtime::Runtime::new()?;
    let timeout = Duration::from_secs_f64(a.timeout.unwrap_or(600.0).max(0.001));
    let retry = RetryPolicy {
        max_retries: a.max_retries.unwrap_or(6),
        ..RetryPolicy::default()
    };
    let (env, cfg) = match &a.resume {
        Some(dir) => {
            let m = read_metadata(dir).with_context(|| format!("resume {}", dir.display()))?;
            let (load, env_package) =
                crate::hub_cmd::resolve_env(&m.env_spec, m.env_package.as_ref())?;
            let env = temper_tasks::loader().load(&load, &m.env_args)?;
            let api_key = match &m.api_key_env {
                Some(v) => Some(std::env::var(v).with_context(|| format!("${v} is not set"))?),
                None => None,
            };
            let cfg = EvalConfig {
                env_spec: m.env_spec,
                env_args: m.env_args,
                env_package,
                model: m.model,
                base_url: m.base_url,
                api_key,
                api_key_env: m.api_key_env,
                num_examples: m.num_examples,
                split: m.split,
                rollouts_per_example: m.rollouts_per_example,
                max_concurrent: m.max_concurrent,
                sampling: m.sampling_args,
                seed: m.seed,
                run_dir: dir.clone(),
                request_timeout: timeout,
                retry,
                pass_threshold: m.pass_threshold,
                resume: true,
                progress: !a.quiet,
            };
            (env, cfg)
        }
        None => {
            let spec = a
                .env
                .clone()
                .context("ENV is required (an argument or `env` in --config)")?;
            let env_args = json_arg("--env-args", &a.env_args)?;
            let (load, env_package) = crate::hub_cmd::resolve_env(&spec, None)?;
            let env = temper_tasks::loader().load(&load, &env_args)?;
            let d = env.eval_defaults();
            let mut sampling = d.sampling.clone();
            if let Some(t) = a.max_tokens {
                sampling.max_tokens = t;
            }
            if let Some(t) = a.temperature {
                sampling.temperature = t;
            }
            if !a.sampling_args.is_empty() {
                let mut merged = serde_json::to_value(&sampling)?;
                for arg in &a.sampling_args {
                    for (k, v) in sampling_arg(arg)? {
                        merged[k] = v;
                    }
                }
                sampling = serde_json::from_value(merged).context("--sampling-args")?;
            }
            let api_key = match &a.api_key_var {
                Some(v) => Some(std::env::var(v).with_context(|| format!("${v} is not set"))?),
                None => None,
            };
            let concurrency = a.concurrency.unwrap_or(32);
            if concurrency == 0 {
                bail!("--max-concurrent must be at least 1");
            }
            let base_url = a
                .base_url
                .clone()
                .unwrap_or_else(|| "http://127.0.0.1:8000/v1".into());
            let model = match &a.model {
                Some(m) => m.clone(),
                None => {
                    let m = rt.block_on(temper_eval::endpoint_model(
                        &base_url,
                        api_key.clone(),
                        a.api_key_var.as_deref(),
                        timeout,
                    ))?;
                    eprintln!("model: {m} (the endpoint's only model)");
                    m
                }
            };
            let save_dir = a
                .save_dir
                .clone()
                .unwrap_or_else(|| PathBuf::from("outputs/evals"));
            let cfg = EvalConfig {
                run_dir: default_run_dir(&save_dir, env.id(), &model),
                env_spec: spec,
                env_args,
                env_package,
                model,
                base_url,
                api_key,
                api_key_env: a.api_key_var.clone(),
                num_examples: a.num_examples.unwrap_or(d.num_examples),
                split: a.split.unwrap_or(Split::Eval),
                rollouts_per_example: a.rollouts.unwrap_or(d.rollouts_per_example).max(1),
                max_concurrent: concurrency,
                sampling,
                seed: a.seed.unwrap_or(0),
                request_timeout: timeout,
                retry,
                pass_threshold: {
                    let t = temper_env::pass_threshold(a.pass_threshold, &*env);
                    if let Some(n) = &t.notice {
                        eprintln!("note: {n}");
                    }
                    t.value
                },
                resume: false,
                progress: !a.quiet,
            };
            (env, cfg)
        }
    };
    if let Some(w) =
        temper_env::greedy_group_warning(cfg.rollouts_per_example, cfg.sampling.temperature)
    {
        eprintln!("warning: {w}");
    }
    eprintln!("run dir: {}", cfg.run_dir.display());
    let out = rt.block_on(run_eval(env, &cfg))?;
    let lines = read_results(&cfg.run_dir.join("results.jsonl"))?;
    let s = summarize(&lines, out.metadata.pass_threshold);
    println!("{}", summary_table(&out.metadata, &s));
    println!(
        "rollouts/s  {:.1}",
        out.new_rollouts as f64 / out.metadata.time.max(1e-9)
    );
    println!("results    {}", cfg.run_dir.display());
    if s.num_rollouts > 0 && s.num_errors == s.num_rollouts {
        let (first, _) = s.errors.first().cloned().unwrap_or_default();
        bail!(
            "every rollout failed ({} of {}); the most common error: {first}",
            s.num_errors,
            s.num_rollouts
        );
    }
    if s.num_rollouts > 0 && s.num_reward_errors == s.num_rollouts {
        let (first, _) = s.reward_errors.first().cloned().unwrap_or_default();
        bail!(
            "every rollout's reward failed ({} of {}), so the rewards above mean nothing; \
             the most common error: {first}",
            s.num_reward_errors,
            s.num_rollouts
        );
    }
    Ok(())
}

/// `temper mock-openai` flags.
#[derive(Args)]
pub struct MockArgs {
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1:0")]
    addr: String,
    /// Milliseconds before each answer.
    #[arg(long, default_value_t = 0)]
    latency_ms: u64,
    /// Inject faults into half the requests (429, 500, hang, malformed, drop).
    #[arg(long)]
    chaos: bool,
    /// Answer tool-offering requests with a calculate call first.
    #[arg(long)]
    tool_calls: bool,
}

/// Run the mock server; prints `listening on ADDR` when ready.
pub fn mock(a: MockArgs) -> Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    rt.block_on(async move {
        let listener = tokio::net::TcpListener::bind(&a.addr).await?;
        println!("listening on {}", listener.local_addr()?);
        let cfg = temper_eval::mock::MockConfig {
            latency: Duration::from_millis(a.latency_ms),
            faults: if a.chaos {
                temper_eval::mock::Faults::chaos(Duration::from_secs(30))
            } else {
                Default::default()
            },
            tool_calls: a.tool_calls,
            ..Default::default()
        };
        temper_eval::mock::serve(listener, cfg, Default::default()).await?;
        Ok(())
    })
}
