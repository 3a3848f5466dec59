//! `temper serve --learn CONFIG.toml`: the served model learns from its own
//! traffic, in the serving process. Clients opt in per episode
//! (`POST /v1/episodes {"train": true}`) and post a reward
//! (`POST /v1/episodes/ID/reward`); the server stores those episodes
//! durably (temper-server's `feedback`). Every `trainer.batch_size` new
//! rewarded episodes (or every `learn.interval_minutes`), the learner:
//!
//! 1. turns them into training data exactly as `temper train rl` does —
//!    the captured token ids and logprobs become the policy's turns
//!    ([`TokenTrace`]s), advantages are group-relative over episodes that
//!    share a prompt and relative to a baseline of recent rewards where
//!    they do not, [`TrainTurns`] makes the datums, [`train_step`] trains
//!    (the mismatch on tokens the live version sampled is reported; it is 0);
//! 2. evaluates the candidate on the held-out `[eval] env` (RL's
//!    [`Evaluator`]);
//! 3. promotes it (temper-server's `versions`: kept on disk, served live) if
//!    its `learn.metric` is not worse than the live version's by more than
//!    `learn.margin`; otherwise keeps it aside under `candidates/` with the
//!    reason, and the trainer returns to the live version's weights.
//!
//! Every decision is a line of `learn.jsonl` in the state directory. The
//! learner's own progress (`learner.json`: which stored episodes it has
//! consumed) is written after each decision, so a kill repeats at most the
//! step in flight. Training and evaluation take at most `learn.duty_cycle`
//! of wall time (the learner idles in proportion after each round), so
//! serving keeps the CPU most of the time.

use std::collections::{BTreeMap, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use temper_engine::Trainer;
use temper_env::{Message, ModelTurn, Rollout, Row, Score, TokenTrace};
use temper_rl::advantage::group_advantages;
use temper_rl::config::{
    EnvSection, EvalSection, LogSection, LoraSection, ModelSection, RlConfig, RlTrainerSection,
    SamplingSection,
};
use temper_rl::datum::TrainTurns;
use temper_rl::dpo::PrefPair;
use temper_rl::eval::{EvalResult, Evaluator};
use temper_rl::policy::{Batcher, EnginePolicy, Renderer};
use temper_rl::runlog::{MetricsLog, RunRecord};
use temper_rl::sampled::Group;
use temper_rl::step::train_step;
use temper_rl::RlPlan;
use temper_server::openai::capture::CaptureRecord;
use temper_server::openai::feedback::{RewardLimits, StoredEpisode};
use temper_server::openai::versions::write_atomic;
use temper_server::openai::{EpisodeRubric, Learning, OpenAiState};

/// `[learn]`: how the server learns.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LearnSection {
    /// The state directory: rewarded episodes, promoted versions,
    /// candidates, `learn.jsonl`.
    pub dir: PathBuf,
    /// The adapter name the live version is served under (clients put it
    /// in `model`).
    pub adapter_name: String,
    /// Also train every this many minutes when fewer than
    /// `trainer.batch_size` new episodes are waiting (at least one); 0: off.
    pub interval_minutes: f64,
    /// `pass@1` or `reward`: the held-out number the gate compares.
    pub metric: String,
    /// A candidate goes live unless its metric is below the live version's
    /// by more than this (negative: it must beat it by that much).
    pub margin: f64,
    /// Recent rewards whose mean is the baseline of an episode whose
    /// prompt no other episode of its batch shares.
    pub baseline_window: usize,
    /// Most rewarded episodes stored (the oldest go first).
    pub max_episodes: usize,
    /// Most MiB of stored episodes.
    pub max_mib: usize,
    /// Largest share (0..=1] of wall time training and evaluating may take.
    pub duty_cycle: f64,
    /// Threads training and evaluating run on: the learner's own thread
    /// pool, apart from serving's, so it never occupies more than this many
    /// cores. 0: half the cores (at least 1).
    pub threads: usize,
    /// The OS priority (nice, 0..=19) of the learner's threads on Linux:
    /// where serving and learning want the same core, the scheduler gives
    /// serving's threads (nice 0) the larger share (10: ~90%, 19: ~98%;
    /// on SmolLM2, 19 keeps serving's p50/p99 within 5% of no learning).
    pub nice: i32,
    /// Rejected candidates kept on disk (older ones are deleted).
    pub keep_rejected: usize,
    /// An environment (as `[eval] env`: a built-in name, a directory with
    /// `env.toml`, ...) whose rubric the server runs on an episode's
    /// conversation when a client posts `{"rubric": {"answer": ...}}` as
    /// its reward. None: clients post rewards themselves.
    pub rubric: Option<String>,
    /// The rubric environment's arguments.
    pub rubric_args: Option<Value>,
    /// What a learning step trains: `rl` (every rewarded episode, with
    /// group-relative or baseline advantages) or `dpo` (pairs of episodes
    /// that answered the same prompt and got different rewards: the
    /// better answer chosen, the worse rejected; DPO's loss against the
    /// live version's weights).
    pub objective: String,
    /// DPO's β (`objective = "dpo"`).
    pub dpo_beta: f64,
    /// Most tokens per held-out answer.
    pub eval_max_tokens: usize,
}

impl Default for LearnSection {
    fn default() -> Self {
        Self {
            dir: PathBuf::from("runs/learn"),
            adapter_name: "live".into(),
            interval_minutes: 0.0,
            metric: "pass@1".into(),
            margin: 0.0,
            baseline_window: 64,
            max_episodes: 10_000,
            max_mib: 256,
            duty_cycle: 0.5,
            threads: 0,
            nice: 19,
            keep_rejected: 8,
            eval_max_tokens: 64,
            rubric: None,
            rubric_args: None,
            objective: "rl".into(),
            dpo_beta: 0.1,
        }
    }
}

/// The `--learn` config file: `temper train rl`'s `[lora]`, `[trainer]`
/// (`batch_size`: rewarded episodes per step; `max_steps`: most learning
/// steps) and `[eval]` (`env` is required: the gate's held-out
/// environment), and `[learn]`. The base model is `temper serve --model`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields, default)]
pub struct LearnConfig {
    /// LoRA init and evaluation seeds.
    pub seed: u64,
    /// The adapter trained.
    pub lora: LoraSection,
    /// The optimiser and loss.
    pub trainer: RlTrainerSection,
    /// The gate's held-out evaluation.
    pub eval: EvalSection,
    /// Learning from use.
    pub learn: LearnSection,
}

/// A checked learning config: the RL plan its sections make, and `[learn]`.
pub struct LearnPlan {
    rl: RlPlan,
    learn: LearnSection,
    limits: RewardLimits,
}

impl LearnPlan {
    /// Reads and checks `path`; `model` is the served model, whose
    /// numerics (`--dtype`, `TEMPER_MATMUL`) the learner trains with too.
    pub fn load(path: &Path, model: &Path, numerics: temper_model::Numerics) -> Result<Self> {
        let cfg: LearnConfig = temper_rl::config::load(path, &[])?;
        let l = &cfg.learn;
        let Some(env) = cfg.eval.env.clone() else {
            bail!(
                "{}: [eval] env is required (the gate's held-out environment)",
                path.display()
            );
        };
        if cfg.eval.num_examples == 0 {
            bail!("[eval] num_examples must be >= 1: the gate needs a held-out score");
        }
        if !cfg.lora.enabled {
            bail!("[lora] enabled must be true: the server hot-swaps LoRA adapters");
        }
        if !matches!(l.metric.as_str(), "pass@1" | "reward") {
            bail!("learn.metric {:?}: use \"pass@1\" or \"reward\"", l.metric);
        }
        if !(l.duty_cycle > 0.0 && l.duty_cycle <= 1.0) {
            bail!("learn.duty_cycle must be in (0, 1], got {}", l.duty_cycle);
        }
        if !matches!(l.objective.as_str(), "rl" | "dpo") {
            bail!("learn.objective {:?}: use \"rl\" or \"dpo\"", l.objective);
        }
        if !(l.dpo_beta.is_finite() && l.dpo_beta > 0.0) {
            bail!("learn.dpo_beta must be > 0, got {}", l.dpo_beta);
        }
        if !(0..=19).contains(&l.nice) {
            bail!("learn.nice must be in 0..=19, got {}", l.nice);
        }
        if !(l.margin.is_finite() && l.interval_minutes.is_finite() && l.interval_minutes >= 0.0) {
            bail!("learn.margin must be finite and learn.interval_minutes >= 0");
        }
        if l.adapter_name.is_empty() || l.max_episodes == 0 || l.max_mib == 0 {
            bail!("learn.adapter_name must be set and learn.max_episodes, learn.max_mib >= 1");
        }
        let rl = RlConfig {
            seed: cfg.seed,
            model: ModelSection {
                path: Some(model.to_path_buf()),
                dtype: Some(numerics.precision.to_string()),
                matmul: Some(numerics.matmul.as_str().into()),
                ..Default::default()
            },
            lora: cfg.lora.clone(),
            env: vec![EnvSection {
                id: env,
                weight: 1.0,
                args: cfg.eval.args.clone().unwrap_or_else(|| json!({})),
                package: None,
            }],
            sampling: SamplingSection {
                max_tokens: l.eval_max_tokens,
                ..Default::default()
            },
            trainer: cfg.trainer.clone(),
            eval: cfg.eval.clone(),
            log: LogSection {
                dir: l.dir.clone(),
                progress: false,
                samples: 0,
                tensorboard: false,
            },
            ..Default::default()
        };
        let rl = RlPlan::try_from(rl).with_context(|| path.display().to_string())?;
        Ok(Self {
            limits: RewardLimits {
                max_episodes: l.max_episodes,
                max_bytes: l.max_mib.saturating_mul(1 << 20),
            },
            learn: cfg.learn,
            rl,
        })
    }

    /// Opens the server's learning state (rewarded episodes, versions)
    /// with the `[learn] rubric` environment loaded.
    pub fn open_state(&self) -> Result<Learning> {
        let mut state = Learning::open(&self.learn.dir, &self.learn.adapter_name, self.limits)
            .with_context(|| format!("learning state in {}", self.learn.dir.display()))?;
        if let Some(spec) = &self.learn.rubric {
            let args = self.learn.rubric_args.clone().unwrap_or(Value::Null);
            let env = temper_tasks::loader()
                .load(spec, &args)
                .with_context(|| format!("learn.rubric {spec:?}"))?;
            state.rubric = Some(Arc::new(EnvRubric { env }));
        }
        Ok(state)
    }

    /// The state directory.
    pub fn dir(&self) -> &Path {
        &self.learn.dir
    }

    /// The adapter name the live version is served under.
    pub fn adapter_name(&self) -> &str {
        &self.learn.adapter_name
    }
}

/// `learner.json`: what the learner has consumed.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
struct Progress {
    /// The next stored episode to train on.
    cursor: u64,
    /// The next candidate number (a promoted candidate keeps it as its
    /// version).
    next_candidate: u64,
    /// Learning steps taken.
    steps: u64,
    /// Recent rewards (the baseline), newest last.
    recent: VecDeque<f64>,
}

/// `versions/vN/meta.json`: what a promoted version is.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct VersionMeta {
    version: u64,
    parent: Option<u64>,
    /// The trainer state of these weights (with the optimizer's).
    state_path: String,
    eval: EvalResult,
    /// Stored episodes trained on: `[first n, last n]`.
    episodes: Option<[u64; 2]>,
    created: u64,
}

/// The learner of a learning server.
pub struct Learner {
    plan: LearnPlan,
    server: OpenAiState,
    learning: Learning,
    trainer: Arc<dyn Trainer>,
    renderer: Renderer,
    batcher: Batcher,
    evaluator: Evaluator,
    progress: Progress,
    /// The version the trainer's weights are.
    trained_from: u64,
    /// `metrics.jsonl`: one record per decision, so `temper view DIR`
    /// charts the learning server like a training run.
    metrics: MetricsLog,
    /// `run.json`: running while the server learns.
    run: Option<RunRecord>,
}

fn now_secs() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

fn read_json<T: serde::de::DeserializeOwned>(path: &Path) -> Result<T> {
    let bytes = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    serde_json::from_slice(&bytes).with_context(|| format!("parsing {}", path.display()))
}

fn write_json<T: Serialize>(path: &Path, v: &T) -> Result<()> {
    let text = serde_json::to_vec_pretty(v)?;
    write_atomic(path, &text).with_context(|| format!("writing {}", path.display()))
}

impl Learner {
    /// Loads the trainer and the eval environment, and makes sure a
    /// version is live: on a fresh state directory the untrained adapter
    /// (identical outputs to the base model) is evaluated and promoted as
    /// version 1; otherwise the trainer resumes the live version.
    pub async fn start(plan: LearnPlan, server: OpenAiState) -> Result<Self> {
        let learning = server
            .learning()
            .cloned()
            .context("the server was not started with learning state")?;
        let dir = plan.learn.dir.clone();
        let (threads, nice) = (plan.learn.threads, plan.learn.nice);
        let (model, seed, run_dir) = (plan.rl.model.clone(), plan.rl.seed, dir.clone());
        let (base, trainer) = tokio::task::spawn_blocking(move || -> Result<_> {
            let engine = temper_engine::Engine::on_pool(learner_pool(threads, nice)?);
            Ok(temper_rl::open_trainer::local_trainer_on(
                &model, seed, &run_dir, engine,
            )?)
        })
        .await??;
        let trainer: Arc<dyn Trainer> = trainer;
        let renderer = Renderer::new(base)?;
        let batcher = Batcher::spawn(trainer.clone());
        let evaluator = Evaluator::for_rl(&plan.rl)
            .await?
            .context("[eval] names no environment")?;
        let progress_path = dir.join("learner.json");
        let mut progress: Progress = if progress_path.exists() {
            read_json(&progress_path)?
        } else {
            Progress::default()
        };
        // Never reuse a number a version or candidate already has.
        let mut taken = learning.versions.list()?;
        taken.extend(candidate_numbers(&dir)?);
        let floor = taken.into_iter().max().map_or(1, |m| m + 1);
        progress.next_candidate = progress.next_candidate.max(floor);
        // What `temper view` reads of a run: its config (model, held-out
        // environment, max_steps), run.json, metrics.jsonl (a step
        // recorded past learner.json's, from a kill, is dropped).
        write_atomic(
            &dir.join("config.toml"),
            temper_rl::config::to_toml(plan.rl.config())?.as_bytes(),
        )?;
        let run = Some(RunRecord::start(&dir, "learn")?);
        let metrics = MetricsLog::open(&dir, Some(progress.steps))?;
        let mut me = Self {
            plan,
            server,
            learning,
            trainer,
            renderer,
            batcher,
            evaluator,
            progress,
            trained_from: 0,
            metrics,
            run,
        };
        match me.learning.versions.live() {
            Some(v) => {
                let meta: VersionMeta =
                    read_json(&me.learning.versions.dir_of(v).join("meta.json"))?;
                me.trainer.load_state(&meta.state_path, true).await?;
                me.trained_from = v;
                eprintln!(
                    "learn: resuming version {v} ({} {:.3}); {} rewarded episodes stored, {} trained on",
                    me.plan.learn.metric,
                    me.metric(&meta.eval),
                    me.learning.rewards.size()?.0,
                    me.progress.cursor
                );
            }
            None => me.promote_initial().await?,
        }
        Ok(me)
    }

    /// Version 1: the untrained adapter, evaluated (the gate's first bar).
    async fn promote_initial(&mut self) -> Result<()> {
        let c = self.progress.next_candidate;
        let staged = self.stage(c).await?;
        let eval = self.evaluate(c).await?;
        eprintln!(
            "learn: version {c} (untrained adapter): {}",
            eval.before_line().trim()
        );
        let meta = VersionMeta {
            version: c,
            parent: None,
            state_path: staged.1,
            eval,
            episodes: None,
            created: now_secs(),
        };
        write_json(&staged.0.join("meta.json"), &meta)?;
        let (server, dir) = (self.server.clone(), staged.0.clone());
        tokio::task::spawn_blocking(move || server.promote(&dir, c, None))
            .await?
            .map_err(|e| anyhow::anyhow!("promoting version {c}: {e}"))?;
        self.trained_from = c;
        self.progress.next_candidate = c + 1;
        write_json(&self.plan.learn.dir.join("learner.json"), &self.progress)?;
        self.log(json!({"event": "promoted", "version": c, "parent": null,
            "eval": self.summary(&meta.eval), "reason": "the untrained adapter: the first live version"}))?;
        if self.progress.steps == 0 {
            self.record(json!({"step": 0, "event": "promoted", "candidate": c,
                "eval/pass@1": meta.eval.pass_at_1, "eval/reward": meta.eval.reward,
                "live/version": c, "live/pass@1": meta.eval.pass_at_1}))?;
        }
        Ok(())
    }

    /// Writes the trainer's weights as candidate `c`: its directory (with
    /// `adapter/`) and its trainer state's path.
    async fn stage(&self, c: u64) -> Result<(PathBuf, String)> {
        let dir = self
            .plan
            .learn
            .dir
            .join("candidates")
            .join(format!("c{c:06}"));
        if dir.exists() {
            std::fs::remove_dir_all(&dir)?;
        }
        std::fs::create_dir_all(&dir)?;
        self.trainer.export_peft(&dir.join("adapter")).await?;
        let state = self.trainer.save_state(&format!("c{c:06}")).await?;
        Ok((dir, state))
    }

    /// The trainer's current weights on the held-out environment.
    async fn evaluate(&self, c: u64) -> Result<EvalResult> {
        let handle = self
            .trainer
            .save_weights_for_sampler(&format!("candidate-{c}"))
            .await?;
        let policy = EnginePolicy::new(
            self.renderer.clone(),
            self.batcher.clone(),
            handle.clone(),
            c,
        );
        let r = self
            .evaluator
            .evaluate(
                Arc::new(policy),
                &self.plan.learn.dir,
                c,
                Some(&self.batcher),
            )
            .await;
        self.trainer.release_sampler(&handle).await?;
        Ok(r?)
    }

    fn metric(&self, r: &EvalResult) -> f64 {
        if self.plan.learn.metric == "reward" {
            r.reward
        } else {
            r.pass_at_1
        }
    }

    fn summary(&self, r: &EvalResult) -> Value {
        json!({"pass@1": r.pass_at_1, "reward": r.reward, "n": r.n, "time_s": r.time_s})
    }

    fn log(&self, mut line: Value) -> Result<()> {
        use std::io::Write;
        line["time"] = now_secs().into();
        let path = self.plan.learn.dir.join("learn.jsonl");
        let mut f = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)?;
        writeln!(f, "{line}")?;
        f.sync_data()?;
        Ok(())
    }

    /// Appends a record to `metrics.jsonl`.
    fn record(&mut self, v: Value) -> Result<()> {
        match v {
            Value::Object(m) => Ok(self.metrics.write(m)?),
            _ => bail!("a metrics record must be an object"),
        }
    }

    /// Learns until the process ends; an error stops learning (logged,
    /// and `run.json` says failed), never serving.
    pub async fn run(mut self) {
        if let Err(e) = self.run_inner().await {
            tracing::error!("learning stopped: {e:#}");
            eprintln!("learn: stopped: {e:#} (the server keeps serving)");
            if let Some(run) = self.run.take() {
                let _ = run.end(Err(format!("{e:#}")));
            }
        }
    }

    async fn run_inner(&mut self) -> Result<()> {
        let mut appended = self.learning.rewards.subscribe();
        let mut live = self.learning.versions.subscribe();
        let interval = (self.plan.learn.interval_minutes > 0.0)
            .then(|| Duration::from_secs_f64(self.plan.learn.interval_minutes * 60.0));
        let mut last_step = Instant::now();
        loop {
            // Wake on a new episode, a rollback, or the interval.
            let tick = interval.map_or(Duration::from_secs(3600), |i| {
                i.saturating_sub(last_step.elapsed())
                    .max(Duration::from_millis(100))
            });
            tokio::select! {
                r = appended.changed() => r?,
                r = live.changed() => r?,
                _ = tokio::time::sleep(tick) => {}
            }
            if let Some(v) = self.learning.versions.live() {
                if v != self.trained_from {
                    // A rollback: continue from that version's weights.
                    let meta: VersionMeta =
                        read_json(&self.learning.versions.dir_of(v).join("meta.json"))?;
                    self.trainer.load_state(&meta.state_path, true).await?;
                    self.trained_from = v;
                    self.log(json!({"event": "rollback", "version": v}))?;
                    eprintln!("learn: now training from version {v} (rolled back)");
                }
            }
            let pending = self.learning.rewards.since(self.progress.cursor)?;
            let due = pending.len() >= self.plan.rl.optim.batch_size
                || (!pending.is_empty() && interval.is_some_and(|i| last_step.elapsed() >= i));
            if !due {
                continue;
            }
            if self.progress.steps >= self.plan.rl.optim.max_steps {
                continue;
            }
            let t = Instant::now();
            self.step(&pending).await?;
            last_step = Instant::now();
            // The duty cycle: idle so that busy / (busy + idle) <= d.
            let busy = t.elapsed().as_secs_f64();
            let d = self.plan.learn.duty_cycle;
            if d < 1.0 {
                tokio::time::sleep(Duration::from_secs_f64(busy * (1.0 - d) / d)).await;
            }
        }
    }

    /// One learning step on `batch`: train, evaluate, gate.
    async fn step(&mut self, batch: &[Arc<StoredEpisode>]) -> Result<()> {
        let parent = self.trained_from;
        let c = self.progress.next_candidate;
        let (first, last) = match (batch.first(), batch.last()) {
            (Some(f), Some(l)) => (f.n, l.n),
            _ => return Ok(()),
        };
        let t_train = Instant::now();
        let trained = if self.plan.learn.objective == "dpo" {
            let pairs = dpo_pairs(batch);
            if pairs.is_empty() {
                // Nothing to prefer: the episodes are consumed, no step.
                self.log(json!({"event": "skipped", "episodes": [first, last],
                    "reason": "no two episodes answered one prompt with different rewards"}))?;
                self.progress.cursor = last + 1;
                write_json(&self.plan.learn.dir.join("learner.json"), &self.progress)?;
                return Ok(());
            }
            self.dpo_step(&pairs).await?
        } else {
            let (groups_g, advantages_g, skipped) = advantages(
                batch,
                &mut self.progress.recent,
                self.plan.learn.baseline_window,
                self.plan.rl.trainer.normalize_std,
            );
            let turns = TrainTurns::of(&groups_g, &advantages_g);
            let out = train_step(
                &*self.trainer,
                &self.plan.rl.optim,
                &self.plan.rl.loss,
                parent,
                turns.datums(),
                turns.seqs_d(),
            )
            .await?;
            json!({
                "sequences": turns.seqs_d().len(), "tokens": turns.tokens(),
                "skipped_episodes": skipped, "zero_advantage_groups": turns.zero_advantage_groups,
                "loss": out.loss_sum, "grad_norm": out.grad_norm,
                "mismatch_max": out.mismatch_max, "mismatch_tokens": out.mismatch_tokens,
            })
        };
        let train_s = t_train.elapsed().as_secs_f64();
        let staged = self.stage(c).await?;
        let eval = self.evaluate(c).await?;
        let live_meta: VersionMeta =
            read_json(&self.learning.versions.dir_of(parent).join("meta.json"))?;
        let (cand, bar) = (self.metric(&eval), self.metric(&live_meta.eval));
        let margin = self.plan.learn.margin;
        let mut line = json!({
            "candidate": c, "parent": parent, "episodes": [first, last],
            "objective": self.plan.learn.objective,
            "train_s": train_s, "eval": self.summary(&eval),
            "live_eval": self.summary(&live_meta.eval), "metric": self.plan.learn.metric,
            "margin": margin,
        });
        if let (Some(line), Value::Object(t)) = (line.as_object_mut(), trained) {
            line.extend(t);
        }
        let mut rejected = if cand >= bar - margin {
            None
        } else {
            Some(format!(
                "held-out {} {cand:.3} is below live version {parent}'s {bar:.3} minus the \
                 margin {margin} (= {:.3})",
                self.plan.learn.metric,
                bar - margin
            ))
        };
        if rejected.is_none() {
            let meta = VersionMeta {
                version: c,
                parent: Some(parent),
                state_path: staged.1.clone(),
                eval: eval.clone(),
                episodes: Some([first, last]),
                created: now_secs(),
            };
            write_json(&staged.0.join("meta.json"), &meta)?;
            let (server, dir) = (self.server.clone(), staged.0.clone());
            match tokio::task::spawn_blocking(move || server.promote(&dir, c, Some(parent))).await?
            {
                Ok(()) => self.trained_from = c,
                // A rollback while this candidate trained: it descends
                // from a version no longer live.
                Err(e) => rejected = Some(format!("not promoted: {e}")),
            }
        }
        match &rejected {
            None => {
                line["event"] = "promoted".into();
                line["version"] = c.into();
                eprintln!(
                    "learn: candidate {c} PROMOTED: {} {cand:.3} vs live {bar:.3} (episodes {first}..={last}, {})",
                    self.plan.learn.metric,
                    match line["mismatch_max"].as_f64() {
                        Some(m) => format!("mismatch {m:.1e}"),
                        None => format!("{} DPO pairs", line["pairs"]),
                    }
                );
            }
            Some(reason) => {
                line["event"] = "rejected".into();
                line["reason"] = reason.clone().into();
                write_json(&staged.0.join("rejected.json"), &line)?;
                // Back to the live weights (and their optimizer state).
                let live = self.learning.versions.live().unwrap_or(parent);
                let meta: VersionMeta =
                    read_json(&self.learning.versions.dir_of(live).join("meta.json"))?;
                self.trainer.load_state(&meta.state_path, true).await?;
                self.trained_from = live;
                let _ = std::fs::remove_dir_all(&staged.1);
                self.prune_rejected()?;
                eprintln!("learn: candidate {c} REJECTED: {reason}");
            }
        }
        let live_eval = if rejected.is_none() {
            &eval
        } else {
            &live_meta.eval
        };
        let rewards: Vec<f64> = batch.iter().map(|e| e.reward).collect();
        let mut rec = json!({
            "step": self.progress.steps + 1, "event": line["event"], "candidate": c,
            "episodes": batch.len(),
            "reward/mean": rewards.iter().sum::<f64>() / rewards.len().max(1) as f64,
            "eval/pass@1": eval.pass_at_1, "eval/reward": eval.reward,
            "live/version": self.trained_from, "live/pass@1": live_eval.pass_at_1,
            "loss": line["loss"], "grad_norm": line["grad_norm"], "train_s": train_s,
            "eval_s": eval.time_s,
        });
        if let Some(m) = line["mismatch_max"].as_f64() {
            rec["mismatch/max"] = m.into();
        }
        if let Some(reason) = &rejected {
            rec["alerts"] = json!([format!("candidate {c} rejected: {reason}")]);
        }
        self.record(rec)?;
        self.log(line)?;
        self.progress.cursor = last + 1;
        self.progress.next_candidate = c + 1;
        self.progress.steps += 1;
        write_json(&self.plan.learn.dir.join("learner.json"), &self.progress)?;
        Ok(())
    }

    /// One DPO step on `pairs`: the reference is the weights the step
    /// starts from (the live version's), the loss and its gradient
    /// `temper_rl::dpo`'s, then one optimizer step.
    async fn dpo_step(&mut self, pairs: &[PrefPair]) -> Result<Value> {
        let hp = &self.plan.rl.optim;
        let refs_p: Vec<&PrefPair> = pairs.iter().collect();
        let micro = hp.micro_batch_of(2 * pairs.len());
        let refs = temper_rl::dpo::policy_logps(&*self.trainer, &refs_p, micro).await?;
        let metrics = temper_rl::dpo::accumulate(
            &*self.trainer,
            temper_rl::plan::DpoLoss::Sigmoid,
            self.plan.learn.dpo_beta,
            &refs_p,
            &refs,
            micro,
        )
        .await?;
        let stats = self
            .trainer
            .optim_step(temper_engine::AdamParams {
                learning_rate: hp.learning_rate(self.progress.steps),
                weight_decay: hp.weight_decay,
                grad_clip_norm: hp.grad_clip,
                ..Default::default()
            })
            .await?;
        Ok(json!({
            "pairs": pairs.len(), "loss": metrics.get("loss"), "grad_norm": stats.grad_norm,
            "tokens": pairs.iter().map(|p| p.chosen.len() + p.rejected.len()).sum::<usize>(),
            "dpo": metrics,
        }))
    }

    /// Keeps the newest `keep_rejected` rejected candidates.
    fn prune_rejected(&self) -> Result<()> {
        let root = self.plan.learn.dir.join("candidates");
        let mut nums = candidate_numbers(&self.plan.learn.dir)?;
        nums.sort_unstable();
        let keep = self.plan.learn.keep_rejected;
        if nums.len() > keep {
            for n in &nums[..nums.len() - keep] {
                let _ = std::fs::remove_dir_all(root.join(format!("c{n:06}")));
            }
        }
        Ok(())
    }
}

/// `[learn] rubric`: an environment's rubric on an episode's conversation —
/// the last chat call's messages as the prompt, its answer as the
/// completion, the client's reference `answer` and `info` as the row's.
struct EnvRubric {
    env: Arc<dyn temper_env::Environment>,
}

impl EpisodeRubric for EnvRubric {
    fn score(
        &self,
        records: Vec<CaptureRecord>,
        answer: Option<String>,
        info: Value,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = Result<f64, String>> + Send>> {
        let env = self.env.clone();
        Box::pin(async move {
            let last = records.last().ok_or("the episode has no calls")?;
            let Some(messages) = &last.messages else {
                return Err(format!(
                    "the rubric scores chat conversations; the episode's last call was {}",
                    last.endpoint
                ));
            };
            let prompt: Vec<Message> = serde_json::from_value(messages.clone())
                .map_err(|e| format!("the episode's messages: {e}"))?;
            let reply: Message = serde_json::from_value(last.response.clone())
                .map_err(|e| format!("the episode's answer: {e}"))?;
            let row = Row {
                example_id: 0,
                prompt,
                answer,
                info,
            };
            let rollout = Rollout {
                completion: vec![reply],
                is_completed: true,
                is_truncated: last.finish_reason == "length",
                ..Default::default()
            };
            let score = env
                .score_group(&row, std::slice::from_ref(&rollout))
                .await
                .into_iter()
                .next()
                .ok_or("the rubric returned no score")?;
            match score.error {
                Some(e) => Err(format!("{}: {e}", env.id())),
                None => Ok(score.reward),
            }
        })
    }
}

/// The learner's thread pool: `threads` threads (0: half the cores, at
/// least 1), each at OS priority `nice`. Training and the gate's evaluation
/// run inside it (their engine installs it), so their kernels use these
/// threads only; serving keeps the process's global pool.
fn learner_pool(threads: usize, nice: i32) -> Result<Arc<rayon::ThreadPool>> {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let n = if threads == 0 {
        (cores / 2).max(1)
    } else {
        threads
    };
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(n)
        .thread_name(|i| format!("temper-learn-{i}"))
        .start_handler(move |_| lower_priority(nice))
        .build()
        .context("starting the learner's threads")?;
    eprintln!("learn: training on {n} thread(s) at nice {nice} ({cores} cores)");
    Ok(Arc::new(pool))
}

/// Sets the calling thread's nice value (Linux: per thread).
#[cfg(target_os = "linux")]
fn lower_priority(nice: i32) {
    // SAFETY: plain syscalls on the calling thread's own id.
    let r = unsafe {
        let tid = libc::gettid() as libc::id_t;
        libc::setpriority(libc::PRIO_PROCESS, tid, nice)
    };
    if r != 0 {
        tracing::warn!(
            "learner thread: setpriority({nice}): {}",
            std::io::Error::last_os_error()
        );
    }
}

/// Elsewhere a nice value is per process: it would slow serving too.
#[cfg(not(target_os = "linux"))]
fn lower_priority(nice: i32) {
    if nice != 0 {
        tracing::warn!("learn.nice is applied on Linux only; the learner runs at normal priority");
    }
}

/// The numbers of the candidates kept under `dir/candidates`.
fn candidate_numbers(dir: &Path) -> Result<Vec<u64>> {
    let root = dir.join("candidates");
    if !root.is_dir() {
        return Ok(Vec::new());
    }
    Ok(std::fs::read_dir(&root)?
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            e.file_name()
                .to_str()
                .and_then(|n| n.strip_prefix('c'))
                .and_then(|n| n.parse().ok())
        })
        .collect())
}

/// Whether a record's tokens were drawn from the model's distribution at
/// its temperature (penalties move it; the trainer could not score them).
fn trainable(sampling: &Value) -> bool {
    let is = |k: &str, v: f64| sampling[k].as_f64().is_none_or(|x| x == v);
    is("presence_penalty", 0.0) && is("frequency_penalty", 0.0) && is("repetition_penalty", 1.0)
}

/// DPO pairs from a batch: among single-call episodes whose prompt is the
/// same token for token, the best-rewarded answer is chosen over the
/// worst, the second best over the second worst, and so on while their
/// rewards differ (each episode in at most one pair).
fn dpo_pairs(batch: &[Arc<StoredEpisode>]) -> Vec<PrefPair> {
    let mut by_prompt: BTreeMap<&[u32], Vec<(f64, &[u32])>> = BTreeMap::new();
    for ep in batch {
        if let [r] = ep.records.as_slice() {
            if trainable(&r.sampling) && !r.completion_token_ids.is_empty() {
                by_prompt
                    .entry(&r.prompt_token_ids)
                    .or_default()
                    .push((ep.reward, &r.completion_token_ids));
            }
        }
    }
    let mut pairs = Vec::new();
    for (prompt, mut answers) in by_prompt {
        // Best first; ties keep arrival order.
        answers.sort_by(|a, b| b.0.total_cmp(&a.0));
        let (mut i, mut j) = (0, answers.len());
        while i + 1 < j && answers[i].0 > answers[j - 1].0 {
            pairs.push(PrefPair {
                prompt: prompt.to_vec(),
                chosen: answers[i].1.to_vec(),
                rejected: answers[j - 1].1.to_vec(),
            });
            i += 1;
            j -= 1;
        }
    }
    pairs
}

/// The stored episodes of a batch as RL groups with their advantages:
/// episodes whose first prompt is the same token for token form a group
/// (reward minus the group's mean, optionally over its std); an episode
/// alone with its prompt gets its reward minus the mean of the recent
/// rewards (`recent`, then updated, at most `window` kept) and this
/// batch's. Episodes sampled with penalties are left out (counted).
fn advantages(
    batch: &[Arc<StoredEpisode>],
    recent: &mut VecDeque<f64>,
    window: usize,
    normalize_std: bool,
) -> (Vec<Group>, Vec<Vec<f64>>, u64) {
    let mut skipped = 0;
    let mut by_prompt: BTreeMap<Vec<u32>, Vec<(Rollout, f64)>> = BTreeMap::new();
    for ep in batch {
        if !ep.records.iter().all(|r| trainable(&r.sampling)) || ep.records.is_empty() {
            skipped += 1;
            continue;
        }
        let turns = ep
            .records
            .iter()
            .map(|r| ModelTurn {
                message: Message::assistant(r.response["content"].as_str().unwrap_or_default()),
                finish_reason: r.finish_reason.clone(),
                usage: Default::default(),
                trace: Some(TokenTrace {
                    prompt_ids: r.prompt_token_ids.clone(),
                    completion_ids: r.completion_token_ids.clone(),
                    logprobs: r.logprobs.clone(),
                    version: r.version,
                    temperature: r.sampling["temperature"].as_f64().unwrap_or(1.0),
                }),
            })
            .collect();
        let rollout = Rollout {
            model_turns: turns,
            is_completed: true,
            ..Default::default()
        };
        by_prompt
            .entry(ep.records[0].prompt_token_ids.clone())
            .or_default()
            .push((rollout, ep.reward));
    }
    let batch_rewards: Vec<f64> = by_prompt.values().flatten().map(|(_, r)| *r).collect();
    let pool: Vec<f64> = recent.iter().chain(&batch_rewards).copied().collect();
    let baseline = pool.iter().sum::<f64>() / pool.len().max(1) as f64;
    let (mut groups_g, mut advantages_g) = (Vec::new(), Vec::new());
    for (i, members) in by_prompt.into_values().enumerate() {
        let rewards_r: Vec<f64> = members.iter().map(|(_, r)| *r).collect();
        let adv = if members.len() > 1 {
            group_advantages(&rewards_r, normalize_std)
        } else {
            rewards_r.iter().map(|r| r - baseline).collect()
        };
        let version = members
            .iter()
            .flat_map(|(r, _)| r.model_turns.iter())
            .filter_map(|t| t.trace.as_ref().map(|t| t.version))
            .min()
            .unwrap_or(0);
        groups_g.push(Group {
            env: 0,
            row: Row {
                example_id: i as u64,
                prompt: Vec::new(),
                answer: None,
                info: Value::Null,
            },
            scores: rewards_r
                .iter()
                .map(|&reward| Score {
                    reward,
                    ..Default::default()
                })
                .collect(),
            rollouts: members.into_iter().map(|(r, _)| r).collect(),
            version,
        });
        advantages_g.push(adv);
    }
    recent.extend(batch_rewards);
    while recent.len() > window.max(1) {
        recent.pop_front();
    }
    (groups_g, advantages_g, skipped)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ep(n: u64, prompt: Vec<u32>, reward: f64, sampling: Value) -> Arc<StoredEpisode> {
        let rec = serde_json::from_value(json!({
            "episode": format!("ep-{n}"), "seq": 0, "request_id": "r",
            "endpoint": "chat.completions", "choice": 0, "model": "live", "version": 3,
            "created": 0, "prompt_token_ids": prompt, "completion_token_ids": [7, 8],
            "logprobs": [-0.5, -0.25], "finish_reason": "stop", "sampling": sampling,
            "response": {"role": "assistant", "content": "x"},
        }))
        .expect("record");
        Arc::new(StoredEpisode {
            n,
            id: format!("ep-{n}"),
            reward,
            created: 0,
            records: vec![rec],
        })
    }

    /// The learner's pool has the threads asked for, each at the nice
    /// value asked for, and leaves the calling thread's priority alone.
    #[cfg(target_os = "linux")]
    #[test]
    fn learner_threads_are_bounded_and_deprioritised() {
        // SAFETY: errno is this thread's own; getpriority reads the
        // calling thread's priority and touches no memory of ours.
        let prio = || unsafe {
            *libc::__errno_location() = 0;
            libc::getpriority(libc::PRIO_PROCESS, libc::gettid() as libc::id_t)
        };
        let before = prio();
        let pool = learner_pool(3, 7).expect("pool");
        assert_eq!(pool.current_num_threads(), 3);
        let seen = pool.broadcast(|_| (prio(), rayon::current_num_threads()));
        // A thread cannot go below the nice value it started with.
        assert_eq!(seen, vec![(before.max(7), 3); 3]);
        assert_eq!(prio(), before);
    }

    /// DPO pairs: within a prompt, best over worst while rewards differ,
    /// each episode once; lone prompts, equal rewards, multi-call and
    /// penalised episodes make none.
    #[test]
    fn dpo_pairs_prefer_the_better_answer_to_one_prompt() {
        let t = json!({"temperature": 1.0});
        let with = |n, prompt: Vec<u32>, reward, completion: Vec<u32>, sampling: &Value| {
            let mut e = (*ep(n, prompt, reward, sampling.clone())).clone();
            e.records[0].completion_token_ids = completion;
            Arc::new(e)
        };
        let pen = json!({"temperature": 1.0, "frequency_penalty": 1.0});
        let batch = vec![
            with(0, vec![1, 2], 0.5, vec![10], &t),
            with(1, vec![1, 2], 1.0, vec![11], &t),
            with(2, vec![1, 2], 0.0, vec![12], &t),
            with(3, vec![1, 2], 0.5, vec![13], &t),
            with(4, vec![1, 2], 2.0, vec![14], &pen),
            with(5, vec![1, 3], 1.0, vec![15], &t),
            with(6, vec![1, 4], 1.0, vec![16], &t),
            with(7, vec![1, 4], 1.0, vec![17], &t),
        ];
        let pairs = dpo_pairs(&batch);
        assert_eq!(
            pairs,
            vec![PrefPair {
                prompt: vec![1, 2],
                chosen: vec![11],
                rejected: vec![12]
            }]
        );
    }

    /// Episodes sharing a prompt are a group (reward minus the group
    /// mean); a lone prompt is measured against the recent rewards and
    /// the batch's; penalised samples are left out; captured tokens and
    /// logprobs reach the datums unchanged.
    #[test]
    fn advantages_are_group_relative_or_against_a_baseline() {
        let t = json!({"temperature": 1.0});
        let batch = vec![
            ep(0, vec![1, 2], 1.0, t.clone()),
            ep(1, vec![1, 2], 0.0, t.clone()),
            ep(2, vec![1, 3], 1.0, t.clone()),
            ep(
                3,
                vec![1, 4],
                0.0,
                json!({"temperature": 1.0, "presence_penalty": 0.5}),
            ),
        ];
        let mut recent: VecDeque<f64> = [0.0, 0.0].into();
        let (groups_g, adv_g, skipped) = advantages(&batch, &mut recent, 3, false);
        assert_eq!(skipped, 1);
        assert_eq!(groups_g.len(), 2);
        assert_eq!(adv_g[0], vec![0.5, -0.5]);
        // Baseline: mean of [0, 0] recent and [1, 0, 1] of the batch = 0.4.
        assert!((adv_g[1][0] - 0.6).abs() < 1e-12, "{:?}", adv_g[1]);
        assert_eq!(recent, VecDeque::from([1.0, 0.0, 1.0]));
        let turns = TrainTurns::of(&groups_g, &adv_g);
        let d = turns.datums();
        assert_eq!(d.len(), 3);
        assert_eq!(d[0].model_input, vec![1, 2, 7]);
        assert_eq!(d[0].loss_fn_inputs.logprobs, Some(vec![0.0, -0.5, -0.25]));
        assert_eq!(turns.seqs_d()[0].spans()[0].version, 3);
    }
}
