//! The training forward: zero mismatch with the sampler, gradients that reach
//! every trainable tensor and agree with finite differences.

use temper_model::candle_core::{DType, Tensor, Var};
use temper_model::{GenerationRequest, LoraAdapter, LoraConfig, Sampler, SamplingParams};

use crate::common::*;

/// Loss used by the gradient tests: −Σ logprob of the targets.
fn nll(p: &temper_model::Pretrained, seq: &[u32], lora: Option<&LoraAdapter>) -> Tensor {
    let s = p
        .model
        .score(&seq[..seq.len() - 1], &seq[1..], lora, 1.0)
        .expect("score");
    s.logprobs.sum_all().expect("sum").neg().expect("neg")
}

fn norm(t: &Tensor) -> f64 {
    t.to_dtype(DType::F64)
        .unwrap()
        .sqr()
        .unwrap()
        .sum_all()
        .unwrap()
        .to_scalar::<f64>()
        .unwrap()
        .sqrt()
}

#[test]
fn sampler_logprobs_equal_training_forward_for_batches_1_to_8() {
    for name in FAMILIES {
        sampler_equals_trainer(&load(name), name, name);
    }
}

/// QLoRA: on GGUF bases kept quantized the sampler and the trainer run the
/// same quantized kernel, so the mismatch stays exactly 0 in every format.
#[test]
fn sampler_logprobs_equal_training_forward_on_quantized_bases() {
    let tmp = tempfile::tempdir().expect("tmp");
    for (name, quant) in QUANT_CASES {
        let p = load_quantized(name, quant, tmp.path(), temper_model::Precision::Gguf);
        sampler_equals_trainer(&p, name, &format!("{name} {quant:?}"));
    }
}

/// QLoRA's backward through the quantized weights: the LoRA gradients on a
/// base kept quantized are, bit for bit, those on the same file
/// dequantized to f32 (the input gradient runs through the same f32 rows).
#[test]
fn lora_gradients_on_a_quantized_base_equal_the_dequantized_models() {
    let tmp = tempfile::tempdir().expect("tmp");
    for (name, quant) in QUANT_CASES {
        {
            let q = load_quantized(name, quant, tmp.path(), temper_model::Precision::Gguf);
            let f = load_quantized(name, quant, tmp.path(), temper_model::Precision::F32);
            let seq = golden_inputs(name)[2].clone();
            let (aq, af) = (adapter(&q, name), adapter(&f, name));
            let gq = nll(&q, &seq, Some(&aq)).backward().expect("backward");
            let gf = nll(&f, &seq, Some(&af)).backward().expect("backward");
            let mut checked = 0;
            for ((n, vq), (_, vf)) in aq.named_vars().into_iter().zip(af.named_vars()) {
                let bits = |gs: &temper_model::candle_core::backprop::GradStore, v: &Var| {
                    gs.get(v.as_tensor())
                        .unwrap_or_else(|| panic!("{name} {quant:?}: no grad for {n}"))
                        .flatten_all()
                        .unwrap()
                        .to_vec1::<f32>()
                        .unwrap()
                };
                let (a, b) = (bits(&gq, &vq), bits(&gf, &vf));
                assert!(
                    a.iter().any(|x| *x != 0.0),
                    "{name} {quant:?}: zero grad {n}"
                );
                assert_eq!(a, b, "{name} {quant:?}: {n}");
                checked += 1;
            }
            assert!(checked > 0);
        }
    }
}

fn sampler_equals_trainer(p: &temper_model::Pretrained, name: &str, label: &str) {
    {
        let a = adapter(p, name);
        let base_prompts = golden_inputs(name);
        let sampler = Sampler::new(&p.model, &p.tokenizer, p.generation.eos_token_ids.clone());
        let mut worst = 0f32;
        let mut compared = 0usize;
        for batch in 1..=8usize {
            for lora in [None, Some(&a)] {
                // Mixed prompt lengths: cut the fixture inputs to different lengths.
                let reqs: Vec<GenerationRequest> = (0..batch)
                    .map(|i| {
                        let src = &base_prompts[i % base_prompts.len()];
                        let len = 1 + (i * 5 + batch) % src.len();
                        GenerationRequest {
                            prompt: src[..len].to_vec(),
                            n: 1,
                            params: SamplingParams {
                                max_tokens: 6 + i,
                                temperature: if i % 2 == 0 { 1.0 } else { 0.7 },
                                seed: Some((batch * 100 + i) as u64),
                                ignore_eos: true,
                                ..Default::default()
                            },
                        }
                    })
                    .collect();
                let out = sampler.generate(&reqs, lora).expect("generate");
                // The trainer sees all sequences of this batch as one batch of datums.
                let fulls: Vec<Vec<u32>> = reqs
                    .iter()
                    .zip(&out)
                    .map(|(r, o)| r.prompt.iter().chain(&o[0].tokens).copied().collect())
                    .collect();
                for temp in [1.0, 0.7] {
                    let scores = p
                        .model
                        .score_batch(&next_token_inputs(&fulls), lora, temp)
                        .expect("score");
                    for ((r, o), s) in reqs.iter().zip(&out).zip(scores) {
                        if r.params.temperature != temp {
                            continue;
                        }
                        let all: Vec<f32> = s.logprobs.to_vec1().unwrap();
                        let n = o[0].tokens.len();
                        let sampled = o[0].logprobs.as_ref().expect("logprobs requested");
                        for (x, y) in all[all.len() - n..].iter().zip(sampled) {
                            worst = worst.max((x - y).abs());
                            compared += 1;
                        }
                    }
                }
            }
        }
        eprintln!("{label}: {compared} tokens compared, max |sampler - trainer| = {worst:e}");
        assert!(compared > 200, "{label}: compared only {compared} tokens");
        // Bit for bit: the sampler takes logprobs straight from its decode
        // steps, and every kernel gives a row the same bits there as in the
        // trainer's full-sequence pass.
        assert_eq!(worst, 0.0, "{label}: sampler/trainer logprob mismatch");
    }
}

#[test]
fn every_lora_tensor_gets_a_gradient() {
    for name in FAMILIES {
        let p = load(name);
        let (g, _) = golden(name);
        let seq = ids(&g["inputs"][2]);
        // The fixture adapter has non-zero B, so A and B both get gradients.
        let a = adapter(&p, name);
        let grads = nll(&p, &seq, Some(&a)).backward().expect("backward");
        for (n, v) in a.named_vars() {
            let gr = grads
                .get(v.as_tensor())
                .unwrap_or_else(|| panic!("{name}: no grad for {n}"));
            assert!(norm(gr) > 0.0, "{name}: zero grad for {n}");
        }
        // A fresh adapter (B = 0): B gets a gradient, A's is exactly zero until B moves.
        let fresh = LoraAdapter::new(
            &p.config,
            LoraConfig::default(),
            3,
            DType::F32,
            p.model.device(),
        )
        .expect("new adapter");
        let grads = nll(&p, &seq, Some(&fresh)).backward().expect("backward");
        for (n, v) in fresh.named_vars() {
            let gn = grads.get(v.as_tensor()).map(norm).unwrap_or(0.0);
            if n.contains("lora_B") {
                assert!(gn > 0.0, "{name}: zero grad for {n}");
            } else {
                assert_eq!(gn, 0.0, "{name}: {n}");
            }
        }
        // Frozen base: no gradient reaches base weights under LoRA training.
        for (n, w) in p.model.named_weights().expect("weights") {
            assert!(
                grads.get(&w).is_none(),
                "{name}: base weight {n} got a gradient"
            );
        }
    }
}

#[test]
fn a_shared_prompt_gives_the_gradients_of_scoring_each_alone() {
    // `score_batch` runs a prompt that consecutive sequences share once;
    // the prompt rows' gradients must be the sum over the sequences.
    for name in FAMILIES {
        let p = load(name);
        let (g, _) = golden(name);
        let prompt = ids(&g["inputs"][2]);
        let tails: [&[u32]; 3] = [&[5, 9, 13, 2], &[5, 9, 40], &[77, 3, 3, 3, 8, 1]];
        let seqs: Vec<Vec<u32>> = tails.iter().map(|t| [&prompt[..], t].concat()).collect();
        let a = adapter(&p, name);
        let scores = p
            .model
            .score_batch(&next_token_inputs(&seqs), Some(&a), 1.0)
            .expect("score_batch");
        let mut shared = scores[0].logprobs.sum_all().unwrap();
        for s in &scores[1..] {
            shared = (shared + s.logprobs.sum_all().unwrap()).unwrap();
        }
        let shared = shared.neg().unwrap().backward().expect("backward");
        let mut alone = nll(&p, &seqs[0], Some(&a));
        for s in &seqs[1..] {
            alone = (alone + nll(&p, s, Some(&a))).unwrap();
        }
        let alone = alone.backward().expect("backward");
        for (n, v) in a.named_vars() {
            let (x, y) = (
                shared.get(v.as_tensor()).expect("grad"),
                alone.get(v.as_tensor()).expect("grad"),
            );
            let err = norm(&(x - y).unwrap()) / norm(y).max(1e-12);
            assert!(err < 1e-5, "{name}: {n} relative error {err}");
        }
    }
}

#[test]
fn full_parameter_training_reaches_every_weight() {
    let mut p = load("tiny-qwen3");
    let (g, _) = golden("tiny-qwen3");
    let seq = ids(&g["inputs"][2]);
    let vars = p.model.make_trainable().expect("trainable");
    let grads = nll(&p, &seq, None).backward().expect("backward");
    for (n, v) in &vars {
        let gr = grads
            .get(v.as_tensor())
            .unwrap_or_else(|| panic!("no grad for {n}"));
        assert!(norm(gr) > 0.0, "zero grad for {n}");
    }
}

/// Central differences along the gradient direction of each tensor:
/// (L(θ+εd) − L(θ−εd)) / 2ε must equal ∇L·d = |∇L| for d = ∇L/|∇L|.
#[test]
fn lora_gradients_match_finite_differences() {
    for name in FAMILIES {
        let p = load(name);
        let (g, _) = golden(name);
        let seq = ids(&g["inputs"][1]);
        let a = adapter(&p, name);
        let grads = nll(&p, &seq, Some(&a)).backward().expect("backward");
        let eps = 1e-2;
        let mut worst_rel = 0f64;
        for (n, v) in a.named_vars() {
            let gr = grads.get(v.as_tensor()).expect("grad").clone();
            let gn = norm(&gr);
            let d = (&gr / gn).expect("direction");
            let orig = v.as_tensor().copy().expect("copy");
            let eval = |sign: f64| -> f64 {
                let moved = (&orig + (&d * (sign * eps)).expect("scale")).expect("add");
                v.set(&moved).expect("set");
                nll(&p, &seq, Some(&a)).to_scalar::<f32>().expect("scalar") as f64
            };
            let fd = (eval(1.0) - eval(-1.0)) / (2.0 * eps);
            v.set(&orig).expect("restore");
            let rel = (fd - gn).abs() / gn.abs().max(1e-6);
            worst_rel = worst_rel.max(rel);
            assert!(
                rel <= 1e-2,
                "{name} {n}: analytic {gn} vs finite difference {fd} (rel {rel})"
            );
        }
        eprintln!("{name}: worst finite-difference relative error {worst_rel:.2e}");
    }
}

#[test]
fn entropy_is_that_of_the_scaled_distribution() {
    let p = load("tiny-llama");
    let (g, t) = golden("tiny-llama");
    let seq = ids(&g["inputs"][0]);
    let s = p
        .model
        .score(&seq[..seq.len() - 1], &seq[1..], None, 0.5)
        .expect("score");
    let logits = t["logits.0"].to_vec2::<f32>().unwrap();
    let ent: Vec<f32> = s.entropy.to_vec1().unwrap();
    let lps: Vec<f32> = s.logprobs.to_vec1().unwrap();
    for (i, row) in logits.iter().take(seq.len() - 1).enumerate() {
        let z: Vec<f64> = row.iter().map(|&x| x as f64 / 0.5).collect();
        let m = z.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let lse = m + z.iter().map(|x| (x - m).exp()).sum::<f64>().ln();
        let h: f64 = -z.iter().map(|x| (x - lse).exp() * (x - lse)).sum::<f64>();
        assert!(
            (h - ent[i] as f64).abs() < 1e-3,
            "entropy {i}: {h} vs {}",
            ent[i]
        );
        let lp = z[seq[i + 1] as usize] - lse;
        assert!(
            (lp - lps[i] as f64).abs() < 1e-3,
            "logprob {i}: {lp} vs {}",
            lps[i]
        );
    }
}

#[test]
fn saved_adapter_loads_back_bit_exact() {
    let p = load("tiny-qwen2");
    let a = adapter(&p, "tiny-qwen2");
    let dir = tempfile::tempdir().expect("tempdir");
    a.save_peft(dir.path(), "fixtures/models/tiny-qwen2")
        .expect("save");
    let cfg: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(dir.path().join("adapter_config.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(cfg["peft_type"], "LORA");
    assert_eq!(cfg["r"], 4);
    assert_eq!(cfg["lora_alpha"], 8.0);
    let back = LoraAdapter::load_peft(dir.path(), &p.config, DType::F32, p.model.device())
        .expect("load back");
    let before = a.named_vars();
    let after = back.named_vars();
    assert_eq!(before.len(), after.len());
    for ((n1, v1), (n2, v2)) in before.iter().zip(&after) {
        assert_eq!(n1, n2);
        let x: Vec<f32> = v1.as_tensor().flatten_all().unwrap().to_vec1().unwrap();
        let y: Vec<f32> = v2.as_tensor().flatten_all().unwrap().to_vec1().unwrap();
        assert!(
            x.iter().zip(&y).all(|(a, b)| a.to_bits() == b.to_bits()),
            "{n1}"
        );
    }
    // PEFT's own tensor names, so PEFT and vLLM find them.
    assert!(before[0].0.starts_with("base_model.model.model.layers.0."));
    let _: Var = after[0].1.clone();
}

#[test]
fn sequences_longer_than_a_score_chunk_agree_with_the_sampler() {
    let p = load("tiny-qwen2");
    let n = temper_model::logprobs::SCORE_CHUNK + 90;
    let prompt: Vec<u32> = (0..n).map(|i| ((i * 37) % 990) as u32).collect();
    let sampler = Sampler::new(&p.model, &p.tokenizer, vec![]);
    let out = sampler
        .generate(
            &[GenerationRequest {
                prompt: prompt.clone(),
                n: 2,
                params: SamplingParams {
                    max_tokens: 5,
                    seed: Some(3),
                    ignore_eos: true,
                    ..Default::default()
                },
            }],
            None,
        )
        .expect("generate");
    for c in &out[0] {
        let full: Vec<u32> = prompt.iter().chain(&c.tokens).copied().collect();
        let s = p
            .model
            .score(&full[..full.len() - 1], &full[1..], None, 1.0)
            .expect("score");
        let all: Vec<f32> = s.logprobs.to_vec1().unwrap();
        assert_eq!(all.len(), full.len() - 1);
        assert_eq!(&all[all.len() - 5..], c.logprobs.as_deref().unwrap());
        // The chunked log-softmax equals one over the whole logits matrix.
        let mut segs = [temper_model::Segment {
            len: full.len() - 1,
            cache: None,
        }];
        let h = p
            .model
            .forward_hidden(&full[..full.len() - 1], &mut segs, None)
            .unwrap();
        let logits = p.model.logits(&h).unwrap().to_vec2::<f32>().unwrap();
        for (i, row) in logits.iter().enumerate().step_by(97) {
            let m = row.iter().cloned().fold(f32::NEG_INFINITY, f32::max) as f64;
            let lse = m + row.iter().map(|&x| (x as f64 - m).exp()).sum::<f64>().ln();
            let want = row[full[i + 1] as usize] as f64 - lse;
            assert!(
                (want - all[i] as f64).abs() < 1e-4,
                "row {i}: {want} vs {}",
                all[i]
            );
        }
    }
}

#[test]
fn a_batch_of_pairs_shares_its_prompts_and_reads_only_its_completions() {
    // `score_batch_where` runs the system prompt once and each pair's
    // question once (a tree of prefixes) and the LM head only on the
    // completions' targets: those logprobs have the bits of scoring each
    // sequence alone, the prompt's are NaN (not computed), and a loss on the
    // completions has the value and LoRA gradients of the unshared batch.
    for name in FAMILIES {
        let p = load(name);
        let a = adapter(&p, name);
        let (seqs, prompt_lens) = preference_pairs(p.config.vocab_size as u32);
        let needed: Vec<Vec<bool>> = seqs
            .iter()
            .zip(&prompt_lens)
            .map(|(s, &pl)| (0..s.len() - 1).map(|i| i + 1 >= pl).collect())
            .collect();
        let masks: Vec<&[bool]> = needed.iter().map(Vec::as_slice).collect();
        let shared = p
            .model
            .score_batch_where(&next_token_inputs(&seqs), Some(&masks), Some(&a), 1.0)
            .expect("score_batch_where");
        // A DPO-like coupling: chosen minus half the rejected side.
        let loss = |lps: Vec<Tensor>| -> Tensor {
            let mut total: Option<Tensor> = None;
            for (i, lp) in lps.iter().enumerate() {
                let at: Vec<u32> = (0..needed[i].len() as u32)
                    .filter(|&j| needed[i][j as usize])
                    .collect();
                let idx = Tensor::new(at.as_slice(), lp.device()).unwrap();
                let s = lp.contiguous().unwrap().index_select(&idx, 0).unwrap();
                let s = s.sum_all().unwrap();
                let s = s.affine(if i % 2 == 0 { -1.0 } else { 0.5 }, 0.0).unwrap();
                total = Some(match total {
                    None => s,
                    Some(t) => (t + s).unwrap(),
                });
            }
            total.unwrap()
        };
        let mut alone = Vec::new();
        for (i, (s, got)) in seqs.iter().zip(&shared).enumerate() {
            let want = p
                .model
                .score(&s[..s.len() - 1], &s[1..], Some(&a), 1.0)
                .expect("score");
            let (g, w) = (
                got.logprobs.to_vec1::<f32>().unwrap(),
                want.logprobs.to_vec1::<f32>().unwrap(),
            );
            let (ge, we) = (
                got.entropy.to_vec1::<f32>().unwrap(),
                want.entropy.to_vec1::<f32>().unwrap(),
            );
            for j in 0..g.len() {
                if needed[i][j] {
                    assert_eq!(g[j].to_bits(), w[j].to_bits(), "{name}: {i}/{j} logprob");
                    assert_eq!(ge[j].to_bits(), we[j].to_bits(), "{name}: {i}/{j} entropy");
                } else {
                    assert!(g[j].is_nan() && ge[j].is_nan(), "{name}: {i}/{j} computed");
                }
            }
            alone.push(want.logprobs);
        }
        let ls = loss(shared.into_iter().map(|s| s.logprobs).collect());
        let la = loss(alone);
        let (vs, va) = (
            ls.to_scalar::<f32>().unwrap(),
            la.to_scalar::<f32>().unwrap(),
        );
        assert!(
            (vs - va).abs() <= 1e-6 * va.abs().max(1.0),
            "{name}: loss {vs} vs {va}"
        );
        let (gs, ga) = (ls.backward().unwrap(), la.backward().unwrap());
        for (n, v) in a.named_vars() {
            let (x, y) = (
                gs.get(v.as_tensor()).expect("grad"),
                ga.get(v.as_tensor()).expect("grad"),
            );
            assert!(norm(y) > 0.0, "{name}: {n} zero gradient");
            let err = norm(&(x - y).unwrap()) / norm(y);
            assert!(err < 1e-5, "{name}: {n} relative error {err}");
        }
    }
}
