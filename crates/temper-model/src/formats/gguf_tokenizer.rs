//! Tokenizers between GGUF and Hugging Face, both ways: a GGUF's
//! `tokenizer.ggml.*` metadata rebuilt as a `tokenizer.json` (as
//! transformers' GGUF loader does; [`GgufFile::tokenizer`]), and a
//! byte-level BPE `tokenizer.json` written as `tokenizer.ggml.*` metadata
//! for GGUF export. Apart from the GGUF reader so that reading a GGUF does
//! not depend on the tokenizer, nor the tokenizer on the GGUF reader's
//! internals.

use std::collections::{HashMap, HashSet};
use std::path::Path;

use candle_core::quantized::gguf_file::Value;
use serde_json::{json, Map as JsonMap, Value as Json};

use crate::error::{ModelError, Result};
use crate::formats::gguf::{is_gguf, meta_f64, meta_u64, GgufFile};
use crate::tokenizer::{chat_template_source, Tokenizer};

impl GgufFile {
    /// The tokenizer described by `tokenizer.ggml.*`, built as transformers'
    /// GGUF loader builds it: byte-level BPE (`gpt2`) with the split regex of
    /// `tokenizer.ggml.pre`, or SentencePiece BPE (`llama`) with byte
    /// fallback; control tokens special, user-defined tokens added.
    pub fn tokenizer(&self) -> Result<Tokenizer> {
        let json = self.tokenizer_json()?;
        let text = serde_json::to_string(&json).map_err(|e| ModelError::bad(&self.path, e))?;
        let inner: tokenizers::Tokenizer = text
            .parse()
            .map_err(|e| ModelError::bad(&self.path, format!("GGUF tokenizer: {e}")))?;
        let tokens = self.tokens()?;
        let tok = |key: &str| {
            self.metadata(key)
                .and_then(meta_u64)
                .and_then(|id| tokens.get(id as usize).cloned())
        };
        Ok(Tokenizer::from_inner(
            inner,
            tok("tokenizer.ggml.bos_token_id"),
            tok("tokenizer.ggml.eos_token_id"),
        ))
    }

    fn tokens(&self) -> Result<Vec<String>> {
        self.string_array("tokenizer.ggml.tokens")?
            .ok_or_else(|| ModelError::bad(&self.path, "GGUF has no tokenizer.ggml.tokens"))
    }

    fn string_array(&self, key: &str) -> Result<Option<Vec<String>>> {
        match self.metadata(key) {
            None => Ok(None),
            Some(Value::Array(a)) => a
                .iter()
                .map(|v| match v {
                    Value::String(s) => Ok(s.clone()),
                    _ => Err(ModelError::bad(&self.path, format!("{key}: not strings"))),
                })
                .collect::<Result<Vec<_>>>()
                .map(Some),
            Some(_) => Err(ModelError::bad(&self.path, format!("{key}: not an array"))),
        }
    }

    fn flag(&self, key: &str) -> Option<bool> {
        match self.metadata(key) {
            Some(Value::Bool(b)) => Some(*b),
            _ => None,
        }
    }

    /// The tokenizer as a `tokenizer.json` document.
    pub fn tokenizer_json(&self) -> Result<Json> {
        let kind = match self.metadata("tokenizer.ggml.model") {
            Some(Value::String(s)) => s.clone(),
            _ => {
                return Err(ModelError::bad(
                    &self.path,
                    "GGUF has no tokenizer.ggml.model",
                ))
            }
        };
        let tokens = self.tokens()?;
        let types: Vec<u64> = match self.metadata("tokenizer.ggml.token_type") {
            Some(Value::Array(a)) => a
                .iter()
                .map(|v| {
                    meta_u64(v).ok_or_else(|| {
                        ModelError::bad(&self.path, format!("tokenizer.ggml.token_type: {v:?}"))
                    })
                })
                .collect::<Result<_>>()?,
            _ => Vec::new(),
        };
        let merges_file = self.string_array("tokenizer.ggml.merges")?;
        let byte_level = kind == "gpt2";
        let (vocab_tokens, model, pre, decoder, add_bos_default) = match kind.as_str() {
            "gpt2" => {
                let spelled: Vec<String> = tokens.iter().map(|t| byte_level_spelling(t)).collect();
                let merges = merges_file.ok_or_else(|| {
                    ModelError::bad(&self.path, "byte-level GGUF tokenizer without merges")
                })?;
                let model = json!({
                    "type": "BPE", "dropout": null, "unk_token": null,
                    "continuing_subword_prefix": "", "end_of_word_suffix": "",
                    "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
                    "vocab": vocab_map(&spelled), "merges": split_merges(&merges, &self.path)?,
                });
                let pre = match self.metadata("tokenizer.ggml.pre") {
                    Some(Value::String(p)) => split_regex(p),
                    _ => None,
                };
                let pre = match pre {
                    Some(re) => json!({"type": "Sequence", "pretokenizers": [
                        {"type": "Split", "pattern": {"Regex": re}, "behavior": "Isolated", "invert": false},
                        {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false},
                    ]}),
                    None => {
                        json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true})
                    }
                };
                let decoder = json!({"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true});
                (spelled, model, pre, decoder, false)
            }
            "llama" => {
                let merges = match merges_file {
                    Some(m) => split_merges(&m, &self.path)?,
                    None => {
                        let scores: Vec<f64> =
                            match self.metadata("tokenizer.ggml.scores") {
                                Some(Value::Array(a)) => a
                                    .iter()
                                    .map(|v| {
                                        meta_f64(v).ok_or_else(|| {
                                            ModelError::bad(
                                                &self.path,
                                                format!("tokenizer.ggml.scores: {v:?}"),
                                            )
                                        })
                                    })
                                    .collect::<Result<_>>()?,
                                _ => return Err(ModelError::bad(
                                    &self.path,
                                    "SentencePiece GGUF tokenizer with neither merges nor scores",
                                )),
                            };
                        merges_from_scores(&tokens, &scores)
                    }
                };
                let model = json!({
                    "type": "BPE", "dropout": null, "unk_token": null,
                    "continuing_subword_prefix": null, "end_of_word_suffix": null,
                    "fuse_unk": true, "byte_fallback": true, "ignore_merges": false,
                    "vocab": vocab_map(&tokens), "merges": merges,
                });
                let pre = json!({"type": "Metaspace", "replacement": "\u{2581}", "prepend_scheme": "first", "split": false});
                let decoder = json!({"type": "Sequence", "decoders": [
                    {"type": "Replace", "pattern": {"String": "\u{2581}"}, "content": " "},
                    {"type": "ByteFallback"},
                    {"type": "Fuse"},
                    {"type": "Strip", "content": " ", "start": 1, "stop": 0},
                ]});
                (tokens.clone(), model, pre, decoder, true)
            }
            other => {
                return Err(ModelError::UnsupportedConfig(format!(
                    "GGUF tokenizer model {other:?} (supported: gpt2, llama)"
                )))
            }
        };
        // Control tokens are special (skipped when a byte-level vocabulary
        // spells them outside its alphabet: a llama.cpp mislabel), then
        // user-defined ones are added as plain tokens.
        let alphabet: HashSet<char> = byte_alphabet().into_iter().collect();
        let mut added: Vec<(u32, String, bool)> = Vec::new();
        let mut seen = HashSet::new();
        for (i, (t, ty)) in tokens.iter().zip(&types).enumerate() {
            if *ty == 3
                && (!byte_level || t.chars().all(|c| alphabet.contains(&c)))
                && seen.insert(t.clone())
            {
                added.push((i as u32, vocab_tokens[i].clone(), true));
            }
        }
        for (i, (t, ty)) in tokens.iter().zip(&types).enumerate() {
            if *ty == 4 && seen.insert(t.clone()) {
                added.push((i as u32, vocab_tokens[i].clone(), false));
            }
        }
        let added: Vec<Json> = added
            .into_iter()
            .map(|(id, content, special)| {
                json!({"id": id, "content": content, "single_word": false, "lstrip": false,
                       "rstrip": false, "normalized": false, "special": special})
            })
            .collect();
        let add_bos = self
            .flag("tokenizer.ggml.add_bos_token")
            .unwrap_or(add_bos_default);
        let add_eos = self.flag("tokenizer.ggml.add_eos_token").unwrap_or(false);
        let special = |key: &str| -> Result<Option<(String, u32)>> {
            match self.metadata(key).and_then(meta_u64) {
                None => Ok(None),
                Some(id) => vocab_tokens
                    .get(id as usize)
                    .map(|t| Some((t.clone(), id as u32)))
                    .ok_or_else(|| ModelError::bad(&self.path, format!("{key} {id} out of range"))),
            }
        };
        let bos = if add_bos {
            special("tokenizer.ggml.bos_token_id")?
        } else {
            None
        };
        let eos = if add_eos {
            special("tokenizer.ggml.eos_token_id")?
        } else {
            None
        };
        Ok(json!({
            "version": "1.0", "truncation": null, "padding": null,
            "added_tokens": added,
            "normalizer": null,
            "pre_tokenizer": pre,
            "post_processor": template_processor(bos.as_ref(), eos.as_ref()),
            "decoder": decoder,
            "model": model,
        }))
    }
}

/// transformers' `update_post_processor`: `[BOS] $A [EOS]`, pairs likewise.
fn template_processor(bos: Option<&(String, u32)>, eos: Option<&(String, u32)>) -> Json {
    let piece =
        |t: &(String, u32), type_id: u32| json!({"SpecialToken": {"id": t.0, "type_id": type_id}});
    let seq = |id: &str, type_id: u32| json!({"Sequence": {"id": id, "type_id": type_id}});
    let mut single = Vec::new();
    let mut pair = Vec::new();
    for (out, parts) in [
        (&mut single, vec![("A", 0)]),
        (&mut pair, vec![("A", 0), ("B", 1)]),
    ] {
        for (id, type_id) in parts {
            if let Some(b) = bos {
                out.push(piece(b, type_id));
            }
            out.push(seq(id, type_id));
            if let Some(e) = eos {
                out.push(piece(e, type_id));
            }
        }
    }
    let mut specials = JsonMap::new();
    for t in [bos, eos].into_iter().flatten() {
        specials.insert(
            t.0.clone(),
            json!({"id": t.0, "ids": [t.1], "tokens": [t.0]}),
        );
    }
    json!({"type": "TemplateProcessing", "single": single, "pair": pair, "special_tokens": specials})
}

fn vocab_map(tokens: &[String]) -> Json {
    let mut m = JsonMap::new();
    for (i, t) in tokens.iter().enumerate() {
        m.insert(t.clone(), json!(i));
    }
    Json::Object(m)
}

fn split_merges(merges: &[String], path: &Path) -> Result<Json> {
    merges
        .iter()
        .map(|m| match m.split_once(' ') {
            Some((a, b)) if !a.is_empty() && !b.is_empty() && !b.contains(' ') => Ok(json!([a, b])),
            _ => Err(ModelError::bad(
                path,
                format!("tokenizer.ggml.merges entry {m:?} is not two tokens"),
            )),
        })
        .collect::<Result<Vec<_>>>()
        .map(Json::Array)
}

/// transformers' `generate_merges` with scores: every split of every token
/// into two vocabulary pieces, best score first.
fn merges_from_scores(tokens: &[String], scores: &[f64]) -> Json {
    let mut vocab: HashMap<&str, usize> = HashMap::new();
    for (i, t) in tokens.iter().enumerate() {
        vocab.insert(t.as_str(), i);
    }
    // dict(zip(tokens, scores)): first position, last score.
    let mut order: Vec<&str> = Vec::new();
    let mut score_of: HashMap<&str, f64> = HashMap::new();
    for (t, s) in tokens.iter().zip(scores) {
        if score_of.insert(t.as_str(), *s).is_none() {
            order.push(t.as_str());
        }
    }
    let mut merges: Vec<(&str, &str, f64)> = Vec::new();
    for t in order {
        let score = score_of[t];
        let mut local: Vec<(&str, &str, f64)> = Vec::new();
        // Python slices by code point.
        let bounds: Vec<usize> = t.char_indices().map(|(i, _)| i).skip(1).collect();
        for b in bounds {
            let (l, r) = t.split_at(b);
            if vocab.contains_key(l) && vocab.contains_key(r) {
                local.push((l, r, score));
            }
        }
        local.sort_by_key(|x| (vocab[x.0], vocab[x.1]));
        merges.extend(local);
    }
    // sorted(key=(score, len(l), len(r)), reverse=True), stable.
    merges.sort_by(|a, b| {
        let ka = (a.2, a.0.chars().count(), a.1.chars().count());
        let kb = (b.2, b.0.chars().count(), b.1.chars().count());
        kb.0.partial_cmp(&ka.0)
            .unwrap_or(std::cmp::Ordering::Equal)
            .then(kb.1.cmp(&ka.1))
            .then(kb.2.cmp(&ka.2))
    });
    Json::Array(merges.into_iter().map(|(l, r, _)| json!([l, r])).collect())
}

/// GPT-2's byte → printable-character table (`bytes_to_unicode`).
fn byte_alphabet() -> Vec<char> {
    let mut table = vec!['\0'; 256];
    let mut n = 0u32;
    for b in 0..256u32 {
        let printable =
            (33..=126).contains(&b) || (161..=172).contains(&b) || (174..=255).contains(&b);
        let c = if printable {
            b
        } else {
            n += 1;
            255 + n
        };
        table[b as usize] = char::from_u32(c).unwrap_or('\0');
    }
    table
}

/// A byte-level token as the vocabulary spells it: unchanged when every
/// character is in the byte alphabet, else its UTF-8 bytes respelled.
fn byte_level_spelling(token: &str) -> String {
    let table = byte_alphabet();
    let alphabet: HashSet<char> = table.iter().copied().collect();
    if token.chars().all(|c| alphabet.contains(&c)) {
        token.to_string()
    } else {
        token.bytes().map(|b| table[b as usize]).collect()
    }
}

const LLAMA3_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const QWEN2_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const QWEN35_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const TEKKEN_SPLIT: &str = r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const GPT4O_SPLIT: &str = r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// The split regex transformers' GGUF loader uses for a `tokenizer.ggml.pre`
/// value; `None` keeps GPT-2's byte-level regex (e.g. `smollm`, `gpt2`).
fn split_regex(pre: &str) -> Option<&'static str> {
    Some(match pre {
        "llama3" | "llama-v3" | "llama-bpe" | "falcon3" | "falcon-h1" | "pixtral" | "midm-2.0"
        | "lfm2" | "jina-v5-nano" | "dbrx" | "smaug-bpe" => LLAMA3_SPLIT,
        "tekken" => TEKKEN_SPLIT,
        "qwen2" | "deepseek-r1-qwen" | "kormo" | "f2llmv2" | "megrez" => QWEN2_SPLIT,
        "qwen35" => QWEN35_SPLIT,
        "gpt-4o" | "llama4" | "kanana2" | "talkie" | "minimax-m2" => GPT4O_SPLIT,
        _ => return None,
    })
}

fn strings(v: Vec<String>) -> Value {
    Value::Array(v.into_iter().map(Value::String).collect())
}

/// `tokenizer.ggml.*` metadata for the tokenizer `tok` of the model at
/// `dir`: copied from its GGUF, or converted from its byte-level BPE
/// `tokenizer.json` (`eos_token_ids`: the generation config's, the EOS
/// when the tokenizer names none).
pub(crate) fn tokenizer_metadata(
    dir: &Path,
    tok: &Tokenizer,
    eos_token_ids: &[u32],
    vocab_size: usize,
) -> Result<Vec<(String, Value)>> {
    if is_gguf(dir) {
        let g = GgufFile::open(dir)?;
        return Ok(g.tokenizer_metadata());
    }
    let path = dir.join("tokenizer.json");
    let text = std::fs::read_to_string(&path).map_err(|e| ModelError::io(&path, e))?;
    let tj: Json = serde_json::from_str(&text).map_err(|e| ModelError::bad(&path, e))?;
    let unsupported = |why: &str| {
        ModelError::UnsupportedConfig(format!(
            "GGUF export of this tokenizer ({why}); supported: byte-level BPE (GPT-2, Llama 3, Qwen2, SmolLM style)"
        ))
    };
    let model = &tj["model"];
    if model["type"] != "BPE" || tj["decoder"]["type"] != "ByteLevel" {
        return Err(unsupported("not byte-level BPE"));
    }
    let pre = &tj["pre_tokenizer"];
    let pre_name = match pre["type"].as_str() {
        // llama.cpp's name for GPT-2's split ("gpt2" is refused as unknown).
        Some("ByteLevel") if pre["use_regex"] != json!(false) => "gpt-2",
        Some("Sequence") => {
            let parts = pre["pretokenizers"].as_array().cloned().unwrap_or_default();
            match parts.as_slice() {
                [a, b] if a["type"] == "Split" && b["type"] == "ByteLevel" => {
                    match a["pattern"]["Regex"].as_str() {
                        Some(r) if r == QWEN2_SPLIT => "qwen2",
                        Some(r) if r == LLAMA3_SPLIT => "llama-bpe",
                        _ => return Err(unsupported("unknown split regex")),
                    }
                }
                [a, b] if a["type"] == "Digits" && b["type"] == "ByteLevel" => "smollm",
                _ => return Err(unsupported("unknown pre-tokenizer sequence")),
            }
        }
        _ => return Err(unsupported("unknown pre-tokenizer")),
    };
    let mut tokens: Vec<Option<String>> = vec![None; vocab_size];
    let mut types = vec![1i32; vocab_size];
    let vocab = model["vocab"]
        .as_object()
        .ok_or_else(|| ModelError::bad(&path, "model.vocab"))?;
    let mut put = |id: u64, tok: &str, ty: i32| -> Result<()> {
        let slot = tokens.get_mut(id as usize).ok_or_else(|| {
            ModelError::UnsupportedConfig(format!(
                "token id {id} beyond the model's vocab_size {vocab_size}"
            ))
        })?;
        *slot = Some(tok.to_string());
        types[id as usize] = ty;
        Ok(())
    };
    for (tok, id) in vocab {
        let id = id
            .as_u64()
            .ok_or_else(|| ModelError::bad(&path, format!("vocab id of {tok:?}")))?;
        put(id, tok, 1)?;
    }
    for a in tj["added_tokens"].as_array().cloned().unwrap_or_default() {
        let ty = if a["special"] == json!(true) { 3 } else { 4 };
        let (Some(id), Some(content)) = (a["id"].as_u64(), a["content"].as_str()) else {
            return Err(ModelError::bad(&path, format!("added token {a}")));
        };
        put(id, content, ty)?;
    }
    let mut tokens_out = Vec::with_capacity(vocab_size);
    for (i, t) in tokens.into_iter().enumerate() {
        match t {
            Some(t) => tokens_out.push(t),
            None => {
                tokens_out.push(format!("[PAD{i}]"));
                types[i] = 5; // unused
            }
        }
    }
    let merges: Vec<String> = model["merges"]
        .as_array()
        .cloned()
        .unwrap_or_default()
        .into_iter()
        .map(|m| match &m {
            Json::String(s) => Ok(s.clone()),
            Json::Array(p) => match (
                p.first().and_then(|x| x.as_str()),
                p.get(1).and_then(|x| x.as_str()),
            ) {
                (Some(a), Some(b)) => Ok(format!("{a} {b}")),
                _ => Err(ModelError::bad(&path, format!("merge {m}"))),
            },
            _ => Err(ModelError::bad(&path, format!("merge {m}"))),
        })
        .collect::<Result<_>>()?;
    let add_bos = tj["post_processor"]
        .pointer("/single/0/SpecialToken")
        .is_some()
        || tj["post_processor"]["processors"]
            .as_array()
            .is_some_and(|ps| {
                ps.iter()
                    .any(|p| p.pointer("/single/0/SpecialToken").is_some())
            });
    let mut meta = vec![
        (
            "tokenizer.ggml.model".to_string(),
            Value::String("gpt2".into()),
        ),
        (
            "tokenizer.ggml.pre".to_string(),
            Value::String(pre_name.into()),
        ),
        ("tokenizer.ggml.tokens".to_string(), strings(tokens_out)),
        (
            "tokenizer.ggml.token_type".to_string(),
            Value::Array(types.into_iter().map(Value::I32).collect()),
        ),
        ("tokenizer.ggml.merges".to_string(), strings(merges)),
        (
            "tokenizer.ggml.add_bos_token".to_string(),
            Value::Bool(add_bos),
        ),
    ];
    if let Some(id) = tok.bos_token().and_then(|t| tok.token_id(t)) {
        meta.push(("tokenizer.ggml.bos_token_id".into(), Value::U32(id)));
    }
    if let Some(id) = tok
        .eos_token()
        .and_then(|t| tok.token_id(t))
        .or_else(|| eos_token_ids.first().copied())
    {
        meta.push(("tokenizer.ggml.eos_token_id".into(), Value::U32(id)));
    }
    if let Some(t) = chat_template_source(dir)? {
        meta.push(("tokenizer.chat_template".into(), Value::String(t)));
    }
    Ok(meta)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_level_spelling_respells_only_foreign_characters() {
        assert_eq!(byte_level_spelling("Ġhello"), "Ġhello");
        assert_eq!(byte_level_spelling("<|im_end|>"), "<|im_end|>");
        // A space is not in the alphabet: respelled as Ġ.
        assert_eq!(byte_level_spelling("a b"), "aĠb");
    }

    #[test]
    fn merges_from_scores_prefer_higher_scores() {
        let tokens: Vec<String> = ["a", "b", "c", "ab", "bc", "abc"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        let m = merges_from_scores(&tokens, &[0., 0., 0., -1., -2., -0.5]);
        assert_eq!(m, json!([["ab", "c"], ["a", "bc"], ["a", "b"], ["b", "c"]]));
    }
}
