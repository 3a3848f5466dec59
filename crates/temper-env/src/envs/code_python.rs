//! code-python: write a Python function; unit tests run in the sandbox
//! service (`POST /run_code`).

use std::sync::Arc;

use rand::Rng;
use rand_chacha::ChaCha8Rng;
use serde::Deserialize;
use serde_json::{json, Value};

use crate::rubric::{CodeTests, CodeTestsConfig};
use crate::{
    parse_args, Env, EnvError, EvalDefaults, Generated, Harness, Parser, PromptTemplate, Reward,
    Rubric, SamplingArgs, Task,
};

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct CodeArgs {
    /// 1 (one-liners) to 3 (loops and edge cases).
    #[serde(default = "one")]
    difficulty: u32,
    /// Sandbox service URL (default `$TEMPER_SANDBOX_URL`, else
    /// `http://127.0.0.1:8080`).
    #[serde(default)]
    sandbox_url: Option<String>,
    #[serde(default)]
    system_prompt: Option<String>,
}

fn one() -> u32 {
    1
}

fn task(question: String, tests: Vec<String>) -> Task {
    Task {
        answer: String::new(),
        question,
        info: json!({ "tests": tests }),
    }
}

fn py_list(xs: &[i64]) -> String {
    format!(
        "[{}]",
        xs.iter().map(i64::to_string).collect::<Vec<_>>().join(", ")
    )
}

/// A task of level ≤ `difficulty`, with tests whose expected values are
/// computed here.
fn generate(rng: &mut ChaCha8Rng, difficulty: u32) -> Task {
    let k: i64 = rng.random_range(2..=9);
    let kinds = match difficulty {
        1 => 3,
        2 => 5,
        _ => 7,
    };
    match rng.random_range(0..kinds) {
        0 => task(
            format!("Write a Python function `add_k(x)` that returns x + {k}."),
            [0, 5, -3]
                .iter()
                .map(|x| format!("assert add_k({x}) == {}", x + k))
                .collect(),
        ),
        1 => task(
            format!("Write a Python function `is_multiple(n)` that returns True when n is divisible by {k}, else False."),
            [k, k + 1, 0, 3 * k]
                .iter()
                .map(|n| format!("assert is_multiple({n}) is {}", if n % k == 0 { "True" } else { "False" }))
                .collect(),
        ),
        2 => task(
            format!("Write a Python function `repeat_str(s)` that returns the string s repeated {k} times."),
            ["ab", "", "x"]
                .iter()
                .map(|s| format!("assert repeat_str({s:?}) == {:?}", s.repeat(k as usize)))
                .collect(),
        ),
        3 => {
            let xs: Vec<i64> = (0..rng.random_range(3..7)).map(|_| rng.random_range(-20..20)).collect();
            let want: i64 = xs.iter().filter(|x| **x > k).sum();
            task(
                format!("Write a Python function `sum_above(xs)` that returns the sum of the numbers in list xs greater than {k}."),
                vec![
                    format!("assert sum_above({}) == {want}", py_list(&xs)),
                    "assert sum_above([]) == 0".into(),
                ],
            )
        }
        4 => task(
            "Write a Python function `count_vowels(s)` that returns how many characters of s are vowels (aeiou, either case).".into(),
            vec![
                "assert count_vowels('hello') == 2".into(),
                "assert count_vowels('') == 0".into(),
                "assert count_vowels('AEIOUxyz') == 5".into(),
            ],
        ),
        5 => {
            let xs: Vec<i64> = (0..rng.random_range(4..8)).map(|_| rng.random_range(0..50)).collect();
            let mut sorted = xs.clone();
            sorted.sort_unstable();
            sorted.dedup();
            let second = if sorted.len() >= 2 { sorted[sorted.len() - 2].to_string() } else { "None".into() };
            task(
                "Write a Python function `second_largest(xs)` that returns the second largest distinct number in list xs, or None if there is none.".into(),
                vec![
                    format!("assert second_largest({}) == {second}", py_list(&xs)),
                    "assert second_largest([1]) is None".into(),
                    "assert second_largest([3, 3]) is None".into(),
                ],
            )
        }
        _ => task(
            "Write a Python function `run_length(s)` that encodes s as a list of (char, count) tuples for runs of equal characters.".into(),
            vec![
                "assert run_length('aaab') == [('a', 3), ('b', 1)]".into(),
                "assert run_length('') == []".into(),
                format!("assert run_length('{}') == [('z', {k})]", "z".repeat(k as usize)),
            ],
        ),
    }
}

pub(super) fn build(args: &Value) -> Result<Env, EnvError> {
    let a: CodeArgs = parse_args("code-python", args)?;
    if !(1..=3).contains(&a.difficulty) {
        return Err(EnvError::BadArgs {
            env: "code-python".into(),
            message: "difficulty must be 1..=3".into(),
        });
    }
    let difficulty = a.difficulty;
    let gen = Generated::new(
        "code-python",
        PromptTemplate {
            system_prompt: Some(a.system_prompt.unwrap_or_else(|| {
                "Answer with the complete Python code in one ```python code block.".into()
            })),
            few_shot: Vec::new(),
        },
        move |rng| generate(rng, difficulty),
    );
    let tests = CodeTests::new(CodeTestsConfig {
        sandbox_url: a.sandbox_url,
        timeout_s: 10.0,
    })
    .map_err(|message| EnvError::BadArgs {
        env: "code-python".into(),
        message,
    })?;
    let rubric = Rubric::new(Parser::Plain).with(Reward::code_tests(1.0, tests));
    let defaults = EvalDefaults {
        num_examples: 20,
        rollouts_per_example: 1,
        sampling: SamplingArgs {
            max_tokens: 512,
            temperature: 0.0,
            ..SamplingArgs::default()
        },
        pass_threshold: None,
    };
    Ok(Env::new(
        "code-python",
        Arc::new(gen),
        Harness::SingleTurn,
        rubric,
        defaults,
    ))
}
