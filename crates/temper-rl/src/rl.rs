//! The RL loop, top to bottom: [`run_rl`] validates, loads the
//! environments, resumes, publishes and evaluates the starting policy, then
//! per step samples a batch of groups → scores advantages → builds datums →
//! trains → publishes the new weights → logs [`StepMetrics`] → checkpoints
//! and evaluates when due. Each stage is a module named after it.
//!
//! Versions: policy version `v` is the weights after `v` optimizer steps.
//! Batch `j` is trained by step `j` (which turns version `j` into `j+1`);
//! the producer starts batch `j` only once version `j − max_off_policy_steps`
//! is published, so with a bound of 0 sampling and training alternate (the
//! synchronous loop), and with a bound of `k` sampling runs up to `k` steps
//! ahead. Every rollout carries the version that sampled it; a group whose
//! version lags its step by more than the bound is dropped, never trained
//! on.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use serde_json::Value;
use temper_engine::{Datum, Trainer};
use temper_env::PassThreshold;
use temper_model::Pretrained;

use crate::advantage::batch_advantages;
use crate::alerts::{Alert, AlertMonitor};
use crate::checkpoint::{self, checkpoint_due, LoopState};
use crate::config::RlConfig;
use crate::datum::TrainTurns;
use crate::error::{Result, RlError};
use crate::eval::Evaluator;
use crate::metrics::{
    DataMetrics, DistillMetrics, RolloutMetrics, StepMetrics, TimeMetrics, TrainMetrics,
};
use crate::plan::{DistillPlan, RlPlan};
use crate::probe::{probe_mismatch, ProbeOutput};
use crate::publish::Publisher;
use crate::rollout::{RolloutPlan, Rollouts};
use crate::runlog::MetricsLog;
use crate::samples::{markdown, LoggedSample, SamplesLog};
use crate::step::{train_step, StepOutput};
use crate::teacher::Teacher;

pub use crate::advantage::group_advantages;
pub use crate::eval::EvalResult;
pub use crate::metrics::PLOTTED;
pub use crate::open_trainer::{local_trainer, lora_config, model_dir};
pub use crate::plan::learning_rate;
pub use crate::sampled::{Batch, Group};

/// How `run_rl` was asked to run.
#[derive(Debug, Clone, Default)]
pub struct RunOptions {
    /// Continue from the run directory's latest checkpoint.
    pub resume: bool,
    /// Stop (as if killed) after this many steps of this session — for
    /// tests of resumption; `None` runs to `max_steps`.
    pub stop_after: Option<u64>,
}

/// What a finished run reports.
#[derive(Debug, Clone)]
pub struct RlOutcome {
    /// The run directory.
    pub run_dir: PathBuf,
    /// Steps completed (in total, across resumes).
    pub steps: u64,
    /// Held-out reward before training (when evaluated).
    pub eval_before: Option<EvalResult>,
    /// Held-out reward after training.
    pub eval_after: Option<EvalResult>,
    /// The trained adapter (PEFT) or model (HF) directory.
    pub output: PathBuf,
    /// Every step's metrics (including those read back from before a
    /// resume).
    pub metrics: Vec<StepMetrics>,
}

/// One batch made ready to train: the groups kept (those staler than the
/// bound dropped), their advantages, the sequences and their datums — with
/// a teacher, datums whose advantages are its per-token reverse KL
/// (on-policy distillation).
pub struct StepData {
    /// The groups trained on, in batch order.
    pub groups_g: Vec<Group>,
    /// Groups dropped as too stale.
    pub dropped: u64,
    /// `advantages_g[g][r]`: rollout `r` of group `g`.
    pub advantages_g: Vec<Vec<f64>>,
    /// The training sequences.
    pub turns: TrainTurns,
    /// One datum per sequence of `turns`.
    pub datums_d: Vec<Datum>,
    /// The teacher's measure of the step, when distilling.
    pub distill: Option<DistillMetrics>,
}

/// The loop's data path for batch `step`: drop stale groups, score
/// advantages, build sequences and datums (scored by `teacher` when
/// distilling).
pub async fn step_data(
    batch: Batch,
    step: u64,
    cfg: &RlPlan,
    teacher: Option<(&DistillPlan, &Teacher)>,
) -> Result<StepData> {
    let (groups_g, dropped) = batch.drop_stale(step, cfg.async_.max_off_policy_steps);
    let advantages_g = batch_advantages(&groups_g, cfg.trainer.normalize_std);
    let (turns, datums_d, distill) = match teacher {
        None => {
            let turns = TrainTurns::of(&groups_g, &advantages_g);
            let datums_d = turns.datums();
            (turns, datums_d, None)
        }
        Some((d, teacher)) => {
            let t_teacher = Instant::now();
            let turns = TrainTurns::of_all(&groups_g, &advantages_g);
            let teacher_d = teacher.score(turns.seqs_d()).await?;
            let (datums_d, kl) = turns
                .distill_datums(&teacher_d, d.kl_coef, d.reward_coef)
                .map_err(RlError::Data)?;
            let m = DistillMetrics::of(&kl, t_teacher.elapsed().as_secs_f64());
            (turns, datums_d, Some(m))
        }
    };
    Ok(StepData {
        groups_g,
        dropped,
        advantages_g,
        turns,
        datums_d,
        distill,
    })
}

/// Print, once, what the environments' pass thresholds and the evaluator
/// want the user to know.
fn print_notices(cfg: &RlPlan, thresholds: &[PassThreshold], evaluator: Option<&Evaluator>) {
    let mut notices: Vec<&str> = thresholds
        .iter()
        .filter_map(|t| t.notice.as_deref())
        .collect();
    notices.extend(evaluator.and_then(Evaluator::notice));
    notices.dedup();
    for n in notices {
        progress(cfg, &format!("note: {n}"));
    }
}

/// Run `temper train rl` with `plan` (an [`RlPlan`], or an [`RlConfig`]
/// checked into one here) in its `log.dir`.
pub async fn run_rl<P>(plan: P, opts: RunOptions) -> Result<RlOutcome>
where
    P: TryInto<RlPlan>,
    RlError: From<P::Error>,
{
    let cfg: RlPlan = plan.try_into()?;
    let run_dir = cfg.log.dir.clone();
    let kind = if cfg.distill.is_some() {
        "distill"
    } else {
        "rl"
    };
    let record = checkpoint::open_run(&run_dir, opts.resume, cfg.config(), kind)?;
    let max_steps = cfg.trainer.max_steps;
    let out = async {
        let (base, trainer) =
            crate::open_trainer::trainer_for(&cfg.model, cfg.remote.as_ref(), cfg.seed, &run_dir)
                .await?;
        run_rl_with(cfg, opts, base, trainer).await
    }
    .await;
    record.end(match &out {
        Ok(o) => Ok(o.steps == max_steps),
        Err(e) => Err(e.to_string()),
    })?;
    out
}

/// [`run_rl`] with a given trainer (in-process, or a remote training API)
/// and the base model it trains (for its tokenizer and chat template).
pub async fn run_rl_with(
    cfg: RlPlan,
    opts: RunOptions,
    base: Arc<Pretrained>,
    trainer: Arc<dyn Trainer>,
) -> Result<RlOutcome> {
    let run_dir = cfg.log.dir.clone();
    let plan = Arc::new(RolloutPlan::load(&cfg).await?);
    let evaluator = Evaluator::for_rl(&cfg).await?;
    let env_ids = plan.env_ids();
    let thresholds = plan.pass_thresholds(cfg.eval.pass_threshold);
    print_notices(&cfg, &thresholds, evaluator.as_ref());
    let thresholds: Vec<f64> = thresholds.iter().map(|t| t.value).collect();
    let teacher = load_teacher(&cfg, &base).await?;
    let mut state = checkpoint::start_state(&run_dir, &*trainer, opts.resume, cfg.seed).await?;
    let start = state.step;
    let (mut log, mut samples) = open_logs(&cfg, opts.resume.then_some(start))?;
    // The in-process engine samples with the learner's weights and
    // kernels: a mismatch there is a bug, elsewhere it is expected.
    let exact_sampler = cfg.sampler.url.is_none() && cfg.remote.is_none();
    let mut alerts = AlertMonitor::new(&cfg.alerts, exact_sampler)?;

    let mut publisher = Publisher::new(&cfg, trainer.clone(), base, &run_dir)?;
    let batcher = publisher.batcher();
    let ev = evaluator.as_ref();
    start_policy(&cfg, &mut publisher, ev, &mut state, &mut log, &mut alerts).await?;

    let max_steps = cfg.trainer.max_steps;
    let end = opts
        .stop_after
        .map_or(max_steps, |n| (start + n).min(max_steps));
    let policies = publisher.subscribe();
    let mut rollouts = Rollouts::start(plan, &cfg.async_, policies, batcher.clone(), start..end);
    let (mut last_eval, mut last_ckpt) = (None, String::new());
    let run_started = Instant::now();
    for step in start..end {
        let t_step = Instant::now();
        let batch = rollouts.next(step).await?;
        every_reward_failed(&batch)?;
        let (generate_s, reward_s) = (batch.generate_s, batch.reward_s);
        let wait_s = t_step.elapsed().as_secs_f64();
        let teacher = teacher.as_ref().map(|(d, t)| (*d, t));
        let (data, trained, probe) =
            train_batch(&cfg, &*trainer, &publisher, teacher, batch, step).await?;
        let StepData {
            groups_g,
            dropped,
            advantages_g,
            turns,
            distill,
            ..
        } = data;
        state.dropped_stale += dropped;
        let picked = LoggedSample::pick(&groups_g, &advantages_g, step, cfg.log.samples, &env_ids);
        if !picked.is_empty() {
            log.tensorboard_text(step + 1, "samples", &markdown(&picked))?;
        }
        samples.write(picked)?;

        // Step `step` made policy version `step + 1`.
        let version = step + 1;
        let t_pub = Instant::now();
        let published = publisher.publish(version).await?;
        let publish_s = t_pub.elapsed().as_secs_f64();
        let eval = Evaluator::evaluate_if_due(ev, version, &published, &run_dir, batcher.as_ref());
        let eval = eval.await?;

        let metrics = StepMetrics {
            step: version,
            rollouts: RolloutMetrics::of(&groups_g, step, &env_ids, &thresholds),
            data: DataMetrics::of(&turns, dropped, state.dropped_stale),
            train: TrainMetrics::of(&trained, probe),
            distill,
            time: TimeMetrics {
                generate_s,
                reward_s,
                wait_s,
                publish_s,
                tokens_per_s: turns.tokens() as f64 / trained.train_s.max(1e-9),
                step_s: t_step.elapsed().as_secs_f64(),
                elapsed_s: run_started.elapsed().as_secs_f64(),
                ..TimeMetrics::default()
            }
            .with_eval(eval.as_ref()),
        };
        let raised = report_step(&cfg, &mut log, &mut alerts, &metrics, groups_g.len())?;
        if let Some(r) = eval {
            progress(&cfg, &r.step_line());
            last_eval = Some(r);
        }
        if checkpoint_due(&cfg.ckpt, version, cfg.trainer.max_steps) {
            state.step = version;
            last_ckpt = checkpoint::save(&run_dir, &*trainer, state.clone(), cfg.ckpt.keep).await?;
        }
        log.write_plots(&run_dir, "temper RL run", PLOTTED, &samples.html())?;
        if let Some(a) = alerts.stopping(&raised) {
            return Err(RlError::Alert(a.to_string()));
        }
    }
    drop(rollouts);
    let steps = end.max(start);
    let (remote, lora) = (cfg.remote.is_some(), cfg.model.lora.is_some());
    let finished = steps == max_steps;
    let output = checkpoint::final_output(&*trainer, &run_dir, remote, lora, finished, &last_ckpt);
    let output = output.await?;
    log.write_plots(&run_dir, "temper RL run", PLOTTED, &samples.html())?;
    let metrics = log.records().iter().map(StepMetrics::try_from);
    let metrics = metrics.collect::<Result<_>>()?;
    let (eval_before, eval_after) = (state.eval_before, last_eval);
    Ok(RlOutcome {
        run_dir,
        steps,
        eval_before,
        eval_after,
        output,
        metrics,
    })
}

/// Publish the starting policy (version `state.step`) and, on a fresh run,
/// evaluate it into `state.eval_before`, which sets the baselines of the
/// log's plots and of the alerts; then replay a resumed run's alerts.
async fn start_policy(
    cfg: &RlPlan,
    publisher: &mut Publisher,
    evaluator: Option<&Evaluator>,
    state: &mut LoopState,
    log: &mut MetricsLog,
    alerts: &mut AlertMonitor,
) -> Result<()> {
    let start = state.step;
    let first = publisher.publish(start).await?;
    if let Some(ev) = evaluator.filter(|_| state.eval_before.is_none() && start == 0) {
        let batcher = publisher.batcher();
        let r = ev
            .evaluate(first.model.clone(), &cfg.log.dir, 0, batcher.as_ref())
            .await?;
        progress(cfg, &r.before_line());
        state.eval_before = Some(r);
    }
    if let Some(r) = &state.eval_before {
        log.set_baseline(r.plot_record());
        alerts.set_baseline(r.pass_at_1);
    }
    replay_alerts(cfg, log, alerts)
}

/// Train on batch `step`: its data path, the train step on its datums, and
/// the mismatch probe (sampler handles from `publisher`).
async fn train_batch(
    cfg: &RlPlan,
    trainer: &dyn Trainer,
    publisher: &Publisher,
    teacher: Option<(&DistillPlan, &Teacher)>,
    batch: Batch,
    step: u64,
) -> Result<(StepData, StepOutput, Option<ProbeOutput>)> {
    let mut data = step_data(batch, step, cfg, teacher).await?;
    let datums_d = std::mem::take(&mut data.datums_d);
    let seqs_d = data.turns.seqs_d();
    let trained = train_step(trainer, &cfg.optim, &cfg.loss, step, datums_d, seqs_d).await?;
    let untrained = || {
        let all = TrainTurns::of_all(&data.groups_g, &data.advantages_g);
        all.seqs_d().to_vec()
    };
    let measured = trained.mismatch_tokens > 0;
    let sampler_of = |v| publisher.sampler_of(v);
    let probe = probe_mismatch(trainer, seqs_d, untrained, step, measured, sampler_of).await?;
    Ok((data, trained, probe))
}

/// The run's metrics and samples logs (a resumed run's cut back to
/// `resume_at`), with TensorBoard's when configured.
fn open_logs(cfg: &RlPlan, resume_at: Option<u64>) -> Result<(MetricsLog, SamplesLog)> {
    let mut log = MetricsLog::open(&cfg.log.dir, resume_at)?;
    if cfg.log.tensorboard {
        log.enable_tensorboard()?;
    }
    Ok((log, SamplesLog::open(&cfg.log.dir, resume_at)?))
}

/// The teacher of on-policy distillation, checked against the student's
/// tokenizer before anything runs.
async fn load_teacher<'a>(
    cfg: &'a RlPlan,
    base: &Pretrained,
) -> Result<Option<(&'a DistillPlan, Teacher)>> {
    let Some(d) = &cfg.distill else {
        return Ok(None);
    };
    let teacher = Teacher::load(&d.teacher, &base.tokenizer).await?;
    progress(cfg, &format!("distilling from the teacher {}", d.teacher));
    Ok(Some((d, teacher)))
}

/// Feed a resumed run's earlier steps to `alerts`, so that its alerts are
/// an uninterrupted run's (what is raised again here is not news).
fn replay_alerts(cfg: &RlPlan, log: &MetricsLog, alerts: &mut AlertMonitor) -> Result<()> {
    for r in log.records() {
        let m = StepMetrics::try_from(r)?;
        let groups = cfg
            .trainer
            .batch_size
            .saturating_sub(m.data.dropped_stale as usize);
        alerts.observe(&m, groups);
    }
    Ok(())
}

/// Print a step's progress line and the alerts it raised, and log it (the
/// alerts with it): answers the alerts.
fn report_step(
    cfg: &RlPlan,
    log: &mut MetricsLog,
    alerts: &mut AlertMonitor,
    metrics: &StepMetrics,
    groups: usize,
) -> Result<Vec<Alert>> {
    progress(cfg, &metrics.progress_line(cfg.trainer.max_steps));
    let raised = alerts.observe(metrics, groups);
    for a in &raised {
        progress(cfg, &format!("  alert {a}"));
    }
    let mut record = metrics.to_record()?;
    if !raised.is_empty() {
        let texts = raised.iter().map(|a| Value::String(a.to_string()));
        record.insert("alerts".into(), Value::Array(texts.collect()));
    }
    log.write(record)?;
    Ok(raised)
}

/// Load the environments of `cfg` and its eval environment, as a run
/// does, checking every service they call: what `--dry-run` reports.
/// Returns the services checked.
pub async fn preflight(cfg: &RlPlan) -> Result<Vec<String>> {
    let plan = RolloutPlan::load(cfg).await?;
    let mut services = plan.services().to_vec();
    if let Some(ev) = Evaluator::for_rl(cfg).await? {
        services.extend(ev.services().iter().cloned());
    }
    services.sort();
    services.dedup();
    Ok(services)
}

/// A batch where no rollout's reward could be computed ends the run: its
/// rewards are all 0 for a reason that is not the policy's (a sandbox gone,
/// a crashing reward program), and training on them teaches nothing.
fn every_reward_failed(batch: &Batch) -> Result<()> {
    let scores = || batch.groups_g.iter().flat_map(|g| g.scores.iter());
    let total = scores().count();
    let failed: Vec<&str> = scores().filter_map(|s| s.error.as_deref()).collect();
    if total > 0 && failed.len() == total {
        return Err(RlError::Env(format!(
            "step {}: every rollout's reward failed ({total} of {total}); the first: {}",
            batch.step, failed[0]
        )));
    }
    Ok(())
}

/// A progress line on stderr, when `log.progress` is on.
fn progress(cfg: &RlConfig, line: &str) {
    if cfg.log.progress {
        eprintln!("{line}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::step::StepOutput;
    use temper_env::{Message, ModelTurn, Rollout, Row, Score, TokenTrace};

    /// The loop's data path for one batch: drop stale groups, advantages,
    /// datums, train.
    async fn train_on(
        cfg: &RlPlan,
        trainer: &dyn Trainer,
        batch: Batch,
        dropped_total: &mut u64,
    ) -> (DataMetrics, RolloutMetrics, StepOutput) {
        let step = batch.step;
        let d = step_data(batch, step, cfg, None).await.unwrap();
        let (groups_g, dropped, turns) = (d.groups_g, d.dropped, d.turns);
        *dropped_total += dropped;
        let out = train_step(
            trainer,
            &cfg.optim,
            &cfg.loss,
            step,
            d.datums_d,
            turns.seqs_d(),
        )
        .await
        .unwrap();
        (
            DataMetrics::of(&turns, dropped, *dropped_total),
            RolloutMetrics::of(&groups_g, step, &[], &[]),
            out,
        )
    }

    #[test]
    fn groups_older_than_the_bound_are_dropped_not_trained() {
        let dir = tempfile::tempdir().unwrap();
        let mut cfg: RlConfig = crate::config::resolve(
            "[model]\npreset = \"tiny\"\n[model.tiny]\nhidden_size = 32\nnum_layers = 1\n\
             num_heads = 2\nnum_kv_heads = 1\nintermediate_size = 64\n[lora]\nrank = 2\n",
            &[],
        )
        .unwrap();
        cfg.async_.max_off_policy_steps = 1;
        cfg.env.push(crate::config::EnvSection {
            id: "unused".into(),
            weight: 1.0,
            args: Value::Null,
            package: None,
        });
        let (_base, trainer) = local_trainer(&cfg.model, &cfg.lora, 0, dir.path()).unwrap();
        let cfg = RlPlan::try_from(cfg).unwrap();
        let group = |version: u64| {
            let turn = |lp: f32, reward: f64| {
                let trace = TokenTrace {
                    prompt_ids: vec![1, 5, 6],
                    completion_ids: vec![7, 8],
                    logprobs: vec![lp, lp],
                    version,
                    temperature: 1.0,
                };
                (
                    Rollout {
                        model_turns: vec![ModelTurn {
                            message: Message::assistant("x"),
                            finish_reason: "stop".into(),
                            usage: Default::default(),
                            trace: Some(trace),
                        }],
                        ..Default::default()
                    },
                    Score {
                        reward,
                        ..Default::default()
                    },
                )
            };
            let (r1, s1) = turn(-1.0, 1.0);
            let (r2, s2) = turn(-2.0, 0.0);
            Group {
                env: 0,
                row: Row {
                    example_id: 0,
                    prompt: vec![],
                    answer: None,
                    info: Value::Null,
                },
                rollouts: vec![r1, r2],
                scores: vec![s1, s2],
                version,
            }
        };
        let rt = tokio::runtime::Runtime::new().unwrap();
        let mut dropped = 0;
        // Step 3, bound 1: version 1 is two steps old (dropped), version 2 is fine.
        let batch = Batch {
            step: 3,
            groups_g: vec![group(1), group(2)],
            generate_s: 0.0,
            reward_s: 0.0,
        };
        let (data, rollouts, _) =
            rt.block_on(train_on(&cfg, trainer.as_ref(), batch, &mut dropped));
        assert_eq!(dropped, 1);
        assert_eq!(data.dropped_stale, 1);
        assert_eq!(
            data.trained_sequences, 2,
            "only the fresh group's two rollouts"
        );
        assert_eq!(rollouts.policy_lag_max, 1.0);
        // Everything stale: nothing trained, no optimizer step.
        let batch = Batch {
            step: 5,
            groups_g: vec![group(1), group(3)],
            generate_s: 0.0,
            reward_s: 0.0,
        };
        let (data, _, out) = rt.block_on(train_on(&cfg, trainer.as_ref(), batch, &mut dropped));
        assert_eq!(dropped, 3);
        assert_eq!(data.trained_sequences, 0);
        assert_eq!(out.grad_norm, 0.0);
    }
}
