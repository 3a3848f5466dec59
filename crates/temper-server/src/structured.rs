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
    JsonSchema(Value, Enforce),
    /// One Hermes tool call, `<tool_call>\n{"name": ..., "arguments":
    /// ...}\n</tool_call>`, its JSON valid under this schema (an object).
    ToolCall(Value, Enforce),
}

/// What to do with schema keywords the engine cannot enforce (`not`,
/// `uniqueItems`, `if`/`then`/`else`, an unknown `format`, ...): OpenAI's
/// `strict` flag chooses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Enforce {
    /// `strict: true`: every keyword is enforced, or the schema is refused
    /// naming the one that cannot be.
    Strict,
    /// `strict` false or absent: enforce what can be, and report the rest
    /// ([`Grammar::unenforced`]); `oneOf` is enforced as `anyOf`.
    Lenient,
}

impl Enforce {
    /// `Strict` when `strict` is `true`.
    pub fn from_strict(strict: bool) -> Self {
        if strict {
            Enforce::Strict
        } else {
            Enforce::Lenient
        }
    }
}

/// llguidance's options forced on every schema: the separators of Python's
/// `json.dumps` and no free whitespace, and its `lenient` mode (unsupported
/// keywords and unknown formats ignored with a warning, `oneOf` as `anyOf`)
/// unless `strict`. Free whitespace would let a model pad a document with
/// spaces and newlines until `max_tokens`; fixed separators keep a valid
/// document finite and still natural to models.
fn options(enforce: Enforce) -> Value {
    json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": ",
           "lenient": enforce == Enforce::Lenient})
}

/// `schema` with [`options`] set; a client's own `x-guidance` (llguidance's
/// option key) is refused rather than silently overridden.
fn with_options(schema: &Value, enforce: Enforce) -> Result<Value, StructuredError> {
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
    let mut v = schema.clone();
    strip_annotations(&mut v);
    if let Value::Object(m) = &mut v {
        m.insert("x-guidance".into(), options(enforce));
    }
    Ok(v)
}

/// Every JSON-schema keyword of drafts 4 to 2020-12 (a key outside this
/// list is an annotation: it constrains nothing).
const KEYWORDS: &[&str] = &[
    "$anchor",
    "$comment",
    "$defs",
    "$dynamicAnchor",
    "$dynamicRef",
    "$id",
    "$recursiveAnchor",
    "$recursiveRef",
    "$ref",
    "$schema",
    "$vocabulary",
    "additionalItems",
    "additionalProperties",
    "allOf",
    "anyOf",
    "const",
    "contains",
    "contentEncoding",
    "contentMediaType",
    "contentSchema",
    "default",
    "definitions",
    "dependencies",
    "dependentRequired",
    "dependentSchemas",
    "deprecated",
    "description",
    "else",
    "enum",
    "examples",
    "exclusiveMaximum",
    "exclusiveMinimum",
    "format",
    "id",
    "if",
    "items",
    "maxContains",
    "maxItems",
    "maxLength",
    "maxProperties",
    "maximum",
    "minContains",
    "minItems",
    "minLength",
    "minProperties",
    "minimum",
    "multipleOf",
    "not",
    "oneOf",
    "pattern",
    "patternProperties",
    "prefixItems",
    "properties",
    "propertyNames",
    "readOnly",
    "required",
    "then",
    "title",
    "type",
    "unevaluatedItems",
    "unevaluatedProperties",
    "uniqueItems",
    "writeOnly",
];

/// Drops the keys beside a `$ref` that are no JSON-schema keyword
/// (`markdownDescription`, `x-...`), in `schema` and its subschemas: they
/// are annotations, as JSON Schema specifies, but llguidance compiles them
/// as a constraint of no type to intersect with the reference, which fails
/// when the reference is recursive ("circular references with sibling
/// keys"). Only schema positions are walked (property names, `enum` values
/// and defaults are data), and only `$ref`s' siblings are dropped: other
/// objects may be the targets of `$ref`s (`#/$defs/group/name`).
fn strip_annotations(schema: &mut Value) {
    const ONE: &[&str] = &[
        "additionalItems",
        "additionalProperties",
        "contains",
        "contentSchema",
        "else",
        "if",
        "items",
        "not",
        "propertyNames",
        "then",
        "unevaluatedItems",
        "unevaluatedProperties",
    ];
    const LIST: &[&str] = &["allOf", "anyOf", "oneOf", "prefixItems", "items"];
    const MAP: &[&str] = &[
        "$defs",
        "definitions",
        "dependencies",
        "dependentSchemas",
        "patternProperties",
        "properties",
    ];
    let Value::Object(m) = schema else {
        return;
    };
    if m.contains_key("$ref") {
        m.retain(|k, _| KEYWORDS.contains(&k.as_str()));
    }
    for (k, v) in m.iter_mut() {
        let k = k.as_str();
        match v {
            Value::Object(_) if ONE.contains(&k) => strip_annotations(v),
            Value::Array(a) if LIST.contains(&k) => a.iter_mut().for_each(strip_annotations),
            // `dependencies` values may be lists of names: not objects, not walked.
            Value::Object(sub) if MAP.contains(&k) => sub.values_mut().for_each(strip_annotations),
            _ => {}
        }
    }
}

/// Most distinct `patternProperties` patterns in one schema: llguidance
/// checks every pair of an object's patterns for overlap, so compile time
/// grows faster than the square of their number: 64 take 0.1 s, 128 0.4 s,
/// 500 168 s (on a 2-core box). An object's patterns are distinct (they are
/// its map's keys, merged objects' too), so no object, written or merged,
/// has more; and the pairs of all written objects together are at most
/// those of one object of this many (real schemas repeat one pattern, such
/// as Compose's `^x-` in 47 objects, which costs no pair).
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
/// more than [`MAX_PATTERN_PROPERTIES`] distinct `patternProperties`
/// patterns, or objects whose patterns make more pairs in all than one
/// object of that many (every object's and `$defs`' counted), and a
/// `pattern` (or `patternProperties` key) whose counted repetitions unroll
/// past [`MAX_PATTERN_REPETITION`].
fn check_cost(schema: &Value) -> Result<(), StructuredError> {
    fn walk<'a>(
        v: &'a Value,
        distinct: &mut std::collections::HashSet<&'a str>,
        pairs: &mut usize,
    ) -> Result<(), StructuredError> {
        match v {
            Value::Object(m) => {
                let mut patterns: Vec<&str> = Vec::new();
                if let Some(Value::String(p)) = m.get("pattern") {
                    patterns.push(p);
                }
                if let Some(Value::Object(pp)) = m.get("patternProperties") {
                    let k = pp.len();
                    *pairs = pairs.saturating_add(k * k.saturating_sub(1) / 2);
                    distinct.extend(pp.keys().map(String::as_str));
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
                m.values().try_for_each(|x| walk(x, distinct, pairs))
            }
            Value::Array(a) => a.iter().try_for_each(|x| walk(x, distinct, pairs)),
            _ => Ok(()),
        }
    }
    let mut distinct = std::collections::HashSet::new();
    let mut pairs = 0;
    walk(schema, &mut distinct, &mut pairs)?;
    let n = distinct.len();
    if n > MAX_PATTERN_PROPERTIES {
        return Err(StructuredError::Compile(format!(
            "the schema has {n} `patternProperties` patterns; the limit is \
             {MAX_PATTERN_PROPERTIES} distinct ones (each pair in an object is checked for \
             overlap at compile time)"
        )));
    }
    let most = MAX_PATTERN_PROPERTIES * (MAX_PATTERN_PROPERTIES - 1) / 2;
    if pairs > most {
        return Err(StructuredError::Compile(format!(
            "the schema's objects have {pairs} pairs of `patternProperties` patterns in all; \
             the limit is {most}, the pairs of one object of {MAX_PATTERN_PROPERTIES} \
             (each pair is checked for overlap at compile time)"
        )));
    }
    Ok(())
}

impl Constraint {
    /// The schema constrained to.
    fn schema(&self) -> &Value {
        match self {
            Constraint::JsonSchema(s, _) | Constraint::ToolCall(s, _) => s,
        }
    }

    /// A digest naming this constraint exactly (the cache key of compiled
    /// grammars): its kind, its enforcement and its schema's JSON text.
    pub fn digest(&self) -> [u8; 32] {
        use sha2::{Digest, Sha256};
        let kind: &[u8] = match self {
            Constraint::JsonSchema(_, Enforce::Strict) => b"json_schema\0",
            Constraint::JsonSchema(_, Enforce::Lenient) => b"json_schema lenient\0",
            Constraint::ToolCall(_, Enforce::Strict) => b"tool_call\0",
            Constraint::ToolCall(_, Enforce::Lenient) => b"tool_call lenient\0",
        };
        let mut h = Sha256::new();
        h.update(kind);
        h.update(self.schema().to_string().as_bytes());
        h.finalize().into()
    }

    fn grammar(&self) -> Result<TopLevelGrammar, StructuredError> {
        check_cost(self.schema())?;
        match self {
            Constraint::JsonSchema(s, e) => {
                Ok(TopLevelGrammar::from_json_schema(with_options(s, *e)?))
            }
            Constraint::ToolCall(s, e) => {
                // The tags are lark string literals: they match the tag's own
                // token when the vocabulary has one (Qwen's `<tool_call>`
                // is a plain added token) or its spelling otherwise.
                let body = serde_json::to_string(&with_options(s, *e)?)
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
        let mut parser = self
            .factory
            .create_parser(grammar)
            .map_err(|e| StructuredError::Compile(explain(&engine_message(e))))?;
        let unenforced = unenforced_keywords(&parser.grammar_warnings(), c.schema()).into();
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
        Ok(Grammar {
            matcher,
            unenforced,
        })
    }
}

/// The schema keywords llguidance's lenient mode left unenforced, from its
/// warnings (sorted, each once): `Unimplemented keys: ["not", ...]`,
/// `Unknown format: ...` (`format`), `oneOf` enforced as `anyOf` (`oneOf`),
/// `min/maxProperties` beside optional properties (whichever of the two
/// `schema` uses). A warning of another shape is passed on as it is, so
/// nothing left out goes unsaid (the test
/// `lenient_mode_reports_what_it_leaves_unenforced` pins the shapes).
fn unenforced_keywords(warnings: &[String], schema: &Value) -> Vec<String> {
    fn uses_key(v: &Value, key: &str) -> bool {
        match v {
            Value::Object(m) => m.contains_key(key) || m.values().any(|x| uses_key(x, key)),
            Value::Array(a) => a.iter().any(|x| uses_key(x, key)),
            _ => false,
        }
    }
    let mut out: Vec<String> = Vec::new();
    for w in warnings {
        if let Some(rest) = w.strip_prefix("Unimplemented keys: [") {
            let list = rest.split(']').next().unwrap_or_default();
            out.extend(
                list.split(',')
                    .map(|k| k.trim().trim_matches('"').to_string())
                    .filter(|k| !k.is_empty()),
            );
        } else if w.starts_with("Unknown format: ") {
            out.push("format".into());
        } else if w.starts_with("oneOf not fully supported") {
            out.push("oneOf".into());
        } else if w.starts_with("min/maxProperties only supported") {
            out.extend(
                ["minProperties", "maxProperties"]
                    .into_iter()
                    .filter(|k| uses_key(schema, k))
                    .map(String::from),
            );
        } else if w != "..." {
            out.push(w.chars().take(200).collect());
        }
    }
    out.sort();
    out.dedup();
    out
}

/// An llguidance error's first line (without verbose errors it still ends
/// with a `<non-verbose/>` marker line).
fn engine_message(e: impl std::fmt::Display) -> String {
    let e = e.to_string();
    e.lines().next().unwrap_or_default().trim().to_string()
}

/// A compile error of llguidance's that names its own internals, said in
/// the schema's terms (the engine's words follow).
fn explain(m: &str) -> String {
    let why = if m.starts_with("Only absolute $ref's") {
        "a `$ref` to another document: only references inside the schema (`#/...`) are \
         resolved; inline what it refers to"
    } else if m == "schema too large" {
        "the schema is too large: compiling it takes more than the engine's 50,000 \
         subschemas and intersections"
    } else if m.starts_with("circular references with sibling keys") {
        "a recursive `$ref` with constraints beside it, which the engine cannot intersect; \
         move them into the referenced schema"
    } else {
        return m.to_string();
    };
    format!("{why} (llguidance: {m})")
}

fn special_name(id: usize) -> Vec<u8> {
    let mut b = format!(".<[{id}]>").into_bytes();
    b[0] = TokTrie::SPECIAL_TOKEN_MARKER;
    b
}

/// One sample's grammar state.
pub struct Grammar {
    matcher: Matcher,
    /// Schema keywords the grammar does not enforce (lenient mode).
    unenforced: Arc<[String]>,
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
            unenforced: self.unenforced.clone(),
        }
    }

    /// The schema keywords this grammar does not enforce, sorted (empty
    /// under [`Enforce::Strict`]): a document it allows may still break
    /// them.
    pub fn unenforced(&self) -> &[String] {
        &self.unenforced
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

    fn strict(schema: Value) -> Constraint {
        Constraint::JsonSchema(schema, Enforce::Strict)
    }

    fn lenient(schema: Value) -> Constraint {
        Constraint::JsonSchema(schema, Enforce::Lenient)
    }

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
        let mut g = c.compile(&strict(schema)).expect("compile");
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
        let mut g = c.compile(&strict(schema)).expect("compile");
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
        let mut g = c.compile(&strict(schema)).expect("compile");
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
        // Lenient mode compiles more of what it is sent: each case in both.
        for (schema, mode) in cases
            .into_iter()
            .flat_map(|s| [(s.clone(), Enforce::Strict), (s, Enforce::Lenient)])
        {
            let shown = format!("{mode:?} {schema}");
            let started = std::time::Instant::now();
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                c.compile(&Constraint::JsonSchema(schema, mode))
                    .map(|mut g| g.mask().map(|_| ()))
            }));
            let took = started.elapsed();
            assert!(r.is_ok(), "panicked on {:.80}", shown);
            assert!(took.as_secs() < 10, "{took:?} on {:.80}", shown);
        }
    }

    /// The `patternProperties` bound counts distinct patterns and the pairs
    /// each object's patterns make: one pattern repeated in many objects
    /// (Compose's `^x-`) costs no pair and passes; 65 distinct patterns, or
    /// two objects of 64, are refused before compiling.
    #[test]
    fn pattern_properties_are_bounded_by_distinct_patterns_and_pairs() {
        let (_, c) = compiler();
        let object = |pats: Vec<String>| {
            let pp: serde_json::Map<String, Value> = pats
                .into_iter()
                .map(|p| (p, json!({"type": "integer"})))
                .collect();
            json!({"type": "object", "patternProperties": pp})
        };
        let repeated: serde_json::Map<String, Value> = (0..100)
            .map(|i| (format!("o{i}"), object(vec!["^x-".into()])))
            .collect();
        let ok = json!({"type": "object", "properties": repeated});
        assert!(c.compile(&strict(ok)).is_ok());
        let distinct = |n: usize, tag: &str| -> Vec<String> {
            (0..n).map(|i| format!("^{tag}{i}_[a-z]+$")).collect()
        };
        let spread: serde_json::Map<String, Value> = distinct(65, "p")
            .into_iter()
            .enumerate()
            .map(|(i, p)| (format!("o{i}"), object(vec![p])))
            .collect();
        let err = c
            .compile(&lenient(json!({"type": "object", "properties": spread})))
            .expect_err("65 distinct");
        assert!(err.to_string().contains("65 `patternProperties`"), "{err}");
        let twice = json!({"type": "object", "properties": {
            "a": object(distinct(64, "p")), "b": object(distinct(64, "p"))}});
        let err = c.compile(&lenient(twice)).expect_err("4032 pairs");
        assert!(err.to_string().contains("4032 pairs"), "{err}");
    }

    /// An annotation beside a recursive `$ref` (CircleCI's
    /// `markdownDescription`) no longer breaks the compile; what looks like
    /// one but is data (a property's name) stays.
    #[test]
    fn annotations_beside_a_ref_are_dropped_and_data_is_not() {
        let (tok, c) = compiler();
        let schema = json!({
            "$ref": "#/definitions/logic",
            "definitions": {"logic": {"anyOf": [
                {"type": "boolean"},
                {"type": "object", "additionalProperties": false, "properties": {
                    "not": {"$ref": "#/definitions/logic", "markdownDescription": "negation"},
                    "markdownDescription": {"type": "integer"}}}]}}
        });
        let mut stripped = schema.clone();
        strip_annotations(&mut stripped);
        let logic = &stripped["definitions"]["logic"]["anyOf"][1]["properties"];
        assert_eq!(logic["not"], json!({"$ref": "#/definitions/logic"}));
        assert_eq!(logic["markdownDescription"], json!({"type": "integer"}));
        let mut g = c.compile(&strict(schema)).expect("compiles");
        for t in tok
            .encode("{\"not\": {\"markdownDescription\": 1}}", false)
            .expect("encode")
        {
            assert!(g.mask().expect("mask").allows(t as usize), "token {t}");
            g.advance(t).expect("advance");
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
        let err = c.compile(&strict(nested)).expect_err("20,000 unrolled");
        assert!(err.to_string().contains("20000"), "{err}");
        // A property named `pattern` is no pattern.
        let named = json!({"type": "object", "properties": {"pattern": {"type": "string"}}});
        assert!(c.compile(&strict(named)).is_ok());
    }

    /// Lenient mode compiles what strict mode refuses, enforces what it
    /// can, and names the rest: llguidance's warning shapes, as read by
    /// [`unenforced_keywords`], for this llguidance version.
    #[test]
    fn lenient_mode_reports_what_it_leaves_unenforced() {
        let (tok, c) = compiler();
        let schema = json!({
            "type": "object", "required": ["tags", "kind"],
            "minProperties": 3,
            "properties": {
                "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "uniqueItems": true,
                         "maxItems": 2},
                "kind": {"oneOf": [{"type": "string", "maxLength": 2}, {"enum": ["x", "yyy"]}]},
                "when": {"type": "string", "format": "no-such-format", "maxLength": 4},
                "n": {"type": "integer", "not": {"const": 3}},
                "m": {"type": "integer"}
            },
            "if": {"required": ["n"]}, "then": {"required": ["m"]}
        });
        let err = c.compile(&strict(schema.clone())).expect_err("strict");
        assert!(err.to_string().contains("Unimplemented keys"), "{err}");
        let mut g = c.compile(&lenient(schema.clone())).expect("lenient");
        assert_eq!(
            g.unenforced(),
            [
                "format",
                "if",
                "minProperties",
                "not",
                "oneOf",
                "then",
                "uniqueItems"
            ]
        );
        assert_eq!(g.fork().unenforced(), g.unenforced());
        // What is enforceable still is (`items`, `enum`).
        let mut prefix = Vec::new();
        for t in tok.encode("{\"tags\": [\"", false).expect("encode") {
            assert!(g.mask().expect("mask").allows(t as usize), "token {t}");
            g.advance(t).expect("advance");
            prefix.push(t);
        }
        let m = g.mask().expect("mask");
        let c_tok = tok.encode("c", false).expect("encode");
        assert!(!m.allows(c_tok[0] as usize), "`c` is not in the enum");
        // A schema strict mode takes reports nothing either way.
        let plain = json!({"type": "object", "properties": {"a": {"type": "integer"}}});
        assert!(c
            .compile(&strict(plain.clone()))
            .expect("strict")
            .unenforced()
            .is_empty());
        assert!(c
            .compile(&lenient(plain))
            .expect("lenient")
            .unenforced()
            .is_empty());
        // Strict and lenient grammars of one schema are cached apart.
        assert_ne!(strict(schema.clone()).digest(), lenient(schema).digest());
    }

    #[test]
    fn unsupported_keywords_and_bad_schemas_are_compile_errors() {
        let (_, c) = compiler();
        let err = c
            .compile(&strict(json!({"type": "array", "uniqueItems": true})))
            .expect_err("uniqueItems");
        assert!(err.to_string().contains("uniqueItems"), "{err}");
        let err = c
            .compile(&strict(json!({"x-guidance": {}})))
            .expect_err("x-guidance");
        assert!(err.to_string().contains("x-guidance"), "{err}");
        assert!(c.compile(&strict(json!(true))).is_err());
    }
}
