//! `temper bench api`: the same training steps through the in-process engine
//! and through `temper api serve` on loopback, to measure the API's overhead.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use clap::Args;
use temper_client::RemoteTrainer;
use temper_engine::{AdamParams, Datum, Engine, LocalTrainer, Loss, LossInputs, Trainer};
use temper_model::{LoadOptions, LoraConfig, Numerics, Pretrained};
use temper_server::training_api::{app, ApiConfig, ApiState, BaseModel, LORA_ALPHA};

/// Arguments of `temper bench api`.
#[derive(Args)]
pub struct ApiBenchArgs {
    /// Model directory or GGUF file.
    #[arg(long, default_value = "fixtures/models/tiny-qwen3")]
    model: PathBuf,
    /// Timed steps (after 2 warm-up steps).
    #[arg(long, default_value_t = 20)]
    steps: usize,
    /// Datums per step.
    #[arg(long, default_value_t = 8)]
    batch: usize,
    /// Tokens per datum.
    #[arg(long, default_value_t = 64)]
    seq_len: usize,
    /// LoRA rank.
    #[arg(long, default_value_t = 8)]
    rank: usize,
}

async fn steps(t: &dyn Trainer, data: &[Datum], n: usize) -> Result<Duration> {
    let adam = AdamParams {
        learning_rate: 1e-4,
        ..Default::default()
    };
    let start = Instant::now();
    for _ in 0..n {
        // Pipelined, as a training loop would issue them.
        let fb = t.forward_backward(data.to_vec(), Loss::CrossEntropy);
        let op = t.optim_step(adam);
        fb.await?;
        op.await?;
    }
    Ok(start.elapsed())
}

/// Run the benchmark.
pub fn run(args: ApiBenchArgs, numerics: Numerics) -> Result<()> {
    let opts = LoadOptions {
        precision: numerics.precision,
        matmul: numerics.matmul,
        ..LoadOptions::default()
    };
    let base = Arc::new(
        Pretrained::load(&args.model, &opts)
            .with_context(|| format!("loading {}", args.model.display()))?,
    );
    let vocab = base.config.vocab_size.min(base.tokenizer.vocab_size()) as u32;
    let data: Vec<Datum> = (0..args.batch)
        .map(|b| {
            let toks: Vec<u32> = (0..=args.seq_len)
                .map(|i| ((b * 97 + i * 13) as u32) % vocab)
                .collect();
            Datum {
                model_input: toks[..args.seq_len].to_vec(),
                loss_fn_inputs: LossInputs {
                    target_tokens: toks[1..].to_vec(),
                    ..Default::default()
                },
            }
        })
        .collect();
    let tokens_per_step = (args.batch * args.seq_len) as f64;
    let ckpt = std::env::temp_dir().join(format!("temper-bench-api-{}", std::process::id()));
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let (local_t, remote_t) = rt.block_on(async {
        let engine = Engine::new();
        engine.add_base_model("bench", base.clone()).await?;
        let cfg = LoraConfig {
            rank: args.rank,
            alpha: LORA_ALPHA,
            ..Default::default()
        };
        let run = engine.create_lora_run("bench", cfg, 0).await?;
        let local = LocalTrainer::new(engine, run, ckpt.clone());
        steps(&local, &data, 2).await?;
        let local_t = steps(&local, &data, args.steps).await?;

        let state = ApiState::new(
            vec![BaseModel {
                name: "bench".into(),
                model: base.clone(),
            }],
            ApiConfig {
                api_key: None,
                checkpoint_dir: ckpt.clone(),
                long_poll: Duration::from_secs(25),
                result_grace: Duration::from_secs(600),
                limits: Default::default(),
                adapters: Default::default(),
            },
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        tokio::spawn(async move { axum::serve(listener, app(state)).await });
        let remote = RemoteTrainer::connect(
            &format!("http://{addr}"),
            "tml-bench",
            "bench",
            args.rank,
            Some(0),
        )
        .await?;
        steps(&remote, &data, 2).await?;
        let remote_t = steps(&remote, &data, args.steps).await?;
        anyhow::Ok((local_t, remote_t))
    })?;
    let _ = std::fs::remove_dir_all(&ckpt);
    let row = |name: &str, d: Duration| {
        let per = d.as_secs_f64() / args.steps as f64;
        println!(
            "  {name:<22} {:>8.2} ms/step {:>8.1} steps/s {:>10.0} tokens/s",
            per * 1e3,
            1.0 / per,
            tokens_per_step / per
        );
    };
    println!(
        "temper bench api: {} ({} layers), LoRA r={}, {} steps of forward_backward+optim_step, batch {}x{} tokens",
        args.model.display(),
        base.config.num_layers,
        args.rank,
        args.steps,
        args.batch,
        args.seq_len
    );
    row("in-process engine", local_t);
    row("training API (HTTP)", remote_t);
    let overhead = (remote_t.as_secs_f64() - local_t.as_secs_f64()) / args.steps as f64;
    println!(
        "  API overhead: {:+.2} ms/step ({:.2}x the in-process time)",
        overhead * 1e3,
        remote_t.as_secs_f64() / local_t.as_secs_f64()
    );
    Ok(())
}
