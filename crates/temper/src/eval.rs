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
    /// A built-in environment, a directory with env.toml, a command, or a
    /// hub reference (`owner/name`, `owner/name@1.2`), pulled into the cache.
    #[arg(required_unless_present = "resume")]
    env: Option<String>,
    /// Environment arguments as JSON (`{"digits": 2}`).
    #[arg(short = 'a', long = "env-args")]
    env_args: Option<String>,
    /// Model name.
    #[arg(short = 'm', long, default_value = "default")]
    model: String,
    /// OpenAI-compatible base URL.
    #[arg(
        short = 'b',
        long = "base-url",
        default_value = "http://127.0.0.1:8000/v1"
    )]
    base_url: String,
    /// Environment variable holding the API key.
    #[arg(short = 'k', long = "api-key-var")]
    api_key_var: Option<String>,
    /// Examples (default: the environment's).
    #[arg(short = 'n', long = "num-examples")]
    num_examples: Option<usize>,
    /// Which rows: `eval` (held out) or `train` (e.g. to sample a teacher
    /// on training questions for `temper generate-sft`).
    #[arg(long, value_parser = parse_split, default_value = "eval")]
    split: Split,
    /// Rollouts per example (default: the environment's).
    #[arg(short = 'r', long = "rollouts-per-example")]
    rollouts: Option<usize>,
    /// Most model calls in flight.
    #[arg(short = 'c', long = "max-concurrent", default_value_t = 32)]
    concurrency: usize,
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
    /// Where runs go: DIR/{env}--{model}/{run_id}.
    #[arg(long = "save-dir", default_value = "outputs/evals")]
    save_dir: PathBuf,
    /// Continue the run in this directory (its metadata.json has the rest).
    #[arg(short = 'R', long)]
    resume: Option<PathBuf>,
    /// Seed of the eval rows.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Per-request timeout, seconds.
    #[arg(long, default_value_t = 600.0)]
    timeout: f64,
    /// Retries per request.
    #[arg(long = "max-retries", default_value_t = 6)]
    max_retries: u32,
    /// A rollout passes (pass@k) at reward ≥ this.
    #[arg(long = "pass-threshold", default_value_t = 1.0)]
    pass_threshold: f64,
    /// No progress bar.
    #[arg(long)]
    quiet: bool,
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
    let rt = tokio::runtime::Runtime::new()?;
    let (env, cfg) = match &a.resume {
        Some(dir) => {
            let m = read_metadata(dir).with_context(|| format!("resume {}", dir.display()))?;
            let (load, env_package) =
                crate::hub_cmd::resolve_env(&m.env_spec, m.env_package.as_ref())?;
            let env = temper_env::load_environment(&load, &m.env_args)?;
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
                request_timeout: Duration::from_secs_f64(a.timeout.max(0.001)),
                retry: RetryPolicy {
                    max_retries: a.max_retries,
                    ..RetryPolicy::default()
                },
                pass_threshold: m.pass_threshold,
                resume: true,
                progress: !a.quiet,
            };
            (env, cfg)
        }
        None => {
            let spec = a.env.clone().context("ENV is required")?;
            let env_args = json_arg("--env-args", &a.env_args)?;
            let (load, env_package) = crate::hub_cmd::resolve_env(&spec, None)?;
            let env = temper_env::load_environment(&load, &env_args)?;
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
            if a.concurrency == 0 {
                bail!("--max-concurrent must be at least 1");
            }
            let cfg = EvalConfig {
                run_dir: default_run_dir(&a.save_dir, env.id(), &a.model),
                env_spec: spec,
                env_args,
                env_package,
                model: a.model.clone(),
                base_url: a.base_url.clone(),
                api_key,
                api_key_env: a.api_key_var.clone(),
                num_examples: a.num_examples.unwrap_or(d.num_examples),
                split: a.split,
                rollouts_per_example: a.rollouts.unwrap_or(d.rollouts_per_example).max(1),
                max_concurrent: a.concurrency,
                sampling,
                seed: a.seed,
                request_timeout: Duration::from_secs_f64(a.timeout.max(0.001)),
                retry: RetryPolicy {
                    max_retries: a.max_retries,
                    ..RetryPolicy::default()
                },
                pass_threshold: a.pass_threshold,
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
