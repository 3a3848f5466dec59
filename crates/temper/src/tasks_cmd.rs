//! `temper tasks`: run Harbor-format tasks in temper's sandbox (`run`,
//! `resume`), the exec helper for `command` agents (`exec`), and
//! `temper bench tasks` (trial overhead and throughput).

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::{Args, Subcommand};
use temper_tasks::job::{job_results, AgentSpec};
use temper_tasks::{
    build_agent, discover, load_job, plan_job, run_job, summary_table, JobConfig, TrialResult,
};

/// `temper tasks` subcommands.
#[derive(Subcommand)]
pub enum TasksCommand {
    /// Run tasks (task dirs, or dirs of task dirs) into a new job directory.
    Run(Box<RunArgs>),
    /// Finish a job that was killed: runs only its trials without a result.
    Resume(ResumeArgs),
    /// Run a command in the current trial's sandbox (for `command` agents:
    /// reads TEMPER_EXEC_URL and TEMPER_EXEC_TOKEN).
    Exec(ExecArgs),
}

/// Agent flags shared by `run`.
#[derive(Args)]
pub struct RunArgs {
    /// Task directories, or directories holding task directories.
    #[arg(required = true)]
    paths: Vec<PathBuf>,
    /// oracle, nop, terminal or command.
    #[arg(short = 'a', long)]
    agent: String,
    /// Model name (terminal, command).
    #[arg(short = 'm', long)]
    model: Option<String>,
    /// OpenAI-compatible base URL (terminal, command), e.g. http://127.0.0.1:8000/v1.
    #[arg(short = 'b', long = "base-url")]
    base_url: Option<String>,
    /// Environment variable holding the endpoint's API key (never stored).
    #[arg(short = 'k', long = "api-key-var")]
    api_key_var: Option<String>,
    /// Trials per task.
    #[arg(short = 'n', long = "trials", default_value_t = 1)]
    trials: u32,
    /// Trials run at once.
    #[arg(short = 'c', long = "concurrency", default_value_t = 4)]
    concurrency: usize,
    /// Where job directories go.
    #[arg(long, default_value = "jobs")]
    jobs_dir: PathBuf,
    /// Job directory name [default: the start time].
    #[arg(long)]
    job_name: Option<String>,
    /// The `command` agent's program (a shell command line).
    #[arg(long = "agent-command")]
    agent_command: Option<String>,
    /// terminal: most model turns [default: 30].
    #[arg(long)]
    max_turns: Option<u32>,
    /// terminal: most prompt + completion tokens per trial.
    #[arg(long)]
    max_total_tokens: Option<u64>,
    /// terminal: completion tokens per turn [default: 1024].
    #[arg(long)]
    max_tokens: Option<usize>,
    /// terminal: sampling temperature [default: 0.7].
    #[arg(long)]
    temperature: Option<f64>,
    /// terminal, command: record every model call at the token level on the
    /// `temper serve` at --base-url (a fresh episode per trial; records in
    /// each trial's agent/tokens.jsonl).
    #[arg(long)]
    capture: bool,
    /// Multiply every task's [agent] timeout_sec.
    #[arg(long)]
    agent_timeout_multiplier: Option<f64>,
    /// Let tasks with `allow_internet = true` (Harbor's default) share the
    /// host's network; without it every trial has loopback only.
    #[arg(long)]
    allow_internet: bool,
}

/// `temper tasks resume` flags.
#[derive(Args)]
pub struct ResumeArgs {
    /// The job directory (jobs/<name>).
    job_dir: PathBuf,
    /// Environment variable holding the endpoint's API key.
    #[arg(short = 'k', long = "api-key-var")]
    api_key_var: Option<String>,
}

/// `temper tasks exec` flags.
#[derive(Args)]
pub struct ExecArgs {
    /// Seconds before the command is killed.
    #[arg(long, default_value_t = 120.0)]
    timeout: f64,
    /// The command (run with bash in the trial's workdir).
    #[arg(required = true, trailing_var_arg = true)]
    command: Vec<String>,
}

/// Run `temper tasks`.
pub fn run(cmd: TasksCommand) -> Result<()> {
    match cmd {
        TasksCommand::Run(a) => run_tasks(*a),
        TasksCommand::Resume(a) => resume(a),
        TasksCommand::Exec(a) => exec(a),
    }
}

fn api_key(var: Option<&str>) -> Result<Option<String>> {
    match var {
        Some(v) => Ok(Some(
            std::env::var(v).with_context(|| format!("${v} is not set"))?,
        )),
        None => Ok(None),
    }
}

fn runtime() -> Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("start the async runtime")
}

fn run_tasks(a: RunArgs) -> Result<()> {
    let tasks = discover(&a.paths)?;
    let spec = AgentSpec {
        name: a.agent.clone(),
        model: a.model.clone(),
        base_url: a.base_url.clone(),
        command: a.agent_command.clone(),
        max_turns: a.max_turns,
        max_total_tokens: a.max_total_tokens,
        max_tokens_per_turn: a.max_tokens,
        temperature: a.temperature,
        capture: a.capture,
    };
    if a.capture && !matches!(a.agent.as_str(), "terminal" | "command") {
        bail!("--capture needs a model-backed agent (-a terminal or -a command)");
    }
    let key = api_key(a.api_key_var.as_deref())?;
    let rt = runtime()?;
    // Build the agent first: a bad flag fails before a job dir exists.
    let agent = build_agent(&spec, key, rt.handle())?;
    let (dir, mut config) = plan_job(
        &tasks,
        spec,
        a.trials,
        a.concurrency,
        &a.jobs_dir,
        a.job_name.clone(),
    )?;
    if let Some(m) = a.agent_timeout_multiplier {
        if !(m.is_finite() && m > 0.0) {
            bail!("--agent-timeout-multiplier must be > 0");
        }
        config.agent_timeout_multiplier = Some(m);
    }
    config.environment.kwargs.allow_internet = a.allow_internet;
    temper_tasks::job::save_config(&dir, &config)?;
    eprintln!(
        "job {}: {} tasks x {} trials, agent {}, {} at a time",
        dir.display(),
        tasks.len(),
        a.trials,
        a.agent,
        a.concurrency
    );
    finish(&dir, &config, agent.as_ref())
}

fn resume(a: ResumeArgs) -> Result<()> {
    let config = load_job(&a.job_dir)?;
    let key = api_key(a.api_key_var.as_deref())?;
    let rt = runtime()?;
    let agent = build_agent(&config.agent, key, rt.handle())?;
    let left = config
        .trials
        .iter()
        .filter(|t| temper_tasks::job::read_result(&a.job_dir.join(&t.trial_name)).is_none())
        .count();
    eprintln!(
        "job {}: {left} of {} trials left to run",
        a.job_dir.display(),
        config.trials.len()
    );
    finish(&a.job_dir, &config, agent.as_ref())
}

fn progress_line(r: &TrialResult, done: usize, total: usize) {
    let err = r
        .exception_info
        .as_ref()
        .map(|e| format!("  {}", e.exception_type))
        .unwrap_or_default();
    eprintln!(
        "[{done}/{total}] {}  reward {:.3}{err}",
        r.trial_name,
        r.reward()
    );
}

fn finish(dir: &Path, config: &JobConfig, agent: &dyn temper_tasks::Agent) -> Result<()> {
    let t0 = Instant::now();
    let job = run_job(dir, config, agent, &progress_line)?;
    let results = job_results(dir, config);
    println!("{}", summary_table(config, &results));
    println!(
        "job        {}  ({} trials, {} resumed, {} errors, {:.1} s)",
        dir.display(),
        job.stats.n_completed_trials,
        job.stats.n_resumed,
        job.stats.n_errored_trials,
        t0.elapsed().as_secs_f64()
    );
    Ok(())
}

fn exec(a: ExecArgs) -> Result<()> {
    let url = std::env::var("TEMPER_EXEC_URL")
        .context("$TEMPER_EXEC_URL is not set (run me from a `command` agent)")?;
    let token = std::env::var("TEMPER_EXEC_TOKEN").context("$TEMPER_EXEC_TOKEN is not set")?;
    let body = serde_json::json!({"command": a.command.join(" "), "timeout_sec": a.timeout});
    let rt = runtime()?;
    let v: serde_json::Value = rt.block_on(async {
        let resp = reqwest::Client::new()
            .post(&url)
            .bearer_auth(token)
            .json(&body)
            .send()
            .await?
            .error_for_status()?;
        resp.json().await
    })?;
    print!("{}", v["stdout"].as_str().unwrap_or_default());
    eprint!("{}", v["stderr"].as_str().unwrap_or_default());
    std::io::stdout().flush().ok();
    match v["exit_code"].as_i64() {
        Some(0) => Ok(()),
        Some(code) => std::process::exit(i32::try_from(code).unwrap_or(1)),
        None => bail!("the command did not finish: {}", v["status"]),
    }
}

/// `temper bench tasks` flags.
#[derive(Args)]
pub struct BenchTasksArgs {
    /// Trials in all.
    #[arg(long, default_value_t = 64)]
    trials: u32,
    /// Trials at once.
    #[arg(short = 'c', long, default_value_t = 16)]
    concurrency: usize,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    json: bool,
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let i = ((sorted.len() - 1) as f64 * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

/// `temper bench tasks`: a trivial task (the oracle writes a file, the
/// verifier checks it) run `trials` times, `concurrency` at once, with the
/// oracle; reports sandbox-session-ready → verifier-done per trial
/// (p50/p99), session start, and trials/s for the whole job.
pub fn bench(a: BenchTasksArgs) -> Result<()> {
    let root = tempfile::tempdir().context("tempdir")?;
    let task = root.path().join("trivial");
    for d in ["environment", "tests", "solution"] {
        std::fs::create_dir_all(task.join(d))?;
    }
    std::fs::write(task.join("instruction.md"), "Write ok to /app/ok.txt\n")?;
    std::fs::write(
        task.join("task.toml"),
        "version = \"1.0\"\n[environment]\nallow_internet = false\nmemory_mb = 256\n",
    )?;
    std::fs::write(
        task.join("environment/Dockerfile"),
        "FROM x\nWORKDIR /app\n",
    )?;
    std::fs::write(task.join("solution/solve.sh"), "echo ok > /app/ok.txt\n")?;
    std::fs::write(
        task.join("tests/test.sh"),
        "if [ \"$(cat /app/ok.txt)\" = ok ]; then echo 1; else echo 0; fi > /logs/verifier/reward.txt\n",
    )?;
    let tasks = discover(&[task])?;
    let spec = AgentSpec {
        name: "oracle".into(),
        ..AgentSpec::default()
    };
    let rt = runtime()?;
    let agent = build_agent(&spec, None, rt.handle())?;
    let (dir, config) = plan_job(
        &tasks,
        spec,
        a.trials,
        a.concurrency,
        &root.path().join("jobs"),
        Some("bench".into()),
    )?;
    let t0 = Instant::now();
    let job = run_job(&dir, &config, agent.as_ref(), &|_, _, _| {})?;
    let wall = t0.elapsed().as_secs_f64();
    let results = job_results(&dir, &config);
    let ok = results.iter().filter(|r| r.reward() == 1.0).count();
    if ok != results.len() || job.stats.n_errored_trials > 0 {
        bail!(
            "{} of {} trials did not score 1: {:?}",
            results.len() - ok,
            results.len(),
            job.stats.exceptions()
        );
    }
    let mut overhead: Vec<f64> = results
        .iter()
        .filter_map(|r| r.temper.session_to_verified_ms)
        .collect();
    overhead.sort_by(f64::total_cmp);
    let mut start: Vec<f64> = results
        .iter()
        .filter_map(|r| r.temper.session_start_ms)
        .collect();
    start.sort_by(f64::total_cmp);
    let rate = results.len() as f64 / wall;
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    if a.json {
        println!(
            "{}",
            serde_json::json!({
                "trials": results.len(), "concurrency": a.concurrency, "cores": cores,
                "ready_to_verified_ms": {"p50": percentile(&overhead, 0.5), "p99": percentile(&overhead, 0.99)},
                "session_start_ms": {"p50": percentile(&start, 0.5), "p99": percentile(&start, 0.99)},
                "trials_per_s": rate, "wall_s": wall,
            })
        );
    } else {
        println!(
            "trivial task, oracle agent: {} trials, {} at once, {cores} cores",
            results.len(),
            a.concurrency
        );
        println!(
            "session ready -> verifier done   p50 {:>8.1} ms   p99 {:>8.1} ms",
            percentile(&overhead, 0.5),
            percentile(&overhead, 0.99)
        );
        println!(
            "sandbox session start            p50 {:>8.1} ms   p99 {:>8.1} ms",
            percentile(&start, 0.5),
            percentile(&start, 0.99)
        );
        println!("throughput                       {rate:.1} trials/s ({wall:.2} s wall)");
    }
    Ok(())
}
