//! [`Environment`]: the trait, and [`Env`], the composition of dataset,
//! harness and rubric that every built-in and `env.toml` environment is.

use std::sync::Arc;
use std::time::Instant;

use async_trait::async_trait;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use serde_json::Value;

use crate::{
    ChatModel, EnvError, EvalDefaults, Harness, Message, Rollout, Row, Rubric, SamplingArgs, Score,
    Service, Split,
};

/// An environment: rows to prompt with, a way to roll out, a way to score.
#[async_trait]
pub trait Environment: Send + Sync {
    /// Its name (`arithmetic`, the manifest's `name`, ...).
    fn id(&self) -> &str;
    /// `n` rows of `split`, deterministic in `seed`. Train and eval rows
    /// never overlap. It may block (reading files, or an external
    /// environment's reply over a pipe): from async code call it inside
    /// `tokio::task::spawn_blocking`.
    fn rows(&self, split: Split, n: usize, seed: u64) -> Result<Vec<Row>, EnvError>;
    /// One rollout of `row`; failures are recorded on the rollout.
    async fn rollout(&self, model: &dyn ChatModel, row: &Row, sampling: &SamplingArgs) -> Rollout;
    /// Scores for the rollouts of one row, in order.
    async fn score_group(&self, row: &Row, rollouts: &[Rollout]) -> Vec<Score>;
    /// What `temper eval` runs by default.
    fn eval_defaults(&self) -> EvalDefaults;
    /// The largest reward a rollout can get, when the rubric knows it.
    fn max_reward(&self) -> Option<f64> {
        None
    }
    /// The services its rollouts and rewards call (the sandbox service, a
    /// judge's endpoint), for [`crate::check_services`] before a run.
    fn services(&self) -> Vec<Arc<dyn Service>> {
        Vec::new()
    }
}

/// The reward at which a rollout passes (pass@k, RL's `pass@1`), and why.
#[derive(Debug, Clone, PartialEq)]
pub struct PassThreshold {
    /// Rollouts with reward ≥ this pass.
    pub value: f64,
    /// Set when the threshold was not configured and the rubric's maximum
    /// exceeds 1: a line to show the user once.
    pub notice: Option<String>,
}

/// The pass threshold of `env`: what the user configured, else the
/// environment's `[eval] pass_threshold`, else 1 — or the rubric's maximum
/// when that exceeds 1 (a sum of an answer reward and a format reward
/// would otherwise count a wrong answer in the right format as a pass).
pub fn pass_threshold(configured: Option<f64>, env: &dyn Environment) -> PassThreshold {
    if let Some(value) = configured.or(env.eval_defaults().pass_threshold) {
        return PassThreshold {
            value,
            notice: None,
        };
    }
    match env.max_reward() {
        Some(max) if max > 1.0 + 1e-9 => PassThreshold {
            value: max,
            notice: Some(format!(
                "{}: the rubric's maximum reward is {max} and no pass threshold is set, so a rollout passes at reward ≥ {max} (set [eval] pass_threshold in env.toml, or --pass-threshold, to change it)",
                env.id()
            )),
        },
        _ => PassThreshold {
            value: 1.0,
            notice: None,
        },
    }
}

/// Where rows come from.
pub trait Dataset: Send + Sync {
    /// `n` rows of `split` for `seed`.
    fn rows(&self, split: Split, n: usize, seed: u64) -> Result<Vec<Row>, EnvError>;
}

/// One generated task: the question text, the reference answer, task data.
#[derive(Debug, Clone, PartialEq)]
pub struct Task {
    /// User message text.
    pub question: String,
    /// Reference answer.
    pub answer: String,
    /// Task data for harness and rubric.
    pub info: Value,
}

/// The prompt shape shared by built-in and manifest environments: an
/// optional system prompt, few-shot pairs, then the question.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PromptTemplate {
    /// System message (`None` or empty = none).
    pub system_prompt: Option<String>,
    /// (question, answer) pairs shown as user / assistant turns.
    pub few_shot: Vec<(String, String)>,
}

impl PromptTemplate {
    /// The prompt messages for `question`.
    pub fn messages(&self, question: &str) -> Vec<Message> {
        let mut out = Vec::with_capacity(2 + 2 * self.few_shot.len());
        if let Some(s) = self.system_prompt.as_deref().filter(|s| !s.is_empty()) {
            out.push(Message::system(s));
        }
        for (q, a) in &self.few_shot {
            out.push(Message::user(q.clone()));
            out.push(Message::assistant(a.clone()));
        }
        out.push(Message::user(question));
        out
    }
}

/// FNV-1a: a hash that stays the same across Rust versions and machines,
/// for split assignment and seeds.
pub fn stable_hash(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in bytes {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

/// Whether a question belongs to the eval split: one in five by content
/// hash, so no question is ever in both splits.
pub fn is_eval_question(question: &str) -> bool {
    stable_hash(question.as_bytes()).is_multiple_of(5)
}

/// A procedural dataset: unlimited seeded tasks from a generator; the
/// split is decided by [`is_eval_question`], so the two never overlap.
pub struct Generated {
    name: String,
    template: PromptTemplate,
    generate: Arc<dyn Fn(&mut ChaCha8Rng) -> Task + Send + Sync>,
}

impl Generated {
    /// A dataset named `name` (salts the seed) from `generate`.
    pub fn new(
        name: impl Into<String>,
        template: PromptTemplate,
        generate: impl Fn(&mut ChaCha8Rng) -> Task + Send + Sync + 'static,
    ) -> Self {
        Generated {
            name: name.into(),
            template,
            generate: Arc::new(generate),
        }
    }
}

impl Dataset for Generated {
    fn rows(&self, split: Split, n: usize, seed: u64) -> Result<Vec<Row>, EnvError> {
        let salt = format!("{}/{}/{seed}", self.name, split.as_str());
        let mut rng = ChaCha8Rng::seed_from_u64(stable_hash(salt.as_bytes()));
        let mut rows = Vec::with_capacity(n);
        let mut misses = 0usize;
        while rows.len() < n {
            let task = (self.generate)(&mut rng);
            if is_eval_question(&task.question) != (split == Split::Eval) {
                misses += 1;
                if misses > 10_000 + 100 * n {
                    return Err(EnvError::BadArgs {
                        env: self.name.clone(),
                        message: format!(
                            "the task space is too small to fill the {} split",
                            split.as_str()
                        ),
                    });
                }
                continue;
            }
            rows.push(Row {
                example_id: rows.len() as u64,
                prompt: self.template.messages(&task.question),
                answer: Some(task.answer),
                info: task.info,
            });
        }
        Ok(rows)
    }
}

/// Dataset + harness + rubric: the environment every built-in and every
/// `env.toml` builds.
pub struct Env {
    id: String,
    dataset: Arc<dyn Dataset>,
    harness: Harness,
    rubric: Rubric,
    defaults: EvalDefaults,
}

impl Env {
    /// Compose an environment.
    pub fn new(
        id: impl Into<String>,
        dataset: Arc<dyn Dataset>,
        harness: Harness,
        rubric: Rubric,
        defaults: EvalDefaults,
    ) -> Self {
        Env {
            id: id.into(),
            dataset,
            harness,
            rubric,
            defaults,
        }
    }

    /// The rubric.
    pub fn rubric(&self) -> &Rubric {
        &self.rubric
    }

    /// The harness.
    pub fn harness(&self) -> &Harness {
        &self.harness
    }
}

#[async_trait]
impl Environment for Env {
    fn id(&self) -> &str {
        &self.id
    }
    fn rows(&self, split: Split, n: usize, seed: u64) -> Result<Vec<Row>, EnvError> {
        self.dataset.rows(split, n, seed)
    }
    async fn rollout(&self, model: &dyn ChatModel, row: &Row, sampling: &SamplingArgs) -> Rollout {
        self.harness.run(model, row, sampling).await
    }
    async fn score_group(&self, row: &Row, rollouts: &[Rollout]) -> Vec<Score> {
        self.rubric.score_group(row, rollouts).await
    }
    fn eval_defaults(&self) -> EvalDefaults {
        self.defaults.clone()
    }
    fn max_reward(&self) -> Option<f64> {
        self.rubric.max_reward()
    }
    fn services(&self) -> Vec<Arc<dyn Service>> {
        let mut out = self.harness.services();
        out.extend(self.rubric.services());
        out
    }
}

/// Score a group and fill each rollout's `timing.scoring_ms`: the time
/// the rubric spent on that rollout where it measured it, else the group's
/// scoring time over its size (shared by the evaluator and trainers).
pub async fn score_and_time(
    env: &dyn Environment,
    row: &Row,
    rollouts: &mut [Rollout],
) -> Vec<Score> {
    let t = Instant::now();
    let scores = env.score_group(row, rollouts).await;
    let share_ms = t.elapsed().as_secs_f64() * 1e3 / rollouts.len().max(1) as f64;
    for (i, r) in rollouts.iter_mut().enumerate() {
        let ms = scores.get(i).and_then(|s| s.scoring_ms).unwrap_or(share_ms);
        r.timing.scoring_ms = ms;
        r.timing.total_ms = r.timing.generation_ms + ms;
    }
    scores
}

/// Deserialize environment arguments (a JSON object, `null` = defaults)
/// into `T`, naming the environment in the error.
pub fn parse_args<T: serde::de::DeserializeOwned>(env: &str, args: &Value) -> Result<T, EnvError> {
    let v = if args.is_null() {
        Value::Object(Default::default())
    } else {
        args.clone()
    };
    serde_json::from_value(v).map_err(|e| EnvError::BadArgs {
        env: env.to_string(),
        message: e.to_string(),
    })
}
