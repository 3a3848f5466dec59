//! The files of a run: `results.jsonl` (one line per rollout) and
//! `metadata.json`, in the field names of verifiers' outputs.

use std::collections::{BTreeMap, HashMap};
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, PoisonError};

use serde::{Deserialize, Serialize};
use serde_json::Value;
use temper_env::{Message, SamplingArgs, Split, Timing, TokenUsage};

use crate::EvalError;

/// One line of `results.jsonl`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ResultLine {
    /// Row index in the eval split.
    pub example_id: u64,
    /// Prompt messages.
    pub prompt: Vec<Message>,
    /// Completion messages.
    pub completion: Vec<Message>,
    /// Reference answer.
    pub answer: Option<String>,
    /// Task data.
    pub info: Value,
    /// Weighted reward.
    pub reward: f64,
    /// Each reward function's score.
    pub metrics: BTreeMap<String, f64>,
    /// Generation / scoring / total milliseconds.
    pub timing: Timing,
    /// Stopped normally.
    pub is_completed: bool,
    /// Hit a token limit.
    pub is_truncated: bool,
    /// The error that ended the rollout.
    pub error: Option<String>,
    /// Why a reward function could not score the rollout (it counted 0).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reward_error: Option<String>,
    /// Why it stopped.
    pub stop_condition: Option<String>,
    /// Token totals.
    pub token_usage: TokenUsage,
}

/// Token totals of a run.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct RunUsage {
    /// Prompt tokens.
    pub input_tokens: u64,
    /// Completion tokens.
    pub output_tokens: u64,
}

fn eval_split() -> Split {
    Split::Eval
}

/// `metadata.json`: verifiers' fields, then what `--resume` needs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Metadata {
    /// Environment id.
    pub env_id: String,
    /// Model name.
    pub model: String,
    /// Endpoint.
    pub base_url: String,
    /// Examples.
    pub num_examples: usize,
    /// Which rows were evaluated (`eval`, the held-out split, unless
    /// `--split train`); absent in runs written before the field existed.
    #[serde(default = "eval_split")]
    pub split: Split,
    /// Rollouts per example.
    pub rollouts_per_example: usize,
    /// Sampling arguments.
    pub sampling_args: SamplingArgs,
    /// Mean reward over rollouts written so far.
    pub avg_reward: f64,
    /// Mean of each metric.
    pub avg_metrics: BTreeMap<String, f64>,
    /// pass@k by k.
    pub pass_at_k: BTreeMap<String, f64>,
    /// Token totals.
    pub usage: RunUsage,
    /// Seconds of evaluation (summed over resumed sessions).
    pub time: f64,
    /// When the run started (RFC 3339).
    pub date: String,
    /// Run id (the directory name).
    pub run_id: String,
    /// `running` or `completed`.
    pub status: String,
    /// Rollouts written.
    pub num_rollouts: usize,
    /// Rollouts with an error.
    pub num_errors: usize,
    /// Rollouts a reward function could not score.
    #[serde(default)]
    pub num_reward_errors: usize,
    /// How the environment was named on the command line.
    pub env_spec: String,
    /// Environment arguments.
    pub env_args: Value,
    /// The hub package the environment came from: reference, resolved
    /// version and digest.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub env_package: Option<temper_env::PackageRef>,
    /// Concurrency.
    pub max_concurrent: usize,
    /// Seed of the eval rows.
    pub seed: u64,
    /// The variable the API key came from.
    pub api_key_env: Option<String>,
    /// Rollouts at or above this reward pass.
    pub pass_threshold: f64,
}

/// `results.jsonl` open for appending, one group per write.
pub struct ResultsWriter {
    file: Mutex<File>,
}

impl ResultsWriter {
    /// Open (create) for appending.
    pub fn open(path: &Path) -> Result<Self, EvalError> {
        let file = OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .map_err(|e| EvalError::io(path, e))?;
        Ok(ResultsWriter {
            file: Mutex::new(file),
        })
    }

    /// Append the lines of one group in one `write` and flush it to the OS,
    /// so a killed process leaves whole groups (and at most one torn line,
    /// which [`recover`] drops).
    pub fn append(&self, lines: &[ResultLine]) -> std::io::Result<()> {
        let mut buf = String::new();
        for l in lines {
            buf.push_str(&serde_json::to_string(l).map_err(std::io::Error::other)?);
            buf.push('\n');
        }
        let mut f = self.file.lock().unwrap_or_else(PoisonError::into_inner);
        f.write_all(buf.as_bytes())?;
        f.flush()
    }

    /// fsync.
    pub fn sync(&self) -> std::io::Result<()> {
        self.file
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .sync_data()
    }
}

/// Read every whole line of `results.jsonl` (a torn last line is skipped).
pub fn read_results(path: &Path) -> Result<Vec<ResultLine>, EvalError> {
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(EvalError::io(path, e)),
    };
    let mut out = Vec::new();
    let whole = match text.rfind('\n') {
        Some(i) => &text[..=i],
        None => "",
    };
    for (i, line) in whole.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        match serde_json::from_str(line) {
            Ok(l) => out.push(l),
            Err(e) => tracing::warn!("{}: line {} skipped: {e}", path.display(), i + 1),
        }
    }
    Ok(out)
}

/// Prepare a killed run for `--resume`: keep exactly the groups that were
/// written whole (`rollouts_per_example` lines of one example), rewrite
/// the file with only those (atomically), and return their example ids.
/// Partial groups are run again, so the finished run has every rollout
/// exactly once.
pub fn recover(path: &Path, rollouts_per_example: usize) -> Result<Vec<u64>, EvalError> {
    let lines = read_results(path)?;
    let mut by_id: HashMap<u64, Vec<ResultLine>> = HashMap::new();
    let mut order = Vec::new();
    for l in lines {
        let e = by_id.entry(l.example_id).or_default();
        if e.is_empty() {
            order.push(l.example_id);
        }
        e.push(l);
    }
    let mut done = Vec::new();
    let mut buf = String::new();
    for id in order {
        let group = &by_id[&id];
        if group.len() >= rollouts_per_example {
            done.push(id);
            for l in group.iter().take(rollouts_per_example) {
                buf.push_str(
                    &serde_json::to_string(l).map_err(|e| EvalError::Results(e.to_string()))?,
                );
                buf.push('\n');
            }
        }
    }
    let tmp: PathBuf = path.with_extension("jsonl.tmp");
    std::fs::write(&tmp, buf).map_err(|e| EvalError::io(&tmp, e))?;
    std::fs::rename(&tmp, path).map_err(|e| EvalError::io(path, e))?;
    Ok(done)
}

/// Read `metadata.json`.
pub fn read_metadata(run_dir: &Path) -> Result<Metadata, EvalError> {
    let p = run_dir.join("metadata.json");
    let text = std::fs::read_to_string(&p).map_err(|e| EvalError::io(&p, e))?;
    serde_json::from_str(&text).map_err(|e| EvalError::Results(format!("{}: {e}", p.display())))
}

/// Write `metadata.json` atomically.
pub fn write_metadata(run_dir: &Path, m: &Metadata) -> Result<(), EvalError> {
    let p = run_dir.join("metadata.json");
    let tmp = run_dir.join("metadata.json.tmp");
    let text = serde_json::to_string_pretty(m).map_err(|e| EvalError::Results(e.to_string()))?;
    std::fs::write(&tmp, text).map_err(|e| EvalError::io(&tmp, e))?;
    std::fs::rename(&tmp, &p).map_err(|e| EvalError::io(&p, e))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn line(id: u64) -> ResultLine {
        ResultLine {
            example_id: id,
            prompt: vec![Message::user("q")],
            completion: vec![Message::assistant("a")],
            answer: Some("a".into()),
            info: serde_json::json!({}),
            reward: 1.0,
            metrics: BTreeMap::new(),
            timing: Timing::default(),
            is_completed: true,
            is_truncated: false,
            error: None,
            reward_error: None,
            stop_condition: Some("max_turns_reached".into()),
            token_usage: TokenUsage::default(),
        }
    }

    #[test]
    fn recover_keeps_whole_groups_and_drops_torn_lines() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("results.jsonl");
        let w = ResultsWriter::open(&p).unwrap();
        w.append(&[line(0), line(0)]).unwrap();
        w.append(&[line(2)]).unwrap(); // half a group of 2
        w.append(&[line(1), line(1)]).unwrap();
        drop(w);
        // A torn line at the end, as a kill mid-write leaves it.
        let mut f = OpenOptions::new().append(true).open(&p).unwrap();
        f.write_all(b"{\"example_id\": 3, \"prom").unwrap();
        drop(f);
        let mut done = recover(&p, 2).unwrap();
        done.sort_unstable();
        assert_eq!(done, vec![0, 1]);
        let lines = read_results(&p).unwrap();
        assert_eq!(lines.len(), 4);
        assert!(lines.iter().all(|l| l.example_id != 2 && l.example_id != 3));
    }

    #[test]
    fn result_line_uses_verifiers_field_names() {
        let v = serde_json::to_value(line(7)).unwrap();
        for k in [
            "example_id",
            "prompt",
            "completion",
            "answer",
            "info",
            "reward",
            "metrics",
            "timing",
            "is_completed",
            "is_truncated",
            "error",
            "stop_condition",
            "token_usage",
        ] {
            assert!(v.get(k).is_some(), "missing {k}");
        }
        assert!(v["timing"].get("generation_ms").is_some());
        assert!(v["token_usage"].get("output_tokens").is_some());
    }
}
