//! Training primitives on one base model — Tinker's slice of the problem,
//! in process: [`TrainingRun::forward_backward`] with a token-level [`Loss`],
//! [`TrainingRun::optim_step`] (AdamW), [`TrainingRun::sample`],
//! [`TrainingRun::compute_logprobs`], [`TrainingRun::save_state`] /
//! [`TrainingRun::load_state`], and immutable [`SamplerWeights`].
//! [`Engine`] puts runs behind an ordered queue: every call returns a
//! [`Pending`] future at once, so calls pipeline and complete in order.
//!
//! Key design choice: the learner's logprobs come from
//! [`temper_model::Model::score`], the same canonical computation the sampler
//! reports, so on-policy importance ratios are exactly 1 — no train–inference
//! mismatch to correct for.
//!
//! ```
//! use std::sync::Arc;
//! use temper_engine::{AdamParams, Datum, Loss, LossInputs, TrainingRun};
//! use temper_model::{LoadOptions, LoraConfig, Pretrained};
//! # let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/models/tiny-qwen3");
//! let base = Arc::new(Pretrained::load(&dir, &LoadOptions::default())?);
//! let mut run = TrainingRun::lora(base, LoraConfig { rank: 4, ..Default::default() }, 0)?;
//! let datum = Datum {
//!     model_input: vec![10, 20, 30],
//!     loss_fn_inputs: LossInputs { target_tokens: vec![20, 30, 40], ..Default::default() },
//! };
//! let out = run.forward_backward(&[datum], &Loss::CrossEntropy)?;
//! assert_eq!(out.loss_fn_outputs[0].logprobs.len(), 3);
//! run.optim_step(&AdamParams { learning_rate: 1e-3, ..Default::default() })?;
//! assert_eq!(run.step(), 1);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
#![deny(missing_docs)]

mod engine;
mod error;
mod loss;
mod optim;
mod run;
mod trainer;

#[cfg(feature = "fault-hooks")]
pub use engine::fault;
pub use engine::{Engine, Pending};
pub use error::{EngineError, Result};
pub use loss::{
    CustomLoss, Loss, LossInputs, PairLoss, DEFAULT_CLIP_HIGH, DEFAULT_CLIP_LOW, DEFAULT_DRO_BETA,
};
pub use optim::{AdamParams, AdamState, StepStats};
pub use run::{Datum, DatumOutput, ForwardOutput, RunKind, SamplerWeights, TrainingRun};
pub use trainer::{LocalTrainer, Sample, Trainer, TrainerFuture};
