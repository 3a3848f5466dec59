//! Response pieces shared by the endpoints: logprobs in the chat and the
//! completions shapes, and `usage`.

use serde_json::{json, Map, Value};
use temper_model::TopLogprobs;

use super::state::OpenAiState;

fn token_text(s: &OpenAiState, id: u32) -> String {
    s.inner
        .model
        .tokenizer
        .decode(&[id], false)
        .unwrap_or_default()
}

/// Chat-style logprobs: `{"content": [{token, logprob, bytes, top_logprobs}]}`.
pub(super) fn chat_logprobs(s: &OpenAiState, tokens: &[u32], lp: &TopLogprobs) -> Value {
    let entry = |id: u32, logprob: f32| {
        let t = token_text(s, id);
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
) -> Value {
    let mut offset = text_start;
    let mut toks = Vec::new();
    let mut offsets = Vec::new();
    for &id in tokens {
        let t = token_text(s, id);
        offsets.push(offset);
        offset += t.len();
        toks.push(t);
    }
    let token_logprobs: Vec<Value> = lp.iter().map(|e| json!(e.as_ref().map(|x| x.0))).collect();
    let top: Vec<Value> = lp
        .iter()
        .map(|e| match e {
            None => Value::Null,
            Some((_, top)) => {
                let mut m = Map::new();
                for &(t, l) in top {
                    m.insert(token_text(s, t), json!(l));
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
