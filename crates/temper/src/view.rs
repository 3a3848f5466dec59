//! `temper view DIR`: the summary of an eval run or of a `temper tasks`
//! job, and a self-contained HTML report beside it.

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Args;
use temper_eval::report::{html_report, summarize, summary_table};
use temper_eval::results::{read_metadata, read_results};

/// `temper view` flags.
#[derive(Args)]
pub struct ViewArgs {
    /// A run directory (results.jsonl + metadata.json), or a job directory
    /// of `temper tasks run` (config.json + trial directories).
    run_dir: PathBuf,
    /// Where to write the HTML (default RUN_DIR/report.html).
    #[arg(short, long)]
    out: Option<PathBuf>,
}

/// Run `temper view`.
pub fn run(a: ViewArgs) -> Result<()> {
    let out = a.out.unwrap_or_else(|| a.run_dir.join("report.html"));
    if a.run_dir.join("config.json").is_file() && !a.run_dir.join("metadata.json").exists() {
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
