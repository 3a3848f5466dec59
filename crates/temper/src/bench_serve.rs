//! `temper bench serve`: generated tokens/s of `temper serve` at several
//! client concurrencies, against HF transformers `generate` on the same model
//! and the same work (`scripts/bench_serve.py`), and optionally llama.cpp's
//! `llama-batched-bench` on the same weights.
//!
//! The model is `--model` (an HF directory or a GGUF file, served in f32) or
//! else a fixed random-weight f32 Llama (hidden 256, intermediate 768, 4
//! layers, 4 heads, 2 KV heads, vocab 1000 with the tiny-llama fixture's
//! tokenizer). The peers get the very weights temper serves: an f32 HF
//! directory for transformers and an f32 GGUF for llama.cpp, both written by
//! temper's exporters (or `--llama-gguf` for another precision). At
//! concurrency C, C clients each
//! send `rounds` `/v1/completions` requests over loopback HTTP (prompt of
//! `prompt_len` token ids, exactly `max_tokens` new tokens, temperature 1,
//! no truncation); transformers runs `rounds` batches of C same-length
//! prompts (no padding: its best case); llama.cpp prefills C prompts and
//! decodes them in lockstep without sampling (`llama-batched-bench`, its
//! generated tokens over its prefill + decode time). Each side reports the
//! best of `repeats` measurements per level.
//!
//! With llama.cpp, a second table splits the work as `llama-batched-bench`
//! does: prefill tokens/s (C prompts of `prompt_len` tokens, its `S_PP`)
//! and decode tokens/s (C sequences in lockstep, its `S_TG`). temper's side
//! runs the in-process sampler (no HTTP) on C distinct prompts twice: with
//! one new token (the prefill and one step) and with `max_tokens`; prefill
//! is `C·prompt_len` over the first time, decode `C·(max_tokens − 1)` over
//! the difference. Then the peak RSS of each side: temper's process from
//! the loaded model on (the peak is reset after loading where Linux
//! allows), llama.cpp's largest `ru_maxrss` over its runs. A GGUF kept
//! quantized (`--dtype gguf`) is given to llama.cpp as it is: the same file.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::Args;
use temper_model::candle_core::DType;
use temper_model::{GgufQuant, LoadOptions, Numerics, Pretrained, RandomInit};
use temper_server::openai::{app, OpenAiState, ServeConfig};

/// Arguments of `temper bench serve`.
#[derive(Args)]
pub struct ServeBenchArgs {
    /// Client concurrencies, comma-separated.
    #[arg(long, default_value = "1,8,32")]
    concurrency: String,
    /// Prompt tokens per request.
    #[arg(long, default_value_t = 16)]
    prompt_len: usize,
    /// Generated tokens per request.
    #[arg(long, default_value_t = 128)]
    max_tokens: usize,
    /// Requests per client (batches for transformers).
    #[arg(long, default_value_t = 2)]
    rounds: usize,
    /// Measurements per level on each side; the best is reported (the
    /// machine may be shared).
    #[arg(long, default_value_t = 3)]
    repeats: usize,
    /// Python with torch + transformers for the comparison.
    #[arg(long, default_value = "/opt/pyref/bin/python")]
    python: String,
    /// Skip the transformers half.
    #[arg(long)]
    no_peer: bool,
    /// Model to serve: a Hugging Face directory or a GGUF file (default: a
    /// random tiny Llama).
    #[arg(long)]
    model: Option<PathBuf>,
    /// llama.cpp's `llama-batched-bench` binary (`scripts/build_llama_cpp.sh`
    /// builds it): adds a llama.cpp column.
    #[arg(long)]
    llama_batched_bench: Option<PathBuf>,
    /// GGUF file llama.cpp runs (default: `--model` itself when it is a
    /// GGUF kept quantized, else the served weights exported as f32 GGUF).
    #[arg(long, requires = "llama_batched_bench")]
    llama_gguf: Option<PathBuf>,
}

const HIDDEN: usize = 256;
const INTER: usize = 768;
const LAYERS: usize = 4;
const HEADS: usize = 4;
const KV_HEADS: usize = 2;
const VOCAB: usize = 1000;

fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// Write the benchmark model as a Hugging Face directory.
fn write_model(dir: &Path) -> Result<()> {
    let config = serde_json::json!({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": HIDDEN, "intermediate_size": INTER, "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS,
        "head_dim": HIDDEN / HEADS, "vocab_size": VOCAB, "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": false,
        "hidden_act": "silu", "bos_token_id": 994, "eos_token_id": 998, "torch_dtype": "float32",
    });
    let init = RandomInit { std: 0.05, seed: 0 };
    temper_model::write_random_model(dir, &config, init)?;
    let fixture = repo_root().join("fixtures/models/tiny-llama");
    for f in ["tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(fixture.join(f), dir.join(f))
            .with_context(|| format!("copying {f} from {}", fixture.display()))?;
    }
    Ok(())
}

/// Tokens/s of the server at concurrency `c`; prompts draw ids below `vocab`.
async fn measure(
    url: &str,
    c: usize,
    args: &ServeBenchArgs,
    vocab: usize,
    http: &reqwest::Client,
) -> Result<f64> {
    let t0 = Instant::now();
    let mut tasks = Vec::new();
    for client in 0..c {
        let http = http.clone();
        let url = url.to_string();
        let (rounds, plen, max_tokens) = (args.rounds, args.prompt_len, args.max_tokens);
        tasks.push(tokio::spawn(async move {
            let mut tokens = 0u64;
            for r in 0..rounds {
                let prompt: Vec<u32> = (0..plen)
                    .map(|i| ((client * 131 + r * 17 + i * 7) % (vocab - 8)) as u32)
                    .collect();
                let body = serde_json::json!({
                    "model": "bench", "prompt": prompt, "max_tokens": max_tokens,
                    "temperature": 1.0, "top_p": 1.0, "seed": client * 1000 + r, "ignore_eos": true,
                });
                let v: serde_json::Value = http
                    .post(format!("{url}/v1/completions"))
                    .json(&body)
                    .send()
                    .await?
                    .error_for_status()?
                    .json()
                    .await?;
                let n = v["usage"]["completion_tokens"].as_u64().unwrap_or(0);
                if n != max_tokens as u64 {
                    anyhow::bail!("expected {max_tokens} tokens, got {v}");
                }
                tokens += n;
            }
            Ok::<u64, anyhow::Error>(tokens)
        }));
    }
    let mut total = 0;
    for t in tasks {
        total += t.await.context("client task")??;
    }
    Ok(total as f64 / t0.elapsed().as_secs_f64())
}

/// Run the benchmark and print the table.
pub fn run(args: ServeBenchArgs, numerics: Numerics) -> Result<()> {
    let levels: Vec<usize> = args
        .concurrency
        .split(',')
        .map(|s| s.trim().parse::<usize>())
        .collect::<Result<_, _>>()
        .context("--concurrency expects comma-separated integers")?;
    if levels.is_empty() || levels.contains(&0) || args.rounds == 0 || args.max_tokens == 0 {
        bail!("concurrency levels, --rounds and --max-tokens must be >= 1");
    }
    let dir = std::env::temp_dir().join(format!("temper-bench-serve-{}", std::process::id()));
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    // `temper --threads` (or the core count) is in RAYON_NUM_THREADS by now.
    let threads = std::env::var("RAYON_NUM_THREADS")
        .ok()
        .and_then(|s| s.parse::<usize>().ok())
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    let result = bench(&dir, &levels, &args, (threads, numerics));
    let _ = std::fs::remove_dir_all(&dir);
    result
}

/// The served model, and an HF directory of the same weights for
/// transformers (written under `work` unless the model is one already).
fn served_model(
    work: &Path,
    args: &ServeBenchArgs,
    numerics: Numerics,
) -> Result<(Pretrained, PathBuf, String)> {
    let opts = LoadOptions {
        dtype: DType::F32,
        precision: numerics.precision,
        matmul: numerics.matmul,
        ..LoadOptions::default()
    };
    let Some(path) = &args.model else {
        let dir = work.join("model");
        write_model(&dir)?;
        let model = Pretrained::load(&dir, &opts)?;
        let what = format!("random f32 Llama (hidden {HIDDEN}, {LAYERS} layers, vocab {VOCAB})");
        return Ok((model, dir, what));
    };
    let model =
        Pretrained::load(path, &opts).with_context(|| format!("loading {}", path.display()))?;
    let what = format!(
        "{} with {} weights ({} layers, hidden {}, vocab {})",
        path.display(),
        model.model.precision(),
        model.config.num_layers,
        model.config.hidden_size,
        model.config.vocab_size
    );
    if path.is_dir() {
        return Ok((model, path.clone(), what));
    }
    let dir = work.join("hf");
    if !args.no_peer {
        temper_model::save_hf(&model, &model.model, &dir)
            .with_context(|| format!("writing {} for transformers", dir.display()))?;
    }
    Ok((model, dir, what))
}

/// One concurrency level of a speed table, each rate the best of its runs.
#[derive(Debug, Default, Clone, Copy)]
struct Rates {
    /// Generated tokens over prefill + decode time.
    overall: f64,
    /// Prompt tokens over prefill time.
    prefill: f64,
    /// Decoded tokens over decode time.
    decode: f64,
}

impl Rates {
    fn best(&mut self, other: Rates) {
        self.overall = self.overall.max(other.overall);
        self.prefill = self.prefill.max(other.prefill);
        self.decode = self.decode.max(other.decode);
    }
}

/// llama.cpp's rates per concurrency (best of `repeats` runs of
/// `llama-batched-bench`: `pl·tg / t`, `S_PP`, `S_TG`) and its peak RSS in
/// MB (the largest of its runs).
fn llama_cpp(
    bin: &Path,
    gguf: &Path,
    levels: &[usize],
    args: &ServeBenchArgs,
    threads: usize,
) -> Result<(HashMap<usize, Rates>, f64)> {
    let most = levels.iter().copied().max().unwrap_or(1);
    let ctx = most * (args.prompt_len + args.max_tokens) + 16;
    let npl = levels
        .iter()
        .map(usize::to_string)
        .collect::<Vec<_>>()
        .join(",");
    let mut best: HashMap<usize, Rates> = HashMap::new();
    let mut peak_mb = 0f64;
    for _ in 0..args.repeats.max(1) {
        let mut cmd = Command::new(bin);
        cmd.arg("-m")
            .arg(gguf)
            .args(["-c", &ctx.to_string(), "-b", "2048", "-ub", "512"])
            .args(["-npp", &args.prompt_len.to_string()])
            .args(["-ntg", &args.max_tokens.to_string()])
            .args(["-npl", &npl, "-t", &threads.to_string()])
            .args(["--output-format", "jsonl"]);
        let (out, rss_mb) = output_with_peak_rss(cmd, bin)?;
        peak_mb = peak_mb.max(rss_mb);
        if !out.status.success() {
            bail!(
                "{} failed:\n{}",
                bin.display(),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        // jsonl goes to the log stream; take every line that parses.
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        let mut seen = 0;
        for line in text.lines().filter(|l| l.trim_start().starts_with('{')) {
            let v: serde_json::Value =
                serde_json::from_str(line).with_context(|| format!("parsing {line:?}"))?;
            let field = |k: &str| {
                v[k].as_f64()
                    .with_context(|| format!("llama-batched-bench line without {k}: {line}"))
            };
            let (pl, tg, t) = (field("pl")?, field("tg")?, field("t")?);
            let rates = Rates {
                overall: pl * tg / t,
                prefill: field("speed_pp")?,
                decode: field("speed_tg")?,
            };
            best.entry(pl as usize).or_default().best(rates);
            seen += 1;
        }
        if seen == 0 {
            bail!("{} printed no results:\n{text}", bin.display());
        }
    }
    Ok((best, peak_mb))
}

/// Run `cmd` to completion with its output captured, and its peak RSS in
/// MB (`ru_maxrss` of that child, from `wait4`).
fn output_with_peak_rss(mut cmd: Command, bin: &Path) -> Result<(std::process::Output, f64)> {
    use std::io::Read;
    use std::os::unix::process::ExitStatusExt;
    let mut child = cmd
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .with_context(|| format!("running {}", bin.display()))?;
    let read = |r: Option<Box<dyn Read + Send>>| {
        std::thread::spawn(move || {
            let mut buf = Vec::new();
            if let Some(mut r) = r {
                r.read_to_end(&mut buf).map(|_| buf)
            } else {
                Ok(buf)
            }
        })
    };
    let out = read(
        child
            .stdout
            .take()
            .map(|r| Box::new(r) as Box<dyn Read + Send>),
    );
    let err = read(
        child
            .stderr
            .take()
            .map(|r| Box::new(r) as Box<dyn Read + Send>),
    );
    let pid = child.id() as libc::pid_t;
    // SAFETY: `rusage` is plain integers, for which all-zero bytes is valid.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    let mut status = 0;
    // SAFETY: `pid` is our unwaited child; `status` and `usage` are valid
    // for the call to fill. The child is reaped here, so `child` is never
    // waited on again.
    let r = unsafe { libc::wait4(pid, &mut status, 0, &mut usage) };
    if r != pid {
        bail!(
            "waiting for {}: {}",
            bin.display(),
            std::io::Error::last_os_error()
        );
    }
    let join = |h: std::thread::JoinHandle<std::io::Result<Vec<u8>>>| -> Result<Vec<u8>> {
        h.join()
            .map_err(|_| anyhow::anyhow!("reading {}'s output", bin.display()))?
            .with_context(|| format!("reading {}'s output", bin.display()))
    };
    let output = std::process::Output {
        status: std::process::ExitStatus::from_raw(status),
        stdout: join(out)?,
        stderr: join(err)?,
    };
    // Linux reports `ru_maxrss` in KiB.
    Ok((output, usage.ru_maxrss as f64 / 1024.0))
}

/// temper's prefill and decode tokens/s at `c` sequences, measured as
/// `llama-batched-bench` splits them (see the module docs): the in-process
/// sampler on `c` distinct prompts with 1 and with `max_tokens` new tokens.
fn split_rates(model: &Pretrained, c: usize, args: &ServeBenchArgs) -> Result<Rates> {
    let vocab = model.config.vocab_size;
    let sampler = temper_model::Sampler::new(&model.model, &model.tokenizer, vec![]);
    let run = |max_tokens: usize| -> Result<f64> {
        let reqs: Vec<temper_model::GenerationRequest> = (0..c)
            .map(|s| temper_model::GenerationRequest {
                prompt: (0..args.prompt_len)
                    .map(|i| ((s * 131 + i * 7 + 3) % (vocab - 8)) as u32)
                    .collect(),
                n: 1,
                params: temper_model::SamplingParams {
                    max_tokens,
                    temperature: 1.0,
                    ignore_eos: true,
                    seed: Some(s as u64),
                    ..Default::default()
                },
            })
            .collect();
        let t0 = Instant::now();
        let out = sampler.generate(&reqs, None)?;
        let secs = t0.elapsed().as_secs_f64();
        if out.iter().any(|o| o[0].tokens.len() != max_tokens) {
            bail!("the sampler stopped before {max_tokens} tokens");
        }
        Ok(secs)
    };
    let (t1, tn) = (run(1)?, run(args.max_tokens)?);
    let prompt = (c * args.prompt_len) as f64;
    Ok(Rates {
        overall: (c * args.max_tokens) as f64 / tn,
        prefill: prompt / t1,
        decode: (c * (args.max_tokens - 1)) as f64 / (tn - t1).max(f64::MIN_POSITIVE),
    })
}

fn bench(
    work: &Path,
    levels: &[usize],
    args: &ServeBenchArgs,
    (threads, numerics): (usize, Numerics),
) -> Result<()> {
    let (model, hf_dir, what) = served_model(work, args, numerics)?;
    let vocab = model.config.vocab_size;
    if vocab <= 8 {
        bail!("the model's vocabulary ({vocab}) is too small to draw prompts from");
    }
    let llama = match &args.llama_batched_bench {
        None => None,
        Some(bin) => {
            let same_file = args
                .model
                .as_ref()
                .filter(|p| p.is_file() && model.model.is_quantized());
            let gguf = match (&args.llama_gguf, same_file) {
                (Some(g), _) => g.clone(),
                (None, Some(file)) => file.clone(),
                (None, None) => {
                    let g = work.join("model-f32.gguf");
                    temper_model::save_gguf(&model, &model.model, &g, GgufQuant::F32)
                        .context("exporting the f32 GGUF for llama.cpp")?;
                    g
                }
            };
            Some((bin.clone(), gguf))
        }
    };
    let cfg = ServeConfig::defaults("bench", &model);
    let model = Arc::new(model);
    // From here on the peak is the served model's, not the loading's.
    let loaded_mb = crate::bench::rss::now_mb();
    crate::bench::rss::reset_peak();
    let state = OpenAiState::new(model.clone(), cfg);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let ours: Vec<f64> = rt.block_on(async {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let url = format!("http://{}", listener.local_addr()?);
        let server = tokio::spawn(async move { axum::serve(listener, app(state)).await });
        let http = reqwest::Client::new();
        // Warm-up.
        let warm = ServeBenchArgs {
            rounds: 1,
            max_tokens: 8,
            concurrency: String::new(),
            python: String::new(),
            model: None,
            llama_batched_bench: None,
            llama_gguf: None,
            ..*args
        };
        measure(&url, 1, &warm, vocab, &http).await?;
        let mut out = Vec::new();
        for &c in levels {
            let mut best = 0f64;
            for _ in 0..args.repeats.max(1) {
                best = best.max(measure(&url, c, args, vocab, &http).await?);
            }
            out.push(best);
        }
        server.abort();
        Ok::<_, anyhow::Error>(out)
    })?;
    drop(rt);
    let split: Vec<Rates> = if llama.is_some() {
        let mut out = Vec::new();
        for &c in levels {
            let mut best = Rates::default();
            for _ in 0..args.repeats.max(1) {
                best.best(split_rates(&model, c, args)?);
            }
            out.push(best);
        }
        out
    } else {
        Vec::new()
    };
    let temper_peak_mb = crate::bench::rss::peak_mb();
    let peer: Option<HashMap<String, f64>> = if args.no_peer {
        None
    } else {
        let script = repo_root().join("scripts/bench_serve.py");
        let out = Command::new(&args.python)
            .arg(&script)
            .args(["--model", &hf_dir.display().to_string()])
            .args(["--concurrency", &args.concurrency])
            .args(["--prompt-len", &args.prompt_len.to_string()])
            .args(["--max-tokens", &args.max_tokens.to_string()])
            .args(["--rounds", &args.rounds.to_string()])
            .args(["--threads", &threads.to_string()])
            .args(["--repeats", &args.repeats.to_string()])
            .output()
            .with_context(|| format!("running {} {}", args.python, script.display()))?;
        if !out.status.success() {
            bail!(
                "{} failed:\n{}",
                script.display(),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        let text = String::from_utf8_lossy(&out.stdout);
        let line = text.lines().last().unwrap_or("");
        Some(serde_json::from_str(line).with_context(|| format!("parsing {line:?}"))?)
    };
    let llama = match &llama {
        Some((bin, gguf)) => {
            let (rates, peak) = llama_cpp(bin, gguf, levels, args, threads)?;
            Some((gguf, rates, peak))
        }
        None => None,
    };
    println!(
        "temper bench serve: {what}, prompt {} tokens, {} new tokens per request, {} request(s) per client, {threads} threads, CPU, best of {}",
        args.prompt_len, args.max_tokens, args.rounds, args.repeats.max(1)
    );
    if let Some((gguf, _, _)) = &llama {
        println!("llama.cpp: {} (no sampling)", gguf.display());
    }
    println!(
        "{:>11}  {:>13}  {:>18}  {:>6}  {:>15}  {:>6}",
        "concurrency", "temper tok/s", "transformers tok/s", "ratio", "llama.cpp tok/s", "ratio"
    );
    let cell = |ours: f64, theirs: Option<f64>| match theirs {
        Some(t) => (format!("{t:.1}"), format!("{:.2}x", ours / t)),
        None => ("-".to_string(), "-".to_string()),
    };
    for (&c, &ours) in levels.iter().zip(&ours) {
        let (hf, hf_ratio) = cell(
            ours,
            peer.as_ref().and_then(|p| p.get(&c.to_string()).copied()),
        );
        let theirs = llama
            .as_ref()
            .and_then(|(_, l, _)| l.get(&c).map(|r| r.overall));
        let (lc, lc_ratio) = cell(ours, theirs);
        println!("{c:>11}  {ours:>13.1}  {hf:>18}  {hf_ratio:>6}  {lc:>15}  {lc_ratio:>6}");
    }
    let Some((_, theirs, llama_peak)) = &llama else {
        return Ok(());
    };
    println!(
        "prefill and decode as llama-batched-bench splits them (temper: in-process sampler, {} prompt tokens, then {} decode steps)",
        args.prompt_len,
        args.max_tokens - 1
    );
    println!(
        "{:>11}  {:>14}  {:>17}  {:>6}  {:>13}  {:>16}  {:>6}",
        "concurrency",
        "temper prefill",
        "llama.cpp prefill",
        "ratio",
        "temper decode",
        "llama.cpp decode",
        "ratio"
    );
    for (&c, ours) in levels.iter().zip(&split) {
        let t = theirs.get(&c);
        let (pp, pp_ratio) = cell(ours.prefill, t.map(|r| r.prefill));
        let (tg, tg_ratio) = cell(ours.decode, t.map(|r| r.decode));
        println!(
            "{c:>11}  {:>14.1}  {pp:>17}  {pp_ratio:>6}  {:>13.1}  {tg:>16}  {tg_ratio:>6}",
            ours.prefill, ours.decode
        );
    }
    let mb = |v: Option<f64>| v.map_or("-".to_string(), |v| format!("{v:.0} MB"));
    println!(
        "peak RSS: temper {} (after loading {}; {} weights), llama-batched-bench {llama_peak:.0} MB",
        mb(temper_peak_mb),
        mb(loaded_mb),
        model.model.precision()
    );
    Ok(())
}
