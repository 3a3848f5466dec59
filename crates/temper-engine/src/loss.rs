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
//!
//! A [`Loss::Custom`] receives each datum's logprob tensor and returns a
//! scalar loss built from differentiable ops.

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
    /// A user function.
    Custom(CustomLoss),
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
    pub const NAMES: [&'static str; 5] = [
        "cross_entropy",
        "importance_sampling",
        "ppo",
        "cispo",
        "dro",
    ];

    /// Its Tinker name (`custom` for a user function, which has none on the wire).
    pub fn name(&self) -> &'static str {
        match self {
            Loss::CrossEntropy => "cross_entropy",
            Loss::ImportanceSampling => "importance_sampling",
            Loss::Ppo { .. } => "ppo",
            Loss::Cispo { .. } => "cispo",
            Loss::Dro { .. } => "dro",
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
            } => vec![
                ("clip_low_threshold", *clip_low),
                ("clip_high_threshold", *clip_high),
            ],
            Loss::Dro { beta } => vec![("beta", *beta)],
            Loss::CrossEntropy | Loss::ImportanceSampling | Loss::Custom(_) => vec![],
        }
    }

    /// The loss by its Tinker name, with `loss_fn_config` values where it
    /// has any (the `DEFAULT_*` constants where `config` has none).
    pub fn from_name(
        name: &str,
        config: &serde_json::Map<String, serde_json::Value>,
    ) -> Result<Loss> {
        let num = |k: &str, default: f64| -> f64 {
            config.get(k).and_then(|v| v.as_f64()).unwrap_or(default)
        };
        Ok(match name {
            "cross_entropy" => Loss::CrossEntropy,
            "importance_sampling" => Loss::ImportanceSampling,
            "ppo" => Loss::Ppo {
                clip_low: num("clip_low_threshold", DEFAULT_CLIP_LOW),
                clip_high: num("clip_high_threshold", DEFAULT_CLIP_HIGH),
            },
            "cispo" => Loss::Cispo {
                clip_low: num("clip_low_threshold", DEFAULT_CLIP_LOW),
                clip_high: num("clip_high_threshold", DEFAULT_CLIP_HIGH),
            },
            "dro" => Loss::Dro {
                beta: num("beta", DEFAULT_DRO_BETA),
            },
            other => {
                return Err(EngineError::InvalidRequest(format!(
                    "unknown loss {other:?} ({})",
                    Self::NAMES.join(", ")
                )))
            }
        })
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
            Loss::Custom(f) => f(p, inputs)?,
        };
        Ok(loss)
    }
}
