//! `temper serve`: the OpenAI-compatible inference server over one model
//! directory, with optional LoRA adapters.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use clap::Args;
use temper_model::{default_device, default_dtype, LoadOptions, Numerics, Pretrained};
use temper_server::openai::{app, OpenAiState, ServeConfig};

/// Arguments of `temper serve`.
#[derive(Args)]
pub struct ServeArgs {
    /// Hugging Face model directory (config.json, *.safetensors, tokenizer.json) or GGUF file.
    #[arg(long)]
    model: PathBuf,
    /// Name clients put in `model` for the base model (default: a GGUF's
    /// `general.name`, also answering to the file name; else the
    /// directory's name).
    #[arg(long)]
    served_model_name: Option<String>,
    /// A LoRA adapter to serve: NAME=DIR (PEFT layout). Repeatable. More can
    /// be loaded and swapped at run time with POST /v1/load_lora_adapter.
    #[arg(long = "lora")]
    loras: Vec<String>,
    /// A directory POST /v1/load_lora_adapter may load adapters from (the
    /// adapter must lie inside it). Repeatable; without one, loading at run
    /// time is off. `temper train rl` with `[sampler] url` needs its run
    /// directory inside one.
    #[arg(long = "lora-root")]
    lora_roots: Vec<PathBuf>,
    /// Address to bind.
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// Port to bind (0: any free port; the chosen one is printed).
    #[arg(long, default_value_t = 8000)]
    port: u16,
    /// Require `Authorization: Bearer KEY` on /v1/*.
    #[arg(long)]
    api_key: Option<String>,
    /// Memory for token capture (calls under /episodes/ID/v1 or with
    /// X-Temper-Episode, read back at GET /v1/episodes/ID), in MiB; the
    /// oldest episodes are dropped beyond it.
    #[arg(long, default_value_t = 512)]
    capture_max_mib: usize,
    /// A structured-output schema that takes longer to compile is refused
    /// with a 400 (seconds).
    #[arg(long, default_value_t = 10)]
    grammar_compile_timeout_s: u64,
    /// Structured-output schemas compiled at once (each on its own thread);
    /// a request waits for a slot up to the compile timeout, then gets 429.
    #[arg(long, default_value_t = 2)]
    max_grammar_compiles: usize,
    /// Compiled structured-output grammars (and refused schemas) kept, by
    /// the schema's SHA-256; 0: none.
    #[arg(long, default_value_t = 256)]
    grammar_cache_size: usize,
    /// Most sequences decoded at once (default 256).
    #[arg(long)]
    max_running: Option<usize>,
    /// KV-cache budget in tokens: running sequences' caches stay within it
    /// (newest evicted and recomputed later when they would not); a request
    /// must fit it alone, n × (prompt + max_tokens) (default: 4 GiB worth of
    /// cache).
    #[arg(long)]
    kv_budget_tokens: Option<usize>,
    /// Most requests waiting for a slot before new ones get 503 (default 1024).
    #[arg(long)]
    max_queue: Option<usize>,
    /// Longest prompt + completion in tokens (default: the model's context).
    #[arg(long)]
    max_model_len: Option<usize>,
    /// Prompt tokens prefilled per engine step; a longer prompt is prefilled
    /// in chunks of this size between decode steps, so it never stalls the
    /// running requests for longer than one chunk (default 512).
    #[arg(long)]
    max_prefill_tokens: Option<usize>,
    /// KV-cache tokens of finished sequences kept so that a prompt starting
    /// with one of them (the next call of a multi-turn conversation, a
    /// shared system prompt) is prefilled only past the shared part; results
    /// are bit-identical to prefilling it all. Held in addition to the KV
    /// budget; 0 turns it off (default: a quarter of the KV budget).
    #[arg(long)]
    prefix_cache_tokens: Option<usize>,
    /// Learn from use: train on rewarded episodes that opted in, gate each
    /// candidate on a held-out environment, hot-swap the promoted one
    /// (served under `[learn] adapter_name`). CONFIG is a TOML file with
    /// `[lora]`, `[trainer]`, `[eval]` and `[learn]` (docs/guide/learn.md).
    #[arg(long, value_name = "CONFIG")]
    learn: Option<PathBuf>,
    #[command(flatten)]
    conn: crate::conn::ConnArgs,
}

fn lora_arg(s: &str) -> Result<(String, PathBuf)> {
    match s.split_once('=') {
        Some((n, d)) if !n.is_empty() && !d.is_empty() => Ok((n.to_string(), PathBuf::from(d))),
        _ => bail!("--lora expects NAME=DIR, got {s:?}"),
    }
}

/// Load, bind, print the address, serve until Ctrl-C.
pub fn run(args: ServeArgs, numerics: Numerics) -> Result<()> {
    // A bad learning config fails before the model loads.
    let learn = match &args.learn {
        Some(path) => Some(crate::learn::LearnPlan::load(path, &args.model, numerics)?),
        None => None,
    };
    let device = default_device()?;
    let opts = LoadOptions {
        dtype: default_dtype(&device),
        device,
        precision: numerics.precision,
        matmul: numerics.matmul,
    };
    let model = Pretrained::load(&args.model, &opts)
        .with_context(|| format!("loading model from {}", args.model.display()))?;
    // The id clients send: --served-model-name, else a GGUF's general.name,
    // else the file or directory name. A GGUF's file name stays accepted as
    // an alias (it was the id before general.name was), but is not listed
    // in /v1/models, so "the endpoint's only model" still means one.
    let file_name = temper_model::path_name(&args.model);
    let (name, aliases) = match &args.served_model_name {
        Some(n) => (n.clone(), Vec::new()),
        None => {
            let name = temper_model::model_name(&args.model);
            let aliases = if name != file_name {
                vec![file_name]
            } else {
                Vec::new()
            };
            (name, aliases)
        }
    };
    let mut cfg = ServeConfig::defaults(name.clone(), &model);
    cfg.model_aliases = aliases;
    cfg.api_key = args.api_key.clone();
    cfg.capture.max_bytes = args.capture_max_mib.saturating_mul(1 << 20);
    if args.grammar_compile_timeout_s == 0 || args.max_grammar_compiles == 0 {
        bail!("--grammar-compile-timeout-s and --max-grammar-compiles must be >= 1");
    }
    cfg.grammars = temper_server::openai::GrammarLimits {
        compile_timeout: std::time::Duration::from_secs(args.grammar_compile_timeout_s),
        max_compiles: args.max_grammar_compiles,
        cache_entries: args.grammar_cache_size,
    };
    for root in &args.lora_roots {
        std::fs::create_dir_all(root)
            .with_context(|| format!("creating --lora-root {}", root.display()))?;
        cfg.lora_roots.push(
            root.canonicalize()
                .with_context(|| format!("--lora-root {}", root.display()))?,
        );
    }
    if let Some(n) = args.max_running {
        if n == 0 {
            bail!("--max-running must be >= 1");
        }
        cfg.scheduler.max_running = n;
    }
    if let Some(n) = args.kv_budget_tokens {
        cfg.scheduler.kv_budget_tokens = n;
    }
    if let Some(n) = args.max_queue {
        cfg.scheduler.max_queue = n;
    }
    if let Some(n) = args.max_model_len {
        if n > model.config.max_position_embeddings || n < 2 {
            bail!(
                "--max-model-len must be in 2..={}",
                model.config.max_position_embeddings
            );
        }
        cfg.scheduler.max_model_len = n;
    }
    if let Some(n) = args.max_prefill_tokens {
        if n == 0 {
            bail!("--max-prefill-tokens must be >= 1");
        }
        cfg.scheduler.max_prefill_tokens = n;
    }
    if let Some(n) = args.prefix_cache_tokens {
        cfg.scheduler.prefix_cache_tokens = n;
    }
    let learning = learn.as_ref().map(|p| p.open_state()).transpose()?;
    let state = OpenAiState::with_learning(Arc::new(model), cfg.clone(), learning);
    if let Some(p) = &learn {
        if let Some(v) = state.serve_live().map_err(|e| anyhow::anyhow!("{e}"))? {
            eprintln!(
                "learn: serving promoted version {v} as {} (state in {})",
                p.adapter_name(),
                p.dir().display()
            );
        }
    }
    for l in &args.loras {
        let (n, dir) = lora_arg(l)?;
        let v = state
            .load_adapter(&n, &dir)
            .map_err(|e| anyhow::anyhow!("{e}"))?;
        eprintln!("adapter {n} v{v}: {}", dir.display());
    }
    crate::conn::runtime()?.block_on(async move {
        if let Some(plan) = learn {
            let learner = crate::learn::Learner::start(plan, state.clone()).await?;
            tokio::spawn(learner.run());
        }
        let addr = format!("{}:{}", args.host, args.port);
        let alias = if cfg.model_aliases.is_empty() {
            String::new()
        } else {
            format!(" (also answers to {})", cfg.model_aliases.join(", "))
        };
        let key = if args.api_key.is_some() {
            ", API key required"
        } else {
            ""
        };
        crate::conn::serve(app(state), &addr, &args.conn, |local| {
            format!(
                "model {name}{alias}: max_model_len {}, max_running {}, kv_budget_tokens {}{key}\n\
                 temper serve listening on http://{local}",
                cfg.scheduler.max_model_len,
                cfg.scheduler.max_running,
                cfg.scheduler.kv_budget_tokens,
            )
        })
        .await
    })
}
