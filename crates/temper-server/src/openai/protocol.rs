//! Request bodies as they arrive (serde structs mirroring the OpenAI / vLLM
//! JSON), and their checked form: [`Sampling`].

use serde::Deserialize;
use serde_json::{Map, Value};
use temper_model::SamplingParams;

use super::error::OpenAiError;

/// `stop`: one string or a list.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum Stop {
    /// A single stop string.
    One(String),
    /// Several.
    Many(Vec<String>),
}

impl Stop {
    fn into_vec(self) -> Vec<String> {
        match self {
            Stop::One(s) => vec![s],
            Stop::Many(v) => v,
        }
    }
}

/// `seed`: accepted over the whole `u64` and `i64` ranges.
#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(untagged)]
pub enum Seed {
    /// 0..=u64::MAX.
    Unsigned(u64),
    /// Negative values.
    Signed(i64),
}

impl Seed {
    fn value(self) -> u64 {
        match self {
            Seed::Unsigned(v) => v,
            Seed::Signed(v) => v as u64,
        }
    }
}

/// `stream_options`.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct StreamOptions {
    /// Send a last chunk with `usage`.
    #[serde(default)]
    pub include_usage: bool,
}

/// The sampling fields every generation route shares.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct SamplingFields {
    /// Softmax temperature in [0, 2]; 0 is greedy.
    pub temperature: Option<f64>,
    /// Nucleus mass in (0, 1].
    pub top_p: Option<f64>,
    /// vLLM extension: top-k (-1 or 0 disable).
    pub top_k: Option<i64>,
    /// Samples per prompt.
    pub n: Option<i64>,
    /// Stop strings.
    pub stop: Option<Stop>,
    /// vLLM extension: token ids that end a sample.
    pub stop_token_ids: Option<Vec<u32>>,
    /// vLLM extension: keep going past EOS.
    pub ignore_eos: Option<bool>,
    /// Reproducible sampling: any 64-bit integer (a negative one is taken
    /// as its two's-complement `u64`).
    pub seed: Option<Seed>,
    /// Subtracted once from the logits of generated tokens, in [-2, 2].
    pub presence_penalty: Option<f64>,
    /// Subtracted per occurrence from the logits of generated tokens, in
    /// [-2, 2].
    pub frequency_penalty: Option<f64>,
    /// vLLM extension: > 0; 1 is off.
    pub repetition_penalty: Option<f64>,
    /// vLLM extension: drop tokens below `min_p` × the top probability.
    pub min_p: Option<f64>,
    /// `{"token id": bias}`, bias in [-100, 100].
    pub logit_bias: Option<Map<String, Value>>,
    /// vLLM extension: tokens generated before EOS, a stop token id or a
    /// stop string may end a sample (>= 0, <= `max_tokens`).
    pub min_tokens: Option<i64>,
    /// vLLM extension: leave special tokens out of the text (default true).
    pub skip_special_tokens: Option<bool>,
}

/// Field names of [`SamplingFields`] (a flattened struct cannot deny
/// unknown fields, so routes list what they accept: see [`parse_body`]).
pub const SAMPLING_FIELDS: &[&str] = &[
    "temperature",
    "top_p",
    "top_k",
    "n",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "min_p",
    "logit_bias",
    "min_tokens",
    "skip_special_tokens",
];

/// The fields a route accepts besides [`SAMPLING_FIELDS`].
pub trait KnownFields {
    /// Top-level field names.
    const FIELDS: &'static [&'static str];
    /// Whether the route also takes the sampling fields.
    const SAMPLING: bool = true;
}

impl KnownFields for ChatRequest {
    const FIELDS: &'static [&'static str] = &[
        "model",
        "messages",
        "tools",
        "tool_choice",
        "max_tokens",
        "max_completion_tokens",
        "logprobs",
        "top_logprobs",
        "stream",
        "stream_options",
        "chat_template_kwargs",
        "response_format",
        // An end-user id for the provider's abuse monitoring: it never
        // changes the output, so accepting it honours it.
        "user",
        "cache_salt",
        "return_token_ids",
        "return_tokens_as_token_ids",
    ];
}

impl KnownFields for ResponsesRequest {
    const FIELDS: &'static [&'static str] = &[
        "model",
        "input",
        "instructions",
        "tools",
        "tool_choice",
        "max_output_tokens",
        "stream",
        "text",
        "include",
        "top_logprobs",
        "previous_response_id",
        "reasoning",
        "truncation",
        "parallel_tool_calls",
        // Neither changes the output: `store` (nothing is stored either
        // way: see `previous_response_id`) and `metadata` (echoed back).
        "store",
        "metadata",
        // Ids for the provider's abuse monitoring and prompt caching: they
        // never change the output, so accepting them honours them.
        "user",
        "safety_identifier",
        "prompt_cache_key",
    ];
}

impl KnownFields for CompletionRequest {
    const FIELDS: &'static [&'static str] = &[
        "model",
        "prompt",
        "max_tokens",
        "logprobs",
        "echo",
        "stream",
        "stream_options",
        "suffix",
        "best_of",
        "user",
        "cache_salt",
        "return_token_ids",
        "return_tokens_as_token_ids",
    ];
}

impl KnownFields for GenerateRequest {
    const FIELDS: &'static [&'static str] = &["model", "prompt_token_ids", "max_tokens"];
}

impl KnownFields for TokensRequest {
    const FIELDS: &'static [&'static str] = &[
        "model",
        "request_id",
        "token_ids",
        "sampling_params",
        "stream",
        "stream_options",
        "cache_salt",
        "priority",
        "return_token_ids",
        "kv_transfer_params",
        "features",
        "content_parts",
    ];
    const SAMPLING: bool = false;
}

impl KnownFields for TokensSampling {
    // `detokenize` is accepted either way: the route answers token ids only.
    const FIELDS: &'static [&'static str] = &["max_tokens", "logprobs", "detokenize"];
}

impl KnownFields for LoadLoraRequest {
    const FIELDS: &'static [&'static str] = &["lora_name", "lora_path"];
    const SAMPLING: bool = false;
}

impl KnownFields for UnloadLoraRequest {
    const FIELDS: &'static [&'static str] = &["lora_name"];
    const SAMPLING: bool = false;
}

/// `POST /v1/chat/completions`.
#[derive(Debug, Clone, Deserialize)]
pub struct ChatRequest {
    /// Base model name or adapter name.
    pub model: String,
    /// OpenAI chat messages.
    pub messages: Vec<Value>,
    /// Tool schemas.
    pub tools: Option<Vec<Value>>,
    /// `"auto"` / `"none"` / `"required"` / `{"type": "function",
    /// "function": {"name": ...}}` (the last two constrain the output).
    pub tool_choice: Option<Value>,
    /// Legacy completion-length cap.
    pub max_tokens: Option<i64>,
    /// Completion-length cap.
    pub max_completion_tokens: Option<i64>,
    /// Return logprobs of the chosen tokens.
    pub logprobs: Option<bool>,
    /// Alternatives per position (0..=20, needs `logprobs`).
    pub top_logprobs: Option<i64>,
    /// Server-sent events.
    pub stream: Option<bool>,
    /// Streaming options.
    pub stream_options: Option<StreamOptions>,
    /// Extra variables for the chat template (e.g. `enable_thinking`).
    pub chat_template_kwargs: Option<Map<String, Value>>,
    /// `{"type": "text"}` (the default), `{"type": "json_object"}` or
    /// `{"type": "json_schema", "json_schema": {"name", "schema", ...}}`
    /// (constrained decoding, see [`crate::structured`]).
    pub response_format: Option<Value>,
    /// vLLM extensions (`cache_salt`, `return_token_ids`,
    /// `return_tokens_as_token_ids`).
    #[serde(flatten)]
    pub vllm: VllmFields,
    /// Sampling.
    #[serde(flatten)]
    pub sampling: SamplingFields,
}

/// `POST /v1/responses` (OpenAI's Responses API; checked and turned into a
/// chat request by `responses`).
#[derive(Debug, Clone, Deserialize)]
pub struct ResponsesRequest {
    /// Base model name or adapter name.
    pub model: String,
    /// A string (one user message) or a list of input items.
    pub input: Value,
    /// A system message put before the input.
    pub instructions: Option<String>,
    /// Function tools, in the Responses API's flat shape.
    pub tools: Option<Vec<Value>>,
    /// `"auto"` / `"none"` / `"required"` / `{"type": "function", "name": ...}`.
    pub tool_choice: Option<Value>,
    /// Completion-length cap.
    pub max_output_tokens: Option<i64>,
    /// Server-sent events.
    pub stream: Option<bool>,
    /// `{"format": {"type": "text" | "json_object" | "json_schema", ...}}`.
    pub text: Option<Value>,
    /// Extra output: `message.output_text.logprobs`.
    pub include: Option<Vec<String>>,
    /// Alternatives per position (0..=20).
    pub top_logprobs: Option<i64>,
    /// Refused: no response is stored.
    pub previous_response_id: Option<String>,
    /// Only null (no reasoning items are produced).
    pub reasoning: Option<Value>,
    /// Only `"disabled"` (an input that does not fit is an error).
    pub truncation: Option<String>,
    /// Only true (the model may call several tools at once).
    pub parallel_tool_calls: Option<bool>,
    /// Echoed back in the response.
    pub metadata: Option<Map<String, Value>>,
    /// Sampling (`temperature`, `top_p`, and the vLLM extensions the other
    /// routes take; `n` must be 1).
    #[serde(flatten)]
    pub sampling: SamplingFields,
}

/// vLLM's request extensions on chat and completions.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct VllmFields {
    /// Partitions the prefix cache: requests share cached prompt prefixes
    /// only with requests of the same salt (1..=1024 characters).
    pub cache_salt: Option<String>,
    /// Return the prompt's token ids and each choice's generated ids.
    pub return_token_ids: Option<bool>,
    /// Render logprob tokens as `token_id:<id>`.
    pub return_tokens_as_token_ids: Option<bool>,
}

/// Longest `cache_salt` (vLLM's limit).
pub const MAX_CACHE_SALT: usize = 1024;

/// Check `cache_salt` as vLLM does: a non-empty string of at most
/// [`MAX_CACHE_SALT`] characters.
pub fn cache_salt_field(v: Option<String>) -> Result<Option<std::sync::Arc<str>>, OpenAiError> {
    match v {
        None => Ok(None),
        Some(s) if s.is_empty() || s.chars().count() > MAX_CACHE_SALT => Err(OpenAiError::invalid(
            "cache_salt",
            format!("cache_salt must be a non-empty string of at most {MAX_CACHE_SALT} characters"),
        )),
        Some(s) => Ok(Some(s.into())),
    }
}

/// `prompt` of `/v1/completions`: text, texts, token ids, or lists of ids.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum PromptInput {
    /// One text.
    Text(String),
    /// Several texts.
    Texts(Vec<String>),
    /// One prompt as token ids.
    Ids(Vec<u32>),
    /// Several prompts as token ids.
    IdLists(Vec<Vec<u32>>),
}

/// `POST /v1/completions`.
#[derive(Debug, Clone, Deserialize)]
pub struct CompletionRequest {
    /// Base model name or adapter name.
    pub model: String,
    /// The prompt(s).
    pub prompt: PromptInput,
    /// Completion-length cap (default 16, as OpenAI).
    pub max_tokens: Option<i64>,
    /// Alternatives per position (0..=20); `Some` turns logprobs on.
    pub logprobs: Option<i64>,
    /// Prepend the prompt to the text (and its logprobs).
    pub echo: Option<bool>,
    /// Server-sent events.
    pub stream: Option<bool>,
    /// Streaming options.
    pub stream_options: Option<StreamOptions>,
    /// Unsupported unless null.
    pub suffix: Option<String>,
    /// Unsupported unless equal to `n`.
    pub best_of: Option<i64>,
    /// vLLM extensions.
    #[serde(flatten)]
    pub vllm: VllmFields,
    /// Sampling.
    #[serde(flatten)]
    pub sampling: SamplingFields,
}

/// `POST /v1/generate`: token ids in, token ids and logprobs out (for RL).
#[derive(Debug, Clone, Deserialize)]
pub struct GenerateRequest {
    /// Base model name or adapter name.
    pub model: String,
    /// The prompt.
    pub prompt_token_ids: Vec<u32>,
    /// Completion-length cap (default 16).
    pub max_tokens: Option<i64>,
    /// Sampling.
    #[serde(flatten)]
    pub sampling: SamplingFields,
}

/// `POST /inference/v1/generate`: vLLM's token-in / token-out route, the
/// one verifiers' train client (prime-rl's sampler) calls.
#[derive(Debug, Clone, Deserialize)]
pub struct TokensRequest {
    /// Base model name or adapter name (default: the base model).
    pub model: Option<String>,
    /// Echoed in the response's `request_id` (`generate-tokens-<id>`).
    pub request_id: Option<String>,
    /// The prompt.
    pub token_ids: Vec<u32>,
    /// vLLM's `SamplingParams` (checked against [`TokensSampling`]).
    pub sampling_params: Value,
    /// Only `false` (streaming is not implemented on this route).
    pub stream: Option<bool>,
    /// Only without `stream`.
    pub stream_options: Option<Value>,
    /// See [`VllmFields::cache_salt`].
    pub cache_salt: Option<String>,
    /// Only 0 (vLLM refuses others without priority scheduling).
    pub priority: Option<i64>,
    /// Return `prompt_token_ids`.
    pub return_token_ids: Option<bool>,
    /// Disaggregated serving: only null.
    pub kv_transfer_params: Option<Value>,
    /// Multimodal inputs: only null.
    pub features: Option<Value>,
    /// Multimodal inputs: only null.
    pub content_parts: Option<Value>,
}

/// `sampling_params` of [`TokensRequest`]: the sampling fields, plus
/// `max_tokens`, `logprobs` (how many alternatives; absent or null: no
/// logprobs) and `detokenize` (the route returns token ids only, so it
/// changes nothing).
#[derive(Debug, Clone, Deserialize)]
pub struct TokensSampling {
    /// Completion-length cap (default: the rest of the context).
    pub max_tokens: Option<i64>,
    /// Alternatives per position (0..=20); `Some` turns logprobs on.
    pub logprobs: Option<i64>,
    /// Sampling.
    #[serde(flatten)]
    pub sampling: SamplingFields,
}

/// `POST /v1/load_lora_adapter` (vLLM's body).
#[derive(Debug, Clone, Deserialize)]
pub struct LoadLoraRequest {
    /// Name clients will put in `model`.
    pub lora_name: String,
    /// PEFT directory (adapter_config.json + adapter_model.safetensors).
    pub lora_path: String,
}

/// `POST /v1/unload_lora_adapter` (vLLM's body).
#[derive(Debug, Clone, Deserialize)]
pub struct UnloadLoraRequest {
    /// The adapter to drop.
    pub lora_name: String,
}

/// Parse a JSON body into `T`, answering a 400 with serde's message, or
/// naming the first field the route does not implement (serde would
/// otherwise drop it silently, and the client would think it applied).
pub fn parse_body<T: serde::de::DeserializeOwned + KnownFields>(
    bytes: &[u8],
) -> Result<T, OpenAiError> {
    let v: Value = serde_json::from_slice(bytes)
        .map_err(|e| OpenAiError::bad(format!("invalid request body: {e}")))?;
    parse_value(v, "")
}

/// [`parse_body`] on a parsed JSON object; `path` prefixes the field names
/// in errors (`"sampling_params."` for a nested object).
pub fn parse_value<T: serde::de::DeserializeOwned + KnownFields>(
    v: Value,
    path: &str,
) -> Result<T, OpenAiError> {
    if let Value::Object(m) = &v {
        let mut unknown: Vec<&String> = m
            .keys()
            .filter(|k| {
                let known = T::FIELDS.contains(&k.as_str())
                    || (T::SAMPLING && SAMPLING_FIELDS.contains(&k.as_str()));
                !known
            })
            .collect();
        unknown.sort();
        if let Some(first) = unknown.first() {
            return Err(OpenAiError::BadRequest {
                message: format!(
                    "unsupported field `{path}{first}`: this server does not implement it{}",
                    if unknown.len() > 1 {
                        format!(
                            " (nor {})",
                            unknown[1..]
                                .iter()
                                .map(|k| format!("`{path}{k}`"))
                                .collect::<Vec<_>>()
                                .join(", ")
                        )
                    } else {
                        String::new()
                    }
                ),
                param: Some(format!("{path}{first}")),
                code: Some("unsupported_field"),
            });
        }
    }
    serde_json::from_value(v).map_err(|e| {
        let what = if path.is_empty() {
            "request body".to_string()
        } else {
            format!("`{}`", path.trim_end_matches('.'))
        };
        OpenAiError::bad(format!("invalid {what}: {e}"))
    })
}

/// Checked sampling settings (`max_tokens` still unresolved).
#[derive(Debug, Clone)]
pub struct Sampling {
    /// Parameters for the scheduler (`max_tokens` filled in later).
    pub params: SamplingParams,
    /// Samples per prompt.
    pub n: usize,
}

/// Most samples per prompt.
pub const MAX_N: i64 = 128;
/// Most `top_logprobs` (OpenAI's limit).
pub const MAX_TOP_LOGPROBS: i64 = 20;

/// Defaults for fields a request omits: the model's generation config, as
/// vLLM does.
#[derive(Debug, Clone, Default)]
pub struct SamplingDefaults {
    /// Temperature when omitted (else 1).
    pub temperature: Option<f64>,
    /// top_p when omitted (else 1).
    pub top_p: Option<f64>,
    /// top_k when omitted (else off).
    pub top_k: Option<usize>,
}

impl SamplingFields {
    /// Validate into [`Sampling`].
    pub fn check(self, defaults: &SamplingDefaults) -> Result<Sampling, OpenAiError> {
        let temperature = self.temperature.or(defaults.temperature).unwrap_or(1.0);
        if !(0.0..=2.0).contains(&temperature) {
            return Err(OpenAiError::invalid(
                "temperature",
                format!("temperature must be between 0 and 2, got {temperature}"),
            ));
        }
        let top_p = self.top_p.or(defaults.top_p).unwrap_or(1.0);
        if !(top_p > 0.0 && top_p <= 1.0) {
            return Err(OpenAiError::invalid(
                "top_p",
                format!("top_p must be in (0, 1], got {top_p}"),
            ));
        }
        let top_k = match self.top_k {
            None => defaults.top_k.unwrap_or(0),
            Some(k) if k == -1 || k == 0 => 0,
            Some(k) if k > 0 => k as usize,
            Some(k) => {
                return Err(OpenAiError::invalid(
                    "top_k",
                    format!("top_k must be -1 (off) or >= 1, got {k}"),
                ))
            }
        };
        let n = self.n.unwrap_or(1);
        if !(1..=MAX_N).contains(&n) {
            return Err(OpenAiError::invalid(
                "n",
                format!("n must be between 1 and {MAX_N}, got {n}"),
            ));
        }
        let stop = self.stop.map(Stop::into_vec).unwrap_or_default();
        if stop.iter().any(|s| s.is_empty()) {
            return Err(OpenAiError::invalid(
                "stop",
                "stop strings must not be empty",
            ));
        }
        let seed = self.seed.map(Seed::value);
        let mut logit_bias = Vec::new();
        for (k, v) in self.logit_bias.unwrap_or_default() {
            let id: u32 = k.parse().map_err(|_| {
                OpenAiError::invalid(
                    "logit_bias",
                    format!("logit_bias keys are token ids, got {k:?}"),
                )
            })?;
            let b = v.as_f64().ok_or_else(|| {
                OpenAiError::invalid(
                    "logit_bias",
                    format!("logit_bias of token {id} must be a number, got {v}"),
                )
            })?;
            logit_bias.push((id, b as f32));
        }
        logit_bias.sort_by_key(|(id, _)| *id);
        let min_tokens = match self.min_tokens {
            None => 0,
            Some(m) if m >= 0 => m as usize,
            Some(m) => {
                return Err(OpenAiError::invalid(
                    "min_tokens",
                    format!("min_tokens must be greater than or equal to 0, got {m}"),
                ))
            }
        };
        let params = SamplingParams {
            max_tokens: 1,
            temperature,
            top_p,
            top_k,
            min_p: self.min_p.unwrap_or(0.0),
            presence_penalty: self.presence_penalty.unwrap_or(0.0),
            frequency_penalty: self.frequency_penalty.unwrap_or(0.0),
            repetition_penalty: self.repetition_penalty.unwrap_or(1.0),
            logit_bias,
            stop,
            stop_token_ids: self.stop_token_ids.unwrap_or_default(),
            ignore_eos: self.ignore_eos.unwrap_or(false),
            min_tokens,
            skip_special_tokens: self.skip_special_tokens.unwrap_or(true),
            seed,
            logprobs: false,
        };
        // The shared rules' range checks, answered as a 400 naming the field
        // (their messages start with it).
        if let Err(e) = params.validate() {
            let msg = e.to_string();
            let field = [
                "min_p",
                "presence_penalty",
                "frequency_penalty",
                "repetition_penalty",
                "logit_bias",
            ]
            .into_iter()
            .find(|f| msg.contains(f))
            .unwrap_or("sampling");
            return Err(OpenAiError::invalid(field, msg));
        }
        Ok(Sampling {
            params,
            n: n as usize,
        })
    }
}

/// Check an explicit `max_tokens`-like field.
pub fn max_tokens_field(name: &'static str, v: Option<i64>) -> Result<Option<usize>, OpenAiError> {
    match v {
        None => Ok(None),
        Some(m) if m >= 1 => Ok(Some(m as usize)),
        Some(m) => Err(OpenAiError::invalid(
            name,
            format!("{name} must be >= 1, got {m}"),
        )),
    }
}

/// Check `top_logprobs` / completions' `logprobs`.
pub fn top_logprobs_field(name: &'static str, v: Option<i64>) -> Result<usize, OpenAiError> {
    match v {
        None => Ok(0),
        Some(k) if (0..=MAX_TOP_LOGPROBS).contains(&k) => Ok(k as usize),
        Some(k) => Err(OpenAiError::invalid(
            name,
            format!("{name} must be between 0 and {MAX_TOP_LOGPROBS}, got {k}"),
        )),
    }
}
