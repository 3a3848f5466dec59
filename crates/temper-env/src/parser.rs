//! Parsers: pull the answer out of a completion, and judge its format.
//!
//! Every parser answers two questions about the assistant's messages:
//! [`Parser::parse_answer`] (the answer of the last assistant message, if
//! it has one) and [`Parser::format_reward`] (0..1, how well the messages
//! follow the requested format), so a rubric can reward the format with a
//! small weight or watch it as a zero-weight metric.

use std::sync::OnceLock;

use regex::Regex;
use serde::{Deserialize, Serialize};

use crate::Message;

/// A field name, or a list of accepted alternatives (`["answer", "result"]`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum FieldSpec {
    /// One tag name.
    One(String),
    /// Alternatives: the first is canonical.
    Any(Vec<String>),
}

impl FieldSpec {
    fn names(&self) -> Vec<&str> {
        match self {
            FieldSpec::One(s) => vec![s.as_str()],
            FieldSpec::Any(v) => v.iter().map(String::as_str).collect(),
        }
    }
}

/// How to read an answer out of a completion.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "kebab-case")]
pub enum Parser {
    /// XML-ish fields: `<think>…</think><answer>…</answer>`. The answer is
    /// the last `answer_field` element of the last assistant message.
    Xml {
        /// Fields the format asks for, in order.
        fields: Vec<FieldSpec>,
        /// Which field holds the answer (any of its alternatives).
        answer_field: String,
    },
    /// `<think>…</think>` first, then the rest parsed by `then`.
    Think {
        /// Parser for the text after `</think>`.
        then: Box<Parser>,
    },
    /// The last `\boxed{…}` (or `\fbox{…}`), braces matched.
    Boxed,
    /// The last number in the text (integers, decimals, fractions, `1e-3`).
    LastNumber,
    /// The whole text of the last assistant message, trimmed.
    Plain,
}

impl Default for Parser {
    fn default() -> Self {
        Parser::answer_tag()
    }
}

impl Parser {
    /// `<answer>…</answer>`.
    pub fn answer_tag() -> Self {
        Parser::Xml {
            fields: vec![FieldSpec::One("answer".into())],
            answer_field: "answer".into(),
        }
    }

    /// The answer in the last assistant message, if the format yields one.
    pub fn parse_answer(&self, completion: &[Message]) -> Option<String> {
        let text = completion
            .iter()
            .rev()
            .find(|m| m.role == "assistant")
            .map(Message::text)?;
        self.parse_text(&text)
    }

    /// The answer in one text.
    pub fn parse_text(&self, text: &str) -> Option<String> {
        match self {
            Parser::Xml {
                fields,
                answer_field,
            } => {
                let names = fields
                    .iter()
                    .find(|f| f.names().contains(&answer_field.as_str()))
                    .map(FieldSpec::names)
                    .unwrap_or_else(|| vec![answer_field.as_str()]);
                names
                    .iter()
                    .filter_map(|n| last_element(text, n))
                    .max_by_key(|(pos, _)| *pos)
                    .map(|(_, s)| s.trim().to_string())
            }
            Parser::Think { then } => {
                let (_, after) = split_think(text)?;
                then.parse_text(after)
            }
            Parser::Boxed => last_boxed(text).map(|s| s.trim().to_string()),
            Parser::LastNumber => last_number(text),
            Parser::Plain => {
                let t = text.trim();
                (!t.is_empty()).then(|| t.to_string())
            }
        }
    }

    /// 0..1: the mean over assistant messages of how well each follows the
    /// format (0 when there is no assistant message).
    pub fn format_reward(&self, completion: &[Message]) -> f64 {
        let scores: Vec<f64> = completion
            .iter()
            .filter(|m| m.role == "assistant")
            .map(|m| self.format_text(&m.text()))
            .collect();
        if scores.is_empty() {
            0.0
        } else {
            scores.iter().sum::<f64>() / scores.len() as f64
        }
    }

    /// 0..1 for one text.
    pub fn format_text(&self, text: &str) -> f64 {
        match self {
            Parser::Xml { fields, .. } => {
                if fields.is_empty() {
                    return 1.0;
                }
                let mut rest = text.to_string();
                let mut present = 0usize;
                for f in fields {
                    let mut found = false;
                    for n in f.names() {
                        if let Some((_, inner)) = last_element(text, n) {
                            found = true;
                            let whole = format!("<{n}>{inner}</{n}>");
                            rest = rest.replace(&whole, "");
                            break;
                        }
                    }
                    present += usize::from(found);
                }
                let presence = present as f64 / fields.len() as f64;
                // Full marks only when nothing but the fields was written.
                let clean = if rest.trim().is_empty() { 1.0 } else { 0.0 };
                0.8 * presence + 0.2 * clean * presence
            }
            Parser::Think { then } => match split_think(text) {
                Some((_, after)) => 0.5 + 0.5 * then.format_text(after),
                None => 0.0,
            },
            Parser::Boxed => f64::from(u8::from(last_boxed(text).is_some())),
            Parser::LastNumber => f64::from(u8::from(last_number(text).is_some())),
            Parser::Plain => f64::from(u8::from(!text.trim().is_empty())),
        }
    }
}

/// The last `<name>…</name>` in `text`: (byte offset, inner text).
fn last_element<'a>(text: &'a str, name: &str) -> Option<(usize, &'a str)> {
    let open = format!("<{name}>");
    let close = format!("</{name}>");
    let end = text.rfind(&close)?;
    let start = text[..end].rfind(&open)? + open.len();
    Some((start, &text[start..end]))
}

/// `<think>…</think>` at the start (leading whitespace allowed), exactly
/// once: (thought, rest).
fn split_think(text: &str) -> Option<(&str, &str)> {
    let t = text.trim_start();
    let body = t.strip_prefix("<think>")?;
    let end = body.find("</think>")?;
    let rest = &body[end + "</think>".len()..];
    if rest.contains("<think>") || rest.contains("</think>") {
        return None;
    }
    Some((&body[..end], rest))
}

/// The content of the last `\boxed{…}` / `\fbox{…}` with balanced braces.
pub fn last_boxed(text: &str) -> Option<String> {
    let pos = ["\\boxed", "\\fbox"]
        .iter()
        .filter_map(|k| text.rfind(k).map(|p| (p, k.len())))
        .max_by_key(|(p, _)| *p)?;
    let after = &text[pos.0 + pos.1..];
    let after_trim = after.trim_start();
    if let Some(body) = after_trim.strip_prefix('{') {
        let mut depth = 1usize;
        for (i, c) in body.char_indices() {
            match c {
                '{' => depth += 1,
                '}' => {
                    depth -= 1;
                    if depth == 0 {
                        return Some(body[..i].to_string());
                    }
                }
                _ => {}
            }
        }
        None
    } else {
        // `\boxed 5`: the next token.
        let tok: String = after_trim
            .chars()
            .take_while(|c| !c.is_whitespace() && *c != '$')
            .collect();
        (!tok.is_empty()).then_some(tok)
    }
}

fn number_re() -> &'static Regex {
    static RE: OnceLock<Regex> = OnceLock::new();
    RE.get_or_init(|| {
        Regex::new(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?|-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?(?:\s*/\s*\d+)?|-?\.\d+")
            .expect("static regex")
    })
}

/// The last number in `text`, commas between thousands removed.
pub fn last_number(text: &str) -> Option<String> {
    number_re()
        .find_iter(text)
        .last()
        .map(|m| m.as_str().replace([',', ' '], ""))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn xml(fields: &[&[&str]], answer: &str) -> Parser {
        Parser::Xml {
            fields: fields
                .iter()
                .map(|f| FieldSpec::Any(f.iter().map(|s| s.to_string()).collect()))
                .collect(),
            answer_field: answer.into(),
        }
    }

    #[test]
    fn parse_table() {
        let think_xml = Parser::Think {
            then: Box::new(Parser::answer_tag()),
        };
        let cases: Vec<(Parser, &str, Option<&str>)> = vec![
            (Parser::answer_tag(), "<answer>42</answer>", Some("42")),
            (Parser::answer_tag(), "x <answer> 7 </answer> y", Some("7")),
            (
                Parser::answer_tag(),
                "<answer>1</answer><answer>2</answer>",
                Some("2"),
            ),
            (Parser::answer_tag(), "<answer>unclosed", None),
            (Parser::answer_tag(), "no tags at all", None),
            (Parser::answer_tag(), "", None),
            (
                xml(&[&["answer", "result"]], "answer"),
                "<result>9</result>",
                Some("9"),
            ),
            (
                xml(&[&["reasoning"], &["answer"]], "answer"),
                "<reasoning>r</reasoning><answer>a</answer>",
                Some("a"),
            ),
            (
                think_xml.clone(),
                "<think>hmm</think><answer>5</answer>",
                Some("5"),
            ),
            (
                think_xml.clone(),
                "  <think>a</think>\n<answer>5</answer>",
                Some("5"),
            ),
            (think_xml.clone(), "<answer>5</answer>", None),
            (
                think_xml.clone(),
                "<think>a</think><think>b</think><answer>5</answer>",
                None,
            ),
            (think_xml.clone(), "<think><answer>3</answer></think>", None),
            (
                Parser::Boxed,
                r"so \boxed{\frac{1}{2}}.",
                Some(r"\frac{1}{2}"),
            ),
            (Parser::Boxed, r"\boxed{1} then \boxed{2}", Some("2")),
            (Parser::Boxed, r"\boxed{a{b}c}", Some("a{b}c")),
            (Parser::Boxed, r"\fbox{7}", Some("7")),
            (Parser::Boxed, r"\boxed 5", Some("5")),
            (Parser::Boxed, r"\boxed{unbalanced", None),
            (Parser::Boxed, "42", None),
            (Parser::LastNumber, "I think 3 then 4.5", Some("4.5")),
            (
                Parser::LastNumber,
                "total: 1,234,567 apples",
                Some("1234567"),
            ),
            (Parser::LastNumber, "x = -12", Some("-12")),
            (Parser::LastNumber, "ratio 3/4", Some("3/4")),
            (Parser::LastNumber, "tiny 1.5e-3", Some("1.5e-3")),
            (Parser::LastNumber, "no digits", None),
            (Parser::Plain, "  hello \n", Some("hello")),
            (Parser::Plain, "   ", None),
        ];
        for (p, text, want) in cases {
            assert_eq!(p.parse_text(text).as_deref(), want, "{p:?} on {text:?}");
        }
    }

    #[test]
    fn format_table() {
        let think_xml = Parser::Think {
            then: Box::new(Parser::answer_tag()),
        };
        let two = xml(&[&["think"], &["answer"]], "answer");
        let cases: Vec<(Parser, &str, f64)> = vec![
            (Parser::answer_tag(), "<answer>1</answer>", 1.0),
            (Parser::answer_tag(), "chatter <answer>1</answer>", 0.8),
            (Parser::answer_tag(), "1", 0.0),
            (two.clone(), "<think>x</think><answer>1</answer>", 1.0),
            (two.clone(), "<answer>1</answer>", 0.5),
            (think_xml.clone(), "<think>x</think><answer>1</answer>", 1.0),
            (think_xml.clone(), "<think>x</think>1", 0.5),
            (think_xml, "<answer>1</answer>", 0.0),
            (Parser::Boxed, r"\boxed{1}", 1.0),
            (Parser::Boxed, "1", 0.0),
            (Parser::LastNumber, "1", 1.0),
            (Parser::LastNumber, "one", 0.0),
            (Parser::Plain, "x", 1.0),
        ];
        for (p, text, want) in cases {
            let got = p.format_text(text);
            assert!(
                (got - want).abs() < 1e-9,
                "{p:?} on {text:?}: {got} != {want}"
            );
        }
    }

    #[test]
    fn format_reward_averages_assistant_turns_and_answer_uses_last() {
        let p = Parser::answer_tag();
        let msgs = vec![
            Message::assistant("<answer>1</answer>"),
            Message::user("again"),
            Message::assistant("2"),
        ];
        assert!((p.format_reward(&msgs) - 0.5).abs() < 1e-9);
        assert_eq!(p.parse_answer(&msgs), None);
        assert_eq!(p.format_reward(&[]), 0.0);
    }

    #[test]
    fn parser_reads_from_toml() {
        let p: Parser = toml::from_str("type = \"xml\"\nfields = [\"think\", [\"answer\", \"result\"]]\nanswer_field = \"answer\"").unwrap();
        assert_eq!(p.parse_text("<result>4</result>").as_deref(), Some("4"));
        let t: Parser = toml::from_str("type = \"think\"\nthen = { type = \"boxed\" }").unwrap();
        assert_eq!(
            t.parse_text(r"<think>.</think>\boxed{3}").as_deref(),
            Some("3")
        );
    }
}
