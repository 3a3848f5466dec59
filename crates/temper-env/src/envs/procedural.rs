//! Single-turn procedural tasks: arithmetic, reverse-text, alphabet-sort,
//! countdown, and the tool-use calculator task.

use std::sync::Arc;
use std::time::Duration;

use rand::seq::IndexedRandom;
use rand::Rng;
use rand_chacha::ChaCha8Rng;
use serde::Deserialize;
use serde_json::{json, Value};

use super::WORDS;
use crate::harness::{format_number, Calculator};
use crate::{
    math, parse_args, Env, EnvError, EvalDefaults, Generated, Harness, Parser, PromptTemplate,
    Reward, RewardCtx, Rubric, SamplingArgs, Task,
};

fn defaults(num_examples: usize, max_tokens: usize) -> EvalDefaults {
    EvalDefaults {
        num_examples,
        rollouts_per_example: 1,
        sampling: SamplingArgs {
            max_tokens,
            temperature: 0.0,
            ..SamplingArgs::default()
        },
        pass_threshold: None,
    }
}

fn bad(env: &str, message: impl Into<String>) -> EnvError {
    EnvError::BadArgs {
        env: env.into(),
        message: message.into(),
    }
}

fn template(system_prompt: Option<String>, default: &str) -> PromptTemplate {
    PromptTemplate {
        system_prompt: Some(system_prompt.unwrap_or_else(|| default.to_string())),
        few_shot: Vec::new(),
    }
}

fn number_in_digits(rng: &mut ChaCha8Rng, digits: u32) -> i64 {
    let hi = 10i64.pow(digits) - 1;
    let lo = if digits == 1 {
        0
    } else {
        10i64.pow(digits - 1)
    };
    rng.random_range(lo..=hi)
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ArithmeticArgs {
    /// Digits per operand (the difficulty).
    #[serde(default = "three")]
    digits: u32,
    /// Operators to draw from.
    #[serde(default = "all_ops")]
    ops: Vec<String>,
    /// System prompt; "" = none.
    #[serde(default)]
    system_prompt: Option<String>,
}

fn three() -> u32 {
    3
}

fn all_ops() -> Vec<String> {
    vec!["+".into(), "-".into(), "*".into()]
}

/// `What is 123 + 456?`, answered in `<answer>` tags. Reward: the answer
/// is the right number (weight 1); format is a metric.
pub(super) fn arithmetic(args: &Value) -> Result<Env, EnvError> {
    let a: ArithmeticArgs = parse_args("arithmetic", args)?;
    if !(1..=9).contains(&a.digits) {
        return Err(bad("arithmetic", "digits must be 1..=9"));
    }
    if a.ops.is_empty() || a.ops.iter().any(|o| !matches!(o.as_str(), "+" | "-" | "*")) {
        return Err(bad(
            "arithmetic",
            "ops must be a non-empty subset of [\"+\", \"-\", \"*\"]",
        ));
    }
    let digits = a.digits;
    let ops = a.ops;
    let gen = Generated::new(
        "arithmetic",
        template(
            a.system_prompt,
            "Answer with the number in <answer></answer> tags.",
        ),
        move |rng| {
            let x = number_in_digits(rng, digits);
            let y = number_in_digits(rng, digits);
            let op = ops.choose(rng).map_or("+", String::as_str);
            let v = match op {
                "-" => x - y,
                "*" => x * y,
                _ => x + y,
            };
            Task {
                question: format!("What is {x} {op} {y}?"),
                answer: v.to_string(),
                info: json!({"a": x, "b": y, "op": op}),
            }
        },
    );
    let rubric = Rubric::new(Parser::answer_tag())
        .with(Reward::numeric_match(1.0).named("correct"))
        .with(Reward::format(0.0));
    Ok(Env::new(
        "arithmetic",
        Arc::new(gen),
        Harness::SingleTurn,
        rubric,
        defaults(50, 64),
    ))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct WordsArgs {
    /// Words per task (the difficulty).
    #[serde(default)]
    words: Option<usize>,
    #[serde(default)]
    system_prompt: Option<String>,
}

fn pick_words(rng: &mut ChaCha8Rng, n: usize) -> Vec<&'static str> {
    WORDS.choose_multiple(rng, n).copied().collect()
}

/// Reverse a text character by character. Reward: LCS ratio with the
/// reversed text (weight 1); exact match and format are metrics.
pub(super) fn reverse_text(args: &Value) -> Result<Env, EnvError> {
    let a: WordsArgs = parse_args("reverse-text", args)?;
    let n = a.words.unwrap_or(2);
    if !(1..=50).contains(&n) {
        return Err(bad("reverse-text", "words must be 1..=50"));
    }
    let gen = Generated::new(
        "reverse-text",
        template(a.system_prompt, "Reverse the text character by character. Put the reversed text in <answer></answer> tags."),
        move |rng| {
            let text = pick_words(rng, n).join(" ");
            Task {
                answer: text.chars().rev().collect(),
                question: text,
                info: json!({}),
            }
        },
    );
    let rubric = Rubric::new(Parser::answer_tag())
        .with(Reward::lcs(1.0))
        .with(Reward::exact_match(0.0, true))
        .with(Reward::format(0.0));
    Ok(Env::new(
        "reverse-text",
        Arc::new(gen),
        Harness::SingleTurn,
        rubric,
        defaults(50, 128),
    ))
}

fn word_list(s: &str) -> Vec<String> {
    s.split([',', '\n', ' '])
        .map(|w| w.trim().to_lowercase())
        .filter(|w| !w.is_empty())
        .collect()
}

/// Sort words alphabetically. Reward: the exact sorted list (weight 1);
/// LCS ratio and format are metrics.
pub(super) fn alphabet_sort(args: &Value) -> Result<Env, EnvError> {
    let a: WordsArgs = parse_args("alphabet-sort", args)?;
    let n = a.words.unwrap_or(5);
    if !(2..=WORDS.len()).contains(&n) {
        return Err(bad(
            "alphabet-sort",
            format!("words must be 2..={}", WORDS.len()),
        ));
    }
    let gen = Generated::new(
        "alphabet-sort",
        template(a.system_prompt, "Sort the words alphabetically. Answer with the sorted words, comma-separated, in <answer></answer> tags."),
        move |rng| {
            let words = pick_words(rng, n);
            let mut sorted = words.clone();
            sorted.sort_unstable();
            Task {
                question: words.join(", "),
                answer: sorted.join(", "),
                info: json!({}),
            }
        },
    );
    let rubric = Rubric::new(Parser::answer_tag())
        .with(Reward::new("sorted", 1.0, |c: &RewardCtx<'_>| {
            match (c.parsed(), c.answer) {
                (Some(got), Some(want)) => f64::from(u8::from(word_list(&got) == word_list(want))),
                _ => 0.0,
            }
        }))
        .with(Reward::lcs(0.0))
        .with(Reward::format(0.0));
    Ok(Env::new(
        "alphabet-sort",
        Arc::new(gen),
        Harness::SingleTurn,
        rubric,
        defaults(50, 128),
    ))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct CountdownArgs {
    /// How many numbers (the difficulty).
    #[serde(default = "four")]
    numbers: usize,
    /// Largest number drawn.
    #[serde(default = "default_max_number")]
    max_number: i64,
    #[serde(default)]
    system_prompt: Option<String>,
}

fn four() -> usize {
    4
}

fn default_max_number() -> i64 {
    20
}

/// Countdown: reach the target using every given number exactly once with
/// `+ - * /` and parentheses. The target is built from the numbers, so it
/// is always reachable. Reward: a valid expression hitting the target.
pub(super) fn countdown(args: &Value) -> Result<Env, EnvError> {
    let a: CountdownArgs = parse_args("countdown", args)?;
    if !(2..=6).contains(&a.numbers) || !(2..=1000).contains(&a.max_number) {
        return Err(bad(
            "countdown",
            "numbers must be 2..=6 and max_number 2..=1000",
        ));
    }
    let (count, max) = (a.numbers, a.max_number);
    let gen = Generated::new(
        "countdown",
        template(a.system_prompt, "Use every given number exactly once with + - * / and parentheses to reach the target. Put only the expression in <answer></answer> tags."),
        move |rng| loop {
            let nums: Vec<i64> = (0..count).map(|_| rng.random_range(1..=max)).collect();
            let mut value = nums[0];
            for &n in &nums[1..] {
                value = match rng.random_range(0..4) {
                    0 => value + n,
                    1 if value - n > 0 => value - n,
                    2 if value * n <= 1000 => value * n,
                    3 if value % n == 0 => value / n,
                    _ => value + n,
                };
            }
            if value <= 0 {
                continue;
            }
            let mut shown = nums.clone();
            shown.sort_unstable();
            let list = shown.iter().map(i64::to_string).collect::<Vec<_>>().join(", ");
            break Task {
                question: format!("Numbers: {list}. Target: {value}."),
                answer: value.to_string(),
                info: json!({"numbers": shown, "target": value}),
            };
        },
    );
    let rubric = Rubric::new(Parser::answer_tag())
        .with(Reward::new("correct", 1.0, |c: &RewardCtx<'_>| {
            let Some(expr) = c.parsed() else { return 0.0 };
            let numbers: Vec<i64> = c.info["numbers"]
                .as_array()
                .map(|a| a.iter().filter_map(Value::as_i64).collect())
                .unwrap_or_default();
            let target = c.info["target"].as_i64().unwrap_or(i64::MIN);
            f64::from(u8::from(countdown_valid(&expr, &numbers, target)))
        }))
        .with(Reward::format(0.0));
    Ok(Env::new(
        "countdown",
        Arc::new(gen),
        Harness::SingleTurn,
        rubric,
        defaults(50, 256),
    ))
}

/// `expr` uses exactly `numbers` (as a multiset), only arithmetic, and
/// equals `target`.
pub fn countdown_valid(expr: &str, numbers: &[i64], target: i64) -> bool {
    if !expr
        .chars()
        .all(|c| c.is_ascii_digit() || " +-*/()".contains(c))
    {
        return false;
    }
    let mut used: Vec<i64> = expr
        .split(|c: char| !c.is_ascii_digit())
        .filter(|s| !s.is_empty())
        .filter_map(|s| s.parse().ok())
        .collect();
    let mut want = numbers.to_vec();
    used.sort_unstable();
    want.sort_unstable();
    if used != want {
        return false;
    }
    math::evaluate(expr).is_some_and(|v| (v - target as f64).abs() < 1e-9)
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct CalculatorArgs {
    /// Digits per operand (the difficulty).
    #[serde(default = "four_u32")]
    digits: u32,
    /// Operands per question.
    #[serde(default = "three_usize")]
    terms: usize,
    #[serde(default)]
    system_prompt: Option<String>,
    /// Most model turns.
    #[serde(default = "five")]
    max_turns: usize,
}

fn four_u32() -> u32 {
    4
}
fn three_usize() -> usize {
    3
}
fn five() -> usize {
    5
}

/// Multi-operand arithmetic with a `calculate` tool. Reward: the right
/// number in `<answer>` tags; the number of tool calls is a metric.
pub(super) fn calculator_tools(args: &Value) -> Result<Env, EnvError> {
    let a: CalculatorArgs = parse_args("calculator-tools", args)?;
    if !(1..=6).contains(&a.digits) || !(2..=8).contains(&a.terms) || a.max_turns == 0 {
        return Err(bad(
            "calculator-tools",
            "digits must be 1..=6, terms 2..=8, max_turns ≥ 1",
        ));
    }
    let (digits, terms) = (a.digits, a.terms);
    let gen = Generated::new(
        "calculator-tools",
        template(a.system_prompt, "Use the calculate tool to compute exactly, then give the final number in <answer></answer> tags."),
        move |rng| {
            let mut expr = number_in_digits(rng, digits).to_string();
            for _ in 1..terms {
                let op = ["+", "-", "*"][rng.random_range(0..3)];
                expr = format!("{expr} {op} {}", number_in_digits(rng, digits));
            }
            let v = math::evaluate(&expr).unwrap_or(f64::NAN);
            Task {
                question: format!("What is {expr}?"),
                answer: format_number(v),
                info: json!({"expression": expr}),
            }
        },
    );
    let rubric = Rubric::new(Parser::answer_tag())
        .with(Reward::numeric_match(1.0).named("correct"))
        .with(Reward::new("tool_calls", 0.0, |c: &RewardCtx<'_>| {
            c.completion
                .iter()
                .filter_map(|m| m.tool_calls.as_ref())
                .map(Vec::len)
                .sum::<usize>() as f64
        }))
        .with(Reward::format(0.0));
    let harness = Harness::Tools {
        tools: vec![Arc::new(Calculator)],
        max_turns: a.max_turns,
        tool_timeout: Duration::from_secs(5),
    };
    Ok(Env::new(
        "calculator-tools",
        Arc::new(gen),
        harness,
        rubric,
        defaults(50, 256),
    ))
}
