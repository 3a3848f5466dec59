//! `temper train rl|sft|dpo`, `temper quickstart` and `temper generate-sft`.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use clap::{Args, Subcommand};
use temper_model::Numerics;
use temper_rl::config::{self, DpoConfig, RlConfig, SftConfig};
use temper_rl::quickstart::{quickstart, QuickstartOptions};
use temper_rl::rl::{run_rl, RunOptions};
use temper_rl::sft::run_sft;
use temper_rl::{DpoPlan, RlPlan, SftPlan};

/// Training commands.
#[derive(Subcommand)]
pub enum TrainCommand {
    /// Async RL on one or more environments (config keys: docs/reference/config.md).
    Rl(TrainArgs),
    /// Supervised fine-tuning on chat data (loss on assistant tokens).
    Sft(TrainArgs),
    /// Direct preference optimisation on chosen/rejected pairs (TRL's
    /// formats), or on pairs sampled online from an environment.
    Dpo(TrainArgs),
}

/// A config file plus dotted-key overrides.
#[derive(Args)]
pub struct TrainArgs {
    /// The TOML config (with --resume: optional; the run's saved config is used).
    config: Option<PathBuf>,
    /// Print the resolved config and exit (`train rl` also loads the
    /// environments and checks the services they call: sandbox, judge).
    #[arg(long)]
    dry_run: bool,
    /// Continue the run in this directory from its latest checkpoint.
    #[arg(long, value_name = "RUN_DIR")]
    resume: Option<PathBuf>,
    /// Overrides: `--section.key VALUE` (e.g. `--trainer.lr 1e-4`,
    /// `--env.0.args.digits 2`).
    #[arg(
        trailing_var_arg = true,
        allow_hyphen_values = true,
        value_name = "OVERRIDES"
    )]
    overrides: Vec<String>,
}

struct Resolved<T> {
    cfg: T,
    resume: bool,
    dry_run: bool,
}

fn resolve<T: serde::de::DeserializeOwned + serde::Serialize>(
    args: &TrainArgs,
    numerics: Numerics,
    set_dir: impl Fn(&mut T, PathBuf),
) -> Result<Resolved<T>> {
    // Flags written after an override land in the trailing list.
    let mut words = Vec::new();
    let mut dry_run = args.dry_run;
    let mut resume = args.resume.clone();
    let mut it = args.overrides.iter();
    while let Some(w) = it.next() {
        match w.as_str() {
            "--dry-run" => dry_run = true,
            "--resume" => resume = it.next().map(PathBuf::from),
            _ => words.push(w.clone()),
        }
    }
    let overrides = config::parse_overrides(&words)?;
    let (path, resuming) = match (&args.config, &resume) {
        (_, Some(dir)) => (
            args.config
                .clone()
                .unwrap_or_else(|| dir.join("config.toml")),
            true,
        ),
        (Some(p), None) => (p.clone(), false),
        (None, None) => bail!("give a config file (or --resume RUN_DIR)"),
    };
    // `--dtype` and `TEMPER_MATMUL` are the defaults of the model's numerics
    // that a config leaves unset (a local teacher's follow the model's).
    let defaults = [
        ("model.dtype".into(), numerics.precision.to_string()),
        ("model.matmul".into(), numerics.matmul.as_str().into()),
    ];
    let mut cfg: T = config::load_with(&path, &defaults, &overrides)?;
    if let Some(dir) = resume {
        set_dir(&mut cfg, dir);
    }
    Ok(Resolved {
        cfg,
        resume: resuming,
        dry_run,
    })
}

fn runtime() -> Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("cannot start the async runtime")
}

/// `12.5%`, or `-` without an evaluation.
fn pass_at_1(e: &Option<temper_rl::rl::EvalResult>) -> String {
    e.as_ref()
        .map_or("-".to_string(), |e| format!("{:.1}%", 100.0 * e.pass_at_1))
}

/// A hub reference in `[[env]] id` is pulled; `id` becomes the pulled
/// directory and `package` records reference, version and digest in the
/// run's saved config (a resumed run uses exactly that version).
fn pull_env(e: &mut config::EnvSection) -> Result<()> {
    let (id, package) = crate::hub_cmd::resolve_env(&e.id, e.package.as_ref())?;
    e.id = id;
    e.package = package;
    Ok(())
}

/// Run a training command.
pub fn run(cmd: TrainCommand, numerics: Numerics) -> Result<()> {
    match cmd {
        TrainCommand::Rl(args) => {
            let mut r = resolve::<RlConfig>(&args, numerics, |c, d| c.log.dir = d)?;
            for e in &mut r.cfg.env {
                pull_env(e)?;
            }
            let s = &r.cfg.sampling;
            if let Some(w) = temper_env::greedy_group_warning(s.group_size, s.temperature) {
                eprintln!("warning: [sampling] {w}");
            }
            // Every check happens here, so a dry run reports what a run would.
            let plan = RlPlan::try_from(r.cfg)?;
            if r.dry_run {
                print!("{}", plan.config().dry_run()?);
                // The environments as a run loads them, and every service
                // they call (sandbox, judge), before anything trains.
                let services = runtime()?.block_on(temper_rl::rl::preflight(&plan))?;
                for s in services {
                    eprintln!("ok: {s}");
                }
                return Ok(());
            }
            let c = plan.config();
            let finish = Finish::of(&c.model, &c.lora, &c.eval, c.env.first());
            let out = runtime()?.block_on(run_rl(
                plan,
                RunOptions {
                    resume: r.resume,
                    stop_after: None,
                },
            ))?;
            println!(
                "done: {} steps; held-out pass@1 {} -> {}",
                out.steps,
                pass_at_1(&out.eval_before),
                pass_at_1(&out.eval_after)
            );
            finish.print(&out.output, &out.run_dir, out.eval_after.as_ref());
            Ok(())
        }
        TrainCommand::Sft(args) => {
            let mut r = resolve::<SftConfig>(&args, numerics, |c, d| c.log.dir = d)?;
            if let Some(e) = &mut r.cfg.data.env {
                pull_env(e)?;
            }
            let plan = SftPlan::try_from(r.cfg)?;
            if r.dry_run {
                print!("{}", plan.config().dry_run()?);
                return Ok(());
            }
            let dir = plan.log.dir.clone();
            let c = plan.config();
            let finish = Finish::of(&c.model, &c.lora, &c.eval, c.data.env.as_ref());
            let out = runtime()?.block_on(run_sft(
                plan,
                RunOptions {
                    resume: r.resume,
                    stop_after: None,
                },
            ))?;
            let eval = match (&out.eval_before, &out.eval_after) {
                (None, None) => String::new(),
                (before, after) => format!(
                    "; held-out pass@1 {} -> {}",
                    pass_at_1(before),
                    pass_at_1(after)
                ),
            };
            println!(
                "done: {} steps; last loss {:.4}{eval}",
                out.steps, out.final_loss
            );
            finish.print(&out.output, &dir, out.eval_after.as_ref());
            Ok(())
        }
        TrainCommand::Dpo(args) => {
            let mut r = resolve::<DpoConfig>(&args, numerics, |c, d| c.log.dir = d)?;
            if let Some(e) = &mut r.cfg.data.env {
                pull_env(e)?;
            }
            let plan = DpoPlan::try_from(r.cfg)?;
            if r.dry_run {
                print!("{}", plan.config().dry_run()?);
                return Ok(());
            }
            let dir = plan.log.dir.clone();
            let c = plan.config();
            let env = c.data.env.as_ref();
            let finish = Finish::of(&c.model, &c.lora, &c.eval, env);
            let out = runtime()?.block_on(temper_rl::dpo::run_dpo(
                plan,
                RunOptions {
                    resume: r.resume,
                    stop_after: None,
                },
            ))?;
            let get = |m: &serde_json::Map<String, serde_json::Value>, k: &str| {
                m.get(k).and_then(|v| v.as_f64()).unwrap_or(f64::NAN)
            };
            let heldout = match (&out.heldout_before, &out.heldout_after) {
                (Some(b), Some(a)) => format!(
                    "; held-out pairs: accuracy {:.2} -> {:.2}, loss {:.4} -> {:.4}",
                    get(b, "eval/rewards/accuracies"),
                    get(a, "eval/rewards/accuracies"),
                    get(b, "eval/loss"),
                    get(a, "eval/loss"),
                ),
                _ => String::new(),
            };
            let eval = match (&out.eval_before, &out.eval_after) {
                (None, None) => String::new(),
                (before, after) => format!(
                    "; held-out pass@1 {} -> {}",
                    pass_at_1(before),
                    pass_at_1(after)
                ),
            };
            println!(
                "done: {} steps; last loss {:.4}, reward accuracy {:.2}{heldout}{eval}",
                out.steps,
                get(&out.last, "loss"),
                get(&out.last, "rewards/accuracies"),
            );
            finish.print(&out.output, &dir, out.eval_after.as_ref());
            Ok(())
        }
    }
}

/// What a finished run (RL or SFT) prints after its `done:` line, taken
/// from the plan before the run consumes it.
struct Finish {
    base: Option<PathBuf>,
    lora: bool,
    /// `temper eval`'s environment argument(s) for the held-out env.
    env: Option<String>,
}

impl Finish {
    fn of(
        model: &config::ModelSection,
        lora: &config::LoraSection,
        eval: &config::EvalSection,
        train_env: Option<&config::EnvSection>,
    ) -> Self {
        Finish {
            base: model.path.clone(),
            lora: lora.enabled,
            env: eval_env_cmd(
                eval.env.as_ref(),
                eval.args.as_ref(),
                train_env.map(|e| (&e.id, &e.args)),
            ),
        }
    }

    /// Where the run's outputs are, then the commands that use them.
    fn print(
        &self,
        output: &Path,
        run_dir: &Path,
        last_eval: Option<&temper_rl::eval::EvalResult>,
    ) {
        println!("  weights:  {}", output.display());
        println!("  metrics:  {}", run_dir.join("metrics.jsonl").display());
        println!("  plots:    {}", run_dir.join("plots.html").display());
        print!(
            "{}",
            next_commands(
                self.base.as_deref(),
                self.lora,
                output,
                run_dir,
                self.env.as_deref(),
                last_eval.map(|e| e.dir.as_path()),
            )
        );
    }
}

/// `ENV [-a 'ARGS']` of `temper eval` for the run's held-out environment:
/// `[eval] env` (its `args`, else the training env's when it is the same
/// one), else the training environment with its arguments.
fn eval_env_cmd(
    eval_env: Option<&String>,
    eval_args: Option<&serde_json::Value>,
    train: Option<(&String, &serde_json::Value)>,
) -> Option<String> {
    let (id, args) = match (eval_env, train) {
        (Some(e), Some((t, a))) if e == t => (e, eval_args.unwrap_or(a)),
        (Some(e), _) => (e, eval_args.unwrap_or(&serde_json::Value::Null)),
        (None, Some((t, a))) => (t, eval_args.unwrap_or(a)),
        (None, None) => return None,
    };
    let empty = args.is_null() || args.as_object().is_some_and(|m| m.is_empty());
    Some(if empty {
        id.clone()
    } else {
        // Single quotes for the shell; a quote inside is closed and escaped.
        format!("{id} -a '{}'", args.to_string().replace('\'', "'\\''"))
    })
}

/// What a finished run prints last: the commands that serve, evaluate and
/// export what it trained, with the run's real paths (issue 39: a user
/// should not have to work them out from the docs).
fn next_commands(
    base: Option<&Path>,
    lora: bool,
    output: &Path,
    run_dir: &Path,
    env: Option<&str>,
    last_eval: Option<&Path>,
) -> String {
    use std::fmt::Write as _;
    let mut t = String::from("\nnext:\n");
    if !output.exists() {
        // A remote trainer's weights stay on the service (a `tinker://`
        // path): nothing local to serve or export.
        let _ = writeln!(
            t,
            "  the weights are on the training service: {} (fetch them with its client to serve or export them here)",
            output.display()
        );
        if let Some(dir) = last_eval {
            let _ = writeln!(t, "  temper view {}", dir.display());
        }
        return t;
    }
    let serve = match (lora, base) {
        (true, Some(b)) => Some(format!(
            "temper serve --model {} --lora policy={}",
            b.display(),
            output.display()
        )),
        (true, None) => None,
        (false, _) => Some(format!("temper serve --model {}", output.display())),
    };
    // The adapter is served as `policy`; a full model is the endpoint's
    // only model, which `temper eval` picks by itself.
    let model = if lora { " -m policy" } else { "" };
    if let Some(serve) = serve {
        let _ = writeln!(t, "  {serve}    # serve it (OpenAI-compatible, port 8000)");
        if let Some(env) = env {
            let _ = writeln!(
                t,
                "  temper eval {env}{model} -b http://127.0.0.1:8000/v1    # evaluate it there"
            );
        }
    }
    let _ = writeln!(
        t,
        "  temper export {} --format gguf --out {}    # for llama.cpp / Ollama",
        run_dir.display(),
        run_dir.join("model.gguf").display()
    );
    if let (true, Some(b)) = (lora, base.filter(|b| temper_model::is_gguf(b))) {
        // The adapter names its GGUF base by path, which PEFT cannot load:
        // give PEFT a Hugging Face copy of the base and an adapter naming it.
        let hf = run_dir.join("base-hf");
        let _ = writeln!(
            t,
            "  temper export {} --format hf --out {} && temper export {} --format peft --base {1} --out {}    # for PEFT / transformers (they cannot load a GGUF base)",
            b.display(),
            hf.display(),
            run_dir.display(),
            run_dir.join("adapter-hf").display()
        );
    }
    if let Some(dir) = last_eval {
        let _ = writeln!(
            t,
            "  temper view {}    # the last held-out evaluation, rollout by rollout",
            dir.display()
        );
    }
    t
}

/// `temper quickstart` options.
#[derive(Args)]
pub struct QuickstartArgs {
    /// Output directory (replaced).
    #[arg(long, default_value = "runs/quickstart")]
    dir: PathBuf,
    /// SFT warm-up steps.
    #[arg(long)]
    sft_steps: Option<u64>,
    /// RL steps.
    #[arg(long)]
    rl_steps: Option<u64>,
    /// Held-out examples per evaluation.
    #[arg(long)]
    eval_examples: Option<usize>,
    /// Fraction of SFT answers that are near misses (the simulated teacher's error rate).
    #[arg(long)]
    teacher_noise: Option<f64>,
    /// Seed.
    #[arg(long, default_value_t = 0)]
    seed: u64,
}

/// Run the quickstart and print what it measured.
pub fn run_quickstart(args: QuickstartArgs, numerics: Numerics) -> Result<()> {
    let d = QuickstartOptions::default();
    let o = QuickstartOptions {
        dir: args.dir,
        sft_steps: args.sft_steps.unwrap_or(d.sft_steps),
        rl_steps: args.rl_steps.unwrap_or(d.rl_steps),
        eval_examples: args.eval_examples.unwrap_or(d.eval_examples),
        teacher_noise: args.teacher_noise.unwrap_or(d.teacher_noise),
        seed: args.seed,
        numerics,
        ..d
    };
    let r = runtime()?.block_on(quickstart(&o))?;
    let (sft_s, rl_s, total) = r.seconds;
    println!();
    println!(
        "before RL: pass@1 {:.1}%  (the SFT model; {} greedy answers to {} distinct held-out questions)",
        100.0 * r.before.pass_at_1,
        r.before.n,
        r.before.distinct
    );
    println!(
        "after RL:  pass@1 {:.1}%  ({:+.1} points)",
        100.0 * r.after.pass_at_1,
        100.0 * (r.after.pass_at_1 - r.before.pass_at_1)
    );
    println!("time: SFT {sft_s:.0}s, RL {rl_s:.0}s, total {total:.0}s");
    println!();
    println!("  SFT model:  {}", r.sft_model.display());
    println!("  adapter:    {}", r.rl_dir.join("adapter").display());
    println!("  metrics:    {}", r.rl_dir.join("metrics.jsonl").display());
    println!("  plots:      {}", r.rl_dir.join("plots.html").display());
    println!("  evals:      {}", r.rl_dir.join("evals").display());
    println!();
    println!("next:");
    println!(
        "  temper serve --model {} --lora policy={}",
        r.sft_model.display(),
        r.rl_dir.join("adapter").display()
    );
    println!(
        "  temper train rl {}          # the RL run's full config; edit and rerun",
        r.rl_dir.join("config.toml").display()
    );
    println!("  temper view {}", r.after.dir.display());
    Ok(())
}

/// `temper generate-sft` options.
#[derive(Args)]
pub struct GenerateSftArgs {
    /// `results.jsonl` files (or eval run directories) from `temper eval`.
    #[arg(required = true)]
    results: Vec<PathBuf>,
    /// Keep rollouts with at least this reward.
    #[arg(long, default_value_t = 1.0)]
    min_reward: f64,
    /// Output chat JSONL (for `temper train sft`'s `[data] path`).
    #[arg(short, long)]
    output: PathBuf,
}

/// Write successful rollouts as an SFT dataset.
pub fn generate_sft(args: GenerateSftArgs) -> Result<()> {
    let mut out = String::new();
    let (mut kept, mut read) = (0, 0);
    for r in &args.results {
        let path = if r.is_dir() {
            r.join("results.jsonl")
        } else {
            r.clone()
        };
        let (rows, n) = temper_rl::sft::successful_rollouts(&path, args.min_reward)?;
        read += n;
        kept += rows.len();
        for row in rows {
            out.push_str(&row.to_string());
            out.push('\n');
        }
    }
    temper_rl::runlog::write_atomic(&args.output, out.as_bytes())?;
    println!(
        "kept {kept} of {read} rollouts with reward >= {} -> {}",
        args.min_reward,
        args.output.display()
    );
    Ok(())
}

#[cfg(test)]
mod next_tests {
    use super::{eval_env_cmd, next_commands};
    use std::path::Path;

    /// A remote trainer's weights are a `tinker://` path on the service:
    /// no serve or export command that could not work is printed.
    #[test]
    fn remote_weights_get_no_local_commands() {
        let t = next_commands(
            Some(Path::new("model")),
            true,
            Path::new("tinker://sess-1:train:0/weights/step-000002"),
            Path::new("runs/rl"),
            Some("arithmetic"),
            None,
        );
        assert!(
            t.contains("on the training service: tinker://sess-1"),
            "{t}"
        );
        assert!(
            !t.contains("temper serve") && !t.contains("temper export"),
            "{t}"
        );
    }

    /// An adapter trained on a GGUF base names the `.gguf` file, which
    /// PEFT cannot load: the next commands include the two exports that
    /// give PEFT a Hugging Face base and an adapter naming it; a Hugging
    /// Face base or a full-weight run gets no such line.
    #[test]
    fn gguf_base_gets_the_peft_route() {
        let d = tempfile::tempdir().unwrap();
        let gguf = d.path().join("base.gguf");
        std::fs::write(&gguf, b"GGUF\x03\0\0\0").unwrap();
        let adapter = d.path().join("adapter");
        std::fs::create_dir(&adapter).unwrap();
        let t = next_commands(
            Some(&gguf),
            true,
            &adapter,
            Path::new("runs/sft"),
            None,
            None,
        );
        assert!(
            t.contains(&format!(
                "temper export {} --format hf --out runs/sft/base-hf && temper export runs/sft --format peft --base runs/sft/base-hf --out runs/sft/adapter-hf",
                gguf.display()
            )),
            "{t}"
        );
        let t = next_commands(
            Some(&gguf),
            false,
            &adapter,
            Path::new("runs/sft"),
            None,
            None,
        );
        assert!(!t.contains("--format peft"), "{t}");
        let t = next_commands(
            Some(d.path()),
            true,
            &adapter,
            Path::new("runs/sft"),
            None,
            None,
        );
        assert!(!t.contains("--format peft"), "{t}");
    }

    use serde_json::json;

    /// The printed `temper eval` names the held-out environment with the
    /// arguments the run used, quoted for the shell.
    #[test]
    fn eval_env_cmd_carries_the_runs_env_args() {
        let id = "verifiers:x".to_string();
        let args = json!({"agent": {"harness": {"id": "null"}}});
        assert_eq!(
            eval_env_cmd(None, None, Some((&id, &args))).unwrap(),
            r#"verifiers:x -a '{"agent":{"harness":{"id":"null"}}}'"#
        );
        let none = json!(null);
        assert_eq!(eval_env_cmd(None, None, Some((&id, &none))).unwrap(), id);
        let other = "arithmetic".to_string();
        let eargs = json!({"digits": 2});
        assert_eq!(
            eval_env_cmd(Some(&other), Some(&eargs), Some((&id, &args))).unwrap(),
            r#"arithmetic -a '{"digits":2}'"#
        );
        assert_eq!(
            eval_env_cmd(Some(&other), None, Some((&id, &args))).unwrap(),
            other
        );
        let quote = json!({"q": "it's"});
        assert_eq!(
            eval_env_cmd(None, None, Some((&id, &quote))).unwrap(),
            r#"verifiers:x -a '{"q":"it'\''s"}'"#
        );
        assert_eq!(eval_env_cmd(None, None, None), None);
    }
}
