//! A few rollouts of each step, as text: `samples.jsonl` in the run
//! directory (one JSON object per sample, flushed as written) and the last
//! step's samples at the bottom of `plots.html` — what the policy actually
//! wrote, beside the curves that summarise it.
//!
//! Which rollouts: the first rollout of each group in order, then the
//! second of each, and so on, up to `log.samples` — so a step's samples
//! cover as many distinct prompts as it has.

use std::fmt::Write as _;
use std::io::Write;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use temper_env::Message;

use crate::error::{Result, RlError};
use crate::runlog::{escape, open_log, write_atomic};
use crate::sampled::Group;

/// One sampled rollout, as a user reads it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LoggedSample {
    /// The step whose training batch it was (as `metrics.jsonl`'s `step`:
    /// the policy version the step produced).
    pub step: u64,
    /// The environment's id.
    pub env: String,
    /// The row's example id.
    pub example_id: u64,
    /// The prompt's last user message.
    pub prompt: String,
    /// Everything after the prompt: the model's turns, and for multi-turn
    /// environments their responses prefixed `[role] `.
    pub completion: String,
    /// Its reward.
    pub reward: f64,
    /// Its advantage (reward relative to its group's); absent in files
    /// written before it was logged.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub advantage: Option<f64>,
    /// Hit the token limit.
    pub truncated: bool,
    /// The error that ended the rollout, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

impl LoggedSample {
    /// Up to `n` samples from `groups_g` (the batch trained as step
    /// `step`, recorded as `step + 1`) with their `advantages_g`;
    /// `env_ids` names environments by index.
    pub fn pick(
        groups_g: &[Group],
        advantages_g: &[Vec<f64>],
        step: u64,
        n: usize,
        env_ids: &[String],
    ) -> Vec<LoggedSample> {
        let most = groups_g.iter().map(|g| g.rollouts.len()).max().unwrap_or(0);
        (0..most)
            .flat_map(|k| groups_g.iter().enumerate().map(move |(i, g)| (i, g, k)))
            .filter_map(|(i, g, k)| {
                let adv = advantages_g.get(i).and_then(|a| a.get(k)).copied();
                Some((g, g.rollouts.get(k)?, g.scores.get(k)?, adv))
            })
            .take(n)
            .map(|(g, r, s, advantage)| LoggedSample {
                step: step + 1,
                env: env_ids
                    .get(g.env)
                    .cloned()
                    .unwrap_or_else(|| format!("env{}", g.env)),
                example_id: g.row.example_id,
                prompt: last_user_text(&g.row.prompt),
                completion: transcript(&r.completion),
                reward: s.reward,
                advantage,
                truncated: r.is_truncated,
                error: r.error.clone(),
            })
            .collect()
    }
}

fn last_user_text(prompt: &[Message]) -> String {
    prompt
        .iter()
        .rev()
        .find(|m| m.role == "user")
        .map(Message::text)
        .unwrap_or_default()
}

fn transcript(completion: &[Message]) -> String {
    completion
        .iter()
        .map(|m| {
            if m.role == "assistant" {
                m.text()
            } else {
                format!("[{}] {}", m.role, m.text())
            }
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// Appends samples to `samples.jsonl` and keeps the last step's for the
/// report.
pub struct SamplesLog {
    path: PathBuf,
    file: std::fs::File,
    last: Vec<LoggedSample>,
}

impl SamplesLog {
    /// Open `dir/samples.jsonl`. With `keep_until_step`, samples of later
    /// steps (written after the checkpoint a run resumes from) are dropped,
    /// as in `metrics.jsonl`; without it an old file is replaced.
    pub fn open(dir: &Path, keep_until_step: Option<u64>) -> Result<Self> {
        let path = dir.join("samples.jsonl");
        let mut last = Vec::new();
        if let Some(until) = keep_until_step {
            let text = match std::fs::read_to_string(&path) {
                Ok(t) => t,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => String::new(),
                Err(e) => return Err(RlError::io(&path, e)),
            };
            let mut kept = String::new();
            // A torn last line from a kill is skipped.
            for s in text
                .lines()
                .filter_map(|l| serde_json::from_str::<LoggedSample>(l).ok())
                .filter(|s| s.step <= until)
            {
                kept.push_str(&to_line(&s)?);
                if last
                    .first()
                    .is_some_and(|l: &LoggedSample| l.step != s.step)
                {
                    last.clear();
                }
                last.push(s);
            }
            write_atomic(&path, kept.as_bytes())?;
        }
        let file = open_log(&path, keep_until_step.is_some())?;
        Ok(Self { path, file, last })
    }

    /// Append one step's samples (flushed before returning).
    pub fn write(&mut self, samples: Vec<LoggedSample>) -> Result<()> {
        if samples.is_empty() {
            return Ok(());
        }
        let mut text = String::new();
        for s in &samples {
            text.push_str(&to_line(s)?);
        }
        self.file
            .write_all(text.as_bytes())
            .and_then(|_| self.file.flush())
            .map_err(|e| RlError::io(&self.path, e))?;
        self.last = samples;
        Ok(())
    }

    /// The last step's samples as an HTML section ("" before any).
    pub fn html(&self) -> String {
        let Some(first) = self.last.first() else {
            return String::new();
        };
        let mut out = format!(
            "<h3>Samples of step {} <small>(all in samples.jsonl)</small></h3>\
             <table style=\"border-collapse:collapse;background:#fff\">\
             <tr><th>env</th><th>prompt</th><th>completion</th><th>reward</th></tr>",
            first.step
        );
        for s in &self.last {
            let mut note = String::new();
            if s.truncated {
                note.push_str(" (truncated)");
            }
            if let Some(e) = &s.error {
                let _ = write!(note, " (error: {})", escape(e));
            }
            let _ = write!(
                out,
                "<tr style=\"border-top:1px solid #ddd;vertical-align:top\"><td>{}</td>\
                 <td><pre style=\"white-space:pre-wrap;max-width:420px\">{}</pre></td>\
                 <td><pre style=\"white-space:pre-wrap;max-width:520px\">{}</pre></td>\
                 <td>{:.3}{note}</td></tr>",
                escape(&s.env),
                escape(&s.prompt),
                escape(&s.completion),
                s.reward,
            );
        }
        out.push_str("</table>");
        out
    }
}

/// `samples` as Markdown (TensorBoard's text tab renders it).
pub fn markdown(samples: &[LoggedSample]) -> String {
    let mut out = String::new();
    for s in samples {
        let _ =
            write!(
            out,
            "**{}** #{} reward {:.3}{}{}\n\n**prompt:** {}\n\n**completion:**\n\n    {}\n\n---\n\n",
            s.env,
            s.example_id,
            s.reward,
            s.advantage.map(|a| format!(", advantage {a:.3}")).unwrap_or_default(),
            if s.truncated { ", truncated" } else { "" },
            s.prompt,
            s.completion.replace('\n', "\n    "),
        );
    }
    out
}

fn to_line(s: &LoggedSample) -> Result<String> {
    let mut line = serde_json::to_string(s).map_err(|e| RlError::Data(format!("sample: {e}")))?;
    line.push('\n');
    Ok(line)
}

#[cfg(test)]
mod tests {
    use super::*;
    use temper_env::{Rollout, Row, Score};

    fn group(env: usize, id: u64, rewards: &[f64]) -> Group {
        Group {
            env,
            row: Row {
                example_id: id,
                prompt: vec![Message::system("sys"), Message::user(format!("q{id}"))],
                answer: None,
                info: Default::default(),
            },
            rollouts: rewards
                .iter()
                .map(|r| Rollout {
                    completion: vec![Message::assistant(format!("a{id} <{r}>"))],
                    ..Default::default()
                })
                .collect(),
            scores: rewards
                .iter()
                .map(|&reward| Score {
                    reward,
                    ..Default::default()
                })
                .collect(),
            version: 0,
        }
    }

    #[test]
    fn samples_cover_distinct_prompts_first_and_stop_at_n() {
        let groups_g = vec![group(0, 1, &[1.0, 0.0]), group(1, 2, &[0.5, 0.25])];
        let ids = vec!["arith".to_string(), "echo".to_string()];
        let adv = vec![vec![0.5, -0.5], vec![0.125, -0.125]];
        let s = LoggedSample::pick(&groups_g, &adv, 4, 3, &ids);
        let picked: Vec<(u64, f64)> = s.iter().map(|s| (s.example_id, s.reward)).collect();
        assert_eq!(picked, [(1, 1.0), (2, 0.5), (1, 0.0)]);
        assert_eq!(s[0].step, 5, "recorded under the version the step made");
        assert_eq!((s[1].env.as_str(), s[1].prompt.as_str()), ("echo", "q2"));
        assert_eq!(s[0].completion, "a1 <1>");
        let advs: Vec<Option<f64>> = s.iter().map(|s| s.advantage).collect();
        assert_eq!(advs, [Some(0.5), Some(0.125), Some(-0.5)]);
        assert!(LoggedSample::pick(&groups_g, &adv, 0, 0, &ids).is_empty());
    }

    #[test]
    fn the_log_appends_keeps_up_to_a_resumed_step_and_renders_the_last() {
        let dir = tempfile::tempdir().unwrap();
        let ids = vec!["arith".to_string()];
        let mut log = SamplesLog::open(dir.path(), None).unwrap();
        assert_eq!(log.html(), "");
        for step in 0..3 {
            log.write(LoggedSample::pick(
                &[group(0, step, &[1.0])],
                &[vec![0.0]],
                step,
                4,
                &ids,
            ))
            .unwrap();
        }
        let html = log.html();
        assert!(
            html.contains("step 3") && html.contains("a2 &lt;1&gt;"),
            "{html}"
        );
        drop(log);
        let path = dir.path().join("samples.jsonl");
        let mut text = std::fs::read_to_string(&path).unwrap();
        assert_eq!(text.lines().count(), 3);
        text.push_str("{\"step\": 4, \"en");
        std::fs::write(&path, text).unwrap();
        // Resuming from the checkpoint of step 2 drops step 3 and the torn line.
        let log = SamplesLog::open(dir.path(), Some(2)).unwrap();
        assert!(log.html().contains("step 2"));
        let steps: Vec<u64> = std::fs::read_to_string(&path)
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str::<LoggedSample>(l).unwrap().step)
            .collect();
        assert_eq!(steps, [1, 2]);
    }
}
