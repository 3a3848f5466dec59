//! Wordle: guess a five-letter word in a few turns, with per-letter
//! feedback after each guess (multi-turn).

use std::sync::Arc;

use async_trait::async_trait;
use rand::seq::IndexedRandom;
use serde::Deserialize;
use serde_json::{json, Value};

use super::WORDS;
use crate::{
    parse_args, Env, EnvError, EnvResponder, EnvResponse, EvalDefaults, FieldSpec, Generated,
    Harness, Message, Parser, PromptTemplate, Reward, RewardCtx, Row, Rubric, SamplingArgs, Task,
};

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct WordleArgs {
    /// Guesses allowed (the difficulty).
    #[serde(default = "six")]
    max_turns: usize,
    /// Secrets are drawn from the first `vocab` words of the list.
    #[serde(default)]
    vocab: Option<usize>,
    #[serde(default)]
    system_prompt: Option<String>,
}

fn six() -> usize {
    6
}

/// Per-letter feedback: `G` right letter right place, `Y` in the word
/// elsewhere (counting repeats), `X` absent.
pub fn feedback(guess: &str, secret: &str) -> String {
    let g: Vec<char> = guess.chars().collect();
    let s: Vec<char> = secret.chars().collect();
    let mut out = vec!['X'; g.len()];
    let mut left: Vec<Option<char>> = s.iter().map(|&c| Some(c)).collect();
    for i in 0..g.len().min(s.len()) {
        if g[i] == s[i] {
            out[i] = 'G';
            left[i] = None;
        }
    }
    for i in 0..g.len() {
        if out[i] == 'G' {
            continue;
        }
        if let Some(slot) = left.iter_mut().find(|c| **c == Some(g[i])) {
            *slot = None;
            out[i] = 'Y';
        }
    }
    out.into_iter().collect()
}

fn guess_parser() -> Parser {
    Parser::Xml {
        fields: vec![FieldSpec::One("guess".into())],
        answer_field: "guess".into(),
    }
}

struct Game;

#[async_trait]
impl EnvResponder for Game {
    fn initial_state(&self, _row: &Row) -> Value {
        json!({"guesses": [], "solved": false, "best_greens": 0})
    }

    async fn respond(
        &self,
        row: &Row,
        messages: &[Message],
        state: &mut Value,
    ) -> Result<EnvResponse, String> {
        let secret = row.answer.as_deref().ok_or("row has no secret word")?;
        let guess = guess_parser()
            .parse_answer(messages)
            .map(|g| g.trim().to_lowercase());
        let Some(guess) =
            guess.filter(|g| g.len() == 5 && g.chars().all(|c| c.is_ascii_lowercase()))
        else {
            return Ok(EnvResponse {
                messages: vec![Message::user(
                    "Invalid guess: reply with a five-letter word in <guess></guess> tags.",
                )],
                done: false,
            });
        };
        let fb = feedback(&guess, secret);
        let greens = fb.chars().filter(|&c| c == 'G').count();
        if let Some(list) = state["guesses"].as_array_mut() {
            list.push(json!(guess));
        }
        let best = state["best_greens"]
            .as_u64()
            .unwrap_or(0)
            .max(greens as u64);
        state["best_greens"] = json!(best);
        if guess == secret {
            state["solved"] = json!(true);
            return Ok(EnvResponse {
                messages: vec![Message::user(format!("{guess}: {fb}. Correct!"))],
                done: true,
            });
        }
        Ok(EnvResponse {
            messages: vec![Message::user(format!("{guess}: {fb}. Guess again."))],
            done: false,
        })
    }
}

/// Wordle. Reward: solved (weight 1); greens of the best guess / 5 and
/// format are metrics.
pub(super) fn build(args: &Value) -> Result<Env, EnvError> {
    let a: WordleArgs = parse_args("wordle", args)?;
    let vocab = a.vocab.unwrap_or(WORDS.len());
    if !(5..=WORDS.len()).contains(&vocab) || !(1..=20).contains(&a.max_turns) {
        return Err(EnvError::BadArgs {
            env: "wordle".into(),
            message: format!("vocab must be 5..={} and max_turns 1..=20", WORDS.len()),
        });
    }
    let max_turns = a.max_turns;
    let system = a.system_prompt.unwrap_or_else(|| {
        format!("Guess the secret five-letter word in {max_turns} tries. Reply with one guess in <guess></guess> tags. Feedback per letter: G = right place, Y = elsewhere in the word, X = not in the word.")
    });
    // The question names the game by the secret's hash, so the split
    // (by question hash) puts each secret in exactly one of train / eval.
    let gen = Generated::new(
        "wordle",
        PromptTemplate {
            system_prompt: Some(system),
            few_shot: Vec::new(),
        },
        move |rng| {
            let secret = *WORDS[..vocab].choose(rng).unwrap_or(&"apple");
            Task {
                question: format!(
                    "Game #{}. Make your first guess.",
                    crate::stable_hash(secret.as_bytes()) % 10_000
                ),
                answer: secret.to_string(),
                info: json!({}),
            }
        },
    );
    let rubric = Rubric::new(guess_parser())
        .with(Reward::new("solved", 1.0, |c: &RewardCtx<'_>| {
            f64::from(u8::from(
                c.rollout.state["solved"].as_bool().unwrap_or(false),
            ))
        }))
        .with(Reward::new("best_greens", 0.0, |c: &RewardCtx<'_>| {
            c.rollout.state["best_greens"].as_f64().unwrap_or(0.0) / 5.0
        }))
        .with(Reward::format(0.0));
    let harness = Harness::MultiTurn {
        responder: Arc::new(Game),
        max_turns,
        max_total_tokens: None,
    };
    let defaults = EvalDefaults {
        num_examples: 20,
        rollouts_per_example: 1,
        sampling: SamplingArgs {
            max_tokens: 64,
            temperature: 0.7,
            ..SamplingArgs::default()
        },
        pass_threshold: None,
    };
    Ok(Env::new("wordle", Arc::new(gen), harness, rubric, defaults))
}

#[cfg(test)]
mod tests {
    use super::feedback;

    #[test]
    fn feedback_table() {
        for (guess, secret, want) in [
            ("crane", "crane", "GGGGG"),
            ("crane", "slate", "XXGXG"),
            ("apple", "paper", "YYGXY"),
            ("eerie", "paper", "YXYXX"),
            ("sheep", "peach", "XYYXY"),
            ("zzzzz", "apple", "XXXXX"),
        ] {
            assert_eq!(feedback(guess, secret), want, "{guess} vs {secret}");
        }
    }
}
