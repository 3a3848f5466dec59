//! `temper view DIR`: for an eval run or a `temper tasks` job, its summary
//! and a self-contained HTML report beside it (as before); for anything
//! else (a runs directory, a training run), or with `--port`, a live web
//! page of every run under DIR ([`server`]).

mod page;
mod runs;
mod server;

use std::io::Write as _;
use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Args;
use temper_eval::report::{html_report, summarize, summary_table};
use temper_eval::results::{read_metadata, read_results};

/// `temper view` flags.
#[derive(Args)]
pub struct ViewArgs {
    /// A runs directory (served), or one run: an eval run (results.jsonl +
    /// metadata.json) or a `temper tasks run` job (config.json + trial
    /// directories) gets its report written unless `--port` is given; a
    /// training run is served.
    run_dir: PathBuf,
    /// Where to write an eval's or job's HTML (default RUN_DIR/report.html).
    #[arg(short, long)]
    out: Option<PathBuf>,
    /// Serve DIR's runs on this port (0 picks a free one, printed); the
    /// default when DIR is not an eval run or a job is 8765.
    #[arg(long)]
    port: Option<u16>,
    /// Address to bind when serving.
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
}

/// Run `temper view`.
pub fn run(a: ViewArgs) -> Result<()> {
    let kind = runs::kind_of(&a.run_dir);
    let report = matches!(kind, Some(runs::Kind::Eval | runs::Kind::Job));
    if !report || a.port.is_some() {
        return serve(&a);
    }
    let out = a.out.unwrap_or_else(|| a.run_dir.join("report.html"));
    if kind == Some(runs::Kind::Job) {
        let config = temper_tasks::load_job(&a.run_dir)
            .with_context(|| format!("view {}", a.run_dir.display()))?;
        let results = temper_tasks::job::job_results(&a.run_dir, &config);
        println!("{}", temper_tasks::summary_table(&config, &results));
        std::fs::write(&out, temper_tasks::job::html_report(&config, &results))
            .with_context(|| format!("write {}", out.display()))?;
        println!("report     {}", out.display());
        return Ok(());
    }
    let meta =
        read_metadata(&a.run_dir).with_context(|| format!("view {}", a.run_dir.display()))?;
    let lines = read_results(&a.run_dir.join("results.jsonl"))?;
    let s = summarize(&lines, meta.pass_threshold);
    println!("{}", summary_table(&meta, &s));
    std::fs::write(&out, html_report(&meta, &lines))
        .with_context(|| format!("write {}", out.display()))?;
    println!("report     {}", out.display());
    Ok(())
}

fn serve(a: &ViewArgs) -> Result<()> {
    let root = runs::RunsRoot::open(&a.run_dir)
        .with_context(|| format!("view {}", a.run_dir.display()))?;
    let addr = format!("{}:{}", a.host, a.port.unwrap_or(8765));
    let rt = tokio::runtime::Runtime::new()?;
    rt.block_on(async move {
        let listener = tokio::net::TcpListener::bind(&addr)
            .await
            .with_context(|| format!("bind {addr}"))?;
        let local = listener.local_addr()?;
        println!("listening on {local}");
        println!(
            "runs: http://{local}/   directory: {}",
            root.path().display()
        );
        std::io::stdout().flush()?;
        let shutdown = async {
            let _ = tokio::signal::ctrl_c().await;
        };
        temper_server::http::serve(
            listener,
            server::app(server::ViewState::new(root)),
            temper_server::http::ConnLimits::default(),
            shutdown,
        )
        .await
        .context("serve")
    })
}
