//! [`Trainer`]: the training primitives of one training run as a trait, so a
//! training loop (the RL orchestrator, a user's script) runs unchanged
//! against the in-process engine ([`LocalTrainer`]) or a remote training API
//! (`temper_client::RemoteTrainer`, which speaks the tinker wire protocol).
//!
//! Calls are submitted in the order they are made and complete in that
//! order, so `forward_backward` and `optim_step` can be issued back to back
//! and awaited later.

use std::future::Future;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};

use temper_model::{Completion, FinishReason, GenerationRequest, SamplingParams};

use crate::engine::Engine;
use crate::error::{EngineError, Result};
use crate::loss::Loss;
use crate::optim::{AdamParams, StepStats};
use crate::run::{Datum, ForwardOutput};

/// A boxed, sendable future of a trainer call.
pub type TrainerFuture<T> = Pin<Box<dyn Future<Output = Result<T>> + Send + 'static>>;

/// One sampled sequence.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    /// Generated token ids.
    pub tokens: Vec<u32>,
    /// Logprob of each generated token.
    pub logprobs: Vec<f32>,
    /// Why it ended.
    pub finish_reason: FinishReason,
}

impl From<Completion> for Sample {
    fn from(c: Completion) -> Self {
        Sample {
            logprobs: c.logprobs.unwrap_or_default(),
            tokens: c.tokens,
            finish_reason: c.finish_reason,
        }
    }
}

/// The training primitives of one run (LoRA on a base model).
pub trait Trainer: Send + Sync {
    /// Loss and per-token outputs, no gradients.
    fn forward(&self, data: Vec<Datum>, loss: Loss) -> TrainerFuture<ForwardOutput>;
    /// Loss, outputs, and gradients accumulated for the next optim_step.
    fn forward_backward(&self, data: Vec<Datum>, loss: Loss) -> TrainerFuture<ForwardOutput>;
    /// One AdamW step with the accumulated gradients.
    fn optim_step(&self, params: AdamParams) -> TrainerFuture<StepStats>;
    /// Freeze the current weights for sampling; resolves to a sampler handle.
    fn save_weights_for_sampler(&self, name: &str) -> TrainerFuture<String>;
    /// Sample `n` continuations of `prompt` from a sampler handle.
    fn sample(
        &self,
        sampler: &str,
        prompt: Vec<u32>,
        n: usize,
        params: SamplingParams,
    ) -> TrainerFuture<Vec<Sample>>;
    /// Sample several prompts at once (one list of samples per request, in
    /// order). The default issues one [`sample`](Trainer::sample) per request;
    /// the in-process engine batches them into shared decode steps.
    fn sample_many(
        &self,
        sampler: &str,
        requests: Vec<GenerationRequest>,
    ) -> TrainerFuture<Vec<Vec<Sample>>> {
        let futures: Vec<_> = requests
            .into_iter()
            .map(|r| self.sample(sampler, r.prompt, r.n, r.params))
            .collect();
        Box::pin(async move {
            let mut out = Vec::with_capacity(futures.len());
            for f in futures {
                out.push(f.await?);
            }
            Ok(out)
        })
    }
    /// Logprobs of `tokens[1..]` under a sampler handle's weights, of
    /// `softmax(logits / temperature)` (what the sampler reports for tokens
    /// drawn at that temperature; 0 scores at 1, like greedy sampling).
    fn compute_logprobs(
        &self,
        sampler: &str,
        tokens: Vec<u32>,
        temperature: f64,
    ) -> TrainerFuture<Vec<f32>>;
    /// Free the weights behind a sampler handle nobody will sample from
    /// again (a long RL run publishes one per step). The default keeps them.
    fn release_sampler(&self, _sampler: &str) -> TrainerFuture<()> {
        Box::pin(async { Ok(()) })
    }
    /// Write the trained LoRA adapter in the PEFT layout into `dir` (what an
    /// external sampler such as `temper serve` or vLLM loads). Trainers that
    /// keep weights remotely do not support it.
    fn export_peft(&self, dir: &Path) -> TrainerFuture<()> {
        let dir = dir.display().to_string();
        Box::pin(async move {
            Err(EngineError::InvalidRequest(format!(
                "this trainer cannot export an adapter to {dir}"
            )))
        })
    }
    /// Write the fully trained model (a full fine-tuning run's weights) as
    /// a Hugging Face directory `dir`. Trainers that keep weights remotely
    /// do not support it.
    fn export_model(&self, dir: &Path) -> TrainerFuture<()> {
        let dir = dir.display().to_string();
        Box::pin(async move {
            Err(EngineError::InvalidRequest(format!(
                "this trainer cannot export a model to {dir}"
            )))
        })
    }
    /// Whether `forward`/`forward_backward` compute a pair loss
    /// ([`Loss::Dpo`]) with every pair in one call. The in-process engine
    /// does; the tinker wire has no pair loss, so a remote trainer does not,
    /// and a DPO loop then trains with a forward plus a weighted
    /// cross-entropy `forward_backward` instead.
    fn takes_pair_loss(&self) -> bool {
        false
    }
    /// Save weights + optimizer state; resolves to the checkpoint's path.
    fn save_state(&self, name: &str) -> TrainerFuture<String>;
    /// Restore a checkpoint saved by [`save_state`](Trainer::save_state).
    fn load_state(&self, path: &str, with_optimizer: bool) -> TrainerFuture<()>;
}

/// A [`Trainer`] over an in-process [`Engine`] run.
pub struct LocalTrainer {
    engine: Engine,
    run: String,
    checkpoint_dir: PathBuf,
    samplers: AtomicU64,
}

impl LocalTrainer {
    /// Wrap run `run` of `engine`; `save_state` writes under `checkpoint_dir`.
    pub fn new(engine: Engine, run: String, checkpoint_dir: PathBuf) -> Self {
        Self {
            engine,
            run,
            checkpoint_dir,
            samplers: AtomicU64::new(0),
        }
    }

    fn checkpoint(&self, name: &str) -> Result<PathBuf> {
        if name.is_empty() || name.contains('/') || name == "." || name == ".." {
            return Err(EngineError::InvalidRequest(format!(
                "invalid checkpoint name {name:?}"
            )));
        }
        Ok(self.checkpoint_dir.join(&self.run).join(name))
    }

    /// The engine behind this trainer.
    pub fn engine(&self) -> &Engine {
        &self.engine
    }

    /// The engine run this trainer drives.
    pub fn run_id(&self) -> &str {
        &self.run
    }
}

impl Trainer for LocalTrainer {
    fn forward(&self, data: Vec<Datum>, loss: Loss) -> TrainerFuture<ForwardOutput> {
        Box::pin(self.engine.forward(&self.run, data, loss))
    }

    fn forward_backward(&self, data: Vec<Datum>, loss: Loss) -> TrainerFuture<ForwardOutput> {
        Box::pin(self.engine.forward_backward(&self.run, data, loss))
    }

    fn optim_step(&self, params: AdamParams) -> TrainerFuture<StepStats> {
        Box::pin(self.engine.optim_step(&self.run, params))
    }

    fn takes_pair_loss(&self) -> bool {
        true
    }

    fn save_weights_for_sampler(&self, name: &str) -> TrainerFuture<String> {
        let n = self.samplers.fetch_add(1, Ordering::Relaxed);
        let key = format!("{}/sampler_weights/{name}#{n}", self.run);
        let pending = self.engine.save_weights_for_sampler(&self.run, &key);
        Box::pin(async move {
            pending.await?;
            Ok(key)
        })
    }

    fn sample(
        &self,
        sampler: &str,
        prompt: Vec<u32>,
        n: usize,
        params: SamplingParams,
    ) -> TrainerFuture<Vec<Sample>> {
        let pending = self.engine.sample(sampler, prompt, n, params);
        Box::pin(async move { Ok(pending.await?.into_iter().map(Sample::from).collect()) })
    }

    fn sample_many(
        &self,
        sampler: &str,
        requests: Vec<GenerationRequest>,
    ) -> TrainerFuture<Vec<Vec<Sample>>> {
        let pending = self.engine.generate(sampler, requests);
        Box::pin(async move {
            Ok(pending
                .await?
                .into_iter()
                .map(|cs| cs.into_iter().map(Sample::from).collect())
                .collect())
        })
    }

    fn compute_logprobs(
        &self,
        sampler: &str,
        tokens: Vec<u32>,
        temperature: f64,
    ) -> TrainerFuture<Vec<f32>> {
        Box::pin(self.engine.compute_logprobs(sampler, tokens, temperature))
    }

    fn export_peft(&self, dir: &Path) -> TrainerFuture<()> {
        Box::pin(self.engine.export_peft(&self.run, dir.to_path_buf()))
    }

    fn release_sampler(&self, sampler: &str) -> TrainerFuture<()> {
        Box::pin(self.engine.drop_sampler(sampler))
    }

    fn export_model(&self, dir: &Path) -> TrainerFuture<()> {
        Box::pin(self.engine.export_model(&self.run, dir.to_path_buf()))
    }

    fn save_state(&self, name: &str) -> TrainerFuture<String> {
        match self.checkpoint(name) {
            Err(e) => Box::pin(async move { Err(e) }),
            Ok(dir) => {
                let pending = self.engine.save_state(&self.run, dir.clone());
                Box::pin(async move {
                    pending.await?;
                    Ok(dir.display().to_string())
                })
            }
        }
    }

    fn load_state(&self, path: &str, with_optimizer: bool) -> TrainerFuture<()> {
        Box::pin(
            self.engine
                .load_state(&self.run, PathBuf::from(path), with_optimizer),
        )
    }
}
