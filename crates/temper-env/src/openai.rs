//! [`OpenAiChatModel`]: a [`ChatModel`] on any OpenAI-compatible
//! `/chat/completions` endpoint, with a per-request timeout and retries
//! with jittered exponential backoff on 408/429/5xx, timeouts, dropped
//! connections and malformed answers.

use std::time::Duration;

use async_trait::async_trait;
use rand::Rng;
use serde_json::{json, Value};

use crate::{ChatModel, ChatRequest, Message, ModelCallError, ModelTurn, Usage};

/// How often and how patiently to retry.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RetryPolicy {
    /// Retries after the first try.
    pub max_retries: u32,
    /// First backoff; doubles each retry, with jitter in [½, 1].
    pub base_delay: Duration,
    /// Backoff cap (also caps a server's `Retry-After`).
    pub max_delay: Duration,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        RetryPolicy {
            max_retries: 6,
            base_delay: Duration::from_millis(500),
            max_delay: Duration::from_secs(20),
        }
    }
}

/// An OpenAI-compatible chat endpoint.
#[derive(Debug, Clone)]
pub struct OpenAiChatModel {
    http: reqwest::Client,
    url: String,
    base: String,
    model: String,
    api_key: Option<String>,
    /// Retry policy.
    pub retry: RetryPolicy,
    /// Per-request timeout (the whole request, body included).
    pub timeout: Duration,
}

impl OpenAiChatModel {
    /// `base_url` like `http://127.0.0.1:8000/v1`. Loopback endpoints
    /// bypass HTTP proxies.
    pub fn new(
        base_url: &str,
        model: impl Into<String>,
        api_key: Option<String>,
    ) -> Result<Self, ModelCallError> {
        let base = base_url.trim_end_matches('/');
        let loopback = ["://127.", "://localhost", "://[::1]", "://0.0.0.0"]
            .iter()
            .any(|p| base.contains(p));
        let mut builder = reqwest::Client::builder()
            .pool_max_idle_per_host(1024)
            .tcp_nodelay(true);
        if loopback {
            builder = builder.no_proxy();
        }
        let http = builder
            .build()
            .map_err(|e| ModelCallError::Other(e.to_string()))?;
        Ok(OpenAiChatModel {
            http,
            url: format!("{base}/chat/completions"),
            base: base.to_string(),
            model: model.into(),
            api_key,
            retry: RetryPolicy::default(),
            timeout: Duration::from_secs(600),
        })
    }

    /// The model name sent in every request.
    pub fn model(&self) -> &str {
        &self.model
    }

    /// The base URL (without a trailing `/`).
    pub fn base_url(&self) -> &str {
        &self.base
    }

    /// `GET {base}/models` once, without retries (a preflight should fail
    /// fast): the ids the endpoint serves, or `None` when it has no such
    /// route (404/405; some proxies only forward completions).
    pub async fn list_models(
        &self,
        timeout: Duration,
    ) -> Result<Option<Vec<String>>, ModelCallError> {
        let mut call = self.http.get(format!("{}/models", self.base));
        if let Some(key) = &self.api_key {
            call = call.bearer_auth(key);
        }
        let work = async {
            let resp = call.send().await.map_err(from_reqwest)?;
            let status = resp.status();
            let text = resp.text().await.map_err(from_reqwest)?;
            if status.as_u16() == 404 || status.as_u16() == 405 {
                return Ok(None);
            }
            if !status.is_success() {
                let message = serde_json::from_str::<Value>(&text)
                    .ok()
                    .and_then(|v| v["error"]["message"].as_str().map(str::to_string))
                    .unwrap_or_else(|| text.chars().take(500).collect());
                return Err(ModelCallError::Status {
                    status: status.as_u16(),
                    message,
                });
            }
            let v: Value = serde_json::from_str(&text)
                .map_err(|e| ModelCallError::Malformed(format!("/models: {e}")))?;
            let data = v["data"]
                .as_array()
                .ok_or_else(|| ModelCallError::Malformed("/models: no `data` list".into()))?;
            Ok(Some(
                data.iter()
                    .filter_map(|m| m["id"].as_str().map(str::to_string))
                    .collect(),
            ))
        };
        match tokio::time::timeout(timeout, work).await {
            Ok(r) => r,
            Err(_) => Err(ModelCallError::Timeout(timeout.as_secs_f64())),
        }
    }

    /// The request body for `req`.
    pub fn body(&self, req: &ChatRequest) -> Value {
        let s = &req.sampling;
        let mut body = json!({
            "model": self.model,
            "messages": req.messages,
            "max_tokens": s.max_tokens,
            "temperature": s.temperature,
            "top_p": s.top_p,
        });
        if let Some(seed) = s.seed {
            body["seed"] = json!(seed);
        }
        if !s.stop.is_empty() {
            body["stop"] = json!(s.stop);
        }
        if !s.stop_token_ids.is_empty() {
            body["stop_token_ids"] = json!(s.stop_token_ids);
        }
        for (k, v) in [
            ("min_p", s.min_p),
            ("presence_penalty", s.presence_penalty),
            ("frequency_penalty", s.frequency_penalty),
            ("repetition_penalty", s.repetition_penalty),
        ] {
            if let Some(v) = v {
                body[k] = json!(v);
            }
        }
        if !s.logit_bias.is_empty() {
            // OpenAI's shape: token ids as string keys.
            let m: serde_json::Map<String, Value> = s
                .logit_bias
                .iter()
                .map(|(id, b)| (id.to_string(), json!(b)))
                .collect();
            body["logit_bias"] = Value::Object(m);
        }
        if let Some(tools) = &req.tools {
            body["tools"] = json!(tools);
        }
        for (k, v) in &s.extra {
            body[k] = v.clone();
        }
        body
    }

    async fn once(&self, body: &Value) -> Result<ModelTurn, (ModelCallError, Option<Duration>)> {
        let mut call = self.http.post(&self.url).json(body);
        if let Some(key) = &self.api_key {
            call = call.bearer_auth(key);
        }
        let work = async {
            let resp = call.send().await.map_err(|e| (from_reqwest(e), None))?;
            let status = resp.status();
            let retry_after = resp
                .headers()
                .get("retry-after")
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.trim().parse::<f64>().ok())
                .map(|s| Duration::from_secs_f64(s.clamp(0.0, 3600.0)));
            let text = resp.text().await.map_err(|e| (from_reqwest(e), None))?;
            if !status.is_success() {
                let message = serde_json::from_str::<Value>(&text)
                    .ok()
                    .and_then(|v| v["error"]["message"].as_str().map(str::to_string))
                    .unwrap_or_else(|| text.chars().take(500).collect());
                let lower = message.to_lowercase();
                if status.as_u16() == 400
                    && (lower.contains("context length") || lower.contains("too long"))
                {
                    return Err((ModelCallError::PromptTooLong(message), None));
                }
                return Err((
                    ModelCallError::Status {
                        status: status.as_u16(),
                        message,
                    },
                    retry_after,
                ));
            }
            parse_response(&text).map_err(|e| (e, None))
        };
        match tokio::time::timeout(self.timeout, work).await {
            Ok(r) => r,
            Err(_) => Err((ModelCallError::Timeout(self.timeout.as_secs_f64()), None)),
        }
    }
}

fn from_reqwest(e: reqwest::Error) -> ModelCallError {
    if e.is_timeout() {
        ModelCallError::Timeout(0.0)
    } else if e.is_decode() {
        ModelCallError::Malformed(e.to_string())
    } else {
        // Connect, request and body errors: the connection went away.
        let mut msg = e.to_string();
        let mut src = std::error::Error::source(&e);
        while let Some(s) = src {
            msg.push_str(": ");
            msg.push_str(&s.to_string());
            src = s.source();
        }
        ModelCallError::Connection(msg)
    }
}

/// Read an OpenAI chat-completion answer.
pub fn parse_response(text: &str) -> Result<ModelTurn, ModelCallError> {
    let v: Value =
        serde_json::from_str(text).map_err(|e| ModelCallError::Malformed(e.to_string()))?;
    let choice = v["choices"]
        .get(0)
        .ok_or_else(|| ModelCallError::Malformed("no choices".into()))?;
    let message: Message = serde_json::from_value(choice["message"].clone())
        .map_err(|e| ModelCallError::Malformed(format!("message: {e}")))?;
    let usage: Usage = serde_json::from_value(v["usage"].clone()).unwrap_or_default();
    Ok(ModelTurn {
        message,
        finish_reason: choice["finish_reason"]
            .as_str()
            .unwrap_or("stop")
            .to_string(),
        usage,
        trace: None,
    })
}

#[async_trait]
impl ChatModel for OpenAiChatModel {
    async fn chat(&self, req: ChatRequest) -> Result<ModelTurn, ModelCallError> {
        let body = self.body(&req);
        let mut attempt = 0u32;
        loop {
            match self.once(&body).await {
                Ok(turn) => return Ok(turn),
                Err((e, retry_after)) => {
                    if !e.is_retryable() || attempt >= self.retry.max_retries {
                        return Err(e);
                    }
                    let backoff = {
                        let exp = self.retry.base_delay.as_secs_f64() * 2f64.powi(attempt as i32);
                        let capped = exp.min(self.retry.max_delay.as_secs_f64());
                        Duration::from_secs_f64(capped * rand::rng().random_range(0.5..=1.0))
                    };
                    let wait = retry_after.map_or(backoff, |r| r.min(self.retry.max_delay));
                    tracing::debug!("model call failed ({e}); retry {} in {wait:?}", attempt + 1);
                    tokio::time::sleep(wait).await;
                    attempt += 1;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_body_carries_sampling_tools_and_extras() {
        let m = OpenAiChatModel::new("http://127.0.0.1:1/v1/", "m", None).unwrap();
        assert_eq!(m.url, "http://127.0.0.1:1/v1/chat/completions");
        let mut sampling = crate::SamplingArgs {
            max_tokens: 7,
            temperature: 0.5,
            top_p: 0.9,
            seed: Some(3),
            stop: vec!["</answer>".into()],
            ..Default::default()
        };
        sampling.extra.insert("top_k".into(), json!(5));
        sampling.min_p = Some(0.1);
        sampling.frequency_penalty = Some(0.5);
        sampling.logit_bias.insert(42, -100.0);
        sampling.stop_token_ids = vec![7];
        let req = ChatRequest {
            messages: vec![Message::user("hi")],
            tools: Some(vec![json!({"type": "function", "function": {"name": "f"}})]),
            sampling,
        };
        let b = m.body(&req);
        assert_eq!(b["model"], "m");
        assert_eq!(b["messages"][0]["content"], "hi");
        assert_eq!(
            (b["max_tokens"].clone(), b["seed"].clone()),
            (json!(7), json!(3))
        );
        assert_eq!(b["stop"][0], "</answer>");
        assert_eq!(b["tools"][0]["function"]["name"], "f");
        assert_eq!(b["min_p"], 0.1);
        assert_eq!(b["top_k"], 5);
        assert_eq!(b["frequency_penalty"], 0.5);
        assert_eq!(b["logit_bias"]["42"], -100.0);
        assert_eq!(b["stop_token_ids"], json!([7]));
        assert!(b.get("presence_penalty").is_none());
    }

    #[test]
    fn responses_parse_or_fail_as_malformed() {
        let t = parse_response(r#"{"choices":[{"message":{"role":"assistant","content":null,"tool_calls":[{"id":"a","type":"function","function":{"name":"f","arguments":"{}"}}]},"finish_reason":"tool_calls"}],"usage":{"prompt_tokens":3,"completion_tokens":2}}"#).unwrap();
        assert_eq!(t.finish_reason, "tool_calls");
        assert_eq!(t.usage.completion_tokens, 2);
        assert_eq!(t.message.tool_calls.unwrap()[0].function.name, "f");
        // No usage: zeros, not an error.
        let t = parse_response(r#"{"choices":[{"message":{"role":"assistant","content":"x"}}]}"#)
            .unwrap();
        assert_eq!(
            (t.usage.prompt_tokens, t.finish_reason.as_str()),
            (0, "stop")
        );
        for bad in [
            "",
            "{\"choices\": [",
            "{\"choices\": []}",
            "{\"choices\":[{\"message\":{\"content\":1}}]}",
        ] {
            assert!(
                matches!(parse_response(bad), Err(ModelCallError::Malformed(_))),
                "{bad}"
            );
        }
    }

    #[test]
    fn retryable_errors() {
        let s = |status| ModelCallError::Status {
            status,
            message: String::new(),
        };
        assert!(
            s(429).is_retryable()
                && s(500).is_retryable()
                && s(503).is_retryable()
                && s(408).is_retryable()
        );
        assert!(!s(400).is_retryable() && !s(401).is_retryable() && !s(404).is_retryable());
        assert!(ModelCallError::Timeout(1.0).is_retryable());
        assert!(ModelCallError::Connection("x".into()).is_retryable());
        assert!(!ModelCallError::PromptTooLong("x".into()).is_retryable());
    }
}
