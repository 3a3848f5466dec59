//! `/v1/completions`: text or token prompts, `echo`, completions-style
//! logprobs.

use std::time::Instant;

use axum::body::Bytes;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};

use super::error::OpenAiError;
use super::protocol::{
    max_tokens_field, parse_body, top_logprobs_field, CompletionRequest, PromptInput,
};

use super::capture::{self, EpisodeTag};
use super::jobs::{collect, prepare, submit};
use super::response::{completion_logprobs, usage, TokenEntry};
use super::state::{now_secs, OpenAiState};
use super::streaming::{sse, StreamKind};

pub(super) async fn completions(
    State(s): State<OpenAiState>,
    episode: EpisodeTag,
    body: Bytes,
) -> Result<Response, OpenAiError> {
    let started = Instant::now();
    let req: CompletionRequest = parse_body(&body)?;
    let sampling = req.sampling.clone().check(&s.inner.defaults)?;
    if req.suffix.is_some() {
        return Err(OpenAiError::invalid("suffix", "suffix is not supported"));
    }
    if req.best_of.is_some_and(|b| b != sampling.n as i64) {
        return Err(OpenAiError::invalid(
            "best_of",
            "best_of must equal n when given",
        ));
    }
    let max_tokens = max_tokens_field("max_tokens", req.max_tokens)?;
    let top = top_logprobs_field("logprobs", req.logprobs)?;
    let vllm = req.vllm.clone().check()?;
    let tok = &s.inner.model.tokenizer;
    let encode = |t: &str| {
        tok.encode(t, true)
            .map_err(|e| OpenAiError::invalid("prompt", format!("tokenizing: {e}")))
    };
    let (prompts, texts): (Vec<Vec<u32>>, Vec<Option<String>>) = match req.prompt {
        PromptInput::Text(t) => (vec![encode(&t)?], vec![Some(t)]),
        PromptInput::Texts(ts) => {
            let mut ids = Vec::new();
            for t in &ts {
                ids.push(encode(t)?);
            }
            (ids, ts.into_iter().map(Some).collect())
        }
        PromptInput::Ids(ids) => (vec![ids], vec![None]),
        PromptInput::IdLists(l) => {
            let n = l.len();
            (l, vec![None; n])
        }
    };
    if prompts.is_empty() {
        return Err(OpenAiError::invalid(
            "prompt",
            "the prompt must not be empty",
        ));
    }
    let mut p = prepare(
        &s,
        &req.model,
        prompts,
        sampling,
        max_tokens,
        Some(16),
        "prompt",
    )?;
    p.logprobs = req.logprobs.is_some();
    p.top_logprobs = top;
    p.capture = episode.completion();
    p.vllm = vllm;
    let echo = req.echo.unwrap_or(false);
    let stream = req.stream.unwrap_or(false);
    if stream && echo {
        return Err(OpenAiError::invalid(
            "echo",
            "echo is not supported with stream",
        ));
    }
    let rx = submit(&s, &p, stream)?;
    let id = s.request_id("cmpl");
    if stream {
        let include_usage = req.stream_options.is_some_and(|o| o.include_usage);
        return Ok(sse(
            s.clone(),
            rx,
            p,
            StreamKind::Completion,
            id,
            include_usage,
            started,
        ));
    }
    let done = collect(&s, rx, p.total_choices(), started).await?;
    let mut choices = Vec::with_capacity(done.len());
    let mut completion_tokens = 0;
    for f in done {
        completion_tokens += f.tokens.len();
        let pi = f.index / p.sampling.n;
        let prompt = &p.prompts[pi];
        let prompt_text = if echo {
            match &texts[pi] {
                Some(t) => t.clone(),
                None => tok
                    .decode(prompt, false)
                    .map_err(|e| OpenAiError::Internal(format!("decoding: {e}")))?,
            }
        } else {
            String::new()
        };
        let scores = capture::score_choice(&s, &p, &f, echo && p.logprobs).await?;
        capture::record(
            &s,
            &p,
            &id,
            &f,
            f.finish_reason.as_str(),
            scores.as_ref(),
            json!({"text": f.text}),
        )?;
        let lp = if let (true, Some(r)) = (p.logprobs, scores) {
            let entries: Vec<TokenEntry> = if echo {
                std::iter::once(None)
                    .chain(r.logprobs.iter().zip(r.top).map(|(&l, t)| Some((l, t))))
                    .collect()
            } else {
                r.logprobs
                    .iter()
                    .zip(r.top)
                    .map(|(&l, t)| Some((l, t)))
                    .collect()
            };
            let toks: Vec<u32> = if echo {
                prompt.iter().chain(&f.tokens).copied().collect()
            } else {
                f.tokens.clone()
            };
            completion_logprobs(&s, &toks, &entries, 0, p.vllm.tokens_as_ids)
        } else {
            Value::Null
        };
        let mut choice = json!({
            "index": f.index, "text": format!("{prompt_text}{}", f.text), "logprobs": lp,
            "finish_reason": f.finish_reason.as_str(),
        });
        if p.vllm.return_token_ids {
            choice["prompt_token_ids"] = json!(prompt);
            choice["token_ids"] = json!(f.tokens);
        }
        choices.push(choice);
    }
    let mut body = json!({
        "id": id, "object": "text_completion", "created": now_secs(), "model": p.model_name,
        "system_fingerprint": p.fingerprint(), "version": p.version, "choices": choices,
        "usage": usage(p.prompt_tokens(), completion_tokens),
    });
    if let Some(c) = &p.capture {
        // Names the episode a reward (`POST /v1/episodes/ID/reward`) goes to.
        body["episode"] = json!(c.episode);
    }
    Ok(Json(body).into_response())
}
