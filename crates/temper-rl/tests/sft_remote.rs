//! Issue 12: SFT runs through the `Trainer` trait, so it trains on a
//! training API (`temper api serve`, started here in process) exactly as it
//! does in process: same losses step for step.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use serde_json::json;
use temper_model::{LoadOptions, Pretrained};
use temper_rl::config::{self, SftConfig};
use temper_rl::rl::RunOptions;
use temper_rl::sft::run_sft;
use temper_server::training_api::{app, ApiConfig, ApiState, BaseModel};

/// The training API on a loopback port, serving `model` as "base".
async fn serve(model: &Path, ckpt: PathBuf) -> String {
    let base = Arc::new(Pretrained::load(model, &LoadOptions::default()).unwrap());
    let state = ApiState::new(
        vec![BaseModel {
            name: "base".into(),
            model: base,
        }],
        ApiConfig {
            api_key: None,
            checkpoint_dir: ckpt,
            long_poll: Duration::from_secs(10),
            result_grace: Duration::from_secs(600),
            limits: Default::default(),
            adapters: Default::default(),
        },
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app(state)).await });
    format!("http://{addr}")
}

fn sft_config(model: &Path, data: &Path, run: &Path, extra: &str) -> SftConfig {
    let text = format!(
        r#"
        seed = 4
        [model]
        path = "{}"
        [lora]
        rank = 4
        [data]
        path = "{}"
        [trainer]
        lr = 1e-2
        batch_size = 2
        max_steps = 6
        [ckpt]
        interval = 3
        [log]
        dir = "{}"
        progress = false
        {extra}
        "#,
        model.display(),
        data.display(),
        run.display()
    );
    config::resolve(&text, &[]).unwrap()
}

#[test]
fn sft_on_a_remote_training_api_gives_the_local_losses() {
    let d = tempfile::tempdir().unwrap();
    let model = d.path().join("model");
    temper_rl::preset::TinyPreset::smallest()
        .write(&model, 1)
        .unwrap();
    let data = d.path().join("chat.jsonl");
    let rows: String = ["red", "blue", "green", "black"]
        .iter()
        .map(|c| {
            json!({"messages": [
                {"role": "user", "content": format!("color {c}?")},
                {"role": "assistant", "content": format!("<c>{c}</c>")}
            ]})
            .to_string()
                + "\n"
        })
        .collect();
    std::fs::write(&data, rows).unwrap();

    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let local = rt
        .block_on(run_sft(
            sft_config(&model, &data, &d.path().join("local"), ""),
            RunOptions::default(),
        ))
        .unwrap();
    let url = rt.block_on(serve(&model, d.path().join("api-ckpt")));
    let remote = rt
        .block_on(run_sft(
            sft_config(
                &model,
                &data,
                &d.path().join("remote"),
                &format!("[remote_trainer]\nurl = \"{url}\"\nbase_model = \"base\"\n"),
            ),
            RunOptions::default(),
        ))
        .unwrap();

    let losses = |m: &[serde_json::Map<String, serde_json::Value>]| -> Vec<f64> {
        m.iter().map(|r| r["loss"].as_f64().unwrap()).collect()
    };
    let (l, r) = (losses(&local.metrics), losses(&remote.metrics));
    assert_eq!(l.len(), 6);
    assert_eq!(
        l, r,
        "the same SFT steps in process and over the training API"
    );
    assert!(l[5] < l[0], "it trains: {l:?}");
    // The weights stay on the service: the output is its checkpoint path.
    assert!(local.output.ends_with("adapter"), "{:?}", local.output);
    assert!(
        remote.output.to_string_lossy().starts_with("tinker://"),
        "{:?}",
        remote.output
    );
}
