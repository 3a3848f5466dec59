//! `temper generate`: sample from a model (a Hugging Face directory or a
//! GGUF file) and print the text.

use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::Args;
use temper_model::{
    default_device, default_dtype, GenerationRequest, LoadOptions, LoraAdapter, Numerics,
    Pretrained, Sampler, SamplingParams,
};

/// Arguments of `temper generate`.
#[derive(Args)]
pub struct GenerateArgs {
    /// Hugging Face model directory (config.json, *.safetensors, tokenizer.json) or GGUF file.
    #[arg(long)]
    model: PathBuf,
    /// Prompt text (raw, unless --chat).
    #[arg(long)]
    prompt: String,
    /// Wrap the prompt as a user message through the model's chat template.
    #[arg(long)]
    chat: bool,
    /// System message (with --chat).
    #[arg(long, requires = "chat")]
    system: Option<String>,
    /// Most tokens to generate.
    #[arg(long, default_value_t = 128)]
    max_tokens: usize,
    /// Temperature (0 = greedy). Default: generation_config.json, else 1.0.
    #[arg(long)]
    temperature: Option<f64>,
    /// Nucleus sampling mass. Default: generation_config.json, else 1.0.
    #[arg(long)]
    top_p: Option<f64>,
    /// Top-k (0 = off). Default: generation_config.json, else off.
    #[arg(long)]
    top_k: Option<usize>,
    /// Seed: same seed, same output.
    #[arg(long)]
    seed: Option<u64>,
    /// Number of samples.
    #[arg(long, default_value_t = 1)]
    n: usize,
    /// Stop string (repeatable).
    #[arg(long)]
    stop: Vec<String>,
    /// PEFT LoRA adapter directory to apply.
    #[arg(long)]
    lora: Option<PathBuf>,
    /// Also print each token's logprob to stderr.
    #[arg(long)]
    logprobs: bool,
}

/// Load, sample, print.
pub fn run(args: GenerateArgs, numerics: Numerics) -> Result<()> {
    if args.n == 0 {
        bail!("--n must be at least 1");
    }
    let device = default_device()?;
    let opts = LoadOptions {
        dtype: default_dtype(&device),
        device,
        precision: numerics.precision,
        matmul: numerics.matmul,
    };
    let t0 = Instant::now();
    let p = Pretrained::load(&args.model, &opts)
        .with_context(|| format!("loading model from {}", args.model.display()))?;
    let lora = args
        .lora
        .as_ref()
        .map(|d| {
            LoraAdapter::load_peft(d, &p.config, opts.dtype, &opts.device)
                .with_context(|| format!("loading LoRA adapter from {}", d.display()))
        })
        .transpose()?;
    let prompt = if args.chat {
        let tmpl = p.chat_template.as_ref().with_context(|| {
            format!(
                "{} has no chat template (no chat_template.jinja, no chat_template in tokenizer_config.json); drop --chat",
                args.model.display()
            )
        })?;
        let mut messages = Vec::new();
        if let Some(s) = &args.system {
            messages.push(serde_json::json!({"role": "system", "content": s}));
        }
        messages.push(serde_json::json!({"role": "user", "content": args.prompt}));
        let text = tmpl.render(
            &serde_json::Value::Array(messages),
            None,
            true,
            &serde_json::Map::new(),
        )?;
        p.tokenizer.encode(&text, false)?
    } else {
        p.tokenizer.encode(&args.prompt, true)?
    };
    let load_s = t0.elapsed().as_secs_f64();
    let params = SamplingParams {
        max_tokens: args.max_tokens,
        temperature: args.temperature.or(p.generation.temperature).unwrap_or(1.0),
        top_p: args.top_p.or(p.generation.top_p).unwrap_or(1.0),
        top_k: args.top_k.or(p.generation.top_k).unwrap_or(0),
        stop: args.stop.clone(),
        seed: args.seed,
        logprobs: args.logprobs,
        ..Default::default()
    };
    let sampler = Sampler::new(&p.model, &p.tokenizer, p.generation.eos_token_ids.clone());
    let t1 = Instant::now();
    let out = sampler.generate(
        &[GenerationRequest {
            prompt: prompt.clone(),
            n: args.n,
            params,
        }],
        lora.as_ref(),
    )?;
    let gen_s = t1.elapsed().as_secs_f64();
    let mut stdout = std::io::stdout().lock();
    let mut generated = 0;
    for (i, c) in out.into_iter().flatten().enumerate() {
        if args.n > 1 {
            writeln!(stdout, "--- sample {i} ---")?;
        }
        writeln!(stdout, "{}", c.text)?;
        generated += c.tokens.len();
        if let Some(lps) = &c.logprobs {
            for (t, lp) in c.tokens.iter().zip(lps) {
                // `{:?}` is the shortest round-trip form: equal text, equal bits.
                eprintln!(
                    "token {t:>7} {:>16?} logprob {lp:?}",
                    p.tokenizer.decode(&[*t], false)?
                );
            }
        }
        eprintln!(
            "[sample {i}: {} tokens, finish_reason={}]",
            c.tokens.len(),
            c.finish_reason.as_str()
        );
    }
    eprintln!(
        "[prompt {} tokens; loaded in {load_s:.2}s; generated {generated} tokens in {gen_s:.2}s = {:.1} tokens/s]",
        prompt.len(),
        generated as f64 / gen_s.max(1e-9)
    );
    Ok(())
}
