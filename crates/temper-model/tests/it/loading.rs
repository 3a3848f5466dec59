//! Loading errors name the problem.

use std::path::Path;

use temper_model::{LoadOptions, Pretrained};

use crate::common::*;

fn copy_fixture(name: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("tempdir");
    for entry in std::fs::read_dir(root().join("models").join(name)).expect("fixture dir") {
        let entry = entry.expect("entry");
        std::fs::copy(entry.path(), dir.path().join(entry.file_name())).expect("copy");
    }
    dir
}

fn load_err(dir: &Path) -> String {
    match Pretrained::load(dir, &LoadOptions::default()) {
        Ok(_) => panic!("expected an error loading {}", dir.display()),
        Err(e) => e.to_string(),
    }
}

fn edit_config(dir: &Path, f: impl FnOnce(&mut serde_json::Value)) {
    let path = dir.join("config.json");
    let mut v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    f(&mut v);
    std::fs::write(&path, serde_json::to_string(&v).unwrap()).unwrap();
}

#[test]
fn missing_files_are_named() {
    let d = copy_fixture("tiny-llama");
    std::fs::remove_file(d.path().join("tokenizer.json")).unwrap();
    assert!(load_err(d.path()).contains("tokenizer.json"));
    let d = copy_fixture("tiny-llama");
    std::fs::remove_file(d.path().join("config.json")).unwrap();
    assert!(load_err(d.path()).contains("config.json"));
    let d = copy_fixture("tiny-llama");
    std::fs::remove_file(d.path().join("model.safetensors")).unwrap();
    assert!(load_err(d.path()).contains("model.safetensors"));
    let d = copy_fixture("tiny-qwen2");
    std::fs::remove_file(d.path().join("model-00002-of-00003.safetensors")).unwrap();
    assert!(load_err(d.path()).contains("model-00002-of-00003.safetensors"));
}

#[test]
fn unknown_model_type_is_rejected() {
    let d = copy_fixture("tiny-qwen3");
    edit_config(d.path(), |v| v["model_type"] = "mamba".into());
    let e = load_err(d.path());
    assert!(e.contains("mamba") && e.contains("llama"), "{e}");
}

#[test]
fn shape_mismatch_names_the_tensor() {
    let d = copy_fixture("tiny-qwen3");
    edit_config(d.path(), |v| v["intermediate_size"] = 96.into());
    let e = load_err(d.path());
    assert!(
        e.contains("mlp.gate_proj.weight") && e.contains("96"),
        "{e}"
    );
}

#[test]
fn sharded_checkpoint_loads() {
    // tiny-qwen2 is split across three shards by the fixture script.
    assert!(root()
        .join("models/tiny-qwen2/model.safetensors.index.json")
        .exists());
    let p = load("tiny-qwen2");
    assert!(p.config.tie_word_embeddings);
}
