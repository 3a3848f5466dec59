//! Checkpoints of a run (RL or SFT): trainer state under `checkpoints/`, and
//! `checkpoints/latest.json` naming the newest complete one with what a
//! resume needs beyond the weights. Written in an order such that a kill
//! at any point leaves `latest.json` naming a complete checkpoint.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use temper_engine::Trainer;

use crate::config::CkptSection;
use crate::error::{Result, RlError};
use crate::eval::EvalResult;
use crate::runlog::write_atomic;

/// `checkpoints/latest.json`: what a resume needs beyond the weights.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct LoopState {
    /// Steps completed.
    pub step: u64,
    /// The trainer's state path for them.
    pub state_path: String,
    /// Stale groups dropped so far.
    pub dropped_stale: u64,
    /// The run's seed.
    pub seed: u64,
    /// Held-out evaluation before training.
    pub eval_before: Option<EvalResult>,
}

/// `run_dir/checkpoints/latest.json`.
pub fn latest_path(run_dir: &Path) -> PathBuf {
    run_dir.join("checkpoints").join("latest.json")
}

/// Opens `run_dir` for a run of `kind` (`rl`, `distill`, `sft`, `dpo`): a
/// new run refuses a directory that already holds one (`resume` continues
/// it instead); the resolved config is written as `config.toml` and the
/// start recorded in `run.json`. Every trainer starts here.
pub fn open_run<C: Serialize>(
    run_dir: &Path,
    resume: bool,
    config: &C,
    kind: &str,
) -> Result<crate::runlog::RunRecord> {
    std::fs::create_dir_all(run_dir).map_err(|e| RlError::io(run_dir, e))?;
    if !resume && latest_path(run_dir).exists() {
        return Err(RlError::Config(format!(
            "{} already holds a run; pass --resume {0} to continue it, or choose another --log.dir",
            run_dir.display()
        )));
    }
    write_atomic(
        &run_dir.join("config.toml"),
        crate::config::to_toml(config)?.as_bytes(),
    )?;
    crate::runlog::RunRecord::start(run_dir, kind)
}

/// The loop state to start from: a fresh run's, or — with `resume` — the
/// latest checkpoint's, loaded into `trainer`.
pub async fn start_state(
    run_dir: &Path,
    trainer: &dyn Trainer,
    resume: bool,
    seed: u64,
) -> Result<LoopState> {
    let mut st = if resume {
        self::resume(run_dir, trainer).await?
    } else {
        LoopState::default()
    };
    st.seed = seed;
    Ok(st)
}

/// Load the latest checkpoint of `run_dir` into `trainer`; its loop state.
pub async fn resume(run_dir: &Path, trainer: &dyn Trainer) -> Result<LoopState> {
    let path = latest_path(run_dir);
    let text = std::fs::read_to_string(&path).map_err(|e| RlError::io(&path, e))?;
    let st: LoopState = serde_json::from_str(&text)
        .map_err(|e| RlError::Config(format!("{}: {e}", path.display())))?;
    trainer.load_state(&st.state_path, true).await?;
    tracing::info!(step = st.step, "resumed from {}", st.state_path);
    Ok(st)
}

/// Whether a checkpoint is due after `step` steps: every `ckpt.interval`
/// steps and after the last (`last_step`).
pub(crate) fn checkpoint_due(ckpt: &CkptSection, step: u64, last_step: u64) -> bool {
    (ckpt.interval > 0 && step.is_multiple_of(ckpt.interval)) || step == last_step
}

/// SFT's and DPO's checkpoints: a run's directory, trainer, `[ckpt]` and
/// seed, fixed for the run.
pub(crate) struct Saver<'a> {
    run_dir: &'a Path,
    trainer: &'a dyn Trainer,
    ckpt: &'a CkptSection,
    seed: u64,
}

impl<'a> Saver<'a> {
    pub(crate) fn new(
        run_dir: &'a Path,
        trainer: &'a dyn Trainer,
        ckpt: &'a CkptSection,
        seed: u64,
    ) -> Self {
        Self {
            run_dir,
            trainer,
            ckpt,
            seed,
        }
    }

    /// The checkpoint after `step` of `last_step` steps when one is due
    /// (see [`checkpoint_due`]): the state path, or `None`. Keeps
    /// `ckpt.keep` checkpoints, as RL does.
    pub(crate) async fn save_if_due(
        &self,
        step: u64,
        last_step: u64,
        eval_before: Option<EvalResult>,
    ) -> Result<Option<String>> {
        if !checkpoint_due(self.ckpt, step, last_step) {
            return Ok(None);
        }
        let st = LoopState {
            step,
            seed: self.seed,
            eval_before,
            ..LoopState::default()
        };
        save(self.run_dir, self.trainer, st, self.ckpt.keep)
            .await
            .map(Some)
    }
}

/// Save trainer state for `st.step`, then (atomically) point
/// `checkpoints/latest.json` at it, then delete checkpoints beyond `keep`.
/// Returns the state path.
pub async fn save(
    run_dir: &Path,
    trainer: &dyn Trainer,
    mut st: LoopState,
    keep: usize,
) -> Result<String> {
    let name = format!("step-{:06}", st.step);
    let path = trainer.save_state(&name).await?;
    st.state_path = path.clone();
    let text = serde_json::to_string_pretty(&st).map_err(|e| RlError::Config(e.to_string()))?;
    write_atomic(&latest_path(run_dir), text.as_bytes())?;
    // Prune older local state directories (siblings named step-N).
    let state = PathBuf::from(&path);
    if let Some(parent) = state.parent().filter(|p| p.is_dir()) {
        let mut old: Vec<PathBuf> = std::fs::read_dir(parent)
            .map_err(|e| RlError::io(parent, e))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| {
                p.file_name()
                    .and_then(|n| n.to_str())
                    .is_some_and(|n| n.starts_with("step-"))
            })
            .collect();
        old.sort();
        let keep = keep.max(1);
        if old.len() > keep {
            for p in &old[..old.len() - keep] {
                if *p != state {
                    let _ = std::fs::remove_dir_all(p);
                }
            }
        }
    }
    Ok(path)
}

/// Where the trained weights are once a trainer's loop ends (RL's and
/// SFT's one rule): with a training service (`remote`), its last checkpoint
/// path (the weights stay there); a run stopped before its last step, its
/// checkpoints directory (it resumes from there); else the weights
/// exported — the PEFT adapter at `run_dir/adapter` with LoRA, the whole
/// model in Hugging Face layout at `run_dir/model` with full fine-tuning
/// (what `temper serve`, vLLM and transformers load).
pub async fn final_output(
    trainer: &dyn Trainer,
    run_dir: &Path,
    remote: bool,
    lora: bool,
    finished: bool,
    last_ckpt: &str,
) -> Result<PathBuf> {
    if remote && !last_ckpt.is_empty() {
        Ok(PathBuf::from(last_ckpt))
    } else if remote || !finished {
        Ok(run_dir.join("checkpoints"))
    } else {
        export_weights(trainer, run_dir, lora).await
    }
}

/// Exports the trained weights into the run directory: the PEFT adapter
/// (`run_dir/adapter`) with LoRA, else the whole model in Hugging Face
/// layout (`run_dir/model`); answers the directory.
pub async fn export_weights(trainer: &dyn Trainer, run_dir: &Path, lora: bool) -> Result<PathBuf> {
    if lora {
        let d = run_dir.join("adapter");
        trainer.export_peft(&d).await?;
        Ok(d)
    } else {
        let d = run_dir.join("model");
        trainer.export_model(&d).await?;
        Ok(d)
    }
}
