//! `temper traces export`: successful trials of a `temper tasks run` job
//! as SFT data (see `temper_tasks::traces`).

use std::io::Write;
use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::{Args, Subcommand};
use temper_tasks::traces::{export, Format};

/// `temper traces` subcommands.
#[derive(Subcommand)]
pub enum TracesCommand {
    /// Write the conversations of a job's trials with reward >= --min-reward
    /// as chat JSONL (what `temper train sft` reads) or ShareGPT JSONL.
    Export(ExportArgs),
}

/// `temper traces export` flags.
#[derive(Args)]
pub struct ExportArgs {
    /// The job directory (jobs/<name>).
    job_dir: PathBuf,
    /// Keep trials whose `reward` is at least this.
    #[arg(long, default_value_t = 1.0)]
    min_reward: f64,
    /// chat-jsonl or sharegpt.
    #[arg(long, default_value = "chat-jsonl")]
    format: String,
    /// Output file [default: stdout].
    #[arg(long)]
    out: Option<PathBuf>,
}

/// Runs a `temper traces` subcommand.
pub fn run(cmd: TracesCommand) -> Result<()> {
    match cmd {
        TracesCommand::Export(a) => run_export(a),
    }
}

fn run_export(a: ExportArgs) -> Result<()> {
    if !a.min_reward.is_finite() {
        bail!("--min-reward must be a number");
    }
    let format: Format = a.format.parse()?;
    let e = export(&a.job_dir, a.min_reward, format)
        .with_context(|| format!("job {}", a.job_dir.display()))?;
    let mut text = String::new();
    for r in &e.rows {
        text.push_str(&r.to_string());
        text.push('\n');
    }
    match &a.out {
        Some(p) => std::fs::write(p, &text).with_context(|| format!("write {}", p.display()))?,
        None => std::io::stdout().write_all(text.as_bytes())?,
    }
    eprintln!(
        "exported {} of {} trials ({} below reward {}, {} without an assistant turn){}",
        e.rows.len(),
        e.trials,
        e.below,
        a.min_reward,
        e.empty,
        a.out
            .as_ref()
            .map(|p| format!(" to {}", p.display()))
            .unwrap_or_default()
    );
    Ok(())
}
