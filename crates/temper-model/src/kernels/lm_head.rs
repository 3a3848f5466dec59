//! The LM head fused with log-softmax, target gather and entropy.
//!
//! `[tokens, vocab]` f32 logits are the largest tensors of a training step
//! (49k-token vocabularies × thousands of tokens). The composed candle version
//! keeps the logits, their shifted copy, `exp`, the log-softmax and
//! `p·log p` alive for the backward: five `[tokens, vocab]` tensors per
//! sequence. This op instead walks the rows in fixed blocks of
//! [`ROW_BLOCK`]: each block's logits live only while that block is reduced
//! to two numbers per row (target logprob, entropy). Nothing `vocab`-wide
//! outlives a block.
//!
//! Backward: when the input is tracked, the forward also stores, per row, the
//! hidden-space gradient of the target logprob, `(onehot − p)·W / T`
//! (`[tokens, hidden]`, small), so the backward of the usual loss (one that
//! depends on the logprobs) is a scale of it; the entropy's gradient, rarely
//! used, recomputes the block's logits instead of storing anything.
//!
//! Numbers: a row's outputs depend only on its hidden state, its target and
//! its position modulo [`ROW_BLOCK`] (the block's matmul shape), so the same
//! sequence gives bit-identical logprobs wherever it is scored (sampler and
//! trainer call the same function on the same rows).

use std::sync::{Arc, Mutex, PoisonError};

use candle_core::{CpuStorage, CustomOp1, DType, Device, Layout, Shape, Tensor};
use rayon::prelude::*;

use super::matmul_bf16::PackedBf16;
use super::quant::QuantWeight;
use crate::error::{ModelError, Result};

/// The LM head in a form its kernels read instead of the plain weight
/// tensor (which then only gives the shape, see [`HeadKernel::Quant`]).
#[derive(Debug, Clone)]
pub enum HeadKernel {
    /// bf16 weights packed for the bf16 kernel.
    Bf16(Arc<PackedBf16>),
    /// GGUF blocks kept quantized (`--dtype gguf`): the logits are the
    /// quantized matmul's, the same bits as the f32 kernel on the
    /// dequantized weight. The weight tensor passed beside it is a
    /// placeholder of the right shape and is never read.
    Quant(QuantWeight),
}

/// Rows of logits materialised at a time (`ROW_BLOCK × vocab` f32).
pub const ROW_BLOCK: usize = 64;

/// Per-row target logprob and entropy of `softmax(hidden·Wᵀ / temperature)`.
/// `hidden`: `[n, h]` f32 on the CPU; `weight`: `[vocab, h]`;
/// `targets`: `n` ids `< vocab`. Returns `(logprobs [n], entropy [n])`, both
/// differentiable w.r.t. `hidden` (not `weight`: LoRA never trains the head;
/// full-parameter training of the head uses the composed path).
pub fn lm_head_logprobs(
    hidden: &Tensor,
    weight: &Tensor,
    targets: &[u32],
    temperature: f64,
    packed: Option<&HeadKernel>,
    matmul: super::ForwardMatmul,
) -> Result<(Tensor, Tensor)> {
    let (n, h) = hidden.dims2()?;
    let (vocab, wh) = weight.dims2()?;
    if wh != h || targets.len() != n {
        return Err(ModelError::InvalidInput(format!(
            "lm_head_logprobs: hidden {n}x{h}, weight {vocab}x{wh}, {} targets",
            targets.len()
        )));
    }
    if let Some(&bad) = targets.iter().find(|&&t| t as usize >= vocab) {
        return Err(ModelError::InvalidInput(format!(
            "target token {bad} out of range for vocabulary size {vocab}"
        )));
    }
    let op = LmHeadLogprobs {
        weight: head_operand(weight, packed)?,
        packed: packed.cloned(),
        matmul,
        targets: Arc::new(targets.to_vec()),
        inv_temp: (1.0 / temperature) as f32,
        save_grad: hidden.track_op(),
        saved: Arc::new(Mutex::new(None)),
    };
    let out = hidden.contiguous()?.apply_op1(op)?; // [n, 2]
    Ok((
        out.narrow(1, 0, 1)?.squeeze(1)?,
        out.narrow(1, 1, 1)?.squeeze(1)?,
    ))
}

/// Call `f(row, logprobs)` with the full `vocab`-wide log-softmax of every
/// row of `hidden`, one [`ROW_BLOCK`] at a time, computed exactly as
/// [`lm_head_logprobs`] computes its target logprobs (bit-identical at the
/// target). No autograd.
pub fn for_each_logprob_row(
    hidden: &Tensor,
    weight: &Tensor,
    temperature: f64,
    (packed, matmul): (Option<&HeadKernel>, super::ForwardMatmul),
    mut f: impl FnMut(usize, &[f32]) -> Result<()>,
) -> Result<()> {
    let (n, h) = hidden.dims2()?;
    let (vocab, wh) = weight.dims2()?;
    if wh != h {
        return Err(ModelError::InvalidInput(format!(
            "for_each_logprob_row: hidden {n}x{h}, weight {vocab}x{wh}"
        )));
    }
    let weight = head_operand(weight, packed)?;
    let x: Vec<f32> = hidden
        .detach()
        .to_dtype(DType::F32)?
        .flatten_all()?
        .to_vec1()?;
    let inv_temp = (1.0 / temperature) as f32;
    for start in (0..n).step_by(ROW_BLOCK) {
        let rows = ROW_BLOCK.min(n - start);
        let xb = &x[start * h..(start + rows) * h];
        let mut s = block_logits(xb, rows, h, &weight, (packed, matmul))?;
        s.par_chunks_mut(vocab)
            .for_each(|row| log_softmax_in_place(row, inv_temp));
        for (i, row) in s.chunks(vocab).enumerate() {
            f(start + i, row)?;
        }
    }
    Ok(())
}

/// Whether [`lm_head_logprobs`] handles this input (f32 hidden states on
/// the CPU; an f32 or bf16 weight).
pub fn fused_lm_head_supported(hidden: &Tensor, weight: &Tensor) -> bool {
    hidden.device().is_cpu()
        && hidden.dtype() == DType::F32
        && matches!(weight.dtype(), DType::F32 | DType::BF16)
        && !weight.is_variable()
}

/// The head weight as the kernels read it: a bf16 weight on the CPU stays
/// bf16 (its logits are then those of [`super::matmul_nt`] on it, as in a
/// decode step), anything else becomes f32; beside a quantized head it is
/// the shape's placeholder, left as it is.
fn head_operand(weight: &Tensor, packed: Option<&HeadKernel>) -> candle_core::Result<Tensor> {
    let w = weight.detach();
    if let Some(HeadKernel::Quant(_)) = packed {
        return Ok(w);
    }
    if w.dtype() == DType::BF16 && w.device().is_cpu() {
        return w.contiguous();
    }
    w.to_dtype(DType::F32)?.contiguous()
}

struct LmHeadLogprobs {
    weight: Tensor,
    /// The packed bf16 or quantized head, which computes the logits when
    /// present.
    packed: Option<HeadKernel>,
    /// The model's forward matmul, which the logits follow.
    matmul: super::ForwardMatmul,
    targets: Arc<Vec<u32>>,
    inv_temp: f32,
    /// Store `d logprob / d hidden` in the forward (input is tracked).
    save_grad: bool,
    saved: Arc<Mutex<Option<Tensor>>>,
}

/// `log softmax(logits / T)[target]` of one row of logits, reduced exactly as
/// [`lm_head_logprobs`] reduces its rows: given the same logits bits, a
/// decode step's logprob equals the trainer's.
pub fn row_logprob(logits: &[f32], target: usize, temperature: f64) -> f32 {
    let mut row = logits.to_vec();
    reduce_row(&mut row, target, (1.0 / temperature) as f32).0
}

/// The whole `log softmax(logits / T)` of one row of logits, computed
/// exactly as [`for_each_logprob_row`] computes its rows: given the same
/// logits bits, a decode step's `top_logprobs` equal the trainer's.
pub fn row_log_softmax(logits: &[f32], temperature: f64) -> Vec<f32> {
    let mut row = logits.to_vec();
    log_softmax_in_place(&mut row, (1.0 / temperature) as f32);
    row
}

/// `row` ← `log softmax(row · inv_temp)`, reduced as [`reduce_row`] does.
fn log_softmax_in_place(row: &mut [f32], inv_temp: f32) {
    let (_, _, log_sum) = reduce_row(row, 0, inv_temp);
    for z in row.iter_mut() {
        *z = (*z as f64 - log_sum) as f32;
    }
}

/// Per-row `(logprob of target, entropy, log Σ exp(s − max))` of scaled
/// logits `s`, with `row` overwritten by `s − max`. The sums run in f64 over
/// eight interleaved lanes (element `j` into lane `j mod 8`), combined in a
/// fixed order: deterministic, independent of the thread count, and
/// vectorized (`exp` is [`super::exp::exp`]).
fn reduce_row(row: &mut [f32], target: usize, inv_temp: f32) -> (f32, f32, f64) {
    let (sum, dot) = shift_and_sum(row, inv_temp);
    let log_sum = sum.ln();
    // log p_t = z_t − log Σ; entropy = −Σ p (z − log Σ) = log Σ − Σ e·z / Σ e.
    let lp = row[target] as f64 - log_sum;
    let ent = log_sum - dot / sum;
    (lp as f32, ent as f32, log_sum)
}

twice_compiled! {
    /// `row` ← `row·inv_temp − max`; returns `(Σ e^z, Σ e^z·z)` over the
    /// new values `z`.
    fn shift_and_sum / shift_and_sum_body(row: &mut [f32], inv_temp: f32) -> (f64, f64)
}

#[inline(always)]
fn shift_and_sum_body(row: &mut [f32], inv_temp: f32) -> (f64, f64) {
    const L: usize = 8;
    let mut mx = [f32::NEG_INFINITY; L];
    let mut chunks = row.chunks_exact_mut(L);
    for c in &mut chunks {
        for l in 0..L {
            c[l] *= inv_temp;
            mx[l] = mx[l].max(c[l]);
        }
    }
    for (l, x) in chunks.into_remainder().iter_mut().enumerate() {
        *x *= inv_temp;
        mx[l] = mx[l].max(*x);
    }
    // The maximum is exact whatever the order.
    let m = mx.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
    let mut sum = [0f64; L];
    let mut dot = [0f64; L];
    let mut chunks = row.chunks_exact_mut(L);
    for c in &mut chunks {
        let mut e = [0f32; L];
        for l in 0..L {
            c[l] -= m;
            e[l] = super::exp::exp(c[l]);
        }
        for l in 0..L {
            sum[l] += e[l] as f64;
            dot[l] += e[l] as f64 * c[l] as f64;
        }
    }
    for (l, x) in chunks.into_remainder().iter_mut().enumerate() {
        *x -= m;
        let e = super::exp::exp(*x) as f64;
        sum[l] += e;
        dot[l] += e * *x as f64;
    }
    let fold = |v: [f64; L]| ((v[0] + v[4]) + (v[2] + v[6])) + ((v[1] + v[5]) + (v[3] + v[7]));
    (fold(sum), fold(dot))
}

/// Logits `[rows, vocab]` of one block of hidden rows, as a flat vector.
fn block_logits(
    xb: &[f32],
    rows: usize,
    h: usize,
    weight: &Tensor,
    (packed, matmul): (Option<&HeadKernel>, super::ForwardMatmul),
) -> candle_core::Result<Vec<f32>> {
    if let Some(HeadKernel::Quant(q)) = packed {
        // The quantized head has no other kernel: the decode step's.
        let (vocab, _) = q.dims();
        return q.with_rows(|w| {
            let mut y = vec![0f32; rows * vocab];
            super::quant::matmul_nt_quant(xb, w, rows, vocab, h, &mut y);
            Ok(y)
        });
    }
    if let (Some(HeadKernel::Bf16(p)), super::ForwardMatmul::BatchInvariant) = (packed, matmul) {
        // The model's bf16 forward: the same packed kernel as its decode
        // logits.
        return Ok(super::matmul::rows_times_packed(xb, rows, p));
    }
    if matches!(weight.dtype(), DType::F32 | DType::BF16)
        && weight.device().is_cpu()
        && matmul == super::ForwardMatmul::BatchInvariant
    {
        // Every row reduced in one fixed order: a one-token sequence's
        // logits equal its row in a longer call.
        return super::matmul::rows_times_weight(xb, rows, weight);
    }
    let x = Tensor::from_slice(xb, (rows, h), &Device::Cpu)?;
    let weight = &weight.to_dtype(DType::F32)?;
    if rows == 1 {
        // candle's CPU matmul takes a matrix-vector path for one row, which
        // rounds differently from the same row inside a larger call; compute
        // a lone row as the first of two so a one-token sequence's logits
        // match its row in a longer one.
        let x2 = Tensor::cat(&[&x, &x.zeros_like()?], 0)?;
        let y = x2.matmul(&weight.t()?)?.narrow(0, 0, 1)?;
        return y.flatten_all()?.to_vec1::<f32>();
    }
    x.matmul(&weight.t()?)?.flatten_all()?.to_vec1::<f32>()
}

impl LmHeadLogprobs {
    /// [`block_logits`] of one block through this head's kernel.
    fn logits(&self, xb: &[f32], rows: usize, h: usize) -> candle_core::Result<Vec<f32>> {
        block_logits(
            xb,
            rows,
            h,
            &self.weight,
            (self.packed.as_ref(), self.matmul),
        )
    }

    /// `∂L/∂hidden` for one block given per-row upstream gradients of the
    /// logprob (`g_lp`) and entropy (`g_ent`): with `s = logits/T`,
    /// `∂L/∂s_j = g_lp (δ_jt − p_j) − g_ent p_j (log p_j + H)`, then `·W / T`.
    fn block_grad(
        &self,
        xb: &[f32],
        start: usize,
        g_lp: &[f32],
        g_ent: &[f32],
    ) -> candle_core::Result<Tensor> {
        let rows = g_lp.len();
        let (vocab, h) = self.weight.dims2()?;
        let mut s = self.logits(xb, rows, h)?;
        let targets = &self.targets[start..start + rows];
        let inv_temp = self.inv_temp;
        s.par_chunks_mut(vocab)
            .zip(targets.par_iter())
            .zip(g_lp.par_iter().zip(g_ent.par_iter()))
            .for_each(|((row, &t), (&gl, &ge))| {
                let (_, ent, log_sum) = reduce_row(row, t as usize, inv_temp);
                grad_row(row, t as usize, log_sum, ent, gl, ge, inv_temp);
            });
        self.times_weight(s, rows)
    }

    /// `ds·W` for a block's `[rows, vocab]` logit gradients: the hidden-space
    /// gradient `[rows, h]`, through `matmul_nn` (on this 64-row, 49k-long
    /// reduction 1.1× candle's `gemm`: `temper bench kernels --intermediate
    /// 49152 --rows 64`, row `gate_up`), or for a packed bf16 head the
    /// packed kernel on its transpose.
    fn times_weight(&self, ds: Vec<f32>, rows: usize) -> candle_core::Result<Tensor> {
        let (vocab, h) = self.weight.dims2()?;
        if let Some(HeadKernel::Quant(q)) = &self.packed {
            // Through the dequantized rows, as every quantized weight's
            // input gradient.
            let mut dx = vec![0f32; rows * h];
            q.with_rows(|w| {
                super::matmul_nn::matmul_nn_rows(
                    &ds,
                    super::WeightRows::Quant(w),
                    rows,
                    vocab,
                    h,
                    &mut dx,
                );
                Ok(())
            })?;
            return Tensor::from_vec(dx, (rows, h), &Device::Cpu);
        }
        if let (Some(HeadKernel::Bf16(p)), super::ForwardMatmul::BatchInvariant) =
            (self.packed.as_ref(), self.matmul)
        {
            // `ds` rounded to bf16, as the forward rounds its inputs.
            let y = super::matmul::rows_times_packed(&ds, rows, p.transposed());
            return Tensor::from_vec(y, (rows, h), &Device::Cpu);
        }
        let ds = Tensor::from_vec(ds, (rows, vocab), &Device::Cpu)?;
        super::matmul_nn(&ds, &self.weight)
    }
}

/// Overwrite a reduced row (`s − max`, see [`reduce_row`]) with `∂L/∂logits`
/// given the upstream gradients of its logprob (`gl`) and entropy (`ge`).
fn grad_row(
    row: &mut [f32],
    target: usize,
    log_sum: f64,
    ent: f32,
    gl: f32,
    ge: f32,
    inv_temp: f32,
) {
    grad_row_values(row, log_sum, ent, gl, ge, inv_temp);
    row[target] += gl * inv_temp;
}

twice_compiled! {
    /// [`grad_row`] but for the target's one-hot term.
    fn grad_row_values / grad_row_body(row: &mut [f32], log_sum: f64, ent: f32, gl: f32, ge: f32, inv_temp: f32)
}

#[inline(always)]
fn grad_row_body(row: &mut [f32], log_sum: f64, ent: f32, gl: f32, ge: f32, inv_temp: f32) {
    for x in row.iter_mut() {
        let lp = (*x as f64 - log_sum) as f32;
        let p = super::exp::exp(lp);
        let mut d = -gl * p;
        if ge != 0.0 {
            d -= ge * p * (lp + ent);
        }
        *x = d * inv_temp;
    }
}

fn cpu_input<'a>(storage: &'a CpuStorage, layout: &Layout) -> candle_core::Result<&'a [f32]> {
    let (start, end) = layout
        .contiguous_offsets()
        .ok_or_else(|| candle_core::Error::Msg("lm-head-logprobs: non-contiguous input".into()))?;
    match storage {
        CpuStorage::F32(v) => Ok(&v[start..end]),
        _ => Err(candle_core::Error::Msg(
            "lm-head-logprobs: f32 input only".into(),
        )),
    }
}

impl CustomOp1 for LmHeadLogprobs {
    fn name(&self) -> &'static str {
        "lm-head-logprobs"
    }

    fn cpu_fwd(
        &self,
        storage: &CpuStorage,
        layout: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let x = cpu_input(storage, layout)?;
        let (n, h) = layout.shape().dims2()?;
        let (vocab, _) = self.weight.dims2()?;
        let mut out = vec![0f32; 2 * n];
        let mut saved = Vec::new();
        for start in (0..n).step_by(ROW_BLOCK) {
            let rows = ROW_BLOCK.min(n - start);
            let xb = &x[start * h..(start + rows) * h];
            let mut s = self.logits(xb, rows, h)?;
            let targets = &self.targets[start..start + rows];
            let save_grad = self.save_grad;
            let inv_temp = self.inv_temp;
            let stats: Vec<(f32, f32)> = s
                .par_chunks_mut(vocab)
                .zip(targets.par_iter())
                .map(|(row, &t)| {
                    let (lp, ent, log_sum) = reduce_row(row, t as usize, inv_temp);
                    if save_grad {
                        // The logprob's gradient from these same logits (what
                        // `block_grad` with g_lp = 1, g_ent = 0 recomputes).
                        grad_row(row, t as usize, log_sum, ent, 1.0, 0.0, inv_temp);
                    }
                    (lp, ent)
                })
                .collect();
            for (i, (lp, ent)) in stats.into_iter().enumerate() {
                out[2 * (start + i)] = lp;
                out[2 * (start + i) + 1] = ent;
            }
            if save_grad {
                saved.push(self.times_weight(s, rows)?);
            }
        }
        if self.save_grad {
            let g = Tensor::cat(&saved, 0)?;
            *self.saved.lock().unwrap_or_else(PoisonError::into_inner) = Some(g);
        }
        Ok((CpuStorage::F32(out), Shape::from((n, 2))))
    }

    fn bwd(
        &self,
        arg: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<Option<Tensor>> {
        let (n, h) = arg.dims2()?;
        let g: Vec<f32> = grad.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?;
        let g_lp: Vec<f32> = g.iter().step_by(2).copied().collect();
        let g_ent: Vec<f32> = g.iter().skip(1).step_by(2).copied().collect();
        let saved = self
            .saved
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        let need_ent = g_ent.iter().any(|&x| x != 0.0);
        let mut dh = match &saved {
            Some(d) => Some(d.broadcast_mul(&Tensor::from_slice(&g_lp, (n, 1), &Device::Cpu)?)?),
            None => None,
        };
        if saved.is_none() || need_ent {
            let x: Vec<f32> = arg.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?;
            let zeros = vec![0f32; n];
            let g_lp_rest: &[f32] = if saved.is_some() { &zeros } else { &g_lp };
            let mut parts = Vec::new();
            for start in (0..n).step_by(ROW_BLOCK) {
                let rows = ROW_BLOCK.min(n - start);
                parts.push(self.block_grad(
                    &x[start * h..(start + rows) * h],
                    start,
                    &g_lp_rest[start..start + rows],
                    &g_ent[start..start + rows],
                )?);
            }
            let rest = Tensor::cat(&parts, 0)?;
            dh = Some(match dh {
                Some(d) => (d + rest)?,
                None => rest,
            });
        }
        Ok(dh)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::test_util::v64;
    use candle_core::{Var, D};

    const N: usize = 150; // two full blocks and a partial one
    const H: usize = 24;
    const V: usize = 301;

    /// The head without a packed kernel, with the default matmul.
    fn plain_head(
        hidden: &Tensor,
        weight: &Tensor,
        targets: &[u32],
        t: f64,
    ) -> Result<(Tensor, Tensor)> {
        lm_head_logprobs(hidden, weight, targets, t, None, Default::default())
    }

    fn inputs(seed: u64) -> (Var, Tensor, Vec<u32>, Tensor, Tensor) {
        use rand::{Rng, SeedableRng};
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        let mut r = |n: usize, s: f32| -> Vec<f32> {
            (0..n).map(|_| rng.random_range(-1.0f32..1.0) * s).collect()
        };
        let dev = Device::Cpu;
        let hidden = Var::from_vec(r(N * H, 1.0), (N, H), &dev).unwrap();
        let weight = Tensor::from_vec(r(V * H, 0.5), (V, H), &dev).unwrap();
        let a = Tensor::from_vec(r(N, 1.0), N, &dev).unwrap();
        let b = Tensor::from_vec(r(N, 1.0), N, &dev).unwrap();
        let targets = (0..N).map(|i| ((i * 37 + 11) % V) as u32).collect();
        (hidden, weight, targets, a, b)
    }

    /// The composed candle version in f64: logits, log-softmax, gather, entropy.
    fn composed(hidden: &Tensor, weight: &Tensor, targets: &[u32], t: f64) -> (Tensor, Tensor) {
        let logits = hidden
            .to_dtype(DType::F64)
            .unwrap()
            .matmul(&weight.to_dtype(DType::F64).unwrap().t().unwrap())
            .unwrap()
            .affine(1.0 / t, 0.0)
            .unwrap();
        let lp = crate::arch::model::log_softmax_last(&logits).unwrap();
        let idx = Tensor::new(targets, &Device::Cpu)
            .unwrap()
            .unsqueeze(1)
            .unwrap();
        let g = lp.gather(&idx, 1).unwrap().squeeze(1).unwrap();
        let ent = (lp.exp().unwrap() * &lp)
            .unwrap()
            .sum(D::Minus1)
            .unwrap()
            .neg()
            .unwrap();
        (g, ent)
    }

    fn max_abs_diff(x: &[f64], y: &[f64]) -> f64 {
        assert_eq!(x.len(), y.len());
        x.iter()
            .zip(y)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0, f64::max)
    }

    /// Loss mixing both outputs with random per-row weights.
    fn loss(lp: &Tensor, ent: &Tensor, a: &Tensor, b: &Tensor) -> Tensor {
        let dt = lp.dtype();
        let a = a.to_dtype(dt).unwrap();
        let b = b.to_dtype(dt).unwrap();
        ((lp * a).unwrap().sum_all().unwrap() + (ent * b).unwrap().sum_all().unwrap()).unwrap()
    }

    #[test]
    fn fused_lm_head_matches_composed_values_and_gradients() {
        for (seed, t) in [(1u64, 1.0f64), (2, 0.7)] {
            let (hidden, weight, targets, a, b) = inputs(seed);
            let (lp, ent) = plain_head(hidden.as_tensor(), &weight, &targets, t).unwrap();
            let (rlp, rent) = composed(hidden.as_tensor(), &weight, &targets, t);
            assert!(max_abs_diff(&v64(&lp), &v64(&rlp)) < 1e-5);
            assert!(max_abs_diff(&v64(&ent), &v64(&rent)) < 1e-5);

            let g = loss(&lp, &ent, &a, &b).backward().unwrap();
            let g = v64(g.get(hidden.as_tensor()).expect("hidden grad"));
            let h64 = Var::from_tensor(&hidden.as_tensor().to_dtype(DType::F64).unwrap()).unwrap();
            let (rlp, rent) = composed(h64.as_tensor(), &weight, &targets, t);
            let rg = loss(&rlp, &rent, &a, &b).backward().unwrap();
            let rg = v64(rg.get(h64.as_tensor()).expect("reference grad"));
            let scale = rg.iter().fold(1e-3f64, |s, x| s.max(x.abs()));
            let err = max_abs_diff(&g, &rg) / scale;
            assert!(err < 1e-5, "temperature {t}: relative grad error {err}");
        }
    }

    #[test]
    fn fused_lm_head_gradient_matches_finite_differences() {
        let (hidden, weight, targets, a, b) = inputs(3);
        let t = 0.9;
        let (lp, ent) = plain_head(hidden.as_tensor(), &weight, &targets, t).unwrap();
        let g = loss(&lp, &ent, &a, &b).backward().unwrap();
        let g = v64(g.get(hidden.as_tensor()).expect("hidden grad"));
        let base: Vec<f32> = hidden.as_tensor().flatten_all().unwrap().to_vec1().unwrap();
        let eps = 1e-2f32;
        let eval = |v: Vec<f32>| -> f64 {
            let x = Tensor::from_vec(v, (N, H), &Device::Cpu).unwrap();
            let (lp, ent) = plain_head(&x, &weight, &targets, t).unwrap();
            let l = loss(&lp, &ent, &a, &b).to_dtype(DType::F64).unwrap();
            l.to_scalar::<f64>().unwrap()
        };
        for k in [0usize, 5, H * 64 + 3, H * 149 + 23] {
            let mut up = base.clone();
            up[k] += eps;
            let mut down = base.clone();
            down[k] -= eps;
            let fd = (eval(up) - eval(down)) / (2.0 * eps as f64);
            let rel = (fd - g[k]).abs() / g[k].abs().max(1e-2);
            assert!(rel < 2e-2, "element {k}: fd {fd} vs grad {}", g[k]);
        }
    }

    #[test]
    fn fused_lm_head_second_backward_recomputes_the_same_gradient() {
        let (hidden, weight, targets, a, b) = inputs(4);
        let (lp, ent) = plain_head(hidden.as_tensor(), &weight, &targets, 1.0).unwrap();
        // Logprob-only loss: the first backward uses the stored gradient, the
        // second (stored one consumed) recomputes it from the logits.
        let l = (lp * &a).unwrap().sum_all().unwrap();
        let g1 = v64(l.backward().unwrap().get(hidden.as_tensor()).unwrap());
        let g2 = v64(l.backward().unwrap().get(hidden.as_tensor()).unwrap());
        let scale = g1.iter().fold(1e-3f64, |s, x| s.max(x.abs()));
        assert!(max_abs_diff(&g1, &g2) / scale < 1e-5);
        drop((ent, b));
    }

    #[test]
    fn fused_lm_head_rejects_out_of_range_targets() {
        let (hidden, weight, mut targets, _, _) = inputs(5);
        targets[7] = V as u32;
        assert!(plain_head(hidden.as_tensor(), &weight, &targets, 1.0).is_err());
    }
}
