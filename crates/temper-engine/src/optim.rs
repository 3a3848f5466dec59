//! AdamW with decoupled weight decay and global-norm gradient clipping.

use std::collections::HashMap;

use serde::{Deserialize, Serialize};
use temper_model::candle_core::{DType, Tensor, Var};

use crate::error::{EngineError, Result};

/// Optimizer hyper-parameters for one step (Tinker's `AdamParams`).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct AdamParams {
    /// Step size.
    pub learning_rate: f64,
    /// First-moment decay.
    pub beta1: f64,
    /// Second-moment decay.
    pub beta2: f64,
    /// Denominator epsilon.
    pub eps: f64,
    /// Decoupled weight decay: `θ ← θ − lr·wd·θ`.
    pub weight_decay: f64,
    /// Clip the global gradient norm to this; 0 disables.
    pub grad_clip_norm: f64,
}

impl Default for AdamParams {
    /// Tinker's defaults.
    fn default() -> Self {
        Self {
            learning_rate: 1e-4,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-12,
            weight_decay: 0.0,
            grad_clip_norm: 0.0,
        }
    }
}

impl AdamParams {
    /// Reject values that make no sense.
    pub fn validate(&self) -> Result<()> {
        let ok = self.learning_rate >= 0.0
            && self.learning_rate.is_finite()
            && (0.0..1.0).contains(&self.beta1)
            && (0.0..1.0).contains(&self.beta2)
            && self.eps >= 0.0
            && self.weight_decay >= 0.0
            && self.grad_clip_norm >= 0.0;
        if ok {
            Ok(())
        } else {
            Err(EngineError::InvalidRequest(format!(
                "bad AdamParams {self:?}"
            )))
        }
    }
}

/// Moments of every parameter, by name, and the step count.
#[derive(Debug, Clone, Default)]
pub struct AdamState {
    /// Steps taken.
    pub step: u64,
    /// First moments.
    pub m: HashMap<String, Tensor>,
    /// Second moments.
    pub v: HashMap<String, Tensor>,
}

/// What one optimizer step did.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepStats {
    /// Global gradient norm before clipping.
    pub grad_norm: f64,
    /// Learning rate used.
    pub learning_rate: f64,
}

impl AdamState {
    /// Update `params` with `grads` (same names). Parameters without a
    /// gradient are left alone.
    pub fn step(
        &mut self,
        params: &[(String, Var)],
        grads: &HashMap<String, Tensor>,
        p: &AdamParams,
    ) -> Result<StepStats> {
        p.validate()?;
        let mut sq = 0f64;
        // Summed in name order, so the norm (and clipping) is the same in
        // every process, whatever the map's iteration order.
        let mut names: Vec<&String> = grads.keys().collect();
        names.sort();
        for g in names.into_iter().filter_map(|n| grads.get(n)) {
            sq += g
                .to_dtype(DType::F64)?
                .sqr()?
                .sum_all()?
                .to_scalar::<f64>()?;
        }
        let grad_norm = sq.sqrt();
        if !grad_norm.is_finite() {
            // One inf/NaN would poison every weight and moment for good.
            return Err(EngineError::InvalidRequest(format!(
                "non-finite gradient (norm {grad_norm}): optimizer step skipped, weights unchanged, gradients discarded"
            )));
        }
        let clip = if p.grad_clip_norm > 0.0 && grad_norm > p.grad_clip_norm {
            p.grad_clip_norm / (grad_norm + 1e-6)
        } else {
            1.0
        };
        self.step += 1;
        let t = self.step as i32;
        let bc1 = 1.0 - p.beta1.powi(t);
        let bc2 = 1.0 - p.beta2.powi(t);
        for (name, var) in params {
            let Some(g) = grads.get(name) else { continue };
            let g = if clip != 1.0 {
                g.affine(clip, 0.0)?
            } else {
                g.clone()
            };
            let m = match self.m.get(name) {
                Some(m) => ((m.affine(p.beta1, 0.0))? + g.affine(1.0 - p.beta1, 0.0)?)?,
                None => g.affine(1.0 - p.beta1, 0.0)?,
            };
            let v = match self.v.get(name) {
                Some(v) => ((v.affine(p.beta2, 0.0))? + g.sqr()?.affine(1.0 - p.beta2, 0.0)?)?,
                None => g.sqr()?.affine(1.0 - p.beta2, 0.0)?,
            };
            let m_hat = m.affine(1.0 / bc1, 0.0)?;
            let v_hat = v.affine(1.0 / bc2, 0.0)?;
            let update = (m_hat / (v_hat.sqrt()? + p.eps)?)?;
            let theta = var.as_tensor();
            let decayed = if p.weight_decay > 0.0 {
                theta.affine(1.0 - p.learning_rate * p.weight_decay, 0.0)?
            } else {
                theta.clone()
            };
            var.set(&(decayed - update.affine(p.learning_rate, 0.0)?)?)?;
            self.m.insert(name.clone(), m);
            self.v.insert(name.clone(), v);
        }
        Ok(StepStats {
            grad_norm,
            learning_rate: p.learning_rate,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use temper_model::candle_core::Device;

    #[test]
    fn a_non_finite_gradient_is_refused_and_leaves_weights_and_moments_alone() {
        let dev = Device::Cpu;
        let var = Var::from_tensor(&Tensor::new(&[1f32, 2.0, 3.0], &dev).unwrap()).unwrap();
        let params = vec![("w".to_string(), var.clone())];
        let mut st = AdamState::default();
        let p = AdamParams::default();
        let good = HashMap::from([(
            "w".to_string(),
            Tensor::new(&[0.1f32, 0.1, 0.1], &dev).unwrap(),
        )]);
        st.step(&params, &good, &p).expect("finite step");
        let before = var.as_tensor().to_vec1::<f32>().unwrap();
        for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
            let g = HashMap::from([(
                "w".to_string(),
                Tensor::new(&[0.1f32, bad, 0.1], &dev).unwrap(),
            )]);
            let err = st.step(&params, &g, &p).expect_err("non-finite step");
            assert!(err.to_string().contains("non-finite gradient"), "{err}");
        }
        assert_eq!(var.as_tensor().to_vec1::<f32>().unwrap(), before);
        assert_eq!(st.step, 1, "no step was counted");
        st.step(&params, &good, &p).expect("training goes on");
        assert!(var
            .as_tensor()
            .to_vec1::<f32>()
            .unwrap()
            .iter()
            .all(|x| x.is_finite()));
    }
}
