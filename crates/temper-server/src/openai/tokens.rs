//! `POST /inference/v1/generate`: vLLM's token-in / token-out route, with
//! vLLM's request and response shapes, so trainers that drive vLLM as their
//! sampler (verifiers' train client, as prime-rl runs it) can drive temper.
//!
//! The request is `{"token_ids": [...], "sampling_params": {...}, "model"?,
//! "request_id"?, "cache_salt"?, "return_token_ids"?}`; `sampling_params`
//! is vLLM's `SamplingParams`: omitted fields take vLLM's defaults
//! (temperature 1, top_p 1, no top-k; `max_tokens`: the rest of the
//! context), not the model's generation config, as on vLLM. The answer
//! holds token ids only (no text): per choice `token_ids`, `finish_reason`,
//! `stop_reason` (the stop token id or string; null for EOS and length) and,
//! when `sampling_params.logprobs` is set, `logprobs.content[i] = {"token":
//! "token_id:<id>", "logprob", "bytes": null, "top_logprobs"}`, where
//! `top_logprobs` lists the sampled token first and then the most likely
//! others, `max(logprobs, 1)` entries in all (vLLM's order).

use std::time::Instant;

use axum::body::Bytes;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};
use temper_model::FinishReason;

use super::error::OpenAiError;
use super::jobs::{collect, prepare, score, Extensions};
use super::protocol::{
    cache_salt_field, max_tokens_field, parse_body, parse_value, top_logprobs_field,
    SamplingDefaults, TokensRequest, TokensSampling,
};
use super::response::usage;
use super::state::{now_secs, OpenAiState};
use crate::scheduler::Finished;

/// vLLM's floor for reported logprobs (its clients read exactly this value
/// as "no evidence", so a real logprob never equals it).
const LOGPROB_FLOOR: f32 = -9999.0;

pub(super) async fn generate_tokens(
    State(s): State<OpenAiState>,
    body: Bytes,
) -> Result<Response, OpenAiError> {
    let started = Instant::now();
    let req: TokensRequest = parse_body(&body)?;
    if req.stream == Some(true) {
        return Err(OpenAiError::invalid(
            "stream",
            "streaming is not implemented on /inference/v1/generate; send stream: false",
        ));
    }
    if req.stream_options.as_ref().is_some_and(|v| !v.is_null()) {
        return Err(OpenAiError::invalid(
            "stream_options",
            "stream_options needs stream, which this route does not implement",
        ));
    }
    for (field, v) in [
        ("features", &req.features),
        ("content_parts", &req.content_parts),
        ("kv_transfer_params", &req.kv_transfer_params),
    ] {
        if v.as_ref().is_some_and(|v| !v.is_null()) {
            return Err(OpenAiError::invalid(
                field,
                format!(
                    "{field} is not supported: this server serves text-only models on one process"
                ),
            ));
        }
    }
    if let Some(p) = req.priority.filter(|&p| p != 0) {
        return Err(OpenAiError::invalid(
            "priority",
            format!(
                "priority {p} needs priority scheduling, which this server does not do; send 0"
            ),
        ));
    }
    if !req.sampling_params.is_object() {
        return Err(OpenAiError::invalid(
            "sampling_params",
            "sampling_params must be an object",
        ));
    }
    let sp: TokensSampling = parse_value(req.sampling_params, "sampling_params.")?;
    // vLLM's SamplingParams defaults, not the model's generation config.
    let sampling = sp.sampling.check(&SamplingDefaults::default())?;
    let max_tokens = max_tokens_field("max_tokens", sp.max_tokens)?;
    let top = top_logprobs_field("logprobs", sp.logprobs)?;
    let model = req.model.unwrap_or_else(|| s.inner.cfg.model_name.clone());
    let mut p = prepare(
        &s,
        &model,
        vec![req.token_ids],
        sampling,
        max_tokens,
        None,
        "prompt",
    )?;
    p.logprobs = sp.logprobs.is_some();
    p.top_logprobs = top;
    p.vllm = Extensions {
        cache_salt: cache_salt_field(req.cache_salt)?,
        return_token_ids: req.return_token_ids.unwrap_or(false),
        tokens_as_ids: true,
    };
    let rx = super::jobs::submit(&s, &p, false)?;
    let done = collect(&s, rx, p.total_choices(), started).await?;
    let eos = &s.inner.model.generation.eos_token_ids;
    let mut choices = Vec::with_capacity(done.len());
    let mut completion_tokens = 0;
    for f in done {
        completion_tokens += f.tokens.len();
        let logprobs = if p.logprobs {
            let r = score(
                &s,
                p.adapter.clone(),
                &p.prompts[0],
                &f,
                p.sampling.params.temperature,
                top,
                false,
            )
            .await?;
            let content: Vec<Value> = f
                .tokens
                .iter()
                .zip(&r.logprobs)
                .zip(&r.top)
                .map(|((&id, &lp), alts)| {
                    let mut ranked = vec![(id, lp)];
                    ranked.extend(alts.iter().copied().filter(|&(t, _)| t != id));
                    ranked.truncate(top.max(1));
                    let top_logprobs: Vec<Value> =
                        ranked.into_iter().map(|(t, l)| entry(t, l)).collect();
                    let mut e = entry(id, lp);
                    e["top_logprobs"] = Value::Array(top_logprobs);
                    e
                })
                .collect();
            json!({"content": content})
        } else {
            Value::Null
        };
        choices.push(json!({
            "index": f.index, "logprobs": logprobs, "finish_reason": f.finish_reason.as_str(),
            "stop_reason": stop_reason(&f, &p.sampling.params, eos, &s)?, "token_ids": f.tokens,
            "routed_experts": null,
        }));
    }
    let request_id = format!(
        "generate-tokens-{}",
        req.request_id.unwrap_or_else(|| s.request_id("gen"))
    );
    let mut body = json!({
        "request_id": request_id, "created": now_secs(), "model": p.model_name,
        "version": p.version, "system_fingerprint": p.fingerprint(), "choices": choices,
        "usage": usage(p.prompt_tokens(), completion_tokens), "prompt_logprobs": null,
        "kv_transfer_params": null,
    });
    if p.vllm.return_token_ids {
        body["prompt_token_ids"] = json!(p.prompts[0]);
    }
    Ok(Json(body).into_response())
}

fn entry(id: u32, logprob: f32) -> Value {
    json!({"token": format!("token_id:{id}"), "logprob": logprob.max(LOGPROB_FLOOR), "bytes": null})
}

/// vLLM's `stop_reason`: the stop token id or stop string that ended the
/// sample; null when it ended on EOS or its length.
fn stop_reason(
    f: &Finished,
    params: &temper_model::SamplingParams,
    eos: &[u32],
    s: &OpenAiState,
) -> Result<Value, OpenAiError> {
    if f.finish_reason != FinishReason::Stop {
        return Ok(Value::Null);
    }
    let Some(&last) = f.tokens.last() else {
        return Ok(Value::Null);
    };
    if !params.ignore_eos && eos.contains(&last) {
        return Ok(Value::Null);
    }
    if params.stop_token_ids.contains(&last) {
        return Ok(json!(last));
    }
    // A stop string: the one the text was cut before.
    let full = s
        .inner
        .model
        .tokenizer
        .decode(&f.tokens, params.skip_special_tokens)
        .map_err(|e| OpenAiError::Internal(format!("decoding: {e}")))?;
    let rest = full.get(f.text.len()..).unwrap_or("");
    Ok(params
        .stop
        .iter()
        .find(|stop| rest.starts_with(stop.as_str()))
        .map_or(Value::Null, |stop| json!(stop)))
}
