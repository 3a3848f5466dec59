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
        /// The shape of the environment.
        #[arg(long, value_enum, default_value = "single-turn")]
        template: Template,
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
        EnvCommand::New {
            name,
            dir,
            template,
        } => {
            check_name(&name)?;
            let root = dir.join(&name);
            if root.exists() {
                bail!("{} already exists", root.display());
            }
            std::fs::create_dir_all(&root).with_context(|| format!("create {}", root.display()))?;
            for (file, text) in scaffold(&name, template) {
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

/// Environment names are also directory names and TOML strings.
pub(crate) fn check_name(name: &str) -> Result<()> {
    let valid = !name.is_empty()
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_');
    if !valid {
        bail!("environment names use letters, digits, '-' and '_'");
    }
    Ok(())
}

/// The shapes `temper env new --template` writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Template {
    /// One prompt, one answer, exact-match reward.
    SingleTurn,
    /// A Python environment that replies to each answer (JSON lines).
    MultiTurn,
    /// Tool calls (a calculator) before the answer.
    Tools,
    /// A JSON answer checked against a schema.
    Json,
    /// Python code run against unit tests in the sandbox.
    Code,
}

/// The files of a new environment of shape `t`, named `name`.
pub(crate) fn scaffold(name: &str, t: Template) -> Vec<(&'static str, String)> {
    let fill = |text: &str| text.replace("{{name}}", name);
    let readme = format!(
        "# {name}\n\nA temper environment ({kind} template). Replace the TODO rows and the\n\
         description; the README section \"Writing an environment\" explains every\n\
         setting of `env.toml` and how to write a reward in Python.\n\n\
         ```sh\ntemper eval {name} -m MODEL -b http://127.0.0.1:8000/v1\n\
         temper view outputs/evals/{name}--MODEL/<run_id>\n```\n",
        kind = match t {
            Template::SingleTurn => "single-turn",
            Template::MultiTurn => "multi-turn",
            Template::Tools => "tools",
            Template::Json => "json",
            Template::Code => "code",
        }
    );
    let data = |toml: &str, train: &str, eval: &str| {
        vec![
            ("env.toml", fill(toml)),
            ("train.jsonl", train.to_string()),
            ("eval.jsonl", eval.to_string()),
        ]
    };
    let mut files = match t {
        Template::SingleTurn => data(
            include_str!("templates/single-turn.toml"),
            include_str!("templates/single-turn.train.jsonl"),
            include_str!("templates/single-turn.eval.jsonl"),
        ),
        Template::Tools => data(
            include_str!("templates/tools.toml"),
            include_str!("templates/tools.train.jsonl"),
            include_str!("templates/tools.eval.jsonl"),
        ),
        Template::Json => data(
            include_str!("templates/json.toml"),
            include_str!("templates/json.train.jsonl"),
            include_str!("templates/json.eval.jsonl"),
        ),
        Template::Code => data(
            include_str!("templates/code.toml"),
            include_str!("templates/code.train.jsonl"),
            include_str!("templates/code.eval.jsonl"),
        ),
        Template::MultiTurn => vec![
            ("env.toml", fill(include_str!("templates/multi-turn.toml"))),
            ("env.py", fill(include_str!("templates/multi-turn.py"))),
            // The helper travels with the environment so it runs anywhere.
            (
                "temper_env.py",
                include_str!("../../../python/temper_env.py").to_string(),
            ),
        ],
    };
    files.push(("README.md", readme));
    files
}
