//! `/v1/generate`: token ids in, token ids and logprobs out (for RL).

use std::time::Instant;

use axum::body::Bytes;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::json;

use super::error::OpenAiError;
use super::protocol::{max_tokens_field, parse_body, GenerateRequest};

use super::jobs::{collect, prepare, score, submit};
use super::response::usage;
use super::state::{now_secs, OpenAiState};

pub(super) async fn generate(
    State(s): State<OpenAiState>,
    body: Bytes,
) -> Result<Response, OpenAiError> {
    let started = Instant::now();
    let req: GenerateRequest = parse_body(&body)?;
    let sampling = req.sampling.clone().check(&s.inner.defaults)?;
    let max_tokens = max_tokens_field("max_tokens", req.max_tokens)?;
    let mut p = prepare(
        &s,
        &req.model,
        vec![req.prompt_token_ids],
        sampling,
        max_tokens,
        Some(16),
        "prompt",
    )?;
    // Every choice carries its logprobs (RL trains on them).
    p.logprobs = true;
    let rx = submit(&s, &p, false)?;
    let done = collect(&s, rx, p.total_choices(), started).await?;
    let mut choices = Vec::with_capacity(done.len());
    let mut completion_tokens = 0;
    for f in done {
        completion_tokens += f.tokens.len();
        let r = score(
            &s,
            p.adapter.clone(),
            &p.prompts[0],
            &f,
            p.sampling.params.temperature,
            0,
            false,
        )
        .await?;
        choices.push(json!({
            "index": f.index, "token_ids": f.tokens, "logprobs": r.logprobs, "text": f.text,
            "finish_reason": f.finish_reason.as_str(),
        }));
    }
    Ok(Json(json!({
        "id": s.request_id("gen"), "object": "generation", "created": now_secs(),
        "model": p.model_name, "version": p.version, "system_fingerprint": p.fingerprint(),
        "choices": choices, "usage": usage(p.prompt_tokens(), completion_tokens),
    }))
    .into_response())
}
