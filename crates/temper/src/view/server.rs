//! `temper view DIR --port P`: the runs of a directory, live, over HTTP.
//! Every request names a run by its path relative to the root (`id=`),
//! which [`RunsRoot::resolve`] keeps inside it; a client's mistake is a
//! 4xx with a message.

use std::sync::Arc;

use axum::extract::{Query, RawQuery, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{Html, IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use serde::Deserialize;
use serde_json::Value;

use super::page::{self, RunPage, Series, StepSamples};
use super::runs::{self, Kind, RunsRoot, ViewError};

/// The server's state: the root and its name for the header.
#[derive(Clone)]
pub struct ViewState {
    root: Arc<RunsRoot>,
    shown: Arc<String>,
}

impl ViewState {
    /// Serve the runs under `root`.
    pub fn new(root: RunsRoot) -> Self {
        let shown = root.path().display().to_string();
        Self {
            root: Arc::new(root),
            shown: Arc::new(shown),
        }
    }
}

impl IntoResponse for ViewError {
    fn into_response(self) -> Response {
        let code = match &self {
            ViewError::BadRequest(_) => StatusCode::BAD_REQUEST,
            ViewError::Forbidden(_) => StatusCode::FORBIDDEN,
            ViewError::NotFound(_) => StatusCode::NOT_FOUND,
            ViewError::Io(_) => StatusCode::INTERNAL_SERVER_ERROR,
        };
        (code, Json(serde_json::json!({"error": self.to_string()}))).into_response()
    }
}

/// The router.
pub fn app(state: ViewState) -> Router {
    Router::new()
        .route(
            "/health",
            get(|| async { Json(serde_json::json!({"status": "ok"})) }),
        )
        .route("/", get(index))
        .route("/run", get(run))
        .route("/report", get(report))
        .route("/api/runs", get(api_runs))
        .route("/api/metrics", get(api_metrics))
        .route("/api/samples", get(api_samples))
        .layer(axum::middleware::map_response(security_headers))
        .with_state(state)
}

async fn security_headers(mut resp: Response) -> Response {
    let h = resp.headers_mut();
    if !h.contains_key(header::CONTENT_SECURITY_POLICY) {
        if let Ok(v) = HeaderValue::from_str(&page::content_security_policy()) {
            h.insert(header::CONTENT_SECURITY_POLICY, v);
        }
    }
    h.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    h.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("no-referrer"),
    );
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    resp
}

/// Reading runs touches the disk: off the async runtime.
async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, ViewError> + Send + 'static,
) -> Result<T, ViewError> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| ViewError::Io(format!("reading the runs: {e}")))?
}

async fn index(State(s): State<ViewState>) -> Html<String> {
    let root = s.root.clone();
    let runs = blocking(move || Ok(root.runs())).await.unwrap_or_default();
    Html(page::index_page(&s.shown, &runs))
}

async fn api_runs(State(s): State<ViewState>) -> Result<Json<Value>, ViewError> {
    let root = s.root.clone();
    let runs = blocking(move || Ok(root.runs())).await?;
    Ok(Json(serde_json::json!({"runs": runs})))
}

#[derive(Deserialize)]
struct IdQuery {
    id: String,
}

/// The run `id` names, which must be a training run.
fn train_run(root: &RunsRoot, id: &str) -> Result<std::path::PathBuf, ViewError> {
    let dir = root.resolve(id)?;
    match runs::kind_of(&dir) {
        Some(Kind::Train) => Ok(dir),
        Some(_) => Err(ViewError::BadRequest(format!(
            "{id:?} is an evaluation or a job, not a training run: see /report?id={id}"
        ))),
        None => Err(ViewError::NotFound(format!("{id:?} is not a run"))),
    }
}

async fn api_metrics(
    State(s): State<ViewState>,
    Query(q): Query<IdQuery>,
) -> Result<Json<Value>, ViewError> {
    let root = s.root.clone();
    let records = blocking(move || {
        let dir = train_run(&root, &q.id)?;
        runs::metrics(&root, &dir)
    })
    .await?;
    Ok(Json(serde_json::json!({"records": records})))
}

#[derive(Deserialize)]
struct SamplesQuery {
    id: String,
    step: u64,
}

async fn api_samples(
    State(s): State<ViewState>,
    Query(q): Query<SamplesQuery>,
) -> Result<Json<Value>, ViewError> {
    let root = s.root.clone();
    let samples = blocking(move || {
        let dir = train_run(&root, &q.id)?;
        runs::samples(&root, &dir, q.step)
    })
    .await?;
    Ok(Json(serde_json::json!({"samples": samples})))
}

/// The run page's query: `id`, any number of `vs` (runs overlaid), and
/// optionally `step` with `min_reward` / `max_reward`. Parsed by hand:
/// `vs` repeats.
#[derive(Default)]
struct RunQuery {
    id: Option<String>,
    vs: Vec<String>,
    step: Option<u64>,
    min_reward: Option<f64>,
    max_reward: Option<f64>,
}

fn decode(s: &str) -> Result<String, ViewError> {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'+' => out.push(b' '),
            b'%' => {
                let hex = s
                    .get(i + 1..i + 3)
                    .and_then(|h| u8::from_str_radix(h, 16).ok())
                    .ok_or_else(|| {
                        ViewError::BadRequest(format!("bad percent-encoding in {s:?}"))
                    })?;
                out.push(hex);
                i += 2;
            }
            b => out.push(b),
        }
        i += 1;
    }
    String::from_utf8(out).map_err(|_| ViewError::BadRequest(format!("{s:?} is not UTF-8")))
}

fn parse_run_query(raw: Option<&str>) -> Result<RunQuery, ViewError> {
    let mut q = RunQuery::default();
    for pair in raw.unwrap_or("").split('&').filter(|p| !p.is_empty()) {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        let v = decode(v)?;
        let number = |what: &str| -> Result<Option<f64>, ViewError> {
            if v.trim().is_empty() {
                return Ok(None);
            }
            v.trim()
                .parse::<f64>()
                .map(Some)
                .map_err(|_| ViewError::BadRequest(format!("{what} {v:?} is not a number")))
        };
        match decode(k)?.as_str() {
            "id" => q.id = Some(v),
            "vs" => q.vs.push(v),
            "step" => {
                q.step = Some(v.parse().map_err(|_| {
                    ViewError::BadRequest(format!("step {v:?} is not a step number"))
                })?)
            }
            "min_reward" => q.min_reward = number("min_reward")?,
            "max_reward" => q.max_reward = number("max_reward")?,
            _ => {}
        }
    }
    Ok(q)
}

async fn run(State(s): State<ViewState>, RawQuery(raw): RawQuery) -> Response {
    let root = s.root.clone();
    let shown = s.shown.clone();
    let r = blocking(move || render_run(&root, &shown, raw.as_deref())).await;
    match r {
        Ok(html) => Html(html).into_response(),
        Err(e) => page_error(&s, e),
    }
}

fn page_error(s: &ViewState, e: ViewError) -> Response {
    let code = e.clone_status();
    (
        code,
        Html(page::error_page(&s.shown, code.as_u16(), &e.to_string())),
    )
        .into_response()
}

impl ViewError {
    fn clone_status(&self) -> StatusCode {
        match self {
            ViewError::BadRequest(_) => StatusCode::BAD_REQUEST,
            ViewError::Forbidden(_) => StatusCode::FORBIDDEN,
            ViewError::NotFound(_) => StatusCode::NOT_FOUND,
            ViewError::Io(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }
}

fn render_run(root: &RunsRoot, shown: &str, raw: Option<&str>) -> Result<String, ViewError> {
    let q = parse_run_query(raw)?;
    let id =
        q.id.ok_or_else(|| ViewError::BadRequest("the run page needs ?id=RUN".into()))?;
    let dir = train_run(root, &id)?;
    let all = root.runs();
    let run = all
        .iter()
        .find(|r| root.resolve(&r.id).ok().as_deref() == Some(dir.as_path()))
        .ok_or_else(|| ViewError::NotFound(format!("{id:?} is not a run")))?;
    let mut loaded = vec![(run.id.clone(), runs::metrics(root, &dir)?)];
    for v in &q.vs {
        let d = train_run(root, v)?;
        if d != dir {
            loaded.push((root.id_of(&d), runs::metrics(root, &d)?));
        }
    }
    let evals = runs::evals(root, &dir);
    let series: Vec<Series<'_>> = loaded
        .iter()
        .enumerate()
        .map(|(i, (id, records))| Series {
            id,
            records,
            // The evaluation before training (step 0) is not a step's record.
            extra: if i == 0 {
                evals
                    .iter()
                    .filter(|e| e.step == 0)
                    .flat_map(|e| {
                        let mut v = vec![("eval/reward".to_string(), 0.0, e.reward)];
                        v.extend(e.pass_at_1.map(|p| ("eval/pass@1".to_string(), 0.0, p)));
                        v
                    })
                    .collect()
            } else {
                Vec::new()
            },
        })
        .collect();
    let step = match q.step {
        Some(step) => {
            let samples = runs::samples(root, &dir, step)?
                .into_iter()
                .filter(|s| {
                    q.min_reward.is_none_or(|lo| s.reward >= lo)
                        && q.max_reward.is_none_or(|hi| s.reward <= hi)
                })
                .collect();
            Some(StepSamples {
                step,
                samples,
                min_reward: q.min_reward,
                max_reward: q.max_reward,
            })
        }
        None => None,
    };
    let info = runs::run_info(root, &dir)?;
    let config = runs::config(root, &dir)?;
    let model_path = config
        .as_ref()
        .and_then(|(_, t)| t.get("model")?.get("path")?.as_str().map(str::to_string));
    let others: Vec<&str> = all
        .iter()
        .filter(|r| r.id != run.id && r.kind != "eval" && r.kind != "job")
        .map(|r| r.id.as_str())
        .collect();
    let page = RunPage {
        root: shown,
        run,
        series,
        others,
        step,
        evals,
        checkpoints: runs::checkpoints(root, &dir, &run.kind, model_path.as_deref()),
        command: info.map(|i| {
            (
                i.command
                    .iter()
                    .map(|a| runs::sh_quote(a))
                    .collect::<Vec<_>>()
                    .join(" "),
                i.cwd.display().to_string(),
            )
        }),
        config: config.map(|(text, _)| text),
    };
    Ok(page::run_page(&page))
}

/// An eval run's or a job's report (the one `temper view DIR` writes),
/// rendered from its files. It carries its own inline style, so its
/// policy allows inline styles and no script.
async fn report(State(s): State<ViewState>, Query(q): Query<IdQuery>) -> Response {
    let root = s.root.clone();
    let r = blocking(move || {
        let dir = root.resolve(&q.id)?;
        match runs::kind_of(&dir) {
            Some(Kind::Eval) => {
                let meta = temper_eval::results::read_metadata(&dir)
                    .map_err(|e| ViewError::Io(e.to_string()))?;
                let results = root
                    .file(&dir, "results.jsonl")?
                    .ok_or_else(|| ViewError::NotFound("no results.jsonl".into()))?;
                let lines = temper_eval::results::read_results(&results)
                    .map_err(|e| ViewError::Io(e.to_string()))?;
                Ok(temper_eval::report::html_report(&meta, &lines))
            }
            Some(Kind::Job) => {
                let cfg = temper_tasks::load_job(&dir).map_err(|e| ViewError::Io(e.to_string()))?;
                let results = temper_tasks::job::job_results(&dir, &cfg);
                Ok(temper_tasks::job::html_report(&cfg, &results))
            }
            _ => Err(ViewError::BadRequest(format!(
                "{:?} is not an evaluation or a job",
                q.id
            ))),
        }
    })
    .await;
    match r {
        Ok(html) => (
            [(
                header::CONTENT_SECURITY_POLICY,
                "default-src 'none'; style-src 'unsafe-inline'; script-src 'none'; base-uri 'none'; frame-ancestors 'none'",
            )],
            Html(html),
        )
            .into_response(),
        Err(e) => page_error(&s, e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::body::Body;
    use axum::http::Request;
    use tower::ServiceExt;

    async fn get_status(app: &Router, uri: &str) -> (StatusCode, String) {
        let resp = app
            .clone()
            .oneshot(Request::get(uri).body(Body::empty()).unwrap())
            .await
            .unwrap();
        let code = resp.status();
        let body = axum::body::to_bytes(resp.into_body(), 1 << 20)
            .await
            .unwrap();
        (code, String::from_utf8_lossy(&body).into_owned())
    }

    /// Paths built from a request stay inside the runs root: `..` and
    /// absolute ids are 400, a symlink out of it 403, no run 404.
    #[tokio::test]
    async fn requests_cannot_leave_the_runs_directory() {
        let dir = tempfile::tempdir().unwrap();
        let run = dir.path().join("runs/a");
        std::fs::create_dir_all(&run).unwrap();
        std::fs::write(
            run.join("metrics.jsonl"),
            "{\"step\":1,\"reward/mean\":0.25}\n",
        )
        .unwrap();
        std::fs::write(
            run.join("samples.jsonl"),
            "{\"step\":1,\"env\":\"e\",\"example_id\":0,\"prompt\":\"p<1>\",\"completion\":\"c\",\"reward\":0.25,\"advantage\":0.5,\"truncated\":false}\n",
        )
        .unwrap();
        let secret = dir.path().join("secret");
        std::fs::create_dir_all(&secret).unwrap();
        std::fs::write(secret.join("metrics.jsonl"), "{\"step\":1,\"secret\":1}\n").unwrap();
        std::os::unix::fs::symlink(&secret, dir.path().join("runs/link")).unwrap();
        let app = app(ViewState::new(
            RunsRoot::open(&dir.path().join("runs")).unwrap(),
        ));

        let (code, body) = get_status(&app, "/api/metrics?id=a").await;
        assert_eq!(code, StatusCode::OK, "{body}");
        assert!(body.contains("0.25"));
        for (uri, want) in [
            ("/api/metrics?id=../secret", StatusCode::BAD_REQUEST),
            ("/api/metrics?id=%2Fetc", StatusCode::BAD_REQUEST),
            ("/run?id=a%2F..%2F..%2Fsecret", StatusCode::BAD_REQUEST),
            ("/report?id=..", StatusCode::BAD_REQUEST),
            ("/api/metrics?id=link", StatusCode::FORBIDDEN),
            ("/run?id=link", StatusCode::FORBIDDEN),
            ("/api/samples?id=a&step=x", StatusCode::BAD_REQUEST),
            ("/run?id=a&step=x", StatusCode::BAD_REQUEST),
            ("/run?id=a&step=1&min_reward=lots", StatusCode::BAD_REQUEST),
            ("/run?id=nope", StatusCode::NOT_FOUND),
            ("/run", StatusCode::BAD_REQUEST),
        ] {
            let (code, body) = get_status(&app, uri).await;
            assert_eq!(code, want, "{uri}: {body}");
            assert!(!body.contains("\"secret\""), "{uri}: {body}");
        }
        // The symlinked directory is not listed either.
        let (_, body) = get_status(&app, "/api/runs").await;
        assert!(body.contains("\"a\"") && !body.contains("link"), "{body}");
    }

    #[tokio::test]
    async fn a_step_shows_its_samples_filtered_by_reward_and_escaped() {
        let dir = tempfile::tempdir().unwrap();
        let run = dir.path().join("a");
        std::fs::create_dir_all(&run).unwrap();
        std::fs::write(
            run.join("metrics.jsonl"),
            "{\"step\":1,\"reward/mean\":0.5}\n{\"step\":2,\"reward/mean\":0.75}\n",
        )
        .unwrap();
        let line = |step: u64, reward: f64, prompt: &str| {
            format!("{{\"step\":{step},\"env\":\"e\",\"example_id\":0,\"prompt\":\"{prompt}\",\"completion\":\"c\",\"reward\":{reward},\"advantage\":-0.5,\"truncated\":true}}\n")
        };
        std::fs::write(
            run.join("samples.jsonl"),
            [
                line(1, 0.0, "one"),
                line(2, 1.0, "<b>two</b>"),
                line(2, 0.0, "three"),
            ]
            .concat(),
        )
        .unwrap();
        let app = app(ViewState::new(RunsRoot::open(dir.path()).unwrap()));
        let (code, page) = get_status(&app, "/run?id=a").await;
        assert_eq!(code, StatusCode::OK);
        assert!(
            page.contains("href=\"/run?id=a&amp;step=2#samples\""),
            "{page}"
        );
        let (_, page) = get_status(&app, "/run?id=a&step=2").await;
        assert!(page.contains("2 samples of step 2"), "{page}");
        assert!(
            page.contains("&lt;b&gt;two&lt;/b&gt;") && !page.contains("<b>two"),
            "escaped"
        );
        assert!(page.contains("-0.500") && !page.contains(">one<"), "{page}");
        let (_, page) = get_status(&app, "/run?id=a&step=2&min_reward=0.5").await;
        assert!(
            page.contains("1 sample of step 2") && !page.contains("three"),
            "{page}"
        );
        // Overlaying the run on itself draws it once.
        let (_, page) = get_status(&app, "/run?id=a&vs=a").await;
        assert_eq!(
            page.matches("<polyline class=\"series\"").count(),
            1,
            "{page}"
        );
    }
}
