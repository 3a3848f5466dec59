//! `temper export` end to end: a PEFT adapter out as a PEFT adapter, a merged
//! Hugging Face directory and a GGUF, each loading back to the adapted
//! model's logits; and a GGUF accepted by `temper generate`.

use std::path::{Path, PathBuf};
use std::process::Command;

use temper_model::{LoadOptions, LoraAdapter, Pretrained, Segment};

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures")
}

fn temper(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_temper"))
        .args(args)
        .output()
        .expect("temper runs")
}

fn logits(p: &Pretrained, ids: &[u32], a: Option<&LoraAdapter>) -> Vec<Vec<f32>> {
    let mut segs = [Segment {
        len: ids.len(),
        cache: None,
    }];
    let h = p.model.forward_hidden(ids, &mut segs, a).expect("forward");
    p.model.logits(&h).expect("logits").to_vec2().expect("vec")
}

fn max_rel(a: &[Vec<f32>], b: &[Vec<f32>]) -> f32 {
    let scale = b.iter().flatten().fold(0f32, |m, x| m.max(x.abs()));
    a.iter()
        .flatten()
        .zip(b.iter().flatten())
        .fold(0f32, |m, (x, y)| m.max((x - y).abs()))
        / scale
}

fn run_ok(args: &[&str]) {
    let out = temper(args);
    assert!(
        out.status.success(),
        "temper {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn export_writes_peft_hf_and_gguf_that_load_back_to_the_adapted_model() {
    let base_dir = fixtures().join("models/tiny-qwen2");
    let adapter_dir = fixtures().join("adapters/tiny-qwen2-lora");
    let base = Pretrained::load(&base_dir, &LoadOptions::default()).expect("base");
    let adapter = LoraAdapter::load_peft(
        &adapter_dir,
        &base.config,
        base.model.dtype(),
        base.model.device(),
    )
    .expect("adapter");
    let ids = base
        .tokenizer
        .encode("Hello, wörld!  1234", true)
        .expect("encode");
    let want = logits(&base, &ids, Some(&adapter));
    let tmp = tempfile::tempdir().expect("tmp");
    let s = |p: &Path| p.display().to_string();
    let common = [s(&adapter_dir), "--base".into(), s(&base_dir)];
    let with = |extra: &[&str]| -> Vec<String> {
        let mut v = vec!["export".to_string()];
        v.extend(common.iter().cloned());
        v.extend(extra.iter().map(|x| x.to_string()));
        v
    };

    let peft = tmp.path().join("peft");
    let args = with(&["--format", "peft", "--out", &s(&peft)]);
    run_ok(&args.iter().map(String::as_str).collect::<Vec<_>>());
    let back = LoraAdapter::load_peft(&peft, &base.config, base.model.dtype(), base.model.device())
        .expect("exported adapter loads");
    assert_eq!(max_rel(&logits(&base, &ids, Some(&back)), &want), 0.0);

    let hf = tmp.path().join("hf");
    let args = with(&["--format", "hf", "--out", &s(&hf)]);
    run_ok(&args.iter().map(String::as_str).collect::<Vec<_>>());
    let merged = Pretrained::load(&hf, &LoadOptions::default()).expect("hf loads");
    let e = max_rel(&logits(&merged, &ids, None), &want);
    assert!(e <= 1e-5, "merged HF: relative error {e}");

    let gguf = tmp.path().join("m.gguf");
    let args = with(&["--format", "gguf", "--quant", "f32", "--out", &s(&gguf)]);
    run_ok(&args.iter().map(String::as_str).collect::<Vec<_>>());
    let g = Pretrained::load(&gguf, &LoadOptions::default()).expect("gguf loads");
    let e = max_rel(&logits(&g, &ids, None), &want);
    assert!(e <= 1e-5, "GGUF f32: relative error {e}");
    assert_eq!(
        g.tokenizer.encode("Hello, wörld!  1234", true).unwrap(),
        ids
    );

    // The GGUF is a model like any other for the CLI.
    let out = temper(&[
        "generate",
        "--model",
        &s(&gguf),
        "--prompt",
        "Hello",
        "--max-tokens",
        "4",
        "--temperature",
        "0",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn export_errors_name_the_problem() {
    let tmp = tempfile::tempdir().expect("tmp");
    let out_path = tmp.path().join("x");
    let model = fixtures().join("models/tiny-qwen3");
    // A model has no adapter to export as PEFT.
    let out = temper(&[
        "export",
        &model.display().to_string(),
        "--format",
        "peft",
        "--out",
        &out_path.display().to_string(),
    ]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("no LoRA adapter"));
    // An unknown quantisation.
    let out = temper(&[
        "export",
        &model.display().to_string(),
        "--format",
        "gguf",
        "--quant",
        "q9_9",
        "--out",
        &out_path.display().to_string(),
    ]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("q9_9"));
    // Not a run, adapter, checkpoint or model.
    let out = temper(&[
        "export",
        &tmp.path().display().to_string(),
        "--format",
        "hf",
        "--out",
        &out_path.display().to_string(),
    ]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("not a run directory"));
}

/// A checkpoint (`state.json` + weights), LoRA or full, exports like the
/// adapter / model it holds.
#[test]
fn export_reads_lora_and_full_checkpoints() {
    use std::sync::Arc;
    use temper_engine::TrainingRun;

    let base_dir = fixtures().join("models/tiny-qwen2");
    let adapter_dir = fixtures().join("adapters/tiny-qwen2-lora");
    let base = Arc::new(Pretrained::load(&base_dir, &LoadOptions::default()).expect("base"));
    let adapter = LoraAdapter::load_peft(
        &adapter_dir,
        &base.config,
        base.model.dtype(),
        base.model.device(),
    )
    .expect("adapter");
    let ids = base
        .tokenizer
        .encode("Hello, wörld!", true)
        .expect("encode");
    let want = logits(&base, &ids, Some(&adapter));
    let tmp = tempfile::tempdir().expect("tmp");
    let s = |p: &Path| p.display().to_string();

    let lora_state = tmp.path().join("lora-state");
    TrainingRun::lora_from(base.clone(), adapter)
        .save_state(&lora_state)
        .expect("save lora state");
    let out = tmp.path().join("from-lora-state");
    run_ok(&[
        "export",
        &s(&lora_state),
        "--format",
        "peft",
        "--out",
        &s(&out),
    ]);
    let back = LoraAdapter::load_peft(&out, &base.config, base.model.dtype(), base.model.device())
        .expect("adapter from checkpoint");
    assert_eq!(max_rel(&logits(&base, &ids, Some(&back)), &want), 0.0);

    let full_state = tmp.path().join("full-state");
    TrainingRun::full(base.clone())
        .expect("full run")
        .save_state(&full_state)
        .expect("save full state");
    let out = tmp.path().join("from-full-state");
    run_ok(&[
        "export",
        &s(&full_state),
        "--format",
        "hf",
        "--out",
        &s(&out),
    ]);
    let back = Pretrained::load(&out, &LoadOptions::default()).expect("hf from checkpoint");
    assert_eq!(
        max_rel(&logits(&back, &ids, None), &logits(&base, &ids, None)),
        0.0
    );
}

/// A SmolLM2 GGUF exported by temper runs in llama.cpp and greedy-decodes the
/// same text as `temper generate` on the same file. Needs the real model
/// (`TEMPER_SMOLLM2_GGUF`, scripts/fetch_smollm2.sh) and a llama.cpp build
/// (`TEMPER_LLAMA_CPP`: the directory holding `llama-simple`,
/// scripts/build_llama_cpp.sh); without them it says it is skipped.
#[test]
fn smollm2_gguf_export_runs_in_llama_cpp_with_our_greedy_text() {
    let (Some(gguf), Some(llama)) = (
        std::env::var_os("TEMPER_SMOLLM2_GGUF"),
        std::env::var_os("TEMPER_LLAMA_CPP"),
    ) else {
        eprintln!(
            "SKIPPED: set TEMPER_SMOLLM2_GGUF (scripts/fetch_smollm2.sh) and TEMPER_LLAMA_CPP (scripts/build_llama_cpp.sh)"
        );
        return;
    };
    let tmp = tempfile::tempdir().expect("tempdir");
    let out = tmp.path().join("smollm2-f32.gguf");
    let out_s = out.to_str().expect("utf-8 path");
    // f32: the export holds exactly the weights temper computes with, so the
    // two engines differ only in summation order.
    run_ok(&[
        "export",
        gguf.to_str().expect("utf-8 path"),
        "--format",
        "gguf",
        "--quant",
        "f32",
        "--out",
        out_s,
    ]);
    let prompts = [
        "The capital of France is",
        "<|im_start|>user\nWhat is 7 + 5?<|im_end|>\n<|im_start|>assistant\n",
    ];
    for prompt in prompts {
        let ours = temper(&[
            "generate",
            "--model",
            out_s,
            "--prompt",
            prompt,
            "--temperature",
            "0",
            "--max-tokens",
            "24",
        ]);
        assert!(
            ours.status.success(),
            "{}",
            String::from_utf8_lossy(&ours.stderr)
        );
        let theirs = Command::new(Path::new(&llama).join("llama-simple"))
            .args(["-m", out_s, "-n", "24", prompt])
            .output()
            .expect("llama-simple runs");
        assert!(
            theirs.status.success(),
            "llama-simple failed to run our export: {}",
            String::from_utf8_lossy(&theirs.stderr)
        );
        // llama-simple echoes the prompt, then the continuation.
        let theirs = String::from_utf8_lossy(&theirs.stdout);
        let theirs = theirs
            .strip_prefix(prompt)
            .unwrap_or_else(|| panic!("llama-simple did not echo the prompt: {theirs:?}"));
        let ours = String::from_utf8_lossy(&ours.stdout);
        assert_eq!(ours.trim_end(), theirs.trim_end(), "prompt {prompt:?}");
    }
}

/// `temper serve --model FILE` on port 0 with `extra` flags: the server
/// (killed on drop) and its address.
struct Served(std::process::Child);

impl Drop for Served {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn serve(model: &Path, extra: &[&str]) -> (Served, String) {
    use std::io::BufRead;
    let mut child = Command::new(env!("CARGO_BIN_EXE_temper"))
        .args(["serve", "--port", "0", "--model"])
        .arg(model)
        .args(extra)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("serve starts");
    let mut lines = std::io::BufReader::new(child.stderr.take().expect("stderr")).lines();
    let addr = loop {
        let line = lines.next().expect("the server exited").expect("line");
        if let Some(rest) = line.split("listening on http://").nth(1) {
            break rest.split_whitespace().next().expect("address").to_string();
        }
    };
    std::thread::spawn(move || for _ in lines.by_ref() {});
    (Served(child), addr)
}

/// One HTTP/1.1 request over std: (status, body).
fn http(addr: &str, method: &str, path: &str, body: &str) -> (u16, serde_json::Value) {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).expect("connect");
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .expect("write");
    let mut resp = String::new();
    s.read_to_string(&mut resp).expect("read");
    let (head, body) = resp.split_once("\r\n\r\n").expect("head");
    let status = head
        .split_whitespace()
        .nth(1)
        .expect("status")
        .parse()
        .expect("code");
    (status, serde_json::from_str(body).expect("JSON body"))
}

fn model_ids(addr: &str) -> Vec<String> {
    let (status, v) = http(addr, "GET", "/v1/models", "");
    assert_eq!(status, 200, "{v}");
    v["data"]
        .as_array()
        .expect("data")
        .iter()
        .map(|m| m["id"].as_str().expect("id").to_string())
        .collect()
}

fn chat_status(addr: &str, model: &str) -> u16 {
    let body = serde_json::json!({
        "model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
    });
    http(addr, "POST", "/v1/chat/completions", &body.to_string()).0
}

/// Issue 39: `temper serve --model FILE.gguf` calls the model by the GGUF's
/// `general.name` (an exported GGUF carries its base's name), lists only
/// that in /v1/models, still answers to the file name clients sent before,
/// and `--served-model-name` replaces both.
#[test]
fn serve_names_a_gguf_by_its_general_name_and_keeps_the_file_name_as_alias() {
    let tmp = tempfile::tempdir().expect("tmp");
    let gguf = tmp.path().join("exported.gguf");
    let base = fixtures().join("models/tiny-qwen3");
    run_ok(&[
        "export",
        base.to_str().expect("utf-8"),
        "--format",
        "gguf",
        "--quant",
        "f32",
        "--out",
        gguf.to_str().expect("utf-8"),
    ]);
    let g = temper_model::GgufFile::open(&gguf).expect("gguf opens");
    assert_eq!(g.general_name(), Some("tiny-qwen3"));

    let (_server, addr) = serve(&gguf, &[]);
    assert_eq!(model_ids(&addr), ["tiny-qwen3"]);
    assert_eq!(chat_status(&addr, "tiny-qwen3"), 200);
    assert_eq!(chat_status(&addr, "exported.gguf"), 200, "the old id");
    assert_eq!(chat_status(&addr, "exported"), 404);
    drop(_server);

    let (_server, addr) = serve(&gguf, &["--served-model-name", "mine"]);
    assert_eq!(model_ids(&addr), ["mine"]);
    assert_eq!(chat_status(&addr, "mine"), 200);
    assert_eq!(chat_status(&addr, "tiny-qwen3"), 404);
    assert_eq!(chat_status(&addr, "exported.gguf"), 404);
}
