//! Reward programs: a reward computed by another program, run as a local
//! process or in the sandbox service.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use serde_json::Value;

use super::context::RewardCtx;

/// A reward computed by another program, in any language, over the JSON
/// lines of [`crate::external`]: `info` → `{functions}`, then one `score`
/// per group, `{function, args, row: {prompt, answer, info}, rollouts:
/// [{text, parsed, completion, state, stop_condition, error,
/// is_truncated}]}` → one `{reward, metrics}` (or a bare number) per
/// rollout. `python/temper_reward.py` is the Python side.
pub struct ProgramReward {
    pub(super) runner: Runner,
    pub(super) command: String,
    function: Option<String>,
    args: Value,
    timeout: Duration,
}

impl ProgramReward {
    /// Start `command` in `dir` and check that it offers `function` (or
    /// exactly one function when `None`).
    pub fn spawn(
        command: &str,
        dir: Option<&std::path::Path>,
        function: Option<String>,
        args: Value,
        timeout: Duration,
    ) -> Result<Self, String> {
        let conn = crate::external::Conn::spawn(command, dir).map_err(|e| e.to_string())?;
        let info = conn
            .call_blocking("info", serde_json::json!({}))
            .map_err(|e| format!("reward program `{command}`: info: {e}"))?;
        let offered: Vec<String> = info["functions"]
            .as_array()
            .map(|a| {
                a.iter()
                    .filter_map(|f| f.as_str().map(str::to_string))
                    .collect()
            })
            .ok_or_else(|| {
                format!("reward program `{command}`: info has no `functions` list: {info}")
            })?;
        match &function {
            Some(f) if !offered.contains(f) => {
                return Err(format!(
                    "reward program `{command}` has no function `{f}`; it offers: {}",
                    offered.join(", ")
                ))
            }
            None if offered.len() != 1 => {
                return Err(format!(
                    "reward program `{command}` offers {} functions ({}); name one with `function`",
                    offered.len(),
                    offered.join(", ")
                ))
            }
            _ => {}
        }
        Ok(ProgramReward {
            runner: Runner::Process(conn),
            command: command.to_string(),
            function,
            args,
            timeout,
        })
    }

    /// The program `python3 FILE.py` (in `dir`) run in the sandbox service:
    /// each group is one isolated run with `FILE.py`, `temper_reward.py`
    /// beside it (and the files of [`ProgramReward::with_files`]), and the
    /// `score` request on stdin.
    pub fn sandboxed(
        command: &str,
        dir: Option<&std::path::Path>,
        function: Option<String>,
        args: Value,
        timeout: Duration,
        sandbox_url: Option<String>,
    ) -> Result<Self, String> {
        use base64::Engine as _;
        let words: Vec<&str> = command.split_whitespace().collect();
        let file = match words.as_slice() {
            ["python3" | "python", file] if file.ends_with(".py") => *file,
            _ => {
                return Err(format!(
                    "in the sandbox a reward program is `python3 FILE.py`, got `{command}`"
                ))
            }
        };
        let path = dir.map_or_else(|| std::path::PathBuf::from(file), |d| d.join(file));
        let code = std::fs::read_to_string(&path)
            .map_err(|e| format!("reward program {}: {e}", path.display()))?;
        // The sandbox runs the code as `__main__` from the work dir, which is
        // not on `sys.path`: put it there so `import temper_reward` works.
        let code = format!("import os as _o, sys as _s; _s.path.insert(0, _o.getcwd())\n{code}");
        let helper = include_str!("../../../../python/temper_reward.py");
        let files = [(
            "temper_reward.py".to_string(),
            base64::engine::general_purpose::STANDARD.encode(helper),
        )]
        .into_iter()
        .collect();
        if timeout.as_secs_f64() > temper_sandbox::service::MAX_RUN_TIMEOUT_S {
            return Err(format!(
                "timeout_s: a sandboxed run may take at most {} s",
                temper_sandbox::service::MAX_RUN_TIMEOUT_S
            ));
        }
        let sandbox = crate::SandboxService::new(sandbox_url)?;
        Ok(ProgramReward {
            runner: Runner::Sandbox {
                sandbox,
                code,
                files,
                requirements: Vec::new(),
            },
            command: command.to_string(),
            function,
            args,
            timeout,
        })
    }

    /// Ship `paths` (files or directories, relative to `dir`) with a
    /// sandboxed program: each run gets them at the same relative paths in
    /// its work directory. They travel in every group's request, so their
    /// total is capped at [`MAX_SHIPPED_BYTES`].
    pub fn with_files(
        mut self,
        dir: Option<&std::path::Path>,
        paths: &[String],
    ) -> Result<Self, String> {
        use base64::Engine as _;
        let Runner::Sandbox { files, .. } = &mut self.runner else {
            return Err("files are shipped with sandboxed reward programs only".into());
        };
        let root = dir.unwrap_or_else(|| std::path::Path::new("."));
        let mut found = Vec::new();
        for p in paths {
            let rel = std::path::Path::new(p);
            if p.is_empty()
                || rel.is_absolute()
                || rel
                    .components()
                    .any(|c| !matches!(c, std::path::Component::Normal(_)))
            {
                return Err(format!(
                    "files: {p:?} must be a relative path inside the environment directory, without `..`"
                ));
            }
            collect_files(root, rel, &mut found)?;
        }
        let mut total = 0usize;
        for rel in found {
            let key = rel.to_string_lossy().into_owned();
            if key == "temper_reward.py" {
                return Err("files: temper_reward.py is shipped by temper itself".into());
            }
            let bytes = std::fs::read(root.join(&rel))
                .map_err(|e| format!("files: {}: {e}", root.join(&rel).display()))?;
            total += bytes.len();
            if total > MAX_SHIPPED_BYTES {
                return Err(format!(
                    "files: more than {MAX_SHIPPED_BYTES} bytes to ship with every group; \
                     put per-row data in the rows' `info` instead"
                ));
            }
            files.insert(key, base64::engine::general_purpose::STANDARD.encode(bytes));
        }
        Ok(self)
    }

    /// One `score` call through the runner.
    async fn call_score(&self, params: Value) -> Result<Value, String> {
        match &self.runner {
            Runner::Process(conn) => tokio::time::timeout(self.timeout, conn.call("score", params))
                .await
                .map_err(|_| format!("no answer within {:.1}s", self.timeout.as_secs_f64()))?,
            Runner::Sandbox {
                sandbox,
                code,
                files,
                requirements,
            } => {
                let line = serde_json::json!({"id": 1, "method": "score", "params": params});
                let req = temper_sandbox::service::RunCodeRequest {
                    code: code.clone(),
                    language: "python".into(),
                    stdin: format!("{line}\n"),
                    files: files.clone(),
                    run_timeout: Some(self.timeout.as_secs_f64()),
                    compile_timeout: None,
                    memory_limit_mb: None,
                    fetch_files: Vec::new(),
                    requirements: requirements.clone(),
                };
                let resp = sandbox
                    .client()
                    .run_code(&req)
                    .await
                    .map_err(|e| format!("{}: {e}", sandbox.url()))?;
                // No run result (a sandbox error) means no answer below.
                let (stdout, stderr) = resp
                    .run_result
                    .as_ref()
                    .map_or(("", ""), |r| (r.stdout.as_str(), r.stderr.as_str()));
                let reply = stdout
                    .lines()
                    .filter_map(|l| serde_json::from_str::<Value>(l).ok())
                    .find(|v| v["id"] == 1)
                    .ok_or_else(|| {
                        format!(
                            "sandbox run {} {}: no answer on stdout; stderr: {}",
                            resp.status,
                            resp.message,
                            clip(stderr)
                        )
                    })?;
                match reply.get("error") {
                    Some(e) if !e.is_null() => {
                        Err(e.as_str().map_or_else(|| e.to_string(), str::to_string))
                    }
                    _ => Ok(reply.get("result").cloned().unwrap_or(Value::Null)),
                }
            }
        }
    }

    /// Scores and metrics of the rollouts of one group, in one call.
    pub async fn score_group(
        &self,
        ctxs: &[RewardCtx<'_>],
    ) -> Result<Vec<(f64, BTreeMap<String, f64>)>, String> {
        let Some(first) = ctxs.first() else {
            return Ok(Vec::new());
        };
        let rollouts: Vec<Value> = ctxs
            .iter()
            .map(|c| {
                serde_json::json!({
                    "text": crate::last_assistant_text(c.completion),
                    "parsed": c.parsed(),
                    "completion": c.completion,
                    "state": c.rollout.state,
                    "stop_condition": c.rollout.stop_condition,
                    "error": c.rollout.error,
                    "is_truncated": c.rollout.is_truncated,
                })
            })
            .collect();
        let params = serde_json::json!({
            "function": self.function,
            "args": self.args,
            "row": {"prompt": first.prompt, "answer": first.answer, "info": first.info},
            "rollouts": rollouts,
        });
        let reply = self.call_score(params).await?;
        let items = reply
            .as_array()
            .filter(|a| a.len() == ctxs.len())
            .ok_or_else(|| {
                format!(
                    "`score` must answer a list of {} scores, got {}",
                    ctxs.len(),
                    clip(&reply.to_string())
                )
            })?;
        items.iter().map(program_score).collect()
    }
}

/// The most bytes of `files` shipped with a sandboxed reward program (they
/// travel base64-encoded in each request, and the service takes 2 MB).
pub const MAX_SHIPPED_BYTES: usize = 1 << 20;

/// The regular files at `rel` under `root` (itself, or every file below a
/// directory), as paths relative to `root`. Symbolic links are refused:
/// what is shipped stays inside the environment directory.
fn collect_files(
    root: &std::path::Path,
    rel: &std::path::Path,
    out: &mut Vec<std::path::PathBuf>,
) -> Result<(), String> {
    let path = root.join(rel);
    let meta =
        std::fs::symlink_metadata(&path).map_err(|e| format!("files: {}: {e}", path.display()))?;
    if meta.is_file() {
        out.push(rel.to_path_buf());
    } else if meta.is_dir() {
        let mut entries: Vec<_> = std::fs::read_dir(&path)
            .map_err(|e| format!("files: {}: {e}", path.display()))?
            .map(|e| e.map(|e| e.file_name()))
            .collect::<Result<_, _>>()
            .map_err(|e| format!("files: {}: {e}", path.display()))?;
        entries.sort();
        for name in entries {
            collect_files(root, &rel.join(name), out)?;
        }
    } else {
        return Err(format!(
            "files: {} is not a regular file or directory",
            path.display()
        ));
    }
    Ok(())
}

/// Where a reward program runs.
pub(super) enum Runner {
    /// A local process, started once.
    Process(Arc<crate::external::Conn>),
    /// One sandbox run per group.
    Sandbox {
        sandbox: crate::SandboxService,
        code: String,
        files: BTreeMap<String, String>,
        /// `[sandbox] requirements`.
        requirements: Vec<String>,
    },
}

/// One rollout's answer: a number or `{reward, metrics}`.
fn program_score(v: &Value) -> Result<(f64, BTreeMap<String, f64>), String> {
    if let Some(x) = v.as_f64() {
        return Ok((x, BTreeMap::new()));
    }
    let reward = v["reward"].as_f64().ok_or_else(|| {
        format!(
            "a score needs a numeric `reward`, got {}",
            clip(&v.to_string())
        )
    })?;
    let mut metrics = BTreeMap::new();
    if let Some(m) = v.get("metrics").and_then(Value::as_object) {
        for (k, x) in m {
            let x = x
                .as_f64()
                .ok_or_else(|| format!("metric `{k}` is not a number: {x}"))?;
            metrics.insert(k.clone(), x);
        }
    }
    Ok((reward, metrics))
}

fn clip(s: &str) -> String {
    s.chars().take(300).collect()
}
