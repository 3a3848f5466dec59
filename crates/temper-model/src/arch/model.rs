//! The decoder: Llama, Qwen2 and Qwen3 in one file, because they differ only
//! by the flags of [`ModelConfig`] (q/k/v bias, per-head q/k RMSNorm, rope
//! scaling, tied embeddings).
//!
//! One forward, [`Model::forward_hidden`], serves training, prefill and
//! decode. It takes the tokens of several sequences packed into one row
//! dimension: linear layers run over all of them at once and attention runs
//! per sequence, each against its own KV cache (or none, for training). Every
//! op is differentiable — no fused inference-only kernel — so the same code
//! that samples can be trained through.

use std::sync::Arc;

use candle_core::{CpuStorage, CustomOp1, DType, Device, Layout, Shape, Tensor, Var, D};
use rayon::prelude::*;

use crate::arch::config::ModelConfig;
use crate::arch::rope::Rope;
use crate::error::{ModelError, Result};
use crate::formats::weights::{Checkpoint, Matrix};
use crate::kernels::{
    causal_attention, fused_attention_supported, fused_rms_norm_supported, fused_swiglu_supported,
    linear_nt, lora_linear, lora_linear_quant, lora_linear_supported, matmul_nt, matmul_nt_packed,
    matmul_nt_quant_op, packed_attention, use_matmul_nt, ForwardMatmul, HeadKernel, PackedBf16,
    PackedHeads, PackedSeq, QuantWeight, RopeTables,
};
use crate::lora::{LoraAdapter, LoraPair, Target};
use crate::precision::Precision;

/// A linear layer `y = x·Wᵀ + b` with an optional LoRA update.
#[derive(Debug, Clone)]
struct Linear {
    weight: Tensor,
    bias: Option<Tensor>,
    /// The bf16 weight packed for the forward (see [`PackedBf16`]); `None`
    /// for f32 weights.
    packed: Option<Arc<PackedBf16>>,
    /// GGUF blocks kept quantized (`--dtype gguf`); `weight` then holds the
    /// same bytes, `[out, row_bytes]` `u8`.
    quant: Option<QuantWeight>,
    /// The model's forward matmul (see [`Model::set_forward_matmul`]).
    matmul: ForwardMatmul,
}

impl Linear {
    fn load(ck: &Checkpoint, name: &str, out: usize, inp: usize, bias: bool) -> Result<Self> {
        let (weight, quant) = match ck.get_matrix(&format!("{name}.weight"), &[out, inp])? {
            Matrix::Dense(w) => (w, None),
            Matrix::Quant(q) => (q.blocks.clone(), Some(q)),
        };
        let bias = if bias {
            Some(ck.get(&format!("{name}.bias"), &[out])?)
        } else {
            None
        };
        Ok(Self {
            weight,
            bias,
            packed: None,
            quant,
            matmul: ForwardMatmul::default(),
        })
    }

    /// The weight as a dense tensor: quantized blocks dequantized to f32.
    fn dense_weight(&self) -> Result<Tensor> {
        match &self.quant {
            Some(q) => q.dequantize(),
            None => Ok(self.weight.detach()),
        }
    }

    /// `x`: `[n, in]` → `[n, out]`.
    fn forward(&self, x: &Tensor, lora: Option<(&LoraPair, f64, bool)>) -> Result<Tensor> {
        // Untracked (inference) adapters run the same ops on detached
        // tensors: same numbers, no autograd graph.
        let adapter = lora.map(|(p, scale, track)| {
            if track {
                (p.a.as_tensor().clone(), p.b.as_tensor().clone(), scale)
            } else {
                (p.a.as_tensor().detach(), p.b.as_tensor().detach(), scale)
            }
        });
        if let Some(q) = &self.quant {
            // Quantized blocks: the sampler's and the trainer's one kernel,
            // with or without an adapter.
            let y = match &adapter {
                Some((a, b, scale)) => lora_linear_quant(x, q, a, b, *scale)?,
                None => matmul_nt_quant_op(x, q)?,
            };
            return Ok(match &self.bias {
                Some(bias) => y.broadcast_add(bias)?,
                None => y,
            });
        }
        if let Some((a, b, scale)) = &adapter {
            if lora_linear_supported(self.matmul, x, &self.weight, a, b) {
                // The base matmul and the update in one op (`kernels`).
                let y = lora_linear(x, &self.weight, self.packed.as_ref(), a, b, *scale)?;
                return Ok(match &self.bias {
                    Some(bias) => y.broadcast_add(bias)?,
                    None => y,
                });
            }
        }
        let frozen_on_cpu = !self.weight.is_variable()
            && x.track_op()
            && x.device().is_cpu()
            && matches!(x.dtype(), DType::F32 | DType::F64);
        let mut y = if use_matmul_nt(self.matmul, x, &self.weight) {
            match &self.packed {
                Some(p) => matmul_nt_packed(x, p)?,
                None => matmul_nt(x, &self.weight)?,
            }
        } else if self.weight.dtype() != x.dtype() {
            // bf16 weights under candle's matmul (`TEMPER_MATMUL=candle`).
            x.matmul(&self.weight.to_dtype(x.dtype())?.t()?)?
        } else if frozen_on_cpu {
            x.contiguous()?.apply_op1(FrozenMatmul {
                weight: self.weight.clone(),
            })?
        } else {
            x.matmul(&self.weight.t()?)?
        };
        if let Some(b) = &self.bias {
            y = y.broadcast_add(b)?;
        }
        if let Some((a, b, scale)) = adapter {
            // Composed: off the CPU, or with `TEMPER_MATMUL=candle`.
            let down = linear_nt(self.matmul, x, &a)?;
            let up = linear_nt(self.matmul, &down, &b)?;
            y = (y + up.affine(scale, 0.0)?)?;
        }
        Ok(y)
    }
}

/// `x·Wᵀ` for a frozen `W`, whose backward computes only the input gradient.
/// candle's matmul backward also computes `xᵀ·grad` for the weight even when
/// the weight is frozen: a third of the matmul work of a LoRA step, thrown
/// away. The forward runs the very same matmul kernel as the plain path, so
/// numbers do not depend on which path ran.
struct FrozenMatmul {
    weight: Tensor,
}

impl CustomOp1 for FrozenMatmul {
    fn name(&self) -> &'static str {
        "frozen-matmul"
    }

    fn cpu_fwd(
        &self,
        storage: &CpuStorage,
        layout: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (start, end) = layout
            .contiguous_offsets()
            .ok_or_else(|| candle_core::Error::Msg("frozen-matmul: non-contiguous input".into()))?;
        let x = match storage {
            CpuStorage::F32(v) => Tensor::from_slice(&v[start..end], layout.shape(), &Device::Cpu)?,
            CpuStorage::F64(v) => Tensor::from_slice(&v[start..end], layout.shape(), &Device::Cpu)?,
            _ => {
                return Err(candle_core::Error::Msg(
                    "frozen-matmul: f32/f64 only".into(),
                ))
            }
        };
        let y = x.matmul(&self.weight.t()?)?;
        let shape = y.shape().clone();
        let flat = y.flatten_all()?;
        let out = match y.dtype() {
            DType::F64 => CpuStorage::F64(flat.to_vec1()?),
            _ => CpuStorage::F32(flat.to_vec1()?),
        };
        Ok((out, shape))
    }

    fn bwd(
        &self,
        _arg: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<Option<Tensor>> {
        Ok(Some(grad.matmul(&self.weight)?))
    }
}

/// RMSNorm from differentiable primitives (candle's fused `rms_norm` has no
/// backward). Normalises over the last dimension.
/// Like transformers, half-precision inputs are normalised in f32.
fn rms_norm(x: &Tensor, weight: &Tensor, eps: f64) -> Result<Tensor> {
    if fused_rms_norm_supported(x, weight) {
        // One pass per row, rows across threads, its own backward.
        return crate::kernels::rms_norm(x, weight, eps);
    }
    let dtype = x.dtype();
    let x = match dtype {
        DType::BF16 | DType::F16 => x.to_dtype(DType::F32)?,
        _ => x.clone(),
    };
    let var = x.sqr()?.mean_keepdim(D::Minus1)?;
    let denom = (var + eps)?.sqrt()?;
    let normed = x.broadcast_div(&denom)?.to_dtype(dtype)?;
    Ok(normed.broadcast_mul(weight)?)
}

/// Softmax over the last dimension from differentiable primitives.
pub(crate) fn softmax_last(x: &Tensor) -> Result<Tensor> {
    let max = x.max_keepdim(D::Minus1)?.detach();
    let e = x.broadcast_sub(&max)?.exp()?;
    Ok(e.broadcast_div(&e.sum_keepdim(D::Minus1)?)?)
}

/// Log-softmax over the last dimension from differentiable primitives.
pub(crate) fn log_softmax_last(x: &Tensor) -> Result<Tensor> {
    let max = x.max_keepdim(D::Minus1)?.detach();
    let shifted = x.broadcast_sub(&max)?;
    let lse = shifted.exp()?.sum_keepdim(D::Minus1)?.log()?;
    Ok(shifted.broadcast_sub(&lse)?)
}

#[derive(Debug, Clone)]
struct Attention {
    q: Linear,
    k: Linear,
    v: Linear,
    o: Linear,
    q_norm: Option<Tensor>,
    k_norm: Option<Tensor>,
}

#[derive(Debug, Clone)]
struct Mlp {
    gate: Linear,
    up: Linear,
    down: Linear,
}

#[derive(Debug, Clone)]
struct Layer {
    input_norm: Tensor,
    attn: Attention,
    post_norm: Tensor,
    mlp: Mlp,
}

impl Layer {
    /// The seven LoRA-targetable linear layers.
    fn linears(&self) -> [(Target, &Linear); 7] {
        [
            (Target::Q, &self.attn.q),
            (Target::K, &self.attn.k),
            (Target::V, &self.attn.v),
            (Target::O, &self.attn.o),
            (Target::Gate, &self.mlp.gate),
            (Target::Up, &self.mlp.up),
            (Target::Down, &self.mlp.down),
        ]
    }

    fn linears_mut(&mut self) -> [(Target, &mut Linear); 7] {
        [
            (Target::Q, &mut self.attn.q),
            (Target::K, &mut self.attn.k),
            (Target::V, &mut self.attn.v),
            (Target::O, &mut self.attn.o),
            (Target::Gate, &mut self.mlp.gate),
            (Target::Up, &mut self.mlp.up),
            (Target::Down, &mut self.mlp.down),
        ]
    }
}

/// Keys and values of one sequence, per layer, in buffers
/// `[kv_heads, capacity, head_dim]` whose first `len` positions are filled.
/// New positions are written in place (the capacity doubles when full), so
/// a decode step costs O(1) per cached token instead of copying the whole
/// cache; attention reads the filled prefix in place. (Keys and values that
/// carry gradients are concatenated instead, so gradients still flow.)
#[derive(Debug)]
pub struct KvCache {
    layers: Vec<Option<(Tensor, Tensor)>>,
    len: usize,
}

/// Smallest buffer a layer starts with, in positions.
const MIN_KV_CAPACITY: usize = 32;

impl Clone for KvCache {
    /// A deep copy of the filled positions ([`KvCache::truncated`]):
    /// buffers are written in place, so copies must never share storage.
    /// Code that can fail should call `truncated(len())` and handle the error.
    fn clone(&self) -> Self {
        match self.truncated(self.len) {
            Ok(c) => c,
            // Only an allocation failure gets here; sharing storage instead
            // would corrupt both caches silently.
            Err(e) => panic!("copying a KV cache: {e}"),
        }
    }
}

impl KvCache {
    /// An empty cache for a model with `num_layers` layers.
    pub fn new(num_layers: usize) -> Self {
        Self {
            layers: vec![None; num_layers],
            len: 0,
        }
    }

    /// A deep copy of the first `len` positions (a cached prefix to extend:
    /// the positions after it are recomputed by the next forward).
    pub fn truncated(&self, len: usize) -> Result<KvCache> {
        if len > self.len {
            return Err(ModelError::InvalidInput(format!(
                "cannot keep {len} positions of a KV cache holding {}",
                self.len
            )));
        }
        let mut layers = Vec::with_capacity(self.layers.len());
        for l in &self.layers {
            layers.push(match l {
                Some((k, v)) if len > 0 => {
                    Some((k.narrow(1, 0, len)?.copy()?, v.narrow(1, 0, len)?.copy()?))
                }
                _ => None,
            });
        }
        Ok(KvCache { layers, len })
    }

    /// Write `k`, `v` (`[kv_heads, t, head_dim]`, the keys and values of
    /// positions `len..len+t`) into layer `li`, growing its buffers when
    /// full; returns views of every filled position, `[kv_heads, len+t,
    /// head_dim]`. `len` itself moves on once the whole forward is done.
    fn append(&mut self, li: usize, k: &Tensor, v: &Tensor) -> Result<(Tensor, Tensor)> {
        let (_, t, _) = k.dims3()?;
        let (pos, filled) = (self.len, self.len + t);
        let layer = self
            .layers
            .get_mut(li)
            .ok_or_else(|| ModelError::InvalidInput(format!("KV cache has no layer {li}")))?;
        if k.track_op() || v.track_op() {
            // Part of an autograd graph (a trainable adapter used without an
            // inference view): concatenate so gradients reach the new
            // positions. The full result is the buffer; the next append
            // finds it full and moves to a fresh one.
            let (kc, vc) = match layer.as_ref() {
                Some((kb, vb)) if pos > 0 => (
                    Tensor::cat(&[&kb.narrow(1, 0, pos)?, k], 1)?,
                    Tensor::cat(&[&vb.narrow(1, 0, pos)?, v], 1)?,
                ),
                _ => (k.clone(), v.clone()),
            };
            *layer = Some((kc.clone(), vc.clone()));
            return Ok((kc, vc));
        }
        let capacity = layer.as_ref().map_or(0, |(kb, _)| kb.dim(1).unwrap_or(0));
        if filled > capacity {
            let cap = filled.max(2 * capacity).max(MIN_KV_CAPACITY);
            let grow = |old: Option<&Tensor>, like: &Tensor| -> Result<Tensor> {
                let (heads, _, hd) = like.dims3()?;
                let buf = Tensor::zeros((heads, cap, hd), like.dtype(), like.device())?;
                if let (Some(old), true) = (old, pos > 0) {
                    buf.slice_set(&old.narrow(1, 0, pos)?.contiguous()?, 1, 0)?;
                }
                Ok(buf)
            };
            let (kb, vb) = match layer.as_ref() {
                Some((kb, vb)) => (grow(Some(kb), k)?, grow(Some(vb), v)?),
                None => (grow(None, k)?, grow(None, v)?),
            };
            *layer = Some((kb, vb));
        }
        let (kb, vb) = layer
            .as_ref()
            .ok_or_else(|| ModelError::InvalidInput("KV cache layer missing".into()))?;
        kb.slice_set(&k.contiguous()?, 1, pos)?;
        vb.slice_set(&v.contiguous()?, 1, pos)?;
        Ok((kb.narrow(1, 0, filled)?, vb.narrow(1, 0, filled)?))
    }

    /// Tokens cached so far (= the position of the next token).
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether nothing is cached.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// A packed forward's `ids` must hold exactly the rows of its sequences,
/// each at least one.
fn check_rows(ids: &[u32], lens: impl Iterator<Item = usize> + Clone) -> Result<()> {
    if lens.clone().sum::<usize>() != ids.len() || ids.is_empty() || lens.clone().any(|l| l == 0) {
        return Err(ModelError::InvalidInput(format!(
            "packed forward: {} ids for sequences of {:?} tokens",
            ids.len(),
            lens.collect::<Vec<_>>()
        )));
    }
    Ok(())
}

/// The packed attention's plan for one whole-sequence forward.
struct Packed {
    seqs: Vec<PackedSeq>,
    tables: Arc<RopeTables>,
}

/// One sequence's slice of a packed forward: `len` new tokens, appended to
/// `cache` when given (positions continue from `cache.len()`); without a
/// cache the tokens are a whole sequence starting at position 0.
pub struct Segment<'a> {
    /// New tokens of this sequence in the packed input.
    pub len: usize,
    /// The sequence's KV cache, if it is being decoded.
    pub cache: Option<&'a mut KvCache>,
}

/// A `[rows, cols]` f32 stand-in for a matrix kept quantized: it gives the
/// shape that shape checks read and is one NaN broadcast (no memory), so
/// a reader that ignored the quantized form would produce NaN, never
/// plausible numbers.
fn quantized_placeholder(q: &QuantWeight) -> Result<Tensor> {
    Ok(Tensor::new(f32::NAN, &Device::Cpu)?.broadcast_as(q.dims())?)
}

/// A Llama / Qwen2 / Qwen3 decoder with frozen (or fully trainable) weights.
#[derive(Debug, Clone)]
pub struct Model {
    cfg: ModelConfig,
    /// A shape placeholder (see [`quantized_placeholder`]) when
    /// `embed_quant` holds the embedding.
    embed: Tensor,
    /// The embedding's GGUF blocks kept quantized (`--dtype gguf`).
    embed_quant: Option<QuantWeight>,
    layers: Vec<Layer>,
    norm: Tensor,
    /// `None` when tied to `embed`; a shape placeholder when `head_packed`
    /// holds it quantized.
    lm_head: Option<Tensor>,
    /// The head weight in its kernel's form: packed bf16 weights, or GGUF
    /// blocks kept quantized (the embedding's, when tied).
    head_packed: Option<HeadKernel>,
    /// Which matmul the forward uses (see [`Model::set_forward_matmul`]).
    matmul: ForwardMatmul,
    rope: Rope,
    device: Device,
    dtype: DType,
}

impl Model {
    /// Build the model from a checkpoint, checking every tensor's shape.
    pub fn load(cfg: &ModelConfig, ck: &Checkpoint, dtype: DType, device: &Device) -> Result<Self> {
        let h = cfg.hidden_size;
        let (embed, embed_quant) =
            match ck.get_matrix("model.embed_tokens.weight", &[cfg.vocab_size, h])? {
                Matrix::Dense(t) => (t, None),
                Matrix::Quant(q) => (quantized_placeholder(&q)?, Some(q)),
            };
        let mut layers = Vec::with_capacity(cfg.num_layers);
        for i in 0..cfg.num_layers {
            let p = format!("model.layers.{i}");
            let lin = |t: Target, bias: bool| {
                let (out, inp) = t.shape(cfg);
                Linear::load(ck, &format!("{p}.{}", t.path()), out, inp, bias)
            };
            let attn = Attention {
                q: lin(Target::Q, cfg.qkv_bias)?,
                k: lin(Target::K, cfg.qkv_bias)?,
                v: lin(Target::V, cfg.qkv_bias)?,
                o: lin(Target::O, cfg.o_bias)?,
                q_norm: if cfg.qk_norm {
                    Some(ck.get(&format!("{p}.self_attn.q_norm.weight"), &[cfg.head_dim])?)
                } else {
                    None
                },
                k_norm: if cfg.qk_norm {
                    Some(ck.get(&format!("{p}.self_attn.k_norm.weight"), &[cfg.head_dim])?)
                } else {
                    None
                },
            };
            let mlp = Mlp {
                gate: lin(Target::Gate, cfg.mlp_bias)?,
                up: lin(Target::Up, cfg.mlp_bias)?,
                down: lin(Target::Down, cfg.mlp_bias)?,
            };
            layers.push(Layer {
                input_norm: ck.get(&format!("{p}.input_layernorm.weight"), &[h])?,
                attn,
                post_norm: ck.get(&format!("{p}.post_attention_layernorm.weight"), &[h])?,
                mlp,
            });
        }
        let norm = ck.get("model.norm.weight", &[h])?;
        // A quantized head (or embedding, when tied) stays in its blocks:
        // the logits are the quantized matmul's, the same bits as the f32
        // model's, from the file's bytes instead of `vocab·hidden` floats.
        let (lm_head, head_packed) = if cfg.tie_word_embeddings && !ck.contains("lm_head.weight") {
            (None, embed_quant.clone().map(HeadKernel::Quant))
        } else {
            match ck.get_matrix("lm_head.weight", &[cfg.vocab_size, h])? {
                Matrix::Dense(t) => (Some(t), None),
                Matrix::Quant(q) => (Some(quantized_placeholder(&q)?), Some(HeadKernel::Quant(q))),
            }
        };
        Ok(Self {
            cfg: cfg.clone(),
            embed,
            embed_quant,
            layers,
            norm,
            lm_head,
            head_packed,
            matmul: ForwardMatmul::default(),
            rope: Rope::new(cfg, dtype, device)?,
            device: device.clone(),
            dtype,
        })
    }

    /// Store the matmul weights (every linear layer, the embedding and the
    /// LM head) in `precision`. On the CPU, `bf16` runs the bf16 matmul
    /// kernel (inputs rounded to bf16, f32 sums); norms, attention and LoRA
    /// stay in the compute dtype. Elsewhere the weights already are in the
    /// compute dtype and nothing changes. A fully trainable model is
    /// refused: its weights are the optimizer's f32 variables.
    pub fn set_precision(&mut self, precision: Precision) -> Result<()> {
        if precision == self.precision() || !self.device.is_cpu() {
            return Ok(());
        }
        if self.is_quantized() {
            return Err(ModelError::InvalidInput(format!(
                "this model keeps its GGUF weights quantized (--dtype gguf); load it with --dtype {precision} to dequantize them"
            )));
        }
        if self.embed.is_variable() {
            return Err(ModelError::InvalidInput(
                "full-parameter training keeps f32 weights: use --dtype f32".into(),
            ));
        }
        let dtype = match precision {
            // Nothing quantized to keep (a safetensors checkpoint, or a GGUF
            // without matrices in a kept format): f32.
            Precision::F32 | Precision::Gguf => DType::F32,
            Precision::Bf16 => DType::BF16,
        };
        let convert = |t: &mut Tensor| -> Result<()> {
            *t = t.to_dtype(dtype)?;
            Ok(())
        };
        let pack = |t: &Tensor| -> Result<Option<Arc<PackedBf16>>> {
            Ok(match precision {
                Precision::F32 | Precision::Gguf => None,
                Precision::Bf16 => Some(Arc::new(PackedBf16::from_tensor(t)?)),
            })
        };
        convert(&mut self.embed)?;
        if let Some(h) = self.lm_head.as_mut() {
            convert(h)?;
        }
        self.head_packed = pack(self.head_weight())?.map(HeadKernel::Bf16);
        for l in self.layers.iter_mut() {
            for (_, lin) in l.linears_mut() {
                convert(&mut lin.weight)?;
                lin.packed = pack(&lin.weight)?;
            }
        }
        Ok(())
    }

    /// Choose the forward's matmul for this model's linear layers and LM
    /// head: [`ForwardMatmul::BatchInvariant`] (the default) or candle's
    /// `gemm`, for comparisons. A property of the model, so two models in
    /// one process can differ and a library caller gets the default
    /// whatever else runs.
    pub fn set_forward_matmul(&mut self, m: ForwardMatmul) {
        self.matmul = m;
        for l in self.layers.iter_mut() {
            for (_, lin) in l.linears_mut() {
                lin.matmul = m;
            }
        }
    }

    /// The forward's matmul (see [`Model::set_forward_matmul`]).
    pub fn forward_matmul(&self) -> ForwardMatmul {
        self.matmul
    }

    /// The precision of the matmul weights (see [`Model::set_precision`]):
    /// bf16 exactly when they are packed for the bf16 kernel.
    pub fn precision(&self) -> Precision {
        if matches!(self.head_packed, Some(HeadKernel::Bf16(_))) {
            Precision::Bf16
        } else if self.is_quantized() {
            Precision::Gguf
        } else {
            Precision::F32
        }
    }

    /// Whether some weight matrix keeps GGUF blocks (see [`Precision::Gguf`]).
    pub fn is_quantized(&self) -> bool {
        !self.quant_formats().is_empty()
    }

    /// Whether the LM head (the embedding, when tied) is kept quantized.
    pub fn head_is_quantized(&self) -> bool {
        matches!(self.head_packed, Some(HeadKernel::Quant(_)))
    }

    /// The block formats of the matrices kept quantized, each once, in
    /// the order first met (empty unless [`Model::is_quantized`]).
    pub fn quant_formats(&self) -> Vec<crate::kernels::QuantFormat> {
        let head = match &self.head_packed {
            Some(HeadKernel::Quant(q)) => Some(q),
            _ => None,
        };
        let mut out = Vec::new();
        let matrices = self
            .layers
            .iter()
            .flat_map(|l| l.linears().into_iter().map(|(_, lin)| lin.quant.as_ref()))
            .chain([self.embed_quant.as_ref(), head]);
        for f in matrices.flatten().map(|q| q.format) {
            if !out.contains(&f) {
                out.push(f);
            }
        }
        out
    }

    /// The configuration.
    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    /// Where the weights live.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// The compute dtype.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Turn every base weight into a trainable variable (full-parameter
    /// training) and return them with their checkpoint names.
    pub fn make_trainable(&mut self) -> Result<Vec<(String, Var)>> {
        if self.precision() != Precision::F32 {
            return Err(ModelError::InvalidInput(format!(
                "full-parameter training needs f32 weights, and this model holds {} ones: load it with --dtype f32 (or train a LoRA)",
                self.precision()
            )));
        }
        let mut vars = Vec::new();
        let mut var = |name: String, t: &mut Tensor| -> Result<()> {
            let v = Var::from_tensor(t)?;
            *t = v.as_tensor().clone();
            vars.push((name, v));
            Ok(())
        };
        var("model.embed_tokens.weight".into(), &mut self.embed)?;
        for (i, l) in self.layers.iter_mut().enumerate() {
            let p = format!("model.layers.{i}");
            var(format!("{p}.input_layernorm.weight"), &mut l.input_norm)?;
            var(
                format!("{p}.post_attention_layernorm.weight"),
                &mut l.post_norm,
            )?;
            for (t, lin) in l.linears_mut() {
                var(format!("{p}.{}.weight", t.path()), &mut lin.weight)?;
                if let Some(b) = lin.bias.as_mut() {
                    var(format!("{p}.{}.bias", t.path()), b)?;
                }
            }
            if let Some(n) = l.attn.q_norm.as_mut() {
                var(format!("{p}.self_attn.q_norm.weight"), n)?;
            }
            if let Some(n) = l.attn.k_norm.as_mut() {
                var(format!("{p}.self_attn.k_norm.weight"), n)?;
            }
        }
        var("model.norm.weight".into(), &mut self.norm)?;
        if let Some(h) = self.lm_head.as_mut() {
            var("lm_head.weight".into(), h)?;
        }
        Ok(vars)
    }

    /// A deep copy whose weights are plain tensors sharing no storage with
    /// `self` — e.g. a frozen snapshot of a fully-trainable model for a
    /// sampler while training goes on.
    pub fn frozen_copy(&self) -> Result<Model> {
        let mut m = self.clone();
        let copy = |t: &mut Tensor| -> Result<()> {
            *t = t.detach().copy()?;
            Ok(())
        };
        copy(&mut m.embed)?;
        copy(&mut m.norm)?;
        if let Some(h) = m.lm_head.as_mut() {
            copy(h)?;
        }
        for l in m.layers.iter_mut() {
            copy(&mut l.input_norm)?;
            copy(&mut l.post_norm)?;
            for n in [l.attn.q_norm.as_mut(), l.attn.k_norm.as_mut()]
                .into_iter()
                .flatten()
            {
                copy(n)?;
            }
            for (_, lin) in l.linears_mut() {
                if lin.quant.is_none() {
                    copy(&mut lin.weight)?;
                }
                if let Some(b) = lin.bias.as_mut() {
                    copy(b)?;
                }
            }
        }
        Ok(m)
    }

    /// The base weights with `adapter` merged in (`W + scale·B·A`): a plain
    /// model that needs no adapter at run time, e.g. for export.
    pub fn merge_lora(&self, adapter: &LoraAdapter) -> Result<Model> {
        let mut merged = self.clone();
        let scale = adapter.scale();
        for (i, l) in merged.layers.iter_mut().enumerate() {
            for (t, lin) in l.linears_mut() {
                if let Some(p) = adapter.get(i, t) {
                    let delta =
                        p.b.as_tensor()
                            .matmul(p.a.as_tensor())?
                            .affine(scale, 0.0)?;
                    // Merged in f32, then stored back in the weight's dtype
                    // (quantized blocks: dequantized, the merge is f32).
                    let dtype = match lin.quant.take() {
                        Some(_) => DType::F32,
                        None => lin.weight.dtype(),
                    };
                    lin.weight = (lin.dense_weight()?.to_dtype(delta.dtype())? + delta.detach())?
                        .to_dtype(dtype)?;
                    if lin.packed.is_some() {
                        lin.packed = Some(Arc::new(PackedBf16::from_tensor(&lin.weight)?));
                    }
                }
            }
        }
        Ok(merged)
    }

    /// Every weight under its Hugging Face checkpoint name (tied `lm_head`
    /// omitted), for saving; quantized blocks dequantized to f32.
    pub fn named_weights(&self) -> Result<Vec<(String, Tensor)>> {
        let embed = match &self.embed_quant {
            Some(q) => q.dequantize()?,
            None => self.embed.detach(),
        };
        let mut out = vec![("model.embed_tokens.weight".to_string(), embed)];
        for (i, l) in self.layers.iter().enumerate() {
            let p = format!("model.layers.{i}");
            out.push((format!("{p}.input_layernorm.weight"), l.input_norm.detach()));
            out.push((
                format!("{p}.post_attention_layernorm.weight"),
                l.post_norm.detach(),
            ));
            for (t, lin) in l.linears() {
                out.push((format!("{p}.{}.weight", t.path()), lin.dense_weight()?));
                if let Some(b) = &lin.bias {
                    out.push((format!("{p}.{}.bias", t.path()), b.detach()));
                }
            }
            if let Some(n) = &l.attn.q_norm {
                out.push((format!("{p}.self_attn.q_norm.weight"), n.detach()));
            }
            if let Some(n) = &l.attn.k_norm {
                out.push((format!("{p}.self_attn.k_norm.weight"), n.detach()));
            }
        }
        out.push(("model.norm.weight".into(), self.norm.detach()));
        if let Some(h) = &self.lm_head {
            let h = match &self.head_packed {
                Some(HeadKernel::Quant(q)) => q.dequantize()?,
                _ => h.detach(),
            };
            out.push(("lm_head.weight".into(), h));
        }
        Ok(out)
    }

    fn check_ids(&self, ids: &[u32]) -> Result<()> {
        if let Some(&bad) = ids.iter().find(|&&t| t as usize >= self.cfg.vocab_size) {
            return Err(ModelError::InvalidInput(format!(
                "token id {bad} is out of range for vocabulary size {}",
                self.cfg.vocab_size
            )));
        }
        Ok(())
    }

    /// The one forward. `ids` holds the new tokens of all `segments`
    /// back to back; returns the final-norm hidden states `[ids.len(), hidden]`.
    /// Caches in `segments` are extended with the new keys and values.
    pub fn forward_hidden(
        &self,
        ids: &[u32],
        segments: &mut [Segment<'_>],
        lora: Option<&LoraAdapter>,
    ) -> Result<Tensor> {
        check_rows(ids, segments.iter().map(|s| s.len))?;
        let x = self.embed_rows(ids)?;
        // Whole sequences on the CPU take `packed_attention`: its rotary
        // tables, read once for every layer.
        let packed = if fused_attention_supported(&x) && segments.iter().all(|s| s.cache.is_none())
        {
            let seqs: Vec<PackedSeq> = segments.iter().map(|s| PackedSeq::whole(s.len)).collect();
            Some(self.packed(seqs)?)
        } else {
            None
        };
        let x = self.layers_forward(x, segments, packed.as_ref(), lora)?;
        for s in segments.iter_mut() {
            if let Some(c) = s.cache.as_deref_mut() {
                c.len += s.len;
            }
        }
        rms_norm(&x, &self.norm, self.cfg.rms_norm_eps)
    }

    /// [`Model::forward_hidden`] for whole sequences of which some continue
    /// an earlier one of the call ([`PackedSeq::after`]: an RL group's
    /// completions after their one prompt, a DPO pair's two sides after
    /// their prompt after the batch's system prompt): `ids` holds each
    /// sequence's own tokens, a continuation's rows are the positions after
    /// its chain of prefixes',
    /// and every row gets the bits it has in the unshared sequence. Needs the
    /// fused CPU attention ([`crate::kernels::fused_attention_supported`]).
    pub fn forward_packed(
        &self,
        ids: &[u32],
        seqs: &[PackedSeq],
        lora: Option<&LoraAdapter>,
    ) -> Result<Tensor> {
        check_rows(ids, seqs.iter().map(|s| s.len))?;
        let x = self.embed_rows(ids)?;
        if !fused_attention_supported(&x) {
            return Err(ModelError::InvalidInput(
                "sequences that share a prefix need the fused CPU attention".into(),
            ));
        }
        let packed = self.packed(seqs.to_vec())?;
        let mut segments: Vec<Segment<'_>> = seqs
            .iter()
            .map(|s| Segment {
                len: s.len,
                cache: None,
            })
            .collect();
        let x = self.layers_forward(x, &mut segments, Some(&packed), lora)?;
        rms_norm(&x, &self.norm, self.cfg.rms_norm_eps)
    }

    /// The embeddings of `ids` in the model's dtype.
    fn embed_rows(&self, ids: &[u32]) -> Result<Tensor> {
        self.check_ids(ids)?;
        if let Some(q) = &self.embed_quant {
            // The rows dequantized as the loader would (the same values).
            let h = self.cfg.hidden_size;
            let v = q.gather_rows(ids)?;
            return Ok(Tensor::from_vec(v, (ids.len(), h), &self.device)?.to_dtype(self.dtype)?);
        }
        let idx = Tensor::new(ids, &self.device)?;
        Ok(self.embed.index_select(&idx, 0)?.to_dtype(self.dtype)?)
    }

    /// The packed attention's plan: the sequences and rotary tables for the
    /// longest one (a continuation's prefixes counted).
    fn packed(&self, seqs: Vec<PackedSeq>) -> Result<Packed> {
        let longest = (0..seqs.len())
            .map(|s| PackedSeq::start(&seqs, s).map(|start| start + seqs[s].len))
            .collect::<Option<Vec<usize>>>()
            .ok_or_else(|| {
                ModelError::InvalidInput(format!(
                    "packed forward: sequences {seqs:?} (a prefix must be an earlier sequence)"
                ))
            })?
            .into_iter()
            .max()
            .unwrap_or(0);
        Ok(Packed {
            tables: Arc::new(self.rope.tables(longest)?),
            seqs,
        })
    }

    /// Every decoder layer over the embedded rows `x`.
    fn layers_forward(
        &self,
        mut x: Tensor,
        segments: &mut [Segment<'_>],
        packed: Option<&Packed>,
        lora: Option<&LoraAdapter>,
    ) -> Result<Tensor> {
        for (li, layer) in self.layers.iter().enumerate() {
            let h = rms_norm(&x, &layer.input_norm, self.cfg.rms_norm_eps)?;
            let a = self.attention(li, &layer.attn, &h, segments, packed, lora)?;
            x = (x + a)?;
            let h = rms_norm(&x, &layer.post_norm, self.cfg.rms_norm_eps)?;
            let m = self.mlp(li, &layer.mlp, &h, lora)?;
            x = (x + m)?;
        }
        Ok(x)
    }

    /// Logits `[n, vocab]` for hidden states `[n, hidden]`.
    pub fn logits(&self, hidden: &Tensor) -> Result<Tensor> {
        let head = self.head_weight();
        match &self.head_packed {
            Some(HeadKernel::Quant(q)) => matmul_nt_quant_op(hidden, q),
            Some(HeadKernel::Bf16(p)) if use_matmul_nt(self.matmul, hidden, head) => {
                matmul_nt_packed(hidden, p)
            }
            _ => linear_nt(self.matmul, hidden, head),
        }
    }

    /// The head weight in its kernel's form (packed bf16 or quantized
    /// weights; `None` for a plain f32 one).
    pub(crate) fn head_packed(&self) -> Option<&HeadKernel> {
        self.head_packed.as_ref()
    }

    /// The output projection `[vocab, hidden]` (the embedding when tied);
    /// only a shape placeholder when [`Model::head_packed`] is quantized.
    pub(crate) fn head_weight(&self) -> &Tensor {
        self.lm_head.as_ref().unwrap_or(&self.embed)
    }

    fn lora_of(
        lora: Option<&LoraAdapter>,
        layer: usize,
        t: Target,
    ) -> Option<(&LoraPair, f64, bool)> {
        lora.and_then(|a| {
            a.get(layer, t)
                .map(|p| (p, a.scale(), a.tracks_gradients()))
        })
    }

    fn mlp(&self, li: usize, m: &Mlp, x: &Tensor, lora: Option<&LoraAdapter>) -> Result<Tensor> {
        let gate = m.gate.forward(x, Self::lora_of(lora, li, Target::Gate))?;
        let up = m.up.forward(x, Self::lora_of(lora, li, Target::Up))?;
        let act = if fused_swiglu_supported(&gate, &up) {
            crate::kernels::swiglu(&gate, &up)?
        } else {
            (gate.silu()? * up)?
        };
        m.down.forward(&act, Self::lora_of(lora, li, Target::Down))
    }

    fn attention(
        &self,
        li: usize,
        at: &Attention,
        x: &Tensor,
        segments: &mut [Segment<'_>],
        packed: Option<&Packed>,
        lora: Option<&LoraAdapter>,
    ) -> Result<Tensor> {
        let (nh, nkv, hd) = (self.cfg.num_heads, self.cfg.num_kv_heads, self.cfg.head_dim);
        let groups = nh / nkv;
        let q = at.q.forward(x, Self::lora_of(lora, li, Target::Q))?;
        let k = at.k.forward(x, Self::lora_of(lora, li, Target::K))?;
        let v = at.v.forward(x, Self::lora_of(lora, li, Target::V))?;
        let scale = 1.0 / (hd as f64).sqrt();
        let fused = fused_attention_supported(&q);
        if let Some(packed) = packed {
            // Whole sequences (training, scoring): every sequence's rotation
            // and attention in one op on the packed rows, the same bits as
            // the per-sequence path below.
            let n = x.dim(0)?;
            let (mut q, mut k) = (q, k);
            if let (Some(qn), Some(kn)) = (&at.q_norm, &at.k_norm) {
                let eps = self.cfg.rms_norm_eps;
                q = rms_norm(&q.reshape((n, nh, hd))?, qn, eps)?.reshape((n, nh * hd))?;
                k = rms_norm(&k.reshape((n, nkv, hd))?, kn, eps)?.reshape((n, nkv * hd))?;
            }
            let shape = PackedHeads {
                heads: nh,
                kv_heads: nkv,
                head_dim: hd,
            };
            let o = packed_attention(
                &q,
                &k,
                &v,
                &packed.seqs,
                shape,
                packed.tables.clone(),
                scale,
            )?;
            return at.o.forward(&o, Self::lora_of(lora, li, Target::O));
        }
        let mut pending = Vec::new();
        let mut outs = Vec::with_capacity(segments.len());
        let mut start = 0;
        for seg in segments.iter_mut() {
            let len = seg.len;
            let pos = seg.cache.as_deref().map_or(0, |c| c.len);
            // [len, heads, hd]
            let mut qs = q.narrow(0, start, len)?.reshape((len, nh, hd))?;
            let mut ks = k.narrow(0, start, len)?.reshape((len, nkv, hd))?;
            let vs = v.narrow(0, start, len)?.reshape((len, nkv, hd))?;
            if let (Some(qn), Some(kn)) = (&at.q_norm, &at.k_norm) {
                qs = rms_norm(&qs, qn, self.cfg.rms_norm_eps)?;
                ks = rms_norm(&ks, kn, self.cfg.rms_norm_eps)?;
            }
            // [heads, len, hd]
            let qs = self.rope.apply(&qs.transpose(0, 1)?.contiguous()?, pos)?;
            let mut ks = self.rope.apply(&ks.transpose(0, 1)?.contiguous()?, pos)?;
            let mut vs = vs.transpose(0, 1)?.contiguous()?;
            if let Some(cache) = seg.cache.as_deref_mut() {
                (ks, vs) = cache.append(li, &ks, &vs)?;
            }
            let o = if fused {
                // Computed below, all segments together.
                pending.push((qs, ks, vs, len));
                start += len;
                continue;
            } else {
                let (ks, vs) = (ks.contiguous()?, vs.contiguous()?);
                let kv_len = pos + len;
                // Query head h uses kv head h / groups (transformers' repeat_kv),
                // so [nh, len, hd] regroups as [nkv, groups·len, hd] without copying K/V.
                let qg = qs.reshape((nkv, groups * len, hd))?;
                let scores = qg.matmul(&ks.t()?)?.affine(scale, 0.0)?;
                let scores = if len > 1 {
                    let mask = causal_mask(len, pos, &self.device, scores.dtype())?;
                    scores
                        .reshape((nkv, groups, len, kv_len))?
                        .broadcast_add(&mask)?
                        .reshape((nkv, groups * len, kv_len))?
                } else {
                    scores
                };
                let probs = softmax_last(&scores)?;
                let o = probs.matmul(&vs)?; // [nkv, groups·len, hd]
                o.reshape((nh, len, hd))?
                    .transpose(0, 1)?
                    .reshape((len, nh * hd))?
            };
            outs.push(o);
            start += len;
        }
        if fused {
            outs = attend_segments(&pending, scale)?;
        }
        let o = if outs.len() == 1 {
            outs.pop()
                .ok_or_else(|| ModelError::InvalidInput("no segments".into()))?
        } else {
            Tensor::cat(&outs, 0)?
        };
        at.o.forward(&o, Self::lora_of(lora, li, Target::O))
    }
}

impl Model {
    /// Batched decode for serving: one new token per sequence (`ids[i]`
    /// continues `caches[i]`), appended to each cache; returns the final-norm
    /// hidden states `[ids.len(), hidden]`. Linear layers run over all
    /// sequences at once; on the CPU in f32, attention runs the same
    /// [`causal_attention`] kernel per sequence as [`Model::forward_hidden`]
    /// (bit-identical attention per token, and with the batch-invariant
    /// matmul bit-identical logits: see [`Model::decode_logits_are_exact`]);
    /// elsewhere the caches are padded to the longest and masked. Inference
    /// only (no autograd use intended).
    pub fn forward_decode(
        &self,
        ids: &[u32],
        caches: &mut [&mut KvCache],
        lora: Option<&LoraAdapter>,
    ) -> Result<Tensor> {
        let b = ids.len();
        if b == 0 || caches.len() != b {
            return Err(ModelError::InvalidInput(format!(
                "batched decode: {b} ids for {} caches",
                caches.len()
            )));
        }
        self.check_ids(ids)?;
        let max_pos = self.cfg.max_position_embeddings;
        if let Some(c) = caches.iter().find(|c| c.len >= max_pos) {
            return Err(ModelError::InvalidInput(format!(
                "sequence of {} tokens exceeds the model's context length {max_pos}",
                c.len + 1
            )));
        }
        let (nh, nkv, hd) = (self.cfg.num_heads, self.cfg.num_kv_heads, self.cfg.head_dim);
        let groups = nh / nkv;
        let scale = 1.0 / (hd as f64).sqrt();
        let eps = self.cfg.rms_norm_eps;
        let positions: Vec<u32> = caches.iter().map(|c| c.len as u32).collect();
        let pos = Tensor::new(positions.as_slice(), &self.device)?;
        let kv_len: Vec<usize> = caches.iter().map(|c| c.len + 1).collect();
        let lmax = kv_len.iter().copied().max().unwrap_or(1);
        let mask: Vec<f32> = kv_len
            .iter()
            .flat_map(|&l| (0..lmax).map(move |j| if j < l { 0.0 } else { f32::NEG_INFINITY }))
            .collect();
        let mask = Tensor::from_vec(mask, (b, 1, 1, lmax), &self.device)?.to_dtype(self.dtype)?;
        let mut x = self.embed_rows(ids)?;
        for (li, layer) in self.layers.iter().enumerate() {
            let at = &layer.attn;
            let h = rms_norm(&x, &layer.input_norm, eps)?;
            let mut q =
                at.q.forward(&h, Self::lora_of(lora, li, Target::Q))?
                    .reshape((b, nh, hd))?;
            let mut k =
                at.k.forward(&h, Self::lora_of(lora, li, Target::K))?
                    .reshape((b, nkv, hd))?;
            let v =
                at.v.forward(&h, Self::lora_of(lora, li, Target::V))?
                    .reshape((b, nkv, hd))?;
            if let (Some(qn), Some(kn)) = (&at.q_norm, &at.k_norm) {
                q = rms_norm(&q, qn, eps)?;
                k = rms_norm(&k, kn, eps)?;
            }
            let q = self.rope.apply_rows(&q.contiguous()?, &pos)?;
            let k = self.rope.apply_rows(&k.contiguous()?, &pos)?;
            let fused = fused_attention_supported(&q);
            let mut ks = Vec::with_capacity(b);
            let mut vs = Vec::with_capacity(b);
            let mut fused_in = Vec::with_capacity(b);
            for (i, c) in caches.iter_mut().enumerate() {
                let ki = k.get(i)?.unsqueeze(1)?;
                let vi = v.get(i)?.unsqueeze(1)?;
                let (kc, vc) = c.append(li, &ki, &vi)?;
                if fused {
                    fused_in.push((q.get(i)?.unsqueeze(1)?, kc, vc, 1)); // q: [nh, 1, hd]
                    continue;
                }
                let pad = lmax - kv_len[i];
                if pad > 0 {
                    ks.push(kc.pad_with_zeros(1, 0, pad)?);
                    vs.push(vc.pad_with_zeros(1, 0, pad)?);
                } else {
                    ks.push(kc);
                    vs.push(vc);
                }
            }
            let o = if fused {
                // The same kernel as `forward_hidden`: each token's attention
                // is bit-identical to a full forward's.
                Tensor::cat(&attend_segments(&fused_in, scale)?, 0)?
            } else {
                let kb = Tensor::stack(&ks, 0)?; // [b, nkv, lmax, hd]
                let vb = Tensor::stack(&vs, 0)?;
                // Query head h uses kv head h / groups, as in `attention`.
                let qg = q.reshape((b, nkv, groups, hd))?;
                let scores = qg
                    .matmul(&kb.transpose(2, 3)?)?
                    .affine(scale, 0.0)?
                    .broadcast_add(&mask)?;
                let probs = softmax_last(&scores)?;
                probs.matmul(&vb)?.reshape((b, nh * hd))?
            };
            x = (x + at.o.forward(&o, Self::lora_of(lora, li, Target::O))?)?;
            let h = rms_norm(&x, &layer.post_norm, eps)?;
            x = (x + self.mlp(li, &layer.mlp, &h, lora)?)?;
        }
        for c in caches.iter_mut() {
            c.len += 1;
        }
        rms_norm(&x, &self.norm, eps)
    }
}

/// [`causal_attention`] of each segment's `(q [heads, len, hd], k, v, len)`,
/// as `[len, heads·hd]` rows. Online softmax over fixed key blocks: linear
/// memory, and each query's output independent of the call's shape. Several
/// short segments (a decode step: one token each) are too small to split one
/// by one, so they run across threads; the same kernel per segment either
/// way, so the same bits.
fn attend_segments(segs: &[(Tensor, Tensor, Tensor, usize)], scale: f64) -> Result<Vec<Tensor>> {
    let one = |(q, k, v, len): &(Tensor, Tensor, Tensor, usize)| -> Result<Tensor> {
        let o = causal_attention(q, k, v, scale)?;
        let (heads, _, hd) = o.dims3()?;
        Ok(o.transpose(0, 1)?.reshape((*len, heads * hd))?)
    };
    if segs.len() > 1 {
        segs.par_iter().map(one).collect()
    } else {
        segs.iter().map(one).collect()
    }
}

/// `[len, pos+len]` additive mask: query i (at position pos+i) sees keys 0..=pos+i.
fn causal_mask(len: usize, pos: usize, device: &Device, dtype: DType) -> Result<Tensor> {
    let kv = pos + len;
    let mask: Vec<f32> = (0..len)
        .flat_map(|i| (0..kv).map(move |j| if j > pos + i { f32::NEG_INFINITY } else { 0.0 }))
        .collect();
    Ok(Tensor::from_vec(mask, (len, kv), device)?.to_dtype(dtype)?)
}
