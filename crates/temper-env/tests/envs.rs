//! Built-in environments, env.toml manifests (JSONL, Parquet, generators,
//! tools) and the external Python environment.

mod common;

use std::collections::HashSet;
use std::path::PathBuf;
use std::sync::Arc;

use async_trait::async_trait;
use common::Scripted;
use serde_json::json;
use temper_env::{
    ChatModel, ChatRequest, EnvError, Loader, Message, ModelCallError, ModelTurn, Rollout, Split,
    Usage, BUILTIN_ENVS,
};

fn question(r: &temper_env::Row) -> String {
    r.prompt.last().unwrap().text()
}

#[test]
fn every_builtin_has_disjoint_deterministic_splits() {
    for name in BUILTIN_ENVS {
        let args = json!({});
        let env = Loader::new().load(name, &args).unwrap();
        assert_eq!(env.id(), *name);
        let eval = env.rows(Split::Eval, 30, 0).unwrap();
        let train = env.rows(Split::Train, 200, 0).unwrap();
        assert_eq!(eval.len(), 30);
        assert_eq!(train.len(), 200);
        assert_eq!(
            eval,
            env.rows(Split::Eval, 30, 0).unwrap(),
            "{name}: not deterministic"
        );
        assert_ne!(
            train.iter().map(question).collect::<Vec<_>>(),
            env.rows(Split::Train, 200, 1)
                .unwrap()
                .iter()
                .map(question)
                .collect::<Vec<_>>(),
            "{name}: the seed changes nothing"
        );
        let eval_q: HashSet<String> = eval
            .iter()
            .map(|r| serde_json::to_string(&(question(r), &r.answer)).unwrap())
            .collect();
        for r in &train {
            let key = serde_json::to_string(&(question(r), &r.answer)).unwrap();
            assert!(!eval_q.contains(&key), "{name}: {key} in both splits");
        }
        let ids: Vec<u64> = eval.iter().map(|r| r.example_id).collect();
        assert_eq!(ids, (0..30).collect::<Vec<_>>());
    }
}

#[test]
fn arithmetic_args_as_the_trainer_uses_them() {
    let env = Loader::new()
        .load(
            "arithmetic",
            &json!({"digits": 2, "ops": ["+"], "system_prompt": ""}),
        )
        .unwrap();
    let rows = env.rows(Split::Train, 50, 7).unwrap();
    let re = regex::Regex::new(r"^What is (\d{2}) \+ (\d{2})\?$").unwrap();
    for r in &rows {
        assert_eq!(r.prompt.len(), 1, "no system message");
        let q = question(r);
        let caps = re.captures(&q).unwrap_or_else(|| panic!("{q}"));
        let sum: i64 = caps[1].parse::<i64>().unwrap() + caps[2].parse::<i64>().unwrap();
        assert_eq!(r.answer.as_deref(), Some(sum.to_string().as_str()));
    }
    let d = Loader::new()
        .load("arithmetic", &json!({}))
        .unwrap()
        .rows(Split::Eval, 5, 0)
        .unwrap();
    assert_eq!(d[0].prompt[0].role, "system");
    assert!(d[0].prompt[0].text().contains("<answer>"));
    for bad in [
        json!({"digits": 0}),
        json!({"ops": ["/"]}),
        json!({"ops": []}),
        json!({"digit": 2}),
    ] {
        assert!(
            matches!(
                Loader::new().load("arithmetic", &bad),
                Err(EnvError::BadArgs { .. })
            ),
            "{bad}"
        );
    }
    assert!(matches!(
        Loader::new().load("no-such-env", &json!({})),
        Err(EnvError::Unknown(_))
    ));
}

#[tokio::test]
async fn arithmetic_rewards_the_right_number_only() {
    let env = Loader::new()
        .load("arithmetic", &json!({"digits": 3}))
        .unwrap();
    let row = env.rows(Split::Eval, 1, 0).unwrap().remove(0);
    let a = row.answer.clone().unwrap();
    let wrong: i64 = a.parse::<i64>().unwrap() + 1;
    let ro = |t: &str| Rollout {
        completion: vec![Message::assistant(t)],
        ..Rollout::default()
    };
    let s = env
        .score_group(
            &row,
            &[
                ro(&format!("<answer>{a}</answer>")),
                ro(&format!("<answer>{wrong}</answer>")),
                ro(&a),
            ],
        )
        .await;
    assert_eq!((s[0].reward, s[0].metrics["format"]), (1.0, 1.0));
    assert_eq!(s[1].reward, 0.0);
    assert_eq!((s[2].reward, s[2].metrics["format"]), (0.0, 0.0));
}

#[tokio::test]
async fn countdown_alphabet_and_reverse_rewards() {
    assert!(temper_env::countdown_valid("(3 + 5) * 2", &[2, 3, 5], 16));
    assert!(!temper_env::countdown_valid("3 * 5 + 1", &[2, 3, 5], 16));
    assert!(!temper_env::countdown_valid(
        "(3 + 5) * 2 * 1",
        &[2, 3, 5],
        16
    ));
    assert!(!temper_env::countdown_valid("__import__('os')", &[2], 2));
    let ro = |t: String| Rollout {
        completion: vec![Message::assistant(t)],
        ..Rollout::default()
    };

    let env = Loader::new()
        .load("countdown", &json!({"numbers": 3}))
        .unwrap();
    let row = env.rows(Split::Eval, 1, 0).unwrap().remove(0);
    assert_eq!(row.info["numbers"].as_array().unwrap().len(), 3);
    let s = env
        .score_group(&row, &[ro("<answer>1</answer>".into())])
        .await;
    assert_eq!(s[0].reward, 0.0);

    let env = Loader::new()
        .load("alphabet-sort", &json!({"words": 4}))
        .unwrap();
    let row = env.rows(Split::Eval, 1, 0).unwrap().remove(0);
    let sorted = row.answer.clone().unwrap();
    let q = question(&row);
    let s = env
        .score_group(
            &row,
            &[
                ro(format!("<answer>{sorted}</answer>")),
                ro(format!("<answer>{q}</answer>")),
            ],
        )
        .await;
    assert_eq!(s[0].reward, 1.0);
    assert_eq!(s[1].reward, if q == sorted { 1.0 } else { 0.0 });

    let env = Loader::new()
        .load("reverse-text", &json!({"words": 3}))
        .unwrap();
    let row = env.rows(Split::Eval, 1, 0).unwrap().remove(0);
    let text = question(&row);
    let rev: String = text.chars().rev().collect();
    let s = env
        .score_group(
            &row,
            &[
                ro(format!("<answer>{rev}</answer>")),
                ro(format!("<answer>{text}</answer>")),
            ],
        )
        .await;
    assert_eq!(s[0].reward, 1.0);
    assert_eq!(s[0].metrics["exact_match"], 1.0);
    assert!(s[1].reward < 1.0);
}

fn write(dir: &std::path::Path, name: &str, text: &str) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    p
}

#[tokio::test]
async fn manifest_with_jsonl_few_shot_and_rubric() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "data.jsonl", &(0..40).map(|i| json!({"question": format!("Double {i}?"), "answer": (2 * i).to_string(), "level": i % 3}).to_string() + "\n").collect::<String>());
    write(
        dir.path(),
        "env.toml",
        r#"
name = "double"
system_prompt = "Answer in <answer></answer> tags."
[dataset]
train = "data.jsonl"
[[few_shot]]
question = "Double 100?"
answer = "<answer>200</answer>"
[parser]
type = "xml"
fields = ["answer"]
answer_field = "answer"
[[rubric]]
function = "math_equiv"
name = "correct"
[[rubric]]
function = "format"
weight = 0.0
[eval]
num_examples = 3
max_tokens = 16
"#,
    );
    let env = Loader::new()
        .load(dir.path().to_str().unwrap(), &json!({}))
        .unwrap();
    assert_eq!(env.id(), "double");
    let d = env.eval_defaults();
    assert_eq!((d.num_examples, d.sampling.max_tokens), (3, 16));
    let eval = env.rows(Split::Eval, 100, 0).unwrap();
    let train = env.rows(Split::Train, 100, 0).unwrap();
    assert!(
        !eval.is_empty() && eval.len() < 40,
        "one file is split by hash: {} eval rows",
        eval.len()
    );
    let eval_q: HashSet<String> = eval.iter().map(question).collect();
    assert!(train.iter().all(|r| !eval_q.contains(&question(r))));
    let r = &eval[0];
    let roles: Vec<&str> = r.prompt.iter().map(|m| m.role.as_str()).collect();
    assert_eq!(roles, ["system", "user", "assistant", "user"]);
    assert!(r.info.get("level").is_some(), "extra fields land in info");
    let ro = Rollout {
        completion: vec![Message::assistant(format!(
            "<answer>{}</answer>",
            r.answer.clone().unwrap()
        ))],
        ..Rollout::default()
    };
    let s = env.score_group(r, &[ro]).await;
    assert_eq!(s[0].reward, 1.0);
}

#[test]
fn manifest_errors_name_the_problem() {
    let dir = tempfile::tempdir().unwrap();
    let cases = [
        ("name = \"x\"\n[dataset]\ntrain = \"missing.jsonl\"\n[[rubric]]\nfunction = \"format\"\n", "missing.jsonl"),
        ("name = \"x\"\n[dataset]\ngenerator = \"arithmetic\"\n[[rubric]]\nfunction = \"teleport\"\n", "unknown reward function"),
        ("name = \"x\"\n[dataset]\ngenerator = \"arithmetic\"\n", "rubric"),
        ("name = \"x\"\nbogus = 1\n", "bogus"),
        ("name = \"x\"\n[dataset]\ngenerator = \"arithmetic\"\n[harness]\ntype = \"tools\"\ntools = [\"laser\"]\n[[rubric]]\nfunction = \"format\"\n", "laser"),
    ];
    for (text, needle) in cases {
        write(dir.path(), "env.toml", text);
        let err = match Loader::new().load(dir.path().to_str().unwrap(), &json!({})) {
            Ok(_) => panic!("{text} loaded"),
            Err(e) => e.to_string(),
        };
        assert!(err.contains(needle), "{err} should mention {needle}");
    }
}

#[tokio::test]
async fn manifest_over_a_generator_with_tools_harness() {
    let dir = tempfile::tempdir().unwrap();
    write(
        dir.path(),
        "env.toml",
        r#"
name = "tool-math"
system_prompt = "Use tools."
[dataset]
generator = "arithmetic"
args = { digits = 2, ops = ["*"] }
[harness]
type = "tools"
tools = ["calculator"]
max_turns = 3
[[rubric]]
function = "numeric_match"
"#,
    );
    let env = Loader::new()
        .load(
            dir.path().join("env.toml").to_str().unwrap(),
            &json!({"digits": 3}),
        )
        .unwrap();
    let row = env.rows(Split::Eval, 1, 0).unwrap().remove(0);
    assert_eq!(row.prompt[0].text(), "Use tools.");
    assert!(
        regex::Regex::new(r"^What is \d{3} \* \d{3}\?$")
            .unwrap()
            .is_match(&question(&row)),
        "args override: {}",
        question(&row)
    );
    let expr = question(&row)
        .trim_start_matches("What is ")
        .trim_end_matches('?')
        .to_string();
    let model = Scripted::new(vec![
        Ok(common::call_tools(&[(
            "calculate",
            &json!({"expression": expr}).to_string(),
        )])),
        Ok(common::say(&format!(
            "<answer>{}</answer>",
            row.answer.clone().unwrap()
        ))),
    ]);
    let ro = env.rollout(&model, &row, &Default::default()).await;
    let s = env.score_group(&row, &[ro]).await;
    assert_eq!(s[0].reward, 1.0);
}

#[tokio::test]
async fn parquet_datasets_load_like_jsonl() {
    use parquet::data_type::{ByteArray, ByteArrayType};
    use parquet::file::properties::WriterProperties;
    use parquet::file::writer::SerializedFileWriter;
    use parquet::schema::parser::parse_message_type;

    let dir = tempfile::tempdir().unwrap();
    let schema = Arc::new(parse_message_type("message rows { REQUIRED BYTE_ARRAY question (UTF8); REQUIRED BYTE_ARRAY answer (UTF8); }").unwrap());
    let file = std::fs::File::create(dir.path().join("eval.parquet")).unwrap();
    let mut w =
        SerializedFileWriter::new(file, schema, Arc::new(WriterProperties::builder().build()))
            .unwrap();
    let mut rg = w.next_row_group().unwrap();
    for col in [["2 + 2?", "3 + 3?"], ["4", "6"]] {
        let mut c = rg.next_column().unwrap().unwrap();
        let vals: Vec<ByteArray> = col.iter().map(|s| ByteArray::from(*s)).collect();
        c.typed::<ByteArrayType>()
            .write_batch(&vals, None, None)
            .unwrap();
        c.close().unwrap();
    }
    rg.close().unwrap();
    w.close().unwrap();
    write(dir.path(), "env.toml", "name = \"pq\"\n[dataset]\neval = \"eval.parquet\"\ntrain = \"eval.parquet\"\n[[rubric]]\nfunction = \"exact_match\"\n");
    let env = Loader::new()
        .load(dir.path().to_str().unwrap(), &json!({}))
        .unwrap();
    let rows = env.rows(Split::Eval, 10, 0).unwrap();
    assert_eq!(rows.len(), 2);
    assert_eq!(question(&rows[1]), "3 + 3?");
    assert_eq!(rows[1].answer.as_deref(), Some("6"));
}

/// Plays guess-the-number by bisection, reading the feedback in the
/// conversation.
struct Bisect;

#[async_trait]
impl ChatModel for Bisect {
    async fn chat(&self, req: ChatRequest) -> Result<ModelTurn, ModelCallError> {
        let hi_text = req.messages[0].text();
        let mut hi: i64 = hi_text
            .split("and ")
            .nth(1)
            .and_then(|s| s.split('.').next())
            .and_then(|s| s.parse().ok())
            .unwrap_or(100);
        let mut lo = 1i64;
        let mut last = None;
        for m in &req.messages {
            match (m.role.as_str(), m.text().as_str()) {
                ("assistant", t) => {
                    last = t
                        .trim_start_matches("<guess>")
                        .trim_end_matches("</guess>")
                        .parse::<i64>()
                        .ok()
                }
                ("user", "higher") => lo = last.map_or(lo, |g| g + 1),
                ("user", "lower") => hi = last.map_or(hi, |g| g - 1),
                _ => {}
            }
        }
        Ok(ModelTurn {
            message: Message::assistant(format!("<guess>{}</guess>", (lo + hi) / 2)),
            finish_reason: "stop".into(),
            usage: Usage::default(),
            trace: None,
        })
    }
}

fn example_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../examples/envs/guess-number")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_external_environment_plays_multi_turn() {
    let env = Loader::new()
        .load(example_dir().to_str().unwrap(), &json!({"hi": 64}))
        .unwrap();
    assert_eq!(env.id(), "guess-number");
    assert_eq!(env.eval_defaults().num_examples, 10);
    let eval = env.rows(Split::Eval, 6, 0).unwrap();
    let train = env.rows(Split::Train, 6, 0).unwrap();
    assert!(eval
        .iter()
        .all(|r| r.answer.as_deref().unwrap().parse::<i64>().unwrap() % 2 == 1));
    assert!(train
        .iter()
        .all(|r| r.answer.as_deref().unwrap().parse::<i64>().unwrap() % 2 == 0));
    // Concurrent rollouts share the one process.
    let sampling = temper_env::SamplingArgs::default();
    let rollouts =
        futures::future::join_all(eval.iter().map(|r| env.rollout(&Bisect, r, &sampling))).await;
    for (row, ro) in eval.iter().zip(&rollouts) {
        assert_eq!(
            ro.stop_condition.as_deref(),
            Some("has_final_env_response"),
            "{ro:?}"
        );
        assert_eq!(ro.completion.last().unwrap().text(), "correct");
        let s = env.score_group(row, std::slice::from_ref(ro)).await;
        assert_eq!(s[0].metrics["solved"], 1.0);
        assert!(s[0].reward > 0.5, "bisection finds 1..64 in ≤ 7 guesses");
        assert_eq!(
            s[0].metrics["guesses"],
            ro.completion
                .iter()
                .filter(|m| m.role == "assistant")
                .count() as f64
        );
    }
    // A rollout that never answers right is scored 0 by the Python side.
    let lazy = Scripted::texts(&["<guess>0</guess>"; 10]);
    let ro = env.rollout(&lazy, &eval[0], &Default::default()).await;
    assert_eq!(ro.stop_condition.as_deref(), Some("max_turns_reached"));
    assert_eq!(env.score_group(&eval[0], &[ro]).await[0].reward, 0.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_errors_become_rollout_errors() {
    let dir = tempfile::tempdir().unwrap();
    let helper = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../python");
    write(
        dir.path(),
        "env.py",
        &format!(
            r#"
import sys
sys.path.insert(0, {helper:?})
from temper_env import Environment, serve
class Broken(Environment):
    env_id = "broken"
    multi_turn = True
    def rows(self, split, n, seed):
        return [{{"question": "hi"}}] * n
    def env_response(self, row, messages, state):
        raise RuntimeError("kaboom")
serve(Broken())
"#
        ),
    );
    let cmd = format!("python3 {}", dir.path().join("env.py").display());
    let env = Loader::new().load(&cmd, &json!({})).unwrap();
    let row = env.rows(Split::Eval, 1, 0).unwrap().remove(0);
    let ro = env
        .rollout(&Scripted::texts(&["x"]), &row, &Default::default())
        .await;
    assert_eq!(ro.stop_condition.as_deref(), Some("has_error"));
    assert!(ro.error.as_deref().unwrap().contains("kaboom"));
    // score is not implemented: every rollout scores 0, the run goes on.
    assert_eq!(env.score_group(&row, &[ro]).await[0].reward, 0.0);
}

/// Issue 15: the example env with a built-in `json_fields` reward and a
/// Python reward program, normalised to [0, 1], scores a right and a wrong
/// answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn support_json_example_scores_with_json_fields_and_a_python_reward() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../examples/envs/support-json");
    let env = Loader::new()
        .load(dir.to_str().unwrap(), &json!({}))
        .unwrap();
    let row = env.rows(Split::Eval, 1, 0).unwrap().remove(0);
    assert!(row.prompt.last().unwrap().text().contains("#C7781"));
    let right = Scripted::texts(&[
        r#"<answer>{"intent": "Refund", "order_id": "C7781", "urgent": false}</answer>"#,
    ]);
    let invented = Scripted::texts(&[
        r#"<answer>{"intent": "shipping", "order_id": "X1", "urgent": false}</answer>"#,
    ]);
    let sampling = temper_env::SamplingArgs::default();
    let a = env.rollout(&right, &row, &sampling).await;
    let b = env.rollout(&invented, &row, &sampling).await;
    let s = env.score_group(&row, &[a, b]).await;
    assert_eq!(s[0].metrics["fields"], 1.0);
    assert_eq!(s[0].metrics["grounded"], 1.0);
    assert_eq!(s[0].metrics["grounded/has_id"], 1.0);
    assert_eq!(s[0].reward, 1.0, "(2·1 + 1·1) / 3");
    // intent wrong (2 of 4 weight), order id wrong (1 of 4), urgent right.
    assert_eq!(s[1].metrics["fields"], 0.25);
    assert_eq!(s[1].metrics["grounded"], 0.0);
    assert!((s[1].reward - 0.5 / 3.0).abs() < 1e-12, "{}", s[1].reward);
}

/// A policy: answers with the sum asked for, and the tokens it "sampled".
struct TokenPolicy;

#[async_trait]
impl ChatModel for TokenPolicy {
    async fn chat(&self, req: ChatRequest) -> Result<ModelTurn, ModelCallError> {
        let n = req.messages.len() as u32;
        Ok(ModelTurn {
            message: Message::assistant(format!("turn {n} at t={}", req.sampling.temperature)),
            finish_reason: "stop".into(),
            usage: Usage {
                prompt_tokens: 10 * u64::from(n),
                completion_tokens: 2,
            },
            trace: Some(temper_env::TokenTrace {
                prompt_ids: (0..10 * n).collect(),
                completion_ids: vec![100 + n, 7],
                logprobs: vec![-0.5, -0.25],
                version: 3,
                temperature: req.sampling.temperature,
            }),
        })
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_process_that_plays_rollouts_calls_the_model_through_the_gate() {
    // The shape of the verifiers bridge, stdlib only: `info` says it plays
    // rollouts; `rollout` calls the OpenAI endpoint it is given twice (once
    // streamed) and returns the conversation and its own score.
    let dir = tempfile::tempdir().unwrap();
    let script = write(
        dir.path(),
        "plays.py",
        r#"
import json, sys, urllib.request
def post(url, body):
    req = urllib.request.Request(url + "/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return r.read().decode()
for line in sys.stdin:
    req = json.loads(line); p = req["params"]; m = req["method"]
    if m == "info":
        out = {"env_id": "plays", "rollout": True}
    elif m == "rows":
        out = [{"question": f"q{i}", "info": {"i": i}} for i in range(p["n"])]
    elif m == "rollout":
        msgs = list(p["row"]["prompt"])
        first = json.loads(post(p["base_url"], {"model": p["model"], "messages": msgs, "temperature": 0.1}))
        msgs.append(first["choices"][0]["message"]); msgs.append({"role": "user", "content": "again"})
        events = post(p["base_url"], {"model": p["model"], "messages": msgs, "stream": True})
        text = "".join(json.loads(e[6:])["choices"][0]["delta"].get("content") or ""
                       for e in events.split("\n\n") if e.startswith("data: {") and json.loads(e[6:])["choices"])
        msgs.append({"role": "assistant", "content": text})
        out = {"completion": msgs[1:], "stop_condition": "done", "state": {"score": len(msgs)}}
    elif m == "score":
        out = [{"reward": r["state"]["score"] / 10, "metrics": {}} for r in p["rollouts"]]
    print(json.dumps({"id": req["id"], "result": out}), flush=True)
"#,
    );
    let env = Loader::new()
        .load(&format!("python3 {}", script.display()), &json!({}))
        .unwrap();
    let rows = env.rows(Split::Eval, 2, 0).unwrap();
    let sampling = temper_env::SamplingArgs {
        temperature: 0.7,
        ..Default::default()
    };
    let rollouts =
        futures::future::join_all(rows.iter().map(|r| env.rollout(&TokenPolicy, r, &sampling)))
            .await;
    for (row, ro) in rows.iter().zip(&rollouts) {
        assert_eq!(ro.error, None, "{ro:?}");
        assert_eq!(ro.stop_condition.as_deref(), Some("done"));
        // The program's own temperature is replaced by the rollout's.
        let texts: Vec<String> = ro.completion.iter().map(Message::text).collect();
        assert_eq!(texts, ["turn 1 at t=0.7", "again", "turn 3 at t=0.7"]);
        // The model turns are the calls, with the policy's tokens untouched.
        assert_eq!(ro.model_turns.len(), 2);
        let traces: Vec<_> = ro
            .model_turns
            .iter()
            .map(|t| t.trace.clone().unwrap())
            .collect();
        assert_eq!(traces[0].completion_ids, vec![101, 7]);
        assert_eq!(traces[1].completion_ids, vec![103, 7]);
        assert_eq!(traces[1].prompt_ids.len(), 30);
        assert_eq!(traces[1].logprobs, vec![-0.5, -0.25]);
        assert_eq!(ro.token_usage.input_tokens, 40);
        assert_eq!(ro.token_usage.output_tokens, 4);
        let s = env.score_group(row, std::slice::from_ref(ro)).await;
        assert_eq!(s[0].reward, 0.4);
    }
}

#[test]
fn verifiers_specs_are_checked_before_any_python_runs() {
    for (spec, args, want) in [
        ("verifiers:", json!({}), "name the taskset"),
        ("verifiers:x", json!([1]), "args must be a table"),
        (
            "verifiers:x",
            json!({"python": 3}),
            "`python` must be a path",
        ),
        (
            "verifiers:x",
            json!({"python": "/no/such/python"}),
            "cannot start `/no/such/python`",
        ),
    ] {
        let e = Loader::new()
            .load(spec, &args)
            .err()
            .expect("refused")
            .to_string();
        assert!(e.contains(want), "{spec} {args}: {e}");
    }
}
