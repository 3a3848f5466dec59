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
//! | `rollout`, `{row, base_url, model, sampling}` | `{completion, stop_condition?, error?, is_truncated?, state?}` |
//!
//! A failure is `{"id": N, "error": "message"}`. The Python helper
//! `python/temper_env.py` implements the process side.
//!
//! A process whose `info` says `"rollout": true` plays each rollout itself:
//! temper sends `rollout` with the `/v1` base URL of an OpenAI-compatible
//! endpoint that this rollout serves from its model ([`crate::gate`]), and
//! the process's program calls the model there. The rollout's model turns
//! are the calls that came through the gate, as the model answered them
//! (a trained policy's token ids and logprobs included), so RL trains on
//! exactly what was sampled. That is how verifiers environments run
//! ([`ExternalEnv::verifiers`], the bridge `python/temper_verifiers.py`).

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Instant;

use async_trait::async_trait;
use futures::channel::oneshot;
use serde::Deserialize;
use serde_json::{json, Value};

use crate::gate::{answer_calls, Gate, MODEL_NAME};
use crate::{
    stop, ChatModel, EnvError, EnvResponder, EnvResponse, Environment, EvalDefaults, Harness,
    Message, Rollout, Row, SamplingArgs, Score, Split, TokenUsage,
};

/// The verifiers bridge, run by the environment's Python (`python -c`).
const VERIFIERS_BRIDGE: &str = include_str!("../../../python/temper_verifiers.py");

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
        cmd.arg("-c").arg(command);
        if let Some(d) = dir.filter(|d| !d.as_os_str().is_empty()) {
            cmd.current_dir(d);
        }
        Self::start(cmd).map_err(|e| EnvError::External(format!("cannot start `{command}`: {e}")))
    }

    /// Starts `cmd` with piped stdin and stdout (stderr passes through).
    fn start(mut cmd: Command) -> std::io::Result<Arc<Self>> {
        cmd.stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        let mut child = cmd.spawn()?;
        let stdin = child
            .stdin
            .take()
            .ok_or_else(|| std::io::Error::other("no stdin"))?;
        let stdout = child
            .stdout
            .take()
            .ok_or_else(|| std::io::Error::other("no stdout"))?;
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
                if let Some(tx) = reader_pending
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .remove(&id)
                {
                    let _ = tx.send(reply);
                }
            }
            // The process is gone: fail whatever still waits.
            {
                let mut p = reader_pending
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner);
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
        self.pending
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(id, tx);
        let line = json!({"id": id, "method": method, "params": params}).to_string();
        let written = {
            let mut w = self.stdin.lock().unwrap_or_else(PoisonError::into_inner);
            writeln!(w, "{line}").and_then(|_| w.flush())
        };
        if written.is_err() {
            if let Some(tx) = self
                .pending
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .remove(&id)
            {
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
        let mut c = self.child.lock().unwrap_or_else(PoisonError::into_inner);
        let _ = c.kill();
        let _ = c.wait();
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
    /// The process plays each rollout itself, calling the model through
    /// the gate (the `rollout` method).
    #[serde(default)]
    rollout: bool,
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
    /// Rollouts are played by the process (`info.rollout`).
    plays: bool,
}

impl ExternalEnv {
    /// Start `command` (through `sh -c`, in `dir`) and ask for its info.
    pub fn spawn(command: &str, dir: Option<&Path>, args: &Value) -> Result<Self, EnvError> {
        let conn = Conn::spawn(command, dir)?;
        Self::connect(conn, args)
    }

    /// A verifiers environment (`verifiers:TARGET`): the bridge shipped with
    /// temper, run by `args.python` (else `$TEMPER_VERIFIERS_PYTHON`, else
    /// `python3`), loads `TARGET` — a taskset id (an importable module or
    /// package, as `vf-eval` takes it) or a path to one — with the rest of
    /// `args` as its verifiers env config, and plays each rollout unchanged:
    /// its harness calls the model through the gate, its rewards score.
    pub fn verifiers(target: &str, args: &Value) -> Result<Self, EnvError> {
        let id = format!("verifiers:{target}");
        let bad = |message: String| EnvError::BadArgs {
            env: id.clone(),
            message,
        };
        if target.trim().is_empty() {
            return Err(bad(
                "name the taskset: verifiers:MODULE or verifiers:PATH".into()
            ));
        }
        let mut args = match args {
            Value::Null => serde_json::Map::new(),
            Value::Object(m) => m.clone(),
            other => return Err(bad(format!("args must be a table, got {other}"))),
        };
        let python = match args.remove("python") {
            Some(Value::String(p)) => p,
            Some(other) => return Err(bad(format!("`python` must be a path, got {other}"))),
            None => std::env::var("TEMPER_VERIFIERS_PYTHON").unwrap_or_else(|_| "python3".into()),
        };
        let mut cmd = Command::new(&python);
        cmd.arg("-u").arg("-c").arg(VERIFIERS_BRIDGE).arg(target);
        let conn = Conn::start(cmd).map_err(|e| {
            EnvError::External(format!(
                "{id}: cannot start `{python}`: {e}; set `python` in the environment's args \
                 (or TEMPER_VERIFIERS_PYTHON) to a Python with verifiers installed"
            ))
        })?;
        Self::connect(conn, &Value::Object(args)).map_err(|e| match e {
            EnvError::External(m) => EnvError::External(format!("{id}: {m}")),
            other => other,
        })
    }

    /// Ask a started process for its info.
    fn connect(conn: Arc<Conn>, args: &Value) -> Result<Self, EnvError> {
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
            plays: info.rollout,
        })
    }

    /// One rollout played by the process, its model calls answered through
    /// a gate.
    async fn play(&self, model: &dyn ChatModel, row: &Row, sampling: &SamplingArgs) -> Rollout {
        let started = Instant::now();
        let failed = |e: String| Rollout {
            error: Some(e),
            stop_condition: Some(stop::ERROR.into()),
            ..Rollout::default()
        };
        let (gate, calls) = Gate::new();
        let base_url = match gate.base_url() {
            Ok(u) => u,
            Err(e) => return failed(e),
        };
        drop(gate);
        let params = json!({
            "row": row, "base_url": base_url, "model": MODEL_NAME, "sampling": sampling,
        });
        let (answer, turns) =
            answer_calls(model, sampling, calls, self.conn.call("rollout", params)).await;
        let mut rollout = match answer.and_then(|v| played(v, &turns)) {
            Ok(r) => r,
            Err(e) => failed(e),
        };
        rollout.token_usage = TokenUsage {
            input_tokens: turns.iter().map(|t| t.usage.prompt_tokens).sum(),
            output_tokens: turns.iter().map(|t| t.usage.completion_tokens).sum(),
        };
        rollout.model_turns = turns;
        rollout.timing.generation_ms = started.elapsed().as_secs_f64() * 1e3;
        rollout.timing.total_ms = rollout.timing.generation_ms;
        rollout
    }
}

/// A `rollout` answer as a [`Rollout`] (model turns and timing not yet set).
fn played(v: Value, turns: &[crate::ModelTurn]) -> Result<Rollout, String> {
    let completion: Vec<Message> = serde_json::from_value(v["completion"].clone())
        .map_err(|e| format!("bad rollout completion: {e}"))?;
    let error = match &v["error"] {
        Value::Null => None,
        Value::String(s) => Some(s.clone()),
        other => Some(other.to_string()),
    };
    let stop_condition = v["stop_condition"]
        .as_str()
        .map(str::to_string)
        .or_else(|| {
            Some(
                if error.is_some() {
                    stop::ERROR
                } else {
                    stop::COMPLETED
                }
                .into(),
            )
        });
    let is_truncated = v["is_truncated"].as_bool().unwrap_or(false)
        || turns.last().is_some_and(|t| t.finish_reason == "length");
    Ok(Rollout {
        completion,
        is_completed: error.is_none(),
        is_truncated,
        stop_condition,
        error,
        state: v.get("state").cloned().unwrap_or(json!({})),
        ..Rollout::default()
    })
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
        if self.plays {
            return self.play(model, row, sampling).await;
        }
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
