//! A training run: trainable weights (a LoRA adapter or the full model) on a
//! shared frozen base, accumulated gradients and AdamW state.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use temper_model::candle_core::{DType, Tensor, Var};
use temper_model::{
    Completion, GenerationRequest, LoraAdapter, LoraConfig, Model, Pretrained, Sampler,
    SamplingParams, ScoreInput,
};

use crate::error::{EngineError, Result};
use crate::loss::{Loss, LossInputs};
use crate::optim::{AdamParams, AdamState, StepStats};

/// One training example: the model input tokens and the loss inputs for
/// every input position (`target_tokens[i]` follows `model_input[..=i]`).
/// Shifting and masking are the caller's job, as in Tinker.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Datum {
    /// Tokens fed to the model.
    pub model_input: Vec<u32>,
    /// Targets, weights, sampler logprobs, advantages.
    pub loss_fn_inputs: LossInputs,
}

/// Per-datum outputs of a forward.
#[derive(Debug, Clone, PartialEq)]
pub struct DatumOutput {
    /// Learner logprob of each target token.
    pub logprobs: Vec<f32>,
    /// Entropy of the learner's distribution at each position.
    pub entropy: Vec<f32>,
}

/// What forward / forward_backward return.
#[derive(Debug, Clone, PartialEq)]
pub struct ForwardOutput {
    /// One entry per datum.
    pub loss_fn_outputs: Vec<DatumOutput>,
    /// `loss:sum` and friends.
    pub metrics: BTreeMap<String, f64>,
}

/// What is being trained.
enum Trainable {
    Lora(LoraAdapter),
    Full {
        model: Box<Model>,
        vars: Vec<(String, Var)>,
    },
}

/// How a run was created; saved with its state.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum RunKind {
    /// LoRA with this rank / alpha / targets.
    Lora {
        /// Rank.
        rank: usize,
        /// Alpha.
        alpha: f64,
        /// Target module names.
        targets: Vec<String>,
    },
    /// All weights trainable.
    Full,
}

/// A training run on a shared base model.
pub struct TrainingRun {
    base: Arc<Pretrained>,
    trainable: Trainable,
    grads: HashMap<String, Tensor>,
    optim: AdamState,
}

#[derive(Serialize, Deserialize)]
struct StateMeta {
    kind: RunKind,
    step: u64,
    base_model: String,
}

/// A checkpoint's `state.json`, and its path (for errors).
fn read_state_meta(dir: &Path) -> Result<(StateMeta, PathBuf)> {
    let meta_path = dir.join("state.json");
    let text = std::fs::read_to_string(&meta_path).map_err(|e| EngineError::io(&meta_path, e))?;
    let meta = serde_json::from_str(&text).map_err(|e| EngineError::BadCheckpoint {
        path: meta_path.clone(),
        reason: e.to_string(),
    })?;
    Ok((meta, meta_path))
}

/// Write the directory `dir` atomically: `fill` writes a temporary sibling
/// (`.{name}.tmp-{pid}`), which then replaces `dir` by rename; an existing
/// `dir` is moved aside first and removed after. A reader sees the old
/// directory or the new one, never a half-written one. `default_name` names
/// the temporaries when `dir` has no file name.
fn write_dir_atomically(
    dir: &Path,
    default_name: &str,
    fill: impl FnOnce(&Path) -> Result<()>,
) -> Result<()> {
    let parent = dir.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(parent).map_err(|e| EngineError::io(parent, e))?;
    let name = dir
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| default_name.into());
    let tmp = parent.join(format!(".{name}.tmp-{}", std::process::id()));
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp).map_err(|e| EngineError::io(&tmp, e))?;
    }
    std::fs::create_dir_all(&tmp).map_err(|e| EngineError::io(&tmp, e))?;
    fill(&tmp)?;
    let old = parent.join(format!(".{name}.old-{}", std::process::id()));
    if dir.exists() {
        std::fs::rename(dir, &old).map_err(|e| EngineError::io(dir, e))?;
    }
    std::fs::rename(&tmp, dir).map_err(|e| EngineError::io(dir, e))?;
    if old.exists() {
        std::fs::remove_dir_all(&old).map_err(|e| EngineError::io(&old, e))?;
    }
    Ok(())
}

impl TrainingRun {
    /// A LoRA run (A random with `seed`, B = 0).
    pub fn lora(base: Arc<Pretrained>, config: LoraConfig, seed: u64) -> Result<Self> {
        let adapter = LoraAdapter::new(
            &base.config,
            config,
            seed,
            base.model.dtype(),
            base.model.device(),
        )?;
        Ok(Self::with(base, Trainable::Lora(adapter)))
    }

    /// A LoRA run that continues from an existing adapter (e.g. a PEFT
    /// directory loaded with [`LoraAdapter::load_peft`]): its rank, alpha,
    /// targets and weights; fresh optimizer state.
    pub fn lora_from(base: Arc<Pretrained>, adapter: LoraAdapter) -> Self {
        Self::with(base, Trainable::Lora(adapter))
    }

    /// A full-parameter run (the base weights are copied, the shared base
    /// stays frozen).
    pub fn full(base: Arc<Pretrained>) -> Result<Self> {
        let mut model = base.model.clone();
        let vars = model.make_trainable()?;
        Ok(Self::with(
            base,
            Trainable::Full {
                model: Box::new(model),
                vars,
            },
        ))
    }

    fn with(base: Arc<Pretrained>, trainable: Trainable) -> Self {
        Self {
            base,
            trainable,
            grads: HashMap::new(),
            optim: AdamState::default(),
        }
    }

    /// The shared base.
    pub fn base(&self) -> &Arc<Pretrained> {
        &self.base
    }

    /// How this run trains.
    pub fn kind(&self) -> RunKind {
        match &self.trainable {
            Trainable::Lora(a) => RunKind::Lora {
                rank: a.config().rank,
                alpha: a.config().alpha,
                targets: a
                    .config()
                    .targets
                    .iter()
                    .map(|t| t.name().to_string())
                    .collect(),
            },
            Trainable::Full { .. } => RunKind::Full,
        }
    }

    /// Optimizer steps taken.
    pub fn step(&self) -> u64 {
        self.optim.step
    }

    fn model(&self) -> &Model {
        match &self.trainable {
            Trainable::Lora(_) => &self.base.model,
            Trainable::Full { model, .. } => model,
        }
    }

    fn adapter(&self) -> Option<&LoraAdapter> {
        match &self.trainable {
            Trainable::Lora(a) => Some(a),
            Trainable::Full { .. } => None,
        }
    }

    /// Trainable tensors by name.
    pub fn named_params(&self) -> Vec<(String, Var)> {
        match &self.trainable {
            Trainable::Lora(a) => a.named_vars(),
            Trainable::Full { vars, .. } => vars.clone(),
        }
    }

    fn validate(&self, data: &[Datum], loss: &Loss) -> Result<()> {
        if data.is_empty() {
            return Err(EngineError::InvalidRequest("empty batch".into()));
        }
        loss.validate_pairs(data.len())?;
        if loss.is_pair() {
            if let Some(i) = data
                .chunks(2)
                .position(|p| p[0].loss_fn_inputs.temperature != p[1].loss_fn_inputs.temperature)
            {
                return Err(EngineError::InvalidRequest(format!(
                    "datums {} and {}: a pair is scored at one temperature",
                    2 * i,
                    2 * i + 1
                )));
            }
        }
        let vocab = self.base.config.vocab_size;
        let max_len = self.base.config.max_position_embeddings;
        for (i, d) in data.iter().enumerate() {
            let len = d.model_input.len();
            if len == 0 {
                return Err(EngineError::InvalidRequest(format!(
                    "datum {i}: empty model_input"
                )));
            }
            if len > max_len {
                return Err(EngineError::InvalidRequest(format!(
                    "datum {i}: {len} tokens exceed the context length {max_len}"
                )));
            }
            let bad = d
                .model_input
                .iter()
                .chain(&d.loss_fn_inputs.target_tokens)
                .find(|&&t| t as usize >= vocab);
            if let Some(t) = bad {
                return Err(EngineError::InvalidRequest(format!(
                    "datum {i}: token id {t} out of range (vocab {vocab})"
                )));
            }
            loss.validate(&d.loss_fn_inputs, len)
                .map_err(|e| EngineError::InvalidRequest(format!("datum {i}: {e}")))?;
        }
        Ok(())
    }

    /// Loss and logprobs without touching gradients.
    pub fn forward(&self, data: &[Datum], loss: &Loss) -> Result<ForwardOutput> {
        self.validate(data, loss)?;
        let (out, _) = temper_model::in_pool(|| self.run(data, loss, |_| Ok(())))?;
        Ok(out)
    }

    /// Loss, logprobs, and gradients added to the accumulated ones (so
    /// several calls before one [`optim_step`](Self::optim_step) accumulate).
    ///
    /// The loss is a sum over datums, so each pack's backward runs right
    /// after its forward and its graph is dropped before the next pack:
    /// activation memory is one pack's (at most
    /// [`temper_model::PACK_TOKENS`] tokens, or one longer datum), not the
    /// batch's.
    pub fn forward_backward(&mut self, data: &[Datum], loss: &Loss) -> Result<ForwardOutput> {
        // On a worker of the kernels' pool (see `temper_model::in_pool`).
        temper_model::in_pool(|| self.forward_backward_in_pool(data, loss))
    }

    fn forward_backward_in_pool(&mut self, data: &[Datum], loss: &Loss) -> Result<ForwardOutput> {
        self.validate(data, loss)?;
        let named = self.named_params();
        let mut batch_grads: HashMap<String, Tensor> = HashMap::new();
        let (out, _) = self.run(data, loss, |l| {
            let grads = l.backward()?;
            for (name, var) in &named {
                if let Some(g) = grads.get(var.as_tensor()) {
                    let acc = match batch_grads.remove(name) {
                        Some(prev) => (prev + g)?,
                        None => g.clone(),
                    };
                    batch_grads.insert(name.clone(), acc);
                }
            }
            Ok(())
        })?;
        for (name, g) in batch_grads {
            let acc = match self.grads.remove(&name) {
                Some(prev) => (prev + g)?,
                None => g,
            };
            self.grads.insert(name, acc);
        }
        // The step's activations are freed; return them to the OS.
        temper_model::release_memory();
        Ok(out)
    }

    /// Score every datum and compute its loss; `each` sees the summed loss
    /// of every pack of datums (with its graph) before the graph is dropped.
    /// Consecutive datums with one scoring temperature are scored as one
    /// packed forward of up to [`temper_model::PACK_TOKENS`] rows
    /// ([`temper_model::Model::score_batch`]: the same logprobs as scoring
    /// each alone). Returns the outputs and the summed loss (detached).
    fn run(
        &self,
        data: &[Datum],
        loss: &Loss,
        mut each: impl FnMut(&Tensor) -> Result<()>,
    ) -> Result<(ForwardOutput, Tensor)> {
        let mut outputs = Vec::with_capacity(data.len());
        let mut total: Option<Tensor> = None;
        let mut tokens = 0usize;
        for pack in packs(data, loss.is_pair()) {
            let data = &data[pack];
            let inputs: Vec<ScoreInput<'_>> = data
                .iter()
                .map(|d| ScoreInput {
                    input: &d.model_input,
                    targets: &d.loss_fn_inputs.target_tokens,
                })
                .collect();
            let temperature = data[0].loss_fn_inputs.scoring_temperature();
            // A pair loss reads only its weighted positions: the LM head
            // runs on those rows alone (see `Loss::Dpo`; `validate` has
            // checked that its weights are there, one per position).
            let weighted: Vec<Vec<bool>> = if loss.is_pair() {
                data.iter()
                    .map(|d| {
                        let w = d.loss_fn_inputs.weights.as_deref().unwrap_or(&[]);
                        w.iter().map(|&x| x != 0.0).collect()
                    })
                    .collect()
            } else {
                Vec::new()
            };
            let needed: Vec<&[bool]> = weighted.iter().map(Vec::as_slice).collect();
            let scores = self.model().score_batch_where(
                &inputs,
                loss.is_pair().then_some(needed.as_slice()),
                self.adapter(),
                temperature,
            )?;
            let mut pack_loss: Option<Tensor> = None;
            let mut add = |l: Tensor| -> Result<()> {
                pack_loss = Some(match pack_loss.take() {
                    None => l,
                    Some(t) => (t + l)?,
                });
                Ok(())
            };
            if loss.is_pair() {
                // A pack holds whole pairs (see `packs`): chosen, rejected.
                for (d, s) in data.chunks(2).zip(scores.chunks(2)) {
                    if let ([c, r], [sc, sr]) = (d, s) {
                        add(loss.compute_pair(
                            &sc.logprobs,
                            &c.loss_fn_inputs,
                            &sr.logprobs,
                            &r.loss_fn_inputs,
                        )?)?;
                    }
                }
            } else {
                for (d, s) in data.iter().zip(&scores) {
                    add(loss.compute(&s.logprobs, &d.loss_fn_inputs)?)?;
                }
            }
            for (d, s) in data.iter().zip(&scores) {
                tokens += d.model_input.len();
                outputs.push(DatumOutput {
                    logprobs: s.logprobs.to_dtype(DType::F32)?.to_vec1()?,
                    entropy: s.entropy.to_dtype(DType::F32)?.to_vec1()?,
                });
            }
            let l = pack_loss.ok_or_else(|| EngineError::InvalidRequest("empty pack".into()))?;
            each(&l)?;
            let l = l.detach();
            total = Some(match total {
                None => l,
                Some(t) => (t + l)?,
            });
        }
        let total = total.ok_or_else(|| EngineError::InvalidRequest("empty batch".into()))?;
        let mut metrics = BTreeMap::new();
        metrics.insert(
            "loss:sum".to_string(),
            total.to_dtype(DType::F64)?.to_scalar::<f64>()?,
        );
        metrics.insert("tokens:sum".to_string(), tokens as f64);
        Ok((
            ForwardOutput {
                loss_fn_outputs: outputs,
                metrics,
            },
            total,
        ))
    }

    /// Gradients accumulated by [`forward_backward`](Self::forward_backward)
    /// since the last [`optim_step`](Self::optim_step), by parameter name
    /// (the names of [`named_params`](Self::named_params)).
    pub fn accumulated_grads(&self) -> &HashMap<String, Tensor> {
        &self.grads
    }

    /// Apply the accumulated gradients with AdamW and clear them.
    pub fn optim_step(&mut self, params: &AdamParams) -> Result<StepStats> {
        if self.grads.is_empty() {
            return Err(EngineError::InvalidRequest(
                "optim_step without a forward_backward since the last step".into(),
            ));
        }
        let named = self.named_params();
        // Cleared on failure too: a non-finite step is skipped, not retried.
        let stats = self.optim.step(&named, &self.grads, params);
        self.grads.clear();
        stats
    }

    /// Sample from the current weights.
    pub fn sample(
        &self,
        prompt: &[u32],
        n: usize,
        params: SamplingParams,
    ) -> Result<Vec<Completion>> {
        sample_with(&self.base, self.model(), self.adapter(), prompt, n, params)
    }

    /// Learner logprobs of `tokens[1..]` (the first token has none) under
    /// `softmax(logits / temperature)`; `temperature` 0 (greedy) scores at 1,
    /// as the sampler reports greedy logprobs.
    pub fn compute_logprobs(&self, tokens: &[u32], temperature: f64) -> Result<Vec<f32>> {
        logprobs_with(self.model(), self.adapter(), tokens, temperature)
    }

    /// An immutable copy of the current weights for a sampler.
    pub fn sampler_weights(&self) -> Result<SamplerWeights> {
        Ok(match &self.trainable {
            Trainable::Lora(a) => SamplerWeights {
                base: self.base.clone(),
                full: None,
                adapter: Some(a.snapshot()?),
            },
            Trainable::Full { model, .. } => SamplerWeights {
                base: self.base.clone(),
                full: Some(Box::new(model.frozen_copy()?)),
                adapter: None,
            },
        })
    }

    /// Save the current full weights as a Hugging Face model directory
    /// (`model.safetensors` plus the base's config, tokenizer and template
    /// files), written to a temporary sibling and renamed into place. A LoRA
    /// run saves the base with its adapter merged.
    pub fn export_model(&self, dir: &Path) -> Result<()> {
        let merged;
        let model = match &self.trainable {
            Trainable::Lora(a) => {
                merged = self.base.model.merge_lora(a)?;
                &merged
            }
            Trainable::Full { model, .. } => model.as_ref(),
        };
        write_dir_atomically(dir, "model", |tmp| {
            let weights: HashMap<String, Tensor> = model.named_weights()?.into_iter().collect();
            temper_model::candle_core::safetensors::save(&weights, tmp.join("model.safetensors"))?;
            for f in [
                "config.json",
                "tokenizer.json",
                "tokenizer_config.json",
                "chat_template.jinja",
                "generation_config.json",
                "special_tokens_map.json",
            ] {
                let src = self.base.dir.join(f);
                if src.exists() {
                    std::fs::copy(&src, tmp.join(f)).map_err(|e| EngineError::io(&src, e))?;
                }
            }
            Ok(())
        })
    }

    /// Export the LoRA adapter in the PEFT layout.
    pub fn export_peft(&self, dir: &Path) -> Result<()> {
        match &self.trainable {
            Trainable::Lora(a) => Ok(a.save_peft(dir, &self.base.dir.display().to_string())?),
            Trainable::Full { .. } => Err(EngineError::InvalidRequest(
                "a full-parameter run has no LoRA adapter to export".into(),
            )),
        }
    }

    /// Save weights, optimizer state and step into `dir`, atomically: a
    /// temporary sibling directory is written, then renamed over `dir`.
    pub fn save_state(&self, dir: &Path) -> Result<()> {
        write_dir_atomically(dir, "state", |tmp| {
            let weights: HashMap<String, Tensor> = self
                .named_params()
                .into_iter()
                .map(|(n, v)| (n, v.as_tensor().clone()))
                .collect();
            temper_model::candle_core::safetensors::save(
                &weights,
                tmp.join("weights.safetensors"),
            )?;
            let mut opt: HashMap<String, Tensor> = HashMap::new();
            for (n, t) in &self.optim.m {
                opt.insert(format!("m.{n}"), t.clone());
            }
            for (n, t) in &self.optim.v {
                opt.insert(format!("v.{n}"), t.clone());
            }
            if !opt.is_empty() {
                temper_model::candle_core::safetensors::save(
                    &opt,
                    tmp.join("optimizer.safetensors"),
                )?;
            }
            let meta = StateMeta {
                kind: self.kind(),
                step: self.optim.step,
                base_model: self.base.dir.display().to_string(),
            };
            let meta_path = tmp.join("state.json");
            let text =
                serde_json::to_string_pretty(&meta).map_err(|e| EngineError::BadCheckpoint {
                    path: meta_path.clone(),
                    reason: e.to_string(),
                })?;
            std::fs::write(&meta_path, text).map_err(|e| EngineError::io(&meta_path, e))?;
            Ok(())
        })
    }

    /// What a checkpoint written by [`save_state`](Self::save_state) holds:
    /// its run kind and the base model directory it was trained on — enough
    /// to recreate a matching run in a process that never saw the original.
    pub fn checkpoint_kind(dir: &Path) -> Result<(RunKind, String)> {
        let (meta, _) = read_state_meta(dir)?;
        Ok((meta.kind, meta.base_model))
    }

    /// Restore weights (and, with `with_optimizer`, AdamW state and step)
    /// saved by [`save_state`](Self::save_state) into this run, which must
    /// have the same kind and shapes.
    pub fn load_state(&mut self, dir: &Path, with_optimizer: bool) -> Result<()> {
        let (meta, meta_path) = read_state_meta(dir)?;
        if meta.kind != self.kind() {
            return Err(EngineError::BadCheckpoint {
                path: meta_path,
                reason: format!(
                    "saved run is {:?}, this run is {:?}",
                    meta.kind,
                    self.kind()
                ),
            });
        }
        let dev = self.base.model.device().clone();
        let wpath = dir.join("weights.safetensors");
        let weights = temper_model::candle_core::safetensors::load(&wpath, &dev)?;
        for (name, var) in self.named_params() {
            let t = weights
                .get(&name)
                .ok_or_else(|| EngineError::BadCheckpoint {
                    path: wpath.clone(),
                    reason: format!("missing tensor {name}"),
                })?;
            if t.dims() != var.as_tensor().dims() {
                return Err(EngineError::BadCheckpoint {
                    path: wpath.clone(),
                    reason: format!(
                        "tensor {name} has shape {:?}, run has {:?}",
                        t.dims(),
                        var.as_tensor().dims()
                    ),
                });
            }
            var.set(&t.to_dtype(var.as_tensor().dtype())?)?;
        }
        self.grads.clear();
        if with_optimizer {
            let mut state = AdamState {
                step: meta.step,
                ..Default::default()
            };
            let opath = dir.join("optimizer.safetensors");
            if opath.exists() {
                for (k, t) in temper_model::candle_core::safetensors::load(&opath, &dev)? {
                    if let Some(n) = k.strip_prefix("m.") {
                        state.m.insert(n.to_string(), t);
                    } else if let Some(n) = k.strip_prefix("v.") {
                        state.v.insert(n.to_string(), t);
                    }
                }
            }
            self.optim = state;
        } else {
            self.optim = AdamState::default();
        }
        Ok(())
    }
}

/// Frozen weights a sampler can use while training goes on.
pub struct SamplerWeights {
    base: Arc<Pretrained>,
    full: Option<Box<Model>>,
    adapter: Option<LoraAdapter>,
}

impl SamplerWeights {
    /// The base model itself, with no adapter.
    pub fn of_base(base: Arc<Pretrained>) -> Self {
        Self {
            base,
            full: None,
            adapter: None,
        }
    }

    /// Sample `n` completions of `prompt`.
    pub fn sample(
        &self,
        prompt: &[u32],
        n: usize,
        params: SamplingParams,
    ) -> Result<Vec<Completion>> {
        let model = self.full.as_deref().unwrap_or(&self.base.model);
        sample_with(&self.base, model, self.adapter.as_ref(), prompt, n, params)
    }

    /// Generate for several prompts in one batch (prefills together, decode
    /// steps shared); one list of completions per request, in order.
    pub fn generate(&self, requests: &[GenerationRequest]) -> Result<Vec<Vec<Completion>>> {
        let model = self.full.as_deref().unwrap_or(&self.base.model);
        let sampler = Sampler::new(
            model,
            &self.base.tokenizer,
            self.base.generation.eos_token_ids.clone(),
        );
        Ok(sampler.generate(requests, self.adapter.as_ref())?)
    }

    /// The base model these weights belong to.
    pub fn base(&self) -> &Arc<Pretrained> {
        &self.base
    }

    /// Logprobs of `tokens[1..]` under these weights at `temperature` (see
    /// [`TrainingRun::compute_logprobs`]).
    pub fn compute_logprobs(&self, tokens: &[u32], temperature: f64) -> Result<Vec<f32>> {
        let model = self.full.as_deref().unwrap_or(&self.base.model);
        logprobs_with(model, self.adapter.as_ref(), tokens, temperature)
    }
}

/// Logprobs of `tokens[1..]` by the canonical training forward.
fn logprobs_with(
    model: &Model,
    adapter: Option<&LoraAdapter>,
    tokens: &[u32],
    temperature: f64,
) -> Result<Vec<f32>> {
    if tokens.len() < 2 {
        return Err(EngineError::InvalidRequest(
            "compute_logprobs needs at least 2 tokens".into(),
        ));
    }
    if !(temperature >= 0.0 && temperature.is_finite()) {
        return Err(EngineError::InvalidRequest(format!(
            "compute_logprobs: temperature must be >= 0, got {temperature}"
        )));
    }
    // The sampler reports greedy (T = 0) logprobs at T = 1; match it.
    let t = temper_model::decode::scoring_temperature(temperature);
    let s = model.score(&tokens[..tokens.len() - 1], &tokens[1..], adapter, t)?;
    Ok(s.logprobs.to_vec1()?)
}

fn sample_with(
    base: &Pretrained,
    model: &Model,
    adapter: Option<&LoraAdapter>,
    prompt: &[u32],
    n: usize,
    params: SamplingParams,
) -> Result<Vec<Completion>> {
    let sampler = Sampler::new(
        model,
        &base.tokenizer,
        base.generation.eos_token_ids.clone(),
    );
    let mut out = sampler.generate(
        &[GenerationRequest {
            prompt: prompt.to_vec(),
            n,
            params,
        }],
        adapter,
    )?;
    out.pop()
        .ok_or_else(|| EngineError::InvalidRequest("no completions".into()))
}

/// Consecutive datums that share a scoring temperature, in packs of at most
/// [`temper_model::PACK_TOKENS`] rows beside their longest shared prefix
/// (see [`temper_model::pack_batch`]: a prefix that consecutive datums
/// share, such as an RL group's prompt, runs once). With `pairs`, a pack
/// ends only after a pair's second datum (it may then run one sequence over
/// the budget; `validate` has checked that a pair shares a temperature).
fn packs(data: &[Datum], pairs: bool) -> Vec<std::ops::Range<usize>> {
    let mut out: Vec<std::ops::Range<usize>> = Vec::new();
    let mut start = 0;
    while start < data.len() {
        let t = data[start].loss_fn_inputs.scoring_temperature();
        let end = start
            + data[start..]
                .iter()
                .take_while(|d| d.loss_fn_inputs.scoring_temperature() == t)
                .count();
        let inputs: Vec<ScoreInput<'_>> = data[start..end]
            .iter()
            .map(|d| ScoreInput {
                input: &d.model_input,
                targets: &d.loss_fn_inputs.target_tokens,
            })
            .collect();
        for r in temper_model::pack_batch(&inputs, temper_model::PACK_TOKENS) {
            let (mut a, mut b) = (start + r.start, start + r.end);
            if pairs {
                // Round both ends up to a pair boundary (`start` is one).
                a += a % 2;
                b = (b + b % 2).min(end);
            }
            if a < b {
                out.push(a..b);
            }
        }
        start = end;
    }
    out
}
