//! Response pieces shared by the endpoints: logprobs in the chat and the
//! completions shapes, `usage`, and the schema keywords a structured output
//! left unenforced.

use axum::http::HeaderValue;
use axum::response::Response;
use serde_json::{json, Map, Value};
use temper_model::TopLogprobs;

use super::jobs::Prepared;
use super::state::OpenAiState;

/// The response field naming the schema keywords a lenient structured
/// output did not enforce (absent when every keyword was).
pub(super) const UNENFORCED_FIELD: &str = "unenforced_schema_keywords";
/// The response header saying the same, comma-separated.
pub(super) const UNENFORCED_HEADER: &str = "x-temper-unenforced-schema-keywords";

/// The schema keywords `p`'s grammar leaves unenforced (empty: none, or
/// no grammar).
pub(super) fn unenforced(p: &Prepared) -> Vec<String> {
    p.grammar
        .as_ref()
        .map(|g| g.unenforced().to_vec())
        .unwrap_or_default()
}

/// Set [`UNENFORCED_FIELD`] on a response object when keywords were left
/// unenforced.
pub(super) fn mark_unenforced(u: &[String], body: &mut Value) {
    if !u.is_empty() {
        body[UNENFORCED_FIELD] = json!(u);
    }
}

/// Add [`UNENFORCED_HEADER`] to `r` when keywords were left unenforced
/// (characters a header cannot carry become `?`).
pub(super) fn unenforced_header(u: &[String], mut r: Response) -> Response {
    if u.is_empty() {
        return r;
    }
    let text: String = u
        .join(", ")
        .chars()
        .map(|c| {
            if c == ' ' || c.is_ascii_graphic() {
                c
            } else {
                '?'
            }
        })
        .collect();
    if let Ok(v) = HeaderValue::from_str(&text) {
        r.headers_mut().insert(UNENFORCED_HEADER, v);
    }
    r
}

/// A token as logprobs name it: its text, or with `as_id` (vLLM's
/// `return_tokens_as_token_ids`) `token_id:<id>`, which names tokens whose
/// bytes are not valid UTF-8 on their own.
pub(super) fn token_text(s: &OpenAiState, id: u32, as_id: bool) -> String {
    if as_id {
        return format!("token_id:{id}");
    }
    s.inner
        .model
        .tokenizer
        .decode(&[id], false)
        .unwrap_or_default()
}

/// Chat-style logprobs: `{"content": [{token, logprob, bytes, top_logprobs}]}`.
pub(super) fn chat_logprobs(
    s: &OpenAiState,
    tokens: &[u32],
    lp: &TopLogprobs,
    as_ids: bool,
) -> Value {
    let entry = |id: u32, logprob: f32| {
        let t = token_text(s, id, as_ids);
        json!({"token": t, "logprob": logprob, "bytes": t.as_bytes()})
    };
    let content: Vec<Value> = tokens
        .iter()
        .zip(&lp.logprobs)
        .zip(&lp.top)
        .map(|((&id, &logprob), top)| {
            let mut e = entry(id, logprob);
            e["top_logprobs"] = Value::Array(top.iter().map(|&(t, l)| entry(t, l)).collect());
            e
        })
        .collect();
    json!({"content": content})
}

/// A token's logprob and its top alternatives (`None`: the first prompt token).
pub(super) type TokenEntry = Option<(f32, Vec<(u32, f32)>)>;

/// Completions-style logprobs over `tokens` (with `first_is_prompt_start`,
/// the first token has no logprob: nothing precedes it).
pub(super) fn completion_logprobs(
    s: &OpenAiState,
    tokens: &[u32],
    lp: &[TokenEntry],
    text_start: usize,
    as_ids: bool,
) -> Value {
    let mut offset = text_start;
    let mut toks = Vec::new();
    let mut offsets = Vec::new();
    for &id in tokens {
        // Offsets count the text, whatever names the tokens.
        let t = token_text(s, id, false);
        offsets.push(offset);
        offset += t.len();
        toks.push(if as_ids { token_text(s, id, true) } else { t });
    }
    let token_logprobs: Vec<Value> = lp.iter().map(|e| json!(e.as_ref().map(|x| x.0))).collect();
    let top: Vec<Value> = lp
        .iter()
        .map(|e| match e {
            None => Value::Null,
            Some((_, top)) => {
                let mut m = Map::new();
                for &(t, l) in top {
                    m.insert(token_text(s, t, as_ids), json!(l));
                }
                Value::Object(m)
            }
        })
        .collect();
    json!({"tokens": toks, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets})
}

pub(super) fn usage(prompt: usize, completion: usize) -> Value {
    json!({"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion})
}
