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
    let mut by_message: BTreeMap<&str, usize> = BTreeMap::new();
    for e in lines.iter().filter_map(|l| l.error.as_deref()) {
        *by_message.entry(e).or_default() += 1;
    }
    let mut errors: Vec<(String, usize)> = by_message
        .into_iter()
        .map(|(m, c)| (m.to_string(), c))
        .collect();
    errors.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
    Summary {
        num_rollouts: n,
        num_examples: groups.len(),
        avg_reward,
        std_reward: var.sqrt(),
        avg_metrics,
        pass_at_k: pass,
        num_errors: lines.iter().filter(|l| l.error.is_some()).count(),
        errors,
        num_truncated: lines.iter().filter(|l| l.is_truncated).count(),
        usage,
        avg_generation_ms: mean(&mut lines.iter().map(|l| l.timing.generation_ms)),
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
    for (k, v) in &s.pass_at_k {
        let _ = writeln!(t, "pass@{k:<5} {v:.4}");
    }
    let _ = writeln!(
        t,
        "errors     {}   truncated {}",
        s.num_errors, s.num_truncated
    );
    for (m, c) in s.errors.iter().take(10) {
        let _ = writeln!(t, "  {c:>5} × {}", clip(m, 300));
    }
    if s.errors.len() > 10 {
        let _ = writeln!(
            t,
            "  … {} more distinct errors in results.jsonl",
            s.errors.len() - 10
        );
    }
    let _ = writeln!(
        t,
        "tokens     {} in / {} out",
        s.usage.input_tokens, s.usage.output_tokens
    );
    let _ = write!(
        t,
        "time       {:.1}s   mean generation {:.0} ms",
        meta.time, s.avg_generation_ms
    );
    t
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

fn histogram_svg(rewards: &[f64]) -> String {
    if rewards.is_empty() {
        return "<p>no rollouts</p>".into();
    }
    let lo = rewards.iter().copied().fold(f64::INFINITY, f64::min);
    let hi = rewards.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let bins = 20usize;
    let width = if hi > lo {
        (hi - lo) / bins as f64
    } else {
        1.0
    };
    let mut counts = vec![0usize; bins];
    for r in rewards {
        let b = if hi > lo {
            (((r - lo) / width) as usize).min(bins - 1)
        } else {
            0
        };
        counts[b] += 1;
    }
    let max = counts.iter().copied().max().unwrap_or(1).max(1) as f64;
    let (w, h) = (600.0, 200.0);
    let bw = w / bins as f64;
    let mut svg = format!(
        "<svg width=\"{w}\" height=\"{}\" xmlns=\"http://www.w3.org/2000/svg\">",
        h + 30.0
    );
    for (i, c) in counts.iter().enumerate() {
        let bh = h * *c as f64 / max;
        let _ = write!(
            svg,
            "<rect x=\"{:.1}\" y=\"{:.1}\" width=\"{:.1}\" height=\"{bh:.1}\" fill=\"#4a7\"><title>[{:.3}, {:.3}): {c}</title></rect>",
            i as f64 * bw + 1.0,
            h - bh,
            bw - 2.0,
            lo + i as f64 * width,
            lo + (i + 1) as f64 * width
        );
    }
    let _ = write!(
        svg,
        "<text x=\"0\" y=\"{}\" font-size=\"12\">{lo:.3}</text><text x=\"{}\" y=\"{}\" font-size=\"12\" text-anchor=\"end\">{hi:.3}</text></svg>",
        h + 20.0,
        w,
        h + 20.0
    );
    svg
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

/// A self-contained HTML report: summary, reward histogram, per-metric
/// means, pass@k, slowest and failed rollouts, and browsable transcripts.
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
        "<h2>Reward histogram</h2>{}",
        histogram_svg(&lines.iter().map(|l| l.reward).collect::<Vec<_>>())
    );
    let _ = write!(h, "<h2>Metrics</h2><table><tr><th>metric</th><th>mean</th></tr><tr><td>reward</td><td>{:.4}</td></tr>", s.avg_reward);
    for (k, v) in &s.avg_metrics {
        let _ = write!(h, "<tr><td>{}</td><td>{v:.4}</td></tr>", esc(k));
    }
    let _ = write!(
        h,
        "</table><h2>pass@k</h2><table><tr><th>k</th><th>pass@k</th></tr>"
    );
    for (k, v) in &s.pass_at_k {
        let _ = write!(h, "<tr><td>{}</td><td>{v:.4}</td></tr>", esc(k));
    }
    h.push_str("</table>");
    let mut slow: Vec<&ResultLine> = lines.iter().collect();
    slow.sort_by(|a, b| b.timing.total_ms.total_cmp(&a.timing.total_ms));
    h.push_str("<h2>Slowest rollouts</h2><table><tr><th>example</th><th>total ms</th><th>reward</th><th>stop</th></tr>");
    for l in slow.iter().take(10) {
        let _ = write!(
            h,
            "<tr><td>{}</td><td>{:.1}</td><td>{:.3}</td><td>{}</td></tr>",
            l.example_id,
            l.timing.total_ms,
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
}
