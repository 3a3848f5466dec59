//! Token-level losses, SUMMED over tokens (Tinker's convention; normalise by
//! choosing `weights` / `advantages`). With `p` the learner's logprob of a
//! target token, `q` the sampler's, and `r = exp(p − q)`:
//!
//! | loss | per-token term |
//! | --- | --- |
//! | `cross_entropy` | `−w · p` |
//! | `importance_sampling` | `−r · A` |
//! | `ppo` | `−min(r · A, clip(r, lo, hi) · A)` |
//! | `cispo` | `−sg(clip(r, lo, hi)) · p · A` (sg = stop-gradient) |
//! | `dro` | `−(p · A − ½ β (p − q)²)` |
//! | `gspo` | `−min(s_t · A, clip(s_t, lo, hi) · A)`, `s_t = exp(mean_M(sg(p) − q) + p − sg(p))` |
//!
//! `gspo` (GSPO-token, Zheng et al. 2025, as Tinker defines it) gives every
//! token the value of the sequence ratio `s` (the geometric mean of `r` over
//! the positions `M` that `sequence_ratio_mask` marks) with the gradient of
//! its own logprob.
//!
//! Tinker's `stable_reinforce` is not here: Tinker has not published its
//! objective, only that it uses information the sampler records, so
//! [`Loss::from_name`] refuses it by name rather than guess.
//!
//! A [`Loss::Custom`] receives each datum's logprob tensor and returns a
//! scalar loss built from differentiable ops.
//!
//! [`Loss::Dpo`] is a PAIR loss (DPO, Rafailov et al. 2023, as TRL's
//! `DPOTrainer` computes it): the datums of a call come in pairs, chosen at
//! an even index and rejected right after it, and a pair's term couples its
//! two sequences. With `Δ = Σ w·(p − q)` a sequence's log-ratio to the
//! reference (`w` the `weights`, 1 on completion tokens and 0 on the
//! prompt's; `q` the reference's logprobs in `logprobs`, of which only the
//! weighted sum enters, so a caller that kept only the reference's summed
//! logprob may put it at one weighted position) and `n = Σ w`:
//!
//! | kind | per pair |
//! | --- | --- |
//! | `sigmoid` | `−s · log σ(β (Δ_c − Δ_r))` |
//! | `ipo` | `s · (Δ_c / n_c − Δ_r / n_r − 1 / (2β))²` |
//!
//! `s` is the call's `scale` (`1 / pairs` in the optimiser step gives
//! TRL's mean). Since it reads only the weighted positions, the engine runs
//! the LM head on their rows alone: its `loss_fn_outputs` hold the logprob
//! and entropy of every weighted position and NaN (not computed) at the
//! others, which may hold NaN in `p` too. It is computed in-process only: the tinker wire has no pair
//! loss, and its client splits a request's datums by size, which could part
//! a pair; a remote trainer says so with [`crate::Trainer::takes_pair_loss`]
//! and a DPO loop falls back to a forward plus a weighted cross-entropy.

use std::sync::Arc;

use temper_model::candle_core::Tensor;

use crate::error::{EngineError, Result};

/// Inputs of one datum's loss: one entry per target position.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct LossInputs {
    /// Token to predict at each position.
    pub target_tokens: Vec<u32>,
    /// Per-token weight (cross_entropy); 0 masks a position.
    pub weights: Option<Vec<f32>>,
    /// Sampler logprobs `q` (importance_sampling, ppo, cispo, dro).
    pub logprobs: Option<Vec<f32>>,
    /// Per-token advantages `A` (RL losses).
    pub advantages: Option<Vec<f32>>,
    /// Positions whose ratio enters `gspo`'s sequence ratio (non-zero = in).
    pub sequence_ratio_mask: Option<Vec<f32>>,
    /// Temperature `T` the learner scores at: `p = log softmax(logits / T)`.
    /// Set it to the sampling temperature the `logprobs` were drawn at, so the
    /// importance ratio compares the same distribution on both sides (the
    /// sampler reports logprobs of `softmax(logits / T)`). `None` scores the
    /// model's own distribution (`T = 1`), as SFT wants.
    pub temperature: Option<f64>,
}

impl LossInputs {
    /// The temperature the learner scores this datum at (`1.0` when unset).
    pub fn scoring_temperature(&self) -> f64 {
        self.temperature.unwrap_or(1.0)
    }
}

/// A custom loss: logprobs `[len]` of one datum and its inputs → scalar loss.
pub type CustomLoss =
    Arc<dyn Fn(&Tensor, &LossInputs) -> temper_model::Result<Tensor> + Send + Sync>;

/// Which loss a forward_backward computes.
#[derive(Clone)]
pub enum Loss {
    /// `−Σ w·p`.
    CrossEntropy,
    /// `−Σ r·A`.
    ImportanceSampling,
    /// `−Σ min(r·A, clip(r, lo, hi)·A)`.
    Ppo {
        /// Lower ratio clip (e.g. 0.8).
        clip_low: f64,
        /// Upper ratio clip (e.g. 1.2).
        clip_high: f64,
    },
    /// `−Σ sg(clip(r, lo, hi))·p·A`.
    Cispo {
        /// Lower clip of the IS weight.
        clip_low: f64,
        /// Upper clip of the IS weight.
        clip_high: f64,
    },
    /// `−Σ (p·A − ½β(p − q)²)`.
    Dro {
        /// Quadratic penalty strength (e.g. 0.05).
        beta: f64,
    },
    /// `−Σ min(s_t·A, clip(s_t, lo, hi)·A)` with the sequence ratio `s_t`.
    Gspo {
        /// Lower clip of the sequence ratio.
        clip_low: f64,
        /// Upper clip of the sequence ratio.
        clip_high: f64,
    },
    /// DPO's pair loss (see the module docs): datums `2i` and `2i + 1` are a
    /// pair's chosen and rejected sequences.
    Dpo {
        /// `sigmoid` or `ipo`.
        kind: PairLoss,
        /// DPO's β (> 0).
        beta: f64,
        /// Every pair's term is multiplied by it (`1 / pairs` for a mean).
        scale: f64,
    },
    /// A user function.
    Custom(CustomLoss),
}

/// Which pair loss [`Loss::Dpo`] computes (TRL's `loss_type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PairLoss {
    /// `−log σ(β (Δ_c − Δ_r))`.
    Sigmoid,
    /// `(Δ_c / n_c − Δ_r / n_r − 1 / (2β))²`.
    Ipo,
}

impl std::fmt::Debug for Loss {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.name())?;
        let config = self.config();
        if !config.is_empty() {
            let values: Vec<String> = config.iter().map(|(_, v)| v.to_string()).collect();
            write!(f, "({})", values.join(", "))?;
        }
        Ok(())
    }
}

/// Default lower ratio clip of `ppo` and `cispo`.
pub const DEFAULT_CLIP_LOW: f64 = 0.8;
/// Default upper ratio clip of `ppo` and `cispo`.
pub const DEFAULT_CLIP_HIGH: f64 = 1.2;
/// Default quadratic penalty of `dro`.
pub const DEFAULT_DRO_BETA: f64 = 0.05;

impl Loss {
    /// Every loss by its Tinker name (the names [`Loss::from_name`] takes).
    pub const NAMES: [&'static str; 6] = [
        "cross_entropy",
        "importance_sampling",
        "ppo",
        "cispo",
        "dro",
        "gspo",
    ];

    /// Its Tinker name (`custom` for a user function, which has none on the wire).
    pub fn name(&self) -> &'static str {
        match self {
            Loss::CrossEntropy => "cross_entropy",
            Loss::ImportanceSampling => "importance_sampling",
            Loss::Ppo { .. } => "ppo",
            Loss::Cispo { .. } => "cispo",
            Loss::Dro { .. } => "dro",
            Loss::Gspo { .. } => "gspo",
            Loss::Dpo {
                kind: PairLoss::Sigmoid,
                ..
            } => "dpo_sigmoid",
            Loss::Dpo {
                kind: PairLoss::Ipo,
                ..
            } => "dpo_ipo",
            Loss::Custom(_) => "custom",
        }
    }

    /// Its `loss_fn_config` entries (Tinker's keys), the inverse of
    /// [`Loss::from_name`]'s `config`.
    pub fn config(&self) -> Vec<(&'static str, f64)> {
        match self {
            Loss::Ppo {
                clip_low,
                clip_high,
            }
            | Loss::Cispo {
                clip_low,
                clip_high,
            }
            | Loss::Gspo {
                clip_low,
                clip_high,
            } => vec![
                ("clip_low_threshold", *clip_low),
                ("clip_high_threshold", *clip_high),
            ],
            Loss::Dro { beta } => vec![("beta", *beta)],
            Loss::Dpo { beta, scale, .. } => vec![("beta", *beta), ("scale", *scale)],
            Loss::CrossEntropy | Loss::ImportanceSampling | Loss::Custom(_) => vec![],
        }
    }

    /// The loss by its Tinker name, with `loss_fn_config` values where it
    /// has any (the `DEFAULT_*` constants where `config` has none). A key the
    /// loss does not take, or a value that is not a number, is an error: a
    /// setting the client believes applied must not be dropped. `temperature`
    /// is the caller's (see [`LossInputs::temperature`]) and passes here.
    pub fn from_name(
        name: &str,
        config: &serde_json::Map<String, serde_json::Value>,
    ) -> Result<Loss> {
        let keys: &[&str] = match name {
            "ppo" | "cispo" | "gspo" => &["clip_low_threshold", "clip_high_threshold"],
            "dro" => &["beta"],
            _ => &[],
        };
        for (k, v) in config {
            if k == "temperature" {
                continue;
            }
            if !keys.contains(&k.as_str()) {
                return Err(EngineError::InvalidRequest(format!(
                    "loss {name:?} takes no loss_fn_config key {k:?} (it takes: {})",
                    if keys.is_empty() {
                        "none".to_string()
                    } else {
                        keys.join(", ")
                    }
                )));
            }
            if !v.as_f64().is_some_and(f64::is_finite) {
                return Err(EngineError::InvalidRequest(format!(
                    "loss_fn_config {k} must be a finite number, got {v}"
                )));
            }
        }
        let num = |k: &str, default: f64| -> f64 {
            config.get(k).and_then(|v| v.as_f64()).unwrap_or(default)
        };
        let clip = || -> Result<(f64, f64)> {
            let (lo, hi) = (
                num("clip_low_threshold", DEFAULT_CLIP_LOW),
                num("clip_high_threshold", DEFAULT_CLIP_HIGH),
            );
            if lo > hi {
                return Err(EngineError::InvalidRequest(format!(
                    "clip_low_threshold {lo} is above clip_high_threshold {hi}"
                )));
            }
            Ok((lo, hi))
        };
        Ok(match name {
            "cross_entropy" => Loss::CrossEntropy,
            "importance_sampling" => Loss::ImportanceSampling,
            "ppo" => {
                let (clip_low, clip_high) = clip()?;
                Loss::Ppo {
                    clip_low,
                    clip_high,
                }
            }
            "cispo" => {
                let (clip_low, clip_high) = clip()?;
                Loss::Cispo {
                    clip_low,
                    clip_high,
                }
            }
            "gspo" => {
                let (clip_low, clip_high) = clip()?;
                Loss::Gspo {
                    clip_low,
                    clip_high,
                }
            }
            "dro" => Loss::Dro {
                beta: num("beta", DEFAULT_DRO_BETA),
            },
            "stable_reinforce" => {
                return Err(EngineError::InvalidRequest(
                    "loss \"stable_reinforce\" is not supported: Tinker has not published its \
                     objective (only that it trains on information the sampler records with \
                     record_stability_info), so temper cannot compute it; use gspo, ppo, cispo \
                     or importance_sampling (tinker-cookbook: loss_fn=gspo)"
                        .into(),
                ))
            }
            "dpo_sigmoid" | "dpo_ipo" => {
                return Err(EngineError::InvalidRequest(format!(
                    "loss {name:?} (DPO's pair loss) is computed in-process only: the tinker \
                     wire has no pair loss; compute DPO client-side (a forward, then a \
                     cross_entropy forward_backward weighted by the loss's gradient)"
                )))
            }
            "custom" => {
                return Err(EngineError::InvalidRequest(
                    "loss \"custom\" (a loss traced and uploaded to the server) is not \
                     supported; forward_backward_custom's client-side path works"
                        .into(),
                ))
            }
            other => {
                return Err(EngineError::InvalidRequest(format!(
                    "unknown loss {other:?} ({})",
                    Self::NAMES.join(", ")
                )))
            }
        })
    }

    /// Whether this loss couples the datums of a pair (chosen at an even
    /// index, rejected after it) rather than scoring each datum alone.
    pub fn is_pair(&self) -> bool {
        matches!(self, Loss::Dpo { .. })
    }

    /// Check a pair loss's settings and its batch of `n` datums (an even
    /// number; a no-op for the other losses).
    pub fn validate_pairs(&self, n: usize) -> Result<()> {
        if let Loss::Dpo { beta, scale, .. } = self {
            if !(*beta > 0.0 && beta.is_finite()) {
                return Err(EngineError::InvalidRequest(format!(
                    "loss {self:?}: beta must be a finite number > 0"
                )));
            }
            if !scale.is_finite() {
                return Err(EngineError::InvalidRequest(format!(
                    "loss {self:?}: scale must be finite"
                )));
            }
            if !n.is_multiple_of(2) {
                return Err(EngineError::InvalidRequest(format!(
                    "loss {self:?} takes pairs (chosen, rejected), got {n} datums"
                )));
            }
        }
        Ok(())
    }

    /// Check that `inputs` carries what this loss needs, for `len` positions.
    pub fn validate(&self, inputs: &LossInputs, len: usize) -> Result<()> {
        let need = |name: &str, v: &Option<Vec<f32>>| -> Result<()> {
            match v {
                None => Err(EngineError::InvalidRequest(format!(
                    "loss {self:?} needs {name}"
                ))),
                Some(x) if x.len() != len => Err(EngineError::InvalidRequest(format!(
                    "{name} has {} entries for {len} target tokens",
                    x.len()
                ))),
                Some(x) if x.iter().any(|v| !v.is_finite()) => Err(EngineError::InvalidRequest(
                    format!("{name} contains non-finite values"),
                )),
                _ => Ok(()),
            }
        };
        if inputs.target_tokens.len() != len {
            return Err(EngineError::InvalidRequest(format!(
                "{} target tokens for {len} input tokens",
                inputs.target_tokens.len()
            )));
        }
        if let Some(w) = &inputs.weights {
            need("weights", &Some(w.clone()))?;
        }
        if let Some(t) = inputs.temperature {
            if !(t > 0.0 && t.is_finite()) {
                return Err(EngineError::InvalidRequest(format!(
                    "temperature must be a finite number > 0, got {t}"
                )));
            }
        }
        match self {
            Loss::CrossEntropy | Loss::Custom(_) => Ok(()),
            Loss::ImportanceSampling | Loss::Ppo { .. } | Loss::Cispo { .. } => {
                need("logprobs", &inputs.logprobs)?;
                need("advantages", &inputs.advantages)
            }
            Loss::Dro { .. } => {
                need("logprobs", &inputs.logprobs)?;
                need("advantages", &inputs.advantages)
            }
            Loss::Dpo { .. } => {
                need("weights", &inputs.weights)?;
                need("logprobs", &inputs.logprobs)?;
                match &inputs.weights {
                    Some(w) if w.iter().all(|&x| x == 0.0) => Err(EngineError::InvalidRequest(
                        "a pair loss's weights mark no completion token".into(),
                    )),
                    _ => Ok(()),
                }
            }
            Loss::Gspo { .. } => {
                need("logprobs", &inputs.logprobs)?;
                need("advantages", &inputs.advantages)?;
                need("sequence_ratio_mask", &inputs.sequence_ratio_mask)?;
                // The sequence ratio is a mean over the marked positions.
                match &inputs.sequence_ratio_mask {
                    Some(m) if m.iter().all(|&x| x == 0.0) => Err(EngineError::InvalidRequest(
                        "sequence_ratio_mask marks no position".into(),
                    )),
                    _ => Ok(()),
                }
            }
        }
    }

    /// The (summed) loss of one datum from the learner's logprobs `p` `[len]`.
    pub fn compute(&self, p: &Tensor, inputs: &LossInputs) -> Result<Tensor> {
        let dev = p.device();
        let len = p.dims1()?;
        let vec = |v: &Option<Vec<f32>>, default: f32| -> Result<Tensor> {
            Ok(match v {
                Some(x) => Tensor::new(x.as_slice(), dev)?,
                None => Tensor::full(default, len, dev)?,
            })
        };
        let w = vec(&inputs.weights, 1.0)?;
        let loss = match self {
            Loss::CrossEntropy => (p * &w)?.sum_all()?.neg()?,
            Loss::ImportanceSampling => {
                let r = (p - vec(&inputs.logprobs, 0.0)?)?.exp()?;
                (r * vec(&inputs.advantages, 0.0)?)?
                    .mul(&w)?
                    .sum_all()?
                    .neg()?
            }
            Loss::Ppo {
                clip_low,
                clip_high,
            } => {
                let a = vec(&inputs.advantages, 0.0)?;
                let r = (p - vec(&inputs.logprobs, 0.0)?)?.exp()?;
                let unclipped = (&r * &a)?;
                let clipped = (r.clamp(*clip_low as f32, *clip_high as f32)? * &a)?;
                let m = unclipped.minimum(&clipped)?;
                (m * &w)?.sum_all()?.neg()?
            }
            Loss::Cispo {
                clip_low,
                clip_high,
            } => {
                let a = vec(&inputs.advantages, 0.0)?;
                let r = (p - vec(&inputs.logprobs, 0.0)?)?.exp()?.detach();
                let c = r.clamp(*clip_low as f32, *clip_high as f32)?;
                ((c * p)? * a)?.mul(&w)?.sum_all()?.neg()?
            }
            Loss::Dro { beta } => {
                let a = vec(&inputs.advantages, 0.0)?;
                let d = (p - vec(&inputs.logprobs, 0.0)?)?;
                let term = ((p * a)? - d.sqr()?.affine(0.5 * beta, 0.0)?)?;
                (term * &w)?.sum_all()?.neg()?
            }
            Loss::Gspo {
                clip_low,
                clip_high,
            } => {
                let a = vec(&inputs.advantages, 0.0)?;
                let mask = vec(&inputs.sequence_ratio_mask, 1.0)?
                    .ne(0f32)?
                    .to_dtype(p.dtype())?;
                let marked = mask.sum_all()?;
                // mean over M of (sg(p) − q): the sequence log-ratio, a constant.
                let log_s = ((p.detach() - vec(&inputs.logprobs, 0.0)?)? * &mask)?
                    .sum_all()?
                    .div(&marked)?;
                // value exp(log_s), gradient of the token's own logprob.
                let s_t = (p - p.detach())?.broadcast_add(&log_s)?.exp()?;
                let unclipped = (&s_t * &a)?;
                let clipped = (s_t.clamp(*clip_low as f32, *clip_high as f32)? * &a)?;
                let m = unclipped.minimum(&clipped)?;
                (m * &w)?.sum_all()?.neg()?
            }
            Loss::Custom(f) => f(p, inputs)?,
            Loss::Dpo { .. } => {
                return Err(EngineError::InvalidRequest(format!(
                    "loss {self:?} is a pair loss: compute it with compute_pair"
                )))
            }
        };
        Ok(loss)
    }

    /// A pair loss's term for one pair from the learner's logprobs of its
    /// chosen (`pc`) and rejected (`pr`) sequences; see the module docs.
    pub fn compute_pair(
        &self,
        pc: &Tensor,
        chosen: &LossInputs,
        pr: &Tensor,
        rejected: &LossInputs,
    ) -> Result<Tensor> {
        let Loss::Dpo { kind, beta, scale } = *self else {
            return Err(EngineError::InvalidRequest(format!(
                "loss {self:?} is not a pair loss"
            )));
        };
        // Δ = Σ w·(p − q) over the weighted positions as a [1] tensor (the
        // others' p may be NaN: not computed), and n = Σ w.
        let log_ratio = |p: &Tensor, inputs: &LossInputs| -> Result<(Tensor, f64)> {
            let need = |v: &Option<Vec<f32>>, what: &str| -> Result<Vec<f32>> {
                v.clone().ok_or_else(|| {
                    EngineError::InvalidRequest(format!("loss {self:?} needs {what}"))
                })
            };
            let (w, q) = (
                need(&inputs.weights, "weights")?,
                need(&inputs.logprobs, "logprobs")?,
            );
            let at: Vec<usize> = (0..w.len()).filter(|&i| w[i] != 0.0).collect();
            if at.is_empty() || w.len() != p.dims1()? || q.len() != w.len() {
                return Err(EngineError::InvalidRequest(format!(
                    "loss {self:?}: {} weights ({} non-zero) and {} logprobs for {} positions",
                    w.len(),
                    at.len(),
                    q.len(),
                    p.dims1()?
                )));
            }
            let (dev, dtype) = (p.device(), p.dtype());
            let pick = |v: &[f32]| -> Result<Tensor> {
                let v: Vec<f32> = at.iter().map(|&i| v[i]).collect();
                Ok(Tensor::new(v.as_slice(), dev)?.to_dtype(dtype)?)
            };
            let idx: Vec<u32> = at.iter().map(|&i| i as u32).collect();
            let p = p
                .contiguous()?
                .index_select(&Tensor::new(idx.as_slice(), dev)?, 0)?;
            let n: f64 = w.iter().map(|&x| f64::from(x)).sum();
            Ok((((p - pick(&q)?)? * pick(&w)?)?.sum_keepdim(0)?, n))
        };
        let (dc, nc) = log_ratio(pc, chosen)?;
        let (dr, nr) = log_ratio(pr, rejected)?;
        let term = match kind {
            PairLoss::Sigmoid => {
                // −log σ(h) = log(1 + exp(−h)), with −h clamped where exp
                // would overflow f32 and the linear tail added back (not
                // relu(−h) + log(1 + exp(−|h|)): its gradient at h = 0, where
                // a new adapter's first step is, would be 0, not −β/2).
                let x = (dc - dr)?.affine(-beta, 0.0)?;
                let soft = x.clamp(-80f32, 80f32)?.exp()?.affine(1.0, 1.0)?.log()?;
                (soft + x.affine(1.0, -80.0)?.relu()?)?
            }
            PairLoss::Ipo => {
                let e = (dc.affine(1.0 / nc.max(1.0), 0.0)?
                    - dr.affine(1.0 / nr.max(1.0), 0.0)?)?
                .affine(1.0, -1.0 / (2.0 * beta))?;
                e.sqr()?
            }
        };
        Ok(term.affine(scale, 0.0)?.sum_all()?)
    }
}
