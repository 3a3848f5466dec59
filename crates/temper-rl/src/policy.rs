//! Policies as [`ChatModel`]s, so environments roll out against the model
//! being trained through the same seam they use for any endpoint.
//!
//! Both implementations render the conversation with the model's own chat
//! template and tokenizer here, in the trainer's process, and sample from
//! token ids: the ids that are trained on are exactly the ids that were
//! sampled (no re-tokenization drift). Each [`ModelTurn`] carries them as
//! its [`TokenTrace`].
//!
//! - [`EnginePolicy`]: the in-process engine. Requests arriving together
//!   (all rollouts of a batch start at once) are gathered into one
//!   `sample_many` call, so they share decode steps.
//! - [`HttpPolicy`]: an external server with temper's token endpoint
//!   (`POST /v1/generate`) and vLLM's adapter routes — `temper serve`.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use serde::Deserialize;
use serde_json::Value;
use temper_engine::{Sample, Trainer};
use temper_env::{
    ChatModel, ChatRequest, Message, ModelCallError, ModelTurn, SamplingArgs, TokenTrace, Usage,
};
use temper_model::{GenerationRequest, Pretrained, SamplingParams};
use tokio::sync::{mpsc, oneshot};

use crate::error::{Result, RlError};

/// Renders chat requests to token ids and sampled tokens back to turns.
#[derive(Clone)]
pub struct Renderer {
    model: Arc<Pretrained>,
}

impl Renderer {
    /// For `model`'s chat template and tokenizer.
    pub fn new(model: Arc<Pretrained>) -> Result<Self> {
        if model.chat_template.is_none() {
            return Err(RlError::Config(format!(
                "model {} has no chat template; environments need one",
                model.dir.display()
            )));
        }
        Ok(Self { model })
    }

    /// Prompt token ids of `req` (generation prompt appended).
    pub fn prompt_ids(&self, req: &ChatRequest) -> std::result::Result<Vec<u32>, ModelCallError> {
        let bad = |m: String| ModelCallError::Other(m);
        let template = self
            .model
            .chat_template
            .as_ref()
            .ok_or_else(|| bad("no chat template".into()))?;
        let messages =
            serde_json::to_value(&req.messages).map_err(|e| bad(format!("messages: {e}")))?;
        let tools = req.tools.as_ref().map(|t| Value::Array(t.clone()));
        let text = template
            .render(&messages, tools.as_ref(), true, &Default::default())
            .map_err(|e| bad(e.to_string()))?;
        let ids = self
            .model
            .tokenizer
            .encode(&text, false)
            .map_err(|e| bad(e.to_string()))?;
        let limit = self.model.config.max_position_embeddings;
        if ids.len() + 1 > limit {
            return Err(ModelCallError::PromptTooLong(format!(
                "prompt is {} tokens; the model's context is {limit}",
                ids.len()
            )));
        }
        Ok(ids)
    }

    /// Sampling parameters for `args`; the token budget is cut to what
    /// fits the context after `prompt_len` tokens.
    pub fn params(&self, args: &SamplingArgs, prompt_len: usize, seed: u64) -> SamplingParams {
        let room = self
            .model
            .config
            .max_position_embeddings
            .saturating_sub(prompt_len)
            .max(1);
        SamplingParams {
            max_tokens: args.max_tokens.clamp(1, room),
            temperature: args.temperature,
            top_p: args.top_p,
            stop: args.stop.clone(),
            stop_token_ids: args.stop_token_ids.clone(),
            min_p: args.min_p.unwrap_or(0.0),
            presence_penalty: args.presence_penalty.unwrap_or(0.0),
            frequency_penalty: args.frequency_penalty.unwrap_or(0.0),
            repetition_penalty: args.repetition_penalty.unwrap_or(1.0),
            logit_bias: args
                .logit_bias
                .iter()
                .map(|(id, b)| (*id, *b as f32))
                .collect(),
            seed: Some(seed),
            logprobs: true,
            ..Default::default()
        }
    }

    /// The assistant turn for a sample.
    pub fn turn(
        &self,
        prompt_ids: Vec<u32>,
        sample: Sample,
        text: String,
        version: u64,
        temperature: f64,
    ) -> ModelTurn {
        let usage = Usage {
            prompt_tokens: prompt_ids.len() as u64,
            completion_tokens: sample.tokens.len() as u64,
        };
        let trace = TokenTrace {
            prompt_ids,
            completion_ids: sample.tokens,
            logprobs: sample.logprobs,
            version,
            temperature,
        };
        ModelTurn {
            message: Message::assistant(text),
            finish_reason: sample.finish_reason.as_str().into(),
            usage,
            trace: Some(trace),
        }
    }

    /// Decode generated ids the way the sampler does (special tokens skipped).
    pub fn decode(&self, ids: &[u32]) -> String {
        self.model.tokenizer.decode(ids, true).unwrap_or_default()
    }
}

/// A seed for one model call: the request's seed mixed with the turn
/// number, so each turn of a multi-turn rollout draws fresh randomness.
fn call_seed(args: &SamplingArgs, req: &ChatRequest) -> u64 {
    let base = args.seed.unwrap_or(0);
    base ^ (req.messages.len() as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15)
}

struct Job {
    sampler: String,
    version: u64,
    request: GenerationRequest,
    reply: oneshot::Sender<temper_engine::Result<Sample>>,
}

/// Gathers concurrent sample requests into batched `sample_many` calls.
///
/// A caller that starts `n` rollouts at once announces them with
/// [`expect`](Batcher::expect): the batcher then waits for all `n` first
/// requests and orders them by seed, so the batch — and with it every
/// sampled token — does not depend on task scheduling. Without an
/// announcement it takes whatever has queued up once arrivals pause.
#[derive(Clone)]
pub struct Batcher {
    tx: mpsc::UnboundedSender<Job>,
    expected: Arc<AtomicUsize>,
}

impl Batcher {
    /// Announce `n` requests that are about to arrive together.
    pub fn expect(&self, n: usize) {
        self.expected.store(n, Ordering::SeqCst);
    }

    /// Start the batching task on the current tokio runtime.
    pub fn spawn(trainer: Arc<dyn Trainer>) -> Self {
        let (tx, mut rx) = mpsc::unbounded_channel::<Job>();
        let expected = Arc::new(AtomicUsize::new(0));
        let want = expected.clone();
        tokio::spawn(async move {
            while let Some(first) = rx.recv().await {
                let mut jobs = vec![first];
                let target = want.swap(0, Ordering::SeqCst);
                // Wait for the announced requests (bounded: a rollout that
                // fails before asking must not stall the rest for long).
                let mut idle = 0;
                while jobs.len() < target && idle < 2000 {
                    match rx.try_recv() {
                        Ok(j) => {
                            jobs.push(j);
                            idle = 0;
                        }
                        Err(_) => {
                            idle += 1;
                            tokio::time::sleep(Duration::from_millis(1)).await;
                        }
                    }
                }
                // Then let anything arriving in the same instant join.
                for _ in 0..3 {
                    tokio::task::yield_now().await;
                    while let Ok(j) = rx.try_recv() {
                        jobs.push(j);
                    }
                }
                jobs.sort_by_key(|j| j.request.params.seed);
                // One call per set of weights.
                while !jobs.is_empty() {
                    let sampler = jobs[0].sampler.clone();
                    let (now, later): (Vec<Job>, Vec<Job>) =
                        jobs.into_iter().partition(|j| j.sampler == sampler);
                    jobs = later;
                    let requests = now.iter().map(|j| j.request.clone()).collect();
                    match trainer.sample_many(&sampler, requests).await {
                        Ok(outs) => {
                            for (job, mut samples) in now.into_iter().zip(outs) {
                                let s = samples.pop().ok_or_else(|| {
                                    temper_engine::EngineError::InvalidRequest(
                                        "sampler returned no sample".into(),
                                    )
                                });
                                let _ = job.reply.send(s);
                            }
                        }
                        Err(e) => {
                            let msg = e.to_string();
                            for job in now {
                                let _ = job
                                    .reply
                                    .send(Err(temper_engine::EngineError::Remote(msg.clone())));
                            }
                        }
                    }
                }
            }
        });
        Self { tx, expected }
    }
}

/// One published policy of the in-process trainer, as a [`ChatModel`].
#[derive(Clone)]
pub struct EnginePolicy {
    renderer: Renderer,
    batcher: Batcher,
    sampler: String,
    version: u64,
}

impl EnginePolicy {
    /// Sample from sampler handle `sampler` (policy `version`).
    pub fn new(renderer: Renderer, batcher: Batcher, sampler: String, version: u64) -> Self {
        Self {
            renderer,
            batcher,
            sampler,
            version,
        }
    }
}

#[async_trait]
impl ChatModel for EnginePolicy {
    async fn chat(&self, req: ChatRequest) -> std::result::Result<ModelTurn, ModelCallError> {
        let prompt = self.renderer.prompt_ids(&req)?;
        let params =
            self.renderer
                .params(&req.sampling, prompt.len(), call_seed(&req.sampling, &req));
        let temperature = params.temperature;
        let (reply, rx) = oneshot::channel();
        let job = Job {
            sampler: self.sampler.clone(),
            version: self.version,
            request: GenerationRequest {
                prompt: prompt.clone(),
                n: 1,
                params,
            },
            reply,
        };
        let version = job.version;
        self.batcher
            .tx
            .send(job)
            .map_err(|_| ModelCallError::Other("the sampler stopped".into()))?;
        let sample = rx
            .await
            .map_err(|_| ModelCallError::Other("the sampler stopped".into()))?
            .map_err(|e| ModelCallError::Other(e.to_string()))?;
        let text = cut_at_stop(self.renderer.decode(&sample.tokens), &req.sampling.stop);
        Ok(self
            .renderer
            .turn(prompt, sample, text, version, temperature))
    }
}

/// Text cut before the earliest stop string, as the sampler cuts it.
fn cut_at_stop(mut text: String, stop: &[String]) -> String {
    if let Some(i) = stop.iter().filter_map(|s| text.find(s.as_str())).min() {
        text.truncate(i);
    }
    text
}

/// An external sampler speaking temper's token endpoint.
#[derive(Clone)]
pub struct HttpPolicy {
    renderer: Renderer,
    client: reqwest::Client,
    url: String,
    model: String,
    api_key: Option<String>,
}

#[derive(Deserialize)]
struct GenerateResponse {
    /// The adapter version that answered (temper serve: its load count).
    version: Option<u64>,
    choices: Vec<GenerateChoice>,
}

#[derive(Deserialize)]
struct GenerateChoice {
    token_ids: Vec<u32>,
    #[serde(default)]
    logprobs: Vec<f32>,
    #[serde(default)]
    text: String,
    #[serde(default)]
    finish_reason: String,
}

impl HttpPolicy {
    /// Sample from `model` (the adapter name) on the server at `url`.
    pub fn new(renderer: Renderer, url: &str, model: &str, api_key: Option<String>) -> Self {
        Self {
            renderer,
            client: reqwest::Client::new(),
            url: url.trim_end_matches('/').to_string(),
            model: model.to_string(),
            api_key,
        }
    }

    fn post(&self, path: &str) -> reqwest::RequestBuilder {
        let b = self.client.post(format!("{}{path}", self.url));
        match &self.api_key {
            Some(k) => b.bearer_auth(k),
            None => b,
        }
    }

    /// Publish the PEFT adapter in `dir` as this policy's weights
    /// (`POST /v1/load_lora_adapter`, vLLM's route); returns the server's
    /// version for it.
    pub async fn load_adapter(&self, dir: &std::path::Path) -> Result<u64> {
        let body =
            serde_json::json!({"lora_name": self.model, "lora_path": dir.display().to_string()});
        let resp = self
            .post("/v1/load_lora_adapter")
            .json(&body)
            .send()
            .await
            .map_err(|e| RlError::Sampler(format!("{}: {e}", self.url)))?;
        let status = resp.status();
        let text = resp.text().await.unwrap_or_default();
        if !status.is_success() {
            return Err(RlError::Sampler(format!(
                "load_lora_adapter answered {status}: {text}"
            )));
        }
        // The version is how turns are attributed to policy versions: a
        // server that does not report one cannot be trained against.
        serde_json::from_str::<Value>(&text)
            .ok()
            .and_then(|v| v.get("version").and_then(Value::as_u64))
            .ok_or_else(|| {
                RlError::Sampler(format!(
                    "load_lora_adapter answered without an adapter version: {text}"
                ))
            })
    }
}

#[async_trait]
impl ChatModel for HttpPolicy {
    async fn chat(&self, req: ChatRequest) -> std::result::Result<ModelTurn, ModelCallError> {
        let prompt = self.renderer.prompt_ids(&req)?;
        let p = self
            .renderer
            .params(&req.sampling, prompt.len(), call_seed(&req.sampling, &req));
        let body = serde_json::json!({
            "model": self.model,
            "prompt_token_ids": prompt,
            "n": 1,
            "max_tokens": p.max_tokens,
            "temperature": p.temperature,
            "top_p": p.top_p,
            "seed": p.seed,
            "stop": p.stop,
            "stop_token_ids": p.stop_token_ids,
            "min_p": p.min_p,
            "presence_penalty": p.presence_penalty,
            "frequency_penalty": p.frequency_penalty,
            "repetition_penalty": p.repetition_penalty,
            "logit_bias": p.logit_bias.iter().map(|(id, b)| (id.to_string(), *b)).collect::<std::collections::BTreeMap<_, _>>(),
        });
        let resp = self
            .post("/v1/generate")
            .json(&body)
            .send()
            .await
            .map_err(|e| ModelCallError::Connection(e.to_string()))?;
        let status = resp.status();
        let text = resp
            .text()
            .await
            .map_err(|e| ModelCallError::Connection(e.to_string()))?;
        if !status.is_success() {
            return Err(ModelCallError::Status {
                status: status.as_u16(),
                message: text,
            });
        }
        let mut out: GenerateResponse = serde_json::from_str(&text)
            .map_err(|e| ModelCallError::Malformed(format!("/v1/generate: {e}: {text}")))?;
        let version = out.version.ok_or_else(|| {
            ModelCallError::Malformed(format!("/v1/generate reported no adapter version: {text}"))
        })?;
        let choice = out
            .choices
            .pop()
            .ok_or_else(|| ModelCallError::Malformed("/v1/generate returned no choice".into()))?;
        let finish_reason = if choice.finish_reason == "length" {
            temper_model::FinishReason::Length
        } else {
            temper_model::FinishReason::Stop
        };
        let sample = Sample {
            tokens: choice.token_ids,
            logprobs: choice.logprobs,
            finish_reason,
        };
        Ok(self
            .renderer
            .turn(prompt, sample, choice.text, version, p.temperature))
    }
}
