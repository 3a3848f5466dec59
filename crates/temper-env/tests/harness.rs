//! Multi-turn and tool-use harnesses driven by a scripted model.

mod common;

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use common::{call_tools, say, Scripted};
use serde_json::{json, Value};
use temper_env::{
    stop, Calculator, ChatModel, EnvResponder, EnvResponse, Harness, Loader, Message,
    ModelCallError, Row, SamplingArgs, Split, Tool,
};

fn row(q: &str) -> Row {
    Row {
        example_id: 0,
        prompt: vec![Message::user(q)],
        answer: None,
        info: json!({}),
    }
}

/// Issue 15: one answer is the normal end of a single-turn rollout, not a
/// turn limit.
#[tokio::test]
async fn single_turn_rollouts_end_completed() {
    let env = Loader::new().load("arithmetic", &json!({})).unwrap();
    let row = env.rows(Split::Eval, 1, 0).unwrap().remove(0);
    let model = Scripted::texts(&["<answer>1</answer>"]);
    let ro = env.rollout(&model, &row, &SamplingArgs::default()).await;
    assert_eq!(ro.stop_condition.as_deref(), Some(stop::COMPLETED));
    assert_eq!(stop::COMPLETED, "completed");
    assert!(ro.is_completed && ro.error.is_none());
}

#[tokio::test]
async fn wordle_solved_on_the_second_guess() {
    let env = Loader::new().load("wordle", &json!({})).unwrap();
    let row = env.rows(Split::Eval, 1, 0).unwrap().remove(0);
    let secret = row.answer.clone().unwrap();
    let wrong = if secret == "zebra" { "apple" } else { "zebra" };
    let model = Scripted::texts(&[
        &format!("<guess>{wrong}</guess>"),
        &format!("<guess>{secret}</guess>"),
    ]);
    let ro = env.rollout(&model, &row, &SamplingArgs::default()).await;
    assert_eq!(ro.stop_condition.as_deref(), Some(stop::ENV_DONE));
    assert!(ro.is_completed && ro.error.is_none());
    // assistant, feedback, assistant, "Correct!"
    let roles: Vec<&str> = ro.completion.iter().map(|m| m.role.as_str()).collect();
    assert_eq!(roles, ["assistant", "user", "assistant", "user"]);
    let fb = temper_env::wordle_feedback(wrong, &secret);
    assert!(ro.completion[1].text().contains(&fb));
    assert!(ro.completion[3].text().contains("Correct"));
    // The second request carried the feedback.
    let reqs = model.requests();
    assert_eq!(reqs.len(), 2);
    assert_eq!(
        reqs[1].messages.last().unwrap().text(),
        ro.completion[1].text()
    );
    assert_eq!(ro.token_usage.output_tokens, 12);
    let scores = env.score_group(&row, &[ro]).await;
    assert_eq!(scores[0].reward, 1.0);
    assert_eq!(scores[0].metrics["best_greens"], 1.0);
    assert_eq!(scores[0].metrics["format"], 1.0);
}

#[tokio::test]
async fn wordle_stops_at_max_turns_and_scores_zero() {
    let env = Loader::new()
        .load("wordle", &json!({"max_turns": 2}))
        .unwrap();
    let mut row = env.rows(Split::Eval, 1, 0).unwrap().remove(0);
    row.answer = Some("crane".into());
    let model = Scripted::texts(&[
        "<guess>slate</guess>",
        "not a guess",
        "<guess>crane</guess>",
    ]);
    let ro = env.rollout(&model, &row, &SamplingArgs::default()).await;
    assert_eq!(ro.stop_condition.as_deref(), Some(stop::MAX_TURNS));
    assert_eq!(model.requests().len(), 2);
    let s = env.score_group(&row, &[ro]).await;
    assert_eq!(s[0].reward, 0.0);
    assert_eq!(s[0].metrics["best_greens"], 0.4); // slate vs crane: _ _ A _ E
    assert_eq!(s[0].metrics["format"], 0.5);
}

#[tokio::test]
async fn model_error_mid_conversation_is_recorded_not_raised() {
    let env = Loader::new().load("wordle", &json!({})).unwrap();
    let row = env.rows(Split::Eval, 1, 0).unwrap().remove(0);
    let model = Scripted::new(vec![
        Ok(say("<guess>zzzzz</guess>")),
        Err(ModelCallError::Status {
            status: 503,
            message: "overloaded".into(),
        }),
    ]);
    let ro = env.rollout(&model, &row, &SamplingArgs::default()).await;
    assert!(!ro.is_completed);
    assert_eq!(ro.stop_condition.as_deref(), Some(stop::ERROR));
    assert!(ro.error.as_deref().unwrap().contains("503"));
    assert_eq!(ro.completion.len(), 2);
}

struct Again;

#[async_trait]
impl EnvResponder for Again {
    async fn respond(
        &self,
        _: &Row,
        _: &[Message],
        state: &mut Value,
    ) -> Result<EnvResponse, String> {
        let n = state.as_u64().unwrap_or(0) + 1;
        *state = json!(n);
        if n == 3 {
            return Err("the environment broke".into());
        }
        Ok(EnvResponse {
            messages: vec![Message::user("again")],
            done: false,
        })
    }
}

#[tokio::test]
async fn token_budget_caps_each_turn_and_stops_the_rollout() {
    let h = Harness::MultiTurn {
        responder: Arc::new(Again),
        max_turns: 10,
        max_total_tokens: Some(10),
    };
    let model = Scripted::texts(&["a", "b", "c"]);
    let sampling = SamplingArgs {
        max_tokens: 8,
        ..SamplingArgs::default()
    };
    let ro = h.run(&model, &row("go"), &sampling).await;
    assert_eq!(ro.stop_condition.as_deref(), Some(stop::MAX_TOKENS));
    assert!(ro.is_truncated && ro.is_completed);
    let reqs = model.requests();
    assert_eq!(reqs.len(), 2);
    assert_eq!(reqs[0].sampling.max_tokens, 8);
    assert_eq!(reqs[1].sampling.max_tokens, 4); // 10 - 6 used
}

#[tokio::test]
async fn environment_error_ends_the_rollout_with_has_error() {
    let h = Harness::MultiTurn {
        responder: Arc::new(Again),
        max_turns: 10,
        max_total_tokens: None,
    };
    let model = Scripted::texts(&["a", "b", "c", "d"]);
    let ro = h.run(&model, &row("go"), &SamplingArgs::default()).await;
    assert_eq!(ro.stop_condition.as_deref(), Some(stop::ERROR));
    assert!(ro
        .error
        .as_deref()
        .unwrap()
        .contains("the environment broke"));
    assert_eq!(model.requests().len(), 3);
    assert_eq!(ro.state, json!(3));
}

#[tokio::test]
async fn calculator_tools_runs_calls_and_feeds_back_errors() {
    let env = Loader::new()
        .load("calculator-tools", &json!({"digits": 2, "terms": 2}))
        .unwrap();
    let row = env.rows(Split::Eval, 1, 0).unwrap().remove(0);
    let expr = row.info["expression"].as_str().unwrap().to_string();
    let answer = row.answer.clone().unwrap();
    let model = Scripted::new(vec![
        Ok(call_tools(&[
            ("calculate", &json!({"expression": expr}).to_string()),
            ("calculate", "{not json"),
            ("teleport", "{}"),
            ("calculate", r#"{"expression": "1/0"}"#),
        ])),
        Ok(say(&format!("<answer>{answer}</answer>"))),
    ]);
    let ro = env.rollout(&model, &row, &SamplingArgs::default()).await;
    assert_eq!(ro.stop_condition.as_deref(), Some(stop::NO_TOOLS));
    let tool_msgs: Vec<&Message> = ro.completion.iter().filter(|m| m.role == "tool").collect();
    assert_eq!(tool_msgs.len(), 4);
    assert_eq!(tool_msgs[0].text(), answer);
    assert_eq!(tool_msgs[0].tool_call_id.as_deref(), Some("call_0"));
    assert!(tool_msgs[1]
        .text()
        .starts_with("Error: arguments are not valid JSON"));
    assert!(tool_msgs[2].text().contains("unknown tool `teleport`"));
    assert!(tool_msgs[3].text().starts_with("Error:"));
    // Tools were offered in OpenAI format on every request.
    let reqs = model.requests();
    assert_eq!(reqs.len(), 2);
    let tools = reqs[0].tools.as_ref().unwrap();
    assert_eq!(tools[0]["function"]["name"], "calculate");
    assert_eq!(
        reqs[1].messages.iter().filter(|m| m.role == "tool").count(),
        4
    );
    // The model's token trace (token ids) is kept for trainers.
    let trace = ro.model_turns[0].trace.as_ref().expect("a token trace");
    assert_eq!(trace.completion_ids, vec![1, 2, 3]);
    let s = env.score_group(&row, &[ro]).await;
    assert_eq!(s[0].reward, 1.0);
    assert_eq!(s[0].metrics["tool_calls"], 4.0);
}

struct Slow;

#[async_trait]
impl Tool for Slow {
    fn name(&self) -> &str {
        "slow"
    }
    fn schema(&self) -> Value {
        json!({"type": "function", "function": {"name": "slow", "parameters": {"type": "object"}}})
    }
    async fn call(&self, _: Value) -> Result<String, String> {
        tokio::time::sleep(Duration::from_secs(5)).await;
        Ok("done".into())
    }
}

#[tokio::test]
async fn tool_timeouts_are_fed_back_and_max_turns_stops_tool_loops() {
    let h = Harness::Tools {
        tools: vec![Arc::new(Slow), Arc::new(Calculator)],
        max_turns: 2,
        tool_timeout: Duration::from_millis(50),
    };
    let model = Scripted::new(vec![
        Ok(call_tools(&[("slow", "{}")])),
        Ok(call_tools(&[("calculate", r#"{"expression": "2*21"}"#)])),
        Ok(say("never reached")),
    ]);
    let t = std::time::Instant::now();
    let ro = h.run(&model, &row("go"), &SamplingArgs::default()).await;
    assert!(t.elapsed() < Duration::from_secs(2));
    assert!(ro.completion[1].text().contains("timed out"));
    assert_eq!(ro.completion[3].text(), "42");
    assert_eq!(ro.stop_condition.as_deref(), Some(stop::MAX_TURNS));
    assert_eq!(model.requests().len(), 2);
}

#[tokio::test]
async fn single_turn_length_finish_marks_truncated() {
    let env = Loader::new().load("arithmetic", &json!({})).unwrap();
    let row = env.rows(Split::Eval, 1, 0).unwrap().remove(0);
    let mut turn = say("<answer>12");
    turn.finish_reason = "length".into();
    let model = Scripted::new(vec![Ok(turn)]);
    let ro = env
        .rollout(&model as &dyn ChatModel, &row, &SamplingArgs::default())
        .await;
    assert!(ro.is_truncated && ro.is_completed);
    assert_eq!(ro.stop_condition.as_deref(), Some(stop::MAX_TOKENS));
}
