//! The trainer a config asks for: the base model from `[model]`, trained
//! in process (LoRA or full) or through a remote training API.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use temper_engine::{Engine, LocalTrainer, Trainer};
use temper_model::{LoadOptions, LoraConfig, Pretrained, Target};

use crate::config::{LoraSection, ModelSection, RlConfig};
use crate::error::{Result, RlError};

/// Resolve `[model]` to a model directory, writing the preset if asked.
pub fn model_dir(m: &ModelSection, run_dir: &Path) -> Result<PathBuf> {
    match (&m.path, m.preset.as_deref()) {
        (Some(p), None) => Ok(p.clone()),
        (None, Some("tiny")) => {
            let dir = run_dir.join("base-model");
            if !dir.join("model.safetensors").exists() {
                m.tiny.write(&dir, 0)?;
            }
            Ok(dir)
        }
        (None, Some(other)) => Err(RlError::Config(format!(
            "unknown model preset {other:?} (known: \"tiny\")"
        ))),
        (Some(_), Some(_)) => Err(RlError::Config(
            "[model] has both `path` and `preset`; pick one".into(),
        )),
        (None, None) => Err(RlError::Config(
            "[model] needs `path` (a Hugging Face directory) or `preset = \"tiny\"`".into(),
        )),
    }
}

/// The LoRA config of `[lora]`.
pub fn lora_config(l: &LoraSection) -> Result<LoraConfig> {
    let targets = if l.targets.is_empty() {
        Target::ALL.to_vec()
    } else {
        l.targets
            .iter()
            .map(|t| {
                Target::from_name(t)
                    .ok_or_else(|| RlError::Config(format!("unknown LoRA target {t:?}")))
            })
            .collect::<Result<Vec<_>>>()?
    };
    if l.rank == 0 {
        return Err(RlError::Config("lora.rank must be >= 1".into()));
    }
    Ok(LoraConfig {
        rank: l.rank,
        alpha: l.alpha,
        targets,
        use_rslora: l.rslora,
    })
}

/// The in-process trainer for `[model]` + `[lora]`: the loaded base, and a
/// [`LocalTrainer`] whose checkpoints go under `run_dir/checkpoints`.
pub fn local_trainer(
    model: &ModelSection,
    lora: &LoraSection,
    seed: u64,
    run_dir: &Path,
) -> Result<(Arc<Pretrained>, Arc<LocalTrainer>)> {
    let dir = model_dir(model, run_dir)?;
    let base = Arc::new(Pretrained::load(&dir, &LoadOptions::default())?);
    let engine = Engine::new();
    engine.add_base_model("base", base.clone()).wait()?;
    let run = if let Some(adapter) = &model.adapter {
        if !lora.enabled {
            return Err(RlError::Config(
                "[model] adapter needs [lora] enabled = true (it continues a LoRA run)".into(),
            ));
        }
        tracing::info!(adapter = %adapter.display(), "continuing from a PEFT adapter (its rank/alpha/targets are used)");
        engine
            .create_lora_run_from_peft("base", adapter.clone())
            .wait()?
    } else if lora.enabled {
        engine
            .create_lora_run("base", lora_config(lora)?, seed)
            .wait()?
    } else {
        engine.create_full_run("base").wait()?
    };
    let trainer = LocalTrainer::new(engine, run, run_dir.join("checkpoints"));
    Ok((base, Arc::new(trainer)))
}

/// [`local_trainer`] on a blocking thread: loading reads and converts the
/// weights, and the engine's setup is waited on synchronously, neither of
/// which may stall the async runtime.
pub async fn local_trainer_off_runtime(
    model: ModelSection,
    lora: LoraSection,
    seed: u64,
    run_dir: &Path,
) -> Result<(Arc<Pretrained>, Arc<LocalTrainer>)> {
    let run_dir = run_dir.to_path_buf();
    off_runtime(move || local_trainer(&model, &lora, seed, &run_dir)).await
}

/// Run blocking `f` on tokio's blocking pool.
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

/// The trainer of `cfg` (in process, or `remote_trainer.url`) and the base
/// model it trains (for its tokenizer and chat template).
pub async fn trainer_for(
    cfg: &RlConfig,
    run_dir: &Path,
) -> Result<(Arc<Pretrained>, Arc<dyn Trainer>)> {
    let Some(url) = &cfg.remote_trainer.url else {
        let (base, local) =
            local_trainer_off_runtime(cfg.model.clone(), cfg.lora.clone(), cfg.seed, run_dir)
                .await?;
        return Ok((base, local));
    };
    if !cfg.lora.enabled || cfg.lora.alpha != 32.0 {
        return Err(RlError::Config(
            "a remote training API trains LoRA adapters with alpha 32: set lora.enabled = true, lora.alpha = 32".into(),
        ));
    }
    let dir = model_dir(&cfg.model, run_dir)?;
    let base =
        off_runtime(move || Ok(Arc::new(Pretrained::load(&dir, &LoadOptions::default())?))).await?;
    let key = cfg
        .remote_trainer
        .api_key_env
        .as_ref()
        .and_then(|v| std::env::var(v).ok())
        .unwrap_or_default();
    let remote = temper_client::RemoteTrainer::connect(
        url,
        &key,
        &cfg.remote_trainer.base_model,
        cfg.lora.rank,
        Some(cfg.seed),
    )
    .await
    .map_err(|e| RlError::Sampler(format!("training API {url}: {e}")))?;
    Ok((base, Arc::new(remote)))
}
