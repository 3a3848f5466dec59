//! Structured outputs: a JSON schema (or a Hermes tool call whose arguments
//! follow a schema) compiled by `llguidance` into a per-step token mask.
//!
//! The scheduler asks a sample's [`Grammar`] for the tokens allowed next,
//! draws among them ([`temper_model::decode::next_token_masked`]), and
//! advances the grammar with the drawn token. When the grammar is complete
//! only the model's EOS tokens are allowed, so a finished constrained sample
//! ends with EOS (`finish_reason` `stop`); `max_tokens` reached first gives
//! `length` and an incomplete document.
//!
//! The token environment is built from the model's own `tokenizers`
//! tokenizer (HF `tokenizer.json`, or the one built from GGUF metadata) with
//! llguidance's `token_bytes_from_tokenizer_json`; we do not use
//! `toktrie_hf_tokenizers` because it pins `tokenizers` 0.21, a second copy
//! beside the workspace's 0.22 that could not take our tokenizer object.

use std::sync::Arc;

use llguidance::api::TopLevelGrammar;
use llguidance::earley::SlicedBiasComputer;
use llguidance::toktrie::{
    InferenceCapabilities, SimpleVob, TokEnv, TokRxInfo, TokTrie, TokenId, TokenizerEnv,
};
use llguidance::{Matcher, ParserFactory};
use serde_json::{json, Value};
use temper_model::Tokenizer;

/// Why structured output could not be set up or continued.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StructuredError {
    /// The model's tokenizer cannot back a token mask (e.g. an unknown
    /// decoder type, or no EOS token).
    #[error("structured outputs are unavailable for this model: {0}")]
    Unavailable(String),
    /// The schema or grammar does not compile (an unsupported keyword, a bad
    /// `$ref`, an unsatisfiable schema, a limit of [`MAX_PATTERN_PROPERTIES`]
    /// or of the engine exceeded, ...): the request's fault.
    #[error("{0}")]
    Compile(String),
    /// The grammar failed while generating: an engine limit exhausted by the
    /// request's schema (llguidance names it), so the request's fault.
    #[error("the grammar failed while generating: {0}")]
    Step(String),
}

/// What a request constrains its output to.
#[derive(Debug, Clone, PartialEq)]
pub enum Constraint {
    /// A JSON document valid under this JSON schema (an object).
    JsonSchema(Value),
    /// One Hermes tool call, `<tool_call>\n{"name": ..., "arguments":
    /// ...}\n</tool_call>`, its JSON valid under this schema (an object).
    ToolCall(Value),
}

/// JSON layout options forced on every schema: the separators of Python's
/// `json.dumps` and no free whitespace. Free whitespace would let a model
/// pad a document with spaces and newlines until `max_tokens`; fixed
/// separators keep a valid document finite and still natural to models.
fn layout() -> Value {
    json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "})
}

/// `schema` with [`layout`] set; a client's own `x-guidance` (llguidance's
/// option key) is refused rather than silently overridden.
fn with_layout(schema: &Value) -> Result<Value, StructuredError> {
    let Value::Object(m) = schema else {
        return Err(StructuredError::Compile(format!(
            "the schema must be a JSON object, got {schema}"
        )));
    };
    if m.contains_key("x-guidance") {
        return Err(StructuredError::Compile(
            "unsupported schema keyword `x-guidance`".into(),
        ));
    }
    let mut m = m.clone();
    m.insert("x-guidance".into(), layout());
    Ok(Value::Object(m))
}

/// Most `patternProperties` patterns in one schema: llguidance checks every
/// pair of an object's patterns for overlap, so compile time grows faster
/// than the square of their number: 64 take 0.1 s, 128 0.4 s, 500 168 s
/// (on a 2-core box).
pub const MAX_PATTERN_PROPERTIES: usize = 64;

/// Most characters a `pattern`'s counted repetition may stand for, unrolled
/// (`a{1000}` is 1,000, `(a{100}){100}` 10,000, `a+` 1). llguidance's lexer
/// works in proportion to it on every token: 10,000 costs about 15 ms a
/// step, 100,000 about 90 ms (on a 2-core box), on the engine's thread that
/// every request shares; `((a{1000}){1000}){1000}` stalled it for 3.6 s.
pub const MAX_PATTERN_REPETITION: u64 = 10_000;

/// Characters `h` stands for, counted repetitions unrolled (saturating).
fn unrolled(h: &regex_syntax::hir::Hir) -> u64 {
    use regex_syntax::hir::HirKind;
    match h.kind() {
        HirKind::Empty | HirKind::Look(_) => 0,
        HirKind::Literal(l) => l.0.len() as u64,
        HirKind::Class(_) => 1,
        HirKind::Repetition(r) => {
            let times = r.max.unwrap_or(r.min).max(r.min).max(1);
            unrolled(&r.sub).max(1).saturating_mul(u64::from(times))
        }
        HirKind::Capture(c) => unrolled(&c.sub),
        HirKind::Concat(v) | HirKind::Alternation(v) => {
            v.iter().map(unrolled).fold(0, u64::saturating_add)
        }
    }
}

/// The largest repetition in `pattern`, unrolled; 0 when the Rust regex
/// parser cannot read it (llguidance then judges it alone).
fn largest_repetition(pattern: &str) -> u64 {
    fn walk(h: &regex_syntax::hir::Hir, most: &mut u64) {
        use regex_syntax::hir::HirKind;
        match h.kind() {
            HirKind::Repetition(r) => {
                *most = (*most).max(unrolled(h));
                walk(&r.sub, most);
            }
            HirKind::Capture(c) => walk(&c.sub, most),
            HirKind::Concat(v) | HirKind::Alternation(v) => v.iter().for_each(|x| walk(x, most)),
            _ => {}
        }
    }
    let mut most = 0;
    if let Ok(h) = regex_syntax::parse(pattern) {
        walk(&h, &mut most);
    }
    most
}

/// Refuses what the engine would spend unbounded time on, before compiling:
/// too many `patternProperties` patterns in all (every object's and
/// `$defs`' counted, so merged objects cannot exceed it either), and a
/// `pattern` (or `patternProperties` key) whose counted repetitions unroll
/// past [`MAX_PATTERN_REPETITION`].
fn check_cost(schema: &Value) -> Result<(), StructuredError> {
    fn walk(v: &Value, n: &mut usize) -> Result<(), StructuredError> {
        match v {
            Value::Object(m) => {
                let mut patterns: Vec<&str> = Vec::new();
                if let Some(Value::String(p)) = m.get("pattern") {
                    patterns.push(p);
                }
                if let Some(Value::Object(pp)) = m.get("patternProperties") {
                    *n += pp.len();
                    patterns.extend(pp.keys().map(String::as_str));
                }
                for p in patterns {
                    let size = largest_repetition(p);
                    if size > MAX_PATTERN_REPETITION {
                        return Err(StructuredError::Compile(format!(
                            "the pattern {:?} repeats {size} characters once unrolled; the \
                             limit is {MAX_PATTERN_REPETITION} (nested counted repetitions \
                             multiply)",
                            p.chars().take(80).collect::<String>()
                        )));
                    }
                }
                m.values().try_for_each(|x| walk(x, n))
            }
            Value::Array(a) => a.iter().try_for_each(|x| walk(x, n)),
            _ => Ok(()),
        }
    }
    let mut n = 0;
    walk(schema, &mut n)?;
    if n > MAX_PATTERN_PROPERTIES {
        return Err(StructuredError::Compile(format!(
            "the schema has {n} `patternProperties` patterns; the limit is \
             {MAX_PATTERN_PROPERTIES} (each pair is checked for overlap at compile time)"
        )));
    }
    Ok(())
}

impl Constraint {
    /// The schema constrained to.
    fn schema(&self) -> &Value {
        match self {
            Constraint::JsonSchema(s) | Constraint::ToolCall(s) => s,
        }
    }

    /// A digest naming this constraint exactly (the cache key of compiled
    /// grammars): its kind and its schema's JSON text.
    pub fn digest(&self) -> [u8; 32] {
        use sha2::{Digest, Sha256};
        let kind: &[u8] = match self {
            Constraint::JsonSchema(_) => b"json_schema\0",
            Constraint::ToolCall(_) => b"tool_call\0",
        };
        let mut h = Sha256::new();
        h.update(kind);
        h.update(self.schema().to_string().as_bytes());
        h.finalize().into()
    }

    fn grammar(&self) -> Result<TopLevelGrammar, StructuredError> {
        check_cost(self.schema())?;
        match self {
            Constraint::JsonSchema(s) => Ok(TopLevelGrammar::from_json_schema(with_layout(s)?)),
            Constraint::ToolCall(s) => {
                // The tags are lark string literals: they match the tag's own
                // token when the vocabulary has one (Qwen's `<tool_call>`
                // is a plain added token) or its spelling otherwise.
                let body = serde_json::to_string(&with_layout(s)?)
                    .map_err(|e| StructuredError::Compile(e.to_string()))?;
                Ok(TopLevelGrammar::from_lark(format!(
                    "start: \"<tool_call>\\n\" body \"\\n</tool_call>\"\nbody: %json {body}\n"
                )))
            }
        }
    }
}

/// The model's vocabulary as llguidance sees it: every token's bytes in a
/// trie, and tokenization through the model's tokenizer.
struct TokenEnv {
    trie: TokTrie,
    tokenizer: tokenizers::Tokenizer,
}

impl TokenizerEnv for TokenEnv {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        self.trie.tokenize_with_greedy_fallback(s, |text| {
            match self.tokenizer.encode(text, false) {
                Ok(enc) => enc.get_ids().to_vec(),
                // Only a hint for llguidance (mask computation does not
                // tokenize); the trie's greedy split is a valid tokenization.
                Err(_) => self.trie.greedy_tokenize(text.as_bytes()),
            }
        })
    }
}

/// Compiles constraints for one model; built once per server, on the first
/// structured request.
pub struct GrammarCompiler {
    factory: ParserFactory,
}

impl std::fmt::Debug for GrammarCompiler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GrammarCompiler")
            .field("vocab", &self.factory.tok_env().tok_trie().vocab_size())
            .finish()
    }
}

impl GrammarCompiler {
    /// The token environment of `tokenizer` for logits of `vocab` entries;
    /// `eos` are the ids that end a sequence (allowed once the grammar is
    /// complete).
    pub fn new(tokenizer: &Tokenizer, vocab: usize, eos: &[u32]) -> Result<Self, StructuredError> {
        let unavailable = |m: String| StructuredError::Unavailable(m);
        let json = serde_json::to_value(tokenizer.inner())
            .map_err(|e| unavailable(format!("serializing the tokenizer: {e}")))?;
        // llguidance's reader asserts on malformed byte-fallback token names;
        // a panic here must not take the server down.
        let bytes = std::panic::catch_unwind(|| llguidance::token_bytes_from_tokenizer_json(&json))
            .map_err(|_| unavailable("reading the vocabulary panicked".into()))?
            .map_err(|e| unavailable(format!("{e}")))?;
        let mut bytes = bytes;
        let size = vocab.max(bytes.len());
        // Ids the tokenizer does not spell (padding rows of the embedding)
        // become named special tokens that no grammar can produce.
        for (id, b) in bytes.iter_mut().enumerate() {
            if b.is_empty() {
                *b = special_name(id);
            }
        }
        while bytes.len() < size {
            let id = bytes.len();
            bytes.push(special_name(id));
        }
        let eos: Vec<TokenId> = eos
            .iter()
            .copied()
            .filter(|&t| (t as usize) < size)
            .collect();
        let Some(&first) = eos.first() else {
            return Err(unavailable(
                "the model has no EOS token to end a constrained sample".into(),
            ));
        };
        let trie = TokTrie::from(&TokRxInfo::new(size as u32, first), &bytes).with_eos_tokens(&eos);
        let env: TokEnv = Arc::new(TokenEnv {
            trie,
            tokenizer: tokenizer.inner().clone(),
        });
        let mut factory = ParserFactory::new(
            &env,
            InferenceCapabilities::default(),
            &SlicedBiasComputer::general_slices(),
        )
        .map_err(|e| unavailable(format!("{e}")))?;
        // Errors come back as values; llguidance's own stderr logging would
        // only duplicate them, and its verbose errors append the parser's
        // state and the grammar (kilobytes per failed request, in the
        // client's answer and the log).
        factory.quiet();
        factory.limits_mut().verbose_errors = false;
        Ok(Self { factory })
    }

    /// Compile `c` into a fresh grammar state, and compute its first mask
    /// here rather than on the engine's thread: a grammar that fails there
    /// (no document satisfies the schema, or an engine limit is hit) is a
    /// compile error, and the work is done once for every sample.
    pub fn compile(&self, c: &Constraint) -> Result<Grammar, StructuredError> {
        let grammar = c.grammar()?;
        let parser = self
            .factory
            .create_parser(grammar)
            .map_err(|e| StructuredError::Compile(engine_message(e)))?;
        let mut matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(StructuredError::Compile(engine_message(e)));
        }
        let first = matcher.compute_mask_or_eos().map_err(|e| {
            let e = engine_message(e);
            if e.contains("NoExtensionBias") {
                StructuredError::Compile(format!(
                    "no document satisfies the schema (a `$ref` cycle with no way out?): {e}"
                ))
            } else {
                StructuredError::Compile(format!("the grammar fails at its first token: {e}"))
            }
        })?;
        if first.is_zero() {
            return Err(StructuredError::Compile(
                "no document satisfies the schema: no token can start one".into(),
            ));
        }
        Ok(Grammar { matcher })
    }
}

/// An llguidance error's first line (without verbose errors it still ends
/// with a `<non-verbose/>` marker line).
fn engine_message(e: impl std::fmt::Display) -> String {
    let e = e.to_string();
    e.lines().next().unwrap_or_default().trim().to_string()
}

fn special_name(id: usize) -> Vec<u8> {
    let mut b = format!(".<[{id}]>").into_bytes();
    b[0] = TokTrie::SPECIAL_TOKEN_MARKER;
    b
}

/// One sample's grammar state.
pub struct Grammar {
    matcher: Matcher,
}

impl std::fmt::Debug for Grammar {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Grammar")
            .field("stopped", &self.matcher.is_stopped())
            .finish()
    }
}

/// The tokens a grammar allows next.
pub struct TokenMask(SimpleVob);

impl TokenMask {
    /// Whether token `id` is allowed.
    pub fn allows(&self, id: usize) -> bool {
        id < self.0.len() && self.0.get(id)
    }
}

impl Grammar {
    /// An independent copy in the same state (one per sample of `n`).
    pub fn fork(&self) -> Self {
        Self {
            matcher: self.matcher.deep_clone(),
        }
    }

    /// The tokens allowed next: only EOS once the grammar is complete.
    pub fn mask(&mut self) -> Result<TokenMask, StructuredError> {
        self.matcher
            .compute_mask_or_eos()
            .map(TokenMask)
            .map_err(|e| StructuredError::Step(engine_message(e)))
    }

    /// Advance past `token` (drawn from [`Grammar::mask`]).
    pub fn advance(&mut self, token: u32) -> Result<(), StructuredError> {
        self.matcher
            .consume_token(token)
            .map_err(|e| StructuredError::Step(engine_message(e)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;

    fn compiler() -> (Tokenizer, GrammarCompiler) {
        let dir =
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/models/tiny-qwen3");
        let tok = Tokenizer::from_dir(&dir).expect("tokenizer");
        let c = GrammarCompiler::new(&tok, 1024, &[995]).expect("compiler");
        (tok, c)
    }

    /// Feeding a document token by token: every token is in the mask, and
    /// after it only EOS is.
    #[test]
    fn a_valid_document_passes_the_mask_and_then_only_eos() {
        let (tok, c) = compiler();
        let schema = json!({"type": "object", "properties": {"ok": {"type": "boolean"}},
                            "required": ["ok"], "additionalProperties": false});
        let mut g = c.compile(&Constraint::JsonSchema(schema)).expect("compile");
        for t in tok.encode("{\"ok\": true}", false).expect("encode") {
            assert!(g.mask().expect("mask").allows(t as usize), "token {t}");
            g.advance(t).expect("advance");
        }
        let m = g.mask().expect("mask");
        let allowed: Vec<usize> = (0..1024).filter(|&i| m.allows(i)).collect();
        assert_eq!(allowed, vec![995]);
    }

    /// The mask refuses what the schema forbids: a space before the key
    /// (fixed layout) and a key that is not in the schema.
    #[test]
    fn the_mask_refuses_off_schema_tokens() {
        let (tok, c) = compiler();
        let schema = json!({"type": "object", "properties": {"ok": {"type": "boolean"}},
                            "required": ["ok"], "additionalProperties": false});
        let mut g = c.compile(&Constraint::JsonSchema(schema)).expect("compile");
        let open = tok.encode("{", false).expect("encode");
        for &t in &open {
            g.advance(t).expect("advance");
        }
        let m = g.mask().expect("mask");
        let space = tok.token_id("Ġ").expect("space token");
        assert!(!m.allows(space as usize));
        let quote = tok.token_id("\"").expect("quote token");
        assert!(m.allows(quote as usize));
        assert!(!m.allows(995), "EOS inside an object");
    }

    /// The GGUF path: SmolLM2's tokenizer as built from GGUF metadata backs
    /// a mask over its 49,152 tokens (CI sets `TEMPER_SMOLLM2_GGUF`).
    #[test]
    fn smollm2_gguf_tokenizer_backs_a_mask() {
        let Some(path) = std::env::var_os("TEMPER_SMOLLM2_GGUF") else {
            eprintln!("SKIPPED: set TEMPER_SMOLLM2_GGUF (scripts/fetch_smollm2.sh)");
            return;
        };
        let tok = temper_model::GgufFile::open(std::path::Path::new(&path))
            .and_then(|f| f.tokenizer())
            .expect("GGUF tokenizer");
        let eos = tok.token_id("<|im_end|>").expect("<|im_end|>");
        let started = std::time::Instant::now();
        let c = GrammarCompiler::new(&tok, 49152, &[eos]).expect("compiler");
        let built = started.elapsed();
        let schema = json!({"type": "object", "additionalProperties": false,
            "required": ["category", "urgent"],
            "properties": {"category": {"enum": ["billing", "bug"]}, "urgent": {"type": "boolean"}}});
        let mut g = c.compile(&Constraint::JsonSchema(schema)).expect("compile");
        let doc = tok
            .encode("{\"category\": \"billing\", \"urgent\": false}", false)
            .expect("encode");
        let started = std::time::Instant::now();
        for &t in &doc {
            assert!(g.mask().expect("mask").allows(t as usize), "token {t}");
            g.advance(t).expect("advance");
        }
        let per_mask = started.elapsed() / doc.len() as u32;
        let m = g.mask().expect("mask");
        assert_eq!((0..49152).filter(|&i| m.allows(i)).count(), 1);
        assert!(m.allows(eos as usize));
        eprintln!("SmolLM2: token env built in {built:?}; {per_mask:?} per mask + advance");
    }

    /// Hostile schemas compile or fail with an error — none panics, aborts
    /// or runs away (the server compiles what any client sends). 60 levels
    /// is about the deepest a request body can carry (serde_json stops
    /// parsing at 128).
    #[test]
    fn hostile_schemas_fail_cleanly() {
        let (_, c) = compiler();
        let deep = (0..60).fold(
            json!({"type": "integer"}),
            |v, _| json!({"type": "array", "items": v, "maxItems": 1}),
        );
        let many: Vec<String> = (0..5000).map(|i| format!("v{i}")).collect();
        let cases = [
            deep,
            json!({"type": "object", "properties": {"next": {"$ref": "#"}}}),
            json!({"type": "string", "pattern": "^(a+)+$"}),
            json!({"type": "string", "minLength": 1_000_000_000u64}),
            json!({"type": "string", "minLength": 5, "maxLength": 2}),
            json!({"type": "string", "maxLength": -1}),
            json!({"type": "nonsense"}),
            json!({"type": "integer", "minimum": 1e308, "maximum": -1e308}),
            json!({"enum": many}),
            json!({"anyOf": []}),
            json!({"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}),
        ];
        for schema in cases {
            let shown = schema.to_string();
            let started = std::time::Instant::now();
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                c.compile(&Constraint::JsonSchema(schema))
                    .map(|mut g| g.mask().map(|_| ()))
            }));
            let took = started.elapsed();
            assert!(r.is_ok(), "panicked on {:.80}", shown);
            assert!(took.as_secs() < 10, "{took:?} on {:.80}", shown);
        }
    }

    #[test]
    fn repetitions_are_measured_unrolled() {
        assert_eq!(largest_repetition("^a+$"), 1);
        assert_eq!(largest_repetition("^[a-z]{1,255}$"), 255);
        assert_eq!(largest_repetition("^(a{100}){100}$"), 10_000);
        assert_eq!(
            largest_repetition("^((a{1000}){1000}){1000}$"),
            1_000_000_000
        );
        assert_eq!(largest_repetition("^(ab|cde){3}x{2,4}$"), 15);
        let (_, c) = compiler();
        let nested = json!({"type": "object", "properties":
            {"s": {"type": "string", "pattern": "^(a{200}){100}$"}}});
        let err = c
            .compile(&Constraint::JsonSchema(nested))
            .expect_err("20,000 unrolled");
        assert!(err.to_string().contains("20000"), "{err}");
        // A property named `pattern` is no pattern.
        let named = json!({"type": "object", "properties": {"pattern": {"type": "string"}}});
        assert!(c.compile(&Constraint::JsonSchema(named)).is_ok());
    }

    #[test]
    fn unsupported_keywords_and_bad_schemas_are_compile_errors() {
        let (_, c) = compiler();
        let err = c
            .compile(&Constraint::JsonSchema(
                json!({"type": "array", "uniqueItems": true}),
            ))
            .expect_err("uniqueItems");
        assert!(err.to_string().contains("uniqueItems"), "{err}");
        let err = c
            .compile(&Constraint::JsonSchema(json!({"x-guidance": {}})))
            .expect_err("x-guidance");
        assert!(err.to_string().contains("x-guidance"), "{err}");
        assert!(c.compile(&Constraint::JsonSchema(json!(true))).is_err());
    }
}
