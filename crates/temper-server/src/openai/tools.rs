//! Tool calls in generated text, for the Hermes / Qwen template family: the
//! model writes `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`
//! (the format the Qwen2/Qwen3 chat templates teach it and render back).

use serde_json::value::RawValue;
use serde_json::{json, Value};

/// Opening tag of a tool call.
pub const OPEN: &str = "<tool_call>";
const CLOSE: &str = "</tool_call>";

/// A parsed tool call.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolCall {
    /// Function name.
    pub name: String,
    /// Arguments as a JSON string (OpenAI's wire form).
    pub arguments: String,
}

/// Text outside tool calls (trimmed; `None` when empty) and the calls, in order.
/// A block that is not closed or not valid JSON with a string `name` stays text.
pub fn parse(text: &str) -> (Option<String>, Vec<ToolCall>) {
    let mut calls = Vec::new();
    let mut content = String::new();
    let mut rest = text;
    while let Some(start) = rest.find(OPEN) {
        let after = &rest[start + OPEN.len()..];
        let Some(end) = after.find(CLOSE) else {
            break;
        };
        match parse_one(&after[..end]) {
            Some(call) => {
                content.push_str(&rest[..start]);
                calls.push(call);
            }
            None => content.push_str(&rest[..start + OPEN.len() + end + CLOSE.len()]),
        }
        rest = &after[end + CLOSE.len()..];
    }
    content.push_str(rest);
    let content = content.trim();
    ((!content.is_empty()).then(|| content.to_string()), calls)
}

fn parse_one(body: &str) -> Option<ToolCall> {
    // Arguments are kept as the model wrote them: re-serialising a parsed
    // value would rewrite numbers (`-0` became `-0.0`, which a schema's
    // "integer" refuses; big integers lost digits).
    #[derive(serde::Deserialize)]
    struct Call<'a> {
        name: String,
        #[serde(borrow, default)]
        arguments: Option<&'a RawValue>,
        #[serde(borrow, default)]
        parameters: Option<&'a RawValue>,
    }
    let call: Call<'_> = serde_json::from_str(body.trim()).ok()?;
    let arguments = match call.arguments.or(call.parameters) {
        None => "{}".to_string(),
        Some(raw) if raw.get().starts_with('"') => serde_json::from_str(raw.get()).ok()?,
        Some(raw) => raw.get().to_string(),
    };
    Some(ToolCall {
        name: call.name,
        arguments,
    })
}

/// How much of streamed `text` may be sent as content when tools are on:
/// everything before the first `<tool_call>`, less a suffix that may start one.
pub fn content_prefix_len(text: &str) -> usize {
    if let Some(i) = text.find(OPEN) {
        return i;
    }
    let mut hold = 0;
    for (i, _) in OPEN.char_indices().skip(1) {
        if text.ends_with(&OPEN[..i]) {
            hold = i;
        }
    }
    text.len() - hold
}

/// OpenAI `tool_calls` entries for `calls`; ids are `call_<request id>_<i>`.
pub fn to_json(calls: &[ToolCall], request_id: &str, choice: usize) -> Vec<Value> {
    calls
        .iter()
        .enumerate()
        .map(|(i, c)| {
            json!({
                "id": format!("call_{request_id}_{choice}_{i}"),
                "type": "function",
                "function": {"name": c.name, "arguments": c.arguments},
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hermes_blocks_become_calls_and_the_rest_content() {
        let text = "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>";
        let (content, calls) = parse(text);
        assert_eq!(content.as_deref(), Some("Let me check."));
        assert_eq!(
            calls,
            vec![ToolCall {
                name: "get_weather".into(),
                arguments: "{\"city\": \"Paris\"}".into()
            }]
        );
    }

    #[test]
    fn arguments_are_passed_on_as_written() {
        let one = |body: &str| parse(&format!("<tool_call>{body}</tool_call>")).1;
        let calls =
            one("{\"name\": \"add\", \"arguments\": {\"a\": -0, \"b\": 12345678901234567890123}}");
        assert_eq!(
            calls[0].arguments,
            "{\"a\": -0, \"b\": 12345678901234567890123}"
        );
        // A JSON-string encoding, `parameters`, and none at all.
        let calls = one("{\"name\": \"f\", \"arguments\": \"{\\\"x\\\": 1}\"}");
        assert_eq!(calls[0].arguments, "{\"x\": 1}");
        assert_eq!(
            one("{\"name\": \"f\", \"parameters\": [1]}")[0].arguments,
            "[1]"
        );
        assert_eq!(one("{\"name\": \"f\"}")[0].arguments, "{}");
        assert!(one("{\"name\": 3}").is_empty());
    }

    #[test]
    fn broken_or_unclosed_blocks_stay_text() {
        let (content, calls) = parse("<tool_call>{not json}</tool_call> and <tool_call>{\"name\"");
        assert!(calls.is_empty());
        assert_eq!(
            content.as_deref(),
            Some("<tool_call>{not json}</tool_call> and <tool_call>{\"name\"")
        );
    }

    #[test]
    fn streaming_holds_back_a_partial_tag() {
        assert_eq!(content_prefix_len("hi <tool_c"), 3);
        assert_eq!(content_prefix_len("hi <tool_call>{"), 3);
        assert_eq!(content_prefix_len("hi"), 2);
    }
}
