//! Rotary position embeddings, computed from the config (incl. Llama-3 and
//! linear scaling) and applied with differentiable primitives only (candle's
//! fused `rotary_emb::rope*` has no backward).

use candle_core::{DType, Device, Tensor, D};

use crate::arch::config::{ModelConfig, RopeScaling};
use crate::error::{ModelError, Result};
use crate::kernels::RopeTables;

/// Cos/sin tables for every position up to the model's context length.
#[derive(Debug, Clone)]
pub struct Rope {
    cos: Tensor,
    sin: Tensor,
    max_positions: usize,
}

/// Inverse frequencies, the way transformers computes them (f32 arithmetic).
pub fn inv_freq(cfg: &ModelConfig) -> Vec<f32> {
    let dim = cfg.head_dim;
    let base = cfg.rope_theta as f32;
    let freqs = (0..dim)
        .step_by(2)
        .map(|i| 1.0f32 / base.powf(i as f32 / dim as f32));
    match cfg.rope_scaling {
        RopeScaling::Default => freqs.collect(),
        RopeScaling::Linear { factor } => freqs.map(|f| f / factor as f32).collect(),
        RopeScaling::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max_position_embeddings: old,
        } => {
            let low_wavelen = old / low_freq_factor;
            let high_wavelen = old / high_freq_factor;
            freqs
                .map(|f| {
                    let f = f as f64;
                    let wavelen = 2.0 * std::f64::consts::PI / f;
                    let scaled = if wavelen < high_wavelen {
                        f
                    } else if wavelen > low_wavelen {
                        f / factor
                    } else {
                        let smooth = (old / wavelen - low_freq_factor)
                            / (high_freq_factor - low_freq_factor);
                        (1.0 - smooth) * f / factor + smooth * f
                    };
                    scaled as f32
                })
                .collect()
        }
    }
}

impl Rope {
    /// Precompute the tables for `cfg.max_position_embeddings` positions.
    pub fn new(cfg: &ModelConfig, dtype: DType, device: &Device) -> Result<Self> {
        let inv = inv_freq(cfg);
        let half = inv.len();
        let n = cfg.max_position_embeddings;
        let mut angles = Vec::with_capacity(n * half);
        for p in 0..n {
            for f in &inv {
                angles.push(p as f32 * f);
            }
        }
        let angles = Tensor::from_vec(angles, (n, half), device)?;
        let angles = Tensor::cat(&[&angles, &angles], D::Minus1)?;
        Ok(Self {
            cos: angles.cos()?.to_dtype(dtype)?,
            sin: angles.sin()?.to_dtype(dtype)?,
            max_positions: n,
        })
    }

    /// Rotate `x` of shape `[heads, len, head_dim]` holding positions
    /// `start..start+len`.
    pub fn apply(&self, x: &Tensor, start: usize) -> Result<Tensor> {
        let (_, len, hd) = x.dims3()?;
        if start + len > self.max_positions {
            return Err(ModelError::InvalidInput(format!(
                "sequence of {} tokens exceeds the model's context length {}",
                start + len,
                self.max_positions
            )));
        }
        let cos = self.cos.narrow(0, start, len)?;
        let sin = self.sin.narrow(0, start, len)?;
        let x1 = x.narrow(D::Minus1, 0, hd / 2)?;
        let x2 = x.narrow(D::Minus1, hd / 2, hd / 2)?;
        let rotated = Tensor::cat(&[&x2.neg()?, &x1], D::Minus1)?;
        Ok((x.broadcast_mul(&cos)? + rotated.broadcast_mul(&sin)?)?)
    }

    /// The f32 tables for positions `0..len`, for
    /// [`crate::kernels::packed_attention`].
    pub fn tables(&self, len: usize) -> Result<RopeTables> {
        if len > self.max_positions {
            return Err(ModelError::InvalidInput(format!(
                "sequence of {len} tokens exceeds the model's context length {}",
                self.max_positions
            )));
        }
        let flat = |t: &Tensor| -> Result<Vec<f32>> {
            Ok(t.narrow(0, 0, len)?
                .to_dtype(DType::F32)?
                .flatten_all()?
                .to_vec1()?)
        };
        Ok(RopeTables {
            cos: flat(&self.cos)?,
            sin: flat(&self.sin)?,
        })
    }

    /// Rotate `x` of shape `[rows, heads, head_dim]` whose row `i` holds
    /// position `positions[i]` (u32 `[rows]`, each below the context length):
    /// batched decode, one token per sequence. Same formula as [`Rope::apply`].
    pub fn apply_rows(&self, x: &Tensor, positions: &Tensor) -> Result<Tensor> {
        let (_, _, hd) = x.dims3()?;
        let cos = self.cos.index_select(positions, 0)?.unsqueeze(1)?;
        let sin = self.sin.index_select(positions, 0)?.unsqueeze(1)?;
        let x1 = x.narrow(D::Minus1, 0, hd / 2)?;
        let x2 = x.narrow(D::Minus1, hd / 2, hd / 2)?;
        let rotated = Tensor::cat(&[&x2.neg()?, &x1], D::Minus1)?;
        Ok((x.broadcast_mul(&cos)? + rotated.broadcast_mul(&sin)?)?)
    }
}
