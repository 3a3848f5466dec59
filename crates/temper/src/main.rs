//! `temper`: the command line. Glue only — the work lives in the crates.

mod api;
mod bench;
mod bench_api;
mod generate;
mod sandbox;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// temper — a self-hosted post-training lab.
#[derive(Parser)]
#[command(name = "temper", version, about)]
struct Cli {
    /// CPU threads for tensor kernels (default: all cores).
    #[arg(long, global = true)]
    threads: Option<usize>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Sample a completion from a Hugging Face model directory.
    Generate(generate::GenerateArgs),
    /// Benchmarks.
    #[command(subcommand)]
    Bench(bench::BenchCommand),
    /// Isolated code execution.
    #[command(subcommand)]
    Sandbox(sandbox::SandboxCommand),
    /// The training API (tinker-SDK compatible).
    #[command(subcommand)]
    Api(api::ApiCommand),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    // Before any tensor op: candle and its matmul read the thread count lazily.
    temper_model::set_num_threads(cli.threads);
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    let result = match cli.command {
        Command::Generate(args) => generate::run(args),
        Command::Bench(cmd) => bench::run(cmd),
        Command::Sandbox(cmd) => sandbox::run(cmd),
        Command::Api(cmd) => api::run(cmd),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
