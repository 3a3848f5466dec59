//! Summaries of a run (averages, pass@k, failures, slowest rollouts), the
//! terminal table, and the self-contained HTML report of `temper view`.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use crate::results::{Metadata, ResultLine, RunUsage};

/// What a run amounts to.
#[derive(Debug, Clone, PartialEq)]
pub struct Summary {
    /// Rollouts.
    pub num_rollouts: usize,
    /// Distinct examples.
    pub num_examples: usize,
    /// Mean reward.
    pub avg_reward: f64,
    /// Standard deviation of the reward.
    pub std_reward: f64,
    /// Mean of each metric.
    pub avg_metrics: BTreeMap<String, f64>,
    /// pass@k by k (as a string, like verifiers' JSON).
    pub pass_at_k: BTreeMap<String, f64>,
    /// Rollouts with an error.
    pub num_errors: usize,
    /// Each distinct error message with how many rollouts ended with it,
    /// most frequent first.
    pub errors: Vec<(String, usize)>,
    /// Rollouts a reward function could not score (`reward_error`).
    pub num_reward_errors: usize,
    /// Each distinct reward error with its count, most frequent first.
    pub reward_errors: Vec<(String, usize)>,
    /// Rollouts that hit a token limit.
    pub num_truncated: usize,
    /// Token totals.
    pub usage: RunUsage,
    /// Mean generation milliseconds.
    pub avg_generation_ms: f64,
}

/// The unbiased pass@k estimator: 1 − C(n−c, k) / C(n, k).
pub fn pass_at_k(n: usize, c: usize, k: usize) -> f64 {
    if k == 0 || k > n {
        return f64::NAN;
    }
    if n - c < k {
        return 1.0;
    }
    let mut miss = 1.0;
    for i in (n - c + 1)..=n {
        miss *= 1.0 - k as f64 / i as f64;
    }
    1.0 - miss
}

/// Summarise result lines; a rollout passes at `reward ≥ threshold`.
pub fn summarize(lines: &[ResultLine], threshold: f64) -> Summary {
    let n = lines.len();
    let mean = |xs: &mut dyn Iterator<Item = f64>| {
        let (s, c) = xs.fold((0.0, 0usize), |(s, c), x| (s + x, c + 1));
        if c == 0 {
            0.0
        } else {
            s / c as f64
        }
    };
    let avg_reward = mean(&mut lines.iter().map(|l| l.reward));
    let var = mean(&mut lines.iter().map(|l| (l.reward - avg_reward).powi(2)));
    let mut sums: BTreeMap<String, (f64, usize)> = BTreeMap::new();
    for l in lines {
        for (k, v) in &l.metrics {
            let e = sums.entry(k.clone()).or_default();
            e.0 += v;
            e.1 += 1;
        }
    }
    let avg_metrics = sums
        .into_iter()
        .map(|(k, (s, c))| (k, s / c as f64))
        .collect();
    let mut groups: BTreeMap<u64, (usize, usize)> = BTreeMap::new();
    for l in lines {
        let g = groups.entry(l.example_id).or_default();
        g.0 += 1;
        g.1 += usize::from(l.reward >= threshold);
    }
    let r = groups.values().map(|g| g.0).min().unwrap_or(0);
    let mut ks: Vec<usize> = (0..).map(|i| 1usize << i).take_while(|k| *k <= r).collect();
    if r > 0 && !ks.contains(&r) {
        ks.push(r);
    }
    let pass = ks
        .into_iter()
        .map(|k| {
            let v = mean(&mut groups.values().map(|(n, c)| pass_at_k(*n, *c, k)));
            (k.to_string(), v)
        })
        .collect();
    let usage = lines.iter().fold(RunUsage::default(), |u, l| RunUsage {
        input_tokens: u.input_tokens + l.token_usage.input_tokens,
        output_tokens: u.output_tokens + l.token_usage.output_tokens,
    });
    let errors = by_count(lines.iter().filter_map(|l| l.error.as_deref()));
    let reward_errors = by_count(lines.iter().filter_map(|l| l.reward_error.as_deref()));
    Summary {
        num_rollouts: n,
        num_examples: groups.len(),
        avg_reward,
        std_reward: var.sqrt(),
        avg_metrics,
        pass_at_k: pass,
        num_errors: lines.iter().filter(|l| l.error.is_some()).count(),
        errors,
        num_reward_errors: lines.iter().filter(|l| l.reward_error.is_some()).count(),
        reward_errors,
        num_truncated: lines.iter().filter(|l| l.is_truncated).count(),
        usage,
        avg_generation_ms: mean(&mut lines.iter().map(|l| l.timing.generation_ms)),
    }
}

/// Each distinct message with how often it occurs, most frequent first.
fn by_count<'a>(messages: impl Iterator<Item = &'a str>) -> Vec<(String, usize)> {
    let mut by_message: BTreeMap<&str, usize> = BTreeMap::new();
    for e in messages {
        *by_message.entry(e).or_default() += 1;
    }
    let mut out: Vec<(String, usize)> = by_message
        .into_iter()
        .map(|(m, c)| (m.to_string(), c))
        .collect();
    out.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
    out
}

/// The ten most frequent messages with their counts, and how many more.
fn list_messages(t: &mut String, list: &[(String, usize)], what: &str) {
    for (m, c) in list.iter().take(10) {
        let _ = writeln!(t, "  {c:>5} × {}", clip(m, 300));
    }
    if list.len() > 10 {
        let _ = writeln!(
            t,
            "  … {} more distinct {what} in results.jsonl",
            list.len() - 10
        );
    }
}

/// The summary as a plain-text table.
pub fn summary_table(meta: &Metadata, s: &Summary) -> String {
    let mut t = String::new();
    let _ = writeln!(t, "env        {}", meta.env_id);
    let _ = writeln!(t, "model      {} @ {}", meta.model, meta.base_url);
    let _ = writeln!(
        t,
        "rollouts   {} ({} {} examples × {})",
        s.num_rollouts,
        s.num_examples,
        meta.split.as_str(),
        meta.rollouts_per_example
    );
    let _ = writeln!(t, "reward     {:.4} ± {:.4}", s.avg_reward, s.std_reward);
    for (k, v) in &s.avg_metrics {
        let _ = writeln!(t, "  {k:<24} {v:.4}");
    }
    for (i, (k, v)) in s.pass_at_k.iter().enumerate() {
        // The threshold once, so a pass@1 is never read without what a pass is.
        let what = if i == 0 {
            format!("   (a pass is reward ≥ {})", meta.pass_threshold)
        } else {
            String::new()
        };
        let _ = writeln!(t, "pass@{k:<5} {v:.4}{what}");
    }
    let _ = writeln!(
        t,
        "errors     {}   reward errors {}   truncated {}",
        s.num_errors, s.num_reward_errors, s.num_truncated
    );
    list_messages(&mut t, &s.errors, "errors");
    if !s.reward_errors.is_empty() {
        let _ = writeln!(t, "  reward errors (those functions scored 0):");
        list_messages(&mut t, &s.reward_errors, "reward errors");
    }
    let _ = writeln!(
        t,
        "tokens     {} in / {} out",
        s.usage.input_tokens, s.usage.output_tokens
    );
    let _ = writeln!(
        t,
        "time       {:.1}s wall: {:.0} ms per rollout ({} rollouts, up to {} at once)",
        meta.time,
        wall_per_rollout_ms(meta.time, s.num_rollouts),
        s.num_rollouts,
        meta.max_concurrent
    );
    // Each rollout's own wall time runs from its first request to its last
    // answer; concurrent requests share the server's batches, so it is close
    // to a batch's time, not what the rollout cost alone.
    let _ = write!(
        t,
        "latency    {:.0} ms mean per rollout, request to answer (rollouts run concurrently: not a rollout's cost)",
        s.avg_generation_ms
    );
    t
}

/// The run's wall time spread over its rollouts: what one rollout cost.
fn wall_per_rollout_ms(wall_s: f64, rollouts: usize) -> f64 {
    wall_s * 1e3 / rollouts.max(1) as f64
}

/// `s` cut to `n` characters (an error can carry a whole HTML page).
fn clip(s: &str, n: usize) -> String {
    let one_line = s.replace('\n', " ");
    if one_line.chars().count() <= n {
        one_line
    } else {
        format!("{}…", one_line.chars().take(n).collect::<String>())
    }
}

fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// Histogram bins of `values`: one bar per distinct value when there are
/// few (a 0/1 reward gives two labelled bars), else ten equal-width bins
/// labelled by their range. Each is (label, count).
fn histogram_bins(values: &[f64]) -> Vec<(String, usize)> {
    let mut distinct: Vec<f64> = values.iter().copied().filter(|v| v.is_finite()).collect();
    distinct.sort_by(f64::total_cmp);
    distinct.dedup_by(|a, b| (*a - *b).abs() < 1e-9);
    let fmt = |v: f64| {
        let s = format!("{v:.3}");
        let s = s.trim_end_matches('0').trim_end_matches('.').to_string();
        if s == "-0" {
            "0".to_string()
        } else {
            s
        }
    };
    let non_finite = values.iter().filter(|v| !v.is_finite()).count();
    let mut bins: Vec<(String, usize)> = if distinct.len() <= 12 {
        distinct
            .iter()
            .map(|&d| {
                let c = values.iter().filter(|v| (**v - d).abs() < 1e-9).count();
                (fmt(d), c)
            })
            .collect()
    } else {
        let (lo, hi) = (distinct[0], distinct[distinct.len() - 1]);
        let n = 10usize;
        let width = (hi - lo) / n as f64;
        let mut counts = vec![0usize; n];
        for v in values.iter().filter(|v| v.is_finite()) {
            counts[(((v - lo) / width) as usize).min(n - 1)] += 1;
        }
        counts
            .into_iter()
            .enumerate()
            .map(|(i, c)| {
                let (a, b) = (lo + i as f64 * width, lo + (i + 1) as f64 * width);
                let close = if i == n - 1 { "]" } else { ")" };
                (format!("[{}, {}{close}", fmt(a), fmt(b)), c)
            })
            .collect()
    };
    if non_finite > 0 {
        bins.push(("NaN/inf".into(), non_finite));
    }
    bins
}

/// An SVG bar chart of `values` with each bar's count above it and its
/// value or range below; `title` names the quantity.
fn histogram_svg(values: &[f64], title: &str) -> String {
    if values.is_empty() {
        return "<p>no rollouts</p>".into();
    }
    let bins = histogram_bins(values);
    let max = bins.iter().map(|b| b.1).max().unwrap_or(1).max(1) as f64;
    let (w, h, top, bottom) = (640.0, 160.0, 18.0, 40.0);
    let bw = w / bins.len() as f64;
    let mut svg = format!(
        "<svg width=\"{w}\" height=\"{}\" xmlns=\"http://www.w3.org/2000/svg\" font-family=\"sans-serif\"><title>{}</title>",
        top + h + bottom,
        esc(title)
    );
    for (i, (label, c)) in bins.iter().enumerate() {
        let bh = h * *c as f64 / max;
        let x = i as f64 * bw;
        let _ = write!(
            svg,
            "<rect x=\"{:.1}\" y=\"{:.1}\" width=\"{:.1}\" height=\"{bh:.1}\" fill=\"#4a7\"><title>{}: {c}</title></rect>\
             <text x=\"{:.1}\" y=\"{:.1}\" font-size=\"11\" text-anchor=\"middle\">{c}</text>\
             <text x=\"{:.1}\" y=\"{:.1}\" font-size=\"10\" text-anchor=\"middle\">{}</text>",
            x + 1.0,
            top + h - bh,
            bw - 2.0,
            esc(label),
            x + bw / 2.0,
            top + h - bh - 4.0,
            x + bw / 2.0,
            top + h + 14.0,
            esc(label)
        );
    }
    let _ = write!(
        svg,
        "<text x=\"{}\" y=\"{}\" font-size=\"11\" text-anchor=\"middle\">{} (bar label: rollouts)</text></svg>",
        w / 2.0,
        top + h + 34.0,
        esc(title)
    );
    svg
}

/// Mean, standard deviation, min and max.
fn stats(values: &[f64]) -> (f64, f64, f64, f64) {
    let n = values.len().max(1) as f64;
    let mean = values.iter().sum::<f64>() / n;
    let var = values.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / n;
    let min = values.iter().copied().fold(f64::INFINITY, f64::min);
    let max = values.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    (mean, var.sqrt(), min, max)
}

fn transcript(l: &ResultLine) -> String {
    let mut s = String::new();
    for m in l.prompt.iter().chain(&l.completion) {
        let mut body = m.text();
        if let Some(calls) = &m.tool_calls {
            for c in calls {
                let _ = write!(body, "\n→ {}({})", c.function.name, c.function.arguments);
            }
        }
        let _ = write!(
            s,
            "<div class=\"msg {}\"><b>{}</b><pre>{}</pre></div>",
            esc(&m.role),
            esc(&m.role),
            esc(&body)
        );
    }
    s
}

/// A self-contained HTML report: summary, reward histogram (counts and bin
/// labels), per-metric statistics and histograms, the distinct errors with
/// counts, pass@k, slowest and failed rollouts, and browsable transcripts.
pub fn html_report(meta: &Metadata, lines: &[ResultLine]) -> String {
    let s = summarize(lines, meta.pass_threshold);
    let mut h = String::new();
    let _ = write!(
        h,
        "<!doctype html><html><head><meta charset=\"utf-8\"><title>{} — {}</title><style>\
body{{font-family:system-ui,sans-serif;margin:2em;max-width:1100px}}table{{border-collapse:collapse}}\
td,th{{border:1px solid #ccc;padding:3px 8px;text-align:left}}pre{{white-space:pre-wrap;margin:2px 0}}\
.msg{{border-left:3px solid #ccc;padding-left:8px;margin:4px 0}}.assistant{{border-color:#4a7}}\
.tool{{border-color:#a74}}.system{{border-color:#47a}}details{{margin:4px 0}}.err{{color:#b00}}</style></head><body>",
        esc(&meta.env_id),
        esc(&meta.model)
    );
    let _ = write!(
        h,
        "<h1>{} — {}</h1><pre>{}</pre>",
        esc(&meta.env_id),
        esc(&meta.model),
        esc(&summary_table(meta, &s))
    );
    let _ = write!(
        h,
        "<h2>Reward distribution</h2>{}",
        histogram_svg(
            &lines.iter().map(|l| l.reward).collect::<Vec<_>>(),
            "reward"
        )
    );
    h.push_str("<h2>Metrics</h2><table><tr><th>metric</th><th>rollouts</th><th>mean</th><th>std</th><th>min</th><th>max</th></tr>");
    let mut per_metric: BTreeMap<&str, Vec<f64>> = BTreeMap::new();
    per_metric.insert("reward", lines.iter().map(|l| l.reward).collect());
    for l in lines {
        for (k, v) in &l.metrics {
            per_metric.entry(k.as_str()).or_default().push(*v);
        }
    }
    for (k, vs) in &per_metric {
        let (mean, std, min, max) = stats(vs);
        let _ = write!(
            h,
            "<tr><td>{}</td><td>{}</td><td>{mean:.4}</td><td>{std:.4}</td><td>{min:.4}</td><td>{max:.4}</td></tr>",
            esc(k),
            vs.len()
        );
    }
    h.push_str("</table>");
    for (k, vs) in per_metric.iter().filter(|(k, _)| **k != "reward") {
        let _ = write!(
            h,
            "<details open><summary>{} distribution</summary>{}</details>",
            esc(k),
            histogram_svg(vs, k)
        );
    }
    let _ = write!(
        h,
        "<h2>Errors ({} rollouts, {} distinct)</h2>",
        s.num_errors,
        s.errors.len()
    );
    if !s.errors.is_empty() {
        h.push_str("<table><tr><th>count</th><th>error</th></tr>");
        for (m, c) in &s.errors {
            let _ = write!(
                h,
                "<tr><td>{c}</td><td class=\"err\">{}</td></tr>",
                esc(&clip(m, 2000))
            );
        }
        h.push_str("</table>");
    }
    h.push_str("<h2>pass@k</h2><table><tr><th>k</th><th>pass@k</th></tr>");
    for (k, v) in &s.pass_at_k {
        let _ = write!(h, "<tr><td>{}</td><td>{v:.4}</td></tr>", esc(k));
    }
    h.push_str("</table>");
    let mut slow: Vec<&ResultLine> = lines.iter().collect();
    slow.sort_by(|a, b| b.timing.total_ms.total_cmp(&a.timing.total_ms));
    h.push_str("<h2>Slowest rollouts</h2><p>Latency: each rollout's wall time, request to answer (generation, then scoring); rollouts run concurrently, so it includes waiting on the others.</p><table><tr><th>example</th><th>latency ms</th><th>generation ms</th><th>scoring ms</th><th>output tokens</th><th>reward</th><th>stop</th></tr>");
    for l in slow.iter().take(10) {
        let _ = write!(
            h,
            "<tr><td>{}</td><td>{:.1}</td><td>{:.1}</td><td>{:.1}</td><td>{}</td><td>{:.3}</td><td>{}</td></tr>",
            l.example_id,
            l.timing.total_ms,
            l.timing.generation_ms,
            l.timing.scoring_ms,
            l.token_usage.output_tokens,
            l.reward,
            esc(l.stop_condition.as_deref().unwrap_or(""))
        );
    }
    h.push_str("</table>");
    let failed: Vec<&ResultLine> = lines.iter().filter(|l| l.error.is_some()).collect();
    let _ = write!(h, "<h2>Failed rollouts ({})</h2>", failed.len());
    for l in failed.iter().take(100) {
        let _ = write!(
            h,
            "<p class=\"err\">example {}: {}</p>",
            l.example_id,
            esc(l.error.as_deref().unwrap_or(""))
        );
    }
    let _ = write!(h, "<h2>Transcripts ({})</h2>", lines.len());
    let mut sorted: Vec<&ResultLine> = lines.iter().collect();
    sorted.sort_by_key(|l| l.example_id);
    for l in sorted.iter().take(2000) {
        let _ = write!(
            h,
            "<details><summary>example {} — reward {:.3} — {}{}</summary><p>answer: <code>{}</code> metrics: <code>{}</code></p>{}</details>",
            l.example_id,
            l.reward,
            esc(l.stop_condition.as_deref().unwrap_or("")),
            if l.error.is_some() { " — error" } else { "" },
            esc(l.answer.as_deref().unwrap_or("")),
            esc(&serde_json::to_string(&l.metrics).unwrap_or_default()),
            transcript(l)
        );
    }
    if lines.len() > 2000 {
        let _ = write!(h, "<p>… {} more in results.jsonl</p>", lines.len() - 2000);
    }
    h.push_str("</body></html>\n");
    h
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pass_at_k_table() {
        let cases: &[(usize, usize, usize, f64)] = &[
            (1, 1, 1, 1.0),
            (1, 0, 1, 0.0),
            (4, 2, 1, 0.5),
            (4, 2, 2, 1.0 - 1.0 / 6.0),
            (4, 0, 4, 0.0),
            (4, 1, 4, 1.0),
            (10, 3, 1, 0.3),
            (10, 3, 5, 1.0 - 21.0 / 252.0),
        ];
        for &(n, c, k, want) in cases {
            let got = pass_at_k(n, c, k);
            assert!(
                (got - want).abs() < 1e-12,
                "pass@{k} n={n} c={c}: {got} != {want}"
            );
        }
    }

    /// Issue 15: the report's histograms carry counts and bin labels, every
    /// metric gets its distribution, and the distinct errors are counted.
    #[test]
    fn report_histograms_have_counts_and_labels_and_errors_are_counted() {
        use crate::results::ResultLine;
        use temper_env::{Message, Timing, TokenUsage};
        let line = |id: u64, reward: f64, fmt: f64, error: Option<&str>| ResultLine {
            example_id: id,
            prompt: vec![Message::user("q")],
            completion: vec![Message::assistant("a")],
            answer: None,
            info: serde_json::json!({}),
            reward,
            metrics: [("format".to_string(), fmt)].into_iter().collect(),
            timing: Timing::default(),
            is_completed: error.is_none(),
            is_truncated: false,
            error: error.map(str::to_string),
            reward_error: None,
            stop_condition: None,
            token_usage: TokenUsage::default(),
        };
        let mut lines = vec![
            line(0, 1.0, 1.0, None),
            line(1, 1.0, 1.0, None),
            line(2, 1.0, 0.0, None),
            line(3, 0.5, 1.0, None),
            line(4, 0.0, 0.0, Some("model endpoint answered 500: boom")),
            line(5, 0.0, 0.0, Some("model endpoint answered 500: boom")),
            line(6, 0.0, 0.0, Some("model call timed out after 5.0s")),
        ];
        // Discrete rewards: one labelled bar per value, with its count.
        assert_eq!(
            histogram_bins(&lines.iter().map(|l| l.reward).collect::<Vec<_>>()),
            vec![("0".into(), 3), ("0.5".into(), 1), ("1".into(), 3)]
        );
        // Continuous values: ten labelled ranges that hold every value.
        let spread: Vec<f64> = (0..50).map(|i| i as f64 / 49.0).collect();
        let bins = histogram_bins(&spread);
        assert_eq!(bins.len(), 10);
        assert_eq!(bins[0].0, "[0, 0.1)");
        assert_eq!(bins[9].0, "[0.9, 1]");
        assert_eq!(bins.iter().map(|b| b.1).sum::<usize>(), 50);

        let meta: crate::results::Metadata = serde_json::from_value(serde_json::json!({
            "env_id": "e", "model": "m", "base_url": "u", "num_examples": 7,
            "split": "eval", "rollouts_per_example": 1,
            "sampling_args": {"max_tokens": 8, "temperature": 0.0, "top_p": 1.0},
            "avg_reward": 0.0, "avg_metrics": {}, "pass_at_k": {}, "usage": {"input_tokens": 0, "output_tokens": 0},
            "time": 1.0, "date": "d", "run_id": "r", "status": "completed",
            "num_rollouts": 7, "num_errors": 3, "env_spec": "e", "env_args": {},
            "max_concurrent": 1, "seed": 0, "pass_threshold": 1.0
        }))
        .unwrap();
        let html = html_report(&meta, &lines);
        // Count labels above bars and value labels below.
        assert!(
            html.contains(">3</text>") && html.contains(">0.5</text>"),
            "{html}"
        );
        assert!(html.contains("format distribution"));
        assert!(html.contains("Errors (3 rollouts, 2 distinct)"));
        assert!(html.contains(
            "<tr><td>2</td><td class=\"err\">model endpoint answered 500: boom</td></tr>"
        ));
        assert!(html
            .contains("<tr><td>1</td><td class=\"err\">model call timed out after 5.0s</td></tr>"));
        let table = summary_table(&meta, &summarize(&lines, 1.0));
        assert!(
            table.contains("2 × model endpoint answered 500: boom"),
            "{table}"
        );
        assert!(table.contains("reward errors 0"), "{table}");
        // A reward that could not score is counted and listed apart.
        lines[3].reward_error = Some("reward `r`: sandbox service answered 401".into());
        let s = summarize(&lines, 1.0);
        assert_eq!((s.num_errors, s.num_reward_errors), (3, 1));
        let table = summary_table(&meta, &s);
        assert!(table.contains("reward errors 1"), "{table}");
        assert!(
            table.contains("1 × reward `r`: sandbox service answered 401"),
            "{table}"
        );
    }
}
