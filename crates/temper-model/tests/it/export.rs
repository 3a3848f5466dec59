//! Export round trips: a model written as GGUF (or a Hugging Face directory)
//! and loaded back computes the same logits — exactly in f32, within the
//! quantisation's error otherwise — with the same tokenizer and template.

use std::path::Path;

use temper_model::{save_gguf, save_hf, GgufQuant, LoadOptions, Pretrained, RopeScaling};

use crate::common::*;

const TEXTS: [&str; 5] = [
    "Hello world",
    "  two  spaces\n\nand newlines\t",
    "Café naïve 日本語 🤗",
    "<|im_start|>user\nhi<|im_end|>",
    "numbers 12345 and 3.14",
];

/// A copy of the tiny Llama fixture with plain RoPE.
fn tiny_llama_plain_rope(dir: &Path) -> Pretrained {
    let src = root().join("models/tiny-llama");
    for e in std::fs::read_dir(&src).expect("fixture dir") {
        let e = e.expect("entry");
        std::fs::copy(e.path(), dir.join(e.file_name())).expect("copy");
    }
    let cfg_path = dir.join("config.json");
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&cfg_path).expect("config")).expect("json");
    let obj = cfg.as_object_mut().expect("object");
    obj.remove("rope_scaling");
    obj.insert(
        "rope_parameters".into(),
        serde_json::json!({"rope_type": "default", "rope_theta": 10000.0}),
    );
    std::fs::write(&cfg_path, cfg.to_string()).expect("write");
    Pretrained::load(dir, &LoadOptions::default()).expect("loads")
}

fn check_same_model(a: &Pretrained, b: &Pretrained, tol: f32, what: &str) {
    let input = a.tokenizer.encode(TEXTS[2], true).expect("encode");
    let e = rel_err(&logits_of(b, &input, None), &logits_of(a, &input, None));
    eprintln!("{what}: logits relative error {e:.2e}");
    assert!(e <= tol, "{what}: logits relative error {e} > {tol}");
    for t in TEXTS {
        let ids = a.tokenizer.encode(t, true).expect("encode");
        assert_eq!(
            b.tokenizer.encode(t, true).expect("encode"),
            ids,
            "{what}: {t:?}"
        );
        assert_eq!(
            b.tokenizer.decode(&ids, false).expect("decode"),
            a.tokenizer.decode(&ids, false).expect("decode"),
            "{what}: decode {t:?}"
        );
    }
    let msgs = serde_json::json!([{"role": "user", "content": "What is 2+2?"}]);
    let render = |p: &Pretrained| {
        p.chat_template
            .as_ref()
            .expect("template")
            .render(&msgs, None, true, &Default::default())
            .expect("render")
    };
    assert_eq!(render(b), render(a), "{what}: chat template");
    assert_eq!(
        b.generation.eos_token_ids.first(),
        a.generation.eos_token_ids.first()
    );
}

#[test]
fn gguf_export_round_trips_every_family() {
    let tmp = tempfile::tempdir().expect("tmp");
    let llama_dir = tmp.path().join("llama");
    std::fs::create_dir_all(&llama_dir).expect("mkdir");
    let models = [
        ("tiny-llama (plain rope)", tiny_llama_plain_rope(&llama_dir)),
        ("tiny-qwen2", load("tiny-qwen2")),
        ("tiny-qwen3", load("tiny-qwen3")),
    ];
    for (name, p) in &models {
        for (quant, tol) in [
            (GgufQuant::F32, 1e-6),
            (GgufQuant::F16, 2e-3),
            (GgufQuant::Q8_0, 5e-2),
        ] {
            let path = tmp
                .path()
                .join(format!("{}-{quant:?}.gguf", p.config.family.model_type()));
            save_gguf(p, &p.model, &path, quant).expect("export");
            let back = Pretrained::load(&path, &LoadOptions::default()).expect("reload");
            assert_eq!(back.config.family, p.config.family);
            assert_eq!(back.config.qkv_bias, p.config.qkv_bias);
            assert_eq!(back.config.qk_norm, p.config.qk_norm);
            assert_eq!(
                back.config.tie_word_embeddings,
                p.config.tie_word_embeddings
            );
            assert_eq!(back.config.head_dim, p.config.head_dim);
            check_same_model(p, &back, tol, &format!("{name} {quant:?}"));
        }
    }
}

/// Llama 3 rope scaling travels as llama.cpp's `rope_freqs.weight` and is
/// recognised again on load.
#[test]
fn gguf_export_round_trips_llama3_rope_scaling() {
    let p = load("tiny-llama");
    let tmp = tempfile::tempdir().expect("tmp");
    let path = tmp.path().join("llama3.gguf");
    save_gguf(&p, &p.model, &path, GgufQuant::F32).expect("export");
    let back = Pretrained::load(&path, &LoadOptions::default()).expect("reload");
    match (&p.config.rope_scaling, &back.config.rope_scaling) {
        (
            RopeScaling::Llama3 {
                factor: f0,
                low_freq_factor: l0,
                high_freq_factor: h0,
                original_max_position_embeddings: o0,
            },
            RopeScaling::Llama3 {
                factor: f1,
                low_freq_factor: l1,
                high_freq_factor: h1,
                original_max_position_embeddings: o1,
            },
        ) => {
            assert_eq!((f0, l0, h0, o0), (f1, l1, h1, o1));
        }
        other => panic!("rope scaling not recovered: {other:?}"),
    }
    check_same_model(&p, &back, 1e-6, "tiny-llama (llama3 rope) F32");
}

#[test]
fn hf_export_round_trips_with_merged_adapter() {
    let p = load("tiny-qwen2");
    let a = adapter(&p, "tiny-qwen2");
    let merged = p.model.merge_lora(&a).expect("merge");
    let tmp = tempfile::tempdir().expect("tmp");
    save_hf(&p, &merged, tmp.path()).expect("export");
    let back = Pretrained::load(tmp.path(), &LoadOptions::default()).expect("reload");
    let input = p.tokenizer.encode(TEXTS[0], true).expect("encode");
    let e = rel_err(
        &logits_of(&back, &input, None),
        &logits_of(&p, &input, Some(&a)),
    );
    assert!(e <= 1e-5, "merged HF export: relative error {e}");
    for t in TEXTS {
        assert_eq!(
            back.tokenizer.encode(t, true).unwrap(),
            p.tokenizer.encode(t, true).unwrap()
        );
    }
    // Llama 3 rope scaling survives config.json.
    let l = load("tiny-llama");
    let dir = tmp.path().join("llama");
    save_hf(&l, &l.model, &dir).expect("export llama");
    let back = Pretrained::load(&dir, &LoadOptions::default()).expect("reload llama");
    assert_eq!(back.config.rope_scaling, l.config.rope_scaling);
    let input = l.tokenizer.encode(TEXTS[2], true).expect("encode");
    let e = rel_err(
        &logits_of(&back, &input, None),
        &logits_of(&l, &input, None),
    );
    assert!(e == 0.0, "llama HF export: relative error {e}");
}

#[test]
fn unknown_quantisation_is_an_error_naming_it() {
    let err = "q7_z".parse::<GgufQuant>().expect_err("unknown");
    assert!(err.to_string().contains("q7_z"));
    assert_eq!("Q4_K_M".parse::<GgufQuant>().unwrap(), GgufQuant::Q4KM);
}

/// SmolLM2 (GGUF, Llama with permuted q/k) → GGUF f32 and → HF directory:
/// both load back to the same logits and tokenizer.
#[test]
fn smollm2_exports_round_trip() {
    let Some(path) = std::env::var_os("TEMPER_SMOLLM2_GGUF") else {
        eprintln!("SKIPPED: set TEMPER_SMOLLM2_GGUF (scripts/fetch_smollm2.sh)");
        return;
    };
    let p = Pretrained::load(Path::new(&path), &LoadOptions::default()).expect("load");
    let tmp = tempfile::tempdir().expect("tmp");
    let g = tmp.path().join("smollm2-f32.gguf");
    save_gguf(&p, &p.model, &g, GgufQuant::F32).expect("export gguf");
    let back = Pretrained::load(&g, &LoadOptions::default()).expect("reload gguf");
    check_same_model(&p, &back, 1e-6, "smollm2 gguf f32");
    let hf = tmp.path().join("hf");
    save_hf(&p, &p.model, &hf).expect("export hf");
    let back = Pretrained::load(&hf, &LoadOptions::default()).expect("reload hf");
    check_same_model(&p, &back, 1e-6, "smollm2 hf");
}
