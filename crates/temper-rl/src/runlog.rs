//! The run directory's record: `run.json` (what kind of run, the command
//! that started it, and whether it is running, finished or failed),
//! `metrics.jsonl` (one JSON object per step, flushed as written),
//! `plots.html` (a self-contained page of line charts of chosen metrics,
//! regenerated from the records) and small atomic file writes.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::io::Write;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::error::{Result, RlError};

/// Write `bytes` to `path` atomically: a temporary sibling, fsync, rename.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let parent = path.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(parent).map_err(|e| RlError::io(parent, e))?;
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "file".into());
    let tmp = parent.join(format!(".{name}.tmp-{}", std::process::id()));
    {
        let mut f = std::fs::File::create(&tmp).map_err(|e| RlError::io(&tmp, e))?;
        f.write_all(bytes).map_err(|e| RlError::io(&tmp, e))?;
        f.sync_all().map_err(|e| RlError::io(&tmp, e))?;
    }
    std::fs::rename(&tmp, path).map_err(|e| RlError::io(path, e))
}

/// How a run stands, as `run.json` says.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RunStatus {
    /// The trainer is (or was, if its process is gone) writing it.
    Running,
    /// Ran all its steps.
    Finished,
    /// Ended early without an error (asked to stop after some steps).
    Stopped,
    /// Ended with an error (`error` says which).
    Failed,
}

/// `run.json`: written when a training run starts and rewritten when it
/// ends, so `temper view` can tell a run that is going from one that
/// finished or failed (a run whose `pid` is gone while `running` was
/// killed), and repeat it (`command`, run from `cwd`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunInfo {
    /// What trained it: `rl`, `distill`, `sft`, ...
    pub kind: String,
    /// The command line of the process (argv).
    pub command: Vec<String>,
    /// The directory it ran in.
    pub cwd: PathBuf,
    /// Its process id.
    pub pid: u32,
    /// Unix seconds when this session started.
    pub started: u64,
    /// How it stands.
    pub status: RunStatus,
    /// Unix seconds when it ended.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ended: Option<u64>,
    /// The error it ended with.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// The open `run.json` of a run: [`RunRecord::start`] writes it as
/// running, [`RunRecord::end`] with how it ended.
pub struct RunRecord {
    path: PathBuf,
    info: RunInfo,
}

impl RunRecord {
    /// Write `dir/run.json` for a run of `kind` started by this process.
    pub fn start(dir: &Path, kind: &str) -> Result<Self> {
        let info = RunInfo {
            kind: kind.into(),
            command: std::env::args().collect(),
            cwd: std::env::current_dir().unwrap_or_default(),
            pid: std::process::id(),
            started: unix_now(),
            status: RunStatus::Running,
            ended: None,
            error: None,
        };
        let rec = Self {
            path: dir.join("run.json"),
            info,
        };
        rec.write()?;
        Ok(rec)
    }

    fn write(&self) -> Result<()> {
        let text = serde_json::to_string_pretty(&self.info)
            .map_err(|e| RlError::Data(format!("run.json: {e}")))?;
        write_atomic(&self.path, text.as_bytes())
    }

    /// Record how the run ended: `Ok(true)` finished, `Ok(false)` stopped
    /// early, `Err` failed with that message.
    pub fn end(mut self, outcome: std::result::Result<bool, String>) -> Result<()> {
        self.info.ended = Some(unix_now());
        match outcome {
            Ok(true) => self.info.status = RunStatus::Finished,
            Ok(false) => self.info.status = RunStatus::Stopped,
            Err(e) => {
                self.info.status = RunStatus::Failed;
                self.info.error = Some(e);
            }
        }
        self.write()
    }
}

/// Read `dir/run.json` (`None` when there is none).
pub fn read_run_info(dir: &Path) -> Result<Option<RunInfo>> {
    let path = dir.join("run.json");
    match std::fs::read_to_string(&path) {
        Ok(text) => serde_json::from_str(&text)
            .map(Some)
            .map_err(|e| RlError::Data(format!("{}: {e}", path.display()))),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(RlError::io(&path, e)),
    }
}

/// Open a JSON-lines log for appending: a resumed run's (`resume`,
/// already trimmed to its checkpoint) is continued, a fresh run's replaces
/// any old file.
pub(crate) fn open_log(path: &Path, resume: bool) -> Result<std::fs::File> {
    if !resume && path.exists() {
        std::fs::remove_file(path).map_err(|e| RlError::io(path, e))?;
    }
    std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .map_err(|e| RlError::io(path, e))
}

/// Appends step records to `metrics.jsonl` and keeps them for plotting.
pub struct MetricsLog {
    path: PathBuf,
    file: std::fs::File,
    records: Vec<Map<String, Value>>,
    baseline: Option<Map<String, Value>>,
    tensorboard: Option<crate::tensorboard::EventWriter>,
}

impl MetricsLog {
    /// Open `dir/metrics.jsonl`. With `keep_until_step`, records of later
    /// steps (written after the checkpoint a run resumes from) are dropped,
    /// so a resumed run's log has each step once.
    pub fn open(dir: &Path, keep_until_step: Option<u64>) -> Result<Self> {
        std::fs::create_dir_all(dir).map_err(|e| RlError::io(dir, e))?;
        let path = dir.join("metrics.jsonl");
        let mut records = Vec::new();
        if let Some(last) = keep_until_step {
            if let Ok(text) = std::fs::read_to_string(&path) {
                for line in text.lines() {
                    // A torn last line from a kill is skipped.
                    if let Ok(Value::Object(m)) = serde_json::from_str::<Value>(line) {
                        let step = m.get("step").and_then(Value::as_u64).unwrap_or(0);
                        if step <= last {
                            records.push(m);
                        }
                    }
                }
            }
            let mut text = String::new();
            for r in &records {
                text.push_str(&Value::Object(r.clone()).to_string());
                text.push('\n');
            }
            write_atomic(&path, text.as_bytes())?;
        }
        let file = open_log(&path, keep_until_step.is_some())?;
        Ok(Self {
            path,
            file,
            records,
            baseline: None,
            tensorboard: None,
        })
    }

    /// Also write each record as TensorBoard scalars, into a new event
    /// file beside `metrics.jsonl` (`[log] tensorboard`).
    pub fn enable_tensorboard(&mut self) -> Result<()> {
        let dir = self.path.parent().unwrap_or(Path::new("."));
        self.tensorboard = Some(crate::tensorboard::EventWriter::create(dir)?);
        Ok(())
    }

    /// `text` (Markdown) for TensorBoard's text tab, when it is on.
    pub fn tensorboard_text(&mut self, step: u64, tag: &str, text: &str) -> Result<()> {
        match &mut self.tensorboard {
            Some(tb) => tb.text(step, tag, text),
            None => Ok(()),
        }
    }

    /// A record plotted before the steps' but not written to
    /// `metrics.jsonl`: the evaluation before training, at step 0.
    pub fn set_baseline(&mut self, record: Map<String, Value>) {
        self.baseline = Some(record);
    }

    /// Append one record (flushed before returning).
    pub fn write(&mut self, record: Map<String, Value>) -> Result<()> {
        let mut line = Value::Object(record.clone()).to_string();
        line.push('\n');
        self.file
            .write_all(line.as_bytes())
            .and_then(|_| self.file.flush())
            .map_err(|e| RlError::io(&self.path, e))?;
        if let Some(tb) = &mut self.tensorboard {
            tb.scalars(&record)?;
        }
        self.records.push(record);
        Ok(())
    }

    /// Every record so far (including those kept from before a resume).
    pub fn records(&self) -> &[Map<String, Value>] {
        &self.records
    }

    /// Write `dir/plots.html`: one chart per metric in `keys` that appears
    /// in the baseline or the records, against `step`; then `appendix`
    /// (HTML, e.g. the last step's samples).
    pub fn write_plots(
        &self,
        dir: &Path,
        title: &str,
        keys: &[&str],
        appendix: &str,
    ) -> Result<PathBuf> {
        let path = dir.join("plots.html");
        let records: Vec<&Map<String, Value>> = self.baseline.iter().chain(&self.records).collect();
        let html = plots_html(title, &records, keys, appendix);
        write_atomic(&path, html.as_bytes())?;
        Ok(path)
    }
}

/// A self-contained HTML page with one SVG line chart per metric, then
/// `appendix`.
pub fn plots_html(
    title: &str,
    records: &[&Map<String, Value>],
    keys: &[&str],
    appendix: &str,
) -> String {
    let mut series: BTreeMap<usize, Vec<(f64, f64)>> = BTreeMap::new();
    for r in records {
        let Some(step) = r.get("step").and_then(Value::as_f64) else {
            continue;
        };
        for (i, k) in keys.iter().enumerate() {
            if let Some(v) = r.get(*k).and_then(Value::as_f64) {
                if v.is_finite() {
                    series.entry(i).or_default().push((step, v));
                }
            }
        }
    }
    let mut out = String::new();
    let _ = write!(
        out,
        "<!doctype html><html><head><meta charset=\"utf-8\"><title>{t}</title><style>\
         body{{font-family:sans-serif;margin:20px;background:#fafafa}}\
         .c{{display:inline-block;margin:8px;background:#fff;border:1px solid #ddd;padding:8px}}\
         h3{{margin:2px 0 6px;font-size:14px}}</style></head><body><h2>{t}</h2>",
        t = escape(title)
    );
    for (i, pts) in &series {
        out.push_str(&chart(keys[*i], pts));
    }
    if series.is_empty() {
        out.push_str("<p>No metrics recorded yet.</p>");
    }
    out.push_str(appendix);
    out.push_str("</body></html>\n");
    out
}

fn chart(name: &str, pts: &[(f64, f64)]) -> String {
    let (w, h, pad) = (360.0, 200.0, 36.0);
    let (mut x0, mut x1, mut y0, mut y1) = (f64::MAX, f64::MIN, f64::MAX, f64::MIN);
    for &(x, y) in pts {
        x0 = x0.min(x);
        x1 = x1.max(x);
        y0 = y0.min(y);
        y1 = y1.max(y);
    }
    if x1 <= x0 {
        x1 = x0 + 1.0;
    }
    if y1 <= y0 {
        y1 = y0 + 1.0;
    }
    let sx = |x: f64| pad + (x - x0) / (x1 - x0) * (w - 2.0 * pad);
    let sy = |y: f64| h - pad + (y - y0) / (y1 - y0) * (2.0 * pad - h);
    let path: Vec<String> = pts
        .iter()
        .map(|&(x, y)| format!("{:.1},{:.1}", sx(x), sy(y)))
        .collect();
    // A marker on every point, so a metric with one value (an evaluation
    // before and after a short run) is still visible.
    let dots: String = if pts.len() <= 100 {
        pts.iter()
            .map(|&(x, y)| {
                format!(
                    "<circle cx=\"{:.1}\" cy=\"{:.1}\" r=\"2.5\" fill=\"#1f77b4\"/>",
                    sx(x),
                    sy(y)
                )
            })
            .collect()
    } else {
        String::new()
    };
    let last = pts.last().map(|p| p.1).unwrap_or(0.0);
    format!(
        "<div class=\"c\"><h3>{n} <small>(last {last:.4})</small></h3>\
         <svg width=\"{w}\" height=\"{h}\" xmlns=\"http://www.w3.org/2000/svg\">\
         <rect x=\"{pad}\" y=\"{pad}\" width=\"{iw}\" height=\"{ih}\" fill=\"none\" stroke=\"#ccc\"/>\
         <polyline fill=\"none\" stroke=\"#1f77b4\" stroke-width=\"1.5\" points=\"{p}\"/>{dots}\
         <text x=\"2\" y=\"{ty1}\" font-size=\"10\">{y1:.3}</text>\
         <text x=\"2\" y=\"{ty0}\" font-size=\"10\">{y0:.3}</text>\
         <text x=\"{pad}\" y=\"{tx}\" font-size=\"10\">step {x0}</text>\
         <text x=\"{tx1}\" y=\"{tx}\" font-size=\"10\">{x1}</text></svg></div>",
        n = escape(name),
        iw = w - 2.0 * pad,
        ih = h - 2.0 * pad,
        p = path.join(" "),
        ty1 = pad + 4.0,
        ty0 = h - pad,
        tx = h - 8.0,
        tx1 = w - pad - 20.0,
    )
}

/// `s` as HTML text or attribute value.
pub(crate) fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn rec(step: u64, reward: f64) -> Map<String, Value> {
        json!({"step": step, "reward/mean": reward})
            .as_object()
            .cloned()
            .unwrap()
    }

    #[test]
    fn resuming_keeps_steps_up_to_the_checkpoint_and_skips_torn_lines() {
        let dir = tempfile::tempdir().unwrap();
        let mut log = MetricsLog::open(dir.path(), None).unwrap();
        for s in 1..=5 {
            log.write(rec(s, s as f64 / 10.0)).unwrap();
        }
        drop(log);
        // A kill mid-write leaves half a line.
        let p = dir.path().join("metrics.jsonl");
        let mut text = std::fs::read_to_string(&p).unwrap();
        text.push_str("{\"step\": 6, \"rew");
        std::fs::write(&p, text).unwrap();
        let mut log = MetricsLog::open(dir.path(), Some(3)).unwrap();
        assert_eq!(log.records().len(), 3);
        log.write(rec(4, 0.9)).unwrap();
        let steps: Vec<u64> = std::fs::read_to_string(&p)
            .unwrap()
            .lines()
            .map(|l| {
                serde_json::from_str::<Value>(l).unwrap()["step"]
                    .as_u64()
                    .unwrap()
            })
            .collect();
        assert_eq!(steps, vec![1, 2, 3, 4]);
        let html = std::fs::read_to_string(
            log.write_plots(dir.path(), "run <1>", &["reward/mean", "absent"], "")
                .unwrap(),
        )
        .unwrap();
        assert!(html.contains("<polyline") && html.contains("reward/mean"));
        assert!(html.contains("run &lt;1&gt;"));
        assert!(
            !html.contains("absent"),
            "metrics never recorded get no chart"
        );
    }

    /// Issue 12: the eval chart was blank — the evaluation before training
    /// (step 0) was not plotted, leaving one point after a run.
    #[test]
    fn issue_12_the_baseline_evaluation_is_plotted_at_step_0() {
        let dir = tempfile::tempdir().unwrap();
        let mut log = MetricsLog::open(dir.path(), None).unwrap();
        log.set_baseline(
            json!({"step": 0, "eval/pass@1": 0.125})
                .as_object()
                .cloned()
                .unwrap(),
        );
        let mut r = rec(4, 0.5);
        r.insert("eval/pass@1".into(), json!(0.675));
        log.write(r).unwrap();
        let html = std::fs::read_to_string(
            log.write_plots(dir.path(), "run", &["eval/pass@1"], "<p>samples</p>")
                .unwrap(),
        )
        .unwrap();
        let chart = html.split("eval/pass@1").nth(1).unwrap();
        assert!(chart.contains("step 0"), "{chart}");
        assert_eq!(chart.matches("<circle").count(), 2, "{chart}");
        assert!(html.ends_with("<p>samples</p></body></html>\n"));
        // Not written to metrics.jsonl.
        let text = std::fs::read_to_string(dir.path().join("metrics.jsonl")).unwrap();
        assert_eq!(text.lines().count(), 1);
    }
}
