//! Environments in any language: a JSON-lines protocol over stdio.
//!
//! temper starts the command once and writes one request per line to its
//! stdin; the process answers one line per request on stdout, in any order,
//! echoing `id`. Its stderr passes through.
//!
//! | request (`method`, `params`) | `result` |
//! |---|---|
//! | `info`, `{args}` | `{env_id, multi_turn, max_turns, eval_defaults?}` (`eval_defaults`: `num_examples`, `rollouts_per_example`, `max_tokens`, `temperature`, `pass_threshold`) |
//! | `rows`, `{split, n, seed}` | `[{prompt \| question, answer?, info?}]` |
//! | `env_response`, `{row, messages, state}` | `{messages, done, state}` |
//! | `score`, `{row, rollouts}` | `[{reward, metrics}]` |
//!
//! A failure is `{"id": N, "error": "message"}`. The Python helper
//! `python/temper_env.py` implements the process side.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use futures::channel::oneshot;
use serde::Deserialize;
use serde_json::{json, Value};

use crate::{
    ChatModel, EnvError, EnvResponder, EnvResponse, Environment, EvalDefaults, Harness, Message,
    Rollout, Row, SamplingArgs, Score, Split,
};

type Pending = Arc<Mutex<HashMap<u64, oneshot::Sender<Result<Value, String>>>>>;

/// The connection to one environment (or reward) process.
pub(crate) struct Conn {
    stdin: Mutex<ChildStdin>,
    pending: Pending,
    next_id: AtomicU64,
    child: Mutex<Child>,
}

impl Conn {
    pub(crate) fn spawn(command: &str, dir: Option<&Path>) -> Result<Arc<Self>, EnvError> {
        let mut cmd = Command::new("sh");
        cmd.arg("-c")
            .arg(command)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        if let Some(d) = dir.filter(|d| !d.as_os_str().is_empty()) {
            cmd.current_dir(d);
        }
        let mut child = cmd
            .spawn()
            .map_err(|e| EnvError::External(format!("cannot start `{command}`: {e}")))?;
        let stdin = child
            .stdin
            .take()
            .ok_or_else(|| EnvError::External("no stdin".into()))?;
        let stdout = child
            .stdout
            .take()
            .ok_or_else(|| EnvError::External("no stdout".into()))?;
        let pending: Pending = Arc::new(Mutex::new(HashMap::new()));
        let reader_pending = pending.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                let Ok(v) = serde_json::from_str::<Value>(&line) else {
                    tracing::warn!("external environment wrote a non-JSON line: {line}");
                    continue;
                };
                let Some(id) = v["id"].as_u64() else { continue };
                let reply = match v.get("error") {
                    Some(e) if !e.is_null() => {
                        Err(e.as_str().map_or_else(|| e.to_string(), str::to_string))
                    }
                    _ => Ok(v.get("result").cloned().unwrap_or(Value::Null)),
                };
                if let Some(tx) = reader_pending.lock().ok().and_then(|mut p| p.remove(&id)) {
                    let _ = tx.send(reply);
                }
            }
            // The process is gone: fail whatever still waits.
            if let Ok(mut p) = reader_pending.lock() {
                for (_, tx) in p.drain() {
                    let _ = tx.send(Err("the environment process exited".into()));
                }
            }
        });
        Ok(Arc::new(Conn {
            stdin: Mutex::new(stdin),
            pending,
            next_id: AtomicU64::new(1),
            child: Mutex::new(child),
        }))
    }

    fn send(&self, method: &str, params: Value) -> oneshot::Receiver<Result<Value, String>> {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = oneshot::channel();
        if let Ok(mut p) = self.pending.lock() {
            p.insert(id, tx);
        }
        let line = json!({"id": id, "method": method, "params": params}).to_string();
        let written = self.stdin.lock().map_err(|_| ()).and_then(|mut w| {
            writeln!(w, "{line}")
                .and_then(|_| w.flush())
                .map_err(|_| ())
        });
        if written.is_err() {
            if let Some(tx) = self.pending.lock().ok().and_then(|mut p| p.remove(&id)) {
                let _ = tx.send(Err("cannot write to the environment process".into()));
            }
        }
        rx
    }

    pub(crate) async fn call(&self, method: &str, params: Value) -> Result<Value, String> {
        self.send(method, params)
            .await
            .unwrap_or_else(|_| Err("the environment process exited".into()))
    }

    /// For the synchronous trait methods; the reply comes from the reader
    /// thread, so this never needs the async runtime.
    pub(crate) fn call_blocking(&self, method: &str, params: Value) -> Result<Value, String> {
        futures::executor::block_on(self.call(method, params))
    }
}

impl Drop for Conn {
    fn drop(&mut self) {
        if let Ok(mut c) = self.child.lock() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

#[derive(Deserialize)]
struct Info {
    env_id: String,
    #[serde(default)]
    multi_turn: bool,
    #[serde(default = "ten")]
    max_turns: usize,
    #[serde(default)]
    eval_defaults: Option<EvalDefaultsWire>,
}

fn ten() -> usize {
    10
}

#[derive(Deserialize)]
struct EvalDefaultsWire {
    #[serde(default)]
    num_examples: Option<usize>,
    #[serde(default)]
    rollouts_per_example: Option<usize>,
    #[serde(default)]
    max_tokens: Option<usize>,
    #[serde(default)]
    temperature: Option<f64>,
    #[serde(default)]
    pass_threshold: Option<f64>,
}

/// An environment served by another process.
pub struct ExternalEnv {
    id: String,
    conn: Arc<Conn>,
    harness: Harness,
    defaults: EvalDefaults,
}

impl ExternalEnv {
    /// Start `command` (through `sh -c`, in `dir`) and ask for its info.
    pub fn spawn(command: &str, dir: Option<&Path>, args: &Value) -> Result<Self, EnvError> {
        let conn = Conn::spawn(command, dir)?;
        let info = conn
            .call_blocking("info", json!({"args": args}))
            .map_err(EnvError::External)?;
        let info: Info = serde_json::from_value(info)
            .map_err(|e| EnvError::External(format!("bad info answer: {e}")))?;
        let harness = if info.multi_turn {
            Harness::MultiTurn {
                responder: Arc::new(ExternalResponder { conn: conn.clone() }),
                max_turns: info.max_turns.max(1),
                max_total_tokens: None,
            }
        } else {
            Harness::SingleTurn
        };
        let d = EvalDefaults::default();
        let defaults = match info.eval_defaults {
            Some(w) => EvalDefaults {
                num_examples: w.num_examples.unwrap_or(d.num_examples),
                rollouts_per_example: w.rollouts_per_example.unwrap_or(1),
                sampling: SamplingArgs {
                    max_tokens: w.max_tokens.unwrap_or(d.sampling.max_tokens),
                    temperature: w.temperature.unwrap_or(d.sampling.temperature),
                    ..SamplingArgs::default()
                },
                pass_threshold: w.pass_threshold,
            },
            None => d,
        };
        Ok(ExternalEnv {
            id: info.env_id,
            conn,
            harness,
            defaults,
        })
    }
}

struct ExternalResponder {
    conn: Arc<Conn>,
}

#[async_trait]
impl EnvResponder for ExternalResponder {
    fn initial_state(&self, _row: &Row) -> Value {
        json!({})
    }

    async fn respond(
        &self,
        row: &Row,
        messages: &[Message],
        state: &mut Value,
    ) -> Result<EnvResponse, String> {
        let v = self
            .conn
            .call(
                "env_response",
                json!({"row": row, "messages": messages, "state": state}),
            )
            .await?;
        let msgs: Vec<Message> = serde_json::from_value(v["messages"].clone())
            .map_err(|e| format!("bad env_response messages: {e}"))?;
        if let Some(s) = v.get("state") {
            *state = s.clone();
        }
        Ok(EnvResponse {
            messages: msgs,
            done: v["done"].as_bool().unwrap_or(false),
        })
    }
}

#[async_trait]
impl Environment for ExternalEnv {
    fn id(&self) -> &str {
        &self.id
    }

    fn rows(&self, split: Split, n: usize, seed: u64) -> Result<Vec<Row>, EnvError> {
        let v = self
            .conn
            .call_blocking("rows", json!({"split": split, "n": n, "seed": seed}))
            .map_err(EnvError::External)?;
        let Value::Array(items) = v else {
            return Err(EnvError::External("rows: expected a list".into()));
        };
        items
            .into_iter()
            .enumerate()
            .map(|(i, item)| {
                let prompt = match (&item["prompt"], &item["question"]) {
                    (Value::Array(_), _) => serde_json::from_value(item["prompt"].clone())
                        .map_err(|e| EnvError::External(format!("row {i}: prompt: {e}")))?,
                    (_, Value::String(q)) => vec![Message::user(q.clone())],
                    _ => {
                        return Err(EnvError::External(format!(
                            "row {i}: needs prompt or question"
                        )))
                    }
                };
                Ok(Row {
                    example_id: i as u64,
                    prompt,
                    answer: match &item["answer"] {
                        Value::Null => None,
                        Value::String(s) => Some(s.clone()),
                        other => Some(other.to_string()),
                    },
                    info: item.get("info").cloned().unwrap_or(json!({})),
                })
            })
            .collect()
    }

    async fn rollout(&self, model: &dyn ChatModel, row: &Row, sampling: &SamplingArgs) -> Rollout {
        self.harness.run(model, row, sampling).await
    }

    async fn score_group(&self, row: &Row, rollouts: &[Rollout]) -> Vec<Score> {
        let wire: Vec<Value> = rollouts
            .iter()
            .map(|r| {
                json!({
                    "completion": r.completion, "state": r.state, "stop_condition": r.stop_condition,
                    "error": r.error, "is_truncated": r.is_truncated,
                })
            })
            .collect();
        let result = self
            .conn
            .call("score", json!({"row": row, "rollouts": wire}))
            .await
            .and_then(|v| serde_json::from_value::<Vec<Score>>(v).map_err(|e| e.to_string()));
        let why = match result {
            Ok(scores) if scores.len() == rollouts.len() => return scores,
            Ok(scores) => format!(
                "external score: {} scores for {} rollouts",
                scores.len(),
                rollouts.len()
            ),
            Err(e) => format!("external score failed: {e}"),
        };
        tracing::warn!("{why}");
        let failed = Score {
            error: Some(why),
            ..Score::default()
        };
        vec![failed; rollouts.len()]
    }

    fn eval_defaults(&self) -> EvalDefaults {
        self.defaults.clone()
    }
}
