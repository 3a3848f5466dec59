//! `temper api serve`: the training API for the official `tinker` SDK.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::{Args, Subcommand};
use temper_model::{default_device, default_dtype, LoadOptions, Numerics, Pretrained};
use temper_server::training_api::{
    app, ApiConfig, ApiLimits, ApiState, BaseModel, ServedAdapter, PEFT_ADAPTER_PREFIX,
};

/// Training API commands.
#[derive(Subcommand)]
pub enum ApiCommand {
    /// Serve the training API over HTTP.
    Serve(ServeArgs),
}

/// Arguments of `temper api serve`.
#[derive(Args)]
pub struct ServeArgs {
    /// A base model clients may use: NAME=DIR (a Hugging Face model
    /// directory or a GGUF file). Repeatable; NAME is the SDK's `base_model`.
    #[arg(long = "model", required = true)]
    models: Vec<String>,
    /// Address to bind.
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// Port to bind.
    #[arg(long, default_value_t = 8000)]
    port: u16,
    /// Require this X-API-Key (the SDK insists keys start with `tml-`).
    #[arg(long)]
    api_key: Option<String>,
    /// Where save_state checkpoints are written.
    #[arg(long, default_value = "checkpoints")]
    checkpoints: PathBuf,
    /// Largest LoRA rank a client may ask for.
    #[arg(long, default_value_t = ApiLimits::default().max_lora_rank)]
    max_lora_rank: usize,
    /// Most samples one asample may ask for.
    #[arg(long, default_value_t = ApiLimits::default().max_num_samples)]
    max_num_samples: usize,
    /// Most tokens in one forward_backward, summed over its datums.
    #[arg(long, default_value_t = ApiLimits::default().max_batch_tokens)]
    max_batch_tokens: usize,
    /// A PEFT LoRA adapter clients may start training from: NAME=DIR.
    /// Repeatable; the SDK loads it with
    /// `create_training_client_from_state("tinker://adapters/peft/NAME")`.
    #[arg(long = "adapter")]
    adapters: Vec<String>,
    /// Seconds a finished result nobody retrieves is kept.
    #[arg(long, default_value_t = ApiLimits::default().result_ttl.as_secs())]
    result_ttl_s: u64,
    /// Most finished results kept at once (the oldest are dropped first).
    #[arg(long, default_value_t = ApiLimits::default().max_results)]
    max_results: usize,
    /// Largest request body, in MiB.
    #[arg(long, default_value_t = ApiLimits::default().max_body_bytes >> 20)]
    max_body_mb: usize,
    #[command(flatten)]
    conn: crate::conn::ConnArgs,
}

/// Parse `NAME=DIR`.
fn model_arg(s: &str) -> Result<(String, PathBuf)> {
    match s.split_once('=') {
        Some((n, d)) if !n.is_empty() && !d.is_empty() => Ok((n.to_string(), PathBuf::from(d))),
        _ => bail!("--model expects NAME=DIR (a model directory or a GGUF file), got {s:?}"),
    }
}

/// The rank of a PEFT adapter (`r` in its `adapter_config.json`).
fn peft_rank(dir: &std::path::Path) -> Result<usize> {
    let path = dir.join("adapter_config.json");
    let text = std::fs::read_to_string(&path)
        .with_context(|| format!("reading {} (a PEFT adapter directory?)", path.display()))?;
    let cfg: serde_json::Value =
        serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
    cfg["r"]
        .as_u64()
        .and_then(|r| usize::try_from(r).ok())
        .filter(|&r| r > 0)
        .with_context(|| {
            format!(
                "{}: no positive integer \"r\" (the LoRA rank)",
                path.display()
            )
        })
}

/// Run a command.
pub fn run(cmd: ApiCommand, numerics: Numerics) -> Result<()> {
    match cmd {
        ApiCommand::Serve(a) => serve(a, numerics),
    }
}

fn serve(args: ServeArgs, numerics: Numerics) -> Result<()> {
    let device = default_device()?;
    let opts = LoadOptions {
        dtype: default_dtype(&device),
        device,
        precision: numerics.precision,
        matmul: numerics.matmul,
    };
    let mut bases = Vec::new();
    for m in &args.models {
        let (name, dir) = model_arg(m)?;
        let model = Pretrained::load(&dir, &opts)
            .with_context(|| format!("loading base model {name} from {}", dir.display()))?;
        eprintln!(
            "base model {name}: {} ({} layers)",
            dir.display(),
            model.config.num_layers
        );
        bases.push(BaseModel {
            name,
            model: Arc::new(model),
        });
    }
    let mut adapters = std::collections::BTreeMap::new();
    for a in &args.adapters {
        let (name, dir) = model_arg(a).context("--adapter expects NAME=DIR")?;
        let rank = peft_rank(&dir)?;
        eprintln!(
            "adapter {name}: {} (rank {rank}) as {PEFT_ADAPTER_PREFIX}{name}",
            dir.display()
        );
        adapters.insert(name, ServedAdapter { dir, rank });
    }
    std::fs::create_dir_all(&args.checkpoints)
        .with_context(|| format!("creating {}", args.checkpoints.display()))?;
    let state = ApiState::new(
        bases,
        ApiConfig {
            api_key: args.api_key.clone(),
            checkpoint_dir: args.checkpoints.clone(),
            long_poll: Duration::from_secs(25),
            result_grace: Duration::from_secs(600),
            limits: ApiLimits {
                max_lora_rank: args.max_lora_rank,
                max_num_samples: args.max_num_samples,
                max_batch_tokens: args.max_batch_tokens,
                max_body_bytes: args.max_body_mb.saturating_mul(1 << 20),
                result_ttl: Duration::from_secs(args.result_ttl_s),
                max_results: args.max_results,
            },
            adapters,
        },
    );
    crate::conn::runtime()?.block_on(async move {
        let addr = format!("{}:{}", args.host, args.port);
        let key = if args.api_key.is_some() {
            ", API key required"
        } else {
            ""
        };
        crate::conn::serve(app(state), &addr, &args.conn, |addr| {
            format!("temper training API on http://{addr} (TINKER_BASE_URL=http://{addr}){key}")
        })
        .await
    })
}
