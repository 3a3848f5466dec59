//! Tokenizers rebuilt from GGUF metadata encode and decode exactly as
//! transformers' GGUF loader does: SentencePiece BPE (`llama`, merges derived
//! from the scores, byte fallback, BOS) and byte-level BPE under the
//! `llama-bpe`, `qwen2` and `smollm` pre-tokenizers. Fixtures: small
//! tokenizer-only GGUFs and transformers' outputs, made by
//! `scripts/make_gguf_tokenizer_fixtures.py`.

use temper_model::GgufFile;

use crate::common::*;

#[test]
fn gguf_tokenizers_match_transformers() {
    let dir = root().join("gguf-tokenizers");
    let refs: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("refs.json")).expect("refs"))
            .expect("json");
    let refs = refs.as_object().expect("object");
    assert_eq!(refs.len(), 4);
    for (name, cases) in refs {
        let file = GgufFile::open(&dir.join(format!("{name}.gguf"))).expect("opens");
        let tok = file.tokenizer().expect("tokenizer");
        for c in cases.as_array().expect("cases") {
            let text = c["text"].as_str().expect("text");
            let want = ids(&c["ids"]);
            assert_eq!(
                tok.encode(text, true).expect("encode"),
                want,
                "{name}: encode {text:?}"
            );
            assert_eq!(
                tok.decode(&want, false).expect("decode"),
                c["decoded"].as_str().expect("decoded"),
                "{name}: decode {text:?}"
            );
            assert_eq!(
                tok.decode(&want, true).expect("decode"),
                c["decoded_skip_special"].as_str().expect("decoded"),
                "{name}: decode skipping special tokens {text:?}"
            );
        }
    }
}

#[test]
fn a_tokenizer_only_gguf_is_an_error_naming_the_missing_key() {
    let dir = root().join("gguf-tokenizers");
    let err = temper_model::Pretrained::load(&dir.join("sp-llama.gguf"), &Default::default())
        .err()
        .expect("no model in a tokenizer-only file");
    assert!(
        err.to_string().contains("llama.attention.head_count"),
        "{err}"
    );
}

/// A GGUF header by hand: `arch`, one 1-D tensor of `ggml_type` (32 values).
fn handmade_gguf(arch: &str, ggml_type: u32) -> Vec<u8> {
    let mut b = Vec::new();
    let s = |b: &mut Vec<u8>, x: &str| {
        b.extend((x.len() as u64).to_le_bytes());
        b.extend(x.as_bytes());
    };
    b.extend(b"GGUF");
    b.extend(3u32.to_le_bytes());
    b.extend(1u64.to_le_bytes()); // tensors
    b.extend(1u64.to_le_bytes()); // metadata entries
    s(&mut b, "general.architecture");
    b.extend(8u32.to_le_bytes()); // string
    s(&mut b, arch);
    s(&mut b, "token_embd.weight");
    b.extend(1u32.to_le_bytes());
    b.extend(32u64.to_le_bytes());
    b.extend(ggml_type.to_le_bytes());
    b.extend(0u64.to_le_bytes());
    while b.len() % 32 != 0 {
        b.push(0);
    }
    b.extend([0u8; 256]);
    b
}

#[test]
fn an_unsupported_gguf_architecture_is_an_error_naming_it() {
    let tmp = tempfile::tempdir().expect("tmp");
    let path = tmp.path().join("phi.gguf");
    std::fs::write(&path, handmade_gguf("phi3", 0)).expect("write");
    let err = temper_model::Pretrained::load(&path, &Default::default())
        .err()
        .expect("phi3 is not supported");
    assert!(err.to_string().contains("phi3"), "{err}");
}

#[test]
fn an_unsupported_gguf_tensor_type_is_an_error_naming_it() {
    let tmp = tempfile::tempdir().expect("tmp");
    let path = tmp.path().join("iq.gguf");
    // 16 = IQ2_XXS, which candle cannot dequantise.
    std::fs::write(&path, handmade_gguf("llama", 16)).expect("write");
    let err = GgufFile::open(&path).expect_err("IQ2_XXS is not supported");
    assert!(
        err.to_string().contains("tensor type 16 (IQ2_XXS)"),
        "{err}"
    );
    // F32 with the same layout opens.
    std::fs::write(&path, handmade_gguf("llama", 0)).expect("write");
    GgufFile::open(&path).expect("F32 opens");
}
