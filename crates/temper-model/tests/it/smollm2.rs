//! Golden tests on a real pretrained model read from GGUF:
//! SmolLM2-135M-Instruct (Q4_1), against transformers' GGUF loader.
//!
//! The references (`fixtures/smollm2/refs.json`) are made by
//! `scripts/make_smollm2_refs.py`; the GGUF (93 MB, never committed) by
//! `scripts/fetch_smollm2.sh`, which prints the path to export as
//! `TEMPER_SMOLLM2_GGUF`. Without that variable these tests say they are
//! skipped and pass; `.ci/run` sets it, so CI runs them.

use std::path::PathBuf;
use std::sync::OnceLock;

use temper_model::candle_core::Tensor;
use temper_model::{GenerationRequest, LoadOptions, Pretrained, Sampler, SamplingParams};

use crate::common::*;

fn gguf_path() -> Option<PathBuf> {
    match std::env::var_os("TEMPER_SMOLLM2_GGUF") {
        Some(p) => Some(PathBuf::from(p)),
        None => {
            eprintln!(
                "SKIPPED: set TEMPER_SMOLLM2_GGUF to SmolLM2-135M-Instruct.Q4_1.gguf (scripts/fetch_smollm2.sh) to run the real-model tests"
            );
            None
        }
    }
}

/// The model, loaded once for all tests of this module.
fn model() -> Option<&'static Pretrained> {
    static MODEL: OnceLock<Pretrained> = OnceLock::new();
    let path = gguf_path()?;
    Some(MODEL.get_or_init(|| {
        Pretrained::load(&path, &LoadOptions::default())
            .unwrap_or_else(|e| panic!("loading {}: {e}", path.display()))
    }))
}

fn refs() -> serde_json::Value {
    let path = root().join("smollm2/refs.json");
    serde_json::from_str(&std::fs::read_to_string(&path).expect("refs.json")).expect("json")
}

fn floats(v: &serde_json::Value) -> Vec<f32> {
    v.as_array()
        .expect("floats")
        .iter()
        .map(|x| x.as_f64().expect("float") as f32)
        .collect()
}

#[test]
fn smollm2_gguf_config_matches_transformers() {
    let Some(p) = model() else { return };
    let r = refs();
    let c = &r["config"];
    let cfg = &p.config;
    assert_eq!(cfg.family, temper_model::Family::Llama);
    assert_eq!(cfg.hidden_size as u64, c["hidden_size"].as_u64().unwrap());
    assert_eq!(
        cfg.intermediate_size as u64,
        c["intermediate_size"].as_u64().unwrap()
    );
    assert_eq!(
        cfg.num_layers as u64,
        c["num_hidden_layers"].as_u64().unwrap()
    );
    assert_eq!(
        cfg.num_heads as u64,
        c["num_attention_heads"].as_u64().unwrap()
    );
    assert_eq!(
        cfg.num_kv_heads as u64,
        c["num_key_value_heads"].as_u64().unwrap()
    );
    assert_eq!(cfg.head_dim as u64, c["head_dim"].as_u64().unwrap());
    assert_eq!(cfg.vocab_size as u64, c["vocab_size"].as_u64().unwrap());
    assert_eq!(cfg.rms_norm_eps, c["rms_norm_eps"].as_f64().unwrap());
    assert_eq!(cfg.rope_theta, r["rope_theta"].as_f64().unwrap());
    assert_eq!(
        cfg.max_position_embeddings as u64,
        c["max_position_embeddings"].as_u64().unwrap()
    );
    assert_eq!(
        cfg.tie_word_embeddings,
        c["tie_word_embeddings"].as_bool().unwrap()
    );
    assert_eq!(p.tokenizer.bos_token(), r["bos_token"].as_str());
    assert_eq!(p.tokenizer.eos_token(), r["eos_token"].as_str());
    assert_eq!(
        p.tokenizer.vocab_size() as u64,
        r["vocab_size"].as_u64().unwrap()
    );
    let eos = r["eos_token_id"].as_u64().unwrap() as u32;
    assert!(p.generation.eos_token_ids.contains(&eos));
}

#[test]
fn smollm2_gguf_tokenizer_matches_transformers() {
    let Some(p) = model() else { return };
    let r = refs();
    for c in r["corpus"].as_array().expect("corpus") {
        let text = c["text"].as_str().expect("text");
        let want = ids(&c["ids"]);
        assert_eq!(
            p.tokenizer.encode(text, true).expect("encode"),
            want,
            "encode {text:?}"
        );
        assert_eq!(
            p.tokenizer.decode(&want, false).expect("decode"),
            c["decoded"].as_str().expect("decoded"),
            "decode {text:?}"
        );
        assert_eq!(
            p.tokenizer.decode(&want, true).expect("decode"),
            c["decoded_skip_special"].as_str().expect("decoded"),
            "decode skipping special tokens {text:?}"
        );
    }
}

#[test]
fn smollm2_gguf_chat_template_matches_transformers() {
    let Some(p) = model() else { return };
    let r = refs();
    let tmpl = p.chat_template.as_ref().expect("GGUF has a chat template");
    for c in r["chats"].as_array().expect("chats") {
        let text = tmpl
            .render(&c["messages"], None, true, &Default::default())
            .expect("renders");
        assert_eq!(text, c["rendered"].as_str().expect("rendered"));
        assert_eq!(
            p.tokenizer.encode(&text, false).expect("encode"),
            ids(&c["prompt_ids"])
        );
    }
}

/// One chat's logits (the prompt's first and last rows), their largest
/// error against transformers' relative to the largest logit (each row
/// checked against `tol`), and the reference's scale.
fn logits_against_refs(p: &Pretrained, c: &serde_json::Value, tol: f32) -> (Tensor, f32, f32) {
    let prompt = ids(&c["prompt_ids"]);
    let logits = logits_of(p, &prompt, None);
    let n = floats(&c["logits_last"]).len();
    let scale = c["max_abs_logit_last"].as_f64().expect("scale") as f32;
    let mut worst = 0f32;
    for (row, key) in [(0, "logits_first"), (prompt.len() - 1, "logits_last")] {
        let ours = logits.get(row).unwrap().narrow(0, 0, n).unwrap();
        let theirs = Tensor::new(floats(&c[key]), ours.device()).unwrap();
        let diff = (&ours - &theirs).unwrap().abs().unwrap().max_all().unwrap();
        let e = diff.to_scalar::<f32>().unwrap() / scale;
        eprintln!("{:?} {key}: relative error {e:.2e}", p.model.precision());
        assert!(e <= tol, "{key}: relative error {e}");
        worst = worst.max(e);
    }
    (logits, worst, scale)
}

#[test]
fn smollm2_gguf_logits_match_transformers() {
    let Some(p) = model() else { return };
    let r = refs();
    for c in r["chats"].as_array().expect("chats") {
        let prompt = ids(&c["prompt_ids"]);
        let (logits, _, scale) = logits_against_refs(p, c, 1e-4);
        let last = logits
            .get(prompt.len() - 1)
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        let mut order: Vec<usize> = (0..last.len()).collect();
        order.sort_by(|&a, &b| last[b].total_cmp(&last[a]));
        let top5: Vec<u32> = order[..5].iter().map(|&i| i as u32).collect();
        assert_eq!(top5, ids(&c["top5_ids"]));
        for (i, want) in ids(&c["top5_ids"]).iter().zip(floats(&c["top5_logits"])) {
            let e = (last[*i as usize] - want).abs() / scale;
            assert!(e <= 1e-4, "top-5 logit {i}: relative error {e}");
        }
    }
}

#[test]
fn smollm2_gguf_greedy_matches_transformers_generate() {
    let Some(p) = model() else { return };
    let r = refs();
    let chats = r["chats"].as_array().expect("chats");
    let sampler = Sampler::new(&p.model, &p.tokenizer, p.generation.eos_token_ids.clone());
    let reqs: Vec<GenerationRequest> = chats
        .iter()
        .map(|c| GenerationRequest {
            prompt: ids(&c["prompt_ids"]),
            n: 1,
            params: SamplingParams {
                max_tokens: 24,
                temperature: 0.0,
                ..Default::default()
            },
        })
        .collect();
    let out = sampler.generate(&reqs, None).expect("generate");
    for (c, o) in chats.iter().zip(out) {
        assert_eq!(o[0].tokens, ids(&c["greedy_ids"]), "{}", c["rendered"]);
        assert_eq!(o[0].text, c["greedy_text"].as_str().expect("text"));
    }
}

/// `--dtype bf16` on the real model: bf16 weights and matmul inputs with f32
/// sums stay within 2% of the largest logit of transformers' f32 forward,
/// and pick the same top token for every prompt.
#[test]
fn smollm2_gguf_bf16_logits_stay_close_to_transformers_f32() {
    let Some(path) = gguf_path() else { return };
    let opts = LoadOptions {
        precision: temper_model::Precision::Bf16,
        ..LoadOptions::default()
    };
    let p = Pretrained::load(&path, &opts).expect("bf16 load");
    assert_eq!(p.model.precision(), temper_model::Precision::Bf16);
    let r = refs();
    let mut worst = 0f32;
    for c in r["chats"].as_array().expect("chats") {
        let prompt = ids(&c["prompt_ids"]);
        let (logits, e, _) = logits_against_refs(&p, c, 2e-2);
        worst = worst.max(e);
        let last = logits
            .get(prompt.len() - 1)
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        let top = (0..last.len())
            .max_by(|&a, &b| last[a].total_cmp(&last[b]))
            .unwrap();
        assert_eq!(top as u32, ids(&c["top5_ids"])[0], "bf16 top-1");
    }
    // Rounded weights do move the logits: a bf16 load that stayed f32
    // would show the f32 test's ≤ 1e-4.
    assert!(
        worst > 1e-4,
        "bf16 logits equal f32's: weights not rounded?"
    );
}

/// Greedy tokens and the last row's logits of every reference chat.
fn greedy_and_logits(p: &Pretrained) -> Vec<(Vec<u32>, Vec<f32>)> {
    let r = refs();
    let chats = r["chats"].as_array().expect("chats");
    let sampler = Sampler::new(&p.model, &p.tokenizer, p.generation.eos_token_ids.clone());
    let reqs: Vec<GenerationRequest> = chats
        .iter()
        .map(|c| GenerationRequest {
            prompt: ids(&c["prompt_ids"]),
            n: 1,
            params: SamplingParams {
                max_tokens: 24,
                temperature: 0.0,
                ..Default::default()
            },
        })
        .collect();
    let out = sampler.generate(&reqs, None).expect("generate");
    chats
        .iter()
        .zip(out)
        .map(|(c, o)| {
            let prompt = ids(&c["prompt_ids"]);
            let logits = logits_of(p, &prompt, None);
            let last = logits.get(prompt.len() - 1).unwrap().to_vec1().unwrap();
            (o[0].tokens.clone(), last)
        })
        .collect()
}

/// `--dtype gguf` on the real Q4_1 file: its blocks kept quantized, the
/// greedy text and the logits are those of the dequantized f32 model — bit
/// for bit (tolerance 0) — and so within the f32 test's 1e-4 of
/// transformers'.
#[test]
fn smollm2_q4_1_kept_quantized_equals_the_dequantized_model() {
    let (Some(path), Some(f32_model)) = (gguf_path(), model()) else {
        return;
    };
    let opts = LoadOptions {
        precision: temper_model::Precision::Gguf,
        ..LoadOptions::default()
    };
    let q = Pretrained::load(&path, &opts).expect("gguf load");
    assert!(q.model.is_quantized());
    assert_eq!(q.model.precision(), temper_model::Precision::Gguf);
    let r = refs();
    for c in r["chats"].as_array().expect("chats") {
        logits_against_refs(&q, c, 1e-4);
    }
    assert_eq!(greedy_and_logits(&q), greedy_and_logits(f32_model));
}

/// A Q8_0 export (`temper export --format gguf --quant q8_0`) of the model,
/// loaded back kept quantized: the same greedy text and logit bits as the
/// same file dequantized. (Not the Q4_1 model's text: re-quantizing to Q8_0
/// rounds again, and one of the six chats diverges after ten tokens.)
#[test]
fn smollm2_q8_0_export_kept_quantized_equals_the_dequantized_model() {
    let Some(base) = model() else { return };
    let tmp = tempfile::tempdir().expect("tmp");
    let path = tmp.path().join("smollm2-q8_0.gguf");
    temper_model::save_gguf(base, &base.model, &path, temper_model::GgufQuant::Q8_0)
        .expect("export");
    let load = |precision| {
        let opts = LoadOptions {
            precision,
            ..LoadOptions::default()
        };
        Pretrained::load(&path, &opts).expect("load q8_0")
    };
    let q = load(temper_model::Precision::Gguf);
    assert!(q.model.is_quantized());
    let f = load(temper_model::Precision::F32);
    assert_eq!(greedy_and_logits(&q), greedy_and_logits(&f));
}

/// How far temper's logits at one prompt are from llama.cpp's.
#[derive(Default, Debug)]
struct VsLlamaCpp {
    positions: usize,
    top1_equal: usize,
    /// max |Δ logit| over llama.cpp's top 5 of every position.
    logit: f64,
    /// max |Δ log-probability| over the same tokens.
    logprob: f64,
    /// max over positions of temper's logit margin of its top token over
    /// llama.cpp's (0 where they agree).
    top1_gap: f64,
    /// Greedy tokens equal before the texts part, per prompt.
    greedy: Vec<usize>,
    /// Where they part, temper's logit margin of its token over llama.cpp's.
    parting_gap: f64,
}

/// temper's `--dtype gguf` on the files llama.cpp ran
/// (`fixtures/smollm2/llama_cpp.json`, written by
/// `scripts/llama_cpp_golden.sh`): SmolLM2's Q4_1 file, temper's Q8_0 and
/// Q4_K_M exports of it (recreated here), its f32 export (the control,
/// whose weights are the f32 load's, so that model runs), and — where
/// `TEMPER_LLAMA_CPP_Q4_K_M` names it — llama.cpp's own Q4_K_M
/// quantization. llama.cpp rounds each activation row to 8 bits before its
/// integer dots, temper keeps f32 activations (`kernels::quant`), so the
/// logits differ slightly: the tolerances below are the measured worst
/// cases with some room. The top token at every position and 16 greedy
/// tokens per prompt are equal.
#[test]
fn smollm2_gguf_logits_match_llama_cpp_on_the_same_files() {
    let (Some(path), Some(base)) = (gguf_path(), model()) else {
        return;
    };
    let golden: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(root().join("smollm2/llama_cpp.json")).expect("llama_cpp.json"),
    )
    .expect("json");
    let tmp = tempfile::tempdir().expect("tmp");
    let cases = golden["cases"].as_object().expect("cases");
    let mut ran = 0;
    for (case, prompts) in cases {
        let file = match case.as_str() {
            "q4_1" => path.clone(),
            // The f32 export holds exactly the f32 load's weights: no file.
            "f32" => path.clone(),
            "q8_0" | "q4_k_m" => {
                let file = tmp.path().join(format!("{case}.gguf"));
                let quant = case.parse().expect("quant");
                temper_model::save_gguf(base, &base.model, &file, quant).expect("export");
                file
            }
            "llama.cpp-q4_k_m" => match std::env::var_os("TEMPER_LLAMA_CPP_Q4_K_M") {
                Some(p) => PathBuf::from(p),
                None => {
                    eprintln!("SKIPPED {case}: set TEMPER_LLAMA_CPP_Q4_K_M to the file scripts/llama_cpp_golden.sh DIR wrote");
                    continue;
                }
            },
            other => panic!("unknown case {other}"),
        };
        let opts = LoadOptions {
            precision: temper_model::Precision::Gguf,
            ..LoadOptions::default()
        };
        let loaded;
        let p = if case == "f32" {
            base
        } else {
            loaded = Pretrained::load(&file, &opts).expect("gguf load");
            &loaded
        };
        assert_eq!(p.model.is_quantized(), case != "f32", "{case}");
        let formats: Vec<&str> = p.model.quant_formats().iter().map(|f| f.as_str()).collect();
        let sampler = Sampler::new(&p.model, &p.tokenizer, vec![]);
        let mut d = VsLlamaCpp::default();
        for (i, want) in prompts.as_array().expect("prompts").iter().enumerate() {
            let prompt = ids(&want["prompt"]);
            let logits: Vec<Vec<f32>> = logits_of(p, &prompt, None).to_vec2().unwrap();
            for (row, pos) in logits.iter().zip(want["positions"].as_array().unwrap()) {
                let max = row.iter().fold(f32::MIN, |a, &b| a.max(b)) as f64;
                let lse = max
                    + row
                        .iter()
                        .map(|&x| (x as f64 - max).exp())
                        .sum::<f64>()
                        .ln();
                let want_lse = pos["lse"].as_f64().unwrap();
                let top = pos["top"].as_array().unwrap();
                let argmax = (0..row.len()).fold(0, |a, j| if row[j] > row[a] { j } else { a });
                d.positions += 1;
                d.top1_equal += usize::from(top[0][0].as_u64() == Some(argmax as u64));
                let theirs = top[0][0].as_u64().unwrap() as usize;
                d.top1_gap = d.top1_gap.max((row[argmax] - row[theirs]) as f64);
                for t in top {
                    let (id, l) = (t[0].as_u64().unwrap() as usize, t[1].as_f64().unwrap());
                    d.logit = d.logit.max((row[id] as f64 - l).abs());
                    d.logprob = d
                        .logprob
                        .max(((row[id] as f64 - lse) - (l - want_lse)).abs());
                }
            }
            let out = sampler
                .generate(
                    &[GenerationRequest {
                        prompt: prompt.clone(),
                        n: 1,
                        params: SamplingParams {
                            max_tokens: 16,
                            temperature: 0.0,
                            ignore_eos: true,
                            ..Default::default()
                        },
                    }],
                    None,
                )
                .expect("generate");
            let (got, theirs) = (&out[0][0].tokens, ids(&want["greedy"]));
            let same = got.iter().zip(&theirs).take_while(|(a, b)| a == b).count();
            d.greedy.push(same);
            if same < theirs.len() {
                // Where the texts part: the two tokens' logit gap in temper.
                let mut ctx = prompt.clone();
                ctx.extend(&got[..same]);
                let last: Vec<f32> = logits_of(p, &ctx, None)
                    .get(ctx.len() - 1)
                    .unwrap()
                    .to_vec1()
                    .unwrap();
                let gap = (last[got[same] as usize] - last[theirs[same] as usize]) as f64;
                d.parting_gap = d.parting_gap.max(gap);
                eprintln!("{case} prompt {i}: greedy parts after {same} tokens ({} vs llama.cpp's {}, logit gap {gap:.4})", got[same], theirs[same]);
            }
        }
        eprintln!("{case} ({}): {d:?}", formats.join(", "));
        if case == "f32" {
            // No rounding on either side: the same model to float noise.
            assert!(formats.is_empty(), "{formats:?}");
            assert_eq!(d.top1_equal, d.positions, "{case}: top-1 tokens");
            assert!(d.greedy.iter().all(|&n| n == 16), "{case}: greedy {d:?}");
            assert!(d.logit < 0.02 && d.logprob < 0.02, "{case}: {d:?}");
        } else {
            // llama.cpp's 8-bit activations move log-probabilities by up
            // to TOL (logits by up to 2·TOL: part of it is a shift of the
            // whole row); a top token or a greedy token may differ only
            // where temper's two candidates are within TOL of each other.
            const TOL: f64 = 1.0;
            assert!(!formats.is_empty(), "{case}: nothing kept quantized");
            assert!(d.logit < 2.0 * TOL && d.logprob < TOL, "{case}: {d:?}");
            assert!(d.top1_gap < TOL && d.parting_gap < TOL, "{case}: {d:?}");
            assert!(d.top1_equal * 10 >= d.positions * 9, "{case}: {d:?}");
        }
        ran += 1;
    }
    assert!(ran >= 4, "only {ran} cases ran");
}
