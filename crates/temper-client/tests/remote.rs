//! One training loop, written once against `Trainer`, run on the in-process
//! engine and on `temper api serve` over HTTP: same losses, bit for bit.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use temper_client::RemoteTrainer;
use temper_engine::{
    AdamParams, Datum, Engine, EngineError, LocalTrainer, Loss, LossInputs, Trainer,
};
use temper_model::{LoadOptions, LoraConfig, Pretrained, SamplingParams};
use temper_server::training_api::{app, ApiConfig, ApiState, BaseModel};

fn base() -> Arc<Pretrained> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/models/tiny-qwen3");
    Arc::new(Pretrained::load(&dir, &LoadOptions::default()).expect("fixture"))
}

fn datum() -> Datum {
    let tokens: Vec<u32> = (40..72).collect();
    Datum {
        model_input: tokens[..tokens.len() - 1].to_vec(),
        loss_fn_inputs: LossInputs {
            target_tokens: tokens[1..].to_vec(),
            ..Default::default()
        },
    }
}

/// A training API on a loopback port; returns its base URL.
async fn serve(b: Arc<Pretrained>, ckpt: PathBuf, api_key: Option<&str>) -> String {
    let state = ApiState::new(
        vec![BaseModel {
            name: "tiny".into(),
            model: b,
        }],
        ApiConfig {
            api_key: api_key.map(str::to_string),
            checkpoint_dir: ckpt,
            long_poll: Duration::from_secs(10),
            result_grace: Duration::from_secs(600),
            limits: Default::default(),
            adapters: Default::default(),
        },
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move { axum::serve(listener, app(state)).await });
    format!("http://{addr}")
}

/// The loop under test: pipelined steps, then sample from the result.
async fn train(t: &dyn Trainer) -> (Vec<f64>, Vec<u32>, Vec<f32>, Vec<f32>) {
    let mut pending = Vec::new();
    for _ in 0..4 {
        let fb = t.forward_backward(vec![datum()], Loss::CrossEntropy);
        let op = t.optim_step(AdamParams {
            learning_rate: 1e-2,
            ..Default::default()
        });
        pending.push((fb, op));
    }
    let mut losses = Vec::new();
    for (fb, op) in pending {
        losses.push(fb.await.expect("forward_backward").metrics["loss:sum"]);
        op.await.expect("optim_step");
    }
    let sampler = t.save_weights_for_sampler("s").await.expect("sampler");
    let prompt: Vec<u32> = (40..48).collect();
    let params = SamplingParams {
        max_tokens: 6,
        seed: Some(9),
        ignore_eos: true,
        ..Default::default()
    };
    let s = t
        .sample(&sampler, prompt.clone(), 1, params)
        .await
        .expect("sample");
    let full: Vec<u32> = prompt.iter().chain(&s[0].tokens).copied().collect();
    let lp = t
        .compute_logprobs(&sampler, full, 1.0)
        .await
        .expect("logprobs");
    (
        losses,
        s[0].tokens.clone(),
        s[0].logprobs.clone(),
        lp[lp.len() - 6..].to_vec(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_same_loop_runs_in_process_and_over_http_with_identical_numbers() {
    let b = base();
    let ckpt = tempfile::tempdir().expect("tempdir");

    // In process.
    let engine = Engine::new();
    engine.add_base_model("tiny", b.clone()).await.expect("add");
    let cfg = LoraConfig {
        rank: 8,
        alpha: temper_server::training_api::LORA_ALPHA,
        ..Default::default()
    };
    let run = engine.create_lora_run("tiny", cfg, 3).await.expect("run");
    let local = LocalTrainer::new(engine, run, ckpt.path().join("local"));
    let (l_losses, l_tokens, l_lp, l_check) = train(&local).await;

    // Over HTTP, on loopback.
    let url = serve(b.clone(), ckpt.path().join("remote"), Some("tml-test")).await;
    let remote = RemoteTrainer::connect(&url, "tml-test", "tiny", 8, Some(3))
        .await
        .expect("connect");
    let (r_losses, r_tokens, r_lp, r_check) = train(&remote).await;

    assert!(l_losses.windows(2).all(|w| w[1] < w[0]), "{l_losses:?}");
    assert_eq!(l_losses, r_losses);
    assert_eq!(l_tokens, r_tokens);
    assert_eq!(l_lp, r_lp);
    // Sampler logprobs equal compute_logprobs on both sides.
    assert_eq!(l_lp, l_check);
    assert_eq!(r_lp, r_check);

    // Errors come back typed; the run keeps working.
    let mut bad = datum();
    bad.model_input[0] = 1_000_000;
    let err = remote
        .forward_backward(vec![bad], Loss::CrossEntropy)
        .await
        .expect_err("out of range");
    assert!(
        matches!(err, EngineError::InvalidRequest(ref m) if m.contains("out of range")),
        "{err}"
    );
    let path = remote.save_state("c1").await.expect("save");
    remote.load_state(&path, true).await.expect("load");
    remote
        .forward(vec![datum()], Loss::CrossEntropy)
        .await
        .expect("forward after an error");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_custom_loss_trains_remotely_through_cross_entropy_weights() {
    let b = base();
    let ckpt = tempfile::tempdir().expect("tempdir");
    let engine = Engine::new();
    engine.add_base_model("tiny", b.clone()).await.expect("add");
    let cfg = LoraConfig {
        rank: 4,
        alpha: temper_server::training_api::LORA_ALPHA,
        ..Default::default()
    };
    let run = engine.create_lora_run("tiny", cfg, 1).await.expect("run");
    let local = LocalTrainer::new(engine, run, ckpt.path().join("local"));

    let url = serve(b.clone(), ckpt.path().join("remote"), None).await;
    let remote = RemoteTrainer::connect(&url, "tml-x", "tiny", 4, Some(1))
        .await
        .expect("connect");

    // Cross-entropy written as a custom loss: −Σ logprobs.
    let custom = Loss::Custom(Arc::new(
        |lp: &temper_model::candle_core::Tensor, _: &LossInputs| Ok(lp.sum_all()?.neg()?),
    ));
    let adam = AdamParams {
        learning_rate: 1e-2,
        ..Default::default()
    };
    for _ in 0..3 {
        let l = local
            .forward_backward(vec![datum()], Loss::CrossEntropy)
            .await
            .expect("local");
        let r = remote
            .forward_backward(vec![datum()], custom.clone())
            .await
            .expect("remote custom");
        let (a, b) = (l.metrics["loss:sum"], r.metrics["loss:sum"]);
        assert!((a - b).abs() <= 1e-4 * a.abs(), "{a} vs {b}");
        local.optim_step(adam).await.expect("step");
        remote.optim_step(adam).await.expect("step");
    }
    let l = local
        .forward(vec![datum()], Loss::CrossEntropy)
        .await
        .unwrap();
    let r = remote
        .forward(vec![datum()], Loss::CrossEntropy)
        .await
        .unwrap();
    assert_eq!(l.metrics["loss:sum"], r.metrics["loss:sum"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_http_the_trainer_scores_the_sampling_temperature_exactly() {
    let b = base();
    let ckpt = tempfile::tempdir().expect("tempdir");
    let url = serve(b.clone(), ckpt.path().join("remote"), None).await;
    let remote = RemoteTrainer::connect(&url, "tml-t", "tiny", 4, Some(2))
        .await
        .expect("connect");
    // One step so the LoRA B matrices are non-zero.
    remote
        .forward_backward(vec![datum()], Loss::CrossEntropy)
        .await
        .expect("forward_backward");
    remote
        .optim_step(AdamParams {
            learning_rate: 1e-2,
            ..Default::default()
        })
        .await
        .expect("optim_step");
    let sampler = remote.save_weights_for_sampler("t").await.expect("sampler");
    let prompt: Vec<u32> = (40..48).collect();
    for t in [0.6, 1.0, 1.3] {
        let params = SamplingParams {
            max_tokens: 6,
            temperature: t,
            seed: Some(4),
            ignore_eos: true,
            ..Default::default()
        };
        let s = remote
            .sample(&sampler, prompt.clone(), 1, params)
            .await
            .expect("sample");
        let q = s[0].logprobs.clone();
        let full: Vec<u32> = prompt.iter().chain(&s[0].tokens).copied().collect();
        // compute_logprobs at the sampling temperature == sampled logprobs.
        let lp = remote
            .compute_logprobs(&sampler, full.clone(), t)
            .await
            .expect("logprobs");
        assert_eq!(&lp[lp.len() - q.len()..], &q[..], "temperature {t}");
        // forward with loss_fn_config temperature: ratio exactly 1.
        let n = full.len() - 1;
        let mut sampled = vec![0.0f32; n];
        sampled[n - q.len()..].copy_from_slice(&q);
        let d = Datum {
            model_input: full[..n].to_vec(),
            loss_fn_inputs: LossInputs {
                target_tokens: full[1..].to_vec(),
                weights: None,
                logprobs: Some(sampled),
                advantages: Some(vec![1.0; n]),
                sequence_ratio_mask: None,
                temperature: Some(t),
            },
        };
        let out = remote
            .forward(vec![d.clone()], Loss::ImportanceSampling)
            .await
            .expect("forward");
        let p = &out.loss_fn_outputs[0].logprobs;
        assert_eq!(&p[p.len() - q.len()..], &q[..], "temperature {t}");
        if t != 1.0 {
            let mut d1 = d;
            d1.loss_fn_inputs.temperature = None;
            let out = remote
                .forward(vec![d1], Loss::ImportanceSampling)
                .await
                .expect("forward");
            let p = &out.loss_fn_outputs[0].logprobs;
            assert_ne!(&p[p.len() - q.len()..], &q[..], "temperature {t}");
        }
    }
}
