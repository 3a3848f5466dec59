//! `temper quickstart`: the whole loop on a model built from nothing, on a
//! laptop CPU, with no downloads.
//!
//! 1. Write a tiny random-initialised model with a character tokenizer and a
//!    ChatML template ([`crate::preset`]).
//! 2. SFT-warm it (all weights) on the built-in `arithmetic` environment's
//!    training rows, answers in `<answer>` tags, for a short budget — from a
//!    simulated imperfect teacher whose answers carry a systematic mistake
//!    (one too many) a set fraction of the time, as distilled traces do.
//! 3. Evaluate it on the held-out split (greedy).
//! 4. Train a LoRA adapter on it by async RL against the same environment's
//!    reward.
//! 5. Evaluate again and print both accuracies — measured, not asserted.

use std::path::{Path, PathBuf};
use std::time::Instant;

use serde_json::json;

use crate::config::{
    AsyncSection, CkptSection, DataSection, EnvSection, EvalSection, LogSection, LoraSection,
    ModelSection, RlConfig, RlTrainerSection, SamplingSection, SftConfig, SftTrainerSection,
};
use crate::error::Result;
use crate::preset::TinyPreset;
use crate::rl::{run_rl, EvalResult, RunOptions};
use crate::sft::run_sft;

/// Knobs of the quickstart (the defaults are the README's run).
#[derive(Debug, Clone)]
pub struct QuickstartOptions {
    /// Where everything goes.
    pub dir: PathBuf,
    /// SFT warm-up steps.
    pub sft_steps: u64,
    /// RL steps.
    pub rl_steps: u64,
    /// Held-out examples per evaluation.
    pub eval_examples: usize,
    /// Operand digits of the arithmetic task.
    pub digits: u32,
    /// Fraction of SFT answers that are near misses (an imperfect teacher).
    pub teacher_noise: f64,
    /// Seed.
    pub seed: u64,
    /// Progress lines on stderr.
    pub progress: bool,
    /// The RL run's numerics (the CLI's `--dtype` and `TEMPER_MATMUL`); the
    /// SFT warm-up trains every weight, in f32 whatever the precision says.
    pub numerics: temper_model::Numerics,
}

impl Default for QuickstartOptions {
    fn default() -> Self {
        Self {
            dir: PathBuf::from("runs/quickstart"),
            sft_steps: 250,
            rl_steps: 60,
            eval_examples: 100,
            digits: 1,
            teacher_noise: 0.75,
            seed: 0,
            progress: true,
            numerics: temper_model::Numerics::default(),
        }
    }
}

/// What the quickstart measured.
#[derive(Debug, Clone)]
pub struct QuickstartReport {
    /// Held-out pass@1 of the SFT model.
    pub before: EvalResult,
    /// Held-out pass@1 after RL.
    pub after: EvalResult,
    /// The SFT model directory.
    pub sft_model: PathBuf,
    /// The RL run directory (adapter/, metrics.jsonl, plots.html).
    pub rl_dir: PathBuf,
    /// Seconds for SFT, RL (with its evaluations) and in total.
    pub seconds: (f64, f64, f64),
}

fn env_args(digits: u32) -> serde_json::Value {
    json!({"digits": digits, "ops": ["+"], "system_prompt": ""})
}

/// The SFT warm-up config.
pub fn sft_config(o: &QuickstartOptions) -> SftConfig {
    SftConfig {
        seed: o.seed,
        model: ModelSection {
            path: None,
            preset: Some("tiny".into()),
            tiny: TinyPreset::default(),
            adapter: None,
            // Full-parameter SFT keeps f32 weights whatever `--dtype` says.
            dtype: Some("f32".into()),
            matmul: Some(o.numerics.matmul.as_str().into()),
        },
        lora: LoraSection {
            enabled: false,
            ..Default::default()
        },
        data: DataSection {
            path: None,
            env: Some(EnvSection {
                id: "arithmetic".into(),
                weight: 1.0,
                args: env_args(o.digits),
                package: None,
            }),
            answer_format: Some("<answer>{answer}</answer>".into()),
            teacher_noise: o.teacher_noise,
            epochs: None,
        },
        trainer: SftTrainerSection {
            lr: 3e-3,
            warmup_steps: 10,
            batch_size: 32,
            max_steps: o.sft_steps,
            max_seq_len: 256,
            ..Default::default()
        },
        // The RL run evaluates the SFT model (its step 0).
        eval: EvalSection {
            num_examples: 0,
            ..EvalSection::default()
        },
        ckpt: CkptSection {
            interval: 0,
            keep: 1,
        },
        log: LogSection {
            dir: o.dir.join("sft"),
            progress: o.progress,
            samples: 0,
            tensorboard: false,
        },
        remote_trainer: Default::default(),
    }
}

/// The RL config, on the SFT model in `sft_model`.
pub fn rl_config(o: &QuickstartOptions, sft_model: &Path) -> RlConfig {
    RlConfig {
        seed: o.seed,
        model: ModelSection {
            path: Some(sft_model.to_path_buf()),
            preset: None,
            tiny: TinyPreset::default(),
            adapter: None,
            dtype: Some(o.numerics.precision.to_string()),
            matmul: Some(o.numerics.matmul.as_str().into()),
        },
        lora: LoraSection {
            enabled: true,
            rank: 16,
            alpha: temper_model::LoraConfig::DEFAULT_ALPHA,
            ..Default::default()
        },
        env: vec![EnvSection {
            id: "arithmetic".into(),
            weight: 1.0,
            args: env_args(o.digits),
            package: None,
        }],
        sampling: SamplingSection {
            temperature: 1.0,
            top_p: 1.0,
            max_tokens: 24,
            group_size: 8,
            ..SamplingSection::default()
        },
        trainer: RlTrainerSection {
            loss: temper_engine::Loss::ImportanceSampling.name().into(),
            lr: 2e-3,
            warmup_steps: 0,
            batch_size: 16,
            max_steps: o.rl_steps,
            ..Default::default()
        },
        async_: AsyncSection {
            max_off_policy_steps: 1,
            enabled: true,
        },
        eval: EvalSection {
            env: None,
            args: None,
            interval: 20,
            num_examples: o.eval_examples,
            temperature: 0.0,
            pass_threshold: None,
        },
        ckpt: CkptSection {
            interval: 10,
            keep: 2,
        },
        log: LogSection {
            dir: o.dir.join("rl"),
            progress: o.progress,
            ..Default::default()
        },
        sampler: Default::default(),
        remote_trainer: Default::default(),
        distill: Default::default(),
        alerts: Default::default(),
    }
}

/// Run the quickstart. An existing `dir` is replaced.
pub async fn quickstart(o: &QuickstartOptions) -> Result<QuickstartReport> {
    let t0 = Instant::now();
    if o.dir.exists() {
        std::fs::remove_dir_all(&o.dir).map_err(|e| crate::RlError::io(&o.dir, e))?;
    }
    let say = |s: String| {
        if o.progress {
            eprintln!("{s}");
        }
    };
    say(format!(
        "== 1/2 SFT warm-up: a {}-parameter tiny model from random init, {} steps on `arithmetic` ({}-digit addition), \
         imitating a simulated teacher whose answers are one too many {:.0}% of the time",
        TinyPreset::default().parameter_count(),
        o.sft_steps,
        o.digits,
        100.0 * o.teacher_noise
    ));
    let sft = run_sft(sft_config(o), RunOptions::default()).await?;
    let t_sft = t0.elapsed().as_secs_f64();
    say(format!(
        "== 2/2 async RL against the environment's verifier (LoRA r=16, group-relative advantages, max 1 step off-policy), {} steps",
        o.rl_steps
    ));
    let t1 = Instant::now();
    let rl = run_rl(rl_config(o, &sft.output), RunOptions::default()).await?;
    let t_rl = t1.elapsed().as_secs_f64();
    let missing = || crate::RlError::Env("the RL run recorded no evaluation".into());
    let before = rl.eval_before.clone().ok_or_else(missing)?;
    let after = rl.eval_after.clone().ok_or_else(missing)?;
    Ok(QuickstartReport {
        before,
        after,
        sft_model: sft.output,
        rl_dir: rl.run_dir,
        seconds: (t_sft, t_rl, t0.elapsed().as_secs_f64()),
    })
}
