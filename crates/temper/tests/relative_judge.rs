//! Issue 32 §3: the relative judge (`relative_judge`, RULER's shape) sends
//! a group's rollouts to an OpenAI-compatible judge in one call and reads a
//! score in [0, 1] for each; a malformed answer, a wrong count, a score out
//! of range or a failing endpoint is a counted reward error, never a silent
//! 0. The judge here is a real HTTP server answering scripted JSON.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::{json, Value};
use temper_env::rubric::relative_judge::{parse_scores, RelativeJudge, RelativeJudgeConfig};
use temper_env::{Message, Parser, Reward, Rollout, Row, Rubric};

/// What the scripted judge answers to a request body: HTTP status and the
/// assistant message's text (or the error message). A text starting with
/// `CUT:` comes back as cut at `max_tokens` (`finish_reason` `length`).
type Script = Arc<dyn Fn(&Value) -> (u16, String) + Send + Sync>;

#[derive(Clone)]
struct Judge {
    script: Script,
    seen: Arc<Mutex<Vec<Value>>>,
}

async fn chat(State(j): State<Judge>, Json(body): Json<Value>) -> (StatusCode, Json<Value>) {
    j.seen.lock().unwrap().push(body.clone());
    let (status, text) = (j.script)(&body);
    let status = StatusCode::from_u16(status).unwrap();
    if !status.is_success() {
        return (status, Json(json!({"error": {"message": text}})));
    }
    let (finish, text) = match text.strip_prefix("CUT:") {
        Some(t) => ("length", t.to_string()),
        None => ("stop", text),
    };
    let reply = json!({
        "id": "j", "object": "chat.completion", "model": "judge",
        "choices": [{"index": 0, "finish_reason": finish,
                     "message": {"role": "assistant", "content": text}}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
    });
    (status, Json(reply))
}

/// A judge endpoint on a free port: `(base_url, requests seen, runtime)`.
fn judge_server(script: Script) -> (String, Arc<Mutex<Vec<Value>>>, tokio::runtime::Runtime) {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let state = Judge {
        script,
        seen: seen.clone(),
    };
    let app = Router::new()
        .route("/v1/chat/completions", post(chat))
        .route(
            "/v1/models",
            get(|| async { Json(json!({"object": "list", "data": [{"id": "judge"}]})) }),
        )
        .with_state(state);
    let listener = rt
        .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
        .unwrap();
    let addr = listener.local_addr().unwrap();
    rt.spawn(async move { axum::serve(listener, app).await });
    (format!("http://{addr}/v1"), seen, rt)
}

/// The trajectory count of a judge request (its `<trajectory id=` tags).
fn trajectories(body: &Value) -> usize {
    body["messages"][1]["content"]
        .as_str()
        .unwrap()
        .matches("<trajectory id=")
        .count()
}

/// Trajectory i of n scores i / (n + 1): distinct scores whose mean is ½.
fn ranked(body: &Value) -> (u16, String) {
    let n = trajectories(body);
    let scores: Vec<Value> = (1..=n)
        .map(|i| json!({"trajectory_id": i.to_string(), "explanation": "ok", "score": i as f64 / (n + 1) as f64}))
        .collect();
    (200, json!({ "scores": scores }).to_string())
}

fn rollout(text: &str) -> Rollout {
    Rollout {
        completion: vec![Message::assistant(text)],
        is_completed: true,
        ..Rollout::default()
    }
}

fn row() -> Row {
    Row {
        example_id: 0,
        prompt: vec![Message::system("Add."), Message::user("What is 2 + 3?")],
        answer: Some("5".into()),
        info: json!({}),
    }
}

fn spec(base: &str, extra: &str) -> Reward {
    let spec: temper_env::rubric::RewardSpec = toml::from_str(&format!(
        "function = \"relative_judge\"\nweight = 2.0\n\
         args = {{ base_url = {base:?}, model = \"judge\"{extra} }}"
    ))
    .unwrap();
    Reward::from_spec(&spec).unwrap()
}

#[test]
fn one_call_scores_the_whole_group_and_identical_answers_share_a_score() {
    let (base, seen, rt) = judge_server(Arc::new(|_: &Value| {
        // Out of order, ids as numbers or strings: matched by id.
        (
            200,
            "```json\n{\"scores\": [{\"trajectory_id\": 3, \"explanation\": \"wrong\", \"score\": 0.0},\
             {\"trajectory_id\": \"1\", \"explanation\": \"right\", \"score\": 0.9},\
             {\"trajectory_id\": \"2\", \"explanation\": \"verbose\", \"score\": 0.6}]}\n```"
                .into(),
        )
    }));
    let rubric = Rubric::new(Parser::Plain).with(spec(
        &base,
        ", rubric = \"Prefer the shortest correct sum.\"",
    ));
    let group = [
        rollout("5"),
        rollout("It is 5."),
        rollout("7"),
        rollout("5"),
    ];
    let s = rt.block_on(rubric.score_group(&row(), &group));

    let judged: Vec<f64> = s.iter().map(|s| s.metrics["relative_judge"]).collect();
    assert_eq!(judged, [0.9, 0.6, 0.0, 0.9]);
    let rewards: Vec<f64> = s.iter().map(|s| s.reward).collect();
    assert_eq!(rewards, [1.8, 1.2, 0.0, 1.8]);
    assert!(s.iter().all(|s| s.error.is_none()));

    let seen = seen.lock().unwrap();
    assert_eq!(seen.len(), 1, "one call for the group");
    let body = &seen[0];
    assert_eq!(body["model"], "judge");
    let system = body["messages"][0]["content"].as_str().unwrap();
    assert!(
        system.contains("Prefer the shortest correct sum."),
        "{system}"
    );
    let user = body["messages"][1]["content"].as_str().unwrap();
    // The shared prompt once, then the three distinct answers.
    assert!(
        user.starts_with("<context>\n") && user.contains("What is 2 + 3?"),
        "{user}"
    );
    assert_eq!(trajectories(body), 3, "{user}");
    assert!(
        user.contains("<trajectory id=\"2\">\n[{\"role\":\"assistant\",\"content\":\"It is 5.\"}]"),
        "{user}"
    );
    let schema = &body["response_format"]["json_schema"]["schema"]["properties"]["scores"];
    assert_eq!(schema["minItems"], 3);
    assert_eq!(
        schema["items"]["properties"]["trajectory_id"]["enum"],
        json!(["1", "2", "3"])
    );
}

#[test]
fn bad_answers_and_a_failing_judge_are_counted_errors() {
    let cases: [(&str, (u16, &str)); 8] = [
        (
            "stopped at max_tokens (1024)",
            (200, "CUT:{\"scores\": [{\"trajectory_id\": \"1\", \"explanation\": \"the the the"),
        ),
        ("no JSON object", (200, "Trajectory 1 is best.")),
        ("no `scores` list", (200, "{\"best\": 1}")),
        ("scored 1 trajectories, not 2", (200, "{\"scores\": [{\"trajectory_id\": \"1\", \"score\": 1}]}")),
        ("outside [0, 1]", (200, "{\"scores\": [{\"trajectory_id\": \"1\", \"score\": 1.5}, {\"trajectory_id\": \"2\", \"score\": 0}]}")),
        ("scored twice", (200, "{\"scores\": [{\"trajectory_id\": \"1\", \"score\": 1}, {\"trajectory_id\": \"1\", \"score\": 0}]}")),
        ("no numeric score", (200, "{\"scores\": [{\"trajectory_id\": \"1\", \"score\": \"high\"}, {\"trajectory_id\": \"2\", \"score\": 0}]}")),
        ("judge call failed", (500, "the judge fell over")),
    ];
    for (why, (status, text)) in cases {
        let text = text.to_string();
        let (base, seen, rt) = judge_server(Arc::new(move |_: &Value| (status, text.clone())));
        // One retry, quickly, so the 500 case also shows the retry.
        let mut endpoint = temper_env::openai::OpenAiChatModel::new(&base, "judge", None).unwrap();
        endpoint.retry.max_retries = 1;
        endpoint.retry.base_delay = Duration::from_millis(1);
        let cfg: RelativeJudgeConfig =
            serde_json::from_value(json!({"base_url": base, "model": "judge"})).unwrap();
        let judge = RelativeJudge::on_endpoint(Arc::new(endpoint), cfg);
        let rubric = Rubric::new(Parser::Plain)
            .with(Reward::relative_judge(1.0, judge))
            .with(Reward::contains(0.5));
        let s = rt.block_on(rubric.score_group(&row(), &[rollout("5"), rollout("6")]));
        for (i, s) in s.iter().enumerate() {
            assert_eq!(s.metrics["relative_judge/error"], 1.0, "{why}: {s:?}");
            assert_eq!(s.metrics["relative_judge"], 0.0, "{why}");
            let err = s.error.as_deref().unwrap_or_default();
            assert!(
                err.starts_with("reward `relative_judge`: ") && err.contains(why),
                "{why}: {err}"
            );
            // The other functions of the rubric still score.
            assert_eq!(s.reward, if i == 0 { 0.5 } else { 0.0 }, "{why}");
        }
        let calls = seen.lock().unwrap().len();
        assert_eq!(calls, if status == 500 { 2 } else { 1 }, "{why}");
    }
}

#[test]
fn parse_scores_reads_ids_and_refuses_what_is_not_a_full_answer() {
    let ok = r#"Here: {"scores": [{"trajectory_id": "2", "score": 0.25}, {"trajectory_id": "1", "score": 1}]} done"#;
    assert_eq!(parse_scores(ok, 2).unwrap(), [1.0, 0.25]);
    assert!(parse_scores(ok, 3).unwrap_err().contains("not 3"));
    let missing_id = r#"{"scores": [{"score": 0.5}]}"#;
    assert!(parse_scores(missing_id, 1)
        .unwrap_err()
        .contains("trajectory_id"));
    let id_out_of_range = r#"{"scores": [{"trajectory_id": "2", "score": 0.5}]}"#;
    assert!(parse_scores(id_out_of_range, 1).is_err());
    assert!(parse_scores(r#"{"scores": [{"trajectory_id": "1", "score": -0.1}]}"#, 1).is_err());
}

#[test]
fn an_unknown_argument_is_refused_with_the_list_of_known_ones() {
    let spec: temper_env::rubric::RewardSpec = toml::from_str(
        "function = \"relative_judge\"\nargs = { base_url = \"http://127.0.0.1:1/v1\", model = \"m\", prompt = \"x\" }",
    )
    .unwrap();
    let err = Reward::from_spec(&spec).unwrap_err();
    assert!(
        err.contains("unknown field `prompt`") && err.contains("rubric"),
        "{err}"
    );
}

fn temper() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_temper"));
    c.arg("--threads").arg("1");
    c
}

/// An env.toml of arithmetic rows rewarded by the relative judge at `base`
/// (weight 1) with `numeric_match` as a metric (weight 0).
fn judge_env(dir: &Path, base: &str) -> PathBuf {
    let env = dir.join("env");
    std::fs::create_dir_all(&env).unwrap();
    std::fs::write(
        env.join("env.toml"),
        format!(
            "name = \"judged\"\n[dataset]\ngenerator = \"arithmetic\"\nargs = {{ digits = 1 }}\n\
             [[rubric]]\nfunction = \"relative_judge\"\nargs = {{ base_url = {base:?}, model = \"judge\", max_tokens = 64 }}\n\
             [[rubric]]\nfunction = \"numeric_match\"\nweight = 0.0\nname = \"correct\"\n"
        ),
    )
    .unwrap();
    env
}

#[test]
fn rl_and_eval_train_and_score_on_the_judges_group_scores() {
    let dir = tempfile::tempdir().unwrap();
    let (base, seen, _rt) = judge_server(Arc::new(ranked));
    let env = judge_env(dir.path(), &base);

    // RL on a tiny fixture model: 2 steps × 2 groups of 2 = 4 judge calls.
    let model = dir.path().join("model");
    temper_rl::preset::TinyPreset::smallest()
        .write(&model, 3)
        .unwrap();
    let run = dir.path().join("run");
    let cfg = dir.path().join("rl.toml");
    std::fs::write(
        &cfg,
        format!(
            "seed = 1\n[model]\npath = {:?}\n[lora]\nrank = 2\n[[env]]\nid = {:?}\n\
             [sampling]\nmax_tokens = 4\ngroup_size = 2\n[trainer]\nbatch_size = 2\nmax_steps = 2\n\
             [eval]\nnum_examples = 0\n[log]\ndir = {:?}\n",
            model.display().to_string(),
            env.display().to_string(),
            run.display().to_string()
        ),
    )
    .unwrap();
    let out = temper().args(["train", "rl"]).arg(&cfg).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    let steps: Vec<Value> = std::fs::read_to_string(run.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(steps.len(), 2);
    for m in &steps {
        assert_eq!(m["reward_errors"], 0, "{m}");
        // Each group's scores are i / (n + 1): mean ½ whatever n is.
        assert!(
            (m["reward/mean"].as_f64().unwrap() - 0.5).abs() < 1e-9,
            "{m}"
        );
    }
    {
        let seen = seen.lock().unwrap();
        assert_eq!(seen.len(), 4, "one judge call per group");
        assert!(seen.iter().all(|b| (1..=2).contains(&trajectories(b))));
    }

    // Eval: an example's rollouts are its group (3 of them, one call).
    seen.lock().unwrap().clear();
    let (mock, _mrt) = {
        let rt = tokio::runtime::Runtime::new().unwrap();
        let (addr, _) = rt
            .block_on(temper_eval::mock::spawn(Default::default()))
            .unwrap();
        (format!("http://{addr}/v1"), rt)
    };
    let save = dir.path().join("eval");
    let out = temper()
        .arg("eval")
        .arg(&env)
        .args([
            "-m",
            "mock",
            "-b",
            &mock,
            "-n",
            "2",
            "-r",
            "3",
            "--quiet",
            "--save-dir",
        ])
        .arg(&save)
        .output()
        .unwrap();
    let (stdout, err) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(out.status.success(), "{stdout}\n{err}");
    assert!(stdout.contains("reward errors 0"), "{stdout}");
    assert_eq!(seen.lock().unwrap().len(), 2, "one judge call per example");
}
