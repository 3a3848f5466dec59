//! `temper env`: scaffold and list environments.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::Subcommand;

/// `temper env` subcommands.
#[derive(Subcommand)]
pub enum EnvCommand {
    /// Write a working environment directory (env.toml + data + README).
    New {
        /// Environment name (also the directory name).
        name: String,
        /// Parent directory.
        #[arg(long, default_value = ".")]
        dir: PathBuf,
    },
    /// List the built-in environments.
    List,
}

/// Run `temper env`.
pub fn run(cmd: EnvCommand) -> Result<()> {
    match cmd {
        EnvCommand::List => {
            for name in temper_env::BUILTIN_ENVS {
                println!("{name}");
            }
            Ok(())
        }
        EnvCommand::New { name, dir } => {
            let valid = !name.is_empty()
                && name
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_');
            if !valid {
                bail!("environment names use letters, digits, '-' and '_'");
            }
            let root = dir.join(&name);
            if root.exists() {
                bail!("{} already exists", root.display());
            }
            std::fs::create_dir_all(&root).with_context(|| format!("create {}", root.display()))?;
            for (file, text) in scaffold(&name) {
                std::fs::write(root.join(file), text).with_context(|| format!("write {file}"))?;
            }
            println!("created {}", root.display());
            println!(
                "try:  temper eval {} -m MODEL -b http://127.0.0.1:8000/v1",
                root.display()
            );
            Ok(())
        }
    }
}

/// The files of a new environment: unit conversions, math-equivalence
/// reward, `<answer>` format metric.
fn scaffold(name: &str) -> Vec<(&'static str, String)> {
    let toml = format!(
        r#"# A temper environment: dataset + harness + rubric (+ parser).
name = "{name}"
version = "0.1.0"
description = "Unit conversions, answered as a number."
system_prompt = "Answer with just the number in <answer></answer> tags."

[dataset]
train = "train.jsonl"
eval = "eval.jsonl"

[[few_shot]]
question = "How many minutes are in 2 hours?"
answer = "<answer>120</answer>"

[harness]
type = "single-turn"

[parser]
type = "xml"
fields = ["answer"]
answer_field = "answer"

[[rubric]]
function = "math_equiv"
weight = 1.0
name = "correct"

[[rubric]]
function = "format"
weight = 0.0

[eval]
num_examples = 8
rollouts_per_example = 2
max_tokens = 64
temperature = 0.0
"#
    );
    let rows = |items: &[(&str, &str)]| -> String {
        items
            .iter()
            .map(|(q, a)| serde_json::json!({"question": q, "answer": a}).to_string() + "\n")
            .collect()
    };
    let train = rows(&[
        ("How many seconds are in 3 minutes?", "180"),
        ("How many centimetres are in 4 metres?", "400"),
        ("How many grams are in 2.5 kilograms?", "2500"),
        ("How many hours are in 3 days?", "72"),
        ("How many millimetres are in 7 centimetres?", "70"),
        ("How many minutes are in 1.5 hours?", "90"),
        ("How many metres are in 3 kilometres?", "3000"),
        ("How many days are in 5 weeks?", "35"),
    ]);
    let eval = rows(&[
        ("How many seconds are in 5 minutes?", "300"),
        ("How many centimetres are in 2 metres?", "200"),
        ("How many grams are in 4 kilograms?", "4000"),
        ("How many hours are in 2 days?", "48"),
        ("How many minutes are in 4 hours?", "240"),
        ("How many metres are in 1.5 kilometres?", "1500"),
        ("How many days are in 3 weeks?", "21"),
        ("What fraction of an hour is 15 minutes?", "1/4"),
    ]);
    let readme = format!(
        "# {name}\n\nA temper environment: unit conversions answered in `<answer></answer>` tags,\n\
         rewarded by math equivalence (so `1/4`, `0.25` and `\\frac{{1}}{{4}}` all count).\n\n\
         - `env.toml`: dataset, harness, parser, rubric, eval defaults.\n\
         - `train.jsonl`, `eval.jsonl`: one row per line: `question` (or `prompt` messages), `answer`, optional `info`.\n\n\
         ```sh\ntemper eval {name} -m MODEL -b http://127.0.0.1:8000/v1\ntemper view outputs/evals/{name}--MODEL/<run_id>\n```\n"
    );
    vec![
        ("env.toml", toml),
        ("train.jsonl", train),
        ("eval.jsonl", eval),
        ("README.md", readme),
    ]
}
