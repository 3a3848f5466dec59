//! `tokenizer.json` through the `tokenizers` crate, plus the special tokens
//! and chat template of `tokenizer_config.json` / `chat_template.jinja`.

use std::path::Path;

use crate::chat::ChatTemplate;
use crate::error::{ModelError, Result};

/// A model's tokenizer and the special tokens generation stops on.
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    bos_token: Option<String>,
    eos_token: Option<String>,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("vocab_size", &self.inner.get_vocab_size(true))
            .field("bos_token", &self.bos_token)
            .field("eos_token", &self.eos_token)
            .finish()
    }
}

/// A special token in `tokenizer_config.json`: a string or `{"content": ...}`.
fn token_str(v: Option<&serde_json::Value>) -> Option<String> {
    match v? {
        serde_json::Value::String(s) => Some(s.clone()),
        serde_json::Value::Object(o) => o.get("content")?.as_str().map(str::to_string),
        _ => None,
    }
}

impl Tokenizer {
    /// Load `tokenizer.json` and `tokenizer_config.json` (optional) from a
    /// model directory.
    pub fn from_dir(dir: &Path) -> Result<Self> {
        let path = dir.join("tokenizer.json");
        if !path.exists() {
            return Err(ModelError::MissingFile {
                path,
                hint: "temper needs the fast-tokenizer file tokenizer.json".into(),
            });
        }
        let inner =
            tokenizers::Tokenizer::from_file(&path).map_err(|e| ModelError::bad(&path, e))?;
        let cfg = read_tokenizer_config(dir)?;
        Ok(Self {
            inner,
            bos_token: token_str(cfg.get("bos_token")),
            eos_token: token_str(cfg.get("eos_token")),
        })
    }

    /// Wrap an in-memory `tokenizers` tokenizer (e.g. one built in code).
    pub fn from_inner(
        inner: tokenizers::Tokenizer,
        bos_token: Option<String>,
        eos_token: Option<String>,
    ) -> Self {
        Self {
            inner,
            bos_token,
            eos_token,
        }
    }

    /// Token ids of `text`; `add_special_tokens` applies the tokenizer's
    /// post-processor (e.g. a BOS token), as transformers does by default.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        let enc = self
            .inner
            .encode(text, add_special_tokens)
            .map_err(|e| ModelError::Tokenizer(e.to_string()))?;
        Ok(enc.get_ids().to_vec())
    }

    /// Text of `ids`.
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String> {
        self.inner
            .decode(ids, skip_special_tokens)
            .map_err(|e| ModelError::Tokenizer(e.to_string()))
    }

    /// Id of a token string, if it is in the vocabulary.
    pub fn token_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// The BOS token string from `tokenizer_config.json`.
    pub fn bos_token(&self) -> Option<&str> {
        self.bos_token.as_deref()
    }

    /// The EOS token string from `tokenizer_config.json`.
    pub fn eos_token(&self) -> Option<&str> {
        self.eos_token.as_deref()
    }

    /// Vocabulary size including added tokens.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// The underlying `tokenizers` tokenizer.
    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }
}

fn read_tokenizer_config(dir: &Path) -> Result<serde_json::Map<String, serde_json::Value>> {
    let path = dir.join("tokenizer_config.json");
    if !path.exists() {
        return Ok(serde_json::Map::new());
    }
    let text = std::fs::read_to_string(&path).map_err(|e| ModelError::io(&path, e))?;
    let v: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| ModelError::bad(&path, e))?;
    match v {
        serde_json::Value::Object(o) => Ok(o),
        _ => Err(ModelError::bad(&path, "expected a JSON object")),
    }
}

/// The chat template of a model directory: `chat_template.jinja` (what
/// transformers >= 4.43 writes), else `chat_template` in
/// `tokenizer_config.json` (a string, or a list of named templates of which
/// `default` is used). `None` when the model has none (base models).
pub fn load_chat_template(dir: &Path, tokenizer: &Tokenizer) -> Result<Option<ChatTemplate>> {
    chat_template_source(dir)?
        .map(|s| {
            ChatTemplate::new(
                &s,
                tokenizer.bos_token().map(str::to_string),
                tokenizer.eos_token().map(str::to_string),
            )
        })
        .transpose()
}

/// The chat template's Jinja source in a model directory (see
/// [`load_chat_template`]), or in a GGUF file (`tokenizer.chat_template`).
pub fn chat_template_source(dir: &Path) -> Result<Option<String>> {
    if crate::formats::gguf::is_gguf(dir) {
        return Ok(crate::formats::gguf::GgufFile::open(dir)?.chat_template());
    }
    let jinja = dir.join("chat_template.jinja");
    if jinja.exists() {
        return Ok(Some(
            std::fs::read_to_string(&jinja).map_err(|e| ModelError::io(&jinja, e))?,
        ));
    }
    let cfg = read_tokenizer_config(dir)?;
    Ok(match cfg.get("chat_template") {
        Some(serde_json::Value::String(s)) => Some(s.clone()),
        Some(serde_json::Value::Array(list)) => list
            .iter()
            .find(|t| t.get("name").and_then(|n| n.as_str()) == Some("default"))
            .or_else(|| list.first())
            .and_then(|t| t.get("template"))
            .and_then(|t| t.as_str())
            .map(str::to_string),
        _ => None,
    })
}
