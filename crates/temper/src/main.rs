//! `temper`: the command line. Glue only — the work lives in the crates.

mod api;
mod bench;
mod bench_api;
mod bench_kernels;
mod bench_parity;
mod bench_serve;
mod conn;
mod env_cmd;
mod eval;
mod export;
mod generate;
mod hub_cmd;
mod init;
mod learn;
mod sandbox;
mod serve;
mod tasks_cmd;
mod traces_cmd;
mod train;
mod view;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// temper — a self-hosted post-training lab.
#[derive(Parser)]
#[command(name = "temper", version, about)]
struct Cli {
    /// CPU threads for tensor kernels (default: all cores).
    #[arg(long, global = true)]
    threads: Option<usize>,
    /// Precision of the matmul weights on the CPU: `f32`, `bf16` (bf16
    /// weights and matmul inputs, f32 sums; fast with avx512_bf16), `gguf`
    /// (a GGUF's Q8_0, Q4_0/1, Q5_0/1, Q4_K, Q5_K and Q6_K matrices kept
    /// quantized, the f32 model's exact logits), or `auto` (bf16 where the CPU has
    /// avx512_bf16, else f32).
    #[arg(long, global = true, default_value = "f32")]
    dtype: temper_model::Precision,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Sample a completion from a model: a Hugging Face directory or a GGUF file.
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
    /// The OpenAI-compatible inference server (continuous batching, LoRA hot-swap).
    Serve(serve::ServeArgs),
    /// Evaluate an environment against an OpenAI-compatible endpoint.
    Eval(eval::EvalArgs),
    /// Start a lab workspace: an environment, eval/RL/SFT configs, a README.
    Init(init::InitArgs),
    /// Environments: scaffold, list, and push / pull / search on a hub.
    #[command(subcommand)]
    Env(env_cmd::EnvCommand),
    /// The environments hub: a self-hosted registry (serve, tokens).
    #[command(subcommand)]
    Hub(hub_cmd::HubCommand),
    /// Store a hub URL and API token for `temper env push/pull`.
    Login(hub_cmd::LoginArgs),
    /// Watch runs live in a browser (a runs directory), or summarise an eval run and write its HTML report.
    View(view::ViewArgs),
    /// A mock OpenAI-compatible server with fault injection (tests, benchmarks).
    #[command(hide = true)]
    MockOpenai(eval::MockArgs),
    /// Train: async RL or SFT from a TOML config.
    #[command(subcommand)]
    Train(train::TrainCommand),
    /// The whole loop on a tiny model in minutes: SFT, eval, async RL, eval.
    Quickstart(train::QuickstartArgs),
    /// Turn an eval's successful rollouts into an SFT dataset (chat JSONL).
    GenerateSft(train::GenerateSftArgs),
    /// Export a run or adapter: merged HF directory, PEFT adapter, or GGUF.
    Export(export::ExportArgs),
    /// Harbor-format agentic tasks in temper's sandbox: run, resume, exec.
    #[command(subcommand)]
    Tasks(tasks_cmd::TasksCommand),
    /// Agent traces of task jobs: export successful trials as SFT data.
    #[command(subcommand)]
    Traces(traces_cmd::TracesCommand),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    // Before any tensor op: candle and its matmul read the thread count lazily.
    temper_model::set_num_threads(cli.threads);
    temper_model::keep_heap_within_steps();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    // The numerics every command's models use, passed down as a value.
    let numerics = match temper_model::forward_matmul_from_env() {
        Ok(matmul) => temper_model::Numerics {
            precision: cli.dtype,
            matmul,
        },
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::FAILURE;
        }
    };
    let result = match cli.command {
        Command::Generate(args) => generate::run(args, numerics),
        Command::Train(cmd) => train::run(cmd, numerics),
        Command::Quickstart(args) => train::run_quickstart(args, numerics),
        Command::GenerateSft(args) => train::generate_sft(args),
        Command::Eval(args) => eval::run(args),
        Command::Init(args) => init::run(args),
        Command::Env(cmd) => env_cmd::run(cmd),
        Command::Hub(cmd) => hub_cmd::run(cmd),
        Command::Login(args) => hub_cmd::login(args),
        Command::View(args) => view::run(args),
        Command::MockOpenai(args) => eval::mock(args),
        Command::Bench(cmd) => bench::run(cmd, numerics),
        Command::Sandbox(cmd) => sandbox::run(cmd),
        Command::Api(cmd) => api::run(cmd, numerics),
        Command::Serve(args) => serve::run(args, numerics),
        Command::Export(args) => export::run(args),
        Command::Tasks(cmd) => tasks_cmd::run(cmd),
        Command::Traces(cmd) => traces_cmd::run(cmd),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
