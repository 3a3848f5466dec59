//! The built-in reward functions of `env.toml` that score one rollout by
//! itself: answer matching, JSON checks, format and length.

use std::sync::Arc;

use serde_json::Value;

use super::json_fields::{json_fields_score, JsonFieldsConfig};
use super::regex_extract::RegexExtract;
use super::reward::Reward;
use crate::math;

impl Reward {
    /// Parsed answer equals the reference exactly (trimmed; `case_sensitive`
    /// default false).
    pub fn exact_match(weight: f64, case_sensitive: bool) -> Self {
        Reward::new("exact_match", weight, move |c| {
            let (Some(got), Some(want)) = (c.parsed(), c.answer) else {
                return 0.0;
            };
            let eq = if case_sensitive {
                got.trim() == want.trim()
            } else {
                got.trim().to_lowercase() == want.trim().to_lowercase()
            };
            f64::from(u8::from(eq))
        })
    }

    /// The reference answer occurs in the last assistant message.
    pub fn contains(weight: f64) -> Self {
        Reward::new("contains", weight, |c| {
            let text = crate::last_assistant_text(c.completion).to_lowercase();
            match c.answer {
                Some(a) if !a.trim().is_empty() => {
                    f64::from(u8::from(text.contains(&a.trim().to_lowercase())))
                }
                _ => 0.0,
            }
        })
    }

    /// The parsed answer matches `pattern` (whole-answer match unless the
    /// pattern says otherwise).
    pub fn regex(weight: f64, pattern: &str) -> Result<Self, regex::Error> {
        let re = regex::Regex::new(pattern)?;
        Ok(Reward::new("regex", weight, move |c| {
            c.parsed()
                .map_or(0.0, |a| f64::from(u8::from(re.is_match(&a))))
        }))
    }

    /// Parsed answer is mathematically equal to the reference
    /// ([`math::math_equal`]).
    pub fn math_equiv(weight: f64) -> Self {
        Reward::new("math_equiv", weight, |c| match (c.parsed(), c.answer) {
            (Some(got), Some(want)) => f64::from(u8::from(math::math_equal(&got, want))),
            _ => 0.0,
        })
    }

    /// Parsed answer is a number literal equal to the reference number.
    pub fn numeric_match(weight: f64) -> Self {
        Reward::new("numeric_match", weight, |c| {
            let got = c.parsed().and_then(|a| math::parse_number_literal(&a));
            let want = c.answer.and_then(math::parse_number_literal);
            match (got, want) {
                (Some(g), Some(w)) => f64::from(u8::from((g - w).abs() < 1e-9)),
                _ => 0.0,
            }
        })
    }

    /// Longest-common-subsequence ratio of the parsed answer and the
    /// reference: 2·LCS / (|a| + |b|).
    pub fn lcs(weight: f64) -> Self {
        Reward::new("lcs_ratio", weight, |c| match (c.parsed(), c.answer) {
            (Some(got), Some(want)) => lcs_ratio(&got, want),
            _ => 0.0,
        })
    }

    /// The parsed answer is valid JSON.
    pub fn json_valid(weight: f64) -> Self {
        Reward::new("json_valid", weight, |c| {
            c.parsed().map_or(0.0, |a| {
                f64::from(u8::from(serde_json::from_str::<Value>(&a).is_ok()))
            })
        })
    }

    /// The parsed answer is JSON valid against `schema`, or against the
    /// row's `info.schema` when `schema` is `None`.
    pub fn json_schema(weight: f64, schema: Option<Value>) -> Result<Self, String> {
        let fixed = match schema {
            Some(s) => Some(Arc::new(
                jsonschema::validator_for(&s).map_err(|e| e.to_string())?,
            )),
            None => None,
        };
        Ok(Reward::new("json_schema", weight, move |c| {
            let Some(value) = c
                .parsed()
                .and_then(|a| serde_json::from_str::<Value>(&a).ok())
            else {
                return 0.0;
            };
            let ok = match &fixed {
                Some(v) => v.is_valid(&value),
                None => match c.info.get("schema") {
                    Some(s) => jsonschema::validator_for(s).is_ok_and(|v| v.is_valid(&value)),
                    None => false,
                },
            };
            f64::from(u8::from(ok))
        }))
    }

    /// The parser's format reward.
    pub fn format(weight: f64) -> Self {
        Reward::new("format", weight, |c| c.parser.format_reward(c.completion))
    }

    /// 0 up to `max_chars` characters of assistant text, then falling
    /// linearly to −1 at twice that. Give it a positive weight.
    pub fn length_penalty(weight: f64, max_chars: usize) -> Self {
        Reward::new("length_penalty", weight, move |c| {
            let len: usize = c
                .completion
                .iter()
                .filter(|m| m.role == "assistant")
                .map(|m| m.text().chars().count())
                .sum();
            let max = max_chars.max(1) as f64;
            -((len as f64 - max) / max).clamp(0.0, 1.0)
        })
    }

    /// Per-field comparison of the parsed answer's JSON object with the
    /// reference's ([`json_fields_score`]).
    pub fn json_fields(weight: f64, cfg: JsonFieldsConfig) -> Self {
        Reward::new("json_fields", weight, move |c| {
            json_fields_score(c.parsed().as_deref(), c.answer, &cfg)
        })
    }

    /// A value captured from the last assistant message by `pattern`,
    /// compared with the reference ([`RegexExtract`]).
    pub fn regex_extract(weight: f64, cfg: RegexExtract) -> Self {
        Reward::new("regex_extract", weight, move |c| {
            let text = crate::last_assistant_text(c.completion);
            match (cfg.extract(&text), c.answer) {
                (Some(got), Some(want)) => f64::from(u8::from(cfg.same(&got, want))),
                _ => 0.0,
            }
        })
    }
}

/// 2·LCS / (|a| + |b|) over characters (1 for two empty strings).
pub fn lcs_ratio(a: &str, b: &str) -> f64 {
    let a: Vec<char> = a.chars().take(4096).collect();
    let b: Vec<char> = b.chars().take(4096).collect();
    if a.is_empty() && b.is_empty() {
        return 1.0;
    }
    let mut prev = vec![0usize; b.len() + 1];
    let mut cur = vec![0usize; b.len() + 1];
    for &x in &a {
        for (j, &y) in b.iter().enumerate() {
            cur[j + 1] = if x == y {
                prev[j] + 1
            } else {
                cur[j].max(prev[j + 1])
            };
        }
        std::mem::swap(&mut prev, &mut cur);
    }
    2.0 * prev[b.len()] as f64 / (a.len() + b.len()) as f64
}
