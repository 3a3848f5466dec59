//! Training calls: `forward_backward` and `optim_step`.

use axum::body::Bytes;
use axum::extract::State;
use axum::Json;
use prost::Message;
use serde::Deserialize;
use serde_json::{json, Value};
use temper_engine::AdamParams;

use super::futures::FutureState;
use super::state::{over_limit, ApiState};
use super::wire::{datum_from_proto, forward_output_proto, loss_from_proto, parse};
use crate::error::ApiError;
use temper_api::proto;

pub(super) async fn forward_backward(
    State(s): State<ApiState>,
    body: Bytes,
) -> Result<Json<Value>, ApiError> {
    let r = proto::ForwardBackwardRequest::decode(body.as_ref()).map_err(|e| {
        ApiError::BadRequest(format!("invalid ForwardBackwardRequest protobuf: {e}"))
    })?;
    let data = r
        .data
        .iter()
        .enumerate()
        .map(|(i, d)| datum_from_proto(d).map_err(|e| format!("datum {i}: {e}")))
        .collect::<std::result::Result<Vec<_>, _>>()
        .map_err(ApiError::BadRequest)?;
    let total: usize = data.iter().map(|d| d.model_input.len()).sum();
    let max = s.0.config.limits.max_batch_tokens;
    if total > max {
        return Err(over_limit(
            "forward_backward tokens",
            total,
            max,
            "--max-batch-tokens",
        ));
    }
    let resp = s.dedupe(&r.model_id, Some(r.seq_id as i64), || {
        let prepared = (|| {
            let (run, base, _) = s.model(&r.model_id)?;
            let ctx = s.context_length(&base)?;
            if let Some((i, d)) = data
                .iter()
                .enumerate()
                .find(|(_, d)| d.model_input.len() > ctx)
            {
                return Err(format!(
                    "datum {i}: {} tokens exceed the model's context length {ctx}",
                    d.model_input.len()
                ));
            }
            for (i, d) in data.iter().enumerate() {
                s.check_vocab(&base, &format!("datum {i} model_input"), &d.model_input)?;
                s.check_vocab(
                    &base,
                    &format!("datum {i} target_tokens"),
                    &d.loss_fn_inputs.target_tokens,
                )?;
            }
            let (loss, temperature) = loss_from_proto(&r)?;
            let mut data = data;
            for d in &mut data {
                d.loss_fn_inputs.temperature = temperature;
            }
            Ok::<_, String>((run, data, loss))
        })();
        let request_id = match prepared {
            Err(e) => s.failed_future(e),
            Ok((run, data, loss)) => {
                let pending = if r.forward_only {
                    s.0.engine.forward(&run, data, loss)
                } else {
                    s.0.engine.forward_backward(&run, data, loss)
                };
                s.spawn_future(async move {
                    let out = pending.await?;
                    Ok(FutureState::Proto(forward_output_proto(&out)))
                })
            }
        };
        json!({"request_id": request_id, "model_id": r.model_id})
    });
    Ok(Json(resp))
}

#[derive(Deserialize)]
struct OptimStep {
    model_id: String,
    #[serde(default)]
    seq_id: Option<i64>,
    #[serde(default, alias = "optim_params", alias = "optimizer_params")]
    adam_params: Option<AdamParams>,
}

pub(super) async fn optim_step(
    State(s): State<ApiState>,
    body: Bytes,
) -> Result<Json<Value>, ApiError> {
    let r: OptimStep = parse(&body)?;
    let resp = s.dedupe(&r.model_id, r.seq_id, || {
        let request_id = match s.model(&r.model_id) {
            Err(e) => s.failed_future(e),
            Ok((run, _, _)) => {
                let pending = s.0.engine.optim_step(&run, r.adam_params.unwrap_or_default());
                s.spawn_future(async move {
                    let st = pending.await?;
                    Ok(FutureState::Json(json!({
                        "type": "optim_step",
                        "metrics": {"grad_norm:mean": st.grad_norm, "learning_rate:mean": st.learning_rate},
                    })))
                })
            }
        };
        json!({"request_id": request_id, "model_id": r.model_id})
    });
    Ok(Json(resp))
}
