//! The viewer's pages: server-rendered HTML with inline SVG charts and one
//! small inline script that refreshes the live part of a page (`#live`)
//! every two seconds while a run on it is running. No build step, nothing
//! loaded from elsewhere.

use std::collections::BTreeSet;
use std::fmt::Write as _;

use base64::Engine as _;
use serde_json::{Map, Value};
use sha2::{Digest, Sha256};
use temper_hub::web::esc;
use temper_rl::samples::LoggedSample;

use super::runs::{Checkpoint, EvalEntry, RunSummary, Status};

const STYLE: &str = "body{font-family:system-ui,sans-serif;margin:1.5rem;color:#222;background:#fafafa}
a{color:#0b5cad;text-decoration:none}a:hover{text-decoration:underline}
header{display:flex;gap:1rem;align-items:baseline;border-bottom:1px solid #ddd;margin-bottom:1rem}
table{border-collapse:collapse;background:#fff}td,th{text-align:left;padding:.3rem .5rem;border-bottom:1px solid #eee;vertical-align:top}
pre{background:#f3f3f3;padding:.5rem;white-space:pre-wrap;margin:0;max-width:48rem}
.st{border-radius:3px;padding:0 .4rem;font-size:.9em}.running{background:#dfe}.finished{background:#eef}.stopped{background:#eee}.failed{background:#fdd}
.c{display:inline-block;margin:4px;background:#fff;border:1px solid #ddd;padding:6px;vertical-align:top}
.c h3{margin:2px 0 4px;font-size:13px;font-weight:600}.legend span{margin-right:1rem}
.alert{background:#fff4e0;border-left:4px solid #e90;padding:.3rem .6rem;margin:.2rem 0}
section{margin:1.2rem 0}.muted{color:#777}";

/// Refreshes `#live` from the same URL every 2 s while its `data-live`
/// is `1` (a run on the page is running), except while the user is typing
/// in it (the reward filter); `data-refreshed` counts the refreshes.
const SCRIPT: &str = "(function(){var m=document.getElementById('live');\
function tick(){if(!m||m.dataset.live!=='1')return;\
if(m.contains(document.activeElement)&&document.activeElement.tagName==='INPUT'){setTimeout(tick,2000);return;}\
fetch(location.href,{cache:'no-store'}).then(function(r){return r.text()}).then(function(t){\
var d=new DOMParser().parseFromString(t,'text/html').getElementById('live');\
if(d){m.innerHTML=d.innerHTML;m.dataset.live=d.dataset.live;m.dataset.refreshed=+(m.dataset.refreshed||0)+1;}setTimeout(tick,2000)})\
.catch(function(){setTimeout(tick,5000)})}setTimeout(tick,2000)})();";

const COLORS: &[&str] = &[
    "#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2",
];

fn sha(s: &str) -> String {
    format!(
        "sha256-{}",
        base64::engine::general_purpose::STANDARD.encode(Sha256::digest(s.as_bytes()))
    )
}

/// The `Content-Security-Policy`: the page's own inline style and script
/// (by hash), fetches to itself, nothing else.
pub fn content_security_policy() -> String {
    format!(
        "default-src 'none'; script-src '{}'; style-src '{}'; connect-src 'self'; img-src 'self'; \
         form-action 'self'; base-uri 'none'; frame-ancestors 'none'",
        sha(SCRIPT),
        sha(STYLE)
    )
}

fn page(title: &str, root: &str, body: &str) -> String {
    format!(
        "<!doctype html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">\
         <meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\
         <title>{t}</title><style>{STYLE}</style></head><body>\
         <header><h1><a href=\"/\">temper runs</a></h1><span class=\"muted\">{r}</span></header>\
         {body}<script>{SCRIPT}</script></body></html>\n",
        t = esc(title),
        r = esc(root)
    )
}

/// Percent-encode a query value.
pub fn q(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'a'..=b'z' | b'A'..=b'Z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' | b'/' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

fn time(unix: Option<u64>) -> String {
    unix.and_then(|s| chrono::DateTime::from_timestamp(i64::try_from(s).ok()?, 0))
        .map(|d| d.format("%Y-%m-%d %H:%M UTC").to_string())
        .unwrap_or_default()
}

fn num(v: Option<f64>) -> String {
    v.map(|v| format!("{v:.3}")).unwrap_or_else(|| "–".into())
}

fn status(s: Status) -> String {
    format!("<span class=\"st {0}\">{0}</span>", s.as_str())
}

/// The runs list.
pub fn index_page(root: &str, runs: &[RunSummary]) -> String {
    let live = runs.iter().any(|r| r.status == Status::Running);
    let mut b = format!(
        "<main id=\"live\" data-live=\"{}\"><p id=\"count\">{} run{}</p>",
        u8::from(live),
        runs.len(),
        if runs.len() == 1 { "" } else { "s" }
    );
    if !runs.is_empty() {
        b.push_str(
            "<table id=\"runs\"><thead><tr><th>run</th><th>kind</th><th>status</th><th>step</th>\
             <th>reward</th><th>held-out pass@1</th><th>model</th><th>environment</th><th>started</th>\
             <th>alerts</th></tr></thead><tbody>",
        );
        for r in runs {
            let step = match (r.step, r.max_steps) {
                (Some(s), Some(m)) => format!("{s}/{m}"),
                (Some(s), None) => s.to_string(),
                (None, Some(m)) => format!("0/{m}"),
                (None, None) => "–".into(),
            };
            let link = if r.kind == "eval" || r.kind == "job" {
                format!("/report?id={}", q(&r.id))
            } else {
                format!("/run?id={}", q(&r.id))
            };
            let _ = write!(
                b,
                "<tr data-run=\"{id}\" data-status=\"{st}\"><td><a href=\"{link}\">{id}</a></td><td>{kind}</td>\
                 <td>{status}{err}</td><td>{step}</td><td>{rw}</td><td>{ho}</td><td>{model}</td><td>{env}</td>\
                 <td>{started}</td><td>{alerts}</td></tr>",
                id = esc(&r.id),
                st = r.status.as_str(),
                kind = esc(&r.kind),
                status = status(r.status),
                err = r
                    .error
                    .as_deref()
                    .map(|e| format!(" <small class=\"muted\">{}</small>", esc(e)))
                    .unwrap_or_default(),
                rw = num(r.reward),
                ho = num(r.heldout),
                model = esc(&r.model),
                env = esc(&r.env),
                started = time(r.started),
                alerts = if r.alerts > 0 { r.alerts.to_string() } else { String::new() },
            );
        }
        b.push_str("</tbody></table>");
    }
    b.push_str("</main>");
    page("temper runs", root, &b)
}

/// The metrics charted first, in this order; the rest follow in the order
/// the records name them.
const FIRST: &[&str] = &[
    "reward/mean",
    "pass@1",
    "eval/pass@1",
    "eval/reward",
    "loss",
    "entropy",
    "seq_len/mean",
    "truncation_rate",
    "zero_advantage_groups",
    "mismatch/max",
    "mismatch/probe_max",
    "policy_lag/mean",
    "grad_norm",
    "lr",
    "tokens_per_s",
    "time/step",
];

/// The numeric metric names of `runs`' records, charted order.
fn metric_names(runs: &[&[Map<String, Value>]]) -> Vec<String> {
    let mut seen = BTreeSet::new();
    let mut rest = Vec::new();
    for records in runs {
        for r in records.iter() {
            for (k, v) in r {
                if k != "step" && v.is_number() && seen.insert(k.clone()) {
                    rest.push(k.clone());
                }
            }
        }
    }
    let mut out: Vec<String> = FIRST
        .iter()
        .filter(|k| seen.contains(**k))
        .map(|k| k.to_string())
        .collect();
    out.extend(rest.into_iter().filter(|k| !FIRST.contains(&k.as_str())));
    out
}

/// One series of a chart.
pub struct Series<'a> {
    /// The run's id.
    pub id: &'a str,
    /// Its records.
    pub records: &'a [Map<String, Value>],
    /// Held-out points not in its records (the evaluation before step 1).
    pub extra: Vec<(String, f64, f64)>,
}

fn chart(
    name: &str,
    series: &[Series<'_>],
    step_href: &dyn Fn(u64) -> String,
    selected: Option<u64>,
) -> String {
    let (w, h, pad) = (270.0, 150.0, 30.0);
    let pts: Vec<Vec<(f64, f64)>> = series
        .iter()
        .map(|s| {
            let mut v: Vec<(f64, f64)> = s
                .extra
                .iter()
                .filter(|(k, _, _)| k == name)
                .map(|(_, x, y)| (*x, *y))
                .collect();
            v.extend(s.records.iter().filter_map(|r| {
                let x = r.get("step")?.as_f64()?;
                let y = r.get(name)?.as_f64()?;
                y.is_finite().then_some((x, y))
            }));
            v
        })
        .collect();
    let all = pts.iter().flatten();
    let (mut x0, mut x1, mut y0, mut y1) = (f64::MAX, f64::MIN, f64::MAX, f64::MIN);
    for &(x, y) in all {
        x0 = x0.min(x);
        x1 = x1.max(x);
        y0 = y0.min(y);
        y1 = y1.max(y);
    }
    if x0 > x1 {
        return String::new();
    }
    if x1 <= x0 {
        x1 = x0 + 1.0;
    }
    if y1 <= y0 {
        y1 = y0 + 1.0;
    }
    let sx = |x: f64| pad + (x - x0) / (x1 - x0) * (w - 2.0 * pad);
    let sy = |y: f64| h - pad + (y - y0) / (y1 - y0) * (2.0 * pad - h);
    let mut svg = String::new();
    if let Some(s) = selected.map(|s| s as f64).filter(|s| (x0..=x1).contains(s)) {
        let _ = write!(
            svg,
            "<line x1=\"{x:.1}\" x2=\"{x:.1}\" y1=\"{pad}\" y2=\"{y2}\" stroke=\"#e90\" stroke-dasharray=\"3,3\"/>",
            x = sx(s),
            y2 = h - pad
        );
    }
    for (i, (s, p)) in series.iter().zip(&pts).enumerate() {
        if p.is_empty() {
            continue;
        }
        let color = COLORS[i % COLORS.len()];
        let line: Vec<String> = p
            .iter()
            .map(|&(x, y)| format!("{:.1},{:.1}", sx(x), sy(y)))
            .collect();
        let _ = write!(
            svg,
            "<polyline class=\"series\" data-run=\"{}\" fill=\"none\" stroke=\"{color}\" stroke-width=\"1.5\" points=\"{}\"/>",
            esc(s.id),
            line.join(" ")
        );
        // At most ~200 markers (every k-th point and the last), so a long
        // run's page stays small; each is a step's link.
        let stride = p.len().div_ceil(200).max(1);
        let marked = p
            .iter()
            .enumerate()
            .filter(|(j, _)| j % stride == 0 || *j + 1 == p.len())
            .map(|(_, pt)| pt);
        {
            for &(x, y) in marked {
                let dot = format!(
                    "<circle class=\"pt\" data-step=\"{x}\" cx=\"{:.1}\" cy=\"{:.1}\" r=\"{}\" fill=\"{color}\"><title>{} step {x}: {y:.4}</title></circle>",
                    sx(x),
                    sy(y),
                    if i == 0 { 3 } else { 2 },
                    esc(s.id)
                );
                // The first run's points open that step's samples.
                if i == 0 && x >= 1.0 {
                    let _ = write!(
                        svg,
                        "<a class=\"step\" href=\"{}\">{dot}</a>",
                        esc(&step_href(x as u64))
                    );
                } else {
                    svg.push_str(&dot);
                }
            }
        }
    }
    let last = pts[0]
        .last()
        .map(|p| format!(" <small>(last {:.4})</small>", p.1))
        .unwrap_or_default();
    format!(
        "<div class=\"c\" data-metric=\"{n}\"><h3>{n}{last}</h3>\
         <svg width=\"{w}\" height=\"{h}\" xmlns=\"http://www.w3.org/2000/svg\">\
         <rect x=\"{pad}\" y=\"{pad}\" width=\"{iw}\" height=\"{ih}\" fill=\"none\" stroke=\"#ccc\"/>{svg}\
         <text x=\"2\" y=\"{ty1}\" font-size=\"10\">{y1:.3}</text>\
         <text x=\"2\" y=\"{ty0}\" font-size=\"10\">{y0:.3}</text>\
         <text x=\"{pad}\" y=\"{tx}\" font-size=\"10\">step {x0}</text>\
         <text x=\"{tx1}\" y=\"{tx}\" font-size=\"10\">{x1}</text></svg></div>",
        n = esc(name),
        iw = w - 2.0 * pad,
        ih = h - 2.0 * pad,
        ty1 = pad + 4.0,
        ty0 = h - pad,
        tx = h - 8.0,
        tx1 = w - pad - 20.0,
    )
}

/// A step's samples, already filtered by reward.
pub struct StepSamples {
    /// The step.
    pub step: u64,
    /// Its samples with a reward in the filter's range.
    pub samples: Vec<LoggedSample>,
    /// The filter's lowest reward.
    pub min_reward: Option<f64>,
    /// The filter's highest reward.
    pub max_reward: Option<f64>,
}

/// Everything the run page shows.
pub struct RunPage<'a> {
    /// The runs root, for the header.
    pub root: &'a str,
    /// The run.
    pub run: &'a RunSummary,
    /// It and the runs overlaid on it.
    pub series: Vec<Series<'a>>,
    /// Other training runs that can be overlaid.
    pub others: Vec<&'a str>,
    /// The chosen step and its samples.
    pub step: Option<StepSamples>,
    /// Held-out evaluations.
    pub evals: Vec<EvalEntry>,
    /// Checkpoints.
    pub checkpoints: Vec<Checkpoint>,
    /// The command line (shell-quoted) and the directory it ran in.
    pub command: Option<(String, String)>,
    /// The resolved config (TOML).
    pub config: Option<String>,
}

/// A run's page.
pub fn run_page(p: &RunPage<'_>) -> String {
    let r = p.run;
    let vs: String = p.series[1..]
        .iter()
        .map(|s| format!("&vs={}", q(s.id)))
        .collect();
    let base = format!("/run?id={}{vs}", q(&r.id));
    let step_href = |s: u64| format!("{base}&step={s}#samples");
    let live = r.status == Status::Running;
    let mut b = format!(
        "<main id=\"live\" data-live=\"{}\"><h2>{} {}</h2><p>{} · model <b>{}</b> · environment <b>{}</b> · started {} · step <span id=\"step\">{}</span>{}</p>",
        u8::from(live),
        esc(&r.id),
        status(r.status),
        esc(&r.kind),
        esc(&r.model),
        esc(&r.env),
        time(r.started),
        r.step.map(|s| s.to_string()).unwrap_or_else(|| "0".into()),
        r.max_steps.map(|m| format!("/{m}")).unwrap_or_default(),
    );
    if let Some(e) = &r.error {
        let _ = write!(b, "<p class=\"alert\">error: {}</p>", esc(e));
    }
    b.push_str(
        "<p class=\"nav\"><a href=\"#charts\">charts</a> · <a href=\"#evals\">held-out evaluations</a> · \
         <a href=\"#checkpoints\">checkpoints</a> · <a href=\"#overlay\">overlay runs</a> · <a href=\"#repeat\">repeat this run</a></p>",
    );
    // Alerts the trainer raised (metrics.jsonl's `alerts`), newest first.
    let alerts: Vec<(u64, String)> = p.series[0]
        .records
        .iter()
        .flat_map(|rec| {
            let step = rec.get("step").and_then(Value::as_u64).unwrap_or(0);
            rec.get("alerts")
                .and_then(Value::as_array)
                .into_iter()
                .flatten()
                .filter_map(move |a| Some((step, a.as_str()?.to_string())))
        })
        .collect();
    if !alerts.is_empty() {
        b.push_str("<section id=\"alerts\"><h3>Alerts</h3>");
        for (step, a) in alerts.iter().rev().take(20) {
            let _ = write!(b, "<div class=\"alert\">step {step}: {}</div>", esc(a));
        }
        b.push_str("</section>");
    }
    // The chosen step's samples, above the charts they were picked from.
    if let Some(StepSamples {
        step,
        samples,
        min_reward: lo,
        max_reward: hi,
    }) = &p.step
    {
        b.push_str("<section id=\"samples\"><h3>Samples</h3>");
        {
            let _ = write!(
                b,
                "<form method=\"get\" action=\"/run#samples\"><input type=\"hidden\" name=\"id\" value=\"{id}\">{hidden}\
                 <input type=\"hidden\" name=\"step\" value=\"{step}\">step <b>{step}</b> · reward from \
                 <input name=\"min_reward\" size=\"5\" value=\"{lo}\"> to <input name=\"max_reward\" size=\"5\" value=\"{hi}\"> \
                 <button type=\"submit\">filter</button></form>",
                id = esc(&r.id),
                hidden = p.series[1..]
                    .iter()
                    .map(|s| format!("<input type=\"hidden\" name=\"vs\" value=\"{}\">", esc(s.id)))
                    .collect::<String>(),
                lo = lo.map(|v| v.to_string()).unwrap_or_default(),
                hi = hi.map(|v| v.to_string()).unwrap_or_default(),
            );
            let _ = write!(
                b,
                "<p id=\"sample-count\">{} sample{} of step {step}</p>",
                samples.len(),
                if samples.len() == 1 { "" } else { "s" }
            );
            if !samples.is_empty() {
                b.push_str("<table id=\"sample-table\"><tr><th>env</th><th>example</th><th>prompt</th><th>completion</th><th>reward</th><th>advantage</th><th>truncated</th><th>error</th></tr>");
                for s in samples {
                    let _ = write!(
                        b,
                        "<tr class=\"sample\"><td>{}</td><td>{}</td><td><pre>{}</pre></td><td><pre>{}</pre></td><td class=\"reward\">{:.3}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
                        esc(&s.env),
                        s.example_id,
                        esc(&s.prompt),
                        esc(&s.completion),
                        s.reward,
                        num(s.advantage),
                        if s.truncated { "yes" } else { "" },
                        esc(s.error.as_deref().unwrap_or("")),
                    );
                }
                b.push_str("</table>");
            }
        }
        b.push_str("</section>");
    }

    b.push_str("<section id=\"charts\">");
    if p.series.len() > 1 {
        b.push_str("<p class=\"legend\">");
        for (i, s) in p.series.iter().enumerate() {
            let _ = write!(
                b,
                "<span><svg width=\"12\" height=\"12\"><rect width=\"12\" height=\"12\" fill=\"{}\"/></svg> {}</span>",
                COLORS[i % COLORS.len()],
                esc(s.id)
            );
        }
        b.push_str("</p>");
    }
    let recs: Vec<&[Map<String, Value>]> = p.series.iter().map(|s| s.records).collect();
    let names = metric_names(&recs);
    if names.is_empty() {
        b.push_str("<p>No metrics recorded yet.</p>");
    } else {
        b.push_str("<p class=\"muted\">Click a point of a chart for that step's rollouts.</p>");
    }
    let selected = p.step.as_ref().map(|s| s.step);
    for n in &names {
        b.push_str(&chart(n, &p.series, &step_href, selected));
    }
    b.push_str("</section>");

    b.push_str("<section id=\"evals\"><h3>Held-out evaluations</h3>");
    if p.evals.is_empty() {
        b.push_str("<p class=\"muted\">None yet.</p>");
    } else {
        b.push_str("<table><tr><th>after step</th><th>pass@1</th><th>mean reward</th><th>rollouts</th><th>per-example outputs</th></tr>");
        for e in &p.evals {
            let _ = write!(
                b,
                "<tr><td>{}</td><td>{}</td><td>{:.3}</td><td>{}</td><td><a href=\"/report?id={}\">report</a></td></tr>",
                e.step,
                num(e.pass_at_1),
                e.reward,
                e.rollouts,
                q(&e.id)
            );
        }
        b.push_str("</table>");
    }
    b.push_str("</section><section id=\"checkpoints\"><h3>Checkpoints</h3>");
    if p.checkpoints.is_empty() {
        b.push_str("<p class=\"muted\">None yet.</p>");
    }
    for c in &p.checkpoints {
        let _ = write!(
            b,
            "<div class=\"ckpt\"><p><b>{}</b> <code>{}</code></p><pre>",
            esc(&c.what),
            esc(&c.path)
        );
        b.push_str(&esc(&c.commands.join("\n")));
        b.push_str("</pre></div>");
    }
    b.push_str("</section></main>");

    if !p.others.is_empty() {
        let _ = write!(
            b,
            "<section id=\"overlay\"><h3>Overlay runs</h3><form method=\"get\" action=\"/run\"><input type=\"hidden\" name=\"id\" value=\"{}\">",
            esc(&r.id)
        );
        let chosen: BTreeSet<&str> = p.series[1..].iter().map(|s| s.id).collect();
        for o in &p.others {
            let _ = write!(
                b,
                "<label><input type=\"checkbox\" name=\"vs\" value=\"{0}\"{1}> {0}</label> ",
                esc(o),
                if chosen.contains(o) { " checked" } else { "" }
            );
        }
        b.push_str("<button type=\"submit\">overlay</button></form></section>");
    }
    b.push_str("<section id=\"repeat\"><h3>Repeat this run</h3>");
    match &p.command {
        Some((cmd, cwd)) => {
            let _ = write!(b, "<p>From <code>{}</code>:</p><pre id=\"command\">{}</pre>", esc(cwd), esc(cmd));
        }
        None => b.push_str("<p class=\"muted\">No run.json (the run predates it): the command line is unknown.</p>"),
    }
    if let Some(c) = &p.config {
        let _ = write!(
            b,
            "<p>Resolved config (<code>config.toml</code>):</p><pre id=\"config\">{}</pre>",
            esc(c)
        );
    }
    b.push_str("</section>");
    page(&format!("{} — temper runs", r.id), p.root, &b)
}

/// An error page.
pub fn error_page(root: &str, status: u16, msg: &str) -> String {
    page(
        "temper runs",
        root,
        &format!(
            "<main id=\"live\" data-live=\"0\"><h2>{status}</h2><p id=\"error\">{}</p></main>",
            esc(msg)
        ),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A long run's chart draws its whole line but at most ~200 step
    /// markers (links), the last step's among them.
    #[test]
    fn a_long_runs_chart_keeps_its_line_and_thins_its_markers() {
        let records: Vec<Map<String, Value>> = (1..=1000)
            .map(|s| {
                let v = serde_json::json!({"step": s, "reward/mean": f64::from(s) / 1000.0});
                v.as_object().cloned().unwrap_or_default()
            })
            .collect();
        let series = [Series {
            id: "r",
            records: &records,
            extra: Vec::new(),
        }];
        let svg = chart(
            "reward/mean",
            &series,
            &|s| format!("/run?id=r&step={s}"),
            None,
        );
        let line = svg.split("points=\"").nth(1).unwrap_or_default();
        assert_eq!(
            line.split('"')
                .next()
                .unwrap_or_default()
                .split(' ')
                .count(),
            1000
        );
        let markers = svg.matches("<circle").count();
        assert!((100..=201).contains(&markers), "{markers}");
        assert_eq!(svg.matches("<a class=\"step\"").count(), markers);
        assert!(svg.contains("step=1000"), "the last step is marked");
    }
}
