//! `temper bench model`: training-step and sampling throughput of the model
//! core on a fixed tiny config. `scripts/bench_torch.py` runs the same shapes
//! in PyTorch / transformers and prints the ratio.

use std::collections::HashMap;
use std::time::Instant;

use anyhow::{Context, Result};
use clap::{Args, Subcommand};
use temper_model::candle_core::{DType, Device, Tensor};
use temper_model::{
    Checkpoint, GenerationRequest, HfConfig, LoraAdapter, LoraConfig, Model, Sampler,
    SamplingParams, Target, Tokenizer,
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
pub fn run(cmd: BenchCommand) -> Result<()> {
    match cmd {
        BenchCommand::Model(a) => model(a),
        BenchCommand::Api(a) => crate::bench_api::run(a),
        BenchCommand::Serve(a) => crate::bench_serve::run(a),
    }
}

fn config() -> Result<HfConfig> {
    Ok(serde_json::from_value(serde_json::json!({
        "model_type": "llama", "hidden_size": HIDDEN, "intermediate_size": INTER,
        "num_hidden_layers": LAYERS, "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS, "vocab_size": VOCAB,
        "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "tie_word_embeddings": false
    }))?)
}

/// A random checkpoint written to a scratch directory and loaded through the
/// real loader.
fn random_model(hf: &HfConfig) -> Result<Model> {
    let cfg = hf.validate()?;
    let dev = Device::Cpu;
    let mut ts: HashMap<String, Tensor> = HashMap::new();
    let rand = |shape: &[usize]| Tensor::randn(0f32, 0.05, shape, &dev);
    ts.insert("model.embed_tokens.weight".into(), rand(&[VOCAB, HIDDEN])?);
    ts.insert("lm_head.weight".into(), rand(&[VOCAB, HIDDEN])?);
    ts.insert(
        "model.norm.weight".into(),
        Tensor::ones(HIDDEN, DType::F32, &dev)?,
    );
    for l in 0..LAYERS {
        let p = format!("model.layers.{l}");
        for n in ["input_layernorm", "post_attention_layernorm"] {
            ts.insert(
                format!("{p}.{n}.weight"),
                Tensor::ones(HIDDEN, DType::F32, &dev)?,
            );
        }
        for t in Target::ALL {
            let (o, i) = t.shape(&cfg);
            ts.insert(format!("{p}.{}.weight", t.path()), rand(&[o, i])?);
        }
    }
    let dir = std::env::temp_dir().join(format!("temper-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    temper_model::candle_core::safetensors::save(&ts, dir.join("model.safetensors"))?;
    let ck = Checkpoint::open(&dir, DType::F32, &dev)?;
    let model = Model::load(&cfg, &ck, DType::F32, &dev);
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

fn model(args: ModelBenchArgs) -> Result<()> {
    let iters = args.iters.max(1);
    let hf = config()?;
    let cfg = hf.validate()?;
    let model = random_model(&hf).context("building the benchmark model")?;
    let tok = word_tokenizer()?;
    let lora_cfg = LoraConfig {
        rank: RANK,
        alpha: 32.0,
        ..Default::default()
    };
    let mut lora = LoraAdapter::new(&cfg, lora_cfg, 0, DType::F32, &Device::Cpu)?;
    // Non-zero B so the whole LoRA backward runs, as after the first step.
    for (_, v) in lora.named_vars() {
        let t = Tensor::randn(0f32, 0.01, v.as_tensor().dims(), &Device::Cpu)?;
        v.set(&t)?;
    }
    let seqs: Vec<Vec<u32>> = (0..BATCH)
        .map(|b| {
            (0..=SEQ)
                .map(|i| ((b * 131 + i * 31) % VOCAB) as u32)
                .collect()
        })
        .collect();

    // Training step: forward + backward of a summed token NLL over 8 × 128.
    let step = |lora: &LoraAdapter| -> Result<f64> {
        let t = Instant::now();
        let mut total: Option<Tensor> = None;
        for s in &seqs {
            let sc = model.score(&s[..SEQ], &s[1..], Some(lora), 1.0)?;
            let l = sc.logprobs.sum_all()?.neg()?;
            total = Some(match total {
                None => l,
                Some(acc) => (acc + l)?,
            });
        }
        let grads = total.context("empty batch")?.backward()?;
        std::hint::black_box(grads);
        Ok(t.elapsed().as_secs_f64())
    };
    step(&lora)?;
    let train_s = median(
        (0..iters)
            .map(|_| step(&lora))
            .collect::<Result<Vec<_>>>()?,
    );
    lora = lora.snapshot()?;

    // Sampling: 8 prompts × 16 tokens → 128 new tokens each, T = 1.
    let sampler = Sampler::new(&model, &tok, vec![]);
    let reqs = |logprobs: bool| -> Vec<GenerationRequest> {
        (0..BATCH)
            .map(|b| GenerationRequest {
                prompt: (0..PROMPT)
                    .map(|i| ((b * 7 + i * 13) % VOCAB) as u32)
                    .collect(),
                n: 1,
                params: SamplingParams {
                    max_tokens: NEW,
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
        Ok(t.elapsed().as_secs_f64())
    };
    sample(true)?;
    let sample_iters = iters.min(3);
    let sample_s = median(
        (0..sample_iters)
            .map(|_| sample(true))
            .collect::<Result<Vec<_>>>()?,
    );
    let sample_nolp_s = median(
        (0..sample_iters)
            .map(|_| sample(false))
            .collect::<Result<Vec<_>>>()?,
    );

    let threads = temper_model::candle_core::utils::get_num_threads();
    let tokens = (BATCH * SEQ) as f64;
    let new_tokens = (BATCH * NEW) as f64;
    let report = serde_json::json!({
        "config": {
            "hidden_size": HIDDEN, "intermediate_size": INTER, "num_layers": LAYERS,
            "num_heads": HEADS, "num_kv_heads": KV_HEADS, "vocab_size": VOCAB,
            "lora_rank": RANK, "batch": BATCH, "seq_len": SEQ, "prompt_len": PROMPT,
            "new_tokens": NEW, "threads": threads
        },
        "train_tokens_per_s": tokens / train_s,
        "train_step_ms": train_s * 1e3,
        "sample_tokens_per_s": new_tokens / sample_s,
        "sample_ms": sample_s * 1e3,
        "sample_without_logprobs_tokens_per_s": new_tokens / sample_nolp_s,
    });
    if args.json {
        println!("{report}");
    } else {
        println!(
            "temper bench model: llama d={HIDDEN} layers={LAYERS} vocab={VOCAB}, LoRA r={RANK}, {threads} threads"
        );
        println!(
            "  LoRA forward+backward  {BATCH}x{SEQ} tokens   {:>9.1} ms   {:>9.0} tokens/s",
            train_s * 1e3,
            tokens / train_s
        );
        println!(
            "  sampling (+logprobs)   {BATCH}x{NEW} new tokens {:>9.1} ms   {:>9.0} tokens/s",
            sample_s * 1e3,
            new_tokens / sample_s
        );
        println!(
            "  sampling (no logprobs) {BATCH}x{NEW} new tokens {:>9.1} ms   {:>9.0} tokens/s",
            sample_nolp_s * 1e3,
            new_tokens / sample_nolp_s
        );
    }
    Ok(())
}
