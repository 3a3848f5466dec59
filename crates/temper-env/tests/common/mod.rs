//! A scripted chat model: answers from a list, records what it was asked.
#![allow(dead_code)]

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use temper_env::{
    ChatModel, ChatRequest, FunctionCall, Message, ModelCallError, ModelTurn, TokenTrace, ToolCall,
    Usage,
};

pub struct Scripted {
    replies: Mutex<VecDeque<Result<ModelTurn, ModelCallError>>>,
    pub seen: Mutex<Vec<ChatRequest>>,
}

impl Scripted {
    pub fn new(replies: Vec<Result<ModelTurn, ModelCallError>>) -> Self {
        Scripted {
            replies: Mutex::new(replies.into()),
            seen: Mutex::new(Vec::new()),
        }
    }
    pub fn texts(texts: &[&str]) -> Self {
        Scripted::new(texts.iter().map(|t| Ok(say(t))).collect())
    }
    pub fn requests(&self) -> Vec<ChatRequest> {
        self.seen.lock().unwrap().clone()
    }
}

#[async_trait]
impl ChatModel for Scripted {
    async fn chat(&self, req: ChatRequest) -> Result<ModelTurn, ModelCallError> {
        self.seen.lock().unwrap().push(req);
        self.replies
            .lock()
            .unwrap()
            .pop_front()
            .unwrap_or_else(|| Err(ModelCallError::Other("script exhausted".into())))
    }
}

pub fn say(text: &str) -> ModelTurn {
    ModelTurn {
        message: Message::assistant(text),
        finish_reason: "stop".into(),
        usage: Usage {
            prompt_tokens: 10,
            completion_tokens: 6,
        },
        trace: None,
    }
}

pub fn call_tools(calls: &[(&str, &str)]) -> ModelTurn {
    let mut m = Message::assistant("");
    m.content = None;
    m.tool_calls = Some(
        calls
            .iter()
            .enumerate()
            .map(|(i, (name, args))| ToolCall {
                id: format!("call_{i}"),
                kind: "function".into(),
                function: FunctionCall {
                    name: name.to_string(),
                    arguments: args.to_string(),
                },
            })
            .collect(),
    );
    ModelTurn {
        message: m,
        finish_reason: "tool_calls".into(),
        usage: Usage {
            prompt_tokens: 10,
            completion_tokens: 6,
        },
        trace: Some(TokenTrace {
            prompt_ids: vec![9],
            completion_ids: vec![1, 2, 3],
            logprobs: vec![-0.1, -0.2, -0.3],
            version: 0,
            temperature: 1.0,
        }),
    }
}

/// The sandbox service on a free port, or `None` where this host cannot
/// create the namespaces it needs.
/// `warm`: runs fork from a pool of warm workers (as `temper sandbox
/// serve` does) instead of starting an interpreter each.
pub async fn sandbox_service(warm: bool) -> Option<String> {
    sandbox_service_with_key(warm, None).await
}

/// [`sandbox_service`] that requires `key` (as `--api-key-file` does).
pub async fn sandbox_service_with_key(warm: bool, key: Option<&str>) -> Option<String> {
    use temper_sandbox::service::{app, AppState, Runner};
    use temper_sandbox::{ExecRequest, Language, Pool, PoolConfig, Sandbox, SandboxConfig};
    let sandbox = Sandbox::new(SandboxConfig::default()).ok()?;
    if let Err(e) = sandbox.run(&ExecRequest::new(Language::Python, "print(1)")) {
        eprintln!("SKIPPED: sandbox unavailable on this host: {e}");
        return None;
    }
    let sandbox = Arc::new(sandbox);
    let runner = if warm {
        let pool = Pool::new(
            sandbox,
            PoolConfig {
                size: 4,
                max_runs_per_worker: 200,
            },
        )
        .expect("warm pool");
        Runner::Pool(Arc::new(pool))
    } else {
        Runner::Cold(sandbox)
    };
    let state = AppState::new(runner, key.map(str::to_string), 4);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.ok()?;
    let addr = listener.local_addr().ok()?;
    tokio::spawn(async move { axum::serve(listener, app(state)).await });
    Some(format!("http://{addr}"))
}

/// `reward.py` in `dir`: `body` between the `temper_reward` import and
/// `serve()`.
pub fn write_reward_py(dir: &std::path::Path, body: &str) {
    let helper = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../python");
    let text = format!(
        "import sys\nsys.path.insert(0, {:?})\nfrom temper_reward import reward, serve\n{body}\nif __name__ == '__main__':\n    serve()\n",
        helper.display().to_string()
    );
    std::fs::write(dir.join("reward.py"), text).unwrap();
}
