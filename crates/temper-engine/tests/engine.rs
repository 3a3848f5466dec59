//! The training primitives in process, on the fixture models.

use std::path::PathBuf;
use std::sync::Arc;

use temper_engine::{AdamParams, Datum, EngineError, Loss, LossInputs, TrainingRun};
use temper_model::candle_core::{Device, Tensor, Var};
use temper_model::{LoadOptions, LoraConfig, Pretrained, SamplingParams};

fn base(name: &str) -> Arc<Pretrained> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../fixtures/models")
        .join(name);
    Arc::new(Pretrained::load(&dir, &LoadOptions::default()).expect("fixture loads"))
}

fn lora(rank: usize) -> LoraConfig {
    LoraConfig {
        rank,
        alpha: 2.0 * rank as f64,
        ..Default::default()
    }
}

/// Next-token datum for a whole sequence.
fn sft_datum(tokens: &[u32]) -> Datum {
    Datum {
        model_input: tokens[..tokens.len() - 1].to_vec(),
        loss_fn_inputs: LossInputs {
            target_tokens: tokens[1..].to_vec(),
            ..Default::default()
        },
    }
}

fn sft_batch(b: &Pretrained) -> Vec<Datum> {
    [
        "What is 12 + 7? 19",
        "def add(a, b): return a + b",
        "The cat sat on the mat.",
        "1 2 3 4 5 6",
    ]
    .iter()
    .map(|t| sft_datum(&b.tokenizer.encode(t, false).expect("encode")))
    .collect()
}

#[test]
fn losses_match_hand_computed_values() {
    let dev = Device::Cpu;
    let p = Var::new(&[-1.0f32, -2.0], &dev).unwrap();
    let inputs = LossInputs {
        target_tokens: vec![0, 0],
        weights: None,
        logprobs: Some(vec![-1.5, -1.0]),
        advantages: Some(vec![1.0, -2.0]),
        sequence_ratio_mask: None,
        temperature: None,
    };
    let r = [0.5f64.exp(), (-1.0f64).exp()];
    let cases: Vec<(Loss, f64, [f64; 2])> = vec![
        // −Σ p  (weights default to 1)
        (Loss::CrossEntropy, 3.0, [-1.0, -1.0]),
        // −Σ r·A ; d/dp = −r·A
        (
            Loss::ImportanceSampling,
            -(r[0] - 2.0 * r[1]),
            [-r[0], 2.0 * r[1]],
        ),
        // r = [1.65, 0.37] → clip [1.2, 0.8]; min(1.65, 1.2) = 1.2 (clipped: no grad),
        // min(−0.74, −1.6) = −1.6 (clipped: no grad)
        (
            Loss::Ppo {
                clip_low: 0.8,
                clip_high: 1.2,
            },
            0.4,
            [0.0, 0.0],
        ),
        // −Σ sg(clip r)·p·A = −(1.2·−1·1 + 0.8·−2·−2) = −2.0 ; d/dp = −clip(r)·A
        (
            Loss::Cispo {
                clip_low: 0.8,
                clip_high: 1.2,
            },
            -2.0,
            [-1.2, 1.6],
        ),
        // −Σ (p·A − ½β(p−q)²), β = 0.05: −((−1 − 0.00625) + (4 − 0.025))
        (
            Loss::Dro { beta: 0.05 },
            -2.96875,
            // d/dp = −(A − β(p − q)) = [−(1 − 0.05·0.5), −(−2 − 0.05·(−1))]
            [-(1.0 - 0.05 * 0.5), -(-2.0 + 0.05)],
        ),
    ];
    for (loss, want, want_grad) in cases {
        let l = loss.compute(p.as_tensor(), &inputs).expect("compute");
        let got = l.to_scalar::<f32>().unwrap() as f64;
        assert!((got - want).abs() < 1e-5, "{loss:?}: {got} vs {want}");
        let g: Vec<f32> = l
            .backward()
            .unwrap()
            .get(p.as_tensor())
            .unwrap()
            .to_vec1()
            .unwrap();
        for (a, b) in g.iter().zip(want_grad) {
            assert!(
                (*a as f64 - b).abs() < 1e-5,
                "{loss:?} grad {g:?} vs {want_grad:?}"
            );
        }
    }
    // Weights scale cross-entropy per token; 0 masks.
    let weighted = LossInputs {
        weights: Some(vec![1.0, 0.5]),
        ..inputs
    };
    let l = Loss::CrossEntropy
        .compute(p.as_tensor(), &weighted)
        .unwrap();
    assert!((l.to_scalar::<f32>().unwrap() - 2.0).abs() < 1e-6);
    // A custom loss: −Σ p², built from differentiable ops.
    let custom = Loss::Custom(Arc::new(|p: &Tensor, _: &LossInputs| {
        Ok(p.sqr()?.sum_all()?.neg()?)
    }));
    let l = custom.compute(p.as_tensor(), &weighted).unwrap();
    assert!((l.to_scalar::<f32>().unwrap() + 5.0).abs() < 1e-6);
}

#[test]
fn sft_loop_drives_loss_down_monotonically() {
    let b = base("tiny-qwen3");
    let data = sft_batch(&b);
    let mut run = TrainingRun::lora(b, lora(8), 0).unwrap();
    let adam = AdamParams {
        learning_rate: 2e-3,
        ..Default::default()
    };
    let mut losses = Vec::new();
    for _ in 0..12 {
        let out = run.forward_backward(&data, &Loss::CrossEntropy).unwrap();
        losses.push(out.metrics["loss:sum"]);
        run.optim_step(&adam).unwrap();
    }
    for w in losses.windows(2) {
        assert!(w[1] < w[0], "loss went up: {losses:?}");
    }
    assert!(losses[11] < 0.8 * losses[0], "{losses:?}");
}

#[test]
fn full_parameter_sft_also_learns() {
    let b = base("tiny-llama");
    let data = sft_batch(&b);
    let mut run = TrainingRun::full(b.clone()).unwrap();
    let first = run
        .forward_backward(&data, &Loss::CrossEntropy)
        .unwrap()
        .metrics["loss:sum"];
    run.optim_step(&AdamParams {
        learning_rate: 1e-3,
        ..Default::default()
    })
    .unwrap();
    let second = run.forward(&data, &Loss::CrossEntropy).unwrap().metrics["loss:sum"];
    assert!(second < first, "{first} -> {second}");
    // The shared base is untouched.
    let fresh = TrainingRun::full(b).unwrap();
    let again = fresh.forward(&data, &Loss::CrossEntropy).unwrap().metrics["loss:sum"];
    assert_eq!(again, first);
}

#[test]
fn importance_sampling_rl_raises_reward() {
    let b = base("tiny-qwen2");
    let prompt = b.tokenizer.encode("What is 12 + 7?", false).unwrap();
    let mut run = TrainingRun::lora(b, lora(8), 1).unwrap();
    let params = |seed: u64| SamplingParams {
        max_tokens: 4,
        temperature: 1.0,
        seed: Some(seed),
        ignore_eos: true,
        ..Default::default()
    };
    // Toy reward: the completion contains token X, X being a token the
    // initial policy emits in some but not most completions.
    let probe = run.sample(&prompt, 64, params(999)).unwrap();
    let mut counts = std::collections::HashMap::new();
    for c in &probe {
        let mut seen: Vec<u32> = c.tokens.clone();
        seen.sort();
        seen.dedup();
        for t in seen {
            *counts.entry(t).or_insert(0usize) += 1;
        }
    }
    let mut cands: Vec<(u32, usize)> = counts.into_iter().collect();
    cands.sort();
    eprintln!("token counts over 64 probe completions: {cands:?}");
    let (x, _) = cands
        .iter()
        .copied()
        .filter(|&(_, n)| (2..=24).contains(&n))
        .max_by_key(|&(t, n)| (n, t))
        .expect("a token of moderate frequency");
    let reward = |toks: &[u32]| if toks.contains(&x) { 1.0f32 } else { 0.0 };
    let mean_reward = |run: &TrainingRun, seed: u64| -> f32 {
        let s = run.sample(&prompt, 64, params(seed)).unwrap();
        s.iter().map(|c| reward(&c.tokens)).sum::<f32>() / s.len() as f32
    };
    let before = mean_reward(&run, 12345);
    let adam = AdamParams {
        learning_rate: 2e-2,
        ..Default::default()
    };
    for step in 0..15u64 {
        let group = run.sample(&prompt, 16, params(step)).unwrap();
        let rewards: Vec<f32> = group.iter().map(|c| reward(&c.tokens)).collect();
        let mean = rewards.iter().sum::<f32>() / rewards.len() as f32;
        let data: Vec<Datum> = group
            .iter()
            .zip(&rewards)
            .filter(|(_, r)| **r != mean)
            .map(|(c, r)| {
                let full: Vec<u32> = prompt.iter().chain(&c.tokens).copied().collect();
                let n_prompt = prompt.len() - 1;
                let lp = c.logprobs.clone().unwrap();
                let mut logprobs = vec![0.0; n_prompt];
                logprobs.extend(lp);
                let mut adv = vec![0.0; n_prompt];
                adv.extend(std::iter::repeat_n(r - mean, c.tokens.len()));
                Datum {
                    model_input: full[..full.len() - 1].to_vec(),
                    loss_fn_inputs: LossInputs {
                        target_tokens: full[1..].to_vec(),
                        weights: None,
                        logprobs: Some(logprobs),
                        advantages: Some(adv),
                        sequence_ratio_mask: None,
                        temperature: None,
                    },
                }
            })
            .collect();
        if data.is_empty() {
            continue;
        }
        let out = run
            .forward_backward(&data, &Loss::ImportanceSampling)
            .unwrap();
        // On-policy: learner logprobs equal the sampler's exactly (ratio 1).
        for (d, o) in data.iter().zip(&out.loss_fn_outputs) {
            let q = d.loss_fn_inputs.logprobs.as_ref().unwrap();
            let n_prompt = prompt.len() - 1;
            assert_eq!(&o.logprobs[n_prompt..], &q[n_prompt..]);
        }
        run.optim_step(&adam).unwrap();
    }
    let after = mean_reward(&run, 12345);
    eprintln!("token {x}: mean reward {before} -> {after}");
    assert!(after > before + 0.25, "reward {before} -> {after}");
}

#[test]
fn save_kill_load_continues_bit_identically() {
    let b = base("tiny-qwen3");
    let data = sft_batch(&b);
    let adam = AdamParams {
        learning_rate: 1e-3,
        weight_decay: 0.01,
        grad_clip_norm: 1.0,
        ..Default::default()
    };
    let dir = tempfile::tempdir().unwrap();
    let ckpt = dir.path().join("step2");
    let (loss3, loss4) = {
        let mut run = TrainingRun::lora(b.clone(), lora(4), 5).unwrap();
        for _ in 0..2 {
            run.forward_backward(&data, &Loss::CrossEntropy).unwrap();
            run.optim_step(&adam).unwrap();
        }
        run.save_state(&ckpt).unwrap();
        let l3 = run
            .forward_backward(&data, &Loss::CrossEntropy)
            .unwrap()
            .metrics["loss:sum"];
        run.optim_step(&adam).unwrap();
        let l4 = run.forward(&data, &Loss::CrossEntropy).unwrap().metrics["loss:sum"];
        (l3, l4)
        // the run is dropped here: the "kill"
    };
    let mut resumed = TrainingRun::lora(b, lora(4), 999).unwrap();
    resumed.load_state(&ckpt, true).unwrap();
    assert_eq!(resumed.step(), 2);
    let l3 = resumed
        .forward_backward(&data, &Loss::CrossEntropy)
        .unwrap()
        .metrics["loss:sum"];
    resumed.optim_step(&adam).unwrap();
    let l4 = resumed.forward(&data, &Loss::CrossEntropy).unwrap().metrics["loss:sum"];
    assert_eq!(l3.to_bits(), loss3.to_bits());
    assert_eq!(l4.to_bits(), loss4.to_bits());
    // No temporary directories are left behind.
    let names: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(names, vec![std::ffi::OsString::from("step2")]);
}

#[test]
fn gradient_accumulation_equals_one_big_batch() {
    let b = base("tiny-llama");
    let data = sft_batch(&b);
    let adam = AdamParams {
        learning_rate: 1e-2,
        ..Default::default()
    };
    let mut one = TrainingRun::lora(b.clone(), lora(4), 7).unwrap();
    let mut acc = TrainingRun::lora(b, lora(4), 7).unwrap();
    // Move B off zero first so every tensor has a gradient.
    for r in [&mut one, &mut acc] {
        r.forward_backward(&data, &Loss::CrossEntropy).unwrap();
        r.optim_step(&adam).unwrap();
    }
    one.forward_backward(&data, &Loss::CrossEntropy).unwrap();
    acc.forward_backward(&data[..2], &Loss::CrossEntropy)
        .unwrap();
    acc.forward_backward(&data[2..], &Loss::CrossEntropy)
        .unwrap();
    let s1 = one.optim_step(&adam).unwrap();
    let s2 = acc.optim_step(&adam).unwrap();
    assert!((s1.grad_norm - s2.grad_norm).abs() <= 1e-5 * s1.grad_norm);
    let mut worst = 0f32;
    for ((_, a), (_, c)) in one.named_params().iter().zip(acc.named_params()) {
        let d = (a.as_tensor() - c.as_tensor())
            .unwrap()
            .abs()
            .unwrap()
            .max_all()
            .unwrap();
        worst = worst.max(d.to_scalar::<f32>().unwrap());
    }
    assert!(worst <= 1e-5, "max param difference {worst}");
}

#[test]
fn bad_requests_are_rejected_and_do_not_poison_the_run() {
    let b = base("tiny-qwen3");
    let data = sft_batch(&b);
    let mut run = TrainingRun::lora(b, lora(4), 0).unwrap();
    let mut bad = data[0].clone();
    bad.model_input[0] = 50_000;
    let mut short = data[0].clone();
    short.loss_fn_inputs.target_tokens.pop();
    for (batch, loss, needle) in [
        (vec![bad], Loss::CrossEntropy, "out of range"),
        (vec![short], Loss::CrossEntropy, "target tokens"),
        (vec![data[0].clone()], Loss::ImportanceSampling, "logprobs"),
        (vec![], Loss::CrossEntropy, "empty"),
    ] {
        match run.forward_backward(&batch, &loss) {
            Err(EngineError::InvalidRequest(m)) => assert!(m.contains(needle), "{m}"),
            other => panic!(
                "expected InvalidRequest({needle}), got {:?}",
                other.map(|_| ())
            ),
        }
    }
    assert!(matches!(
        run.optim_step(&AdamParams::default()),
        Err(EngineError::InvalidRequest(_))
    ));
    run.forward_backward(&data, &Loss::CrossEntropy).unwrap();
    run.optim_step(&AdamParams::default()).unwrap();
    assert_eq!(run.step(), 1);
}

#[test]
fn sampler_weights_are_immutable_and_match_compute_logprobs() {
    let b = base("tiny-qwen2");
    let data = sft_batch(&b);
    let prompt = data[0].model_input.clone();
    let mut run = TrainingRun::lora(b, lora(4), 0).unwrap();
    run.forward_backward(&data, &Loss::CrossEntropy).unwrap();
    run.optim_step(&AdamParams {
        learning_rate: 1e-2,
        ..Default::default()
    })
    .unwrap();
    let frozen = run.sampler_weights().unwrap();
    let s = frozen
        .sample(
            &prompt,
            2,
            SamplingParams {
                max_tokens: 6,
                seed: Some(1),
                ignore_eos: true,
                ..Default::default()
            },
        )
        .unwrap();
    let full: Vec<u32> = prompt.iter().chain(&s[0].tokens).copied().collect();
    let lp = frozen.compute_logprobs(&full, 1.0).unwrap();
    assert_eq!(&lp[lp.len() - 6..], s[0].logprobs.as_deref().unwrap());
    assert_eq!(run.compute_logprobs(&full, 1.0).unwrap(), lp);
    // Training on does not change the saved sampler weights.
    run.forward_backward(&data, &Loss::CrossEntropy).unwrap();
    run.optim_step(&AdamParams {
        learning_rate: 1e-2,
        ..Default::default()
    })
    .unwrap();
    assert_eq!(frozen.compute_logprobs(&full, 1.0).unwrap(), lp);
    assert_ne!(run.compute_logprobs(&full, 1.0).unwrap(), lp);
}

#[test]
fn engine_pipelines_calls_and_completes_them_in_order() {
    use temper_engine::Engine;
    let b = base("tiny-qwen3");
    let data = sft_batch(&b);
    let engine = Engine::new();
    engine.add_base_model("tiny", b).wait().unwrap();
    assert_eq!(
        engine.base_models().wait().unwrap(),
        vec!["tiny".to_string()]
    );
    let run = engine.create_lora_run("tiny", lora(4), 0).wait().unwrap();
    let adam = AdamParams {
        learning_rate: 2e-3,
        ..Default::default()
    };
    // Submit five steps back to back without waiting, then collect.
    let mut pending = Vec::new();
    for _ in 0..5 {
        let fb = engine.forward_backward(&run, data.clone(), Loss::CrossEntropy);
        let st = engine.optim_step(&run, adam);
        pending.push((fb, st));
    }
    let losses: Vec<f64> = pending
        .into_iter()
        .map(|(fb, st)| {
            let l = fb.wait().unwrap().metrics["loss:sum"];
            st.wait().unwrap();
            l
        })
        .collect();
    for w in losses.windows(2) {
        assert!(w[1] < w[0], "{losses:?}");
    }
    let key = "run/sampler_weights/s5";
    engine.save_weights_for_sampler(&run, key).wait().unwrap();
    let prompt = data[0].model_input.clone();
    let params = SamplingParams {
        max_tokens: 4,
        seed: Some(2),
        ignore_eos: true,
        ..Default::default()
    };
    let out = engine
        .sample(key, prompt.clone(), 1, params)
        .wait()
        .unwrap();
    let full: Vec<u32> = prompt.iter().chain(&out[0].tokens).copied().collect();
    let lp = engine.compute_logprobs(key, full, 1.0).wait().unwrap();
    assert_eq!(&lp[lp.len() - 4..], out[0].logprobs.as_deref().unwrap());
    // Errors come back through the future; the engine keeps serving.
    assert!(matches!(
        engine.optim_step("run-404", adam).wait(),
        Err(EngineError::NotFound(_))
    ));
    assert!(engine
        .forward(&run, data, Loss::CrossEntropy)
        .wait()
        .is_ok());
}

#[test]
fn exported_peft_adapter_reproduces_the_trained_run() {
    let b = base("tiny-qwen3");
    let data = sft_batch(&b);
    let mut run = TrainingRun::lora(b.clone(), lora(4), 0).unwrap();
    for _ in 0..2 {
        run.forward_backward(&data, &Loss::CrossEntropy).unwrap();
        run.optim_step(&AdamParams {
            learning_rate: 1e-2,
            ..Default::default()
        })
        .unwrap();
    }
    let dir = tempfile::tempdir().unwrap();
    run.export_peft(dir.path()).unwrap();
    let adapter = temper_model::LoraAdapter::load_peft(
        dir.path(),
        &b.config,
        b.model.dtype(),
        b.model.device(),
    )
    .unwrap();
    let tokens: Vec<u32> = data[1].model_input.clone();
    let ours = run.compute_logprobs(&tokens, 1.0).unwrap();
    let s = b
        .model
        .score(
            &tokens[..tokens.len() - 1],
            &tokens[1..],
            Some(&adapter),
            1.0,
        )
        .unwrap();
    assert_eq!(s.logprobs.to_vec1::<f32>().unwrap(), ours);
    // A full-parameter run has no adapter to export.
    let full = TrainingRun::full(b).unwrap();
    assert!(matches!(
        full.export_peft(dir.path()),
        Err(EngineError::InvalidRequest(_))
    ));
}

/// A LoRA run one step away from its init (B ≠ 0, so the adapter matters).
fn trained_lora_run(b: &Arc<Pretrained>) -> TrainingRun {
    let data = sft_batch(b);
    let mut run = TrainingRun::lora(b.clone(), lora(4), 0).unwrap();
    run.forward_backward(&data, &Loss::CrossEntropy).unwrap();
    run.optim_step(&AdamParams {
        learning_rate: 1e-2,
        ..Default::default()
    })
    .unwrap();
    run
}

/// The RL datum of one sampled completion: sampler logprobs `q` on the
/// completion, weight 0 on the prompt.
fn rl_datum(prompt: &[u32], tokens: &[u32], q: &[f32], temperature: f64) -> Datum {
    let full: Vec<u32> = prompt.iter().chain(tokens).copied().collect();
    let n = full.len() - 1;
    let start = prompt.len() - 1;
    let mut logprobs = vec![0.0f32; n];
    logprobs[start..].copy_from_slice(q);
    let mut weights = vec![0.0f32; n];
    weights[start..].iter_mut().for_each(|w| *w = 1.0);
    Datum {
        model_input: full[..n].to_vec(),
        loss_fn_inputs: LossInputs {
            target_tokens: full[1..].to_vec(),
            weights: Some(weights),
            logprobs: Some(logprobs),
            advantages: Some(vec![1.0; n]),
            sequence_ratio_mask: None,
            temperature: Some(temperature),
        },
    }
}

#[test]
fn trainer_scores_the_sampling_temperature_so_the_on_policy_ratio_is_one() {
    let b = base("tiny-qwen3");
    let run = trained_lora_run(&b);
    let frozen = run.sampler_weights().unwrap();
    let prompt = sft_batch(&b)[0].model_input.clone();
    for t in [0.6, 1.0, 1.3] {
        let s = frozen
            .sample(
                &prompt,
                2,
                SamplingParams {
                    max_tokens: 8,
                    temperature: t,
                    seed: Some(3),
                    ignore_eos: true,
                    ..Default::default()
                },
            )
            .unwrap();
        for c in &s {
            let q = c.logprobs.as_deref().unwrap();
            let full: Vec<u32> = prompt.iter().chain(&c.tokens).copied().collect();
            // compute_logprobs at the sampling temperature is the sampler's number.
            let lp = frozen.compute_logprobs(&full, t).unwrap();
            assert_eq!(&lp[lp.len() - q.len()..], q, "temperature {t}");
            assert_eq!(run.compute_logprobs(&full, t).unwrap(), lp);
            // The learner scores the datum at its temperature: p == q exactly.
            let d = rl_datum(&prompt, &c.tokens, q, t);
            let out = run.forward(&[d], &Loss::ImportanceSampling).unwrap();
            let p = &out.loss_fn_outputs[0].logprobs;
            assert_eq!(&p[p.len() - q.len()..], q, "temperature {t}");
            // And at T = 1 it would not be, away from T = 1.
            if t != 1.0 {
                let d1 = rl_datum(&prompt, &c.tokens, q, 1.0);
                let p1 = run.forward(&[d1], &Loss::ImportanceSampling).unwrap();
                let p1 = &p1.loss_fn_outputs[0].logprobs;
                assert_ne!(&p1[p1.len() - q.len()..], q, "temperature {t}");
            }
        }
    }
}

#[test]
fn temperature_scaled_loss_gradient_matches_finite_differences() {
    let b = base("tiny-qwen3");
    let mut run = trained_lora_run(&b);
    let frozen = run.sampler_weights().unwrap();
    let prompt = sft_batch(&b)[1].model_input.clone();
    let t = 0.6;
    let s = frozen
        .sample(
            &prompt,
            1,
            SamplingParams {
                max_tokens: 6,
                temperature: t,
                seed: Some(5),
                ignore_eos: true,
                ..Default::default()
            },
        )
        .unwrap();
    let q = s[0].logprobs.clone().unwrap();
    // Off-policy q (shifted) so the ratio is not 1 and the loss is not flat.
    let q: Vec<f32> = q.iter().map(|x| x - 0.3).collect();
    let data = vec![rl_datum(&prompt, &s[0].tokens, &q, t)];
    let loss = Loss::Ppo {
        clip_low: 0.0,
        clip_high: 100.0,
    };
    run.forward_backward(&data, &loss).unwrap();
    let grads = run.accumulated_grads().clone();
    let loss_at =
        |run: &TrainingRun| -> f64 { run.forward(&data, &loss).unwrap().metrics["loss:sum"] };
    let mut checked = 0;
    for (name, var) in run.named_params() {
        let Some(g) = grads.get(&name) else { continue };
        let g: Vec<f32> = g.flatten_all().unwrap().to_vec1().unwrap();
        let base_v: Vec<f32> = var.as_tensor().flatten_all().unwrap().to_vec1().unwrap();
        // The element with the largest gradient: a well-conditioned probe.
        let (k, &gk) = g
            .iter()
            .enumerate()
            .max_by(|a, b| a.1.abs().total_cmp(&b.1.abs()))
            .unwrap();
        if gk.abs() < 1e-3 {
            continue;
        }
        let eps = 1e-2f32;
        let set = |delta: f32| {
            let mut v = base_v.clone();
            v[k] += delta;
            var.set(&Tensor::from_vec(v, var.shape(), var.device()).unwrap())
                .unwrap();
        };
        set(eps);
        let up = loss_at(&run);
        set(-eps);
        let down = loss_at(&run);
        set(0.0);
        let fd = (up - down) / (2.0 * eps as f64);
        let rel = (fd - gk as f64).abs() / (gk.abs() as f64);
        assert!(
            rel < 2e-2,
            "{name}[{k}]: finite difference {fd} vs gradient {gk}"
        );
        checked += 1;
    }
    assert!(
        checked >= 4,
        "only {checked} parameters had a usable gradient"
    );
}

/// `forward_backward` scores consecutive datums as one packed forward; each
/// datum's reported logprobs and entropies are still those of scoring it
/// alone, bit for bit, and a datum with another scoring temperature starts a
/// new pack.
#[test]
fn a_packed_batch_reports_each_datums_numbers_as_scored_alone() {
    let b = base("tiny-llama");
    let mut data = sft_batch(&b);
    data[3].loss_fn_inputs.temperature = Some(0.7);
    let mut run = TrainingRun::lora(b, lora(4), 7).unwrap();
    let packed = run.forward_backward(&data, &Loss::CrossEntropy).unwrap();
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    for (i, d) in data.iter().enumerate() {
        let alone = run
            .forward(std::slice::from_ref(d), &Loss::CrossEntropy)
            .unwrap();
        let (p, a) = (&packed.loss_fn_outputs[i], &alone.loss_fn_outputs[0]);
        assert_eq!(bits(&p.logprobs), bits(&a.logprobs), "datum {i}: logprobs");
        assert_eq!(bits(&p.entropy), bits(&a.entropy), "datum {i}: entropy");
    }
}

/// An engine on its own thread pool (the learning server's learner) trains
/// and samples bit-identically to one on the global pool, at any pool size:
/// bounding the learner's threads cannot move the sampler/trainer mismatch
/// off 0.
#[test]
fn engine_on_its_own_pool_matches_the_global_pool_bit_for_bit() {
    use temper_engine::Engine;
    let b = base("tiny-qwen3");
    let data = sft_batch(&b);
    let adam = AdamParams {
        learning_rate: 2e-3,
        ..Default::default()
    };
    let trace = |engine: Engine| {
        engine.add_base_model("tiny", b.clone()).wait().unwrap();
        let run = engine.create_lora_run("tiny", lora(4), 0).wait().unwrap();
        let mut losses = Vec::new();
        for _ in 0..2 {
            let fb = engine.forward_backward(&run, data.clone(), Loss::CrossEntropy);
            losses.push(fb.wait().unwrap().metrics["loss:sum"].to_bits());
            engine.optim_step(&run, adam).wait().unwrap();
        }
        engine.save_weights_for_sampler(&run, "s").wait().unwrap();
        let params = SamplingParams {
            max_tokens: 6,
            seed: Some(3),
            ignore_eos: true,
            ..Default::default()
        };
        let out = engine
            .sample("s", data[0].model_input.clone(), 2, params)
            .wait()
            .unwrap();
        let sampled: Vec<(Vec<u32>, Vec<u32>)> = out
            .iter()
            .map(|c| {
                let lp = c.logprobs.as_deref().unwrap().iter().map(|x| x.to_bits());
                (c.tokens.clone(), lp.collect())
            })
            .collect();
        (losses, sampled)
    };
    let pool = |n| {
        Arc::new(
            rayon::ThreadPoolBuilder::new()
                .num_threads(n)
                .build()
                .unwrap(),
        )
    };
    let global = trace(Engine::new());
    assert_eq!(trace(Engine::on_pool(pool(1))), global);
    assert_eq!(trace(Engine::on_pool(pool(3))), global);
}

/// DPO's pair loss on hand-made logprobs: TRL's formulas, the gradient
/// −β·σ(−h)·scale on each chosen token (also at h = 0, where a new
/// adapter's first step is), and the checks on its batch.
#[test]
fn the_dpo_pair_loss_has_trls_value_and_gradient() {
    use temper_engine::PairLoss;
    let inputs = |n: usize, reference: f32| LossInputs {
        target_tokens: vec![0; n],
        // The first target is the prompt's; the rest are the completion's.
        weights: Some((0..n).map(|i| if i == 0 { 0.0 } else { 1.0 }).collect()),
        logprobs: Some(
            (0..n)
                .map(|i| if i + 1 == n { reference } else { 0.0 })
                .collect(),
        ),
        ..Default::default()
    };
    let (ci, ri) = (inputs(3, -2.0), inputs(4, -3.5));
    let dev = Device::Cpu;
    for (pc, pr) in [
        (vec![-9.0f32, -1.0, -0.5], vec![-7.0f32, -1.0, -1.5, -1.25]),
        (vec![-9.0f32, -1.0, -1.0], vec![-7.0f32, -1.0, -1.5, -1.0]),
    ] {
        let (vc, vr) = (
            Var::from_tensor(&Tensor::new(pc.as_slice(), &dev).unwrap()).unwrap(),
            Var::from_tensor(&Tensor::new(pr.as_slice(), &dev).unwrap()).unwrap(),
        );
        // Δ_c = (−1 − 0.5) + 2 or 0, Δ_r = (−1 − 1.5 − 1.25) + 3.5 or 0.
        let dc = pc[1..].iter().sum::<f32>() as f64 + 2.0;
        let dr = pr[1..].iter().sum::<f32>() as f64 + 3.5;
        let (beta, scale) = (0.1, 0.25);
        let sig = Loss::Dpo {
            kind: PairLoss::Sigmoid,
            beta,
            scale,
        };
        let l = sig
            .compute_pair(vc.as_tensor(), &ci, vr.as_tensor(), &ri)
            .unwrap();
        let h = beta * (dc - dr);
        let want = scale * (1.0 + (-h).exp()).ln();
        let got = l.to_scalar::<f32>().unwrap() as f64;
        assert!((got - want).abs() < 1e-6, "sigmoid: {got} vs {want}");
        let grads = l.backward().unwrap();
        let gc: Vec<f32> = grads.get(vc.as_tensor()).unwrap().to_vec1().unwrap();
        let gr: Vec<f32> = grads.get(vr.as_tensor()).unwrap().to_vec1().unwrap();
        let g = -beta * scale / (1.0 + h.exp());
        assert_eq!(gc[0], 0.0, "a prompt token has no gradient");
        for x in &gc[1..] {
            assert!(
                (*x as f64 - g).abs() < 1e-7,
                "chosen grad {x} vs {g} (h {h})"
            );
        }
        for x in &gr[1..] {
            assert!((*x as f64 + g).abs() < 1e-7, "rejected grad {x} vs {}", -g);
        }
        let ipo = Loss::Dpo {
            kind: PairLoss::Ipo,
            beta: 0.5,
            scale,
        };
        let got = ipo
            .compute_pair(vc.as_tensor(), &ci, vr.as_tensor(), &ri)
            .unwrap()
            .to_scalar::<f32>()
            .unwrap() as f64;
        let want = scale * (dc / 2.0 - dr / 3.0 - 1.0).powi(2);
        assert!((got - want).abs() < 1e-6, "ipo: {got} vs {want}");
    }
    // Far from the reference the loss stays finite and linear.
    let far = Tensor::new(&[0f32, -2000.0], &dev).unwrap();
    let near = Tensor::new(&[0f32, 0.0], &dev).unwrap();
    let two = LossInputs {
        target_tokens: vec![0, 0],
        weights: Some(vec![0.0, 1.0]),
        logprobs: Some(vec![0.0, 0.0]),
        ..Default::default()
    };
    let sig = Loss::Dpo {
        kind: PairLoss::Sigmoid,
        beta: 1.0,
        scale: 1.0,
    };
    let l = sig.compute_pair(&far, &two, &near, &two).unwrap();
    assert!((l.to_scalar::<f32>().unwrap() - 2000.0).abs() < 1e-3);

    // The wire refuses it by name; a run refuses an odd batch.
    let e = Loss::from_name("dpo_sigmoid", &serde_json::Map::new())
        .unwrap_err()
        .to_string();
    assert!(e.contains("pair loss"), "{e}");
    let mut run = TrainingRun::lora(base("tiny-qwen2"), lora(2), 0).unwrap();
    let d = Datum {
        model_input: vec![1, 2, 3],
        loss_fn_inputs: LossInputs {
            target_tokens: vec![2, 3, 4],
            ..two.clone()
        },
    };
    let d = Datum {
        loss_fn_inputs: LossInputs {
            weights: Some(vec![0.0, 1.0, 1.0]),
            logprobs: Some(vec![0.0, 0.0, -3.0]),
            ..d.loss_fn_inputs
        },
        ..d
    };
    let e = run
        .forward_backward(std::slice::from_ref(&d), &sig)
        .unwrap_err()
        .to_string();
    assert!(e.contains("pairs"), "{e}");
    let out = run.forward_backward(&[d.clone(), d], &sig).unwrap();
    // Both sides equal: h = 0 whatever the policy, loss ln 2.
    assert!((out.metrics["loss:sum"] - 2f64.ln()).abs() < 1e-5);
}

/// A DPO step on pairs after one system prompt: the engine runs the system
/// prompt once, each pair's prompt once and the LM head on the completions
/// only (see `Model::score_batch_where`), and still gives the loss and the
/// LoRA gradients of scoring every sequence alone, unshared (relative error
/// under 1e-5), and the completions' logprobs bit for bit; the prompt
/// positions, not computed, report NaN.
#[test]
fn a_dpo_step_with_shared_prompts_has_the_unshared_loss_and_gradients() {
    use temper_engine::PairLoss;
    use temper_model::LoraAdapter;
    let b = base("tiny-qwen2");
    let dir =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/adapters/tiny-qwen2-lora");
    let adapter = LoraAdapter::load_peft(&dir, &b.config, b.model.dtype(), b.model.device())
        .expect("adapter loads");
    let enc = |t: &str| b.tokenizer.encode(t, false).expect("encode");
    let system = enc("You are a careful assistant. Answer with one number in tags.");
    let mut data = Vec::new();
    for (i, (q, c, r)) in [
        (
            "What is 2 + 3? Think.",
            " <a>5</a>",
            " It is five, I think.",
        ),
        ("What is 7 + 1? Think.", " <a>8</a>", " <a>9</a>"),
        ("What is 4 + 4? Think.", " <a>8</a>", " 8"),
    ]
    .iter()
    .enumerate()
    {
        let prompt = [system.clone(), enc(q)].concat();
        for (side, completion) in [c, r].iter().enumerate() {
            let tokens = [prompt.clone(), enc(completion)].concat();
            let n = tokens.len() - 1;
            let mut reference = vec![0f32; n];
            reference[n - 1] = -3.0 - (i + side) as f32;
            data.push(Datum {
                model_input: tokens[..n].to_vec(),
                loss_fn_inputs: LossInputs {
                    target_tokens: tokens[1..].to_vec(),
                    weights: Some(
                        (1..=n)
                            .map(|j| f32::from(u8::from(j >= prompt.len())))
                            .collect(),
                    ),
                    logprobs: Some(reference),
                    ..Default::default()
                },
            });
        }
    }
    let loss = Loss::Dpo {
        kind: PairLoss::Sigmoid,
        beta: 0.5,
        scale: 1.0 / 3.0,
    };
    let mut run = TrainingRun::lora_from(b.clone(), adapter.clone());
    let out = run.forward_backward(&data, &loss).unwrap();
    // Unshared: every sequence scored alone, the same pair loss.
    let scores: Vec<Tensor> = data
        .iter()
        .map(|d| {
            b.model
                .score(
                    &d.model_input,
                    &d.loss_fn_inputs.target_tokens,
                    Some(&adapter),
                    1.0,
                )
                .unwrap()
                .logprobs
        })
        .collect();
    let mut total = None::<Tensor>;
    for (d, s) in data.chunks(2).zip(scores.chunks(2)) {
        let t = loss
            .compute_pair(&s[0], &d[0].loss_fn_inputs, &s[1], &d[1].loss_fn_inputs)
            .unwrap();
        total = Some(match total {
            None => t,
            Some(x) => (x + t).unwrap(),
        });
    }
    let total = total.unwrap();
    let want = total.to_scalar::<f32>().unwrap() as f64;
    let got = out.metrics["loss:sum"];
    assert!(
        (got - want).abs() <= 1e-6 * want.abs().max(1.0),
        "loss {got} vs {want}"
    );
    for (i, (d, s)) in data.iter().zip(&scores).enumerate() {
        let alone: Vec<f32> = s.to_vec1().unwrap();
        let reported = &out.loss_fn_outputs[i].logprobs;
        let w = d.loss_fn_inputs.weights.as_ref().unwrap();
        for j in 0..alone.len() {
            if w[j] != 0.0 {
                assert_eq!(
                    reported[j].to_bits(),
                    alone[j].to_bits(),
                    "datum {i} position {j}"
                );
            } else {
                assert!(reported[j].is_nan(), "datum {i} position {j}: computed");
            }
        }
    }
    let unshared = total.backward().unwrap();
    let grads = run.accumulated_grads();
    let norm = |v: &[f32]| v.iter().map(|x| (*x as f64).powi(2)).sum::<f64>().sqrt();
    for (name, var) in adapter.named_vars() {
        let y: Vec<f32> = unshared
            .get(var.as_tensor())
            .expect("grad")
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        let x: Vec<f32> = grads[&name].flatten_all().unwrap().to_vec1().unwrap();
        let diff: Vec<f32> = x.iter().zip(&y).map(|(a, b)| a - b).collect();
        assert!(norm(&y) > 0.0, "{name}: zero gradient");
        let err = norm(&diff) / norm(&y);
        assert!(err < 1e-5, "{name}: relative error {err}");
    }
}
