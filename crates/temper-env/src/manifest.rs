//! `env.toml`: environments that need no code, and file datasets (JSONL,
//! Parquet).
//!
//! ```toml
//! name = "capitals"
//! version = "0.1.0"
//! description = "Name the capital of a country."
//! system_prompt = "Answer in <answer></answer> tags."
//!
//! [dataset]
//! train = "train.jsonl"   # .jsonl or .parquet: rows with prompt or question, answer, info
//! eval = "eval.jsonl"     # optional: without it train rows are split by content hash; alone, all rows are held out
//! # generator = "arithmetic"   # or a built-in generator...
//! # args = { digits = 2 }      # ...with its arguments
//!
//! [[few_shot]]
//! question = "France?"
//! answer = "<answer>Paris</answer>"
//!
//! [harness]
//! type = "single-turn"    # or "tools" with tools = ["calculator", "python"], max_turns
//!
//! [parser]
//! type = "xml"
//! fields = ["answer"]
//! answer_field = "answer"
//!
//! [[rubric]]
//! function = "exact_match"
//! weight = 1.0
//!
//! [sandbox]              # optional: Python packages sandboxed code needs
//! requirements = ["pytest==8.3.4"]
//!
//! [eval]
//! num_examples = 10
//! rollouts_per_example = 1
//! max_tokens = 64
//! temperature = 0.0
//! pass_threshold = 1.0    # a rollout passes at reward ≥ this
//! ```
//!
//! Publishing to a hub (`temper env push`) reads four more keys:
//!
//! ```toml
//! namespace = "acme"          # the owner on the hub (or `temper env push --namespace`)
//! tags = ["math", "easy"]
//! license = "MIT"
//! temper = ">=0.1"           # the temper versions it needs (a semver requirement)
//! ```
//!
//! `command = "python3 env.py"` instead of a dataset makes it an external
//! environment ([`crate::external`]) run from the manifest's directory.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use rand::seq::SliceRandom;
use rand::SeedableRng;
use serde::Deserialize;
use serde_json::{Map, Value};

use crate::harness::{Calculator, PythonTool, Tool};
use crate::rubric::{build_rubric, RewardSpec};
use crate::{
    is_eval_question, stable_hash, Dataset, Env, EnvError, Environment, EvalDefaults, Harness,
    Message, Parser, PromptTemplate, Row, SamplingArgs, Split,
};

/// `env.toml` as written.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Manifest {
    /// Environment id.
    pub name: String,
    /// Version.
    #[serde(default)]
    pub version: Option<String>,
    /// One line on what it is.
    #[serde(default)]
    pub description: Option<String>,
    /// Owner on a hub.
    #[serde(default)]
    pub namespace: Option<String>,
    /// Search tags on a hub.
    #[serde(default)]
    pub tags: Vec<String>,
    /// License of the package (an SPDX id).
    #[serde(default)]
    pub license: Option<String>,
    /// The temper versions it needs (a semver requirement, `>=0.1`).
    #[serde(default)]
    pub temper: Option<String>,
    /// System prompt.
    #[serde(default)]
    pub system_prompt: Option<String>,
    /// External environment command (run from the manifest's directory).
    #[serde(default)]
    pub command: Option<String>,
    /// The rows.
    #[serde(default)]
    pub dataset: Option<DatasetSpec>,
    /// Few-shot examples.
    #[serde(default)]
    pub few_shot: Vec<FewShot>,
    /// The harness.
    #[serde(default)]
    pub harness: HarnessSpec,
    /// The parser.
    #[serde(default)]
    pub parser: Parser,
    /// Reward functions.
    #[serde(default)]
    pub rubric: Vec<RewardSpec>,
    /// Divide the reward (Σ weight · score) by Σ |weight|.
    #[serde(default)]
    pub normalize_reward: bool,
    /// What code run in the sandbox service needs.
    #[serde(default)]
    pub sandbox: SandboxSpec,
    /// Eval defaults.
    #[serde(default)]
    pub eval: EvalSpec,
}

/// `[dataset]`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DatasetSpec {
    /// Training rows file.
    #[serde(default)]
    pub train: Option<PathBuf>,
    /// Eval rows file.
    #[serde(default)]
    pub eval: Option<PathBuf>,
    /// A built-in generator instead of files.
    #[serde(default)]
    pub generator: Option<String>,
    /// The generator's arguments.
    #[serde(default)]
    pub args: Option<toml::Table>,
}

/// `[[few_shot]]`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FewShot {
    /// User turn.
    pub question: String,
    /// Assistant turn.
    pub answer: String,
}

/// `[harness]`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HarnessSpec {
    /// `single-turn` or `tools`.
    #[serde(rename = "type", default = "single_turn")]
    pub kind: String,
    /// Tools for `tools`: `calculator`, `python`.
    #[serde(default)]
    pub tools: Vec<String>,
    /// Most model turns.
    #[serde(default = "default_max_turns")]
    pub max_turns: usize,
    /// Seconds per tool call.
    #[serde(default = "default_tool_timeout")]
    pub tool_timeout_s: f64,
    /// Sandbox URL for the `python` tool.
    #[serde(default)]
    pub sandbox_url: Option<String>,
}

impl Default for HarnessSpec {
    fn default() -> Self {
        HarnessSpec {
            kind: single_turn(),
            tools: Vec::new(),
            max_turns: default_max_turns(),
            tool_timeout_s: default_tool_timeout(),
            sandbox_url: None,
        }
    }
}

fn single_turn() -> String {
    "single-turn".into()
}
fn default_max_turns() -> usize {
    8
}
fn default_tool_timeout() -> f64 {
    10.0
}

/// `[sandbox]`.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SandboxSpec {
    /// Python packages (pip requirement strings: a name, extras, version
    /// specifiers, markers) for every sandboxed reward and the `python`
    /// tool: the sandbox service builds a virtualenv with them once and
    /// caches it.
    #[serde(default)]
    pub requirements: Vec<String>,
}

/// `[eval]`.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EvalSpec {
    /// Examples.
    #[serde(default)]
    pub num_examples: Option<usize>,
    /// Rollouts per example.
    #[serde(default)]
    pub rollouts_per_example: Option<usize>,
    /// Completion tokens.
    #[serde(default)]
    pub max_tokens: Option<usize>,
    /// Temperature.
    #[serde(default)]
    pub temperature: Option<f64>,
    /// Top-p.
    #[serde(default)]
    pub top_p: Option<f64>,
    /// A rollout passes (pass@k, training's pass@1) at reward ≥ this.
    #[serde(default)]
    pub pass_threshold: Option<f64>,
}

impl EvalSpec {
    fn defaults(&self) -> EvalDefaults {
        let d = EvalDefaults::default();
        EvalDefaults {
            num_examples: self.num_examples.unwrap_or(d.num_examples),
            rollouts_per_example: self.rollouts_per_example.unwrap_or(1),
            sampling: SamplingArgs {
                max_tokens: self.max_tokens.unwrap_or(d.sampling.max_tokens),
                temperature: self.temperature.unwrap_or(0.0),
                top_p: self.top_p.unwrap_or(1.0),
                ..SamplingArgs::default()
            },
            pass_threshold: self.pass_threshold,
        }
    }
}

fn manifest_err(path: &Path, message: impl Into<String>) -> EnvError {
    EnvError::Manifest {
        path: path.display().to_string(),
        message: message.into(),
    }
}

/// Read and parse an `env.toml` file.
pub fn read_manifest(file: &Path) -> Result<Manifest, EnvError> {
    let text = std::fs::read_to_string(file).map_err(|source| EnvError::Io {
        path: file.display().to_string(),
        source,
    })?;
    toml::from_str(&text).map_err(|e| manifest_err(file, e.to_string()))
}

/// Load the environment described by `path` (a directory holding
/// `env.toml`, or the file itself). `args` override generator arguments,
/// or are handed to an external command.
pub fn load_manifest(path: &Path, args: &Value) -> Result<Arc<dyn Environment>, EnvError> {
    let file = if path.is_dir() {
        path.join("env.toml")
    } else {
        path.to_path_buf()
    };
    let dir = file.parent().map(Path::to_path_buf).unwrap_or_default();
    let m = read_manifest(&file)?;
    temper_sandbox::check_requirements(&m.sandbox.requirements)
        .map_err(|e| manifest_err(&file, format!("[sandbox] {e}")))?;
    if let Some(cmd) = &m.command {
        let env = crate::external::ExternalEnv::spawn(cmd, Some(&dir), args)?;
        return Ok(Arc::new(env));
    }
    let template = PromptTemplate {
        system_prompt: m.system_prompt.clone(),
        few_shot: m
            .few_shot
            .iter()
            .map(|f| (f.question.clone(), f.answer.clone()))
            .collect(),
    };
    let spec = m
        .dataset
        .clone()
        .ok_or_else(|| manifest_err(&file, "needs [dataset] or command"))?;
    let dataset: Arc<dyn Dataset> = if let Some(gen) = &spec.generator {
        let mut gen_args = match &spec.args {
            Some(t) => serde_json::to_value(t).map_err(|e| manifest_err(&file, e.to_string()))?,
            None => Value::Object(Map::new()),
        };
        if let (Some(obj), Some(extra)) = (gen_args.as_object_mut(), args.as_object()) {
            for (k, v) in extra {
                obj.insert(k.clone(), v.clone());
            }
        }
        let inner = crate::envs::builtin(gen, &gen_args)
            .ok_or_else(|| manifest_err(&file, format!("unknown generator `{gen}`")))??;
        Arc::new(Retemplated {
            inner: Arc::new(inner),
            template,
        })
    } else {
        let train = spec.train.as_ref().map(|p| dir.join(p));
        let eval = spec.eval.as_ref().map(|p| dir.join(p));
        if train.is_none() && eval.is_none() {
            return Err(manifest_err(
                &file,
                "[dataset] needs train, eval or generator",
            ));
        }
        Arc::new(FileDataset::new(train, eval, template)?)
    };
    let harness = match m.harness.kind.as_str() {
        "single-turn" => Harness::SingleTurn,
        "tools" => {
            let mut tools: Vec<Arc<dyn Tool>> = Vec::new();
            for t in &m.harness.tools {
                match t.as_str() {
                    "calculator" | "calculate" => tools.push(Arc::new(Calculator)),
                    "python" => {
                        let sandbox = crate::SandboxService::new(m.harness.sandbox_url.clone())
                            .map_err(|e| manifest_err(&file, e))?;
                        tools.push(Arc::new(
                            PythonTool::new(sandbox)
                                .with_requirements(m.sandbox.requirements.clone()),
                        ));
                    }
                    other => return Err(manifest_err(&file, format!("unknown tool `{other}` (calculator, python)"))),
                }
            }
            if tools.is_empty() {
                return Err(manifest_err(&file, "harness `tools` needs tools = [...]"));
            }
            Harness::Tools {
                tools,
                max_turns: m.harness.max_turns.max(1),
                tool_timeout: Duration::from_secs_f64(m.harness.tool_timeout_s.max(0.01)),
            }
        }
        other => {
            return Err(manifest_err(
                &file,
                format!("unknown harness `{other}` (single-turn, tools; multi-turn needs an external command)"),
            ))
        }
    };
    if m.rubric.is_empty() {
        return Err(manifest_err(&file, "needs at least one [[rubric]] entry"));
    }
    let mut rubric = build_rubric(
        m.parser.clone(),
        &m.rubric,
        &file.display().to_string(),
        Some(&dir),
        &m.sandbox.requirements,
    )?;
    rubric.normalize = m.normalize_reward;
    Ok(Arc::new(Env::new(
        m.name.clone(),
        dataset,
        harness,
        rubric,
        m.eval.defaults(),
    )))
}

/// A built-in generator's rows under the manifest's prompt template.
struct Retemplated {
    inner: Arc<Env>,
    template: PromptTemplate,
}

impl Dataset for Retemplated {
    fn rows(&self, split: Split, n: usize, seed: u64) -> Result<Vec<Row>, EnvError> {
        let mut rows = self.inner.rows(split, n, seed)?;
        for r in &mut rows {
            let q = r
                .prompt
                .iter()
                .rev()
                .find(|m| m.role == "user")
                .map(Message::text)
                .unwrap_or_default();
            r.prompt = self.template.messages(&q);
        }
        Ok(rows)
    }
}

/// Rows from JSONL or Parquet files.
pub struct FileDataset {
    train: Vec<Row>,
    eval: Vec<Row>,
}

impl FileDataset {
    /// Read the files now; with only a train file, rows are split by
    /// content hash; with only an eval file, all rows are eval rows.
    pub fn new(
        train: Option<PathBuf>,
        eval: Option<PathBuf>,
        template: PromptTemplate,
    ) -> Result<Self, EnvError> {
        let load = |p: &Option<PathBuf>| -> Result<Vec<Row>, EnvError> {
            match p {
                Some(p) => read_records(p)?
                    .into_iter()
                    .enumerate()
                    .map(|(i, rec)| {
                        record_to_row(rec, &template).map_err(|m| EnvError::Dataset {
                            path: p.display().to_string(),
                            message: format!("row {}: {m}", i + 1),
                        })
                    })
                    .collect(),
                None => Ok(Vec::new()),
            }
        };
        let (mut train_rows, mut eval_rows) = (load(&train)?, load(&eval)?);
        // An eval file alone is a benchmark: every row held out, none to
        // train on. A train file alone is split by content hash.
        if eval.is_none() {
            let all: Vec<Row> = train_rows.drain(..).chain(eval_rows.drain(..)).collect();
            for r in all {
                let key = serde_json::to_string(&r.prompt).unwrap_or_default();
                if is_eval_question(&key) {
                    eval_rows.push(r);
                } else {
                    train_rows.push(r);
                }
            }
        }
        Ok(FileDataset {
            train: train_rows,
            eval: eval_rows,
        })
    }
}

impl Dataset for FileDataset {
    /// Eval: the first `n` rows in file order. Train: `n` rows cycling
    /// through a seeded shuffle.
    fn rows(&self, split: Split, n: usize, seed: u64) -> Result<Vec<Row>, EnvError> {
        let mut out: Vec<Row> = match split {
            Split::Eval => self.eval.iter().take(n).cloned().collect(),
            Split::Train => {
                if self.train.is_empty() {
                    return Ok(Vec::new());
                }
                let mut rng =
                    rand_chacha::ChaCha8Rng::seed_from_u64(stable_hash(&seed.to_le_bytes()));
                let mut out = Vec::with_capacity(n);
                while out.len() < n {
                    let mut order: Vec<usize> = (0..self.train.len()).collect();
                    order.shuffle(&mut rng);
                    out.extend(
                        order
                            .into_iter()
                            .take(n - out.len())
                            .map(|i| self.train[i].clone()),
                    );
                }
                out
            }
        };
        for (i, r) in out.iter_mut().enumerate() {
            r.example_id = i as u64;
        }
        Ok(out)
    }
}

/// Records of a `.jsonl` or `.parquet` file as JSON objects.
pub fn read_records(path: &Path) -> Result<Vec<Value>, EnvError> {
    let derr = |m: String| EnvError::Dataset {
        path: path.display().to_string(),
        message: m,
    };
    let is_parquet = path.extension().is_some_and(|e| e == "parquet");
    if is_parquet {
        use parquet::file::reader::{FileReader, SerializedFileReader};
        let f = std::fs::File::open(path).map_err(|source| EnvError::Io {
            path: path.display().to_string(),
            source,
        })?;
        let reader = SerializedFileReader::new(f).map_err(|e| derr(e.to_string()))?;
        let iter = reader.get_row_iter(None).map_err(|e| derr(e.to_string()))?;
        let mut out = Vec::new();
        for row in iter {
            let row = row.map_err(|e| derr(e.to_string()))?;
            out.push(row.to_json_value());
        }
        return Ok(out);
    }
    let text = std::fs::read_to_string(path).map_err(|source| EnvError::Io {
        path: path.display().to_string(),
        source,
    })?;
    text.lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
        .map(|(i, l)| serde_json::from_str(l).map_err(|e| derr(format!("line {}: {e}", i + 1))))
        .collect()
}

/// A record (`prompt` or `question`, `answer`, `info`, other fields into
/// `info`) as a row.
fn record_to_row(rec: Value, template: &PromptTemplate) -> Result<Row, String> {
    let Value::Object(mut obj) = rec else {
        return Err("not a JSON object".into());
    };
    let prompt = match (obj.remove("prompt"), obj.remove("question")) {
        (Some(Value::Array(msgs)), _) => {
            let msgs: Vec<Message> =
                serde_json::from_value(Value::Array(msgs)).map_err(|e| format!("prompt: {e}"))?;
            let mut p = template.messages("");
            p.pop();
            p.extend(msgs);
            p
        }
        (Some(Value::String(q)), _) | (None, Some(Value::String(q))) => template.messages(&q),
        _ => return Err("needs `prompt` (messages) or `question` (string)".into()),
    };
    let answer = match obj.remove("answer") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => Some(s),
        Some(other) => Some(other.to_string()),
    };
    let mut info = match obj.remove("info") {
        Some(Value::Object(m)) => m,
        Some(Value::String(s)) => {
            serde_json::from_str::<Map<String, Value>>(&s).unwrap_or_default()
        }
        _ => Map::new(),
    };
    for (k, v) in obj {
        info.entry(k).or_insert(v);
    }
    Ok(Row {
        example_id: 0,
        prompt,
        answer,
        info: Value::Object(info),
    })
}
