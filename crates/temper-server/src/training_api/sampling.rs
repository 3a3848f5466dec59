//! Sampling: sampling sessions and `asample`, with their JSON decoding.

use axum::body::Bytes;
use axum::extract::{Path as UrlPath, State};
use axum::Json;
use prost::Message;
use serde::Deserialize;
use serde_json::{json, Value};
use temper_engine::Pending;
use temper_model::{Completion, FinishReason, SamplingParams};

use super::checkpoints::parse_tinker_path;
use super::futures::FutureState;
use super::state::{over_limit, ApiState, Sampler};
use super::wire::parse;
use crate::error::ApiError;
use temper_api::proto;

#[derive(Deserialize)]
struct CreateSamplingSession {
    session_id: String,
    sampling_session_seq_id: i64,
    #[serde(default)]
    model_path: Option<String>,
    #[serde(default)]
    base_model: Option<String>,
}

pub(super) async fn create_sampling_session(
    State(s): State<ApiState>,
    body: Bytes,
) -> Result<Json<Value>, ApiError> {
    let r: CreateSamplingSession = parse(&body)?;
    s.known_session(&r.session_id)?;
    let sid = format!("{}:sample:{}", r.session_id, r.sampling_session_seq_id);
    let sampler = match (&r.model_path, &r.base_model) {
        (Some(path), _) => {
            let (model, kind, _) = parse_tinker_path(path).map_err(ApiError::BadRequest)?;
            if kind != "sampler_weights" {
                return Err(ApiError::BadRequest(format!(
                    "{path}: sampling needs sampler weights (save_weights_for_sampler)"
                )));
            }
            let (_, base, _) = s.model(&model).map_err(ApiError::NotFound)?;
            Sampler {
                key: path.clone(),
                base,
                model_path: Some(path.clone()),
            }
        }
        (None, Some(base)) => {
            if !s.0.bases.contains_key(base) {
                return Err(ApiError::NotFound(format!("unknown base_model {base:?}")));
            }
            let key = format!("base:{base}");
            s.0.engine
                .add_base_sampler(base, &key)
                .await
                .map_err(|e| ApiError::Internal(e.to_string()))?;
            Sampler {
                key,
                base: base.clone(),
                model_path: None,
            }
        }
        (None, None) => return Err(ApiError::BadRequest("give model_path or base_model".into())),
    };
    s.tables().samplers.insert(sid.clone(), sampler);
    Ok(Json(
        json!({"type": "create_sampling_session", "sampling_session_id": sid}),
    ))
}

pub(super) async fn get_sampler(
    State(s): State<ApiState>,
    UrlPath(id): UrlPath<String>,
) -> Result<Json<Value>, ApiError> {
    let t = s.tables();
    let sm = t
        .samplers
        .get(&id)
        .ok_or_else(|| ApiError::NotFound(format!("unknown sampler {id}")))?;
    Ok(Json(
        json!({"sampler_id": id, "base_model": sm.base, "model_path": sm.model_path}),
    ))
}

#[derive(Deserialize)]
struct ModelInputJson {
    chunks: Vec<Value>,
}

#[derive(Deserialize, Default)]
struct SamplingParamsJson {
    #[serde(default)]
    max_tokens: Option<usize>,
    #[serde(default)]
    seed: Option<serde_json::Number>,
    #[serde(default)]
    stop: Option<Value>,
    #[serde(default)]
    temperature: Option<f64>,
    #[serde(default)]
    top_k: Option<i64>,
    #[serde(default)]
    top_p: Option<f64>,
}

#[derive(Deserialize)]
struct ASample {
    sampling_session_id: String,
    #[serde(default)]
    seq_id: Option<i64>,
    #[serde(default = "one")]
    num_samples: usize,
    prompt: ModelInputJson,
    #[serde(default)]
    sampling_params: SamplingParamsJson,
    #[serde(default)]
    prompt_logprobs: bool,
    /// The SDK's options temper does not implement: sent at their defaults
    /// they ask for nothing; set, they are refused by name (see [`refused`]).
    #[serde(default)]
    record_stability_info: Option<bool>,
    #[serde(default)]
    topk_prompt_logprobs: Option<i64>,
    #[serde(default)]
    topk_sample_logprobs: Option<i64>,
    #[serde(default)]
    target_prompt_logprobs: Option<Value>,
    #[serde(default)]
    prompt_alt_tokens_k: Option<i64>,
    #[serde(default)]
    prompt_logprobs_last_n: Option<i64>,
}

/// The first SDK sampling option `r` sets that temper cannot honour, with why;
/// answering without it would hand the client less than it asked for.
fn refused(r: &ASample) -> Option<String> {
    if r.record_stability_info == Some(true) {
        return Some(
            "record_stability_info is not supported: temper records no stability info, as it \
             does not implement stable_reinforce (Tinker has not published its objective); \
             sample without it and train with gspo, ppo, cispo or importance_sampling"
                .into(),
        );
    }
    let set = |v: Option<i64>| v.is_some_and(|k| k != 0);
    for (name, on) in [
        ("topk_prompt_logprobs", set(r.topk_prompt_logprobs)),
        ("topk_sample_logprobs", set(r.topk_sample_logprobs)),
        ("prompt_alt_tokens_k", set(r.prompt_alt_tokens_k)),
        ("prompt_logprobs_last_n", r.prompt_logprobs_last_n.is_some()),
        (
            "target_prompt_logprobs",
            r.target_prompt_logprobs
                .as_ref()
                .is_some_and(|v| !v.is_null()),
        ),
    ] {
        if on {
            return Some(format!(
                "{name} is not supported (temper returns each sampled token's logprob, \
                 and the prompt's with prompt_logprobs)"
            ));
        }
    }
    None
}

fn one() -> usize {
    1
}

fn prompt_tokens(m: &ModelInputJson) -> std::result::Result<Vec<u32>, String> {
    let mut out = Vec::new();
    for c in &m.chunks {
        if c.get("type")
            .and_then(|t| t.as_str())
            .unwrap_or("encoded_text")
            != "encoded_text"
        {
            return Err("only encoded_text chunks are supported".into());
        }
        let toks = c
            .get("tokens")
            .and_then(|t| t.as_array())
            .ok_or("encoded_text chunk without tokens")?;
        for t in toks {
            let id = t
                .as_u64()
                .and_then(|x| u32::try_from(x).ok())
                .ok_or(format!("bad token {t}"))?;
            out.push(id);
        }
    }
    if out.is_empty() {
        return Err("empty prompt".into());
    }
    Ok(out)
}

fn sampling_params(p: &SamplingParamsJson) -> std::result::Result<SamplingParams, String> {
    let mut out = SamplingParams {
        max_tokens: p.max_tokens.unwrap_or(16),
        temperature: p.temperature.unwrap_or(1.0),
        top_p: p.top_p.unwrap_or(1.0),
        top_k: p.top_k.filter(|&k| k > 0).map_or(0, |k| k as usize),
        // Seeds may exceed 2^63: fold them into u64.
        seed: p.seed.as_ref().map(|n| {
            n.as_u64()
                .or_else(|| n.as_i64().map(|x| x as u64))
                .unwrap_or_else(|| n.as_f64().unwrap_or(0.0) as u64)
        }),
        logprobs: true,
        ..Default::default()
    };
    match &p.stop {
        None | Some(Value::Null) => {}
        Some(Value::String(s)) => out.stop = vec![s.clone()],
        Some(Value::Array(a)) if a.is_empty() => out.ignore_eos = true,
        Some(Value::Array(a)) if a.iter().all(|v| v.is_string()) => {
            out.stop = a
                .iter()
                .filter_map(|v| v.as_str().map(str::to_string))
                .collect()
        }
        Some(Value::Array(a)) if a.iter().all(|v| v.is_u64()) => {
            out.ignore_eos = true;
            out.stop_token_ids = a
                .iter()
                .filter_map(|v| v.as_u64().map(|x| x as u32))
                .collect();
        }
        Some(other) => {
            return Err(format!(
                "stop must be a string, strings or token ids, got {other}"
            ))
        }
    }
    out.validate().map_err(|e| e.to_string())?;
    Ok(out)
}

fn sample_response(seqs: &[Completion], prompt_logprobs: Option<Vec<f32>>) -> Vec<u8> {
    proto::SampleResponse {
        sequences: seqs
            .iter()
            .map(|c| proto::SampledSequence {
                stop_reason: match c.finish_reason {
                    FinishReason::Stop => proto::StopReason::Stop as i32,
                    FinishReason::Length => proto::StopReason::Length as i32,
                },
                tokens: proto::le::i32_bytes(&c.tokens),
                logprobs: c.logprobs.as_ref().map(|l| proto::le::f32_bytes(l)),
            })
            .collect(),
        prompt_logprobs: prompt_logprobs.map(|l| proto::le::f32_bytes(&l)),
        prompt_cache_hit_tokens: 0,
    }
    .encode_to_vec()
}

pub(super) async fn asample(
    State(s): State<ApiState>,
    body: Bytes,
) -> Result<Json<Value>, ApiError> {
    let r: ASample = parse(&body)?;
    let max = s.0.config.limits.max_num_samples;
    if r.num_samples > max {
        return Err(over_limit(
            "num_samples",
            r.num_samples,
            max,
            "--max-num-samples",
        ));
    }
    if r.num_samples == 0 {
        return Err(ApiError::BadRequest("num_samples must be >= 1".into()));
    }
    if let Some(why) = refused(&r) {
        return Err(ApiError::BadRequest(why));
    }
    let (key, base) = {
        let t = s.tables();
        let sm = t.samplers.get(&r.sampling_session_id).ok_or_else(|| {
            ApiError::NotFound(format!(
                "unknown sampling_session_id {:?}",
                r.sampling_session_id
            ))
        })?;
        (sm.key.clone(), sm.base.clone())
    };
    let prompt = prompt_tokens(&r.prompt).map_err(ApiError::BadRequest)?;
    let params = sampling_params(&r.sampling_params).map_err(ApiError::BadRequest)?;
    let ctx = s.context_length(&base).map_err(ApiError::Internal)?;
    s.check_vocab(&base, "prompt", &prompt)
        .map_err(ApiError::BadRequest)?;
    if prompt.len() + params.max_tokens > ctx {
        return Err(ApiError::BadRequest(format!(
            "prompt ({} tokens) + max_tokens ({}) exceed the model's context length {ctx}",
            prompt.len(),
            params.max_tokens
        )));
    }
    let owner = format!("sample:{}", r.sampling_session_id);
    let resp = s.dedupe(&owner, r.seq_id, || {
        let seq_ids: Vec<String> = (0..r.num_samples).map(|_| s.next_id("seq")).collect();
        let request_id = {
            let temperature = params.temperature;
            let sample =
                s.0.engine
                    .sample(&key, prompt.clone(), r.num_samples, params);
            // Prompt logprobs at the request's sampling temperature: the
            // distribution its sampled tokens were drawn from (greedy scores
            // at 1, as the sampler reports it).
            let lps: Option<Pending<Vec<f32>>> =
                (r.prompt_logprobs && prompt.len() >= 2).then(|| {
                    s.0.engine
                        .compute_logprobs(&key, prompt.clone(), temperature)
                });
            let want_prompt = r.prompt_logprobs;
            s.spawn_future(async move {
                let seqs = sample.await?;
                let prompt_lp = match lps {
                    Some(p) => {
                        let mut v = vec![f32::NAN];
                        v.extend(p.await?);
                        Some(v)
                    }
                    None if want_prompt => Some(vec![f32::NAN]),
                    None => None,
                };
                Ok(FutureState::Proto(sample_response(&seqs, prompt_lp)))
            })
        };
        json!({"request_id": request_id, "sample_sequence_ids": seq_ids})
    });
    Ok(Json(resp))
}
