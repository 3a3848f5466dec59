//! `temper init DIR`: a lab workspace — an environment (`temper env new`'s
//! single-turn template), an eval config, RL and SFT configs that point at
//! it, and a README with the next commands.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use clap::Args;

use crate::env_cmd::{check_name, scaffold, Template};

/// `temper init` flags.
#[derive(Args)]
pub struct InitArgs {
    /// The workspace directory (created; an existing one must be empty).
    dir: PathBuf,
    /// The environment's name (its directory: DIR/envs/NAME).
    #[arg(long = "env", default_value = "my-task")]
    env: String,
    /// The model to train (a GGUF file or a Hugging Face directory),
    /// written into the configs and the README; without it they say
    /// `path/to/model` and the README passes `--model.path`.
    #[arg(long)]
    model: Option<PathBuf>,
}

/// Placeholder for the model when `--model` is not given.
const NO_MODEL: &str = "path/to/model";

/// Run `temper init`.
pub fn run(a: InitArgs) -> Result<()> {
    check_name(&a.env)?;
    let model = match &a.model {
        Some(p) => p
            .canonicalize()
            .with_context(|| format!("--model {}", p.display()))?
            .display()
            .to_string(),
        None => NO_MODEL.to_string(),
    };
    if a.dir.exists() {
        let empty = std::fs::read_dir(&a.dir)
            .with_context(|| format!("read {}", a.dir.display()))?
            .next()
            .is_none();
        if !empty {
            bail!("{} exists and is not empty", a.dir.display());
        }
    }
    let env_dir = a.dir.join("envs").join(&a.env);
    std::fs::create_dir_all(&env_dir).with_context(|| format!("create {}", env_dir.display()))?;
    for (file, text) in scaffold(&a.env, Template::SingleTurn, &format!("envs/{}", a.env)) {
        write(&env_dir.join(file), &text)?;
    }
    for (file, text) in workspace_files(&a.env, &model, a.model.is_some()) {
        write(&a.dir.join(file), &text)?;
    }
    println!("created {}", a.dir.display());
    println!("next: {}", a.dir.join("README.md").display());
    Ok(())
}

fn write(path: &Path, text: &str) -> Result<()> {
    std::fs::write(path, text).with_context(|| format!("write {}", path.display()))
}

/// A TOML string literal (quoted and escaped).
fn toml_str(s: &str) -> String {
    toml::Value::String(s.to_string()).to_string()
}

/// The workspace's own files: configs, README, .gitignore.
fn workspace_files(env: &str, model: &str, model_given: bool) -> Vec<(&'static str, String)> {
    let env_id = toml_str(&format!("envs/{env}"));
    let model_path = toml_str(model);
    // Without --model the commands pass the model on the command line.
    let model_flag = if model_given {
        String::new()
    } else {
        " --model.path \"$MODEL\"".to_string()
    };
    let eval = format!(
        r#"# `temper eval --config eval.toml`, run from this directory: every key is
# a `temper eval` flag (long name, `_` for `-`); flags on the command line win.
env = {env_id}                     # a directory with env.toml, a built-in, or "python3 my_env.py"
base_url = "http://127.0.0.1:8000/v1"      # any OpenAI-compatible endpoint (temper serve, vLLM, ...)
# model = "NAME"                           # default: the endpoint's only model
# api_key_var = "OPENAI_API_KEY"           # the variable that holds the key, if the endpoint needs one
# The environment's env.toml [eval] sets num_examples, rollouts_per_example,
# max_tokens and temperature (one place); set one here, or as a flag, to
# override it for this lab:
# num_examples = 40
# rollouts_per_example = 4                 # for pass@k raise it AND temperature
max_concurrent = 32
save_dir = "outputs/evals"                 # runs land in outputs/evals/ENV--MODEL/RUN_ID
# sampling_args = {{ top_p = 0.95 }}
"#
    );
    let rl = format!(
        r#"# `temper train rl rl.toml`, run from this directory: RL on {env_id}.
# Any key can be overridden on the command line (`--trainer.lr 1e-4`);
# `--dry-run` checks the config and prints it resolved.
seed = 0

[model]
path = {model_path}   # a GGUF file or a Hugging Face directory (or --model.path)

[lora]
enabled = true
rank = 8
alpha = 16.0

[[env]]
id = {env_id}
weight = 1.0

[sampling]
temperature = 1.0
max_tokens = 64
group_size = 4              # rollouts per prompt: the advantage baseline

# The defaults below are the ones measured on SmolLM2-135M on a laptop CPU
# (examples/smollm2-rl/rl.toml).
[trainer]
loss = "importance_sampling"
lr = 5e-4
batch_size = 4              # prompts per optimizer step
micro_batch = 0             # all batch_size x group_size sequences in one forward_backward, so each
                            # prompt runs once (1.16 GB peak RSS on SmolLM2); N bounds memory on a big model
max_steps = 20

[async]
max_off_policy_steps = 0    # on-policy: each step samples with the weights it trains, so the
                            # sampler/trainer mismatch (mismatch/max) is measured on every step

[eval]
interval = 0                # held-out pass@1 before and after training
num_examples = 40           # held-out questions (at most eval.jsonl's rows): fewer make pass@1 noise

[ckpt]
interval = 10

[log]
dir = "runs/rl"             # metrics.jsonl, samples.jsonl, plots.html, adapter/
"#
    );
    let sft = format!(
        r#"# `temper train sft sft.toml`, run from this directory: supervised
# fine-tuning on {env_id}'s training rows, each row's `answer` written as
# the assistant's reply (or `[data] path = "chat.jsonl"`: your own chats).
seed = 0

[model]
path = {model_path}   # a GGUF file or a Hugging Face directory (or --model.path)

[lora]
enabled = true
rank = 8
alpha = 16.0

[data]
env = {{ id = {env_id} }}
answer_format = "<answer>{{answer}}</answer>"   # what the environment's parser reads

[trainer]
lr = 5e-4
batch_size = 4
max_steps = 20
max_seq_len = 512

[eval]
interval = 0                # held-out pass@1 of the environment before and after
num_examples = 4

[ckpt]
interval = 10

[log]
dir = "runs/sft"            # metrics.jsonl, plots.html, adapter/
"#
    );
    let model_sh = format!("'{}'", model.replace('\'', "'\\''"));
    let readme = format!(
        r#"# A temper workspace

- `envs/{env}/`: the environment (`env.toml`, `train.jsonl`, `eval.jsonl`).
  Replace its rows with your task; its README says how.
- `eval.toml`: `temper eval --config eval.toml` evaluates a served model on it.
- `sft.toml`, `rl.toml`: train a model on it (SFT on its reference answers; RL
  on its reward).

The next five commands, from this directory:

```sh
MODEL={model_sh}   # a GGUF file or a Hugging Face directory
temper serve --model "$MODEL" &                  # 1. the model behind an OpenAI-compatible API on :8000 (wait for "listening on")
temper eval --config eval.toml                   # 2. evaluate it on envs/{env}: summary + outputs/evals/...
temper view outputs/evals/{env}--MODEL/RUN_ID    # 3. the report (the run directory step 2 printed)
temper train sft sft.toml{model_flag}   # 4. SFT: runs/sft/ (metrics, plots, adapter)
temper train rl rl.toml{model_flag}     # 5. RL from the base model: runs/rl/
```

`temper train rl rl.toml --model.adapter runs/sft/adapter` starts RL from
the SFT adapter instead. Add `--dry-run` to a train command to check its
config without running it. Other environment shapes (multi-turn, tools,
JSON, code, a reward written in Python: python-reward):
`temper env new NAME --dir envs --template T`.
"#
    );
    vec![
        ("eval.toml", eval),
        ("rl.toml", rl),
        ("sft.toml", sft),
        ("README.md", readme),
        (".gitignore", "outputs/\nruns/\n".to_string()),
    ]
}
