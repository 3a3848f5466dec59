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
    /// Unsupported unless 0.
    pub presence_penalty: Option<f64>,
    /// Unsupported unless 0.
    pub frequency_penalty: Option<f64>,
    /// Unsupported unless 1 (vLLM extension).
    pub repetition_penalty: Option<f64>,
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
    /// `"auto"` / `"none"`.
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
    /// Sampling.
    #[serde(flatten)]
    pub sampling: SamplingFields,
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

/// Parse a JSON body into `T`, answering a 400 with serde's message.
pub fn parse_body<T: serde::de::DeserializeOwned>(bytes: &[u8]) -> Result<T, OpenAiError> {
    serde_json::from_slice(bytes)
        .map_err(|e| OpenAiError::bad(format!("invalid request body: {e}")))
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
        for (name, v, neutral) in [
            ("presence_penalty", self.presence_penalty, 0.0),
            ("frequency_penalty", self.frequency_penalty, 0.0),
            ("repetition_penalty", self.repetition_penalty, 1.0),
        ] {
            if v.is_some_and(|v| v != neutral) {
                return Err(OpenAiError::BadRequest {
                    message: format!(
                        "{name} is not supported by this server (leave it at {neutral})"
                    ),
                    param: Some(match name {
                        "presence_penalty" => "presence_penalty",
                        "frequency_penalty" => "frequency_penalty",
                        _ => "repetition_penalty",
                    }),
                    code: None,
                });
            }
        }
        Ok(Sampling {
            params: SamplingParams {
                max_tokens: 1,
                temperature,
                top_p,
                top_k,
                stop,
                stop_token_ids: self.stop_token_ids.unwrap_or_default(),
                ignore_eos: self.ignore_eos.unwrap_or(false),
                seed,
                logprobs: false,
            },
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
