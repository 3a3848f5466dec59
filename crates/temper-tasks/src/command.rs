//! `command`: any external program as the agent.
//!
//! The program (`sh -c PROGRAM`) runs on the host, in the trial's `agent/`
//! directory, with:
//!
//! - the task instruction on stdin and in `$TEMPER_INSTRUCTION_FILE`;
//! - `OPENAI_BASE_URL`, `OPENAI_API_KEY` (`EMPTY` when none was given) and
//!   `OPENAI_MODEL`, so an agent built on the `openai` client needs no flags;
//! - `TEMPER_EXEC_URL` and `TEMPER_EXEC_TOKEN`: `POST $TEMPER_EXEC_URL`
//!   with `Authorization: Bearer $TEMPER_EXEC_TOKEN` and a JSON body
//!   `{"command": "...", "timeout_sec": 30}` runs the command with bash in
//!   the trial's sandbox (in `$TEMPER_WORKDIR`) and answers
//!   `{"stdout", "stderr", "exit_code", "status"}`;
//! - with token capture on (`capture`, `temper tasks run --capture`),
//!   `OPENAI_BASE_URL` is a fresh episode's base URL on the `temper serve`
//!   endpoint (`http://host:port/episodes/<id>/v1`, id also in
//!   `$TEMPER_EPISODE`) and `OPENAI_API_KEY` the episode's token (not the
//!   server's key): its calls are recorded there and land in
//!   `agent/tokens.jsonl`;
//! - `TEMPER_TRAJECTORY_FILE`: where it may write its own ATIF trajectory
//!   (otherwise the trajectory records its exec calls).
//!
//! The exec endpoint listens on 127.0.0.1 only, for this trial only. When
//! the program exits or reaches the agent's deadline, its whole process
//! group is killed, and so is every process in its cgroup
//! ([`temper_sandbox::HostCgroup`]): a child that called `setsid` or
//! double-forked is gone before the verifier runs. Where no cgroup is
//! writable (unprivileged, no delegation) only the process group is killed,
//! and the trial's `process_cleanup` metadata says so.

use std::collections::BTreeMap;
use std::io::Write;
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::routing::post;
use axum::{Json, Router};
use serde::Deserialize;
use serde_json::{json, Map, Value};
use temper_sandbox::ExecStatus;

use crate::agent::{failure_of, render_output, Agent, AgentContext, AgentFailure, AgentOutcome};
use crate::atif::{Observation, ObservationResult, Step, ToolCall, Trajectory};
use crate::capture::Episode;

/// The agent.
pub struct CommandAgent {
    /// Shell command line of the program.
    pub program: String,
    /// Endpoint for `OPENAI_BASE_URL`.
    pub base_url: Option<String>,
    /// Model for `OPENAI_MODEL`.
    pub model: Option<String>,
    /// Key for `OPENAI_API_KEY`.
    pub api_key: Option<String>,
    /// Token capture: `OPENAI_BASE_URL` is a fresh episode's base URL on
    /// the `temper serve` at `base_url`, and its records land in
    /// `agent/tokens.jsonl`.
    pub capture: bool,
    /// Runs the exec endpoint.
    pub runtime: tokio::runtime::Handle,
}

impl std::fmt::Debug for CommandAgent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CommandAgent")
            .field("program", &self.program)
            .finish_non_exhaustive()
    }
}

#[derive(Debug, Deserialize)]
struct ExecBody {
    command: String,
    #[serde(default)]
    timeout_sec: Option<f64>,
}

type Reply = tokio::sync::oneshot::Sender<Value>;

#[derive(Clone)]
struct ExecState {
    token: String,
    tx: mpsc::Sender<(ExecBody, Reply)>,
}

async fn exec_handler(
    State(st): State<ExecState>,
    headers: HeaderMap,
    Json(body): Json<ExecBody>,
) -> Result<Json<Value>, (StatusCode, String)> {
    let auth = headers
        .get(axum::http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "));
    let ok = auth.is_some_and(|a| {
        use subtle::ConstantTimeEq;
        bool::from(a.as_bytes().ct_eq(st.token.as_bytes()))
    });
    if !ok {
        return Err((StatusCode::UNAUTHORIZED, "bad TEMPER_EXEC_TOKEN".into()));
    }
    let (reply, rx) = tokio::sync::oneshot::channel();
    st.tx
        .send((body, reply))
        .map_err(|_| (StatusCode::GONE, "the trial is over".into()))?;
    rx.await
        .map(Json)
        .map_err(|_| (StatusCode::GONE, "the trial is over".into()))
}

impl Agent for CommandAgent {
    fn name(&self) -> &str {
        "command"
    }
    fn model_name(&self) -> Option<String> {
        self.model.clone()
    }
    fn settings(&self) -> Map<String, Value> {
        json!({ "program": self.program })
            .as_object()
            .cloned()
            .unwrap_or_default()
    }

    fn run(&self, ctx: &AgentContext<'_>) -> AgentOutcome {
        let mut traj = Trajectory::new(ctx.trial_name, self.atif_agent(), &ctx.task.instruction);
        let mut metadata = Map::new();
        let done = |traj: Trajectory, metadata: Map<String, Value>, failure| AgentOutcome {
            trajectory: traj,
            n_input_tokens: None,
            n_output_tokens: None,
            metadata,
            failure,
        };
        let fail = |kind: &str, message: String| {
            Some(AgentFailure {
                kind: kind.into(),
                message,
                env_alive: true,
            })
        };
        // The exec endpoint, for this trial only.
        let (tx, rx) = mpsc::channel::<(ExecBody, Reply)>();
        let token = crate::job::random_id(32);
        let state = ExecState {
            token: token.clone(),
            tx,
        };
        let listener = match self
            .runtime
            .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
        {
            Ok(l) => l,
            Err(e) => return done(traj, metadata, fail("AgentSetupError", e.to_string())),
        };
        let addr = match listener.local_addr() {
            Ok(a) => a,
            Err(e) => return done(traj, metadata, fail("AgentSetupError", e.to_string())),
        };
        let app = Router::new()
            .route("/exec", post(exec_handler))
            .with_state(state);
        let server = self.runtime.spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        let instruction_file = ctx.logs_dir.join("instruction.md");
        let traj_file = ctx.logs_dir.join("agent-trajectory.json");
        if let Err(e) = std::fs::write(&instruction_file, &ctx.task.instruction) {
            server.abort();
            return done(traj, metadata, fail("AgentSetupError", e.to_string()));
        }
        let log = |name: &str| {
            std::fs::File::create(ctx.logs_dir.join(name))
                .map(Stdio::from)
                .unwrap_or_else(|_| Stdio::null())
        };
        let mut cmd = Command::new("sh");
        cmd.arg("-c")
            .arg(&self.program)
            .current_dir(ctx.logs_dir)
            .env("OPENAI_API_KEY", self.api_key.as_deref().unwrap_or("EMPTY"))
            .env("TEMPER_EXEC_URL", format!("http://{addr}/exec"))
            .env("TEMPER_EXEC_TOKEN", &token)
            .env("TEMPER_WORKDIR", &ctx.env.workdir)
            .env("TEMPER_INSTRUCTION_FILE", &instruction_file)
            .env("TEMPER_TRAJECTORY_FILE", &traj_file)
            .stdin(Stdio::piped())
            .stdout(log("command-stdout.txt"))
            .stderr(log("command-stderr.txt"));
        let episode = match (&self.base_url, self.capture) {
            (Some(url), true) => match Episode::create(url, self.api_key.as_deref(), &self.runtime)
            {
                Ok(e) => Some(e),
                Err(e) => {
                    server.abort();
                    return done(traj, metadata, fail("AgentSetupError", e.to_string()));
                }
            },
            (None, true) => {
                server.abort();
                return done(
                    traj,
                    metadata,
                    fail("AgentSetupError", "token capture needs --base-url".into()),
                );
            }
            (_, false) => None,
        };
        if let Some(e) = &episode {
            // The episode's token is the agent's key: it opens this episode
            // only, never the server's other routes or another trial's.
            cmd.env("OPENAI_BASE_URL", e.base_url());
            cmd.env("OPENAI_API_KEY", e.token());
            cmd.env("TEMPER_EPISODE", &e.id);
        } else if let Some(url) = &self.base_url {
            cmd.env("OPENAI_BASE_URL", url);
        }
        if let Some(m) = &self.model {
            cmd.env("OPENAI_MODEL", m);
        }
        // Its own process group and, where the host allows, its own cgroup:
        // a child that leaves the group (`setsid`, a daemon's double fork)
        // stays in the cgroup and is killed with the rest.
        std::os::unix::process::CommandExt::process_group(&mut cmd, 0);
        let tree = temper_sandbox::HostCgroup::new();
        tree.attach(&mut cmd);
        let mut child = match cmd.spawn() {
            Ok(c) => c,
            Err(e) => {
                server.abort();
                return done(
                    traj,
                    metadata,
                    fail("AgentSetupError", format!("start {:?}: {e}", self.program)),
                );
            }
        };
        if let Some(mut stdin) = child.stdin.take() {
            // A program that does not read stdin closes it: not an error.
            let _ = stdin.write_all(ctx.task.instruction.as_bytes());
        }
        let mut failure = None;
        let mut calls = 0u64;
        let status = loop {
            match child.try_wait() {
                Ok(Some(status)) => break Some(status),
                Ok(None) => {}
                Err(e) => {
                    failure = fail("AgentError", e.to_string());
                    break None;
                }
            }
            if ctx.remaining().is_zero() {
                failure = fail(
                    "AgentTimeoutError",
                    "the program ran past [agent] timeout_sec and was killed".into(),
                );
                break None;
            }
            let wait = ctx.remaining().min(Duration::from_millis(50));
            let Ok((body, reply)) = rx.recv_timeout(wait) else {
                continue;
            };
            calls += 1;
            let timeout = body
                .timeout_sec
                .filter(|t| t.is_finite() && *t > 0.0)
                .map(Duration::from_secs_f64)
                .unwrap_or(Duration::from_secs(120))
                .min(ctx.remaining());
            let id = format!("call_{calls}");
            let mut step = Step::new("agent", "");
            step.tool_calls = Some(vec![ToolCall {
                tool_call_id: id.clone(),
                function_name: "bash".into(),
                arguments: json!({ "command": body.command })
                    .as_object()
                    .cloned()
                    .unwrap_or_default(),
            }]);
            let answer = match ctx.env.exec(&body.command, None, &BTreeMap::new(), timeout) {
                Ok(r) => {
                    step.observation = Some(Observation {
                        results: vec![ObservationResult {
                            source_call_id: id,
                            content: render_output(&r),
                        }],
                    });
                    let status = match r.status {
                        ExecStatus::Finished => "finished",
                        ExecStatus::TimeLimitExceeded => "timeout",
                        ExecStatus::MemoryLimitExceeded => "memory_limit",
                        _ => "signaled",
                    };
                    let v = json!({"stdout": r.stdout, "stderr": r.stderr,
                                   "exit_code": r.return_code, "status": status});
                    if let Some(f) = failure_of(&r, false).filter(|f| !f.env_alive) {
                        failure = Some(f);
                    }
                    v
                }
                Err(e) => {
                    failure = Some(crate::agent::sandbox_failure(&e));
                    json!({"error": e.to_string()})
                }
            };
            traj.push(step);
            let _ = reply.send(answer);
            if failure.is_some() {
                break None;
            }
        };
        // Also what an exited program left running: its group, then every
        // process in its cgroup (those that left the group).
        kill_group(child.id());
        if status.is_none() {
            let _ = child.wait();
        }
        let leftovers = tree.kill_all(Duration::from_secs(2));
        metadata.insert(
            "process_cleanup".into(),
            json!(if tree.is_tracking() {
                format!(
                    "cgroup ({}): {leftovers} process(es) still in it at the end, killed",
                    tree.mode()
                )
            } else {
                format!("process group only ({})", tree.mode())
            }),
        );
        server.abort();
        if let Some(s) = status {
            metadata.insert("exit_code".into(), json!(s.code()));
        }
        metadata.insert("exec_calls".into(), json!(calls));
        // The program's own trajectory wins when it wrote a valid one.
        if let Some(own) = std::fs::read_to_string(&traj_file)
            .ok()
            .and_then(|t| serde_json::from_str::<Trajectory>(&t).ok())
        {
            traj = own;
        } else {
            traj.finish();
        }
        if let Some(e) = &episode {
            crate::capture::finish(e, &self.runtime, ctx.logs_dir, &mut traj, &mut metadata);
        }
        done(traj, metadata, failure)
    }
}

/// SIGKILL to the process group `pid` leads.
fn kill_group(pid: u32) {
    if let Ok(pid) = i32::try_from(pid) {
        // SAFETY: kill(2) of a process group we created; no memory involved.
        unsafe { libc::kill(-pid, libc::SIGKILL) };
    }
}
