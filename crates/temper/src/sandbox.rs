//! `temper sandbox ...`: run code in the sandbox and check the host.

use std::io::Read;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::{Args, Subcommand, ValueEnum};
use temper_sandbox::service::{app, AppState, Runner, ServiceConfig};
use temper_sandbox::{ExecRequest, Language, Pool, PoolConfig, Sandbox, SandboxConfig};

/// Isolated code execution.
#[derive(Subcommand)]
pub enum SandboxCommand {
    /// Report which isolation layers are active on this host, and why any
    /// is missing.
    Doctor,
    /// Run one program in a fresh sandbox and print its output.
    Run(RunArgs),
    /// Serve the HTTP API: SandboxFusion-compatible `POST /run_code`,
    /// sessions, `GET /health`, `GET /metrics`.
    Serve(ServeArgs),
    /// Latency and throughput of `print(1)`: library (fresh and warm), HTTP,
    /// and two baselines (a `python3 -c` subprocess, `unshare` per run).
    Bench(BenchArgs),
}

/// Arguments of `temper sandbox bench`.
#[derive(Args)]
pub struct BenchArgs {
    /// Sequential runs per path for p50 / p99.
    #[arg(long, default_value_t = 100)]
    runs: usize,
    /// Requests per throughput point.
    #[arg(long, default_value_t = 200)]
    requests: usize,
    /// Warm workers behind the pool and the HTTP service.
    #[arg(long, default_value_t = 4)]
    pool_size: usize,
    /// Concurrency levels for the throughput columns.
    #[arg(long, value_delimiter = ',', default_value = "16,64,256")]
    concurrency: Vec<usize>,
}

/// Arguments of `temper sandbox serve`.
#[derive(Args)]
pub struct ServeArgs {
    /// Address to bind.
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// Port to bind (0 = any free port; the address is printed).
    #[arg(long, default_value_t = 8080)]
    port: u16,
    /// Require `Authorization: Bearer KEY` (or `X-API-Key`) on every route
    /// but /health and /metrics. Visible to `ps` on the host until start-up
    /// scrubs it: prefer --api-key-file or $TEMPER_SANDBOX_API_KEY.
    #[arg(long, conflicts_with = "api_key_file")]
    api_key: Option<String>,
    /// Read the API key from this file (first line, trimmed); default:
    /// the file $TEMPER_SANDBOX_API_KEY_FILE names (what clients read too).
    #[arg(long)]
    api_key_file: Option<PathBuf>,
    /// Warm workers (0 = a fresh sandbox per run); default: one per CPU.
    #[arg(long)]
    pool_size: Option<usize>,
    /// Runs (and session commands) executing at once; default: the pool
    /// size (one per CPU for a cold runner).
    #[arg(long)]
    concurrency: Option<usize>,
    /// Requests waiting for a slot before new ones get 429 + Retry-After.
    #[arg(long, default_value_t = 64)]
    max_queue: usize,
    /// Live sessions at once before `POST /sessions` gets 429.
    #[arg(long, default_value_t = 16)]
    max_sessions: usize,
    /// Per-run memory limit in MiB over all processes of a run (cgroup), and
    /// the most a request may ask for.
    #[arg(long, default_value_t = 1024)]
    memory_mb: u64,
    /// Per-run limit on processes and threads.
    #[arg(long, default_value_t = 64)]
    max_processes: u64,
    /// Where virtualenvs for runs that declare Python `requirements` are
    /// built and cached (default `$XDG_CACHE_HOME/temper/sandbox-venvs`, else
    /// `~/.cache/temper/sandbox-venvs`).
    #[arg(long)]
    venv_dir: Option<PathBuf>,
    /// An extra `pip install` argument for those builds, repeatable (e.g.
    /// `--pip-arg=--no-index --pip-arg=--find-links=/srv/wheels` offline).
    #[arg(long = "pip-arg", allow_hyphen_values = true)]
    pip_args: Vec<String>,
    /// Longest a virtualenv build may take, in seconds.
    #[arg(long, default_value_t = 600)]
    venv_build_timeout: u64,
    /// Refuse runs that declare `requirements` (400) instead of installing
    /// packages from the package index.
    #[arg(long, conflicts_with_all = ["venv_dir", "pip_args"])]
    no_requirements: bool,
    #[command(flatten)]
    conn: crate::conn::ConnArgs,
}

/// The API key from --api-key, --api-key-file, $TEMPER_SANDBOX_API_KEY or
/// the file $TEMPER_SANDBOX_API_KEY_FILE names,
/// scrubbed from this process's argument and environment blocks so neither
/// `ps` nor a sandbox (whose init is a clone of this process) can read it.
fn api_key(args: &mut ServeArgs) -> Result<Option<String>> {
    let env = std::env::var(temper_sandbox::API_KEY_ENV).ok();
    if env.as_deref() == Some("") {
        bail!(
            "${} is set but empty: unset it to serve without a key",
            temper_sandbox::API_KEY_ENV
        );
    }
    let flag = args.api_key.take();
    if flag.as_deref() == Some("") {
        bail!("--api-key is empty");
    }
    let key = if let Some(key) = &flag {
        eprintln!(
            "warning: --api-key is visible to `ps` on the host while the server starts; \
             use --api-key-file or ${}",
            temper_sandbox::API_KEY_ENV
        );
        Some(key.clone())
    } else if let Some(path) = args.api_key_file.clone().or_else(|| {
        // The file the clients' $TEMPER_SANDBOX_API_KEY_FILE names, with the
        // clients' precedence: the key itself wins when both are set.
        env.is_none()
            .then(|| std::env::var_os(temper_env::SANDBOX_KEY_FILE_ENV))
            .flatten()
            .filter(|p| !p.is_empty())
            .map(PathBuf::from)
    }) {
        let text = std::fs::read_to_string(&path)
            .with_context(|| format!("reading the API key from {}", path.display()))?;
        let key = text.lines().next().map(str::trim).unwrap_or("");
        if key.is_empty() {
            bail!("{} holds no API key on its first line", path.display());
        }
        Some(key.to_string())
    } else {
        env.clone()
    };
    if env.is_some() {
        std::env::remove_var(temper_sandbox::API_KEY_ENV);
    }
    // What came in through argv or the environment is still in the
    // process's original blocks (a key from a file never was).
    for secret in flag.iter().chain(env.iter()) {
        temper_sandbox::scrub_from_process(secret).context(
            "scrubbing the API key from the process's arguments and environment \
             (use --api-key-file where /proc/self/mem is not writable)",
        )?;
    }
    Ok(key)
}

#[derive(Clone, Copy, ValueEnum)]
enum Lang {
    Python,
    Bash,
}

/// Arguments of `temper sandbox run`.
#[derive(Args)]
pub struct RunArgs {
    /// Interpreter.
    #[arg(long, value_enum, default_value = "python")]
    language: Lang,
    /// Source file (`-` = standard input); or use `--code`.
    file: Option<PathBuf>,
    /// Source code given inline.
    #[arg(long, short = 'c', conflicts_with = "file")]
    code: Option<String>,
    /// Wall-clock timeout in seconds.
    #[arg(long, default_value_t = 10.0)]
    timeout: f64,
    /// Address-space limit in MiB.
    #[arg(long)]
    memory_mb: Option<u64>,
    /// Run it N times and print latency percentiles instead of output.
    #[arg(long)]
    repeat: Option<usize>,
    /// Run on a warm worker (zygote fork) instead of a fresh sandbox.
    #[arg(long)]
    warm: bool,
}

pub fn run(cmd: SandboxCommand) -> Result<()> {
    let default_sandbox = || Sandbox::new(SandboxConfig::default()).context("building the sandbox");
    match cmd {
        SandboxCommand::Doctor => {
            let layers = temper_sandbox::doctor(&default_sandbox()?);
            for layer in &layers {
                let mark = if layer.active { "ok  " } else { "MISS" };
                println!("[{mark}] {:<32} {}", layer.name, layer.detail);
            }
            let missing = layers.iter().filter(|l| !l.active).count();
            println!(
                "{} of {} layers active",
                layers.len() - missing,
                layers.len()
            );
            Ok(())
        }
        SandboxCommand::Run(args) => run_code(default_sandbox()?, args),
        // Built from its flags (limits), after the API key is scrubbed.
        SandboxCommand::Serve(args) => serve(args),
        SandboxCommand::Bench(args) => bench(default_sandbox()?, args),
    }
}

type Job<'a> = Box<dyn Fn() -> Result<()> + Sync + 'a>;

fn expect_one(stdout: &[u8]) -> Result<()> {
    if stdout != b"1\n" {
        bail!(
            "expected \"1\\n\", got {:?}",
            String::from_utf8_lossy(stdout)
        );
    }
    Ok(())
}

fn bench(sandbox: Sandbox, args: BenchArgs) -> Result<()> {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use temper_sandbox::service::RunCodeRequest;

    let python = sandbox.interpreter(Language::Python)?.exe.clone();
    let sandbox = Arc::new(sandbox);
    let config = PoolConfig {
        size: args.pool_size.max(1),
        ..PoolConfig::default()
    };
    let pool = Arc::new(Pool::new(sandbox.clone(), config)?);
    let req = ExecRequest::new(Language::Python, "print(1)");
    let rt = tokio::runtime::Runtime::new()?;
    let state = AppState::new(Runner::Pool(pool.clone()), None, 1024);
    let addr = rt.block_on(async {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        tokio::spawn(async move { axum::serve(listener, app(state)).await });
        Ok::<_, std::io::Error>(addr)
    })?;
    let http = temper_sandbox::Client::local(format!("http://{addr}"), None)?;
    let rc = RunCodeRequest::new(Language::Python, "print(1)");

    let jobs: Vec<(&str, Job)> = vec![
        (
            "baseline: python3 -c subprocess",
            Box::new(|| {
                let out = std::process::Command::new(&python)
                    .args(["-c", "print(1)"])
                    .output()?;
                expect_one(&out.stdout)
            }),
        ),
        (
            "baseline: unshare -Urnpf per run",
            Box::new(|| {
                let out = std::process::Command::new("unshare")
                    .args(["-Urnpf", "--mount-proc"])
                    .arg(&python)
                    .args(["-c", "print(1)"])
                    .output()?;
                expect_one(&out.stdout)
            }),
        ),
        (
            "library: fresh sandbox",
            Box::new(|| expect_one(sandbox.run(&req)?.stdout.as_bytes())),
        ),
        (
            "library: warm pool",
            Box::new(|| expect_one(pool.run(&req)?.stdout.as_bytes())),
        ),
        (
            "HTTP /run_code: warm pool",
            Box::new(|| {
                let r = rt.block_on(http.run_code(&rc))?;
                let run = r.run_result.context("no run_result")?;
                expect_one(run.stdout.as_bytes())
            }),
        ),
    ];

    print!(
        "{:<34} {:>8} {:>8}",
        "path (python print(1))", "p50 ms", "p99 ms"
    );
    for c in &args.concurrency {
        print!(" {:>10}", format!("exec/s@{c}"));
    }
    println!();
    for (name, job) in &jobs {
        let mut times = Vec::with_capacity(args.runs);
        for _ in 0..args.runs.max(1) {
            let t = Instant::now();
            job()?;
            times.push(t.elapsed());
        }
        times.sort();
        let pct = |p: f64| times[((times.len() - 1) as f64 * p).round() as usize];
        print!(
            "{name:<34} {:>8.2} {:>8.2}",
            pct(0.5).as_secs_f64() * 1e3,
            pct(0.99).as_secs_f64() * 1e3
        );
        for &c in &args.concurrency {
            let next = AtomicUsize::new(0);
            let t = Instant::now();
            std::thread::scope(|s| -> Result<()> {
                let workers: Vec<_> = (0..c.max(1))
                    .map(|_| {
                        s.spawn(|| -> Result<()> {
                            while next.fetch_add(1, Ordering::Relaxed) < args.requests {
                                job()?;
                            }
                            Ok(())
                        })
                    })
                    .collect();
                for w in workers {
                    w.join()
                        .map_err(|_| anyhow::anyhow!("bench thread panicked"))??;
                }
                Ok(())
            })?;
            print!(
                " {:>10.0}",
                args.requests as f64 / t.elapsed().as_secs_f64()
            );
        }
        println!();
    }
    Ok(())
}

fn serve(mut args: ServeArgs) -> Result<()> {
    let api_key = api_key(&mut args)?;
    let mut config = SandboxConfig::default();
    config.limits.memory_mb = args.memory_mb;
    config.limits.max_processes = args.max_processes;
    let venvs = if args.no_requirements {
        None
    } else {
        let root = match &args.venv_dir {
            Some(dir) => dir.clone(),
            None => dirs_cache()?.join("sandbox-venvs"),
        };
        let venv_config = temper_sandbox::VenvConfig {
            root,
            pip_args: args.pip_args.clone(),
            build_timeout: Duration::from_secs(args.venv_build_timeout.max(1)),
        };
        Some(Arc::new(
            temper_sandbox::Venvs::new(venv_config, config.clone())
                .context("setting up virtualenvs for `requirements`")?,
        ))
    };
    let sandbox = Arc::new(Sandbox::new(config).context("building the sandbox")?);
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    let pool_size = args.pool_size.unwrap_or(cpus);
    let runner = if pool_size > 0 {
        let config = PoolConfig {
            size: pool_size,
            ..PoolConfig::default()
        };
        Runner::Pool(Arc::new(
            Pool::new(sandbox, config).context("starting the warm pool")?,
        ))
    } else {
        Runner::Cold(sandbox)
    };
    let service = ServiceConfig {
        api_key,
        concurrency: args
            .concurrency
            .unwrap_or(if pool_size > 0 { pool_size } else { cpus }),
        max_queue: args.max_queue,
        max_sessions: args.max_sessions,
    };
    eprintln!(
        "temper sandbox: {} warm workers, {} concurrent runs, queue {}, {} sessions, API key {}",
        pool_size,
        service.concurrency,
        service.max_queue,
        service.max_sessions,
        if service.api_key.is_some() {
            "required"
        } else {
            "not required"
        }
    );
    let mut state = AppState::with_config(runner, service);
    if let Some(venvs) = venvs {
        state = state.with_venvs(venvs);
    }
    let addr = format!("{}:{}", args.host, args.port);
    crate::conn::runtime()?.block_on(async move {
        // Reclaim expired sessions even when nobody calls the API.
        let sessions = state.sessions().clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_secs(10));
            loop {
                tick.tick().await;
                let sessions = sessions.clone();
                let _ = tokio::task::spawn_blocking(move || sessions.reap()).await;
            }
        });
        crate::conn::serve(app(state), &addr, &args.conn, |local| {
            format!("temper sandbox listening on http://{local}")
        })
        .await
    })
}

fn run_code(sandbox: Sandbox, args: RunArgs) -> Result<()> {
    let code = match (&args.code, &args.file) {
        (Some(code), _) => code.clone(),
        (None, Some(path)) if path.as_os_str() == "-" => {
            let mut s = String::new();
            std::io::stdin().read_to_string(&mut s)?;
            s
        }
        (None, Some(path)) => {
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?
        }
        (None, None) => bail!("give a source file or --code"),
    };
    if !(args.timeout > 0.0 && args.timeout <= 86_400.0) {
        bail!("--timeout must be in (0, 86400] seconds");
    }
    let language = match args.language {
        Lang::Python => Language::Python,
        Lang::Bash => Language::Bash,
    };
    let mut req = ExecRequest::new(language, code);
    req.timeout = Duration::from_secs_f64(args.timeout);
    req.memory_limit_mb = args.memory_mb;

    let runner = if args.warm {
        let config = PoolConfig {
            size: 1,
            ..PoolConfig::default()
        };
        Runner::Pool(Arc::new(Pool::new(Arc::new(sandbox), config)?))
    } else {
        Runner::Cold(Arc::new(sandbox))
    };
    let exec = |req: &ExecRequest| match &runner {
        Runner::Pool(pool) => pool.run(req),
        Runner::Cold(sandbox) => sandbox.run(req),
    };

    if let Some(n) = args.repeat {
        let mut times: Vec<Duration> = (0..n.max(1))
            .map(|_| {
                let t = Instant::now();
                exec(&req).map(|_| t.elapsed())
            })
            .collect::<Result<_, _>>()?;
        times.sort();
        let pct = |p: f64| times[((times.len() - 1) as f64 * p).round() as usize];
        println!(
            "{} runs: p50 {:.2} ms, p99 {:.2} ms, min {:.2} ms",
            times.len(),
            pct(0.5).as_secs_f64() * 1e3,
            pct(0.99).as_secs_f64() * 1e3,
            times[0].as_secs_f64() * 1e3
        );
        return Ok(());
    }
    let out = exec(&req)?;
    print!("{}", out.stdout);
    eprint!("{}", out.stderr);
    eprintln!(
        "[{:?}, return code {:?}, signal {:?}, {:.1} ms{}]",
        out.status,
        out.return_code,
        out.signal,
        out.execution_time.as_secs_f64() * 1e3,
        if out.stdout_truncated || out.stderr_truncated {
            ", output truncated"
        } else {
            ""
        }
    );
    Ok(())
}

/// `$XDG_CACHE_HOME/temper`, else `~/.cache/temper` (as the hub's cache).
fn dirs_cache() -> Result<PathBuf> {
    let base = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
        .context("no cache directory: set --venv-dir, XDG_CACHE_HOME or HOME")?;
    Ok(base.join("temper"))
}
