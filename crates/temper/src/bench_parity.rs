//! `temper bench parity`: the numbers a golden comparison needs from one
//! model on one device, as one JSON file: per-token logprobs (the base model,
//! and with a PEFT adapter), greedy continuations, the LoRA gradients of a
//! summed token NLL, and the sampler-vs-trainer logprob mismatch.
//! `scripts/gpu/checks.py` computes the same with transformers + PEFT and
//! compares them; it runs on the CPU as well as on a GPU (built with
//! `--features cuda`), so the comparison itself is tested where no GPU is.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::Args;
use serde::Deserialize;
use serde_json::{json, Map, Value};
use temper_model::candle_core::{DType, Device, Tensor};
use temper_model::{
    GenerationRequest, LoadOptions, LoraAdapter, Numerics, Pretrained, Sampler, SamplingParams,
    ScoreInput,
};

/// Arguments of `temper bench parity`.
#[derive(Args)]
pub struct ParityArgs {
    /// Model directory (Hugging Face layout) or GGUF file.
    #[arg(long)]
    model: PathBuf,
    /// A PEFT LoRA adapter directory: logprobs with it, and its gradients.
    #[arg(long)]
    adapter: Option<PathBuf>,
    /// `cpu`, or `cuda` (GPU 0; needs a build with `--features cuda`).
    #[arg(long, default_value = "cpu")]
    device: String,
    /// Weights and activations on `--device cuda`: `f32` or `bf16` (on the
    /// CPU the global `--dtype` picks the matmul weights' precision).
    #[arg(long, default_value = "f32")]
    device_dtype: String,
    /// The work, a JSON file: `{"sequences": [[ids]], "prompts": [[ids]],
    /// "new_tokens": N, "samples": K}` (logprobs and gradients of the
    /// sequences; greedy continuations of the prompts; K sampled
    /// continuations per prompt for the mismatch).
    #[arg(long)]
    work: PathBuf,
    /// Where to write the result (JSON).
    #[arg(long)]
    out: PathBuf,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Work {
    sequences: Vec<Vec<u32>>,
    prompts: Vec<Vec<u32>>,
    new_tokens: usize,
    samples: usize,
}

/// The device a flag names.
pub fn parse_device(name: &str) -> Result<Device> {
    match name {
        "cpu" => Ok(Device::Cpu),
        "cuda" => cuda_device(),
        other => bail!("unknown device {other:?} (cpu or cuda)"),
    }
}

#[cfg(feature = "cuda")]
fn cuda_device() -> Result<Device> {
    Device::new_cuda(0).context("opening CUDA device 0")
}

#[cfg(not(feature = "cuda"))]
fn cuda_device() -> Result<Device> {
    bail!("this temper was built without CUDA: build it with `--features cuda` (scripts/gpu/build.sh)")
}

/// The dtype a flag names.
pub fn parse_dtype(name: &str) -> Result<DType> {
    match name {
        "f32" => Ok(DType::F32),
        "bf16" => Ok(DType::BF16),
        other => bail!("unknown dtype {other:?} (f32 or bf16)"),
    }
}

fn to_f32s(t: &Tensor) -> Result<Vec<f32>> {
    Ok(t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?)
}

/// Run `temper bench parity`.
pub fn run(a: ParityArgs, numerics: Numerics) -> Result<()> {
    let work: Work = serde_json::from_str(
        &std::fs::read_to_string(&a.work).with_context(|| format!("read {}", a.work.display()))?,
    )
    .with_context(|| format!("parse {}", a.work.display()))?;
    if work.sequences.iter().any(|s| s.len() < 2) {
        bail!("every sequence needs at least 2 tokens");
    }
    let device = parse_device(&a.device)?;
    let dtype = if device.is_cpu() {
        DType::F32
    } else {
        parse_dtype(&a.device_dtype)?
    };
    let opts = LoadOptions {
        device: device.clone(),
        dtype,
        precision: numerics.precision,
        matmul: numerics.matmul,
    };
    let t0 = Instant::now();
    let p = Pretrained::load(&a.model, &opts)
        .with_context(|| format!("loading {}", a.model.display()))?;
    let load_s = t0.elapsed().as_secs_f64();
    let model = &p.model;
    let adapter = match &a.adapter {
        Some(dir) => Some(
            LoraAdapter::load_peft(dir, &p.config, dtype, &device)
                .with_context(|| format!("loading adapter {}", dir.display()))?,
        ),
        None => None,
    };
    let inputs: Vec<ScoreInput<'_>> = work
        .sequences
        .iter()
        .map(|s| ScoreInput {
            input: &s[..s.len() - 1],
            targets: &s[1..],
        })
        .collect();
    let mut out = Map::new();
    out.insert("device".into(), json!(a.device));
    out.insert("dtype".into(), json!(format!("{dtype:?}").to_lowercase()));
    out.insert("precision".into(), json!(model.precision().as_str()));
    out.insert("load_s".into(), json!(load_s));

    // Logprobs of every sequence's tokens, base model (no autograd graph).
    let logprobs = |lora: Option<&LoraAdapter>| -> Result<Vec<Vec<f32>>> {
        let view = lora.map(LoraAdapter::inference_view);
        inputs
            .iter()
            .map(|i| {
                to_f32s(
                    &model
                        .score(i.input, i.targets, view.as_ref(), 1.0)?
                        .logprobs,
                )
            })
            .collect()
    };
    out.insert("logprobs".into(), json!(logprobs(None)?));

    if let Some(lora) = &adapter {
        out.insert("logprobs_adapter".into(), json!(logprobs(Some(lora))?));
        // Gradients of the summed NLL over every sequence, per LoRA tensor:
        // its norm, sum and first values (the whole tensors would be
        // megabytes of JSON on a 1B model).
        let mut nll = Vec::new();
        for i in &inputs {
            nll.push(
                model
                    .score(i.input, i.targets, Some(lora), 1.0)?
                    .logprobs
                    .sum_all()?
                    .neg()?,
            );
        }
        let loss = Tensor::stack(&nll, 0)?.sum_all()?;
        let grads = loss.backward()?;
        let mut g = Map::new();
        for (name, var) in lora.named_vars() {
            let Some(grad) = grads.get(var.as_tensor()) else {
                bail!("no gradient reached {name}");
            };
            let v = to_f32s(grad)?;
            let norm = v.iter().map(|x| f64::from(*x).powi(2)).sum::<f64>().sqrt();
            let sum: f64 = v.iter().map(|x| f64::from(*x)).sum();
            g.insert(
                name,
                json!({"norm": norm, "sum": sum, "head": &v[..v.len().min(16)]}),
            );
        }
        out.insert(
            "loss_adapter".into(),
            json!(loss.to_dtype(DType::F32)?.to_scalar::<f32>()?),
        );
        out.insert("grads".into(), Value::Object(g));
    }

    // Greedy continuations of the base model.
    let sampler = Sampler::new(model, &p.tokenizer, vec![]);
    let request = |prompt: &Vec<u32>, temperature: f64, seed: u64, n: usize| GenerationRequest {
        prompt: prompt.clone(),
        n,
        params: SamplingParams {
            max_tokens: work.new_tokens,
            temperature,
            ignore_eos: true,
            seed: Some(seed),
            logprobs: true,
            ..Default::default()
        },
    };
    let greedy: Vec<GenerationRequest> = work
        .prompts
        .iter()
        .map(|pr| request(pr, 0.0, 0, 1))
        .collect();
    let greedy = sampler.generate(&greedy, None)?;
    out.insert(
        "greedy".into(),
        json!(greedy
            .iter()
            .map(|c| c[0].tokens.clone())
            .collect::<Vec<_>>()),
    );

    // Sampler vs trainer: sample (T = 1, with the adapter where there is
    // one), then score the same tokens with the training forward.
    if work.samples > 0 {
        let reqs: Vec<GenerationRequest> = work
            .prompts
            .iter()
            .enumerate()
            .map(|(i, pr)| request(pr, 1.0, i as u64 + 1, work.samples))
            .collect();
        let t = Instant::now();
        let done = sampler.generate(&reqs, adapter.as_ref())?;
        let sample_s = t.elapsed().as_secs_f64();
        let (mut n, mut max_abs, mut sum_abs, mut k1, mut k3) = (0usize, 0f64, 0f64, 0f64, 0f64);
        for (pr, comps) in work.prompts.iter().zip(&done) {
            for c in comps {
                let Some(sampled) = &c.logprobs else {
                    bail!("the sampler returned no logprobs");
                };
                let seq: Vec<u32> = pr.iter().chain(&c.tokens).copied().collect();
                let scored = model.score(
                    &seq[..seq.len() - 1],
                    &seq[1..],
                    adapter.as_ref().map(LoraAdapter::inference_view).as_ref(),
                    1.0,
                )?;
                let trained = to_f32s(&scored.logprobs)?;
                let trained = &trained[pr.len() - 1..];
                for (s, t) in sampled.iter().zip(trained) {
                    let d = f64::from(*s) - f64::from(*t);
                    max_abs = max_abs.max(d.abs());
                    sum_abs += d.abs();
                    // KL(sampler || trainer) estimators on the sampler's own
                    // tokens: k1 = log p/q, k3 = (q/p - 1) - log(q/p).
                    k1 += d;
                    k3 += (-d).exp() - 1.0 + d;
                    n += 1;
                }
            }
        }
        let nf = n.max(1) as f64;
        out.insert(
            "mismatch".into(),
            json!({"tokens": n, "max_abs": max_abs, "mean_abs": sum_abs / nf,
                   "kl_k1": k1 / nf, "kl_k3": k3 / nf, "sample_s": sample_s}),
        );
    }
    let text = serde_json::to_string(&Value::Object(out))?;
    std::fs::write(&a.out, text).with_context(|| format!("write {}", a.out.display()))?;
    println!("wrote {}", a.out.display());
    Ok(())
}
