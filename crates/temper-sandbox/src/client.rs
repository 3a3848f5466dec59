//! A small async client for the service (`temper sandbox serve`), so other
//! crates can call a remote sandbox the way they call [`crate::Pool`].

use crate::service::{RunCodeRequest, RunCodeResponse};

/// Why a call to the service failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ClientError {
    /// Could not reach the service, or its answer was not the expected JSON.
    #[error("sandbox service: {0}")]
    Http(#[from] reqwest::Error),
    /// The service answered with an error status.
    #[error("sandbox service answered {status}: {message}")]
    Status {
        /// HTTP status code.
        status: u16,
        /// The service's message.
        message: String,
    },
}

/// Calls `POST /run_code` and `GET /health` on a sandbox service.
#[derive(Debug, Clone)]
pub struct Client {
    base_url: String,
    api_key: Option<String>,
    http: reqwest::Client,
}

impl Client {
    /// `base_url` like `http://127.0.0.1:8080`; `api_key` sent as a bearer
    /// token when given.
    pub fn new(base_url: impl Into<String>, api_key: Option<String>) -> Self {
        Client {
            base_url: base_url.into().trim_end_matches('/').to_string(),
            api_key,
            http: reqwest::Client::new(),
        }
    }

    /// Like [`Client::new`] with a configured `reqwest::Client` (proxies,
    /// timeouts).
    pub fn with_http_client(
        base_url: impl Into<String>,
        api_key: Option<String>,
        http: reqwest::Client,
    ) -> Self {
        Client {
            http,
            ..Client::new(base_url, api_key)
        }
    }

    /// A client that never goes through an HTTP proxy: for a service on
    /// this machine (tests, benchmarks), whatever `HTTP_PROXY` says.
    pub fn local(
        base_url: impl Into<String>,
        api_key: Option<String>,
    ) -> Result<Self, ClientError> {
        let http = reqwest::Client::builder().no_proxy().build()?;
        Ok(Client::with_http_client(base_url, api_key, http))
    }

    /// `GET /health`.
    pub async fn health(&self) -> Result<(), ClientError> {
        let resp = self
            .http
            .get(format!("{}/health", self.base_url))
            .send()
            .await?;
        if !resp.status().is_success() {
            return Err(ClientError::Status {
                status: resp.status().as_u16(),
                message: resp.text().await.unwrap_or_default(),
            });
        }
        Ok(())
    }

    /// `POST /run_code`. A program that fails or times out is a response,
    /// not an error; a 4xx/5xx is [`ClientError::Status`].
    pub async fn run_code(&self, req: &RunCodeRequest) -> Result<RunCodeResponse, ClientError> {
        let mut call = self
            .http
            .post(format!("{}/run_code", self.base_url))
            .json(req);
        if let Some(key) = &self.api_key {
            call = call.bearer_auth(key);
        }
        let resp = call.send().await?;
        let status = resp.status();
        if !status.is_success() {
            let text = resp.text().await.unwrap_or_default();
            let message = serde_json::from_str::<RunCodeResponse>(&text)
                .map(|r| r.message)
                .unwrap_or(text);
            return Err(ClientError::Status {
                status: status.as_u16(),
                message,
            });
        }
        Ok(resp.json().await?)
    }
}
