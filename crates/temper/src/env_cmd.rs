//! `temper env`: scaffold and list environments; push, pull, search,
//! inspect and yank them on a hub.

use std::path::{Path, PathBuf};

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
    /// Pack an environment directory and publish it to the hub.
    Push {
        /// The environment directory (holds env.toml).
        #[arg(default_value = ".")]
        dir: PathBuf,
        /// Publish the next version: bumps the higher of env.toml's
        /// version and the hub's latest, and writes it to env.toml.
        #[arg(long, value_enum)]
        bump: Option<Bump>,
        /// Owner (default: env.toml's `namespace`).
        #[arg(long)]
        namespace: Option<String>,
        /// The hub (default: $TEMPER_HUB_URL, else `temper login`'s).
        #[arg(long)]
        hub: Option<String>,
    },
    /// Download an environment into the local cache and print its directory.
    Pull {
        /// `owner/name`, `owner/name@1.2.3` (exact) or `owner/name@^1` (range).
        reference: String,
        /// Ask the hub even if the cache holds a matching version.
        #[arg(long)]
        update: bool,
        /// The hub.
        #[arg(long)]
        hub: Option<String>,
        /// Refuse an archive over this many MiB (default: the hub's own
        /// default --max-package-mb).
        #[arg(long, default_value_t = crate::hub_cmd::DEFAULT_MAX_DOWNLOAD_MB)]
        max_download_mb: u64,
    },
    /// Search the hub (free text over names and descriptions).
    Search {
        /// Text to look for (empty: everything).
        #[arg(default_value = "")]
        text: String,
        /// Only environments with this tag.
        #[arg(long)]
        tag: Option<String>,
        /// The hub.
        #[arg(long)]
        hub: Option<String>,
    },
    /// An environment's versions and digests.
    Info {
        /// `owner/name`.
        reference: String,
        /// The hub.
        #[arg(long)]
        hub: Option<String>,
    },
    /// Hide a version from resolution (exact pulls still work).
    Yank {
        /// `owner/name@1.2.3`.
        reference: String,
        /// Un-yank.
        #[arg(long)]
        undo: bool,
        /// The hub.
        #[arg(long)]
        hub: Option<String>,
    },
    /// Delete one of your versions (its number is never reused).
    Delete {
        /// `owner/name@1.2.3`.
        reference: String,
        /// The hub.
        #[arg(long)]
        hub: Option<String>,
    },
}

/// Which part of the version `temper env push --bump` raises.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Bump {
    /// 1.2.3 -> 1.2.4
    Patch,
    /// 1.2.3 -> 1.3.0
    Minor,
    /// 1.2.3 -> 2.0.0
    Major,
}

fn hub_client(hub: Option<&str>) -> Result<temper_hub::HubClient> {
    crate::hub_cmd::client(hub)?
        .context("no hub: pass --hub URL, set TEMPER_HUB_URL, or run `temper login URL`")
}

fn exact_ref(reference: &str) -> Result<(temper_hub::EnvRef, String)> {
    let r = temper_hub::EnvRef::parse(reference)?;
    match &r.spec {
        temper_hub::VersionSpec::Exact(v) => {
            let v = v.to_string();
            Ok((r, v))
        }
        _ => bail!("{reference}: give an exact version (owner/name@1.2.3)"),
    }
}

/// Replace (or add) env.toml's top-level `version`, keeping the rest of
/// the file as written.
fn set_version(dir: &Path, version: &semver::Version) -> Result<()> {
    let path = dir.join("env.toml");
    let text =
        std::fs::read_to_string(&path).with_context(|| format!("read {}", path.display()))?;
    let mut done = false;
    let mut out = String::with_capacity(text.len() + 24);
    let mut top_level = true;
    for line in text.lines() {
        let t = line.trim_start();
        if t.starts_with('[') {
            top_level = false;
        }
        if top_level
            && !done
            && t.starts_with("version")
            && t["version".len()..].trim_start().starts_with('=')
        {
            out.push_str(&format!("version = \"{version}\"\n"));
            done = true;
        } else {
            out.push_str(line);
            out.push('\n');
        }
    }
    if !done {
        out = format!("version = \"{version}\"\n{out}");
    }
    std::fs::write(&path, out).with_context(|| format!("write {}", path.display()))
}

fn push(dir: &Path, bump: Option<Bump>, namespace: Option<&str>, hub: Option<&str>) -> Result<()> {
    let client = hub_client(hub)?;
    let rt = tokio::runtime::Runtime::new()?;
    if let Some(b) = bump {
        let m = temper_env::manifest::read_manifest(&dir.join("env.toml"))?;
        let ns = namespace
            .map(str::to_string)
            .or(m.namespace.clone())
            .context("env.toml has no `namespace` (or pass --namespace)")?;
        let mut base = match &m.version {
            Some(v) => {
                semver::Version::parse(v).with_context(|| format!("env.toml version {v:?}"))?
            }
            None => semver::Version::new(0, 0, 0),
        };
        match rt.block_on(client.info(&ns, &m.name)) {
            Ok(info) => {
                for v in info.versions {
                    if let Ok(v) = semver::Version::parse(&v.version) {
                        base = base.max(v);
                    }
                }
            }
            Err(temper_hub::HubError::NotFound(_)) => {}
            Err(e) => return Err(e.into()),
        }
        let next = match b {
            Bump::Patch => semver::Version::new(base.major, base.minor, base.patch + 1),
            Bump::Minor => semver::Version::new(base.major, base.minor + 1, 0),
            Bump::Major => semver::Version::new(base.major + 1, 0, 0),
        };
        set_version(dir, &next)?;
        eprintln!("env.toml: version = \"{next}\"");
    }
    let packed = temper_hub::pack_dir(dir, namespace)?;
    let (pb, progress) = crate::hub_cmd::bar(&format!(
        "push {}@{}",
        packed.manifest.id(),
        packed.manifest.version
    ));
    let out = rt.block_on(client.publish(&packed.manifest, packed.bytes, Some(progress)));
    pb.finish_and_clear();
    let v = out?;
    println!(
        "published {}/{}@{} {} ({} bytes)",
        v.namespace, v.name, v.version, v.digest, v.size
    );
    println!("  temper env pull {}/{}@{}", v.namespace, v.name, v.version);
    Ok(())
}

fn hub_command(cmd: EnvCommand) -> Result<()> {
    let rt = tokio::runtime::Runtime::new()?;
    match cmd {
        EnvCommand::Push {
            dir,
            bump,
            namespace,
            hub,
        } => push(&dir, bump, namespace.as_deref(), hub.as_deref()),
        EnvCommand::Pull {
            reference,
            update,
            hub,
            max_download_mb,
        } => {
            let r = temper_hub::EnvRef::parse(&reference)?;
            let c = crate::hub_cmd::pull(&r, hub.as_deref(), update, false, max_download_mb)?;
            eprintln!(
                "{}@{} {} ({})",
                c.id,
                c.version,
                c.digest,
                if c.from_cache { "cached" } else { "pulled" }
            );
            println!("{}", c.dir.display());
            Ok(())
        }
        EnvCommand::Search { text, tag, hub } => {
            let client = hub_client(hub.as_deref())?;
            let q = Some(text.as_str()).filter(|t| !t.trim().is_empty());
            let found = rt.block_on(client.search(q, tag.as_deref()))?;
            if found.is_empty() {
                println!("no environments match");
            }
            for p in found {
                println!(
                    "{:<32} {:<10} {}{}",
                    p.id,
                    p.latest.version,
                    p.latest.description,
                    if p.latest.tags.is_empty() {
                        String::new()
                    } else {
                        format!("  [{}]", p.latest.tags.join(", "))
                    }
                );
            }
            Ok(())
        }
        EnvCommand::Info { reference, hub } => {
            let r = temper_hub::EnvRef::parse(&reference)?;
            let client = hub_client(hub.as_deref())?;
            let info = rt.block_on(client.info(&r.namespace, &r.name))?;
            let l = &info.latest;
            println!("{}  {}", info.id, l.description);
            println!("latest   {}", l.version);
            println!("license  {}", l.license.as_deref().unwrap_or("-"));
            println!("tags     {}", l.tags.join(", "));
            println!("temper   {}", l.temper.as_deref().unwrap_or("any"));
            println!("versions:");
            for v in info.versions.iter().rev() {
                println!(
                    "  {:<10} {} {:>10} B  {}{}",
                    v.version,
                    v.digest,
                    v.size,
                    v.published_at,
                    if v.yanked { "  (yanked)" } else { "" }
                );
            }
            Ok(())
        }
        EnvCommand::Yank {
            reference,
            undo,
            hub,
        } => {
            let (r, v) = exact_ref(&reference)?;
            let client = hub_client(hub.as_deref())?;
            rt.block_on(client.yank(&r.namespace, &r.name, &v, !undo))?;
            println!(
                "{}@{v} {}",
                r.id(),
                if undo { "un-yanked" } else { "yanked" }
            );
            Ok(())
        }
        EnvCommand::Delete { reference, hub } => {
            let (r, v) = exact_ref(&reference)?;
            let client = hub_client(hub.as_deref())?;
            rt.block_on(client.delete(&r.namespace, &r.name, &v))?;
            println!("{}@{v} deleted", r.id());
            Ok(())
        }
        EnvCommand::New { .. } | EnvCommand::List => bail!("not a hub command"),
    }
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
        cmd @ (EnvCommand::Push { .. }
        | EnvCommand::Pull { .. }
        | EnvCommand::Search { .. }
        | EnvCommand::Info { .. }
        | EnvCommand::Yank { .. }
        | EnvCommand::Delete { .. }) => hub_command(cmd),
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
            for (file, text) in scaffold(&name, template, &name) {
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
    /// Single-turn, scored by a Python function (reward.py).
    PythonReward,
}

/// How the python-reward template's reward gets its libraries.
const PYTHON_REWARD_README: &str = r#"
## The reward

`reward.py`'s `correct` function scores each reply; `temper_reward.py`
beside it is the helper that connects it to temper (leave it as it is).
temper runs env.toml's `command` from this directory, so a reward that
needs a library runs under the interpreter that has it. With a virtualenv:

```sh
python3 -m venv .venv                 # in this directory
.venv/bin/pip install some-library
```

and in env.toml:

```toml
[[rubric]]
command = ".venv/bin/python reward.py"   # relative to this directory; an absolute path works too
function = "correct"
```

Test the reward without a model: `temper eval` fails before its first
rollout if the command does not start or has no such function.
"#;

/// The files of a new environment of shape `t`, named `name`; its README's
/// commands name it as `path` (relative to where they are run: `NAME` for
/// `temper env new`, `envs/NAME` in a `temper init` lab).
pub(crate) fn scaffold(name: &str, t: Template, path: &str) -> Vec<(&'static str, String)> {
    let fill = |text: &str| text.replace("{{name}}", name);
    let mut readme = format!(
        "# {name}\n\nA temper environment ({kind} template). Replace the TODO rows and the\n\
         description; docs/guide/environments.md explains every setting of\n\
         `env.toml` and how to write a reward in Python.\n\n\
         From the directory that holds `{path}`, with a model served on :8000\n\
         (`temper serve --model MODEL`):\n\n\
         ```sh\ntemper eval {path} -b http://127.0.0.1:8000/v1\n\
         temper view outputs/evals/{name}--MODEL/RUN_ID   # the run directory it printed\n```\n",
        kind = match t {
            Template::SingleTurn => "single-turn",
            Template::MultiTurn => "multi-turn",
            Template::Tools => "tools",
            Template::Json => "json",
            Template::Code => "code",
            Template::PythonReward => "python-reward",
        }
    );
    if t == Template::PythonReward {
        readme.push_str(PYTHON_REWARD_README);
    }
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
        Template::PythonReward => {
            let mut files = data(
                include_str!("templates/python-reward.toml"),
                include_str!("templates/single-turn.train.jsonl"),
                include_str!("templates/single-turn.eval.jsonl"),
            );
            files.push((
                "reward.py",
                fill(include_str!("templates/python-reward.py")),
            ));
            // The helper travels with the environment so it runs anywhere.
            files.push((
                "temper_reward.py",
                include_str!("../../../python/temper_reward.py").to_string(),
            ));
            files
        }
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
