//! [`RemoteTrainer`]: the [`Trainer`] trait over the tinker wire protocol.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use prost::Message;
use serde_json::{json, Value};
use temper_engine::{
    AdamParams, Datum, DatumOutput, EngineError, ForwardOutput, Loss, Result, Sample, StepStats,
    Trainer, TrainerFuture,
};
use temper_model::{FinishReason, SamplingParams};
use tokio::sync::oneshot;

use crate::conn::{remote, Body, Conn, Kind, Reply, SDK_VERSION};
use temper_api::proto;

/// A training run on a Tinker-compatible training API, as a [`Trainer`]:
/// `temper api serve`, or any service the tinker SDK drives.
///
/// Calls are submitted strictly in the order they are made (each waits
/// until the previous one is acknowledged by the server), then run
/// concurrently with the caller: issue `forward_backward` and `optim_step`
/// back to back and await both later. Sampling calls are independent of
/// that order. Must be used inside a tokio runtime; dropping the trainer
/// stops its session's heartbeat.
pub struct RemoteTrainer {
    conn: Arc<Conn>,
    model_id: String,
    seq: AtomicI64,
    sampler_seq: AtomicI64,
    sample_seq: Arc<AtomicI64>,
    chain: Mutex<Option<oneshot::Receiver<()>>>,
    heartbeat: tokio::task::AbortHandle,
}

impl Drop for RemoteTrainer {
    fn drop(&mut self) {
        self.heartbeat.abort();
    }
}

/// Resubmissions of a sample whose result the service expired (HTTP 410),
/// each under a new `seq_id`, as the SDK's sampling retry does.
const SAMPLE_RESUBMITS: usize = 3;

impl RemoteTrainer {
    /// Open a session on `base_url` and create a LoRA run of `rank` on
    /// `base_model` (one of the server's model names). `api_key` goes in
    /// `X-API-Key` (none when empty).
    pub async fn connect(
        base_url: &str,
        api_key: &str,
        base_model: &str,
        rank: usize,
        seed: Option<u64>,
    ) -> Result<Self> {
        let conn = Arc::new(Conn::open(base_url, api_key).await?);
        let s = conn
            .post_json(
                "create_session",
                json!({"tags": [], "user_metadata": {}, "sdk_version": SDK_VERSION,
                       "type": "create_session"}),
            )
            .await?;
        let session_id = s
            .get("session_id")
            .and_then(|v| v.as_str())
            .ok_or_else(|| remote(format!("create_session: {s}")))?
            .to_string();
        let heartbeat = Conn::heartbeat(conn.clone(), session_id.clone());
        let mut lora =
            json!({"rank": rank, "train_mlp": true, "train_attn": true, "train_unembed": false});
        if let Some(seed) = seed {
            lora["seed"] = json!(seed);
        }
        let created = async {
            let id = conn
                .submit(
                    "create_model",
                    Body::Json(json!({
                        "session_id": session_id, "model_seq_id": 0, "base_model": base_model,
                        "lora_config": lora, "type": "create_model",
                    })),
                    &[],
                )
                .await?;
            match conn.resolve(&id, Kind::CreateModel).await? {
                Reply::Json(v) => v
                    .get("model_id")
                    .and_then(|m| m.as_str())
                    .map(str::to_string)
                    .ok_or_else(|| remote(format!("create_model: {v}"))),
                Reply::Proto(_) => Err(remote("create_model: unexpected protobuf")),
            }
        }
        .await;
        let model_id = match created {
            Ok(m) => m,
            Err(e) => {
                heartbeat.abort();
                return Err(e);
            }
        };
        Ok(Self {
            conn,
            model_id,
            seq: AtomicI64::new(1),
            sampler_seq: AtomicI64::new(0),
            sample_seq: Arc::new(AtomicI64::new(0)),
            chain: Mutex::new(None),
            heartbeat,
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
            .unwrap_or_else(PoisonError::into_inner)
            .replace(rx);
        (prev, tx)
    }

    /// Submit `bodies` in order after every earlier call has been
    /// submitted, then wait for their results and convert them.
    fn call<T: Send + 'static>(
        &self,
        route: &'static str,
        kind: Kind,
        bodies: Result<Vec<Body>>,
        then: impl FnOnce(Vec<Reply>) -> Result<T> + Send + 'static,
    ) -> TrainerFuture<T> {
        let (prev, tx) = self.take_turn();
        let conn = self.conn.clone();
        let task = tokio::spawn(async move {
            if let Some(p) = prev {
                let _ = p.await;
            }
            let submitted = async {
                let mut ids = Vec::new();
                for b in bodies? {
                    ids.push(conn.submit(route, b, &[]).await?);
                }
                Ok::<_, EngineError>(ids)
            }
            .await;
            let _ = tx.send(());
            let mut replies = Vec::new();
            for id in submitted? {
                replies.push(conn.resolve(&id, kind).await?);
            }
            then(replies)
        });
        Box::pin(async move { task.await.map_err(remote)? })
    }

    /// The datums of one forward(_backward), split into requests as the
    /// service's `client/config` allows, as index ranges.
    fn chunks(&self, data: &[proto::Datum]) -> Vec<std::ops::Range<usize>> {
        let sizes: Vec<usize> = data.iter().map(|d| d.encoded_len()).collect();
        chunk_ranges(
            &sizes,
            self.conn.flags.max_chunk_len,
            self.conn.flags.max_chunk_bytes,
        )
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
        let kind = if forward_only {
            Kind::Forward
        } else {
            Kind::ForwardBackward
        };
        let n = data.len();
        let datums = data.iter().map(proto_datum).collect::<Vec<_>>();
        let bodies = self
            .chunks(&datums)
            .into_iter()
            .map(|r| {
                encode_forward_backward(
                    &self.model_id,
                    self.next_seq(),
                    &data[r.clone()],
                    datums[r].to_vec(),
                    &loss,
                    forward_only,
                )
                .map(Body::Proto)
            })
            .collect::<Result<Vec<_>>>();
        self.call("forward_backward", kind, bodies, move |replies| {
            decode_forward_outputs(replies, n)
        })
    }

    /// A custom loss, computed here: a forward pass for the logprobs, the
    /// loss and its gradient `g = dL/dlogprobs` locally, then a
    /// cross-entropy forward_backward with weights `−g`, whose gradient is
    /// the custom loss's (Tinker's client-side custom-loss recipe). Both
    /// passes go out before any later call.
    fn custom_forward_backward(
        &self,
        data: Vec<Datum>,
        f: temper_engine::CustomLoss,
    ) -> TrainerFuture<ForwardOutput> {
        let (prev, tx) = self.take_turn();
        let conn = self.conn.clone();
        let model_id = self.model_id.clone();
        let chunks = self.chunks(&data.iter().map(proto_datum).collect::<Vec<_>>());
        // Both passes' seq ids, reserved now (the SDK reserves 2 × chunks).
        let fwd_seqs: Vec<i64> = chunks.iter().map(|_| self.next_seq()).collect();
        let bwd_seqs: Vec<i64> = chunks.iter().map(|_| self.next_seq()).collect();
        let task = tokio::spawn(async move {
            if let Some(p) = prev {
                let _ = p.await;
            }
            let encode = |data: &[Datum], seq: i64, forward_only: bool| {
                let datums = data.iter().map(proto_datum).collect();
                encode_forward_backward(
                    &model_id,
                    seq,
                    data,
                    datums,
                    &Loss::CrossEntropy,
                    forward_only,
                )
                .map(Body::Proto)
            };
            let result = async {
                let n = data.len();
                let mut replies = Vec::new();
                for (r, seq) in chunks.iter().zip(&fwd_seqs) {
                    let id = conn
                        .submit(
                            "forward_backward",
                            encode(&data[r.clone()], *seq, true)?,
                            &[],
                        )
                        .await?;
                    replies.push(conn.resolve(&id, Kind::Forward).await?);
                }
                let fwd = decode_forward_outputs(replies, n)?;
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
                let mut ids = Vec::new();
                for (r, seq) in chunks.iter().zip(&bwd_seqs) {
                    let body = encode(&weighted[r.clone()], *seq, false)?;
                    ids.push(conn.submit("forward_backward", body, &[]).await?);
                }
                Ok::<_, EngineError>((ids, fwd, total))
            }
            .await;
            let _ = tx.send(());
            let (ids, fwd, total) = result?;
            for id in ids {
                conn.resolve(&id, Kind::ForwardBackward).await?;
            }
            let mut metrics = BTreeMap::new();
            metrics.insert("loss:sum".to_string(), total);
            Ok(ForwardOutput {
                loss_fn_outputs: fwd.loss_fn_outputs,
                metrics,
            })
        });
        Box::pin(async move { task.await.map_err(remote)? })
    }

    /// Sample outside the training order (sampling requests are
    /// independent), resubmitting under a new `seq_id` when the service
    /// expired the request.
    fn sample_call<T: Send + 'static>(
        &self,
        body: impl Fn(i64) -> Value + Send + 'static,
        then: impl FnOnce(proto::SampleResponse) -> Result<T> + Send + 'static,
    ) -> TrainerFuture<T> {
        let conn = self.conn.clone();
        let seq = self.sample_seq.clone();
        let task = tokio::spawn(async move {
            // The SDK's backpressure contract: a 429 means back off and
            // resubmit (the submit's retry does).
            let headers = [("X-Tinker-Sampling-Backpressure", "1".to_string())];
            for _ in 0..=SAMPLE_RESUBMITS {
                let b = Body::Json(body(seq.fetch_add(1, Ordering::Relaxed)));
                let id = conn.submit("asample", b, &headers).await?;
                match conn.wait(&id, Kind::Sample).await? {
                    Some(Reply::Proto(b)) => {
                        return then(proto::SampleResponse::decode(b.as_slice()).map_err(remote)?)
                    }
                    Some(Reply::Json(v)) => {
                        return Err(remote(format!("asample: expected protobuf, got {v}")))
                    }
                    None => tracing::warn!("the service expired sample {id}; resubmitting"),
                }
            }
            Err(remote(format!(
                "the service expired a sample {} times",
                SAMPLE_RESUBMITS + 1
            )))
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

/// Consecutive ranges of items of `sizes` bytes, each at most `max_len`
/// items and `max_bytes` bytes (an item larger than that goes alone), as
/// the SDK splits a forward_backward; at least one range.
fn chunk_ranges(sizes: &[usize], max_len: usize, max_bytes: usize) -> Vec<std::ops::Range<usize>> {
    let mut out = Vec::new();
    let (mut start, mut size) = (0, 0);
    for (i, &b) in sizes.iter().enumerate() {
        if i > start && (i - start >= max_len || size + b > max_bytes) {
            out.push(start..i);
            (start, size) = (i, 0);
        }
        size += b;
    }
    if start < sizes.len() || out.is_empty() {
        out.push(start..sizes.len());
    }
    out
}

/// One datum as the protocol carries it.
fn proto_datum(d: &Datum) -> proto::Datum {
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
}

/// One `forward_backward` request: `datums` are `data` encoded.
fn encode_forward_backward(
    model_id: &str,
    seq_id: i64,
    data: &[Datum],
    datums: Vec<proto::Datum>,
    loss: &Loss,
    forward_only: bool,
) -> Result<Vec<u8>> {
    if let Loss::Custom(_) = loss {
        return Err(EngineError::InvalidRequest(
            "a custom loss has no server-side forward; use forward_backward".into(),
        ));
    }
    if loss.is_pair() {
        return Err(EngineError::InvalidRequest(format!(
            "loss {loss:?} is a pair loss, which the tinker wire does not carry \
             (Trainer::takes_pair_loss is false here); compute it client-side"
        )));
    }
    let (name, mut config) = (loss.name(), loss.config());
    // The wire carries one scoring temperature per request, in
    // loss_fn_config (temper's extension, see the server): every datum must
    // share it. At 1 (the protocol's own scoring) it is left out, so a
    // service without the extension sees only the SDK's keys.
    let temperature = data.first().and_then(|d| d.loss_fn_inputs.temperature);
    if data
        .iter()
        .any(|d| d.loss_fn_inputs.temperature != temperature)
    {
        return Err(EngineError::InvalidRequest(
            "datums of one forward_backward must share one temperature".into(),
        ));
    }
    if let Some(t) = temperature.filter(|&t| t != 1.0) {
        config.push(("temperature", t));
    }
    Ok(proto::ForwardBackwardRequest {
        model_id: model_id.to_string(),
        seq_id: i32::try_from(seq_id).map_err(|_| remote("seq_id overflow"))?,
        data: datums,
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

/// The outputs of one request's datums, and its metrics.
fn decode_forward_output(reply: Reply) -> Result<(Vec<DatumOutput>, BTreeMap<String, f64>)> {
    let Reply::Proto(bytes) = reply else {
        return Err(remote("forward_backward: expected a protobuf result"));
    };
    let out = proto::ForwardBackwardOutput::decode(bytes.as_slice()).map_err(remote)?;
    let mut outputs = Vec::new();
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
    Ok((outputs, out.metrics.into_iter().collect()))
}

/// The results of the requests one forward(_backward) was split into,
/// joined: outputs in order, metrics reduced by the reduction each key
/// names (`name:sum`, `:mean` weighted by datums, `:min`, `:max`; keys of
/// another reduction are dropped, as the SDK drops them).
fn decode_forward_outputs(replies: Vec<Reply>, n: usize) -> Result<ForwardOutput> {
    let mut outputs = Vec::with_capacity(n);
    let mut parts = Vec::new();
    for r in replies {
        let (o, m) = decode_forward_output(r)?;
        parts.push((o.len() as f64, m));
        outputs.extend(o);
    }
    if outputs.len() != n {
        return Err(remote(format!("{} outputs for {n} datums", outputs.len())));
    }
    let metrics = match parts.len() {
        1 => parts.pop().map(|(_, m)| m).unwrap_or_default(),
        _ => reduce_metrics(&parts),
    };
    Ok(ForwardOutput {
        loss_fn_outputs: outputs,
        metrics,
    })
}

fn reduce_metrics(parts: &[(f64, BTreeMap<String, f64>)]) -> BTreeMap<String, f64> {
    let mut out = BTreeMap::new();
    let Some((_, first)) = parts.first() else {
        return out;
    };
    for key in first.keys() {
        let Some(vals) = parts
            .iter()
            .map(|(w, m)| m.get(key).map(|v| (*w, *v)))
            .collect::<Option<Vec<_>>>()
        else {
            continue;
        };
        let v = match key.rsplit_once(':').map(|(_, r)| r) {
            Some("sum") => vals.iter().map(|(_, v)| v).sum(),
            Some("mean") => {
                let w: f64 = vals.iter().map(|(w, _)| w).sum();
                vals.iter().map(|(w, v)| w * v).sum::<f64>() / w.max(1.0)
            }
            Some("min") => vals.iter().map(|(_, v)| *v).fold(f64::INFINITY, f64::min),
            Some("max") => vals
                .iter()
                .map(|(_, v)| *v)
                .fold(f64::NEG_INFINITY, f64::max),
            _ => continue,
        };
        out.insert(key.clone(), v);
    }
    out
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

fn json_reply(mut replies: Vec<Reply>, what: &str) -> Result<Value> {
    match replies.pop() {
        Some(Reply::Json(v)) => Ok(v),
        _ => Err(remote(format!("{what}: expected one JSON result"))),
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
        self.call(
            "optim_step",
            Kind::OptimStep,
            Ok(vec![Body::Json(body)]),
            move |reply| {
                let v = json_reply(reply, "optim_step")?;
                let m = |k: &str| v["metrics"][k].as_f64();
                Ok(StepStats {
                    grad_norm: m("grad_norm:mean").unwrap_or(f64::NAN),
                    learning_rate: m("learning_rate:mean").unwrap_or(params.learning_rate),
                })
            },
        )
    }

    /// The SDK's `save_weights_and_get_sampling_client`: an unnamed,
    /// ephemeral snapshot with its own sampling session (no checkpoint is
    /// kept on the service; `name` is not sent).
    fn save_weights_for_sampler(&self, _name: &str) -> TrainerFuture<String> {
        let body = json!({
            "model_id": self.model_id,
            "sampling_session_seq_id": self.sampler_seq.fetch_add(1, Ordering::Relaxed),
            "kind": "snapshot", "seq_id": self.next_seq(), "type": "save_weights_for_sampler",
        });
        self.call(
            "save_weights_for_sampler",
            Kind::SaveWeightsForSampler,
            Ok(vec![Body::Json(body)]),
            move |reply| {
                let v = json_reply(reply, "save_weights_for_sampler")?;
                v["sampling_session_id"]
                    .as_str()
                    .map(str::to_string)
                    .ok_or_else(|| remote(format!("save_weights_for_sampler: {v}")))
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
        let sampler = sampler.to_string();
        let sampling = sampling_json(&params);
        let body = move |seq: i64| {
            json!({
                "sampling_session_id": sampler, "seq_id": seq, "num_samples": n,
                "prompt": {"chunks": [{"type": "encoded_text", "tokens": prompt}]},
                "sampling_params": sampling, "prompt_logprobs": false, "type": "sample",
            })
        };
        self.sample_call(body, move |r| {
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
    }

    fn compute_logprobs(
        &self,
        sampler: &str,
        tokens: Vec<u32>,
        temperature: f64,
    ) -> TrainerFuture<Vec<f32>> {
        // Prompt logprobs come back at the request's sampling temperature.
        let sampler = sampler.to_string();
        let body = move |seq: i64| {
            json!({
                "sampling_session_id": sampler, "seq_id": seq, "num_samples": 1,
                "prompt": {"chunks": [{"type": "encoded_text", "tokens": tokens}]},
                "sampling_params": {"max_tokens": 1, "temperature": temperature, "top_k": -1, "top_p": 1.0},
                "prompt_logprobs": true, "type": "sample",
            })
        };
        self.sample_call(body, |r| {
            let lp = r
                .prompt_logprobs
                .as_deref()
                .and_then(proto::le::f32_from)
                .ok_or_else(|| remote("compute_logprobs: no prompt logprobs"))?;
            Ok(lp.into_iter().skip(1).collect())
        })
    }

    fn save_state(&self, name: &str) -> TrainerFuture<String> {
        let body = json!({
            "model_id": self.model_id, "path": name, "seq_id": self.next_seq(),
            "overwrite": true, "type": "save_weights",
        });
        self.call(
            "save_weights",
            Kind::SaveWeights,
            Ok(vec![Body::Json(body)]),
            move |reply| {
                let v = json_reply(reply, "save_weights")?;
                v["path"]
                    .as_str()
                    .map(str::to_string)
                    .ok_or_else(|| remote(format!("save_weights: {v}")))
            },
        )
    }

    fn load_state(&self, path: &str, with_optimizer: bool) -> TrainerFuture<()> {
        let body = json!({
            "model_id": self.model_id, "path": path, "seq_id": self.next_seq(),
            "optimizer": with_optimizer, "type": "load_weights",
        });
        self.call(
            "load_weights",
            Kind::LoadWeights,
            Ok(vec![Body::Json(body)]),
            move |reply| {
                json_reply(reply, "load_weights")?;
                Ok(())
            },
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batches_split_by_datum_count_and_bytes() {
        assert_eq!(chunk_ranges(&[], 4, 100), vec![0..0]);
        assert_eq!(chunk_ranges(&[1; 5], 2, 100), vec![0..2, 2..4, 4..5]);
        assert_eq!(
            chunk_ranges(&[40, 40, 40, 150, 10], 10, 100),
            vec![0..2, 2..3, 3..4, 4..5]
        );
        assert_eq!(chunk_ranges(&[10; 3], 1024, 5_000_000), vec![0..3]);
    }

    #[test]
    fn chunk_metrics_reduce_by_their_named_reduction() {
        let part = |w: f64, kv: &[(&str, f64)]| {
            (
                w,
                kv.iter()
                    .map(|(k, v)| (k.to_string(), *v))
                    .collect::<BTreeMap<_, _>>(),
            )
        };
        let m = reduce_metrics(&[
            part(
                1.0,
                &[
                    ("loss:sum", 2.0),
                    ("x:mean", 1.0),
                    ("y:max", 3.0),
                    ("z:hash2", 1.0),
                ],
            ),
            part(
                3.0,
                &[
                    ("loss:sum", 5.0),
                    ("x:mean", 5.0),
                    ("y:max", 1.0),
                    ("z:hash2", 2.0),
                ],
            ),
        ]);
        assert_eq!(m.get("loss:sum"), Some(&7.0));
        assert_eq!(m.get("x:mean"), Some(&4.0));
        assert_eq!(m.get("y:max"), Some(&3.0));
        assert_eq!(m.get("z:hash2"), None, "unknown reductions are dropped");
    }
}
