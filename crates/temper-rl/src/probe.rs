//! The mismatch probe. Rollouts sampled by an older policy version (async
//! RL's lag) cannot be compared with the learner, whose weights have moved
//! on; a step of equal rewards trains nothing to compare. On such a step
//! one sequence is scored again under the weights that sampled it (the
//! sampler handle of its version, still published) and compared with the
//! sampler's logprobs, so "mismatch 0 on every step" is measured on every
//! step, not inferred from the steps that had on-policy tokens. One
//! sequence a step keeps its cost to one forward pass.

use temper_engine::Trainer;

use crate::datum::TrainSeq;
use crate::error::{Result, RlError};

/// What the probe measured.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct ProbeOutput {
    /// Largest |rescored − sampler| logprob over the probed tokens.
    pub max: f64,
    /// Completion tokens compared.
    pub tokens: usize,
}

/// Pick the sequence to probe: the first of `seqs_d` holding a turn
/// sampled before `step`; or, where the step measured no on-policy token
/// (`on_policy_measured` false), any turn — each by a version `sampler_of`
/// still has weights for. `None` when no sequence qualifies.
fn pick<'a>(
    seqs_d: &'a [TrainSeq],
    step: u64,
    on_policy_measured: bool,
    sampler_of: &impl Fn(u64) -> Option<String>,
) -> Option<(&'a TrainSeq, u64, String)> {
    seqs_d.iter().find_map(|seq| {
        seq.spans()
            .iter()
            .filter(|s| s.version < step || !on_policy_measured)
            .find_map(|s| sampler_of(s.version).map(|h| (seq, s.version, h)))
    })
}

/// Probe the step: rescore one sequence (see [`pick`]) from the trained
/// ones, else from `untrained` (the batch's sequences that trained nothing:
/// groups of equal rewards), under its sampler's weights.
pub async fn probe_mismatch(
    trainer: &dyn Trainer,
    trained: &[TrainSeq],
    untrained: impl FnOnce() -> Vec<TrainSeq>,
    step: u64,
    on_policy_measured: bool,
    sampler_of: impl Fn(u64) -> Option<String>,
) -> Result<Option<ProbeOutput>> {
    let rest;
    let picked = match pick(trained, step, on_policy_measured, &sampler_of) {
        Some(p) => p,
        None => {
            rest = untrained();
            match pick(&rest, step, on_policy_measured, &sampler_of) {
                Some(p) => p,
                None => return Ok(None),
            }
        }
    };
    let (seq, version, handle) = picked;
    let rescored = trainer
        .compute_logprobs(&handle, seq.tokens().to_vec(), seq.temperature())
        .await?;
    let mut out = ProbeOutput::default();
    for span in seq.spans().iter().filter(|s| s.version == version) {
        let Some(now) = rescored.get(span.targets()) else {
            return Err(RlError::Data(format!(
                "the probe got {} logprobs for a sequence of {} tokens",
                rescored.len(),
                seq.tokens().len()
            )));
        };
        for (&l, &q) in now.iter().zip(&span.logprobs) {
            out.max = out.max.max((f64::from(l) - f64::from(q)).abs());
        }
        out.tokens += span.logprobs.len();
    }
    Ok(Some(out))
}
