//! The trainer a plan asks for: the base model of `[model]`, trained in
//! process (LoRA or full) or through a remote training API. RL and SFT get
//! theirs here, as a [`Trainer`].

use std::path::{Path, PathBuf};
use std::sync::Arc;

use temper_engine::{Engine, LocalTrainer, Trainer};
use temper_model::{LoadOptions, Pretrained};

use crate::config::{LoraSection, ModelSection, RemoteTrainerSection};
use crate::error::{Result, RlError};
use crate::plan::{ModelPlan, ModelSource};

pub use crate::plan::lora_config;

/// The model directory of `source`, writing the tiny preset if asked.
pub fn model_dir(source: &ModelSource, run_dir: &Path) -> Result<PathBuf> {
    match source {
        ModelSource::Path(p) => Ok(p.clone()),
        ModelSource::Tiny(tiny) => {
            let dir = run_dir.join("base-model");
            if !dir.join("model.safetensors").exists() {
                tiny.write(&dir, 0)?;
            }
            Ok(dir)
        }
    }
}

/// The in-process trainer for `[model]` + `[lora]` (checked here): the
/// loaded base, and a [`LocalTrainer`] whose checkpoints go under
/// `run_dir/checkpoints`.
pub fn local_trainer(
    model: &ModelSection,
    lora: &LoraSection,
    seed: u64,
    run_dir: &Path,
) -> Result<(Arc<Pretrained>, Arc<LocalTrainer>)> {
    local_trainer_of(&ModelPlan::of(model, lora)?, seed, run_dir)
}

/// The in-process trainer of a checked [`ModelPlan`].
pub fn local_trainer_of(
    model: &ModelPlan,
    seed: u64,
    run_dir: &Path,
) -> Result<(Arc<Pretrained>, Arc<LocalTrainer>)> {
    local_trainer_on(model, seed, run_dir, Engine::new())
}

/// [`local_trainer_of`] on `engine` (e.g. one on its own thread pool,
/// [`Engine::on_pool`]).
pub fn local_trainer_on(
    model: &ModelPlan,
    seed: u64,
    run_dir: &Path,
    engine: Engine,
) -> Result<(Arc<Pretrained>, Arc<LocalTrainer>)> {
    let dir = model_dir(&model.source, run_dir)?;
    let opts = LoadOptions {
        precision: model.precision,
        matmul: model.matmul,
        ..LoadOptions::default()
    };
    let base = Arc::new(Pretrained::load(&dir, &opts)?);
    engine.add_base_model("base", base.clone()).wait()?;
    let run = match (&model.adapter, &model.lora) {
        (Some(adapter), _) => {
            tracing::info!(adapter = %adapter.display(), "continuing from a PEFT adapter (its rank/alpha/targets are used)");
            engine
                .create_lora_run_from_peft("base", adapter.clone())
                .wait()?
        }
        (None, Some(lora)) => engine.create_lora_run("base", lora.clone(), seed).wait()?,
        (None, None) => engine.create_full_run("base").wait()?,
    };
    let trainer = LocalTrainer::new(engine, run, run_dir.join("checkpoints"));
    Ok((base, Arc::new(trainer)))
}

/// Run blocking `f` on tokio's blocking pool: loading reads and converts
/// the weights, and the engine's setup is waited on synchronously, neither
/// of which may stall the async runtime.
async fn off_runtime<T: Send + 'static>(
    f: impl FnOnce() -> Result<T> + Send + 'static,
) -> Result<T> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|source| RlError::Blocking {
            what: "loading the model",
            source,
        })?
}

/// The trainer of a run — in process, or the training API at `remote`'s
/// `url` (the plan checked it trains LoRA with the API's alpha) — and the
/// base model it trains (for its tokenizer and chat template).
pub async fn trainer_for(
    model: &ModelPlan,
    remote: Option<&RemoteTrainerSection>,
    seed: u64,
    run_dir: &Path,
) -> Result<(Arc<Pretrained>, Arc<dyn Trainer>)> {
    let run_dir = run_dir.to_path_buf();
    let Some(remote) = remote else {
        let model = model.clone();
        let (base, local) = off_runtime(move || local_trainer_of(&model, seed, &run_dir)).await?;
        return Ok((base, local));
    };
    let (Some(url), Some(lora)) = (&remote.url, &model.lora) else {
        return Err(RlError::Config(
            "a remote trainer needs remote_trainer.url and [lora] enabled".into(),
        ));
    };
    let dir = model_dir(&model.source, &run_dir)?;
    let opts = LoadOptions {
        precision: model.precision,
        matmul: model.matmul,
        ..LoadOptions::default()
    };
    let base = off_runtime(move || Ok(Arc::new(Pretrained::load(&dir, &opts)?))).await?;
    let key = remote_api_key(remote)?;
    let remote =
        temper_client::RemoteTrainer::connect(url, &key, &remote.base_model, lora.rank, Some(seed))
            .await
            .map_err(|e| RlError::Sampler(format!("training API {url}: {e}")))?;
    Ok((base, Arc::new(remote)))
}

/// The training API's key: from the variable `api_key_env` names (an error
/// when unset), else `TINKER_API_KEY` as the tinker SDK reads it, else none
/// (a `temper api serve` started without `--api-key`).
fn remote_api_key(remote: &RemoteTrainerSection) -> Result<String> {
    match &remote.api_key_env {
        Some(var) => std::env::var(var).map_err(|_| {
            RlError::Config(format!(
                "remote_trainer.api_key_env names {var}, which is not set"
            ))
        }),
        None => Ok(std::env::var("TINKER_API_KEY").unwrap_or_default()),
    }
}
