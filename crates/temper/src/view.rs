//! `temper view RUN_DIR`: the summary of a run, and a self-contained HTML
//! report beside it.

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Args;
use temper_eval::report::{html_report, summarize, summary_table};
use temper_eval::results::{read_metadata, read_results};

/// `temper view` flags.
#[derive(Args)]
pub struct ViewArgs {
    /// A run directory (results.jsonl + metadata.json).
    run_dir: PathBuf,
    /// Where to write the HTML (default RUN_DIR/report.html).
    #[arg(short, long)]
    out: Option<PathBuf>,
}

/// Run `temper view`.
pub fn run(a: ViewArgs) -> Result<()> {
    let meta =
        read_metadata(&a.run_dir).with_context(|| format!("view {}", a.run_dir.display()))?;
    let lines = read_results(&a.run_dir.join("results.jsonl"))?;
    let s = summarize(&lines, meta.pass_threshold);
    println!("{}", summary_table(&meta, &s));
    let out = a.out.unwrap_or_else(|| a.run_dir.join("report.html"));
    std::fs::write(&out, html_report(&meta, &lines))
        .with_context(|| format!("write {}", out.display()))?;
    println!("report     {}", out.display());
    Ok(())
}
