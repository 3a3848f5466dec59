//! Request decoding: JSON bodies, and the protobuf datums, losses and
//! forward outputs of the training calls.

use std::collections::HashMap;

use axum::body::Bytes;
use prost::Message;
use serde::Deserialize;
use serde_json::json;
use temper_engine::{Datum, Loss, LossInputs};

use crate::error::ApiError;
use temper_api::proto;

pub(super) fn parse<T: for<'de> Deserialize<'de>>(
    body: &Bytes,
) -> std::result::Result<T, ApiError> {
    serde_json::from_slice(body)
        .map_err(|e| ApiError::BadRequest(format!("invalid JSON body: {e}")))
}

/// Decode one protobuf datum into the engine's form.
pub(super) fn datum_from_proto(d: &proto::Datum) -> std::result::Result<Datum, String> {
    let mut tokens = Vec::new();
    for c in &d.model_input {
        match &c.chunk {
            Some(proto::chunk::Chunk::EncodedText(t)) => tokens
                .extend(proto::le::ids_from_i32(&t.tokens).ok_or("malformed encoded_text tokens")?),
            Some(_) => {
                return Err("only encoded_text chunks are supported (no images or audio)".into())
            }
            None => return Err("empty model_input chunk".into()),
        }
    }
    let mut inputs = LossInputs::default();
    for (name, t) in &d.loss_fn_inputs {
        let dense = match &t.encoding {
            Some(proto::tensor::Encoding::Dense(b)) => b,
            Some(proto::tensor::Encoding::SparseCsr(_)) => {
                return Err(format!(
                    "{name}: sparse tensors are not supported; send 1-D dense"
                ))
            }
            None => return Err(format!("{name}: tensor without data")),
        };
        if t.shape.len() > 1 {
            return Err(format!(
                "{name}: shape {:?}; only 1-D loss inputs are supported",
                t.shape
            ));
        }
        let floats = || -> std::result::Result<Vec<f32>, String> {
            match proto::DType::try_from(t.dtype) {
                Ok(proto::DType::Float32) => {
                    proto::le::f32_from(dense).ok_or(format!("{name}: malformed f32 data"))
                }
                Ok(proto::DType::Int64) => Ok(proto::le::i64_from(dense)
                    .ok_or(format!("{name}: malformed i64 data"))?
                    .into_iter()
                    .map(|x| x as f32)
                    .collect()),
                _ => Err(format!("{name}: unsupported dtype {}", t.dtype)),
            }
        };
        match name.as_str() {
            "target_tokens" => {
                let ids: Vec<i64> = match proto::DType::try_from(t.dtype) {
                    Ok(proto::DType::Int64) => {
                        proto::le::i64_from(dense).ok_or("target_tokens: malformed i64 data")?
                    }
                    Ok(proto::DType::Int32) => proto::le::ids_from_i32(dense)
                        .ok_or("target_tokens: malformed i32 data")?
                        .into_iter()
                        .map(i64::from)
                        .collect(),
                    _ => return Err("target_tokens must be int64".into()),
                };
                inputs.target_tokens = ids
                    .into_iter()
                    .map(|x| u32::try_from(x).map_err(|_| format!("target token {x} out of range")))
                    .collect::<std::result::Result<_, _>>()?;
            }
            "weights" => inputs.weights = Some(finite(name, floats()?)?),
            "logprobs" => inputs.logprobs = Some(finite(name, floats()?)?),
            "advantages" => inputs.advantages = Some(finite(name, floats()?)?),
            "sequence_ratio_mask" => inputs.sequence_ratio_mask = Some(finite(name, floats()?)?),
            // Ignoring them would train with thresholds the client did not ask for.
            "clip_low_threshold" | "clip_high_threshold" => {
                return Err(format!(
                    "per-datum {name} is not supported; set it in loss_fn_config"
                ))
            }
            other => return Err(format!("unsupported loss_fn_inputs key {other:?}")),
        }
    }
    Ok(Datum {
        model_input: tokens,
        loss_fn_inputs: inputs,
    })
}

/// A NaN or inf in a loss input would turn every weight into NaN.
fn finite(name: &str, v: Vec<f32>) -> std::result::Result<Vec<f32>, String> {
    match v.iter().position(|x| !x.is_finite()) {
        Some(i) => Err(format!("{name}[{i}] is {} (inputs must be finite)", v[i])),
        None => Ok(v),
    }
}

/// The loss of a request and its scoring temperature: `loss_fn_config`'s
/// `temperature` (temper's extension of the tinker protocol, which has no
/// temperature on forward_backward) scores every datum at
/// `log softmax(logits / temperature)`, the distribution tokens sampled at
/// that temperature were drawn from. Absent: 1.
pub(super) fn loss_from_proto(
    r: &proto::ForwardBackwardRequest,
) -> std::result::Result<(Loss, Option<f64>), String> {
    let mut cfg = serde_json::Map::new();
    for (k, v) in &r.loss_fn_config {
        cfg.insert(k.clone(), json!(v));
    }
    for (k, v) in &r.loss_fn_config_v2 {
        match &v.value {
            Some(proto::loss_config_value::Value::Number(n)) => {
                cfg.insert(k.clone(), json!(n));
            }
            Some(proto::loss_config_value::Value::Text(t)) => {
                cfg.insert(k.clone(), json!(t));
            }
            None => {}
        }
    }
    let temperature = match cfg.get("temperature") {
        None => None,
        Some(v) => match v.as_f64() {
            Some(t) if t > 0.0 && t.is_finite() => Some(t),
            _ => {
                return Err(format!(
                    "loss_fn_config temperature must be a number > 0, got {v}"
                ))
            }
        },
    };
    let loss = Loss::from_name(&r.loss_fn, &cfg).map_err(|e| e.to_string())?;
    Ok((loss, temperature))
}

pub(super) fn forward_output_proto(out: &temper_engine::ForwardOutput) -> Vec<u8> {
    let mut data = Vec::new();
    let mut offsets = vec![0i64];
    for o in &out.loss_fn_outputs {
        data.extend(proto::le::f32_bytes(&o.logprobs));
        offsets.push(data.len() as i64);
    }
    let mut fields = HashMap::new();
    fields.insert(
        "logprobs".to_string(),
        proto::BatchedTensor {
            data,
            offsets: proto::le::i64_bytes(&offsets),
            dtype: proto::DType::Float32 as i32,
            trailing_shape: vec![],
        },
    );
    let metrics: HashMap<String, f64> = out
        .metrics
        .iter()
        .filter(|(k, _)| k.matches(':').count() == 1)
        .map(|(k, v)| (k.clone(), *v))
        .collect();
    proto::ForwardBackwardOutput {
        loss_fn_output_type: "ArrayRecord".into(),
        loss_fn_outputs: vec![proto::ArrayRecord {
            type_tag: "ArrayRecord".into(),
            fields,
            num_datums: out.loss_fn_outputs.len() as i64,
        }],
        metrics,
    }
    .encode_to_vec()
}
