//! The train step: `forward_backward` over the datums (in micro-batches),
//! then one `optim_step`, back to back — shared by RL and SFT — and, for RL,
//! what the learner's logprobs say about the sampler's (the mismatch on
//! on-policy tokens).

use std::time::Instant;

use temper_engine::{AdamParams, Datum, ForwardOutput, Loss, Trainer};

use crate::datum::TrainSeq;
use crate::error::{Result, RlError};
use crate::plan::Optim;

/// What one train step reports.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StepOutput {
    /// Summed loss over the micro-batches.
    pub loss_sum: f64,
    /// Gradient norm before clipping (0 when nothing was trained).
    pub grad_norm: f64,
    /// Learning rate used.
    pub lr: f64,
    /// Largest |learner − sampler| logprob over on-policy tokens.
    pub mismatch_max: f64,
    /// Sum of |learner − sampler| logprob over on-policy tokens.
    pub mismatch_sum: f64,
    /// On-policy completion tokens (sampled by the weights being trained).
    pub mismatch_tokens: usize,
    /// Sum of the learner's entropy over the tokens that report one.
    pub entropy_sum: f64,
    /// Tokens that reported an entropy.
    pub entropy_tokens: usize,
    /// Seconds in forward_backward + optim_step.
    pub train_s: f64,
}

/// What [`forward_backward_step`] reports: the step's loss, gradient norm,
/// learning rate and time.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Stepped {
    /// Summed loss over the micro-batches.
    pub loss_sum: f64,
    /// Gradient norm before clipping.
    pub grad_norm: f64,
    /// Learning rate used.
    pub lr: f64,
}

/// The train step every trainer shares: `forward_backward` over `datums`
/// in micro-batches, each micro-batch's output handed to `each` with the
/// index of its first datum, then one `optim_step` at the plan's learning
/// rate for `step`.
pub async fn forward_backward_step(
    trainer: &dyn Trainer,
    hp: &Optim,
    loss: &Loss,
    step: u64,
    datums: Vec<Datum>,
    each: impl FnMut(usize, &ForwardOutput) -> Result<()>,
) -> Result<Stepped> {
    let micro = hp.micro_batch_of(datums.len());
    let loss_sum = forward_backward_chunks(trainer, loss, &datums, micro, each).await?;
    let (lr, grad_norm) = optim_step(trainer, hp, step).await?;
    Ok(Stepped {
        loss_sum,
        grad_norm,
        lr,
    })
}

/// `forward_backward` over `datums`, `micro` at a time, leaving the summed
/// gradient in the trainer; each call's output goes to `each` with the
/// index of its first datum. Returns the summed loss.
pub async fn forward_backward_chunks(
    trainer: &dyn Trainer,
    loss: &Loss,
    datums: &[Datum],
    micro: usize,
    mut each: impl FnMut(usize, &ForwardOutput) -> Result<()>,
) -> Result<f64> {
    let micro = micro.max(1);
    let mut loss_sum = 0.0;
    for (i, chunk) in datums.chunks(micro).enumerate() {
        let fb = trainer
            .forward_backward(chunk.to_vec(), loss.clone())
            .await?;
        loss_sum += fb.metrics.get("loss:sum").copied().unwrap_or(0.0);
        each(i * micro, &fb)?;
    }
    Ok(loss_sum)
}

/// One `optim_step` at the plan's learning rate for `step`, its weight
/// decay and clip: returns the learning rate and the gradient norm.
pub async fn optim_step(trainer: &dyn Trainer, hp: &Optim, step: u64) -> Result<(f64, f64)> {
    let lr = hp.learning_rate(step);
    let stats = trainer
        .optim_step(AdamParams {
            learning_rate: lr,
            weight_decay: hp.weight_decay,
            grad_clip_norm: hp.grad_clip,
            ..AdamParams::default()
        })
        .await?;
    Ok((lr, stats.grad_norm))
}

/// RL's train step `step` on `datums_d` (one per sequence of `seqs_d`),
/// comparing the learner's logprobs with the sampler's on on-policy
/// tokens. Without datums nothing is trained and no optimizer step is
/// taken.
pub async fn train_step(
    trainer: &dyn Trainer,
    hp: &Optim,
    loss: &Loss,
    step: u64,
    datums_d: Vec<Datum>,
    seqs_d: &[TrainSeq],
) -> Result<StepOutput> {
    let t_train = Instant::now();
    let mut out = StepOutput {
        lr: hp.learning_rate(step),
        ..Default::default()
    };
    if !datums_d.is_empty() {
        let stepped = forward_backward_step(trainer, hp, loss, step, datums_d, |first, fb| {
            for (o, seq) in fb.loss_fn_outputs.iter().zip(&seqs_d[first..]) {
                for span in seq.spans() {
                    let targets = span.targets();
                    let Some(learner) = o.logprobs.get(targets.clone()) else {
                        return Err(RlError::Data(format!(
                            "the trainer returned {} logprobs for a datum of {} targets",
                            o.logprobs.len(),
                            seq.tokens().len() - 1
                        )));
                    };
                    if span.version == step {
                        for (&l, &q) in learner.iter().zip(&span.logprobs) {
                            let d = (f64::from(l) - f64::from(q)).abs();
                            out.mismatch_max = out.mismatch_max.max(d);
                            out.mismatch_sum += d;
                        }
                    }
                    // A training API (the tinker protocol) returns no
                    // entropy; the metric then averages over the tokens
                    // that have one.
                    if let Some(ent) = o.entropy.get(targets) {
                        out.entropy_sum += ent.iter().map(|&e| f64::from(e)).sum::<f64>();
                        out.entropy_tokens += ent.len();
                    }
                }
            }
            Ok(())
        })
        .await?;
        out.loss_sum = stepped.loss_sum;
        out.grad_norm = stepped.grad_norm;
    }
    out.train_s = t_train.elapsed().as_secs_f64();
    out.mismatch_tokens = seqs_d
        .iter()
        .flat_map(TrainSeq::spans)
        .filter(|s| s.version == step)
        .map(|s| s.logprobs.len())
        .sum();
    Ok(out)
}
