//! Supervised fine-tuning data: chat conversations rendered through the
//! model's chat template, with the loss on assistant tokens only.
//!
//! The assistant spans are found by rendering: for assistant message `i`,
//! the template applied to `messages[..i]` with the generation prompt is a
//! prefix of the full conversation, and the template applied to
//! `messages[..=i]` ends where that message's turn ends (its end-of-turn
//! token included, so the model learns to stop). Tokens whose character
//! offsets fall inside a span get weight 1, all others 0. A template that
//! rewrites earlier turns (so the prefixes do not line up) is reported as an
//! error rather than silently mis-masked.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use rand::seq::SliceRandom;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use serde_json::{json, Map, Value};
use temper_engine::{Datum, Loss, LossInputs, Trainer};
use temper_model::{ChatTemplate, Pretrained, Tokenizer};

use crate::checkpoint;
use crate::config::{EnvSection, EvalSection, LogSection};
use crate::error::{Result, RlError};
use crate::eval::{EvalResult, Evaluator};
use crate::metrics::SftStepMetrics;
use crate::plan::{DataSource, SftPlan};
use crate::policy::{Batcher, EnginePolicy, Renderer};
use crate::rl::RunOptions;
use crate::runlog::MetricsLog;
use crate::step::forward_backward_step;

/// One tokenized conversation: the input tokens and, per position, the
/// target (the next token) and its loss weight.
#[derive(Debug, Clone, PartialEq)]
pub struct SftExample {
    /// All tokens of the rendered conversation.
    pub tokens: Vec<u32>,
    /// `mask[i]` is true when `tokens[i]` belongs to an assistant turn.
    pub mask: Vec<bool>,
}

impl SftExample {
    /// Tokens that carry loss.
    pub fn trained_tokens(&self) -> usize {
        self.mask[1..].iter().filter(|m| **m).count()
    }

    /// The shifted training datum, each trained token weighted `weight`.
    pub fn datum(&self, weight: f32) -> Datum {
        let n = self.tokens.len();
        Datum {
            model_input: self.tokens[..n - 1].to_vec(),
            loss_fn_inputs: LossInputs {
                target_tokens: self.tokens[1..].to_vec(),
                weights: Some(
                    self.mask[1..]
                        .iter()
                        .map(|&m| if m { weight } else { 0.0 })
                        .collect(),
                ),
                ..Default::default()
            },
        }
    }
}

/// Render and tokenize `messages` (OpenAI chat messages), marking the
/// assistant turns. Errors on an empty conversation, one with no assistant
/// turn, or one longer than `max_len` tokens.
pub fn tokenize_chat(
    template: &ChatTemplate,
    tokenizer: &Tokenizer,
    messages: &[Value],
    max_len: usize,
) -> Result<SftExample> {
    let extra = serde_json::Map::new();
    let render = |m: &[Value], gen: bool| -> Result<String> {
        Ok(template.render(&Value::Array(m.to_vec()), None, gen, &extra)?)
    };
    let full = render(messages, false)?;
    let mut spans = Vec::new();
    for (i, m) in messages.iter().enumerate() {
        if m.get("role").and_then(Value::as_str) != Some("assistant") {
            continue;
        }
        let start = render(&messages[..i], true)?;
        let end = render(&messages[..=i], false)?;
        if !full.starts_with(&start) || !full.starts_with(&end) || end.len() < start.len() {
            return Err(RlError::Data(format!(
                "the chat template does not render assistant turn {i} as an extension of the \
                 earlier turns, so its tokens cannot be located for the loss mask"
            )));
        }
        spans.push(start.len()..end.len());
    }
    if spans.is_empty() {
        return Err(RlError::Data(
            "conversation has no assistant message to train on".into(),
        ));
    }
    let enc = tokenizer
        .inner()
        .encode(full.as_str(), false)
        .map_err(|e| RlError::Data(format!("tokenize: {e}")))?;
    let tokens = enc.get_ids().to_vec();
    if tokens.len() < 2 {
        return Err(RlError::Data("conversation renders to < 2 tokens".into()));
    }
    if tokens.len() > max_len {
        return Err(RlError::Data(format!(
            "conversation is {} tokens, longer than max_seq_len {max_len}",
            tokens.len()
        )));
    }
    let mask = enc
        .get_offsets()
        .iter()
        .map(|&(s, _)| spans.iter().any(|r| r.contains(&s)))
        .collect();
    Ok(SftExample { tokens, mask })
}

/// Messages of one dataset row: `{"messages": [...]}`, or `prompt` (a
/// string or a message list) plus `completion` (a string or a message list),
/// as in verifiers' and TRL's conversational formats.
pub fn row_messages(row: &Value) -> Result<Vec<Value>> {
    if let Some(m) = row.get("messages").and_then(Value::as_array) {
        return Ok(m.clone());
    }
    let as_msgs = |v: &Value, role: &str| -> Option<Vec<Value>> {
        match v {
            Value::String(s) => Some(vec![serde_json::json!({"role": role, "content": s})]),
            Value::Array(a) => Some(a.clone()),
            _ => None,
        }
    };
    match (
        row.get("prompt").and_then(|p| as_msgs(p, "user")),
        row.get("completion").and_then(|c| as_msgs(c, "assistant")),
    ) {
        (Some(mut p), Some(c)) => {
            p.extend(c);
            Ok(p)
        }
        _ => Err(RlError::Data(
            "a row needs `messages`, or `prompt` and `completion`".into(),
        )),
    }
}

/// What a finished SFT run reports.
#[derive(Debug, Clone)]
pub struct SftOutcome {
    /// Steps completed.
    pub steps: u64,
    /// The trained adapter (LoRA) or model (full) directory.
    pub output: PathBuf,
    /// Mean per-token loss of the last step.
    pub final_loss: f64,
    /// Held-out reward before training (when `[eval]` names an
    /// environment, or the data comes from one).
    pub eval_before: Option<EvalResult>,
    /// Held-out reward after the last evaluation.
    pub eval_after: Option<EvalResult>,
    /// Every step's metrics.
    pub metrics: Vec<Map<String, Value>>,
}

/// The tokenized dataset of `cfg.data`: a chat JSONL file, or an
/// environment's training rows with `answer_format` as the assistant turn.
pub fn load_examples(cfg: &SftPlan, base: &Pretrained) -> Result<Vec<SftExample>> {
    let template = base.chat_template.as_ref().ok_or_else(|| {
        RlError::Config(format!("model {} has no chat template", base.dir.display()))
    })?;
    let conversations: Vec<Vec<Value>> = match &cfg.data {
        DataSource::File { path, .. } => read_conversations(path)?,
        DataSource::Env {
            env: e,
            answer_format: fmt,
            teacher_noise: noise,
        } => {
            let noise = *noise;
            let env = temper_tasks::loader()
                .load(&e.id, &e.args)
                .map_err(|err| RlError::Env(format!("{}: {err}", e.id)))?;
            let n = (cfg.optim.max_steps as usize * cfg.optim.batch_size).max(1);
            let mut rng = ChaCha8Rng::seed_from_u64(cfg.seed ^ 0x7EAC_4E25);
            env.rows(temper_env::Split::Train, n, cfg.seed)
                .map_err(|err| RlError::Env(format!("{}: {err}", e.id)))?
                .into_iter()
                .map(|row| {
                    let answer = row.answer.clone().ok_or_else(|| {
                        RlError::Data(format!("{} row {} has no answer", e.id, row.example_id))
                    })?;
                    let answer = near_miss(&answer, noise, &mut rng);
                    let mut msgs: Vec<Value> = row
                        .prompt
                        .iter()
                        .map(|m| serde_json::to_value(m).unwrap_or(Value::Null))
                        .collect();
                    msgs.push(serde_json::json!({
                        "role": "assistant",
                        "content": fmt.replace("{answer}", &answer),
                    }));
                    Ok(msgs)
                })
                .collect::<Result<Vec<_>>>()?
        }
    };
    let mut out = Vec::with_capacity(conversations.len());
    for (i, c) in conversations.iter().enumerate() {
        out.push(
            tokenize_chat(template, &base.tokenizer, c, cfg.trainer.max_seq_len)
                .map_err(|e| RlError::Data(format!("example {i}: {e}")))?,
        );
    }
    if out.is_empty() {
        return Err(RlError::Data("the dataset is empty".into()));
    }
    Ok(out)
}

/// How many distinct prompts `examples` hold: the tokens before each one's
/// first trained token (an environment row's prompt, whatever its answer).
fn distinct_prompts(examples: &[SftExample]) -> usize {
    examples
        .iter()
        .map(|e| {
            let first = e.mask.iter().position(|&m| m).unwrap_or(e.tokens.len());
            &e.tokens[..first]
        })
        .collect::<std::collections::HashSet<_>>()
        .len()
}

/// With probability `noise`, a numeric `answer` replaced by the simulated
/// teacher's systematic mistake (one more than the truth); otherwise (or
/// for a non-numeric answer) unchanged.
fn near_miss(answer: &str, noise: f64, rng: &mut ChaCha8Rng) -> String {
    use rand::Rng;
    let roll: f64 = rng.random();
    match answer.trim().parse::<i64>() {
        Ok(v) if roll < noise => (v + 1).to_string(),
        _ => answer.to_string(),
    }
}

/// Turn evaluation results (`temper eval`'s `results.jsonl`) into an SFT
/// dataset: one `{"messages": prompt + completion}` row per rollout with
/// reward ≥ `min_reward` and no error — distilling a model's successful
/// traces, the warm-up of the SFT-then-RL recipe. Returns the rows and how
/// many results were read.
pub fn successful_rollouts(results: &Path, min_reward: f64) -> Result<(Vec<Value>, usize)> {
    let text = std::fs::read_to_string(results).map_err(|e| RlError::io(results, e))?;
    let mut rows = Vec::new();
    let mut read = 0;
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let Ok(v) = serde_json::from_str::<Value>(line) else {
            // A torn last line of a killed eval: skip it, like --resume does.
            if i + 1 == text.lines().count() {
                continue;
            }
            return Err(RlError::Data(format!(
                "{}:{}: not JSON",
                results.display(),
                i + 1
            )));
        };
        read += 1;
        let reward = v
            .get("reward")
            .and_then(Value::as_f64)
            .unwrap_or(f64::NEG_INFINITY);
        let failed = v.get("error").is_some_and(|e| !e.is_null());
        if reward < min_reward || failed {
            continue;
        }
        let (Some(Value::Array(p)), Some(Value::Array(c))) = (v.get("prompt"), v.get("completion"))
        else {
            return Err(RlError::Data(format!(
                "{}:{}: needs `prompt` and `completion` message lists",
                results.display(),
                i + 1
            )));
        };
        let mut messages = p.clone();
        messages.extend(c.iter().cloned());
        rows.push(json!({"messages": messages, "reward": reward}));
    }
    Ok((rows, read))
}

/// Conversations of a chat JSONL or Parquet file (read by the same reader
/// as environment datasets): a `messages` column (a list, or JSON text in
/// Parquet), or `prompt` + `completion`; errors name the file and row.
pub fn read_conversations(path: &Path) -> Result<Vec<Vec<Value>>> {
    let rows = temper_env::manifest::read_records(path)
        .map_err(|e| RlError::Data(format!("{}: {e}", path.display())))?;
    rows.iter()
        .enumerate()
        .map(|(i, r)| {
            let mut r = r.clone();
            if let Some(Value::String(s)) = r.get("messages") {
                if let Ok(v) = serde_json::from_str::<Value>(s) {
                    r["messages"] = v;
                }
            }
            row_messages(&r)
                .map_err(|e| RlError::Data(format!("{}: row {}: {e}", path.display(), i + 1)))
        })
        .collect()
}

/// `temper train sft`: cross-entropy on assistant tokens, mean over the
/// batch's trained tokens; shuffled epochs (seeded); checkpoints and
/// metrics like the RL loop; resumable. It trains through the [`Trainer`]
/// trait like RL: in process, or on a training API (`[remote_trainer]`,
/// e.g. `temper api serve`), where the weights and checkpoints stay.
pub async fn run_sft<P>(plan: P, opts: RunOptions) -> Result<SftOutcome>
where
    P: TryInto<SftPlan>,
    RlError: From<P::Error>,
{
    let cfg: SftPlan = plan.try_into()?;
    let run_dir = cfg.log.dir.clone();
    let record = checkpoint::open_run(&run_dir, opts.resume, cfg.config(), "sft")?;
    let stop_early = opts.stop_after.is_some();
    let out = sft_loop(cfg, opts, &run_dir).await;
    record.end(match &out {
        Ok(_) => Ok(!stop_early),
        Err(e) => Err(e.to_string()),
    })?;
    out
}

/// [`run_sft`] once the run directory is set up.
async fn sft_loop(cfg: SftPlan, opts: RunOptions, run_dir: &Path) -> Result<SftOutcome> {
    let run_dir = run_dir.to_path_buf();
    let (base, trainer) =
        crate::open_trainer::trainer_for(&cfg.model, cfg.remote.as_ref(), cfg.seed, &run_dir)
            .await?;
    let (cfg2, base2) = (cfg.clone(), base.clone());
    let examples = tokio::task::spawn_blocking(move || load_examples(&cfg2, &base2))
        .await
        .map_err(|source| RlError::Blocking {
            what: "loading the SFT data",
            source,
        })??;
    let bs = cfg.optim.batch_size;
    let per_epoch = examples.len().div_ceil(bs) as u64;
    // An environment's rows are drawn all at once, cycling through its
    // training set, so a pass over its data is its distinct prompts.
    let pass_len = match cfg.data {
        DataSource::Env { .. } => Some(distinct_prompts(&examples)),
        DataSource::File { .. } => None,
    };
    let max_steps = match cfg.data {
        DataSource::File {
            epochs: Some(e), ..
        } => cfg.optim.max_steps.min(e * per_epoch),
        _ => cfg.optim.max_steps,
    };
    let spec = run_start!(cfg.config(), opts.resume, max_steps);
    let (start, eval_before, mut log, run_eval) = spec.open(&run_dir, &trainer, &base).await?;
    let mut eval_after = None;
    if let Some(r) = &eval_before {
        log.set_baseline(r.plot_record());
    }
    let end = opts
        .stop_after
        .map_or(max_steps, |n| (start + n).min(max_steps));
    let mut final_loss = f64::NAN;
    let mut last_state = String::new();
    let saver = checkpoint::Saver::new(&run_dir, &*trainer, &cfg.ckpt, cfg.seed);
    let t_run = Instant::now();
    let mut step = start;
    while step < end {
        let t0 = Instant::now();
        let (epoch, idx) = epoch_batch(cfg.seed, step, per_epoch, bs, examples.len());
        let batch: Vec<&SftExample> = idx.iter().map(|&i| &examples[i]).collect();
        let n_tok: usize = batch.iter().map(|e| e.trained_tokens()).sum();
        let w = 1.0 / n_tok.max(1) as f32;
        let data: Vec<Datum> = batch.iter().map(|e| e.datum(w)).collect();
        let stepped = forward_backward_step(
            &*trainer,
            &cfg.optim,
            &Loss::CrossEntropy,
            step,
            data,
            |_, _| Ok(()),
        )
        .await?;
        step += 1;
        final_loss = stepped.loss_sum;
        let dt = t0.elapsed().as_secs_f64();
        let tokens: usize = batch.iter().map(|e| e.tokens.len()).sum();
        let mut m = SftStepMetrics {
            step,
            epoch: pass_len.map_or(epoch, |n| (step - 1) * bs as u64 / n.max(1) as u64),
            loss: stepped.loss_sum,
            trained_tokens: n_tok,
            grad_norm: stepped.grad_norm,
            lr: stepped.lr,
            tokens_per_s: tokens as f64 / dt.max(1e-9),
            step_s: dt,
            ..SftStepMetrics::default()
        };
        if let Some(r) = RunEval::after(run_eval.as_ref(), &run_dir, step).await? {
            m.eval_pass_at_1 = Some(r.pass_at_1);
            m.eval_reward = Some(r.reward);
            eval_after = Some(r);
        }
        m.elapsed_s = t_run.elapsed().as_secs_f64();
        if cfg.log.progress && (step.is_multiple_of(10) || step == end) {
            eprintln!("{}", m.progress_line(max_steps));
        }
        log.write(m.to_record()?)?;
        if let Some(path) = saver
            .save_if_due(step, max_steps, eval_before.clone())
            .await?
        {
            last_state = path;
        }
    }
    let plots = ["loss", "eval/pass@1", "grad_norm", "lr", "tokens_per_s"];
    log.write_plots(&run_dir, "temper SFT run", &plots, "")?;
    let output = checkpoint::final_output(
        &*trainer,
        &run_dir,
        cfg.remote.is_some(),
        cfg.model.lora.is_some(),
        step == max_steps,
        &last_state,
    )
    .await?;
    Ok(SftOutcome {
        steps: step,
        output,
        final_loss,
        eval_before,
        eval_after,
        metrics: log.records().to_vec(),
    })
}

/// The examples step `step` trains on, with its epoch: epoch `e`'s order
/// is a seeded shuffle of `0..n`, and its `k`-th step takes the `k`-th `bs`
/// of it, so the batch is a function of the step (a resumed run continues
/// where it stopped). Shared by SFT and DPO.
pub(crate) fn epoch_batch(
    seed: u64,
    step: u64,
    per_epoch: u64,
    bs: usize,
    n: usize,
) -> (u64, Vec<usize>) {
    let epoch = step / per_epoch;
    let mut order: Vec<usize> = (0..n).collect();
    order.shuffle(&mut ChaCha8Rng::seed_from_u64(
        seed ^ epoch.wrapping_mul(0x9E37),
    ));
    let k = (step % per_epoch) as usize;
    (epoch, order[k * bs..((k + 1) * bs).min(n)].to_vec())
}

/// How SFT and DPO start a run: from the checkpoint a resume names (the
/// RL loop's format: a missing or malformed field of `latest.json` is an
/// error, not a silent step 0), with the metrics log open and the held-out
/// evaluation before training run unless the run already has it.
pub(crate) struct RunStart<'a> {
    pub(crate) seed: u64,
    pub(crate) log: &'a LogSection,
    pub(crate) eval: &'a EvalSection,
    pub(crate) data_env: Option<&'a EnvSection>,
    pub(crate) resume: bool,
    pub(crate) max_steps: u64,
}

/// The [`RunStart`] of an SFT or DPO config `$c` (different types with the
/// same section names).
macro_rules! run_start {
    ($c:expr, $resume:expr, $max_steps:expr) => {{
        let c = $c;
        $crate::sft::RunStart {
            seed: c.seed,
            log: &c.log,
            eval: &c.eval,
            data_env: c.data.env.as_ref(),
            resume: $resume,
            max_steps: $max_steps,
        }
    }};
}
pub(crate) use run_start;

impl RunStart<'_> {
    /// The step to start at, the evaluation before training, the metrics
    /// log and the run's evaluator.
    pub(crate) async fn open(
        &self,
        run_dir: &Path,
        trainer: &Arc<dyn Trainer>,
        base: &Arc<Pretrained>,
    ) -> Result<(u64, Option<EvalResult>, MetricsLog, Option<RunEval>)> {
        let state = checkpoint::start_state(run_dir, &**trainer, self.resume, self.seed).await?;
        let (start, mut eval_before) = (state.step, state.eval_before);
        let mut log = MetricsLog::open(run_dir, self.resume.then_some(start))?;
        if self.log.tensorboard {
            log.enable_tensorboard()?;
        }
        let (seed, progress) = (self.seed, self.log.progress);
        let ev = Evaluator::for_trainer(self.eval, self.data_env, seed, progress, self.max_steps);
        let run_eval = RunEval::new(ev.await?, base, trainer, progress)?;
        if let Some(e) = &run_eval {
            e.before(run_dir, &mut eval_before, start).await?;
        }
        Ok((start, eval_before, log, run_eval))
    }
}

/// SFT's and DPO's held-out environment evaluation (`[eval]`) of the run's
/// current weights, with its progress lines.
pub(crate) struct RunEval {
    ev: Evaluator,
    policy: SftPolicy,
    progress: bool,
}

impl RunEval {
    /// `None` when the run has no evaluator.
    pub(crate) fn new(
        ev: Option<Evaluator>,
        base: &Arc<Pretrained>,
        trainer: &Arc<dyn Trainer>,
        progress: bool,
    ) -> Result<Option<Self>> {
        let Some(ev) = ev else { return Ok(None) };
        if let Some(n) = ev.notice().filter(|_| progress) {
            eprintln!("note: {n}");
        }
        let policy = SftPolicy::new(base, trainer.clone())?;
        Ok(Some(Self {
            ev,
            policy,
            progress,
        }))
    }

    /// Evaluate the weights before training into `eval_before`, unless a
    /// resumed run has it already (or resumed past step 0).
    pub(crate) async fn before(
        &self,
        run_dir: &Path,
        eval_before: &mut Option<EvalResult>,
        start: u64,
    ) -> Result<()> {
        if eval_before.is_some() || start != 0 {
            return Ok(());
        }
        let r = self.policy.evaluate(&self.ev, run_dir, 0).await?;
        if self.progress {
            eprintln!("{}", r.before_line());
        }
        *eval_before = Some(r);
        Ok(())
    }

    /// The evaluation after `step` steps, when one is due.
    pub(crate) async fn after(
        this: Option<&Self>,
        run_dir: &Path,
        step: u64,
    ) -> Result<Option<EvalResult>> {
        let Some(e) = this.filter(|e| e.ev.due(step)) else {
            return Ok(None);
        };
        let r = e.policy.evaluate(&e.ev, run_dir, step).await?;
        if e.progress {
            eprintln!("{}", r.step_line());
        }
        Ok(Some(r))
    }
}

/// The SFT run's current weights as a chat model, for evaluation.
pub(crate) struct SftPolicy {
    trainer: Arc<dyn Trainer>,
    renderer: Renderer,
    batcher: Batcher,
}

impl SftPolicy {
    pub(crate) fn new(base: &Arc<Pretrained>, trainer: Arc<dyn Trainer>) -> Result<Self> {
        Ok(Self {
            renderer: Renderer::new(base.clone())?,
            batcher: Batcher::spawn(trainer.clone()),
            trainer,
        })
    }

    /// Evaluate the weights after `step` steps, then drop their snapshot.
    pub(crate) async fn evaluate(
        &self,
        ev: &Evaluator,
        run_dir: &Path,
        step: u64,
    ) -> Result<EvalResult> {
        let handle = self
            .trainer
            .save_weights_for_sampler(&format!("sft-eval-{step}"))
            .await?;
        let model = EnginePolicy::new(
            self.renderer.clone(),
            self.batcher.clone(),
            handle.clone(),
            step,
        );
        let r = ev
            .evaluate(Arc::new(model), run_dir, step, Some(&self.batcher))
            .await;
        self.trainer.release_sampler(&handle).await?;
        r
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::preset::TinyPreset;
    use serde_json::json;
    use temper_model::{LoadOptions, Pretrained};

    fn tiny() -> (tempfile::TempDir, Pretrained) {
        let dir = tempfile::tempdir().unwrap();
        TinyPreset::smallest().write(dir.path(), 0).unwrap();
        let p = Pretrained::load(dir.path(), &LoadOptions::default()).unwrap();
        (dir, p)
    }

    #[test]
    fn only_assistant_turns_and_their_end_of_turn_carry_loss() {
        let (_d, p) = tiny();
        let msgs = vec![
            json!({"role": "user", "content": "1+1"}),
            json!({"role": "assistant", "content": "2"}),
            json!({"role": "user", "content": "2+2"}),
            json!({"role": "assistant", "content": "4"}),
        ];
        let ex =
            tokenize_chat(p.chat_template.as_ref().unwrap(), &p.tokenizer, &msgs, 256).unwrap();
        let trained: String = ex
            .tokens
            .iter()
            .zip(&ex.mask)
            .filter(|(_, m)| **m)
            .map(|(t, _)| p.tokenizer.decode(&[*t], false).unwrap())
            .collect();
        assert_eq!(trained, "2<|im_end|>\n4<|im_end|>\n");
        let d = ex.datum(0.5);
        assert_eq!(d.model_input.len() + 1, ex.tokens.len());
        let w = d.loss_fn_inputs.weights.unwrap();
        assert_eq!(w.iter().filter(|x| **x == 0.5).count(), ex.trained_tokens());
    }

    #[test]
    fn rows_without_assistant_or_too_long_are_errors() {
        let (_d, p) = tiny();
        let t = p.chat_template.as_ref().unwrap();
        let e = tokenize_chat(
            t,
            &p.tokenizer,
            &[json!({"role": "user", "content": "x"})],
            256,
        )
        .unwrap_err();
        assert!(e.to_string().contains("no assistant"), "{e}");
        let msgs = vec![
            json!({"role": "user", "content": "x".repeat(300)}),
            json!({"role": "assistant", "content": "y"}),
        ];
        let e = tokenize_chat(t, &p.tokenizer, &msgs, 256).unwrap_err();
        assert!(e.to_string().contains("max_seq_len"), "{e}");
        assert!(row_messages(&json!({"text": "x"})).is_err());
        let m = row_messages(&json!({"prompt": "q", "completion": "a"})).unwrap();
        assert_eq!(m[1]["role"], "assistant");
    }
}
