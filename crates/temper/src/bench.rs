//! `temper bench model`: training-step and sampling throughput of the model
//! core and its peak resident memory, on a fixed tiny config or on any Hugging
//! Face model directory (`--model DIR`). `scripts/bench_torch.py` runs the
//! same shapes in PyTorch / transformers and prints the ratio.

use std::collections::HashMap;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result};
use clap::{Args, Subcommand};
use temper_model::candle_core::{DType, Device, Tensor};
use temper_model::{
    Checkpoint, GenerationRequest, LoadOptions, LoraAdapter, LoraConfig, Model, Numerics,
    Pretrained, RandomInit, Sampler, SamplingParams, ScoreInput, Tokenizer,
};

/// Benchmarks.
#[derive(Subcommand)]
pub enum BenchCommand {
    /// LoRA forward+backward and batched sampling tokens/s on a tiny Llama.
    Model(ModelBenchArgs),
    /// forward_backward + optim_step steps/s in process vs through the
    /// training API (HTTP on loopback): the API's overhead.
    Api(crate::bench_api::ApiBenchArgs),
    /// Generated tokens/s of `temper serve` at several concurrencies vs HF
    /// transformers `generate` on the same model and work.
    Serve(crate::bench_serve::ServeBenchArgs),
    /// GFLOP/s of temper's matmul kernels vs candle's gemm on a decoder's
    /// linear-layer shapes (forward and input gradient).
    Kernels(crate::bench_kernels::KernelBenchArgs),
    /// Logprobs, greedy tokens, LoRA gradients and the sampler/trainer
    /// mismatch of a model on a device, as JSON for a golden comparison
    /// (scripts/gpu/checks.py).
    Parity(crate::bench_parity::ParityArgs),
    /// Push and pull latency and throughput of a 10 MB environment through
    /// the hub's HTTP API (an in-process hub on loopback).
    Hub(crate::hub_cmd::BenchHubArgs),
    /// Harbor-task trial overhead (sandbox session ready -> verifier done)
    /// and trials/s on a trivial task with the oracle agent.
    Tasks(crate::tasks_cmd::BenchTasksArgs),
}

/// Arguments of `temper bench model`.
#[derive(Args)]
pub struct ModelBenchArgs {
    /// Print one JSON object instead of a table.
    #[arg(long)]
    json: bool,
    /// Timed iterations (the median is reported).
    #[arg(long, default_value_t = 5)]
    iters: usize,
    /// A Hugging Face model directory to benchmark instead of the built-in
    /// tiny random Llama (same work: LoRA r=16 on 8x128 tokens, 8x(16+128)
    /// sampling).
    #[arg(long)]
    model: Option<PathBuf>,
    /// Run only the training step (e.g. under a profiler); sampling is
    /// reported as absent.
    #[arg(long)]
    train_only: bool,
    /// `cpu`, or `cuda` (GPU 0, bf16 unless `--device-dtype f32`; needs a
    /// build with `--features cuda`).
    #[arg(long, default_value = "cpu")]
    device: String,
    /// Weights and activations on `--device cuda`: `bf16` or `f32`.
    #[arg(long, default_value = "bf16")]
    device_dtype: String,
    /// Sequences per training step.
    #[arg(long, default_value_t = BATCH)]
    batch: usize,
    /// Tokens per training sequence.
    #[arg(long, default_value_t = SEQ)]
    seq_len: usize,
    /// Sequences sampled at once.
    #[arg(long, default_value_t = BATCH)]
    sample_seqs: usize,
    /// New tokens per sampled sequence.
    #[arg(long, default_value_t = NEW)]
    new_tokens: usize,
}

const HIDDEN: usize = 256;
const INTER: usize = 768;
const LAYERS: usize = 4;
const HEADS: usize = 4;
const KV_HEADS: usize = 2;
const VOCAB: usize = 512;
const RANK: usize = 16;
const BATCH: usize = 8;
const SEQ: usize = 128;
const PROMPT: usize = 16;
const NEW: usize = 128;

/// Run a benchmark.
pub fn run(cmd: BenchCommand, numerics: Numerics) -> Result<()> {
    match cmd {
        BenchCommand::Model(a) => model(a, numerics),
        BenchCommand::Api(a) => crate::bench_api::run(a, numerics),
        BenchCommand::Serve(a) => crate::bench_serve::run(a, numerics),
        BenchCommand::Hub(a) => crate::hub_cmd::bench(a),
        BenchCommand::Kernels(a) => crate::bench_kernels::run(a),
        BenchCommand::Parity(a) => crate::bench_parity::run(a, numerics),
        BenchCommand::Tasks(a) => crate::tasks_cmd::bench(a),
    }
}

fn config() -> serde_json::Value {
    serde_json::json!({
        "model_type": "llama", "hidden_size": HIDDEN, "intermediate_size": INTER,
        "num_hidden_layers": LAYERS, "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS, "vocab_size": VOCAB,
        "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "tie_word_embeddings": false
    })
}

/// A random checkpoint written to a scratch directory and loaded through the
/// real loader.
fn random_model(dev: &Device, dtype: DType, numerics: Numerics) -> Result<Model> {
    let dir = std::env::temp_dir().join(format!("temper-bench-{}", std::process::id()));
    let init = RandomInit { std: 0.05, seed: 0 };
    let cfg = temper_model::write_random_model(&dir, &config(), init)?;
    let ck = Checkpoint::open(&dir, dtype, dev)?;
    let model = Model::load(&cfg, &ck, dtype, dev).and_then(|mut m| {
        m.set_precision(numerics.precision)?;
        m.set_forward_matmul(numerics.matmul);
        Ok(m)
    });
    drop(ck);
    let _ = std::fs::remove_dir_all(&dir);
    Ok(model?)
}

fn word_tokenizer() -> Result<Tokenizer> {
    let vocab: HashMap<String, u32> = (0..VOCAB as u32).map(|i| (format!("t{i}"), i)).collect();
    let wl = tokenizers::models::wordlevel::WordLevel::builder()
        .vocab(vocab.into_iter().collect())
        .unk_token("t0".into())
        .build()
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    Ok(Tokenizer::from_inner(
        tokenizers::Tokenizer::new(wl),
        None,
        None,
    ))
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Resident-set sizes from `/proc/self/status` (Linux), in MB.
pub(crate) mod rss {
    /// `VmRSS` (now) or `VmHWM` (peak) in MB; `None` where /proc is absent.
    fn field(name: &str) -> Option<f64> {
        let status = std::fs::read_to_string("/proc/self/status").ok()?;
        let line = status.lines().find(|l| l.starts_with(name))?;
        let kb: f64 = line
            .trim_start_matches(name)
            .trim_start_matches(':')
            .split_whitespace()
            .next()?
            .parse()
            .ok()?;
        Some(kb / 1024.0)
    }

    pub fn now_mb() -> Option<f64> {
        field("VmRSS")
    }

    pub fn peak_mb() -> Option<f64> {
        field("VmHWM")
    }

    /// User + system CPU seconds of the whole process (every thread): with
    /// one thread, the work a step costs even while other processes share
    /// the cores.
    pub fn cpu_seconds() -> f64 {
        // SAFETY: `rusage` is plain integers, for which all-zero bytes is valid.
        let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
        // SAFETY: `usage` is a valid rusage for the call to fill.
        unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut usage) };
        let tv = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 * 1e-6;
        tv(usage.ru_utime) + tv(usage.ru_stime)
    }

    /// Reset the peak to the current RSS (Linux ≥ 4.0: `echo 5 >
    /// /proc/self/clear_refs`). Returns whether it worked; when not, the peak
    /// reported afterwards is the process-lifetime peak.
    pub fn reset_peak() -> bool {
        std::fs::write("/proc/self/clear_refs", "5").is_ok()
    }
}

fn model(args: ModelBenchArgs, numerics: Numerics) -> Result<()> {
    let iters = args.iters.max(1);
    let dev = crate::bench_parity::parse_device(&args.device)?;
    let dtype = if dev.is_cpu() {
        DType::F32
    } else {
        crate::bench_parity::parse_dtype(&args.device_dtype)?
    };
    let (batch, seq, sample_seqs, new) =
        (args.batch, args.seq_len, args.sample_seqs, args.new_tokens);
    if batch == 0 || seq == 0 || sample_seqs == 0 || new == 0 {
        anyhow::bail!("--batch, --seq-len, --sample-seqs and --new-tokens must be at least 1");
    }
    let opts = LoadOptions {
        device: dev.clone(),
        dtype,
        precision: numerics.precision,
        matmul: numerics.matmul,
    };
    let (model, tok, eos, label) = match &args.model {
        Some(dir) => {
            let p = Pretrained::load(dir, &opts)
                .with_context(|| format!("loading {}", dir.display()))?;
            let label = format!("{} ({:?})", dir.display(), p.config.family);
            (p.model, p.tokenizer, p.generation.eos_token_ids, label)
        }
        None => {
            let model =
                random_model(&dev, dtype, numerics).context("building the benchmark model")?;
            (
                model,
                word_tokenizer()?,
                vec![],
                "tiny random llama".to_string(),
            )
        }
    };
    let cfg = model.config().clone();
    let vocab = cfg.vocab_size;
    let rss_loaded = rss::now_mb();
    let lora_cfg = LoraConfig {
        rank: RANK,
        alpha: LoraConfig::DEFAULT_ALPHA,
        ..Default::default()
    };
    let mut lora = LoraAdapter::new(&cfg, lora_cfg, 0, dtype, &dev)?;
    // Non-zero B so the whole LoRA backward runs, as after the first step.
    for (_, v) in lora.named_vars() {
        let t = Tensor::randn(0f32, 0.01, v.as_tensor().dims(), &dev)?.to_dtype(dtype)?;
        v.set(&t)?;
    }
    let seqs: Vec<Vec<u32>> = (0..batch)
        .map(|b| {
            (0..=seq)
                .map(|i| ((b * 131 + i * 31) % vocab) as u32)
                .collect()
        })
        .collect();

    // Training step: forward + backward of a summed token NLL over 8 × 128,
    // as the engine's `forward_backward` runs it: the sequences in packs of
    // up to `PACK_TOKENS` tokens, each pack one forward and its backward
    // right after (the loss is a sum), gradients accumulated, on a worker of
    // the kernels' pool.
    let inputs: Vec<ScoreInput<'_>> = seqs
        .iter()
        .map(|s| ScoreInput {
            input: &s[..seq],
            targets: &s[1..],
        })
        .collect();
    let packs = temper_model::pack_batch(&inputs, temper_model::PACK_TOKENS);
    let step = |lora: &LoraAdapter| -> Result<(f64, f64)> {
        let t = Instant::now();
        let c = rss::cpu_seconds();
        let vars = lora.named_vars();
        let mut acc: Vec<Option<Tensor>> = vec![None; vars.len()];
        for pack in &packs {
            let scores = model.score_batch(&inputs[pack.clone()], Some(lora), 1.0)?;
            let mut nll = Vec::with_capacity(scores.len());
            for sc in &scores {
                nll.push(sc.logprobs.sum_all()?.neg()?);
            }
            let grads = Tensor::stack(&nll, 0)?.sum_all()?.backward()?;
            for ((_, v), a) in vars.iter().zip(acc.iter_mut()) {
                if let Some(g) = grads.get(v.as_tensor()) {
                    *a = Some(match a.take() {
                        None => g.clone(),
                        Some(prev) => (prev + g)?,
                    });
                }
            }
        }
        std::hint::black_box(acc);
        // GPU kernels run asynchronously: the step ends when they do.
        model.device().synchronize()?;
        // As the engine does after forward_backward.
        temper_model::release_memory();
        Ok((t.elapsed().as_secs_f64(), rss::cpu_seconds() - c))
    };
    let peak_reset = rss::reset_peak();
    temper_model::in_pool(|| step(&lora))?;
    let timed = (0..iters)
        .map(|_| temper_model::in_pool(|| step(&lora)))
        .collect::<Result<Vec<_>>>()?;
    let train_s = median(timed.iter().map(|t| t.0).collect());
    let train_cpu_s = median(timed.iter().map(|t| t.1).collect());
    let train_peak = rss::peak_mb();
    let rss_after_train = rss::now_mb();
    lora = lora.snapshot()?;

    // Sampling: 8 prompts × 16 tokens → 128 new tokens each, T = 1.
    let sampler = Sampler::new(&model, &tok, eos);
    let reqs = |logprobs: bool| -> Vec<GenerationRequest> {
        (0..sample_seqs)
            .map(|b| GenerationRequest {
                prompt: (0..PROMPT)
                    .map(|i| ((b * 7 + i * 13) % vocab) as u32)
                    .collect(),
                n: 1,
                params: SamplingParams {
                    max_tokens: new,
                    temperature: 1.0,
                    ignore_eos: true,
                    seed: Some(b as u64),
                    logprobs,
                    ..Default::default()
                },
            })
            .collect()
    };
    let sample = |logprobs: bool| -> Result<f64> {
        let t = Instant::now();
        let out = sampler.generate(&reqs(logprobs), Some(&lora))?;
        std::hint::black_box(out);
        model.device().synchronize()?;
        Ok(t.elapsed().as_secs_f64())
    };
    rss::reset_peak();
    let sample_iters = iters.min(3);
    let (sample_s, sample_nolp_s) = if args.train_only {
        (f64::NAN, f64::NAN)
    } else {
        sample(true)?;
        (
            median(
                (0..sample_iters)
                    .map(|_| sample(true))
                    .collect::<Result<Vec<_>>>()?,
            ),
            median(
                (0..sample_iters)
                    .map(|_| sample(false))
                    .collect::<Result<Vec<_>>>()?,
            ),
        )
    };

    let sample_peak = rss::peak_mb();
    let threads = temper_model::candle_core::utils::get_num_threads();
    let tokens = (batch * seq) as f64;
    let new_tokens = (sample_seqs * new) as f64;
    let report = serde_json::json!({
        "model": label,
        "config": {
            "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
            "num_layers": cfg.num_layers, "num_heads": cfg.num_heads,
            "num_kv_heads": cfg.num_kv_heads, "vocab_size": vocab,
            "lora_rank": RANK, "batch": batch, "seq_len": seq, "prompt_len": PROMPT,
            "sample_seqs": sample_seqs, "new_tokens": new, "threads": threads,
            "dtype": model.precision().as_str(), "device": args.device,
            "device_dtype": format!("{dtype:?}").to_lowercase()
        },
        "train_tokens_per_s": tokens / train_s,
        "train_step_ms": train_s * 1e3,
        "train_tokens_per_cpu_s": tokens / train_cpu_s,
        "sample_tokens_per_s": new_tokens / sample_s,
        "sample_ms": sample_s * 1e3,
        "sample_without_logprobs_tokens_per_s": new_tokens / sample_nolp_s,
        "rss_mb": {
            "after_load": rss_loaded,
            "train_peak": train_peak,
            "after_train": rss_after_train,
            "sample_peak": sample_peak,
            "peak_is_per_phase": peak_reset,
        },
    });
    if args.json {
        println!("{report}");
    } else {
        println!(
            "temper bench model: {label} d={} layers={} vocab={vocab}, LoRA r={RANK}, {threads} threads, {} weights",
            cfg.hidden_size, cfg.num_layers, model.precision()
        );
        println!(
            "  LoRA forward+backward  {batch}x{seq} tokens   {:>9.1} ms   {:>9.0} tokens/s   ({:.0} tokens per CPU-second)",
            train_s * 1e3,
            tokens / train_s,
            tokens / train_cpu_s
        );
        if !args.train_only {
            println!(
                "  sampling (+logprobs)   {sample_seqs}x{new} new tokens {:>9.1} ms   {:>9.0} tokens/s",
                sample_s * 1e3,
                new_tokens / sample_s
            );
            println!(
                "  sampling (no logprobs) {sample_seqs}x{new} new tokens {:>9.1} ms   {:>9.0} tokens/s",
                sample_nolp_s * 1e3,
                new_tokens / sample_nolp_s
            );
        }
        let mb = |v: Option<f64>| v.map_or("n/a".to_string(), |v| format!("{v:.0} MB"));
        println!(
            "  RSS: after load {}, training peak {}, after training {}, sampling peak {}{}",
            mb(rss_loaded),
            mb(train_peak),
            mb(rss_after_train),
            mb(sample_peak),
            if peak_reset {
                ""
            } else {
                " (peaks are process-lifetime)"
            }
        );
    }
    Ok(())
}
