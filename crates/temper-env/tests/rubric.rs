//! Reward functions as tables of cases, group functions, the judge and the
//! code-tests reward against the real sandbox service.

mod common;

use std::sync::Arc;

use common::{sandbox_service, write_reward_py, Scripted};
use serde_json::{json, Value};
use temper_env::rubric::{CodeTests, CodeTestsConfig, Judge};
use temper_env::{GroupReward, Message, Parser, Reward, RewardCtx, Rollout, Row, Rubric};

fn rollout(text: &str) -> Rollout {
    Rollout {
        completion: vec![Message::assistant(text)],
        is_completed: true,
        ..Rollout::default()
    }
}

fn row(answer: Option<&str>, info: Value) -> Row {
    Row {
        example_id: 0,
        prompt: vec![Message::user("q?")],
        answer: answer.map(str::to_string),
        info,
    }
}

async fn score(r: Reward, parser: Parser, text: &str, answer: Option<&str>, info: Value) -> f64 {
    let name = r.name().to_string();
    let rubric = Rubric::new(parser).with(r);
    let s = rubric
        .score_group(&row(answer, info), &[rollout(text)])
        .await;
    s[0].metrics[&name]
}

#[tokio::test]
async fn reward_function_table() {
    let tag = Parser::answer_tag;
    let schema =
        json!({"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]});
    let fifty = "x".repeat(50);
    /// (reward, parser, completion text, reference answer, info, expected score)
    type Case<'a> = (Reward, Parser, &'a str, Option<&'a str>, Value, f64);
    let cases: Vec<Case<'_>> = vec![
        (
            Reward::exact_match(1.0, false),
            tag(),
            "<answer>Paris</answer>",
            Some("paris"),
            json!({}),
            1.0,
        ),
        (
            Reward::exact_match(1.0, true),
            tag(),
            "<answer>Paris</answer>",
            Some("paris"),
            json!({}),
            0.0,
        ),
        (
            Reward::exact_match(1.0, false),
            tag(),
            "Paris",
            Some("Paris"),
            json!({}),
            0.0,
        ),
        (
            Reward::exact_match(1.0, false),
            Parser::Plain,
            " Paris ",
            Some("Paris"),
            json!({}),
            1.0,
        ),
        (
            Reward::contains(1.0),
            tag(),
            "it is PARIS I think",
            Some("Paris"),
            json!({}),
            1.0,
        ),
        (
            Reward::contains(1.0),
            tag(),
            "it is Lyon",
            Some("Paris"),
            json!({}),
            0.0,
        ),
        (
            Reward::contains(1.0),
            tag(),
            "anything",
            Some(""),
            json!({}),
            0.0,
        ),
        (
            Reward::regex(1.0, r"^\d{3}-\d{4}$").unwrap(),
            tag(),
            "<answer>555-1234</answer>",
            None,
            json!({}),
            1.0,
        ),
        (
            Reward::regex(1.0, r"^\d{3}-\d{4}$").unwrap(),
            tag(),
            "<answer>5551234</answer>",
            None,
            json!({}),
            0.0,
        ),
        (
            Reward::math_equiv(1.0),
            Parser::Boxed,
            r"so \boxed{\frac{1}{2}}",
            Some("0.5"),
            json!({}),
            1.0,
        ),
        (
            Reward::math_equiv(1.0),
            Parser::Boxed,
            r"\boxed{0.25}",
            Some("1/2"),
            json!({}),
            0.0,
        ),
        (
            Reward::math_equiv(1.0),
            Parser::LastNumber,
            "first 3 then 7",
            Some("7"),
            json!({}),
            1.0,
        ),
        (
            Reward::numeric_match(1.0),
            tag(),
            "<answer>1,234</answer>",
            Some("1234"),
            json!({}),
            1.0,
        ),
        (
            Reward::numeric_match(1.0),
            tag(),
            "<answer>1000 + 234</answer>",
            Some("1234"),
            json!({}),
            0.0,
        ),
        (
            Reward::lcs(1.0),
            tag(),
            "<answer>abcd</answer>",
            Some("abcd"),
            json!({}),
            1.0,
        ),
        (
            Reward::lcs(1.0),
            tag(),
            "<answer>abcd</answer>",
            Some("abxx"),
            json!({}),
            0.5,
        ),
        (
            Reward::lcs(1.0),
            tag(),
            "<answer>zzzz</answer>",
            Some("abcd"),
            json!({}),
            0.0,
        ),
        (
            Reward::json_valid(1.0),
            tag(),
            r#"<answer>{"n": 1}</answer>"#,
            None,
            json!({}),
            1.0,
        ),
        (
            Reward::json_valid(1.0),
            tag(),
            r#"<answer>{"n": 1</answer>"#,
            None,
            json!({}),
            0.0,
        ),
        (
            Reward::json_schema(1.0, Some(schema.clone())).unwrap(),
            tag(),
            r#"<answer>{"n": 1}</answer>"#,
            None,
            json!({}),
            1.0,
        ),
        (
            Reward::json_schema(1.0, Some(schema.clone())).unwrap(),
            tag(),
            r#"<answer>{"n": "x"}</answer>"#,
            None,
            json!({}),
            0.0,
        ),
        (
            Reward::json_schema(1.0, None).unwrap(),
            tag(),
            r#"<answer>{"n": 2}</answer>"#,
            None,
            json!({"schema": schema}),
            1.0,
        ),
        (
            Reward::json_schema(1.0, None).unwrap(),
            tag(),
            r#"<answer>[]</answer>"#,
            None,
            json!({"schema": {"type": "object"}}),
            0.0,
        ),
        (
            Reward::json_schema(1.0, None).unwrap(),
            tag(),
            r#"<answer>{}</answer>"#,
            None,
            json!({}),
            0.0,
        ),
        (
            Reward::length_penalty(1.0, 10),
            tag(),
            "short",
            None,
            json!({}),
            0.0,
        ),
        (
            Reward::length_penalty(1.0, 10),
            tag(),
            "fifteen chars!!",
            None,
            json!({}),
            -0.5,
        ),
        (
            Reward::length_penalty(1.0, 10),
            tag(),
            &fifty,
            None,
            json!({}),
            -1.0,
        ),
        (
            Reward::format(1.0),
            tag(),
            "<answer>1</answer>",
            None,
            json!({}),
            1.0,
        ),
        (Reward::format(1.0), tag(), "1", None, json!({}), 0.0),
    ];
    for (i, (r, p, text, answer, info, want)) in cases.into_iter().enumerate() {
        let name = r.name().to_string();
        let got = score(r, p, text, answer, info).await;
        assert!(
            (got - want).abs() < 1e-9,
            "case {i} ({name}) on {text:?}: {got} != {want}"
        );
    }
    assert!(Reward::regex(1.0, "(").is_err());
    assert!(Reward::json_schema(1.0, Some(json!({"type": 5}))).is_err());
}

#[tokio::test]
async fn reward_is_the_weighted_sum_and_zero_weight_is_a_metric() {
    let rubric = Rubric::new(Parser::answer_tag())
        .with(Reward::exact_match(2.0, false).named("correct"))
        .with(Reward::format(0.5))
        .with(Reward::lcs(0.0));
    let s = rubric
        .score_group(
            &row(Some("ab"), json!({})),
            &[
                rollout("<answer>ab</answer>"),
                rollout("x <answer>zz</answer>"),
            ],
        )
        .await;
    assert_eq!(s[0].reward, 2.0 + 0.5);
    assert_eq!(s[0].metrics["lcs_ratio"], 1.0);
    assert!((s[1].reward - 0.5 * 0.8).abs() < 1e-12);
    assert_eq!(s[1].metrics["correct"], 0.0);
}

#[tokio::test]
async fn group_functions_see_every_rollout_of_a_prompt() {
    // 1 for the shortest correct completion of the group.
    let shortest = GroupReward::new("shortest_correct", 1.0, |ctxs: &[RewardCtx<'_>]| {
        let lens: Vec<Option<usize>> = ctxs
            .iter()
            .map(|c| (c.parsed().as_deref() == c.answer).then(|| c.completion[0].text().len()))
            .collect();
        let best = lens.iter().flatten().min().copied();
        lens.iter()
            .map(|l| f64::from(u8::from(l.is_some() && *l == best)))
            .collect()
    });
    let rubric = Rubric::new(Parser::answer_tag()).with_group(shortest);
    let s = rubric
        .score_group(
            &row(Some("7"), json!({})),
            &[
                rollout("long text <answer>7</answer>"),
                rollout("<answer>7</answer>"),
                rollout("<answer>8</answer>"),
            ],
        )
        .await;
    let rewards: Vec<f64> = s.iter().map(|s| s.reward).collect();
    assert_eq!(rewards, [0.0, 1.0, 0.0]);
}

#[tokio::test]
async fn judge_asks_once_per_distinct_prompt_and_reads_yes() {
    let model = Arc::new(Scripted::texts(&["Yes, correct.", "no"]));
    let judge = Judge::new(
        model.clone(),
        "Q: {question}\nRef: {answer}\nGot: {response}\nCorrect?",
    );
    let rubric = Rubric::new(Parser::answer_tag()).with(Reward::judge(1.0, judge));
    let r = row(Some("Paris"), json!({}));
    let s = rubric
        .score_group(&r, &[rollout("<answer>Paris</answer>")])
        .await;
    assert_eq!(s[0].reward, 1.0);
    // Same prompt again: cached, no second call.
    let s = rubric
        .score_group(&r, &[rollout("<answer>Paris</answer>")])
        .await;
    assert_eq!(s[0].reward, 1.0);
    assert_eq!(model.requests().len(), 1);
    let prompt = model.requests()[0].messages[0].text();
    assert_eq!(prompt, "Q: q?\nRef: Paris\nGot: Paris\nCorrect?");
    let s = rubric
        .score_group(&r, &[rollout("<answer>Lyon</answer>")])
        .await;
    assert_eq!(s[0].reward, 0.0);
    assert_eq!(model.requests().len(), 2);
}

#[test]
fn code_block_extraction() {
    let cases = [
        (
            "```python\ndef f():\n    return 1\n```",
            "def f():\n    return 1\n",
        ),
        ("text\n```\nx = 1\n```\nmore\n```py\ny = 2\n```", "y = 2\n"),
        ("def g(): pass", "def g(): pass"),
        // A bare function body keeps its indentation (HumanEval's answers).
        ("    return 1\n", "    return 1"),
        ("\n\n    x = 1\n    return x\n\n", "    x = 1\n    return x"),
        ("```python\nunclosed", "```python\nunclosed"),
    ];
    for (text, want) in cases {
        assert_eq!(temper_env::rubric::extract_code(text), want, "{text:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn code_tests_run_in_the_sandbox_service() {
    let Some(url) = sandbox_service(false).await else {
        return;
    };
    let tests = CodeTests::new(CodeTestsConfig {
        sandbox_url: Some(url.clone()),
        timeout_s: 5.0,
    })
    .unwrap();
    let asserts: Vec<String> = vec![
        "assert add(1, 2) == 3".into(),
        "assert add(-1, 1) == 0".into(),
        "assert add(2, 2) == 5".into(),
    ];
    let rate = tests
        .pass_rate("def add(a, b):\n    return a + b", &asserts)
        .await
        .unwrap();
    assert!((rate - 2.0 / 3.0).abs() < 1e-9, "{rate}");
    assert_eq!(
        tests
            .pass_rate("def add(a, b): while True: pass", &asserts)
            .await
            .unwrap(),
        0.0
    );

    // The code-python environment end to end: a right and a wrong answer.
    let env = temper_env::Loader::new()
        .load("code-python", &json!({"sandbox_url": url}))
        .unwrap();
    let row = env
        .rows(temper_env::Split::Eval, 8, 0)
        .unwrap()
        .into_iter()
        .find(|r| r.prompt.last().unwrap().text().contains("add_k"))
        .expect("an add_k task");
    let k: i64 = row.info["tests"][0]
        .as_str()
        .unwrap()
        .rsplit("== ")
        .next()
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    let good = rollout(&format!(
        "```python\ndef add_k(x):\n    return x + {k}\n```"
    ));
    let bad = rollout("```python\ndef add_k(x):\n    return x\n```");
    let s = env.score_group(&row, &[good, bad]).await;
    assert_eq!(s[0].reward, 1.0);
    assert_eq!(s[1].reward, 0.0);
}

#[tokio::test]
async fn code_tests_score_zero_when_the_sandbox_is_unreachable() {
    let tests = CodeTests::new(CodeTestsConfig {
        sandbox_url: Some("http://127.0.0.1:9".into()),
        timeout_s: 1.0,
    })
    .unwrap();
    assert!(tests
        .pass_rate("x = 1", &["assert x == 1".into()])
        .await
        .is_err());
    let rubric = Rubric::new(Parser::Plain).with(Reward::code_tests(1.0, tests));
    let s = rubric
        .score_group(
            &row(None, json!({"tests": ["assert True"]})),
            &[rollout("x = 1")],
        )
        .await;
    assert_eq!(s[0].reward, 0.0);
}

/// HumanEval, validated (issue 16): through the committed
/// `examples/envs/humaneval/env.toml` and the sandbox service, every
/// problem's canonical solution scores 1 (as the bare body a completion
/// model writes, and as the fenced whole function a chat model writes) and
/// an empty body (`pass`) scores 0, on all 164. Needs the data:
/// `TEMPER_HUMANEVAL=$(scripts/fetch_humaneval.sh)` (`.ci/run` sets it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn humaneval_canonical_solutions_pass_and_empty_bodies_fail() {
    use futures::StreamExt;
    let Ok(dir) = std::env::var("TEMPER_HUMANEVAL") else {
        eprintln!("SKIPPED: set TEMPER_HUMANEVAL=$(scripts/fetch_humaneval.sh)");
        return;
    };
    let Some(url) = sandbox_service(true).await else {
        return;
    };
    let dir = std::path::Path::new(&dir);
    let data = dir.join("humaneval.jsonl");
    assert!(data.is_file(), "{} missing", data.display());
    // The committed manifest, pointed at the test's sandbox service and at
    // the fetched data; nothing else changed.
    let manifest = std::fs::read_to_string(dir.join("env.toml")).unwrap();
    let args = "args = { timeout_s = 10.0 }";
    assert!(
        manifest.contains(args),
        "env.toml's code_tests args changed"
    );
    let manifest = manifest
        .replace(
            args,
            &format!("args = {{ timeout_s = 10.0, sandbox_url = {url:?} }}"),
        )
        .replace(
            "eval = \"humaneval.jsonl\"",
            &format!("eval = {:?}", data.display().to_string()),
        );
    let tmp = tempfile::tempdir().unwrap();
    std::fs::write(tmp.path().join("env.toml"), manifest).unwrap();
    let env = temper_env::Loader::new()
        .load(tmp.path().to_str().unwrap(), &json!({}))
        .unwrap();
    assert_eq!(env.id(), "humaneval");
    assert_eq!(env.eval_defaults().num_examples, 164);
    let rows = env.rows(temper_env::Split::Eval, 1000, 0).unwrap();
    assert_eq!(rows.len(), 164, "every problem is an eval row");
    assert!(env
        .rows(temper_env::Split::Train, 10, 0)
        .unwrap()
        .is_empty());

    let scored: Vec<(String, Vec<f64>)> = futures::stream::iter(rows)
        .map(|row| {
            let env = env.clone();
            async move {
                let body = row.answer.clone().expect("canonical solution");
                let prompt = row.info["prefix"].as_str().expect("prefix").to_string();
                let rollouts = [
                    rollout(&body),
                    rollout(&format!("Here it is:\n```python\n{prompt}{body}```\nDone.")),
                    rollout("    pass\n"),
                ];
                let s = env.score_group(&row, &rollouts).await;
                let task = row.info["task_id"].as_str().unwrap_or("?").to_string();
                (task, s.iter().map(|s| s.reward).collect())
            }
        })
        .buffer_unordered(4)
        .collect()
        .await;
    let failed = |i: usize, want: f64| -> Vec<&str> {
        scored
            .iter()
            .filter(|(_, r)| r[i] != want)
            .map(|(t, _)| t.as_str())
            .collect()
    };
    assert_eq!(scored.len(), 164);
    assert_eq!(
        failed(0, 1.0),
        Vec::<&str>::new(),
        "canonical bodies that fail"
    );
    assert_eq!(
        failed(1, 1.0),
        Vec::<&str>::new(),
        "canonical functions that fail"
    );
    assert_eq!(failed(2, 0.0), Vec::<&str>::new(), "empty bodies that pass");
}

fn xml() -> Parser {
    serde_json::from_value(json!({"type": "xml", "fields": ["answer"], "answer_field": "answer"}))
        .unwrap()
}

/// Issue 15: `json_fields` compares field by field, weighted, with strings
/// and numbers normalised; `regex_extract` captures and compares.
#[tokio::test]
async fn json_fields_and_regex_extract() {
    use temper_env::rubric::{JsonFieldsConfig, RegexExtract, RegexExtractConfig};
    let want = r#"{"name": "Ana Ruiz", "total": 12.5, "address": {"city": "Lima"}, "tags": ["a"]}"#;
    let cfg = |v: Value| -> JsonFieldsConfig { serde_json::from_value(v).unwrap() };
    let all = || Reward::json_fields(1.0, cfg(json!({})));
    let cases: &[(&str, f64)] = &[
        // Every field right, up to case, spacing, number formatting, fences.
        (
            r#"<answer>```json
{"name": " ana  RUIZ", "total": "12.50", "address": {"city": "lima"}, "tags": ["A"]}
```</answer>"#,
            1.0,
        ),
        (
            r#"<answer>{"name": "Ana Ruiz", "total": 13, "address": {"city": "Lima"}, "tags": ["a"]}</answer>"#,
            0.75,
        ),
        (r#"<answer>{"name": "Ana Ruiz"}</answer>"#, 0.25),
        ("<answer>not json</answer>", 0.0),
        ("no tags at all", 0.0),
    ];
    for (text, expected) in cases {
        let got = score(all(), xml(), text, Some(want), json!({})).await;
        assert!((got - expected).abs() < 1e-9, "{text}: {got} != {expected}");
    }
    // Weights and dotted paths; normalisation off is strict.
    let weighted = Reward::json_fields(
        1.0,
        cfg(json!({"fields": {"name": 3.0, "address.city": 1.0}})),
    );
    let text = r#"<answer>{"name": "Ana Ruiz", "address": {"city": "Cusco"}}</answer>"#;
    assert_eq!(
        score(weighted, xml(), text, Some(want), json!({})).await,
        0.75
    );
    let strict = Reward::json_fields(1.0, cfg(json!({"fields": ["name"], "normalize": false})));
    let text = r#"<answer>{"name": "ana ruiz"}</answer>"#;
    assert_eq!(score(strict, xml(), text, Some(want), json!({})).await, 0.0);
    assert!(serde_json::from_value::<JsonFieldsConfig>(json!({"feilds": []})).is_err());

    let rx = |v: Value| {
        Reward::regex_extract(
            1.0,
            RegexExtract::new(serde_json::from_value::<RegexExtractConfig>(v).unwrap()).unwrap(),
        )
    };
    let p = Parser::Plain;
    let total = json!({"pattern": r"Total: (?P<answer>[\d.,/]+)", "compare": "numeric"});
    assert_eq!(
        score(
            rx(total.clone()),
            p.clone(),
            "Total: 1.50 then Total: 12.5",
            Some("12.50"),
            json!({})
        )
        .await,
        1.0
    );
    let first = json!({"pattern": r"Total: ([\d.]+)", "compare": "numeric", "first": true});
    assert_eq!(
        score(
            rx(first),
            p.clone(),
            "Total: 1.50 then Total: 12.5",
            Some("12.5"),
            json!({})
        )
        .await,
        0.0
    );
    let math = json!({"pattern": r"= (.+)$", "compare": "math"});
    assert_eq!(
        score(rx(math), p.clone(), "x = 1/2", Some("0.5"), json!({})).await,
        1.0
    );
    let exact = json!({"pattern": r"City: (\w+)"});
    assert_eq!(
        score(rx(exact), p.clone(), "City: LIMA", Some("lima"), json!({})).await,
        1.0
    );
    assert!(RegexExtract::new(
        serde_json::from_value(json!({"pattern": "x", "compare": "fuzzy"})).unwrap()
    )
    .is_err());
}

/// Issue 15: the reward is Σ weight · score, or that over Σ |weight| when
/// the rubric normalises.
#[tokio::test]
async fn normalized_rubric_divides_by_the_weight_sum() {
    let mut rubric = Rubric::new(Parser::Plain)
        .with(Reward::new("a", 2.0, |_| 1.0))
        .with(Reward::new("b", 3.0, |_| 0.5))
        .with(Reward::new("metric", 0.0, |_| 7.0));
    let s = rubric
        .score_group(&row(None, json!({})), &[rollout("x")])
        .await;
    assert_eq!(s[0].reward, 3.5);
    rubric.normalize = true;
    let s = rubric
        .score_group(&row(None, json!({})), &[rollout("x")])
        .await;
    assert_eq!(s[0].reward, 0.7);
    assert_eq!(s[0].metrics["metric"], 7.0);
}

/// Issue 15: a reward written in Python, one batched call per group, with
/// its metrics; a failing program is a visible `/error` metric.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_reward_program_scores_a_group_in_one_call() {
    use std::time::Duration;
    use temper_env::rubric::ProgramReward;
    let dir = tempfile::tempdir().unwrap();
    write_reward_py(
        dir.path(),
        r#"
calls = []

@reward
def overlap(text, parsed, answer, info, args, **_):
    calls.append(1)
    hit = float(answer.lower() in text.lower())
    return hit * args["scale"], {"calls": len(calls), "bonus": info["bonus"]}

@reward
def broken(**_):
    raise RuntimeError("no luck")
"#,
    );
    let spawn = |f: Option<&str>| {
        ProgramReward::spawn(
            "python3 reward.py",
            Some(dir.path()),
            f.map(str::to_string),
            json!({"scale": 0.5}),
            Duration::from_secs(30),
        )
    };
    // Two functions: the entry must name one, and a wrong name lists them.
    let e = spawn(None).err().unwrap();
    assert!(e.contains("broken, overlap"), "{e}");
    let e = spawn(Some("nope")).err().unwrap();
    assert!(e.contains("no function `nope`"), "{e}");

    let rubric = Rubric::new(Parser::Plain).with(Reward::program(
        2.0,
        "overlap",
        spawn(Some("overlap")).unwrap(),
    ));
    let rollouts = [
        rollout("It is PARIS."),
        rollout("London"),
        rollout("paris!"),
    ];
    let s = rubric
        .score_group(&row(Some("Paris"), json!({"bonus": 3})), &rollouts)
        .await;
    let rewards: Vec<f64> = s.iter().map(|s| s.reward).collect();
    assert_eq!(rewards, [1.0, 0.0, 1.0]);
    assert_eq!(s[1].metrics["overlap"], 0.0);
    assert_eq!(s[0].metrics["overlap/bonus"], 3.0);
    // One process, called in order within the group.
    assert_eq!(s[2].metrics["overlap/calls"], 3.0);

    let rubric = Rubric::new(Parser::Plain).with(Reward::program(
        1.0,
        "broken",
        spawn(Some("broken")).unwrap(),
    ));
    let s = rubric
        .score_group(&row(Some("x"), json!({})), &[rollout("x")])
        .await;
    assert_eq!(s[0].reward, 0.0);
    assert_eq!(s[0].metrics["broken/error"], 1.0);
}

/// Issue 15: with `sandbox = true` the same Python reward runs in the
/// sandbox service, one isolated run per group.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_reward_program_runs_in_the_sandbox() {
    let Some(url) = sandbox_service(false).await else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    write_reward_py(
        dir.path(),
        r#"
@reward
def shout(text, args, **_):
    return float(text.isupper()) * args["scale"]
"#,
    );
    let spec: temper_env::rubric::RewardSpec = toml::from_str(&format!(
        "command = \"python3 reward.py\"\nsandbox = true\nsandbox_url = {url:?}\nargs = {{ scale = 2.0 }}\nname = \"shout\""
    ))
    .unwrap();
    let r = Reward::from_spec_in(&spec, Some(dir.path())).unwrap();
    let rubric = Rubric::new(Parser::Plain).with(r);
    let s = rubric
        .score_group(&row(None, json!({})), &[rollout("HEY"), rollout("hey")])
        .await;
    assert_eq!(s[0].metrics.get("shout/error"), None, "{:?}", s[0].metrics);
    assert_eq!((s[0].reward, s[1].reward), (2.0, 0.0));
    // Only `python3 FILE.py` can be shipped to the sandbox.
    let bad: temper_env::rubric::RewardSpec =
        toml::from_str("command = \"node reward.js\"\nsandbox = true").unwrap();
    let e = Reward::from_spec_in(&bad, Some(dir.path())).err().unwrap();
    assert!(e.contains("python3 FILE.py"), "{e}");
}
