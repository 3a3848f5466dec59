//! The `temper` binary end to end on the fixture models.

use std::path::PathBuf;
use std::process::Command;

use temper_model::{LoadOptions, Pretrained};

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures")
}

fn temper(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_temper"))
        .args(args)
        .output()
        .expect("temper runs")
}

#[test]
fn generate_prints_the_greedy_continuation_of_transformers() {
    let g: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(fixtures().join("golden/tiny-llama.json")).unwrap(),
    )
    .unwrap();
    let case = &g["greedy"][0];
    let model = fixtures().join("models/tiny-llama");
    let p = Pretrained::load(&model, &LoadOptions::default()).unwrap();
    let new_ids: Vec<u32> = case["new_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect();
    // The golden run ignores EOS; cut at the first EOS as `temper generate` stops there.
    let eos = &p.generation.eos_token_ids;
    let end = new_ids
        .iter()
        .position(|t| eos.contains(t))
        .unwrap_or(new_ids.len());
    let want = p.tokenizer.decode(&new_ids[..end], true).unwrap();
    let out = temper(&[
        "generate",
        "--model",
        model.to_str().unwrap(),
        "--prompt",
        case["prompt_text"].as_str().unwrap(),
        "--temperature",
        "0",
        "--max-tokens",
        &new_ids.len().to_string(),
        "--threads",
        "1",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(String::from_utf8_lossy(&out.stdout), format!("{want}\n"));
}

#[test]
fn generate_chat_with_lora_and_seed_is_reproducible() {
    let model = fixtures().join("models/tiny-qwen3");
    let lora = fixtures().join("adapters/tiny-qwen3-lora");
    let args = [
        "generate",
        "--model",
        model.to_str().unwrap(),
        "--lora",
        lora.to_str().unwrap(),
        "--prompt",
        "What is 12 + 7?",
        "--chat",
        "--seed",
        "7",
        "--n",
        "2",
        "--max-tokens",
        "10",
    ];
    let a = temper(&args);
    let b = temper(&args);
    assert!(a.status.success(), "{}", String::from_utf8_lossy(&a.stderr));
    assert_eq!(a.stdout, b.stdout);
    assert!(String::from_utf8_lossy(&a.stdout).contains("--- sample 1 ---"));
}

#[test]
fn generate_reports_a_missing_model_directory() {
    let out = temper(&[
        "generate",
        "--model",
        "/nonexistent/model",
        "--prompt",
        "hi",
    ]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("/nonexistent/model"), "{err}");
}

#[test]
fn logprobs_do_not_depend_on_the_thread_count() {
    let model = fixtures().join("models/tiny-qwen2");
    let run = |threads: &str| {
        let out = temper(&[
            "generate",
            "--model",
            model.to_str().unwrap(),
            "--prompt",
            "def add(a, b): return a + b and some more text to make the prompt longer",
            "--seed",
            "3",
            "--max-tokens",
            "24",
            "--logprobs",
            "--threads",
            threads,
        ]);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let lines: Vec<String> = String::from_utf8_lossy(&out.stderr)
            .lines()
            .filter(|l| l.contains("logprob"))
            .map(str::to_string)
            .collect();
        assert!(!lines.is_empty());
        lines
    };
    assert_eq!(run("1"), run("2"));
    assert_eq!(run("1"), run("3"));
}
