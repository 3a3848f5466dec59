//! [`RemoteTrainer`]: the [`Trainer`] trait over the tinker wire protocol.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Arc, Mutex};

use prost::Message;
use serde_json::{json, Value};
use temper_engine::{
    AdamParams, Datum, DatumOutput, EngineError, ForwardOutput, Loss, Result, Sample, StepStats,
    Trainer, TrainerFuture,
};
use temper_model::{FinishReason, SamplingParams};
use tokio::sync::oneshot;

use crate::proto;

enum Body {
    Json(Value),
    Proto(Vec<u8>),
}

enum Reply {
    Json(Value),
    Proto(Vec<u8>),
}

fn remote(e: impl std::fmt::Display) -> EngineError {
    EngineError::Remote(e.to_string())
}

struct Conn {
    http: reqwest::Client,
    base: String,
    api_key: String,
}

impl Conn {
    async fn post(&self, route: &str, body: Body) -> Result<reqwest::Response> {
        let req = self
            .http
            .post(format!("{}/api/v1/{route}", self.base))
            .header("X-API-Key", &self.api_key);
        let req = match body {
            Body::Json(v) => req.json(&v),
            Body::Proto(b) => req.header("Content-Type", "application/x-protobuf").body(b),
        };
        let resp = req.send().await.map_err(remote)?;
        if !resp.status().is_success() {
            let status = resp.status();
            let text = resp.text().await.unwrap_or_default();
            return Err(if status.is_client_error() {
                EngineError::InvalidRequest(format!("{route}: {status}: {text}"))
            } else {
                remote(format!("{route}: {status}: {text}"))
            });
        }
        Ok(resp)
    }

    async fn post_json(&self, route: &str, body: Value) -> Result<Value> {
        self.post(route, Body::Json(body))
            .await?
            .json()
            .await
            .map_err(remote)
    }

    /// Submit, returning the request id of the future.
    async fn submit(&self, route: &str, body: Body) -> Result<String> {
        let v: Value = self.post(route, body).await?.json().await.map_err(remote)?;
        v.get("request_id")
            .and_then(|r| r.as_str())
            .map(str::to_string)
            .ok_or_else(|| remote(format!("{route}: no request_id in {v}")))
    }

    /// Poll a future until it resolves.
    async fn wait(&self, request_id: &str) -> Result<Reply> {
        loop {
            let resp = self
                .post(
                    "retrieve_future",
                    Body::Json(json!({"request_id": request_id, "allow_metadata_only": false})),
                )
                .await?;
            let is_proto = resp
                .headers()
                .get("content-type")
                .and_then(|v| v.to_str().ok())
                .is_some_and(|c| c.contains("application/x-protobuf"));
            if is_proto {
                return Ok(Reply::Proto(resp.bytes().await.map_err(remote)?.to_vec()));
            }
            let v: Value = resp.json().await.map_err(remote)?;
            if v.get("type").and_then(|t| t.as_str()) == Some("try_again") {
                continue;
            }
            if let Some(err) = v.get("error") {
                let msg = err
                    .as_str()
                    .map(str::to_string)
                    .unwrap_or_else(|| err.to_string());
                return Err(match v.get("category").and_then(|c| c.as_str()) {
                    Some("user") => EngineError::InvalidRequest(msg),
                    _ => remote(msg),
                });
            }
            return Ok(Reply::Json(v));
        }
    }
}

/// A training run on a remote training API, as a [`Trainer`].
///
/// Calls are submitted strictly in the order they are made (each waits
/// until the previous one is acknowledged by the server), then run
/// concurrently with the caller: issue `forward_backward` and `optim_step`
/// back to back and await both later. Must be used inside a tokio runtime.
pub struct RemoteTrainer {
    conn: Arc<Conn>,
    session_id: String,
    model_id: String,
    seq: AtomicI64,
    sampler_seq: Arc<AtomicI64>,
    sample_seq: AtomicI64,
    chain: Mutex<Option<oneshot::Receiver<()>>>,
}

impl RemoteTrainer {
    /// Open a session on `base_url` and create a LoRA run of `rank` on
    /// `base_model` (one of the server's model names).
    pub async fn connect(
        base_url: &str,
        api_key: &str,
        base_model: &str,
        rank: usize,
        seed: Option<u64>,
    ) -> Result<Self> {
        let conn = Arc::new(Conn {
            http: reqwest::Client::new(),
            base: base_url.trim_end_matches('/').to_string(),
            api_key: api_key.to_string(),
        });
        conn.post_json("client/config", json!({"sdk_version": "temper"}))
            .await?;
        let s = conn
            .post_json(
                "create_session",
                json!({"tags": [], "type": "create_session"}),
            )
            .await?;
        let session_id = s
            .get("session_id")
            .and_then(|v| v.as_str())
            .ok_or_else(|| remote(format!("create_session: {s}")))?
            .to_string();
        let mut lora =
            json!({"rank": rank, "train_mlp": true, "train_attn": true, "train_unembed": false});
        if let Some(seed) = seed {
            lora["seed"] = json!(seed);
        }
        let id = conn
            .submit(
                "create_model",
                Body::Json(json!({
                    "session_id": session_id, "model_seq_id": 0, "base_model": base_model,
                    "lora_config": lora, "type": "create_model",
                })),
            )
            .await?;
        let model_id = match conn.wait(&id).await? {
            Reply::Json(v) => v
                .get("model_id")
                .and_then(|m| m.as_str())
                .map(str::to_string)
                .ok_or_else(|| remote(format!("create_model: {v}")))?,
            Reply::Proto(_) => return Err(remote("create_model: unexpected protobuf")),
        };
        Ok(Self {
            conn,
            session_id,
            model_id,
            seq: AtomicI64::new(1),
            sampler_seq: Arc::new(AtomicI64::new(0)),
            sample_seq: AtomicI64::new(0),
            chain: Mutex::new(None),
        })
    }

    /// The server's id of this run.
    pub fn model_id(&self) -> &str {
        &self.model_id
    }

    fn next_seq(&self) -> i64 {
        self.seq.fetch_add(1, Ordering::Relaxed)
    }

    /// This call's place in the submission order: wait on the first (the
    /// previous call has been submitted), fire the second once submitted.
    fn take_turn(&self) -> (Option<oneshot::Receiver<()>>, oneshot::Sender<()>) {
        let (tx, rx) = oneshot::channel::<()>();
        let prev = self
            .chain
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .replace(rx);
        (prev, tx)
    }

    /// Submit after every earlier call has been submitted, then wait for the
    /// result and convert it.
    fn call<T: Send + 'static>(
        &self,
        route: &'static str,
        body: Result<Body>,
        then: impl FnOnce(Arc<Conn>, Reply) -> TrainerFuture<T> + Send + 'static,
    ) -> TrainerFuture<T> {
        let (prev, tx) = self.take_turn();
        let conn = self.conn.clone();
        let task = tokio::spawn(async move {
            if let Some(p) = prev {
                let _ = p.await;
            }
            let submitted = match body {
                Ok(b) => conn.submit(route, b).await,
                Err(e) => Err(e),
            };
            let _ = tx.send(());
            let reply = conn.wait(&submitted?).await?;
            then(conn, reply).await
        });
        Box::pin(async move { task.await.map_err(remote)? })
    }

    fn fwd(
        &self,
        data: Vec<Datum>,
        loss: Loss,
        forward_only: bool,
    ) -> TrainerFuture<ForwardOutput> {
        if let (Loss::Custom(f), false) = (&loss, forward_only) {
            return self.custom_forward_backward(data, f.clone());
        }
        let n = data.len();
        let body =
            encode_forward_backward(&self.model_id, self.next_seq(), &data, &loss, forward_only)
                .map(Body::Proto);
        self.call("forward_backward", body, move |_, reply| {
            Box::pin(async move { decode_forward_output(reply, n) })
        })
    }

    /// A custom loss, computed here: a forward pass for the logprobs, the
    /// loss and its gradient `g = dL/dlogprobs` locally, then a
    /// cross-entropy forward_backward with weights `−g`, whose gradient is
    /// the custom loss's (Tinker's client-side custom-loss recipe). Both
    /// requests go out before any later call.
    fn custom_forward_backward(
        &self,
        data: Vec<Datum>,
        f: temper_engine::CustomLoss,
    ) -> TrainerFuture<ForwardOutput> {
        let (prev, tx) = self.take_turn();
        let conn = self.conn.clone();
        let model_id = self.model_id.clone();
        let (seq_fwd, seq_bwd) = (self.next_seq(), self.next_seq());
        let task = tokio::spawn(async move {
            if let Some(p) = prev {
                let _ = p.await;
            }
            let result = async {
                let n = data.len();
                let body =
                    encode_forward_backward(&model_id, seq_fwd, &data, &Loss::CrossEntropy, true)?;
                let id = conn.submit("forward_backward", Body::Proto(body)).await?;
                let fwd = decode_forward_output(conn.wait(&id).await?, n)?;
                let mut total = 0f64;
                let mut weighted = Vec::with_capacity(n);
                for (d, o) in data.iter().zip(&fwd.loss_fn_outputs) {
                    let dev = temper_model::candle_core::Device::Cpu;
                    let lp = temper_model::candle_core::Var::new(o.logprobs.as_slice(), &dev)?;
                    let l = f(lp.as_tensor(), &d.loss_fn_inputs)?;
                    total += l
                        .to_dtype(temper_model::candle_core::DType::F64)?
                        .to_scalar::<f64>()?;
                    let g = l
                        .backward()?
                        .get(lp.as_tensor())
                        .map(|g| g.to_vec1::<f32>())
                        .transpose()?
                        .unwrap_or_else(|| vec![0.0; o.logprobs.len()]);
                    let mut w = d.clone();
                    w.loss_fn_inputs.weights = Some(g.iter().map(|x| -x).collect());
                    weighted.push(w);
                }
                let body = encode_forward_backward(
                    &model_id,
                    seq_bwd,
                    &weighted,
                    &Loss::CrossEntropy,
                    false,
                )?;
                let id = conn.submit("forward_backward", Body::Proto(body)).await;
                Ok::<_, EngineError>((id, fwd, total))
            }
            .await;
            let _ = tx.send(());
            let (id, fwd, total) = result?;
            conn.wait(&id?).await?;
            let mut metrics = BTreeMap::new();
            metrics.insert("loss:sum".to_string(), total);
            Ok(ForwardOutput {
                loss_fn_outputs: fwd.loss_fn_outputs,
                metrics,
            })
        });
        Box::pin(async move { task.await.map_err(remote)? })
    }
}

fn tensor_i64(xs: &[i64]) -> proto::Tensor {
    proto::Tensor {
        encoding: Some(proto::tensor::Encoding::Dense(proto::le::i64_bytes(xs))),
        dtype: proto::DType::Int64 as i32,
        shape: vec![xs.len() as i64],
    }
}

fn tensor_f32(xs: &[f32]) -> proto::Tensor {
    proto::Tensor {
        encoding: Some(proto::tensor::Encoding::Dense(proto::le::f32_bytes(xs))),
        dtype: proto::DType::Float32 as i32,
        shape: vec![xs.len() as i64],
    }
}

fn encode_forward_backward(
    model_id: &str,
    seq_id: i64,
    data: &[Datum],
    loss: &Loss,
    forward_only: bool,
) -> Result<Vec<u8>> {
    if let Loss::Custom(_) = loss {
        return Err(EngineError::InvalidRequest(
            "a custom loss has no server-side forward; use forward_backward".into(),
        ));
    }
    let (name, config) = (loss.name(), loss.config());
    // The wire carries one scoring temperature per request, in
    // loss_fn_config (see the server): every datum must share it.
    let temperature = data.first().and_then(|d| d.loss_fn_inputs.temperature);
    if data
        .iter()
        .any(|d| d.loss_fn_inputs.temperature != temperature)
    {
        return Err(EngineError::InvalidRequest(
            "datums of one forward_backward must share one temperature".into(),
        ));
    }
    let mut config = config;
    if let Some(t) = temperature {
        config.push(("temperature", t));
    }
    let data = data
        .iter()
        .map(|d| {
            let mut inputs = HashMap::new();
            let li = &d.loss_fn_inputs;
            let targets: Vec<i64> = li.target_tokens.iter().map(|&t| t as i64).collect();
            inputs.insert("target_tokens".to_string(), tensor_i64(&targets));
            for (k, v) in [
                ("weights", &li.weights),
                ("logprobs", &li.logprobs),
                ("advantages", &li.advantages),
                ("sequence_ratio_mask", &li.sequence_ratio_mask),
            ] {
                if let Some(v) = v {
                    inputs.insert(k.to_string(), tensor_f32(v));
                }
            }
            proto::Datum {
                model_input: vec![proto::Chunk {
                    chunk: Some(proto::chunk::Chunk::EncodedText(proto::EncodedTextChunk {
                        tokens: proto::le::i32_bytes(&d.model_input),
                    })),
                }],
                loss_fn_inputs: inputs,
            }
        })
        .collect();
    Ok(proto::ForwardBackwardRequest {
        model_id: model_id.to_string(),
        seq_id: i32::try_from(seq_id).map_err(|_| remote("seq_id overflow"))?,
        data,
        loss_fn: name.to_string(),
        loss_fn_config: config.iter().map(|(k, v)| (k.to_string(), *v)).collect(),
        forward_only,
        loss_fn_config_v2: config
            .iter()
            .map(|(k, v)| {
                (
                    k.to_string(),
                    proto::LossConfigValue {
                        value: Some(proto::loss_config_value::Value::Number(*v)),
                    },
                )
            })
            .collect(),
    }
    .encode_to_vec())
}

fn decode_forward_output(reply: Reply, n: usize) -> Result<ForwardOutput> {
    let Reply::Proto(bytes) = reply else {
        return Err(remote("forward_backward: expected a protobuf result"));
    };
    let out = proto::ForwardBackwardOutput::decode(bytes.as_slice()).map_err(remote)?;
    let mut outputs = Vec::with_capacity(n);
    for rec in &out.loss_fn_outputs {
        let f = rec
            .fields
            .get("logprobs")
            .ok_or_else(|| remote("forward_backward: no logprobs output"))?;
        let data = proto::le::f32_from(&f.data).ok_or_else(|| remote("malformed logprobs"))?;
        let offsets = proto::le::i64_from(&f.offsets).ok_or_else(|| remote("malformed offsets"))?;
        for w in offsets.windows(2) {
            let (a, b) = (w[0] as usize / 4, w[1] as usize / 4);
            let lp = data
                .get(a..b)
                .ok_or_else(|| remote("offsets out of range"))?;
            outputs.push(DatumOutput {
                logprobs: lp.to_vec(),
                entropy: Vec::new(),
            });
        }
    }
    if outputs.len() != n {
        return Err(remote(format!("{} outputs for {n} datums", outputs.len())));
    }
    Ok(ForwardOutput {
        loss_fn_outputs: outputs,
        metrics: out.metrics.into_iter().collect::<BTreeMap<_, _>>(),
    })
}

fn sampling_json(p: &SamplingParams) -> Value {
    let mut v = json!({
        "max_tokens": p.max_tokens,
        "temperature": p.temperature,
        "top_k": if p.top_k == 0 { -1 } else { p.top_k as i64 },
        "top_p": p.top_p,
    });
    if let Some(seed) = p.seed {
        v["seed"] = json!(seed);
    }
    if !p.stop_token_ids.is_empty() {
        // The protocol cannot say "EOS and these ids": ids replace EOS.
        v["stop"] = json!(p.stop_token_ids);
    } else if !p.stop.is_empty() {
        v["stop"] = json!(p.stop);
    } else if p.ignore_eos {
        v["stop"] = json!([]);
    }
    v
}

fn json_reply(reply: Reply, what: &str) -> Result<Value> {
    match reply {
        Reply::Json(v) => Ok(v),
        Reply::Proto(_) => Err(remote(format!("{what}: unexpected protobuf result"))),
    }
}

fn sample_reply(reply: Reply) -> Result<proto::SampleResponse> {
    match reply {
        Reply::Proto(b) => proto::SampleResponse::decode(b.as_slice()).map_err(remote),
        Reply::Json(v) => Err(remote(format!("asample: expected protobuf, got {v}"))),
    }
}

impl Trainer for RemoteTrainer {
    fn forward(&self, data: Vec<Datum>, loss: Loss) -> TrainerFuture<ForwardOutput> {
        self.fwd(data, loss, true)
    }

    fn forward_backward(&self, data: Vec<Datum>, loss: Loss) -> TrainerFuture<ForwardOutput> {
        self.fwd(data, loss, false)
    }

    fn optim_step(&self, params: AdamParams) -> TrainerFuture<StepStats> {
        let body = json!({
            "model_id": self.model_id, "seq_id": self.next_seq(), "type": "optim_step",
            "adam_params": params,
        });
        self.call("optim_step", Ok(Body::Json(body)), move |_, reply| {
            Box::pin(async move {
                let v = json_reply(reply, "optim_step")?;
                let m = |k: &str| v["metrics"][k].as_f64();
                Ok(StepStats {
                    grad_norm: m("grad_norm:mean").unwrap_or(f64::NAN),
                    learning_rate: m("learning_rate:mean").unwrap_or(params.learning_rate),
                })
            })
        })
    }

    fn save_weights_for_sampler(&self, name: &str) -> TrainerFuture<String> {
        let body = json!({
            "model_id": self.model_id, "path": name, "kind": "snapshot",
            "seq_id": self.next_seq(), "type": "save_weights_for_sampler",
        });
        let session = self.session_id.clone();
        let sampler_seq = self.sampler_seq.clone();
        self.call(
            "save_weights_for_sampler",
            Ok(Body::Json(body)),
            move |conn, reply| {
                Box::pin(async move {
                    let v = json_reply(reply, "save_weights_for_sampler")?;
                    let path = v["path"]
                        .as_str()
                        .ok_or_else(|| remote(format!("save_weights_for_sampler: {v}")))?;
                    let n = sampler_seq.fetch_add(1, Ordering::Relaxed);
                    let s = conn
                        .post_json(
                            "create_sampling_session",
                            json!({"session_id": session, "sampling_session_seq_id": n,
                               "model_path": path, "type": "create_sampling_session"}),
                        )
                        .await?;
                    s["sampling_session_id"]
                        .as_str()
                        .map(str::to_string)
                        .ok_or_else(|| remote(format!("create_sampling_session: {s}")))
                })
            },
        )
    }

    fn sample(
        &self,
        sampler: &str,
        prompt: Vec<u32>,
        n: usize,
        params: SamplingParams,
    ) -> TrainerFuture<Vec<Sample>> {
        let body = json!({
            "sampling_session_id": sampler, "seq_id": self.sample_seq.fetch_add(1, Ordering::Relaxed),
            "num_samples": n, "prompt": {"chunks": [{"type": "encoded_text", "tokens": prompt}]},
            "sampling_params": sampling_json(&params), "prompt_logprobs": false, "type": "sample",
        });
        self.call("asample", Ok(Body::Json(body)), move |_, reply| {
            Box::pin(async move {
                let r = sample_reply(reply)?;
                r.sequences
                    .iter()
                    .map(|s| {
                        Ok(Sample {
                            tokens: proto::le::ids_from_i32(&s.tokens)
                                .ok_or_else(|| remote("malformed tokens"))?,
                            logprobs: s
                                .logprobs
                                .as_deref()
                                .map(proto::le::f32_from)
                                .unwrap_or(Some(Vec::new()))
                                .ok_or_else(|| remote("malformed logprobs"))?,
                            finish_reason: if s.stop_reason == proto::StopReason::Length as i32 {
                                FinishReason::Length
                            } else {
                                FinishReason::Stop
                            },
                        })
                    })
                    .collect()
            })
        })
    }

    fn compute_logprobs(
        &self,
        sampler: &str,
        tokens: Vec<u32>,
        temperature: f64,
    ) -> TrainerFuture<Vec<f32>> {
        // Prompt logprobs come back at the request's sampling temperature.
        let body = json!({
            "sampling_session_id": sampler, "seq_id": self.sample_seq.fetch_add(1, Ordering::Relaxed),
            "num_samples": 1, "prompt": {"chunks": [{"type": "encoded_text", "tokens": tokens}]},
            "sampling_params": {"max_tokens": 1, "temperature": temperature, "top_k": -1, "top_p": 1.0},
            "prompt_logprobs": true, "type": "sample",
        });
        self.call("asample", Ok(Body::Json(body)), move |_, reply| {
            Box::pin(async move {
                let r = sample_reply(reply)?;
                let lp = r
                    .prompt_logprobs
                    .as_deref()
                    .and_then(proto::le::f32_from)
                    .ok_or_else(|| remote("compute_logprobs: no prompt logprobs"))?;
                Ok(lp.into_iter().skip(1).collect())
            })
        })
    }

    fn save_state(&self, name: &str) -> TrainerFuture<String> {
        let body = json!({
            "model_id": self.model_id, "path": name, "seq_id": self.next_seq(),
            "overwrite": true, "type": "save_weights",
        });
        self.call("save_weights", Ok(Body::Json(body)), move |_, reply| {
            Box::pin(async move {
                let v = json_reply(reply, "save_weights")?;
                v["path"]
                    .as_str()
                    .map(str::to_string)
                    .ok_or_else(|| remote(format!("save_weights: {v}")))
            })
        })
    }

    fn load_state(&self, path: &str, with_optimizer: bool) -> TrainerFuture<()> {
        let body = json!({
            "model_id": self.model_id, "path": path, "seq_id": self.next_seq(),
            "optimizer": with_optimizer, "type": "load_weights",
        });
        self.call("load_weights", Ok(Body::Json(body)), move |_, reply| {
            Box::pin(async move {
                json_reply(reply, "load_weights")?;
                Ok(())
            })
        })
    }
}
