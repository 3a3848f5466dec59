//! The services an environment calls while it runs — the sandbox service,
//! a judge's endpoint — and the check that each one answers before the
//! first rollout, so that a service that is down or refuses the key ends
//! `temper eval` / `temper train rl` at once, naming it, instead of
//! scoring every rollout 0.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;

use crate::{EnvError, Environment};

/// Where the sandbox service is when nothing says: `$TEMPER_SANDBOX_URL`.
pub const SANDBOX_URL_ENV: &str = "TEMPER_SANDBOX_URL";
/// The sandbox service's URL when neither the environment nor
/// `$TEMPER_SANDBOX_URL` names one.
pub const DEFAULT_SANDBOX_URL: &str = "http://127.0.0.1:8080";
/// A file whose first line is the sandbox service's API key (the file
/// `temper sandbox serve --api-key-file` reads); `$TEMPER_SANDBOX_API_KEY`
/// (the key itself) wins when both are set.
pub const SANDBOX_KEY_FILE_ENV: &str = "TEMPER_SANDBOX_API_KEY_FILE";

/// Something an environment needs to reach while it runs.
#[async_trait]
pub trait Service: Send + Sync {
    /// What it is and where, for messages and to check each one once:
    /// `the sandbox service at http://127.0.0.1:8080`.
    fn describe(&self) -> String;
    /// Whether it works, in words a user can act on when it does not.
    async fn check(&self) -> Result<(), String>;
}

/// Check every service `env` needs (each once, concurrently): what was
/// checked, or an error naming each one that failed and why.
pub async fn check_services(env: &dyn Environment) -> Result<Vec<String>, EnvError> {
    let mut seen = std::collections::BTreeSet::new();
    let services: Vec<Arc<dyn Service>> = env
        .services()
        .into_iter()
        .filter(|s| seen.insert(s.describe()))
        .collect();
    let results =
        futures::future::join_all(services.iter().map(|s| async move { (s, s.check().await) }))
            .await;
    let failed: Vec<String> = results
        .into_iter()
        .filter_map(|(s, r)| r.err().map(|e| format!("{}: {e}", s.describe())))
        .collect();
    if failed.is_empty() {
        Ok(services.iter().map(|s| s.describe()).collect())
    } else {
        Err(EnvError::Service {
            env: env.id().to_string(),
            message: failed.join("\n"),
        })
    }
}

/// The sandbox service (`temper sandbox serve`) as environments call it:
/// its URL and the client that sends its API key.
#[derive(Debug, Clone)]
pub struct SandboxService {
    url: String,
    client: temper_sandbox::Client,
    keyed: bool,
}

impl SandboxService {
    /// The service at `url` (default `$TEMPER_SANDBOX_URL`, else
    /// [`DEFAULT_SANDBOX_URL`]), with the key in `$TEMPER_SANDBOX_API_KEY`
    /// or else the file named by `$TEMPER_SANDBOX_API_KEY_FILE`. A key file
    /// that cannot be read, or is empty, is an error here, not a 401 later.
    pub fn new(url: Option<String>) -> Result<Self, String> {
        let url = url
            .or_else(|| std::env::var(SANDBOX_URL_ENV).ok())
            .unwrap_or_else(|| DEFAULT_SANDBOX_URL.into());
        let key = sandbox_key()?;
        Ok(Self::with_key(url, key))
    }

    /// The service at `url` with this key (none: send none).
    pub fn with_key(url: impl Into<String>, key: Option<String>) -> Self {
        let url = url.into();
        let keyed = key.is_some();
        // A local service must not go through an HTTP proxy; a client
        // without one only fails to build where TLS cannot initialise.
        let client = temper_sandbox::Client::local(url.clone(), key.clone())
            .unwrap_or_else(|_| temper_sandbox::Client::new(url.clone(), key));
        SandboxService { url, client, keyed }
    }

    /// The client, for `POST /run_code`.
    pub fn client(&self) -> &temper_sandbox::Client {
        &self.client
    }

    /// Its URL.
    pub fn url(&self) -> &str {
        &self.url
    }
}

/// The sandbox API key from the environment: `$TEMPER_SANDBOX_API_KEY`,
/// else the first line of `$TEMPER_SANDBOX_API_KEY_FILE`.
fn sandbox_key() -> Result<Option<String>, String> {
    if let Some(key) = std::env::var(temper_sandbox::API_KEY_ENV)
        .ok()
        .filter(|k| !k.is_empty())
    {
        return Ok(Some(key));
    }
    let Some(path) = std::env::var_os(SANDBOX_KEY_FILE_ENV).filter(|p| !p.is_empty()) else {
        return Ok(None);
    };
    let path = std::path::PathBuf::from(path);
    let text = std::fs::read_to_string(&path).map_err(|e| {
        format!(
            "${SANDBOX_KEY_FILE_ENV}: cannot read the sandbox API key from {}: {e}",
            path.display()
        )
    })?;
    match text.lines().next().map(str::trim) {
        Some(key) if !key.is_empty() => Ok(Some(key.to_string())),
        _ => Err(format!(
            "${SANDBOX_KEY_FILE_ENV}: {} holds no API key on its first line",
            path.display()
        )),
    }
}

#[async_trait]
impl Service for SandboxService {
    fn describe(&self) -> String {
        format!("the sandbox service at {}", self.url)
    }

    /// Runs `print("ok")`: reaching the service, the key and a working
    /// sandbox, all at once.
    async fn check(&self) -> Result<(), String> {
        let req = temper_sandbox::service::RunCodeRequest {
            code: "print('ok')".into(),
            language: "python".into(),
            run_timeout: Some(10.0),
            ..Default::default()
        };
        let resp = tokio::time::timeout(Duration::from_secs(30), self.client.run_code(&req))
            .await
            .map_err(|_| "no answer within 30 s".to_string())?;
        match resp {
            Ok(r) if r.status == "Success" => Ok(()),
            Ok(r) => Err(format!(
                "a test run of print('ok') ended {}: {} {}",
                r.status,
                r.message,
                r.run_result.map(|x| x.stderr).unwrap_or_default()
            )),
            Err(temper_sandbox::ClientError::Status { status, message })
                if status == 401 || status == 403 =>
            {
                let sent = if self.keyed {
                    "the key sent was refused"
                } else {
                    "no key was sent"
                };
                Err(format!(
                    "answered {status} ({message}): {sent}; set ${} to the service's key, \
                     or ${SANDBOX_KEY_FILE_ENV} to the file `temper sandbox serve --api-key-file` reads",
                    temper_sandbox::API_KEY_ENV
                ))
            }
            Err(temper_sandbox::ClientError::Http(e)) if e.is_connect() || e.is_timeout() => {
                Err(format!(
                    "cannot reach it ({e}); is `temper sandbox serve` running? \
                     ${SANDBOX_URL_ENV} or the environment's `sandbox_url` sets where"
                ))
            }
            Err(e) => Err(e.to_string()),
        }
    }
}

/// An OpenAI-compatible endpoint a reward calls (the judge): `GET
/// /models` must answer and list the model, where it lists models.
pub(crate) struct EndpointService {
    pub(crate) model: Arc<crate::openai::OpenAiChatModel>,
    pub(crate) what: &'static str,
}

#[async_trait]
impl Service for EndpointService {
    fn describe(&self) -> String {
        format!(
            "the {} endpoint {} (model `{}`)",
            self.what,
            self.model.base_url(),
            self.model.model()
        )
    }

    async fn check(&self) -> Result<(), String> {
        match self.model.list_models(Duration::from_secs(30)).await {
            Ok(None) => Ok(()),
            Ok(Some(ids)) if ids.iter().any(|id| id == self.model.model()) => Ok(()),
            Ok(Some(ids)) => Err(format!(
                "it does not serve `{}`; it offers: {}",
                self.model.model(),
                ids.join(", ")
            )),
            Err(e) => Err(e.to_string()),
        }
    }
}
